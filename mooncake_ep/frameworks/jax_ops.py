"""JAX ops of dispatch and combine on ``jax.experimental.buffer_callback``; JAX is imported lazily.

This module builds the ops (the split form is in :mod:`mooncake_ep.frameworks.jax_split`);
:mod:`mooncake_ep.jax` is their public face (gradients included). Each op
is one ``buffer_callback`` whose result shapes are declared up front from the same checks
:meth:`mooncake_ep.Buffer.dispatch` runs, so a bad argument fails at trace time with the eager
message. The callback gets XLA's stream and buffers and either launches the kernels
(``Buffer._dispatch_launcher``) or, for host buffers, runs the numpy reference.

Example::

    recv_x, recv_count, handle, active = dispatch(buffer, x, topk_idx, active, T, E, parity=0, ...)

Per-call state and command buffers:
    With ``command_buffer_compatible=True`` XLA may record the launches into a CUDA graph and run the
    Python callback only when it records (again whenever its buffers' addresses change, per device,
    at times no rank can predict). So nothing per call may come from the host: the kernels keep
    their epochs in device memory, the layout of a configuration is uploaded at trace time
    (``Buffer._prepare``), and the workspace half (``parity``) is a static attribute of the op fixed
    at trace time, never the buffer's host counter, which would advance on one rank's re-recording
    and not on another's, leaving them waiting on different halves. One parity for every call is
    correct while each dispatch is followed by its combine before the next dispatch on the same
    buffer; two dispatches whose handles are alive at once need different parities.

Ordering:
    XLA orders ops by data only. A combine takes its dispatch's ``recv_count``; each receive half of
    the split form takes every rank's send-half outputs; ``after=`` adds operands an op must wait
    for (the gradients use it). The ops of one rank per device declare no side effect: a jitted
    function holding an effect loses JAX's C++ dispatch path and pays the Python one on every call
    (~170 µs on the H200's host, 7x the GPU time of a decode step). So XLA may drop an op whose
    results nothing reads, and merge two ops of one configuration and the same operands, which only
    a program that does not pass ``active_ranks`` on from step to step can hold. One exception: the
    ops of a rank with no tokens this step (``x`` of shape ``[0, hidden]``) keep the effect, since
    XLA replaces a result of no elements by a constant, so the combine (whose ``combined_x`` is
    empty), and with it the dispatch that feeds it, would vanish from that rank's program alone
    while its peers wait for it. The split form keeps the effect (see
    :mod:`mooncake_ep.frameworks.jax_split`).
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from collections.abc import Sequence

import numpy as np

from mooncake_ep import reference
from mooncake_ep._reference_backend import MESH_POSITION, refusal_of
from mooncake_ep.frameworks.jax_args import (DLPACK_CUDA, Ranks, abstract_view, check_parity, dlpack_device,
                                              manual_axes, rank_results, varying_like)
from mooncake_ep.tensor import ArrayView, dense_device_view, numpy_dtype, read_array
from mooncake_ep.validation import check_bool, check_expert_ids, check_flags, check_same_routing, type_name

__all__ = ["Handle", "PendingDispatch", "PendingCombine", "DispatchConfig", "CombineConfig", "dispatch", "combine",
           "dispatch_config", "combine_config", "check_handle"]

# Kernel phase bits (kPhaseSend / kPhaseRecv in kernels_cu/).
SEND, RECV = 1, 2
# Handle metadata the CPU path carries between its ops (reference.DispatchResult's routing fields),
# then the dispatch's own topk_idx (int32), against which combine checks its ids.
_METADATA = ("recv_src_rank", "recv_src_token", "recv_src_topk", "layout_range")


# --- configurations (static: part of the traced program) --------------------------------------------


@dataclasses.dataclass(frozen=True)
class DispatchConfig:
    """Everything static about one dispatch (and so about the combine answering it).

    Attributes:
        ranks: the Buffer(s).
        num_tokens, hidden, num_topk: x's and topk_idx's shapes.
        num_experts, num_max_dispatch_tokens_per_rank: E and T.
        use_fp8, round_scale, use_ue8m0: the format.
        timeout_us: microseconds a receive waits for a peer; -1 forever.
        parity: the workspace half, fixed at trace time (see the module docstring).
        command_buffer_compatible: passed to ``buffer_callback``.
    """

    ranks: Ranks
    num_tokens: int
    hidden: int
    num_topk: int
    num_experts: int
    num_max_dispatch_tokens_per_rank: int
    use_fp8: bool
    round_scale: bool
    use_ue8m0: bool
    timeout_us: int
    parity: int
    command_buffer_compatible: bool

    @property
    def backend(self) -> str:
        return self.ranks.backend

    @property
    def num_ranks(self) -> int:
        return self.ranks.first.num_ranks

    @property
    def device_id(self) -> int:
        """-1: the device is XLA's, unknown at trace time (the callback checks it), as for the views."""
        return -1

    @property
    def flags(self) -> dict:
        return dict(use_fp8=self.use_fp8, round_scale=self.round_scale, use_ue8m0=self.use_ue8m0)

    def metadata_specs(self) -> list[tuple[str, tuple[int, ...], str]]:
        """The CPU path's routing outputs: where each received row came from."""
        if self.backend != "reference":
            return []
        num_local_experts = self.num_experts // self.num_ranks
        rows = (num_local_experts, self.num_ranks * self.num_max_dispatch_tokens_per_rank)
        return [(name, rows, "int32") for name in _METADATA[:3]] + \
            [("layout_range", (num_local_experts, self.num_ranks, 2), "int32"),
             ("dispatch_number", (1,), "int32"),
             ("dispatched_topk_idx", (self.num_tokens, self.num_topk), "int32")]


