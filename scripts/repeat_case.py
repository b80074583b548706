"""Run low-latency test cases over and over and, when one fails, show what every rank saw.

For failures that come and go (in-process ranks racing on one GPU). Runs the cases of
tests/test_gpu_low_latency.py whose ids contain one of ``--cases`` (in the file's order), ``--repeat``
times over. Every Buffer, just before it is destroyed, once every rank's kernels are done, dumps
from its workspace: the step counters, and the dispatch and combine flags its peers stored into it
(step and payload per parity and source). With ``--trace`` (kernels built with EP_TRACE=1) it also
dumps the %globaltimer points of its last dispatch and combine (kernels_cu/trace.cuh), relative to
the earliest dispatch entry of any rank in that case. It also keeps a host timeline: when each
rank's dispatch and combine calls began and returned, and every garbage collection, in us from
the earliest dispatch call of the case (a rank launched late by its host thread shows there; one
launched on time but started late by the GPU does not); with ``--stall-log``, every thread's stack
whenever a call runs too long (HostTimeline). A failing case prints its assertion and
its dumps; ``--json`` keeps everything. A development tool, not part of the library.

    python scripts/repeat_case.py --cases async --repeat 20 --trace --json repeat.json

``--macro`` builds the kernels with an experiment's macro (as scripts/ab_kernels.py's variants), so
that a variant is checked against the reference on every case before it is written in:

    python scripts/repeat_case.py --cases all --repeat 1 --macro EP_TRY=1
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import gc
import json
import os
import sys
import threading
import time
import traceback

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, HERE)

import ab_kernels  # noqa: E402 - scripts/, for the macros' parser
from mooncake_ep import _constants, _cuda_backend, buffer, kernels, layout  # noqa: E402


def dump_workspace(cuda, trace: bool) -> dict:
    """Steps and flags of this rank's workspace (no kernel of any rank runs: see destroy below)."""
    state = cuda.peek_state()
    out = {"rank": cuda.group.rank, "state": {name: state[name].tolist() for name in layout.STATE_FIELDS}}
    num_ranks = cuda.group.world_size
    for region in ("dispatch_flag", "dispatch_verdict", "combine_flag", "combine_verdict", "combine_ack"):
        raw = cuda.workspace.peek(layout.HEADER_OFFSETS[region], layout.NUM_PARITIES * _constants.MAX_RANKS * 8)
        flags = np.frombuffer(raw, dtype=np.uint64).reshape(layout.NUM_PARITIES, _constants.MAX_RANKS)[:, :num_ranks]
        out[region] = [[[int(f >> np.uint64(32)), int(f & np.uint64(0xFFFFFFFF))] for f in row] for row in flags]
    if trace:
        import trace_phases

        for name, launcher in cuda.launchers.items():
            if name == "combine" or name.startswith("dispatch"):
                points = trace_phases.read_trace(launcher, cuda.group.rank)[:, : cuda.num_sms]
                if points.any():
                    out["trace_" + ("combine" if name == "combine" else "dispatch")] = points
    return out


def relative_to_first_entry(ranks: list[dict]) -> None:
    """Replace each rank's trace arrays by [earliest, latest] block per point, in us from the
    earliest dispatch send entry of any rank (None: no block wrote the point)."""
    import trace_phases

    entries = [d["trace_dispatch"][0] for d in ranks if "trace_dispatch" in d]
    written = [e[e > 0] for e in entries if (e > 0).any()]
    t0 = int(min(w.min() for w in written)) if written else 0
    for d in ranks:
        for key in ("trace_dispatch", "trace_combine"):
            if key not in d:
                continue
            points = {}
            for name, row in zip(trace_phases.POINTS, d[key]):
                row = row[row > 0].astype(np.int64)
                points[name] = [round((int(row.min()) - t0) / 1e3, 1), round((int(row.max()) - t0) / 1e3, 1)] \
                    if row.size else None
            d[key] = points


