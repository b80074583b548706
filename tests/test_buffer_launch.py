"""The GPU path of Buffer, on the CPU: what it launches, on which stream, with which arguments.

A recording stand-in replaces the CUDA backend, and the arrays are host memory exported through
DLPack as if it were device memory, so buffer.py's CUDA branch (validation, outputs, phases, modes,
parity, hooks) runs without a GPU. The kernels themselves are tested on the GPU
(test_gpu_low_latency.py).
"""

from __future__ import annotations

import dataclasses
import gc
import sys
import threading
import types
import weakref

import ml_dtypes
import numpy as np
import pytest

import mooncake_ep as ep
from mooncake_ep import _dlpack, _handshake, frameworks
from mooncake_ep import layout
from mooncake_ep.tensor import ArrayView, DeviceMemoryArray

SEND, RECV = 1, 2
CALLER_STREAM = 0  # the 'dlpack' framework reports the legacy stream
COMM_STREAM = 0xC0FFEE
R, E, T, H, K = 2, 8, 4, 256, 2


@dataclasses.dataclass
class Launch:
    kernel: str
    phases: int
    parity: int
    stream: int
    args: dict


class RecordingCuda:
    """What buffer.py uses of _cuda_backend.CudaBackend, recording launches instead of making them."""

    device_id = 0
    direct_peer_reads = True  # in-process ranks on one GPU
    # Where the workspace would be: an address no host array of a test has (nothing reads it).
    workspace = type("Workspace", (), {"ptr": 0x7E00_0000_0000})()

    def __init__(self):
        self.launches: list[Launch] = []
        self.comm_stream = type("Stream", (), {"ptr": COMM_STREAM})()
        self.waits: list[tuple[int, object]] = []
        self.agreed: list[tuple] = []  # the configurations agree_on was asked, in order

    def agree_on(self, configuration, where="dispatch"):
        self.agreed.append(configuration)

    def layout_for(self, num_max_tokens, hidden, num_experts):
        return layout.compute_layout(R, num_experts, num_max_tokens, hidden), 0x1000

    def upload_layouts(self, stream_ptr):
        pass

    def dispatch_launch(self, parity, layout_ptr, **args):
        def launch(phases, stream_ptr):
            self.launches.append(Launch("dispatch", phases, parity, stream_ptr, args))
        return launch

    def combine_launch(self, parity, layout_ptr, **args):
        def launch(phases, stream_ptr):
            self.launches.append(Launch("combine", phases, parity, stream_ptr, args))
        return launch

    def record_event(self, stream_ptr):
        return ("event", stream_ptr)

    done_events = False  # whether event_done answers True

    def event_done(self, event):
        return self.done_events

    capturing = False

    def stream_is_capturing(self, stream_ptr):
        return self.capturing

    def stream_wait(self, stream_ptr, event):
        self.waits.append((stream_ptr, event))


class FakeDeviceArrays:
    """Host arrays exported through DLPack as cuda:0 memory."""

    def __init__(self):
        self.keep = []

    def __call__(self, array: np.ndarray) -> DeviceMemoryArray:
        array = np.ascontiguousarray(array)
        self.keep.append(array)
        dtype = {np.dtype(ml_dtypes.bfloat16): "bfloat16", np.dtype(ml_dtypes.float8_e4m3fn): "float8_e4m3fn"}.get(
            array.dtype, array.dtype.name)
        return DeviceMemoryArray(array.ctypes.data, array.shape, dtype, "cuda", 0, owner=array)


@pytest.fixture
def setup():
    group = _TwoRankView()
    buf = ep.Buffer(group, ep.Buffer.get_ep_buffer_size_hint(T, H, R, E), backend="reference")
    group.constructed = True
    cuda = RecordingCuda()
    buf._cuda, buf.backend = cuda, "cuda"
    device = FakeDeviceArrays()
    rng = np.random.default_rng(0)
    inputs = dict(
        x=device(rng.standard_normal((3, H)).astype(ml_dtypes.bfloat16)),
        topk_idx=device(np.array([[0, 5], [7, -1], [2, 3]], dtype=np.int64)),
        active_ranks=device(np.ones(R, np.int32)),
    )
    return buf, cuda, device, inputs


class _TwoRankView:
    """Rank 0 of a two-rank group: construction's configuration check hears the same configuration
    from the peer; after construction no collective may be called on this path."""

    rank, world_size, is_in_process, device = 0, R, True, 0
    constructed = False

    def allgather_bytes(self, data):
        if not self.constructed:
            return [data] * self.world_size
        raise AssertionError("the CUDA path makes no host collective per call")

    def barrier(self):  # pragma: no cover
        raise AssertionError("the CUDA path makes no host collective per call")


