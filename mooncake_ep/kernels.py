"""Compile, cache and load the CUDA kernels of ``kernels_cu/``.

Split as cupy splits its kernel layer: :class:`KernelKey` names one specialisation and owns its
digest, :func:`compile_kernel` turns a key into a cubin with NVRTC (``cuda.bindings.nvrtc``, so it
runs on a machine without a GPU for any named architecture), :class:`KernelCache` stores cubins on
disk, :func:`warmup` fills that cache ahead of time, and :class:`Launcher` is a loaded function
with its launch settings. Everything a buffer needs is compiled and loaded when the buffer is
built, never inside a call: loading a module during graph capture breaks the capture.

The cache lives in ``$MOONCAKE_EP_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/mooncake_ep/kernels``
(``~/.cache/mooncake_ep/kernels`` where XDG_CACHE_HOME is unset).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import hashlib
import importlib.resources
import logging
import os
import re
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from mooncake_ep import _constants

try:
    import fcntl
except ImportError:  # not POSIX: compiles are not shared between processes (each compiles on a miss)
    fcntl = None

logger = logging.getLogger("mooncake_ep")

# Bump when the cache payload format or the compile recipe changes.
_CACHE_FORMAT = "v1"
# No fast math: the fp8 scale division must be correctly rounded to match reference.py.
_COMPILE_OPTIONS = ("-std=c++17", "-lineinfo")
_INCLUDE_RE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)
_ARCH_RE = re.compile(r"^sm_(\d{2,3})[a-z]?$")

# Threads per block of every kernel: 16 warps, enough vectors in flight per SM for a copy, and
# few enough registers for the fp8 path. A block scan and one waiting thread per rank fit in it.
NUM_THREADS = 512


class KernelCompileError(RuntimeError):
    """NVRTC rejected a kernel. Carries the file, macros, options and the compiler's log."""

    def __init__(self, key: KernelKey, log: str):
        self.key = key
        self.log = log
        super().__init__(
            f"NVRTC failed to compile {key.file} for {key.arch} with macros {dict(key.macros)} "
            f"and options {list(key.options)}:\n{log}"
        )

    def __reduce__(self):
        # Across processes (a rank's, a warm-up pool's) as it was raised: RuntimeError's own pickling
        # passes the message alone, which __init__ refuses, and a pool then broke instead of raising.
        return type(self), (self.key, self.log)


def kernel_source_dir() -> Path:
    """The folder holding the shipped ``.cu``/``.cuh`` sources."""
    return Path(str(importlib.resources.files("mooncake_ep.kernels_cu")))


@functools.lru_cache(maxsize=None)
def _read_source(name: str) -> str:
    return (kernel_source_dir() / name).read_text()


def kernel_sources() -> dict[str, str]:
    """Every shipped ``.cu``/``.cuh`` source by file name, as this process compiles them: each read
    once, so a file edited on disk afterwards changes neither the kernels nor what the ranks compare."""
    return {path.name: _read_source(path.name) for path in sorted(kernel_source_dir().iterdir())
            if path.suffix in (".cu", ".cuh")}


def _source_closure(name: str) -> list[str]:
    """The file and every local header it includes, transitively, in a stable order."""
    seen: list[str] = []
    pending = [name]
    while pending:
        current = pending.pop()
        if current in seen:
            continue
        seen.append(current)
        pending.extend(sorted(set(_INCLUDE_RE.findall(_read_source(current)))))
    return seen


# The oldest architecture built for. NVRTC 12.x warns that those before sm_75 are deprecated on
# every compile (compile_kernel refuses any warning) and CUDA 13 dropped them.
MIN_ARCH = 75


def validate_arch(arch: str) -> str:
    """Check an architecture name like ``sm_90``; return it."""
    if not isinstance(arch, str) or not _ARCH_RE.match(arch) or int(_ARCH_RE.match(arch).group(1)) < MIN_ARCH:
        raise ValueError(f"arch must name a CUDA architecture sm_{MIN_ARCH} or newer, like 'sm_90', got {arch!r}")
    return arch


@functools.lru_cache(maxsize=1)
def supported_archs() -> tuple[str, ...]:
    """The architectures the installed NVRTC compiles for, as ``sm_XX`` names, oldest first.

    :func:`validate_arch` checks only the form of a name; this is what this NVRTC accepts (an
    ``sm_90a``-style name is accepted when its ``sm_90`` is listed).
    """
    nvrtc = _nvrtc()

    result, archs = nvrtc.nvrtcGetSupportedArchs()
    _check_nvrtc(result, "nvrtcGetSupportedArchs")
    return tuple(f"sm_{int(a)}" for a in archs)


def _nvrtc():
    """cuda-python's NVRTC module; an ImportError that says what to install where it is missing (a
    cupy installed without the package's CUDA extra: even a warm cache needs it, for its keys)."""
    try:
        from cuda.bindings import nvrtc
    except ImportError as exc:
        raise ImportError(f"mooncake_ep's CUDA kernels need cuda-python's NVRTC (cuda.bindings: {exc}), to compile "
                          f"them and to name their kernel cache entries: pip install 'mooncake_ep[cuda12]' (or "
                          f"[cuda13]: the driver's CUDA major version)") from exc
    return nvrtc


@functools.lru_cache(maxsize=1)
def nvrtc_version() -> tuple[int, int]:
    """(major, minor) of the NVRTC library that :func:`compile_kernel` uses."""
    nvrtc = _nvrtc()

    result, major, minor = nvrtc.nvrtcVersion()
    _check_nvrtc(result, "nvrtcVersion")
    return int(major), int(minor)


# Bytes of each end of the NVRTC library that name its build: the ELF headers and build-id note lie at
# the front, and a rebuild moves the end.
_BUILD_SAMPLE_BYTES = 1 << 20


