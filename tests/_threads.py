"""A test helper shared by the group tests: run callables on threads, collect results or errors."""

from __future__ import annotations

import threading


def run_in_threads(fns: list, limit_s: float) -> list:
    """Run each zero-argument fn on its own thread; return each one's result or exception."""
    out: list = [None] * len(fns)

    def call(i: int) -> None:
        try:
            out[i] = fns[i]()
        except BaseException as exc:  # noqa: BLE001 - inspected by the test
            out[i] = exc

    threads = [threading.Thread(target=call, args=(i,), daemon=True) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(limit_s)
        assert not t.is_alive(), "a rank thread hung"
    return out


def call_or_error(fn):
    """fn()'s result, or the exception it raised (for a thread whose outcome a test inspects)."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - inspected by the test
        return exc
