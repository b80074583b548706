"""transport/ipc.py on the CPU: handle exchange, route tables, peer checks, errors and teardown order.

Each rank is a LocalGroup thread posing as a process of its own: its own ProcessIdentity and its
own fake CUDA runtime (what one process sees: its devices, their PCI bus ids, which pairs have
peer access). The fakes record every IPC call, so the tests check what the transport asks CUDA
to do; that CUDA does it is the GPU tests' part (test_gpu_ipc.py).
"""

from __future__ import annotations

import gc
import threading

import pytest

import mooncake_ep as ep
from mooncake_ep.transport import TransportError
from mooncake_ep.transport.ipc import IpcTransport, PeerRecord, ProcessIdentity

LAZY_PEER_ACCESS = 1  # cudaIpcMemLazyEnablePeerAccess
# Where a fake process maps a peer's allocation: distinct from every real pointer of the test.
MAPPED_BASE = 0x7F00_0000_0000
WORKSPACE_BYTES = 1 << 20


def bus_id(gpu: int) -> str:
    return f"0000:{0x10 + gpu:02x}:00.0"


class FakeCudaError(RuntimeError):
    pass


class FakeRuntime:
    """The slice of cupy.cuda.runtime the transport uses, as one process sees a machine.

    Args:
        visible: physical GPU numbers this process sees; ordinal i is visible[i].
        peer_pairs: physical (a, b) pairs with peer access (both directions).
        fail_open: make cudaIpcOpenMemHandle fail.
    """

    CUDARuntimeError = FakeCudaError
    cudaIpcMemLazyEnablePeerAccess = LAZY_PEER_ACCESS

    def __init__(self, visible=(0,), peer_pairs=(), fail_open=False):
        self.visible = list(visible)
        self.peer_pairs = {frozenset(p) for p in peer_pairs}
        self.fail_open = fail_open
        self.current = 0
        self.calls: list[tuple] = []
        self.open_mappings: dict[int, bytes] = {}

    def getDevice(self):
        return self.current

    def setDevice(self, device):
        self.current = device

    def deviceGetPCIBusId(self, device):
        return bus_id(self.visible[device]).upper()  # CUDA answers in upper case

    def deviceGetByPCIBusId(self, bus):
        for ordinal, gpu in enumerate(self.visible):
            if bus_id(gpu) == bus.lower():
                return ordinal
        raise FakeCudaError("cudaErrorInvalidDevice: invalid device ordinal")

    def deviceCanAccessPeer(self, device, peer):
        return int(frozenset((self.visible[device], self.visible[peer])) in self.peer_pairs)

    def deviceEnablePeerAccess(self, peer):
        self.calls.append(("enable_peer", self.current, peer))

    def ipcGetMemHandle(self, ptr):
        return b"H" + ptr.to_bytes(8, "little") + bytes(55)

    def ipcOpenMemHandle(self, handle, flags):
        self.calls.append(("open", self.current, handle, flags))
        if self.fail_open:
            raise FakeCudaError("cudaErrorMapBufferObjectFailed: mapping of buffer object failed")
        ptr = MAPPED_BASE + int.from_bytes(handle[1:9], "little")
        self.open_mappings[ptr] = handle
        return ptr

    def ipcCloseMemHandle(self, ptr):
        self.calls.append(("close", self.current, ptr))
        assert ptr in self.open_mappings, f"closing {ptr:#x}, which is not an open mapping"
        del self.open_mappings[ptr]


class FakeWorkspace:
    def __init__(self, ptr, device_id=0, num_bytes=WORKSPACE_BYTES):
        self.ptr, self.device_id, self.num_bytes = ptr, device_id, num_bytes


def process(rank: int, host: str = "boot-a", pid: int | None = None) -> ProcessIdentity:
    return ProcessIdentity(host, f"host-{host}", 1000 + rank if pid is None else pid, f"nonce{rank}")


def workspace_ptr(rank: int, generation: int = 0) -> int:
    return 0x1_0000_0000 * (rank + 1) + generation * 0x1000


def run(num_ranks: int, fn):
    """fn(group) on one thread per rank; each rank's result or exception."""
    out = [None] * num_ranks

    def rank_fn(group):
        try:
            out[group.rank] = fn(group)
        except BaseException as exc:  # noqa: BLE001 - inspected by the test
            out[group.rank] = exc

    ep.LocalGroup(num_ranks, timeout_s=30.0).spawn(rank_fn)
    return out


