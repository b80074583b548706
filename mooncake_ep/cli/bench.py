"""``python -m mooncake_ep bench``: per-phase kernel time, bandwidth, the HBM floor and a torch baseline.

In-process ranks share the visible GPUs (one GPU: all ranks on it, each with its own stream and
``--num-sms`` SMs). Kernel times come from one CUDA graph per phase that holds every rank's launch
(a fork/join of the rank streams), replayed and timed with events on the origin stream: a phase's
time is the time until the slowest rank finishes. Events recorded inside a copy of each graph
(``--inner-events``) also time its replays from its root node's end to every rank's end, without
the graph's launch and its own end nodes. With in-process ranks and graphs, each phase's
replays are also profiled apart (``--kernel-span``, mooncake_ep.cli.kernel_span): the span of its
kernels alone, from the first to start to the last to end over every rank, without the graph's own
nodes, fork and join that the events also time; and its graph span, over every node of the replay,
those included. ``--no-graph`` times the same calls made eagerly, every rank's from this one
thread: the time then includes the host issuing ranks one after another.
``--mode`` picks how the calls run: ``sync`` on the caller's stream, ``async`` with ``async_finish``
(the communication stream, joined back through the returned event), ``hook`` with
``return_recv_hook`` (every rank's send half, then every rank's receive hook). Host time per call is
measured separately on eager calls (results allocated by the call), inside each call only: the
benchmark's own stream switches between ranks are left out; in hook mode the hooks are reported
apart (``dispatch_hook``, ``combine_hook``). Inputs rotate among ``--input-sets`` sets so that the
L2 cache does not flatter small shapes.

The HBM floor of a phase is the fewest bytes it must move through device memory (dispatch: read
each token once, write each copy once into recv_x; combine: read each expert output row once, write
each combined token once), divided by the device-to-device copy bandwidth measured in the same run.
``load`` says how unevenly the routing falls: the busiest expert's and the busiest rank's copies over
the mean (a phase waits for the busiest rank).

Ranks as processes: ``--launch N`` starts N processes on this host, one rank each, joined through
``mooncake_ep.init_group()`` (on a GPU each uses ``LOCAL_RANK`` modulo the visible GPUs, the ``ipc``
transport between them); ``--group init`` is one such process, for a launcher such as torchrun. Each
rank times its own calls on its own stream, every iteration starting at a barrier of the group, and
an iteration lasts until the slowest rank is done; rank 0 reports. There is no baseline there.

Baseline (``--baseline``, on by default): the same dispatch and combine written with plain torch
operations (mooncake_ep.cli.baseline: sort by expert, index_select, per-rank copies, index_add_),
timed in the same run on the same input sets. It reads its counts on the host, so it cannot be
captured in a graph: it is timed on eager calls, every rank's work issued from one thread on the
current stream, with CUDA events around all ranks' work of a call. Each phase reports
speedup_vs_baseline = baseline p50 / mooncake_ep p50 (zero-copy combine against the baseline's combine).

Without a GPU, or with ``--backend reference``, the command runs on the numpy reference backend
with a small default shape and times with time.perf_counter: host wall time, not kernel time
(``"timer": "host"`` in the JSON; copy bandwidth and floors are null). The JSON schema is the same,
so CI smoke-tests the command; the numbers say nothing about the kernels.

``--plot PATH`` also sweeps tokens per rank over ``--sweep-tokens`` (one measurement per point) and
draws p50 latency against tokens for dispatch and combine, mooncake_ep and the baseline, with the
HBM floor on a GPU.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import platform
import time
from collections.abc import Callable, Sequence

import numpy as np

import mooncake_ep as ep
from mooncake_ep.cli import (EXIT_OK, CheckFailed, OutputError, UsageError, check_host_memory, check_moe_shape,
                             check_output_path, kernel_span, launch, write_json)
from mooncake_ep.cli.gpu import choose_backend

DEFAULTS_DECODE = dict(ranks=8, tokens=128, hidden=7168, topk=8, experts=256)
# The reference backend is numpy on one host thread per rank: a shape it runs in milliseconds.
DEFAULTS_REFERENCE = dict(ranks=2, tokens=16, hidden=256, topk=2, experts=8)
PHASES = ("dispatch", "combine", "combine_zero_copy", "step")
BASELINE_PHASES = ("dispatch", "combine", "step")
# The baseline phase each phase is compared with: to the user a zero-copy combine is still a combine.
BASELINE_OF = {"dispatch": "dispatch", "combine": "combine", "combine_zero_copy": "combine", "step": "step"}
# Issue 7's range of tokens per rank: 1 to 512 for decode, up to 4096 for prefill.
DEFAULT_SWEEP_TOKENS = "1,2,4,8,16,32,64,128,256,512"
MAX_SWEEP_TOKENS = 4096
# A progress bar appears only once a measurement has run this long (tqdm's delay): long runs only.
PROGRESS_DELAY_S = 2.0
# Host iterations timed for host time per call on the GPU path (after --warmup untimed ones).
HOST_TIMED_CALLS = 20
# Microseconds a call waits for a peer. Finite, so that a stall ends as a masked rank and an error
# (check_no_rank_masked) instead of a hang; healthy calls take microseconds.
KERNEL_TIMEOUT_US = 10_000_000
MODES = ("sync", "async", "hook")
# Milliseconds of untimed replays before a phase is timed (--warmup-ms). At T = 1024 the first ~30 ms
# of back-to-back dispatch replays ran ~10% slower than every later round on the H200
# (docs/performance.md, (18)).
WARMUP_MS = 100.0
WARMUP_MS_MAX = 60_000.0
# Milliseconds the GPU is held (a spin kernel on the timing stream) while the host queues a phase's
# timed replays (--hold-ms). Without it a replay shorter than the host's launch of it (the 8-rank
# dispatch graph, ~37 us) is timed at the host's pace: in one process of scripts/ab_kernels.py the
# events around it read 37.0 then 41.6-53.7 us while its CUPTI graph span stayed at 36.8-38.0
# (docs/performance.md, (22)).
HOLD_MS = 50.0
HOLD_MS_MAX = 10_000.0
# Nodes of the graph's own at the ends of each captured fork/join (--graph-ends).
GRAPH_ENDS = ("none", "root", "both")


def inner_events_timed(args) -> bool:
    """Whether --inner-events applies: graphs with a root node to start them from."""
    return args.inner_events and args.graph and args.graph_ends != "none"


def in_process_graphs(args, group) -> bool:
    """Whether the phases run as graphs of ranks in this process: what --hold-ms applies to (eager
    calls are timed with their launches; ranks in processes meet at a barrier before every replay)."""
    return args.graph and group is None


def spans_profiled(args, group) -> bool:
    """Whether --kernel-span applies: graphs of ranks in this process (a profile sees one process)."""
    return args.kernel_span and in_process_graphs(args, group)


def call_flags(mode: str) -> dict:
    """The dispatch/combine keyword arguments of a --mode."""
    return dict(async_finish=mode == "async", return_recv_hook=mode == "hook")


class ByBackend:
    """A flag's default that depends on the backend: the decode shape on a GPU, a small one on the reference."""

    def __init__(self, cuda: int, reference: int):
        self.cuda = cuda
        self.reference = reference

    def __str__(self) -> str:  # what --help shows as the default
        return f"{self.cuda} on a GPU, {self.reference} on the reference backend"

    def resolve(self, backend: str) -> int:
        return self.cuda if backend == "cuda" else self.reference


