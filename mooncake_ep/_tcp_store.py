"""The TCP store behind :class:`mooncake_ep.group.TCPGroup`: a key-value server and its client.

Standard library only. Rank 0 serves the store from a daemon thread (:class:`TCPStoreServer`);
every rank talks to it through one connection (:class:`TCPStoreClient`). Keys are strings, values
bytes; ``wait`` blocks server-side until the keys appear, so it costs one round trip, not polling.

Wire format: a connection opens with the client's hello, answered by a reply (OK, or an error that
says why: another protocol version, or the store serves its most connections already); a connection
that has not said it within ``_HELLO_DEADLINE_S`` is dropped, and past ``_MAX_UNGREETED_CONNECTIONS``
such connections a new one is closed at once. Then one request and one reply at a time::

    hello: a request of op 6 whose payload is magic b"MCEP", protocol version u32
    request: op u8, payload length u64, payload    reply: status u8, body length u64, body
    payload fields: key = u16 length + UTF-8, blob = u32 length + bytes, then fixed-size scalars

A key can be *claimed* (:meth:`TCPStoreClient.claim`): created only if absent and owned by the
connection that claimed it, so it disappears when that connection closes, which is when its
process exits or dies (unless a set, a delete, or a wait asked to settle it ended the claim
first), or when a wait of that connection that asked to withdraw it fails.
:class:`mooncake_ep.group.TCPGroup` holds one such key per rank, so a replacement process can take
over the rank of a dead one (``init_group(rejoin=True)``) and never that of a live one; its
rendezvous slots are claims too, settled by the round or withdrawn by a wait that failed. A
process forked from a rank (a worker pool, a data loader) closes its copies of the store's sockets
at once: holding them open would keep a dead rank's claims alive for as long as the child runs.

Users import :class:`TCPStoreServer`, :class:`TCPStoreClient` and :class:`StoreTimeoutError` from
:mod:`mooncake_ep.group`.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import ipaddress
import logging
import random
import select
import socket
import socketserver
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from mooncake_ep._group_common import (
    DEFAULT_TIMEOUT_S,
    GroupError,
    StoreHoldersGoneError,
    StoreTimeoutError,
    WITHDRAWN_SUFFIX,
    _PROTOCOL_VERSION,
    _StoreStalledError,
    _StoreWaitError,
    _check_data,
    _check_int,
    _check_port,
    _check_timeout,
    _forget_after_fork_in_children,
    _wait_arg,
)

__all__ = ["StoreHoldersGoneError", "StoreTimeoutError", "TCPStoreClient", "TCPStoreServer"]

logger = logging.getLogger("mooncake_ep")

# Tries of something that may succeed later (a connection to a store not up yet, a claim a dead
# process still holds) pause from the first to the second value (retry_pauses).
_RETRY_FIRST_S = 0.01
_RETRY_MAX_S = 0.5
# How often the store's accept loop checks for shutdown (bounds how long close() takes).
_SERVE_POLL_S = 0.05
# A connection must say the store's hello within this long of its handler starting: a client says it as
# soon as it has connected, so one that says nothing (a port scanner, a hung or hostile peer) is dropped,
# instead of holding a connection and a thread of rank 0's process for good. Generous: a rank whose
# process stalls between its connect and its hello must not be refused. A hello that came in time and
# waits unread (rank 0's own process stalled: Ctrl-Z, a call holding the GIL) is still read when it resumes.
_HELLO_DEADLINE_S = 30.0
# The most clients (connections that said the hello) the store serves at once, each with a thread of rank
# 0's process: a group holds one per rank, so a job of thousands of ranks, with replacements and the
# connections of dead processes that TCP has not given up yet, stays far below it. Past it a new client's
# hello is answered with an error that names the bound (a client looping on connect, a flood), and it is
# closed. Connections that have not said the hello yet do not count: a port scan cannot refuse real ranks.
_MAX_CONNECTIONS = 16384
# The most connections that have not said the hello yet, each with a thread until it does or its deadline
# passes: past it, a new connection is closed on the accept thread at once, with no thread and no reply.
# A rank's connection is one only from its accept to its hello, a moment, so even thousands of ranks
# connecting at once stay below it; silent ones (a scan, a flood) stay _HELLO_DEADLINE_S each. With
# _MAX_CONNECTIONS this bounds rank 0's store threads, whatever connects.
_MAX_UNGREETED_CONNECTIONS = 4096
# How often a server-side wait looks whether its client has hung up (died).
_DEAD_CLIENT_POLL_S = 0.5
# close() lets requests already woken by it (waits answered "closed") send their replies this long.
_CLOSE_REPLY_S = 1.0
# TCP keepalive on every store connection, both ends: a peer whose host vanished (power, network)
# leaves an idle connection that TCP would otherwise keep for the system's 2 hours, and with it the
# rank's claims (member/{rank}), so no replacement could join. Probes from 10 s idle, every 5 s, 3
# unanswered: ~25 s to drop it.
_KEEPALIVE_IDLE_S, _KEEPALIVE_INTERVAL_S, _KEEPALIVE_PROBES = 10, 5, 3
# A client allows the store this long beyond a server-side wait before it calls the link dead: a
# quarter of the wait, within these bounds (a short wait must not grow by 10 s when rank 0 stalls).
_REPLY_SLACK_S = (0.5, 10.0)
# Bytes a second a transfer is allowed at the slowest: a request or reply of N bytes gets N / this
# seconds on top of its time limit (the limit is for waiting on peers, not for moving data).
_MIN_TRANSFER_BYTES_PER_S = 20e6

# Store wire format. Request: header (op, payload bytes) + payload; reply: (status, bytes) + body.
# Payload fields: key = u16 length + UTF-8, blob = u32 length + bytes, then fixed-size scalars.
_HEADER = struct.Struct("!BQ")  # u64 lengths: a multi_get reply holds every rank's value, 4 GiB each at most
_HELLO, _MAGIC = struct.Struct("!4sI"), b"MCEP"
# The server reads a request of a length its client chose in pieces, growing from the first's size
# as bytes arrive, up to the largest's: a length that no data follows (a client of another protocol, or
# a hostile one) costs the first piece, not its length (_recv_in_pieces).
_RECV_FIRST_PIECE_BYTES, _RECV_PIECE_BYTES = 1 << 20, 64 << 20
# A set larger than this marks its key as arriving while its value comes in (waits on it go on).
_ARRIVING_SET_BYTES = 1 << 20
# A message (request or reply) whose body is up to this size is sent in one piece; a larger one as
# its header, then its parts.
_JOINED_MESSAGE_BYTES = 1 << 16
_U8, _U16, _U32 = struct.Struct("!B"), struct.Struct("!H"), struct.Struct("!I")
# The largest value the store holds: a blob's length is a u32.
_MAX_VALUE_BYTES = 0xFFFFFFFF
# The largest request a set can be (key length, key, value length, value): a longer one is not ours.
_MAX_SET_BYTES = _U16.size + 0xFFFF + _U32.size + _MAX_VALUE_BYTES
_I64, _U64, _F64 = struct.Struct("!q"), struct.Struct("!Q"), struct.Struct("!d")
_I64_RANGE = (-(1 << 63), (1 << 63) - 1)
_OP_SET, _OP_ADD, _OP_WAIT, _OP_DELETE, _OP_CLAIM = 1, 2, 3, 4, 5
# The hello is framed as a request (op, length, payload = magic, version): a store of protocol 3 or
# older answers it at once as an unknown op, which the client names, instead of waiting for more bytes.
_OP_HELLO = 6
_OK, _TIMEOUT, _ERROR, _CLOSED = 0, 1, 2, 3
# A wait ended early (body: the missing keys' indexes, then those among them whose holders are gone):
# a missing key's holder claim went with its connection, so no one will set the key.
_HOLDERS_GONE = 5
# An interim reply to a wait past its time (body: u64 bytes still coming): a missing key's value is
# arriving from a peer that set it in time; the client extends its own limit by that transfer.
_STILL_ARRIVING = 4
# Bits of a wait's flags byte: return the values; end the claims on the keys once all are there;
# remove the keys the waiting connection still holds a claim on when the wait fails (each leaving
# key + WITHDRAWN_SUFFIX); end the wait once a missing key's holder claim is gone (the request then
# names a holder key per key after the keys, "" for none).
_WAIT_VALUES, _WAIT_SETTLES_CLAIMS, _WAIT_WITHDRAWS_CLAIMS, _WAIT_ENDS_WITHOUT_HOLDERS = 1, 2, 4, 8
_DONT_WAIT = getattr(socket, "MSG_DONTWAIT", 0)  # the server's sockets block: a peek must not


class _StoreClosedError(_StoreWaitError):
    """A store wait was cut short because the server closed (rank 0 closed its group or exited)."""

    cut_short = "was cut short by the store closing (rank 0 closed its group or exited)"


# ----------------------------------------------------------------------------- wire format


def _configure(sock: socket.socket) -> None:
    """A store connection's options, on both ends: no Nagle delay (each message is a packet), and
    TCP keepalive (see _KEEPALIVE_IDLE_S; the per-socket times where the platform has them)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", _KEEPALIVE_IDLE_S), ("TCP_KEEPINTVL", _KEEPALIVE_INTERVAL_S),
                        ("TCP_KEEPCNT", _KEEPALIVE_PROBES)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def _pack_key(key: str) -> bytes:
    if not isinstance(key, str):
        raise TypeError(f"TCPStoreClient: a key must be a str, got {type(key).__name__}")
    raw = key.encode()
    if len(raw) > 0xFFFF:
        raise ValueError(f"TCPStoreClient: key must be at most 65535 UTF-8 bytes, got {len(raw)}")
    return _U16.pack(len(raw)) + raw


