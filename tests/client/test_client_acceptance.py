"""Draft acceptance against a known engine: a real worker process and a real client on
loopback, an engine loop that accepts exactly the drafts it chooses, and both sides' counters
scraped over HTTP (the worker's /metrics, the client's collector) and read from STATS. A
reconnect, a new generation, a release and a slot left out of a round count nothing."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from prometheus_client import CollectorRegistry
from test_client_metrics import DRAFTER, parsed, scrape, summed, value

import dspark_client as dc
from protocol import wire
from protocol.acceptance import Acceptance
from protocol.messages import ENTRY_DTYPE
from tests.support.worker_proc import WorkerProcess, start_worker


@pytest.fixture(scope="module")
def worker() -> Iterator[WorkerProcess]:
    with start_worker("--device", "cpu", "--window", "64", "--max-slots", "4",
                      "--max-total-slots", "4", "--max-rows-per-step", "256") as w:
        yield w


class Want:
    """The counts a known engine expects, kept by hand (by position, arrays of N)."""

    def __init__(self, n: int) -> None:
        self.rounds = self.verified_rounds = 0
        self.accepted = np.zeros(n, np.int64)
        self.drafted = np.zeros(n, np.int64)
        self.verified = np.zeros(n, np.int64)
        self.predicted = np.zeros(n, np.float64)
        self.lengths = np.zeros(n + 1, np.int64)

    @property
    def accepted_drafts(self) -> int:
        return int(self.accepted.sum())


class KnownEngine:
    """Rank 0 of an engine whose target accepts exactly what the test says (rows are zeros:
    the worker checks no row values). ``want`` is what the blocks the next STEP judges add up
    to, kept by the rule of ``protocol.acceptance``, written out here by hand."""

    def __init__(self, rounds: dc.DraftRounds, row_bytes: int, num_spec: int) -> None:
        self.rounds, self.row_bytes, self.N = rounds, row_bytes, num_spec
        self.gen: dict[int, int] = {}
        self.anchor: dict[int, int] = {}
        self.fresh: dict[int, int] = {}
        self.k: dict[int, int] = {}
        self.surv: dict[int, np.ndarray] = {}
        self.want = Want(num_spec)
        self.verified: dict[int, int] = {}

    def admit(self, slot: int, prompt: int) -> None:
        self.gen[slot] = self.gen.get(slot, 0) + 1
        self.anchor[slot] = self.fresh[slot] = prompt
        self.k[slot] = 0

    def accept(self, slot: int, a: int, *, judged: bool = True,
               verified: int | None = None) -> None:
        """The target verified the slot's drafts and accepted the first ``a``, then its own
        token: ``a + 1`` rows are committed and the anchor moves past them. ``judged``: the
        slot's next STEP continues its chain."""
        k = self.k[slot]
        assert 0 <= a <= k
        if judged:
            w = self.want
            w.rounds += 1
            w.accepted[:a] += 1
            w.drafted[:k] += 1
            w.predicted[:k] += self.surv[slot]
            w.lengths[a] += 1
            if verified is not None:
                w.verified_rounds += 1
                w.verified[:min(verified, k)] += 1
        if verified is not None:
            self.verified[slot] = verified
        self.anchor[slot] += a + 1
        self.fresh[slot] += a + 1

    def run(self, slots: list[int], *, n_out: dict[int, int] | None = None,
            release: tuple[int, ...] = ()) -> dc.RoundResult:
        reqs = [dc.SlotRequest(slot=s, generation=self.gen[s], anchor_pos=self.anchor[s],
                               anchor_token=3 + s,
                               rows=np.zeros((self.fresh[s], self.row_bytes), np.uint8),
                               n_out=(n_out or {}).get(s, self.N)) for s in slots]
        if self.verified:
            dc.record_verified(self.rounds, list(self.verified), list(self.verified.values()))
            self.verified = {}
        res = self.rounds.run(reqs, release=release)
        assert res.ok, res.reason
        for i, s in enumerate(slots):
            self.fresh[s] = 0
            k = self.k[s] = int(res.num_drafted[i])
            self.surv[s] = np.cumprod(res.confidence[i, :k].astype(np.float32))
        return res


def scrape_worker(worker: WorkerProcess) -> dict[Any, float]:
    assert worker.metrics_url is not None
    with urllib.request.urlopen(worker.metrics_url + "/metrics", timeout=10) as r:
        return parsed(r.read().decode())


def by_position(samples: dict[Any, float], name: str, n: int, **labels: str) -> list[float]:
    """Per position; a worker's series summed over its drafter versions."""
    get = summed if name.startswith("dspark_worker_") else value
    return [get(samples, name, position=str(j), **labels) for j in range(n)]


