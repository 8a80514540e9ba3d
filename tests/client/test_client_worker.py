"""The client against a real worker process on loopback (the tiny embedded drafter on the CPU):
multi-step runs, greedy and sampled sessions, slot reuse, a SIGKILLed and restarted worker, and
a chaos proxy that cuts connections mid-frame. Every usable draft is compared with the
in-process reference drafter run from scratch on the same rows."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from real_engine import RealEngine, free_port, hello_for

from dspark_client.client import RemoteDraftClient
from dspark_client.config import RemoteConfig
from dspark_client.rounds import DraftRounds
from protocol import wire
from tests.support.chaos_proxy import ChaosProxy
from tests.support.local_drafts import reference_drafter_one_thread
from tests.support.worker_proc import WorkerProcess, start_worker

W, SLOTS = 16, 6
WORKER_ARGS = ("--window", str(W), "--max-slots", "8", "--max-total-slots", "32",
               "--device", "cpu")


@pytest.fixture(scope="module")
def drafter() -> Iterator[Any]:
    yield from reference_drafter_one_thread()


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerProcess]:
    path = tmp_path_factory.mktemp("sock") / "w.sock"
    with start_worker(*WORKER_ARGS, "--unix", str(path)) as w:
        yield w


def cfg(endpoint: str, **over: Any) -> RemoteConfig:
    base: dict[str, Any] = dict(endpoint=endpoint, connect_timeout_ms=2000, timeout_ms=2000,
                                backoff_ms=20, backoff_max_ms=200, jitter=0.2)
    base.update(over)
    return RemoteConfig(**base)


def open_rounds(endpoint: str, drafter: Any, *, sampled: bool = False, name: str = "engine",
                **over: Any) -> tuple[RemoteDraftClient, DraftRounds]:
    c = RemoteDraftClient(cfg(endpoint, **over),
                          hello_for(drafter, window=W, max_slots=SLOTS, sampled=sampled,
                                    client_name=name))
    assert c.wait_ready(10.0), (c.last_error, c.disabled_reason)
    return c, DraftRounds(c)


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_multi_step_run_matches_the_reference(worker: WorkerProcess, drafter: Any,
                                              sampled: bool) -> None:
    assert worker.endpoint is not None
    c, rounds = open_rounds(worker.endpoint, drafter, sampled=sampled,
                            name=f"multi-{sampled}")
    eng = RealEngine(rounds, drafter, seed=11 if sampled else 3, sampled=sampled)
    try:
        for slot, prompt in zip(range(4), (3, W, 40, 1), strict=True):  # below, at, above W
            eng.admit(slot, prompt)
        reqs, res = eng.run([0, 1, 2, 3])
        assert res.ok, res.reason
        assert res.resynced == 4 and res.rows_sent == 3 + W + W + 1
        eng.check(reqs, res)
        for step in range(1, 9):
            live = [s for s in range(5) if s in eng.gen]
            for s in live:
                if eng.fresh.get(s, 0) == 0:
                    eng.accept(s, int(eng.rng.integers(0, eng.N)))
            release: tuple[int, ...] = ()
            n_out = {s: 1 + (step + s) % eng.N for s in live}
            if step == 3:
                eng.admit(2, 9)  # slot 2 takes a new request (generation 2)
            if step == 5:
                release = (3,)  # slot 3 finishes
                live = [s for s in live if s != 3]
                del eng.gen[3]
                eng.admit(4, 20)
                live.append(4)
            reqs, res = eng.run(live, release=release, n_out=n_out)
            assert res.ok, res.reason
            assert all(st in (wire.RS_OK,) for st in res.status.tolist()), res.status
            eng.check(reqs, res)
            if step == 3:
                assert rounds.ring.held(2) == (0, 9)
        assert eng.checked > 80
        assert c.epoch == 1 and c.stats.get("bad_replies", 0) == 0
    finally:
        c.close()


def test_worker_killed_and_restarted(drafter: Any) -> None:
    port = free_port()
    args = (*WORKER_ARGS, "--listen", f"127.0.0.1:{port}")
    w = start_worker(*args)
    endpoint = f"tcp://127.0.0.1:{port}"
    c, rounds = open_rounds(endpoint, drafter, name="killed", timeout_ms=500)
    eng = RealEngine(rounds, drafter, seed=5)
    try:
        for s in range(3):
            eng.admit(s, 10 + 4 * s)
        for _ in range(3):
            reqs, res = eng.run([0, 1, 2])
            assert res.ok
            eng.check(reqs, res)
            for s in range(3):
                eng.accept(s, 2)
        w.kill()
        # While the worker is gone every round is target-only at once: none waits past the
        # timeout (the first may see the dead connection, the rest are not_ready).
        for _ in range(5):
            t0 = time.monotonic()
            reqs, res = eng.run([0, 1, 2])
            assert time.monotonic() - t0 < 0.5 + 0.2
            assert not res.ok and res.num_drafted.tolist() == [0, 0, 0]
            for s in range(3):
                eng.accept(s, 1)
        assert c.connection_epoch() is None
        deadline = time.monotonic() + 5
        while c.stats.get("connect_failures", 0) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)  # the connect thread retries with backoff meanwhile
        assert c.stats.get("connect_failures", 0) >= 2 and not c.disabled
        w = start_worker(*args)
        deadline = time.monotonic() + 10
        while c.connection_epoch() != 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert c.connection_epoch() == 2, c.last_error
        reqs, res = eng.run([0, 1, 2])
        assert res.ok and res.resynced == 3  # every slot resyncs from rank 0's ring
        eng.check(reqs, res)
        for s in range(3):
            eng.accept(s, 3)
        reqs, res = eng.run([0, 1, 2])
        assert res.ok and res.resynced == 0
        eng.check(reqs, res)
    finally:
        c.close()
        w.stop()


def test_chaos_proxy_cuts_mid_frame(worker: WorkerProcess, drafter: Any) -> None:
    assert worker.host is not None and worker.port is not None
    # Every connection is likely cut, somewhere in its first 20 KB either way: in a HELLO, in
    # a STEP's rows (a round sends about 12 KB) or in a reply.
    with ChaosProxy(worker.host, worker.port, seed=1234, cut_probability=0.9,
                    cut_max_bytes=20_000, max_cuts=5) as proxy:
        c, rounds = open_rounds(proxy.endpoint, drafter, name="chaos", timeout_ms=1000,
                                backoff_ms=5, backoff_max_ms=20)
        eng = RealEngine(rounds, drafter, seed=9)
        ok = failed = 0
        try:
            for s in range(4):
                eng.admit(s, 6 + 5 * s)
            for _ in range(80):
                t0 = time.monotonic()
                reqs, res = eng.run([0, 1, 2, 3])
                assert time.monotonic() - t0 < 1.0 + 0.3
                if res.ok:
                    ok += 1
                    eng.check(reqs, res)
                else:
                    failed += 1
                    c.wait_ready(2.0)
                for s in range(4):
                    eng.accept(s, int(eng.rng.integers(0, eng.N)))
                if proxy.cuts >= proxy.max_cuts and ok > 20:
                    break
            assert proxy.cuts >= 3 and failed >= 2 and ok >= 10, (proxy.cut_log, ok, failed)
            assert not c.disabled
            # Once the cuts are spent, rounds succeed and resync as needed.
            proxy.enabled = False
            c.wait_ready(5.0)
            reqs, res = eng.run([0, 1, 2, 3])
            if not res.ok:  # a cut planned earlier may still land on this connection
                c.wait_ready(5.0)
                for s in range(4):
                    eng.accept(s, 0)
                reqs, res = eng.run([0, 1, 2, 3])
            assert res.ok
            eng.check(reqs, res)
        finally:
            c.close()


def test_rounds_over_a_unix_socket(worker: WorkerProcess, drafter: Any) -> None:
    assert worker.unix_endpoint is not None
    c, rounds = open_rounds(worker.unix_endpoint, drafter, name="unix")
    eng = RealEngine(rounds, drafter, seed=21)
    try:
        eng.admit(0, 12)
        for _ in range(3):
            reqs, res = eng.run([0])
            assert res.ok
            eng.check(reqs, res)
            eng.accept(0, 2)
    finally:
        c.close()


def test_auth_secret_file_shared_with_the_worker(tmp_path: Any, drafter: Any) -> None:
    secret = tmp_path / "secret"
    secret.write_bytes(b"  correct horse battery staple\n")
    secret.chmod(0o600)
    with start_worker(*WORKER_ARGS, "--auth-secret-file", str(secret)) as w:
        assert w.endpoint is not None
        c, rounds = open_rounds(w.endpoint, drafter, name="auth-ok",
                                auth_secret_file=str(secret))
        eng = RealEngine(rounds, drafter, seed=2)
        eng.admit(0, 5)
        reqs, res = eng.run([0])
        assert res.ok
        eng.check(reqs, res)
        c.close()
        bad = RemoteDraftClient(cfg(w.endpoint, auth_secret=b"correct horse"),
                                hello_for(drafter, window=W, max_slots=SLOTS,
                                          client_name="auth-bad"))
        assert not bad.wait_ready(10.0)
        assert "HELLO refused: AUTH" in (bad.disabled_reason or "")
        bad.close()


def test_failover_between_two_real_workers(drafter: Any) -> None:
    """Engines spread over a list of workers by a stable hash of their client name; when its
    worker dies, an engine moves to the next one under a new session, every slot resyncs, and
    drafts equal the reference again."""
    workers = [start_worker(*WORKER_ARGS) for _ in range(2)]
    endpoints = [w.endpoint for w in workers]
    assert all(endpoints)
    # Two client names whose hashes pick different workers: each engine starts on its own.
    base = RemoteConfig(endpoint=str(endpoints[0]), endpoints=(str(endpoints[1]),))
    names = [f"engine-{i}" for i in range(64)]
    by_home = {base.home_index(n): n for n in names}
    assert set(by_home) == {0, 1}, "the hash should spread 64 names over two workers"
    assert base.home_index(by_home[1]) == 1  # stable: the same answer every time
    clients: list[RemoteDraftClient] = []
    try:
        for home in (0, 1):
            c, rounds = open_rounds(str(endpoints[0]), drafter, name=by_home[home],
                                    endpoints=(str(endpoints[1]),), timeout_ms=500)
            clients.append(c)
            assert c.endpoint == endpoints[home]
            assert c.worker_info is not None
        c = clients[1]  # the engine on worker 1
        rounds = DraftRounds(c)
        eng = RealEngine(rounds, drafter, seed=21)
        for s in range(3):
            eng.admit(s, 12 + 5 * s)
        reqs, res = eng.run([0, 1, 2])
        assert res.ok
        eng.check(reqs, res)
        for s in range(3):
            eng.accept(s, 2)
        session_before = c.session
        workers[1].kill()
        deadline = time.monotonic() + 10
        while True:  # target-only rounds until the client is on worker 0, never blocking
            assert time.monotonic() < deadline, c.last_error
            t0 = time.monotonic()
            reqs, res = eng.run([0, 1, 2])
            assert time.monotonic() - t0 < 0.5 + 0.2
            if res.ok:
                break
            for s in range(3):
                eng.accept(s, 1)
            time.sleep(0.01)
        assert c.endpoint == endpoints[0]
        assert c.session != session_before and c.stats.get("failovers") == 1
        assert res.resynced == 3  # every slot resyncs on the new worker
        eng.check(reqs, res)
        for s in range(3):
            eng.accept(s, 3)
        reqs, res = eng.run([0, 1, 2])
        assert res.ok and res.resynced == 0
        eng.check(reqs, res)
        # The engine that lived on worker 0 all along never moved.
        assert clients[0].endpoint == endpoints[0] and clients[0].stats.get("failovers", 0) == 0
    finally:
        for cl in clients:
            cl.close()
        for w in workers:
            w.stop()