@dataclasses.dataclass(frozen=True)
class CombineConfig:
    """Everything static about one combine: its dispatch's configuration and its own options."""

    dispatch: DispatchConfig
    timeout_us: int
    renormalize: bool
    command_buffer_compatible: bool


def _register(cls, flatten=lambda h: (h.arrays, h.config), unflatten=None):
    import jax

    jax.tree_util.register_pytree_node(cls, flatten, unflatten or (lambda c, a: cls(c, tuple(a))))
    return cls


class Handle:
    """What a JAX combine needs from its dispatch: a pytree (static configuration, device arrays).

    Attributes:
        config: the :class:`DispatchConfig` (static, compared by value under ``jax.jit``).
        recv_count: ``[num_local_experts]`` int32, the dispatch's received rows per local expert.
        dispatched_topk_idx: ``[num_tokens, num_topk]``, the ids the dispatch was given (combine's
            gradient routes by them).
        arrays: ``(recv_count, topk_idx)`` on the GPU, where the routing stays in the workspace
            (topk_idx: the dispatch's operand, as given); on the CPU recv_count, then recv_src_rank,
            recv_src_token, recv_src_topk ``[num_local_experts, num_ranks * T]`` int32, layout_range
            ``[num_local_experts, num_ranks, 2]`` int32, the dispatch's number at its parity ``[1]``
            int32 (:func:`check_current`) and the ids as int32.
        sources: ``[num_ranks]`` int32, the dispatch's mask after it (the ranks whose rows it took),
            which combine's gradient checks its own against; not an operand of the combine ops. None
            in handles made otherwise.

    Note:
        The fields ``num_tokens``, ``hidden``, ... of the configuration are readable on the handle,
        as on :class:`mooncake_ep.Handle`.
    """

    def __init__(self, config: DispatchConfig, arrays: tuple, sources=None):
        self.config = config
        self.arrays = tuple(arrays)
        self.sources = sources

    @property
    def recv_count(self):
        return self.arrays[0]

    @property
    def dispatched_topk_idx(self):
        return self.arrays[-1]

    def __getattr__(self, name: str):
        if name in ("num_tokens", "hidden", "num_topk", "num_experts", "num_max_dispatch_tokens_per_rank",
                    "parity"):
            return getattr(self.config, name)
        raise AttributeError(name)

    def __repr__(self) -> str:
        c = self.config
        return (f"mooncake_ep.jax.Handle(num_tokens={c.num_tokens}, hidden={c.hidden}, num_topk={c.num_topk}, "
                f"num_experts={c.num_experts}, T={c.num_max_dispatch_tokens_per_rank}, parity={c.parity})")


class PendingDispatch:
    """A dispatch whose send half is issued: give it, with every rank's, to :func:`dispatch_recv`.

    A pytree: ``config`` static; ``arrays`` = (x, topk_idx, active_ranks after the send half).
    """

    def __init__(self, config: DispatchConfig, arrays: tuple):
        self.config = config
        self.arrays = tuple(arrays)


