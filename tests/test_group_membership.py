"""Membership epochs of the store groups: renew_membership, and a process taking over a dead rank.

CPU only. Ranks are threads here, each with its own store connection; a rank "dies" when its
connection closes, which is what the OS does to a killed process's socket (the multi-process
version, with SIGKILL, is in test_buffer_multiprocess.py). Timeouts only bound failures.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import socket
import threading
import time
import types

import pytest

import _threads

from mooncake_ep.cli.launch import free_port
from mooncake_ep.group import (GroupError, StoreHoldersGoneError, StoreTimeoutError, TCPGroup, TCPStoreClient,
                               TCPStoreServer, TorchStoreGroup, init_group)

PROCESS_LIMIT_S = 60.0
LONG_TIMEOUT_S = 30.0
SHORT_TIMEOUT_S = 0.5


def run_in_threads(fns: list) -> list:
    return _threads.run_in_threads(fns, PROCESS_LIMIT_S)


def join(port: int, world_size: int) -> list[TCPGroup]:
    groups = run_in_threads([lambda r=r: TCPGroup(r, world_size, master_port=port, timeout_s=LONG_TIMEOUT_S)
                             for r in range(world_size)])
    assert all(isinstance(g, TCPGroup) for g in groups), groups
    return groups


def die(group: TCPGroup) -> None:
    """What a killed process leaves behind: its store connection closed, no goodbye."""
    group._client.close()


def eventually(fn, limit_s: float = PROCESS_LIMIT_S):
    """fn()'s first truthy result, polling: the store frees a claim a moment after the connection closes."""
    deadline = time.monotonic() + limit_s
    while not (result := fn()):
        assert time.monotonic() < deadline, "the condition never held"
        time.sleep(0.01)
    return result


def join_while_claimed(make):
    """make()'s result or error, retried while the error is the old connection's claim still being held."""
    def attempt():
        try:
            return make()
        except GroupError as exc:
            return None if "twice" in str(exc) else exc
    return eventually(attempt)


def gather_ranks(groups) -> list:
    return run_in_threads([lambda g=g: g.allgather_bytes(bytes([g.rank, g.membership_epoch])) for g in groups])


# ----------------------------------------------------------------------------- store claims


def test_claim_is_held_by_its_connection_and_released_when_it_closes():
    with TCPStoreServer("127.0.0.1", 0) as server:
        a = TCPStoreClient("127.0.0.1", server.port, timeout_s=5.0)
        b = TCPStoreClient("127.0.0.1", server.port, timeout_s=5.0)
        assert a.claim("member/1", b"a") is True
        assert b.claim("member/1", b"b") is False  # a holds it
        assert b.get("member/1", timeout_s=1.0) == b"a"
        a.close()
        # The server frees the key once it has seen the connection close: wait for the key to go.
        c = TCPStoreClient("127.0.0.1", server.port, timeout_s=5.0)
        assert eventually(lambda: b.claim("member/1", b"b"))
        assert c.get("member/1", timeout_s=1.0) == b"b"
        # A set ends the claim: the key outlives its claimer.
        c.set("member/1", b"set")
        b.close()
        assert c.get("member/1", timeout_s=1.0) == b"set"
        assert c.claim("member/1") is False
        c.close()


def test_a_wait_given_holders_ends_at_once_when_a_missing_keys_holder_is_gone():
    """A collective's wait names each slot's holder (the rank's member claim): once a missing slot's
    holder is gone (its connection closed, as a killed process's is), nobody will set it, and the wait
    ends there instead of at its timeout (helper-146). A holder that set its key before it left, or a
    key without a holder (""), counts as usual."""
    with TCPStoreServer("127.0.0.1", 0) as server:
        waiter = TCPStoreClient("127.0.0.1", server.port, timeout_s=5.0)
        early = TCPStoreClient("127.0.0.1", server.port, timeout_s=5.0)
        dying = TCPStoreClient("127.0.0.1", server.port, timeout_s=5.0)
        assert early.claim("member/1") and dying.claim("member/2")
        early.set("c/1", b"one")
        early.close()  # gone, but its key is there
        eventually(lambda: not _holds(waiter, "member/1"))
        holders = ["", "member/1", "member/2"]
        waiter.set("c/0", b"zero")
        result: list = []
        thread = threading.Thread(target=lambda: result.append(_threads.call_or_error(
            lambda: waiter.multi_get(["c/0", "c/1", "c/2"], LONG_TIMEOUT_S, holders=holders))))
        thread.start()
        time.sleep(0.2)  # the wait is in the store, its holders alive
        assert thread.is_alive()
        dying.close()
        thread.join(PROCESS_LIMIT_S)
        (error,) = result
        assert isinstance(error, StoreHoldersGoneError), error
        assert (error.missing_keys, error.gone_keys) == (["c/2"], ["c/2"])
        assert str(error) == ("TCPStoreClient.multi_get: the holders of keys ['c/2'] are gone (their store "
                              "connections closed: the processes exited or died) while waiting for keys ['c/2']")
        # The same wait finds a gone holder at its start, and one whose key is there is no failure.
        with pytest.raises(StoreHoldersGoneError):
            waiter.multi_get(["c/0", "c/2"], LONG_TIMEOUT_S, holders=["", "member/2"])
        assert waiter.multi_get(["c/0", "c/1"], 1.0, holders=holders[:2]) == [b"zero", b"one"]
        with pytest.raises(ValueError, match=r'holders must name one claim \(or ""\) per key: 1 for 2 keys'):
            waiter.multi_get(["c/0", "c/1"], 1.0, holders=["member/1"])
        waiter.close()
    # Pickled with its attributes, as StoreTimeoutError (helper-150: neither could be unpickled)
    import pickle

    for exc in (error, StoreTimeoutError("timed out", ["c/2"], " (and longer)")):
        copy = pickle.loads(pickle.dumps(exc))
        assert (type(copy), str(copy), copy.missing_keys) == (type(exc), str(exc), exc.missing_keys)
        assert getattr(copy, "gone_keys", None) == getattr(exc, "gone_keys", None)
        assert getattr(copy, "extended", None) == getattr(exc, "extended", None)


def _holds(client: TCPStoreClient, key: str) -> bool:
    """Whether ``key`` exists (a claim held), without waiting."""
    try:
        client.get(key, timeout_s=0.01)
        return True
    except StoreTimeoutError:
        return False


def test_a_wait_that_settles_claims_keeps_the_keys_after_their_claimer_leaves():
    """A membership round: once one rank's wait saw every join key, a replacement that exits must
    still count as joined for a rank whose wait comes later (else the two end in different epochs)."""
    with TCPStoreServer("127.0.0.1", 0) as server:
        replacement = TCPStoreClient("127.0.0.1", server.port, timeout_s=5.0)
        survivor = TCPStoreClient("127.0.0.1", server.port, timeout_s=5.0)
        late = TCPStoreClient("127.0.0.1", server.port, timeout_s=5.0)
        assert replacement.claim("e1/join/2", b"r") and replacement.claim("unsettled", b"u")
        survivor.set("e1/join/0", b"s")
        assert survivor.multi_get(["e1/join/0", "e1/join/2"], timeout_s=1.0, settle_claims=True) == [b"s", b"r"]
        assert survivor.multi_get(["unsettled"], timeout_s=1.0) == [b"u"]  # a plain wait leaves the claim
        replacement.close()
        assert eventually(lambda: late.claim("unsettled", b"late"))  # freed with its claimer's connection
        assert late.multi_get(["e1/join/0", "e1/join/2"], timeout_s=1.0) == [b"s", b"r"]
        assert late.claim("e1/join/2") is False
        for client in (survivor, late):
            client.close()


