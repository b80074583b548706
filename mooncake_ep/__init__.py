"""mooncake_ep: expert-parallel dispatch and combine for Mixture-of-Experts models.

Mooncake EP / DeepEP's low-latency programming model, with CUDA kernels compiled at run time by
NVRTC, one DLPack-based implementation for torch, JAX and cupy callers, and fault tolerance that
masks a dead rank instead of hanging. ``import mooncake_ep`` needs neither a GPU nor torch or JAX.
"""

__version__ = "0.1.0"

from mooncake_ep._handshake import RankMismatchError
from mooncake_ep.buffer import Buffer, EventOverlap, Handle
from mooncake_ep.group import Group, GroupError, LocalGroup, init_group
from mooncake_ep.kernels import KernelCompileError
from mooncake_ep.transport import TransportError

__all__ = [
    "Buffer",
    "EventOverlap",
    "Group",
    "GroupError",
    "Handle",
    "KernelCompileError",
    "LocalGroup",
    "RankMismatchError",
    "TransportError",
    "__version__",
    "init_group",
]
