"""The split form of the JAX ops: every rank's send half, then every rank's receive half.

For several ranks on one device, where XLA runs all their work on one stream. A send
half never waits on a peer; each receive half takes every rank's send-half results as operands, so
XLA cannot schedule a receive before a send it would wait for. On the CPU the send half is nothing
at all: each receive half computes the numpy reference from every rank's inputs, which XLA hands
it as operands, so the ranks need no collective (and can run in one thread).

Every op here declares a side effect, which keeps the ops in program order on the device: the send
halves of all ranks, then all receive halves. The operands alone order every receive after the
sends it reads, but without the effect one H200 run of ``test_jax_split_form_on_one_gpu_equals_reference``
lost whole ranks to timeouts (a rerun in a fresh process passed; the cause is not pinned down).
The price, JAX's Python dispatch path on every call of the jitted function, is paid only by
programs that hold several ranks on one device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from mooncake_ep import reference
from mooncake_ep.buffer import Buffer
from mooncake_ep.frameworks.jax_args import Ranks, varying_like
from mooncake_ep.validation import check_expert_ids
from mooncake_ep.frameworks.jax_ops import (
    RECV,
    SEND,
    CombineConfig,
    DispatchConfig,
    Handle,
    PendingCombine,
    PendingDispatch,
    _call,
    _CombineCallback,
    _dispatch_metadata,
    _dispatch_results,
    _DispatchCallback,
    _executes,
    _next_dispatch_number,
    _read,
    _register_pytrees,
    _stream,
    _write,
    _write_dispatch,
    check_combine_values,
    combine_config,
    dispatch_config,
    read_outputs,
)

__all__ = ["dispatch_send", "dispatch_recv", "combine_send", "combine_recv"]


def dispatch_send(where: str, buffer: Buffer, x, topk_idx, active_ranks, num_max_dispatch_tokens_per_rank: int,
                  num_experts: int, **options) -> PendingDispatch:
    """The send half of one rank's dispatch (never waits on a peer). See :mod:`mooncake_ep.jax`."""
    _register_pytrees()
    config, _ = dispatch_config(where, Ranks(buffer), x, topk_idx, active_ranks, num_max_dispatch_tokens_per_rank,
                                num_experts, **options)
    if config.backend == "reference":
        # The CPU receive half computes from every rank's inputs, handed over by XLA: nothing to send.
        return PendingDispatch(config, (x, topk_idx, active_ranks))
    (sent,) = _call(where, config.ranks, _DispatchCallback(where, config, SEND),
                    [("active_ranks", active_ranks.shape, "int32")], [x, topk_idx, active_ranks], {2: 0},
                    config.command_buffer_compatible, has_side_effect=True)
    return PendingDispatch(config, (x, topk_idx, varying_like(sent, active_ranks)))


def dispatch_recv(where: str, pending: list[PendingDispatch]) -> list:
    """The receive halves of every given rank's dispatch: ``[(recv_x, recv_count, handle, active_ranks)]``.
    ``pending`` is :func:`check_pending`'s list, which the public op makes before tracing this."""
    _register_pytrees()
    operands = [a for p in pending for a in p.arrays]
    results = []
    for index, p in enumerate(pending):
        c = p.config
        _, specs = dispatch_config(where, c.ranks, *p.arrays, c.num_max_dispatch_tokens_per_rank, c.num_experts,
                                   timeout_us=c.timeout_us, **c.flags, parity=c.parity,
                                   command_buffer_compatible=c.command_buffer_compatible)
        out_specs = specs + [("active_ranks", (c.num_ranks,), "int32")] + c.metadata_specs()
        callback = _DispatchRecvCallback(where, c, index, tuple(q.config.ranks.single.rank for q in pending))
        outputs = _call(where, c.ranks, callback, out_specs, operands,
                        {3 * index + 2: len(specs)}, c.command_buffer_compatible, has_side_effect=True)
        results.append(_dispatch_results(c, specs, varying_like(outputs, *p.arrays), p.arrays[1]))
    return results


