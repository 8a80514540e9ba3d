"""The Gemma4 drafter behind the in-process worker: two sessions' STEPs queued together run as
one device batch and draft exactly what each drafts alone (runner.py; contract 7.2 step 6),
and DeepSpec's vectors come back over the socket."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from worker_harness import make_hello, tap_rows, thread_worker

from protocol.constants import OP_STEP, RF_NEED_DRAFT, ST_OK
from protocol.framing import frame
from protocol.messages import ReqEntry, pack_step

DATA = Path(__file__).resolve().parent / "drafter" / "data" / "gemma4_tiny"


@pytest.fixture(scope="module")
def gemma4() -> Any:
    from dspark_worker.drafter import load_drafter

    return load_drafter(DATA)


def wait_for(cond: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met")
        time.sleep(0.005)


def test_sessions_batched_and_the_vectors_over_the_socket(gemma4: Any) -> None:
    from dspark_worker.drafter import encode_bf16_rows

    d = gemma4
    cases = json.loads((DATA / "cases.json").read_text())
    with thread_worker(d) as w:
        a, b = w.connect(), w.connect()
        for c in (a, b):
            assert c.hello(make_hello(d)).status == ST_OK
        # session a: DeepSpec's two cases in slots 0 and 1; session b: its own rows
        rows = np.concatenate([encode_bf16_rows(np.asarray(k["taps"], np.float32))
                               for k in cases])
        entries = [ReqEntry(slot=i, generation=1, anchor_pos=k["anchor_pos"],
                            anchor_token=k["anchor_token"], n_rows=9, flags=RF_NEED_DRAFT)
                   for i, k in enumerate(cases)]
        got = a.step(entries, rows, d.row_bytes).step()
        for i, k in enumerate(cases):
            assert got.draft_ids[i].tolist() == k["ids"]
            np.testing.assert_allclose(got.confidence[i], k["confidence"], atol=1e-4)
        rows_b = np.concatenate([tap_rows(d.row_bytes, s, 5, 0, 12 + s) for s in (0, 3)])
        fill_b = [ReqEntry(slot=s, generation=5, anchor_pos=12 + s, anchor_token=1,
                           n_rows=12 + s) for s in (0, 3)]
        assert b.step(fill_b, rows_b, d.row_bytes).status == ST_OK
        probe_a = [ReqEntry(slot=i, generation=1, anchor_pos=k["anchor_pos"],
                            anchor_token=k["anchor_token"], flags=RF_NEED_DRAFT)
                   for i, k in enumerate(cases)]
        probe_b = [ReqEntry(slot=s, generation=5, anchor_pos=12 + s, anchor_token=20 + s,
                            flags=RF_NEED_DRAFT) for s in (0, 3)]
        alone_b = b.step(probe_b, b"", d.row_bytes).step()
        w.hold_runner()
        for c, entries in ((a, probe_a), (b, probe_b)):
            c.send_raw(frame(OP_STEP, c.next_seq(), c.session,
                             pack_step(1, entries, b"", d.row_bytes)))
        wait_for(lambda: w.queued_steps() == 2)
        w.release_runner()
        ra, rb = a.recv(), b.recv()
        assert ra.status == ST_OK and rb.status == ST_OK
        log = w.call(lambda: list(w.app.runner.batch_log))  # type: ignore[union-attr]
        assert log[-1] == (2, 4)  # two STEPs, four entries, one draft call
        ta, tb = ra.step(), rb.step()
        for i, k in enumerate(cases):
            assert ta.draft_ids[i].tolist() == k["ids"]
        assert tb.draft_ids.tolist() == alone_b.draft_ids.tolist()
        np.testing.assert_allclose(tb.confidence, alone_b.confidence, atol=1e-5)
        a.close()
        b.close()
