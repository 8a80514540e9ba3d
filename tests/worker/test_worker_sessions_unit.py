"""sessions.py on its own: generations (7.1), the session table (6.2), lane accounting (8)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dspark_worker.sessions import (
    DropReason,
    Outcome,
    SessionTable,
    generation_order,
    plan_step,
)
from protocol.constants import RF_NEED_DRAFT, RF_RELEASE, RF_RESET
from protocol.errors import BusyError, NoSessionError, StaleSeqError
from protocol.messages import ENTRY_DTYPE, Hello

U32 = 1 << 32


def hello(max_slots: int = 4, name: str = "", window: int = 32) -> Hello:
    return Hello(sample_mode=0, window=window, num_spec=7, max_slots=max_slots,
                 max_rows_per_step=64, row_bytes=768, vocab_size=512, n_taps=3, hidden=128,
                 drafter_identity=bytes(32), markov_identity=bytes(32), client_name=name)


def entries(*rows: tuple[int, int, int]) -> np.ndarray:
    """(slot, generation, flags) per entry."""
    e = np.zeros(len(rows), dtype=ENTRY_DTYPE)
    for i, (slot, gen, flags) in enumerate(rows):
        e[i]["slot"], e[i]["generation"], e[i]["flags"] = slot, gen, flags
        e[i]["anchor_pos"] = 10
    return e


@given(old=st.integers(0, U32 - 1), delta=st.integers(0, U32 - 1))
def test_generation_order_is_serial_number_arithmetic(old: int, delta: int) -> None:
    new = (old + delta) % U32
    want = 0 if delta == 0 else (1 if delta < (1 << 31) else -1)
    assert generation_order(np.array([new], np.uint32), np.array([old], np.uint32))[0] == want


def test_generation_wraps() -> None:
    assert generation_order(0, U32 - 1) == 1  # 0 follows 0xFFFFFFFF
    assert generation_order(U32 - 1, 0) == -1
    assert generation_order((1 << 31) - 1, 0) == 1
    assert generation_order(1 << 31, 0) == -1  # exactly half way is not newer


def test_plan_and_commit_step() -> None:
    t = SessionTable(max_sessions=4, lane_capacity=16, idle_s=60)
    s = t.hello(7, 1, hello(), conn_id=1, now=0).session
    e = entries((0, 5, RF_NEED_DRAFT), (1, 9, 0))
    p = plan_step(s, e)
    assert p.reset.tolist() == [True, True]  # no state: new requests
    assert p.stale.tolist() == [False, False]
    t.commit_step(s, p, e, 2, 1.0)
    assert s.n_live == 2 and s.last_seq == 2

    e2 = entries((0, 5, 0), (1, 8, RF_NEED_DRAFT), (2, 1, RF_RESET))
    p2 = plan_step(s, e2)
    assert p2.reset.tolist() == [False, False, True]  # same, (stale), new
    assert p2.stale.tolist() == [False, True, False]
    assert p2.need_draft.tolist() == [False, False, False]  # a stale entry drafts nothing
    assert p2.apply.tolist() == [True, False, True]
    t.commit_step(s, p2, e2, 3, 2.0)
    assert s.generation[:3].tolist() == [5, 9, 1]  # the stale entry changed nothing

    e3 = entries((0, 5, RF_RESET), (1, 9, RF_RELEASE))
    p3 = plan_step(s, e3)
    assert p3.reset.tolist() == [True, False] and p3.release.tolist() == [False, True]
    t.commit_step(s, p3, e3, 4, 3.0)
    assert s.n_live == 2 and not s.live[1]  # released: generation forgotten
    p4 = plan_step(s, entries((1, 3, 0)))  # any generation is new again
    assert p4.reset.tolist() == [True] and not p4.stale.any()



def test_steady_step_plans_like_the_general_rules() -> None:
    """A STEP that continues every known generation without RESET or RELEASE takes the short
    path; its plan is what the general rules give, and committing it changes no generation."""
    t = SessionTable(max_sessions=4, lane_capacity=16, idle_s=60)
    s = t.hello(7, 1, hello(), conn_id=1, now=0).session
    first = entries((0, 5, RF_NEED_DRAFT), (2, 9, 0))
    t.commit_step(s, plan_step(s, first), first, 2, 1.0)
    e = entries((2, 9, RF_NEED_DRAFT), (0, 5, 0))
    p = plan_step(s, e)
    assert p.steady
    assert p.slots.tolist() == [2, 0] and p.apply.tolist() == [True, True]
    assert not (p.stale.any() or p.reset.any() or p.release.any())
    assert p.need_draft.tolist() == [True, False]
    gen, live, n_live = s.generation.copy(), s.live.copy(), s.n_live
    t.commit_step(s, p, e, 3, 2.0)
    assert (s.generation == gen).all() and (s.live == live).all() and s.n_live == n_live
    assert s.last_seq == 3 and s.steps == 2
    # Any one entry off the steady path sends the whole STEP through the general rules.
    for off in ((2, 9, RF_RESET), (2, 10, 0), (2, 8, 0), (1, 1, 0), (2, 9, RF_RELEASE)):
        q = plan_step(s, entries((0, 5, 0), off))
        assert not q.steady, off
        assert q.reset.any() or q.stale.any() or q.release.any(), off

def test_hello_create_resume_recreate() -> None:
    t = SessionTable(max_sessions=4, lane_capacity=16, idle_s=60)
    r = t.hello(7, 1, hello(), conn_id=1, now=0)
    assert r.outcome is Outcome.CREATED and t.lanes_reserved == 4
    with pytest.raises(StaleSeqError):
        t.hello(7, 1, hello(), conn_id=2, now=0)  # a replay
    r2 = t.hello(7, 2, hello(), conn_id=2, now=0)
    assert r2.outcome is Outcome.RESUMED and r2.session is r.session
    assert r.session.conn_id == 2
    r3 = t.hello(7, 3, hello(window=64), conn_id=2, now=0)
    assert r3.outcome is Outcome.RECREATED and r3.session is not r.session
    assert r3.dropped == [(r.session, DropReason.RECREATED)] and not r.session.alive
    assert t.lanes_reserved == 4 and len(t) == 1


def test_bound_binds_session_to_connection() -> None:
    t = SessionTable(max_sessions=4, lane_capacity=16, idle_s=60)
    t.hello(7, 1, hello(), conn_id=1, now=0)
    assert t.bound(7, 1, 2).session_id == 7
    with pytest.raises(NoSessionError):
        t.bound(7, 2, 2)  # another connection
    with pytest.raises(NoSessionError):
        t.bound(8, 1, 2)
    with pytest.raises(StaleSeqError):
        t.bound(7, 1, 1)


def test_replacement_by_client_name_and_capacity() -> None:
    t = SessionTable(max_sessions=2, lane_capacity=8, idle_s=60)
    a = t.hello(1, 1, hello(max_slots=6, name="engine-a"), conn_id=1, now=0).session
    with pytest.raises(BusyError) as e:
        t.hello(2, 1, hello(max_slots=4, name="engine-b"), conn_id=2, now=0)  # lanes
    assert e.value.field == "max_slots_per_peer" and len(t) == 1 and a.alive  # nothing changed
    # The same client name under a new id: the old session goes first, so it fits.
    r = t.hello(3, 1, hello(max_slots=8, name="engine-a"), conn_id=3, now=0)
    assert r.outcome is Outcome.CREATED and r.dropped == [(a, DropReason.REPLACED)]
    assert not a.alive and t.lanes_reserved == 8
    t2 = SessionTable(max_sessions=1, lane_capacity=64, idle_s=60)
    t2.hello(1, 1, hello(), conn_id=1, now=0)
    with pytest.raises(BusyError) as e2:
        t2.hello(2, 1, hello(), conn_id=2, now=0)  # session count
    assert e2.value.field == "max_sessions_per_peer"  # the same as max_sessions here


def test_unnamed_sessions_do_not_replace_each_other() -> None:
    t = SessionTable(max_sessions=4, lane_capacity=16, idle_s=60)
    t.hello(1, 1, hello(), conn_id=1, now=0)
    r = t.hello(2, 1, hello(), conn_id=2, now=0)
    assert r.dropped == [] and len(t) == 2


def test_expiry() -> None:
    t = SessionTable(max_sessions=4, lane_capacity=16, idle_s=10)
    a = t.hello(1, 1, hello(), conn_id=1, now=0).session
    b = t.hello(2, 1, hello(), conn_id=2, now=5).session
    assert t.expire(9.9) == []
    assert t.expire(10.0) == [a] and not a.alive
    t.touch(b, 2, 12.0)
    assert t.expire(20.0) == [] and t.expire(22.0) == [b]
    assert t.lanes_reserved == 0


def test_retired_ids_keep_their_seq_by_id_and_by_client_name() -> None:
    """A session the table let go leaves its id and last seq behind: a HELLO for it must carry a
    higher seq. The global memory is bounded (oldest first); the last ids of each client name
    outlive a churn of other names' sessions."""
    t = SessionTable(max_sessions=8, lane_capacity=64, idle_s=60.0, retired_max=2)
    t.hello(0xA, 5, hello(name="engine-v"), conn_id=1, now=0.0)
    t.hello(0xB, 9, hello(name="engine-v"), conn_id=1, now=1.0)  # replaces 0xA
    assert t.retired_seq(0xA) == 5
    with pytest.raises(StaleSeqError, match="was dropped"):
        t.hello(0xA, 5, hello(name="engine-v"), conn_id=2, now=2.0)
    assert t.get(0xB) is not None  # the refused replay dropped nothing
    for i in range(10):  # other engines come and go: 0xA leaves the global memory
        t.hello(0x100 + i, 1, hello(name=f"other-{i % 2}"), conn_id=3, now=3.0)
    assert t.retired_seq(0xA) is None and t.retired_seq(0xA, "engine-v") == 5
    with pytest.raises(StaleSeqError):
        t.hello(0xA, 5, hello(name="engine-v"), conn_id=2, now=4.0)
    assert t.get(0xB) is not None
    # the engine's own reconnect under its old id, seq above, is a new session
    r = t.hello(0xA, 10, hello(name="engine-v"), conn_id=1, now=5.0)
    assert r.session.session_id == 0xA and t.get(0xB) is None
    assert t.retired_seq(0xA, "engine-v") is None  # held again


