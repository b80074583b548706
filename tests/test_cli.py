"""Tests of the command line (mooncake_ep.cli): ``python -m mooncake_ep`` in a subprocess, as users run it.

CPU: the demo runs on the numpy reference backend with a tiny shape. The GPU test runs it on the kernels.
No assertion is about elapsed time; the process limit only turns a hang into a failure.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mooncake_ep import cli

REPO_ROOT = Path(__file__).resolve().parents[1]
CLI_DIR = REPO_ROOT / "mooncake_ep" / "cli"
# Safety net for a command that hangs (a bug): the test fails instead of stalling CI.
PROCESS_LIMIT_S = 120.0
TINY = ["--ranks", "2", "--experts", "8", "--topk", "4", "--tokens", "8", "--hidden", "256"]


def run_cli(*argv: str, cwd: Path = REPO_ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mooncake_ep", *argv], cwd=cwd, capture_output=True, text=True,
                          timeout=PROCESS_LIMIT_S, env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)))


def table_rows(stdout: str, num_ranks: int) -> list[list[str]]:
    """The per-rank rows of the demo's table, plain or drawn by rich: cells split on spaces and box lines."""
    rows = []
    for line in stdout.splitlines():
        cells = line.replace("│", " ").replace("┃", " ").split()
        if cells and cells[0].isdigit() and len(cells) >= 6:
            rows.append(cells)
    assert [int(r[0]) for r in rows] == list(range(num_ranks)), stdout
    return rows


