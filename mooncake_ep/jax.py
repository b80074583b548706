"""JAX dispatch and combine: eager, under ``jax.jit`` and ``jax.jit(shard_map(...))``, differentiable.

Each call is one ``jax.experimental.buffer_callback`` op that runs in XLA's stream: on a GPU it
launches the kernels of :class:`mooncake_ep.Buffer` on XLA's buffers, on the CPU it runs the numpy
reference on the host buffers. Result shapes are declared up front, so the ops trace, ``jit`` and
record into XLA command buffers (``command_buffer_compatible=True``) like any JAX op.

Example (one rank per device under ``shard_map``; ``buffers`` maps each device to its rank's
Buffer, see :func:`make_buffers`)::

    import mooncake_ep.jax as epj

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))
    def moe(x, topk_idx, topk_weights, active):
        recv_x, recv_count, handle, active = epj.dispatch(buffers, x, topk_idx, active, T, E, use_fp8=False)
        y = experts(recv_x)                       # [E_l, R*T, H] bf16, rows past recv_count ignored
        out, active = epj.combine(buffers, y, topk_idx, topk_weights, active, handle)
        return out

Several ranks on one GPU share XLA's one stream for that device, where a receive half waiting for
a peer would block the peer's send behind it. Use the split form there: every rank's
send half, then every rank's receive half; a send half never waits, and no receive half waits for
another's (the split combine copies the expert outputs into the workspace instead of letting peers
read them in place, which would make each receive half wait until every peer had read), so the
order cannot deadlock::

    buffers = ep.LocalGroup(R, devices=[0] * R).spawn(lambda g: ep.Buffer(g, size))  # a list, rank order
    sent = [epj.dispatch_send(buffers[r], xs[r], topks[r], actives[r], T, E) for r in range(R)]
    results = epj.dispatch_recv(sent)         # [(recv_x, recv_count, handle, active) per rank]

Note:
    **Parity.** The kernels keep their epochs in device memory, but which workspace half a call
    uses is a launch argument. Under a command buffer the Python callback runs only when XLA
    records (and again, per device, when buffer addresses change), so the half cannot come from
    the Buffer's host counter: it is the static ``parity`` argument, fixed at trace time and equal
    on every rank. ``parity=0`` everywhere is correct as long as each dispatch is followed by its
    combine before the next dispatch on that Buffer; two dispatches whose handles are alive at once
    (two micro-batches) need parities 0 and 1. Do not interleave these ops with a
    :meth:`mooncake_ep.Buffer.dispatch` whose handle is still waiting for its combine. The CPU
    path refuses a combine of a handle whose parity a later dispatch took (``handle is stale``);
    on a GPU nothing sees it, and the combine would use that dispatch's routing.

    **Order.** XLA orders the ops by data: a combine takes its dispatch's handle, and each
    receive half takes every rank's send-half results. Keep the data flowing (pass the returned
    ``active_ranks`` on) so two steps on one Buffer cannot be reordered.

    **Gradients.** :func:`dispatch` (bf16) and :func:`combine` carry a ``jax.custom_vjp``. The
    backward of combine is a dispatch of the rows ``w_k * grad_y[t]`` as ``t * K`` tokens, each
    routed to its k-th expert, which land exactly where the forward's rows were; that needs a
    second Buffer sized for ``T * K`` tokens (``grad_buffer=``, see :func:`grad_buffer_size_hint`).
    The gradient of the routing weights, ``<expert_out[row(t, k)], grad_y[t]>``, is a combine of
    the forward's expert outputs on that layout with unit weights (every row comes back unsummed).
    The backward of dispatch is a combine of the gradient with unit weights; it first re-runs a
    dispatch (fp8, of zeros) to rebuild the routing in the workspace, since the workspace keeps the
    routing of the last dispatches only. Not supported: gradients of an fp8 dispatch, of
    ``renormalize=True``, and of the split form (use :func:`dispatch` / :func:`combine`, one
    rank per device); ``jax.vmap`` (use ``shard_map``) and what maps with it (``jax.jacrev``,
    ``jax.hessian``), forward-mode ``jax.jvp``, second-order gradients (the backward's ops have no
    derivative of their own), and a ``shard_map`` outside ``jax.jit`` (JAX runs a custom_vjp with
    symbolic zeros in shard_map only when traced). ``jax.checkpoint`` refuses a step in which a
    rank has no tokens (its ops keep a side effect, see :mod:`mooncake_ep.frameworks.jax_ops`):
    give it one token whose ids are all -1.

    **CPU.** On the CPU each rank's collective runs through its group (a :class:`LocalGroup` of
    threads): the ranks must run at once, so give each rank its own JAX CPU device
    (``jax.config.update("jax_num_cpu_devices", R)`` before JAX starts), as XLA runs one CPU
    device's programs one at a time. The split form needs no collective on the CPU: every rank's
    inputs reach each receive half as operands.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Iterable, Mapping, Sequence, Set
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

try:  # every op is one; without it the first call failed deep inside, long after the import
    import jax.experimental.buffer_callback  # noqa: F401
except ImportError as error:
    raise ImportError(f"mooncake_ep.jax needs jax.experimental.buffer_callback (jax >= 0.6.1; tested with "
                      f"0.10 and 0.11), found jax {jax.__version__}") from error

from mooncake_ep import _constants
from mooncake_ep._reference_backend import refusal_of
from mooncake_ep.buffer import Buffer
from mooncake_ep.frameworks import jax_args, jax_ops, jax_split
from mooncake_ep.frameworks.jax_ops import Handle, PendingCombine, PendingDispatch
from mooncake_ep.group import DEFAULT_TIMEOUT_S, LocalGroup
from mooncake_ep.validation import (check_bool, check_experts, check_flags, check_grad_num_topk, check_int,
                                    check_timeout)

__all__ = ["Handle", "PendingDispatch", "PendingCombine", "dispatch", "combine", "dispatch_send", "dispatch_recv",
           "combine_send", "combine_recv", "grad_buffer_size_hint", "make_buffers", "destroy_buffers"]

BufferArg = Buffer | Mapping[Any, Buffer]


# --- dispatch ---------------------------------------------------------------------------------------


def _check_one_buffer(where: str, buffer) -> None:
    """The split ops take one rank's Buffer (the fused ops also take a mapping of them)."""
    if not isinstance(buffer, Buffer):
        raise TypeError(f"{where}: buffer must be one rank's mooncake_ep.Buffer, got {type(buffer).__name__}")


