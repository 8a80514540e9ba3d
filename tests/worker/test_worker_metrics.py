"""/metrics and /healthz over HTTP (docs/contract.md section 12), parsed with the Prometheus
text parser; metrics live on the worker's own registry."""

from __future__ import annotations

import asyncio
import threading
import time
import urllib.error
import urllib.request
from typing import Any

import numpy as np
import pytest
import uvloop
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from worker_harness import ThreadWorker, make_hello, tap_rows, worker_config

from dspark_worker import app as app_module
from dspark_worker.app import WorkerApp
from protocol.constants import RF_NEED_DRAFT, ST_IDENTITY, ST_OK
from protocol.messages import ReqEntry


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(s: dict[Any, float], name: str, **labels: str) -> float:
    return s.get((name, tuple(sorted(labels.items()))), 0.0)


def summed(s: dict[Any, float], name: str, **labels: str) -> float:
    """Over every sample of ``name`` carrying these labels (acceptance: every version)."""
    want = set(labels.items())
    return float(sum(v for (n, ls), v in s.items() if n == name and want <= set(ls)))


def test_metrics_move_with_frames(worker: ThreadWorker, drafter: Any) -> None:
    d = drafter
    status, text = worker.scrape()
    assert status == 200
    before = samples(text)
    assert value(before, "dspark_worker_ready") == 1
    assert value(before, "dspark_worker_window_memory_bytes") > 0
    with worker.connect() as c:
        assert c.hello(make_hello(d, drafter_identity=bytes(32))).status == ST_IDENTITY
        assert c.hello(make_hello(d)).status == ST_OK
        rows = tap_rows(d.row_bytes, 0, 1, 0, 10)
        entries = [ReqEntry(slot=0, generation=1, anchor_pos=10, anchor_token=3, n_rows=10,
                            flags=RF_NEED_DRAFT),
                   ReqEntry(slot=1, generation=1, anchor_pos=10, anchor_token=3,
                            flags=RF_NEED_DRAFT)]
        assert c.step(entries, rows, d.row_bytes).status == ST_OK
        assert c.ping().status == ST_OK
        _, text = worker.scrape()
        after = samples(text)
        assert value(after, "dspark_worker_connections_open") == 1
    p = "dspark_worker_"
    assert value(after, p + "frames_total", op="STEP", status="OK") == 1
    assert value(after, p + "frames_total", op="HELLO", status="IDENTITY") == 1
    assert value(after, p + "frames_total", op="HELLO", status="OK") == 1
    assert value(after, p + "frames_total", op="PING", status="OK") == 1
    assert value(after, p + "hello_refusals_total", status="IDENTITY") == 1
    assert value(after, p + "request_status_total", status="OK") == 1
    assert value(after, p + "request_status_total", status="NO_WINDOW") == 1
    assert value(after, p + "received_rows_total") == 10
    assert value(after, p + "drafted_positions_total") == d.num_spec
    assert value(after, p + "received_bytes_total") > 10 * d.row_bytes
    assert value(after, p + "sent_bytes_total") > 0
    assert value(after, p + "sessions") == 1 and value(after, p + "active_slots") == 2
    assert value(after, p + "connections_total") >= 1
    for stage in ("decode", "queue", "apply", "draft", "encode", "step", "to_device",
                  "from_device"):
        assert value(after, p + "stage_duration_seconds_count", stage=stage) == 1, stage
        assert value(after, p + "stage_duration_seconds_sum", stage=stage) > 0, stage
    assert value(after, p + "batch_entries_count") == 1
    assert value(after, p + "batch_entries_sum") == 1  # one entry drafted (the other had none)
    info = [k for k in after if k[0] == p + "info"]
    assert info and dict(info[0][1])["drafter_identity"] == d.drafter_identity.hex()


def test_start_time_and_memory_gauges(worker: ThreadWorker) -> None:
    """Restarts are read from a gauge (not from *_created series, which some setups drop), and
    the resident set is a gauge; on the CPU there is no device memory to report."""
    _, text = worker.scrape()
    s = samples(text)
    start = value(s, "dspark_worker_start_time_seconds")
    assert time.time() - 3600 < start <= time.time()
    assert value(s, "dspark_worker_resident_memory_bytes") > 16 * 2**20
    assert not [k for k in s if k[0].startswith("dspark_worker_device_memory")]
    # No *_created series at all (they would double the series and nothing reads them).
    assert "_created" not in text
    assert value(s, "dspark_worker_connections_total") >= 0


def test_device_memory_gauges_are_read_when_scraped() -> None:
    from prometheus_client import generate_latest

    from dspark_worker.metrics import Metrics

    m = Metrics(CollectorRegistry())
    held = {"allocated": 5 << 20, "reserved": 8 << 20, "rss": 100 << 20}
    m.watch_memory(lambda: held["rss"], (lambda: held["allocated"], lambda: held["reserved"]))
    s = samples(generate_latest(m.registry).decode())
    assert value(s, "dspark_worker_device_memory_allocated_bytes") == 5 << 20
    assert value(s, "dspark_worker_device_memory_reserved_bytes") == 8 << 20
    assert value(s, "dspark_worker_resident_memory_bytes") == 100 << 20
    held.update(allocated=6 << 20, rss=101 << 20)
    s = samples(generate_latest(m.registry).decode())
    assert value(s, "dspark_worker_device_memory_allocated_bytes") == 6 << 20
    assert value(s, "dspark_worker_resident_memory_bytes") == 101 << 20


