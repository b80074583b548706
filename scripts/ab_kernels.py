"""Kernel variants side by side: the same benchmark, once per set of extra NVRTC macros, in one process.

Times are noisy between machines and drift within one; comparing variants is only meaningful
inside one run, interleaved, with a variant repeated to show the drift. Each variant patches the
macros every kernel is compiled with (as scripts/trace_phases.py does for EP_TRACE), runs
``python -m mooncake_ep bench`` with the given flags, and the p50 of every phase is tabulated.
A development tool for choosing between kernel versions; nothing here is part of the library.

    python scripts/ab_kernels.py --variant base: --variant try:EP_TRY=1 --variant base: \\
        --json ab.json -- --ranks 8 --num-sms 16 --tokens 128 --iters 100 --no-baseline

where the sources under test pick their variant with ``#if EP_TRY`` (a macro of the experiment only:
the chosen variant is written in without it before it is committed).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import tempfile

from mooncake_ep import kernels
from mooncake_ep.cli import main as cli_main


# Macros the library sets for every kernel, or per dispatch mode: the host launches to match them,
# so a variant may not change them (the mode macros would be overwritten anyway). EP_NUM_THREADS is
# the exception: the launchers take their block size from the kernel's own macros.
RESERVED_MACROS = (frozenset(kernels._common_macros(True)) - {"EP_NUM_THREADS"}) | {"EP_USE_FP8", "EP_ROUND_SCALE",
                                                                                    "EP_USE_UE8M0"}


@functools.cache
def _source_words() -> frozenset[str]:
    """Every EP_ name in the kernel sources that the installed package compiles."""
    folder = kernels.kernel_source_dir()
    return frozenset(word for path in sorted(folder.iterdir()) if path.suffix in (".cu", ".cuh")
                     for word in re.findall(r"\bEP_\w+", path.read_text()))


def parse_macro(item: str, where: str) -> tuple[str, int]:
    """``EP_MACRO=INTEGER``, a macro of the experiment's own (not one of :data:`RESERVED_MACROS`),
    named in the kernel sources the installed package compiles: an undefined macro is 0 to the
    preprocessor, so a macro of another tree (an experiment's branch not checked out) would compile
    the unchanged kernels without a word. ``where`` names the flag in the error (also
    scripts/trace_phases.py's and repeat_case.py's ``--macro``, and tests/_experiment.py's
    MOONCAKE_EP_TEST_MACROS)."""
    key, sep, value = item.partition("=")
    if not sep or not key.startswith("EP_") or not value.lstrip("-").isdigit():
        raise argparse.ArgumentTypeError(f"{where}: {item!r} is not EP_MACRO=INTEGER")
    if key in RESERVED_MACROS:
        raise argparse.ArgumentTypeError(f"{where}: {key} is set by the library (the host launches "
                                         f"to match it); use a macro of the experiment's own")
    if key not in _source_words():
        raise argparse.ArgumentTypeError(f"{where}: {key} appears in no kernel source under "
                                         f"{kernels.kernel_source_dir()}, so it would change nothing; install the "
                                         f"tree of the experiment (its branch checked out)")
    return key, int(value)


def parse_variant(text: str) -> tuple[str, dict[str, int]]:
    """``NAME:MACRO=VALUE,MACRO=VALUE`` with integer values (no macros after the colon: the unpatched
    kernels)."""
    name, _, spec = text.partition(":")
    if not name:
        raise argparse.ArgumentTypeError(f"--variant {text!r}: NAME:MACRO=VALUE,... expected")
    return name, dict(parse_macro(item, f"--variant {text!r}") for item in filter(None, spec.split(",")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", type=parse_variant, action="append", required=True,
                        help="NAME:MACRO=VALUE,...; repeat it (a name may come back, to show drift)")
    parser.add_argument("--json", default=None, help="write every run's bench report here")
    parser.add_argument("bench_args", nargs=argparse.REMAINDER, help="-- then the bench flags")
    args = parser.parse_args()
    bench_args = [a for a in args.bench_args if a != "--"]
    if any(a.split("=")[0] in ("--launch", "--group") for a in bench_args):
        # Ranks in other processes compile their own kernels, without this process's patched macros.
        parser.error("the bench must run its ranks in this process: --launch and --group are not supported")

    original = kernels._common_macros
    runs = []
    with tempfile.TemporaryDirectory() as scratch:
        for i, (name, macros) in enumerate(args.variant):
            kernels._common_macros = lambda sys_scope, extra=macros: original(sys_scope) | extra
            path = os.path.join(scratch, f"{i}.json")
            print(f"== variant {name} {macros}", flush=True)
            code = cli_main(["bench", *bench_args, "--json", path])
            if code != 0:
                raise SystemExit(f"variant {name}: bench exited {code}")
            with open(path) as f:
                runs.append({"name": name, "macros": macros, "report": json.load(f)})
    kernels._common_macros = original

    phases = list(runs[0]["report"]["phases"])
    print(f"{'variant':<12}" + "".join(f"{p:>20}" for p in phases))
    for run in runs:
        cells = []
        for phase in phases:
            stats = run["report"]["phases"][phase]
            cells.append(f"{stats['p50_us']:>9.1f} ({stats.get('ratio_to_floor') or 0:.2f}x)".rjust(20))
        print(f"{run['name']:<12}" + "".join(cells))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f, indent=1)


if __name__ == "__main__":
    main()
