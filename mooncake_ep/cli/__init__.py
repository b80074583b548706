"""Command line: ``python -m mooncake_ep <command>`` (or the ``mooncake-ep`` script).

Each command is a module of this package named in :data:`COMMANDS`, exposing::

    add_arguments(parser: argparse.ArgumentParser) -> None   # the command's flags
    run(args: argparse.Namespace) -> int                     # the exit code: 0 only on success

The module docstring's first line is the command's one-line help, the whole docstring its
description. Command modules use only public ``mooncake_ep`` names (no leading ``_``, a test checks; the
one exception, bench's ``--peer-reads workspace`` switch, says why where it is),
and import heavy or optional packages (torch, cupy, tqdm, matplotlib) inside ``run``, so that
``--help`` is fast and works without them. A command raises :class:`UsageError` for a combination
of flags argparse cannot check; the message is printed as argparse prints its own errors.

To add a command (``warmup``, say): write ``cli/<name>.py`` with the two functions above and
add ``"<name>"`` to :data:`COMMANDS`.

Exit codes: 0 success, 1 a failed check or a runtime error, 2 bad usage (as argparse), 130 interrupted
(a launch stopped by another signal: 128 + its number, 143 for SIGTERM).
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import math
import os
import re
import sys
from collections.abc import Sequence
from types import ModuleType

import mooncake_ep
from mooncake_ep.cli.gpu import GpuUnavailable

__all__ = ["COMMANDS", "EXIT_FAILURE", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_USAGE", "CheckFailed", "Interrupted",
           "OutputError", "UsageError", "build_parser", "check_host_memory", "check_output_path", "console_main",
           "exit_process", "main", "verbosity", "write_json"]

# Command names, in the order --help lists them; each is the module mooncake_ep.cli.<name>.
COMMANDS: tuple[str, ...] = ("demo", "bench", "warmup")

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2  # what argparse exits with for a bad flag
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report it


class OutputError(Exception):
    """A result file could not be written at the end of a run (a full disk, a path that went away)."""


class Interrupted(KeyboardInterrupt):
    """A launch stopped by a signal (SIGINT, SIGTERM, SIGHUP): the command exits 128 + its number,
    as a shell reports a process the signal ended."""

    def __init__(self, signum: int):
        super().__init__(f"signal {signum}")
        self.signum = signum


class CheckFailed(RuntimeError):
    """A command's own check of the results failed (bench's against the torch baseline, a rank
    masked while timing): exit 1 with its message, as a failed demo."""


# Failures of the runtime that deserve a one-line message rather than a traceback: the user's
# environment (no GPU for --backend cuda, a peer that never came, ranks of a --group init job
# started with other flags or another mooncake_ep, a kernel that does not compile here, no peer
# access, a result file the system would not take), and a failed check.
_REPORTED_ERRORS = (mooncake_ep.GroupError, mooncake_ep.RankMismatchError, mooncake_ep.KernelCompileError,
                    mooncake_ep.TransportError, OutputError, CheckFailed, GpuUnavailable)


class UsageError(Exception):
    """A command's flags do not fit together (e.g. ``--experts`` not a multiple of ``--ranks``)."""


def check_output_path(flag: str, path: str | None, suffix: str | None = None) -> None:
    """A file a command writes at its end, checked before the run (UsageError): not a directory, in a
    directory that exists and is writable, and ending in ``suffix`` when given."""
    if path is None:
        return
    if not path:
        raise UsageError(f"{flag}: the path is empty; name a file")
    if path == "-":  # a script's "stdout" would be a file named "-"; stdout holds the report's table
        raise UsageError(f"{flag}: '-' would be a file named '-', not stdout; name a file (./- for that one)")
    full = os.path.abspath(path)
    if os.path.isdir(full):
        raise UsageError(f"{flag} {path}: is a directory; name a file")
    if suffix is not None and not full.lower().endswith(suffix):
        raise UsageError(f"{flag} {path}: must end in {suffix}")
    folder = os.path.dirname(full)
    if not os.path.isdir(folder):
        raise UsageError(f"{flag} {path}: the directory {folder} does not exist")
    if not os.access(folder, os.W_OK) or (os.path.exists(full) and not os.access(full, os.W_OK)):
        raise UsageError(f"{flag} {path}: not writable")


