"""The ``ipc`` transport: ranks in separate processes of one host, one GPU each or several per GPU.

Each rank exports its workspace (our own ``cudaMalloc``, so legacy CUDA IPC can) with
``cudaIpcGetMemHandle``; the handles go round the group (``allgather_bytes``), and every rank maps
its peers' workspaces with ``cudaIpcOpenMemHandle`` (``cudaIpcMemLazyEnablePeerAccess``: the
driver enables peer access between two GPUs as it maps). The route table gets the mapped
addresses; a rank's own entry is its own pointer (a process cannot open its own handle).

Processes on the same GPU map each other too: that is how several processes share one GPU.
Ranks on different GPUs need peer access between them (checked with ``cudaDeviceCanAccessPeer``
and named in the error). Ranks on different hosts are refused: they need the ``proxy`` transport.
Two ranks that happen to be one process (two groups' ranks on threads) use plain pointers, as
the ``local`` transport does.

Every decision that could differ between ranks is made on the gathered records, or agreed on
with a second allgather (:meth:`IpcTransport.connect`), so a failure raises on every rank and
never leaves one rank waiting in a collective that its peers have abandoned.

Lifetime, and the order CUDA requires (an exporter may free its memory only once every importer
has closed its mapping): the owner waits for its own kernels, barriers, calls :meth:`close`,
barriers again, then frees its workspace (``CudaBackend.destroy``). :meth:`connect` called again
(``Buffer.update_ep_member``) maps only the ranks whose workspace changed, beside the mappings the
route table holds; :meth:`commit` then closes the replaced ranks' old mappings, once every rank
wrote its new route table, and :meth:`abandon` instead closes the new ones, of replacements whose
construction failed with the update and which free their workspaces. Until the commit the route
table keeps pointing at mappings that stay open.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import socket
import weakref
from collections.abc import Iterator

from mooncake_ep.transport.local import enable_peer_access
from mooncake_ep.transport.workspace import TransportError, failure_text, raise_if_any_failed

logger = logging.getLogger("mooncake_ep")

# Identifies this boot of this machine: two processes with the same one can share GPU memory.
# Hostnames may repeat across containers of one machine, and differ for one machine's containers.
_BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"
# Tells this process from another that reuses its pid (another container, or after an exit); a
# forked child shares it but not the pid.
_PROCESS_NONCE = os.urandom(8).hex()


@dataclasses.dataclass(frozen=True)
class ProcessIdentity:
    """Where a rank runs.

    Attributes:
        host_id: the boot id of the machine (its hostname where there is none).
        hostname: for messages.
        pid: the process id.
        nonce: random per process (see ``_PROCESS_NONCE``).
    """

    host_id: str
    hostname: str
    pid: int
    nonce: str

    def same_process(self, other: ProcessIdentity) -> bool:
        return (self.host_id, self.pid, self.nonce) == (other.host_id, other.pid, other.nonce)


def this_process() -> ProcessIdentity:
    """The identity of the calling process."""
    hostname = socket.gethostname()
    try:
        with open(_BOOT_ID_PATH) as f:
            host_id = f.read().strip() or hostname
    except OSError:  # not Linux (where CUDA IPC is not available anyway)
        host_id = hostname
    return ProcessIdentity(host_id, hostname, os.getpid(), _PROCESS_NONCE)


@dataclasses.dataclass(frozen=True)
class PeerRecord:
    """What one rank tells the others about its workspace.

    Attributes:
        process: where the rank runs.
        device_id: its CUDA ordinal, as its own process numbers devices (for messages).
        bus_id: the PCI bus id of its GPU, the same name in every process whatever
            ``CUDA_VISIBLE_DEVICES`` says.
        workspace_id: random per workspace: a peer whose id changed was replaced.
        workspace_ptr: the workspace's address in its own process (used by same-process peers).
        num_bytes: the workspace's size.
        handle: its ``cudaIpcMemHandle_t`` (64 bytes).
    """

    process: ProcessIdentity
    device_id: int
    bus_id: str
    workspace_id: str
    workspace_ptr: int
    num_bytes: int
    handle: bytes

    def pack(self) -> bytes:
        fields = dataclasses.asdict(self)
        fields["handle"] = self.handle.hex()
        return json.dumps(fields, sort_keys=True).encode()

    @classmethod
    def unpack(cls, blob: bytes) -> PeerRecord:
        fields = json.loads(blob)
        return cls(**dict(fields, process=ProcessIdentity(**fields["process"]), handle=bytes.fromhex(fields["handle"])))

    def describe(self, rank: int) -> str:
        return f"rank {rank} (pid {self.process.pid}, cuda:{self.device_id} = GPU {self.bus_id})"


@dataclasses.dataclass(frozen=True)
class _Mapping:
    """How this process reaches one rank's workspace."""

    workspace_id: str
    ptr: int
    opened: bool  # True: an IPC mapping this process must close; False: a plain pointer


