"""A renew_membership round completes for every rank or for none.

A survivor whose renewal timed out had left its join key, so a late peer completed the round alone:
the two ranks split epochs, and a later renewal paired one rank's round with the other's leftover
slot (an allgather_bytes then returned a peer's payload from a failed call). Survivors' joins are now
claims, held while the process lives and taken back with a failed wait (helper-94): all or none on
the TCP store, whose server decides a wait and its claims in one step. On a store without claims
(torch's, JAX's) each attempt of the round is decided once, by the first rank to create its decision
key: complete (every rank counted in) or failed (a rank's wait ran out).
"""
from __future__ import annotations

import contextlib
import threading
import time

import pytest

import _threads
from mooncake_ep.cli.launch import free_port
from mooncake_ep._group_common import WITHDRAWN_SUFFIX
from mooncake_ep.group import GroupError, JaxGroup, TCPGroup, TorchStoreGroup
from test_group_adapters import FakeJaxClient

SHORT_S, LONG_S = 0.3, 30.0


def run(fns):
    return _threads.run_in_threads(fns, 60.0)


def pair(kind):
    if kind == "tcp":
        port = free_port()
        return run([lambda r=r: TCPGroup(r, 2, master_port=port, timeout_s=LONG_S) for r in range(2)])
    dist = pytest.importorskip("torch.distributed")
    store = dist.HashStore()
    return run([lambda r=r: TorchStoreGroup(store, r, 2, timeout_s=LONG_S) for r in range(2)])


@pytest.mark.parametrize("kind", ["tcp", "torch"])
def test_a_late_peer_does_not_complete_a_renewal_its_peer_gave_up(kind):
    """Rank 0's renewal times out; rank 1's, later, times out too, naming rank 0 as one that came and
    gave up: both stay at epoch 0, and a retry together meets at epoch 1 with fresh payloads."""
    a, b = pair(kind)
    a.timeout_s = b.timeout_s = SHORT_S
    with pytest.raises(GroupError, match=r"renew_membership #0 \(epoch 1\) timed out"):
        a.renew_membership()
    # Before the fix: b found a's leftover join key and completed epoch 1 alone (epochs 0 and 1).
    with pytest.raises(GroupError, match=r"renew_membership #0 \(epoch 1\) timed out .* waiting for ranks \[0\] of 2 .*"
                                         r"; ranks \[0\] came and gave up first"):
        b.renew_membership()
    assert (a.membership_epoch, b.membership_epoch) == (0, 0)
    a.timeout_s = b.timeout_s = LONG_S
    assert run([a.renew_membership, b.renew_membership]) == [[], []]
    assert run([lambda g=g: g.allgather_bytes(bytes([g.rank, g.membership_epoch])) for g in (a, b)]) == \
        [[b"\0\1", b"\1\1"]] * 2
    run([lambda g=g: g.close() for g in (a, b)])


def test_a_peer_that_comes_just_after_a_renewal_timed_out_is_not_named_as_one_that_gave_up():
    """The check for ranks that came and gave up looked only at their came keys, which a peer arriving
    in that moment has set too: its error told every rank to call again, while that peer still waited
    (helper-146). Such a peer holds its join as well; a retry meets it."""
    a, b = pair("tcp")
    b.timeout_s = SHORT_S
    present, late = b._present, []

    def a_arrives_first(ranks_by_key):  # b's wait has failed: a comes now, before b looks
        if not late:
            late.append(threading.Thread(target=lambda: late.append(_threads.call_or_error(a.renew_membership))))
            late[0].start()
            deadline = time.monotonic() + LONG_S
            while not all(present({key: 0}) for key in ("e1/came/0", "e1/join/0")):
                assert time.monotonic() < deadline
                time.sleep(0.01)
        return present(ranks_by_key)

    b._present = a_arrives_first
    with pytest.raises(GroupError, match=r"renew_membership #0 \(epoch 1\) timed out .* waiting for ranks \[0\] "
                                         r"of 2") as info:
        b.renew_membership()
    assert "gave up first" not in str(info.value), info.value
    b._present = present
    b.timeout_s = LONG_S
    assert b.renew_membership() == []  # meets a, still waiting
    late[0].join(LONG_S)
    assert late[1] == [] and (a.membership_epoch, b.membership_epoch) == (1, 1), late
    run([lambda g=g: g.close() for g in (a, b)])