def _static_ints(where: str, num_max_dispatch_tokens_per_rank, num_experts) -> tuple[int, int]:
    """T and E as Python ints (numpy's small integers would wrap in the shapes worked out from them);
    the Buffer's checks refuse the rest of what is wrong with them (E not a multiple of the ranks)."""
    return (check_int(where, "num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank, minimum=1),
            check_int(where, "num_experts", num_experts, minimum=1, maximum=_constants.MAX_EXPERTS))


@dataclasses.dataclass(frozen=True)
class _DispatchStatic:
    ranks: jax_args.Ranks
    num_max_dispatch_tokens_per_rank: int
    num_experts: int
    timeout_us: int
    use_fp8: bool
    round_scale: bool
    use_ue8m0: bool
    parity: int
    command_buffer_compatible: bool

    def options(self) -> dict:
        return dict(timeout_us=self.timeout_us, use_fp8=self.use_fp8, round_scale=self.round_scale,
                    use_ue8m0=self.use_ue8m0, parity=self.parity,
                    command_buffer_compatible=self.command_buffer_compatible)


def dispatch(buffer: BufferArg, x, topk_idx, active_ranks, num_max_dispatch_tokens_per_rank: int, num_experts: int,
             *, timeout_us: int = _constants.TIMEOUT_FOREVER, use_fp8: bool = True, round_scale: bool = False,
             use_ue8m0: bool = False, parity: int = 0, command_buffer_compatible: bool = True):
    """Send each token to the ranks owning its top-k experts; receive this rank's experts' tokens.

    The JAX form of :meth:`mooncake_ep.Buffer.dispatch`: same arguments and checks, results as JAX
    arrays, the updated mask returned instead of written in place. Differentiable w.r.t. ``x``
    (bf16 only).

    Args:
        buffer: this rank's :class:`mooncake_ep.Buffer`, or ``{jax.Device: Buffer}`` with one rank per
            device under ``shard_map`` (:func:`make_buffers`). On a GPU, the Buffer's device must be
            the arrays' and hold no other rank of the group (else use the split form).
        x: ``[num_tokens, hidden]`` bf16; num_tokens <= num_max_dispatch_tokens_per_rank, hidden a
            multiple of 128.
        topk_idx: ``[num_tokens, num_topk]`` int32 (int64 with ``jax_enable_x64``) global expert ids; -1 =
            no expert. A numpy int64 array becomes int32 (JAX's canonicalisation; ids fit).
        active_ranks: ``[num_ranks]`` int32, 1 (any nonzero value) = alive, 0 = masked.
        num_max_dispatch_tokens_per_rank: T, equal on every rank.
        num_experts: E, a multiple of num_ranks.
        timeout_us: microseconds a receive waits for a peer before masking it; -1 waits forever.
        use_fp8, round_scale, use_ue8m0: as in :meth:`mooncake_ep.Buffer.dispatch`.
        parity: the workspace half, 0 or 1, fixed at trace time (see the module note).
        command_buffer_compatible: let XLA record the launches into a command buffer (CUDA graph).

    Returns:
        ``(recv_x, recv_count, handle, active_ranks)``: recv_x ``[num_local_experts, num_ranks * T,
        hidden]`` bf16, or with use_fp8 ``(x_fp8 float8_e4m3fn [same], scales [num_local_experts,
        num_ranks * T, hidden / 128] fp32)`` (int32 ``[..., ceil(hidden / 512)]`` with use_ue8m0; row-major,
        as every JAX array, where Buffer.dispatch's torch results are DeepEP's column-major view); rows
        ordered by source rank then token, rows past recv_count[e] undefined. recv_count
        ``[num_local_experts]`` int32. handle: :class:`Handle`, for :func:`combine`. active_ranks
        ``[num_ranks]`` int32, with 0 for the ranks this call timed out on.

    Raises:
        TypeError, ValueError: at trace time, with :meth:`Buffer.dispatch`'s messages; also for a
            float64 numpy argument, an array of another framework, a parity outside {0, 1}, or a GPU
            Buffer whose device holds several ranks. Bad ids in a CPU ``topk_idx`` raise ValueError
            when called eagerly; under ``jit`` (values unknown at trace time) the op raises when it
            runs, and JAX reports that as a ``JaxRuntimeError`` carrying the same message (a
            ValueError wrapping it once the program was compiled and cached, in JAX 0.10). Either
            way the op refuses them through its exchange, so the other ranks' ops raise at once too,
            naming this rank and its reason; no rank counts the call and the group stays usable.
    """
    where = "mooncake_ep.jax.dispatch"
    ranks = jax_args.as_ranks(where, buffer)
    num_max_dispatch_tokens_per_rank, num_experts = _static_ints(where, num_max_dispatch_tokens_per_rank, num_experts)
    x, topk_idx, active_ranks = (jax_args.as_jax(where, name, value) for name, value in
                                 (("x", x), ("topk_idx", topk_idx), ("active_ranks", active_ranks)))
    jax_args.check_devices(where, ranks, x=x, topk_idx=topk_idx, active_ranks=active_ranks)
    # Before the ids are read against it, as under jit (an E the op refuses made valid ids look bad).
    num_experts = check_experts(where, num_experts, ranks.first.num_ranks)
    refusal = refusal_of(jax_args.check_eager_expert_ids, where, topk_idx, num_experts, num_max_dispatch_tokens_per_rank)
    # Here, not only in the op: the gradient's refusal of fp8 reads use_fp8 before the op checks it.
    check_flags(where, use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=use_ue8m0)
    timeout_us = _checked_options(where, timeout_us, command_buffer_compatible)
    static = _DispatchStatic(ranks, num_max_dispatch_tokens_per_rank, num_experts, timeout_us, use_fp8,
                             round_scale, use_ue8m0, jax_args.check_parity(where, parity), command_buffer_compatible)
    return _bind_or_refuse(refusal, where, _dispatch, static, x, topk_idx, active_ranks)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _dispatch(static: _DispatchStatic, x, topk_idx, active_ranks):
    return jax_ops.dispatch("mooncake_ep.jax.dispatch", static.ranks, x, topk_idx, active_ranks,
                            static.num_max_dispatch_tokens_per_rank, static.num_experts, **static.options())


def _dispatch_fwd(static: _DispatchStatic, x, topk_idx, active_ranks):
    if x.perturbed and static.use_fp8:
        raise TypeError("mooncake_ep.jax.dispatch: the gradient of an fp8 dispatch is not supported (its rows are "
                        "quantised); dispatch bf16 (use_fp8=False) for training and quantise inside the experts")
    out = _dispatch(static, x.value, topk_idx.value, active_ranks.value)
    _, recv_count, _, active_out = out
    # x[:0]: no bytes, but x's type, whose shard_map axes the gradient must match (_cotangent_like).
    return out, (topk_idx.value, active_out, recv_count, x.value[:0])


def _dispatch_bwd(static: _DispatchStatic, residuals, cotangents):
    topk_idx, active, forward_count, x_like = residuals
    grad_recv_x = cotangents[0]
    if isinstance(grad_recv_x, jax.custom_derivatives.SymbolicZero):
        return None, None, None
    where = "mooncake_ep.jax.dispatch (gradient)"
    grad_recv_x = grad_recv_x.astype(jnp.bfloat16)
    # The workspace keeps only the last dispatches' routing: rebuild it (fp8 halves the bytes; only the
    # routing is used), after the gradient exists, so it cannot be scheduled before the forward combine.
    x_shape = (topk_idx.shape[0], grad_recv_x.shape[2])
    zeros = jax_args.varying_like(jnp.zeros(x_shape, jnp.bfloat16), grad_recv_x)
    _, count, handle, active = jax_ops.dispatch(where, static.ranks, zeros, topk_idx, active,
                                                static.num_max_dispatch_tokens_per_rank, static.num_experts,
                                                **(static.options() | dict(use_fp8=True, round_scale=False,
                                                                           use_ue8m0=False)),
                                                after=(grad_recv_x,))
    # A rank that failed since the forward moved the rows: an expert whose count differs from the
    # forward's sends zeros, not the gradient rows of other tokens. (No rank can come back here: this
    # dispatch starts from the forward's mask, and the kernels only ever mask.)
    grad_recv_x = _where_same(count == forward_count, grad_recv_x)
    ones = jax_args.varying_like(jnp.ones(topk_idx.shape, jnp.float32), grad_recv_x)
    grad_x, _ = jax_ops.combine(where, static.ranks, grad_recv_x, topk_idx, ones, active, handle,
                                timeout_us=static.timeout_us, renormalize=False,
                                command_buffer_compatible=static.command_buffer_compatible)
    return _cotangent_like(grad_x, x_like), None, None


_dispatch.defvjp(_dispatch_fwd, _dispatch_bwd, symbolic_zeros=True)


# --- combine ----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _CombineStatic:
    ranks: jax_args.Ranks
    grad_ranks: jax_args.Ranks | None
    grad_num_topk: int
    grad_parity: int
    timeout_us: int
    renormalize: bool
    command_buffer_compatible: bool


def combine(buffer: BufferArg, x, topk_idx, topk_weights, active_ranks, handle: Handle, *,
            timeout_us: int = _constants.TIMEOUT_FOREVER, renormalize: bool = False,
            grad_buffer: BufferArg | None = None, grad_num_topk: int | None = None, grad_parity: int = 0,
            command_buffer_compatible: bool = True):
    """Bring expert outputs back to the tokens' ranks and sum them with the routing weights.

    The JAX form of :meth:`mooncake_ep.Buffer.combine`. Differentiable w.r.t. ``x`` and
    ``topk_weights`` when ``grad_buffer`` is given.

    Args:
        buffer: as given to the :func:`dispatch` of ``handle``.
        x: ``[num_local_experts, num_ranks * T, hidden]`` bf16 expert outputs, rows laid out as recv_x.
        topk_idx: ``[num_tokens, num_topk]`` the ids given to that dispatch; an entry may be -1 where
            the dispatch had an expert (it then adds nothing, and gets no gradient), as does a copy the
            dispatch dropped (a rank's copies to one expert past its first T, on a GPU).
        topk_weights: ``[num_tokens, num_topk]`` float32 (float64 is refused, never cast).
        active_ranks: ``[num_ranks]`` int32 (pass the mask dispatch returned).
        handle: the :class:`Handle` returned by that dispatch.
        timeout_us: microseconds to wait for an expert rank before masking it; -1 waits forever.
        renormalize: scale each token's live weights so they sum to the sum of all its weights.
        grad_buffer: for the gradient only: a Buffer (or mapping, like ``buffer``) of the same group
            sized for ``T * num_topk`` tokens (:func:`grad_buffer_size_hint`), used by nothing else
            while a backward runs.
        grad_num_topk: the top-k the gradient's dispatch is laid out for, equal on every rank: the
            largest num_topk of any rank, when ranks route with different top-k (the gradient is a
            dispatch of T * grad_num_topk tokens, and its T must be the same everywhere); by default
            this rank's num_topk. grad_buffer is sized with it.
        grad_parity: the parity of the gradient's ops on grad_buffer.
        command_buffer_compatible: as in :func:`dispatch`.

    Returns:
        ``(combined_x, active_ranks)``: combined_x ``[num_tokens, hidden]`` bf16, Σ_k w_k · x[row(t, k)]
        over live experts, summed in fp32 and rounded once; active_ranks ``[num_ranks]`` int32.

    Raises:
        TypeError, ValueError: at trace time, with :meth:`Buffer.combine`'s messages; when
            differentiating without ``grad_buffer`` or with ``renormalize=True``; for a grad_buffer
            that is the forward's, of another group size, or smaller than :func:`grad_buffer_size_hint`;
            under a ``shard_map`` outside ``jax.jit``. Ids in a CPU ``topk_idx`` that name other experts
            than the dispatch's raise ValueError when called eagerly (under ``jit``, from the op as a
            ``JaxRuntimeError``, or a ValueError wrapping it for a cached program).
        RuntimeError: grad_buffer was destroyed.

    Note:
        The backward routes the gradient with the mask this combine returns. A rank masked after the
        forward's dispatch (by this combine's timeout, or a failure during the backward) changes
        where later ranks' gradient rows land: the experts whose row counts then differ from the
        forward's (and every expert, if this combine's mask has a rank back that the dispatch's
        masked) give zero gradients (to ``x`` and, through them, to ``topk_weights`` and the
        dispatch's ``x``) rather than misplaced ones, and the failure shows in ``active_ranks``.

        One combine per dispatch: a second combine of ``handle`` (here or with the split form)
        would copy into the workspace rows that slower peers may still be reading (ranks in other
        processes, or the split form, read copies there). The host cannot see this inside a jitted
        program, so it is not refused as :meth:`mooncake_ep.Buffer.combine` refuses it.

        Micro-batches: two forward steps in flight at once take parities 0 and 1 (see the module
        docstring), and their backwards may overlap too: give each combine ``grad_parity`` equal
        to its dispatch's ``parity``, as XLA does not order one micro-batch's gradient ops after the
        other's.
    """
    where = "mooncake_ep.jax.combine"
    ranks = jax_args.as_ranks(where, buffer)
    # Here, not only in the op: the gradient's refusal of renormalize reads it before the op checks it.
    check_flags(where, renormalize=renormalize)
    jax_ops.check_handle(where, handle, ranks)
    grad_num_topk = check_grad_num_topk(where, grad_num_topk, handle.config.num_topk)
    grad_ranks = None if grad_buffer is None else _check_grad_buffer(where, ranks, grad_buffer, handle, grad_num_topk)
    x, topk_idx, topk_weights, active_ranks = (
        jax_args.as_jax(where, name, value) for name, value in
        (("x", x), ("topk_idx", topk_idx), ("topk_weights", topk_weights), ("active_ranks", active_ranks)))
    jax_args.check_devices(where, ranks, x=x, topk_idx=topk_idx, topk_weights=topk_weights, active_ranks=active_ranks,
                           handle=handle.recv_count)
    refusal = refusal_of(jax_args.check_eager_routing, where, topk_idx, handle.dispatched_topk_idx,
                         handle.config.num_experts)
    grad_parity = jax_args.check_parity(where, grad_parity, "grad_parity")
    timeout_us = _checked_options(where, timeout_us, command_buffer_compatible)
    static = _CombineStatic(ranks, grad_ranks, grad_num_topk, grad_parity, timeout_us, renormalize,
                            command_buffer_compatible)
    return _bind_or_refuse(refusal, where, _combine, static, x, topk_idx, topk_weights, active_ranks, handle)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _combine(static: _CombineStatic, x, topk_idx, topk_weights, active_ranks, handle):
    return jax_ops.combine("mooncake_ep.jax.combine", static.ranks, x, topk_idx, topk_weights, active_ranks, handle,
                           timeout_us=static.timeout_us, renormalize=static.renormalize,
                           command_buffer_compatible=static.command_buffer_compatible)


def _combine_fwd(static: _CombineStatic, x, topk_idx, topk_weights, active_ranks, handle):
    where = "mooncake_ep.jax.combine"
    if x.perturbed or topk_weights.perturbed:
        if static.renormalize:
            raise TypeError(f"{where}: the gradient of combine with renormalize=True is not supported; normalise the "
                            f"weights in the router (differentiably) and combine with renormalize=False")
        if static.grad_ranks is None:
            raise TypeError(f"{where}: the gradient of combine is a dispatch of num_tokens * num_topk rows: pass "
                            f"grad_buffer=, a Buffer of the same group sized with "
                            f"mooncake_ep.jax.grad_buffer_size_hint(T, hidden, num_ranks, num_experts, num_topk)")
    handle = _values(handle)
    out = _combine(static, x.value, topk_idx.value, topk_weights.value, active_ranks.value, handle)
    keep_x = x.value if topk_weights.perturbed else None
    return out, (keep_x, topk_idx.value, topk_weights.value, out[1], handle, x.perturbed, x.value[:0])


def _combine_bwd(static: _CombineStatic, residuals, cotangents):
    expert_out, topk_idx, topk_weights, active, handle, want_x, x_like = residuals
    grad_y = cotangents[0]
    if isinstance(grad_y, jax.custom_derivatives.SymbolicZero):
        return None, None, None, None, None
    where = "mooncake_ep.jax.combine (gradient)"
    # The likely cause of ranks disagreeing on the gradient's dispatch, which its error cannot know. (Its
    # errors all carry it: they arise inside the op, at trace or run time, where no wrapper could pick.)
    dispatch_where = (f"{where[:-1]}: a dispatch of T * grad_num_topk tokens; where ranks disagree on its T, "
                      f"they route with different top-k and must pass combine the same grad_num_topk=, the largest)")
    config = handle.config
    num_tokens, num_topk, hidden = config.num_tokens, config.num_topk, config.hidden
    num_rows = config.num_ranks * config.num_max_dispatch_tokens_per_rank
    grad_y32 = grad_y.astype(jnp.float32)
    # grad of expert row (t, k) is w_k * grad_y[t]: dispatch those t*K rows as t*K tokens, token t*K+k
    # routed (top-1) to the expert the dispatch sent (t, k) to. A local expert then receives them in
    # the order (source rank, t, k) of the forward's rows, with the same counts, so they land on the
    # forward's rows. An entry combine's topk_idx leaves out (-1) added nothing: it sends zeros.
    named = (topk_idx >= 0) & (topk_idx < config.num_experts)
    weights = jnp.where(named, topk_weights, jnp.zeros((), topk_weights.dtype))
    rows = (weights[:, :, None] * grad_y32[:, None, :]).astype(jnp.bfloat16).reshape(num_tokens * num_topk, hidden)
    # The forward's dispatch dropped a rank's copies to one expert past its first T; this one, with K
    # times that T, would keep them, and every later row of that expert would be off by their number.
    routes = _drop_copies_past(handle.dispatched_topk_idx, config.num_experts,
                               config.num_max_dispatch_tokens_per_rank).reshape(num_tokens * num_topk, 1)
    grad_T = config.num_max_dispatch_tokens_per_rank * static.grad_num_topk
    recv, count, grad_handle, grad_active = jax_ops.dispatch(
        dispatch_where, static.grad_ranks, rows, routes, active, grad_T, config.num_experts, timeout_us=static.timeout_us,
        use_fp8=False, round_scale=False, use_ue8m0=False, parity=static.grad_parity,
        command_buffer_compatible=static.command_buffer_compatible)
    same = _same_rows(count, grad_active, handle.recv_count, handle.sources)
    grad_w = None
    if expert_out is not None:
        # <expert_out[row(t, k)], grad_y[t]>: the forward's rows come back unsummed through a combine on the
        # t*K layout with unit weights. recv passes through it, so the next op on grad_buffer (whose inputs
        # derive from recv) cannot be scheduled before it.
        # Rows a failure may have moved since the forward come back as zeros, and give none.
        padded = jnp.zeros(recv.shape, jnp.bfloat16).at[:, :num_rows].set(_where_same(same, expert_out))
        ones = jax_args.varying_like(jnp.ones(routes.shape, jnp.float32), grad_y)
        unsummed, _, recv = jax_ops.combine(where, static.grad_ranks, padded, routes, ones, grad_active, grad_handle,
                                            timeout_us=static.timeout_us, renormalize=False,
                                            command_buffer_compatible=static.command_buffer_compatible,
                                            through=(recv,))
        grad_w = jnp.where(named, jnp.sum(unsummed.astype(jnp.float32).reshape(num_tokens, num_topk, hidden)
                                          * grad_y32[:, None, :], axis=-1), jnp.zeros((), jnp.float32))
        grad_w = _cotangent_like(grad_w, topk_weights)
    grad_x = None
    if want_x:
        valid = (jnp.arange(num_rows)[None, :] < count[:, None]) & same[:, None]
        grad_x = _cotangent_like(jnp.where(valid[:, :, None], recv[:, :num_rows], jnp.zeros((), jnp.bfloat16)), x_like)
    return grad_x, None, grad_w, None, None


_combine.defvjp(_combine_fwd, _combine_bwd, symbolic_zeros=True)


def _cotangent_like(grad, primal):
    """``grad`` summed over the ``shard_map`` axes it varies over and ``primal`` does not.

    The ops' results vary over every axis of the shard_map (each device is a rank); an input
    replicated over an axis (``in_specs`` without it) is the same array on every rank there, so its
    cotangent is the sum of the ranks' (the transpose of JAX's own broadcast). A shard_map with
    ``check_vma=False`` tracks no axes: there, as for JAX's own ops, the caller sums it."""
    missing = tuple(sorted(jax_args.varying_axes(grad) - jax_args.varying_axes(primal), key=str))
    return jax.lax.psum(grad, missing) if missing else grad


def _same_rows(count, active, forward_count, forward_sources):
    """``[num_local_experts]`` bool: whether a gradient's dispatch (its ``count``, and its mask after it,
    ``active``) received each expert's rows from the forward's tokens, in the forward's order.

    Rows are ordered by source rank, then token. A source lost since the forward shortens the count of
    every expert it sent rows to, so an equal count means it sent none there. A source gained (one the
    forward's dispatch masked, back in the mask combine was given) can make up for a lost one's rows
    with as many of its own: then no expert is trusted (as mooncake_ep.torch does)."""
    same = count == forward_count
    if forward_sources is None:  # a handle made otherwise
        return same
    return same & ~jnp.any((active != 0) & (forward_sources == 0))


def _drop_copies_past(topk_idx, num_experts: int, num_max_dispatch_tokens_per_rank: int):
    """``topk_idx`` (``[num_tokens, num_topk]`` int) with -1 at each copy a dispatch with that T drops.

    A dispatch delivers at most T copies of one rank's to one expert (recv_x's rows per source), the
    first T in (token, k) order (``reference.expert_slots``); only a token naming an expert twice
    makes more. Ids outside [0, num_experts) are left as they are (the dispatch sends them nowhere)."""
    flat = topk_idx.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # each expert's copies together, in (token, k) order
    ordered = flat[order]
    slot_in_order = jnp.arange(flat.shape[0]) - jnp.searchsorted(ordered, ordered, side="left")
    slots = jnp.zeros_like(slot_in_order).at[order].set(slot_in_order)
    dropped = (flat >= 0) & (flat < num_experts) & (slots >= num_max_dispatch_tokens_per_rank)
    return jnp.where(dropped, jnp.full((), -1, flat.dtype), flat).reshape(topk_idx.shape)


def _where_same(same, rows):
    """``rows`` (``[num_local_experts, ...]``) with the experts ``same`` leaves out set to 0."""
    return jnp.where(same.reshape((-1,) + (1,) * (rows.ndim - 1)), rows, jnp.zeros((), rows.dtype))


def _bind(where: str, op, static, *args):
    """``op(static, *args)``, one of the ops' custom_vjps, run as ``jax.jit(op)`` when called eagerly.

    Eagerly (every array a concrete ``jax.Array``: no transformation is tracing) JAX would trace the
    custom_vjp and run its primitives one at a time, every call: ~1.2 ms a call on a GPU's host. The
    jitted op is traced once per static configuration and shapes, then each call runs the compiled
    program, as under the caller's own ``jax.jit``. A cached program skips the trace-time checks, so
    the callers make before this, every call, each check it must not skip: the options' types
    (:func:`_checked_options`) and, above all, that no Buffer was destroyed (``check_devices``,
    ``jax_split.check_pending``), since a command buffer replays its launches without calling back.

    The ops' custom_vjp takes symbolic zeros (a cotangent known to be zero costs no collective),
    which shard_map supports only when traced, inside ``jax.jit``: JAX's refusal under an eager
    shard_map (its arrays are tracers, so the op is called as it is) is named."""
    leaves = jax.tree_util.tree_leaves(args)
    if leaves and all(isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer) for leaf in leaves):
        op = _eager_op(op)
    try:
        return op(static, *args)
    except NotImplementedError as error:
        if "shard_map" not in str(error) or "symbolic_zeros" not in str(error):
            raise
        raise TypeError(f"{where}: shard_map outside jax.jit is not supported (JAX runs a custom_vjp with "
                        f"symbolic zeros in shard_map only when it is traced); put jax.jit around the shard_map"
                        ) from error


