"""Tests of the benchmark (mooncake_ep.cli.bench) and its torch baseline (mooncake_ep.cli.baseline), on the CPU.

The baseline must compute what mooncake_ep computes: it is checked against mooncake_ep.reference on
fresh random inputs (dispatch bit-exact, combine within bf16 rounding). The command is smoke-run on
the reference backend in a subprocess, as users and CI run it: exit code, JSON schema, the PNG.
No assertion is about elapsed time; the process limit only turns a hang into a failure.
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from mooncake_ep import _constants, cli, reference  # noqa: E402 - after the torch skip
from mooncake_ep.cli import baseline, bench, launch  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
PROCESS_LIMIT_S = 120.0
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
PHASE_KEYS = {"p50_us", "p90_us", "p99_us", "floor_us", "ratio_to_floor", "deepep_gbps_per_rank", "baseline_p50_us",
              "speedup_vs_baseline", "inner_events", "kernel_span", "graph_span"}
TOP_KEYS = {"date", "device", "config", "copy_bandwidth_gbps", "write_bandwidth_gbps", "host_us_per_call", "phases", "load"}
# Small shapes: (ranks, tokens T, hidden, top-k, experts).
SHAPES = [(2, 8, 256, 4, 8), (3, 5, 128, 2, 9), (4, 6, 384, 3, 16)]


def run_bench(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mooncake_ep", "bench", *argv], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=PROCESS_LIMIT_S)


# --- the baseline against the reference -------------------------------------------------------------


def random_inputs(seed: int, num_ranks: int, num_max_tokens: int, hidden: int, num_topk: int, num_experts: int):
    """Per rank: bf16 tokens, distinct expert ids with about a quarter -1, fp32 weights.

    Token counts differ per rank and include 0 and T (t < T, t = 0 and t = T all occur).
    """
    gen = torch.Generator().manual_seed(seed)
    counts = [0, num_max_tokens] + [int(torch.randint(1, num_max_tokens + 1, (), generator=gen))
                                    for _ in range(num_ranks - 2)]
    xs, topk_idxs, weights = [], [], []
    for num_tokens in counts:
        xs.append(torch.randn(num_tokens, hidden, generator=gen).to(torch.bfloat16))
        ids = torch.stack([torch.randperm(num_experts, generator=gen)[:num_topk] for _ in range(num_tokens)]) \
            if num_tokens else torch.empty(0, num_topk, dtype=torch.int64)
        ids[torch.rand(ids.shape, generator=gen) < 0.25] = _constants.NO_EXPERT
        topk_idxs.append(ids)
        weights.append(torch.rand(num_tokens, num_topk, generator=gen))
    return xs, topk_idxs, weights


def as_numpy(t: torch.Tensor) -> np.ndarray:
    """A torch CPU tensor as numpy, bf16 and fp8 as ml_dtypes (the reference's dtypes), same bits."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.uint16).numpy().view(reference.bfloat16)
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8).numpy().view(reference.float8_e4m3fn)
    return t.numpy()


def reference_dispatch(xs, topk_idxs, num_max_tokens, num_experts, use_fp8):
    num_ranks = len(xs)
    active = [np.ones(num_ranks, dtype=np.int32)] * num_ranks
    return [reference.dispatch(rank, [as_numpy(x) for x in xs], [t.numpy() for t in topk_idxs], active,
                               num_max_tokens, num_experts, use_fp8=use_fp8) for rank in range(num_ranks)]


def test_fp8_constants_are_the_library_s():
    assert baseline.FP8_BLOCK == _constants.FP8_BLOCK
    assert baseline.FP8_E4M3_MAX == _constants.FP8_E4M3_MAX
    assert baseline.FP8_AMAX_FLOOR == _constants.FP8_AMAX_FLOOR
    assert baseline.NO_EXPERT == _constants.NO_EXPERT


