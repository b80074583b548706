"""CudaBackend's host-side protocol on the CPU: connect, the per-configuration check, teardown order.

The backend is built without __init__ (which loads kernels and allocates device memory) and given
stand-ins: a workspace backed by host bytes, a transport that returns a route, a group that
records its collectives. What runs is the backend's own code: what it writes where, which
collectives it makes in which order, and what it frees when. Kernels and real IPC are the GPU
tests' part (test_gpu_ipc.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import struct
import threading
import weakref

import pytest

import mooncake_ep as ep
from mooncake_ep import _constants, _cuda_backend, kernels, layout
from mooncake_ep._cuda_backend import CudaBackend
from mooncake_ep.group import GroupError
from mooncake_ep.transport import TransportError

STEPS = struct.Struct("<4I")  # ep::State's dispatch_step[2], combine_step[2]
STATE = layout.HEADER_OFFSETS["state"]


class HostWorkspace:
    """A DeviceWorkspace stand-in: host bytes, with what the backend calls on it."""

    def __init__(self, num_bytes: int, log: list, name: str, fill: int = 0):
        self.memory = bytearray([fill]) * num_bytes
        self.ptr = 0x5000_0000
        self.device_id = 0
        self.num_bytes = num_bytes
        self.log, self.name = log, name

    def write(self, offset: int, data: bytes) -> None:
        self.memory[offset:offset + len(data)] = data

    def read(self, offset: int, num_bytes: int) -> bytes:
        return bytes(self.memory[offset:offset + num_bytes])

    peek = read  # on the host there is no device to synchronise

    def synchronize(self) -> None:
        self.log.append("synchronize")

    def write_on_stream(self, offset: int, data: bytes, stream_ptr: int) -> None:
        self.log.append(f"write {self.name} on stream {stream_ptr:#x}")
        self.write(offset, data)

    def free(self) -> None:
        self.log.append(f"free {self.name}")

    def abandon(self) -> None:
        self.log.append(f"abandon {self.name}")


class RecordingTransport:
    def __init__(self, log: list, route: list[int], replaced: list[int], exported: bool = True):
        self.log, self.route, self.replaced, self.exported = log, route, replaced, exported
        self.failure: Exception | None = None

    def connect(self):
        self.log.append("transport connect")
        if self.failure is not None:
            raise self.failure
        return self.route, self.replaced

    def close(self):
        self.log.append("close")

    def commit(self):
        self.log.append("commit")

    def abandon(self):
        self.log.append("abandon")


class RecordingGroup:
    """One rank of a two-rank group: collectives answer with this rank's data twice (a peer that
    agrees), or raise when told to."""

    is_in_process = False

    def __init__(self, log: list, rank: int = 0, world_size: int = 2, fail_barrier: bool = False):
        self.log, self.rank, self.world_size, self.fail_barrier = log, rank, world_size, fail_barrier

    def allgather_bytes(self, data: bytes) -> list[bytes]:
        self.log.append("allgather")
        return [data] * self.world_size

    def barrier(self) -> None:
        self.log.append("barrier")
        if self.fail_barrier:
            raise GroupError("barrier #0 timed out after 1.0 s waiting for ranks [1] of 2 (test)")


class CountingGroup:
    """A LocalGroup rank posing as a rank of a multi-process group, counting its collectives."""

    is_in_process = False

    def __init__(self, rank_group):
        self._group, self.rank, self.world_size = rank_group, rank_group.rank, rank_group.world_size
        self.num_collectives = 0

    def allgather_bytes(self, data: bytes) -> list[bytes]:
        self.num_collectives += 1
        return self._group.allgather_bytes(data)

    def barrier(self) -> None:
        self.num_collectives += 1
        self._group.barrier()


class FakeRuntime:
    """cupy.cuda.runtime's current device, for a thread: getDevice / setDevice (logged)."""

    def __init__(self, log: list, current: int = 0):
        self.log, self.current = log, current

    def getDevice(self) -> int:  # noqa: N802 - cupy's names
        return self.current

    def setDevice(self, device: int) -> None:  # noqa: N802
        self.log.append(f"set device {device}")
        self.current = device


@pytest.fixture(autouse=True)
def idle_comm_streams(monkeypatch) -> dict:
    """The process's idle communication streams, emptied for each test (stand-ins go there)."""
    idle: dict = {}
    monkeypatch.setattr(_cuda_backend, "_idle_comm_streams", idle)
    return idle


