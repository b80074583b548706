"""Probe: does programmatic dependent launch (PDL) shorten a captured fork/join graph's ends?

The benchmark's graphs are a root node, one kernel per rank on its own stream, a join and a sink
node. This times stand-in graphs of the same shape (rank kernels that spin for --work-us) with the
rank launches and the sink made programmatic or not, around each replay with CUDA events, and
reads %globaltimer stamps of one replay: root start -> first rank start, last rank end -> sink.
A development probe, not part of the library; what it found is (21) of docs/performance.md.

    python scripts/pdl_probe.py --json pdl.json
"""
from __future__ import annotations

import argparse
import ctypes
import json

import numpy as np

SOURCE = r"""
__device__ __forceinline__ unsigned long long now_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
extern "C" __global__ void root(unsigned long long* stamps, int trigger) {
    if (trigger) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    stamps[0] = now_ns();
}
// stamps[1 + 2r] first block start of rank r (atomicMin), stamps[2 + 2r] last block end (atomicMax).
extern "C" __global__ void work(unsigned long long* stamps, int rank, long long spin_ns, int wait, int trigger) {
    if (wait) asm volatile("griddepcontrol.wait;" ::: "memory");
    if (trigger) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    const unsigned long long start = now_ns();
    if (threadIdx.x == 0) atomicMin(stamps + 1 + 2 * rank, start);
    while (now_ns() - start < static_cast<unsigned long long>(spin_ns)) {}
    __syncthreads();
    if (threadIdx.x == 0) atomicMax(stamps + 2 + 2 * rank, now_ns());
}
extern "C" __global__ void sink(unsigned long long* stamps, int slot, int wait) {
    if (wait) asm volatile("griddepcontrol.wait;" ::: "memory");
    stamps[slot] = now_ns();
}
"""


class LaunchAttribute(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_char * 64)]


