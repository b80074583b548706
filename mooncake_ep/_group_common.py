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

import functools
import logging
import numbers
import os
import struct
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from mooncake_ep._handshake import RankMismatchError, by_rank

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

    def __reduce__(self):  # pickled with its attributes (the default passes the message alone)
        return type(self), (str(self), self.missing_keys)


class StoreTimeoutError(_StoreWaitError):
    """A store wait ran out of time.

    Attributes:
        missing_keys: the keys still absent when the wait gave up, in the order they were asked for.
        extended: why the wait went on past its timeout, in words for a message (" (and longer: ...)"),
            or "" where it did not.
    """

    def __init__(self, message: str, missing_keys: list[str], extended: str = "") -> None:
        super().__init__(message, missing_keys)
        self.extended = extended

    def __reduce__(self):
        return type(self), (str(self), self.missing_keys, self.extended)


class StoreHoldersGoneError(_StoreWaitError):
    """A store wait ended early: the holders of some missing keys are gone (their claims went with
    their connections: the processes exited or died), so no one will set those keys.

    Attributes:
        missing_keys: the keys still absent, in asked order.
        gone_keys: those among them whose holders are gone.
    """

    cut_short = "ended early"

    def __init__(self, message: str, missing_keys: list[str], gone_keys: list[str]) -> None:
        super().__init__(message, missing_keys)
        self.gone_keys = gone_keys

    def __reduce__(self):
        return type(self), (str(self), self.missing_keys, self.gone_keys)


class _StoreStalledError(GroupError):
    """A store wait's reply did not begin within its limit: rank 0's process, which serves the store,
    stalled (the connection stays: TCPStoreClient reads the late reply before its next request)."""


class _PeerAbortedError(GroupError):
    """Raised in a LocalGroup rank whose wait was cut short because another rank failed (LocalGroup.spawn
    then raises that rank's own error, so callers of a collective let this one through as it is)."""


# The public home of these errors is mooncake_ep.group (tracebacks and pickles name them there).
GroupError.__module__ = StoreTimeoutError.__module__ = StoreHoldersGoneError.__module__ = "mooncake_ep.group"


def _check_int(where: str, name: str, value: Any, minimum: int) -> int:
    """``value`` as a Python int, if it is an integer (numpy's too: they register as Integral) >= minimum."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{where}: {name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{where}: {name} must be >= {minimum}, got {value}")
    return int(value)


def _check_rank(where: str, rank: Any, world_size: Any) -> tuple[int, int]:
    world_size = _check_int(where, "world_size", world_size, 1)
    rank = _check_int(where, "rank", rank, 0)
    if rank >= world_size:
        raise ValueError(f"{where}: rank must be in [0, world_size) = [0, {world_size}), got {rank}")
    return rank, world_size


def _check_timeout(where: str, timeout_s: Any) -> float:
    """Seconds > 0, as a float (a numpy scalar too, as every integer argument takes numpy's);
    ``math.inf`` waits forever (so does anything from 1e8 s on, see :func:`_wait_arg`)."""
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, numbers.Real):  # numpy's bool is no Real
        raise TypeError(f"{where}: timeout_s must be a number of seconds, got {type(timeout_s).__name__}")
    timeout_s = float(timeout_s)
    if not timeout_s > 0:  # also refuses NaN
        raise ValueError(f"{where}: timeout_s must be > 0 seconds (math.inf waits forever), got {timeout_s}")
    return timeout_s


# Waits at least this long are forever: socket and lock timeouts overflow a little above 1e9 s.
_FOREVER_FROM_S = 1e8


def _wait_arg(timeout_s: float) -> float | None:
    """``timeout_s`` as the threading and socket APIs take it: None (forever) for math.inf, and for
    waits of 1e8 s (three years) or more, which those APIs cannot hold."""
    return None if timeout_s >= _FOREVER_FROM_S else timeout_s


def _check_port(where: str, port: Any, name: str = "master_port", minimum: int = 1) -> int:
    port = _check_int(where, name, port, minimum)
    if port > 0xFFFF:
        raise ValueError(f"{where}: {name} must be in [{minimum}, 65535], got {port}")
    return port


def _check_data(where: str, data: Any, name: str = "data") -> bytes:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"{where}: {name} must be bytes, got {type(data).__name__}")
    return bytes(data)


# ----------------------------------------------------------------------------- collectives over a store

# Bumped whenever the store protocol or the collective framing changes; ranks must agree.
# 2: membership epochs (renew_membership) and rank claims held by the store connection.
# 3: the store's request and reply lengths are u64 (a reply of every rank's value passed 4 GiB).
# 4: a store connection opens with a hello (magic, version), so a mismatch is named, not misread.
# 5: rank 0 publishes its init hello under {namespace}init/world_size, which every other rank reads first.
# 6: the TCP store's rendezvous slots are claims, settled by the round or withdrawn by a failed wait, and
#    stay as the record of who joined (a wait's flag that withdraws the waiter's claims).
# 7: on stores without claims (torch's, JAX's) each attempt of a renewal round is decided once, by the first
#    rank to create e{epoch}/a{attempt}/decision: complete (the count of joins reached world_size) or failed.
# 8: a TCP store wait can name each key's holder claim, and ends at once when a missing key's holder is
#    gone (a collective fails fast on a dead rank instead of waiting out timeout_s).
# 9: on stores without claims (torch's, JAX's) rank 0 leads each join attempt: it numbers it from
#    {prefix}/generation (no more per-rank group counters {prefix}/groups/{rank}, which drifted apart after
#    one rank's failed attempt), the others follow it, and the attempt is decided once under
#    {prefix}/{n}/decision: complete by rank 0, failed by the first rank to give up, superseded by the
#    next attempt's rank 0 (_group_join).
_PROTOCOL_VERSION = 9
# The key a store with claims sets, in the same step, beside a claimed key that a failed wait withdrew:
# a rank that came to a round and left is told from one that never came.
WITHDRAWN_SUFFIX = ":withdrawn"
_U8 = struct.Struct("!B")
# What each rank shows the others when it joins (the init_group round, and rank 0's init/world_size key):
# protocol version, world_size.
_INIT = struct.Struct("!II")
# First byte of every value a collective publishes, so ranks that call different collectives
# in the same round are caught instead of reading each other's payloads.
_TAGS = {"init_group": 0, "allgather_bytes": 1, "barrier": 2, "close": 3}
_TAG_BYTES = {name: _U8.pack(tag) for name, tag in _TAGS.items()}
_TAG_NAMES = {tag: name for name, tag in _TAG_BYTES.items()}


def _ranks_of(keys: Sequence[str]) -> list[int]:
    """The ranks, ascending, of per-rank keys (``.../{rank}``): a wait's missing or gone slots."""
    return sorted(int(key.rsplit("/", 1)[1]) for key in keys)


def _slot_value(name: str, data: bytes) -> bytes:
    """What a rank stores in its slot of a round of the collective ``name``: the tag, then ``data``."""
    return _TAG_BYTES[name] + data


def _slot_data(value: bytes) -> bytes:
    """The data of a slot's value (:func:`_slot_value`), without its tag."""
    return value[1:]

# A renew_membership value: protocol version, world_size, and whether the sender is a process that
# just took over its rank (a replacement).
_JOIN = struct.Struct("!IIB")
# How long a replacement looks at a renew_membership round to tell whether it already completed.
_PROBE_S = 0.05
# The two decisions of an attempt of a counted renewal round (_counted_round).
_ROUND_COMPLETE, _ROUND_FAILED = b"complete", b"failed"
# A rank 0 whose store closes when it raises, having failed to join its group, keeps the store up
# for the ranks connected to it to hang up at most this long (and at most its timeout_s), so that
# those whose own wait ends meanwhile raise their own error, not "store closed". When it found ranks
# started with another world_size it first waits as long, within its rendezvous's deadline, for the
# ranks beyond its own world_size that a larger one says exist, which may still be starting, to
# come and read why (instead of finding no store). Both delay rank 0's error.
_MISMATCH_GRACE_S = 30.0


# What this process shares with a child it forks and the child must let go of (the store groups,
# their servers and clients): each one's _forget_after_fork runs in the child.
_SHARED_WITH_CHILDREN: weakref.WeakSet = weakref.WeakSet()


def _forget_after_fork_in_children(shared: Any) -> None:
    """Have ``shared._forget_after_fork()`` run in every child this process forks from now on."""
    _SHARED_WITH_CHILDREN.add(shared)


def _forget_everything_after_fork() -> None:
    for shared in list(_SHARED_WITH_CHILDREN):
        shared._forget_after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_everything_after_fork)