@pytest.mark.parametrize("use_fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "R{}-T{}-H{}-K{}-E{}".format(*s))
@pytest.mark.parametrize("seed", [0, 1])
def test_baseline_dispatch_is_the_reference_bit_for_bit(shape, use_fp8, seed):
    num_ranks, num_max_tokens, hidden, num_topk, num_experts = shape
    xs, topk_idxs, _ = random_inputs(seed, *shape)
    result = baseline.dispatch(xs, topk_idxs, num_max_tokens, num_experts, use_fp8=use_fp8)
    expected = reference_dispatch(xs, topk_idxs, num_max_tokens, num_experts, use_fp8)
    num_local_experts = num_experts // num_ranks
    for rank, ref in enumerate(expected):
        np.testing.assert_array_equal(result.recv_count[rank].numpy(), ref.recv_count)
        assert result.recv_count[rank].dtype == torch.int32
        assert tuple(result.recv_x[rank].shape) == (num_local_experts, num_ranks * num_max_tokens, hidden)
        for local_expert, count in enumerate(ref.recv_count):
            # Rows past recv_count are undefined: compare the valid ones, as raw bits. fp8 too: the
            # same fp32 division and a round-to-nearest-even cast on both sides.
            got = as_numpy(result.recv_x[rank][local_expert, :count])
            want = ref.recv_x[local_expert, :count]
            np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8),
                                          err_msg=f"rank {rank} local expert {local_expert}")
            if use_fp8:
                np.testing.assert_array_equal(result.recv_scales[rank][local_expert, :count].numpy().view(np.uint32),
                                              ref.recv_scales[local_expert, :count].view(np.uint32))
        if not use_fp8:
            assert result.recv_scales is None


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "R{}-T{}-H{}-K{}-E{}".format(*s))
@pytest.mark.parametrize("seed", [0, 1])
def test_baseline_combine_is_the_reference_within_bf16_rounding(shape, seed):
    num_ranks, num_max_tokens, hidden, num_topk, num_experts = shape
    xs, topk_idxs, weights = random_inputs(seed, *shape)
    result = baseline.dispatch(xs, topk_idxs, num_max_tokens, num_experts, use_fp8=False)
    expected = reference_dispatch(xs, topk_idxs, num_max_tokens, num_experts, False)
    gen = torch.Generator().manual_seed(seed + 100)
    expert_outs = [torch.randn(num_experts // num_ranks, num_ranks * num_max_tokens, hidden, generator=gen)
                   .to(torch.bfloat16) for _ in range(num_ranks)]
    combined = baseline.combine(expert_outs, weights, result.layout)
    active = [np.ones(num_ranks, dtype=np.int32)] * num_ranks
    for rank in range(num_ranks):
        want, _ = reference.combine(rank, [as_numpy(e) for e in expert_outs], expected, topk_idxs[rank].numpy(),
                                    weights[rank].numpy(), active)
        got = combined[rank]
        assert got.dtype == torch.bfloat16 and tuple(got.shape) == (xs[rank].shape[0], hidden)
        got, want = got.float().numpy(), want.astype(np.float32)
        # Both sums are fp32 over the same K terms in different orders (the reference in k order
        # with fused multiply-adds, the baseline in expert order), so before rounding they differ by
        # at most 2 * K * 2^-24 * sum |w y|; each is then rounded to bf16 once (8 significant bits),
        # which can put them one bf16 step apart: at most 2^-7 of the larger magnitude.
        sum_abs = abs_weighted_sum(expected, expert_outs, weights[rank].numpy(), rank)
        tolerance = 2.0 ** -7 * np.maximum(np.abs(got), np.abs(want)) + 2 * num_topk * 2.0 ** -24 * sum_abs
        assert np.all(np.abs(got - want) <= tolerance), f"rank {rank}: max diff {np.abs(got - want).max()}"


def abs_weighted_sum(dispatch_results, expert_outs, weights: np.ndarray, rank: int) -> np.ndarray:
    """``[t, H]`` fp64 sum over the token's delivered copies of |w y|, routed by the reference's dispatch."""
    acc = np.zeros((weights.shape[0], expert_outs[0].shape[-1]), dtype=np.float64)
    for expert_rank, result in enumerate(dispatch_results):
        local_experts, rows = np.nonzero(result.recv_src_rank == rank)
        tokens = result.recv_src_token[local_experts, rows]
        topks = result.recv_src_topk[local_experts, rows]
        y = expert_outs[expert_rank].float().numpy()[local_experts, rows]
        np.add.at(acc, tokens, np.abs(weights[tokens, topks, None].astype(np.float64) * y))
    return acc


# --- the command -----------------------------------------------------------------------------------


@pytest.mark.parametrize("use_fp8", [False, True], ids=["bf16", "fp8"])
def test_the_kernels_results_are_checked_against_the_baseline(use_fp8):
    """bench's check before timing: results equal to the baseline's pass, with rows past recv_count
    anything; a wrong count, row byte, scale or combined element raises, naming the rank."""
    num_ranks, num_max_tokens, hidden, num_topk, num_experts = 3, 5, 256, 2, 6
    xs, topk_idxs, weights = random_inputs(4, num_ranks, num_max_tokens, hidden, num_topk, num_experts)
    gen = torch.Generator().manual_seed(5)
    inputs = [dict(x=x, topk=t, weights=w, expert_out=torch.randn(num_experts // num_ranks, num_ranks * num_max_tokens,
                                                                  hidden, generator=gen).to(torch.bfloat16))
              for x, t, w in zip(xs, topk_idxs, weights)]
    args = argparse.Namespace(tokens=num_max_tokens, experts=num_experts, fp8=use_fp8)

    def results():
        """What correct kernels return: the baseline's results, with NaN rows past recv_count."""
        expected = baseline.dispatch(xs, topk_idxs, num_max_tokens, num_experts, use_fp8=use_fp8)
        combined = baseline.combine([inp["expert_out"] for inp in inputs], weights, expected.layout)
        dispatched = {}
        for r in range(num_ranks):
            rows = expected.recv_x[r].clone()
            for e, count in enumerate(expected.recv_count[r].tolist()):
                rows[e, count:] = float("nan")
            recv_x = (rows, expected.recv_scales[r].clone()) if use_fp8 else rows
            dispatched[r] = recv_x, expected.recv_count[r].clone()
        return dispatched, dict(enumerate(combined))

    dispatched, combined = results()
    bench.check_against_baseline(args, inputs, dispatched, combined, torch)
    combined[1][0, 0] = combined[1][0, 0].float() * 1.05 + 0.1  # past one bf16 rounding
    with pytest.raises(cli.CheckFailed,
                       match=r"^bench: rank 1's combined_x differs from the torch baseline's by up to"):
        bench.check_against_baseline(args, inputs, dispatched, combined, torch)
    busy = max(range(num_ranks), key=lambda r: int(dispatched[r][1].sum()))
    expert = int(dispatched[busy][1].argmax())
    corruptions = [("recv_count", lambda d: d[busy][1].__setitem__(expert, d[busy][1][expert] + 1),
                    rf"rank {busy}'s recv_count \[.*\] differs"),
                   ("recv_x", lambda d: (d[busy][0][0] if use_fp8 else d[busy][0])[expert, 0, 5].fill_(3.0),
                    rf"rank {busy}'s recv_x of local expert {expert} differ")]
    if use_fp8:
        corruptions.append(("scales", lambda d: d[busy][0][1][expert, 0, 1].fill_(7.0),
                            rf"rank {busy}'s scales of local expert {expert} differ"))
    for name, corrupt, pattern in corruptions:
        dispatched, combined = results()
        corrupt(dispatched)
        with pytest.raises(cli.CheckFailed, match=pattern):
            bench.check_against_baseline(args, inputs, dispatched, combined, torch)


def test_a_failed_check_is_one_line_and_exit_1(monkeypatch, capsys):
    """A check of the results is the run's verdict, not a crash: it read as a RuntimeError's traceback."""
    from mooncake_ep.cli import bench

    def failing(*args):
        raise cli.CheckFailed("bench: rank 1's combined_x differs from the torch baseline's by up to 0.5")

    monkeypatch.setattr(bench, "run_ranks", failing)
    assert cli.main(["bench", "--backend", "reference"]) == 1
    lines = capsys.readouterr().err.strip().splitlines()  # the program's name as this process was started
    assert len(lines) == 1 and lines[0].endswith(
        " bench: CheckFailed: bench: rank 1's combined_x differs from the torch baseline's by up to 0.5"), lines


def test_expert_load_counts_copies_per_expert_and_per_owning_rank():
    # 2 ranks x 2 local experts; set 0: expert 0 twice, 1 once, 3 once (-1 ignored); set 1: even.
    uneven = [np.array([[0, 1], [0, -1]]), np.array([[3, -1]])]
    even = [np.array([[0, 1]]), np.array([[2, 3]])]
    load = bench.expert_load([uneven, even], num_experts=4, num_ranks=2)
    # set 0: per expert (2, 1, 0, 1), mean 1 -> 2.0; per rank (3, 1), mean 2 -> 1.5, busiest 3 copies.
    assert load == pytest.approx({"expert_max_over_mean": (2.0 + 1.0) / 2, "rank_max_over_mean": (1.5 + 1.0) / 2,
                                  "max_copies_per_rank": (3 + 2) / 2})
    assert bench.expert_load([[np.full((2, 1), -1)]], num_experts=4, num_ranks=2)["rank_max_over_mean"] == 1.0


def test_k_hot_routing_loads_the_hot_experts_rank():
    args = argparse.Namespace(experts=64, topk=4, routing="k_hot", hot_fraction=1.0, hot_experts=8, alpha=1.2)
    routes = [bench.route(np.random.default_rng(seed), args, 32) for seed in range(4)]
    hot = bench.expert_load([routes], num_experts=64, num_ranks=8)
    args.routing = "uniform"
    uniform = bench.expert_load([[bench.route(np.random.default_rng(seed), args, 32) for seed in range(4)]], 64, 8)
    assert hot["rank_max_over_mean"] == pytest.approx(8.0)  # every copy on rank 0's 8 experts
    assert uniform["rank_max_over_mean"] < 2.0


def check_schema(report: dict, *, with_baseline: bool, backend: str = "reference") -> None:
    assert TOP_KEYS <= report.keys(), sorted(report)
    on_gpu = backend == "cuda"
    assert report["backend"] == backend and report["timer"] == ("cuda_events" if on_gpu else "host")
    assert (report["copy_bandwidth_gbps"] is not None) is on_gpu
    assert (report["write_bandwidth_gbps"] is not None) is on_gpu
    hooks = {"dispatch_hook", "combine_hook"} if report["config"]["mode"] == "hook" else set()
    assert set(report["host_us_per_call"]) == {"dispatch", "combine"} | hooks
    assert all(v > 0 for v in report["host_us_per_call"].values())
    assert set(report["phases"]) == {"dispatch", "combine", "combine_zero_copy", "step"}
    load = report["load"]
    assert load["expert_max_over_mean"] >= 1.0 and load["rank_max_over_mean"] >= 1.0
    assert load["max_copies_per_rank"] >= report["copies"] / report["config"]["ranks"]
    for phase, row in report["phases"].items():
        assert PHASE_KEYS <= row.keys(), (phase, sorted(row))
        assert 0 < row["p50_us"] <= row["p90_us"] <= row["p99_us"], (phase, row)
        if on_gpu:
            assert row["floor_us"] > 0 and row["ratio_to_floor"] == pytest.approx(row["p50_us"] / row["floor_us"])
        else:
            assert row["floor_us"] is None and row["ratio_to_floor"] is None  # no HBM floor without a GPU
        if on_gpu:
            assert row["deepep_gbps_per_rank"] > 0
        else:
            assert row["deepep_gbps_per_rank"] is None  # numpy's wall time is not a transfer
        config = report["config"]
        if on_gpu and config["graph"] and config["kernel_span"] and config["group"] == "local":
            span, graph = row["kernel_span"], row["graph_span"]
            assert 0 < span["p50_us"] <= span["p90_us"] <= span["p99_us"], (phase, span)
            assert span["ratio_to_floor"] == pytest.approx(span["p50_us"] / row["floor_us"])
            assert span["p50_us"] <= graph["p50_us"] <= graph["p90_us"] <= graph["p99_us"], (phase, span, graph)
        else:
            assert row["kernel_span"] is None and row["graph_span"] is None
        if on_gpu and config["graph"] and config["inner_events"] and config["graph_ends"] != "none":
            inner = row["inner_events"]
            assert 0 < inner["p50_us"] <= inner["p90_us"] <= inner["p99_us"], (phase, inner)
            assert inner["ratio_to_floor"] == pytest.approx(inner["p50_us"] / row["floor_us"])
        else:
            assert row["inner_events"] is None
        if with_baseline:
            assert row["baseline_p50_us"] > 0
            assert row["speedup_vs_baseline"] == pytest.approx(row["baseline_p50_us"] / row["p50_us"])
        else:
            assert row["baseline_p50_us"] is None and row["speedup_vs_baseline"] is None


def test_bench_reference_writes_the_json_schema(tmp_path):
    path = tmp_path / "bench.json"
    proc = run_bench("--backend", "reference", "--json", str(path), "--iters", "5")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "host wall time" in proc.stdout  # the output says what was timed
    # and the layout, which moves dispatch's time: torch tensors' results, in DeepEP's (helper-149: said row-major)
    assert "fp8 dispatch (scales DeepEP's layout)" in proc.stdout
    report = json.loads(path.read_text())
    check_schema(report, with_baseline=True)
    # The small default shape of the reference backend.
    shape = tuple(report["config"][k] for k in ("ranks", "tokens", "hidden", "topk", "experts"))
    assert shape == (2, 16, 256, 2, 8)
    assert report["config"]["iters"] == 5
    assert report["config"]["hold_ms"] == 0.0  # the hold is the GPU graphs' only
    # GPU-only flags (on by default) recorded as they applied: not here.
    assert (report["config"]["kernel_span"], report["config"]["inner_events"], report["config"]["warmup_ms"]) == \
        (False, False, 0.0)
    assert set(report["baseline"]) == {"dispatch", "combine", "step"}
    assert "alpha" not in report["config"]  # uniform routing has no parameters
    assert report["hold_ran_out"] == []  # the GPU graphs' hold: which phases' events timed the host's pace
    # How many samples each p99 is of: of 5, about their maximum, as the text says.
    assert all(row["samples"] == 5 for row in report["phases"].values())
    assert all(stats["samples"] == 5 for stats in report["baseline"].values())
    assert "p99 of 5 replays (--iters): fewer than 100, so about their maximum" in proc.stdout


@pytest.mark.parametrize("routing, extra, parameters", [
    ("zipf", ["--alpha", "0.7"], {"alpha": 0.7}),
    ("k_hot", ["--hot-fraction", "0.25", "--hot-experts", "3"], {"hot_fraction": 0.25, "hot_experts": 3}),
    # The default, 8, would make every one of the reference shape's 8 experts hot: half of them are.
    ("k_hot", [], {"hot_fraction": 0.5, "hot_experts": 4}),
])
def test_bench_json_says_how_to_draw_its_routes_again(tmp_path, routing, extra, parameters):
    path = tmp_path / "bench.json"
    proc = run_bench("--backend", "reference", "--routing", routing, *extra, "--no-baseline", "--iters", "2",
                     "--warmup", "1", "--json", str(path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    config = json.loads(path.read_text())["config"]
    assert config["routing"] == routing and {k: config[k] for k in parameters} == parameters


def test_bench_no_baseline_leaves_it_null(tmp_path):
    path = tmp_path / "bench.json"
    proc = run_bench("--backend", "reference", "--no-baseline", "--json", str(path), "--iters", "2", "--warmup", "1",
                     "--ranks", "4", "--tokens", "4", "--no-fp8")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(path.read_text())
    check_schema(report, with_baseline=False)
    assert report["baseline"] is None
    assert (report["config"]["ranks"], report["config"]["tokens"], report["config"]["fp8"]) == (4, 4, False)


def test_bench_plot_writes_a_png(tmp_path):
    png, path = tmp_path / "sweep.png", tmp_path / "bench.json"
    proc = run_bench("--backend", "reference", "--plot", str(png), "--sweep-tokens", "1,4", "--iters", "3",
                     "--warmup", "2", "--json", str(path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert png.read_bytes()[:len(PNG_SIGNATURE)] == PNG_SIGNATURE
    sweep = json.loads(path.read_text())["sweep"]
    assert [point["tokens"] for point in sweep] == [1, 4]
    for point in sweep:
        assert point["phases"]["dispatch"]["p50_us"] > 0 and point["phases"]["combine"]["baseline_p50_us"] > 0


def test_a_plot_that_cannot_be_written_is_one_line_and_keeps_the_json(tmp_path, monkeypatch, capsys):
    """The folder can go, or the disk fill, during the sweep (helper-106: a traceback, and the --json
    report, written after the plot, was lost)."""
    import errno

    import matplotlib.figure

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", full_disk)
    png, path = tmp_path / "sweep.png", tmp_path / "bench.json"
    assert cli.main(["bench", "--backend", "reference", "--plot", str(png), "--sweep-tokens", "1,4", "--iters", "3",
                     "--warmup", "2", "--json", str(path)]) == 1
    assert f"OutputError: --plot {png}: could not write the plot: No space left on device" in capsys.readouterr().err
    assert [point["tokens"] for point in json.loads(path.read_text())["sweep"]] == [1, 4]


def test_a_sweep_point_that_fails_keeps_the_measurements_before_it(tmp_path, monkeypatch, capsys):
    """The JSON was written once every point had run: a point that ran out of memory (a sweep past the
    largest T that fits) lost the main measurement and every point before it (helper-114)."""
    measure = bench.measure_reference

    def out_of_memory_at_t4(args, progress, group=None):
        if args.tokens == 4:
            raise MemoryError("stand-in: this point does not fit")
        return measure(args, progress, group)

    monkeypatch.setattr(bench, "measure_reference", out_of_memory_at_t4)
    png, path = tmp_path / "sweep.png", tmp_path / "bench.json"
    assert cli.main(["bench", "--backend", "reference", "--plot", str(png), "--sweep-tokens", "1,2,4", "--iters", "3",
                     "--warmup", "1", "--json", str(path)]) == 1
    assert "out of host memory" in capsys.readouterr().err
    report = json.loads(path.read_text())
    assert report["phases"]["dispatch"]["p50_us"] > 0 and [point["tokens"] for point in report["sweep"]] == [1, 2]


def test_num_sms_is_checked_as_a_flag_on_the_gpu(monkeypatch):
    """--num-sms was never checked: 0, or more SMs than the GPU has for its ranks, was the Buffer's
    ValueError, a traceback (helper-114)."""
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    with pytest.raises(cli.UsageError, match=r"^--num-sms must be >= 1, got 0$"):
        bench.settle_args(parser.parse_args(["--num-sms", "0"]), "cuda")
    args = argparse.Namespace(num_sms=17)
    gpu = lambda n: (f"boot/0000:{n:02x}:00.0", 132, f"cuda:{n} on h")  # noqa: E731 - (key, SMs, name) of a rank's GPU
    with pytest.raises(cli.UsageError, match=r"^--num-sms 17: the 8 ranks on cuda:0 on h would need 136 SMs, it has "
                                             r"132: use --num-sms <= 16$"):
        bench.check_num_sms(args, [gpu(0)] * 8)
    # Every rank checks every GPU (the same verdict everywhere), a rank alone on its own GPU too.
    with pytest.raises(cli.UsageError, match=r"the 8 ranks on cuda:0 on h"):
        bench.check_num_sms(args, [gpu(1)] + [gpu(0)] * 8)
    bench.check_num_sms(args, [gpu(0)] * 7 + [gpu(1)])
    bench.check_num_sms(argparse.Namespace(num_sms=None), [gpu(0)] * 8)


@pytest.mark.parametrize("mode", ["async", "hook"])
def test_bench_reference_runs_each_mode(tmp_path, mode):
    path = tmp_path / "bench.json"
    proc = run_bench("--backend", "reference", "--mode", mode, "--no-baseline", "--json", str(path), "--iters", "2",
                     "--warmup", "1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"mode {mode}, eager calls" in proc.stdout
    report = json.loads(path.read_text())
    check_schema(report, with_baseline=False)
    assert (report["config"]["mode"], report["config"]["graph"]) == (mode, False)


def test_bench_launch_runs_one_rank_per_process(tmp_path):
    path = tmp_path / "bench.json"
    proc = run_bench("--backend", "reference", "--launch", "2", "--iters", "2", "--warmup", "1", "--json", str(path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "launching 2 processes" in proc.stdout and "all 2 processes passed" in proc.stdout
    assert proc.stdout.count("phase ") == 1  # rank 0 alone reports
    report = json.loads(path.read_text())
    check_schema(report, with_baseline=False)
    assert (report["config"]["ranks"], report["config"]["group"], report["config"]["baseline"]) == (2, "processes",
                                                                                                   False)


def test_launch_passes_this_command_s_flags_to_each_process_without_launch():
    args = argparse.Namespace(verbose=1, command_argv=["--launch", "4", "--tokens", "8", "--launch=4", "--no-fp8"])
    argv = bench.child_argv(args)
    assert argv[3:] == ["-v", "bench", "--tokens", "8", "--no-fp8", "--group", "init"]
    assert argv[:3] == launch.rank_command()  # this package, not whatever the current directory holds


def test_bench_bad_flag_exits_2():
    proc = run_bench("--no-such-flag")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "usage:" in proc.stderr


@pytest.mark.parametrize("argv, message", [
    (["--sweep-tokens", "0"], "[1, 4096]"),
    (["--sweep-tokens", "8192"], "[1, 4096]"),
    (["--sweep-tokens", "1,x"], "comma-separated"),
    (["--sweep-tokens", "1,8"], "--sweep-tokens sets the points of the --plot sweep; give --plot PATH.png"),
    (["--backend", "tpu"], "invalid choice"),
    (["--ranks", "two"], "invalid int"),
    (["--ranks", "3"], "--experts must be a multiple of --ranks=3"),
    (["--hidden", "100"], "multiple of 128"),
    (["--topk", "9"], "--topk"),
    (["--iters", "0"], "--iters"),
    (["--warmup-ms", "-1"], "--warmup-ms"),
    (["--hold-ms", "-1"], "--hold-ms"),
    (["--hold-ms", "inf"], "--hold-ms must be a number in [0, 10000], got inf"),
    (["--hold-ms", "nan"], "--hold-ms must be a number in [0, 10000], got nan"),
    (["--num-sms", "4"], "--num-sms"),
    (["--routing", "k_hot", "--hot-experts", "99"], "--hot-experts"),
    (["--routing", "k_hot", "--hot-experts", "1", "--topk", "2"], "--hot-experts must be in [--topk=2, --experts=8)"),
    # every expert hot is uniform routing: --hot-fraction did nothing (helper-149)
    (["--routing", "k_hot", "--hot-experts", "8"],
     "--hot-experts must be in [--topk=2, --experts=8) (every expert hot is uniform routing), got 8"),
    (["--routing", "k_hot", "--experts", "4", "--topk", "4"],
     "--routing k_hot needs more --experts than --topk (some experts cold), got 4 and 4"),
    # A routing's flags with another routing: refused, not ignored.
    (["--alpha", "-1"], "--alpha applies to --routing zipf, not uniform"),
    (["--routing", "zipf", "--hot-fraction", "2"], "--hot-fraction applies to --routing k_hot, not zipf"),
    (["--hot-experts", "100"], "--hot-experts applies to --routing k_hot, not uniform"),
    (["--peer-reads", "workspace"], "--peer-reads sets where the GPU kernels read"),
    (["--graph-ends", "none"], "--graph-ends shapes the CUDA graphs; the reference backend has none"),
    (["--parities", "alternate"], "--parities places the CUDA graphs' calls; the reference backend has none"),
    (["--fp8-scales", "row-major"], "--fp8-scales gives the GPU kernels out= arrays to write"),
    (["--fp8-scales", "swapped", "--no-fp8"], "--fp8-scales lays out fp8 dispatch's scales; --no-fp8 dispatches bf16"),
    (["--plot", "/no/such/dir/x.png"], "does not exist"),
    (["--mode", "eager"], "invalid choice"),
    (["--launch", "2", "--group", "init"], "leave out --group"),
    (["--launch", "2", "--ranks", "4"], "must match --launch"),
    (["--launch", "0"], "--launch must be >= 1"),
    (["--graph"], "no CUDA graphs"),
    # The GPU's timing flags, given where they would change nothing: refused, as --graph (they were ignored).
    (["--hold-ms", "10"], "--hold-ms paces the GPU's replays; the reference backend's calls run on the host"),
    (["--warmup-ms", "5"], "--warmup-ms paces the GPU's replays"),
    (["--kernel-span"], "--kernel-span times the CUDA graphs' kernels; the reference backend has none"),
    (["--inner-events"], "--inner-events times the CUDA graphs' kernels"),
    (["--experts", "-8"], "--experts must be >= 1, got -8"),
    # The plot saved over the JSON's measurements (helper-114), however the two paths are spelled.
    (["--json", "./same.png", "--plot", "same.png"], "--json ./same.png and --plot same.png name the same file"),
    # Each rank's expert outputs (E_l x R*T x H bf16) counted, and the sweep's largest point: these
    # runs went into torch's allocator, with a traceback after the first points. (Sized for any host:
    # 60 TB at the sweep's T = 4096, 15 GB at T = 1; 2.6 TB of expert outputs beside 2.6 GB of the rest.)
    (["--ranks", "1", "--experts", "1024", "--hidden", "7168", "--tokens", "1", "--input-sets", "1000",
      "--plot", "/tmp/x.png", "--sweep-tokens", "1,4096"], "GiB of host memory, this machine has"),
    (["--ranks", "1", "--experts", "1024", "--hidden", "128", "--tokens", "1", "--input-sets", "10000000"],
     "GiB of host memory, this machine has"),
])
def test_bench_bad_usage_exits_2_with_the_reason(argv, message, capsys):
    assert cli.main(["bench", "--backend", "reference", *argv]) == 2
    assert message in capsys.readouterr().err


def test_the_reference_backends_memory_check_counts_what_a_run_holds(monkeypatch, capsys):
    """On the reference backend a run holds ~14 + 2R bytes per channel of every rank's received rows
    besides the input sets (peak RSS measured, bench.py): 4 ranks, T = 64, H = 1024, E = 16 need
    ~101 MB. A host of 60 MB is refused before anything runs; the 1 byte a channel counted before
    (~13 MB with the input set) let such a run start, to be killed for want of memory."""
    shape = ["--ranks", "4", "--tokens", "64", "--hidden", "1024", "--experts", "16", "--topk", "4",
             "--input-sets", "1", "--iters", "1", "--warmup", "0", "--no-baseline"]
    monkeypatch.setattr(cli, "_physical_memory_bytes", lambda: 60 << 20)
    assert cli.main(["bench", "--backend", "reference", *shape]) == 2
    assert "bench on the reference backend needs at least 0.09" in capsys.readouterr().err
    monkeypatch.setattr(cli, "_physical_memory_bytes", lambda: 110 << 20)
    assert cli.main(["bench", "--backend", "reference", *shape]) == 0


def test_plot_without_matplotlib_is_a_usage_error_before_anything_runs(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    assert cli.main(["bench", "--backend", "reference", "--plot", str(tmp_path / "x.png")]) == 2
    captured = capsys.readouterr()
    assert "--plot needs matplotlib (pip install matplotlib)" in captured.err and "phase" not in captured.out


def test_bench_without_torch_is_a_usage_error_before_anything_runs(monkeypatch, capsys):
    """The timed calls take torch tensors on every backend: without torch the reference run ended in a
    traceback from inside the measurement (helper-149)."""
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch raises ImportError
    assert cli.main(["bench", "--backend", "reference", "--no-baseline"]) == 2
    captured = capsys.readouterr()
    assert "bench needs torch (pip install torch; the demo runs without it)" in captured.err
    assert "phase" not in captured.out


def test_bench_help_shows_the_new_flags_and_backend_defaults(capsys):
    assert cli.main(["bench", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps to the terminal width
    for flag in ("--baseline", "--no-baseline", "--plot", "--sweep-tokens", "--backend", "--mode", "--no-graph",
                 "--inner-events", "--no-inner-events"):
        assert flag in out
    assert "(default: 8 on a GPU, 2 on the reference backend)" in out
    assert "(default: 1,2,4,8,16,32,64,128,256,512)" in out


# --- GPU: the baseline on CUDA tensors, and the command on the kernels ------------------------------


def _gpu_usable() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0 and torch.cuda.is_available()
    except Exception:  # noqa: BLE001 - no cupy, no driver: no GPU
        return False


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("use_fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "R{}-T{}-H{}-K{}-E{}".format(*s))
def test_baseline_on_cuda_is_the_baseline_on_cpu(shape, use_fp8):
    """CUDA's fp8 cast and fp32 division round as the CPU's: dispatch bit-exact; combine within bf16 rounding."""
    num_ranks, num_max_tokens, hidden, num_topk, num_experts = shape
    xs, topk_idxs, weights = random_inputs(3, *shape)
    cpu = baseline.dispatch(xs, topk_idxs, num_max_tokens, num_experts, use_fp8=use_fp8)
    gpu = baseline.dispatch([x.cuda() for x in xs], [t.cuda() for t in topk_idxs], num_max_tokens, num_experts,
                            use_fp8=use_fp8)
    expert_outs = [torch.randn(num_experts // num_ranks, num_ranks * num_max_tokens, hidden).to(torch.bfloat16)
                   for _ in range(num_ranks)]
    for rank in range(num_ranks):
        counts = cpu.recv_count[rank].tolist()
        assert gpu.recv_count[rank].cpu().tolist() == counts
        for local_expert, count in enumerate(counts):
            got = gpu.recv_x[rank][local_expert, :count].cpu().view(torch.uint8)
            assert torch.equal(got, cpu.recv_x[rank][local_expert, :count].view(torch.uint8))
            if use_fp8:
                assert torch.equal(gpu.recv_scales[rank][local_expert, :count].cpu(),
                                   cpu.recv_scales[rank][local_expert, :count])
    combined_cpu = baseline.combine(expert_outs, weights, cpu.layout)
    combined_gpu = baseline.combine([e.cuda() for e in expert_outs], [w.cuda() for w in weights], gpu.layout)
    for want, got in zip(combined_cpu, combined_gpu):
        # index_add_ on CUDA adds in any order: fp32 sums agree to a few 2^-24, bf16 to one step (2^-7).
        torch.testing.assert_close(got.cpu().float(), want.float(), rtol=2.0 ** -7, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_usable(), reason="needs a CUDA GPU with cupy and CUDA torch")
@pytest.mark.parametrize("mode, graph, parities", [("async", "--graph", "one"), ("hook", "--graph", "one"),
                                                   ("sync", "--no-graph", "one"), ("async", "--no-graph", "one"),
                                                   ("sync", "--graph", "alternate"), ("hook", "--graph", "alternate")])
def test_bench_cuda_each_mode(tmp_path, mode, graph, parities):
    path = tmp_path / "bench.json"
    proc = run_bench("--backend", "cuda", "--ranks", "4", "--tokens", "8", "--hidden", "256", "--topk", "2",
                     "--experts", "8", "--iters", "5", "--warmup", "2", "--no-baseline", "--mode", mode, graph,
                     "--parities", parities, "--json", str(path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(path.read_text())
    check_schema(report, with_baseline=False, backend="cuda")
    assert (report["config"]["mode"], report["config"]["graph"], report["config"]["parities"]) == \
        (mode, graph == "--graph", parities)


class LoggedStream:
    """Stands in for a torch stream: logs the waits fork_join asks of it."""

    def __init__(self, name: str, log: list):
        self.name, self.log = name, log

    def wait_stream(self, other) -> None:
        self.log.append(f"{self.name} waits {other.name}")


class LoggedEvent:
    """Stands in for a torch event: logs where fork_join records it."""

    def __init__(self, name: str, log: list):
        self.name, self.log = name, log

    def record(self, stream) -> None:
        self.log.append(f"{self.name} on {stream.name}")


def fork_join_log(ends: str, inner_names: tuple[str, str, str] | None = None) -> list[str]:
    """The work fork_join puts on two rank streams around fn, with end nodes that log themselves, and
    with InnerEvents stand-ins (side stream, start and end event names) if given."""
    import types

    log = []
    origin = LoggedStream("origin", log)
    fake_torch = types.SimpleNamespace(cuda=types.SimpleNamespace(current_stream=lambda: origin))
    inner = None
    if inner_names is not None:
        side, start, end = inner_names
        inner = types.SimpleNamespace(side_stream=LoggedStream(side, log), start=LoggedEvent(start, log),
                                      end=LoggedEvent(end, log))
    bench.fork_join(fake_torch, [LoggedStream("r0", log), LoggedStream("r1", log)], lambda: log.append("fn"), ends,
                    (lambda: log.append("marker 0"), lambda: log.append("marker 1")), inner)
    return log


@pytest.mark.parametrize("ends, expected", [
    ("none", ["r0 waits origin", "r1 waits origin", "fn", "origin waits r0", "origin waits r1"]),
    ("root", ["marker 0", "r0 waits origin", "r1 waits origin", "fn", "origin waits r0", "origin waits r1"]),
    ("both", ["marker 0", "r0 waits origin", "r1 waits origin", "fn", "origin waits r0", "origin waits r1",
              "marker 1"]),
])
def test_fork_join_puts_its_own_nodes_at_the_ends_asked_for(ends, expected):
    """The order of work on the streams: the end nodes go on the current stream, before every fork
    and after every join (inside a capture, the graph's one root and one leaf)."""
    assert fork_join_log(ends) == expected


def test_fork_join_records_inner_events_beside_the_branches_and_joins_their_stream_last():
    """The start event waits for the root node only (the branches do not wait for it), the end event
    for every branch; the sink node does not wait for it, and the side stream is joined back last."""
    assert fork_join_log("both", ("side", "start", "end")) == [
        "marker 0", "r0 waits origin", "r1 waits origin", "side waits origin", "start on side", "fn",
        "side waits r0", "side waits r1", "end on side", "origin waits r0", "origin waits r1", "marker 1",
        "origin waits side"]
    with pytest.raises(ValueError, match="inner events need a root node"):
        fork_join_log("none", ("side", "start", "end"))


def test_kernel_span_of_each_launch_covers_its_phase_kernels_only():
    """Two step replays after an untimed dispatch launch: each kernel span runs from its first
    dispatch kernel's start to its last combine kernel's end, its graph span over the fills of its own
    launch too; the other launch counts in neither."""
    from mooncake_ep.cli.kernel_span import KernelRecord, replay_spans_us

    records = [KernelRecord("ll_dispatch", 0, 9_000, 1), KernelRecord("ll_dispatch", 500, 9_500, 1),
               KernelRecord("fill", 20_000, 21_000, 7),
               KernelRecord("ll_dispatch", 30_000, 40_000, 7), KernelRecord("ll_dispatch", 31_000, 41_500, 7),
               KernelRecord("ll_combine", 42_000, 55_000, 7), KernelRecord("ll_combine", 42_500, 56_250, 7),
               KernelRecord("fill", 57_000, 58_000, 7),
               KernelRecord("ll_combine", 72_000, 80_000, 8), KernelRecord("ll_dispatch", 61_000, 70_000, 8),
               KernelRecord("ll_dispatch", 60_000, 70_000, 8), KernelRecord("ll_combine", 71_000, 79_000, 8)]
    names = ("ll_dispatch", "ll_combine")
    assert replay_spans_us(records, names, num_replays=2, min_kernels=2) == ([26.25, 20.0], [38.0, 20.0])
    assert replay_spans_us(records, ("ll_dispatch",), num_replays=3, min_kernels=2) == ([9.5, 11.5, 10.0],
                                                                                        [9.5, 38.0, 20.0])
    with pytest.raises(RuntimeError, match="3 launches of ll_dispatch for 2 replays"):
        replay_spans_us(records, ("ll_dispatch",), num_replays=2, min_kernels=2)
    with pytest.raises(RuntimeError, match="fewer than 5 kernels"):
        replay_spans_us(records, names, num_replays=2, min_kernels=5)


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_usable(), reason="needs a CUDA GPU with cupy and CUDA torch")
@pytest.mark.parametrize("ends", ["none", "root"])  # "both", the default, runs in every other test
def test_bench_cuda_each_graph_shape(tmp_path, ends):
    path = tmp_path / "bench.json"
    proc = run_bench("--backend", "cuda", "--ranks", "4", "--tokens", "8", "--hidden", "256", "--topk", "2",
                     "--experts", "8", "--iters", "5", "--warmup", "2", "--no-baseline", "--graph-ends", ends,
                     "--json", str(path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(path.read_text())
    check_schema(report, with_baseline=False, backend="cuda")
    assert report["config"]["graph_ends"] == ends


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_usable(), reason="needs a CUDA GPU with cupy and CUDA torch")
def test_bench_cuda_workspace_peer_reads(tmp_path):
    """The combine protocol of ranks in other processes, on in-process ranks (docs/performance.md)."""
    path = tmp_path / "bench.json"
    proc = run_bench("--backend", "cuda", "--ranks", "4", "--tokens", "8", "--hidden", "256", "--topk", "2",
                     "--experts", "8", "--iters", "5", "--warmup", "2", "--no-baseline", "--peer-reads", "workspace",
                     "--json", str(path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(path.read_text())
    check_schema(report, with_baseline=False, backend="cuda")
    assert report["config"]["peer_reads"] == "workspace"


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_usable(), reason="needs a CUDA GPU with cupy and CUDA torch")
def test_graph_fork_stagger_reports_every_branch(tmp_path):
    """The reproducer of docs/performance.md (12): one row per (kernel, graph, replay), an entry time
    per branch for the stamping kernels (none for ours, which return before stamping)."""
    out = tmp_path / "stagger.json"
    result = subprocess.run([sys.executable, "scripts/graph_fork_stagger.py", "--ranks", "4", "--replays", "3",
                             "--kernels", "trivial", "poll15us", "ll_combine", "--graphs", "unrooted", "rooted+sink",
                             "--json", str(out)], cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=PROCESS_LIMIT_S)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [(r["kernel"], r["graph"], r["replay"]) for r in rows] == [
        (kernel, graph, replay) for kernel in ("trivial", "poll15us", "ll_combine")
        for graph in ("unrooted", "rooted+sink") for replay in ("idle", "queued")]
    for row in rows:
        assert row["event_us_p50"] > 0
        if row["kernel"] == "ll_combine":
            assert row["entry_us_p50"] is None
        else:  # one start per branch (the script refuses a branch that did not stamp), all in the replay
            assert len(row["entry_us_p50"]) == 4 and row["entry_us_p50"][-1] < row["event_us_p50"], row
    # A 15 us poll in every branch: the replay lasts at least that long.
    assert all(r["event_us_p50"] >= 15 for r in rows if r["kernel"] == "poll15us")


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_usable(), reason="needs a CUDA GPU with cupy and CUDA torch")
def test_bench_cuda_launch_two_processes(tmp_path):
    """One rank per process (ipc on one GPU: the processes time-slice it, so the times mean little)."""
    path = tmp_path / "bench.json"
    proc = run_bench("--backend", "cuda", "--launch", "2", "--tokens", "8", "--hidden", "256", "--topk", "2",
                     "--experts", "8", "--iters", "5", "--warmup", "2", "--mode", "async", "--json", str(path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(path.read_text())
    check_schema(report, with_baseline=False, backend="cuda")
    assert (report["config"]["group"], report["config"]["ranks"]) == ("processes", 2)


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_usable(), reason="needs a CUDA GPU with cupy and CUDA torch")
def test_bench_cuda_small_shape_writes_the_json_schema(tmp_path):
    path, png = tmp_path / "bench.json", tmp_path / "sweep.png"
    proc = run_bench("--backend", "cuda", "--ranks", "2", "--tokens", "8", "--hidden", "256", "--topk", "2",
                     "--experts", "8", "--iters", "5", "--warmup", "2", "--json", str(path), "--plot", str(png),
                     "--sweep-tokens", "1,8")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    check_schema(json.loads(path.read_text()), with_baseline=True, backend="cuda")
    assert png.read_bytes()[:len(PNG_SIGNATURE)] == PNG_SIGNATURE


# --- scripts/ab_kernels.py: variants of the benchmark side by side ------------------------------------


def test_ab_kernels_runs_each_variant_and_tabulates(tmp_path):
    """On the reference backend the macros change nothing; what is checked is the plumbing: one bench
    report per variant, in order, with its macros, and the table. (The macros must be named in the
    kernel sources: EP_TRACE and its point count are.)"""
    out = tmp_path / "ab.json"
    result = subprocess.run([sys.executable, "scripts/ab_kernels.py", "--variant", "base:", "--variant",
                             "try:EP_TRACE=0,EP_TRACE_NUM_POINTS=2", "--variant", "base:", "--json", str(out), "--",
                             "--iters", "2", "--warmup", "0"],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=PROCESS_LIMIT_S)
    assert result.returncode == 0, result.stderr
    runs = json.loads(out.read_text())
    assert [(r["name"], r["macros"]) for r in runs] == [("base", {}), ("try", {"EP_TRACE": 0,
                                                                                "EP_TRACE_NUM_POINTS": 2}),
                                                        ("base", {})]
    assert all(set(r["report"]["phases"]) == set(bench.PHASES) for r in runs)
    table = result.stdout.splitlines()[-4:]
    assert table[0].split() == ["variant", *bench.PHASES] and [row.split()[0] for row in table[1:]] == [
        "base", "try", "base"]


@pytest.mark.parametrize("argv", [["--variant", ""], ["--variant", ":EP_TRACE=1"], ["--variant", "x:TRY=1"],
                                  ["--variant", "x:EP_TRACE"], ["--variant", "x:EP_TRACE=one"],
                                  ["--variant", "x:EP_NOT_IN_THE_SOURCES=1"],  # would compile the same kernels
                                  ["--variant", "x:EP_MAX_RANKS=16"], ["--variant", "x:EP_USE_FP8=0"],
                                  ["--variant", "x:", "--", "--launch", "2"], ["--variant", "x:", "--", "--group=init"]])
def test_ab_kernels_refuses_what_it_cannot_measure(argv):
    result = subprocess.run([sys.executable, "scripts/ab_kernels.py", *argv], cwd=REPO_ROOT, capture_output=True,
                            text=True, timeout=PROCESS_LIMIT_S)
    error = result.stderr.strip().splitlines()[-1]
    assert result.returncode == 2 and error.startswith("ab_kernels.py: error: "), result.stderr
    assert ("argument --variant" in error) != ("in this process" in error), error


# --- scripts/profile_host_stand_in.py: the GPU path's host time on any machine -------------------------


def test_profile_host_stand_in_times_the_gpu_paths_calls(tmp_path):
    """It must keep driving Buffer's CUDA branch (not the reference one) as buffer.py and
    _cuda_backend.py change: each round's p50 of both calls is reported."""
    out = tmp_path / "host.json"
    result = subprocess.run([sys.executable, "scripts/profile_host_stand_in.py", "--calls", "40", "--rounds", "2",
                             "--ranks", "2", "--experts", "8", "--hidden", "256", "--tokens", "4", "--json", str(out)],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=PROCESS_LIMIT_S)
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    for name in ("dispatch", "combine"):
        assert len(report[f"{name}_us_rounds"]) == 2 and all(t > 0 for t in report[f"{name}_us_rounds"])
        assert report[f"{name}_us_best_round"] == min(report[f"{name}_us_rounds"])
    assert report["launches"] == {"dispatch": 1 + 40, "combine": 40}, "every call launched its kernel"
    assert [line.split()[:2] for line in result.stdout.splitlines()] == [["dispatch", "out=:"], ["combine", "out=:"]]


def test_hold_current_stream_spins_the_asked_milliseconds_at_two_ghz_and_not_at_zero():
    """The timed replays queue behind one spin kernel of ~hold_ms on the current stream, and an event
    recorded after it tells whether the spin ended before the host was done queuing."""
    log = []

    class Event:
        def record(self):
            log.append("record")

    stand_in = types.SimpleNamespace(cuda=types.SimpleNamespace(_sleep=lambda cycles: log.append(cycles),
                                                                Event=Event))
    assert isinstance(bench.hold_current_stream(stand_in, 50.0), Event)
    assert bench.hold_current_stream(stand_in, 0.0) is None
    assert log == [100_000_000, "record"]


@pytest.mark.parametrize("graph, group, applies", [(True, None, True), (False, None, False), (True, object(), False)])
def test_the_hold_applies_to_graphs_of_ranks_in_this_process_only(graph, group, applies):
    """Eager calls are timed with their launches; ranks in processes meet at a barrier every replay."""
    assert bench.in_process_graphs(argparse.Namespace(graph=graph), group) is applies


def test_the_seed_gives_every_rank_the_same_inputs_in_every_process():
    """--seed fixes the tokens, weights and expert outputs too (torch's own generator is seeded at random
    in each process), and a process holding one rank draws the same routes and values for it as a
    process holding them all."""
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--ranks", "2", "--tokens", "4", "--hidden", "128", "--experts", "4", "--topk", "2",
                              "--input-sets", "2", "--seed", "7"])

    def draw(devices):
        torch.manual_seed(len(devices) + sum(d is None for d in devices))  # torch's own stream differs
        return bench.make_input_sets(args, np.random.default_rng(args.seed), devices, torch)

    every, again, rank1_alone = draw(["cpu", "cpu"]), draw(["cpu", "cpu"]), draw([None, "cpu"])
    same = lambda a, b: torch.equal(torch.as_tensor(a), torch.as_tensor(b))  # noqa: E731 - routes are numpy
    for s, r, name in itertools.product(range(args.input_sets), range(args.ranks),
                                        ("x", "topk", "weights", "expert_out", "routes")):
        assert same(every[s][r][name], again[s][r][name]), (s, r, name)
        if r == 1:
            assert same(rank1_alone[s][r][name], every[s][r][name]), (s, name)
    assert not torch.equal(every[0][0]["x"], every[0][1]["x"])


@pytest.mark.parametrize("flags,pattern", [
    (["--no-graph", "--inner-events"], r"^--inner-events applies to the CUDA graphs' replays; --no-graph times eager"),
    (["--no-graph", "--kernel-span"], r"^--kernel-span applies to the CUDA graphs' replays"),
    (["--no-graph", "--graph-ends", "root"], r"^--graph-ends applies to the CUDA graphs' replays"),
    (["--no-graph", "--parities", "alternate"], r"^--parities applies to the CUDA graphs' replays"),
    (["--no-graph", "--hold-ms", "5"], r"^--hold-ms applies to the CUDA graphs' replays"),
    (["--warmup", "0", "--warmup-ms", "500"], r"^--warmup-ms paces rounds of --warmup untimed replays; --warmup 0"),
])
def test_graph_flags_that_would_change_nothing_on_the_gpu_are_refused(flags, pattern):
    """On a GPU, --no-graph's run quietly turned these off while the JSON recorded them as given (helper-161)."""
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    with pytest.raises(cli.UsageError, match=pattern):
        bench.settle_args(parser.parse_args(flags), "cuda")
    bench.settle_args(parser.parse_args(["--no-graph", "--no-inner-events", "--no-kernel-span"]), "cuda")  # said off


def test_no_warmup_on_the_gpu_is_recorded_as_none():
    """--warmup 0 runs no untimed replays, so the JSON's warmup_ms must not say the default 100 ms ran (helper-173)."""
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--warmup", "0"])
    bench.settle_args(args, "cuda")
    assert args.warmup_ms == 0.0
    args = parser.parse_args([])
    bench.settle_args(args, "cuda")
    assert args.warmup_ms == bench.WARMUP_MS > 0
    args = parser.parse_args(["--warmup", "0"])
    bench.settle_args(args, "reference")  # the reference backend's own zero, without a refusal
    assert args.warmup_ms == 0.0
