"""scripts/gpu_check.sh's own control flow, on the CPU: stand-in python3 and nvidia-smi first on PATH
record what the script runs and answer as told (helper-116 found each of these passing silently)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.sh"
pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None,
                                reason="bash and coreutils' timeout")

STAND_IN = """#!/usr/bin/env bash
echo "$(basename "$0") $*" >>"$CALLS"
[ -n "${RECORD_REQUIRE_GPU:-}" ] && echo "MOONCAKE_EP_REQUIRE_GPU=${MOONCAKE_EP_REQUIRE_GPU:-}" >>"$CALLS"
case "$*" in *"pip install"*) exit "${INSTALL_RC:-0}";; esac
case "$*" in *test_b.py*) printf '%s' "${PYTEST_OUTPUT_TEST_B:-}"; exit "${PYTEST_RC_TEST_B:-${PYTEST_RC:-0}}";; esac
case "$*" in *pytest*) exit "${PYTEST_RC:-0}";; esac
exit 0
"""


def run_script(tmp_path: Path, *stages: str, **env: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls.txt"
    bin_dir.mkdir(exist_ok=True)
    for name in ("python3", "nvidia-smi"):
        (bin_dir / name).write_text(STAND_IN)
        (bin_dir / name).chmod(0o755)
    calls.write_text("")
    proc = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "out"), *stages], cwd=tmp_path, capture_output=True,
                          text=True, timeout=60,
                          env=dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", CALLS=str(calls),
                                   **env))
    return proc, calls.read_text().splitlines()


@pytest.mark.parametrize("stages, env, message", [
    (("tests", "benchmark"), {}, "unknown stage 'benchmark'"),
    (("tests",), {"BUDGET_S": "1800.0"}, "BUDGET_S must be a whole number of seconds, got '1800.0'"),
    (("tests",), {"PACK_RESERVE_S": "10m"}, "PACK_RESERVE_S must be a whole number of seconds, got '10m'"),
])
def test_an_unknown_stage_or_budget_is_refused_before_anything_runs(tmp_path, stages, env, message):
    """A typo in a stage ran nothing and exited 0; so did a BUDGET_S of 1800.0 (bash's arithmetic failed
    inside every stage's if)."""
    proc, calls = run_script(tmp_path, *stages, **env)
    assert proc.returncode == 2 and message in proc.stderr and calls == [], proc.stdout + proc.stderr


def test_a_failed_install_still_packs_its_log(tmp_path):
    """The install's failure exited before the pack: a caller that fetches only the archive got nothing."""
    pack = tmp_path / "r.tar.gz"
    proc, calls = run_script(tmp_path, "tests", INSTALL_RC="1", PACK_TO=str(pack))
    assert proc.returncode == 1 and len(calls) == 1 and "pip install" in calls[0], proc.stdout + proc.stderr
    with tarfile.open(pack) as archive:
        assert "./install.log" in archive.getnames()


def test_a_budget_with_a_leading_zero_is_decimal_and_a_k_that_selects_nothing_in_a_file_passes(tmp_path):
    """BUDGET_S=0600 was octal (384 s); pytest's exit 5 for a file where -k selected nothing failed it."""
    proc, calls = run_script(tmp_path, "tests", BUDGET_S="0600", PYTEST_FILES="test_a test_b", PYTEST_K="one_case",
                             PYTEST_RC_TEST_B="5")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [call.split()[-1] for call in calls if "pytest" in call] == ["tests/test_a.py", "tests/test_b.py"]
    proc, _ = run_script(tmp_path, "tests", PYTEST_FILES="test_a", PYTEST_RC="5")  # without -k, 5 is a failure
    assert proc.returncode == 1


def test_a_k_that_selects_nothing_in_any_file_fails(tmp_path):
    """Each file's exit 5 passes under -k, but a -k that ran no test anywhere (a typo) passed as a whole
    (helper-117)."""
    proc, _ = run_script(tmp_path, "tests", PYTEST_FILES="test_a test_b", PYTEST_K="no_such_case", PYTEST_RC="5")
    assert proc.returncode == 1 and "PYTEST_K='no_such_case' selected no test in any file" in proc.stdout


def test_a_log_cut_mid_line_still_gets_its_exit_code_line(tmp_path):
    """A pytest killed by its limit mid-line left the log without a final newline: the step's
    "== NAME rc=" line was glued to it, and a caller's grep for "^== " lost that file's result."""
    proc, _ = run_script(tmp_path, "tests", PYTEST_FILES="test_a test_b", PYTEST_OUTPUT_TEST_B="....F..",
                         PYTEST_RC_TEST_B="124")
    assert proc.returncode == 1
    assert "\n== test_b rc=124\n" in proc.stdout and "\n== test_a rc=0\n" in proc.stdout, proc.stdout


def test_every_stages_pytest_fails_a_skipped_gpu_test(tmp_path):
    """MOONCAKE_EP_REQUIRE_GPU was set in the tests stage only: a call of the sanitizer stage alone ran its
    in-process cases with the requirement off, and passed with every test skipped (helper-173)."""
    proc, calls = run_script(tmp_path, "sanitizer", RECORD_REQUIRE_GPU="1")
    pytest_runs = [i for i, call in enumerate(calls) if "python3 -m pytest" in call]
    assert pytest_runs, proc.stdout + proc.stderr
    assert all(calls[i + 1] == "MOONCAKE_EP_REQUIRE_GPU=1" for i in pytest_runs), calls
