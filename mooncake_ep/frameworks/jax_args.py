"""The arguments of the JAX ops: which Buffer runs where, the arrays, their trace-time views.

Shared by :mod:`mooncake_ep.frameworks.jax_ops` and :mod:`mooncake_ep.jax`; JAX is imported lazily.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from mooncake_ep.buffer import Buffer
from mooncake_ep.tensor import c_contiguous_strides, masked_array_error, numpy_dtype, read_array
from mooncake_ep.validation import check_expert_ids, check_same_routing, first_index

__all__ = ["Ranks", "as_ranks", "abstract_view", "as_jax", "check_devices", "check_parity", "manual_axes",
           "varying_like", "rank_results", "DLPACK_CPU", "DLPACK_CUDA"]

# DLPack device types of XLA's buffers (kDLCPU, kDLCUDA).
DLPACK_CPU, DLPACK_CUDA = 1, 2


# --- which Buffer runs where ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Ranks:
    """The Buffer an op runs on: one Buffer, or one per JAX device (``shard_map``).

    Part of every op's static configuration, which JAX keeps in its compilation caches with the
    programs traced from it: so a Buffer a JAX op has used lives as long as those programs are cached
    (until ``jax.clear_caches()``, which :func:`mooncake_ep.jax.destroy_buffers` calls), even dropped
    without ``destroy()``. Held weakly, it was released by the garbage collector while a cached
    program could still replay its launches from a command buffer, without calling back, on the
    freed workspace (helper-121): a leak until destroy_buffers is the safe side of that.

    Attributes:
        single: the Buffer when one was given, else None.
        by_device: ``((dlpack_device_type, device_id), Buffer)`` pairs of a per-device mapping.
    """

    single: Buffer | None
    by_device: tuple[tuple[tuple[int, int], Buffer], ...] = ()

    @property
    def buffers(self) -> tuple[Buffer, ...]:
        return (self.single,) if self.single is not None else tuple(b for _, b in self.by_device)

    @property
    def first(self) -> Buffer:
        return self.buffers[0]

    @property
    def backend(self) -> str:
        return self.first.backend

    @property
    def placement(self) -> tuple[tuple[tuple[int, int], int], ...] | None:
        """A mapping's (DLPack device, rank) pairs, sorted; None for one Buffer."""
        return None if self.single is not None else tuple(sorted((key, b.rank) for key, b in self.by_device))

    def describe(self) -> str:
        """For messages: "one Buffer", or "a mapping over cpu:0 (rank 0), cpu:1 (rank 1)"."""
        if self.single is not None:
            return "one Buffer"
        return "a mapping over " + ", ".join(f"{_device_name(key)} (rank {rank})" for key, rank in self.placement)

    def select(self, where: str, device: tuple[int, int]) -> Buffer:
        """The Buffer for XLA buffers on DLPack ``device``, checking that it can run there (and still
        exists: a program traced before destroy_buffers records its launches again with a clear error)."""
        kind, device_id = int(device[0]), int(device[1])
        if self.single is not None:
            buffer = self.single
        else:
            buffer = dict(self.by_device).get((kind, device_id))
            if buffer is None:
                known = ", ".join(_device_name(key) for key, _ in self.by_device)
                raise ValueError(f"{where}: no Buffer for {_device_name((kind, device_id))}; the mapping has {known}")
        buffer._check_alive(where)
        if kind == DLPACK_CUDA and buffer.backend != "cuda":
            raise TypeError(f"{where}: the arrays are on cuda:{device_id}, this Buffer runs on the numpy reference "
                            f"backend; build it where a GPU is visible (backend='auto' or 'cuda')")
        if kind == DLPACK_CUDA and buffer.device_id != device_id:
            raise TypeError(f"{where}: the arrays are on cuda:{device_id}, this Buffer's rank uses "
                            f"cuda:{buffer.device_id}")
        if kind == DLPACK_CPU and buffer.backend == "cuda":
            raise TypeError(f"{where}: the computation runs on the CPU, this Buffer runs its kernels on "
                            f"cuda:{buffer.device_id}; build a Buffer with backend='reference' for JAX CPU arrays")
        return buffer


def _device_name(key: tuple[int, int]) -> str:
    return f"{'cuda' if key[0] == DLPACK_CUDA else 'cpu'}:{key[1]}"


