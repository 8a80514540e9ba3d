"""DraftRounds against the scripted fake worker: what each round sends (continue, RF_RESET,
RF_RELEASE), when slots resync, and what a failed round gives (docs/contract.md 7.1, 7.5).

The fake worker checks every row it receives against ``row_pattern`` and keeps windows by the
contract's rule, so ``fw.errors == []`` means every row went to the right slot and position.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from client_fakes import (
    MAX_ROWS,
    ROW_BYTES,
    FakeWorker,
    N,
    StepCtx,
    W,
    fake_draft,
    make_hello,
    rows_for,
)

from dspark_client.client import RemoteDraftClient
from dspark_client.config import RemoteConfig
from dspark_client.rounds import NOT_SENT, DraftRounds, SlotRequest
from protocol import wire


class Engine:
    """A stand-in for rank 0's scheduler: per slot a generation and an anchor; each round it
    commits the verified anchor plus some accepted drafts and hands their rows over."""

    def __init__(self, rounds: DraftRounds) -> None:
        self.rounds = rounds
        self.gen: dict[int, int] = {}
        self.anchor: dict[int, int] = {}
        self.fresh: dict[int, int] = {}  # rows committed but not yet handed over

    def admit(self, slot: int, prompt: int) -> None:
        self.gen[slot] = self.gen.get(slot, 0) + 1
        self.anchor[slot] = prompt
        self.fresh[slot] = prompt

    def accept(self, slot: int, k: int) -> None:
        """The round verified the anchor and accepted k drafts: k + 1 rows are committed."""
        self.anchor[slot] += k + 1
        self.fresh[slot] = k + 1

    def token(self, slot: int) -> int:
        return (self.anchor[slot] * 13 + slot) % 97

    def request(self, slot: int, n_out: int = N, **kw: Any) -> SlotRequest:
        a, g, n = self.anchor[slot], self.gen[slot], self.fresh[slot]
        self.fresh[slot] = 0
        return SlotRequest(slot=slot, generation=g, anchor_pos=a, anchor_token=self.token(slot),
                           rows=rows_for(slot, g, a - n, a), n_out=n_out, **kw)

    def run(self, slots: list[int], release: tuple[int, ...] = (), **kw: Any) -> Any:
        return self.rounds.run([self.request(s, **kw) for s in slots], release=release)


def cfg(endpoint: str, **over: Any) -> RemoteConfig:
    base: dict[str, Any] = dict(endpoint=endpoint, connect_timeout_ms=1000, timeout_ms=300,
                                backoff_ms=10, backoff_max_ms=50, jitter=0.1)
    base.update(over)
    return RemoteConfig(**base)


@pytest.fixture
def fw() -> Iterator[FakeWorker]:
    with FakeWorker() as w:
        yield w


def make(fw: FakeWorker, **hello_over: Any) -> tuple[RemoteDraftClient, DraftRounds, Engine]:
    c = RemoteDraftClient(cfg(fw.endpoint), make_hello(**hello_over))
    assert c.wait_ready(3.0), c.last_error
    r = DraftRounds(c)
    return c, r, Engine(r)


@pytest.fixture
def setup(fw: FakeWorker) -> Iterator[tuple[RemoteDraftClient, DraftRounds, Engine]]:
    c, r, e = make(fw)
    yield c, r, e
    c.close()


def last_entries(fw: FakeWorker) -> list[wire.ReqEntry]:
    return fw.steps[-1][1]


def wait_epoch(c: RemoteDraftClient, epoch: int, timeout: float = 3.0) -> None:
    deadline = time.monotonic() + timeout
    while c.connection_epoch() != epoch and time.monotonic() < deadline:
        time.sleep(0.005)
    assert c.connection_epoch() == epoch


def expected(eng: Engine, slot: int, n_out: int = N) -> list[int]:
    wr = min(W, eng.anchor[slot])
    return [fake_draft(eng.token(slot), wr, j) if j < n_out else 0 for j in range(N)]


def test_prefill_then_continue(fw: FakeWorker, setup: Any) -> None:
    _c, _rounds, eng = setup
    eng.admit(0, 5)   # shorter than W
    eng.admit(1, 20)  # longer than W: only the newest W rows go out
    res = eng.run([0, 1])
    assert res.ok and res.num_drafted.tolist() == [N, N]
    es = last_entries(fw)
    assert [(e.slot, e.n_rows, e.flags) for e in es] == [
        (0, 5, wire.RF_NEED_DRAFT | wire.RF_RESET), (1, W, wire.RF_NEED_DRAFT | wire.RF_RESET)]
    assert res.draft_ids.tolist() == [expected(eng, 0), expected(eng, 1)]
    assert res.resynced == 2 and res.rows_sent == 5 + W
    for k in (0, 3, 1, N - 1):  # accepted rows of varying length
        eng.accept(0, k)
        eng.accept(1, N - 1 - k)
        res = eng.run([0, 1])
        assert res.ok and res.resynced == 0
        es = last_entries(fw)
        assert [(e.n_rows, e.flags) for e in es] == [(k + 1, wire.RF_NEED_DRAFT),
                                                    (N - k, wire.RF_NEED_DRAFT)]
        assert res.status.tolist() == [wire.RS_OK, wire.RS_OK]
        assert res.draft_ids.tolist() == [expected(eng, 0), expected(eng, 1)]
    assert fw.errors == []


def test_n_out_and_not_drafting(fw: FakeWorker, setup: Any) -> None:
    _c, rounds, eng = setup
    eng.admit(2, 9)
    eng.admit(3, 9)
    res = rounds.run([eng.request(2, n_out=2), eng.request(3, n_out=0)])
    assert res.ok and res.num_drafted.tolist() == [2, 0]
    assert res.draft_ids[0].tolist() == expected(eng, 2, n_out=2)
    assert res.draft_ids[1].tolist() == [0] * N
    es = last_entries(fw)
    assert es[1].flags == wire.RF_RESET and es[1].n_rows == W  # rows apply, no draft asked
    eng.accept(3, 0)
    res = rounds.run([eng.request(3)])
    assert res.ok and res.resynced == 0 and res.num_drafted.tolist() == [N]
    assert fw.errors == []


def test_slot_reuse_with_new_generation_and_release(fw: FakeWorker, setup: Any) -> None:
    c, rounds, eng = setup
    eng.admit(0, 10)
    eng.admit(1, 4)
    assert eng.run([0, 1]).ok
    # slot 1 finishes; slot 0 takes a new request in the same round as its release
    eng.accept(0, 1)
    res = eng.run([0], release=(1,))
    es = last_entries(fw)
    assert [(e.slot, e.flags) for e in es] == [(0, wire.RF_NEED_DRAFT),
                                              (1, wire.RF_RELEASE)]
    assert es[1].generation == 1 and es[1].n_rows == 0
    assert res.ok and len(res.num_drafted) == 1
    assert 1 not in fw.sessions[c.session].slots
    eng.admit(0, 6)  # new generation in slot 0, released at the same time: a new request
    res = eng.run([0], release=(0,))
    es = last_entries(fw)
    assert [(e.slot, e.generation, e.n_rows, e.flags) for e in es] == [
        (0, 2, 6, wire.RF_NEED_DRAFT | wire.RF_RESET)]
    assert res.ok and res.draft_ids.tolist() == [expected(eng, 0)]
    assert rounds.ring.held(0) == (0, 6)
    assert fw.errors == []


def test_reconnect_resyncs_every_slot(fw: FakeWorker, setup: Any) -> None:
    c, _rounds, eng = setup
    for s in range(3):
        eng.admit(s, 6 + s)
    assert eng.run([0, 1, 2]).ok
    fw.drop_connections()
    for s in range(3):
        eng.accept(s, 2)
    res = eng.run([0, 1, 2])
    assert not res.ok and res.reason in ("transport_error", "not_ready")
    assert res.num_drafted.tolist() == [0, 0, 0]
    assert res.status.tolist() == [NOT_SENT] * 3
    wait_epoch(c, 2)
    for s in range(3):
        eng.accept(s, 1)
    res = eng.run([0, 1, 2])
    assert res.ok and res.resynced == 3
    es = last_entries(fw)
    assert all(e.flags & wire.RF_RESET and e.n_rows == min(W, e.anchor_pos) for e in es)
    assert res.draft_ids.tolist() == [expected(eng, s) for s in range(3)]
    eng.accept(0, 0)
    assert eng.run([0]).resynced == 0
    assert fw.errors == []


def test_not_ready_is_target_only_at_once() -> None:
    c = RemoteDraftClient(cfg("tcp://127.0.0.1:9"), make_hello(), background=False)
    rounds = DraftRounds(c)
    eng = Engine(rounds)
    eng.admit(0, 4)
    t0 = time.monotonic()
    res = eng.run([0])
    assert time.monotonic() - t0 < 0.1  # no connect, no wait
    assert not res.ok and res.reason == "not_ready" and res.num_drafted.tolist() == [0]
    assert res.draft_ids.shape == (1, N) and not res.draft_ids.any()
    assert rounds.ring.held(0) == (0, 4)  # the ring keeps the rows for the later resync
    c.close()


def test_timeout_round_never_blocks_past_the_timeout(fw: FakeWorker, setup: Any) -> None:
    c, _rounds, eng = setup
    eng.admit(0, 8)
    assert eng.run([0]).ok
    fw.step_hook = lambda ctx: "silent"
    eng.accept(0, 2)
    t0 = time.monotonic()
    res = eng.run([0])
    elapsed = time.monotonic() - t0
    assert not res.ok and res.reason == "timeout" and elapsed < 0.3 + 0.25
    fw.step_hook = None
    wait_epoch(c, 2)
    eng.accept(0, 1)
    res = eng.run([0])
    assert res.ok and res.resynced == 1 and last_entries(fw)[0].flags & wire.RF_RESET
    assert res.draft_ids.tolist() == [expected(eng, 0)]


def test_busy_round_resyncs_the_same_connection(fw: FakeWorker, setup: Any) -> None:
    c, _rounds, eng = setup
    eng.admit(0, 8)
    assert eng.run([0]).ok
    fw.step_hook = lambda ctx: ("status", wire.ST_BUSY)
    eng.accept(0, 2)
    assert eng.run([0]).reason == "frame_busy"
    fw.step_hook = None
    eng.accept(0, 0)
    res = eng.run([0])  # the worker never saw the rows of the busy round: resync
    assert res.ok and res.resynced == 1 and c.epoch == 1
    assert fw.errors == []


def test_partial_and_no_window_resync(fw: FakeWorker, setup: Any) -> None:
    c, rounds, eng = setup
    eng.admit(0, 12)
    eng.admit(1, 12)
    assert eng.run([0, 1]).ok
    # The worker loses slot 0's window (a RESET by an operator): a continue gets NO_WINDOW
    # if it brings no rows... here it brings 2 rows, so the worker has a partial window.
    assert c.simple_request(wire.OP_RESET, wire.pack_reset([]))[0] == wire.ST_OK
    eng.accept(0, 1)
    eng.accept(1, 1)
    res = eng.run([0, 1])
    assert res.ok
    assert res.status.tolist() == [wire.RS_PARTIAL_WINDOW, wire.RS_PARTIAL_WINDOW]
    assert res.num_drafted.tolist() == [N, N]  # PARTIAL drafts are usable
    assert rounds.needs_resync(0) and rounds.needs_resync(1)
    eng.accept(0, 0)
    eng.accept(1, 0)
    res = eng.run([0, 1])
    assert res.ok and res.resynced == 2 and res.status.tolist() == [wire.RS_OK, wire.RS_OK]
    assert fw.errors == []


def test_partial_window_from_a_short_ring_does_not_loop(fw: FakeWorker, setup: Any) -> None:
    """An engine that handed over only part of a slot's history: the resync sends what the
    ring has, the worker answers PARTIAL_WINDOW, and the slot does not resync forever."""
    _c, rounds, eng = setup
    eng.admit(0, 12)
    req = eng.request(0)
    req.rows = req.rows[-3:]  # only the newest 3 rows of 12
    res = rounds.run([req])
    assert res.ok and res.status.tolist() == [wire.RS_PARTIAL_WINDOW]
    assert not rounds.needs_resync(0)
    eng.accept(0, 1)
    res = eng.run([0])
    assert res.ok and res.resynced == 0 and res.status.tolist() == [wire.RS_PARTIAL_WINDOW]
    assert fw.errors == []


def test_stale_generation_starts_a_new_session(fw: FakeWorker, setup: Any) -> None:
    c, _rounds, eng = setup
    eng.admit(0, 8)
    eng.admit(1, 8)
    assert eng.run([0, 1]).ok
    old = c.session

    def stale(ctx: StepCtx) -> None:
        assert ctx.reply is not None
        ctx.reply.status[1] = wire.RS_STALE_GENERATION
        ctx.reply.window_rows[1] = 0
        ctx.reply.draft_ids[1] = 0
        ctx.reply.confidence[1] = 0
        if ctx.reply.margin is not None:
            ctx.reply.margin[1] = 0

    fw.step_hook = stale
    eng.accept(0, 1)
    eng.accept(1, 1)
    res = eng.run([0, 1])
    fw.step_hook = None
    assert res.ok and res.num_drafted.tolist() == [N, 0]
    assert c.stats.get("new_sessions") == 1 and c.session != old
    wait_epoch(c, 2)
    eng.accept(0, 0)
    eng.accept(1, 0)
    res = eng.run([0, 1])
    assert res.ok and res.resynced == 2
    assert fw.errors == []


@pytest.mark.parametrize("field, value", [("confidence", np.nan), ("draft_ids", 10_000)])
def test_bad_reply_fails_the_round_and_slots_resync(fw: FakeWorker, setup: Any, field: str,
                                                   value: Any) -> None:
    c, _rounds, eng = setup
    eng.admit(0, 8)
    assert eng.run([0]).ok

    def bad(ctx: StepCtx) -> None:
        getattr(ctx.reply, field)[0, 0] = value

    fw.step_hook = bad
    eng.accept(0, 2)
    res = eng.run([0])
    assert not res.ok and res.reason == "bad_reply" and res.num_drafted.tolist() == [0]
    fw.step_hook = None
    wait_epoch(c, 2)
    eng.accept(0, 0)
    res = eng.run([0])
    assert res.ok and res.resynced == 1 and res.draft_ids.tolist() == [expected(eng, 0)]


def test_row_budget_goes_oldest_first(fw: FakeWorker) -> None:
    c, _rounds, eng = make(fw, max_rows_per_step=2 * W + 1)
    for s in range(4):
        eng.admit(s, 20)
    res = eng.run([0, 1, 2, 3])
    assert res.ok and res.rows_sent == 2 * W
    assert res.status.tolist() == [wire.RS_OK, wire.RS_OK, NOT_SENT, NOT_SENT]
    assert res.num_drafted.tolist() == [N, N, 0, 0]
    assert res.draft_ids[2:].tolist() == [[0] * N] * 2
    assert c.stats.get("deferred_slots_total") == 2
    for s in range(4):
        eng.accept(s, 1)
    # The two resyncs left out waited a round: they go before the continuing slots, which wait
    # with a backlog (their windows on the worker stay valid, no resync for them).
    res = eng.run([0, 1, 2, 3])
    assert res.ok and res.status.tolist() == [NOT_SENT, NOT_SENT, wire.RS_OK, wire.RS_OK]
    assert res.rows_sent == 2 * W and res.resynced == 2
    for s in range(4):
        eng.accept(s, 0)
    res = eng.run([0, 1, 2, 3])
    assert res.ok and res.num_drafted.tolist() == [N] * 4 and res.resynced == 0
    assert [(e.slot, e.n_rows, e.flags & wire.RF_RESET) for e in last_entries(fw)] == [
        (0, 3, 0), (1, 3, 0), (2, 1, 0), (3, 1, 0)]  # backlog of 2 + the new row
    assert res.draft_ids.tolist() == [expected(eng, s) for s in range(4)]
    assert c.stats.get("deferred_slots_total") == 4
    # 8 slots of the session, 2 full windows per STEP: every slot goes within 4 rounds.
    assert c.stats.get("starved_slots_now") == 0 and c.stats.get("fair_bound_rounds") == 4
    assert fw.errors == []
    c.close()


def test_round_without_rows(fw: FakeWorker, setup: Any) -> None:
    """Slots that only ask for drafts again (no new rows): a STEP of entries alone goes out
    (it used to fail in the transport on an empty rows part)."""
    _c, _rounds, eng = setup
    eng.admit(0, 5)
    assert eng.run([0]).ok
    res = eng.run([0])
    assert res.ok and res.rows_sent == 0 and res.num_drafted.tolist() == [N]
    assert last_entries(fw)[0].n_rows == 0 and fw.errors == []


def test_resync_in_parts_below_one_window(fw: FakeWorker) -> None:
    """A row budget under W (after size refusals) sends a resync in parts, oldest rows first
    with RF_RESET, then plain entries continuing it; the slot drafts when its window reaches
    the anchor, and every row the worker holds is the right one."""
    c, rounds, eng = make(fw)
    rounds.row_budget = 3
    eng.admit(0, 20)
    parts = []
    for _ in range(4):
        res = eng.run([0])
        e = last_entries(fw)[0]
        parts.append((e.anchor_pos, e.n_rows, e.flags))
        if res.num_drafted[0]:
            break
        eng.accept(0, 0)  # the engine goes on target-only: one new row per round
    R, ND = wire.RF_RESET, wire.RF_NEED_DRAFT
    assert parts == [(15, 3, R), (18, 3, 0), (21, 3, 0), (23, 2, ND)], parts
    assert res.num_drafted[0] == N and res.draft_ids[0].tolist() == expected(eng, 0)
    assert c.stats.get("resync_parts_total") == 3
    assert fw.errors == []
    c.close()


def test_sampled_rounds(fw: FakeWorker) -> None:
    c, rounds, eng = make(fw, sampled=True)
    eng.admit(0, 9)
    eng.admit(1, 9)
    res = rounds.run([eng.request(0, seed=7, top_k=4, temperature=0.7, top_p=0.9),
                      eng.request(1)])
    assert res.ok, c.stats.get("last_bad_reply")
    assert res.support_ids is not None and res.proposal_q is not None
    assert res.support_ids.shape == (2, N, 32)
    assert (res.proposal_q[0].sum(axis=-1) == 1 << 24).all()
    assert not res.proposal_q[1].any()  # greedy entry in a sampled session
    assert res.draft_ids[1].tolist() == expected(eng, 1)
    c.close()


@pytest.mark.parametrize("bad, words", [
    (dict(slot=99), "slot 99 outside"),
    (dict(n_out=N + 1), "n_out"),
    (dict(top_k=4, temperature=1.0), "sampling fields on a greedy session"),
    (dict(rows=np.zeros((3, ROW_BYTES), np.uint16)), "uint8 array"),
    (dict(rows=np.zeros((9, ROW_BYTES), np.uint8)), "rows exist only before the anchor"),
])
def test_engine_errors_raise_before_sending(fw: FakeWorker, setup: Any, bad: dict[str, Any],
                                           words: str) -> None:
    _c, rounds, _eng = setup
    args: dict[str, Any] = dict(slot=0, generation=1, anchor_pos=8, anchor_token=1,
                                rows=rows_for(0, 1, 0, 8), n_out=N)
    args.update(bad)
    sent = len(fw.frames)
    with pytest.raises(ValueError, match=words):
        rounds.run([SlotRequest(**args)])
    assert len(fw.frames) == sent


def test_duplicate_slot_and_older_generation(fw: FakeWorker, setup: Any) -> None:
    _c, rounds, eng = setup
    eng.admit(0, 4)
    req = eng.request(0)
    with pytest.raises(ValueError, match="appears twice"):
        rounds.run([req, req])
    assert rounds.run([req]).ok
    old = SlotRequest(slot=0, generation=0, anchor_pos=5, anchor_token=0)
    with pytest.raises(ValueError, match="generations only rise"):
        rounds.run([old])


def test_staging_is_what_goes_out(fw: FakeWorker, setup: Any) -> None:
    """Rows reach the transport as a view of the rounds' staging buffer: no copy after the
    one gather."""
    c, rounds, eng = setup
    seen: list[Any] = []
    conn: Any = c.link.conn
    assert conn is not None
    real = conn.request_parts

    def spy(parts: Any, buf: bytearray, timeout: float, **kw: Any) -> int:
        seen.append(parts)
        return int(real(parts, buf, timeout, **kw))

    conn.request_parts = spy
    eng.admit(0, 8)
    assert eng.run([0]).ok
    rows = seen[-1][1]
    assert np.shares_memory(rows, rounds.staging) and rows.shape == (8, ROW_BYTES)
    assert rounds.staging.shape[0] == MAX_ROWS


def test_req_entry_field_order_is_what_rounds_builds_positionally() -> None:
    from protocol.messages import ReqEntry

    assert ReqEntry.__struct_fields__ == (
        "slot", "generation", "anchor_pos", "anchor_token", "n_rows", "n_out", "flags", "seed",
        "top_k", "temperature", "top_p")
