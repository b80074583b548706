"""The join of the groups over torch's and JAX's stores (_group_join): rank 0 leads each attempt.

Each rank had counted its own groups in the store and taken its keys from that count: after one
rank's join failed, the counts differed for good and the ranks waited under different keys at
every later attempt; a second process with the same rank was never refused (it waited under keys
of its own); and a rank coming late completed a round the others had given up on.

CPU only. Ranks are threads, each group with a store connection of its own, as a process has (a
torch HashStore behind a thin wrapper; JAX's key-value client faked over a shared dict). Timeouts
only bound failures; SHORT_S is what a join expected to time out waits.
"""

from __future__ import annotations

import threading

import pytest

import _threads
from mooncake_ep import RankMismatchError
from mooncake_ep._group_common import _INIT, _PROTOCOL_VERSION, _slot_value
from mooncake_ep.group import GroupError, JaxGroup, TorchStoreGroup
from test_group_adapters import FakeJaxClient

SHORT_S = 0.3
# What a join expected to succeed waits: short enough that a test of the drift this file guards
# against, failing, still ends in seconds.
RETRY_S = 2.0
LIMIT_S = 60.0
KINDS = ["torch", "jax"]


def run(fns: list) -> list:
    return _threads.run_in_threads(fns, LIMIT_S)


def in_thread(fn):
    """Start ``fn`` on a thread; return a function that joins it and gives what it returned or raised."""
    out = []
    thread = threading.Thread(target=lambda: out.append(_threads.call_or_error(fn)), daemon=True)
    thread.start()

    def outcome():
        thread.join(LIMIT_S)
        assert not thread.is_alive(), "a rank thread hung"
        return out[0]
    return outcome


class _Connection:
    """A torch store reached through a connection of its own, as each process reaches a TCPStore (a
    HashStore lives in one process): what the group calls is the store's, ``add`` reported."""

    def __init__(self, store, on_add) -> None:
        self._store, self._on_add = store, on_add

    def add(self, key: str, amount: int) -> int:
        value = self._store.add(key, amount)
        self._on_add(key, value)
        return value

    def __getattr__(self, name: str):
        return getattr(self._store, name)


class _JaxConnection(FakeJaxClient):
    def __init__(self, shared: dict, on_add) -> None:
        super().__init__(shared)
        self._on_add = on_add

    def key_value_increment(self, key: str, increment: int) -> int:
        value = super().key_value_increment(key, increment)
        self._on_add(key, value)
        return value


