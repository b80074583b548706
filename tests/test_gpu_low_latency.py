"""GPU kernels against reference.py: in-process ranks on one GPU, every element written checked.

Each case draws fresh random tokens, poisons every output (NaN bf16 rows, 0xFF fp8 bytes, -1 counts)
and compares: recv_count exactly, the valid rows of recv_x bit for bit (bf16, fp8 bytes and scales),
combine within one bf16 rounding of the reference (the reference rounds once from fp32, as the kernel
does; the tolerance covers a different summation order of the renormalisation factor).
"""

from __future__ import annotations

import dataclasses
import gc
import os
import struct
import time

import ml_dtypes
import numpy as np
import pytest

import mooncake_ep as ep
from mooncake_ep import layout, reference

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# A bug shows up as a masked rank after 10 s, never as a hang. Under compute-sanitizer a rank can
# reach its peer's wait later than that (racecheck instruments every shared access), so a run under
# the tool raises the timeout through the environment, as scripts/gpu_check.sh's sanitizer stage
# does (tests/_ep_processes.py's ranks take the same variable).
TIMEOUT_US = int(os.environ.get("MOONCAKE_EP_TEST_TIMEOUT_US", 10_000_000))
# combined_x is compared bit for bit: ll_combine.cu adds w_k * y_k with fmaf in k order (renormalize's
# sums in warp_sum's order) and rounds to bf16 once, and reference.combine does the same on the same
# expert outputs (the GPU's). A tolerance of one bf16 rounding let a dropped expert term smaller than it
# through: 3.5% of this grid's (token, k) terms.


@dataclasses.dataclass
class Case:
    num_ranks: int
    num_experts: int
    hidden: int
    num_topk: int
    num_max_tokens: int = 32
    use_fp8: bool = False
    round_scale: bool = False
    use_ue8m0: bool = False
    # sync | async | hook | mixed (even ranks hook, odd ranks sync: both kinds of launch in one call,
    # each rank's send half and receive half meeting peers of the other kind)
    mode: str = "sync"
    zero_copy: bool = False
    # uniform | skewed | repeated (some tokens name one expert twice) | past_t (rank 0 sends expert 0
    # more than T copies, naming it twice in tokens: copies past the first T are dropped, as -1)
    routing: str = "uniform"
    renormalize: bool = False
    # Weights of every token with K named experts cancel pairwise (w_2j+1 = -w_2j, K even): their
    # sum is 0, which renormalize keeps as is (live weights summing to 0 for a total of 0).
    cancelling_weights: bool = False
    dead_rank: int | None = None  # a rank that stops launching at dead_phase
    dead_phase: str = "dispatch"  # dispatch: it never launches; combine: it dispatches, never combines
    # Combine copies expert outputs into the workspace first, as transports whose peers cannot read
    # the caller's memory do (in-process ranks otherwise read them where they are).
    copy_source: bool = False
    timeout_us: int = TIMEOUT_US
    seed: int = 0
    topk_dtype: type = np.int64  # the ids' width: both kernels read int64 and int32
    # Each rank's own num_topk (num_topk is then the largest): the API lets ranks differ, and a
    # receiver must find a source's tokens without knowing its K.
    rank_topk: tuple[int, ...] | None = None
    # fp8 scales given as out=: "swapped", DeepEP's layout (column-major in the last two dimensions,
    # as the calls make them), or "row-major"; the kernels write either, as the strides say.
    scales_layout: str = "swapped"

    def topk_of(self, rank: int) -> int:
        return self.rank_topk[rank] if self.rank_topk is not None else self.num_topk


def make_inputs(case: Case):
    rng = np.random.default_rng(case.seed)
    xs, topks, weights = [], [], []
    for rank in range(case.num_ranks):
        # t < T on most ranks, t = 0 on one when there are several.
        num_tokens = case.num_max_tokens if rank == 0 else int(rng.integers(0, case.num_max_tokens + 1))
        if case.num_ranks > 2 and rank == case.num_ranks - 1:
            num_tokens = 0
        x = rng.standard_normal((num_tokens, case.hidden), dtype=np.float32) * 3
        x[:, -1] = rank + 1  # the last channel names the source rank, exact in bf16
        num_topk = case.topk_of(rank)
        pool = case.num_experts
        if case.routing == "skewed":  # every token to the experts of rank 0 (an incast)
            pool = max(num_topk, case.num_experts // case.num_ranks)
        topk = np.stack([rng.choice(pool, num_topk, replace=False) for _ in range(num_tokens)]) if num_tokens \
            else np.zeros((0, num_topk), dtype=np.int64)
        topk = topk.astype(np.int64)
        if case.routing == "repeated" and num_tokens:
            # Legal but no router's choice: the kernels rank such chunks another way.
            repeat = rng.random(num_tokens) < 0.25
            topk[repeat, 1] = topk[repeat, 0]
        if num_tokens:
            topk[rng.random(topk.shape) < 0.1] = -1
        if case.routing == "past_t" and rank == 0:
            # Expert 0 in every token, twice in the first chunk of 128 that the kernel ranks (that
            # chunk is ranked serially, the later ones, each expert once per token, by bitmap, so
            # with T = 300 the count passes T inside a bitmap chunk: 256 after the first, 384).
            topk[topk == 0] = -1
            topk[:, 0] = 0
            topk[:128, 1] = 0
        xs.append(x.astype(ml_dtypes.bfloat16))
        topks.append(topk.astype(case.topk_dtype))
        token_weights = rng.random((num_tokens, num_topk), dtype=np.float32)
        if case.cancelling_weights:
            assert num_topk % 2 == 0, "weights cancel in pairs"
            whole = (topk >= 0).all(axis=1)
            token_weights[whole, 1::2] = -token_weights[whole, 0::2]
        weights.append(token_weights)
    return xs, topks, weights


def to_torch(array: np.ndarray, device="cuda"):
    if array.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(array.view(np.uint16)).view(torch.bfloat16).to(device)
    return torch.from_numpy(array).to(device)


# How often wait_idle looks at its event: a fraction of the shortest call.
IDLE_POLL_S = 50e-6


def wait_idle() -> None:
    """Return once the current stream has run all its work, by polling an event.

    A rank thread must not block inside CUDA while its kernel may still wait for a peer that has
    not launched yet: a copy to pageable host memory (``tensor.cpu()``) that waits behind such a
    kernel holds up the CUDA calls of every other thread of the process, the peer's launch
    included, until the kernel times out (docs/performance.md, "The async failure, found at
    last"). Polling ``cudaEventQuery`` never blocks; after it, copies find the stream idle.
    """
    event = torch.cuda.Event()
    event.record()
    poll_until(event.query)


def poll_until(done) -> None:
    """Sleep in steps of IDLE_POLL_S until ``done()`` says so (an event query: it never blocks)."""
    while not done():
        time.sleep(IDLE_POLL_S)


def to_numpy(tensor) -> np.ndarray:
    """A host copy of a tensor of the current stream, taken once that stream is idle (wait_idle)."""
    wait_idle()
    tensor = tensor.detach().cpu()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.uint16).numpy().view(ml_dtypes.bfloat16)
    if tensor.dtype == torch.float8_e4m3fn:
        return tensor.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)
    return tensor.numpy()


