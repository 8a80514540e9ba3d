"""What a stranger, a flood or an unlucky operator can do to a worker, in-process with real
sockets (docs/contract.md sections 3, 6.2, 10, 11): bodies from connections without a session,
silent connections, STATS without the ids, retired session ids, RESET counts, one series per
unknown op, receive buffers held now, rate-limited refusal logs, the metrics HTTP server's
bounds, HELLOs the frame limit cannot serve."""

from __future__ import annotations

import logging
import re
import socket
import struct
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np
import pytest
from worker_harness import Client, ThreadWorker, make_hello, tap_rows, thread_worker, wait_until

from dspark_worker.buffers import BufferPool
from dspark_worker.config import (
    MAX_SESSIONLESS_PER_PEER,
    SESSIONLESS_MAX_BODY_BYTES,
    WorkerConfig,
    config_warnings,
    exposure_warning,
    max_step_body_bytes,
)
from dspark_worker.dispatch import STATS_REBUILD_S, RateLimitedLog
from protocol.constants import (
    OP_GOODBYE,
    OP_HELLO,
    OP_PING,
    OP_RESET,
    OP_STATS,
    OP_STEP,
    RF_NEED_DRAFT,
    RS_OK,
    ST_BAD_FRAME,
    ST_LIMITS,
    ST_NO_SESSION,
    ST_OK,
    ST_STALE_SEQ,
)
from protocol.errors import BadFrameError
from protocol.framing import frame
from protocol.header import AppHeader
from protocol.messages import ReqEntry, reset_slots

U64_MAX = (1 << 64) - 1