def write_json(flag: str, path: str, report: dict) -> None:
    """Write a run's ``report`` to ``path`` as strict JSON (a non-finite number, e.g. the relative
    error of a failed run, as null: Python's NaN and Infinity tokens are not JSON); OutputError (one
    line, exit 1) if the system refuses."""
    try:
        with open(path, "w") as f:
            json.dump(_finite(report), f, indent=2, allow_nan=False)
            f.write("\n")
    except OSError as exc:
        raise OutputError(f"{flag} {path}: could not write the results: {exc.strerror or exc}") from None


def _finite(value):
    """``value`` with every non-finite float in its dicts, lists and tuples replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value


# The flags of each command that set how much memory it takes, for an out-of-memory error's advice.
_SHAPE_FLAGS = {"bench": "--hidden, --experts, --tokens, --ranks or --input-sets",
                None: "--hidden, --experts, --tokens or --ranks"}


def _out_of_memory(where: str, command: str, memory: str, detail: str) -> int:
    """Say in one line that ``command`` ran out of ``memory`` ("host" or "device"), and which of its
    flags lower what it takes; EXIT_FAILURE. ``detail``: the allocator's words ("" prints none)."""
    detail = f" ({detail})" if detail else ""  # numpy's MemoryError can be empty
    print(f"{where}: out of {memory} memory{detail}; lower {_SHAPE_FLAGS.get(command, _SHAPE_FLAGS[None])}",
          file=sys.stderr)
    return EXIT_FAILURE


def _physical_memory_bytes() -> int | None:
    """The memory this process may use: the machine's, or its container's limit where that is less
    (a GPU pod's: past it the OOM killer ends the run without a word)."""
    try:
        physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):  # not POSIX, or the value is unknown
        physical = None
    limits = [b for b in (physical, _cgroup_memory_limit_bytes()) if b is not None]
    return min(limits) if limits else None


def _cgroup_memory_limit_bytes(root: str = "/sys/fs/cgroup", proc_cgroup: str = "/proc/self/cgroup") -> int | None:
    """This process's cgroup memory limit: the least ``memory.max`` (v2) or ``memory.limit_in_bytes``
    (v1) of its own cgroup (``proc_cgroup``'s path: a Slurm job's, a systemd scope's) and each parent,
    up to ``root`` (where a container's own namespace shows its cgroup). None where none is set
    ("max", or v1's near-2**63 "unlimited") or none can be read."""
    files = ["memory.max", os.path.join("memory", "memory.limit_in_bytes")]  # relative to root
    try:
        with open(proc_cgroup) as f:
            for line in f:
                _, controllers, path = line.rstrip("\n").split(":", 2)
                folder = path.strip("/")
                while folder:  # the cgroup, then each parent below the root (listed above)
                    if controllers == "":  # v2's unified hierarchy
                        files.append(os.path.join(folder, "memory.max"))
                    elif "memory" in controllers.split(","):
                        files.append(os.path.join("memory", folder, "memory.limit_in_bytes"))
                    folder = os.path.dirname(folder)
    except (OSError, ValueError):
        pass
    limits = []
    for name in files:
        try:
            with open(os.path.join(root, name)) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 60:
            limits.append(int(text))
    return min(limits) if limits else None


def check_host_memory(what: str, num_bytes: int, flags: str) -> None:
    """Refuse a run whose arrays cannot fit in this machine's memory (UsageError), before it starts:
    it would otherwise fail at an allocation deep in numpy or torch, or loop for hours before one.

    ``num_bytes``: a lower bound of what the run holds at once; ``flags``: the ones that set it.
    """
    total = _physical_memory_bytes()
    if total is not None and num_bytes > total:
        raise UsageError(f"{what} needs at least {num_bytes / 2**30:.4g} GiB of host memory, this machine has "
                         f"{total / 2**30:.4g} GiB; lower {flags}")


