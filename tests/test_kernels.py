"""Tests of mooncake_ep.kernels (compile, digest, cache) and of ``python -m mooncake_ep warmup``. CPU only.

NVRTC runs here through cuda.bindings with no GPU. Each kernel variant is compiled once per session:
the ``warm`` fixture runs the warm-up command on an empty folder, which is both the CI guard that
every variant compiles without an NVRTC error or warning and the cold half of the warm-up test;
the other tests reuse its cubins, or stand in for the compiler where only the cache is under test.
No assertion is about elapsed time; the process limit only turns a hang into a failure.
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import fcntl
import hashlib
import json
import mmap
import os
import stat
import re
import shutil
import struct
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest

import _threads
import mooncake_ep
from mooncake_ep import cli, kernels

REPO_ROOT = Path(__file__).resolve().parents[1]
# Safety net for a command that hangs (a bug): the test fails instead of stalling CI.
PROCESS_LIMIT_S = 300.0
ARCH = "sm_90"
SUMMARY_RE = re.compile(r"compiled (\d+), loaded from cache (\d+), failed (\d+)")
ELF_MAGIC = b"\x7fELF"


def _nvrtc_error() -> str | None:
    """Why NVRTC's tests skip: cuda-python is not installed. An installed one whose NVRTC does not
    load (no libnvrtc, a broken install) is not a reason: those tests then fail with its error, so
    a CI that installs the cuda extra cannot lose the sm_90 compile checks to a silent skip."""
    try:
        import cuda.bindings  # noqa: F401
    except ImportError as exc:
        return f"{type(exc).__name__}: {exc} (install mooncake_ep[cuda12] or [cuda13])"
    return None


NVRTC_ERROR = _nvrtc_error()
needs_nvrtc = pytest.mark.skipif(NVRTC_ERROR is not None, reason=f"cuda-python is not installed: {NVRTC_ERROR}")


@pytest.fixture(autouse=True)
def fresh_cache_state(monkeypatch):
    """What kernels.py remembers per process of its cache folders (cubins it could not save, folders
    it warned of or swept), fresh for each test: one test's could answer another's."""
    monkeypatch.setattr(kernels, "_unsaved_cubins", {})
    monkeypatch.setattr(kernels, "_logged_cache_dirs", set())
    monkeypatch.setattr(kernels, "_swept_cache_dirs", set())


def all_keys() -> list[kernels.KernelKey]:
    """Every variant the library produces for ARCH: what one Buffer loads, at either memory scope."""
    return [key for sys_scope in (True, False) for key in kernels.low_latency_keys(ARCH, sys_scope)]


def run_cli(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mooncake_ep", *argv], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=PROCESS_LIMIT_S, env=env)


def summary(proc: subprocess.CompletedProcess) -> tuple[int, int, int]:
    """(compiled, loaded from cache, failed) of a warm-up's last summary line."""
    found = SUMMARY_RE.findall(proc.stdout)
    assert found, proc.stdout + proc.stderr
    return tuple(int(n) for n in found[-1])


@dataclasses.dataclass(frozen=True)
class Warm:
    cache_dir: Path
    cold: subprocess.CompletedProcess  # the first warm-up, on an empty folder
    report: dict  # its --json summary
    env: dict  # MOONCAKE_EP_CACHE_DIR points into the test's folders, never at the user's cache


@pytest.fixture(scope="module")
def warm(tmp_path_factory) -> Warm:
    """A cache warmed by ``python -m mooncake_ep warmup --arch sm_90`` (both scopes), compiled from nothing."""
    if NVRTC_ERROR is not None:
        pytest.skip(f"cuda-python is not installed: {NVRTC_ERROR}")
    root = tmp_path_factory.mktemp("warm")
    cache_dir = root / "cache"
    env = os.environ | {"MOONCAKE_EP_CACHE_DIR": str(root / "unused-default")}
    proc = run_cli("warmup", "--arch", ARCH, "--cache-dir", str(cache_dir), "--json", str(root / "cold.json"),
                   env=env)
    report = json.loads((root / "cold.json").read_text()) if (root / "cold.json").exists() else {}
    return Warm(cache_dir, proc, report, env)


def cubin_of(warm: Warm, key: kernels.KernelKey) -> bytes:
    cubin = kernels.KernelCache(warm.cache_dir).load(key.digest)
    assert cubin is not None, f"{key} is not in the warmed cache"
    return cubin


# --- (a) every variant compiles: the CI guard of the kernel sources --------------------------------


@needs_nvrtc
@pytest.mark.parametrize("arch", ["sm_75", "sm_80"])
def test_every_variant_compiles_for_older_gpus(arch):
    """Hopper-era cache hints (the 256-byte L2 fetch size) fall back below sm_80: a Buffer on a T4 or
    an A100 must still build. (sm_70 is refused by validate_arch: NVRTC 12 warns on every compile
    that it is deprecated, compile_kernel refuses any warning, and CUDA 13 dropped it.)"""
    for key in kernels.low_latency_keys(arch, sys_scope=True):
        assert kernels.compile_kernel(key)[:4] == ELF_MAGIC, key


@needs_nvrtc
def test_every_variant_compiles_without_error_or_warning(warm):
    # compile_kernel raises KernelCompileError on an NVRTC error and on any warning in the log.
    failures = [f"{k['file']} {k['macros']}:\n{k['log']}" for k in warm.report.get("kernels", [])
                if k["status"] == "failed"]
    assert not failures, "\n\n".join(failures)
    assert warm.cold.returncode == 0, warm.cold.stdout + warm.cold.stderr
    keys = all_keys()
    assert len({key.digest for key in keys}) == len(keys) == 2 * (len(kernels.DISPATCH_MODES) + 1)
    assert summary(warm.cold) == (len(keys), 0, 0)
    assert sorted(k["digest"] for k in warm.report["kernels"]) == sorted(key.digest for key in keys)
    for key in keys:
        assert cubin_of(warm, key).startswith(ELF_MAGIC), key


# An experiment switch in a kernel source: off by default, turned on by ab_kernels or
# MOONCAKE_EP_TEST_MACROS in a device session.
EXPERIMENT_SWITCH_RE = re.compile(r"^#ifndef (EP_\w+)\n#define \1 0 +// experiment", re.MULTILINE)
# Any macro a kernel source defaults to 0, whatever its comment: a switch or a diagnostic.
DEFAULT_OFF_RE = re.compile(r"^#ifndef (EP_\w+)\n#define \1 0\b", re.MULTILINE)
# Macros defaulting to 0 that are no experiment, and what turns them on instead.
NON_EXPERIMENT_SWITCHES = {"EP_TRACE": "scripts/trace_phases.py (phase timestamps)"}


@needs_nvrtc
def test_every_experiment_switch_compiles_when_turned_on():
    """A switch left off in the library's builds must still compile when a later session turns it on
    for an A/B: every variant of its kernel, with the switch at 1.

    The sources may hold no switch (they hold none between experiments), and the test then compiles
    nothing; it runs all the same, rather than skip, and checks what would make it pass
    for nothing with switches present: the scan reaches the headers, and every macro the sources
    default to 0 is a switch the pattern reads (one whose comment is spelled otherwise would go
    unchecked) or a known diagnostic (NON_EXPERIMENT_SWITCHES)."""
    # The pattern is the one the sources use (a switch it missed would go unchecked).
    assert EXPERIMENT_SWITCH_RE.findall("#ifndef EP_X\n#define EP_X 0  // experiment: why\n") == ["EP_X"]
    keys = kernels.low_latency_keys(ARCH, sys_scope=True)
    closures = {key: kernels._source_closure(key.file) for key in keys}  # the kernel's file and its headers
    sources = {name: kernels._read_source(name) for names in closures.values() for name in names}
    assert {"ll_dispatch.cu", "ll_combine.cu", "trace.cuh"} <= set(sources), sorted(sources)
    default_off = {macro for text in sources.values() for macro in DEFAULT_OFF_RE.findall(text)}
    all_switches = {switch for text in sources.values() for switch in EXPERIMENT_SWITCH_RE.findall(text)}
    unread = sorted(default_off - all_switches - set(NON_EXPERIMENT_SWITCHES))
    assert not unread, (f"{unread} default to 0 but are not written as experiment switches "
                        f"('#define EP_X 0  // experiment: why'), nor listed in NON_EXPERIMENT_SWITCHES")
    assert set(NON_EXPERIMENT_SWITCHES) <= default_off, "NON_EXPERIMENT_SWITCHES names a macro the sources lost"
    assert not all_switches & set(NON_EXPERIMENT_SWITCHES)
    for key in keys:
        switches = {switch for name in closures[key] for switch in EXPERIMENT_SWITCH_RE.findall(sources[name])}
        for switch in sorted(switches):
            on = dataclasses.replace(key, macros=tuple(sorted((*key.macros, (switch, "1")))))
            assert kernels.compile_kernel(on)[:4] == ELF_MAGIC, on


