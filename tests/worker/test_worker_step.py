"""STEP over real sockets (docs/contract.md 7, 9, 10): request statuses with exact replies, the
window rules, generations, RELEASE and RESET, every 7.2 step 3 refusal leaving every window as
it was, sampled sessions, and ST_INTERNAL."""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np
import pytest
from worker_harness import (
    Client,
    ThreadWorker,
    make_hello,
    tap_rows,
    thread_worker,
)

from protocol import sampled as psampled
from protocol.constants import (
    MAX_TOP_K,
    OP_PING,
    OP_STEP,
    RF_NEED_DRAFT,
    RF_RELEASE,
    RF_RESET,
    RPF_MARGIN,
    RPF_SAMPLED,
    RS_NO_WINDOW,
    RS_OK,
    RS_PARTIAL_WINDOW,
    RS_STALE_GENERATION,
    SAMPLE_TOP32,
    ST_BAD_FRAME,
    ST_INTERNAL,
    ST_NO_SESSION,
    ST_OK,
)
from protocol.framing import frame
from protocol.header import AppHeader
from protocol.messages import ReqEntry, StepReply, pack_step
from protocol.validate import check_reply_values

W = 32  # the test worker's window


def rows_for(d: Any, slot: int, gen: int, first: int, count: int) -> np.ndarray:
    return tap_rows(d.row_bytes, slot, gen, first, count)


def reference(d: Any, window_rows: list[np.ndarray], anchors: list[int], tokens: list[int],
              sampling: Any = None) -> Any:
    return d.reference_draft(window_rows, np.array(anchors), np.array(tokens),
                             sampling=sampling)


def check_drafts(reply: StepReply, i: int, k: int, ref: Any, j: int) -> None:
    """Entry i carries the reference's lane j in positions < k and zeros after."""
    N = reply.num_spec
    assert reply.draft_ids[i, :k].tolist() == ref.draft_ids[j, :k].tolist()
    np.testing.assert_allclose(reply.confidence[i, :k], ref.confidence[j, :k], rtol=1e-4,
                               atol=1e-5)
    assert reply.margin is not None
    np.testing.assert_allclose(reply.margin[i, :k], ref.margin[j, :k], rtol=1e-3, atol=1e-4)
    for arr in (reply.draft_ids, reply.confidence, reply.margin):
        assert not arr[i, k:N].any()


def session(w: ThreadWorker, d: Any, **kw: Any) -> Client:
    c = w.connect()
    assert c.hello(make_hello(d, **kw)).status == ST_OK
    return c


def ok_step(c: Client, d: Any, entries: list[ReqEntry], rows: Any = b"") -> StepReply:
    if isinstance(rows, list):
        rows = np.concatenate(rows) if rows else b""
    r = c.step(entries, rows, d.row_bytes)
    assert r.status == ST_OK, r.header
    reply = r.step()
    assert reply.step_id == c.seq and reply.n_req == len(entries)
    assert reply.num_spec == d.num_spec
    assert reply.generation.tolist() == [e.generation & 0xFFFFFFFF for e in entries]
    check_reply_values(reply, entries, vocab_size=d.vocab_size, window=W)
    return reply


def test_step_exact_reply(worker: ThreadWorker, drafter: Any) -> None:
    d = drafter
    with session(worker, d) as c:
        r0, r3, r5 = (rows_for(d, 0, 1, 0, 20), rows_for(d, 3, 7, 0, 50),
                      rows_for(d, 5, 2, 0, 4))
        entries = [
            ReqEntry(slot=0, generation=1, anchor_pos=20, anchor_token=11, n_rows=20,
                     flags=RF_NEED_DRAFT),
            ReqEntry(slot=3, generation=7, anchor_pos=50, anchor_token=12, n_rows=50,
                     n_out=3, flags=RF_NEED_DRAFT),  # more rows than W: the newest W kept
            ReqEntry(slot=5, generation=2, anchor_pos=4, anchor_token=13, n_rows=4),
        ]
        reply = ok_step(c, d, entries, [r0, r3, r5])
        assert reply.flags == RPF_MARGIN and reply.sampled_mask is None
        assert reply.status.tolist() == [RS_OK, RS_OK, RS_OK]
        assert reply.window_rows.tolist() == [20, W, 4]
        ref = reference(d, [r0, r3[-W:]], [20, 50], [11, 12])
        check_drafts(reply, 0, d.num_spec, ref, 0)
        check_drafts(reply, 1, 3, ref, 1)  # n_out 3: k = 3
        check_drafts(reply, 2, 0, ref, 0)  # no NEED_DRAFT: zeros
        assert 0 < reply.worker_us < 10_000_000


