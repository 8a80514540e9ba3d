"""HELLO and sessions over real sockets (docs/contract.md 6.1, 6.2, 11): every refusal with its
exact reply, the refusal order, resume, re-create, replacement, binding, replay, expiry."""

from __future__ import annotations

import time
from typing import Any

import msgspec
import numpy as np
import pytest
from worker_harness import (
    TEST_MAX_ROWS,
    TEST_MAX_SLOTS,
    TEST_WINDOW,
    Client,
    ThreadWorker,
    make_hello,
    tap_rows,
    thread_worker,
    wait_until,
)

from protocol.auth import sign_hello
from protocol.constants import (
    CAP_MARGIN,
    CAP_TAPS_BF16,
    CAP_TOP32,
    OP_HELLO,
    OP_STEP,
    RF_NEED_DRAFT,
    RS_NO_WINDOW,
    RS_OK,
    SAMPLE_TOP32,
    ST_AUTH,
    ST_BAD_FRAME,
    ST_BUSY,
    ST_GEOMETRY,
    ST_IDENTITY,
    ST_LIMITS,
    ST_NO_SESSION,
    ST_OK,
    ST_STALE_SEQ,
    ST_VERSION,
)
from protocol.framing import frame
from protocol.header import AppHeader
from protocol.messages import HelloReply, ReqEntry, pack_reset


def worker_reply(drafter: Any, resumed: int = 0, **over: Any) -> HelloReply:
    fields: dict[str, Any] = dict(
        capabilities=CAP_TAPS_BF16 | CAP_TOP32 | CAP_MARGIN, window=TEST_WINDOW,
        num_spec=drafter.num_spec, max_slots=TEST_MAX_SLOTS, max_rows_per_step=TEST_MAX_ROWS,
        row_bytes=drafter.row_bytes, vocab_size=drafter.vocab_size,
        drafter_identity=drafter.drafter_identity, markov_identity=drafter.markov_identity,
        worker_name="test-worker", resumed=resumed, n_taps=drafter.n_taps,
        hidden=drafter.target_hidden)
    fields.update(over)
    return HelloReply(**fields)


def assert_refused(c: Client, msg: Any, status: int, drafter: Any, **kw: Any) -> None:
    seq = c.seq + 1
    r = c.hello(msg, **kw)
    assert r.header == AppHeader(op=OP_HELLO, seq=seq, session=c.session, body_len=len(r.body),
                                 status=status)
    assert r.hello() == worker_reply(drafter)  # the worker's own values, also on a refusal


def draft_probe(c: Client, drafter: Any, slot: int = 0, gen: int = 1, anchor: int = 12) -> Any:
    e = [ReqEntry(slot=slot, generation=gen, anchor_pos=anchor, anchor_token=3,
                  flags=RF_NEED_DRAFT)]
    r = c.step(e, b"", drafter.row_bytes)
    assert r.status == ST_OK
    return r.step()


def fill(c: Client, drafter: Any, slot: int = 0, gen: int = 1, anchor: int = 12) -> None:
    rows = tap_rows(drafter.row_bytes, slot, gen, 0, anchor)
    e = [ReqEntry(slot=slot, generation=gen, anchor_pos=anchor, anchor_token=3, n_rows=anchor)]
    r = c.step(e, rows, drafter.row_bytes)
    assert r.status == ST_OK and r.step().status.tolist() == [RS_OK]


def test_hello_accepted_reply(worker: ThreadWorker, drafter: Any) -> None:
    with worker.connect() as c:
        r = c.hello(make_hello(drafter, sample_mode=SAMPLE_TOP32))
        assert r.header == AppHeader(op=OP_HELLO, seq=1, session=c.session,
                                     body_len=len(r.body), status=ST_OK)
        assert r.hello() == worker_reply(drafter)