def test_a_survivor_that_dies_in_a_renewal_is_not_counted_as_joined():
    """Its join key went with its connection: a replacement can take its rank in the same round."""
    port = free_port()
    groups = run([lambda r=r: TCPGroup(r, 3, master_port=port, timeout_s=LONG_S) for r in range(3)])
    groups[2]._client.close()  # rank 2 dies
    groups[1].timeout_s = SHORT_S
    # rank 1 joins round 1 and "dies" in it: its connection closes after its wait failed; before the
    # fix its plain join key stayed, and a replacement of rank 1 was refused as a second one.
    with pytest.raises(GroupError):
        groups[1].renew_membership()
    groups[1]._client.close()
    out = run([groups[0].renew_membership,
               lambda: TCPGroup(1, 3, master_port=port, timeout_s=LONG_S, rejoin=True),
               lambda: TCPGroup(2, 3, master_port=port, timeout_s=LONG_S, rejoin=True)])
    assert out[0] == [1, 2], out
    run([lambda g=g: g.close() for g in (groups[0], out[1], out[2])])


def test_a_rank_whose_process_died_after_giving_up_is_named_missing():
    """Ranks 1 and 2 come to a renewal and give up (ranks 0 and 3 late); rank 2's process then dies. The
    next renewal names rank 2 among the ranks it waits for (a replacement's to take), not as one that
    came and gave up: its 'came' mark was held by its connection, as its join was (helper-95)."""
    port = free_port()
    groups = run([lambda r=r: TCPGroup(r, 4, master_port=port, timeout_s=LONG_S) for r in range(4)])
    for group in groups:
        group.timeout_s = SHORT_S
    for error in run([groups[1].renew_membership, groups[2].renew_membership]):
        assert isinstance(error, GroupError), error
    groups[2]._client.close()  # rank 2's process dies
    errors = run([groups[0].renew_membership, groups[1].renew_membership])
    for error in errors:
        assert isinstance(error, GroupError), error
        assert "waiting for ranks [2, 3] of 4" in str(error), str(error)
        assert "[2] came and gave up" not in str(error), str(error)  # rank 0 may have: it did
    run([lambda g=g: g.close() for g in (groups[0], groups[1], groups[3])])


def test_renew_membership_over_jax():
    """Every rank sets {namespace}epoch in a renewal; JAX's coordination service refuses a key set twice
    unless told to overwrite (ALREADY_EXISTS): the renewal had raised on every rank but the first, after
    moving to the new epoch (helper-94)."""
    shared = FakeJaxClient.make_shared()
    groups = run([lambda r=r: JaxGroup(FakeJaxClient(shared), rank=r, world_size=2, timeout_s=LONG_S)
                  for r in range(2)])
    assert run([g.renew_membership for g in groups]) == [[], []]
    assert run([lambda g=g: g.allgather_bytes(bytes([g.rank, g.membership_epoch])) for g in groups]) == \
        [[b"\0\1", b"\1\1"]] * 2


@pytest.mark.parametrize("kind", ["jax", "torch"])
def test_a_peer_that_read_a_join_before_it_was_given_up_does_not_complete_the_round(kind):
    """Three ranks over a store without claims. Rank 0 gives up a renewal that rank 1 waits in; rank 2
    comes after. JAX's reads of the joins one at a time had let rank 1, which read rank 0's join before
    rank 0 gave up, complete the round with rank 2's (epochs 0, 1, 0: helper-95's split). The round is
    now decided by one counter that rank 0 poisoned: ranks 1 and 2 meet in the next attempt and, rank
    0 not coming, time out as well; a retry of all three then meets, one epoch on."""
    if kind == "jax":
        shared = FakeJaxClient.make_shared()
        groups = run([lambda r=r: JaxGroup(FakeJaxClient(shared), rank=r, world_size=3, timeout_s=LONG_S)
                      for r in range(3)])
    else:
        dist = pytest.importorskip("torch.distributed")
        store = dist.HashStore()
        groups = run([lambda r=r: TorchStoreGroup(store, r, 3, timeout_s=LONG_S) for r in range(3)])
    groups[0].timeout_s, groups[1].timeout_s, groups[2].timeout_s = SHORT_S, 6 * SHORT_S, SHORT_S
    outcome = []
    thread = threading.Thread(target=lambda: outcome.append(_threads.call_or_error(groups[1].renew_membership)))
    thread.start()
    with pytest.raises(GroupError, match=r"renew_membership #0 \(epoch 1\) timed out .* waiting for ranks \[2\] of 3"):
        groups[0].renew_membership()
    with pytest.raises(GroupError, match=r"renew_membership #0 \(epoch 1\) timed out .* waiting for ranks \[0\] of 3 "
                                         r".*; ranks \[0\] came and gave up first"):
        groups[2].renew_membership()
    thread.join(60.0)
    assert len(outcome) == 1 and isinstance(outcome[0], GroupError), outcome
    assert [g.membership_epoch for g in groups] == [0, 0, 0]
    for group in groups:
        group.timeout_s = LONG_S
    assert run([g.renew_membership for g in groups]) == [[], [], []]
    assert run([lambda g=g: g.allgather_bytes(bytes([g.rank, g.membership_epoch])) for g in groups]) == \
        [[b"\0\1", b"\1\1", b"\2\1"]] * 3