def sweep_tokens(text: str) -> tuple[int, ...]:
    """``"1,2,4"`` → ``(1, 2, 4)``: the tokens per rank of a sweep, each in ``[1, MAX_SWEEP_TOKENS]``."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers such as 1,4,16, got {text!r}") from None
    bad = [v for v in values if not 1 <= v <= MAX_SWEEP_TOKENS]
    if bad:
        raise argparse.ArgumentTypeError(f"tokens per rank must be in [1, {MAX_SWEEP_TOKENS}], got {bad[0]}")
    return tuple(sorted(set(values)))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    def shape(name: str) -> ByBackend:
        return ByBackend(DEFAULTS_DECODE[name], DEFAULTS_REFERENCE[name])

    parser.add_argument("--backend", choices=("auto", "cuda", "reference"), default="auto",
                        help="auto: the GPU kernels if a GPU is usable, else the numpy reference (host wall time)")
    parser.add_argument("--ranks", type=int, default=shape("ranks"),
                        help="in-process ranks; with --launch or --group init the ranks are processes, and --ranks, "
                             "if given, must match their number")
    launch.add_arguments(parser, "bench")
    parser.add_argument("--tokens", type=int, default=shape("tokens"), help="tokens per rank (T)")
    parser.add_argument("--hidden", type=int, default=shape("hidden"), help="hidden size, a multiple of 128")
    parser.add_argument("--topk", type=int, default=shape("topk"), help="experts per token")
    parser.add_argument("--experts", type=int, default=shape("experts"), help="experts in all, a multiple of --ranks")
    parser.add_argument("--fp8", action=argparse.BooleanOptionalAction, default=True, help="fp8 dispatch")
    parser.add_argument("--fp8-scales", choices=("made", "swapped", "row-major"), default="made",
                        help="fp8 dispatch's results: made by each call (the scales in DeepEP's layout, column-major "
                             "in their last two dimensions), or given as out= (made once) with the scales in that "
                             "layout (swapped) or row-major")
    parser.add_argument("--num-sms", type=int, default=None, help="SMs per rank (default: the GPU shared evenly)")
    parser.add_argument("--mode", choices=MODES, default="sync",
                        help="sync: on the caller's stream; async: async_finish=True (the communication stream, "
                             "joined back by the event); hook: return_recv_hook=True (every rank's send half, "
                             "then every rank's hook)")
    parser.add_argument("--graph", action=argparse.BooleanOptionalAction, default=None,
                        help="time replays of one CUDA graph per phase (default on a GPU); --no-graph: eager "
                             "calls, every rank's launches issued from this thread")
    parser.add_argument("--graph-ends", choices=GRAPH_ENDS, default="both",
                        help="nodes of its own at the ends of each captured fork/join of the rank streams: "
                             "root (one before the fork), both (and one after the join), or none (every "
                             "rank's first launch a root of the graph: they start 0.7-1.6 us apart each)")
    parser.add_argument("--inner-events", action=argparse.BooleanOptionalAction, default=None,
                        help="also time replays of a copy of each graph with events recorded inside it, after the "
                             "root node and after every rank's last kernel: the phase without the graph's launch "
                             "and end nodes (graphs with a root node: --graph-ends root or both; on by default "
                             "on the GPU)")
    parser.add_argument("--kernel-span", action=argparse.BooleanOptionalAction, default=None,
                        help="also profile each phase's graph replays (CUPTI, through torch.profiler) for the span "
                             "of its kernels alone, first start to last end over every rank: the events' time "
                             "less the graph's launch, end nodes, fork and join; and for the graph span, every "
                             "node of the replay (graphs of in-process ranks only; on by default on the GPU)")
    parser.add_argument("--peer-reads", choices=("in-place", "workspace"), default="in-place",
                        help="where combine's token owners read the expert outputs of ranks in this process: "
                             "in-place (the caller's array), or workspace (copied there first, as ranks in other "
                             "processes need); dispatch always reads the tokens its sources staged")
    parser.add_argument("--routing", choices=("uniform", "zipf", "k_hot"), default="uniform",
                        help="how tokens pick their distinct experts: uniform; zipf (expert popularity ~ "
                             "1/rank**alpha, the ranks shuffled); k_hot (a share of tokens among the first experts)")
    parser.add_argument("--alpha", type=float, default=None, help="zipf: the exponent (default 1.2)")
    parser.add_argument("--hot-fraction", type=float, default=None,
                        help="k_hot: share of tokens that go hot (default 0.5)")
    parser.add_argument("--hot-experts", type=int, default=None,
                        help="k_hot: the first N experts are hot (default 8, at least --topk, at most max(--topk, "
                             "--experts / 2))")
    parser.add_argument("--warmup", type=int, default=20, help="untimed replays")
    parser.add_argument("--warmup-ms", type=float, default=WARMUP_MS,
                        help="on the GPU, each phase's untimed replays go on in rounds of --warmup until they have "
                             "run this long: the first tens of ms of load run slower (up to 10%% at T = 1024)")
    parser.add_argument("--hold-ms", type=float, default=HOLD_MS,
                        help="on the GPU, hold the timing stream this long (a spin kernel) while the host queues "
                             "each phase's timed replays, so that they run back to back at the GPU's pace and not "
                             "at the host's launch rate; 0: no hold. Only graphs of ranks in this process are "
                             "held: eager calls (--no-graph) are timed with their launches, and ranks in processes "
                             "meet at a barrier before every replay")
    parser.add_argument("--iters", type=int, default=200, help="timed replays per phase")
    parser.add_argument("--input-sets", type=int, default=4, help="input sets rotated between replays")
    parser.add_argument("--parities", choices=("one", "alternate"), default="one",
                        help="the workspace halves the graphs' calls use: one (each phase's graphs all on one half, "
                             "so a dispatch restages into the rows the last replay left in L2; the tables up to "
                             "2026-12-05), or alternate (input set k's graphs on half k mod 2, as consecutive calls "
                             "of a model use them; needs an even --input-sets)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the tokens and the routing")
    parser.add_argument("--baseline", action=argparse.BooleanOptionalAction, default=True,
                        help="also time the same dispatch and combine written with plain torch operations")
    parser.add_argument("--json", metavar="PATH", default=None, help="write the report as JSON")
    parser.add_argument("--plot", metavar="PATH", default=None,
                        help="sweep tokens per rank over --sweep-tokens and draw latency against tokens (PNG)")
    parser.add_argument("--sweep-tokens", type=sweep_tokens, default=DEFAULT_SWEEP_TOKENS, metavar="T,T,...",
                        help=f"tokens per rank of the --plot sweep, each in [1, {MAX_SWEEP_TOKENS}]")


# The skewed routings' defaults (the flags are None until check_args, which refuses them with another routing).
ZIPF_ALPHA = 1.2
HOT_FRACTION = 0.5
HOT_EXPERTS = 8


def zipf_weights(num_experts: int, alpha: float) -> np.ndarray:
    """Expert ``i``'s unnormalised zipf weight ``1 / (i + 1) ** alpha``; a large alpha underflows to 0."""
    with np.errstate(over="ignore"):
        return 1.0 / np.arange(1, num_experts + 1, dtype=np.float64) ** alpha


def route(rng: np.random.Generator, args, num_tokens: int) -> np.ndarray:
    """``[num_tokens, topk]`` int64 distinct expert ids per token, by the chosen routing."""
    if args.routing == "uniform":
        probs = np.full(args.experts, 1.0 / args.experts)
    elif args.routing == "zipf":
        probs = zipf_weights(args.experts, args.alpha)
        probs = rng.permutation(probs / probs.sum())
    else:
        probs = None
    topk = np.empty((num_tokens, args.topk), dtype=np.int64)
    for t in range(num_tokens):
        if probs is None:
            hot = rng.random() < args.hot_fraction
            pool = args.hot_experts if hot else args.experts
            topk[t] = rng.choice(pool, args.topk, replace=False)
        else:
            topk[t] = rng.choice(args.experts, args.topk, replace=False, p=probs)
    return topk


def routing_parameters(args) -> dict:
    """The flags of the chosen routing, so that a report says how to draw its routes again."""
    if args.routing == "zipf":
        return {"alpha": args.alpha}
    if args.routing == "k_hot":
        return {"hot_fraction": args.hot_fraction, "hot_experts": args.hot_experts}
    return {}


def percentiles(times_us: list[float]) -> dict:
    """p50, p90 and p99 in microseconds, and how many samples they are of: a p99 of fewer than 100 is
    about their maximum (of 20, the interpolation between the two largest)."""
    values = np.asarray(times_us)
    return {"p50_us": float(np.percentile(values, 50)), "p90_us": float(np.percentile(values, 90)),
            "p99_us": float(np.percentile(values, 99)), "samples": len(values)}


def bytes_moved(args, copies: float) -> tuple[dict, dict]:
    """Per phase, ``(the HBM floor's bytes, bytes by DeepEP's rule)`` for ``copies`` token copies."""
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
    return floor_bytes, deepep_bytes


def fp8_results(args, device: str) -> tuple:
    """``((x_fp8, scales), recv_count)`` for one rank's fp8 dispatches as out=, the scales in the layout
    of ``--fp8-scales``: row-major, or swapped (DeepEP's, as the calls make them)."""
    import torch

    rows, columns = args.ranks * args.tokens, args.hidden // 128
    num_local = args.experts // args.ranks
    if args.fp8_scales == "row-major":
        scales = torch.empty(num_local, rows, columns, dtype=torch.float32, device=device)
    else:
        scales = torch.empty(num_local, columns, rows, dtype=torch.float32, device=device).transpose(1, 2)
    return ((torch.empty(num_local, rows, args.hidden, dtype=torch.float8_e4m3fn, device=device), scales),
            torch.empty(num_local, dtype=torch.int32, device=device))


def make_input_sets(args, rng: np.random.Generator, devices: list[str | None], torch) -> list[list[dict]]:
    """``--input-sets`` sets of every rank's inputs (tokens, routing, weights, expert outputs) on
    ``devices``. A rank whose device is None (another process's) gets its routes only: every process
    draws the same routes, and the load statistics count them all."""
    num_local = args.experts // args.ranks
    sets = []
    for input_set in range(args.input_sets):
        per_rank = []
        for r in range(args.ranks):
            device = devices[r]
            topk = route(rng, args, args.tokens)
            if device is None:
                per_rank.append(dict(routes=topk))
                continue
            # The values follow --seed too (torch's own generator is seeded at random in each process),
            # from a stream of their own: the routes of a seed stay what they were.
            values_seed = int(np.random.default_rng([args.seed, input_set, r]).integers(2**63))
            generator = torch.Generator(device).manual_seed(values_seed)
            per_rank.append(dict(
                x=torch.randn(args.tokens, args.hidden, device=device, generator=generator).to(torch.bfloat16),
                topk=torch.from_numpy(topk).to(device),
                weights=torch.rand(args.tokens, args.topk, device=device, generator=generator),
                # Drawn in bf16: an fp32 draw would cache twice the bytes in torch's pool (7.5 GB per
                # rank at T = 1024), which later allocations then free with a device-wide cudaFree.
                expert_out=torch.randn(num_local, args.ranks * args.tokens, args.hidden, device=device,
                                       dtype=torch.bfloat16, generator=generator),
                active=torch.ones(args.ranks, dtype=torch.int32, device=device),
                routes=topk,
            ))
        sets.append(per_rank)
    return sets


def mean_copies(sets: list[list[dict]]) -> float:
    return float(np.mean([sum(int((inp["routes"] >= 0).sum()) for inp in per_rank) for per_rank in sets]))


def set_load(args, sets: list[list[dict]]) -> dict:
    """:func:`expert_load` of the input sets' routes."""
    return expert_load([[inp["routes"] for inp in per_rank] for per_rank in sets], args.experts, args.ranks)


