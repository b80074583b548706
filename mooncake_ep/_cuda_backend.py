"""The GPU backend of :class:`mooncake_ep.Buffer`: workspace, route table, kernels and launches.

Built once per buffer (collectively): allocates the symmetric workspace, connects it through the
transport, compiles or loads every kernel. A call only packs arguments and launches; the arguments
were validated by ``buffer.py`` before they get here.

Transport: in-process ranks (:class:`mooncake_ep.LocalGroup`) and a group of one use ``local``
(plain pointers); any other group ``ipc`` (CUDA IPC between the processes of one host). With
``ipc`` the ranks also check at connect time that they run the same kernels, and agree on the
step counters, so that a replacement process joins the survivors' epoch.
"""

from __future__ import annotations

import collections
import hashlib
import json
import logging
import struct
import weakref
from collections.abc import Callable, Sequence

import numpy as np

from mooncake_ep import _constants, _handshake, kernels, layout
from mooncake_ep.group import GroupError
from mooncake_ep.transport import DeviceWorkspace, TransportError
from mooncake_ep.transport.workspace import failure_text, raise_if_any_failed
from mooncake_ep.transport import ipc as ipc_transport
from mooncake_ep.transport import local as local_transport

logger = logging.getLogger("mooncake_ep")

PHASE_SEND = 1
PHASE_RECV = 2
# Where combine's token owners read an expert rank's outputs (kSource* in ll_combine.cu).
SOURCE_WORKSPACE = 0  # zero copy: already in the workspace's combine_x
SOURCE_COPY = 1  # the send half copies them into combine_x
SOURCE_DIRECT = 2  # peers read the caller's array where it is (every rank in this process)
# Device copies of configurations: one per distinct (T, H, E) a buffer has seen.
MAX_LAYOUTS = 64
# The kernels' protocol digest is taken for this architecture, whatever the GPU: ranks on
# different GPU generations run different cubins of the same protocol, and may work together.
_DIGEST_ARCH = "sm_90"
# The fields of ep::State (kernels_cu/layout.cuh) a Buffer agrees on with its peers: the step counters,
# one u32 per parity each. The fields after them are reset by every call, or, like dispatch's staging
# count and its target, consistent with each other in any workspace, a fresh one included.
_STEP_FIELDS = ("dispatch_step", "combine_step")

# Communication streams (async_finish), per device: made once, handed from a destroyed Buffer to the
# next, never destroyed. torch's allocator records an event on every stream a tensor was recorded on
# (Buffer._finish does, for async calls) when that tensor is freed, which may be after its Buffer is
# gone: a destroyed stream there crashes the process. Reuse keeps the streams made few. (In-process
# ranks use their LocalGroup's instead: see LocalGroup._make_streams for why.)
# No lock: the finalizer of a collected Buffer hands its stream back (_release_unreachable), and
# collection runs on whichever thread allocates next, possibly one inside these functions, which
# would wait on itself for a lock it holds. A deque's append and pop are atomic, as is setdefault.
_idle_comm_streams: dict[int, collections.deque] = {}
_all_comm_streams: list = []  # every one made: a Buffer collected without destroy() must not free its own


def _take_comm_stream(device_id: int):
    """An idle communication stream of ``device_id``, or a new non-blocking one."""
    import cupy

    try:
        return _idle_comm_streams.setdefault(device_id, collections.deque()).pop()
    except IndexError:  # none idle
        pass
    with cupy.cuda.Device(device_id):
        stream = cupy.cuda.Stream(non_blocking=True)
    _all_comm_streams.append(stream)
    return stream


def _return_comm_stream(device_id: int, stream) -> None:
    """Give a stream with no work left on it to the next Buffer of ``device_id``."""
    _idle_comm_streams.setdefault(device_id, collections.deque()).append(stream)


def device_sm_count(device_id: int) -> int:
    import cupy

    return int(cupy.cuda.runtime.getDeviceProperties(device_id)["multiProcessorCount"])


def device_arch(device_id: int) -> str:
    import cupy

    return f"sm_{cupy.cuda.Device(device_id).compute_capability}"


