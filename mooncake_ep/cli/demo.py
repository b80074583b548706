"""Run a small MoE layer through dispatch and combine, and check it against a dense computation.

Every rank routes random bf16 tokens with a random softmax router (top-k, weights renormalised to
sum to 1), dispatches them, multiplies the rows each local expert received by that expert's weight
matrix, and combines. The result is compared on the host with the same layer computed densely in
float32: every token through its top-k experts, with the same weights. With fp8 dispatch the dense
input is the tokens quantised and dequantised exactly as dispatch does (mooncake_ep.reference), so
only the bf16 roundings of the expert outputs and of the combined sum remain.

Ranks are threads of this process (mooncake_ep.LocalGroup) by default. With ``--launch N`` they are
N processes on this host, started with the environment torchrun gives (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT on a free port), each joining through ``mooncake_ep.init_group()``; rank 0
prints the table and the command exits 0 only if every process passed. ``--group init`` runs one
such process, for a launcher that sets those variables itself, e.g.
``torchrun --nproc-per-node 2 -m mooncake_ep demo --group init``. With a GPU (cupy and CUDA torch
installed) the ranks run on the kernels: threads share device 0; processes use GPU
``LOCAL_RANK % (number of GPUs)`` (all on device 0 on a one-GPU machine) and reach each other
through CUDA IPC (the ``ipc`` transport). Without one they run on the numpy reference backend.
The expert weights live in host memory as float32, experts x hidden^2 x 4 bytes: keep it small
(the defaults need 128 MiB); `python -m mooncake_ep bench` is the tool for large shapes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time

import numpy as np

import mooncake_ep
from mooncake_ep import reference
from mooncake_ep.cli import (EXIT_FAILURE, EXIT_OK, UsageError, check_host_memory, check_moe_shape, check_output_path,
                             flag_message, launch, write_json)
from mooncake_ep.cli.gpu import choose_backend
from mooncake_ep.validation import check_timeout

# Relative error a token may show: the norm of its row's difference over that of its dense row, for
# every token (one norm over a rank's tokens hid a token that lost an expert's contribution among
# many right ones). The roundings (fp8 inputs, bf16 expert outputs and sums) give at most ~3e-3 per
# token at the demo's shapes; 2e-2 still catches a misrouted token or one missing its smallest
# expert term, which costs that term's share of the weights.
DEFAULT_TOLERANCE = 2e-2
# How long a GPU rank waits for a peer before masking it: a broken run ends as a failed check.
DEFAULT_TIMEOUT_US = 10_000_000
# In-process ranks when --ranks is not given.
DEFAULT_RANKS = 4

# Independent random streams, all derived from --seed (numpy SeedSequence entropy lists), so the
# weights are the same on every rank and in every run, whatever the rank count or backend.
_STREAM_ROUTER = 0
_STREAM_EXPERT = 1
_STREAM_TOKENS = 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ranks", type=int, default=argparse.SUPPRESS, metavar="N",
                        help=f"ranks as threads of this process (default: {DEFAULT_RANKS}); with --launch or "
                             f"--group init the ranks are processes, and --ranks, if given, must match their number")
    launch.add_arguments(parser, "demo")
    parser.add_argument("--experts", type=int, default=32, metavar="N", help="experts in all, a multiple of --ranks")
    parser.add_argument("--topk", type=int, default=4, metavar="K", help="experts per token")
    parser.add_argument("--hidden", type=int, default=1024, metavar="H", help="hidden size, a multiple of 128")
    parser.add_argument("--tokens", type=int, default=64, metavar="T", help="tokens per rank (also the buffer's maximum)")
    parser.add_argument("--fp8", action=argparse.BooleanOptionalAction, default=True,
                        help="dispatch in fp8 e4m3 with one scale per 128 channels (else bf16)")
    parser.add_argument("--backend", choices=("auto", "cuda", "reference"), default="auto",
                        help="auto: the GPU if one is usable, else the numpy reference")
    parser.add_argument("--seed", type=int, default=0, metavar="INT", help="seed of the router, expert weights and tokens")
    parser.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE, metavar="RATIO",
                        help="largest relative error of a token (norm of its row's difference / norm of its dense "
                             "row) that passes")
    parser.add_argument("--timeout-us", type=int, default=DEFAULT_TIMEOUT_US, metavar="US",
                        help="microseconds a GPU rank waits for a peer before masking it; -1 waits forever")
    parser.add_argument("--json", metavar="PATH", help="also write the configuration and results as JSON here")


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    num_ranks: int
    num_experts: int
    num_topk: int
    hidden: int
    num_tokens: int  # per rank; also num_max_dispatch_tokens_per_rank
    use_fp8: bool
    seed: int
    timeout_us: int

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.num_ranks


@dataclasses.dataclass(frozen=True)
class Weights:
    """The layer, identical on every rank: router ``[hidden, num_experts]`` and experts
    ``[num_experts, hidden, hidden]``, float32."""

    router: np.ndarray
    experts: np.ndarray


@dataclasses.dataclass(frozen=True)
class Inputs:
    """One rank's tokens and routing: x ``[num_tokens, hidden]`` bf16, topk_idx ``[num_tokens, num_topk]``
    int64, topk_weights ``[num_tokens, num_topk]`` float32."""

    x: np.ndarray
    topk_idx: np.ndarray
    topk_weights: np.ndarray


@dataclasses.dataclass(frozen=True)
class RankResult:
    rank: int
    tokens_sent: int
    rows_received: int
    max_abs_error: float
    relative_error: float  # the worst token's
    masked_ranks: list[int]  # ranks this rank's active_ranks marked dead after the calls
    passed: bool


def make_weights(config: DemoConfig) -> Weights:
    """Router and expert weights from the seed; expert ``e`` depends only on (seed, e)."""
    hidden = config.hidden
    # Variance 1/hidden keeps logits and expert outputs of unit-variance tokens near unit variance.
    std = np.float32(1.0 / np.sqrt(hidden))
    router_rng = np.random.default_rng([config.seed, _STREAM_ROUTER])
    router = router_rng.standard_normal((hidden, config.num_experts), dtype=np.float32) * std
    experts = np.empty((config.num_experts, hidden, hidden), dtype=np.float32)
    for expert in range(config.num_experts):
        rng = np.random.default_rng([config.seed, _STREAM_EXPERT, expert])
        rng.standard_normal((hidden, hidden), dtype=np.float32, out=experts[expert])
        experts[expert] *= std
    return Weights(router, experts)


def make_inputs(config: DemoConfig, rank: int, weights: Weights) -> Inputs:
    """Rank ``rank``'s tokens, routed by a softmax over the router's logits (top-k, renormalised)."""
    rng = np.random.default_rng([config.seed, _STREAM_TOKENS, rank])
    x = rng.standard_normal((config.num_tokens, config.hidden), dtype=np.float32).astype(reference.bfloat16)
    logits = x.astype(np.float32) @ weights.router
    probs = np.exp(logits - logits.max(axis=1, keepdims=True))
    probs /= probs.sum(axis=1, keepdims=True)
    topk_idx = np.argsort(-probs, axis=1, kind="stable")[:, : config.num_topk]
    topk_weights = np.take_along_axis(probs, topk_idx, axis=1)
    topk_weights /= topk_weights.sum(axis=1, keepdims=True)
    return Inputs(x, topk_idx.astype(np.int64), topk_weights.astype(np.float32))


def dense_layer(config: DemoConfig, inputs: Inputs, weights: Weights) -> np.ndarray:
    """``[num_tokens, hidden]`` float32: Σ_k w_k · (x @ W_{e_k}), on the tokens dispatch delivers."""
    if config.use_fp8:
        q, scales = reference.quantize_fp8(inputs.x, round_scale=False, use_ue8m0=False)
        x = reference.dequantize_fp8(q, scales, use_ue8m0=False)
    else:
        x = inputs.x.astype(np.float32)
    out = np.zeros((config.num_tokens, config.hidden), dtype=np.float32)
    for expert in np.unique(inputs.topk_idx):
        tokens, slots = np.nonzero(inputs.topk_idx == expert)
        out[tokens] += inputs.topk_weights[tokens, slots, None] * (x[tokens] @ weights.experts[expert])
    return out


def compare(config: DemoConfig, rank: int, inputs: Inputs, weights: Weights, combined: np.ndarray,
            rows_received: int, active_ranks: np.ndarray, tolerance: float) -> RankResult:
    dense = dense_layer(config, inputs, weights)
    diff = combined.astype(np.float32) - dense
    max_abs = float(np.abs(diff).max(initial=0.0))
    # The worst token's: a dense row of norm 0 (no expert) must come back 0, so its error is absolute.
    norms, errors = np.linalg.norm(dense, axis=1), np.linalg.norm(diff, axis=1)
    relative = float(np.where(norms > 0, errors / np.where(norms > 0, norms, 1), errors).max(initial=0.0))
    masked = [int(r) for r in np.flatnonzero(np.asarray(active_ranks) == 0)]
    passed = bool(np.isfinite(relative) and relative < tolerance and not masked)
    return RankResult(rank, config.num_tokens, rows_received, max_abs, relative, masked, passed)


# --- one rank's step, on each backend --------------------------------------------------------------


def _host_rank_step(group, config: DemoConfig, weights: Weights, tolerance: float) -> RankResult:
    """numpy arrays on the reference backend; the expert is a numpy matmul."""
    inputs = make_inputs(config, group.rank, weights)
    size = mooncake_ep.Buffer.get_ep_buffer_size_hint(config.num_tokens, config.hidden, config.num_ranks,
                                                       config.num_experts)
    buffer = mooncake_ep.Buffer(group, size, backend="reference")
    active_ranks = np.ones(config.num_ranks, dtype=np.int32)
    recv_x, recv_count, handle, _, _ = buffer.dispatch(
        inputs.x, inputs.topk_idx, active_ranks, config.num_tokens, config.num_experts,
        timeout_us=config.timeout_us, use_fp8=config.use_fp8)
    first_expert = group.rank * config.num_local_experts
    expert_out = np.zeros((config.num_local_experts, config.num_ranks * config.num_tokens, config.hidden),
                          dtype=reference.bfloat16)
    for local_expert, count in enumerate(int(c) for c in recv_count):
        if config.use_fp8:
            x_fp8, scales = recv_x
            rows = reference.dequantize_fp8(x_fp8[local_expert, :count], scales[local_expert, :count],
                                            use_ue8m0=False)
        else:
            rows = recv_x[local_expert, :count].astype(np.float32)
        w = weights.experts[first_expert + local_expert]
        expert_out[local_expert, :count] = (rows @ w).astype(reference.bfloat16)
    combined, _, _ = buffer.combine(expert_out, inputs.topk_idx, inputs.topk_weights, active_ranks,
                                    config.timeout_us, handle)
    buffer.destroy()
    return compare(config, group.rank, inputs, weights, np.asarray(combined), int(np.sum(recv_count)),
                   active_ranks, tolerance)


def _cuda_rank_step(group, config: DemoConfig, weights: Weights, tolerance: float) -> RankResult:
    """torch CUDA tensors on the GPU kernels; the expert is ``recv_x[e, :count] @ W_e`` in float32.

    LocalGroup.spawn made this rank's device and its own stream current for torch (threads), or
    launch.use_process_device made its device current (processes, on the default stream).

    Note:
        In-process ranks share one GPU and their kernels wait for each other. A device allocation (torch's
        allocator growing, cuBLAS creating its workspace) made while a peer's kernel is waiting can
        hold back the kernels issued after it (CUDA's implicit synchronisation), so the peer waits
        for a rank that cannot start and times out. So this step allocates every array before the
        first launch (outputs through ``out=``), and does its expert work, which allocates, only
        between a barrier after dispatch has finished everywhere and one before combine.
    """
    import torch

    device = torch.device("cuda", torch.cuda.current_device())
    stream = torch.cuda.current_stream(device)
    inputs = make_inputs(config, group.rank, weights)
    size = mooncake_ep.Buffer.get_ep_buffer_size_hint(config.num_tokens, config.hidden, config.num_ranks,
                                                       config.num_experts)
    buffer = mooncake_ep.Buffer(group, size, backend="cuda")
    # torch.from_numpy refuses ml_dtypes' bf16: move the raw bits and reinterpret them.
    x = torch.from_numpy(inputs.x.view(np.uint16)).view(torch.bfloat16).to(device)
    topk_idx = torch.from_numpy(inputs.topk_idx).to(device)
    topk_weights = torch.from_numpy(inputs.topk_weights).to(device)
    active_ranks = torch.ones(config.num_ranks, dtype=torch.int32, device=device)
    first_expert = group.rank * config.num_local_experts
    local_weights = torch.from_numpy(
        weights.experts[first_expert:first_expert + config.num_local_experts]).to(device)
    recv_shape = (config.num_local_experts, config.num_ranks * config.num_tokens, config.hidden)
    recv_count = torch.empty(config.num_local_experts, dtype=torch.int32, device=device)
    if config.use_fp8:
        # The scales in the layout dispatch makes them in (DeepEP's): [E_l, rows, blocks] viewed over
        # [E_l, blocks, rows]. A row-major array works too.
        num_blocks = reference.num_scale_columns(config.hidden, False)
        scales = torch.empty((recv_shape[0], num_blocks, recv_shape[1]), dtype=torch.float32, device=device)
        recv_x = (torch.empty(recv_shape, dtype=torch.float8_e4m3fn, device=device), scales.transpose(1, 2))
    else:
        recv_x = torch.empty(recv_shape, dtype=torch.bfloat16, device=device)
    expert_out = torch.zeros(recv_shape, dtype=torch.bfloat16, device=device)
    combined = torch.empty((config.num_tokens, config.hidden), dtype=torch.bfloat16, device=device)
    stream.synchronize()
    group.barrier()  # every rank has allocated: no allocation overlaps a waiting kernel

    _, _, handle, _, _ = buffer.dispatch(x, topk_idx, active_ranks, config.num_tokens, config.num_experts,
                                         timeout_us=config.timeout_us, use_fp8=config.use_fp8,
                                         out=(recv_x, recv_count))
    # A real MoE step never reads recv_count on the host (a sync, and it breaks graph capture): its
    # grouped GEMM takes the counts on the device. A demo may sync and slice.
    stream.synchronize()
    counts = [int(c) for c in recv_count.cpu().tolist()]
    for local_expert, count in enumerate(counts):
        if config.use_fp8:
            x_fp8, scales = recv_x
            num_blocks = scales.shape[-1]  # one fp8 scale per block of channels
            rows = (x_fp8[local_expert, :count].float().view(count, num_blocks, config.hidden // num_blocks)
                    * scales[local_expert, :count, :, None]).view(count, config.hidden)
        else:
            rows = recv_x[local_expert, :count].float()
        expert_out[local_expert, :count] = (rows @ local_weights[local_expert]).to(torch.bfloat16)
    stream.synchronize()
    group.barrier()  # every rank's expert work (and its allocations) is done before any combine waits

    buffer.combine(expert_out, topk_idx, topk_weights, active_ranks, config.timeout_us, handle, out=combined)
    stream.synchronize()  # combine is done on every rank before this one allocates again
    combined_host = combined.float().cpu().numpy()
    active_host = active_ranks.cpu().numpy()
    buffer.destroy()
    return compare(config, group.rank, inputs, weights, combined_host, sum(counts), active_host, tolerance)


def _make_config(args: argparse.Namespace, num_ranks: int, ranks_flag: str) -> DemoConfig:
    """The demo's configuration with ``num_ranks`` ranks, which ``ranks_flag`` set (for messages)."""
    given = getattr(args, "ranks", None)
    if given is not None and given != num_ranks:
        raise UsageError(f"--ranks {given} does not match {ranks_flag} {num_ranks}; leave --ranks out")
    config = DemoConfig(num_ranks, args.experts, args.topk, args.hidden, args.tokens, args.fp8, args.seed,
                        args.timeout_us)
    _check_config(config, args.tolerance, ranks_flag)
    check_output_path("--json", args.json)
    return config


def _check_config(config: DemoConfig, tolerance: float, ranks_flag: str) -> None:
    for flag, value in ((ranks_flag, config.num_ranks), ("--experts", config.num_experts),
                        ("--topk", config.num_topk), ("--tokens", config.num_tokens)):
        if value < 1:
            raise UsageError(f"{flag} must be >= 1, got {value}")
    check_moe_shape(config.num_tokens, config.hidden, config.num_ranks, ranks_flag, config.num_experts,
                    config.num_topk, config.seed)
    if config.timeout_us < -1:
        raise UsageError(f"--timeout-us must be >= -1 (-1 waits forever), got {config.timeout_us}")
    try:  # the library's ceiling (nanoseconds in an int64), with its message
        check_timeout("demo", config.timeout_us)
    except ValueError as exc:
        raise UsageError(flag_message(exc, {"timeout_us": "--timeout-us"})) from None
    if not (tolerance > 0 and np.isfinite(tolerance)):  # inf would pass every result
        raise UsageError(f"--tolerance must be a finite number > 0, got {tolerance}")


def _check_memory(config: DemoConfig, backend: str, num_processes: int, ranks_per_process: int,
                  ranks_flag: str) -> None:
    """The host memory this host's processes need at least (UsageError if it has less): each makes
    the expert matrices (float32), and on the reference backend holds, per channel of its ranks'
    received rows (on the GPU they are in device memory), the fp8 byte, the expert's float32 output,
    the bf16 expert outputs, and every rank's outputs as the exchange unpickles them (2 bytes each):
    7 + 2R bytes. Measured on 2026-12-06 (4 ranks, 256 and 1024 tokens, peak RSS): 15.3 bytes a
    channel, against the 15 of this count and the 1 an earlier check counted, which let through runs
    that the kernel then killed for want of memory."""
    expert_bytes = config.num_experts * config.hidden * config.hidden * 4
    bytes_per_channel = 7 + 2 * config.num_ranks
    recv_bytes = ranks_per_process * config.num_experts * config.num_tokens * config.hidden * bytes_per_channel
    needed = num_processes * (expert_bytes + (recv_bytes if backend == "reference" else 0))
    check_host_memory("the demo", needed, f"--hidden, --experts, --tokens or {ranks_flag}")


# --- output -------------------------------------------------------------------------------------

_COLUMNS = ("rank", "tokens sent", "rows received", "max abs error", "worst token rel error", "result")


def _rows(results: list[RankResult]) -> list[tuple[str, ...]]:
    rows = []
    for r in results:
        verdict = "pass" if r.passed else ("FAIL (masked " + ",".join(map(str, r.masked_ranks)) + ")"
                                           if r.masked_ranks else "FAIL")
        rows.append((str(r.rank), str(r.tokens_sent), str(r.rows_received), f"{r.max_abs_error:.3e}",
                     f"{r.relative_error:.2e}", verdict))
    return rows


def _print_table(results: list[RankResult]) -> None:
    rows = _rows(results)
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(_COLUMNS)]
        print("  ".join(c.rjust(w) for c, w in zip(_COLUMNS, widths)))
        print("  ".join("-" * w for w in widths))
        for row in rows:
            print("  ".join(cell.rjust(w) for cell, w in zip(row, widths)))
        return
    table = Table()
    for column in _COLUMNS:
        table.add_column(column, justify="right", no_wrap=True)
    for row, result in zip(rows, results):
        table.add_row(*row, style=None if result.passed else "bold red")
    Console().print(table)


