"""torch, cupy and JAX callers on the GPU kernels, each element compared with reference.py.

In-process ranks share GPU 0. Each case draws fresh random tokens (channel 0 = source rank + 1, exact in
bf16, so a misrouted row names its source), poisons the outputs, and compares recv_count exactly, the
valid rows of recv_x bit for bit (bf16, fp8 bytes, scales), combine within one bf16 rounding of the
reference (the reference rounds once from fp32, as the kernel does).

The caller's stream: a *gate* kernel holds the caller's stream until the host opens it, then writes the
call's input. The host opens it only after the call returned, so a call that synchronised the host
would leave the gate waiting until its timeout (reported in a status word, never a hang), and a call
that ran on another stream would read the poisoned input instead of the gate's.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
import textwrap
import time

import ml_dtypes
import numpy as np
import pytest

import mooncake_ep as ep
from mooncake_ep import reference
from mooncake_ep.tensor import swapped_last_axes_strides

torch = pytest.importorskip("torch")

from test_gpu_low_latency import IDLE_POLL_S, poll_until, to_numpy, wait_idle  # noqa: E402  (after the skip: they need torch)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

BF16 = np.dtype(ml_dtypes.bfloat16)
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
TIMEOUT_US = 10_000_000  # a bug shows up as a masked rank after 10 s, never as a hang
GATE_TIMEOUT_NS = 20_000_000_000  # how long a gate holds a stream if the host never opens it
NUM_SMS = 16  # per rank: leaves SMs for the gates and for JAX's own kernels
FLAGS = {"bf16": dict(use_fp8=False), "fp8": dict(use_fp8=True),
         "fp8-ue8m0": dict(use_fp8=True, round_scale=True, use_ue8m0=True)}

GATE_SOURCE = r"""
extern "C" __global__ void gate(const volatile int* flag, long long timeout_ns, const unsigned char* src,
                                unsigned char* dst, long long num_bytes, int* status) {
    __shared__ int opened;
    if (threadIdx.x == 0) {
        unsigned long long start, now;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
        opened = 1;
        while (*flag == 0) {
            asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
            if (now - start > (unsigned long long)timeout_ns) { opened = 0; break; }
        }
        if (!opened) atomicExch(status, 1);
    }
    __syncthreads();
    for (long long i = threadIdx.x; i < num_bytes; i += blockDim.x) dst[i] = src[i];
}
"""


class Gate:
    """Holds a stream until :meth:`open`, then copies ``num_bytes`` from src to dst on it."""

    def __init__(self):
        import ctypes

        import cupy

        self.cupy = cupy
        self.kernel = cupy.RawKernel(GATE_SOURCE, "gate")
        self.kernel.compile()
        # Mapped pinned memory: with unified addressing the device reads it at the host address.
        self.flag_ptr = cupy.cuda.runtime.hostAlloc(4, cupy.cuda.runtime.hostAllocMapped)
        self.flag = np.ctypeslib.as_array((ctypes.c_int32 * 1).from_address(self.flag_ptr))
        self.flag[0] = 0
        self.status = cupy.zeros(1, cupy.int32)

    def hold(self, stream_ptr: int, src_ptr: int, dst_ptr: int, num_bytes: int) -> None:
        self.flag[0] = 0
        args = (np.uint64(self.flag_ptr), np.int64(GATE_TIMEOUT_NS), np.uint64(src_ptr), np.uint64(dst_ptr),
                np.int64(num_bytes), np.uint64(self.status.data.ptr))
        self.kernel((1,), (256,), args, stream=self.cupy.cuda.ExternalStream(int(stream_ptr)))

    def __del__(self):
        if getattr(self, "flag_ptr", None):
            self.cupy.cuda.runtime.freeHost(self.flag_ptr)

    def open(self) -> None:
        self.flag[0] = 1

    def timed_out(self) -> bool:
        return bool(self.status.get()[0])  # a sync: after the step only


@dataclasses.dataclass
class Case:
    num_ranks: int = 2
    num_experts: int = 8
    hidden: int = 1024
    num_topk: int = 4
    num_max_tokens: int = 16
    seed: int = 0

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.num_ranks

    @property
    def size(self) -> int:
        return ep.Buffer.get_ep_buffer_size_hint(self.num_max_tokens, self.hidden, self.num_ranks, self.num_experts)


def make_inputs(case: Case, num_tokens=None):
    rng = np.random.default_rng(case.seed)
    xs, topks, weights = [], [], []
    for rank in range(case.num_ranks):
        t = case.num_max_tokens if num_tokens is None else num_tokens[rank]
        x = rng.standard_normal((t, case.hidden), dtype=np.float32) * 3
        x[:, 0] = rank + 1
        topk = np.array([rng.choice(case.num_experts, case.num_topk, replace=False) for _ in range(t)],
                        np.int64).reshape(t, case.num_topk)
        topk[rng.random(topk.shape) < 0.1] = -1
        xs.append(x.astype(BF16))
        topks.append(topk)
        weights.append(rng.random((t, case.num_topk), dtype=np.float32))
    return xs, topks, weights


def to_torch(array: np.ndarray, device="cuda"):
    if array.dtype == BF16:
        return torch.from_numpy(array.view(np.uint16)).view(torch.bfloat16).to(device)
    return torch.from_numpy(array).to(device)


def cupy_wait_idle() -> None:
    """wait_idle for cupy's current stream: poll an event, never block inside CUDA (a rank's
    blocking copy to the host can hold up a peer's launch; see test_gpu_low_latency.wait_idle)."""
    import cupy

    event = cupy.cuda.Event()
    event.record()
    poll_until(lambda: event.done)


def expert_scale(case: Case, rank: int) -> np.ndarray:
    """The experts of the tests multiply by (global expert id + 1) / E: [E_l] float32."""
    return ((np.arange(case.num_local_experts) + rank * case.num_local_experts + 1) / case.num_experts).astype(np.float32)


def dequantised(recv, flags: dict) -> np.ndarray:
    """recv_x as float32 on the host, whatever its format."""
    if not flags.get("use_fp8"):
        return np.asarray(recv).astype(np.float32)
    q, scales = (np.asarray(a) for a in recv)
    num_local, rows, hidden = q.shape
    values = reference.dequantize_fp8(q.reshape(-1, hidden), scales.reshape(num_local * rows, -1),
                                      use_ue8m0=flags.get("use_ue8m0", False))
    return values.reshape(q.shape)


def host_experts(case: Case, rank: int, recv, flags: dict) -> np.ndarray:
    return (dequantised(recv, flags) * expert_scale(case, rank)[:, None, None]).astype(BF16)


def check(case: Case, xs, topks, weights, flags, results, actives=None) -> None:
    """results[rank] = dict(recv=host recv_x (array or (q, scales)), count, y (expert outputs), combined,
    active (the mask after the step))."""
    actives = actives or [np.ones(case.num_ranks, np.int32)] * case.num_ranks
    dispatched = [reference.dispatch(r, xs, topks, actives, case.num_max_tokens, case.num_experts, **flags)
                  for r in range(case.num_ranks)]
    # The mask first: a healthy peer masked (its wait timed out) explains every difference after it.
    expert_outs = [np.asarray(r["y"]) for r in results]
    combined_wants = [reference.combine(rank, expert_outs, dispatched, topks[rank], weights[rank], actives)
                      for rank in range(case.num_ranks)]
    for rank, (got, (_, want_mask)) in enumerate(zip(results, combined_wants)):
        np.testing.assert_array_equal(np.asarray(got["active"]), want_mask,
                                      err_msg=f"rank {rank}: active_ranks (0 where the reference has 1: a timeout)")
    for rank, (got, want) in enumerate(zip(results, dispatched)):
        np.testing.assert_array_equal(got["count"], want.recv_count, err_msg=f"rank {rank}: recv_count")
        q = got["recv"][0] if flags.get("use_fp8") else got["recv"]
        for e, n in enumerate(want.recv_count):
            np.testing.assert_array_equal(np.asarray(q)[e, :n].view(np.uint8), want.recv_x[e, :n].view(np.uint8),
                                          err_msg=f"rank {rank} expert {e}: recv_x rows")
            if flags.get("use_fp8"):
                np.testing.assert_array_equal(np.asarray(got["recv"][1])[e, :n], want.recv_scales[e, :n],
                                              err_msg=f"rank {rank} expert {e}: scales")
    for rank, (got, (want, _)) in enumerate(zip(results, combined_wants)):
        combined = np.asarray(got["combined"]).astype(np.float32)
        assert np.isfinite(combined).all(), f"rank {rank}: combine left unwritten (NaN) elements"
        # Bit for bit: the kernel and the reference add the same expert outputs the same way
        # (test_gpu_low_latency says why a tolerance is not enough).
        np.testing.assert_array_equal(combined, want.astype(np.float32), err_msg=f"rank {rank}: combined_x")


