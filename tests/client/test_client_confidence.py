"""A drafter without a confidence head, on the engine's side: ``client.has_confidence`` from the
HelloReply's CAP_NO_CONFIDENCE, ``RoundResult.has_confidence`` from each reply's
RPF_NO_CONFIDENCE (a reply that disagrees with the HELLO is refused), no predicted acceptance in
the client's metrics or in ``dspark-client stats``, and the depth policy's static length."""

from __future__ import annotations

import logging
import math
from typing import Any

import numpy as np
import pytest
from client_fakes import FakeWorker, make_hello, make_hello_reply
from test_client_rounds import Engine, cfg

import dspark_client as dc
from dspark_client.cli import stats_summary
from protocol import wire
from protocol.acceptance import AcceptanceTotals

CAPS = wire.CAP_TAPS_BF16 | wire.CAP_TOP32 | wire.CAP_MARGIN


def client_of(fw: FakeWorker) -> tuple[dc.RemoteDraftClient, Engine]:
    c = dc.RemoteDraftClient(cfg(fw.endpoint), make_hello())
    assert c.has_confidence is None  # nothing known before a HELLO is accepted
    assert c.wait_ready(3.0), c.last_error
    return c, Engine(dc.DraftRounds(c))


@pytest.mark.parametrize("has_confidence", [True, False])
def test_the_flag_from_hello_to_every_round(has_confidence: bool) -> None:
    logged: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: logged.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("dspark_client")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    caps = CAPS | (0 if has_confidence else wire.CAP_NO_CONFIDENCE)
    with FakeWorker(hello_reply=make_hello_reply(capabilities=caps),
                    reply_flags=0 if has_confidence else wire.RPF_NO_CONFIDENCE) as fw:
        c, eng = client_of(fw)
        try:
            assert c.has_confidence is has_confidence
            said = "its drafter has no confidence head (confidences predict nothing"
            assert any(said in m for m in logged) is not has_confidence
            for slot in (0, 1):
                eng.admit(slot, 9)
            res = eng.run([0, 1])
            assert res.ok and res.has_confidence is has_confidence
            eng.accept(0, 1)
            eng.accept(1, 0)
            assert eng.run([0, 1]).ok  # judges the first round's blocks
            metrics = dc.client_metrics(c)
            assert metrics["dspark_client_acceptance_rounds_total"] == 2
            assert ("dspark_client_acceptance_predicted_total" in metrics) is has_confidence
            summary = c.acceptance.summary()
            assert summary["confidence_head"] is has_confidence
            assert (summary["predicted_acceptance_by_position"] is None) is not has_confidence
            failed = eng.rounds._failed(2, "test")
            assert failed.has_confidence is has_confidence
        finally:
            c.close()
            logger.removeHandler(handler)
            logger.setLevel(level)


@pytest.mark.parametrize(("caps", "flags"), [(CAPS | wire.CAP_NO_CONFIDENCE, 0),
                                             (CAPS, wire.RPF_NO_CONFIDENCE)])
def test_a_reply_that_disagrees_with_the_hello_is_refused(caps: int, flags: int) -> None:
    with FakeWorker(hello_reply=make_hello_reply(capabilities=caps), reply_flags=flags) as fw:
        c, eng = client_of(fw)
        try:
            eng.admit(0, 9)
            res = eng.run([0])
            assert not res.ok and c.stats.get("bad_replies") == 1
            assert "RPF_NO_CONFIDENCE disagrees with the worker's HELLO" in str(
                c.stats.get("last_bad_reply"))
        finally:
            c.close()


def test_the_depth_policy_falls_back_to_a_static_length() -> None:
    sps = dc.SpsTable([1, 64], [50.0, 40.0])
    drafted = np.array([4, 2, 0])
    for schedule in (dc.schedule_greedy, dc.schedule_global):
        s = schedule(None, sps, drafted)
        assert s.lengths.tolist() == [4, 2, 0] and s.batch_tokens == 9
        assert math.isnan(s.expected_tokens) and math.isnan(s.score)  # nothing predicts them
        assert schedule(None, sps, drafted, static_length=3).lengths.tolist() == [3, 2, 0]
        with pytest.raises(ValueError, match="needs num_drafted"):
            schedule(None, sps)
    # the table's largest batch caps B: position by position across the requests
    small = dc.SpsTable([1, 7], [50.0, 40.0])
    assert dc.schedule_static([4, 4, 4], small).lengths.tolist() == [2, 1, 1]
    with pytest.raises(ValueError, match="static_length -1 is not a count"):
        dc.schedule_static([1], static_length=-1)
    # with confidences the schedule is the confidence-scheduled one, as before
    conf = np.array([[0.9, 0.1, 0.1, 0.1]] * 3)
    assert dc.schedule_greedy(conf, sps, drafted).lengths.tolist() != [4, 2, 0]


def test_stats_summary_says_the_head_is_absent() -> None:
    t = AcceptanceTotals(3, has_confidence=False)
    t.drafted_hist[:], t.lengths[:] = [0, 0, 2, 2], [1, 1, 2, 0]
    acc = t.summary()
    assert acc["predicted_acceptance_by_position"] is None and acc["confidence_head"] is False
    st: dict[str, Any] = {"totals": {"acceptance": acc}, "sessions": [],
                          "confidence_head": False, "geometry": {"capabilities": CAPS}}
    text = stats_summary(st, "tcp://w:1")
    assert "no confidence head (confidences predict nothing)" in text
    assert "by position 0.75 0.50 0.00; nothing predicted (the drafter has no confidence" \
           " head)" in text
    assert "predicted 1.00" not in text
    assert "no confidence head" not in stats_summary(
        {"totals": {"acceptance": AcceptanceTotals(3).summary()}, "sessions": [],
         "confidence_head": True, "geometry": {"capabilities": CAPS}}, "tcp://w:1")
