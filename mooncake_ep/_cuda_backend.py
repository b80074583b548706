"""The GPU backend of :class:`mooncake_ep.Buffer`: workspace, route table, kernels and launches.

Built once per buffer (collectively): allocates the symmetric workspace, connects it through the
transport, compiles or loads every kernel. A call only packs arguments and launches; the arguments
were validated by ``buffer.py`` before they get here.
"""

from __future__ import annotations

import logging
import struct


from mooncake_ep import kernels, layout
from mooncake_ep.transport import DeviceWorkspace, TransportError
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


def device_sm_count(device_id: int) -> int:
    import cupy

    return int(cupy.cuda.runtime.getDeviceProperties(device_id)["multiProcessorCount"])


def device_arch(device_id: int) -> str:
    import cupy

    return f"sm_{cupy.cuda.Device(device_id).compute_capability}"


class CudaBackend:
    """Device state of one rank.

    Args:
        group: the group (``is_in_process`` ranks use the ``local`` transport).
        num_ep_buffer_bytes: workspace size.
        device_id: CUDA device of this rank.
        num_sms: blocks of each launch (one per SM).
        cache: kernel cache.
        all_on_one_device: every rank of the group runs on device_id.
    """

    def __init__(self, group, num_ep_buffer_bytes: int, device_id: int, num_sms: int,
                 cache: kernels.KernelCache | None = None, all_on_one_device: bool = False):
        import cupy

        if not getattr(group, "is_in_process", False) and group.world_size > 1:
            raise TransportError(
                "Buffer: only in-process ranks (LocalGroup) have a GPU transport so far; "
                "a multi-process group needs the ipc transport"
            )
        self.group = group
        # Every peer can dereference this process's device addresses: combine reads the caller's
        # expert outputs where they are instead of copying them into the workspace first.
        self.direct_peer_reads = bool(getattr(group, "is_in_process", False)) or group.world_size == 1
        self.device_id = device_id
        self.num_sms = num_sms
        # In one process on one GPU, GPU-scope ordering is enough (kernels_cu/ptx.cuh).
        sys_scope = not (all_on_one_device and getattr(group, "is_in_process", False))
        self.launchers = kernels.load_low_latency_kernels(device_arch(device_id), cache, sys_scope)
        self.workspace = DeviceWorkspace(num_ep_buffer_bytes, device_id)
        self.layout_table = DeviceWorkspace(MAX_LAYOUTS * layout.LAYOUT_SLOT_BYTES, device_id)
        self._layouts: dict[tuple[int, int, int], tuple[layout.WorkspaceLayout, int]] = {}
        with cupy.cuda.Device(device_id):
            self.comm_stream = cupy.cuda.Stream(non_blocking=True)
        self.connect()

    def connect(self) -> None:
        """Exchange workspace addresses and write the route table (collective)."""
        self.route = local_transport.connect(self.group, self.workspace)
        self.workspace.write(layout.ROUTE_OFFSET, struct.pack(f"<{len(self.route)}Q", *self.route))
        self.group.barrier()  # every route table is written before any rank launches

    def layout_for(self, num_max_tokens: int, hidden: int, num_experts: int) -> tuple[layout.WorkspaceLayout, int]:
        """The layout of a configuration and the device address of its packed copy."""
        key = (num_max_tokens, hidden, num_experts)
        found = self._layouts.get(key)
        if found is not None:
            return found
        if len(self._layouts) >= MAX_LAYOUTS:
            raise ValueError(f"Buffer: more than {MAX_LAYOUTS} distinct (T, hidden, num_experts) configurations")
        workspace_layout = layout.compute_layout(self.group.world_size, num_experts, num_max_tokens, hidden)
        offset = len(self._layouts) * layout.LAYOUT_SLOT_BYTES
        # A synchronous copy, once per configuration: call each shape once before capturing a graph.
        self.layout_table.write(offset, workspace_layout.pack())
        self._layouts[key] = (workspace_layout, self.layout_table.ptr + offset)
        return self._layouts[key]

    def launch_dispatch(self, phases: int, parity: int, layout_ptr: int, *, x_ptr: int, num_tokens: int,
                        topk_ptr: int, topk_is_int64: bool, num_topk: int, active_ptr: int, recv_x_ptr: int,
                        recv_scales_ptr: int, recv_count_ptr: int, timeout_ns: int, use_fp8: bool,
                        round_scale: bool, use_ue8m0: bool, stream_ptr: int) -> None:
        launcher = self.launchers[kernels.dispatch_launcher_name(use_fp8, round_scale, use_ue8m0)]
        launcher(self.num_sms, (phases, parity, layout_ptr, self.workspace.ptr, self.group.rank, x_ptr, num_tokens,
                                topk_ptr, topk_is_int64, num_topk, active_ptr, recv_x_ptr, recv_scales_ptr,
                                recv_count_ptr, timeout_ns), stream_ptr)

    def launch_combine(self, phases: int, parity: int, layout_ptr: int, *, expert_out_ptr: int, zero_copy: bool,
                       num_tokens: int, topk_ptr: int, topk_is_int64: bool, num_topk: int, weights_ptr: int,
                       active_ptr: int, combined_ptr: int, renormalize: bool, timeout_ns: int,
                       stream_ptr: int) -> None:
        self.launchers["combine"](self.num_sms, (
            phases, parity, layout_ptr, self.workspace.ptr, self.group.rank, expert_out_ptr,
            self._combine_source(zero_copy), num_tokens, topk_ptr, topk_is_int64, num_topk, weights_ptr, active_ptr,
            combined_ptr, renormalize, timeout_ns), stream_ptr)

    def _combine_source(self, zero_copy: bool) -> int:
        if zero_copy:
            return SOURCE_WORKSPACE
        return SOURCE_DIRECT if self.direct_peer_reads else SOURCE_COPY

    # --- streams and events -------------------------------------------------------------------

    def record_event(self, stream_ptr: int):
        import cupy

        with cupy.cuda.Device(self.device_id):
            event = cupy.cuda.Event(block=False, disable_timing=True)
            cupy.cuda.runtime.eventRecord(event.ptr, stream_ptr)
        return event

    def stream_wait(self, stream_ptr: int, event) -> None:
        import cupy

        cupy.cuda.runtime.streamWaitEvent(stream_ptr, event.ptr, 0)

    def destroy(self) -> None:
        for workspace in (getattr(self, "workspace", None), getattr(self, "layout_table", None)):
            if workspace is not None:
                workspace.free()
