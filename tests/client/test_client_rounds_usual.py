"""The usual round's short cut (``DraftRounds`` keeps the last round when every slot went out
whole and stayed valid; a round with the same slots, order and generations whose rows continue
it skips the per-slot decisions): it sends the same STEPs and gives the same results as the
general path (``fast_path = False``), on histories that take it most rounds and leave it in
every way, and it is taken when, and only when, the round continues the last one.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from client_fakes import MAX_SLOTS, N, W, rows_for
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_client_rounds_batch import History, as_batch, make_pair, same_result

from dspark_client.rounds import DraftRounds, SlotRequest
from protocol import wire


def count_general(rounds: DraftRounds) -> list[int]:
    """Counts the rounds that took the general plan (``_plan``), in a one-item list."""
    calls = [0]
    plan = rounds._plan

    def counted(*args: Any) -> Any:
        calls[0] += 1
        return plan(*args)

    rounds._plan = counted  # type: ignore[method-assign]
    return calls


class Pair:
    """The same engine history through a DraftRounds with the short cut (a) and one without
    (b), each against its own fake worker; every round's STEP and result are compared."""

    def __init__(self, sampled: bool = False, max_rows: int = 4 * W) -> None:
        (self.la, self.ca, self.ra), (self.lb, self.cb, self.rb) = make_pair(sampled, max_rows)
        self.rb.fast_path = False
        self.general = count_general(self.ra)
        self.hist = History()
        self.sampled = sampled

    def round(self, slots: list[int], n_out: int = N, skip: dict[int, int] | None = None,
              sampling: dict[int, tuple[int, int, float, float]] | None = None,
              release: list[int] | None = None, form: str = "batch") -> bool:
        """One round; True when (a) took the short cut."""
        skip = skip or {}
        samp = None
        if self.sampled:
            samp = [(sampling or {}).get(s, (1000 + s, 4, 0.8, 0.9)) for s in slots]
        reqs = self.hist.requests(slots, [n_out] * len(slots), [skip.get(s, 0) for s in slots],
                                  samp)
        rel = release or []
        before = self.general[0]
        if form == "list":
            res_a = self.ra.run(reqs, release=rel)
        else:
            res_a = as_batch(self.ra, reqs, rel, None)
        res_b = as_batch(self.rb, reqs, rel, None)
        same_result(res_a, res_b)
        assert self.la.steps == self.lb.steps
        for s in rel:
            if s not in slots:
                self.hist.gen.pop(s), self.hist.anchor.pop(s), self.hist.fresh.pop(s)
        for s in slots:
            self.hist.accept(s, 1)
        return self.general[0] == before

    def close(self) -> None:
        assert self.la.fw.errors == [] and self.lb.fw.errors == []
        assert np.array_equal(self.ra.ring.start, self.rb.ring.start)
        assert np.array_equal(self.ra.ring.end, self.rb.ring.end)
        for link, c in ((self.la, self.ca), (self.lb, self.cb)):
            c.close()
            link.fw.close()


@pytest.fixture
def pair() -> Any:
    p = Pair()
    yield p
    p.close()


def start(p: Pair, slots: list[int]) -> None:
    for s in slots:
        p.hist.admit(s, 3 + s)
    assert not p.round(slots)  # every slot resyncs: the general path


def test_the_short_cut_is_taken_on_the_usual_round(pair: Pair) -> None:
    start(pair, [0, 1, 2])
    assert pair.round([0, 1, 2])
    assert pair.round([0, 1, 2], form="list")  # the adapter's rounds too
    assert pair.round([0, 1, 2], n_out=0)  # another depth continues all the same
    assert pair.round([0, 1, 2])


@pytest.mark.parametrize("leave", [
    "order", "new_slot", "fewer_slots", "new_generation", "short_rows", "release", "forget",
    "reconnect", "budget", "failed", "more_than_w", "worker_reset"])
