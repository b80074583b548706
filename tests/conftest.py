"""Session set-up shared by every test module.

JAX gets several CPU devices, one per in-process rank of the JAX CPU tests (tests/test_jax.py): XLA
runs one CPU device's programs one at a time, so ranks whose collectives must meet need a device
each. The option only takes effect before JAX starts its CPU backend, hence here, before any test
module runs; JAX's default device stays cpu:0, so other tests see no difference.

On a GPU, JAX would take 75% of the device memory at start-up; the GPU tests share the device
between JAX, torch, cupy and the Buffers' workspaces, so JAX allocates as it goes instead.

With MOONCAKE_EP_TEST_MACROS="EP_NAME=INTEGER,..." every kernel this process and the rank processes of
_ep_processes.py build gets those extra NVRTC macros (_experiment.py; other processes that tests spawn,
the CLI's and the benchmark's, build the library's own kernels): an experiment's variant
(scripts/ab_kernels.py) is then checked by the GPU tests and the sanitizer before it is written in
(`pytest -m gpu`; the CPU tests of the kernel cache expect the library's own keys and fail under it).

With MOONCAKE_EP_REQUIRE_GPU set, a GPU test that skips fails instead (see pytest_runtest_makereport).
"""

from __future__ import annotations

import os
import re

import pytest

from _experiment import apply_experiment_macros

NUM_JAX_CPU_DEVICES = 8

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

try:
    import jax
except ImportError:  # JAX is optional; its tests skip
    jax = None

if jax is not None:
    jax.config.update("jax_num_cpu_devices", NUM_JAX_CPU_DEVICES)


EXPERIMENT_MACROS = apply_experiment_macros()


def pytest_report_header(config):
    if EXPERIMENT_MACROS:
        return f"kernels built with the experiment's macros {EXPERIMENT_MACROS} (MOONCAKE_EP_TEST_MACROS)"
    return None


# Skips a GPU run may take: a test that needs more GPUs than the machine has.
_GPU_RUN_SKIPS = re.compile(r"needs \d+ GPUs")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """With MOONCAKE_EP_REQUIRE_GPU set (scripts/gpu_check.sh sets it), a GPU test that skips fails.

    On the GPU machine "needs a CUDA GPU", "needs JAX with CUDA" or a cupy that does not import
    mean a broken install, which a skip would hide; only a test that needs more GPUs may skip.
    """
    outcome = yield
    report = outcome.get_result()
    if (report.skipped and not hasattr(report, "wasxfail") and os.environ.get("MOONCAKE_EP_REQUIRE_GPU")
            and item.get_closest_marker("gpu") is not None):
        reason = report.longrepr[-1] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        if not _GPU_RUN_SKIPS.search(reason):
            report.outcome = "failed"
            report.longrepr = f"skipped on a GPU run (MOONCAKE_EP_REQUIRE_GPU is set): {reason}"


def pytest_runtest_logreport(report):
    """With MOONCAKE_EP_FAILURE_LOG set, append each failure's report to that file as it happens.

    scripts/gpu_check.sh sets it: a run killed by its time limit (a hang) still leaves the
    tracebacks of the failures before it, which pytest would only have printed at the end.
    """
    path = os.environ.get("MOONCAKE_EP_FAILURE_LOG")
    if path and report.failed:
        with open(path, "a") as log:
            log.write(f"==== {report.nodeid} ({report.when})\n{report.longreprtext}\n")
