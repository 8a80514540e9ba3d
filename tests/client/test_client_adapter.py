"""What the engine plugins share beside the options (``dspark_client.adapter``): rank 0's slot
table, the round that never raises and the fill of a round's drafts and confidences."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from dspark_client.adapter.engine import GuardedRounds, fill_round
from dspark_client.adapter.slots import NO_SLOT, SlotTable
from dspark_client.rounds import RoundResult


def test_a_row_takes_a_fresh_generation_and_gives_it_back_by_request() -> None:
    t = SlotTable(max_rows=4, max_slots=2)
    t.add(3)
    slot = int(t.of_index[3])
    assert slot == 0 and t.generation[slot] == 1 and t.index_of[slot] == 3
    t.name(t.of_index[[3]], ["r1"])
    t.add(3)  # its request left without finishing: the row's old slot is released
    assert t.take_release() == [slot] and t.take_release() == []
    again = int(t.of_index[3])
    t.name(t.of_index[[3]], ["r2"])
    t.finished(["r1", "r2"])  # r1's slot is gone already; r2's goes now
    assert t.take_release() == [again] and t.of_index[3] == NO_SLOT
    t.add(1)
    assert t.generation[int(t.of_index[1])] >= 2  # a slot taken again is a new generation


def test_a_request_back_under_another_row_drops_its_old_slot() -> None:
    t = SlotTable(max_rows=4, max_slots=4)
    t.add(0)
    t.name(t.of_index[[0]], ["r"])
    old = int(t.of_index[0])
    t.add(2)
    t.name(t.of_index[[2]], ["r"])
    assert t.take_release() == [old] and t.of_request["r"] == int(t.of_index[2])


def test_rows_beyond_the_slots_get_none_and_one_warning(caplog: pytest.LogCaptureFixture
                                                        ) -> None:
    t = SlotTable(max_rows=3, max_slots=1, engine="SGLang")
    with caplog.at_level(logging.WARNING, "dspark_client.adapter"):
        for row in range(3):
            t.add(row)
    assert t.of_index.tolist() == [0, NO_SLOT, NO_SLOT] and t.refused == 2
    assert len(caplog.records) == 1 and "SGLang" in caplog.records[0].getMessage()


def _result(ok: bool, n: int, N: int) -> RoundResult:
    return RoundResult(ok=ok, reason=None if ok else "timeout",
                       num_drafted=np.full(n, N, np.int32), status=np.zeros(n, np.uint8),
                       draft_ids=np.arange(n * N, dtype=np.int32).reshape(n, N) + 1,
                       confidence=np.full((n, N), 0.5, np.float32))


def test_a_round_fills_its_requests_rows_and_a_failed_one_leaves_zeros() -> None:
    K = 3
    out = np.zeros((3, 2 * K), np.int64)
    fill_round(out, np.array([0, 2]), _result(True, 2, 5))
    np.testing.assert_array_equal(out[:, :K], [[1, 2, 3], [0, 0, 0], [6, 7, 8]])
    assert (out[[0, 2], K:].astype(np.int32).view(np.float32) == 0.5).all()
    assert not out[1].any()
    failed = np.zeros((2, 2 * K), np.int64)
    fill_round(failed, np.array([0, 1]), _result(False, 2, 5))
    assert not failed.any()


def test_a_round_that_raises_gives_zeros_and_is_logged_once(caplog: pytest.LogCaptureFixture
                                                            ) -> None:
    guard = GuardedRounds(logging.getLogger("test.adapter"))

    def broken(out: np.ndarray) -> None:
        out[:] = 7
        raise RuntimeError("an adapter bug")

    with caplog.at_level(logging.ERROR, "test.adapter"):
        for _ in range(3):
            assert not guard.run(np.zeros((2, 4), np.int64), broken).any()
    assert guard.errors == 3 and len(caplog.records) == 1


@pytest.mark.parametrize(("raw", "says"), [
    ({"timeout_ms": -1}, "ENGINE_OPTIONS.timeout_ms = -1"),
    ({"window": 0}, "ENGINE_OPTIONS.window = 0"),
    ({"nope": 1}, "ENGINE_OPTIONS: unknown option 'nope'"),
    ([], "ENGINE_OPTIONS must be a JSON object")])
def test_the_options_name_the_place_an_engine_takes_them_from(raw: object, says: str) -> None:
    from dspark_client.adapter.options import parse_options

    with pytest.raises(ValueError) as exc:
        parse_options(raw, where="ENGINE_OPTIONS")
    assert str(exc.value).startswith(says), exc.value
    assert parse_options({"window": 8}, where="ENGINE_OPTIONS").window == 8
