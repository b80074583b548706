"""What every group implementation shares: :class:`GroupError`, the default timeout, argument checks.

Kept apart from ``group.py`` so that the TCP store (``_tcp_store.py``) and the adapters
(``_group_adapters.py``) can raise the same error and check arguments the same way without
importing ``group.py``, which imports them. Users import these names from :mod:`mooncake_ep.group`.
"""

from __future__ import annotations

import math
from typing import Any

# Seconds any rendezvous or collective waits for its peers; torch's TCPStore uses the same.
DEFAULT_TIMEOUT_S = 300.0


class GroupError(RuntimeError):
    """A group operation failed: a timeout, a missing or duplicate peer, a lost store, a broken group."""


# The public home of the error is mooncake_ep.group (tracebacks and pickles name it there).
GroupError.__module__ = "mooncake_ep.group"


def _check_int(where: str, name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{where}: {name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{where}: {name} must be >= {minimum}, got {value}")
    return value


def _check_rank(where: str, rank: Any, world_size: Any) -> tuple[int, int]:
    world_size = _check_int(where, "world_size", world_size, 1)
    rank = _check_int(where, "rank", rank, 0)
    if rank >= world_size:
        raise ValueError(f"{where}: rank must be in [0, world_size) = [0, {world_size}), got {rank}")
    return rank, world_size


def _check_timeout(where: str, timeout_s: Any) -> float:
    """Seconds > 0; ``math.inf`` waits forever."""
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)):
        raise TypeError(f"{where}: timeout_s must be a number of seconds, got {type(timeout_s).__name__}")
    if not timeout_s > 0:  # also refuses NaN
        raise ValueError(f"{where}: timeout_s must be > 0 seconds (math.inf waits forever), got {timeout_s}")
    return float(timeout_s)


def _wait_arg(timeout_s: float) -> float | None:
    """``timeout_s`` as the threading and socket APIs take it: None for math.inf (forever)."""
    return None if math.isinf(timeout_s) else timeout_s


def _check_port(where: str, port: Any, name: str = "master_port", minimum: int = 1) -> int:
    port = _check_int(where, name, port, minimum)
    if port > 0xFFFF:
        raise ValueError(f"{where}: {name} must be in [{minimum}, 65535], got {port}")
    return port


def _check_data(where: str, data: Any) -> bytes:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"{where}: data must be bytes, got {type(data).__name__}")
    return bytes(data)
