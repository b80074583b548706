"""Ranks as processes on this host, for the commands' ``--launch N`` and ``--group init``.

``launch(argv, N)`` starts N copies of a command line with the environment torchrun gives (RANK,
WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT on a free port), each of which
joins through ``mooncake_ep.init_group()``, and passes only if every process exits 0. On POSIX the
launcher binds the store's port itself and rank 0 serves the listening socket it is given
(:data:`STORE_SOCKET_FD_ENV`): the port is held from its choice on, so no other program can take it
between the choice and rank 0's start, as one could take a port found free and released. Whatever
ends the launch (a failed rank, a signal, the last exit, the launcher killed), it leaves no process
of the ranks' own running: on POSIX each rank leads a process group, which is stopped as a whole;
Ctrl-Z suspends the ranks with the launcher, and ``fg`` or ``bg`` continues them (a launcher killed
while suspended, with SIGKILL, leaves them suspended).
:func:`use_process_device` is what one such process does first on a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import mooncake_ep
from mooncake_ep.cli import EXIT_FAILURE, EXIT_OK, Interrupted, UsageError
from mooncake_ep.group import TORCHRUN_AGENT_STORE_VAR, free_port

# Seconds a launched process waits for its peers, to join and in each collective: long enough for N
# processes to import their libraries and build their inputs on a loaded host, short enough to end a
# broken run.
GROUP_TIMEOUT_S = 120.0
# Once one launched process has failed, seconds the others get to finish and report before they are
# stopped (a peer waiting for the failed one would otherwise wait GROUP_TIMEOUT_S).
LAUNCH_GRACE_S = 10.0
# How often the launcher looks at its processes.
_LAUNCH_POLL_S = 0.05
# A join still waiting after this long says so once (the wait is otherwise silent up to GROUP_TIMEOUT_S).
JOIN_NOTICE_S = 10.0
# Where launched processes meet: this host only.
LAUNCH_ADDR = "127.0.0.1"
# POSIX: each launched process leads a session (and process group) of its own, so that stopping a
# rank stops whatever it started too (compiler workers, a shell's children), not only the rank. A
# group is signalled only while its leader is not yet reaped (os.waitid with WNOWAIT looks without
# reaping): until then its id cannot name another process's group. A session, not a group of the
# launcher's session: there a rank is a background job of the launcher's terminal, stopped (SIGTTIN)
# as soon as it reads it (input(), pdb), and the launch hung (helper-117). The price: a launcher
# killed while suspended (Ctrl-Z, then kill -9 or the OOM killer) leaves its ranks stopped, since
# nothing of theirs runs to see it gone (in its session the kernel would have continued them).
_OWN_GROUPS = os.name == "posix" and hasattr(os, "waitid") and hasattr(os, "killpg")
_KILL = getattr(signal, "SIGKILL", signal.SIGTERM)
# Set in a launched process's environment: the descriptor of the read end of a pipe whose write end
# only the launcher holds, which the process watches (watch_launcher) so that it ends, with whatever
# it started, when the launcher dies without stopping it: the pipe ends with the launcher's process,
# reaped or not (its pid, watched before, stayed there as a zombie until its own parent reaped it).
LAUNCHER_FD_ENV = "MOONCAKE_EP_LAUNCHER_FD"
# Set in rank 0's environment (where _OWN_GROUPS): the descriptor of the socket listening on MASTER_PORT,
# bound by the launcher, which rank 0's store serves (init_group(store_socket=...)).
STORE_SOCKET_FD_ENV = "MOONCAKE_EP_STORE_FD"


def add_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    """``--launch N`` and ``--group {local,init}``, for a command whose ranks may be processes."""
    parser.add_argument("--launch", type=int, metavar="N",
                        help="run N processes on this host, one rank each, instead of threads of this process "
                             "(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set as torchrun does, on a free port); "
                             "rank 0 reports")
    parser.add_argument("--group", choices=("local", "init"), default="local",
                        help="local: the ranks are threads of this process; init: this process is one rank of a "
                             "job whose launcher set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT "
                             f"(mooncake_ep.init_group()), e.g. torchrun --nproc-per-node 8 -m mooncake_ep {command} "
                             "--group init; --launch starts such processes")


def check_launch(args: argparse.Namespace) -> None:
    """UsageError for a ``--launch`` that cannot run: with ``--group``, or fewer than one process."""
    if args.group != "local":
        raise UsageError("--launch starts processes that join with --group init themselves; leave out --group")
    if args.launch < 1:
        raise UsageError(f"--launch must be >= 1, got {args.launch}")


def env_world_size() -> int | None:
    """WORLD_SIZE of this process's environment (a launcher's, torchrun's) where it is a positive
    integer, else None (:func:`join_group` then says what is wrong with it). A command checks its
    flags against it before joining, which waits for every rank: a flag every rank refuses was
    reported only after that wait, or as the timeout of a peer that had already refused it."""
    value = os.environ.get("WORLD_SIZE", "")
    return int(value) if value.isascii() and value.isdigit() and int(value) > 0 else None


def join_group(backend: str, device: int | None = None) -> mooncake_ep.Group:
    """This process's rank of a ``--group init`` run (a launcher's, or torchrun's): the group, its
    device made current on the GPU (``device``: already chosen). UsageError for an environment
    that names no rank (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT unset or not numbers)."""
    watch_launcher()
    if backend == "cuda" and device is None:
        device = use_process_device()
    where = (f"RANK {os.environ.get('RANK', '?')} of WORLD_SIZE {os.environ.get('WORLD_SIZE', '?')} at "
             f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}")
    notice = threading.Timer(JOIN_NOTICE_S, _say, (f"mooncake_ep: {where}: still waiting for the other ranks to "
                                                   f"join ({JOIN_NOTICE_S:.0f} s so far, {GROUP_TIMEOUT_S:.0f} s "
                                                   f"at most)",))
    notice.daemon = True
    notice.start()
    try:
        return mooncake_ep.init_group(timeout_s=GROUP_TIMEOUT_S, device=device, store_socket=_launch_store_socket())
    except ValueError as exc:
        raise UsageError(f"--group init: {exc}") from None
    finally:
        notice.cancel()


def _launch_store_socket() -> socket.socket | None:
    """The listening socket ``launch`` gave this process, its rank 0, to serve the store on
    (:data:`STORE_SOCKET_FD_ENV`), also where the launched command wraps python (``sh -c``, a
    sanitizer: that python inherited both, and leads no process group); None in any other process: one
    not started by ``launch``, or one started by such a process (which inherits the environment, not
    the descriptor).

    The variable is read once and removed, and the socket kept is not inheritable: a process this one
    starts (a shell's, a helper's) neither adopts it nor holds the port, which would leave rank 1's
    connection in the backlog of a dead rank 0 until its timeout. A number that names no listening
    socket (the variable inherited by a process that did not inherit the descriptor, e.g. a torchrun
    worker) is ignored, with a warning: rank 0 binds MASTER_PORT itself. The socket is adopted as a
    duplicate, and the number closed only once checked, so a mistaken one never closes a socket of
    this process's own.
    """
    fd_text = os.environ.pop(STORE_SOCKET_FD_ENV, "")
    if not (_OWN_GROUPS and fd_text.isascii() and fd_text.isdigit()):  # (a wrapped python leads no group: checked)
        return None
    fd = int(fd_text)
    problem, sock = None, None
    if os.environ.get("RANK") != "0":
        problem = f"RANK is {os.environ.get('RANK')!r}, and only rank 0 serves the store"
    else:
        try:
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                problem = "it is not a socket"
            else:
                sock = socket.socket(fileno=os.dup(fd))  # a duplicate, not inheritable
                if sock.type != socket.SOCK_STREAM or not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                    problem = "it is a socket that does not listen"
        except OSError as exc:
            problem = f"{exc.strerror or exc}"
    if problem is not None:
        if sock is not None:
            sock.close()  # the duplicate only
        _say(f"mooncake_ep: ignoring {STORE_SOCKET_FD_ENV}={fd_text} ({problem}): rank 0 binds MASTER_PORT itself")
        return None
    os.close(fd)  # the launcher's inheritable one: the duplicate serves
    return sock


@contextlib.contextmanager
def joined_group(backend: str) -> Iterator[mooncake_ep.Group]:
    """:func:`join_group`, closed when the block ends: with the group's final barrier when the block
    returns, without it when it raises (the peers may never reach a final barrier then)."""
    group = join_group(backend)
    finished = False
    try:
        yield group
        finished = True
    finally:
        close = getattr(group, "close", None)  # the Group protocol has no close; every init_group group does
        if close is not None:
            close(final_barrier=finished)


def use_process_device() -> int:
    """This process's GPU: LOCAL_RANK (set by torchrun and --launch) modulo the GPUs it sees, made
    current for torch and cupy. Several processes may share one GPU; they time-slice it. UsageError
    for a LOCAL_RANK that is not a non-negative integer (a launcher's empty or unset variable)."""
    local_rank = os.environ.get("LOCAL_RANK", "0")
    if not (local_rank.isascii() and local_rank.isdigit()):
        raise UsageError(f"--group init: the environment variable LOCAL_RANK must be a non-negative integer (this "
                         f"process's index on its host), got {local_rank!r}")
    import cupy
    import torch

    device = int(local_rank) % torch.cuda.device_count()
    torch.cuda.set_device(device)
    cupy.cuda.Device(device).use()
    return device


def rank_command(*args: str) -> list[str]:
    """The command line of a launched rank running ``python -m mooncake_ep ARGS``, with the package this
    process runs: ``-m`` would put the current directory first on ``sys.path``, where a checkout (or
    any folder named ``mooncake_ep``) would be imported instead (a non-editable install launched
    from its own checkout failed every rank; an editable one run from another checkout ran that
    one's code). The script puts this package's folder where ``-m`` puts the current directory,
    once the interpreter has started, as ``-m`` does: the rest of ``sys.path`` is a plain
    ``python -m``'s."""
    package_root = str(Path(mooncake_ep.__file__).resolve().parent.parent)
    # The current directory's entry goes; the package's folder takes it only where it is not on the
    # path already (installed in site-packages, which must stay after the standard library).
    script = (f"import runpy, sys; sys.path[0:1] = [] if {package_root!r} in sys.path[1:] else [{package_root!r}]; "
              f"runpy.run_module('mooncake_ep', run_name='__main__', alter_sys=True)")
    return [sys.executable, "-c", script, *args]


def launch(command: str, argv: Sequence[str], num_processes: int) -> int:
    """Run ``argv`` as ``num_processes`` rank processes on this host; EXIT_OK only if all exit 0.

    Args:
        command: the command's name, for what is printed.
        argv: one process's command line (each gets its rank in the environment).
        num_processes: the ranks, >= 1 (:func:`check_launch`).
    """
    # The store's port, held by this process until rank 0 has the socket (see the module's docstring).
    # Without process groups (where pass_fds may not exist either), a port found free, and released.
    store_socket = socket.create_server((LAUNCH_ADDR, 0), backlog=socket.SOMAXCONN) if _OWN_GROUPS else None
    port = store_socket.getsockname()[1] if store_socket is not None else free_port(LAUNCH_ADDR)
    print(f"mooncake_ep {command}: launching {num_processes} processes, store at {LAUNCH_ADDR}:{port}")
    sys.stdout.flush()
    # A launch inside a torchrun worker: its ranks meet at this launch's store, not torchrun's agent's
    # (init_group would look for that one at the MASTER_PORT given here, where nothing serves it).
    # Nor does it watch the pipe of a launch that started this one. PYTHONPATH stays as it is:
    # rank_command finds this package, and an entry added there would come before the standard
    # library from the interpreter's start (a checkout's encodings/ or keyword.py replaced the real one).
    inherited = {name: value for name, value in os.environ.items()
                 if name not in (TORCHRUN_AGENT_STORE_VAR, LAUNCHER_FD_ENV, STORE_SOCKET_FD_ENV)}
    procs: list[subprocess.Popen] = []
    # The ranks' end of the pipe they watch; the launcher's end (not inheritable) closes with it.
    watched_fd, launcher_fd = os.pipe() if _OWN_GROUPS else (None, None)
    # A launcher stopped by SIGINT, SIGTERM or SIGHUP stops its processes too, and one suspended
    # (SIGTSTP: Ctrl-Z) suspends them with it: the handler only notes the signal, and the loops below
    # act on it where every started process is in procs (raised inside Popen, after its fork, it
    # would leave that process unknown, and running).
    stop = _StopOnSignal(procs)
    try:
        for rank in range(num_processes):
            env = dict(inherited, RANK=str(rank), WORLD_SIZE=str(num_processes), LOCAL_RANK=str(rank),
                       LOCAL_WORLD_SIZE=str(num_processes), MASTER_ADDR=LAUNCH_ADDR, MASTER_PORT=str(port))
            pass_fds = []
            if watched_fd is not None:
                env[LAUNCHER_FD_ENV] = str(watched_fd)
                pass_fds.append(watched_fd)
            if rank == 0 and store_socket is not None:
                env[STORE_SOCKET_FD_ENV] = str(store_socket.fileno())
                pass_fds.append(store_socket.fileno())
            procs.append(subprocess.Popen(list(argv), env=env, pass_fds=pass_fds, start_new_session=_OWN_GROUPS))
            if rank == 0 and store_socket is not None:  # rank 0 holds the port now; a rank 0 that dies frees it
                store_socket.close()
            stop.check()
        stopped_by_launcher = _wait_for_processes(procs, stop)
    finally:
        stop.restore()
        # Interrupted, a failure while starting, or ranks that left processes of their own running:
        # leave nothing behind. Each group is killed before its leader is reaped, and every one
        # before any is waited for: ranks killed one by one saw rank 0's store go away first and
        # printed that as their error.
        try:
            for proc in procs:
                _signal_rank(proc, _KILL)
            for proc in procs:
                proc.wait()
        finally:  # a second Ctrl-C in those waits too
            stop.restore_child_signal()
            for fd in (watched_fd, launcher_fd):
                if fd is not None:
                    os.close(fd)
            if store_socket is not None:  # rank 0 never started
                store_socket.close()
    failed = {rank: proc.returncode for rank, proc in enumerate(procs) if proc.returncode != 0}
    if failed:
        # The ranks the launcher stopped did not fail themselves: said apart, or they read as crashes.
        stopped = sorted(rank for rank in failed if rank in stopped_by_launcher)
        summary = ", ".join(f"rank {rank} {_describe_exit(code)}" for rank, code in failed.items()
                            if rank not in stopped)
        if stopped:
            summary += (f"; {'rank' if len(stopped) == 1 else 'ranks'} {', '.join(map(str, stopped))} still running "
                        f"{LAUNCH_GRACE_S:g} s later, stopped by the launcher")
        print("FAIL: " + summary)
        return EXIT_FAILURE
    print(f"all {num_processes} processes passed")
    return EXIT_OK


class _StopOnSignal:
    """Notes SIGINT, SIGTERM and SIGHUP in this (main) thread; :meth:`check` raises Interrupted (a
    KeyboardInterrupt) then.
    SIGCHLD is set to its default meanwhile: ignored (inherited so from a daemon or a wrapper), the
    kernel reaps the ranks itself, and the launch could not read their exit codes.

    SIGTSTP (Ctrl-Z) is noted too where the ranks lead process groups of their own (_OWN_GROUPS),
    which the terminal's signal does not reach: :meth:`check` then stops every rank's group and this
    process, and once this process is continued (``fg``, ``bg``, SIGCONT) continues them. SIGSTOP,
    not SIGTSTP, on both sides: a rank's group, in a session of its own, is orphaned, and the kernel
    would discard a SIGTSTP to it. Where this process's own group is orphaned (a launcher
    started with setsid, or by a supervisor), no one could continue it, and the kernel would discard
    the SIGTSTP: so is it here, with a line on stderr that says so. The ranks' timeouts are
    wall-clock time: a suspension longer than a rank's wait for a peer
    (GROUP_TIMEOUT_S in a collective) can fail that wait when they are continued.

    Off the main thread (where handlers cannot be set) it notes nothing and Python's own SIGINT
    handling stays.
    """

    def __init__(self, procs: list[subprocess.Popen]) -> None:
        self.signum: int | None = None
        self._procs = procs
        self._suspend = False
        self._previous: dict = {}
        if threading.current_thread() is threading.main_thread():
            for name in ("SIGINT", "SIGTERM", "SIGHUP"):
                self._handle(getattr(signal, name, None), self._note)
            if hasattr(signal, "SIGCHLD"):
                self._previous[signal.SIGCHLD] = signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            if _OWN_GROUPS:
                self._handle(signal.SIGTSTP, self._note_suspend)

    def _handle(self, sig: int | None, handler) -> None:
        """Handles ``sig`` unless it is ignored: ``nohup`` (SIGHUP), or a shell's ``cmd &`` in a script
        (SIGINT), says the launch should outlive it, as Python itself keeps it ignored."""
        if sig is not None and signal.getsignal(sig) is not signal.SIG_IGN:
            self._previous[sig] = signal.signal(sig, handler)

    def _note(self, signum, frame) -> None:
        self.signum = signum

    def _note_suspend(self, signum, frame) -> None:
        self._suspend = True

    def check(self) -> None:
        if self._suspend:
            self._suspend = False
            if _group_is_orphaned():
                # Said, not silent: whoever sent it (a supervisor, a kill by hand) learns why nothing stopped.
                _say("mooncake_ep launch: SIGTSTP ignored: this launch's process group is orphaned (started with "
                     "setsid or by a supervisor), so nothing could continue it")
                return
            for proc in self._procs:
                if proc.returncode is None:  # not reaped: its group id is still its own
                    _signal_rank(proc, signal.SIGSTOP)
            os.kill(os.getpid(), signal.SIGSTOP)  # returns once this process is continued
            for proc in self._procs:
                if proc.returncode is None:
                    _signal_rank(proc, signal.SIGCONT)
        if self.signum is not None:
            raise Interrupted(self.signum)

    def restore(self) -> None:
        """The handlers before the launch, but SIGCHLD's (:meth:`restore_child_signal`)."""
        for sig, handler in self._previous.items():
            if sig != getattr(signal, "SIGCHLD", None):
                signal.signal(sig, handler)

    def restore_child_signal(self) -> None:
        """SIGCHLD's handler before the launch: once every rank is reaped (ignored, it reaps them)."""
        if hasattr(signal, "SIGCHLD") and signal.SIGCHLD in self._previous:
            signal.signal(signal.SIGCHLD, self._previous[signal.SIGCHLD])


def _group_is_orphaned() -> bool:
    """Whether this process's group is orphaned: no member has a parent in another group of the same
    session (a job-control shell), which is when the kernel discards a SIGTSTP to it. Members are
    read from /proc; without it, this process is taken as the only one."""
    group, session = os.getpgrp(), os.getsid(0)
    try:
        pids = [entry for entry in os.listdir("/proc") if entry.isdigit()]
    except OSError:
        parents = [os.getppid()]
    else:
        parents = []
        for pid in pids:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()  # state, ppid, pgrp, session, ...
            except OSError:  # gone meanwhile
                continue
            if int(fields[2]) == group:
                parents.append(int(fields[1]))
    for parent in parents:
        try:
            if os.getpgid(parent) != group and os.getsid(parent) == session:
                return False
        except OSError:  # the parent is gone, or in a namespace this process cannot see
            continue
    return True


def _say(line: str) -> None:
    """A line on stderr; a stderr nobody reads any more (a closed pipe) must not end the launch."""
    try:
        print(line, file=sys.stderr, flush=True)
    except OSError:
        pass


def _wait_for_processes(procs: list[subprocess.Popen], stop: _StopOnSignal) -> set[int]:
    """Returns once every process has exited (on POSIX not yet reaped: see _OWN_GROUPS). Once one
    fails, the others get LAUNCH_GRACE_S, then SIGTERM and LAUNCH_GRACE_S more; the caller kills
    what is left. Returns the ranks still running when the SIGTERM went out."""
    stop_at = None
    while True:
        stop.check()
        codes = [_exit_code(proc) for proc in procs]
        if all(code is not None for code in codes):
            return set()
        if stop_at is None and any(code not in (None, 0) for code in codes):
            stop_at = time.monotonic() + LAUNCH_GRACE_S
            if any(code is None for code in codes):  # said now: the wait is otherwise silent
                rank = next(r for r, code in enumerate(codes) if code not in (None, 0))
                _say(f"mooncake_ep launch: rank {rank} {_describe_exit(codes[rank])}; the others get "
                     f"{LAUNCH_GRACE_S:.0f} s to finish before they are stopped")
        if stop_at is not None and time.monotonic() > stop_at:
            running = {rank for rank, code in enumerate(codes) if code is None}
            for proc in procs:
                _signal_rank(proc, signal.SIGTERM)
            deadline = time.monotonic() + LAUNCH_GRACE_S  # one grace for all, not one each in turn
            while time.monotonic() < deadline and any(_exit_code(proc) is None for proc in procs):
                stop.check()
                time.sleep(_LAUNCH_POLL_S)
            return running
        time.sleep(_LAUNCH_POLL_S)


def _exit_code(proc: subprocess.Popen) -> int | None:
    """The process's exit code (negative: the signal that stopped it), None while it runs; on POSIX
    without reaping it, so that its process group can still be signalled safely."""
    if not _OWN_GROUPS or proc.returncode is not None:
        return proc.poll()
    info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    if info is None:
        return None
    return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status


def _signal_rank(proc: subprocess.Popen, sig: int) -> None:
    """``sig`` to a launched process and every process it started (its process group, POSIX); to the
    process alone elsewhere. Call it only before the process is reaped."""
    if _OWN_GROUPS:
        try:
            os.killpg(proc.pid, sig)  # the group outlives its leader while any member runs
        except ProcessLookupError:  # the leader exited and no process it started is left
            pass
    elif proc.poll() is None:
        proc.send_signal(sig)


def watch_launcher() -> None:
    """In a process that ``launch`` started: end it, and every process it started, if the launcher
    dies without stopping it (SIGKILL, the OOM killer), as a signal to the launcher's whole process
    group did before the ranks had groups of their own. A daemon thread reads the launcher's pipe
    (:data:`LAUNCHER_FD_ENV`), which ends when the launcher's process does, before this call too;
    nothing where this process was not started by ``launch``, a wrapper between the two closed the
    pipe, or a platform has no process groups."""
    fd = os.environ.get(LAUNCHER_FD_ENV, "")
    # Only in the group launch gave this process (not in a process it started, which inherits the
    # environment).
    if not (_OWN_GROUPS and fd.isascii() and fd.isdigit() and os.getpgrp() == os.getpid()):
        return
    try:
        if not stat.S_ISFIFO(os.fstat(int(fd)).st_mode):
            return  # closed by a wrapper, and the number taken by something else since
    except OSError:
        return  # closed by a wrapper

    def watch() -> None:
        while os.read(int(fd), 1):  # the launcher never writes: end of file when its process ends
            pass
        os.killpg(os.getpgrp(), _KILL)

    threading.Thread(target=watch, name="mooncake_ep-launcher-watch", daemon=True).start()


def _describe_exit(code: int) -> str:
    if code < 0:
        return f"was stopped by signal {-code}"
    return f"exited {code}"
