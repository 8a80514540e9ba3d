"""A fleet of real worker processes on loopback addresses (127.0.0.2-4, one port) behind a DNS
name whose answer the test controls, and engines placed on it by rendezvous hashing.

One run through the events of a cluster's life: a worker added to the DNS answer, one removed
from it and put back, one SIGKILLed, one drained (SIGTERM). After each: exactly the engines
whose best-ranked live worker changed have moved (about 1/n), the others lost no round, a moved
engine lost no more rounds than the failover window allows, and every draft of every engine,
before and after its resync on the new worker, equals the in-process reference drafter's on
the same rows (what an undisturbed run drafts).
"""

from __future__ import annotations

import concurrent.futures
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from real_engine import RealEngine, hello_for

from dspark_client.client import RemoteDraftClient
from dspark_client.config import RemoteConfig
from dspark_client.placement import rank
from dspark_client.rounds import DraftRounds
from tests.support.local_drafts import reference_drafter_one_thread
from tests.support.worker_proc import WorkerProcess, start_worker, worker_stats

W, SLOTS, ENGINE_SLOTS = 16, 4, 2
HOSTS = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
NAME = "dspark-fleet.test"
WORKER_ARGS = ("--window", str(W), "--max-slots", str(SLOTS), "--max-total-slots", "64",
               "--device", "cpu", "--drain-s", "5", "--no-warmup")
QUIET_MS = 300.0
# Rounds a moving engine may lose: the failed STEP itself, then target-only rounds while the
# connect thread fails over (failover_after connects, backoff 20-200 ms); generous for a
# loaded 2-core machine, and still far below what a timeout-driven move would cost.
MAX_LOST_ROUNDS = 12