class IpcTransport:
    """The route table of one rank whose peers are other processes of this host.

    Args:
        group: the ranks (a multi-process :class:`mooncake_ep.Group`).
        workspace: this rank's :class:`~mooncake_ep.transport.DeviceWorkspace` (or anything with
            ``ptr``, ``num_bytes`` and ``device_id``).
        runtime: the CUDA runtime module; default ``cupy.cuda.runtime`` (tests pass a fake).
        process: this process's identity; default :func:`this_process` (tests pass fakes).

    Note:
        The mappings this object opened are closed by :meth:`close`, or when it is
        garbage-collected (not at interpreter exit, when the process's CUDA context goes anyway).
    """

    def __init__(self, group, workspace, *, runtime=None, process: ProcessIdentity | None = None):
        if runtime is None:
            import cupy

            runtime = cupy.cuda.runtime
        self.group = group
        self.workspace = workspace
        self._runtime = runtime
        self._process = process if process is not None else this_process()
        self._workspace_id = os.urandom(8).hex()
        self._record: PeerRecord | None = None
        # The mappings of the last committed connect (the ones the route table holds), and those a
        # connect since opened for ranks whose workspace changed: committed, or abandoned. A replaced
        # rank's old mapping stays open until the commit, so a connect that fails anywhere (an open
        # here, a route table on another rank) leaves every route table pointing at open mappings,
        # and the retry still finds the rank replaced (the old process's flags still to be cleared).
        self._mappings: dict[int, _Mapping] = {}
        self._new_mappings: dict[int, _Mapping] = {}
        self.peers: list[PeerRecord] = []
        self._finalizer = weakref.finalize(self, _close_all, runtime, workspace.device_id, self._mappings,
                                           self._new_mappings)
        self._finalizer.atexit = False

    @property
    def exported(self) -> bool:
        """Whether another process may have mapped this rank's workspace (since the last connect)."""
        return any(not peer.process.same_process(self._process) for peer in self.peers)

    def connect(self) -> tuple[list[int], list[int]]:
        """Exchange handles through the group and map every peer's workspace (collective).

        Called again, it maps only the ranks whose workspace changed, and keeps their old mappings
        open until :meth:`commit` (or closes the new ones at :meth:`abandon`). The caller makes
        sure that none of its kernels is running.

        Returns:
            ``(route, replaced)``: route is one address per rank, this process's view of each
            rank's workspace; replaced lists the ranks whose workspace changed since the last
            committed connect (empty on the first).

        Raises:
            TransportError: on every rank alike: a rank that could not export its workspace, ranks
                on different hosts (the proxy transport is needed), two GPUs without peer access,
                or a handle that would not open (each failing rank's reason is in the message).
                Mappings opened before the failure stay recorded, for :meth:`abandon`, :meth:`close`
                or garbage collection to close.
        """
        where = f"Buffer (ipc transport, rank {self.group.rank})"
        try:
            mine = self._describe().pack()
        except Exception as exc:  # noqa: BLE001 - said in the exchange: the peers must not wait for a record
            mine = json.dumps({"failed": failure_text(exc)}).encode()
        blobs = self.group.allgather_bytes(mine)
        failures = {rank: fields["failed"] for rank, fields in enumerate(map(json.loads, blobs)) if "failed" in fields}
        if failures:
            raise TransportError(f"{where}: could not export the workspaces: " +
                                 "; ".join(f"on rank {rank}: {message}" for rank, message in failures.items()))
        records = [PeerRecord.unpack(blob) for blob in blobs]
        _check_one_host(where, records)
        failure = ""
        try:
            self._map(records)
        except Exception as exc:  # noqa: BLE001 - a runtime error too: every rank must hear of it
            failure = failure_text(exc)
        raise_if_any_failed(self.group, f"{where}: could not map the peers' workspaces", failure)
        self.peers = records
        replaced = sorted(rank for rank in self._new_mappings if rank in self._mappings)
        return [self._mapping(rank).ptr for rank in range(len(records))], replaced

    def commit(self) -> None:
        """The route table of :meth:`connect` is written on every rank: close the replaced ranks' old
        mappings (no kernel of this rank runs: the caller's connect waited for them)."""
        for rank in sorted(self._new_mappings):
            if rank in self._mappings:
                self._unmap(rank)
        self._mappings.update(self._new_mappings)
        self._new_mappings.clear()

    def close(self) -> None:
        """Close every IPC mapping of a peer's workspace this process opened. Idempotent.

        Note:
            Local only (no collective): the caller orders it, after a barrier that proves no
            kernel reads a peer any more, and before the barrier after which peers free.
        """
        _close_all(self._runtime, self.workspace.device_id, self._mappings, self._new_mappings)
        self.peers = []

    def abandon(self) -> None:
        """Close the mappings the last :meth:`connect` opened, and forget them (local only): an update
        failed, and the replacements, whose construction failed with it, free those workspaces now.
        The route table holds the committed ones, which stay; the ranks stay replaced for the
        next connect, which maps their next processes' workspaces."""
        _close_mappings(self._runtime, self.workspace.device_id, self._new_mappings)

    def _mapping(self, rank: int) -> _Mapping:
        """How this process reaches ``rank``'s workspace as the last connect found it."""
        return self._new_mappings.get(rank) or self._mappings[rank]

    # --- internals

    def _describe(self) -> PeerRecord:
        if self._record is None or self._record.workspace_ptr != self.workspace.ptr:
            runtime, device_id = self._runtime, self.workspace.device_id
            with _on_device(runtime, device_id):
                try:
                    handle = bytes(runtime.ipcGetMemHandle(self.workspace.ptr))
                except runtime.CUDARuntimeError as exc:
                    raise TransportError(f"cudaIpcGetMemHandle of the workspace on cuda:{device_id} failed: {exc}; "
                                         f"CUDA IPC needs Linux and memory from cudaMalloc") from exc
            self._record = PeerRecord(self._process, device_id, _bus_id(runtime, device_id), self._workspace_id,
                                      self.workspace.ptr, self.workspace.num_bytes, handle)
        return self._record

    def _map(self, records: list[PeerRecord]) -> None:
        """Map each rank whose workspace differs from the committed mapping's, into ``_new_mappings``."""
        me = self.group.rank
        mine = records[me]
        # Left by a connect that failed and was not abandoned: their workspaces may be freed by now.
        _close_mappings(self._runtime, self.workspace.device_id, self._new_mappings)
        for rank, peer in enumerate(records):
            current = self._mappings.get(rank)
            if current is not None and current.workspace_id == peer.workspace_id:
                continue
            if rank == me:
                mapping = _Mapping(peer.workspace_id, self.workspace.ptr, opened=False)
            elif peer.process.same_process(self._process):
                if peer.bus_id != mine.bus_id:
                    enable_peer_access(mine.device_id, peer.device_id,
                                       f"{mine.describe(me)} cannot access the memory of {peer.describe(rank)}",
                                       self._runtime)
                mapping = _Mapping(peer.workspace_id, peer.workspace_ptr, opened=False)
            else:
                mapping = _Mapping(peer.workspace_id, self._open(me, mine, rank, peer), opened=True)
            self._new_mappings[rank] = mapping

    def _open(self, me: int, mine: PeerRecord, rank: int, peer: PeerRecord) -> int:
        runtime = self._runtime
        local_device = None  # the peer's GPU in this process's numbering, if it sees it
        if peer.bus_id != mine.bus_id:
            try:
                local_device = int(runtime.deviceGetByPCIBusId(peer.bus_id))
            except runtime.CUDARuntimeError:
                pass  # not visible here (CUDA_VISIBLE_DEVICES): the driver may still map it
            if local_device is not None and not runtime.deviceCanAccessPeer(mine.device_id, local_device):
                raise TransportError(
                    f"{mine.describe(me)} cannot access the memory of {peer.describe(rank)}: GPUs {mine.bus_id} "
                    f"and {peer.bus_id} have no peer access (cudaDeviceCanAccessPeer is 0); run these ranks on "
                    f"GPUs connected by NVLink or a PCIe switch that allows peer-to-peer")
        with _on_device(runtime, mine.device_id):
            try:
                return int(runtime.ipcOpenMemHandle(peer.handle, runtime.cudaIpcMemLazyEnablePeerAccess))
            except runtime.CUDARuntimeError as exc:
                hidden = ""
                if peer.bus_id != mine.bus_id and local_device is None:
                    hidden = (f"; GPU {peer.bus_id} is not visible in this process (CUDA_VISIBLE_DEVICES="
                              f"{os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}): make every rank's GPU visible "
                              f"to every rank and pick the device with init_group(device=...)")
                raise TransportError(f"{mine.describe(me)} could not open the workspace of {peer.describe(rank)} "
                                     f"(cudaIpcOpenMemHandle: {exc}){hidden}") from exc

    def _unmap(self, rank: int) -> None:
        mapping = self._mappings.pop(rank)
        if mapping.opened:
            _close_mappings(self._runtime, self.workspace.device_id, {rank: mapping})