def stub_backend(group, log: list, transport=None, workspace_fill: int = 0) -> CudaBackend:
    backend = object.__new__(CudaBackend)
    backend.group = group
    backend.device_id = 0
    backend._runtime = FakeRuntime(log)
    backend.sys_scope = True
    backend.workspace = HostWorkspace(layout.header_bytes(), log, "workspace", workspace_fill)
    # Layouts are laid out in this many bytes; only the header, all the tests touch, has memory.
    backend.workspace.num_bytes = 1 << 30
    backend.layout_table = HostWorkspace(_cuda_backend.MAX_LAYOUTS * layout.LAYOUT_SLOT_BYTES, log, "layout table")
    backend._ipc = transport
    backend.transport = "local" if transport is None else "ipc"
    backend._layouts, backend._agreed, backend._pending_layouts = {}, set(), []
    backend._connected, backend._destroyed, backend._route = False, False, []
    backend._finalizer = weakref.finalize(backend, lambda: None)
    backend.comm_stream = f"communication stream of {id(backend):#x}"
    backend._owns_comm_stream = True
    return backend


# ----------------------------------------------------------------------------- connect


def test_reconnect_waits_for_its_kernels_adopts_steps_and_clears_the_replaced_ranks_flags():
    log: list = []
    route = [0x1000, 0x2000, 0x3000]
    backend = stub_backend(RecordingGroup(log, world_size=3), log, RecordingTransport(log, route, []),
                           workspace_fill=0xFF)
    backend.workspace.write(STATE, STEPS.pack(5, 6, 5, 6))
    backend.connect()
    assert log == ["allgather", "transport connect", "allgather", "commit"]  # the first connect waits for nothing
    assert backend.workspace.read(layout.ROUTE_OFFSET, 24) == struct.pack("<3Q", *route)

    log.clear()
    backend._ipc.replaced = [2]
    backend.connect()
    assert log == ["synchronize", "allgather", "transport connect", "allgather", "commit"]
    memory = backend.workspace.memory
    for region in ("dispatch_flag", "combine_flag"):
        for parity in range(layout.NUM_PARITIES):
            for src_rank in range(3):
                offset = layout.HEADER_OFFSETS[region] + (parity * _constants.MAX_RANKS + src_rank) * layout.FLAG_BYTES
                flag = bytes(memory[offset:offset + layout.FLAG_BYTES])
                assert flag == (bytes(8) if src_rank == 2 else b"\xff" * 8), (region, parity, src_rank)


@pytest.mark.parametrize("transport", ["ipc", "local"])
def test_a_failed_update_meets_the_failed_replacements_release(transport, monkeypatch):
    """An update that fails on every rank fails the replacement's construction, whose destroy() runs two
    barriers (closing its mappings between them) before it frees: a survivor left without a barrier, so
    the replacement's met the survivors' retry (breaking the group) or waited out the group's timeout,
    and freed its workspace while survivors still mapped it (helper-113). Now a survivor meets both,
    closing its mappings of the replacements' workspaces between them (ipc)."""
    log: list = []
    recording = RecordingTransport(log, [0x1000, 0x2000], []) if transport == "ipc" else None
    backend = stub_backend(RecordingGroup(log), log, recording)
    backend.connect()
    log.clear()
    failure = TransportError("Buffer (ipc transport, rank 0): could not map the peers' workspaces: ...")
    if recording is not None:
        recording.failure = failure
    else:
        monkeypatch.setattr(_cuda_backend.local_transport, "connect", lambda group, workspace: (_ for _ in ()).throw(
            failure))
    with pytest.raises(TransportError, match="could not map"):
        backend.connect(replaced_ranks=[1])
    assert log == ["synchronize", "allgather", *(["transport connect"] if recording else []), "barrier",
                   *(["abandon"] if recording else []), "barrier"]
    # A replacement whose setup failed released alone before the agreement: nothing to meet.
    log.clear()
    monkeypatch.setattr(_cuda_backend, "_agreement_record", lambda blob, rank: (_ for _ in ()).throw(
        _cuda_backend._PeerSetupFailed("Buffer: rank 1 could not set up its GPU side (...)")))
    with pytest.raises(TransportError, match="could not set up"):
        backend.connect(replaced_ranks=[1])
    assert log == ["synchronize", "allgather"]


def test_a_route_table_that_one_rank_cannot_write_fails_every_rank():
    """The flags' clearing and the route table's write were the connect's only steps not shared: a rank
    failing there alone left its peers connected, and the release after a failed update unmatched
    (helper-117)."""
    out = [None, None]

    def rank_fn(rank_group):
        group = CountingGroup(rank_group)
        log: list = []
        backend = stub_backend(group, log, RecordingTransport(log, [1, 2], []))
        if group.rank == 1:
            def write(offset, data):
                raise RuntimeError("cudaErrorIllegalAddress: an illegal memory access was encountered")
            backend.workspace.write = write
        try:
            backend.connect()
        except TransportError as exc:
            out[group.rank] = exc

    ep.LocalGroup(2, timeout_s=30.0).spawn(rank_fn)
    for error in out:
        assert isinstance(error, TransportError) and str(error) == (
            "Buffer: could not write the route table: on rank 1: RuntimeError: cudaErrorIllegalAddress: an illegal "
            "memory access was encountered"), out


