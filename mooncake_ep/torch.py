"""torch autograd for dispatch and combine: a differentiable MoE layer on :class:`mooncake_ep.Buffer`.

:func:`dispatch` and :func:`combine` are :meth:`Buffer.dispatch` / :meth:`Buffer.combine` (bf16,
synchronous, on torch's current stream) as ``torch.autograd.Function`` s, on CUDA tensors (the
kernels) and CPU tensors (the numpy reference) alike.

Example::

    import mooncake_ep.torch as ept

    recv_x, recv_count, handle = ept.dispatch(buffer, x, topk_idx, active_ranks, T, E)
    y = experts(recv_x)                        # [E_l, R*T, H] bf16; rows past recv_count are 0, and ignored
    out = ept.combine(buffer, y, topk_idx, topk_weights, active_ranks, handle, grad_buffer=grad_buffer)
    loss(out).backward()                       # gradients for x, the experts and topk_weights

Gradients (every rank must run the same backward, since each step below is a collective):
    - combine, w.r.t. the expert outputs: ``grad[row(t, k)] = w_k * grad_y[t]``, exactly, as a
      dispatch on ``grad_buffer`` of the ``t * K`` rows ``w_k * grad_y[t]``, row ``t * K + k`` routed
      (top-1) to the expert the forward's dispatch sent (t, k) to. A local expert receives them
      ordered by (source rank, t, k), each source's in the forward's order, and each source's are
      moved to where the forward had them (both dispatches' (first row, rows) per source, read on the
      device); rows past recv_count get 0, and so do the rows of entries combine's topk_idx leaves
      out (-1) and of a source lost or gained since the forward.
      ``grad_buffer`` is a Buffer of the same group sized for ``T * K`` tokens
      (:func:`grad_buffer_size_hint`): its receive layout is K times the forward's.
    - combine, w.r.t. topk_weights: ``grad_w[t, k] = <expert_out[row(t, k)], grad_y[t]>``, from a
      combine on that same layout of the forward's expert outputs with unit weights: with one
      expert per "token" nothing is summed, so every row comes back to its owner as it was.
    - dispatch, w.r.t. x: ``grad_x[t] = Σ_k grad_recv_x[row(t, k)]``, a combine with unit weights.
      The workspace keeps the routing of the last two dispatches only, so the backward first re-runs
      the dispatch with zeros (fp8, half the bytes) to rebuild it, and moves each source's gradient
      rows from the forward's place to the rebuilt one's.

    Cost per layer: forward 1 dispatch + 1 combine; backward 2 dispatches + 2 combines (2 + 1 when
    topk_weights needs no gradient), all on torch's current stream, no host synchronisation.

Note:
    The autograd engine runs CUDA backward functions on its own thread per device, on the forward's
    streams, so in-process ranks on one GPU issue their backward launches one after another from that
    thread; launches do not wait, but a device allocation there can (see :class:`Buffer`): warm the
    caching allocator with a first step.
"""

from __future__ import annotations

import functools
import weakref

import torch

from mooncake_ep import _constants
from mooncake_ep._handshake import RankMismatchError
from mooncake_ep.buffer import Buffer, Handle
from mooncake_ep.validation import check_experts, check_grad_num_topk, check_hidden, check_int

__all__ = ["dispatch", "combine", "grad_buffer_size_hint", "DispatchFunction", "CombineFunction"]

# Per dispatch handle of :func:`dispatch`: where each source's rows lie (Buffer._recv_layout_range, a
# copy) and its topk_idx, by which combine's backward moves and routes the gradient rows (Handle belongs
# to buffer.py, so they are not stored on it).
_forward_routing: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


# Bytes of the grad_buffer of combine: a Buffer for T * num_topk tokens (the same in mooncake_ep.jax).
grad_buffer_size_hint = Buffer.get_grad_buffer_size_hint