def check_pending(where: str, pending, kind: type, producer: str) -> list:
    """``pending`` (every rank's ``kind`` from ``producer``) as a list, checked: one step of one Buffer's
    ranks, each once, whose Buffers still exist, with their arrays on one device.

    Raises:
        TypeError: ``pending`` is not a non-empty sequence of ``kind``.
        ValueError: a rank twice, ranks of different Buffers or steps, or arrays on different devices.
        RuntimeError: a destroyed Buffer (:meth:`Buffer._check_alive`).
    """
    if isinstance(pending, (kind, str, bytes)) or not isinstance(pending, Sequence) or not pending:
        raise TypeError(f"{where}: pending must be a non-empty list of the {producer} results of the ranks, got "
                        f"{type(pending).__name__}")
    pending = list(pending)
    for p in pending:
        if not isinstance(p, kind):
            raise TypeError(f"{where}: pending must hold {producer} results, got {type(p).__name__}")
    # A combine's step is its dispatch's: the same configuration on every rank, one Buffer's group.
    dispatches = [p.config if isinstance(p, PendingDispatch) else p.config.dispatch for p in pending]
    ranks = [c.ranks.single.rank for c in dispatches]
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"{where}: pending holds rank(s) {sorted({r for r in ranks if ranks.count(r) > 1})} more "
                         f"than once")
    for c in dispatches:  # every call: an eager call's cached program does not trace (mooncake_ep.jax._bind)
        c.ranks.single._check_alive(where)
    base = dispatches[0]
    for c in dispatches[1:]:
        if c.ranks.single._token != base.ranks.single._token:
            raise ValueError(f"{where}: pending holds calls on different Buffers: rank {c.ranks.single.rank}'s is "
                             f"not on the Buffer rank {base.ranks.single.rank}'s is on (another Buffer, or another "
                             f"group's); every rank's call must be on its rank of one Buffer")
        if (c.num_max_dispatch_tokens_per_rank, c.hidden, c.num_experts, c.flags, c.parity) != \
                (base.num_max_dispatch_tokens_per_rank, base.hidden, base.num_experts, base.flags, base.parity):
            raise ValueError(f"{where}: every rank's {'dispatch' if kind is PendingDispatch else 'combine'} must "
                             f"answer the same step: the same T, hidden, num_experts, fp8 flags and parity; rank "
                             f"{c.ranks.single.rank} differs from rank {base.ranks.single.rank}")
    _check_one_device(where, pending, ranks)
    return pending


def _check_one_device(where: str, pending: list, ranks: list[int]) -> None:
    """Every rank's arrays are operands of each receive half, one XLA op: concrete arrays committed to
    different devices are refused here, naming the ranks (XLA's own error names args[i] of
    buffer_callback). Tracers are placed by XLA, which says it at run time."""
    import jax

    placed = {}  # rank -> the devices of its committed concrete arrays
    for p, rank in zip(pending, ranks):
        for array in p.arrays:
            if not isinstance(array, jax.core.Tracer) and getattr(array, "committed", False):
                placed.setdefault(rank, set()).update(array.devices())
    if len(set().union(*placed.values()) if placed else ()) > 1:
        where_placed = ", ".join(f"rank {rank}: {sorted(str(d) for d in devices)}" for rank, devices in placed.items())
        raise ValueError(f"{where}: the pending ranks' arrays are on different devices ({where_placed}); each "
                         f"receive half takes every rank's arrays as operands of one op, so they must be on one "
                         f"device (jax.device_put them there before the send halves)")


@dataclasses.dataclass(frozen=True)
class _DispatchRecvCallback:
    """The receive half of rank ``index`` among the pending dispatches of ``ranks``.

    Operands: (x, topk_idx, active_ranks) of every pending rank, in order. Results as
    :class:`_DispatchCallback`'s, the mask aliasing this rank's.
    """

    where: str
    config: DispatchConfig
    index: int
    ranks: tuple[int, ...]

    def __call__(self, ctx, outs, *operands) -> None:
        if not _executes(ctx):
            return
        c = self.config
        triples = [[_read(self.where, name, a) for name, a in zip(("x", "topk_idx", "active_ranks"),
                                                                  operands[3 * i:3 * i + 3])]
                   for i in range(len(self.ranks))]
        (x_view, device), (topk_view, _), _ = triples[self.index]
        num_recv = 3 if c.use_fp8 else 2
        out_views = read_outputs(self.where, outs)
        recv_views, active_view = out_views[:num_recv], out_views[num_recv]
        buffer = c.ranks.select(self.where, device)
        if x_view.device_type == "cuda":
            buffer._dispatch_launcher(x_view, topk_view, active_view, recv_views, parity=c.parity,
                                      num_max_dispatch_tokens_per_rank=c.num_max_dispatch_tokens_per_rank,
                                      num_experts=c.num_experts, timeout_us=c.timeout_us,
                                      **c.flags)(RECV, _stream(ctx))
            return
        # CPU: every pending rank's inputs are operands, so the reference needs no collective. A rank
        # of the group with no pending dispatch here never ran: it is masked, as on the GPU.
        xs, topks = [None] * c.num_ranks, [None] * c.num_ranks
        actives = [np.ones(c.num_ranks, np.int32)] * c.num_ranks
        for ((xi, _), (ti, _), (ai, _)), rank in zip(triples, self.ranks):
            buffer._check_dispatch(self.where, xi, ti, ai, c.num_max_dispatch_tokens_per_rank, c.num_experts,
                                   timeout_us=c.timeout_us, **c.flags)
            # No exchange here to carry a refusal: every rank's receive half reads every rank's ids.
            check_expert_ids(self.where, ti, c.num_experts, c.num_max_dispatch_tokens_per_rank)
            xs[rank], topks[rank], actives[rank] = xi.numpy(), ti.numpy(), ai.numpy()
        result = reference.dispatch(buffer.rank, xs, topks, actives, c.num_max_dispatch_tokens_per_rank,
                                    c.num_experts, **c.flags)
        _write_dispatch(result, recv_views, active_view, out_views[num_recv + 1:], c.use_fp8, topk_view,
                        _next_dispatch_number(buffer, c.parity))


