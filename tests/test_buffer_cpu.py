"""Tests of mooncake_ep.Buffer on the numpy reference backend, with in-process ranks (LocalGroup).

Every dispatch and combine is a collective: in a LocalGroup all ranks make the same sequence of
successful calls. A rejected call raises before it communicates, so the tests reject a call on
every rank (or on one rank only, which proves it did not communicate) and then go on in step.

Each rank's results are compared with mooncake_ep.reference run on the same global inputs: dispatch
rows bit for bit up to recv_count (rows past it are undefined), combine bit for bit (the backend is
the reference itself, so no tolerance is needed). Inputs encode their origin: channel 0 of rank s's
token t holds s and channel 1 holds t (exact in bf16), so a misrouted row names its source.
"""

from __future__ import annotations

import dataclasses
import gc
import re
import threading
import time

import ml_dtypes
import numpy as np
import pytest

from _cases import BF16, Case, bits, make_case, reference_step  # one definition for both in-process tests

import mooncake_ep as ep
from mooncake_ep import buffer as buffer_module
from mooncake_ep import layout as ep_layout
from mooncake_ep import reference
from mooncake_ep.buffer import EventOverlap, Handle, _Plan
from mooncake_ep.tensor import DeviceMemoryArray, c_contiguous_strides, read_array, swapped_last_axes_strides

FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
# Seconds a collective waits in these tests: a call that communicated on one rank only fails fast.
GROUP_TIMEOUT_S = 20.0

BF16_FLAGS = dict(use_fp8=False)
FP8_FLAGS = dict(use_fp8=True)
FP8_ROUND_FLAGS = dict(use_fp8=True, round_scale=True)
UE8M0_FLAGS = dict(use_fp8=True, round_scale=True, use_ue8m0=True)
ALL_FLAGS = [BF16_FLAGS, FP8_FLAGS, FP8_ROUND_FLAGS, UE8M0_FLAGS]
FLAG_IDS = ["bf16", "fp8", "fp8-round", "fp8-ue8m0"]


def expert_fn(rank: int, recv_x: np.ndarray, recv_scales: np.ndarray | None, flags: dict) -> np.ndarray:
    """The experts of a rank: global expert e multiplies its (dequantized) rows by (e + 1) / 4."""
    num_local_experts, num_rows, hidden = recv_x.shape
    if recv_scales is None:
        values = recv_x.astype(np.float32)
    else:
        values = reference.dequantize_fp8(recv_x.reshape(-1, hidden),
                                          recv_scales.reshape(num_local_experts * num_rows, -1),
                                          use_ue8m0=flags.get("use_ue8m0", False)).reshape(recv_x.shape)
    factor = (rank * num_local_experts + np.arange(num_local_experts, dtype=np.float32) + 1) / 4
    return (values * factor[:, None, None]).astype(BF16)


@dataclasses.dataclass
class Expected:
    dispatch: reference.DispatchResult
    combined: np.ndarray
    combine_mask: np.ndarray


def expected_step(case: Case, flags: dict, renormalize: bool = False) -> list[Expected]:
    results, combined = reference_step(case, flags, lambda r, res, f: expert_fn(r, res.recv_x, res.recv_scales, f),
                                       renormalize)
    return [Expected(res, *rank_combined) for res, rank_combined in zip(results, combined)]


# --- framework conversion ---------------------------------------------------------------------------


def to_framework(a: np.ndarray, framework: str):
    """A copy of ``a`` in the framework (bf16/fp8 kept; JAX gets int32 ids, since x64 is off)."""
    if framework == "numpy":
        return a.copy()
    if framework == "torch":
        import torch

        raw = {BF16: (np.uint16, torch.bfloat16), FP8: (np.uint8, torch.float8_e4m3fn)}.get(a.dtype)
        if raw is None:
            return torch.from_numpy(a.copy())
        return torch.from_numpy(a.view(raw[0]).copy()).view(raw[1])
    if framework == "jax":
        import jax.numpy as jnp

        return jnp.asarray(a.astype(np.int32) if a.dtype == np.int64 else a)
    raise AssertionError(framework)


def to_numpy(obj) -> np.ndarray:
    if isinstance(obj, np.ndarray):
        return obj
    module = type(obj).__module__
    if module.startswith("torch"):
        import torch

        raw = {torch.bfloat16: (torch.int16, BF16), torch.float8_e4m3fn: (torch.uint8, FP8)}.get(obj.dtype)
        if raw is None:
            return obj.numpy()
        return obj.view(raw[0]).numpy().view(raw[1])
    return np.asarray(obj)


def framework_type(framework: str) -> type:
    if framework == "numpy":
        return np.ndarray
    if framework == "torch":
        import torch

        return torch.Tensor
    import jax

    return jax.Array


def poisoned(shape, dtype) -> np.ndarray:
    """An output array full of 0xFF bytes (NaN for bf16, fp8 and fp32; -1 for int32)."""
    return np.full(tuple(shape) + (np.dtype(dtype).itemsize,), 0xFF, np.uint8).view(dtype).reshape(shape)


# --- per-rank steps ---------------------------------------------------------------------------------


@dataclasses.dataclass
class Step:
    """One rank's results of a dispatch + combine, as numpy."""

    recv_x: np.ndarray
    recv_scales: np.ndarray | None
    recv_count: np.ndarray
    combined: np.ndarray
    dispatch_mask: np.ndarray | None = None
    combine_mask: np.ndarray | None = None


def dispatch_args(case: Case, rank: int, framework: str = "numpy", **overrides) -> dict:
    args = dict(x=to_framework(case.xs[rank], framework), topk_idx=to_framework(case.topk_idxs[rank], framework),
                active_ranks=to_framework(case.actives[rank], framework),
                num_max_dispatch_tokens_per_rank=case.num_max_tokens, num_experts=case.num_experts)
    args.update(overrides)
    return args


def split_recv(recv_x, flags):
    if flags.get("use_fp8", True):
        q, scales = recv_x
        return to_numpy(q), to_numpy(scales)
    return to_numpy(recv_x), None


def run_step(buf: ep.Buffer, case: Case, rank: int, flags: dict, framework: str = "numpy",
             renormalize: bool = False, **overrides) -> Step:
    """A plain dispatch then combine of ``case`` on ``rank``; expert outputs from :func:`expert_fn`.
    ``overrides``: dispatch arguments other than the case's (the same values in another form)."""
    args = dispatch_args(case, rank, framework, **overrides)
    recv_x, recv_count, handle, _, _ = buf.dispatch(**args, **flags)
    q, scales = split_recv(recv_x, flags)
    dispatch_mask = to_numpy(args["active_ranks"]).copy()
    expert_out = to_framework(expert_fn(rank, q, scales, flags), framework)
    combined, _, _ = buf.combine(expert_out, args["topk_idx"], to_framework(case.weights[rank], framework),
                                 args["active_ranks"], -1, handle, renormalize=renormalize)
    return Step(q.copy(), None if scales is None else scales.copy(), to_numpy(recv_count).copy(),
                to_numpy(combined).copy(), dispatch_mask, to_numpy(args["active_ranks"]).copy())


def check_dispatch(expected: Expected, recv_x: np.ndarray, recv_scales: np.ndarray | None, recv_count: np.ndarray,
                   rank: int = -1) -> None:
    ref = expected.dispatch
    assert recv_x.shape == ref.recv_x.shape and recv_x.dtype == ref.recv_x.dtype, f"rank {rank}"
    assert recv_count.dtype == np.int32
    np.testing.assert_array_equal(recv_count, ref.recv_count, err_msg=f"rank {rank}: recv_count")
    for e, count in enumerate(ref.recv_count):
        np.testing.assert_array_equal(bits(recv_x[e, :count]), bits(ref.recv_x[e, :count]),
                                      err_msg=f"rank {rank}: recv_x of local expert {e}")
        if ref.recv_scales is not None:
            assert recv_scales.shape == ref.recv_scales.shape and recv_scales.dtype == ref.recv_scales.dtype
            np.testing.assert_array_equal(recv_scales[e, :count], ref.recv_scales[e, :count],
                                          err_msg=f"rank {rank}: recv_scales of local expert {e}")


def check_steps(case: Case, flags: dict, steps: list[Step], renormalize: bool = False, masks: bool = True) -> None:
    for rank, (step, exp) in enumerate(zip(steps, expected_step(case, flags, renormalize))):
        check_dispatch(exp, step.recv_x, step.recv_scales, step.recv_count, rank)
        assert step.combined.dtype == BF16
        np.testing.assert_array_equal(bits(step.combined), bits(exp.combined), err_msg=f"rank {rank}: combined")
        if masks:
            np.testing.assert_array_equal(step.dispatch_mask, exp.dispatch.active_ranks, err_msg=f"rank {rank}")
            np.testing.assert_array_equal(step.combine_mask, exp.combine_mask, err_msg=f"rank {rank}")


def spawn(num_ranks: int, fn, *args):
    return ep.LocalGroup(num_ranks, timeout_s=GROUP_TIMEOUT_S).spawn(fn, *args)


def new_buffer(group, case: Case, num_bytes: int | None = None) -> ep.Buffer:
    return ep.Buffer(group, case.size_hint if num_bytes is None else num_bytes, backend="reference")


# --- results equal the reference --------------------------------------------------------------------

SHAPES = [  # (num_ranks, hidden, num_experts, num_topk, T)
    (1, 128, 2, 1, 3),
    (2, 256, 4, 2, 4),
    (3, 384, 6, 3, 5),
    (4, 128, 8, 4, 6),
]


@pytest.mark.parametrize("flags", ALL_FLAGS, ids=FLAG_IDS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "R{}-H{}-E{}-K{}-T{}".format(*s))
def test_dispatch_and_combine_equal_reference(shape, flags):
    num_ranks, hidden, num_experts, num_topk, num_max_tokens = shape
    case = make_case(sum(shape), num_ranks, num_max_tokens, hidden, num_experts, num_topk)

    def rank_fn(group):
        buf = new_buffer(group, case)
        assert buf.backend == "reference"
        return run_step(buf, case, group.rank, flags)

    check_steps(case, flags, spawn(num_ranks, rank_fn))


def test_zero_tokens_on_every_rank_but_one():
    case = make_case(5, num_ranks=4, num_experts=8, num_topk=3, num_tokens=[4, 0, 0, 0])

    def rank_fn(group):
        return run_step(new_buffer(group, case), case, group.rank, FP8_FLAGS)

    steps = spawn(4, rank_fn)
    check_steps(case, FP8_FLAGS, steps)
    assert all(np.all(s.dispatch_mask == 1) for s in steps)  # a rank without tokens is alive
    assert all(s.combined.shape == (0, case.hidden) for s in steps[1:])


def test_int32_topk_idx_gives_the_same_results():
    case64 = make_case(6, num_ranks=2)
    case32 = dataclasses.replace(case64, topk_idxs=[i.astype(np.int32) for i in case64.topk_idxs])

    def rank_fn(group):
        buf = new_buffer(group, case64)
        return run_step(buf, case64, group.rank, FP8_FLAGS), run_step(buf, case32, group.rank, FP8_FLAGS)

    for a, b in spawn(2, rank_fn):
        np.testing.assert_array_equal(bits(a.combined), bits(b.combined))
        np.testing.assert_array_equal(a.recv_count, b.recv_count)


@pytest.mark.parametrize("framework", ["numpy", "torch"])
def test_numpy_integer_sizes_give_the_results_of_python_ints(framework):
    # In uint8 arithmetic the R * T = 400 rows per expert of recv_x would wrap to 144.
    case = make_case(12, num_ranks=2, num_max_tokens=200, hidden=128, num_experts=4)
    import_framework(framework)

    def rank_fn(group):
        return run_step(new_buffer(group, case), case, group.rank, BF16_FLAGS, framework,
                        num_max_dispatch_tokens_per_rank=np.uint8(200), num_experts=np.uint8(4))

    check_steps(case, BF16_FLAGS, spawn(2, rank_fn))
    assert ep.Buffer.get_grad_buffer_size_hint(np.int16(4096), 128, 2, 4, np.int16(16)) == \
        ep.Buffer.get_grad_buffer_size_hint(4096, 128, 2, 4, 16)


def test_renormalize_equals_reference():
    case = make_case(7, num_ranks=4, num_experts=8, num_topk=3,
                     actives=[[1, 1, 1, 0], [1, 1, 1, 0], [1, 1, 1, 0], [0, 0, 0, 1]])

    def rank_fn(group):
        return run_step(new_buffer(group, case), case, group.rank, BF16_FLAGS, renormalize=True)

    check_steps(case, BF16_FLAGS, spawn(4, rank_fn), renormalize=True)