def test_a_failed_wait_that_withdraws_removes_only_its_own_unsettled_claims():
    """A rendezvous round: a rank whose wait fails takes its key with it in the same step, so no peer's
    wait can complete the round with it afterwards; other connections' claims, plain keys, and keys a
    completed round settled stay."""
    with TCPStoreServer("127.0.0.1", 0) as server:
        quitter = TCPStoreClient("127.0.0.1", server.port, timeout_s=5.0)
        peer = TCPStoreClient("127.0.0.1", server.port, timeout_s=5.0)
        assert quitter.claim("c/0/1", b"q") and peer.claim("c/0/0", b"p")
        quitter.set("plain", b"x")
        with pytest.raises(StoreTimeoutError, match=r"waiting for keys \['c/0/2'\]"):
            quitter.multi_get(["c/0/0", "c/0/1", "c/0/2", "plain"], 0.1, settle_claims=True, withdraw_claims=True)
        with pytest.raises(StoreTimeoutError, match=r"waiting for keys \['c/0/1'\]"):  # gone while still connected
            peer.multi_get(["c/0/0", "c/0/1", "plain"], 0.1)
        assert peer.get("c/0/1:withdrawn", timeout_s=1.0) == b""  # set in the same step: it came and left
        assert peer.claim("c/0/1", b"again")  # a restarted rank claims the slot afresh
        assert quitter.claim("c/0/0") is False  # the peer's claim stayed
        # A round that completes settles every key: the failed wait of a rank that comes too late to
        # see it withdraws nothing.
        assert peer.multi_get(["c/0/0", "c/0/1"], 1.0, settle_claims=True, withdraw_claims=True) == [b"p", b"again"]
        with pytest.raises(StoreTimeoutError):
            peer.multi_get(["c/0/0", "c/0/1", "c/0/2"], 0.1, settle_claims=True, withdraw_claims=True)
        peer.close()
        assert quitter.multi_get(["c/0/0", "c/0/1", "plain"], 1.0) == [b"p", b"again", b"x"]
        quitter.close()


def test_a_rank_that_gives_up_in_the_rendezvous_leaves_nothing_behind():
    """Rank 1 joins, times out waiting for rank 2, and leaves. Before, its slot stayed: rank 2 then
    completed the round with rank 0 as a group of three with a rank that was gone, and rank 1's
    restart was refused as one that had joined before. Now the round completes only with the restart."""
    port = free_port()
    rank0 = []
    waiting = threading.Thread(target=lambda: rank0.append(_threads.call_or_error(
        lambda: TCPGroup(0, 3, master_port=port, timeout_s=LONG_TIMEOUT_S))))
    waiting.start()
    probe = eventually(lambda: _threads.call_or_error(lambda: TCPStoreClient("127.0.0.1", port, timeout_s=5.0)))
    assert isinstance(probe, TCPStoreClient), probe
    probe.get("c/0/0", timeout_s=PROCESS_LIMIT_S)  # rank 0 is in the round
    with pytest.raises(GroupError, match=r"init_group #0 timed out after 0\.5 s waiting for ranks \[2\] of 3"):
        TCPGroup(1, 3, master_port=port, timeout_s=SHORT_TIMEOUT_S)
    rank2 = []
    late = threading.Thread(target=lambda: rank2.append(_threads.call_or_error(
        lambda: TCPGroup(2, 3, master_port=port, timeout_s=LONG_TIMEOUT_S))))
    late.start()
    probe.get("c/0/2", timeout_s=PROCESS_LIMIT_S)  # rank 2 in the round: before, it completed here, with rank 1's slot
    probe.close()
    assert not rank2 and not rank0
    restarted = join_while_claimed(lambda: TCPGroup(1, 3, master_port=port, timeout_s=LONG_TIMEOUT_S))
    for thread in (waiting, late):
        thread.join(PROCESS_LIMIT_S)
    groups = [rank0[0], restarted, rank2[0]]
    assert all(isinstance(g, TCPGroup) for g in groups), groups
    assert gather_ranks(groups) == [[b"\0\0", b"\1\0", b"\2\0"]] * 3
    run_in_threads([lambda g=g: g.close() for g in groups])


def test_a_rank_that_dies_in_the_rendezvous_can_be_restarted(monkeypatch):
    """Rank 1 dies in the round (its connection closes, as the OS closes a killed process's), before
    rank 2 came. Before, its slot and its join count stayed: ranks 0 and 2 completed the round with
    a dead rank, and its restart was refused. Now what it held goes with its connection."""
    port = free_port()
    wait = TCPGroup._kv_multi_get
    died = threading.Event()

    def dies_in_its_first_round(self, keys, timeout_s, **kwargs):
        if self.rank == 1 and len(keys) == 3 and not died.is_set():
            died.set()
            self._client.close()
            raise GroupError("killed")
        return wait(self, keys, timeout_s, **kwargs)

    monkeypatch.setattr(TCPGroup, "_kv_multi_get", dies_in_its_first_round)
    out = []
    rank0 = threading.Thread(target=lambda: out.append(_threads.call_or_error(
        lambda: TCPGroup(0, 3, master_port=port, timeout_s=LONG_TIMEOUT_S))))
    rank0.start()
    first = _threads.call_or_error(lambda: TCPGroup(1, 3, master_port=port, timeout_s=LONG_TIMEOUT_S))  # connects once up
    assert isinstance(first, GroupError) and "killed" in str(first), first
    probe = TCPStoreClient("127.0.0.1", port, timeout_s=5.0)
    eventually(lambda: isinstance(_threads.call_or_error(lambda: probe.get("c/0/1", 0.01)), StoreTimeoutError))
    probe.close()  # the store has seen the connection go
    restarted = run_in_threads([
        lambda: join_while_claimed(lambda: TCPGroup(1, 3, master_port=port, timeout_s=LONG_TIMEOUT_S)),
        lambda: TCPGroup(2, 3, master_port=port, timeout_s=LONG_TIMEOUT_S)])
    rank0.join(PROCESS_LIMIT_S)
    groups = out + restarted
    assert all(isinstance(g, TCPGroup) for g in groups), groups
    assert gather_ranks(groups) == [[b"\0\0", b"\1\0", b"\2\0"]] * 3
    run_in_threads([lambda g=g: g.close() for g in groups])