class PendingCombine:
    """A combine whose send half is issued: give it, with every rank's, to :func:`combine_recv`.

    A pytree: ``config`` static; ``arrays`` = (x, topk_idx, topk_weights, active_ranks after the send
    half, handle arrays).
    """

    def __init__(self, config: CombineConfig, arrays: tuple):
        self.config = config
        self.arrays = tuple(arrays)


_registered = False
_register_lock = threading.Lock()  # rank threads make their first calls at once; JAX refuses a second registration


def _register_pytrees() -> None:
    global _registered
    if _registered:
        return
    with _register_lock:
        if not _registered:
            for cls in (PendingDispatch, PendingCombine):
                _register(cls)
            _register(Handle, lambda h: ((h.arrays, h.sources), h.config),
                      lambda c, children: Handle(c, tuple(children[0]), children[1]))
            _registered = True


def _shapes(specs) -> list:
    import jax

    return [jax.ShapeDtypeStruct(tuple(shape), numpy_dtype(dtype)) for _, shape, dtype in specs]


def _call(where: str, ranks: Ranks, callback, specs, operands: Sequence, aliases: dict[int, int],
          command_buffer_compatible: bool, has_side_effect: bool = False):
    """One ``buffer_callback`` launch of ``callback`` with result ``specs``; vmap refused by name, and
    the program's devices checked against ``ranks`` when it is lowered (:func:`_placement_primitive`)."""
    from jax.custom_batching import custom_vmap
    from jax.experimental.buffer_callback import buffer_callback

    op = buffer_callback(callback, _shapes(specs), has_side_effect=has_side_effect, input_output_aliases=aliases,
                         command_buffer_compatible=command_buffer_compatible)

    @custom_vmap
    def run(first, *rest):
        first = _placement_primitive().bind(first, where=where, ranks=ranks)
        return tuple(op(first, *rest))

    @run.def_vmap
    def _refuse_vmap(axis_size, in_batched, *args):
        raise TypeError(f"{where}: jax.vmap is not supported (each call is one collective step of every rank), "
                        f"nor what maps with it (jax.jacrev, jax.hessian); map the ranks with shard_map, one device "
                        f"per rank, or use the split form (dispatch_send / dispatch_recv) for several ranks on one "
                        f"device")
    return list(run(*operands))


def _placement_primitive():
    """An identity on an op's first operand whose lowering checks the devices the program runs on.

    Refusals that depend only on where the program runs belong before it runs: a callback that raises
    on one device while the others' ops wait for it in the exchange holds them there until the group's
    timeout, and breaks the group. The tracers do not say where the program runs; the lowering does:

    - Outside ``shard_map``, under ``jax.jit`` with shardings (``in_shardings=``, or arrays sharded
      inside the function), the trace-time check (``jax_args.check_devices``) passes, and XLA would
      run the op on every device with the whole arrays, each device's rank sending every token: wrong
      results, silently. The lowering knows how many devices (``ShardingContext.num_devices``).
    - Inside ``shard_map`` the lowering has the mesh (``SPMDAxisContext.mesh``), whose devices of this
      process must each have a Buffer that runs there (:meth:`jax_args.Ranks.select`); the trace-time
      check counts them only.

    Lowered to nothing."""
    global _PLACEMENT
    if _PLACEMENT is None:
        from jax.extend.core import Primitive
        from jax.interpreters import mlir

        primitive = Primitive("mooncake_ep_placement")
        primitive.def_impl(lambda operand, **params: operand)
        primitive.def_abstract_eval(lambda operand, **params: operand)
        mlir.register_lowering(primitive, _lower_placement)
        _PLACEMENT = primitive
    return _PLACEMENT


_PLACEMENT = None  # made at first use: JAX is imported lazily


def _lower_placement(ctx, operand, *, where: str, ranks: Ranks):
    context = ctx.module_context.axis_context
    num_devices = getattr(context, "num_devices", None)
    if num_devices is not None and num_devices > 1:
        raise ValueError(f"{where}: the jitted program runs on {num_devices} devices outside shard_map (its shardings "
                         f"spread the arrays), and XLA would run this op on every one of them with the whole arrays, "
                         f"each device's rank sending every token; run it inside jax.shard_map with one device per "
                         f"rank (the mapping of make_buffers), or jit it for one device")
    for device in _local_mesh_devices(context):
        ranks.select(f"{where}: in the shard_map's mesh", dlpack_device(device))
    return [operand]