@pytest.mark.parametrize("actives,expected_masks", [
    # Rank 3 is dead to everyone and sees everyone dead (both sides agree): nothing changes.
    ([[1, 1, 1, 0], [1, 1, 1, 0], [1, 1, 1, 0], [0, 0, 0, 1]], None),
    # Rank 0 masks rank 2, rank 2 does not know: rank 0 skips it, so rank 2 times out on rank 0.
    ([[1, 1, 0, 1], [1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1]],
     [[1, 1, 0, 1], [1, 1, 1, 1], [0, 1, 1, 1], [1, 1, 1, 1]]),
], ids=["agreed", "one-sided"])
@pytest.mark.parametrize("flags", [BF16_FLAGS, UE8M0_FLAGS], ids=["bf16", "fp8-ue8m0"])
def test_inactive_ranks_deliver_nothing_and_masks_come_back(actives, expected_masks, flags):
    case = make_case(8, num_ranks=4, num_experts=8, num_topk=4, num_tokens=[4, 4, 4, 4], actives=actives)

    def rank_fn(group):
        return run_step(new_buffer(group, case), case, group.rank, flags)

    steps = spawn(4, rank_fn)
    check_steps(case, flags, steps)
    for rank, step in enumerate(steps):
        np.testing.assert_array_equal(step.dispatch_mask, (expected_masks or actives)[rank])


# --- frameworks -------------------------------------------------------------------------------------

FRAMEWORKS = ["numpy", "torch", "jax"]


def import_framework(framework: str) -> None:
    if framework != "numpy":
        pytest.importorskip(framework)


@pytest.mark.parametrize("flags", [BF16_FLAGS, UE8M0_FLAGS], ids=["bf16", "fp8-ue8m0"])
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_framework_callers_get_equal_values(framework, flags):
    import_framework(framework)
    case = make_case(9, num_ranks=2, hidden=128)

    def rank_fn(group):
        return run_step(new_buffer(group, case), case, group.rank, flags, framework)

    check_steps(case, flags, spawn(2, rank_fn))


# JAX callers get numpy arrays back: frameworks.jax.empty allocates numpy scratch outputs and
# Buffer._outputs hands them back without converting them with frameworks.jax.from_numpy.
@pytest.mark.parametrize("framework", ["numpy", "torch", "jax"])
def test_framework_callers_get_their_own_arrays(framework):
    import_framework(framework)
    case = make_case(10, num_ranks=2, hidden=128)
    expected_type = framework_type(framework)

    def rank_fn(group):
        buf = new_buffer(group, case)
        args = dispatch_args(case, group.rank, framework)
        (q, scales), count, handle, _, _ = buf.dispatch(**args, **UE8M0_FLAGS)
        expert_out = to_framework(expert_fn(group.rank, to_numpy(q), to_numpy(scales), UE8M0_FLAGS), framework)
        combined, _, _ = buf.combine(expert_out, args["topk_idx"], to_framework(case.weights[group.rank], framework),
                                     args["active_ranks"], -1, handle)
        # torch's scales come as DeepEP's (column-major in their last two dimensions), the others row-major.
        strides = swapped_last_axes_strides(tuple(scales.shape)) if framework == "torch" else (
            c_contiguous_strides(tuple(scales.shape)))
        assert to_numpy(scales).strides == tuple(4 * s for s in strides)
        return [type(obj) for obj in (q, scales, count, combined)]

    for types in spawn(2, rank_fn):
        for got in types:
            assert issubclass(got, expected_type), f"{framework} caller got {got}"


def test_jax_active_ranks_array_is_not_mutated():
    pytest.importorskip("jax")
    case = make_case(11, num_ranks=2, hidden=128, actives=[[1, 1], [0, 1]])  # rank 0 will mask rank 1

    def rank_fn(group):
        args = dispatch_args(case, group.rank, "jax")
        new_buffer(group, case).dispatch(**args, **BF16_FLAGS)
        return to_numpy(args["active_ranks"]).copy()

    masks = spawn(2, rank_fn)
    np.testing.assert_array_equal(masks[0], case.actives[0])


# --- out= -------------------------------------------------------------------------------------------


def dispatch_outs(case: Case, flags: dict, framework: str, scales_layout: str = "row-major"):
    """Poisoned out= arrays of a dispatch; fp8 scales row-major or ``"swapped"`` (DeepEP's layout)."""
    shape = (case.num_local_experts, case.num_ranks * case.num_max_tokens, case.hidden)
    count = to_framework(poisoned((case.num_local_experts,), np.int32), framework)
    if not flags.get("use_fp8", True):
        return to_framework(poisoned(shape, BF16), framework), count
    columns = reference.num_scale_columns(case.hidden, flags.get("use_ue8m0", False))
    scale_dtype = np.int32 if flags.get("use_ue8m0") else np.float32
    if scales_layout == "swapped":
        scales = to_framework(poisoned((shape[0], columns, shape[1]), scale_dtype), framework).swapaxes(1, 2)
    else:
        scales = to_framework(poisoned(shape[:2] + (columns,), scale_dtype), framework)
    return (to_framework(poisoned(shape, FP8), framework), scales), count


def unpack_dispatch_out(out, flags):
    recv_x, count = out
    q, scales = split_recv(recv_x, flags)
    return q, scales, to_numpy(count)


@pytest.mark.parametrize("flags, scales_layout",
                         [(flags, "row-major") for flags in ALL_FLAGS] + [(FP8_FLAGS, "swapped"), (UE8M0_FLAGS, "swapped")],
                         ids=FLAG_IDS + ["fp8-swapped-scales", "fp8-ue8m0-swapped-scales"])
@pytest.mark.parametrize("framework", ["numpy", "torch"])
def test_out_arrays_are_written_in_place(framework, flags, scales_layout):
    import_framework(framework)
    case = make_case(12, num_ranks=2, hidden=256)

    def rank_fn(group):
        rank = group.rank
        buf = new_buffer(group, case)
        out = dispatch_outs(case, flags, framework, scales_layout)
        args = dispatch_args(case, rank, framework)
        recv_x, count, handle, _, _ = buf.dispatch(**args, **flags, out=out)
        assert count is out[1]
        if flags["use_fp8"]:
            assert recv_x[0] is out[0][0] and recv_x[1] is out[0][1]
        else:
            assert recv_x is out[0]
        q, scales, counts = unpack_dispatch_out(out, flags)
        expert_out = to_framework(expert_fn(rank, q, scales, flags), framework)
        combined_out = to_framework(poisoned(case.xs[rank].shape, BF16), framework)
        combined, _, _ = buf.combine(expert_out, args["topk_idx"], to_framework(case.weights[rank], framework),
                                     args["active_ranks"], -1, handle, out=combined_out)
        assert combined is combined_out
        return Step(q.copy(), None if scales is None else scales.copy(), counts.copy(), to_numpy(combined_out).copy())

    check_steps(case, flags, spawn(2, rank_fn), masks=False)


# --- hook and async modes ---------------------------------------------------------------------------


@pytest.mark.parametrize("flags", [BF16_FLAGS, UE8M0_FLAGS], ids=["bf16", "fp8-ue8m0"])
def test_hook_mode_fills_outputs_only_when_hook_is_called(flags):
    case = make_case(13, num_ranks=2, hidden=128)

    def rank_fn(group):
        rank = group.rank
        buf = new_buffer(group, case)
        out = dispatch_outs(case, flags, "numpy")
        arrays = [out[0][0], out[0][1], out[1]] if flags["use_fp8"] else list(out)
        snapshot = [bits(a).copy() for a in arrays]
        args = dispatch_args(case, rank)
        _, _, handle, event, hook = buf.dispatch(**args, **flags, return_recv_hook=True, out=out)
        assert isinstance(event, EventOverlap) and callable(hook)
        for before, array in zip(snapshot, arrays):
            np.testing.assert_array_equal(before, bits(array))  # the receive half has not run
        # combine needs the receive half: refused (before communicating) until hook() runs.
        expert_out = np.zeros((case.num_local_experts, 2 * case.num_max_tokens, case.hidden), BF16)
        for where, call in [
                ("combine", lambda: buf.combine(expert_out, args["topk_idx"], case.weights[rank],
                                                args["active_ranks"], -1, handle)),
                ("get_next_combine_buffer", lambda: buf.get_next_combine_buffer(handle))]:
            with pytest.raises(RuntimeError, match=rf"^{where}: the dispatch of this handle has not received yet: "
                                                   rf"call its hook\(\) first$"):
                call()
        hook()
        with pytest.raises(RuntimeError, match="already called"):
            hook()
        q, scales, counts = unpack_dispatch_out(out, flags)
        expert_out = expert_fn(rank, q, scales, flags)
        combined_out = poisoned(case.xs[rank].shape, BF16)
        before = bits(combined_out).copy()
        _, event, combine_hook = buf.combine(expert_out, args["topk_idx"], case.weights[rank], args["active_ranks"],
                                             -1, handle, return_recv_hook=True, out=combined_out)
        assert isinstance(event, EventOverlap) and callable(combine_hook)
        np.testing.assert_array_equal(bits(combined_out), before)
        combine_hook()
        return Step(q.copy(), None if scales is None else scales.copy(), counts.copy(), combined_out.copy())

    check_steps(case, flags, spawn(2, rank_fn), masks=False)


def test_two_hooks_may_be_pending_and_run_in_any_order():
    cases = [make_case(14, num_ranks=2, hidden=128), make_case(15, num_ranks=2, hidden=128)]

    def rank_fn(group):
        rank = group.rank
        buf = new_buffer(group, cases[0])
        pending = [buf.dispatch(**dispatch_args(c, rank), **FP8_FLAGS, return_recv_hook=True) for c in cases]
        pending[1][4]()
        pending[0][4]()
        steps = []
        for c, ((q, scales), count, handle, _, _) in zip(cases, pending):
            expert_out = expert_fn(rank, q, scales, FP8_FLAGS)
            combined, _, _ = buf.combine(expert_out, c.topk_idxs[rank], c.weights[rank], c.actives[rank].copy(), -1,
                                         handle)
            steps.append(Step(q.copy(), scales.copy(), count.copy(), combined.copy()))
        return steps

    results = spawn(2, rank_fn)
    for i, c in enumerate(cases):
        check_steps(c, FP8_FLAGS, [r[i] for r in results], masks=False)


def test_a_receive_hook_dropped_uncalled_leaves_the_buffer_usable():
    """The caller's code raised between a hook-mode call and its hook() (an expert's OOM, say), and the
    hook went with the frame: it stayed pending for good, so every later dispatch on its parity and
    update_ep_member were refused (helper-165). Dropped uncalled, it is given up as a receive that
    failed: its handle is refused by name, and the next steps equal the reference."""
    def rank_fn(group):
        rank = group.rank
        buf = new_buffer(group, VCASE)

        def step_that_raises_before_its_hook(call):
            recv_x, _, handle, _, hook = buf.dispatch(**dispatch_args(VCASE, rank), **BF16_FLAGS,
                                                      return_recv_hook=(call == "dispatch"))
            if call == "combine":
                buf.combine(expert_fn(rank, recv_x, None, BF16_FLAGS), dispatch_args(VCASE, rank)["topk_idx"],
                            VCASE.weights[rank], dispatch_args(VCASE, rank)["active_ranks"], -1, handle,
                            return_recv_hook=True)
            raise MemoryError("an expert ran out of memory")

        steps = []
        for call in ("dispatch", "combine"):
            with pytest.raises(MemoryError):
                step_that_raises_before_its_hook(call)
            gc.collect()
            steps += [run_step(buf, VCASE, rank, BF16_FLAGS) for _ in range(2)]  # both parities
        _, _, handle, _, hook = buf.dispatch(**dispatch_args(VCASE, rank), **BF16_FLAGS, return_recv_hook=True)
        del hook
        gc.collect()
        with pytest.raises(RuntimeError, match=r"^combine: the receive half of this handle's dispatch raised \(its "
                                               r"receive hook was dropped without being called\)"):
            buf.combine(np.zeros((VCASE.num_local_experts, 2 * VCASE.num_max_tokens, VCASE.hidden), BF16),
                        dispatch_args(VCASE, rank)["topk_idx"], VCASE.weights[rank],
                        dispatch_args(VCASE, rank)["active_ranks"], -1, handle)
        assert buf.update_ep_member() == []
        return steps

    results = spawn(2, rank_fn)
    for i in range(4):
        check_steps(VCASE, BF16_FLAGS, [steps[i] for steps in results])


