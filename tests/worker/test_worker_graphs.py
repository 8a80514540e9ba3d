"""The worker's start-up preparation of the draft step (--cuda-graphs): its metric, its one
log line on a fallback, and STEPs served either way. There is no GPU here, so the drafter is
handed the CPU stand-in replay (the same static step a CUDA graph captures); with it the whole
path runs: buckets up to max_slots, the self-check, the fallback."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest
from worker_harness import (
    TEST_MAX_SLOTS,
    ThreadWorker,
    WithReplay,
    make_hello,
    tap_rows,
    worker_config,
)

from dspark_worker.config import ConfigError, WorkerConfig
from dspark_worker.drafter.step import EagerReplay, Replay, bucket_sizes
from protocol.constants import RF_NEED_DRAFT, ST_IDENTITY, ST_OK
from protocol.identity import markov_walk_identity
from protocol.messages import ReqEntry


class OffByOne(EagerReplay):
    """A wrong step: every first id off by one."""

    def replay(self) -> None:
        super().replay()
        ids = self.outputs["draft_ids"].clone()
        ids[:, 0] += 1
        self.outputs["draft_ids"] = ids


def metric(w: ThreadWorker, name: str) -> float:
    status, text = w.scrape()
    assert status == 200
    line = next(ln for ln in text.splitlines() if ln.startswith(name + " "))
    return float(line.split()[1])


def one_step(w: ThreadWorker, d: Any) -> Any:
    with w.connect() as c:
        assert c.hello(make_hello(d)).status == ST_OK
        rows = tap_rows(d.row_bytes, 0, 1, 0, 6)
        entries = [ReqEntry(slot=0, generation=1, anchor_pos=6, anchor_token=3, n_rows=6,
                            flags=RF_NEED_DRAFT)]
        rep = c.step(entries, rows, d.row_bytes)
        assert rep.status == ST_OK
        return rep


@pytest.mark.parametrize("replay", [EagerReplay, OffByOne])
def test_worker_prepares_the_step_and_falls_back(drafter: Any, replay: type[Replay],
                                                 caplog: pytest.LogCaptureFixture) -> None:
    d = WithReplay(drafter.with_draft_topk(0), replay)  # a Drafter of its own, same model
    caplog.set_level(logging.INFO, logger="dspark_worker")
    w = ThreadWorker(worker_config(), d)
    try:
        graphs = 2 * len(bucket_sizes(TEST_MAX_SLOTS))
        assert d.modes == ["auto"]
        lines = [r.getMessage() for r in caplog.records if "cuda graphs" in r.getMessage()]
        assert len(lines) == 1, lines
        if replay is OffByOne:
            assert metric(w, "dspark_worker_cuda_graph_fallbacks_total") == 1.0
            assert metric(w, "dspark_worker_cuda_graphs") == 0.0
            assert "drafting eagerly" in lines[0] and "bucket 16 (greedy): draft_ids" in lines[0]
            assert d._inner.graphs is None
        else:
            assert metric(w, "dspark_worker_cuda_graph_fallbacks_total") == 0.0
            assert metric(w, "dspark_worker_cuda_graphs") == graphs
            assert f"{graphs} captured for buckets 1,2,4,8,16" in lines[0]
            assert d._inner.graphs is not None
        rep = one_step(w, d)
        # the served drafts are the eager drafter's in both cases
        pool = drafter.new_pool(1, 32)
        lane = pool.allocate(1)
        pool.apply(lane, [6], [6], [True], tap_rows(d.row_bytes, 0, 1, 0, 6))
        want = drafter.draft(pool, lane, [6], [3])
        np.testing.assert_array_equal(rep.step().draft_ids, want.draft_ids)
    finally:
        w.stop()


def test_draft_topk_reaches_the_hello_identity(drafter: Any) -> None:
    """--dspark-draft-topk: the worker's Markov identity is the candidate walk's, so a HELLO
    for the full walk is refused and one for the candidate walk served."""
    d = drafter.with_draft_topk(64)
    w = ThreadWorker(worker_config(cuda_graphs="off"), d)
    try:
        with w.connect() as c:
            assert c.hello(make_hello(drafter)).status == ST_IDENTITY
        ours = markov_walk_identity(drafter.markov_identity, 64)
        with w.connect() as c:
            assert c.hello(make_hello(drafter, markov_identity=ours)).status == ST_OK
    finally:
        w.stop()


@pytest.mark.parametrize(("field", "value", "said"), [
    ("cuda_graphs", "on", "cuda_graphs: 'on' is not one of auto, off"),
    ("dspark_draft_topk", -1, "dspark_draft_topk: -1 is not a non-negative integer"),
])
def test_flags_refused(field: str, value: object, said: str) -> None:
    with pytest.raises(ConfigError, match=said):
        WorkerConfig(**{field: value})  # type: ignore[arg-type]