# torch.compiler.disable: under torch.compile, Dynamo would trace into the library's host code (numpy,
# DLPack, kernel launches) frame by frame and fail there; each call stays one opaque step instead.
@torch.compiler.disable
def dispatch(buffer: Buffer, x: torch.Tensor, topk_idx: torch.Tensor, active_ranks: torch.Tensor,
             num_max_dispatch_tokens_per_rank: int, num_experts: int, *,
             timeout_us: int = _constants.TIMEOUT_FOREVER) -> tuple[torch.Tensor, torch.Tensor, Handle]:
    """A differentiable bf16 :meth:`Buffer.dispatch`.

    Args:
        buffer: this rank's Buffer.
        x: ``[num_tokens, hidden]`` bf16 (may require grad), on the Buffer's device (or the CPU).
        topk_idx: ``[num_tokens, num_topk]`` int64 (int32 accepted); -1 = no expert.
        active_ranks: ``[num_ranks]`` int32, 1 (any nonzero value) = alive, 0 = masked; updated in
            place, by the backward too.
        num_max_dispatch_tokens_per_rank: T.
        num_experts: E.
        timeout_us: microseconds a receive waits for a peer; -1 waits forever.

    Returns:
        ``(recv_x, recv_count, handle)``: recv_x ``[num_local_experts, num_ranks * T, hidden]`` bf16
        (differentiable; rows past recv_count[e] are zeros, so an expert that computes every row gets
        finite weight gradients), recv_count ``[num_local_experts]`` int32,
        handle for :func:`combine`.

    Raises:
        TypeError: buffer is not a Buffer, or x, topk_idx or active_ranks is not a torch.Tensor (before
            anything is launched).

    Note:
        A rank that fails (or comes back) between the forward and the backward moves the rows of
        the ranks after it; the backward moves each row's gradient along, so only the rows of a
        source lost (or gained) since the forward give no gradient, and active_ranks shows the
        failure.
    """
    _check_buffer("mooncake_ep.torch.dispatch", buffer)
    _check_tensors("mooncake_ep.torch.dispatch", x=x, topk_idx=topk_idx, active_ranks=active_ranks)
    return DispatchFunction.apply(x, topk_idx, active_ranks, buffer, num_max_dispatch_tokens_per_rank,
                                  num_experts, timeout_us)


