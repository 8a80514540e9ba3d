"""Rendezvous placement and DNS discovery, without sockets: the ranking's stability and the
share of engines a scale event moves, failover, holds, the quiet period before a return, and
the resolution of ``dns+tcp`` endpoints through a resolver the test controls (and once through
the real ``getaddrinfo`` on ``localhost``)."""

from __future__ import annotations

import math
import socket

import pytest

from dspark_client.config import RemoteConfig, RemoteConfigError
from dspark_client.discovery import Discovery, parse_dns_endpoint, system_resolver, tcp_endpoint
from dspark_client.placement import Placement, rank, score
from dspark_client.transport import EndpointError

NAMES = [f"vllm-dp{i}@host-{i % 7}" for i in range(2000)]


def _eps(n: int) -> list[str]:
    return [f"tcp://10.0.0.{i + 1}:7600" for i in range(n)]


def _homes(eps: list[str]) -> dict[str, str]:
    return {n: rank(n, eps)[0] for n in NAMES}


def test_score_is_stable_sha256() -> None:
    # A fixed value: the same in every process, host and Python (no salted hash()).
    assert score("engine-a", "tcp://10.0.0.1:7600") == score("engine-a", "tcp://10.0.0.1:7600")
    import hashlib

    d = hashlib.sha256(b"engine-a\0tcp://10.0.0.1:7600").digest()
    assert score("engine-a", "tcp://10.0.0.1:7600") == int.from_bytes(d[:8], "big")
    assert rank("e", ["b", "a", "b"]) == rank("e", ["a", "b"])  # order and duplicates ignored


@pytest.mark.parametrize("n", [3, 4, 8])
def test_adding_or_removing_one_worker_moves_about_one_in_n(n: int) -> None:
    before = _homes(_eps(n))
    grown = _eps(n + 1)
    after = _homes(grown)
    moved = [k for k in NAMES if before[k] != after[k]]
    # Only to the new worker, and about 1/(n+1) of the engines (2000 names: +-35 %).
    assert all(after[k] == grown[-1] for k in moved)
    assert abs(len(moved) / len(NAMES) - 1 / (n + 1)) < 0.35 / (n + 1)
    # Removing a worker moves exactly the engines it was home to, spread over the others.
    gone = _eps(n)[0]
    shrunk = _homes(_eps(n)[1:])
    moved = [k for k in NAMES if before[k] != shrunk[k]]
    assert set(moved) == {k for k in NAMES if before[k] == gone}
    assert len({shrunk[k] for k in moved}) == n - 1
    # The modulo placement this replaces would have moved most engines.
    mod_moved = sum(1 for k in NAMES if score(k, "") % n != score(k, "") % (n + 1))
    assert mod_moved > len(NAMES) // 2


def test_failover_after_repeated_failures_then_return_after_quiet() -> None:
    eps = _eps(3)
    name = "engine-7"
    order = rank(name, eps)
    p = Placement(name, failover_after=2, return_after_s=10.0)
    p.update(eps, now=0.0)
    assert p.target(0.0) == order[0]  # first listing: eligible at once
    assert not p.connect_failed(order[0], 1.0)  # one failure: stay
    assert p.target(1.0) == order[0]
    assert p.connect_failed(order[0], 2.0)  # the second: held off, fail over
    assert p.target(2.0) == order[1]
    p.connected(order[1])
    assert p.better(order[1], 5.0) is None  # home still held
    assert math.isclose(p.next_change(5.0), 7.0)
    assert p.better(order[1], 12.0) == order[0]  # quiet period over: go home
    # Draining holds without counting failures; the next-ranked is the target at once.
    p.hold(order[0], 20.0)
    assert p.target(20.0) == order[1] and p.better(order[1], 25.0) is None
    # Every member held: the one whose hold ends first.
    p.hold(order[1], 21.0)
    p.hold(order[2], 22.0)
    assert p.target(23.0) == order[0]