def device_identity(device_id: int) -> tuple[str, str]:
    """``(key, name)`` of a GPU: the key is the same in every process of a host, whatever
    ``CUDA_VISIBLE_DEVICES`` makes of ordinals (host boot id and PCI bus id); the name is for messages."""
    import cupy

    bus_id = str(cupy.cuda.runtime.deviceGetPCIBusId(device_id)).lower()
    process = ipc_transport.this_process()
    return f"{process.host_id}/{bus_id}", f"cuda:{device_id} (GPU {bus_id}) on {process.hostname}"


def protocol_digest(sys_scope: bool) -> str:
    """A hash of what must be equal for two ranks' kernels to understand each other.

    It covers the kernel sources and headers, every kernel's macros and options, the workspace
    layout as Python computes it, and the package version; not the architecture nor the NVRTC
    version, which change the machine code but not the protocol.
    """
    from mooncake_ep import __version__

    digest = hashlib.sha256(__version__.encode() + b"\0")
    for key in kernels.low_latency_keys(_DIGEST_ARCH, sys_scope):
        digest.update(repr((key.file, key.name, key.macros, key.options)).encode() + b"\0")
    for name, source in kernels.kernel_sources().items():
        digest.update(name.encode() + b"\0" + source.encode() + b"\0")
    digest.update(repr((layout.LAYOUT_DTYPE.descr, sorted(layout.HEADER_OFFSETS.items()))).encode())
    # Where the regions of a configuration lie (peers write into them): two shapes stand for the rule.
    for configuration in ((8, 256, 128, 7168), (3, 24, 5, 1152)):
        digest.update(layout.compute_layout(*configuration).pack() + b"\0")
    return digest.hexdigest()


