"""Test helpers shared by the group tests: run callables on threads, collect results or errors."""

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


def tcp_rank0_in_its_round(port: int, world_size: int, timeout_s: float, limit_s: float):
    """Start rank 0 of a TCPGroup on ``port`` in a thread and return once it is in the init_group
    round, with a function that joins the thread (at most ``limit_s``) and gives what its
    TCPGroup returned or raised."""
    from mooncake_ep.group import TCPGroup, TCPStoreClient

    out = []
    thread = threading.Thread(target=lambda: out.append(call_or_error(
        lambda: TCPGroup(0, world_size, master_port=port, timeout_s=timeout_s))))
    thread.start()
    with TCPStoreClient("127.0.0.1", port, timeout_s=limit_s) as probe:
        probe.get("c/0/0", timeout_s=limit_s)

    def outcome():
        thread.join(limit_s)
        assert not thread.is_alive(), "rank 0's thread hung"
        return out[0]

    return outcome