def _blob_length(value: bytes) -> bytes:
    if len(value) > _MAX_VALUE_BYTES:
        raise ValueError(f"TCPStoreClient: value must be below 4 GiB, got {len(value)} bytes")
    return _U32.pack(len(value))


def _pack_blob(value: bytes) -> bytes:
    return _blob_length(value) + value


class _Reader:
    """Reads the fields of one payload in order; a short or malformed payload raises ValueError."""

    def __init__(self, payload: bytes) -> None:
        self._view, self._pos = memoryview(payload), 0

    def _take(self, size: int) -> bytes:
        if self._pos + size > len(self._view):
            raise ValueError("truncated message")
        chunk = bytes(self._view[self._pos:self._pos + size])
        self._pos += size
        return chunk

    def scalar(self, fmt: struct.Struct) -> Any:
        return fmt.unpack(self._take(fmt.size))[0]

    def key(self) -> str:
        return self._take(self.scalar(_U16)).decode()

    def blob(self) -> bytes:
        return self._take(self.scalar(_U32))


def hello(version: int) -> bytes:
    """What a client says first on a connection: the store protocol ``version`` it speaks."""
    return _HEADER.pack(_OP_HELLO, _HELLO.size) + _HELLO.pack(_MAGIC, version)


def _send_message(sock: socket.socket, kind: int, parts: Sequence[bytes]) -> None:
    """A message: the header (``kind``, an op or a status; the body's length), then the body's
    ``parts``. A small one goes out in one send (with TCP_NODELAY each send is a packet); a large
    one's parts are sent as they are, not copied into one (a reply of every rank's value, a set)."""
    length = sum(len(part) for part in parts)
    if length <= _JOINED_MESSAGE_BYTES:
        sock.sendall(b"".join((_HEADER.pack(kind, length), *parts)))
        return
    sock.sendall(_HEADER.pack(kind, length))
    for part in parts:
        sock.sendall(part)


class _NoReplyYet(Exception):
    """Nothing of a wait's reply came within its limit: the connection stays in step (TCPStoreClient)."""


def _recv_exact(sock: socket.socket, size: int, deadline: float | None = None) -> bytes:
    """``size`` bytes from ``sock``; by ``deadline`` (a ``time.monotonic()``, for the whole of them,
    however they trickle in), else TimeoutError; None: within the socket's own timeout per read. Past
    the deadline, bytes already there are still read (without waiting): they came in time, and this
    process was the late one (stalled, or its thread not scheduled)."""
    buf = bytearray(size)
    view, got = memoryview(buf), 0
    while got < size:
        if deadline is not None:
            sock.settimeout(max(deadline - time.monotonic(), 0.0))  # 0: non-blocking
        try:
            n = sock.recv_into(view[got:])
        except BlockingIOError:  # past the deadline, and nothing there
            raise TimeoutError(f"{got} of {size} bytes came in time") from None
        if n == 0:
            raise ConnectionError("connection closed by the other side")
        got += n
    return bytes(buf)


def _recv_in_pieces(sock: socket.socket, size: int, prefix: bytes = b"") -> bytes:
    """``prefix`` + :func:`_recv_exact` for a length the peer chose: memory grows with the bytes that
    arrive, each piece at most as large as all before it (and _RECV_FIRST_PIECE_BYTES at first), so a
    length that no data follows costs at most that first piece."""
    if size <= _RECV_FIRST_PIECE_BYTES and not prefix:
        return _recv_exact(sock, size)
    pieces, got = [prefix], 0
    while got < size:
        piece = min(max(_RECV_FIRST_PIECE_BYTES, got), _RECV_PIECE_BYTES, size - got)
        pieces.append(_recv_exact(sock, piece))
        got += piece
    return b"".join(pieces)


def _close_fd_only(sock: socket.socket) -> None:
    """Close this process's descriptor of a socket it shares with its parent (no shutdown, which
    would end the parent's connection too)."""
    try:
        sock.close()
    except OSError:
        pass


# ----------------------------------------------------------------------------- server