def connected(group, runtime: FakeRuntime) -> IpcTransport:
    """The group rank's transport over its first workspace, connected (collective)."""
    transport = IpcTransport(group, FakeWorkspace(workspace_ptr(group.rank)), runtime=runtime,
                             process=process(group.rank))
    transport.connect()
    transport.commit()
    return transport


def mapped(rank: int, generation: int = 0) -> int:
    return MAPPED_BASE + workspace_ptr(rank, generation)


# ----------------------------------------------------------------------------- connecting


@pytest.mark.parametrize("num_ranks", [2, 4])
def test_processes_on_one_gpu_map_every_peer(num_ranks):
    runtimes = [FakeRuntime() for _ in range(num_ranks)]

    def rank_fn(group):
        transport = IpcTransport(group, FakeWorkspace(workspace_ptr(group.rank)), runtime=runtimes[group.rank],
                                 process=process(group.rank))
        route, replaced = transport.connect()
        return route, replaced, transport.exported

    out = run(num_ranks, rank_fn)
    for rank, (route, replaced, exported) in enumerate(out):
        # Own entry: our own pointer; every peer: our mapping of its handle.
        assert route == [workspace_ptr(r) if r == rank else mapped(r) for r in range(num_ranks)]
        assert replaced == [] and exported
        opens = [call for call in runtimes[rank].calls if call[0] == "open"]
        assert [(device, flags) for _, device, _, flags in opens] == [(0, LAZY_PEER_ACCESS)] * (num_ranks - 1)
        assert sorted(int.from_bytes(h[1:9], "little") for _, _, h, _ in opens) == \
            [workspace_ptr(r) for r in range(num_ranks) if r != rank]


def test_gpus_with_peer_access_are_mapped_and_the_current_device_is_restored():
    runtimes = [FakeRuntime(visible=(0, 1), peer_pairs=[(0, 1)]) for _ in range(2)]

    def rank_fn(group):
        runtime = runtimes[group.rank]
        runtime.current = 1 - group.rank  # the caller's current device is not the rank's
        transport = IpcTransport(group, FakeWorkspace(workspace_ptr(group.rank), device_id=group.rank),
                                 runtime=runtime, process=process(group.rank))
        route, _ = transport.connect()
        return route, runtime.current

    out = run(2, rank_fn)
    assert out == [([workspace_ptr(0), mapped(1)], 1), ([mapped(0), workspace_ptr(1)], 0)]
    assert [c[1] for c in runtimes[0].calls if c[0] == "open"] == [0]  # mapped into the rank's own device
    assert [c[1] for c in runtimes[1].calls if c[0] == "open"] == [1]


def test_gpus_without_peer_access_are_refused_on_every_rank_naming_both():
    # Ranks 0, 1 on GPU 0; rank 2 on GPU 1, which GPU 0 cannot reach.
    gpus = [0, 0, 1]
    runtimes = [FakeRuntime(visible=(0, 1)) for _ in range(3)]

    def rank_fn(group):
        transport = IpcTransport(group, FakeWorkspace(workspace_ptr(group.rank), device_id=gpus[group.rank]),
                                 runtime=runtimes[group.rank], process=process(group.rank))
        return transport.connect()

    out = run(3, rank_fn)
    for error in out:
        assert isinstance(error, TransportError), out
        message = str(error)
        assert f"rank 0 (pid 1000, cuda:0 = GPU {bus_id(0)}) cannot access the memory of rank 2 (pid 1002, " \
               f"cuda:1 = GPU {bus_id(1)})" in message
        assert f"on rank 2: rank 2 (pid 1002, cuda:1 = GPU {bus_id(1)}) cannot access the memory of rank 0" in message
        assert "cudaDeviceCanAccessPeer is 0" in message
    # No rank opened anything it could not use: ranks 0 and 1 opened each other only.
    assert [len([c for c in r.calls if c[0] == "open"]) for r in runtimes] == [1, 1, 0]