def as_ranks(where: str, buffer: Buffer | Mapping[Any, Buffer]) -> Ranks:
    """Reads the ``buffer`` argument of an op: a Buffer, or a mapping ``{jax.Device: Buffer}``.

    Raises:
        TypeError: neither, or a mapping's key is not a JAX device.
        ValueError: an empty mapping, Buffers of groups of different sizes or backends, or a GPU
            device mapped to a Buffer of another GPU.
    """
    if isinstance(buffer, Buffer):
        return Ranks(buffer)
    if not isinstance(buffer, Mapping):
        raise TypeError(f"{where}: buffer must be a mooncake_ep.Buffer or a mapping {{jax.Device: Buffer}} (one "
                        f"rank per device, for shard_map), got {type(buffer).__name__}")
    if not buffer:
        raise ValueError(f"{where}: buffer mapping is empty")
    pairs = []
    for device, value in buffer.items():
        platform = getattr(device, "platform", None)
        if platform not in ("cpu", "gpu", "cuda") or not isinstance(value, Buffer):
            raise TypeError(f"{where}: buffer mapping must be {{jax.Device: Buffer}}, got {device!r}: "
                            f"{type(value).__name__}")
        if platform == "cpu":
            key = (DLPACK_CPU, int(device.id))
        else:
            key = (DLPACK_CUDA, int(device.local_hardware_id))
            if value.device_id != key[1]:
                raise ValueError(f"{where}: {device} (cuda:{key[1]}) is mapped to a Buffer on cuda:{value.device_id}")
        pairs.append((key, value))
    ranks = Ranks(None, tuple(sorted(pairs, key=lambda pair: pair[0])))
    if len({(b.num_ranks, b.backend) for b in ranks.buffers}) != 1:
        raise ValueError(f"{where}: the Buffers of the mapping must be ranks of one group (same num_ranks and "
                         f"backend), got {sorted({(b.num_ranks, b.backend) for b in ranks.buffers})}")
    # Ranks of one Buffer, each once: a Buffer of another group waits in a collective its peers never
    # join, and one rank on two devices makes each step's calls twice on it (helper-88).
    if len({b._token for b in ranks.buffers}) != 1:
        raise ValueError(f"{where}: the Buffers of the mapping must be the ranks of one Buffer (make_buffers' "
                         f"result), got Buffers of {len({b._token for b in ranks.buffers})} different ones")
    devices_of_rank: dict[int, list] = {}
    for device, value in buffer.items():
        devices_of_rank.setdefault(value.rank, []).append(device)
    twice = {rank: devices for rank, devices in devices_of_rank.items() if len(devices) > 1}
    if twice:
        rank, devices = min(twice.items())
        raise ValueError(f"{where}: the mapping gives rank {rank}'s Buffer to {len(devices)} devices "
                         f"({', '.join(map(str, devices))}); each device must have a rank of its own")
    return ranks


# --- trace-time arguments ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _AbstractView:
    """A shape-only stand-in for an ArrayView, for the Buffer's checks at trace time.

    Its device_type is neither "cpu" nor "cuda", so no check reads host data.
    """

    shape: tuple[int, ...]
    dtype: str
    framework: str = "jax"
    device_type: str = "xla"
    device_id: int = -1

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def strides(self) -> tuple[int, ...]:
        return c_contiguous_strides(self.shape)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * numpy_dtype(self.dtype).itemsize

    is_contiguous = True


def abstract_view(array) -> _AbstractView:
    """The trace-time view of a JAX array or tracer: its shape and dtype name (JAX's own name for an
    extended dtype numpy has none for, such as a PRNG key's, which the Buffer's checks then refuse
    by name)."""
    try:
        dtype_name = np.dtype(array.dtype).name
    except TypeError:  # key<fry>: not a numpy dtype
        dtype_name = str(array.dtype)
    return _AbstractView(tuple(int(n) for n in array.shape), dtype_name)


# The dtypes each op argument takes, for the advice of as_jax's refusals.
_DTYPES_TAKEN = {"x": "bfloat16", "topk_idx": "int32 (int64 with jax_enable_x64)", "topk_weights": "float32",
                 "active_ranks": "int32"}