@pytest.mark.parametrize(("field", "value", "status"), [
    ("drafter_identity", bytes(32), ST_IDENTITY),
    ("markov_identity", b"\x01" * 32, ST_IDENTITY),
    ("window", TEST_WINDOW * 2, ST_GEOMETRY),
    ("num_spec", 3, ST_GEOMETRY),
    ("row_bytes", 1536, ST_GEOMETRY),
    ("vocab_size", 1000, ST_GEOMETRY),
    ("tap_dtype", 2, ST_GEOMETRY),
    ("sample_mode", 7, ST_GEOMETRY),
    ("n_taps", 6, ST_GEOMETRY),  # row_bytes no longer n_taps * hidden * 2
    ("max_slots", TEST_MAX_SLOTS + 1, ST_LIMITS),
    ("max_slots", 0, ST_LIMITS),
    ("max_rows_per_step", TEST_MAX_ROWS + 1, ST_LIMITS),
    ("version", 2, ST_VERSION),
])
def test_hello_refusals(worker: ThreadWorker, drafter: Any, field: str, value: Any,
                        status: int) -> None:
    with worker.connect() as c:
        assert_refused(c, make_hello(drafter, **{field: value}), status, drafter)
        if status == ST_VERSION:
            assert c.is_closed()  # a version the worker does not speak ends the connection
            return
        # Refused, nothing changed: the stream is aligned and the session does not exist.
        assert c.ping().status == ST_OK
        assert c.stats(session=c.session).status == ST_NO_SESSION


def test_hello_refusal_order(worker: ThreadWorker, drafter: Any) -> None:
    """6.1: version, auth, identities, geometry, limits, capacity."""
    with worker.connect() as c:
        assert_refused(c, make_hello(drafter, vocab_size=1, max_slots=99,
                                     drafter_identity=bytes(32)), ST_IDENTITY, drafter)
        assert_refused(c, make_hello(drafter, vocab_size=1, max_slots=99), ST_GEOMETRY, drafter)
        assert_refused(c, make_hello(drafter, max_slots=TEST_MAX_SLOTS + 1), ST_LIMITS, drafter)
        assert_refused(c, make_hello(drafter, version=9, vocab_size=1), ST_VERSION, drafter)


def test_hello_header_version_closes(worker: ThreadWorker, drafter: Any) -> None:
    with worker.connect() as c:
        body = make_hello(drafter).pack()
        raw = bytearray(frame(OP_HELLO, 1, c.session, body))
        raw[4:6] = (2).to_bytes(2, "little")
        c.send_raw(bytes(raw))
        r = c.recv()
        assert r.status == ST_VERSION and r.header.seq == 1 and r.hello() == worker_reply(drafter)
        assert c.is_closed()
    assert _closed(worker, "version") >= 1


def _closed(w: ThreadWorker, reason: str) -> float:
    """``connections_closed_total{reason}`` of the worker."""
    value = w.call(lambda: w.app.metrics.registry.get_sample_value(  # type: ignore[union-attr]
        "dspark_worker_connections_closed_total", {"reason": reason}))
    return value or 0.0


def test_hello_bad_frames(worker: ThreadWorker, drafter: Any) -> None:
    with worker.connect() as c:
        good = make_hello(drafter).pack()
        for body, session in ((good[:-1], c.session), (good + b"\0", c.session),
                              (good, 0)):
            r = c.request(OP_HELLO, body, session=session)
            assert r.status == ST_BAD_FRAME and r.hello() == worker_reply(drafter)
        bad_reserved = bytearray(good)
        bad_reserved[26:28] = b"\2\0"  # a bit of the flags u16 after n_taps no flag names
        assert c.request(OP_HELLO, bytes(bad_reserved)).status == ST_BAD_FRAME
        assert c.ping().status == ST_OK


