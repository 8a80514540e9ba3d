"""Blocking socket transports of the client (docs/contract.md section 2).

One connection, one request in flight, replies in order. What this module owns:

* endpoints: ``tcp://host:port`` (``tcp://[::1]:7600`` for IPv6), ``unix:///path``, and
  ``unix+shm:///path``: a Unix socket whose STEP rows go through a shared-memory region
  (section 13; ``dspark_client.shm``; the connection itself is the Unix one);
* ``connect(timeout)``: TCP_NODELAY on TCP, the connecting process's PID remembered;
* ``request(msg, buf, timeout)`` / ``request_parts(parts, buf, timeout)``: send the parts with
  ``socket.sendmsg`` (scatter-gather: a STEP goes out as [headers, rows] and the rows are never
  copied), then receive one reply frame into the caller's ``bytearray`` with ``recv_into``: the
  24-byte header first, then ``body_len`` bytes. A reply larger than the buffer grows the
  buffer in place; a reply body over ``max_reply_bytes`` is an error. Returns the frame's length.

Failure rules (section 7.5): one deadline covers the whole request (send and receive). A request
that times out or fails closes the connection, and a closed transport refuses further requests:
after a timeout the stream may still carry the late reply, so it can never be trusted again. The
caller makes a new transport (``make_client``) and says HELLO on it.

Fork safety: a socket inherited across ``os.fork()`` is shared with the parent, and two
processes reading one stream corrupt each other's replies. A transport remembers the PID that
connected it (``process_id``: a fork made by Python code, os.fork or multiprocessing, moves it
on in the child); used from another PID it drops the inherited descriptor (``close`` only, never
``shutdown``, which would end the parent's connection too) and opens its own connection to the
same endpoint, inside the request's deadline. The worker binds sessions to connections (6.2),
so a session HELLOed by the parent answers ``ST_NO_SESSION`` on the child's connection: the
child says HELLO under its own session before it sends STEPs.

Header parsing goes through ``protocol`` (``AppHeader.unpack``); nothing here knows message
bodies.
"""

from __future__ import annotations

import array
import contextlib
import ipaddress
import os
import socket
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, Final, Protocol

import numpy as np

from protocol.constants import APP_HEADER_SIZE
from protocol.errors import WireError
from protocol.header import AppHeader

__all__ = [
    "DEFAULT_MAX_REPLY_BYTES",
    "DEFAULT_PORT",
    "Endpoint",
    "EndpointError",
    "RpcClient",
    "SocketClient",
    "TransportError",
    "TransportTimeout",
    "make_client",
    "parse_endpoint",
    "process_id",
]

DEFAULT_PORT: Final = 7600
# A reply body above this is refused: the largest real reply (sampled, 4096 entries, N = 16) is
# about 33 MiB; STATS JSON is far smaller. A corrupt body_len must not make us allocate GiBs.
DEFAULT_MAX_REPLY_BYTES: Final = 64 << 20
# sendmsg takes at most IOV_MAX buffers per call (1024 on Linux and macOS).
_IOV_MAX: Final = 1024

# This process's id, made current in a child by os.fork() (register_at_fork): a client and its
# transport compare it with their own on every request instead of a getpid() system call.
# A fork made outside Python (a C library's fork() whose child then runs this code) is not
# seen; every fork Python code makes (os.fork, multiprocessing's fork and forkserver) is.
_PID: list[int] = [os.getpid()]


def _after_fork_in_child() -> None:
    _PID[0] = os.getpid()


os.register_at_fork(after_in_child=_after_fork_in_child)


def process_id() -> int:
    """``os.getpid()``, without the system call (see ``_PID``)."""
    return _PID[0]


Buffer = bytes | bytearray | memoryview


class TransportError(Exception):
    """The connection failed (refused, reset, closed by the peer, unreadable reply header). The
    transport is closed; the caller reconnects."""


class TransportTimeout(TransportError):
    """The deadline passed before the whole request was sent and its reply received. The
    transport is closed: a late reply must never be read as the answer to a later request."""


class EndpointError(TransportError, ValueError):
    """An endpoint string that names no transport this client speaks."""


class RpcClient(Protocol):
    """What the client needs of a transport (the seed client's ``RpcClient``)."""

    def connect(self, timeout: float) -> None: ...

    def request(self, msg: Buffer, buf: bytearray, timeout: float) -> int: ...

    def request_parts(self, parts: Sequence[Any], buf: bytearray, timeout: float) -> int: ...

    def close(self) -> None: ...


class WaitingRpcClient(RpcClient, Protocol):
    """A transport whose ``request_parts`` runs ``while_waiting`` between sending the frame
    and reading the reply (it says so with ``runs_while_waiting``)."""

    @property
    def runs_while_waiting(self) -> bool: ...

    def request_parts(self, parts: Sequence[Any], buf: bytearray, timeout: float,
                      fds: Sequence[int] = (),
                      while_waiting: Callable[[], None] | None = None) -> int: ...