def settle(group) -> None:
    """Finish this rank's stream, then meet the other ranks (no allocation while a peer's kernel waits)."""
    wait_idle()
    group.barrier()


def ready(group) -> None:
    """Before a rank's first collective call: grow torch's and cupy's pools, then settle.

    In-process ranks share the GPU, and what synchronises the device (cudaMalloc of a growing pool,
    pinned allocations such as Gate's or cupy.asarray's staging of a host array, module loads) waits, inside one rank's call, behind peers'
    kernels that wait for that rank: they time out and mask it. So the calls' allocations must find
    their memory cached on this rank's stream, and everything else happen before the barrier.
    """
    import cupy

    # Large blocks (> 1 MB) come from one cached segment; torch serves smaller ones from 2 MB
    # segments of its small pool, so several of those are cached too.
    blocks = [torch.empty(64 << 20, dtype=torch.uint8, device="cuda")]
    blocks += [torch.empty(1 << 20, dtype=torch.uint8, device="cuda") for _ in range(16)]
    pooled = cupy.empty(64 << 20, dtype=cupy.uint8)
    del blocks, pooled
    settle(group)


def local_group(case: Case) -> ep.LocalGroup:
    return ep.LocalGroup(case.num_ranks, devices=[0] * case.num_ranks, timeout_s=120)