class _StoreHandler(socketserver.BaseRequestHandler):
    """Serves one client connection: request, reply, until the client hangs up."""

    server: _StoreTCPServer

    def handle(self) -> None:
        sock: socket.socket = self.request
        # Blocking, whatever socket.setdefaulttimeout says: an idle client is not dropped, and a peek
        # at its socket from another connection's wait (_hung_up) never waits.
        sock.settimeout(None)
        _configure(sock)
        store = self.server.store
        deadline = time.monotonic() + _HELLO_DEADLINE_S
        try:  # (counted in on the accept thread: _StoreTCPServer.verify_request)
            if not self._greet(sock, store, deadline):
                return
            while True:
                try:
                    op, length = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
                except ConnectionError:
                    return  # the client closed: the normal end
                self._answer(sock, store, op, length)
        except OSError as exc:
            logger.debug("TCPStoreServer: dropped a client: %s", exc)
        finally:
            store._disconnected(sock)

    def _answer(self, sock: socket.socket, store: TCPStoreServer, op: int, length: int) -> None:
        """Reads the request whose header said (op, length), serves it and replies. Its own call, so
        that the request's bytes (a large set's, which the store keeps a copy of) are let go when it
        returns, not held until the client's next request replaces them."""
        arrived = None
        if op == _OP_SET and length > _MAX_SET_BYTES:
            # No client of this protocol sends it, and its bytes may never end: the connection is dropped
            # rather than its key marked arriving for the transfer time of that length.
            logger.warning("TCPStoreServer: dropped a client that sent a set of %d bytes, past the largest a "
                           "set can be (%d)", length, _MAX_SET_BYTES)
            raise ConnectionAbortedError("set too large")
        if op == _OP_SET and length > _ARRIVING_SET_BYTES:
            arrived, request = self._receive_set(sock, store, length)
        else:
            request = _recv_in_pieces(sock, length)
        store._busy(+1)
        try:
            try:
                status, body = store._serve(op, request, sock)
            finally:  # arriving until stored: a wait must never see it neither arriving nor there
                if arrived is not None:
                    arrived()
            _send_message(sock, status, [body] if isinstance(body, bytes) else body)
        finally:
            store._busy(-1)

    @staticmethod
    def _receive_set(sock: socket.socket, store: TCPStoreServer, length: int) -> tuple[Callable[[], None], bytes]:
        """A large set's request, ``(done, request)``: its key is marked arriving from when its value
        starts to come in until the caller, having stored it, calls ``done``, so that a wait for it
        does not time out on a peer that set it in time and is still sending."""
        head = _recv_exact(sock, _U16.size)
        key_raw = _recv_exact(sock, min(_U16.unpack(head)[0], length - _U16.size))
        done = store._arriving(key_raw.decode(errors="replace"), length)  # a malformed key: _serve refuses it
        try:
            return done, _recv_in_pieces(sock, length - len(head) - len(key_raw), prefix=head + key_raw)
        except BaseException:
            done()
            raise

    @staticmethod
    def _greet(sock: socket.socket, store: TCPStoreServer, deadline: float) -> bool:
        """Read the client's hello, by ``deadline`` (a ``time.monotonic()``), and answer it; False: the
        connection is not to be served. Where the store serves :data:`_MAX_CONNECTIONS` clients already,
        a client of this protocol is told so (read first, its hello is answered, not cut off by a reset).
        A client is counted greeted before the answer reaches it, so that a client whose connect
        returned is one the store's close() lets hang up first."""
        magic = version = None
        try:
            if _HEADER.unpack(_recv_exact(sock, _HEADER.size, deadline)) == (_OP_HELLO, _HELLO.size):
                magic, version = _HELLO.unpack(_recv_exact(sock, _HELLO.size, deadline))
        except ConnectionError:
            return False
        except TimeoutError:
            # Warned of once: a flood of silent connections must not flood the log too (the rest at debug).
            log = logger.debug if store._silent_drop_logged else logger.warning
            store._silent_drop_logged = True
            log("TCPStoreServer: dropped a connection that said no hello within %g s (a client says it as soon as "
                "it connects: a port scanner, or a process stopped since; more such drops are logged at debug)",
                _HELLO_DEADLINE_S)
            return False
        finally:
            sock.settimeout(None)  # served blocking from here (see handle)
        if magic != _MAGIC:
            logger.warning("TCPStoreServer: dropped a connection that does not speak the store protocol (a "
                           "mooncake_ep older than store protocol 4, or another program sent to MASTER_PORT)")
            return False
        if version != _PROTOCOL_VERSION:
            message = (f"the store speaks protocol {_PROTOCOL_VERSION} and this rank {version}: every rank "
                       f"must run the same mooncake_ep version").encode()
            _send_message(sock, _ERROR, [message])
            return False
        refusal = store._greeted(sock)
        if refusal is not None:
            _send_message(sock, _ERROR, [refusal.encode()])
            return False
        _send_message(sock, _OK, [])
        return True


class _StoreTCPServer(socketserver.ThreadingTCPServer):
    allow_reuse_address = True  # SO_REUSEADDR: a restarted job may rebind while old sockets linger
    # Every rank connects at start-up at once: socketserver's queue of 5 left the others to SYN
    # retransmission back-off (seconds), and past a few hundred ranks, to time out.
    request_queue_size = socket.SOMAXCONN
    daemon_threads = True
    block_on_close = False

    def __init__(self, address: tuple[str, int], family: int, store: TCPStoreServer,
                 listen_socket: socket.socket | None = None) -> None:
        self.address_family = family
        self.store = store
        self._out_of_descriptors = False  # accepts fail for want of a descriptor, and the log said so
        super().__init__(address, _StoreHandler, bind_and_activate=listen_socket is None)
        if listen_socket is not None:  # already bound and listening: served as it is
            self.socket.close()
            self.socket = listen_socket
            self.server_address = listen_socket.getsockname()

    def verify_request(self, request: socket.socket, client_address: Any) -> bool:
        """On the accept thread, before a handler thread starts: whether to serve ``request`` (else
        socketserver closes it at once). See :meth:`TCPStoreServer._admit`."""
        return self.store._admit(request)

    def shutdown_request(self, request: socket.socket) -> None:
        """Close a connection: refused, its handler failed to start, or its handler has ended."""
        self.store._disconnected(request)  # (idempotent: the handler's end said so already)
        super().shutdown_request(request)

    def get_request(self) -> tuple[socket.socket, Any]:
        """Accept a connection. One that fails for want of a descriptor is logged (socketserver drops the
        error unsaid) and pauses the accept loop, which would otherwise spin on the pending connection;
        the connection waits in the listen queue until a descriptor is free."""
        try:
            accepted = super().get_request()
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE):
                if not self._out_of_descriptors:
                    self._out_of_descriptors = True
                    logger.error("TCPStoreServer: cannot accept connections: rank 0's process has as many files open "
                                 "as it may (%s); raise its limit (ulimit -n) above a descriptor per rank, and "
                                 "its own files besides", exc.strerror)
                time.sleep(_SERVE_POLL_S)
            raise
        self._out_of_descriptors = False
        return accepted