def _init_mismatch(pairs: dict[int, tuple[int, int]]) -> str | None:
    """What the ranks' (protocol version, world_size) ``pairs`` disagree on, in words; None if nothing."""
    pairs = dict(sorted(pairs.items()))
    sizes = {r: size for r, (_, size) in pairs.items()}
    versions = {r: version for r, (version, _) in pairs.items()}
    problems = []
    if len(set(sizes.values())) > 1:
        outside = [r for r in sizes if 0 in sizes and r >= sizes[0]]
        beyond = (f", and {'rank' if len(outside) == 1 else 'ranks'} {', '.join(map(str, outside))} "
                  f"{'is' if len(outside) == 1 else 'are'} outside rank 0's group of {sizes[0]}" if outside else "")
        problems.append(f"ranks disagree on world_size ({by_rank(sizes)}){beyond}: start every rank with the "
                        f"same world_size (WORLD_SIZE)")
    if len(set(versions.values())) > 1:
        problems.append(f"ranks disagree on the store protocol ({by_rank(versions)}): every rank must run the "
                        f"same mooncake_ep version")
    return "; ".join(problems) or None


class _KeyValueGroup:
    """Collectives of one rank over a key-value store that all ranks reach.

    Construction ends in :meth:`_rendezvous`: the rank claims its rank (:meth:`_claim_rank`; a
    second process with the same rank is refused) and all ranks exchange (protocol version,
    world_size). (The groups over torch's and JAX's stores, which outlive the attempts made on them,
    join in attempts that rank 0 leads, then read the same round: ``_group_join``.) Rank 0 publishes
    its pair first, under ``{namespace}init/world_size`` (kept), and every other rank reads it before
    it claims its rank: a rank started with another world_size, or
    with a rank outside rank 0's group, raises :class:`RankMismatchError` at once. Every collective
    then publishes ``{namespace}c/{seq}/{rank}`` for a per-call
    sequence number ``seq`` and waits for the other ranks' keys of the same ``seq``, so
    consecutive calls never mix. Each rank deletes its key of call ``seq - 1`` once call ``seq``
    completes (all peers have read it by then), so the store stays small; its key of the
    rendezvous stays (:meth:`_first_slot_key`).

    Membership epochs: :meth:`renew_membership` is a round in which every rank publishes
    ``{namespace}e{epoch}/join/{rank}`` for the next epoch and waits for all of them (on a store
    without claims, ``{namespace}e{epoch}/a{attempt}/join/{rank}``, each attempt decided once by a
    create-if-absent key: :meth:`_counted_round`), and which completes for every rank or for none; the round
    then starts that epoch, whose collectives use ``{namespace}e{epoch}/c/{seq}/{rank}`` from
    ``seq = 0``. Epoch 0 is the one the rendezvous starts (its keys carry no ``e0/``). A process
    that takes over the rank of a dead one (``TCPGroup(..., rejoin=True)``) joins the next round
    directly, so the survivors, wherever their sequence numbers were (even in a broken group),
    and the newcomer continue in step. A round's keys go once the next round completes (every rank
    has left it then), and once a round a replacement joined completes, rank 0 deletes what the dead
    process left of the epoch before (:meth:`_predecessor_keys`), so the store stays the same size
    however often the ranks renew or are replaced.

    A subclass sets ``rank``, ``world_size``, ``device``, calls :meth:`_init_collectives`, and
    provides the store operations ``_kv_set``, ``_kv_add``, ``_kv_multi_get`` (raises
    :class:`_StoreWaitError` naming the missing keys), ``_kv_delete``, and ``_where`` (the store
    in words, for error messages).

    Note:
        After any :class:`GroupError` from a collective (or anything else that stopped one) the
        group is broken: the ranks no longer agree on the sequence number, so every later call
        raises at once, until every rank calls :meth:`renew_membership` (which
        ``Buffer.update_ep_member`` does), or make a new group. A rank whose own store connection
        was lost (a request interrupted midway, a store that stopped answering) cannot renew: its
        process is then as a dead rank's, and a replacement (``rejoin=True``) takes its rank over.
    """

    # Whether a process can take a dead rank over (init_group(rejoin=True)): only the TCP store's claims
    # let a replacement's join be withdrawn with its process (TCPGroup sets it).
    _takes_replacements = False

    is_in_process = False
    rank: int
    world_size: int
    device: int | None
    # Keys of this group are prefixed with it, so several groups can share one store.
    _namespace = ""
    # Said when two processes claim the same rank.
    _same_rank_hint = "every process needs its own RANK"
    # Whether the store closes when rank 0 gives up (the TCP store, which rank 0 serves).
    _store_closes_with_rank0 = False

    def _init_collectives(self, timeout_s: float) -> None:
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._epoch = 0
        self._is_replacement = False  # until the first renew_membership of a rejoining process
        # What this rank deletes of its last completed renewal round once the next one completes (every
        # rank has left it then): its join, and on a store without claims its joins of the round's failed
        # attempts, and, on rank 0, each attempt's count, decision and decided (_counted_round_keys).
        self._spent_round_keys: list[str] = []
        # The mark a failed wait of this rank's current renewal round left beside its join (a store with
        # claims: WITHDRAWN_SUFFIX), which nobody reads once the round completes.
        self._withdrawn_join_key: str | None = None
        # (epoch, attempt, counted there) of this rank's counted renewal round (_counted_round)
        self._round_attempt: tuple[int, int, bool] = (0, 0, False)
        self._seq = 0
        self._num_calls: Counter[str] = Counter()
        self._broken: str | None = None
        self._closed = False
        self._closed_because = "the group is closed"
        self._largest_world_seen = 0  # in the rendezvous, when the ranks disagree on world_size
        _forget_after_fork_in_children(self)

    def _forget_after_fork(self) -> None:
        """In a forked child: the group is the parent's rank. A parent thread may have held the lock
        at the fork (a collective holds it for its whole wait), so the child gets a new one, and
        every call of the child raises at once instead of waiting on it."""
        self._lock = threading.Lock()
        self._closed = True
        self._closed_because = (f"the group is rank {self.rank}'s of process {os.getppid()}, and this process "
                                f"was forked from it; a child makes its own group")

    # --- the store, provided by the subclass

    def _kv_set(self, key: str, value: bytes) -> None:
        raise NotImplementedError

    def _kv_add(self, key: str, amount: int) -> int:
        raise NotImplementedError

    def _kv_multi_get(self, keys: Sequence[str], timeout_s: float, reply_bytes: int = 0,
                      settle: bool = False, holders: Sequence[str] | None = None) -> list[bytes]:
        """The keys' values once all are set (within ``timeout_s``); ``reply_bytes``: about how many
        bytes they hold, for a store whose transfers count against its time limits; ``settle``: a
        round that completes for every rank or for none: once all keys are there, those set by
        :meth:`_kv_set_while_connected` stay from then on, and if the wait fails, this process's
        own such keys among them are removed in the same step (where the store has claims);
        ``holders``: per key, the claim of the process that sets it (:meth:`_holder_keys`): where the
        store has claims, the wait ends early once a missing key's holder is gone."""
        raise NotImplementedError

    def _holder_keys(self) -> list[str] | None:
        """Per rank, the claim its process of the current epoch holds for as long as it lives, where
        the store has claims; None elsewhere (a collective then waits out its timeout for a dead rank)."""
        return None

    def _hold_alive(self, epoch: int) -> None:
        """Make this process's claim of :meth:`_holder_keys` for ``epoch``, where the store has claims."""

    def _release_alive(self, epoch: int) -> None:
        """End this process's claim of :meth:`_holder_keys` for ``epoch`` (held since :meth:`_hold_alive`),
        once a later epoch's round has completed: every rank has left ``epoch``'s collectives then."""

    def _kv_create(self, key: str, value: bytes) -> bytes:
        """Set ``key`` to ``value`` unless it is set: the value the key holds then, the first creator's
        (a store without claims decides a renewal round's attempt with it)."""
        raise NotImplementedError

    def _kv_set_while_connected(self, key: str, value: bytes) -> bool:
        """Set ``key`` for as long as this process's store connection lives, where the store can
        (the TCP store's claims; False, setting nothing, if the key exists); elsewhere a plain set."""
        self._kv_set(key, value)
        return True

    def _kv_delete(self, key: str) -> None:
        raise NotImplementedError

    def _max_value_bytes(self) -> int | None:
        """The most bytes the store holds in one value; None where no limit is known."""
        return None

    def _where(self) -> str:
        raise NotImplementedError

    def _shutdown(self, drain_s: float) -> None:
        """Release the store once the group is closed; ``drain_s``: seconds peers may still need it."""

    def _claim_rank(self, first_slot: bytes) -> bool:
        """Refuse a second process with this rank (:meth:`_rendezvous`'s; the stores without claims
        join otherwise, claiming a rank in each join attempt: ``_group_join``).

        Returns whether this also wrote ``first_slot``, this rank's value of the rendezvous round,
        as a claim (the TCP store); else the round writes it.
        """
        raise NotImplementedError

    # --- the Group protocol

    @property
    def membership_epoch(self) -> int:
        """How many :meth:`renew_membership` rounds this group has completed (0 after joining;
        a replacement starts at the epoch it joined)."""
        return self._epoch

    @property
    def broken(self) -> str | None:
        """Why the group's collectives refuse to run until :meth:`renew_membership` (a collective
        that failed); None while the group is sound."""
        return self._broken

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
            ValueError: ``data`` is larger than the store holds in one value (the TCP store: 4 GiB,
                less the collective's tag byte); raised before the round starts, so every rank's
                next call still meets the others'.
            GroupError: some ranks did not call within ``timeout_s`` (they are named; on the TCP
                store, one whose process exited or died is named at once), the store is gone, or
                the group is broken or closed.
        """
        data = _check_data("allgather_bytes", data)
        # Checked here, not left to the store: its refusal came inside the round, after this rank's
        # sequence number had moved on, which broke the group (the peers timed out waiting for this rank).
        limit, tag = self._max_value_bytes(), len(_TAG_BYTES["allgather_bytes"])
        if limit is not None and len(data) > limit - tag:
            raise ValueError(f"allgather_bytes: data must be at most {limit - tag} bytes (what a "
                             f"{type(self).__name__}'s store holds in one value, less the collective's tag byte), "
                             f"got {len(data)} bytes")
        return self._collective("allgather_bytes", data)

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

    def renew_membership(self) -> list[int]:
        """Start the next membership epoch with every rank as it is now (collective).

        Every rank must call it, the survivors of a failure and any process that took over the
        rank of a dead one (which calls it while joining, in ``TCPGroup(..., rejoin=True)``). It
        returns once all ``world_size`` ranks have arrived; the collectives of the new epoch then
        start from a clean sequence, so this also repairs a group broken by a failed collective.
        ``Buffer.update_ep_member`` calls it.

        Returns:
            The ranks held by a replacement process that joined in this round, ascending (empty
            when the membership did not change).

        Raises:
            GroupError: some ranks did not arrive within ``timeout_s`` (they are named; a dead
                rank needs a replacement process, started with ``init_group(rejoin=True)``),
                ranks disagree on the protocol version or world_size, the store is gone, or the
                group is closed. A timeout leaves the group as it was: every rank may call again.
        """
        return self._renew(self._timeout_s)

    def _renew(self, wait_s: float) -> list[int]:
        """:meth:`renew_membership`, waiting ``wait_s`` for the other ranks."""
        with self._lock:
            label = f"renew_membership #{self._num_calls['renew_membership']}"
            self._num_calls["renew_membership"] += 1
            if self._closed:
                raise GroupError(f"{label}: {self._closed_because}")
            epoch = self._epoch + 1
            if self.world_size == 1:
                self._epoch, self._seq, self._broken = epoch, 0, None
                return []
            keys = [f"{self._namespace}e{epoch}/join/{r}" for r in range(self.world_size)]
            mine = _JOIN.pack(_PROTOCOL_VERSION, self.world_size, self._is_replacement)
            came = [f"{self._namespace}e{epoch}/came/{r}" for r in range(self.world_size)]
            try:
                self._hold_alive(epoch)
                if not self._is_replacement:
                    # Held while this process lives where the store can (a retry finds its own: refused,
                    # and kept): the peers' errors tell a rank that gave up from one whose process died.
                    self._kv_set_while_connected(came[self.rank], b"")
                # A round completes for every rank or for none. (A survivor's join left by a failed wait
                # let a late peer complete the round alone: the two split epochs, and a later renewal
                # paired one's round with the other's leftover slots.)
                round_keys = [keys[self.rank]]
                if not self._takes_replacements:
                    values, last_attempt = self._counted_round(epoch, mine, wait_s)
                    round_keys = self._counted_round_keys(epoch, last_attempt)
                # On the TCP store every rank's join, a survivor's too, is held while this process lives
                # (its claims): one that dies joins nobody, and one whose wait fails takes it with it in
                # the same step.
                elif not self._kv_set_while_connected(keys[self.rank], mine):
                    if self._is_replacement:
                        raise GroupError(f"init_group(rejoin=True): another process joins the running ranks as "
                                         f"rank {self.rank} ({self._where()}): only one replacement per rank")
                    raise GroupError(f"{label} (epoch {epoch}): rank {self.rank}'s join of this round is held by "
                                     f"another process ({self._where()})")
                else:
                    # Settled once complete: a rank that exits or dies after the round must still count as
                    # joined for a peer whose wait is on its way (else the ranks split epochs).
                    values = self._kv_multi_get(keys, wait_s, settle=True)
            except _StoreWaitError as exc:
                if self._takes_replacements:  # the store took this rank's join back, leaving its mark
                    self._withdrawn_join_key = keys[self.rank] + WITHDRAWN_SUFFIX
                missing = _ranks_of(exc.missing_keys)
                # Survivors that came to this round and gave up first (their joins withdrawn) are not
                # what the round waits for: the ranks that never came are named, those after them.
                gave_up = self._present({came[r]: r for r in missing if r != self.rank}) or {}
                gave_up = sorted(r for r, _ in gave_up.values())
                if self._takes_replacements and gave_up:
                    # Came is held while the process lives: one that has just come, its wait running,
                    # holds its join too; one that gave up took its join away (helper-146).
                    waiting = {rank for rank, _ in (self._present({keys[r]: r for r in gave_up}) or {}).values()}
                    gave_up = [r for r in gave_up if r not in waiting]
                left = (f"; ranks {gave_up} came and gave up first: every rank calls Buffer.update_ep_member() "
                        f"(or group.renew_membership()) again"
                        if gave_up else "")
                if len(gave_up) < len(missing):
                    missing = [r for r in missing if r not in gave_up]
                # A replacement's wait is what its join left of timeout_s: the whole join timed out.
                what = self._wait_failure(exc)
                if self._is_replacement:
                    hint = "the running ranks join it through Buffer.update_ep_member() or group.renew_membership()"
                elif self._takes_replacements:
                    hint = ("a rank whose process died needs a replacement: start one with "
                            "init_group(rank=..., rejoin=True)")
                else:  # torch and JAX stores: no process can take a rank over
                    hint = ("every rank must call Buffer.update_ep_member() (or group.renew_membership()) again, or, "
                            "where a rank's process died, the job "
                            "builds a new group (only TCPGroup takes a replacement process, init_group(rejoin=True))")
                # No join missing: in a counted round, every rank had come but not every count was in.
                waiting_for = (f"ranks {missing} of {self.world_size}" if missing else
                               f"the counts of {self.world_size} ranks (every rank's join had come)")
                raise GroupError(f"{label} (epoch {epoch}) {what} waiting for {waiting_for} ({self._where()}); "
                                 f"{hint}{left}") from None
            joins = [_JOIN.unpack(v) for v in values]
            if len({(version, size) for version, size, _ in joins}) > 1:
                seen = {r: (version, size) for r, (version, size, _) in enumerate(joins)}
                raise GroupError(f"{label}: ranks disagree on (protocol version, world_size): {seen}")
            # Every rank has come to this round, so every peer has left the old epoch's collectives: its
            # last slot goes, and, where a call failed (it broke the group), the one before it too, which
            # a peer may still have been reading then (a call that completes deletes it).
            spent_keys = [self._collective_key(seq, self.rank)
                          for seq in range(max(self._seq - (1 if self._broken is None else 2), 0), self._seq)]
            replaced = [r for r, (_, _, was_replaced) in enumerate(joins) if was_replaced]
            # Rank 0 is never replaced, and was in the epoch left: it deletes what the dead processes left.
            predecessor_keys = self._predecessor_keys(replaced) if self.rank == 0 else []
            old_epoch, was_replacement = self._epoch, self._is_replacement
            self._epoch, self._seq, self._broken = epoch, 0, None
            self._is_replacement = False
            # The round has completed for every rank: from here on nothing raises (a rank told its round
            # failed would renew again, alone, while its peers went on in the new epoch). What fails is
            # logged: a key left behind, or an epoch key that the other ranks set too.
            # Where a later replacement looks for the round to join (see _join_as_replacement).
            self._after_round(self._kv_set, f"{self._namespace}epoch", str(epoch).encode())
            for key in spent_keys:
                self._after_round(self._delete_spent_slot, key)
            for key in predecessor_keys:
                self._after_round(self._kv_delete, key)
            if not was_replacement:  # (a replacement never held the old epoch's: its dead process's went with it)
                self._after_round(self._release_alive, old_epoch)
            for key in self._spent_round_keys:  # every rank has finished the round before this one:
                self._after_round(self._kv_delete, key)  # nobody reads its keys
            self._spent_round_keys = round_keys
            if self._withdrawn_join_key is not None:
                self._after_round(self._kv_delete, self._withdrawn_join_key)
                self._withdrawn_join_key = None
            if epoch > 1:
                self._after_round(self._kv_delete, f"{self._namespace}e{epoch - 1}/came/{self.rank}")
            return replaced

    def _predecessor_keys(self, replaced: list[int]) -> list[str]:
        """The keys that the dead processes of the ``replaced`` ranks left of the epoch this rank leaves,
        which no process of theirs deletes: their settled join of its round, and their slots of its
        collectives. Call before the epoch advances, on a rank that was in it (rank 0).

        A dead process published its slots up to this rank's sequence number at most (its call ``s``
        started once its call ``s - 1`` had completed, which needed this rank's slot ``s - 1``), and it
        completed this rank's call ``seq - 3`` at least (this rank started ``seq - 1``, so every rank
        published ``seq - 2``), deleting all before ``seq - 4``; so its slots lie in ``[seq - 4, seq]``.
        """
        keys = []
        for rank in replaced:
            keys += [self._collective_key(seq, rank) for seq in range(max(self._seq - 4, 0), self._seq + 1)
                     if self._collective_key(seq, rank) != self._first_slot_key(rank)]  # which stays
            if self._epoch > 0:  # epoch 0's round is the rendezvous, whose slot stays (_first_slot_key)
                keys.append(f"{self._namespace}e{self._epoch}/join/{rank}")
        return keys

    def _after_round(self, step: Callable[..., object], *args: object) -> None:
        """A clean-up step of a completed renewal round: a GroupError is logged, not raised."""
        try:
            step(*args)
        except GroupError as exc:
            logger.warning("%s: rank %d: renewal round %d completed; a clean-up step after it failed, which leaves "
                           "the round as it is: %s%r: %s", type(self).__name__, self.rank, self._epoch,
                           getattr(step, "__name__", step), args, exc)

    def _counted_round(self, epoch: int, mine: bytes, wait_s: float) -> tuple[list[bytes], int]:
        """The renewal round to ``epoch`` on a store without claims (torch's, JAX's): every rank's join
        (``mine`` is this rank's), once all have come, and the number of the attempt that completed.

        Such a store cannot take a join back in the same step as a failed wait, so a late peer could
        read a rank's join after that rank gave up, complete the round alone, and split the epochs.
        Here each attempt of the round is decided once, by the first rank to create its decision key
        (create-if-absent: the store keeps the first value, and every later creator reads it):
        ``complete`` by the rank whose add to the attempt's count makes it world_size (each rank sets
        its join, then adds 1), ``failed`` by a rank whose wait ran out. Every rank obeys that one
        decision. The ranks of a failed attempt go on to the next, and so does a rank that gave up,
        when it retries. A rank adds to an attempt's count once, however often it retries there
        (``_round_attempt``), so the count reads world_size only once every rank has come. A rank that
        learns the decision also sets it under a second key, which the others wait for: a plain set
        wakes waiters on every store, where a create may not (torch's TCPStore without libuv). The
        attempts' keys stay until the next round completes (:meth:`_counted_round_keys`): a peer reading
        who came, or a decision, must not see it vanish.

        Raises:
            StoreTimeoutError: ``wait_s`` ran out, and this rank decided the attempt failed;
                missing_keys are the joins absent from it (the ranks that had not come).
        """
        base = f"{self._namespace}e{epoch}/"
        deadline = time.monotonic() + wait_s
        attempt = self._round_attempt[1] if self._round_attempt[0] == epoch else 0
        while True:
            prefix = f"{base}a{attempt}/"
            keys = [f"{prefix}join/{r}" for r in range(self.world_size)]
            count_key, decision_key, decided_key = prefix + "count", prefix + "decision", prefix + "decided"
            decision = None
            if self._round_attempt != (epoch, attempt, True):
                self._kv_set(keys[self.rank], mine)  # before the count: a complete count means every join is set
                # Counted before the add: an add whose reply was lost may have counted (a retry only waits).
                self._round_attempt = (epoch, attempt, True)
                if self._kv_add(count_key, 1) == self.world_size:
                    decision = self._decide(decision_key, decided_key, _ROUND_COMPLETE)
            elif self._kv_add(count_key, 0) == self.world_size:  # a retry: the rank that completed it may have
                decision = self._decide(decision_key, decided_key, _ROUND_COMPLETE)  # failed before it said so
            if decision is None:
                left_s = deadline - time.monotonic()
                if left_s > 0:  # (never a wait of 0: torch's stores take it as forever)
                    try:
                        decision = self._kv_multi_get([decided_key], left_s)[0]
                    except _StoreWaitError:
                        pass
            if decision is None:  # this rank's time ran out
                missing = self._absent_joins(keys)  # read before the decision: after it, the peers move on
                decision = self._decide(decision_key, decided_key, _ROUND_FAILED)
                if decision == _ROUND_FAILED:
                    raise StoreTimeoutError(f"renewal round {epoch}, attempt {attempt}: timed out", missing)
            if decision == _ROUND_COMPLETE:
                return self._kv_multi_get(keys, max(deadline - time.monotonic(), _PROBE_S)), attempt
            # A peer decided this attempt failed: on to the next, unless this rank's own time is up (it would
            # only fail that one too).
            if time.monotonic() >= deadline:
                raise StoreTimeoutError(f"renewal round {epoch}, attempt {attempt}: timed out",
                                        self._absent_joins(keys))
            attempt += 1

    def _counted_round_keys(self, epoch: int, last_attempt: int) -> list[str]:
        """The keys this rank deletes of the counted round to ``epoch``, which completed in attempt
        ``last_attempt``, once the next round completes: its own join in each attempt (every rank
        passes through attempts 0 to ``last_attempt``, setting its join in each), and, on rank 0 alone
        (one delete of each), every attempt's count, decision and decided.

        Nobody reads them then: the next round completes only once every rank has counted in it, after
        it had finished this one (a rank whose renewal raised retries this round before the next).
        Without this, each renewal left three keys (and every failed attempt a join per rank) in the
        store for the life of the job (deleting a key the store lacks is no error).
        """
        keys = []
        for attempt in range(last_attempt + 1):
            prefix = f"{self._namespace}e{epoch}/a{attempt}/"
            keys.append(f"{prefix}join/{self.rank}")
            if self.rank == 0:
                keys += [prefix + "count", prefix + "decision", prefix + "decided"]
        return keys

    def _absent_joins(self, keys: list[str]) -> list[str]:
        """Of a counted round's attempt's join ``keys``, the other ranks' that the store does not hold."""
        present = self._present({key: r for r, key in enumerate(keys) if r != self.rank}) or {}
        return [key for r, key in enumerate(keys) if r != self.rank and key not in present]

    def _decide(self, decision_key: str, decided_key: str, proposal: bytes) -> bytes:
        """The decision of a counted round's attempt: ``proposal``, unless a peer decided first (then
        theirs), also set under ``decided_key``, where the peers wait for it."""
        decision = self._kv_create(decision_key, proposal)
        self._kv_set(decided_key, decision)
        return decision

    def _join_as_replacement(self, deadline: float) -> None:
        """Take this rank over from a dead process: join the survivors' next renew_membership, waiting
        for them until ``deadline`` (a ``time.monotonic()``).

        The target is the first round not yet complete: ``{namespace}epoch`` names the last round
        its members finished, and a round is complete when every rank's join key is there (the
        epoch key is written just after, so it can lag by one round).
        """
        epoch = self._kv_add(f"{self._namespace}epoch", 0)
        while True:
            keys = [f"{self._namespace}e{epoch + 1}/join/{r}" for r in range(self.world_size)]
            try:
                self._kv_multi_get(keys, _PROBE_S)
            except _StoreWaitError:
                break  # round epoch + 1 still waits for someone: that is the one to join
            epoch += 1
        self._epoch, self._seq, self._is_replacement = epoch, 0, True
        self._renew(max(deadline - time.monotonic(), _PROBE_S))

    def _collective_key(self, seq: int, rank: int) -> str:
        epoch = f"e{self._epoch}/" if self._epoch else ""
        return f"{self._namespace}{epoch}c/{seq}/{rank}"

    def _delete_spent_slot(self, key: str) -> None:
        """Delete ``key``, this rank's slot of a round every peer has read, unless it is the
        rendezvous's, which stays (:meth:`_first_slot_key`)."""
        if key != self._first_slot_key(self.rank):
            self._kv_delete(key)

    def _first_slot_key(self, rank: int) -> str:
        """``rank``'s slot of the rendezvous round (epoch 0, call 0). It stays when later calls clean
        up: it is the record that the rank joined (the TCP store's rendezvous settles it only if the
        round completed for every rank)."""
        return f"{self._namespace}c/0/{rank}"

    def _rendezvous(self, deadline: float | None = None) -> None:
        """Join: claim this rank, then the init_group round, in which every rank shows the others its
        (protocol version, world_size); all of it within ``timeout_s``, or by ``deadline`` (a
        ``time.monotonic()``: the group's construction, which connected to the store first).

        Rank 0 first publishes its pair under ``{namespace}init/world_size``, and every other rank
        reads it before anything else: a rank started with another world_size (or a rank outside
        rank 0's group) learns so from the store at once, where in the round it would wait for
        keys that never all come, until its timeout or until rank 0, having seen the mismatch,
        closed the store under it ("store closed", no cause named). It also leaves its pair in its
        slot of rank 0's round, where that round's ranks read it: they raise naming it, at once if
        the round is otherwise complete, else when their wait runs out (:meth:`_check_arrived`).

        Raises:
            RankMismatchError: the ranks disagree on world_size or protocol version (each rank's
                value named), on every rank that saw it.
            GroupError: this rank joined twice, a process of it joined before (the TCP store: it
                needs ``rejoin``), or ranks did not come within ``timeout_s`` (named; those that
                came and left said so).
        """
        mine = self._init_pair()
        if deadline is None:
            deadline = time.monotonic() + self._timeout_s
        if self.rank == 0:
            self._kv_set(self._init_key(), mine)
        else:
            self._check_rank0(mine, deadline)  # before the claim: a rank that does not fit leaves no claim behind
        slot_claimed = self._claim_rank(_slot_value("init_group", mine))
        try:
            if slot_claimed:  # an earlier process's mark, which left: not this one's
                self._kv_delete(self._first_slot_key(self.rank) + WITHDRAWN_SUFFIX)
            replies = self._collective("init_group", mine, timeout_s=max(deadline - time.monotonic(), _PROBE_S),
                                       on_wait_error=functools.partial(self._check_arrived, mine),
                                       slot_claimed=slot_claimed)
            self._check_init(dict(enumerate(replies)))
        except RankMismatchError:
            if self.rank == 0 and self._store_closes_with_rank0:
                self._wait_for_larger_world(deadline)
            raise

    def _init_pair(self) -> bytes:
        """What this rank shows the others when it joins: (protocol version, world_size), packed."""
        return _INIT.pack(_PROTOCOL_VERSION, self.world_size)

    def _init_key(self) -> str:
        """Where rank 0 keeps its (protocol version, world_size) for the other ranks to check theirs against."""
        return f"{self._namespace}init/world_size"

    def _check_rank0(self, mine: bytes, deadline: float) -> None:
        """Raise RankMismatchError if this rank does not fit rank 0's pair (``mine`` is this rank's),
        waiting until ``deadline`` for rank 0 to publish it."""
        label = f"init_group #{self._num_calls['init_group']}"
        try:
            rank0 = self._kv_multi_get([self._init_key()], max(deadline - time.monotonic(), _PROBE_S))[0]
        except _StoreWaitError as exc:
            failure = (f"{label} {self._wait_failure(exc)} waiting for ranks [0] of {self.world_size} "
                       f"({self._where()})")
            # A rank 0 of an older store protocol writes no init key, only its slot of round 0 (the
            # adapters' stores have no hello to name the versions): name them from there.
            try:
                self._check_init({0: _slot_data(self._kv_multi_get([self._collective_key(0, 0)], _PROBE_S)[0]),
                                  self.rank: mine}, failure)
            except GroupError:  # no slot either (or the store is gone): rank 0 never came
                pass
            raise GroupError(failure) from None
        pairs = {0: _INIT.unpack(rank0), self.rank: _INIT.unpack(mine)}
        if _init_mismatch(pairs) is None:
            return
        # This rank's pair in its slot of round 0 (unclaimed: it does not join): within rank 0's group,
        # that round's ranks then name it too; beyond, it tells rank 0 that this rank has read why. Not
        # over a slot already there: a process of this rank is in the round, or joined a group that
        # completed it, and the slot is its own. (A look, then a set: one claiming its slot between
        # the two has it overwritten, two processes started as one rank with different world sizes.)
        slot = self._first_slot_key(self.rank)
        try:
            if not self._present({slot: self.rank}):
                self._kv_set(slot, _slot_value("init_group", mine))
        except GroupError:
            pass  # the store is going away: this rank's own error below still names the cause
        self._check_init(pairs)

    def _check_arrived(self, mine: bytes, keys: list[str], missing_keys: list[str], failure: str) -> None:
        """After the init_group round's wait failed (``failure``, naming the ranks that did not come):
        raise RankMismatchError if the pairs that did arrive disagree (``mine``: this rank's), which is
        why those ranks never come (they were started with another world_size). Else, if some of the
        ranks named came and left (their own rendezvous failed first, taking their slot with it),
        GroupError saying so. The keys are read as they are now; a store that is gone leaves the
        failure as is."""
        arrived = self._present({k: r for r, k in enumerate(keys) if k not in missing_keys and r != self.rank})
        if arrived is None:
            return
        self._check_init({r: _slot_data(v) for r, v in arrived.values()} | {self.rank: mine}, failure)
        left = self._present({k + WITHDRAWN_SUFFIX: r for r, k in enumerate(keys) if k in missing_keys})
        if left:
            raise GroupError(f"{failure}; of these, ranks {sorted(r for r, _ in left.values())} came and left "
                             f"(their own init_group failed first)")

    def _present(self, ranks_by_key: dict[str, int]) -> dict[str, tuple[int, bytes]] | None:
        """Of the keys given (each with its rank), those the store holds now, with their values; None if
        the store is gone."""
        while ranks_by_key:
            try:
                values = self._kv_multi_get(list(ranks_by_key), _PROBE_S)
                return {k: (r, v) for (k, r), v in zip(ranks_by_key.items(), values)}
            except _StoreWaitError as exc:  # keys withdrawn meanwhile or never set, or the store is closing
                still_there = {k: r for k, r in ranks_by_key.items() if k not in exc.missing_keys}
                if len(still_there) == len(ranks_by_key):  # a store that names no key: nothing more to learn
                    return None
                ranks_by_key = still_there
            except GroupError:  # the connection is gone
                return None
        return {}

    def _check_init(self, pairs: dict[int, bytes | tuple[int, int]], failure: str | None = None) -> None:
        """Raise RankMismatchError if the ranks' (protocol version, world_size) ``pairs`` (packed or
        not) disagree; ``failure``: how the round failed besides, added to the message."""
        pairs = {r: _INIT.unpack(p) if isinstance(p, bytes) else p for r, p in pairs.items()}
        message = _init_mismatch(pairs)
        if message is not None:
            self._largest_world_seen = max(size for _, size in pairs.values())
            raise RankMismatchError(f"init_group: {message}" + (f"; {failure}" if failure else "")) from None

    def _wait_for_larger_world(self, deadline: float) -> None:
        """Rank 0, about to raise RankMismatchError and close its store: first wait until the ranks
        beyond its world_size, which a peer's larger world_size says exist, have read why (each leaves
        its pair in round 0 once it has; see :meth:`_check_rank0`), until ``deadline`` (the
        rendezvous's) and at most :data:`_MISMATCH_GRACE_S`."""
        ranks = range(self.world_size, self._largest_world_seen)
        keys = [self._collective_key(0, r) for r in ranks]
        wait_s = min(deadline - time.monotonic(), _MISMATCH_GRACE_S)
        if not keys or wait_s <= 0:
            return
        try:
            self._kv_multi_get(keys, min(wait_s, _PROBE_S))
            return
        except GroupError:
            pass
        which = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks[0]} to {ranks[-1]}"
        logger.warning("init_group: ranks were started with a larger world_size than rank 0's %d: rank 0 keeps "
                       "the store up for %s to read why, %.0f s at most, then raises", self.world_size, which, wait_s)
        try:
            self._kv_multi_get(keys, wait_s)
        except GroupError:  # they did not all come: rank 0 raises anyway
            pass

    def _wait_failure(self, exc: _StoreWaitError) -> str:
        """How a store wait of a collective ended, in words: "timed out after 3.0 s", "was cut short ..."."""
        if isinstance(exc, StoreTimeoutError):
            return f"timed out after {self._timeout_s} s{exc.extended}"
        return exc.cut_short

    def _collective(self, name: str, data: bytes, timeout_s: float | None = None,
                    on_wait_error: Callable[[list[str], list[str], str], None] | None = None,
                    slot_claimed: bool = False) -> list[bytes]:
        """Every rank's ``data`` for the collective ``name``, in rank order.

        ``timeout_s``: the wait's limit, when not the group's (what is left of the rendezvous's).
        ``on_wait_error(keys, missing_keys, failure)``: called when the wait fails, before GroupError
        ``failure`` is raised; it may raise a more telling error instead. ``slot_claimed``: this rank's
        slot is in the store already, as a claim (the rendezvous over the TCP store): the round
        settles every slot once complete, or withdraws this one if its wait fails.
        """
        with self._lock:
            label = f"{name} #{self._num_calls[name]}"
            self._num_calls[name] += 1
            if self._closed:
                raise GroupError(f"{label}: {self._closed_because}")
            if self._broken is not None:
                raise GroupError(f"{label}: the group is broken by an earlier failure ({self._broken}); "
                                 f"every rank repairs it with Buffer.update_ep_member() (or "
                                 f"group.renew_membership()), where the group can, or makes a new group")
            if self.world_size == 1:
                return [data]
            seq, self._seq = self._seq, self._seq + 1
            keys = [self._collective_key(seq, r) for r in range(self.world_size)]
            wait_s = self._timeout_s if timeout_s is None else timeout_s
            try:
                mine = _slot_value(name, data)
                if not slot_claimed:
                    self._kv_set(keys[self.rank], mine)
                # Outside the rendezvous (where a rank's claim may not be made yet), a rank whose
                # process is gone fails the round at once: its slot will never come.
                values = self._kv_multi_get(keys, wait_s, reply_bytes=self.world_size * len(mine),
                                            settle=slot_claimed, holders=None if slot_claimed else self._holder_keys())
                if seq > 0:
                    self._delete_spent_slot(self._collective_key(seq - 1, self.rank))
            except _StoreWaitError as exc:
                missing = _ranks_of(exc.missing_keys)
                self._broken = (f"{label} {self._wait_failure(exc)} waiting for ranks {missing} of "
                                f"{self.world_size} ({self._where()})")
                if isinstance(exc, StoreHoldersGoneError):  # not timed out: told at once
                    gone = _ranks_of(exc.gone_keys)
                    self._broken += (f": ranks {gone} left the group (their store connections closed: their "
                                     f"processes exited or died, or closed the group)")
                if on_wait_error is not None:
                    on_wait_error(keys, exc.missing_keys, self._broken)
                raise GroupError(self._broken) from None
            except GroupError as exc:
                self._broken = f"{label} on rank {self.rank} failed: {exc}"
                raise GroupError(self._broken) from exc
            except BaseException as exc:  # the round is spent whatever stopped it (an interrupt, a bug)
                self._broken = f"{label} on rank {self.rank} stopped: {type(exc).__name__}: {exc}"
                raise
            odd = {r: _TAG_NAMES.get(v[:1], "?") for r, v in enumerate(values) if v[:1] != _TAG_BYTES[name]}
            if odd:
                self._broken = (f"{label}: ranks called other collectives in the same round {odd}; "
                                f"every rank must make the same sequence of collective calls")
                raise GroupError(self._broken)
            return [_slot_data(v) for v in values]