@pytest.mark.parametrize("failure", ["open", "route"])
def test_a_failed_update_leaves_every_route_table_on_open_mappings(failure):
    """Rank 2's process died; its replacement's update fails on every rank: rank 1 cannot open the new
    workspace, or cannot write its route table after every rank mapped it. The replacement frees its
    workspace, so the survivors close their mappings of it first (both failures: the second closed
    none, helper-152), and each survivor's route table still points at the dead process's mapping,
    which stays open (the first closed it before opening the new one, and left the table on it)."""
    from test_ipc_transport import FakeRuntime as IpcRuntime, FakeWorkspace, mapped, process, workspace_ptr

    from mooncake_ep.transport.ipc import IpcTransport

    runtimes = [IpcRuntime() for _ in range(3)]
    out = {}

    def rank_fn(rank_group):
        group = CountingGroup(rank_group)
        runtime = runtimes[group.rank]
        backend = stub_backend(group, [], IpcTransport(group, FakeWorkspace(workspace_ptr(group.rank)),
                                                       runtime=runtime, process=process(group.rank)))
        backend.connect()
        rank_group.barrier()
        if group.rank == 2:  # the replacement builds its Buffer (CudaBackend.__init__'s path on a failure)
            log: list = []
            replacement = stub_backend(group, log, IpcTransport(group, FakeWorkspace(workspace_ptr(2, 1)),
                                                                runtime=IpcRuntime(), process=process(2, pid=2002)))
            with pytest.raises(TransportError):
                replacement.connect()
            replacement.destroy(raise_group_error=False)
            out[2] = log
            return
        if group.rank == 1:
            if failure == "open":
                runtime.fail_open = True
            else:
                write = backend.workspace.write
                backend.workspace.write = lambda offset, data: (_ for _ in ()).throw(
                    RuntimeError("cudaErrorLaunchFailure: unspecified launch failure"))
        with pytest.raises(TransportError):
            backend.connect(replaced_ranks=[2])
        if failure == "route" and group.rank == 1:
            backend.workspace.write = write
        route = struct.unpack("<3Q", backend.workspace.read(layout.ROUTE_OFFSET, 24))
        out[group.rank] = route, set(runtime.open_mappings)

    ep.LocalGroup(3, timeout_s=30.0).spawn(rank_fn)
    assert out[2] == ["synchronize", "free workspace", "free layout table"]  # after its destroy's two barriers
    for rank in (0, 1):
        route, open_mappings = out[rank]
        assert route[2] == mapped(2), (rank, hex(route[2]))
        assert open_mappings == {mapped(1 - rank), mapped(2)}, (rank, sorted(map(hex, open_mappings)))


def test_a_survivor_whose_device_wait_fails_fails_the_update_on_every_rank_at_once():
    """The wait before a reconnect's counters ran outside any collective: the survivor raised alone and
    the others waited in the agreement for the group's whole timeout, naming no cause (helper-152). Now
    it tells them there, and every rank raises its reason; nobody meets a release (nothing was mapped)."""
    out = {}

    def rank_fn(rank_group):
        group = CountingGroup(rank_group)
        log: list = []
        backend = stub_backend(group, log, RecordingTransport(log, [1, 2, 3], []))
        backend.connect()
        if group.rank == 1:
            def faulted():
                raise RuntimeError("cudaErrorIllegalAddress: an illegal memory access was encountered")
            backend.workspace.synchronize = faulted
        log.clear()
        before = group.num_collectives
        try:
            backend.connect(replaced_ranks=[2])
        except TransportError as exc:
            out[group.rank] = str(exc), log, group.num_collectives - before

    ep.LocalGroup(3, timeout_s=60.0).spawn(rank_fn)
    for rank in range(3):
        message, log, num_collectives = out[rank]
        assert message == ("Buffer: rank 1 could not set up its GPU side (RuntimeError: cudaErrorIllegalAddress: an "
                           "illegal memory access was encountered); a new Buffer releases its own, and a Buffer in "
                           "update_ep_member keeps its route table"), message
        assert log == ([] if rank == 1 else ["synchronize"]) and num_collectives == 1, (rank, log, num_collectives)


def test_a_rank_that_cannot_read_its_step_counters_fails_the_construction_on_every_rank():
    out = {}

    def rank_fn(rank_group):
        group = CountingGroup(rank_group)
        backend = stub_backend(group, [], RecordingTransport([], [1, 2], []))
        if group.rank == 0:
            backend.workspace.peek = lambda offset, num_bytes: (_ for _ in ()).throw(
                RuntimeError("cudaErrorECCUncorrectable: uncorrectable ECC error encountered"))
        with pytest.raises(_cuda_backend._PeerSetupFailed, match="rank 0 could not set up its GPU side "
                                                                 r"\(RuntimeError: cudaErrorECCUncorrectable"):
            backend.connect()
        out[group.rank] = group.num_collectives

    ep.LocalGroup(2, timeout_s=60.0).spawn(rank_fn)
    assert out == {0: 1, 1: 1}  # the agreement only: each then releases alone