def _local_mesh_devices(context) -> list:
    """This process's devices of a ``shard_map``'s concrete mesh; none outside one, or for an abstract
    mesh (``shard_map(mesh=mesh.abstract_mesh)``, lowered without devices: the callback's check stays).
    Only this process's: a process whose program is refused here never runs, while another process's
    lowers and waits for it in the exchange until the group's timeout."""
    import jax
    from jax.sharding import AbstractMesh

    mesh = getattr(context, "mesh", None)  # a ShardingContext has none
    if mesh is None or isinstance(mesh, AbstractMesh):  # whose .devices raises ValueError
        return []
    return [device for device in mesh.devices.flat if device.process_index == jax.process_index()]


def _stream(ctx) -> int:
    stream = ctx.stream
    return int(stream() if callable(stream) else stream)  # a method in JAX releases before 0.7


def _executes(ctx) -> bool:
    """Whether XLA asks for the work now (a handler may also be called to prepare or initialise)."""
    stage = getattr(ctx, "stage", None)
    stage = stage() if callable(stage) else stage
    return stage is None or getattr(stage, "name", "EXECUTE") == "EXECUTE"


@dataclasses.dataclass(frozen=True)
class _NoArray:
    """A result a half does not write (the kernels' send halves never touch it): a null pointer, and
    no elements, so no strides (the launch reads recv_scales' layout, Buffer._dispatch_launcher)."""

    ptr: int = 0
    shape: tuple[int, ...] = (0, 0, 0)
    strides: tuple[int, ...] = (0, 0, 0)


_NO_ARRAY = _NoArray()


def _read(where: str, name: str, buffer) -> tuple[ArrayView, tuple[int, int]]:
    """An XLA buffer of a callback as an ArrayView, and its DLPack device (which, unlike the view, tells
    CPU devices apart).

    A GPU buffer is read from its own attributes: XLA's buffers are dense and row-major, and going
    through DLPack cost ~10 us a buffer, most of a callback's host time (8 buffers a dispatch). Not
    an fp8 one: jaxlib's ``__cuda_array_interface__`` has no type string for it and raises
    (helper-103). Those, and the CPU's, go through DLPack (on the CPU the reference's work dwarfs it).
    """
    device = tuple(buffer.__dlpack_device__())
    if device[0] != DLPACK_CUDA or buffer.dtype == _FP8:
        return read_array(buffer, name=f"{where}: {name}"), device
    interface = buffer.__cuda_array_interface__  # its "data" is (address, read-only)
    return dense_device_view(buffer, interface["data"][0], buffer.shape, buffer.dtype, device[1],
                             name=f"{where}: {name}", framework="jax", readonly=not buffer.writeable), device


_FP8 = numpy_dtype("float8_e4m3fn")


def read_outputs(where: str, buffers) -> list[ArrayView]:
    """A callback's result buffers as ArrayViews (see :func:`_read`)."""
    return [_read(where, "output", buffer)[0] for buffer in buffers]


def _write(view: ArrayView, value: np.ndarray) -> None:
    view.numpy()[...] = value


# --- dispatch ---------------------------------------------------------------------------------------


def dispatch_config(where: str, ranks: Ranks, x, topk_idx, active_ranks, num_max_dispatch_tokens_per_rank: int,
                    num_experts: int, *, timeout_us: int, use_fp8: bool, round_scale: bool, use_ue8m0: bool,
                    parity: int, command_buffer_compatible: bool) -> tuple[DispatchConfig, list]:
    """Checks a dispatch at trace time; returns its configuration and result specs.

    Also puts the configuration's layout on every Buffer's device, outside any recording.
    """
    parity = check_parity(where, parity)
    check_bool(where, "command_buffer_compatible", command_buffer_compatible)
    specs = None
    for buffer in ranks.buffers:
        specs = buffer._check_dispatch(where, abstract_view(x), abstract_view(topk_idx), abstract_view(active_ranks),
                                       num_max_dispatch_tokens_per_rank, num_experts, timeout_us=timeout_us,
                                       use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=use_ue8m0).specs
    specs = list(specs)
    config = DispatchConfig(ranks, int(x.shape[0]), int(x.shape[1]), int(topk_idx.shape[1]), int(num_experts),
                            int(num_max_dispatch_tokens_per_rank), use_fp8, round_scale, use_ue8m0,
                            int(timeout_us), parity, command_buffer_compatible)
    for buffer in ranks.buffers:
        buffer._prepare(config.num_max_dispatch_tokens_per_rank, config.hidden, config.num_experts, **config.flags,
                        where=where)
    return config, specs


