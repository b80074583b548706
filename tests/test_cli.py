"""Tests of the command line (mooncake_ep.cli): ``python -m mooncake_ep`` in a subprocess, as users run it.

CPU: the demo runs on the numpy reference backend with a tiny shape. The GPU test runs it on the kernels.
No assertion is about elapsed time; the process limit only turns a hang into a failure.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from mooncake_ep import cli

REPO_ROOT = Path(__file__).resolve().parents[1]
CLI_DIR = REPO_ROOT / "mooncake_ep" / "cli"
# Safety net for a command that hangs (a bug): the test fails instead of stalling CI.
PROCESS_LIMIT_S = 120.0
TINY = ["--ranks", "2", "--experts", "8", "--topk", "4", "--tokens", "8", "--hidden", "256"]


def run_cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mooncake_ep", *argv], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=PROCESS_LIMIT_S)


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
    report_path = tmp_path / "demo.json"
    proc = run_cli("demo", "--launch", "2", *TINY, "--json", str(report_path))
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
    assert "FAIL" in proc.stdout


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


def test_bad_flag_exits_2():
    proc = run_cli("demo", "--no-such-flag")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "usage:" in proc.stderr and "--no-such-flag" in proc.stderr


@pytest.mark.parametrize("argv", [["no-such-command"], ["demo", "--ranks", "two"], ["demo", "--backend", "tpu"], []])
def test_bad_usage_returns_2(argv, capsys):
    assert cli.main(argv) == 2
    assert "usage:" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["demo", "--ranks", "4", "--experts", "6"], "multiple of num_ranks"),
    (["demo", "--hidden", "1000"], "multiple of 128"),
    (["demo", "--experts", "4", "--topk", "8"], "--topk"),
    (["demo", "--tokens", "0"], "--tokens"),
    (["demo", "--launch", "2", "--ranks", "4"], "--ranks 4 does not match --launch 2"),
    (["demo", "--launch", "0"], "--launch must be >= 1"),
    (["demo", "--launch", "3"], "multiple of num_ranks=3"),
    (["demo", "--launch", "2", "--group", "init"], "leave out --group"),
])
def test_inconsistent_flags_exit_2_with_the_reason(argv, message, capsys):
    assert cli.main([*argv, "--backend", "reference"]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and message in err


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
