"""The ``local`` transport: several ranks in one process, on one GPU or several.

Every rank's workspace is a plain device pointer valid in the whole process; ranks on different
devices need peer access, enabled here once per device pair.
"""

from __future__ import annotations

import struct

from mooncake_ep.transport.workspace import DeviceWorkspace, TransportError

_ENTRY = struct.Struct("<qq")  # (workspace address, device id)


def connect(group, workspace: DeviceWorkspace) -> list[int]:
    """Exchange workspace addresses through ``group``; return the route table (one address per rank).

    Raises:
        TransportError: two ranks' devices cannot access each other's memory.
    """
    import cupy

    entries = [_ENTRY.unpack(blob) for blob in group.allgather_bytes(_ENTRY.pack(workspace.ptr, workspace.device_id))]
    for peer_rank, (_, peer_device) in enumerate(entries):
        if peer_device == workspace.device_id:
            continue
        if not cupy.cuda.runtime.deviceCanAccessPeer(workspace.device_id, peer_device):
            raise TransportError(
                f"rank {group.rank} on cuda:{workspace.device_id} cannot access the memory of rank {peer_rank} "
                f"on cuda:{peer_device} (no peer access between these GPUs)"
            )
        with cupy.cuda.Device(workspace.device_id):
            try:
                cupy.cuda.runtime.deviceEnablePeerAccess(peer_device)
            except cupy.cuda.runtime.CUDARuntimeError as exc:
                if "PeerAccessAlreadyEnabled" not in str(exc):
                    raise TransportError(f"enabling peer access cuda:{workspace.device_id} -> cuda:{peer_device}: {exc}") from exc
    return [address for address, _ in entries]