# --- (b) the digest covers everything that changes the binary -------------------------------------


@pytest.fixture
def read_source():
    """The real source reader, its memo cleared around the test so an edited text leaks into no other test."""
    original = kernels._read_source
    original.cache_clear()
    yield original
    original.cache_clear()


# C parameter type -> the Launcher's struct code (ints, 64-bit ints, and every pointer).
_PARAM_CODES = {"int": "i", "long long": "q"}


def _entry_point_codes(file: str, name: str) -> str:
    """The struct codes of an ``extern "C"`` entry point's parameters, read from its source."""
    source = kernels._read_source(file)
    match = re.search(rf"\b{name}\(([^)]*)\)\s*{{", source)
    assert match, f"{name} not found in {file}"
    codes = []
    for param in match.group(1).split(","):
        declaration = re.sub(r"\b(const|__restrict__)\b", " ", param).strip()
        if "*" in declaration:
            codes.append("Q")
        else:
            type_name = " ".join(declaration.split()[:-1])
            assert type_name in _PARAM_CODES, f"{name}: no launch code for parameter {param.strip()!r}"
            codes.append(_PARAM_CODES[type_name])
    return "".join(codes)


@pytest.mark.parametrize("file, name, fmt", [("ll_dispatch.cu", "ll_dispatch", kernels.DISPATCH_ARG_FORMAT),
                                             ("ll_combine.cu", "ll_combine", kernels.COMBINE_ARG_FORMAT)])
def test_launch_formats_match_the_kernel_signatures(file, name, fmt):
    """The Launcher packs what the kernel declares: a wrong slot would pass garbage, never fail loudly."""
    assert _entry_point_codes(file, name) == fmt


def test_launcher_packs_one_8_byte_slot_per_parameter_and_launches_through_the_pointer_array():
    """A Launcher of a function loaded elsewhere (the path every Launcher's packing shares): the
    struct codes land in their slots, and the driver gets the function, grid, block and the slots."""
    pytest.importorskip("cupy_backends.cuda.api.driver")
    launcher = kernels.Launcher.for_function(types.SimpleNamespace(ptr=0x1234), "k", "iQq", num_threads=64)
    launches = []
    launcher._launch = lambda *args: launches.append(args)
    launcher(3, (7, 2**40, -3), 5)
    assert bytes(launcher._slots) == struct.pack("<i4xQq", 7, 2**40, -3)
    assert launches == [(0x1234, 3, 1, 1, 64, 1, 1, 0, 5, launcher._pointers_address, 0)]
    slot_addresses = [ctypes.cast(launcher._pointers, ctypes.POINTER(ctypes.c_void_p))[i] for i in range(3)]
    assert slot_addresses == [ctypes.addressof(launcher._slots) + 8 * i for i in range(3)]


def test_launchers_use_the_block_size_their_kernels_were_built_for(monkeypatch):
    """A kernel built with another EP_NUM_THREADS (an ab_kernels variant) is launched with blocks of
    that size: its __launch_bounds__ and its warps' roles assume it."""
    cupy = pytest.importorskip("cupy")
    original = kernels._common_macros
    monkeypatch.setattr(kernels, "_common_macros", lambda sys_scope: original(sys_scope) | {"EP_NUM_THREADS": 256})
    built = []
    monkeypatch.setattr(kernels, "get_cubin",
                        lambda key, cache=None, cancelled=None: (built.append(key) or key.digest.encode(), False))
    monkeypatch.setattr(kernels, "_loaded_function", lambda cubin, name, device_id: types.SimpleNamespace(ptr=1))
    monkeypatch.setattr(cupy.cuda.runtime, "getDevice", lambda: 0)
    launchers = kernels.load_low_latency_kernels("sm_90")
    assert len(built) == len(launchers) and all(dict(key.macros)["EP_NUM_THREADS"] == "256" for key in built)
    assert {launcher.num_threads for launcher in launchers.values()} == {256}
    assert kernels.NUM_THREADS != 256  # the library's own size is not what the launchers got


@pytest.mark.parametrize("arg_format", ["", "iQx"])
def test_launcher_refuses_an_unknown_parameter_code(arg_format):
    pytest.importorskip("cupy_backends.cuda.api.driver")
    with pytest.raises(ValueError, match="arg_format must be codes among"):
        kernels.Launcher.for_function(types.SimpleNamespace(ptr=1), "k", arg_format)


@needs_nvrtc
def test_digest_is_stable_and_distinct_per_variant():
    assert [key.digest for key in all_keys()] == [key.digest for key in all_keys()]  # new objects, same digests
    assert len({key.digest for key in all_keys()}) == len(all_keys())
    base = kernels.dispatch_key(ARCH, False, False, False)
    assert kernels.KernelKey.make(base.file, base.name, dict(base.macros), ARCH).digest == base.digest


@needs_nvrtc
@pytest.mark.parametrize("change", ["macro value", "extra macro", "scope", "arch", "arch suffix"])
def test_digest_changes_with_macros_and_arch(change):
    base = kernels.dispatch_key(ARCH, True, False, False)
    macros = dict(base.macros)
    if change == "macro value":
        other = kernels.dispatch_key(ARCH, True, True, False)
    elif change == "extra macro":
        other = kernels.KernelKey.make(base.file, base.name, macros | {"EP_EXTRA": 1}, ARCH)
    elif change == "scope":
        other = kernels.dispatch_key(ARCH, True, False, False, sys_scope=False)
    elif change == "arch":
        other = kernels.dispatch_key("sm_80", True, False, False)
    else:
        other = kernels.dispatch_key("sm_90a", True, False, False)
    assert other.digest != base.digest


@needs_nvrtc
# The .cu itself, a header it includes, and a header included only through other headers.
@pytest.mark.parametrize("edited", ["ll_dispatch.cu", "signal.cuh", "types.cuh"])
def test_digest_changes_when_a_source_changes(edited, read_source, monkeypatch):
    before = kernels.dispatch_key(ARCH, False, False, False).digest
    combine_before = kernels.combine_key(ARCH).digest

    def edited_source(name: str) -> str:
        return read_source(name) + ("\n// edited\n" if name == edited else "")

    monkeypatch.setattr(kernels, "_read_source", edited_source)
    assert kernels.dispatch_key(ARCH, False, False, False).digest != before
    # types.cuh and signal.cuh are included (directly or not) by ll_combine.cu as well.
    assert kernels.combine_key(ARCH).digest != combine_before or edited == "ll_dispatch.cu"


@needs_nvrtc
def test_digest_changes_with_the_cuda_headers_found(tmp_path, monkeypatch):
    """cuda_bf16.h and cuda_fp8.h come from a wheel or toolkit of their own version: another copy on the
    include path is another binary (the first folder holding a header is the one NVRTC reads)."""
    first, second = tmp_path / "first", tmp_path / "second"
    for folder, text in ((first, "// bf16 v1\n"), (second, "// bf16 v2\n")):
        folder.mkdir()
        (folder / "cuda_bf16.h").write_text(text)

    def digest(*folders) -> str:
        monkeypatch.setattr(kernels, "_include_dirs", lambda: tuple(str(f) for f in folders))
        kernels._cuda_headers_digest.cache_clear()
        return kernels.combine_key(ARCH).digest
    try:
        assert digest(first, second) != digest(second, first)
        assert digest(first, second) == digest(first)  # a header found later is not read
        unpatched = digest(first)
        (first / "cuda_bf16.h").write_text("// bf16 v1, patched\n")
        assert digest(first) != unpatched
    finally:
        monkeypatch.undo()
        kernels._cuda_headers_digest.cache_clear()


@needs_nvrtc
def test_digest_changes_with_nvrtc_and_library_version(monkeypatch):
    before = kernels.combine_key(ARCH).digest
    monkeypatch.setattr(kernels, "nvrtc_version", lambda: (99, 0))
    assert kernels.combine_key(ARCH).digest != before
    monkeypatch.undo()
    monkeypatch.setattr(mooncake_ep, "__version__", "0.0.0-test")
    assert kernels.combine_key(ARCH).digest != before


