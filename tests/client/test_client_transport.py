"""Transports against real local sockets: framing of replies, buffer growth, deadlines,
scatter-gather sends, Unix sockets, endpoints and fork safety (docs/contract.md 2, 3, 7.5)."""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from client_fakes import FakeWorker

from dspark_client.discovery import check_endpoint
from dspark_client.transport import (
    EndpointError,
    SocketClient,
    TransportError,
    TransportTimeout,
    make_client,
    parse_endpoint,
)
from protocol import wire


@contextlib.contextmanager
def serve(handler: Callable[[socket.socket], None], unix_dir: str | None = None
          ) -> Iterator[str]:
    """Accept one connection and run ``handler`` on it in a thread; yield the endpoint."""
    if unix_dir is not None:
        path = os.path.join(unix_dir, "s.sock")
        lst = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        lst.bind(path)
        endpoint = f"unix://{path}"
    else:
        lst = socket.socket()
        lst.bind(("127.0.0.1", 0))
        endpoint = f"tcp://127.0.0.1:{lst.getsockname()[1]}"
    lst.listen(1)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            conn, _ = lst.accept()
        except OSError:
            return
        with conn:
            try:
                handler(conn)
            except OSError:
                pass
            except BaseException as exc:  # surfaced in the test thread
                errors.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    try:
        yield endpoint
    finally:
        with contextlib.suppress(OSError):
            lst.shutdown(socket.SHUT_RDWR)
        lst.close()
        t.join(5)
    if errors:
        raise errors[0]


def read_frame(conn: socket.socket) -> tuple[wire.AppHeader, bytes]:
    head = recv_exact(conn, wire.APP_HEADER_SIZE)
    h = wire.AppHeader.unpack(head)
    return h, recv_exact(conn, h.body_len)


