"""How far apart do the rank launches of one forked CUDA graph start, and why?

The benchmark captures each phase as one graph that forks every in-process rank's stream from the
origin stream and joins them back. This script captures the same shape with kernels that do nothing
but stamp ``%globaltimer`` at entry (thread 0 of block 0), one per branch, and reports when each
branch's kernel started relative to the first (p50 over replays), and the replay's time between
events. It varies what might matter:

- the kernel: trivial; 128 registers a thread (the whole register file at 512 threads, as ours);
  34 KB of static shared memory (as ll_dispatch); a 15 us poll of a flag with acquire loads (as a
  receiver waiting); a 15 us spin on the timer alone; and our own ll_dispatch / ll_combine launched
  with ``phases = 0`` (they return at once; graph time only, they stamp nothing);
- the graph: every branch's kernel a root node (``unrooted``), or the fork from one node of its own
  (``rooted``, a one-warp kernel on the origin stream first), or rooted with one node after the
  join too (``rooted+sink``);
- the replay: after the previous one finished (``idle``), or queued behind it (``queued``), as the
  benchmark replays.

    python scripts/graph_fork_stagger.py --json stagger.json

A development tool: it needs a GPU, torch and cupy; nothing here is part of the library.
"""

from __future__ import annotations

import argparse
import json
import statistics

import numpy as np

from mooncake_ep import kernels
from mooncake_ep.cli import bench