def test_a_replacement_jumps_to_the_survivors_steps_and_agreed_configurations():
    """Rank 1 is fresh (steps 0, nothing agreed); rank 0 has run. Both end with rank 0's state."""
    logs = [[], []]
    survivor_steps = (9, 8, 9, 8)
    backends = {}

    def rank_fn(rank_group):
        group = CountingGroup(rank_group)
        backend = stub_backend(group, logs[group.rank], RecordingTransport(logs[group.rank], [1, 2], []))
        if group.rank == 0:
            backend.workspace.write(STATE, STEPS.pack(*survivor_steps))
            backend._agreed = {(4, 128, 8, True, False, False), (8, 256, 8, False, False, False)}
        backend.connect()
        backends[group.rank] = backend
        # An agreed configuration makes no collective; a new one does, on both ranks: other flags too.
        before = group.num_collectives
        backend.agree_on((4, 128, 8, True, False, False))
        backend.layout_for(4, 128, 8)
        assert group.num_collectives == before
        backend.agree_on((4, 128, 8, False, False, False))
        assert group.num_collectives == before + 1

    ep.LocalGroup(2, timeout_s=30.0).spawn(rank_fn)
    for backend in backends.values():
        assert STEPS.unpack(backend.workspace.read(STATE, STEPS.size)) == survivor_steps
        assert backend._agreed == {(4, 128, 8, True, False, False), (8, 256, 8, False, False, False),
                                   (4, 128, 8, False, False, False)}


def test_ranks_with_different_kernels_are_refused_on_every_rank(monkeypatch):
    digests = {"mooncake_ep-rank0": "a" * 64, "mooncake_ep-rank1": "b" * 64, "mooncake_ep-rank2": "a" * 64}
    monkeypatch.setattr(_cuda_backend, "protocol_digest", lambda sys_scope: digests[threading.current_thread().name])
    out = [None] * 3

    def rank_fn(group):
        backend = stub_backend(group, [], RecordingTransport([], [1, 2, 3], []))
        try:
            backend.connect()
        except ValueError as exc:
            out[group.rank] = str(exc)

    ep.LocalGroup(3, timeout_s=30.0).spawn(rank_fn)
    for message in out:
        assert message is not None and message.startswith(
            "Buffer: ranks run different kernels (protocol digest ranks [0, 2]: 'aaaaaaaaaaaa', rank 1: "
            "'bbbbbbbbbbbb'; NVRTC ranks [0, 1, 2]: "), out
        assert message.endswith("install the same mooncake_ep, with the same kernels_cu sources, on every rank")


def test_protocol_digest_ignores_the_gpu_but_not_the_scope():
    assert _cuda_backend.protocol_digest(True) == _cuda_backend.protocol_digest(True)
    assert _cuda_backend.protocol_digest(True) != _cuda_backend.protocol_digest(False)


def test_protocol_digest_covers_the_sources_as_this_process_compiles_them(monkeypatch):
    """The sources come from kernels.kernel_sources (each read once, as compiled): a file edited on
    disk after a process started would otherwise change what it reports, not what it runs."""
    before = _cuda_backend.protocol_digest(True)
    sources = kernels.kernel_sources()
    assert {"ll_dispatch.cu", "ll_combine.cu"} <= set(sources), sorted(sources)
    name = sorted(sources)[0]
    monkeypatch.setattr(kernels, "kernel_sources", lambda: sources | {name: sources[name] + "\n// edited\n"})
    assert _cuda_backend.protocol_digest(True) != before


def test_protocol_digest_covers_where_the_layout_puts_each_region(monkeypatch):
    """Peers write into each other's regions at offsets layout.py computes: two checkouts that place
    them differently must not connect, even with the same kernels."""
    before = _cuda_backend.protocol_digest(True)
    compute = layout.compute_layout

    def moved(*args, **kwargs):
        computed = compute(*args, **kwargs)
        offsets = dict(computed.offsets, combine_x=tuple(offset + 256 for offset in computed.offsets["combine_x"]))
        return dataclasses.replace(computed, offsets=offsets)

    monkeypatch.setattr(layout, "compute_layout", moved)
    assert _cuda_backend.protocol_digest(True) != before


# ----------------------------------------------------------------------------- per-configuration check