def _check_one_rank_per_stream(where: str, ranks: Ranks) -> None:
    for buffer in ranks.buffers:
        if buffer.backend == "cuda" and buffer._in_process_ranks_on_device > 1:
            raise ValueError(
                f"{where}: {buffer._in_process_ranks_on_device} ranks of this Buffer's group share cuda:{buffer.device_id}, and "
                f"XLA runs a device's work on one stream, where a rank's receive half would wait for a send queued "
                f"behind it; use the split form: dispatch_send / combine_send for every rank, then dispatch_recv / "
                f"combine_recv")


def dispatch(where: str, ranks: Ranks, x, topk_idx, active_ranks, num_max_dispatch_tokens_per_rank: int,
             num_experts: int, *, timeout_us: int, use_fp8: bool, round_scale: bool, use_ue8m0: bool, parity: int,
             command_buffer_compatible: bool, after: Sequence = ()):
    """Both halves of a dispatch in one op. See :func:`mooncake_ep.jax.dispatch` for the arguments.

    Returns:
        ``(recv_x, recv_count, handle, active_ranks)``; recv_x is a pair ``(x_fp8, scales)`` with fp8.
    """
    _register_pytrees()
    _check_one_rank_per_stream(where, ranks)
    config, specs = dispatch_config(where, ranks, x, topk_idx, active_ranks, num_max_dispatch_tokens_per_rank,
                                    num_experts, timeout_us=timeout_us, use_fp8=use_fp8, round_scale=round_scale,
                                    use_ue8m0=use_ue8m0, parity=parity,
                                    command_buffer_compatible=command_buffer_compatible)
    out_specs = specs + [("active_ranks", active_ranks.shape, "int32")] + config.metadata_specs()
    position = _mesh_position(ranks)
    outputs = _call(where, ranks, _DispatchCallback(where, config, SEND | RECV, position is not None), out_specs,
                    [x, topk_idx, active_ranks, *after, *([] if position is None else [position])], {2: len(specs)},
                    config.command_buffer_compatible, has_side_effect=config.num_tokens == 0)
    outputs = rank_results(outputs)
    return _dispatch_results(config, specs, outputs, topk_idx)


def _mesh_position(ranks: Ranks):
    """Inside a ``shard_map`` over one axis of the group's size: this device's index on it, else None.

    That index is the rank the program's data layout assumes (experts sharded over the axis); the
    device's Buffer must have it. Over several axes the layout is the caller's to choose (experts
    sharded over ``("ep", "dp")`` or ``("dp", "ep")``), so nothing is checked. Only the CPU path
    checks it: there the callback reads it from host memory, where on a GPU it would take a
    device-to-host copy (and a host synchronisation) per call.
    """
    import jax

    axes = manual_axes()
    if ranks.single is not None or ranks.backend != "reference" or len(axes) != 1:
        return None
    size = dict(jax.sharding.get_abstract_mesh().shape)[axes[0]]
    if not size == len(ranks.by_device) == ranks.first.num_ranks:
        return None  # a mapping of some of the group's ranks, or an axis of another size: the caller's layout
    return jax.lax.axis_index(axes[0]).reshape(1)


def _dispatch_results(config: DispatchConfig, specs, outputs, topk_idx):
    num_recv = len(specs) - 1
    recv = tuple(outputs[:num_recv])
    recv_count, active = outputs[num_recv], outputs[num_recv + 1]
    # The CPU path's metadata ends with a copy of the ids; on the GPU the operand itself is kept.
    kept_ids = [topk_idx] if config.backend != "reference" else []
    handle = Handle(config, (recv_count, *outputs[num_recv + 2:], *kept_ids), sources=active)
    return (recv if config.use_fp8 else recv[0]), recv_count, handle, active