def _print_header(config: DemoConfig, kind: str, backend: str, why: str) -> None:
    print(f"mooncake_ep demo: {config.num_ranks} {kind} x {config.num_tokens} tokens, {config.num_experts} experts "
          f"(top-{config.num_topk}), hidden {config.hidden}, {'fp8' if config.use_fp8 else 'bf16'} dispatch, "
          f"backend {backend} ({why})")
    sys.stdout.flush()


def _report(config: DemoConfig, backend: str, results: list[RankResult], elapsed_s: float,
            args: argparse.Namespace) -> int:
    """Print the table and the verdict, write ``--json``; the exit code."""
    _print_table(results)
    failed = [r.rank for r in results if not r.passed]
    against = "of the same layer computed densely in float32" + (" from the dequantised fp8 tokens"
                                                                 if config.use_fp8 else "")
    if failed:
        def error(r: RankResult) -> float:  # a NaN error is the worst
            return math.inf if math.isnan(r.relative_error) else r.relative_error

        worst = max(results, key=error)
        off = [r.rank for r in results if not error(r) < args.tolerance]
        masking = {r.rank: r.masked_ranks for r in results if r.masked_ranks}
        reasons = [f"ranks {off} have a token off by more than relative error {args.tolerance:g} {against} "
                   f"(worst: rank {worst.rank}, {worst.relative_error:.3g})"] if off else []
        reasons += [f"rank {rank} masked ranks {masked}" for rank, masked in masking.items()]
        print(f"FAIL: {'; '.join(reasons)} ({elapsed_s:.2f} s)")
    else:
        print(f"PASS: every token within relative error {args.tolerance:g} {against} ({elapsed_s:.2f} s)")
    sys.stdout.flush()
    if args.json:
        report = {"config": dataclasses.asdict(config), "backend": backend, "tolerance": args.tolerance,
                  "elapsed_s": elapsed_s, "passed": not failed, "ranks": [dataclasses.asdict(r) for r in results]}
        write_json("--json", args.json, report)
    return EXIT_FAILURE if failed else EXIT_OK