def test_hello_auth(drafter: Any, tmp_path: Any) -> None:
    secret_file = tmp_path / "secret"
    secret_file.write_bytes(b"s3cret-value\n")
    secret_file.chmod(0o600)
    with thread_worker(drafter, auth_secret_file=str(secret_file)) as w, w.connect() as c:
        assert_refused(c, make_hello(drafter), ST_AUTH, drafter)  # no tag
        assert_refused(c, make_hello(drafter), ST_AUTH, drafter, secret=b"wrong")
        # auth comes before identity: an unauthenticated peer learns nothing more
        assert_refused(c, make_hello(drafter, drafter_identity=bytes(32)), ST_AUTH, drafter)
        assert c.is_closed()  # three wrong tags on one connection: closed
        assert _closed(w, "auth") == 1 and _closed(w, "version") == 0
        c = w.connect()
        signed = sign_hello(b"s3cret-value", c.session, c.seq + 1, make_hello(drafter))
        # the tag binds session and seq: the same signed body under another seq is refused
        r = c.request(OP_HELLO, signed.pack(), seq=c.seq + 2)
        assert r.status == ST_AUTH
        r = c.hello(make_hello(drafter), secret=b"s3cret-value")
        assert r.status == ST_OK and r.hello() == worker_reply(drafter)
        c.close()


def test_hello_busy_lanes_and_sessions(drafter: Any) -> None:
    with thread_worker(drafter, max_total_slots=10, max_sessions=2) as w:
        a, b, c = w.connect(), w.connect(), w.connect()
        assert a.hello(make_hello(drafter, max_slots=8)).status == ST_OK
        assert_refused(b, make_hello(drafter, max_slots=4), ST_BUSY, drafter)  # 2 lanes left
        assert b.hello(make_hello(drafter, max_slots=2)).status == ST_OK
        assert_refused(c, make_hello(drafter, max_slots=1), ST_BUSY, drafter)  # 2 sessions
        for x in (a, b, c):
            x.close()


def test_resume_keeps_windows_and_recreate_drops_them(worker: ThreadWorker,
                                                      drafter: Any) -> None:
    c1 = worker.connect()
    msg = make_hello(drafter, client_name="engine-1")
    assert c1.hello(msg).status == ST_OK
    fill(c1, drafter)
    before = draft_probe(c1, drafter)
    # Reconnect on a new connection, same session, seq continuing: resumed, windows kept.
    c2 = Client(worker.address, session=c1.session)
    c2.seq = c1.seq
    r = c2.hello(msg)
    assert r.status == ST_OK and r.hello() == worker_reply(drafter, resumed=1)
    after = draft_probe(c2, drafter)
    assert after.status.tolist() == [RS_OK]
    assert np.array_equal(after.draft_ids, before.draft_ids)
    # The old connection lost the session: it is bound to the latest HELLO's connection.
    c1.seq = c2.seq
    assert c1.step([], b"", drafter.row_bytes).status == ST_NO_SESSION
    assert c1.reset([]).status == ST_NO_SESSION
    # A reconnect HELLO whose fields differ re-creates it: resumed 0, windows gone.
    c3 = Client(worker.address, session=c1.session)
    c3.seq = c2.seq + 5
    r3 = c3.hello(make_hello(drafter, client_name="engine-1", max_slots=4))
    assert r3.status == ST_OK and r3.hello().resumed == 0
    assert draft_probe(c3, drafter).status.tolist() == [RS_NO_WINDOW]
    for c in (c1, c2, c3):
        c.close()


def test_same_client_name_replaces_older_session(worker: ThreadWorker, drafter: Any) -> None:
    old = worker.connect()
    assert old.hello(make_hello(drafter, client_name="vllm-dp0@host-a")).status == ST_OK
    fill(old, drafter)
    old.close()  # the engine died: its connection is gone
    assert wait_until(lambda: len(worker.app.server.connections) == 0)  # type: ignore[union-attr]
    new = worker.connect()  # a respawned engine: new session id, same client name
    assert new.hello(make_hello(drafter, client_name="vllm-dp0@host-a")).status == ST_OK
    stats = msgspec.json.decode(new.stats().body)
    assert [s["session"] for s in stats["sessions"]] == [new.session]
    assert stats["totals"]["sessions_dropped"] == {"replaced": 1}
    new.close()


