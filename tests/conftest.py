"""Session set-up shared by every test module.

JAX gets several CPU devices, one per in-process rank of the JAX CPU tests (tests/test_jax.py): XLA
runs one CPU device's programs one at a time, so ranks whose collectives must meet need a device
each. The option only takes effect before JAX starts its CPU backend, hence here, before any test
module runs; JAX's default device stays cpu:0, so other tests see no difference.

On a GPU, JAX would take 75% of the device memory at start-up; the GPU tests share the device
between JAX, torch, cupy and the Buffers' workspaces, so JAX allocates as it goes instead.
"""

from __future__ import annotations

import os

NUM_JAX_CPU_DEVICES = 8

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

try:
    import jax
except ImportError:  # JAX is optional; its tests skip
    jax = None

if jax is not None:
    jax.config.update("jax_num_cpu_devices", NUM_JAX_CPU_DEVICES)


def pytest_runtest_logreport(report):
    """With MOONCAKE_EP_FAILURE_LOG set, append each failure's report to that file as it happens.

    scripts/gpu_check.sh sets it: a run killed by its time limit (a hang) still leaves the
    tracebacks of the failures before it, which pytest would only have printed at the end.
    """
    path = os.environ.get("MOONCAKE_EP_FAILURE_LOG")
    if path and report.failed:
        with open(path, "a") as log:
            log.write(f"==== {report.nodeid} ({report.when})\n{report.longreprtext}\n")