@pytest.mark.parametrize("num_ranks", [2, 3])
def test_a_round_that_completes_as_one_rank_gives_up_completes_for_every_rank(num_ranks):
    """Rank 0's wait runs out, and while it reads who came the last rank arrives and completes the round
    (its count makes num_ranks); ranks between wait. Rank 0's 'failed' then finds 'complete' decided, and
    every rank obeys it. (With a poisoned counter, a waiting rank had read the count past world_size as a
    failure while ranks 0 and 2 completed: epochs 1, 0, 1, for good: helper-99.)"""
    dist = pytest.importorskip("torch.distributed")
    store = dist.HashStore()
    groups = run([lambda r=r: TorchStoreGroup(store, r, num_ranks, timeout_s=LONG_S) for r in range(num_ranks)])
    outcomes = []
    waiting = [threading.Thread(target=lambda g=g: outcomes.append(_threads.call_or_error(g.renew_membership)))
               for g in groups[1:-1]]
    for thread in waiting:
        thread.start()
    real_present = groups[0]._present
    arrived = []

    def last_rank_arrives_meanwhile(ranks_by_key):
        arrived.append(run([groups[-1].renew_membership]))
        return real_present(ranks_by_key)

    groups[0]._present = last_rank_arrives_meanwhile
    groups[0].timeout_s = 0.05
    assert groups[0].renew_membership() == []
    for thread in waiting:
        thread.join(60.0)
    assert arrived == [[[]]] and outcomes == [[]] * (num_ranks - 2), (arrived, outcomes)
    assert [g.membership_epoch for g in groups] == [1] * num_ranks
    del groups[0]._present
    assert run([lambda g=g: g.allgather_bytes(bytes([g.rank])) for g in groups]) == \
        [[bytes([r]) for r in range(num_ranks)]] * num_ranks


def test_a_rank_retrying_after_a_store_error_does_not_count_twice():
    """Rank 0's first wait for the decision fails (a store error, not a timeout) after it counted; its
    retry waits in the same attempt without counting again, so the round completes when rank 1 comes, not
    before (a second count had made it 2 without rank 1, and rank 1's then 3: helper-99)."""
    dist = pytest.importorskip("torch.distributed")
    store = dist.HashStore()
    groups = run([lambda r=r: TorchStoreGroup(store, r, 2, timeout_s=LONG_S) for r in range(2)])
    real_get = groups[0]._kv_multi_get
    failures = []

    def fails_once(keys, timeout_s, *args, **kwargs):
        if not failures and keys[0].endswith("/decided"):
            failures.append(keys[0])
            raise GroupError("torch store wait failed: DistNetworkError: (a transient error)")
        return real_get(keys, timeout_s, *args, **kwargs)

    groups[0]._kv_multi_get = fails_once
    with pytest.raises(GroupError, match="a transient error"):
        groups[0].renew_membership()
    groups[0].timeout_s = SHORT_S
    with pytest.raises(GroupError, match=r"renew_membership #1 \(epoch 1\) timed out .* waiting for ranks \[1\] of 2"):
        groups[0].renew_membership()  # alone: counted once, so the round does not complete without rank 1
    attempt = groups[0]._namespace + "e1/a0/"
    assert (store.get(attempt + "count"), store.get(attempt + "decision")) == (b"1", b"failed")
    groups[0].timeout_s = LONG_S
    assert run([g.renew_membership for g in groups]) == [[], []]
    assert [g.membership_epoch for g in groups] == [1, 1]


