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
from collections.abc import Callable, Hashable

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
# Not a decision: what a follower's look finds once rank 0 opened the attempt and none decided it yet.
_ATTEMPT_OPENED = b"opened"
# How a timeout names the way an attempt before it ended (keyed by the attempt's decision).
_ENDED = {_ROUND_FAILED: "failed: a rank gave up on it", _ATTEMPT_SUPERSEDED: "was superseded by a newer one"}
# Seconds between the looks of a rank waiting in the join (rank 0 for the joins or its attempt's
# decision, a rank > 0 for rank 0 to open an attempt or decide it): from the first to the last,
# doubling. Looks, not waits on the store: a wait for either of two keys has no store operation, and
# torch's stores log two lines for every short wait that times out.
_JOIN_POLL_S = (0.005, 0.1)


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

    def _kv_holds_all(self, keys: list[str]) -> bool:
        """Whether the store holds every one of ``keys`` now (no wait)."""
        raise NotImplementedError

    def _join_lock_key(self) -> Hashable:
        """What this process's joins of this rank on this store under this prefix share: they run one
        at a time (two threads of a rank building groups at once each take an attempt of rank 0 in
        turn, where together they would claim the same attempt twice, or, as rank 0, close each
        other's). Groups of other prefixes join apart: one lock across them let two processes each
        hold it for one prefix while waiting for the other's join of the other."""
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
        self._namespace = self._attempt(generation)
        decision_key, decided_key = self._namespace + "decision", self._namespace + "decided"
        label = f"init_group #{self._num_calls['init_group']}"
        keys = [self._first_slot_key(r) for r in range(self.world_size)]
        try:  # from the number on: an attempt this rank leaves is decided, never left open to the followers
            if generation > 1:
                before = self._attempt(generation - 1)
                self._decide(before + "decision", before + "decided", _ATTEMPT_SUPERSEDED)
            self._kv_set(self._init_key(), mine)
            self._kv_set(keys[0], _slot_value("init_group", mine))
            decision = self._look_until(deadline, lambda: _ROUND_COMPLETE if self._kv_holds_all(keys)
                                  else self._kv_try_get(decision_key))
            if decision == _ROUND_COMPLETE or decision is None:  # every join there, or the deadline
                decision = self._decide(decision_key, decided_key, decision or _ROUND_FAILED)
        except BaseException:
            self._give_up(decision_key, decided_key)
            raise
        if decision == _ROUND_COMPLETE:
            return
        if decision == _ATTEMPT_SUPERSEDED:
            raise GroupError(f"init_group: rank 0 joined the store ({self._where()}) twice: another process leads "
                             f"as rank 0; {self._same_rank_hint}")
        missing = [key for key in keys if self._kv_try_get(key) is None]
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
            # Rank 0 opens the attempt, or it is decided (an earlier group's, of another world_size
            # perhaps, or one that ended without completing: passed over unread; or one whose rank 0
            # failed between numbering it and opening it).
            decision_key, init_key = self._namespace + "decision", self._init_key()
            decision = self._look_until(deadline, lambda: self._kv_try_get(decision_key)
                                  or (_ATTEMPT_OPENED if self._kv_holds_all([init_key]) else None))
            if decision in (None, _ATTEMPT_OPENED):  # opened (or the deadline, which the check names)
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

    @staticmethod
    def _look_until(deadline: float, look: Callable[[], bytes | None]) -> bytes | None:
        """What ``look()`` returns first that is not None, looking every _JOIN_POLL_S; None at ``deadline``."""
        poll_s = _JOIN_POLL_S[0]
        while True:
            found = look()
            left_s = deadline - time.monotonic()
            if found is not None or left_s <= 0:
                return found
            time.sleep(min(poll_s, left_s))
            poll_s = min(2 * poll_s, _JOIN_POLL_S[1])

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