def test_limits_per_connection_and_per_peer_and_the_unused_grace() -> None:
    t = SessionTable(max_sessions=16, lane_capacity=64, idle_s=600, max_per_connection=2,
                     max_per_peer=3, unused_idle_s=5)
    t.hello(1, 1, hello(), conn_id=1, now=0, peer="10.0.0.1")
    t.hello(2, 1, hello(), conn_id=1, now=0, peer="10.0.0.1")
    with pytest.raises(BusyError, match="limit per connection is 2"):
        t.hello(3, 1, hello(), conn_id=1, now=0, peer="10.0.0.1")
    t.hello(3, 1, hello(), conn_id=2, now=0, peer="10.0.0.1")
    with pytest.raises(BusyError, match="limit per peer is 3") as e:
        t.hello(4, 1, hello(), conn_id=3, now=0, peer="10.0.0.1")
    assert e.value.limit == 3 and len(t) == 3
    t.hello(4, 1, hello(), conn_id=4, now=0, peer="10.0.0.2")  # another host
    # A respawn under its client name replaces its predecessor even at the peer's limit.
    t.hello(5, 1, hello(name="e"), conn_id=5, now=0, peer="10.0.0.2")
    t.hello(6, 1, hello(name="e"), conn_id=6, now=0, peer="10.0.0.2")
    assert t.get(5) is None and t.get(6) is not None
    # Connections 1 and 2 went; session 3 had sent a STEP: only 1 and 2 go after the grace.
    t.get(3).steps = 1  # type: ignore[union-attr]
    open_conns = {3, 4, 6}
    assert t.expire(4.0, open_conns.__contains__) == []
    assert {s.session_id for s in t.expire(5.0, open_conns.__contains__)} == {1, 2}
    assert t.get(3) is not None and t.get(4) is not None