def test_same_client_name_on_two_live_connections_keeps_both(worker: ThreadWorker,
                                                             drafter: Any) -> None:
    """Two engines started with one client name: the second HELLO does not drop the first
    engine's session while its connection is open and in use; both are served (6.2)."""
    first = worker.connect()
    assert first.hello(make_hello(drafter, client_name="dup")).status == ST_OK
    fill(first, drafter)
    second = worker.connect()
    assert second.hello(make_hello(drafter, client_name="dup")).status == ST_OK
    assert first.step([], b"", drafter.row_bytes).status == ST_OK
    assert second.step([], b"", drafter.row_bytes).status == ST_OK
    stats = msgspec.json.decode(second.stats().body)
    assert len(stats["sessions"]) == 2 and stats["totals"]["sessions_dropped"] == {}
    # The same connection's HELLO under a new id still replaces its own old session.
    old_id = second.session
    second.session ^= 0x10101
    assert second.hello(make_hello(drafter, client_name="dup")).status == ST_OK
    stats = msgspec.json.decode(second.stats().body)
    assert old_id not in [s.get("session") for s in stats["sessions"]]
    assert stats["totals"]["sessions_dropped"] == {"replaced": 1}
    first.close()
    second.close()


def test_session_hijack_and_replay(worker: ThreadWorker, drafter: Any) -> None:
    owner = worker.connect()
    assert owner.hello(make_hello(drafter)).status == ST_OK
    fill(owner, drafter)
    thief = Client(worker.address, session=owner.session)
    thief.seq = 1000
    e = [ReqEntry(slot=0, generation=1, anchor_pos=12, anchor_token=3, flags=RF_NEED_DRAFT)]
    assert thief.step(e, b"", drafter.row_bytes).status == ST_NO_SESSION
    assert thief.reset([]).status == ST_NO_SESSION
    assert thief.stats(session=owner.session).status == ST_NO_SESSION
    # A replayed HELLO (an old seq) is refused and moves nothing.
    replay = thief.hello(make_hello(drafter), seq=1)
    assert replay.status == ST_STALE_SEQ and replay.hello() == worker_reply(drafter)
    assert owner.seq > 1
    # STEP with a seq not above the last: STALE_SEQ, nothing applied
    last = owner.seq
    r = owner.step(e, b"", drafter.row_bytes, seq=last)
    assert r.header == AppHeader(op=OP_STEP, seq=last, session=owner.session, body_len=0,
                                 status=ST_STALE_SEQ)
    owner.seq = last
    assert draft_probe(owner, drafter).status.tolist() == [RS_OK]
    owner.close()
    thief.close()


def test_unknown_session_gets_no_session(worker: ThreadWorker, drafter: Any) -> None:
    with worker.connect() as c:
        r = c.step([], b"", drafter.row_bytes)
        assert r.header == AppHeader(op=OP_STEP, seq=c.seq, session=c.session, body_len=0,
                                     status=ST_NO_SESSION)
        assert c.request(OP_STEP, b"", session=0).status == ST_NO_SESSION
        assert c.reset([0]).status == ST_NO_SESSION
        r = c.request(5, pack_reset([]), session=0)
        assert r.status == ST_NO_SESSION


def test_idle_session_expires(drafter: Any) -> None:
    with thread_worker(drafter, session_idle_s=0.3) as w, w.connect() as c:
        assert c.hello(make_hello(drafter)).status == ST_OK
        fill(c, drafter)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            time.sleep(0.1)
            stats = msgspec.json.decode(c.stats().body)
            if not stats["sessions"]:
                break
        assert stats["sessions"] == [] and stats["totals"]["sessions_dropped"] == {"expired": 1}
        assert c.step([], b"", drafter.row_bytes).status == ST_NO_SESSION


def test_accepted_tcp_sockets_have_nodelay(worker: ThreadWorker) -> None:
    import socket

    with worker.connect() as c:
        assert c.ping(session=0).status == ST_OK
        flags = worker.call(lambda: [
            conn.transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP,
                                                               socket.TCP_NODELAY)
            for conn in worker.app.server.connections.values()])  # type: ignore[union-attr]
    assert flags and all(flags)