def run(args: argparse.Namespace) -> int:
    if args.launch is not None:
        launch.check_launch(args)
        return _run_launcher(args)
    if args.group == "init":
        return _run_process_rank(args)
    return _run_threads(args)


# --- ranks as threads ----------------------------------------------------------------------------


def _run_threads(args: argparse.Namespace) -> int:
    config = _make_config(args, getattr(args, "ranks", DEFAULT_RANKS), "--ranks")
    backend, why = choose_backend(args.backend)
    _check_memory(config, backend, 1, config.num_ranks, "--ranks")
    _print_header(config, "ranks", backend, why)
    weights = make_weights(config)
    start = time.perf_counter()
    if backend == "cuda":
        group = mooncake_ep.LocalGroup(config.num_ranks, devices=[0] * config.num_ranks)
        results = group.spawn(_cuda_rank_step, config, weights, args.tolerance)
    else:
        group = mooncake_ep.LocalGroup(config.num_ranks)
        results = group.spawn(_host_rank_step, config, weights, args.tolerance)
    return _report(config, backend, results, time.perf_counter() - start, args)


# --- ranks as processes --------------------------------------------------------------------------


def _run_process_rank(args: argparse.Namespace) -> int:
    """One rank of a multi-process run: join, run the step, gather every rank's result on rank 0."""
    backend, why = choose_backend(args.backend)
    world_size = launch.env_world_size()
    if world_size is not None:  # the flags, before the wait for every rank to join
        _make_config(args, world_size, "WORLD_SIZE")
    with launch.joined_group(backend) as group:
        return _process_rank_step(group, args, backend, why)


