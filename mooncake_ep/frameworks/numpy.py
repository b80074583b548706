"""numpy glue: CPU arrays only (the reference backend, and unknown DLPack producers).

This module is ``mooncake_ep.frameworks.numpy``; ``import numpy`` below is absolute and gets the
real numpy.
"""

from __future__ import annotations

import numpy as np

from mooncake_ep.tensor import ArrayView, DeviceMemoryArray, numpy_dtype, read_array

__all__ = ["empty", "from_numpy", "current_stream", "wrap"]


def _require_cpu(device_type: str, where: str) -> None:
    if device_type != "cpu":
        raise TypeError(f"{where} must be on the CPU for numpy, got {device_type!r}; numpy "
                        f"arrays cannot hold device memory")


def empty(shape: tuple[int, ...], dtype: str, device_type: str = "cpu",
          device_id: int = 0) -> np.ndarray:
    """Returns an uninitialised numpy array (bf16/fp8 as ``ml_dtypes`` dtypes).

    Raises:
        TypeError: ``device_type`` is not ``"cpu"``, or ``dtype`` is unknown.
    """
    _require_cpu(device_type, "numpy.empty: device_type")
    return np.empty(shape, numpy_dtype(dtype))


def from_numpy(arr: np.ndarray, like: ArrayView) -> np.ndarray:
    """Returns ``arr`` itself (``like`` must be CPU memory)."""
    _require_cpu(like.device_type, "numpy.from_numpy: like")
    return arr


def current_stream(device_id: int) -> int:
    """Returns 0: numpy has no stream (its work is done when the call returns)."""
    return 0


def wrap(array: DeviceMemoryArray) -> np.ndarray:
    """Returns a zero-copy numpy view of host memory; it keeps ``array.owner`` alive.

    Note:
        ``np.from_dlpack`` rejects bf16 and fp8 ("Unsupported dtype in DLTensor"), so this reads
        the capsule with our own reader, which maps them to ``ml_dtypes``.

    Raises:
        TypeError: the memory is not host memory.
    """
    _require_cpu(array.device_type, "numpy.wrap: array")
    return read_array(array, name="numpy.wrap: array").numpy()