def expert_load(routes_per_set: list[list[np.ndarray]], num_experts: int, num_ranks: int) -> dict:
    """How unevenly the copies fall on experts and on the ranks that own them, over the input sets.

    Args:
        routes_per_set: per input set, every rank's ``[tokens, topk]`` expert ids (-1: no expert).

    Returns:
        ``expert_max_over_mean``: copies of the busiest expert over the mean per expert;
        ``rank_max_over_mean``: copies received by the busiest rank over the mean per rank (the
        busiest rank's receive is what a phase waits for); ``max_copies_per_rank``: that rank's
        copies; each the mean over the input sets (1.0 = perfectly even).
    """
    experts, ranks, busiest = [], [], []
    for routes in routes_per_set:
        ids = np.concatenate([r.reshape(-1) for r in routes])
        per_expert = np.bincount(ids[ids >= 0], minlength=num_experts).astype(np.float64)
        per_rank = per_expert.reshape(num_ranks, num_experts // num_ranks).sum(axis=1)
        experts.append(per_expert.max() / per_expert.mean() if per_expert.any() else 1.0)
        ranks.append(per_rank.max() / per_rank.mean() if per_rank.any() else 1.0)
        busiest.append(per_rank.max())
    return {"expert_max_over_mean": float(np.mean(experts)), "rank_max_over_mean": float(np.mean(ranks)),
            "max_copies_per_rank": float(np.mean(busiest))}


# --- the torch baseline ------------------------------------------------------------------------


class CudaEventTimer:
    """Times one call of every rank's work with events on the current stream (forked to other devices)."""

    def __init__(self, torch, sets: list[list[dict]], iters: int):
        self.torch = torch
        self.origin = torch.cuda.current_stream()
        devices = {inp["x"].device for inp in sets[0]}
        self.others = [torch.cuda.current_stream(d) for d in sorted(devices, key=str) if d != self.origin.device]
        self.starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        self.ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]

    def start(self, i: int | None) -> None:
        if i is not None:
            self.starts[i].record(self.origin)
        for s in self.others:
            s.wait_stream(self.origin)

    def stop(self, i: int | None) -> None:
        for s in self.others:
            self.origin.wait_stream(s)
        if i is not None:
            self.ends[i].record(self.origin)

    def times_us(self) -> list[float]:
        self.torch.cuda.synchronize()
        return [start.elapsed_time(end) * 1e3 for start, end in zip(self.starts, self.ends)]


class HostTimer:
    """Times one call of every rank's work with time.perf_counter (host wall time)."""

    def __init__(self, iters: int):
        self.begun = [0.0] * iters
        self.elapsed_us = [0.0] * iters

    def start(self, i: int | None) -> None:
        if i is not None:
            self.begun[i] = time.perf_counter()

    def stop(self, i: int | None) -> None:
        if i is not None:
            self.elapsed_us[i] = (time.perf_counter() - self.begun[i]) * 1e6

    def times_us(self) -> list[float]:
        return self.elapsed_us


def time_baseline(args, sets: list[list[dict]], make_timer, progress) -> dict:
    """p50/p90/p99 of the torch baseline per phase in :data:`BASELINE_PHASES`, on eager calls.

    A combine answers an untimed baseline dispatch of the same input set, as on the kernels' side.
    """
    from mooncake_ep.cli import baseline

    def dispatch(inputs):
        return baseline.dispatch([inp["x"] for inp in inputs], [inp["topk"] for inp in inputs], args.tokens,
                                 args.experts, use_fp8=args.fp8)

    def combine(inputs, result):
        baseline.combine([inp["expert_out"] for inp in inputs], [inp["weights"] for inp in inputs], result.layout)

    stats = {}
    for phase in BASELINE_PHASES:
        timer = make_timer()
        for i in range(args.warmup + args.iters):
            inputs = sets[i % len(sets)]
            timed = i - args.warmup if i >= args.warmup else None
            if phase == "combine":
                result = dispatch(inputs)
            timer.start(timed)
            if phase != "combine":
                result = dispatch(inputs)
            if phase != "dispatch":
                combine(inputs, result)
            timer.stop(timed)
            progress.update(1)
        stats[phase] = percentiles(timer.times_us())
    return stats


# --- measurements --------------------------------------------------------------------------------


class InnerEvents:
    """Two timing events that a captured :func:`fork_join` records inside its graph, on a side stream
    of their own: ``start`` once the root node is done, beside the rank branches rather than ahead
    of them (an event node ahead of the branches undoes their rooted start, docs/performance.md
    (18)), and ``end`` once every branch is done, beside the sink node. Between them: the phase's
    kernels, with the graph's dependency resolution at both ends, without the root and sink nodes'
    own run time or the graph's launch. Not a bound from outside: nothing orders the start event
    before the rank kernels, which wait for the same node. A replay overwrites the pair: read it
    (:meth:`elapsed_us`) before the same graph is replayed again."""

    def __init__(self, torch, side_stream):
        self.side_stream = side_stream
        self.start = torch.cuda.Event(enable_timing=True, external=True)  # external: a node of the graph
        self.end = torch.cuda.Event(enable_timing=True, external=True)

    def elapsed_us(self) -> float:
        """The last replay's time between the two, in microseconds (waits for that replay's end)."""
        self.end.synchronize()
        return self.start.elapsed_time(self.end) * 1e3


def fork_join(torch, streams: list, fn: Callable[[], None], ends: str = "none",
              end_nodes: tuple[Callable[[], None], Callable[[], None]] | None = None,
              inner: InnerEvents | None = None) -> None:
    """Run fn with every stream of ``streams`` ordered after, and joined back into, the current stream.

    ``ends`` (:data:`GRAPH_ENDS`): with a node of its own on the current stream before the fork
    (``root``), and after the join too (``both``): ``end_nodes[0]()`` and ``end_nodes[1]()``, each
    putting one small piece of work on the current stream. Captured in a graph whose every rank
    launch is a root, the GPU starts the rank launches 0.7-1.6 us apart, resolving each root's wait
    on the work before the graph one at a time; forked from one node they start 0.16 us apart, and a
    graph that ends in one node is done sooner than one with a leaf per rank (docs/performance.md, (12)).
    ``inner`` (with a root node only): :class:`InnerEvents` recorded after the root and after the
    branches, on their side stream, which is joined back last.
    """
    if inner is not None and ends == "none":
        raise ValueError("fork_join: inner events need a root node to start from (ends 'root' or 'both')")
    origin = torch.cuda.current_stream()
    if ends != "none":
        end_nodes[0]()
    for stream in streams:
        stream.wait_stream(origin)
    if inner is not None:
        inner.side_stream.wait_stream(origin)
        inner.start.record(inner.side_stream)
    fn()
    if inner is not None:
        for stream in streams:
            inner.side_stream.wait_stream(stream)
        inner.end.record(inner.side_stream)
    for stream in streams:
        origin.wait_stream(stream)
    if ends == "both":
        end_nodes[1]()
    if inner is not None:
        origin.wait_stream(inner.side_stream)


def hold_current_stream(torch, hold_ms: float):
    """Queue a spin of about ``hold_ms`` milliseconds on torch's current stream: what the host queues
    behind it meanwhile then runs back to back, at the GPU's pace rather than the host's.

    ``torch.cuda._sleep`` spins for a number of SM clock cycles; at the H200's 1.98 GHz the hold is
    about what is asked, at a lower clock longer, which costs only time.

    Returns:
        An event recorded after the spin (None for no hold): once the host has queued what the hold
        was for, ``query()`` true says the spin had already ended, so the hold was too short.
    """
    if hold_ms <= 0:
        return None
    torch.cuda._sleep(int(hold_ms * 2e6))
    held = torch.cuda.Event()
    held.record()
    return held


def marker_end_nodes(torch) -> tuple[Callable[[], None], Callable[[], None]]:
    """End nodes for :func:`fork_join`: each zeroes one int32 of a device array of its own."""
    markers = torch.zeros(2, dtype=torch.int32, device=torch.cuda.current_device())
    return markers[0].zero_, markers[1].zero_


