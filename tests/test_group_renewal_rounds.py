"""A renew_membership round completes for every rank or for none.

A survivor whose renewal timed out had left its join key, so a late peer completed the round alone:
the two ranks split epochs, and a later renewal paired one rank's round with the other's leftover
slot (an allgather_bytes then returned a peer's payload from a failed call). Survivors' joins are now
claims, held while the process lives and taken back with a failed wait (helper-94). That is all or
none on the TCP store, whose server decides a wait and its claims in one step; a store without
claims deletes a failed rank's join, which only narrows the race (docs: the closing note).
"""
from __future__ import annotations

import pytest

import _threads
from mooncake_ep.cli.launch import free_port
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