@functools.lru_cache(maxsize=1)
def nvrtc_build() -> str:
    """A hash naming the NVRTC library build this process loaded (a cache key part).

    :func:`nvrtc_version` gives (major, minor) only, and patch releases of one minor version compile
    the same source to different code. The loaded ``libnvrtc.so`` is named by its size and both ends
    of its bytes, which read in milliseconds where hashing the whole ~100 MB would take a tenth of a
    second; "" where it cannot be found (the version alone then).
    """
    nvrtc_version()  # loads the library
    paths = _loaded_nvrtc_paths()
    if paths is None:
        return ""
    digest, named = hashlib.sha256(), False
    for path in paths:
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                head = f.read(_BUILD_SAMPLE_BYTES)
                f.seek(max(size - _BUILD_SAMPLE_BYTES, 0))
                tail = f.read()
        except OSError as exc:  # unlinked or replaced since it was loaded: "(deleted)" in the maps
            logger.debug("could not read the loaded NVRTC library %r: %s", path, exc)
            continue
        digest.update(str(size).encode() + b"\0" + head + tail)
        named = True
    return digest.hexdigest() if named else ""


def _loaded_nvrtc_paths() -> list[bytes] | None:
    """The files of the NVRTC library that ``cuda.bindings`` compiles with: every ``libnvrtc.so*``
    mapped in this process (``/proc/self/maps``), or of these the one ``cuda.pathfinder`` names,
    which ``cuda.bindings`` (from 12.9) loads NVRTC through: a framework that loaded another NVRTC
    (another CUDA major) then changes nothing. Pathfinder's answer counts only where it is mapped:
    older bindings load NVRTC themselves, and pathfinder may name another file. None where the maps
    cannot be read."""
    try:
        with open("/proc/self/maps", "rb") as maps:  # bytes: other mapped files' paths need not be UTF-8
            mapped = sorted({line.split(maxsplit=5)[-1].strip() for line in maps
                             if os.path.basename(line.rstrip()).startswith(b"libnvrtc.so")})
    except OSError as exc:
        logger.debug("no /proc/self/maps to name the NVRTC build: %s", exc)
        return None
    try:
        from cuda.pathfinder import load_nvidia_dynamic_lib

        named = load_nvidia_dynamic_lib("nvrtc").abs_path
    except Exception as exc:  # noqa: BLE001 - any failure here leaves the maps to tell
        logger.debug("cuda.pathfinder does not name the NVRTC library: %s", exc)
        return mapped
    if named:
        real = os.path.realpath(os.fsencode(named))
        if real in {os.path.realpath(path) for path in mapped}:
            return [real]
    return mapped


@dataclasses.dataclass(frozen=True)
class KernelKey:
    """One specialisation of one kernel.

    Attributes:
        file: the ``.cu`` file in ``kernels_cu/``.
        name: the ``extern "C"`` entry point.
        macros: ``-D`` definitions, as sorted (name, value) pairs.
        arch: target architecture, e.g. ``sm_90``.
        options: extra NVRTC options.
    """

    file: str
    name: str
    macros: tuple[tuple[str, str], ...]
    arch: str
    options: tuple[str, ...] = _COMPILE_OPTIONS

    @classmethod
    def make(cls, file: str, name: str, macros: Mapping[str, object], arch: str) -> KernelKey:
        return cls(file, name, tuple(sorted((k, str(v)) for k, v in macros.items())), validate_arch(arch))

    def nvrtc_options(self) -> list[str]:
        return [*self.options, f"--gpu-architecture={self.arch}", *(f"-D{k}={v}" for k, v in self.macros)]

    @functools.cached_property
    def digest(self) -> str:
        """Hash of everything that changes the binary: sources (with headers), options, NVRTC, us."""
        from mooncake_ep import __version__

        digest = hashlib.sha256()
        for part in (_CACHE_FORMAT, __version__, repr(nvrtc_version()), nvrtc_build(), self.name,
                     *self.nvrtc_options(), _cuda_headers_digest()):
            digest.update(part.encode() + b"\0")
        for name in _source_closure(self.file):
            digest.update(name.encode() + b"\0" + _read_source(name).encode() + b"\0")
        return digest.hexdigest()


def _check_nvrtc(result, what: str) -> None:
    nvrtc = _nvrtc()

    if result != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise RuntimeError(f"{what} failed: {result}")


