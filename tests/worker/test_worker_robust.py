"""Nothing a socket sends crashes the worker or changes state when refused (docs/contract.md 3,
11): garbage, a huge body_len, frames cut and left open, too many connections, and thousands of
seeded mutations of valid frames."""

from __future__ import annotations

import socket
import struct
import time
from typing import Any

import numpy as np
import pytest
from worker_harness import Client, ThreadWorker, make_hello, tap_rows, thread_worker

from protocol.constants import (
    FRAME_STATUS_NAMES,
    OP_HELLO,
    OP_PING,
    OP_RESET,
    OP_STATS,
    OP_STEP,
    RF_NEED_DRAFT,
    RF_RELEASE,
    RF_RESET,
    ST_BAD_FRAME,
    ST_NO_SESSION,
    ST_OK,
    ST_STALE_SEQ,
)
from protocol.errors import WireError
from protocol.framing import frame
from protocol.header import AppHeader
from protocol.messages import (
    ENTRY_DTYPE,
    ReqEntry,
    StepReply,
    decode_step,
    entries_from_view,
    pack_reset,
    pack_step,
)
from protocol.validate import check_reply_values

PROBE = [ReqEntry(slot=s, generation=1, anchor_pos=12, anchor_token=3 + s, flags=RF_NEED_DRAFT)
         for s in range(3)]


def control_session(w: ThreadWorker, d: Any) -> tuple[Client, bytes]:
    """A session that only the test talks to, and its probe reply (minus worker_us)."""
    c = w.connect()
    assert c.hello(make_hello(d, client_name="control-session-of-the-test")).status == ST_OK
    entries = [ReqEntry(slot=s, generation=1, anchor_pos=12, anchor_token=3, n_rows=12)
               for s in range(3)]
    rows = np.concatenate([tap_rows(d.row_bytes, s, 1, 0, 12) for s in range(3)])
    assert c.step(entries, rows, d.row_bytes).status == ST_OK
    return c, probe(c, d)


def probe(c: Client, d: Any) -> bytes:
    r = c.step(PROBE, b"", d.row_bytes, step_id=1)
    assert r.status == ST_OK
    body = bytearray(r.body)
    body[16:20] = b"\0\0\0\0"  # worker_us differs from call to call
    return bytes(body)