def test_first_use_of_a_configuration_is_checked_across_ranks_and_a_mismatch_is_not_kept():
    """Rank 1 first dispatches another hidden, then fp8 where rank 0 dispatches bf16 (a receiver would
    read the staged rows in its own form): both refused on both ranks, then the agreed one passes."""
    bf16, fp8 = (False, False, False), (True, False, False)
    configurations = {0: [(4, 128, 8, *bf16)] * 2, 1: [(4, 256, 8, *bf16), (4, 128, 8, *fp8)]}
    out = {}

    def rank_fn(group):
        backend = stub_backend(group, [], RecordingTransport([], [1, 2], []))
        errors = []
        for configuration in configurations[group.rank]:
            with pytest.raises(ep.RankMismatchError) as error:
                backend.agree_on(configuration)
            errors.append(str(error.value))
        assert backend._agreed == set()  # the rejected calls left nothing
        backend.agree_on((4, 128, 8, *bf16))  # the buffer is still usable
        found, address = backend.layout_for(4, 128, 8)
        out[group.rank] = (errors, found.hidden, address, backend._agreed)

    ep.LocalGroup(2, timeout_s=30.0).spawn(rank_fn)
    fix = ("every rank must dispatch the same T, hidden, num_experts and fp8 flags, or the kernels would read peers' "
           "workspaces at the wrong offsets, or their staged rows in the wrong form")
    assert out[0] == out[1] == ([f"dispatch: ranks disagree on hidden (rank 0: 128, rank 1: 256); {fix}",
                                 f"dispatch: ranks disagree on use_fp8 (rank 0: False, rank 1: True); {fix}"],
                                128, 0x5000_0000, {(4, 128, 8, *bf16)}), out


def test_in_process_ranks_make_no_collective_for_a_configuration():
    class NoCollectives(RecordingGroup):
        is_in_process = True

        def allgather_bytes(self, data):
            raise AssertionError("in-process ranks skip the configuration check")

    backend = stub_backend(NoCollectives([]), [])
    workspace_layout, address = backend.layout_for(4, 128, 8)
    assert workspace_layout.num_bytes == layout.compute_layout(2, 8, 4, 128).num_bytes
    backend.upload_layouts(None)
    assert backend.layout_table.read(0, layout.LAYOUT_SLOT_BYTES)[:len(workspace_layout.pack())] == \
        workspace_layout.pack()


# Arguments of a bf16 dispatch_launch, pointers made up: the stubs never dereference them.
DISPATCH_ARGUMENTS = dict(x_ptr=1, num_tokens=1, topk_ptr=2, topk_is_int64=True, num_topk=1, active_ptr=3,
                          recv_x_ptr=4, recv_scales_ptr=0, scale_row_stride=0, scale_column_stride=0, recv_count_ptr=5,
                          timeout_ns=-1, use_fp8=False, round_scale=False, use_ue8m0=False)


def test_a_new_configuration_is_written_by_the_next_launch_on_its_stream(monkeypatch):
    """Never by a synchronous copy inside the call: that can wait behind in-process peers' kernels
    that wait for this rank (seen on the H200: six of eight ranks stuck in the copy until timeout)."""
    import cupy

    log: list = []
    backend = stub_backend(RecordingGroup(log), log)
    backend.num_sms = 4
    backend.launchers = {kernels.dispatch_launcher_name(False, False, False):
                         lambda num_blocks, args, stream: log.append(f"launch on {stream:#x}")}
    capturing = [True, False]
    monkeypatch.setattr(cupy.cuda.runtime, "streamIsCapturing", lambda stream: capturing.pop(0))
    workspace_layout, layout_ptr = backend.layout_for(4, 128, 8)
    assert log == [] and backend.layout_table.read(0, 8) == bytes(8), "nothing is copied inside layout_for"
    backend.dispatch_launch(0, layout_ptr, **DISPATCH_ARGUMENTS)(3, 0xA0)  # inside a capture: stays pending
    backend.dispatch_launch(0, layout_ptr, **DISPATCH_ARGUMENTS)(3, 0xB0)
    backend.dispatch_launch(0, layout_ptr, **DISPATCH_ARGUMENTS)(3, 0xB0)
    assert log == ["write layout table on stream 0xa0", "launch on 0xa0", "write layout table on stream 0xb0",
                   "launch on 0xb0", "launch on 0xb0"]
    assert backend.layout_table.read(0, len(workspace_layout.pack())) == workspace_layout.pack()