@needs_nvrtc
def test_digest_changes_with_the_nvrtc_build_of_one_version(monkeypatch):
    """Patch releases of one minor version compile the same source differently: the loaded library's
    build is part of the key, not only nvrtcVersion's (major, minor)."""
    build = kernels.nvrtc_build()
    if os.path.exists("/proc/self/maps"):  # the loaded library was found and read
        assert build not in ("", hashlib.sha256().hexdigest()), "no libnvrtc.so was read"
    before = kernels.combine_key(ARCH).digest
    monkeypatch.setattr(kernels, "nvrtc_build", lambda: "another build")
    assert kernels.combine_key(ARCH).digest != before


def builds_before_and_while_mapped(tmp_path, name: bytes) -> tuple[str, str]:
    """nvrtc_build() computed afresh, then again while a 4 KiB file ``name`` (under ``tmp_path``) is
    mapped into this process, listed in /proc/self/maps; the cached answer is cleared after."""
    path = os.path.join(os.fsencode(tmp_path), name)
    with open(path, "wb") as f:
        f.write(b"\0" * 4096)
    try:
        kernels.nvrtc_build.cache_clear()
        before = kernels.nvrtc_build()
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 4096, access=mmap.ACCESS_READ):
            kernels.nvrtc_build.cache_clear()
            return before, kernels.nvrtc_build()
    finally:
        kernels.nvrtc_build.cache_clear()


@needs_nvrtc
def test_nvrtc_build_reads_maps_listing_paths_that_are_not_utf8(tmp_path, monkeypatch):
    """Without cuda.pathfinder the maps name the library: /proc/self/maps lists every mapped file of
    the process, whatever bytes its path holds."""
    monkeypatch.setitem(sys.modules, "cuda.pathfinder", None)  # import fails: the maps are read
    before, during = builds_before_and_while_mapped(tmp_path, b"\xff-mapped.bin")
    assert during == before


@needs_nvrtc
def test_nvrtc_build_names_only_the_library_cuda_bindings_compiles_with(tmp_path):
    """Another libnvrtc.so in the process (a framework's, of another CUDA major) does not change the
    key: the warm-up command, which loads no framework, and a server that does must agree on it."""
    pytest.importorskip("cuda.pathfinder")
    before, during = builds_before_and_while_mapped(tmp_path, b"libnvrtc.so.99")
    assert during == before


# --- (c) KernelCache: round trip, corrupt entries, atomic writes ----------------------------------

DIGEST = "ab" * 32


def entry_path(cache: kernels.KernelCache, digest: str = DIGEST) -> Path:
    (path,) = [p for p in cache.directory.iterdir() if p.name.startswith(digest)]
    return path


def temp_files(directory: Path) -> list[str]:
    return [p.name for p in directory.iterdir() if p.name.startswith(".tmp-")]


def test_cache_round_trip(tmp_path):
    cache = kernels.KernelCache(tmp_path / "new" / "folder")  # created on first save
    assert cache.load(DIGEST) is None
    payload = os.urandom(4096)
    cache.save(DIGEST, payload)
    assert cache.load(DIGEST) == payload
    cache.save(DIGEST, b"replaced")
    assert cache.load(DIGEST) == b"replaced"
    assert cache.load("cd" * 32) is None
    assert temp_files(cache.directory) == []
    # Another user (the server, after an image build warmed the cache) can read the entry.
    assert entry_path(cache).stat().st_mode & 0o044 == 0o044


def test_folders_the_cache_makes_are_reachable_by_other_users_whatever_the_umask(tmp_path):
    """A umask of 077 made them 0700: the 0644 entries of a cache warmed by one user (an image build)
    could not be reached by another (the server), which recompiled everything. Folders that exist
    keep their mode."""
    existing = tmp_path / "existing"
    existing.mkdir(mode=0o700)
    cache = kernels.KernelCache(existing / "new" / "folder")
    previous = os.umask(0o077)
    try:
        cache.save(DIGEST, b"cubin")
    finally:
        os.umask(previous)
    assert [oct(p.stat().st_mode & 0o777) for p in (existing, existing / "new", cache.directory)] == \
        ["0o700", "0o755", "0o755"]
    assert oct(entry_path(cache).stat().st_mode & 0o777) == "0o644"


def test_folders_the_cache_makes_keep_what_the_umask_and_a_setgid_parent_give(tmp_path):
    """The mode is only added to: a group-shared cache (umask 002, a setgid folder) keeps group
    write and the setgid bit, for the group's other users to add entries."""
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o2775)
    cache = kernels.KernelCache(shared / "kernels")
    previous = os.umask(0o002)
    try:
        cache.check_writable()
    finally:
        os.umask(previous)
    assert oct(stat.S_IMODE(cache.directory.stat().st_mode)) == "0o2775"