def as_jax(where: str, name: str, value):
    """A JAX array (or tracer) for an op argument, never a silent cast.

    JAX arrays and tracers pass through. numpy arrays are converted, except float64 ones, which JAX
    would turn into float32 without a word when ``jax_enable_x64`` is off, and any other that JAX
    would turn into another dtype, but one: int64 ``topk_idx``, which becomes int32 the same way.
    Expert ids fit, so that is accepted, but values outside int32 (which would wrap, 2**32 turning
    into expert 0) are refused. (An int64 ``active_ranks`` is refused whatever x64 says, as
    :meth:`mooncake_ep.Buffer.dispatch` refuses it.)

    Raises:
        TypeError: a float64 numpy array, another numpy array JAX would convert to another dtype
            (but an int64 topk_idx to int32), or an object of another framework (convert it with
            ``jax.dlpack.from_dlpack``).
        ValueError: an int64 topk_idx with values outside int32 while x64 is off.
    """
    import jax
    import jax.numpy as jnp

    if isinstance(value, jax.Array):
        if not isinstance(value, jax.core.Tracer) and value.is_deleted():  # its devices() raises JAX's own error
            raise TypeError(f"{where}: {name}: this {type(value).__qualname__} was deleted (donated to a jitted "
                            f"call, or .delete()); pass a live array")
        return value
    if isinstance(value, (np.ndarray, np.generic)):
        if isinstance(value, np.ma.MaskedArray):  # as read_array refuses it; JAX's refusal names nothing
            raise masked_array_error(f"{where}: {name}")
        if not value.dtype.isnative:  # JAX's own refusal names neither the call nor the argument
            raise TypeError(f"{where}: {name} is a byte-swapped numpy array ({value.dtype.str}); pass native byte "
                            f"order, e.g. {name}.astype({name}.dtype.newbyteorder('='))")
        if value.dtype == np.float64:  # no argument takes float64
            cast = "" if jax.config.jax_enable_x64 else ", which JAX would cast silently"
            raise TypeError(f"{where}: {name} is a float64 numpy array{cast}; pass {_DTYPES_TAKEN.get(name, 'float32')}")
        narrowed_ids = name == "topk_idx" and value.dtype == np.int64 and not jax.config.jax_enable_x64
        if narrowed_ids and value.size:
            low, high = np.iinfo(np.int32).min, np.iinfo(np.int32).max
            outside = (value < low) | (value > high)
            if outside.any():
                first = first_index(outside)
                raise ValueError(f"{where}: {name} holds {int(value[first])} at {first}, outside int32, and with "
                                 f"jax_enable_x64 off JAX would wrap it into int32 without a word; pass int32 "
                                 f"values, or enable jax_enable_x64")
        try:
            converted = jnp.asarray(value)
        except TypeError as exc:  # object, string, structured, longdouble: JAX names "position 0" of "stage"
            raise TypeError(f"{where}: {name} is a numpy array of {value.dtype.str} ({value.dtype}), which JAX cannot "
                            f"hold; pass {_DTYPES_TAKEN.get(name, 'an array of a dtype JAX has')}") from exc
        if converted.dtype != value.dtype and not narrowed_ids:
            # e.g. uint64 into uint32 with x64 off: name the caller's dtype, not the one JAX made of it
            raise TypeError(f"{where}: {name} is a {value.dtype} numpy array, which JAX would turn into "
                            f"{converted.dtype} without a word; pass {_DTYPES_TAKEN.get(name, value.dtype.name)}")
        return converted
    kind = type(value)
    got = kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
    if isinstance(value, (tuple, list)):
        # A dispatch's fp8 recv_x is a (rows, scales) pair: an easy thing to hand to combine as x.
        hint = (" (an fp8 dispatch's (rows, scales) pair: the experts' bf16 outputs go to combine)" if name == "x"
                else "") + f"; pass one array, e.g. jnp.asarray({name})"
    elif isinstance(value, (bool, int, float, complex)):  # a Python scalar: no producer to convert from
        hint = f"; pass an array of {_DTYPES_TAKEN.get(name, 'its dtype')}, e.g. made with jnp.asarray"
    else:
        hint = "; convert it with jax.dlpack.from_dlpack"
    raise TypeError(f"{where}: {name} must be a jax.Array (or a numpy array), got {got}{hint}")