def test_a_third_dispatch_while_two_receive_hooks_are_pending_is_refused():
    """Each pending receive half holds one workspace half (its parity): a third dispatch, in hook mode
    or not, would restage the half the first one's hook has yet to read. It is refused, counting
    nothing: both hooks then run, both handles (neither made stale by the refused calls) combine to
    the reference, and a full step after them does too."""
    def rank_fn(group):
        rank = group.rank
        buf = new_buffer(group, VCASE)
        pending = [buf.dispatch(**dispatch_args(VCASE, rank), **BF16_FLAGS, return_recv_hook=True) for _ in range(2)]
        for return_recv_hook in (False, True):
            with pytest.raises(RuntimeError, match=r"^dispatch: the dispatch two calls ago still waits for its "
                                                   r"hook\(\); call it first \(at most two receive hooks may be "
                                                   r"pending\)$"):
                buf.dispatch(**dispatch_args(VCASE, rank), **BF16_FLAGS, return_recv_hook=return_recv_hook)
        assert buf._num_dispatches == 2
        for _, _, _, _, hook in pending:
            hook()
        steps = []
        for recv_x, count, handle, _, _ in pending:
            combined, _, _ = Ctx(rank, handle, expert_fn(rank, recv_x, None, BF16_FLAGS)).combine(buf)
            steps.append(Step(recv_x.copy(), None, count.copy(), combined.copy()))
        return steps, run_step(buf, VCASE, rank, FP8_FLAGS)

    results = spawn(2, rank_fn)
    for i in range(2):
        check_steps(VCASE, BF16_FLAGS, [steps[i] for steps, _ in results], masks=False)
    check_steps(VCASE, FP8_FLAGS, [step for _, step in results])


@pytest.mark.parametrize("flags", [BF16_FLAGS, FP8_FLAGS], ids=["bf16", "fp8"])
def test_async_mode_returns_a_waitable_event_and_correct_results(flags):
    case = make_case(16, num_ranks=2, hidden=256)

    def rank_fn(group):
        rank = group.rank
        buf = new_buffer(group, case)
        args = dispatch_args(case, rank)
        recv_x, count, handle, event, hook = buf.dispatch(**args, **flags, async_finish=True)
        assert hook is None and isinstance(event, EventOverlap)
        event.current_stream_wait()
        q, scales = split_recv(recv_x, flags)
        expert_out = expert_fn(rank, q, scales, flags)
        combined, event, hook = buf.combine(expert_out, args["topk_idx"], case.weights[rank], args["active_ranks"],
                                            -1, handle, async_finish=True)
        assert hook is None and isinstance(event, EventOverlap)
        with event:
            pass
        return Step(q, scales, count, combined)

    check_steps(case, flags, spawn(2, rank_fn), masks=False)


# --- zero-copy combine ------------------------------------------------------------------------------


@pytest.mark.parametrize("framework", ["numpy", "torch"])
def test_zero_copy_combine_reads_the_next_combine_buffer(framework):
    import_framework(framework)
    case = make_case(17, num_ranks=2, hidden=256)
    flags = FP8_FLAGS

    def rank_fn(group):
        rank = group.rank
        buf = new_buffer(group, case)
        args = dispatch_args(case, rank, framework)
        recv_x, count, handle, _, _ = buf.dispatch(**args, **flags)
        q, scales = split_recv(recv_x, flags)
        target = buf.get_next_combine_buffer(handle)
        assert isinstance(target, framework_type(framework))
        assert tuple(target.shape) == (case.num_local_experts, 2 * case.num_max_tokens, case.hidden)
        expert_out = expert_fn(rank, q, scales, flags)
        if framework == "torch":
            target.copy_(to_framework(expert_out, "torch"))
        else:
            target[...] = expert_out
        combined, _, _ = buf.combine(None, args["topk_idx"], to_framework(case.weights[rank], framework),
                                     args["active_ranks"], -1, handle, zero_copy=True)
        return Step(q.copy(), scales.copy(), to_numpy(count).copy(), to_numpy(combined).copy())

    check_steps(case, flags, spawn(2, rank_fn), masks=False)


# --- validation -------------------------------------------------------------------------------------

# The configuration of the validation tests: two ranks, four experts, T = 4, hidden 256.
VCASE = make_case(18, num_ranks=2, num_max_tokens=4, hidden=256, num_experts=4, num_topk=2, num_tokens=[3, 4])


@dataclasses.dataclass
class Ctx:
    """What a bad call needs on one rank: the good inputs of VCASE and a live handle."""

    rank: int
    handle: Handle
    expert_out: np.ndarray
    framework: str = "numpy"  # of the good inputs, and of the numpy arrays among the overrides

    def dispatch(self, buf, **overrides):
        args = dispatch_args(VCASE, self.rank, self.framework, **self.in_framework(overrides))
        flags = {k: args.pop(k) for k in ("use_fp8", "round_scale", "use_ue8m0") if k in args}
        return buf.dispatch(**args, **({"use_fp8": False} | flags))

    def combine(self, buf, **overrides):
        args = dict(x=self.expert_out, topk_idx=VCASE.topk_idxs[self.rank].copy(),
                    topk_weights=VCASE.weights[self.rank].copy(), active_ranks=VCASE.actives[self.rank].copy(),
                    timeout_us=-1, handle=self.handle)
        args = self.in_framework(args)
        args.update(self.in_framework(overrides))
        return buf.combine(**args)

    def in_framework(self, overrides: dict) -> dict:
        if self.framework == "numpy":
            return overrides  # as given: some share memory on purpose (a copy would part them)
        return {k: to_framework(v, self.framework) if isinstance(v, np.ndarray) else v for k, v in overrides.items()}


# --- torch's autograd and out= ----------------------------------------------------------------------


def test_torch_out_arrays_keep_autograd_honest():
    """An out= tensor that requires grad is refused while torch records gradients (as torch's out= ops
    refuse it), and each write counts in the version counters, in every grad mode: a tensor saved for
    a backward and then overwritten by the next call makes that backward raise instead of using the
    new values."""
    torch = pytest.importorskip("torch")

    def rank_fn(group):
        rank = group.rank
        buf = new_buffer(group, VCASE)
        args = dispatch_args(VCASE, rank, "torch")
        recv_x = torch.zeros((2, 8, 256), dtype=torch.bfloat16)
        out = (recv_x, torch.zeros(2, dtype=torch.int32))
        with pytest.raises(ValueError, match=r"^dispatch: out recv_x requires grad, and the call writes into it"):
            buf.dispatch(**args, **BF16_FLAGS, out=(recv_x.clone().requires_grad_(), out[1]))
        with torch.no_grad():  # as torch's out= ops, only while gradients are recorded
            buf.dispatch(**args, **BF16_FLAGS, out=(recv_x.clone().requires_grad_(), out[1]))
        versions = (recv_x._version, out[1]._version)
        buf.dispatch(**args, **BF16_FLAGS, out=out)
        assert (recv_x._version, out[1]._version) == (versions[0] + 1, versions[1] + 1)
        scale = torch.ones((), dtype=torch.bfloat16, requires_grad=True)
        loss = (recv_x * scale).float().sum()  # saves recv_x for the gradient of scale
        buf.dispatch(**args, **BF16_FLAGS, out=out)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()
        # An engine's eval step reusing the buffers a training graph saved: counted there too, as
        # torch's out= ops count it (helper-145: that backward ran on the new values).
        for grad_off in (torch.no_grad, torch.inference_mode):
            loss = (recv_x * scale).float().sum()
            with grad_off():
                buf.dispatch(**args, **BF16_FLAGS, out=out)
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                loss.backward()
        return run_step(buf, VCASE, rank, FP8_FLAGS)

    check_steps(VCASE, FP8_FLAGS, spawn(2, rank_fn))


def test_torch_subclass_callers_get_torch_results():
    torch = pytest.importorskip("torch")

    class TensorOfItsOwn(torch.Tensor):
        pass

    def rank_fn(group):
        buf = new_buffer(group, VCASE)
        args = dispatch_args(VCASE, group.rank, "torch")
        args["x"] = args["x"].as_subclass(TensorOfItsOwn)
        recv_x, recv_count, _, _, _ = buf.dispatch(**args, **BF16_FLAGS)
        return isinstance(recv_x, torch.Tensor) and isinstance(recv_count, torch.Tensor)

    assert spawn(2, rank_fn) == [True, True]


def test_jax_callers_get_results_on_the_device_of_their_arrays():
    jax = pytest.importorskip("jax")
    device = jax.devices("cpu")[1]  # not JAX's default device (tests/conftest.py makes 8)

    def rank_fn(group):
        rank = group.rank
        buf = new_buffer(group, VCASE)
        args = {name: jax.device_put(value, device) if name in ("x", "topk_idx", "active_ranks") else value
                for name, value in dispatch_args(VCASE, rank, "jax").items()}
        recv_x, recv_count, handle, _, _ = buf.dispatch(**args, **BF16_FLAGS)
        expert_out = jax.device_put(expert_fn(rank, np.asarray(recv_x), None, BF16_FLAGS), device)
        combined, _, _ = buf.combine(expert_out, args["topk_idx"], jax.device_put(VCASE.weights[rank], device),
                                     args["active_ranks"], -1, handle)
        return [array.devices() for array in (recv_x, recv_count, combined)]

    for devices in spawn(2, rank_fn):
        assert devices == [{device}] * 3


# --- call sequencing: hooks, ranks in different calls ------------------------------------------------


def test_a_receive_hook_writes_only_the_ranks_it_masked():
    """The kernels only ever write 0 into active_ranks; so does a receive half run later (a hook): a rank
    masked meanwhile, by the caller or by a newer call's receive half, stays masked."""
    def rank_fn(group):
        rank, peer = group.rank, 1 - group.rank
        buf = new_buffer(group, VCASE)
        active = np.ones(2, np.int32)  # an engine's one mask, passed to every call
        args = dispatch_args(VCASE, rank, active_ranks=active)
        recv_x, _, handle, _, dispatch_hook = buf.dispatch(**args, **BF16_FLAGS, return_recv_hook=True)
        active[peer] = 0  # the caller learns that the peer died
        dispatch_hook()
        after_dispatch = active.copy()
        active[peer] = 1
        expert_out = expert_fn(rank, recv_x, None, BF16_FLAGS)
        _, _, combine_hook = buf.combine(expert_out, VCASE.topk_idxs[rank], VCASE.weights[rank], active, -1, handle,
                                         return_recv_hook=True)
        active[peer] = 0
        combine_hook()
        return after_dispatch, active.copy()

    for rank, masks in enumerate(spawn(2, rank_fn)):
        expected = np.ones(2, np.int32)
        expected[1 - rank] = 0
        for mask in masks:
            np.testing.assert_array_equal(mask, expected)


def test_a_receive_hook_reads_this_ranks_mask_when_it_runs_as_the_kernels_do():
    """The receive half reads the caller's active_ranks when hook() runs (the kernels' does): a peer
    masked between the halves delivers no rows and adds no expert outputs; a peer re-admitted by then
    is received. The send half went by the mask of the call: a rank masked in its own mask then
    never sent itself rows, so it gets none from itself (and masks itself) even if re-admitted."""
    num_ranks, num_experts, num_tokens, hidden = 2, 4, 2, 128
    topk = np.array([[0, 2], [1, 3]])  # each token to one expert on each rank

    def rank_fn(group, scenario):
        rank, peer = group.rank, 1 - group.rank
        buf = ep.Buffer(group, ep.Buffer.get_ep_buffer_size_hint(num_tokens, hidden, num_ranks, num_experts),
                        backend="reference")
        x = np.full((num_tokens, hidden), rank + 1, reference.bfloat16)
        active = np.ones(num_ranks, np.int32)
        if scenario == "combine":  # rank r's experts multiply by 10 (r + 1); the peer masked before the hook
            recv_x, _, handle, _, _ = buf.dispatch(x, topk, active, num_tokens, num_experts, use_fp8=False)
            expert_out = (recv_x.astype(np.float32) * 10 * (rank + 1)).astype(reference.bfloat16)
            combined, _, hook = buf.combine(expert_out, topk, np.ones((num_tokens, 2), np.float32), active, -1,
                                            handle, return_recv_hook=True)
            active[peer] = 0
            hook()
            return combined.astype(np.float32)[:, 0].tolist(), active.tolist()
        masked_at_call = {"mask": None, "readmit": peer if rank == 0 else None, "self": rank}[scenario]
        if masked_at_call is not None:
            active[masked_at_call] = 0
        _, count, _, _, hook = buf.dispatch(x, topk, active, num_tokens, num_experts, use_fp8=False, timeout_us=0,
                                            return_recv_hook=True)
        if scenario == "mask":
            active[peer] = 0
        elif masked_at_call is not None:
            active[masked_at_call] = 1
        hook()
        return count.tolist(), active.tolist()

    mask, readmit, itself, combine = (spawn(num_ranks, rank_fn, scenario)
                                      for scenario in ("mask", "readmit", "self", "combine"))
    assert mask == [([1, 1], [1, 0]), ([1, 1], [0, 1])]  # own rows only
    # Rank 0 re-admitted rank 1, which had sent it its rows; rank 1 got nothing from rank 0, whose
    # send half skipped it, and masked it.
    assert readmit == [([2, 2], [1, 1]), ([1, 1], [0, 1])]
    assert itself == [([1, 1], [0, 1]), ([1, 1], [1, 0])]  # each rank's rows from its peer only
    assert combine == [([10.0, 10.0], [1, 0]), ([40.0, 40.0], [0, 1])]  # x (r + 1) times own experts only


