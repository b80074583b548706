"""An experiment's kernel variant for the GPU tests: MOONCAKE_EP_TEST_MACROS="EP_NAME=INTEGER,...".

Every kernel the calling process builds then gets those extra NVRTC macros, so a variant of
scripts/ab_kernels.py is checked by the GPU tests and the sanitizer before it is written in. The test
session applies it (conftest.py), and so does every rank process a test spawns (_ep_processes.py),
which inherits the variable.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

MACROS_VAR = "MOONCAKE_EP_TEST_MACROS"


def apply_experiment_macros() -> dict[str, int]:
    """Parses the variable as ab_kernels' variants are (the library's own macros refused, but for the
    block size EP_NUM_THREADS) and adds the macros to every kernel build; returns them ({} when unset)."""
    spec = os.environ.get(MACROS_VAR, "")
    if not spec:
        return {}
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import ab_kernels  # a development tool of scripts/

    from mooncake_ep import kernels

    macros = dict(ab_kernels.parse_macro(item, MACROS_VAR) for item in spec.split(",") if item)
    library_macros = kernels._common_macros
    kernels._common_macros = lambda sys_scope: library_macros(sys_scope) | macros
    return macros