def recv_exact(conn: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = conn.recv(n - len(out))
        if not chunk:
            raise ConnectionError("peer closed")
        out += chunk
    return bytes(out)


def ping_frame(seq: int = 1) -> bytes:
    return wire.frame(wire.OP_PING, seq, 0, b"")


# -- endpoints -----------------------------------------------------------------------------------
@pytest.mark.parametrize("text, kind, host, port, path", [
    ("tcp://127.0.0.1:7600", "tcp", "127.0.0.1", 7600, ""),
    ("tcp://worker-0.dspark.svc:1", "tcp", "worker-0.dspark.svc", 1, ""),
    ("tcp://[::1]:65535", "tcp", "::1", 65535, ""),
    ("unix:///run/dspark/w.sock", "unix", "", 0, "/run/dspark/w.sock"),
])
def test_parse_endpoint(text: str, kind: str, host: str, port: int, path: str) -> None:
    ep = parse_endpoint(text)
    assert (ep.kind, ep.host, ep.port, ep.path) == (kind, host, port, path)


@pytest.mark.parametrize("text, words", [
    ("127.0.0.1:7600", "no scheme"),
    ("http://127.0.0.1:7600", "unknown scheme 'http'"),
    ("tcp://127.0.0.1", "no host:port"),
    ("tcp://:7600", "no host:port"),
    ("tcp://host:port", "port 'port' is not a number"),
    ("tcp://host:0", "port 0 outside 1..65535"),
    ("tcp://host:70000", "port 70000 outside"),
    ("tcp://::1:7600", "IPv6 address goes in brackets"),
    ("tcp://host:1/x", "no path"),
    ("unix://relative.sock", "must be absolute"),
    ("unix:///" + "x" * 200, "107-byte sun_path"),
    # a name no lookup can take: refused here, not a UnicodeError at every connect attempt
    (f"tcp://{'w' * 64}.dspark.svc:7600", "is 64 bytes; a DNS label is 1 to 63"),
    ("tcp://worker..svc:7600", "host label '' is 0 bytes"),
    (f"tcp://{'a.' * 130}b:7600", "host name is 261 characters, over DNS's 253"),
    (f"dns+tcp://{'w' * 64}:7600", "is 64 bytes; a DNS label is 1 to 63"),
])
def test_bad_endpoint_names_itself(text: str, words: str) -> None:
    with pytest.raises(EndpointError) as info:
        check_endpoint(text) if text.startswith("dns+") else make_client(text)
    assert words in str(info.value)
    assert repr(text) in str(info.value) or repr(text.replace("dns+", "")) in str(info.value)
    assert isinstance(info.value, ValueError) and isinstance(info.value, TransportError)


def test_connect_refused_names_endpoint() -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    c = make_client(f"tcp://127.0.0.1:{port}")
    with pytest.raises(TransportError, match=f"127.0.0.1:{port}: connect failed"):
        c.connect(1.0)
    c.close()


# -- replies -------------------------------------------------------------------------------------
def test_round_trip_sets_nodelay_and_returns_length() -> None:
    with FakeWorker() as fw:
        c = make_client(fw.endpoint)
        c.connect(1.0)
        assert c._sock is not None
        assert c._sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
        buf = bytearray(64)
        n = c.request(ping_frame(7), buf, 1.0)
        h, _body = wire.split_frame(memoryview(buf)[:n])
        assert (h.op, h.seq, n) == (wire.OP_PING, 7, wire.APP_HEADER_SIZE)
        c.close()
        c.close()  # idempotent


def test_while_waiting_runs_once_after_the_frame_is_sent_and_before_the_reply() -> None:
    """The client's request-only work runs in the round trip: the whole frame is at the
    worker when it runs, and the reply, which the worker holds back until told, is not yet
    read."""
    frame_in = threading.Event()
    may_reply = threading.Event()
    frame = ping_frame(5)

    def handler(conn: socket.socket) -> None:
        h, _ = read_frame(conn)
        frame_in.set()
        may_reply.wait(5)
        conn.sendall(wire.frame(h.op, h.seq, 0, b""))

    calls: list[tuple[bool, bool]] = []

    def while_waiting() -> None:
        calls.append((frame_in.wait(5), bytes(buf[:len(frame)]) == bytes(len(frame))))
        may_reply.set()

    buf = bytearray(64)
    with serve(handler) as ep:
        c = make_client(ep)
        c.connect(1.0)
        assert c.runs_while_waiting
        n = c.request_parts((frame[:10], frame[10:]), buf, 5.0, while_waiting=while_waiting)
        c.close()
    assert calls == [(True, True)]  # once; the frame was in, nothing of the reply was read
    assert wire.split_frame(memoryview(buf)[:n])[0].seq == 5


def test_reply_arriving_a_byte_at_a_time() -> None:
    body = bytes(range(256)) * 3

    def handler(conn: socket.socket) -> None:
        h, _ = read_frame(conn)
        out = wire.frame(h.op, h.seq, h.session, body)
        for i in range(len(out)):
            conn.sendall(out[i:i + 1])
            if i % 97 == 0:
                time.sleep(0.001)

    with serve(handler) as ep, make_client(ep) as c:
        c.connect(1.0)
        buf = bytearray(4096)
        n = c.request(ping_frame(), buf, 5.0)
        assert bytes(buf[wire.APP_HEADER_SIZE:n]) == body


def test_reply_larger_than_buffer_grows_it() -> None:
    body = np.random.default_rng(1).integers(0, 256, 300_000, dtype=np.uint8).tobytes()

    def handler(conn: socket.socket) -> None:
        h, _ = read_frame(conn)
        conn.sendall(wire.frame(h.op, h.seq, h.session, body))
        h, _ = read_frame(conn)
        conn.sendall(wire.frame(h.op, h.seq, h.session, b"small"))

    with serve(handler) as ep, make_client(ep) as c:
        c.connect(1.0)
        buf = bytearray(16)  # smaller than even the header
        n = c.request(ping_frame(1), buf, 5.0)
        assert n == wire.APP_HEADER_SIZE + len(body) and len(buf) >= n
        assert bytes(buf[wire.APP_HEADER_SIZE:n]) == body
        size = len(buf)
        n = c.request(ping_frame(2), buf, 5.0)  # the grown buffer is reused as it is
        assert bytes(buf[wire.APP_HEADER_SIZE:n]) == b"small" and len(buf) == size


def test_buffer_that_cannot_grow_fails_and_closes() -> None:
    def handler(conn: socket.socket) -> None:
        h, _ = read_frame(conn)
        conn.sendall(wire.frame(h.op, h.seq, h.session, bytes(1000)))
        time.sleep(0.2)

    with serve(handler) as ep, make_client(ep) as c:
        c.connect(1.0)
        buf = bytearray(100)
        view = np.frombuffer(buf, np.uint8)  # a live export: the bytearray cannot resize
        with pytest.raises(TransportError, match="cannot grow while views of it are alive"):
            c.request(ping_frame(), buf, 1.0)
        assert not c.connected
        del view


def test_body_over_limit_is_refused() -> None:
    def handler(conn: socket.socket) -> None:
        h, _ = read_frame(conn)
        hdr = wire.AppHeader(op=h.op, seq=h.seq, session=h.session, body_len=1 << 30).pack()
        conn.sendall(hdr)
        time.sleep(0.2)

    with serve(handler) as ep, make_client(ep, max_reply_bytes=1 << 20) as c:
        c.connect(1.0)
        buf = bytearray(64)
        with pytest.raises(TransportError, match="body_len 1073741824 is over the limit"):
            c.request(ping_frame(), buf, 1.0)
        assert len(buf) == 64 and not c.connected


@pytest.mark.parametrize("answer, words", [
    (b"\x16\x03\x01" + bytes(40), "unreadable reply header"),
    (b"HTTP/1.1 400 Bad Request\r\n\r\n",
     r"answers HTTP, not dspark frames: is it a worker's metrics port \(--metrics-listen\)"),
])
def test_unreadable_header_closes(answer: bytes, words: str) -> None:
    def handler(conn: socket.socket) -> None:
        read_frame(conn)
        conn.sendall(answer)
        time.sleep(0.2)

    with serve(handler) as ep, make_client(ep) as c:
        c.connect(1.0)
        with pytest.raises(TransportError, match=words):
            c.request(ping_frame(), bytearray(64), 1.0)
        assert not c.connected


def test_peer_closing_mid_reply() -> None:
    def handler(conn: socket.socket) -> None:
        h, _ = read_frame(conn)
        conn.sendall(wire.frame(h.op, h.seq, h.session, bytes(500))[:100])

    with serve(handler) as ep, make_client(ep) as c:
        c.connect(1.0)
        with pytest.raises(TransportError, match="closed by the worker after 76 of 500 bytes"):
            c.request(ping_frame(), bytearray(64), 1.0)


# -- deadlines -----------------------------------------------------------------------------------
def test_timeout_closes_and_is_never_reused() -> None:
    seen_eof = threading.Event()

    def handler(conn: socket.socket) -> None:
        read_frame(conn)  # and never answer
        conn.settimeout(5.0)
        if conn.recv(1) == b"":
            seen_eof.set()

    with serve(handler) as ep:
        c = make_client(ep)
        c.connect(1.0)
        t0 = time.monotonic()
        with pytest.raises(TransportTimeout):
            c.request(ping_frame(), bytearray(64), 0.1)
        assert 0.09 <= time.monotonic() - t0 < 0.5
        assert not c.connected
        assert seen_eof.wait(2.0), "the worker never saw the timed-out connection close"
        with pytest.raises(TransportError, match="never reused"):
            c.request(ping_frame(), bytearray(64), 0.1)
        with pytest.raises(TransportError, match="closed"):
            c.connect(1.0)


def test_deadline_covers_the_whole_request() -> None:
    """Each byte comes within any per-call timeout, but the reply as a whole is too late."""

    def handler(conn: socket.socket) -> None:
        h, _ = read_frame(conn)
        out = wire.frame(h.op, h.seq, h.session, bytes(64))
        for i in range(len(out)):
            conn.sendall(out[i:i + 1])
            time.sleep(0.01)

    with serve(handler) as ep, make_client(ep) as c:
        c.connect(1.0)
        t0 = time.monotonic()
        with pytest.raises(TransportTimeout):
            c.request(ping_frame(), bytearray(128), 0.2)
        assert time.monotonic() - t0 < 0.4


# -- scatter-gather --------------------------------------------------------------------------------
def late_reader(got: bytearray, total: int, seq: int) -> Any:
    """A handler that waits (the sender fills the socket buffers meanwhile), reads ``total``
    bytes into ``got`` and answers a PING of ``seq``."""

    def handler(conn: socket.socket) -> None:
        time.sleep(0.05)
        while len(got) < total:
            chunk = conn.recv(min(1 << 16, total - len(got)))
            if not chunk:
                return
            got.extend(chunk)
        conn.sendall(wire.frame(wire.OP_PING, seq, 0, b""))

    return handler


def test_parts_arrive_byte_identical_with_partial_sends() -> None:
    """[headers, rows] of 16 MiB against a late reader: sendmsg sends part, the rest follows."""
    rows = np.random.default_rng(2).integers(0, 256, (4096, 4096), dtype=np.uint8)
    head = bytearray(wire.APP_HEADER_SIZE + 80)
    head[wire.APP_HEADER_SIZE:] = bytes(range(80))
    body_len = 80 + rows.nbytes
    wire.AppHeader(op=wire.OP_PING, seq=3, session=0, body_len=body_len).pack_into(head)
    got = bytearray()

    with serve(late_reader(got, wire.APP_HEADER_SIZE + body_len, 3)) as ep, make_client(ep) as c:
        c.connect(1.0)
        spy = SpySocket(c._sock)
        c._sock = spy  # type: ignore[assignment]
        n = c.request_parts([memoryview(head), rows], bytearray(64), 10.0)
    assert n == wire.APP_HEADER_SIZE
    assert bytes(got) == bytes(head) + rows.tobytes()
    assert len(spy.calls) > 1, "expected partial sends of 16 MiB"
    # Every byte of the rows went out from the rows' own memory: never copied.
    first = spy.calls[0]
    assert np.shares_memory(np.frombuffer(first[-1], np.uint8), rows)


def test_many_array_parts_arrive_byte_identical_with_partial_sends() -> None:
    """A round's rows as one array per request: 1,500 two-dimensional parts (more than one
    sendmsg takes, 1,024) against a late reader arrive in order, each sent from its own
    memory, the partial sends resuming inside a part."""
    rng = np.random.default_rng(3)
    rows = [rng.integers(0, 256, (int(rng.integers(1, 5)), 64), dtype=np.uint8)
            for _ in range(1500)]
    body = b"".join(r.tobytes() for r in rows)
    head = bytearray(wire.APP_HEADER_SIZE)
    wire.AppHeader(op=wire.OP_PING, seq=4, session=0, body_len=len(body)).pack_into(head)
    got = bytearray()

    with serve(late_reader(got, wire.APP_HEADER_SIZE + len(body), 4)) as ep, make_client(ep) as c:
        c.connect(1.0)
        assert c._sock is not None
        # A small send buffer: each sendmsg takes a few tens of KiB, so most stop inside a part.
        c._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 15)
        spy = SpySocket(c._sock)
        c._sock = spy  # type: ignore[assignment]
        assert c.request_parts([memoryview(head), *rows], bytearray(64), 10.0) == \
            wire.APP_HEADER_SIZE
    assert bytes(got) == bytes(head) + body
    assert len(spy.calls) > 2 and max(len(call) for call in spy.calls) <= 1024
    assert any(part is rows[5] for part in spy.calls[0])  # the array itself, no view or copy
    # Some sendmsg resumed inside a part: it starts with a byte view of that array's rest.
    assert any(isinstance(call[0], memoryview) for call in spy.calls[1:])