def test_every_way_out_of_the_short_cut(pair: Pair, leave: str) -> None:
    """The round after the departure takes the general path (what it sends is compared with
    the reference's, round by round), and the short cut comes back once a round again left
    every slot whole and valid."""
    slots = [0, 1, 2]
    start(pair, slots)
    assert pair.round(slots)
    kw: dict[str, Any] = {}
    if leave == "order":
        slots = [2, 0, 1]
    elif leave == "new_slot":
        pair.hist.admit(5, 4)
        slots = [0, 1, 2, 5]
    elif leave == "fewer_slots":
        slots = [0, 2]
    elif leave == "new_generation":
        pair.hist.admit(1, 6)
    elif leave == "short_rows":  # slot 1 hands over only its newest row: a gap, a resync
        kw = dict(skip={1: 1})
    elif leave == "release":
        kw = dict(release=[1])
        slots = [0, 2]
    elif leave == "forget":
        pair.ra.forget(1), pair.rb.forget(1)
    elif leave == "reconnect":
        for c in (pair.ca, pair.cb):
            c.mark_failed("test: reconnect")
            assert c.connect_now(), c.last_error
    elif leave == "budget":
        pair.ra.row_budget = pair.rb.row_budget = W  # as size refusals do
        for s in slots:  # 6 new rows each: two slots wait
            pair.hist.accept(s, 3)
    elif leave == "failed":
        pair.la.busy = pair.lb.busy = True
        assert pair.round(slots)  # this one still goes the short way, and fails
        assert pair.ra._usual is None
    elif leave == "more_than_w":  # slot 0 commits more than a window in one round
        pair.hist.accept(0, W + 2)
    elif leave == "worker_reset":  # the worker forgets every window: NO_WINDOW replies
        for c in (pair.ca, pair.cb):
            assert c.simple_request(wire.OP_RESET, wire.pack_reset([]))[0] == 0
        assert pair.round(slots)  # sent the short way; the statuses end it
    assert not pair.round(slots, **kw)
    if leave == "budget":
        assert not pair.round(slots)  # the slots left out catch up first
        assert not pair.round(slots)
        pair.ra.row_budget = pair.rb.row_budget = pair.ra.max_rows_per_step
    for _ in range(3):
        if pair.round(slots):
            break
    else:
        raise AssertionError(f"the short cut did not come back after {leave}")
    assert pair.round(slots)


def test_sampling_changes_on_the_short_cut() -> None:
    """A usual round whose sampling columns differ from the last round's writes them again
    (and checks them); the same columns are neither checked nor written again."""
    p = Pair(sampled=True)
    try:
        start(p, [0, 1, 2])
        assert p.round([0, 1, 2])
        assert p.round([0, 1, 2], sampling={1: (77, 32, 1.5, 1.0)})
        assert p.round([0, 1, 2], sampling={1: (77, 32, 1.5, 1.0), 2: (5, 0, 0.0, 0.0)})
        assert p.round([0, 1, 2])
        with pytest.raises(ValueError, match="slot 1: temperature nan must be"):
            p.ra.run([SlotRequest(slot=s, generation=p.hist.gen[s],
                                  anchor_pos=p.hist.anchor[s], anchor_token=1, n_out=N,
                                  seed=1, top_k=4, temperature=float("nan") if s == 1 else 1.0,
                                  top_p=0.9) for s in (0, 1, 2)])
        assert p.round([0, 1, 2])  # the refused round changed nothing
    finally:
        p.close()


def test_a_usual_round_without_sampling_after_one_with() -> None:
    """On a sampled session, a usual round given no sampling columns sends greedy entries
    (sampling fields zero), as the general path does, though the kept entries had them."""
    p = Pair(sampled=True)
    try:
        start(p, [0, 1])
        assert p.round([0, 1])
        for r in (p.ra, p.rb):
            # The rows committed since the last round (History keeps them owed).
            rows = np.concatenate([rows_for(s, 1, p.hist.anchor[s] - 2, p.hist.anchor[s])
                                   for s in (0, 1)])
            res = r.run_batch([0, 1], 1, [p.hist.anchor[s] for s in (0, 1)], 5, N, rows,
                              [2, 2])
            assert res.ok
        assert p.general[0] == 1  # the short way
        assert p.la.steps == p.lb.steps
        entries = np.frombuffer(p.la.steps[-1], wire.ENTRY_DTYPE, count=2,
                                offset=wire.APP_HEADER_SIZE + wire.STEP_HEADER_SIZE)
        assert not entries["top_k"].any() and not entries["seed"].any()
    finally:
        p.close()