def _check_one_host(where: str, records: list[PeerRecord]) -> None:
    hosts: dict[str, tuple[str, list[int]]] = {}
    for rank, record in enumerate(records):
        hosts.setdefault(record.process.host_id, (record.process.hostname, []))[1].append(rank)
    if len(hosts) > 1:
        listed = ", ".join(f"ranks {ranks} on host {name!r}" for name, ranks in hosts.values())
        raise TransportError(f"{where}: the ranks run on {len(hosts)} hosts ({listed}): ranks on different hosts "
                             f"need the proxy transport (RDMA or TCP between nodes), which is not built yet; run "
                             f"every rank of a Buffer on one host")


def _close_all(runtime, device_id: int, *mappings: dict[int, _Mapping]) -> None:
    """:func:`_close_mappings` of each dict (also the finalizer)."""
    for each in mappings:
        _close_mappings(runtime, device_id, each)


def _close_mappings(runtime, device_id: int, mappings: dict[int, _Mapping]) -> None:
    """cudaIpcCloseMemHandle every opened mapping and forget them all."""
    for rank in sorted(mappings):
        mapping = mappings.pop(rank)
        if not mapping.opened:
            continue
        try:
            with _on_device(runtime, device_id):
                runtime.ipcCloseMemHandle(mapping.ptr)
        except Exception as exc:  # noqa: BLE001 - closing the others matters more; the OS reclaims at exit
            logger.warning("mooncake_ep: closing the IPC mapping of rank %d's workspace failed: %s", rank, exc)


def _bus_id(runtime, device_id: int) -> str:
    return str(runtime.deviceGetPCIBusId(device_id)).lower()


@contextlib.contextmanager
def _on_device(runtime, device_id: int) -> Iterator[None]:
    """Make ``device_id`` current (IPC maps into, and closes from, the current device)."""
    previous = runtime.getDevice()
    runtime.setDevice(device_id)
    try:
        yield
    finally:
        runtime.setDevice(previous)