def test_a_launch_runs_on_the_ranks_device_and_gives_the_caller_its_own_back():
    """A thread holding another device (an engine's, a callback's) launches in the rank's context."""
    log: list = []
    backend = stub_backend(RecordingGroup(log), log)
    backend.device_id, backend.num_sms = 1, 4
    runtime = backend._runtime
    backend.launchers = {kernels.dispatch_launcher_name(False, False, False):
                         lambda num_blocks, args, stream: log.append(f"dispatch on device {runtime.current}"),
                         "combine": lambda num_blocks, args, stream: log.append(f"combine on device {runtime.current}")}
    backend.direct_peer_reads = True
    combine = dict(expert_out_ptr=1, zero_copy=False, num_tokens=1, topk_ptr=2, topk_is_int64=True, num_topk=1,
                   weights_ptr=3, active_ptr=4, combined_ptr=5, renormalize=False, timeout_ns=-1)
    runtime.current = 0
    backend.dispatch_launch(0, 0, **DISPATCH_ARGUMENTS)(3, 0xA0)
    backend.combine_launch(0, 0, **combine)(3, 0xA0)
    assert log == ["set device 1", "dispatch on device 1", "set device 0",
                   "set device 1", "combine on device 1", "set device 0"]
    assert runtime.current == 0
    log.clear()
    runtime.current = 1  # already the rank's device: no switch
    backend.dispatch_launch(0, 0, **DISPATCH_ARGUMENTS)(3, 0xA0)
    assert log == ["dispatch on device 1"]

    class FailingLauncher:
        name = "ll_combine"

        def __call__(self, num_blocks, args, stream):
            raise RuntimeError("CUDA_ERROR_INVALID_VALUE: invalid argument")
    backend.launchers["combine"] = FailingLauncher()
    runtime.current = 0
    with pytest.raises(RuntimeError) as failure:
        backend.combine_launch(0, 0, **combine)(2, 0xA0)
    # The driver's words alone named neither the kernel nor the rank.
    assert str(failure.value) == ("Buffer rank 0: launching ll_combine (receive half, 4 blocks) on stream 0xa0 of "
                                  "cuda:1 failed: RuntimeError: CUDA_ERROR_INVALID_VALUE: invalid argument")
    assert runtime.current == 0, "a failed launch gives the caller its device back too"


def test_a_replacement_in_the_same_process_also_adopts_the_survivors_steps():
    """The local transport too: a fresh Buffer of an in-process rank that stopped starts at step 0."""
    survivor_steps = (7, 3, 6, 2)
    results = {}

    def rank_fn(rank_group):
        backend = stub_backend(rank_group, [])
        if rank_group.rank == 0:
            backend.workspace.write(STATE, STEPS.pack(*survivor_steps))
        backend.connect()
        results[rank_group.rank] = STEPS.unpack(backend.workspace.read(STATE, STEPS.size))

    ep.LocalGroup(2, timeout_s=30.0).spawn(rank_fn)
    assert results == {0: survivor_steps, 1: survivor_steps}


def test_an_in_process_reconnect_waits_for_its_kernels_and_clears_the_replaced_ranks_flags():
    """As with ipc: a survivor's queued kernels may still move its step counters and flags, and the
    flags an in-process rank's old Buffer left could pass for ones of a step its replacement has not
    reached. Rank 1 is the replacement (update_ep_member names it); rank 2 survived."""
    logs = {0: [], 1: [], 2: []}
    backends = {}

    def rank_fn(rank_group):
        log = logs[rank_group.rank]
        backend = stub_backend(rank_group, log, workspace_fill=0xFF if rank_group.rank != 1 else 0)
        backend._connected = rank_group.rank != 1
        backends[rank_group.rank] = backend
        backend.connect([1])

    ep.LocalGroup(3, timeout_s=30.0).spawn(rank_fn)
    assert logs == {0: ["synchronize"], 1: [], 2: ["synchronize"]}  # a new Buffer has no kernels to wait for
    for rank in (0, 2):
        memory = backends[rank].workspace.memory
        for region in ("dispatch_flag", "combine_flag"):
            for parity in range(layout.NUM_PARITIES):
                for src_rank in range(3):
                    offset = (layout.HEADER_OFFSETS[region] +
                              (parity * _constants.MAX_RANKS + src_rank) * layout.FLAG_BYTES)
                    flag = bytes(memory[offset:offset + layout.FLAG_BYTES])
                    assert flag == (bytes(8) if src_rank == 1 else b"\xff" * 8), (rank, region, parity, src_rank)


# ----------------------------------------------------------------------------- teardown


def test_destroy_waits_barriers_closes_barriers_then_frees_and_is_idempotent():
    log: list = []
    backend = stub_backend(RecordingGroup(log), log, RecordingTransport(log, [1, 2], []))
    backend.destroy()
    backend.destroy()
    assert log == ["synchronize", "barrier", "close", "barrier", "close", "free workspace", "free layout table"]


def test_destroy_hands_the_communication_stream_to_the_next_buffer_of_its_device(idle_comm_streams):
    """torch may record events on it after the Buffer is gone (async results freed later): the
    stream lives on, idle, and the next Buffer of the device takes it instead of making one."""
    log: list = []
    backend = stub_backend(RecordingGroup(log), log)
    backend.destroy()
    backend.destroy()  # idempotent: handed back once
    assert {d: list(q) for d, q in idle_comm_streams.items()} == {0: [backend.comm_stream]}
    assert _cuda_backend._take_comm_stream(0) == backend.comm_stream
    assert {d: list(q) for d, q in idle_comm_streams.items()} == {0: []}