def test_ranks_on_other_hosts_need_the_proxy_transport():
    hosts = ["boot-a", "boot-a", "boot-b", "boot-b"]

    def rank_fn(group):
        transport = IpcTransport(group, FakeWorkspace(workspace_ptr(group.rank)), runtime=FakeRuntime(),
                                 process=process(group.rank, host=hosts[group.rank]))
        return transport.connect()

    for error in run(4, rank_fn):
        assert isinstance(error, TransportError)
        assert ("the ranks run on 2 hosts (ranks [0, 1] on host 'host-boot-a', ranks [2, 3] on host 'host-boot-b'): "
                "ranks on different hosts need the proxy transport") in str(error)


def test_a_handle_that_does_not_open_fails_every_rank_with_its_reason():
    # Rank 1 sees only its own GPU (CUDA_VISIBLE_DEVICES=1), and the driver refuses the mapping.
    runtimes = [FakeRuntime(visible=(0, 1), peer_pairs=[(0, 1)]), FakeRuntime(visible=(1,), fail_open=True)]

    def rank_fn(group):
        transport = IpcTransport(group, FakeWorkspace(workspace_ptr(group.rank)), runtime=runtimes[group.rank],
                                 process=process(group.rank))
        try:
            return transport.connect()
        finally:
            transport.close()

    out = run(2, rank_fn)
    for error in out:
        assert isinstance(error, TransportError), out
        message = str(error)
        assert f"on rank 1: rank 1 (pid 1001, cuda:0 = GPU {bus_id(1)}) could not open the workspace of rank 0 " \
               f"(pid 1000, cuda:0 = GPU {bus_id(0)}) (cudaIpcOpenMemHandle: cudaErrorMapBufferObjectFailed" in message
        assert f"GPU {bus_id(0)} is not visible in this process (CUDA_VISIBLE_DEVICES=" in message
        assert "on rank 0" not in message  # rank 0 mapped rank 1 fine
    assert runtimes[0].open_mappings == {}  # and closed it again


def test_peers_in_this_process_get_plain_pointers():
    """Ranks of a multi-process group that share a process (threads) cannot IPC each other."""
    runtime = FakeRuntime(visible=(0, 1), peer_pairs=[(0, 1)])
    shared = process(0, pid=4242)
    devices = [0, 1, 0]
    identities = [shared, shared, process(2)]
    runtimes = [runtime, runtime, FakeRuntime(visible=(0, 1), peer_pairs=[(0, 1)])]
    lock = threading.Lock()  # the two threads share one fake runtime's current device

    def rank_fn(group):
        with lock:
            transport = IpcTransport(group, FakeWorkspace(workspace_ptr(group.rank), device_id=devices[group.rank]),
                                     runtime=runtimes[group.rank], process=identities[group.rank])
        return transport.connect()[0]

    out = run(3, rank_fn)
    assert out[0] == [workspace_ptr(0), workspace_ptr(1), mapped(2)]
    assert out[1] == [workspace_ptr(0), workspace_ptr(1), mapped(2)]
    assert out[2] == [mapped(0), mapped(1), workspace_ptr(2)]
    # The two same-process ranks on different devices enabled peer access instead of IPC.
    assert sorted(c for c in runtime.calls if c[0] == "enable_peer") == [("enable_peer", 0, 1), ("enable_peer", 1, 0)]


def test_peer_record_round_trips():
    record = PeerRecord(process(3), 1, bus_id(1), "ab" * 8, 0x1234, 4096, bytes(range(64)))
    assert PeerRecord.unpack(record.pack()) == record


# ----------------------------------------------------------------------------- replacing and closing


def test_reconnect_maps_only_the_replaced_rank_and_closes_its_old_mapping_at_the_commit():
    """The dead process's mapping stays open, and in the route table, until every rank has written its new
    route table (commit): a connect that fails later leaves no route table pointing at a closed mapping."""
    runtimes = [FakeRuntime() for _ in range(3)]

    def rank_fn(group):
        runtime = runtimes[group.rank]
        transport = IpcTransport(group, FakeWorkspace(workspace_ptr(group.rank)), runtime=runtime,
                                 process=process(group.rank))
        first = transport.connect()
        transport.commit()
        if group.rank == 2:  # the process dies; a replacement with a new workspace takes rank 2
            group.barrier()
            transport = IpcTransport(group, FakeWorkspace(workspace_ptr(2, 1)), runtime=FakeRuntime(),
                                     process=process(2, pid=2002))
            second = transport.connect()
            transport.commit()
            return first, second, None, set()
        group.barrier()
        before = len(runtime.calls)
        second = transport.connect()
        assert runtime.calls[before:] == [("open", 0, runtime.calls[-1][2], LAZY_PEER_ACCESS)]
        open_before_commit = set(runtime.open_mappings)
        transport.commit()
        assert runtime.calls[-1] == ("close", 0, mapped(2))
        return first, second, open_before_commit, set(runtime.open_mappings)

    out = run(3, rank_fn)
    for rank in (0, 1):
        (_, first_replaced), (route, replaced), open_before_commit, open_mappings = out[rank]
        assert first_replaced == [] and replaced == [2]
        assert route == [workspace_ptr(r) if r == rank else mapped(r) for r in (0, 1)] + [mapped(2, 1)]
        assert open_before_commit == {mapped(1 - rank), mapped(2), mapped(2, 1)}
        assert open_mappings == {mapped(1 - rank), mapped(2, 1)}
    assert out[2][1] == ([mapped(0), mapped(1), workspace_ptr(2, 1)], [])