class HostTimeline:
    """Host times of every rank's dispatch / combine calls and of every garbage collection.

    With ``stall_log``, a watchdog also writes every thread's Python stack to that file when a call
    has been running for ``STALL_S`` (a healthy one takes microseconds to milliseconds), through
    faulthandler's own thread, which needs no GIL: the stacks show where a rank's host thread is
    stuck even when a thread blocked inside a C call holds the GIL. A Python thread re-arms
    faulthandler's timer every few ms while no call is that old; when one is (or when the GIL is
    held so long that the re-arming stops), the timer fires after ``STALL_S`` more.
    """

    STALL_S = 0.2
    WATCH_INTERVAL_S = 0.01

    def __init__(self, stall_log: str | None = None) -> None:
        self.events: list[tuple[str, int, int]] = []  # (what, start ns, end ns)
        self._gc_start = 0
        self._running: dict[int, int] = {}  # thread ident -> start ns of its call in progress
        self._originals = {name: getattr(buffer.Buffer, name) for name in ("dispatch", "combine")}
        for name, method in self._originals.items():
            setattr(buffer.Buffer, name, self._timed(method, name))
        gc.callbacks.append(self._on_gc)
        self._stopped = threading.Event()
        self._watchdog = None
        if stall_log is not None:
            self._stall_file = open(stall_log, "w")  # noqa: SIM115 - faulthandler writes to it until close()
            self._watchdog = threading.Thread(target=self._watch, name="stall watchdog", daemon=True)
            self._watchdog.start()

    def close(self) -> None:
        """Stop the watchdog and its timer (no stacks from the interpreter's exit); untime the calls."""
        self._stopped.set()
        if self._watchdog is not None:
            self._watchdog.join()  # it cancels the timer on its way out
            self._stall_file.close()
        for name, method in self._originals.items():
            setattr(buffer.Buffer, name, method)
        gc.callbacks.remove(self._on_gc)

    def _timed(self, method, name: str):
        timeline = self

        def call(self, *args, **kwargs):
            start = time.monotonic_ns()
            timeline._running[threading.get_ident()] = start
            try:
                return method(self, *args, **kwargs)
            finally:
                timeline._running.pop(threading.get_ident(), None)
                timeline.events.append((f"rank {self.rank} {name}", start, time.monotonic_ns()))

        return call

    def _watch(self) -> None:
        while not self._stopped.is_set():
            now = time.monotonic_ns()
            stuck = [start for start in list(self._running.values()) if now - start > self.STALL_S * 1e9]
            if not stuck:
                faulthandler.dump_traceback_later(self.STALL_S, file=self._stall_file)
            else:
                self._stall_file.write(f"-- a call running for {(now - min(stuck)) / 1e6:.0f} ms, at "
                                       f"{time.strftime('%H:%M:%S')}; the stacks follow when the timer fires\n")
                self._stall_file.flush()
                time.sleep(2 * self.STALL_S)  # let the armed timer fire once
            time.sleep(self.WATCH_INTERVAL_S)
        faulthandler.cancel_dump_traceback_later()

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_start = time.monotonic_ns()
        else:
            self.events.append((f"gc generation {info['generation']}", self._gc_start, time.monotonic_ns()))

    def take(self) -> list[list]:
        """This case's events, [what, start us, end us] from the earliest dispatch call, and clear."""
        starts = [start for what, start, _ in self.events if what.endswith("dispatch")]
        t0 = min(starts) if starts else 0
        events = sorted(self.events, key=lambda e: e[1])
        self.events = []
        return [[what, round((start - t0) / 1e3, 1), round((end - t0) / 1e3, 1)] for what, start, end in events]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="async",
                        help="comma-separated substrings of test ids, or 'all' (every grid, mode and fault case)")
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--trace", action="store_true", help="build the kernels with EP_TRACE=1")
    parser.add_argument("--macro", action="append", default=[], metavar="EP_NAME=INTEGER",
                        type=lambda item: ab_kernels.parse_macro(item, "--macro"),
                        help="an extra NVRTC macro of an experiment (scripts/ab_kernels.py), for its correctness "
                             "against the reference; repeatable")
    parser.add_argument("--timeout-us", type=int, default=1_000_000,
                        help="the cases' timeout, unless theirs is shorter (the fault cases')")
    parser.add_argument("--json", default=None)
    parser.add_argument("--stall-log", default=None, metavar="PATH",
                        help=f"write every thread's stack there when a call runs {HostTimeline.STALL_S} s or more")
    args = parser.parse_args()

    import test_gpu_low_latency as t

    if args.trace or args.macro:
        import trace_phases

        kernels._common_macros = trace_phases.traced_macros(kernels._common_macros, dict(args.macro),
                                                            trace=args.trace)
    dumps: list[dict] = []
    original_destroy = _cuda_backend.CudaBackend.destroy

    def destroy(self, raise_group_error: bool = True) -> None:
        if not self._destroyed:
            self._synchronize()
            self.group.barrier()  # every rank's kernels are done: the flags are final
            dumps.append(dump_workspace(self, args.trace))
        original_destroy(self, raise_group_error)

    _cuda_backend.CudaBackend.destroy = destroy
    timeline = HostTimeline(args.stall_log)
    wanted = [w for w in args.cases.split(",") if w]
    cases = [dataclasses.replace(c, timeout_us=min(c.timeout_us, args.timeout_us))
             for c in t.GRID + t.MODES + t.FAULTS
             if args.cases == "all" or any(w in t._case_id(c) for w in wanted)]
    if not cases:
        parser.error(f"--cases {args.cases}: no test id matches")
    results = []
    for repetition in range(args.repeat):
        for case in cases:
            dumps.clear()
            timeline.take()
            if args.trace:
                trace_phases.clear_all_traces()
            start = time.perf_counter()
            try:
                t.check_case(case)
                error = None
            except Exception:  # noqa: BLE001 - a diagnostic: keep going and report
                error = traceback.format_exc(limit=3)
            elapsed = time.perf_counter() - start
            ranks = sorted(dumps, key=lambda d: d["rank"])
            if args.trace:
                relative_to_first_entry(ranks)
            result = {"repetition": repetition, "case": t._case_id(case), "ok": error is None,
                      "seconds": round(elapsed, 3), "error": error, "ranks": ranks, "host": timeline.take()}
            results.append(result)
            print(f"{repetition:3d} {t._case_id(case)}: {'ok' if error is None else 'FAILED'} in {elapsed:.3f} s",
                  flush=True)
            if error is not None:
                print(error)
                for d in ranks:
                    print(json.dumps(d))
                print("host:", json.dumps(result["host"]))
    timeline.close()
    failed = sum(not r["ok"] for r in results)
    print(f"{failed} of {len(results)} runs failed")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