class Dns:
    """The test's resolver: the DNS answer for NAME, changed by the test."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.addresses: list[str] = []

    def set(self, addresses: list[str]) -> None:
        with self.lock:
            self.addresses = list(addresses)

    def __call__(self, name: str, port: int) -> list[str]:
        if name != NAME:
            raise socket.gaierror(socket.EAI_NONAME, f"{name}: no such name")
        with self.lock:
            return list(self.addresses)


@dataclass
class Engine:
    name: str
    client: RemoteDraftClient
    eng: RealEngine
    ok: int = 0
    failed: int = 0


@pytest.fixture(scope="module")
def drafter() -> Iterator[Any]:
    yield from reference_drafter_one_thread()


def _free_port() -> int:
    s = socket.socket()
    s.bind((HOSTS[0], 0))
    port = int(s.getsockname()[1])
    s.close()
    return port


def _start_all(port: int) -> dict[str, WorkerProcess]:
    """One worker per address, started in parallel; all or none."""
    with concurrent.futures.ThreadPoolExecutor(len(HOSTS)) as pool:
        futures = [pool.submit(start_worker, *WORKER_ARGS, "--listen", f"{h}:{port}",
                               "--worker-name", f"w-{h}", timeout=180) for h in HOSTS]
        concurrent.futures.wait(futures)
    errors = [f.exception() for f in futures if f.exception() is not None]
    if errors:
        for f in futures:
            if f.exception() is None:
                f.result().kill()
        raise errors[0]  # type: ignore[misc]
    return {f"tcp://{h}:{port}": f.result() for h, f in zip(HOSTS, futures, strict=True)}


def _pick_names(eps: list[str], per_worker: int) -> list[str]:
    """Engine names whose best-ranked worker over all three is each worker ``per_worker``
    times: every event then moves someone, and the test says who."""
    want = {ep: per_worker for ep in eps}
    names = []
    for i in range(10_000):
        n = f"engine-{i}"
        top = rank(n, eps)[0]
        if want[top]:
            want[top] -= 1
            names.append(n)
        if not any(want.values()):
            return names
    raise AssertionError("no spread of names found")


def test_fleet_add_remove_kill_drain(drafter: Any) -> None:
    port = _free_port()
    eps = [f"tcp://{h}:{port}" for h in HOSTS]
    workers = _start_all(port)
    dns = Dns()
    a, b, c = eps
    dns.set(HOSTS[:2])  # c is up but not yet in the answer
    engines: list[Engine] = []
    try:
        cfg = RemoteConfig(endpoint=f"dns+tcp://{NAME}:{port}", connect_timeout_ms=3000,
                           timeout_ms=3000, backoff_ms=20, backoff_max_ms=200, jitter=0.2,
                           failover_after=2, return_after_ms=QUIET_MS, resolve_interval_ms=100)
        for i, name in enumerate(_pick_names(eps, 2)):
            client = RemoteDraftClient(cfg, hello_for(drafter, window=W, max_slots=SLOTS,
                                                      client_name=name), resolver=dns)
            eng = RealEngine(DraftRounds(client), drafter, seed=100 + i)
            for s in range(ENGINE_SLOTS):
                eng.admit(s, 9 + 4 * s + i)
            engines.append(Engine(name, client, eng))
        for e in engines:
            assert e.client.wait_ready(20.0), (e.name, e.client.last_error)

        def live_home(e: Engine, live: list[str]) -> str:
            return rank(e.name, live)[0]

        def drive(until: Callable[[], bool], what: str, min_sweeps: int,
                  timeout: float = 30.0) -> None:
            """Rounds of every engine, each checked against the reference, until ``until``
            holds after a full sweep (and at least ``min_sweeps`` sweeps)."""
            deadline = time.monotonic() + timeout
            sweeps = 0
            while True:
                for e in engines:
                    reqs, res = e.eng.run(list(range(ENGINE_SLOTS)))
                    if res.ok:
                        e.ok += 1
                        e.eng.check(reqs, res)
                    else:
                        e.failed += 1
                    for s in range(ENGINE_SLOTS):
                        e.eng.accept(s, min(int(res.num_drafted[s]), 2) if res.ok else 0)
                sweeps += 1
                if sweeps >= min_sweeps and until():
                    return
                assert time.monotonic() < deadline, (
                    f"{what}: " + "; ".join(f"{e.name} on {e.client.endpoint}"
                                            f" ({e.client.last_error})" for e in engines))
                time.sleep(0.02)

        lost: dict[str, int] = {}

        def settle(live: list[str], what: str) -> dict[str, str]:
            """Drive until every engine is on its best-ranked live worker, then two more
            sweeps in which every round must be drafted; returns where each engine is and
            leaves the rounds each engine lost on the way in ``lost``."""
            def placed() -> bool:
                return all(e.client.endpoint == live_home(e, live) and e.client.ready
                           for e in engines)
            drive(placed, what, 1)
            lost.clear()
            lost.update({e.name: e.failed for e in engines})
            for e in engines:
                e.ok = e.failed = 0
            drive(lambda: True, what + " (settled)", 2)
            for e in engines:  # settled: every engine drafts every round
                assert e.failed == 0, (what, e.name, e.client.last_error)
            return {e.name: e.client.endpoint for e in engines}

        def begin() -> dict[str, tuple[float, float]]:
            for e in engines:
                e.ok = e.failed = 0
            return {e.name: (e.client.stats.get("connect_failures", 0),
                             e.client.stats.get("step_timeouts", 0)) for e in engines}

        where = settle([a, b], "start")
        assert {where[e.name] for e in engines} == {a, b}

        # -- add c: exactly the engines that rank c first move, without losing a round -------
        begin()
        dns.set(HOSTS)
        moved_to_c = {e.name for e in engines if live_home(e, eps) == c}
        after = settle(eps, "add c")
        moved = {n for n in after if after[n] != where[n]}
        assert moved == moved_to_c and len(moved) == 2  # 2 of 6: the 1/n of n = 3
        for e in engines:
            # The move connects first, then swaps: at most the round whose epoch changed.
            assert lost[e.name] <= (1 if e.name in moved else 0), (e.name, lost[e.name])
            assert e.client.stats.get("moves", 0) == (1 if e.name in moved else 0)
            # A move says GOODBYE where it leaves: no session is left holding lanes there.
            assert e.client.stats.get("goodbyes", 0) == (1 if e.name in moved else 0)
        for ep in (a, b):
            st = worker_stats(workers[ep])
            assert len(st["sessions"]) == sum(after[n] == ep for n in after), (ep, st)
            assert st["totals"]["sessions_dropped"].get("goodbye", 0) == sum(
                where[n] == ep for n in moved), (ep, st)
        where = after

        # -- remove b from the answer (still up): its engines move; then put it back ----------
        begin()
        dns.set([HOSTS[0], HOSTS[2]])
        after = settle([a, c], "remove b")
        moved = {n for n in after if after[n] != where[n]}
        assert moved == {n for n in where if where[n] == b} and len(moved) == 2
        assert all(after[n] != b for n in after)
        assert all(lost[n] <= (1 if n in moved else 0) for n in lost), lost
        begin()
        dns.set(HOSTS)
        back = settle(eps, "b back")
        assert back == where  # every engine home again, after the quiet period
        assert all(lost[n] <= 1 for n in lost), lost
        where = back

        # -- kill c: its engines fail over to their next-ranked worker -----------------------
        before = begin()
        workers[c].kill()
        live = [a, b]
        after = settle(live, "kill c")
        moved = {n for n in after if after[n] != where[n]}
        assert moved == {n for n in where if where[n] == c} and len(moved) == 2
        for e in engines:
            if e.name in moved:
                assert e.client.stats.get("failovers", 0) >= 1
                assert 1 <= lost[e.name] <= MAX_LOST_ROUNDS, (e.name, lost[e.name])
            else:
                assert lost[e.name] == 0, (e.name, lost[e.name])
        where = after
        dns.set(HOSTS[:2])  # the cluster takes it out of the answer
        # Every engine has resolved the new answer before the next event: an engine that still
        # listed c could try it first after the drain (a correct failover, but not this test's).
        drive(lambda: all(c not in e.client.workers for e in engines), "c out of DNS", 1)

        # -- drain a (SIGTERM): its engines go elsewhere at once; no timeout, no failure ------
        before = begin()
        workers[a].proc.send_signal(15)
        # The engines on a step first: on a loaded machine a whole sweep with its reference
        # checks can outlast the drain's quiet period.
        engines.sort(key=lambda e: e.client.endpoint != a)
        live = [b]
        after = settle(live, "drain a")
        moved = {n for n in after if after[n] != where[n]}
        # Its own two and the two that failed over to it from c.
        assert moved == {n for n in where if where[n] == a} and len(moved) >= 2
        for e in engines:
            failures, timeouts = before[e.name]
            assert e.client.stats.get("step_timeouts", 0) == timeouts, e.name
            if e.name in moved:
                assert e.client.stats.get("drained", 0) >= 1
                # Drained, not failed: no connect to a, no failed HELLO counted.
                assert e.client.stats.get("connect_failures", 0) == failures, e.name
                # The refused STEP, and a round or two while the connect thread HELLOs at
                # the next worker (no backoff, no timeout).
                assert 1 <= lost[e.name] <= 4, (e.name, lost[e.name])
            else:
                assert lost[e.name] == 0, (e.name, lost[e.name])
            assert not e.client.disabled
        assert workers[a].proc.wait(30) == 0
        assert "draining" in workers[a].log_text()
        for e in engines:
            assert e.eng.checked > 0
    finally:
        for e in engines:
            e.client.close()
        for w in workers.values():
            w.kill()
