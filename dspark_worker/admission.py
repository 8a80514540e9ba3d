"""What strangers may cost: token buckets for the frames of connections that hold no session,
per peer host and for the whole worker (docs/contract.md section 11; docs/architecture.md,
"What a stranger costs").

A connection without a session (PING, STATS, a HELLO not yet answered) is answered only when
its peer host's bucket and the worker's have a token; HELLOs draw on buckets of their own, so a
flood of PINGs and STATS from a host cannot keep an engine's HELLO from that host waiting. A
connection turned away waits in its peer's queue with reading paused (its bytes stay in the
kernel and cost nothing); one timer per peer and kind serves the queue as tokens come, the
connection answered least so far first (oldest among equals): a new connection's PING goes
before a pipelining connection's next STATS. Frames of a session bound to its connection never
pass through here: an engine's STEPs are never rationed.

Pure bookkeeping over a clock and ``call_later``: the server owns the sockets.
"""

from __future__ import annotations

import asyncio
import ipaddress
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Final, Protocol

# Frames a second (after a burst) a peer host's connections without a session are answered
# together: a health checker PINGs every few seconds, a monitor polls STATS every 15, a person
# runs `dspark-client stats`; 100 leaves room for dozens of them behind one address, and a peer
# opening hundreds of connections a second, each with a burst, gets no more than this.
PEER_FRAMES_PER_S: Final = 100.0
PEER_FRAMES_BURST: Final = 64
# HELLOs a second a peer host may have answered: an engine HELLOs once per connect; a host
# whose sixteen engines restart at once is the burst.
PEER_HELLOS_PER_S: Final = 20.0
PEER_HELLOS_BURST: Final = 32
# What every peer together may have answered: with each answer costing the event loop some
# tens of microseconds, 1,000 frames a second keep strangers under a few percent of the loop,
# however many hosts they come from.
WORKER_FRAMES_PER_S: Final = 1000.0
WORKER_FRAMES_BURST: Final = 256
WORKER_HELLOS_PER_S: Final = 200.0
WORKER_HELLOS_BURST: Final = 256
# Peer hosts whose buckets are remembered; one not seen for longest is forgotten first (its
# bucket would be full by then anyway, unless a flood of new addresses pushes it out).
MAX_PEERS: Final = 4096

HELLO: Final = "hello"
OTHER: Final = "other"
LOOPBACK: Final = "loopback"


def peer_host(address: str, *, v4_prefix: int = 32, v6_prefix: int = 64,
              loopback_one: bool = True) -> str:
    """The peer host per-peer limits count a TCP peer's ``address`` under: every loopback
    address (127.0.0.0/8, ::1) as one host, since any process on the worker's host can use any
    of them (``loopback_one``); an IPv6 address by its ``v6_prefix`` network (a host is given
    a /64 and picks addresses in it freely); an IPv4 address by its ``v4_prefix`` network. An
    IPv4-mapped IPv6 address counts as its IPv4 address."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])  # an IPv6 scope id names no host
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip.is_loopback and loopback_one:
        return LOOPBACK
    prefix = v4_prefix if ip.version == 4 else v6_prefix
    if prefix >= ip.max_prefixlen:
        return str(ip)
    return str(ipaddress.ip_network((ip, prefix), strict=False))


class Waiter(Protocol):
    """A connection as the gate sees it."""

    closing: bool
    answered: int  # frames the gate let through for it so far

    def admitted(self) -> None:
        """A token was taken for this connection's next frame: answer it (soon)."""


class TokenBucket:
    """``rate`` tokens a second up to ``burst``; starts full."""

    __slots__ = ("at", "burst", "rate", "tokens")

    def __init__(self, rate: float, burst: int, now: float) -> None:
        self.rate = rate
        self.burst = float(burst)
        self.tokens = float(burst)
        self.at = now

    def _fill(self, now: float) -> None:
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now

    def due(self, now: float) -> float:
        """Seconds until a token is there (0: one is)."""
        self._fill(now)
        return 0.0 if self.tokens >= 1.0 else (1.0 - self.tokens) / self.rate

    def take(self) -> None:
        """Take a token ``due`` said is there."""
        self.tokens -= 1.0