def check_moe_shape(num_tokens: int, hidden: int, num_ranks: int, ranks_flag: str, num_experts: int,
                    num_topk: int, seed: int) -> None:
    """The checks the demo and the benchmark share (UsageError): top-k within the experts and the
    kernels' bound, a seed numpy accepts, and the library's own checks of the shape, with its
    messages; ``ranks_flag`` names where the ranks came from."""
    from mooncake_ep.cli.warmup import kernels_max_topk

    if num_topk > num_experts:
        raise UsageError(f"--topk ({num_topk}) must be <= --experts ({num_experts})")
    if num_topk > kernels_max_topk():
        raise UsageError(f"--topk must be <= {kernels_max_topk()} (the kernels' bound), got {num_topk}")
    if seed < 0:
        raise UsageError(f"--seed must be >= 0, got {seed}")
    try:
        mooncake_ep.Buffer.get_ep_buffer_size_hint(num_tokens, hidden, num_ranks, num_experts)
    except (TypeError, ValueError) as exc:
        raise UsageError(flag_message(exc, {"num_max_dispatch_tokens_per_rank": "--tokens", "hidden": "--hidden",
                                            "num_ranks": ranks_flag, "num_experts": "--experts"})) from None


def flag_message(exc: Exception, flags: dict[str, str]) -> str:
    """A library check's message (``"call: name must be ..."``) said with the flags the user typed:
    the call's prefix dropped, each of its argument names in ``flags`` replaced by its flag
    (``"--experts must be a multiple of --ranks=4, got 6"``). The library keeps the checks and
    their limits; only the names are the command line's."""
    message = str(exc)
    call, separator, rest = message.partition(": ")
    if separator and call.isidentifier():
        message = rest
    names = re.compile(r"\b(" + "|".join(map(re.escape, flags)) + r")\b")
    return names.sub(lambda match: flags[match.group()], message)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Shows every flag's default, and keeps the line breaks of the command docstrings."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        # A default of None means "decided at run time", which the help says in words where it
        # matters, as it does any default it names itself: "(default: None)" would only repeat it.
        if action.default is None or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def command_module(name: str) -> ModuleType:
    """The module implementing command ``name`` (one of :data:`COMMANDS`)."""
    return importlib.import_module(f"{__name__}.{name}")


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """The parser of every command: ``<prog> [-v] <command> [flags]``."""
    # No abbreviations: a command that starts copies of itself passes its flags on as written.
    parser = argparse.ArgumentParser(
        prog=prog,
        allow_abbrev=False,
        description="mooncake_ep: expert-parallel dispatch and combine for Mixture-of-Experts models.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {mooncake_ep.__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0,
                        help="log the library's messages: -v for INFO, -vv for DEBUG")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    for name in COMMANDS:
        module = command_module(name)
        doc = (module.__doc__ or name).strip()
        sub = subparsers.add_parser(name, help=_summary(doc), description=doc, formatter_class=HelpFormatter,
                                    allow_abbrev=False)
        module.add_arguments(sub)
        # -v after the command too (where scripts add flags): a count of its own (argparse would copy
        # the command's over the one before it), the larger of the two applies (verbosity()).
        sub.add_argument("-v", "--verbose", action="count", default=0, dest="verbose_after_command",
                         help="log the library's messages: -v for INFO, -vv for DEBUG")
        sub.set_defaults(run=module.run, command_parser=sub)
    return parser


def verbosity(args: argparse.Namespace) -> int:
    """How many ``-v`` apply: the larger count, before or after the command's name (a command that
    starts copies of itself passes both on, and the copies must count as many)."""
    return max(args.verbose, getattr(args, "verbose_after_command", 0))