def _bind_or_refuse(refusal: ValueError | None, where: str, op, static, *args):
    """:func:`_bind`, or, where an eager check of the ids refused the call (``refusal``), that refusal,
    raised once the op ran: its callback refuses the same ids through its exchange, whose peers would
    otherwise wait for this rank there until the group's timeout, which then broke the group."""
    if refusal is None:
        return _bind(where, op, static, *args)
    try:
        jax.block_until_ready(_bind(where, op, static, *args))
    except (jax.errors.JaxRuntimeError, ValueError) as error:  # a cached program's callback error: a ValueError
        if str(refusal) not in str(error):  # another failure (a peer's call, the group's timeout): that one
            error.add_note(f"(this rank's own check had refused the call: {refusal})")
            raise
        raise refusal from None  # the op's own refusal, as XLA wraps it: the caller gets the eager check's
    raise RuntimeError(f"{where}: the op ran although this rank's check refused it ({refusal}); its results are "
                       f"lost and the call counted on every rank") from refusal


def _checked_options(where: str, timeout_us, command_buffer_compatible) -> int:
    """timeout_us (as an int) and command_buffer_compatible, checked every call, as every option of a
    static configuration must be: an equal value of another type (1 for True, 7.0 for 7) would find
    the program an eager call compiled for a valid one (:func:`_bind`) without these checks."""
    check_bool(where, "command_buffer_compatible", command_buffer_compatible)
    return check_timeout(where, timeout_us)