def _step(t: SessionTable, s: object, seq: int, now: float, rows: int = 0) -> None:
    e = entries((0, 1, RF_NEED_DRAFT))
    e["n_rows"] = rows
    t.commit_step(s, plan_step(s, e), e, seq, now)  # type: ignore[arg-type]


def test_lanes_per_connection_and_per_peer_name_their_limit_and_change_nothing() -> None:
    t = SessionTable(max_sessions=16, lane_capacity=32, idle_s=600, lanes_per_connection=8,
                     lanes_per_peer=16, reservation_idle_s=10)
    a = t.hello(1, 1, hello(8), conn_id=1, now=0, peer="h1").session
    with pytest.raises(BusyError, match="limit per connection is 8 slots"
                                        r" \(--max-slots-per-connection\)") as e:
        t.hello(2, 1, hello(1), conn_id=1, now=1, peer="h1")
    assert e.value.value == 9 and e.value.limit == 8
    t.hello(3, 1, hello(8), conn_id=2, now=1, peer="h1")
    with pytest.raises(BusyError, match="sessions from h1 hold 16, the limit per peer is 16"
                                        r" slots \(--max-slots-per-peer\)"):
        t.hello(4, 1, hello(4), conn_id=3, now=2, peer="h1")
    assert len(t) == 2 and t.lanes_reserved == 16 and a.alive  # nothing changed
    t.hello(5, 1, hello(8), conn_id=4, now=2, peer="h2")  # another host gets the rest
    t.hello(6, 1, hello(8), conn_id=5, now=2, peer="h2")
    with pytest.raises(BusyError, match="the ring pool has 0 of 32 free"):
        t.hello(7, 1, hello(1), conn_id=6, now=3, peer="h3")