def _wait(cond: Callable[[], bool], timeout: float = 15.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not met in {timeout:g} s")
        time.sleep(0.02)


def _fill_and_draft(c: Client, d: Any, slot: int = 0) -> list[int]:
    """Rows for one slot, then a draft: the drafted tokens (RS_OK asserted)."""
    rows = tap_rows(d.row_bytes, slot, 1, 0, 12)
    e = [ReqEntry(slot=slot, generation=1, anchor_pos=12, anchor_token=3, n_rows=12,
                  flags=RF_NEED_DRAFT)]
    r = c.step(e, rows, d.row_bytes)
    assert r.status == ST_OK
    rep = r.step()
    assert rep.status.tolist() == [RS_OK]
    return [int(x) for x in np.asarray(rep.draft_ids).reshape(-1).tolist()]


def _metric(text: str, name: str, **labels: str) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pat = re.compile(rf"^{re.escape(name)}{{{re.escape(want)}}} (\S+)$" if labels
                     else rf"^{re.escape(name)} (\S+)$", re.M)
    m = pat.search(text)
    return float(m.group(1)) if m else 0.0


# -- 2: memory before HELLO ------------------------------------------------------------------
def test_a_stranger_may_send_only_small_bodies(drafter: Any) -> None:
    """A connection without a session that announces a large body is refused ST_BAD_FRAME and
    closed at its header; once it HELLOed, its STEPs may be as large as the frame limit."""
    d = drafter
    with thread_worker(d, max_frame_bytes=64 << 20) as w:
        for op in (OP_STEP, OP_HELLO, OP_STATS, 77):
            with w.connect() as c:
                c.send_raw(AppHeader(op=op, seq=1, session=5,
                                     body_len=32 << 20).pack())  # a header, no body
                r = c.recv()
                assert (r.header.op, r.header.seq, r.status) == (op, 1, ST_BAD_FRAME)
                assert c.is_closed()
        with w.connect() as c:  # at the limit the stream stays aligned: refused by dispatch
            c.send_raw(frame(OP_STEP, 1, 5, b"\0" * SESSIONLESS_MAX_BODY_BYTES))
            assert c.recv().status == ST_NO_SESSION
            assert c.ping(session=0).status == ST_OK
        with w.connect() as c:
            assert c.hello(make_hello(d)).status == ST_OK
            rows = tap_rows(d.row_bytes, 0, 1, 0, 200)  # 150 KiB: above the stranger's limit
            e = [ReqEntry(slot=0, generation=1, anchor_pos=200, anchor_token=3, n_rows=200,
                          flags=RF_NEED_DRAFT)]
            assert c.step(e, rows, d.row_bytes).status == ST_OK
        assert w.call(lambda: w.app.buffers.in_use_bytes) == 0  # type: ignore[union-attr]


# -- 3: silent connections -------------------------------------------------------------------
def test_idle_sockets_are_closed_and_do_not_lock_out_an_engine(drafter: Any) -> None:
    d = drafter
    n = 256
    with thread_worker(d, max_connections=n, handshake_timeout_s=2.0,
                       connection_idle_s=1.0) as w:
        idle = [socket.create_connection(w.address, timeout=10) for _ in range(n)]
        try:
            # a health checker that PINGs stays connected past the deadline
            checker = w.connect()
            for s in idle:  # the worker closes every one of them (EOF)
                s.settimeout(15)
                assert s.recv(1) == b""
            # an engine now gets in, HELLOs and drafts
            with w.connect() as eng:
                assert eng.hello(make_hello(d)).status == ST_OK
                _fill_and_draft(eng, d)
                # the checker was refused at the limit or is still open; either way a new one
                # that PINGs every 0.25 s outlives the handshake deadline
                checker.close()
                checker = w.connect()
                t_end = time.monotonic() + 3.0
                while time.monotonic() < t_end:
                    assert checker.ping(session=0).status == ST_OK
                    time.sleep(0.25)
                # a connection whose session moved to another connection is closed after
                # connection_idle_s
                moved = Client(w.address, session=eng.session)
                moved.seq = eng.seq + 10
                assert moved.hello(make_hello(d)).status == ST_OK
                assert eng.is_closed(timeout=15)
                assert moved.ping(session=0).status == ST_OK
                moved.close()
            checker.close()
        finally:
            for s in idle:
                s.close()
        _, text = w.scrape()
        closed = "dspark_worker_connections_closed_total"
        # all but the last few of one peer's connections without a session were pushed out
        assert _metric(text, closed, reason="pushed_out") >= n - MAX_SESSIONLESS_PER_PEER
        assert _metric(text, closed, reason="handshake_timeout") + _metric(
            text, closed, reason="pushed_out") >= n
        assert _metric(text, closed, reason="idle_timeout") == 1


# -- 4: STATS does not give sessions away; a takeover does not lock the owner out ----------
def test_stats_shows_ids_only_to_their_own_connection(worker: ThreadWorker,
                                                      drafter: Any) -> None:
    d = drafter
    with worker.connect() as owner, worker.connect() as stranger:
        assert owner.hello(make_hello(d, client_name="engine-secret-name")).status == ST_OK
        raw = stranger.stats().body
        stats = msgspec.json.decode(raw)
        (s,) = stats["sessions"]
        assert "session" not in s and "client_name" not in s
        assert re.fullmatch(r"[0-9a-f]{12}", s["label"]) and s["max_slots"] == 8
        text = raw.decode()
        for form in (str(owner.session), f"{owner.session:x}", f"{owner.session:#010x}",
                     "engine-secret-name"):
            assert form not in text
        mine = msgspec.json.decode(owner.stats(session=owner.session).body)["sessions"][0]
        assert mine["session"] == owner.session and mine["label"] == s["label"]
        assert mine["client_name"] == "engine-secret-name"
        # The engine a session belongs to: a keyed hash of its client name, not the name, and
        # the same for the engine's next session (a reload it follows, a restart).
        assert re.fullmatch(r"[0-9a-f]{12}", s["engine"]) and s["engine"] != s["label"]
        owner.session += 1
        assert owner.hello(make_hello(d, client_name="engine-secret-name")).status == ST_OK
        (again,) = msgspec.json.decode(stranger.stats().body)["sessions"]
        assert again["label"] != s["label"] and again["engine"] == s["engine"]


def test_takeover_with_the_largest_seq_does_not_lock_the_owner_out(worker: ThreadWorker,
                                                                   drafter: Any) -> None:
    """A stranger who has the id (it cannot read it from STATS any more) takes the session with
    seq 2**64 - 1. The owner's re-HELLO under that id is refused STALE_SEQ, and stays refused
    after the thief leaves (the worker remembers the id's seq); a new session under the same
    client name gets the owner drafting again, and drops the thief's once its connection is
    gone."""
    d = drafter
    owner = worker.connect()
    hello = make_hello(d, client_name="engine-a")
    assert owner.hello(hello).status == ST_OK
    before = _fill_and_draft(owner, d)
    thief = Client(worker.address, session=owner.session)
    assert thief.hello(hello, seq=U64_MAX).status == ST_OK
    assert owner.step([], b"", d.row_bytes).status == ST_NO_SESSION
    assert owner.hello(hello).status == ST_STALE_SEQ
    # the owner's recovery: a new session id (as the client does on STALE_SEQ)
    owner.session = owner.session ^ 0x5A5A5A5
    assert owner.hello(hello).status == ST_OK
    assert _fill_and_draft(owner, d) == before
    # The thief's connection is open and was just used: like a second engine under the same
    # client name it keeps what it holds (6.2), beside the owner's new session.
    stats = msgspec.json.decode(owner.stats().body)
    assert len(stats["sessions"]) == 2 and stats["totals"]["sessions_dropped"] == {}
    thief.close()
    assert wait_until(lambda: worker.call(lambda: len(worker.app.server.connections)) == 1)
    owner.session ^= 0x1111  # a respawn: the thief's connection is gone, its session replaced
    assert owner.hello(hello).status == ST_OK
    stats = msgspec.json.decode(owner.stats().body)
    assert len(stats["sessions"]) == 1 and stats["totals"]["sessions_dropped"] == {
        "replaced": 2}
    owner.close()
    thief.close()


# -- 5: an old signed HELLO cannot be replayed ----------------------------------------------
def test_replayed_signed_hello_disturbs_no_one(drafter: Any, tmp_path: Any) -> None:
    """With auth on, a captured HELLO for a session id the worker let go (here: replaced when
    its engine came back under a new id) is refused STALE_SEQ, every time, and the engine's
    current session keeps its windows."""
    from protocol.auth import sign_hello

    d = drafter
    secret = b"replay-test-secret"
    path = tmp_path / "secret"
    path.write_bytes(secret)
    path.chmod(0o600)
    with thread_worker(d, auth_secret_file=str(path)) as w:
        victim = w.connect()
        hello = make_hello(d, client_name="engine-v")
        # what an eavesdropper captures: the victim's first HELLO, bytes as sent
        seq1 = victim.next_seq()
        captured = frame(OP_HELLO, seq1, victim.session,
                         sign_hello(secret, victim.session, seq1, hello).pack())
        victim.send_raw(captured)
        assert victim.recv().status == ST_OK
        first_id = victim.session
        _fill_and_draft(victim, d)
        # the engine starts a new session (same client name, its seq keeps rising): the first
        # one is dropped, replaced
        victim.session = first_id ^ 0x1234567
        assert victim.hello(hello, secret=secret).status == ST_OK
        drafts = _fill_and_draft(victim, d)
        for _ in range(3):  # the replay, again and again, from other connections
            with w.connect() as attacker:
                attacker.send_raw(captured)
                assert attacker.recv().status == ST_STALE_SEQ
        assert _fill_and_draft(victim, d) == drafts  # its windows are still there
        stats = msgspec.json.decode(victim.stats().body)
        assert [s.get("session") for s in stats["sessions"]] == [victim.session]
        assert stats["totals"]["sessions_dropped"] == {"replaced": 1}
        # the seed client's own reconnect under an id the worker let go, with a higher seq
        # (its seq counter only rises), is still accepted
        victim.session = first_id
        assert victim.hello(hello, secret=secret).status == ST_OK
        victim.close()


# -- 6: RESET checks its count before decoding --------------------------------------------
def test_reset_count_is_checked_before_anything_is_decoded() -> None:
    count = 41_900_000
    body = struct.pack("<I", count) + bytes(4 * 1000)  # the count lies about the body
    big = struct.pack("<I", 1 << 20) + bytes(4 << 20)  # a consistent, too long list
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        with pytest.raises(BadFrameError, match=r"41900000 slots; the session has 16"):
            reset_slots(body, max_count=16)
        with pytest.raises(BadFrameError, match=r"1048576 slots"):
            reset_slots(big, max_count=16)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20 and time.perf_counter() - t0 < 1.0
    ok = struct.pack("<3I", 2, 5, 1)
    arr = reset_slots(ok, max_count=16)
    assert arr.tolist() == [5, 1] and np.shares_memory(arr, np.frombuffer(ok, np.uint8))


def test_reset_with_a_huge_count_is_refused_and_changes_nothing(worker: ThreadWorker,
                                                                drafter: Any) -> None:
    d = drafter
    with worker.connect() as c:
        assert c.hello(make_hello(d)).status == ST_OK
        drafts = _fill_and_draft(c, d)
        for count, extra in ((0xFFFFFFFF, 0), (41_900_000, 4 * 2000)):
            r = c.request(OP_RESET, struct.pack("<I", count) + bytes(extra))
            assert r.status == ST_BAD_FRAME
        assert c.ping(c.session).status == ST_OK
        assert _fill_and_draft(c, d) == drafts


# -- 7: one series for unknown ops ----------------------------------------------------------
def test_unknown_ops_share_one_series(worker: ThreadWorker) -> None:
    with worker.connect() as c:
        for op in (9, 10, 11, 200, 9):
            assert c.request(op, b"", session=0).status == ST_BAD_FRAME
    _, text = worker.scrape()
    lines = [ln for ln in text.splitlines()
             if ln.startswith('dspark_worker_frames_total{op="unknown",status="BAD_FRAME"}')]
    assert len(lines) == 1 and float(lines[0].split()[-1]) == 5.0
    series = [ln.rsplit(" ", 1)[0] for ln in text.splitlines() if ln and ln[0] != "#"]
    assert len(series) == len(set(series))  # no duplicate series anywhere


# -- 8: receive buffers held now ------------------------------------------------------------
def test_buffer_pool_reports_what_it_holds_and_keeps_one_per_session() -> None:
    sessions = 8
    pool = BufferPool(idle_per_class=lambda: sessions)
    size = 1 << 20
    for _ in range(3):  # three rounds of eight engines' STEPs in flight at once
        bufs = [pool.alloc(size - 5) for _ in range(sessions)]
        assert pool.in_use_bytes == sessions * size
        for b in bufs:
            pool.release(b)
        assert pool.in_use_bytes == 0 and pool.held_bytes == sessions * size
    assert pool.misses == sessions and pool.hits == 2 * sessions  # every later STEP reused one
    assert pool.created_bytes == sessions * size


def test_stats_receive_buffers_are_what_is_held_now(worker: ThreadWorker, drafter: Any) -> None:
    """Six engines' large STEPs in flight together, three times over: the pool keeps a buffer
    per session, so STATS reports the same bytes held after every round."""
    d = drafter
    engines = [worker.connect() for _ in range(6)]
    n = 120  # 90 KiB of rows: a pooled body
    held: list[int] = []
    scraped: list[float] = []
    try:
        for c in engines:
            assert c.hello(make_hello(d, max_slots=2)).status == ST_OK
        for rnd in range(3):
            worker.hold_runner()
            for c in engines:
                rows = tap_rows(d.row_bytes, 0, rnd + 1, 0, n)
                e = [ReqEntry(slot=0, generation=rnd + 1, anchor_pos=n, anchor_token=3,
                              n_rows=n)]
                from protocol.messages import pack_step

                c.send_raw(frame(OP_STEP, c.next_seq(), c.session,
                                 pack_step(1, e, rows.tobytes(), d.row_bytes)))
            _wait(lambda: worker.queued_steps() == len(engines), what="STEPs queued")
            worker.release_runner()
            for c in engines:
                assert c.recv().status == ST_OK
            stats = msgspec.json.decode(engines[0].stats().body)
            held.append(stats["memory"]["receive_buffers_bytes"])
            _, text = worker.scrape()  # the gauge reads the same pool when scraped
            scraped.append(_metric(text, "dspark_worker_receive_buffers_bytes"))
    finally:
        for c in engines:
            c.close()
    assert held == [6 * (128 << 10)] * 3, held  # flat, and what six bodies hold
    assert scraped == held


# -- 10: refusal logs per host and reason, with what was held back -------------------------
def test_refusal_log_is_rate_limited_per_host_and_says_what_it_held_back(
        caplog: pytest.LogCaptureFixture) -> None:
    now = [100.0]
    logger = logging.getLogger("dspark_worker.test_ratelimit")
    rl = RateLimitedLog(logger, 10.0, clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger=logger.name):
        for port in range(40000, 40100):  # a new connection (port) per bad frame
            rl.warning(("127.0.0.1", "bad_magic"), "bad_magic closes from 127.0.0.1",
                       "closing connection from 127.0.0.1:%d: bad_magic", port)
        rl.warning(("10.0.0.9", "bad_magic"), "bad_magic closes from 10.0.0.9",
                   "closing connection from 10.0.0.9:1: bad_magic")
        assert len(caplog.records) == 2
        now[0] += 10.5
        rl.flush()
        assert len(caplog.records) == 3
        assert caplog.records[-1].getMessage() == (
            "99 more bad_magic closes from 127.0.0.1 were not logged (one line per 10 s)")
        rl.flush()
        assert len(caplog.records) == 3


def test_a_flood_of_bad_streams_logs_a_few_lines(drafter: Any,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="dspark_worker"), thread_worker(drafter) as w:
        for _ in range(60):
            with w.connect() as c:
                c.send_raw(b"\0" * 24)  # bad magic
                assert c.is_closed()
        lines = [r for r in caplog.records if "bad_magic" in r.getMessage()]
    assert 1 <= len(lines) <= 2, [r.getMessage() for r in lines]


# -- 11: the metrics HTTP server is bounded -------------------------------------------------
def test_idle_http_connections_do_not_keep_a_scrape_out(worker: ThreadWorker) -> None:
    host, port = worker.app.metrics_address  # type: ignore[misc]
    idle = [socket.create_connection((host, port), timeout=10) for _ in range(100)]
    try:
        for s in idle[:50]:
            s.sendall(b"GET /metrics HTTP/1.1\r\n")  # a request that never ends
        t0 = time.monotonic()
        status, text = worker.scrape()
        assert status == 200 and "dspark_worker_frames_total" in text
        # older idle connections were pushed out at once to stay within the limit ...
        def closed(s: socket.socket) -> bool:  # EOF, after a 408 for a timed-out one
            s.settimeout(0.05)
            try:
                while s.recv(4096):
                    pass
                return True
            except TimeoutError:
                return False
            except OSError:
                return True
        _wait(lambda: sum(closed(s) for s in idle) >= 60, timeout=5,
              what="idle HTTP connections pushed out")
        # ... and the rest time out in seconds, not after ten
        _wait(lambda: all(closed(s) for s in idle), timeout=10, what="idle HTTP timeouts")
        assert time.monotonic() - t0 < 10
    finally:
        for s in idle:
            s.close()


def test_probes_are_answered_while_the_draft_loop_is_held(worker: ThreadWorker) -> None:
    """The metrics port has an event loop and a thread of its own: while the draft port's loop
    is held (1.5 s of work in one callback, as a flood or a slow handler would hold it),
    /livez, /healthz and /metrics still answer at once."""
    worker.loop.call_soon_threadsafe(time.sleep, 1.5)
    time.sleep(0.1)  # the loop is in it now
    t0 = time.perf_counter()
    for path in ("/livez", "/healthz", "/metrics"):
        status, _ = worker.scrape(path)
        assert status == 200, path
    assert time.perf_counter() - t0 < 0.5


# -- 12: a HELLO the frame limit cannot serve ----------------------------------------------
def test_hello_whose_largest_step_is_over_the_frame_limit_is_refused(
        drafter: Any, caplog: pytest.LogCaptureFixture) -> None:
    d = drafter
    limit = 128 << 10
    with caplog.at_level(logging.WARNING, logger="dspark_worker"), \
            thread_worker(d, max_frame_bytes=limit) as w, w.connect() as c:
        too_big = make_hello(d, max_slots=8, max_rows_per_step=256)
        need = max_step_body_bytes(8, 256, d.row_bytes)
        assert need > limit
        r = c.hello(too_big)
        assert r.status == ST_LIMITS
        msgs = [rec.getMessage() for rec in caplog.records
                if "refused LIMITS" in rec.getMessage()]
        assert msgs and str(need) in msgs[0] and str(limit) in msgs[0]
        fits = make_hello(d, max_slots=8, max_rows_per_step=128)
        assert c.hello(fits).status == ST_OK
        _fill_and_draft(c, d)


def test_start_warnings_for_limits_that_cannot_all_be_used() -> None:
    c = WorkerConfig(max_frame_bytes=1 << 20, max_slots=600, max_total_slots=512,
                     max_rows_per_step=2048)
    texts = config_warnings(c, 25600)
    largest = max_step_body_bytes(600, 2048, 25600)
    assert len(texts) == 2
    assert str(1 << 20) in texts[0] and str(largest) in texts[0]
    assert "max_slots 600 is above max_total_slots 512" in texts[1]
    assert config_warnings(WorkerConfig(), 25600) == []  # the defaults agree
    small_share = config_warnings(WorkerConfig(max_slots_per_peer=128), 25600)
    assert len(small_share) == 1 and "a HELLO may ask for 128 slots at most" in small_share[0]
    assert WorkerConfig(max_slots_per_peer=128).session_slots == 128
    assert (WorkerConfig().slots_per_connection, WorkerConfig().slots_per_peer) == (256, 256)


# -- 13: exposed without authentication ----------------------------------------------------
@pytest.mark.parametrize("listen,loud", [
    ("0.0.0.0:7600", True), ("[::]:7600", True), ("10.1.2.3:7600", True),
    ("dspark.example:7600", True), ("127.0.0.1:7600", False), ("127.9.9.9:1", False),
    ("[::1]:7600", False), ("localhost:7600", False)])
def test_non_loopback_listener_without_auth_is_announced(listen: str, loud: bool) -> None:
    text = exposure_warning(WorkerConfig(listen=listen))
    assert (text is not None) == loud
    if loud:
        assert "WITHOUT AUTHENTICATION" in text and listen in text  # type: ignore[operator]
    assert exposure_warning(WorkerConfig(listen=listen, auth_secret_file="/s")) is None


def test_ping_with_a_session_keeps_the_stream(worker: ThreadWorker, drafter: Any) -> None:
    """PING and STATS of a sessioned connection are unaffected by the stranger limits."""
    with worker.connect() as c:
        assert c.hello(make_hello(drafter)).status == ST_OK
        c.send_raw(frame(OP_PING, c.next_seq(), c.session, b"x" * 10_000))
        assert c.recv().status == ST_BAD_FRAME  # refused by dispatch, stream aligned
        assert c.ping(c.session).status == ST_OK


def test_repeated_stats_share_one_body_until_something_changes(worker: ThreadWorker,
                                                              drafter: Any) -> None:
    """STATS from a connection without a session is answered from the last body while no
    other frame came (a pipelined flood costs no JSON per frame); after a STEP it is fresh
    once STATS_REBUILD_S has passed since the last body (rebuilt at most that often)."""
    d = drafter
    with worker.connect() as eng, worker.connect() as tool:
        assert eng.hello(make_hello(d, client_name="stats-cache")).status == ST_OK
        first = tool.stats().body
        assert all(tool.stats().body == first for _ in range(20))
        _fill_and_draft(eng, d)
        time.sleep(STATS_REBUILD_S)
        after = msgspec.json.decode(tool.stats().body)
        assert after["totals"]["steps"] > msgspec.json.decode(first)["totals"]["steps"]
        # the engine's own connection sees its session's id: never a shared body
        mine = msgspec.json.decode(eng.stats(session=0).body)
        assert [s.get("session") for s in mine["sessions"]] == [eng.session]


def test_a_session_still_bound_here_is_not_taken_for_a_gone_one(worker: ThreadWorker,
                                                                drafter: Any) -> None:
    """A connection holding two sessions whose latest is released: a large STEP of the other,
    still bound to it, is served whole (12 rows: over the 4 KiB of a sessionless body)."""
    d = drafter
    with worker.connect() as c:
        first = c.session
        assert c.hello(make_hello(d, client_name="multi-a")).status == ST_OK
        c.session = first ^ 0x777
        assert c.hello(make_hello(d, client_name="multi-b")).status == ST_OK
        assert c.request(OP_GOODBYE).status == ST_OK  # the latest one goes
        c.session = first
        _fill_and_draft(c, d)  # 12 x 768 bytes of rows: served, not NO_SESSION