def test_healthz_and_other_paths(worker: ThreadWorker) -> None:
    assert worker.scrape("/healthz") == (200, "ok\n")
    assert worker.scrape("/livez") == (200, "alive\n")
    assert worker.scrape("/nope")[0] == 404
    req = urllib.request.Request(worker.metrics_url + "/metrics", method="POST", data=b"x")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=5)
    assert e.value.code == 405
    e.value.close()


def test_healthz_is_503_until_the_drafter_is_loaded(drafter: Any,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    gate = threading.Event()

    def slow_load(config: Any) -> Any:
        gate.wait(20)
        return drafter

    monkeypatch.setattr(app_module, "load_drafter_for", slow_load)
    app = WorkerApp(worker_config(), registry=CollectorRegistry())
    loop = uvloop.new_event_loop()
    started: asyncio.Future[None] | None = None

    def serve() -> None:
        nonlocal started
        asyncio.set_event_loop(loop)
        started = loop.create_task(app.start())  # type: ignore[assignment]
        loop.run_forever()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        deadline = 50
        while app.metrics_address is None and deadline:
            threading.Event().wait(0.05)
            deadline -= 1
        assert app.metrics_address is not None
        url = f"http://{app.metrics_address[0]}:{app.metrics_address[1]}/healthz"
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(url, timeout=5)
        # It says what it is doing: a worker loading is not a worker down.
        assert e.value.code == 503
        assert e.value.read() == b"loading: reading the drafter (embedded default)\n"
        e.value.close()
        live = url.replace("/healthz", "/livez")
        with urllib.request.urlopen(live, timeout=5) as r:  # alive while it loads
            assert r.status == 200
        gate.set()
        fut = asyncio.run_coroutine_threadsafe(_wait_ready(app), loop)
        fut.result(20)
        with urllib.request.urlopen(url, timeout=5) as r:
            assert r.status == 200
    finally:
        gate.set()
        asyncio.run_coroutine_threadsafe(app.stop(), loop).result(20)
        loop.call_soon_threadsafe(loop.stop)
        t.join(10)
        loop.close()


async def _wait_ready(app: WorkerApp) -> None:
    while not app.ready:
        await asyncio.sleep(0.01)



def test_step_families_follow_prometheus_rules() -> None:
    """The per-STEP families are exported from plain numbers at scrape time: buckets are
    cumulative with inclusive upper bounds (``le``), ``_count`` is the +Inf bucket, counters
    carry ``_total``, every request status is there from the start."""
    from prometheus_client import generate_latest

    from dspark_worker.metrics import LATENCY_BUCKETS, Metrics
    from protocol.constants import OP_STEP, REQ_STATUS_NAMES, RS_NO_WINDOW, ST_BAD_FRAME

    m = Metrics(CollectorRegistry())
    s0 = samples(generate_latest(m.registry).decode())
    p = "dspark_worker_"
    for name in REQ_STATUS_NAMES.values():
        assert (p + "request_status_total", (("status", name),)) in s0, name
    edge = LATENCY_BUCKETS[2]
    for v in (1e-6, edge, edge * 1.01, 100.0):
        m.observe_stage("apply", v)
    m.frame(OP_STEP, 0)
    m.frame(OP_STEP, 0)
    m.frame(OP_STEP, ST_BAD_FRAME)
    m.request_status_ok(5)
    m.request_statuses(np.bincount([RS_NO_WINDOW, RS_NO_WINDOW, 0], minlength=8))
    m.step_accepted(rows=7, received_bytes=100)
    m.drafted(21)
    s = samples(generate_latest(m.registry).decode())
    le = [str(b) if b < 1 else f"{b:.1f}" for b in LATENCY_BUCKETS]
    buckets = [value(s, p + "stage_duration_seconds_bucket", stage="apply", le=x) for x in le]
    assert buckets[:2] == [1, 1] and buckets[2] == 2  # edge falls in its own bucket (le)
    assert buckets[3] == 3 and buckets[-1] == 3  # 100 s only in +Inf
    assert value(s, p + "stage_duration_seconds_bucket", stage="apply", le="+Inf") == 4
    assert value(s, p + "stage_duration_seconds_count", stage="apply") == 4
    assert value(s, p + "stage_duration_seconds_sum", stage="apply") == pytest.approx(
        1e-6 + edge * 2.01 + 100.0)
    assert value(s, p + "stage_duration_seconds_count", stage="draft") == 0
    assert value(s, p + "frames_total", op="STEP", status="OK") == 2
    assert value(s, p + "frames_total", op="STEP", status="BAD_FRAME") == 1
    assert value(s, p + "request_status_total", status="OK") == 6
    assert value(s, p + "request_status_total", status="NO_WINDOW") == 2
    assert value(s, p + "received_rows_total") == 7
    assert value(s, p + "drafted_positions_total") == 21
    assert m.totals["frames"] == 3 and m.refusals == {"STEP:BAD_FRAME": 1}


def test_every_torch_call_runs_on_one_device_thread(drafter: Any,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Loading, the ring pool, warm-up and every batch run on the same thread (OpenMP spins
    only while no more threads own teams than there are CPUs), never on the event loop's."""
    seen: dict[str, set[int]] = {}

    def note(what: str) -> None:
        seen.setdefault(what, set()).add(threading.get_ident())

    class Recording:
        def __init__(self, inner: Any) -> None:
            self._inner = inner

        def __getattr__(self, name: str) -> Any:
            return getattr(self._inner, name)

        def new_pool(self, *args: Any) -> Any:
            note("new_pool")
            return self._inner.new_pool(*args)

        def warmup(self, *args: Any) -> None:
            note("warmup")
            self._inner.warmup(*args)

        def draft(self, *args: Any, **kw: Any) -> Any:
            note("draft")
            return self._inner.draft(*args, **kw)

    def load(config: Any) -> Any:
        note("load")
        return Recording(drafter)

    monkeypatch.setattr(app_module, "load_drafter_for", load)
    w = ThreadWorker(worker_config(warmup=True), None)
    try:
        with w.connect() as c:
            assert c.hello(make_hello(drafter)).status == ST_OK
            rows = tap_rows(drafter.row_bytes, 0, 1, 0, 4)
            entries = [ReqEntry(slot=0, generation=1, anchor_pos=4, anchor_token=3, n_rows=4,
                                flags=RF_NEED_DRAFT)]
            assert c.step(entries, rows, drafter.row_bytes).status == ST_OK
    finally:
        w.stop()
    assert set(seen) == {"load", "new_pool", "warmup", "draft"}
    threads = set().union(*seen.values())
    assert len(threads) == 1, seen
    assert threads != {w._thread.ident}  # not the event loop's thread


def test_acceptance_per_session_and_in_total(worker: ThreadWorker, drafter: Any) -> None:
    """A block the next STEP continues is judged (2 of N accepted here); a session replaced by
    a HELLO of the same client name starts from nothing in STATS, the worker's totals keep it."""
    import json

    d = drafter
    with worker.connect() as c:
        assert c.hello(make_hello(d, client_name="eng")).status == ST_OK
        entry = ReqEntry(slot=0, generation=1, anchor_pos=10, anchor_token=3, n_rows=10,
                         flags=RF_NEED_DRAFT)
        rep = c.step([entry], tap_rows(d.row_bytes, 0, 1, 0, 10), d.row_bytes)
        assert rep.status == ST_OK
        conf = rep.step().confidence[0].astype(np.float64)  # the block judged below
        # The anchor and two accepted drafts committed: the new anchor is 10 + 2 + 1.
        entry = ReqEntry(slot=0, generation=1, anchor_pos=13, anchor_token=5, n_rows=3,
                         flags=RF_NEED_DRAFT)
        assert c.step([entry], tap_rows(d.row_bytes, 0, 1, 10, 3), d.row_bytes).status == ST_OK
        st = json.loads(c.stats(c.session).body)
        (mine,) = st["sessions"]
        acc = mine["acceptance"]
        assert acc["rounds"] == 1 and acc["accepted_drafts"] == 2
        assert acc["accepted_by_position"] == [1, 1] + [0] * (d.num_spec - 2)
        assert acc["drafted_by_position"] == [1] * d.num_spec
        assert acc["mean_accepted_length"] == 3.0
        _, text = worker.scrape()
        s = samples(text)
        assert summed(s, "dspark_worker_acceptance_rounds_total") == 1
        by_version = (("name", st["drafter_name"]), ("version", "1"))
        assert s[("dspark_worker_acceptance_rounds_total", by_version)] == 1  # who drafted
        assert summed(s, "dspark_worker_acceptance_accepted_total", position="1") == 1
        assert summed(s, "dspark_worker_acceptance_accepted_total", position="2") == 0
        assert summed(s, "dspark_worker_acceptance_drafted_total",
                     position=str(d.num_spec - 1)) == 1
        predicted = [summed(s, "dspark_worker_acceptance_predicted_total", position=str(j))
                     for j in range(d.num_spec)]
        assert predicted == pytest.approx(np.cumprod(conf).tolist(), rel=1e-5)
    with worker.connect() as c2:  # the engine restarted: a new session, the same name
        assert c2.hello(make_hello(d, client_name="eng")).status == ST_OK
        st = json.loads(c2.stats(c2.session).body)
        (mine,) = st["sessions"]
        assert mine["acceptance"]["rounds"] == 0
        assert mine["acceptance"]["mean_accepted_length"] is None
        assert st["totals"]["acceptance"]["rounds"] == 1