class _Line:
    """One peer's bucket and queue for one kind of frame."""

    __slots__ = ("bucket", "queue", "timer")

    def __init__(self, rate: float, burst: int, now: float) -> None:
        self.bucket = TokenBucket(rate, burst, now)
        self.queue: list[Waiter] = []  # in order of arrival
        self.timer: asyncio.TimerHandle | None = None


class Gate:
    """The buckets of every peer and of the worker (loop thread only)."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic,
                 peer_frames: tuple[float, int] = (PEER_FRAMES_PER_S, PEER_FRAMES_BURST),
                 peer_hellos: tuple[float, int] = (PEER_HELLOS_PER_S, PEER_HELLOS_BURST),
                 worker_frames: tuple[float, int] = (WORKER_FRAMES_PER_S, WORKER_FRAMES_BURST),
                 worker_hellos: tuple[float, int] = (WORKER_HELLOS_PER_S, WORKER_HELLOS_BURST),
                 max_peers: int = MAX_PEERS,
                 on_wait: Callable[[str, str], None] | None = None) -> None:
        self._clock = clock
        self._rates = {HELLO: peer_hellos, OTHER: peer_frames}
        now = clock()
        self._worker = {HELLO: TokenBucket(*worker_hellos, now),
                        OTHER: TokenBucket(*worker_frames, now)}
        self._peers: OrderedDict[str, dict[str, _Line]] = OrderedDict()
        self._max_peers = max_peers
        # Called with (kind, "peer" | "worker") each time a frame has to wait (a metric).
        self._on_wait = on_wait or (lambda kind, limit: None)

    def _lines(self, peer: str) -> dict[str, _Line]:
        lines = self._peers.get(peer)
        if lines is None:
            now = self._clock()
            lines = {kind: _Line(*rate, now) for kind, rate in self._rates.items()}
            self._peers[peer] = lines
            self._forget_idle()
        else:
            self._peers.move_to_end(peer)
        return lines

    def _forget_idle(self) -> None:
        """Keep the map bounded: forget the peer seen longest ago that has nobody waiting."""
        while len(self._peers) > self._max_peers:
            for peer, lines in self._peers.items():
                if not any(line.queue for line in lines.values()):
                    del self._peers[peer]
                    break
            else:
                return  # every peer has a connection waiting: each is bounded by its own

    def admit(self, peer: str, kind: str, conn: Waiter) -> bool:
        """True: answer the frame now (a token was taken). False: ``conn`` waits its turn, and
        ``conn.admitted()`` is called once a token was taken for it."""
        line = self._lines(peer)[kind]
        if not line.queue:  # nobody of this peer is waiting: no one to overtake
            wait, limit = self._due(line, kind)
            if wait == 0.0:
                line.bucket.take()
                self._worker[kind].take()
                conn.answered += 1
                return True
            self._on_wait(kind, limit)
        if conn not in line.queue:
            line.queue.append(conn)
        self._arm(peer, kind, line)
        return False

    def _due(self, line: _Line, kind: str) -> tuple[float, str]:
        now = self._clock()
        mine, everyone = line.bucket.due(now), self._worker[kind].due(now)
        return (mine, "peer") if mine >= everyone else (everyone, "worker")

    def _arm(self, peer: str, kind: str, line: _Line) -> None:
        if line.timer is not None:
            return
        wait, _ = self._due(line, kind)
        line.timer = asyncio.get_running_loop().call_later(max(wait, 0.001), self._serve,
                                                           peer, kind, line)

    def _serve(self, peer: str, kind: str, line: _Line) -> None:
        line.timer = None
        line.queue[:] = [c for c in line.queue if not c.closing]
        while line.queue:
            wait, _ = self._due(line, kind)
            if wait > 0.0:
                break
            # min keeps the first of equals: the queue is in order of arrival
            conn = min(line.queue, key=lambda c: c.answered)
            line.queue.remove(conn)
            line.bucket.take()
            self._worker[kind].take()
            conn.answered += 1
            conn.admitted()
        if line.queue:
            self._arm(peer, kind, line)

    def forget(self, peer: str, conn: Waiter) -> None:
        """A connection of ``peer`` closed: it waits nowhere any more."""
        for line in self._peers.get(peer, {}).values():
            if conn in line.queue:
                line.queue.remove(conn)

    def waiting(self) -> int:
        return sum(len(line.queue) for lines in self._peers.values() for line in lines.values())