@torch.compiler.disable
def combine(buffer: Buffer, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
            active_ranks: torch.Tensor, handle: Handle, *, grad_buffer: Buffer | None = None,
            grad_num_topk: int | None = None, timeout_us: int = _constants.TIMEOUT_FOREVER) -> torch.Tensor:
    """A differentiable :meth:`Buffer.combine` (w.r.t. the expert outputs and topk_weights).

    Args:
        buffer: the Buffer of the dispatch of ``handle``.
        x: ``[num_local_experts, num_ranks * T, hidden]`` bf16 expert outputs, laid out as recv_x.
        topk_idx: the ids given to that dispatch; an entry may be -1 where the dispatch had an expert
            (it then adds nothing, and gets no gradient), as does a copy the dispatch dropped (a rank's
            copies to one expert past its first T, on a GPU). The backward routes the gradient by the
            dispatch's ids: :func:`dispatch`'s handle brings a copy, and a handle of
            :meth:`Buffer.dispatch` the host's copy (CPU tensors) or the tensor that dispatch was given
            (CUDA: not a copy, so write no -1 into that one before the backward; give combine another).
        topk_weights: ``[num_tokens, num_topk]`` fp32 (may require grad).
        active_ranks: ``[num_ranks]`` int32, updated in place.
        handle: from :func:`dispatch` (or :meth:`Buffer.dispatch`).
        grad_buffer: needed when x or topk_weights requires grad: a Buffer of the same group sized
            with :func:`grad_buffer_size_hint` and used by nothing else during a backward.
        grad_num_topk: the top-k the gradient's dispatch is laid out for, equal on every rank: the
            largest num_topk of any rank, when ranks route with different top-k (the gradient is a
            dispatch of T * grad_num_topk tokens, and its T must be the same everywhere); by default
            this rank's num_topk. grad_buffer is sized with it.
        timeout_us: microseconds to wait for an expert rank; -1 waits forever.

    Returns:
        combined_x ``[num_tokens, hidden]`` bf16.

    Raises:
        TypeError: buffer or grad_buffer is not a Buffer; x, topk_idx, topk_weights or active_ranks
            is not a torch.Tensor; or a gradient is needed and grad_buffer is missing.
        ValueError: grad_num_topk is below this rank's num_topk or above 16; or a gradient is needed
            and grad_buffer is of another group size or too small.

    Note:
        A rank that fails (or comes back) between the forward and the backward moves the gradient
        rows of the ranks after it; each is moved back to its own row, so only the rows of a source
        lost (or gained) since the forward get a zero gradient, and active_ranks shows the failure.
        Differentiable once: a double backward (``create_graph=True``) through it is refused.
    """
    _check_buffer("mooncake_ep.torch.combine", buffer)
    _check_tensors("mooncake_ep.torch.combine", x=x, topk_idx=topk_idx, topk_weights=topk_weights,
                   active_ranks=active_ranks)
    # Their types and range in every call: a typo found only when training starts is found late.
    if grad_buffer is not None:
        _check_buffer("mooncake_ep.torch.combine", grad_buffer, "grad_buffer")
    if grad_num_topk is not None and isinstance(handle, Handle):
        check_grad_num_topk("mooncake_ep.torch.combine", grad_num_topk, handle.num_topk)
    # Checked here, not in forward (which autograd runs with grad mode off): an evaluation under
    # no_grad records no backward, so a Parameter among the inputs needs no grad_buffer there.
    if torch.is_grad_enabled() and (_requires_grad(x) or _requires_grad(topk_weights)):
        grad_num_topk = _check_grad_buffer(buffer, grad_buffer, handle, grad_num_topk)
        if _requires_grad(topk_weights) and x.is_inference():  # before the collective: saving x fails after it
            raise RuntimeError("mooncake_ep.torch.combine: x was made under torch.inference_mode, and the gradient "
                               "of topk_weights reads it in the backward, which torch cannot save; clone it outside "
                               "inference mode (x.clone())")
    return CombineFunction.apply(x, topk_weights, topk_idx, active_ranks, handle, buffer, grad_buffer, grad_num_topk,
                                 timeout_us)


def _check_buffer(where: str, buffer, name: str = "buffer") -> None:
    """``buffer`` is a Buffer: anything else (None, the group) failed later with an AttributeError
    that named no argument (helper-105). And no ``torch.jit.trace`` runs: its shapes are tensors,
    which read as a bad hidden size (helper-154), and a trace would replay no collective."""
    if torch.jit.is_tracing():
        raise RuntimeError(f"{where}: torch.jit.trace cannot record a call of mooncake_ep (a collective with "
                           f"peers, launched from Python); run the model eagerly, in CUDA graphs, or under "
                           f"torch.compile, where the calls are opaque steps")
    if not isinstance(buffer, Buffer):
        raise TypeError(f"{where}: {name} must be a mooncake_ep.Buffer, got {type(buffer).__module__}."
                        f"{type(buffer).__qualname__}")


def _check_tensors(where: str, **arrays) -> None:
    """Refuse what Buffer would take but autograd cannot save (numpy, cupy, JAX arrays), before the
    collective runs: afterwards the results, and the peers' matching call, would be lost."""
    for name, value in arrays.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{where}: {name} must be a torch.Tensor, got {type(value).__module__}."
                            f"{type(value).__qualname__} (Buffer.dispatch / combine take any array, without gradients)")


def _requires_grad(value) -> bool:
    return isinstance(value, torch.Tensor) and value.requires_grad