def test_a_receive_hook_that_raises_is_no_longer_pending_and_its_handle_is_refused():
    def rank_fn(group):
        rank = group.rank
        buf = new_buffer(group, VCASE)
        compute = buf._reference.dispatch

        def fails(*args, **kwargs):
            raise RuntimeError("injected")
        buf._reference.dispatch = fails  # this rank's receive half fails, after the exchange
        _, _, handle, _, hook = buf.dispatch(**dispatch_args(VCASE, rank), **BF16_FLAGS, return_recv_hook=True)
        with pytest.raises(RuntimeError, match="injected"):
            hook()
        buf._reference.dispatch = compute
        with pytest.raises(RuntimeError, match=r"combine: the receive half of this handle's dispatch raised "
                                               r"\(RuntimeError: injected\)"):
            Ctx(rank, handle, np.zeros((2, 8, 256), BF16)).combine(buf)
        with pytest.raises(RuntimeError, match="already called"):
            hook()
        # Two more steps: the second dispatch is on the failed one's parity, no longer held by it.
        return [run_step(buf, VCASE, rank, flags) for flags in (FP8_FLAGS, BF16_FLAGS)]

    results = spawn(2, rank_fn)
    check_steps(VCASE, FP8_FLAGS, [first for first, _ in results])
    check_steps(VCASE, BF16_FLAGS, [second for _, second in results])


@pytest.mark.parametrize("field,rank_1_overrides", [
    ("num_max_dispatch_tokens_per_rank", dict(num_max_dispatch_tokens_per_rank=8)),
    ("hidden", dict(x=np.zeros((len(VCASE.xs[1]), 128), BF16))),
    ("use_fp8", dict(use_fp8=True)),
], ids=["T", "hidden", "use_fp8"])
def test_ranks_in_different_calls_raise_on_every_rank_and_count_nothing(field, rank_1_overrides):
    """Every rank's call is valid on its own; the exchange finds that they are not the same call."""
    def rank_fn(group):
        rank = group.rank
        buf = new_buffer(group, VCASE, ep.Buffer.get_ep_buffer_size_hint(8, VCASE.hidden, 2, VCASE.num_experts))
        with pytest.raises(ValueError, match=rf"^dispatch: the ranks are not in the same call: they disagree on "
                                             rf"{field} \(rank 0: .*, rank 1: .*\); every rank must make the same"):
            Ctx(rank, None, None).dispatch(buf, **(rank_1_overrides if rank == 1 else {}))
        assert buf._num_dispatches == 0
        return run_step(buf, VCASE, rank, FP8_FLAGS)

    check_steps(VCASE, FP8_FLAGS, spawn(2, rank_fn))


def test_two_buffers_called_in_different_orders_raise_on_every_rank():
    """The reference backend's exchanges pair whatever the ranks send: rank 1 calling the Buffers in
    another order than rank 0 would mix their data. Each exchange names its Buffer instead."""
    def rank_fn(group):
        rank = group.rank
        buffers = [new_buffer(group, VCASE), new_buffer(group, VCASE)]
        for buf in buffers if rank == 0 else buffers[::-1]:
            with pytest.raises(ValueError, match=r"dispatch: the ranks are not in the same call: they disagree on "
                                                 r"Buffer \(rank 0: 'Buffer #0', rank 1: 'Buffer #1'\)"):
                buf.dispatch(**dispatch_args(VCASE, rank), **BF16_FLAGS)
        return [run_step(buf, VCASE, rank, FP8_FLAGS) for buf in buffers]

    results = spawn(2, rank_fn)
    for i in range(2):
        check_steps(VCASE, FP8_FLAGS, [steps[i] for steps in results])


def test_a_rank_building_a_buffer_while_another_dispatches_raises_on_both():
    """The handshake and the data exchange share the group's collectives: each tells the other apart."""
    def rank_fn(group):
        buf = new_buffer(group, VCASE)
        if group.rank == 0:
            with pytest.raises(ValueError, match=r"^Buffer: the ranks are not in the same call: rank 1 is not building "
                                                 r"a Buffer or in update_ep_member"):
                new_buffer(group, VCASE)
        else:
            with pytest.raises(ValueError, match=r"^dispatch: the ranks are not in the same call: they disagree on "
                                                 r"call \(rank 0: 'a Buffer construction or update_ep_member', rank 1: "
                                                 r"'dispatch'\)"):
                buf.dispatch(**dispatch_args(VCASE, 1), **BF16_FLAGS)
        return run_step(buf, VCASE, group.rank, FP8_FLAGS)

    check_steps(VCASE, FP8_FLAGS, spawn(2, rank_fn))


def test_a_peers_call_this_host_cannot_hold_is_out_of_memory_not_a_mismatch(monkeypatch):
    """The exchange reads a blob that does not unpickle as a handshake; one that fails for want of memory
    is a call of ours all the same, and the MemoryError says so (it had read as ranks in different calls)."""
    from mooncake_ep import _reference_backend

    def no_memory(blob):
        raise MemoryError("test: no room for the peer's expert outputs")
    monkeypatch.setattr(_reference_backend.pickle, "loads", no_memory)
    with pytest.raises(MemoryError, match="no room"):
        _reference_backend._call_and_arrays(b"any blob")
    monkeypatch.undo()
    assert _reference_backend._call_and_arrays(b'{"json": "a handshake"}') == (_reference_backend._NOT_A_DATA_EXCHANGE,
                                                                             (), None)


# Dispatch arguments a rank refuses for their shapes, before its exchange: 5 tokens, T = 4.
TOO_MANY_TOKENS = dict(x=np.zeros((5, 256), BF16), topk_idx=np.zeros((5, 2), np.int64))


def test_a_peer_that_refused_the_call_is_what_the_others_timeout_names():
    """A call one rank refuses for its own shapes (checked before its exchange; a refusal of its values
    goes through the exchange) is as if never made there, so its peers wait in the exchange until the
    group's timeout_s. Their GroupError had named only the group's collective ("allgather_bytes #1 timed
    out"); it now names the call and its number (review, helper-105)."""
    timeout_s = 0.5

    def rank_fn(group):
        buf = new_buffer(group, VCASE)
        run_step(buf, VCASE, group.rank, BF16_FLAGS)  # the Buffer works before: dispatch number 0
        if group.rank == 1:
            with pytest.raises(ValueError, match=r"^dispatch: x has 5 tokens, more than "):
                buf.dispatch(**dispatch_args(VCASE, 1, **TOO_MANY_TOKENS), **BF16_FLAGS)
            return None
        with pytest.raises(ep.GroupError) as info:
            buf.dispatch(**dispatch_args(VCASE, 0), **BF16_FLAGS)
        return str(info.value)

    message, refused = ep.LocalGroup(2, timeout_s=GROUP_TIMEOUT_S).spawn(rank_fn, timeout_s=timeout_s)
    assert refused is None
    assert re.fullmatch(rf"dispatch \(dispatch number 1 of this Buffer\): the exchange with the other ranks failed: "
                        rf"allgather_bytes #\d+ timed out after {timeout_s} s waiting for ranks \[1\] of 2 "
                        rf"\(LocalGroup\)", message), message


def test_a_rank_that_fails_in_spawn_is_what_spawn_raises_not_the_peer_released_from_the_exchange():
    """LocalGroup releases a rank waiting in a collective when a peer fails (_PeerAbortedError), and spawn
    raises the failed rank's own error. The exchange's naming of the call must let that release through
    as it is: wrapped, it read as rank 0's own failure, and spawn raised it instead (helper-108)."""
    def rank_fn(group):
        buf = new_buffer(group, VCASE)
        run_step(buf, VCASE, group.rank, BF16_FLAGS)  # rank 0 then waits in the next exchange, not the handshake
        if group.rank == 1:  # refused before its exchange
            buf.dispatch(**dispatch_args(VCASE, 1, **TOO_MANY_TOKENS), **BF16_FLAGS)
        buf.dispatch(**dispatch_args(VCASE, 0), **BF16_FLAGS)

    with pytest.raises(ValueError, match=r"^dispatch: x has 5 tokens, more than "):
        ep.LocalGroup(2, timeout_s=GROUP_TIMEOUT_S).spawn(rank_fn)


def test_an_exchange_without_a_call_number_is_named_by_its_call_alone():
    """The JAX ops' exchanges carry their parity, not a call number: the name is then the call's alone."""
    from mooncake_ep._reference_backend import ReferenceBackend

    class BrokenGroup:
        rank, world_size = 0, 2

        def allgather_bytes(self, data):
            raise ep.GroupError("allgather_bytes #4: the group is broken by an earlier failure")

    backend = ReferenceBackend(BrokenGroup())
    with pytest.raises(ep.GroupError, match=r"^mooncake_ep\.jax\.dispatch: the exchange with the other ranks failed: "
                                            r"allgather_bytes #4: the group is broken by an earlier failure$"):
        backend.exchange("mooncake_ep.jax.dispatch", (("call", "dispatch"), ("parity", 0)), np.zeros(1))


def test_ranks_updating_different_buffers_are_refused_and_can_update_alike():
    """Two Buffers of one size: nothing but their names tells them apart, and ranks updating them in
    different orders had each adopted the other's dispatch count (on the GPU, its peers' workspaces).
    Refused on every rank with the names, nothing changed; the same order then works (review, helper-81)."""
    def rank_fn(group):
        rank = group.rank
        first, second = new_buffer(group, VCASE), new_buffer(group, VCASE)
        for _ in range(3):
            run_step(first, VCASE, rank, BF16_FLAGS)
        with pytest.raises(ep.RankMismatchError, match=r"update_ep_member: the ranks are updating different Buffers "
                                                       r"\(their names: rank 0: '[0-9a-f]+', rank 1: '[0-9a-f]+'\); "
                                                       r"every rank must call update_ep_member on its rank of the "
                                                       r"same Buffer"):
            (first if rank == 0 else second).update_ep_member()
        assert (first._num_dispatches, second._num_dispatches) == (3, 0)
        assert first.update_ep_member() == [] and second.update_ep_member() == []
        return run_step(second, VCASE, rank, BF16_FLAGS)

    check_steps(VCASE, BF16_FLAGS, spawn(2, rank_fn))


def test_update_ep_member_adopts_the_largest_dispatch_count():
    """Ranks whose dispatch counts differ (a dispatch counted on one rank and not on another: its
    exchange failed there) make different calls: the next one is refused as mismatched. update_ep_member
    sets every rank to the most any rank made, as the README says, and the next step equals the
    reference on every rank."""
    def rank_fn(group):
        rank = group.rank
        buf = new_buffer(group, VCASE)
        run_step(buf, VCASE, rank, BF16_FLAGS)
        if rank == 1:
            buf._num_dispatches += 1  # the dispatch this rank counted and rank 0 did not
        counts = [buf._num_dispatches]
        assert buf.update_ep_member() == []
        counts.append(buf._num_dispatches)
        return counts, run_step(buf, VCASE, rank, FP8_FLAGS)

    results = spawn(2, rank_fn)
    assert [counts for counts, _ in results] == [[1, 2], [2, 2]]
    check_steps(VCASE, FP8_FLAGS, [step for _, step in results])