@functools.lru_cache(maxsize=1)
def _include_dirs() -> tuple[str, ...]:
    """Where cuda_bf16.h / cuda_fp8.h live: the CUDA runtime headers of a wheel or a toolkit."""
    dirs = [str(kernel_source_dir())]
    try:
        from cuda import pathfinder

        for lib in ("cudart", "nvrtc"):
            found = pathfinder.find_nvidia_header_directory(lib)
            if found:
                dirs.append(str(found))
    except (ImportError, AttributeError, RuntimeError) as exc:  # an older cuda-pathfinder, or none
        logger.debug("cuda.pathfinder found no CUDA headers: %s", exc)
    for root in (os.environ.get("CUDA_PATH"), os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if root and os.path.isfile(os.path.join(root, "include", "cuda_fp8.h")):
            dirs.append(os.path.join(root, "include"))
    return tuple(dict.fromkeys(dirs))


# The CUDA headers the kernels include from outside kernels_cu/ (cuda_bf16.h and cuda_fp8.h, and the
# fp16 and .hpp files they pull in; not vector_types.h and the like, which do not change code): they
# come from a wheel or a toolkit of their own version, beside NVRTC's.
_CUDA_HEADERS = ("cuda_bf16.h", "cuda_bf16.hpp", "cuda_fp16.h", "cuda_fp16.hpp", "cuda_fp8.h", "cuda_fp8.hpp")


@functools.lru_cache(maxsize=1)
def _cuda_headers_digest() -> str:
    """Hash of the CUDA headers NVRTC would find first on the include path (a cache key part)."""
    digest = hashlib.sha256()
    for header in _CUDA_HEADERS:
        for folder in _include_dirs():
            path = os.path.join(folder, header)
            if os.path.isfile(path):
                with open(path, "rb") as f:
                    digest.update(header.encode() + b"\0" + f.read() + b"\0")
                break
    return digest.hexdigest()


def compile_kernel(key: KernelKey) -> bytes:
    """Compile one specialisation to a cubin with NVRTC. Needs no GPU.

    Raises:
        KernelCompileError: NVRTC reported an error, or a warning (warnings are bugs here).
    """
    nvrtc = _nvrtc()

    sources = {name: _read_source(name) for name in _source_closure(key.file)}
    headers = [name for name in sources if name != key.file]
    result, program = nvrtc.nvrtcCreateProgram(
        sources[key.file].encode(),
        key.file.encode(),
        len(headers),
        [sources[h].encode() for h in headers],
        [h.encode() for h in headers],
    )
    _check_nvrtc(result, "nvrtcCreateProgram")
    try:
        options = [*key.nvrtc_options(), *(f"-I{d}" for d in _include_dirs())]
        (compile_result,) = nvrtc.nvrtcCompileProgram(program, len(options), [o.encode() for o in options])
        result, log_size = nvrtc.nvrtcGetProgramLogSize(program)
        _check_nvrtc(result, "nvrtcGetProgramLogSize")
        # NVRTC writes into the buffer it is given: a fresh bytearray, never a bytes object, which
        # is immutable and may be shared (b" " * 1 is CPython's one cached b" ", and an empty log
        # is one NUL: writing it there turned every b" " of the process into b"\0").
        log = bytearray(log_size)
        (result,) = nvrtc.nvrtcGetProgramLog(program, log)
        log_text = bytes(log).rstrip(b"\0 ").decode(errors="replace").strip()
        if compile_result != nvrtc.nvrtcResult.NVRTC_SUCCESS or "warning" in log_text:
            raise KernelCompileError(key, log_text or str(compile_result))
        result, cubin_size = nvrtc.nvrtcGetCUBINSize(program)
        _check_nvrtc(result, "nvrtcGetCUBINSize")
        cubin = bytearray(cubin_size)
        (result,) = nvrtc.nvrtcGetCUBIN(program, cubin)
        _check_nvrtc(result, "nvrtcGetCUBIN")
        return bytes(cubin)
    finally:
        nvrtc.nvrtcDestroyProgram(program)


def default_cache_dir() -> Path:
    """``$MOONCAKE_EP_CACHE_DIR``, else ``$XDG_CACHE_HOME/mooncake_ep/kernels`` (an absolute
    ``XDG_CACHE_HOME`` only, as the XDG spec says), else ``~/.cache/mooncake_ep/kernels``; where the
    home folder is unknown (no ``HOME``, a user id without a passwd entry: ``~`` stays ``~``), a
    folder of this user under the temporary directory, never one relative to the working directory.

    ``$MOONCAKE_EP_CACHE_DIR``'s ``~`` is expanded (a container's or a unit's environment leaves it as
    written); where there is no home folder to expand it to, the variable is ignored, with a warning.
    A relative value is taken from the working directory, with a warning: a warm-up and a server
    started in different folders would not share it."""
    configured = os.environ.get(_constants.CACHE_DIR_ENV)
    if configured:
        expanded = os.path.expanduser(configured)
        if expanded.startswith("~"):
            _warn_once(f"mooncake_ep: {_constants.CACHE_DIR_ENV}={configured!r} names a home folder this process "
                       f"does not have (no HOME, no passwd entry): ignored")
        else:
            if not os.path.isabs(expanded):
                _warn_once(f"mooncake_ep: {_constants.CACHE_DIR_ENV}={configured!r} is relative: the kernel cache "
                           f"is {os.path.abspath(expanded)}, under this process's working directory; set an "
                           f"absolute path to share it between processes started elsewhere")
            return Path(expanded).absolute()
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = xdg if os.path.isabs(xdg) else os.path.join(os.path.expanduser("~"), ".cache")
    if not os.path.isabs(base):
        base = _private_temp_folder()
        logger.info("mooncake_ep: no home folder; kernel cache under %s (set %s to choose)", base,
                    _constants.CACHE_DIR_ENV)
    return Path(base) / "mooncake_ep" / "kernels"


def _warn_once(message: str) -> None:
    """A warning logged once per process (a Buffer looks up its cache at every construction)."""
    if message not in _warned:
        _warned.add(message)
        logger.warning(message)


_warned: set[str] = set()


def resolve_cache_dir(directory: str | os.PathLike, name: str = "directory") -> Path:
    """``directory`` (an argument named ``name``) as a kernel cache folder: ``~`` expanded, made
    absolute. A relative path is taken from the working directory, with a warning (a warm-up and a
    server started in different folders would not share it).

    Raises:
        TypeError: not a str or path.
        ValueError: empty (the working directory), or a ``~`` this process has no home folder for.
    """
    if not isinstance(directory, (str, os.PathLike)):
        raise TypeError(f"{name} must be a str or os.PathLike, got {type(directory).__name__}")
    given = os.fspath(directory)
    if not isinstance(given, str):
        given = os.fsdecode(given)
    if not given:
        raise ValueError(f"{name}: the path is empty; name the kernel cache's directory")
    expanded = os.path.expanduser(given)
    if expanded.startswith("~"):
        raise ValueError(f"{name}={given!r} names a home folder this process does not have (no HOME, no passwd "
                         f"entry); pass an absolute path")
    if not os.path.isabs(expanded):
        _warn_once(f"mooncake_ep: {name}={given!r} is relative: the kernel cache is {os.path.abspath(expanded)}, "
                   f"under this process's working directory; pass an absolute path to share it between "
                   f"processes started elsewhere")
    return Path(expanded).absolute()


def _private_temp_folder() -> str:
    """This user's folder under the shared temporary directory, made 0700 if missing. Another user
    could make the folder first and plant cubins under their digests, which a Buffer would load and
    run: one not owned by this user, or writable by others, is not used; a fresh private folder
    (``mkdtemp``, this process's only) is, the same one for every later lookup (each made its own,
    and a process never found its own cubins again)."""
    user = os.getuid() if hasattr(os, "getuid") else os.getlogin()
    folder = os.path.join(tempfile.gettempdir(), f"mooncake_ep-{user}")
    try:
        os.mkdir(folder, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        logger.debug("could not make %s: %s", folder, exc)
    try:
        info = os.lstat(folder)
        if stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() and not info.st_mode & 0o022:
            return folder
    except (OSError, AttributeError):  # AttributeError: no os.getuid (not POSIX)
        pass
    with _fresh_temp_folders_lock:
        fresh = _fresh_temp_folders.get(folder)
        if fresh is None or not os.path.isdir(fresh):
            fresh = _fresh_temp_folders[folder] = tempfile.mkdtemp(prefix="mooncake_ep-")
    try:
        info = os.lstat(folder)
        found = f"owned by uid {info.st_uid}, mode {stat.S_IMODE(info.st_mode):o}"
    except OSError as exc:
        found = str(exc)
    _warn_once(f"mooncake_ep: no home folder, and {folder} is not this user's private folder ({found}): the "
               f"kernel cache is {fresh}, this process's alone, so every process compiles its kernels; set "
               f"{_constants.CACHE_DIR_ENV} to a folder of this user's")
    return fresh


# The shared folder _private_temp_folder refused -> the fresh one it made instead, in this process.
_fresh_temp_folders: dict[str, str] = {}
_fresh_temp_folders_lock = threading.Lock()


class KernelCache:
    """Cubins on disk, one file per digest: a SHA-256 of the payload, then the payload.

    Writes go to a temporary file in the same folder and are renamed into place, so concurrent
    writers (several ranks warming one cache) never expose a torn file; a file whose checksum does
    not match is a miss, rebuilt and replaced, never loaded.
    """

    _CHECKSUM_BYTES = 32
    # A cache warmed by one user (an image build) is read by another (the server), and a cubin is
    # no secret: entries, and the folders the cache makes, are readable by all whatever the umask.
    _CACHE_FILE_MODE = 0o644
    _CACHE_DIR_MODE = 0o755
    # How long a process waits for another compiling the same entry (:meth:`compiling`) before it
    # compiles the entry itself: a compile takes seconds, several at once on a loaded host tens.
    _COMPILE_WAIT_S = 300.0

    def __init__(self, directory: str | os.PathLike | None = None, *, name: str = "directory"):
        """Args:
            directory: the folder (default: :func:`default_cache_dir`); see :func:`resolve_cache_dir`.
            name: how errors name ``directory`` (the caller's argument: ``kernel_cache_dir``, ``--cache-dir``).
        """
        if directory is None:
            self.directory = default_cache_dir()
            self._remedy = f"set {_constants.CACHE_DIR_ENV} to a writable folder"
        else:
            self.directory = resolve_cache_dir(directory, name)
            self._remedy = f"pass a writable {name}"
        # The folders made readable by all (_make_directory): a folder named for the cache, and every
        # one made for it; of the default, only mooncake_ep's own (a missing ~/.cache is the user's,
        # made 0700 as the XDG spec says).
        default = directory is None and not os.environ.get(_constants.CACHE_DIR_ENV)
        self._shared_from = self.directory.parent if default else None

    def _path(self, digest: str) -> Path:
        return self.directory / f"{digest}.cubin"

    def _mkstemp(self) -> tuple[int, str]:
        """A new temporary file in the cache folder (created if missing), as ``(fd, path)``."""
        try:
            self._make_directory()
            return tempfile.mkstemp(dir=self.directory, prefix=".tmp-", suffix=".cubin")
        except OSError as exc:
            raise OSError(f"kernel cache directory {self.directory} is not writable ({exc}); {self._remedy}") from exc

    def _make_directory(self) -> None:
        """Create the folder and its missing parents, each with at least ``_CACHE_DIR_MODE`` (a umask of
        077 made them 0700, and the 0644 entries unreachable to other users); folders that exist stay
        as they are."""
        missing = []
        path = self.directory.absolute()
        while not path.is_dir() and path != path.parent:
            missing.append(path)
            path = path.parent
        for folder in reversed(missing):
            shared = self._shared_from is None or folder == self._shared_from or self._shared_from in folder.parents
            try:
                folder.mkdir(0o777 if shared else 0o700)
            except FileExistsError:  # another process made it meanwhile (or a file is there: mkstemp says)
                continue
            if shared:  # bits added, none taken: a umask of 002 keeps group write, a setgid parent its bit
                os.chmod(folder, stat.S_IMODE(folder.stat().st_mode) | self._CACHE_DIR_MODE)

    def check_writable(self) -> None:
        """Create the folder if it is missing and check that a file can be written in it.

        Raises:
            OSError: the folder cannot be created or written; the message names it and
                ``MOONCAKE_EP_CACHE_DIR``.
        """
        fd, tmp = self._mkstemp()
        os.close(fd)
        os.unlink(tmp)
        self._remove_stale_temp_files()

    # A writer renames its temporary file within milliseconds; one this old was left by a process
    # killed between the two (SIGKILL, the OOM killer), and nothing else would ever remove it.
    _STALE_TEMP_S = 3600

    def _remove_stale_temp_files(self) -> None:
        _swept_cache_dirs.add(self.directory)
        deadline = time.time() - self._STALE_TEMP_S
        for path in self.directory.glob(".tmp-*.cubin"):
            try:
                if path.stat().st_mtime < deadline:
                    path.unlink()
            except OSError:  # removed by another process meanwhile, or not ours to remove
                continue

    # No cubin of ours comes near it; a file this size is not an entry, and is not read.
    _MAX_ENTRY_BYTES = 64 << 20

    def load(self, digest: str) -> bytes | None:
        """The entry's cubin, or None (a miss): none there, a checksum that does not match, or a file a
        process could be made to run without choosing it (:meth:`_untrusted`)."""
        path = self._path(digest)
        try:
            # No link followed, no FIFO waited on (open blocked for good on one planted there).
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # a link (O_NOFOLLOW): a miss, said as the other refusals are
                _warn_once(f"mooncake_ep: not loading kernel cache entry {path} (a symbolic link); compiling "
                           f"it instead")
            return None
        try:
            info = os.fstat(fd)
            refused = self._untrusted(info)
            if refused:
                _warn_once(f"mooncake_ep: not loading kernel cache entry {path} ({refused}); compiling it instead")
                return None
            with os.fdopen(os.dup(fd), "rb") as f:
                blob = f.read()
        except OSError:
            return None
        finally:
            os.close(fd)
        checksum, payload = blob[: self._CHECKSUM_BYTES], blob[self._CHECKSUM_BYTES :]
        if len(checksum) != self._CHECKSUM_BYTES or hashlib.sha256(payload).digest() != checksum:
            logger.warning("mooncake_ep: ignoring corrupt kernel cache entry %s", path)
            return None
        return payload

    def _untrusted(self, info: os.stat_result) -> str:
        """Why an entry (``info``, its fstat) must not be loaded, or "". A cubin runs in the process's
        CUDA context, and the checksum only finds damage: an entry that another user could have put
        there, in a folder anyone may write (another user made ``/tmp/kernels`` first), or rewritten,
        writable by anyone, is not one this user chose. A group-shared cache (group write, as a
        setgid folder with umask 002 makes) trusts its group, as its users chose."""
        if not stat.S_ISREG(info.st_mode):
            return "not a regular file"
        if info.st_size > self._MAX_ENTRY_BYTES:
            return f"{info.st_size} bytes, larger than any entry"
        if not hasattr(os, "geteuid") or info.st_uid in (os.geteuid(), 0):
            return ""
        if info.st_mode & stat.S_IWOTH:
            return f"writable by every user, owned by uid {info.st_uid}"
        # The folders up to the root. Every user may put entries in the cache folder where it is
        # writable by all, and swap any folder beneath one writable by all without the sticky bit;
        # a folder of another user in one writable by all (a /tmp/kernels made first) is theirs to fill.
        folder = top = self.directory.absolute()
        here = None  # each folder's stat, taken once: as the parent of the one below it, then as itself
        while True:
            try:
                if here is None:
                    here = os.stat(folder)
                parent = os.stat(folder.parent)
            except OSError as exc:
                return f"its folder {folder} cannot be checked: {exc}"
            if here.st_mode & stat.S_IWOTH and (folder == top or not here.st_mode & stat.S_ISVTX):
                return f"owned by uid {info.st_uid}, in a folder every user may write ({folder})"
            if here.st_uid not in (os.geteuid(), 0) and parent.st_mode & stat.S_IWOTH:
                return (f"owned by uid {info.st_uid}, under {folder}, a folder of uid {here.st_uid} in one every "
                        f"user may write")
            if folder == folder.parent:
                return ""
            folder, here = folder.parent, parent

    @contextlib.contextmanager
    def compiling(self, digest: str, cancelled: threading.Event | None = None):
        """Hold the entry's lock while compiling it: processes (and threads) that miss the same entry
        at once, as every rank of a job starting on a cold cache does, compile it once; the others
        wait, then find it saved. Yields whether this caller waited for another holder (one that
        then left no entry, its compile or its save failed, is not waited for again: see
        :func:`get_cubin`).

        The lock is ``flock`` on a ``.<digest>.lock`` file beside the entry (left there: removing
        it would race with its next user), released when its holder exits or dies (a process forked
        meanwhile does not inherit it). Where no lock can be had (a read-only cache, a file system
        without locks), another holder takes longer than ``_COMPILE_WAIT_S``, or ``cancelled`` is
        set, the caller goes on without it and compiles the entry itself."""
        fd = self._open_lock_file(digest) if fcntl is not None else None
        waited = False
        try:
            if fd is not None:
                deadline = time.monotonic() + self._COMPILE_WAIT_S
                while True:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        _held_lock_fds.add(fd)
                        break
                    except BlockingIOError:
                        waited = True
                        if cancelled is not None and cancelled.is_set():
                            break
                        if time.monotonic() > deadline:
                            logger.info("mooncake_ep: kernel cache entry %s still compiled elsewhere after %.0f s; "
                                        "compiling it here", digest, self._COMPILE_WAIT_S)
                            break
                        time.sleep(0.02)
                    except OSError as exc:  # a file system without locks (ENOLCK on some NFS mounts)
                        _log_once_per_folder(logging.INFO, self.directory, "mooncake_ep: no lock in the kernel "
                                             f"cache {self.directory} ({exc}): ranks missing an entry at once each "
                                             f"compile it")
                        break
            yield waited
        finally:
            if fd is not None:
                _held_lock_fds.discard(fd)
                os.close(fd)  # releases the lock

    def _open_lock_file(self, digest: str) -> int | None:
        """The entry's lock file, opened for writing where it can be (NFS emulates flock with byte
        range locks, which an exclusive lock needs a writable file for), else for reading; None where
        it cannot be opened at all (a read-only cache whose lock file is missing)."""
        path = self.directory / f".{digest}.lock"
        # No link followed (a planted one had the file it names made 0644), no FIFO waited on.
        flags = os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
        try:
            self._make_directory()
            fd = os.open(path, os.O_RDWR | os.O_CREAT | flags, self._CACHE_FILE_MODE)
        except OSError:
            try:  # a lock file another user made, in a cache this one only reads
                fd = os.open(path, os.O_RDONLY | flags)
            except OSError as exc:
                logger.debug("mooncake_ep: no lock file for kernel cache entry %s: %s", digest, exc)
                return None
        try:
            info = os.fstat(fd)
        except OSError:
            info = None
        if info is None or not stat.S_ISREG(info.st_mode):
            os.close(fd)
            logger.debug("mooncake_ep: the lock file of kernel cache entry %s is not a regular file", digest)
            return None
        if hasattr(os, "geteuid") and info.st_uid == os.geteuid():
            with contextlib.suppress(OSError):  # readable by the other users of the cache, whatever the umask
                os.fchmod(fd, self._CACHE_FILE_MODE)
        return fd

    # The files the cache names: an entry, or an entry's lock file (see :meth:`compiling`).
    _ENTRY_FILE = re.compile(r"(?P<digest>[0-9a-f]{64})\.cubin|\.(?P<locked>[0-9a-f]{64})\.lock")

    def prune(self, keep: Iterable[str]) -> PruneResult:
        """Remove every entry whose digest is not in ``keep``, and its lock file: the cubins of other
        mooncake_ep or NVRTC versions and of targets no longer served, which nothing else removes.

        Only regular files named as this cache names them are touched (not a symlink, nor what it
        points to). An entry whose lock file some process holds stays, with its lock: that process
        is compiling it now. A lock file that a process opens just as it is removed costs that
        process at most a compile of its own, never a wrong entry (entries are renamed into place
        whole).

        Args:
            keep: the digests to keep, e.g. those :func:`warmup` just compiled or found.
        """
        keep = set(keep)
        removed: list[str] = []
        failed: list[tuple[str, str]] = []
        held: set[str] = set()  # digests whose lock a process holds: their entries stay
        num_bytes = 0
        try:
            paths = sorted(self.directory.iterdir())  # ".<digest>.lock" sorts before "<digest>.cubin"
        except FileNotFoundError:
            return PruneResult((), 0, ())
        for path in paths:
            match = self._ENTRY_FILE.fullmatch(path.name)
            digest = match and (match["digest"] or match["locked"])
            if match is None or digest in keep or digest in held:
                continue
            try:
                info = path.lstat()
                if not stat.S_ISREG(info.st_mode):
                    continue
                if match["locked"] is not None:
                    if not self._remove_unheld_lock(path):
                        held.add(digest)
                        continue
                else:
                    path.unlink()
            except FileNotFoundError:  # another pruner, or a writer's rename: nothing left to do
                continue
            except OSError as exc:  # another user's entry in a shared cache, a read-only mount
                failed.append((path.name, exc.strerror or str(exc)))
                continue
            removed.append(path.name)
            num_bytes += info.st_size
        return PruneResult(tuple(removed), num_bytes, tuple(failed))

    @staticmethod
    def _remove_unheld_lock(path: Path) -> bool:
        """Unlink a lock file no process holds (taken here first, so none holds it meanwhile); False
        where one does, or where the path names another file by now. Raises OSError where it cannot be
        opened or removed."""
        flags = os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
        try:
            fd = os.open(path, os.O_RDWR | flags)
        except PermissionError:  # another user's lock file (0644) in a shared cache: flock needs no write
            fd = os.open(path, os.O_RDONLY | flags)
        try:
            if fcntl is not None:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    return False
                except OSError as exc:  # a file system without locks: none can be held there either
                    if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP):
                        raise
            if os.fstat(fd).st_ino != path.lstat().st_ino:  # removed and made again since we opened it
                return False
            path.unlink()
            return True
        finally:
            os.close(fd)

    def save(self, digest: str, cubin: bytes) -> None:
        if self.directory not in _swept_cache_dirs:  # once per folder and process: what killed writers left
            with contextlib.suppress(OSError):
                self._remove_stale_temp_files()
        fd, tmp = self._mkstemp()
        try:
            with os.fdopen(fd, "wb") as f:  # owns fd from here: closed whatever fails below
                # mkstemp makes the file private (0600): see _CACHE_FILE_MODE.
                os.fchmod(f.fileno(), self._CACHE_FILE_MODE)
                f.write(hashlib.sha256(cubin).digest() + cubin)
            os.replace(tmp, self._path(digest))
        except BaseException as exc:
            Path(tmp).unlink(missing_ok=True)
            if isinstance(exc, OSError):  # a full disk, a quota: say which cache, and how to choose another
                raise OSError(exc.errno, f"could not write kernel cache entry {self._path(digest)} "
                                         f"({exc.strerror or exc}); {self._remedy}") from exc
            raise


# Cache folders whose stale temporary files this process has removed (KernelCache.save).
_swept_cache_dirs: set[Path] = set()
# Cubins this process compiled and could not save, by digest: a later Buffer of the process finds
# them here instead of compiling them again.
_unsaved_cubins: dict[str, bytes] = {}
# (log level, cache folder) of the messages logged once per folder (_log_once_per_folder).
_logged_cache_dirs: set[tuple[int, Path]] = set()
# The lock files whose lock this process holds now (KernelCache.compiling).
_held_lock_fds: set[int] = set()


def get_cubin(key: KernelKey, cache: KernelCache | None = None,
              cancelled: threading.Event | None = None) -> tuple[bytes, bool]:
    """The cubin of ``key`` from the cache, compiling and storing it on a miss (once for all the
    processes missing it at once: :meth:`KernelCache.compiling`; ``cancelled`` ends a wait there).

    A cubin that cannot be saved (a read-only or full cache) is kept in this process, with a warning
    once per cache folder.

    Returns:
        ``(cubin, compiled)``: compiled is False when the cache answered.
    """
    cache = cache if cache is not None else KernelCache()
    cubin = _unsaved_cubins.get(key.digest) or cache.load(key.digest)
    if cubin is not None:
        return cubin, False
    with cache.compiling(key.digest, cancelled) as waited:
        # Saved by another process, or kept by another thread of this one, while this one waited.
        cubin = _unsaved_cubins.get(key.digest) or cache.load(key.digest)
        if cubin is not None:
            return cubin, False
        if not waited:
            return _compile_and_save(key, cache), True
    # The holder left no entry (its compile failed, or its save): compiled here, beside the others
    # that waited, not one after another under the lock.
    return _compile_and_save(key, cache), True


def _compile_and_save(key: KernelKey, cache: KernelCache) -> bytes:
    # A miss said where it was looked for: a warm-up on another machine whose key differs (another
    # NVRTC build, other CUDA headers) otherwise left no trace but the compile's seconds.
    logger.info("mooncake_ep: compiling kernel %s for %s (entry %s not in the kernel cache %s)", key.name, key.arch,
                key.digest[:16], cache.directory)
    cubin = compile_kernel(key)
    try:
        cache.save(key.digest, cubin)
    except OSError as exc:
        _unsaved_cubins[key.digest] = cubin
        _log_once_per_folder(logging.WARNING, cache.directory, f"mooncake_ep: could not cache the kernels this "
                             f"process compiles ({exc}); it keeps them, and every process compiles them again")
    return cubin


def _log_once_per_folder(level: int, folder: Path, message: str) -> None:
    """``message`` logged the first time this process says something of ``folder`` at ``level``."""
    if (level, folder) not in _logged_cache_dirs:
        _logged_cache_dirs.add((level, folder))
        logger.log(level, message)


def _close_held_locks_in_child() -> None:
    """In a process forked while a thread held an entry's lock: let it go (the child shares the lock
    with its parent, and would otherwise hold it for as long as it lives). The descriptor is pointed
    at /dev/null rather than closed: were the forking thread the holder, its own close would later
    hit whatever file the child had opened under that number meanwhile."""
    if not _held_lock_fds:
        return
    try:
        null = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return
    for fd in list(_held_lock_fds):
        with contextlib.suppress(OSError):
            os.dup2(null, fd, inheritable=False)
    os.close(null)
    _held_lock_fds.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_held_locks_in_child)