def test_a_rank_whose_time_ran_out_before_it_waited_decides_at_once():
    """Rank 0's count takes longer than its whole timeout (a slow store); it then decides the attempt
    failed at once. Its wait for the decision had been given the time left, 0, which torch's HashStore
    and FileStore take as no limit: it hung (helper-100)."""
    dist = pytest.importorskip("torch.distributed")
    store = dist.HashStore()
    groups = run([lambda r=r: TorchStoreGroup(store, r, 2, timeout_s=LONG_S) for r in range(2)])
    real_add = groups[0]._kv_add

    def slow_count(key, amount):
        if key.endswith("/count") and amount == 1:
            time.sleep(2 * SHORT_S)
        return real_add(key, amount)

    groups[0]._kv_add = slow_count
    groups[0].timeout_s = SHORT_S
    (error,) = run([groups[0].renew_membership])
    assert isinstance(error, GroupError) and "waiting for ranks [1] of 2" in str(error), error


def test_the_store_stays_the_same_size_however_often_the_ranks_renew():
    """Each renewal claimed alive/e{epoch}/{rank}, the holder of the rank's slots in that epoch's
    collectives, and nothing let it go: a job renewing often grew rank 0's store (keys and claims) by
    world_size per renewal for as long as it ran. A rank now ends its claim of the old epoch once the
    next round completes (every rank has left the old epoch's collectives then)."""
    port = free_port()
    groups = run([lambda r=r: TCPGroup(r, 3, master_port=port, timeout_s=LONG_S) for r in range(3)])
    server = groups[0]._server
    sizes = []
    for _ in range(4):
        assert run([g.renew_membership for g in groups]) == [[], [], []]
        assert run([lambda g=g: g.allgather_bytes(bytes([g.rank])) for g in groups]) == [[b"\0", b"\1", b"\2"]] * 3
        with server._cond:
            sizes.append((len(server._data), len(server._claim_owners)))
    assert sizes == [sizes[0]] * 4, sizes
    with server._cond:
        assert sorted(k for k in server._data if k.startswith("alive/")) == [f"alive/e4/{r}" for r in range(3)]
    # The claims of the current epoch still tell a dead rank at once.
    groups[2]._client.close()
    (error,) = run([groups[0].barrier])
    assert isinstance(error, GroupError) and "ranks [2] left the group" in str(error), error
    run([lambda g=g: g.close(final_barrier=False) for g in groups[:2]])


def test_a_failed_call_and_a_failed_renewal_leave_nothing_in_the_store_once_the_ranks_renew():
    """A collective that timed out left this rank's slot of the call before it (a peer may still have
    been reading it, so it stays until the renewal), and a renewal that timed out left the mark beside
    its withdrawn join: the next renewal deleted neither, so every failure grew the store for good."""
    a, b = pair("tcp")
    run([a.barrier, b.barrier])  # call 1
    a.timeout_s = SHORT_S
    with pytest.raises(GroupError, match=r"barrier #1 timed out"):
        a.barrier()  # call 2: rank 0 alone
    with pytest.raises(GroupError, match=r"renew_membership #0 \(epoch 1\) timed out"):
        a.renew_membership()  # alone too: its join is withdrawn, e1/join/0:withdrawn marks it
    a.timeout_s = LONG_S
    assert run([a.renew_membership, b.renew_membership]) == [[], []]
    server = a._server
    with server._cond:
        left = sorted(k for k in server._data
                      if (k.startswith("c/") and not k.startswith("c/0/")) or k.endswith(WITHDRAWN_SUFFIX))
    assert left == [], left
    assert run([lambda g=g: g.allgather_bytes(bytes([g.rank])) for g in (a, b)]) == [[b"\0", b"\1"]] * 2
    run([lambda g=g: g.close() for g in (a, b)])