@pytest.mark.parametrize("precision", ["--fp8", "--no-fp8"])
def test_demo_reference_passes(precision, tmp_path):
    report_path = tmp_path / "demo.json"
    proc = run_cli("demo", *TINY, precision, "--backend", "reference", "--json", str(report_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "backend reference" in proc.stdout
    for header in ("rank", "tokens sent", "rows received", "rel error", "result"):
        assert header in proc.stdout
    rows = table_rows(proc.stdout, 2)
    assert all(row[-1] == "pass" for row in rows), proc.stdout
    assert all(int(row[1]) == 8 for row in rows)  # tokens sent per rank
    assert sum(int(row[2]) for row in rows) == 2 * 8 * 4  # every (token, k) copy arrives once
    assert "PASS" in proc.stdout

    report = json.loads(report_path.read_text())
    assert report["passed"] is True
    assert report["backend"] == "reference"
    assert report["config"]["use_fp8"] is (precision == "--fp8")
    assert [r["rank"] for r in report["ranks"]] == [0, 1]
    assert all(r["relative_error"] < report["tolerance"] for r in report["ranks"])


def test_demo_launch_processes_passes(tmp_path):
    # Two processes joined by init_group() over the TCP store; auto picks the GPU (the ipc transport)
    # where one is usable, else the reference backend. Rank 0 prints the table for every rank.
    # A path that starts with "-", as one token: the ranks were given it as two, and each refused it.
    report_path = tmp_path / "-demo.json"
    proc = run_cli("demo", "--launch", "2", *TINY, f"--json={report_path.name}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "launching 2 processes" in proc.stdout and "2 ranks (processes)" in proc.stdout
    backend = "cuda" if _gpu_usable() else "reference"
    assert f"backend {backend}" in proc.stdout
    rows = table_rows(proc.stdout, 2)
    assert all(row[-1] == "pass" for row in rows), proc.stdout
    assert sum(int(row[2]) for row in rows) == 2 * 8 * 4  # every (token, k) copy arrives once
    assert "PASS" in proc.stdout and "all 2 processes passed" in proc.stdout
    report = json.loads(report_path.read_text())
    assert report["passed"] is True and report["config"]["num_ranks"] == 2 and report["backend"] == backend
    assert [r["rank"] for r in report["ranks"]] == [0, 1]


def test_launched_ranks_run_this_package_not_the_current_directorys(tmp_path):
    """`python -m mooncake_ep` puts the current directory first on sys.path: ranks launched from a
    checkout ran that checkout (a non-editable install, launched from its own checkout, failed every
    rank on its missing compiled-in paths; an editable one, from another checkout, ran that one's code;
    helper-149). The ranks now import the package the launcher runs."""
    from mooncake_ep.cli.launch import rank_command

    shadow = tmp_path / "mooncake_ep"
    shadow.mkdir()
    (shadow / "__init__.py").write_text("raise ImportError('the current directory\'s mooncake_ep was imported')\n")
    (shadow / "__main__.py").write_text("")
    proc = subprocess.run(rank_command("demo", "--launch", "2", *TINY, "--backend", "reference"), cwd=tmp_path,
                          capture_output=True, text=True, timeout=PROCESS_LIMIT_S)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "all 2 processes passed" in proc.stdout and "current directory" not in proc.stderr


def test_launched_ranks_start_with_the_path_a_plain_python_m_starts_with(tmp_path):
    """The launcher gave its ranks PYTHONPATH=<the package's folder>, which Python puts before the
    standard library from the start: a checkout holding a file named like a standard module (here
    ``encodings``, which every interpreter imports as it starts) broke every rank, where `python -m`
    from that checkout, which adds the current directory only once started, ran."""
    import shutil

    checkout = tmp_path / "checkout"
    shutil.copytree(REPO_ROOT / "mooncake_ep", checkout / "mooncake_ep",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (checkout / "encodings").mkdir()
    (checkout / "encodings" / "__init__.py").write_text("raise ImportError('the checkout shadows encodings')\n")
    env = {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-m", "mooncake_ep", "demo", "--launch", "2", *TINY[2:], "--backend",
                           "reference"], cwd=checkout, env=env, capture_output=True, text=True,
                          timeout=PROCESS_LIMIT_S)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "all 2 processes passed" in proc.stdout and "shadows encodings" not in proc.stderr


def test_demo_launch_fails_when_a_process_fails():
    proc = run_cli("demo", "--launch", "2", *TINY, "--tolerance", "1e-9")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert all(row[-1] == "FAIL" for row in table_rows(proc.stdout, 2))
    assert "FAIL: rank 0 exited 1, rank 1 exited 1" in proc.stdout


def test_demo_fails_beyond_tolerance():
    # bf16 outputs cannot be within 1e-9 of a float32 computation: the check must report it.
    proc = run_cli("demo", *TINY, "--backend", "reference", "--tolerance", "1e-9")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert all(row[-1] == "FAIL" for row in table_rows(proc.stdout, 2))
    # The verdict says against what, and which rank was worst.
    assert re.search(r"^FAIL: ranks \[0, 1\] have a token off by more than relative error 1e-09 of the same layer "
                     r"computed densely in float32( from the dequantised fp8 tokens)? \(worst: rank [01], ",
                     proc.stdout, re.MULTILINE), proc.stdout


def test_the_demo_verdict_names_a_nan_error_and_masked_ranks_apart(capsys):
    from mooncake_ep.cli import demo

    config = demo.DemoConfig(num_ranks=3, num_experts=6, num_topk=2, hidden=128, num_tokens=4, use_fp8=False,
                             seed=0, timeout_us=-1)
    results = [demo.RankResult(0, 4, 8, 0.0, 1e-3, [], True),
               demo.RankResult(1, 4, 8, float("nan"), float("nan"), [], False),
               demo.RankResult(2, 4, 8, 0.0, 1e-3, [0], False)]
    args = argparse.Namespace(tolerance=0.02, json=None)
    assert demo._report(config, "reference", results, 0.5, args) == cli.EXIT_FAILURE
    verdict = capsys.readouterr().out.strip().splitlines()[-1]
    assert verdict == ("FAIL: ranks [1] have a token off by more than relative error 0.02 of the same layer computed "
                       "densely in float32 (worst: rank 1, nan); rank 2 masked ranks [0] (0.50 s)")


def test_the_demo_check_fails_one_token_missing_an_expert_among_many_right_ones():
    """The check is per token: one row off by 5% (an expert term lost) among 1024 right ones fails,
    where one norm over the rank's tokens read 1.6e-3 and passed."""
    import numpy as np

    from mooncake_ep.cli import demo

    config = demo.DemoConfig(num_ranks=1, num_experts=4, num_topk=2, hidden=128, num_tokens=1024, use_fp8=False,
                             seed=0, timeout_us=-1)
    weights = demo.make_weights(config)
    inputs = demo.make_inputs(config, 0, weights)
    dense = demo.dense_layer(config, inputs, weights)
    mask = np.ones(1, np.int32)
    assert demo.compare(config, 0, inputs, weights, dense.copy(), 2048, mask, demo.DEFAULT_TOLERANCE).passed
    one_token_off = dense.copy()
    one_token_off[7] *= 0.95
    result = demo.compare(config, 0, inputs, weights, one_token_off, 2048, mask, demo.DEFAULT_TOLERANCE)
    assert not result.passed and abs(result.relative_error - 0.05) < 1e-3


def test_result_files_are_strict_json(tmp_path):
    """A failed run's non-finite numbers are written as null, never Python's NaN / Infinity tokens."""
    path = tmp_path / "r.json"
    cli.write_json("--json", str(path), {"error": float("inf"), "ranks": [{"e": float("nan"), "ok": 1.5}], "t": (2,)})
    reject = lambda token: pytest.fail(f"non-JSON token {token}")  # noqa: E731
    assert json.loads(path.read_text(), parse_constant=reject) == {"error": None, "ranks": [{"e": None, "ok": 1.5}],
                                                                   "t": [2]}


def test_a_result_file_the_system_refuses_is_one_line_after_the_run(capsys):
    if not os.path.exists("/dev/full"):
        pytest.skip("needs /dev/full (Linux)")
    assert cli.main(["demo", *TINY, "--backend", "reference", "--json", "/dev/full"]) == 1
    assert "demo: OutputError: --json /dev/full: could not write the results: No space left on device" in \
        capsys.readouterr().err


def test_a_closed_stdout_still_leaves_the_results_file(tmp_path):
    """`... | head -1` and `... | true`: printing stops, the run still writes its --json, and exits 0,
    with stdout buffered (a pipe's default) or not (PYTHONUNBUFFERED, which this machine may set)."""
    buffered = {name: value for name, value in os.environ.items() if name != "PYTHONUNBUFFERED"}
    for command, lines_read, env in (("demo", 1, None), ("bench", 1, None), ("demo", 0, None), ("bench", 0, None),
                                     ("bench", 0, buffered), ("demo", 0, buffered)):
        report = tmp_path / f"{command}{lines_read}{env is None}.json"
        extra = ["--iters", "5", "--warmup", "1"] if command == "bench" else []
        proc = subprocess.Popen([sys.executable, "-m", "mooncake_ep", command, *TINY, *extra, "--backend", "reference",
                                 "--json", str(report)], cwd=REPO_ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=env)
        for _ in range(lines_read):
            proc.stdout.readline()
        proc.stdout.close()
        assert proc.wait(PROCESS_LIMIT_S) == 0, proc.stderr.read()
        assert "config" in json.loads(report.read_text())


def test_help_lists_commands_and_defaults():
    proc = run_cli("--help")
    assert proc.returncode == 0, proc.stderr
    for name in cli.COMMANDS:
        assert name in proc.stdout
    proc = run_cli("demo", "--help")
    assert proc.returncode == 0, proc.stderr
    assert "--tokens" in proc.stdout and "--no-fp8" in proc.stdout and "--timeout-us" in proc.stdout
    assert "--launch" in proc.stdout and "--group" in proc.stdout
    assert "(default: 64)" in " ".join(proc.stdout.split())  # argparse wraps to the terminal width
    bench_help = " ".join(run_cli("bench", "--help").stdout.split())
    # A default decided at run time, or one the help names itself, is not repeated as "(default: ...)".
    assert "(default: None)" not in bench_help and "(default: the GPU shared evenly) (default" not in bench_help
    assert "how tokens pick their distinct experts" in bench_help and "(default: uniform)" in bench_help


def test_bad_flag_exits_2():
    proc = run_cli("demo", "--no-such-flag")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    # The command's usage, which lists its flags, not the top-level one.
    assert proc.stderr.startswith("usage: python -m mooncake_ep demo [-h]"), proc.stderr
    assert proc.stderr.rstrip().endswith("python -m mooncake_ep demo: error: unrecognized arguments: --no-such-flag")


@pytest.mark.parametrize("argv", [["no-such-command"], ["demo", "--ranks", "two"], ["demo", "--backend", "tpu"], []])
def test_bad_usage_returns_2(argv, capsys):
    assert cli.main(argv) == 2
    assert "usage:" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["demo", "bench"])
def test_backend_cuda_without_a_usable_gpu_is_a_failure_in_one_line(command, monkeypatch, capsys):
    """--backend cuda where the GPU path cannot run: exit 1, the machine's failure, with what is
    missing; 2 stays for flags that do not fit together. Before anything runs (--launch too)."""
    from mooncake_ep.cli import gpu

    monkeypatch.setattr(gpu, "gpu_status", lambda: (False, "no CUDA device is visible"))
    for extra in ([], ["--launch", "2"]):
        assert cli.main([command, "--backend", "cuda", *extra]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.endswith(f" {command}: GpuUnavailable: --backend cuda: no CUDA device "
                                                      f"is visible\n"), err
    monkeypatch.setattr(gpu, "gpu_status", lambda: (False, "cupy is not installed"))
    assert gpu.choose_backend("auto") == ("reference", "cupy is not installed")
    assert gpu.choose_backend("reference") == ("reference", "asked for")


@pytest.mark.parametrize("argv, message", [
    # The library's shape checks, said with the flags given (its argument names beside a legend were
    # left to decode): every one get_ep_buffer_size_hint makes.
    (["demo", "--ranks", "4", "--experts", "6"], "error: --experts must be a multiple of --ranks=4, got 6\n"),
    (["demo", "--hidden", "1000"], "error: --hidden must be a multiple of 128, got 1000\n"),
    (["demo", "--hidden", "0"], "error: --hidden must be >= 1, got 0\n"),
    (["demo", "--experts", "1026", "--ranks", "2"], "error: --experts must be <= 1024, got 1026\n"),
    (["demo", "--experts", "4", "--topk", "8"], "--topk"),
    (["demo", "--tokens", "0"], "--tokens"),
    (["demo", "--launch", "2", "--ranks", "4"], "--ranks 4 does not match --launch 2"),
    (["demo", "--launch", "0"], "--launch must be >= 1"),
    (["demo", "--launch", "3"], "error: --experts must be a multiple of --launch=3, got 32\n"),
    (["demo", "--launch", "2", "--group", "init"], "leave out --group"),
    (["demo", "--seed", "-1"], "--seed must be >= 0, got -1"),
    (["demo", "--tolerance", "inf"], "--tolerance must be a finite number > 0, got inf"),
    (["demo", "--experts", "32", "--topk", "17"], "--topk must be <= 16 (the kernels' bound), got 17"),
    (["demo", "--timeout-us", "-5"], "--timeout-us must be >= -1"),
    (["demo", "--timeout-us", "9223372036854776"], "error: --timeout-us must be <= 9223372036854775, got "),
    (["demo", "--json", ""], "--json: the path is empty; name a file"),
    (["demo", "--json", "-"], "--json: '-' would be a file named '-', not stdout; name a file"),
    # Sizes no host holds: refused before an allocation fails deep in numpy, or a loop runs for hours.
    (["demo", "--hidden", "1280000000000000000000000"], "the demo needs at least"),
    (["demo", "--tokens", "100000000000000000000000"], "GiB of host memory, this machine has"),
    (["bench", "--tokens", "100000000", "--hidden", "7168"], "bench on the reference backend needs at least"),
    (["demo", "--json", "."], "--json .: is a directory; name a file"),
    (["demo", "--json", "/nonexistent/x.json"], "--json /nonexistent/x.json: the directory /nonexistent does not "
                                                "exist"),
    (["bench", "--seed", "-1"], "--seed must be >= 0, got -1"),
    (["bench", "--experts", "32", "--topk", "17"], "--topk must be <= 16 (the kernels' bound)"),
    (["bench", "--routing", "zipf", "--alpha", "nan"], "--alpha must be a finite number >= 0, got nan"),
    (["bench", "--routing", "zipf", "--alpha", "2000"], "gives fewer than --topk=2 experts a probability above 0"),
    (["bench", "--warmup-ms", "inf"], "--warmup-ms must be a number in [0, 60000], got inf"),
    (["bench", "--json", "."], "--json .: is a directory"),
    (["bench", "--plot", "sweep"], "--plot sweep: must end in .png"),
    # --launch checks what each process would refuse before any starts, naming --launch.
    (["bench", "--launch", "2", "--hidden", "100"], "error: --hidden must be a multiple of 128, got 100\n"),
    (["bench", "--launch", "65", "--experts", "65"], "error: --launch must be <= 64, got 65\n"),
    (["warmup", "--arch", "sm_90", "--json", "."], "--json .: is a directory"),
    (["warmup", "--arch", "sm_90", "--cache-dir", ""], "--cache-dir: the path is empty"),
])
def test_inconsistent_flags_exit_2_with_the_reason(argv, message, capsys):
    backend = ["--backend", "reference"] if argv[0] != "warmup" else []
    assert cli.main([*argv, *backend]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and message in err


def test_flags_are_not_abbreviated(capsys):
    """A command that starts copies of itself passes its flags on as written: '--laun 2' would reach
    each copy as a flag it refuses."""
    assert cli.main(["bench", "--laun", "2", "--backend", "reference"]) == 2
    assert "unrecognized arguments: --laun 2" in capsys.readouterr().err


@pytest.mark.parametrize("argv, count", [(["demo"], 0), (["-v", "demo"], 1), (["demo", "-v"], 1), (["demo", "-vv"], 2),
                                         (["warmup", "--verbose"], 1), (["-vv", "demo", "-v"], 2),
                                         (["-v", "bench", "-vv"], 2)])
def test_verbose_goes_before_or_after_the_command(argv, count):
    """`demo -v` was refused as an unknown flag: only `-v demo` was taken. The larger count applies
    (a launch passes both on to its copies, which must count as many)."""
    args, unknown = cli.build_parser().parse_known_args(argv)
    assert unknown == [] and cli.verbosity(args) == count


def test_group_init_without_a_launchers_environment_is_a_usage_error(monkeypatch, capsys):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert cli.main(["demo", "--group", "init", "--backend", "reference"]) == 2
    assert "error: --group init: init_group: rank was not given" in capsys.readouterr().err


@pytest.mark.parametrize("command, flags, message", [
    ("demo", ["--hidden", "100"], "error: --hidden must be a multiple of 128, got 100\n"),
    ("demo", ["--experts", "5", "--topk", "2"], "error: --experts must be a multiple of WORLD_SIZE=2, got 5\n"),
    ("demo", ["--ranks", "3"], "--ranks 3 does not match WORLD_SIZE 2; leave --ranks out"),
    ("bench", ["--hidden", "100"], "error: --hidden must be a multiple of 128, got 100\n"),
    ("bench", ["--ranks", "3"], "--ranks (3) must match WORLD_SIZE's 2 ranks, or be left out"),
])
def test_group_init_refuses_its_flags_before_waiting_for_the_ranks(command, flags, message, monkeypatch, capsys):
    """A flag every rank refuses was reported only after the join's wait (120 s when a rank never
    came), or lost behind a peer's timeout: it is checked against WORLD_SIZE before joining."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    from mooncake_ep.cli import launch

    monkeypatch.setattr(launch, "join_group", lambda *args: pytest.fail("joined before checking the flags"))
    assert cli.main([command, "--group", "init", "--backend", "reference", *flags]) == 2
    assert message in capsys.readouterr().err


def test_a_long_join_says_it_is_waiting_and_a_short_one_says_nothing(monkeypatch, capsys):
    """--group init waited up to 120 s for a rank that never came without a word (helper-133)."""
    from mooncake_ep.cli import launch

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(launch, "JOIN_NOTICE_S", 0.05)
    for join_s, said in ((0.0, False), (0.5, True)):
        monkeypatch.setattr(launch.mooncake_ep, "init_group", lambda **kwargs: time.sleep(join_s) or "group")
        assert launch.join_group("reference") == "group"
        time.sleep(0.1)  # a notice not cancelled would come now
        err = capsys.readouterr().err
        assert ("RANK 1 of WORLD_SIZE 2 at" in err and "still waiting for the other ranks to join" in err) == said, err


def test_a_rank_that_fails_leaves_without_the_final_barrier(monkeypatch):
    """bench's and demo's --group init ranks: one leaving on an error must not wait in the group's
    final barrier for peers that may never come; one that finished must (its peers may still be
    reading its memory)."""
    from mooncake_ep.cli import launch

    closed = []

    class Group:
        def close(self, final_barrier):
            closed.append(final_barrier)

    monkeypatch.setattr(launch, "join_group", lambda *args: Group())
    with launch.joined_group("reference") as group:
        assert isinstance(group, Group)
    with pytest.raises(RuntimeError, match="boom"), launch.joined_group("reference"):
        raise RuntimeError("boom")
    assert closed == [True, False]


def test_ranks_started_with_other_flags_fail_in_one_line():
    """Ranks of a --group init job (torchrun's, a custom launcher's) given different flags: every rank
    says which value differs where, in one line (it was a 30-line traceback of a ValueError)."""
    from mooncake_ep.group import free_port

    env = dict(os.environ, WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port("127.0.0.1")),
               PYTHONPATH=str(REPO_ROOT))
    procs = [subprocess.Popen([sys.executable, "-m", "mooncake_ep", "demo", "--group", "init", "--backend", "reference",
                               "--experts", "4", "--tokens", "8", "--hidden", hidden], cwd=REPO_ROOT, text=True,
                              env=dict(env, RANK=str(rank)), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for rank, hidden in enumerate(["128", "256"])]
    for proc in procs:
        out, err = proc.communicate(timeout=PROCESS_LIMIT_S)
        assert proc.returncode == cli.EXIT_FAILURE, out + err
        assert "Traceback" not in err, err
        assert "RankMismatchError: Buffer: ranks disagree on num_ep_buffer_bytes (rank 0: " in err, err


@pytest.mark.parametrize("local_rank", ["", "abc", "-1"])
def test_a_bad_local_rank_is_a_usage_error(monkeypatch, local_rank):
    """A launcher's LOCAL_RANK that names no index (empty, as $SLURM_LOCALID outside srun): named, not a
    traceback of int(); -1 had been wrapped silently onto the last GPU."""
    from mooncake_ep.cli import launch

    monkeypatch.setenv("LOCAL_RANK", local_rank)
    with pytest.raises(cli.UsageError, match=f"LOCAL_RANK must be a non-negative integer .*got {local_rank!r}"):
        launch.use_process_device()


@pytest.mark.skipif(os.name != "posix", reason="the listening socket reaches rank 0 through pass_fds (POSIX)")
def test_a_launch_keeps_its_port_from_its_choice_to_rank_0s_store(monkeypatch, capsys):
    """The launcher chose a free port, released it and gave its number to the ranks: a program that took
    it meanwhile (here: before rank 0 had started) failed rank 0 ("already in use"), or its peers met
    that program's store. The launcher now holds the port and gives rank 0 the listening socket."""
    import socket

    from mooncake_ep.cli import launch

    with socket.create_server(("127.0.0.1", 0)) as taken:
        taken_port = taken.getsockname()[1]
        monkeypatch.setattr(launch, "free_port", lambda host: taken_port, raising=False)
        assert cli.main(["demo", "--launch", "2", *TINY[2:], "--backend", "reference"]) == cli.EXIT_OK
    out = capsys.readouterr().out
    assert "all 2 processes passed" in out and f"127.0.0.1:{taken_port}" not in out


_STORE_FD_CHILD = r"""
import json, os, socket, sys
from mooncake_ep.cli import launch
out = {}
listening = int(os.environ[launch.STORE_SOCKET_FD_ENV])
sock = launch._launch_store_socket()
out["adopted"] = sock is not None and sock.getsockname()[1] == int(sys.argv[1])
out["inheritable"] = sock is not None and os.get_inheritable(sock.fileno())
out["variable left"] = launch.STORE_SOCKET_FD_ENV in os.environ
try:
    os.fstat(listening)
    out["launcher's number open"] = True
except OSError:
    out["launcher's number open"] = False
own = socket.create_connection(("127.0.0.1", int(sys.argv[1])))  # a socket of this process's own
for name, number, rank in (("closed", "97", "0"), ("own", str(own.fileno()), "0"), ("rank 1", "97", "1")):
    os.environ.update({launch.STORE_SOCKET_FD_ENV: number, "RANK": rank})
    out[name] = repr(launch._launch_store_socket())
out["own still open"] = own.fileno() != -1 and os.fstat(own.fileno()) is not None
print(json.dumps(out))
"""


@pytest.mark.skipif(os.name != "posix", reason="the listening socket reaches rank 0 through pass_fds (POSIX)")
@pytest.mark.parametrize("leads_its_group", [True, False])
def test_rank_0_adopts_only_a_listening_store_socket_and_passes_neither_it_nor_its_variable_on(leads_its_group):
    """Rank 0 adopted whatever MOONCAKE_EP_STORE_FD named: a closed number raised a raw OSError, another
    socket of its own was closed under it, and the adopted socket and the variable reached every process
    rank 0 started (one still running held the port: rank 1 then waited its whole timeout for a dead
    rank 0). Now it checks the number, adopts a non-inheritable duplicate and removes the variable. Also
    where the launched command wraps python (sh -c, a sanitizer): that python leads no process group, and
    ignored the socket it held, so its own store could not bind the port (review)."""
    import json
    import socket

    from mooncake_ep.cli import launch

    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        env = dict(os.environ, RANK="0", PYTHONPATH=str(Path(__file__).resolve().parent.parent),
                   **{launch.STORE_SOCKET_FD_ENV: str(listener.fileno())})
        proc = subprocess.run([sys.executable, "-c", _STORE_FD_CHILD, str(port)], env=env, pass_fds=[listener.fileno()],
                              start_new_session=leads_its_group, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {"adopted": True, "inheritable": False, "variable left": False,
                                       "launcher's number open": False, "closed": "None", "own": "None",
                                       "rank 1": "None", "own still open": True}, proc.stdout
    for problem in ("97 (Bad file descriptor)", "(it is a socket that does not listen)",
                    "97 (RANK is '1', and only rank 0 serves the store)"):
        assert f"ignoring {launch.STORE_SOCKET_FD_ENV}=" in proc.stderr and problem in proc.stderr, proc.stderr


def test_a_launch_inside_a_torchrun_worker_meets_at_its_own_store(monkeypatch, capsys):
    """torchrun's TORCHELASTIC_USE_AGENT_STORE is not passed on: with it the ranks looked for torchrun's
    store at the launch's port, where nothing serves it, and failed after twice the group timeout."""
    from mooncake_ep.cli import launch

    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    rank_code = "import os, sys; sys.exit(3 if 'TORCHELASTIC_USE_AGENT_STORE' in os.environ else 0)"
    assert launch.launch("test", [sys.executable, "-c", rank_code], 2) == cli.EXIT_OK
    assert "all 2 processes passed" in capsys.readouterr().out


def test_the_demo_prints_the_tolerance_it_used():
    proc = run_cli("demo", *TINY, "--backend", "reference", "--tolerance", "0.025")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "PASS: every token within relative error 0.025 " in proc.stdout


@pytest.mark.parametrize("signal_name", ["SIGTERM", "SIGKILL"])
def test_a_terminated_launcher_stops_its_processes(tmp_path, signal_name):
    """SIGTERM (or SIGHUP) to --launch's process ends its rank processes, as Ctrl-C does; so does a
    SIGKILL, which the launcher never sees: each rank watches it (the ranks lead process groups of
    their own, which a signal to the launcher's group no longer reaches)."""
    signal = pytest.importorskip("signal")
    if not hasattr(signal, signal_name) or sys.platform == "win32":
        pytest.skip("POSIX signals")
    marker = f"--seed {os.getpid() % 1000}"
    log = tmp_path / "launcher.log"  # a file, not a pipe: the ranks' progress bars would fill a pipe
    with open(log, "w") as out:
        launcher = subprocess.Popen([sys.executable, "-m", "mooncake_ep", "bench", "--launch", "2", "--backend",
                                     "reference", "--iters", "1000000", "--warmup", "0", "--tokens", "8",
                                     *marker.split()], cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT,
                                    env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)))

    def workers() -> list[str]:
        listing = subprocess.run(["ps", "-ww", "-eo", "pid,args"], capture_output=True, text=True).stdout.splitlines()
        return [line for line in listing if "--group init" in line and marker in line]
    deadline = time.monotonic() + PROCESS_LIMIT_S
    while len(workers()) < 2:
        assert time.monotonic() < deadline and launcher.poll() is None, log.read_text()
        time.sleep(0.1)
    launcher.send_signal(getattr(signal, signal_name))
    expected = 128 + signal.SIGTERM if signal_name == "SIGTERM" else -signal.SIGKILL  # 143, as a shell reports it
    assert launcher.wait(PROCESS_LIMIT_S) == expected
    deadline = time.monotonic() + 10.0  # a watching rank sees its parent gone within 0.2 s
    while workers():
        assert time.monotonic() < deadline, workers()
        time.sleep(0.05)


def test_a_signal_while_a_process_starts_leaves_none_running(monkeypatch, capsys):
    """SIGTERM that lands inside Popen, after its fork: that process is stopped with the others."""
    signal = pytest.importorskip("signal")
    if not hasattr(signal, "SIGTERM") or sys.platform == "win32":
        pytest.skip("POSIX signals")
    from mooncake_ep.cli import launch

    started, real_popen = [], subprocess.Popen

    def popen_then_signal(*args, **kwargs):
        started.append(real_popen(*args, **kwargs))
        if len(started) == 2:  # the process exists, the launcher has not got its Popen object yet
            os.kill(os.getpid(), signal.SIGTERM)
        return started[-1]
    monkeypatch.setattr(launch.subprocess, "Popen", popen_then_signal)
    previous = signal.getsignal(signal.SIGTERM)
    with pytest.raises(cli.Interrupted, match=f"signal {int(signal.SIGTERM)}") as interrupted:
        launch.launch("test", [sys.executable, "-c", "import time; time.sleep(60)"], 3)
    assert interrupted.value.signum == signal.SIGTERM
    assert len(started) == 2 and [proc.poll() for proc in started] == [-signal.SIGKILL] * 2
    assert signal.getsignal(signal.SIGTERM) is previous
    capsys.readouterr()


def test_an_ignored_signal_stays_ignored_through_a_launch(capsys):
    """nohup (SIGHUP ignored), or a script's ``cmd &`` (SIGINT ignored): the launch runs on, as Python
    keeps such a signal ignored; it had put its own handler there and stopped every rank."""
    signal = pytest.importorskip("signal")
    if not hasattr(signal, "SIGHUP") or sys.platform == "win32":
        pytest.skip("POSIX signals")
    from mooncake_ep.cli import launch

    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        rank_code = "import os, signal; os.kill(os.getppid(), signal.SIGHUP)"
        assert launch.launch("test", [sys.executable, "-c", rank_code], 2) == cli.EXIT_OK
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, previous)
    assert "all 2 processes passed" in capsys.readouterr().out


@pytest.mark.parametrize("detached", [False, True], ids=["under-a-shell", "setsid"])
def test_a_suspended_launcher_suspends_its_processes(tmp_path, detached):
    """Ctrl-Z (SIGTSTP) to --launch's process stops its ranks too, which lead process groups of their
    own that the terminal's signal does not reach; continuing the launcher continues them, and the
    launch then ends as usual. A launcher of an orphaned group (setsid: no shell could continue it)
    ignores SIGTSTP, as the kernel does for such a group, says so on stderr, and runs on with its ranks."""
    signal = pytest.importorskip("signal")
    if not hasattr(signal, "SIGTSTP") or not hasattr(os, "killpg") or not os.path.isdir("/proc/self"):
        pytest.skip("POSIX job control, and /proc to see the processes' states")
    go = tmp_path / "go"
    rank_code = (
        "import os, time\n"
        f"open({str(tmp_path)!r} + '/rank' + os.environ['RANK'], 'w').write(str(os.getpid()))\n"
        f"while not os.path.exists({str(go)!r}): time.sleep(0.01)\n"
    )
    launcher_code = ("import sys\nfrom mooncake_ep.cli import launch\n"
                     f"sys.exit(launch.launch('test', [sys.executable, '-c', {rank_code!r}], 2))\n")
    # A group of its own whose parent (this test) is in another group of the session, as a shell's
    # job; or a session of its own.
    placement = dict(start_new_session=True) if detached else dict(process_group=0)
    stderr_path = tmp_path / "launcher.err"
    with stderr_path.open("w") as stderr:  # the launcher has its own copy of the descriptor
        launcher = subprocess.Popen([sys.executable, "-c", launcher_code], cwd=tmp_path, stdout=subprocess.DEVNULL,
                                    stderr=stderr, env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)), **placement)
    try:
        rank_files = [tmp_path / f"rank{rank}" for rank in range(2)]
        _wait_until(lambda: all(f.exists() and f.read_text() for f in rank_files), launcher)
        ranks = [int(f.read_text()) for f in rank_files]
        launcher.send_signal(signal.SIGTSTP)
        if detached:
            # The line comes where the launcher decided: had it stopped anything, it would be stopped by now.
            _wait_until(lambda: "SIGTSTP ignored" in stderr_path.read_text(), launcher)
            assert [_state(pid) for pid in [launcher.pid, *ranks]].count("T") == 0
        else:
            _wait_until(lambda: [_state(pid) for pid in [launcher.pid, *ranks]] == ["T"] * 3)
            launcher.send_signal(signal.SIGCONT)
            _wait_until(lambda: all(_state(pid) not in ("T", None) for pid in [launcher.pid, *ranks]))
        go.touch()
        assert launcher.wait(PROCESS_LIMIT_S) == cli.EXIT_OK
    finally:
        if launcher.poll() is None:  # a failed check: continue and end the launch, which ends its ranks
            launcher.send_signal(signal.SIGCONT)
            launcher.terminate()
            launcher.wait(PROCESS_LIMIT_S)