def test_a_rank_killed_in_its_rendezvous_wait_is_not_counted_when_the_last_rank_comes(monkeypatch):
    """Rank 1 is killed while its wait is in the store, whose handler notices the closed socket only
    at its next poll; rank 2 comes in that window. Before, ranks 0 and 2 settled the round with rank
    1's slot, and its restart was refused. The settling wait now drops a hung-up claimer's claims."""
    port = free_port()
    wait, waiting_rank1 = TCPGroup._kv_multi_get, {}

    def tracked_wait(self, keys, timeout_s, **kwargs):
        if self.rank == 1 and len(keys) == 3:
            waiting_rank1[self.rank] = self
        return wait(self, keys, timeout_s, **kwargs)

    monkeypatch.setattr(TCPGroup, "_kv_multi_get", tracked_wait)
    out = {}

    def start(rank, name):  # retried while the killed process's member claim is still held
        thread = threading.Thread(target=lambda: out.__setitem__(name, _threads.call_or_error(
            lambda: join_while_claimed(lambda: TCPGroup(rank, 3, master_port=port, timeout_s=LONG_TIMEOUT_S)))))
        thread.start()
        return thread

    threads = [start(0, "rank 0"), start(1, "killed")]
    eventually(lambda: waiting_rank1)
    time.sleep(0.1)  # its wait request is in the store
    waiting_rank1[1]._client._sock.shutdown(socket.SHUT_RDWR)  # what the OS does to a killed process's socket
    threads.append(start(2, "rank 2"))
    threads.append(start(1, "restart"))
    for thread in threads:
        thread.join(PROCESS_LIMIT_S)
    assert isinstance(out["killed"], GroupError), out
    groups = [out["rank 0"], out["restart"], out["rank 2"]]
    assert all(isinstance(g, TCPGroup) for g in groups), out
    assert gather_ranks(groups) == [[b"\0\0", b"\1\0", b"\2\0"]] * 3
    run_in_threads([lambda g=g: g.close() for g in groups])


def test_a_rank_0_with_more_than_1024_descriptors_open_serves_the_rendezvous():
    """A large group's rank 0 holds a socket per rank, and torch and CUDA their files: a descriptor past
    1023 made select() raise, which the store's settling wait answered as a malformed request."""
    resource = pytest.importorskip("resource")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 1200
    if hard != resource.RLIM_INFINITY and hard < wanted:
        pytest.skip(f"the hard limit on open files is {hard}")
    held = []
    try:
        if soft != resource.RLIM_INFINITY and soft < wanted:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
        held = [open(os.devnull) for _ in range(1100)]  # the store's sockets come after these
        groups = join(free_port(), 3)
        assert gather_ranks(groups) == [[b"\0\0", b"\1\0", b"\2\0"]] * 3
        run_in_threads([lambda g=g: g.close() for g in groups])
    finally:
        for f in held:
            f.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_store_names_another_protocol_and_ignores_what_is_not_one(caplog):
    """A client of another store protocol is refused by name; bytes that are no hello, or a request
    length that no data follows, cost the server nothing (it used to allocate whatever length came)."""
    from mooncake_ep import _tcp_store

    with TCPStoreServer("127.0.0.1", 0) as server:
        with socket.create_connection(("127.0.0.1", server.port)) as stray:  # an old client's first request
            stray.sendall(_tcp_store._HEADER.pack(1, 1 << 62))
            assert stray.recv(1) == b""  # dropped
        assert "does not speak the store protocol" in caplog.text
        with socket.create_connection(("127.0.0.1", server.port)) as liar:  # a hello, then a length without data
            liar.sendall(_tcp_store.hello(_tcp_store._PROTOCOL_VERSION))
            assert liar.recv(_tcp_store._HEADER.size) == _tcp_store._HEADER.pack(_tcp_store._OK, 0)
            liar.sendall(_tcp_store._HEADER.pack(1, 1 << 62) + bytes(1000))
        newer = _tcp_store._PROTOCOL_VERSION + 1
        with socket.create_connection(("127.0.0.1", server.port)) as other:  # a newer rank's hello
            other.sendall(_tcp_store.hello(newer))
            status, length = _tcp_store._HEADER.unpack(_tcp_store._recv_exact(other, _tcp_store._HEADER.size))
            message = _tcp_store._recv_exact(other, length).decode()
        assert status == _tcp_store._ERROR
        assert message == (f"the store speaks protocol {_tcp_store._PROTOCOL_VERSION} and this rank {newer}: every "
                           f"rank must run the same mooncake_ep version")
        client = TCPStoreClient("127.0.0.1", server.port, timeout_s=5.0)  # the server still serves
        client.set("k", b"v")
        assert client.get("k", timeout_s=1.0) == b"v"
        client.close()
    # A store from before the hello answers it as an unknown op, at once: the client names that.
    with socket.create_server(("127.0.0.1", 0)) as listener:
        def answer_as_protocol_3():
            conn, _ = listener.accept()
            with conn:
                op, length = _tcp_store._HEADER.unpack(_tcp_store._recv_exact(conn, _tcp_store._HEADER.size))
                _tcp_store._recv_exact(conn, length)
                reply = f"unknown op {op}".encode()
                conn.sendall(_tcp_store._HEADER.pack(_tcp_store._ERROR, len(reply)) + reply)
        old_store = threading.Thread(target=answer_as_protocol_3, daemon=True)
        old_store.start()
        with pytest.raises(GroupError, match=r"refused this rank: it runs a mooncake_ep of store protocol 3 or older"):
            TCPStoreClient("127.0.0.1", listener.getsockname()[1], timeout_s=5.0, who="rank 1")
        old_store.join(PROCESS_LIMIT_S)
    # What a refused client says: the store's reason, with its own name and the store's address.
    with socket.create_server(("127.0.0.1", 0)) as listener:
        def refuse():
            conn, _ = listener.accept()
            with conn:
                _tcp_store._recv_exact(conn, _tcp_store._HEADER.size + _tcp_store._HELLO.size)
                conn.sendall(_tcp_store._HEADER.pack(_tcp_store._ERROR, len(message)) + message.encode())
        refusing = threading.Thread(target=refuse, daemon=True)
        refusing.start()
        port = listener.getsockname()[1]
        with pytest.raises(GroupError, match=rf"^rank 1: store at 127\.0\.0\.1:{port}: refused this rank: the store "
                                             rf"speaks protocol \d+ and this rank {newer}: every rank"):
            TCPStoreClient("127.0.0.1", port, timeout_s=5.0, who="rank 1")
        refusing.join(PROCESS_LIMIT_S)