def test_a_failed_updates_new_mappings_are_abandoned_and_its_rank_stays_replaced():
    """A reconnect that failed (here: the new workspace would not open on rank 1) keeps the dead process's
    mapping, which the route table still holds, and the retry reports the rank replaced again, so the
    Buffer clears the flags the dead process left (helper-113). A survivor closes its mappings of the
    failed replacement's workspace before that process frees it (abandon, between the barriers of the
    replacement's destroy)."""
    runtimes = [FakeRuntime() for _ in range(3)]

    def rank_fn(group):
        runtime = runtimes[group.rank]
        transport = connected(group, runtime)
        if group.rank == 2:  # dies; a replacement whose workspace rank 1 cannot open, then another
            group.barrier()
            failed = IpcTransport(group, FakeWorkspace(workspace_ptr(2, 1)), runtime=FakeRuntime(),
                                  process=process(2, pid=2002))
            with pytest.raises(TransportError):
                failed.connect()
            failed.close()
            group.barrier()
            transport = IpcTransport(group, FakeWorkspace(workspace_ptr(2, 2)), runtime=FakeRuntime(),
                                     process=process(2, pid=2003))
            return transport.connect()[1]
        group.barrier()
        runtime.fail_open = group.rank == 1
        with pytest.raises(TransportError):
            transport.connect()
        transport.abandon()
        open_after_failure = set(runtime.open_mappings)
        runtime.fail_open = False
        group.barrier()
        route, replaced = transport.connect()
        transport.commit()
        return replaced, open_after_failure, set(runtime.open_mappings), route[2]

    out = run(3, rank_fn)
    # Rank 0 had opened the failed replacement's workspace (mapped(2, 1)): closed before it frees, while the
    # dead process's (mapped(2)) stays open until the retry's commit.
    assert out[0] == ([2], {mapped(1), mapped(2)}, {mapped(1), mapped(2, 2)}, mapped(2, 2)), out
    assert out[1] == ([2], {mapped(0), mapped(2)}, {mapped(0), mapped(2, 2)}, mapped(2, 2)), out


def test_a_connect_left_neither_committed_nor_abandoned_closes_its_new_mappings_at_the_next():
    """The next connect maps afresh: what the last one opened may be freed by now, and is closed."""
    runtimes = [FakeRuntime() for _ in range(2)]

    def rank_fn(group):
        runtime = runtimes[group.rank]
        transport = IpcTransport(group, FakeWorkspace(workspace_ptr(group.rank)), runtime=runtime,
                                 process=process(group.rank))
        transport.connect()
        transport.connect()
        transport.commit()
        return [call[0] for call in runtime.calls], set(runtime.open_mappings)

    for rank, (calls, open_mappings) in enumerate(run(2, rank_fn)):
        assert calls == ["open", "close", "open"] and open_mappings == {mapped(1 - rank)}


def test_a_workspace_one_rank_cannot_export_fails_every_rank_with_its_reason():
    """cudaIpcGetMemHandle ran before the exchange: the failing rank raised alone, and its peers, still in
    the exchange, timed out or met its next collective without the cause (helper-152)."""

    class NoIpc(FakeRuntime):
        def ipcGetMemHandle(self, ptr):
            raise FakeCudaError("cudaErrorNotSupported: operation not supported")

    runtimes = [FakeRuntime(), NoIpc(), FakeRuntime()]

    def rank_fn(group):
        return IpcTransport(group, FakeWorkspace(workspace_ptr(group.rank)), runtime=runtimes[group.rank],
                            process=process(group.rank)).connect()

    for rank, error in enumerate(run(3, rank_fn)):
        assert isinstance(error, TransportError) and str(error) == (
            f"Buffer (ipc transport, rank {rank}): could not export the workspaces: on rank 1: cudaIpcGetMemHandle "
            f"of the workspace on cuda:0 failed: cudaErrorNotSupported: operation not supported; CUDA IPC needs Linux "
            f"and memory from cudaMalloc"), error
        assert runtimes[rank].calls == []  # nothing was opened