def combine_send(where: str, buffer: Buffer, x, topk_idx, topk_weights, active_ranks, handle: Handle,
                 **options) -> PendingCombine:
    """The send half of one rank's combine. See :mod:`mooncake_ep.jax`."""
    _register_pytrees()
    ranks = Ranks(buffer)
    config, _ = combine_config(where, ranks, x, topk_idx, topk_weights, active_ranks, handle, **options)
    if config.dispatch.backend == "reference":
        return PendingCombine(config, (x, topk_idx, topk_weights, active_ranks, *handle.arrays))
    (sent,) = _call(where, ranks, _CombineCallback(where, config, SEND, direct_reads=False),
                    [("active_ranks", active_ranks.shape, "int32")],
                    [x, topk_idx, topk_weights, active_ranks, *handle.arrays], {3: 0},
                    config.command_buffer_compatible, has_side_effect=True)
    return PendingCombine(config, (x, topk_idx, topk_weights, varying_like(sent, active_ranks), *handle.arrays))


def combine_recv(where: str, pending: list[PendingCombine]) -> list:
    """The receive halves of every given rank's combine: ``[(combined_x, active_ranks)]``. ``pending``
    is :func:`check_pending`'s list, which the public op makes before tracing this."""
    _register_pytrees()
    sizes = [len(p.arrays) for p in pending]
    operands = [a for p in pending for a in p.arrays]
    results = []
    offset = 0
    for index, p in enumerate(pending):
        c = p.config
        callback = _CombineRecvCallback(where, c, index, tuple(sizes),
                                        tuple(q.config.dispatch.ranks.single.rank for q in pending))
        combined, active = _call(where, c.dispatch.ranks, callback,
                                 [("combined_x", (c.dispatch.num_tokens, c.dispatch.hidden), "bfloat16"),
                                  ("active_ranks", (c.dispatch.num_ranks,), "int32")],
                                 operands, {offset + 3: 1}, c.command_buffer_compatible, has_side_effect=True)
        offset += sizes[index]
        results.append(tuple(varying_like((combined, active), *p.arrays[:4])))
    return results


@dataclasses.dataclass(frozen=True)
class _CombineRecvCallback:
    """The receive half of rank ``index``'s combine; operands: every pending rank's arrays, in order."""

    where: str
    config: CombineConfig
    index: int
    sizes: tuple[int, ...]
    ranks: tuple[int, ...]

    def __call__(self, ctx, outs, *operands) -> None:
        if not _executes(ctx):
            return
        c, d = self.config, self.config.dispatch
        groups, offset = [], 0
        for size in self.sizes:
            groups.append(operands[offset:offset + size])
            offset += size
        x, topk_idx, topk_weights, active_ranks, *handle_arrays = groups[self.index]
        x_view, device = _read(self.where, "x", x)
        topk_view, _ = _read(self.where, "topk_idx", topk_idx)
        weights_view, _ = _read(self.where, "topk_weights", topk_weights)
        combined_view, active_view = read_outputs(self.where, outs)
        buffer = d.ranks.select(self.where, device)
        if x_view.device_type == "cuda":
            buffer._combine_launcher(x_view, topk_view, weights_view, active_view, combined_view, parity=d.parity,
                                     num_max_dispatch_tokens_per_rank=d.num_max_dispatch_tokens_per_rank,
                                     hidden=d.hidden, num_experts=d.num_experts, zero_copy=False,
                                     renormalize=c.renormalize, timeout_us=c.timeout_us,
                                     direct_reads=False)(RECV, _stream(ctx))
            return
        check_combine_values(self.where, buffer, d.parity, topk_view, handle_arrays, d.num_experts)
        outs_by_rank, results, actives = [None] * d.num_ranks, [None] * d.num_ranks, \
            [np.ones(d.num_ranks, np.int32)] * d.num_ranks
        for group, rank in zip(groups, self.ranks):
            xi, _, _, ai, *hi = group
            outs_by_rank[rank] = _read(self.where, "x", xi)[0].numpy()
            results[rank] = _dispatch_metadata(self.where, hi)
            actives[rank] = _read(self.where, "active_ranks", ai)[0].numpy()
        combined, mask = reference.combine(buffer.rank, outs_by_rank, results, topk_view.numpy(), weights_view.numpy(),
                                           actives, renormalize=c.renormalize)
        _write(combined_view, combined)
        _write(active_view, mask)