def _truncate_to_half(blob: bytes) -> bytes:
    return blob[: len(blob) // 2]


def _flip_payload_bit(blob: bytes) -> bytes:
    return blob[:100] + bytes([blob[100] ^ 0x01]) + blob[101:]


def _flip_checksum_bit(blob: bytes) -> bytes:
    return bytes([blob[0] ^ 0x80]) + blob[1:]


CORRUPTIONS = {
    "truncated": _truncate_to_half,
    "shorter than the checksum": lambda blob: blob[:10],
    "empty": lambda blob: b"",
    "payload bit flipped": _flip_payload_bit,
    "checksum bit flipped": _flip_checksum_bit,
    "extra bytes": lambda blob: blob + b"\0",
}


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_corrupt_entry_is_a_miss(corruption, tmp_path):
    cache = kernels.KernelCache(tmp_path)
    cache.save(DIGEST, os.urandom(1000))
    path = entry_path(cache)
    path.write_bytes(CORRUPTIONS[corruption](path.read_bytes()))
    assert cache.load(DIGEST) is None


@needs_nvrtc
@pytest.mark.parametrize("corruption", ["truncated", "payload bit flipped"])
def test_get_cubin_rebuilds_a_corrupt_entry(corruption, warm, tmp_path, monkeypatch):
    key = kernels.combine_key(ARCH)
    good = cubin_of(warm, key)
    cache = kernels.KernelCache(tmp_path)
    cache.save(key.digest, good)
    path = entry_path(cache, key.digest)
    path.write_bytes(CORRUPTIONS[corruption](path.read_bytes()))
    # The compiler is stood in for (the real one ran in `warm`): what is tested is that a corrupt
    # entry is never returned, is compiled again, and is replaced by a valid one.
    compiled = []
    monkeypatch.setattr(kernels, "compile_kernel", lambda k: compiled.append(k) or good)
    assert kernels.get_cubin(key, cache) == (good, True)
    assert compiled == [key]
    assert cache.load(key.digest) == good
    assert kernels.get_cubin(key, cache) == (good, False)
    assert compiled == [key]
    assert temp_files(tmp_path) == []


def test_failed_write_leaves_no_temp_file_and_keeps_the_old_entry(tmp_path, monkeypatch):
    cache = kernels.KernelCache(tmp_path)
    cache.save(DIGEST, b"old")

    def replace_fails(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(kernels.os, "replace", replace_fails)
    with pytest.raises(OSError, match="No space left") as info:
        cache.save(DIGEST, b"new")
    assert info.value.errno == 28  # the entry, the cause and the way out:
    assert str(entry_path(cache)) in str(info.value) and str(info.value).endswith("; pass a writable directory")
    monkeypatch.undo()
    assert temp_files(tmp_path) == []
    assert cache.load(DIGEST) == b"old"


@needs_nvrtc
def test_ranks_missing_an_entry_at_once_compile_it_once(tmp_path, monkeypatch):
    """Every rank of a job starting on a cold cache missed every entry and compiled it: 8 ranks, 40
    compiles for 5 entries (helper-132). The first to take the entry's lock compiles it; the others
    wait and load what it saved. (Threads here, each with its own cache object: flock locks an open
    file, so threads of one process exclude each other as processes do.)"""
    key = kernels.combine_key(ARCH)
    compiled = []

    def slow_compile(k):
        compiled.append(k)
        time.sleep(0.2)  # long enough for the other threads to miss the entry and queue on its lock
        return b"cubin of " + k.digest.encode()

    monkeypatch.setattr(kernels, "compile_kernel", slow_compile)
    results = _threads.run_in_threads([lambda: kernels.get_cubin(key, kernels.KernelCache(tmp_path))] * 4,
                                      PROCESS_LIMIT_S)
    assert compiled == [key]
    assert sorted(results) == [(b"cubin of " + key.digest.encode(), False)] * 3 + [
        (b"cubin of " + key.digest.encode(), True)]
    assert (tmp_path / f".{key.digest}.lock").exists() and temp_files(tmp_path) == []


@needs_nvrtc
def test_a_cubin_that_cannot_be_saved_is_kept_by_the_process(tmp_path, monkeypatch, caplog):
    """A cache folder that cannot be made (a file in its place; a home-less service account's) made
    every Buffer of the process compile every kernel again, with a warning per kernel each time."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    compiled = []
    monkeypatch.setattr(kernels, "compile_kernel", lambda k: compiled.append(k) or b"cubin of " + k.digest.encode())
    keys = [kernels.combine_key(ARCH), kernels.dispatch_key(ARCH, True, False, False)]
    for _ in range(2):  # two Buffers
        cache = kernels.KernelCache(blocker / "cache", name="kernel_cache_dir")
        results = [kernels.get_cubin(key, cache) for key in keys]
    assert compiled == keys and [compiled_now for _, compiled_now in results] == [False, False]
    warnings = [r.getMessage() for r in caplog.records if "could not cache" in r.getMessage()]
    assert len(warnings) == 1 and str(blocker / "cache") in warnings[0], warnings
    assert "pass a writable kernel_cache_dir" in warnings[0]


@needs_nvrtc
def test_ranks_that_waited_for_a_holder_that_left_no_entry_compile_beside_each_other(tmp_path, monkeypatch):
    """A holder whose compile failed (or, in another process, whose save did) leaves no entry: the
    ranks that waited for it compiled one after another under the lock, minutes for 8 ranks
    (helper-134); they compile at once, as without a lock."""
    key = kernels.combine_key(ARCH)
    spans = []

    def failing_compile(k):
        start = time.monotonic()
        time.sleep(0.3)
        spans.append((start, time.monotonic()))
        raise kernels.KernelCompileError(k, "error: stand-in")

    monkeypatch.setattr(kernels, "compile_kernel", failing_compile)
    results = _threads.run_in_threads([lambda: kernels.get_cubin(key, kernels.KernelCache(tmp_path))] * 4,
                                      PROCESS_LIMIT_S)
    assert all(isinstance(r, kernels.KernelCompileError) for r in results), results
    holder, *waiters = sorted(spans)
    assert all(start >= holder[1] for start, _ in waiters)  # they waited for the holder...
    assert max(start for start, _ in waiters) < min(end for _, end in waiters)  # ...then compiled together


@needs_nvrtc
def test_threads_that_waited_take_what_the_holder_could_not_save(tmp_path, monkeypatch):
    key = kernels.combine_key(ARCH)
    compiled = []

    def slow_compile(k):
        compiled.append(k)
        time.sleep(0.2)
        return b"cubin of " + k.digest.encode()

    def full_disk(self, digest, cubin):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(kernels, "compile_kernel", slow_compile)
    monkeypatch.setattr(kernels.KernelCache, "save", full_disk)
    results = _threads.run_in_threads([lambda: kernels.get_cubin(key, kernels.KernelCache(tmp_path))] * 4,
                                      PROCESS_LIMIT_S)
    assert compiled == [key] and sorted(flag for _, flag in results) == [False, False, False, True]


@needs_nvrtc
def test_a_cancelled_wait_for_another_holder_compiles_at_once(tmp_path, monkeypatch):
    """Ctrl-C in load_low_latency_kernels left its workers polling another holder's lock for minutes."""
    key = kernels.combine_key(ARCH)
    monkeypatch.setattr(kernels, "compile_kernel", lambda k: b"cubin")
    cancelled = threading.Event()
    cancelled.set()
    with kernels.KernelCache(tmp_path).compiling(key.digest) as waited:  # another holder, for good
        assert not waited
        assert kernels.get_cubin(key, kernels.KernelCache(tmp_path), cancelled) == (b"cubin", True)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
# The child only sleeps and exits: the fork-with-threads warnings (JAX's, Python's) do not apply.
@pytest.mark.filterwarnings("ignore:os.fork")
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded")
def test_a_process_forked_while_a_lock_is_held_does_not_keep_it(tmp_path):
    """A child forked mid-compile (a DataLoader's worker) shared the lock, and held it for its life."""
    cache = kernels.KernelCache(tmp_path)
    with cache.compiling(DIGEST):
        pid = os.fork()
        if pid == 0:  # the child: alive well past the parent's look below
            time.sleep(5)
            os._exit(0)
    gave_up = threading.Event()  # bounds the wait the test makes, should the child hold the lock
    timer = threading.Timer(3.0, gave_up.set)
    timer.start()
    try:
        start = time.monotonic()
        with kernels.KernelCache(tmp_path).compiling(DIGEST, gave_up):
            assert time.monotonic() - start < 2.0  # the child let go of it as it started, not as it exits
    finally:
        timer.cancel()
        os.kill(pid, 9)
        os.waitpid(pid, 0)


@needs_nvrtc
def test_nvrtc_build_takes_pathfinders_library_only_where_it_is_loaded(monkeypatch):
    """Bindings older than 12.9 load NVRTC themselves: pathfinder may name another file, whose
    build would then stand in the key for the one compiling."""
    kernels.nvrtc_version()
    mapped = kernels._loaded_nvrtc_paths()
    assert mapped, "no libnvrtc.so mapped"
    elsewhere = types.SimpleNamespace(abs_path="/nowhere/libnvrtc.so.99")
    monkeypatch.setitem(sys.modules, "cuda.pathfinder",
                        types.SimpleNamespace(load_nvidia_dynamic_lib=lambda name: elsewhere))
    assert b"/nowhere/libnvrtc.so.99" not in kernels._loaded_nvrtc_paths()


def test_save_removes_temp_files_left_by_killed_writers(tmp_path):
    """Only the warm-up command removed them; a Buffer's save now does too, once per folder and process."""
    stale, fresh = tmp_path / ".tmp-killed.cubin", tmp_path / ".tmp-writing.cubin"
    for path in (stale, fresh):
        path.write_bytes(b"partial")
    hours_ago = time.time() - 2 * kernels.KernelCache._STALE_TEMP_S
    os.utime(stale, (hours_ago, hours_ago))
    kernels.KernelCache(tmp_path).save(DIGEST, b"cubin")
    assert not stale.exists() and fresh.exists()


def test_prune_removes_other_entries_and_their_unheld_locks_only(tmp_path):
    """What is kept: the digests named, an entry whose lock some process holds (it is compiling it
    now) with that lock, files the cache did not name, and symlinks (not what they point to)."""
    cache = kernels.KernelCache(tmp_path)
    kept, old, busy, linked = DIGEST, "1" * 64, "2" * 64, "4" * 64
    for digest in (kept, old, busy):
        cache.save(digest, b"cubin " + digest.encode())
        (tmp_path / f".{digest}.lock").touch()
    foreign = [tmp_path / name for name in ("notes.txt", f"{old}.cubin.bak", f"{old[:63]}.cubin", ".tmp-x.cubin")]
    for path in foreign:
        path.write_bytes(b"not the cache's")
    target = tmp_path / "elsewhere.bin"
    target.write_bytes(b"x" * 1000)
    for name in (f"{linked}.cubin", f".{linked}.lock"):
        (tmp_path / name).symlink_to(target)
    holder = os.open(tmp_path / f".{busy}.lock", os.O_RDWR)
    try:
        fcntl.flock(holder, fcntl.LOCK_EX)  # a process of another version compiling that entry now
        result = cache.prune([kept])
    finally:
        os.close(holder)
    assert sorted(result.removed) == sorted([f"{old}.cubin", f".{old}.lock"])
    assert result.num_bytes == 32 + len(b"cubin ") + 64 and result.failed == ()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f"{kept}.cubin", f".{kept}.lock", f"{busy}.cubin", f".{busy}.lock", f"{linked}.cubin", f".{linked}.lock",
         target.name, *(p.name for p in foreign)])
    assert cache.load(kept) == b"cubin " + kept.encode() and target.read_bytes() == b"x" * 1000
    assert kernels.KernelCache(tmp_path / "missing").prune([]) == kernels.PruneResult((), 0, ())