class CudaBackend:
    """Device state of one rank.

    Args:
        group: the group (``is_in_process`` ranks use the ``local`` transport, others ``ipc``).
        num_ep_buffer_bytes: workspace size.
        device_id: CUDA device of this rank.
        num_sms: blocks of each launch (one per SM).
        cache: kernel cache.
        all_on_one_device: every rank of the group runs on device_id.

    Raises:
        TransportError: the workspace cannot be allocated, or the peers cannot be reached.
        ValueError: the ranks run different kernels (raised on every rank).
    """

    def __init__(self, group, num_ep_buffer_bytes: int, device_id: int, num_sms: int,
                 cache: kernels.KernelCache | None = None, all_on_one_device: bool = False):
        import cupy

        in_process = getattr(group, "is_in_process", False)
        self.group = group
        self.device_id = device_id
        self.num_sms = num_sms
        self.transport = "local" if in_process or group.world_size == 1 else "ipc"
        # With local on one GPU, every peer can dereference the caller's memory: combine reads the
        # expert outputs where they are instead of copying them into the workspace. Across GPUs
        # peer access covers cudaMalloc memory only, not a stream-ordered pool's (torch's and
        # cupy's cudaMallocAsync allocators; that needs cudaMemPoolSetAccess by its owner): copy.
        self.direct_peer_reads = self.transport == "local" and all_on_one_device
        # In one process on one GPU, GPU-scope ordering is enough (kernels_cu/ptx.cuh); ranks in
        # other processes, even on this GPU, need system scope.
        self.sys_scope = not (all_on_one_device and in_process)
        self._runtime = cupy.cuda.runtime
        try:
            arch = device_arch(device_id)
            if int(arch[3:]) < kernels.MIN_ARCH:
                raise RuntimeError(f"Buffer: cuda:{device_id} is {arch}; the kernels need sm_{kernels.MIN_ARCH} or "
                                   f"newer (Turing on)")
            with cupy.cuda.Device(device_id):  # the modules load into this device's context
                self.launchers = kernels.load_low_latency_kernels(arch, cache, self.sys_scope)
            self.workspace = DeviceWorkspace(num_ep_buffer_bytes, device_id)
            self.layout_table = DeviceWorkspace(MAX_LAYOUTS * layout.LAYOUT_SLOT_BYTES, device_id, host_mirror=True)
        except Exception as exc:
            # The peers go on to connect's first collective: tell them there why this rank will not
            # come, or they would wait for it the group's whole timeout and name no cause.
            _announce_setup_failure(group, exc)
            raise
        self._ipc = ipc_transport.IpcTransport(group, self.workspace) if self.transport == "ipc" else None
        self._layouts: dict[tuple[int, int, int], tuple[layout.WorkspaceLayout, int]] = {}
        self._pending_layouts: list[tuple[int, bytes]] = []  # (offset in layout_table, packed layout)
        # Configurations (T, hidden, num_experts, fp8 flags) every member has agreed on (ipc, agree_on).
        # A replacement adopts the survivors' at connect, so no rank checks one that the others skip.
        self._agreed: set[tuple] = set()
        self._connected = False
        self._route: list[int] = []  # the route table of the last connect that succeeded
        self._destroyed = False
        # Garbage collection cannot wait for the peers; it releases in the order that is safe for
        # this process (mappings of the peers first, then its own memory) and says so. Ranks in
        # this process keep the memory instead (see _release_unreachable).
        # In-process ranks use the one their group made beside their own stream (LocalGroup._make_streams).
        group_stream = getattr(group, "comm_stream", None)
        self._owns_comm_stream = group_stream is None
        self.comm_stream = _take_comm_stream(device_id) if group_stream is None else group_stream
        self._finalizer = weakref.finalize(self, _release_unreachable, group.rank, self._ipc, self.workspace,
                                           self.layout_table, in_process and group.world_size > 1,
                                           self.comm_stream if self._owns_comm_stream else None)
        self._finalizer.atexit = False
        try:
            self.connect()
        except _PeerSetupFailed:
            # Nothing is exchanged yet (the agreement comes first), and the failed peer takes no part
            # in a collective release: release alone.
            self._release_alone()
            raise
        except BaseException:
            # Every rank fails here alike (the checks and the transport agree first), so the
            # collective release can run; if a peer is gone it gives up and frees anyway.
            self.destroy(raise_group_error=False)
            raise

    def connect(self, replaced_ranks: Sequence[int] = ()) -> list[int]:
        """Exchange workspace addresses and write the route table (collective).

        Every call brings a replacement's step counters to the survivors'. Called again
        (``update_ep_member``), it first waits for this rank's kernels (the step counters it reads
        and the flags it clears must be final), and clears the flags the replaced ranks' old
        Buffers left in this workspace, or a stale flag could pass for one of a step the
        replacement has not reached. With ``ipc`` it also maps the workspaces that changed.

        Args:
            replaced_ranks: the ranks building a new Buffer while this one reconnects (local: ranks
                of one process share no workspace identity to compare; ipc finds them itself, as
                the ranks whose workspace changed).

        Returns:
            The ranks whose workspace was replaced (empty on the first call).
        """
        if self._connected:
            try:
                return self._connect(replaced_ranks)
            except _PeerSetupFailed:  # no rank has mapped or written anything of this connect
                raise
            except Exception:
                # The route tables some ranks wrote point at workspaces that failed replacements free now:
                # back to the last connect's, whose mappings and workspaces stay.
                try:
                    self._store_route(self._route)
                except Exception as exc:  # noqa: BLE001 - the update's own error is the one raised
                    logger.warning("mooncake_ep: rank %d could not restore its route table after a failed "
                                   "update: %s", self.group.rank, exc)
                if replaced_ranks:
                    self._meet_failed_replacements()
                raise
        return self._connect(replaced_ranks)

    def _connect(self, replaced_ranks: Sequence[int]) -> list[int]:
        self._agree_on_kernels_and_steps()
        if self._ipc is None:
            # In one process a replacement (a fresh Buffer of a rank that stopped) also starts its
            # step counters at 0: it adopts the survivors' as across processes.
            route = local_transport.connect(self.group, self.workspace)
            replaced = sorted(replaced_ranks) if self._connected else []
        else:
            route, replaced = self._ipc.connect()
        failure = ""
        try:
            for rank in replaced:
                self._clear_flags_from(rank)
            self._store_route(route)
        except Exception as exc:  # noqa: BLE001 - shared: a rank failing here alone would leave the others connected
            failure = failure_text(exc)
        # Every route table is written before any rank launches; a write that failed fails every rank,
        # so that the release after a failed update meets on every rank (_meet_failed_replacements).
        raise_if_any_failed(self.group, "Buffer: could not write the route table", failure)
        if self._ipc is not None:
            self._ipc.commit()  # the replaced ranks' old mappings: no route table points at them now
        self._route = route
        self._connected = True
        return replaced

    def _store_route(self, route: list[int]) -> None:
        """Write the device route table: one address per rank."""
        self.workspace.write(layout.ROUTE_OFFSET, struct.pack(f"<{len(route)}Q", *route))

    def _meet_failed_replacements(self) -> None:
        """A survivor's side of an update that failed on every rank: the replacements, whose construction
        failed with it, release their workspaces collectively (:meth:`destroy`); meet their two barriers,
        closing this process's mappings of those workspaces between the two (ipc), so that none is freed
        while mapped here. Without this a replacement's barrier met the survivors' next collective (a
        retry) and broke the group, or waited out the group's timeout, and freed while still mapped."""
        where = "update_ep_member, releasing the failed replacements"
        failure = self._barrier(where)
        if self._ipc is not None:
            self._ipc.abandon()
        if failure is None:
            self._barrier(where)

    def _agree_on_kernels_and_steps(self) -> None:
        """Check that every rank runs the same protocol; adopt the highest step counters and
        every configuration some rank has agreed on.

        The counters are equal on ranks that made the same calls; a replacement's start at 0 and
        must jump to the survivors', or its flags would carry steps they never wait for.

        Raises:
            _PeerSetupFailed: on every rank, where one could not set up its side or read its counters
                (before any rank mapped or wrote anything: each releases alone, or keeps its Buffer).
        """
        try:
            if self._connected:
                # Reconnecting (update_ep_member): the counters read and the flags cleared must be final.
                # With peers in this process the sync waits for their kernels too; they finish without
                # any host's help, as every rank is here, past its last launch and with no hook pending
                # (update_ep_member checked), and a dead rank's are bounded by their timeouts.
                self.workspace.synchronize()
            mine = {"digest": protocol_digest(self.sys_scope), "nvrtc": list(kernels.nvrtc_version()),
                    # peek: no device-wide sync, which in one process would wait for peers' kernels
                    # (this rank has nothing in flight: a new Buffer, or connect synchronised first).
                    "steps": self._peek_steps(),
                    "agreed": sorted(self._agreed)}
        except Exception as exc:
            # Said in the collective the peers are in, as a failed setup is, or they would wait for this
            # rank's record the group's whole timeout and name no cause; this rank raises as they do.
            _announce_setup_failure(self.group, exc)
            raise _PeerSetupFailed(_setup_failure_message(self.group.rank, f"{type(exc).__name__}: {exc}")) from exc
        records = [_agreement_record(blob, rank) for rank, blob in
                   enumerate(self.group.allgather_bytes(json.dumps(mine).encode()))]
        digests = {rank: record["digest"][:12] for rank, record in enumerate(records)}
        if len(set(digests.values())) > 1:
            nvrtc = {rank: ".".join(map(str, record["nvrtc"])) for rank, record in enumerate(records)}
            raise ValueError(f"Buffer: ranks run different kernels (protocol digest {_handshake.by_rank(digests)}; "
                             f"NVRTC {_handshake.by_rank(nvrtc)}): install the same mooncake_ep, with the same "
                             f"kernels_cu sources, on every rank")
        steps = [max(column) for column in zip(*(record["steps"] for record in records))]
        if steps != mine["steps"]:
            self._write_steps(steps)
        self._agreed.update(tuple(key) for record in records for key in record["agreed"])

    def peek_state(self) -> np.void:
        """This rank's ``ep::State``, a record of :data:`layout.STATE_DTYPE` (``workspace.peek``: the
        caller makes sure no kernel of this rank runs)."""
        raw = self.workspace.peek(layout.HEADER_OFFSETS["state"], layout.STATE_BYTES)
        return np.frombuffer(raw, dtype=layout.STATE_DTYPE)[0]

    def _peek_steps(self) -> list[int]:
        """The step counters, field by field, parity by parity (``_STEP_FIELDS``)."""
        state = self.peek_state()
        return [int(step) for field in _STEP_FIELDS for step in state[field]]

    def _write_steps(self, steps: Sequence[int]) -> None:
        """Write the step counters, in ``_peek_steps``'s order; the other State fields stay as they are."""
        for i, field in enumerate(_STEP_FIELDS):
            words = np.asarray(steps[i * layout.NUM_PARITIES:(i + 1) * layout.NUM_PARITIES],
                               dtype=layout.STATE_DTYPE[field].base)
            self.workspace.write(layout.state_offset(field, 0), words.tobytes())

    def _clear_flags_from(self, rank: int) -> None:
        """Zero the flags ``rank`` writes into this workspace: its old process left steps there."""
        for region in ("dispatch_flag", "combine_flag"):
            for parity in range(layout.NUM_PARITIES):
                offset = layout.HEADER_OFFSETS[region] + (parity * _constants.MAX_RANKS + rank) * layout.FLAG_BYTES
                self.workspace.write(offset, bytes(layout.FLAG_BYTES))

    def agree_on(self, configuration: tuple, where: str = "dispatch") -> None:
        """Check, at its first use, that every rank dispatches ``configuration`` (T, hidden,
        num_experts and the fp8 flags, in ``_handshake.CONFIGURATION_FIELDS``' order).

        With ``ipc`` the first use is a collective (``_handshake.check_same_configuration``) that
        raises RankMismatchError on every rank if any differs: a kernel finds a region of a peer's
        workspace at its own offset, and reads the peer's staged rows in the form its own flags say.
        In-process ranks skip it (one thread may drive every rank, so a call holds no collective):
        the Buffer compares their first dispatch of each configuration through the group instead
        (``LocalRankGroup.claim_call``).

        Note:
            The trade-off with ``ipc``: a configuration first used after a rank died waits for the
            group's timeout and raises GroupError instead of masking that rank, and a rank calling a
            configuration it already used while a peer calls a new one is not caught here (that peer
            waits in the check; use one sequence of calls on every rank). So call every
            configuration once at start-up, while every rank is alive. A process that replaces a
            dead rank takes over the configurations the others agreed on.
        """
        if self._ipc is not None and configuration not in self._agreed:
            _handshake.check_same_configuration(self.group, configuration, where)
            self._agreed.add(configuration)

    def layout_for(self, num_max_tokens: int, hidden: int, num_experts: int) -> tuple[layout.WorkspaceLayout, int]:
        """The layout of a configuration and the device address of its packed copy.

        Note:
            The first call of a configuration computes it; the next launch writes it ahead of
            itself on its stream (:meth:`upload_layouts`). Ranks agree on it beforehand
            (:meth:`agree_on`).
        """
        key = (num_max_tokens, hidden, num_experts)
        found = self._layouts.get(key)
        if found is not None:
            return found
        if len(self._layouts) >= MAX_LAYOUTS:
            raise ValueError(f"dispatch: this Buffer already holds {MAX_LAYOUTS} distinct (T, hidden, num_experts) "
                             f"configurations, the most it can; reuse one of them or build another Buffer")
        workspace_layout = layout.compute_layout(self.group.world_size, num_experts, num_max_tokens, hidden,
                                                 self.workspace.num_bytes)
        offset = len(self._layouts) * layout.LAYOUT_SLOT_BYTES
        # Written by the next launch, on its stream (see upload_layouts), never here: a synchronous
        # copy inside a call waits behind the kernels of in-process peers that wait for this rank.
        self._pending_layouts.append((offset, workspace_layout.pack()))
        self._layouts[key] = (workspace_layout, self.layout_table.ptr + offset)
        return self._layouts[key]

    def upload_layouts(self, stream_ptr: int | None) -> None:
        """Write the configurations' layouts that :meth:`layout_for` made since the last upload.

        Args:
            stream_ptr: the stream of the launch about to read them: the copies go there, ahead of
                it, and the host does not wait. Inside a graph capture they are recorded into the
                graph and stay pending, so an eager launch after the capture copies them too.
                ``None``: copy synchronously now (outside any call and recording, e.g. at JAX
                trace time).
        """
        import cupy

        if stream_ptr is None:
            for offset, packed in self._pending_layouts:
                self.layout_table.write(offset, packed)
            self._pending_layouts.clear()
            return
        for offset, packed in self._pending_layouts:
            self.layout_table.write_on_stream(offset, packed, stream_ptr)
        if not cupy.cuda.runtime.streamIsCapturing(stream_ptr):
            self._pending_layouts.clear()

    def dispatch_launch(self, parity: int, layout_ptr: int, *, x_ptr: int, num_tokens: int, topk_ptr: int,
                        topk_is_int64: bool, num_topk: int, active_ptr: int, recv_x_ptr: int, recv_scales_ptr: int,
                        scale_row_stride: int, scale_column_stride: int, recv_count_ptr: int, timeout_ns: int,
                        use_fp8: bool, round_scale: bool, use_ue8m0: bool) -> Callable[[int, int], None]:
        """The launch of one dispatch, as ``launch(phases, stream_ptr)``: the arguments are bound once
        here, so that launching (once, or twice in hook mode) only packs them. ``scale_row_stride``,
        ``scale_column_stride``: recv_scales' strides in 4-byte elements (row-major, or DeepEP's
        column-major view); its local experts are ``rows * columns`` apart either way."""
        launcher = self.launchers[kernels.dispatch_launcher_name(use_fp8, round_scale, use_ue8m0)]
        args = (parity, layout_ptr, self.workspace.ptr, self.group.rank, x_ptr, num_tokens, topk_ptr, topk_is_int64,
                num_topk, active_ptr, recv_x_ptr, recv_scales_ptr, scale_row_stride, scale_column_stride,
                recv_count_ptr, timeout_ns)
        return lambda phases, stream_ptr: self._launch(launcher, (phases, *args), stream_ptr)

    def combine_launch(self, parity: int, layout_ptr: int, *, expert_out_ptr: int, zero_copy: bool, num_tokens: int,
                       topk_ptr: int, topk_is_int64: bool, num_topk: int, weights_ptr: int, active_ptr: int,
                       combined_ptr: int, renormalize: bool, timeout_ns: int,
                       direct_reads: bool = True) -> Callable[[int, int], None]:
        """The launch of one combine, as ``launch(phases, stream_ptr)`` (see :meth:`dispatch_launch`).
        ``direct_reads=False`` copies the expert outputs into the workspace even where peers could read
        them in place (see :meth:`_combine_source`)."""
        launcher = self.launchers["combine"]
        args = (parity, layout_ptr, self.workspace.ptr, self.group.rank, expert_out_ptr,
                self._combine_source(zero_copy, direct_reads), num_tokens, topk_ptr, topk_is_int64, num_topk,
                weights_ptr, active_ptr, combined_ptr, renormalize, timeout_ns)
        return lambda phases, stream_ptr: self._launch(launcher, (phases, *args), stream_ptr)

    def _launch(self, launcher, args: tuple, stream_ptr: int) -> None:
        """Write pending layouts ahead of the launch, then launch, with this rank's device current.

        The kernels were loaded in this device's context and the stream is this device's, but the
        calling thread may hold another device (an engine's thread, a callback's): the launch would
        fail after the call had advanced its step counters. The caller's device is given back.
        """
        previous = self._runtime.getDevice()
        if previous != self.device_id:
            self._runtime.setDevice(self.device_id)
        try:
            if self._pending_layouts:
                self.upload_layouts(stream_ptr)
            launcher(self.num_sms, args, stream_ptr)
        except Exception as exc:
            # cupy's message is the driver's alone ("invalid argument"): say which launch it was.
            raise RuntimeError(f"Buffer rank {self.group.rank}: launching {launcher.name} "
                               f"({_PHASE_NAMES.get(args[0], f'phases {args[0]}')}, {self.num_sms} blocks) on "
                               f"stream {stream_ptr:#x} of cuda:{self.device_id} failed: {type(exc).__name__}: "
                               f"{exc}") from exc
        finally:
            if previous != self.device_id:
                self._runtime.setDevice(previous)

    def _combine_source(self, zero_copy: bool, direct_reads: bool) -> int:
        """Where token owners read this rank's expert outputs (kSource* in ll_combine.cu).

        Direct reads make the receive half wait until every owner has read: right for ranks whose
        receive halves run at once, a deadlock for receive halves queued one after another on one
        stream (the JAX split form), which therefore asks for the copy.
        """
        if zero_copy:
            return SOURCE_WORKSPACE
        return SOURCE_DIRECT if self.direct_peer_reads and direct_reads else SOURCE_COPY

    # --- streams and events -------------------------------------------------------------------

    def record_event(self, stream_ptr: int):
        import cupy

        with cupy.cuda.Device(self.device_id):
            event = cupy.cuda.Event(block=False, disable_timing=True)
            cupy.cuda.runtime.eventRecord(event.ptr, stream_ptr)
        return event

    @staticmethod
    def event_done(event) -> bool:
        """Whether the work before ``event`` (record_event's) is done; never blocks."""
        return event.done

    def stream_is_capturing(self, stream_ptr: int) -> bool:
        """Whether ``stream_ptr`` is capturing a CUDA graph (it runs nothing meanwhile)."""
        import cupy

        with cupy.cuda.Device(self.device_id):
            return bool(cupy.cuda.runtime.streamIsCapturing(stream_ptr))

    def stream_wait(self, stream_ptr: int, event) -> None:
        import cupy

        # On this rank's device: a default-stream handle (0, 2) names the current device's stream,
        # and the calling thread may have another device current.
        with cupy.cuda.Device(self.device_id):
            cupy.cuda.runtime.streamWaitEvent(stream_ptr, event.ptr, 0)

    # --- teardown ---------------------------------------------------------------------------------

    def destroy(self, raise_group_error: bool = True) -> None:
        """Release the workspace once no rank can touch it (collective; idempotent).

        The order CUDA IPC requires: this process's kernels are done; barrier (no kernel reads any
        workspace); close the mappings of the peers' workspaces; barrier (no peer maps this one);
        free. With ``local`` (ranks of one process): this process's kernels are done; barrier;
        free; barrier (none returns and launches again, its next Buffer's kernels waiting for peers,
        while a peer's free still synchronises the device). A peer that never arrives (dead) makes
        a barrier raise GroupError after the group's timeout: the memory is released anyway.

        Args:
            raise_group_error: re-raise a failed barrier after releasing (False: only log it).
        """
        if self._destroyed:
            return
        self._destroyed = True
        self._finalizer.detach()
        failure: GroupError | None = None
        try:
            self.workspace.synchronize()
            failure = self._barrier()  # every rank's kernels are done: nobody reads any workspace
            if self._ipc is not None:
                self._ipc.close()
                if failure is None:  # a failed barrier broke the group: the next would fail at once
                    failure = self._barrier()  # every rank closed its mappings: nobody maps ours
        finally:
            self._release_memory()
        # In-process ranks share the device: none may return and launch again (its next Buffer's
        # kernels wait for peers) while a peer is still in the device-wide synchronisation of its
        # free, which would wait for that kernel as the kernel waits for the peer. Every rank frees
        # before any returns.
        if self.transport == "local" and self.group.world_size > 1 and failure is None:
            failure = self._barrier()
        if failure is not None and raise_group_error:
            raise failure

    def _release_alone(self) -> None:
        """Release without the peers: before any rank has the others' addresses (construction)."""
        self._destroyed = True
        self._finalizer.detach()
        self._release_memory()

    def _release_memory(self) -> None:
        """:func:`_release` this Buffer's mappings, memory and communication stream; raises the first failure."""
        failures = _release(self._ipc, self.workspace, self.layout_table,
                            self.comm_stream if self._owns_comm_stream else None)
        if failures:
            raise failures[0]

    def _barrier(self, where: str = "Buffer.destroy") -> GroupError | None:
        """The group's barrier; its GroupError logged and returned, not raised (a release goes on)."""
        try:
            self.group.barrier()
        except GroupError as exc:
            logger.warning("mooncake_ep: %s on rank %d: %s; releasing without waiting", where, self.group.rank, exc)
            return exc
        return None


