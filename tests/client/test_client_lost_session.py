"""A session that goes away under a live connection (docs/contract.md sections 3 and 6.2)
against a real worker process: two engines started with one client name, a session moved to
another connection, a GOODBYE, an idle expiry. The frames that follow are real-size STEPs (8
slots of resync, 6-75 KB: over the 4 KiB a connection without a session may send); each is
answered ST_NO_SESSION, its body dropped unbuffered, and the engine HELLOs again and keeps
drafting. Every draft is compared with the reference drafter."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from real_engine import RealEngine, hello_for

from dspark_client.client import RemoteDraftClient
from dspark_client.config import RemoteConfig
from dspark_client.rounds import DraftRounds
from protocol import wire
from protocol.messages import ReqEntry, pack_step
from tests.support.local_drafts import reference_drafter_one_thread
from tests.support.worker_proc import WorkerProcess, start_worker

W, SLOTS = 16, 8
ARGS = ("--window", str(W), "--max-slots", str(SLOTS), "--max-total-slots", "32",
        "--device", "cpu", "--no-warmup")


@pytest.fixture(scope="module")
def drafter() -> Iterator[Any]:
    yield from reference_drafter_one_thread()


def _engine(endpoint: str, drafter: Any, name: str, seed: int) -> tuple[RemoteDraftClient,
                                                                         RealEngine]:
    cfg = RemoteConfig(endpoint=endpoint, connect_timeout_ms=3000, timeout_ms=5000,
                       backoff_ms=20, backoff_max_ms=200)
    c = RemoteDraftClient(cfg, hello_for(drafter, window=W, max_slots=SLOTS, client_name=name))
    assert c.wait_ready(10.0), (c.last_error, c.disabled_reason)
    eng = RealEngine(DraftRounds(c), drafter, seed=seed)
    for s in range(SLOTS):
        eng.admit(s, 4)  # the first STEP: 8 slots x 4 rows of 768 bytes, 25 KB
    return c, eng


def _round(eng: RealEngine) -> bool:
    """One round over every slot; True when it drafted (and the drafts are right)."""
    reqs, res = eng.run(list(range(SLOTS)))
    eng.check(reqs, res)
    for s in range(SLOTS):  # the engine accepts a few drafts: 1-7 new rows per slot
        if eng.fresh.get(s, 0) == 0:
            eng.accept(s, int(res.num_drafted[s]) if res.ok else 0)
    return bool(res.ok and int(res.num_drafted.sum()) > 0)


def test_two_engines_under_one_client_name_both_keep_drafting(drafter: Any) -> None:
    with start_worker(*ARGS) as w:
        assert w.endpoint is not None
        a, ea = _engine(w.endpoint, drafter, "dp0@host", seed=1)
        b, eb = _engine(w.endpoint, drafter, "dp0@host", seed=2)  # the same name, by mistake
        drafted = {"a": 0, "b": 0}
        try:
            for _ in range(20):
                for name, eng in (("a", ea), ("b", eb)):
                    drafted[name] += _round(eng)
                    time.sleep(0.005)
            assert a.disabled_reason is None and b.disabled_reason is None
            # Both draft (the first rounds may resync): neither engine is shut out.
            assert drafted["a"] >= 15 and drafted["b"] >= 15, drafted
            assert ea.checked and eb.checked
        finally:
            a.close()
            b.close()
        log = w.log_text()
    # Told why, once: the worker kept the first engine's session beside the second's.
    assert log.count("two engines use this client name") == 1, log[-3000:]
    assert "Traceback" not in log


class _Raw:
    """A blocking frame connection (what a client does, with no reconnect logic)."""

    def __init__(self, w: WorkerProcess) -> None:
        assert w.host and w.port
        self.sock = socket.create_connection((w.host, w.port), timeout=10)
        self.dec = wire.FrameDecoder()
        self.got: list[Any] = []

    def request(self, op: int, seq: int, session: int, body: bytes = b"") -> int:
        self.sock.sendall(wire.frame(op, seq, session, body))
        while not self.got:
            data = self.sock.recv(1 << 16)
            assert data, "the worker closed the connection"
            self.got.extend(self.dec.feed(data))
        f = self.got.pop(0)
        assert (f.header.op, f.header.seq, f.header.session) == (op, seq, session)
        return int(f.header.status)

    def close(self) -> None:
        self.sock.close()


def _big_step(drafter: Any, seq: int) -> bytes:
    """A resync of 8 slots x 4 rows (25 KB): real-size, over the sessionless body limit."""
    rb = drafter.row_bytes
    entries = [ReqEntry(slot=s, generation=1, anchor_pos=4, anchor_token=3, n_rows=4,
                        flags=wire.RF_NEED_DRAFT) for s in range(SLOTS)]
    rows = np.full((SLOTS * 4, rb), 0x3F, dtype=np.uint8).tobytes()
    return pack_step(seq, entries, rows, rb)


def test_frames_of_a_gone_session_are_answered_no_session(drafter: Any) -> None:
    """Moved, released with GOODBYE, expired: every large frame after it is answered
    ST_NO_SESSION, the connection stays open and aligned, and HELLO brings the engine back.
    GOODBYE retires its own seq: a HELLO with exactly that seq is refused."""
    with start_worker(*ARGS, "--session-idle-s", "1") as w:
        hello = hello_for(drafter, window=W, max_slots=SLOTS, client_name="e").pack()
        step = _big_step(drafter, 1)
        assert len(step) > 16 << 10
        # moved: the session's HELLO on a second connection takes it
        c1, c2 = _Raw(w), _Raw(w)
        assert c1.request(wire.OP_HELLO, 1, 0x51, hello) == wire.ST_OK
        assert c1.request(wire.OP_STEP, 2, 0x51, step) == wire.ST_OK
        assert c2.request(wire.OP_HELLO, 3, 0x51, hello) == wire.ST_OK
        for seq in (4, 5):
            assert c1.request(wire.OP_STEP, seq, 0x51, step) == wire.ST_NO_SESSION
        assert c1.request(wire.OP_PING, 6, 0) == wire.ST_OK  # the stream is aligned
        assert c1.request(wire.OP_HELLO, 7, 0x51, hello) == wire.ST_OK  # and back
        assert c1.request(wire.OP_STEP, 8, 0x51, step) == wire.ST_OK
        # GOODBYE: the session is gone, and its seq with it
        assert c1.request(wire.OP_GOODBYE, 20, 0x51) == wire.ST_OK
        assert c1.request(wire.OP_STEP, 21, 0x51, step) == wire.ST_NO_SESSION
        assert c1.request(wire.OP_HELLO, 20, 0x51, hello) == wire.ST_STALE_SEQ
        assert c1.request(wire.OP_HELLO, 22, 0x51, hello) == wire.ST_OK
        # expired (session_idle_s 1 s, below the connection's idle time)
        time.sleep(2.5)
        assert c1.request(wire.OP_STEP, 23, 0x51, step) == wire.ST_NO_SESSION
        assert c1.request(wire.OP_HELLO, 24, 0x51, hello) == wire.ST_OK
        assert c1.request(wire.OP_STEP, 25, 0x51, step) == wire.ST_OK
        c1.close()
        c2.close()
        log = w.log_text()
    assert "Traceback" not in log
