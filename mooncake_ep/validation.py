"""Argument checks of the public calls: each raises naming the call and the argument.

The layer between :mod:`mooncake_ep.buffer` (the public API) and the tensor boundary: it reads
:class:`~mooncake_ep.tensor.ArrayView` s and plain arguments, never launches anything, and keeps no
state, so a refused call leaves the Buffer as it was.
"""

from __future__ import annotations

import numbers
import operator
import sys
from typing import Any

import numpy as np

from mooncake_ep import _constants, frameworks
from mooncake_ep.tensor import ArrayView, c_contiguous_strides, read_array, swapped_last_axes_strides

__all__ = ["check_int", "check_hidden", "check_experts", "check_timeout", "check_flags", "check_array",
           "check_expert_ids", "check_same_routing", "type_name", "read_out", "check_out", "check_writable",
           "check_vector_aligned", "check_element_aligned", "check_disjoint", "check_allocatable", "check_mutable",
           "first_index", "is_raw_bits", "stream_handle", "IMMUTABLE_FRAMEWORKS", "VECTOR_BYTES"]


def check_int(where: str, name: str, value, *, minimum: int | None = None, maximum: int | None = None) -> int:
    """``value`` as a Python int, if it is an int or a numpy integer in [minimum, maximum].

    Callers go on with the returned int: numpy's small integers wrap in the arithmetic of shapes and
    sizes (``np.int16(4096) * np.int16(16)`` is 0, with a warning), where a Python int does not.
    """
    if type(value) is int and (minimum is None or value >= minimum) and (maximum is None or value <= maximum):
        return value  # a Python int in range (not a bool, whose type is bool): the checks below would pass
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{where}: {name} must be an int, got {type(value).__name__}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{where}: {name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{where}: {name} must be <= {maximum}, got {value}")
    return int(value)


def check_hidden(where: str, name: str, hidden) -> int:
    hidden = check_int(where, name, hidden, minimum=1)
    if hidden % _constants.HIDDEN_ALIGNMENT:
        raise ValueError(f"{where}: {name} must be a multiple of {_constants.HIDDEN_ALIGNMENT}, got {hidden}")
    return hidden


def check_experts(where: str, num_experts, num_ranks: int) -> int:
    num_experts = check_int(where, "num_experts", num_experts, minimum=1, maximum=_constants.MAX_EXPERTS)
    if num_experts % num_ranks:
        raise ValueError(f"{where}: num_experts must be a multiple of num_ranks={num_ranks}, got {num_experts}")
    return num_experts


def check_grad_num_topk(where: str, grad_num_topk, num_topk: int) -> int:
    """The top-k a combine's gradient dispatch is laid out for: ``grad_num_topk`` (at least this
    rank's ``num_topk``, at most the kernels' top-k), or ``num_topk`` when None."""
    if grad_num_topk is None:
        return num_topk
    return check_int(where, "grad_num_topk", grad_num_topk, minimum=num_topk, maximum=_constants.MAX_TOPK)


def check_timeout(where: str, timeout_us) -> int:
    return check_int(where, "timeout_us", timeout_us, minimum=_constants.TIMEOUT_FOREVER,
                     maximum=_constants.MAX_TIMEOUT_US)


def stream_handle(where: str, stream, device_id: int | None) -> int:
    """A ``stream=`` argument as the ``cudaStream_t`` it names, 0 for the legacy default stream.

    Accepted: a ``torch.cuda.Stream`` (``ExternalStream`` too: its ``cuda_stream``), a CUDA
    ``torch.Stream`` (``torch.accelerator.current_stream()``'s: its ``native_handle``), a cupy stream
    (its ``ptr``), an object of the CUDA stream protocol (``__cuda_stream__()`` -> ``(version, handle)``), or
    a handle as an int in [0, 2**63). 1, CUDA's other name of the legacy default stream, reads as 0. 2,
    the per-thread default stream, is refused: it names another stream in each thread, and a hook or
    an event's wait may run in another thread than the call. A stream object of another device than
    ``device_id`` (the Buffer's; None for the reference backend) is refused.
    """
    kind = "a torch.cuda.Stream, a cupy.cuda.Stream, a __cuda_stream__ object or a cudaStream_t as an int"
    handle, stream_device = stream, None
    torch = sys.modules.get("torch")
    cupy = sys.modules.get("cupy")
    if torch is not None and isinstance(stream, torch.cuda.Stream):
        handle, stream_device = stream.cuda_stream, stream.device.index
    elif torch is not None and isinstance(stream, getattr(torch, "Stream", ())):  # torch.accelerator's
        if stream.device.type != "cuda":
            raise TypeError(f"{where}: stream is a torch stream of device type {stream.device.type!r}, not CUDA")
        stream_device = stream.device.index
        if device_id is None or stream_device == device_id:  # native_handle asks the device for it
            handle = stream.native_handle
    elif cupy is not None and isinstance(stream, (cupy.cuda.Stream, cupy.cuda.ExternalStream)):
        # -1: a stream of no known device (cupy's null stream, an ExternalStream made without one)
        handle, stream_device = stream.ptr, getattr(stream, "device_id", -1)
    elif hasattr(type(stream), "__cuda_stream__"):
        protocol = stream.__cuda_stream__()
        if not (isinstance(protocol, tuple) and len(protocol) == 2):
            raise TypeError(f"{where}: stream.__cuda_stream__() must return (version, handle), got {protocol!r}")
        handle = protocol[1]
    elif isinstance(stream, bool) or not isinstance(stream, numbers.Integral):
        raise TypeError(f"{where}: stream must be {kind}, got {type(stream).__name__}")
    if device_id is not None and isinstance(stream_device, int) and stream_device >= 0 and stream_device != device_id:
        raise ValueError(f"{where}: stream is a stream of cuda:{stream_device}, this Buffer's rank uses "
                         f"cuda:{device_id}")
    try:
        value = operator.index(handle)
    except TypeError:  # a __cuda_stream__ handle of another type
        raise TypeError(f"{where}: stream's handle must be an int, got {type(handle).__name__}") from None
    if not 0 <= value < 1 << 63:
        raise ValueError(f"{where}: stream must name a CUDA stream (a cudaStream_t, an int in [0, 2**63)), got {value}")
    if value == _constants.PER_THREAD_DEFAULT_STREAM:
        raise ValueError(f"{where}: stream 2 is the per-thread default stream, another stream in each thread (a "
                         f"hook or an event may be waited for in another thread than the call's): pass that "
                         f"thread's stream object, or a stream of its own")
    return 0 if value == 1 else value


def check_bool(where: str, name: str, value) -> None:
    """TypeError unless ``value`` is True or False (a Python bool: numpy's, 0, None or a string are not)."""
    if value is not True and value is not False:  # (type_name: numpy's bool is also called "bool")
        raise TypeError(f"{where}: {name} must be a bool, got {type_name(value)}")


def check_flags(where: str, *, use_fp8: bool = False, round_scale: bool = False, use_ue8m0: bool = False,
                async_finish: bool = False, return_recv_hook: bool = False, zero_copy: bool = False,
                renormalize: bool = False) -> None:
    # Python bools only: a flag reaches the launch's packed arguments and the plan keys as is.
    if not ((use_fp8 is True or use_fp8 is False) and (round_scale is True or round_scale is False)
            and (use_ue8m0 is True or use_ue8m0 is False) and (async_finish is True or async_finish is False)
            and (return_recv_hook is True or return_recv_hook is False) and (zero_copy is True or zero_copy is False)
            and (renormalize is True or renormalize is False)):
        flags = dict(use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=use_ue8m0, async_finish=async_finish,
                     return_recv_hook=return_recv_hook, zero_copy=zero_copy, renormalize=renormalize)
        name, value = next(item for item in flags.items() if item[1] is not True and item[1] is not False)
        check_bool(where, name, value)
    if async_finish and return_recv_hook:
        raise ValueError(f"{where}: async_finish and return_recv_hook are exclusive")
    if use_ue8m0 and not (use_fp8 and round_scale):
        raise ValueError(f"{where}: use_ue8m0=True needs use_fp8=True and round_scale=True (UE8M0 stores "
                         f"power-of-two scales)")
    if round_scale and not use_fp8:
        raise ValueError(f"{where}: round_scale=True needs use_fp8=True")


def check_array(where: str, name: str, view: ArrayView, *, dtypes: tuple[str, ...], ndim: int | None = None,
                 shape: tuple[int, ...] | None = None, like: ArrayView | None = None,
                 swapped_last_axes: bool = False) -> None:
    """Dtype, shape and device of an argument, dense and row-major (or, with ``swapped_last_axes``,
    dense with its last two dimensions swapped: DeepEP's fp8 scales)."""
    if view.dtype not in dtypes and not is_raw_bits(view, dtypes):
        raise TypeError(f"{where}: {name} must be {' or '.join(dtypes)}, got {view.dtype}")
    if shape is not None and tuple(view.shape) != tuple(shape):
        hint = ""
        if swapped_last_axes and tuple(view.shape) == (*shape[:-2], shape[-1], shape[-2]):
            hint = "; for DeepEP's layout pass this array with its last two dimensions swapped (.swapaxes(1, 2))"
        raise ValueError(f"{where}: {name} must have shape {tuple(shape)}, got {tuple(view.shape)}{hint}")
    if ndim is not None and view.ndim != ndim:
        raise ValueError(f"{where}: {name} must be {ndim}-dimensional, got shape {tuple(view.shape)}")
    if not view.is_contiguous and not (swapped_last_axes and view.is_swapped_last_axes):
        # Strides in elements, whatever the framework counts them in (numpy: bytes): the arrays
        # are named by their shape and dtype, and so are the strides that fit.
        if swapped_last_axes:
            raise ValueError(f"{where}: {name} must be contiguous (row-major, strides in elements "
                             f"{c_contiguous_strides(view.shape)}) or a contiguous array with its last two "
                             f"dimensions swapped (DeepEP's layout, strides {swapped_last_axes_strides(view.shape)}), "
                             f"got strides {view.strides}; pass a contiguous array, or the .swapaxes(1, 2) of one")
        raise ValueError(f"{where}: {name} must be contiguous (row-major), got strides in elements {view.strides}; "
                         f"pass a contiguous copy")
    if like is not None and (view.device_type, view.device_id) != (like.device_type, like.device_id):
        raise TypeError(f"{where}: {name} is on {view.device_type}:{view.device_id}, expected "
                        f"{like.device_type}:{like.device_id} like the other arrays")


# Frameworks without bf16/fp8 dtypes: their callers hold such arrays as unsigned ints of the same
# width, the raw bits (frameworks/cupy.py), and those are accepted where bf16/fp8 is expected.
RAW_BITS_FRAMEWORKS = ("cupy",)


def is_raw_bits(view: ArrayView, dtypes: tuple[str, ...]) -> bool:
    if view.framework not in RAW_BITS_FRAMEWORKS:
        return False
    raw_bits = frameworks.get(view.framework).RAW_BITS_DTYPES
    return any(raw_bits.get(dtype) == view.dtype for dtype in dtypes)


def type_name(value) -> str:
    """``value``'s type for an error message: a builtin's bare name (NoneType), any other's with its
    module (mooncake_ep.buffer.Handle, where two classes share a name)."""
    kind = type(value)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def first_index(mask: np.ndarray) -> tuple[int, ...]:
    """The index of the first true element of ``mask`` (row-major), for naming a bad entry."""
    return tuple(int(i) for i in np.unravel_index(int(np.argmax(mask)), mask.shape))


def check_expert_ids(where: str, topk_view: ArrayView, num_experts: int, num_max_tokens: int) -> None:
    ids = topk_view.numpy()
    bad = (ids < _constants.NO_EXPERT) | (ids >= num_experts)
    if bad.any():
        first = first_index(bad)
        raise ValueError(f"{where}: topk_idx entries must be -1 or in [0, {num_experts}), got {int(ids[first])} "
                         f"at {first}")
    # recv_x holds num_ranks * T rows per expert, so each rank may send an expert at most T copies:
    # always true when each token's experts are distinct, broken by a token naming one twice.
    copies = np.bincount(ids[ids >= 0].astype(np.int64), minlength=num_experts)
    if copies.max(initial=0) > num_max_tokens:
        expert = int(np.argmax(copies))
        raise ValueError(f"{where}: topk_idx sends {int(copies[expert])} copies to expert {expert}, more than "
                         f"num_max_dispatch_tokens_per_rank={num_max_tokens} (recv_x has num_ranks * T rows per "
                         f"expert); give each token distinct experts")


def check_same_routing(where: str, given: np.ndarray, dispatched: np.ndarray, num_experts: int) -> None:
    """Host arrays: an entry of combine's topk_idx that names an expert must name the one its dispatch
    was given (the kernels find the expert's row by this id and the dispatch's slot, so another id
    reads another expert's row). -1, or an id outside [0, E), adds nothing in either."""
    differs = (given != dispatched) & (given >= 0) & (given < num_experts)
    if differs.any():
        first = first_index(differs)
        raise ValueError(f"{where}: topk_idx must name the experts given to the dispatch of handle (or -1); "
                         f"entry {first} is {int(given[first])}, the dispatch had {int(dispatched[first])}")


def read_out(where: str, out, nested_fp8: bool, stream: int | None) -> list[tuple[ArrayView, Any]] | None:
    """Read the arrays of a dispatch's ``out=`` (``None``: the call allocates its results)."""
    if out is None:
        return None
    if not isinstance(out, (tuple, list)):
        raise TypeError(f"{where}: out must be a tuple of arrays shaped as the results, got {type(out).__name__}")
    flat = list(out)
    if nested_fp8:
        if len(flat) != 2 or not isinstance(flat[0], (tuple, list)) or len(flat[0]) != 2:
            raise TypeError(f"{where}: out must be ((recv_x, recv_scales), recv_count) with use_fp8")
        flat = [flat[0][0], flat[0][1], flat[1]]
    elif flat and isinstance(flat[0], (tuple, list)):
        raise TypeError(f"{where}: out must be (recv_x, recv_count) without use_fp8; ((recv_x, recv_scales), "
                        f"recv_count) is the form of an fp8 dispatch")
    names = ("recv_x", "recv_scales", "recv_count") if nested_fp8 else ("recv_x", "recv_count")
    if len(flat) != len(names):
        raise TypeError(f"{where}: out must hold {len(names)} arrays ({', '.join(names)}), got {len(flat)}")
    labels = _OUT_LABELS.get((where, nested_fp8))
    if labels is None:
        labels = _OUT_LABELS[where, nested_fp8] = tuple(f"{where}: out {name}" for name in names)
    return [(read_array(obj, name=label, stream=stream), obj) for obj, label in zip(flat, labels)]


# The error-message names of the out= arrays, by (call, fp8): made once, not formatted every call.
_OUT_LABELS: dict[tuple[str, bool], tuple[str, ...]] = {}


def check_out(where: str, out_views, specs, like: ArrayView, swapped_last_axes: tuple[str, ...] = ()) -> None:
    """Check ``out=`` arrays against the result specs (nothing to check when the call allocates);
    the results named in ``swapped_last_axes`` may also be laid out as :func:`check_array` says."""
    if out_views is None:
        return
    for (view, _), (name, shape, dtype) in zip(out_views, specs):
        check_array(where, f"out {name}", view, dtypes=(dtype,), shape=shape, like=like,
                    swapped_last_axes=name in swapped_last_axes)
        check_writable(where, f"out {name}", view)


def check_allocatable(where: str, name: str, view: ArrayView) -> None:
    """A call without ``out=`` makes its results in the framework of its array ``view`` on its
    device; device memory of a DLPack producer other than torch, cupy or JAX has no framework that
    could (numpy holds host memory only)."""
    if view.framework == "dlpack" and view.device_type != "cpu":
        raise TypeError(f"{where}: {name} is {view.device_type} memory of a DLPack producer mooncake_ep cannot make "
                        f"results for (it makes them as torch, cupy or JAX arrays, or numpy ones on the CPU); pass "
                        f"out=, or torch, cupy or JAX arrays")


def check_writable(where: str, name: str, view: ArrayView) -> None:
    """An array the call writes into (out=, active_ranks) must not be marked read-only, nor be of an
    immutable framework: the write would fail after the peers have been told, be dropped without a
    word, or (JAX memory, whose legacy DLPack capsules cannot say read-only) change a value JAX shares.
    JAX memory is told apart however it comes: a JAX array, or a capsule JAX made (bare, or from a
    wrapper's ``__dlpack__``), which reads as read-only (ArrayView.jax_memory)."""
    if view.framework in IMMUTABLE_FRAMEWORKS:
        raise TypeError(f"{where}: {name} is a {view.framework} array, which is immutable, and the call writes "
                        f"into it; pass a torch, cupy or numpy array (or {view.framework} arrays throughout)")
    if view.readonly:
        if view.jax_memory:
            raise TypeError(f"{where}: {name} is a JAX array's memory (its DLPack capsule was made by JAX), which "
                            f"is immutable, and the call writes into it; pass a torch, cupy or numpy array")
        raise ValueError(f"{where}: {name} is read-only, and the call writes into it; pass a writable array")
    if view.copied:
        raise ValueError(f"{where}: {name} was exported by its producer as a copy (DLPack IS_COPIED), so what the "
                         f"call writes would never reach it; pass an array whose memory can be shared")


# The kernels move rows of x, recv_x, expert outputs and combined_x as 16-byte vectors.
VECTOR_BYTES = 16


def check_vector_aligned(where: str, name: str, view: ArrayView, nbytes: int) -> None:
    """A device array whose rows the kernels move as 16-byte vectors must start on a 16-byte boundary
    (its rows then do too: hidden is a multiple of 128); a misaligned access would stop the kernel
    with an error that poisons the CUDA context for every later call."""
    if view.device_type == "cuda" and nbytes and view.ptr % VECTOR_BYTES:
        raise ValueError(f"{where}: {name} starts at {view.ptr:#x}, not on a {VECTOR_BYTES}-byte boundary, and the "
                         f"kernels move its rows as {VECTOR_BYTES}-byte vectors; pass an array that starts on one "
                         f"(a copy, or a slice at a multiple of {VECTOR_BYTES} bytes)")


def check_element_aligned(where: str, names: tuple[str, ...], views, nbytes: tuple[int, ...]) -> None:
    """Device arrays start on a multiple of their element size: the kernels load and store their
    elements (ids, counts, weights, scales) one by one as such, and a misaligned access would stop
    the kernel with an error that poisons the CUDA context for every later call. torch never makes
    such an array; a cupy or DLPack view at an odd byte offset can be one. ``nbytes``: the arrays'
    sizes in bytes (an empty one is never read)."""
    for name, view, size in zip(names, views, nbytes):
        if view.device_type == "cuda" and size and view.ptr % view.itemsize:
            raise ValueError(f"{where}: {name} starts at {view.ptr:#x}, not on a multiple of its {view.itemsize}-byte "
                             f"{view.dtype} elements, which the kernels load and store one by one; pass an array "
                             f"that starts on one (a copy)")


def check_disjoint(where: str, names: tuple[str, ...], views, nbytes: tuple[int, ...], num_written: int) -> None:
    """The arrays a call writes (the first ``num_written`` of ``views``) must share no memory with
    each other or with the arrays it reads (the rest): the kernels read the inputs while they write
    the results, and an array written twice ends up holding one of the two.

    ``views`` are on one device (checked before); ``nbytes`` are their sizes in bytes, in order.
    """
    for i in range(num_written):
        start, end = views[i].ptr, views[i].ptr + nbytes[i]
        for j, view in enumerate(views):
            if j != i and start < view.ptr + nbytes[j] and view.ptr < end and nbytes[i] and nbytes[j]:
                raise ValueError(f"{where}: {names[i]} shares memory with {names[j]}; pass separate arrays")


# Frameworks whose arrays are immutable: results are built after the computation, never written
# into later (no hook, no out=), and active_ranks is not updated in place.
IMMUTABLE_FRAMEWORKS = ("jax",)


def check_mutable(where: str, name: str, view: ArrayView, out, return_recv_hook: bool) -> None:
    """TypeError for out= or return_recv_hook=True in a call whose results are of an immutable framework
    (that of ``view``, the call's array ``name``): its results are new arrays, built once the call is
    done, never arrays filled in place or later."""
    if view.framework not in IMMUTABLE_FRAMEWORKS:
        return
    if return_recv_hook or out is not None:
        given = "out=" if out is not None else "return_recv_hook=True"
        raise TypeError(f"{where}: {name} is a {view.framework} array, so the results are new {view.framework} arrays "
                        f"(immutable), built once the call is done, and {given} would fill arrays in place or later; "
                        f"call without it (or pass torch, cupy or numpy arrays)")