class TCPStoreServer:
    """A key-value store served from a daemon thread of this process (rank 0's, in a TCPGroup).

    Keys are strings, values bytes. Clients block server-side in ``wait`` until their keys appear,
    so a wait costs one round trip, not polling.

    Args:
        host: address to listen on (MASTER_ADDR); must be an address of this host.
        port: TCP port (MASTER_PORT); 0 picks a free one, read back from :attr:`port`.
        listen_socket: a TCP socket already listening on ``port`` (0: on any), which the store
            serves instead of binding one: a launcher that bound it and passed it on leaves no
            moment in which another program could take the port. Refused by the checks
            (TypeError, ValueError), it stays the caller's; from then on it is the store's, which
            closes it when it closes, or when it fails to start.

    Raises:
        GroupError: the port is taken, or ``host`` is not an address of this host.
        ValueError: ``listen_socket`` is not a listening TCP socket on ``port``.
    """

    def __init__(self, host: str, port: int, *, listen_socket: socket.socket | None = None) -> None:
        port = _check_port("TCPStoreServer", port, "port", minimum=0)
        if listen_socket is not None:
            _check_listen_socket("TCPStoreServer", listen_socket, port)
        self.host = host
        self._data: dict[str, bytes] = {}
        self._cond = threading.Condition()
        self._closing = False
        self._clients: set[socket.socket] = set()
        # Those of them that said the hello: close() waits for these to hang up, not for a connection
        # that never said it (a port scanner, another protocol's client), which may never hang up.
        self._greeted_clients: set[socket.socket] = set()
        # Claimed key -> the connection holding it; a set or delete of the key ends the claim.
        self._claim_owners: dict[str, socket.socket] = {}
        # Keys whose large set is being received -> (length, time its transfer allowance ends) of each
        # such set (see _StoreHandler._receive_set): a wait for one goes on past its own time until the
        # value is in or its allowance ends (a setter that stalls, its connection open, is waited for
        # until then only: 10 s and the time of its bytes at the slowest rate a transfer is allowed).
        self._arriving_keys: dict[str, list[tuple[int, float]]] = {}
        self._num_busy = 0  # requests read and not yet answered
        self._full_since_logged = False  # refusing clients (_MAX_CONNECTIONS), and said so in the log
        self._ungreeted_full_logged = False  # closing new connections (_MAX_UNGREETED_CONNECTIONS), and said so
        self._silent_drop_logged = False  # dropped a connection that said no hello in time, and warned of it
        try:
            if listen_socket is not None:
                try:
                    self._server = _StoreTCPServer((host, port), listen_socket.family, self, listen_socket)
                except BaseException:  # the store's from its checks on, whatever comes: closed here
                    listen_socket.close()
                    raise
            else:
                family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
                self._server = _StoreTCPServer((host, port), family, self)
        except socket.gaierror as exc:
            raise GroupError(f"TCPStoreServer: cannot resolve MASTER_ADDR {host!r}: {exc}") from exc
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise GroupError(
                    f"TCPStoreServer: cannot listen on {host}:{port}: the port is already in use "
                    f"(another job, or a previous run still holding it); set MASTER_PORT to a free "
                    f"port on every rank, e.g. MASTER_PORT={_suggested_port(host)}") from exc
            raise GroupError(
                f"TCPStoreServer: cannot listen on {host}:{port}: {exc}; MASTER_ADDR must be an "
                f"address of rank 0's host") from exc
        self.port: int = self._server.server_address[1]
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": _SERVE_POLL_S},
            name=f"mooncake_ep-store-{self.port}", daemon=True)
        self._thread.start()
        # At interpreter exit, answer the peers' pending waits ("closed") before the daemon
        # threads die, so they learn which ranks they were waiting for instead of a bare reset.
        atexit.register(self.close)
        _forget_after_fork_in_children(self)
        logger.debug("TCPStoreServer: listening on %s:%d", host, self.port)

    def _forget_after_fork(self) -> None:
        """In a forked child: the store is the parent's; close the child's copies of its sockets (the
        listening one would keep the port, the clients' their claims) and do not close it at exit."""
        atexit.unregister(self.close)
        self._cond = threading.Condition()  # a parent's store thread may have held it at the fork
        self._closing = True  # close() (a group's finalizer, in the child) then returns at once
        _close_fd_only(self._server.socket)
        for sock in list(self._clients):
            _close_fd_only(sock)

    def __enter__(self) -> TCPStoreServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self, wait_for_clients_s: float = 0.0) -> None:
        """Stop serving. Idempotent.

        Args:
            wait_for_clients_s: seconds to wait for the clients connected now to hang up first (so
                a peer still reading its last reply is not cut off); 0 closes at once. A connection
                that has not said the store's hello is not waited for, nor one made meanwhile (a
                peer retrying at once would otherwise hold the store open for a retry it cannot
                complete). Interrupted (KeyboardInterrupt) while it waits, it still closes.
        """
        deadline = time.monotonic() + wait_for_clients_s
        with self._cond:
            if self._closing:
                return
            connected = set(self._greeted_clients)
        try:
            with self._cond:
                self._cond.wait_for(lambda: not (connected & self._greeted_clients),
                                    timeout=_wait_arg(max(0.0, deadline - time.monotonic())))
        finally:
            self._stop_serving()

    def _stop_serving(self) -> None:
        """Answer every waiter CLOSED, hang up on every client and stop the server thread."""
        with self._cond:
            if self._closing:  # a concurrent close() stops it
                return
            self._closing = True  # wakes any waiter: it answers CLOSED
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._num_busy == 0, timeout=_CLOSE_REPLY_S)
            left = list(self._clients)
        atexit.unregister(self.close)
        self._server.shutdown()
        self._server.server_close()
        for sock in left:  # ends the handler threads blocked in recv
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._thread.join()
        logger.debug("TCPStoreServer: closed %s:%d", self.host, self.port)

    @property
    def num_clients(self) -> int:
        """How many clients are connected now (connections that said the store's hello)."""
        with self._cond:
            return len(self._greeted_clients)

    def _admit(self, sock: socket.socket) -> bool:
        """Count a connection just accepted in, on the accept thread; False: it is not to be served, and
        socketserver closes it at once, with no handler thread: the store is closing, or
        :data:`_MAX_UNGREETED_CONNECTIONS` connections have not said the hello yet (a scan, a flood).

        A connection accepted while close() runs is refused here, under the lock close() set ``_closing``
        with; one admitted before is among those close() lists and shuts down: never served by a closed
        store.
        """
        with self._cond:
            if self._closing:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                return False
            num_ungreeted = len(self._clients) - len(self._greeted_clients)
            if num_ungreeted >= _MAX_UNGREETED_CONNECTIONS:
                if not self._ungreeted_full_logged:  # once while full: a flood must not flood the log too
                    self._ungreeted_full_logged = True
                    logger.warning("TCPStoreServer: %d connections have not said the store's hello yet, the most "
                                   "it waits for; closing new ones at once until those say it or their %g s run "
                                   "out (a port scan, or a flood, on MASTER_PORT?)", num_ungreeted,
                                   _HELLO_DEADLINE_S)
                return False
            self._clients.add(sock)
            return True

    def _disconnected(self, sock: socket.socket) -> None:
        """Count a connection out (idempotent): the client hung up, exited or died, so what it claimed
        is free again."""
        with self._cond:
            if sock not in self._clients:
                return
            self._clients.discard(sock)
            self._greeted_clients.discard(sock)
            self._drop_claims_of(sock)
            self._full_since_logged = self._full_since_logged and len(self._greeted_clients) >= _MAX_CONNECTIONS
            self._ungreeted_full_logged = self._ungreeted_full_logged and (
                len(self._clients) - len(self._greeted_clients) >= _MAX_UNGREETED_CONNECTIONS)
            self._cond.notify_all()

    def _greeted(self, sock: socket.socket) -> str | None:
        """The connection ``sock`` said the hello: None where it is a client of the store now, which
        close() lets hang up first; else why the store refuses it, which its hello is answered with: it
        serves :data:`_MAX_CONNECTIONS` clients already (it is not counted)."""
        with self._cond:
            if len(self._greeted_clients) >= _MAX_CONNECTIONS:
                if not self._full_since_logged:  # once while full: a flood must not flood the log too
                    self._full_since_logged = True
                    logger.warning("TCPStoreServer: %d clients connected, the most the store serves; refusing new "
                                   "ones until some close (a client reconnecting in a loop?)",
                                   len(self._greeted_clients))
                return (f"the store serves {_MAX_CONNECTIONS} connections already, the most it serves (each a "
                        f"thread of rank 0's process), where a group needs one per rank: some process keeps "
                        f"connecting to MASTER_PORT without closing")
            self._greeted_clients.add(sock)
            return None

    def _drop_claims_of(self, sock: socket.socket) -> None:
        """Remove what the connection ``sock`` claimed (and still holds); call with the lock held."""
        for key in [k for k, owner in self._claim_owners.items() if owner is sock]:
            del self._claim_owners[key]
            self._data.pop(key, None)

    def _dropped_hung_up_claimers(self, keys: list[str]) -> bool:
        """Whether some of ``keys`` were claimed by a connection that hung up, whose claims are then
        dropped here (as its handler would, a moment later); call with the lock held."""
        gone = {owner for owner in map(self._claim_owners.get, keys) if owner is not None and _hung_up(owner)}
        for sock in gone:
            self._drop_claims_of(sock)
        return bool(gone)

    def _arriving(self, key: str, num_bytes: int) -> Callable[[], None]:
        """Mark a set of ``num_bytes`` for ``key`` as being received; returns the call that marks it over.

        Its allowance is the time a transfer of that size gets (as a client gives its replies) from now.
        """
        entry = (num_bytes, time.monotonic() + _REPLY_SLACK_S[1] + num_bytes / _MIN_TRANSFER_BYTES_PER_S)
        with self._cond:
            self._arriving_keys.setdefault(key, []).append(entry)
            self._cond.notify_all()

        def done() -> None:
            with self._cond:
                entries = self._arriving_keys[key]
                entries.remove(entry)
                if not entries:
                    del self._arriving_keys[key]
                self._cond.notify_all()
        return done

    def _arriving_bytes(self, keys: list[str]) -> int:
        """Bytes still coming, within their allowance, for those of ``keys`` not set yet (under _cond)."""
        now = time.monotonic()
        return sum(length for k in keys if k not in self._data for length, until in self._arriving_keys.get(k, ())
                   if now < until)

    def _busy(self, delta: int) -> None:
        with self._cond:
            self._num_busy += delta
            self._cond.notify_all()

    def _serve(self, op: int, payload: bytes, client: socket.socket | None = None) -> tuple[int, bytes]:
        """One request from the connection ``client``: returns (status, reply body); a wait's body
        as the list of its parts (the values are not copied into one)."""
        try:
            reader = _Reader(payload)
            if op == _OP_SET:
                key, value = reader.key(), reader.blob()
                with self._cond:
                    self._data[key] = value
                    self._claim_owners.pop(key, None)
                    self._cond.notify_all()
                return _OK, b""
            if op == _OP_ADD:
                key, amount = reader.key(), reader.scalar(_I64)
                with self._cond:
                    try:
                        total = int(self._data.get(key, b"0")) + amount
                    except ValueError:
                        return _ERROR, f"add: key {key!r} holds a value that is not a counter".encode()
                    if not _I64_RANGE[0] <= total <= _I64_RANGE[1]:  # refused before the store changes
                        return _ERROR, f"add: key {key!r} would pass the signed 64-bit range ({total})".encode()
                    self._data[key] = str(total).encode()
                    self._cond.notify_all()
                return _OK, _I64.pack(total)
            if op == _OP_WAIT:
                timeout_s, flags = reader.scalar(_F64), reader.scalar(_U8)
                keys = [reader.key() for _ in range(reader.scalar(_U32))]
                holders = ([reader.key() for _ in range(reader.scalar(_U32))] if flags & _WAIT_ENDS_WITHOUT_HOLDERS
                           else [])
                if holders and len(holders) != len(keys):
                    return _ERROR, f"wait: {len(holders)} holder keys for {len(keys)} keys".encode()
                deadline = time.monotonic() + timeout_s

                def orphaned() -> list[int]:  # missing keys whose holders are gone (call with the lock held)
                    # No peek at the holders' sockets here (the predicate runs on every set, for every
                    # waiter): a holder killed in a wait of its own is let go by that wait's next slice,
                    # _DEAD_CLIENT_POLL_S, whose handler then drops its claims and wakes this wait.
                    return [i for i, (k, h) in enumerate(zip(keys, holders))
                            if h and k not in self._data and h not in self._data]

                with self._cond:
                    # In slices, looking at the connection in between: a client that died while
                    # waiting (its socket closed) is let go at once, and with it its claims, instead
                    # of holding them until its wait would have run out. Past the deadline the wait
                    # goes on while a missing key's value is still coming in: its peer was in time.
                    # A wait that settles claims first drops those of claimers that hung up (a rank
                    # killed in its own wait, which its handler notices only at its next slice): a
                    # round is never settled with a member that is gone.
                    # A wait given holders ends once a missing key's holder is gone: nobody will set it.
                    while not self._cond.wait_for(
                            lambda: self._closing or (all(k in self._data for k in keys) and not (
                                flags & _WAIT_SETTLES_CLAIMS and self._dropped_hung_up_claimers(keys)))
                            or bool(orphaned()),
                            timeout=max(0.0, min(_DEAD_CLIENT_POLL_S, deadline - time.monotonic()))):
                        arriving = self._arriving_bytes(keys)
                        if (time.monotonic() >= deadline and not arriving) or _hung_up(client):
                            break
                        if time.monotonic() >= deadline:  # told, then woken when it lands (_arriving)
                            if client is not None:  # sent without the store's lock: a waiter that stopped
                                self._cond.release()  # reading holds up its own request, no other
                                try:
                                    _send_message(client, _STILL_ARRIVING, [_U64.pack(arriving)])
                                finally:
                                    self._cond.acquire()
                            if not all(k in self._data for k in keys):  # it may have landed meanwhile
                                self._cond.wait(_DEAD_CLIENT_POLL_S)
                    missing = [i for i, k in enumerate(keys) if k not in self._data]
                    if missing:
                        if flags & _WAIT_WITHDRAWS_CLAIMS:  # in the step that failed the wait: no peer's
                            for key in keys:  # wait can have found them all there meanwhile
                                if client is not None and self._claim_owners.get(key) is client:
                                    del self._data[key], self._claim_owners[key]
                                    self._data[key + WITHDRAWN_SUFFIX] = b""
                        body = _U32.pack(len(missing)) + b"".join(_U32.pack(i) for i in missing)
                        gone = [] if self._closing else orphaned()
                        if gone:
                            return _HOLDERS_GONE, body + _U32.pack(len(gone)) + b"".join(_U32.pack(i) for i in gone)
                        return (_CLOSED if self._closing else _TIMEOUT), body
                    values = [self._data[k] for k in keys] if flags & _WAIT_VALUES else []
                    if flags & _WAIT_SETTLES_CLAIMS:  # in the same step as the answer, no window between
                        for key in keys:
                            self._claim_owners.pop(key, None)
                return _OK, [part for v in values for part in (_U32.pack(len(v)), v)]
            if op == _OP_DELETE:
                key = reader.key()
                with self._cond:
                    existed = self._data.pop(key, None) is not None
                    self._claim_owners.pop(key, None)
                return _OK, _U8.pack(existed)
            if op == _OP_CLAIM:
                key, value = reader.key(), reader.blob()
                with self._cond:
                    # A claimer that hung up loses its claims here, not only when its handler notices:
                    # one killed in a wait is seen at that wait's next slice (_DEAD_CLIENT_POLL_S), and
                    # its process restarted meanwhile was refused as a second live one.
                    if key in self._data:
                        self._dropped_hung_up_claimers([key])
                    if key in self._data:
                        return _OK, _U8.pack(False)
                    self._data[key] = value
                    self._claim_owners[key] = client
                    self._cond.notify_all()
                return _OK, _U8.pack(True)
            return _ERROR, f"unknown op {op}".encode()
        except (ValueError, struct.error, UnicodeDecodeError) as exc:
            return _ERROR, f"malformed request (op {op}): {exc}".encode()


