"""The client recovering from what a reconnect, a session takeover and a frame limit do to it,
against a real worker process (the tiny embedded drafter on the CPU) and, for Qwen3-4B-sized
rows, the scripted fake worker with a frame limit.

* After a reconnect or at start-up with prompts past the row budget, every slot drafts again
  within ``fair_bound_rounds`` rounds while every slot commits rows every round, and every
  draft equals the reference drafter's on the newest rows (docs/architecture.md).
* A HELLO refused ST_STALE_SEQ (someone took the session with seq 2**64 - 1) starts a new
  session.
* STEPs refused or cut off for their size lower the row budget, split resyncs, and report; they
  are not resent forever.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from client_fakes import FakeWorker, make_hello, make_hello_reply
from real_engine import RealEngine, hello_for

from dspark_client.client import RemoteDraftClient
from dspark_client.config import RemoteConfig
from dspark_client.hello import DEFAULT_MAX_ROWS_PER_STEP, default_max_rows_per_step
from dspark_client.rounds import DraftRounds, SlotRequest, fair_bound_rounds
from protocol import wire
from tests.support.local_drafts import reference_drafter_one_thread
from tests.support.worker_proc import WorkerProcess, start_worker

W, SLOTS = 64, 8
WORKER_ARGS = ("--window", str(W), "--max-slots", str(SLOTS), "--max-total-slots", "32",
               "--device", "cpu")


@pytest.fixture(scope="module")
def drafter() -> Iterator[Any]:
    yield from reference_drafter_one_thread()


@pytest.fixture(scope="module")
def worker() -> Iterator[WorkerProcess]:
    with start_worker(*WORKER_ARGS) as w:
        yield w


def cfg(endpoint: str, **over: Any) -> RemoteConfig:
    base: dict[str, Any] = dict(endpoint=endpoint, connect_timeout_ms=3000, timeout_ms=5000,
                                backoff_ms=20, backoff_max_ms=200, jitter=0.2)
    base.update(over)
    return RemoteConfig(**base)


def wait_ready(c: RemoteDraftClient, timeout: float = 20.0) -> None:
    assert c.wait_ready(timeout), (c.last_error, c.disabled_reason)


def drive(eng: RealEngine, rounds_n: int, rng: np.random.Generator,
          until_all: bool = False) -> list[list[int]]:
    """``rounds_n`` rounds over every slot, each committing rows every round (the verified
    anchor plus some of its drafts); every draft is checked against the reference. Returns,
    per round, the slots that drafted. With ``until_all``, stops once every slot drafted."""
    drafted_by_round: list[list[int]] = []
    seen: set[int] = set()
    for _ in range(rounds_n):
        reqs, res = eng.run(list(range(SLOTS)))
        eng.check(reqs, res)
        drafted = [s for s in range(SLOTS) if res.num_drafted[s] > 0]
        drafted_by_round.append(drafted)
        seen.update(drafted)
        for s in range(SLOTS):
            k = int(res.num_drafted[s])
            eng.accept(s, int(rng.integers(0, k)) if k else 0)
        if until_all and len(seen) == SLOTS:
            break
    return drafted_by_round


def longest_gap(drafted_by_round: list[list[int]], slot: int) -> int:
    """Rounds in a row, from the first, in which ``slot`` did not draft."""
    gap = worst = 0
    for drafted in drafted_by_round:
        gap = 0 if slot in drafted else gap + 1
        worst = max(worst, gap)
    return worst


@pytest.mark.parametrize("budget", [W, default_max_rows_per_step(W, SLOTS)],
                         ids=["one-window", "default"])
def test_every_slot_drafts_within_the_bound(worker: WorkerProcess, drafter: Any,
                                            budget: int) -> None:
    """At start-up (prompts of 100 rows: 8 full windows, past a one-window budget) and after a
    forced reconnect, every slot drafts again within the proven bound, with every slot
    committing rows every round; before, one slot drafted and seven never did."""
    assert worker.endpoint is not None
    c = RemoteDraftClient(cfg(worker.endpoint),
                          hello_for(drafter, window=W, max_slots=SLOTS,
                                    max_rows_per_step=budget, client_name=f"bound-{budget}"))
    wait_ready(c)
    rounds = DraftRounds(c)
    eng = RealEngine(rounds, drafter, seed=5)
    rng = np.random.default_rng(5)
    bound = fair_bound_rounds(SLOTS, budget, W)
    assert bound == (SLOTS if budget == W else 1)
    try:
        for s in range(SLOTS):
            eng.admit(s, 100)
        for phase in ("start-up", "reconnect"):
            if phase != "start-up":
                c.mark_failed(f"test: {phase}")
                # The engine goes on while the client reconnects: target-only rounds that
                # still commit rows.
                deadline = time.monotonic() + 20.0
                while c.connection_epoch() is None and time.monotonic() < deadline:
                    drive(eng, 1, rng)
                    time.sleep(0.01)
                wait_ready(c)
            by_round = drive(eng, 2 * bound + 2, rng)
            for s in range(SLOTS):
                gap = longest_gap(by_round, s)
                assert gap <= bound - 1, (f"{phase}: slot {s} went {gap} rounds without"
                                          f" drafts (bound {bound}): {by_round}")
        assert eng.checked > 0
        snap = c.stats.snapshot()
        assert snap["starved_slots_now"] == 0 and snap.get("starved_slots_total", 0) == 0
        if budget == W:
            assert snap["deferred_slots_total"] > 0
        else:
            assert snap.get("deferred_slots_total", 0) == 0
    finally:
        c.close()


def test_session_taken_with_the_largest_seq_recovers(worker: WorkerProcess,
                                                     drafter: Any) -> None:
    """Another connection HELLOs with our session id and seq 2**64 - 1: our STEPs lose the
    session and our re-HELLO is refused STALE_SEQ, so the client starts a new session and
    drafts again within a few rounds (before: refused forever, never disabled)."""
    assert worker.endpoint is not None and worker.host is not None and worker.port is not None
    c = RemoteDraftClient(cfg(worker.endpoint),
                          hello_for(drafter, window=W, max_slots=SLOTS, client_name="victim"))
    wait_ready(c)
    rounds = DraftRounds(c)
    eng = RealEngine(rounds, drafter, seed=9)
    rng = np.random.default_rng(9)
    victim = c.session
    thief = socket.create_connection((worker.host, worker.port), timeout=10)
    try:
        for s in range(2):
            eng.admit(s, 20)
        reqs, res = eng.run([0, 1])
        assert res.ok and res.num_drafted.tolist() == [drafter.num_spec] * 2
        for s in range(2):
            eng.accept(s, 1)
        msg = wire.frame(wire.OP_HELLO, (1 << 64) - 1, victim, c.hello.pack())
        thief.sendall(msg)
        head = b""
        while len(head) < wire.APP_HEADER_SIZE:
            chunk = thief.recv(wire.APP_HEADER_SIZE - len(head))
            assert chunk, "worker closed the thief's connection"
            head += chunk
        taken = wire.AppHeader.unpack(head).status == wire.ST_OK
        recovered_after = None
        deadline = time.monotonic() + 20.0
        n = 0
        while time.monotonic() < deadline:
            n += 1
            reqs, res = eng.run([0, 1])
            eng.check(reqs, res)
            for s in range(2):
                eng.accept(s, int(rng.integers(0, max(1, int(res.num_drafted[s])))))
            drafting = res.ok and res.num_drafted.tolist() == [drafter.num_spec] * 2
            if (drafting and c.session != victim) or (not taken and n > 3 and drafting):
                recovered_after = n
                break
            time.sleep(0.02)
        assert recovered_after is not None, (c.last_error, c.stats.snapshot())
        assert not c.disabled
        if taken:  # the worker let the takeover happen: the client moved on by itself
            assert c.session != victim
            assert c.stats.get("hello_stale_seq_total", 0) >= 1
    finally:
        thief.close()
        c.close()


def test_step_over_the_frame_limit_is_split_not_resent(drafter: Any,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    """A worker whose --max-frame-bytes (64 KiB) is below the client's resync STEP (8 windows
    of 768-byte rows, 393 KB): the client halves its row budget after two refusals in a row,
    logs the sizes, and drafts every slot with the smaller STEPs (or, where the worker refuses
    such a HELLO outright, is disabled with the reason). Before, it resent the same STEP four
    times a second for ever."""
    budget = W * SLOTS
    caplog.set_level(logging.WARNING, logger="dspark_client")
    with start_worker(*WORKER_ARGS, "--max-frame-bytes", str(64 << 10)) as w:
        assert w.endpoint is not None
        c = RemoteDraftClient(cfg(w.endpoint),
                              hello_for(drafter, window=W, max_slots=SLOTS,
                                        max_rows_per_step=budget, client_name="big-steps"))
        try:
            deadline = time.monotonic() + 10.0
            while not c.ready and not c.disabled and time.monotonic() < deadline:
                time.sleep(0.02)
            if c.disabled:  # the worker refused the HELLO: nothing is ever sent
                reason = c.disabled_reason or ""
                assert "LIMITS" in reason and "largest STEP is" in reason, reason
                return
            rounds = DraftRounds(c)
            eng = RealEngine(rounds, drafter, seed=13)
            for s in range(SLOTS):
                eng.admit(s, 100)
            seen: set[int] = set()
            n = 0
            deadline = time.monotonic() + 30.0
            while len(seen) < SLOTS and time.monotonic() < deadline and not c.disabled:
                n += 1
                reqs, res = eng.run(list(range(SLOTS)))
                eng.check(reqs, res)
                seen.update(s for s in range(SLOTS) if res.num_drafted[s])
                for s in range(SLOTS):
                    eng.accept(s, 0)
                if not res.ok:
                    time.sleep(0.02)
            assert seen == set(range(SLOTS)), (seen, c.stats.snapshot())
            snap = c.stats.snapshot()
            # 512 -> 256 -> 128 -> 64 rows: 49 KB of rows fit under 64 KiB.
            assert snap["row_budget"] == W and snap["row_budget_cuts_total"] == 3, snap
            assert snap["step_size_refusals_total"] == 6, snap
            text = caplog.text
            assert "STEPs of 512 rows (" in text and "sending at most 256 rows" in text, text
        finally:
            c.close()


QWEN_ROW_BYTES = 25_600  # Qwen3-4B: 5 taps x 2560 hidden x bf16


class _Rows:
    """Deterministic Qwen3-4B-sized rows per (slot, position)."""

    def __init__(self) -> None:
        self.anchor: dict[int, int] = {}

    def request(self, slot: int, n_new: int) -> SlotRequest:
        a = self.anchor.get(slot, 0) + n_new
        self.anchor[slot] = a
        rows = np.empty((n_new, QWEN_ROW_BYTES), np.uint8)
        for j, pos in enumerate(range(a - n_new, a)):
            rows[j] = (np.arange(QWEN_ROW_BYTES) + slot * 31 + pos) % 251
        return SlotRequest(slot=slot, generation=1, anchor_pos=a, anchor_token=a % 97,
                           rows=rows, n_out=4)


@pytest.mark.parametrize("limit, outcome", [(25 * QWEN_ROW_BYTES, "split"),
                                            (100_000, "disabled")])
def test_qwen_sized_rows_over_the_frame_limit(limit: int, outcome: str) -> None:
    """25,600-byte rows, max_rows_per_step 2048 announced, against a worker whose frame limit
    holds 24 rows (W 64): the budget falls until STEPs fit, resyncs go in parts, and every
    slot drafts; with a limit under the smallest part (W / 8 = 8 rows) the client is disabled
    with a message naming the sizes. Either way the number of refused STEPs is bounded."""
    qw = 64
    reply = make_hello_reply(row_bytes=QWEN_ROW_BYTES, n_taps=5, hidden=2560, window=qw,
                             max_rows_per_step=2048)
    with FakeWorker(hello_reply=reply, check_rows=False, max_body=limit) as fw:
        c = RemoteDraftClient(cfg(fw.endpoint, timeout_ms=3000),
                              make_hello(row_bytes=QWEN_ROW_BYTES, n_taps=5, hidden=2560,
                                         window=qw, max_rows_per_step=2048))
        try:
            wait_ready(c)
            rounds = DraftRounds(c)
            rows = _Rows()
            first = True
            seen: set[int] = set()
            n = 0
            deadline = time.monotonic() + 30.0
            while len(seen) < 8 and not c.disabled and time.monotonic() < deadline:
                res = rounds.run([rows.request(s, 70 if first else 1) for s in range(8)])
                first = False
                n += 1
                seen.update(s for s in range(8) if res.num_drafted[s])
                if not res.ok:
                    time.sleep(0.01)
            snap = c.stats.snapshot()
            assert len(fw.too_large) <= 14, fw.too_large
            print(f"{n} rounds, {len(fw.too_large)} refused STEPs, {snap}")
            from dspark_client.stats import COUNTERS, GAUGES

            for key, value in snap.items():  # every name written is documented for exporters
                if isinstance(value, (int, float)):
                    assert key in COUNTERS or key in GAUGES or key.startswith(
                        ("rounds_failed_", "step_frame_")), key
            if outcome == "split":
                assert seen == set(range(8)) and not c.disabled, snap
                assert snap["row_budget"] * QWEN_ROW_BYTES < limit, snap
            else:
                assert c.disabled, snap
                reason = c.disabled_reason or ""
                assert "--max-frame-bytes" in reason and "rows" in reason, reason
        finally:
            c.close()


def test_client_and_worker_defaults_agree() -> None:
    """A client with default max_rows_per_step against a worker with defaults: the HELLO is
    within the worker's --max-rows-per-step, and its largest STEP is within the worker's
    automatic frame limit, for the worker's W and slots and Qwen3-4B rows."""
    from dspark_worker.config import (
        DEFAULT_MAX_ROWS_PER_STEP as WORKER_ROWS,
    )
    from dspark_worker.config import (
        DEFAULT_MAX_SLOTS,
        DEFAULT_WINDOW,
        WorkerConfig,
        frame_limit,
    )

    assert DEFAULT_MAX_ROWS_PER_STEP == WORKER_ROWS
    for window, slots in ((DEFAULT_WINDOW, DEFAULT_MAX_SLOTS), (64, 8), (1024, 1), (16, 256)):
        rows = default_max_rows_per_step(window, slots)
        assert window <= rows <= WORKER_ROWS or rows == window
        largest = wire.rows_offset_for(slots) + rows * QWEN_ROW_BYTES
        cfg_w = WorkerConfig(window=window, max_slots=max(slots, 1))
        if slots <= DEFAULT_MAX_SLOTS:
            assert largest <= frame_limit(cfg_w, QWEN_ROW_BYTES), (window, slots)
    assert default_max_rows_per_step(64, 8) == 512  # every slot's resync in one STEP


def test_resync_in_parts_against_the_real_worker(worker: WorkerProcess, drafter: Any) -> None:
    """A row budget under W: resyncs go in parts (RF_RESET with the oldest rows, then plain
    continuing entries), and the drafts once a window reaches its anchor equal the reference
    drafter's on the newest W rows, so the worker assembled the parts into the right window."""
    assert worker.endpoint is not None
    c = RemoteDraftClient(cfg(worker.endpoint),
                          hello_for(drafter, window=W, max_slots=SLOTS, client_name="parts"))
    wait_ready(c)
    rounds = DraftRounds(c)
    rounds.row_budget = 24  # as after size refusals
    eng = RealEngine(rounds, drafter, seed=21)
    try:
        for s in range(3):
            eng.admit(s, 100)
        seen: set[int] = set()
        for _ in range(40):
            reqs, res = eng.run([0, 1, 2])
            assert res.ok, res.reason
            eng.check(reqs, res)
            seen.update(s for s in range(3) if res.num_drafted[s])
            for s in range(3):
                eng.accept(s, 0)
            if len(seen) == 3:
                break
        assert seen == {0, 1, 2} and eng.checked > 0
        assert c.stats.get("resync_parts_total") >= 6
    finally:
        c.close()