class Endpoint:
    """A parsed endpoint: ``kind`` "tcp" with ``host``/``port``, or "unix" with ``path``;
    ``shm``: rows through a shared-memory region when the worker offers it (section 13)."""

    __slots__ = ("host", "kind", "path", "port", "shm", "text")

    def __init__(self, text: str, kind: str, host: str = "", port: int = 0,
                 path: str = "", shm: bool = False) -> None:
        self.text, self.kind, self.host, self.port, self.path = text, kind, host, port, path
        self.shm = shm

    def __repr__(self) -> str:
        return f"Endpoint({self.text!r})"


def _host_name_problem(host: str) -> str | None:
    """What makes ``host`` no name the resolver can look up (None: an address, or a name it
    can): a DNS label is 1 to 63 bytes and a name at most 253 (RFC 1035), else every lookup
    fails with a UnicodeError instead of an answer."""
    try:
        ipaddress.ip_address(host.split("%", 1)[0])
        return None
    except ValueError:
        pass
    name = host.removesuffix(".")
    if len(name) > 253:
        return f"host name is {len(name)} characters, over DNS's 253"
    for label in name.split("."):
        if not 1 <= len(label.encode("utf-8")) <= 63:
            return (f"host label {label!r} is {len(label.encode('utf-8'))} bytes; a DNS label"
                    " is 1 to 63")
    try:
        host.encode("idna")
    except UnicodeError as exc:
        return f"host {host!r} is no DNS name ({exc})"
    return None


def parse_endpoint(endpoint: str) -> Endpoint:
    """Parse ``tcp://host:port`` or ``unix:///absolute/path``; raise EndpointError naming the
    endpoint and what is wrong with it."""
    if not isinstance(endpoint, str):
        raise EndpointError(f"endpoint {endpoint!r} is not a string")

    def bad(why: str) -> EndpointError:
        return EndpointError(f"endpoint {endpoint!r}: {why} (expected tcp://HOST:PORT,"
                             " unix:///PATH or unix+shm:///PATH)")

    if endpoint.startswith("tcp://"):
        rest = endpoint[len("tcp://"):]
        if "/" in rest:
            raise bad("a TCP endpoint has no path")
        host, sep, port_text = rest.rpartition(":")
        if not sep or not host:
            raise bad("no host:port")
        if host.startswith("["):
            if not host.endswith("]"):
                raise bad("unclosed [ in an IPv6 address")
            host = host[1:-1]
        elif ":" in host:
            raise bad("an IPv6 address goes in brackets, tcp://[::1]:PORT")
        if not host:
            raise bad("empty host")
        why = _host_name_problem(host)
        if why:
            raise bad(why)
        if not port_text.isdigit():
            raise bad(f"port {port_text!r} is not a number")
        port = int(port_text)
        if not 1 <= port <= 65535:
            raise bad(f"port {port} outside 1..65535")
        return Endpoint(endpoint, "tcp", host=host, port=port)
    for scheme in ("unix://", "unix+shm://"):
        if not endpoint.startswith(scheme):
            continue
        path = endpoint[len(scheme):]
        if not path.startswith("/"):
            raise bad(f"a Unix socket path must be absolute ({scheme}/run/dspark.sock)")
        if len(os.fsencode(path)) > 107:  # sun_path holds 108 bytes with the NUL
            raise bad(f"path is {len(os.fsencode(path))} bytes, over the 107-byte sun_path limit")
        return Endpoint(endpoint, "unix", path=path, shm=scheme == "unix+shm://")
    scheme = endpoint.partition("://")[0] if "://" in endpoint else ""
    raise bad(f"unknown scheme {scheme!r}" if scheme else "no scheme")


