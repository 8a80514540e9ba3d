"""Test doubles for the client tests: a scripted fake worker speaking protocol frames over a real
socket, a small geometry, deterministic tap rows, and a recording transport.

The fake worker follows the contract where the client depends on it (sessions bound to
connections, the seq guard, 7.1 generations, 7.2 step 4 windows and step 5 statuses, 9.1/9.3
sampled proposals) and checks every STEP with ``protocol.validate.check_step_shape`` and every
row it receives against ``row_pattern``, so rounds that send the wrong rows are caught here.
Its drafts are a pure function of (anchor token, window rows, position) so tests know what to
expect. Hooks inject what a real worker never sends: bad replies, cuts, silence.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from protocol import sampled as psampled
from protocol import wire
from protocol.auth import verify_hello
from protocol.errors import FrameTooLargeError, WireError
from protocol.framing import FrameDecoder
from protocol.messages import decode_step, entries_from_view, reply_layout
from protocol.validate import check_step_shape

W, N, ROW_BYTES, VOCAB, MAX_SLOTS, MAX_ROWS = 8, 4, 32, 97, 8, 256
N_TAPS, HIDDEN = 2, 8  # ROW_BYTES == N_TAPS * HIDDEN * 2
DRAFTER_ID = bytes(range(32))
MARKOV_ID = bytes(range(100, 132))


def make_hello(sampled: bool = False, **over: Any) -> wire.Hello:
    fields: dict[str, Any] = dict(
        sample_mode=wire.SAMPLE_TOP32 if sampled else wire.SAMPLE_GREEDY, window=W, num_spec=N,
        max_slots=MAX_SLOTS, max_rows_per_step=MAX_ROWS, row_bytes=ROW_BYTES, vocab_size=VOCAB,
        n_taps=N_TAPS, hidden=HIDDEN, drafter_identity=DRAFTER_ID, markov_identity=MARKOV_ID,
        client_name="test-engine")
    fields.update(over)
    return wire.Hello(**fields)


def make_hello_reply(**over: Any) -> wire.HelloReply:
    fields: dict[str, Any] = dict(
        capabilities=wire.CAP_TAPS_BF16 | wire.CAP_TOP32 | wire.CAP_MARGIN, window=W,
        num_spec=N, max_slots=MAX_SLOTS, max_rows_per_step=MAX_ROWS, row_bytes=ROW_BYTES,
        vocab_size=VOCAB, drafter_identity=DRAFTER_ID, markov_identity=MARKOV_ID,
        worker_name="fake-worker", n_taps=N_TAPS, hidden=HIDDEN)
    fields.update(over)
    return wire.HelloReply(**fields)


def row_pattern(slot: int, generation: int, pos: int, row_bytes: int = ROW_BYTES) -> np.ndarray:
    """The tap row of (slot, generation, position): distinct for every triple that tests use."""
    base = (slot * 7919 + generation * 104729 + pos * 131) & 0xFFFFFFFF
    return ((np.arange(row_bytes, dtype=np.uint64) * 2654435761 + base) % 251).astype(np.uint8)


def rows_for(slot: int, generation: int, first: int, last: int,
             row_bytes: int = ROW_BYTES) -> np.ndarray:
    """Rows of positions [first, last) as a uint8 [n, row_bytes] array."""
    if last <= first:
        return np.zeros((0, row_bytes), np.uint8)
    return np.stack([row_pattern(slot, generation, p, row_bytes) for p in range(first, last)])


def fake_draft(anchor_token: int, window_rows: int, j: int) -> int:
    return (anchor_token * 3 + window_rows * 5 + j * 11 + 1) % VOCAB


def fake_logits(slot: int, anchor_pos: int, j: int) -> np.ndarray:
    rng = np.random.default_rng([slot, anchor_pos, j])
    return rng.normal(size=VOCAB) * 3.0


@dataclass
class SlotState:
    generation: int
    start: int = 0
    end: int = 0
    rows: dict[int, bytes] = field(default_factory=dict)


@dataclass
class FakeSession:
    session_id: int
    hello: wire.Hello
    conn_id: int
    last_seq: int
    slots: dict[int, SlotState] = field(default_factory=dict)


@dataclass
class StepCtx:
    """What a step hook sees: the request, and the reply about to go out (mutable)."""

    worker: FakeWorker
    conn_id: int
    header: wire.AppHeader
    entries: list[wire.ReqEntry]
    reply: wire.StepReply | None
    session: FakeSession | None


# What a hook may return: None (send the reply), "close" (close before replying), "cut" (send
# part of the reply, then close), "silent" (send nothing, keep reading), ("status", ST) (answer
# that frame status instead), ("delay", seconds) (sleep, then reply), ("frame", bytes) (send
# these bytes as the reply).
Action = Any


class FakeWorker:
    """A threaded, scripted worker on 127.0.0.1:0 (or a Unix socket)."""

    def __init__(self, *, unix: bool = False, hello_reply: wire.HelloReply | None = None,
                 hello_status: int | None = None, check_rows: bool = True,
                 margin: bool = True, secret: bytes | None = None,
                 max_body: int | None = None, reply_flags: int = 0) -> None:
        self.secret = secret
        # Like the worker's --max-frame-bytes: a larger frame is answered ST_BAD_FRAME from its
        # header and the connection closed (unread bytes then reset the sender).
        self.max_body = max_body
        self.too_large: list[int] = []  # body_len of every frame refused for its size
        self.hello_reply = hello_reply or make_hello_reply()
        self.hello_status = hello_status
        self.check_rows = check_rows
        self.margin = margin
        self.reply_flags = reply_flags  # more StepReply flags (RPF_NO_CONFIDENCE)
        self.step_hook: Callable[[StepCtx], Action] | None = None
        self.hello_hook: Callable[[wire.AppHeader, wire.Hello], Action] | None = None
        self.sessions: dict[int, FakeSession] = {}
        self.errors: list[str] = []  # contract breaches seen in what the client sent
        self.frames: list[tuple[int, wire.AppHeader, bytes]] = []  # (conn, header, body)
        self.steps: list[tuple[wire.AppHeader, list[wire.ReqEntry]]] = []
        self.connections = 0
        self.confidence = 0.9
        self.stats_limits: dict[str, Any] = {"max_sessions": 64, "max_total_slots": 512,
                                             "session_idle_s": 600.0}
        self.lock = threading.RLock()
        self._conns: dict[int, socket.socket] = {}
        self._threads: list[threading.Thread] = []
        self._closed = False
        self._tmpdir: tempfile.TemporaryDirectory[str] | None = None
        if unix:
            self._tmpdir = tempfile.TemporaryDirectory(prefix="dspark-fake-")
            path = os.path.join(self._tmpdir.name, "w.sock")
            self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._listener.bind(path)
            self.endpoint = f"unix://{path}"
        else:
            self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._listener.bind(("127.0.0.1", 0))
            self.endpoint = f"tcp://127.0.0.1:{self._listener.getsockname()[1]}"
        self._listener.listen(16)
        t = threading.Thread(target=self._accept_loop, name="fake-accept", daemon=True)
        t.start()
        self._threads.append(t)

    # -- life -----------------------------------------------------------------------------------
    def __enter__(self) -> FakeWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        self.drop_connections()
        for t in self._threads:
            t.join(timeout=5)
        if self._tmpdir is not None:
            self._tmpdir.cleanup()

    def drop_connections(self) -> None:
        """Cut every open connection (as a crashed worker would)."""
        with self.lock:
            conns = list(self._conns.values())
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            with self.lock:
                self.connections += 1
                conn_id = self.connections
                self._conns[conn_id] = sock
            t = threading.Thread(target=self._conn_loop, args=(conn_id, sock),
                                 name=f"fake-conn-{conn_id}", daemon=True)
            t.start()
            self._threads.append(t)

    def _conn_loop(self, conn_id: int, sock: socket.socket) -> None:
        dec = FrameDecoder() if self.max_body is None else FrameDecoder(max_body=self.max_body)
        try:
            while True:
                data = sock.recv(1 << 16)
                if not data:
                    return
                try:
                    frames = dec.feed(data)
                except FrameTooLargeError:
                    h = dec.error_header
                    if h is not None:
                        with self.lock:
                            self.too_large.append(h.body_len)
                        sock.sendall(wire.frame(h.op, h.seq, h.session, b"",
                                                status=wire.ST_BAD_FRAME))
                    return
                except WireError as exc:
                    self.errors.append(f"conn {conn_id}: undecodable stream: {exc}")
                    return
                for fr in frames:
                    body = bytes(fr.body)
                    with self.lock:
                        self.frames.append((conn_id, fr.header, body))
                        action = self._handle(conn_id, fr.header, body)
                    if not self._act(sock, action):
                        return
        except OSError:
            return
        finally:
            with self.lock:
                self._conns.pop(conn_id, None)
            sock.close()

    def _act(self, sock: socket.socket, action: Action) -> bool:
        """Carry out one reply action; False when the connection must end."""
        kind, payload = action
        if kind == "close":
            return False
        if kind == "silent":
            return True
        if kind == "delay":
            seconds, frame = payload
            time.sleep(seconds)
            sock.sendall(frame)
            return True
        if kind == "cut":
            sock.sendall(payload[:max(1, len(payload) // 2)])
            return False
        sock.sendall(payload)
        return True

    # -- handling ---------------------------------------------------------------------------------
    def _handle(self, conn_id: int, h: wire.AppHeader, body: bytes) -> tuple[str, Any]:
        if h.op == wire.OP_PING:
            return ("send", wire.frame(h.op, h.seq, h.session, b""))
        if h.op == wire.OP_STATS:
            return ("send", wire.frame(h.op, h.seq, h.session, self.stats_json()))
        if h.op == wire.OP_GOODBYE:
            s = self._session_for(conn_id, h)
            if isinstance(s, int):
                return ("send", wire.frame(h.op, h.seq, h.session, b"", status=s))
            del self.sessions[h.session]
            return ("send", wire.frame(h.op, h.seq, h.session, b""))
        if h.op == wire.OP_HELLO:
            return self._hello(conn_id, h, body)
        if h.op == wire.OP_RESET:
            s = self._session_for(conn_id, h)
            if isinstance(s, int):
                return ("send", wire.frame(h.op, h.seq, h.session, b"", status=s))
            s.slots.clear()
            return ("send", wire.frame(h.op, h.seq, h.session, b""))
        if h.op == wire.OP_STEP:
            return self._step(conn_id, h, body)
        return ("send", wire.frame(h.op, h.seq, h.session, b"", status=wire.ST_BAD_FRAME))

    def stats_json(self) -> bytes:
        """What the real worker's STATS says of its geometry, identities, limits, sessions."""
        r = self.hello_reply
        return json.dumps({
            "worker_name": r.worker_name, "contract_version": wire.VERSION, "ready": True,
            "geometry": {"window": r.window, "num_spec": r.num_spec, "row_bytes": r.row_bytes,
                         "vocab_size": r.vocab_size, "n_taps": r.n_taps, "hidden": r.hidden,
                         "capabilities": r.capabilities},
            "drafter_identity": r.drafter_identity.hex(),
            "markov_identity": r.markov_identity.hex(),
            "limits": {"max_slots": r.max_slots, "max_rows_per_step": r.max_rows_per_step,
                       **self.stats_limits},
            # As the real worker shows sessions to a stranger: by label, not name or id.
            "sessions": [{"label": f"{x.session_id:012x}", "max_slots": x.hello.max_slots,
                          "slots_in_use": len(x.slots), "connected": True, "idle_s": 0.0}
                         for x in self.sessions.values()],
        }).encode()

    def _hello(self, conn_id: int, h: wire.AppHeader, body: bytes) -> tuple[str, Any]:
        rep = self.hello_reply.pack()
        hello = wire.Hello.unpack(body)
        if self.hello_hook is not None:
            action = self.hello_hook(h, hello)
            if action is not None:
                return self._translate(h, action, rep)
        if not verify_hello(self.secret, h.session, h.seq, hello):
            return ("send", wire.frame(h.op, h.seq, h.session, rep, status=wire.ST_AUTH))
        if self.hello_status is not None:
            return ("send", wire.frame(h.op, h.seq, h.session, rep, status=self.hello_status))
        old = self.sessions.get(h.session)
        if old is not None and h.seq <= old.last_seq:
            return ("send", wire.frame(h.op, h.seq, h.session, rep, status=wire.ST_STALE_SEQ))
        for sid, s in list(self.sessions.items()):  # same client name: replaced (6.2)
            if sid != h.session and s.hello.client_name == hello.client_name:
                del self.sessions[sid]
        resumed = old is not None and old.hello.without_auth() == hello.without_auth()
        if resumed and old is not None:
            old.conn_id, old.last_seq = conn_id, h.seq
        else:
            self.sessions[h.session] = FakeSession(h.session, hello, conn_id, h.seq)
        rep = (self.hello_reply.__class__(**{**_fields(self.hello_reply), "resumed": int(resumed)})
               .pack())
        return ("send", wire.frame(h.op, h.seq, h.session, rep))

    def _session_for(self, conn_id: int, h: wire.AppHeader) -> FakeSession | int:
        s = self.sessions.get(h.session)
        if s is None or s.conn_id != conn_id:
            return wire.ST_NO_SESSION
        if h.seq <= s.last_seq:
            return wire.ST_STALE_SEQ
        s.last_seq = h.seq
        return s

    def _step(self, conn_id: int, h: wire.AppHeader, body: bytes) -> tuple[str, Any]:
        s = self._session_for(conn_id, h)
        if isinstance(s, int):
            return self._hooked(conn_id, h, [], None, None,
                                ("send", wire.frame(h.op, h.seq, h.session, b"", status=s)))
        hello = s.hello
        sampled = hello.sample_mode == wire.SAMPLE_TOP32
        try:
            view = decode_step(body)
            check_step_shape(view, row_bytes=hello.row_bytes, max_slots=hello.max_slots,
                             max_rows_per_step=hello.max_rows_per_step,
                             num_spec=hello.num_spec, sampled=sampled)
        except WireError as exc:
            self.errors.append(f"bad STEP: {exc}")
            return ("send", wire.frame(h.op, h.seq, h.session, b"", status=wire.ST_BAD_FRAME))
        entries = entries_from_view(view.entries)
        self.steps.append((h, entries))
        flags = ((wire.RPF_MARGIN if self.margin else 0) | (wire.RPF_SAMPLED if sampled else 0)
                 | self.reply_flags)
        reply = wire.StepReply.empty(view.header.step_id, len(entries), hello.num_spec, flags)
        row_at = 0
        for i, e in enumerate(entries):
            rows = view.rows[row_at:row_at + e.n_rows]
            row_at += e.n_rows
            self._apply_entry(s, i, e, rows, reply, sampled)
        return self._hooked(conn_id, h, entries, reply, s, None)

    def _apply_entry(self, s: FakeSession, i: int, e: wire.ReqEntry, rows: np.ndarray,
                     reply: wire.StepReply, sampled: bool) -> None:
        Wn, Nn = s.hello.window, s.hello.num_spec
        reply.generation[i] = e.generation & wire.U32_MASK
        st = s.slots.get(e.slot)
        if st is not None and _older(e.generation, st.generation):
            reply.status[i] = wire.RS_STALE_GENERATION
            return
        if e.flags & wire.RF_RELEASE:
            s.slots.pop(e.slot, None)
            return
        if st is None or st.generation != e.generation:
            st = s.slots[e.slot] = SlotState(e.generation)
        first = e.anchor_pos - e.n_rows
        if self.check_rows:
            for k in range(e.n_rows):
                want = row_pattern(e.slot, e.generation, first + k, s.hello.row_bytes)
                if not np.array_equal(rows[k], want):
                    self.errors.append(f"slot {e.slot} gen {e.generation}: row of position"
                                       f" {first + k} is not the expected row")
                    break
        if e.n_rows:
            if e.flags & wire.RF_RESET or not (st.start <= first <= st.end and st.end > st.start):
                st.rows.clear()
                st.start = first
            for k in range(e.n_rows):
                st.rows[first + k] = bytes(rows[k])
            st.end = e.anchor_pos
            st.start = max(st.start, st.end - Wn)
        elif e.flags & wire.RF_RESET:
            st.rows.clear()
            st.start = st.end = e.anchor_pos
        elif st.end > e.anchor_pos:
            st.end = e.anchor_pos
            st.start = min(st.start, st.end)
        held = st.end - st.start if st.end == e.anchor_pos else 0
        wr = min(held, Wn)
        expected = min(Wn, e.anchor_pos)
        reply.window_rows[i] = wr
        if not e.flags & wire.RF_NEED_DRAFT:
            return
        if wr == expected:
            reply.status[i] = wire.RS_OK
        elif wr > 0:
            reply.status[i] = wire.RS_PARTIAL_WINDOW
        else:
            reply.status[i] = wire.RS_NO_WINDOW
            return
        k = Nn if e.n_out == 0 else min(e.n_out, Nn)
        if sampled and e.top_k > 0:
            assert reply.sampled_mask is not None
            assert reply.support_ids is not None and reply.proposal_q is not None
            reply.sampled_mask[i] = 1
            u = psampled.draw_u(e.seed, e.generation & wire.U32_MASK,
                                e.anchor_pos + 1 + np.arange(k))
            for j in range(k):
                ids, q = psampled.build_q(fake_logits(e.slot, e.anchor_pos, j), e.top_k,
                                          e.temperature, e.top_p)
                reply.support_ids[i, j], reply.proposal_q[i, j] = ids, q
                reply.draft_ids[i, j] = int(psampled.draw(ids, q, u[j]))
        else:
            for j in range(k):
                reply.draft_ids[i, j] = fake_draft(e.anchor_token, wr, j)
        reply.confidence[i, :k] = self.confidence
        if reply.margin is not None:
            reply.margin[i, :k] = 1.5

    def _hooked(self, conn_id: int, h: wire.AppHeader, entries: list[wire.ReqEntry],
                reply: wire.StepReply | None, session: FakeSession | None,
                default: tuple[str, Any] | None) -> tuple[str, Any]:
        action = None
        if self.step_hook is not None:
            action = self.step_hook(StepCtx(self, conn_id, h, entries, reply, session))
        if default is not None and action is None:
            return default
        body = reply.pack() if reply is not None else b""
        return self._translate(h, action, body)

    def _translate(self, h: wire.AppHeader, action: Action, body: bytes) -> tuple[str, Any]:
        frame = wire.frame(h.op, h.seq, h.session, body)
        if action is None:
            return ("send", frame)
        if action in ("close", "silent"):
            return (action, None)
        if action == "cut":
            return ("cut", frame)
        kind, value = action
        if kind == "status":
            return ("send", wire.frame(h.op, h.seq, h.session, b"", status=value))
        if kind == "delay":
            return ("delay", (value, frame))
        if kind == "frame":
            return ("send", value)
        raise ValueError(f"unknown hook action {action!r}")