class Store:
    """One torch or JAX store, and a group on it with a connection of its own per call."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        # Set once a rank is claimed twice in one attempt (the second claim's add reads 2).
        self.claimed_twice = threading.Event()
        if kind == "torch":
            self.store = pytest.importorskip("torch.distributed").HashStore()
        else:
            self.shared = FakeJaxClient.make_shared()

    def _on_add(self, key: str, value: int) -> None:
        if "/claim/" in key and value == 2:
            self.claimed_twice.set()

    def group(self, rank: int, world_size: int, timeout_s: float):
        if self.kind == "torch":
            return TorchStoreGroup(_Connection(self.store, self._on_add), rank, world_size, timeout_s=timeout_s)
        return JaxGroup(_JaxConnection(self.shared, self._on_add), rank=rank, world_size=world_size,
                        timeout_s=timeout_s)

    def set(self, key: str, value: bytes) -> None:
        if self.kind == "torch":
            self.store.set(key, value)
        else:
            FakeJaxClient(self.shared).key_value_set_bytes(key, value, allow_overwrite=True)

    def wait_for(self, key: str) -> None:
        if self.kind == "torch":
            import datetime
            self.store.wait([key], datetime.timedelta(seconds=LIMIT_S))
        else:
            FakeJaxClient(self.shared).blocking_key_value_get_bytes(key, int(LIMIT_S * 1000))


def formed(groups: list) -> None:
    """Assert that ``groups`` are one group, rank by rank, whose allgather works."""
    assert all(isinstance(g, (TorchStoreGroup, JaxGroup)) for g in groups), groups
    assert sorted(g.rank for g in groups) == list(range(len(groups))), groups
    got = run([lambda g=g: g.allgather_bytes(bytes([g.rank])) for g in groups])
    assert got == [[bytes([r]) for r in range(len(groups))]] * len(groups)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("first", [0, 1])
def test_ranks_meet_again_after_one_ranks_join_timed_out(kind, first):
    """One rank's join times out before the other started; then both join again with new groups.
    Before, that rank's group count stayed one ahead of the other's: they waited under different keys
    (every later attempt too), and both timed out."""
    store = Store(kind)
    with pytest.raises(GroupError, match=rf"^init_group #0 timed out after {SHORT_S} s waiting for ranks "
                                         rf"\[{1 - first}\] of 2"):
        store.group(first, 2, SHORT_S)
    formed(run([lambda r=r: store.group(r, 2, RETRY_S) for r in range(2)]))


@pytest.mark.parametrize("kind", KINDS)
def test_a_second_process_of_a_rank_is_refused_after_a_retry(kind):
    """After rank 1's first join timed out, rank 0 and two processes as rank 1 join: both claim rank 1 in
    rank 0's attempt, and once rank 2 completes it the second one is refused. Before, the two had
    each their own keys (their own group counts) and were never compared."""
    store = Store(kind)
    with pytest.raises(GroupError, match=r"waiting for ranks \[0\] of 3"):
        store.group(1, 3, SHORT_S)
    joins = [in_thread(lambda r=r: store.group(r, 3, RETRY_S)) for r in (0, 1, 1)]
    assert store.claimed_twice.wait(RETRY_S), "the two processes of rank 1 never joined one attempt"
    rank2 = store.group(2, 3, RETRY_S)
    rank0, *rank1 = [outcome() for outcome in joins]
    refused = [g for g in rank1 if isinstance(g, GroupError)]
    assert len(refused) == 1, rank1
    assert str(refused[0]).startswith("init_group: rank 1 joined the store (") and " twice; " in str(refused[0])
    formed([rank0, *[g for g in rank1 if g is not refused[0]], rank2])


@pytest.mark.parametrize("kind", KINDS)
def test_a_second_process_as_rank_0_is_refused_after_a_retry(kind):
    """After rank 1's first join timed out, a second process as rank 0 opens an attempt while the first
    waits in its own: the first is refused, and rank 1 joins the second. Before, the first formed the
    group with rank 1, whose count had moved on past it, and the second waited alone."""
    store = Store(kind)
    with pytest.raises(GroupError, match=r"waiting for ranks \[0\] of 2"):
        store.group(1, 2, SHORT_S)
    first = in_thread(lambda: store.group(0, 2, RETRY_S))
    store.wait_for("mooncake_ep/1/init/world_size")  # the first one's attempt is open
    second = in_thread(lambda: store.group(0, 2, RETRY_S))
    error = first()
    assert isinstance(error, GroupError), error
    assert str(error).startswith("init_group: rank 0 joined the store (") and \
        "twice: another process leads as rank 0" in str(error), error
    rank1 = store.group(1, 2, RETRY_S)
    formed([second(), rank1])


@pytest.mark.parametrize("kind", KINDS)
def test_a_late_rank_does_not_complete_a_join_another_gave_up(kind):
    """Rank 1 gives up on rank 0's attempt (rank 2 has not come); rank 2, coming after, does not complete
    it with rank 0 (before, it did: rank 1's join was still there), and rank 0 learns at once that a
    rank gave up. Then all three join again and meet."""
    store = Store(kind)
    rank0 = in_thread(lambda: store.group(0, 3, RETRY_S))
    store.wait_for("mooncake_ep/1/init/world_size")
    with pytest.raises(GroupError, match=rf"^init_group #0 timed out after {SHORT_S} s waiting for ranks \[2\] of 3 "):
        store.group(1, 3, SHORT_S)
    late = _threads.call_or_error(lambda: store.group(2, 3, SHORT_S))
    assert isinstance(late, GroupError), f"rank 2 completed the join rank 1 gave up on: {late}"
    assert str(late).endswith("keys mooncake_ep/2/*); before it, rank 0's attempt mooncake_ep/1/* failed: a rank "
                              "gave up on it"), late
    error = rank0()
    assert isinstance(error, GroupError), error
    assert str(error).startswith("init_group #0 failed waiting for ranks [2] of 3 (") and \
        "a rank that came gave up first" in str(error), error
    formed(run([lambda r=r: store.group(r, 3, RETRY_S) for r in range(3)]))


@pytest.mark.parametrize("kind", KINDS)
def test_joins_a_gone_rank_0_left_open_do_not_complete(kind):
    """A rank 0 opened attempt 1 and its process is gone (a worker torchrun restarted): rank 1 joins
    that attempt but does not complete it with rank 0's leftover join (before, it did: the group
    formed with a dead rank 0). A new rank 0 closes it, and rank 1 follows it to the next one."""
    store = Store(kind)
    pair = _INIT.pack(_PROTOCOL_VERSION, 2)
    for key, value in (("mooncake_ep/1/init/world_size", pair), ("mooncake_ep/1/c/0/0", _slot_value("init_group", pair))):
        store.set(key, value)
    if kind == "torch":
        store.store.add("mooncake_ep/generation", 1)
    else:
        FakeJaxClient(store.shared).key_value_increment("mooncake_ep/generation", 1)
    with pytest.raises(GroupError, match=rf"^init_group #0 timed out after {SHORT_S} s waiting for ranks \[0\] of 2 "
                                         r"\(every rank had joined; rank 0 did not complete\)"):
        store.group(1, 2, SHORT_S)
    rank1 = in_thread(lambda: store.group(1, 2, RETRY_S))
    formed([store.group(0, 2, RETRY_S), rank1()])


@pytest.mark.parametrize("kind", KINDS)
def test_a_rank_passes_over_an_earlier_group_of_another_world_size(kind):
    """Rank 1 of a group of 2 comes before rank 0, on a prefix where a group of 3 formed: it waits for rank
    0's next attempt instead of reading the earlier one's rank 0 (whose world_size is 3)."""
    store = Store(kind)
    formed(run([lambda r=r: store.group(r, 3, RETRY_S) for r in range(3)]))
    rank1 = in_thread(lambda: store.group(1, 2, RETRY_S))
    formed([store.group(0, 2, RETRY_S), rank1()])


@pytest.mark.parametrize("kind", KINDS)
def test_a_rank_of_another_world_size_in_the_attempt_is_named(kind):
    """Rank 1 started with world_size 2, rank 0 with 3: rank 1 reads rank 0's pair and raises at once;
    rank 0 names it from rank 1's join when its wait ends."""
    store = Store(kind)
    rank0 = in_thread(lambda: store.group(0, 3, SHORT_S))
    with pytest.raises(RankMismatchError, match=r"^init_group: ranks disagree on world_size \(rank 0: 3, rank 1: 2\)"):
        store.group(1, 2, RETRY_S)
    error = rank0()
    assert isinstance(error, RankMismatchError), error
    assert str(error).startswith("init_group: ranks disagree on world_size (rank 0: 3, rank 1: 2)"), error
    assert "waiting for ranks [2] of 3" in str(error), error