def _refuse_create_graph(name: str):
    """Refuse a backward that records a graph (``create_graph=True``, which runs it with grad mode on;
    otherwise it runs with grad mode off, so its calls record nothing).

    The backward's dispatches and combines record no graph, so a second derivative through them
    would be silently zero; torch's ``once_differentiable`` refuses it only when the incoming
    gradient itself requires grad, not for a loss linear in the output."""
    def wrap(backward):
        @functools.wraps(backward)
        def checked(ctx, *grads):
            if torch.is_grad_enabled():
                raise RuntimeError(f"mooncake_ep.torch.{name}: a double backward (create_graph=True) is not supported: "
                                   f"its backward is a dispatch and a combine, which record no graph, so the second "
                                   f"derivative would be silently zero")
            return backward(ctx, *grads)
        return checked
    return wrap


class DispatchFunction(torch.autograd.Function):
    """``(x, topk_idx, active_ranks, buffer, T, E, timeout_us) -> (recv_x, recv_count, handle)``; see :func:`dispatch`."""

    @staticmethod
    def forward(ctx, x, topk_idx, active_ranks, buffer, num_max_dispatch_tokens_per_rank, num_experts, timeout_us):
        if x.is_cuda:  # the backward's rebuild of this routing, in fp8: agreed with this one, before it
            where = "mooncake_ep.torch.dispatch"
            # x as the dispatch checks it, before its hidden size is read and agreed on (a 1-D x raised
            # a bare IndexError; a float32 one was agreed on, then refused: helper-120).
            if x.dtype != torch.bfloat16:
                raise TypeError(f"{where}: x must be bfloat16, got {str(x.dtype).removeprefix('torch.')}")
            if x.dim() != 2:
                raise ValueError(f"{where}: x must be 2-dimensional, got shape {tuple(x.shape)}")
            hidden = check_hidden(where, "x.shape[1] (hidden)", x.shape[1])
            num_max_tokens = check_int(where, "num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank,
                                       minimum=1)
            num_local_experts = check_experts(where, num_experts, buffer.num_ranks) // buffer.num_ranks
            buffer._agree_ahead(num_max_tokens, hidden, num_experts, use_fp8=True, round_scale=False,
                                use_ue8m0=False, where=where)
            # The kernels leave the rows past recv_count as they find them; an expert that computes every
            # row (a dense einsum) takes them into its weight gradient, times a zero gradient row, and
            # 0 * NaN is NaN: torch.empty's memory may hold any bits (NaN everywhere under
            # torch.use_deterministic_algorithms). Zeros, as the reference backend's, for one memset.
            out = (torch.zeros((num_local_experts, buffer.num_ranks * num_max_tokens, hidden), dtype=torch.bfloat16,
                               device=x.device),
                   torch.empty(num_local_experts, dtype=torch.int32, device=x.device))
        else:
            out = None  # the reference backend's rows past recv_count are zeros
        recv_x, recv_count, handle, _, _ = buffer.dispatch(x, topk_idx, active_ranks, num_max_dispatch_tokens_per_rank,
                                                           num_experts, timeout_us, use_fp8=False, out=out)
        # Copies: the caller may write into topk_idx (combine documents dropping entries with -1),
        # which the backwards route by, and the workspace's ranges are rewritten two dispatches on.
        forward_range = _layout_range(buffer, "mooncake_ep.torch.dispatch", handle).clone()
        forward_idx = topk_idx.detach().clone()
        _forward_routing[handle] = (forward_range, forward_idx)
        ctx.mark_non_differentiable(recv_count)
        ctx.save_for_backward(forward_idx)
        ctx.forward_range = forward_range
        # active_ranks is updated in place by every later call: keep the tensor, not a saved version.
        ctx.active_ranks = active_ranks
        ctx.config = (buffer, tuple(x.shape), num_max_dispatch_tokens_per_rank, num_experts, timeout_us)
        return recv_x, recv_count, handle

    @staticmethod
    @torch.compiler.disable  # compiled autograd traces backwards too: the library's calls stay opaque
    @_refuse_create_graph("dispatch")
    def backward(ctx, grad_recv_x, grad_recv_count, grad_handle):
        if grad_recv_x is None:
            return (None,) * 7
        (topk_idx,) = ctx.saved_tensors
        buffer, x_shape, num_max_tokens, num_experts, timeout_us = ctx.config
        device = grad_recv_x.device
        # Rebuild this dispatch's routing in the workspace (only the routing is used: zeros, fp8).
        zeros = torch.zeros(x_shape, dtype=torch.bfloat16, device=device)
        _, _, handle, _, _ = buffer.dispatch(zeros, topk_idx, ctx.active_ranks, num_max_tokens, num_experts,
                                             timeout_us, use_fp8=True)
        # A rank that failed or came back since the forward moved the rows of the ranks after it: each
        # row goes where its (source, token) lies now, and a lost source's rows go nowhere.
        backward_range = _layout_range(buffer, "mooncake_ep.torch.dispatch (gradient)", handle)
        grad_rows = _move_rows(grad_recv_x.to(torch.bfloat16), ctx.forward_range, backward_range,
                               grad_recv_x.shape[1])
        ones = torch.ones(topk_idx.shape, dtype=torch.float32, device=device)
        grad_x, _, _ = buffer.combine(grad_rows.contiguous(), topk_idx, ones, ctx.active_ranks, timeout_us, handle)
        return grad_x, None, None, None, None, None, None