def test_window_rules(worker: ThreadWorker, drafter: Any) -> None:
    """7.2 steps 4 and 5: partial, none, continue, overwrite, gap, cut, anchor 0."""
    d = drafter
    with session(worker, d) as c:
        def one(slot: int, gen: int, anchor: int, first: int | None, token: int = 5,
                flags: int = RF_NEED_DRAFT) -> tuple[StepReply, np.ndarray | None]:
            n = 0 if first is None else anchor - first
            rows = rows_for(d, slot, gen, first, n) if first is not None else None
            e = [ReqEntry(slot=slot, generation=gen, anchor_pos=anchor, anchor_token=token,
                          n_rows=n, flags=flags)]
            return ok_step(c, d, e, [rows] if rows is not None else b""), rows

        rep, r = one(0, 1, 20, 15)  # a new request with 5 of 20 rows: partial
        assert (rep.status[0], rep.window_rows[0]) == (RS_PARTIAL_WINDOW, 5)
        check_drafts(rep, 0, d.num_spec, reference(d, [r], [20], [5]), 0)
        rep, _ = one(1, 1, 10, None)  # a new request without rows: no window, no draft
        assert (rep.status[0], rep.window_rows[0]) == (RS_NO_WINDOW, 0)
        assert not rep.draft_ids.any() and not rep.confidence.any()
        rep, _ = one(2, 1, 0, None)  # anchor 0: nothing to read, expected 0: OK, drafted
        assert (rep.status[0], rep.window_rows[0]) == (RS_OK, 0)
        check_drafts(rep, 0, d.num_spec, reference(d, [rows_for(d, 2, 1, 0, 0)], [0], [5]), 0)

        full = rows_for(d, 4, 1, 0, 30)
        rep, _ = one(4, 1, 20, 0)  # rows 0..19
        rep, _ = one(4, 1, 23, 20)  # continues at the end: 23 rows
        assert (rep.status[0], rep.window_rows[0]) == (RS_OK, 23)
        check_drafts(rep, 0, d.num_spec, reference(d, [full[:23]], [23], [5]), 0)
        rep, _ = one(4, 1, 22, 21)  # starts inside the window: overwrite, window ends at 22
        assert (rep.status[0], rep.window_rows[0]) == (RS_OK, 22)
        rep, _ = one(4, 1, 15, None)  # no rows, window ends after the anchor: cut at 15
        assert (rep.status[0], rep.window_rows[0]) == (RS_OK, 15)
        check_drafts(rep, 0, d.num_spec, reference(d, [full[:15]], [15], [5]), 0)
        rep, r = one(4, 1, 40, 35)  # a gap: the window restarts with these 5 rows
        assert (rep.status[0], rep.window_rows[0]) == (RS_PARTIAL_WINDOW, 5)
        check_drafts(rep, 0, d.num_spec, reference(d, [r], [40], [5]), 0)
        rep, _ = one(4, 1, 41, None)  # the window ends before the anchor: none usable
        assert (rep.status[0], rep.window_rows[0]) == (RS_NO_WINDOW, 0)
        rep, r = one(4, 1, 40, 30, flags=RF_NEED_DRAFT | RF_RESET)  # reset: rows are window
        assert (rep.status[0], rep.window_rows[0]) == (RS_PARTIAL_WINDOW, 10)
        check_drafts(rep, 0, d.num_spec, reference(d, [r], [40], [5]), 0)


