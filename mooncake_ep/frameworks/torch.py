"""torch glue. This module is ``mooncake_ep.frameworks.torch``; torch is imported lazily."""

from __future__ import annotations

import os
import sys
import warnings
from typing import TYPE_CHECKING, Any

import numpy as np

from mooncake_ep.tensor import DTYPES, ArrayView, DeviceMemoryArray, torch_current_stream

if TYPE_CHECKING:
    import torch

__all__ = ["empty", "empty_swapped", "from_numpy", "current_stream", "wrap", "record_stream", "mark_modified"]

# numpy dtypes torch.from_numpy refuses (ml_dtypes) -> unsigned int of the same width; the
# tensor is then reinterpreted with Tensor.view(dtype), which copies nothing.
_RAW_BITS = {"bfloat16": np.uint16, "float8_e4m3fn": np.uint8}


def _torch_dtype(dtype: str, where: str) -> Any:
    import torch

    if dtype not in DTYPES:
        raise TypeError(f"{where} must be one of {DTYPES}, got {dtype!r}")
    return getattr(torch, dtype)  # our names are torch's names


def _device(device_type: str, device_id: int, where: str) -> str:
    if device_type == "cuda":
        return f"cuda:{device_id}"
    if device_type == "cpu":
        return "cpu"
    raise TypeError(f"{where} must be 'cuda' or 'cpu', got {device_type!r}")


def empty(shape: tuple[int, ...], dtype: str, device_type: str, device_id: int) -> torch.Tensor:
    """Returns ``torch.empty(shape)`` of ``dtype`` on ``cuda:{device_id}`` or the CPU.

    Raises:
        TypeError: ``dtype`` or ``device_type`` is not supported.
    """
    make, torch_dtype, device = _empty_args(dtype, device_type, device_id)
    if shape:  # extents as separate arguments: torch parses them ~0.45 us faster than one tuple
        return make(*shape, dtype=torch_dtype, device=device)
    return make(shape, dtype=torch_dtype, device=device)


# (dtype, device_type, device_id) -> (torch.empty, torch dtype, torch.device): each call allocates its
# results, and parsing "cuda:N" and looking the dtype up every time costs a microsecond a result.
_EMPTY_ARGS: dict[tuple[str, str, int], tuple] = {}


def empty_swapped(shape: tuple[int, ...], strides: tuple[int, ...], dtype: str, device_type: str,
                  device_id: int) -> torch.Tensor:
    """Returns :func:`empty` of ``shape`` laid out with its last two dimensions swapped: ``strides``,
    ``swapped_last_axes_strides(shape)`` (one ``torch.empty_strided``: a transpose after ``empty``
    costs a microsecond more of every call)."""
    import torch

    _, torch_dtype, device = _empty_args(dtype, device_type, device_id)
    return torch.empty_strided(shape, strides, dtype=torch_dtype, device=device)


def _empty_args(dtype: str, device_type: str, device_id: int) -> tuple:
    found = _EMPTY_ARGS.get((dtype, device_type, device_id))
    if found is None:
        import torch

        found = (torch.empty, _torch_dtype(dtype, "torch.empty: dtype"),
                 torch.device(_device(device_type, device_id, "torch.empty: device_type")))
        _EMPTY_ARGS[(dtype, device_type, device_id)] = found
    return found


def from_numpy(arr: np.ndarray, like: ArrayView) -> torch.Tensor:
    """Returns a tensor with ``arr``'s values on ``like``'s device.

    On the CPU it shares ``arr``'s memory (bf16/fp8 included, through a raw-bits view) unless
    ``arr`` has negative strides or is read-only, which torch cannot share: then it is copied.
    For a CUDA ``like`` the data is copied to ``cuda:{like.device_id}`` (a host sync).

    Raises:
        TypeError: ``arr``'s dtype is not supported.
    """
    import torch

    from mooncake_ep.tensor import read_array

    dtype = read_array(arr, name="torch.from_numpy: arr").dtype
    if any(s < 0 for s in arr.strides) or not arr.flags.writeable:
        arr = np.array(arr)
    raw = _RAW_BITS.get(dtype)
    tensor = torch.from_numpy(arr.view(raw) if raw is not None else arr)
    if raw is not None:
        tensor = tensor.view(getattr(torch, dtype))
    if like.device_type == "cuda":
        tensor = tensor.to(f"cuda:{like.device_id}")
    return tensor