def test_a_cuda_error_on_one_rank_fails_every_rank_with_it():
    """Only a TransportError was shared: a CUDA error of one rank's peer query escaped there alone, and
    its peers timed out in the group's next collective without the cause (local.connect shares any)."""

    class FailingPeerQuery(FakeRuntime):
        def deviceCanAccessPeer(self, device, peer):
            raise FakeCudaError("cudaErrorUnknown: unknown error")

    runtimes = [FakeRuntime(visible=(0, 1), peer_pairs=[(0, 1)]), FailingPeerQuery(visible=(0, 1), peer_pairs=[(0, 1)])]

    def rank_fn(group):
        transport = IpcTransport(group, FakeWorkspace(workspace_ptr(group.rank), device_id=group.rank),
                                 runtime=runtimes[group.rank], process=process(group.rank))
        try:
            return transport.connect()
        finally:
            transport.close()

    for error in run(2, rank_fn):
        assert isinstance(error, TransportError) and "FakeCudaError: cudaErrorUnknown" in str(error), error


def test_close_is_idempotent_and_garbage_collection_closes_too():
    runtimes = [FakeRuntime() for _ in range(3)]

    def rank_fn(group):
        runtime = runtimes[group.rank]
        transport = connected(group, runtime)
        if group.rank == 0:
            transport.close()
            transport.close()
            assert not transport.exported
        else:
            del transport  # dropped without close: the finalizer closes what it opened
            gc.collect()
        return sorted(c[2] for c in runtime.calls if c[0] == "close")

    out = run(3, rank_fn)
    assert out == [sorted(mapped(r) for r in range(3) if r != rank) for rank in range(3)]
    assert all(r.open_mappings == {} for r in runtimes)


def test_local_connect_fails_on_every_rank_when_some_lack_peer_access():
    """In-process ranks on cuda:0-2, where cuda:1 and cuda:2 have no peer access: ranks 1 and 2 fail,
    and so does rank 0, which could reach both (it had kept routes to the workspaces they then free)."""
    from mooncake_ep.transport import local

    runtime = FakeRuntime(visible=(0, 1, 2), peer_pairs=((0, 1), (0, 2)))
    out = run(3, lambda group: local.connect(group, FakeWorkspace(workspace_ptr(group.rank), group.rank), runtime))
    assert all(isinstance(e, TransportError) for e in out), out
    for e in out:
        assert str(e) == ("Buffer (local transport): could not reach the peers' workspaces: on rank 1: cuda:1 cannot "
                          "access the memory of rank 2 on cuda:2 (no peer access between these GPUs); on rank 2: "
                          "cuda:2 cannot access the memory of rank 1 on cuda:1 (no peer access between these GPUs)")
    runtime = FakeRuntime(visible=(0, 1, 2), peer_pairs=((0, 1), (0, 2), (1, 2)))
    routes = run(3, lambda group: local.connect(group, FakeWorkspace(workspace_ptr(group.rank), group.rank), runtime))
    assert routes == [[workspace_ptr(r) for r in range(3)]] * 3

    class FailingOnDevice2(FakeRuntime):  # a CUDA error, not a refusal, on one rank only
        def deviceCanAccessPeer(self, device, peer):
            if device == 2:
                raise FakeCudaError("cudaErrorUnknown: unknown error")
            return super().deviceCanAccessPeer(device, peer)
    runtime = FailingOnDevice2(visible=(0, 1, 2), peer_pairs=((0, 1), (0, 2), (1, 2)))
    out = run(3, lambda group: local.connect(group, FakeWorkspace(workspace_ptr(group.rank), group.rank), runtime))
    assert all(isinstance(e, TransportError) and str(e).endswith("on rank 2: FakeCudaError: cudaErrorUnknown: "
                                                                 "unknown error") for e in out), out
