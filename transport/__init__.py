"""Transports: how a kernel reaches another rank's workspace.

A transport fills the route table, one entry per rank: an address this rank's kernels can
dereference to reach that rank's workspace. ``local`` serves ranks of one process (one GPU or
several, with peer access); ``ipc`` and ``proxy`` fill the same table for other deployments.
"""

from mooncake_ep.transport.workspace import DeviceWorkspace, TransportError

__all__ = ["DeviceWorkspace", "TransportError"]