# torch's current CUDA stream handle on a device (0 = legacy default): tensor's getter itself, one
# call fewer on every dispatch and combine.
current_stream = torch_current_stream


def wrap(array: DeviceMemoryArray) -> torch.Tensor:
    """Returns ``torch.from_dlpack(array)``: a tensor sharing the memory, keeping its owner."""
    import torch

    return torch.from_dlpack(array)


# torch stream objects of the streams record_stream was given, by (handle, device): one each, made
# on first use. Emptied when it grows past this many (Buffers come and go; a handle may be reused).
_external_streams: dict[tuple[int, int], Any] = {}
_MAX_EXTERNAL_STREAMS = 64


def record_stream(tensors, stream_ptr: int, device_id: int) -> None:
    """Tell torch's caching allocator that work on ``stream_ptr`` uses ``tensors``.

    For calls that run on another stream than the one the tensors were allocated on (async_finish
    runs on the Buffer's communication stream): a tensor the caller drops is then not handed to a
    new allocation on its own stream before that work is done (``Tensor.record_stream``).
    """
    import torch

    stream = _external_streams.get((stream_ptr, device_id))
    if stream is None:
        if len(_external_streams) >= _MAX_EXTERNAL_STREAMS:
            _external_streams.clear()
        device = torch.device("cuda", device_id)
        # 0 is the legacy default stream, torch's own default stream (not an external one).
        stream = torch.cuda.default_stream(device) if stream_ptr == 0 else torch.cuda.ExternalStream(stream_ptr,
                                                                                                     device=device)
        _external_streams[(stream_ptr, device_id)] = stream
    for tensor in tensors:
        tensor.record_stream(stream)


def mark_modified(tensors: list) -> None:
    """Count a call's in-place write of ``tensors`` in torch's autograd, as torch's own in-place ops do.

    A kernel writes them through their pointers, which torch cannot see: a tensor saved for a
    backward and then overwritten by a call (an out= array reused) then makes that backward raise,
    instead of computing a gradient from the new values (``torch.autograd.graph.increment_version``,
    which skips inference tensors: they have no version counter).
    """
    if not _increment_version:
        import torch

        _increment_version.append(torch.autograd.graph.increment_version)
    _increment_version[0](tensors)


_increment_version: list = []  # torch.autograd.graph.increment_version, bound on first use


def warn_if_differentiated(where: str, name: str, tensor) -> None:
    """Warn where ``tensor`` requires grad in grad mode: the call is no autograd op, so its results
    carry no gradient back to it, and a model that trains through it (a residual around an MoE layer
    still has a loss) leaves its experts and router untouched without an error. Not an error: an
    inference script that forgot ``torch.no_grad()`` gets what Mooncake EP's and DeepEP's calls give."""
    import torch

    if torch.is_grad_enabled():
        # Named at the caller's line: the first frame outside the package (deep_ep's calls pass two of ours).
        package = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
        frame, stacklevel = sys._getframe(0), 1
        while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package):
            frame, stacklevel = frame.f_back, stacklevel + 1
        warnings.warn(f"{where}: {name} requires grad, and Buffer calls are not differentiable: no gradient "
                      f"flows back through them. Use mooncake_ep.torch.dispatch / combine to train; for "
                      f"inference call under torch.no_grad() or torch.inference_mode() (or pass {name}.detach())",
                      UserWarning, stacklevel=stacklevel)