@dataclasses.dataclass(frozen=True)
class _DispatchCallback:
    """The host side of a dispatch op (compared by value, so an eager call hits JAX's compile cache).

    Operands: x, topk_idx, active_ranks, then ``after`` operands (ignored), then with
    ``checks_position`` the device's mesh position (:func:`_mesh_position`). Results: recv_x,
    [recv_scales,] recv_count, active_ranks (aliasing the operand), [CPU routing metadata].
    """

    where: str
    config: DispatchConfig
    phases: int
    checks_position: bool = False

    def __call__(self, ctx, outs, x, topk_idx, active_ranks, *after) -> None:
        if not _executes(ctx):
            return
        c = self.config
        x_view, device = _read(self.where, "x", x)
        topk_view, _ = _read(self.where, "topk_idx", topk_idx)
        num_recv = 3 if c.use_fp8 else 2
        out_views = read_outputs(self.where, outs)
        if self.phases == SEND:  # the send half's only result is the mask; it writes no received rows
            out_views = [_NO_ARRAY] * num_recv + out_views
        recv_views, active_view = out_views[:num_recv], out_views[num_recv]
        buffer = c.ranks.select(self.where, device)
        if x_view.device_type == "cuda":
            launch = buffer._dispatch_launcher(x_view, topk_view, active_view, recv_views, parity=c.parity,
                                               num_max_dispatch_tokens_per_rank=c.num_max_dispatch_tokens_per_rank,
                                               num_experts=c.num_experts, timeout_us=c.timeout_us, **c.flags)
            # Both halves in one launch when both are asked, as Buffer's synchronous calls do.
            launch(self.phases, _stream(ctx))
            return
        buffer._check_dispatch(self.where, x_view, topk_view, active_view, c.num_max_dispatch_tokens_per_rank,
                               c.num_experts, timeout_us=c.timeout_us, **c.flags)
        # The ids' values go to the exchange as this rank's verdict: raised here, they left the other
        # devices' ops waiting in it until the group's timeout, which broke the group.
        refusal = refusal_of(check_expert_ids, self.where, topk_view, c.num_experts,
                             c.num_max_dispatch_tokens_per_rank)
        # One collective of the group (the send half), then this rank's reference computation. The mesh
        # position goes with it, so that a mesh in another order fails on every rank at once.
        position = (((MESH_POSITION, int(_read(self.where, "mesh position", after[-1])[0].numpy()[0])),)
                    if self.checks_position else ())
        call = (("call", "dispatch (JAX)"), ("Buffer", buffer._token), ("parity", c.parity),
                ("num_max_dispatch_tokens_per_rank", c.num_max_dispatch_tokens_per_rank), ("hidden", c.hidden),
                ("num_experts", c.num_experts), *c.flags.items(), *position)
        gathered = buffer._reference.exchange(self.where, call, x_view.numpy().copy(), topk_view.numpy().copy(),
                                              active_view.numpy().copy(), refusal=refusal)
        result = buffer._reference.dispatch(gathered, c.num_max_dispatch_tokens_per_rank, c.num_experts, **c.flags)
        _write_dispatch(result, recv_views, active_view, out_views[num_recv + 1:], c.use_fp8, topk_view,
                        _next_dispatch_number(buffer, c.parity))


def _write_dispatch(result: reference.DispatchResult, recv_views, active_view, metadata_views, use_fp8,
                    topk_view, dispatch_number: int) -> None:
    values = [result.recv_x] + ([result.recv_scales] if use_fp8 else []) + [result.recv_count]
    for view, value in zip(recv_views, values):
        _write(view, value)
    _write(active_view, result.active_ranks)
    for view, name in zip(metadata_views, _METADATA):
        _write(view, getattr(result, name))
    _write(metadata_views[len(_METADATA)], np.array([dispatch_number], np.int32))
    _write(metadata_views[len(_METADATA) + 1], topk_view.numpy().astype(np.int32))


# The CPU path's dispatches per (Buffer, parity), numbered as they run. A GPU combine reads the
# routing of its parity's last dispatch from the workspace, so it would combine a handle that a later
# dispatch at the same parity overwrote on that dispatch's routing, without a word; the CPU callbacks
# run on every call (no command buffer replays them unseen), so they can refuse it (check_current).
_dispatch_numbers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_dispatch_numbers_lock = threading.Lock()