def _end_ranks(ranks: list[int]) -> None:
    """Kill whatever a failed check left of the ranks' groups."""
    for pid in ranks:
        try:
            os.killpg(pid, 9)
        except ProcessLookupError:
            pass


def test_a_rank_reads_the_terminal_of_a_launch_in_its_foreground():
    """Ranks in process groups of the launcher's session were background jobs of its terminal: a rank
    reading it (input(), pdb) was stopped by SIGTTIN and the launch hung (helper-117). In sessions of
    their own they read it. The pty is forked by a driver process of its own: this one may hold threads
    (JAX's), which a fork must not copy."""
    pytest.importorskip("pty")
    rank_code = "import sys\nsys.exit(0 if sys.stdin.readline().strip() == 'go' else 3)\n"
    launcher_code = (f"import sys\nsys.path.insert(0, {str(REPO_ROOT)!r})\nfrom mooncake_ep.cli import launch\n"
                     f"sys.exit(launch.launch('test', [sys.executable, '-c', {rank_code!r}], 1))\n")
    driver_code = f"""
import os, pty, select, sys, time
pid, terminal = pty.fork()
if pid == 0:  # the launcher: a session leader whose controlling terminal is the pty, in its foreground
    os.execv(sys.executable, [sys.executable, "-c", {launcher_code!r}])
output, deadline = b"", time.monotonic() + {PROCESS_LIMIT_S / 2}
while b"launching 1 processes" not in output and time.monotonic() < deadline:
    if select.select([terminal], [], [], 0.1)[0]:
        output += os.read(terminal, 4096)
os.write(terminal, b"go\\n")
while time.monotonic() < deadline:
    if select.select([terminal], [], [], 0.1)[0]:
        try:
            output += os.read(terminal, 4096)
        except OSError:  # the launcher exited: the pty closed
            pass
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
        print("launcher exited", os.waitstatus_to_exitcode(status), output)
        sys.exit(0)
os.kill(pid, 9)
print("the launch did not end", output)
"""
    proc = subprocess.run([sys.executable, "-c", driver_code], capture_output=True, text=True, timeout=PROCESS_LIMIT_S)
    assert proc.returncode == 0 and proc.stdout.startswith(f"launcher exited {cli.EXIT_OK} "), proc.stdout + proc.stderr


