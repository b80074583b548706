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
from mooncake_ep import frameworks, layout, reference
from mooncake_ep.tensor import DeviceMemoryArray

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

    def __init__(self):
        self.launches = []

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


def test_cupy_raw_bits_are_accepted_as_bf16_and_fp8(monkeypatch):
    cupy_glue = frameworks.get("cupy")
    monkeypatch.setattr(cupy_glue, "current_stream", lambda device_id: 0xC0)
    T, H, E = 4, 128, 2
    buffer = ep.LocalGroup(1).spawn(lambda g: ep.Buffer(g, ep.Buffer.get_ep_buffer_size_hint(T, H, 1, E),
                                                        backend="reference"))[0]
    cuda = RecordingCuda()
    buffer._cuda, buffer.backend = cuda, "cuda"
    x = CupyLikeArray(np.zeros((3, H), np.uint16))  # bf16 bits
    topk = CupyLikeArray(np.array([[0], [1], [-1]], np.int64))
    active = CupyLikeArray(np.ones(1, np.int32))
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