@pytest.mark.parametrize("trouble", ["no locks on this file system", "another user's lock file"])
def test_prune_removes_locks_it_can_only_read_or_not_lock(trouble, tmp_path, monkeypatch):
    """A file system without locks (ENOLCK on some NFS mounts: nothing can hold one there either), and
    a lock file of another user (0644: opened for reading, which flock needs no more than)."""
    cache = kernels.KernelCache(tmp_path)
    cache.save("1" * 64, b"old")
    lock = tmp_path / f".{'1' * 64}.lock"
    lock.touch()
    if trouble == "no locks on this file system":
        def flock(fd, operation):
            raise OSError(errno.ENOLCK, "No locks available")

        monkeypatch.setattr(kernels.fcntl, "flock", flock)
    else:
        real_open = os.open

        def open_(path, flags, *args):
            if flags & os.O_RDWR and str(path) == str(lock):
                raise PermissionError(errno.EACCES, "Permission denied")
            return real_open(path, flags, *args)

        monkeypatch.setattr(kernels.os, "open", open_)
    result = cache.prune([DIGEST])
    assert result.failed == () and sorted(result.removed) == [f".{'1' * 64}.lock", f"{'1' * 64}.cubin"]
    assert list(tmp_path.iterdir()) == []


def test_kernel_cache_dir_is_expanded_made_absolute_and_never_empty(tmp_path, monkeypatch, caplog):
    """kernel_cache_dir="~/k" made a folder named ~ under the working directory, where
    MOONCAKE_EP_CACHE_DIR=~/k is expanded; "" was the working directory (helper-132)."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert kernels.KernelCache("~/k").directory == tmp_path / "home" / "k"
    monkeypatch.chdir(tmp_path)
    assert kernels.KernelCache("relative/k", name="kernel_cache_dir").directory == tmp_path / "relative" / "k"
    assert "kernel_cache_dir='relative/k' is relative" in caplog.text
    with pytest.raises(ValueError, match=r"^--cache-dir: the path is empty; name the kernel cache's directory$"):
        kernels.KernelCache("", name="--cache-dir")
    with pytest.raises(TypeError, match=r"^directory must be a str or os.PathLike, got int$"):
        kernels.KernelCache(5)
    group = mooncake_ep.LocalGroup(1).rank_group(0)
    with pytest.raises(ValueError, match=r"^Buffer: kernel_cache_dir: the path is empty"):
        mooncake_ep.Buffer(group, mooncake_ep.Buffer.get_ep_buffer_size_hint(4, 128, 1, 2), backend="reference",
                           kernel_cache_dir="")


@needs_nvrtc
def test_a_buffer_compiles_its_missing_kernels_at_once_and_loads_each_as_its_own(tmp_path, monkeypatch):
    """load_low_latency_kernels compiles the misses on worker threads (NVRTC releases the GIL: five
    compiles one after another were most of a cold Buffer's construction) and loads the modules
    on the calling thread, each launcher with its own kernel's cubin."""
    compiled_on = {}

    def compile_stub(key):
        compiled_on[key.digest] = threading.current_thread()
        return b"cubin of " + key.digest.encode()

    loaded = {}

    def launcher_stub(cubin, name, arg_format, num_threads):
        loaded[cubin] = (name, arg_format, num_threads, threading.current_thread())
        return cubin

    monkeypatch.setattr(kernels, "compile_kernel", compile_stub)
    monkeypatch.setattr(kernels, "Launcher", launcher_stub)
    launchers = kernels.load_low_latency_kernels(ARCH, kernels.KernelCache(tmp_path))
    keys = {kernels.dispatch_launcher_name(*mode): kernels.dispatch_key(ARCH, *mode) for mode in kernels.DISPATCH_MODES}
    keys["combine"] = kernels.combine_key(ARCH)
    assert launchers == {name: b"cubin of " + key.digest.encode() for name, key in keys.items()}
    assert set(compiled_on) == {key.digest for key in keys.values()}
    assert threading.main_thread() not in compiled_on.values()
    assert {loaded[launchers[name]][:3] for name in launchers} == {
        ("ll_dispatch", kernels.DISPATCH_ARG_FORMAT, kernels.NUM_THREADS),
        ("ll_combine", kernels.COMBINE_ARG_FORMAT, kernels.NUM_THREADS)}
    assert all(entry[3] is threading.main_thread() for entry in loaded.values())


def poll_entry(cache: kernels.KernelCache, payloads: list[bytes], writing) -> int:
    """Load the entry while ``writing()`` is true; return how many loads found it.

    With atomic renames the entry, once there, is always whole: a load never returns a torn file
    (the checksum would turn that into a miss) and never misses after a hit.
    """
    hits = 0
    while writing():
        loaded = cache.load(DIGEST)
        if loaded is None:
            assert hits == 0, "the entry was missing or torn after it had been written whole"
        else:
            assert loaded in payloads, "a load returned bytes no writer wrote"
            hits += 1
    return hits


def test_concurrent_threads_leave_a_whole_entry(tmp_path):
    cache = kernels.KernelCache(tmp_path)
    # Different lengths, so a file mixing two writers could not pass for either.
    payloads = [bytes([i]) * (100_000 + 1000 * i) for i in range(8)]
    start = threading.Barrier(len(payloads))
    errors = []

    def writer(payload: bytes) -> None:
        try:
            start.wait()
            for _ in range(50):
                cache.save(DIGEST, payload)
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(p,)) for p in payloads]
    for thread in threads:
        thread.start()
    poll_entry(cache, payloads, lambda: any(t.is_alive() for t in threads))
    for thread in threads:
        thread.join()
    assert not errors
    assert cache.load(DIGEST) in payloads
    assert temp_files(tmp_path) == []


_WRITER = """
import sys
from mooncake_ep.kernels import KernelCache
cache, index = KernelCache(sys.argv[1]), int(sys.argv[2])
payload = bytes([index]) * (150_000 + 1000 * index)
for _ in range(200):
    cache.save(sys.argv[3], payload)
"""


def test_concurrent_processes_never_expose_a_torn_entry(tmp_path):
    """Four ranks warming one cache at once, and a reader polling it throughout."""
    num_writers = 4
    payloads = [bytes([i]) * (150_000 + 1000 * i) for i in range(num_writers)]
    cache = kernels.KernelCache(tmp_path)
    writers = [subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path), str(i), DIGEST], cwd=REPO_ROOT,
                                stderr=subprocess.PIPE, text=True) for i in range(num_writers)]
    try:
        poll_entry(cache, payloads, lambda: any(w.poll() is None for w in writers))
    finally:
        for w in writers:
            w.wait(timeout=PROCESS_LIMIT_S)
    assert [w.returncode for w in writers] == [0] * num_writers, [w.stderr.read() for w in writers]
    assert cache.load(DIGEST) in payloads
    assert temp_files(tmp_path) == []


