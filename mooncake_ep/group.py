"""Bootstrap: who the ranks are, an allgather of bytes, and a barrier.

The buffers need only four things from a group: ``rank``, ``world_size``,
``allgather_bytes`` and ``barrier``. This module provides them three ways:

- :class:`TCPGroup`, one process per rank, over a small TCP store served by rank 0 (standard
  library only, in ``_tcp_store.py``; :class:`TCPStoreServer` and :class:`TCPStoreClient` are
  re-exported here), configured like ``torch.distributed``: ``RANK``, ``WORLD_SIZE``,
  ``MASTER_ADDR``, ``MASTER_PORT``.
- Adapters over what the launcher already set up (``_group_adapters.py``): :class:`TorchGroup`
  (a torch ProcessGroup), :class:`TorchStoreGroup` (a torch Store), :class:`MPIGroup` (an mpi4py
  communicator), :class:`JaxGroup` (``jax.distributed``'s key-value client).
- :class:`LocalGroup`, several ranks in one process, one thread per rank (tests, simulation,
  JAX single-controller). Each rank has its own CUDA device and stream.

:func:`init_group` picks the first two for a process: the group it is given, else an initialised
torch.distributed, jax.distributed or mpi4py, else the TCP store from the environment.

Example::

    group = init_group()                       # RANK=0 WORLD_SIZE=2 MASTER_PORT=29500 ...
    group = init_group(torch.distributed.group.WORLD)  # or an mpi4py comm, or "jax"
    peers = group.allgather_bytes(b"my handle")  # [rank 0's bytes, rank 1's bytes]

    def step(group: LocalRankGroup, x: bytes) -> list[bytes]:
        return group.allgather_bytes(x * (group.rank + 1))
    LocalGroup(4).spawn(step, b"ab")           # one result per rank, in rank order

Every wait is bounded by ``timeout_s`` and raises :class:`GroupError` naming the ranks that
never arrived (torch's all_gather and MPI bring their own timeouts, or none: see those adapters);
a group that saw such a failure refuses further calls instead of mixing rounds.

Membership: the store groups (TCP store, torch Store, jax.distributed) have epochs. Every rank
calling ``renew_membership()`` (``Buffer.update_ep_member()`` does) starts the next one, which
also repairs a group broken by a failure; with the TCP store a process can take over the rank of
a dead one, ``init_group(rejoin=True)``, and joins the survivors at that call.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
import time
import weakref
from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Protocol, runtime_checkable

from mooncake_ep import _constants, _group_common, _tcp_store
from mooncake_ep._group_common import (
    DEFAULT_TIMEOUT_S,
    GroupError,
    StoreHoldersGoneError,
    StoreTimeoutError,
    _check_data,
    _check_int,
    _check_port,
    _check_rank,
    _check_timeout,
    _KeyValueGroup,
    _PeerAbortedError,
    _PROBE_S,
    _StoreStalledError,
    _wait_arg,
)
from mooncake_ep._group_adapters import (
    TORCHRUN_AGENT_STORE_VAR,
    _outside_group,
    JaxGroup,
    MPIGroup,
    TorchGroup,
    TorchStoreGroup,
    torchrun_store_group,
)
from mooncake_ep._handshake import RankMismatchError
from mooncake_ep._tcp_store import TCPStoreClient, TCPStoreServer, free_port, retry_pauses

__all__ = [
    "DEFAULT_MASTER_ADDR",
    "DEFAULT_MASTER_PORT",
    "DEFAULT_TIMEOUT_S",
    "Group",
    "GroupError",
    "JaxGroup",
    "LocalGroup",
    "LocalRankGroup",
    "MPIGroup",
    "StoreHoldersGoneError",
    "StoreTimeoutError",
    "TORCHRUN_AGENT_STORE_VAR",
    "TCPGroup",
    "TCPStoreClient",
    "TCPStoreServer",
    "TorchGroup",
    "TorchStoreGroup",
    "free_port",
    "init_group",
    "is_communicator",
]

logger = logging.getLogger("mooncake_ep")

# torch.distributed's defaults, so launch scripts written for torchrun work unchanged.
DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_MASTER_PORT = 29500


def __getattr__(name: str) -> Any:
    """The store's internals (``_pack_key``, ``_OP_SET``, ``_TAGS``, ...) were defined here before they
    moved to ``_tcp_store.py`` and ``_group_common.py``; ``from mooncake_ep.group import <name>``
    keeps finding them (PEP 562)."""
    for module in (_tcp_store, _group_common):
        if not name.startswith("__") and hasattr(module, name):
            return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@runtime_checkable
class Group(Protocol):
    """What the buffers need from a set of ranks: the four members below, which ``isinstance``
    checks (and any object with them is a Group, as the Buffer takes it).

    Attributes:
        rank: this rank's index in ``[0, world_size)``.
        world_size: number of ranks.

    Optional attributes, read where present: ``is_in_process`` (True only for
    :class:`LocalRankGroup`: all ranks share this process; absent reads False) and ``device`` (the
    CUDA device ordinal this rank uses; absent or None: not set, the CPU or the caller's choice).
    The groups of this module have both.
    """

    rank: int
    world_size: int

    def allgather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank's ``data``, in rank order. Collective: every rank must call it."""

    def barrier(self) -> None:
        """Return once every rank has entered the barrier. Collective."""

    # Optional, and not part of the runtime check: ``renew_membership() -> list[int]`` (the store
    # groups have it) starts the group's next membership epoch; Buffer.update_ep_member calls it
    # when it is there. With ``membership_epoch`` (an int) and ``broken`` (None while sound) too,
    # the updates of several Buffers renew once per change of members; without, every update renews.


# ----------------------------------------------------------------------------- TCPGroup


class TCPGroup(_KeyValueGroup):
    """One rank of a multi-process group, bootstrapped over a TCP store served by rank 0.

    Construction is a rendezvous: it returns once all ``world_size`` ranks have joined (or
    raises). Every collective then publishes ``f"c/{seq}/{rank}"`` for a per-call sequence
    number ``seq`` and waits for the other ranks' keys of the same ``seq``, so consecutive calls
    never mix. Each rank deletes its key of call ``seq - 1`` once call ``seq`` completes (all
    peers have read it by then), so the store stays small; its key of the rendezvous stays, as the
    record that the rank joined.

    Args:
        rank: this process's rank in ``[0, world_size)``; rank 0 serves the store.
        world_size: number of processes. 1 needs no network at all.
        master_addr: rank 0's address (MASTER_ADDR).
        master_port: the store's port (MASTER_PORT), in ``[1, 65535]``; None: ``store_socket``'s
            port where it is given, else 29500.
        timeout_s: seconds any rendezvous or collective waits for its peers (math.inf = forever);
            can be changed later through :attr:`timeout_s`.
        device: CUDA device ordinal this rank uses (reported as :attr:`device`), None = unset.
        rejoin: take over ``rank`` from a process of this group that died: check rank 0's
            world_size, wait for the dead process's store connection to be gone, then join the
            running ranks' next :meth:`renew_membership` (``Buffer.update_ep_member`` on the
            survivors), instead of the first rendezvous; all of it within ``timeout_s``. Rank 0
            cannot be taken over: it serves the store.
        store_socket: rank 0 only: a TCP socket already listening on ``master_port``, bound to
            ``master_addr`` (one of its addresses) or to all addresses, which the store serves
            instead of binding the port itself. A launcher that binds it and passes it to rank 0
            holds the port throughout: a port chosen free, released and bound again could be
            taken by another program in between. Who closes it: refused with the arguments
            (TypeError, ValueError), nobody, it stays the caller's; otherwise the group, with
            world_size 1 at once, else with its store: when the group closes (or is dropped), or
            when the constructor raises.

    Raises:
        GroupError: the port is taken (rank 0), rank 0 is unreachable, a rank joined twice (or,
            without ``rejoin``, joined again after its process died), or some ranks did not join
            within ``timeout_s``. With ``rejoin``: the rank never joined, its first process is
            still connected, or the running ranks did not renew the membership within ``timeout_s``.
            Rank 0, whose store closes when it raises, first waits for the ranks connected to it
            to hang up, at most ``min(timeout_s, 30 s)`` more, so that those whose own wait ends
            meanwhile raise their own error, not "store closed".
        RankMismatchError: ranks were started with different ``world_size`` (or this ``rank`` is
            outside rank 0's group), naming each rank's value. Raised on this rank at once when
            rank 0's value differs from its own; rank 0's group raises it as soon as the rank's
            value arrives in its round, or when its wait for the ranks that never come runs out.
            Rank 0, whose store closes when it raises, first waits for the ranks of a larger
            world_size beyond its own to read why (up to 30 s, within ``timeout_s``). With
            ``rejoin``, raised on this rank alone, before it joins anything.
        ValueError: ``rejoin=True`` with rank 0; ``store_socket`` on another rank than 0, not a
            TCP socket listening on ``master_port``, or bound to an address not ``master_addr``'s.

    Note:
        After any :class:`GroupError` from a collective the group is broken: the ranks no longer
        agree on the sequence number, so every later call raises at once, until every rank calls
        :meth:`renew_membership`. :meth:`close` on rank 0 stops the store, after a final barrier
        by default.

        Each rank holds a claim in the store while its connection is open (see
        ``TCPStoreClient.claim``): the OS closes a dead process's socket, which is what lets a
        replacement in. A host that vanishes without closing its sockets (power loss) keeps its
        claim until TCP gives the connection up.

        The rendezvous completes for every rank or for none. Each rank's slot in it is a claim,
        which the round settles once every rank's is there; a rank whose wait runs out first takes
        its slot with it in the same step (the others' errors then say it came and left), and a
        rank that dies first loses it with its connection. So no rank starts a group with a rank
        that has left, and a process restarted in place of one that left before the round
        completed joins as a first one does. Once the round completed, the rank counts as joined:
        a process taking it over must say ``rejoin=True``. (A rank whose own link to the store fails,
        or that is interrupted, just as the store answers that the round completed raises while the
        others complete: as a rank that dies right after joining, which the kernels mask.)
    """

    _takes_replacements = True

    _store_closes_with_rank0 = True

    def __init__(self, rank: int, world_size: int, *, master_addr: str = DEFAULT_MASTER_ADDR,
                 master_port: int | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                 device: int | None = None, rejoin: bool = False, store_socket: Any = None) -> None:
        self.rank, self.world_size = _check_rank("TCPGroup", rank, world_size)
        if not isinstance(rejoin, bool):
            raise TypeError(f"TCPGroup: rejoin must be a bool, got {type(rejoin).__name__}")
        if rejoin and self.rank == 0:
            raise ValueError("TCPGroup: rejoin=True cannot take over rank 0: rank 0 serves the store, which "
                             "died with it; restart every rank")
        self._rejoin = rejoin
        if not isinstance(master_addr, str) or not master_addr:
            raise TypeError(f"TCPGroup: master_addr must be a non-empty str, got {master_addr!r}")
        self.master_addr = master_addr
        if master_port is None:
            master_port = _tcp_store._listening_port(store_socket) or DEFAULT_MASTER_PORT
        self.master_port = _check_port("TCPGroup", master_port)
        if store_socket is not None:
            if self.rank != 0:
                raise ValueError(f"TCPGroup: store_socket is rank 0's, which serves the store; rank {self.rank} "
                                 f"connects to it: leave it out")
            _tcp_store._check_listen_socket("TCPGroup", store_socket, self.master_port, "store_socket", master_addr)
        self.device = None if device is None else _check_int("TCPGroup", "device", device, 0)
        self._init_collectives(_check_timeout("TCPGroup", timeout_s))
        self._server: TCPStoreServer | None = None
        self._client: TCPStoreClient | None = None
        if self.world_size == 1:
            if store_socket is not None:  # the group's to close, and no store needs it
                store_socket.close()
            return
        deadline = time.monotonic() + self._timeout_s  # the connection and the rendezvous together
        try:
            if self.rank == 0:
                self._server = TCPStoreServer(master_addr, self.master_port, listen_socket=store_socket)
            self._client = TCPStoreClient(master_addr, self.master_port, timeout_s=self._timeout_s,
                                          who=f"rank {self.rank}")
            # A group dropped without close() still hangs up, and rank 0's stops its store (its port
            # and thread would stay taken for the life of the process).
            weakref.finalize(self, _release_store, self._client, self._server)
            if rejoin:
                # Before anything is joined: a replacement of another world_size, its join key settled
                # by the running ranks' renewal, would make that renewal and every later one fail.
                try:  # a running group's rank 0 published its pair long ago
                    self._check_rank0(self._init_pair(), time.monotonic() + _PROBE_S)
                except _StoreStalledError:  # rank 0's process is there, and stalled: said as such
                    raise
                except GroupError:  # (not a RankMismatchError, which is a ValueError)
                    raise GroupError(self._never_joined("no group's rank 0 serves this store")) from None
                self._claim_rank_to_take_over(deadline)
                self._join_as_replacement(deadline)
            else:
                self._rendezvous(deadline)
        except BaseException as exc:
            # A rank 0 whose rendezvous failed keeps its store up until the peers connected now have
            # hung up: closed at once, it cut them off with "store closed" before they could read why.
            # Ranks started differently raise once they read its world_size or the round's pairs;
            # ranks started with the same timeout_s a moment after it, when their own wait runs out,
            # naming the rank that never came and rank 0 as one that came and left. A rank whose wait
            # ends later than the grace still finds the store closed. (Ranks beyond its world_size
            # that may still be starting it waited for in _rendezvous.)
            drain_s = 0.0
            if isinstance(exc, (RankMismatchError, GroupError)) and self._server is not None:
                num_peers = self._server.num_clients - (self._client is not None)  # its own client too
                if num_peers > 0:
                    drain_s = min(self._timeout_s, _group_common._MISMATCH_GRACE_S)
                    logger.warning("init_group: rank 0 failed to join; it keeps the store up until the ranks "
                                   "connected to it (%d) have hung up, %g s at most, then raises", num_peers, drain_s)
            self._shutdown(drain_s=drain_s)
            raise

    def __repr__(self) -> str:
        return (f"TCPGroup(rank={self.rank}, world_size={self.world_size}, "
                f"store={self.master_addr}:{self.master_port})")

    def _kv_set(self, key: str, value: bytes) -> None:
        self._store().set(key, value)

    def _kv_add(self, key: str, amount: int) -> int:
        return self._store().add(key, amount)

    def _kv_multi_get(self, keys: Sequence[str], timeout_s: float, reply_bytes: int = 0,
                      settle: bool = False, holders: Sequence[str] | None = None) -> list[bytes]:
        return self._store().multi_get(keys, timeout_s, reply_bytes=reply_bytes, settle_claims=settle,
                                       withdraw_claims=settle, holders=holders)

    def _holder_keys(self) -> list[str]:
        return [self._alive_key(self._epoch, rank) for rank in range(self.world_size)]

    def _alive_key(self, epoch: int, rank: int) -> str:
        """Held by ``rank``'s process of membership epoch ``epoch`` while it lives: the holder of that
        rank's slots in the epoch's collectives. Per epoch, not ``member/{rank}``: a replacement holds
        that one at once, while the dead process's slots of the current epoch still never come."""
        return f"{self._namespace}alive/e{epoch}/{rank}"

    def _hold_alive(self, epoch: int) -> None:
        # Before this process's join of the epoch's round (or slot of the rendezvous): once the round
        # completes, every member holds its key, so no collective of the epoch finds one missing early.
        # A retried round finds its own claim (claim() is False then: only this process has this rank).
        self._store().claim(self._alive_key(epoch, self.rank), self._claim_value())

    def _release_alive(self, epoch: int) -> None:
        # Else one claim per renewal stayed for the life of the process: the store grew without bound.
        self._store().delete(self._alive_key(epoch, self.rank))

    @staticmethod
    def _claim_value() -> bytes:
        """What this process's claims hold: who holds them, for whoever reads one."""
        return f"pid {os.getpid()}".encode()

    def _kv_delete(self, key: str) -> None:
        self._store().delete(key)

    def _kv_set_while_connected(self, key: str, value: bytes) -> bool:
        return self._store().claim(key, value)

    def _max_value_bytes(self) -> int | None:
        return _tcp_store._MAX_VALUE_BYTES

    @_KeyValueGroup.timeout_s.setter
    def timeout_s(self, value: float) -> None:
        # The store connection's own requests (sets, claims) wait as long as the collectives.
        _KeyValueGroup.timeout_s.fset(self, value)
        if self._client is not None:
            self._client.timeout_s = self._timeout_s

    def _claim_rank(self, first_slot: bytes) -> bool:
        """Hold ``member/{rank}`` for as long as this connection lives, then this rank's slot of the
        rendezvous round (``first_slot``), as a claim too.

        The member claim refuses a second live process with this rank. The slot stays only if the
        round completes for every rank (it settles the slots; a rank whose wait fails withdraws
        its own, and a dead process's claim goes with its connection), so a slot already there
        means a process with this rank joined before and has exited: it must say ``rejoin=True``.
        A process that died before the round completed left nothing: its restart joins afresh.
        """
        store, who = self._store(), self._claim_value()
        if not store.claim(f"member/{self.rank}", who):
            raise GroupError(f"init_group: rank {self.rank} joined the store ({self._where()}) twice; "
                             f"{self._same_rank_hint}")
        self._hold_alive(0)
        slot = self._first_slot_key(self.rank)
        if not store.claim(slot, first_slot):
            held = self._present({slot: self.rank})
            if held is None:
                raise GroupError(f"init_group: rank {self.rank} lost the store ({self._where()}) while it joined")
            if held and held[slot][1] != first_slot:
                # Left by a process of this rank started with another world_size, which shows it to
                # the round's ranks and leaves (_check_rank0). Not taken over: ranks that read it in
                # a complete round have raised, and this rank would complete it with the others.
                raise GroupError(f"init_group: rank {self.rank}'s slot of the rendezvous ({self._where()}) "
                                 f"holds the world_size of a process of this rank started with another one, "
                                 f"which ranks waiting in the round may have read and raised on: restart every "
                                 f"rank with the same world_size (WORLD_SIZE)")
            raise GroupError(f"init_group: rank {self.rank} joined the store ({self._where()}) before and "
                             f"that process has exited; a process taking over its rank must join with "
                             f"init_group(rejoin=True)")
        return True

    def _claim_rank_to_take_over(self, deadline: float) -> None:
        """Hold ``member/{rank}`` once the dead process's claim on it is gone (retrying until
        ``deadline``, a ``time.monotonic()``), then check that the rank joined the group: its
        rendezvous slot is there."""
        store, who = self._store(), self._claim_value()
        # The store frees the claim when it sees the old connection close, a moment after the
        # old process died: a replacement started at once retries until then.
        pauses = retry_pauses(deadline)
        while not store.claim(f"member/{self.rank}", who):
            if not next(pauses, False):
                raise GroupError(f"init_group(rejoin=True): rank {self.rank} is still held by a live process "
                                 f"after {self._timeout_s} s ({self._where()}): a replacement takes over only a "
                                 f"rank whose process has exited")
        # Looked at once the member claim is ours: the old process's connection is closed, so a
        # slot of a round it never completed is gone with it.
        try:
            self._kv_multi_get([self._first_slot_key(self.rank)], _PROBE_S)
        except StoreTimeoutError:
            raise GroupError(self._never_joined("no process of this rank completed the rendezvous")) from None

    def _never_joined(self, why: str) -> str:
        return (f"init_group(rejoin=True): rank {self.rank} never joined the group at {self._where()} ({why}): "
                f"there is nothing to take over; join without rejoin")

    def _store(self) -> TCPStoreClient:
        assert self._client is not None  # internal invariant: world_size > 1 and not shut down
        return self._client

    def _where(self) -> str:
        return f"MASTER_ADDR={self.master_addr}, MASTER_PORT={self.master_port}"

    def _shutdown(self, drain_s: float) -> None:
        """Hang up; on rank 0, stop the store once the peers hung up (at most ``drain_s`` seconds)."""
        if self._client is not None:
            self._client.close()
        if self._server is not None:
            self._server.close(wait_for_clients_s=min(drain_s, self._timeout_s))


def _release_store(client: TCPStoreClient, server: TCPStoreServer | None) -> None:
    client.close()
    if server is not None:
        server.close()


# ----------------------------------------------------------------------------- init_group


def _env_int(where: str, var: str, arg: str, default: int | None = None) -> int:
    raw = os.environ.get(var)
    if raw is None:
        if default is not None:
            return default
        raise ValueError(f"{where}: {arg} was not given and the environment variable {var} is not "
                         f"set; pass {where}({arg}=...) or export {var} (torchrun and most "
                         f"launchers set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT), or pass "
                         f"{where}(group=...) a torch ProcessGroup, an mpi4py communicator or 'jax'")
    # ASCII digits only: int() also takes '1_0' (10) and other scripts' digits, a typo read as another rank.
    # Surrounding whitespace (a value read from a file) is dropped, as for MASTER_ADDR.
    if not re.fullmatch(r"[-+]?[0-9]+", raw.strip()):
        raise ValueError(f"{where}: environment variable {var} must be an integer, got {raw!r}")
    return int(raw)


def init_group(group: Any = None, *, rank: int | None = None, world_size: int | None = None,
               master_addr: str | None = None, master_port: int | None = None,
               timeout_s: float = DEFAULT_TIMEOUT_S, device: int | None = None, rejoin: bool = False,
               store_socket: Any = None) -> Group:
    """Join the group of processes this one belongs to, over what the launcher set up.

    ``group`` chooses the bootstrap; left as None, the first of these that applies is used:

    1. ``rank``, ``world_size``, ``master_addr``, ``master_port`` or ``store_socket`` given:
       mooncake_ep's TCP store.
    2. ``torch.distributed`` initialised (its default group): :class:`TorchGroup`.
    3. ``jax.distributed`` initialised: :class:`JaxGroup`.
    4. mpi4py's ``MPI`` module already imported, with more than one process: :class:`MPIGroup`
       over ``COMM_WORLD``.
    5. A torchrun worker (``TORCHELASTIC_USE_AGENT_STORE=True``): a :class:`TorchStoreGroup` over
       the store torchrun's agent serves at ``MASTER_ADDR:MASTER_PORT``, with ``RANK`` and
       ``WORLD_SIZE``.
    6. Otherwise the TCP store, configured from the environment as with ``torch.distributed``:
       ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` (default ``127.0.0.1`` where unset; set and
       empty is refused), ``MASTER_PORT`` (default 29500).

    Steps 2 to 5 come before the environment's TCP store because under torchrun ``MASTER_PORT``
    is already served by torch's own store: a second store could not listen there. Detection
    never imports torch, jax or mpi4py; it only looks at those already imported (step 5 imports
    torch, which torchrun implies).

    Args:
        group: None (see above); a torch ``ProcessGroup`` (:class:`TorchGroup`); a
            ``torch.distributed.Store`` (:class:`TorchStoreGroup`, with ``rank`` and
            ``world_size`` from the arguments or RANK/WORLD_SIZE); an mpi4py communicator
            (:class:`MPIGroup`); ``"torch"`` (the default ProcessGroup), ``"jax"``
            (:class:`JaxGroup`) or ``"tcp"`` (the TCP store, from the arguments and environment);
            or an object that already is a :class:`Group`, returned as is.
        rank: this process's rank in ``[0, world_size)``. With an adapter that knows the rank,
            a different value is refused.
        world_size: number of processes; 1 returns at once and uses no network.
        master_addr: rank 0's host, where the TCP store listens (TCP store only).
        master_port: the TCP store's port (TCP store only); None: MASTER_PORT, else
            ``store_socket``'s port where it is given, else 29500.
        store_socket: on rank 0, a socket already listening on the store's port, which the store
            serves instead of binding it (see :class:`TCPGroup`, which says who closes it; TCP
            store only). Refused with the arguments, it stays the caller's.
        timeout_s: seconds every rendezvous and collective waits for its peers (math.inf =
            forever). torch's all_gather and MPI have no per-call timeout: see each adapter.
        device: CUDA device ordinal this rank uses (the group's ``device``), None = unset.
        rejoin: this process replaces a dead process of a running TCP-store group (same RANK,
            WORLD_SIZE, MASTER_ADDR, MASTER_PORT): it returns once the running ranks have renewed
            the membership (``Buffer.update_ep_member()``); see :class:`TCPGroup`. TCP store only.

    Returns:
        A :class:`TCPGroup`, :class:`TorchGroup`, :class:`TorchStoreGroup`, :class:`MPIGroup` or
        :class:`JaxGroup`, joined: every rank has arrived.

    Raises:
        TypeError: ``group`` is none of the kinds above.
        ValueError: the TCP store's RANK or WORLD_SIZE is neither given nor set, a variable is
            not an integer, MASTER_ADDR is set but empty (or only whitespace), rank is outside
            ``[0, world_size)``, ``master_addr``/``master_port``
            were given with an adapter, ``rank``/``world_size`` contradict the adapter's, or
            ``rejoin=True`` with anything but the TCP store (or with rank 0).
        GroupError: as the chosen group's constructor (a peer that never joins is named).
        RankMismatchError: the store groups' ranks were started with different ``world_size``
            (each rank's value named), as the chosen group's constructor.
    """
    where = "init_group"
    timeout_s = _check_timeout(where, timeout_s)
    if not isinstance(rejoin, bool):
        raise TypeError(f"{where}: rejoin must be a bool, got {type(rejoin).__name__}")
    if isinstance(group, str) and group not in _GROUP_NAMES:
        raise ValueError(f"{where}: group must be one of {list(_GROUP_NAMES)} when a str, got {group!r}")
    tcp_args = [name for name, value in (("master_addr", master_addr), ("master_port", master_port),
                                         ("store_socket", store_socket)) if value is not None]
    if group is None and not tcp_args and rank is None and world_size is None and not rejoin:
        group = _detect_group()
    if group is None and not tcp_args and rank is None and world_size is None and not rejoin \
            and os.environ.get(TORCHRUN_AGENT_STORE_VAR) == "True":
        rank, world_size, master_addr, master_port = _tcp_settings(where, None, None, None, None)
        return torchrun_store_group(rank, world_size, master_addr, master_port, timeout_s=timeout_s, device=device)
    if group is None or group == "tcp":
        return _init_tcp_group(where, rank, world_size, master_addr, master_port, timeout_s, device, rejoin,
                               store_socket)
    if rejoin:
        raise ValueError(f"{where}: rejoin=True takes over a rank of mooncake_ep's TCP store group (whose rank "
                         f"claims end with their process); with group={_describe(group)} leave it out")
    if tcp_args:
        verb, them = ("configures", "it") if len(tcp_args) == 1 else ("configure", "them")
        raise ValueError(f"{where}: {' and '.join(tcp_args)} {verb} the TCP store; with group={_describe(group)} "
                         f"leave {them} out")
    if group == "jax":
        return JaxGroup(rank=rank, world_size=world_size, timeout_s=timeout_s, device=device)
    outside = _outside_group(group)
    if outside is not None:
        raise ValueError(f"{where}: group is {outside}: this process is not a member of that group; build "
                         f"the Buffer on the ranks of the group only, or on a group this process belongs to")
    torch_kind = _torch_kind(group)
    if torch_kind == "store":
        rank = _env_int(where, "RANK", "rank") if rank is None else rank
        world_size = _env_int(where, "WORLD_SIZE", "world_size") if world_size is None else world_size
        return TorchStoreGroup(group, rank, world_size, timeout_s=timeout_s, device=device)
    if group == "torch" or torch_kind == "process_group":
        adapter: Group = TorchGroup(None if group == "torch" else group, device=device, timeout_s=timeout_s)
    elif isinstance(group, Group):
        adapter = group
    elif _is_mpi_communicator(group):
        adapter = MPIGroup(group, device=device)
    else:
        raise TypeError(f"{where}: group must be None, a torch ProcessGroup or Store, an mpi4py communicator, "
                        f"one of {list(_GROUP_NAMES)} or a mooncake_ep Group, got {_describe(group)}")
    _check_same(where, "rank", rank, adapter.rank)
    _check_same(where, "world_size", world_size, adapter.world_size)
    _check_same(where, "device", device, getattr(adapter, "device", None))
    return adapter


def _tcp_settings(where: str, rank: int | None, world_size: int | None, master_addr: str | None,
                  master_port: int | None, default_port: int = DEFAULT_MASTER_PORT) -> tuple[int, int, str, int]:
    """(rank, world_size, master_addr, master_port): the arguments given, the rest from the
    environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; ``default_port`` where that is unset),
    checked. A value out of range that came from the environment is refused with the variables read,
    which the caller set, not the argument."""
    from_env = {}
    if rank is None:
        rank = from_env["RANK"] = _env_int(where, "RANK", "rank")
    if world_size is None:
        world_size = from_env["WORLD_SIZE"] = _env_int(where, "WORLD_SIZE", "world_size")
    if master_addr is None:
        raw_addr = os.environ.get("MASTER_ADDR")
        # Only an unset one means the default, as torch's env:// refuses an empty one: set and empty is
        # a launcher's variable that expanded to nothing, and 127.0.0.1 is wrong on any other host.
        if raw_addr == "":
            raise ValueError(f"{where}: environment variable MASTER_ADDR is empty; set it to rank 0's host, or "
                             f"unset it for {DEFAULT_MASTER_ADDR}")
        if raw_addr and not raw_addr.strip():
            raise ValueError(f"{where}: environment variable MASTER_ADDR is only whitespace: {raw_addr!r}")
        master_addr = (raw_addr or "").strip() or DEFAULT_MASTER_ADDR  # '10.0.0.1\n' read from a file
    if master_port is None:
        master_port = _env_int(where, "MASTER_PORT", "master_port", default_port)
        if "MASTER_PORT" in os.environ:
            from_env["MASTER_PORT"] = master_port

    def checked(check, *variables):
        try:
            return check()
        except ValueError as exc:
            read = ", ".join(f"{var}={from_env[var]}" for var in variables if var in from_env)
            if not read:  # the values were arguments
                raise
            raise ValueError(f"{exc} (read from the environment: {read})") from None
    rank, world_size = checked(lambda: _check_rank(where, rank, world_size), "RANK", "WORLD_SIZE")
    master_port = checked(lambda: _check_port(where, master_port), "MASTER_PORT")
    return rank, world_size, master_addr, master_port


def _init_tcp_group(where: str, rank: int | None, world_size: int | None, master_addr: str | None,
                    master_port: int | None, timeout_s: float, device: int | None, rejoin: bool,
                    store_socket: Any) -> TCPGroup:
    # A store socket given alone names the port: rank 0's launcher bound it (the other ranks need MASTER_PORT).
    default_port = _tcp_store._listening_port(store_socket) or DEFAULT_MASTER_PORT
    rank, world_size, master_addr, master_port = _tcp_settings(where, rank, world_size, master_addr, master_port,
                                                               default_port)
    if rejoin and rank == 0:
        raise ValueError(f"{where}: rejoin=True cannot take over rank 0: rank 0 serves the store, which died "
                         f"with it; restart every rank")
    return TCPGroup(rank, world_size, master_addr=master_addr, master_port=master_port,
                    timeout_s=timeout_s, device=device, rejoin=rejoin, store_socket=store_socket)


# What init_group(group=<str>) accepts.
_GROUP_NAMES = ("tcp", "torch", "jax")


def _detect_group() -> str | Any | None:
    """What init_group() uses with no arguments: see its steps 2 to 4; None = the TCP store."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return "torch"
    jax_distributed = sys.modules.get("jax._src.distributed")
    if getattr(getattr(jax_distributed, "global_state", None), "client", None) is not None:
        return "jax"
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized() and mpi.COMM_WORLD.Get_size() > 1:
        return mpi.COMM_WORLD
    return None


def is_communicator(obj: Any) -> bool:
    """Whether ``obj`` is a torch ProcessGroup or an mpi4py communicator: the groups of other libraries
    that ``init_group(obj)`` wraps with nothing else given (as Buffer does, where Mooncake EP's and
    DeepEP's Buffers take a ProcessGroup). What those libraries give a process outside a group counts
    too, for init_group to name."""
    return _torch_kind(obj) == "process_group" or _is_mpi_communicator(obj) or _outside_group(obj) is not None


def _is_mpi_communicator(obj: Any) -> bool:
    return all(callable(getattr(obj, m, None)) for m in ("Get_rank", "Get_size", "allgather", "Barrier"))


def _torch_kind(obj: Any) -> str | None:
    """"process_group", "store" or None, without importing torch (a torch object means it is)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available():
        return None
    if isinstance(obj, dist.ProcessGroup):
        return "process_group"
    if isinstance(obj, dist.Store):
        return "store"
    return None


def _check_same(where: str, name: str, given: int | None, actual: int | None) -> None:
    if given is not None and given != actual:
        raise ValueError(f"{where}: {name}={given} differs from the group's {name} {actual}; leave it out")


def _describe(obj: Any) -> str:
    return repr(obj) if isinstance(obj, str) else f"{type(obj).__module__}.{type(obj).__name__}"


# ----------------------------------------------------------------------------- LocalGroup


class LocalRankGroup:
    """One rank of a :class:`LocalGroup`; what ``spawn`` passes to each rank's function.

    Attributes:
        rank: this rank's index in ``[0, world_size)``.
        world_size: the LocalGroup's ``num_ranks``.
        device: the LocalGroup's ``devices[rank]``, or None without devices.
        local_group: the parent :class:`LocalGroup`.
    """

    is_in_process = True

    def __init__(self, local_group: LocalGroup, rank: int) -> None:
        self.local_group = local_group
        self.rank = rank
        self.world_size = local_group.num_ranks
        self.device = None if local_group.devices is None else local_group.devices[rank]
        self._seq = 0
        self._num_calls: Counter[str] = Counter()
        self._stream_calls = local_group._stream_calls
        self._in_collective = threading.Lock()  # held by the thread in one of this rank's collectives

    def __repr__(self) -> str:
        return f"LocalRankGroup(rank={self.rank}, world_size={self.world_size}, device={self.device})"

    @property
    def comm_stream(self) -> Any:
        """This rank's communication stream (a ``cupy.cuda.Stream``, made with its own stream by
        ``spawn``; None without devices): the Buffers of this rank run ``async_finish`` calls there."""
        return self.local_group._comm_streams[self.rank]

    @property
    def stream_ptr(self) -> int | None:
        """Address (``cudaStream_t``) of this rank's own stream, set current by ``spawn``.

        None without devices, or before the first ``spawn`` created it.
        """
        stream = self.local_group._streams[self.rank]
        return None if stream is None else int(stream.ptr)

    def claim_stream(self, device_id: int, stream_ptr: int, call: Hashable) -> int | None:
        """Note that this rank's ``call`` runs on stream ``stream_ptr`` of ``device_id``, unless
        another rank's same call already ran there: that rank is returned, and nothing is noted.

        ``call`` names one collective call, equal on every rank that makes it (a Buffer's name and
        the count of its calls). Ranks whose calls of one collective share a stream serialise: a
        rank's receive half, waiting for a peer's send queued behind it, could only time out and
        mask a healthy peer (the Buffers refuse such a call). Calls of different collectives may
        share a stream (ranks that swap streams between steps): each waits only for its own
        collective's peers, whose calls are issued already.
        """
        # cudaStreamPerThread (2) is a stream per thread, and so not shared by two threads' ranks.
        per_thread = stream_ptr == _constants.PER_THREAD_DEFAULT_STREAM
        key = (device_id, threading.get_ident() if per_thread else stream_ptr)
        # No lock (this is every call's path): two ranks' same call interleaved between the lookup and
        # the store could both pass, once; a program that shares a stream does so every step, and the
        # next step's call is caught.
        owner = self._stream_calls.get(key)
        if owner is not None and owner[1] == call and owner[0] != self.rank:
            return owner[0]
        self._stream_calls[key] = (self.rank, call)
        return None

    def claim_call(self, name: Hashable, call: Hashable) -> tuple[int, Hashable] | None:
        """Note that this rank makes the call ``name`` with arguments ``call``, unless another rank
        made it already with other arguments: that rank and its arguments are returned, and nothing
        is noted (the caller refuses its call; a retry with the first rank's arguments then passes).
        So are, to the first rank retrying with other arguments a call a peer made alike and has not
        withdrawn (it launched, or may yet), that peer and the noted arguments.

        ``name`` is equal on every rank that makes the call (a Buffer's name and a dispatch's number);
        ``call`` is what the ranks must agree on (values compared with ``==``). The kernels of ranks
        in one process find a peer's regions at their own offsets, so a rank whose T differs from its
        peers' would read and write the wrong bytes; ranks in processes check the same with a
        collective, which in-process ranks driven by one thread (a single controller) cannot make.
        Each rank whose claim passed then reports its launch (:meth:`confirm_call`) or its failure
        before it (:meth:`withdraw_call`); a note goes once no rank launched against it and none
        that made the call alike is still on its way, so ranks that all failed may call otherwise.
        What this cannot catch: ranks more than ``_CALLS_KEPT`` calls apart, and calls a rank does not
        claim (the Buffer claims only each configuration's first dispatch on a rank).
        """
        # A lock: claims are made at a configuration's first use only, so it costs no call of a
        # steady state, and a note's test and change must not interleave with another rank's.
        group = self.local_group
        with group._calls_lock:
            note = group._calls.get(name)
            if note is not None and note.rank != self.rank:
                if note.call != call:
                    return note.rank, note.call
                note.in_flight.add(self.rank)
                return None
            if note is not None and note.call != call:
                # This rank's retry, with other arguments, of a call peers made with its first ones.
                peer = note.launched_by if note.launched_by is not None else min(note.in_flight, default=None)
                if peer is not None:
                    return peer, note.call
            if note is None or note.call != call:
                group._calls[name] = _CallNote(self.rank, call)  # a retry's keeps its place in the order
            else:  # this rank's own retry, alike
                note.withdrawn = False
            if len(group._calls) > _CALLS_KEPT:
                group._calls.popitem(last=False)
        return None

    def confirm_call(self, name: Hashable, call: Hashable) -> None:
        """This rank launched the call ``name`` it claimed with ``call``: peers may now wait on it, so
        the note stays, even if the rank that made it withdraws (:meth:`withdraw_call`)."""
        with self.local_group._calls_lock:
            note = self.local_group._calls.get(name)
            if note is not None and note.rank != self.rank and note.call == call:
                note.in_flight.discard(self.rank)
                if note.launched_by is None:
                    note.launched_by = self.rank

    def withdraw_call(self, name: Hashable, call: Hashable) -> None:
        """This rank's call ``name``, claimed with ``call``, failed before it launched; the ranks will
        make it again, perhaps with other arguments. The note goes once its rank withdrew it and no
        other rank launched against it or is still on its way to (:meth:`claim_call`)."""
        group = self.local_group
        with group._calls_lock:
            note = group._calls.get(name)
            if note is None or note.call != call:
                return
            if note.rank == self.rank:
                note.withdrawn = True
            else:
                note.in_flight.discard(self.rank)
            if note.withdrawn and note.launched_by is None and not note.in_flight:
                del group._calls[name]

    def allgather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank's ``data``, in rank order. Collective over the LocalGroup's rank threads.

        Raises:
            TypeError: ``data`` is not bytes-like.
            GroupError: some ranks did not call within the timeout (they are named), another
                rank failed, or the group is broken.
        """
        return self._collective("allgather_bytes", _check_data("allgather_bytes", data))

    def barrier(self) -> None:
        """Return once every rank has entered; raises GroupError as :meth:`allgather_bytes`."""
        self._collective("barrier", b"")

    def _collective(self, name: str, data: bytes) -> list[bytes]:
        # A group of one rank has no peer's place to take: a second thread waits its turn.
        if not self._in_collective.acquire(blocking=self.world_size == 1):
            self._refuse_second_thread(name)
        try:
            return self._collective_round(name, data)
        finally:
            self._in_collective.release()

    def _refuse_second_thread(self, name: str) -> None:
        """A second thread entered one of this rank's collectives: it would take a peer's place in the
        round (JAX eager calls whose arrays sit on one rank's device all select that rank's Buffer).
        The group breaks at once, so the thread already waiting gets the reason, not a timeout."""
        group = self.local_group
        reason = (f"{name} #{self._num_calls[name]}: rank {self.rank} entered a collective in thread "
                  f"{threading.current_thread().name!r} while another thread is in one as that rank: two threads "
                  f"used one rank (with JAX, an eager call picks its rank by its arrays' device: put each rank's "
                  f"arrays on its own device, with jax.device_put or jax.default_device)")
        with group._state_lock:
            if group._break_reason is None:
                group._break_reason = reason
        group._barrier.abort()
        raise GroupError(reason)

    def _collective_round(self, name: str, data: bytes) -> list[bytes]:
        group = self.local_group
        label = f"{name} #{self._num_calls[name]}"
        self._num_calls[name] += 1
        seq, self._seq = self._seq, self._seq + 1
        # Two slot sets, alternating: a rank can only write set p again two calls later, after
        # the call in between proved every rank has finished reading set p.
        slots = group._slots[seq % 2]
        slots[self.rank] = (name, data)
        group._arrivals[self.rank] = seq + 1
        try:
            group._barrier.wait(_wait_arg(group._active_timeout_s))
        except threading.BrokenBarrierError:
            raise group._broken_error(self.rank, label, seq) from None
        odd = {r: n for r, (n, _) in enumerate(slots) if n != name}
        if odd:
            raise GroupError(f"{label} on rank {self.rank}: ranks called other collectives in the same "
                             f"round {odd}; every rank must make the same sequence of collective calls")
        return [d for _, d in slots]


# Calls LocalRankGroup.claim_call remembers: ranks further apart than this go unchecked.
_CALLS_KEPT = 256


class _CallNote:
    """The first claim of a call (LocalRankGroup.claim_call): its rank and arguments, the other ranks
    that made it alike and have neither launched nor withdrawn, the first of them that launched, and
    whether its own rank withdrew it."""

    __slots__ = ("rank", "call", "in_flight", "launched_by", "withdrawn")

    def __init__(self, rank: int, call: Hashable) -> None:
        self.rank, self.call = rank, call
        self.in_flight: set[int] = set()
        self.launched_by: int | None = None
        self.withdrawn = False

# Communication streams of every LocalGroup made in this process: never destroyed (_make_streams).
_kept_streams: list[Any] = []


class LocalGroup:
    """Several ranks in this process, one thread per rank (tests, simulation, single-controller).

    Args:
        num_ranks: number of ranks, >= 1.
        devices: CUDA device ordinal of each rank (``len(devices) == num_ranks``; several ranks
            may share a device), or None for CPU-only ranks.
        timeout_s: seconds a collective waits for its peers (math.inf = forever).

    Raises:
        TypeError, ValueError: bad ``num_ranks``, ``devices`` or ``timeout_s``.

    Note:
        With ``devices``, :meth:`spawn` makes each rank thread use its device and its *own*
        non-blocking stream, as current stream for cupy and (when CUDA torch is installed)
        torch. Ranks that shared a stream would serialise, and a rank waiting for a peer
        queued behind it could only time out. The streams are made once and reused by every
        spawn; each rank's stream is synchronised before its result is handed back.
    """

    def __init__(self, num_ranks: int, devices: Sequence[int] | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.num_ranks = _check_int("LocalGroup", "num_ranks", num_ranks, 1)
        if devices is not None:
            if isinstance(devices, (str, bytes)) or not isinstance(devices, Sequence):
                raise TypeError(f"LocalGroup: devices must be a sequence of ints, got {type(devices).__name__}")
            if len(devices) != num_ranks:
                raise ValueError(f"LocalGroup: devices must have one entry per rank (num_ranks="
                                 f"{num_ranks}), got {len(devices)}: {list(devices)}")
            devices = tuple(_check_int("LocalGroup", f"devices[{i}]", d, 0) for i, d in enumerate(devices))
        self.devices: tuple[int, ...] | None = devices
        self._timeout_s = _check_timeout("LocalGroup", timeout_s)
        self._spawn_timeout_s: float | None = None  # a running spawn's own (spawn(timeout_s=...))
        self._barrier = threading.Barrier(num_ranks)
        self._slots: list[list[Any]] = [[None] * num_ranks, [None] * num_ranks]
        self._arrivals = [0] * num_ranks  # collectives each rank has entered
        self._state_lock = threading.Lock()
        self._failure: tuple[int, BaseException] | None = None
        self._break_reason: str | None = None
        self._spawn_lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._streams: list[Any] = [None] * num_ranks  # cupy.cuda.Stream per rank
        self._comm_streams: list[Any] = [None] * num_ranks  # and each rank's communication stream
        # (rank, call) of the latest call on each stream (LocalRankGroup.claim_stream).
        self._stream_calls: dict[tuple[int, int], tuple[int, Hashable]] = {}
        self._torch_streams: list[Any] = [None] * num_ranks  # torch.cuda.ExternalStream per rank
        # The latest calls' arguments, by call, oldest first (LocalRankGroup.claim_call); at most
        # _CALLS_KEPT. Claims are first uses only, under the lock.
        self._calls: OrderedDict[Hashable, _CallNote] = OrderedDict()
        self._calls_lock = threading.Lock()
        self._rank_groups = [LocalRankGroup(self, r) for r in range(num_ranks)]

    def __repr__(self) -> str:
        return f"LocalGroup(num_ranks={self.num_ranks}, devices={self.devices})"

    def rank_group(self, rank: int) -> LocalRankGroup:
        """The group object of ``rank`` (always the same object for a rank)."""
        rank, _ = _check_rank("LocalGroup.rank_group", rank, self.num_ranks)
        return self._rank_groups[rank]

    @property
    def timeout_s(self) -> float:
        """Seconds a collective waits for its peers (math.inf = forever); set it to change that for the
        collectives from now on, inside or outside :meth:`spawn` (but for a spawn given its own)."""
        return self._timeout_s

    @timeout_s.setter
    def timeout_s(self, value: float) -> None:
        self._timeout_s = _check_timeout("LocalGroup.timeout_s", value)

    @property
    def _active_timeout_s(self) -> float:
        """What the collectives wait: a running spawn's own timeout_s, else the group's."""
        return self._timeout_s if self._spawn_timeout_s is None else self._spawn_timeout_s

    def spawn(self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None) -> list[Any]:
        """Run ``fn(rank_group, *args)`` on one thread per rank; return the results in rank order.

        Args:
            fn: the per-rank function; its first argument is that rank's :class:`LocalRankGroup`.
            *args: passed to every rank's ``fn`` after the rank group.
            timeout_s: seconds each collective waits during this spawn; None = the group's.

        Returns:
            ``[fn's result on rank 0, ..., on rank num_ranks - 1]``.

        Note:
            Without a failure, spawn waits as long as the ranks run; collectives are what time
            out. Once a rank fails, the others get ``timeout_s`` more to return; any still running
            then are left behind (daemon threads), and the group refuses further spawns while they run.

        Raises:
            BaseException: the exception of the lowest rank that failed on its own (not because a
                peer failed), re-raised as is, with a note naming the rank. Peers waiting in a
                collective are released at once with GroupError, so nothing hangs.
            GroupError: another spawn is running, or threads of an earlier spawn never finished.
        """
        if not callable(fn):
            raise TypeError(f"LocalGroup.spawn: fn must be callable, got {type(fn).__name__}")
        own_timeout = None if timeout_s is None else _check_timeout("LocalGroup.spawn", timeout_s)
        if not self._spawn_lock.acquire(blocking=False):
            raise GroupError("LocalGroup.spawn: another spawn of this LocalGroup is running")
        try:
            self._spawn_timeout_s = own_timeout
            return self._spawn(fn, args, self._active_timeout_s)
        finally:
            self._spawn_timeout_s = None
            self._spawn_lock.release()

    def _spawn(self, fn: Callable[..., Any], args: tuple[Any, ...], timeout: float) -> list[Any]:
        stuck = [t.name for t in self._threads if t.is_alive()]
        if stuck:
            raise GroupError(f"LocalGroup.spawn: threads of an earlier spawn are still running {stuck}; "
                             f"make a new LocalGroup")
        self._reset()
        if self.devices is not None:
            self._make_streams()
        n = self.num_ranks
        results: list[Any] = [None] * n
        errors: list[BaseException | None] = [None] * n
        done = threading.Condition()
        num_done = 0

        def run(rank: int) -> None:
            nonlocal num_done
            try:
                if self.devices is not None:
                    _use_rank_device_and_stream(self, rank)
                results[rank] = fn(self._rank_groups[rank], *args)
                if self._streams[rank] is not None:
                    self._streams[rank].synchronize()  # results may be arrays still being written
            except BaseException as exc:  # noqa: BLE001 - handed to the caller by spawn
                errors[rank] = exc
                with self._state_lock:
                    if self._failure is None:
                        self._failure = (rank, exc)
                self._barrier.abort()  # peers waiting in a collective get GroupError now
            finally:
                with done:
                    num_done += 1
                    done.notify_all()

        self._threads = [threading.Thread(target=run, args=(r,), name=f"mooncake_ep-rank{r}", daemon=True)
                         for r in range(n)]
        try:
            # Inside: a start that fails (no more threads) or a KeyboardInterrupt between two starts
            # must release the ranks already started as well (they waited out timeout_s).
            for thread in self._threads:
                thread.start()
            with done:
                done.wait_for(lambda: num_done == n or self._failure is not None)
                # After a failure the others are released from their collectives; give them the
                # timeout to get out of whatever else they are doing.
                done.wait_for(lambda: num_done == n, timeout=_wait_arg(timeout))
        except BaseException as exc:  # release the ranks, saying why, then propagate
            with self._state_lock:
                if self._break_reason is None:
                    self._break_reason = (f"LocalGroup.spawn stopped in its calling thread: {type(exc).__name__}"
                                          + (f": {exc}" if str(exc) else ""))
            self._barrier.abort()
            raise
        failed = [(r, e) for r, e in enumerate(errors) if e is not None]
        if not failed:
            return results
        own = [(r, e) for r, e in failed if not isinstance(e, _PeerAbortedError)]
        rank, exc = (own or failed)[0]
        _add_note(exc, f"LocalGroup.spawn: raised on rank {rank} of {n}")
        others = [f"rank {r}: {type(e).__name__}: {e}" for r, e in own if r != rank]
        if others:
            _add_note(exc, "other ranks failed too: " + "; ".join(others))
        released = [r for r, e in failed if isinstance(e, _PeerAbortedError)]
        if released:
            _add_note(exc, f"ranks {released} were released from their collectives with GroupError")
        alive = [r for r, t in enumerate(self._threads) if t.is_alive()]
        if alive:
            _add_note(exc, f"ranks {alive} had not returned after {timeout} s and were left running")
        raise exc

    def _make_streams(self) -> None:
        """Every rank's stream, then every rank's communication stream, made here on one thread, one
        after another, at the first spawn; kept for later spawns, and the communication streams for
        the process's life.

        CUDA runs a context's streams on a few hardware queues (CUDA_DEVICE_MAX_CONNECTIONS, 8 unless
        set; at most 32), handing them out in turn as streams are made. Work on one queue starts in
        order, so an in-process rank whose kernel waits for a peer would hold back that peer's work
        queued behind it, until the wait times out. Made in one run, the ranks' streams get queues of
        their own (so do their communication streams, or at worst their own rank's), as long as 2R
        (R for a rank's stream alone) fits in the queues. Made in each rank's thread, interleaved
        with other streams, they did not always: async_finish calls timed out on healthy ranks.
        The communication streams are never destroyed: torch records events on a stream a tensor
        was recorded on when the tensor is freed, which may be after this group is gone.
        """
        if self._streams[0] is not None:
            return
        try:
            import cupy
        except ImportError as exc:
            raise GroupError(f"LocalGroup.spawn: devices={list(self.devices)} needs cupy to set each "
                             f"rank's device and stream; install mooncake_ep[cuda12] (or [cuda13]), or "
                             f"pass devices=None") from exc
        for streams in (self._streams, self._comm_streams):
            for rank, device in enumerate(self.devices):
                with cupy.cuda.Device(device):
                    streams[rank] = cupy.cuda.Stream(non_blocking=True)
        _kept_streams.extend(self._comm_streams)

    def _reset(self) -> None:
        """Fresh collective state for a new spawn (a failed spawn leaves the barrier broken)."""
        self._barrier = threading.Barrier(self.num_ranks)
        self._slots = [[None] * self.num_ranks, [None] * self.num_ranks]
        self._arrivals = [0] * self.num_ranks
        self._failure = None
        self._break_reason = None
        for rank_group in self._rank_groups:
            rank_group._seq = 0
            rank_group._num_calls.clear()

    def _broken_error(self, rank: int, label: str, seq: int) -> GroupError:
        """The error for a rank whose barrier wait broke: a peer failed, a timeout, or both earlier."""
        with self._state_lock:
            if self._failure is not None:
                src, exc = self._failure
                return _PeerAbortedError(f"{label} on rank {rank} aborted: rank {src} failed with {exc!r}")
            if self._break_reason is None:
                missing = [r for r, a in enumerate(self._arrivals) if a <= seq]
                self._break_reason = (f"{label} timed out after {self._active_timeout_s} s waiting for "
                                      f"ranks {missing} of {self.num_ranks} (LocalGroup)")
                return GroupError(self._break_reason)
            return GroupError(f"{label} on rank {rank}: the LocalGroup is broken by an earlier failure "
                              f"({self._break_reason})")


def _add_note(exc: BaseException, note: str) -> None:
    """``exc.add_note(note)``, which Python 3.10 lacks (this package supports it): there the note is
    logged instead, as its traceback would not show it."""
    if hasattr(exc, "add_note"):
        exc.add_note(note)
    else:
        logger.error("%s: %s", type(exc).__name__, note)


def _use_rank_device_and_stream(group: LocalGroup, rank: int) -> None:
    """In rank ``rank``'s thread: make its device current, and its own stream current for cupy
    and torch (made by ``LocalGroup._make_streams``; the torch stream object on first use).

    Both libraries keep the current device and stream per thread, so this touches no other rank.
    """
    import cupy

    assert group.devices is not None  # internal invariant: only called with devices
    device = group.devices[rank]
    cupy.cuda.Device(device).use()
    stream = group._streams[rank]
    stream.use()
    try:
        import torch
    except ImportError:
        return  # torch is optional; cupy (and our launches) already use the rank's stream
    if not torch.cuda.is_available():
        return
    torch.cuda.set_device(device)
    torch_stream = group._torch_streams[rank]
    if torch_stream is None:
        torch_stream = torch.cuda.ExternalStream(stream.ptr, device=torch.device("cuda", device))
        group._torch_streams[rank] = torch_stream
    torch.cuda.set_stream(torch_stream)
