"""Frameworks together, on the CPU: a mixed torch/JAX step, and cupy's raw-bits form through Buffer.

A torch dispatch, JAX experts reading recv_x through DLPack (no copy), and a torch combine of the
JAX result must equal the reference step. cupy has no bf16/fp8 dtype, so its callers pass and get
uint16/uint8 arrays of the same bits; without a GPU that path is checked on a recording stand-in
for the CUDA backend, with host memory presented as a cupy array on cuda:0.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import mooncake_ep as ep
from mooncake_ep import _dlpack, frameworks, layout, reference
from mooncake_ep.tensor import DeviceMemoryArray, DLDevice, DLDeviceType, DLManagedTensor

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

BF16 = np.dtype(ml_dtypes.bfloat16)


def test_torch_dispatch_jax_experts_torch_combine_equal_the_reference():
    R, T, H, E, K = 2, 4, 256, 4, 2
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((T, H)).astype(BF16) for _ in range(R)]
    topks = [np.array([rng.permutation(E)[:K] for _ in range(T)], np.int64) for _ in range(R)]
    weights = [rng.random((T, K), dtype=np.float32) for _ in range(R)]
    scale = jnp.asarray(rng.standard_normal(H).astype(np.float32))

    def jax_experts(recv_x):
        return (recv_x.astype(jnp.float32) * scale).astype(jnp.bfloat16)

    def rank_fn(group):
        r = group.rank
        buffer = ep.Buffer(group, ep.Buffer.get_ep_buffer_size_hint(T, H, R, E), backend="reference")
        x = torch.from_numpy(xs[r].view(np.uint16)).view(torch.bfloat16)
        topk, w = torch.from_numpy(topks[r]), torch.from_numpy(weights[r])
        active = torch.ones(R, dtype=torch.int32)
        recv_x, _, handle, _, _ = buffer.dispatch(x, topk, active, T, E, use_fp8=False)
        assert isinstance(recv_x, torch.Tensor)
        with jax.default_device(jax.devices("cpu")[0]):
            y = jax_experts(jax.dlpack.from_dlpack(recv_x))  # the JAX experts read torch's memory
        expert_out = torch.from_dlpack(y)  # and torch reads JAX's
        assert expert_out.dtype == torch.bfloat16
        combined, _, _ = buffer.combine(expert_out, topk, w, active, -1, handle)
        return combined.view(torch.uint16).numpy().view(BF16)

    got = ep.LocalGroup(R, timeout_s=30).spawn(rank_fn)
    actives = [np.ones(R, np.int32)] * R
    dispatched = [reference.dispatch(r, xs, topks, actives, T, E, use_fp8=False) for r in range(R)]
    outs = [np.asarray(jax_experts(jnp.asarray(d.recv_x))) for d in dispatched]
    for r in range(R):
        want, _ = reference.combine(r, outs, dispatched, topks[r], weights[r], actives)
        np.testing.assert_array_equal(got[r].view(np.uint16), want.view(np.uint16), err_msg=f"rank {r}")


# --- cupy's raw bits ----------------------------------------------------------------------------------


class CupyLikeArray:
    """Host memory presented as a cupy array on cuda:0 (its type's module says cupy)."""

    def __init__(self, array: np.ndarray):
        self.array = np.ascontiguousarray(array)
        self._memory = DeviceMemoryArray(self.array.ctypes.data, self.array.shape, self.array.dtype.name, "cuda", 0,
                                         owner=self.array)

    def __dlpack__(self, **kwargs):
        return self._memory.__dlpack__(max_version=kwargs.get("max_version"))

    def __dlpack_device__(self):
        return self._memory.__dlpack_device__()


CupyLikeArray.__module__ = "cupy._core.core"


class RecordingCuda:
    device_id = 0
    direct_peer_reads = True  # in-process ranks on one GPU

    def __init__(self):
        self.launches = []

    def agree_on(self, configuration, where="dispatch"):  # one rank: nothing to agree with
        pass

    def layout_for(self, num_max_tokens, hidden, num_experts):
        return layout.compute_layout(1, num_experts, num_max_tokens, hidden), 0x1000

    def dispatch_launch(self, parity, layout_ptr, **args):
        def launch(phases, stream_ptr):
            self.launches.append(("dispatch", phases, stream_ptr, args))
        return launch

    def combine_launch(self, parity, layout_ptr, **args):
        def launch(phases, stream_ptr):
            self.launches.append(("combine", phases, stream_ptr, args))
        return launch

    # Arrays of another producer than the launch framework are held until an event is done.
    def record_event(self, stream_ptr):
        return ("event", stream_ptr)

    def event_done(self, event):
        return True

    def stream_is_capturing(self, stream_ptr):
        return False


def recording_cupy_call(monkeypatch, T: int, H: int, E: int):
    """A one-rank Buffer whose CUDA backend records its launches, and cupy-like ``(x, topk_idx,
    active_ranks)`` for a dispatch of 3 tokens: ``(buffer, cuda, x, topk, active)``."""
    monkeypatch.setattr(frameworks.get("cupy"), "current_stream", lambda device_id: 0xC0)
    buffer = ep.LocalGroup(1).spawn(lambda g: ep.Buffer(g, ep.Buffer.get_ep_buffer_size_hint(T, H, 1, E),
                                                        backend="reference"))[0]
    cuda = RecordingCuda()
    buffer._cuda, buffer.backend = cuda, "cuda"
    x = CupyLikeArray(np.zeros((3, H), np.uint16))  # bf16 bits
    topk = CupyLikeArray(np.array([[0], [1], [-1]], np.int64))
    active = CupyLikeArray(np.ones(1, np.int32))
    return buffer, cuda, x, topk, active


def test_cupy_raw_bits_are_accepted_as_bf16_and_fp8(monkeypatch):
    T, H, E = 4, 128, 2
    buffer, cuda, x, topk, active = recording_cupy_call(monkeypatch, T, H, E)
    out = ((CupyLikeArray(np.zeros((E, T, H), np.uint8)), CupyLikeArray(np.zeros((E, T, 1), np.float32))),
           CupyLikeArray(np.zeros(E, np.int32)))
    (q, scales), count, handle, _, _ = buffer.dispatch(x, topk, active, T, E, use_fp8=True, out=out)
    assert q is out[0][0] and count is out[1]
    assert [(k, p, s) for k, p, s, _ in cuda.launches] == [("dispatch", 3, 0xC0)]  # both halves, cupy's stream
    assert cuda.launches[0][3]["recv_x_ptr"] == out[0][0].array.ctypes.data
    expert_out = CupyLikeArray(np.zeros((E, T, H), np.uint16))
    combined = CupyLikeArray(np.zeros((3, H), np.uint16))
    weights = CupyLikeArray(np.ones((3, 1), np.float32))
    got, _, _ = buffer.combine(expert_out, topk, weights, active, -1, handle, out=combined)
    assert got is combined and cuda.launches[-1][0] == "combine"
    assert cuda.launches[-1][3]["combined_ptr"] == combined.array.ctypes.data
    # Raw bits of the wrong width are still refused, naming the argument.
    with pytest.raises(TypeError, match=r"dispatch: x must be bfloat16, got uint8"):
        buffer.dispatch(CupyLikeArray(np.zeros((3, H), np.uint8)), topk, active, T, E, use_fp8=True, out=out)
    # Only cupy gets the raw-bits form: a numpy uint16 x is refused.
    with pytest.raises(TypeError, match=r"dispatch: x must be bfloat16, got uint16"):
        buffer.dispatch(np.zeros((3, H), np.uint16), np.zeros((3, 1), np.int64), np.ones(1, np.int32), T, E)


def test_cupy_glue_returns_raw_bits(monkeypatch):
    """frameworks.cupy.wrap exports bf16/fp8 memory as uint16/uint8 (what cupy.from_dlpack can import)."""
    cupy_glue = frameworks.get("cupy")
    seen = []

    class FakeCupy:
        @staticmethod
        def from_dlpack(array):
            seen.append((array.dtype, array.ptr, array.shape))
            return "cupy array"

    monkeypatch.setitem(__import__("sys").modules, "cupy", FakeCupy)
    memory = DeviceMemoryArray(0x1000, (2, 3), "bfloat16", "cuda", 0, owner=None)
    assert cupy_glue.wrap(memory) == "cupy array"
    cupy_glue.wrap(DeviceMemoryArray(0x2000, (4,), "float8_e4m3fn", "cuda", 0, owner=None))
    cupy_glue.wrap(DeviceMemoryArray(0x3000, (4,), "float32", "cuda", 0, owner=None))
    assert seen == [("uint16", 0x1000, (2, 3)), ("uint8", 0x2000, (4,)), ("float32", 0x3000, (4,))]


# --- JAX memory where a call writes -------------------------------------------------------------------


class Wrapper:
    """Any object whose __dlpack__ hands on its array's capsule (a JAX array's: legacy, no READ_ONLY flag)."""

    def __init__(self, array):
        self.array = array

    def __dlpack__(self, **kwargs):
        return self.array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()


def jax_memory_refused(name: str) -> str:
    return (rf"^{name} is a JAX array's memory \(its DLPack capsule was made by JAX\), which is immutable, and the "
            rf"call writes into it; pass a torch, cupy or numpy array$")


def test_jax_memory_through_a_capsule_is_refused_where_a_call_writes_and_left_as_it_was():
    """A JAX array's capsule (bare, or from another object's __dlpack__) as out= or active_ranks is refused before
    anything is written or exchanged, on the reference backend; torch's and numpy's legacy capsules are still written
    into, and the refused calls leave the buffer as it was (the first handle is still fresh)."""
    T, H, E = 4, 128, 2
    x = (np.arange(3 * H) % 64).astype(BF16).reshape(3, H)
    topk = np.array([[0], [1], [-1]], np.int64)
    weights = np.ones((3, 1), np.float32)
    buffer = ep.LocalGroup(1).spawn(lambda g: ep.Buffer(g, ep.Buffer.get_ep_buffer_size_hint(T, H, 1, E),
                                                        backend="reference"))[0]
    want_x, want_count, handle, _, _ = buffer.dispatch(x, topk, np.ones(1, np.int32), T, E, use_fp8=False)
    recv_x = np.full((E, T, H), 5, BF16)
    count = jnp.full(E, 7, jnp.int32)
    jax_recv_x = jnp.full((E, T, H), 5, jnp.bfloat16)
    jax_active = jnp.ones(1, jnp.int32)
    refused = [("dispatch: out recv_count", dict(out=(recv_x, count.__dlpack__()))),
               ("dispatch: out recv_count", dict(out=(recv_x, Wrapper(count)))),
               ("dispatch: out recv_x", dict(out=(jax_recv_x.__dlpack__(), np.zeros(E, np.int32)))),
               ("dispatch: active_ranks", dict(active_ranks=jax_active.__dlpack__()))]
    for name, call in refused:
        args = dict(x=x, topk_idx=topk, active_ranks=np.ones(1, np.int32), num_max_dispatch_tokens_per_rank=T,
                    num_experts=E, use_fp8=False)
        with pytest.raises(TypeError, match=jax_memory_refused(name)):
            buffer.dispatch(**{**args, **call})
    np.testing.assert_array_equal(np.asarray(count), [7, 7])
    np.testing.assert_array_equal(np.asarray(jax_recv_x).astype(np.float32), 5)
    np.testing.assert_array_equal(recv_x.astype(np.float32), 5)  # nor the array beside the refused one

    torch_count = torch.full((E,), 7, dtype=torch.int32)
    buffer.dispatch(x, topk, np.ones(1, np.int32), T, E, use_fp8=False,
                    out=(recv_x, torch.utils.dlpack.to_dlpack(torch_count)))
    np.testing.assert_array_equal(torch_count.numpy(), want_count)  # torch's legacy capsule is written
    for row in range(E):
        np.testing.assert_array_equal(recv_x[row, :want_count[row]], want_x[row, :want_count[row]])

    combined = jnp.zeros((3, H), jnp.bfloat16)
    with pytest.raises(TypeError, match=jax_memory_refused("combine: out combined_x")):
        buffer.combine(want_x, topk, weights, np.ones(1, np.int32), -1, handle, out=combined.__dlpack__())
    np.testing.assert_array_equal(np.asarray(combined).astype(np.float32), 0)
    want_combined, _, _ = buffer.combine(want_x, topk, weights, np.ones(1, np.int32), -1, handle)
    out = np.zeros((3, H), BF16)
    buffer.combine(want_x, topk, weights, np.ones(1, np.int32), -1, handle, out=out)
    np.testing.assert_array_equal(out.view(np.uint16), want_combined.view(np.uint16))


def test_a_remembered_plan_does_not_let_a_jax_capsule_through(monkeypatch):
    """Device arrays' checked plans are remembered by their layouts; a JAX capsule with the layout of a writable
    capsule that an earlier call was accepted with must still be refused, and nothing launched for it."""
    T, H, E = 4, 128, 2
    buffer, cuda, x, topk, active = recording_cupy_call(monkeypatch, T, H, E)
    recv_x = CupyLikeArray(np.zeros((E, T, H), np.uint16))
    counts = np.zeros(E, np.int32)

    def writable_count():
        """A legacy capsule of memory we may write, on cuda:0 as the other arrays claim to be."""
        return DeviceMemoryArray(counts.ctypes.data, counts.shape, "int32", "cuda", 0, owner=counts).__dlpack__()

    buffer.dispatch(x, topk, active, T, E, use_fp8=False, out=(recv_x, writable_count()))
    assert len(buffer._plans) == 1 and len(cuda.launches) == 1
    count = jnp.full(E, 7, jnp.int32)
    capsule = count.__dlpack__()
    managed = DLManagedTensor.from_address(_dlpack._PyCapsule_GetPointer(capsule, b"dltensor"))
    managed.dl_tensor.device = DLDevice(DLDeviceType.kDLCUDA, 0)  # the layout of writable_count(), JAX's deleter
    with pytest.raises(TypeError, match=jax_memory_refused("dispatch: out recv_count")):
        buffer.dispatch(x, topk, active, T, E, use_fp8=False, out=(recv_x, capsule))
    assert len(cuda.launches) == 1
    np.testing.assert_array_equal(np.asarray(count), [7, 7])
    buffer.dispatch(x, topk, active, T, E, use_fp8=False, out=(recv_x, writable_count()))  # still usable
    assert len(cuda.launches) == 2 and len(buffer._plans) == 1
