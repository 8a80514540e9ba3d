"""A speculators drafter (reduced vocabulary, bonus layout, sliding layers) behind the in-process
worker: two sessions' STEPs queued together run as one device batch and draft what each drafts
alone (runner.py; contract 7.2 step 6), speculators' vectors come back over the socket, and a
sampled session's replies hold 9.2 on target ids."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from worker_harness import WithReplay, check_vectors_and_batching, make_hello, thread_worker

from dspark_worker.drafter.step import EagerReplay
from protocol import sampled
from protocol.constants import RF_NEED_DRAFT, SAMPLE_TOP32, ST_OK
from protocol.messages import ReqEntry

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
        check_vectors_and_batching(w, d, cases, rows, window=64, probe_token=290)
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