def torch_experts(case: Case, rank: int, recv, flags: dict):
    if flags.get("use_fp8"):
        q, scales = recv
        values = q.float().reshape(q.shape[0], q.shape[1], -1, 128)
        if flags.get("use_ue8m0"):
            exponents = scales.contiguous().view(torch.uint8)[..., : case.hidden // 128].to(torch.int32)
            scale = (exponents << 23).view(torch.float32)
        else:
            scale = scales
        values = (values * scale[..., None]).reshape(q.shape)
    else:
        values = recv.float()
    factor = torch.from_numpy(expert_scale(case, rank)).to(values.device)
    return (values * factor[:, None, None]).to(torch.bfloat16)


# --- torch --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("flag_id", ["bf16", "fp8"])
def test_torch_calls_wait_for_the_callers_stream_and_do_not_block_the_host(flag_id):
    flags = FLAGS[flag_id]
    case = Case(seed=1)
    xs, topks, weights = make_inputs(case)

    def run(g):
        r = g.rank
        buffer = ep.Buffer(g, case.size, num_sms=NUM_SMS)
        stream = torch.cuda.current_stream()
        assert stream.cuda_stream == g.stream_ptr
        gate = Gate()
        fresh_x, topk, w = to_torch(xs[r]), to_torch(topks[r]), to_torch(weights[r])
        x = torch.full_like(fresh_x, float("nan"))
        active = torch.ones(case.num_ranks, dtype=torch.int32, device="cuda")
        # The warm-up's values and routes differ from the checked call's: its results' memory, which
        # the checked call's fresh results may be given again, must not already hold the right answer.
        # -2x: fp8 rows of the other sign and doubled scales, exact in bf16.
        warm_x, warm_topk = fresh_x * -2, torch.where(topk >= 0, (topk + 1) % case.num_experts, topk)
        ready(g)
        # Warm-up: the first call of a configuration plans it and queues its layout copy.
        _, _, handle, _, _ = buffer.dispatch(warm_x, warm_topk, active, case.num_max_tokens, case.num_experts,
                                             timeout_us=TIMEOUT_US, **flags)
        warm_y = torch.zeros(case.num_local_experts, case.num_ranks * case.num_max_tokens, case.hidden,
                             dtype=torch.bfloat16, device="cuda")
        buffer.combine(warm_y, warm_topk, w, active, TIMEOUT_US, handle)
        settle(g)
        gate.hold(stream.cuda_stream, fresh_x.data_ptr(), x.data_ptr(), x.numel() * 2)
        recv, count, handle, _, _ = buffer.dispatch(x, topk, active, case.num_max_tokens, case.num_experts,
                                                    timeout_us=TIMEOUT_US, **flags)
        gate.open()
        settle(g)
        if flags["use_fp8"]:  # the scales come as DeepEP's: column-major in their last two dimensions
            assert recv[1].stride() == swapped_last_axes_strides(tuple(recv[1].shape)), recv[1].stride()
        fresh_y = torch_experts(case, r, recv, flags)
        y = torch.full_like(fresh_y, float("nan"))
        settle(g)
        gate.hold(stream.cuda_stream, fresh_y.data_ptr(), y.data_ptr(), y.numel() * 2)
        combined, _, _ = buffer.combine(y, topk, w, active, TIMEOUT_US, handle)
        gate.open()
        settle(g)
        result = dict(recv=tuple(to_numpy(t) for t in recv) if flags["use_fp8"] else to_numpy(recv),
                      count=to_numpy(count), y=to_numpy(fresh_y), combined=to_numpy(combined),
                      active=to_numpy(active), blocked=gate.timed_out())
        buffer.destroy()
        return result

    results = local_group(case).spawn(run)
    assert not any(r["blocked"] for r in results), "a call synchronised the host with the caller's stream"
    check(case, xs, topks, weights, flags, results)


def test_torch_autograd_gradients_match_float64():
    import mooncake_ep.torch as ept

    case = Case(num_experts=4, hidden=256, num_topk=2, num_max_tokens=8, seed=2)
    xs, topks, weights = make_inputs(case)
    rng = np.random.default_rng(3)
    rows = case.num_ranks * case.num_max_tokens
    grad_recvs = [rng.standard_normal((case.num_local_experts, rows, case.hidden)).astype(BF16)
                  for _ in range(case.num_ranks)]
    expert_outs = [rng.standard_normal((case.num_local_experts, rows, case.hidden)).astype(BF16)
                   for _ in range(case.num_ranks)]
    grad_ys = [rng.standard_normal((case.num_max_tokens, case.hidden)).astype(BF16) for _ in range(case.num_ranks)]
    grad_size = ept.grad_buffer_size_hint(case.num_max_tokens, case.hidden, case.num_ranks, case.num_experts,
                                          case.num_topk)

    def run(g):
        r = g.rank
        buffer, grad_buffer = ep.Buffer(g, case.size, num_sms=NUM_SMS), ep.Buffer(g, grad_size, num_sms=NUM_SMS)
        topk, w0 = to_torch(topks[r]), to_torch(weights[r])
        out = None
        for step in range(2):  # the first warms torch's caching allocator (see mooncake_ep.torch's note)
            active = torch.ones(case.num_ranks, dtype=torch.int32, device="cuda")
            x = to_torch(xs[r]).requires_grad_()
            recv, count, handle = ept.dispatch(buffer, x, topk, active, case.num_max_tokens, case.num_experts,
                                               timeout_us=TIMEOUT_US)
            (recv.float() * to_torch(grad_recvs[r]).float()).sum().backward()
            y = to_torch(expert_outs[r]).requires_grad_()
            w = w0.clone().requires_grad_()
            combined = ept.combine(buffer, y, topk, w, active, handle, grad_buffer=grad_buffer, timeout_us=TIMEOUT_US)
            combined.backward(to_torch(grad_ys[r]))
            settle(g)
            out = (to_numpy(count), x.grad.float().cpu().numpy(), y.grad.float().cpu().numpy(), to_numpy(w.grad),
                   to_numpy(active))
        g.barrier()
        buffer.destroy()
        grad_buffer.destroy()
        return out

    results = local_group(case).spawn(run)
    actives = [np.ones(case.num_ranks, np.int32)] * case.num_ranks
    dispatched = [reference.dispatch(r, xs, topks, actives, case.num_max_tokens, case.num_experts, use_fp8=False)
                  for r in range(case.num_ranks)]
    T, H, K = case.num_max_tokens, case.hidden, case.num_topk
    want_x = [np.zeros((T, H)) for _ in range(case.num_ranks)]
    want_y = [np.zeros((case.num_local_experts, rows, H)) for _ in range(case.num_ranks)]
    want_w = [np.zeros((T, K)) for _ in range(case.num_ranks)]
    for owner, res in enumerate(dispatched):
        for e in range(case.num_local_experts):
            for row in range(res.recv_count[e]):
                src, t, k = (int(a[e, row]) for a in (res.recv_src_rank, res.recv_src_token, res.recv_src_topk))
                want_x[src][t] += grad_recvs[owner][e, row].astype(np.float64)
                want_y[owner][e, row] = float(weights[src][t, k]) * grad_ys[src][t].astype(np.float64)
                want_w[src][t, k] = expert_outs[owner][e, row].astype(np.float64) @ grad_ys[src][t].astype(np.float64)
    for r, (count, grad_x, grad_y, grad_w, active) in enumerate(results):
        np.testing.assert_array_equal(count, dispatched[r].recv_count)
        np.testing.assert_array_equal(active, np.ones(case.num_ranks))
        np.testing.assert_allclose(grad_x, want_x[r], rtol=2.0**-8, atol=1e-5, err_msg=f"rank {r}: grad x")
        np.testing.assert_allclose(grad_y, want_y[r], rtol=2.0**-8, atol=1e-5, err_msg=f"rank {r}: grad expert out")
        for e, n in enumerate(dispatched[r].recv_count):
            assert not grad_y[e, n:].any(), f"rank {r} expert {e}: rows past recv_count get no gradient"
        np.testing.assert_allclose(grad_w, want_w[r], rtol=1e-4, atol=1e-3, err_msg=f"rank {r}: grad weights")


def test_torch_autograd_of_two_layers_on_one_buffer_equals_the_reference_backends():
    """Two MoE layers on one Buffer, then one backward: the second layer's dispatches (forward, and the
    backward's re-dispatch) rewrite the workspace half whose per-source row ranges the first layer's
    combine backward moves gradient rows by, so those ranges must be the copy the forward took. The
    GPU's gradients equal the same program's on the reference backend (whose autograd the CPU tests
    check against float64 formulas)."""
    import mooncake_ep.torch as ept

    case = Case(num_experts=4, hidden=256, num_topk=2, num_max_tokens=8, seed=7)
    xs, topks, weights = make_inputs(case)
    rng = np.random.default_rng(8)
    second_topks = [np.argsort(rng.random((case.num_max_tokens, case.num_experts)), axis=1)[:, :case.num_topk]
                    .astype(np.int64) for _ in range(case.num_ranks)]
    grad_ys = [rng.standard_normal((case.num_max_tokens, case.hidden)).astype(BF16) for _ in range(case.num_ranks)]
    grad_size = ept.grad_buffer_size_hint(case.num_max_tokens, case.hidden, case.num_ranks, case.num_experts,
                                          case.num_topk)

    def two_layers(g, device: str, backend: str):
        r = g.rank
        buffer = ep.Buffer(g, case.size, backend=backend, **({"num_sms": NUM_SMS} if backend == "cuda" else {}))
        grad_buffer = ep.Buffer(g, grad_size, backend=backend, **({"num_sms": NUM_SMS} if backend == "cuda" else {}))
        out = None
        for step in range(2):  # the first warms torch's caching allocator (see mooncake_ep.torch's note)
            x = to_torch(xs[r], device).requires_grad_()
            ws = [to_torch(weights[r], device).requires_grad_() for _ in range(2)]
            h = x
            for layer, topk in enumerate((topks[r], second_topks[r])):
                active = torch.ones(case.num_ranks, dtype=torch.int32, device=device)
                topk = to_torch(topk, device)
                recv, _, handle = ept.dispatch(buffer, h, topk, active, case.num_max_tokens, case.num_experts,
                                               timeout_us=TIMEOUT_US)
                expert_out = (recv.float() * (layer + 2)).to(torch.bfloat16)
                h = ept.combine(buffer, expert_out, topk, ws[layer], active, handle, grad_buffer=grad_buffer,
                                timeout_us=TIMEOUT_US)
            h.backward(to_torch(grad_ys[r], device))
            if backend == "cuda":
                settle(g)
            out = [t.grad.float().cpu().numpy() for t in (x, *ws)]
        g.barrier()
        buffer.destroy()
        grad_buffer.destroy()
        return out

    got = local_group(case).spawn(lambda g: two_layers(g, "cuda", "cuda"))
    want = ep.LocalGroup(case.num_ranks, timeout_s=120).spawn(lambda g: two_layers(g, "cpu", "reference"))
    for r in range(case.num_ranks):
        for name, a, b in zip(("x", "weights of layer 0", "weights of layer 1"), got[r], want[r]):
            np.testing.assert_allclose(a, b, rtol=2.0**-7, atol=1e-3, err_msg=f"rank {r}: grad {name}")


def test_torch_dense_experts_get_finite_weight_gradients_past_recv_count():
    """An expert that computes every row of recv_x (a dense einsum) takes the rows past recv_count into its
    weight gradient, times zero gradient rows: the kernels leave those rows as they find them, and
    0 * NaN poisoned the whole gradient (helper-154). They are zeros, as the reference backend's."""
    import mooncake_ep.torch as ept

    case = Case(num_experts=4, hidden=256, num_topk=2, num_max_tokens=8, seed=5)
    xs, topks, weights = make_inputs(case)
    rows = case.num_ranks * case.num_max_tokens
    grad_size = ept.grad_buffer_size_hint(case.num_max_tokens, case.hidden, case.num_ranks, case.num_experts,
                                          case.num_topk)

    def run(g):
        r = g.rank
        buffer, grad_buffer = ep.Buffer(g, case.size, num_sms=NUM_SMS), ep.Buffer(g, grad_size, num_sms=NUM_SMS)
        generator = torch.Generator(device="cuda").manual_seed(r)
        w_experts = torch.randn((case.num_local_experts, case.hidden, case.hidden), device="cuda",
                                generator=generator).mul_(case.hidden ** -0.5).requires_grad_()
        active = torch.ones(case.num_ranks, dtype=torch.int32, device="cuda")
        # NaN in the caching allocator's block of recv_x's size: what torch.empty handed out before.
        poison = torch.full((case.num_local_experts, rows, case.hidden), float("nan"), dtype=torch.bfloat16,
                            device="cuda")
        del poison
        recv, count, handle = ept.dispatch(buffer, to_torch(xs[r]), to_torch(topks[r]), active, case.num_max_tokens,
                                           case.num_experts, timeout_us=TIMEOUT_US)
        y = torch.einsum("erh,ehk->erk", recv.float(), w_experts).to(torch.bfloat16)
        y.retain_grad()
        combined = ept.combine(buffer, y, to_torch(topks[r]), to_torch(weights[r]), active, handle,
                               grad_buffer=grad_buffer, timeout_us=TIMEOUT_US)
        combined.float().square().sum().backward()
        valid = (torch.arange(rows, device="cuda")[None, :] < count[:, None])[:, :, None]
        want = torch.einsum("erh,erk->ehk", torch.where(valid, recv.float(), 0.0), y.grad.float())
        settle(g)
        out = (to_numpy(count), recv.detach().float().cpu().numpy(), w_experts.grad.cpu().numpy(), want.cpu().numpy())
        g.barrier()
        buffer.destroy()
        grad_buffer.destroy()
        return out

    for r, (count, recv, grad_w, want) in enumerate(local_group(case).spawn(run)):
        for e, n in enumerate(count):
            assert not recv[e, n:].any(), f"rank {r} expert {e}: rows past recv_count are not zeros"
        assert np.isfinite(grad_w).all(), f"rank {r}: the experts' weight gradient is not finite"
        np.testing.assert_allclose(grad_w, want, rtol=1e-5, atol=1e-5, err_msg=f"rank {r}: the experts' weight gradient")


def test_torch_bad_input_is_refused_and_the_buffer_still_works():
    case = Case(num_ranks=1, num_experts=4, hidden=256, num_topk=2, num_max_tokens=8, seed=4)
    xs, topks, weights = make_inputs(case)

    def run(g):
        buffer = ep.Buffer(g, case.size, num_sms=NUM_SMS)
        x, topk, w = to_torch(xs[0]), to_torch(topks[0]), to_torch(weights[0])
        active = torch.ones(1, dtype=torch.int32, device="cuda")
        args = (case.num_max_tokens, case.num_experts)
        with pytest.raises(TypeError, match=r"dispatch: topk_idx is on cpu:0, expected cuda:0 like the other arrays"):
            buffer.dispatch(x, topk.cpu(), active, *args)
        with pytest.raises(ValueError, match=r"dispatch: x must be contiguous"):
            buffer.dispatch(x.t().contiguous().t(), topk, active, *args)
        with pytest.raises(TypeError, match=r"dispatch: x must be bfloat16, got float16"):
            buffer.dispatch(x.half(), topk, active, *args)
        if torch.cuda.device_count() > 1:
            with pytest.raises(TypeError, match=r"dispatch: x is on cuda:1, this Buffer's rank uses cuda:0"):
                buffer.dispatch(x.to("cuda:1"), topk.to("cuda:1"), active.to("cuda:1"), *args)
        recv, count, handle, _, _ = buffer.dispatch(x, topk, active, *args, timeout_us=TIMEOUT_US, use_fp8=False)
        with pytest.raises(TypeError, match=r"combine: topk_weights must be float32, got float64"):
            buffer.combine(recv, topk, w.double(), active, TIMEOUT_US, handle)
        y = torch_experts(case, 0, recv, FLAGS["bf16"])
        combined, _, _ = buffer.combine(y, topk, w, active, TIMEOUT_US, handle)
        result = dict(recv=to_numpy(recv), count=to_numpy(count), y=to_numpy(y), combined=to_numpy(combined),
                      active=to_numpy(active))
        buffer.destroy()
        return result

    check(case, xs, topks, weights, FLAGS["bf16"], local_group(case).spawn(run))


@pytest.mark.parametrize("mode", ["sync", "async_finish", "return_recv_hook"])
def test_deep_ep_calls_with_recv_stats_equal_reference(mode):
    """mooncake_ep.deep_ep as DeepEP's callers use it, two steps: results equal the reference, and
    cumulative_local_expert_recv_stats grows by recv_count each step, ordered as the receive (the
    communication stream with async_finish, the hook's stream with a hook)."""
    import mooncake_ep.deep_ep as deep_ep

    flags = FLAGS["fp8"]
    case = Case(seed=5)
    xs, topks, weights = make_inputs(case)
    modes = dict(async_finish=mode == "async_finish", return_recv_hook=mode == "return_recv_hook")

    def run(g):
        r = g.rank
        buffer = deep_ep.Buffer(g, 0, case.size, low_latency_mode=True, timeout_us=TIMEOUT_US, num_sms=NUM_SMS)
        x, topk, w = to_torch(xs[r]), to_torch(topks[r]), to_torch(weights[r])
        stats = torch.full((case.num_local_experts,), 1000 + r, dtype=torch.int32, device="cuda")
        assert buffer.get_comm_stream().cuda_stream == buffer.runtime.comm_stream_ptr
        ready(g)
        for _ in range(2):
            recv, count, handle, event, hook = buffer.low_latency_dispatch(
                x, topk, case.num_max_tokens, case.num_experts, stats, **flags, **modes)
            if hook is not None:
                hook()
            event.current_stream_wait()
            settle(g)
            y = torch_experts(case, r, recv, flags)
            settle(g)
            combined, event, hook = buffer.low_latency_combine(y, topk, w, handle, **modes)
            if hook is not None:
                hook()
            event.current_stream_wait()
            settle(g)
        result = dict(recv=tuple(to_numpy(t) for t in recv), count=to_numpy(count), y=to_numpy(y),
                      combined=to_numpy(combined), active=to_numpy(buffer.active_ranks),
                      stats_growth=to_numpy(stats) - (1000 + r))
        buffer.destroy()
        return result

    results = local_group(case).spawn(run)
    check(case, xs, topks, weights, flags, results)
    for rank, result in enumerate(results):
        np.testing.assert_array_equal(result["stats_growth"], 2 * result["count"], err_msg=f"rank {rank}")


def test_a_deep_ep_buffer_dropped_on_its_thread_is_destroyed_and_a_new_one_works():
    """TensorRT-LLM grows its DeepEP buffer with `del buffer` before building the next: the destructor of
    one built without explicitly_destroy runs destroy() (a collective on the GPU), and the next Buffer's
    step equals the reference."""
    import mooncake_ep.deep_ep as deep_ep

    flags = FLAGS["bf16"]
    case = Case(seed=7)
    xs, topks, weights = make_inputs(case)

    def run(g):
        r = g.rank
        first = deep_ep.Buffer(g, 0, case.size, low_latency_mode=True, timeout_us=TIMEOUT_US, num_sms=NUM_SMS)
        runtime = first.runtime
        ready(g)
        del first  # the collective destroy, on every rank's thread
        dropped = (runtime.backend, runtime._cuda is None)
        buffer = deep_ep.Buffer(g, 0, case.size, low_latency_mode=True, timeout_us=TIMEOUT_US, num_sms=NUM_SMS)
        x, topk, w = to_torch(xs[r]), to_torch(topks[r]), to_torch(weights[r])
        ready(g)
        recv, count, handle, _, _ = buffer.low_latency_dispatch(x, topk, case.num_max_tokens, case.num_experts,
                                                                **flags)
        settle(g)
        y = torch_experts(case, r, recv, flags)
        settle(g)
        combined, _, _ = buffer.low_latency_combine(y, topk, w, handle)
        settle(g)
        result = dict(recv=to_numpy(recv), count=to_numpy(count), y=to_numpy(y), combined=to_numpy(combined),
                      active=to_numpy(buffer.active_ranks), dropped=dropped)
        buffer.destroy()
        return result

    results = local_group(case).spawn(run)
    assert [result.pop("dropped") for result in results] == [("cuda", True)] * case.num_ranks
    check(case, xs, topks, weights, flags, results)


# --- cupy ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("flag_id", list(FLAGS))
def test_cupy_arrays_in_and_out_on_cupys_stream(flag_id):
    """cupy callers pass and get raw bits: bf16 as uint16, fp8 as uint8 (cupy has neither dtype)."""
    cupy = pytest.importorskip("cupy")
    flags = FLAGS[flag_id]
    case = Case(seed=5)
    xs, topks, weights = make_inputs(case)

    def run(g):
        r = g.rank
        buffer = ep.Buffer(g, case.size, num_sms=NUM_SMS)
        stream = cupy.cuda.get_current_stream()
        assert stream.ptr == g.stream_ptr
        gate = Gate()
        fresh_x = cupy.asarray(xs[r].view(np.uint16))
        x = cupy.full(fresh_x.shape, 0x7FC0, cupy.uint16)  # bf16 NaN
        topk, w = cupy.asarray(topks[r]), cupy.asarray(weights[r])
        active = cupy.ones(case.num_ranks, cupy.int32)
        # A warm-up with other values (-2x: other fp8 rows and scales) and routes (see the torch test):
        # cupy's pool may give the checked call's results this call's memory again, which must not hold
        # the right answer.
        warm_x = cupy.asarray((xs[r].astype(np.float32) * -2).astype(BF16).view(np.uint16))
        warm_topk = cupy.where(topk >= 0, (topk + 1) % case.num_experts, topk)
        ready(g)
        buffer.dispatch(warm_x, warm_topk, active, case.num_max_tokens, case.num_experts, timeout_us=TIMEOUT_US,
                        **flags)
        cupy_wait_idle()
        g.barrier()
        gate.hold(stream.ptr, fresh_x.data.ptr, x.data.ptr, x.nbytes)
        recv, count, handle, _, _ = buffer.dispatch(x, topk, active, case.num_max_tokens, case.num_experts,
                                                    timeout_us=TIMEOUT_US, **flags)
        gate.open()
        cupy_wait_idle()
        if flags["use_fp8"]:
            q, scales = recv
            assert q.dtype == cupy.uint8 and scales.dtype == (cupy.int32 if flags.get("use_ue8m0") else cupy.float32)
            assert scales.flags.c_contiguous, scales.strides  # DeepEP's layout is torch callers' only
            host_recv = (cupy.asnumpy(q).view(FP8), cupy.asnumpy(scales))
        else:
            assert recv.dtype == cupy.uint16
            host_recv = cupy.asnumpy(recv).view(BF16)
        assert count.dtype == cupy.int32
        g.barrier()
        y = cupy.asarray(host_experts(case, r, host_recv, flags).view(np.uint16))  # bf16 bits
        combined, _, _ = buffer.combine(y, topk, w, active, TIMEOUT_US, handle)
        assert combined.dtype == cupy.uint16
        cupy_wait_idle()
        result = dict(recv=host_recv, count=cupy.asnumpy(count), y=cupy.asnumpy(y).view(BF16),
                      combined=cupy.asnumpy(combined).view(BF16), active=cupy.asnumpy(active),
                      blocked=gate.timed_out())
        g.barrier()
        buffer.destroy()
        return result

    results = local_group(case).spawn(run)
    assert not any(r["blocked"] for r in results), "dispatch synchronised the host with cupy's stream"
    check(case, xs, topks, weights, flags, results)


def test_cupy_out_scales_in_deepeps_layout_equal_reference():
    """cupy callers may pass DeepEP's swapped scales as out=: the kernel writes them there. They are
    read back through a contiguous copy: cupy 14.2's ndarray.get() of a non-contiguous array leaves
    the legacy default stream current in the calling thread (seen on an H100, the thirty-seventh
    session: get(), get(stream=current) and cupy.asnumpy do it; ascontiguousarray and copy() do not),
    and the rank's next call would then share that stream with its peer and be refused."""
    cupy = pytest.importorskip("cupy")
    flags = FLAGS["fp8"]
    case = Case(seed=6)
    xs, topks, weights = make_inputs(case)
    rows, columns = case.num_ranks * case.num_max_tokens, case.hidden // 128

    def run(g):
        r = g.rank
        buffer = ep.Buffer(g, case.size, num_sms=NUM_SMS)
        x = cupy.asarray(xs[r].view(np.uint16))
        topk, w = cupy.asarray(topks[r]), cupy.asarray(weights[r])
        active = cupy.ones(case.num_ranks, cupy.int32)
        q = cupy.full((case.num_local_experts, rows, case.hidden), 0xFF, cupy.uint8)
        scales = cupy.full((case.num_local_experts, columns, rows), np.nan, cupy.float32).swapaxes(1, 2)
        count = cupy.full(case.num_local_experts, -1, cupy.int32)
        assert scales.strides == tuple(4 * s for s in swapped_last_axes_strides(scales.shape))
        ready(g)
        (got_q, got_scales), got_count, handle, _, _ = buffer.dispatch(
            x, topk, active, case.num_max_tokens, case.num_experts, timeout_us=TIMEOUT_US,
            out=((q, scales), count), **flags)
        assert got_q is q and got_scales is scales and got_count is count
        cupy_wait_idle()
        host_recv = (cupy.asnumpy(q).view(FP8), cupy.asnumpy(cupy.ascontiguousarray(scales)))
        assert cupy.cuda.get_current_stream().ptr == g.stream_ptr, f"rank {r}: the read-back changed cupy's stream"
        g.barrier()
        y = cupy.asarray(host_experts(case, r, host_recv, flags).view(np.uint16))
        combined, _, _ = buffer.combine(y, topk, w, active, TIMEOUT_US, handle)
        cupy_wait_idle()
        result = dict(recv=host_recv, count=cupy.asnumpy(count), y=cupy.asnumpy(y).view(BF16),
                      combined=cupy.asnumpy(combined).view(BF16), active=cupy.asnumpy(active))
        g.barrier()
        buffer.destroy()
        return result

    check(case, xs, topks, weights, flags, local_group(case).spawn(run))


@pytest.mark.parametrize("shape", [(4, 8, 128), (4, 0, 128), (0, 7), (3,), (1, 1, 1)])
@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn", "float32", "int32"])
def test_allocated_cupy_results_read_as_read_array_reads_them(shape, dtype):
    """_allocate builds the views of cupy results it just made without read_array: every field the
    same (bf16 and fp8 by their raw-bits uint dtypes), as test_buffer_cpu.py checks for torch. The
    one exception is an empty array's strides: cupy gives it zero strides, the view row-major ones;
    both are contiguous, and no element has an address to disagree on."""
    cupy = pytest.importorskip("cupy")
    from mooncake_ep.buffer import _Plan
    from mooncake_ep.tensor import ArrayView, read_array

    buffer = ep.LocalGroup(1).spawn(lambda g: ep.Buffer(g, ep.Buffer.get_ep_buffer_size_hint(8, 128, 1, 4),
                                                        backend="reference"))[0]
    like = read_array(cupy.ones((2, 2), cupy.float32), name="like")
    ((view, obj),) = buffer._allocate(_Plan.of(0, 0, 0, [("out", list(shape), dtype)]), like)
    expected = read_array(obj, name="out")
    empty = math.prod(shape) == 0
    fields = [name for name in ArrayView.__slots__
              if name not in ("obj", "keepalive") and not (empty and name == "strides")]
    assert [getattr(view, name) for name in fields] == [getattr(expected, name) for name in fields]
    assert view.obj is obj and view.keepalive is obj and view.is_contiguous and expected.is_contiguous


def test_cupy_zero_copy_combine():
    cupy = pytest.importorskip("cupy")
    case = Case(seed=6)
    xs, topks, weights = make_inputs(case)
    flags = FLAGS["bf16"]

    def run(g):
        r = g.rank
        buffer = ep.Buffer(g, case.size, num_sms=NUM_SMS)
        topk, w = cupy.asarray(topks[r]), cupy.asarray(weights[r])
        active = cupy.ones(case.num_ranks, cupy.int32)
        x = cupy.asarray(xs[r].view(np.uint16))  # before ready(): cupy stages host copies in pinned memory
        ready(g)
        recv, count, handle, _, _ = buffer.dispatch(x, topk, active,
                                                    case.num_max_tokens, case.num_experts, timeout_us=TIMEOUT_US,
                                                    use_fp8=False)
        cupy_wait_idle()
        host_recv = cupy.asnumpy(recv).view(BF16)
        y = host_experts(case, r, host_recv, flags)
        target = buffer.get_next_combine_buffer(handle)
        assert target.dtype == cupy.uint16 and target.shape == y.shape
        target[...] = cupy.asarray(y.view(np.uint16))
        cupy.cuda.get_current_stream().synchronize()
        g.barrier()
        combined, _, _ = buffer.combine(None, topk, w, active, TIMEOUT_US, handle, zero_copy=True)
        cupy_wait_idle()
        result = dict(recv=host_recv, count=cupy.asnumpy(count), y=y, combined=cupy.asnumpy(combined).view(BF16),
                      active=cupy.asnumpy(active))
        g.barrier()
        buffer.destroy()
        return result

    check(case, xs, topks, weights, flags, local_group(case).spawn(run))


# --- an explicit stream= -------------------------------------------------------------------------------


def idle_within(event_done, seconds: float = 2.0) -> bool:
    """Whether ``event_done()`` turns true within ``seconds`` (polled: never blocks inside CUDA)."""
    deadline = time.monotonic() + seconds
    while not event_done():
        if time.monotonic() > deadline:
            return False
        time.sleep(IDLE_POLL_S)
    return True


@pytest.mark.parametrize("mode", ["sync", "hook"])
@pytest.mark.parametrize("given", ["torch.Stream", "int", "cupy.Stream"])
def test_an_explicit_stream_is_the_one_the_calls_run_on(given, mode):
    """``stream=`` names a stream that is not the arrays' framework's current one. A gate holds that
    stream and writes the call's input there: dispatch and combine must wait for it (else they read
    the poisoned input), must not synchronise the host (else the gate times out), and must queue
    nothing on the current stream (an event recorded there after the call completes while the gate
    still holds the given stream). In hook mode the receive half, launched by ``hook()``, runs on the
    given stream too. The results equal the reference."""
    cupy = pytest.importorskip("cupy")
    flags = FLAGS["fp8"]
    case = Case(seed=8)
    xs, topks, weights = make_inputs(case)
    use_cupy = given == "cupy.Stream"
    hook_mode = mode == "hook"
    recv_shape = (case.num_local_experts, case.num_ranks * case.num_max_tokens, case.hidden)

    def run(g):
        r = g.rank
        buffer = ep.Buffer(g, case.size, num_sms=NUM_SMS)
        gate = Gate()
        if use_cupy:
            side = cupy.cuda.Stream(non_blocking=True)
            side_ptr, stream_arg = side.ptr, side
            fresh_x = cupy.asarray(xs[r].view(np.uint16))
            x = cupy.full(fresh_x.shape, 0x7FC0, cupy.uint16)  # bf16 NaN
            topk, w = cupy.asarray(topks[r]), cupy.asarray(weights[r])
            active = cupy.ones(case.num_ranks, cupy.int32)
            x_ptr, fresh_x_ptr = x.data.ptr, fresh_x.data.ptr

            def current_stream_event_done():
                event = cupy.cuda.Event()
                event.record()
                return lambda: event.done

            def wait_for_side():
                event = cupy.cuda.Event()
                event.record(side)
                cupy.cuda.get_current_stream().wait_event(event)
                cupy_wait_idle()
        else:
            side = torch.cuda.Stream()
            side_ptr = side.cuda_stream
            stream_arg = side if given == "torch.Stream" else side_ptr
            fresh_x = to_torch(xs[r])
            x = torch.full_like(fresh_x, float("nan"))
            # Weights that need grad, as a training step's: torch refuses to export those through DLPack,
            # which a launch on another stream than torch's current one had used.
            topk, w = to_torch(topks[r]), to_torch(weights[r]).requires_grad_()
            active = torch.ones(case.num_ranks, dtype=torch.int32, device="cuda")
            x_ptr, fresh_x_ptr = x.data_ptr(), fresh_x.data_ptr()

            def current_stream_event_done():
                event = torch.cuda.Event()
                event.record()
                return event.query

            def wait_for_side():
                torch.cuda.current_stream().wait_stream(side)
                wait_idle()
        assert side_ptr != g.stream_ptr
        # The warm-up's routes differ from the checked call's, so that results given its memory again
        # do not already hold the right counts (see the torch test); its x is the poisoned one.
        warm_topk = (cupy if use_cupy else torch).where(topk >= 0, (topk + 1) % case.num_experts, topk)
        warm_y = (cupy.zeros(recv_shape, cupy.uint16) if use_cupy
                  else torch.zeros(recv_shape, dtype=torch.bfloat16, device="cuda"))
        ready(g)
        # Warm-up on the given stream: a configuration's first call plans it and queues its layout.
        _, _, warm_handle, _, warm_hook = buffer.dispatch(x, warm_topk, active, case.num_max_tokens,
                                                          case.num_experts, timeout_us=TIMEOUT_US,
                                                          return_recv_hook=hook_mode, stream=stream_arg, **flags)
        if hook_mode:
            warm_hook()
        _, _, warm_hook = buffer.combine(warm_y, warm_topk, w, active, TIMEOUT_US, warm_handle,
                                         return_recv_hook=hook_mode, stream=stream_arg)
        if hook_mode:
            warm_hook()
        wait_for_side()
        g.barrier()

        gate.hold(side_ptr, fresh_x_ptr, x_ptr, case.num_max_tokens * case.hidden * 2)
        recv, count, handle, _, hook = buffer.dispatch(x, topk, active, case.num_max_tokens, case.num_experts,
                                                       timeout_us=TIMEOUT_US, return_recv_hook=hook_mode,
                                                       stream=stream_arg, **flags)
        if hook_mode:
            hook()
        current_idle = idle_within(current_stream_event_done())
        gate.open()
        wait_for_side()
        if use_cupy:
            q, scales = recv
            host_recv = (cupy.asnumpy(q).view(FP8), cupy.asnumpy(scales))
            host_count = cupy.asnumpy(count)
        else:
            host_recv, host_count = tuple(to_numpy(t) for t in recv), to_numpy(count)
        g.barrier()

        fresh_y_host = host_experts(case, r, host_recv, flags)
        if use_cupy:
            fresh_y = cupy.asarray(fresh_y_host.view(np.uint16))
            y = cupy.full(fresh_y.shape, 0x7FC0, cupy.uint16)
            y_ptr, fresh_y_ptr, y_bytes = y.data.ptr, fresh_y.data.ptr, y.nbytes
        else:
            fresh_y = to_torch(fresh_y_host)
            y = torch.full_like(fresh_y, float("nan"))
            y_ptr, fresh_y_ptr, y_bytes = y.data_ptr(), fresh_y.data_ptr(), y.numel() * 2
        wait_for_side()
        g.barrier()
        gate.hold(side_ptr, fresh_y_ptr, y_ptr, y_bytes)
        combined, _, hook = buffer.combine(y, topk, w, active, TIMEOUT_US, handle, return_recv_hook=hook_mode,
                                           stream=stream_arg)
        if hook_mode:
            hook()
        current_idle = current_idle and idle_within(current_stream_event_done())
        gate.open()
        wait_for_side()
        if use_cupy:
            host_combined, host_active = cupy.asnumpy(combined).view(BF16), cupy.asnumpy(active)
        else:
            host_combined, host_active = to_numpy(combined), to_numpy(active)
        result = dict(recv=host_recv, count=host_count, y=fresh_y_host, combined=host_combined, active=host_active,
                      blocked=gate.timed_out(), current_idle=current_idle)
        g.barrier()
        buffer.destroy()
        return result

    results = local_group(case).spawn(run)
    assert not any(r["blocked"] for r in results), "a call synchronised the host with the given stream"
    assert all(r["current_idle"] for r in results), "a call queued work on the current stream behind the given one"
    check(case, xs, topks, weights, flags, results)


def test_a_graph_captured_after_calls_that_hold_arrays_replays_correctly():
    """Calls on another stream than an array's allocator's (async_finish, with a cupy active_ranks beside
    torch tensors) hold that array until an event is done. A torch graph captured after such an eager
    call must not query those events: a query inside a capture ends it (cudaErrorStreamCaptureInvalidated
    at capture_end, seen on an H100 by a review), nor make the captured stream wait for cupy's (CUDA
    refuses a dependency on uncaptured work: cudaErrorStreamCaptureIsolation). The captured dispatch,
    replayed with fresh tokens and routes, equals the reference every time."""
    cupy = pytest.importorskip("cupy")
    case = Case(num_ranks=1, num_experts=8, hidden=256, num_topk=2, num_max_tokens=8, seed=9)
    steps = [make_inputs(dataclasses.replace(case, seed=100 + step)) for step in range(3)]

    def run(g):
        buffer = ep.Buffer(g, case.size, num_sms=NUM_SMS)
        x, topk = to_torch(steps[0][0][0]), to_torch(steps[0][1][0])
        active = cupy.ones(1, cupy.int32)
        recv = torch.empty(case.num_local_experts, case.num_max_tokens, case.hidden, dtype=torch.bfloat16,
                           device="cuda")
        count = torch.empty(case.num_local_experts, dtype=torch.int32, device="cuda")

        def call():
            _, _, _, event, _ = buffer.dispatch(x, topk, active, case.num_max_tokens, case.num_experts,
                                                use_fp8=False, async_finish=True, out=(recv, count))
            event.current_stream_wait()

        call()  # eager: plans the configuration, and holds the cupy array
        cupy.cuda.get_current_stream().synchronize()
        torch.cuda.synchronize()
        held_before_capture = len(buffer._in_flight)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            call()
        results = []
        for xs, topks, _ in steps:
            recv.fill_(float("nan"))
            count.fill_(-1)
            x.copy_(to_torch(xs[0]))
            topk.copy_(to_torch(topks[0]))
            graph.replay()
            torch.cuda.synchronize()
            results.append((to_numpy(recv), to_numpy(count)))
        buffer.destroy()
        return held_before_capture, results

    held_before_capture, results = local_group(case).spawn(run)[0]
    assert held_before_capture == 1, "the eager call held the cupy array: the case the capture must survive"
    for step, ((xs, topks, _), (recv, count)) in enumerate(zip(steps, results)):
        want = reference.dispatch(0, xs, topks, [np.ones(1, np.int32)], case.num_max_tokens, case.num_experts,
                                  use_fp8=False)
        np.testing.assert_array_equal(count, want.recv_count, err_msg=f"replay {step}: recv_count")
        for e, n in enumerate(want.recv_count):
            np.testing.assert_array_equal(recv[e, :n].view(np.uint16), want.recv_x[e, :n].view(np.uint16),
                                          err_msg=f"replay {step} expert {e}: recv_x rows")


# --- JAX ----------------------------------------------------------------------------------------------


def jax_gpu():
    jax = pytest.importorskip("jax")
    try:
        gpus = [d for d in jax.devices() if d.platform == "gpu"]
    except RuntimeError:
        gpus = []
    if not gpus:
        pytest.skip("needs JAX with CUDA")
    return jax, gpus


def jax_experts(case: Case, rank: int, recv, flags: dict):
    import jax
    import jax.numpy as jnp

    if flags.get("use_fp8"):
        q, scales = recv
        num_local, rows, hidden = q.shape
        if flags.get("use_ue8m0"):
            exponents = jax.lax.bitcast_convert_type(scales, jnp.uint8).reshape(num_local, rows, -1)
            scale = jax.lax.bitcast_convert_type(exponents[..., : hidden // 128].astype(jnp.uint32) << 23,
                                                 jnp.float32)
        else:
            scale = scales
        values = (q.astype(jnp.float32).reshape(num_local, rows, -1, 128) * scale[..., None]).reshape(q.shape)
    else:
        values = recv.astype(jnp.float32)
    return (values * jnp.asarray(expert_scale(case, rank))[:, None, None]).astype(jnp.bfloat16)


def split_step(jax, buffers, case: Case, flags: dict, gate=None):
    """One jitted step of every rank on GPU 0 in the split form; with ``gate``, x comes from a gate kernel."""
    import jax.numpy as jnp
    from jax.experimental.buffer_callback import buffer_callback

    import mooncake_ep.jax as epj

    def gated(x):
        """x, copied by a gate kernel on XLA's stream (as uint16: the array interface has no bf16)."""
        def hold(ctx, out, source):
            stream = ctx.stream() if callable(ctx.stream) else ctx.stream
            src = source.__cuda_array_interface__["data"][0]
            dst = out.__cuda_array_interface__["data"][0]
            gate.hold(int(stream), src, dst, int(np.prod(source.shape)) * 2)
        bits = jax.lax.bitcast_convert_type(x, jnp.uint16)
        copied = buffer_callback(hold, jax.ShapeDtypeStruct(bits.shape, jnp.uint16), has_side_effect=True,
                                 command_buffer_compatible=False)(bits)
        return jax.lax.bitcast_convert_type(copied, jnp.bfloat16)

    def step(xs, topks, weights, actives):
        if gate is not None:
            xs = [gated(x) for x in xs]
        sent = [epj.dispatch_send(buffers[r], xs[r], topks[r], actives[r], case.num_max_tokens, case.num_experts,
                                  timeout_us=TIMEOUT_US, **flags) for r in range(case.num_ranks)]
        received = epj.dispatch_recv(sent)
        ys = [jax_experts(case, r, recv, flags) for r, (recv, _, _, _) in enumerate(received)]
        sent = [epj.combine_send(buffers[r], ys[r], topks[r], weights[r], active, handle, timeout_us=TIMEOUT_US)
                for r, (_, _, handle, active) in enumerate(received)]
        combined = epj.combine_recv(sent)
        return ([(recv, count) for recv, count, _, _ in received], ys, [out for out, _ in combined],
                [active for _, active in combined])

    return jax.jit(step)


def jax_results(case, flags, received, ys, combined, actives):
    """:func:`check`'s results of JAX steps: per rank ``(recv, count)``, expert outputs, combined_x and
    the mask combine returned."""
    results = []
    for r in range(case.num_ranks):
        recv, count = received[r]
        host_recv = tuple(np.asarray(a) for a in recv) if flags["use_fp8"] else np.asarray(recv)
        results.append(dict(recv=host_recv, count=np.asarray(count), y=np.asarray(ys[r]),
                            combined=np.asarray(combined[r]), active=np.asarray(actives[r])))
    return results


def jax_inputs(jax, case, xs, topks, weights):
    import jax.numpy as jnp

    to32 = [t.astype(np.int32) for t in topks]
    return ([jnp.asarray(x) for x in xs], [jnp.asarray(t) for t in to32], [jnp.asarray(w) for w in weights],
            [jnp.ones(case.num_ranks, jnp.int32)] * case.num_ranks), to32


def gpu_buffers(case: Case, num_sms=None) -> list:
    group = ep.LocalGroup(case.num_ranks, devices=[0] * case.num_ranks, timeout_s=120)
    return group, group.spawn(lambda g: ep.Buffer(g, case.size, num_sms=num_sms))


@pytest.mark.parametrize("flag_id", list(FLAGS))
def test_jax_split_form_on_one_gpu_equals_reference(flag_id):
    jax, _ = jax_gpu()
    flags = FLAGS[flag_id]
    case = Case(num_ranks=4, num_experts=16, seed=7)
    group, buffers = gpu_buffers(case)
    step = split_step(jax, buffers, case, flags)
    for seed in range(3):  # fresh inputs each step, one compiled program
        case.seed = 100 + seed
        xs, topks, weights = make_inputs(case, num_tokens=[16, 9, 16, 0])
        args, topks32 = jax_inputs(jax, case, xs, topks, weights)
        check(case, xs, topks32, weights, flags, jax_results(case, flags, *step(*args)))
    group.spawn(lambda g: buffers[g.rank].destroy())


def test_jax_ops_wait_for_xlas_stream_and_do_not_block_the_host():
    jax, _ = jax_gpu()
    flags = FLAGS["fp8"]
    case = Case(num_ranks=2, seed=8)
    group, buffers = gpu_buffers(case, num_sms=NUM_SMS)
    gate = Gate()
    xs, topks, weights = make_inputs(case)
    args, topks32 = jax_inputs(jax, case, xs, topks, weights)
    split_step(jax, buffers, case, flags)(*args)  # warm-up: compile, upload the layout
    step = split_step(jax, buffers, case, flags, gate=gate)
    outputs = step(*args)  # returns once enqueued: the gate still holds XLA's stream
    gate.open()
    outputs = jax.block_until_ready(outputs)
    assert not gate.timed_out(), "an op synchronised the host with XLA's stream"
    check(case, xs, topks32, weights, flags, jax_results(case, flags, *outputs))
    group.spawn(lambda g: buffers[g.rank].destroy())


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_jax_fused_ops_on_one_gpu_rank(jit):
    jax, gpus = jax_gpu()
    import mooncake_ep.jax as epj

    flags = FLAGS["fp8"]
    case = Case(num_ranks=1, num_experts=8, seed=9)
    buffers = epj.make_buffers(gpus[:1], case.size)
    xs, topks, weights = make_inputs(case, num_tokens=[11])
    (x, topk, w, active), topks32 = jax_inputs(jax, case, xs, topks, weights)

    def step(x, topk, w, active):
        recv, count, handle, active = epj.dispatch(buffers, x, topk, active, case.num_max_tokens, case.num_experts,
                                                   timeout_us=TIMEOUT_US, **flags)
        y = jax_experts(case, 0, recv, flags)
        combined, active = epj.combine(buffers, y, topk, w, active, handle, timeout_us=TIMEOUT_US)
        return recv, count, y, combined, active

    run = jax.jit(step) if jit else step
    recv, count, y, combined, active = run(x[0], topk[0], w[0], active[0])
    check(case, xs, topks32, weights, flags, jax_results(case, flags, [(recv, count)], [y], [combined], [active]))
    epj.destroy_buffers(buffers)


def test_jax_shard_map_over_several_gpus():
    jax, gpus = jax_gpu()
    if len(gpus) < 2:
        pytest.skip("needs 2 GPUs visible to JAX")
    import functools

    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import mooncake_ep.jax as epj

    flags = FLAGS["bf16"]
    case = Case(num_ranks=len(gpus), num_experts=4 * len(gpus), seed=10)
    buffers = epj.make_buffers(gpus, case.size)
    mesh = jax.sharding.Mesh(np.array(gpus), ("ep",))
    xs, topks, weights = make_inputs(case)
    topks32 = [t.astype(np.int32) for t in topks]

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))
    def step(x, topk, w, active):
        recv, count, handle, active = epj.dispatch(buffers, x, topk, active, case.num_max_tokens, case.num_experts,
                                                   timeout_us=TIMEOUT_US, **flags)
        rank = jax.lax.axis_index("ep")
        y = jax.lax.switch(rank, [functools.partial(jax_experts, case, r, flags=flags)
                                  for r in range(case.num_ranks)], recv)
        combined, active = epj.combine(buffers, y, topk, w, active, handle, timeout_us=TIMEOUT_US)
        return recv, count, y, combined, active

    put = lambda arrays: jax.device_put(np.concatenate(arrays), NamedSharding(mesh, P("ep")))  # noqa: E731
    recv, count, y, combined, active = step(put(xs), put(topks32), put(weights),
                                            put([np.ones(case.num_ranks, np.int32)] * case.num_ranks))
    n, t, R = case.num_local_experts, case.num_max_tokens, case.num_ranks
    results = [dict(recv=np.asarray(recv)[r * n:(r + 1) * n], count=np.asarray(count)[r * n:(r + 1) * n],
                    y=np.asarray(y)[r * n:(r + 1) * n], combined=np.asarray(combined)[r * t:(r + 1) * t],
                    active=np.asarray(active)[r * R:(r + 1) * R])
               for r in range(case.num_ranks)]
    check(case, xs, topks32, weights, flags, results)
    epj.destroy_buffers(buffers)