def test_a_wait_goes_on_while_a_value_set_in_time_is_still_arriving():
    """timeout_s bounds the wait for peers, not transfers: a peer that began its set before the
    deadline is waited for until the value is in, however long that takes past the waiter's own
    limits (the store tells the waiter how many bytes are still coming)."""
    from mooncake_ep import _tcp_store as ts

    with TCPStoreServer("127.0.0.1", 0) as server:
        waiter = TCPStoreClient("127.0.0.1", server.port, timeout_s=5.0)
        result = []
        waiting = threading.Thread(target=lambda: result.append(_threads.call_or_error(lambda: waiter.multi_get(["big"], 0.3))))
        value = bytes(range(256)) * (8 << 12)  # 8 MiB: a set large enough to be marked arriving
        request = ts._pack_key("big") + ts._pack_blob(value)
        with socket.create_connection(("127.0.0.1", server.port)) as setter:
            setter.sendall(ts.hello(ts._PROTOCOL_VERSION))
            assert ts._recv_exact(setter, ts._HEADER.size) == ts._HEADER.pack(ts._OK, 0)
            waiting.start()
            setter.sendall(ts._HEADER.pack(ts._OP_SET, len(request)) + request[:1000])
            eventually(lambda: "big" in server._arriving_keys)
            time.sleep(1.5)  # past the wait (0.3 s) and the waiter's own limit (0.3 + 0.5 s slack)
            setter.sendall(request[1000:])
            assert ts._recv_exact(setter, ts._HEADER.size) == ts._HEADER.pack(ts._OK, 0)
        waiting.join(PROCESS_LIMIT_S)
        assert result == [[value]], result
        waiter.close()


def test_a_set_that_stalls_midway_is_waited_for_only_its_transfer_allowance(monkeypatch):
    """A peer that began a large set and stopped (its process frozen, its connection open): a wait for
    the key goes on past its own time only for what that transfer is allowed, then times out."""
    from mooncake_ep import _tcp_store as ts

    monkeypatch.setattr(ts, "_REPLY_SLACK_S", (0.25, 0.5))  # allowance: 0.5 s + 2 MiB at 20 MB/s
    with TCPStoreServer("127.0.0.1", 0) as server:
        value_bytes = 2 << 20
        request_head = ts._pack_key("big") + ts._U32.pack(value_bytes)
        with socket.create_connection(("127.0.0.1", server.port)) as setter:
            setter.sendall(ts.hello(ts._PROTOCOL_VERSION))
            ts._recv_exact(setter, ts._HEADER.size)
            setter.sendall(ts._HEADER.pack(ts._OP_SET, len(request_head) + value_bytes) + request_head + bytes(1000))
            eventually(lambda: "big" in server._arriving_keys)
            waiter = TCPStoreClient("127.0.0.1", server.port, timeout_s=5.0)
            with pytest.raises(StoreTimeoutError, match=r"timed out after 0\.1 s waiting for keys \['big'\]"):
                waiter.wait(["big"], timeout_s=0.1)
            waiter.close()


def test_a_request_interrupted_midway_closes_the_connection_instead_of_misreading_the_next_reply():
    """Ctrl-C between a request and its reply leaves the reply in the socket: the next request would
    read it as its own (a 'truncated message', or a wrong value). The connection is closed instead."""
    with TCPStoreServer("127.0.0.1", 0) as server:
        client = TCPStoreClient("127.0.0.1", server.port, timeout_s=5.0, who="rank 1")
        client.set("k", b"v")

        class InterruptedOnce:  # the client's socket, whose first read after the request is interrupted
            def __init__(self, sock):
                self.sock, self.interrupted = sock, False

            def recv_into(self, *args):
                if not self.interrupted:
                    self.interrupted = True
                    raise KeyboardInterrupt
                return self.sock.recv_into(*args)

            def __getattr__(self, name):
                return getattr(self.sock, name)
        client._sock = InterruptedOnce(client._sock)
        with pytest.raises(KeyboardInterrupt):
            client.get("k", timeout_s=1.0)
        with pytest.raises(GroupError, match=r"rank 1: store at .*: the connection is closed"):
            client.get("k", timeout_s=1.0)


def test_a_stalled_store_is_named_within_a_quarter_of_the_wait_past_it():
    """A client gives the store a quarter of its wait (0.5-10 s) to answer past it, not a flat 10 s:
    a rank 0 that stalls (not dead, so its socket stays open) is named soon after timeout_s."""
    with TCPStoreServer("127.0.0.1", 0) as server:
        serve, release = server._serve, threading.Event()

        def stalled(op, payload, client=None):
            release.wait(PROCESS_LIMIT_S)
            return serve(op, payload, client)
        server._serve = stalled
        client = TCPStoreClient("127.0.0.1", server.port, timeout_s=5.0, who="rank 1")
        with pytest.raises(GroupError, match=r"rank 1: store at .*: no reply within 1\.0 s: rank 0's process, which "
                                             r"serves the store, stalled or is overloaded"):
            client.wait(["k"], timeout_s=0.5)
        release.set()


def test_a_large_value_gets_time_to_move_beyond_timeout_s():
    """timeout_s bounds the wait for peers, not the transfer: a set and a multi_get of 64 MiB with a
    limit far below their transfer time go through."""
    with TCPStoreServer("127.0.0.1", 0) as server:
        # Connected with room for the hello (a loaded machine did not answer it within 1 ms), then
        # every request limited to 1 ms.
        client = TCPStoreClient("127.0.0.1", server.port, timeout_s=5.0)
        client.timeout_s = 0.001
        value = bytes(64 << 20)
        client.set("big", value)
        assert client.multi_get(["big"], timeout_s=0.001, reply_bytes=len(value)) == [value]
        client.close()


def test_claim_of_a_client_that_dies_inside_a_wait_is_released():
    """A rank killed while it waits in a collective: its store request is still being served."""
    with TCPStoreServer("127.0.0.1", 0) as server:
        dying = TCPStoreClient("127.0.0.1", server.port, timeout_s=5.0)
        other = TCPStoreClient("127.0.0.1", server.port, timeout_s=5.0)
        assert dying.claim("member/2", b"x")
        waiter = threading.Thread(target=lambda: _swallow(lambda: dying.wait(["never"], timeout_s=math.inf)),
                                  daemon=True)
        waiter.start()
        eventually(lambda: server._num_busy == 1)  # the endless wait is inside the server
        dying._sock.shutdown(socket.SHUT_RDWR)  # what the OS does to a killed process's socket
        assert eventually(lambda: other.claim("member/2", b"y"))
        waiter.join(PROCESS_LIMIT_S)
        other.close()


def test_a_claim_of_a_client_that_hung_up_in_a_wait_is_taken_over_at_once(monkeypatch):
    """A rank killed in a wait and restarted at once: the store saw the hang-up only at the wait's next
    slice (_DEAD_CLIENT_POLL_S, here longer than the test), and refused the restart's claim as a second
    live process's ("joined twice"). A competing claim now looks at the claimer's socket; a claimer
    still connected, in a wait too, keeps its claim."""
    from mooncake_ep import _tcp_store

    monkeypatch.setattr(_tcp_store, "_DEAD_CLIENT_POLL_S", PROCESS_LIMIT_S)
    with TCPStoreServer("127.0.0.1", 0) as server:
        dying, alive, restart = (TCPStoreClient("127.0.0.1", server.port, timeout_s=5.0) for _ in range(3))
        assert dying.claim("member/1", b"old") and alive.claim("member/2", b"live")
        waiters = [threading.Thread(target=lambda c=c: _swallow(lambda: c.wait(["never"], timeout_s=PROCESS_LIMIT_S)),
                                    daemon=True) for c in (dying, alive)]
        for waiter in waiters:
            waiter.start()
        eventually(lambda: server._num_busy == 2)  # both waits are inside the server
        assert restart.claim("member/2", b"duplicate") is False  # its holder is alive: a true duplicate
        dying._sock.shutdown(socket.SHUT_RDWR)  # what the OS does to a killed process's socket
        assert eventually(lambda: restart.claim("member/1", b"new"), limit_s=5.0)  # not at the slice, 60 s on
        assert restart.multi_get(["member/1", "member/2"], timeout_s=1.0) == [b"new", b"live"]
    for waiter in waiters:  # the store's close answered the live wait
        waiter.join(PROCESS_LIMIT_S)
    for client in (dying, alive, restart):
        client.close()


