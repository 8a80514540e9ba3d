"""TapRing: the newest W rows per slot, wrap-around, and the worker's window rule (7.2 step 4)."""

from __future__ import annotations

import numpy as np
import pytest
from client_fakes import rows_for
from hypothesis import given, settings
from hypothesis import strategies as st

from dspark_client.ring import TapRing

RB = 32


def test_append_and_wrap_keeps_newest_w() -> None:
    ring = TapRing(2, 4, RB)
    ring.write(1, 0, rows_for(1, 1, 0, 3))
    assert ring.held(1) == (0, 3) and ring.available(1, 3) == 3
    ring.write(1, 3, rows_for(1, 1, 3, 6))  # wraps: positions 4, 5 land at 0, 1
    assert ring.held(1) == (2, 6)
    assert np.array_equal(ring.rows(1, 6, 4), rows_for(1, 1, 2, 6))
    assert ring.available(1, 6) == 4 and ring.available(1, 5) == 3 and ring.available(1, 7) == 0
    assert ring.held(0) == (0, 0)  # other slots untouched


def test_more_rows_than_window_keeps_the_newest() -> None:
    ring = TapRing(1, 4, RB)
    ring.write(0, 10, rows_for(0, 2, 10, 21))
    assert ring.held(0) == (17, 21)
    assert np.array_equal(ring.rows(0, 21, 4), rows_for(0, 2, 17, 21))


def test_gap_restarts_and_overlap_overwrites() -> None:
    ring = TapRing(1, 8, RB)
    ring.write(0, 0, rows_for(0, 1, 0, 5))
    ring.write(0, 7, rows_for(0, 1, 7, 9))  # gap at 5, 6
    assert ring.held(0) == (7, 9)
    ring.write(0, 8, rows_for(0, 9, 8, 10))  # overlap: overwrite from 8
    assert ring.held(0) == (7, 10)
    assert np.array_equal(ring.rows(0, 10, 3),
                          np.concatenate([rows_for(0, 1, 7, 8), rows_for(0, 9, 8, 10)]))
    ring.write(0, 3, rows_for(0, 1, 3, 5))  # before the run's start: restart
    assert ring.held(0) == (3, 5)


def test_truncate_and_gather_errors() -> None:
    ring = TapRing(1, 8, RB)
    ring.write(0, 0, rows_for(0, 1, 0, 6))
    ring.truncate(0, 4)
    assert ring.held(0) == (0, 4)
    with pytest.raises(ValueError, match=r"rows \[2, 6\) are not all held"):
        ring.rows(0, 6, 4)
    ring.clear(0)
    assert ring.available(0, 0) == 0 and ring.held(0) == (0, 0)


def test_bad_shapes() -> None:
    with pytest.raises(ValueError, match="window 0"):
        TapRing(1, 0, RB)
    ring = TapRing(1, 4, RB)
    with pytest.raises(ValueError, match=r"expected \[n, 32\]"):
        ring.write(0, 0, np.zeros((2, 16), np.uint8))
    with pytest.raises(ValueError, match="< 0"):
        ring.write(0, -1, np.zeros((1, RB), np.uint8))


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.lists(st.integers(0, 9), min_size=1, max_size=12))
def test_contiguous_appends_match_a_plain_model(window: int, chunks: list[int]) -> None:
    """Appending chunks of rows always leaves exactly the newest min(W, end) rows."""
    ring = TapRing(1, window, 8)
    pos = 0
    for n in chunks:
        ring.write(0, pos, rows_for(0, 1, pos, pos + n, 8))
        pos += n
        held = min(window, pos)
        assert ring.available(0, pos) == held
        assert np.array_equal(ring.rows(0, pos, held), rows_for(0, 1, pos - held, pos, 8))


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.lists(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 14),
                                                      st.integers(0, 9)),
                                            max_size=4), min_size=1, max_size=8),
       st.booleans())
def test_batch_writes_and_gathers_match_the_slot_by_slot_ones(
        window: int, rounds: list[list[tuple[int, int, int]]], gaps: bool) -> None:
    """write_batch / gather_batch over many slots do what write / gather do slot by slot,
    for starts inside, at the end of, before and past each held run (gaps and overwrites),
    rows beyond W, and rows given with offsets."""
    one, many = TapRing(4, window, 8), TapRing(4, window, 8)
    for r, writes in enumerate(rounds):
        writes = list({s: (s, first, n) for s, first, n in writes}.values())  # distinct slots
        parts, offsets, at = [], [], 0
        for s, first, n in writes:
            rows = rows_for(s, r, first, first + n, 8)
            one.write(s, first, rows)
            if gaps:
                parts.append(np.full((1, 8), 0xEE, np.uint8))
                at += 1
            offsets.append(at)
            parts.append(rows)
            at += n
        if writes:
            many.write_batch(np.array([w[0] for w in writes]), np.array([w[1] for w in writes]),
                             np.array([w[2] for w in writes]), np.concatenate(parts),
                             np.array(offsets) if gaps else None)
        assert np.array_equal(one.start, many.start) and np.array_equal(one.end, many.end)
        slots = np.arange(4)
        ends, ks = many.end.copy(), many.end - many.start
        out = np.empty((int(ks.sum()), 8), np.uint8)
        assert many.gather_batch(slots, ends, ks, out) == len(out)
        want = [one.rows(s, int(ends[s]), int(ks[s])) for s in range(4)]
        assert np.array_equal(out, np.concatenate(want))