@functools.cache
def _eager_op(op):
    """``op`` jitted, its static configuration (argument 0) part of the cache key: see :func:`_bind`."""
    return jax.jit(op, static_argnums=0)


def _values(tree):
    """A pytree of ``symbolic_zeros`` primals (each leaf a ``CustomVJPPrimal``) with the plain values."""
    return jax.tree_util.tree_map(lambda primal: primal.value, tree,
                                  is_leaf=lambda leaf: hasattr(leaf, "perturbed") and hasattr(leaf, "value"))


def _check_grad_buffer(where: str, ranks: jax_args.Ranks, grad_buffer: BufferArg, handle: Handle,
                       grad_num_topk: int) -> jax_args.Ranks:
    """The Ranks of ``grad_buffer``: other Buffers of the same group, large enough for T * grad_num_topk
    tokens."""
    grad_ranks = jax_args.as_ranks(f"{where}: grad_buffer", grad_buffer)
    if ranks.placement != grad_ranks.placement:
        raise ValueError(f"{where}: grad_buffer must serve the devices buffer serves, each with the same rank (one "
                         f"Buffer for one Buffer, a mapping over the same devices for a mapping): buffer is "
                         f"{ranks.describe()}, grad_buffer {grad_ranks.describe()}")
    if ranks.single is not None and grad_ranks.single.rank != ranks.single.rank:
        # Each rank's gradient dispatch runs on grad_buffer as its rank: another rank's Buffer made every
        # collective complete, with the ranks' gradients swapped.
        raise ValueError(f"{where}: grad_buffer is rank {grad_ranks.single.rank} of its group, buffer rank "
                         f"{ranks.single.rank}: pass this rank's Buffer of the gradient's group")
    for buffer in grad_ranks.buffers:  # here, not in a backward pass long after this call
        buffer._check_alive(f"{where}: grad_buffer")
    config = handle.config
    needed = grad_buffer_size_hint(config.num_max_dispatch_tokens_per_rank, config.hidden, config.num_ranks,
                                   config.num_experts, grad_num_topk)
    if set(grad_ranks.buffers) & set(ranks.buffers) or grad_ranks.first.num_ranks != config.num_ranks:
        raise ValueError(f"{where}: grad_buffer must be other Buffers of the same group ({config.num_ranks} ranks), "
                         f"not the forward's")
    small = [b.num_ep_buffer_bytes for b in grad_ranks.buffers if b.num_ep_buffer_bytes < needed]
    if small:
        raise ValueError(f"{where}: grad_buffer has {small[0]} bytes, the gradient needs {needed} "
                         f"(grad_buffer_size_hint(T={config.num_max_dispatch_tokens_per_rank}, hidden={config.hidden}, "
                         f"num_ranks={config.num_ranks}, num_experts={config.num_experts}, "
                         f"num_topk={grad_num_topk}))")
    return grad_ranks