def expert_function(recv: np.ndarray | tuple, case: Case, rank: int):
    """The 'experts' of the test, in torch on the GPU: y = dequant(x) * (global expert id + 1) / E."""
    if case.use_fp8:
        q, scales = recv
        values = q.float().reshape(q.shape[0], q.shape[1], -1, 128)
        if case.use_ue8m0:
            exponents = scales.contiguous().view(torch.uint8)[..., : case.hidden // 128].to(torch.int32)
            scale = (exponents << 23).view(torch.float32)
        else:
            scale = scales
        values = (values * scale[..., None]).reshape(q.shape)
    else:
        values = recv.float()
    num_local = case.num_experts // case.num_ranks
    factor = (torch.arange(num_local, device=values.device, dtype=torch.float32) + rank * num_local + 1) / case.num_experts
    return (values * factor[:, None, None]).to(torch.bfloat16)


def settle(group) -> None:
    """Finish this rank's stream, collect garbage, then wait for every rank to get here.

    In-process ranks share the GPU and the interpreter. A device allocation (torch growing its pool)
    can wait for kernels that are waiting for this very rank, and a full garbage collection stops
    every thread for tens of ms, longer than the fault cases' timeout: allocate and collect only
    while no rank has a kernel waiting. One collection serves every thread, and after it the next
    full one is tens of thousands of allocations away.
    """
    wait_idle()
    if group.rank == 0:
        gc.collect()
    group.barrier()


def finish_call(event, hook) -> None:
    """The receive half of a hook-mode call, then the caller's stream joined to an async call's event."""
    if hook is not None:
        hook()
    event.current_stream_wait()


def run_rank(group, case: Case, xs, topks, weights, size):
    rank = group.rank
    buffer = ep.Buffer(group, size)
    if case.copy_source:
        buffer._cuda.direct_peer_reads = False
    dead = rank == case.dead_rank
    if dead and case.dead_phase == "dispatch":
        for _ in range(3):  # never launches; it still joins the host barriers of the others
            group.barrier()
        buffer.destroy()
        return None
    stream = torch.cuda.current_stream()
    assert stream.cuda_stream == group.stream_ptr, "each rank runs on its own stream"
    active = torch.ones(case.num_ranks, dtype=torch.int32, device="cuda")
    x, topk, w = to_torch(xs[rank]), to_torch(topks[rank]), to_torch(weights[rank])
    recv_out, recv_count, combined = poisoned_outputs(case, x.shape[0])
    settle(group)
    flags = dict(async_finish=case.mode == "async",
                 return_recv_hook=case.mode == "hook" or (case.mode == "mixed" and rank % 2 == 0))
    recv, count, handle, event, hook = buffer.dispatch(
        x, topk, active, case.num_max_tokens, case.num_experts, timeout_us=case.timeout_us, use_fp8=case.use_fp8,
        round_scale=case.round_scale, use_ue8m0=case.use_ue8m0, out=(recv_out, recv_count), **flags)
    finish_call(event, hook)
    active_after_dispatch = to_numpy(active)
    settle(group)
    y = expert_function(recv, case, rank)
    if case.zero_copy:
        buffer.get_next_combine_buffer(handle).copy_(y)
        expert_out = None
    else:
        expert_out = y
    settle(group)
    recv_np = tuple(to_numpy(t) for t in recv) if case.use_fp8 else to_numpy(recv)
    result = dict(recv=recv_np, count=to_numpy(count), active_after_dispatch=active_after_dispatch)
    if dead:  # dispatched, then stopped: never answers combine
        buffer.destroy()
        return dict(result, y=None, combined=None, active=active_after_dispatch)
    combined, event, hook = buffer.combine(expert_out, topk, w, active, case.timeout_us, handle, zero_copy=case.zero_copy,
                                           out=combined, renormalize=case.renormalize, **flags)
    finish_call(event, hook)
    result.update(y=to_numpy(y), combined=to_numpy(combined), active=to_numpy(active))
    if case.dead_rank is not None:
        assert_context_healthy()
    buffer.destroy()  # a barrier first: nobody frees its workspace while a peer may still read it
    return result


def assert_context_healthy() -> None:
    """After a masked peer: a new allocation and a kernel on it work, and the result is right."""
    values = torch.arange(1 << 16, device="cuda", dtype=torch.float64)
    assert float((values * 2).sum()) == float((1 << 16) * ((1 << 16) - 1)), "the CUDA context is broken"
    torch.cuda.synchronize()


def assert_rows_equal(where: str, recv, count: np.ndarray, expected, use_fp8: bool) -> None:
    """A dispatch's results (recv: rows, or (rows, scales) with fp8) against reference.dispatch's: the
    counts, and every valid row bit for bit with its scales."""
    np.testing.assert_array_equal(count, expected.recv_count, err_msg=f"{where}: recv_count")
    rows = recv[0] if use_fp8 else recv
    for local_expert, num_rows in enumerate(expected.recv_count):
        np.testing.assert_array_equal(rows[local_expert, :num_rows].view(np.uint8),
                                      expected.recv_x[local_expert, :num_rows].view(np.uint8),
                                      err_msg=f"{where}: local expert {local_expert} recv_x rows")
        if use_fp8:
            np.testing.assert_array_equal(recv[1][local_expert, :num_rows], expected.recv_scales[local_expert, :num_rows],
                                          err_msg=f"{where}: local expert {local_expert} scales")


def assert_dispatch_equal(rank: int, recv, count: np.ndarray, active: np.ndarray, expected, use_fp8: bool) -> None:
    """:func:`assert_rows_equal`, and the mask after the call."""
    assert_rows_equal(f"rank {rank}", recv, count, expected, use_fp8)
    np.testing.assert_array_equal(active, expected.active_ranks, err_msg=f"rank {rank} active_ranks after dispatch")


def poisoned_outputs(case: Case, num_tokens: int):
    """``(recv_x, recv_count, combined_x)`` for a rank's dispatch and combine with out=, poisoned
    (:func:`poison`); recv_x is ``(x_fp8, scales)`` with fp8."""
    num_local = case.num_experts // case.num_ranks
    rows = case.num_ranks * case.num_max_tokens
    if case.use_fp8:
        columns = reference.num_scale_columns(case.hidden, case.use_ue8m0)
        scale_dtype = torch.int32 if case.use_ue8m0 else torch.float32
        if case.scales_layout == "swapped":
            scales = torch.empty((num_local, columns, rows), dtype=scale_dtype, device="cuda").transpose(1, 2)
        else:
            scales = torch.empty((num_local, rows, columns), dtype=scale_dtype, device="cuda")
        recv_out = (torch.empty((num_local, rows, case.hidden), dtype=torch.float8_e4m3fn, device="cuda"), scales)
    else:
        recv_out = torch.empty((num_local, rows, case.hidden), dtype=torch.bfloat16, device="cuda")
    recv_count = torch.empty((num_local,), dtype=torch.int32, device="cuda")
    combined = torch.empty((num_tokens, case.hidden), dtype=torch.bfloat16, device="cuda")
    poison(*(recv_out if case.use_fp8 else (recv_out,)), recv_count, combined)
    return recv_out, recv_count, combined


def poison(*tensors) -> None:
    """Fill results before a call or replay, so that an element it leaves unwritten shows: NaN for
    floats (0xFF bytes, NaN, for fp8), -1 for integers."""
    for tensor in tensors:
        if tensor.dtype == torch.float8_e4m3fn:
            tensor.view(torch.uint8).fill_(0xFF)
        elif tensor.dtype.is_floating_point:
            tensor.fill_(float("nan"))
        else:
            tensor.fill_(-1)


def drop_copies_past(topk: np.ndarray, num_max_tokens: int, num_experts: int) -> np.ndarray:
    """``topk`` with each expert's copies past its first ``num_max_tokens`` in (token, k) order set to
    -1: what the kernels keep of ids that send one expert more copies than recv_x has rows for."""
    kept = topk.copy()
    seen = np.zeros(num_experts, np.int64)
    for index in np.ndindex(*kept.shape):
        expert = int(kept[index])
        if 0 <= expert < num_experts:
            seen[expert] += 1
            if seen[expert] > num_max_tokens:
                kept[index] = -1
    return kept


def check_case(case: Case):
    xs, topks, weights = make_inputs(case)
    size = ep.Buffer.get_ep_buffer_size_hint(case.num_max_tokens, case.hidden, case.num_ranks, case.num_experts)
    group = ep.LocalGroup(case.num_ranks, devices=[0] * case.num_ranks)
    results = group.spawn(run_rank, case, xs, topks, weights, size)

    dispatched_ok = [r is not None for r in results]  # ranks that ran dispatch
    ref_xs = [x if ok else None for x, ok in zip(xs, dispatched_ok)]
    # Device ids are not checked by the host: a rank's copies past T to one expert are dropped.
    ref_topks = [drop_copies_past(t, case.num_max_tokens, case.num_experts) if ok else None
                 for t, ok in zip(topks, dispatched_ok)]
    actives = [np.ones(case.num_ranks, np.int32) for _ in range(case.num_ranks)]
    dispatched = [
        reference.dispatch(rank, ref_xs, ref_topks, actives, case.num_max_tokens, case.num_experts,
                           use_fp8=case.use_fp8, round_scale=case.round_scale, use_ue8m0=case.use_ue8m0)
        if ok else None
        for rank, ok in enumerate(dispatched_ok)
    ]
    for rank, (result, expected) in enumerate(zip(results, dispatched)):
        if result is not None:
            assert_dispatch_equal(rank, result["recv"], result["count"], result["active_after_dispatch"], expected,
                                  case.use_fp8)

    # None for a rank that never combined: its experts are left out, and it is masked.
    expert_outs = [r["y"] if r is not None else None for r in results]
    masks = [r["active_after_dispatch"] if r is not None else np.ones(case.num_ranks, np.int32) for r in results]
    for rank, result in enumerate(results):
        if result is None or result["combined"] is None:
            continue
        # The dropped copies are -1 entries to combine as well (renormalize leaves them out of the total).
        want, want_mask = reference.combine(rank, expert_outs, dispatched, ref_topks[rank], weights[rank], masks,
                                            renormalize=case.renormalize)
        got = result["combined"].astype(np.float32)
        want = want.astype(np.float32)
        assert np.isfinite(got).all(), f"rank {rank}: combine left unwritten (NaN) elements"
        np.testing.assert_array_equal(got, want, err_msg=f"rank {rank} combined_x")
        np.testing.assert_array_equal(result["active"], want_mask, err_msg=f"rank {rank} active_ranks after combine")
        if case.dead_rank is not None:  # exactly the dead rank is masked
            expected_mask = np.ones(case.num_ranks, np.int32)
            expected_mask[case.dead_rank] = 0
            np.testing.assert_array_equal(result["active"], expected_mask, err_msg=f"rank {rank} final mask")


GRID = [
    Case(1, 8, 1024, 4),
    Case(2, 8, 1152, 1),
    Case(2, 64, 2048, 8, use_fp8=True),
    Case(4, 64, 2816, 4, use_fp8=True, round_scale=True, scales_layout="row-major"),
    Case(4, 256, 4096, 16, use_fp8=True, round_scale=True, use_ue8m0=True),
    Case(4, 256, 4096, 16, use_fp8=True, round_scale=True, use_ue8m0=True, scales_layout="row-major"),
    Case(8, 256, 7168, 8, num_max_tokens=128, use_fp8=True),
    Case(8, 512, 8192, 16, num_max_tokens=16),
    Case(8, 64, 3584, 8, routing="skewed", use_fp8=True),
    Case(4, 512, 1024, 16, routing="skewed"),
    Case(4, 64, 1024, 4, num_max_tokens=300, routing="repeated", use_fp8=True),
    Case(2, 8, 1024, 4, num_max_tokens=64, routing="past_t", use_fp8=True, renormalize=True),
    Case(2, 8, 1024, 4, num_max_tokens=300, routing="past_t"),
    Case(2, 16, 1024, 8, num_max_tokens=300),
    Case(8, 8, 7168, 1, num_max_tokens=64),
]
MODES = [
    Case(4, 32, 1024, 4, mode="async", use_fp8=True),
    Case(4, 32, 1024, 4, mode="hook", use_fp8=True, scales_layout="row-major"),
    Case(4, 32, 1024, 4, mode="hook", zero_copy=True),
    Case(4, 32, 1152, 4, zero_copy=True, use_fp8=True),
    Case(4, 32, 1024, 4, renormalize=True),
    Case(4, 32, 1024, 4, renormalize=True, cancelling_weights=True),
    Case(4, 32, 1024, 4, copy_source=True),
    Case(4, 32, 2048, 8, mode="hook", copy_source=True, use_fp8=True),
    Case(4, 32, 1024, 4, mode="mixed"),
    Case(4, 32, 1024, 8, use_fp8=True, topk_dtype=np.int32),
    # 9 scale blocks a row: the last UE8M0 word of each row is three quarters padding.
    Case(4, 32, 1152, 4, mode="mixed", use_fp8=True, round_scale=True, use_ue8m0=True),
    Case(3, 24, 1152, 4, use_fp8=True, round_scale=True, use_ue8m0=True, routing="skewed", scales_layout="row-major"),
    # One rank in the process: the sanitizer stage of scripts/gpu_check.sh runs the R1 cases in-process
    # (the kernels ordered at GPU scope, which ranks in processes of their own never build).
    Case(1, 8, 1152, 4, mode="hook", use_fp8=True, round_scale=True, use_ue8m0=True),
    # Ranks with different top-k: rank 1 routes each token to one expert, rank 2 to 16.
    Case(4, 64, 2048, 16, rank_topk=(8, 1, 16, 4), use_fp8=True),
    Case(3, 24, 1024, 9, rank_topk=(4, 9, 2), mode="hook", renormalize=True),
]
FAULT_TIMEOUT_US = 50_000  # the survivors' calls return this long after the rank stopped; well above the
# skew of the ranks' launches (threads of one interpreter: a GIL switch interval is 5 ms)
# A rank that stops at each phase, in each mode (issue 4).
FAULTS = [
    Case(4, 32, 1024, 4, dead_rank=dead_rank, dead_phase=phase, mode=mode, use_fp8=use_fp8, timeout_us=FAULT_TIMEOUT_US)
    for phase, mode, dead_rank, use_fp8 in (
        ("dispatch", "sync", 2, True), ("dispatch", "async", 1, False), ("dispatch", "hook", 0, False),
        ("combine", "sync", 3, True), ("combine", "async", 0, True), ("combine", "hook", 2, False))
]


def _case_id(case: Case) -> str:
    topk = case.num_topk if case.rank_topk is None else ",".join(map(str, case.rank_topk))
    parts = [f"R{case.num_ranks}", f"E{case.num_experts}", f"H{case.hidden}", f"K{topk}", f"T{case.num_max_tokens}",
             "fp8" if case.use_fp8 else "bf16", case.mode, case.routing]
    parts += [name for name in ("round_scale", "use_ue8m0", "zero_copy", "renormalize", "cancelling_weights",
                                "copy_source")
              if getattr(case, name)]
    if case.topk_dtype != np.int64:
        parts.append(np.dtype(case.topk_dtype).name)
    if case.use_fp8 and case.scales_layout != "swapped":
        parts.append(f"{case.scales_layout}-scales")
    if case.dead_rank is not None:
        parts.append(f"dead{case.dead_rank}-at-{case.dead_phase}")
    return "-".join(parts)


@pytest.mark.parametrize("case", GRID + MODES, ids=_case_id)
def test_matches_reference(case):
    check_case(case)


@pytest.mark.parametrize("case", FAULTS, ids=_case_id)
def test_dead_rank_is_masked(case):
    """A rank that stops: the survivors time out on it, mask exactly it, equal the reference with it
    masked, and their CUDA context still works."""
    check_case(case)


@pytest.mark.parametrize("mode", ["sync", "async", "hook"])
def test_a_rank_waits_on_itself_past_a_short_timeout(mode):
    """timeout_us=0 gives up at once on any flag not already there. A rank's own flags and counts come
    from its own blocks, which are resident with it, so it waits for them at least 100 ms whatever
    timeout_us says: one rank alone masks nothing and equals the reference (it had masked itself, its
    own routing flag a few microseconds late)."""
    check_case(Case(1, 8, 1024, 4, num_max_tokens=128, use_fp8=True, mode=mode, timeout_us=0))


@pytest.mark.parametrize("scenario", ["mask", "readmit", "self"])
def test_a_receive_hook_reads_the_mask_when_it_runs(scenario):
    """As test_buffer_cpu.py's reference case of the same name: the receive half that hook() launches
    reads active_ranks then. mask: the peer masked between the halves delivers nothing; readmit: rank 0
    masked rank 1 at the call (its send half skipped it) and re-admitted it before the hook, which then
    receives rank 1's rows, while rank 1 times out on rank 0; self: each rank masked itself at the call,
    so its send half never signalled it, and its hook gives up on itself at once, even with
    timeout_us=-1: the mask, read when the hook runs, ends a wait on itself as on any peer."""
    num_ranks, num_experts, num_tokens, hidden = 2, 4, 2, 128

    def rank_fn(group):
        rank, peer = group.rank, 1 - group.rank
        buffer = ep.Buffer(group, ep.Buffer.get_ep_buffer_size_hint(num_tokens, hidden, num_ranks, num_experts))
        x = torch.full((num_tokens, hidden), rank + 1, dtype=torch.bfloat16, device="cuda")
        topk = torch.tensor([[0, 2], [1, 3]], device="cuda")  # each token to one expert on each rank
        active = torch.ones(num_ranks, dtype=torch.int32, device="cuda")
        masked_at_call = {"mask": None, "readmit": peer if rank == 0 else None, "self": rank}[scenario]
        if masked_at_call is not None:
            active[masked_at_call] = 0
        settle(group)
        # readmit: rank 1 waits for the routing flag rank 0's send half never sent it
        timeout_us = FAULT_TIMEOUT_US if scenario == "readmit" else -1
        _, count, _, _, hook = buffer.dispatch(x, topk, active, num_tokens, num_experts, timeout_us=timeout_us,
                                               use_fp8=False, return_recv_hook=True)
        if scenario == "mask":
            active[peer] = 0
        elif masked_at_call is not None:
            active[masked_at_call] = 1
        hook()
        result = to_numpy(count).tolist(), to_numpy(active).tolist()
        buffer.destroy()
        return result

    expected = {"mask": [([1, 1], [1, 0]), ([1, 1], [0, 1])],
                "readmit": [([2, 2], [1, 1]), ([1, 1], [0, 1])],
                "self": [([1, 1], [0, 1]), ([1, 1], [1, 0])]}[scenario]
    assert ep.LocalGroup(num_ranks, devices=[0] * num_ranks).spawn(rank_fn) == expected
    assert_context_healthy()


@pytest.mark.parametrize("use_fp8", [False, True], ids=["bf16", "fp8"])
def test_a_source_masked_only_by_its_receiver_delivers_nothing(use_fp8):
    """Rank 0 passes rank 2 as masked; rank 2 does not know and sends to rank 0 anyway, flag and all.
    Rank 0 must take none of its rows however early that flag lands (the mask is read before the
    flag), and rank 2, which rank 0 never signals, times out on rank 0: the reference's view."""
    case = Case(4, 32, 1024, 4, use_fp8=use_fp8, timeout_us=FAULT_TIMEOUT_US, seed=3)
    xs, topks, _ = make_inputs(case)
    actives = [np.array(row, np.int32) for row in ([1, 1, 0, 1], [1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1])]
    to_rank_0 = (topks[2] >= 0) & (topks[2] < case.num_experts // case.num_ranks)
    assert to_rank_0.any(), "the seed must give rank 2 tokens for rank 0's experts"
    size = ep.Buffer.get_ep_buffer_size_hint(case.num_max_tokens, case.hidden, case.num_ranks, case.num_experts)

    def run(group):
        buffer = ep.Buffer(group, size)
        x, topk, active = (to_torch(a[group.rank]) for a in (xs, topks, actives))  # before the settle (settle)
        recv_out, recv_count, _ = poisoned_outputs(case, xs[group.rank].shape[0])
        settle(group)
        recv, count, _, _, _ = buffer.dispatch(x, topk, active, case.num_max_tokens, case.num_experts,
                                               timeout_us=case.timeout_us, use_fp8=use_fp8, out=(recv_out, recv_count))
        result = dict(recv=tuple(to_numpy(t) for t in recv) if use_fp8 else to_numpy(recv), count=to_numpy(count),
                      active=to_numpy(active))
        buffer.destroy()
        return result

    results = ep.LocalGroup(case.num_ranks, devices=[0] * case.num_ranks).spawn(run)
    for rank, got in enumerate(results):
        want = reference.dispatch(rank, xs, topks, actives, case.num_max_tokens, case.num_experts, use_fp8=use_fp8)
        assert_dispatch_equal(rank, got["recv"], got["count"], got["active"], want, use_fp8)
    assert results[2]["active"][0] == 0, "rank 2 timed out on rank 0, which never signalled it"


@pytest.mark.parametrize("round_scale", [False, True], ids=["plain-scale", "round_scale"])
def test_fp8_blocks_holding_inf_or_nan_quantise_as_the_reference(round_scale):
    """A block with +inf, one with -inf, one with a NaN, one with a NaN of sign bit 1: bit for bit the
    reference (an inf block's rounded scale is inf; its multiplier had wrapped to -inf and flipped every
    finite value's sign; a NaN stays in its channel, the block scaled by the rest, as the canonical
    e4m3 NaN 0x7F whatever its sign: the reference wrote 0xFF for -NaN, helper-115)."""
    num_tokens, hidden, num_experts = 4, 1024, 8
    rng = np.random.default_rng(9)
    x = rng.standard_normal((num_tokens, hidden), dtype=np.float32)
    x[0, 3], x[1, 130], x[2, 260], x[3, 390] = np.inf, -np.inf, np.nan, -np.nan
    x = x.astype(ml_dtypes.bfloat16)
    assert x.view(np.uint16)[3, 390] == 0xFFC0  # the sign bit survives the bf16 cast
    topk = np.stack([rng.choice(num_experts, 2, replace=False) for _ in range(num_tokens)]).astype(np.int64)

    def run(group):
        buffer = ep.Buffer(group, ep.Buffer.get_ep_buffer_size_hint(num_tokens, hidden, 1, num_experts))
        recv, count, _, _, _ = buffer.dispatch(to_torch(x), to_torch(topk), torch.ones(1, dtype=torch.int32,
                                               device="cuda"), num_tokens, num_experts, use_fp8=True,
                                               round_scale=round_scale)
        result = (tuple(to_numpy(t) for t in recv), to_numpy(count))
        buffer.destroy()
        return result

    (recv, count), = ep.LocalGroup(1, devices=[0]).spawn(run)
    want = reference.dispatch(0, [x], [topk], [np.ones(1, np.int32)], num_tokens, num_experts, use_fp8=True,
                              round_scale=round_scale)
    np.testing.assert_array_equal(count, want.recv_count)
    for e, n in enumerate(want.recv_count):
        # Every byte, NaN channels (inf * 0, a NaN input) included
        np.testing.assert_array_equal(recv[0][e, :n].view(np.uint8), want.recv_x[e, :n].view(np.uint8),
                                      err_msg=f"expert {e}: fp8 bytes")
        np.testing.assert_array_equal(recv[1][e, :n], want.recv_scales[e, :n], err_msg=f"expert {e}: scales")


def test_a_combine_that_finds_alive_a_rank_its_dispatch_masked_adds_nothing_of_it():
    """Rank 0's dispatch masks rank 2 (and rank 2, never signalled, masks rank 0); then every rank
    combines with a fresh all-ones mask, so rank 0 and rank 2 find each other live. Neither holds rows
    of the other, so neither may add any (the kernel had read rows at first + slot that the dispatch
    never delivered, other tokens' rows); the reference adds nothing for them."""
    case = Case(4, 32, 1024, 4, timeout_us=FAULT_TIMEOUT_US, seed=3)
    xs, topks, weights = make_inputs(case)
    dispatch_actives = [np.array(row, np.int32) for row in ([1, 1, 0, 1], [1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1])]
    size = ep.Buffer.get_ep_buffer_size_hint(case.num_max_tokens, case.hidden, case.num_ranks, case.num_experts)

    def run(group):
        rank = group.rank
        buffer = ep.Buffer(group, size)
        # Every device array before the settle: an allocation after it can wait behind the peers'
        # kernels, already waiting on this rank, past the fault timeout, and a healthy rank is masked.
        x, topk, weight = (to_torch(a[rank]) for a in (xs, topks, weights))
        dispatch_active = to_torch(dispatch_actives[rank])
        recv_out, recv_count, combined = poisoned_outputs(case, xs[rank].shape[0])
        settle(group)
        recv, count, handle, _, _ = buffer.dispatch(x, topk, dispatch_active, case.num_max_tokens, case.num_experts,
                                                    timeout_us=case.timeout_us, use_fp8=False,
                                                    out=(recv_out, recv_count))
        wait_idle()
        y = expert_function(recv, case, rank)
        active = torch.ones(case.num_ranks, dtype=torch.int32, device="cuda")
        settle(group)
        buffer.combine(y, topk, weight, active, case.timeout_us, handle, out=combined)
        result = dict(y=to_numpy(y), combined=to_numpy(combined), active=to_numpy(active),
                      dispatch_active=to_numpy(dispatch_active))
        buffer.destroy()
        return result

    results = ep.LocalGroup(case.num_ranks, devices=[0] * case.num_ranks).spawn(run)
    dispatched = [reference.dispatch(rank, xs, topks, dispatch_actives, case.num_max_tokens, case.num_experts)
                  for rank in range(case.num_ranks)]
    assert dispatched[2].active_ranks[0] == 0, "rank 2 timed out on rank 0 in the dispatch"
    for rank, got in enumerate(results):  # else the reference below combines another dispatch than the kernels'
        np.testing.assert_array_equal(got["dispatch_active"], dispatched[rank].active_ranks,
                                      err_msg=f"rank {rank}: the dispatch masked a rank the test kept live")
    combine_actives = [np.ones(case.num_ranks, np.int32)] * case.num_ranks
    expert_outs = [r["y"] for r in results]
    for rank, got in enumerate(results):
        want, want_mask = reference.combine(rank, expert_outs, dispatched, topks[rank], weights[rank], combine_actives)
        assert np.isfinite(got["combined"].astype(np.float32)).all(), f"rank {rank}: unwritten elements"
        np.testing.assert_array_equal(got["combined"].astype(np.float32), want.astype(np.float32),
                                      err_msg=f"rank {rank} combined_x")
        np.testing.assert_array_equal(got["active"], want_mask, err_msg=f"rank {rank} active_ranks after combine")


@pytest.mark.parametrize("use_fp8", [False, True], ids=["bf16", "fp8"])
def test_a_source_whose_staging_never_lands_is_masked_and_its_rows_are_zero(use_fp8):
    """Rank 1's routing flag arrives, but the staging count it announces is never reached: the test
    raises rank 1's recorded target by hand, standing for a rank that stopped between the two. Every
    rank waits for it until its timeout (rank 1, which receives from itself, 100 ms: the least a rank
    waits on itself), masks it, and
    writes its rows, already counted, as zeros; every other row, and every count, is the reference's.
    That dispatch's combine, with every rank live again (a fresh mask) and random expert outputs,
    adds nothing to rank 1's tokens from those zero rows: the reference's combine of a dispatch that
    had no rows from rank 1, and every other token as the reference's. Then the three others
    dispatch and combine again without rank 1, and equal the reference."""
    case = Case(4, 32, 1024, 4, use_fp8=use_fp8, timeout_us=FAULT_TIMEOUT_US, seed=6)  # rank 1: 26 tokens
    stalled = 1
    xs, topks, weights = make_inputs(case)
    assert (topks[stalled] >= 0).any(), "the seed must give rank 1 copies to send"
    size = ep.Buffer.get_ep_buffer_size_hint(case.num_max_tokens, case.hidden, case.num_ranks, case.num_experts)
    # Expert outputs of the first dispatch: random on every row, the zero rows' too (an expert's
    # output of a zero row is anything, a bias say), so that a combine reading them shows.
    rng = np.random.default_rng(16)
    recv_shape = (case.num_experts // case.num_ranks, case.num_ranks * case.num_max_tokens, case.hidden)
    first_ys = [rng.standard_normal(recv_shape, np.float32).astype(ml_dtypes.bfloat16) for _ in range(case.num_ranks)]

    def dispatched(buffer, x, topk, active, outputs):
        recv_out, recv_count, _ = outputs  # poisoned: the zeros of the stalled rank's rows are the kernel's
        recv, count, handle, _, _ = buffer.dispatch(x, topk, active, case.num_max_tokens, case.num_experts,
                                                    timeout_us=case.timeout_us, use_fp8=use_fp8,
                                                    out=(recv_out, recv_count))
        return recv, dict(recv=tuple(to_numpy(t) for t in recv) if use_fp8 else to_numpy(recv), count=to_numpy(count),
                          active=to_numpy(active)), handle

    def run(group):
        buffer = ep.Buffer(group, size)
        if group.rank == stalled:
            for parity in range(layout.NUM_PARITIES):
                offset = layout.state_offset("dispatch_staged_target", parity)
                (target,) = struct.unpack("<I", buffer._cuda.workspace.peek(offset, 4))
                buffer._cuda.workspace.write(offset, struct.pack("<I", (target + (1 << 20)) % (1 << 32)))
        active = torch.ones(case.num_ranks, dtype=torch.int32, device="cuda")
        num_tokens = xs[group.rank].shape[0]
        first_outputs, second_outputs = poisoned_outputs(case, num_tokens), poisoned_outputs(case, num_tokens)
        # The calls' inputs before the settle: an allocation after it could wait behind the peers'
        # kernels, already waiting on this rank, past the fault timeout (settle says why).
        live_again = torch.ones(case.num_ranks, dtype=torch.int32, device="cuda")
        x, first_y, topk, weight = (to_torch(a[group.rank]) for a in (xs, first_ys, topks, weights))
        settle(group)
        _, first, first_handle = dispatched(buffer, x, topk, active, first_outputs)
        settle(group)
        combined, _, _ = buffer.combine(first_y, topk, weight, live_again, case.timeout_us, first_handle,
                                        out=first_outputs[2])
        first.update(combined=to_numpy(combined), active_after_combine=to_numpy(live_again))
        settle(group)
        second = None
        if group.rank != stalled:
            recv, second, handle = dispatched(buffer, x, topk, active, second_outputs)
            y = expert_function(recv, case, group.rank)
            combined, _, _ = buffer.combine(y, topk, weight, active, case.timeout_us, handle, out=second_outputs[2])
            second.update(y=to_numpy(y), combined=to_numpy(combined), active=to_numpy(active))
        buffer.destroy()
        return first, second

    results = ep.LocalGroup(case.num_ranks, devices=[0] * case.num_ranks).spawn(run)
    all_live = [np.ones(case.num_ranks, np.int32)] * case.num_ranks
    masked = np.ones(case.num_ranks, np.int32)
    masked[stalled] = 0
    zeroed_rows = 0
    firsts = []
    for rank, (got, _) in enumerate(results):
        want = reference.dispatch(rank, xs, topks, all_live, case.num_max_tokens, case.num_experts, use_fp8=use_fp8)
        from_stalled = want.recv_src_rank == stalled
        zeroed_rows += int(from_stalled.sum())
        want.recv_x[from_stalled] = np.zeros((), want.recv_x.dtype)
        if use_fp8:
            want.recv_scales[from_stalled] = 0
        want.active_ranks = masked
        assert_dispatch_equal(rank, got["recv"], got["count"], got["active"], want, use_fp8)
        want.recv_src_rank[from_stalled] = -1  # counted, but rows of no source: combine reads none back
        firsts.append(want)
    assert zeroed_rows > 0, "the seed must route rank 1's tokens somewhere"
    for rank, (got, _) in enumerate(results):
        combined, mask = reference.combine(rank, first_ys, firsts, topks[rank], weights[rank], all_live)
        if rank == stalled:  # every rank took rank 1 as unstaged, so none holds a row that answers its tokens
            assert (combined.astype(np.float32) == 0).all()
        np.testing.assert_array_equal(got["combined"].astype(np.float32), combined.astype(np.float32),
                                      err_msg=f"rank {rank} combined_x of the dispatch that zeroed rank 1's rows")
        np.testing.assert_array_equal(got["active_after_combine"], mask, err_msg=f"rank {rank} mask after that combine")

    survivors_xs = [None if r == stalled else x for r, x in enumerate(xs)]
    survivors_topks = [None if r == stalled else t for r, t in enumerate(topks)]
    masks = [masked] * case.num_ranks
    wants = [None if r == stalled else reference.dispatch(r, survivors_xs, survivors_topks, masks, case.num_max_tokens,
                                                          case.num_experts, use_fp8=use_fp8)
             for r in range(case.num_ranks)]
    expert_outs = [None if second is None else second["y"] for _, second in results]
    for rank, (_, got) in enumerate(results):
        if rank == stalled:
            continue
        assert_dispatch_equal(rank, got["recv"], got["count"], masked, wants[rank], use_fp8)
        combined, mask = reference.combine(rank, expert_outs, wants, topks[rank], weights[rank], masks)
        np.testing.assert_array_equal(got["combined"].astype(np.float32), combined.astype(np.float32),
                                      err_msg=f"rank {rank} combined_x after the masked call")
        np.testing.assert_array_equal(got["active"], mask, err_msg=f"rank {rank} active_ranks after combine")


def test_async_results_dropped_early_keep_their_memory_until_the_kernel_is_done():
    """async_finish: the caller drops recv_x and the event while the kernel (on the communication
    stream) still waits for a peer; torch's allocator must not hand recv_x's memory to a new tensor
    on the caller's stream before the kernel is done (the results are recorded on that stream).

    Rank 1 dispatches only after rank 0 has allocated again (a barrier), so rank 0's kernel is
    certainly still running then. Rank 0 works on a stream of its own with no cached memory, where
    torch would otherwise give the freed block back at once (the same address)."""
    case = Case(2, 8, 1024, 2, mode="async")
    xs, topks, weights = make_inputs(case)
    size = ep.Buffer.get_ep_buffer_size_hint(case.num_max_tokens, case.hidden, case.num_ranks, case.num_experts)
    group = ep.LocalGroup(case.num_ranks, devices=[0] * case.num_ranks)
    recv_shape = (case.num_experts // case.num_ranks, case.num_ranks * case.num_max_tokens, case.hidden)

    def run(g):
        buffer = ep.Buffer(g, size)
        active = torch.ones(case.num_ranks, dtype=torch.int32, device="cuda")
        x, topk = to_torch(xs[g.rank]), to_torch(topks[g.rank])
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # its first segment is allocated now, while no kernel runs
            spare = torch.empty(recv_shape, dtype=torch.bfloat16, device="cuda")
            del spare
        settle(g)
        reallocated_at_dropped_address = None
        with torch.cuda.stream(stream):
            if g.rank == 1:
                g.barrier()
            recv, count, _, event, _ = buffer.dispatch(x, topk, active, case.num_max_tokens, case.num_experts,
                                                       timeout_us=TIMEOUT_US, use_fp8=False, async_finish=True)
            if g.rank == 0:
                dropped = recv.data_ptr()
                del recv, event
                fresh = torch.empty(recv_shape, dtype=torch.bfloat16, device="cuda")
                reallocated_at_dropped_address = fresh.data_ptr() == dropped
                g.barrier()
                result = None
            else:
                event.current_stream_wait()
                result = to_numpy(recv)
        torch.cuda.synchronize()
        outcome = (reallocated_at_dropped_address, to_numpy(count), result, to_numpy(active))
        g.barrier()
        buffer.destroy()
        return outcome

    results = group.spawn(run)
    actives = [np.ones(case.num_ranks, np.int32)] * case.num_ranks
    expected = [reference.dispatch(r, xs, topks, actives, case.num_max_tokens, case.num_experts, use_fp8=False)
                for r in range(case.num_ranks)]
    assert results[0][0] is False, "recv_x's memory went to a new tensor while the kernel could still write it"
    for rank, (_, count, _, active) in enumerate(results):
        np.testing.assert_array_equal(count, expected[rank].recv_count, err_msg=f"rank {rank} recv_count")
        np.testing.assert_array_equal(active, np.ones(case.num_ranks, np.int32), err_msg=f"rank {rank} mask")
    for local_expert, num_rows in enumerate(expected[1].recv_count):
        np.testing.assert_array_equal(results[1][2][local_expert, :num_rows].view(np.uint16),
                                      expected[1].recv_x[local_expert, :num_rows].view(np.uint16))


def test_repeated_steps_alternating_configurations():
    """Ten steps on one buffer alternate parities and epochs, and two configurations (T, H) in an
    order that puts each on both parities and after either; fresh inputs every step, each equal to
    the reference. The buffer holds both with room to spare, so each configuration's parity 1 lies
    past its own parity 0's end (layout.compute_layout with the workspace size)."""
    configs = [Case(4, 32, 1024, 4, use_fp8=True), Case(4, 32, 2048, 4, num_max_tokens=16, use_fp8=True)]
    order = [0, 1, 1, 0, 0, 1, 0, 1, 1, 0]
    size = 2 * max(ep.Buffer.get_ep_buffer_size_hint(c.num_max_tokens, c.hidden, c.num_ranks, c.num_experts)
                   for c in configs)
    group = ep.LocalGroup(configs[0].num_ranks, devices=[0] * configs[0].num_ranks)
    steps = [(configs[c], make_inputs(dataclasses.replace(configs[c], seed=seed))) for seed, c in enumerate(order)]

    def run(g):
        buffer = ep.Buffer(g, size)
        active = torch.ones(g.world_size, dtype=torch.int32, device="cuda")
        outputs = []
        for case, (xs, topks, weights) in steps:
            x, topk, w = to_torch(xs[g.rank]), to_torch(topks[g.rank]), to_torch(weights[g.rank])
            settle(g)
            recv, count, handle, _, _ = buffer.dispatch(x, topk, active, case.num_max_tokens, case.num_experts,
                                                        timeout_us=TIMEOUT_US)
            q, scales = recv
            settle(g)
            y = expert_function(recv, case, g.rank)
            combined_out = torch.empty(x.shape[0], case.hidden, dtype=torch.bfloat16, device="cuda")
            poison(combined_out)
            settle(g)
            combined, _, _ = buffer.combine(y, topk, w, active, TIMEOUT_US, handle, out=combined_out)
            outputs.append((to_numpy(count), (to_numpy(q), to_numpy(scales)), to_numpy(y), to_numpy(combined),
                            to_numpy(active)))
        g.barrier()
        buffer.destroy()
        return outputs

    results = group.spawn(run)
    for step, (case, (xs, topks, weights)) in enumerate(steps):
        actives = [np.ones(case.num_ranks, np.int32)] * case.num_ranks
        dispatched = [reference.dispatch(r, xs, topks, actives, case.num_max_tokens, case.num_experts, use_fp8=True)
                      for r in range(case.num_ranks)]
        expert_outs = [results[r][step][2] for r in range(case.num_ranks)]
        for rank in range(case.num_ranks):
            count, recv, _, combined, active = results[rank][step]
            where = f"step {step} (T={case.num_max_tokens}, H={case.hidden}) rank {rank}"
            assert_rows_equal(where, recv, count, dispatched[rank], use_fp8=True)
            # The expert outputs are the GPU's, computed from rows just found equal to the reference's.
            want, want_mask = reference.combine(rank, expert_outs, dispatched, topks[rank], weights[rank], actives)
            assert np.isfinite(combined.astype(np.float32)).all(), f"{where}: combine left unwritten (NaN) elements"
            np.testing.assert_array_equal(combined.astype(np.float32), want.astype(np.float32), err_msg=where)
            np.testing.assert_array_equal(active, want_mask, err_msg=f"{where}: active_ranks")


def test_a_rank_dispatching_another_t_than_its_peers_is_refused_and_can_call_again():
    """In-process ranks' kernels check no configuration: a rank whose T differs from its peers' would
    find their regions at the wrong offsets. Ranks 0-2 dispatch first; rank 3's dispatch with half
    their T is refused before it launches, and its retry with their T completes the call: every
    rank's rows, counts and combine are the reference's."""
    case = Case(4, 32, 1024, 4, use_fp8=True, seed=3)
    late = case.num_ranks - 1
    xs, topks, weights = make_inputs(case)
    assert xs[late].shape[0] <= case.num_max_tokens // 2, "rank 3's tokens must fit the refused call's T"
    size = ep.Buffer.get_ep_buffer_size_hint(case.num_max_tokens, case.hidden, case.num_ranks, case.num_experts)
    smaller = dataclasses.replace(case, num_max_tokens=case.num_max_tokens // 2)

    def run(group):
        buffer = ep.Buffer(group, size)
        active = torch.ones(case.num_ranks, dtype=torch.int32, device="cuda")
        x, topk, w = (to_torch(a[group.rank]) for a in (xs, topks, weights))
        recv_out, recv_count, combined = poisoned_outputs(case, x.shape[0])
        refused_out, refused_count, _ = poisoned_outputs(smaller, x.shape[0])
        settle(group)  # every allocation before a kernel waits: settle says why
        refusal = None
        if group.rank == late:
            group.barrier()  # after the others' dispatches
            with pytest.raises(ep.RankMismatchError) as refused:
                buffer.dispatch(x, topk, active, smaller.num_max_tokens, case.num_experts, timeout_us=TIMEOUT_US,
                                use_fp8=True, out=(refused_out, refused_count))
            refusal = str(refused.value)
        recv, count, handle, _, _ = buffer.dispatch(x, topk, active, case.num_max_tokens, case.num_experts,
                                                    timeout_us=TIMEOUT_US, use_fp8=True, out=(recv_out, recv_count))
        if group.rank != late:
            group.barrier()
        settle(group)
        y = expert_function(recv, case, group.rank)
        settle(group)
        buffer.combine(y, topk, w, active, TIMEOUT_US, handle, out=combined)
        result = dict(recv=tuple(to_numpy(t) for t in recv), count=to_numpy(count), y=to_numpy(y),
                      combined=to_numpy(combined), active=to_numpy(active), refusal=refusal)
        buffer.destroy()
        return result

    results = ep.LocalGroup(case.num_ranks, devices=[0] * case.num_ranks).spawn(run)
    assert f"num_max_dispatch_tokens_per_rank {case.num_max_tokens}, this rank with {smaller.num_max_tokens}" in \
        results[late]["refusal"]
    actives = [np.ones(case.num_ranks, np.int32)] * case.num_ranks
    dispatched = [reference.dispatch(r, xs, topks, actives, case.num_max_tokens, case.num_experts, use_fp8=True)
                  for r in range(case.num_ranks)]
    expert_outs = [result["y"] for result in results]
    for rank, result in enumerate(results):
        assert_dispatch_equal(rank, result["recv"], result["count"], result["active"], dispatched[rank], use_fp8=True)
        want, _ = reference.combine(rank, expert_outs, dispatched, topks[rank], weights[rank], actives)
        np.testing.assert_array_equal(result["combined"].astype(np.float32), want.astype(np.float32),
                                      err_msg=f"rank {rank} combined")


def test_step_counters_wrap_past_zero():
    """The step counters wrap after 2^32 calls on a parity. The kernels never use step 0, which every
    zeroed word (a fresh workspace's flags and verdicts, those cleared for a replaced rank) carries:
    Buffers whose counters are set to the last step before the wrap give the reference's results in
    three steps (both parities wrap), and count on from 1."""
    case = Case(4, 32, 1024, 4, use_fp8=True)
    size = ep.Buffer.get_ep_buffer_size_hint(case.num_max_tokens, case.hidden, case.num_ranks, case.num_experts)
    group = ep.LocalGroup(case.num_ranks, devices=[0] * case.num_ranks)
    steps = [make_inputs(dataclasses.replace(case, seed=seed)) for seed in range(3)]
    last_step = 2**32 - 1

    def run(g):
        buffer = ep.Buffer(g, size)
        buffer._cuda._write_steps([last_step] * 4)  # no kernel of any rank has run on this workspace yet
        g.barrier()
        active = torch.ones(g.world_size, dtype=torch.int32, device="cuda")
        outputs = []
        for xs, topks, weights in steps:
            x, topk, w = to_torch(xs[g.rank]), to_torch(topks[g.rank]), to_torch(weights[g.rank])
            recv_out, recv_count, combined_out = poisoned_outputs(case, x.shape[0])
            settle(g)
            recv, count, handle, _, _ = buffer.dispatch(x, topk, active, case.num_max_tokens, case.num_experts,
                                                        timeout_us=TIMEOUT_US, use_fp8=True, out=(recv_out, recv_count))
            settle(g)
            y = expert_function(recv, case, g.rank)
            settle(g)
            combined, _, _ = buffer.combine(y, topk, w, active, TIMEOUT_US, handle, out=combined_out)
            outputs.append((to_numpy(count), tuple(to_numpy(t) for t in recv), to_numpy(y), to_numpy(combined),
                            to_numpy(active)))
        settle(g)
        counters = buffer._cuda._peek_steps()
        g.barrier()
        buffer.destroy()
        return outputs, counters

    results = group.spawn(run)
    for rank, (_, counters) in enumerate(results):
        # Three calls of each kind: parity 0 went last_step -> 1 -> 2, parity 1 last_step -> 1.
        assert counters == [2, 1, 2, 1], f"rank {rank}: step counters (dispatch 0, 1, combine 0, 1) {counters}"
    actives = [np.ones(case.num_ranks, np.int32)] * case.num_ranks
    for index, (xs, topks, weights) in enumerate(steps):
        dispatched = [reference.dispatch(r, xs, topks, actives, case.num_max_tokens, case.num_experts, use_fp8=True)
                      for r in range(case.num_ranks)]
        expert_outs = [results[r][0][index][2] for r in range(case.num_ranks)]
        for rank in range(case.num_ranks):
            count, recv, _, combined, active = results[rank][0][index]
            where = f"step {index} rank {rank}"
            assert_rows_equal(where, recv, count, dispatched[rank], use_fp8=True)
            want, want_mask = reference.combine(rank, expert_outs, dispatched, topks[rank], weights[rank], actives)
            np.testing.assert_array_equal(combined.astype(np.float32), want.astype(np.float32), err_msg=where)
            np.testing.assert_array_equal(active, want_mask, err_msg=f"{where}: active_ranks")


@pytest.mark.parametrize("mode", ["sync", "async", "hook"])
def test_cuda_graph_replay_with_fresh_inputs(mode):
    """A captured dispatch -> expert -> combine step, replayed 100 times with new inputs, equals the
    reference, in every mode (async: the communication stream forked into the capture and joined back)."""
    case = Case(4, 32, 512, 4, num_max_tokens=16, use_fp8=True, mode=mode)
    flags = dict(async_finish=mode == "async", return_recv_hook=mode == "hook")
    num_replays = 100
    size = ep.Buffer.get_ep_buffer_size_hint(case.num_max_tokens, case.hidden, case.num_ranks, case.num_experts)
    group = ep.LocalGroup(case.num_ranks, devices=[0] * case.num_ranks)
    # Fixed token counts per rank (graph shapes are static); fresh values and routes every replay.
    token_counts = [len(x) for x in make_inputs(case)[0]]
    steps = []
    for seed in range(num_replays):
        rng = np.random.default_rng(1000 + seed)
        xs = [(rng.standard_normal((n, case.hidden), dtype=np.float32) * 3).astype(ml_dtypes.bfloat16)
              for n in token_counts]
        topks = [np.array([rng.choice(case.num_experts, case.num_topk, replace=False) for _ in range(n)],
                          dtype=np.int64).reshape(n, case.num_topk) for n in token_counts]
        weights = [rng.random((n, case.num_topk), dtype=np.float32) for n in token_counts]
        steps.append((xs, topks, weights))

    def run(g):
        buffer = ep.Buffer(g, size)
        active = torch.ones(case.num_ranks, dtype=torch.int32, device="cuda")
        xs, topks, weights = steps[0]
        static_x, static_topk, static_w = to_torch(xs[g.rank]), to_torch(topks[g.rank]), to_torch(weights[g.rank])

        def step():
            recv, count, handle, event, hook = buffer.dispatch(static_x, static_topk, active, case.num_max_tokens,
                                                               case.num_experts, timeout_us=TIMEOUT_US, **flags)
            finish_call(event, hook)
            y = expert_function(recv, case, g.rank)
            combined, event, hook = buffer.combine(y, static_topk, static_w, active, TIMEOUT_US, handle, **flags)
            finish_call(event, hook)
            return recv, count, y, combined

        settle(g)
        step()  # warm-up: the configuration's layout is uploaded outside the capture
        settle(g)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=torch.cuda.current_stream(), capture_error_mode="thread_local"):
            (q, scales), count, y, combined = step()
        g.barrier()
        outputs = []
        for xs, topks, weights in steps:
            static_x.copy_(to_torch(xs[g.rank]))
            static_topk.copy_(to_torch(topks[g.rank]))
            static_w.copy_(to_torch(weights[g.rank]))
            poison(q, scales, count, y, combined)  # the graph's own results: a replay must rewrite them all
            settle(g)
            graph.replay()
            outputs.append((to_numpy(count), (to_numpy(q), to_numpy(scales)), to_numpy(y), to_numpy(combined),
                            to_numpy(active)))
        g.barrier()
        buffer.destroy()
        return outputs

    results = group.spawn(run)
    actives = [np.ones(case.num_ranks, np.int32)] * case.num_ranks
    for index, (xs, topks, weights) in enumerate(steps):
        dispatched = [reference.dispatch(r, xs, topks, actives, case.num_max_tokens, case.num_experts, use_fp8=True)
                      for r in range(case.num_ranks)]
        expert_outs = [results[r][index][2] for r in range(case.num_ranks)]
        for rank in range(case.num_ranks):
            count, recv, _, combined, active = results[rank][index]
            where = f"replay {index} rank {rank}"
            assert_rows_equal(where, recv, count, dispatched[rank], use_fp8=True)
            # The expert outputs are the GPU's, computed from rows just found equal to the reference's.
            want, want_mask = reference.combine(rank, expert_outs, dispatched, topks[rank], weights[rank], actives)
            assert np.isfinite(combined.astype(np.float32)).all(), f"{where}: combine left unwritten (NaN) elements"
            np.testing.assert_array_equal(combined.astype(np.float32), want.astype(np.float32), err_msg=where)
            np.testing.assert_array_equal(active, want_mask, err_msg=f"{where}: active_ranks")