COMMAND_BUFFER_SCRIPT = textwrap.dedent("""
    import json, struct, sys
    sys.path.insert(0, sys.argv[1])
    import numpy as np, jax
    import mooncake_ep as ep
    from mooncake_ep import buffer as buffer_module, layout
    import test_gpu_frameworks as t

    launches = []
    real = buffer_module.Buffer._dispatch_launcher
    def counting(self, *args, **kwargs):
        launches.append(1)
        return real(self, *args, **kwargs)
    buffer_module.Buffer._dispatch_launcher = counting

    flags = t.FLAGS["fp8"]
    case = t.Case(num_ranks=4, num_experts=16)
    group, buffers = t.gpu_buffers(case)
    step = t.split_step(jax, buffers, case, flags)
    failures = []

    def run(name, args, case, xs, topks32, weights):
        outputs = step(*args)
        try:
            t.check(case, xs, topks32, weights, flags, t.jax_results(case, flags, *outputs))
        except AssertionError as error:
            failures.append(f"{name}: {error}")

    for seed in range(6):  # fresh values every step
        case.seed = 200 + seed
        xs, topks, weights = t.make_inputs(case)
        args, topks32 = t.jax_inputs(jax, case, xs, topks, weights)
        run(f"fresh step {seed}", args, case, xs, topks32, weights)
    def steps():  # every rank's step counters (dispatch_step[2], combine_step[2]): the kernels advance them
        state = layout.HEADER_OFFSETS["state"]
        return [list(struct.unpack("<4I", b._cuda.workspace.read(state, 16))) for b in buffers]

    before, steps_before = len(launches), steps()
    repeats = 6  # the same arrays again: the recorded graphs replay, with the epochs on the device
    for index in range(repeats):
        run(f"repeated step {index}", args, case, xs, topks32, weights)
    steps_after = steps()
    group.spawn(lambda g: buffers[g.rank].destroy())
    print(json.dumps(dict(failures=failures, repeated_calls=len(launches) - before,
                          repeated_halves=2 * case.num_ranks * repeats, repeats=repeats, steps_before=steps_before,
                          steps_after=steps_after)))
""")


