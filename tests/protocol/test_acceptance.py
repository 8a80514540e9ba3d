"""``protocol.acceptance.Acceptance`` against a plain per-entry reading of its rule, on random
engine-like STEP sequences: the log, judged in one pass whenever it fills or a reader asks
(also between a STEP and its reply), counts exactly what judging every entry on its own does.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol import wire
from protocol.acceptance import LOG_STEPS, Acceptance
from protocol.messages import ENTRY_DTYPE

MAX_SLOTS, N = 5, 4
ENDS = wire.RF_RESET | wire.RF_RELEASE


class Reference:
    """The rule entry by entry (slots distinct within a STEP, as 7.2 step 3 requires): an
    entry judges its slot's previous entry if that came in the
    STEP just before, with the same generation, no RESET or RELEASE on this one, and
    0 <= anchor - (old anchor + 1) <= k (u32) with k > 0."""

    def __init__(self) -> None:
        self.state: dict[int, dict[str, Any]] = {}
        self.lengths = np.zeros(N + 1, np.int64)
        self.drafted = np.zeros(N + 1, np.int64)
        self.verified = np.zeros(N + 1, np.int64)
        self.predicted = np.zeros(N, np.float64)
        self.steps = 0

    def step(self, entries: list[tuple[int, int, int, int]],
             reply: list[tuple[int, list[float]]] | None) -> None:
        i = self.steps
        self.steps += 1
        for e, (slot, gen, anchor, flags) in enumerate(entries):
            if slot >= MAX_SLOTS:
                continue
            p = self.state.get(slot)
            if (p is not None and p["step"] == i - 1 and p["gen"] == gen
                    and not flags & ENDS and p["k"] > 0):
                a = (anchor - p["a1"]) & 0xFFFFFFFF
                if a <= p["k"]:
                    self.lengths[a] += 1
                    self.drafted[p["k"]] += 1
                    self.predicted += np.cumprod(np.asarray(p["conf"], np.float64))
                    if p["verified"] >= 0:
                        self.verified[p["verified"]] += 1
            k, conf = reply[e] if reply is not None else (0, [0.0] * N)
            self.state[slot] = {"step": i, "gen": gen, "a1": (anchor + 1) & 0xFFFFFFFF,
                                "k": k, "conf": np.asarray(conf, np.float32),
                                "verified": -1}

    def record_verified(self, slots: list[int], counts: list[int]) -> None:
        for s, c in zip(slots, counts, strict=True):
            p = self.state.get(s)
            if p is not None and p["step"] == self.steps - 1:
                p["verified"] = min(c, p["k"]) if p["k"] > 0 else -1


def entries_of(rows: list[tuple[int, int, int, int]]) -> np.ndarray:
    e = np.zeros(len(rows), ENTRY_DTYPE)
    for i, (slot, gen, anchor, flags) in enumerate(rows):
        e[i]["slot"], e[i]["generation"], e[i]["anchor_pos"], e[i]["flags"] = (
            slot, gen, anchor, flags)
    return e


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_the_log_counts_what_judging_each_entry_alone_counts(seed: int) -> None:
    rng = np.random.default_rng(seed)
    acc, ref = Acceptance(MAX_SLOTS, N), Reference()
    anchor = dict.fromkeys(range(MAX_SLOTS + 1), 10)
    gen = dict.fromkeys(range(MAX_SLOTS + 1), 1)
    k_last = dict.fromkeys(range(MAX_SLOTS + 1), 0)
    order = [0, 1, 2]
    for _ in range(int(rng.integers(1, 2 * LOG_STEPS + 20))):
        if rng.integers(10) == 0:  # another slot set, or order (one past max_slots at times)
            order = rng.permutation(MAX_SLOTS + 1)[:int(rng.integers(0, 5))].tolist()
        rows = []
        for s in order:
            how = int(rng.integers(10))
            if how < 7:  # accepted a of the last block, then the target's own token
                anchor[s] += int(rng.integers(0, k_last[s] + 1)) + 1
            else:  # a gap, or a step back (a preemption's replay)
                anchor[s] = max(0, anchor[s] + int(rng.integers(-3, 13)))
            flags = int(rng.choice([wire.RF_RESET, wire.RF_RELEASE, 0])) if how == 9 else 0
            if rng.integers(20) == 0:
                gen[s] += 1
            rows.append((s, gen[s], anchor[s], flags))
        reply = None
        if rng.integers(10):  # answered
            reply = []
            for s, *_ in rows:
                k = int(rng.integers(0, N + 1))
                reply.append((k, [float(rng.choice([0.25, 0.5, 1.0])) if j < k else 0.0
                                  for j in range(N)]))
                k_last[s] = k
        acc.judge(entries_of(rows))
        if rng.integers(30) == 0:
            acc.flush()  # a reader between the STEP and its reply
        if reply is not None:
            acc.keep(np.array([k for k, _ in reply], np.int64),
                     np.array([c for _, c in reply], np.float32).reshape(len(rows), N))
        ref.step(rows, reply)
        if rows and rng.integers(4) == 0:
            slots = sorted({s for s, *_ in rows if s < MAX_SLOTS})
            counts = rng.integers(0, N + 3, len(slots)).tolist()
            acc.record_verified(slots, counts)
            ref.record_verified(slots, counts)
        if rng.integers(40) == 0:
            acc.totals  # noqa: B018 - a read judges the log
    acc.flush()
    t = acc.totals
    assert t.lengths.tolist() == ref.lengths.tolist()
    assert t.drafted_hist.tolist() == ref.drafted.tolist()
    assert t.verified_hist.tolist() == ref.verified.tolist()
    np.testing.assert_allclose(t.predicted, ref.predicted, rtol=1e-9)


def test_a_long_run_is_judged_without_a_reader() -> None:
    """Past LOG_STEPS STEPs the log is judged on its own: the totals read at the end hold
    every block, and the log never holds more than LOG_STEPS STEPs."""
    acc = Acceptance(2, N)
    a = 10
    for _ in range(3 * LOG_STEPS):
        acc.judge(entries_of([(0, 1, a, 0), (1, 1, a, 0)]))
        acc.keep(np.array([N, N]), np.full((2, N), 0.5, np.float32))
        assert len(acc._log_n) <= LOG_STEPS
        a += 2  # one draft accepted, then the target's token
    acc.flush()
    t = acc.totals
    assert t.rounds == 2 * (3 * LOG_STEPS - 1)
    assert t.lengths[1] == t.rounds and t.accepted.tolist() == [t.rounds, 0, 0, 0]


def test_steps_the_worker_refuses_are_taken_without_an_error() -> None:
    """A client judges what it sends, refused STEPs too (7.2 step 3: duplicate slots, slots
    past max_slots): they raise nothing, and the chains of well-formed STEPs go on."""
    acc = Acceptance(2, N)
    conf = np.full((3, N), 0.5, np.float32)
    acc.observe(entries_of([(0, 1, 10, 0), (1, 1, 10, 0)]), np.array([N, N]), conf[:2])
    acc.observe(entries_of([(1, 1, 12, 0), (1, 1, 13, 0), (7, 1, 3, 0)]), np.array([N] * 3),
                conf)
    acc.observe(entries_of([(0, 1, 12, 0), (1, 1, 14, 0)]), np.array([N, N]), conf[:2])
    acc.observe(entries_of([(0, 1, 14, 0), (1, 1, 16, 0)]), np.array([N, N]), conf[:2])
    acc.flush()
    assert acc.totals.rounds >= 2 and acc.totals.lengths[1] >= 2
