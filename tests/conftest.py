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