def dispatch_out(device, use_fp8: bool, num_max_tokens: int = T):
    rows = R * num_max_tokens
    recv_count = device(np.full(E // R, -1, np.int32))
    if use_fp8:
        return ((device(np.zeros((E // R, rows, H), ml_dtypes.float8_e4m3fn)),
                 device(np.zeros((E // R, rows, H // 128), np.float32))), recv_count)
    return device(np.zeros((E // R, rows, H), ml_dtypes.bfloat16)), recv_count


class FakeDeviceStrided:
    """A host float32 array exported through DLPack as cuda:0 memory with its own strides."""

    def __init__(self, array: np.ndarray):
        assert array.dtype == np.float32
        self.array = array

    def __dlpack_device__(self):
        return (_dlpack.DLDeviceType.kDLCUDA, 0)

    def __dlpack__(self, stream=None, max_version=None, dl_device=None, copy=None):
        return _dlpack.build_capsule(self.array.view(np.uint32), versioned=max_version is not None,
                                     code=_dlpack.DLDataTypeCode.kDLFloat, bits=32,
                                     dl_device=self.__dlpack_device__())


@pytest.mark.parametrize("layout", ["row-major", "swapped"])
def test_the_kernel_writes_the_fp8_scales_in_the_layout_of_out(setup, layout):
    """The scales' strides reach the kernel: row-major, or DeepEP's swapped layout (the results')."""
    buf, cuda, device, inputs = setup
    (q, _), count = dispatch_out(device, True)
    rows, columns = R * T, H // 128
    scales = np.zeros((E // R, rows, columns) if layout == "row-major" else (E // R, columns, rows), np.float32)
    out = ((q, FakeDeviceStrided(scales if layout == "row-major" else scales.swapaxes(1, 2))), count)
    buf.dispatch(**inputs, num_max_dispatch_tokens_per_rank=T, num_experts=E, use_fp8=True, out=out)
    args = cuda.launches[-1].args
    assert args["recv_scales_ptr"] == scales.ctypes.data
    assert (args["scale_row_stride"], args["scale_column_stride"]) == ((columns, 1) if layout == "row-major"
                                                                       else (1, rows))


def test_fp8_scales_in_another_layout_are_refused_and_the_buffer_stays_usable(setup):
    buf, cuda, device, inputs = setup
    (q, _), count = dispatch_out(device, True)
    every_other_row = np.zeros((E // R, 2 * R * T, H // 128), np.float32)[:, ::2]
    with pytest.raises(ValueError,
                       match=r"^dispatch: out recv_scales must be contiguous \(row-major, strides in elements "):
        buf.dispatch(**inputs, num_max_dispatch_tokens_per_rank=T, num_experts=E, use_fp8=True,
                     out=((q, FakeDeviceStrided(every_other_row)), count))
    assert cuda.launches == []
    buf.dispatch(**inputs, num_max_dispatch_tokens_per_rank=T, num_experts=E, use_fp8=True,
                 out=dispatch_out(device, True))
    assert [(l.kernel, l.args["scale_row_stride"], l.args["scale_column_stride"]) for l in cuda.launches] == \
        [("dispatch", H // 128, 1)]


@pytest.mark.parametrize("use_fp8", [False, True])
def test_sync_dispatch_launches_both_halves_in_one_kernel_on_the_caller_stream(setup, use_fp8):
    buf, cuda, device, inputs = setup
    out = dispatch_out(device, use_fp8)
    recv, count, handle, event, hook = buf.dispatch(**inputs, num_max_dispatch_tokens_per_rank=T, num_experts=E,
                                                   timeout_us=250, use_fp8=use_fp8, out=out)
    assert hook is None and count is out[1]
    assert all(a is b for a, b in zip(recv, out[0])) if use_fp8 else recv is out[0]
    assert [(l.kernel, l.phases, l.stream) for l in cuda.launches] == [("dispatch", SEND | RECV, CALLER_STREAM)]
    args = cuda.launches[0].args
    assert args["num_tokens"] == 3 and args["num_topk"] == K and args["topk_is_int64"]
    assert args["timeout_ns"] == 250_000 and args["use_fp8"] == use_fp8
    recv_x = out[0][0] if use_fp8 else out[0]
    assert args["recv_x_ptr"] == recv_x.ptr and args["recv_count_ptr"] == out[1].ptr
    assert args["recv_scales_ptr"] == (out[0][1].ptr if use_fp8 else 0)
    assert (args["scale_row_stride"], args["scale_column_stride"]) == ((H // 128, 1) if use_fp8 else (0, 0))
    event.current_stream_wait()  # a no-op: the work is on the caller's stream


def test_hook_mode_launches_the_receive_half_only_when_called(setup):
    buf, cuda, device, inputs = setup
    _, _, handle, _, hook = buf.dispatch(**inputs, num_max_dispatch_tokens_per_rank=T, num_experts=E,
                                         use_fp8=False, return_recv_hook=True, out=dispatch_out(device, False))
    assert [l.phases for l in cuda.launches] == [SEND]
    with pytest.raises(RuntimeError, match="hook"):
        buf.combine(None, inputs["topk_idx"], device(np.ones((3, K), np.float32)), inputs["active_ranks"],
                    handle=handle, zero_copy=True)
    hook()
    assert [(l.phases, l.stream) for l in cuda.launches] == [(SEND, CALLER_STREAM), (RECV, CALLER_STREAM)]
    with pytest.raises(RuntimeError, match="already called"):
        hook()


@pytest.mark.parametrize("call", ["dispatch", "combine"])
def test_a_hook_on_the_per_thread_default_stream_refuses_another_thread(setup, monkeypatch, call):
    """Stream 2 (cupy's current stream under CUPY_CUDA_PER_THREAD_DEFAULT_STREAM) names each thread's own
    stream: launched from another thread, the receive half would run unordered after its send half.
    Refused there, before anything launches; the call's own thread then launches it on stream 2."""
    buf, cuda, device, inputs = setup
    monkeypatch.setattr(frameworks.get("dlpack"), "current_stream", lambda device_id: 2)
    kwargs = dict(num_max_dispatch_tokens_per_rank=T, num_experts=E, use_fp8=False)
    _, _, handle, _, hook = buf.dispatch(**inputs, **kwargs, return_recv_hook=(call == "dispatch"),
                                         out=dispatch_out(device, False))
    if call == "combine":
        _, _, hook = buf.combine(None, inputs["topk_idx"], device(np.ones((3, K), np.float32)),
                                 inputs["active_ranks"], handle=handle, zero_copy=True, return_recv_hook=True,
                                 out=device(np.zeros((3, H), ml_dtypes.bfloat16)))
    launched = len(cuda.launches)
    errors = []
    thread = threading.Thread(target=lambda: errors.append(pytest.raises(RuntimeError, hook)))
    thread.start()
    thread.join()
    assert len(errors) == 1 and errors[0].match(f"hook: the {call} ran on the per-thread default stream \\(2\\)")
    assert len(cuda.launches) == launched, "nothing was launched from the other thread"
    hook()
    assert (cuda.launches[-1].kernel, cuda.launches[-1].phases, cuda.launches[-1].stream) == (call, RECV, 2)


class CopiedDeviceArray(DeviceMemoryArray):
    """A CUDA producer that exported a copy: IS_COPIED on its versioned capsule."""

    def __dlpack__(self, *args, **kwargs):
        capsule = super().__dlpack__(*args, **kwargs)
        name = _dlpack._PyCapsule_GetName(capsule)
        managed = _dlpack.DLManagedTensorVersioned.from_address(_dlpack._PyCapsule_GetPointer(capsule, name))
        managed.flags |= _dlpack.DLPACK_FLAG_BITMASK_IS_COPIED
        return capsule


def test_an_active_ranks_exported_as_a_copy_is_refused_after_a_remembered_plan_too(setup):
    """The call writes active_ranks: one its producer exported as a copy would never show the ranks the
    kernels mask, so it is refused, also once an ordinary call of the same layout left a checked plan."""
    buf, cuda, device, inputs = setup
    kwargs = dict(num_max_dispatch_tokens_per_rank=T, num_experts=E, use_fp8=False)
    buf.dispatch(**inputs, **kwargs, out=dispatch_out(device, False))
    mask = np.ones(R, np.int32)
    with pytest.raises(ValueError, match=r"dispatch: active_ranks was exported by its producer as a copy"):
        buf.dispatch(inputs["x"], inputs["topk_idx"], CopiedDeviceArray(mask.ctypes.data, mask.shape, "int32", "cuda",
                                                                        0, owner=mask),
                     **kwargs, out=dispatch_out(device, False))
    assert len([launch for launch in cuda.launches if launch.kernel == "dispatch"]) == 1


def test_a_hook_keeps_the_calls_arrays_until_it_has_launched(setup):
    """The receive half writes the outputs: the call's arrays live until the hook launched, though the
    caller dropped them (their memory could otherwise go to new work before the kernels are done with
    it). Then, arrays of a DLPack producer other than torch and cupy (whose allocator's stream nothing
    orders after the kernels), until the receive half is done."""
    buf, cuda, device, inputs = setup
    _, _, handle, _, _ = buf.dispatch(**inputs, num_max_dispatch_tokens_per_rank=T, num_experts=E, use_fp8=False,
                                      out=dispatch_out(device, False))
    owners = [np.zeros((E // R, R * T, H), ml_dtypes.bfloat16), np.zeros((3, H), ml_dtypes.bfloat16)]
    alive = [weakref.ref(owner) for owner in owners]
    x, combined = (DeviceMemoryArray(o.ctypes.data, o.shape, "bfloat16", "cuda", 0, owner=o) for o in owners)
    del owners
    _, _, hook = buf.combine(x, inputs["topk_idx"], device(np.ones((3, K), np.float32)), inputs["active_ranks"],
                             handle=handle, return_recv_hook=True, out=combined)
    del x, combined
    gc.collect()
    assert all(ref() is not None for ref in alive), "dropped by the caller, kept by the pending hook"
    hook()
    gc.collect()
    # Held until the receive half is done (the dispatch's arrays are held too: 2 entries).
    assert all(ref() is not None for ref in alive) and len(buf._in_flight) == 2
    cuda.done_events = True
    buf.dispatch(**inputs, num_max_dispatch_tokens_per_rank=T, num_experts=E, use_fp8=False,
                 out=dispatch_out(device, False))  # the next call lets go of what is done
    gc.collect()
    assert all(ref() is None for ref in alive), "released once the receive half is done"


def test_a_combine_hook_whose_launch_failed_keeps_the_calls_arrays_and_refuses_launches_until_an_update(
        setup, monkeypatch):
    """The send half ran, so in-process peers may still read x in place; with the receive half's launch
    failed nothing orders their reads before a reuse of the memory: the hook keeps it."""
    buf, cuda, device, inputs = setup
    _, _, handle, _, _ = buf.dispatch(**inputs, num_max_dispatch_tokens_per_rank=T, num_experts=E, use_fp8=False,
                                      out=dispatch_out(device, False))
    owner = np.zeros((E // R, R * T, H), ml_dtypes.bfloat16)
    alive = weakref.ref(owner)
    x = DeviceMemoryArray(owner.ctypes.data, owner.shape, "bfloat16", "cuda", 0, owner=owner)
    del owner
    real_launch = cuda.combine_launch

    def failing_receive(parity, layout_ptr, **args):
        launch = real_launch(parity, layout_ptr, **args)

        def run(phases, stream_ptr):
            if phases & RECV:
                raise RuntimeError("cuLaunchKernel: the receive half failed")
            launch(phases, stream_ptr)
        return run
    cuda.combine_launch = failing_receive
    _, _, hook = buf.combine(x, inputs["topk_idx"], device(np.ones((3, K), np.float32)), inputs["active_ranks"],
                             handle=handle, return_recv_hook=True, out=device(np.zeros((3, H), ml_dtypes.bfloat16)))
    del x
    # A dispatch of the other parity, its hook pending (two micro-batches in flight).
    _, _, _, _, other_hook = buf.dispatch(**inputs, num_max_dispatch_tokens_per_rank=T, num_experts=E,
                                          use_fp8=False, return_recv_hook=True, out=dispatch_out(device, False))
    with pytest.raises(RuntimeError, match="the receive half failed"):
        hook()
    gc.collect()
    assert alive() is not None
    # Its counters are the other parity's: it still runs, else it stayed pending, and update_ep_member,
    # which refuses pending hooks, could never run (helper-157).
    other_hook()
    # The combine's send half ran and its receive half, which moves the step counters, did not: this
    # rank's next call would take the failed one's step, and could accept the peers' flags of it over
    # their next call's data (helper-153). Every launch is refused until update_ep_member.
    cuda.combine_launch = real_launch
    behind = (r"the receive half of a combine failed to launch \(RuntimeError: cuLaunchKernel: the receive half "
              r"failed\), after its send half ran, so this rank's step counters are behind its peers' .* Call "
              r"update_ep_member\(\) on every rank")
    with pytest.raises(RuntimeError, match=r"^combine: " + behind):
        buf.combine(None, inputs["topk_idx"], device(np.ones((3, K), np.float32)), inputs["active_ranks"],
                    handle=handle, zero_copy=True, out=device(np.zeros((3, H), ml_dtypes.bfloat16)))
    with pytest.raises(RuntimeError, match=r"^dispatch: " + behind):
        buf.dispatch(**inputs, num_max_dispatch_tokens_per_rank=T, num_experts=E, use_fp8=False,
                     out=dispatch_out(device, False))
    assert [(launch.kernel, launch.phases) for launch in cuda.launches] == [
        ("dispatch", SEND | RECV), ("combine", SEND), ("dispatch", SEND), ("dispatch", RECV)]
    # update_ep_member (every rank) brings the counters to the peers': launches go on.
    group = buf.group
    group.constructed = False  # its collectives answer again, as a peer that agrees
    cuda.connect = lambda replaced: cuda.launches.append(Launch("connect", 0, 0, 0, {"replaced": replaced}))
    monkeypatch.setattr(_handshake, "num_sms_for", lambda configs, rank, where: 16)
    assert buf.update_ep_member() == []
    buf.dispatch(**inputs, num_max_dispatch_tokens_per_rank=T, num_experts=E, use_fp8=False,
                 out=dispatch_out(device, False))
    assert [launch.kernel for launch in cuda.launches] == ["dispatch", "combine", "dispatch", "dispatch", "connect",
                                                           "dispatch"]


def test_a_hook_dropped_uncalled_refuses_launches_until_an_update(setup, monkeypatch):
    """Its send half moved the step counters and no receive half will (as a receive half that failed to
    launch): every launch is refused by name until update_ep_member, which it had refused for good while
    the dropped hook stayed pending (helper-165)."""
    buf, cuda, device, inputs = setup
    _, _, _, _, hook = buf.dispatch(**inputs, num_max_dispatch_tokens_per_rank=T, num_experts=E, use_fp8=False,
                                    return_recv_hook=True, out=dispatch_out(device, False))
    del hook
    gc.collect()
    with pytest.raises(RuntimeError, match=r"^dispatch: the receive hook of a dispatch was dropped without being "
                                           r"called, after its send half ran, so this rank's step counters are "
                                           r"behind its peers'"):
        buf.dispatch(**inputs, num_max_dispatch_tokens_per_rank=T, num_experts=E, use_fp8=False,
                     out=dispatch_out(device, False))
    buf.group.constructed = False  # its collectives answer again, as a peer that agrees
    cuda.connect = lambda replaced: cuda.launches.append(Launch("connect", 0, 0, 0, {"replaced": replaced}))
    monkeypatch.setattr(_handshake, "num_sms_for", lambda configs, rank, where: 16)
    assert buf.update_ep_member() == []
    buf.dispatch(**inputs, num_max_dispatch_tokens_per_rank=T, num_experts=E, use_fp8=False,
                 out=dispatch_out(device, False))
    assert [launch.kernel for launch in cuda.launches] == ["dispatch", "connect", "dispatch"]


def test_async_mode_runs_both_halves_on_the_comm_stream_after_the_caller(setup):
    buf, cuda, device, inputs = setup
    _, _, _, event, _ = buf.dispatch(**inputs, num_max_dispatch_tokens_per_rank=T, num_experts=E, use_fp8=False,
                                     async_finish=True, out=dispatch_out(device, False))
    assert [(l.phases, l.stream) for l in cuda.launches] == [(SEND | RECV, COMM_STREAM)]
    assert cuda.waits == [(COMM_STREAM, ("event", CALLER_STREAM))]  # comm stream waits for the caller
    event.current_stream_wait()
    assert cuda.waits[-1] == (CALLER_STREAM, ("event", COMM_STREAM))  # and the caller for the comm stream


def test_parity_alternates_and_combine_answers_its_dispatch(setup):
    buf, cuda, device, inputs = setup
    weights = device(np.ones((3, K), np.float32))
    handles = []
    for _ in range(3):
        _, _, handle, _, _ = buf.dispatch(**inputs, num_max_dispatch_tokens_per_rank=T, num_experts=E,
                                          use_fp8=False, out=dispatch_out(device, False))
        handles.append(handle)
    assert [l.parity for l in cuda.launches if l.phases & SEND] == [0, 1, 0]
    expert_out = device(np.zeros((E // R, R * T, H), ml_dtypes.bfloat16))
    combined = device(np.zeros((3, H), ml_dtypes.bfloat16))
    result, _, _ = buf.combine(expert_out, inputs["topk_idx"], weights, inputs["active_ranks"], 10, handles[1],
                               out=combined, renormalize=True)
    combine = [l for l in cuda.launches if l.kernel == "combine"]
    assert result is combined
    assert [(l.phases, l.parity) for l in combine] == [(SEND | RECV, 1)]
    assert combine[0].args["expert_out_ptr"] == expert_out.ptr and not combine[0].args["zero_copy"]
    assert combine[0].args["combined_ptr"] == combined.ptr and combine[0].args["renormalize"]
    assert combine[0].args["timeout_ns"] == 10_000 and combine[0].args["direct_reads"]
    assert {name: combine[0].args[name] for name in ("topk_ptr", "topk_is_int64", "num_tokens", "num_topk",
                                                     "weights_ptr", "active_ptr")} == \
        dict(topk_ptr=inputs["topk_idx"].ptr, topk_is_int64=True, num_tokens=3, num_topk=K, weights_ptr=weights.ptr,
             active_ptr=inputs["active_ranks"].ptr)
    with pytest.raises(ValueError, match="stale"):
        buf.combine(expert_out, inputs["topk_idx"], weights, inputs["active_ranks"], 10, handles[0], out=combined)


def test_a_dispatch_refused_on_its_way_to_the_launch_uses_no_parity(setup):
    """A configuration the backend refuses (here: past its layout limit) launches nothing, so it is not
    counted: the next dispatch takes the parity the refused one would have, and the handle before it
    stays valid (it had been refused as stale after one real dispatch)."""
    buf, cuda, device, inputs = setup
    weights = device(np.ones((3, K), np.float32))
    def dispatch():
        return buf.dispatch(**inputs, num_max_dispatch_tokens_per_rank=T, num_experts=E, use_fp8=False,
                            out=dispatch_out(device, False))[2]
    first = dispatch()
    real_layout_for = cuda.layout_for

    def refuse(*args):
        raise ValueError("dispatch: this Buffer already holds 64 distinct (T, hidden, num_experts) configurations")
    cuda.layout_for = refuse
    with pytest.raises(ValueError, match="already holds 64 distinct"):
        dispatch()
    cuda.layout_for = real_layout_for
    second = dispatch()
    assert [l.parity for l in cuda.launches if l.phases & SEND] == [0, 1]
    assert (first.dispatch_index, second.dispatch_index) == (0, 1)
    expert_out = device(np.zeros((E // R, R * T, H), ml_dtypes.bfloat16))
    combined = device(np.zeros((3, H), ml_dtypes.bfloat16))
    buf.combine(expert_out, inputs["topk_idx"], weights, inputs["active_ranks"], handle=first, out=combined)  # valid


def test_int32_expert_ids_reach_both_kernels_as_int32(setup):
    buf, cuda, device, inputs = setup
    topk32 = device(np.array([[0, 5], [7, -1], [2, 3]], dtype=np.int32))
    _, _, handle, _, _ = buf.dispatch(**dict(inputs, topk_idx=topk32), num_max_dispatch_tokens_per_rank=T,
                                      num_experts=E, use_fp8=False, out=dispatch_out(device, False))
    buf.combine(device(np.zeros((E // R, R * T, H), ml_dtypes.bfloat16)), topk32, device(np.ones((3, K), np.float32)),
                inputs["active_ranks"], -1, handle, out=device(np.zeros((3, H), ml_dtypes.bfloat16)))
    assert [(l.kernel, l.args["topk_ptr"], l.args["topk_is_int64"]) for l in cuda.launches] == \
        [("dispatch", topk32.ptr, False), ("combine", topk32.ptr, False)]


def test_zero_copy_combine_refuses_an_out_inside_the_combine_buffer(setup):
    """The CUDA backend's combine buffer is the workspace's combine_x of the handle's parity."""
    buf, cuda, device, inputs = setup
    _, _, handle, _, _ = buf.dispatch(**inputs, num_max_dispatch_tokens_per_rank=T, num_experts=E, use_fp8=False,
                                      out=dispatch_out(device, False))
    start = cuda.workspace.ptr + cuda.layout_for(T, H, E)[0].offsets["combine_x"][handle.parity]
    last_rows = DeviceMemoryArray(start + ((E // R) * R * T - 3) * H * 2, (3, H), "bfloat16", "cuda", 0, owner=None)
    weights = device(np.ones((3, K), np.float32))
    with pytest.raises(ValueError, match=r"combine: out combined_x shares memory with get_next_combine_buffer"):
        buf.combine(None, inputs["topk_idx"], weights, inputs["active_ranks"], -1, handle, zero_copy=True,
                    out=last_rows)
    assert [l.kernel for l in cuda.launches] == ["dispatch"]
    buf.combine(None, inputs["topk_idx"], weights, inputs["active_ranks"], -1, handle, zero_copy=True,
                out=device(np.zeros((3, H), ml_dtypes.bfloat16)))  # still usable
    assert [l.kernel for l in cuda.launches] == ["dispatch", "combine"]


@pytest.mark.parametrize("mode", ["hook", "copy"])
def test_a_combine_that_copies_refuses_an_out_inside_the_combine_buffer_too(setup, mode):
    """A hook combine, and any whose peers read copies, copies x into the same memory, which the peers
    read while the receive half writes combined_x: only zero_copy was checked (helper-158)."""
    buf, cuda, device, inputs = setup
    cuda.direct_peer_reads = mode != "copy"
    _, _, handle, _, _ = buf.dispatch(**inputs, num_max_dispatch_tokens_per_rank=T, num_experts=E, use_fp8=False,
                                      out=dispatch_out(device, False))
    start = cuda.workspace.ptr + cuda.layout_for(T, H, E)[0].offsets["combine_x"][handle.parity]
    inside = DeviceMemoryArray(start, (3, H), "bfloat16", "cuda", 0, owner=None)
    x = device(np.zeros((E // R, R * T, H), ml_dtypes.bfloat16))
    with pytest.raises(ValueError, match=r"combine: out combined_x shares memory with get_next_combine_buffer\(handle\), "
                                         r"whose memory the combine's peers read"):
        buf.combine(x, inputs["topk_idx"], device(np.ones((3, K), np.float32)), inputs["active_ranks"], -1, handle,
                    return_recv_hook=mode == "hook", out=inside)
    assert [l.kernel for l in cuda.launches] == ["dispatch"]


def test_zero_copy_combine_passes_no_expert_output(setup):
    buf, cuda, device, inputs = setup
    _, _, handle, _, _ = buf.dispatch(**inputs, num_max_dispatch_tokens_per_rank=T, num_experts=E, use_fp8=False,
                                      out=dispatch_out(device, False))
    buf.combine(None, inputs["topk_idx"], device(np.ones((3, K), np.float32)), inputs["active_ranks"], -1, handle,
                zero_copy=True, out=device(np.zeros((3, H), ml_dtypes.bfloat16)))
    combine = [l for l in cuda.launches if l.kernel == "combine"]
    assert combine[0].args["expert_out_ptr"] == 0 and combine[0].args["zero_copy"]
    assert combine[0].args["timeout_ns"] == -1


@pytest.mark.parametrize("first", ["zero_copy", "copy"])
def test_a_dispatch_combined_through_the_workspace_is_not_combined_or_rewritten_again(setup, first):
    """A zero-copy combine, or one whose transport copies the expert outputs into the workspace,
    leaves rows there that slower peers may still be reading: a second combine of that handle, or
    the caller writing get_next_combine_buffer(handle), would change them under those reads."""
    buf, cuda, device, inputs = setup
    cuda.direct_peer_reads = first != "copy"  # ranks in other processes, or in-process across GPUs
    _, _, handle, _, _ = buf.dispatch(**inputs, num_max_dispatch_tokens_per_rank=T, num_experts=E, use_fp8=False,
                                      out=dispatch_out(device, False))
    weights, combined = device(np.ones((3, K), np.float32)), device(np.zeros((3, H), ml_dtypes.bfloat16))
    x = None if first == "zero_copy" else device(np.zeros((E // R, R * T, H), ml_dtypes.bfloat16))
    buf.combine(x, inputs["topk_idx"], weights, inputs["active_ranks"], -1, handle, zero_copy=x is None,
                out=combined)
    message = r"combine: this handle was already combined through the workspace .* dispatch again"
    with pytest.raises(RuntimeError, match=message):
        buf.combine(x, inputs["topk_idx"], weights, inputs["active_ranks"], -1, handle, zero_copy=x is None,
                    out=combined)
    with pytest.raises(RuntimeError, match=message.replace("combine:", "get_next_combine_buffer:")):
        buf.get_next_combine_buffer(handle)
    assert [l.kernel for l in cuda.launches] == ["dispatch", "combine"]
    _, _, handle, _, _ = buf.dispatch(**inputs, num_max_dispatch_tokens_per_rank=T, num_experts=E, use_fp8=False,
                                      out=dispatch_out(device, False))
    buf.combine(x, inputs["topk_idx"], weights, inputs["active_ranks"], -1, handle, zero_copy=x is None,
                out=combined)
    assert [l.kernel for l in cuda.launches] == ["dispatch", "combine"] * 2


def test_a_dispatch_read_in_place_is_combined_again_and_a_hook_combine_copies(setup):
    """In-process peers on one GPU read the caller's x in place (DeepEP's tests combine one dispatch
    twice), and a receive half that reads in place waits until every peer has read: in hook mode that
    is until every peer's hook ran, where a hook's receive half must wait for the peers' send halves
    alone (a caller waiting for one rank's hook before calling the next's waited forever, or past
    timeout_us, which masked a live peer still reading: helper-153). A hook combine copies, through
    the workspace, so that handle is not combined again."""
    buf, cuda, device, inputs = setup
    _, _, handle, _, _ = buf.dispatch(**inputs, num_max_dispatch_tokens_per_rank=T, num_experts=E, use_fp8=False,
                                      out=dispatch_out(device, False))
    weights, combined = device(np.ones((3, K), np.float32)), device(np.zeros((3, H), ml_dtypes.bfloat16))
    x = device(np.zeros((E // R, R * T, H), ml_dtypes.bfloat16))
    buf.combine(x, inputs["topk_idx"], weights, inputs["active_ranks"], -1, handle, out=combined)
    buf.combine(x, inputs["topk_idx"], weights, inputs["active_ranks"], -1, handle, out=combined)
    _, _, hook = buf.combine(x, inputs["topk_idx"], weights, inputs["active_ranks"], -1, handle,
                             return_recv_hook=True, out=combined)
    with pytest.raises(RuntimeError, match=r"combine: a combine of this handle still waits for its hook\(\)"):
        buf.combine(x, inputs["topk_idx"], weights, inputs["active_ranks"], -1, handle, out=combined)
    hook()
    with pytest.raises(RuntimeError, match=r"combine: this handle was already combined through the workspace "
                                           r"\(return_recv_hook=True, which copies\)"):
        buf.combine(x, inputs["topk_idx"], weights, inputs["active_ranks"], -1, handle, out=combined)
    combines = [(l.phases, l.args["direct_reads"]) for l in cuda.launches if l.kernel == "combine"]
    assert combines == [(SEND | RECV, True), (SEND | RECV, True), (SEND, False), (RECV, False)]


def test_positional_flags_are_mooncake_eps_and_the_scale_options_keywords(setup):
    """Mooncake EP's dispatch takes (..., timeout_us, use_fp8, async_finish, return_recv_hook): a call
    written for it means the same here; DeepEP's round_scale / use_ue8m0 cannot be set by position."""
    buf, cuda, device, inputs = setup
    args = (inputs["x"], inputs["topk_idx"], inputs["active_ranks"], T, E, 250, False)
    _, _, _, _, hook = buf.dispatch(*args, False, True, out=dispatch_out(device, False))
    assert hook is not None and [l.phases for l in cuda.launches] == [SEND]
    hook()
    with pytest.raises(TypeError, match=r"positional argument"):
        buf.dispatch(*args, False, False, True, out=dispatch_out(device, False))
    assert len(cuda.launches) == 2


@pytest.mark.parametrize("num_experts", [np.array(E), [E]], ids=["0-d-array", "list"])
def test_an_unhashable_num_experts_is_named(setup, num_experts):
    buf, cuda, device, inputs = setup
    with pytest.raises(TypeError, match=rf"dispatch: num_experts must be an int, got {type(num_experts).__name__}"):
        buf.dispatch(**inputs, num_max_dispatch_tokens_per_rank=T, num_experts=num_experts, use_fp8=False,
                     out=dispatch_out(device, False))
    buf.dispatch(**inputs, num_max_dispatch_tokens_per_rank=T, num_experts=E, use_fp8=False,
                 out=dispatch_out(device, False))
    assert [l.kernel for l in cuda.launches] == ["dispatch"]


def test_device_arrays_are_not_read_by_the_host(setup):
    """Expert ids of device arrays are left to the kernels (reading them would need a sync)."""
    buf, cuda, device, inputs = setup
    inputs = dict(inputs, topk_idx=device(np.array([[0, 99], [7, -1], [2, 3]], dtype=np.int64)))
    buf.dispatch(**inputs, num_max_dispatch_tokens_per_rank=T, num_experts=E, use_fp8=False,
                 out=dispatch_out(device, False))
    assert len(cuda.launches) == 1


def test_a_cached_plan_does_not_pass_a_num_experts_of_another_type(setup):
    """Device arrays' plans are cached by layout; 8.0 equals 8 as a key, and must still be refused."""
    buf, cuda, device, inputs = setup
    out = dispatch_out(device, False)
    buf.dispatch(**inputs, num_max_dispatch_tokens_per_rank=T, num_experts=E, use_fp8=False, out=out)
    with pytest.raises(TypeError, match="dispatch: num_experts must be an int, got float"):
        buf.dispatch(**inputs, num_max_dispatch_tokens_per_rank=T, num_experts=float(E), use_fp8=False, out=out)
    assert len(cuda.launches) == 1


class ReadOnlyExport:
    """A device array whose DLPack capsule says read-only (DLPack >= 1.0's flag), as a producer's may."""

    def __init__(self, array):
        self.array = array

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()

    def __dlpack__(self, **kwargs):
        capsule = self.array.__dlpack__(**kwargs)
        opened = _dlpack.open_capsule(capsule, "test")  # read, not consumed
        managed = _dlpack.DLManagedTensorVersioned.from_address(opened.managed_address)
        managed.flags |= _dlpack.DLPACK_FLAG_BITMASK_READ_ONLY
        return capsule


def test_a_cached_plan_does_not_pass_a_read_only_array(setup):
    """A read-only array with the layout of an accepted call must still be refused as one."""
    buf, cuda, device, inputs = setup
    out = dispatch_out(device, False)
    call = dict(num_max_dispatch_tokens_per_rank=T, num_experts=E, use_fp8=False)
    buf.dispatch(**inputs, **call, out=out)
    with pytest.raises(ValueError, match="dispatch: out recv_count is read-only"):
        buf.dispatch(**inputs, **call, out=(out[0], ReadOnlyExport(out[1])))
    with pytest.raises(ValueError, match="dispatch: active_ranks is read-only"):
        buf.dispatch(**dict(inputs, active_ranks=ReadOnlyExport(inputs["active_ranks"])), **call, out=out)
    assert len(cuda.launches) == 1


def test_the_same_addresses_with_larger_overlapping_arrays_are_checked_again(setup):
    """Disjointness is remembered per plan and addresses: the same pointers under another layout (x
    grown from 1 token over recv_count's memory) are not the set already found disjoint. Arrays that
    only touch are disjoint; one element in common is not."""
    buf, cuda, device, inputs = setup
    call = dict(num_max_dispatch_tokens_per_rank=T, num_experts=E, use_fp8=False)
    rows = device(np.zeros((E // R, R * T, H), ml_dtypes.bfloat16))
    memory = device(np.zeros(3 * H * 2, np.uint8))
    count = DeviceMemoryArray(memory.ptr + H * 2, (E // R,), "int32", "cuda", 0, owner=memory)  # after token 0
    one_token = DeviceMemoryArray(memory.ptr, (1, H), "bfloat16", "cuda", 0, owner=memory)
    topk = inputs["topk_idx"]
    topk_one = DeviceMemoryArray(topk.ptr, (1, 2), "int64", "cuda", 0, owner=topk)  # every pointer the same
    buf.dispatch(**dict(inputs, x=one_token, topk_idx=topk_one), **call, out=(rows, count))
    three_tokens = DeviceMemoryArray(memory.ptr, (3, H), "bfloat16", "cuda", 0, owner=memory)
    with pytest.raises(ValueError, match="dispatch: out recv_count shares memory with x"):
        buf.dispatch(**dict(inputs, x=three_tokens), **call, out=(rows, count))
    # Touching is not sharing (the first call), one element in common is.
    on_last_channels = DeviceMemoryArray(count.ptr - 4, (E // R,), "int32", "cuda", 0, owner=memory)
    with pytest.raises(ValueError, match="dispatch: out recv_count shares memory with x"):
        buf.dispatch(**dict(inputs, x=one_token, topk_idx=topk_one), **call, out=(rows, on_last_channels))
    assert len(cuda.launches) == 1


def test_the_overlap_rule_to_the_byte():
    """fp8 rows are single bytes: one byte in common is sharing, touching ends are not."""
    from types import SimpleNamespace

    from mooncake_ep.validation import check_disjoint

    at = SimpleNamespace
    check_disjoint("t", ("a", "b"), [at(ptr=100), at(ptr=110)], (10, 10), 1)  # [100, 110) and [110, 120)
    with pytest.raises(ValueError, match="t: a shares memory with b"):
        check_disjoint("t", ("a", "b"), [at(ptr=100), at(ptr=109)], (10, 10), 1)
    with pytest.raises(ValueError, match="t: a shares memory with b"):
        check_disjoint("t", ("a", "b"), [at(ptr=109), at(ptr=100)], (10, 10), 1)
    check_disjoint("t", ("a", "b"), [at(ptr=100), at(ptr=100)], (10, 0), 1)  # an empty array shares nothing


def test_a_timeout_past_int64_nanoseconds_is_refused_before_anything_changes(setup):
    buf, cuda, device, inputs = setup
    with pytest.raises(ValueError, match="dispatch: timeout_us must be <= "):
        buf.dispatch(**inputs, num_max_dispatch_tokens_per_rank=T, num_experts=E, use_fp8=False, timeout_us=10**16,
                     out=dispatch_out(device, False))
    assert cuda.launches == [] and buf._num_dispatches == 0


def test_out_arrays_sharing_memory_are_refused_whenever_their_addresses_change(setup):
    """The disjointness of out= arrays is checked once per set of addresses: a call with new ones,
    after an accepted call with the same layouts, is checked again."""
    buf, cuda, device, inputs = setup
    good = dispatch_out(device, False)
    for _ in range(2):  # the second call finds the addresses already checked
        buf.dispatch(**inputs, num_max_dispatch_tokens_per_rank=T, num_experts=E, use_fp8=False, out=good)
    recv_x, recv_count = good
    mask_in_count = DeviceMemoryArray(recv_count.ptr, (R,), "int32", "cuda", 0, owner=recv_count)
    with pytest.raises(ValueError, match="dispatch: out recv_count shares memory with active_ranks"):
        buf.dispatch(**dict(inputs, active_ranks=mask_in_count), num_max_dispatch_tokens_per_rank=T, num_experts=E,
                     use_fp8=False, out=good)
    rows = device(np.zeros((E // R, R * T, H), ml_dtypes.bfloat16))
    inside = DeviceMemoryArray(rows.ptr, (3, H), "bfloat16", "cuda", 0, owner=rows)  # x inside recv_x
    with pytest.raises(ValueError, match="dispatch: out recv_x shares memory with x"):
        buf.dispatch(**dict(inputs, x=inside), num_max_dispatch_tokens_per_rank=T, num_experts=E, use_fp8=False,
                     out=(rows, good[1]))
    assert len(cuda.launches) == 2 and buf._num_dispatches == 2


def test_calls_after_destroy_are_refused(setup):
    buf, cuda, device, inputs = setup
    _, _, handle, _, _ = buf.dispatch(**inputs, num_max_dispatch_tokens_per_rank=T, num_experts=E, use_fp8=False,
                                      out=dispatch_out(device, False))
    _, _, _, _, hook = buf.dispatch(**inputs, num_max_dispatch_tokens_per_rank=T, num_experts=E, use_fp8=False,
                                    return_recv_hook=True, out=dispatch_out(device, False))
    buf._cuda = None  # what destroy() leaves (the recording stand-in has no workspace to free)
    buf.destroy()
    with pytest.raises(RuntimeError, match="hook: this Buffer was destroyed"):
        hook()  # its receive half would launch on the freed workspace
    assert [l.phases for l in cuda.launches] == [SEND | RECV, SEND]
    for call in (lambda: buf.dispatch(**inputs, num_max_dispatch_tokens_per_rank=T, num_experts=E, use_fp8=False),
                 lambda: buf.combine(None, inputs["topk_idx"], device(np.ones((3, K), np.float32)),
                                     inputs["active_ranks"], -1, handle, zero_copy=True),
                 lambda: buf.get_next_combine_buffer(handle)):
        with pytest.raises(RuntimeError, match="this Buffer was destroyed"):
            call()


def test_device_arrays_whose_rows_move_as_vectors_must_start_on_16_bytes(setup):
    """A misaligned vector access would stop the kernel and poison the CUDA context: refused first."""
    buf, cuda, device, inputs = setup
    memory = device(np.zeros(3 * H + 8, ml_dtypes.bfloat16))
    shifted = DeviceMemoryArray(memory.ptr + 2, (3, H), "bfloat16", "cuda", 0, owner=memory)  # one bf16 in
    with pytest.raises(ValueError, match=r"dispatch: x starts at 0x[0-9a-f]+, not on a 16-byte boundary"):
        buf.dispatch(**dict(inputs, x=shifted), num_max_dispatch_tokens_per_rank=T, num_experts=E, use_fp8=False,
                     out=dispatch_out(device, False))
    recv_x, recv_count = dispatch_out(device, False)
    rows = device(np.zeros((E // R) * R * T * H + 8, ml_dtypes.bfloat16))
    shifted_rows = DeviceMemoryArray(rows.ptr + 8, recv_x.shape, "bfloat16", "cuda", 0, owner=rows)
    with pytest.raises(ValueError, match=r"dispatch: out recv_x starts at 0x[0-9a-f]+, not on a 16-byte boundary"):
        buf.dispatch(**inputs, num_max_dispatch_tokens_per_rank=T, num_experts=E, use_fp8=False,
                     out=(shifted_rows, recv_count))
    assert cuda.launches == [] and buf._num_dispatches == 0
    _, _, handle, _, _ = buf.dispatch(**inputs, num_max_dispatch_tokens_per_rank=T, num_experts=E, use_fp8=False,
                                      out=(recv_x, recv_count))
    weights = device(np.ones((3, K), np.float32))
    expert_out = device(np.zeros((E // R) * R * T * H + 8, ml_dtypes.bfloat16))
    for x, out, name in [(DeviceMemoryArray(expert_out.ptr + 4, recv_x.shape, "bfloat16", "cuda", 0, owner=expert_out),
                          device(np.zeros((3, H), ml_dtypes.bfloat16)), "x"),
                         (None, DeviceMemoryArray(memory.ptr + 6, (3, H), "bfloat16", "cuda", 0, owner=memory),
                          "out combined_x")]:
        with pytest.raises(ValueError, match=rf"combine: {name} starts at 0x[0-9a-f]+, not on a 16-byte boundary"):
            buf.combine(x, inputs["topk_idx"], weights, inputs["active_ranks"], -1, handle, zero_copy=x is None,
                        out=out)
    assert [launch.kernel for launch in cuda.launches] == ["dispatch"]


def test_device_arrays_must_start_on_a_multiple_of_their_element_size(setup, monkeypatch):
    """The kernels load ids, masks, counts, weights and scales element by element: an int64 at an
    address of 4 mod 8 would stop the kernel and poison the CUDA context. Refused first, with out=
    (checked once per set of addresses) and without (every call); nothing launched."""
    buf, cuda, device, inputs = setup
    # These arrays' producer is no framework that could make results: let the calls without out= go on.
    monkeypatch.setattr(ep.buffer, "check_allocatable", lambda where, name, view: None)

    def shifted(array: np.ndarray, offset_bytes: int) -> DeviceMemoryArray:
        """``array``'s values, offset_bytes past an aligned start."""
        backing = np.zeros(array.nbytes + 16, np.uint8)
        backing[offset_bytes:offset_bytes + array.nbytes] = np.frombuffer(array.tobytes(), np.uint8)
        memory = device(backing)
        assert memory.ptr % 16 == 0
        return DeviceMemoryArray(memory.ptr + offset_bytes, array.shape, array.dtype.name, "cuda", 0, owner=memory)

    kwargs = dict(num_max_dispatch_tokens_per_rank=T, num_experts=E, use_fp8=True)
    topk = np.array([[0, 5], [7, -1], [2, 3]], dtype=np.int64)
    cases = [("topk_idx", dict(topk_idx=shifted(topk, 4)), None, "8-byte int64"),
             ("active_ranks", dict(active_ranks=shifted(np.ones(R, np.int32), 1)), None, "4-byte int32"),
             ("out recv_count", {}, lambda out: (out[0], shifted(np.zeros(E // R, np.int32), 2)), "4-byte int32"),
             ("out recv_scales", {}, lambda out: ((out[0][0], shifted(np.zeros((E // R, R * T, H // 128), np.float32),
                                                                      2)), out[1]), "4-byte float32")]
    for name, arrays, make_out, what in cases:
        for out in ([dispatch_out(device, True)] if make_out else [None, dispatch_out(device, True)]):
            with pytest.raises(ValueError, match=rf"dispatch: {name} starts at 0x[0-9a-f]+, not on a multiple of its "
                                                 rf"{what} elements"):
                buf.dispatch(**(inputs | arrays), **kwargs, out=make_out(out) if make_out else out)
    assert cuda.launches == [] and buf._num_dispatches == 0
    _, _, handle, _, _ = buf.dispatch(**inputs, **kwargs, out=dispatch_out(device, True))
    weights = shifted(np.ones((3, K), np.float32), 2)
    for out in (None, device(np.zeros((3, H), ml_dtypes.bfloat16))):
        with pytest.raises(ValueError, match=r"combine: topk_weights starts at 0x[0-9a-f]+, not on a multiple of its "
                                             r"4-byte float32 elements"):
            buf.combine(None, inputs["topk_idx"], weights, inputs["active_ranks"], -1, handle, zero_copy=True, out=out)
    assert [launch.kernel for launch in cuda.launches] == ["dispatch"]


class StreamRecordingArray(DeviceMemoryArray):
    """A CUDA producer that notes the stream each export is made for (DLPack: the consumer's stream,
    which the producer makes wait for its pending writes)."""

    def __dlpack__(self, stream=None, **kwargs):
        self.streams.append(stream)
        return super().__dlpack__(stream, **kwargs)


def stream_recording(array: DeviceMemoryArray) -> StreamRecordingArray:
    recording = StreamRecordingArray(array.ptr, array.shape, array.dtype, "cuda", 0, owner=array)
    recording.streams = []
    return recording


class CudaStreamProtocol:
    """A stream of the CUDA stream protocol (``__cuda_stream__``, as cuda.core's and others' are)."""

    def __init__(self, handle: int, protocol=None):
        self.handle, self.protocol = handle, protocol

    def __cuda_stream__(self):
        return (0, self.handle) if self.protocol is None else self.protocol


def test_stream_is_the_launch_stream_and_the_arrays_are_exported_for_it(setup, monkeypatch):
    """stream=: both halves and the combine launch there, not on the framework's current stream (the
    legacy stream for DLPack producers), and every array is exported for it, x too, so its producer
    orders its pending writes before the launch."""
    buf, cuda, device, inputs = setup
    arrays = {name: stream_recording(array) for name, array in inputs.items()}
    kwargs = dict(num_max_dispatch_tokens_per_rank=T, num_experts=E, use_fp8=False)
    torch_like, cupy_like = CudaStreamProtocol(0xAB), CudaStreamProtocol(0xCD)
    _, _, handle, _, hook = buf.dispatch(*arrays.values(), **kwargs, return_recv_hook=True,
                                         out=dispatch_out(device, False), stream=torch_like)
    hook()
    assert all(array.streams == [0xAB] for array in arrays.values()), {k: a.streams for k, a in arrays.items()}
    weights = stream_recording(device(np.ones((3, K), np.float32)))
    buf.combine(None, arrays["topk_idx"], weights, arrays["active_ranks"], -1, handle, zero_copy=True,
                out=device(np.zeros((3, H), ml_dtypes.bfloat16)), stream=cupy_like)
    assert weights.streams == [0xCD]
    buf.dispatch(**inputs, **kwargs, out=dispatch_out(device, False), stream=0x5EED)
    assert [(l.kernel, l.phases, l.stream) for l in cuda.launches] == [
        ("dispatch", SEND, 0xAB), ("dispatch", RECV, 0xAB), ("combine", SEND | RECV, 0xCD),
        ("dispatch", SEND | RECV, 0x5EED)]
    # 1 is the legacy default stream's other name: launched as 0, where the framework's own calls go.
    buf.dispatch(**inputs, **kwargs, out=dispatch_out(device, False), stream=1)
    assert cuda.launches[-1].stream == 0
    # Refused before anything is launched or counted, naming the argument:
    memory_pointer = type("MemoryPointer", (), {"ptr": 0xCD})()  # a .ptr is not a stream (cupy's arr.data)
    for stream, error, message in (("s", TypeError, r"dispatch: stream must be a torch.cuda.Stream, a "
                                                      r"cupy.cuda.Stream, a __cuda_stream__ object or a "
                                                      r"cudaStream_t as an int, got str"),
                                   (True, TypeError, r"dispatch: stream must be .* got bool"),
                                   (memory_pointer, TypeError, r"dispatch: stream must be .* got MemoryPointer"),
                                   (CudaStreamProtocol("0xAB"), TypeError, r"dispatch: stream's handle must be an int, got str"),
                                   (CudaStreamProtocol(0xAB, protocol=0xAB), TypeError,
                                    r"dispatch: stream.__cuda_stream__\(\) must return \(version, handle\), got 171"),
                                   (-2, ValueError, r"dispatch: stream must name a CUDA stream .* got -2"),
                                   (1 << 63, ValueError, r"dispatch: stream must name a CUDA stream .* got 9223372036854775808"),
                                   (2, ValueError, r"dispatch: stream 2 is the per-thread default stream, another "
                                                   r"stream in each thread"),
                                   (CudaStreamProtocol(2), ValueError, r"dispatch: stream 2 is the per-thread")):
        with pytest.raises(error, match=message):
            buf.dispatch(**inputs, **kwargs, out=dispatch_out(device, False), stream=stream)
    host = dict(x=np.zeros((3, H), ml_dtypes.bfloat16), topk_idx=np.zeros((3, K), np.int64),
                active_ranks=np.ones(R, np.int32))
    with pytest.raises(ValueError, match=r"dispatch: stream is for CUDA arrays; x is a host array"):
        buf.dispatch(**host, **kwargs, stream=0xAB)
    buf._device_id = 0
    # A cupy stream of another device (cupy itself needs a GPU: a stand-in module for the type check).
    fake_stream_type = type("Stream", (), {"ptr": 0xAB, "device_id": 1})
    fake_cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(Stream=fake_stream_type, ExternalStream=fake_stream_type))
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy)
    with pytest.raises(ValueError, match=r"dispatch: stream is a stream of cuda:1, this Buffer's rank uses cuda:0"):
        buf.dispatch(**inputs, **kwargs, out=dispatch_out(device, False), stream=fake_stream_type())
    # cupy's null stream and an ExternalStream made without a device report -1: no device to compare.
    fake_cupy.cuda.ExternalStream = type("ExternalStream", (), {"ptr": 0xEE, "device_id": -1})
    buf.dispatch(**inputs, **kwargs, out=dispatch_out(device, False), stream=fake_cupy.cuda.ExternalStream())
    assert cuda.launches[-1].stream == 0xEE
    monkeypatch.delitem(sys.modules, "cupy")
    # torch.accelerator's streams (torch.Stream): a CUDA one of another device, and a CPU one, refused.
    torch = pytest.importorskip("torch")
    with pytest.raises(ValueError, match=r"dispatch: stream is a stream of cuda:1, this Buffer's rank uses cuda:0"):
        buf.dispatch(**inputs, **kwargs, out=dispatch_out(device, False),
                     stream=torch.Stream(stream_id=5, device_index=1, device_type=1))
    with pytest.raises(TypeError, match=r"dispatch: stream is a torch stream of device type 'cpu', not CUDA"):
        buf.dispatch(**inputs, **kwargs, out=dispatch_out(device, False),
                     stream=torch.Stream(stream_id=0, device_index=-1, device_type=0))
    capsule = inputs["x"].__dlpack__()  # a refused stream leaves a bare capsule unread
    with pytest.raises(TypeError, match=r"dispatch: stream must be"):
        buf.dispatch(capsule, inputs["topk_idx"], inputs["active_ranks"], **kwargs, stream="s")
    assert _dlpack._PyCapsule_GetName(capsule) == b"dltensor"
    assert len(cuda.launches) == 6 and buf._num_dispatches == 4
    # async_finish: the event makes the given stream wait, not the framework's current one (0 here).
    _, _, _, event, _ = buf.dispatch(**inputs, **kwargs, async_finish=True, out=dispatch_out(device, False),
                                     stream=0xAB)
    assert cuda.launches[-1].stream == COMM_STREAM and cuda.waits[-1] == (COMM_STREAM, ("event", 0xAB))
    event.current_stream_wait()
    assert cuda.waits[-1] == (0xAB, ("event", COMM_STREAM))


def test_the_launch_stream_waits_once_for_each_other_frameworks_current_stream(setup, monkeypatch):
    """torch and cupy arrays are read directly, ordering nothing: before a launch on another stream than
    their framework's current one (stream=, or arrays of two frameworks in one call) the launch stream
    waits for that stream, once per framework: for their writes of the inputs and for the earlier use of
    fresh results' memory. Host arrays and other DLPack producers (ordered on export) add no wait. It
    answers the frameworks whose arrays are off their allocators' streams: torch and cupy where it
    waited, other producers than the launch framework (their allocators' streams unknown). The call
    then keeps those arrays alive (record_stream, or held) as with stream=."""
    buf, cuda, _, _ = setup
    monkeypatch.setattr(frameworks.get("torch"), "current_stream", lambda device_id: 0x70)
    monkeypatch.setattr(frameworks.get("cupy"), "current_stream", lambda device_id: 0xC0)

    def view(framework, device_type="cuda"):
        return ArrayView(None, 0x1000, (1,), (1,), "int32", device_type, 0, framework, None)

    assert buf._wait_for_writers(0xAB, None, (view("torch"), view("torch"), None, view("cupy"), view("numpy", "cpu"),
                                              view("dlpack"), view("cupy"))) == {"torch", "cupy", "dlpack"}
    assert cuda.waits == [(0xAB, ("event", 0x70)), (0xAB, ("event", 0xC0))]
    cuda.waits.clear()
    assert buf._wait_for_writers(0x70, "torch", (view("torch"), view("cupy"))) == {"cupy"}  # on torch's stream
    assert cuda.waits == [(0x70, ("event", 0xC0))]
    cuda.waits.clear()
    # zero-copy's buffer, written with torch: cupy's current stream is the launch stream, cupy's arrays on it
    assert buf._wait_for_writers(0xC0, None, (view("cupy"),), ("torch",)) == {"torch"}
    assert cuda.waits == [(0xC0, ("event", 0x70))]
    cuda.waits.clear()
    cuda.waits.clear()
    cuda.capturing = True  # a captured graph cannot wait for uncaptured work: the caller orders its replays
    assert buf._wait_for_writers(0xAB, None, (view("torch"), view("cupy"))) == {"torch", "cupy"}
    assert cuda.waits == []
    cuda.capturing = False
    # One framework, one stream: no wait, and the call's arrays stay on their allocator's stream.
    assert not buf._wait_for_writers(0x70, "torch", (view("torch"),), ("torch",))
    # stream= torch's own: no wait; another DLPack producer's arrays are off their allocator's stream
    assert buf._wait_for_writers(0x70, None, (view("torch"), view("dlpack"))) == {"dlpack"}
    assert cuda.waits == []


def test_arrays_of_a_call_on_another_stream_live_until_its_kernels_are_done(setup):
    """A call launched on another stream than its arrays' allocator's (stream=, async_finish; any
    call of another DLPack producer's arrays) holds the arrays until an event on the launch stream is
    done (torch's too with async_finish: record_stream protects only torch's own memory), even when the
    caller drops them and the returned event at once: a pool would otherwise hand their memory to new
    work that nothing orders after the kernels. In hook mode they are held from the call until the
    receive half, launched by hook(), is done. Done events let go at the next call, one that holds
    nothing too; under capture nothing is held and nothing let go (a graph's arrays are the caller's to
    keep, and an event query would end the capture)."""
    buf, cuda, device, inputs = setup
    kwargs = dict(num_max_dispatch_tokens_per_rank=T, num_experts=E, use_fp8=False)

    class Memory:  # what bounds x's memory: its exports hold it
        pass

    def dropped_call(**options):
        """A dispatch whose x the caller drops at once; a weak reference to x's memory, and the hook."""
        memory = Memory()
        x = DeviceMemoryArray(inputs["x"].ptr, inputs["x"].shape, inputs["x"].dtype, "cuda", 0, owner=memory)
        alive = weakref.ref(memory)
        hook = buf.dispatch(x, inputs["topk_idx"], inputs["active_ranks"], **kwargs,
                            out=dispatch_out(device, False), **options)[-1]
        del x, memory
        return alive, hook

    alive, _ = dropped_call(stream=0xAB)
    gc.collect()
    assert alive() is not None and len(buf._in_flight) == 1
    assert buf._in_flight[0][0] == ("event", 0xAB)
    cuda.done_events = True
    later, _ = dropped_call(async_finish=True)  # lets go of the done one, holds its own on the comm stream
    gc.collect()
    assert alive() is None and later() is not None and [event for event, _ in buf._in_flight] == [("event", COMM_STREAM)]
    cuda.done_events = False
    hooked, hook = dropped_call(stream=0xAB, return_recv_hook=True)
    gc.collect()
    assert hooked() is not None and len(buf._in_flight) == 1, "held by the hook until it runs"
    hook()
    del hook
    gc.collect()
    assert hooked() is not None and [event for event, _ in buf._in_flight] == [("event", COMM_STREAM),
                                                                               ("event", 0xAB)]
    cuda.done_events, cuda.capturing = True, True
    captured, _ = dropped_call(stream=0xAB)
    gc.collect()
    assert captured() is None, "nothing held under capture: a graph's arrays are the caller's to keep"
    assert len(buf._in_flight) == 2, "nor let go: an event query would end the capture"
    cuda.capturing = False
    buf.dispatch(**inputs, **kwargs, out=dispatch_out(device, False))  # the next call lets go of what is done
    gc.collect()
    # ...and holds its own arrays: another DLPack producer's, launched on the legacy default stream (as
    # with stream=, nothing orders their allocator's reuse of the memory after the kernels).
    assert [event for event, _ in buf._in_flight] == [("event", 0)] and hooked() is None and later() is None
    dropped_call(stream=0xAB)
    buf._cuda = None  # destroy() without the backend's collective
    buf.destroy()
    assert not buf._in_flight


def test_in_process_ranks_on_one_gpu_making_one_call_on_one_stream_are_refused(setup):
    """torch and cupy callers too, as JAX's: a rank's receive half would wait for a peer's send queued
    behind it on the shared stream, until the timeout masked a healthy peer. The Buffer is rank 0 of a
    LocalGroup whose rank 1 made the same call on the legacy stream (0), the caller's stream here."""
    buf, cuda, device, inputs = setup
    local = ep.LocalGroup(R)
    rank0, rank1 = (ep.group.LocalRankGroup(local, rank) for rank in range(R))
    buf._claim_stream = rank0.claim_stream
    call = lambda n: (buf._token, n)  # noqa: E731 - the n-th call of this Buffer, on every rank
    assert rank1.claim_stream(1, CALLER_STREAM, call(0)) is None, "another device's legacy stream is another"
    assert rank1.claim_stream(0, CALLER_STREAM, call(0)) is None
    kwargs = dict(num_max_dispatch_tokens_per_rank=T, num_experts=E, use_fp8=False)
    for hook_mode in (False, True):
        with pytest.raises(ValueError, match=r"dispatch: rank 0 calls on stream 0x0 of cuda:0, where rank 1 of "
                                             r"this process made the same call; ranks sharing a stream "
                                             r"serialise.*Give each rank a stream of its own"):
            buf.dispatch(**inputs, **kwargs, return_recv_hook=hook_mode, out=dispatch_out(device, False))
    assert buf._num_dispatches == 0 and cuda.launches == [], "refused before a launch"
    # Captured, it runs nothing: where its graph replays is the caller's choice.
    cuda.capturing = True
    buf.dispatch(**inputs, **kwargs, out=dispatch_out(device, False))
    cuda.capturing = False
    # async_finish launches on the rank's own communication stream: accepted.
    rank1.claim_stream(0, CALLER_STREAM, call(1))
    _, _, handle, _, _ = buf.dispatch(**inputs, **kwargs, async_finish=True, out=dispatch_out(device, False))
    assert [launch.stream for launch in cuda.launches] == [CALLER_STREAM, COMM_STREAM]
    # Another call may follow rank 1's on the stream (ranks that swap streams between steps): it waits
    # only for its own call's peers. Rank 1's same call then is refused there.
    combined = device(np.zeros((3, H), ml_dtypes.bfloat16))
    buf.combine(None, inputs["topk_idx"], device(np.ones((3, K), np.float32)), inputs["active_ranks"],
                handle=handle, zero_copy=True, out=combined)
    assert cuda.launches[-1].stream == CALLER_STREAM and rank1.claim_stream(0, CALLER_STREAM, call(2)) == 0


def test_an_in_process_dispatch_whose_arguments_differ_from_a_peers_same_call_is_refused(setup):
    """The kernels of in-process ranks check no configuration: a rank whose T (or hidden, experts,
    fp8 flags) differs from its peers' finds their regions at the wrong offsets. The Buffer is rank 0;
    rank 1 of its LocalGroup made most calls first. A refused call launches nothing and uses no
    dispatch number; the same call with rank 1's arguments then runs. A rank compares the first
    dispatch of each configuration."""
    buf, cuda, device, inputs = setup
    local = ep.LocalGroup(R)
    rank0, rank1 = (ep.group.LocalRankGroup(local, rank) for rank in range(R))
    buf._call_claims = rank0

    def call(tokens=T, use_fp8=False):  # as Buffer._claim_dispatch describes a dispatch
        return tokens, H, E, use_fp8, False, False

    def peer_dispatches(number, **arguments):
        assert rank1.claim_call((buf._token, "dispatch", number), call(**arguments)) is None

    peer_dispatches(0, tokens=T - 1)
    kwargs = dict(num_max_dispatch_tokens_per_rank=T, num_experts=E, use_fp8=False)
    with pytest.raises(ep.RankMismatchError, match=r"dispatch: rank 1 of this process made dispatch number 0 of this "
                                                   rf"Buffer with num_max_dispatch_tokens_per_rank {T - 1}, this rank "
                                                   rf"with {T}; .*Nothing was launched here; rank 1's kernel waits "
                                                   r"for this rank's dispatch forever \(timeout_us=-1\)"):
        buf.dispatch(**inputs, **kwargs, out=dispatch_out(device, False))
    assert buf._num_dispatches == 0 and cuda.launches == []
    with pytest.raises(ep.RankMismatchError, match=r"with num_max_dispatch_tokens_per_rank"):  # a retry, alike
        buf.dispatch(**inputs, **kwargs, out=dispatch_out(device, False))
    buf.dispatch(**inputs, **(kwargs | dict(num_max_dispatch_tokens_per_rank=T - 1)),
                 out=dispatch_out(device, False, T - 1))
    assert buf._num_dispatches == 1 and [launch.kernel for launch in cuda.launches] == ["dispatch"]

    peer_dispatches(1, use_fp8=True)  # staged fp8, which a bf16 receiver would read as bf16
    with pytest.raises(ep.RankMismatchError, match=r"made dispatch number 1 of this Buffer with use_fp8 True, this "
                                                   r"rank with False"):
        buf.dispatch(**inputs, **kwargs, out=dispatch_out(device, False))
    buf.dispatch(**inputs, **(kwargs | dict(use_fp8=True)), out=dispatch_out(device, True))
    assert buf._num_dispatches == 2 and len(cuda.launches) == 2
    # This rank first: the peer's same call is compared with it, and the peer's other call is refused.
    buf.dispatch(**inputs, **kwargs, out=dispatch_out(device, False))
    assert rank1.claim_call((buf._token, "dispatch", 2), call(T)) is None
    assert rank1.claim_call((buf._token, "dispatch", 2), call(T + 1)) == (0, call(T))
    # A configuration this rank launched before is not compared again (no host cost per call; ranks in
    # processes check each configuration once too): a peer's other arguments then go unseen.
    assert rank1.claim_call((buf._token, "dispatch", 3), call(T + 1)) is None
    buf.dispatch(**inputs, **kwargs, out=dispatch_out(device, False))
    assert buf._num_dispatches == 4

    # A call that fails after the comparison (here at the layout) withdraws its note, so the peer's
    # same call with other arguments is not refused against a call that never ran.
    fp8_fewer_rows = dict(kwargs, num_max_dispatch_tokens_per_rank=T - 1, use_fp8=True)
    cuda.layout_for = lambda *arguments: (_ for _ in ()).throw(ValueError("the most configurations"))
    with pytest.raises(ValueError, match="the most configurations"):
        buf.dispatch(**inputs, **fp8_fewer_rows, out=dispatch_out(device, True, T - 1))
    del cuda.layout_for
    assert rank1.claim_call((buf._token, "dispatch", 4), call(use_fp8=True)) is None
    with pytest.raises(ep.RankMismatchError, match=r"waits for this rank's dispatch until its timeout_us masks this "
                                                   r"rank: make it with rank 1's arguments"):
        buf.dispatch(**inputs, **fp8_fewer_rows, timeout_us=5000, out=dispatch_out(device, True, T - 1))
    buf.dispatch(**inputs, **(kwargs | dict(use_fp8=True)), out=dispatch_out(device, True))
    assert buf._num_dispatches == 5 and len(cuda.launches) == 5


def test_a_note_a_peer_launched_against_outlives_the_first_ranks_failed_call(setup, monkeypatch):
    """Rank 0 notes dispatch 0 with T; rank 1 makes it alike and launches; rank 0's call then fails
    before its launch (its results' allocation). Rank 1's kernel runs with T, so rank 0's note must
    stay: its retry with another T is refused, naming rank 1, and the retry with T runs. Where both
    failed before launching, both may make the call again with other arguments."""
    buf, cuda, device, inputs = setup
    # These arrays' producer is no framework that could make results: let the call reach the allocation.
    monkeypatch.setattr(ep.buffer, "check_allocatable", lambda where, name, view: None)
    local = ep.LocalGroup(R)
    rank0, rank1 = (ep.group.LocalRankGroup(local, rank) for rank in range(R))
    buf._call_claims = rank0
    allocate = buf._allocate

    def peer_launches_then_out_of_memory(plan, like):
        assert rank1.claim_call((buf._token, "dispatch", 0), (T, H, E, False, False, False)) is None
        rank1.confirm_call((buf._token, "dispatch", 0), (T, H, E, False, False, False))
        raise MemoryError("out of memory")
    buf._allocate = peer_launches_then_out_of_memory
    kwargs = dict(num_max_dispatch_tokens_per_rank=T, num_experts=E, use_fp8=False)
    with pytest.raises(MemoryError):
        buf.dispatch(**inputs, **kwargs)
    buf._allocate = allocate
    assert buf._num_dispatches == 0 and cuda.launches == []
    with pytest.raises(ep.RankMismatchError, match=rf"rank 1 of this process made dispatch number 0 of this Buffer "
                                                   rf"with num_max_dispatch_tokens_per_rank {T}, this rank with "
                                                   rf"{T - 1}"):
        buf.dispatch(**inputs, **(kwargs | dict(num_max_dispatch_tokens_per_rank=T - 1)),
                     out=dispatch_out(device, False, T - 1))
    buf.dispatch(**inputs, **kwargs, out=dispatch_out(device, False))
    assert buf._num_dispatches == 1 and len(cuda.launches) == 1
    # A note no peer launched against is withdrawn: the ranks may then all make the call otherwise.
    rank1.claim_call((buf._token, "dispatch", 1), (T, H, E, True, False, False))
    rank1.withdraw_call((buf._token, "dispatch", 1), (T, H, E, True, False, False))
    buf.dispatch(**inputs, **(kwargs | dict(num_max_dispatch_tokens_per_rank=T - 1)),
                 out=dispatch_out(device, False, T - 1))
    assert buf._num_dispatches == 2
    # The peer matched and is on its way when this rank fails: its retry with other arguments is
    # refused until the peer withdraws too (it failed as well); then both may call otherwise.
    fp8, name = (T, H, E, True, False, False), (buf._token, "dispatch", 2)

    def peer_matches_then_out_of_memory(plan, like):
        assert rank1.claim_call(name, fp8) is None
        raise MemoryError("out of memory")
    buf._allocate = peer_matches_then_out_of_memory
    with pytest.raises(MemoryError):
        buf.dispatch(**inputs, **(kwargs | dict(use_fp8=True)))
    buf._allocate = allocate
    fewer_rows = dict(kwargs, num_max_dispatch_tokens_per_rank=T - 1, use_fp8=True)
    with pytest.raises(ep.RankMismatchError, match=r"rank 1 of this process made dispatch number 2 of this Buffer "
                                                   rf"with num_max_dispatch_tokens_per_rank {T}, this rank with "
                                                   rf"{T - 1}"):
        buf.dispatch(**inputs, **fewer_rows, out=dispatch_out(device, True, T - 1))
    rank1.withdraw_call(name, fp8)
    buf.dispatch(**inputs, **fewer_rows, out=dispatch_out(device, True, T - 1))
    assert rank1.claim_call(name, (T - 1, H, E, True, False, False)) is None
    assert rank1.claim_call(name, fp8) == (0, (T - 1, H, E, True, False, False))
    assert buf._num_dispatches == 3


def test_device_memory_of_an_unknown_dlpack_producer_needs_out(setup):
    """Without out= a call makes its results in its arrays' framework; device memory of another DLPack
    producer has none that could. Refused with the plan, before the configuration is agreed on (with
    ipc, a collective) or anything launched; a zero-copy buffer comes back as a DeviceMemoryArray."""
    buf, cuda, device, inputs = setup
    kwargs = dict(num_max_dispatch_tokens_per_rank=T, num_experts=E, use_fp8=False)
    with pytest.raises(TypeError, match=r"dispatch: x is cuda memory of a DLPack producer mooncake_ep cannot make "
                                        r"results for .*; pass out=, or torch, cupy or JAX arrays"):
        buf.dispatch(**inputs, **kwargs)
    assert cuda.agreed == [] and cuda.launches == [] and buf._num_dispatches == 0
    _, _, handle, _, _ = buf.dispatch(**inputs, **kwargs, out=dispatch_out(device, False))
    with pytest.raises(TypeError, match=r"combine: topk_idx is cuda memory of a DLPack producer"):
        buf.combine(None, inputs["topk_idx"], device(np.ones((3, K), np.float32)), inputs["active_ranks"],
                    handle=handle, zero_copy=True)
    combine_buffer = buf.get_next_combine_buffer(handle)
    assert isinstance(combine_buffer, DeviceMemoryArray) and combine_buffer.shape == (E // R, R * T, H)
    assert combine_buffer.ptr == buf._combine_buffer_ptr(handle) and combine_buffer.device_type == "cuda"
    assert [launch.kernel for launch in cuda.launches] == ["dispatch"]


def test_ranks_in_processes_agree_on_each_configuration_at_its_first_dispatch_before_anything_is_launched(setup):
    """Ranks in processes (no claim_call) check a dispatch's configuration with their peers in a
    collective (CudaBackend.agree_on) at its first use: T, hidden, num_experts and each fp8 flag make
    a configuration. A refused one launches nothing, uses no dispatch number and is not kept."""
    buf, cuda, device, inputs = setup
    assert buf._call_claims is None
    kwargs = dict(num_max_dispatch_tokens_per_rank=T, num_experts=E)
    for use_fp8 in (False, True, False, True):
        buf.dispatch(**inputs, **kwargs, use_fp8=use_fp8, out=dispatch_out(device, use_fp8))
    bf16, fp8 = (T, H, E, False, False, False), (T, H, E, True, False, False)
    assert cuda.agreed == [bf16, fp8] and buf._num_dispatches == 4

    def refuse(configuration, where="dispatch"):
        cuda.agreed.append(configuration)
        raise ep.RankMismatchError(f"{where}: ranks disagree on round_scale")
    cuda.agree_on = refuse
    with pytest.raises(ep.RankMismatchError, match="dispatch: ranks disagree on round_scale"):
        buf.dispatch(**inputs, **kwargs, use_fp8=True, round_scale=True, out=dispatch_out(device, True))
    assert buf._num_dispatches == 4 and len(cuda.launches) == 4
    del cuda.agree_on
    buf.dispatch(**inputs, **kwargs, use_fp8=True, round_scale=True, out=dispatch_out(device, True))
    assert cuda.agreed[2:] == [(T, H, E, True, True, False)] * 2, "asked again after the refusal"
    assert buf._num_dispatches == 5 and len(cuda.launches) == 5


def test_a_configuration_agreed_ahead_makes_no_collective_at_its_first_dispatch(setup):
    """torch's backward rebuilds a bf16 dispatch's routing in fp8: its forward agrees on that
    configuration too (_agree_ahead), while every rank is alive, so that the first backward holds no
    collective a dead rank would turn into a GroupError. In-process ranks compare at the call instead."""
    buf, cuda, device, inputs = setup
    fp8 = (T, H, E, True, False, False)
    buf._agree_ahead(T, H, E, use_fp8=True, round_scale=False, use_ue8m0=False, where="mooncake_ep.torch.dispatch")
    buf._agree_ahead(T, H, E, use_fp8=True, round_scale=False, use_ue8m0=False, where="mooncake_ep.torch.dispatch")
    assert cuda.agreed == [fp8]
    buf.dispatch(**inputs, num_max_dispatch_tokens_per_rank=T, num_experts=E, use_fp8=True,
                 out=dispatch_out(device, True))
    assert cuda.agreed == [fp8] and len(cuda.launches) == 1
    buf._call_claims = ep.group.LocalRankGroup(ep.LocalGroup(R), 0)
    buf._agree_ahead(T, H, E, use_fp8=False, round_scale=False, use_ue8m0=False, where="mooncake_ep.torch.dispatch")
    assert cuda.agreed == [fp8]


def test_claim_call_remembers_the_latest_calls_only():
    local = ep.LocalGroup(2)
    rank0, rank1 = (ep.group.LocalRankGroup(local, rank) for rank in range(2))
    kept = ep.group._CALLS_KEPT
    for number in range(kept + 1):
        assert rank0.claim_call(("Buffer", number), (("T", 8),)) is None
    assert rank1.claim_call(("Buffer", 0), (("T", 16),)) is None, "the oldest call is forgotten"
    assert rank1.claim_call(("Buffer", 2), (("T", 16),)) == (0, (("T", 8),))
    assert len(local._calls) == kept
    # A call retried after failures is one name in the order, not one per try: it ages out with its turn.
    for _ in range(2 * kept):
        assert rank0.claim_call(("Buffer", "retried"), (("T", 8),)) is None
        rank0.withdraw_call(("Buffer", "retried"), (("T", 8),))
    assert rank0.claim_call(("Buffer", "retried"), (("T", 8),)) is None
    assert rank1.claim_call(("Buffer", "retried"), (("T", 16),)) == (0, (("T", 8),))
    assert rank1.claim_call(("Buffer", kept), (("T", 16),)) == (0, (("T", 8),)), "the others stay"
    assert len(local._calls) == kept


def test_the_per_thread_default_stream_is_each_threads_own():
    import threading

    local = ep.LocalGroup(2)
    rank0, rank1 = (ep.group.LocalRankGroup(local, rank) for rank in range(2))
    assert rank0.claim_stream(0, 2, "call 0") is None
    other = []
    thread = threading.Thread(target=lambda: other.append(rank1.claim_stream(0, 2, "call 0")))
    thread.start()
    thread.join()
    assert other == [None]
    assert rank1.claim_stream(0, 2, "call 0") == 0, "one thread driving both ranks shares its per-thread stream"


def test_allocating_calls_check_their_inputs_addresses_once_and_refuse_an_overlap_a_plan_already_has(setup,
                                                                                                     monkeypatch):
    """A dispatch or combine that allocates its results remembers the addresses of inputs it found
    disjoint and aligned, as one with out= does: the same arrays again cost one lookup. An
    active_ranks inside x, with the layouts of a remembered plan, is still refused (the kernels write
    the mask while they read x), and nothing is launched."""
    torch = pytest.importorskip("torch")
    from mooncake_ep import tensor as tensor_module

    class ReportsCuda(torch.Tensor):  # host memory that reads as cuda:0 (nothing dereferences it here)
        __torch_function__ = torch._C._disabled_torch_function_impl
        is_cuda = property(lambda self: True)

        def get_device(self) -> int:
            return 0

    def on_device(array: torch.Tensor) -> torch.Tensor:
        return array.as_subclass(ReportsCuda)

    buf, cuda, _, _ = setup
    tensor_module._torch()
    monkeypatch.setattr(tensor_module, "_torch_stream", [lambda device_id: 0])
    torch_framework = frameworks.get("torch")
    monkeypatch.setattr(torch_framework, "current_stream", lambda device_id: 0)
    real_empty = torch_framework.empty
    monkeypatch.setattr(torch_framework, "empty",
                        lambda shape, dtype, device_type, device_id: on_device(real_empty(shape, dtype, "cpu", 0)))
    x = on_device(torch.randn(3, H).to(torch.bfloat16))
    topk = on_device(torch.tensor([[0, 5], [7, -1], [2, 3]]))
    active = on_device(torch.ones(R, dtype=torch.int32))
    checks = []
    real_check = ep.Buffer._check_disjoint
    monkeypatch.setattr(ep.Buffer, "_check_disjoint", lambda self, where, *args: (checks.append(where),
                                                                                   real_check(self, where, *args)))
    kwargs = dict(num_max_dispatch_tokens_per_rank=T, num_experts=E, use_fp8=False)
    expert_out, weights = on_device(torch.zeros(E // R, R * T, H, dtype=torch.bfloat16)), on_device(torch.ones(3, K))
    for _ in range(2):
        _, _, handle, _, _ = buf.dispatch(x, topk, active, **kwargs)
        buf.combine(expert_out, topk, weights, active, handle=handle)
    assert checks == ["dispatch", "combine"], "the second calls' addresses were found good before"
    launched = len(cuda.launches)
    inside_x = on_device(x.view(torch.int32)[0, :R])  # the layouts of the remembered plan
    with pytest.raises(ValueError, match=r"^dispatch: active_ranks shares memory with x"):
        buf.dispatch(x, topk, inside_x, **kwargs)
    assert len(cuda.launches) == launched


def test_the_recv_layout_range_view_is_made_once_per_parity_and_holds_no_buffer(setup):
    """The autograd functions read each dispatch's per-source row ranges: a view of the workspace's
    recv_range of its parity, wrapped once (a new wrap cost ~12 us a call, review), and owned by the
    workspace, not by the Buffer that keeps it (a cycle would leave a dropped Buffer to the collector)."""
    buf, cuda, device, inputs = setup
    handles = [buf.dispatch(**inputs, num_max_dispatch_tokens_per_rank=T, num_experts=E, use_fp8=False,
                            out=dispatch_out(device, False))[2] for _ in range(2)]
    views = [buf._recv_layout_range("test", handle) for handle in handles]
    assert buf._recv_layout_range("test", handles[0]) is views[0] and views[0] is not views[1]
    workspace_layout, _ = cuda.layout_for(T, H, E)
    for parity, view in enumerate(views):
        assert view.ptr == cuda.workspace.ptr + workspace_layout.offsets["recv_range"][parity]
        assert view.shape == (E // R, R, 2) and view.dtype == "int32"
        assert buf not in gc.get_referents(view)
