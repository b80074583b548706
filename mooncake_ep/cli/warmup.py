"""Compile every kernel a Buffer loads into the kernel cache ahead of time, so no Buffer waits for NVRTC.

A Buffer built on a cold cache compiles its kernels with NVRTC first (about half a second per
variant); with a warm cache it only loads them. Run this when building the image or the shared
cache volume, then point the servers at the same folder. It needs no GPU: name the targets.

    python -m mooncake_ep warmup --arch sm_90,sm_100 --cache-dir /models/mooncake_ep_kernels
    MOONCAKE_EP_CACHE_DIR=/models/mooncake_ep_kernels python serve.py

What is compiled: kernels are specialised only by dispatch mode (every Buffer loads all four: bf16,
fp8, fp8 with power-of-two scales, fp8 with UE8M0 scales; plus combine), by memory scope, and by
architecture. System scope ("sys") serves ranks on several GPUs or in several processes; GPU scope
("gpu") serves ranks that are all threads of one process on one GPU. Hidden size, top-k, experts,
ranks and tokens are run-time arguments: every shape uses the same 5 kernels per architecture and
scope, so the shapes given here are checked as a Buffer checks them, not compiled one by one.

Configurations come from the flags, or from --config FILE: a JSON object or a list of objects with
the keys hidden, topk, experts, ranks, tokens (a missing key takes its flag's value), and optionally
fp8 (bool; a Buffer loads both precisions, so it changes nothing compiled) and single_gpu (bool:
true = all ranks are threads of one process on one GPU, GPU scope only; false = system scope only;
absent = --scope).

The cache key holds the kernel sources, the NVRTC version and build, the CUDA headers NVRTC compiles
against (the nvidia-cuda-runtime wheel's, else CUDA_PATH's, CUDA_HOME's or /usr/local/cuda's) and
the mooncake_ep version: the machines that load the cache must have the same, or they compile again. Several processes may
warm one cache at once (each entry is written to a temporary file and renamed into place). Nothing
removes the entries of earlier versions (about 1 MB per version, architecture and scope) but
--prune, which keeps only what this warm-up's targets and scopes load (name every architecture the
cache serves; warm-ups of other targets running at the same time lose their entries to it):

    python -m mooncake_ep warmup --arch sm_90,sm_100 --cache-dir /models/mooncake_ep_kernels --prune

Exit codes: 0 every variant compiled or cached (and, with --prune, every other entry removed); 1 a
variant failed to compile (its NVRTC log is printed; nothing is pruned), NVRTC is missing, or a
pruned file could not be removed; 2 bad input (a shape, an architecture, the config file, the cache
folder).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import time
from pathlib import Path

import mooncake_ep
from mooncake_ep import kernels
from mooncake_ep.cli import EXIT_FAILURE, EXIT_OK, UsageError, check_output_path, write_json

logger = logging.getLogger("mooncake_ep")

# The decode shape of DeepSeek-V3 (7168 hidden, top-8 of 256 routed experts) on one 8-GPU node,
# with a decode batch of 128 tokens per rank.
DEFAULT_SHAPE = {"hidden": 7168, "topk": 8, "experts": 256, "ranks": 8, "tokens": 128}
# Threads compiling at once: NVRTC releases the GIL and uses one core per compile; a warm-up has
# at most a few dozen variants, and each compile holds a few hundred MB, so more buys nothing.
MAX_DEFAULT_JOBS = 16
# Memory scopes by --scope value; the bool is low_latency_keys' sys_scope.
SCOPES = {"both": (True, False), "sys": (True,), "gpu": (False,)}

_SHAPE_FIELDS = tuple(DEFAULT_SHAPE)
_FLAG_FIELDS = ("fp8", "single_gpu")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hidden", type=int, default=DEFAULT_SHAPE["hidden"], metavar="H",
                        help="hidden size, a multiple of 128")
    parser.add_argument("--topk", type=int, default=DEFAULT_SHAPE["topk"], metavar="K", help="experts per token")
    parser.add_argument("--experts", type=int, default=DEFAULT_SHAPE["experts"], metavar="N",
                        help="experts in all, a multiple of --ranks")
    parser.add_argument("--ranks", type=int, default=DEFAULT_SHAPE["ranks"], metavar="N",
                        help="ranks (GPUs) in the group")
    parser.add_argument("--tokens", type=int, default=DEFAULT_SHAPE["tokens"], metavar="T",
                        help="num_max_dispatch_tokens_per_rank")
    parser.add_argument("--config", metavar="PATH",
                        help="JSON file of configurations (an object or a list of objects) instead of the shape "
                             "flags; keys hidden, topk, experts, ranks, tokens, fp8, single_gpu")
    parser.add_argument("--arch", default="local", metavar="ARCHS",
                        help="comma-separated targets such as sm_80,sm_90,sm_100; 'local': the architecture of "
                             "each visible GPU (needs cupy)")
    parser.add_argument("--scope", choices=tuple(SCOPES), default="both",
                        help="memory scope: sys (ranks on several GPUs or processes), gpu (all ranks threads of "
                             "one process on one GPU), or both")
    # Resolved in run(), not here: the parser is built for --help too, and a home-less default made a folder.
    parser.add_argument("--cache-dir", metavar="DIR",
                        help="kernel cache folder; the default is $MOONCAKE_EP_CACHE_DIR when set, "
                             "else $XDG_CACHE_HOME/mooncake_ep/kernels, ~/.cache/mooncake_ep/kernels where that "
                             "is unset")
    parser.add_argument("--jobs", type=int, default=min(os.cpu_count() or 1, MAX_DEFAULT_JOBS), metavar="N",
                        help="kernels compiled at once")
    parser.add_argument("--prune", action="store_true",
                        help="after a warm-up without failures, remove the cache's other entries: those of other "
                             "mooncake_ep or NVRTC versions, and of architectures and scopes not named here (name "
                             "every target the cache serves in --arch; not with 'local')")
    parser.add_argument("--json", metavar="PATH", help="also write the summary as JSON here")


@dataclasses.dataclass(frozen=True)
class WarmupConfig:
    """One model configuration; ``sys_scopes`` are the memory scopes its Buffers use."""

    hidden: int
    topk: int
    experts: int
    ranks: int
    tokens: int
    fp8: bool | None
    sys_scopes: tuple[bool, ...]


# --- inputs -------------------------------------------------------------------------------------


def parse_archs(value: str) -> list[str]:
    """The targets of ``--arch``, in order, without repeats; ``local`` expands to the visible GPUs."""
    names = [name.strip() for name in value.split(",")]
    if not all(names):
        raise UsageError(f"--arch must be a comma-separated list like sm_80,sm_90, got {value!r}")
    archs: list[str] = []
    for name in names:
        found = _local_archs() if name == "local" else [name]
        for arch in found:
            try:
                kernels.validate_arch(arch)
            except ValueError as exc:
                raise UsageError(f"--arch: {exc}") from None
            if not arch[-1].isdigit():  # what no Buffer would load: the cache would stay cold
                raise UsageError(f"--arch: a Buffer loads the kernels of sm_XY, its device's compute capability, "
                                 f"never of a suffixed target; warm {arch.rstrip('abcdefghijklmnopqrstuvwxyz')} "
                                 f"instead of {arch}")
            if arch not in archs:
                archs.append(arch)
    return archs


def _local_archs() -> list[str]:
    """``sm_XY`` of each visible GPU, named as a Buffer names its device's architecture."""
    try:
        import cupy

        num_devices = cupy.cuda.runtime.getDeviceCount()
    except Exception:  # noqa: BLE001 - no cupy, no driver and no device raise different errors; all mean none
        num_devices = 0
    if num_devices == 0:
        raise UsageError("--arch local: no CUDA GPU is visible here; name the targets instead, "
                         "e.g. --arch sm_90 (sm_80: A100, sm_90: H100/H200, sm_100: B200)")
    return [f"sm_{cupy.cuda.Device(i).compute_capability}" for i in range(num_devices)]