def test_stale_generation_applies_nothing_of_itself(worker: ThreadWorker,
                                                    drafter: Any) -> None:
    d = drafter
    with session(worker, d) as c:
        ok_step(c, d, [ReqEntry(slot=0, generation=5, anchor_pos=12, anchor_token=3,
                                n_rows=12)], [rows_for(d, 0, 5, 0, 12)])
        probe = [ReqEntry(slot=0, generation=5, anchor_pos=12, anchor_token=3,
                          flags=RF_NEED_DRAFT)]
        before = ok_step(c, d, probe)
        mixed = [ReqEntry(slot=0, generation=4, anchor_pos=12, anchor_token=3, n_rows=6,
                          flags=RF_NEED_DRAFT | RF_RESET),
                 ReqEntry(slot=1, generation=1, anchor_pos=6, anchor_token=3, n_rows=6,
                          flags=RF_NEED_DRAFT)]
        r1 = rows_for(d, 1, 1, 0, 6)
        rep = ok_step(c, d, mixed, [rows_for(d, 0, 4, 6, 6), r1])
        assert rep.status.tolist() == [RS_STALE_GENERATION, RS_OK]
        assert rep.window_rows.tolist() == [0, 6]
        assert not rep.draft_ids[0].any() and not rep.confidence[0].any()
        check_drafts(rep, 1, d.num_spec, reference(d, [r1], [6], [3]), 0)
        after = ok_step(c, d, probe)
        assert after.pack()[24:] == before.pack()[24:]  # slot 0's window is as it was


def test_generation_serial_wrap(worker: ThreadWorker, drafter: Any) -> None:
    d = drafter
    with session(worker, d) as c:
        top = 0xFFFFFFFF
        ok_step(c, d, [ReqEntry(slot=0, generation=top, anchor_pos=8, anchor_token=3,
                                n_rows=8)], [rows_for(d, 0, top, 0, 8)])
        rep = ok_step(c, d, [ReqEntry(slot=0, generation=0, anchor_pos=8, anchor_token=3,
                                      flags=RF_NEED_DRAFT)])
        assert rep.status.tolist() == [RS_NO_WINDOW]  # 0 is newer than 0xFFFFFFFF: new request
        rep = ok_step(c, d, [ReqEntry(slot=0, generation=top, anchor_pos=8, anchor_token=3,
                                      flags=RF_NEED_DRAFT)])
        assert rep.status.tolist() == [RS_STALE_GENERATION]
        # generations wider than 32 bits travel as their low 32 bits
        rep = ok_step(c, d, [ReqEntry(slot=0, generation=(1 << 32) + 1, anchor_pos=8,
                                      anchor_token=3, flags=RF_NEED_DRAFT)])
        assert rep.status.tolist() == [RS_NO_WINDOW] and rep.generation.tolist() == [1]


def test_release_frees_window_and_forgets_generation(worker: ThreadWorker,
                                                     drafter: Any) -> None:
    d = drafter
    with session(worker, d) as c:
        ok_step(c, d, [ReqEntry(slot=2, generation=9, anchor_pos=8, anchor_token=3,
                                n_rows=8)], [rows_for(d, 2, 9, 0, 8)])
        rep = ok_step(c, d, [ReqEntry(slot=2, generation=9, anchor_pos=8, anchor_token=3,
                                      flags=RF_RELEASE)])
        assert rep.status.tolist() == [RS_OK] and rep.window_rows.tolist() == [0]
        # generation 3 < 9 would be stale, but the slot was forgotten: a new request
        rep = ok_step(c, d, [ReqEntry(slot=2, generation=3, anchor_pos=8, anchor_token=3,
                                      flags=RF_NEED_DRAFT)])
        assert rep.status.tolist() == [RS_NO_WINDOW]
        stats = msgspec.json.decode(c.stats().body)
        assert stats["sessions"][0]["slots_in_use"] == 1


