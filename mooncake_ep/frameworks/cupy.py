"""cupy glue. This module is ``mooncake_ep.frameworks.cupy``; cupy is imported lazily.

cupy has no bfloat16 and no float8 dtype, so bf16 travels as a ``uint16`` array and fp8 e4m3fn as a
``uint8`` array of the same shape, holding the raw bits: :func:`empty`, :func:`from_numpy` and
:func:`wrap` return that form, and :class:`mooncake_ep.Buffer` accepts it wherever a bf16/fp8 array is
expected from a cupy caller (``x``, the expert outputs, ``out=``). To compute with the values, view
the bits in a framework that has the dtype, e.g. ``torch.from_dlpack(recv_x).view(torch.float8_e4m3fn)``,
or decode them on the host with ``ml_dtypes``: ``cupy.asnumpy(recv_x).view(ml_dtypes.float8_e4m3fn)``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from mooncake_ep.tensor import DTYPES, ArrayView, DeviceMemoryArray

if TYPE_CHECKING:
    import cupy

__all__ = ["RAW_BITS_DTYPES", "empty", "from_numpy", "current_stream", "wrap"]

# Our dtype -> the cupy dtype that carries its bits.
RAW_BITS_DTYPES = {"bfloat16": "uint16", "float8_e4m3fn": "uint8"}


# The numpy dtype cupy carries each of ours in, made once: empty() runs for every result of an
# allocating call.
_CUPY_DTYPES = {name: np.dtype(RAW_BITS_DTYPES.get(name, name)) for name in DTYPES}


def _cupy_dtype(dtype: str, where: str) -> np.dtype:
    found = _CUPY_DTYPES.get(dtype)
    if found is None:
        raise TypeError(f"{where} must be one of {DTYPES}, got {dtype!r}")
    return found


def _require_cuda(device_type: str, where: str) -> None:
    if device_type != "cuda":
        raise TypeError(f"{where} must be 'cuda' for cupy, got {device_type!r}")


def empty(shape: tuple[int, ...], dtype: str, device_type: str, device_id: int) -> cupy.ndarray:
    """Returns ``cupy.empty(shape)`` on device ``device_id`` (bf16/fp8 as raw-bits uint).

    Raises:
        TypeError: ``dtype`` is unknown or ``device_type`` is not ``"cuda"``.
    """
    import cupy

    _require_cuda(device_type, "cupy.empty: device_type")
    np_dtype = _cupy_dtype(dtype, "cupy.empty: dtype")
    if cupy.cuda.runtime.getDevice() == device_id:  # the usual case: no switch of device and back
        return cupy.empty(tuple(shape), dtype=np_dtype)
    with cupy.cuda.Device(device_id):
        return cupy.empty(tuple(shape), dtype=np_dtype)


def from_numpy(arr: np.ndarray, like: ArrayView) -> cupy.ndarray:
    """Returns a copy of ``arr`` on ``like``'s device (bf16/fp8 as raw-bits uint).

    Raises:
        TypeError: ``like`` is not on a CUDA device, or ``arr``'s dtype is not supported.
    """
    import cupy

    from mooncake_ep.tensor import read_array

    _require_cuda(like.device_type, "cupy.from_numpy: like")
    dtype = read_array(arr, name="cupy.from_numpy: arr").dtype
    with cupy.cuda.Device(like.device_id):
        return cupy.asarray(arr.view(_cupy_dtype(dtype, "cupy.from_numpy: arr")))


def current_stream(device_id: int) -> int:
    """Returns cupy's current stream handle on ``device_id`` (0 = legacy default)."""
    import cupy

    return cupy.cuda.get_current_stream(device_id).ptr


def wrap(array: DeviceMemoryArray) -> cupy.ndarray:
    """Returns a cupy array sharing the memory (bf16/fp8 as raw-bits uint, like :func:`empty`).

    Raises:
        TypeError: the memory is not on a CUDA device.
    """
    import cupy

    _require_cuda(array.device_type, "cupy.wrap: array.device_type")
    raw = RAW_BITS_DTYPES.get(array.dtype)
    if raw is not None:
        # cupy.from_dlpack refuses the bf16/fp8 type codes: export the same memory as unsigned ints.
        array = DeviceMemoryArray(array.ptr, array.shape, raw, array.device_type, array.device_id, owner=array.owner)
    return cupy.from_dlpack(array)