def _swallow(fn) -> None:
    try:
        fn()
    except GroupError:
        pass  # the dying side's wait ends with a lost connection


# ----------------------------------------------------------------------------- renew and rejoin


def test_replacement_takes_over_a_dead_rank_at_the_survivors_renew():
    port = free_port()
    groups = join(port, 3)
    assert gather_ranks(groups) == [[b"\0\0", b"\1\0", b"\2\0"]] * 3
    die(groups[2])
    for g in groups[:2]:
        g.timeout_s = SHORT_TIMEOUT_S
    out = run_in_threads([lambda g=g: g.allgather_bytes(b"x") for g in groups[:2]])
    for e in out:  # the survivors notice at once: the collective names the dead rank, and the group is broken
        assert isinstance(e, GroupError) and re.search(
            rf"ended early waiting for ranks \[(\d, )?2\] of 3 \(MASTER_ADDR=127.0.0.1, MASTER_PORT={port}\): ranks "
            rf"\[2\] left the group", str(e)), out
    with pytest.raises(GroupError, match="broken"):
        groups[0].barrier()
    for g in groups[:2]:
        g.timeout_s = LONG_TIMEOUT_S
    out = run_in_threads([groups[0].renew_membership, groups[1].renew_membership,
                          lambda: TCPGroup(2, 3, master_port=port, timeout_s=LONG_TIMEOUT_S, rejoin=True)])
    assert out[:2] == [[2], [2]], out
    groups[2] = out[2]
    assert isinstance(groups[2], TCPGroup) and [g.membership_epoch for g in groups] == [1, 1, 1]
    # The repaired group's collectives include the newcomer, round after round.
    assert gather_ranks(groups) == [[b"\0\1", b"\1\1", b"\2\1"]] * 3
    run_in_threads([lambda g=g: g.barrier() for g in groups])
    assert gather_ranks(groups) == [[b"\0\1", b"\1\1", b"\2\1"]] * 3
    # A renewal with every rank alive changes nobody.
    assert run_in_threads([g.renew_membership for g in groups]) == [[], [], []]
    assert gather_ranks(groups) == [[b"\0\2", b"\1\2", b"\2\2"]] * 3
    run_in_threads([lambda g=g: g.close() for g in groups])


def test_a_survivor_is_told_at_once_of_a_dead_rank_whose_replacement_is_already_waiting():
    """The holder of a rank's slots is its process of the current epoch: a replacement already
    holding member/{rank}, which joins only the next epoch, must not hide the dead process from a
    survivor still in this epoch's collective (it waited out its timeout, and came to the renewal
    after the replacement had given up; helper-150)."""
    port = free_port()
    groups = join(port, 3)
    die(groups[2])
    replacement: list = []
    started = threading.Thread(target=lambda: replacement.append(_threads.call_or_error(
        lambda: join_while_claimed(lambda: TCPGroup(2, 3, master_port=port, timeout_s=LONG_TIMEOUT_S,
                                                    rejoin=True)))))
    started.start()
    # The replacement holds the rank (its claim is taken over) before the survivor's collective.
    eventually(lambda: _holder_pid(groups[0], "member/2") is not None and _holder_pid(groups[0], "alive/e0/2") is None)
    with pytest.raises(GroupError, match=r"ended early waiting for ranks \[(0, )?2\] of 3 .*: ranks \[2\] left"):
        groups[1].allgather_bytes(b"x")  # its own timeout is LONG_TIMEOUT_S: told at once, not at that
    assert run_in_threads([g.renew_membership for g in groups[:2]]) == [[2], [2]]
    started.join(PROCESS_LIMIT_S)
    (groups[2],) = replacement
    assert isinstance(groups[2], TCPGroup), replacement
    assert gather_ranks(groups) == [[b"\0\1", b"\1\1", b"\2\1"]] * 3
    run_in_threads([lambda g=g: g.close() for g in groups])


def _holder_pid(group: TCPGroup, key: str) -> bytes | None:
    """The value of a claim (its holder's "pid N"), None where nobody holds it."""
    try:
        return group._store().get(key, timeout_s=0.01)
    except StoreTimeoutError:
        return None


def test_a_second_replacement_joins_the_next_epoch():
    port = free_port()
    groups = join(port, 3)
    for victim in (1, 2):
        die(groups[victim])
        others = [g for g in groups if g.rank != victim]
        out = run_in_threads([g.renew_membership for g in others] +
                             [lambda v=victim: TCPGroup(v, 3, master_port=port, timeout_s=LONG_TIMEOUT_S, rejoin=True)])
        assert out[:2] == [[victim], [victim]], out
        groups[victim] = out[2]
    assert [g.membership_epoch for g in groups] == [2, 2, 2]
    assert gather_ranks(groups) == [[b"\0\2", b"\1\2", b"\2\2"]] * 3
    run_in_threads([lambda g=g: g.close() for g in groups])


def test_a_replacement_builds_every_buffer_the_survivors_update_and_a_refused_update_is_retried():
    """Two Buffers per rank (a forward Buffer and a grad_buffer): the survivors update both, the
    replacement joins once and builds both. The first update is refused (hooks pending, on every
    rank, the replacement's Buffer too); the retries meet. Each update had renewed the epoch, so the
    second Buffer's (and every retry's) waited in an epoch the replacement never joined."""
    import numpy as np

    import mooncake_ep as ep
    from mooncake_ep.reference import bfloat16

    world_size, T, H, E, K = 3, 4, 128, 6, 2
    size = ep.Buffer.get_ep_buffer_size_hint(T, H, world_size, E)
    port = free_port()
    groups = join(port, world_size)
    buffers = run_in_threads([lambda g=g: [ep.Buffer(g, size, backend="reference") for _ in range(2)] for g in groups])

    def step(buffer, hook: bool):
        rng = np.random.default_rng(buffer.rank)
        x = rng.standard_normal((T, H)).astype(bfloat16)
        topk = np.argsort(rng.random((T, E)), axis=1)[:, :K].copy()
        active = np.ones(world_size, np.int32)
        recv, _, handle, _, receive = buffer.dispatch(x, topk, active, T, E, use_fp8=False, return_recv_hook=hook)
        if hook:
            return receive
        combined, _, _ = buffer.combine(recv, topk, np.ones((T, K), np.float32), active, handle=handle)
        return combined

    hooks = run_in_threads([lambda b=b: step(b[0], hook=True) for b in buffers])
    die(groups[2])  # with its hook pending, as the survivors' are

    def survivor(rank):
        forward, grad = buffers[rank]
        with pytest.raises(RuntimeError, match=r"update_ep_member: ranks \[0, 1\] have receive hooks pending"):
            forward.update_ep_member()
        hooks[rank]()
        return forward.update_ep_member(), grad.update_ep_member(), step(forward, hook=False).shape

    def replacement():
        group = join_while_claimed(lambda: TCPGroup(2, world_size, master_port=port, timeout_s=LONG_TIMEOUT_S,
                                                    rejoin=True))
        with pytest.raises(RuntimeError, match=r"Buffer: ranks \[0, 1\] have receive hooks pending"):
            ep.Buffer(group, size, backend="reference")
        forward, grad = ep.Buffer(group, size, backend="reference"), ep.Buffer(group, size, backend="reference")
        return group, step(forward, hook=False).shape

    *survivors, (groups[2], replaced_shape) = run_in_threads([lambda: survivor(0), lambda: survivor(1), replacement])
    assert survivors == [([2], [2], (T, H))] * 2 and replaced_shape == (T, H), survivors
    assert [g.membership_epoch for g in groups] == [1, 1, 1]
    run_in_threads([lambda g=g: g.close() for g in groups])