def test_reset_op(worker: ThreadWorker, drafter: Any) -> None:
    d = drafter
    with session(worker, d) as c:
        for slot in (0, 1):
            ok_step(c, d, [ReqEntry(slot=slot, generation=1, anchor_pos=8, anchor_token=3,
                                    n_rows=8)], [rows_for(d, slot, 1, 0, 8)])
        probe = [ReqEntry(slot=s, generation=1, anchor_pos=8, anchor_token=3,
                          flags=RF_NEED_DRAFT) for s in (0, 1)]
        assert c.reset([1]).status == ST_OK
        assert ok_step(c, d, probe).status.tolist() == [RS_OK, RS_NO_WINDOW]
        assert c.reset([]).status == ST_OK  # count 0: every slot
        assert ok_step(c, d, probe).status.tolist() == [RS_NO_WINDOW, RS_NO_WINDOW]
        r = c.reset([99])
        assert (r.status, r.body) == (ST_BAD_FRAME, b"")
        assert c.request(5, b"\1\0").status == ST_BAD_FRAME  # shorter than its count
        assert c.request(5, struct.pack("<II", 2, 0)).status == ST_BAD_FRAME  # count 2, 1 slot


# -- every 7.2 step 3 refusal leaves every window as it was -----------------------------------
def _body(d: Any, entries: list[ReqEntry], rows: np.ndarray | bytes,
          row_bytes: int | None = None) -> bytearray:
    rb = d.row_bytes if row_bytes is None else row_bytes
    raw = rows if isinstance(rows, bytes) else rows.tobytes()
    return bytearray(pack_step(1, entries, raw, rb))


def _valid_first(d: Any) -> tuple[ReqEntry, np.ndarray]:
    """An entry that would change slot 0's window if anything of its STEP applied."""
    return (ReqEntry(slot=0, generation=1, anchor_pos=12, anchor_token=3, n_rows=4,
                     flags=RF_NEED_DRAFT | RF_RESET), rows_for(d, 0, 77, 8, 4))


def _e(slot: int, **kw: Any) -> ReqEntry:
    base: dict[str, Any] = dict(slot=slot, generation=1, anchor_pos=12, anchor_token=3)
    base.update(kw)
    return ReqEntry(**base)


def _bad_bodies(d: Any) -> dict[str, Callable[[], bytes]]:
    first, r = _valid_first(d)
    N, V = d.num_spec, d.vocab_size

    def with_(e: ReqEntry, rows: np.ndarray | None = None) -> bytes:
        extra = rows if rows is not None else np.zeros((e.n_rows, d.row_bytes), np.uint8)
        return bytes(_body(d, [first, e], np.concatenate([r, extra])))

    def patched(offset: int, fmt: str, value: int) -> bytes:
        b = _body(d, [first], r)
        struct.pack_into(fmt, b, offset, value)
        return bytes(b)

    return {
        "row_bytes": lambda: bytes(_body(d, [first], np.zeros((4, 2 * d.row_bytes), np.uint8),
                                         2 * d.row_bytes)),
        "n_req_over_max_slots": lambda: bytes(_body(d, [first] + [_e(s) for s in range(1, 9)],
                                                    r)),
        "duplicate_slot": lambda: with_(_e(0, generation=2)),
        "slot_over_max_slots": lambda: with_(_e(8)),
        "n_rows_header": lambda: patched(12, "<I", 5),
        # the session's HELLO said 64 rows per STEP; 4 + 61 is one more
        "n_rows_over_limit": lambda: with_(_e(1, anchor_pos=100, n_rows=61)),
        "rows_before_position_0": lambda: with_(_e(1, anchor_pos=2, n_rows=3)),
        "n_out_over_N": lambda: with_(_e(1, n_out=N + 1, flags=RF_NEED_DRAFT)),
        "sampling_on_greedy": lambda: with_(_e(1, top_k=4, temperature=1.0, seed=3)),
        "seed_on_greedy": lambda: with_(_e(1, seed=3)),
        "unknown_flag": lambda: with_(_e(1, flags=8)),
        "release_with_rows": lambda: with_(_e(1, n_rows=2, flags=RF_RELEASE)),
        "release_with_draft": lambda: with_(_e(1, flags=RF_RELEASE | RF_NEED_DRAFT)),
        "anchor_token_over_vocab": lambda: with_(_e(1, anchor_token=V, flags=RF_NEED_DRAFT)),
        "body_longer": lambda: bytes(_body(d, [first], r)) + b"\0",
        "body_shorter": lambda: bytes(_body(d, [first], r))[:-1],
        "body_short_header": lambda: b"\0" * 16,
        "step_flags": lambda: patched(20, "<I", 1),
        "header_reserved": lambda: patched(24, "<Q", 1),
        "entry_reserved": lambda: patched(32 + 34, "<H", 1),
    }