class CombineFunction(torch.autograd.Function):
    """``(x, topk_weights, topk_idx, active_ranks, handle, buffer, grad_buffer, grad_num_topk, timeout_us)
    -> combined_x``.

    See :func:`combine`.
    """

    @staticmethod
    def forward(ctx, x, topk_weights, topk_idx, active_ranks, handle, buffer, grad_buffer, grad_num_topk, timeout_us):
        # grad_w reads the forward's expert outputs. needs_input_grad ignores grad mode: under no_grad
        # nothing is recorded, and an inference-mode x (refused by combine() where grad is on) is not kept.
        need_w = ctx.needs_input_grad[1] and not x.is_inference()
        # Either gradient moves rows between this dispatch's layout and its backward's (its row ranges).
        needs_ranges = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        if isinstance(grad_buffer, Buffer) and topk_idx.is_cuda and isinstance(handle, Handle):
            # The backward's dispatch on grad_buffer: agreed now, while every rank is alive (on every rank
            # that passes grad_buffer, whatever it records: the condition must be the same everywhere).
            num_topk = check_grad_num_topk("mooncake_ep.torch.combine", grad_num_topk, handle.num_topk)
            grad_buffer._agree_ahead(handle.num_max_dispatch_tokens_per_rank * num_topk, handle.hidden,
                                     handle.num_experts, use_fp8=False, round_scale=False, use_ue8m0=False,
                                     where="mooncake_ep.torch.combine (gradient)")
        forward_range, dispatched_idx = _forward_routing.get(handle, (None, None))
        if dispatched_idx is None:  # a handle of Buffer.dispatch: its ids, and its sources' rows
            host_ids, given = handle.state.get("topk_idx"), handle.state.get("topk_idx_array")
            dispatched_idx = (torch.from_numpy(host_ids) if host_ids is not None
                              else given if isinstance(given, torch.Tensor) else topk_idx)
            if needs_ranges and handle.backend != "reference":
                # Before the combine: a combine through the workspace leaves the handle refused for more.
                forward_range = _layout_range(buffer, "mooncake_ep.torch.combine", handle).clone()
        combined, _, _ = buffer.combine(x, topk_idx, topk_weights, active_ranks, timeout_us, handle)
        if forward_range is None and needs_ranges:
            # A CPU handle's: after the combine, which refuses a handle it cannot combine on every rank at
            # once (through its exchange; read before, the refusal was this rank's alone, and its peers
            # waited until the group's timeout). The dispatch result's own ranges are never rewritten.
            forward_range = torch.from_numpy(handle.state["result"].layout_range)
        # Made under torch.inference_mode (a frozen dispatch, say), which save_for_backward refuses: the
        # small routing tensors are copied out of it (helper-120: the combine had run when it raised).
        topk_idx, topk_weights, dispatched_idx = (t.clone() if t.is_inference() else t
                                                  for t in (topk_idx, topk_weights, dispatched_idx))
        ctx.save_for_backward(x if need_w else None, topk_idx, topk_weights, dispatched_idx)
        ctx.active_ranks = active_ranks
        ctx.config = (buffer, grad_buffer, handle, grad_num_topk, timeout_us)
        ctx.forward_range = forward_range
        return combined

    @staticmethod
    @torch.compiler.disable
    @_refuse_create_graph("combine")
    def backward(ctx, grad_y):
        expert_out, topk_idx, topk_weights, dispatched_idx = ctx.saved_tensors
        buffer, grad_buffer, handle, grad_num_topk, timeout_us = ctx.config
        if grad_buffer is None:  # CombineFunction.apply called directly, without combine()'s check
            _check_grad_buffer(buffer, grad_buffer, handle, grad_num_topk)
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        num_tokens, num_topk, hidden = handle.num_tokens, handle.num_topk, handle.hidden
        num_rows = buffer.num_ranks * handle.num_max_dispatch_tokens_per_rank
        grad_y32 = grad_y.float()
        # An entry of combine's topk_idx that names no expert added nothing, whatever its dispatch sent.
        named = (topk_idx >= 0) & (topk_idx < handle.num_experts)
        # Row t*K+k is the gradient of expert row (t, k), routed top-1 to the expert the dispatch sent
        # (t, k) to: then each lands on the forward's row, and an entry combine left out sends zeros.
        weights = torch.where(named, topk_weights.float(), torch.zeros((), device=topk_weights.device))
        rows = (weights[:, :, None] * grad_y32[:, None, :]).to(torch.bfloat16).reshape(num_tokens * num_topk, hidden)
        # The forward's dispatch dropped a rank's copies to one expert past its first T; this one, with K
        # times that T, would keep them, and every later row of that expert would be off by their number.
        routes = _drop_copies_past(dispatched_idx, handle.num_experts,
                                   handle.num_max_dispatch_tokens_per_rank).reshape(num_tokens * num_topk, 1)
        try:
            recv, _, grad_handle, _, _ = grad_buffer.dispatch(
                rows, routes, ctx.active_ranks,
                handle.num_max_dispatch_tokens_per_rank * (num_topk if grad_num_topk is None else grad_num_topk),
                handle.num_experts, timeout_us, use_fp8=False)
        except RankMismatchError as exc:  # the likely cause, which the dispatch cannot know
            raise RankMismatchError(f"mooncake_ep.torch.combine (gradient): {exc}. The gradient is a dispatch of "
                                    f"T * grad_num_topk tokens: where ranks route with different top-k, every "
                                    f"rank must pass combine grad_num_topk=, the largest") from exc
        # Each source's rows lie where they did in the forward unless a rank failed or came back since,
        # which moves those of the ranks after it: each row is moved to its (source, token)'s place, and
        # a row whose source is lost or gained since gets 0.
        grad_range = _layout_range(grad_buffer, "mooncake_ep.torch.combine (gradient)", grad_handle)
        grad_x = grad_w = None
        if need_w:
            # Only the first R * T rows of an expert can hold rows (a source sends each expert at most
            # T, the copies past them dropped): moved into those, the rest of the K times larger layout
            # zeros (a move over all of it cost a full-size gather and where more).
            padded = torch.zeros(recv.shape, dtype=torch.bfloat16, device=recv.device)
            padded[:, :num_rows] = _move_rows(expert_out, ctx.forward_range, grad_range, num_rows)
            ones = torch.ones(routes.shape, dtype=torch.float32, device=recv.device)
            unsummed, _, _ = grad_buffer.combine(padded, routes, ones, ctx.active_ranks, timeout_us, grad_handle)
            grad_w = (unsummed.float().view(num_tokens, num_topk, hidden) * grad_y32[:, None, :]).sum(-1)
            # where, not a product: a left-out entry's row may be anything (an uncomputed capacity row)
            grad_w = torch.where(named, grad_w, torch.zeros((), device=grad_w.device))
        if need_x:  # rows past recv_count have no source: 0
            grad_x = _move_rows(recv, grad_range, ctx.forward_range, num_rows)
        return grad_x, grad_w, None, None, None, None, None, None, None


