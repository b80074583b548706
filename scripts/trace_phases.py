"""Where does a phase spend its time? Per-block timestamps of every rank's kernels in one replay.

Builds the kernels with EP_TRACE=1 (kernels_cu/trace.cuh), captures the benchmark's graphs (one
dispatch graph and one combine graph, each holding every rank's launches, forked from one stream),
replays them, and reads back each rank's trace of the last replay. Prints, per rank, the points
relative to the earliest dispatch send entry of any rank (microseconds): min over blocks for entry
points, max over blocks for completion points. A development tool: the traced kernels are slower
by one global store per block and point, and nothing here is part of the library.

    python scripts/trace_phases.py --ranks 8 --tokens 128 --json trace.json
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

import mooncake_ep as ep
from mooncake_ep import kernels
from mooncake_ep.cli import bench

import ab_kernels  # scripts/, beside this one: its macro syntax and checks

POINTS = ("send_entry", "send_done", "flags_stored", "recv_entry", "flags_seen", "plan_ready", "rows_done",
          "recv_exit", "staging_seen", "lists_counted", "lists_prefix", "lists_loaded", "lists_bits",
          "lists_slots", "offsets_loaded", "first_row")
NUM_POINTS, MAX_BLOCKS, MAX_RANKS = 16, 256, 8  # kernels_cu/trace.cuh


def traced_macros(original, extra: dict | None = None, trace: bool = True):
    """``kernels._common_macros`` with an experiment's ``extra`` macros, and EP_TRACE=1 with ``trace``
    (also scripts/repeat_case.py's)."""
    added = (extra or {}) | ({"EP_TRACE": 1} if trace else {})

    def macros(sys_scope: bool) -> dict:
        return original(sys_scope) | added
    return macros


def trace_address(launcher) -> tuple[int, int]:
    """Device address and size of the ``ep_trace`` array of the launcher's module."""
    return module_trace_address(launcher._function.module.ptr)


def module_trace_address(module_ptr: int) -> tuple[int, int]:
    """Device address and size of the ``ep_trace`` array of a loaded module (a ``CUmodule``)."""
    from cuda.bindings import driver

    err, dptr, size = driver.cuModuleGetGlobal(driver.CUmodule(module_ptr), b"ep_trace")
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuModuleGetGlobal(ep_trace): {err}")
    assert size == MAX_RANKS * NUM_POINTS * MAX_BLOCKS * 8, size
    return int(dptr), int(size)


def clear_all_traces() -> None:
    """Zero the trace of every module this process loaded (kernels._modules)."""
    import cupy

    for module in kernels._modules.values():
        address, size = module_trace_address(module.ptr)
        cupy.cuda.runtime.memset(address, 0, size)
    cupy.cuda.runtime.deviceSynchronize()


def read_trace(launcher, rank: int) -> np.ndarray:
    """``[NUM_POINTS, MAX_BLOCKS]`` u64 timestamps (ns) of ``rank``'s launches of the launcher's
    module (in-process ranks of one device share it); 0 = not written."""
    import cupy

    address, size = trace_address(launcher)
    host = np.zeros((MAX_RANKS, NUM_POINTS, MAX_BLOCKS), dtype=np.uint64)
    cupy.cuda.runtime.memcpy(host.ctypes.data, address, size, cupy.cuda.runtime.memcpyDeviceToHost)
    return host[rank]


def summarize(trace: np.ndarray, num_blocks: int, t0: int) -> dict:
    """Per point, min and max over blocks (us from t0); block 0 (the dispatch list builder) apart."""
    out = {"block0_send_done_us": float((int(trace[1, 0]) - t0) / 1e3) if trace[1, 0] else None,
           "others_send_done_us": (float((trace[1, 1:num_blocks].astype(np.int64).max() - t0) / 1e3)
                                   if num_blocks > 1 and trace[1, 1:num_blocks].any() else None),
           "per_block_us": {p: [((int(v) - t0) / 1e3 if v else None) for v in trace[i, :num_blocks]]
                            for i, p in enumerate(POINTS)}}
    for i, name in enumerate(POINTS):
        values = trace[i, :num_blocks].astype(np.int64)
        written = values[values > 0]
        if written.size == 0:
            out[name] = None
            continue
        rel = (written - t0) / 1e3
        out[name] = {"min_us": float(rel.min()), "max_us": float(rel.max())}
    return out


def profile_range(torch, graphs: dict, replays: int, phases: tuple[str, ...] = ("dispatch", "combine")) -> None:
    """Replay each graph of ``phases`` ``replays`` times, in that order, between cudaProfilerStart
    and Stop, after two kernels of known bytes on buffers of their own: an elementwise pass over
    64 MiB (64 MiB read and 64 MiB written; a plain copy would be a memcpy, which a kernel profiler
    does not see) and a fill of 64 MiB (written only). Synchronised between them."""
    num_bytes = 64 << 20
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda").random_()
    dst, filled = torch.empty_like(src), torch.empty_like(src)
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    torch.bitwise_not(src, out=dst)
    torch.cuda.synchronize()
    filled.fill_(0x5A)
    torch.cuda.synchronize()
    for _ in range(replays):
        for name in phases:
            graphs[name].replay()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--num-sms", type=int, default=None)
    parser.add_argument("--fp8", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--zero-copy", action="store_true", help="trace the zero-copy combine")
    parser.add_argument("--fp8-scales", choices=("made", "row-major"), default="made",
                        help="the fp8 scales as the call makes them (DeepEP's column-major layout, for torch), or "
                             "row-major arrays given as out=")
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--warmup-ms", type=float, default=bench.WARMUP_MS,
                        help="replay both graphs back to back this long first, as the benchmark warms up each phase "
                             "(the first tens of ms of load run slower)")
    parser.add_argument("--graph-ends", choices=bench.GRAPH_ENDS, default="both",
                        help="nodes of the graph's own around each fork/join, as the benchmark's --graph-ends")
    parser.add_argument("--macro", action="append", default=[], metavar="EP_NAME=INTEGER",
                        type=lambda item: ab_kernels.parse_macro(item, "the macro"),
                        help="an extra NVRTC macro for every kernel (a variant under test, as scripts/ab_kernels.py)")
    parser.add_argument("--trace", action=argparse.BooleanOptionalAction, default=True,
                        help="build with EP_TRACE and print the timeline; --no-trace: the library's own kernels")
    parser.add_argument("--profiler-range", type=int, default=0, metavar="REPLAYS",
                        help="after the timed replays, this many replays of each graph (and an elementwise pass and "
                             "a fill of 64 MiB, to calibrate) between cudaProfilerStart and Stop: for "
                             "`ncu --profile-from-start off --graph-profiling graph`, which profiles each graph "
                             "replay as one workload, its rank kernels running together")
    parser.add_argument("--profiler-phases", choices=("both", "dispatch"), default="both",
                        help="the graphs --profiler-range replays: both phases in turn, or dispatch alone (whose "
                             "replays then write back only what earlier dispatches left in L2)")
    parser.add_argument("--clean-l2-mb", type=int, default=0, metavar="MB",
                        help="before each timed and the traced replay, read MB of another buffer (untimed): the "
                             "L2 then holds no dirty lines of the previous replays, whose write-back the "
                             "phase would otherwise share the memory with")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.ranks > MAX_RANKS:
        parser.error(f"--ranks: the trace holds at most {MAX_RANKS} ranks (EP_TRACE_MAX_RANKS)")
    if args.fp8_scales != "made" and not args.fp8:
        parser.error("--fp8-scales lays out fp8 dispatch's scales; --no-fp8 dispatches bf16")

    import torch

    if args.trace or args.macro:
        kernels._common_macros = traced_macros(kernels._common_macros, dict(args.macro), trace=args.trace)
    group = ep.LocalGroup(args.ranks, devices=[0] * args.ranks)
    size = ep.Buffer.get_ep_buffer_size_hint(args.tokens, args.hidden, args.ranks, args.experts)
    buffers = group.spawn(lambda g: ep.Buffer(g, size, num_sms=args.num_sms))
    streams = [torch.cuda.ExternalStream(group.rank_group(r).stream_ptr) for r in range(args.ranks)]
    rng = np.random.default_rng(0)
    num_local = args.experts // args.ranks
    inputs = []
    for _ in range(args.ranks):
        topk = np.stack([rng.choice(args.experts, args.topk, replace=False) for _ in range(args.tokens)])
        inputs.append(dict(
            x=torch.randn(args.tokens, args.hidden, device="cuda").to(torch.bfloat16),
            topk=torch.from_numpy(topk).cuda(),
            weights=torch.rand(args.tokens, args.topk, device="cuda"),
            expert_out=torch.randn(num_local, args.ranks * args.tokens, args.hidden, device="cuda").to(torch.bfloat16),
            active=torch.ones(args.ranks, dtype=torch.int32, device="cuda")))
        if args.fp8 and args.fp8_scales == "row-major":
            rows = args.ranks * args.tokens
            inputs[-1]["out"] = (
                (torch.empty(num_local, rows, args.hidden, dtype=torch.float8_e4m3fn, device="cuda"),
                 torch.empty(num_local, rows, args.hidden // 128, dtype=torch.float32, device="cuda")),
                torch.empty(num_local, dtype=torch.int32, device="cuda"))
    handles = [None] * args.ranks

    end_nodes = bench.marker_end_nodes(torch)

    def forked(fn, ends="none"):
        bench.fork_join(torch, streams, fn, ends, end_nodes)

    def dispatch_all():
        for r, inp in enumerate(inputs):
            with torch.cuda.stream(streams[r]):
                _, _, handles[r], _, _ = buffers[r].dispatch(inp["x"], inp["topk"], inp["active"], args.tokens,
                                                             args.experts, use_fp8=args.fp8, out=inp.get("out"))

    def combine_all():
        for r, inp in enumerate(inputs):
            with torch.cuda.stream(streams[r]):
                buffers[r].combine(None if args.zero_copy else inp["expert_out"], inp["topk"], inp["weights"],
                                   inp["active"], -1, handles[r], zero_copy=args.zero_copy)

    forked(lambda: (dispatch_all(), combine_all()))
    torch.cuda.synchronize()
    graphs = {}
    for name, fn in (("dispatch", dispatch_all), ("combine", combine_all)):
        graphs[name] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[name]):
            forked(fn, ends=args.graph_ends)
    torch.cuda.synchronize()
    start_s = time.perf_counter()
    while (time.perf_counter() - start_s) * 1e3 < args.warmup_ms:
        for _ in range(10):
            for name in ("dispatch", "combine"):
                graphs[name].replay()
        torch.cuda.synchronize()
    clean_l2 = l2_cleaner(torch, args.clean_l2_mb)
    event_us = {"dispatch": [], "combine": []}
    for _ in range(args.replays):
        for name in ("dispatch", "combine"):
            clean_l2()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graphs[name].replay()
            end.record()
            torch.cuda.synchronize()
            event_us[name].append(start.elapsed_time(end) * 1e3)

    if args.profiler_range:
        profile_range(torch, graphs, args.profiler_range,
                      ("dispatch", "combine") if args.profiler_phases == "both" else ("dispatch",))
    report = {"config": vars(args), "event_us_p50": {k: float(np.median(v)) for k, v in event_us.items()}}
    if args.trace:
        report |= timeline(args, buffers, graphs, event_us, clean_l2)
    else:
        print("event p50 us: " + ", ".join(f"{k} {v:.1f}" for k, v in report["event_us_p50"].items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    group.spawn(lambda g: buffers[g.rank].destroy())


def l2_cleaner(torch, megabytes: int):
    """A function that reads ``megabytes`` of a buffer of its own and waits (a no-op for 0): the L2's dirty
    lines (the last replays' outputs) are written back during it, not during the next phase."""
    if not megabytes:
        return lambda: None
    block = torch.ones(megabytes << 20, dtype=torch.uint8, device="cuda")

    def clean() -> None:
        block.sum(dtype=torch.int64)
        torch.cuda.synchronize()
    return clean


def timeline(args, buffers, graphs: dict, event_us: dict, clean_l2) -> dict:
    """The traced timeline of one more replay of each graph, printed per rank; returns the report's
    ``num_sms`` and ``phases``."""
    import torch

    # On cleared traces: only the last block of a phase writes points 2 and 7, so uncleared slots
    # would hold earlier replays' values.
    dispatch_name = kernels.dispatch_launcher_name(args.fp8, False, False)
    launchers = {"dispatch": [b._cuda.launchers[dispatch_name] for b in buffers],
                 "combine": [b._cuda.launchers["combine"] for b in buffers]}
    clear_all_traces()
    for name in ("dispatch", "combine"):
        clean_l2()
        graphs[name].replay()
    torch.cuda.synchronize()
    traces = {name: [read_trace(launcher, r) for r, launcher in enumerate(launchers[name])] for name in launchers}
    num_blocks = buffers[0]._cuda.num_sms
    report = {"num_sms": num_blocks, "phases": {}}
    for name in ("dispatch", "combine"):
        entries = np.concatenate([t[0, :num_blocks] for t in traces[name]]).astype(np.int64)
        t0 = int(entries[entries > 0].min())
        rows = [summarize(t, num_blocks, t0) for t in traces[name]]
        report["phases"][name] = rows
        print(f"== {name}: {np.median(event_us[name]):.1f} us between events (p50 of {args.replays} replays);"
              f" points in us from the first send entry; entry points min, others max over blocks")
        print(f"{'rank':>4}" + "".join(f"{p:>13}" for p in POINTS) + f"{'blk0_send':>11}{'rest_send':>11}")
        for r, row in enumerate(rows):
            cells = []
            for i, p in enumerate(POINTS):
                v = row[p]
                if v is None:
                    cells.append(f"{'-':>13}")
                elif p in ("send_entry", "recv_entry"):
                    cells.append(f"{v['min_us']:>6.1f}-{v['max_us']:<6.1f}")
                else:
                    cells.append(f"{v['max_us']:>13.1f}")
            extra = "".join(f"{'-':>11}" if row[k] is None else f"{row[k]:>11.1f}"
                            for k in ("block0_send_done_us", "others_send_done_us"))
            print(f"{r:>4}" + "".join(cells) + extra)
    return report


if __name__ == "__main__":
    main()
