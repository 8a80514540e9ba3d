"""GOODBYE over real sockets (docs/contract.md 4, 6.2, 10): the session and all its slots are
released at once, only by the connection the session is bound to, and a refused GOODBYE
releases nothing."""

from __future__ import annotations

from typing import Any

import msgspec
from worker_harness import ThreadWorker, make_hello, tap_rows, thread_worker

from protocol import wire
from protocol.constants import (
    OP_GOODBYE,
    ST_BAD_FRAME,
    ST_BUSY,
    ST_NO_SESSION,
    ST_OK,
    ST_STALE_SEQ,
)
from protocol.header import AppHeader
from protocol.messages import ReqEntry


def _fill(c: Any, drafter: Any, slot: int) -> None:
    rows = tap_rows(drafter.row_bytes, slot, 1, 0, 4)
    e = [ReqEntry(slot=slot, generation=1, anchor_pos=4, anchor_token=3, n_rows=4)]
    assert c.step(e, rows, drafter.row_bytes).status == ST_OK


def _stats(c: Any) -> dict[str, Any]:
    out: dict[str, Any] = msgspec.json.decode(c.stats().body)
    return out


def test_goodbye_releases_session_and_slots(drafter: Any) -> None:
    with thread_worker(drafter, max_total_slots=8) as w:
        a, b = w.connect(), w.connect()
        assert a.hello(make_hello(drafter, max_slots=8, client_name="bench-a")).status == ST_OK
        _fill(a, drafter, 0)
        _fill(a, drafter, 5)
        # Every lane is held: a second session does not fit.
        assert b.hello(make_hello(drafter, max_slots=8, client_name="bench-b")).status == ST_BUSY
        seq = a.seq + 1
        r = a.request(OP_GOODBYE)
        assert r.header == AppHeader(op=OP_GOODBYE, seq=seq, session=a.session, body_len=0,
                                     status=ST_OK)
        stats = _stats(b)
        assert stats["sessions"] == []
        assert stats["totals"]["sessions_dropped"] == {"goodbye": 1}
        assert stats["memory"]["window_used_bytes"] == 0
        # The lanes are free again at once, not after session_idle_s.
        assert b.hello(make_hello(drafter, max_slots=8, client_name="bench-b")).status == ST_OK
        # The released session is gone: its frames get NO_SESSION.
        assert a.step([], b"", drafter.row_bytes).status == ST_NO_SESSION
        assert a.request(OP_GOODBYE).status == ST_NO_SESSION
        _, text = w.scrape()
        assert 'dspark_worker_sessions_dropped_total{reason="goodbye"} 1.0' in text
        a.close()
        b.close()


def test_goodbye_refusals_release_nothing(worker: ThreadWorker, drafter: Any) -> None:
    owner = worker.connect()
    assert owner.hello(make_hello(drafter)).status == ST_OK
    _fill(owner, drafter, 0)
    # Another connection naming the session: NO_SESSION, the session stays.
    thief = worker.connect()
    thief.seq = owner.seq + 100
    assert thief.request(OP_GOODBYE, session=owner.session).status == ST_NO_SESSION
    # A replayed seq, or a body: refused, the session stays.
    assert owner.request(OP_GOODBYE, seq=owner.seq).status == ST_STALE_SEQ
    assert owner.request(OP_GOODBYE, b"\0\0\0\0").status == ST_BAD_FRAME
    sessions = _stats(owner)["sessions"]
    assert [s["slots_in_use"] for s in sessions] == [1]
    # The wire helper frames the same request.
    seq = owner.next_seq()
    owner.send_raw(wire.goodbye_frame(seq, owner.session))
    assert owner.recv().header.status == ST_OK
    assert _stats(owner)["sessions"] == []
    owner.close()
    thief.close()
