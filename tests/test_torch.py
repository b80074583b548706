"""mooncake_ep.torch on the CPU: the autograd functions' gradients against float64 formulas.

The ranks are threads of a LocalGroup with CPU tensors, so the Buffers run the numpy reference; the
backward's dispatches and combines are real collectives of the group. Each gradient is checked
against its formula evaluated in float64 from the forward's routing (reference.dispatch), and a
whole MoE layer against the same layer computed densely by torch in float64.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import mooncake_ep as ep
from mooncake_ep import reference

torch = pytest.importorskip("torch")
ept = pytest.importorskip("mooncake_ep.torch")

GROUP_TIMEOUT_S = 30.0
BF16_RTOL = 2.0**-8  # one bf16 rounding


def make_inputs(seed: int, num_ranks: int, num_max_tokens: int, hidden: int, num_experts: int, num_topk,
                num_tokens=None):
    """num_topk: one K for every rank, or a K per rank."""
    rng = np.random.default_rng(seed)
    num_tokens = num_tokens or [num_max_tokens] * num_ranks
    rank_topk = num_topk if isinstance(num_topk, (list, tuple)) else [num_topk] * num_ranks
    xs, topks, weights = [], [], []
    for rank, (t, num_topk) in enumerate(zip(num_tokens, rank_topk)):
        x = rng.standard_normal((t, hidden)).astype(np.float32)
        x[:, 0] = rank
        xs.append(torch.from_numpy(x).to(torch.bfloat16))
        idx = np.array([rng.permutation(num_experts)[:num_topk] for _ in range(t)], np.int64).reshape(t, num_topk)
        idx[rng.random(idx.shape) < 0.2] = -1
        topks.append(torch.from_numpy(idx))
        weights.append(torch.from_numpy(rng.uniform(-1, 1, size=(t, num_topk)).astype(np.float32)))
    return xs, topks, weights


def to_np(t):
    t = t.detach()
    return t.view(torch.uint16).numpy().view(reference.bfloat16) if t.dtype == torch.bfloat16 else t.numpy()


def buffers(group, T, H, E, K):
    R = group.world_size
    return (ep.Buffer(group, ep.Buffer.get_ep_buffer_size_hint(T, H, R, E), backend="reference"),
            ep.Buffer(group, ept.grad_buffer_size_hint(T, H, R, E, K), backend="reference"))


def drop_copies_past_t_as_the_kernels_do(monkeypatch):
    """Lift the host check that refuses a rank's copies to one expert past its first T, so the CPU
    path drops them as the kernels do (reference.dispatch drops them; Buffer.dispatch documents both)."""
    from mooncake_ep import buffer as buffer_module
    from mooncake_ep.validation import check_expert_ids

    def range_only(where, topk_view, num_experts, num_max_tokens):
        check_expert_ids(where, topk_view, num_experts, np.iinfo(np.int32).max)

    monkeypatch.setattr(buffer_module, "check_expert_ids", range_only)


@pytest.mark.parametrize("combine_drops", [False, True, "in-place", "copies-past-T"],
                         ids=["same-ids", "combine-drops-entries", "combine-drops-entries-in-place", "copies-past-T"])
@pytest.mark.parametrize("num_ranks,num_tokens,rank_topk", [(2, [4, 4], [2, 2]), (3, [4, 1, 0], [2, 2, 2]),
                                                            (3, [4, 3, 2], [3, 1, 2])],
                         ids=["R2", "R3-uneven", "R3-mixed-topk"])
def test_gradients_match_float64_formulas(num_ranks, num_tokens, rank_topk, combine_drops, monkeypatch):
    """combine_drops: combine's topk_idx is -1 at some entries the dispatch sent (they add nothing): their
    expert rows and weights get no gradient, and every other row still gets its own; "in-place": the
    caller writes the -1 into the tensor it dispatched, which the backward must not route by.
    "copies-past-T": rank 0 names expert 0 six times (T = 4) and the dispatch drops its last two
    copies, as the kernels do: only those get no gradient, expert 0's other rows still get theirs.
    Mixed top-k: ranks with different K pass grad_num_topk, the largest."""
    T, H, E = 4, 128, 2 * num_ranks
    grad_num_topk = max(rank_topk)
    xs, topks, weights = make_inputs(1, num_ranks, T, H, E, rank_topk, num_tokens)
    if combine_drops == "copies-past-T":
        drop_copies_past_t_as_the_kernels_do(monkeypatch)
        topks[0][:, :2] = torch.tensor([[0, 0], [0, 1], [0, 0], [2, 0]])
        topks[0][:, 2:][topks[0][:, 2:] == 0] = -1
        if num_tokens[1]:
            topks[1][0, 0] = 0  # rank 1's rows of expert 0 come after rank 0's
        assert (reference.expert_slots(topks[0].numpy(), E) >= T).sum() == 2
    combine_topks = [t.clone() for t in topks]
    if combine_drops in (True, "in-place"):
        for t in combine_topks:
            t[::2, 0] = -1
        assert any(((t < 0) & (d >= 0)).any() for t, d in zip(combine_topks, topks))
    rng = np.random.default_rng(2)
    num_local, num_rows = E // num_ranks, num_ranks * T
    grad_recvs = [torch.from_numpy(rng.standard_normal((num_local, num_rows, H)).astype(np.float32)).bfloat16()
                  for _ in range(num_ranks)]
    expert_outs = [torch.from_numpy(rng.standard_normal((num_local, num_rows, H)).astype(np.float32)).bfloat16()
                   for _ in range(num_ranks)]
    grad_ys = [torch.from_numpy(rng.standard_normal((t, H)).astype(np.float32)).bfloat16() for t in num_tokens]

    def rank_fn(group):
        r = group.rank
        buffer, grad_buffer = buffers(group, T, H, E, grad_num_topk)
        active = torch.ones(num_ranks, dtype=torch.int32)
        x = xs[r].clone().requires_grad_()
        dispatched_topk = topks[r].clone()
        recv, count, handle = ept.dispatch(buffer, x, dispatched_topk, active, T, E)
        assert recv.requires_grad and not count.requires_grad
        (recv.float() * grad_recvs[r].float()).sum().backward()
        y = expert_outs[r].clone().requires_grad_()
        w = weights[r].clone().requires_grad_()
        combine_topk = combine_topks[r]
        if combine_drops == "in-place":
            dispatched_topk.copy_(combine_topk)
            combine_topk = dispatched_topk
        out = ept.combine(buffer, y, combine_topk, w, active, handle, grad_buffer=grad_buffer,
                          grad_num_topk=grad_num_topk if len(set(rank_topk)) > 1 else None)
        out.backward(grad_ys[r])
        return to_np(count), x.grad.float().numpy(), y.grad.float().numpy(), w.grad.numpy(), active.numpy().copy()

    results = ep.LocalGroup(num_ranks, timeout_s=GROUP_TIMEOUT_S).spawn(rank_fn)
    np_xs = [to_np(x) for x in xs]
    np_topks = [t.numpy() for t in topks]
    actives = [np.ones(num_ranks, np.int32)] * num_ranks
    dispatched = [reference.dispatch(r, np_xs, np_topks, actives, T, E, use_fp8=False) for r in range(num_ranks)]
    want_x = [np.zeros((t, H)) for t in num_tokens]
    want_y = [np.zeros((num_local, num_rows, H)) for _ in range(num_ranks)]
    want_w = [np.zeros((t, k)) for t, k in zip(num_tokens, rank_topk)]
    for owner, res in enumerate(dispatched):
        for e in range(num_local):
            for row in range(res.recv_count[e]):
                src, t, k = (int(a[e, row]) for a in (res.recv_src_rank, res.recv_src_token, res.recv_src_topk))
                want_x[src][t] += to_np(grad_recvs[owner])[e, row].astype(np.float64)
                if combine_topks[src][t, k] < 0:
                    continue
                want_y[owner][e, row] = weights[src].double()[t, k].item() * to_np(grad_ys[src])[t].astype(np.float64)
                want_w[src][t, k] = to_np(expert_outs[owner])[e, row].astype(np.float64) @ \
                    to_np(grad_ys[src])[t].astype(np.float64)
    for r, (count, grad_x, grad_y, grad_w, active) in enumerate(results):
        np.testing.assert_array_equal(count, dispatched[r].recv_count)
        np.testing.assert_array_equal(active, np.ones(num_ranks))
        # dispatch: a sum of bf16 rows in fp32, rounded once to bf16.
        np.testing.assert_allclose(grad_x, want_x[r], rtol=BF16_RTOL, atol=1e-6, err_msg=f"rank {r}: grad x")
        # combine: w_k * grad_y[t] rounded to bf16, and exactly 0 past recv_count.
        np.testing.assert_allclose(grad_y, want_y[r], rtol=BF16_RTOL, atol=1e-6, err_msg=f"rank {r}: grad expert out")
        for e, n in enumerate(dispatched[r].recv_count):
            assert not grad_y[e, n:].any(), f"rank {r} expert {e}: rows past recv_count get no gradient"
        # weights: fp32 dot products of H bf16 products.
        np.testing.assert_allclose(grad_w, want_w[r], rtol=1e-5, atol=1e-4, err_msg=f"rank {r}: grad weights")
        assert np.all(grad_w[combine_topks[r].numpy() < 0] == 0)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_the_combine_gradient_drops_the_copies_the_reference_drops(dtype):
    """The backward's routing leaves out exactly the copies past T that reference.dispatch drops (its
    expert_slots), whatever the ids: repeats, -1, ids outside [0, E)."""
    rng = np.random.default_rng(3)
    num_experts, T = 4, 3
    ids = rng.integers(-2, num_experts + 2, size=(6, 4))
    want = np.where(reference.expert_slots(ids, num_experts) >= T, -1, ids)
    assert (want != ids).any() and ((ids < 0) | (ids >= num_experts)).any()
    got = ept._drop_copies_past(torch.from_numpy(ids).to(dtype), num_experts, T)
    assert got.dtype == dtype
    np.testing.assert_array_equal(got.numpy(), want)


def test_entries_combine_leaves_out_get_no_gradient_whatever_their_rows_hold():
    """Combine leaves out every entry naming expert 1 (-1), whose rows are NaN (never computed, as a
    capacity-dropped token's torch.empty row): the output is finite, and so are the gradients, 0 for
    the left-out weights and rows (a product with a 0 mask had made them NaN)."""
    T, H, E, K = 2, 128, 2, 2

    def rank_fn(group):
        buffer, grad_buffer = buffers(group, T, H, E, K)
        topk = torch.tensor([[0, 1], [1, 0]])
        active = torch.ones(1, dtype=torch.int32)
        recv, _, handle = ept.dispatch(buffer, torch.ones(T, H, dtype=torch.bfloat16), topk, active, T, E)
        y = recv.detach().clone()
        y[1] = float("nan")
        y.requires_grad_()
        weights = torch.full((T, K), 0.5, requires_grad=True)
        out = ept.combine(buffer, y, torch.where(topk == 1, -1, topk), weights, active, handle, grad_buffer=grad_buffer)
        out.float().sum().backward()
        return out.float(), weights.grad, y.grad.float()

    (out, grad_w, grad_y), = ep.LocalGroup(1, timeout_s=GROUP_TIMEOUT_S).spawn(rank_fn)
    assert torch.isfinite(out).all()
    assert grad_w.tolist() == [[H, 0.0], [0.0, H]]  # d sum(out) / d w = the sum of the kept row's ones
    assert torch.isfinite(grad_y).all() and not grad_y[1].any()


def test_a_failure_during_the_backward_drops_only_the_lost_ranks_rows():
    """Rank 0 masked between forward and backward: its gradient rows no longer arrive, so the rows of
    the ranks after it move up into its rows' places. Those rows still get their own gradient, carried
    back to their tokens (x through dispatch's backward, topk_weights through combine's); only rank 0's
    rows, and its experts', get 0 (the review of helper-78's fix: it zeroed every expert rank 0 fed)."""
    num_ranks, T, H, E, K = 3, 4, 128, 6, 2
    num_local, num_rows = E // num_ranks, num_ranks * T
    xs, _, weights = make_inputs(4, num_ranks, T, H, E, K)
    # Rank 0 routes only to experts 2 and 3 (rank 1's), which rank 2 feeds too; experts 4 and 5 (rank
    # 2's) hear from ranks 1 and 2 only.
    topks = [torch.tensor([[2, 3], [3, 2], [2, 3], [3, 2]]), torch.tensor([[0, 4], [1, 5], [2, 4], [3, 5]]),
             torch.tensor([[4, 0], [5, 1], [2, 5], [3, 4]])]
    rng = np.random.default_rng(5)
    expert_outs, grad_recvs = ([torch.from_numpy(rng.standard_normal((num_local, num_rows, H)).astype(np.float32))
                                .bfloat16() for _ in range(num_ranks)] for _ in range(2))

    def rank_fn(group):
        buffer, grad_buffer = buffers(group, T, H, E, K)
        active = torch.ones(num_ranks, dtype=torch.int32)
        x = xs[group.rank].clone().requires_grad_()
        w = weights[group.rank].clone().requires_grad_()
        recv, _, handle = ept.dispatch(buffer, x, topks[group.rank], active, T, E)
        y = expert_outs[group.rank].clone().requires_grad_()
        out = ept.combine(buffer, y, topks[group.rank], w, active, handle, grad_buffer=grad_buffer)
        active[0] = 0  # every rank's mask: rank 0 failed after the forward
        # d loss / d out = 1, d loss / d recv = grad_recvs: combine's backward, then dispatch's.
        (out.float().sum() + (recv.float() * grad_recvs[group.rank].float()).sum()).backward()
        return y.grad.float().numpy(), x.grad.float().numpy(), w.grad.numpy()

    grads = ep.LocalGroup(num_ranks, timeout_s=GROUP_TIMEOUT_S).spawn(rank_fn)
    # Every row of the live ranks' experts from a live source gets its own gradient, w_k for y (d out = 1),
    # and carries back its own to x (grad_recvs' row) and to w (the row's sum, <y_row, 1>).
    forwards = [reference.dispatch(r, [to_np(x) for x in xs], [t.numpy() for t in topks],
                                   [np.ones(num_ranks, np.int32)] * num_ranks, T, E, use_fp8=False)
                for r in range(num_ranks)]
    want_y = [np.zeros((num_local, num_rows, H), np.float32) for _ in range(num_ranks)]
    want_x = [np.zeros((T, H)) for _ in range(num_ranks)]
    want_w = [np.zeros((T, K)) for _ in range(num_ranks)]
    for owner in (1, 2):
        forward = forwards[owner]
        for e in range(num_local):
            for row in range(forward.recv_count[e]):
                src, t, k = (int(a[e, row]) for a in (forward.recv_src_rank, forward.recv_src_token,
                                                      forward.recv_src_topk))
                if src == 0:
                    continue
                want_y[owner][e, row] = np.float32(weights[src][t, k].item())
                want_x[src][t] += to_np(grad_recvs[owner])[e, row].astype(np.float64)
                want_w[src][t, k] = to_np(expert_outs[owner])[e, row].astype(np.float64).sum()
    assert (forwards[1].recv_src_rank[:, 0] == 0).all(), "rank 0's rows come first in rank 1's experts"
    assert (forwards[1].recv_src_rank == 2).any(), "and rank 2's after them, moved in the backward"
    for r in (1, 2):
        np.testing.assert_array_equal(grads[r][0], want_y[r].astype(reference.bfloat16).astype(np.float32),
                                      err_msg=f"rank {r}: grad expert out")
        np.testing.assert_allclose(grads[r][1], want_x[r], rtol=BF16_RTOL, atol=1e-6, err_msg=f"rank {r}: grad x")
        np.testing.assert_allclose(grads[r][2], want_w[r], rtol=1e-5, atol=1e-4, err_msg=f"rank {r}: grad weights")
        assert np.all(grads[r][2][topks[r].numpy() < 2] == 0), f"rank {r}: the lost rank's experts' weights"


@pytest.mark.parametrize("dispatch", ["mooncake_ep.torch", "Buffer"])
def test_the_rows_after_a_lost_rank_get_their_own_gradient_by_hand(dispatch):
    """One expert per rank, hand-computed. Expert 1 (rank 1's) receives, in order, rank 0's two tokens,
    rank 1's token 0 and rank 2's token 0; expert 2 rank 1's and rank 2's token 1. Rank 0 is masked
    after the forward, so in the backward expert 1's rows from ranks 1 and 2 arrive first: they must
    still be the gradient of forward rows 2 and 3, and only rows 0 and 1 get 0. Row values say where
    they are: 10 * owner + row + 1, exact in bf16; a misplaced row gives another number, a dropped
    one 0. "Buffer": the combine answers a handle of Buffer.dispatch (its x gets no gradient)."""
    num_ranks, T, H, E = 3, 2, 128, 3
    topks = [torch.tensor([[1], [1]]), torch.tensor([[1], [2]]), torch.tensor([[1], [2]])]
    weights = [torch.tensor([[11.0], [13.0]]), torch.tensor([[2.0], [3.0]]), torch.tensor([[5.0], [7.0]])]
    # Both the expert outputs (combine's forward) and d loss / d recv_x (dispatch's backward).
    row_values = [(10 * r + torch.arange(1, num_ranks * T + 1, dtype=torch.float32)).reshape(1, -1, 1).expand(1, -1, H)
                  .bfloat16() for r in range(num_ranks)]

    def rank_fn(group):
        r = group.rank
        buffer, grad_buffer = buffers(group, T, H, E, 1)
        active = torch.ones(num_ranks, dtype=torch.int32)
        x = torch.zeros(T, H, dtype=torch.bfloat16, requires_grad=True)
        w = weights[r].clone().requires_grad_()
        if dispatch == "Buffer":
            _, _, handle, _, _ = buffer.dispatch(x.detach(), topks[r], active, T, E, use_fp8=False)
            loss = 0
        else:
            recv, _, handle = ept.dispatch(buffer, x, topks[r], active, T, E)
            loss = (recv.float() * row_values[r].float()).sum()
        y = row_values[r].clone().requires_grad_()
        out = ept.combine(buffer, y, topks[r], w, active, handle, grad_buffer=grad_buffer)
        active[0] = 0  # every rank's mask: rank 0 failed after the forward
        (loss + out.float().sum()).backward()  # d loss / d out = 1
        grad_x = None if x.grad is None else x.grad.float()
        return grad_x, w.grad, y.grad[0].float()

    results = ep.LocalGroup(num_ranks, timeout_s=GROUP_TIMEOUT_S).spawn(rank_fn)
    ones = torch.ones(H)
    # d out[t] / d y[row(t)] = w[t]: on rank 1 rows 2 and 3 are rank 1's token 0 and rank 2's token 0;
    # on rank 2 rows 0 and 1 are their tokens 1.
    want_y = {1: [0, 0, 2, 5, 0, 0], 2: [3, 7, 0, 0, 0, 0]}
    # d out[t] / d w[t] = <y[row(t)], 1> = H * (10 * owner + row + 1); d loss / d x[t] = that row's value.
    want_row_value = {1: [13, 21], 2: [14, 22]}
    for r in (1, 2):
        grad_x, grad_w, grad_y = results[r]
        assert torch.equal(grad_y, torch.tensor(want_y[r], dtype=torch.float32)[:, None] * ones), f"rank {r}: grad y"
        assert grad_w.flatten().tolist() == [H * v for v in want_row_value[r]], f"rank {r}: grad weights"
        if dispatch == "mooncake_ep.torch":
            assert torch.equal(grad_x, torch.tensor(want_row_value[r], dtype=torch.float32)[:, None] * ones), \
                f"rank {r}: grad x"


def test_rows_move_between_layouts_by_source_and_only_shared_rows_move():
    """The layouts the GPU makes and the reference never does: a source whose staging timed out keeps its
    first row with 0 rows (a gap of zero rows follows), and a source with more rows in one layout than
    the other (copies a dispatch of fewer tokens per rank dropped). Row values are their row numbers
    + 1 in the forward layout, so each moved row says where it came from; NaN past the rows, which
    must not leak into the result."""
    # One local expert, three sources. Forward: source 0 rows 0-1, source 1 rows 2-4, source 2 rows 5-6.
    forward_range = torch.tensor([[[0, 2], [2, 3], [5, 2]]], dtype=torch.int32)
    # Backward: source 0 lost (0 rows at 0); source 1 unstaged (its 3 zero rows 0-2, 0 rows in its
    # range); source 2 at 3 with 4 rows, of which the forward kept 2.
    backward_range = torch.tensor([[[0, 0], [0, 0], [3, 4]]], dtype=torch.int32)
    rows = torch.arange(1.0, 9.0).reshape(1, 8, 1).expand(1, 8, 2).clone()
    rows[0, 7] = float("nan")  # past the forward's rows
    to_backward = ept._move_rows(rows, forward_range, backward_range, 10)
    assert to_backward[0, :, 0].tolist() == [0, 0, 0, 6, 7, 0, 0, 0, 0, 0]
    back = ept._move_rows(to_backward, backward_range, forward_range, 8)
    assert back[0, :, 0].tolist() == [0, 0, 0, 0, 0, 6, 7, 0]
    # A source gained in the backward (0 rows in the forward) gets 0 in its rows.
    gained = torch.tensor([[[0, 2], [2, 3], [5, 2]]], dtype=torch.int32)
    assert ept._move_rows(rows, torch.tensor([[[0, 0], [0, 3], [3, 2]]], dtype=torch.int32), gained,
                          8)[0, :, 0].tolist() == [0, 0, 1, 2, 3, 4, 5, 0]


def test_a_rank_that_came_back_since_the_forward_gets_no_other_tokens_gradient():
    """Expert 2 (rank 2's) has rows from rank 1 only in the forward (ranks 0 and 2 mask each other);
    before the backward rank 1 drops out of rank 2's view and rank 0 comes back, with as many rows:
    the count is the same, the rows are other tokens'. Every gradient through expert 2 is then 0, not
    rank 1's given to rank 0 (review, helper-78). Expert 1 (rank 1's) hears from rank 2, live in both."""
    num_ranks, T, H, E = 3, 2, 128, 3
    topks = [torch.tensor([[2], [2]]), torch.tensor([[2], [2]]), torch.tensor([[1], [1]])]
    forward_masks = [[1, 1, 0], [1, 1, 1], [0, 1, 1]]
    backward_masks = [[1, 1, 1], [1, 1, 0], [1, 0, 1]]
    xs, _, _ = make_inputs(6, num_ranks, T, H, E, 1)
    weights = [torch.tensor([[2.0], [3.0]]), torch.tensor([[5.0], [7.0]]), torch.tensor([[1.0], [1.0]])]

    def rank_fn(group):
        buffer, grad_buffer = buffers(group, T, H, E, 1)
        active = torch.tensor(forward_masks[group.rank], dtype=torch.int32)
        x = xs[group.rank].clone().requires_grad_()
        w = weights[group.rank].clone().requires_grad_()
        recv, count, handle = ept.dispatch(buffer, x, topks[group.rank], active, T, E)
        y = recv.detach().float().bfloat16().requires_grad_()  # identity experts
        out = ept.combine(buffer, y, topks[group.rank], w, active, handle, grad_buffer=grad_buffer)
        active.copy_(torch.tensor(backward_masks[group.rank], dtype=torch.int32))  # a failure, and a comeback
        (out.float().sum() + recv.float().sum()).backward()
        return count.tolist(), x.grad.float(), w.grad, y.grad.float()

    results = ep.LocalGroup(num_ranks, timeout_s=GROUP_TIMEOUT_S).spawn(rank_fn)
    assert [count for count, *_ in results] == [[0], [2], [2]]
    for r in (0, 1):  # routed to expert 2 only
        _, grad_x, grad_w, _ = results[r]
        assert not grad_x.any() and not grad_w.any(), f"rank {r}: no gradient through expert 2"
    assert not results[2][3].any(), "expert 2's rows: no gradient"
    # Expert 1 (rank 1's) received rank 2's tokens in the forward; in the backward ranks 1 and 2 mask
    # each other, so rank 2's tokens get no gradient back either (lost, not misplaced).
    assert not results[2][1].any() and not results[2][2].any()


def test_ranks_with_different_topk_without_grad_num_topk_are_told_to_pass_it():
    T, H, E = 4, 128, 4
    xs, topks, weights = make_inputs(1, 2, T, H, E, [1, 2])

    def rank_fn(group):
        r = group.rank
        buffer, grad_buffer = buffers(group, T, H, E, 2)
        active = torch.ones(2, dtype=torch.int32)
        recv, _, handle = ept.dispatch(buffer, xs[r], topks[r], active, T, E)
        y = recv.detach().clone().requires_grad_()
        out = ept.combine(buffer, y, topks[r], weights[r], active, handle, grad_buffer=grad_buffer)
        with pytest.raises(ep.RankMismatchError, match=r"mooncake_ep.torch.combine \(gradient\): .* every rank must "
                                                       r"pass combine grad_num_topk=, the largest"):
            out.float().sum().backward()

    ep.LocalGroup(2, timeout_s=GROUP_TIMEOUT_S).spawn(rank_fn)


def test_writing_into_the_returned_recv_count_changes_no_gradient():
    """The backward compares the counts with the forward's own copy, not with the tensor the caller got."""
    T, H, E, K = 2, 128, 2, 2

    def rank_fn(group):
        buffer, _ = buffers(group, T, H, E, K)
        x = torch.ones(T, H, dtype=torch.bfloat16, requires_grad=True)
        recv, count, _ = ept.dispatch(buffer, x, torch.tensor([[0, 1], [1, 0]]), torch.ones(1, dtype=torch.int32), T, E)
        count.zero_()
        recv.float().sum().backward()
        return x.grad.float()

    (grad_x,) = ep.LocalGroup(1, timeout_s=GROUP_TIMEOUT_S).spawn(rank_fn)
    assert torch.equal(grad_x, torch.full((T, H), float(K)))  # each token's two rows, each of gradient 1


@pytest.mark.parametrize("host_ids", [True, False], ids=["cpu-handle", "handle-without-host-ids"])
def test_a_buffer_dispatch_handle_routes_the_gradient_by_the_dispatchs_ids(host_ids):
    """A handle of Buffer.dispatch (fp8 here: no gradient to x) and a combine whose ids leave out
    entries the dispatch sent: the backward routes by the dispatch's own ids, the host's copy for
    CPU tensors, else (as for CUDA tensors, whose ids the host never reads) the tensor dispatch was
    given, so every row still gets its own gradient and left-out ones get 0."""
    T, H, E, K = 2, 128, 2, 2
    topk = torch.tensor([[0, 1], [1, 0]])
    left_out = torch.tensor([[-1, 1], [1, 0]])  # token 0 leaves out expert 0

    def rank_fn(group):
        buffer, grad_buffer = buffers(group, T, H, E, K)
        active = torch.ones(1, dtype=torch.int32)
        _, _, handle, _, _ = buffer.dispatch(torch.ones(T, H, dtype=torch.bfloat16), topk, active, T, E)
        if not host_ids:
            del handle.state["topk_idx"]  # the host copy of the ids, which a CUDA dispatch never makes
        y = torch.zeros(E, T, H, dtype=torch.bfloat16, requires_grad=True)
        weights = torch.tensor([[2.0, 3.0], [5.0, 7.0]], requires_grad=True)
        out = ept.combine(buffer, y, left_out, weights, active, handle, grad_buffer=grad_buffer)
        out.float().sum().backward()
        return y.grad[:, :, 0].float()

    (grad_rows,) = ep.LocalGroup(1, timeout_s=GROUP_TIMEOUT_S).spawn(rank_fn)
    # Expert 0's rows: token 0's copy (left out: 0), then token 1's (weight 7); expert 1's: token 0's
    # (weight 3), then token 1's (weight 5).
    assert grad_rows.tolist() == [[0.0, 7.0], [3.0, 5.0]]


def test_a_moe_layer_trains_like_the_dense_layer():
    num_ranks, T, H, E, K = 2, 4, 128, 4, 2
    xs, topks, weights = make_inputs(3, num_ranks, T, H, E, K)
    expert_weights = torch.from_numpy(np.random.default_rng(4).standard_normal((E, H, H)).astype(np.float32)) / H**0.5
    num_local = E // num_ranks

    def rank_fn(group):
        r = group.rank
        buffer, grad_buffer = buffers(group, T, H, E, K)
        active = torch.ones(num_ranks, dtype=torch.int32)
        mine = expert_weights[r * num_local:(r + 1) * num_local].clone().requires_grad_()
        x, w = xs[r].clone().requires_grad_(), weights[r].clone().requires_grad_()
        for _ in range(2):  # two steps on the same Buffers: the backward leaves them reusable
            for t in (x, w, mine):
                t.grad = None
            recv, _, handle = ept.dispatch(buffer, x, topks[r], active, T, E)
            y = torch.einsum("erh,ehk->erk", recv.float(), mine).bfloat16()
            out = ept.combine(buffer, y, topks[r], w, active, handle, grad_buffer=grad_buffer)
            (out.float() ** 2).sum().backward()
        return x.grad.float(), w.grad, mine.grad

    results = ep.LocalGroup(num_ranks, timeout_s=GROUP_TIMEOUT_S).spawn(rank_fn)
    x_all = torch.cat(xs).double().requires_grad_()
    w_all = torch.cat(weights).double().requires_grad_()
    experts_all = expert_weights.double().requires_grad_()
    topk_all = torch.cat(topks)
    ys = torch.einsum("th,ehk->tek", x_all, experts_all)
    picked = ys[torch.arange(len(topk_all))[:, None], topk_all.clamp(min=0)]
    out = (torch.where(topk_all[:, :, None] >= 0, w_all[:, :, None] * picked, 0)).sum(1)
    (out ** 2).sum().backward()
    got_x = torch.cat([r[0] for r in results]).double()
    got_w = torch.cat([r[1] for r in results]).double()
    got_experts = torch.cat([r[2] for r in results]).double()
    # bf16 roundings of recv_x, expert outputs and gradient rows: within a few bf16 ulps of the scale.
    for got, want, name in ((got_x, x_all.grad, "x"), (got_w, w_all.grad, "weights"),
                            (got_experts, experts_all.grad, "experts")):
        torch.testing.assert_close(got, want, atol=0.02 * want.abs().max().item(), rtol=0, msg=f"grad {name}")


@pytest.mark.parametrize("num_ranks, compiled_backward", [(2, False), (1, True)],
                         ids=["compiled-forward", "compiled-autograd"])
def test_under_torch_compile_the_calls_are_opaque_steps_with_eager_results(num_ranks, compiled_backward):
    """Dynamo traced into the library's host code and failed on its numpy (helper-120), and compiled
    autograd the same from the backwards (helper-121): the calls and the backwards are excluded from
    compilation, and a compiled layer's output and gradients equal the eager layer's. Compiled
    autograd is one rank's: its state is the process's, and two rank threads would nest it."""
    import contextlib

    from torch._dynamo import compiled_autograd

    T, H, E, K = 4, 128, 4, 2
    xs, topks, weights = make_inputs(5, num_ranks, T, H, E, K)
    expert_weights = torch.from_numpy(np.random.default_rng(6).standard_normal((E // num_ranks, H, H))
                                      .astype(np.float32)) / H**0.5
    # torch's switch for compiled autograd is private (its own tests use _enable).
    backward_context = ((lambda: compiled_autograd._enable(torch.compile(backend="aot_eager")))
                        if compiled_backward else contextlib.nullcontext)

    def rank_fn(group):
        r = group.rank
        buffer, grad_buffer = buffers(group, T, H, E, K)
        active = torch.ones(num_ranks, dtype=torch.int32)
        mine = expert_weights.clone().requires_grad_()

        def layer(x, w):
            recv, _, handle = ept.dispatch(buffer, x, topks[r], active, T, E)
            y = torch.einsum("erh,ehk->erk", recv.float(), mine).bfloat16()
            return ept.combine(buffer, y, topks[r], w, active, handle, grad_buffer=grad_buffer)

        results = []
        for run, context in ((layer, contextlib.nullcontext),
                             (torch.compile(layer, backend="aot_eager"), backward_context)):
            x, w = xs[r].clone().requires_grad_(), weights[r].clone().requires_grad_()
            mine.grad = None
            with context():
                out = run(x, w)
                (out.float() ** 2).sum().backward()
            results.append((out.detach(), x.grad, w.grad, mine.grad))
        return results

    for eager, compiled in ep.LocalGroup(num_ranks, timeout_s=GROUP_TIMEOUT_S).spawn(rank_fn):
        for got, want, name in zip(compiled, eager, ("out", "grad x", "grad weights", "grad experts")):
            assert torch.equal(got, want), name


def test_a_dispatch_under_inference_mode_feeds_a_trained_combine():
    """A frozen dispatch (torch.inference_mode) before trained experts and weights: the combine saved
    the dispatch's routing copy, an inference tensor, and raised after its collective (helper-120)."""
    num_ranks, T, H, E, K = 2, 4, 128, 4, 2
    xs, topks, weights = make_inputs(7, num_ranks, T, H, E, K)

    def rank_fn(group):
        r = group.rank
        buffer, grad_buffer = buffers(group, T, H, E, K)
        active = torch.ones(num_ranks, dtype=torch.int32)
        grads = []
        for frozen in (True, False):
            with torch.inference_mode(frozen):
                recv, _, handle = ept.dispatch(buffer, xs[r], topks[r], active, T, E)
            y = recv.clone().requires_grad_()
            w = weights[r].clone().requires_grad_()
            out = ept.combine(buffer, y, topks[r], w, active, handle, grad_buffer=grad_buffer)
            (out.float() ** 2).sum().backward()
            grads.append((y.grad, w.grad))
        # The expert outputs as inference tensors, and topk_weights needing their gradient: refused
        # before the combine's collective, on both ranks alike; where no graph is recorded (no_grad,
        # inference_mode: an evaluation) the same call runs (helper-121: it had been refused there too).
        w = weights[r].clone().requires_grad_()
        with torch.inference_mode():
            recv, _, handle = ept.dispatch(buffer, xs[r], topks[r], active, T, E)
        with pytest.raises(RuntimeError, match=r"^mooncake_ep.torch.combine: x was made under torch.inference_mode"):
            ept.combine(buffer, recv, topks[r], w, active, handle, grad_buffer=grad_buffer)
        for evaluation in (torch.no_grad, torch.inference_mode):
            with torch.inference_mode():
                recv, _, handle = ept.dispatch(buffer, xs[r], topks[r], active, T, E)
            with evaluation():
                ept.combine(buffer, recv * 2, topks[r], w, active, handle)
        return grads

    for frozen, plain in ep.LocalGroup(num_ranks, timeout_s=GROUP_TIMEOUT_S).spawn(rank_fn):
        for got, want in zip(frozen, plain):
            assert torch.equal(got, want)


class _ReportsCuda(torch.Tensor):
    """A CPU tensor that says it is on cuda:0: the CUDA branch of DispatchFunction.forward, on the CPU."""

    __torch_function__ = torch._C._disabled_torch_function_impl
    is_cuda = property(lambda self: True)

    def get_device(self) -> int:
        return 0


@pytest.mark.parametrize("cupy_module, reason", [
    (None, r"backend='auto': cupy could not be imported \((ModuleNotFound|Import)Error: .*\); the CUDA backend needs "
           r"it: pip install 'mooncake_ep\[cuda12\]' \(or \[cuda13\]: the driver's CUDA major version\)"),
    ("no device", r"backend='auto': cupy found no CUDA device"),
    ("no driver", r"backend='auto': cupy found no usable CUDA driver \(RuntimeError: driver gone\)"),
], ids=["no-cupy", "no-device", "no-driver"])
def test_a_cuda_array_given_to_an_auto_reference_buffer_is_told_why_no_gpu_was_found(monkeypatch, cupy_module,
                                                                                       reason):
    """backend='auto' took a missing cupy for a missing GPU without a word: a deep_ep engine installed
    without the cuda extra got a reference Buffer, and its first CUDA tensor an error that said to
    build the Buffer where a GPU is visible, on a GPU host (helper-147)."""
    import sys
    import types

    def count(case=cupy_module):
        if case == "no driver":
            raise RuntimeError("driver gone")
        return 0

    if cupy_module is not None:
        cupy_module = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=types.SimpleNamespace(
            getDeviceCount=count)))
    monkeypatch.setitem(sys.modules, "cupy", cupy_module)  # None: import raises ImportError
    buffer = ep.Buffer(ep.LocalGroup(1).rank_group(0), ep.Buffer.get_ep_buffer_size_hint(4, 128, 1, 2))
    assert buffer.backend == "reference"
    x = torch.zeros((4, 128), dtype=torch.bfloat16).as_subclass(_ReportsCuda)
    topk = torch.zeros((4, 1), dtype=torch.int64).as_subclass(_ReportsCuda)
    active = torch.ones(1, dtype=torch.int32).as_subclass(_ReportsCuda)
    with pytest.raises(TypeError, match=rf"^dispatch: x is on cuda:0, and this Buffer runs on the numpy reference "
                                        rf"backend \({reason}\); build the Buffer where a GPU is visible"):
        buffer.dispatch(x, topk, active, 4, 2)
    buffer.destroy()


@pytest.mark.parametrize("x, error, pattern", [
    (torch.zeros(3 * 128, dtype=torch.bfloat16), ValueError, r"x must be 2-dimensional, got shape \(384,\)"),
    (torch.zeros((), dtype=torch.bfloat16), ValueError, r"x must be 2-dimensional, got shape \(\)"),
    (torch.zeros(3, 100), TypeError, r"x must be bfloat16, got float32"),
    (torch.zeros(3, 100, dtype=torch.bfloat16), ValueError,
     r"x.shape\[1\] \(hidden\) must be a multiple of 128, got 100"),
], ids=["1-d", "0-d", "float32", "hidden-100"])
def test_a_cuda_x_is_checked_before_the_backwards_configuration_is_agreed(x, error, pattern):
    """The CUDA path agrees (with ranks in processes, a collective) on the fp8 configuration its backward
    rebuilds the routing in, before the dispatch: it read x.shape[1] unchecked (a bare IndexError) and
    agreed on a float32 x's hidden before the dispatch refused it (helper-120)."""
    from test_buffer_launch import RecordingCuda, _TwoRankView

    group = _TwoRankView()
    buffer = ep.Buffer(group, ep.Buffer.get_ep_buffer_size_hint(4, 128, 2, 8), backend="reference")
    group.constructed = True
    buffer._cuda, buffer.backend = RecordingCuda(), "cuda"
    topk = torch.zeros((x.shape[0] if x.dim() else 1, 2), dtype=torch.int64).as_subclass(_ReportsCuda)
    active = torch.ones(2, dtype=torch.int32).as_subclass(_ReportsCuda)
    with pytest.raises(error, match=rf"^mooncake_ep\.torch\.dispatch: {pattern}"):
        ept.dispatch(buffer, x.as_subclass(_ReportsCuda), topk, active, 4, 8)
    assert buffer._cuda.agreed == []


@pytest.mark.parametrize("loss", ["quadratic", "linear", "dispatch-only"])
def test_a_double_backward_is_refused(loss):
    """The backward's dispatches and combines record no graph: a second derivative through them (a
    gradient penalty, create_graph=True) raises instead of dropping its terms without a word, also
    for a loss linear in the output, whose incoming gradient does not require grad."""
    T, H, E, K = 4, 128, 2, 2
    xs, topks, weights = make_inputs(6, 1, T, H, E, K)

    def rank_fn(group):
        buffer, grad_buffer = buffers(group, T, H, E, K)
        active = torch.ones(1, dtype=torch.int32)
        x = xs[0].clone().requires_grad_()
        recv, _, handle = ept.dispatch(buffer, x, topks[0], active, T, E)
        w = weights[0].clone().requires_grad_()
        out = ept.combine(buffer, recv * 2, topks[0], w, active, handle, grad_buffer=grad_buffer)
        value = {"quadratic": (out.float() ** 2).sum(), "linear": out.float().sum(),
                 "dispatch-only": (recv.float() ** 2).sum()}[loss]
        inputs, op = ((x,), "dispatch") if loss == "dispatch-only" else ((x, w), "combine")
        with pytest.raises(RuntimeError, match=rf"mooncake_ep.torch.{op}: a double backward \(create_graph=True\) "
                                               rf"is not supported"):
            torch.autograd.grad(value, inputs, create_graph=True, retain_graph=True)
        grads = torch.autograd.grad(value, inputs)  # the graph and the buffers are still usable
        return [tuple(g.shape) for g in grads]

    want = [(T, H)] if loss == "dispatch-only" else [(T, H), (T, K)]
    assert ep.LocalGroup(1, timeout_s=GROUP_TIMEOUT_S).spawn(rank_fn) == [want]


def test_only_the_needed_gradients_are_computed():
    """Weights without grad: combine's backward is one dispatch, and no grad_w; x alone likewise."""
    num_ranks, T, H, E, K = 2, 2, 128, 2, 1
    xs, topks, weights = make_inputs(5, num_ranks, T, H, E, K)

    def rank_fn(group):
        r = group.rank
        buffer, grad_buffer = buffers(group, T, H, E, K)
        active = torch.ones(num_ranks, dtype=torch.int32)
        recv, _, handle = ept.dispatch(buffer, xs[r], topks[r], active, T, E)
        y = recv.clone().requires_grad_()
        calls = []
        real = grad_buffer.combine
        grad_buffer.combine = lambda *a, **k: calls.append("combine") or real(*a, **k)
        ept.combine(buffer, y, topks[r], weights[r], active, handle, grad_buffer=grad_buffer).float().sum().backward()
        assert y.grad is not None and calls == []
        recv, _, handle = ept.dispatch(buffer, xs[r], topks[r], active, T, E)
        w = weights[r].clone().requires_grad_()
        ept.combine(buffer, recv, topks[r], w, active, handle, grad_buffer=grad_buffer).float().sum().backward()
        assert w.grad is not None and calls == ["combine"]
        # Nothing needs a gradient: no grad_buffer needed at all.
        recv, _, handle = ept.dispatch(buffer, xs[r], topks[r], active, T, E)
        return ept.combine(buffer, recv, topks[r], weights[r], active, handle).shape

    assert ep.LocalGroup(num_ranks, timeout_s=GROUP_TIMEOUT_S).spawn(rank_fn) == [(T, H)] * num_ranks


def test_a_grad_buffer_of_another_rank_is_refused():
    """Each rank's gradient dispatch runs on grad_buffer as grad_buffer's rank: another rank's Buffer of
    the gradient's group let every collective complete with the ranks' gradients swapped (a JAX review,
    helper-93, found it there; torch's check had the same gap). Refused at the call, on every rank, and
    each rank's own grad Buffer then works."""
    T, H, E, K = 3, 128, 2, 2
    xs, topks, weights = make_inputs(7, 2, T, H, E, K)
    grad_buffers = [None, None]

    def rank_fn(group):
        rank = group.rank
        buffer, grad_buffer = buffers(group, T, H, E, K)
        grad_buffers[rank] = grad_buffer
        group.barrier()
        active = torch.ones(2, dtype=torch.int32)
        recv, _, handle = ept.dispatch(buffer, xs[rank], topks[rank], active, T, E)
        y = recv.clone().requires_grad_()
        with pytest.raises(ValueError, match=rf"mooncake_ep.torch.combine: grad_buffer is rank {1 - rank} of its "
                                             rf"group, buffer rank {rank}: pass this rank's Buffer"):
            ept.combine(buffer, y, topks[rank], weights[rank], active, handle, grad_buffer=grad_buffers[1 - rank])
        out = ept.combine(buffer, y, topks[rank], weights[rank], active, handle, grad_buffer=grad_buffer)
        out.float().sum().backward()
        return y.grad is not None

    assert ep.LocalGroup(2, timeout_s=GROUP_TIMEOUT_S).spawn(rank_fn) == [True, True]


def test_a_grad_buffer_of_another_backend_is_refused_at_the_call():
    """Its calls run in the backward: refused there, they named the backward's arrays (helper-120)."""
    from test_buffer_launch import RecordingCuda

    T, H, E, K = 3, 128, 2, 2
    xs, topks, weights = make_inputs(8, 1, T, H, E, K)

    def rank_fn(group):
        buffer, grad_buffer = buffers(group, T, H, E, K)
        active = torch.ones(1, dtype=torch.int32)
        recv, _, handle = ept.dispatch(buffer, xs[0], topks[0], active, T, E)
        y = recv.clone().requires_grad_()
        reference_backend = grad_buffer._cuda, grad_buffer.backend
        grad_buffer._cuda, grad_buffer.backend = RecordingCuda(), "cuda"  # as a Buffer built on cuda:0
        with pytest.raises(ValueError, match=r"^mooncake_ep.torch.combine: grad_buffer runs on the cuda backend on "
                                             r"device 0, buffer on the reference backend on device -1"):
            ept.combine(buffer, y, topks[0], weights[0], active, handle, grad_buffer=grad_buffer)
        grad_buffer._cuda, grad_buffer.backend = reference_backend
        ept.combine(buffer, y, topks[0], weights[0], active, handle, grad_buffer=grad_buffer).float().sum().backward()
        return y.grad is not None

    assert ep.LocalGroup(1, timeout_s=GROUP_TIMEOUT_S).spawn(rank_fn) == [True]


def test_a_bad_grad_buffer_or_grad_num_topk_is_refused_without_a_gradient_too():
    """Checked only when a gradient was recorded, a typo there passed every inference call and was found
    when training started (helper-145)."""
    T, H, E, K = 3, 128, 2, 2
    xs, topks, weights = make_inputs(9, 1, T, H, E, K)

    def rank_fn(group):
        buffer = buffers(group, T, H, E, K)[0]
        active = torch.ones(1, dtype=torch.int32)
        recv, _, handle = ept.dispatch(buffer, xs[0], topks[0], active, T, E)
        with pytest.raises(TypeError, match=r"^mooncake_ep.torch.combine: grad_buffer must be a mooncake_ep.Buffer, "
                                            r"got builtins.str"):
            ept.combine(buffer, recv, topks[0], weights[0], active, handle, grad_buffer="grad")
        with pytest.raises(ValueError, match=r"grad_num_topk"):
            ept.combine(buffer, recv, topks[0], weights[0], active, handle, grad_num_topk=99)
        return ept.combine(buffer, recv, topks[0], weights[0], active, handle).shape  # still usable

    assert ep.LocalGroup(1, timeout_s=GROUP_TIMEOUT_S).spawn(rank_fn) == [(T, H)]


def test_refusals_name_the_argument_and_leave_the_buffer_usable():
    T, H, E, K = 3, 128, 2, 2
    xs, topks, weights = make_inputs(6, 1, T, H, E, K)

    def rank_fn(group):
        buffer, grad_buffer = buffers(group, T, H, E, K)
        small = ep.Buffer(group, buffer.num_ep_buffer_bytes, backend="reference")
        active = torch.ones(1, dtype=torch.int32)
        with pytest.raises(TypeError, match=r"dispatch: x must be bfloat16, got float32"):
            ept.dispatch(buffer, xs[0].float().requires_grad_(), topks[0], active, T, E)
        with pytest.raises(ValueError, match=r"dispatch: x must be contiguous"):
            ept.dispatch(buffer, xs[0].repeat(1, 2)[:, ::2], topks[0], active, T, E)
        with pytest.raises(TypeError, match=r"dispatch: active_ranks must be int32, got int64"):
            ept.dispatch(buffer, xs[0], topks[0], active.long(), T, E)
        # Arrays Buffer takes but autograd cannot save: refused before the collective, which is not counted.
        with pytest.raises(TypeError, match=r"mooncake_ep.torch.dispatch: topk_idx must be a torch.Tensor, got "
                                            r"numpy.ndarray"):
            ept.dispatch(buffer, xs[0], topks[0].numpy(), active, T, E)
        with pytest.raises(TypeError, match=r"^mooncake_ep.torch.dispatch: buffer must be a mooncake_ep.Buffer, got "
                                            r"mooncake_ep.group.LocalRankGroup$"):
            ept.dispatch(group, xs[0], topks[0], active, T, E)  # the group for its Buffer (helper-105)
        assert buffer._num_dispatches == 0
        recv, _, handle = ept.dispatch(buffer, xs[0], topks[0], active, T, E)
        y = recv.clone().requires_grad_()
        with pytest.raises(TypeError, match=r"mooncake_ep.torch.combine: the gradient of combine is a dispatch of "
                                            r"num_tokens \* num_topk rows: pass grad_buffer="):
            ept.combine(buffer, y, topks[0], weights[0], active, handle)
        direct = ept.CombineFunction.apply(y, weights[0], topks[0], active, handle, buffer, None, None, -1)
        with pytest.raises(TypeError, match=r"mooncake_ep.torch.combine: the gradient of combine is a dispatch of "
                                            r"num_tokens \* num_topk rows: pass grad_buffer="):  # the public Function
            direct.float().sum().backward()
        with pytest.raises(ValueError, match=r"grad_buffer must be another Buffer of the same group"):
            ept.combine(buffer, y, topks[0], weights[0], active, handle, grad_buffer=buffer)
        with pytest.raises(ValueError, match=r"grad_buffer has \d+ bytes, the gradient needs \d+ "
                                             r"\(grad_buffer_size_hint\(T=3, hidden=128"):
            ept.combine(buffer, y, topks[0], weights[0], active, handle, grad_buffer=small)
        with pytest.raises(ValueError, match=r"mooncake_ep.torch.combine: grad_num_topk must be >= 2, got 1"):
            ept.combine(buffer, y, topks[0], weights[0], active, handle, grad_buffer=grad_buffer, grad_num_topk=1)
        with pytest.raises(ValueError, match=r"grad_buffer has \d+ bytes, the gradient needs \d+ "
                                             r"\(grad_buffer_size_hint\(T=3, hidden=128, .*num_topk=3\)\)"):
            ept.combine(buffer, y, topks[0], weights[0], active, handle, grad_buffer=grad_buffer, grad_num_topk=3)
        with pytest.raises(TypeError, match=r"combine: topk_weights must be float32, got float64"):
            ept.combine(buffer, y, topks[0], weights[0].double(), active, handle, grad_buffer=grad_buffer)
        with pytest.raises(TypeError, match=r"mooncake_ep.torch.combine: topk_weights must be a torch.Tensor, got "
                                            r"numpy.ndarray"):
            ept.combine(buffer, y, topks[0], weights[0].numpy(), active, handle, grad_buffer=grad_buffer)
        small.destroy()
        with pytest.raises(RuntimeError, match=r"mooncake_ep.torch.combine: grad_buffer: this Buffer was destroyed"):
            ept.combine(buffer, y, topks[0], weights[0], active, handle, grad_buffer=small)
        for grad_mode in (True, False):  # with a gradient needed, and without
            with torch.set_grad_enabled(grad_mode):
                with pytest.raises(TypeError, match=r"^mooncake_ep.torch.combine: buffer must be a mooncake_ep.Buffer, "
                                                    r"got builtins.NoneType$"):
                    ept.combine(None, y, topks[0], weights[0], active, handle, grad_buffer=grad_buffer)
        with torch.no_grad():  # an evaluation records no backward: inputs that require grad need no grad_buffer
            evaluated = ept.combine(buffer, y, topks[0], torch.nn.Parameter(weights[0].clone()), active, handle)
        out = ept.combine(buffer, y, topks[0], weights[0], active, handle, grad_buffer=grad_buffer)
        assert not evaluated.requires_grad and torch.equal(evaluated, out)
        out.float().sum().backward()
        # The public Function, called without grad_num_topk (None): this rank's num_topk.
        direct = ept.CombineFunction.apply(y, weights[0], topks[0], active, handle, buffer, grad_buffer, None, -1)
        direct.float().sum().backward()
        return y.grad.shape

    assert ep.LocalGroup(1, timeout_s=GROUP_TIMEOUT_S).spawn(rank_fn) == [(1 * 2, 3, H)]


def test_grad_buffer_size_hint():
    assert ept.grad_buffer_size_hint(8, 256, 2, 4, 3) == ep.Buffer.get_ep_buffer_size_hint(24, 256, 2, 4)
    with pytest.raises(ValueError, match=r"grad_buffer_size_hint: num_topk must be <= 16, got 17"):
        ept.grad_buffer_size_hint(8, 256, 2, 4, 17)
    with pytest.raises(ValueError, match=r"^grad_buffer_size_hint: hidden must be a multiple of 128, got 100"):
        ept.grad_buffer_size_hint(8, 100, 2, 4, 2)  # named as the function called, not the one it uses
    assert ept.grad_buffer_size_hint(8, 256, 2, 4, np.int64(3)) == ept.grad_buffer_size_hint(8, 256, 2, 4, 3)


def test_buffer_calls_on_tensors_that_require_grad_warn_in_grad_mode_only():
    """Buffer.dispatch / combine are no autograd ops: a residual MoE block trained through them still has
    a loss, and left its experts and router untouched without a word (helper-154). A warning, not an
    error: an inference script without torch.no_grad() gets what Mooncake EP's and DeepEP's calls give."""
    T, H, E, K = 4, 128, 2, 2
    xs, topks, weights = make_inputs(41, 1, T, H, E, K)

    def rank_fn(group):
        buffer, grad_buffer = buffers(group, T, H, E, K)
        active = torch.ones(1, dtype=torch.int32)
        x, w = xs[0].clone().requires_grad_(), weights[0].clone().requires_grad_()
        with pytest.warns(UserWarning, match=r"^dispatch: x requires grad, and Buffer calls are not "
                                             r"differentiable: no gradient flows back through them"):
            recv, _, handle, _, _ = buffer.dispatch(x, topks[0], active, T, E, use_fp8=False)
        y = recv.clone().requires_grad_()
        with pytest.warns(UserWarning) as caught:
            buffer.combine(y, topks[0], w, active, handle=handle)
        assert [str(c.message).split(" requires")[0] for c in caught] == ["combine: topk_weights", "combine: x"]
        assert caught[0].filename == __file__  # names the caller's line
        import mooncake_ep.deep_ep as deep_ep  # through the DeepEP shim too, two frames of ours deeper

        shim = deep_ep.Buffer(group, num_rdma_bytes=ep.Buffer.get_ep_buffer_size_hint(T, H, 1, E),
                              low_latency_mode=True, backend="reference", explicitly_destroy=True)
        with pytest.warns(UserWarning, match=r"^dispatch: x requires grad") as caught:
            shim.low_latency_dispatch(x, topks[0], T, E, use_fp8=False)
        assert caught[0].filename == __file__
        shim.destroy()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with torch.no_grad():
                recv, _, handle, _, _ = buffer.dispatch(x, topks[0], active, T, E, use_fp8=False)
                buffer.combine(y, topks[0], w, active, handle=handle)
            # The autograd functions call the Buffer with grad mode off, and train.
            recv, _, handle = ept.dispatch(buffer, x, topks[0], active, T, E)
            out = ept.combine(buffer, recv * 2, topks[0], w, active, handle, grad_buffer=grad_buffer)
            out.float().sum().backward()
        assert x.grad is not None and w.grad is not None

    ep.LocalGroup(1, timeout_s=GROUP_TIMEOUT_S).spawn(rank_fn)


@pytest.mark.filterwarnings("ignore:`torch.jit.trace` is deprecated:DeprecationWarning")
def test_torch_jit_trace_is_refused_by_name():
    """Under torch.jit.trace the shapes are tensors, which read as a bad hidden size (helper-154)."""
    T, H, E, K = 4, 128, 2, 2
    xs, topks, weights = make_inputs(43, 1, T, H, E, K)

    def rank_fn(group):
        buffer, _ = buffers(group, T, H, E, K)
        active = torch.ones(1, dtype=torch.int32)
        with pytest.raises(RuntimeError, match=r"^mooncake_ep.torch.dispatch: torch.jit.trace cannot record a call"):
            torch.jit.trace(lambda x: ept.dispatch(buffer, x, topks[0], active, T, E)[0], (xs[0],))
        recv, _, _ = ept.dispatch(buffer, xs[0], topks[0], active, T, E)  # the Buffer still works
        assert recv.shape == (E, T, H)

    ep.LocalGroup(1, timeout_s=GROUP_TIMEOUT_S).spawn(rank_fn)


def test_a_cpu_handle_combine_refuses_is_refused_on_every_rank_at_once_with_gradients_too():
    """Rank 1 has not called its dispatch's hook. Buffer.combine refuses that handle through its exchange
    (every rank raises at once); mooncake_ep.torch.combine read the handle's row ranges first, which
    refused it on rank 1 alone, and rank 0 waited in the exchange until the group's timeout (review)."""
    import time

    import mooncake_ep.torch as ept

    num_ranks, T, H, E, K = 2, 4, 128, 4, 2

    def rank_fn(group):
        buffer = ep.Buffer(group, ep.Buffer.get_ep_buffer_size_hint(T, H, num_ranks, E), backend="reference")
        grad_buffer = ep.Buffer(group, ept.grad_buffer_size_hint(T, H, num_ranks, E, K), backend="reference")
        x = torch.randn(T, H, generator=torch.Generator().manual_seed(group.rank)).to(torch.bfloat16)
        topk = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0]], dtype=torch.int64)
        active = torch.ones(num_ranks, dtype=torch.int32)
        recv_x, _, handle, _, hook = buffer.dispatch(x, topk, active, T, E, use_fp8=False, return_recv_hook=True)
        if group.rank == 0:
            hook()
        start = time.monotonic()
        with pytest.raises((ValueError, RuntimeError)) as refused:
            ept.combine(buffer, recv_x.clone().requires_grad_(), topk, torch.full((T, K), 0.5), active, handle,
                        grad_buffer=grad_buffer)
        return type(refused.value).__name__, str(refused.value), time.monotonic() - start

    out = ep.LocalGroup(num_ranks, timeout_s=30.0).spawn(rank_fn)
    assert out[1][:2] == ("RuntimeError", "combine: the dispatch of this handle has not received yet: call its "
                                          "hook() first"), out[1]
    assert out[0][0] == "ValueError" and "rank 1 of 2 refused this call" in out[0][1], out[0]
    assert max(took for _, _, took in out) < 10, out  # not the group's 30 s timeout
