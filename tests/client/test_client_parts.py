"""The engine side's parts on their own surfaces: the row budget, the HELLO reply's fit, the
worker set, and the link's hand-over to the exchange (no socket: the parts decide, the client
tests drive them against workers)."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
from client_fakes import make_hello, make_hello_reply

from dspark_client.acceptance import ClientAcceptance
from dspark_client.budget import (
    MIN_ROW_BUDGET_PARTS,
    PROBE_AFTER_OK_STEPS,
    SIZE_FAILURES_TO_SHRINK,
    RowBudget,
)
from dspark_client.config import RemoteConfig
from dspark_client.hello_check import limits_hint, reply_problems
from dspark_client.link import WorkerLink
from dspark_client.stats import Stats
from dspark_client.transport import TransportError
from dspark_client.workers import WorkerSet
from protocol import wire


def test_row_budget_halves_after_repeated_size_refusals_and_probes_back() -> None:
    stats = Stats()
    b = RowBudget(max_slots=4, window=64, row_bytes=32, max_rows_per_step=256, stats=stats)
    for _ in range(SIZE_FAILURES_TO_SHRINK - 1):
        assert b.size_refused(256, 9000, "transport_error") is None
        assert b.limit == 256  # one alone may be a restart or a cut
    assert b.size_refused(256, 9000, "transport_error") is None
    assert b.limit == 128 and stats.snapshot()["row_budget"] == 128
    for _ in range(PROBE_AFTER_OK_STEPS):
        b.step_ok()
    assert b.limit == 256  # probed upwards again
    # A failed probe lowers it at once, and the next probe waits twice as long.
    assert b.size_refused(256, 9000, "frame_bad_frame_size") is None and b.limit == 128
    for _ in range(PROBE_AFTER_OK_STEPS):
        b.step_ok()
    assert b.limit == 128


def test_row_budget_at_its_floor_says_why_the_client_must_stop() -> None:
    b = RowBudget(max_slots=4, window=64, row_bytes=32, max_rows_per_step=256, stats=Stats())
    floor = math.ceil(64 / MIN_ROW_BUDGET_PARTS)
    b.limit = floor
    why = None
    for _ in range(SIZE_FAILURES_TO_SHRINK):
        why = b.size_refused(floor, 4000, "frame_bad_frame_size")
    assert why is not None and f"finer than {floor} rows" in why and "refused BAD_FRAME" in why
    assert b.limit == floor  # nothing half-applied: the budget stays where it was


def test_row_budget_fit_takes_the_oldest_first_and_keeps_the_engine_order() -> None:
    stats = Stats()
    b = RowBudget(max_slots=4, window=8, row_bytes=32, max_rows_per_step=16, stats=stats)
    slots, anchors = np.array([0, 1, 2]), np.array([20, 20, 20])
    kind, rows = np.zeros(3, np.int64), np.array([8, 8, 8])
    picked, _, k, _ = b.fit(slots, anchors, kind, rows)
    assert picked.tolist() == [0, 1] and k.tolist() == [8, 8]  # slot 2 left out: it ages
    picked, _, _, _ = b.fit(slots, anchors, kind, rows)
    assert 2 in picked.tolist() and picked.tolist() == sorted(picked.tolist())
    assert stats.snapshot()["deferred_slots_total"] == 2


def test_reply_problems_name_every_difference_and_a_following_session_takes_any_drafter() -> None:
    ours = make_hello()
    assert reply_problems(ours, make_hello_reply()) == []
    bad = make_hello_reply(window=ours.window * 2, drafter_identity=b"\xaa" * 32, max_slots=1)
    got = "; ".join(reply_problems(ours, bad))
    assert f"window {ours.window * 2} != ours {ours.window}" in got
    assert "drafter identity aaaaaaaaaaaaaaaa.." in got and "max_slots 1 < ours" in got
    follows = make_hello(flags=wire.HF_FOLLOW)
    assert reply_problems(follows, make_hello_reply(drafter_identity=b"\xaa" * 32)) == []
    assert "--max-frame-bytes" in limits_hint(ours)


def test_worker_set_fails_over_after_repeated_failed_connects() -> None:
    cfg = RemoteConfig(endpoint="tcp://127.0.0.1:1", endpoints=("tcp://127.0.0.1:2",),
                       failover_after=2)
    stats = Stats()
    ws = WorkerSet(cfg, "engine-a", stats)
    first = ws.target(time.monotonic())
    assert first is not None and sorted(ws.members) == ["tcp://127.0.0.1:1",
                                                        "tcp://127.0.0.1:2"]
    why = ws.connect_failed(first, TransportError("refused"))
    assert why == f"connect {first}: refused" and ws.fail_run == 1
    assert ws.target(time.monotonic()) == first  # one failure is not a failover
    # An error that names the endpoint is the link's last_error as it is.
    assert ws.connect_failed(first, TransportError(f"{first}: refused")) == f"{first}: refused"
    other = ws.target(time.monotonic())
    assert other is not None and other != first
    counts = stats.snapshot()
    assert counts["connect_failures"] == 2 and counts["failovers"] == 1


def test_link_refuses_a_seq_for_a_connection_it_left() -> None:
    hello = make_hello()
    stats = Stats()
    link = WorkerLink(RemoteConfig(endpoint="tcp://127.0.0.1:1"), hello, stats,
                      ClientAcceptance(hello.max_slots, hello.num_spec), background=False)
    conn, session, epoch = link.connection()
    assert conn is None and epoch == 0  # nothing ready: the exchange sends nothing
    with pytest.raises(ValueError, match="session 0 outside"):
        WorkerLink(RemoteConfig(endpoint="tcp://127.0.0.1:1"), hello, stats,
                   ClientAcceptance(hello.max_slots, hello.num_spec), session=0,
                   background=False)
    # A connection the link does not hold (dropped, replaced) gets no seq.
    assert link.take_seq(object(), session) is None  # type: ignore[arg-type]
    link.close()