def _process_rank_step(group: mooncake_ep.Group, args: argparse.Namespace, backend: str, why: str) -> int:
    config = _make_config(args, group.world_size, "WORLD_SIZE")  # the same flags fail alike on every rank
    _check_memory(config, backend, 1, 1, "WORLD_SIZE")
    if group.rank == 0:
        _print_header(config, "ranks (processes)", backend, why)
    weights = make_weights(config)
    group.barrier()  # every process is ready: time the step alone
    start = time.perf_counter()
    step = _cuda_rank_step if backend == "cuda" else _host_rank_step
    result = step(group, config, weights, args.tolerance)
    blobs = group.allgather_bytes(json.dumps(dataclasses.asdict(result)).encode())
    results = [RankResult(**json.loads(blob)) for blob in blobs]
    elapsed_s = time.perf_counter() - start
    if group.rank == 0:
        return _report(config, backend, results, elapsed_s, args)
    return EXIT_OK if all(r.passed for r in results) else EXIT_FAILURE


def _rank_argv(args: argparse.Namespace, config: DemoConfig) -> list[str]:
    """The command line of one launched process: this demo's flags, as one rank (--group init)."""
    argv = launch.rank_command(
        *["-v"] * getattr(args, "verbose", 0), "demo", "--group", "init", "--experts", str(config.num_experts),
        "--topk", str(config.num_topk), "--hidden", str(config.hidden), "--tokens", str(config.num_tokens),
        "--fp8" if config.use_fp8 else "--no-fp8", "--backend", args.backend, "--seed", str(config.seed),
        "--tolerance", repr(args.tolerance), "--timeout-us", str(config.timeout_us))
    return argv + ([f"--json={args.json}"] if args.json else [])  # one token: a path may start with "-"


def _run_launcher(args: argparse.Namespace) -> int:
    """``--launch N``: start N rank processes on this host, wait for all, pass only if all passed."""
    config = _make_config(args, args.launch, "--launch")
    backend, _ = choose_backend(args.backend)  # --backend cuda without a GPU: refused here
    _check_memory(config, backend, args.launch, 1, "--launch")  # every process on this host
    return launch.launch("demo", _rank_argv(args, config), args.launch)
