"""A TCP proxy that cuts connections mid-frame, at random but reproducibly (seeded) and a
bounded number of times, for fault tests of every layer (the idea of asyncpg's
``_testbase/fuzzer.py``).

    with ChaosProxy("127.0.0.1", worker_port, seed=7, cut_probability=0.3, max_cuts=5) as p:
        p.endpoint   # "tcp://127.0.0.1:PROXY_PORT": point the client here
        p.cuts       # connections cut so far
        p.enabled = False  # stop cutting (the proxy keeps forwarding)

Each accepted connection draws from ``random.Random(seed + connection index)``: with probability
``cut_probability`` (while fewer than ``max_cuts`` cuts happened) it is cut after a number of
bytes in ``[1, cut_max_bytes]`` in one direction (client to worker or back), chosen by the same
draw. Cutting forwards the bytes up to that point, then closes both sides: the peer sees a
frame that stops in the middle. Everything else is forwarded unchanged.
"""

from __future__ import annotations

import contextlib
import random
import socket
import threading
from typing import Final

__all__ = ["ChaosProxy"]

_CHUNK: Final = 1 << 16


class ChaosProxy:
    def __init__(self, target_host: str, target_port: int, *, seed: int = 0,
                 cut_probability: float = 0.3, cut_max_bytes: int = 4096,
                 max_cuts: int = 10) -> None:
        if not 0.0 <= cut_probability <= 1.0:
            raise ValueError(f"cut_probability {cut_probability} outside [0, 1]")
        if cut_max_bytes < 1:
            raise ValueError(f"cut_max_bytes {cut_max_bytes} must be >= 1")
        self.target = (target_host, target_port)
        self.seed = seed
        self.cut_probability = cut_probability
        self.cut_max_bytes = cut_max_bytes
        self.max_cuts = max_cuts
        self.enabled = True
        self.cuts = 0
        self.connections = 0
        self.cut_log: list[tuple[int, str, int]] = []  # (connection, direction, after bytes)
        self._lock = threading.Lock()
        self._closed = False
        self._socks: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self.port = self._listener.getsockname()[1]
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        t = threading.Thread(target=self._accept_loop, name="chaos-accept", daemon=True)
        t.start()
        self._threads.append(t)

    def __enter__(self) -> ChaosProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        with self._lock:
            socks = list(self._socks)
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
        for t in self._threads:
            t.join(5)

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            for s in (client, upstream):
                with contextlib.suppress(OSError):
                    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                index = self.connections
                self.connections += 1
                self._socks.update((client, upstream))
                plan = self._plan(index)
            pair = _Pair(self, client, upstream)
            for direction, src, dst in (("up", client, upstream), ("down", upstream, client)):
                cut_at = plan[1] if plan is not None and plan[0] == direction else None
                t = threading.Thread(target=pair.pump, args=(index, direction, src, dst, cut_at),
                                     name=f"chaos-{index}-{direction}", daemon=True)
                t.start()
                self._threads.append(t)

    def _plan(self, index: int) -> tuple[str, int] | None:
        """Called under the lock: whether and where connection ``index`` is cut."""
        rng = random.Random(self.seed * 1_000_003 + index)
        cut = rng.random() < self.cut_probability
        direction = "up" if rng.random() < 0.5 else "down"
        after = rng.randint(1, self.cut_max_bytes)
        if not (cut and self.enabled and self.cuts < self.max_cuts):
            return None
        self.cuts += 1
        self.cut_log.append((index, direction, after))
        return direction, after


class _Pair:
    """The two sockets of one proxied connection; closing either closes both."""

    def __init__(self, proxy: ChaosProxy, a: socket.socket, b: socket.socket) -> None:
        self.proxy, self.a, self.b = proxy, a, b
        self._lock = threading.Lock()
        self._done = 0

    def pump(self, index: int, direction: str, src: socket.socket, dst: socket.socket,
             cut_at: int | None) -> None:
        sent = 0
        try:
            while True:
                data = src.recv(_CHUNK)
                if not data:
                    break
                if cut_at is not None and sent + len(data) >= cut_at:
                    dst.sendall(data[:cut_at - sent])
                    break  # mid-frame: stop here and close both sides
                dst.sendall(data)
                sent += len(data)
        except OSError:
            pass
        finally:
            self._close_both()

    def _close_both(self) -> None:
        for s in (self.a, self.b):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
        with self._lock:
            self._done += 1
            last = self._done == 2
        if last:
            with self.proxy._lock:
                self.proxy._socks.difference_update((self.a, self.b))
            self.a.close()
            self.b.close()