def test_a_buffer_that_replaces_rank_0_takes_the_survivors_name():
    """The Buffer's name (what its calls are matched by) is the survivors' when a rank builds a fresh
    Buffer while the others update, rank 0 included; it had been rank 0's new one, which no survivor
    had, and every later call was refused (review, helper-81)."""
    def rank_fn(group):
        rank = group.rank
        buf = new_buffer(group, VCASE)
        run_step(buf, VCASE, rank, BF16_FLAGS)
        if rank == 0:
            buf = new_buffer(group, VCASE)  # rank 0's process replaced (in-process groups allow it)
        else:
            assert buf.update_ep_member() == [0]
        return buf._token, run_step(buf, VCASE, rank, FP8_FLAGS)

    results = spawn(2, rank_fn)
    assert results[0][0] == results[1][0]
    check_steps(VCASE, FP8_FLAGS, [step for _, step in results])


def test_a_pending_combine_hook_holds_its_dispatchs_parity_and_update_ep_member():
    """A combine's receive half reads the routing of the dispatch it answers: the dispatch two calls
    later, which rewrites it, waits for that hook, and so does update_ep_member."""
    def rank_fn(group):
        rank = group.rank
        buf = new_buffer(group, VCASE)
        recv_x, _, handle, _, _ = buf.dispatch(**dispatch_args(VCASE, rank), **BF16_FLAGS)
        combined, _, hook = Ctx(rank, handle, expert_fn(rank, recv_x, None, BF16_FLAGS)).combine(
            buf, return_recv_hook=True)
        buf.dispatch(**dispatch_args(VCASE, rank), **BF16_FLAGS)
        with pytest.raises(RuntimeError, match=r"dispatch: a combine of the dispatch two calls ago still waits for "
                                               r"its hook\(\)"):
            buf.dispatch(**dispatch_args(VCASE, rank), **BF16_FLAGS)
        with pytest.raises(RuntimeError, match=r"update_ep_member: ranks \[0, 1\] have receive hooks pending"):
            buf.update_ep_member()
        hook()
        assert buf.update_ep_member() == []
        return combined.copy(), run_step(buf, VCASE, rank, FP8_FLAGS)

    results = spawn(2, rank_fn)
    for rank, (combined, _) in enumerate(results):
        np.testing.assert_array_equal(bits(combined), bits(expected_step(VCASE, BF16_FLAGS)[rank].combined))
    check_steps(VCASE, FP8_FLAGS, [step for _, step in results])


def test_zero_copy_without_the_combine_buffer_is_refused_and_buffer_stays_usable():
    case = make_case(18, num_ranks=2, hidden=128)
    flags = BF16_FLAGS

    def rank_fn(group):
        rank = group.rank
        buf = new_buffer(group, case)
        args = dispatch_args(case, rank)
        recv_x, count, handle, _, _ = buf.dispatch(**args, **flags)
        weights = case.weights[rank]
        with pytest.raises(ValueError, match="get_next_combine_buffer"):
            buf.combine(None, args["topk_idx"], weights, args["active_ranks"], -1, handle, zero_copy=True)
        expert_out = expert_fn(rank, recv_x, None, flags)
        combined, _, _ = buf.combine(expert_out, args["topk_idx"], weights, args["active_ranks"], -1, handle)
        return Step(np.asarray(recv_x).copy(), None, np.asarray(count).copy(), np.asarray(combined).copy())

    check_steps(case, flags, spawn(2, rank_fn), masks=False)