@dataclasses.dataclass(frozen=True)
class PruneResult:
    """What :meth:`KernelCache.prune` removed.

    Attributes:
        removed: the file names removed (entries and lock files).
        num_bytes: their size in bytes.
        failed: ``(name, reason)`` of each file that could not be removed.
    """

    removed: tuple[str, ...]
    num_bytes: int
    failed: tuple[tuple[str, str], ...]


@dataclasses.dataclass(frozen=True)
class WarmupResult:
    """What :func:`warmup` did for one key.

    Attributes:
        key: the specialisation.
        status: ``"compiled"`` (compiled and saved), ``"cached"`` (the cache held a valid entry) or
            ``"failed"`` (NVRTC rejected it; see ``error``).
        elapsed_s: seconds spent on this key (loading, or compiling and saving).
        error: the compile error when ``status == "failed"``.
    """

    key: KernelKey
    status: str
    elapsed_s: float
    error: KernelCompileError | None = None


def warmup(keys: Iterable[KernelKey], cache: KernelCache | None = None, *, num_workers: int = 1,
           progress: Callable[[WarmupResult], None] | None = None) -> list[WarmupResult]:
    """Fill ``cache`` with the cubin of every key ahead of time (what ``python -m mooncake_ep warmup`` runs).

    Keys with the same digest are done once. A key whose entry is missing or corrupt is compiled
    and saved; a valid entry is left as it is. NVRTC releases the GIL, so ``num_workers`` threads
    compile that many keys at once (NVRTC allows concurrent calls on distinct programs).

    Args:
        keys: the specialisations, e.g. :func:`low_latency_keys` for each architecture and scope.
        cache: where to store them (default: :func:`default_cache_dir`).
        num_workers: keys compiled at once, >= 1.
        progress: called in the calling thread with each result as it finishes.

    Returns:
        One result per distinct digest, in the order of ``keys``.

    Raises:
        OSError: a cubin could not be saved (unlike :func:`get_cubin`, which only warns: a warm-up
            that leaves the cache cold has failed). Call :meth:`KernelCache.check_writable` first
            to fail before compiling anything.

    Note:
        A :class:`KernelCompileError` does not stop the others: it is returned in its result.
    """
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
        raise ValueError(f"warmup: num_workers must be an int >= 1, got {num_workers!r}")
    cache = cache if cache is not None else KernelCache()
    by_digest: dict[str, KernelKey] = {}
    for key in keys:
        by_digest.setdefault(key.digest, key)
    unique = list(by_digest.values())

    def one(key: KernelKey) -> WarmupResult:
        start = time.perf_counter()
        if cache.load(key.digest) is not None:
            return WarmupResult(key, "cached", time.perf_counter() - start)
        try:
            cubin = compile_kernel(key)
        except KernelCompileError as exc:
            return WarmupResult(key, "failed", time.perf_counter() - start, exc)
        cache.save(key.digest, cubin)
        return WarmupResult(key, "compiled", time.perf_counter() - start)

    results: dict[str, WarmupResult] = {}
    with ThreadPoolExecutor(max_workers=min(num_workers, max(1, len(unique)))) as executor:
        futures = [executor.submit(one, key) for key in unique]
        try:
            for future in as_completed(futures):
                result = future.result()
                results[result.key.digest] = result
                if progress is not None:
                    progress(result)
        except BaseException:
            for future in futures:
                future.cancel()
            raise
    return [results[key.digest] for key in unique]