def _summary(doc: str) -> str:
    """A docstring's first line, without a leading ````python -m mooncake_ep name``: ```` label."""
    first = doc.splitlines()[0]
    if first.startswith("``") and "``: " in first:
        first = first.split("``: ", 1)[1]
    return first[:1].upper() + first[1:]


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    """Parse ``argv`` (without the program name), run the command, return its exit code.

    Never raises SystemExit: ``--help`` returns 0, a bad flag returns 2, as argparse would exit.
    """
    parser = build_parser(prog)
    try:
        args, unknown = parser.parse_known_args(argv)
        if unknown:  # the command's usage, not the top-level one that argparse would print
            getattr(args, "command_parser", parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    except SystemExit as exc:  # argparse exits on --help, --version and bad flags
        return exc.code if isinstance(exc.code, int) else (EXIT_OK if exc.code is None else EXIT_USAGE)
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    args.verbose = verbosity(args)
    if args.verbose:
        logging.basicConfig(level=logging.DEBUG if args.verbose > 1 else logging.INFO,
                            format="%(levelname)s %(name)s: %(message)s")
    # What followed the command's name: a command that starts copies of itself (--launch) passes it on.
    raw = list(sys.argv[1:] if argv is None else argv)
    args.command_argv = raw[raw.index(args.command) + 1:]
    where = f"{parser.prog} {args.command}"
    stdout = sys.stdout
    sys.stdout = wrapped = _StdoutThatMayClose(stdout)
    try:
        return int(args.run(args))
    except UsageError as exc:
        print(f"{where}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except _REPORTED_ERRORS as exc:
        print(f"{where}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except MemoryError as exc:  # numpy's for a shape this host cannot hold, or cupy's for the device
        return _out_of_memory(where, args.command, "device" if type(exc).__module__.startswith("cupy") else "host",
                              str(exc))
    except RuntimeError as exc:
        # torch.cuda's OutOfMemoryError (a RuntimeError), and torch's CPU allocator's plain one: one line too.
        host = "can't allocate memory" in str(exc)
        if type(exc).__name__ != "OutOfMemoryError" and not host:
            raise
        return _out_of_memory(where, args.command, "host" if host else "device", str(exc).splitlines()[0])
    except KeyboardInterrupt as exc:
        print(f"{where}: interrupted", file=sys.stderr)
        return 128 + exc.signum if isinstance(exc, Interrupted) else EXIT_INTERRUPTED
    except BrokenPipeError:  # stdout went away where something wrote to it directly: exit quietly
        _silence_stdout(stdout)
        return EXIT_FAILURE
    finally:
        # What is still buffered goes out now, through the wrapper: a pipe closed since the last print
        # is silenced here, not at the interpreter's exit (exit status 120, unless stdout is unbuffered).
        wrapped.flush()
        sys.stdout = stdout


class _StdoutThatMayClose:
    """``sys.stdout`` while a command runs: once stdout has closed (``... | head``), printing stops and
    the run goes on (its files are written), instead of a BrokenPipeError at the next print."""

    def __init__(self, stream) -> None:
        self._stream, self._closed = stream, False

    def write(self, text: str) -> int:
        if not self._closed:
            try:
                return self._stream.write(text)
            except BrokenPipeError:
                self._close()
        return len(text)

    def flush(self) -> None:
        if not self._closed:
            try:
                self._stream.flush()
            except BrokenPipeError:
                self._close()

    def _close(self) -> None:
        self._closed = True
        _silence_stdout(self._stream)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def _silence_stdout(stream) -> None:
    """Point ``stream``'s descriptor at /dev/null, so that the interpreter's last flush at exit raises
    nothing more."""
    try:
        descriptor = stream.fileno()
    except (AttributeError, OSError, ValueError):  # not a real file (a test's capture): nothing to point
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, descriptor)
    os.close(devnull)


def exit_process(code: int) -> None:
    """End the process with ``code``. After an interrupt, without the interpreter's finalisation:
    in-process ranks stopped inside numpy calls can leave OpenBLAS's thread pool waiting on itself at
    exit, and the process then never ends (seen in 3 of 8 Ctrl-C's of a threaded demo)."""
    if code != EXIT_INTERRUPTED:
        sys.exit(code)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed, or a pipe that went away
            pass
    os._exit(code)


def console_main() -> None:
    """Entry point of the ``mooncake-ep`` console script (declared in pyproject.toml)."""
    exit_process(main(sys.argv[1:], prog="mooncake-ep"))
