"""A speculators drafter (reduced vocabulary, bonus layout, sliding layers) behind the in-process
worker: two sessions' STEPs queued together run as one device batch and draft what each drafts
alone (runner.py; contract 7.2 step 6), speculators' vectors come back over the socket, and a
sampled session's replies hold 9.2 on target ids."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from worker_harness import WithReplay, make_hello, tap_rows, thread_worker

from dspark_worker.drafter.step import EagerReplay
from protocol import sampled
from protocol.constants import OP_STEP, RF_NEED_DRAFT, SAMPLE_TOP32, ST_OK
from protocol.framing import frame
from protocol.messages import ReqEntry, pack_step

DATA = Path(__file__).resolve().parent / "drafter" / "data" / "speculators_tiny"


def load(name: str) -> Any:
    from dspark_worker.drafter import load_drafter

    return load_drafter(DATA / name, DATA / "target")


def case_rows(name: str) -> tuple[list[dict[str, Any]], np.ndarray]:
    """The checkpoint's cases and their wire rows, in case order (the vectors' bf16 bytes)."""
    import torch
    from safetensors.torch import load_file

    cases = [c for c in json.loads((DATA / "cases.json").read_text())["cases"]
             if c["checkpoint"] == name]
    taps = load_file(str(DATA / "taps.safetensors"))
    rows = np.concatenate([taps[c["taps_key"]].view(torch.int16).numpy().view(np.uint8)
                           .reshape(c["n_rows"], -1) for c in cases])
    return cases, rows


def wait_for(cond: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met")
        time.sleep(0.005)


class CountingReplay(EagerReplay):
    """The CPU stand-in of a captured step, counting its replays."""

    count = 0

    def replay(self) -> None:
        CountingReplay.count += 1
        super().replay()


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
@pytest.mark.parametrize("name", ["gated_bonus_full_sliding", "rnn_anchor_reduced_mixed_noconf"])
def test_sessions_batched_and_the_vectors_over_the_socket(name: str, static: bool) -> None:
    """``static``: the worker prepares the bucketed static step at start-up (--cuda-graphs
    auto, the stand-in replay for CUDA graphs), passes its self-check and drafts every STEP
    through it."""
    d: Any = load(name)
    if static:
        d = WithReplay(d, CountingReplay)
    cases, rows = case_rows(name)
    before = CountingReplay.count
    with thread_worker(d, window=64) as w:
        if static:
            assert d.modes == ["auto"] and d._inner.graphs is not None
            before = CountingReplay.count  # after the self-check's replays
        a, b = w.connect(), w.connect()
        for c in (a, b):
            assert c.hello(make_hello(d, window=64)).status == ST_OK
        entries = [ReqEntry(slot=i, generation=1, anchor_pos=k["anchor_pos"],
                            anchor_token=k["anchor_token"], n_rows=k["n_rows"],
                            flags=RF_NEED_DRAFT) for i, k in enumerate(cases)]
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
        probe_b = [ReqEntry(slot=s, generation=5, anchor_pos=12 + s, anchor_token=290 + s,
                            flags=RF_NEED_DRAFT) for s in (0, 3)]
        alone_b = b.step(probe_b, b"", d.row_bytes).step()
        w.hold_runner()
        for c, ents in ((a, probe_a), (b, probe_b)):
            c.send_raw(frame(OP_STEP, c.next_seq(), c.session,
                             pack_step(1, ents, b"", d.row_bytes)))
        wait_for(lambda: w.queued_steps() == 2)
        w.release_runner()
        ra, rb = a.recv(), b.recv()
        assert ra.status == ST_OK and rb.status == ST_OK
        log = w.call(lambda: list(w.app.runner.batch_log))  # type: ignore[union-attr]
        assert log[-1] == (2, 6)  # two STEPs, six entries, one draft call
        ta, tb = ra.step(), rb.step()
        for i, k in enumerate(cases):
            assert ta.draft_ids[i].tolist() == k["ids"]
        assert tb.draft_ids.tolist() == alone_b.draft_ids.tolist()
        np.testing.assert_allclose(tb.confidence, alone_b.confidence, atol=1e-5)
        a.close()
        b.close()
    # three draft calls (the vectors, b alone, the two together); b's fill drafts nothing
    assert CountingReplay.count - before == (3 if static else 0)


def test_a_sampled_session_over_a_reduced_vocabulary() -> None:
    d = load("vanilla_anchor_reduced")
    cases, rows = case_rows("vanilla_anchor_reduced")
    t2d = d.model.t2d.numpy()
    with thread_worker(d, window=64) as w:
        c = w.connect()
        assert c.hello(make_hello(d, window=64, sample_mode=SAMPLE_TOP32)).status == ST_OK
        entries = [ReqEntry(slot=i, generation=2, anchor_pos=k["anchor_pos"],
                            anchor_token=k["anchor_token"], n_rows=k["n_rows"],
                            flags=RF_NEED_DRAFT, top_k=(32, 5, 0, 9)[i], temperature=0.8,
                            top_p=(0.0, 0.95, 0.0, 0.7)[i], seed=77 + i)
                   for i, k in enumerate(cases)]
        got = c.step(entries, rows, d.row_bytes).step()
        top_k = np.array([e.top_k for e in entries])
        assert got.support_ids is not None and got.proposal_q is not None
        sampled.validate((top_k > 0).astype(np.uint8), got.support_ids, got.proposal_q,
                         got.draft_ids, np.ones(4, dtype=bool), d.vocab_size, top_k)
        sampled.check_draws(top_k > 0, got.support_ids, got.proposal_q, got.draft_ids,
                            np.array([e.seed for e in entries], dtype=np.uint64),
                            [2] * 4, [k["anchor_pos"] for k in cases])
        assert t2d[got.support_ids[got.proposal_q > 0]].all()
        assert got.draft_ids[2].tolist() == cases[2]["ids"]  # the greedy entry
        c.close()