# --- The specialisations a low-latency buffer uses ------------------------------------------------


def _common_macros(sys_scope: bool) -> dict[str, object]:
    return {
        "EP_SYS_SCOPE": int(sys_scope),
        "EP_NUM_THREADS": NUM_THREADS,
        "EP_MAX_RANKS": _constants.MAX_RANKS,
        "EP_MAX_EXPERTS": _constants.MAX_EXPERTS,
        "EP_MAX_TOPK": _constants.MAX_TOPK,
        "EP_FP8_BLOCK": _constants.FP8_BLOCK,
        "EP_FP8_E4M3_MAX": f"{_constants.FP8_E4M3_MAX!r}f",
        "EP_FP8_AMAX_FLOOR": f"{_constants.FP8_AMAX_FLOOR!r}f",
    }


# (use_fp8, round_scale, use_ue8m0) combinations dispatch accepts; use_ue8m0 requires round_scale.
DISPATCH_MODES: tuple[tuple[bool, bool, bool], ...] = (
    (False, False, False),
    (True, False, False),
    (True, True, False),
    (True, True, True),
)


def dispatch_key(arch: str, use_fp8: bool, round_scale: bool, use_ue8m0: bool, sys_scope: bool = True) -> KernelKey:
    macros = _common_macros(sys_scope) | {
        "EP_USE_FP8": int(use_fp8),
        "EP_ROUND_SCALE": int(round_scale),
        "EP_USE_UE8M0": int(use_ue8m0),
    }
    return KernelKey.make("ll_dispatch.cu", "ll_dispatch", macros, arch)


