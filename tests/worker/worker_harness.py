"""The worker tests' harness: a worker in a background thread (its own uvloop loop, real sockets
on port 0) and a small blocking client that speaks frames through ``protocol`` only.

An in-process worker starts in ~10 ms against the shared tiny drafter, so most tests get a fresh
one; the subprocess (tests.support.worker_proc) is for the CLI, signals and the port file.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import secrets
import socket
import threading
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import uvloop
from prometheus_client import CollectorRegistry

from dspark_worker.app import WorkerApp
from dspark_worker.config import WorkerConfig
from protocol import wire
from protocol.auth import sign_hello
from protocol.constants import APP_HEADER_SIZE, RPF_MARGIN, RPF_SAMPLED, SAMPLE_GREEDY
from protocol.framing import FrameDecoder, frame
from protocol.header import AppHeader
from protocol.messages import (
    HELLO_REP,
    Hello,
    HelloReply,
    ReqEntry,
    StepReply,
    pack_reset,
    pack_step,
)

# Small enough that every test's pool and frames are cheap on two shared CPU cores.
TEST_WINDOW = 32
TEST_MAX_SLOTS = 16
TEST_TOTAL_SLOTS = 48
TEST_MAX_ROWS = 256


def worker_config(**overrides: Any) -> WorkerConfig:
    values: dict[str, Any] = dict(
        listen="127.0.0.1:0", metrics_listen="127.0.0.1:0", window=TEST_WINDOW,
        max_slots=TEST_MAX_SLOTS, max_total_slots=TEST_TOTAL_SLOTS,
        max_rows_per_step=TEST_MAX_ROWS, worker_name="test-worker", warmup=False,
        log_level="WARNING", drain_s=0.0)  # stop at once; the drain has its own tests
    values.update(overrides)
    return WorkerConfig(**values)


class ThreadWorker:
    """A ``WorkerApp`` serving from a daemon thread; ``call`` runs a function on its loop."""

    def __init__(self, config: WorkerConfig, drafter: Any) -> None:
        self.config = config
        self.registry = CollectorRegistry()
        self.app = WorkerApp(config, drafter=drafter, registry=self.registry)
        self.loop = uvloop.new_event_loop()
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="test-worker", daemon=True)
        self._thread.start()
        if not self._started.wait(30):
            raise RuntimeError("in-process worker did not start")
        if self._error is not None:
            raise self._error

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self.app.start())
        except BaseException as exc:
            self._error = exc
            self._started.set()
            return
        self._started.set()
        self.loop.run_forever()
        self.loop.run_until_complete(self.loop.shutdown_asyncgens())
        self.loop.close()

    @property
    def address(self) -> tuple[str, int]:
        addr = self.app.tcp_address
        if addr is None:
            raise RuntimeError("no TCP listener")
        return addr

    @property
    def metrics_url(self) -> str:
        addr = self.app.metrics_address
        if addr is None:
            raise RuntimeError("no metrics listener")
        return f"http://{addr[0]}:{addr[1]}"

    def call(self, fn: Callable[[], Any], timeout: float = 10.0) -> Any:
        """Run ``fn`` on the worker's loop thread and return its result."""
        async def run() -> Any:
            return fn()
        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout)

    def hold_runner(self) -> None:
        self.call(lambda: self.app.runner.hold())  # type: ignore[union-attr]

    def release_runner(self) -> None:
        self.call(lambda: self.app.runner.release())  # type: ignore[union-attr]

    def queued_steps(self) -> int:
        return int(self.call(lambda: self.app.runner.queued_steps))  # type: ignore[union-attr]

    def stop(self) -> int:
        code = asyncio.run_coroutine_threadsafe(self.app.stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        return int(code)

    def connect(self, **kw: Any) -> Client:
        return Client(self.address, **kw)

    def scrape(self, path: str = "/metrics") -> tuple[int, str]:
        try:
            with urllib.request.urlopen(self.metrics_url + path, timeout=10) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            with contextlib.closing(e):
                return e.code, e.read().decode()


@dataclass
class Reply:
    header: AppHeader
    body: bytes

    @property
    def status(self) -> int:
        return self.header.status

    def hello(self) -> HelloReply:
        return HelloReply.unpack(self.body)

    def step(self) -> StepReply:
        return StepReply.unpack(self.body)


class Client:
    """Blocking frames over TCP or a Unix socket. ``seq`` rises by one per request."""

    _sessions = itertools.count(0x1000)

    def __init__(self, address: tuple[str, int] | str, *, timeout: float = 20.0,
                 session: int | None = None, source: str | None = None) -> None:
        """``source``: the local address to connect from (127.0.0.2: another peer host on
        the loopback)."""
        if isinstance(address, str):
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.settimeout(timeout)
            self.sock.connect(address)
        else:
            self.sock = socket.create_connection(
                address, timeout=timeout, source_address=(source, 0) if source else None)
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.decoder = FrameDecoder()
        self._pending: deque[Any] = deque()
        self.session = session if session is not None else secrets.randbits(31) | 1
        self.seq = 0
        self.hello_msg: Hello | None = None

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def recv(self) -> Reply:
        """The next reply frame (replies that arrived together are returned in order)."""
        while not self._pending:
            data = self.sock.recv(1 << 20)
            if not data:
                raise ConnectionError("worker closed the connection")
            self._pending.extend(self.decoder.feed(data))
        f = self._pending.popleft()
        return Reply(f.header, bytes(f.body))

    def request(self, op: int, body: bytes = b"", *, seq: int | None = None,
                session: int | None = None) -> Reply:
        seq = self.next_seq() if seq is None else seq
        session = self.session if session is None else session
        self.send_raw(frame(op, seq, session, body))
        r = self.recv()
        assert (r.header.op, r.header.seq, r.header.session) == (op, seq, session), r.header
        return r

    def is_closed(self, timeout: float = 5.0) -> bool:
        """True once the worker has closed this connection (reads to EOF)."""
        self.sock.settimeout(timeout)
        try:
            while True:
                data = self.sock.recv(65536)
                if not data:
                    return True
        except (ConnectionResetError, BrokenPipeError):
            return True
        except TimeoutError:
            return False

    # -- ops --------------------------------------------------------------------------------------
    def hello(self, msg: Hello, *, secret: bytes | None = None, seq: int | None = None,
              session: int | None = None) -> Reply:
        seq = self.next_seq() if seq is None else seq
        session = self.session if session is None else session
        signed = sign_hello(secret, session, seq, msg)
        self.hello_msg = msg
        return self.request(wire.OP_HELLO, signed.pack(), seq=seq, session=session)

    def step(self, entries: list[ReqEntry], rows: bytes | np.ndarray, row_bytes: int, *,
             step_id: int | None = None, seq: int | None = None) -> Reply:
        body = pack_step(self.seq + 1 if step_id is None else step_id, entries,
                         bytes(np.ascontiguousarray(rows).view(np.uint8).reshape(-1))
                         if isinstance(rows, np.ndarray) else rows, row_bytes)
        return self.request(wire.OP_STEP, body, seq=seq)

    def ping(self, session: int | None = None) -> Reply:
        return self.request(wire.OP_PING, session=self.session if session is None else session)

    def stats(self, session: int = 0) -> Reply:
        return self.request(wire.OP_STATS, session=session)

    def reset(self, slots: list[int]) -> Reply:
        return self.request(wire.OP_RESET, pack_reset(slots))


def make_hello(drafter: Any, *, window: int = TEST_WINDOW, max_slots: int = 8,
               max_rows_per_step: int = TEST_MAX_ROWS, sample_mode: int = SAMPLE_GREEDY,
               client_name: str = "", **overrides: Any) -> Hello:
    fields: dict[str, Any] = dict(
        sample_mode=sample_mode, window=window, num_spec=drafter.num_spec, max_slots=max_slots,
        max_rows_per_step=max_rows_per_step, row_bytes=drafter.row_bytes,
        vocab_size=drafter.vocab_size, n_taps=drafter.n_taps, hidden=drafter.target_hidden,
        drafter_identity=drafter.drafter_identity, markov_identity=drafter.markov_identity,
        client_name=client_name)
    fields.update(overrides)
    return Hello(**fields)


def tap_rows(row_bytes: int, slot: int, generation: int, first: int, count: int) -> np.ndarray:
    """Deterministic bf16 tap rows for positions [first, first + count) of one request: finite
    values in [-2, 2] (bf16 bit patterns built from float32), uint8 [count, row_bytes]."""
    width = row_bytes // 2
    pos = np.arange(first, first + count, dtype=np.float64)[:, None]  # [count, 1]
    k = np.arange(width, dtype=np.float64)[None, :]  # [1, width]
    vals = 2.0 * np.sin(0.37 * pos + 0.11 * k + 1.3 * slot + 0.7 * (generation % 97))
    f32 = vals.astype(np.float32)
    bf16 = (f32.view(np.uint32) >> 16).astype(np.uint16)  # truncation is fine for tests
    return bf16.view(np.uint8).reshape(count, row_bytes)


def expected_reply_flags(sampled: bool) -> int:
    return RPF_MARGIN | (RPF_SAMPLED if sampled else 0)


@contextlib.contextmanager
def thread_worker(drafter: Any, **overrides: Any) -> Iterator[ThreadWorker]:
    w = ThreadWorker(worker_config(**overrides), drafter)
    try:
        yield w
    finally:
        w.stop()


HELLO_REPLY_SIZE = HELLO_REP.size
HEADER = APP_HEADER_SIZE


def wait_until(pred: Callable[[], Any], timeout: float = 10.0) -> bool:
    """Poll ``pred`` until it is true or ``timeout`` seconds pass; its last answer."""
    import time

    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


class WithReplay:
    """The drafter, its static-step graphs made by ``replay`` (``drafter.step``: the CPU
    stand-in of a CUDA graph) instead of CUDA; everything else as is."""

    def __init__(self, inner: Any, replay: Any) -> None:
        self._inner, self._replay = inner, replay
        self.modes: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def prepare_graphs(self, pool: Any, largest: int, mode: str = "auto") -> Any:
        self.modes.append(mode)
        return self._inner.prepare_graphs(pool, largest, mode, replay=self._replay)


def check_vectors_and_batching(w: ThreadWorker, d: Any, cases: list[dict[str, Any]],
                               rows: np.ndarray, *, window: int = TEST_WINDOW,
                               probe_token: int = 20) -> None:
    """Session a sends a family's vector cases (slot i = case i, each with its own rows) and
    gets their ids and confidences; session b fills slots 0 and 3 with rows of its own; then
    one STEP of each, held back until both are queued, runs as one device batch (contract 7.2
    step 6) and drafts what each drafts alone. ``probe_token``: b's anchor tokens start there."""
    from protocol.constants import OP_STEP, RF_NEED_DRAFT, ST_OK

    a, b = w.connect(), w.connect()
    try:
        for c in (a, b):
            assert c.hello(make_hello(d, window=window)).status == ST_OK
        entries = [ReqEntry(slot=i, generation=1, anchor_pos=k["anchor_pos"],
                            anchor_token=k["anchor_token"], n_rows=k["n_rows"],
                            flags=RF_NEED_DRAFT) for i, k in enumerate(cases)]
        got = a.step(entries, rows, d.row_bytes).step()
        for i, k in enumerate(cases):
            assert got.draft_ids[i].tolist() == k["ids"]
            np.testing.assert_allclose(got.confidence[i], k["confidence"], atol=1e-4)
        rows_b = np.concatenate([tap_rows(d.row_bytes, s, 5, 0, 12 + s) for s in (0, 3)])
        fill_b = [ReqEntry(slot=s, generation=5, anchor_pos=12 + s, anchor_token=1,
                           n_rows=12 + s) for s in (0, 3)]
        assert b.step(fill_b, rows_b, d.row_bytes).status == ST_OK
        probe_a = [ReqEntry(slot=i, generation=1, anchor_pos=k["anchor_pos"],
                            anchor_token=k["anchor_token"], flags=RF_NEED_DRAFT)
                   for i, k in enumerate(cases)]
        probe_b = [ReqEntry(slot=s, generation=5, anchor_pos=12 + s,
                            anchor_token=probe_token + s, flags=RF_NEED_DRAFT) for s in (0, 3)]
        alone_b = b.step(probe_b, b"", d.row_bytes).step()
        w.hold_runner()
        for c, ents in ((a, probe_a), (b, probe_b)):
            c.send_raw(frame(OP_STEP, c.next_seq(), c.session,
                             pack_step(1, ents, b"", d.row_bytes)))
        assert wait_until(lambda: w.queued_steps() == 2, timeout=20.0), "STEPs not queued"
        w.release_runner()
        ra, rb = a.recv(), b.recv()
        assert ra.status == ST_OK and rb.status == ST_OK
        log = w.call(lambda: list(w.app.runner.batch_log))  # type: ignore[union-attr]
        assert log[-1] == (2, len(cases) + 2)  # two STEPs, every entry, one draft call
        ta, tb = ra.step(), rb.step()
        for i, k in enumerate(cases):
            assert ta.draft_ids[i].tolist() == k["ids"]
        assert tb.draft_ids.tolist() == alone_b.draft_ids.tolist()
        np.testing.assert_allclose(tb.confidence, alone_b.confidence, atol=1e-5)
    finally:
        a.close()
        b.close()
