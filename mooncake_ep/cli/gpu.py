"""Whether the commands' GPU paths can run here: one answer for demo and bench."""

from __future__ import annotations


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
