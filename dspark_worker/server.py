"""Sockets: the only module that touches asyncio transports (docs/contract.md sections 2, 3, 11,
12).

* ``Connection`` is an ``asyncio.BufferedProtocol`` over TCP or a Unix socket. The transport
  receives straight into ``protocol.framing.FrameDecoder``'s memory: headers into a scratch
  buffer, each body into storage from the ``BufferPool`` (pinned on CUDA), so a rows region is
  never re-assembled from chunks. Frames of one connection are answered one at a time, in order
  (the contract allows one request in flight); a few more are buffered, then reading pauses,
  and at most ``FRAMES_PER_TURN`` are answered per turn of the event loop.
  Replies are written from one buffer per connection, reused while the transport holds no part
  of it. A wrong magic closes the connection; a body over its limit is answered ST_BAD_FRAME
  and closes it; a frame that stays incomplete past the partial-frame deadline closes it.
  Everything else is answered by dispatch and the stream stays aligned.
* Memory follows trust (section 11): a connection that holds no session may send only small
  bodies (``SESSIONLESS_MAX_BODY_BYTES``: HELLO, PING, STATS, GOODBYE), and a body's storage is
  taken whole from its header only for a STEP of the session this connection HELLOed; anything
  else grows with the bytes that arrive. On a connection whose session is gone, a larger STEP,
  RESET, GOODBYE or SHM_ATTACH is read and dropped unbuffered and answered ST_NO_SESSION: the
  engine HELLOs again instead of being cut off.
* ``WorkerServer`` accepts on TCP (``TCP_NODELAY``) and Unix listeners (sockets bound before the
  drafter loads, see ``bind_tcp``), enforces the connection limit, closes connections that hold
  no session and stay silent (``handshake_timeout_s``, ``connection_idle_s``), pushes those out
  first when a peer holds too many of them or the limit is reached, and drains on shutdown.
* ``MetricsServer`` is a small HTTP/1.0 server for ``/metrics`` (Prometheus text format),
  ``/healthz`` (readiness: 200 once the drafter is loaded and warm, 503 before and while
  draining) and ``/livez`` (liveness: 200 while the process serves, 503 once its runner died).
  It runs on an event loop and thread of its own, so probes are answered in milliseconds
  however busy the draft port is, and a flood of the metrics port costs the engines nothing
  but CPU. It holds at most ``MAX_HTTP_CONNECTIONS`` connections (a new one pushes out the
  oldest that has not finished its request) and gives each request ``HTTP_TIMEOUT_S``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import itertools
import logging
import os
import socket
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from protocol.constants import (
    MAGIC,
    OP_GOODBYE,
    OP_HELLO,
    OP_RESET,
    OP_SHM_ATTACH,
    OP_STATS,
    OP_STEP,
)
from protocol.errors import FrameHeaderError, FrameTooLargeError
from protocol.framing import Frame, FrameDecoder
from protocol.header import AppHeader

from .admission import HELLO, OTHER, Gate, peer_host
from .buffers import BufferPool
from .config import (
    DEFAULT_CONNECTION_IDLE_S,
    DEFAULT_HANDSHAKE_TIMEOUT_S,
    MAX_PENDING_FRAMES_PER_CONNECTION,
    MAX_SESSIONLESS_PER_PEER,
    SESSIONLESS_MAX_BODY_BYTES,
)
from .dispatch import Buffer, Dispatcher, RateLimitedLog
from .metrics import Metrics
from .shm import ConnShm, FdReceiver, close_fds

log = logging.getLogger(__name__)

# Receives after a decoder error land here and are dropped while the connection closes.
_DISCARD = bytearray(64 << 10)
# Smallest reply buffer a connection keeps (a few entries' reply; grows to the largest seen).
MIN_REPLY_BUFFER = 4 << 10
# While a large body arrives, the event loop is woken only once this much more of it is in the
# kernel (SO_RCVLOWAT; never more than what is left, so the last byte always wakes it): each
# wake-up is a trip through the loop, and a 4 MiB STEP otherwise takes dozens of them.
RCVLOWAT_MIN_REMAINING = 64 << 10
RCVLOWAT_CAP = 1 << 20
# Ops that act on the header's session: on a connection whose session is gone, one of them
# with a body over the sessionless limit is answered ST_NO_SESSION unbuffered (section 3).
SESSION_OPS = frozenset({OP_STEP, OP_RESET, OP_GOODBYE, OP_SHM_ATTACH})
# Frames of one connection answered in one turn of the event loop; the rest wait for the next
# turn (and reading pauses meanwhile): a peer pipelining thousands of cheap frames in one
# receive cannot hold the loop while other connections and new ones wait.
FRAMES_PER_TURN = 4
# A connection without a session that leaves this much of its replies unread (they wait in
# the worker, the kernel's buffers being full) is closed: a peer that sends and never reads
# would otherwise hold answers nobody takes.
SESSIONLESS_UNREAD_BYTES = 64 << 10


class Connection(asyncio.BufferedProtocol):
    """One client connection."""

    _ids = itertools.count(1)

    def __init__(self, server: WorkerServer, kind: str) -> None:
        self.server = server
        self.dispatcher = server.dispatcher
        self.kind = kind
        self.conn_id = next(self._ids)
        self.peer = "?"
        self.peer_host = "?"  # the peer without its port: what refusal logs are counted by
        self.session_id = 0  # the session of the latest HELLO accepted here (dispatch sets it)
        self.auth_failures = 0  # HELLOs refused ST_AUTH here (dispatch counts them)
        self.last_frame = time.monotonic()  # connect, then each complete frame
        self.transport: asyncio.Transport | None = None
        self.decoder = FrameDecoder(max_body=server.max_frame_bytes, alloc=server.buffers.alloc,
                                    limit=self._body_limit, preallocate=self._trusted,
                                    discard=self._discard)
        self.pending: deque[tuple[Frame, float]] = deque()
        self.busy = False  # a STEP of this connection is with the runner
        self.closing = False
        self.closed = False
        self.close_reason = "peer"
        self.read_paused = False
        self.write_paused = False
        self._pump_soon = False  # a _pump is scheduled for the next loop turn
        self._admitted = False  # the gate took a token for the next frame (no session here)
        self.answered = 0  # frames the gate let through while without a session
        self._reply_buf: bytearray | None = None
        self._partial_since: float | None = None
        self._partial_timer: asyncio.TimerHandle | None = None
        self._sock: Any = None  # TCP only: for SO_RCVLOWAT
        self._rcvlowat = 1
        # Section 13: the shared-memory region, and the receive of a MAP frame with its memfd.
        self.shm = ConnShm()
        self._fd_rx: FdReceiver | None = None
        self._fds_next: list[int] | None = None  # descriptors for the next frame completed
        self._fd_timer: asyncio.TimerHandle | None = None

    # -- asyncio.BufferedProtocol -----------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        peer = transport.get_extra_info("peername")
        if isinstance(peer, tuple):
            self.peer = f"{peer[0]}:{peer[1]}"
            self.peer_host = self.server.peer_host_of(str(peer[0]))
        else:
            self.peer_host = f"unix:{self.server.unix_path or '?'}"
            self.peer = f"{self.peer_host}#{self.conn_id}"
        sock = transport.get_extra_info("socket")
        if self.kind == "tcp" and sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sock = sock
        if not self.server.register(self):
            self.closing = True
            self.close_reason = "refused"
            transport.close()

    def get_buffer(self, sizehint: int) -> memoryview:
        if self.closing or self.decoder.error is not None:
            return memoryview(_DISCARD)
        return self.decoder.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        if self.closing:
            return
        try:
            frames = self.decoder.buffer_updated(nbytes)
        except FrameHeaderError as exc:
            self._bad_magic(exc)
            return
        except FrameTooLargeError as exc:
            h = self.decoder.error_header
            if h is not None:
                self._write(self.dispatcher.refuse_too_large(self, h, exc).data)
            self._close("too_large")
            return
        self._received(frames)

    def _received(self, frames: list[Frame]) -> None:
        if frames and self._fds_next is not None:
            self.shm.fds[id(frames[0])], self._fds_next = self._fds_next, None
        if frames:
            now = time.perf_counter()
            self.last_frame = time.monotonic()
            self.pending.extend((f, now) for f in frames)
            self._pump()
        self._watch_partial(bool(frames))
        if self._sock is not None:
            self._set_rcvlowat(self.decoder.body_remaining)
        if (len(self.pending) >= MAX_PENDING_FRAMES_PER_CONNECTION and not self.read_paused
                and not self.closing and self.transport is not None):
            self.read_paused = True
            self.transport.pause_reading()

    def _set_rcvlowat(self, remaining: int) -> None:
        want = min(remaining, RCVLOWAT_CAP) if remaining >= RCVLOWAT_MIN_REMAINING else 1
        if want == self._rcvlowat:
            return
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, want)
            self._rcvlowat = want
        except OSError:
            self._sock = None  # not supported here: wake on every receive, as by default

    def eof_received(self) -> bool | None:
        return None  # close our side too; sessions outlive their connections (6.2)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = self.closing = True
        if self._partial_timer is not None:
            self._partial_timer.cancel()
            self._partial_timer = None
        self._stop_fd_receive()
        if self._fds_next is not None:
            close_fds([fd for fd in self._fds_next if fd >= 0])
            self._fds_next = None
        while self.pending:
            f, _ = self.pending.popleft()
            self.server.buffers.release(f.storage)
        self.shm.close()  # unmapped now, or as the in-flight STEP's rows view goes
        self.server.gate.forget(self.peer_host, self)
        self.server.unregister(self, self.close_reason if exc is None else "error")

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        self._pump()

    # -- what a body may cost (section 11) ---------------------------------------------------------
    @property
    def has_session(self) -> bool:
        """A session is held and bound to this connection (its latest HELLO came here)."""
        if not self.session_id:
            return False
        s = self.dispatcher.table.get(self.session_id)
        return s is not None and s.conn_id == self.conn_id

    def _bound(self, h: AppHeader) -> bool:
        """The header's session is held and bound to this connection."""
        s = self.dispatcher.table.get(h.session) if h.session else None
        return s is not None and s.conn_id == self.conn_id

    def _body_limit(self, h: AppHeader) -> tuple[int, str]:
        if self.has_session or self._bound(h):  # bodies but STEP grow with what arrives
            return self.server.max_frame_bytes, "(the frame limit)"
        return SESSIONLESS_MAX_BODY_BYTES, "for a connection without a session"

    def _discard(self, h: AppHeader) -> bool:
        """A frame of a session op, on a connection that held a session, for a session that
        is not bound here (any more): answered ST_NO_SESSION from its header (the client HELLOs
        again), its body read and dropped."""
        return (h.op in SESSION_OPS and h.body_len > SESSIONLESS_MAX_BODY_BYTES
                and bool(self.session_id) and not self._bound(h))

    def _trusted(self, h: AppHeader) -> bool:
        """Whether a body's storage may be taken whole from its header alone."""
        return h.op == OP_STEP and self._bound(h)

    def idle_close_reason(self, now: float) -> str | None:
        """Why this connection should be closed now for holding no session and staying silent
        (None: keep it). A health checker's PINGs keep its connection open."""
        if self.closing or self.busy or self.pending or self.has_session:
            return None
        silent = now - self.last_frame
        if not self.session_id:
            return "handshake_timeout" if silent >= self.server.handshake_timeout_s else None
        return "idle_timeout" if silent >= self.server.connection_idle_s else None

    # -- what dispatch calls ----------------------------------------------------------------------
    def reply_buffer(self, nbytes: int) -> bytearray:
        """A buffer for the next reply. The previous one is reused unless the transport may
        still hold a view of it (data not yet sent)."""
        buf = self._reply_buf
        held = self.transport is not None and self.transport.get_write_buffer_size() > 0
        if buf is None or len(buf) < nbytes or held:
            size = max(nbytes, MIN_REPLY_BUFFER)
            if buf is not None and not held:
                size = max(size, len(buf))
            buf = bytearray(1 << (size - 1).bit_length())
            self._reply_buf = buf
        return buf

    def complete(self, data: Buffer, close: bool = False) -> None:
        """The answer to this connection's STEP (loop thread, from the runner's batch)."""
        self.busy = False
        if self.closing:
            return
        self._write(data)
        if close:
            self._close("refused")
            return
        self._pump()

    def release_storage(self, storage: Any) -> None:
        self.server.buffers.release(storage)

    # -- inner work -------------------------------------------------------------------------------
    def _pump(self) -> None:
        self._pump_soon = False
        budget = FRAMES_PER_TURN
        while self.pending and not self.busy and not self.closing and not self.write_paused:
            if budget == 0:  # a pipelining peer waits its turn: the loop serves everyone else
                self._pump_soon = True
                asyncio.get_running_loop().call_soon(self._pump_later)
                break
            head = self.pending[0][0].header
            if (not self.has_session or head.op == OP_STATS) and not self._admit(head):
                break  # its peer's or the worker's rate for strangers: the gate calls back
            budget -= 1
            fr, t_arrival = self.pending.popleft()
            reply = self.dispatcher.handle(self, fr, t_arrival)
            if self.shm.fds:
                self.shm.drop_fds(fr)  # descriptors no handler took are closed
            if reply is None:  # a STEP: the runner has it and its body
                self.busy = True
                break
            self.server.buffers.release(fr.storage)
            self._write(reply.data)
            if reply.close:  # e.g. a version the worker does not speak (section 3)
                self._close(reply.close)
                return
        if (self.read_paused and not self.closing and self.transport is not None
                and len(self.pending) < MAX_PENDING_FRAMES_PER_CONNECTION
                and not self.server.draining and self._fd_rx is None):
            self.read_paused = False
            self.transport.resume_reading()

    def _admit(self, h: AppHeader) -> bool:
        """A frame of a connection without a session, or a STATS of any (a JSON body of a
        millisecond, never on an engine's round), through the gate (admission.py). False: it
        waits; ``admitted`` pumps again once its turn has come."""
        if self._admitted:
            self._admitted = False
            return True
        if self.transport is not None and not self.has_session and \
                self.transport.get_write_buffer_size() > SESSIONLESS_UNREAD_BYTES:
            self.server.bad_stream(self, "unread", f"{self.transport.get_write_buffer_size()}"
                                   " bytes of replies not read")
            self._close("unread")
            return False
        kind = HELLO if h.op == OP_HELLO else OTHER
        return self.server.gate.admit(self.peer_host, kind, self)

    def admitted(self) -> None:
        self._admitted = True
        if not self._pump_soon:
            self._pump_soon = True
            asyncio.get_running_loop().call_soon(self._pump_later)

    def _pump_later(self) -> None:
        if self._pump_soon:
            self._pump()

    def _write(self, data: Buffer) -> None:
        if self.transport is None or self.closing:
            return
        self.transport.write(data)
        self.server.metrics.sent(len(data))

    def _bad_magic(self, exc: FrameHeaderError) -> None:
        """A stream that does not start a frame: closed. One that starts an HTTP request (a
        scrape or probe given this port instead of the metrics port) is told so first."""
        self.server.bad_stream(self, "bad_magic", str(exc))
        if exc.value in _HTTP_STARTS:
            self._write(self.server.http_answer())
        self._close("bad_magic")

    def _close(self, reason: str) -> None:
        if self.closing:
            return
        self.closing = True
        self.close_reason = reason
        if self.transport is not None:
            self.transport.close()  # flushes what was written first

    def _watch_partial(self, completed: bool) -> None:
        """Arm the deadline for a frame that has started and not finished."""
        if not self.decoder.has_partial or self.closing:
            self._partial_since = None
            return
        if completed or self._partial_since is None:
            self._partial_since = time.monotonic()  # a new frame began in this receive
        if self._partial_timer is None:
            self._arm_partial(self.server.partial_timeout_s)

    def _arm_partial(self, delay: float) -> None:
        loop = asyncio.get_running_loop()
        self._partial_timer = loop.call_later(max(delay, 0.01), self._partial_check)

    def _partial_check(self) -> None:
        self._partial_timer = None
        since = self._partial_since
        if since is None or self.closing:
            return
        if self.read_paused:  # our own back-pressure is not the peer's fault
            self._arm_partial(self.server.partial_timeout_s)
            return
        left = self.server.partial_timeout_s - (time.monotonic() - since)
        if left > 0:
            self._arm_partial(left)
            return
        self.server.bad_stream(self, "partial_timeout",
                               f"{self.decoder.partial_bytes} bytes of a frame and no more for"
                               f" {self.server.partial_timeout_s:g} s")
        self._close("partial_timeout")

    # -- section 13: the MAP frame and its memfd --------------------------------------------------
    def expect_fds(self, nbytes: int) -> None:
        """Read the next ``nbytes`` of the stream with recvmsg (not through the transport, whose
        receives drop descriptors), then go on as before. Called by an accepted OFFER: the client
        sends nothing until its reply, so nothing of the MAP frame has been read yet."""
        if self.transport is None or self.closing or self._fd_rx is not None:
            return
        sock = self.transport.get_extra_info("socket")
        if sock is None:
            return
        if not self.read_paused:
            self.transport.pause_reading()
        self.read_paused = True
        self._fd_rx = FdReceiver(asyncio.get_running_loop(), sock.fileno(), nbytes,
                                 self._fd_frame)
        self._fd_timer = asyncio.get_running_loop().call_later(
            max(self.server.partial_timeout_s, 0.01), self._fd_timeout)

    def _fd_frame(self, data: bytes, fds: list[int], error: str | None) -> None:
        self._fd_rx = None
        if self._fd_timer is not None:
            self._fd_timer.cancel()
            self._fd_timer = None
        if error is not None or self.closing:
            close_fds([fd for fd in fds if fd >= 0])
            if not self.closing:
                self._close("peer" if "closed" in (error or "") else "error")
            return
        try:
            frames = self.decoder.feed(data)
        except (FrameHeaderError, FrameTooLargeError) as exc:
            close_fds([fd for fd in fds if fd >= 0])
            h = self.decoder.error_header
            if isinstance(exc, FrameTooLargeError):
                if h is not None:
                    self._write(self.dispatcher.refuse_too_large(self, h, exc).data)
                self._close("too_large")
            else:
                self._bad_magic(exc)
            return
        # They came with the frame's first bytes: they belong to the next frame completed (its
        # body, if any, arrives through the transport).
        self._fds_next = fds or None
        if self.transport is not None and len(self.pending) + len(frames) \
                < MAX_PENDING_FRAMES_PER_CONNECTION:
            self.read_paused = False
            self.transport.resume_reading()
        self._received(frames)

    def _fd_timeout(self) -> None:
        self._fd_timer = None
        if self._fd_rx is None or self.closing:
            return
        got = self._fd_rx.received
        self._stop_fd_receive()
        self.server.bad_stream(self, "partial_timeout",
                               f"{got} bytes of the SHM_ATTACH MAP frame and no more for"
                               f" {self.server.partial_timeout_s:g} s")
        self._close("partial_timeout")

    def _stop_fd_receive(self) -> None:
        if self._fd_timer is not None:
            self._fd_timer.cancel()
            self._fd_timer = None
        rx, self._fd_rx = self._fd_rx, None
        if rx is not None:
            rx.abandon()

    def stop_reading(self) -> None:
        if self.transport is not None and not self.closing and not self.read_paused:
            self.read_paused = True
            with contextlib.suppress(RuntimeError):
                self.transport.pause_reading()

    def abort(self) -> None:
        self._close("shutdown")