def measure_cuda(args, progress, group=None) -> dict:
    """The report of one configuration on the GPU kernels (CUDA events).

    ``group`` None: every rank in this process (a LocalGroup on the visible GPUs, all issued from
    this thread). A group: this process is one of its ranks (on the current device, with a stream of
    its own); every iteration starts at a barrier of the group, each rank times its own calls, and an
    iteration's time is the slowest rank's. Every rank returns the same report.
    """
    import torch

    size = ep.Buffer.get_ep_buffer_size_hint(args.tokens, args.hidden, args.ranks, args.experts)
    if group is None:
        num_gpus = torch.cuda.device_count()
        devices = [r % num_gpus for r in range(args.ranks)]
        check_num_sms(args, [(str(d), torch.cuda.get_device_properties(d).multi_processor_count, f"cuda:{d}")
                             for d in devices])
        local_group = ep.LocalGroup(args.ranks, devices=devices)
        local_ranks = list(range(args.ranks))
        buffers = dict(enumerate(local_group.spawn(lambda g: ep.Buffer(g, size, num_sms=args.num_sms))))
        streams = {r: torch.cuda.ExternalStream(local_group.rank_group(r).stream_ptr, device=f"cuda:{devices[r]}")
                   for r in local_ranks}
        num_copying_gpus = min(num_gpus, args.ranks)
    else:
        device = torch.cuda.current_device()
        devices = [device if r == group.rank else None for r in range(args.ranks)]
        local_ranks = [group.rank]
        # Every rank's GPU by host and PCI bus id (the same in every process of a host, whatever
        # CUDA_VISIBLE_DEVICES makes of ordinals), and its SMs: every rank checks every GPU, as the Buffer does.
        import cupy

        bus_id = str(cupy.cuda.runtime.deviceGetPCIBusId(device)).lower()
        gpus = [tuple(json.loads(blob)) for blob in group.allgather_bytes(json.dumps(
            [f"{platform.node()}/{bus_id}", torch.cuda.get_device_properties(device).multi_processor_count,
             f"cuda:{device} (GPU {bus_id}) on {platform.node()}"]).encode())]
        check_num_sms(args, gpus)
        places = [gpu[0] for gpu in gpus]
        buffers = {group.rank: ep.Buffer(group, size, num_sms=args.num_sms)}
        streams = {group.rank: torch.cuda.Stream()}
        num_copying_gpus = len(set(places))
    if args.peer_reads == "workspace":  # the protocol of the ipc transport, on these ranks
        for buffer in buffers.values():
            # The one private name a command uses (cli/__init__.py): a measurement's switch, not an
            # option a caller of Buffer would want (the transport chooses what is fastest).
            buffer._cuda.direct_peer_reads = False

    rng = np.random.default_rng(args.seed)
    sets = make_input_sets(args, rng, [None if d is None else f"cuda:{d}" for d in devices], torch)

    flags = call_flags(args.mode)
    # out= arrays of every rank, written by every call (nothing reads them back).
    fp8_out = {r: fp8_results(args, f"cuda:{devices[r]}") for r in local_ranks} \
        if args.fp8 and args.fp8_scales != "made" else {}

    def finish_all(pending) -> float:
        """Every rank's receive hook (hook mode), then its stream joined to the call's event (async).
        Holds each call's results until then: async outputs are written on the communication stream.
        Returns the seconds spent inside the hooks."""
        inside = 0.0
        for r, event, hook, _results in pending:
            with torch.cuda.stream(streams[r]):
                if hook is not None:
                    start = time.perf_counter()
                    hook()
                    inside += time.perf_counter() - start
                event.current_stream_wait()
        return inside

    def dispatch_all(inputs, handles, results: dict | None = None) -> tuple[float, float]:
        """Every rank's dispatch; returns the seconds spent inside the calls and inside the hooks
        (not the stream switches). ``results``: filled with each rank's (recv_x, recv_count)."""
        inside, pending = 0.0, []
        for r in local_ranks:
            with torch.cuda.stream(streams[r]):
                start = time.perf_counter()
                recv_x, recv_count, handles[r], event, hook = buffers[r].dispatch(
                    inputs[r]["x"], inputs[r]["topk"], inputs[r]["active"], args.tokens, args.experts,
                    KERNEL_TIMEOUT_US, use_fp8=args.fp8, out=fp8_out.get(r), **flags)
                inside += time.perf_counter() - start
                pending.append((r, event, hook, (recv_x, recv_count)))
                if results is not None:
                    results[r] = recv_x, recv_count
        return inside, finish_all(pending)

    def combine_all(inputs, handles, zero_copy, results: dict | None = None) -> tuple[float, float]:
        inside, pending = 0.0, []
        for r in local_ranks:
            with torch.cuda.stream(streams[r]):
                start = time.perf_counter()
                combined, event, hook = buffers[r].combine(
                    None if zero_copy else inputs[r]["expert_out"], inputs[r]["topk"], inputs[r]["weights"],
                    inputs[r]["active"], KERNEL_TIMEOUT_US, handles[r], zero_copy=zero_copy, **flags)
                inside += time.perf_counter() - start
                pending.append((r, event, hook, combined))
                if results is not None:
                    results[r] = combined
        return inside, finish_all(pending)

    def run_phase(phase: str, inputs, handles) -> None:
        if phase in ("dispatch", "step"):
            dispatch_all(inputs, handles)
        if phase in ("combine", "step"):
            combine_all(inputs, handles, False)
        if phase == "combine_zero_copy":
            combine_all(inputs, handles, True)

    end_nodes = marker_end_nodes(torch)

    def forked(fn, ends: str = "none", inner: InnerEvents | None = None):
        fork_join(torch, list(streams.values()), fn, ends, end_nodes, inner)

    # Eager warm-up (uploads each configuration's layout), whose results are checked, and host time per call.
    handles = [None] * args.ranks
    if group is None:
        dispatched, combined = {}, {}
        forked(lambda: (dispatch_all(sets[0], handles, dispatched), combine_all(sets[0], handles, False, combined)))
        torch.cuda.synchronize()
        check_against_baseline(args, sets[0], dispatched, combined, torch)
        del dispatched, combined
        torch.cuda.empty_cache()  # the baseline's blocks: no allocation inside a call may free them later
    else:
        forked(lambda: run_phase("step", sets[0], handles))
        torch.cuda.synchronize()
    host = {"dispatch": [], "combine": []}
    if args.mode == "hook":
        host.update(dispatch_hook=[], combine_hook=[])
    for i in range(args.warmup + HOST_TIMED_CALLS):
        inputs = sets[i % len(sets)]
        times = []
        forked(lambda: times.extend((dispatch_all(inputs, handles), combine_all(inputs, handles, False))))
        torch.cuda.synchronize()
        if i >= args.warmup:
            for phase, (call_s, hook_s) in zip(("dispatch", "combine"), times):
                host[phase].append(call_s / len(local_ranks) * 1e6)
                if args.mode == "hook":
                    host[phase + "_hook"].append(hook_s / len(local_ranks) * 1e6)
    progress.update(args.warmup + HOST_TIMED_CALLS)

    # --graph: one graph per (phase, input set); the combine graphs answer the dispatch graph of
    # their set. --no-graph: the same calls, eager. --inner-events: a second set of the same graphs,
    # each holding an InnerEvents pair, timed apart: with the pair in the timed graphs the events
    # around them read 4.7-7.3 us more (docs/performance.md, (19)).
    graphs = {phase: [] for phase in PHASES}
    inner_graphs = {phase: [] for phase in PHASES} if inner_events_timed(args) else None
    inner_events = {phase: [] for phase in PHASES}
    set_handles = [[None] * args.ranks for _ in sets]  # the eager calls' (--no-graph)
    if args.graph:
        pool = torch.cuda.graph_pool_handle()
        side_stream = torch.cuda.Stream()
        for captured, with_inner in ((graphs, False), (inner_graphs, True)):
            if captured is None:
                continue
            graph_handles = [[None] * args.ranks for _ in sets]  # each set of graphs answers its own dispatches
            for k, inputs in enumerate(sets):
                # --parities alternate: set k's dispatch graph on half k mod 2 (a capture of a set's
                # graphs makes two dispatches, so the next set would have the same half): one eager,
                # uncaptured step moves the dispatch count on where it does not.
                if args.parities == "alternate" and buffers[local_ranks[0]].num_dispatches % 2 != k % 2:
                    forked(lambda: run_phase("step", inputs, graph_handles[k]))
                    torch.cuda.synchronize()
                for phase in captured:
                    pair = None
                    if with_inner:
                        pair = InnerEvents(torch, side_stream)
                        inner_events[phase].append(pair)
                    if phase.startswith("combine"):
                        # Both combine graphs answer this set's dispatch graph, and every replay of one
                        # follows a replay of that (replay_answered): no dispatch is combined twice when
                        # they run, though two captures took its handles (which a combine through the
                        # workspace marks as used, for eager callers).
                        for handle in graph_handles[k]:
                            if handle is not None:
                                handle.state.pop("combined_through_workspace", None)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        forked(lambda: run_phase(phase, inputs, graph_handles[k]), ends=args.graph_ends,
                               inner=pair)
                    captured[phase].append(graph)
        torch.cuda.synchronize()

    def replay(phase: str, k: int, inner: bool = False) -> None:
        if args.graph:
            (inner_graphs if inner else graphs)[phase][k].replay()
        else:
            forked(lambda: run_phase(phase, sets[k], set_handles[k]))

    def replay_answered(phase: str, k: int, inner: bool = False) -> None:
        if phase.startswith("combine"):
            replay("dispatch", k, inner)  # combine answers this set's dispatch
        replay(phase, k, inner)

    def warm_up(phase: str, inner: bool = False) -> None:
        """Rounds of --warmup replays until --warmup-ms have passed since the first (every rank
        goes on while any rank's time is short, so that their replays stay matched)."""
        start = time.perf_counter()
        while True:
            for i in range(args.warmup):
                if group is not None:  # ranks in processes start every replay together, as when timed
                    torch.cuda.synchronize()
                    group.barrier()
                replay_answered(phase, i % len(sets), inner)
            torch.cuda.synchronize()
            short = args.warmup > 0 and (time.perf_counter() - start) * 1e3 < args.warmup_ms
            if group is not None:
                short = any(blob[0] for blob in group.allgather_bytes(bytes([short])))
            if not short:
                return

    def time_phase(phase: str, inner: bool = False) -> list[float]:
        """Each of --iters replays' time: from events around the replay of the phase's graph, or with
        ``inner`` from the InnerEvents inside its other graph, each pair read just before that graph's
        next replay, --input-sets replays later: the host waits there, so it runs at most that many
        replays ahead of the GPU (with one input set, each inner-timed replay starts on an idle GPU)."""
        warm_up(phase, inner)
        times, held = [], None
        if not inner:
            starts = [torch.cuda.Event(enable_timing=True) for _ in range(args.iters)]
            ends = [torch.cuda.Event(enable_timing=True) for _ in range(args.iters)]
            if in_process_graphs(args, group):
                held = hold_current_stream(torch, args.hold_ms)
        for i in range(args.iters):
            k = i % len(sets)
            if inner and i >= len(sets):
                times.append(inner_events[phase][k].elapsed_us())
            if phase.startswith("combine"):
                replay("dispatch", k, inner)
            if group is not None:  # after the answered dispatch: the ranks start each timed replay together
                torch.cuda.synchronize()
                group.barrier()
            if not inner:
                starts[i].record()
            replay(phase, k, inner)
            if not inner:
                ends[i].record()
        if held is not None and held.query():
            print(f"bench: the {args.hold_ms:g} ms hold ran out before the {phase} phase's timed replays were "
                  f"queued, so some were timed at the host's pace: raise --hold-ms")
            hold_ran_out.append(phase)
        torch.cuda.synchronize()
        if inner:
            times += [inner_events[phase][i % len(sets)].elapsed_us()
                      for i in range(max(args.iters - len(sets), 0), args.iters)]
        else:
            times = [start.elapsed_time(end) * 1e3 for start, end in zip(starts, ends)]
        if group is None:
            return times
        every_rank = [json.loads(blob) for blob in group.allgather_bytes(json.dumps(times).encode())]
        return np.max(every_rank, axis=0).tolist()  # an iteration lasts until its slowest rank is done

    def span_phase(phase: str) -> kernel_span.ReplaySpans:
        """The kernel and graph spans of each of ``--iters`` replays, profiled apart from the timed ones."""
        def run() -> None:
            for i in range(args.iters):
                replay_answered(phase, i % len(sets))
        records = kernel_span.profile_kernels(torch, run)
        return kernel_span.replay_spans_us(records, kernel_span.PHASE_KERNELS[phase], args.iters, args.ranks)

    kernel, inner_stats = {}, {} if inner_graphs is not None else None
    hold_ran_out: list[str] = []  # phases some of whose events timed the host's pace (the JSON says so too)
    for phase in graphs:
        kernel[phase] = percentiles(time_phase(phase))
        progress.update(args.warmup + args.iters)
        if inner_stats is not None:
            inner_stats[phase] = percentiles(time_phase(phase, inner=True))
            progress.update(args.warmup + args.iters)
    spans = None
    if spans_profiled(args, group):
        try:
            spans = {phase: span_phase(phase) for phase in graphs}
        except RuntimeError as exc:  # a profiler that records nothing, or not by graph launch
            print(f"bench: no kernel span: {exc}")
        progress.update(args.iters * len(graphs))
    check_no_rank_masked(sets, torch)

    # The torch baseline, after every kernel is done (no kernel waits while it allocates). It
    # issues every rank's work from one process: not with ranks in processes.
    baseline_stats = None
    if args.baseline and group is None:
        baseline_stats = time_baseline(args, sets, lambda: CudaEventTimer(torch, sets, args.iters), progress)

    device_name = f"cuda:{devices[local_ranks[0]]}"
    if group is None:
        bandwidths = measure_bandwidth(torch, device_name)
    else:
        # One process per GPU measures, while the others at its place wait: processes sharing a GPU
        # measured at once, each timing the others' copies too (a floor up to N times too high).
        leader = places.index(places[group.rank])
        group.barrier()
        mine = measure_bandwidth(torch, device_name) if leader == group.rank else None
        bandwidths = json.loads(group.allgather_bytes(json.dumps(mine).encode())[leader])
    copy_bandwidth, write_bandwidth = (b * num_copying_gpus for b in bandwidths)  # every GPU copies at once

    if group is not None:  # every rank's host times
        host = {phase: [t for blob in group.allgather_bytes(json.dumps(times).encode()) for t in json.loads(blob)]
                for phase, times in host.items()}
    report = build_report(args, backend="cuda", timer="cuda_events",
                          device=torch.cuda.get_device_name(devices[local_ranks[0]]),
                          num_sms_per_rank=buffers[local_ranks[0]].num_sms, copy_bandwidth=copy_bandwidth,
                          write_bandwidth=write_bandwidth,
                          copies=mean_copies(sets), load=set_load(args, sets), host=host, kernel=kernel,
                          baseline_stats=baseline_stats, spans=spans, inner=inner_stats, hold_ran_out=hold_ran_out)
    if group is None:
        local_group.spawn(lambda g: buffers[g.rank].destroy())
    else:
        buffers[group.rank].destroy()
    sets.clear()  # the closures above hold these names: empty them rather than del
    graphs.clear()
    if inner_graphs is not None:
        inner_graphs.clear()
    torch.cuda.empty_cache()  # the next point of a sweep starts with the memory this one cached
    return report