class SocketClient:
    """A blocking stream-socket transport (TCP or Unix). Not thread-safe: one request at a time,
    which is also what the contract allows per connection."""

    def __init__(self, endpoint: str | Endpoint, *,
                 max_reply_bytes: int = DEFAULT_MAX_REPLY_BYTES) -> None:
        self.endpoint = endpoint if isinstance(endpoint, Endpoint) else parse_endpoint(endpoint)
        if max_reply_bytes < 0:
            raise ValueError(f"max_reply_bytes {max_reply_bytes} is negative")
        self.max_reply_bytes = max_reply_bytes
        self._sock: socket.socket | None = None
        self._pid: int | None = None  # the process that opened _sock
        self._closed = False  # closed after a failure or by close(): never reused
        self._connect_timeout = 1.0
        self.reconnects_after_fork = 0

    # -- life ---------------------------------------------------------------------------------
    @property
    def connected(self) -> bool:
        return self._sock is not None and not self._closed

    def fileno(self) -> int:
        return self._sock.fileno() if self._sock is not None else -1

    def connect(self, timeout: float) -> None:
        if self._closed:
            raise TransportError(f"{self.endpoint.text}: transport is closed; make a new one")
        if self._sock is not None:
            raise TransportError(f"{self.endpoint.text}: already connected")
        self._connect_timeout = timeout
        self._sock = self._open(timeout)
        self._pid = process_id()

    def _open(self, timeout: float) -> socket.socket:
        ep = self.endpoint
        if timeout <= 0:
            raise TransportTimeout(f"{ep.text}: no time left to connect")
        try:
            if ep.kind == "tcp":
                sock = socket.create_connection((ep.host, ep.port), timeout=timeout)
                try:
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                except OSError:
                    sock.close()
                    raise
                return sock
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.settimeout(timeout)
                sock.connect(ep.path)
            except OSError:
                sock.close()
                raise
            return sock
        except TimeoutError as exc:
            raise TransportTimeout(f"{ep.text}: connect timed out after"
                                   f" {timeout * 1000:.0f} ms") from exc
        except OSError as exc:
            raise TransportError(f"{ep.text}: connect failed: {exc}") from exc

    def close(self) -> None:
        """Close the connection; this transport is never used again."""
        self._closed = True
        sock, self._sock = self._sock, None
        if sock is None:
            return
        if self._pid == process_id():
            # Tell the worker at once (FIN even if another descriptor to the socket exists).
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        sock.close()

    def _abort(self) -> None:
        """Close after a failure inside a request (same as close; a separate name for reading)."""
        self.close()

    def __enter__(self) -> SocketClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("connected" if self._sock else "new")
        return f"SocketClient({self.endpoint.text!r}, {state})"

    # -- requests -----------------------------------------------------------------------------
    def request(self, msg: Buffer, buf: bytearray, timeout: float) -> int:
        return self.request_parts((msg,), buf, timeout)

    def request_fds(self, msg: Buffer, fds: Sequence[int], buf: bytearray,
                    timeout: float) -> int:
        """``request`` with descriptors passed along with the message's first bytes
        (``SCM_RIGHTS``, Unix sockets only): the MAP frame of section 13."""
        if self.endpoint.kind != "unix":
            raise TransportError(f"{self.endpoint.text}: descriptors go over Unix sockets only")
        return self.request_parts((msg,), buf, timeout, fds=fds)

    runs_while_waiting: Final = True  # request_parts takes while_waiting

    def request_parts(self, parts: Sequence[Any], buf: bytearray, timeout: float,
                      fds: Sequence[int] = (),
                      while_waiting: Callable[[], None] | None = None) -> int:
        """Send ``parts`` back to back as one frame, receive one reply frame into ``buf`` (grown
        when the reply is larger) and return the reply's length in bytes. Parts are any
        C-contiguous buffers (bytes, bytearray, memoryview, numpy arrays); none is copied.
        ``while_waiting`` is called once the frame is sent, before the reply is read: work
        that needs the request but not the reply, done during the round trip (it must not
        raise)."""
        deadline = time.monotonic() + timeout
        views = [_sendable(p) for p in parts]
        sock = self._usable_socket(deadline)
        try:
            self._send_all(sock, views, deadline, fds)
            if while_waiting is not None:
                while_waiting()
            return self._recv_frame(sock, buf, deadline)
        except TransportError:
            self._abort()
            raise
        except TimeoutError as exc:
            self._abort()
            raise TransportTimeout(f"{self.endpoint.text}: request timed out after"
                                   f" {timeout * 1000:.0f} ms") from exc
        except OSError as exc:
            self._abort()
            raise TransportError(f"{self.endpoint.text}: {exc}") from exc
        except BaseException:
            # Anything else (KeyboardInterrupt in the middle of a frame, a bad part): the stream
            # position is unknown, so the connection cannot be reused.
            self._abort()
            raise

    def _usable_socket(self, deadline: float) -> socket.socket:
        if self._closed:
            raise TransportError(f"{self.endpoint.text}: transport is closed (a failed or timed"
                                 " out connection is never reused); make a new one")
        sock = self._sock
        if sock is None:
            raise TransportError(f"{self.endpoint.text}: not connected")
        if self._pid != process_id():
            # Inherited across fork: the parent owns this stream. Drop our descriptor without
            # shutdown (that would cut the parent's connection) and open our own.
            sock.close()
            self._sock = None
            self._pid = process_id()
            self.reconnects_after_fork += 1
            try:
                sock = self._open(min(self._connect_timeout, deadline - time.monotonic()))
            except TransportError:
                self._closed = True
                raise
            self._sock = sock
        return sock

    def _send_all(self, sock: socket.socket, views: list[Any], deadline: float,
                  fds: Sequence[int] = ()) -> None:
        # Drop empty parts; sendmsg may send any prefix of the rest, so advance through them.
        pending = [v for v in views if v.nbytes]
        # Descriptors ride on the first sendmsg only (with its first byte).
        ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TransportTimeout(f"{self.endpoint.text}: deadline passed while sending")
            sock.settimeout(remaining)
            if ancillary:
                sent = sock.sendmsg(pending[:_IOV_MAX], ancillary)
                ancillary = []
            else:
                sent = sock.sendmsg(pending[:_IOV_MAX])
            while sent:
                head = pending[0]
                if sent >= head.nbytes:
                    sent -= head.nbytes
                    pending.pop(0)
                else:
                    pending[0] = _byte_view(head)[sent:]
                    sent = 0

    def _recv_exact(self, sock: socket.socket, view: memoryview, deadline: float,
                    what: str) -> None:
        got, need = 0, view.nbytes
        while got < need:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TransportTimeout(f"{self.endpoint.text}: deadline passed with {got} of"
                                       f" {need} bytes of the reply {what} received")
            sock.settimeout(remaining)
            n = sock.recv_into(view[got:], need - got)
            if n == 0:
                raise TransportError(f"{self.endpoint.text}: connection closed by the worker"
                                     f" after {got} of {need} bytes of the reply {what}")
            got += n

    def _recv_frame(self, sock: socket.socket, buf: bytearray, deadline: float) -> int:
        if len(buf) < APP_HEADER_SIZE:
            _grow(buf, APP_HEADER_SIZE)
        self._recv_exact(sock, memoryview(buf)[:APP_HEADER_SIZE], deadline, "header")
        try:
            header = AppHeader.unpack(buf)
        except WireError as exc:
            if buf.startswith(b"HTTP/"):
                raise TransportError(
                    f"{self.endpoint.text} answers HTTP, not dspark frames: is it a worker's"
                    " metrics port (--metrics-listen)? Give the worker's --listen address"
                ) from exc
            raise TransportError(f"{self.endpoint.text}: unreadable reply header: {exc}") from exc
        body_len = header.body_len
        if body_len > self.max_reply_bytes:
            raise TransportError(
                f"{self.endpoint.text}: reply body_len {body_len} is over the limit of"
                f" {self.max_reply_bytes} bytes ({header.op_name}, seq {header.seq})")
        total = APP_HEADER_SIZE + body_len
        if len(buf) < total:
            try:
                _grow(buf, total)
            except BufferError as exc:
                raise TransportError(
                    f"{self.endpoint.text}: a {total}-byte reply does not fit the {len(buf)}-byte"
                    " buffer, which cannot grow while views of it are alive") from exc
        if body_len:
            self._recv_exact(sock, memoryview(buf)[APP_HEADER_SIZE:total], deadline, "body")
        return total


