"""Context rings against CONTRACT 7.2 steps 4 and 5, and incremental drafting against the
from-scratch reference: rows in chunks over many steps (ring wrap, resets, gaps, cuts, more
than W rows at once) must draft what the newest rows drafted from scratch draft."""

from __future__ import annotations

import numpy as np
import pytest
from drafter_support import TINY, make_rows
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dspark_worker.drafter import Drafter, PoolExhaustedError, RingPool
from protocol.errors import BusyError

W = 8


class LaneModel:
    """What a lane must hold, kept as a dict position -> row (a second, plain reading of 7.2)."""

    def __init__(self, window: int) -> None:
        self.window = window
        self.rows: dict[int, np.ndarray] = {}
        self.start = 0
        self.end = 0

    def apply(self, anchor: int, rows: np.ndarray, reset: bool) -> None:
        n = rows.shape[0]
        first = anchor - n
        if reset:
            self.rows, self.start, self.end = {}, first, anchor
        elif n:
            inside = self.end > self.start and self.start <= first <= self.end
            if not inside:
                self.rows, self.start = {}, first
            self.end = anchor
        elif self.end > anchor:
            self.end = anchor
            self.start = min(self.start, anchor)
        for i in range(n):
            self.rows[first + i] = rows[i]
        self.start = max(self.start, self.end - self.window)
        self.rows = {p: r for p, r in self.rows.items() if self.start <= p < self.end}

    def window_rows(self, anchor: int) -> int:
        return min(self.end - self.start, self.window) if self.end == anchor else 0

    def newest(self, anchor: int) -> np.ndarray:
        held = self.window_rows(anchor)
        rows = [self.rows[p] for p in range(anchor - held, anchor)]
        return np.stack(rows) if rows else np.zeros((0, TINY.row_bytes), dtype=np.uint8)


def check_against_reference(drafter: Drafter, pool: RingPool, lanes: np.ndarray,
                            models: list[LaneModel], anchors: list[int],
                            tokens: list[int]) -> None:
    expected_rows = np.array([m.window_rows(a) for m, a in zip(models, anchors, strict=True)])
    np.testing.assert_array_equal(pool.window_rows(lanes, anchors), expected_rows)
    got = drafter.draft(pool, lanes, anchors, tokens)
    ref = drafter.reference_draft([m.newest(a) for m, a in zip(models, anchors, strict=True)],
                                  anchors, tokens)
    np.testing.assert_array_equal(got.window_rows, expected_rows)
    np.testing.assert_array_equal(got.draft_ids, ref.draft_ids)
    np.testing.assert_allclose(got.confidence, ref.confidence, atol=1e-5, rtol=0)
    np.testing.assert_allclose(got.margin, ref.margin, atol=1e-4, rtol=0)


class Harness:
    """A pool with lanes and their models; ``step`` applies one STEP over all lanes."""

    def __init__(self, drafter: Drafter, n_lanes: int, window: int = W, seed: int = 0) -> None:
        self.drafter = drafter
        self.pool = drafter.new_pool(n_lanes + 1, window)
        self.pool.allocate(1)  # lane 0 stays unused, so batches index a non-zero lane
        self.lanes = self.pool.allocate(n_lanes)
        self.models = [LaneModel(window) for _ in range(n_lanes)]
        self.rng = np.random.default_rng(seed)

    def step(self, entries: list[tuple[int, int, bool]]) -> None:
        """entries[i] = (anchor_pos, n_rows, reset) of lane i; fresh random rows."""
        rows = [make_rows(self.rng, n) for _, n, _ in entries]
        for model, (anchor, _, reset), r in zip(self.models, entries, rows, strict=True):
            model.apply(anchor, r, reset)
        self.pool.apply(self.lanes, [e[0] for e in entries], [e[1] for e in entries],
                        [e[2] for e in entries], np.concatenate(rows))

    def check(self, anchors: list[int], tokens: list[int] | None = None) -> None:
        tokens = tokens or [int(t) for t in self.rng.integers(0, TINY.vocab_size, len(anchors))]
        check_against_reference(self.drafter, self.pool, self.lanes, self.models, anchors,
                                tokens)

    def window(self, i: int) -> tuple[int, int]:
        start, end = self.pool.windows(self.lanes[i:i + 1])
        return int(start[0]), int(end[0])


