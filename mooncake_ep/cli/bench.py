"""``python -m mooncake_ep bench``: per-phase kernel time, bandwidth and the HBM floor.

In-process ranks share the visible GPUs (one GPU: all ranks on it, each with its own stream and
``--num-sms`` SMs). Kernel times come from one CUDA graph per phase that holds every rank's launch
(a fork/join of the rank streams), replayed and timed with events on the origin stream: a phase's
time is the time until the slowest rank finishes. Host time per call is measured separately on eager
calls. Inputs rotate among ``--input-sets`` sets so that the L2 cache does not flatter small shapes.

The HBM floor of a phase is the fewest bytes it must move through device memory (dispatch: read
each token once, write each copy once into recv_x; combine: read each expert output row once, write
each combined token once), divided by the device-to-device copy bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

import mooncake_ep as ep

DEFAULTS_DECODE = dict(ranks=8, tokens=128, hidden=7168, topk=8, experts=256)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ranks", type=int, default=DEFAULTS_DECODE["ranks"], help="in-process ranks")
    parser.add_argument("--tokens", type=int, default=DEFAULTS_DECODE["tokens"], help="tokens per rank (T)")
    parser.add_argument("--hidden", type=int, default=DEFAULTS_DECODE["hidden"])
    parser.add_argument("--topk", type=int, default=DEFAULTS_DECODE["topk"])
    parser.add_argument("--experts", type=int, default=DEFAULTS_DECODE["experts"])
    parser.add_argument("--fp8", action=argparse.BooleanOptionalAction, default=True, help="fp8 dispatch")
    parser.add_argument("--num-sms", type=int, default=None, help="SMs per rank (default: the GPU shared evenly)")
    parser.add_argument("--routing", choices=("uniform", "zipf", "k_hot"), default="uniform")
    parser.add_argument("--alpha", type=float, default=1.2, help="zipf exponent")
    parser.add_argument("--hot-fraction", type=float, default=0.5, help="k_hot: share of tokens that go hot")
    parser.add_argument("--hot-experts", type=int, default=8, help="k_hot: the first N experts are hot")
    parser.add_argument("--warmup", type=int, default=20, help="untimed replays")
    parser.add_argument("--iters", type=int, default=200, help="timed replays per phase")
    parser.add_argument("--input-sets", type=int, default=4, help="input sets rotated between replays")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH", default=None, help="write the report as JSON")


def route(rng: np.random.Generator, args, num_tokens: int) -> np.ndarray:
    """``[num_tokens, topk]`` int64 distinct expert ids per token, by the chosen routing."""
    if args.routing == "uniform":
        probs = np.full(args.experts, 1.0 / args.experts)
    elif args.routing == "zipf":
        probs = 1.0 / np.arange(1, args.experts + 1) ** args.alpha
        probs = rng.permutation(probs / probs.sum())
    else:
        probs = None
    topk = np.empty((num_tokens, args.topk), dtype=np.int64)
    for t in range(num_tokens):
        if probs is None:
            hot = rng.random() < args.hot_fraction
            pool = max(args.hot_experts, args.topk) if hot else args.experts
            topk[t] = rng.choice(pool, args.topk, replace=False)
        else:
            topk[t] = rng.choice(args.experts, args.topk, replace=False, p=probs)
    return topk


def percentiles(times_us: list[float]) -> dict:
    values = np.asarray(times_us)
    return {"p50_us": float(np.percentile(values, 50)), "p90_us": float(np.percentile(values, 90)),
            "p99_us": float(np.percentile(values, 99))}


def run(args) -> int:
    import torch

    if not torch.cuda.is_available():
        print("bench: no CUDA GPU visible; the kernel benchmark needs one")
        return 1
    num_gpus = torch.cuda.device_count()
    devices = [r % num_gpus for r in range(args.ranks)]
    group = ep.LocalGroup(args.ranks, devices=devices)
    size = ep.Buffer.get_ep_buffer_size_hint(args.tokens, args.hidden, args.ranks, args.experts)
    buffers = group.spawn(lambda g: ep.Buffer(g, size, num_sms=args.num_sms))
    streams = [torch.cuda.ExternalStream(group.rank_group(r).stream_ptr, device=f"cuda:{devices[r]}")
               for r in range(args.ranks)]

    rng = np.random.default_rng(args.seed)
    num_local = args.experts // args.ranks
    sets = []
    for _ in range(args.input_sets):
        per_rank = []
        for r in range(args.ranks):
            device = f"cuda:{devices[r]}"
            topk = route(rng, args, args.tokens)
            per_rank.append(dict(
                x=torch.randn(args.tokens, args.hidden, device=device).to(torch.bfloat16),
                topk=torch.from_numpy(topk).to(device),
                weights=torch.rand(args.tokens, args.topk, device=device),
                expert_out=torch.randn(num_local, args.ranks * args.tokens, args.hidden, device=device).to(torch.bfloat16),
                active=torch.ones(args.ranks, dtype=torch.int32, device=device),
                routes=topk,
            ))
        sets.append(per_rank)

    def dispatch_all(inputs, handles):
        for r in range(args.ranks):
            with torch.cuda.stream(streams[r]):
                _, _, handles[r], _, _ = buffers[r].dispatch(inputs[r]["x"], inputs[r]["topk"], inputs[r]["active"],
                                                             args.tokens, args.experts, use_fp8=args.fp8)

    def combine_all(inputs, handles, zero_copy):
        for r in range(args.ranks):
            with torch.cuda.stream(streams[r]):
                buffers[r].combine(None if zero_copy else inputs[r]["expert_out"], inputs[r]["topk"],
                                   inputs[r]["weights"], inputs[r]["active"], -1, handles[r], zero_copy=zero_copy)

    def forked(fn):
        """Run fn with every rank stream ordered after, and joined back into, the current stream."""
        origin = torch.cuda.current_stream()
        for s in streams:
            s.wait_stream(origin)
        fn()
        for s in streams:
            origin.wait_stream(s)

    # Eager warm-up (uploads each configuration's layout) and host time per call.
    handles = [None] * args.ranks
    forked(lambda: (dispatch_all(sets[0], handles), combine_all(sets[0], handles, False)))
    torch.cuda.synchronize()
    host = {"dispatch": [], "combine": []}
    for i in range(args.warmup + 20):
        inputs = sets[i % len(sets)]
        origin = torch.cuda.current_stream()
        for s in streams:
            s.wait_stream(origin)
        start = time.perf_counter()
        dispatch_all(inputs, handles)
        middle = time.perf_counter()
        combine_all(inputs, handles, False)
        end = time.perf_counter()
        for s in streams:
            origin.wait_stream(s)
        torch.cuda.synchronize()
        if i >= args.warmup:
            host["dispatch"].append((middle - start) / args.ranks * 1e6)
            host["combine"].append((end - middle) / args.ranks * 1e6)

    # One graph per (phase, input set); the combine graphs answer the dispatch graph of their set.
    pool = torch.cuda.graph_pool_handle()
    graphs = {"dispatch": [], "combine": [], "combine_zero_copy": [], "step": []}
    for inputs in sets:
        set_handles = [None] * args.ranks
        for phase in graphs:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                if phase == "dispatch":
                    forked(lambda: dispatch_all(inputs, set_handles))
                elif phase == "step":
                    forked(lambda: (dispatch_all(inputs, set_handles), combine_all(inputs, set_handles, False)))
                else:
                    forked(lambda: combine_all(inputs, set_handles, phase == "combine_zero_copy"))
            graphs[phase].append(graph)
    torch.cuda.synchronize()

    def time_phase(phase: str) -> list[float]:
        times = []
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(args.iters)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(args.iters)]
        for i in range(args.warmup + args.iters):
            k = i % len(sets)
            if phase.startswith("combine"):
                graphs["dispatch"][k].replay()  # combine answers this set's dispatch
            if i >= args.warmup:
                starts[i - args.warmup].record()
            graphs[phase][k].replay()
            if i >= args.warmup:
                ends[i - args.warmup].record()
        torch.cuda.synchronize()
        for start, end in zip(starts, ends):
            times.append(start.elapsed_time(end) * 1e3)
        return times

    kernel = {phase: percentiles(time_phase(phase)) for phase in graphs}

    # Device-to-device copy bandwidth, bytes read + written, on a buffer far larger than L2.
    copy_bytes = 1 << 30
    src = torch.empty(copy_bytes, dtype=torch.uint8, device="cuda:0").random_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    copy_bandwidth = 2 * copy_bytes * 10 / (start.elapsed_time(end) * 1e-3)
    if num_gpus > 1 and args.ranks > 1:
        copy_bandwidth *= min(num_gpus, args.ranks)  # every GPU copies at once

    copies = float(np.mean([sum(int((inp["routes"] >= 0).sum()) for inp in per_rank) for per_rank in sets]))
    tokens = args.ranks * args.tokens
    hidden = args.hidden
    scale_bytes = hidden // 128 * 4
    dispatch_copy_bytes = (hidden + scale_bytes) if args.fp8 else 2 * hidden
    # The fewest bytes each phase must move through HBM, whatever the protocol: read every token
    # once and write every copy once (dispatch); read every expert output row once and write every
    # combined token once (combine, with or without zero-copy: the copy into the workspace is
    # this implementation's cost, not the floor's).
    combine_floor = copies * 2 * hidden + tokens * 2 * hidden
    floor_bytes = {
        "dispatch": tokens * 2 * hidden + copies * dispatch_copy_bytes,
        "combine": combine_floor,
        "combine_zero_copy": combine_floor,
    }
    floor_bytes["step"] = floor_bytes["dispatch"] + floor_bytes["combine"]
    deepep_bytes = {
        "dispatch": copies * ((hidden + scale_bytes + 16) if args.fp8 else (2 * hidden + 16)),
        "combine": copies * 2 * hidden,
        "combine_zero_copy": copies * 2 * hidden,
    }
    deepep_bytes["step"] = deepep_bytes["dispatch"] + deepep_bytes["combine"]
    report = {
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name(0),
        "config": {k: getattr(args, k) for k in ("ranks", "tokens", "hidden", "topk", "experts", "fp8", "num_sms",
                                                 "routing", "iters", "input_sets")},
        "num_sms_per_rank": buffers[0]._cuda.num_sms,
        "copy_bandwidth_gbps": copy_bandwidth / 1e9,
        "copies": copies,
        "host_us_per_call": {k: float(np.median(v)) for k, v in host.items()},
        "phases": {},
    }
    for phase, stats in kernel.items():
        floor_us = floor_bytes[phase] / copy_bandwidth * 1e6
        report["phases"][phase] = dict(
            stats,
            floor_us=floor_us,
            ratio_to_floor=stats["p50_us"] / floor_us,
            hbm_bytes_floor=floor_bytes[phase],
            deepep_gbps_per_rank=deepep_bytes[phase] / args.ranks / (stats["p50_us"] * 1e-6) / 1e9,
        )

    print(f"{report['device']}: {args.ranks} ranks x {report['num_sms_per_rank']} SMs, T={args.tokens}, H={hidden}, "
          f"top-{args.topk} of {args.experts}, {'fp8' if args.fp8 else 'bf16'} dispatch, routing {args.routing}; "
          f"copy bandwidth {report['copy_bandwidth_gbps']:.0f} GB/s")
    print(f"{'phase':<18}{'p50 us':>9}{'p90 us':>9}{'p99 us':>9}{'floor us':>10}{'ratio':>7}{'GB/s/rank':>11}")
    for phase, row in report["phases"].items():
        print(f"{phase:<18}{row['p50_us']:>9.1f}{row['p90_us']:>9.1f}{row['p99_us']:>9.1f}{row['floor_us']:>10.1f}"
              f"{row['ratio_to_floor']:>7.2f}{row['deepep_gbps_per_rank']:>11.1f}")
    print("host us per call: " + ", ".join(f"{k} {v:.1f}" for k, v in report["host_us_per_call"].items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    group.spawn(lambda g: buffers[g.rank].destroy())
    return 0