def test_ranks_end_when_the_launcher_died_before_they_looked_and_is_not_reaped(tmp_path):
    """A rank that looked for its launcher only after it died found its pid still there, a zombie that
    its parent had not reaped yet, took it for a wrapper between them, and ran on unwatched."""
    signal = pytest.importorskip("signal")
    if not hasattr(os, "killpg") or not os.path.isdir("/proc/self"):
        pytest.skip("POSIX process groups, and /proc to see the processes")
    go = tmp_path / "go"
    rank_code = (f"import os, time\nwhile not os.path.exists({str(go)!r}): time.sleep(0.01)\n"  # the launcher is dead
                 "from mooncake_ep.cli import launch\nlaunch.watch_launcher()\ntime.sleep(600)\n")  # by then
    launcher_code = ("import sys\nfrom mooncake_ep.cli import launch\n"
                     f"sys.exit(launch.launch('test', [sys.executable, '-c', {rank_code!r}], 2))\n")
    launcher = subprocess.Popen([sys.executable, "-c", launcher_code], cwd=tmp_path, stdout=subprocess.DEVNULL,
                                env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)), start_new_session=True)
    ranks = []
    try:
        _wait_until(lambda: len(_children(launcher.pid)) == 2, launcher)
        ranks = _children(launcher.pid)
        launcher.send_signal(signal.SIGKILL)
        _wait_until(lambda: _state(launcher.pid) == "Z")  # dead, and not reaped until the end of the test
        go.touch()
        _wait_until(lambda: all(_state(pid) in (None, "Z") for pid in ranks))
        assert _state(launcher.pid) == "Z"
    finally:
        launcher.kill()
        launcher.wait()
        _end_ranks(ranks)