def test_a_reservation_without_a_step_gives_its_lanes_to_a_hello_that_needs_them() -> None:
    """Only under pressure, only after reservation_idle_s without a STEP (a PING or a resume
    does not count), the longest unused first; a re-created session keeps its predecessor's
    clock; a refusal evicts nothing."""
    t = SessionTable(max_sessions=16, lane_capacity=16, idle_s=600, reservation_idle_s=10)
    hoard = t.hello(1, 1, hello(8), conn_id=1, now=0, peer="h").session
    used = t.hello(2, 1, hello(8), conn_id=2, now=0, peer="h").session
    for i in range(3):  # 96 rows in 10 s over 8 lanes: used, not underused
        _step(t, used, 2 + i, 9.0 + i / 10, rows=32)
    t.touch(hoard, 2, 9.5)  # a PING: the lanes are no more used for it
    with pytest.raises(BusyError, match="sessions from h hold 16"):
        t.hello(3, 1, hello(8), conn_id=3, now=9.9, peer="h")  # not unused for 10 s yet
    assert hoard.alive
    with pytest.raises(BusyError):  # would need both: the stepping one is not evicted
        t.hello(3, 1, hello(16), conn_id=3, now=10.0, peer="h")
    assert hoard.alive and used.alive
    # a re-create (other fields) of the hoard keeps the clock of its first HELLO
    hoard2 = t.hello(1, 3, hello(8, window=16), conn_id=1, now=10.0, peer="h").session
    assert hoard2.last_step_at == 0
    r = t.hello(3, 1, hello(8), conn_id=3, now=10.0, peer="h")
    assert r.dropped == [(hoard2, DropReason.UNUSED)] and not hoard2.alive and used.alive
    assert t.lanes_reserved == 16
    # the lanes it took stay unused until its first STEP: a hoarder's next HELLO gets them back
    # only to lose them at once to the next that needs them
    assert r.session.last_step_at == 0
    _step(t, r.session, 2, 10.5)
    assert r.session.last_step_at == 10.5


