"""Tests of mooncake_ep.group: LocalGroup threads, the TCP store, TCPGroup across real processes.

CPU only. Timeouts here are short but only bound failures; no assertion is about elapsed time.
"""

from __future__ import annotations

import contextlib
import logging
import json
import math
import os
import re
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time
import types
from pathlib import Path

import numpy as np
import pytest

import _threads

from mooncake_ep import RankMismatchError, _group_common, _tcp_store
from mooncake_ep.group import (
    Group,
    GroupError,
    LocalGroup,
    StoreTimeoutError,
    TCPGroup,
    TCPStoreClient,
    TCPStoreServer,
    free_port,
    init_group,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
# Safety net for a test process that hangs (a bug): the test fails instead of stalling CI.
PROCESS_LIMIT_S = 60.0
# Timeout of the tests that expect one: long enough for a loaded machine, short for the suite.
SHORT_TIMEOUT_S = 1.0


def payload(rank: int, round_idx: int) -> bytes:
    """Distinct per rank and round, of varying length (empty for rank 0 in round 0)."""
    return f"r{rank}i{round_idx};".encode() * ((rank + round_idx) % 4) + bytes([rank, round_idx])


def run_in_threads(fns: list) -> list:
    return _threads.run_in_threads(fns, PROCESS_LIMIT_S)


# ----------------------------------------------------------------------------- LocalGroup


def test_local_spawn_returns_results_in_rank_order():
    group = LocalGroup(4)
    assert group.spawn(lambda g, x: (g.rank, g.world_size, x, g.device, g.is_in_process), "a") == [
        (r, 4, "a", None, True) for r in range(4)]
    assert group.num_ranks == 4 and group.devices is None
    assert isinstance(group.rank_group(2), Group)
    assert group.rank_group(2) is group.rank_group(2) and group.rank_group(2).local_group is group


def test_local_allgather_rounds_do_not_mix():
    num_rounds = 20

    def body(g):
        seen = []
        for i in range(num_rounds):
            seen.append(g.allgather_bytes(payload(g.rank, i)))
            if i % 3 == 0:
                g.barrier()
        return seen

    results = LocalGroup(5).spawn(body)
    expected = [[payload(r, i) for r in range(5)] for i in range(num_rounds)]
    assert results == [expected] * 5


def test_local_group_is_reusable_across_spawns():
    group = LocalGroup(3)
    for _ in range(3):
        assert group.spawn(lambda g: g.allgather_bytes(bytes([g.rank]))) == [[b"\0", b"\1", b"\2"]] * 3


def test_two_threads_in_one_ranks_collective_break_the_group_with_the_reason():
    """Both spawn threads call rank 0's collective, as JAX eager calls whose arrays all sit on rank 0's
    device do (helper-93): the second would take rank 1's place in the round. It is refused, and the
    group breaks at once, so the first thread, waiting in the round, gets the reason too, not the
    group's timeout (60 s here) naming rank 1 as missing."""
    group = LocalGroup(2, timeout_s=60.0)
    entered = threading.Event()

    def body(g):
        rank0 = group.rank_group(0)
        if g.rank == 0:
            entered.set()
        else:
            entered.wait()
            while not rank0._in_collective.locked():  # rank 0's thread is in its round
                time.sleep(0.001)
        rank0.allgather_bytes(b"x")

    with pytest.raises(GroupError, match=r"rank 0 entered a collective in thread 'mooncake_ep-rank1' while another "
                                         r"thread is in one as that rank: two threads used one rank") as info:
        group.spawn(body)
    assert "timed out" not in str(info.value)


def test_a_group_of_one_rank_lets_two_threads_take_turns():
    """With one rank there is no peer's place to take: a second thread entering its collective waits
    for the first, rather than breaking the group (helper-95)."""
    group = LocalGroup(1, timeout_s=60.0)
    rank0 = group.rank_group(0)
    assert run_in_threads([lambda i=i: rank0.allgather_bytes(bytes([i])) for i in range(4)]) == \
        [[bytes([i])] for i in range(4)]


def test_local_world_size_one():
    assert LocalGroup(1).spawn(lambda g: (g.allgather_bytes(b"x"), g.barrier())) == [([b"x"], None)]


def test_local_exception_in_one_rank_is_reraised_and_peers_released():
    def body(g):
        if g.rank == 2:
            raise ValueError("boom on purpose")
        g.allgather_bytes(b"x")  # would wait forever for rank 2 without the abort
        return g.rank

    group = LocalGroup(4, timeout_s=60.0)  # the abort, not this timeout, must release the peers
    with pytest.raises(ValueError, match="boom on purpose") as info:
        group.spawn(body)
    assert any("rank 2 of 4" in note for note in info.value.__notes__)
    # The group works again after a failed spawn.
    assert group.spawn(lambda g: g.allgather_bytes(b"k")) == [[b"k"] * 4] * 4


def test_local_timeout_names_missing_rank():
    def body(g):
        if g.rank != 1:
            g.barrier()

    with pytest.raises(GroupError, match=r"barrier #0 .*timed out after .* ranks \[1\] of 3"):
        LocalGroup(3).spawn(body, timeout_s=0.2)


def test_a_spawn_that_fails_to_start_its_threads_releases_the_ranks_it_started(monkeypatch):
    """A thread start that fails (no more threads), or a KeyboardInterrupt between two starts: the ranks
    already started waited in their collective for timeout_s (here forever), and the group refused
    every later spawn (helper-122). They are released, told why, and the group spawns again."""
    group = LocalGroup(4, timeout_s=math.inf)
    seen = []
    start = threading.Thread.start
    started = []

    def start_two(thread):
        if len(started) == 2:
            raise RuntimeError("can't start new thread")
        started.append(thread)
        start(thread)

    def body(g):
        try:
            g.barrier()
        except GroupError as exc:
            seen.append(str(exc))
            raise

    monkeypatch.setattr(threading.Thread, "start", start_two)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        group.spawn(body)
    monkeypatch.undo()
    for thread in started:
        thread.join(SHORT_TIMEOUT_S)
    assert not any(thread.is_alive() for thread in started), "a started rank was never released"
    assert len(seen) == 2 and all("LocalGroup.spawn stopped in its calling thread: RuntimeError: can't start new "
                                  "thread" in message for message in seen), seen
    assert group.spawn(lambda g: g.allgather_bytes(bytes([g.rank]))) == [[b"\0", b"\1", b"\2", b"\3"]] * 4


def test_local_timeout_s_is_checked_and_applies_from_now_on():
    """A plain attribute before: any value was taken, and read only at the next spawn, so ranks driven
    outside spawn (JAX's make_buffers drives them so) kept the old timeout (helper-122)."""
    group = LocalGroup(2, timeout_s=math.inf)
    for bad, error in ((float("nan"), ValueError), (0, ValueError), (-1.0, ValueError), ("5", TypeError),
                       (True, TypeError)):
        with pytest.raises(error, match=r"^LocalGroup.timeout_s: timeout_s must be"):
            group.timeout_s = bad
    assert group.timeout_s == math.inf
    group.timeout_s = np.float32(0.25)  # numpy scalars as every integer argument takes numpy's
    assert group.timeout_s == 0.25 and type(group.timeout_s) is float
    errors = []
    alone = threading.Thread(target=lambda: errors.append(_threads.call_or_error(group.rank_group(0).barrier)))
    alone.start()
    alone.join(SHORT_TIMEOUT_S)
    assert not alone.is_alive(), "a barrier outside spawn kept the timeout of before"
    assert isinstance(errors[0], GroupError) and "timed out after 0.25 s waiting for ranks [1]" in str(errors[0])
    # A spawn's own timeout_s is not overridden by the group's meanwhile, and the group's comes back after it.
    assert LocalGroup(1, timeout_s=np.int64(30)).spawn(lambda g: g.barrier(), timeout_s=np.float32(1.5)) == [None]


def test_local_mismatched_collectives_are_refused():
    def body(g):
        return g.barrier() if g.rank == 0 else g.allgather_bytes(b"x")

    with pytest.raises(GroupError, match="other collectives"):
        LocalGroup(2).spawn(body, timeout_s=SHORT_TIMEOUT_S)


def test_local_validation_errors():
    with pytest.raises(ValueError, match="num_ranks must be >= 1"):
        LocalGroup(0)
    with pytest.raises(TypeError, match="num_ranks must be an int"):
        LocalGroup(2.0)
    with pytest.raises(TypeError, match="num_ranks must be an int, got bool np.True_"):
        LocalGroup(np.bool_(True))
    # numpy integers are ints, taken as Python ints (a numpy one would wrap in arithmetic).
    group = LocalGroup(np.int16(2), devices=[np.uint8(0), np.int64(0)])
    assert type(group.num_ranks) is int and all(type(d) is int for d in group.devices), group
    ranks = TCPGroup(np.int64(0), np.int32(1), master_port=np.uint16(1), device=np.int8(0))  # world 1: no store
    assert (ranks.rank, ranks.world_size, ranks.master_port, ranks.device) == (0, 1, 1, 0)
    assert all(type(v) is int for v in (ranks.rank, ranks.world_size, ranks.master_port, ranks.device))
    with pytest.raises(ValueError, match="devices must have one entry per rank"):
        LocalGroup(2, devices=[0])
    with pytest.raises(ValueError, match="devices"):
        LocalGroup(2, devices=[0, -1])
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        LocalGroup(2, timeout_s=0)
    group = LocalGroup(2)
    with pytest.raises(ValueError, match=r"rank must be in \[0, world_size\) = \[0, 2\), got 2"):
        group.rank_group(2)
    with pytest.raises(TypeError, match="fn must be callable"):
        group.spawn(None)
    with pytest.raises(ValueError, match="timeout_s"):
        group.spawn(lambda g: None, timeout_s=-1)
    with pytest.raises(TypeError, match="data must be bytes, got str"):
        group.spawn(lambda g: g.allgather_bytes("text"))


def _fake_cuda_modules(monkeypatch, with_torch: bool) -> list:
    """Install stand-ins for cupy (and torch) that record, per thread, what spawn sets."""
    calls: list = []
    counter = iter(range(1000, 2000))

    entered: list[int] = []  # devices of the `with cupy.cuda.Device(d):` blocks open now

    class Device:
        def __init__(self, d):
            self.d = d

        def use(self):
            calls.append(("cupy.device", threading.current_thread().name, self.d))

        def __enter__(self):
            entered.append(self.d)

        def __exit__(self, *exc_info):
            entered.pop()

    class Stream:
        def __init__(self, non_blocking=False):
            assert non_blocking
            self.ptr = next(counter)
            calls.append(("cupy.new_stream", threading.current_thread().name, (self.ptr, entered[-1])))

        def use(self):
            calls.append(("cupy.stream", threading.current_thread().name, self.ptr))

        def synchronize(self):
            calls.append(("cupy.sync", threading.current_thread().name, self.ptr))

    cupy = types.ModuleType("cupy")
    cupy.cuda = types.SimpleNamespace(Device=Device, Stream=Stream)
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    if not with_torch:
        monkeypatch.setitem(sys.modules, "torch", None)  # import torch -> ImportError
        return calls
    torch = types.ModuleType("torch")
    torch.device = lambda kind, idx: (kind, idx)
    torch.cuda = types.SimpleNamespace(
        is_available=lambda: True,
        set_device=lambda d: calls.append(("torch.device", threading.current_thread().name, d)),
        ExternalStream=lambda ptr, device: ("ext", ptr, device),
        set_stream=lambda s: calls.append(("torch.stream", threading.current_thread().name, s)),
    )
    monkeypatch.setitem(sys.modules, "torch", torch)
    return calls


@pytest.mark.parametrize("with_torch", [False, True])
def test_local_spawn_sets_each_rank_device_and_own_stream(monkeypatch, with_torch):
    calls = _fake_cuda_modules(monkeypatch, with_torch)
    group = LocalGroup(3, devices=[0, 1, 1])
    first = group.spawn(lambda g: (threading.current_thread().name, g.device, g.stream_ptr))
    second = group.spawn(lambda g: g.stream_ptr)
    ptrs = [p for _, _, p in first]
    assert len(set(ptrs)) == 3, "each rank must get its own stream"
    assert second == ptrs, "streams are made once per LocalGroup and reused"
    # Every rank's stream, then every rank's communication stream, one after another on the spawning
    # thread (so that they get hardware queues of their own), each on its rank's device.
    comm = [group.rank_group(r).comm_stream.ptr for r in range(3)]
    made = [c[2] for c in calls if c[0] == "cupy.new_stream"]
    assert made == [(p, d) for p, d in zip(ptrs + comm, [0, 1, 1] * 2)]
    assert {c[1] for c in calls if c[0] == "cupy.new_stream"} == {threading.current_thread().name}
    for thread, device, ptr in first:
        mine = [c[0] + ":" + str(c[2]) for c in calls if c[1] == thread]
        assert f"cupy.device:{device}" in mine and f"cupy.stream:{ptr}" in mine and f"cupy.sync:{ptr}" in mine
        if with_torch:
            assert f"torch.device:{device}" in mine
            assert f"torch.stream:{('ext', ptr, ('cuda', device))}" in mine
    assert LocalGroup(2).spawn(lambda g: g.stream_ptr) == [None, None]


# ----------------------------------------------------------------------------- TCP store


def test_store_set_get_add_wait_delete():
    with TCPStoreServer("127.0.0.1", 0) as server, \
            TCPStoreClient("127.0.0.1", server.port, timeout_s=5.0) as a, \
            TCPStoreClient("127.0.0.1", server.port, timeout_s=5.0) as b:
        big = os.urandom(3 << 20)  # several MiB: replies span many recv calls
        a.set("big", big)
        assert b.get("big", timeout_s=5.0) == big
        assert [a.add("n", 2), b.add("n", 3), a.add("n", -1)] == [2, 5, 4]
        b.set("x", b"")
        a.wait(["big", "x", "n"], timeout_s=5.0)
        assert a.multi_get(["x", "n"], timeout_s=5.0) == [b"", b"4"]
        assert a.delete("x") and not a.delete("x")
        with pytest.raises(StoreTimeoutError) as info:
            a.wait(["big", "never", "x"], timeout_s=0.1)
        assert info.value.missing_keys == ["never", "x"]
        with pytest.raises(GroupError, match="not a counter"):
            a.add("big", 1)
        # A waiter is woken by a set from another connection.
        got = run_in_threads([lambda: b.get("late", timeout_s=30.0), lambda: a.set("late", b"v")])
        assert got[0] == b"v"


def test_store_keeps_one_copy_of_a_large_value_between_requests():
    """The server keeps what it stores, not also the request it came in: that was held until the
    same client's next request (twice a large value's memory, for as long as a rank sat idle)."""
    import tracemalloc

    if tracemalloc.is_tracing():
        pytest.skip("tracemalloc is already on (PYTHONTRACEMALLOC): this test would count and stop it")
    value = os.urandom(32 << 20)
    with TCPStoreServer("127.0.0.1", 0) as server, \
            TCPStoreClient("127.0.0.1", server.port, timeout_s=5.0) as client:
        tracemalloc.start()
        try:
            client.set("big", value)  # the client's own copies are gone when it returns
            deadline = time.monotonic() + 5.0  # the server lets go after its reply, not before
            while (held := tracemalloc.get_traced_memory()[0]) > 1.5 * len(value):
                assert time.monotonic() < deadline, f"{held >> 20} MiB held for a {len(value) >> 20} MiB value"
                time.sleep(0.01)
        finally:
            tracemalloc.stop()
        assert client.get("big", timeout_s=5.0) == value


class FakeClock:
    """time.monotonic and time.sleep of a module under test: sleeping advances the clock, nothing waits."""

    def __init__(self) -> None:
        self.now = 100.0
        self.attempts: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_connecting_retries_until_its_timeout_not_before(monkeypatch):
    """The backoff never gives up early: the last attempt comes at the deadline, and none after it."""
    from mooncake_ep import _tcp_store

    clock = FakeClock()

    def refuse(address, timeout):
        clock.attempts.append(clock.now)
        raise ConnectionRefusedError("refused")

    monkeypatch.setattr(_tcp_store, "time", types.SimpleNamespace(monotonic=clock.monotonic, sleep=clock.sleep))
    monkeypatch.setattr(_tcp_store.socket, "create_connection", refuse)
    with pytest.raises(ConnectionRefusedError):
        _tcp_store.connect("127.0.0.1", 1, timeout_s=3.0)
    assert clock.attempts[0] == 100.0 and clock.attempts[-1] == pytest.approx(103.0)
    assert len(clock.attempts) > 3


def test_store_port_already_taken():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(GroupError, match=rf"127\.0\.0\.1:{port}.*already in use.*MASTER_PORT"):
            TCPStoreServer("127.0.0.1", port)
        with pytest.raises(GroupError, match="MASTER_PORT"):
            TCPGroup(0, 2, master_port=port, timeout_s=SHORT_TIMEOUT_S)


def test_rank0_serves_the_store_on_a_socket_it_was_given():
    """A launcher that chose a free port, released it and handed it to rank 0 left a moment in which
    another program could take it (rank 0's bind then failed, or its peers met a stranger's store):
    one that passes the listening socket itself holds the port throughout."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    with pytest.raises(GroupError, match="already in use"):  # held: nothing else binds it meanwhile
        TCPStoreServer("127.0.0.1", port)
    groups = run_in_threads([lambda: TCPGroup(0, 2, master_port=port, store_socket=listener, timeout_s=30.0),
                             lambda: TCPGroup(1, 2, master_port=port, timeout_s=30.0)])
    assert run_in_threads([lambda g=g: g.allgather_bytes(bytes([g.rank])) for g in groups]) == [[b"\0", b"\1"]] * 2
    run_in_threads([group.close for group in groups])
    assert listener.fileno() == -1  # the store closed it with itself: the port is free again
    TCPStoreServer("127.0.0.1", port).close()


def test_a_store_socket_rank_0_cannot_serve_is_refused_naming_the_argument_and_left_open(clean_env):
    """The errors named listen_socket, the server's parameter, not the caller's store_socket; a socket bound
    to another address than master_addr's passed, and rank 0's own client then timed out connecting. A
    socket refused with the arguments stays the caller's: open."""
    with socket.create_server(("127.0.0.1", 0)) as listener, socket.socket() as unbound, \
            socket.create_server(("127.0.0.2", 0)) as elsewhere:
        port = listener.getsockname()[1]
        with pytest.raises(ValueError, match=r"^TCPGroup: store_socket is rank 0's, which serves the store; rank 1 "):
            TCPGroup(1, 2, master_port=port, store_socket=listener)
        with pytest.raises(ValueError, match=rf"^TCPGroup: store_socket listens on port {port}, not the store's "
                                             rf"port {port % 65535 + 1}$"):
            TCPGroup(0, 2, master_port=port % 65535 + 1, store_socket=listener)
        with pytest.raises(ValueError, match=r"^TCPGroup: store_socket must be a TCP socket that listens"):
            TCPGroup(0, 2, master_port=port, store_socket=unbound)
        with pytest.raises(TypeError, match=r"^TCPGroup: store_socket must be a socket\.socket, got int$"):
            TCPGroup(0, 2, master_port=port, store_socket=listener.fileno())
        with pytest.raises(ValueError, match=r"^init_group: store_socket configures the TCP store; with group="):
            init_group(LocalGroup(1).spawn(lambda g: g)[0], store_socket=listener)
        with pytest.raises(ValueError, match=r"^TCPGroup: store_socket is bound to 127\.0\.0\.2, which is not "
                                             r"master_addr '127\.0\.0\.1' \(127\.0\.0\.1\)"):
            init_group(rank=0, world_size=2, master_addr="127.0.0.1", store_socket=elsewhere, timeout_s=30.0)
        assert listener.fileno() != -1 and elsewhere.fileno() != -1


def test_a_store_socket_given_without_a_port_names_the_port_and_a_failed_join_closes_it(clean_env):
    """init_group(store_socket=...) without master_port (nor MASTER_PORT) checked the socket against port
    29500 and refused it; the port is the socket's. Once the store serves it, a failed join closes it."""
    listener = socket.create_server(("", 0))  # all addresses: master_addr's among them
    port = listener.getsockname()[1]
    with pytest.raises(GroupError, match=rf"waiting for ranks \[1\] of 2 \(MASTER_ADDR=127\.0\.0\.1, "
                                         rf"MASTER_PORT={port}\)"):
        init_group(rank=0, world_size=2, store_socket=listener, timeout_s=0.3)
    assert listener.fileno() == -1


def test_store_client_gives_up_when_rank0_never_starts():
    port = free_port()
    with pytest.raises(GroupError, match=rf"rank 1: could not connect to the store at 127\.0\.0\.1:{port}"):
        TCPGroup(1, 2, master_port=port, timeout_s=0.3)


def test_store_client_sees_lost_server():
    server = TCPStoreServer("127.0.0.1", 0)
    client = TCPStoreClient("127.0.0.1", server.port, timeout_s=5.0)
    client.set("k", b"v")
    server.close()
    with pytest.raises(GroupError, match="lost the connection|shutting down"):
        client.get("k", timeout_s=5.0)
    client.close()


def test_store_close_answers_pending_waits():
    server = TCPStoreServer("127.0.0.1", 0)
    client = TCPStoreClient("127.0.0.1", server.port, timeout_s=5.0)
    client.set("here", b"")

    def close_once_the_wait_is_pending():
        while server._num_busy == 0:  # the wait request is inside the server
            threading.Event().wait(0.001)
        server.close()

    out = run_in_threads([lambda: client.wait(["here", "never"], timeout_s=60.0), close_once_the_wait_is_pending])
    assert isinstance(out[0], GroupError) and not isinstance(out[0], StoreTimeoutError), out
    assert "closed" in str(out[0]) and out[0].missing_keys == ["never"]
    client.close()


def test_a_wait_past_its_limit_on_a_stalled_store_keeps_the_connection_and_its_claims(monkeypatch):
    """Rank 0's process stalled (its main thread holding the GIL for seconds, say) past a short wait's
    reply slack: the client closed the connection, which dropped every claim it held (the rank's
    membership, for good), though both processes were alive (helper-162). The wait still fails in
    time, and the late reply is read before the next request."""
    server = TCPStoreServer("127.0.0.1", 0)
    client = TCPStoreClient("127.0.0.1", server.port, timeout_s=5.0)
    assert client.claim("member/1")
    serve, stalled = server._serve, threading.Event()

    def stalled_wait(op, payload, client_socket=None):
        if op == _tcp_store._OP_WAIT and not stalled.is_set():
            stalled.set()
            time.sleep(1.0)  # past the 0.05-s wait's 0.5 s of slack
        return serve(op, payload, client_socket)
    monkeypatch.setattr(server, "_serve", stalled_wait)
    with pytest.raises(GroupError, match=r"no reply within 0.6 s: rank 0's process, which serves the store, stalled "
                                         r"or is overloaded; the connection stays"):
        client.wait(["never"], timeout_s=0.05)
    assert client._unread_replies == 1
    client.set("after", b"1")  # waits for the late reply (a timeout answer), drops it, then is answered
    assert client.get("after", timeout_s=1.0) == b"1" and client._unread_replies == 0
    other = TCPStoreClient("127.0.0.1", server.port, timeout_s=5.0)
    assert not other.claim("member/1")  # still held by the live client
    other.close()
    # A wait that settles claims (a round every rank must see complete, or none) instead waits for the
    # store's verdict: raising while the store settles the round with this rank's claim in it would
    # leave the peers a group this rank left (helper-164).
    stalled.clear()
    assert client.claim("round/1", b"mine")
    assert client.multi_get(["round/1"], 0.05, settle_claims=True, withdraw_claims=True) == [b"mine"]
    client.close()
    server.close()


def test_the_store_reads_a_request_in_pieces_no_larger_than_what_arrived(monkeypatch):
    """A header announcing 64 MiB that no data follows made the store allocate all of it at once, per
    connection (helper-162): the pieces now grow with the bytes that arrive."""
    sizes, recv_exact = [], _tcp_store._recv_exact
    monkeypatch.setattr(_tcp_store, "_recv_exact", lambda sock, size: sizes.append(size) or recv_exact(sock, size))
    server_end, client_end = socket.socketpair()
    with server_end, client_end:
        def send_3_mib_and_stop() -> None:
            client_end.sendall(bytes(3 << 20))
            client_end.shutdown(socket.SHUT_WR)
        sender = threading.Thread(target=send_3_mib_and_stop)
        sender.start()
        with pytest.raises(ConnectionError):
            _tcp_store._recv_in_pieces(server_end, 64 << 20)
        sender.join()
    assert sizes == [1 << 20, 1 << 20, 2 << 20], sizes  # 3 MiB came: the last piece found 1 MiB, then the end
    whole = bytes(range(256)) * ((5 << 20) // 256 + 1)
    server_end, client_end = socket.socketpair()
    with server_end, client_end:
        sender = threading.Thread(target=client_end.sendall, args=(whole,))
        sender.start()
        assert _tcp_store._recv_in_pieces(server_end, len(whole), prefix=b"k") == b"k" + whole
        sender.join()


def test_a_store_that_never_answers_the_hello_is_named_as_stalled_not_as_an_old_protocol():
    """Every store protocol answers a hello at once (an old one refuses it): a timeout means rank 0
    stopped or too busy to serve, which the error blamed on an older protocol (helper-146)."""
    with socket.create_server(("127.0.0.1", 0)) as silent:  # connections complete in its backlog, unanswered
        port = silent.getsockname()[1]
        with pytest.raises(GroupError, match=r"no answer to this rank's hello \(none within 0.3 s: rank 0's process "
                                             r"may be stopped or too busy to serve its store"):
            TCPStoreClient("127.0.0.1", port, timeout_s=0.3)


def test_a_store_that_closes_during_the_hello_is_named_as_closed_not_as_an_old_protocol():
    """Rank 0's process exiting after its listener accepted (a reset or end of file before any reply) was
    blamed on an older store protocol or another program; a reply that is not a store's still is."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        closer = threading.Thread(target=lambda: listener.accept()[0].close())  # closed with the hello unread
        closer.start()
        with pytest.raises(GroupError, match=r"no answer to this rank's hello \(.*: rank 0's store closed the "
                                             r"connection during the hello: its process may have exited") as info:
            TCPStoreClient("127.0.0.1", port, timeout_s=PROCESS_LIMIT_S)
        closer.join()
        assert "older store protocol" not in str(info.value)

        def answer_not_ours():
            conn = listener.accept()[0]
            with conn:
                conn.recv(64)
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")
        other = threading.Thread(target=answer_not_ours)
        other.start()
        with pytest.raises(GroupError, match=r"no answer to this rank's hello \(a reply that is not the store's "
                                             r"\(status 72\): rank 0 may run a mooncake_ep of an older store protocol"):
            TCPStoreClient("127.0.0.1", port, timeout_s=PROCESS_LIMIT_S)
        other.join()


def test_store_reads_a_hello_that_came_in_time_while_its_own_process_was_stalled(monkeypatch):
    """The deadline was checked before any read: a hello waiting in the socket's buffer was refused when
    rank 0's process itself had been held past the deadline (Ctrl-Z, a call holding the GIL), and the
    client was told its store spoke an older protocol."""
    monkeypatch.setattr(_tcp_store, "_HELLO_DEADLINE_S", 0.1)
    greet = _tcp_store._StoreHandler._greet

    def stalled_then_greets(sock, store, deadline):
        time.sleep(0.3)  # the handler's deadline set, then its process stalled; the hello arrived meanwhile
        return greet(sock, store, deadline)

    monkeypatch.setattr(_tcp_store._StoreHandler, "_greet", staticmethod(stalled_then_greets))
    with TCPStoreServer("127.0.0.1", 0) as server, \
            TCPStoreClient("127.0.0.1", server.port, timeout_s=PROCESS_LIMIT_S) as client:
        client.set("k", b"v")
        assert client.get("k", timeout_s=1.0) == b"v"


def _wait_for(condition, what):
    deadline = time.monotonic() + PROCESS_LIMIT_S
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_connections_without_a_hello_neither_refuse_clients_nor_hold_threads_past_their_own_bound(monkeypatch,
                                                                                                    caplog):
    """Connections past _MAX_CONNECTIONS were refused uncounted but each kept a thread until its hello
    deadline (silent ones grew rank 0's threads with their rate), and silent ones counted toward the
    bound, so a port scan refused real ranks. Now the silent ones have their own bound, past which the
    accept thread closes them with no thread, and only clients count toward _MAX_CONNECTIONS."""
    monkeypatch.setattr(_tcp_store, "_MAX_CONNECTIONS", 2)
    monkeypatch.setattr(_tcp_store, "_MAX_UNGREETED_CONNECTIONS", 3)
    with TCPStoreServer("127.0.0.1", 0) as server, contextlib.ExitStack() as stack:
        # The store's handler threads by name (socketserver's target): other tests' threads may come and go.
        handlers = lambda: sum("process_request_thread" in t.name for t in threading.enumerate())  # noqa: E731
        handlers_before = handlers()
        silent = [stack.enter_context(socket.create_connection(("127.0.0.1", server.port))) for _ in range(3)]
        _wait_for(lambda: handlers() - handlers_before == 3, "a thread per silent connection")
        past = [stack.enter_context(socket.create_connection(("127.0.0.1", server.port))) for _ in range(20)]
        assert all(_closed_by_the_server(sock) for sock in past)  # at once, on the accept thread
        assert handlers() - handlers_before == 3
        assert caplog.text.count("have not said the store's hello yet") == 1, caplog.text  # said once while full
        silent[0].close()
        _wait_for(lambda: len(server._clients) == 2, "the handler let the closed one go")
        clients = [stack.enter_context(TCPStoreClient("127.0.0.1", server.port, timeout_s=PROCESS_LIMIT_S))
                   for _ in range(2)]  # the silent ones count not toward the clients' bound
        clients[0].set("k", b"v")
        assert clients[1].get("k", timeout_s=1.0) == b"v"
        with pytest.raises(GroupError, match=r"refused this rank: the store serves 2 connections already"):
            TCPStoreClient("127.0.0.1", server.port, timeout_s=PROCESS_LIMIT_S)


def test_store_close_does_not_wait_for_connections_that_never_said_hello():
    """A port scanner, or another protocol's client that sent less than a header, holds a connection the
    store never serves and that may never hang up: close(wait_for_clients_s) waited for it all that time
    (rank 0's close after a final barrier allows its clients the group's whole timeout_s)."""
    server = TCPStoreServer("127.0.0.1", 0)
    client = TCPStoreClient("127.0.0.1", server.port, timeout_s=5.0)
    client.set("k", b"v")
    with socket.create_connection(("127.0.0.1", server.port)) as scanner, \
            socket.create_connection(("127.0.0.1", server.port)) as stranger:
        stranger.sendall(b"GET")
        deadline = time.monotonic() + PROCESS_LIMIT_S
        while len(server._clients) < 3:  # the server holds both connections
            assert time.monotonic() < deadline, server._clients
            time.sleep(0.01)
        client.close()
        start = time.monotonic()
        server.close(wait_for_clients_s=PROCESS_LIMIT_S)
        close_s = time.monotonic() - start
        assert scanner.recv(1) == b"" and stranger.recv(1) == b""  # the store's close ended them
    assert close_s < PROCESS_LIMIT_S / 2  # not a timing claim: without the fix it returns only when the wait ends


def _closed_by_the_server(sock: socket.socket) -> bool:
    """Whether the server closed ``sock`` (waiting up to 10 s for it to): end of file, or a reset where
    it closed with bytes of ours unread."""
    sock.settimeout(10.0)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_store_drops_a_connection_that_says_no_hello_in_time(monkeypatch, caplog):
    """A connection that said nothing, or trickled its hello a byte at a time, held a connection and a
    thread of rank 0's process for as long as it stayed open: the store had no deadline for the hello."""
    monkeypatch.setattr(_tcp_store, "_HELLO_DEADLINE_S", 0.5)  # (a slow CI host still says a real hello in time)
    caplog.set_level(logging.DEBUG, logger=_tcp_store.logger.name)
    with TCPStoreServer("127.0.0.1", 0) as server:
        with socket.create_connection(("127.0.0.1", server.port)) as silent:
            assert _closed_by_the_server(silent)
        with socket.create_connection(("127.0.0.1", server.port)) as trickle:  # each byte within 0.5 s, the whole not
            with contextlib.suppress(OSError):  # (the store hangs up midway)
                for byte in _tcp_store.hello(_tcp_store._PROTOCOL_VERSION):
                    trickle.send(bytes([byte]))
                    time.sleep(0.1)
            assert _closed_by_the_server(trickle)
        drops = [r.levelname for r in caplog.records if "said no hello within 0.5 s" in r.getMessage()]
        assert drops == ["WARNING", "DEBUG"], drops  # warned of once: a flood of them must not flood the log
        deadline = time.monotonic() + PROCESS_LIMIT_S
        while server._clients:  # their handlers have let them go
            assert time.monotonic() < deadline
            time.sleep(0.01)
        with TCPStoreClient("127.0.0.1", server.port, timeout_s=5.0) as client:  # a client's hello is in time
            time.sleep(0.6)  # past the hello's deadline: a greeted connection has none
            client.set("k", b"v")
            assert client.get("k", timeout_s=1.0) == b"v"


def test_store_refuses_connections_past_its_bound_and_names_it(monkeypatch, caplog):
    """Every connection was served, each with a thread: a process reconnecting in a loop grew rank 0's
    threads without bound. Past _MAX_CONNECTIONS a new one is refused, its client told why; one that
    closes makes room again."""
    monkeypatch.setattr(_tcp_store, "_MAX_CONNECTIONS", 2)
    with TCPStoreServer("127.0.0.1", 0) as server:
        first = TCPStoreClient("127.0.0.1", server.port, timeout_s=5.0)
        with TCPStoreClient("127.0.0.1", server.port, timeout_s=5.0) as second:
            for _ in range(2):
                with pytest.raises(GroupError, match=r"refused this rank: the store serves 2 connections already, "
                                                     r"the most it serves .*: some process keeps connecting"):
                    TCPStoreClient("127.0.0.1", server.port, timeout_s=5.0)
            assert caplog.text.count("the most the store serves") == 1, caplog.text  # said once while full
            first.close()
            deadline = time.monotonic() + PROCESS_LIMIT_S
            while len(server._clients) > 1:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            with TCPStoreClient("127.0.0.1", server.port, timeout_s=5.0) as third:
                third.set("k", b"v")
                assert second.get("k", timeout_s=1.0) == b"v"


def test_store_says_when_it_runs_out_of_descriptors_and_serves_once_one_is_free(caplog):
    """A rank 0 at its open-file limit (ulimit -n below a descriptor per rank) failed every accept in
    silence (socketserver drops the error), its accept loop spinning, while the ranks waited for an
    answer to their hello until their timeout_s: nothing said why."""
    resource = pytest.importorskip("resource")
    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("needs /proc/self/fd to find the descriptors open")
    with TCPStoreServer("127.0.0.1", 0) as server, socket.socket() as waiting:  # its descriptor made before the limit
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        fillers = []
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (1 + max(map(int, os.listdir("/proc/self/fd"))), hard))
            with contextlib.suppress(OSError):  # every free descriptor below the limit taken: accept finds none
                while True:
                    fillers.append(os.open(os.devnull, os.O_RDONLY))
            waiting.connect(("127.0.0.1", server.port))  # completes in the listen queue
            deadline = time.monotonic() + 10.0
            while "cannot accept connections" not in caplog.text:
                assert time.monotonic() < deadline, "the store said nothing"
                time.sleep(0.01)
        finally:
            for fd in fillers:
                os.close(fd)
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        assert "raise its limit (ulimit -n)" in caplog.text
        waiting.settimeout(PROCESS_LIMIT_S)
        waiting.sendall(_tcp_store.hello(_tcp_store._PROTOCOL_VERSION))  # accepted once a descriptor is free
        assert _tcp_store._recv_exact(waiting, _tcp_store._HEADER.size) == _tcp_store._HEADER.pack(_tcp_store._OK, 0)


def test_store_close_waits_only_for_the_clients_connected_when_it_was_called(monkeypatch):
    """A failed rank 0 lets the ranks connected to it hang up first; a peer that reconnects at once to
    retry joined a store about to close, and held it (and rank 0's error) open for the whole wait."""
    server = TCPStoreServer("127.0.0.1", 0)
    first = TCPStoreClient("127.0.0.1", server.port, timeout_s=5.0)
    assert server.num_clients == 1
    waiting = threading.Event()
    wait_for = server._cond.wait_for

    def signalled_wait_for(predicate, timeout=None):
        waiting.set()  # close() has listed the clients it waits for
        return wait_for(predicate, timeout)

    monkeypatch.setattr(server._cond, "wait_for", signalled_wait_for)
    closed = []
    closing = threading.Thread(target=lambda: closed.append(_threads.call_or_error(
        lambda: server.close(wait_for_clients_s=PROCESS_LIMIT_S))))
    closing.start()
    assert waiting.wait(PROCESS_LIMIT_S)
    with TCPStoreClient("127.0.0.1", server.port, timeout_s=5.0) as retry:  # greeted while close() waits
        retry.set("k", b"v")
        first.close()
        closing.join(PROCESS_LIMIT_S)
        assert closed == [None] and not closing.is_alive()  # without the fix close() waits for retry too
        with pytest.raises(GroupError):
            retry.get("k", timeout_s=5.0)


def test_store_close_interrupted_while_it_waits_still_closes(monkeypatch):
    """Ctrl-C while rank 0 waits for its peers to hang up: the store still stops and frees its port
    (it kept serving until the failed group was collected, and a retry found the port taken)."""
    server = TCPStoreServer("127.0.0.1", 0)
    client = TCPStoreClient("127.0.0.1", server.port, timeout_s=5.0)
    wait_for = server._cond.wait_for
    calls = []

    def interrupted_once(predicate, timeout=None):
        calls.append(timeout)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return wait_for(predicate, timeout)

    monkeypatch.setattr(server._cond, "wait_for", interrupted_once)
    with pytest.raises(KeyboardInterrupt):
        server.close(wait_for_clients_s=PROCESS_LIMIT_S)
    assert calls[0] == pytest.approx(PROCESS_LIMIT_S, abs=1.0)
    with TCPStoreServer("127.0.0.1", server.port):  # the port is free again
        pass
    with pytest.raises(GroupError):
        client.get("k", timeout_s=5.0)
    client.close()


def test_store_connections_keep_alive_and_the_listener_queues_a_whole_start_up():
    """A host that vanishes leaves an idle connection, and its rank's claims, that TCP without
    keepalive keeps for hours; every rank connects at once at start-up (a queue of 5 left the rest
    to SYN back-off, and hundreds of ranks to time out)."""
    with TCPStoreServer("127.0.0.1", 0) as server, TCPStoreClient("127.0.0.1", server.port, timeout_s=5.0) as client:
        client.set("k", b"v")  # served: the server's end of the connection is configured
        with server._cond:
            ends = [client._sock, *server._clients]
        assert len(ends) == 2
        for sock in ends:
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
            if hasattr(socket, "TCP_KEEPIDLE"):
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) <= 10
        assert server._server.request_queue_size >= 128


def test_store_client_close_from_another_thread_ends_a_wait_in_flight():
    """close() used to wait on the request lock, which a wait holds for its whole timeout (forever
    with math.inf): a group's close, or the process's exit, stalled behind a rank's pending wait."""
    with TCPStoreServer("127.0.0.1", 0) as server:
        client = TCPStoreClient("127.0.0.1", server.port, timeout_s=5.0)

        def close_once_the_wait_is_pending():
            while server._num_busy == 0:  # the wait request is inside the server
                threading.Event().wait(0.001)
            start = time.monotonic()
            client.close()
            return time.monotonic() - start

        # A finite wait, so that a regression fails (after it) instead of hanging.
        waited, close_s = run_in_threads([lambda: client.wait(["never"], timeout_s=60.0),
                                          close_once_the_wait_is_pending])
        assert isinstance(waited, GroupError) and "was closed (close()) while this request waited" in str(waited), \
            waited
        assert close_s < 30.0  # not a timing claim: without the fix it returns only when the wait does
        client.close()  # idempotent


def test_store_client_refuses_keys_and_amounts_of_the_wrong_type():
    with TCPStoreServer("127.0.0.1", 0) as server, TCPStoreClient("127.0.0.1", server.port, timeout_s=5.0) as client:
        with pytest.raises(TypeError, match=r"TCPStoreClient.wait: keys must be a sequence of str, got one str"):
            client.wait("c/0/0", 0.1)
        with pytest.raises(TypeError, match=r"TCPStoreClient: a key must be a str, got int"):
            client.set(7, b"x")
        with pytest.raises(TypeError, match=r"TCPStoreClient.add: amount must be an int, got str"):
            client.add("n", "1")
        assert client.add("n", 1) == 1  # the connection is still in step


def test_store_client_argument_errors_name_the_call_and_argument_and_keep_the_connection():
    """get's errors named multi_get, set's and claim's named an argument called data, and a negative
    reply_bytes reached the socket's settimeout as a bare ValueError, which closed the connection (and
    with it the rank's claims)."""
    with TCPStoreServer("127.0.0.1", 0) as server, TCPStoreClient("127.0.0.1", server.port, timeout_s=5.0) as client:
        with pytest.raises(StoreTimeoutError, match=r"^TCPStoreClient.get: timed out after 0.1 s waiting for keys"):
            client.get("missing", 0.1)
        with pytest.raises(ValueError, match=r"^TCPStoreClient.get: timeout_s must be > 0"):
            client.get("missing", 0)
        with pytest.raises(TypeError, match=r"^TCPStoreClient.set: value must be bytes, got str"):
            client.set("k", "v")
        with pytest.raises(TypeError, match=r"^TCPStoreClient.claim: value must be bytes, got int"):
            client.claim("k", 1)
        with pytest.raises(ValueError, match=r"^TCPStoreClient.multi_get: reply_bytes must be >= 0, got -1"):
            client.multi_get(["k"], 0.1, reply_bytes=-1)
        with pytest.raises(ValueError, match=r"^TCPStoreClient: timeout_s must be > 0"):
            client.timeout_s = 0
        with pytest.raises(ValueError, match=r"^TCPStoreClient.add: amount must fit a signed 64-bit counter"):
            client.add("n", 1 << 63)
        assert client.timeout_s == 5.0 and client.add("n", 1) == 1  # the connection is still in step


def test_store_add_past_the_signed_64_bit_range_is_refused_and_changes_nothing():
    """The server stored the sum before packing it, then answered "malformed request": the caller saw
    a failure and the counter had moved."""
    with TCPStoreServer("127.0.0.1", 0) as server, TCPStoreClient("127.0.0.1", server.port, timeout_s=5.0) as client:
        top = (1 << 63) - 1
        assert client.add("n", top) == top
        with pytest.raises(GroupError, match=r"add: key 'n' would pass the signed 64-bit range \(9223372036854775808\)"):
            client.add("n", 1)
        assert client.get("n", 1.0) == str(top).encode()
        assert client.add("n", -top) == 0


def test_store_drops_a_set_longer_than_any_set_and_its_key_is_not_held_arriving(caplog):
    """A set's header claiming more bytes than a set can hold marked its key arriving for the transfer
    time of that length (hours): a wait on the key went on that long, or overflowed the client's socket
    timeout, which closed the waiter's connection."""
    from mooncake_ep import _tcp_store

    with TCPStoreServer("127.0.0.1", 0) as server, TCPStoreClient("127.0.0.1", server.port, timeout_s=5.0) as client, \
            socket.create_connection(("127.0.0.1", server.port)) as raw:
        raw.settimeout(PROCESS_LIMIT_S)  # a regression fails instead of hanging
        raw.sendall(_tcp_store.hello(_group_common._PROTOCOL_VERSION))
        assert _tcp_store._HEADER.unpack(_tcp_store._recv_exact(raw, _tcp_store._HEADER.size))[0] == _tcp_store._OK
        raw.sendall(_tcp_store._HEADER.pack(_tcp_store._OP_SET, 1 << 62) + _tcp_store._pack_key("k"))
        assert raw.recv(1) == b""  # dropped
        with pytest.raises(StoreTimeoutError, match=r"waiting for keys \['k'\]$"):
            client.get("k", 0.1)
        client.set("k", b"v")  # the waiter's connection is in step
        assert client.get("k", 1.0) == b"v"
    assert "past the largest a set can be" in caplog.text


def test_store_wait_past_its_time_for_a_value_still_arriving_says_so(monkeypatch):
    """A wait the store extends for a large value still coming in (its setter stalled) said only that
    it timed out after its own timeout_s."""
    from mooncake_ep import _tcp_store

    monkeypatch.setattr(_tcp_store, "_REPLY_SLACK_S", (0.2, 1.0))  # the allowance: 1 s + bytes at 20 MB/s
    monkeypatch.setattr(_tcp_store, "_DEAD_CLIENT_POLL_S", 0.05)  # how often the store tells the waiter
    size = 2 * _tcp_store._ARRIVING_SET_BYTES
    with TCPStoreServer("127.0.0.1", 0) as server, TCPStoreClient("127.0.0.1", server.port, timeout_s=5.0) as client, \
            socket.create_connection(("127.0.0.1", server.port)) as setter:
        setter.sendall(_tcp_store.hello(_group_common._PROTOCOL_VERSION))
        _tcp_store._recv_exact(setter, _tcp_store._HEADER.size)
        key = _tcp_store._pack_key("big")
        setter.sendall(_tcp_store._HEADER.pack(_tcp_store._OP_SET, len(key) + 4 + size) + key
                       + struct.pack("!I", size) + bytes(size // 2))  # half the value, then it stalls
        deadline = time.monotonic() + PROCESS_LIMIT_S
        while not server._arriving_keys:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        with pytest.raises(StoreTimeoutError, match=rf"after 0.1 s waiting for keys \['big'\] \(and longer: the store "
                                                    rf"held the wait while a value of {len(key) + 4 + size} "
                                                    rf"bytes") as info:
            client.get("big", 0.1)
        # For the group's own message, which it words itself (helper-146: the extension was lost there).
        assert info.value.extended.startswith(" (and longer: the store held the wait"), info.value.extended


def test_store_connection_that_registers_after_close_listed_its_clients_is_not_served():
    """close() shut down the connections it had listed; one whose handler registered after that (accepted
    just before the listener stopped) was served by the closed store until its client hung up."""
    server = TCPStoreServer("127.0.0.1", 0)
    server.close()
    ours, theirs = socket.socketpair()
    with ours, theirs:
        ours.settimeout(PROCESS_LIMIT_S)  # a regression fails instead of hanging
        assert not server._admit(theirs)  # what a connection accepted now is told
        assert ours.recv(1) == b"" and not server._clients


def test_store_client_request_waits_for_another_threads_only_up_to_its_own_limit():
    """A set behind another thread's wait on the same client waited out that whole wait (forever with
    math.inf), whatever the client's timeout_s: a thread waiting for a key that another sets through the
    same client waited for itself."""
    with TCPStoreServer("127.0.0.1", 0) as server, TCPStoreClient("127.0.0.1", server.port, timeout_s=0.2) as client:
        def set_once_the_wait_is_pending():
            while server._num_busy == 0:  # the wait request is inside the server
                threading.Event().wait(0.001)
            return client.set("ready", b"1")

        waited, set_ = run_in_threads([lambda: client.wait(["ready"], timeout_s=5.0), set_once_the_wait_is_pending])
        assert isinstance(set_, GroupError) and "another thread's request on this connection held it past this " \
            "request's limit (0.2 s)" in str(set_), set_
        assert isinstance(waited, StoreTimeoutError), waited
        client.set("ready", b"1")  # in step
        assert client.get("ready", 1.0) == b"1"


# ----------------------------------------------------------------------------- TCPGroup, threads


def test_tcp_group_in_threads_missing_and_duplicate_rank():
    port = free_port()
    make = [lambda r=r: TCPGroup(r, 3, master_port=port, timeout_s=SHORT_TIMEOUT_S) for r in (0, 1, 1)]
    out = run_in_threads(make)
    assert all(isinstance(e, GroupError) for e in out), out
    messages = sorted(str(e) for e in out)
    assert sum("rank 1 joined" in m and "twice" in m for m in messages) == 1, messages
    # Rank 0 times out, and so does the other rank 1 (rank 0, giving up first, keeps its store up until
    # it has hung up). Both name the rank that never came, and the one whose wait failed second also
    # the other (it withdrew its slot), saying that it came and left.
    waited = [m for m in messages if "twice" not in m]
    assert len(waited) == 2 and all(m.startswith(f"init_group #0 timed out after {SHORT_TIMEOUT_S} s ")
                                    for m in waited), messages
    where = re.escape(f" of 3 (MASTER_ADDR=127.0.0.1, MASTER_PORT={port})")
    came_and_left = r"; of these, ranks \[\1\] came and left \(their own init_group failed first\)"
    assert all(re.search(rf"waiting for ranks \[2\]{where}$|waiting for ranks \[([01]), 2\]{where}{came_and_left}$", m)
               for m in waited), messages


def test_tcp_group_names_a_rank_that_came_and_left_the_rendezvous():
    """Rank 1 gives up first and takes its slot with it: rank 0's wait then names it with the rank
    that never came, and says that it came and left (not that it never started)."""
    port = free_port()
    rank0 = _threads.tcp_rank0_in_its_round(port, 3, 4 * SHORT_TIMEOUT_S, PROCESS_LIMIT_S)
    with pytest.raises(GroupError, match=r"^init_group #0 timed out after 0\.2 s waiting for ranks \[2\] of 3 "):
        TCPGroup(1, 3, master_port=port, timeout_s=0.2)
    assert str(rank0()) == (f"init_group #0 timed out after {4 * SHORT_TIMEOUT_S} s waiting for ranks [1, 2] of 3 "
                             f"(MASTER_ADDR=127.0.0.1, MASTER_PORT={port}); of these, ranks [1] came and left (their "
                             f"own init_group failed first)")


def test_tcp_group_rank0_that_gives_up_first_keeps_its_store_up_for_the_others_to_time_out():
    """Rank 0 gives up first (ranks started with one timeout_s a moment apart): it keeps serving
    the store until rank 1 hangs up, so rank 1's own wait runs out and names rank 0 as one that came
    and left, where a store closed at once had cut it short with "store closed"."""
    port = free_port()
    rank0 = _threads.tcp_rank0_in_its_round(port, 3, 2 * SHORT_TIMEOUT_S, PROCESS_LIMIT_S)  # runs out first
    time.sleep(SHORT_TIMEOUT_S / 2)  # rank 1's process started later: rank 0 has raised before rank 1's wait runs out
    with pytest.raises(GroupError) as rank1:
        TCPGroup(1, 3, master_port=port, timeout_s=2 * SHORT_TIMEOUT_S)
    where = f"(MASTER_ADDR=127.0.0.1, MASTER_PORT={port})"
    assert str(rank0()) == f"init_group #0 timed out after {2 * SHORT_TIMEOUT_S} s waiting for ranks [2] of 3 {where}"
    assert str(rank1.value) == (f"init_group #0 timed out after {2 * SHORT_TIMEOUT_S} s waiting for ranks [0, 2] of 3 "
                                f"{where}; of these, ranks [0] came and left (their own init_group failed first)")


def mismatch_message(sizes: str, outside: str = "") -> str:
    """The start of what every rank of a rendezvous with different world sizes raises."""
    return (f"init_group: ranks disagree on world_size ({sizes}){outside}: start every rank with the same "
            f"world_size (WORLD_SIZE)")


@pytest.mark.parametrize("sizes, seen", [
    # A smaller WORLD_SIZE on rank 1, with a rank 2 that fits rank 0: the round completes for ranks 0 and 2.
    ((3, 2, 3), ["ranks [0, 2]: 3, rank 1: 2", "rank 0: 3, rank 1: 2", "ranks [0, 2]: 3, rank 1: 2"]),
    # A larger one on ranks 1 and 2: rank 0 saw it in its round and closed its store, and rank 1, waiting
    # for rank 2, was told only "store closed"; rank 2 is outside rank 0's group, and now reads rank 0's
    # world_size, which rank 0 keeps serving until it has, instead of waiting in a round it has no part in.
    ((2, 3, 3), ["rank 0: 2, rank 1: 3", "rank 0: 2, rank 1: 3", "rank 0: 2, rank 2: 3"]),
])
def test_tcp_group_world_size_mismatch_is_named_on_every_rank(sizes, seen):
    port = free_port()
    out = run_in_threads([lambda r=r, w=w: TCPGroup(r, w, master_port=port, timeout_s=PROCESS_LIMIT_S)
                          for r, w in enumerate(sizes)])
    assert all(isinstance(e, RankMismatchError) for e in out), out
    outside = ["", "", ", and rank 2 is outside rank 0's group of 2" if sizes[0] == 2 else ""]
    assert [str(e) for e in out] == [mismatch_message(s, o) for s, o in zip(seen, outside)]


def test_tcp_group_larger_world_size_on_rank1_only(monkeypatch, caplog):
    """RANK=1 WORLD_SIZE=3 with a rank 0 of 2, and no rank 2: rank 1 reads rank 0's world_size and
    raises at once (it was told "store closed"); rank 0 names it from its round, after waiting (here
    briefly) for the rank 2 that rank 1's world_size says exists."""
    monkeypatch.setattr(_group_common, "_MISMATCH_GRACE_S", 0.1)
    port = free_port()
    out = run_in_threads([lambda r=r, w=w: TCPGroup(r, w, master_port=port, timeout_s=PROCESS_LIMIT_S)
                          for r, w in enumerate((2, 3))])
    assert all(isinstance(e, RankMismatchError) for e in out), out
    assert [str(e) for e in out] == [mismatch_message("rank 0: 2, rank 1: 3")] * 2
    assert "rank 0 keeps the store up for rank 2 to read why" in caplog.text


def test_tcp_group_rank_restarted_into_a_round_a_wrong_world_size_spoiled_is_refused():
    """A rank 1 started with WORLD_SIZE=2 in rank 0's group of 3 leaves its pair in its slot for the
    round's ranks to name, and raises. Restarted with the right world_size, rank 1 does not take the
    slot over: ranks that read the pair in a complete round have raised, and it would complete the
    round with the others (a split group). It says why; rank 0 still names the mismatch."""
    port = free_port()
    rank0 = _threads.tcp_rank0_in_its_round(port, 3, 4 * SHORT_TIMEOUT_S, PROCESS_LIMIT_S)
    with pytest.raises(RankMismatchError, match=r"\(rank 0: 3, rank 1: 2\)"):
        TCPGroup(1, 2, master_port=port, timeout_s=PROCESS_LIMIT_S)
    with pytest.raises(GroupError, match=r"^init_group: rank 1's slot of the rendezvous \(MASTER_ADDR=127\.0\.0\.1, "
                                         r"MASTER_PORT=\d+\) holds the world_size of a process of this rank started "
                                         r"with another one, .*restart every rank with the same world_size"):
        TCPGroup(1, 3, master_port=port, timeout_s=PROCESS_LIMIT_S)
    outcome = rank0()
    assert isinstance(outcome, RankMismatchError) and "(rank 0: 3, rank 1: 2)" in str(outcome), outcome


def test_tcp_group_rank0_names_a_smaller_world_size_when_its_wait_runs_out(monkeypatch):
    """Rank 1 said 2 and left; rank 0 (3) waits for a rank 2 that never comes. When the wait runs
    out it names rank 1's world_size, which it reads from rank 1's slot of the round, not only the
    missing rank."""
    port = free_port()
    rank1_done = threading.Event()
    wait = TCPGroup._kv_multi_get

    def round_after_rank1(self, keys, timeout_s, **kwargs):
        if self.rank == 0 and len(keys) == 3:  # rank 0's init_group round starts once rank 1 has left
            assert rank1_done.wait(PROCESS_LIMIT_S)
        return wait(self, keys, timeout_s, **kwargs)

    def rank1():
        try:
            return TCPGroup(1, 2, master_port=port, timeout_s=PROCESS_LIMIT_S)
        finally:
            rank1_done.set()

    monkeypatch.setattr(TCPGroup, "_kv_multi_get", round_after_rank1)
    out = run_in_threads([lambda: TCPGroup(0, 3, master_port=port, timeout_s=SHORT_TIMEOUT_S), rank1])
    assert all(isinstance(e, RankMismatchError) for e in out), out
    message = mismatch_message("rank 0: 3, rank 1: 2")
    assert str(out[1]) == message
    assert str(out[0]) == (f"{message}; init_group #0 timed out after {SHORT_TIMEOUT_S} s waiting for ranks [2] of 3 "
                           f"(MASTER_ADDR=127.0.0.1, MASTER_PORT={port})")


def test_tcp_group_rank_outside_a_running_group_is_refused_and_leaves_it_alone():
    port = free_port()
    groups = run_in_threads([lambda r=r: TCPGroup(r, 2, master_port=port, timeout_s=PROCESS_LIMIT_S) for r in range(2)])
    assert all(isinstance(g, TCPGroup) for g in groups), groups
    # Two rounds past the rendezvous (a process with RANK=2 WORLD_SIZE=3 once waited for rank 0's key of
    # round 0, then deleted by now; the rendezvous's slots stay since, as the record of who joined).
    rounds = run_in_threads([lambda g=g: [g.allgather_bytes(bytes([g.rank])) for _ in range(2)] for g in groups])
    assert rounds == [[[b"\0", b"\1"]] * 2] * 2
    with pytest.raises(RankMismatchError) as info:
        TCPGroup(2, 3, master_port=port, timeout_s=PROCESS_LIMIT_S)
    assert str(info.value) == mismatch_message("rank 0: 2, rank 2: 3", ", and rank 2 is outside rank 0's group of 2")
    # So is a second rank 1 started with another world_size, before it claims the rank; it leaves rank 1's
    # slot of the rendezvous as it was.
    with pytest.raises(RankMismatchError, match=r"\(rank 0: 2, rank 1: 3\)"):
        TCPGroup(1, 3, master_port=port, timeout_s=PROCESS_LIMIT_S)
    with TCPStoreClient("127.0.0.1", port, timeout_s=PROCESS_LIMIT_S) as probe:
        assert probe.get("c/0/1", timeout_s=PROCESS_LIMIT_S) == _group_common._slot_value(
            "init_group", _group_common._INIT.pack(_group_common._PROTOCOL_VERSION, 2))
    assert run_in_threads([lambda g=g: g.allgather_bytes(bytes([g.rank])) for g in groups]) == [[b"\0", b"\1"]] * 2
    run_in_threads([lambda g=g: g.close() for g in groups])


def test_tcp_group_in_threads_collectives_and_broken_after_timeout():
    port = free_port()
    groups = run_in_threads([lambda r=r: TCPGroup(r, 2, master_port=port, timeout_s=30.0) for r in range(2)])
    assert all(isinstance(g, TCPGroup) and isinstance(g, Group) for g in groups), groups
    assert run_in_threads([lambda g=g: g.allgather_bytes(bytes([g.rank])) for g in groups]) == [[b"\0", b"\1"]] * 2
    # Rank 0 calls barrier, rank 1 allgather: both see the mismatch.
    out = run_in_threads([groups[0].barrier, lambda: groups[1].allgather_bytes(b"x")])
    assert all(isinstance(e, GroupError) and "other collectives" in str(e) for e in out), out
    with pytest.raises(GroupError, match="broken by an earlier failure"):
        groups[0].barrier()
    run_in_threads([lambda g=g: g.close() for g in groups])


def test_tcp_group_timeout_in_collective_names_rank():
    port = free_port()
    groups = run_in_threads([lambda r=r: TCPGroup(r, 3, master_port=port, timeout_s=30.0) for r in range(3)])
    for g in groups:
        g.timeout_s = 0.2
    out = run_in_threads([lambda: groups[0].allgather_bytes(b"a"), lambda: groups[2].allgather_bytes(b"c")])
    for e in out:
        assert isinstance(e, GroupError)
        assert f"allgather_bytes #0 timed out after 0.2 s waiting for ranks [1] of 3 " \
               f"(MASTER_ADDR=127.0.0.1, MASTER_PORT={port})" == str(e)
    with pytest.raises(GroupError, match="broken"):
        groups[0].allgather_bytes(b"a")
    for g in groups:
        g.close(final_barrier=False)


def test_tcp_group_refuses_data_past_the_store_limit_before_the_round(monkeypatch):
    """A value past the store's limit (4 GiB; here 64 bytes) was refused by the store's client inside the
    round, after the rank's sequence number had moved on: its group was broken and its peers timed out.
    Refused before the round now, the rank's next call meets the peers' waiting one."""
    from mooncake_ep import _tcp_store

    monkeypatch.setattr(_tcp_store, "_MAX_VALUE_BYTES", 64)
    port = free_port()
    groups = run_in_threads([lambda r=r: TCPGroup(r, 2, master_port=port, timeout_s=30.0) for r in range(2)])
    refused = []

    def oversized_then_fixed(g):
        with pytest.raises(ValueError) as info:
            g.allgather_bytes(bytes(64))  # with the tag byte, one past the limit
        refused.append(str(info.value))
        return g.allgather_bytes(bytes(63))  # the most that fits

    assert run_in_threads([lambda: groups[0].allgather_bytes(b"a"), lambda: oversized_then_fixed(groups[1])]) == \
        [[b"a", bytes(63)]] * 2
    assert refused == ["allgather_bytes: data must be at most 63 bytes (what a TCPGroup's store holds in one value, "
                       "less the collective's tag byte), got 64 bytes"]
    assert run_in_threads([lambda g=g: g.allgather_bytes(bytes([g.rank])) for g in groups]) == [[b"\0", b"\1"]] * 2
    run_in_threads([lambda g=g: g.close() for g in groups])


def test_tcp_group_waits_past_what_sockets_hold_and_any_failed_round_breaks_it():
    """A timeout too long for a socket (1e10 s) waits as forever does, instead of an OverflowError
    after the round's sequence number was spent; and a round stopped by anything (here a bug of a
    store call) breaks the group as a GroupError does, so the ranks cannot fall out of step."""
    port = free_port()
    groups = run_in_threads([lambda r=r: TCPGroup(r, 2, master_port=port, timeout_s=30.0) for r in range(2)])
    for g in groups:
        g.timeout_s = 1e10
    assert run_in_threads([lambda g=g: g.allgather_bytes(bytes([g.rank])) for g in groups]) == [[b"\0", b"\1"]] * 2

    def failing_wait(*args, **kwargs):
        raise RuntimeError("a bug in the store call")
    groups[1]._kv_multi_get = failing_wait
    with pytest.raises(RuntimeError, match="a bug in the store call"):
        groups[1].barrier()
    with pytest.raises(GroupError, match=r"barrier #1: the group is broken by an earlier failure \(barrier #0 on rank 1 "
                                         r"stopped: RuntimeError: a bug in the store call\)"):
        groups[1].barrier()
    for g in groups:
        g.close(final_barrier=False)


def test_tcp_group_context_manager_and_close():
    port = free_port()

    def rank(r):
        with TCPGroup(r, 2, master_port=port, timeout_s=30.0) as g:
            g.barrier()
        with pytest.raises(GroupError, match="closed"):
            g.barrier()
        return "ok"

    assert run_in_threads([lambda: rank(0), lambda: rank(1)]) == ["ok", "ok"]


# ----------------------------------------------------------------------------- TCPGroup, processes

WORKER = textwrap.dedent("""
    import json, sys
    from mooncake_ep.group import GroupError, init_group

    mode = sys.argv[1]
    group = init_group(timeout_s=30.0)
    try:
        if mode == "leave":  # joins, then exits without taking part in any collective
            group.close(final_barrier=False)
            sys.exit(0)
        if mode == "idle":  # joins, then stays alive without taking part, for argv[2] seconds
            import time
            time.sleep(float(sys.argv[2]))
            group.close(final_barrier=False)
            sys.exit(0)
        group.timeout_s = float(sys.argv[2])
        rounds = []
        for i in range(int(sys.argv[3])):
            data = f"r{group.rank}i{i};".encode() * ((group.rank + i) % 4) + bytes([group.rank, i])
            rounds.append([v.hex() for v in group.allgather_bytes(data)])
            group.barrier()
        group.close()
        print(json.dumps({"rounds": rounds}))
    except GroupError as exc:
        print(json.dumps({"error": str(exc)}))
""")


def launch(world_size: int, port: int, argv_by_rank: dict[int, list[str]]) -> dict[int, dict]:
    """Run WORKER as the given ranks (environment like torchrun's); return each rank's JSON."""
    procs = {}
    for rank, argv in argv_by_rank.items():
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), PYTHONPATH=str(REPO_ROOT))
        procs[rank] = subprocess.Popen([sys.executable, "-c", WORKER, *argv], env=env, cwd=REPO_ROOT,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out = {}
    try:
        for rank, proc in procs.items():
            stdout, stderr = proc.communicate(timeout=PROCESS_LIMIT_S)
            assert proc.returncode == 0, f"rank {rank} exited {proc.returncode}: {stderr}"
            out[rank] = json.loads(stdout) if stdout.strip() else {}
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
    return out


def test_tcp_group_four_processes_allgather_and_barrier():
    num_rounds = 5
    out = launch(4, free_port(), {r: ["run", "30", str(num_rounds)] for r in range(4)})
    expected = [[payload(r, i).hex() for r in range(4)] for i in range(num_rounds)]
    assert out == {r: {"rounds": expected} for r in range(4)}


def test_tcp_group_peer_missing_from_collective_is_named():
    # Rank 2 is alive and never calls: rank 0 times out and exits, closing the store it serves; rank 1
    # either timed out too or was answered "store closed" by that exit. Both name the rank that never came.
    out = launch(3, free_port(), {0: ["run", "1.0", "1"], 1: ["run", "1.0", "1"], 2: ["idle", "10"]})
    assert out[0]["error"].startswith("allgather_bytes #0 timed out after 1.0 s waiting for ranks [2] of 3")
    assert out[1]["error"].startswith("allgather_bytes #0 ")
    assert "waiting for ranks [2] of 3" in out[1]["error"]


def test_tcp_group_peer_gone_from_collective_ends_it_at_once():
    """Rank 2's process exits without calling: its claim goes with its connection, and the others'
    collective ends at once, naming it, instead of waiting out their 60 s (helper-146)."""
    out = launch(3, free_port(), {0: ["run", "60", "1"], 1: ["run", "60", "1"], 2: ["leave"]})
    # The other rank's slot may not be there yet either, when a rank finds rank 2 gone.
    assert re.match(r"allgather_bytes #0 ended early waiting for ranks \[(1, )?2\] of 3 \(MASTER_ADDR=", out[0]["error"]), out
    assert out[0]["error"].endswith(": ranks [2] left the group (their store connections closed: their processes "
                                    "exited or died, or closed the group)"), out
    # Rank 1 was told the same, or, if rank 0's exit took the store away first, that it went.
    assert out[1]["error"].startswith("allgather_bytes #0 ") and "timed out" not in out[1]["error"], out


MISMATCH_WORKER = textwrap.dedent("""
    import json
    from mooncake_ep.group import init_group

    try:
        init_group(timeout_s=60.0)
        print(json.dumps({"error": None}))
    except Exception as exc:
        print(json.dumps({"error": [type(exc).__name__, str(exc)]}))
""")


def test_tcp_group_world_size_mismatch_across_processes():
    """As launched: RANK=0 WORLD_SIZE=2, then RANK=1 and RANK=2 with WORLD_SIZE=3. Rank 0 saw the
    mismatch, raised and exited; rank 1 was told only that the store closed, and rank 2 that it could
    not connect (or nothing at all, when it connected just before the store closed)."""
    port = free_port()
    procs = []
    for rank, world_size in ((0, 2), (1, 3), (2, 3)):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), PYTHONPATH=str(REPO_ROOT))
        procs.append(subprocess.Popen([sys.executable, "-c", MISMATCH_WORKER], env=env, cwd=REPO_ROOT,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        out = [json.loads(proc.communicate(timeout=PROCESS_LIMIT_S)[0]) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    assert out == [{"error": ["RankMismatchError", mismatch_message("rank 0: 2, rank 1: 3")]}] * 2 + [
        {"error": ["RankMismatchError", mismatch_message("rank 0: 2, rank 2: 3",
                                                         ", and rank 2 is outside rank 0's group of 2")]}]


# ----------------------------------------------------------------------------- init_group


@pytest.fixture
def clean_env(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_init_group_environment_errors(clean_env):
    with pytest.raises(ValueError, match="RANK is not set.*export RANK"):
        init_group()
    clean_env.setenv("RANK", "0")
    with pytest.raises(ValueError, match="WORLD_SIZE is not set"):
        init_group()
    clean_env.setenv("WORLD_SIZE", "two")
    with pytest.raises(ValueError, match="WORLD_SIZE must be an integer, got 'two'"):
        init_group()
    # int() takes these, as other numbers than the ones meant (helper-156): 10, and 3.
    for typo in ("1_0", "\u0663"):
        clean_env.setenv("WORLD_SIZE", typo)
        with pytest.raises(ValueError, match=f"WORLD_SIZE must be an integer, got {typo!r}"):
            init_group()
    clean_env.setenv("WORLD_SIZE", "2")
    clean_env.setenv("MASTER_ADDR", "   ")
    with pytest.raises(ValueError, match=r"MASTER_ADDR is only whitespace: '   '"):
        init_group()
    # Set but empty (a launcher's variable that expanded to nothing) is a mistake, not "unset": it was
    # read as 127.0.0.1, so ranks on other hosts waited for a rank 0 that listened on its own loopback.
    # (A free port and a short timeout: read as 127.0.0.1, rank 0 would wait for rank 1 there, not 300 s.)
    clean_env.setenv("MASTER_ADDR", "")
    clean_env.setenv("MASTER_PORT", str(free_port()))
    with pytest.raises(ValueError, match=r"^init_group: environment variable MASTER_ADDR is empty; set it to rank 0's "
                                         r"host, or unset it for 127\.0\.0\.1$"):
        init_group(timeout_s=1.0)
    clean_env.delenv("MASTER_PORT")
    clean_env.delenv("MASTER_ADDR")
    clean_env.setenv("WORLD_SIZE", "2")
    clean_env.setenv("RANK", "2")
    with pytest.raises(ValueError, match=r"rank must be in \[0, world_size\) = \[0, 2\), got 2"):
        init_group()
    with pytest.raises(ValueError, match="rank must be >= 0"):
        init_group(rank=-1)
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        init_group(rank=0, world_size=0)
    clean_env.setenv("MASTER_PORT", "x")
    with pytest.raises(ValueError, match="MASTER_PORT must be an integer"):
        init_group(rank=0)
    with pytest.raises(ValueError, match=r"master_port must be in \[1, 65535\]"):
        init_group(rank=0, master_port=70000)
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        init_group(rank=0, timeout_s=0.0)


def test_init_group_world_size_one_uses_no_network(clean_env):
    with socket.socket() as taken:  # the store's port is taken: a store would fail to start
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        clean_env.setenv("RANK", "0")
        clean_env.setenv("WORLD_SIZE", "1")
        clean_env.setenv("MASTER_PORT", str(taken.getsockname()[1]))
        with init_group(device=3) as group:
            assert (group.rank, group.world_size, group.device, group.is_in_process) == (0, 1, 3, False)
            assert group.allgather_bytes(b"solo") == [b"solo"]
            group.barrier()


def test_spawn_notes_a_rank_failure_also_on_python_310(caplog):
    """LocalGroup.spawn notes on a rank's exception where it was raised. Python 3.10 (supported) has no
    add_note: the rank's exception became an AttributeError there; the note now goes to the log."""
    from mooncake_ep import group as group_module

    error = ValueError("boom")
    group_module._add_note(error, "LocalGroup.spawn: raised on rank 1 of 2")
    assert error.__notes__ == ["LocalGroup.spawn: raised on rank 1 of 2"]

    class ErrorOfPython310(ValueError):  # as a 3.10 exception: no add_note
        add_note = property(lambda self: (_ for _ in ()).throw(AttributeError("add_note")))

    with caplog.at_level("ERROR", logger="mooncake_ep"):
        group_module._add_note(ErrorOfPython310("boom"), "LocalGroup.spawn: raised on rank 1 of 2")
    assert "ErrorOfPython310: LocalGroup.spawn: raised on rank 1 of 2" in caplog.text
