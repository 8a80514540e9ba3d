"""Depth policy: survival, Algorithm 1 (greedy, stop at the first drop) and the production
global-argmax variant, with crafted SPS tables and outputs computed by hand."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dspark_client.schedule import (
    ConfidenceHistory,
    SpsTable,
    expected_tokens_per_s,
    schedule_global,
    schedule_greedy,
    survival,
)

CONF = [[0.9, 0.8, 0.5],
        [0.6, 0.5, 0.9]]
# survival: r0 0.9 0.72 0.36 ; r1 0.6 0.3 0.27
# order: (0,0) .9, (0,1) .72, (1,0) .6, (0,2) .36, (1,1) .3, (1,2) .27
TABLE = SpsTable([1, 4, 8], [100.0, 100.0, 60.0])  # 100 up to 4 tokens, then -10 per token


def test_survival_is_the_cumulative_product() -> None:
    s = survival(CONF)
    assert np.allclose(s, [[0.9, 0.72, 0.36], [0.6, 0.3, 0.27]])
    s = survival(CONF, num_drafted=[3, 1])
    assert np.allclose(s, [[0.9, 0.72, 0.36], [0.6, 0.0, 0.0]])


def test_algorithm_1_by_hand() -> None:
    # m=0: B 2, tau 2,    SPS 100 -> 200
    # m=1: B 3, tau 2.9,  SPS 100 -> 290   rise
    # m=2: B 4, tau 3.62, SPS 100 -> 362   rise
    # m=3: B 5, tau 4.22, SPS  90 -> 379.8 rise
    # m=4: B 6, tau 4.58, SPS  80 -> 366.4 drop: stop, 3 admitted: (0,0) (0,1) (1,0)
    sch = schedule_greedy(CONF, TABLE)
    assert sch.lengths.tolist() == [2, 1]
    assert sch.batch_tokens == 5
    assert sch.expected_tokens == pytest.approx(4.22)
    assert sch.score == pytest.approx(379.8)
    assert schedule_global(CONF, TABLE).lengths.tolist() == [2, 1]  # same optimum here


def test_greedy_stops_at_a_local_dip_global_does_not() -> None:
    table = SpsTable([2, 3, 4, 5, 6], [100.0, 60.0, 60.0, 60.0, 55.0])
    conf = [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]
    # m=0: 2 * 100 = 200; m=1: 3 * 60 = 180 (drop: greedy stops with nothing admitted)
    # m=2: 4 * 60 = 240; m=3: 5 * 60 = 300 (global max); r1's zero survivals are no candidates
    greedy = schedule_greedy(conf, table)
    assert greedy.lengths.tolist() == [0, 0] and greedy.score == pytest.approx(200.0)
    best = schedule_global(conf, table)
    assert best.lengths.tolist() == [3, 0]
    assert best.batch_tokens == 5 and best.score == pytest.approx(300.0)


def test_a_tie_is_not_a_rise() -> None:
    table = SpsTable([1, 100], [50.0, 50.0])
    # a zero-survival candidate adds nothing and is never admitted
    assert schedule_greedy([[0.5, 0.0]], table).lengths.tolist() == [1]
    # survival 1 with a flat table: every candidate raises the score
    assert schedule_greedy(np.ones((2, 3)), table).lengths.tolist() == [3, 3]
    # the global variant takes the smallest B among equal maxima
    flat = SpsTable([1, 3, 5], [60.0, 40.0, 30.0])
    # R=1: m=0: 1*60 = 60; m=1 (s=.5): 1.5*50 = 75; m=2 (s=.25): 1.75*40 = 70 -> m=1
    assert schedule_global([[0.5, 0.5]], flat).lengths.tolist() == [1]


def test_batch_never_exceeds_the_table() -> None:
    table = SpsTable([1, 4], [100.0, 100.0])
    sch = schedule_greedy(np.ones((2, 3)), table)
    assert sch.batch_tokens == 4 and sch.lengths.tolist() == [2, 0]  # ties: request order
    assert schedule_global(np.ones((5, 3)), table).lengths.tolist() == [0] * 5  # R > table


def test_num_drafted_limits_candidates() -> None:
    table = SpsTable([1, 100], [50.0, 50.0])
    sch = schedule_greedy(np.ones((3, 4)), table, num_drafted=[4, 0, 2])
    assert sch.lengths.tolist() == [4, 0, 2]


def test_empty_batch() -> None:
    sch = schedule_greedy(np.zeros((0, 4)), TABLE)
    assert sch.lengths.tolist() == [] and sch.batch_tokens == 0 and sch.score == 0.0


@pytest.mark.parametrize("conf, words", [
    ([[0.5, 1.2]], r"confidence\[0, 1\] = 1.2"),
    ([[np.nan, 0.5]], r"confidence\[0, 0\] = nan"),
    ([0.5, 0.5], "must be"),
])
def test_bad_confidences(conf: Any, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        schedule_greedy(conf, TABLE)


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 6), st.integers(1, 5), st.data())
def test_properties(R: int, N: int, data: Any) -> None:
    conf = np.array(data.draw(st.lists(st.lists(st.floats(0, 1), min_size=N, max_size=N),
                                       min_size=R, max_size=R)))
    n_pts = data.draw(st.integers(1, 5))
    xs = sorted(data.draw(st.sets(st.integers(1, 60), min_size=n_pts, max_size=n_pts)))
    ys = data.draw(st.lists(st.floats(1, 1000), min_size=n_pts, max_size=n_pts))
    table = SpsTable(xs, ys)
    g, best = schedule_greedy(conf, table), schedule_global(conf, table)
    for sch in (g, best):
        assert ((sch.lengths >= 0) & (sch.lengths <= N)).all()
        assert sch.batch_tokens == R + int(sch.lengths.sum())
        if table.max_batch_tokens >= R:
            assert sch.batch_tokens <= table.max_batch_tokens
            assert sch.score == pytest.approx(expected_tokens_per_s(sch.lengths, conf, table))
    assert best.score >= g.score - 1e-9  # the global argmax is never worse


def test_sps_table_validation_and_json(tmp_path: Any) -> None:
    t = SpsTable([1, 2, 4], [10.0, 8.0, 4.0])
    assert t(3) == pytest.approx(6.0) and t(0.5) == 10.0 and t(10) == 4.0
    path = tmp_path / "sps.json"
    path.write_text(json.dumps({"batch_tokens": [1, 64, 256], "steps_per_s": [90, 80, 40]}))
    loaded = SpsTable.load(path)
    assert loaded.max_batch_tokens == 256 and loaded(160) == pytest.approx(60.0)
    for raw, words in [
        ({"batch_tokens": [1, 2]}, "missing steps_per_s"),
        ({"batch_tokens": [1, 2], "steps_per_s": [1.0]}, "2 batch_tokens but 1 steps_per_s"),
        ({"batch_tokens": [2, 2], "steps_per_s": [1, 1]}, r"batch_tokens\[1\] = 2 does not rise"),
        ({"batch_tokens": [0, 2], "steps_per_s": [1, 1]}, r"batch_tokens\[0\] = 0.0 is not"),
        ({"batch_tokens": [1.5], "steps_per_s": [1]}, "not an integer"),
        ({"batch_tokens": [1, 2], "steps_per_s": [1, -1]}, r"steps_per_s\[1\] = -1.0"),
        ({"batch_tokens": "1,2", "steps_per_s": [1, 1]}, "must be a list of numbers"),
        ({"batch_tokens": [], "steps_per_s": []}, "non-empty"),
        ([1, 2], "expected a JSON object"),
    ]:
        with pytest.raises(ValueError, match=words):
            SpsTable.from_dict(raw)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match=r"bad\.json"):
        SpsTable.load(bad)


def test_confidence_history_lags_two_rounds() -> None:
    h = ConfidenceHistory(max_slots=4, num_spec=2, lag=2)
    prior = [0.5, 0.25]
    assert h.lagged([1], [7], prior).tolist() == [prior]
    h.push([1, 2], [7, 1], [[0.9, 0.8], [0.1, 0.1]])  # round t-2
    assert h.lagged([1], [7], prior).tolist() == [prior]  # one round is not two
    h.push([1], [7], [[0.7, 0.6]])  # round t-1
    assert h.lagged([1, 2], [7, 1], prior).tolist() == [[0.9, 0.8], prior]
    h.push([1], [7], [[0.3, 0.2]])
    assert h.lagged([1], [7], prior).tolist() == [[0.7, 0.6]]
    h.push([1], [8], [[0.4, 0.4]])  # a new request in slot 1 starts over
    assert h.lagged([1], [8], prior).tolist() == [prior]
    sch = schedule_global(h.lagged([1, 2], [8, 1], prior), TABLE)
    assert sch.lengths.shape == (2,)