class LaunchConfig(ctypes.Structure):
    _fields_ = [("grid_x", ctypes.c_uint), ("grid_y", ctypes.c_uint), ("grid_z", ctypes.c_uint),
                ("block_x", ctypes.c_uint), ("block_y", ctypes.c_uint), ("block_z", ctypes.c_uint),
                ("shared_bytes", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


class Launcher:
    def __init__(self, libcuda, function_ptr: int):
        self._fn = libcuda.cuLaunchKernelEx
        self._fn.argtypes = [ctypes.POINTER(LaunchConfig), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        self._fn.restype = ctypes.c_int
        self._function = ctypes.c_void_p(function_ptr)
        self._attr = LaunchAttribute()
        self._attr.id = PROGRAMMATIC_STREAM_SERIALIZATION
        self._attr.value = (1).to_bytes(4, "little") + bytes(60)

    def __call__(self, blocks: int, threads: int, stream_ptr: int, args: list, programmatic: bool) -> None:
        config = LaunchConfig(blocks, 1, 1, threads, 1, 1, 0, stream_ptr,
                              ctypes.pointer(self._attr) if programmatic else None, 1 if programmatic else 0)
        holders = [ctypes.c_uint64(a) if kind == "p" else ctypes.c_int(a) if kind == "i" else ctypes.c_longlong(a)
                   for kind, a in args]
        params = (ctypes.c_void_p * len(holders))(*(ctypes.addressof(h) for h in holders))
        rc = self._fn(ctypes.byref(config), self._function, params, None)
        if rc != 0:
            raise RuntimeError(f"cuLaunchKernelEx failed: {rc}")


VARIANTS = {  # name: (root triggers, rank launch programmatic, rank waits, rank triggers, sink programmatic)
    "plain": (0, False, 0, 0, False),
    "pdl_ranks": (1, True, 1, 0, False),
    "pdl_ranks_nowait": (1, True, 0, 0, False),
    "pdl_ranks_root_untriggered": (0, True, 1, 0, False),
    "pdl_both": (1, True, 1, 1, True),
    "pdl_sink_only": (0, False, 0, 1, True),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 1])
    parser.add_argument("--work-us", type=float, default=30.0)
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    import cupy
    import torch

    torch.cuda.init()
    module = cupy.RawModule(code=SOURCE, options=("-std=c++17",))
    libcuda = ctypes.CDLL("libcuda.so.1")
    launch = {name: Launcher(libcuda, module.get_function(name).kernel.ptr) for name in ("root", "work", "sink")}
    report = {}
    for num_ranks in args.ranks:
        blocks = 16 if num_ranks > 1 else 132
        streams = [torch.cuda.Stream() for _ in range(num_ranks)]
        stamps = torch.empty(2 + 2 * num_ranks + 1, dtype=torch.int64, device="cuda")
        sink_slot = 1 + 2 * num_ranks
        spin_ns = int(args.work_us * 1000)
        graphs = {}
        for name, (root_trigger, rank_pdl, rank_wait, rank_trigger, sink_pdl) in VARIANTS.items():
            graph = torch.cuda.CUDAGraph()
            origin_side = torch.cuda.Stream()
            with torch.cuda.stream(origin_side):
                with torch.cuda.graph(graph, stream=origin_side):
                    origin = torch.cuda.current_stream()
                    launch["root"](1, 32, origin.cuda_stream, [("p", stamps.data_ptr()), ("i", root_trigger)], False)
                    if num_ranks == 1:  # a chain on one stream: root -> work -> sink
                        launch["work"](blocks, 128, origin.cuda_stream, [("p", stamps.data_ptr()), ("i", 0),
                                       ("q", spin_ns), ("i", rank_wait), ("i", rank_trigger)], rank_pdl)
                    else:
                        for rank, stream in enumerate(streams):
                            stream.wait_stream(origin)
                            launch["work"](blocks, 128, stream.cuda_stream, [("p", stamps.data_ptr()), ("i", rank),
                                           ("q", spin_ns), ("i", rank_wait), ("i", rank_trigger)], rank_pdl)
                        for stream in streams:
                            origin.wait_stream(stream)
                    launch["sink"](1, 32, origin.cuda_stream, [("p", stamps.data_ptr()), ("i", sink_slot),
                                   ("i", 1 if sink_pdl else 0)], sink_pdl)
            graphs[name] = graph
        torch.cuda.synchronize()
        results = {name: {"events_us": [], "root_to_first_start_us": [], "last_end_to_sink_us": [],
                          "rank_start_spread_us": []} for name in graphs}
        for _ in range(args.rounds):
            for name, graph in graphs.items():
                for _ in range(50):
                    graph.replay()
                starts = [torch.cuda.Event(enable_timing=True) for _ in range(args.iters)]
                ends = [torch.cuda.Event(enable_timing=True) for _ in range(args.iters)]
                for i in range(args.iters):
                    starts[i].record()
                    graph.replay()
                    ends[i].record()
                torch.cuda.synchronize()
                results[name]["events_us"].append(float(np.median([s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)])))
                gaps = []
                for _ in range(20):
                    stamps.zero_()
                    stamps[1:1 + 2 * num_ranks:2].fill_(np.iinfo(np.int64).max)
                    torch.cuda.synchronize()
                    graph.replay()
                    torch.cuda.synchronize()
                    s = stamps.cpu().numpy().astype(np.int64)
                    first_start = s[1:1 + 2 * num_ranks:2]
                    last_end = s[2:2 + 2 * num_ranks:2]
                    gaps.append(((first_start.min() - s[0]) / 1e3, (s[sink_slot] - last_end.max()) / 1e3,
                                 (first_start.max() - first_start.min()) / 1e3))
                g = np.median(np.array(gaps), axis=0)
                results[name]["root_to_first_start_us"].append(float(g[0]))
                results[name]["last_end_to_sink_us"].append(float(g[1]))
                results[name]["rank_start_spread_us"].append(float(g[2]))
        print(f"ranks={num_ranks} blocks/rank={blocks} work={args.work_us} us")
        for name, r in results.items():
            print(f"  {name:28s} events p50 {' / '.join(f'{v:.1f}' for v in r['events_us'])} us;"
                  f" root->first start {' / '.join(f'{v:.2f}' for v in r['root_to_first_start_us'])};"
                  f" start spread {' / '.join(f'{v:.2f}' for v in r['rank_start_spread_us'])};"
                  f" last end->sink {' / '.join(f'{v:.2f}' for v in r['last_end_to_sink_us'])}")
        report[f"ranks{num_ranks}"] = results
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