BAD = sorted(_bad_bodies(type("D", (), {"num_spec": 7, "vocab_size": 512, "row_bytes": 768})())
             .keys())


@pytest.mark.parametrize("case", BAD)
def test_refused_step_changes_nothing(worker: ThreadWorker, drafter: Any, case: str) -> None:
    d = drafter
    victim, control = (session(worker, d, max_rows_per_step=64),
                       session(worker, d, max_rows_per_step=64))
    history = [ReqEntry(slot=s, generation=1, anchor_pos=12, anchor_token=3, n_rows=12)
               for s in (0, 1)]
    rows = [rows_for(d, s, 1, 0, 12) for s in (0, 1)]
    for c in (victim, control):
        ok_step(c, d, history, rows)
    r = victim.request(OP_STEP, _bad_bodies(d)[case]())
    assert r.header == AppHeader(op=OP_STEP, seq=victim.seq, session=victim.session,
                                 body_len=0, status=ST_BAD_FRAME)
    probe = [ReqEntry(slot=s, generation=1, anchor_pos=12, anchor_token=3,
                      flags=RF_NEED_DRAFT) for s in (0, 1)]
    a, b = ok_step(victim, d, probe), ok_step(control, d, probe)
    assert a.status.tolist() == [RS_OK, RS_OK] == b.status.tolist()
    assert a.window_rows.tolist() == b.window_rows.tolist() == [12, 12]
    assert a.draft_ids.tolist() == b.draft_ids.tolist()
    np.testing.assert_allclose(a.confidence, b.confidence, rtol=1e-5)
    victim.close()
    control.close()