def test_non_contiguous_part_is_refused_before_sending() -> None:
    with FakeWorker() as fw, make_client(fw.endpoint) as c:
        c.connect(1.0)
        rows = np.zeros((4, 8), np.uint8)[:, ::2]
        with pytest.raises(ValueError, match="not C-contiguous"):
            c.request_parts([ping_frame(), rows], bytearray(64), 1.0)
        assert c.connected  # nothing was sent: the connection is still good
        n = c.request(ping_frame(2), bytearray(64), 1.0)
        assert n == wire.APP_HEADER_SIZE


class SpySocket:
    """Wraps a socket and records the buffers handed to sendmsg."""

    def __init__(self, sock: Any) -> None:
        self._sock = sock
        self.calls: list[list[memoryview]] = []

    def sendmsg(self, buffers: list[memoryview]) -> int:
        self.calls.append(list(buffers))
        return int(self._sock.sendmsg(buffers))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


# -- unix sockets ----------------------------------------------------------------------------
def test_unix_socket(tmp_path: Any) -> None:
    with FakeWorker(unix=True) as fw:
        assert fw.endpoint.startswith("unix:///")
        with make_client(fw.endpoint) as c:
            c.connect(1.0)
            buf = bytearray(8)
            n = c.request_parts([ping_frame(5)[:10], ping_frame(5)[10:]], buf, 1.0)
            assert wire.AppHeader.unpack(buf[:n]).seq == 5

    def handler(conn: socket.socket) -> None:
        h, body = read_frame(conn)
        conn.sendall(wire.frame(h.op, h.seq, h.session, body[::-1]))

    with serve(handler, unix_dir=str(tmp_path)) as ep, make_client(ep) as c:
        c.connect(1.0)
        buf = bytearray(8)
        n = c.request(wire.frame(wire.OP_STATS, 1, 0, b"abc"), buf, 1.0)
        assert bytes(buf[wire.APP_HEADER_SIZE:n]) == b"cba"