def check_against_baseline(args, inputs: list[dict], dispatched: dict, combined: dict, torch) -> None:
    """One step's results of the kernels against the torch baseline's (which tests/test_bench.py checks
    against mooncake_ep.reference), every rank: recv_count exactly, the valid rows of recv_x and the fp8
    scales bit for bit, combine within one bf16 rounding (the two sum the same products in another
    order). A timing of wrong results is no timing: raises RuntimeError. In-process ranks only (the
    baseline needs every rank's tensors), of the first input set's eager step in the benchmark's mode,
    not a zero-copy combine nor the graphs' replays (the GPU tests check those against the reference)."""
    from mooncake_ep.cli import baseline

    expected = baseline.dispatch([inp["x"] for inp in inputs], [inp["topk"] for inp in inputs], args.tokens,
                                 args.experts, use_fp8=args.fp8)
    expected_combined = baseline.combine([inp["expert_out"] for inp in inputs], [inp["weights"] for inp in inputs],
                                         expected.layout)
    for r, (recv_x, recv_count) in sorted(dispatched.items()):
        if not torch.equal(recv_count, expected.recv_count[r]):
            raise CheckFailed(f"bench: rank {r}'s recv_count {recv_count.tolist()} differs from the torch "
                               f"baseline's {expected.recv_count[r].tolist()}")
        rows, scales = recv_x if args.fp8 else (recv_x, None)
        for e, count in enumerate(expected.recv_count[r].tolist()):
            pairs = [("recv_x", rows[e, :count].view(torch.uint8), expected.recv_x[r][e, :count].view(torch.uint8))]
            if scales is not None:
                pairs.append(("scales", scales[e, :count], expected.recv_scales[r][e, :count]))
            wrong = [name for name, got, want in pairs if not torch.equal(got, want)]
            if wrong:
                raise CheckFailed(f"bench: rank {r}'s {' and '.join(wrong)} of local expert {e} differ from the "
                                   f"torch baseline's")
        got, want = combined[r].float(), expected_combined[r].float()
        if not torch.allclose(got, want, rtol=2.0**-7, atol=1e-3):
            raise CheckFailed(f"bench: rank {r}'s combined_x differs from the torch baseline's by up to "
                               f"{(got - want).abs().max().item():.3g} (more than one bf16 rounding)")


def check_no_rank_masked(sets: list[list[dict]], torch) -> None:
    """Every rank stayed active: a masked rank means a call waited more than KERNEL_TIMEOUT_US, and
    the times would measure that timeout, not the kernels."""
    torch.cuda.synchronize()
    for per_rank in sets:
        for r, inputs in enumerate(per_rank):
            if "active" not in inputs:
                continue  # another process's rank
            masked = (inputs["active"] == 0).nonzero().flatten().tolist()
            if masked:
                raise CheckFailed(f"bench: rank {r} masked ranks {masked} (a call waited more than "
                                   f"{KERNEL_TIMEOUT_US} us for them). In-process ranks share the GPU: a "
                                   f"device-wide synchronisation inside one rank's call (a pool's cudaFree when "
                                   f"memory runs short) stalls the peers waiting for that rank")


