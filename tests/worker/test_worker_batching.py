"""Cross-session batching and shedding (runner.py; docs/contract.md 7.2 step 6, RS_SHED)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from worker_harness import Client, ThreadWorker, make_hello, tap_rows, thread_worker

from dspark_worker.runner import LaneOp, Runner, StepItem
from dspark_worker.sessions import Session
from protocol.constants import (
    OP_STEP,
    RF_NEED_DRAFT,
    RS_NO_WINDOW,
    RS_OK,
    RS_SHED,
    ST_OK,
)
from protocol.framing import frame
from protocol.messages import ReqEntry, pack_step


def wait_for(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met")
        time.sleep(0.005)


def history(d: Any, c: Client, slots: list[int], seed: int) -> None:
    """Give each slot a window of rows unique to (seed, slot)."""
    entries = [ReqEntry(slot=s, generation=seed, anchor_pos=10 + s, anchor_token=1,
                        n_rows=10 + s) for s in slots]
    rows = np.concatenate([tap_rows(d.row_bytes, s, seed, 0, 10 + s) for s in slots])
    assert c.step(entries, rows, d.row_bytes).status == ST_OK


def probe_entries(slots: list[int], seed: int) -> list[ReqEntry]:
    return [ReqEntry(slot=s, generation=seed, anchor_pos=10 + s, anchor_token=(7 * s) % 500,
                     flags=RF_NEED_DRAFT) for s in slots]


def send_step(c: Client, d: Any, entries: list[ReqEntry]) -> None:
    c.send_raw(frame(OP_STEP, c.next_seq(), c.session, pack_step(1, entries, b"",
                                                                 d.row_bytes)))


def test_two_sessions_in_one_batch_draft_as_each_alone(worker: ThreadWorker,
                                                       drafter: Any) -> None:
    d = drafter
    a, b = worker.connect(), worker.connect()
    for c in (a, b):
        assert c.hello(make_hello(d)).status == ST_OK
    history(d, a, [0, 1, 2], seed=3)
    history(d, b, [0, 4], seed=5)
    pa, pb = probe_entries([0, 1, 2], 3), probe_entries([0, 4], 5)
    # Alone: one STEP per batch.
    alone_a = a.step(pa, b"", d.row_bytes).step()
    alone_b = b.step(pb, b"", d.row_bytes).step()
    batches = worker.call(lambda: worker.app.runner.batches)  # type: ignore[union-attr]
    # Together: both queued while the runner is held, then one batch, one drafter call.
    worker.hold_runner()
    send_step(a, d, pa)
    send_step(b, d, pb)
    wait_for(lambda: worker.queued_steps() == 2)
    worker.release_runner()
    ra, rb = a.recv(), b.recv()
    assert ra.status == ST_OK and rb.status == ST_OK
    log = worker.call(lambda: list(worker.app.runner.batch_log))  # type: ignore[union-attr]
    assert worker.call(lambda: worker.app.runner.batches) == batches + 1  # type: ignore
    assert log[-1] == (2, 5)  # two STEPs, five entries, one draft call
    for together, alone in ((ra.step(), alone_a), (rb.step(), alone_b)):
        assert together.status.tolist() == alone.status.tolist()
        assert together.window_rows.tolist() == alone.window_rows.tolist()
        assert together.draft_ids.tolist() == alone.draft_ids.tolist()
        np.testing.assert_allclose(together.confidence, alone.confidence, rtol=1e-5,
                                   atol=1e-6)
        assert together.margin is not None and alone.margin is not None
        np.testing.assert_allclose(together.margin, alone.margin, rtol=1e-4, atol=1e-5)
    a.close()
    b.close()


def test_shedding_applies_rows_and_skips_drafting(drafter: Any) -> None:
    d = drafter
    with thread_worker(d, shed_queue_steps=1) as w:
        a, b = w.connect(), w.connect()
        for c in (a, b):
            assert c.hello(make_hello(d)).status == ST_OK
        history(d, a, [0], seed=1)
        w.hold_runner()
        send_step(a, d, probe_entries([0], 1))  # queue depth 0 on arrival: drafts
        wait_for(lambda: w.queued_steps() == 1)
        rows = tap_rows(d.row_bytes, 2, 9, 0, 6)
        shed = [ReqEntry(slot=2, generation=9, anchor_pos=6, anchor_token=1, n_rows=6,
                         flags=RF_NEED_DRAFT),
                ReqEntry(slot=3, generation=9, anchor_pos=6, anchor_token=1,
                         flags=RF_NEED_DRAFT)]
        b.send_raw(frame(OP_STEP, b.next_seq(), b.session,
                         pack_step(1, shed, rows.tobytes(), d.row_bytes)))
        wait_for(lambda: w.queued_steps() == 2)
        w.release_runner()
        ra, rb = a.recv().step(), b.recv().step()
        assert ra.status.tolist() == [RS_OK] and ra.draft_ids.any()
        assert rb.status.tolist() == [RS_SHED, RS_NO_WINDOW]  # no window is not "shed"
        assert rb.window_rows.tolist() == [6, 0]
        assert not rb.draft_ids.any() and not rb.confidence.any()
        # the shed STEP's rows were applied: its window is there for the next STEP
        again = b.step([ReqEntry(slot=2, generation=9, anchor_pos=6,
                                                anchor_token=1, flags=RF_NEED_DRAFT)],
                       b"", d.row_bytes).step()
        assert again.status.tolist() == [RS_OK] and again.window_rows.tolist() == [6]
        a.close()
        b.close()


def test_a_session_is_never_twice_in_one_batch() -> None:
    """The batch is cut before a second STEP (or lane operation) of a session in it."""
    async def run() -> list[list[Any]]:
        runner = Runner(type("D", (), {"num_spec": 7})(), None, window=8,  # type: ignore
                        complete=lambda item: None)
        x, y = (Session(i, _hello(), 1, 1, 0.0) for i in (1, 2))
        ops: list[Any] = [_item(x), _item(y), LaneOp("allocate", y), _item(x), _item(y),
                          LaneOp("free", x)]
        for op in ops:
            runner.submit(op)
        batches = []
        while runner._queue:
            batches.append(runner._take_batch())
        return batches

    batches = asyncio.run(run())
    sessions = [[(type(op).__name__, op.session.session_id) for op in b] for b in batches]
    assert sessions == [
        [("StepItem", 1), ("StepItem", 2)],  # cut: y's lane op must follow y's draft
        [("LaneOp", 2), ("StepItem", 1), ("StepItem", 2)],  # a lane op before a STEP is fine
        [("LaneOp", 1)],  # x's lanes are freed only after x's STEP has drafted
    ]


def _hello() -> Any:
    from protocol.messages import Hello

    return Hello(sample_mode=0, window=8, num_spec=7, max_slots=2, max_rows_per_step=8,
                 row_bytes=768, vocab_size=512, n_taps=3, hidden=128,
                 drafter_identity=bytes(32), markov_identity=bytes(32))


def _item(s: Session) -> StepItem:
    from protocol.header import AppHeader
    from protocol.messages import decode_step

    view = decode_step(pack_step(1, [], b"", 768))
    return StepItem(None, AppHeader(op=OP_STEP), s, view, None, None,  # type: ignore[arg-type]
                    bytearray(64), 0.0, False)



def test_concurrent_engines_get_the_drafts_of_their_own_history(worker: ThreadWorker,
                                                                drafter: Any) -> None:
    """Four engines at once, each the same history under its own session: every STEP is
    answered in order and every engine sees the same drafts, however they were batched."""
    import threading

    d = drafter
    results: dict[int, list[list[list[int]]]] = {}
    errors: list[BaseException] = []

    def engine(k: int) -> None:
        try:
            with worker.connect() as c:
                assert c.hello(make_hello(d)).status == ST_OK
                out = []
                for step in range(12):
                    anchor = 4 + step
                    rows = tap_rows(d.row_bytes, 0, 1, anchor - 1, 1)
                    entries = [ReqEntry(slot=0, generation=1, anchor_pos=anchor,
                                        anchor_token=step, n_rows=1, flags=RF_NEED_DRAFT),
                               ReqEntry(slot=1, generation=1, anchor_pos=anchor,
                                        anchor_token=step + 1, flags=RF_NEED_DRAFT)]
                    r = c.step(entries, rows, d.row_bytes)
                    assert r.status == ST_OK and r.header.seq == c.seq
                    out.append(r.step().draft_ids.tolist())
                results[k] = out
        except BaseException as exc:  # reported below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=engine, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert len(results) == 4 and all(results[k] == results[0] for k in results)
    log = worker.call(lambda: list(worker.app.runner.batch_log))  # type: ignore[union-attr]
    assert max(steps for steps, _ in log) >= 1