@pytest.mark.parametrize("where", ["under a file", "is a file"])
def test_check_writable_names_the_folder_and_the_variable(where, tmp_path, monkeypatch):
    """The remedy named is what chose the folder: the caller's argument, else the variable."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    directory = blocker / "cache" if where == "under a file" else blocker
    with pytest.raises(OSError) as info:
        kernels.KernelCache(directory, name="kernel_cache_dir").check_writable()
    assert str(directory) in str(info.value) and str(info.value).endswith("; pass a writable kernel_cache_dir")
    monkeypatch.setenv("MOONCAKE_EP_CACHE_DIR", str(directory))
    with pytest.raises(OSError) as info:
        kernels.KernelCache().check_writable()
    assert str(directory) in str(info.value) and str(info.value).endswith(
        "; set MOONCAKE_EP_CACHE_DIR to a writable folder")
    kernels.KernelCache(tmp_path / "x" / "y").check_writable()  # creates what is missing
    assert (tmp_path / "x" / "y").is_dir() and temp_files(tmp_path / "x" / "y") == []


def test_check_writable_removes_temp_files_left_by_killed_writers_only(tmp_path):
    cache = kernels.KernelCache(tmp_path)
    stale, fresh = tmp_path / ".tmp-killed.cubin", tmp_path / ".tmp-writing.cubin"
    for path in (stale, fresh):
        path.write_bytes(b"partial")
    long_ago = time.time() - 2 * kernels.KernelCache._STALE_TEMP_S
    os.utime(stale, (long_ago, long_ago))
    cache.check_writable()
    assert temp_files(tmp_path) == [fresh.name]  # a writer's file of now is left to its rename


def test_an_entry_that_is_no_regular_file_is_a_miss_and_never_waited_on(tmp_path):
    """A FIFO planted under an entry's name blocked every Buffer's construction in open(); a link was
    followed to whatever it names (helper-155)."""
    cache = kernels.KernelCache(tmp_path / "cache")
    cache.save("cd" * 32, b"a cubin")
    os.mkfifo(cache.directory / f"{DIGEST}.cubin")
    os.symlink(cache.directory / f"{'cd' * 32}.cubin", cache.directory / f"{'ef' * 32}.cubin")
    (results,) = _threads.run_in_threads([lambda: (cache.load(DIGEST), cache.load("ef" * 32),
                                                   cache.load("cd" * 32))], limit_s=30.0)
    assert results == (None, None, b"a cubin")


@pytest.mark.skipif(os.geteuid() != 0, reason="makes files of another user (needs root)")
def test_an_entry_another_user_could_have_planted_is_not_loaded(tmp_path, caplog):
    """A cubin runs in the process's CUDA context, and the checksum only finds damage: an entry of another
    user in a folder every user may write (another user made MOONCAKE_EP_CACHE_DIR=/tmp/kernels first),
    or one every user may rewrite, was loaded (helper-155). A group-shared cache trusts its group, and
    a cache an image's build user warmed is read by the server's user."""
    nobody = 65534
    for folder_mode, entry_mode, loaded in ((0o777, 0o644, False), (0o1777, 0o644, False), (0o755, 0o666, False),
                                            (0o2775, 0o664, True), (0o755, 0o644, True)):
        folder = tmp_path / f"cache-{folder_mode:o}-{entry_mode:o}"
        cache = kernels.KernelCache(folder)
        cache.save(DIGEST, b"a cubin")
        os.chmod(folder, folder_mode)
        os.chown(entry_path(cache), nobody, nobody)
        os.chmod(entry_path(cache), entry_mode)
        assert (cache.load(DIGEST) == b"a cubin") is loaded, (oct(folder_mode), oct(entry_mode))
        os.chown(entry_path(cache), os.geteuid(), os.getegid())  # this user's own entries load anywhere
        assert cache.load(DIGEST) == b"a cubin"
    assert "owned by uid 65534, in a folder every user may write" in caplog.text
    # Another user's folder, made first in a folder every user may write (as /tmp), 0755 (helper-157).
    public = tmp_path / "public"
    public.mkdir()
    os.chmod(public, 0o1777)
    cache = kernels.KernelCache(public / "kernels")
    cache.save(DIGEST, b"a planted cubin")
    os.chown(cache.directory, nobody, nobody)
    os.chown(entry_path(cache), nobody, nobody)
    assert cache.load(DIGEST) is None
    assert f"under {cache.directory}, a folder of uid 65534 in one every user may write" in caplog.text
    # A link to an entry is a miss, said so.
    os.symlink(entry_path(cache), tmp_path / f"{'ef' * 32}.cubin")
    assert kernels.KernelCache(tmp_path).load("ef" * 32) is None
    assert "(a symbolic link); compiling it instead" in caplog.text


def test_a_lock_file_that_is_a_link_or_a_fifo_is_not_used(tmp_path):
    """The lock file was opened through a link and made 0644 (a planted link made another file of this
    user readable by all), and a FIFO there blocked the open for good (helper-155): the entry is then
    compiled without the lock."""
    cache = kernels.KernelCache(tmp_path / "cache")
    cache.check_writable()
    private = tmp_path / "private"
    private.write_text("secret")
    os.chmod(private, 0o600)
    os.symlink(private, cache.directory / f".{DIGEST}.lock")
    os.mkfifo(cache.directory / f".{'cd' * 32}.lock")

    def lock_both():
        with cache.compiling(DIGEST) as waited, cache.compiling("cd" * 32) as waited_too:
            return waited, waited_too

    assert _threads.run_in_threads([lock_both], limit_s=30.0) == [(False, False)]
    assert stat.S_IMODE(private.stat().st_mode) == 0o600 and private.read_text() == "secret"


def test_the_default_cache_makes_a_missing_xdg_base_private(tmp_path, monkeypatch):
    """Only mooncake_ep's own folders are made readable by all: a missing ~/.cache is the user's, 0700
    as the XDG spec says (it was made 0755, listing every other program's cache: helper-155)."""
    monkeypatch.delenv("MOONCAKE_EP_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    cache = kernels.KernelCache()
    previous = os.umask(0o022)
    try:
        cache.check_writable()
    finally:
        os.umask(previous)
    modes = [oct(stat.S_IMODE(p.stat().st_mode)) for p in (tmp_path / "xdg", cache.directory.parent, cache.directory)]
    assert modes == ["0o700", "0o755", "0o755"]


def test_without_cuda_python_the_kernel_key_names_what_to_install(monkeypatch):
    """Every key holds the NVRTC version: a cupy installed without the package's CUDA extra failed Buffer
    construction, warm cache or not, with a bare ModuleNotFoundError (helper-155)."""
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)
    kernels.nvrtc_version.cache_clear()
    try:
        with pytest.raises(ImportError, match=r"mooncake_ep's CUDA kernels need cuda-python's NVRTC .*pip install "
                                              r"'mooncake_ep\[cuda12\]'"):
            kernels.combine_key(ARCH).digest
    finally:
        kernels.nvrtc_version.cache_clear()


@pytest.mark.parametrize("xdg", [None, "relative/cache"])
def test_default_cache_dir_is_absolute_and_private_without_a_home_folder(xdg, tmp_path, monkeypatch, caplog):
    monkeypatch.delenv("MOONCAKE_EP_CACHE_DIR", raising=False)
    monkeypatch.delenv("HOME", raising=False)
    if xdg is None:
        monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    else:  # the XDG spec: a relative XDG_CACHE_HOME is ignored
        monkeypatch.setenv("XDG_CACHE_HOME", xdg)
    monkeypatch.setattr(kernels.os.path, "expanduser", lambda path: path)  # a user id without a passwd entry
    monkeypatch.setattr(kernels.tempfile, "tempdir", str(tmp_path))
    directory = kernels.default_cache_dir()
    assert directory.is_absolute() and str(directory).startswith(str(tmp_path))
    private = directory.parents[1]  # <tmp>/mooncake_ep-<uid>: this user's, 0700
    assert private.stat().st_uid == os.getuid() and stat.S_IMODE(private.stat().st_mode) == 0o700
    # Another user's folder there (or one others can write) is not used: a fresh private one is, and
    # the warning says so (each process then compiles every kernel: helper-155).
    os.chmod(private, 0o777)
    other = kernels.default_cache_dir().parents[1]
    assert other != private and stat.S_IMODE(other.stat().st_mode) == 0o700
    assert f"{private} is not this user's private folder (owned by uid {os.getuid()}, mode 777)" in caplog.text
    # And the same one for every later lookup: each made a folder of its own, whose cubins no later
    # lookup found (a Buffer's five kernels compiled into five folders, at every construction).
    assert kernels.default_cache_dir().parents[1] == other
    monkeypatch.setenv("XDG_CACHE_HOME", "/xdg")
    assert kernels.default_cache_dir() == Path("/xdg/mooncake_ep/kernels")


def test_cache_dir_from_the_environment_is_expanded_and_a_relative_one_is_named(tmp_path, monkeypatch, caplog):
    """A container's or a unit's environment does not expand ~: MOONCAKE_EP_CACHE_DIR=~/k was a folder
    named ~ under whichever folder each process started in, so warm-up and server missed each other.
    Without a home folder to expand it to, the variable is ignored (helper-117: it was ./~/k); a
    relative value stays relative to the working directory, and says so."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("MOONCAKE_EP_CACHE_DIR", "~/k")
    assert kernels.default_cache_dir() == tmp_path / "home" / "k"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MOONCAKE_EP_CACHE_DIR", "relative/k")
    assert kernels.default_cache_dir() == tmp_path / "relative" / "k"
    assert "MOONCAKE_EP_CACHE_DIR='relative/k' is relative" in caplog.text
    monkeypatch.delenv("HOME")
    monkeypatch.setattr(kernels.os.path, "expanduser", lambda path: path)  # a user id without a passwd entry
    monkeypatch.setattr(kernels.tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setenv("MOONCAKE_EP_CACHE_DIR", "~/k")
    assert str(kernels.default_cache_dir()).startswith(str(tmp_path / "tmp"))
    assert "MOONCAKE_EP_CACHE_DIR='~/k' names a home folder this process does not have" in caplog.text


def test_a_buffers_kernels_share_one_cache(monkeypatch):
    """load_low_latency_kernels without a cache made one per kernel: without a home folder, five
    folders for one Buffer, every time."""
    caches = []
    monkeypatch.setattr(kernels, "get_cubin", lambda key, cache, cancelled: caches.append(cache) or (b"", False))
    monkeypatch.setattr(kernels, "Launcher", lambda *args, **kwargs: None)
    launchers = kernels.load_low_latency_kernels("sm_90")
    assert len(caches) == len(launchers) == 5 and isinstance(caches[0], kernels.KernelCache)
    assert all(cache is caches[0] for cache in caches)


def test_a_compile_error_crosses_to_another_process_whole():
    """RuntimeError's pickling passed the message alone, which __init__ refused: a compile error in a
    worker process broke its pool (and hung multiprocessing.Pool) instead of reaching the caller."""
    import pickle

    key = kernels.dispatch_key("sm_90", True, False, False)
    error = pickle.loads(pickle.dumps(kernels.KernelCompileError(key, "error: expected a ';'")))
    assert type(error) is kernels.KernelCompileError and error.key == key and error.log == "error: expected a ';'"
    assert str(error).startswith("NVRTC failed to compile ll_dispatch.cu for sm_90") and "expected a ';'" in str(error)


# --- kernels.warmup --------------------------------------------------------------------------------


@needs_nvrtc
def test_warmup_dedupes_and_loads_a_warm_cache(warm, monkeypatch):
    def no_compile(key):
        raise AssertionError(f"compiled {key} although the cache holds it")

    monkeypatch.setattr(kernels, "compile_kernel", no_compile)
    keys = all_keys()
    seen = []
    results = kernels.warmup(keys + keys[::-1], kernels.KernelCache(warm.cache_dir), num_workers=3,
                             progress=seen.append)
    assert [r.key.digest for r in results] == [k.digest for k in keys]
    assert {r.status for r in results} == {"cached"} and len(seen) == len(keys)


# --- (d) python -m mooncake_ep warmup --------------------------------------------------------------


@needs_nvrtc
def test_warmup_twice_compiles_nothing_the_second_time(warm):
    assert warm.cold.returncode == 0, warm.cold.stdout + warm.cold.stderr
    num_keys = len(all_keys())
    assert summary(warm.cold) == (num_keys, 0, 0)
    again = run_cli("warmup", "--arch", ARCH, "--cache-dir", str(warm.cache_dir), env=warm.env)
    assert again.returncode == 0, again.stdout + again.stderr
    assert summary(again) == (0, num_keys, 0)
    # The runtime path (what Buffer calls) finds every key the warm-up stored: same keys, same digests.
    cache = kernels.KernelCache(warm.cache_dir)
    for key in all_keys():
        cubin, compiled = kernels.get_cubin(key, cache)
        assert not compiled, key
        assert cubin.startswith(ELF_MAGIC)
    assert temp_files(warm.cache_dir) == []


@needs_nvrtc
def test_warmup_shapes_share_the_same_variants(warm, tmp_path):
    """Representative shapes (decode and prefill sizes, single GPU and multi-node) need no new kernels."""
    configs = [
        {"hidden": 7168, "topk": 8, "experts": 256, "ranks": 8, "tokens": 128, "fp8": True},
        {"hidden": 4096, "topk": 2, "experts": 8, "ranks": 8, "tokens": 512, "fp8": False},
        {"hidden": 2048, "topk": 6, "experts": 64, "ranks": 32, "tokens": 64},
        {"hidden": 128, "topk": 16, "experts": 1024, "ranks": 64, "tokens": 1},
        {"hidden": 1024, "topk": 4, "experts": 32, "ranks": 4, "tokens": 64, "single_gpu": True},
    ]
    config_path = tmp_path / "models.json"
    config_path.write_text(json.dumps(configs))
    proc = run_cli("warmup", "--arch", ARCH, "--cache-dir", str(warm.cache_dir), "--config", str(config_path),
                   "--json", str(tmp_path / "report.json"), env=warm.env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert summary(proc) == (0, len(all_keys()), 0)
    report = json.loads((tmp_path / "report.json").read_text())
    assert len(report["configurations"]) == len(configs)
    assert report["configurations"][-1]["sys_scopes"] == [False]
    assert {k["status"] for k in report["kernels"]} == {"cached"}


@needs_nvrtc
def test_warmup_single_scope_compiles_only_its_kernels(warm, tmp_path, capsys):
    assert cli.main(["warmup", "--arch", ARCH, "--cache-dir", str(warm.cache_dir), "--scope", "gpu",
                     "--json", str(tmp_path / "r.json")]) == 0
    report = json.loads((tmp_path / "r.json").read_text())
    expected = {key.digest for key in kernels.low_latency_keys(ARCH, sys_scope=False)}
    assert {k["digest"] for k in report["kernels"]} == expected
    assert SUMMARY_RE.search(capsys.readouterr().out).groups() == ("0", str(len(expected)), "0")


@needs_nvrtc
def test_warmup_prune_keeps_what_its_targets_load(warm, tmp_path, capsys):
    """--prune after a warm-up of one scope: the other scope's entries and an older version's go, the
    kept ones load; after a failed warm-up nothing is pruned."""
    cache_dir = tmp_path / "cache"
    shutil.copytree(warm.cache_dir, cache_dir)
    older = "3" * 64
    kernels.KernelCache(cache_dir).save(older, b"an older version's cubin")
    (cache_dir / f".{older}.lock").touch()
    (cache_dir / "README").write_text("the team's notes")
    argv = ["warmup", "--arch", ARCH, "--cache-dir", str(cache_dir), "--scope", "gpu", "--prune",
            "--json", str(tmp_path / "r.json")]
    assert cli.main(argv) == 0
    gpu_scope = {key.digest for key in kernels.low_latency_keys(ARCH, sys_scope=False)}
    sys_scope = {key.digest for key in kernels.low_latency_keys(ARCH, sys_scope=True)}
    assert {p.name[:-len(".cubin")] for p in cache_dir.glob("*.cubin")} == gpu_scope
    assert (cache_dir / "README").exists() and not (cache_dir / f".{older}.lock").exists()
    out = capsys.readouterr().out
    assert re.search(rf"^pruned {len(sys_scope) + 2} files \(", out, re.MULTILINE), out
    pruned = json.loads((tmp_path / "r.json").read_text())["pruned"]
    assert sorted(pruned["removed"]) == sorted([f"{older}.cubin", f".{older}.lock", *(f"{d}.cubin" for d in sys_scope)])

    def broken(key):
        raise kernels.KernelCompileError(key, "error: broken")

    kernels.KernelCache(cache_dir).save(older, b"an older version's cubin")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kernels, "compile_kernel", broken)
        assert cli.main(["warmup", "--arch", ARCH, "--cache-dir", str(cache_dir), "--scope", "sys", "--prune"]) == 1
    assert "--prune skipped" in capsys.readouterr().err
    assert (cache_dir / f"{older}.cubin").exists()

    # A file that cannot be removed (another user's, in a shared cache) fails the run, named.
    def refused(self, keep):
        return kernels.PruneResult((), 0, ((f"{older}.cubin", "Permission denied"),))

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kernels.KernelCache, "prune", refused)
        assert cli.main(argv) == 1
    assert f"--prune could not remove {cache_dir / older}.cubin: Permission denied" in capsys.readouterr().err
    assert json.loads((tmp_path / "r.json").read_text())["pruned"]["failed"] == [
        {"file": f"{older}.cubin", "error": "Permission denied"}]
    # A guess of the targets would drop the kernels of the cache's other machines.
    assert cli.main(["warmup", "--cache-dir", str(cache_dir), "--prune"]) == 2
    assert "not 'local'" in capsys.readouterr().err


@needs_nvrtc
def test_warmup_reports_a_compile_failure_with_its_log(tmp_path, monkeypatch, capsys):
    def broken(key):
        raise kernels.KernelCompileError(key, f'{key.file}(42): error: identifier "kBroken" is undefined')

    monkeypatch.setattr(kernels, "compile_kernel", broken)
    code = cli.main(["warmup", "--arch", ARCH, "--scope", "sys", "--cache-dir", str(tmp_path / "c"),
                     "--json", str(tmp_path / "r.json")])
    out, err = capsys.readouterr()
    assert code == 1
    num_keys = len(kernels.low_latency_keys(ARCH))
    assert SUMMARY_RE.search(out).groups() == ("0", "0", str(num_keys))
    assert 'll_dispatch.cu(42): error: identifier "kBroken" is undefined' in err
    assert "EP_USE_FP8" in err  # the message names the variant's macros
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["failed"] == num_keys and all("kBroken" in k["log"] for k in report["kernels"])
    assert not list((tmp_path / "c").glob("*.cubin"))


# --- (e) bad input: a clear message, a non-zero exit, nothing compiled -----------------------------


def _blocked(tmp_path: Path) -> Path:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    return blocker


@pytest.mark.parametrize("argv, message", [
    (["--arch", "sm_5x"], "'sm_5x'"),
    (["--arch", "garbage"], "'garbage'"),
    (["--arch", "sm_50"], "sm_75 or newer"),
    (["--arch", "sm_72"], "sm_75 or newer"),
    (["--arch", "sm_90,,sm_80"], "comma-separated"),
    (["--arch", "sm_90a"], "warm sm_90 instead of sm_90a"),  # no Buffer loads it
    # well formed, unknown to NVRTC: the list offered holds only what --arch takes (sm_75 on)
    pytest.param(["--arch", "sm_99"], "cannot compile for sm_99; it supports sm_75, ", marks=needs_nvrtc),
    (["--hidden", "1000"], "--hidden must be a multiple of 128, got 1000"),
    (["--experts", "100"], "--experts must be a multiple of --ranks=8, got 100"),
    (["--ranks", "128", "--experts", "256"], "--ranks must be <= 64"),
    (["--experts", "2048", "--ranks", "8"], "--experts must be <= 1024"),
    (["--topk", "17"], "--topk must be an int in [1, 16], got 17"),
    (["--topk", "0"], "--topk"),
    (["--tokens", "0"], "--tokens must be >= 1"),
    (["--jobs", "0"], "--jobs"),
])
def test_bad_flags_exit_2_naming_the_flag(argv, message, tmp_path, capsys):
    argv = ["--arch", ARCH, *argv] if "--arch" not in argv else argv
    assert cli.main(["warmup", "--cache-dir", str(tmp_path / "c"), *argv]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and message in err
    assert not (tmp_path / "c").exists() or not list((tmp_path / "c").iterdir())


@needs_nvrtc
@pytest.mark.parametrize("where", ["under a file", "is a file"])
def test_unwritable_cache_dir_is_refused_before_compiling(where, tmp_path, monkeypatch, capsys):
    blocker = _blocked(tmp_path)
    directory = blocker / "cache" if where == "under a file" else blocker
    monkeypatch.setattr(kernels, "compile_kernel", lambda key: pytest.fail("compiled before checking the cache"))
    assert cli.main(["warmup", "--arch", ARCH, "--cache-dir", str(directory)]) != 0
    err = capsys.readouterr().err
    assert str(directory) in err and "MOONCAKE_EP_CACHE_DIR" in err and "--cache-dir" in err


@pytest.mark.parametrize("text, message", [
    ('{"hidden": 7168, "topk": 8,}', "not valid JSON"),
    ("", "not valid JSON"),
    ("[]", "non-empty list of objects"),
    ("[1, 2]", "non-empty list of objects"),
    ('[{"hidden": 7168}, {"hiden": 4096}]', "configuration 1: unknown key 'hiden'"),
    ('{"hidden": 1000}', "hidden must be a multiple of 128, got 1000"),
    ('{"hidden": "7168"}', "hidden must be an int, got str"),
    ('{"experts": 100, "ranks": 8}', "experts must be a multiple of"),
    ('{"topk": 32}', "topk must be an int in [1, 16], got 32"),
    ('{"fp8": "yes"}', "fp8 must be true or false"),
    ('{"single_gpu": 1}', "single_gpu must be true or false"),
])
def test_bad_config_exits_2_naming_the_problem(text, message, tmp_path, capsys):
    config_path = tmp_path / "models.json"
    config_path.write_text(text)
    assert cli.main(["warmup", "--arch", ARCH, "--cache-dir", str(tmp_path / "c"), "--config", str(config_path)]) == 2
    err = capsys.readouterr().err
    assert str(config_path) in err and message in err


def test_config_file_in_utf16_is_read_and_one_not_text_is_named(tmp_path, capsys):
    """PowerShell's > writes UTF-16 with a byte-order mark: that raised a UnicodeDecodeError traceback
    (exit 1). It is JSON (json tells UTF-8, -16 and -32 apart); bytes that are none of them exit 2."""
    import argparse

    config_path = tmp_path / "models.json"
    config_path.write_text('{"hidden": 4096, "topk": 8, "experts": 256, "ranks": 8}', encoding="utf-16")
    parser = argparse.ArgumentParser()
    cli.warmup.add_arguments(parser)
    configs = cli.warmup.load_configs(parser.parse_args(["--arch", ARCH, "--config", str(config_path)]))
    assert [(config.hidden, config.topk) for config in configs] == [(4096, 8)]
    config_path.write_bytes(b"\xff{\"hidden\": 7168}")
    assert cli.main(["warmup", "--arch", ARCH, "--cache-dir", str(tmp_path / "c"), "--config", str(config_path)]) == 2
    assert "not UTF-8 (nor UTF-16/32) text" in capsys.readouterr().err


def test_missing_config_file_exits_2(tmp_path, capsys):
    assert cli.main(["warmup", "--arch", ARCH, "--config", str(tmp_path / "nope.json")]) == 2
    assert "nope.json: cannot read it" in capsys.readouterr().err


@needs_nvrtc
def test_bad_input_in_a_subprocess_exits_non_zero(tmp_path):
    """The real entry point: the message reaches stderr and the exit code the shell."""
    proc = run_cli("warmup", "--arch", ARCH, "--hidden", "1000", "--cache-dir", str(tmp_path / "c"))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "--hidden must be a multiple of 128, got 1000" in proc.stderr
    proc = run_cli("warmup", "--arch", "sm_5x", "--cache-dir", str(tmp_path / "c"))
    assert proc.returncode == 2 and "sm_5x" in proc.stderr


@needs_nvrtc
def test_compiling_in_process_leaves_the_interpreters_shared_bytes_intact():
    """NVRTC writes its log and cubin into the buffers it is handed. Handed bytes objects, it wrote an
    empty log's NUL into CPython's one cached b" " (what b" " * 1 returns), and every b" " of the
    process read b"\\0" after the first cold compile (seen as torn npz headers and torch schema
    parse errors in the GPU ipc tests)."""
    space = bytes([32])  # CPython's cached single-byte object: the one a write would have hit
    cubin = kernels.compile_kernel(kernels.combine_key(ARCH))
    assert isinstance(cubin, bytes) and cubin.startswith(ELF_MAGIC)
    assert space == b"\x20" and ord(b" ") == 32 and b"a b".split(b" ") == [b"a", b"b"]


def test_a_cache_miss_says_where_the_entry_was_looked_for(tmp_path, monkeypatch, caplog):
    """A warm-up on a machine whose key differs (another NVRTC build, other CUDA headers) left no trace
    but the compile's seconds (helper-155)."""
    import logging

    key = kernels.KernelKey("ll_combine.cu", "ll_combine", (), ARCH, ())
    monkeypatch.setattr(kernels.KernelKey, "digest", "cd" * 32)
    monkeypatch.setattr(kernels, "compile_kernel", lambda k: b"a cubin")
    cache = kernels.KernelCache(tmp_path)
    with caplog.at_level(logging.INFO, logger="mooncake_ep"):
        assert kernels.get_cubin(key, cache) == (b"a cubin", True)
        assert kernels.get_cubin(key, cache) == (b"a cubin", False)
    misses = [r.getMessage() for r in caplog.records if "compiling kernel" in r.getMessage()]
    assert misses == [f"mooncake_ep: compiling kernel ll_combine for {ARCH} (entry {'cd' * 8} not in the kernel "
                      f"cache {tmp_path})"]