def measure_reference(args, progress, group=None) -> dict:
    """The report of one configuration on the numpy reference backend (host wall time).

    Each rank is a thread of one spawn per phase (``group`` None), or this process is one rank of
    ``group``; every iteration starts at a barrier and ends at one, so a phase's time is the time
    until the slowest rank finishes, as on the GPU. Host time per call is the median of each rank's
    own dispatch and (copy-mode) combine calls: on this backend the call does the whole work, so it
    is close to the phase time. Every rank returns the same report.
    """
    import torch

    size = ep.Buffer.get_ep_buffer_size_hint(args.tokens, args.hidden, args.ranks, args.experts)
    if group is None:
        local_group = ep.LocalGroup(args.ranks)
        buffers = local_group.spawn(lambda g: ep.Buffer(g, size, backend="reference"))
        devices = ["cpu"] * args.ranks
    else:
        buffers = {group.rank: ep.Buffer(group, size, backend="reference")}
        devices = ["cpu" if r == group.rank else None for r in range(args.ranks)]
    sets = make_input_sets(args, np.random.default_rng(args.seed), devices, torch)

    flags = call_flags(args.mode)

    def finish(event, hook) -> float:
        """The receive hook (hook mode) and the event; returns the seconds inside the hook."""
        start = time.perf_counter()
        if hook is not None:
            hook()
        event.current_stream_wait()
        return time.perf_counter() - start

    def rank_loop(g, phase: str) -> tuple[list[float], list[float], list[float]]:
        buffer = buffers[g.rank]
        phase_us, call_us, hook_us = [], [], []
        for i in range(args.warmup + args.iters):
            inp = sets[i % len(sets)][g.rank]

            def dispatch() -> tuple:
                result = buffer.dispatch(inp["x"], inp["topk"], inp["active"], args.tokens, args.experts,
                                         use_fp8=args.fp8, **flags)
                return result[2], result[3], result[4]

            def combine(zero_copy: bool) -> tuple:
                _, event, hook = buffer.combine(None if zero_copy else inp["expert_out"], inp["topk"], inp["weights"],
                                                inp["active"], -1, handle, zero_copy=zero_copy, **flags)
                return event, hook

            if phase.startswith("combine"):
                handle, event, hook = dispatch()  # untimed: the dispatch this combine answers
                finish(event, hook)
                if phase == "combine_zero_copy":
                    buffer.get_next_combine_buffer(handle).copy_(inp["expert_out"])
            g.barrier()
            start = time.perf_counter()
            hook_s = 0.0
            if phase in ("dispatch", "step"):
                handle, event, hook = dispatch()
                call_s = time.perf_counter() - start
                hook_s += finish(event, hook)
            if phase != "dispatch":
                call_start = time.perf_counter()
                event, hook = combine(phase == "combine_zero_copy")
                call_s = time.perf_counter() - call_start  # a step's host time is not reported
                hook_s += finish(event, hook)
            g.barrier()
            end = time.perf_counter()
            if i >= args.warmup:
                phase_us.append((end - start) * 1e6)
                call_us.append(call_s * 1e6)
                hook_us.append(hook_s * 1e6)
            if g.rank == 0:
                progress.update(1)
        return phase_us, call_us, hook_us

    def every_rank(phase: str) -> list:
        if group is None:
            return local_group.spawn(rank_loop, phase)
        return [json.loads(blob) for blob in group.allgather_bytes(json.dumps(rank_loop(group, phase)).encode())]

    kernel, host = {}, {}
    for phase in PHASES:
        per_rank = every_rank(phase)
        kernel[phase] = percentiles(np.max([times for times, _, _ in per_rank], axis=0).tolist())
        if phase in ("dispatch", "combine"):
            host[phase] = [t for _, calls, _ in per_rank for t in calls]
            if args.mode == "hook":
                host[phase + "_hook"] = [t for _, _, hooks in per_rank for t in hooks]
    baseline_stats = None
    if args.baseline and group is None:  # it runs every rank's work in one process
        baseline_stats = time_baseline(args, sets, lambda: HostTimer(args.iters), progress)
    report = build_report(args, backend="reference", timer="host",
                          device=f"CPU ({platform.machine() or 'unknown'}, {os.cpu_count()} cores)",
                          num_sms_per_rank=None, copy_bandwidth=None, write_bandwidth=None, copies=mean_copies(sets),
                          load=set_load(args, sets), host=host, kernel=kernel, baseline_stats=baseline_stats)
    if group is None:
        local_group.spawn(lambda g: buffers[g.rank].destroy())
    else:
        buffers[group.rank].destroy()
    return report


def check_num_sms(args, gpus: Sequence[tuple[str, int, str]]) -> None:
    """UsageError naming --num-sms where the ranks on a GPU would need more SMs than it has (every rank's
    kernel must be resident at once); the Buffer's own ValueError was a traceback. ``gpus``: each rank's
    ``(GPU key, its SMs, its name)``, the same list on every rank, so every rank gives the same verdict."""
    if args.num_sms is None:
        return
    for key in dict.fromkeys(gpu[0] for gpu in gpus):
        on_it = [gpu for gpu in gpus if gpu[0] == key]
        num_ranks, (_, num_device_sms, name) = len(on_it), on_it[0]
        if args.num_sms * num_ranks > num_device_sms:
            raise UsageError(f"--num-sms {args.num_sms}: the {num_ranks} ranks on {name} would need "
                             f"{args.num_sms * num_ranks} SMs, it has {num_device_sms}: use --num-sms <= "
                             f"{num_device_sms // num_ranks}")


def measure_bandwidth(torch, device: str, num_bytes: int = 1 << 30, repeats: int = 10) -> tuple[float, float]:
    """(copy, write) bandwidth of one GPU in bytes/s, on a buffer far larger than L2: a device copy
    counted as bytes read + written (the floors' unit), and ``cudaMemsetAsync``, which only writes
    (dispatch's copies are mostly writes to recv_x: the memset says how fast those can go).
    Not ``torch.fill_``: its kernel writes 3.4 TB/s where plain stores reach 4.4 on an H200
    (docs/performance.md (25))."""
    import cupy

    src = torch.empty(num_bytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)

    def seconds(fn) -> float:
        for _ in range(3):
            fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e-3

    copy = 2 * num_bytes * repeats / seconds(lambda: dst.copy_(src))
    stream_ptr = torch.cuda.current_stream(dst.device).cuda_stream  # the events' stream
    with cupy.cuda.Device(dst.device.index):
        write = num_bytes * repeats / seconds(lambda: cupy.cuda.runtime.memsetAsync(
            dst.data_ptr(), 0x5A, num_bytes, stream_ptr))
    return copy, write


def build_report(args, *, backend: str, timer: str, device: str, num_sms_per_rank: int | None,
                 copy_bandwidth: float | None, write_bandwidth: float | None, copies: float, load: dict, host: dict,
                 kernel: dict, baseline_stats: dict | None, spans: dict | None = None,
                 inner: dict | None = None, hold_ran_out: Sequence[str] = ()) -> dict:
    """The JSON report; ``copy_bandwidth`` (bytes/s) None means no floor (the reference backend), and no
    rate either: DeepEP's bytes over numpy's wall time would read as a transfer rate of nothing.
    ``write_bandwidth`` (bytes/s) is context only: the floors use the copy bandwidth. ``spans``: per
    phase, the profiled replays' :class:`~mooncake_ep.cli.kernel_span.ReplaySpans` (None: not profiled).
    ``inner``: per phase, the :class:`InnerEvents`' percentiles (None: not recorded). ``hold_ran_out``:
    the phases some of whose timed replays were queued after the hold ended (timed at the host's pace)."""
    floor_bytes, deepep_bytes = bytes_moved(args, copies)
    report = {
        "date": time.strftime("%Y-%m-%d"),
        "device": device,
        "backend": backend,
        "timer": timer,
        "config": {k: getattr(args, k) for k in ("ranks", "tokens", "hidden", "topk", "experts", "fp8", "fp8_scales",
                                                 "num_sms", "mode", "graph", "graph_ends", "peer_reads", "routing", "iters",
                                                 "input_sets", "parities", "warmup", "warmup_ms", "seed", "baseline")}
                  | routing_parameters(args)
                  # The flags as they applied, not as given.
                  | {"inner_events": inner_events_timed(args), "kernel_span": spans is not None},
        "num_sms_per_rank": num_sms_per_rank,
        "copy_bandwidth_gbps": None if copy_bandwidth is None else copy_bandwidth / 1e9,
        "write_bandwidth_gbps": None if write_bandwidth is None else write_bandwidth / 1e9,
        "copies": copies,
        "load": load,
        "host_us_per_call": {k: float(np.median(v)) for k, v in host.items()},
        "baseline": baseline_stats,
        "hold_ran_out": list(hold_ran_out),
        "phases": {},
    }
    for phase, stats in kernel.items():
        floor_us = None if copy_bandwidth is None else floor_bytes[phase] / copy_bandwidth * 1e6

        def with_ratio(percentile_stats: dict) -> dict:  # a measure's percentiles and its p50 over the floor
            return dict(percentile_stats,
                        ratio_to_floor=None if floor_us is None else percentile_stats["p50_us"] / floor_us)

        base = baseline_stats[BASELINE_OF[phase]] if baseline_stats else None
        report["phases"][phase] = dict(
            with_ratio(stats),
            floor_us=floor_us,
            hbm_bytes_floor=floor_bytes[phase],
            deepep_gbps_per_rank=(None if copy_bandwidth is None else
                                  deepep_bytes[phase] / args.ranks / (stats["p50_us"] * 1e-6) / 1e9),
            baseline_p50_us=None if base is None else base["p50_us"],
            speedup_vs_baseline=None if base is None else base["p50_us"] / stats["p50_us"],
            inner_events=None if inner is None else with_ratio(inner[phase]),
            kernel_span=None if spans is None else with_ratio(percentiles(spans[phase].kernels_us)),
            graph_span=None if spans is None else percentiles(spans[phase].graph_us),
        )
    return report


# --- output --------------------------------------------------------------------------------------


def _cell(value: float | None, width: int, digits: int) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}.{digits}f}"