def test_garbage_closes_only_that_connection(worker: ThreadWorker, drafter: Any) -> None:
    ctl, before = control_session(worker, drafter)
    for junk in (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", bytes(range(256)) * 4, b"\0" * 24):
        with worker.connect() as c:
            c.send_raw(junk)
            assert c.is_closed()
    with worker.connect() as c:
        assert c.ping(session=0).status == ST_OK
    assert probe(ctl, drafter) == before
    ctl.close()


def test_huge_body_len_is_refused_then_closed(worker: ThreadWorker, drafter: Any) -> None:
    with worker.connect() as c:
        hdr = AppHeader(op=OP_STEP, seq=7, session=c.session, body_len=0xFFFFFFF0).pack()
        c.send_raw(hdr + b"\0" * 100)
        r = c.recv()
        assert r.header == AppHeader(op=OP_STEP, seq=7, session=c.session, body_len=0,
                                     status=ST_BAD_FRAME)
        assert c.is_closed()
    with worker.connect() as c:
        assert c.ping(session=0).status == ST_OK


@pytest.mark.parametrize("cut", [10, 24 + 100])  # inside the header, inside the body
def test_partial_frame_deadline(drafter: Any, cut: int) -> None:
    with thread_worker(drafter, partial_frame_timeout_s=0.3) as w, w.connect() as c:
        # a session of this connection: its STEP may be larger than a stranger's frame
        assert c.hello(make_hello(drafter)).status == ST_OK
        body = pack_step(1, [ReqEntry(slot=0, generation=1, anchor_pos=8, anchor_token=1,
                                      n_rows=8)], bytes(8 * drafter.row_bytes),
                         drafter.row_bytes)
        c.send_raw(frame(OP_STEP, 2, c.session, body)[:cut])
        t = time.monotonic()
        assert c.is_closed(timeout=5)
        assert 0.25 < time.monotonic() - t < 3.0
        with w.connect() as c2:
            assert c2.ping(session=0).status == ST_OK


def test_slow_but_steady_frame_is_not_cut(drafter: Any) -> None:
    """A large frame in pieces, each within the deadline of its frame's start, completes."""
    with thread_worker(drafter, partial_frame_timeout_s=1.0) as w, w.connect() as c:
        data = frame(OP_PING, 1, 0) + frame(OP_STATS, 2, 0)
        for i in range(0, len(data), 7):
            c.send_raw(data[i:i + 7])
            time.sleep(0.02)
        assert c.recv().status == ST_OK and c.recv().status == ST_OK


def test_connection_limit(drafter: Any) -> None:
    """At the limit a new connection pushes out the oldest one that holds no session; when
    every connection holds a session it is closed at once."""
    with thread_worker(drafter, max_connections=2) as w:
        a, b = w.connect(), w.connect()
        assert a.hello(make_hello(drafter)).status == ST_OK
        assert b.ping(session=0).status == ST_OK
        c = w.connect()
        assert c.ping(session=0).status == ST_OK  # served: b, without a session, made room
        assert b.is_closed()
        b.close()
        assert c.hello(make_hello(drafter)).status == ST_OK
        e = w.connect()
        assert e.is_closed()  # both hold sessions: closed at once
        e.close()
        a.close()
        deadline = time.monotonic() + 5
        while True:  # the slot frees once the worker has seen a's close
            d = w.connect()
            try:
                if d.ping(session=0).status == ST_OK:
                    break
            except (ConnectionError, OSError):
                pass
            finally:
                d.close()
            assert time.monotonic() < deadline
            time.sleep(0.02)
        c.close()


# -- seeded mutation fuzzing ------------------------------------------------------------------
FUZZ_FRAMES = 4000
FUZZ_SECONDS = 15.0  # a bound for slow machines; the count usually ends it first


def _templates(d: Any, session: int) -> list[tuple[int, bytes, int]]:
    """(op, body, bytes worth mutating) of valid frames for the fuzz session."""
    hello = make_hello(d, client_name="fuzz").pack()
    rows = tap_rows(d.row_bytes, 0, 1, 0, 3).tobytes()
    step = pack_step(1, [ReqEntry(slot=0, generation=1, anchor_pos=3, anchor_token=9,
                                  n_rows=3, flags=RF_NEED_DRAFT | RF_RESET),
                         ReqEntry(slot=1, generation=2, anchor_pos=9, anchor_token=8,
                                  n_out=2, flags=RF_NEED_DRAFT)], rows, d.row_bytes)
    step0 = pack_step(2, [ReqEntry(slot=2, generation=1, anchor_pos=5, anchor_token=1)], b"",
                      d.row_bytes)
    return [(OP_HELLO, hello, len(hello)), (OP_STEP, step, 32 + 96),
            (OP_STEP, step0, len(step0)), (OP_PING, b"", 0), (OP_STATS, b"", 0),
            (OP_RESET, pack_reset([0, 1]), 12)]


def _mutate(rng: np.random.Generator, op: int, body: bytes, hot: int, seq: int,
            session: int, vocab: int) -> bytes:
    kind = rng.integers(10)
    h = AppHeader(op=op, seq=seq, session=session, body_len=len(body))
    if kind == 0:  # header fields (never magic or body_len: those end the stream, tested above)
        raw = bytearray(frame(op, seq, session, body))
        for _ in range(int(rng.integers(1, 3))):
            at = int(rng.choice([4, 5, 6, 7, 8, 9, 10, 11, 16, 17]))
            raw[at] = int(rng.integers(256))
        return bytes(raw)
    b = bytearray(body)
    if kind in (3, 4) and op == OP_STEP:  # legal but unusual values: generations, windows
        e = np.frombuffer(b, dtype=ENTRY_DTYPE, count=struct.unpack_from("<I", b, 8)[0],
                          offset=32).copy()
        for r in e:
            r["generation"] = int(rng.integers(0, 1 << 32)) if rng.random() < 0.3 else \
                int(r["generation"]) + int(rng.integers(-1, 2))
            r["anchor_pos"] = int(r["n_rows"]) + int(rng.integers(0, 80))
            r["anchor_token"] = int(rng.integers(0, vocab))
            r["n_out"] = int(rng.integers(0, 9))
            choices = [0, RF_NEED_DRAFT, RF_RESET, RF_NEED_DRAFT | RF_RESET]
            if not r["n_rows"]:
                choices.append(RF_RELEASE)
            r["flags"] = int(rng.choice(choices))
        b[32:32 + e.nbytes] = e.tobytes()
    elif kind == 1 and b:  # shorter body, length consistent
        b = b[:int(rng.integers(len(b)))]
    elif kind == 2:  # longer body
        b += rng.integers(0, 256, int(rng.integers(1, 64)), dtype=np.uint8).tobytes()
    elif b:
        for _ in range(int(rng.integers(1, 9))):
            span = hot if hot and rng.random() < 0.8 else len(b)
            at = int(rng.integers(span))
            if rng.random() < 0.5:
                b[at] = int(rng.integers(256))
            else:
                b[at] ^= 1 << int(rng.integers(8))
    h.body_len = len(b)
    return h.pack() + bytes(b)


def _rehello(c: Client, d: Any) -> int:
    """HELLO the fuzz session again; a HELLO refused STALE_SEQ (a mutated seq went ahead of
    ours, and the worker remembers it after the session is dropped) starts a new session, as
    a client does. Returns the session id in use."""
    for _ in range(8):
        r = c.hello(make_hello(d, client_name="fuzz"))
        if r.status != ST_STALE_SEQ:
            break
        c.session = (c.session + 0x10001) & 0x7FFFFFFF or 1
    return c.session


def _check_reply(r: Any, sent: bytes, d: Any, window: int) -> None:
    h = AppHeader.unpack(sent)
    assert (r.header.op, r.header.seq, r.header.session) == (h.op, h.seq, h.session)
    assert r.status in FRAME_STATUS_NAMES
    if r.status == ST_OK and h.op == OP_STEP:
        view = decode_step(memoryview(sent)[24:])
        reply = StepReply.unpack(r.body, expect_n_req=view.header.n_req)
        check_reply_values(reply, entries_from_view(view.entries), vocab_size=d.vocab_size,
                           window=window)


def test_mutated_frames(drafter: Any) -> None:
    d = drafter
    with thread_worker(d, log_level="ERROR", max_sessions=8) as w:
        ctl, before = control_session(w, d)
        rng = np.random.default_rng(20240611)
        session = 0x5EED
        templates = _templates(d, session)
        c = Client(w.address, session=session, timeout=5)
        assert c.hello(make_hello(d, client_name="fuzz")).status == ST_OK
        seq = c.seq
        counts = {"sent": 0, "replies": 0, "closed": 0, "ok": 0}
        t_end = time.monotonic() + FUZZ_SECONDS
        for _ in range(FUZZ_FRAMES):
            if time.monotonic() > t_end:
                break
            counts["sent"] += 1
            op, body, hot = templates[int(rng.integers(len(templates)))]
            seq += 1
            data = _mutate(rng, op, body, hot, seq, session, d.vocab_size)
            try:
                c.send_raw(data)
                r = c.recv()
            except (ConnectionError, OSError):
                counts["closed"] += 1  # a version refusal closes; reconnect and go on
                c.close()
                c = Client(w.address, session=session, timeout=5)
                c.seq = seq
                session = _rehello(c, d)
                seq = c.seq
                continue
            counts["replies"] += 1
            counts["ok"] += r.status == ST_OK
            if r.status == ST_OK and r.header.op == OP_STEP:
                counts["steps_ok"] = counts.get("steps_ok", 0) + 1
            try:
                _check_reply(r, data, d, window=32)
            except WireError as exc:  # pragma: no cover - a worker bug
                raise AssertionError(f"bad reply to {data[:64].hex()}: {exc}") from exc
            if r.status == ST_NO_SESSION and r.header.session == session:
                # a mutated HELLO under another id and the same client name replaced it (6.2)
                c.seq = seq
                session = _rehello(c, d)
                seq = c.seq
        c.close()
        # The time bound may end the run early on a loaded machine: judge the frames sent.
        sent = counts["sent"]
        assert sent >= min(FUZZ_FRAMES, 500), counts
        assert counts["replies"] > 0.9 * sent, counts
        assert counts.get("steps_ok", 0) > 80 * sent / FUZZ_FRAMES, counts
        with w.connect() as p:
            assert p.ping(session=0).status == ST_OK
        assert probe(ctl, d) == before  # the control session saw nothing of it
        ctl.close()


def test_half_closed_client_still_gets_its_reply(worker: ThreadWorker, drafter: Any) -> None:
    s = socket.create_connection(worker.address, timeout=5)
    s.sendall(frame(OP_PING, 1, 0))
    s.shutdown(socket.SHUT_WR)
    data = b""
    while len(data) < 24:
        chunk = s.recv(64)
        if not chunk:
            break
        data += chunk
    s.close()
    assert struct.unpack_from("<IHBBIIQ", data)[3] == ST_OK


def test_large_frame_in_uneven_pieces_then_small_frames(drafter: Any) -> None:
    """A STEP of about 1.5 MiB arrives in pieces of uneven size with pauses (the worker raises
    its receive low-water mark while a large body arrives and must never wait for more than the
    body's rest), then small frames follow on the same connection: all are answered."""
    rb = drafter.row_bytes
    n_rows = (3 << 19) // rb
    with thread_worker(drafter, max_rows_per_step=4096,
                       partial_frame_timeout_s=10.0) as w, w.connect() as c:
        assert c.hello(make_hello(drafter, max_rows_per_step=4096)).status == ST_OK
        entries = [ReqEntry(slot=0, generation=1, anchor_pos=n_rows, anchor_token=3,
                            n_rows=n_rows, flags=RF_NEED_DRAFT)]
        rows = tap_rows(rb, 0, 1, 0, n_rows)
        data = frame(OP_STEP, c.next_seq(), c.session,
                     pack_step(1, entries, rows.tobytes(), rb))
        rng = np.random.default_rng(7)
        at = 0
        while at < len(data):
            n = int(rng.choice([1, 1000, 70_000, 300_000, 900_000]))
            c.send_raw(data[at:at + n])
            at += n
            time.sleep(0.01)
        r = c.recv()
        assert r.status == ST_OK
        assert int(r.step().window_rows[0]) == min(n_rows, w.config.window)
        for _ in range(3):
            assert c.ping().status == ST_OK
        # the rows just applied draft as if they had come in one piece
        again = frame(OP_STEP, c.next_seq(), c.session,
                      pack_step(2, [ReqEntry(slot=0, generation=1, anchor_pos=n_rows,
                                             anchor_token=3, flags=RF_NEED_DRAFT)], b"", rb))
        c.send_raw(again)
        r2 = c.recv()
        assert r2.status == ST_OK
        assert r2.step().draft_ids.tolist() == r.step().draft_ids.tolist()