def check_devices(where: str, ranks: Ranks, **arrays) -> None:
    """For concrete arrays (eager calls), the checks the callback would make at run time, made now.

    Under ``jax.jit`` the arrays are tracers whose devices are known only when XLA runs the op; the
    callback then raises the same errors (inside XLA's runtime error). Outside ``shard_map`` an
    array, concrete or traced, must be one device's: XLA would run the op on every device of a
    sharded array with the whole array, each device's rank sending every token.

    Raises:
        TypeError, ValueError: an array on a device no Buffer of ``ranks`` serves, as
            :meth:`Ranks.select` says.
        ValueError: outside ``shard_map``, an array spread over several devices; arrays placed on
            different devices (XLA's own message would name ``args[i] of buffer_callback``). An
            array JAX has not committed to a device (a converted numpy array, a plain ``jnp.ones``)
            goes where the others are, as JAX moves it.
    """
    import jax

    # Outside shard_map, as far as this JAX can say (one without get_abstract_mesh cannot: no check).
    axes = manual_axes()
    outside_shard_map = hasattr(jax.sharding, "get_abstract_mesh") and not axes
    if axes and jax.process_count() == 1:
        # Every device of the mesh is this process's (with one process per device, as under
        # jax.distributed, each process's one Buffer is its device's rank), and XLA runs the op on
        # each, automatic axes included: each must be a rank, and every rank must take part.
        num_devices = math.prod(jax.sharding.get_abstract_mesh().shape.values())
        if ranks.single is not None and num_devices > 1:  # every device's op would run as this one rank
            raise ValueError(f"{where}: one Buffer inside a shard_map over {num_devices} devices; each device is its "
                             f"own rank: pass the mapping device -> Buffer (make_buffers)")
        if ranks.single is None and num_devices != ranks.first.num_ranks:  # a collective that cannot complete
            raise ValueError(f"{where}: the shard_map runs on {num_devices} devices, the Buffers' group has "
                             f"{ranks.first.num_ranks} ranks; every rank takes part in each call: use a mesh of "
                             f"the Buffers' devices")
    for buffer in ranks.buffers:  # a destroyed Buffer is the call's fault, not one argument's
        buffer._check_alive(where)
    first = None  # (name, devices) of the first concrete array committed to its device
    for name, array in arrays.items():
        traced = isinstance(array, jax.core.Tracer)
        # Read once: each devices() builds a new set (~1 us on a GPU's host, every eager call).
        devices = array.devices() if not traced and hasattr(array, "devices") else None
        if devices is not None and getattr(array, "committed", False):
            if first is None:
                first = (name, devices)
            elif devices != first[1]:
                raise ValueError(f"{where}: {name} is on {_device_names(devices)}, {first[0]} on "
                                 f"{_device_names(first[1])}; put every array of the call on one device")
        if outside_shard_map:
            count = _device_count(array) if devices is None else len(devices)
            if count > 1:
                raise ValueError(f"{where}: {name} is spread over {count} devices outside shard_map, and each call "
                                 f"is one rank's; run it inside jax.shard_map with one device per rank (the mapping "
                                 f"of make_buffers), or pass one device's arrays")
        for device in devices or ():
            ranks.select(f"{where}: {name}", dlpack_device(device))


def dlpack_device(device) -> tuple[int, int]:
    """A JAX device as the DLPack ``(device_type, device_id)`` of its buffers in a callback, the key of
    :meth:`Ranks.select` (a CPU device by its JAX id: DLPack numbers every CPU device 0)."""
    if device.platform == "cpu":
        return DLPACK_CPU, int(device.id)
    return DLPACK_CUDA, int(device.local_hardware_id)


def check_eager_expert_ids(where: str, topk_idx, num_experts, num_max_dispatch_tokens_per_rank) -> None:
    """An eager call's topk_idx on the CPU: its values checked here, where the error reaches the
    caller as itself; the op's own check runs in a callback inside XLA, which wraps what it
    raises in a JaxRuntimeError. Under ``jit`` (a tracer) that one remains; on a GPU values are
    never read. Arguments of the wrong type are left to the op's checks.

    Raises:
        ValueError: an id outside [-1, num_experts), or an expert sent more than T copies.
    """
    if not _host_ids(topk_idx):
        return  # a tracer, another device or dtype: the op's checks
    if not all(isinstance(n, int) and not isinstance(n, bool) and n > 0
               for n in (num_experts, num_max_dispatch_tokens_per_rank)):
        return
    if topk_idx.shape[0] > num_max_dispatch_tokens_per_rank:
        return  # the op names the token count first
    check_expert_ids(where, read_array(np.asarray(topk_idx), name=f"{where}: topk_idx"), num_experts,
                     num_max_dispatch_tokens_per_rank)