def _next_dispatch_number(buffer, parity: int) -> int:
    """Counts a CPU dispatch of ``buffer`` at ``parity``; returns its number there (from 1, wrapping
    within int32)."""
    with _dispatch_numbers_lock:
        numbers = _dispatch_numbers.setdefault(buffer, [0] * 2)
        numbers[parity] = numbers[parity] % np.iinfo(np.int32).max + 1
        return numbers[parity]


def check_current(where: str, buffer, parity: int, handle_arrays) -> None:
    """CPU: the handle is of the last dispatch of ``buffer`` at ``parity`` (see _dispatch_numbers)."""
    number = int(_read(where, "handle", handle_arrays[1 + len(_METADATA)])[0].numpy()[0])
    with _dispatch_numbers_lock:
        current = _dispatch_numbers.get(buffer, [0] * 2)[parity]
    if number != current:
        raise ValueError(f"{where}: handle is stale: it is dispatch #{number} at parity {parity} of this Buffer, and "
                         f"dispatch #{current} at that parity has overwritten its routing since (on a GPU this "
                         f"combine would read that dispatch's); give dispatches whose handles are alive at once "
                         f"different parities (mooncake_ep.jax's note on parity)")


# --- combine ----------------------------------------------------------------------------------------


def check_handle(where: str, handle, ranks: Ranks) -> None:
    """Raises unless ``handle`` is a JAX dispatch handle made on ``ranks``."""
    if not isinstance(handle, Handle):
        advice = (" (a Buffer.dispatch's: combine it with Buffer.combine)"
                  if type(handle).__module__ == "mooncake_ep.buffer" else "")
        raise TypeError(f"{where}: handle must be the mooncake_ep.jax.Handle of a dispatch, got "
                        f"{type_name(handle)}{advice}")
    if handle.config.ranks != ranks:
        raise ValueError(f"{where}: handle was made by a dispatch on another Buffer")


def combine_config(where: str, ranks: Ranks, x, topk_idx, topk_weights, active_ranks, handle: Handle, *,
                   timeout_us: int, renormalize: bool, command_buffer_compatible: bool) -> tuple[CombineConfig, list]:
    """Checks a combine against its dispatch's handle at trace time; returns its configuration and specs."""
    check_handle(where, handle, ranks)
    check_flags(where, renormalize=renormalize)
    check_bool(where, "command_buffer_compatible", command_buffer_compatible)
    specs = None
    for buffer in ranks.buffers:
        specs = list(buffer._check_combine(where, handle.config, abstract_view(x), abstract_view(topk_idx),
                                           abstract_view(topk_weights), abstract_view(active_ranks),
                                           timeout_us=timeout_us).specs)
    return CombineConfig(handle.config, int(timeout_us), renormalize, command_buffer_compatible), specs


def combine(where: str, ranks: Ranks, x, topk_idx, topk_weights, active_ranks, handle: Handle, *, timeout_us: int,
            renormalize: bool, command_buffer_compatible: bool, after: Sequence = (), through: Sequence = ()):
    """Both halves of a combine in one op: ``(combined_x, active_ranks, *through)``.

    See :func:`mooncake_ep.jax.combine`. ``through`` arrays come back unchanged (aliased, no copy
    when nothing else reads them), so what is computed from them is ordered after this combine.
    """
    _register_pytrees()
    _check_one_rank_per_stream(where, ranks)
    config, specs = combine_config(where, ranks, x, topk_idx, topk_weights, active_ranks, handle,
                                   timeout_us=timeout_us, renormalize=renormalize,
                                   command_buffer_compatible=command_buffer_compatible)
    out_specs = specs + [("active_ranks", active_ranks.shape, "int32")]
    out_specs += [(f"through{i}", a.shape, np.dtype(a.dtype).name) for i, a in enumerate(through)]
    operands = [x, topk_idx, topk_weights, active_ranks, *handle.arrays, *after, *through]
    aliases = {3: 1} | {len(operands) - len(through) + i: 2 + i for i in range(len(through))}
    combined, active, *passed = _call(where, ranks, _CombineCallback(where, config, SEND | RECV), out_specs, operands,
                                      aliases, config.command_buffer_compatible,
                                      has_side_effect=config.dispatch.num_tokens == 0)
    return (*rank_results((combined, active)),
            *(varying_like(out, source) for out, source in zip(passed, through)))