@contextlib.contextmanager
def store_without_claims(kind, world_size):
    """(a maker of rank r's group, a lister of the keys the store holds) for a store without claims,
    shared by threads: torch's HashStore, torch's TCPStore (a client per rank; it lists no keys, only
    counts them: the list holds one placeholder per key), or a real jax.distributed coordination
    service with a client per rank."""
    if kind == "jax":
        xla = pytest.importorskip("jax._src.lib")._jax
        address = f"127.0.0.1:{free_port()}"
        service = xla.get_distributed_runtime_service(address, world_size)
        clients = [xla.get_distributed_runtime_client(address, r, init_timeout=int(LONG_S)) for r in range(world_size)]
        run([client.connect for client in clients])
        try:
            yield (lambda r: JaxGroup(clients[r], rank=r, world_size=world_size, timeout_s=LONG_S),
                   lambda: sorted(key for key, _ in clients[0].key_value_dir_get_bytes("mooncake_ep/")))
        finally:
            run([client.shutdown for client in clients])
            service.shutdown()
        return
    dist = pytest.importorskip("torch.distributed")
    if kind == "HashStore":
        store = dist.HashStore()
        yield lambda r: TorchStoreGroup(store, r, world_size, timeout_s=LONG_S), lambda: sorted(store.list_keys())
        return
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, None, True, wait_for_workers=False)
    stores = [server] + [dist.TCPStore("127.0.0.1", port, None, False) for _ in range(world_size - 1)]
    yield (lambda r: TorchStoreGroup(stores[r], r, world_size, timeout_s=LONG_S),
           lambda: ["?"] * server.num_keys())


@pytest.mark.parametrize("kind", ["HashStore", "TCPStore", "jax"])
def test_a_store_without_claims_stays_the_same_size_however_often_the_ranks_renew(kind):
    """Each renewal round on torch's and JAX's stores left its attempt's count, decision and decided
    keys behind for good (the joins went with the next round): a job renewing often grew the store by
    three keys per renewal for as long as it ran. Once the next round completes, every rank has left
    the old one, and its keys go."""
    with store_without_claims(kind, 3) as (make, stored_keys):
        groups = run([lambda r=r: make(r) for r in range(3)])
        sizes = []
        for epoch in range(1, 5):
            assert run([g.renew_membership for g in groups]) == [[], [], []]
            assert run([lambda g=g: g.allgather_bytes(bytes([g.rank, epoch])) for g in groups]) == \
                [[bytes([r, epoch]) for r in range(3)]] * 3
            sizes.append(len(stored_keys()))
        assert sizes == [sizes[0]] * 4, sizes
        if kind != "TCPStore":  # (it lists no keys)
            rounds = sorted({key.split("/a")[0] for key in stored_keys() if "/a" in key})
            assert rounds == [groups[0]._namespace + "e4"], rounds
        run([lambda g=g: g.close() for g in groups])


def test_the_failed_attempts_of_a_renewal_leave_nothing_once_the_ranks_renew_again():
    """Rank 0 alone fails attempt 0 of round 1 (its join stays there, decided failed); both ranks then
    complete round 1 in attempt 1, and round 2. Attempt 0's keys, the failed attempt's joins among them,
    stayed for good; now round 1 leaves nothing once round 2 completes."""
    with store_without_claims("HashStore", 2) as (make, stored_keys):
        a, b = run([lambda r=r: make(r) for r in range(2)])
        a.timeout_s = SHORT_S
        with pytest.raises(GroupError, match=r"renew_membership #0 \(epoch 1\) timed out"):
            a.renew_membership()
        a.timeout_s = LONG_S
        assert run([a.renew_membership, b.renew_membership]) == [[], []]
        assert a._namespace + "e1/a1/decision" in stored_keys()  # (the round completed in attempt 1)
        assert run([a.renew_membership, b.renew_membership]) == [[], []]
        left = [key for key in stored_keys() if key.startswith(a._namespace + "e1/")]
        assert left == [], left
        run([lambda g=g: g.close() for g in (a, b)])


