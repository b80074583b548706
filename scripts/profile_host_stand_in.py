"""Host (Python) time of the GPU path's dispatch and combine calls, on any machine, GPU or not.

The real ``Buffer.dispatch`` / ``combine`` with ``out=``, down to ``CudaBackend``'s launch closures
and ``Launcher``'s argument packing; only what needs a GPU is a stand-in: torch tensors are host
memory whose type reports CUDA (a ``torch.Tensor`` subclass with torch functions disabled, so
that every attribute read is torch's own), torch's current stream is 0, the device query answers
0 and ``cuLaunchKernel`` returns at once. The decode shape's per-rank work (8 ranks, T = 128,
H = 7168, top-8 of 256 experts), fp8 dispatch.

What it is for: comparing two versions of the host path on a quiet machine. The H200 hosts move
the same code's time by up to 2x between runs (docs/performance.md), which hides a change of a
few microseconds; this CPU measures it within ~3% between runs. Absolute numbers are this
machine's, without the driver's own cost (a launch is ~2-4 us more on the H200 hosts).

    python scripts/profile_host_stand_in.py --calls 20000 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import types
from collections.abc import Callable

import torch

import mooncake_ep as ep
from mooncake_ep import _cuda_backend, kernels, tensor


class HostTensorReportingCuda(torch.Tensor):
    """Host memory that reads as a CUDA tensor on device 0 to mooncake_ep's torch reader."""

    # Versions before 2026-12-04's ninth session took the torch fast path for types of torch.* only:
    # kept, so that an old package can be measured against a new one with this script.
    __module__ = "torch.stand_in"
    __torch_function__ = torch._C._disabled_torch_function_impl

    @property
    def is_cuda(self) -> bool:
        return True

    def get_device(self) -> int:
        return 0


def packing_launcher(arg_format: str) -> kernels.Launcher:
    """A Launcher of no kernel: the arguments are packed as for a real one; the launch only counts."""
    launcher = kernels.Launcher.for_function(types.SimpleNamespace(ptr=0), "stand-in", arg_format)
    launcher.launches = 0

    def count(*args) -> None:
        launcher.launches += 1
    launcher._launch = count
    return launcher


class _RankView:
    """Rank 0 of the decode group; every rank's configuration is this one."""

    def __init__(self, world_size: int):
        self.rank, self.world_size, self.is_in_process, self.device = 0, world_size, True, 0

    def allgather_bytes(self, data: bytes) -> list[bytes]:
        return [data] * self.world_size

    def barrier(self) -> None:
        pass


def stand_in_buffer(num_ranks: int, num_tokens: int, hidden: int, num_experts: int) -> ep.Buffer:
    """A Buffer of rank 0 whose CUDA backend is real but for the driver calls."""
    group = _RankView(num_ranks)
    buffer = ep.Buffer(group, ep.Buffer.get_ep_buffer_size_hint(num_tokens, hidden, num_ranks, num_experts),
                       backend="reference")
    cuda = object.__new__(_cuda_backend.CudaBackend)
    cuda.group, cuda.device_id, cuda.num_sms, cuda.direct_peer_reads = group, 0, 16, True
    cuda.launchers = {kernels.dispatch_launcher_name(*mode): packing_launcher(kernels.DISPATCH_ARG_FORMAT)
                      for mode in kernels.DISPATCH_MODES}
    cuda.launchers["combine"] = packing_launcher(kernels.COMBINE_ARG_FORMAT)
    cuda.workspace = types.SimpleNamespace(ptr=1 << 32, num_bytes=buffer.num_ep_buffer_bytes)
    cuda.layout_table = types.SimpleNamespace(ptr=2 << 32)
    cuda._ipc, cuda._layouts, cuda._pending_layouts, cuda._agreed = None, {}, [], set()
    cuda._runtime = types.SimpleNamespace(getDevice=lambda: 0)
    cuda.upload_layouts = lambda stream_ptr: cuda._pending_layouts.clear()
    buffer._cuda, buffer.backend = cuda, "cuda"
    return buffer


def p50_rounds_us(call: Callable[[], object], calls: int, rounds: int) -> list[float]:
    """The median host time of ``call()`` in each of ``rounds`` rounds of ``calls // rounds`` calls."""
    medians = []
    for _ in range(rounds):
        times = []
        for _ in range(calls // rounds):
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
        medians.append(statistics.median(times) * 1e6)
    return medians


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--calls", type=int, default=20000, help="timed calls of each kind")
    parser.add_argument("--rounds", type=int, default=5, help="the calls run in this many rounds")
    parser.add_argument("--grad-enabled", action="store_true",
                        help="call with torch recording gradients (a training step), not under torch.no_grad() "
                             "(an inference engine's calls, the default)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if not 1 <= args.rounds <= args.calls:
        parser.error(f"--rounds must be in [1, --calls={args.calls}], got {args.rounds}")
    tensor._torch()
    tensor._torch_stream[0] = lambda device_id: 0  # torch's current stream, as it is without a GPU's
    buffer = stand_in_buffer(args.ranks, args.tokens, args.hidden, args.experts)

    def host(shape, dtype) -> torch.Tensor:
        return torch.ones(shape, dtype=dtype).as_subclass(HostTensorReportingCuda)

    rows, local_experts = args.ranks * args.tokens, args.experts // args.ranks
    x, active = host((args.tokens, args.hidden), torch.bfloat16), host((args.ranks,), torch.int32)
    topk, weights = host((args.tokens, args.topk), torch.int64), host((args.tokens, args.topk), torch.float32)
    dispatch_out = ((host((local_experts, rows, args.hidden), torch.float8_e4m3fn),
                     host((local_experts, rows, args.hidden // 128), torch.float32)), host((local_experts,), torch.int32))
    expert_out, combined = host((local_experts, rows, args.hidden), torch.bfloat16), host(tuple(x.shape), torch.bfloat16)
    handles = []

    def dispatch():
        handles[:] = [buffer.dispatch(x, topk, active, args.tokens, args.experts, out=dispatch_out)[2]]

    def combine():
        buffer.combine(expert_out, topk, weights, active, handle=handles[0], out=combined)

    torch.set_grad_enabled(args.grad_enabled)
    dispatch()
    report = {"config": vars(args), "dispatch_us_rounds": p50_rounds_us(dispatch, args.calls, args.rounds),
              "combine_us_rounds": p50_rounds_us(combine, args.calls, args.rounds)}
    launchers = buffer._cuda.launchers
    report["launches"] = {"dispatch": sum(launcher.launches for name, launcher in launchers.items() if name != "combine"),
                          "combine": launchers["combine"].launches}
    for name in ("dispatch", "combine"):
        report[f"{name}_us_best_round"] = min(report[f"{name}_us_rounds"])
        print(f"{name} out=: {statistics.median(report[f'{name}_us_rounds']):.2f} us (median of the rounds' "
              f"p50s; best round {report[f'{name}_us_best_round']:.2f} us)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