def _children(pid: int) -> list[int]:
    """The pids of the processes whose parent is ``pid`` (from /proc)."""
    children = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (fields := _stat_fields(int(entry))) and fields[1] == str(pid):
            children.append(int(entry))
    return children


def test_a_launch_whose_sigchld_is_ignored_still_reads_its_ranks_exit_codes(tmp_path):
    """SIGCHLD ignored (inherited across exec from a daemon or a wrapper) lets the kernel reap the ranks
    itself: the launch's look at their exit codes raised ChildProcessError, even on success."""
    signal = pytest.importorskip("signal")
    if not hasattr(signal, "SIGCHLD") or not hasattr(os, "waitid"):
        pytest.skip("POSIX SIGCHLD")
    rank_code = "import os, sys\nsys.exit(3 if os.environ['RANK'] == '1' else 0)\n"
    wrapper = ("import os, signal, sys\nsignal.signal(signal.SIGCHLD, signal.SIG_IGN)\n"
               "from mooncake_ep.cli import launch\n"
               f"code = launch.launch('test', [sys.executable, '-c', {rank_code!r}], 2)\n"
               "assert signal.getsignal(signal.SIGCHLD) == signal.SIG_IGN  # restored\n"
               "sys.exit(code)\n")
    proc = subprocess.run([sys.executable, "-c", wrapper], cwd=tmp_path, capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)), timeout=PROCESS_LIMIT_S)
    assert proc.returncode == cli.EXIT_FAILURE and "FAIL: rank 1 exited 3" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.parametrize("raised, code", [(KeyboardInterrupt(), 130), (cli.Interrupted(15), 143),
                                          (cli.Interrupted(1), 129)])