def test_a_collected_buffer_hands_its_stream_back_even_inside_the_pool(monkeypatch):
    """The finalizer of a Buffer collected without destroy() returns its stream, and collection runs
    on whichever thread allocates next: one inside _take_comm_stream here. With a lock around the
    pool that thread waited on itself (Python >= 3.12 runs collections between any two calls)."""
    returned = []

    class CollectedMeanwhile(dict):
        def setdefault(self, key, default):
            if not returned:  # the collection, at this point of _take_comm_stream
                returned.append(key)
                _cuda_backend._return_comm_stream(key, "stream of a collected Buffer")
            return super().setdefault(key, default)

    monkeypatch.setattr(_cuda_backend, "_idle_comm_streams", CollectedMeanwhile())
    taken = []
    thread = threading.Thread(target=lambda: taken.append(_cuda_backend._take_comm_stream(0)), daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), "the pool waited on itself"
    assert taken == ["stream of a collected Buffer"]


def test_destroy_with_the_local_transport_frees_between_two_barriers():
    log: list = []
    backend = stub_backend(RecordingGroup(log), log)
    backend.destroy()
    # And one after the frees: an in-process peer that returned and launched again would hold up
    # the device-wide synchronisation of a rank still freeing, and wait for it.
    assert log == ["synchronize", "barrier", "free workspace", "free layout table", "barrier"]


def test_destroy_with_a_missing_peer_still_releases_then_raises(caplog):
    log: list = []
    backend = stub_backend(RecordingGroup(log, fail_barrier=True), log, RecordingTransport(log, [1, 2], []))
    with caplog.at_level(logging.WARNING, logger="mooncake_ep"):
        with pytest.raises(GroupError, match=r"waiting for ranks \[1\] of 2"):
            backend.destroy()
    # The broken group makes no second barrier; the mappings and memory are released anyway.
    assert log == ["synchronize", "barrier", "close", "close", "free workspace", "free layout table"]
    assert "Buffer.destroy on rank 0" in caplog.text and "releasing without waiting" in caplog.text
    log.clear()
    backend = stub_backend(RecordingGroup(log, fail_barrier=True), log, RecordingTransport(log, [1, 2], []))
    backend.destroy(raise_group_error=False)  # what a failed construction does
    assert log[-2:] == ["free workspace", "free layout table"]


def test_destroy_whose_free_fails_still_frees_the_rest_and_keeps_the_stream(idle_comm_streams):
    """A faulted kernel makes the first free's device wait raise: the layout table is still freed
    (its own wait raises too, on a real device), the error comes out, and the stream, which may hold
    the faulted work, goes to no later Buffer."""
    log: list = []
    backend = stub_backend(RecordingGroup(log), log, RecordingTransport(log, [1, 2], []))

    def faulted_free():
        log.append("free workspace")
        raise RuntimeError("cudaErrorIllegalAddress: an illegal memory access was encountered")
    backend.workspace.free = faulted_free
    with pytest.raises(RuntimeError, match="illegal memory access"):
        backend.destroy()
    assert log == ["synchronize", "barrier", "close", "barrier", "close", "free workspace", "free layout table"]
    assert idle_comm_streams == {}


def test_a_workspace_whose_device_wait_fails_keeps_its_memory_with_its_finalizer(monkeypatch):
    """The finalizer was detached before the wait: a failed wait lost the memory for good."""
    import cupy

    from mooncake_ep.transport import DeviceWorkspace

    freed = []
    waits = [RuntimeError("cudaErrorLaunchTimeout"), None]

    def device_synchronize():
        failure = waits.pop(0)
        if failure is not None:
            raise failure
    monkeypatch.setattr(cupy.cuda, "Device", lambda device_id: contextlib.nullcontext())
    monkeypatch.setattr(cupy.cuda.runtime, "deviceSynchronize", device_synchronize)
    monkeypatch.setattr(cupy.cuda.runtime, "free", freed.append)
    workspace = object.__new__(DeviceWorkspace)
    workspace.ptr, workspace.device_id = 0x5000, 0
    workspace._finalizer = weakref.finalize(workspace, freed.append, "by the finalizer")
    with pytest.raises(RuntimeError, match="cudaErrorLaunchTimeout"):
        workspace.free()
    assert workspace.ptr == 0x5000 and workspace._finalizer.alive and freed == []
    workspace.free()  # a later free tries again
    workspace.free()
    assert workspace.ptr == 0 and not workspace._finalizer.alive and freed == [0x5000]


def test_garbage_collection_waits_for_its_kernels_then_closes_the_peers_mappings_before_freeing(
        caplog, idle_comm_streams):
    """A Buffer dropped right after an eager call is collected while its kernel may still store through
    the peers' mappings: the close came first, and the only wait was inside the free (helper-152)."""
    log: list = []
    transport = RecordingTransport(log, [1, 2], [])
    with caplog.at_level(logging.WARNING, logger="mooncake_ep"):
        _cuda_backend._release_unreachable(3, transport, HostWorkspace(8, log, "workspace"),
                                           HostWorkspace(8, log, "layout table"), False, "stream 3")
    assert log == ["synchronize", "close", "free workspace", "free layout table"]
    assert "the Buffer of rank 3 was garbage-collected without destroy()" in caplog.text
    # Its communication stream goes to the next Buffer of the device, as destroy() hands it on.
    assert {d: list(q) for d, q in idle_comm_streams.items()} == {0: ["stream 3"]}


