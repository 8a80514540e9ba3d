"""The engine side's metrics (dspark_client.metrics): a real worker round trip, the client's
collector in a real prometheus_client registry, scraped over HTTP, and the plain dict."""

from __future__ import annotations

import importlib.util
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.parser import text_string_to_metric_families

import dspark_client as dc
from dspark_client.metrics import STEP_RTT_BUCKETS
from dspark_client.stats import Stats
from tests.support.worker_proc import WorkerProcess, start_worker

DRAFTER = Path(importlib.util.find_spec("dspark_worker").submodule_search_locations[0],
               "drafter", "reference")


@pytest.fixture(scope="module")
def worker() -> Iterator[WorkerProcess]:
    with start_worker("--device", "cpu", "--window", "64", "--max-slots", "8",
                      "--max-total-slots", "16", "--max-rows-per-step", "256") as w:
        yield w


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


def scrape(registry: CollectorRegistry) -> str:
    """GET /metrics from prometheus_client's WSGI app, served on a free loopback port (one
    request, so no shutdown poll to wait for)."""
    server = make_server("127.0.0.1", 0, make_wsgi_app(registry), handler_class=_QuietHandler)
    thread = threading.Thread(target=server.handle_request, daemon=True)
    thread.start()
    try:
        port = server.server_address[1]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            assert r.status == 200
            return r.read().decode()
    finally:
        thread.join(10)
        server.server_close()