# A frame header's first word when the stream is an HTTP/1 request (or HTTP/2's preface).
_HTTP_STARTS = frozenset(int.from_bytes(m, "little") for m in (
    b"GET ", b"HEAD", b"POST", b"PUT ", b"DELE", b"OPTI", b"PATC", b"PRI "))


class WorkerServer:
    """The listeners and the set of open connections."""

    def __init__(self, dispatcher: Dispatcher, metrics: Metrics, buffers: BufferPool, *,
                 max_frame_bytes: int, max_connections: int, partial_timeout_s: float,
                 handshake_timeout_s: float = DEFAULT_HANDSHAKE_TIMEOUT_S,
                 connection_idle_s: float = DEFAULT_CONNECTION_IDLE_S,
                 metrics_address: tuple[str, int] | None = None,
                 peer_host_of: Callable[[str], str] = peer_host) -> None:
        self.dispatcher = dispatcher
        self.metrics_address = metrics_address
        self.metrics = metrics
        self.buffers = buffers
        self.max_frame_bytes = max_frame_bytes
        self.max_connections = max_connections
        self.partial_timeout_s = partial_timeout_s
        self.handshake_timeout_s = handshake_timeout_s
        self.connection_idle_s = connection_idle_s
        # A TCP peer's address -> the peer host its per-peer limits count under.
        self.peer_host_of = peer_host_of
        self.connections: dict[int, Connection] = {}
        self.draining = False
        self.unix_path: str | None = None
        self._unix_sock: socket.socket | None = None
        self.tcp_address: tuple[str, int] | None = None
        self._servers: list[asyncio.AbstractServer] = []
        self._log = RateLimitedLog(log)
        self._sweeper: asyncio.Task[None] | None = None
        self.gate = Gate(on_wait=lambda kind, limit: metrics.stranger_waits.labels(
            kind=kind, limit=limit).inc())
        dispatcher.connected = lambda conn_id: conn_id in self.connections
        dispatcher.session_left = self._session_left

    def _session_left(self, conn_id: int) -> None:
        """A session of this connection went: a region it attached is unmapped once the
        connection holds no session (its memory is no longer the worker's to hold)."""
        conn = self.connections.get(conn_id)
        if conn is not None and conn.shm.region is not None and not conn.has_session:
            log.info("connection %s: its session is gone; shared-memory region unmapped",
                     conn.peer)
            conn.shm.close()

    async def listen_tcp(self, host: str, port: int,
                         sock: socket.socket | None = None) -> tuple[str, int]:
        """Serve on TCP: on ``sock`` (from ``bind_tcp``, bound before the drafter loaded) or on a
        new socket for host and port."""
        loop = asyncio.get_running_loop()
        if sock is None:
            sock = bind_tcp(host, port)
        sock.listen(1024)
        srv = await loop.create_server(lambda: Connection(self, "tcp"), sock=sock,
                                       backlog=1024)
        self._servers.append(srv)
        addr = srv.sockets[0].getsockname()
        self.tcp_address = (addr[0], addr[1])
        return self.tcp_address

    async def listen_unix(self, path: str, sock: socket.socket | None = None) -> str:
        loop = asyncio.get_running_loop()
        if sock is None:
            sock = bind_unix(path)
        sock.listen(1024)
        srv = await loop.create_unix_server(lambda: Connection(self, "unix"), sock=sock,
                                            backlog=1024)
        self._servers.append(srv)
        self.unix_path = path
        self._unix_sock = sock
        return path

    # -- connections without a session --------------------------------------------------------
    def start_sweeping(self) -> None:
        """Close silent connections that hold no session; flush the refusal-log summaries."""
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep_loop(),
                                                                   name="dspark-sweep")

    async def _sweep_loop(self) -> None:
        interval = max(0.05, min(1.0, self.handshake_timeout_s / 4, self.connection_idle_s / 4))
        while True:
            await asyncio.sleep(interval)
            self.sweep(time.monotonic())

    def sweep(self, now: float) -> int:
        closed = 0
        for conn in list(self.connections.values()):
            reason = conn.idle_close_reason(now)
            if reason is None:
                continue
            limit = (self.handshake_timeout_s if reason == "handshake_timeout"
                     else self.connection_idle_s)
            self._log.info((conn.peer_host, reason), f"{reason} closes from {conn.peer_host}",
                           "closing connection from %s: %s (no session and no frame for"
                           " %g s)", conn.peer, reason, limit)
            conn._close(reason)
            closed += 1
        self._log.flush(now)
        self.dispatcher.flush_logs(now)
        return closed

    async def stop_sweeping(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
            self._sweeper = None

    def _make_room(self, conn: Connection) -> None:
        """Connections without a session go first (section 11): a new connection from a peer
        that holds ``MAX_SESSIONLESS_PER_PEER`` of them closes one of those, and at the
        connection limit a new one closes one of all; so PINGs that keep idle connections open
        cannot keep an engine out. The one closed has the most frames waiting unanswered (a
        peer pipelining past its rate), the oldest among equals: a health checker's single
        PING outlives a flood's bursts. Connections that hold a session, or have a STEP with
        the runner, are never pushed out."""
        idle = [c for c in self.connections.values()
                if not c.closing and not c.busy and not c.has_session]
        mine = [c for c in idle if c.peer_host == conn.peer_host]
        victim: Connection | None = None

        def greediest(c: Connection) -> tuple[int, int]:
            return -len(c.pending), c.conn_id

        if len(mine) >= MAX_SESSIONLESS_PER_PEER:
            victim = min(mine, key=greediest)
            why = (f"{len(mine)} connections without a session from {conn.peer_host}, the limit"
                   f" per peer is {MAX_SESSIONLESS_PER_PEER}")
        elif len(self.connections) >= self.max_connections and idle:
            victim = min(idle, key=greediest)
            why = (f"{len(self.connections)} connections open, the limit is"
                   f" {self.max_connections}")
        if victim is None:
            return
        self._log.warning(("pushed_out", victim.peer_host),
                          f"connections without a session pushed out from {victim.peer_host}",
                          "closing connection from %s (no session) for a new one from %s: %s",
                          victim.peer, conn.peer, why)
        victim._close("pushed_out")
        self.unregister(victim, "pushed_out")  # its slot is free now, before the close lands

    def register(self, conn: Connection) -> bool:
        if not self.draining:
            self._make_room(conn)
        if self.draining or len(self.connections) >= self.max_connections:
            self.metrics.connections_refused.inc()
            self._log.warning(("refused", conn.peer_host),
                              f"connections refused from {conn.peer_host}",
                              "connection from %s refused: %s", conn.peer,
                              "draining" if self.draining else
                              f"{len(self.connections)} connections open, the limit is"
                              f" {self.max_connections}")
            return False
        self.connections[conn.conn_id] = conn
        self.dispatcher.counters_version += 1
        self.metrics.connections_total.inc()
        self.metrics.connections.set(len(self.connections))
        log.debug("connection %d from %s (%s)", conn.conn_id, conn.peer, conn.kind)
        return True

    def unregister(self, conn: Connection, reason: str) -> None:
        if self.connections.pop(conn.conn_id, None) is None:
            return
        self.dispatcher.counters_version += 1
        self.metrics.connections.set(len(self.connections))
        self.metrics.connections_closed.labels(reason=reason).inc()
        log.debug("connection %d from %s closed: %s", conn.conn_id, conn.peer, reason)

    def http_answer(self) -> bytes:
        """What an HTTP request on the draft port gets before the connection closes."""
        where = (f"on port {self.metrics_address[1]} (--metrics-listen)"
                 if self.metrics_address else "nowhere: this worker runs with"
                 " --metrics-listen none")
        text = (f"this is a dspark worker's draft port: it speaks dspark frames, not HTTP;"
                f" its /metrics and /healthz are served {where}\n").encode()
        return http_400(text)

    def bad_stream(self, conn: Connection, reason: str, detail: str) -> None:
        self._log.warning((conn.peer_host, reason), f"{reason} closes from {conn.peer_host}",
                          "closing connection from %s: %s (%s)", conn.peer, reason, detail)

    async def stop_accepting(self) -> None:
        self.draining = True
        await self.stop_sweeping()
        for srv in self._servers:
            srv.close()
        for conn in list(self.connections.values()):
            conn.stop_reading()
        for srv in self._servers:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(srv.wait_closed(), 0.5)
        self._servers.clear()
        if self.unix_path:
            unlink_own_socket(self.unix_path, self._unix_sock)
            self._unix_sock = None

    def busy_connections(self) -> int:
        return sum(1 for c in self.connections.values() if c.busy)

    async def close_all(self, grace_s: float = 1.0) -> None:
        for conn in list(self.connections.values()):
            conn.abort()
        deadline = time.monotonic() + grace_s
        while self.connections and time.monotonic() < deadline:
            await asyncio.sleep(0.01)


def _is_socket(path: str) -> bool:
    import stat

    try:
        return stat.S_ISSOCK(os.stat(path).st_mode)
    except OSError:
        return False


def bind_tcp(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port and not yet listening: bound before the drafter loads, so
    a busy port or a bad host is found at once, and engines are refused (not left waiting)
    until the worker listens. Raises OSError (socket.gaierror for a host that does not
    resolve)."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                               flags=socket.AI_PASSIVE)
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(addr)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def bind_unix(path: str) -> socket.socket:
    """A Unix socket bound to ``path``. A socket file left by a run that is gone (nothing
    accepts on it) is replaced; one that a live process serves is not touched: OSError
    EADDRINUSE. The socket remembers which file it made, for ``unlink_own_socket``."""
    if _is_socket(path):
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.settimeout(1.0)
        try:
            probe.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # stale: no one listens
        except OSError:
            pass  # cannot tell (a full backlog, permissions): bind decides
        else:
            raise OSError(errno.EADDRINUSE, f"another process is serving on {path} (a second"
                                            " worker on the same --unix path?)")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
        sock.setblocking(False)
        st = os.stat(path)
        _UNIX_OWNED[sock] = (st.st_dev, st.st_ino)
    except BaseException:
        sock.close()
        raise
    return sock


# listening socket -> (st_dev, st_ino) of the socket file its bind made (kept after it closes)
_UNIX_OWNED: weakref.WeakKeyDictionary[socket.socket, tuple[int, int]] = \
    weakref.WeakKeyDictionary()


def unlink_own_socket(path: str, sock: socket.socket | None) -> None:
    """Remove ``path`` only if it is still the socket file ``sock``'s bind made (another
    worker may have taken the path since, after all)."""
    if sock is None or not path:
        return
    owned = _UNIX_OWNED.pop(sock, None)
    try:
        st = os.stat(path)
    except OSError:
        return
    if owned == (st.st_dev, st.st_ino):
        with contextlib.suppress(OSError):
            os.unlink(path)


# -- /metrics and /healthz --------------------------------------------------------------------
# A scrape request is a request line and a few headers: anything longer is not Prometheus.
MAX_HTTP_REQUEST_BYTES = 16 << 10
# A scrape sends its request at once and reads a reply of a few hundred KiB on a local network:
# a connection that takes longer is stalled or hostile, and must not hold a slot for long.
HTTP_TIMEOUT_S = 2.0
# Open HTTP connections: Prometheus, a probe or two and a human need a handful. At the limit a
# new connection pushes out the oldest one that has not sent its whole request, so idle
# connections cannot keep a scrape out.
MAX_HTTP_CONNECTIONS = 32
# Connections the kernel queues before they are accepted. Short, as a queue in front of a busy
# server should be: under a flood of thousands of connections a second a probe waits behind
# at most this many (milliseconds) instead of seconds of them (1,024 queued: p90 1.9 s, 128:
# 7 ms, bench/README.md "The metrics port under a flood").
HTTP_BACKLOG = 128
# A connection that opens with a frame header's magic is an engine or a tool given this port
# instead of --listen: it is told so at once, not after the timeout.
_FRAME_START = MAGIC.to_bytes(4, "little")
_NOT_HERE = (b"this is a dspark worker's metrics port (--metrics-listen): dspark frames go"
             b" to its --listen address\n")


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency of the worker
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def http_400(text: bytes) -> bytes:
    """A whole HTTP/1.1 ``400`` response whose body is ``text``, closing the connection."""
    return (b"HTTP/1.1 400 Bad Request\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n"
            b"Connection: close\r\n\r\n%s" % (len(text), text))


class MetricsServer:
    """``GET /metrics`` and ``GET /healthz`` over HTTP/1.0-style one-shot connections, served
    from a thread of its own (``health`` and ``liveness`` are called there: they read
    attributes; the registry's collectors read the loop's counters under the GIL). A
    connection is a plain protocol (no stream, no task): one costs tens of microseconds, so a
    flood of them does not hold the accept queue."""

    def __init__(self, registry: CollectorRegistry, health: Callable[[], tuple[bool, str]],
                 liveness: Callable[[], tuple[bool, str]] | None = None, *,
                 max_connections: int = MAX_HTTP_CONNECTIONS,
                 timeout_s: float = HTTP_TIMEOUT_S) -> None:
        self.registry = registry
        self.health = health
        self.liveness = liveness or (lambda: (True, "alive"))
        self.max_connections = max_connections
        self.timeout_s = timeout_s
        self._server: asyncio.AbstractServer | None = None
        self.address: tuple[str, int] | None = None
        # connection -> whether its request is still being read; in order of arrival
        self._open: dict[_HttpConnection, bool] = {}
        self.pushed_out = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._done: asyncio.Event | None = None

    async def start(self, host: str, port: int) -> tuple[str, int]:
        """Bind (OSError at once for a busy port or a bad host), then serve on the thread."""
        sock = bind_tcp(host, port)
        sock.listen(HTTP_BACKLOG)
        started: concurrent.futures.Future[tuple[str, int]] = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._serve, args=(sock, started),
                                        name="dspark-metrics", daemon=True)
        self._thread.start()
        self.address = await asyncio.wrap_future(started)
        return self.address

    def _serve(self, sock: socket.socket, started: concurrent.futures.Future[Any]) -> None:
        loop = _new_loop()
        self._loop = loop

        async def main() -> None:
            self._done = asyncio.Event()
            try:
                self._server = await loop.create_server(lambda: _HttpConnection(self),
                                                        sock=sock, backlog=HTTP_BACKLOG)
            except BaseException as exc:
                started.set_exception(exc)
                raise
            addr = self._server.sockets[0].getsockname()
            started.set_result((addr[0], addr[1]))
            sweeper = loop.create_task(self._sweep_loop())
            await self._done.wait()
            sweeper.cancel()
            self._server.close()
            for conn in list(self._open):
                conn.abort()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)

        try:
            loop.run_until_complete(main())
        except Exception:
            if started.done() and started.exception() is None:  # not a failed start: a bug
                log.exception("the metrics server stopped")
        finally:
            loop.close()

    async def stop(self) -> None:
        loop, done, thread = self._loop, self._done, self._thread
        if loop is not None and done is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # its loop closed meanwhile
                loop.call_soon_threadsafe(done.set)
        if thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, thread.join, 2.0)
        self._server = self._loop = self._thread = None

    async def _sweep_loop(self) -> None:
        """Requests unfinished after ``timeout_s`` get a 408; answers not taken by then go."""
        while True:
            await asyncio.sleep(min(0.25, self.timeout_s / 4))
            deadline = time.monotonic() - self.timeout_s
            for conn, reading in list(self._open.items()):
                if conn.since <= deadline:
                    if reading:
                        self.answered(conn)
                        conn.answer(b"HTTP/1.1 408 Request Timeout\r\nContent-Length: 0\r\n"
                                    b"Connection: close\r\n\r\n")
                    else:
                        conn.abort()  # its answer was not read in time

    def admit(self, conn: _HttpConnection) -> None:
        if len(self._open) >= self.max_connections:
            oldest = next((c for c, reading in self._open.items() if reading), None)
            if oldest is not None:
                self._open.pop(oldest)
                self.pushed_out += 1
                oldest.abort()
        self._open[conn] = True

    def answered(self, conn: _HttpConnection) -> None:
        if conn in self._open:
            self._open[conn] = False
            conn.since = time.monotonic()  # the answer's own time to be read

    def closed(self, conn: _HttpConnection) -> None:
        self._open.pop(conn, None)

    def response(self, line: str | None) -> bytes:
        """The whole answer to a request line (None: the stream began with a dspark frame)."""
        if line is None:
            return http_400(_NOT_HERE)
        parts = line.split()
        method, target = (parts[0], parts[1]) if len(parts) >= 2 else ("", "")
        path = target.split("?", 1)[0]
        if method not in ("GET", "HEAD"):
            status, ctype, body = "405 Method Not Allowed", "text/plain", b"GET only\n"
        elif path == "/metrics":
            status, ctype = "200 OK", CONTENT_TYPE_LATEST
            body = generate_latest(self.registry)
        elif path in ("/healthz", "/health", "/ready", "/readyz", "/livez"):
            ok, text = self.liveness() if path == "/livez" else self.health()
            status = "200 OK" if ok else "503 Service Unavailable"
            ctype, body = "text/plain; charset=utf-8", (text + "\n").encode()
        else:
            status, ctype, body = "404 Not Found", "text/plain", b"try /metrics or /healthz\n"
        head = (f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
        return head if method == "HEAD" else head + body


class _HttpConnection(asyncio.Protocol):
    """One HTTP connection of the metrics port: its request head is read as it comes (a
    request line, headers, an empty line: CRLF or a bare LF, as curl -0 and netcat send; or
    the end of the stream from a client that half-closed), then it is answered and closed."""

    def __init__(self, server: MetricsServer) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.since = time.monotonic()
        self.head = bytearray()
        self.start = 0  # where the first line not yet looked at begins
        self.first: bytes | None = None  # the request line (blank lines before it skipped)
        self.done = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.server.admit(self)

    def data_received(self, data: bytes) -> None:
        if self.done:
            return
        at = len(self.head)
        self.head += data
        if self.head.startswith(_FRAME_START):
            self._request(None)
            return
        if len(self.head) > MAX_HTTP_REQUEST_BYTES:  # not a scrape: closed without a word
            self.abort()
            return
        # Only the new bytes are searched for line ends: a peer sending a byte at a time
        # costs one look at each byte, not one at the whole head per byte.
        while (end := self.head.find(b"\n", max(self.start, at))) >= 0:
            line = bytes(self.head[self.start:end]).rstrip(b"\r")
            self.start = at = end + 1
            if self.first is None:
                self.first = line or None
            elif not line:
                self._request(self.first.decode("latin-1"))
                return

    def eof_received(self) -> bool:
        if self.done:
            return True
        first = self.first or bytes(self.head[self.start:]).rstrip(b"\r") or None
        if first is None:  # closed before a request
            self.abort()
            return False
        self._request(first.decode("latin-1"))
        return True  # our side stays open until the answer is written

    def _request(self, line: str | None) -> None:
        self.done = True
        self.server.answered(self)
        try:
            self.answer(self.server.response(line))
        except Exception:  # a collector or a health callback failed: the scrape fails alone
            log.exception("metrics request %r failed", line)
            self.abort()

    def answer(self, data: bytes) -> None:
        self.done = True
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)
            self.transport.close()  # after what was written is sent

    def abort(self) -> None:
        self.done = True
        if self.transport is not None:
            self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.closed(self)