SOURCE = r"""
extern "C" {
__device__ __forceinline__ unsigned long long timer_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
    return t;
}
#define STAMP_ENTRY() if (threadIdx.x == 0 && blockIdx.x == 0) stamps[rank] = timer_ns()

__global__ void trivial(unsigned long long* stamps, int rank, const int4* src, int4* dst) { STAMP_ENTRY(); }

// 28 live int4 a thread: 128 registers at 512 threads, the whole register file of an SM.
__global__ void __launch_bounds__(512, 1) registers128(unsigned long long* stamps, int rank, const int4* src, int4* dst) {
    STAMP_ENTRY();
    int4 v[28];
#pragma unroll
    for (int i = 0; i < 28; ++i) v[i] = src[(blockIdx.x * 28 + i) * blockDim.x + threadIdx.x];
#pragma unroll
    for (int i = 0; i < 28; ++i) dst[((rank * gridDim.x + blockIdx.x) * 28 + i) * blockDim.x + threadIdx.x] = v[27 - i];
}

__global__ void shared34k(unsigned long long* stamps, int rank, const int4* src, int4* dst) {
    __shared__ int buffer[8500];
    STAMP_ENTRY();
    for (int i = threadIdx.x; i < 8500; i += blockDim.x) buffer[i] = i;
    __syncthreads();
    if (threadIdx.x == 0 && buffer[rank] == -1) dst[0] = make_int4(0, 0, 0, 0);
}

// Thread 0 of every block polls a flag that is never set (acquire loads, as a receiver) for 15 us.
__global__ void poll15us(unsigned long long* stamps, int rank, const int4* src, int4* dst) {
    STAMP_ENTRY();
    if (threadIdx.x == 0) {
        const unsigned long long start = timer_ns();
        const int* flag = reinterpret_cast<const int*>(src);
        int value = 0;
        while (timer_ns() - start < 15000) {
            asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(value) : "l"(flag));
            if (value == -12345) break;
        }
    }
    __syncthreads();
}

__global__ void spin15us(unsigned long long* stamps, int rank, const int4* src, int4* dst) {
    STAMP_ENTRY();
    if (threadIdx.x == 0) {
        const unsigned long long start = timer_ns();
        while (timer_ns() - start < 15000) {
        }
    }
    __syncthreads();
}

__global__ void node(int* marker) { *marker = 0; }
}
"""
KERNELS = ("trivial", "registers128", "shared34k", "poll15us", "spin15us")
OURS = ("ll_dispatch", "ll_combine")  # launched with phases = 0
GRAPHS = ("unrooted", "rooted", "rooted+sink")
GRAPH_ENDS = dict(zip(GRAPHS, bench.GRAPH_ENDS))  # the same shapes as the benchmark's --graph-ends
REPLAYS = ("idle", "queued")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=8, help="graph branches")
    parser.add_argument("--blocks", type=int, default=16, help="blocks per kernel (SMs per rank)")
    parser.add_argument("--replays", type=int, default=50, help="timed replays per case (after 10 untimed)")
    parser.add_argument("--kernels", nargs="+", choices=KERNELS + OURS, default=list(KERNELS + OURS))
    parser.add_argument("--graphs", nargs="+", choices=GRAPHS, default=list(GRAPHS))
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    import cupy
    import torch

    from mooncake_ep import _cuda_backend

    torch.cuda.init()
    module = cupy.RawModule(code=SOURCE, options=("-std=c++17",))
    threads = kernels.NUM_THREADS
    launchers = {name: [kernels.Launcher.for_function(module.get_function(name).kernel, name, "QiQQ", threads)
                        for _ in range(args.ranks)] for name in KERNELS}
    node = [kernels.Launcher.for_function(module.get_function("node").kernel, "node", "Q", 32) for _ in range(2)]
    arch = _cuda_backend.device_arch(torch.cuda.current_device())
    ours = [kernels.load_low_latency_kernels(arch, sys_scope=False) if set(OURS) & set(args.kernels) else None
            for _ in range(args.ranks)]
    stamps = torch.zeros(args.ranks, dtype=torch.int64, device="cuda")
    src = torch.randint(0, 1 << 20, (args.blocks * 28 * threads * 4,), dtype=torch.int32, device="cuda")
    dst = torch.empty(args.ranks * args.blocks * 28 * threads * 4, dtype=torch.int32, device="cuda")
    zeros = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda")  # layout and workspace of phases = 0
    marker = torch.zeros(2, dtype=torch.int32, device="cuda")
    streams = [torch.cuda.Stream() for _ in range(args.ranks)]

    def launch(kernel: str, rank: int, stream) -> None:
        if kernel in KERNELS:
            launchers[kernel][rank](args.blocks, (stamps.data_ptr(), rank, src.data_ptr(), dst.data_ptr()), stream)
            return
        # Ours with phases = 0: it reads the (zero) layout and returns.
        name, arg_format = (("dispatch/1/0/0", kernels.DISPATCH_ARG_FORMAT) if kernel == "ll_dispatch"
                            else ("combine", kernels.COMBINE_ARG_FORMAT))
        head = (0, 0, zeros.data_ptr(), zeros.data_ptr(), rank)
        ours[rank][name](args.blocks, head + (0,) * (len(arg_format) - len(head)), stream)

    # The graph's own end nodes: a one-warp kernel each, on the stream the fork starts from.
    end_nodes = (lambda: node[0](1, (marker.data_ptr(),), torch.cuda.current_stream().cuda_stream),
                 lambda: node[1](1, (marker.data_ptr() + 4,), torch.cuda.current_stream().cuda_stream))

    def capture(kernel: str, shape: str):
        def step() -> None:
            def launch_all() -> None:
                for rank, stream in enumerate(streams):
                    launch(kernel, rank, stream.cuda_stream)
            bench.fork_join(torch, streams, launch_all, GRAPH_ENDS[shape], end_nodes)

        step()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        torch.cuda.synchronize()
        return graph

    rows = []
    for kernel in args.kernels:
        for shape in args.graphs:
            graph = capture(kernel, shape)
            for replay in REPLAYS:
                spreads, event_us = [], []
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                for i in range(10 + args.replays):
                    stamps.zero_()
                    if replay == "queued":
                        graph.replay()  # the timed replay waits behind this one
                    start.record()
                    graph.replay()
                    end.record()
                    torch.cuda.synchronize()
                    if i >= 10:
                        event_us.append(start.elapsed_time(end) * 1e3)
                        entry = stamps.cpu().numpy()
                        if kernel in KERNELS and not entry.all():
                            raise RuntimeError(f"{kernel}, {shape}: a branch's kernel did not stamp its entry")
                        spreads.append(np.sort(entry - entry.min()) / 1e3)
                row = {"kernel": kernel, "graph": shape, "replay": replay, "event_us_p50": statistics.median(event_us),
                       "entry_us_p50": None if kernel not in KERNELS else np.median(spreads, axis=0).round(2).tolist()}
                rows.append(row)
                entries = "-" if row["entry_us_p50"] is None else " ".join(f"{x:5.2f}" for x in row["entry_us_p50"])
                print(f"{kernel:13s} {shape:12s} {replay:7s} events {row['event_us_p50']:6.1f} us | entries {entries}",
                      flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
