"""SIGTERM's drain (contract sections 5 and 6.2): HELLO and STEP answered ST_DRAINING with
nothing applied and the connection closed after the reply, a STEP accepted before the drain
answered normally, PING still answered, and the drain ending once the connections are gone or
quiet rather than after ``drain_s``."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from worker_harness import ThreadWorker, make_hello, tap_rows, worker_config

from protocol.constants import RF_NEED_DRAFT, RF_RESET, ST_DRAINING, ST_OK
from protocol.framing import frame
from protocol.messages import ReqEntry, pack_step
from protocol.wire import OP_STEP


def _entry(n: int) -> list[ReqEntry]:
    return [ReqEntry(slot=0, generation=1, anchor_pos=n, anchor_token=3, n_rows=n,
                     flags=RF_NEED_DRAFT | RF_RESET)]


def test_drain_refuses_hello_and_step_and_finishes_accepted_steps(drafter: Any) -> None:
    d = drafter
    w = ThreadWorker(worker_config(drain_s=30.0), d)
    busy, idle, late = w.connect(), w.connect(), None
    try:
        assert busy.hello(make_hello(d, client_name="busy")).status == ST_OK
        assert idle.hello(make_hello(d, client_name="idle")).status == ST_OK
        assert idle.step(_entry(6), tap_rows(d.row_bytes, 0, 1, 0, 6), d.row_bytes).status == ST_OK
        # A STEP accepted before the signal, held in the runner's queue.
        w.hold_runner()
        busy.send_raw(frame(OP_STEP, busy.next_seq(), busy.session,
                            pack_step(7, _entry(5), tap_rows(d.row_bytes, 0, 1, 0, 5).tobytes(),
                                      d.row_bytes)))
        deadline = time.monotonic() + 10
        while w.queued_steps() < 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        t0 = time.monotonic()
        stopping = asyncio.run_coroutine_threadsafe(w.app.stop(), w.loop)
        while not w.call(lambda: w.app.dispatcher.draining):  # type: ignore[union-attr]
            time.sleep(0.01)
        assert idle.ping().status == ST_OK  # PING is answered while draining
        # STEP: refused, not applied, and the connection closes after the reply.
        before = w.call(lambda: w.app.metrics.totals["steps"])
        r = idle.step(_entry(6), tap_rows(d.row_bytes, 0, 1, 0, 6), d.row_bytes)
        assert r.status == ST_DRAINING and r.body == b""
        assert idle.is_closed()
        assert w.call(lambda: w.app.metrics.totals["steps"]) == before
        # HELLO on a new connection: refused with the worker's HelloReply, then closed.
        late = w.connect()
        r = late.hello(make_hello(d, client_name="late"))
        assert r.status == ST_DRAINING and r.hello().worker_name == "test-worker"
        assert late.is_closed()
        # Counted as the drain's closes, not as broken streams (DSparkBadStreams).
        registry = w.app.metrics.registry  # type: ignore[union-attr]
        closed = w.call(lambda: {reason: registry.get_sample_value(
            "dspark_worker_connections_closed_total", {"reason": reason}) or 0.0
            for reason in ("draining", "version")})
        assert closed == {"draining": 2.0, "version": 0.0}
        # The accepted STEP is drafted and answered once the runner goes on.
        w.release_runner()
        r = busy.recv()
        assert r.status == ST_OK and r.step().step_id == 7
        busy.close()
        # No connection left: the drain ends long before drain_s.
        assert stopping.result(20) == 0
        assert time.monotonic() - t0 < 15
    finally:
        for c in (busy, idle, late):
            if c is not None:
                c.close()
        w.loop.call_soon_threadsafe(w.loop.stop)


def test_drain_ends_when_connections_go_quiet(drafter: Any) -> None:
    w = ThreadWorker(worker_config(drain_s=30.0), drafter)
    c = w.connect()
    try:
        assert c.hello(make_hello(drafter, client_name="quiet")).status == ST_OK
        t0 = time.monotonic()
        code = w.stop()  # the connection stays open and silent
        assert code == 0
        assert 1.9 < time.monotonic() - t0 < 15  # the quiet period, not drain_s
        assert c.is_closed()
    finally:
        c.close()