# Bytes of the grad_buffer of combine: a Buffer for T * num_topk tokens (the same in mooncake_ep.torch).
grad_buffer_size_hint = Buffer.get_grad_buffer_size_hint


# --- the split form -----------------------------------------------------------------------------------


def _no_gradient(name: str):
    """A custom_vjp whose forward refuses differentiation, naming the differentiable ops."""

    def decorate(fn):
        wrapped = jax.custom_vjp(fn, nondiff_argnums=(0,))

        def fwd(static, *args):
            raise TypeError(f"mooncake_ep.jax.{name} is not differentiable; for training use mooncake_ep.jax.dispatch "
                            f"and mooncake_ep.jax.combine (one rank per device, e.g. under shard_map)")

        def bwd(static, residuals, cotangents):  # pragma: no cover - fwd always raises
            raise AssertionError("unreachable")

        wrapped.defvjp(fwd, bwd)
        return wrapped
    return decorate


def dispatch_send(buffer: Buffer, x, topk_idx, active_ranks, num_max_dispatch_tokens_per_rank: int,
                  num_experts: int, *, timeout_us: int = _constants.TIMEOUT_FOREVER, use_fp8: bool = True,
                  round_scale: bool = False, use_ue8m0: bool = False, parity: int = 0,
                  command_buffer_compatible: bool = True) -> PendingDispatch:
    """The send half of one rank's dispatch: stage its tokens and signal the peers; never waits.

    Arguments as in :func:`dispatch` (``buffer`` is one rank's Buffer). Call it for every rank, then
    :func:`dispatch_recv` with all the results. Not differentiable.

    Returns:
        A :class:`PendingDispatch` (a pytree of this rank's arrays).
    """
    where = "mooncake_ep.jax.dispatch_send"
    _check_one_buffer(where, buffer)
    num_max_dispatch_tokens_per_rank, num_experts = _static_ints(where, num_max_dispatch_tokens_per_rank, num_experts)
    arrays = tuple(jax_args.as_jax(where, name, value) for name, value in
                   (("x", x), ("topk_idx", topk_idx), ("active_ranks", active_ranks)))
    # As the fused op's: one device's arrays, of a device the Buffer serves (XLA's own errors name args[i]).
    jax_args.check_devices(where, jax_args.Ranks(buffer), x=arrays[0], topk_idx=arrays[1], active_ranks=arrays[2])
    num_experts = check_experts(where, num_experts, buffer.num_ranks)
    jax_args.check_eager_expert_ids(where, arrays[1], num_experts, num_max_dispatch_tokens_per_rank)
    check_flags(where, use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=use_ue8m0)
    timeout_us = _checked_options(where, timeout_us, command_buffer_compatible)
    parity = jax_args.check_parity(where, parity)
    options = dict(timeout_us=timeout_us, use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=use_ue8m0,
                   parity=parity, command_buffer_compatible=command_buffer_compatible)
    static = (buffer, num_max_dispatch_tokens_per_rank, num_experts, tuple(sorted(options.items())))
    return _bind(where, _dispatch_send, static, *arrays)