def check_eager_routing(where: str, topk_idx, dispatched_topk_idx, num_experts: int) -> None:
    """An eager combine's topk_idx on the CPU against its dispatch's (``validation.check_same_routing``),
    here for the reason of :func:`check_eager_expert_ids`; other cases are left to the op.

    Raises:
        ValueError: an entry names another expert than the dispatch was given.
    """
    if not (_host_ids(topk_idx) and _host_ids(dispatched_topk_idx)) or topk_idx.shape != dispatched_topk_idx.shape:
        return
    check_same_routing(where, np.asarray(topk_idx), np.asarray(dispatched_topk_idx), num_experts)


def _host_ids(ids) -> bool:
    """A concrete 2-D integer JAX array on the CPU, whose values an eager call can read at once."""
    import jax

    if isinstance(ids, jax.core.Tracer) or not getattr(ids, "is_fully_addressable", False):
        return False
    return (all(device.platform == "cpu" for device in ids.devices()) and getattr(ids, "ndim", 0) == 2
            and ids.dtype in (np.int32, np.int64))


def _device_names(devices) -> str:
    return ", ".join(sorted(f"{d.platform}:{d.id}" for d in devices))


def manual_axes() -> tuple[str, ...]:
    """The mesh axes of the ``shard_map`` being traced (in mesh order); () outside one."""
    import jax

    get_mesh = getattr(jax.sharding, "get_abstract_mesh", None)  # JAX releases before 0.5 lack it
    mesh = get_mesh() if get_mesh is not None else None
    manual = set(getattr(mesh, "manual_axes", ()) or ())
    return tuple(axis for axis in getattr(mesh, "axis_names", ()) if axis in manual)


def _device_count(array) -> int:
    """How many devices hold ``array``: a concrete array's, or a tracer's sharding's mesh (0 or 1: one)."""
    import jax

    if not isinstance(array, jax.core.Tracer):
        return len(array.devices()) if hasattr(array, "devices") else 1
    sharding = getattr(jax.typeof(array), "sharding", None) if hasattr(jax, "typeof") else None
    return int(getattr(getattr(sharding, "mesh", None), "size", 1) or 1)


def check_parity(where: str, parity, name: str = "parity") -> int:
    if isinstance(parity, bool) or not isinstance(parity, (int, np.integer)) or parity not in (0, 1):
        raise ValueError(f"{where}: {name} must be 0 or 1 (the workspace half), got {parity!r}")
    return int(parity)


def varying_like(values, *likes):
    """``values`` marked as varying over every ``shard_map`` axis any of ``likes`` varies over.

    For arrays built inside a backward (zeros, ones) that must have the type of the values they
    meet there (gradients are checked against the inputs' types).
    """
    axes = set()
    for like in likes:
        axes |= varying_axes(like)
    return _vary(values, axes)


def rank_results(values):
    """An op's results, marked as varying over every manual axis of the ``shard_map`` being traced.

    ``buffer_callback`` results carry no manual-axis type, and each device of a shard_map is its own
    rank, with its own results, even where every input is replicated over an axis: typed as the
    inputs, such results would be taken as equal on every device (an ``out_specs`` without the
    axis would pass, and the gradient of a replicated input would be summed over that axis).
    """
    return _vary(values, set(manual_axes()))


def _vary(values, axes: set):
    import jax

    def cast(value):
        missing = tuple(sorted(axes - varying_axes(value), key=str))
        if not missing:
            return value
        if hasattr(jax.lax, "pcast"):
            return jax.lax.pcast(value, missing, to="varying")
        return jax.lax.pvary(value, missing)  # JAX releases before pcast
    return jax.tree_util.tree_map(cast, values)


def varying_axes(value) -> set:
    """The shard_map axes ``value`` varies over (empty outside one)."""
    import jax

    aval = jax.typeof(value)
    mat = getattr(aval, "mat", None)  # JAX >= 0.9: ManualAxisType(varying=...)
    if mat is not None:
        return set(mat.varying)
    return set(getattr(aval, "vma", ()))  # earlier releases