def _layout_range(buffer: Buffer, where: str, handle: Handle) -> torch.Tensor:
    """:meth:`Buffer._recv_layout_range` as a tensor, ``[num_local_experts, num_ranks, 2]`` int32 (a
    view of the workspace on the GPU: copy what is kept past the next dispatch). A handle of
    :meth:`Buffer.dispatch` may come from numpy or cupy arrays: those cross through DLPack (a torch
    tensor not again: exporting a CUDA one raises where the current device is another)."""
    ranges = buffer._recv_layout_range(where, handle)
    return ranges if isinstance(ranges, torch.Tensor) else torch.from_dlpack(ranges)


def _drop_copies_past(topk_idx: torch.Tensor, num_experts: int, num_max_dispatch_tokens_per_rank: int) -> torch.Tensor:
    """``topk_idx`` (``[num_tokens, num_topk]`` int) with -1 at each copy a dispatch with that T drops.

    A dispatch delivers at most T copies of one rank's to one expert (recv_x's rows per source), the
    first T in (token, k) order (``reference.expert_slots``); only a token naming an expert twice
    makes more. Ids outside [0, num_experts) are left as they are (the dispatch sends them nowhere).
    On the device, without a synchronisation."""
    flat = topk_idx.reshape(-1)
    ordered, order = torch.sort(flat, stable=True)  # each expert's copies together, in (token, k) order
    slot_in_order = torch.arange(flat.numel(), device=flat.device) - torch.searchsorted(ordered, ordered)
    slots = torch.empty_like(slot_in_order).scatter_(0, order, slot_in_order)
    dropped = (flat >= 0) & (flat < num_experts) & (slots >= num_max_dispatch_tokens_per_rank)
    return torch.where(dropped, torch.full((), -1, dtype=flat.dtype, device=flat.device), flat).view(topk_idx.shape)


