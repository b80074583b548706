"""What every group implementation shares: the errors, argument checks, and collectives over a store.

Kept apart from ``group.py`` so that the TCP store (``_tcp_store.py``) and the adapters
(``_group_adapters.py``) raise the same errors, check arguments the same way and run the same
collective protocol without importing ``group.py``, which imports them. Users import the public
names (:class:`GroupError`, :class:`StoreTimeoutError`) from :mod:`mooncake_ep.group`.

:class:`_KeyValueGroup` is that protocol: every group whose peers meet in a key-value store with
blocking waits (our TCP store, a ``torch.distributed.Store``, ``jax.distributed``'s key-value
client) gets its allgather, barrier, rendezvous and error messages from it.
"""

from __future__ import annotations

import logging
import math
import struct
import threading
from collections import Counter
from collections.abc import Sequence
from typing import Any

logger = logging.getLogger("mooncake_ep")

# Seconds any rendezvous or collective waits for its peers; torch's TCPStore uses the same.
DEFAULT_TIMEOUT_S = 300.0


class GroupError(RuntimeError):
    """A group operation failed: a timeout, a missing or duplicate peer, a lost store, a broken group."""


class _StoreWaitError(GroupError):
    """A store wait ended with keys still missing; ``missing_keys`` lists them in asked order."""

    # How a collective cut short by this error says so: "<call> {cut_short} waiting for ranks [...]".
    cut_short = "was cut short by the store"

    def __init__(self, message: str, missing_keys: list[str]) -> None:
        super().__init__(message)
        self.missing_keys = missing_keys


class StoreTimeoutError(_StoreWaitError):
    """A store wait ran out of time.

    Attributes:
        missing_keys: the keys still absent when the wait gave up, in the order they were asked for.
    """


# The public home of these errors is mooncake_ep.group (tracebacks and pickles name them there).
GroupError.__module__ = StoreTimeoutError.__module__ = "mooncake_ep.group"


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


# ----------------------------------------------------------------------------- collectives over a store

# Bumped whenever the store protocol or the collective framing changes; ranks must agree.
_PROTOCOL_VERSION = 1
_U8, _U32 = struct.Struct("!B"), struct.Struct("!I")
# First byte of every value a collective publishes, so ranks that call different collectives
# in the same round are caught instead of reading each other's payloads.
_TAGS = {"init_group": 0, "allgather_bytes": 1, "barrier": 2, "close": 3}