# -- sampled sessions (9.2) -------------------------------------------------------------------
def test_sampled_session(worker: ThreadWorker, drafter: Any) -> None:
    from dspark_worker.drafter import SamplingParams

    d = drafter
    with session(worker, d, sample_mode=SAMPLE_TOP32) as c:
        r0, r1, r2 = (rows_for(d, s, 1, 0, 10) for s in range(3))
        entries = [
            ReqEntry(slot=0, generation=1, anchor_pos=10, anchor_token=21, n_rows=10,
                     n_out=5, flags=RF_NEED_DRAFT, seed=42, top_k=8, temperature=0.8,
                     top_p=0.9),
            ReqEntry(slot=1, generation=1, anchor_pos=10, anchor_token=22, n_rows=10,
                     flags=RF_NEED_DRAFT),  # top_k 0: greedy within a sampled session
            ReqEntry(slot=2, generation=1, anchor_pos=10, anchor_token=23, n_rows=10,
                     seed=5, top_k=MAX_TOP_K, temperature=1.0),  # no NEED_DRAFT
        ]
        rep = ok_step(c, d, entries, [r0, r1, r2])
        assert rep.flags == RPF_MARGIN | RPF_SAMPLED
        assert rep.sampled_mask is not None and rep.support_ids is not None
        assert rep.proposal_q is not None
        assert rep.sampled_mask.tolist() == [1, 0, 0]
        psampled.validate(rep.sampled_mask, rep.support_ids, rep.proposal_q, rep.draft_ids,
                          [True, True, False], d.vocab_size, [8, 0, MAX_TOP_K])
        psampled.check_draws(rep.sampled_mask, rep.support_ids, rep.proposal_q, rep.draft_ids,
                             [42, 0, 5], [1, 1, 1], [10, 10, 10])
        assert not rep.support_ids[0, 5:].any() and not rep.proposal_q[0, 5:].any()
        assert not rep.support_ids[1:].any() and not rep.proposal_q[1:].any()
        ref = reference(d, [r0, r1], [10, 10], [21, 22], SamplingParams(
            top_k=[8, 0], temperature=[0.8, 1.0], top_p=[0.9, 0.0], seed=[42, 0],
            generation=[1, 1]))
        check_drafts(rep, 0, 5, ref, 0)
        check_drafts(rep, 1, d.num_spec, ref, 1)
        assert ref.support_ids is not None and ref.proposal_q is not None
        assert rep.support_ids[0, :5].tolist() == ref.support_ids[0, :5].tolist()
        # q comes from float logits: the batched path and the reference differ by a few units
        np.testing.assert_allclose(rep.proposal_q[0, :5].astype(np.int64),
                                   ref.proposal_q[0, :5].astype(np.int64), atol=256)
        # sampled-session shape rules
        for bad in (dict(top_k=MAX_TOP_K + 1, temperature=1.0),
                    dict(top_k=4, temperature=0.0), dict(top_k=4, temperature=1.0, top_p=1.5)):
            e = [ReqEntry(slot=3, generation=1, anchor_pos=4, anchor_token=1,
                          flags=RF_NEED_DRAFT, **bad)]  # type: ignore[arg-type]
            assert c.step(e, b"", d.row_bytes).status == ST_BAD_FRAME


