"""A store group whose rendezvous failed here retries in the same namespace, where a late peer meets it,
not in a new one no peer ever comes to (helper-94: the retry had moved on, while the late peer completed
the abandoned namespace with this rank's slot). And renew_membership over JAX's coordination service,
which refused the second rank's set of the epoch key."""
from __future__ import annotations

import pytest

import _threads
from mooncake_ep.group import GroupError, JaxGroup, TorchStoreGroup
from test_group_adapters import FakeJaxClient

SHORT_S, LONG_S = 0.3, 5.0


def makers():
    dist = pytest.importorskip("torch.distributed")
    store = dist.HashStore()
    shared = FakeJaxClient.make_shared()
    return {"torch": lambda r, t: TorchStoreGroup(store, r, 2, timeout_s=t),
            "jax": lambda r, t: JaxGroup(FakeJaxClient(shared), rank=r, world_size=2, timeout_s=t)}


@pytest.mark.parametrize("kind", ["torch", "jax"])
@pytest.mark.parametrize("first", [0, 1])
def test_a_retried_rendezvous_meets_the_late_peer(kind, first):
    """Rank ``first`` times out waiting for its late peer, then retries while the peer comes: both end in
    one namespace and exchange data, and their next group shares one as well."""
    make = makers()[kind]
    with pytest.raises(GroupError, match=r"init_group #0 timed out"):
        make(first, SHORT_S)  # its peer is late
    late = 1 - first
    # Before the fix: the retry went to namespace 2 and timed out, while the late peer completed namespace 1
    # alone with the abandoned slot.
    groups = _threads.run_in_threads([lambda: make(late, LONG_S), lambda: make(first, LONG_S)], 60.0)
    assert all(not isinstance(g, BaseException) for g in groups), groups
    assert groups[0]._namespace == groups[1]._namespace, groups
    got = _threads.run_in_threads([lambda g=g: g.allgather_bytes(bytes([g.rank])) for g in groups], 60.0)
    assert got == [[b"\0", b"\1"]] * 2
    # The next group of both ranks again shares a namespace.
    nxt = _threads.run_in_threads([lambda: make(late, LONG_S), lambda: make(first, LONG_S)], 60.0)
    assert nxt[0]._namespace == nxt[1]._namespace != groups[0]._namespace, nxt


def test_renew_membership_over_jax():
    """Every rank sets {namespace}epoch in a renewal; the coordination service refused the second set
    (ALREADY_EXISTS): the renewal raised on every rank but the first, after moving to the new epoch."""
    shared = FakeJaxClient.make_shared()
    groups = _threads.run_in_threads([lambda r=r: JaxGroup(FakeJaxClient(shared), rank=r, world_size=2, timeout_s=LONG_S)
                                      for r in range(2)], 60.0)
    assert _threads.run_in_threads([g.renew_membership for g in groups], 60.0) == [[], []]
    assert _threads.run_in_threads([lambda g=g: g.allgather_bytes(bytes([g.rank, g.membership_epoch]))
                                    for g in groups], 60.0) == [[b"\0\1", b"\1\1"]] * 2