def check_supported(archs: list[str]) -> None:
    """Refuse a well-formed name this NVRTC cannot target (``sm_99``), before compiling anything."""
    supported = kernels.supported_archs()
    for arch in archs:
        base = arch.rstrip("abcdefghijklmnopqrstuvwxyz")  # sm_90a compiles where sm_90 does
        if base not in supported:
            newer = [a for a in supported if int(a[3:]) >= kernels.MIN_ARCH]  # what --arch takes
            raise UsageError(f"--arch: NVRTC {'.'.join(map(str, kernels.nvrtc_version()))} cannot compile for "
                             f"{arch}; it supports {', '.join(newer)}")


def load_configs(args: argparse.Namespace) -> list[WarmupConfig]:
    """The configurations of ``--config``, else the one of the flags, each checked."""
    flag_values = {field: getattr(args, field) for field in _SHAPE_FIELDS}
    if args.config is None:
        return [_make_config(flag_values, SCOPES[args.scope], "", {f: f"--{f}" for f in _SHAPE_FIELDS})]
    where = f"--config {args.config}"
    try:
        raw = Path(args.config).read_bytes()
    except OSError as exc:
        raise UsageError(f"{where}: cannot read it: {exc.strerror or exc}") from None
    try:
        document = json.loads(raw)  # UTF-8, or UTF-16/32 (what PowerShell's > writes): json tells them apart
    except UnicodeDecodeError as exc:
        raise UsageError(f"{where}: not UTF-8 (nor UTF-16/32) text: {exc.reason} at byte {exc.start}") from None
    except json.JSONDecodeError as exc:
        raise UsageError(f"{where}: not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    entries = document if isinstance(document, list) else [document]
    if not entries or not all(isinstance(entry, dict) for entry in entries):
        raise UsageError(f"{where}: expected a JSON object or a non-empty list of objects with keys "
                         f"{', '.join(_SHAPE_FIELDS + _FLAG_FIELDS)}, got {json.dumps(document)[:80]!r}")
    configs = []
    for index, entry in enumerate(entries):
        here = f"{where}, configuration {index}" if isinstance(document, list) else where
        unknown = sorted(set(entry) - set(_SHAPE_FIELDS + _FLAG_FIELDS))
        if unknown:
            raise UsageError(f"{here}: unknown key {unknown[0]!r}; the keys are "
                             f"{', '.join(_SHAPE_FIELDS + _FLAG_FIELDS)}")
        for field in _FLAG_FIELDS:
            if field in entry and not isinstance(entry[field], bool):
                raise UsageError(f"{here}: {field} must be true or false, got {json.dumps(entry[field])}")
        if "single_gpu" in entry:
            sys_scopes = (not entry["single_gpu"],)
        else:
            sys_scopes = SCOPES[args.scope]
        names = {f: f if f in entry else f"--{f}" for f in _SHAPE_FIELDS}  # a missing key took the flag's value
        configs.append(_make_config(flag_values | entry, sys_scopes, f"{here}: ", names, entry.get("fp8")))
    return configs


# Buffer's argument names -> this command's field names, to translate its messages.
_BUFFER_NAMES = {"num_max_dispatch_tokens_per_rank": "tokens", "num_experts": "experts", "num_ranks": "ranks",
                 "hidden": "hidden"}


def _make_config(values: dict, sys_scopes: tuple[bool, ...], where: str, names: dict[str, str],
                 fp8: bool | None = None) -> WarmupConfig:
    """Check one configuration with the library's own rules and messages, each value named by its
    flag or config key (``names``), the message prefixed by ``where``."""
    config = WarmupConfig(*(values[f] for f in _SHAPE_FIELDS), fp8=fp8, sys_scopes=sys_scopes)
    try:
        mooncake_ep.Buffer.get_ep_buffer_size_hint(config.tokens, config.hidden, config.ranks, config.experts)
    except (TypeError, ValueError) as exc:
        message = str(exc).split(": ", 1)[-1]  # drop the "get_ep_buffer_size_hint: " of the library's call
        for buffer_name, field in _BUFFER_NAMES.items():
            if message.startswith(buffer_name + " "):
                message = f"{names[field]} {message[len(buffer_name) + 1:]}"
        message = message.replace("num_ranks=", f"{names['ranks']}=")
        raise UsageError(where + message) from None
    max_topk = kernels_max_topk()
    if isinstance(config.topk, bool) or not isinstance(config.topk, int) or not 1 <= config.topk <= max_topk:
        raise UsageError(f"{where}{names['topk']} must be an int in [1, {max_topk}], got {json.dumps(config.topk)}")
    return config


def kernels_max_topk() -> int:
    """The top-k bound the kernels are compiled with (EP_MAX_TOPK, the same for every arch and scope),
    which Buffer.dispatch enforces."""
    return int(dict(kernels.combine_key("sm_90").macros)["EP_MAX_TOPK"])


def check_cache_dir(cache: kernels.KernelCache) -> None:
    """Fail before compiling anything if the cache cannot take the results."""
    try:
        cache.check_writable()
    except OSError as exc:
        cause = exc.__cause__ or exc
        raise UsageError(f"--cache-dir: the kernel cache directory {cache.directory} is not writable ({cause}); "
                         f"pass a writable --cache-dir, or set MOONCAKE_EP_CACHE_DIR to one") from None


# --- the run ------------------------------------------------------------------------------------


def _describe(config: WarmupConfig) -> str:
    scopes = "+".join("sys" if s else "gpu" for s in config.sys_scopes)
    precision = {None: "bf16+fp8", True: "fp8", False: "bf16"}[config.fp8]
    return (f"hidden {config.hidden}, top-{config.topk} of {config.experts} experts, {config.ranks} ranks, "
            f"{config.tokens} tokens/rank, {precision}, {scopes} scope")


def _progress_bar(total: int):
    """A tqdm bar on stderr (hidden when stderr is not a terminal), or None without tqdm."""
    try:
        from tqdm import tqdm
    except ImportError:
        logger.info("mooncake_ep warmup: tqdm is not installed; no progress bar")
        return None
    return tqdm(total=total, desc="compiling", unit="kernel", file=sys.stderr, disable=None)


def run(args: argparse.Namespace) -> int:
    check_output_path("--json", args.json)
    if args.prune and "local" in (name.strip() for name in args.arch.split(",")):
        # A cache shared by machines of other GPUs would lose their kernels to this one's guess.
        raise UsageError("--prune keeps only the kernels of the targets named: name them all in --arch "
                         "(e.g. --arch sm_90,sm_100), not 'local'")
    configs = load_configs(args)
    archs = parse_archs(args.arch)
    if args.jobs < 1:
        raise UsageError(f"--jobs must be >= 1, got {args.jobs}")
    try:
        nvrtc = ".".join(map(str, kernels.nvrtc_version()))
    except (ImportError, OSError, RuntimeError) as exc:
        print(f"mooncake_ep warmup: NVRTC is not usable here ({exc}); install it with "
              f"pip install 'mooncake_ep[cuda12]' (or [cuda13])", file=sys.stderr)
        return EXIT_FAILURE
    check_supported(archs)
    try:  # "" (the working directory), a "~" with no home to expand to
        cache = kernels.KernelCache(args.cache_dir, name="--cache-dir")
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    check_cache_dir(cache)

    scopes = sorted({s for config in configs for s in config.sys_scopes}, reverse=True)  # sys first
    # Every configuration of one (arch, scope) loads the same kernels: shapes are run-time arguments.
    scope_of = {key.digest: sys_scope for arch in archs for sys_scope in scopes
                for key in kernels.low_latency_keys(arch, sys_scope)}
    keys = [key for arch in archs for sys_scope in scopes for key in kernels.low_latency_keys(arch, sys_scope)]
    num_variants = len(scope_of)
    for index, config in enumerate(configs):
        print(f"configuration {index}: {_describe(config)}")
    print(f"mooncake_ep warmup: {num_variants} kernel variants for {', '.join(archs)} "
          f"({'+'.join('sys' if s else 'gpu' for s in scopes)} scope), NVRTC {nvrtc}, cache {cache.directory}")
    sys.stdout.flush()

    bar = _progress_bar(num_variants)
    start = time.perf_counter()
    try:
        results = kernels.warmup(keys, cache, num_workers=args.jobs,
                                 progress=(lambda result: bar.update(1)) if bar is not None else None)
    except OSError as exc:  # a save failed after the writability check: the disk filled, or a permission changed
        print(f"mooncake_ep warmup: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    finally:
        if bar is not None:
            bar.close()
    elapsed_s = time.perf_counter() - start

    counts = {status: sum(r.status == status for r in results) for status in ("compiled", "cached", "failed")}
    failures = [r for r in results if r.status == "failed"]
    for result in failures:
        print(f"mooncake_ep warmup: {result.error}", file=sys.stderr)
    print(f"compiled {counts['compiled']}, loaded from cache {counts['cached']}, failed {counts['failed']} "
          f"in {elapsed_s:.2f} s")
    pruned = prune_report = None
    if args.prune and failures:
        prune_report = {"skipped": "a variant failed to compile"}
        print("mooncake_ep warmup: --prune skipped: a variant failed, so the cache does not hold all it needs",
              file=sys.stderr)
    elif args.prune:
        pruned = cache.prune(r.key.digest for r in results)
        prune_report = {"removed": list(pruned.removed), "num_bytes": pruned.num_bytes,
                        "failed": [{"file": name, "error": error} for name, error in pruned.failed]}
        print(f"pruned {len(pruned.removed)} files ({pruned.num_bytes / 1e6:.1f} MB) no target here uses")
        for name, error in pruned.failed:
            print(f"mooncake_ep warmup: --prune could not remove {cache.directory / name}: {error}", file=sys.stderr)
    if args.json:
        report = {
            "archs": archs,
            "cache_dir": str(cache.directory),
            "nvrtc": nvrtc,
            "mooncake_ep": mooncake_ep.__version__,
            "configurations": [dataclasses.asdict(c) for c in configs],
            "variants": num_variants,
            **counts,
            "elapsed_s": elapsed_s,
            "pruned": prune_report,  # null without --prune
            "kernels": [{"file": r.key.file, "name": r.key.name, "arch": r.key.arch,
                         "sys_scope": scope_of[r.key.digest], "macros": dict(r.key.macros),
                         "digest": r.key.digest, "status": r.status, "elapsed_s": r.elapsed_s,
                         "log": r.error.log if r.error is not None else None} for r in results],
        }
        write_json("--json", args.json, report)
    return EXIT_FAILURE if failures or (pruned is not None and pruned.failed) else EXIT_OK