class _KeyValueGroup:
    """Collectives of one rank over a key-value store that all ranks reach.

    Construction ends in :meth:`_rendezvous`: the rank claims ``{namespace}claim/{rank}`` (a second
    process with the same rank is refused) and all ranks exchange (protocol version, world_size).
    Every collective then publishes ``{namespace}c/{seq}/{rank}`` for a per-call sequence number
    ``seq`` and waits for the other ranks' keys of the same ``seq``, so consecutive calls never
    mix. Each rank deletes its key of call ``seq - 1`` once call ``seq`` completes (all peers have
    read it by then), so the store stays small.

    A subclass sets ``rank``, ``world_size``, ``device``, calls :meth:`_init_collectives`, and
    provides the store operations ``_kv_set``, ``_kv_add``, ``_kv_multi_get`` (raises
    :class:`_StoreWaitError` naming the missing keys), ``_kv_delete``, and ``_where`` (the store
    in words, for error messages).

    Note:
        After any :class:`GroupError` from a collective the group is broken: the ranks no longer
        agree on the sequence number, so every later call raises at once. Make a new group.
    """

    is_in_process = False
    rank: int
    world_size: int
    device: int | None
    # Keys of this group are prefixed with it, so several groups can share one store.
    _namespace = ""
    # Said when two processes claim the same rank.
    _same_rank_hint = "every process needs its own RANK"

    def _init_collectives(self, timeout_s: float) -> None:
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._seq = 0
        self._num_calls: Counter[str] = Counter()
        self._broken: str | None = None
        self._closed = False

    # --- the store, provided by the subclass

    def _kv_set(self, key: str, value: bytes) -> None:
        raise NotImplementedError

    def _kv_add(self, key: str, amount: int) -> int:
        raise NotImplementedError

    def _kv_multi_get(self, keys: Sequence[str], timeout_s: float) -> list[bytes]:
        raise NotImplementedError

    def _kv_delete(self, key: str) -> None:
        raise NotImplementedError

    def _where(self) -> str:
        raise NotImplementedError

    def _shutdown(self, drain_s: float) -> None:
        """Release the store once the group is closed; ``drain_s``: seconds peers may still need it."""

    # --- the Group protocol

    @property
    def timeout_s(self) -> float:
        """Seconds each collective waits for its peers before raising GroupError."""
        return self._timeout_s

    @timeout_s.setter
    def timeout_s(self, value: float) -> None:
        self._timeout_s = _check_timeout(f"{type(self).__name__}.timeout_s", value)

    def __enter__(self):
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc_info: object) -> None:
        # Leaving on an exception: the peers may never reach the final barrier, so skip it.
        self.close(final_barrier=exc_type is None)

    def allgather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank's ``data``, in rank order (lengths may differ between ranks).

        Raises:
            TypeError: ``data`` is not bytes-like.
            GroupError: some ranks did not call within ``timeout_s`` (they are named), the
                store is gone, or the group is broken or closed.
        """
        return self._collective("allgather_bytes", _check_data("allgather_bytes", data))

    def barrier(self) -> None:
        """Return once every rank has entered; raises GroupError as :meth:`allgather_bytes`."""
        self._collective("barrier", b"")

    def close(self, *, final_barrier: bool = True) -> None:
        """Leave the group and release what it holds of the store. Idempotent.

        Args:
            final_barrier: first wait (up to ``timeout_s``) for every rank to close, so no rank
                takes the store away under a peer still in its last call. A failed final
                barrier is logged and the group closes anyway.
        """
        if self._closed:
            return
        drain_s = 0.0
        if final_barrier and self.world_size > 1 and self._broken is None:
            try:
                self._collective("close", b"")
                drain_s = self._timeout_s
            except GroupError as exc:
                logger.warning("%s.close: rank %d: final barrier failed, closing anyway: %s",
                               type(self).__name__, self.rank, exc)
        self._closed = True
        self._shutdown(drain_s)

    # --- the protocol

    def _rendezvous(self) -> None:
        if self._kv_add(f"{self._namespace}claim/{self.rank}", 1) > 1:
            raise GroupError(f"init_group: rank {self.rank} joined the store ({self._where()}) twice; "
                             f"{self._same_rank_hint}")
        hello = _U32.pack(_PROTOCOL_VERSION) + _U32.pack(self.world_size)
        replies = self._collective("init_group", hello)
        if len(set(replies)) > 1:
            seen = {r: tuple(struct.unpack("!II", v)) for r, v in enumerate(replies)}
            raise GroupError(f"init_group: ranks disagree on (protocol version, world_size): {seen}")

    def _collective(self, name: str, data: bytes) -> list[bytes]:
        with self._lock:
            label = f"{name} #{self._num_calls[name]}"
            self._num_calls[name] += 1
            if self._closed:
                raise GroupError(f"{label}: the group is closed")
            if self._broken is not None:
                raise GroupError(f"{label}: the group is broken by an earlier failure ({self._broken}); "
                                 f"make a new group")
            if self.world_size == 1:
                return [data]
            seq, self._seq = self._seq, self._seq + 1
            keys = [f"{self._namespace}c/{seq}/{r}" for r in range(self.world_size)]
            try:
                self._kv_set(keys[self.rank], _U8.pack(_TAGS[name]) + data)
                values = self._kv_multi_get(keys, self._timeout_s)
                if seq > 0:
                    self._kv_delete(f"{self._namespace}c/{seq - 1}/{self.rank}")
            except _StoreWaitError as exc:
                missing = sorted(int(k.rsplit("/", 1)[1]) for k in exc.missing_keys)
                what = (f"timed out after {self._timeout_s} s" if isinstance(exc, StoreTimeoutError)
                        else exc.cut_short)
                self._broken = (f"{label} {what} waiting for ranks {missing} of {self.world_size} "
                                f"({self._where()})")
                raise GroupError(self._broken) from None
            except GroupError as exc:
                self._broken = f"{label} on rank {self.rank} failed: {exc}"
                raise GroupError(self._broken) from exc
            names = {_U8.pack(tag): n for n, tag in _TAGS.items()}
            odd = {r: names.get(v[:1], "?") for r, v in enumerate(values) if v[:1] != _U8.pack(_TAGS[name])}
            if odd:
                self._broken = (f"{label}: ranks called other collectives in the same round {odd}; "
                                f"every rank must make the same sequence of collective calls")
                raise GroupError(self._broken)
            return [v[1:] for v in values]