def test_a_new_or_returning_member_waits_for_the_quiet_period() -> None:
    eps = _eps(4)
    p = Placement("x", failover_after=1, return_after_s=5.0)
    p.update(eps[:3], now=0.0)
    home3 = rank("x", eps[:3])[0]
    assert p.target(0.0) == home3
    # Find a name for which the 4th worker ranks first.
    name = next(n for n in NAMES if rank(n, eps)[0] == eps[3])
    p = Placement(name, failover_after=1, return_after_s=5.0)
    p.update(eps[:3], now=0.0)
    cur = p.target(0.0)
    assert cur is not None and cur != eps[3]
    added, removed = p.update(eps, now=1.0)
    assert added == [eps[3]] and removed == []
    assert p.better(cur, 3.0) is None  # listed 2 s: not yet
    assert p.better(cur, 6.5) == eps[3]
    # It drops out of the listing and comes back: the quiet period starts again (no flapping).
    p.update(eps[:3], now=7.0)
    p.update(eps, now=8.0)
    assert p.better(cur, 10.0) is None and p.better(cur, 13.5) == eps[3]
    # An empty answer does not forget the set.
    assert p.update([], now=20.0) == ([], []) and len(p.members) == 4
    # The current member no longer listed: any eligible one is better.
    p2 = Placement(name, failover_after=1, return_after_s=0.0)
    p2.update(eps[:2], now=0.0)
    assert p2.better("tcp://10.9.9.9:7600", 0.0) == rank(name, eps[:2])[0]


def test_discovery_resolves_with_the_test_resolver() -> None:
    answers: dict[str, list[str]] = {"fleet": ["127.0.0.2", "127.0.0.3", "::1"]}
    calls: list[tuple[str, int]] = []

    def resolver(name: str, port: int) -> list[str]:
        calls.append((name, port))
        if name not in answers:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return answers[name]

    d = Discovery(["dns+tcp://fleet:7601", "unix:///run/x.sock"], resolver)
    assert d.dynamic
    assert d.resolve() == ["unix:///run/x.sock", "tcp://127.0.0.2:7601", "tcp://127.0.0.3:7601",
                           "tcp://[::1]:7601"]
    assert calls == [("fleet", 7601)] and d.last_error is None
    answers["fleet"] = ["127.0.0.4"]
    assert d.resolve() == ["unix:///run/x.sock", "tcp://127.0.0.4:7601"]
    # A failed lookup keeps the last answer and says why.
    del answers["fleet"]
    assert d.resolve() == ["unix:///run/x.sock", "tcp://127.0.0.4:7601"]
    assert d.last_error is not None and "dns+tcp://fleet:7601" in d.last_error
    answers["fleet"] = ["not-an-address"]
    assert d.resolve() == ["unix:///run/x.sock", "tcp://127.0.0.4:7601"]
    assert not Discovery(["tcp://127.0.0.1:7600"]).dynamic


def test_discovery_through_getaddrinfo_on_localhost() -> None:
    addrs = system_resolver("localhost", 7600)
    assert addrs and set(addrs) <= {"127.0.0.1", "::1"}
    found = Discovery(["dns+tcp://localhost:7600"]).resolve()
    assert "tcp://127.0.0.1:7600" in found or "tcp://[::1]:7600" in found


def test_dns_endpoints_in_the_config() -> None:
    assert parse_dns_endpoint("dns+tcp://dspark-worker.ns.svc:7600") == (
        "dspark-worker.ns.svc", 7600)
    assert tcp_endpoint("fe80::1", 7) == "tcp://[fe80::1]:7"
    cfg = RemoteConfig(endpoint="dns+tcp://dspark-worker:7600", return_after_ms=500,
                       resolve_interval_ms=1000)
    assert cfg.all_endpoints == ("dns+tcp://dspark-worker:7600",)
    assert RemoteConfig.from_dict({"endpoint": "dns+tcp://w:1", "return_after_ms": 0})
    with pytest.raises(EndpointError, match="SRV records are not supported"):
        parse_dns_endpoint("dns+srv://_dspark._tcp.w")
    with pytest.raises(RemoteConfigError, match=r"endpoints\[0\].*port 0 outside"):
        RemoteConfig(endpoints=("dns+tcp://w:0",))
    with pytest.raises(RemoteConfigError, match="return_after_ms = -1"):
        RemoteConfig(return_after_ms=-1)
    with pytest.raises(RemoteConfigError, match="resolve_interval_ms"):
        RemoteConfig(resolve_interval_ms=0)
    # home_index is the rendezvous top of the static list.
    c = RemoteConfig(endpoint=_eps(3)[0], endpoints=tuple(_eps(3)[1:]))
    for n in NAMES[:50]:
        assert c.all_endpoints[c.home_index(n)] == rank(n, _eps(3))[0]
