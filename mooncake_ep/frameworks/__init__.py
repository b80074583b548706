"""Per-framework glue: allocate, convert and wrap arrays in the caller's framework.

Each module (``numpy``, ``torch``, ``jax``, ``cupy``) exposes the same four functions, and is
imported only by :func:`get`, so ``import mooncake_ep`` imports no framework:

- ``empty(shape, dtype, device_type, device_id)``: a new, uninitialised array.
- ``from_numpy(arr, like)``: an array of the framework holding ``arr``'s values, on ``like``'s
  device.
- ``current_stream(device_id) -> int``: the framework's current CUDA stream handle.
- ``wrap(array)``: the framework's array sharing a :class:`~mooncake_ep.tensor.DeviceMemoryArray`.

``torch`` also has ``empty_swapped(shape, strides, dtype, device_type, device_id)``: a new array laid
out with its last two dimensions swapped (``strides``), DeepEP's layout of the fp8 scales, which only
torch callers get.

The JAX ops (``jax_ops``, ``jax_split``, ``jax_args``) live here too, beside the JAX glue; they
are reached through :mod:`mooncake_ep.jax`, not through :func:`get`.

Example::

    view = read_array(x, name="dispatch: x")
    out = frameworks.get(view.framework).empty((n, hidden), "bfloat16", view.device_type,
                                               view.device_id)
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["FRAMEWORKS", "get"]

# ArrayView.framework -> module of this package. Unknown DLPack producers get numpy arrays,
# which serve CPU memory only.
_MODULES = {"numpy": "numpy", "torch": "torch", "jax": "jax", "cupy": "cupy", "dlpack": "numpy"}
FRAMEWORKS: tuple[str, ...] = tuple(_MODULES)
_LOADED: dict[str, ModuleType] = {}


def get(framework: str) -> ModuleType:
    """Returns the glue module of a framework, importing it (and the framework) on first use.

    Args:
        framework: an :attr:`~mooncake_ep.tensor.ArrayView.framework` value: ``"numpy"``,
            ``"torch"``, ``"jax"``, ``"cupy"``, or ``"dlpack"`` (served by numpy, CPU only).

    Raises:
        ValueError: ``framework`` is not one of :data:`FRAMEWORKS`.
    """
    loaded = _LOADED.get(framework)
    if loaded is not None:  # every call of dispatch/combine asks: skip the import machinery
        return loaded
    module = _MODULES.get(framework) if isinstance(framework, str) else None
    if module is None:
        raise ValueError(f"frameworks.get: framework must be one of {FRAMEWORKS}, "
                         f"got {framework!r}")
    loaded = _LOADED[framework] = importlib.import_module(f"{__name__}.{module}")
    return loaded