def combine_key(arch: str, sys_scope: bool = True) -> KernelKey:
    return KernelKey.make("ll_combine.cu", "ll_combine", _common_macros(sys_scope) | {"EP_USE_FP8": 0,
                          "EP_ROUND_SCALE": 0, "EP_USE_UE8M0": 0}, arch)


def low_latency_keys(arch: str, sys_scope: bool = True) -> list[KernelKey]:
    """Every specialisation a low-latency :class:`mooncake_ep.Buffer` loads on construction.

    Args:
        arch: target architecture.
        sys_scope: order memory at system scope (peers on other GPUs or processes); False when
            every rank is on this GPU, where GPU scope suffices and is cheaper.
    """
    return [dispatch_key(arch, *mode, sys_scope) for mode in DISPATCH_MODES] + [combine_key(arch, sys_scope)]


# --- Loading and launching -----------------------------------------------------------------------


class Launcher:
    """A loaded kernel and how to launch it. Calling it packs the arguments and launches; nothing else.

    The arguments are packed with one :class:`struct.Struct` into a buffer made once, one 8-byte
    slot per parameter, and launched with ``cuLaunchKernel`` given the fixed array of pointers to
    those slots, through cupy's own binding of it (the one its kernels use: plain integers in, no
    per-argument type dispatch), a few microseconds of host time per launch.

    Args:
        cubin: the compiled module.
        name: the entry point.
        arg_format: one :mod:`struct` code per kernel parameter, in order: ``i`` int32,
            ``q`` int64, ``Q`` a device pointer (uint64).
        num_threads: threads per block.

    Note:
        One launch at a time per Launcher (the slots are shared); each rank's Buffer has its own.
        The calling thread's current CUDA context must be the module's device (the frameworks make
        the buffer's device current with its stream).
    """

    def __init__(self, cubin: bytes, name: str, arg_format: str, num_threads: int = NUM_THREADS):
        import cupy

        _check_arg_format(arg_format)
        self._bind(_loaded_function(cubin, name, cupy.cuda.runtime.getDevice()), name, arg_format, num_threads)

    @classmethod
    def for_function(cls, function, name: str, arg_format: str, num_threads: int = NUM_THREADS) -> Launcher:
        """A Launcher of a function something else loaded (a cupy ``Function``, e.g. of a ``RawModule``)."""
        _check_arg_format(arg_format)
        launcher = cls.__new__(cls)
        launcher._bind(function, name, arg_format, num_threads)
        return launcher

    def _bind(self, function, name: str, arg_format: str, num_threads: int) -> None:
        import ctypes
        import struct

        from cupy_backends.cuda.api import driver

        self._function = function
        self._function_ptr = function.ptr
        self._launch = driver.launchKernel
        self.name = name
        self.num_threads = num_threads
        self.arg_format = arg_format
        self._packer = struct.Struct("<" + "".join(_ARG_SLOT_FORMATS[code] for code in arg_format))
        self._slots = ctypes.create_string_buffer(self._packer.size)
        base = ctypes.addressof(self._slots)
        self._pointers = (ctypes.c_void_p * len(arg_format))(*(base + _ARG_SLOT_BYTES * i for i in range(len(arg_format))))
        self._pointers_address = ctypes.addressof(self._pointers)

    def __call__(self, num_blocks: int, args: Sequence[int], stream_ptr: int) -> None:
        """Launch ``num_blocks`` blocks on ``stream_ptr``. Raises cupy's CUDADriverError on failure."""
        self._packer.pack_into(self._slots, 0, *args)
        self._launch(self._function_ptr, num_blocks, 1, 1, self.num_threads, 1, 1, 0, stream_ptr,
                     self._pointers_address, 0)


