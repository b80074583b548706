"""The join of a group over a store without claims (torch's stores, JAX's key-value service).

Such a store outlives the attempts made on it (a rank's join that timed out, a worker torchrun
restarted) and cannot take a key back when the process that set it gives up or dies. Each rank
counting its own groups there (protocols up to 8) let the ranks drift apart for good after one
rank's failed attempt, and a late rank could complete a round the others had given up. Here rank 0
leads each attempt and the ranks follow it:

- rank 0 takes the next number ``g`` of ``{prefix}/generation``, decides attempt ``g - 1``
  ``superseded`` if it is still open (its rank 0 is gone, or is a second process started as
  rank 0), and opens attempt ``g`` by publishing its (protocol version, world_size) under
  ``{prefix}/{g}/init/world_size``;
- a rank r > 0 reads the number and takes the first attempt from there that is not decided,
  waiting for rank 0 to open it: it checks rank 0's pair, claims its rank
  (``{prefix}/{g}/claim/{r}``) and sets its join, its slot of the init_group round
  (``{prefix}/{g}/c/0/{r}``);
- each attempt is decided once, by the first rank to create ``{prefix}/{g}/decision``:
  ``complete`` by rank 0 once every join is there, ``failed`` by the first rank whose
  ``timeout_s`` runs out, ``superseded`` by the next attempt's rank 0. Every rank obeys that one
  decision (``{prefix}/{g}/decided`` copies it for the waits). A rank > 0 whose attempt did not
  complete goes on to the next one within its own ``timeout_s``, so ranks that retry meet in rank
  0's next attempt whatever their earlier attempts were, and no rank completes an attempt that
  another gave up on.

Only a live rank 0 decides ``complete``: joins left in an attempt by processes that are gone (a
restart) never complete it. A second process with a rank > 0 in the same attempt finds the rank
claimed: it waits for the decision and, if the attempt completes, raises as a second process
with that rank (if it does not, the claim may have been a process that is gone: it goes on to
the next attempt).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Hashable

from mooncake_ep._group_common import (
    _PROBE_S,
    _ROUND_COMPLETE,
    _ROUND_FAILED,
    GroupError,
    _KeyValueGroup,
    _ranks_of,
    _slot_value,
    _StoreWaitError,
)

# The third decision of a join attempt: the next attempt's rank 0 closed it while it was still open.
_ATTEMPT_SUPERSEDED = b"superseded"
# How a timeout names the way an attempt before it ended (keyed by the attempt's decision).
_ENDED = {_ROUND_FAILED: "failed: a rank gave up on it", _ATTEMPT_SUPERSEDED: "was superseded by a newer one"}
# Seconds between rank 0's looks, while it waits for the joins, at whether a peer decided its attempt
# (a rank that gave up, another process opening a newer attempt as rank 0): from the first to the
# last, doubling. How late it notices that, not how late it sees the joins (its waits for those
# return as soon as they are there); each look past a wait also checks every missing join.
_JOIN_POLL_S = (0.01, 0.5)


class _LedJoinGroup(_KeyValueGroup):
    """A :class:`_KeyValueGroup` that joins in attempts led by rank 0 (the module's docstring).

    A subclass sets ``_prefix``, provides :meth:`_kv_try_get` and :meth:`_join_lock_key` besides the
    store operations of :class:`_KeyValueGroup`, and calls :meth:`_rendezvous`.
    """

    # Namespace of the group's attempts in the store: the attempt g's keys are {prefix}/{g}/...
    _prefix: str

    def _kv_try_get(self, key: str) -> bytes | None:
        """``key``'s value now (no wait); None if the store does not hold it."""
        raise NotImplementedError

    def _join_lock_key(self) -> Hashable:
        """What this process's joins of this rank on this store share: they run one at a time (two
        threads of a rank building groups at once each take an attempt of rank 0 in turn, where
        together they would claim the same attempt twice, or, as rank 0, close each other's)."""
        raise NotImplementedError

    def _attempt(self, generation: int) -> str:
        """The namespace of join attempt ``generation``."""
        return f"{self._prefix}/{generation}/"

    def _rendezvous(self, deadline: float | None = None) -> None:
        """Join (the module's docstring), then read the init_group round's pairs, by ``deadline``.

        Raises:
            RankMismatchError: the ranks disagree on world_size or protocol version (each rank's
                value named).
            GroupError: two processes joined as one rank, or ranks did not come within
                ``timeout_s`` (named), or a rank that came gave up first.
        """
        mine = self._init_pair()
        if deadline is None:
            deadline = time.monotonic() + self._timeout_s
        with _join_lock(self._join_lock_key()):
            if self.rank == 0:
                self._lead(mine, deadline)
            else:
                self._follow(mine, deadline)
        # The attempt completed: every join is there. This rank's slot is set already (slot_claimed).
        replies = self._collective("init_group", mine, timeout_s=max(deadline - time.monotonic(), _PROBE_S),
                                   slot_claimed=True)
        self._check_init(dict(enumerate(replies)))

    def _lead(self, mine: bytes, deadline: float) -> None:
        """Rank 0: open the next attempt, wait for every rank's join, decide the attempt."""
        generation = self._kv_add(f"{self._prefix}/generation", 1)
        if generation > 1:
            before = self._attempt(generation - 1)
            self._decide(before + "decision", before + "decided", _ATTEMPT_SUPERSEDED)
        self._namespace = self._attempt(generation)
        decision_key, decided_key = self._namespace + "decision", self._namespace + "decided"
        label = f"init_group #{self._num_calls['init_group']}"
        keys = [self._first_slot_key(r) for r in range(self.world_size)]
        poll_s = _JOIN_POLL_S[0]
        try:
            self._kv_set(self._init_key(), mine)
            self._kv_set(keys[0], _slot_value("init_group", mine))
            while True:
                try:
                    self._kv_multi_get(keys, max(min(poll_s, deadline - time.monotonic()), _PROBE_S))
                    decision, missing = self._decide(decision_key, decided_key, _ROUND_COMPLETE), []
                    break
                except _StoreWaitError as exc:
                    missing = exc.missing_keys
                decision = self._kv_try_get(decision_key)
                if decision is not None:
                    break
                if time.monotonic() >= deadline:
                    decision = self._decide(decision_key, decided_key, _ROUND_FAILED)
                    break
                poll_s = min(2 * poll_s, _JOIN_POLL_S[1])
        except BaseException:
            self._give_up(decision_key, decided_key)
            raise
        if decision == _ROUND_COMPLETE:
            return
        if decision == _ATTEMPT_SUPERSEDED:
            raise GroupError(f"init_group: rank 0 joined the store ({self._where()}) twice: another process leads "
                             f"as rank 0; {self._same_rank_hint}")
        waiting = (f"waiting for ranks {_ranks_of(missing)} of {self.world_size}" if missing
                   else f"as the last of {self.world_size} ranks joined")
        if time.monotonic() >= deadline:
            failure = f"{label} timed out after {self._timeout_s} s {waiting} ({self._where()})"
        else:
            failure = (f"{label} failed {waiting} ({self._where()}): a rank that came gave up first (its "
                       f"timeout_s ran out); every rank builds the group again")
        self._check_arrived(mine, keys, missing, failure)
        raise GroupError(failure)

    def _follow(self, mine: bytes, deadline: float) -> None:
        """A rank > 0: join rank 0's first attempt not yet decided, and the next ones while each
        ends otherwise than complete, until one completes or ``deadline``."""
        generation = max(self._kv_add(f"{self._prefix}/generation", 0), 1)
        ended = ""  # how the last attempt this rank saw end did, for its timeout's message
        while True:
            self._namespace = self._attempt(generation)
            # A decided attempt is passed over unread: an earlier group's (of another world_size,
            # perhaps), or one that ended without completing.
            decision = self._kv_try_get(self._namespace + "decision")
            if decision is None:
                try:
                    self._check_rank0(mine, deadline)  # rank 0's pair: the attempt is open
                except GroupError as exc:
                    raise GroupError(f"{exc}{ended}") from None
                decision = self._join_attempt(mine, deadline)
                if decision == _ROUND_COMPLETE:
                    return
            if decision != _ROUND_COMPLETE:  # (a complete one here is an earlier group's)
                ended = f"; before it, rank 0's attempt {self._namespace}* {_ENDED.get(decision, 'ended')}"
            generation += 1
            if time.monotonic() >= deadline:  # no time left to join another (it would fail it at once)
                self._namespace = self._attempt(generation)
                raise GroupError(f"init_group #{self._num_calls['init_group']} timed out after {self._timeout_s} s "
                                 f"waiting for ranks [0] of {self.world_size} ({self._where()}){ended}")

    def _join_attempt(self, mine: bytes, deadline: float) -> bytes:
        """A rank > 0: claim this rank in the open attempt, set its join, and wait for the attempt's
        decision (deciding it failed if ``deadline`` comes first); the decision."""
        claim_key = f"{self._namespace}claim/{self.rank}"
        decision_key, decided_key = self._namespace + "decision", self._namespace + "decided"
        label = f"init_group #{self._num_calls['init_group']}"
        twice = f"init_group: rank {self.rank} joined the store ({self._where()}) twice"
        claimed = self._kv_add(claim_key, 1) == 1
        if not claimed:
            self._kv_add(claim_key, -1)  # not taken: the holder keeps it
        try:
            if claimed:
                self._kv_set(self._first_slot_key(self.rank), _slot_value("init_group", mine))
            try:
                decision = self._kv_multi_get([decided_key], max(deadline - time.monotonic(), _PROBE_S))[0]
            except _StoreWaitError:
                if not claimed:  # the holder's attempt is still open: it is alive, or rank 0 is gone too
                    raise GroupError(f"{twice} (the other process's join was still open after {self._timeout_s} s); "
                                     f"{self._same_rank_hint}")
                keys = [self._first_slot_key(r) for r in range(self.world_size)]
                missing = self._absent_joins(keys)  # read before the decision: after it, the peers move on
                decision = self._decide(decision_key, decided_key, _ROUND_FAILED)
                if decision != _ROUND_COMPLETE:
                    waiting = (f"ranks {_ranks_of(missing)} of {self.world_size}" if missing else
                               f"ranks [0] of {self.world_size} (every rank had joined; rank 0 did not complete)")
                    failure = f"{label} timed out after {self._timeout_s} s waiting for {waiting} ({self._where()})"
                    self._check_arrived(mine, keys, missing, failure)
                    raise GroupError(failure) from None
        except BaseException:
            if claimed:
                self._give_up(decision_key, decided_key)
            raise
        if not claimed and decision == _ROUND_COMPLETE:  # the group formed with the other process
            raise GroupError(f"{twice}; {self._same_rank_hint}")
        return decision

    def _give_up(self, decision_key: str, decided_key: str) -> None:
        """Decide the attempt failed, where nobody decided it yet, as a rank leaves it on an error of
        its own; a store that fails now leaves it to the peers' timeouts."""
        try:
            self._decide(decision_key, decided_key, _ROUND_FAILED)
        except GroupError:
            pass


# Per _LedJoinGroup._join_lock_key: the lock of that rank's joins on that store in this process.
_join_locks: dict[Hashable, threading.Lock] = {}
_join_locks_lock = threading.Lock()


def _join_lock(key: Hashable) -> threading.Lock:
    with _join_locks_lock:
        return _join_locks.setdefault(key, threading.Lock())