# The phases argument of a launch (kPhaseSend / kPhaseRecv in ll_dispatch.cu, ll_combine.cu), for error messages.
_PHASE_NAMES = {1: "send half", 2: "receive half", 3: "both halves"}


class _PeerSetupFailed(TransportError):
    """A peer could not set up its side of a Buffer (kernels, workspace) and said so at the agreement."""


def _announce_setup_failure(group, exc: Exception) -> None:
    """On a rank whose setup failed: take part in the agreement's collective with the reason, so that
    the peers raise at once (:func:`_agreement_record`). A failure of the collective itself is left
    to the peers' own wait: this rank raises its setup error either way."""
    try:
        group.allgather_bytes(json.dumps({"failed": f"{type(exc).__name__}: {exc}"}).encode())
    except Exception as group_error:  # noqa: BLE001 - logged; the setup error is the one raised
        logger.warning("mooncake_ep: rank %d could not tell its peers that its setup failed: %s", group.rank,
                       group_error)


def _setup_failure_message(rank: int, reason: str) -> str:
    return (f"Buffer: rank {rank} could not set up its GPU side ({reason}); a new Buffer releases its own, and a "
            f"Buffer in update_ep_member keeps its route table")


def _agreement_record(blob: bytes, rank: int) -> dict:
    """A rank's record of _agree_on_kernels_and_steps; _PeerSetupFailed if that rank's setup failed,
    RankMismatchError if it is in another call."""
    try:
        record = json.loads(blob)
        if isinstance(record, dict) and "failed" in record:
            raise _PeerSetupFailed(_setup_failure_message(rank, record["failed"]))
        if isinstance(record, dict) and {"digest", "nvrtc", "steps", "agreed"} <= record.keys():
            return record
    except ValueError:  # JSONDecodeError and UnicodeDecodeError
        pass
    raise _handshake.RankMismatchError(f"Buffer: the ranks are not in the same call: rank {rank} is not connecting "
                                       f"a Buffer's workspace (a dispatch or combine of the reference backend, or "
                                       f"another collective?); every rank must make the same calls in the same order")