def _move_rows(rows: torch.Tensor, from_range: torch.Tensor, to_range: torch.Tensor, num_to_rows: int) -> torch.Tensor:
    """Rows received by one dispatch, moved to where another dispatch of the same routing received them.

    Rows are ordered by source rank, then token (in (token, k) order), so a source live in both
    dispatches has the same rows in the same order, only starting elsewhere when a source before it
    was lost or gained between them. Each row goes from its source's place in ``from_range`` to its
    place in ``to_range``; a row of a source the other dispatch did not receive (lost, gained, or
    its rows written as zeros) gets 0, as does every row past the last source's. Of a source with
    more rows in one than in the other (a copy past its first T rows to one expert, which a dispatch
    of fewer tokens per rank drops), the common first rows move. On the device, without a
    synchronisation: plain tensor ops on both backends.

    Args:
        rows: ``[num_local_experts, num_from_rows, ...]``, laid out as ``from_range`` says.
        from_range, to_range: ``[num_local_experts, num_ranks, 2]`` int32, each dispatch's (first row,
            rows) per (local expert, source rank) (:meth:`Buffer._recv_layout_range`).
        num_to_rows: rows of the result per local expert, at least the last range's end in ``to_range``.

    Returns:
        ``[num_local_experts, num_to_rows, ...]`` of ``rows``' dtype, laid out as ``to_range`` says.
    """
    from_range, to_range = from_range.to(rows.device, torch.int64), to_range.to(rows.device, torch.int64)
    to_first, to_count = to_range[..., 0], to_range[..., 1]
    num_local_experts, num_ranks = to_first.shape
    to_rows = torch.arange(num_to_rows, device=rows.device).expand(num_local_experts, num_to_rows).contiguous()
    # Each row's source: the first whose range ends past it (the ends are nondecreasing along the
    # sources, a source without rows ends where it begins); past every range, the last source, whose
    # offset then falls outside its rows.
    source = torch.searchsorted((to_first + to_count).contiguous(), to_rows, right=True).clamp_(max=num_ranks - 1)
    offset = to_rows - to_first.gather(1, source)
    kept = torch.minimum(to_count, from_range[..., 1]).gather(1, source)
    moved = (offset >= 0) & (offset < kept)
    from_rows = torch.where(moved, from_range[..., 0].gather(1, source) + offset, 0)
    index = from_rows.reshape(from_rows.shape + (1,) * (rows.dim() - 2))
    # where, not a product: a row left out may hold anything (an uncomputed capacity row, NaN).
    return torch.where(moved.reshape(index.shape), torch.take_along_dim(rows, index, dim=1),
                       torch.zeros((), dtype=rows.dtype, device=rows.device))


