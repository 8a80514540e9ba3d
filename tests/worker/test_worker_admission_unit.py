"""admission.py on its own: the rates per peer host and for the worker, HELLOs apart, the
order in which waiting connections are served, the bounded map of peers."""

from __future__ import annotations

import asyncio

from dspark_worker.admission import HELLO, OTHER, Gate, TokenBucket, peer_host


class Conn:
    def __init__(self, name: str, answered: int = 0) -> None:
        self.name = name
        self.closing = False
        self.answered = answered
        self.turns = 0

    def admitted(self) -> None:
        self.turns += 1


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_token_bucket() -> None:
    b = TokenBucket(10.0, 3, now=0.0)
    for _ in range(3):
        assert b.due(0.0) == 0.0
        b.take()
    assert abs(b.due(0.0) - 0.1) < 1e-9  # the next token in 1 / rate
    assert b.due(0.25) == 0.0 and b.tokens == 2.5  # refilled at the rate ...
    assert b.due(100.0) == 0.0 and b.tokens == 3.0  # ... never past the burst


def test_a_host_gets_its_rate_however_many_connections_it_opens() -> None:
    clock = Clock()
    waits: list[tuple[str, str]] = []

    async def run() -> None:
        gate = Gate(clock=clock, peer_frames=(10.0, 4), worker_frames=(1000.0, 100),
                    on_wait=lambda kind, limit: waits.append((kind, limit)))
        conns = [Conn(f"c{i}") for i in range(20)]  # a new connection each, a burst each
        assert [gate.admit("h", OTHER, c) for c in conns[:5]] == [True] * 4 + [False]
        assert all(not gate.admit("h", OTHER, c) for c in conns[5:])
        assert gate.admit("other-host", OTHER, Conn("x"))  # another host has its own
        assert gate.admit("h", HELLO, Conn("engine"))  # and a HELLO draws on its own bucket
        assert waits and waits[0] == (OTHER, "peer")
        assert gate.waiting() == 16
        gate.forget("h", conns[10])
        assert gate.waiting() == 15

    asyncio.run(run())


def test_waiting_connections_are_served_least_answered_first_as_tokens_come() -> None:
    order: list[str] = []

    class Recorded(Conn):
        def admitted(self) -> None:
            order.append(self.name)

    async def run() -> None:
        gate = Gate(peer_frames=(200.0, 1), worker_frames=(1000.0, 100))
        greedy = Recorded("pipeline", answered=500)
        fresh = Recorded("probe")
        gone = Recorded("closed")
        assert gate.admit("h", OTHER, Conn("first"))  # the burst of 1
        assert not gate.admit("h", OTHER, greedy)
        assert not gate.admit("h", OTHER, gone)
        assert not gate.admit("h", OTHER, fresh)  # came last, answered least: served first
        gone.closing = True
        for _ in range(200):
            if len(order) == 2:
                break
            await asyncio.sleep(0.005)
        assert order == ["probe", "pipeline"] and gate.waiting() == 0
        assert fresh.answered == 1 and greedy.answered == 501

    asyncio.run(run())


def test_the_worker_rate_bounds_every_host_together() -> None:
    async def run() -> None:
        gate = Gate(peer_frames=(1000.0, 10), worker_frames=(1.0, 5))
        got = [gate.admit(f"h{i}", OTHER, Conn(f"c{i}")) for i in range(8)]
        assert got == [True] * 5 + [False] * 3
        waits: list[str] = []
        gate2 = Gate(peer_frames=(1000.0, 10), worker_frames=(1.0, 1),
                     on_wait=lambda kind, limit: waits.append(limit))
        gate2.admit("a", OTHER, Conn("a"))
        gate2.admit("b", OTHER, Conn("b"))
        assert waits == ["worker"]

    asyncio.run(run())


def test_the_map_of_peers_stays_bounded() -> None:
    async def run() -> None:
        gate = Gate(peer_frames=(1.0, 1), max_peers=64)
        waiting = Conn("w")
        assert gate.admit("keep", OTHER, Conn("first"))
        assert not gate.admit("keep", OTHER, waiting)  # a peer with a waiter is kept
        for i in range(1000):  # a flood of new addresses
            gate.admit(f"10.0.{i // 256}.{i % 256}", OTHER, Conn(str(i)))
        assert len(gate._peers) <= 64 and "keep" in gate._peers

    asyncio.run(run())


def test_peer_hosts_are_counted_by_what_one_party_holds() -> None:
    """Every loopback address is the worker's own host; IPv6 counts by /64, IPv4 by its
    prefix; an IPv4-mapped address as its IPv4 address; a scope id names no other host."""
    assert {peer_host(a) for a in ("127.0.0.1", "127.8.9.10", "::1", "::ffff:127.0.0.2")} \
        == {"loopback"}
    assert peer_host("127.0.0.2", loopback_one=False) == "127.0.0.2"
    assert peer_host("2001:db8::1") == peer_host("2001:db8::ffff:2") == "2001:db8::/64"
    assert peer_host("2001:db8:0:1::1") == "2001:db8:0:1::/64"
    assert peer_host("fe80::1%eth0") == "fe80::/64"
    assert peer_host("10.1.2.3") == "10.1.2.3" and peer_host("::ffff:10.1.2.3") == "10.1.2.3"
    assert peer_host("10.1.2.3", v4_prefix=24) == peer_host("10.1.2.200", v4_prefix=24) \
        == "10.1.2.0/24"
    assert peer_host("2001:db8::1", v6_prefix=128) == "2001:db8::1"
