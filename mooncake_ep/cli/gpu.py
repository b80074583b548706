"""Whether the commands' GPU paths can run here: one answer for demo and bench."""

from __future__ import annotations


class GpuUnavailable(RuntimeError):
    """``--backend cuda`` where the GPU path cannot run (no device, no cupy, torch without CUDA): a
    failure of the machine, exit 1 with one line, not a usage error (2: flags that do not fit)."""


def choose_backend(requested: str) -> tuple[str, str]:
    """``(backend, why)`` for ``--backend``: ``reference`` where asked for; ``cuda`` where asked for
    (GpuUnavailable if it cannot run); for ``auto``, ``cuda`` where it can run, else ``reference``.
    ``why`` is the device's name, or what is missing."""
    if requested == "reference":
        return "reference", "asked for"
    usable, why = gpu_status()
    if requested == "cuda" and not usable:
        raise GpuUnavailable(f"--backend cuda: {why}")
    return ("cuda" if usable else "reference"), why


def gpu_status() -> tuple[bool, str]:
    """Whether cupy sees a CUDA device and torch can use it, and why (not).

    Returns:
        ``(usable, reason)``: the device's name when usable, else what is missing.
    """
    try:
        import cupy
    except ImportError:
        return False, "cupy is not installed (pip install 'mooncake_ep[cuda12]')"
    try:
        num_devices = cupy.cuda.runtime.getDeviceCount()
    except Exception:  # noqa: BLE001 - no driver and no device raise different errors; both mean none
        num_devices = 0
    if num_devices == 0:
        return False, "no CUDA device is visible"
    try:
        import torch
    except ImportError:
        return False, "the GPU path needs torch with CUDA, which is not installed"
    if not torch.cuda.is_available():
        return False, f"torch {torch.__version__} has no CUDA"
    return True, torch.cuda.get_device_name(0)