def test_garbage_collection_whose_free_fails_still_frees_the_rest_and_keeps_the_stream(caplog, idle_comm_streams):
    """As destroy(): a faulted kernel fails the first free's device wait; the layout table is still
    freed, the failure is logged (a finalizer may not raise), and the stream goes to no later Buffer."""
    log: list = []
    workspace = HostWorkspace(8, log, "workspace")

    def faulted_free():
        log.append("free workspace")
        raise RuntimeError("cudaErrorIllegalAddress: an illegal memory access was encountered")
    workspace.free = faulted_free
    with caplog.at_level(logging.WARNING, logger="mooncake_ep"):
        _cuda_backend._release_unreachable(3, RecordingTransport(log, [1, 2], []), workspace,
                                           HostWorkspace(8, log, "layout table"), False, "stream 3")
    assert log == ["synchronize", "close", "free workspace", "free layout table"]
    assert "releasing the Buffer of rank 3 failed: cudaErrorIllegalAddress" in caplog.text
    assert idle_comm_streams == {}


def test_garbage_collection_frees_nothing_while_ranks_of_this_process_may_run(caplog):
    """Freeing synchronises the device: in one process it could stall peers' kernels waiting for us."""
    log: list = []
    with caplog.at_level(logging.WARNING, logger="mooncake_ep"):
        _cuda_backend._release_unreachable(1, None, HostWorkspace(8, log, "workspace"),
                                           HostWorkspace(8, log, "layout table"), True)
    assert log == ["abandon workspace", "abandon layout table"]  # nor may their own finalizers free them
    assert "stays allocated until the process ends" in caplog.text


def test_combine_reads_in_place_only_where_asked_and_possible():
    """Direct reads make a receive half wait for every reader: the JAX split form, whose receive
    halves queue on one stream, asks for the copy (it hung on the H200 before it did)."""
    backend = stub_backend(RecordingGroup([]), [])
    backend.direct_peer_reads = True
    assert backend._combine_source(zero_copy=False, direct_reads=True) == _cuda_backend.SOURCE_DIRECT
    assert backend._combine_source(zero_copy=False, direct_reads=False) == _cuda_backend.SOURCE_COPY
    assert backend._combine_source(zero_copy=True, direct_reads=True) == _cuda_backend.SOURCE_WORKSPACE
    backend.direct_peer_reads = False  # ipc: peers cannot read the caller's memory
    assert backend._combine_source(zero_copy=False, direct_reads=True) == _cuda_backend.SOURCE_COPY


def test_a_peer_in_another_collective_is_named_at_the_kernel_agreement():
    """A peer whose blob is no agreement record (it is in a dispatch's exchange, say) is named, where a
    bare KeyError('digest') or a JSON error came out before."""
    record = {"digest": "d", "nvrtc": [12, 9], "steps": [0] * 14, "agreed": []}
    assert _cuda_backend._agreement_record(json.dumps(record).encode(), 1) == record
    for blob in (b'{"call": "dispatch"}', b"\x80\x04 pickled", b"[1, 2]"):
        with pytest.raises(ep.RankMismatchError, match=r"rank 2 is not connecting a Buffer's workspace"):
            _cuda_backend._agreement_record(blob, 2)


def test_a_rank_whose_setup_failed_says_so_at_the_agreement_and_the_others_release_alone():
    """A rank whose kernels or workspace could not be set up (out of memory, a compile error) takes part
    in connect's first collective with its reason: the others raise at once, naming it, and release
    their own memory without the collective release it would never join (they waited for it the
    group's whole timeout, and named no cause)."""
    announced = []

    class FailedRank:  # rank 1, announcing
        rank, world_size = 1, 2

        def allgather_bytes(self, data):
            announced.append(data)
            return [b"{}", data]
    _cuda_backend._announce_setup_failure(FailedRank(), MemoryError("out of memory allocating 123 bytes"))
    assert [json.loads(blob) for blob in announced] == [{"failed": "MemoryError: out of memory allocating 123 bytes"}]

    log: list = []

    class Rank0:  # connecting, and hearing rank 1's announcement
        rank, world_size = 0, 2

        def allgather_bytes(self, data):
            log.append("allgather")
            return [data, announced[0]]

        def barrier(self):  # pragma: no cover - the release must not wait for the failed rank
            raise AssertionError("no collective after a peer's setup failed")
    backend = stub_backend(Rank0(), log)
    with pytest.raises(ep.transport.TransportError, match=r"rank 1 could not set up its GPU side \(MemoryError: out "
                                                            r"of memory allocating 123 bytes\)"):
        backend.connect()
    backend._release_alone()
    assert log == ["allgather", "free workspace", "free layout table"]