def engine_client(endpoint: str, name: str, max_slots: int,
                  rows_per_step: int = 256) -> tuple[wire.Hello, dc.RemoteDraftClient]:
    """An engine's HELLO for the reference drafter (W 64) and its client of ``endpoint``."""
    hello = dc.hello_from_checkpoint(DRAFTER, window=64, max_slots=max_slots, client_name=name,
                                     max_rows_per_step=rows_per_step)
    return hello, dc.RemoteDraftClient(dc.RemoteConfig(endpoint=endpoint, timeout_ms=10_000,
                                                       backoff_ms=10), hello)


def test_both_sides_count_exactly_what_a_known_engine_accepted(worker: WorkerProcess) -> None:
    assert worker.endpoint is not None
    hello, client = engine_client(worker.endpoint, "acceptance", 4)
    n = hello.num_spec
    registry = CollectorRegistry()
    registry.register(dc.prometheus_collector(client))
    before = scrape_worker(worker)
    try:
        assert client.wait_ready(30.0), client.last_error
        rounds = dc.DraftRounds(client)
        eng = KnownEngine(rounds, hello.row_bytes, n)
        for slot, prompt in ((0, 10), (1, 70), (2, 1)):  # below W, above W, the first position
            eng.admit(slot, prompt)
        eng.run([0, 1, 2])
        for r in range(6):  # every accepted length 0..k comes up, some blocks shorter than N
            for s in (0, 1, 2):
                eng.accept(s, (r + 2 * s) % (eng.k[s] + 1),
                           verified=eng.k[s] - (r % 2) if s == 0 else None)
            eng.run([0, 1, 2], n_out={1: 1 + r % n} if r % 3 == 1 else None)
        # Slot 2 is left out of a round (its next rows span two rounds): not judged.
        for s in (0, 1):
            eng.accept(s, eng.k[s])
        eng.accept(2, 1, judged=False)
        eng.run([0, 1])
        eng.accept(2, 0, judged=False)  # the target-only round of the slot left out
        for s in (0, 1):
            eng.accept(s, 1)
        eng.run([0, 1, 2])
        # Slot 1 takes a new request (a new generation): its old block counts nothing.
        eng.accept(0, 2)
        eng.accept(2, eng.k[2])
        eng.admit(1, 30)
        eng.run([0, 1, 2])
        # A reconnect: every live slot resyncs (RF_RESET), so no block counts.
        for s in (0, 1, 2):
            eng.accept(s, 1, judged=False)
        epoch = client.epoch
        client.mark_failed("the test drops the connection", backoff=False)
        assert client.wait_ready(30.0) and client.epoch == epoch + 1
        res = eng.run([0, 1, 2])
        assert res.resynced == 3
        for s in (0, 1, 2):
            eng.accept(s, min(3, eng.k[s]))
        eng.run([0, 1, 2])
        # Slot 0 finishes (RF_RELEASE): its last block counts nothing.
        eng.accept(0, 1, judged=False)
        eng.accept(1, 0)
        eng.accept(2, 2)
        eng.run([1, 2], release=(0,))
        text = scrape(registry)
        as_dict = dc.client_metrics(client)
        status, body = client.simple_request(wire.OP_STATS)
        assert status == wire.ST_OK
        stats = json.loads(body)
    finally:
        client.close()
    want = eng.want
    assert want.rounds > 20 and 0 < want.accepted_drafts < want.drafted.sum()
    assert want.lengths[0] and want.lengths[n] and want.verified_rounds
    after = scrape_worker(worker)
    s = parsed(text)
    p, q = "dspark_client_acceptance_", "dspark_worker_acceptance_"
    # The engine's side.
    assert value(s, p + "rounds_total") == want.rounds
    assert by_position(s, p + "accepted_total", n) == want.accepted.tolist()
    assert by_position(s, p + "drafted_total", n) == want.drafted.tolist()
    assert by_position(s, p + "predicted_total", n) == pytest.approx(want.predicted, rel=1e-5)
    assert value(s, p + "verified_rounds_total") == want.verified_rounds
    assert by_position(s, p + "verified_total", n) == want.verified.tolist()
    assert as_dict[p + "accepted_total"] == {str(j): v for j, v in
                                             enumerate(want.accepted.tolist())}
    assert value(s, "dspark_client_steps_ok_total") == value(s, "dspark_client_steps_total")
    # The worker's side (a worker of this test's own): the same blocks, counted from the STEPs
    # it applied.
    assert summed(after, q + "rounds_total") - summed(before, q + "rounds_total") == want.rounds
    for name, wanted in (("accepted", want.accepted), ("drafted", want.drafted)):
        got = np.subtract(by_position(after, f"{q}{name}_total", n),
                          by_position(before, f"{q}{name}_total", n))
        assert got.tolist() == wanted.tolist(), name
    predicted = np.subtract(by_position(after, q + "predicted_total", n),
                            by_position(before, q + "predicted_total", n))
    assert predicted == pytest.approx(want.predicted, rel=1e-5)
    # And per session in STATS.
    (mine,) = [e for e in stats["sessions"] if e.get("session") == client.session]
    acc = mine["acceptance"]
    assert acc["rounds"] == want.rounds and acc["accepted_drafts"] == want.accepted_drafts
    assert acc["accepted_by_position"] == want.accepted.tolist()
    assert acc["mean_accepted_length"] == pytest.approx(1 + want.accepted_drafts / want.rounds,
                                                        abs=1e-4)
    assert acc["acceptance_by_position"][0] == pytest.approx(
        want.accepted[0] / want.drafted[0], abs=1e-4)
    assert stats["totals"]["acceptance"]["rounds"] == want.rounds