def print_report(report: dict) -> None:
    c = report["config"]
    precision = "bf16 dispatch"
    if c["fp8"]:  # the layout of the scales moves dispatch's time (docs/performance.md (52))
        # The calls take torch tensors on both backends, so the results they make are in DeepEP's layout.
        layout = {"made": "DeepEP's layout", "swapped": "DeepEP's layout", "row-major": "row-major"}[
            c.get("fp8_scales", "made")]
        precision = f"fp8 dispatch (scales {layout})"
    shape = (f"T={c['tokens']}, H={c['hidden']}, top-{c['topk']} of {c['experts']}, "
             f"{precision}, routing {c['routing']}, mode {c['mode']}, "
             f"{'CUDA graphs' if c['graph'] else 'eager calls'}")
    if report["backend"] == "cuda":
        print(f"{report['device']}: {c['ranks']} ranks x {report['num_sms_per_rank']} SMs, {shape}; "
              f"copy bandwidth {report['copy_bandwidth_gbps']:.0f} GB/s (write only "
              f"{report['write_bandwidth_gbps']:.0f} GB/s)")
    else:
        print(f"reference backend (numpy) on {report['device']}: {c['ranks']} ranks, {shape}; times are host wall "
              f"time (time.perf_counter), not kernel time; no HBM floor")
    if report["baseline"] is not None:
        how = "CUDA events around every rank's work" if report["timer"] == "cuda_events" else "host wall time"
        print(f"baseline (plain torch ops, eager, {how}): " + "; ".join(
            f"{phase} p50/p90/p99 {s['p50_us']:.1f}/{s['p90_us']:.1f}/{s['p99_us']:.1f} us"
            for phase, s in report["baseline"].items()))
    print(f"{'phase':<18}{'p50 us':>9}{'p90 us':>9}{'p99 us':>9}{'floor us':>10}{'ratio':>7}{'GB/s/rank':>11}"
          f"{'base p50':>10}{'speedup':>9}{'inner p50':>11}{'ratio':>7}{'graph p50':>11}{'span p50':>10}{'ratio':>7}")
    missing = {"p50_us": None, "ratio_to_floor": None}
    for phase, row in report["phases"].items():
        inner = row["inner_events"] or missing
        graph = row["graph_span"] or missing
        span = row["kernel_span"] or missing
        print(f"{phase:<18}{row['p50_us']:>9.1f}{row['p90_us']:>9.1f}{row['p99_us']:>9.1f}"
              f"{_cell(row['floor_us'], 10, 1)}{_cell(row['ratio_to_floor'], 7, 2)}"
              f"{_cell(row['deepep_gbps_per_rank'], 11, 1)}"
              f"{_cell(row['baseline_p50_us'], 10, 1)}{_cell(row['speedup_vs_baseline'], 9, 2)}"
              f"{_cell(inner['p50_us'], 11, 1)}{_cell(inner['ratio_to_floor'], 7, 2)}"
              f"{_cell(graph['p50_us'], 11, 1)}{_cell(span['p50_us'], 10, 1)}{_cell(span['ratio_to_floor'], 7, 2)}")
    samples = min(row["samples"] for row in report["phases"].values())
    if samples < 100:
        print(f"p99 of {samples} replays (--iters): fewer than 100, so about their maximum")
    if any(row["inner_events"] for row in report["phases"].values()):
        print("inner: events recorded inside a copy of the graph, after its root node and after the last rank's kernel "
              "(the graph's own end nodes and launch left out); p50 us and its ratio to the floor")
    if any(row["kernel_span"] for row in report["phases"].values()):
        print("graph: every node of the replay's graph (CUPTI), its own end nodes included; span: the "
              "phase's kernels alone, first start to last end over every rank; p50 us, and the span's ratio to "
              "the floor")
    print("host us per call: " + ", ".join(f"{k} {v:.1f}" for k, v in report["host_us_per_call"].items()))
    load = report["load"]
    print(f"load: busiest expert {load['expert_max_over_mean']:.2f}x the mean, busiest rank "
          f"{load['rank_max_over_mean']:.2f}x ({load['max_copies_per_rank']:.0f} copies)")


def plot_sweep(path: str, report: dict, points: list[dict]) -> None:
    """Draw p50 latency against tokens per rank for dispatch and combine into a PNG at ``path``."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    c = report["config"]
    tokens = [p["tokens"] for p in points]
    fig = Figure(figsize=(11, 4.5), layout="constrained")
    FigureCanvasAgg(fig)  # the Agg canvas: no display, no global pyplot state
    unit = "kernel time" if report["timer"] == "cuda_events" else "host wall time"
    for ax, phase in zip(fig.subplots(1, 2), ("dispatch", "combine")):
        rows = [p["phases"][phase] for p in points]
        ax.plot(tokens, [r["p50_us"] for r in rows], "o-",
                label="mooncake_ep (graph, events)" if report["backend"] == "cuda" else "mooncake_ep (numpy reference)")
        for key, marker, label in (("inner_events", "d-", "inner events"), ("graph_span", "v-", "graph span"),
                                   ("kernel_span", "^-", "kernel span")):
            if all(r.get(key) is not None for r in rows):  # .get: sweeps saved before the graph span
                ax.plot(tokens, [r[key]["p50_us"] for r in rows], marker, label=f"mooncake_ep ({label})")
        if all(r["baseline_p50_us"] is not None for r in rows):
            ax.plot(tokens, [r["baseline_p50_us"] for r in rows], "s--", label="torch baseline")
        if all(r["floor_us"] is not None for r in rows):
            ax.plot(tokens, [r["floor_us"] for r in rows], ":", color="gray", label="HBM floor")
        ax.set_xscale("log", base=2)
        ax.set_xticks(tokens, [str(t) for t in tokens])
        ax.minorticks_off()
        ax.set_yscale("log")
        ax.set_xlabel("tokens per rank")
        ax.set_ylabel(f"p50 {unit}, us")
        ax.set_title(f"{phase} ({'fp8' if c['fp8'] and phase == 'dispatch' else 'bf16'})")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(f"{report['device']} ({report['backend']}): {c['ranks']} ranks, H={c['hidden']}, "
                 f"top-{c['topk']} of {c['experts']}, routing {c['routing']}, {report['date']}")
    try:
        fig.savefig(path, dpi=120, format="png")
    except OSError as exc:  # the folder went away or the disk filled during the run (helper-106)
        raise OutputError(f"--plot {path}: could not write the plot: {exc.strerror or exc}") from None


# --- the command ---------------------------------------------------------------------------------


class _NoProgress:
    """Stands in for a tqdm bar where tqdm is not installed: progress is cosmetic."""

    def __init__(self, iterable=None, **_):
        self.iterable = iterable

    def __iter__(self):
        return iter(self.iterable)

    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def check_args(args, ranks_flag: str = "--ranks") -> None:
    """Refuse flags that do not fit together (UsageError, exit 2) before anything runs; ``ranks_flag``
    names where the ranks came from (``--launch`` starts that many processes)."""
    for flag, value, minimum in ((ranks_flag, args.ranks, 1), ("--tokens", args.tokens, 1), ("--topk", args.topk, 1),
                                 ("--experts", args.experts, 1),
                                 ("--iters", args.iters, 1), ("--warmup", args.warmup, 0),
                                 ("--warmup-ms", args.warmup_ms, 0), ("--hold-ms", args.hold_ms, 0),
                                 ("--input-sets", args.input_sets, 1),
                                 *((("--num-sms", args.num_sms, 1),) if args.num_sms is not None else ())):
        if value < minimum:
            raise UsageError(f"{flag} must be >= {minimum}, got {value}")
    if args.parities == "alternate" and args.input_sets % 2:
        raise UsageError(f"--parities alternate takes an even --input-sets (set k on half k mod 2, replayed in "
                         f"rotation), got {args.input_sets}")
    # (>= 0 was checked above; nan fails every comparison, so these refuse it and inf too)
    if not args.hold_ms <= HOLD_MS_MAX:
        raise UsageError(f"--hold-ms must be a number in [0, {HOLD_MS_MAX:g}], got {args.hold_ms}")
    if not args.warmup_ms <= WARMUP_MS_MAX:  # a warm-up loop runs until this much time has passed
        raise UsageError(f"--warmup-ms must be a number in [0, {WARMUP_MS_MAX:g}], got {args.warmup_ms}")
    check_moe_shape(args.tokens, args.hidden, args.ranks, ranks_flag, args.experts, args.topk, args.seed)
    # A routing's flags with another routing would be ignored without a word: refused, then defaulted.
    for flag, name, routing, default in (("--alpha", "alpha", "zipf", ZIPF_ALPHA),
                                         ("--hot-fraction", "hot_fraction", "k_hot", HOT_FRACTION),
                                         ("--hot-experts", "hot_experts", "k_hot", HOT_EXPERTS)):
        if getattr(args, name) is None:
            if name == "hot_experts":  # fewer where experts are few: with every expert hot, k_hot is uniform
                if args.routing == "k_hot" and args.experts <= args.topk:
                    raise UsageError(f"--routing k_hot needs more --experts than --topk (some experts cold), got "
                                     f"{args.experts} and {args.topk}")
                default = min(max(HOT_EXPERTS, args.topk), max(args.topk, args.experts // 2))
            setattr(args, name, default)
        elif args.routing != routing:
            raise UsageError(f"{flag} applies to --routing {routing}, not {args.routing}")
    if args.routing == "zipf":
        if not (math.isfinite(args.alpha) and args.alpha >= 0):
            raise UsageError(f"--alpha must be a finite number >= 0, got {args.alpha}")
        # An expert whose weight underflows to 0 is never chosen.
        if np.count_nonzero(zipf_weights(args.experts, args.alpha)) < args.topk:
            raise UsageError(f"--alpha {args.alpha} gives fewer than --topk={args.topk} experts a probability "
                             f"above 0; use a smaller --alpha")
    if args.routing == "k_hot" and not args.topk <= args.hot_experts < args.experts:
        # A hot token takes top-k distinct experts among the hot ones: fewer cannot hold them; with
        # every expert hot, the routing is uniform whatever --hot-fraction says.
        raise UsageError(f"--hot-experts must be in [--topk={args.topk}, --experts={args.experts}) (every expert "
                         f"hot is uniform routing), got {args.hot_experts}")
    if args.routing == "k_hot" and not 0 <= args.hot_fraction <= 1:
        raise UsageError(f"--hot-fraction must be in [0, 1], got {args.hot_fraction}")
    check_output_path("--json", args.json)
    check_output_path("--plot", args.plot, suffix=".png")
    if args.json and args.plot and os.path.realpath(args.json) == os.path.realpath(args.plot):
        raise UsageError(f"--json {args.json} and --plot {args.plot} name the same file: the plot would replace the "
                         f"measurements")
    if args.plot is None and args.sweep_tokens != sweep_tokens(DEFAULT_SWEEP_TOKENS):  # else silently unused
        raise UsageError("--sweep-tokens sets the points of the --plot sweep; give --plot PATH.png as well")
    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401 - only checked here, before a long run, and used at the end
        except ImportError:
            raise UsageError("--plot needs matplotlib (pip install matplotlib)") from None
    try:  # the timed calls take torch tensors on every backend, as an engine's would (and the baseline is torch)
        import torch  # noqa: F401
    except ImportError:
        raise UsageError("bench needs torch (pip install torch; the demo runs without it)") from None


def run(args) -> int:
    if args.launch is not None:
        launch.check_launch(args)
        if not isinstance(args.ranks, ByBackend) and args.ranks != args.launch:
            raise UsageError(f"--ranks ({args.ranks}) must match --launch ({args.launch}), or be left out")
        check_as_ranks(args, choose_backend(args.backend)[0], args.launch, "--launch")  # before any starts
        return launch.launch("bench", child_argv(args), args.launch)
    backend, why = choose_backend(args.backend)
    if args.group == "local":
        return run_ranks(args, backend, why, None)
    world_size = launch.env_world_size()
    if world_size is not None:  # the flags, before the wait for every rank to join
        check_ranks_flag(args, world_size, "WORLD_SIZE's")
        check_as_ranks(args, backend, world_size, "WORLD_SIZE")
    with launch.joined_group(backend) as group:
        check_ranks_flag(args, group.world_size, "the group's")
        args.ranks = group.world_size
        return run_ranks(args, backend, why, group)


def child_argv(args) -> list[str]:
    """The command line of one process of ``--launch``: this command's flags, as one rank (--group init)."""
    flags, skip = [], False
    for token in args.command_argv:
        if skip:
            skip = False
        elif token == "--launch":
            skip = True  # and its value
        elif not token.startswith("--launch="):
            flags.append(token)
    return launch.rank_command(*["-v"] * getattr(args, "verbose", 0), "bench", *flags, "--group", "init")


