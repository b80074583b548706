"""Fault tolerance on the GPU kernels, beyond one masked call (issue 4): a dead rank inside a
captured graph, and a replacement that rejoins at update_ep_member and is included again.

Ranks are threads of one process on one GPU (LocalGroup). A dead rank stops launching; it still
joins the host barriers of the test, which stand for the engine's own step boundaries. Every
output is compared with reference.py on the same fresh random inputs, with the dead rank masked.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import mooncake_ep as ep
from mooncake_ep import reference

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

from test_gpu_low_latency import (  # noqa: E402  (after the skip: these need torch)
    FAULT_TIMEOUT_US,
    Case,
    assert_context_healthy,
    assert_rows_equal,
    expert_function,
    poison,
    settle,
    to_numpy,
    to_torch,
)


def fresh_inputs(case: Case, token_counts: list[int], seed: int):
    """Random tokens, distinct experts per token and weights, with fixed token counts per rank."""
    rng = np.random.default_rng(seed)
    xs = [(rng.standard_normal((n, case.hidden), dtype=np.float32) * 3).astype(ml_dtypes.bfloat16)
          for n in token_counts]
    topks = [np.array([rng.choice(case.num_experts, case.num_topk, replace=False) for _ in range(n)],
                      dtype=np.int64).reshape(n, case.num_topk) for n in token_counts]
    weights = [rng.random((n, case.num_topk), dtype=np.float32) for n in token_counts]
    return xs, topks, weights


def expected(case: Case, xs, topks, weights, expert_outs, alive: list[bool]):
    """Per rank ``(dispatch result, combined, mask)`` of reference.py, ranks that did not run masked."""
    actives = [np.ones(case.num_ranks, np.int32)] * case.num_ranks
    ran_xs = [x if ok else None for x, ok in zip(xs, alive)]
    ran_topks = [t if ok else None for t, ok in zip(topks, alive)]
    dispatched = [reference.dispatch(r, ran_xs, ran_topks, actives, case.num_max_tokens, case.num_experts,
                                     use_fp8=case.use_fp8) if alive[r] else None for r in range(case.num_ranks)]
    masks = [d.active_ranks if d is not None else np.ones(case.num_ranks, np.int32) for d in dispatched]
    out = []
    for rank in range(case.num_ranks):
        if not alive[rank]:
            out.append(None)
            continue
        combined, mask = reference.combine(rank, expert_outs, dispatched, topks[rank], weights[rank], masks)
        out.append((dispatched[rank], combined, mask))
    return out


def assert_matches(got, want, what: str) -> None:
    """A step's ``(recv, recv_count, combined, mask)`` against :func:`expected`'s: the received rows and
    scales bit for bit (the expert outputs the expectation is built from are the GPU's, computed from
    those rows), combined_x bit for bit too (test_gpu_low_latency says why), every element written, and
    the mask."""
    recv, count, combined, mask = got
    want_dispatch, want_combined, want_mask = want
    assert_rows_equal(what, recv, count, want_dispatch, use_fp8=True)
    assert np.isfinite(combined.astype(np.float32)).all(), f"{what}: combine left unwritten (NaN) elements"
    np.testing.assert_array_equal(combined.astype(np.float32), want_combined.astype(np.float32),
                                  err_msg=f"{what}: combined_x")
    np.testing.assert_array_equal(mask, want_mask, err_msg=f"{what}: active_ranks")


def test_dead_rank_inside_a_captured_graph():
    """Every replay finds the dead rank again (active_ranks reset to 1 before it), masks it within
    timeout_us, and equals the reference with it masked."""
    case = Case(4, 32, 512, 4, num_max_tokens=16, use_fp8=True, timeout_us=FAULT_TIMEOUT_US)
    dead, num_replays = 1, 3
    token_counts = [16, 9, 0, 12]
    replays = [fresh_inputs(case, token_counts, 2000 + i) for i in range(num_replays)]
    size = ep.Buffer.get_ep_buffer_size_hint(case.num_max_tokens, case.hidden, case.num_ranks, case.num_experts)
    group = ep.LocalGroup(case.num_ranks, devices=[0] * case.num_ranks)

    def run(g):
        buffer = ep.Buffer(g, size)
        if g.rank == dead:
            for _ in range(3 + num_replays + 1):  # the survivors' barriers below
                g.barrier()
            buffer.destroy()
            return None
        active = torch.ones(case.num_ranks, dtype=torch.int32, device="cuda")
        xs, topks, weights = replays[0]
        x, topk, w = to_torch(xs[g.rank]), to_torch(topks[g.rank]), to_torch(weights[g.rank])

        def step():
            recv, count, handle, _, _ = buffer.dispatch(x, topk, active, case.num_max_tokens, case.num_experts,
                                                        timeout_us=case.timeout_us)
            y = expert_function(recv, case, g.rank)
            combined, _, _ = buffer.combine(y, topk, w, active, case.timeout_us, handle)
            return recv, count, y, combined

        settle(g)
        step()  # eager: uploads the layout (outside the capture), and masks the dead rank once
        settle(g)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=torch.cuda.current_stream(), capture_error_mode="thread_local"):
            (q, scales), count, y, combined = step()
        g.barrier()
        outputs = []
        for xs, topks, weights in replays:
            x.copy_(to_torch(xs[g.rank]))
            topk.copy_(to_torch(topks[g.rank]))
            w.copy_(to_torch(weights[g.rank]))
            active.fill_(1)  # the replay itself must time out on the dead rank and mask it
            poison(q, scales, count, y, combined)  # the graph's own results: a replay must rewrite them all
            settle(g)
            graph.replay()
            outputs.append(((to_numpy(q), to_numpy(scales)), to_numpy(count), to_numpy(y), to_numpy(combined),
                            to_numpy(active)))
        g.barrier()
        assert_context_healthy()
        buffer.destroy()
        return outputs

    results = group.spawn(run)
    alive = [r is not None for r in results]
    for index, (xs, topks, weights) in enumerate(replays):
        expert_outs = [results[r][index][2] if alive[r] else None for r in range(case.num_ranks)]
        for rank, want in enumerate(expected(case, xs, topks, weights, expert_outs, alive)):
            if want is not None:
                recv, count, _, combined, mask = results[rank][index]
                assert mask[dead] == 0 and mask.sum() == case.num_ranks - 1, f"replay {index} rank {rank}: {mask}"
                assert_matches((recv, count, combined, mask), want, f"replay {index} rank {rank}")


def test_a_replacement_rejoins_at_update_ep_member_and_is_included():
    """Step 1 with everyone; step 2 with rank 2 stopped (masked); then rank 2 builds a fresh Buffer
    while the survivors call update_ep_member(), which names it; step 3 includes it again."""
    case = Case(4, 32, 1024, 8, num_max_tokens=32, use_fp8=True, timeout_us=FAULT_TIMEOUT_US)
    dead = 2
    token_counts = [32, 20, 31, 7]
    steps = [fresh_inputs(case, token_counts, 3000 + i) for i in range(3)]
    size = ep.Buffer.get_ep_buffer_size_hint(case.num_max_tokens, case.hidden, case.num_ranks, case.num_experts)
    group = ep.LocalGroup(case.num_ranks, devices=[0] * case.num_ranks)

    def one_step(buffer, g, active, inputs):
        xs, topks, weights = inputs
        x, topk, w = to_torch(xs[g.rank]), to_torch(topks[g.rank]), to_torch(weights[g.rank])
        settle(g)
        recv, count, handle, _, _ = buffer.dispatch(x, topk, active, case.num_max_tokens, case.num_experts,
                                                    timeout_us=case.timeout_us)
        settle(g)
        y = expert_function(recv, case, g.rank)
        settle(g)
        combined, _, _ = buffer.combine(y, topk, w, active, case.timeout_us, handle)
        return (to_numpy(recv[0]), to_numpy(recv[1])), to_numpy(count), to_numpy(y), to_numpy(combined), \
            to_numpy(active)

    def run(g):
        buffer = ep.Buffer(g, size)
        active = torch.ones(case.num_ranks, dtype=torch.int32, device="cuda")
        outputs = [one_step(buffer, g, active, steps[0])]
        if g.rank == dead:
            for _ in range(3):  # step 2's barriers: it launches nothing
                g.barrier()
            outputs.append(None)
            # Its process "died": the replacement starts from nothing. The old buffer is dropped
            # without destroy() (no collective: the survivors are not in one); collection frees it.
            del buffer
            buffer = ep.Buffer(g, size)
            replaced = None
        else:
            outputs.append(one_step(buffer, g, active, steps[1]))
            replaced = buffer.update_ep_member()
            active.fill_(1)  # what update_ep_member's answer tells the caller to do
        outputs.append(one_step(buffer, g, active, steps[2]))
        assert_context_healthy()
        buffer.destroy()
        return outputs, replaced

    results = group.spawn(run)
    for rank, (_, replaced) in enumerate(results):
        assert replaced == (None if rank == dead else [dead]), f"rank {rank}: update_ep_member returned {replaced}"
    for index, (xs, topks, weights) in enumerate(steps):
        alive = [index != 1 or rank != dead for rank in range(case.num_ranks)]
        expert_outs = [results[r][0][index][2] if alive[r] else None for r in range(case.num_ranks)]
        for rank, want in enumerate(expected(case, xs, topks, weights, expert_outs, alive)):
            if want is None:
                continue
            recv, count, _, combined, mask = results[rank][0][index]
            assert_matches((recv, count, combined, mask), want, f"step {index + 1} rank {rank}")
            assert mask.sum() == case.num_ranks - (index == 1), f"step {index + 1} rank {rank}: {mask}"