def test_a_reservation_kept_alive_by_a_row_now_and_then_gives_way_least_used_first() -> None:
    """A session that STEPs a row a second over 8 lanes is underused (under one row a second
    per lane, once it had reservation_idle_s to show its use) and gives its lanes to a HELLO
    that needs them, the least used first; a busy one and one still new keep theirs."""
    t = SessionTable(max_sessions=16, lane_capacity=24, idle_s=600, reservation_idle_s=2)
    trickle = t.hello(1, 1, hello(8), conn_id=1, now=0, peer="h").session
    trickle2 = t.hello(2, 1, hello(8), conn_id=2, now=0, peer="h").session
    busy = t.hello(3, 1, hello(8), conn_id=3, now=0, peer="h").session
    for i in range(40):  # 4 s: a row a second each for the trickles, 80 a second for busy
        now = i / 10
        if i % 10 == 0:
            _step(t, trickle, 2 + i, now, rows=1)
            _step(t, trickle2, 2 + i, now, rows=2)
        _step(t, busy, 2 + i, now, rows=8)
    assert t.underused(trickle, 4.0) and not t.underused(busy, 4.0)
    assert t.use(trickle, 4.0) < t.use(trickle2, 4.0) < 1.0 < t.use(busy, 4.0)
    r = t.hello(4, 1, hello(8), conn_id=4, now=4.0, peer="h")
    assert r.dropped == [(trickle, DropReason.UNDERUSED)] and trickle2.alive and busy.alive
    assert r.session.last_step_at == 4.0  # not the evicted one's clock: judged on its own
    # the newcomer has reservation_idle_s to show its use: the next HELLO takes trickle2's
    r = t.hello(5, 1, hello(8), conn_id=5, now=4.5, peer="h")
    assert r.dropped == [(trickle2, DropReason.UNDERUSED)]
    with pytest.raises(BusyError):  # busy and the two new ones stay
        t.hello(6, 1, hello(8), conn_id=6, now=5.0, peer="h")
    assert not t.reclaimable(busy, 5.0)


def test_a_client_name_held_on_another_host_is_kept_and_a_stopped_predecessor_gives_way(
) -> None:
    t = SessionTable(max_sessions=16, lane_capacity=8, idle_s=600)
    connected = {1, 2}.__contains__
    owner = t.hello(1, 1, hello(4, name="engine"), conn_id=1, now=0, peer="h1").session

    def live(s: object) -> bool:
        return True  # every session had a frame lately

    # a stranger on another host claims the name: the owner's open connection keeps it
    r = t.hello(2, 1, hello(4, name="engine"), conn_id=2, now=1, peer="h2", live=live,
                connected=connected)
    assert r.kept == [owner] and owner.alive and not r.dropped
    t.drop(r.session)
    # on the owner's own host, in use: kept while the new session fits beside it ...
    r = t.hello(3, 1, hello(4, name="engine"), conn_id=3, now=2, peer="h1", live=live,
                connected=connected)
    assert r.kept == [owner] and owner.alive
    # ... and replaced when it does not (a respawn over its predecessor, stopped moments ago)
    r2 = t.hello(4, 1, hello(8, name="engine"), conn_id=4, now=3, peer="h1", live=live,
                 connected=connected)
    assert {s.session_id for s, _ in r2.dropped} == {1, 3} and not owner.alive
    assert all(why is DropReason.REPLACED for _, why in r2.dropped)