def test_an_interrupted_command_exits_as_a_shell_reports_its_signal(raised, code, monkeypatch, capsys):
    """Ctrl-C: 130; a launch stopped by SIGTERM exited 130 too, where 143 is what supervisors expect."""
    from mooncake_ep.cli import demo

    def interrupted(args):
        raise raised

    monkeypatch.setattr(demo, "run", interrupted)
    assert cli.main(["demo", "--backend", "reference"]) == code
    assert capsys.readouterr().err.strip().endswith("demo: interrupted")


def test_a_launch_says_when_a_rank_failed_and_the_others_are_given_time(capsys):
    """The grace before the others are stopped (10 s) passed in silence after a rank died."""
    from mooncake_ep.cli import launch

    rank_code = "import os, sys, time\nif os.environ['RANK'] == '1': sys.exit(3)\ntime.sleep(1.0)\n"
    assert launch.launch("test", [sys.executable, "-c", rank_code], 2) == cli.EXIT_FAILURE
    out, err = capsys.readouterr()
    assert (f"mooncake_ep launch: rank 1 exited 3; the others get {launch.LAUNCH_GRACE_S:.0f} s to finish before "
            f"they are stopped") in err and "FAIL: rank 1 exited 3" in out, (out, err)


def test_a_launchs_summary_tells_the_ranks_it_stopped_from_the_one_that_failed(monkeypatch, capsys):
    """The ranks stopped after the grace were listed as "stopped by signal 15", like crashed ones
    (helper-146)."""
    from mooncake_ep.cli import launch

    monkeypatch.setattr(launch, "LAUNCH_GRACE_S", 0.5)
    rank_code = "import os, sys, time\nif os.environ['RANK'] == '1': sys.exit(3)\ntime.sleep(60)\n"
    assert launch.launch("test", [sys.executable, "-c", rank_code], 3) == cli.EXIT_FAILURE
    assert "FAIL: rank 1 exited 3; ranks 0, 2 still running 0.5 s later, stopped by the launcher" in \
        capsys.readouterr().out