def test_groups_of_two_prefixes_built_at_once_by_two_processes_form():
    """Each process builds a group on prefix a and one on prefix b from two threads, in crossed orders.
    One join lock per process and rank across prefixes let process 0 hold it for a while process 1
    held it for b, each waiting for the other's join of the other prefix (helper-164)."""
    dist = pytest.importorskip("torch.distributed")
    store = dist.HashStore()
    connections = [_Connection(store, lambda key, value: None) for _ in range(2)]  # a process each
    joins = [in_thread(lambda r=r, p=p: TorchStoreGroup(connections[r], r, 2, timeout_s=RETRY_S, prefix=p))
             for r, p in ((0, "a"), (1, "b"), (0, "b"), (1, "a"))]
    formed_groups = [outcome() for outcome in joins]
    assert not [g for g in formed_groups if isinstance(g, BaseException)], formed_groups


def test_followers_join_rank_0s_retry_after_its_attempt_failed_before_it_opened():
    """Rank 0 numbered an attempt, then failed (a store error) before opening it: that attempt is decided
    failed, and a follower waiting for it goes on to rank 0's retry. It had waited for the unopened
    attempt's init key until its own timeout, and rank 0's retry timed out too (helper-164)."""
    dist = pytest.importorskip("torch.distributed")
    store = dist.HashStore()

    class Failing(_Connection):  # the compare-and-set that closes the attempt before fails once
        failures = 1

        def compare_set(self, *args):
            if self.failures:
                self.failures -= 1
                raise RuntimeError("a transient store error")
            return self._store.compare_set(*args)
    quiet = lambda key, value: None  # noqa: E731
    formed(run([lambda r=r: TorchStoreGroup(_Connection(store, quiet), r, 2, timeout_s=RETRY_S) for r in range(2)]))
    follower = in_thread(lambda: TorchStoreGroup(_Connection(store, quiet), 1, 2, timeout_s=2 * RETRY_S))
    with pytest.raises(GroupError, match=r"torch store compare_set failed: RuntimeError: a transient store error"):
        TorchStoreGroup(Failing(store, quiet), 0, 2, timeout_s=RETRY_S)
    formed([TorchStoreGroup(_Connection(store, quiet), 0, 2, timeout_s=RETRY_S), follower()])