def test_a_chain_is_judged_only_by_the_slots_very_next_step() -> None:
    """The rule alone, on hand-made STEPs: accepted = new anchor - old anchor - 1 within
    0..k; anything else, or a gap, a reset, a release or another generation, counts nothing.
    (``acc.totals`` judges the STEPs fed so far each time it is read.)"""
    acc = Acceptance(max_slots=4, num_spec=3)
    conf = np.array([[0.5, 0.5, 0.5]] * 4, np.float32)

    def step(slots: list[int], anchors: list[int], *, gen: int = 1, flags: int = 0,
             k: int = 3) -> None:
        m = len(slots)
        entries = np.zeros(m, ENTRY_DTYPE)
        entries["slot"], entries["generation"] = slots, gen
        entries["anchor_pos"], entries["flags"] = anchors, flags
        acc.observe(entries, np.full(m, k), conf[:m])

    step([0, 1, 2, 3], [10, 10, 10, 10])
    step([0, 1, 2, 3], [11, 14, 15, 13])  # accepted 0, 3 (all), out of range (4), 2
    assert acc.totals.rounds == 3 and acc.totals.accepted.tolist() == [2, 2, 1]
    assert acc.totals.lengths.tolist() == [1, 0, 1, 1]
    assert acc.totals.drafted.tolist() == [3, 3, 3]
    acc.flush()  # the prefix survival of judged blocks is summed in batches
    assert acc.totals.predicted.tolist() == pytest.approx([1.5, 0.75, 0.375])
    step([0], [12])  # slots 1..3 left out; slot 0 judged (0 accepted)
    step([0, 1, 2, 3], [13, 15, 16, 14])  # slot 0 judged again, the others not
    assert acc.totals.rounds == 5 and acc.totals.lengths.tolist() == [3, 0, 1, 1]
    step([0, 1], [14, 16], flags=wire.RF_RESET)
    step([0, 1], [15, 17], gen=2)
    step([0, 1], [16, 18], gen=2, flags=wire.RF_RELEASE)
    assert acc.totals.rounds == 5
    step([0, 1], [17, 19], gen=3)  # a new request after the release
    assert acc.totals.rounds == 5
    acc.record_verified([0, 1], [2, 9])  # 9: more than drafted, taken as all 3
    step([0, 1], [19, 20], gen=3)
    t = acc.totals
    assert t.rounds == 7 and t.verified_rounds == 2 and t.verified.tolist() == [2, 2, 1]
    step([0, 1], [20, 21], gen=3)  # no report this time
    assert acc.totals.rounds == 9 and acc.totals.verified_rounds == 2
    with pytest.raises(ValueError, match=r"slot 4 is not in 0\.\.3"):
        acc.record_verified([4], [1])
    step([0, 1, 9], [21, 23, 5], gen=3)  # slot 9 is past max_slots: left out, no error
    assert acc.totals.rounds == 11


