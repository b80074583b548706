"""The ``local`` transport: several ranks in one process, on one GPU or several.

Every rank's workspace is a plain device pointer valid in the whole process; ranks on different
devices need peer access, enabled here once per device pair.
"""

from __future__ import annotations

import struct

from mooncake_ep.transport.workspace import DeviceWorkspace, TransportError, failure_text, raise_if_any_failed

_ENTRY = struct.Struct("<qq")  # (workspace address, device id)


def connect(group, workspace: DeviceWorkspace, runtime=None) -> list[int]:
    """Exchange workspace addresses through ``group``; return the route table (one address per rank).

    Args:
        runtime: the CUDA runtime module (default ``cupy.cuda.runtime``; tests pass a fake).

    Raises:
        TransportError: two ranks' devices cannot access each other's memory, on every rank at once
            (a rank that could connect would otherwise keep routes to the workspaces the failing
            ranks free).
    """
    entries = [_ENTRY.unpack(blob) for blob in group.allgather_bytes(_ENTRY.pack(workspace.ptr, workspace.device_id))]
    failure = ""
    try:
        for peer_rank, (_, peer_device) in enumerate(entries):
            if peer_device != workspace.device_id:
                enable_peer_access(workspace.device_id, peer_device,
                                   f"cuda:{workspace.device_id} cannot access the memory of rank {peer_rank} on "
                                   f"cuda:{peer_device}", runtime)
    except Exception as exc:  # noqa: BLE001 - a runtime error too: every rank must hear of it
        failure = failure_text(exc)
    raise_if_any_failed(group, "Buffer (local transport): could not reach the peers' workspaces", failure)
    return [address for address, _ in entries]


def enable_peer_access(device_id: int, peer_device_id: int, refusal: str, runtime=None) -> None:
    """Let kernels on ``device_id`` dereference memory of ``peer_device_id`` (same process).

    Args:
        device_id, peer_device_id: CUDA ordinals in this process.
        refusal: the start of the error message, naming the two ranks and devices.
        runtime: the CUDA runtime module (default ``cupy.cuda.runtime``; tests pass a fake).

    Raises:
        TransportError: the devices have no peer access, or enabling it failed.
    """
    if runtime is None:
        import cupy

        runtime = cupy.cuda.runtime
    if not runtime.deviceCanAccessPeer(device_id, peer_device_id):
        raise TransportError(f"{refusal} (no peer access between these GPUs)")
    previous = runtime.getDevice()
    runtime.setDevice(device_id)  # peer access is enabled from the current device
    try:
        runtime.deviceEnablePeerAccess(peer_device_id)
    except runtime.CUDARuntimeError as exc:
        if "PeerAccessAlreadyEnabled" not in str(exc):
            raise TransportError(f"enabling peer access cuda:{device_id} -> cuda:{peer_device_id}: {exc}") from exc
    finally:
        runtime.setDevice(previous)