def test_jax_under_xla_command_buffers_replays_correctly():
    """XLA records the ops into CUDA graphs: the Python callback runs when it records, every replay is exact.

    In a fresh process with command buffers enabled for custom calls (XLA_FLAGS), six steps with fresh
    inputs and six more with the same arrays must equal the reference. In the repeated steps the dispatch
    launcher (called only from the callback) must run fewer times than the 2 x ranks dispatch halves per
    step: the replays happened without Python, so the epochs advanced on the device alone.
    """
    jax_gpu()
    env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " --xla_gpu_graph_min_graph_size=1"
                                      " --xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL").strip(),
               XLA_PYTHON_CLIENT_PREALLOCATE="false")
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    run = subprocess.run([sys.executable, "-c", COMMAND_BUFFER_SCRIPT, tests_dir], env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["failures"] == [], report["failures"]
    # The repeated steps' outputs equal the previous ones' (same inputs): a replay that ran nothing in
    # buffers XLA handed out again would pass the comparison. The kernels' own counters say they ran.
    for rank, (before, after) in enumerate(zip(report["steps_before"], report["steps_after"])):
        dispatches, combines = sum(after[:2]) - sum(before[:2]), sum(after[2:]) - sum(before[2:])
        assert (dispatches, combines) == (report["repeats"], report["repeats"]), (
            f"rank {rank}: the repeated steps ran {dispatches} dispatches and {combines} combines, not "
            f"{report['repeats']} each (step counters {before} -> {after})")
    assert report["repeated_calls"] < report["repeated_halves"], (
        f"the callback ran {report['repeated_calls']} times for {report['repeated_halves']} dispatch halves: XLA "
        f"did not replay a recorded command buffer (check that this XLA honours "
        f"--xla_gpu_enable_command_buffer=CUSTOM_CALL)")


def test_jax_gpu_arrays_in_buffer_methods_name_mooncake_ep_jax():
    jax, gpus = jax_gpu()
    import jax.numpy as jnp

    case = Case(num_ranks=1, num_experts=4, hidden=256, num_topk=2, num_max_tokens=8)
    group = ep.LocalGroup(1, devices=[0])
    buffer = group.spawn(lambda g: ep.Buffer(g, case.size))[0]
    with jax.default_device(gpus[0]):
        x = jnp.zeros((4, 256), jnp.bfloat16)
        topk = jnp.zeros((4, 2), jnp.int32)
        active = jnp.ones(1, jnp.int32)
    with pytest.raises(TypeError, match=r"call mooncake_ep.jax.dispatch / mooncake_ep.jax.combine"):
        buffer.dispatch(x, topk, active, case.num_max_tokens, case.num_experts)
    group.spawn(lambda g: buffer.destroy())


# --- frameworks mixed ---------------------------------------------------------------------------------


def test_torch_dispatch_jax_experts_torch_combine():
    jax, gpus = jax_gpu()
    import jax.numpy as jnp

    flags = FLAGS["bf16"]
    case = Case(seed=11)
    xs, topks, weights = make_inputs(case)

    def run(g):
        r = g.rank
        buffer = ep.Buffer(g, case.size, num_sms=NUM_SMS)
        x, topk, w = to_torch(xs[r]), to_torch(topks[r]), to_torch(weights[r])
        active = torch.ones(case.num_ranks, dtype=torch.int32, device="cuda")
        ready(g)
        recv, count, handle, _, _ = buffer.dispatch(x, topk, active, case.num_max_tokens, case.num_experts,
                                                    timeout_us=TIMEOUT_US, **flags)
        settle(g)
        # JAX reads torch's recv_x through DLPack (ordered after torch's stream by the protocol), computes on
        # its own stream, and torch reads the result back the same way.
        factor = jnp.asarray(expert_scale(case, r))
        y_jax = (jax.dlpack.from_dlpack(recv).astype(jnp.float32) * factor[:, None, None]).astype(jnp.bfloat16)
        y = torch.from_dlpack(y_jax)
        assert y.device == recv.device and y.dtype == torch.bfloat16
        settle(g)
        combined, _, _ = buffer.combine(y, topk, w, active, TIMEOUT_US, handle)
        settle(g)
        result = dict(recv=to_numpy(recv), count=to_numpy(count), y=to_numpy(y), combined=to_numpy(combined),
                      active=to_numpy(active))
        buffer.destroy()
        return result

    check(case, xs, topks, weights, flags, local_group(case).spawn(run))