@_no_gradient("dispatch_send")
def _dispatch_send(static, x, topk_idx, active_ranks):
    buffer, num_max_tokens, num_experts, options = static
    return jax_split.dispatch_send("mooncake_ep.jax.dispatch_send", buffer, x, topk_idx, active_ranks, num_max_tokens,
                                 num_experts, **dict(options))


def dispatch_recv(pending: Sequence[PendingDispatch]) -> list:
    """The receive halves of the dispatches sent with :func:`dispatch_send`.

    Args:
        pending: every rank's :class:`PendingDispatch` of this step, each rank once (on the CPU a rank
            missing here counts as one that never ran, and is masked).

    Returns:
        One ``(recv_x, recv_count, handle, active_ranks)`` per pending rank, in its order, as
        :func:`dispatch` returns.
    """
    where = "mooncake_ep.jax.dispatch_recv"
    return _bind(where, _dispatch_recv, None, jax_split.check_pending(where, pending, PendingDispatch, "dispatch_send"))


@_no_gradient("dispatch_recv")
def _dispatch_recv(static, pending):
    return jax_split.dispatch_recv("mooncake_ep.jax.dispatch_recv", pending)


def combine_send(buffer: Buffer, x, topk_idx, topk_weights, active_ranks, handle: Handle, *,
                 timeout_us: int = _constants.TIMEOUT_FOREVER, renormalize: bool = False,
                 command_buffer_compatible: bool = True) -> PendingCombine:
    """The send half of one rank's combine: publish its expert outputs; never waits.

    Arguments as in :func:`combine` (``handle`` from :func:`dispatch_recv`). Not differentiable.

    Returns:
        A :class:`PendingCombine`, for :func:`combine_recv`.
    """
    where = "mooncake_ep.jax.combine_send"
    _check_one_buffer(where, buffer)
    ranks = jax_args.Ranks(buffer)
    jax_ops.check_handle(where, handle, ranks)
    arrays = tuple(jax_args.as_jax(where, name, value) for name, value in
                   (("x", x), ("topk_idx", topk_idx), ("topk_weights", topk_weights), ("active_ranks", active_ranks)))
    jax_args.check_devices(where, ranks, x=arrays[0], topk_idx=arrays[1], topk_weights=arrays[2],
                           active_ranks=arrays[3])
    jax_args.check_eager_routing(where, arrays[1], handle.dispatched_topk_idx, handle.config.num_experts)
    check_flags(where, renormalize=renormalize)
    timeout_us = _checked_options(where, timeout_us, command_buffer_compatible)
    options = dict(timeout_us=timeout_us, renormalize=renormalize, command_buffer_compatible=command_buffer_compatible)
    return _bind(where, _combine_send, (buffer, tuple(sorted(options.items()))), *arrays, handle)