def parsed(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples: dict[Any, float], name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def summed(samples: dict[Any, float], name: str, **labels: str) -> float:
    """The sum of ``name``'s samples that carry these labels, whatever their others (a worker's
    acceptance series, by drafter version)."""
    want = set(labels.items())
    found = [v for (n, ls), v in samples.items() if n == name and want <= set(ls)]
    if not found:
        raise KeyError((name, labels))
    return float(sum(found))


def test_a_real_round_trip_shows_in_a_scrape_and_in_the_dict(worker: WorkerProcess) -> None:
    assert worker.endpoint is not None
    hello = dc.hello_from_checkpoint(DRAFTER, window=64, max_slots=4, client_name="metrics-test",
                                     max_rows_per_step=256)
    client = dc.RemoteDraftClient(dc.RemoteConfig(endpoint=worker.endpoint, timeout_ms=10_000),
                                  hello)
    registry = CollectorRegistry()
    registry.register(dc.prometheus_collector(client, labels={"dp_rank": "0"}))
    try:
        rounds = dc.DraftRounds(client)
        # Before the connection is up: a target-only round, by reason.
        if client.connection_epoch() is None:
            assert not rounds.run([]).ok
        assert client.wait_ready(30.0)
        rng = np.random.default_rng(0)
        rows = (rng.standard_normal((20, hello.row_bytes // 2)).astype(np.float32)
                .view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
        drafted = 0
        for step in range(3):
            n = 20 if step == 0 else 1
            res = rounds.run([dc.SlotRequest(slot=0, generation=1, anchor_pos=20 + step,
                                             anchor_token=5, rows=rows[:n],
                                             n_out=hello.num_spec)])
            assert res.ok, res.reason
            drafted += 1
        client.new_session("a test asks for one")  # a reconnect under a new session id
        assert client.wait_ready(30.0)
        res = rounds.run([dc.SlotRequest(slot=0, generation=1, anchor_pos=22, anchor_token=5,
                                         n_out=hello.num_spec)])
        assert res.ok and res.resynced == 1 and res.rows_sent == 22, (res.reason, res.resynced)
        drafted += 1
        # A round that only releases sends a STEP without rows (it used to fail in the
        # transport: a (0, row_bytes) view cannot be cast to bytes).
        res = rounds.run([], release=[0])
        assert res.ok and res.rows_sent == 0, res.reason
        text = scrape(registry)
        as_dict = dc.client_metrics(client)
    finally:
        client.close()
    s = parsed(text)
    p = "dspark_client_"
    assert value(s, p + "rounds_drafted_total", dp_rank="0") == drafted + 1  # + the release
    assert value(s, p + "steps_total", dp_rank="0") == drafted + 1
    assert value(s, p + "epoch", dp_rank="0") == 2
    assert value(s, p + "connected", dp_rank="0") == 1
    assert value(s, p + "reconnects_total", dp_rank="0") == 1
    assert value(s, p + "hellos_total", dp_rank="0") == 2
    assert value(s, p + "new_sessions_total", dp_rank="0") == 1
    # The new generation's first entry and the one after the new session are resyncs.
    assert value(s, p + "slots_resynced_total", dp_rank="0") == 2
    assert value(s, p + "step_timeouts_total", dp_rank="0") == 0
    assert value(s, p + "disabled", dp_rank="0") == 0
    assert value(s, p + "step_rtt_seconds_count", dp_rank="0") == drafted + 1
    assert value(s, p + "step_rtt_seconds_bucket", dp_rank="0", le="+Inf") == drafted + 1
    assert 0 < value(s, p + "step_rtt_seconds_sum", dp_rank="0") < drafted * 10
    assert value(s, p + "sent_bytes_total", dp_rank="0") > 20 * hello.row_bytes
    assert value(s, p + "step_worker_seconds_total", dp_rank="0") > 0
    info = [k for k in s if k[0] == p + "worker_info"]
    assert len(info) == 1 and dict(info[0][1])["endpoint"] == worker.endpoint
    target_only = {dict(k[1])["reason"]: v for k, v in s.items()
                   if k[0] == p + "rounds_target_only_total"}
    assert target_only["timeout"] == 0 and sum(target_only.values()) <= 1  # not_ready, once
    # The dict carries the same numbers under the same names.
    assert as_dict[p + "rounds_drafted_total"] == drafted + 1
    assert as_dict[p + "epoch"] == 2
    assert as_dict[p + "step_rtt_seconds"]["count"] == drafted + 1
    assert as_dict[p + "step_rtt_seconds"]["buckets"]["+Inf"] == drafted + 1
    (entry,) = as_dict[p + "worker_info"]
    assert entry["endpoint"] == worker.endpoint and entry["value"] == 1 and entry["worker_name"]
    for name, v in as_dict.items():
        if isinstance(v, (int, float)):
            assert value(s, name, dp_rank="0") == pytest.approx(v), name


def test_a_counter_added_later_flows_through_without_code() -> None:
    stats = Stats()
    registry = CollectorRegistry()
    registry.register(dc.prometheus_collector(stats))
    stats.inc("slots_starved", 3)  # a name no table in dspark_client.metrics knows
    stats.inc("resync_wait_us_total", 2_500_000)
    stats.inc("rounds_failed_timeout", 2)
    stats.inc("rounds_failed", 2)  # the sum of the labelled family: not exported twice
    stats.inc("step_frame_busy")
    stats.set("starved_slots_now", 2)  # a value, not a counter: a gauge
    stats.set("disabled_reason", "text is not a metric")
    text = scrape(registry)
    s = parsed(text)
    types = {f.name: f.type for f in text_string_to_metric_families(text)}
    assert types["dspark_client_starved_slots_now"] == "gauge"
    assert value(s, "dspark_client_starved_slots_now") == 2
    assert types["dspark_client_slots_starved"] == "counter"
    assert not [k for k in s if "disabled_reason" in k[0]]
    assert value(s, "dspark_client_slots_starved_total") == 3
    assert value(s, "dspark_client_resync_wait_seconds_total") == 2.5
    assert value(s, "dspark_client_rounds_target_only_total", reason="timeout") == 2
    assert value(s, "dspark_client_step_refusals_total", status="BUSY") == 1
    assert not [k for k in s if k[0] == "dspark_client_rounds_failed_total"]
    # Counters the table names exist from 0 on, so rate() sees their first event.
    assert value(s, "dspark_client_rounds_drafted_total") == 0
    assert value(s, "dspark_client_step_rtt_seconds_count") == 0


def test_rtt_histogram_buckets_are_inclusive_upper_bounds() -> None:
    stats = Stats()
    edge = STEP_RTT_BUCKETS[3]
    for v in (1e-6, edge, edge * 1.01, 100.0):
        stats.observe("step_rtt_seconds", v, STEP_RTT_BUCKETS)
    h = dc.client_metrics(stats)["dspark_client_step_rtt_seconds"]
    bounds = list(h["buckets"])
    assert bounds[-1] == "+Inf" and len(bounds) == len(STEP_RTT_BUCKETS) + 1
    counts = list(h["buckets"].values())
    assert counts[0] == 1 and counts[3] == 2 and counts[4] == 3 and counts[-2] == 3
    assert counts[-1] == h["count"] == 4
    assert h["sum"] == pytest.approx(1e-6 + edge * 2.01 + 100.0)
    stats.reset()
    assert stats.histograms() == {}


def test_several_clients_share_a_registry_by_label() -> None:
    a, b = Stats(), Stats()
    a.inc("rounds_ok", 1)
    b.inc("rounds_ok", 5)
    registry = CollectorRegistry()
    registry.register(dc.prometheus_collector(a, labels={"dp_rank": "0"}))
    registry.register(dc.prometheus_collector(b, labels={"dp_rank": "1"}))
    s = parsed(scrape(registry))
    assert value(s, "dspark_client_rounds_drafted_total", dp_rank="0") == 1
    assert value(s, "dspark_client_rounds_drafted_total", dp_rank="1") == 5
    with pytest.raises(ValueError, match="'dp-rank' is not a Prometheus label name"):
        dc.prometheus_collector(a, labels={"dp-rank": "0"})
    with pytest.raises(TypeError, match="int is not a Stats"):
        dc.prometheus_collector(3)


def test_every_stats_key_the_client_documents_scrapes_under_one_name() -> None:
    """Each counter and gauge that ``dspark_client.stats`` names (what DraftRounds and the
    client write) appears once, as a counter ending in ``_total`` exactly once or as a gauge,
    with the help text written beside the key."""
    from dspark_client import metrics as dc_metrics
    from dspark_client.stats import COUNTERS, GAUGES

    stats = Stats()
    registry = CollectorRegistry()
    registry.register(dc.prometheus_collector(stats))
    for i, key in enumerate(COUNTERS, start=1):
        stats.inc(key, i)
    for key in GAUGES:
        stats.set(key, 7)
    text = scrape(registry)
    s = parsed(text)
    names = [n for n, _ in s]
    assert not [n for n in names if n.endswith("_total_total")]
    assert value(s, "dspark_client_deferred_slots_total") == list(COUNTERS).index(
        "deferred_slots_total") + 1
    assert value(s, "dspark_client_starved_slots_total") == list(COUNTERS).index(
        "starved_slots_total") + 1
    helps = {f.name: f.documentation for f in text_string_to_metric_families(text)}
    for key, help_ in GAUGES.items():
        assert value(s, f"dspark_client_{key}") == 7
        if key not in dc_metrics.GAUGES:  # those have a scrape name and help of their own
            assert helps[f"dspark_client_{key}"] == help_