def test_a_rank_whose_renewal_raised_after_its_round_completed_still_finds_the_round():
    """Rank 1's read of the joins fails (a store error) after round 1 completed, so it stays at epoch 0
    while rank 0 is at 1. Rank 0's round 2 cannot complete without rank 1, so round 1's keys are still
    there when rank 1 retries it: it completes round 1, then both complete round 2, and only then does
    round 1 go. (Keys deleted as soon as their own round completed had left rank 1's retry waiting for a
    decision that was gone, until its timeout.)"""
    with store_without_claims("HashStore", 2) as (make, stored_keys):
        a, b = run([lambda r=r: make(r) for r in range(2)])
        real_get, failures = b._kv_multi_get, []

        def fails_once(keys, timeout_s, *args, **kwargs):
            if not failures and keys[0].endswith("/join/0"):
                failures.append(keys[0])
                raise GroupError("torch store get failed: DistNetworkError: (a transient error)")
            return real_get(keys, timeout_s, *args, **kwargs)

        b._kv_multi_get = fails_once
        out = run([a.renew_membership, b.renew_membership])
        assert out[0] == [] and isinstance(out[1], GroupError), out
        assert (a.membership_epoch, b.membership_epoch) == (1, 0)
        a.timeout_s = SHORT_S
        with pytest.raises(GroupError, match=r"renew_membership #1 \(epoch 2\) timed out .* waiting for ranks \[1\]"):
            a.renew_membership()
        a.timeout_s = b.timeout_s = SHORT_S
        assert b.renew_membership() == []  # round 1 again: decided complete, its joins still there
        a.timeout_s = b.timeout_s = LONG_S
        assert run([a.renew_membership, b.renew_membership]) == [[], []]
        assert (a.membership_epoch, b.membership_epoch) == (2, 2)
        assert [key for key in stored_keys() if key.startswith(a._namespace + "e1/")] == []
        assert run([lambda g=g: g.allgather_bytes(bytes([g.rank])) for g in (a, b)]) == [[b"\0", b"\1"]] * 2
        run([lambda g=g: g.close() for g in (a, b)])


def test_replacements_leave_nothing_of_the_dead_processes_in_the_store():
    """A dead process's settled join of its last round and its last collective slots stayed for good, as no
    process of its rank deletes them (its replacement never held them): every replacement grew rank 0's store
    by two keys. Rank 0 now deletes them once the round the replacement joined completes."""
    port = free_port()
    groups = run([lambda r=r: TCPGroup(r, 3, master_port=port, timeout_s=LONG_S) for r in range(3)])
    server = groups[0]._server
    sizes = []
    for victim in (1, 2, 1, 2):
        run([g.renew_membership for g in groups])  # the dead process held a join of a round (e{epoch}/join/...)
        run([g.barrier for g in groups] * 2)  # and slots of two calls
        groups[victim]._client.close()  # it dies
        others = [g for g in groups if g.rank != victim]
        out = run([g.renew_membership for g in others] +
                  [lambda v=victim: TCPGroup(v, 3, master_port=port, timeout_s=LONG_S, rejoin=True)])
        assert out[:2] == [[victim]] * 2, out
        groups[victim] = out[2]
        run([g.barrier for g in groups])
        with server._cond:
            sizes.append(len(server._data))
    assert sizes == [sizes[0]] * 4, sizes
    with server._cond:
        left = sorted(k for k in server._data if k[:1] == "e" and k[1:2].isdigit() and not k.startswith("e8/"))
    assert left == [], left
    run([lambda g=g: g.close() for g in groups])


def test_a_clean_up_that_fails_after_a_round_completed_is_logged_not_raised(caplog):
    """The deletes after a round run once the epoch has advanced: one that raised reported a completed round
    as failed, and the rank renewed again, alone, while its peer went on in the new epoch."""
    a, b = pair("tcp")
    run([a.barrier, b.barrier])  # a slot for the round to delete
    real_delete = a._kv_delete

    def fails(key):
        real_delete(key)
        raise GroupError("store delete failed: (a transient error)")

    a._kv_delete = fails
    with caplog.at_level("WARNING", logger="mooncake_ep"):
        assert run([a.renew_membership, b.renew_membership]) == [[], []]
    assert (a.membership_epoch, b.membership_epoch) == (1, 1)
    assert "renewal round 1 completed; a clean-up step after it failed" in caplog.text, caplog.text
    a._kv_delete = real_delete
    assert run([lambda g=g: g.allgather_bytes(bytes([g.rank])) for g in (a, b)]) == [[b"\0", b"\1"]] * 2
    run([lambda g=g: g.close() for g in (a, b)])
