"""scripts/repeat_case.py's host timeline on the CPU: a stalled call leaves every thread's stack."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
sys.path.insert(0, str(SCRIPTS))

import repeat_case  # noqa: E402 - from scripts/, a development tool


class _Rank:
    rank = 3


def test_a_call_past_the_stall_limit_leaves_the_stacks_of_every_thread(tmp_path):
    log = tmp_path / "stalls.log"
    original = repeat_case.buffer.Buffer.dispatch
    timeline = repeat_case.HostTimeline(str(log))
    release = threading.Event()

    def other_thread_waits_here() -> None:
        release.wait()

    def stuck_in_the_call(self) -> None:
        # Stuck until the watchdog has written the stacks (not a fixed time, which a loaded machine
        # could outlast before the timer fires); the cap only keeps a broken watchdog from hanging.
        deadline = time.monotonic() + 60
        while "in stuck_in_the_call" not in (log.read_text() if log.exists() else "") and time.monotonic() < deadline:
            time.sleep(0.05)

    other = threading.Thread(target=other_thread_waits_here)
    other.start()
    try:
        timeline._timed(stuck_in_the_call, "dispatch")(_Rank())
    finally:
        release.set()
        other.join()
        timeline.close()
    text = log.read_text()
    assert "a call running for" in text
    assert "in stuck_in_the_call" in text and "in other_thread_waits_here" in text
    # Garbage collections are events too, and one may run meanwhile (after tests that leave garbage).
    assert [what for what, _, _ in timeline.events if not what.startswith("gc ")] == ["rank 3 dispatch"]
    assert repeat_case.buffer.Buffer.dispatch is original  # close() untimed the calls