def _check_arg_format(arg_format: str) -> None:
    if not arg_format or set(arg_format) - set(_ARG_SLOT_FORMATS):
        raise ValueError(f"Launcher: arg_format must be codes among {sorted(_ARG_SLOT_FORMATS)}, got {arg_format!r}")


# Modules loaded in this process, by (cubin digest, device): loaded once, never unloaded. A Buffer's
# own module would be unloaded when the Buffer is collected, and collection runs on whichever thread
# allocates next: in-process ranks, that can be a rank whose peers' kernels are waiting for its
# launch, while cuModuleUnload waits for the device (or, worse, does not).
_modules: dict[tuple[str, int], object] = {}
_modules_lock = threading.Lock()


def _loaded_function(cubin: bytes, name: str, device_id: int):
    """``name`` of ``cubin`` loaded on ``device_id`` (the current device), shared by every Launcher."""
    import cupy

    key = (hashlib.sha256(cubin).hexdigest(), device_id)
    with _modules_lock:
        module = _modules.get(key)
        if module is None:
            module = cupy.cuda.function.Module()
            module.load(cubin)
            _modules[key] = module
    return module.get_function(name)


# Each kernel parameter gets an 8-byte slot; cuLaunchKernel copies the parameter's own size from it.
_ARG_SLOT_BYTES = 8
_ARG_SLOT_FORMATS = {"i": "i4x", "q": "q", "Q": "Q"}
# Parameters of the entry points, in order (ll_dispatch.cu, ll_combine.cu).
DISPATCH_ARG_FORMAT = "iiQQiQiQiiQQQiiQq"
COMBINE_ARG_FORMAT = "iiQQiQiiQiiQQQiq"