def one_lane(tiny: Drafter) -> Harness:
    return Harness(tiny, 1)


# -- 7.2 step 4, rule by rule -----------------------------------------------------------------


def test_reset_makes_rows_the_window(tiny: Drafter) -> None:
    h = one_lane(tiny)
    h.step([(6, 6, False)])
    h.step([(20, 3, True)])  # RF_RESET: the rows are the window, whatever came before
    assert h.window(0) == (17, 20)
    h.check([20])


def test_reset_without_rows_clears(tiny: Drafter) -> None:
    h = one_lane(tiny)
    h.step([(6, 6, False)])
    h.step([(6, 0, True)])  # new generation with no rows: window cleared
    assert h.pool.window_rows(h.lanes, [6])[0] == 0
    h.check([6])


def test_extend_at_window_end(tiny: Drafter) -> None:
    h = one_lane(tiny)
    h.step([(4, 4, False)])
    h.step([(7, 3, False)])  # rows start at the window's end
    assert h.window(0) == (0, 7)
    h.check([7])


def test_overwrite_from_inside_the_window(tiny: Drafter) -> None:
    h = one_lane(tiny)
    h.step([(7, 7, False)])
    h.step([(5, 2, False)])  # rows [3, 5): overwrite from 3, the window now ends at 5
    assert h.window(0) == (0, 5)
    h.check([5])


def test_overwrite_at_window_start(tiny: Drafter) -> None:
    h = one_lane(tiny)
    h.step([(7, 4, False)])  # window [3, 7)
    h.step([(9, 6, False)])  # rows [3, 9) start exactly at the window's start
    assert h.window(0) == (3, 9)
    h.check([9])


def test_gap_restarts_the_window(tiny: Drafter) -> None:
    h = one_lane(tiny)
    h.step([(5, 5, False)])
    h.step([(9, 2, False)])  # rows [7, 9) leave a gap at 5, 6
    assert h.window(0) == (7, 9)
    h.check([9])


def test_start_before_window_start_restarts(tiny: Drafter) -> None:
    h = one_lane(tiny)
    h.step([(10, 4, False)])  # window [6, 10)
    h.step([(8, 4, False)])  # rows [4, 8) start before 6: the window restarts with them
    assert h.window(0) == (4, 8)
    h.check([8])


def test_cut_without_rows(tiny: Drafter) -> None:
    h = one_lane(tiny)
    h.step([(7, 7, False)])
    h.step([(4, 0, False)])  # no rows, the window ends after the anchor: cut there
    assert h.window(0) == (0, 4)
    h.check([4])


def test_cut_below_window_start_empties(tiny: Drafter) -> None:
    h = one_lane(tiny)
    h.step([(12, 4, False)])  # window [8, 12)
    h.step([(5, 0, False)])
    assert h.pool.window_rows(h.lanes, [5])[0] == 0
    h.check([5])


def test_no_rows_anchor_after_window_keeps_it(tiny: Drafter) -> None:
    h = one_lane(tiny)
    h.step([(5, 5, False)])
    h.step([(9, 0, False)])
    assert h.window(0) == (0, 5)
    assert h.pool.window_rows(h.lanes, [9])[0] == 0  # does not end at 9
    assert h.pool.window_rows(h.lanes, [5])[0] == 5
    h.check([9])


def test_only_newest_w_rows_kept(tiny: Drafter) -> None:
    h = one_lane(tiny)
    h.step([(20, 20, True)])  # 20 rows at once, W = 8
    assert h.window(0) == (12, 20)
    assert h.pool.window_rows(h.lanes, [20])[0] == W
    h.check([20])
    h.step([(23, 3, False)])  # extend across the ring's end
    assert h.window(0) == (15, 23)
    h.check([23])


