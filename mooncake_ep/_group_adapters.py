"""Groups over what the launcher already set up: torch.distributed, mpi4py, jax.distributed.

Each class here implements the :class:`mooncake_ep.group.Group` protocol (``rank``,
``world_size``, ``allgather_bytes``, ``barrier``, ``is_in_process = False``, ``device``) on top of
a communication object the user already has, so a job started by torchrun, mpirun or a JAX
launcher needs no second rendezvous and no extra port:

- :class:`TorchGroup`: a ``torch.distributed`` ProcessGroup (any backend; byte tensors on the
  backend's device, gloo on the CPU).
- :class:`TorchStoreGroup`: a ``torch.distributed.Store`` (TCPStore, FileStore, HashStore, ...)
  with the rank and world size given, running our store protocol (``_group_common``) over it.
- :class:`MPIGroup`: an mpi4py communicator (``Get_rank``, ``Get_size``, ``allgather``, ``Barrier``).
- :class:`JaxGroup`: ``jax.distributed``'s key-value client, running our store protocol over it.

torch, mpi4py and jax are imported only when an adapter is built from them; ``import
mooncake_ep`` needs none of them. :func:`mooncake_ep.group.init_group` chooses among these.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import logging
import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

from mooncake_ep import _tcp_store
from mooncake_ep._group_common import (
    DEFAULT_TIMEOUT_S,
    GroupError,
    StoreTimeoutError,
    _FOREVER_FROM_S,
    _check_data,
    _check_int,
    _check_rank,
    _check_timeout,
)
from mooncake_ep._group_join import _LedJoinGroup

__all__ = ["JaxGroup", "MPIGroup", "TorchGroup", "TorchStoreGroup"]

logger = logging.getLogger("mooncake_ep")

# Namespace of our keys in a store shared with others (torch's own keys, JAX's, a second group).
DEFAULT_PREFIX = "mooncake_ep"
# What a timeout of math.inf becomes for APIs that take a finite one: 30 days, beyond any job.
_FOREVER_S = 30 * 24 * 3600.0
# jax's blocking get takes whole milliseconds; a wait of less than 1 ms would read as "no wait".
_MIN_WAIT_MS = 1
# Seconds torch's TCPStore gets at least once its listener answered (its own handshake), however
# little of timeout_s the wait for the listener left.
_MIN_TORCH_TIMEOUT_S = 1.0
# The status text jax's coordination service gives a blocking get that ran out of time.
_JAX_DEADLINE = "DEADLINE_EXCEEDED"
# How long a key another rank created (the set was refused: ALREADY_EXISTS) may take to read back, seconds.
_CREATED_READ_S = 10.0
# The text of what torch's FileStore raises for a wait that ran out of time: a bare RuntimeError, where
# torch's other stores raise DistStoreError.
_TORCH_FILESTORE_TIMEOUT = "Wait timeout"
# Seconds between a FileStore's key checks while waiting (see TorchStoreGroup._poll): FileStore.wait's own.
_FILESTORE_POLL_S = 0.01


def _check_device(where: str, device: Any) -> int | None:
    return None if device is None else _check_int(where, "device", device, 0)


def _finite_s(timeout_s: float) -> float:
    """A timeout torch and MPI can hold: what the groups take as forever (math.inf, and anything from
    1e8 s on, _group_common._wait_arg) is _FOREVER_S (a finite 1e10 s had timed out at once in torch's
    millisecond arithmetic, and 1e15 overflowed)."""
    return _FOREVER_S if timeout_s >= _FOREVER_FROM_S else timeout_s


class _CollectiveState:
    """Call labels, and the broken/closed state, of a group over a collective library (torch, MPI).

    Those libraries match collectives by call order, so after a failed call the ranks no longer
    agree on which call is which: the group refuses every later call, as the store groups do.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.num_calls: Counter[str] = Counter()
        self.broken: str | None = None
        self.closed = False

    def begin(self, name: str) -> str:
        """The label of this call (``"barrier #3"``); raises GroupError on a closed or broken group."""
        label = f"{name} #{self.num_calls[name]}"
        self.num_calls[name] += 1
        if self.closed:
            raise GroupError(f"{label}: the group is closed")
        if self.broken is not None:
            raise GroupError(f"{label}: the group is broken by an earlier failure ({self.broken}); "
                             f"make a new group")
        return label

    def fail(self, label: str, rank: int, what: str, exc: BaseException) -> GroupError:
        self.broken = f"{label} on rank {rank}: {what} failed: {type(exc).__name__}: {exc}"
        return GroupError(self.broken)