# -- ST_INTERNAL ------------------------------------------------------------------------------
class FailingDrafter:
    """The real drafter, except that drafting anchor token 13 raises."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def draft(self, pool: Any, lanes: Any, anchor_pos: Any, anchor_token: Any, *args: Any,
              **kw: Any) -> Any:
        if 13 in np.asarray(anchor_token).tolist():
            raise RuntimeError("injected device failure")
        return self._inner.draft(pool, lanes, anchor_pos, anchor_token, *args, **kw)


def test_internal_error_drops_only_that_session(drafter: Any) -> None:
    d = drafter
    with thread_worker(FailingDrafter(d)) as w:
        bad, good = session(w, d), session(w, d)
        for c in (bad, good):
            ok_step(c, d, [ReqEntry(slot=0, generation=1, anchor_pos=8, anchor_token=3,
                                    n_rows=8)], [rows_for(d, 0, 1, 0, 8)])
        # both STEPs in one batch: the batched draft fails, each is retried alone
        w.hold_runner()
        e_bad = [ReqEntry(slot=0, generation=1, anchor_pos=8, anchor_token=13,
                          flags=RF_NEED_DRAFT)]
        e_good = [ReqEntry(slot=0, generation=1, anchor_pos=8, anchor_token=3,
                           flags=RF_NEED_DRAFT)]
        bad.send_raw(frame(OP_STEP, bad.next_seq(), bad.session,
                           pack_step(1, e_bad, b"", d.row_bytes)))
        good.send_raw(frame(OP_STEP, good.next_seq(), good.session,
                            pack_step(1, e_good, b"", d.row_bytes)))
        _wait(lambda: w.queued_steps() == 2)
        w.release_runner()
        rb, rg = bad.recv(), good.recv()
        assert rb.header == AppHeader(op=OP_STEP, seq=bad.seq, session=bad.session,
                                      body_len=0, status=ST_INTERNAL)
        assert rg.status == ST_OK and rg.step().status.tolist() == [RS_OK]
        assert bad.step(e_good, b"", d.row_bytes).status == ST_NO_SESSION
        stats = msgspec.json.decode(good.stats().body)
        assert stats["totals"]["sessions_dropped"] == {"internal": 1}
        assert [s["session"] for s in stats["sessions"]] == [good.session]
        bad.close()
        good.close()


def test_a_failure_repeated_by_a_peer_logs_one_traceback(drafter: Any,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    """Each failed STEP drops its session, but a peer can HELLO again and repeat it: one
    traceback per window, the rest counted."""
    d = drafter
    e_bad = [ReqEntry(slot=0, generation=1, anchor_pos=8, anchor_token=13, n_rows=8,
                      flags=RF_NEED_DRAFT)]
    with thread_worker(FailingDrafter(d)) as w, caplog.at_level("ERROR", "dspark_worker"):
        for _ in range(5):
            c = session(w, d)
            assert c.step(e_bad, rows_for(d, 0, 1, 0, 8), d.row_bytes).status == ST_INTERNAL
            c.close()
        failed = [r for r in caplog.records if "failed on the device" in r.getMessage()]
        assert len(failed) == 1 and failed[0].exc_info is not None
        w.call(lambda: w.app.dispatcher._refusal_log.flush(everything=True))  # type: ignore[union-attr]
        assert any("4 more STEP RuntimeError failures on the device were not logged"
                   in r.getMessage() for r in caplog.records)


def _wait(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met")
        time.sleep(0.005)


# -- other ops ----------------------------------------------------------------------------------
def test_ping_stats_and_unknown_op(worker: ThreadWorker, drafter: Any) -> None:
    d = drafter
    with worker.connect() as anon:
        r = anon.request(OP_PING, session=0)
        assert r.header == AppHeader(op=OP_PING, seq=1, session=0, body_len=0, status=ST_OK)
        assert anon.request(OP_PING, b"x", session=0).status == ST_BAD_FRAME
        assert anon.request(99, b"abc", session=0).status == ST_BAD_FRAME  # skipped by length
        raw = bytearray(frame(OP_PING, anon.next_seq(), 0))
        raw[7] = 3  # a request carrying a status
        anon.send_raw(bytes(raw))
        assert anon.recv().status == ST_BAD_FRAME
        assert anon.ping(session=0).status == ST_OK  # the stream stayed aligned
        stats = msgspec.json.decode(anon.stats().body)
    with session(worker, d, client_name="stats-client") as c:
        ok_step(c, d, [ReqEntry(slot=0, generation=1, anchor_pos=4, anchor_token=3,
                                n_rows=4, flags=RF_NEED_DRAFT)], [rows_for(d, 0, 1, 0, 4)])
        r = c.stats(session=c.session)
        assert r.status == ST_OK
        stats = msgspec.json.decode(r.body)
    for key in ("worker_name", "version", "contract_version", "uptime_s", "ready", "device",
                "dtype", "geometry", "drafter_identity", "markov_identity", "limits",
                "connections", "queue_steps", "sessions", "totals", "latency_us", "memory"):
        assert key in stats, key
    assert stats["worker_name"] == "test-worker" and stats["ready"] is True
    assert stats["drafter_identity"] == d.drafter_identity.hex()
    (s,) = stats["sessions"]
    assert s["client_name"] == "stats-client" and s["slots_in_use"] == 1 and s["connected"]
    assert s["steps"] == 1 and s["rows"] == 4 and s["drafted_positions"] == d.num_spec
    t = stats["totals"]
    assert t["steps"] == 1 and t["rows"] == 4 and t["drafted_positions"] == d.num_spec
    assert t["request_status"]["OK"] == 1
    assert t["refusals"]["PING:BAD_FRAME"] == 2 and t["refusals"]["unknown:BAD_FRAME"] == 1
    assert stats["latency_us"]["step"]["count"] == 1 and stats["latency_us"]["step"]["p50_us"] > 0
    assert stats["memory"]["window_bytes"] > 0 and stats["memory"]["rss_bytes"] > 0
