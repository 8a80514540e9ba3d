"""DFlash drafters behind the in-process worker: two sessions' STEPs batched as one device call
draft what each drafts alone, the vectors come back over the socket (eager and the static step),
and a drafter without a confidence head says so everywhere predicted acceptance would show:
HelloReply's CAP_NO_CONFIDENCE, every reply's RPF_NO_CONFIDENCE, STATS and /metrics."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_worker_metrics import samples, summed, value
from worker_harness import (
    WithReplay,
    check_vectors_and_batching,
    make_hello,
    tap_rows,
    thread_worker,
)

from dspark_worker.drafter.step import EagerReplay
from protocol import sampled
from protocol.constants import (
    CAP_NO_CONFIDENCE,
    RF_NEED_DRAFT,
    RPF_MARGIN,
    RPF_NO_CONFIDENCE,
    RPF_SAMPLED,
    SAMPLE_TOP32,
    ST_OK,
)
from protocol.messages import ReqEntry

DATA = Path(__file__).resolve().parent / "drafter" / "data" / "dflash_tiny"


def load(name: str) -> Any:
    from dspark_worker.drafter import load_drafter

    target = json.loads((DATA / "cases_extra.json").read_text())["checkpoints"].get(name) or \
        json.loads((DATA / "cases.json").read_text())["checkpoints"][name]
    return load_drafter(DATA / name, DATA / target["target"], record_identities=False)


def case_rows(name: str) -> tuple[list[dict[str, Any]], np.ndarray]:
    import torch
    from safetensors.torch import load_file

    suffix = "_extra" if name.startswith("extra_") else ""
    cases = [c for c in json.loads((DATA / f"cases{suffix}.json").read_text())["cases"]
             if c["checkpoint"] == name]
    taps = load_file(str(DATA / f"taps{suffix}.safetensors"))
    rows = np.concatenate([taps[c["taps_key"]].view(torch.int16).numpy().view(np.uint8)
                           .reshape(c["n_rows"], -1) for c in cases])
    return cases, rows


@pytest.mark.parametrize(("name", "static"), [("spec_dflash2_b5", True),
                                              ("extra_zlab2_scaled_yarn", False)])
def test_sessions_batched_and_the_vectors_over_the_socket(name: str, static: bool) -> None:
    d: Any = load(name)
    if static:
        d = WithReplay(d, EagerReplay)
    cases, rows = case_rows(name)
    with thread_worker(d, window=64) as w:
        if static:
            assert d.modes == ["auto"] and d._inner.graphs is not None
        check_vectors_and_batching(w, d, cases, rows, window=64, probe_token=290)


def test_no_confidence_on_the_wire_in_stats_and_metrics() -> None:
    """A head-less drafter: HelloReply has CAP_NO_CONFIDENCE, greedy and sampled replies carry
    RPF_NO_CONFIDENCE with confidence 1.0 where drafted (0 elsewhere, as 6.3 requires); after a
    judged block STATS says confidence_head false and shows no predicted figure, and /metrics
    has dspark_worker_confidence_head 0 and no predicted series."""
    d = load("zlab_nested_sliding_b6")
    with thread_worker(d, window=64) as w:
        for mode in (0, SAMPLE_TOP32):
            with w.connect() as c:
                rep = c.hello(make_hello(d, window=64, sample_mode=mode))
                assert rep.status == ST_OK and rep.hello().capabilities & CAP_NO_CONFIDENCE
                entries = [ReqEntry(slot=0, generation=1, anchor_pos=10, anchor_token=3,
                                    n_rows=10, flags=RF_NEED_DRAFT, n_out=3,
                                    top_k=8 if mode else 0, temperature=0.9 if mode else 0.0,
                                    seed=5 if mode else 0),
                           ReqEntry(slot=1, generation=1, anchor_pos=4, anchor_token=3,
                                    n_rows=4)]
                rows = np.concatenate([tap_rows(d.row_bytes, 0, 1, 0, 10),
                                       tap_rows(d.row_bytes, 1, 1, 0, 4)])
                got = c.step(entries, rows, d.row_bytes).step()
                assert got.flags == RPF_MARGIN | RPF_NO_CONFIDENCE | (RPF_SAMPLED if mode else 0)
                assert got.confidence[0].tolist() == [1.0] * 3 + [0.0] * (d.num_spec - 3)
                assert got.confidence[1].tolist() == [0.0] * d.num_spec
                if mode:
                    assert got.support_ids is not None and got.proposal_q is not None
                    sampled.validate(np.array([1, 0], np.uint8), got.support_ids,
                                     got.proposal_q, got.draft_ids, np.array([True, False]),
                                     d.vocab_size, np.array([8, 0]))
                # the block judged: 1 accepted (anchor + 1 + the bonus token)
                nxt = ReqEntry(slot=0, generation=1, anchor_pos=12, anchor_token=4, n_rows=2,
                               flags=RF_NEED_DRAFT, top_k=8 if mode else 0,
                               temperature=0.9 if mode else 0.0, seed=5 if mode else 0)
                assert c.step([nxt], tap_rows(d.row_bytes, 0, 1, 10, 2),
                              d.row_bytes).status == ST_OK
                st = json.loads(c.stats(c.session).body)
        assert st["confidence_head"] is False
        assert st["geometry"]["capabilities"] & CAP_NO_CONFIDENCE
        for acc in (st["totals"]["acceptance"], st["sessions"][-1]["acceptance"]):
            assert acc["rounds"] >= 1 and acc["confidence_head"] is False
            assert acc["predicted_by_position"] is None
            assert acc["predicted_acceptance_by_position"] is None
        status, text = w.scrape()
        assert status == 200
        s = samples(text)
        assert value(s, "dspark_worker_confidence_head") == 0
        assert summed(s, "dspark_worker_acceptance_rounds_total") == 2  # over its versions
        assert "dspark_worker_acceptance_predicted_total" not in text
        # dspark-client stats against this worker says it in words, with no predicted figure
        from dspark_client.cli import main

        out = io.StringIO()
        host, port = w.address
        assert main(["--endpoint", f"tcp://{host}:{port}", "stats"], out=out) == 0
        said = out.getvalue()
        assert "no confidence head (confidences predict nothing)" in said
        assert "nothing predicted (the drafter has no confidence head)" in said
        assert "predicted 1.00" not in said


def test_a_drafter_with_a_head_keeps_its_predictions() -> None:
    from dspark_worker.drafter import embedded_default

    d = embedded_default()
    with thread_worker(d) as w, w.connect() as c:
        rep = c.hello(make_hello(d))
        assert rep.status == ST_OK and not rep.hello().capabilities & CAP_NO_CONFIDENCE
        entry = ReqEntry(slot=0, generation=1, anchor_pos=10, anchor_token=3, n_rows=10,
                         flags=RF_NEED_DRAFT)
        got = c.step([entry], tap_rows(d.row_bytes, 0, 1, 0, 10), d.row_bytes).step()
        assert got.flags == RPF_MARGIN
        st = json.loads(c.stats(c.session).body)
        assert st["confidence_head"] is True
        assert st["totals"]["acceptance"]["predicted_by_position"] == [0.0] * d.num_spec
        s = samples(w.scrape()[1])
        assert value(s, "dspark_worker_confidence_head") == 1