@pytest.mark.parametrize("devices, second_combine_refused", [(None, False), ([0, 0], False), ([0, 1], True)])
def test_a_second_combine_is_refused_where_peers_would_read_copies(devices, second_combine_refused):
    """In-process ranks on several GPUs read each other's expert outputs from copies in the workspace,
    which a second combine would rewrite under a slower peer's reads: the CUDA backend refuses it, and
    the reference backend must too, or a CPU test passes what a GPU run refuses (helper-144). The
    ranks run in threads of their own: LocalGroup.spawn with devices needs a GPU."""
    case = make_case(20, num_ranks=2, hidden=128)
    flags = BF16_FLAGS
    local_group = ep.LocalGroup(2, devices=devices, timeout_s=GROUP_TIMEOUT_S)
    steps, errors = [None, None], [None, None]

    def rank_fn(rank):
        try:
            buf = new_buffer(local_group.rank_group(rank), case)
            args = dispatch_args(case, rank)
            recv_x, count, handle, _, _ = buf.dispatch(**args, **flags)
            expert_out = expert_fn(rank, recv_x, None, flags)
            weights = case.weights[rank]
            combined, _, _ = buf.combine(expert_out, args["topk_idx"], weights, args["active_ranks"], -1, handle)
            steps[rank] = Step(np.asarray(recv_x).copy(), None, np.asarray(count).copy(), np.asarray(combined).copy())
            if second_combine_refused:
                with pytest.raises(RuntimeError, match=r"combine: this handle was already combined through the "
                                                       r"workspace"):
                    buf.combine(expert_out, args["topk_idx"], weights, args["active_ranks"], -1, handle)
            else:
                again, _, _ = buf.combine(expert_out, args["topk_idx"], weights, args["active_ranks"], -1, handle)
                np.testing.assert_array_equal(bits(again), bits(combined))
        except BaseException as exc:  # noqa: BLE001 - raised in the test's thread below
            errors[rank] = exc

    threads = [threading.Thread(target=rank_fn, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for error in errors:
        if error is not None:
            raise error
    check_steps(case, flags, steps, masks=False)


def test_zero_copy_combine_refuses_to_write_into_the_buffer_it_reads():
    """out= or active_ranks inside get_next_combine_buffer(handle) would overwrite the expert outputs
    while they are read, here and by every peer: refused, and the rows stay for the combine after."""
    case = make_case(19, num_ranks=2, hidden=256)
    flags = FP8_FLAGS

    def rank_fn(group):
        rank = group.rank
        buf = new_buffer(group, case)
        args = dispatch_args(case, rank)
        recv_x, count, handle, _, _ = buf.dispatch(**args, **flags)
        q, scales = split_recv(recv_x, flags)
        target = buf.get_next_combine_buffer(handle)
        target[...] = expert_fn(rank, q, scales, flags)
        weights = case.weights[rank]
        inside_out = target[0, :len(case.xs[rank])]  # [num_tokens, hidden] bf16, contiguous
        with pytest.raises(ValueError, match=r"combine: out combined_x shares memory with "
                                             r"get_next_combine_buffer\(handle\)"):
            buf.combine(None, args["topk_idx"], weights, args["active_ranks"], -1, handle, zero_copy=True,
                        out=inside_out)
        inside_active = target[1, 0, :4].view(np.int32)  # two int32 in the bytes of four bf16
        inside_active[...] = 1
        with pytest.raises(ValueError, match=r"combine: active_ranks shares memory with get_next_combine_buffer"):
            buf.combine(None, args["topk_idx"], weights, inside_active, -1, handle, zero_copy=True)
        target[1, 0, :4] = expert_fn(rank, q, scales, flags)[1, 0, :4]  # the rows as they were
        combined, _, _ = buf.combine(None, args["topk_idx"], weights, args["active_ranks"], -1, handle,
                                     zero_copy=True)
        return Step(q.copy(), scales.copy(), to_numpy(count).copy(), to_numpy(combined).copy())

    check_steps(case, flags, spawn(2, rank_fn), masks=False)


@pytest.mark.parametrize("overrides,given", [(dict(return_recv_hook=True), "return_recv_hook=True"),
                                             (dict(out="allocated"), "out=")], ids=["hook", "out"])
def test_jax_callers_cannot_ask_for_arrays_filled_later(overrides, given):
    """JAX arrays are immutable: hook mode, out= and the zero-copy buffer are refused before any communication."""
    pytest.importorskip("jax")
    case = make_case(19, num_ranks=1, hidden=128)

    def rank_fn(group):
        buf = new_buffer(group, case)
        args = dispatch_args(case, group.rank, "jax")
        call = dict(overrides)
        if call.get("out") == "allocated":
            call["out"] = (np.zeros((case.num_local_experts, case.num_max_tokens, case.hidden), "uint16"),
                           np.zeros(case.num_local_experts, np.int32))
        with pytest.raises(TypeError, match=rf"dispatch: x is a jax array, so the results are new jax arrays "
                                            rf"\(immutable\), built once the call is done, and {given} would fill"):
            buf.dispatch(**args, **BF16_FLAGS, **call)
        recv_x, _, handle, _, _ = buf.dispatch(**args, **BF16_FLAGS)
        with pytest.raises(TypeError, match=r"get_next_combine_buffer: the dispatch's arrays are jax arrays, which "
                                            r"cannot be written in place"):
            buf.get_next_combine_buffer(handle)
        return type(recv_x).__module__

    assert spawn(1, rank_fn)[0].startswith("jax")


def non_contiguous(a: np.ndarray) -> np.ndarray:
    """The same values, strided: a transposed copy transposed back."""
    return np.ascontiguousarray(a.T).T if a.ndim == 2 else np.ascontiguousarray(np.swapaxes(a, 1, 2)).swapaxes(1, 2)


def with_entry(topk_idx: np.ndarray, value: int) -> np.ndarray:
    """topk_idx with its last entry replaced by ``value``."""
    bad = topk_idx.copy()
    bad[-1, -1] = value
    return bad


def read_only(a: np.ndarray) -> np.ndarray:
    a = a.copy()
    a.flags.writeable = False
    return a


def on_cuda(a: np.ndarray) -> DeviceMemoryArray:
    """An array that says it is on cuda:0 (its bytes are host memory: a reference Buffer must refuse it unread)."""
    dtype = "bfloat16" if a.dtype == BF16 else a.dtype.name
    return DeviceMemoryArray(a.ctypes.data, a.shape, dtype, "cuda", 0, owner=a)


def shared_mask_and_count(c) -> dict:
    """active_ranks and out's recv_count are one array (both [2] int32)."""
    shared = VCASE.actives[c.rank].copy()
    return dict(active_ranks=shared, out=(np.zeros((2, 8, 256), BF16), shared))


def x_inside_recv_x(c) -> dict:
    """x (the rank's tokens) lives inside out's recv_x."""
    recv_x = np.zeros((2, 8, 256), BF16)
    x = recv_x[0, :len(VCASE.xs[c.rank])]
    x[...] = VCASE.xs[c.rank]
    return dict(x=x, out=(recv_x, np.zeros(2, np.int32)))


def active_inside_x(c) -> dict:
    """active_ranks ([2] int32, the rank's mask) is the first 4 bytes of x."""
    x = VCASE.xs[c.rank].copy()
    active = x.view(np.int32)[0, :2]
    active[...] = VCASE.actives[c.rank]
    return dict(x=x, active_ranks=active)


def active_inside_topk(c) -> dict:
    """active_ranks starts at the last entry of an int32 topk_idx, whose ids stay the rank's own."""
    ids = VCASE.topk_idxs[c.rank]
    memory = np.ones(ids.size + 1, np.int32)
    memory[:ids.size] = ids.ravel()
    return dict(topk_idx=memory[:ids.size].reshape(ids.shape), active_ranks=memory[ids.size - 1:])


def active_inside_weights(c) -> dict:
    """active_ranks is the first row of topk_weights, read as int32."""
    weights = VCASE.weights[c.rank].copy()
    active = weights.view(np.int32)[0]
    active[...] = VCASE.actives[c.rank]
    return dict(topk_weights=weights, active_ranks=active)


def other_expert(c) -> np.ndarray:
    """The rank's topk_idx with its last entry naming another expert than its dispatch did."""
    topk = VCASE.topk_idxs[c.rank]
    return with_entry(topk, (int(topk[-1, -1]) + 1) % 4)


DISPATCH_REJECTIONS = [
    # (id, exception, pattern the message must match, overrides of the rank's good dispatch)
    ("x-on-cuda", TypeError, r"dispatch: x is on cuda:0, and this Buffer runs on the numpy reference backend",
     lambda c: dict(x=on_cuda(VCASE.xs[c.rank]))),
    ("x-float32", TypeError, r"dispatch: x must be bfloat16, got float32",
     lambda c: dict(x=VCASE.xs[c.rank].astype(np.float32))),
    ("x-not-contiguous", ValueError, r"dispatch: x must be contiguous",
     lambda c: dict(x=non_contiguous(VCASE.xs[c.rank]))),
    ("x-1d", ValueError, r"dispatch: x must be 2-dimensional", lambda c: dict(x=VCASE.xs[c.rank][0])),
    ("hidden-not-multiple-of-128", ValueError, r"dispatch: x\.shape\[1\] \(hidden\) must be a multiple of 128, got 200",
     lambda c: dict(x=np.zeros((3, 200), BF16))),
    ("tokens-above-T", ValueError, r"dispatch: x has 5 tokens, more than num_max_dispatch_tokens_per_rank=4",
     lambda c: dict(x=np.zeros((5, 256), BF16), topk_idx=np.zeros((5, 2), np.int64))),
    ("topk-float", TypeError, r"dispatch: topk_idx must be int64 or int32, got float32",
     lambda c: dict(topk_idx=VCASE.topk_idxs[c.rank].astype(np.float32))),
    ("topk-int16", TypeError,  # refused at the DLPack boundary
     r"dispatch: topk_idx has a dtype no argument of mooncake_ep takes: .*int16",
     lambda c: dict(topk_idx=VCASE.topk_idxs[c.rank].astype(np.int16))),
    ("topk-rows", ValueError, r"dispatch: topk_idx has 2 rows, x has",
     lambda c: dict(topk_idx=VCASE.topk_idxs[c.rank][:2].copy())),
    ("num-topk-17", ValueError, r"dispatch: topk_idx\.shape\[1\] \(num_topk\) must be in \[1, 16\], got 17",
     lambda c: dict(topk_idx=np.full((VCASE.xs[c.rank].shape[0], 17), -1, np.int64))),
    ("num-topk-0", ValueError, r"dispatch: topk_idx\.shape\[1\] \(num_topk\) must be in \[1, 16\], got 0",
     lambda c: dict(topk_idx=np.zeros((VCASE.xs[c.rank].shape[0], 0), np.int64))),
    ("experts-not-multiple-of-ranks", ValueError, r"dispatch: num_experts must be a multiple of num_ranks=2, got 3",
     lambda c: dict(num_experts=3)),
    ("active-int64", TypeError, r"dispatch: active_ranks must be int32, got int64",
     lambda c: dict(active_ranks=np.ones(2, np.int64))),
    ("active-too-long", ValueError, r"dispatch: active_ranks must have shape \(2,\), got \(3,\)",
     lambda c: dict(active_ranks=np.ones(3, np.int32))),
    ("active-too-short", ValueError, r"dispatch: active_ranks must have shape \(2,\), got \(1,\)",
     lambda c: dict(active_ranks=np.ones(1, np.int32))),
    ("timeout-below-minus-1", ValueError, r"dispatch: timeout_us must be >= -1, got -2", lambda c: dict(timeout_us=-2)),
    ("ue8m0-without-round-scale", ValueError, r"dispatch: use_ue8m0=True needs .*round_scale=True",
     lambda c: dict(use_fp8=True, use_ue8m0=True)),
    ("round-scale-without-fp8", ValueError, r"dispatch: round_scale=True needs use_fp8=True",
     lambda c: dict(round_scale=True)),
    ("async-and-hook", ValueError, r"dispatch: async_finish and return_recv_hook are exclusive",
     lambda c: dict(async_finish=True, return_recv_hook=True)),
    ("T-zero", ValueError, r"dispatch: num_max_dispatch_tokens_per_rank must be >= 1, got 0",
     lambda c: dict(num_max_dispatch_tokens_per_rank=0)),
    ("T-float", TypeError, r"dispatch: num_max_dispatch_tokens_per_rank must be an int, got float",
     lambda c: dict(num_max_dispatch_tokens_per_rank=4.0)),
    ("out-wrong-dtype", TypeError, r"dispatch: out recv_x must be bfloat16, got float32",
     lambda c: dict(out=(np.zeros((2, 8, 256), np.float32), np.zeros(2, np.int32)))),
    ("out-wrong-shape", ValueError, r"dispatch: out recv_count must have shape \(2,\), got \(3,\)",
     lambda c: dict(out=(np.zeros((2, 8, 256), BF16), np.zeros(3, np.int32)))),
    ("out-read-only", ValueError, r"dispatch: out recv_count is read-only",
     lambda c: dict(out=(np.zeros((2, 8, 256), BF16), read_only(np.zeros(2, np.int32))))),
    ("out-read-only-hook", ValueError, r"dispatch: out recv_x is read-only",  # refused now, not at hook()
     lambda c: dict(out=(read_only(np.zeros((2, 8, 256), BF16)), np.zeros(2, np.int32)), return_recv_hook=True)),
    ("active-read-only", ValueError, r"dispatch: active_ranks is read-only",
     lambda c: dict(active_ranks=read_only(VCASE.actives[c.rank]))),
    ("out-is-active", ValueError, r"dispatch: out recv_count shares memory with active_ranks", shared_mask_and_count),
    ("out-holds-x", ValueError, r"dispatch: out recv_x shares memory with x", x_inside_recv_x),
    ("out-not-a-tuple", TypeError, r"dispatch: out must be a tuple of arrays", lambda c: dict(out=5)),
    # fp8 scales: row-major or DeepEP's swapped layout, nothing else (here every other row of a larger array).
    ("out-scales-strided", ValueError,
     r"dispatch: out recv_scales must be contiguous \(row-major, strides in elements \(16, 2, 1\)\) or a contiguous "
     r"array with its last two dimensions swapped \(DeepEP's layout, strides \(16, 1, 8\)\), got strides \(32, 4, 1\); "
     r"pass a contiguous array, or the \.swapaxes\(1, 2\) of one$",
     lambda c: dict(use_fp8=True, out=((np.zeros((2, 8, 256), FP8), np.zeros((2, 16, 2), np.float32)[:, ::2]),
                                       np.zeros(2, np.int32)))),
    # DeepEP's layout's own array, not yet viewed with its last two dimensions swapped.
    ("out-scales-not-swapped-back", ValueError,
     r"dispatch: out recv_scales must have shape \(2, 8, 2\), got \(2, 2, 8\); for DeepEP's layout pass this "
     r"array with its last two dimensions swapped \(\.swapaxes\(1, 2\)\)$",
     lambda c: dict(use_fp8=True, out=((np.zeros((2, 8, 256), FP8), np.zeros((2, 2, 8), np.float32)),
                                       np.zeros(2, np.int32)))),
    ("out-fp8-form-for-bf16", TypeError,
     r"dispatch: out must be \(recv_x, recv_count\) without use_fp8; \(\(recv_x, recv_scales\), recv_count\) is the "
     r"form of an fp8 dispatch$",
     lambda c: dict(out=((np.zeros((2, 8, 256), BF16), np.zeros((2, 8, 2), np.float32)), np.zeros(2, np.int32)))),
    ("out-jax", TypeError, r"dispatch: out recv_count is a jax array, which is immutable, and the call writes into it",
     lambda c: dict(out=(np.zeros((2, 8, 256), BF16), to_framework(np.zeros(2, np.int32), "jax")))),
    ("active-jax", TypeError, r"dispatch: active_ranks is a jax array, which is immutable",  # x is numpy
     lambda c: dict(active_ranks=to_framework(VCASE.actives[c.rank], "jax"))),
    ("active-read-only-jax-x", ValueError, r"dispatch: active_ranks is read-only",  # only JAX masks go unwritten
     lambda c: dict(x=to_framework(VCASE.xs[c.rank], "jax"), topk_idx=to_framework(VCASE.topk_idxs[c.rank], "jax"),
                    active_ranks=read_only(VCASE.actives[c.rank]))),
    # Without out= too: the kernels write active_ranks while they read x and topk_idx.
    ("active-inside-x", ValueError, r"dispatch: active_ranks shares memory with x", active_inside_x),
    ("active-inside-topk", ValueError, r"dispatch: active_ranks shares memory with topk_idx", active_inside_topk),
    ("use-fp8-str", TypeError, r"dispatch: use_fp8 must be a bool, got str", lambda c: dict(use_fp8="no")),
    ("hook-int", TypeError, r"dispatch: return_recv_hook must be a bool, got int",
     lambda c: dict(return_recv_hook=1)),
    ("round-scale-numpy-bool", TypeError, r"dispatch: round_scale must be a bool, got numpy\.bool",
     lambda c: dict(use_fp8=True, round_scale=np.True_)),
    ("timeout-past-int64-ns", ValueError, r"dispatch: timeout_us must be <= 9223372036854775",
     lambda c: dict(timeout_us=10**20)),
    ("experts-float", TypeError, r"dispatch: num_experts must be an int, got float", lambda c: dict(num_experts=4.0)),
    # The kernels' limit (MAX_EXPERTS): 1026 is a multiple of num_ranks=2, so no other check refuses it.
    ("experts-above-1024", ValueError, r"dispatch: num_experts must be <= 1024, got 1026",
     lambda c: dict(num_experts=1026)),
]

# Refusals for the values of a rank's host arrays, which its peers cannot see: sent through the
# exchange, so every rank raises at once (ReferenceBackend.exchange's refusal).
DISPATCH_VALUE_REJECTIONS = [
    ("expert-id-E", ValueError, r"dispatch: topk_idx entries must be -1 or in \[0, 4\), got 4",
     lambda c: dict(topk_idx=with_entry(VCASE.topk_idxs[c.rank], 4))),
    ("expert-id-below-minus-1", ValueError, r"dispatch: topk_idx entries must be -1 or in \[0, 4\), got -2",
     lambda c: dict(topk_idx=with_entry(VCASE.topk_idxs[c.rank], -2))),
    ("repeated-expert-overflows", ValueError, r"dispatch: topk_idx .*expert 1.*num_max_dispatch_tokens_per_rank=4",
     # Each token names expert 1 twice: 5 or 6 copies from one rank, which recv_x (R * T rows) cannot hold.
     lambda c: dict(topk_idx=np.array([[1, 1], [1, 1]] + [[1, -1]] * (len(VCASE.xs[c.rank]) - 2), np.int64))),
]


COMBINE_REJECTIONS = [
    ("topk-on-cuda", TypeError, r"combine: topk_idx is on cuda:0, and this Buffer runs on the numpy reference backend",
     lambda c: dict(topk_idx=on_cuda(VCASE.topk_idxs[c.rank]))),
    ("x-float32", TypeError, r"combine: x must be bfloat16, got float32",
     lambda c: dict(x=c.expert_out.astype(np.float32))),
    ("x-not-contiguous", ValueError, r"combine: x must be contiguous", lambda c: dict(x=non_contiguous(c.expert_out))),
    ("x-wrong-shape", ValueError, r"combine: x must have shape \(2, 8, 256\), got \(2, 4, 256\)",
     lambda c: dict(x=c.expert_out[:, :4].copy())),
    ("x-missing", TypeError, r"combine: x \(expert outputs\) is required", lambda c: dict(x=None)),
    ("topk-float", TypeError, r"combine: topk_idx must be int64 or int32, got float32",
     lambda c: dict(topk_idx=VCASE.topk_idxs[c.rank].astype(np.float32))),
    ("topk-wrong-shape", ValueError, r"combine: topk_idx must have shape",
     lambda c: dict(topk_idx=VCASE.topk_idxs[c.rank][:1].copy())),
    ("weights-float64", TypeError, r"combine: topk_weights must be float32, got float64",
     lambda c: dict(topk_weights=VCASE.weights[c.rank].astype(np.float64))),
    ("weights-bf16", TypeError, r"combine: topk_weights must be float32, got bfloat16",
     lambda c: dict(topk_weights=VCASE.weights[c.rank].astype(BF16))),
    ("active-int64", TypeError, r"combine: active_ranks must be int32, got int64",
     lambda c: dict(active_ranks=np.ones(2, np.int64))),
    ("active-too-long", ValueError, r"combine: active_ranks must have shape \(2,\), got \(4,\)",
     lambda c: dict(active_ranks=np.ones(4, np.int32))),
    ("timeout-below-minus-1", ValueError, r"combine: timeout_us must be >= -1, got -5", lambda c: dict(timeout_us=-5)),
    ("async-and-hook", ValueError, r"combine: async_finish and return_recv_hook are exclusive",
     lambda c: dict(async_finish=True, return_recv_hook=True)),
    ("handle-none", TypeError, r"combine: handle must be the Handle returned by Buffer.dispatch, got NoneType$",
     lambda c: dict(handle=None)),
    ("handle-tuple", TypeError, r"combine: handle must be the Handle", lambda c: dict(handle=(1, 2, 3))),
    # DeepEP's order, combine(x, topk_idx, topk_weights, handle): the handle lands in timeout_us
    ("handle-as-timeout", TypeError, r"combine: the Handle was passed as timeout_us, the 5th argument .*pass "
                                     r"handle=handle", lambda c: dict(timeout_us=c.handle, handle=None)),
    ("handle-in-deepeps-place", TypeError, r"combine: the Handle was passed as active_ranks, the 4th argument .*"
                                           r"DeepEP's has no active_ranks\); pass handle=handle",
     lambda c: dict(active_ranks=c.handle, handle=None)),
    ("out-wrong-dtype", TypeError, r"combine: out combined_x must be bfloat16, got float32",
     lambda c: dict(out=np.zeros((VCASE.xs[c.rank].shape[0], 256), np.float32))),
    ("out-read-only", ValueError, r"combine: out combined_x is read-only",
     lambda c: dict(out=read_only(np.zeros((VCASE.xs[c.rank].shape[0], 256), BF16)))),
    ("active-read-only", ValueError, r"combine: active_ranks is read-only",
     lambda c: dict(active_ranks=read_only(VCASE.actives[c.rank]))),
    ("out-inside-x", ValueError, r"combine: out combined_x shares memory with x",
     lambda c: dict(out=c.expert_out[0, :VCASE.xs[c.rank].shape[0]])),
    ("active-inside-weights", ValueError, r"combine: active_ranks shares memory with topk_weights",
     active_inside_weights),
    ("out-jax", TypeError, r"combine: out combined_x is a jax array, which is immutable",
     lambda c: dict(out=to_framework(np.zeros((len(VCASE.xs[c.rank]), 256), BF16), "jax"))),
    ("timeout-past-int64-ns", ValueError, r"combine: timeout_us must be <= ", lambda c: dict(timeout_us=2**62)),
    ("renormalize-str", TypeError, r"combine: renormalize must be a bool, got str", lambda c: dict(renormalize="no")),
    ("zero-copy-numpy-bool", TypeError, r"combine: zero_copy must be a bool, got numpy\.bool",
     lambda c: dict(zero_copy=np.False_)),
]

COMBINE_VALUE_REJECTIONS = [
    ("topk-other-expert", ValueError, r"combine: topk_idx must name the experts given to the dispatch of handle "
                                      r"\(or -1\); entry \(\d, 1\) is",
     lambda c: dict(topk_idx=other_expert(c))),
]


def validation_rank(group, phase: str, make_overrides, exc, pattern: str, rejecting_ranks, peers_call: bool = False,
                    framework: str = "numpy"):
    """One good dispatch, the bad call twice (on the ranks in ``rejecting_ranks``), then a combine of
    the first handle and a fresh step: all must equal the reference. Two rejected dispatches would
    have made the first handle stale had they counted. With ``peers_call`` (a refusal of values, sent
    through the exchange) the other ranks make the call too, with their good arguments, and must
    raise a ValueError naming the refusing ranks and their reasons. ``framework``: of every array of
    the calls (the overrides' numpy arrays converted)."""
    rank = group.rank
    buf = new_buffer(group, VCASE)
    args = dispatch_args(VCASE, rank, framework)
    recv_x, count, handle, _, _ = buf.dispatch(**args, **BF16_FLAGS)
    recv_x, count = to_numpy(recv_x), to_numpy(count)
    ctx = Ctx(rank, handle, expert_fn(rank, recv_x, None, BF16_FLAGS), framework)
    call = ctx.dispatch if phase == "dispatch" else ctx.combine
    if rank in rejecting_ranks:
        for _ in range(2):
            overrides = make_overrides(ctx)
            given_mask = overrides.get("active_ranks")
            active_before = given_mask.copy() if isinstance(given_mask, np.ndarray) else None
            with pytest.raises(exc, match=pattern):
                call(buf, **overrides)
            if active_before is not None:  # a rejected mask is never written, nor replaced
                np.testing.assert_array_equal(given_mask, active_before)
    elif peers_call:
        refusing = ", ".join(map(str, rejecting_ranks))
        for _ in range(2):
            # Named by its number (as the exchange's GroupError), each reason without the call's name again.
            with pytest.raises(ValueError, match=rf"^{phase} \([^)]*number \d+ of this Buffer\): ranks? {refusing} of "
                                                 rf"2 refused this call, so no rank made it \(nothing received or "
                                                 rf"counted; the group stays usable\): rank {rejecting_ranks[0]}: "
                                                 rf"{pattern.removeprefix(phase + ': ')}"):
                call(buf)
    combined, _, _ = buf.combine(to_framework(ctx.expert_out, framework), args["topk_idx"],
                                 to_framework(VCASE.weights[rank], framework), args["active_ranks"], -1, handle)
    first = Step(recv_x.copy(), None, count.copy(), to_numpy(combined).copy())
    return first, run_step(buf, VCASE, rank, FP8_FLAGS, framework)


def check_validation(steps) -> None:
    check_steps(VCASE, BF16_FLAGS, [first for first, _ in steps], masks=False)
    check_steps(VCASE, FP8_FLAGS, [second for _, second in steps])


def rejection_params(table):
    return [pytest.param(exc, pattern, make, id=name) for name, exc, pattern, make in table]


@pytest.mark.parametrize("rejecting_ranks", [(0, 1), (1,)], ids=["all-ranks", "one-rank"])
@pytest.mark.parametrize("exc,pattern,make_overrides", rejection_params(DISPATCH_REJECTIONS))
def test_rejected_dispatch_names_the_argument_and_leaves_buffer_usable(exc, pattern, make_overrides,
                                                                      rejecting_ranks):
    check_validation(spawn(2, validation_rank, "dispatch", make_overrides, exc, pattern, rejecting_ranks))


@pytest.mark.parametrize("rejecting_ranks", [(0, 1), (0,)], ids=["all-ranks", "one-rank"])
@pytest.mark.parametrize("exc,pattern,make_overrides", rejection_params(COMBINE_REJECTIONS))
def test_rejected_combine_names_the_argument_and_leaves_buffer_usable(exc, pattern, make_overrides,
                                                                     rejecting_ranks):
    check_validation(spawn(2, validation_rank, "combine", make_overrides, exc, pattern, rejecting_ranks))


# The group's timeout is long (30 s): a rank that raised before the exchange, as these refusals did,
# held its peers there until it, and their GroupError (not the ValueError named) broke the group.
@pytest.mark.parametrize("framework", ["numpy", "torch"])
@pytest.mark.parametrize("rejecting_ranks", [(0, 1), (1,), (0,)], ids=["all-ranks", "rank-1", "rank-0"])
@pytest.mark.parametrize("phase,exc,pattern,make_overrides",
                         [pytest.param("dispatch", *rest, id=f"dispatch-{name}")
                          for name, *rest in DISPATCH_VALUE_REJECTIONS] +
                         [pytest.param("combine", *rest, id=f"combine-{name}")
                          for name, *rest in COMBINE_VALUE_REJECTIONS])
def test_a_refusal_of_one_ranks_values_raises_on_every_rank_at_once_and_the_group_stays_usable(
        phase, exc, pattern, make_overrides, rejecting_ranks, framework):
    """Bad ids on one rank (out of range, too many copies to one expert; combine's naming other experts
    than its dispatch's) are refused through the exchange: that rank raises its own error, its peers,
    called with good arguments, a ValueError naming it and its reason; no rank counts the call (the
    first handle stays combinable) and a following good step equals the reference on every rank."""
    if framework == "torch":
        pytest.importorskip("torch")
    check_validation(ep.LocalGroup(2, timeout_s=30.0).spawn(validation_rank, phase, make_overrides, exc, pattern,
                                                            rejecting_ranks, True, framework))


@pytest.mark.parametrize("unnamed", [-1, 4, 99])
def test_combine_entries_naming_no_expert_add_nothing(unnamed):
    """An entry of combine's ids that names no expert (-1, or outside [0, E), as the kernels read it)
    adds nothing: the same as its weight set to 0."""
    def rank_fn(group):
        rank = group.rank
        buf = new_buffer(group, VCASE)
        args = dispatch_args(VCASE, rank)
        recv_x, _, handle, _, _ = buf.dispatch(**args, **BF16_FLAGS)
        expert_out = expert_fn(rank, recv_x, None, BF16_FLAGS)
        ids, weights = args["topk_idx"], VCASE.weights[rank]
        entry = tuple(np.argwhere(ids >= 0)[0])  # an entry the dispatch sent
        unnamed_ids, zero_weight = ids.copy(), weights.copy()
        unnamed_ids[entry], zero_weight[entry] = unnamed, 0
        expected, _, _ = buf.combine(expert_out, ids, zero_weight, args["active_ranks"], -1, handle)
        combined, _, _ = buf.combine(expert_out, unnamed_ids, weights, args["active_ranks"], -1, handle)
        return expected, combined
    for expected, combined in spawn(2, rank_fn):
        assert np.any(bits(expected) != 0)
        np.testing.assert_array_equal(bits(combined), bits(expected))


def test_handle_from_another_buffer_is_refused():
    def rank_fn(group):
        rank = group.rank
        buf, other = new_buffer(group, VCASE), new_buffer(group, VCASE)
        _, _, foreign, _, _ = other.dispatch(**dispatch_args(VCASE, rank), **BF16_FLAGS)
        recv_x, _, handle, _, _ = buf.dispatch(**dispatch_args(VCASE, rank), **BF16_FLAGS)
        ctx = Ctx(rank, handle, expert_fn(rank, recv_x, None, BF16_FLAGS))
        with pytest.raises(ValueError, match=r"combine: handle was made by another Buffer"):
            ctx.combine(buf, handle=foreign)
        with pytest.raises(ValueError, match=r"get_next_combine_buffer: handle was made by another Buffer"):
            buf.get_next_combine_buffer(foreign)
        return run_step(buf, VCASE, rank, FP8_FLAGS)

    check_steps(VCASE, FP8_FLAGS, spawn(2, rank_fn))


def test_stale_handle_is_refused_after_two_more_dispatches():
    def rank_fn(group):
        rank = group.rank
        buf = new_buffer(group, VCASE)
        handles, outs = [], []
        for _ in range(3):
            recv_x, _, handle, _, _ = buf.dispatch(**dispatch_args(VCASE, rank), **BF16_FLAGS)
            handles.append(handle)
            outs.append(expert_fn(rank, recv_x, None, BF16_FLAGS))
        for where, call in [("combine", lambda: Ctx(rank, handles[0], outs[0]).combine(buf)),
                            ("get_next_combine_buffer", lambda: buf.get_next_combine_buffer(handles[0]))]:
            with pytest.raises(ValueError, match=rf"{where}: handle is stale: dispatch #0 was overwritten"):
                call()
        # The handle of the dispatch before last is still valid, and so is the last one.
        combined = [Ctx(rank, handles[i], outs[i]).combine(buf)[0].copy() for i in (1, 2)]
        return combined, run_step(buf, VCASE, rank, FP8_FLAGS)

    results = spawn(2, rank_fn)
    expected = expected_step(VCASE, BF16_FLAGS)
    for rank, (combined, _) in enumerate(results):
        for c in combined:
            np.testing.assert_array_equal(bits(c), bits(expected[rank].combined))
    check_steps(VCASE, FP8_FLAGS, [second for _, second in results])


def test_buffer_smaller_than_the_hint_is_refused_and_stays_usable_for_smaller_shapes():
    small = make_case(19, num_ranks=2, num_max_tokens=2, hidden=128, num_experts=4, num_topk=2)
    big = dataclasses.replace(small, num_max_tokens=8)
    assert small.size_hint < big.size_hint

    def rank_fn(group):
        buf = new_buffer(group, small, big.size_hint - 1)
        pattern = (rf"dispatch: the buffer has {big.size_hint - 1} bytes, this configuration \(T=8, hidden=128, "
                   rf"num_experts=4, num_ranks=2\) needs {big.size_hint}: .*get_ep_buffer_size_hint")
        with pytest.raises(ValueError, match=pattern):
            buf.dispatch(**dispatch_args(big, group.rank), **BF16_FLAGS)
        return run_step(buf, small, group.rank, UE8M0_FLAGS)

    check_steps(small, UE8M0_FLAGS, spawn(2, rank_fn))


@pytest.mark.parametrize("call,pattern", [
    (lambda g: ep.Buffer(g, 0, backend="reference"), r"Buffer: num_ep_buffer_bytes must be >= \d+, got 0"),
    (lambda g: ep.Buffer(g, ep_layout.header_bytes() - 1, backend="reference"),
     rf"Buffer: num_ep_buffer_bytes must be >= {ep_layout.header_bytes()}, got {ep_layout.header_bytes() - 1}"),
    (lambda g: ep.Buffer(g, 1 << 20, backend="gpu"), r"Buffer: backend must be 'auto', 'cuda' or 'reference'"),
    (lambda g: ep.Buffer(object(), 1 << 20, backend="reference"),
     r"Buffer: group must be a mooncake_ep group \(init_group\(\)'s, or a rank of a LocalGroup: rank_group\(r\), or "
     r"what spawn passes\), a torch ProcessGroup or an mpi4py communicator; object has no 'rank'"),
    (lambda g: ep.Buffer(ep.LocalGroup(2), 1 << 20, backend="reference"), r"LocalGroup has no 'rank'"),
])
def test_bad_buffer_arguments_are_refused(call, pattern):
    group = ep.LocalGroup(1).rank_group(0)
    with pytest.raises((TypeError, ValueError), match=pattern):
        call(group)


class GroupThatMustNotCommunicate:
    """A group of ``world_size`` ranks (this one rank 0) whose collectives fail the test: a Buffer that
    refuses its arguments does so on its own, before the handshake (peers would wait for it there)."""

    def __init__(self, world_size: int):
        self.rank, self.world_size = 0, world_size

    def allgather_bytes(self, blob: bytes) -> list[bytes]:
        raise AssertionError("the Buffer communicated (its handshake) before refusing its arguments")

    def barrier(self) -> None:
        raise AssertionError("the Buffer communicated (a barrier) before refusing its arguments")


def test_more_ranks_than_the_kernels_hold_are_refused_before_the_handshake():
    """The kernels hold at most MAX_RANKS (64) ranks (route table, masks): a group of 65 is refused by
    each rank at construction, before communicating; one of 64 passes the check and goes on to the
    handshake (which this group fails)."""
    with pytest.raises(ValueError, match=r"^Buffer: at most 64 ranks are supported, got 65$"):
        ep.Buffer(GroupThatMustNotCommunicate(65), 1 << 20, backend="reference")
    with pytest.raises(AssertionError, match=r"communicated \(its handshake\)"):
        ep.Buffer(GroupThatMustNotCommunicate(64), 1 << 20, backend="reference")


@pytest.mark.parametrize("num_sms,exc,pattern", [
    (0, ValueError, r"^Buffer: num_sms must be >= 1, got 0$"),
    (-1, ValueError, r"^Buffer: num_sms must be >= 1, got -1$"),
    (2.0, TypeError, r"^Buffer: num_sms must be an int, got float$"),
    (True, TypeError, r"^Buffer: num_sms must be an int, got bool$"),
], ids=["zero", "negative", "float", "bool"])
def test_bad_num_sms_is_refused_before_the_handshake(num_sms, exc, pattern):
    """num_sms is checked on every backend, the reference one (which launches nothing) included, and
    before communicating: unchecked, 0 would read as "the default", and -1, a float or a bool would
    reach the kernels' launch grid. A numpy integer is an int."""
    with pytest.raises(exc, match=pattern):
        ep.Buffer(GroupThatMustNotCommunicate(2), 1 << 20, backend="reference", num_sms=num_sms)
    buf = spawn(1, lambda g: ep.Buffer(g, 1 << 20, backend="reference", num_sms=np.int64(1)))[0]
    assert buf.backend == "reference"


@pytest.mark.parametrize("args,pattern", [
    ((4, 200, 2, 4), r"get_ep_buffer_size_hint: hidden must be a multiple of 128, got 200"),
    ((4, 256, 2, 3), r"get_ep_buffer_size_hint: num_experts must be a multiple of num_ranks=2, got 3"),
    ((0, 256, 2, 4), r"get_ep_buffer_size_hint: num_max_dispatch_tokens_per_rank must be >= 1, got 0"),
    # The kernels' limits (MAX_EXPERTS, MAX_RANKS), with num_experts a multiple of num_ranks.
    ((4, 256, 2, 1026), r"get_ep_buffer_size_hint: num_experts must be <= 1024, got 1026"),
    ((4, 256, 65, 65), r"get_ep_buffer_size_hint: num_ranks must be <= 64, got 65"),
])
def test_size_hint_validates_its_arguments(args, pattern):
    with pytest.raises(ValueError, match=pattern):
        ep.Buffer.get_ep_buffer_size_hint(*args)


def test_error_messages_name_the_call():
    # Every pattern of the tables starts with the call it belongs to (a cheap guard on the tables).
    for table, where in ((DISPATCH_REJECTIONS, "dispatch: "), (COMBINE_REJECTIONS, "combine: ")):
        for name, _, pattern, _ in table:
            assert pattern.startswith(where), name
            re.compile(pattern)


@pytest.mark.parametrize("shape, swapped", [((4, 8, 128), False), ((4, 0, 128), False), ((0, 7), False), ((3,), False),
                                            ((1, 1, 1), False), ((4, 8, 56), True), ((4, 0, 56), True), ((3, 1, 5), True),
                                            ((2, 3), True)])
@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn", "float32", "int32"])
def test_allocated_torch_results_read_as_read_array_reads_them(shape, swapped, dtype):
    """_allocate builds the views of torch results it just made without read_array (the plan's
    strides, worked out once): same fields; a swapped result (DeepEP's fp8 scales) has its layout."""
    torch = pytest.importorskip("torch")
    buffer = ep.LocalGroup(1).spawn(lambda g: ep.Buffer(g, ep.Buffer.get_ep_buffer_size_hint(8, 128, 1, 4),
                                                        backend="reference"))[0]
    like = read_array(torch.ones(2, 2), name="like")
    plan = _Plan.of(0, 0, 0, [("out", list(shape), dtype)],  # a list: the plan makes it a tuple
                    swapped_last_axes=("out",) if swapped else ())
    ((view, obj),) = buffer._allocate(plan, like)
    expected = read_array(obj, name="out")
    assert (view.ptr, view.shape, view.strides, view.dtype, view.device_type, view.device_id, view.framework) == \
        (expected.ptr, expected.shape, expected.strides, expected.dtype, expected.device_type, expected.device_id,
         expected.framework)
    assert view.obj is obj and (view.is_swapped_last_axes if swapped else view.is_contiguous)
    if swapped and view.size and shape[-2] > 1 and shape[-1] > 1:
        assert view.strides == swapped_last_axes_strides(shape) and not view.is_contiguous


def test_a_configuration_agreed_ahead_is_checked_and_agreed_in_python_ints(monkeypatch):
    """torch's dispatch agrees ahead on its backward's fp8 configuration with the caller's own T and
    num_experts, before the dispatch checks them: a numpy int agreed on broke every later
    update_ep_member (the agreement's JSON), and a float reached the collective as a bare struct.error."""
    buffer = ep.LocalGroup(1).spawn(lambda group: ep.Buffer(group, 1 << 22, backend="reference"))[0]
    agreed = []
    monkeypatch.setattr(buffer, "_cuda", type("Backend", (), {"agree_on": lambda self, c, where: agreed.append(c)})())
    agree = lambda T, E: buffer._agree_ahead(T, 1024, E, use_fp8=True, round_scale=False,  # noqa: E731
                                             use_ue8m0=False, where="mooncake_ep.torch.dispatch")
    with pytest.raises(TypeError, match=r"^mooncake_ep.torch.dispatch: num_max_dispatch_tokens_per_rank must be an "
                                        r"int, got float"):
        agree(8.0, 16)
    with pytest.raises(ValueError, match=r"^mooncake_ep.torch.dispatch: num_experts"):
        agree(8, 0)
    agree(np.int64(8), np.int32(16))
    assert agreed == [(8, 1024, 16, True, False, False)] and [type(v) for v in agreed[0][:3]] == [int] * 3
    agree(8, 16)  # agreed: no second collective
    assert len(agreed) == 1


def test_the_public_counts_of_a_buffer():
    """num_dispatches counts every rank's dispatches alike (its parity is the next one's workspace half);
    num_sms is the kernels' (None on the reference backend); group_size is num_ranks, as DeepEP names it."""
    case = make_case(31, num_ranks=2)

    def rank_fn(group):
        buf = new_buffer(group, case)
        counts = [buf.num_dispatches]
        for _ in range(3):
            run_step(buf, case, group.rank, BF16_FLAGS)
            counts.append(buf.num_dispatches)
        return counts, buf.num_sms, buf.group_size

    assert spawn(2, rank_fn) == [([0, 1, 2, 3], None, 2)] * 2


@pytest.mark.skipif(buffer_module._why_no_gpu() is None, reason="a usable GPU: backend='cuda' builds")
@pytest.mark.parametrize("devices", [None, [0]])
def test_backend_cuda_without_a_usable_gpu_says_so(devices):
    """backend="cuda" on a machine with no usable GPU raised cupy's own error (cudaErrorInsufficientDriver
    from cupy.cuda.runtime), naming no call; it names the Buffer and why, as the CLI's --backend cuda does."""
    group = ep.LocalGroup(1, devices=devices).rank_group(0)
    with pytest.raises(RuntimeError, match=r"^Buffer: backend='cuda': (cupy found no|cupy could not be imported)"):
        ep.Buffer(group, ep.Buffer.get_ep_buffer_size_hint(4, 128, 1, 2), backend="cuda")


def test_a_stale_handle_on_one_rank_is_refused_on_every_rank_at_once():
    """Rank 1 combines a handle that two later dispatches made stale, rank 0 a current one: rank 1 raised
    before the exchange, rank 0 waited there until the group's timeout, and the group broke (review).
    The stale handle is rank 1's verdict in the exchange: rank 1 raises its own error, rank 0 that the
    ranks' calls differ (their handles' dispatch numbers), both at once; the next step works."""
    def rank_fn(group):
        rank = group.rank
        buf = new_buffer(group, VCASE)
        made = [buf.dispatch(**dispatch_args(VCASE, rank), **BF16_FLAGS) for _ in range(3)]
        recv_x, _, handle, _, _ = made[0] if rank == 1 else made[2]
        start = time.monotonic()
        try:
            buf.combine(expert_fn(rank, to_numpy(recv_x), None, BF16_FLAGS), dispatch_args(VCASE, rank)["topk_idx"],
                        VCASE.weights[rank], dispatch_args(VCASE, rank)["active_ranks"], -1, handle)
        except (ValueError, ep.RankMismatchError) as exc:
            refused = (type(exc).__name__, str(exc), time.monotonic() - start)
        return refused, run_step(buf, VCASE, rank, BF16_FLAGS)

    out = ep.LocalGroup(2, timeout_s=30.0).spawn(rank_fn)
    (kind1, message1, took1), (kind0, message0, took0) = out[1][0], out[0][0]
    assert kind1 == "ValueError" and message1.startswith("combine: handle is stale: dispatch #0"), out[1][0]
    assert kind0 == "RankMismatchError" and "disagree on handle's dispatch number" in message0, out[0][0]
    assert max(took0, took1) < 10, (took0, took1)  # not the group's 30 s timeout
    check_steps(VCASE, BF16_FLAGS, [steps for _, steps in out])


def test_the_live_buffers_are_listed_while_other_threads_build_buffers():
    """Buffers built on threads (ranks of one process on a TCP-store group) register while another
    thread's construction lists those its process holds: a bare WeakSet raised "Set changed size during
    iteration" there (review; ~40 times a second in this loop)."""
    class Registered:  # what the registry reads of a Buffer
        group, _destroyed, _built_in_an_update, _token = None, False, False, "t"

    kept, stop, errors, num_registered = [], threading.Event(), [], [0]

    def register():
        try:
            while not stop.is_set():
                kept.append(Registered())
                buffer_module._register_live(kept[-1])
                num_registered[0] += 1
                del kept[:-100]  # collected as they go, as dropped Buffers are
        except Exception as exc:  # noqa: BLE001 - a failure here is the test's, not a thread warning
            errors.append(exc)

    adder = threading.Thread(target=register)
    adder.start()
    try:
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline:
            try:
                buffer_module._held_tokens(object())
            except RuntimeError as exc:
                errors.append(exc)
    finally:
        stop.set()
        adder.join()
    assert not errors, errors[:1]
    assert num_registered[0] > 1000, num_registered  # the lists did run beside registrations