def _hung_up(sock: socket.socket | None) -> bool:
    """Whether the client closed its end: its socket reads end of file, or an error. (Data waiting
    is a request; it may be read meanwhile by the connection's own handler, so the peek never blocks.)"""
    if sock is None:
        return False
    try:
        poller = select.poll()  # not select.select: it refuses descriptors past 1023 (a large group's rank 0)
        poller.register(sock, select.POLLIN)
        return bool(poller.poll(0)) and not sock.recv(1, socket.MSG_PEEK | _DONT_WAIT)
    except BlockingIOError:  # its handler read the request between the poll and the peek
        return False
    except OSError:
        return True


def _check_listen_socket(where: str, sock: Any, port: int, name: str = "listen_socket",
                         host: str | None = None) -> None:
    """ValueError (TypeError for another object) unless ``sock`` is a TCP socket listening on ``port``
    (any, for 0) and, where ``host`` is given, bound to one of its addresses or to a wildcard (else the
    ranks, rank 0's own client too, could not reach it at ``host``). ``name``: the caller's argument."""
    if not isinstance(sock, socket.socket):
        raise TypeError(f"{where}: {name} must be a socket.socket, got {type(sock).__name__}")
    try:
        listening = sock.type == socket.SOCK_STREAM and sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
        bound = sock.getsockname() if sock.family in (socket.AF_INET, socket.AF_INET6) else None
    except OSError as exc:  # closed
        raise ValueError(f"{where}: {name} is not usable: {exc}") from None
    if not listening or bound is None:
        raise ValueError(f"{where}: {name} must be a TCP socket that listens (socket.create_server), got {sock!r}")
    if port and bound[1] != port:
        raise ValueError(f"{where}: {name} listens on port {bound[1]}, not the store's port {port}")
    if host is not None:
        bound_address = _plain_address(bound[0])
        if not bound_address.is_unspecified:
            try:
                addresses = {_plain_address(info[4][0]) for info in socket.getaddrinfo(host, bound[1],
                                                                                       type=socket.SOCK_STREAM)}
            except socket.gaierror:  # the client's connection says so, naming MASTER_ADDR
                return
            if bound_address not in addresses:
                raise ValueError(f"{where}: {name} is bound to {bound[0]}, which is not master_addr {host!r} "
                                 f"({', '.join(sorted(map(str, addresses)))}): the ranks connect there; bind it to "
                                 f"that address or to all (\"\" or 0.0.0.0)")