def _grow(buf: bytearray, size: int) -> None:
    if not isinstance(buf, bytearray):
        raise TransportError(f"reply of {size} bytes does not fit a {type(buf).__name__} of"
                             f" {len(buf)} bytes (pass a bytearray to let it grow)")
    # Double (at least) so a slowly rising reply size does not resize every time.
    buf.extend(bytes(max(size, 2 * len(buf)) - len(buf)))


def _sendable(part: Any) -> Any:
    """A part as ``sendmsg`` takes it, without a copy: a C-contiguous numpy array as it is
    (sendmsg reads any such buffer, and its ``nbytes`` is its length; a round's rows can be
    hundreds of arrays, each view a cost), anything else as a flat byte view."""
    if type(part) is np.ndarray and part.flags.c_contiguous:
        return part
    return _byte_view(part)


def _byte_view(part: Any) -> memoryview:
    """A flat byte view of a part, without a copy (numpy arrays, memoryviews, bytes)."""
    view = part if isinstance(part, memoryview) else memoryview(part)
    if view.format == "B" and view.ndim == 1:
        return view
    if not view.nbytes:  # e.g. rows[:0] of a [n, row_bytes] array: cast refuses zero shapes
        return memoryview(b"")
    if not view.c_contiguous:
        raise ValueError(f"a part of shape {view.shape} with strides {view.strides} is not"
                         " C-contiguous; sendmsg cannot send it without a copy")
    return view.cast("B")


def make_client(endpoint: str, **kwargs: Any) -> SocketClient:
    """A transport for ``endpoint`` (``tcp://host:port``, ``unix:///path`` or
    ``unix+shm:///path``: the same Unix socket; the region is the client's business), not yet
    connected. Raises EndpointError for an endpoint it cannot speak."""
    ep = parse_endpoint(endpoint)
    if ep.kind == "unix" and not hasattr(socket, "AF_UNIX"):  # pragma: no cover - Windows
        raise EndpointError(f"endpoint {endpoint!r}: Unix sockets are not available on"
                            f" {sys.platform}")
    return SocketClient(ep, **kwargs)