@_no_gradient("combine_send")
def _combine_send(static, x, topk_idx, topk_weights, active_ranks, handle):
    buffer, options = static
    return jax_split.combine_send("mooncake_ep.jax.combine_send", buffer, x, topk_idx, topk_weights, active_ranks,
                                handle, **dict(options))


def combine_recv(pending: Sequence[PendingCombine]) -> list:
    """The receive halves of the combines sent with :func:`combine_send`.

    Returns:
        One ``(combined_x, active_ranks)`` per pending rank, in its order.
    """
    where = "mooncake_ep.jax.combine_recv"
    return _bind(where, _combine_recv, None, jax_split.check_pending(where, pending, PendingCombine, "combine_send"))


@_no_gradient("combine_recv")
def _combine_recv(static, pending):
    return jax_split.combine_recv("mooncake_ep.jax.combine_recv", pending)


# --- building the Buffers -------------------------------------------------------------------------------


def make_buffers(devices: Sequence[Any], num_ep_buffer_bytes: int, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                 **options) -> dict:
    """One Buffer per JAX device, as ranks of one in-process group, rank ``i`` on ``devices[i]``.

    Args:
        devices: distinct JAX devices in rank order, ``mesh.devices.flat`` of the ``shard_map``'s
            mesh (or ``mesh.devices``, or the mesh itself, read in that flat order): the
            program's data (its experts) is sharded by mesh position, so the Buffer of the device at
            position ``i`` must be rank ``i``. The CPU path checks it in every dispatch; on GPUs a
            mismatch is not detected (reading the position there would cost a host sync per call).
            GPUs get the kernels (``backend="cuda"``); CPU devices the reference.
        num_ep_buffer_bytes: workspace bytes per rank (:meth:`Buffer.get_ep_buffer_size_hint`).
        timeout_s: seconds a rank's collective waits for the others (the :class:`LocalGroup`'s):
            on the CPU every call is one, so this bounds how long the other devices' ops wait when
            one device's op raised (then the group is broken, and every later call raises at once).
        **options: more keyword arguments of :class:`mooncake_ep.Buffer` (``num_sms``, ...).

    Returns:
        ``{device: Buffer}``, for the ``buffer`` argument of the ops. Destroy the Buffers with
        :func:`destroy_buffers`.
    """
    if isinstance(devices, jax.sharding.Mesh):  # its devices, as the docstring says to pass them
        devices = devices.devices
    # A mesh's device array (any number of axes) in its flat order, the order of mesh positions.
    if isinstance(devices, np.ndarray):
        devices = list(devices.flat)
    elif isinstance(devices, Iterable) and not isinstance(devices, (str, bytes, Set, Mapping)):  # in rank order
        devices = list(devices)
    else:  # a single Device, None, a set: list() would say only that it is not iterable, or guess an order
        raise TypeError(f"make_buffers: devices must be JAX devices in rank order (a sequence, a Mesh or its "
                        f"devices array), got {type(devices).__name__}")
    if not devices:
        raise ValueError("make_buffers: devices is empty; pass one JAX device per rank")
    for device in devices:
        if not isinstance(device, jax.Device):
            raise TypeError(f"make_buffers: devices must be JAX devices, got {type(device).__name__}")
    repeated = [d for d, n in collections.Counter(devices).items() if n > 1]
    if repeated:
        raise ValueError(f"make_buffers: devices must be distinct, one per rank; {repeated[0]} appears "
                         f"{devices.count(repeated[0])} times")
    platforms = {d.platform for d in devices}
    if len(platforms) != 1:
        raise ValueError(f"make_buffers: devices must share one platform, got {sorted(platforms)}")
    on_gpu = platforms != {"cpu"}
    group = LocalGroup(len(devices), devices=[d.local_hardware_id for d in devices] if on_gpu else None,
                       timeout_s=timeout_s)
    options.setdefault("backend", "cuda" if on_gpu else "reference")
    buffers = group.spawn(lambda g: Buffer(g, num_ep_buffer_bytes, **options))
    return dict(zip(devices, buffers))


