"""JAX glue for eager CPU arrays through :class:`mooncake_ep.Buffer`. This module is
``mooncake_ep.frameworks.jax``; JAX is imported lazily.

JAX arrays are immutable, so nothing here allocates an output for a kernel to write on a GPU:
there, outputs are the buffers XLA hands to ``buffer_callback``, and the ops that do that are
:mod:`mooncake_ep.jax` (built in :mod:`mooncake_ep.frameworks.jax_ops`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from mooncake_ep.tensor import ArrayView, DeviceMemoryArray, numpy_dtype

if TYPE_CHECKING:
    import jax

__all__ = ["empty", "from_numpy", "current_stream", "wrap"]

_64_BIT_DTYPES = ("int64", "float64")


def _check_x64(dtype: str, where: str) -> None:
    # Without jax_enable_x64, JAX silently casts 64-bit arrays to 32 bits; we cast nothing.
    import jax

    if dtype in _64_BIT_DTYPES and not jax.config.jax_enable_x64:
        raise TypeError(f"{where} is {dtype}, which JAX would cast to 32 bits; enable "
                        f"jax.config.update('jax_enable_x64', True) or use a 32-bit dtype")


def _jax_device(device_type: str, device_id: int, where: str) -> Any:
    import jax

    if device_type == "cpu":
        return jax.devices("cpu")[0]
    if device_type == "cuda":
        for device in jax.local_devices(backend="gpu"):
            if device.local_hardware_id == device_id:
                return device
        raise ValueError(f"{where}: JAX has no local GPU with CUDA ordinal {device_id}")
    raise TypeError(f"{where} must be 'cuda' or 'cpu', got {device_type!r}")


def empty(shape: tuple[int, ...], dtype: str, device_type: str, device_id: int) -> np.ndarray:
    """Returns a numpy scratch array for a CPU output; turn it into JAX with :func:`from_numpy`.

    Raises:
        TypeError: ``device_type`` is ``"cuda"``: JAX GPU outputs come from XLA through
            ``buffer_callback`` (use ``mooncake_ep.jax``), or ``dtype`` is unknown.
    """
    if device_type != "cpu":
        raise TypeError(f"jax.empty: device_type must be 'cpu', got {device_type!r}; JAX arrays "
                        f"are immutable, GPU outputs are allocated by XLA (use mooncake_ep.jax)")
    return np.empty(shape, numpy_dtype(dtype))


def from_numpy(arr: np.ndarray, like: ArrayView) -> jax.Array:
    """Returns a JAX array with ``arr``'s values (a copy) on ``like``'s device.

    ``like`` of a JAX array on one device: that device (DLPack numbers every CPU device 0, and JAX
    has several of them: a call's results stay where its inputs are).

    Raises:
        TypeError: ``arr`` is 64-bit and ``jax_enable_x64`` is off, or its dtype is unknown.
    """
    import jax

    from mooncake_ep.tensor import read_array

    _check_x64(read_array(arr, name="jax.from_numpy: arr").dtype, "jax.from_numpy: arr")
    devices = like.obj.devices() if isinstance(like.obj, jax.Array) else ()
    if len(devices) == 1:
        return jax.device_put(arr, next(iter(devices)))
    return jax.device_put(arr, _jax_device(like.device_type, like.device_id, "jax.from_numpy: like"))


def current_stream(device_id: int) -> int:
    """JAX has no current stream: XLA names its stream only inside ``buffer_callback``.

    Raises:
        TypeError: always; JAX GPU arrays go through ``mooncake_ep.jax`` (which runs in XLA's
            stream), not through :class:`mooncake_ep.Buffer` methods.
    """
    raise TypeError(f"JAX arrays on cuda:{device_id} cannot be passed to Buffer.dispatch/combine: JAX has no "
                    f"current stream outside XLA; call mooncake_ep.jax.dispatch / mooncake_ep.jax.combine, "
                    f"which launch in XLA's stream (eagerly, or under jax.jit, with or without shard_map)")


def wrap(array: DeviceMemoryArray) -> jax.Array:
    """Returns ``jax.dlpack.from_dlpack(array, copy=False)``: a JAX array over the memory.

    Note:
        JAX imports without a copy only memory aligned as XLA wants (64 bytes on the CPU);
        ``copy=False`` makes it raise instead of copying silently. The memory must not change
        while the JAX array lives: JAX assumes its arrays are immutable.

    Raises:
        TypeError: ``array`` is 64-bit and ``jax_enable_x64`` is off.
        ValueError: the memory is not aligned for XLA.
    """
    import jax

    _check_x64(array.dtype, "jax.wrap: array.dtype")
    return jax.dlpack.from_dlpack(array, copy=False)