def _wait_until(condition, proc: subprocess.Popen | None = None, limit_s: float = 30.0) -> None:
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        assert proc is None or proc.poll() is None, f"exited {proc.returncode}"
        time.sleep(0.02)


def _state(pid: int) -> str | None:
    """The process's state letter (T stopped, Z zombie); None if there is none."""
    fields = _stat_fields(pid)
    return fields[0] if fields else None


def test_launched_processes_children_are_stopped_with_them(tmp_path, monkeypatch, capsys):
    """A rank's own child processes go with it: rank 0 fails, rank 1 hangs beside a child of its own,
    and once the grace has passed neither rank 1 nor its child is left running."""
    if not hasattr(os, "killpg") or not os.path.isdir("/proc/self"):
        pytest.skip("POSIX process groups, and /proc to see the child")
    from mooncake_ep.cli import launch

    monkeypatch.setattr(launch, "LAUNCH_GRACE_S", 0.5)
    child_pid_file = tmp_path / "child.pid"
    rank_code = (
        "import os, subprocess, sys, time\n"
        "if os.environ['RANK'] == '0':\n"  # fails once rank 1's child runs
        f"    while not os.path.exists({str(child_pid_file)!r}): time.sleep(0.01)\n"
        "    sys.exit(3)\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        f"open({str(child_pid_file) + '.part'!r}, 'w').write(str(child.pid))\n"
        f"os.rename({str(child_pid_file) + '.part'!r}, {str(child_pid_file)!r})\n"
        "time.sleep(600)\n"
    )
    assert launch.launch("test", [sys.executable, "-c", rank_code], 2) == cli.EXIT_FAILURE
    assert "rank 0 exited 3" in capsys.readouterr().out
    child_pid = int(child_pid_file.read_text())
    started = _start_time(child_pid)  # None: already gone; else, which process the pid names now
    deadline = time.monotonic() + 10.0
    while started is not None and _start_time(child_pid) == started:
        if time.monotonic() > deadline:
            os.kill(child_pid, 9)
            pytest.fail(f"the rank's child {child_pid} was left running")
        time.sleep(0.05)


def _start_time(pid: int) -> str | None:
    """When the process ``pid`` started; None if there is none, or a zombie. A pid taken again by a
    new process reads another time."""
    fields = _stat_fields(pid)
    return None if not fields or fields[0] == "Z" else fields[19]