def destroy_buffers(buffers: Mapping[Any, Buffer] | Sequence[Buffer] | Buffer) -> None:
    """Free Buffers the JAX ops have used, and clear JAX's compilation caches.

    The caches go too: a jitted program whose command buffer (CUDA graph) holds these Buffers'
    launches would otherwise replay them on the freed workspaces without calling back. Called again,
    such a program is traced anew, and its ops refuse the destroyed Buffers by name. An executable
    the caller compiled ahead of time and kept (``jit(...).lower(...).compile()``) is not reached by
    this: drop it before destroying the Buffers.

    Args:
        buffers: every Buffer of one in-process group, as the mapping :func:`make_buffers` returned
            or a sequence (the split form's list, from ``LocalGroup.spawn``): their destroy is a
            collective, run here on the group's threads. Or this process's one Buffer of a group of
            processes (``init_group``), where every process calls this with its own.
    """
    where = "destroy_buffers"
    if isinstance(buffers, Buffer):
        if getattr(buffers.group, "local_group", None) is not None:
            raise TypeError(f"{where}: this Buffer is one rank of an in-process group, whose destroy is a "
                            f"collective of its threads: pass every rank's Buffer (make_buffers' mapping, or a "
                            f"list)")
        buffers.destroy()  # collective: each process calls destroy_buffers with its own
        jax.clear_caches()
        return
    if isinstance(buffers, Mapping):
        values = list(buffers.values())
    elif isinstance(buffers, Sequence) and not isinstance(buffers, (str, bytes)):
        values = list(buffers)
    else:
        raise TypeError(f"{where}: buffers must be make_buffers' mapping, a sequence of Buffers or one Buffer, "
                        f"got {type(buffers).__name__}")
    if not values:
        raise ValueError(f"{where}: buffers is empty; pass the mapping returned by make_buffers")
    for buffer in values:
        if not isinstance(buffer, Buffer):
            raise TypeError(f"{where}: buffers must hold mooncake_ep Buffers, got {type(buffer).__name__}")
    by_rank = {b.rank: b for b in values}
    parent = getattr(values[0].group, "local_group", None)
    if parent is None or len(values) != parent.num_ranks or sorted(by_rank) != list(range(parent.num_ranks)) \
            or any(getattr(b.group, "local_group", None) is not parent for b in values):
        raise ValueError(f"{where}: buffers must be every rank's Buffer of one in-process group, each once "
                         f"(ranks {sorted(b.rank for b in values)} given); a process's own Buffer of a group "
                         f"of processes goes alone")
    parent.spawn(lambda g: by_rank[g.rank].destroy())
    jax.clear_caches()