def test_an_engine_reusing_its_arrays_does_not_fool_the_short_cut(pair: Pair) -> None:
    """The last round is kept as copies: an engine that writes its next round into the same
    arrays (as an input batch does) is compared with what was sent, not with itself."""
    slots = np.array([0, 1, 2], np.int64)
    anchor = np.array([8, 8, 8], np.int64)
    gens = np.ones(3, np.int64)
    ra, rb = pair.ra, pair.rb
    for r in (ra, rb):
        rows = np.concatenate([rows_for(s, 1, 0, 8) for s in range(3)])
        assert r.run_batch(slots, gens, anchor, slots, N, rows, [8, 8, 8]).ok
    anchor += 2  # in place
    for r in (ra, rb):
        rows = np.concatenate([rows_for(s, 1, 8, 10) for s in range(3)])
        assert r.run_batch(slots, gens, anchor, slots, N, rows, [2, 2, 2]).ok
    assert pair.general[0] == 1
    gens[1] = 2  # in place: slot 1 holds a new request, 3 rows long
    anchor[1] = 3
    for r in (ra, rb):
        rows = np.concatenate([rows_for(0, 1, 10, 11), rows_for(1, 2, 2, 3),
                               rows_for(2, 1, 10, 11)])
        res = r.run_batch(slots, gens, anchor + np.array([1, 0, 1]), slots, N, rows, [1, 1, 1])
        assert res.ok and res.resynced == 1
    assert pair.general[0] == 2
    assert pair.la.steps == pair.lb.steps


event = st.one_of(
    *[st.tuples(st.just("round"), st.integers(0, 2 ** 32))] * 6,
    st.tuples(st.just("admit"), st.integers(0, MAX_SLOTS - 1), st.integers(1, 3 * W)),
    st.tuples(st.just("order"), st.integers(0, 2 ** 32)),
    st.tuples(st.just("release"), st.integers(0, MAX_SLOTS - 1)),
    st.tuples(st.just("skip"), st.integers(0, MAX_SLOTS - 1)),
    st.tuples(st.just("sampling"), st.integers(0, MAX_SLOTS - 1), st.sampled_from([0, 1, 32])),
    st.tuples(st.just("depth"), st.integers(0, N)),
    st.tuples(st.just("cut")), st.tuples(st.just("busy")), st.tuples(st.just("reconnect")),
    st.tuples(st.just("reset_worker")), st.tuples(st.just("budget"), st.integers(W, 3 * W)),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sampled=st.booleans(), first=st.lists(st.integers(0, MAX_SLOTS - 1), min_size=1,
                                             max_size=MAX_SLOTS, unique=True),
       events=st.lists(event, min_size=1, max_size=30))
def test_short_cut_and_general_path_send_the_same(sampled: bool, first: list[int],
                                                   events: list[tuple[Any, ...]]) -> None:
    """Histories that stay on the usual round most of the time: the same slots in the same
    order, leaving it now and then by every way an engine or the network has."""
    p = Pair(sampled=sampled)
    try:
        order = list(first)
        for s in order:
            p.hist.admit(s, 2 + s)
        depth, release, skip = N, [], {}
        sampling: dict[int, tuple[int, int, float, float]] = {}
        for ev in [("round", 0), *events]:
            kind = ev[0]
            if kind == "round":
                form = "list" if ev[1] % 3 == 0 else "batch"
                live = [s for s in order if s in p.hist.gen]
                p.round(live, depth, skip, sampling, release, form=form)
                order = [s for s in order if s in p.hist.gen]
                release, skip = [], {}
            elif kind == "admit":
                p.hist.admit(ev[1], ev[2])
                if ev[1] not in order:
                    order.append(ev[1])
            elif kind == "order":
                order = np.random.default_rng(ev[1]).permutation(order).tolist()
            elif kind == "release" and ev[1] in p.hist.gen:
                release.append(ev[1])
            elif kind == "skip":
                skip[ev[1]] = 1
            elif kind == "sampling":
                sampling[ev[1]] = (ev[1] * 31, ev[2], 0.7, 0.95) if ev[2] else (0, 0, 0.0, 0.0)
            elif kind == "depth":
                depth = ev[1]
            elif kind == "cut":
                p.la.cut = p.lb.cut = True
            elif kind == "busy":
                p.la.busy = p.lb.busy = True
            elif kind == "reconnect":
                for c in (p.ca, p.cb):
                    if c.connection_epoch() is None:
                        assert c.connect_now(), c.last_error
            elif kind == "reset_worker":
                for c in (p.ca, p.cb):
                    if c.connection_epoch() is not None:
                        assert c.simple_request(wire.OP_RESET, wire.pack_reset([]))[0] == 0
            elif kind == "budget":
                p.ra.row_budget = p.rb.row_budget = ev[1]
        sa, sb = p.ca.stats.snapshot(), p.cb.stats.snapshot()
        for key in set(sa) | set(sb):
            if not key.endswith("us_total") and key != "rtt_seconds":
                assert sa.get(key) == sb.get(key), key
    finally:
        p.close()