def _stat_fields(pid: int) -> list[str] | None:
    """/proc/PID/stat from its 3rd field (the state) on; None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return None


def test_bench_finishes_when_its_stderr_is_a_closed_pipe():
    """The progress bar is for a terminal: written into a closed pipe from a rank's thread, it raised
    inside tqdm's lock and the run hung in close() (a run past the bar's 2 s delay: ~6 s here). The
    tiny shape without the torch baseline, whose threads a loaded 2-CPU machine slowed 25-fold."""
    proc = subprocess.Popen([sys.executable, "-m", "mooncake_ep", "bench", *TINY, "--iters", "400", "--warmup", "1",
                             "--no-baseline"], cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        proc.stderr.close()
        assert proc.wait(PROCESS_LIMIT_S) == 0
    finally:
        proc.kill()
        proc.wait()


def test_running_out_of_memory_is_one_line_naming_which(monkeypatch, capsys):
    """numpy's MemoryError and torch's CPU allocator's RuntimeError are the host's; cupy's (a MemoryError) and
    torch.cuda's (a RuntimeError) the device's."""
    from mooncake_ep.cli import demo

    class OutOfMemoryError(RuntimeError):  # torch.cuda.OutOfMemoryError's name and base
        pass

    class CupyOutOfMemory(MemoryError):
        __module__ = "cupy.cuda.memory"

    for error, which in ((MemoryError("Unable to allocate 1 TiB"), "host"), (CupyOutOfMemory("pool"), "device"),
                         (OutOfMemoryError("CUDA out of memory. Tried to allocate 80 GiB\nmore"), "device"),
                         (RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate "
                                       "memory: you tried to allocate 31457280000 bytes.\nmore"), "host")):
        monkeypatch.setattr(demo, "run", lambda args, error=error: (_ for _ in ()).throw(error))
        assert cli.main(["demo"]) == 1
        err = capsys.readouterr().err
        assert f"demo: out of {which} memory (" in err and "lower --hidden, --experts, --tokens or --ranks" in err
        assert "more" not in err  # one line
    # numpy's MemoryError can be empty: no "()" (helper-149); bench names its own flags too
    from mooncake_ep.cli import bench

    monkeypatch.setattr(bench, "run", lambda args: (_ for _ in ()).throw(MemoryError()))
    assert cli.main(["bench"]) == 1
    assert capsys.readouterr().err.endswith("bench: out of host memory; lower --hidden, --experts, --tokens, --ranks or "
                                            "--input-sets\n")
    monkeypatch.setattr(demo, "run", lambda args: (_ for _ in ()).throw(RuntimeError("a bug")))
    with pytest.raises(RuntimeError, match="a bug"):  # other RuntimeErrors keep their traceback
        cli.main(["demo"])


def test_the_memory_check_takes_the_containers_limit(tmp_path):
    """A GPU pod's or a Slurm job's cgroup limit, not the machine's memory, is where the OOM killer ends
    a run without a word (helper-149, helper-150): the least limit of the process's own cgroup and its
    parents, v2's memory.max or v1's memory.limit_in_bytes, "max" or v1's unlimited counting as none."""
    root, proc = tmp_path / "sys", tmp_path / "cgroup"
    root.mkdir()
    proc.write_text("")

    def limit():
        return cli._cgroup_memory_limit_bytes(str(root), str(proc))

    def write(relative: str, text: str) -> None:
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_text(text + "\n")

    assert limit() is None  # no file at all
    write("memory/memory.limit_in_bytes", "9223372036854771712")  # v1 unlimited
    assert limit() is None
    write("memory.max", "max")  # v2: no limit at the root
    assert limit() is None
    # v1: the job's own cgroup, and a parent's lower limit
    proc.write_text("9:name=systemd:/\n4:cpu,memory:/slurm/job_7\n0::/\n")
    write("memory/slurm/job_7/memory.limit_in_bytes", str(8 << 30))
    assert limit() == 8 << 30
    write("memory/slurm/memory.limit_in_bytes", str(6 << 30))
    assert limit() == 6 << 30
    # v2: the unified hierarchy's path, "max" where unset
    proc.write_text("0::/system.slice/job.scope\n")
    write("system.slice/job.scope/memory.max", str(3 << 30))
    write("system.slice/memory.max", "max")
    assert limit() == 3 << 30
    write("memory.max", str(2 << 30))  # a container's own namespace: its limit at the root
    assert limit() == 2 << 30


def test_main_returns_instead_of_exiting(capsys):
    assert cli.main(["--version"]) == 0
    assert cli.main(["demo", "--bogus"]) == 2
    capsys.readouterr()


def test_cli_imports_only_public_names():
    """STYLE §2: cli/ imports public mooncake_ep names only, nothing with a leading underscore."""
    for path in sorted(CLI_DIR.glob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module != "__future__":
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                if name.split(".")[0] == "mooncake_ep":
                    private = [part for part in name.split(".") if part.startswith("_")]
                    assert not private, f"{path.name}:{node.lineno} imports {name}"


# Private attributes cli/ reads of objects not its own: the standard library's and torch's, and bench's
# one switch of the Buffer's backend (cli/__init__.py says why).
ALLOWED_PRIVATE_ATTRIBUTES = {("__init__.py", "_exit"), ("__init__.py", "_get_help_string"), ("bench.py", "_sleep"),
                              ("bench.py", "_cuda")}


def test_cli_reads_no_private_attribute_of_the_library():
    """As the imports: ``obj._name`` only on the command's own objects (self), or where listed."""
    used = set()
    for path in sorted(CLI_DIR.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                    and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
                used.add((path.name, node.attr))
    assert used == ALLOWED_PRIVATE_ATTRIBUTES


def _gpu_usable() -> bool:
    try:
        import cupy
        import torch

        return cupy.cuda.runtime.getDeviceCount() > 0 and torch.cuda.is_available()
    except Exception:  # noqa: BLE001 - no cupy, no torch, no driver: no GPU for the demo
        return False


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_usable(), reason="needs a CUDA GPU with cupy and CUDA torch")
@pytest.mark.parametrize("precision", ["--fp8", "--no-fp8"])
def test_demo_cuda_passes(precision):
    proc = run_cli("demo", *TINY, precision, "--backend", "cuda")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "backend cuda" in proc.stdout
    assert all(row[-1] == "pass" for row in table_rows(proc.stdout, 2)), proc.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_usable(), reason="needs a CUDA GPU with cupy and CUDA torch")
def test_demo_launch_cuda_passes():
    """--launch N on the GPU: processes on the one GPU, peers reached through CUDA IPC (fp8 dispatch;
    bf16 and fp8 in processes are compared element by element in test_gpu_ipc.py)."""
    proc = run_cli("demo", "--launch", "2", *TINY, "--fp8", "--backend", "cuda")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "backend cuda" in proc.stdout and "all 2 processes passed" in proc.stdout
    assert all(row[-1] == "pass" for row in table_rows(proc.stdout, 2)), proc.stdout