def test_window_rows_never_above_w_or_anchor(tiny: Drafter) -> None:
    h = one_lane(tiny)
    h.step([(3, 3, False)])
    assert h.pool.window_rows(h.lanes, [3])[0] == 3
    h.step([(40, 12, False)])
    assert h.pool.window_rows(h.lanes, [40])[0] == W


def test_release_forgets_window(tiny: Drafter) -> None:
    h = one_lane(tiny)
    h.step([(5, 5, False)])
    h.pool.release(h.lanes)
    h.models[0] = LaneModel(W)
    assert h.pool.window_rows(h.lanes, [5])[0] == 0
    h.step([(6, 1, False)])  # after release, rows start a fresh window
    assert h.window(0) == (5, 6)
    h.check([6])


def test_anchor_zero_drafts_without_context(tiny: Drafter) -> None:
    h = one_lane(tiny)
    h.step([(0, 0, True)])
    h.check([0])


# -- incremental equals from scratch over long random schedules ---------------------------------


def random_entry(rng: np.random.Generator, model: LaneModel) -> tuple[int, int, bool]:
    s, e = model.start, model.end
    kind = rng.choice(["extend", "extend", "extend", "overwrite", "gap", "before", "reset",
                       "cut", "idle", "long"])
    if kind == "extend":
        n = int(rng.integers(1, 5))
        return e + n, n, False
    if kind == "overwrite" and e > s:
        first = int(rng.integers(s, e + 1))
        n = int(rng.integers(1, 6))
        return first + n, n, False
    if kind == "gap":
        n = int(rng.integers(1, 4))
        return e + int(rng.integers(1, 4)) + n, n, False
    if kind == "before" and s > 0:
        first = int(rng.integers(0, s))
        n = int(rng.integers(1, 4))
        return first + n, n, False
    if kind == "reset":
        anchor = int(rng.integers(0, 60))
        return anchor, int(rng.integers(0, min(anchor, 12) + 1)), True
    if kind == "cut" and e > 0:
        return int(rng.integers(max(0, s - 2), e)), 0, False
    if kind == "long":
        n = int(rng.integers(W + 1, 3 * W))
        return e + n, n, False
    return e, 0, False


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_incremental_equals_reference_random_schedule(tiny: Drafter, seed: int) -> None:
    h = Harness(tiny, 3, seed=seed)
    for _ in range(25):
        entries = [random_entry(h.rng, m) for m in h.models]
        h.step(entries)
        # draft at each anchor; sometimes one past it (no window there: drafts from 0 rows)
        anchors = [a + int(h.rng.random() < 0.1) for a, _, _ in entries]
        h.check(anchors)


@settings(max_examples=20, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.tuples(st.integers(-3, 12), st.integers(0, 12), st.booleans()),
                    min_size=1, max_size=8))
def test_incremental_equals_reference_hypothesis(tiny: Drafter,
                                                 ops: list[tuple[int, int, bool]]) -> None:
    """ops: (offset of the first row from the window's end, n_rows, reset)."""
    h = Harness(tiny, 1, seed=len(ops))
    for offset, n, reset in ops:
        first = max(0, h.models[0].end + offset)
        h.step([(first + n, n, reset)])
        h.check([first + n])