# ----------------------------------------------------------------------------- torch.distributed


def _torch_distributed(where: str) -> Any:
    try:
        import torch.distributed as dist
    except ImportError as exc:
        raise GroupError(f"{where}: torch is not installed; install mooncake_ep[test] or torch") from exc
    if not dist.is_available():
        raise GroupError(f"{where}: this torch build has no torch.distributed")
    return dist


class TorchGroup:
    """A ``torch.distributed`` ProcessGroup as a mooncake_ep group.

    ``allgather_bytes`` sends each rank's length, then its bytes padded to the longest, as uint8
    tensors on the group's device (no pickle): the CPU for gloo, mpi and ucc, else (nccl) the
    current CUDA device. ``barrier`` is ``monitored_barrier`` on gloo (it names the ranks that
    did not come) and ``torch.distributed.barrier`` elsewhere.

    Args:
        process_group: the group; None = the default (world) group. This process must be a member.
        device: CUDA device ordinal this rank uses (the group's ``device``), None = unset.
        timeout_s: seconds a gloo barrier waits for its peers (math.inf = forever).
        collective_device: the torch device of the byte tensors; None = chosen from the backend.

    Raises:
        GroupError: torch.distributed is missing or not initialised.
        ValueError: this process is not a member of ``process_group``.

    Note:
        torch has no per-call timeout for all_gather (nor for barrier outside gloo): those wait
        as long as the process group's own timeout, ``init_process_group(timeout=...)``. On a
        timeout torch raises; the group then refuses further calls (GroupError).
    """

    is_in_process = False

    def __init__(self, process_group: Any = None, *, device: int | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S, collective_device: Any = None) -> None:
        dist = _torch_distributed("TorchGroup")
        if not dist.is_initialized():
            raise GroupError("TorchGroup: torch.distributed is not initialised; call "
                             "torch.distributed.init_process_group(...) first, or use init_group() "
                             "without a group for mooncake_ep's own TCP store")
        self._dist = dist
        self.process_group = process_group
        self.rank = dist.get_rank(process_group)
        if self.rank < 0:
            raise ValueError("TorchGroup: this process is not a member of process_group; build the "
                             "group on the ranks of the process group only")
        self.world_size = dist.get_world_size(process_group)
        self.device = _check_device("TorchGroup", device)
        self._timeout_s = _check_timeout("TorchGroup", timeout_s)
        self.backend = str(dist.get_backend(process_group))
        self.collective_device = (self._backend_device() if collective_device is None
                                  else collective_device)
        self._state = _CollectiveState()
        # How failures name the group: torch's own messages number a subgroup's ranks within it, which
        # read as the job's ranks unless the mapping is said.
        self._what = self.backend
        if process_group is not None and process_group is not dist.group.WORLD:
            with contextlib.suppress(Exception):  # torch releases without get_process_group_ranks
                ranks = dist.get_process_group_ranks(process_group)
                self._what += f"; a subgroup: its ranks 0..{len(ranks) - 1} are global ranks {ranks}"

    def __repr__(self) -> str:
        return (f"TorchGroup(rank={self.rank}, world_size={self.world_size}, backend={self.backend!r}, "
                f"collective_device={self.collective_device})")

    @property
    def timeout_s(self) -> float:
        """Seconds a gloo barrier waits for its peers (math.inf = forever); set it to change that for
        the barriers from now on."""
        return self._timeout_s

    @timeout_s.setter
    def timeout_s(self, value: float) -> None:
        self._timeout_s = _check_timeout("TorchGroup.timeout_s", value)

    def _backend_device(self) -> Any:
        import torch

        # Backends that carry CPU tensors; a mixed "cpu:gloo,cuda:nccl" group names gloo too.
        if any(name in self.backend for name in ("gloo", "mpi", "ucc")):
            return torch.device("cpu")
        return torch.device("cuda", torch.cuda.current_device() if self.device is None else self.device)

    def allgather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank's ``data``, in rank order (lengths may differ between ranks).

        Raises:
            TypeError: ``data`` is not bytes-like.
            GroupError: torch's collective failed (a peer's timeout or exit), or the group is
                broken or closed.
        """
        import torch

        data = _check_data("allgather_bytes", data)
        with self._state.lock:
            label = self._state.begin("allgather_bytes")
            try:
                return self._allgather(torch, data)
            # torch's DistError and backend errors are RuntimeErrors; a destroyed default group a ValueError
            except (RuntimeError, ValueError) as exc:
                raise self._state.fail(label, self.rank, f"torch.distributed.all_gather ({self._what})",
                                       exc) from exc
            except BaseException as exc:  # an interrupt between its two rounds: the ranks' calls no longer pair
                self._state.fail(label, self.rank, f"torch.distributed.all_gather ({self._what})", exc)
                raise

    def _allgather(self, torch: Any, data: bytes) -> list[bytes]:
        dist, group, device = self._dist, self.process_group, self.collective_device
        length = torch.tensor([len(data)], dtype=torch.int64, device=device)
        lengths = [torch.empty_like(length) for _ in range(self.world_size)]
        dist.all_gather(lengths, length, group=group)
        sizes = [int(n.item()) for n in lengths]  # bootstrap, not the hot path: a host sync is fine
        padded = torch.zeros(max(1, *sizes), dtype=torch.uint8, device=device)  # no empty tensors
        if data:
            padded[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
        gathered = [torch.empty_like(padded) for _ in range(self.world_size)]
        dist.all_gather(gathered, padded, group=group)
        return [t[:n].cpu().numpy().tobytes() for t, n in zip(gathered, sizes)]

    def barrier(self) -> None:
        """Return once every rank has entered; raises GroupError as :meth:`allgather_bytes`."""
        with self._state.lock:
            label = self._state.begin("barrier")
            try:
                if self.backend == "gloo":
                    # At least 1 ms: torch keeps whole milliseconds, and gloo takes 0 as no limit at all.
                    timeout = datetime.timedelta(seconds=max(_finite_s(self.timeout_s), 0.001))
                    self._dist.monitored_barrier(group=self.process_group, timeout=timeout, wait_all_ranks=True)
                else:
                    self._dist.barrier(group=self.process_group)
            except (RuntimeError, ValueError) as exc:  # as allgather_bytes's
                raise self._state.fail(label, self.rank, f"torch.distributed barrier ({self._what})",
                                       exc) from exc
            except BaseException as exc:  # stopped inside the collective: the ranks' calls no longer pair
                self._state.fail(label, self.rank, f"torch.distributed barrier ({self._what})", exc)
                raise

    def close(self, *, final_barrier: bool = False) -> None:
        """Stop using the group. Idempotent. The ProcessGroup stays the caller's: nothing is torn
        down, so no final barrier is needed unless asked for.

        Args:
            final_barrier: first wait for every rank to close.
        """
        if final_barrier and not self._state.closed and self._state.broken is None:
            try:
                self.barrier()
            except GroupError as exc:  # as the store groups: logged, and the group closes all the same
                logger.warning("mooncake_ep: %r: the final barrier of close() failed: %s", self, exc)
        self._state.closed = True


class TorchStoreGroup(_LedJoinGroup):
    """A ``torch.distributed.Store`` as a mooncake_ep group: our store protocol over its keys.

    Keys live under ``{prefix}/{n}/``, where ``n`` numbers rank 0's join attempts on the store
    (``{prefix}/generation``): rank 0 opens each attempt and the other ranks follow it
    (``_group_join``), so several groups (and torch's own keys) share the store without clashing,
    and ranks that retry a failed join meet in rank 0's next attempt. Groups with the same
    ``prefix`` are built one after another by every rank.

    Args:
        store: a TCPStore, FileStore, HashStore, PrefixStore... reachable by every rank.
        rank: this process's rank in ``[0, world_size)`` (a store does not know it).
        world_size: number of processes.
        timeout_s: seconds the rendezvous and every collective wait for their peers (math.inf =
            forever); a timeout names the ranks that did not come.
        device: CUDA device ordinal this rank uses (the group's ``device``), None = unset.
        prefix: namespace of our keys in the store.

    Raises:
        GroupError: some ranks did not join within ``timeout_s``, or two processes claimed the same
            rank.
        RankMismatchError: ranks disagree on ``world_size`` (each rank's value named).
    """

    _same_rank_hint = "every process needs its own rank"
    # The time.monotonic() by which the join must end, where a subclass spent part of timeout_s before it
    # (torchrun's group connects to the store first); None: timeout_s from the construction.
    _join_deadline: float | None = None

    def __init__(self, store: Any, rank: int, world_size: int, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                 device: int | None = None, prefix: str = DEFAULT_PREFIX) -> None:
        for method in ("set", "add", "wait", "get", "check"):
            if not callable(getattr(store, method, None)):
                raise TypeError(f"TorchStoreGroup: store must be a torch.distributed.Store, got "
                                f"{type(store).__name__} (no {method!r})")
        self._dist = _torch_distributed("TorchStoreGroup")
        self.store = store
        self._store_name = type(store).__name__  # for messages, also once a closed group let go of its store
        self._waits_by_polling = _is_file_store(self._dist, store)
        self.rank, self.world_size = _check_rank("TorchStoreGroup", rank, world_size)
        self.device = _check_device("TorchStoreGroup", device)
        self._init_collectives(_check_timeout("TorchStoreGroup", timeout_s))
        if self.world_size == 1:
            return
        self._prefix = prefix
        self._rendezvous(self._join_deadline if self._join_deadline is not None
                         else time.monotonic() + _finite_s(self._timeout_s))

    def __repr__(self) -> str:
        return f"TorchStoreGroup(rank={self.rank}, world_size={self.world_size}, store={self._store_name})"

    def _where(self) -> str:
        return f"torch {self._store_name}, keys {self._namespace}*"

    def _join_lock_key(self) -> tuple:
        return "torch", id(self.store), self._prefix, self.rank

    def _call(self, what: str, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except GroupError:  # a closed group's stand-in store (_ClosedStore): said as it is
            raise
        except RuntimeError as exc:  # DistStoreError, DistNetworkError: the store is unreachable
            raise GroupError(f"torch store {what} failed: {type(exc).__name__}: {exc}") from exc

    def _kv_set(self, key: str, value: bytes) -> None:
        self._call("set", self.store.set, key, value)

    def _kv_add(self, key: str, amount: int) -> int:
        return int(self._call("add", self.store.add, key, amount))

    def _kv_create(self, key: str, value: bytes) -> bytes:
        # compare_set with an empty expected value sets a missing key and answers what the key holds.
        return bytes(self._call("compare_set", self.store.compare_set, key, "", value))

    def _kv_multi_get(self, keys: Sequence[str], timeout_s: float, reply_bytes: int = 0,
                      settle: bool = False, holders: Sequence[str] | None = None) -> list[bytes]:
        # No claims here: every key stays, and holders (_holder_keys: None) are never given.
        keys = list(keys)
        try:
            if self._waits_by_polling:
                self._poll(keys, timeout_s)
            else:
                # At least 1 ms: torch's stores take a wait of 0 as one without a limit.
                self.store.wait(keys, datetime.timedelta(seconds=max(_finite_s(timeout_s), 0.001)))
        except RuntimeError as exc:
            # A timeout names no keys, and FileStore's is not even a DistStoreError: the keys found
            # missing here are what the collective's error names the ranks from.
            timed_out = isinstance(exc, getattr(self._dist, "DistStoreError", RuntimeError))
            if not (timed_out or _TORCH_FILESTORE_TIMEOUT in str(exc)):
                raise GroupError(f"torch store wait failed: {type(exc).__name__}: {exc}") from exc
            missing = [k for k in keys if not self._check([k])]
            if missing:
                raise StoreTimeoutError(f"torch store wait timed out after {timeout_s} s waiting for keys "
                                        f"{missing}", missing) from exc
        if hasattr(self.store, "multi_get"):
            return [bytes(v) for v in self._call("multi_get", self.store.multi_get, keys)]
        return [bytes(self._call("get", self.store.get, k)) for k in keys]

    def _kv_try_get(self, key: str) -> bytes | None:
        return bytes(self._call("get", self.store.get, key)) if self._check([key]) else None

    def _kv_holds_all(self, keys: list[str]) -> bool:
        return self._check(keys)

    def _check(self, keys: list[str]) -> bool:
        """Whether every one of ``keys`` is set (at once: no wait)."""
        return bool(self._call("check", self.store.check, keys))

    def _poll(self, keys: list[str], timeout_s: float) -> None:
        """Waits for ``keys`` as FileStore.wait does (checking the file every 10 ms), but to the limit.

        torch's FileStore.wait compares the limit with the time waited in whole seconds, truncated:
        a wait of 0.5 s returned after 1 s and one of 2.0 s after 3 (a renewal, two waits, after 4).

        Raises:
            RuntimeError: FileStore's own timeout text, for _kv_multi_get to name the missing keys.
        """
        deadline = time.monotonic() + _finite_s(timeout_s)
        # The store's own errors as its wait's: _kv_multi_get tells them apart (helper-104: a GroupError
        # from here was wrapped again as "wait failed").
        while not self.store.check(keys):
            left_s = deadline - time.monotonic()
            if left_s <= 0:
                raise RuntimeError(_TORCH_FILESTORE_TIMEOUT)
            time.sleep(min(_FILESTORE_POLL_S, left_s))

    def _kv_delete(self, key: str) -> None:
        try:
            self.store.delete_key(key)
        except (AttributeError, RuntimeError) as exc:  # a store without delete_key, or one that refuses it
            logger.debug("TorchStoreGroup: could not delete %s (the key stays): %s", key, exc)


def _is_file_store(dist: Any, store: Any) -> bool:
    """Whether ``store`` is a torch FileStore, or PrefixStores over one."""
    while isinstance(store, dist.PrefixStore):
        store = getattr(store, "underlying_store", None)  # torch releases without it: not known
    return isinstance(store, dist.FileStore)


# torchrun sets this to "True" in its workers when its agent serves the job's store at MASTER_ADDR:MASTER_PORT.
TORCHRUN_AGENT_STORE_VAR = "TORCHELASTIC_USE_AGENT_STORE"


class _TorchrunStoreGroup(TorchStoreGroup):
    """A :class:`TorchStoreGroup` on the store torchrun's agent serves, whose keys outlive the workers
    the agent restarts.

    The join already meets whatever restarted workers' predecessors left there (rank 0 leads each
    attempt, and only a live rank 0 completes one: ``_group_join``). Here it ends by the
    ``deadline`` the connection to the store started (one ``timeout_s`` for both), and each rank of
    this process builds its groups one at a time, whichever store client each uses (a torchrun
    worker connects one per group).
    """

    def __init__(self, store: Any, rank: int, world_size: int, *, timeout_s: float, device: int | None,
                 deadline: float) -> None:
        self._join_deadline = deadline
        super().__init__(store, rank, world_size, timeout_s=timeout_s, device=device)

    def _join_lock_key(self) -> tuple:
        return "torchrun", self._prefix, self.rank

    def _shutdown(self, drain_s: float) -> None:
        """Hang up: the store client is this group's own (torchrun_store_group connected it, where a
        TorchStoreGroup's store is the caller's). torch's TCPStore has no close(); its socket closes
        when the object goes, and this is its only reference. A stand-in takes its place: a collective
        still waiting on another thread (``close(final_barrier=False)`` from an abort path) then raises
        GroupError at its next store call, as a closed TCPGroup's does, not AttributeError on None."""
        self.store = _ClosedStore(self._store_name)


class _ClosedStore:
    """What a closed :class:`_TorchrunStoreGroup` holds instead of its store: every method raises GroupError."""

    def __init__(self, store_name: str) -> None:
        self._store_name = store_name

    def __getattr__(self, name: str) -> Any:
        def closed(*args: Any, **kwargs: Any) -> Any:
            raise GroupError(f"torch {self._store_name} {name}: the group is closed (its store connection was "
                             f"let go)")
        return closed


def torchrun_store_group(rank: int, world_size: int, master_addr: str, master_port: int, *,
                         timeout_s: float = DEFAULT_TIMEOUT_S, device: int | None = None) -> TorchStoreGroup:
    """A :class:`TorchStoreGroup` over the store torchrun's agent serves at ``master_addr:master_port``.

    Under torchrun that port is taken by the agent's TCPStore, so our own store cannot listen there;
    every worker connects to the agent's store as a client instead, as ``init_process_group("env://")``
    does.

    The agent's store outlives the workers it restarts: rank 0 leads each join attempt there, and only a
    live rank 0 completes one (``_group_join``), so restarted workers meet whatever their predecessors
    left.

    Raises:
        GroupError: torch is missing, or the agent's store is unreachable within ``timeout_s``.
    """
    dist = _torch_distributed("init_group (under torchrun)")
    where = f"init_group: rank {rank} cannot reach torchrun's store at {master_addr}:{master_port} " \
            f"({TORCHRUN_AGENT_STORE_VAR}=True)"
    # Our own bounded wait for the listener first: TCPStore's connect tries again after its timeout,
    # which took twice timeout_s (and pages of C++ frames) where nothing listens.
    deadline = time.monotonic() + _finite_s(timeout_s)
    try:
        _tcp_store.connect(master_addr, master_port, timeout_s).close()
    except OSError as exc:
        raise GroupError(f"{where}: nothing answered within {timeout_s} s ({exc})") from exc
    try:
        store = dist.TCPStore(master_addr, master_port, world_size, False, timeout=datetime.timedelta(
            seconds=max(deadline - time.monotonic(), _MIN_TORCH_TIMEOUT_S)))
    except RuntimeError as exc:
        raise GroupError(f"{where}: {exc}") from exc
    # One timeout_s for the connection and the join together, as TCPGroup's; the collectives after it
    # get all of it.
    return _TorchrunStoreGroup(store, rank, world_size, timeout_s=timeout_s, device=device,
                               deadline=max(deadline, time.monotonic() + _MIN_TORCH_TIMEOUT_S))


# ----------------------------------------------------------------------------- mpi4py


def _outside_group(obj: Any) -> str | None:
    """What ``obj`` is, where it is what torch or mpi4py give a process outside a group: torch's
    ``new_group`` returns ``GroupMember.NON_GROUP_MEMBER`` (an int) to the ranks it leaves out, and
    mpi4py's ``Split`` ``MPI.COMM_NULL``; else None."""
    dist = sys.modules.get("torch.distributed")
    if (type(obj) is int and dist is not None and dist.is_available()
            and obj == getattr(getattr(dist, "GroupMember", None), "NON_GROUP_MEMBER", None)):
        return "torch.distributed.GroupMember.NON_GROUP_MEMBER (new_group's answer to a rank it leaves out)"
    comm_null = getattr(sys.modules.get("mpi4py.MPI"), "COMM_NULL", None)
    # Split's answer is an Intracomm holding MPI_COMM_NULL: a Comm, equal to COMM_NULL.
    if comm_null is not None and isinstance(obj, type(comm_null)) and obj == comm_null:
        return "mpi4py's MPI.COMM_NULL (Split's answer to a process it leaves out)"
    return None


class MPIGroup:
    """An mpi4py communicator as a mooncake_ep group.

    ``allgather_bytes`` is ``comm.allgather`` of the bytes (mpi4py pickles each object), and
    ``barrier`` is ``comm.Barrier()``.

    Args:
        comm: an mpi4py communicator (``MPI.COMM_WORLD`` or a split of it), or any object with
            ``Get_rank()``, ``Get_size()``, ``allgather(obj)`` and ``Barrier()``.
        device: CUDA device ordinal this rank uses (the group's ``device``), None = unset.

    Raises:
        TypeError: ``comm`` lacks one of those methods.
        ValueError: ``comm`` is an intercommunicator (its allgather returns the other group's data).

    Note:
        MPI collectives have no timeout: a peer that never calls makes the others wait until the
        MPI runtime gives up (most launchers end the whole job when one rank exits). An MPI error
        raised by mpi4py becomes a GroupError, after which the group refuses further calls.
    """

    is_in_process = False

    def __init__(self, comm: Any, *, device: int | None = None) -> None:
        for method in ("Get_rank", "Get_size", "allgather", "Barrier"):
            if not callable(getattr(comm, method, None)):
                raise TypeError(f"MPIGroup: comm must be an mpi4py communicator, got {type(comm).__name__} "
                                f"(no {method!r})")
        outside = _outside_group(comm)
        if outside is not None:
            raise ValueError(f"MPIGroup: comm is {outside}: this process is not a member of that communicator")
        is_inter = getattr(comm, "Is_inter", None)
        if callable(is_inter) and is_inter():
            # Its rank and size are the local group's, its allgather the remote group's objects: of equal
            # sizes, every rank got the other side's bytes, and no error.
            raise ValueError("MPIGroup: comm is an intercommunicator, whose allgather returns the other group's "
                             "data; pass an intracommunicator (comm.Merge())")
        self.comm = comm
        self.rank, self.world_size = _check_rank("MPIGroup", comm.Get_rank(), comm.Get_size())
        self.device = _check_device("MPIGroup", device)
        self._state = _CollectiveState()

    def __repr__(self) -> str:
        return f"MPIGroup(rank={self.rank}, world_size={self.world_size}, comm={type(self.comm).__name__})"

    def allgather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank's ``data``, in rank order (lengths may differ between ranks).

        Raises:
            TypeError: ``data`` is not bytes-like.
            GroupError: the MPI call failed or returned something else than one bytes per rank, or
                the group is broken or closed.
        """
        data = _check_data("allgather_bytes", data)
        with self._state.lock:
            label = self._state.begin("allgather_bytes")
            try:
                values = self.comm.allgather(data)
            except RuntimeError as exc:  # mpi4py.MPI.Exception is a RuntimeError
                raise self._state.fail(label, self.rank, "MPI allgather", exc) from exc
            except BaseException as exc:  # stopped inside the collective: the ranks' calls no longer pair
                self._state.fail(label, self.rank, "MPI allgather", exc)
                raise
            if (not isinstance(values, list) or len(values) != self.world_size
                    or not all(isinstance(v, bytes) for v in values) or values[self.rank] != data):
                self._state.broken = (f"{label} on rank {self.rank}: MPI allgather returned "
                                      f"{type(values).__name__} {values!r:.200}, expected a list of "
                                      f"{self.world_size} bytes with this rank's own at {self.rank}; every "
                                      f"rank must make the same sequence of collective calls")
                raise GroupError(self._state.broken)
            return values

    def barrier(self) -> None:
        """Return once every rank has entered; raises GroupError as :meth:`allgather_bytes`."""
        with self._state.lock:
            label = self._state.begin("barrier")
            try:
                self.comm.Barrier()
            except RuntimeError as exc:
                raise self._state.fail(label, self.rank, "MPI Barrier", exc) from exc
            except BaseException as exc:  # stopped inside the collective: the ranks' calls no longer pair
                self._state.fail(label, self.rank, "MPI Barrier", exc)
                raise

    def close(self, *, final_barrier: bool = False) -> None:
        """Stop using the communicator (it stays the caller's). Idempotent."""
        if final_barrier and not self._state.closed and self._state.broken is None:
            try:
                self.barrier()
            except GroupError as exc:  # as the store groups: logged, and the group closes all the same
                logger.warning("mooncake_ep: %r: the final barrier of close() failed: %s", self, exc)
        self._state.closed = True


# ----------------------------------------------------------------------------- jax.distributed

# The key-value client methods JaxGroup calls (jax._src.lib._jax.DistributedRuntimeClient).
_JAX_CLIENT_METHODS = ("key_value_set_bytes", "blocking_key_value_get_bytes", "key_value_try_get_bytes",
                       "key_value_increment", "key_value_delete")


class JaxGroup(_LedJoinGroup):
    """``jax.distributed``'s key-value client as a mooncake_ep group: our store protocol over it.

    The coordination service that ``jax.distributed.initialize`` started holds the keys, under
    ``{prefix}/{n}/`` (``n`` numbers rank 0's join attempts, as :class:`TorchStoreGroup`'s), so no
    extra port is used.
    ``barrier`` goes through the same keys as ``allgather_bytes`` rather than the client's
    ``wait_at_barrier``, so a rank that calls the other collective, or none, is named the same way.

    Args:
        client: the key-value client; None = ``jax._src.distributed.global_state.client``, the one
            ``jax.distributed.initialize()`` made (rank and world size then come from it too).
        rank: this process's rank (``jax.process_index()``); required with ``client``.
        world_size: number of processes (``jax.process_count()``); required with ``client``.
        timeout_s: seconds the rendezvous and every collective wait for their peers (math.inf =
            forever); a timeout names the ranks that did not come.
        device: CUDA device ordinal this rank uses (the group's ``device``), None = unset.
        prefix: namespace of our keys in the coordination service.

    Raises:
        GroupError: jax.distributed is not initialised, the client lacks a method this adapter
            needs (a jax whose private API moved), or the rendezvous failed.
    """

    _same_rank_hint = "every process needs its own process_id"

    def __init__(self, client: Any = None, *, rank: int | None = None, world_size: int | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S, device: int | None = None,
                 prefix: str = DEFAULT_PREFIX) -> None:
        if client is None:
            client, rank, world_size = _jax_global_client(rank, world_size)
        elif rank is None or world_size is None:
            raise ValueError("JaxGroup: with an explicit client, pass rank and world_size too")
        missing = [m for m in _JAX_CLIENT_METHODS if not callable(getattr(client, m, None))]
        if missing:
            raise GroupError(f"JaxGroup: the jax.distributed client ({type(client).__module__}."
                             f"{type(client).__name__}, jax {_jax_version()}) has no {missing}; mooncake_ep "
                             f"calls {list(_JAX_CLIENT_METHODS)} (as jax 0.10 has them); "
                             f"use init_group() with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT instead")
        self.client = client
        self.rank, self.world_size = _check_rank("JaxGroup", rank, world_size)
        self.device = _check_device("JaxGroup", device)
        self._init_collectives(_check_timeout("JaxGroup", timeout_s))
        if self.world_size == 1:
            return
        self._prefix = prefix
        self._rendezvous()

    def __repr__(self) -> str:
        return f"JaxGroup(rank={self.rank}, world_size={self.world_size})"

    def _where(self) -> str:
        return f"jax.distributed key-value store, keys {self._namespace}*"

    def _call(self, what: str, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception as exc:  # noqa: BLE001 - jax raises JaxRuntimeError, not exported everywhere
            raise GroupError(f"jax.distributed key-value {what} failed: {type(exc).__name__}: {exc}") from exc

    def _kv_set(self, key: str, value: bytes) -> None:
        # Overwriting, as every other store's set: the coordination service refuses a key set twice
        # by default (ALREADY_EXISTS), and every rank sets {namespace}epoch in renew_membership.
        self._call("set", lambda: self.client.key_value_set_bytes(key, value, allow_overwrite=True))

    def _kv_add(self, key: str, amount: int) -> int:
        return int(self._call("increment", self.client.key_value_increment, key, amount))

    def _kv_create(self, key: str, value: bytes) -> bytes:
        try:
            self.client.key_value_set_bytes(key, value)  # refused where the key exists (ALREADY_EXISTS)
            return value
        except Exception as exc:  # noqa: BLE001 - see _call
            if "ALREADY_EXISTS" not in str(exc):
                raise GroupError(f"jax.distributed key-value set of {key!r} failed: {type(exc).__name__}: "
                                 f"{exc}") from exc
        try:
            return self._kv_multi_get([key], _CREATED_READ_S)[0]
        except StoreTimeoutError as exc:  # set, yet unreadable: the service is failing
            raise GroupError(f"jax.distributed key-value get of {key!r}, which exists, failed: {exc}") from None

    def _kv_multi_get(self, keys: Sequence[str], timeout_s: float, reply_bytes: int = 0,
                      settle: bool = False, holders: Sequence[str] | None = None) -> list[bytes]:
        # No claims here: every key stays, and holders (_holder_keys: None) are never given.
        deadline = time.monotonic() + _finite_s(timeout_s)
        values = []
        for i, key in enumerate(keys):
            wait_ms = max(_MIN_WAIT_MS, int((deadline - time.monotonic()) * 1000))
            try:
                values.append(bytes(self.client.blocking_key_value_get_bytes(key, wait_ms)))
            except Exception as exc:  # noqa: BLE001 - see _call
                if _JAX_DEADLINE not in str(exc):
                    raise GroupError(f"jax.distributed key-value get of {key!r} failed: "
                                     f"{type(exc).__name__}: {exc}") from exc
                missing = [k for k in keys[i:] if not self._has(k)]
                raise StoreTimeoutError(f"jax.distributed key-value get timed out after {timeout_s} s "
                                        f"waiting for keys {missing}", missing or [key]) from None
        return values

    def _kv_try_get(self, key: str) -> bytes | None:
        try:
            return bytes(self.client.key_value_try_get_bytes(key))
        except Exception as exc:  # noqa: BLE001 - see _call
            if "NOT_FOUND" in str(exc):
                return None
            raise GroupError(f"jax.distributed key-value get of {key!r} failed: {type(exc).__name__}: {exc}") from exc

    def _join_lock_key(self) -> tuple:
        return "jax", id(self.client), self._prefix, self.rank

    def _kv_holds_all(self, keys: list[str]) -> bool:
        return all(self._kv_try_get(key) is not None for key in keys)  # a service gone: GroupError

    def _has(self, key: str) -> bool:
        try:
            self.client.key_value_try_get_bytes(key)
        except Exception:  # noqa: BLE001 - NOT_FOUND (or the service gone): not there for us
            return False
        return True

    def _kv_delete(self, key: str) -> None:
        self._call("delete", self.client.key_value_delete, key)


def _jax_version() -> str:
    try:
        import jax
    except ImportError:
        return "not installed"
    return jax.__version__


def _jax_global_client(rank: int | None, world_size: int | None) -> tuple[Any, int, int]:
    """The client, process id and process count of the initialised ``jax.distributed``."""
    try:
        distributed = importlib.import_module("jax._src.distributed")
    except ImportError as exc:
        raise GroupError(f"JaxGroup: cannot import jax._src.distributed (jax {_jax_version()}): {exc}; "
                         f"install jax, or use init_group() with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT") from exc
    state = getattr(distributed, "global_state", None)
    client = getattr(state, "client", None)
    if client is None:
        raise GroupError("JaxGroup: jax.distributed is not initialised; call jax.distributed.initialize("
                         "coordinator_address=..., num_processes=..., process_id=...) first")
    own_rank, own_world_size = state.process_id, state.num_processes
    for name, given, own in (("rank", rank, own_rank), ("world_size", world_size, own_world_size)):
        if given is not None and given != own:
            raise ValueError(f"JaxGroup: {name}={given} differs from jax.distributed's {own}; leave it out")
    return client, own_rank, own_world_size