@dataclasses.dataclass(frozen=True)
class _CombineCallback:
    """The host side of a combine op.

    Operands: x, topk_idx, topk_weights, active_ranks, the handle's arrays, then ``after`` and
    ``through`` operands (ignored). Results: combined_x, active_ranks (aliasing the operand), then the
    ``through`` arrays (aliased, untouched).
    """

    where: str
    config: CombineConfig
    phases: int
    # False in the split form: its receive halves queue on one stream, where the wait of direct
    # reads (every owner must have read before a receive half ends) would never end.
    direct_reads: bool = True

    def __call__(self, ctx, outs, x, topk_idx, topk_weights, active_ranks, *handle_arrays) -> None:
        if not _executes(ctx):
            return
        c, d = self.config, self.config.dispatch
        x_view, device = _read(self.where, "x", x)
        topk_view, _ = _read(self.where, "topk_idx", topk_idx)
        weights_view, _ = _read(self.where, "topk_weights", topk_weights)
        out_views = read_outputs(self.where, outs[:2])
        if self.phases == SEND:  # the send half's only result is the mask; it writes no combined rows
            out_views = [_NO_ARRAY] + out_views
        combined_view, active_view = out_views[:2]
        buffer = d.ranks.select(self.where, device)
        if x_view.device_type == "cuda":
            launch = buffer._combine_launcher(x_view, topk_view, weights_view, active_view, combined_view,
                                              parity=d.parity,
                                              num_max_dispatch_tokens_per_rank=d.num_max_dispatch_tokens_per_rank,
                                              hidden=d.hidden, num_experts=d.num_experts, zero_copy=False,
                                              renormalize=c.renormalize, timeout_us=c.timeout_us,
                                              direct_reads=self.direct_reads)
            # Both halves in one launch when both are asked, as Buffer's synchronous calls do.
            launch(self.phases, _stream(ctx))
            return
        # The handle's and the ids' values go to the exchange as this rank's verdict (as dispatch's ids).
        refusal = refusal_of(check_combine_values, self.where, buffer, d.parity, topk_view, handle_arrays,
                             d.num_experts)
        metadata = _dispatch_metadata(self.where, handle_arrays)
        call = (("call", "combine (JAX)"), ("Buffer", buffer._token), ("parity", d.parity),
                ("num_max_dispatch_tokens_per_rank", d.num_max_dispatch_tokens_per_rank), ("hidden", d.hidden),
                ("num_experts", d.num_experts))
        gathered = buffer._reference.exchange(self.where, call, x_view.numpy().copy(), metadata,
                                              active_view.numpy().copy(), refusal=refusal)
        combined, mask = buffer._reference.combine(gathered, topk_view.numpy().copy(), weights_view.numpy().copy(),
                                                   renormalize=c.renormalize)
        _write(combined_view, combined)
        _write(active_view, mask)


def check_combine_values(where: str, buffer, parity: int, topk_view, handle_arrays, num_experts: int) -> None:
    """CPU: the checks of a combine's array values: its handle is current (:func:`check_current`), its
    topk_idx names the experts of that dispatch (:func:`check_dispatched_ids`)."""
    check_current(where, buffer, parity, handle_arrays)
    check_dispatched_ids(where, topk_view, handle_arrays, num_experts)


def check_dispatched_ids(where: str, topk_view, handle_arrays, num_experts: int) -> None:
    """CPU: combine's topk_idx names the experts its dispatch was given (validation.check_same_routing)."""
    dispatched = _read(where, "handle", handle_arrays[2 + len(_METADATA)])[0].numpy()
    check_same_routing(where, topk_view.numpy(), dispatched, num_experts)


def _dispatch_metadata(where: str, arrays) -> reference.DispatchResult:
    """The routing of a CPU dispatch, rebuilt from its handle's arrays (what a combine's peers need)."""
    count, *routing = (_read(where, "handle", a)[0].numpy().copy() for a in arrays[:1 + len(_METADATA)])
    src_rank, src_token, src_topk, layout_range = routing
    return reference.DispatchResult(np.empty(0), None, count, src_rank, src_token, src_topk, layout_range, np.empty(0))