def test_batch_equals_each_lane_alone(tiny: Drafter) -> None:
    """A ragged batch (windows of 0, 3, 8 rows and one cut short) drafts what each lane alone
    drafts."""
    h = Harness(tiny, 4, seed=5)
    h.step([(0, 0, True), (3, 3, True), (30, 30, True), (9, 9, True)])
    h.step([(0, 0, False), (3, 0, False), (30, 0, False), (6, 0, False)])
    anchors, tokens = [0, 3, 30, 6], [1, 2, 3, 4]
    together = tiny.draft(h.pool, h.lanes, anchors, tokens)
    for i in range(4):
        alone = tiny.draft(h.pool, h.lanes[i:i + 1], anchors[i:i + 1], tokens[i:i + 1])
        np.testing.assert_array_equal(together.draft_ids[i], alone.draft_ids[0])
        np.testing.assert_allclose(together.confidence[i], alone.confidence[0], atol=1e-5)
    # and lanes in any order, not contiguous, read the same rings
    order = np.array([2, 0, 3, 1])
    shuffled = tiny.draft(h.pool, h.lanes[order], np.array(anchors)[order],
                          np.array(tokens)[order])
    np.testing.assert_array_equal(shuffled.draft_ids, together.draft_ids[order])


def test_fewer_positions_than_block(tiny: Drafter) -> None:
    h = Harness(tiny, 2, seed=9)
    h.step([(5, 5, True), (7, 7, True)])
    got = tiny.draft(h.pool, h.lanes, [5, 7], [3, 4], num_spec=3)
    ref = tiny.reference_draft([h.models[0].newest(5), h.models[1].newest(7)], [5, 7], [3, 4],
                               num_spec=3)
    assert got.draft_ids.shape == (2, 3)
    np.testing.assert_array_equal(got.draft_ids, ref.draft_ids)
    with pytest.raises(ValueError, match="num_spec 7"):
        tiny.draft(h.pool, h.lanes, [5, 7], [3, 4], num_spec=7)


# -- the pool -----------------------------------------------------------------------------------


def test_allocate_free_and_capacity(tiny: Drafter) -> None:
    pool = tiny.new_pool(4, W)
    a = pool.allocate(3)
    assert a.tolist() == [0, 1, 2]
    assert pool.free_lanes == 1
    with pytest.raises(PoolExhaustedError, match="1 free lanes of 4; 2 requested") as info:
        pool.allocate(2)
    assert isinstance(info.value, BusyError)
    assert (info.value.value, info.value.limit) == (2, 1)
    pool.free(a[1:2])
    assert pool.allocate(2).tolist() == [1, 3]
    assert pool.free_lanes == 0
    pool.free([0])
    with pytest.raises(ValueError, match=r"lanes \[0\] are not allocated"):
        pool.window_rows([0], [0])
    with pytest.raises(ValueError, match=r"lanes \[7\] outside \[0, 4\)"):
        pool.release([7])


def test_nbytes_formula(tiny: Drafter) -> None:
    pool = tiny.new_pool(5, 32)
    c = tiny.config
    per_lane = 2 * c.num_hidden_layers * 32 * c.num_key_value_heads * c.head_dim * 4  # fp32
    assert pool.bytes_per_lane == per_lane
    assert pool.nbytes == 5 * per_lane


def test_apply_refuses_bad_input_and_changes_nothing(tiny: Drafter) -> None:
    h = Harness(tiny, 2, seed=3)
    h.step([(4, 4, True), (4, 4, True)])
    before = h.pool.windows(h.lanes)
    rows = make_rows(h.rng, 3)
    with pytest.raises(ValueError, match="rows hold"):
        h.pool.apply(h.lanes, [6, 6], [2, 2], [False, False], rows)
    with pytest.raises(ValueError, match="n_rows 9 outside"):
        h.pool.apply(h.lanes, [6, 8], [0, 9], [False, False], make_rows(h.rng, 9))
    with pytest.raises(ValueError, match="repeat"):
        h.pool.apply(np.array([h.lanes[0]] * 2), [5, 5], [1, 2], [False, False], rows)
    after = h.pool.windows(h.lanes)
    np.testing.assert_array_equal(before[0], after[0])
    np.testing.assert_array_equal(before[1], after[1])


def test_apply_takes_a_bytes_buffer(tiny: Drafter) -> None:
    h = one_lane(tiny)
    rows = make_rows(h.rng, 3)
    h.pool.apply(h.lanes, [3], [3], [True], rows.tobytes())
    h.models[0].apply(3, rows, True)
    h.check([3])