def test_a_new_buffer_of_a_live_process_is_refused_at_the_others_update_and_the_update_can_be_retried():
    """The first update renews the epoch; the second Buffer's joins it without renewing, and there a
    rank whose process lives built a new Buffer instead of updating its own (what the docs forbid).
    Its construction passed as a replacement's: the others connected its new workspace in place of
    its Buffer, named it replaced, and handed it their Buffer's name and dispatch count (review).
    Refused on every rank, naming the misuse; the update then made by every rank replaces nobody."""
    import mooncake_ep as ep

    size = ep.Buffer.get_ep_buffer_size_hint(4, 128, 2, 4)
    groups = join(free_port(), 2)
    buffers = run_in_threads([lambda g=g: [ep.Buffer(g, size, backend="reference") for _ in range(2)] for g in groups])
    assert run_in_threads([lambda b=b: b[0].update_ep_member() for b in buffers]) == [[], []]

    def rank_fn(rank):
        forward, grad = buffers[rank]
        with pytest.raises(ep.RankMismatchError) as error:
            grad.update_ep_member() if rank == 0 else ep.Buffer(groups[rank], size, backend="reference")
        return str(error.value), grad.update_ep_member()

    out = run_in_threads([lambda: rank_fn(0), lambda: rank_fn(1)])
    assert all(isinstance(o, tuple) for o in out), out
    for (message, replaced), where in zip(out, ("update_ep_member", "Buffer")):
        assert message == (f"{where}: ranks [1] are building a new Buffer while ranks [0] update theirs "
                           f"(update_ep_member), a Buffer that the processes of ranks [1] hold themselves (only a "
                           f"process that took over a dead rank, init_group(rejoin=True), builds its Buffers "
                           f"there): a rank whose process lives calls Buffer.update_ep_member() on each of its "
                           f"Buffers, in the order every rank does"), out
        assert replaced == [], out
    run_in_threads([lambda g=g: g.close() for g in groups])


def test_a_replacement_builds_its_buffers_across_a_second_death():
    """Rank 2's replacement built the first of two Buffers; then rank 1 died, before the second. Every
    process goes on in the documented order (rank 0 updates both, rank 2's updates the first and builds
    the second, rank 1's builds both). A replacement had been accepted only in the epoch it joined, so
    rank 2's second Buffer was refused on every rank, at every retry (helper-175)."""
    import mooncake_ep as ep

    size = ep.Buffer.get_ep_buffer_size_hint(4, 128, 3, 6)
    port = free_port()
    groups = join(port, 3)
    buffers = run_in_threads([lambda g=g: [ep.Buffer(g, size, backend="reference") for _ in range(2)] for g in groups])
    rejoin = lambda rank: join_while_claimed(  # noqa: E731
        lambda: TCPGroup(rank, 3, master_port=port, timeout_s=LONG_TIMEOUT_S, rejoin=True))
    die(groups[2])
    built = {}

    def replacement_of_2():
        groups[2] = rejoin(2)
        built[2] = ep.Buffer(groups[2], size, backend="reference")

    run_in_threads([buffers[0][0].update_ep_member, buffers[1][0].update_ep_member, replacement_of_2])
    die(groups[1])

    def replacement_of_1():
        groups[1] = rejoin(1)
        return [ep.Buffer(groups[1], size, backend="reference").num_dispatches for _ in range(2)]

    out = run_in_threads([lambda: [b.update_ep_member() for b in buffers[0]],
                          lambda: replacement_of_1(),
                          lambda: (built[2].update_ep_member(),
                                   ep.Buffer(groups[2], size, backend="reference").num_dispatches)])
    assert out == [[[1], [1, 2]], [0, 0], ([1], 0)], out
    run_in_threads([lambda g=g: g.close() for g in groups])


def test_a_replacement_builds_a_buffer_again_when_the_others_update_of_it_failed():
    """The replacement was slow to build the second Buffer: the survivors' update of it timed out. Its
    build may still complete (it read their records after they gave up) or fail; either way every rank
    retries (the survivors' update renews the broken group; the replacement renews and builds again),
    and the retry must meet. The Buffer it built in their update is no Buffer a live rank holds."""
    import mooncake_ep as ep

    size = ep.Buffer.get_ep_buffer_size_hint(4, 128, 3, 6)
    port = free_port()
    groups = join(port, 3)
    buffers = run_in_threads([lambda g=g: [ep.Buffer(g, size, backend="reference") for _ in range(2)] for g in groups])
    die(groups[2])
    first_done = threading.Barrier(3)

    def survivor(rank):
        forward, grad = buffers[rank]
        first = forward.update_ep_member()
        first_done.wait()
        groups[rank].timeout_s = SHORT_TIMEOUT_S
        with pytest.raises(GroupError):
            grad.update_ep_member()  # the replacement is not there yet
        groups[rank].timeout_s = LONG_TIMEOUT_S
        return first, grad.update_ep_member()

    def replacement():
        group = join_while_claimed(lambda: TCPGroup(2, 3, master_port=port, timeout_s=LONG_TIMEOUT_S, rejoin=True))
        ep.Buffer(group, size, backend="reference")
        first_done.wait()
        time.sleep(SHORT_TIMEOUT_S * 4)  # past the survivors' wait
        held = []
        with contextlib.suppress(GroupError, ep.RankMismatchError):
            held.append(ep.Buffer(group, size, backend="reference"))  # kept alive while it retries, as `b = ...` does
        with contextlib.suppress(GroupError):
            group.renew_membership()  # joins the survivors' retry round, or is joined by it
        return ep.Buffer(group, size, backend="reference").num_dispatches

    out = run_in_threads([lambda: survivor(0), lambda: survivor(1), replacement])
    assert out == [([2], [2]), ([2], [2]), 0], out
    run_in_threads([lambda g=g: g.close() for g in groups])