def test_unix_socket_missing_path(tmp_path: Any) -> None:
    c = make_client(f"unix://{tmp_path}/nothing.sock")
    with pytest.raises(TransportError, match="connect failed"):
        c.connect(1.0)


# -- fork ----------------------------------------------------------------------------------------
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_transport_used_after_fork_opens_its_own_connection() -> None:
    with FakeWorker() as fw:
        c = make_client(fw.endpoint)
        c.connect(1.0)
        assert c.request(ping_frame(1), bytearray(64), 1.0) == wire.APP_HEADER_SIZE
        assert fw.connections == 1
        parent_fd_conn = c._sock
        r, w = os.pipe()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # 3.12+: fork with threads
            pid = os.fork()
        if pid == 0:  # child: never return into pytest
            code = 1
            try:
                os.close(r)
                n = c.request(ping_frame(2), bytearray(64), 2.0)
                ok = n == wire.APP_HEADER_SIZE and c.reconnects_after_fork == 1
                os.write(w, struct.pack("<?i", ok, c.fileno()))
                c.close()
                code = 0
            finally:
                os._exit(code)
        os.close(w)
        data = b""
        while len(data) < 5:
            chunk = os.read(r, 5)
            if not chunk:
                break
            data += chunk
        os.close(r)
        _, status = os.waitpid(pid, 0)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
        ok, _child_fd = struct.unpack("<?i", data)
        assert ok, "the child's request failed or did not reconnect"
        assert fw.connections == 2  # the child's own connection
        # The parent's connection was not shut down by the child and still works.
        assert c._sock is parent_fd_conn and c.reconnects_after_fork == 0
        assert c.request(ping_frame(3), bytearray(64), 1.0) == wire.APP_HEADER_SIZE
        c.close()


def test_socket_client_repr_and_state() -> None:
    c = SocketClient("tcp://127.0.0.1:9")
    assert "new" in repr(c) and not c.connected and c.fileno() == -1
    c.close()
    assert "closed" in repr(c)