def _release_unreachable(rank: int, ipc, workspace: DeviceWorkspace, layout_table: DeviceWorkspace,
                         has_in_process_peers: bool, comm_stream=None) -> None:
    """The finalizer of a CudaBackend dropped without destroy(): no collective can run here.

    With peers in this process the memory is kept until the process ends: freeing synchronises
    the device, and collection runs on whichever thread allocates next, possibly while that rank's
    peers' kernels wait for it: the free would stall them all until their timeouts masked it.
    ``comm_stream`` (the Buffer's own, None for a group's) is handed to the next Buffer of its
    device once the frees have waited for the device, as destroy() does.
    """
    if has_in_process_peers:
        logger.warning("mooncake_ep: the Buffer of in-process rank %d was garbage-collected without destroy(): "
                       "its workspace (%d bytes) stays allocated until the process ends; call destroy() on every "
                       "rank", rank, workspace.num_bytes)
        # The workspaces' own finalizers would free them as soon as this one lets go of them.
        workspace.abandon()
        layout_table.abandon()
        return
    if ipc is not None and ipc.exported:
        logger.warning("mooncake_ep: the Buffer of rank %d was garbage-collected without destroy(): its "
                       "workspace is freed without waiting for the peers, which must not use it any more; "
                       "call destroy() on every rank", rank)
    for exc in _release(ipc, workspace, layout_table, comm_stream, wait_first=True):  # a finalizer may not raise
        logger.warning("mooncake_ep: releasing the Buffer of rank %d failed: %s", rank, exc)


def _release(ipc, workspace: DeviceWorkspace, layout_table: DeviceWorkspace, comm_stream, *,
             wait_first: bool = False) -> list[Exception]:
    """Close the mappings of the peers' workspaces (idempotent), free our own memory, then hand
    ``comm_stream`` (None: a group's, not ours) to the next Buffer of the device; each step tried
    even if one before it failed (a faulted kernel fails every device wait). Returns the failures.
    Memory whose free failed stays with its own finalizer; the stream, which may hold the faulted
    work, goes to no one. ``wait_first``: wait for this process's kernels before closing (the
    callers that have not: garbage collection can drop a Buffer right after an eager call, whose
    kernel may still store through those mappings)."""
    steps = [workspace.free, layout_table.free]
    if ipc is not None:
        steps[:0] = [workspace.synchronize, ipc.close] if wait_first else [ipc.close]  # the peers' first
    failures = []
    for step in steps:
        try:
            step()
        except Exception as exc:  # noqa: BLE001 - the caller raises or logs them, after the other steps
            failures.append(exc)
    if comm_stream is not None and not failures:
        _return_comm_stream(workspace.device_id, comm_stream)  # idle: the frees waited for the device
    return failures