def test_renew_times_out_naming_the_missing_rank_and_can_be_retried():
    port = free_port()
    groups = join(port, 3)
    die(groups[2])
    for g in groups[:2]:
        g.timeout_s = SHORT_TIMEOUT_S
    out = run_in_threads([g.renew_membership for g in groups[:2]])
    for e in out:
        assert isinstance(e, GroupError), out
        assert str(e).startswith(f"renew_membership #0 (epoch 1) timed out after {SHORT_TIMEOUT_S} s waiting for "
                                 f"ranks [2] of 3 (MASTER_ADDR=127.0.0.1, MASTER_PORT={port}); a rank whose process "
                                 f"died needs a replacement: start one with init_group(rank=..., rejoin=True)"), out
    for g in groups[:2]:
        g.timeout_s = LONG_TIMEOUT_S
    out = run_in_threads([groups[0].renew_membership, groups[1].renew_membership,
                          lambda: TCPGroup(2, 3, master_port=port, timeout_s=LONG_TIMEOUT_S, rejoin=True)])
    assert out[:2] == [[2], [2]], out
    groups[2] = out[2]
    assert gather_ranks(groups) == [[b"\0\1", b"\1\1", b"\2\1"]] * 3
    run_in_threads([lambda g=g: g.close() for g in groups])


def test_a_replacement_that_gave_up_is_not_counted_as_joined():
    """Its join key is held by its connection and deleted when it fails: the survivors' later renew
    must time out naming the rank, not report a rank that no process holds."""
    port = free_port()
    groups = join(port, 3)
    die(groups[2])
    error = join_while_claimed(lambda: TCPGroup(2, 3, master_port=port, timeout_s=SHORT_TIMEOUT_S, rejoin=True))
    assert isinstance(error, GroupError) and "renew_membership #0 (epoch 1) timed out" in str(error) and \
        "waiting for ranks [0, 1]" in str(error), error
    for g in groups[:2]:
        g.timeout_s = SHORT_TIMEOUT_S
    out = run_in_threads([g.renew_membership for g in groups[:2]])
    assert all(isinstance(e, GroupError) and "waiting for ranks [2] of 3" in str(e) for e in out), out
    run_in_threads([lambda g=g: g.close(final_barrier=False) for g in groups[:2]])


def test_the_timeout_setter_reaches_the_store_connection():
    port = free_port()
    groups = join(port, 2)
    groups[1].timeout_s = 0.25
    assert groups[1]._client.timeout_s == 0.25  # the store requests that wait for no keys time out with it
    run_in_threads([lambda g=g: g.close() for g in groups])


@pytest.mark.filterwarnings("ignore:os.fork\\(\\) was called:RuntimeWarning")  # JAX's; the child only waits
def test_a_forked_child_does_not_hold_its_parents_store_connection():
    """A worker forked by a rank keeps no copy of the rank's store socket: when the rank dies, its
    claim is freed although the child lives on, and a replacement can take the rank over."""
    multiprocessing = pytest.importorskip("multiprocessing")
    if "fork" not in multiprocessing.get_all_start_methods():
        pytest.skip("no fork on this platform")
    port = free_port()
    groups = join(port, 3)
    child_may_exit = multiprocessing.get_context("fork").Event()
    child = multiprocessing.get_context("fork").Process(target=child_may_exit.wait, args=(PROCESS_LIMIT_S,))
    child.start()
    try:
        die(groups[2])  # the parent's socket closes; the child's copy was closed at the fork
        out = run_in_threads([groups[0].renew_membership, groups[1].renew_membership,
                              lambda: TCPGroup(2, 3, master_port=port, timeout_s=LONG_TIMEOUT_S, rejoin=True)])
        assert out[:2] == [[2], [2]], out
        groups[2] = out[2]
        assert gather_ranks(groups) == [[b"\0\1", b"\1\1", b"\2\1"]] * 3
    finally:
        child_may_exit.set()
        child.join(PROCESS_LIMIT_S)
    run_in_threads([lambda g=g: g.close() for g in groups])


def _barrier_in_forked_child(group, report) -> None:
    start = time.monotonic()
    try:
        group.barrier()
        report.put("returned")
    except GroupError as exc:
        report.put(f"{time.monotonic() - start:.1f} s: {exc}")


@pytest.mark.filterwarnings("ignore:os.fork\\(\\) was called:RuntimeWarning")  # JAX's; the child only calls
def test_a_child_forked_during_a_collective_gets_an_error_not_its_parents_lock():
    """A collective holds the group's lock for its whole wait; a child forked meanwhile (a worker
    pool, a data loader) must not wait on that lock forever: its group calls raise at once."""
    multiprocessing = pytest.importorskip("multiprocessing")
    if "fork" not in multiprocessing.get_all_start_methods():
        pytest.skip("no fork on this platform")
    groups = join(free_port(), 2)
    waiting = threading.Thread(target=groups[1].barrier)
    waiting.start()
    eventually(lambda: groups[1]._lock.locked())
    context = multiprocessing.get_context("fork")
    report = context.Queue()
    child = context.Process(target=_barrier_in_forked_child, args=(groups[1], report))
    child.start()
    try:
        assert re.fullmatch(r"0\.\d s: barrier #1: the group is rank 1's of process \d+, and this process was forked "
                            r"from it; a child makes its own group", report.get(timeout=PROCESS_LIMIT_S))
    finally:
        child.join(PROCESS_LIMIT_S)
        if child.is_alive():
            child.kill()
    groups[0].barrier()
    waiting.join()
    run_in_threads([lambda g=g: g.close() for g in groups])


def test_a_dropped_rank_0_group_frees_its_port():
    port = free_port()
    groups = join(port, 2)
    thread_name = f"mooncake_ep-store-{port}"
    del groups[:]
    import gc

    gc.collect()
    eventually(lambda: not any(t.name == thread_name for t in threading.enumerate()))
    groups = join(port, 2)  # the port is free again
    run_in_threads([lambda g=g: g.close() for g in groups])


def test_renew_repairs_a_group_broken_by_mismatched_collectives():
    port = free_port()
    groups = join(port, 2)
    out = run_in_threads([groups[0].barrier, lambda: groups[1].allgather_bytes(b"x")])
    assert all(isinstance(e, GroupError) and "other collectives" in str(e) for e in out), out
    assert run_in_threads([g.renew_membership for g in groups]) == [[], []]
    assert gather_ranks(groups) == [[b"\0\1", b"\1\1"]] * 2
    run_in_threads([lambda g=g: g.close() for g in groups])