def _plain_address(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """An address of a socket or of getaddrinfo, an IPv4 one mapped into IPv6 as itself (a dual-stack
    socket's peers)."""
    address = ipaddress.ip_address(text.split("%", 1)[0])  # (an IPv6 scope)
    mapped = getattr(address, "ipv4_mapped", None)
    return mapped if mapped is not None else address


def _listening_port(sock: Any) -> int | None:
    """The port ``sock`` is bound to, where it is a TCP/IP socket that can say; None otherwise (its
    check, :func:`_check_listen_socket`, says what is wrong)."""
    if not isinstance(sock, socket.socket) or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return None
    try:
        return sock.getsockname()[1] or None
    except OSError:
        return None


# Where free_port looks first: below Linux's ephemeral range (32768-60999).
_PORT_RANGE = (20000, 32768)


def retry_pauses(deadline: float) -> Iterator[bool]:
    """The pauses between tries of something that may succeed later: each ``next()`` sleeps (from
    :data:`_RETRY_FIRST_S`, doubling up to :data:`_RETRY_MAX_S`, never past ``deadline``, a
    ``time.monotonic()``) and gives True; once the deadline has passed it gives nothing, so the
    caller's last try comes at the deadline, not a pause before it."""
    delay = _RETRY_FIRST_S
    while (remaining_s := deadline - time.monotonic()) > 0:
        time.sleep(min(delay, remaining_s))
        delay = min(2 * delay, _RETRY_MAX_S)
        yield True


def connect(host: str, port: int, timeout_s: float) -> socket.socket:
    """A TCP connection to ``host:port``, tried again (backing off) until ``timeout_s`` has passed:
    the listener may not be up yet. Raises the last attempt's OSError once the time is spent."""
    deadline = time.monotonic() + timeout_s
    pauses = retry_pauses(deadline)
    while True:
        try:
            # The attempt's own limit is what is left: a host that drops packets holds it that long.
            return socket.create_connection((host, port), timeout=_wait_arg(max(deadline - time.monotonic(), 0.01)))
        except OSError:  # refused (server not up yet), unreachable, unresolvable
            if not next(pauses, False):
                raise


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now on ``host``, for a store to listen on, below Linux's ephemeral range
    (32768-60999), from which the OS gives every outgoing connection on the machine its local port: a
    port probed there (bind to port 0) can be taken by any such connection before rank 0 binds it.
    Another program may still take it first (the server then says so).

    Raises:
        OSError: ``host`` is not an address of this machine.
    """
    for _ in range(200):
        port = random.randrange(*_PORT_RANGE)
        try:
            with socket.create_server((host, port)):
                return port
        except OSError:  # taken
            continue
    with socket.create_server((host, 0)) as probe:  # a crowded range: the OS's choice
        return probe.getsockname()[1]


def _suggested_port(host: str) -> int | str:
    """free_port, for an error message: a placeholder where none can be found."""
    try:
        return free_port(host)
    except OSError:
        return "<a free port>"


# ----------------------------------------------------------------------------- client


class TCPStoreClient:
    """A connection to a :class:`TCPStoreServer`. Thread-safe: one request at a time, so a request
    waits for another thread's (a ``wait``) up to its own limit; a thread waiting for a key that
    another thread is to set through the same client would wait for itself.

    Args:
        host: the server's address (MASTER_ADDR).
        port: the server's port (MASTER_PORT).
        timeout_s: seconds to keep retrying the connection (the server may start later), and
            the limit for requests that do not wait for keys.
        who: names this client in error messages (e.g. ``"rank 3"``).

    Raises:
        GroupError: no connection within ``timeout_s``.
    """

    def __init__(self, host: str, port: int, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                 who: str = "TCPStoreClient") -> None:
        self.host, self.port = host, _check_port("TCPStoreClient", port, "port")
        self.timeout_s = timeout_s
        self._who = who
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._closing = False  # close() was called: a request failing now was cut short by it
        # Replies of waits that ran past their limit before a byte of them came (rank 0's process
        # stalled): read and dropped before the next request, so that a stall closes no link (closed,
        # it would take this rank's claims with it: its membership, for good).
        self._unread_replies = 0
        try:
            self._sock = connect(host, port, self.timeout_s)
        except OSError as exc:
            raise GroupError(f"{who}: could not connect to the store at {host}:{port} within {self.timeout_s} s "
                             f"({exc}); rank 0 serves it: check that rank 0 is running and that MASTER_ADDR and "
                             f"MASTER_PORT match on every rank") from exc
        _configure(self._sock)
        _forget_after_fork_in_children(self)
        self._hello()
        logger.debug("%s: connected to the store at %s:%d", who, host, port)

    @property
    def timeout_s(self) -> float:
        """Seconds a request that does not wait for keys may take (and the connection's retries)."""
        return self._timeout_s

    @timeout_s.setter
    def timeout_s(self, value: float) -> None:
        self._timeout_s = _check_timeout("TCPStoreClient", value)

    def _hello(self) -> None:
        """Say which protocol this rank speaks; the store refuses another one by name."""
        where = f"{self._who}: store at {self.host}:{self.port}"
        not_ours = (f"rank 0 may run a mooncake_ep of an older store protocol (this one speaks {_PROTOCOL_VERSION}), "
                    f"or another program listens on MASTER_PORT")
        try:
            self._sock.settimeout(_wait_arg(self.timeout_s))
            self._sock.sendall(hello(_PROTOCOL_VERSION))
            status, length = _HEADER.unpack(_recv_exact(self._sock, _HEADER.size))
            if status not in (_OK, _ERROR):  # what every store of a protocol with the hello answers it
                raise ValueError(f"a reply that is not the store's (status {status})")
            body = _recv_exact(self._sock, min(length, 1 << 16))
        except (OSError, ValueError) as exc:
            self._sock.close()
            self._sock = None
            if isinstance(exc, TimeoutError):  # a store of any protocol answers a hello at once, if only to refuse it
                cause = (f"none within {self.timeout_s} s: rank 0's process may be stopped or too busy to serve its "
                         f"store, or another program listens on MASTER_PORT")
            elif isinstance(exc, ConnectionError):  # a reset, or end of file: before any reply of a store
                cause = (f"{exc or type(exc).__name__}: rank 0's store closed the connection during the hello: its "
                         f"process may have exited, or its store closes new connections (see rank 0's log)")
            else:
                cause = f"{exc or type(exc).__name__}: {not_ours}"
            raise GroupError(f"{where}: no answer to this rank's hello ({cause})") from exc
        if status != _OK:
            self._sock.close()
            self._sock = None
            reason = body.decode(errors="replace")
            if reason.startswith(f"unknown op {_OP_HELLO}"):  # a store from before the hello
                reason = (f"it runs a mooncake_ep of store protocol 3 or older, and this rank {_PROTOCOL_VERSION}: "
                          f"every rank must run the same mooncake_ep version")
            raise GroupError(f"{where}: refused this rank: {reason}")

    def _first_bytes(self, where: str, io_timeout: float) -> bytes:
        """The first bytes of a wait's reply; _NoReplyYet where none came within ``io_timeout``."""
        try:
            first = self._sock.recv(_HEADER.size)
        except TimeoutError:
            raise _NoReplyYet(f"{where}: no reply within {io_timeout:.1f} s: rank 0's process, which serves the "
                              f"store, stalled or is overloaded; the connection stays, its late reply read before "
                              f"the next request's") from None
        if not first:
            raise ConnectionError("connection closed by the other side")
        return first

    def _read_reply(self, io_timeout: float, reply_bytes: int, arriving: list[int] | None,
                    first: bytes = b"") -> tuple[int, bytes]:
        """One reply's (status, body), its header's ``first`` bytes already read (see :meth:`_request`)."""
        head = first + _recv_exact(self._sock, _HEADER.size - len(first))
        status, length = _HEADER.unpack(head)
        while status == _STILL_ARRIVING:
            arriving_bytes = _U64.unpack(_recv_exact(self._sock, length))[0]
            if arriving is not None:
                arriving.append(arriving_bytes)
            io_timeout = _REPLY_SLACK_S[1] + (arriving_bytes + reply_bytes) / _MIN_TRANSFER_BYTES_PER_S
            self._sock.settimeout(_wait_arg(io_timeout))
            status, length = _HEADER.unpack(_recv_exact(self._sock, _HEADER.size))
        self._sock.settimeout(_wait_arg(io_timeout + length / _MIN_TRANSFER_BYTES_PER_S))
        return status, _recv_exact(self._sock, length)

    def _forget_after_fork(self) -> None:
        """In a forked child: this connection is the parent's; close the child's copy of it."""
        self._lock = threading.Lock()  # a parent thread may have held it at the fork
        if self._sock is not None:
            _close_fd_only(self._sock)
            self._sock = None

    def __enter__(self) -> TCPStoreClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Hang up. Idempotent. A request in flight on another thread (a wait) fails at once with
        GroupError, instead of holding this call for its whole timeout."""
        sock = self._sock
        if sock is not None:
            self._closing = True
            with contextlib.suppress(OSError):  # not connected any more
                sock.shutdown(socket.SHUT_RDWR)
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None

    def set(self, key: str, value: bytes) -> None:
        """Store ``value`` under ``key`` (replacing any value), waking the waiters on it."""
        value = _check_data("TCPStoreClient.set", value, "value")
        self._request(_OP_SET, [_pack_key(key), _blob_length(value), value])  # sent as parts: no copy

    def add(self, key: str, amount: int) -> int:
        """Atomically add ``amount`` to the counter ``key`` (absent = 0); returns the new value."""
        if isinstance(amount, bool) or not isinstance(amount, int):
            raise TypeError(f"TCPStoreClient.add: amount must be an int, got {type(amount).__name__}")
        if not _I64_RANGE[0] <= amount <= _I64_RANGE[1]:
            raise ValueError(f"TCPStoreClient.add: amount must fit a signed 64-bit counter, got {amount}")
        _, body = self._request(_OP_ADD, _pack_key(key) + _I64.pack(amount))
        return _I64.unpack(body)[0]

    def claim(self, key: str, value: bytes = b"") -> bool:
        """Set ``key`` to ``value`` only if it is absent, owned by this connection.

        The key is removed when this connection closes (:meth:`close`, or the process exiting or
        dying, whose sockets the OS closes), so a claim marks a live holder.

        Returns:
            True if this call created the key; False if it exists (claimed by a live connection,
            or set by :meth:`set`).
        """
        _, body = self._request(_OP_CLAIM, _pack_key(key) + _pack_blob(_check_data("TCPStoreClient.claim", value, "value")))
        return bool(_U8.unpack(body)[0])

    def delete(self, key: str) -> bool:
        """Remove ``key``; returns whether it existed."""
        _, body = self._request(_OP_DELETE, _pack_key(key))
        return bool(_U8.unpack(body)[0])

    def get(self, key: str, timeout_s: float) -> bytes:
        """The value of ``key``, waiting up to ``timeout_s`` seconds for it to be set.

        Raises:
            StoreTimeoutError: ``key`` was not set in time.
        """
        return self._wait("TCPStoreClient.get", [key], timeout_s, want_values=True)[0]

    def wait(self, keys: Sequence[str], timeout_s: float) -> None:
        """Return once every key in ``keys`` is set.

        Raises:
            StoreTimeoutError: some keys were not set within ``timeout_s`` seconds; its
                ``missing_keys`` lists them.
        """
        self._wait("TCPStoreClient.wait", keys, timeout_s, want_values=False)

    def multi_get(self, keys: Sequence[str], timeout_s: float, reply_bytes: int = 0,
                  settle_claims: bool = False, withdraw_claims: bool = False,
                  holders: Sequence[str] | None = None) -> list[bytes]:
        """Wait as :meth:`wait` does, then return the values of ``keys`` in order (one round trip).

        ``reply_bytes``: about how many bytes the values hold; the store needs time to assemble and
        send them beyond ``timeout_s`` (which bounds the wait for the keys, not the transfer).
        ``settle_claims``: once all keys are there, end the claims on them in the same step, so that
        a peer whose wait for the same keys is still on its way finds them too, whatever becomes of
        their claimers (a round every rank must see complete).
        ``withdraw_claims``: if the wait fails, remove the keys among ``keys`` that this connection
        still holds a claim on, in the same step, setting ``key + WITHDRAWN_SUFFIX`` beside each.
        With ``settle_claims`` on every rank's wait, a round then either completes for every rank
        or for none: a rank that gave up takes its key with it, and never leaves peers a round
        whose member has left (and they can tell it came).
        ``holders``: per key, the claim whose holder sets it ("" for none): the wait ends at once,
        raising :class:`StoreHoldersGoneError`, when a missing key's holder claim is gone (its
        connection closed: the process exited or died), instead of waiting out ``timeout_s`` for a
        key nobody will set.
        """
        return self._wait("TCPStoreClient.multi_get", keys, timeout_s, want_values=True, reply_bytes=reply_bytes,
                          settle_claims=settle_claims, withdraw_claims=withdraw_claims, holders=holders)

    def _wait(self, where: str, keys: Sequence[str], timeout_s: float, want_values: bool,
              reply_bytes: int = 0, settle_claims: bool = False, withdraw_claims: bool = False,
              holders: Sequence[str] | None = None) -> list[bytes]:
        timeout_s = _check_timeout(where, timeout_s)
        reply_bytes = _check_int(where, "reply_bytes", reply_bytes, 0)
        if isinstance(keys, (str, bytes)):  # a sequence, but of characters
            raise TypeError(f"{where}: keys must be a sequence of str, got one {type(keys).__name__}")
        keys = list(keys)
        if holders is not None:
            holders = list(holders)
            if len(holders) != len(keys):
                raise ValueError(f"{where}: holders must name one claim (or \"\") per key: {len(holders)} for "
                                 f"{len(keys)} keys")
        flags = ((_WAIT_VALUES if want_values else 0) | (_WAIT_SETTLES_CLAIMS if settle_claims else 0)
                 | (_WAIT_WITHDRAWS_CLAIMS if withdraw_claims else 0)
                 | (_WAIT_ENDS_WITHOUT_HOLDERS if holders is not None else 0))
        payload = (_F64.pack(timeout_s) + _U8.pack(flags) + _U32.pack(len(keys))
                   + b"".join(_pack_key(k) for k in keys))
        if holders is not None:
            payload += _U32.pack(len(holders)) + b"".join(_pack_key(h) for h in holders)
        arriving: list[int] = []
        status, body = self._request(_OP_WAIT, payload, wait_s=timeout_s, reply_bytes=reply_bytes, arriving=arriving,
                                     decides_claims=settle_claims or withdraw_claims)
        reader = _Reader(body)
        if status != _OK:
            missing = [keys[reader.scalar(_U32)] for _ in range(reader.scalar(_U32))]
            if status == _HOLDERS_GONE:
                gone = [keys[reader.scalar(_U32)] for _ in range(reader.scalar(_U32))]
                raise StoreHoldersGoneError(
                    f"{where}: the holders of keys {gone} are gone (their store connections closed: the processes "
                    f"exited or died) while waiting for keys {missing}", missing, gone)
            if status == _CLOSED:
                raise _StoreClosedError(
                    f"{where}: the store at {self.host}:{self.port} closed (rank 0 closed its group or "
                    f"exited) while waiting for keys {missing}", missing)
            late = (f" (and longer: the store held the wait while a value of {max(arriving)} bytes for them was "
                    f"still arriving, until its transfer allowance ran out)" if arriving else "")
            raise StoreTimeoutError(f"{where}: timed out after {timeout_s} s waiting for keys {missing}{late}", missing,
                                    late)
        return [reader.blob() for _ in keys] if want_values else []

    def _request(self, op: int, payload: bytes | list[bytes], wait_s: float = 0.0,
                 reply_bytes: int = 0, arriving: list[int] | None = None,
                 decides_claims: bool = False) -> tuple[int, bytes]:
        """Send one request (its payload, or the parts of it), read its reply. A broken link closes
        the socket for good; a wait whose reply has not begun by its limit (rank 0's process stalled)
        raises and leaves it open, the reply to be read and dropped before the next request.

        ``decides_claims``: a wait that settles or withdraws claims (a round every rank must see
        complete, or none) waits for the store's verdict up to ``timeout_s`` past its own limit, since
        the store may still settle the round with this rank's claim in it; past that the link is
        closed, which takes the claim out of the round.

        ``reply_bytes``: the reply's expected size; the server reads the request before it answers,
        so the header's wait gets both transfers' time. A wait the server extends for a value still
        arriving (:data:`_STILL_ARRIVING`) extends this side's limit by that value's transfer, and
        appends the value's bytes to ``arriving``.
        """
        parts = [payload] if isinstance(payload, bytes) else payload
        payload_bytes = sum(len(part) for part in parts)
        where = f"{self._who}: store at {self.host}:{self.port}"
        # The server answers a wait itself when wait_s runs out; past the slack rank 0 stalled (or died).
        if decides_claims:
            io_timeout = wait_s + self.timeout_s
        elif wait_s:
            io_timeout = wait_s + min(max(0.25 * wait_s, _REPLY_SLACK_S[0]), _REPLY_SLACK_S[1])
        else:
            io_timeout = self.timeout_s
        # The server reads the whole request before it answers.
        io_timeout += (payload_bytes + reply_bytes) / _MIN_TRANSFER_BYTES_PER_S
        limit = _wait_arg(io_timeout)
        if not self._lock.acquire(timeout=-1 if limit is None else limit):
            raise GroupError(f"{where}: another thread's request on this connection held it past this request's "
                             f"limit ({io_timeout:.1f} s); the connection serves one request at a time")
        try:
            if self._sock is None:
                raise GroupError(f"{where}: the connection is closed")
            try:
                self._sock.settimeout(_wait_arg(io_timeout))
                while self._unread_replies:  # rank 0 answers in order: the late replies come first
                    self._read_reply(io_timeout, 0, None, self._first_bytes(where, io_timeout))
                    self._unread_replies -= 1
                    self._sock.settimeout(_wait_arg(io_timeout))  # (a reply's reading moves it)
                _send_message(self._sock, op, parts)
                if wait_s and not decides_claims:
                    try:
                        first = self._first_bytes(where, io_timeout)
                    except _NoReplyYet:
                        self._unread_replies += 1
                        raise
                else:
                    first = b""
                status, body = self._read_reply(io_timeout, reply_bytes, arriving, first)
            except _NoReplyYet as exc:
                raise _StoreStalledError(str(exc)) from None
            except BaseException as exc:  # a late or half-read reply would desynchronise the stream
                self._sock.close()
                self._sock = None
                if not isinstance(exc, OSError):  # interrupted (Ctrl-C) mid-request: the link is unusable
                    raise
                if self._closing:
                    raise GroupError(f"{where}: the connection was closed (close()) while this request "
                                     f"waited") from exc
                if isinstance(exc, TimeoutError):
                    raise GroupError(f"{where}: no reply within {io_timeout:.1f} s: rank 0's process, which "
                                     f"serves the store, stalled or is overloaded; the connection is closed") from exc
                raise GroupError(f"{where}: lost the connection ({exc}); rank 0's process, which "
                                 f"serves the store, may have exited") from exc
        finally:
            self._lock.release()
        if status == _ERROR:
            raise GroupError(f"{where}: {body.decode(errors='replace')}")
        if status == _CLOSED and op != _OP_WAIT:
            raise GroupError(f"{where}: the store is shutting down (rank 0 closed its group)")
        return status, body