def test_a_bench_beside_an_engine_leaves_the_workers_acceptance_as_it_was(
        worker: WorkerProcess) -> None:
    """``dspark-client bench`` (a real CLI process) drafts beside a known engine: its HELLO says
    HF_SYNTHETIC, so not one of its blocks enters the worker's acceptance figures (/metrics and
    STATS totals), while the engine's keep counting. Without the flag the bench's rounds (each
    accepting ``--accept`` drafts) would be judged blocks like the engine's."""
    assert worker.endpoint is not None
    hello, client = engine_client(worker.endpoint, "beside-bench", 2)
    n = hello.num_spec
    q = "dspark_worker_acceptance_"

    def figures() -> tuple[float, list[float], list[float], dict[str, Any]]:
        m = scrape_worker(worker)
        status, body = client.simple_request(wire.OP_STATS)
        assert status == wire.ST_OK
        return (summed(m, q + "rounds_total"), by_position(m, q + "accepted_total", n),
                by_position(m, q + "drafted_total", n), json.loads(body))

    try:
        assert client.wait_ready(30.0), client.last_error
        eng = KnownEngine(dc.DraftRounds(client), hello.row_bytes, n)
        eng.admit(0, 12)
        eng.run([0])
        for a in (1, 2, 0):
            eng.accept(0, min(a, eng.k[0]))
            eng.run([0])
        rounds0, accepted0, drafted0, stats0 = figures()
        steps0 = stats0["totals"]["steps"]
        bench = subprocess.run(
            [sys.executable, "-m", "dspark_client.cli", "--endpoint", worker.endpoint,
             "bench", "--batch", "2", "--steps", "12", "--warmup", "1", "--accept", "2",
             "--no-progress"], capture_output=True, text=True, timeout=120)
        assert bench.returncode == 0, bench.stderr
        rounds1, accepted1, drafted1, stats1 = figures()
        # The bench ran here (13 STEPs of its own) and counted nowhere.
        assert stats1["totals"]["steps"] - steps0 >= 13
        assert (rounds1, accepted1, drafted1) == (rounds0, accepted0, drafted0)
        assert stats1["totals"]["acceptance"] == stats0["totals"]["acceptance"]
        assert "synthetic (kept out of acceptance)" in worker.log_text()
        # The engine's next judged block still counts, on both.
        eng.accept(0, min(1, eng.k[0]))
        eng.run([0])
        rounds2, accepted2, _, stats2 = figures()
    finally:
        client.close()
    assert rounds2 == rounds0 + 1
    assert accepted2[0] == accepted0[0] + 1 and accepted2[1:] == accepted0[1:]
    (mine,) = [e for e in stats2["sessions"] if e.get("session") == client.session]
    assert mine["synthetic"] is False and mine["acceptance"]["rounds"] == 4


def test_one_session_moves_the_totals_but_not_the_median_session() -> None:
    """Three engines accept two drafts a block; a fourth (broken, or lying: its anchors are its
    own word) claims none accepted over many more blocks. The worker's totals follow the
    fourth; the per-session median the acceptance alert reads stays at the three's 2.0."""
    from dspark_worker.acceptance import MIN_RECENT_BLOCKS

    # four engines of one host fill the pool: its share may be all of it
    with start_worker("--device", "cpu", "--window", "64", "--max-slots", "2",
                      "--max-total-slots", "8", "--max-slots-per-peer", "8",
                      "--max-rows-per-step", "128") as w:
        assert w.endpoint is not None
        clients, engines = [], []
        for name in ("honest-a", "honest-b", "honest-c", "broken"):
            hello, c = engine_client(w.endpoint, name, 2, rows_per_step=128)
            clients.append(c)
            assert c.wait_ready(30.0), c.last_error
            eng = KnownEngine(dc.DraftRounds(c), hello.row_bytes, hello.num_spec)
            for s in (0, 1):
                eng.admit(s, 8)
            eng.run([0, 1])
            engines.append(eng)
        try:
            rounds = MIN_RECENT_BLOCKS // 2 + 2
            for eng, accepted, n_rounds in zip(engines, (2, 2, 2, 0),
                                               (rounds, rounds, rounds, 6 * rounds),
                                               strict=True):
                for _ in range(n_rounds):
                    for s in (0, 1):
                        eng.accept(s, min(accepted, eng.k[s]))
                    eng.run([0, 1])
            m = scrape_worker(w)
        finally:
            for c in clients:
                c.close()
    assert min(e.k[0] for e in engines) >= 2  # every block offered two drafts to accept
    total_mean = (summed(m, "dspark_worker_acceptance_accepted_total", position="0")
                  + summed(m, "dspark_worker_acceptance_accepted_total", position="1")
                  ) / summed(m, "dspark_worker_acceptance_rounds_total")
    assert total_mean < 1.0  # the broken engine's blocks outnumber the others'
    assert value(m, "dspark_worker_acceptance_sessions_judged") == 4
    q = "dspark_worker_acceptance_session_accepted_drafts"
    assert value(m, q, quantile="0.5") == pytest.approx(2.0)
    assert value(m, q, quantile="0.1") < 2.0 and value(m, q, quantile="0.9") == pytest.approx(2.0)