def test_rejoin_errors():
    port = free_port()
    with pytest.raises(ValueError, match="rejoin=True cannot take over rank 0: rank 0 serves the store"):
        TCPGroup(0, 2, master_port=port, rejoin=True)
    with pytest.raises(ValueError, match="rejoin=True cannot take over rank 0"):
        init_group(rank=0, world_size=2, master_port=port, rejoin=True)
    with pytest.raises(TypeError, match="rejoin must be a bool, got int"):
        TCPGroup(1, 2, master_port=port, rejoin=1)
    groups = join(port, 3)
    # A live rank cannot be taken over; a rank that never joined has nothing to take over.
    with pytest.raises(GroupError, match=r"rank 1 is still held by a live process after 0\.5 s .*only a rank whose "
                                         r"process has exited"):
        TCPGroup(1, 3, master_port=port, timeout_s=SHORT_TIMEOUT_S, rejoin=True)
    die(groups[2])
    # Coming back as a dead rank without saying so is refused (its peers are past the rendezvous).
    error = join_while_claimed(lambda: TCPGroup(2, 3, master_port=port, timeout_s=SHORT_TIMEOUT_S))
    assert isinstance(error, GroupError), error
    assert "rank 2 joined the store" in str(error) and "before and that process has exited" in str(error)
    assert "init_group(rejoin=True)" in str(error)
    # The replacement waits for the survivors to renew; they never do here.
    with pytest.raises(GroupError, match=r"renew_membership #0 \(epoch 1\) timed out after 0\.5 s waiting for ranks "
                                         r"\[0, 1\] of 3 .*Buffer\.update_ep_member\(\)"):
        TCPGroup(2, 3, master_port=port, timeout_s=SHORT_TIMEOUT_S, rejoin=True)
    run_in_threads([lambda g=g: g.close(final_barrier=False) for g in groups[:2]])


def test_a_replacement_spends_one_timeout_on_its_whole_join(monkeypatch):
    """The member claim took 0.4 s of a 1 s timeout (a fake clock): the wait for the survivors' renewal
    gets the 0.6 s left, not 1 s more."""
    from mooncake_ep import _group_common, group as group_module

    port = free_port()
    groups = join(port, 2)
    die(groups[1])
    with TCPStoreClient("127.0.0.1", port, timeout_s=5.0) as probe:  # the store has seen it go (the claim
        # loop below, on the fake clock, would give up at once)
        eventually(lambda: isinstance(_threads.call_or_error(lambda: probe.get("member/1", 0.01)), StoreTimeoutError))
    clock = types.SimpleNamespace(now=100.0)
    fake_time = types.SimpleNamespace(monotonic=lambda: clock.now, sleep=time.sleep)
    for module in (_group_common, group_module):
        monkeypatch.setattr(module, "time", fake_time)
    take_over, renew, waits = TCPGroup._claim_rank_to_take_over, _group_common._KeyValueGroup._renew, []

    def slow_take_over(self, deadline):
        take_over(self, deadline)
        clock.now += 0.4

    def recorded_renew(self, wait_s):
        waits.append(wait_s)
        return renew(self, 0.1)  # the survivors never renew: fail soon

    monkeypatch.setattr(TCPGroup, "_claim_rank_to_take_over", slow_take_over)
    monkeypatch.setattr(_group_common._KeyValueGroup, "_renew", recorded_renew)
    with pytest.raises(GroupError, match=r"^renew_membership #0 \(epoch 1\) timed out after 1\.0 s waiting for "
                                         r"ranks \[0\] "):
        TCPGroup(1, 2, master_port=port, timeout_s=1.0, rejoin=True)
    assert waits == [pytest.approx(0.6)], waits
    groups[0].close(final_barrier=False)


def test_a_replacement_of_another_world_size_is_refused_before_it_joins_anything():
    """Before, it joined the survivors' renewal as far as its key went: the survivors settled that
    key, found the world sizes disagree, and every later renewal failed on the same key, with the
    right replacement too. Now it reads rank 0's world_size first and leaves nothing behind."""
    from mooncake_ep import RankMismatchError

    port = free_port()
    groups = join(port, 3)
    die(groups[2])
    for g in groups[:2]:
        g.timeout_s = SHORT_TIMEOUT_S
    wrong = run_in_threads([lambda: TCPGroup(2, 4, master_port=port, timeout_s=SHORT_TIMEOUT_S, rejoin=True)]
                           + [g.renew_membership for g in groups[:2]])
    assert isinstance(wrong[0], RankMismatchError), wrong
    assert str(wrong[0]).startswith("init_group: ranks disagree on world_size (rank 0: 3, rank 2: 4)"), wrong[0]
    assert all(isinstance(e, GroupError) and "waiting for ranks [2] of 3" in str(e) for e in wrong[1:]), wrong
    for g in groups[:2]:
        g.timeout_s = LONG_TIMEOUT_S
    renewed = run_in_threads([lambda: TCPGroup(2, 3, master_port=port, timeout_s=LONG_TIMEOUT_S, rejoin=True)]
                             + [g.renew_membership for g in groups[:2]])
    assert renewed[1:] == [[2], [2]], renewed
    groups[2] = renewed[0]
    assert gather_ranks(groups) == [[b"\0\1", b"\1\1", b"\2\1"]] * 3
    run_in_threads([lambda g=g: g.close() for g in groups])


def test_rejoin_of_a_rank_that_never_joined_is_refused():
    port = free_port()
    server = TCPStoreServer("127.0.0.1", port)  # a store with no group in it
    try:
        with pytest.raises(GroupError, match=r"rank 1 never joined the group .* \(no group's rank 0 serves this "
                                             r"store\): there is nothing to take over"):
            TCPGroup(1, 2, master_port=port, timeout_s=SHORT_TIMEOUT_S, rejoin=True)
    finally:
        server.close()
    # Rank 0 in its rendezvous, which rank 1 never completed: refused, and the rendezvous goes on.
    port = free_port()
    rank0 = _threads.tcp_rank0_in_its_round(port, 2, LONG_TIMEOUT_S, PROCESS_LIMIT_S)
    with pytest.raises(GroupError, match=r"rank 1 never joined the group .* \(no process of this rank completed the "
                                         r"rendezvous\): there is nothing to take over; join without rejoin"):
        TCPGroup(1, 2, master_port=port, timeout_s=SHORT_TIMEOUT_S, rejoin=True)
    rank1 = join_while_claimed(lambda: TCPGroup(1, 2, master_port=port, timeout_s=LONG_TIMEOUT_S))
    groups = [rank0(), rank1]
    assert gather_ranks(groups) == [[b"\0\0", b"\1\0"]] * 2
    run_in_threads([lambda g=g: g.close() for g in groups])


def test_init_group_rejoin_needs_the_tcp_store():
    torch_dist = pytest.importorskip("torch.distributed")
    store = torch_dist.HashStore()
    with pytest.raises(ValueError, match=r"rejoin=True takes over a rank of mooncake_ep's TCP store group"):
        init_group(store, rank=1, world_size=2, rejoin=True)


def test_renew_membership_over_a_torch_store():
    """Every store group has epochs: a renewal over a torch Store repairs it the same way."""
    torch_dist = pytest.importorskip("torch.distributed")
    store = torch_dist.HashStore()
    groups = run_in_threads([lambda r=r: TorchStoreGroup(store, r, 2, timeout_s=LONG_TIMEOUT_S) for r in range(2)])
    out = run_in_threads([groups[0].barrier, lambda: groups[1].allgather_bytes(b"x")])
    assert all(isinstance(e, GroupError) for e in out), out
    assert run_in_threads([g.renew_membership for g in groups]) == [[], []]
    assert gather_ranks(groups) == [[b"\0\1", b"\1\1"]] * 2