def _check_grad_buffer(buffer: Buffer, grad_buffer, handle, grad_num_topk) -> int:
    """The gradient's top-k (grad_num_topk, or the handle's), once grad_buffer is found fit for it."""
    where = "mooncake_ep.torch.combine"
    if grad_buffer is None:
        raise TypeError(f"{where}: the gradient of combine is a dispatch of num_tokens * num_topk rows: pass "
                        f"grad_buffer=, a Buffer of the same group sized with "
                        f"mooncake_ep.torch.grad_buffer_size_hint(T, hidden, num_ranks, num_experts, num_topk)")
    _check_buffer(where, grad_buffer, "grad_buffer")
    grad_buffer._check_alive(f"{where}: grad_buffer")  # here, not in a backward long after this call
    if grad_buffer is buffer or grad_buffer.num_ranks != buffer.num_ranks:
        raise ValueError(f"{where}: grad_buffer must be another Buffer of the same group ({buffer.num_ranks} ranks), "
                         f"got {'the forward Buffer' if grad_buffer is buffer else f'{grad_buffer.num_ranks} ranks'}")
    if grad_buffer.rank != buffer.rank:  # its dispatch would run as that rank: every rank's gradient swapped
        raise ValueError(f"{where}: grad_buffer is rank {grad_buffer.rank} of its group, buffer rank {buffer.rank}: "
                         f"pass this rank's Buffer of the gradient's group")
    # Where the backward's calls run: refused there, they would name the backward's arrays, not grad_buffer.
    if (grad_buffer.backend, grad_buffer.device_id) != (buffer.backend, buffer.device_id):
        raise ValueError(f"{where}: grad_buffer runs on the {grad_buffer.backend} backend on device "
                         f"{grad_buffer.device_id}, buffer on the {buffer.backend} backend on device {buffer.device_id}: "
                         f"build grad_buffer where buffer is")
    if not isinstance(handle, Handle):
        raise TypeError(f"{where}: handle must be the Handle returned by dispatch, got {type(handle).__name__}")
    num_topk = check_grad_num_topk(where, grad_num_topk, handle.num_topk)
    needed = grad_buffer_size_hint(handle.num_max_dispatch_tokens_per_rank, handle.hidden, buffer.num_ranks,
                                   handle.num_experts, num_topk)
    if grad_buffer.num_ep_buffer_bytes < needed:
        raise ValueError(f"{where}: grad_buffer has {grad_buffer.num_ep_buffer_bytes} bytes, the gradient needs {needed} "
                         f"(grad_buffer_size_hint(T={handle.num_max_dispatch_tokens_per_rank}, hidden={handle.hidden}, "
                         f"num_ranks={buffer.num_ranks}, num_experts={handle.num_experts}, num_topk={num_topk}))")
    return num_topk