def load_low_latency_kernels(arch: str, cache: KernelCache | None = None, sys_scope: bool = True) -> dict[str, Launcher]:
    """Compile (or load from the cache) and load every kernel of a low-latency buffer.

    Returns:
        ``{"dispatch/<fp8>/<round>/<ue8m0>": Launcher, "combine": Launcher}``.
    """
    cache = cache if cache is not None else KernelCache()  # one folder for all five
    keys = {dispatch_launcher_name(*mode): (dispatch_key(arch, *mode, sys_scope), DISPATCH_ARG_FORMAT)
            for mode in DISPATCH_MODES}
    keys["combine"] = (combine_key(arch, sys_scope), COMBINE_ARG_FORMAT)
    # Misses compile at once (NVRTC releases the GIL); the modules load here, on the caller's device.
    # Interrupted (Ctrl-C), the workers stop waiting for other processes' compiles at once.
    cancelled = threading.Event()
    executor = ThreadPoolExecutor(max_workers=len(keys))
    try:
        cubins = dict(zip(keys, executor.map(lambda item: get_cubin(item[0], cache, cancelled)[0], keys.values())))
    except BaseException:
        cancelled.set()
        executor.shutdown(wait=False, cancel_futures=True)
        raise
    executor.shutdown()
    # Blocks of the size each kernel was built for (its __launch_bounds__ and warp roles).
    return {name: Launcher(cubins[name], key.name, arg_format, num_threads=int(dict(key.macros)["EP_NUM_THREADS"]))
            for name, (key, arg_format) in keys.items()}


def dispatch_launcher_name(use_fp8: bool, round_scale: bool, use_ue8m0: bool) -> str:
    """The key of a dispatch variant in :func:`load_low_latency_kernels`' result."""
    return _DISPATCH_LAUNCHER_NAMES[bool(use_fp8), bool(round_scale), bool(use_ue8m0)]


# Looked up, not formatted, on every call: an f-string of three flags costs a quarter of a microsecond.
_DISPATCH_LAUNCHER_NAMES = {(fp8, round_scale, ue8m0): f"dispatch/{int(fp8)}/{int(round_scale)}/{int(ue8m0)}"
                            for fp8 in (False, True) for round_scale in (False, True) for ue8m0 in (False, True)}