def _fields(s: Any) -> dict[str, Any]:
    return {f: getattr(s, f) for f in s.__struct_fields__}


def _older(a: int, b: int) -> bool:
    """Serial-number arithmetic on u32 (7.1): a is older than b."""
    d = (b - a) & wire.U32_MASK
    return 0 < d < (1 << 31)


def reply_size(n_req: int, sampled: bool) -> int:
    flags = wire.RPF_MARGIN | (wire.RPF_SAMPLED if sampled else 0)
    return reply_layout(n_req, N, flags).size


class RecordingTransport:
    """An RpcClient that records what it is asked to send and answers from a callable. Used
    to check that rows are never copied (the parts handed over share memory with them)."""

    def __init__(self, answer: Callable[[list[Any]], bytes]) -> None:
        self.answer = answer
        self.sent: list[list[Any]] = []
        self.closed = False

    def connect(self, timeout: float) -> None:
        pass

    def request(self, msg: Any, buf: bytearray, timeout: float) -> int:
        return self.request_parts((msg,), buf, timeout)

    def request_parts(self, parts: Any, buf: bytearray, timeout: float) -> int:
        self.sent.append(list(parts))
        out = self.answer(list(parts))
        if len(buf) < len(out):
            buf.extend(bytes(len(out) - len(buf)))
        buf[:len(out)] = out
        return len(out)

    def close(self) -> None:
        self.closed = True