def check_as_ranks(args, backend: str, num_ranks: int, ranks_flag: str) -> None:
    """What each of ``num_ranks`` rank processes would refuse (``settle_args`` with ``--ranks``
    ``num_ranks``, on a copy: ``args`` is left as given), refused once here: before the processes
    start (``--launch``) or join (``WORLD_SIZE``, which ``ranks_flag`` names)."""
    as_ranks = copy.copy(args)
    as_ranks.ranks = num_ranks
    settle_args(as_ranks, backend, ranks_flag=ranks_flag)


def check_ranks_flag(args, world_size: int, whose: str) -> None:
    """UsageError if ``--ranks`` was given and is not the group's ``world_size`` (``whose``, in words)."""
    if not isinstance(args.ranks, ByBackend) and args.ranks != world_size:
        raise UsageError(f"--ranks ({args.ranks}) must match {whose} {world_size} ranks, or be left out")


def settle_args(args, backend: str, ranks_flag: str = "--ranks") -> None:
    """Resolve the flags whose defaults depend on ``backend``, then check them all (UsageError)."""
    for name in DEFAULTS_DECODE:
        value = getattr(args, name)
        if isinstance(value, ByBackend):
            setattr(args, name, value.resolve(backend))
    if args.fp8_scales != "made" and not args.fp8:
        raise UsageError("--fp8-scales lays out fp8 dispatch's scales; --no-fp8 dispatches bf16")
    if backend == "reference":  # the GPU's flags, given where they would change nothing
        if args.num_sms is not None:
            raise UsageError("--num-sms sets the kernels' SMs per rank; the reference backend has none")
        if args.graph:
            raise UsageError("--graph: the reference backend has no CUDA graphs (its calls are numpy on the host)")
        if args.peer_reads != "in-place":
            raise UsageError("--peer-reads sets where the GPU kernels read expert outputs; the reference backend has "
                             "none")
        if args.graph_ends != "both":
            raise UsageError("--graph-ends shapes the CUDA graphs; the reference backend has none")
        if args.parities != "one":
            raise UsageError("--parities places the CUDA graphs' calls; the reference backend has none")
        if args.fp8_scales != "made":
            raise UsageError("--fp8-scales gives the GPU kernels out= arrays to write; the reference backend's calls "
                             "make their results")
        for flag, given in (("--inner-events", args.inner_events), ("--kernel-span", args.kernel_span)):
            if given:
                raise UsageError(f"{flag} times the CUDA graphs' kernels; the reference backend has none")
    elif args.graph is False:  # --no-graph on the GPU: the graphs' flags, given, would change nothing
        for flag, given in (("--inner-events", args.inner_events), ("--kernel-span", args.kernel_span),
                            ("--graph-ends", args.graph_ends != "both"), ("--parities", args.parities != "one"),
                            ("--hold-ms", args.hold_ms != HOLD_MS)):
            if given:
                raise UsageError(f"{flag} applies to the CUDA graphs' replays; --no-graph times eager calls")
    if args.graph is None:
        args.graph = backend == "cuda"
    for name in ("inner_events", "kernel_span"):  # on by default where there is a GPU to time
        if getattr(args, name) is None:
            setattr(args, name, backend == "cuda")
    check_args(args, ranks_flag)
    if args.warmup == 0 and args.warmup_ms != WARMUP_MS:
        raise UsageError("--warmup-ms paces rounds of --warmup untimed replays; --warmup 0 runs none")
    if backend != "reference" and args.warmup == 0:
        args.warmup_ms = 0.0  # recorded as run: none
    if backend == "reference":
        for flag, given, default in (("--warmup-ms", args.warmup_ms, WARMUP_MS), ("--hold-ms", args.hold_ms, HOLD_MS)):
            if given != default:  # (after check_args: a value out of range is named as such)
                raise UsageError(f"{flag} paces the GPU's replays; the reference backend's calls run on the host")
        args.warmup_ms, args.hold_ms = 0.0, 0.0  # GPU timing only: recorded as not applied
        # Every rank's received rows, per channel: what the reference backend and the timed calls hold
        # of them, 14 + 2R bytes (the received rows, the expert outputs, every rank's inputs as the
        # exchange unpickles them; measured on 2026-12-06 as the peak RSS at T = 64 and 512, H = 1024,
        # E = 16, one input set: 20.5, 25.9 and 34.3 bytes a channel at R = 2, 4 and 8, input sets
        # included; the 1 byte counted before let runs through that the kernel then killed). And the
        # input sets (x, and the expert outputs laid out as every rank's received rows, bf16), in this
        # host, at the sweep's largest point.
        tokens = max([args.tokens, *args.sweep_tokens]) if args.plot is not None else args.tokens
        rows = args.experts * args.ranks * tokens * args.hidden
        input_bytes = args.input_sets * (args.ranks * tokens * args.hidden + rows) * 2
        check_host_memory("bench on the reference backend", rows * (14 + 2 * args.ranks) + input_bytes,
                          f"--tokens{', --sweep-tokens' if args.plot is not None else ''}, --hidden, --experts, "
                          f"--input-sets or {ranks_flag}")


def run_ranks(args, backend: str, why: str, group) -> int:
    """Measure (every point of a sweep too) and report: in-process ranks, or this process's rank of
    ``group``, where rank 0 prints and writes the files."""
    settle_args(args, backend, "--ranks" if group is None else "WORLD_SIZE")  # a group's ranks: the environment's
    reporting = group is None or group.rank == 0
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = _NoProgress
    if not reporting:
        tqdm = _NoProgress
    if backend == "reference" and reporting:
        print(f"bench: the reference backend ({why}): host wall time of numpy code, not the kernels")
    if group is not None and args.baseline:
        args.baseline = False
        if reporting:
            print("bench: no torch baseline with ranks in processes (it issues every rank's work from one process)")

    measure = measure_cuda if backend == "cuda" else measure_reference

    def measured(tokens: int) -> dict:
        point = argparse.Namespace(**{**vars(args), "tokens": tokens})
        replays = (args.warmup + args.iters) * (len(PHASES) + (len(BASELINE_PHASES) if args.baseline else 0))
        if backend == "cuda":
            replays += args.warmup + HOST_TIMED_CALLS
            if spans_profiled(args, group):
                replays += args.iters * len(PHASES)
            if inner_events_timed(args):
                replays += (args.warmup + args.iters) * len(PHASES)
        # Hidden when stderr is not a terminal (disable=None): a bar written into a pipe that closed
        # raised inside tqdm's lock, from a rank's thread, and the run hung in close().
        progress = tqdm(total=replays, desc=f"bench T={tokens}", unit="call", leave=False, delay=PROGRESS_DELAY_S,
                        disable=None)
        try:
            return measure(point, progress, group)
        finally:
            progress.close()

    report = measured(args.tokens)
    report["config"]["group"] = "local" if group is None else "processes"
    # The hold where it applied (0 elsewhere), as config.inner_events records its flag.
    report["config"]["hold_ms"] = args.hold_ms if backend == "cuda" and in_process_graphs(args, group) else 0.0
    if reporting:
        print_report(report)
    # Written now and after each point of a sweep: a point that fails (out of memory at the largest T)
    # or a plot that cannot be written loses none of the measurements before it.
    if args.json and reporting:
        write_json("--json", args.json, report)
    if args.plot is not None:
        report["sweep"] = []
        for tokens in tqdm(args.sweep_tokens, desc="bench sweep", unit="point", disable=None):
            phases = report["phases"] if tokens == args.tokens else measured(tokens)["phases"]
            report["sweep"].append({"tokens": tokens, "phases": phases})
            if args.json and reporting:
                write_json("--json", args.json, report)
    if args.plot is not None and reporting:
        plot_sweep(args.plot, report, report["sweep"])
        print(f"plot of {len(report['sweep'])} points (tokens per rank {', '.join(map(str, args.sweep_tokens))}): "
              f"{args.plot}")
    return EXIT_OK
