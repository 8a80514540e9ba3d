"""STEP round trips against a real ``dspark-worker`` subprocess, and the worker's host-side
bookkeeping per STEP without torch.

    python bench/bench_worker.py [--iters 300] [--rounds 3] [--threads N] [--device auto]
                                 [--unix] [--skip-rtt] [--skip-bookkeeping]
    python bench/bench_worker.py --transports [--rounds 3] [--device cpu]
    python bench/bench_worker.py --engine-shaped [--steps 100]
    python bench/bench_worker.py --handoffs [--iters 300]

1. RTT: frames of about 4 KiB, 256 KiB and 4 MiB (1, 4 and 8 entries; rows of the embedded
   drafter, 768 bytes each, every entry RF_RESET so each STEP re-applies the same rows), in two
   modes: ``rows`` (no entry drafts: decode, checks, rows projected into the rings, reply) and
   ``draft`` (every entry RF_NEED_DRAFT: the same plus one batched draft of the tiny model on
   the CPU). Reports RTT, the reply's ``worker_us`` (frame's last byte to reply) and
   RTT - worker_us (transport, client, and the worker's receive before the last byte), p50 and
   p99 in microseconds. Every case runs in ``--rounds`` rounds; each round is followed, for the
   same STEP, by
   - the floor: bench/floor.py's raw echo (a blocking server in its own process) of the same
     request and reply bytes, holding each request as long as the worker's p50 worker_us (busy,
     as the worker computes) and reporting RTT minus the time held. The hold matters on a VM:
     a client that waits milliseconds for its reply wakes up slower than one in a tight
     ping-pong, and that cost is the machine's, not the transport's;
   - bench/zmq_worker.py: the same STEP through a ZMQ REQ/REP + JSON server that applies the
     rows to the same ring pool and drafts with the same drafter, the full RTT compared.
   The worker and the ZMQ server get ``--threads`` intra-op threads (default: every CPU) and
   the same ``--device`` (default auto: CUDA when there is one, as the worker picks).
   A PING round trip first: the transport and dispatch alone.
3. ``--transports``: STEP round trips with rows only (every entry RF_RESET, none drafts) of
   about 4 KiB, 256 KiB, 4 MiB, 16 MiB and 64 MiB over TCP, the Unix socket and the Unix socket
   with the rows in a shared-memory region (contract section 13; the rows are written into the
   region once, as an engine's device-to-host copy would land there), against one worker
   (W 1024, every row lands in a ring: entries of at most W rows). Beside each: one memcpy of
   the rows (numpy, into a preallocated buffer) and the raw echo of the same request and reply
   bytes over TCP and over a Unix socket (bench/floor.py). Also the worker's ingest rate (rows
   and bytes per second of worker_us) per transport. Cases interleave transport by transport
   within each round, so the ratios compare figures taken minutes apart at most.
4. ``--engine-shaped``: ``dspark-client bench`` (64 slots, 5 rows per slot per round) against a
   worker whose drafter reads Qwen3-4B-sized tap rows (5 taps x 2560, 25,600 bytes; a small
   random drafter behind them, written to a temporary checkpoint) over tcp://, unix:// and
   unix+shm://.
2. Bookkeeping at 256 entries, in this process, with a drafter and ring pool that do nothing:
   decode + shape checks + generations/session bookkeeping (dispatch) + the runner's window
   statuses + the drafter's inputs + reply encode + reply header (dispatch.complete). Only the
   time inside the (null) drafter call is excluded.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import socket
import statistics
import struct
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from protocol.constants import (  # noqa: E402
    APP_HEADER_SIZE,
    OP_HELLO,
    OP_PING,
    OP_SHM_ATTACH,
    OP_STEP,
    RF_NEED_DRAFT,
    RF_RESET,
    ST_OK,
)
from protocol.framing import frame  # noqa: E402
from protocol.header import AppHeader  # noqa: E402
from protocol.messages import Hello, ReqEntry, pack_step, rows_offset_for  # noqa: E402

sys.path.insert(0, str(ROOT / "bench"))
from floor import bench_raw  # noqa: E402
from zmq_worker import ZmqDraftServer  # noqa: E402

REPLY_HEADER = struct.Struct("<QIHHII")
SEQ, SEQ_OFFSET = struct.Struct("<Q"), APP_HEADER_SIZE - 8  # the header's last field
SIZES = (4 << 10, 256 << 10, 4 << 20)
WINDOW = 1024


def shape_for(size: int, row_bytes: int) -> tuple[int, int]:
    n_req = 1 if size <= 8 << 10 else (4 if size <= 512 << 10 else 8)
    rows = max(1, (size - APP_HEADER_SIZE - 32 - 48 * n_req) // row_bytes)
    return n_req, rows - rows % n_req or n_req


def q(xs: list[float]) -> tuple[float, float]:
    a = np.asarray(xs)
    return float(np.percentile(a, 50)), float(np.percentile(a, 99))


class RawClient:
    def __init__(self, address: Any) -> None:
        if isinstance(address, str):
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.connect(address)
        else:
            self.sock = socket.create_connection(address)
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = bytearray(1 << 20)
        self.view = memoryview(self.buf)
        self.seq = 0  # of the last request sent

    def exchange(self, data: bytes) -> tuple[AppHeader, memoryview]:
        self.sock.sendall(data)
        got = 0
        while got < APP_HEADER_SIZE:
            got += self.sock.recv_into(self.view[got:])
        h = AppHeader.unpack(self.buf)
        need = APP_HEADER_SIZE + h.body_len
        while got < need:
            got += self.sock.recv_into(self.view[got:need])
        return h, self.view[APP_HEADER_SIZE:need]


def bench_rtt(iters: int, unix: bool, rounds: int, threads: int, device: str) -> None:
    from dspark_worker.drafter import embedded_default
    from tests.support.worker_proc import start_worker

    d = embedded_default()
    rb = d.row_bytes
    extra = ["--window", str(WINDOW), "--max-rows-per-step", "8192", "--max-slots", "16",
             "--max-total-slots", "16", "--metrics-listen", "none", "--log-level", "WARNING",
             "--device", device]
    tmp = tempfile.mkdtemp(prefix="dspark-bench-")
    sock_path = f"{tmp}/w.sock"
    if unix:
        extra += ["--unix", sock_path]
    # start_worker gives a worker one intra-op thread (for tests sharing a small box); a
    # benchmark gives it, and the ZMQ server, the same count.
    with start_worker(*extra, env={"OMP_NUM_THREADS": str(threads)}) as w:
        address: Any = sock_path if unix else (w.host, w.port)
        c = RawClient(address)
        hello = Hello(sample_mode=0, window=WINDOW, num_spec=d.num_spec, max_slots=16,
                      max_rows_per_step=8192, row_bytes=rb, vocab_size=d.vocab_size,
                      n_taps=d.n_taps, hidden=d.target_hidden,
                      drafter_identity=d.drafter_identity, markov_identity=d.markov_identity,
                      client_name="bench")
        session = 0xB0B
        c.seq = 1
        h, _ = c.exchange(frame(OP_HELLO, c.seq, session, hello.pack()))
        if h.status != ST_OK:
            raise SystemExit(f"HELLO refused: {h.status}")
        ping_rtt = []
        for i in range(2 * iters):
            c.seq += 1
            data = frame(OP_PING, c.seq, 0)
            t0 = time.perf_counter()
            c.exchange(data)
            if i >= iters // 5:
                ping_rtt.append((time.perf_counter() - t0) * 1e6)
        p50, p99 = q(ping_rtt)
        print(f"worker pid {w.pid} over {'unix' if unix else 'tcp'}; PING RTT p50 {p50:.0f}"
              f" p99 {p99:.0f} us (transport + dispatch, no device work)")
        rng = np.random.default_rng(0)
        cases = []
        for size in SIZES:
            n_req, n_rows = shape_for(size, rb)
            per = n_rows // n_req
            rows = (rng.integers(0, 2**16, size=(n_rows, rb // 2), dtype=np.uint16)
                    & 0x3FFF).astype(np.uint16).view(np.uint8).tobytes()  # finite bf16
            for mode in ("rows", "draft"):
                flags = RF_RESET | (RF_NEED_DRAFT if mode == "draft" else 0)
                entries = [ReqEntry(slot=i, generation=1, anchor_pos=per + 10, anchor_token=1,
                                    n_rows=per, flags=flags) for i in range(n_req)]
                # One frame, its seq rewritten in place: the client's side is a sendall of a
                # ready buffer, as in bench/floor.py.
                data = bytearray(frame(OP_STEP, 0, session, pack_step(1, entries, rows, rb)))
                cases.append(Case(
                    label=f"{len(data):>12} {n_req:>7} {n_rows:>5} {mode:>5}", frame=data,
                    iters=max(30, iters if size <= 256 << 10 else iters // 4), rows=rows,
                    entries=[[e.slot, e.generation, e.anchor_pos, e.anchor_token, e.n_rows,
                              e.flags] for e in entries]))
        results: list[list[tuple[float, ...]]] = [[] for _ in cases]
        zmq_server: Any = (contextlib.nullcontext() if unix
                           else ZmqDraftServer(WINDOW, 16, threads, device))
        with zmq_server as z:
            for _ in range(rounds):
                for k, case in enumerate(cases):
                    results[k].append(run_case(c, case, z))
        print(f"STEP, microseconds; each figure the median over {rounds} rounds of its p50 or"
              " p99. floor: the raw echo of")
        print("the same bytes held for the worker's p50; zmq: the same STEP through a ZMQ"
              " REQ/REP + JSON server doing the same work")
        print(f"{'frame bytes':>12} {'entries':>7} {'rows':>5} {'mode':>5} | {'RTT p50':>8}"
              f" {'p99':>8} | {'worker p50':>10} {'p99':>8} | {'RTT-wrk p50':>11} {'p99':>8}"
              f" | {'floor':>6} {'ratio':>6} | {'zmq RTT':>7} {'server':>6} {'ratio':>6}")
        for case, res in zip(cases, results, strict=True):
            r50, r99, w50, w99, d50, d99, f50, z50, zs50 = (statistics.median(col)
                                                            for col in zip(*res, strict=True))
            print(f"{case.label} | {r50:>8.0f} {r99:>8.0f} | {w50:>10.0f} {w99:>8.0f} |"
                  f" {d50:>11.0f} {d99:>8.0f} | {f50:>6.0f} {d50 / f50:>5.2f}x | {z50:>7.0f}"
                  f" {zs50:>6.0f} {r50 / z50:>5.2f}x")
        print("per round, RTT-wrk / floor and RTT / zmq RTT:")
        for case, res in zip(cases, results, strict=True):
            print(f"{case.label} | " + " ".join(f"{r[4] / r[6]:.2f}" for r in res) + " | "
                  + " ".join(f"{r[0] / r[7]:.2f}" for r in res))
        c.sock.close()
        if w.stop() != 0:
            raise SystemExit("worker did not exit 0")


@dataclass
class Case:
    label: str
    frame: bytearray
    iters: int
    rows: bytes
    entries: list[list[int]]


def time_steps(c: RawClient, data: bytearray, iters: int, warmup: int,
               where: str = "") -> tuple[list[float], list[int], int]:
    """``warmup`` then ``iters`` timed exchanges of the STEP frame ``data`` (its seq bumped in
    place each time): (round trips in µs, the replies' worker_us, the reply frame's length)."""
    rtt: list[float] = []
    wus: list[int] = []
    reply_len = 0
    for i in range(iters + warmup):
        c.seq += 1
        SEQ.pack_into(data, SEQ_OFFSET, c.seq)
        t0 = time.perf_counter()
        h, reply = c.exchange(data)
        dt = (time.perf_counter() - t0) * 1e6
        if h.status != ST_OK:
            raise SystemExit(f"STEP refused{where}: status {h.status}")
        reply_len = APP_HEADER_SIZE + len(reply)
        if i >= warmup:
            rtt.append(dt)
            wus.append(REPLY_HEADER.unpack_from(reply)[4])
    return rtt, wus, reply_len


def run_case(c: RawClient, case: Case, z: ZmqDraftServer | None) -> tuple[float, ...]:
    """One round of one case: the worker, then the held floor and the ZMQ + JSON server for
    the same STEP, one after the other (two torch processes taking turns STEP by STEP would
    slow each other: a finished parallel region keeps its threads spinning for a while).
    (RTT p50, p99, worker_us p50, p99, RTT - worker_us p50, p99, floor p50, ZMQ RTT p50, ZMQ
    server time p50)."""
    n, data = case.iters, case.frame
    rtt, wus, reply_len = time_steps(c, data, n, n // 10)
    diff = [a - b for a, b in zip(rtt, wus, strict=True)]
    (r50, r99), (w50, w99), (d50, d99) = q(rtt), q(wus), q(diff)
    f50 = z50 = zs50 = float("nan")
    if z is not None:  # TCP: the floor and the ZMQ server are TCP too
        f50, _ = bench_raw(len(data), reply_len, n, True, hold_s=w50 * 1e-6)
        times, server = [], []
        for i in range(n + n // 10):
            times.append(z.round_trip(case.entries, case.rows, i))
            server.append(z.last_server_us)
        z50, _ = q(times[n // 10:])
        zs50, _ = q(server[n // 10:])
    return r50, r99, w50, w99, d50, d99, f50, z50, zs50


# -- bookkeeping without torch --------------------------------------------------------------
class NullPool:
    """Keeps windows as numbers only: apply and window_rows without any tensor."""

    def __init__(self, lanes: int) -> None:
        self.end = np.zeros(lanes, dtype=np.int64)
        self.bytes_per_lane = 0
        self.nbytes = 0

    def allocate(self, n: int) -> np.ndarray:
        return np.arange(n, dtype=np.int64)

    def free(self, lanes: Any) -> None:
        pass

    def release(self, lanes: Any) -> None:
        self.end[np.asarray(lanes)] = 0

    def apply(self, lanes: Any, anchor: Any, n_rows: Any, reset: Any, rows: Any) -> None:
        self.end[np.asarray(lanes)] = anchor

    def window_rows(self, lanes: Any, anchor: Any) -> np.ndarray:
        ids = np.asarray(lanes)
        return np.where(self.end[ids] == anchor, anchor, 0)


class NullDrafter:
    num_spec = 7

    def __init__(self, b: int) -> None:
        from types import SimpleNamespace

        self.result = SimpleNamespace(
            draft_ids=np.ones((b, 7), np.int32), confidence=np.full((b, 7), 0.5, np.float32),
            margin=np.ones((b, 7), np.float32))

        self.seconds = 0.0  # time inside the last draft call (subtracted from host work)

    def draft(self, pool: Any, lanes: Any, *args: Any, **kw: Any) -> Any:
        t = time.perf_counter()
        result = self.result
        self.seconds = time.perf_counter() - t
        return result


class NullConn:
    conn_id = 1
    peer = "bench"
    peer_host = "bench"
    session_id = 0

    def __init__(self) -> None:
        self.buf = bytearray(1 << 20)
        self.last: Any = None

    def reply_buffer(self, nbytes: int) -> bytearray:
        return self.buf

    def complete(self, data: Any, close: bool = False) -> None:
        self.last = data

    def release_storage(self, storage: Any) -> None:
        pass


def bench_bookkeeping(n: int, repeat: int) -> None:
    import asyncio

    from prometheus_client import CollectorRegistry

    from dspark_worker.dispatch import Dispatcher, WorkerInfo
    from dspark_worker.metrics import Metrics
    from dspark_worker.runner import Runner, StepItem
    from dspark_worker.sessions import SessionTable
    from protocol.framing import FrameDecoder

    async def run() -> None:
        rb = 768
        drafter = NullDrafter(n)
        pool = NullPool(n)
        metrics = Metrics(CollectorRegistry())
        info = WorkerInfo(worker_name="bench", drafter_identity=bytes(32),
                          markov_identity=bytes(32), window=WINDOW, num_spec=7, row_bytes=rb,
                          vocab_size=512, n_taps=3, hidden=128, max_slots=n,
                          max_rows_per_step=4 * n, capabilities=7)
        table = SessionTable(max_sessions=4, lane_capacity=n, idle_s=600)
        runner = Runner(drafter, pool, window=WINDOW, complete=lambda item: None)
        disp = Dispatcher(info, table, runner, metrics)
        conn = NullConn()
        hello = Hello(sample_mode=0, window=WINDOW, num_spec=7, max_slots=n,
                      max_rows_per_step=4 * n, row_bytes=rb, vocab_size=512, n_taps=3,
                      hidden=128, drafter_identity=bytes(32), markov_identity=bytes(32))
        dec = FrameDecoder()
        (f,) = dec.feed(frame(OP_HELLO, 1, 9, hello.pack()))
        disp.handle(conn, f, time.perf_counter())
        runner._execute(list(runner._queue))  # allocate lanes
        runner._queue.clear()
        entries = [ReqEntry(slot=i, generation=3, anchor_pos=100 + i, anchor_token=7, n_rows=1,
                            flags=RF_NEED_DRAFT) for i in range(n)]
        body = pack_step(1, entries, bytes(n * rb), rb)
        seq = 1
        host, null_draft, total = [], [], []
        for i in range(repeat + 50):
            seq += 1
            (f,) = dec.feed(frame(OP_STEP, seq, 9, body))
            t0 = time.perf_counter()
            disp.handle(conn, f, t0)  # decode, shape, generations, seq, queue
            item = runner._queue.popleft()
            runner.queued_steps -= 1
            if not isinstance(item, StepItem):
                raise SystemExit("expected a STEP")
            t1 = time.perf_counter()
            runner._execute([item])  # window statuses (null pool), null draft, encode
            disp.complete(item)  # reply header, metrics
            t2 = time.perf_counter()
            if i >= 50:
                host.append((t2 - t0) * 1e6)
                null_draft.append(drafter.seconds * 1e6)
                total.append((t1 - t0) * 1e6)
        a = np.asarray(host) - np.asarray(null_draft)
        print(f"worker bookkeeping per STEP at {n} entries (no torch; only the time inside the"
              " drafter call excluded),"
              f" {repeat} STEPs, microseconds:")
        print(f"  dispatch (decode + check_step_shape + tokens + generations + seq + queue):"
              f" p50 {statistics.median(total):.0f}  p99 {np.percentile(total, 99):.0f}")
        print(f"  all host work incl. runner statuses, reply encode, header, metrics:"
              f"     p50 {np.percentile(a, 50):.0f}  p99 {np.percentile(a, 99):.0f}")

    asyncio.run(run())


# -- transports: TCP, Unix, shared memory --------------------------------------------------
SWEEP_SIZES = (4 << 10, 256 << 10, 4 << 20, 16 << 20, 64 << 20)
SWEEP_ITERS = {4 << 10: 400, 256 << 10: 200, 4 << 20: 40, 16 << 20: 15, 64 << 20: 6}


def sweep_shape(size: int, row_bytes: int, window: int) -> tuple[int, int]:
    """(entries, rows) of a rows-only STEP of about ``size`` bytes of rows, at most W rows per
    entry so that every row is projected into a ring."""
    n_rows = max(1, size // row_bytes)
    n_req = -(-n_rows // window)
    return n_req, n_rows - n_rows % n_req if n_rows >= n_req else n_req


def memcpy_us(nbytes: int, iters: int) -> float:
    src = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    ts = []
    for _ in range(iters + 2):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        ts.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(ts[2:])


class ShmRawClient(RawClient):
    """RawClient plus a shared-memory rows region attached with OFFER then MAP."""

    def attach(self, session: int, nbytes: int) -> np.ndarray:
        from dspark_client.shm import ShmRegion
        from protocol.shm import SHM_MAP, SHM_OFFER, ShmAttach

        self.region = ShmRegion(nbytes)
        for phase in (SHM_OFFER, SHM_MAP):
            self.seq += 1
            msg = frame(OP_SHM_ATTACH, self.seq, session,
                        ShmAttach(self.region.nbytes, phase).pack())
            if phase == SHM_MAP:
                socket.send_fds(self.sock, [msg], [self.region.fd])
                h, _ = self.exchange(b"")
            else:
                h, _ = self.exchange(msg)
            if h.status != ST_OK:
                raise SystemExit(f"SHM_ATTACH phase {phase} refused: status {h.status}")
        return self.region.array


def bench_transports(rounds: int, threads: int, device: str, sizes: tuple[int, ...]) -> None:
    from dspark_worker.drafter import embedded_default
    from protocol.shm import set_rows_at
    from tests.support.worker_proc import start_worker

    d = embedded_default()
    rb, window = d.row_bytes, WINDOW
    max_rows = max(sweep_shape(s, rb, window)[1] for s in sizes)
    max_req = max(sweep_shape(s, rb, window)[0] for s in sizes)
    tmp = tempfile.mkdtemp(prefix="dspark-bench-")
    path = f"{tmp}/w.sock"
    extra = ["--window", str(window), "--max-rows-per-step", str(max_rows), "--max-slots",
             str(max_req), "--max-total-slots", str(3 * max_req), "--metrics-listen", "none",
             "--log-level", "WARNING", "--device", device, "--unix", path,
             "--max-shm-region-bytes", str(max_rows * rb + (1 << 20))]
    with start_worker(*extra, env={"OMP_NUM_THREADS": str(threads)}) as w:
        clients: dict[str, RawClient] = {"tcp": RawClient((w.host, w.port)),
                                         "unix": RawClient(path), "shm": ShmRawClient(path)}
        sessions = {"tcp": 0xB01, "unix": 0xB02, "shm": 0xB03}
        for name, c in clients.items():
            hello = Hello(sample_mode=0, window=window, num_spec=d.num_spec, max_slots=max_req,
                          max_rows_per_step=max_rows, row_bytes=rb, vocab_size=d.vocab_size,
                          n_taps=d.n_taps, hidden=d.target_hidden,
                          drafter_identity=d.drafter_identity,
                          markov_identity=d.markov_identity, client_name=f"bench-{name}")
            c.seq = 1
            h, _ = c.exchange(frame(OP_HELLO, c.seq, sessions[name], hello.pack()))
            if h.status != ST_OK:
                raise SystemExit(f"HELLO refused on {name}: {h.status}")
            c.buf = bytearray(4 << 20)
            c.view = memoryview(c.buf)
        shm_client = clients["shm"]
        assert isinstance(shm_client, ShmRawClient)
        region = shm_client.attach(sessions["shm"], max_rows * rb)
        rng = np.random.default_rng(0)
        frames: dict[tuple[str, int], bytearray] = {}
        shapes = {}
        for size in sizes:
            n_req, n_rows = sweep_shape(size, rb, window)
            shapes[size] = (n_req, n_rows)
            per = n_rows // n_req
            rows = (rng.integers(0, 2**16, size=(n_rows, rb // 2), dtype=np.uint16)
                    & 0x3FFF).astype(np.uint16).view(np.uint8)  # finite bf16
            entries = [ReqEntry(slot=i, generation=1, anchor_pos=per + 10, anchor_token=1,
                                n_rows=per, flags=RF_RESET) for i in range(n_req)]
            body = pack_step(1, entries, rows.tobytes(), rb)
            for name in ("tcp", "unix"):
                frames[(name, size)] = bytearray(frame(OP_STEP, 0, sessions[name], body))
            prefix = bytearray(body[:rows_offset_for(n_req)])
            set_rows_at(prefix, 0, 0)
            region[:rows.nbytes] = rows.reshape(-1)  # the engine's copy lands here, once
            frames[("shm", size)] = bytearray(frame(OP_STEP, 0, sessions["shm"], prefix))
        cols = ("tcp", "unix", "shm")
        results: dict[tuple[str, int], list[tuple[float, float, float]]] = {}
        floors: dict[tuple[str, int], list[float]] = {}
        copies: dict[int, list[float]] = {}
        echo_ids = itertools.count()
        for _ in range(rounds):
            for size in sizes:
                iters = SWEEP_ITERS.get(size, 50)
                n_req, n_rows = shapes[size]
                for name in cols:
                    c = clients[name]
                    rtt, wus, reply_len = time_steps(c, frames[(name, size)], iters,
                                                     max(2, iters // 10), f" on {name}")
                    results.setdefault((name, size), []).append(
                        (statistics.median(rtt), statistics.median(wus),
                         statistics.median([a - b for a, b in zip(rtt, wus, strict=True)])))
                req_len = len(frames[("tcp", size)])
                floors.setdefault(("tcp", size), []).append(
                    bench_raw(req_len, reply_len, iters, True)[0])
                floors.setdefault(("unix", size), []).append(
                    bench_raw(req_len, reply_len, iters, True,
                              unix_path=f"{tmp}/echo-{next(echo_ids)}.sock")[0])
                copies.setdefault(size, []).append(memcpy_us(n_rows * rb, iters))
        print(f"rows-only STEP, microseconds, median over {rounds} rounds of each round's p50;"
              f" row_bytes {rb}, W {window}, device {device}")
        print(f"{'rows bytes':>10} {'ent':>4} | {'memcpy':>7} | {'echo tcp':>8} {'unix':>7} |"
              f" {'RTT tcp':>8} {'unix':>8} {'shm':>8} | {'wrk tcp':>7} {'unix':>7} {'shm':>7} |"
              f" {'RTT-wrk tcp':>11} {'unix':>7} {'shm':>7} | {'shm/cpy':>7} {'shm/tcp':>7}"
              f" {'shmRTT/unixRTT':>14}")
        ingest = []
        for size in sizes:
            n_req, n_rows = shapes[size]
            m = {k: tuple(statistics.median(col) for col in zip(*v, strict=True))
                 for k, v in results.items() if k[1] == size}
            cp = statistics.median(copies[size])
            ft = statistics.median(floors[("tcp", size)])
            fu = statistics.median(floors[("unix", size)])
            rt, ru, rs = (m[(n, size)][0] for n in cols)
            wt, wu, ws = (m[(n, size)][1] for n in cols)
            dt_, du, ds = (m[(n, size)][2] for n in cols)
            print(f"{n_rows * rb:>10} {n_req:>4} | {cp:>7.0f} | {ft:>8.0f} {fu:>7.0f} |"
                  f" {rt:>8.0f} {ru:>8.0f} {rs:>8.0f} | {wt:>7.0f} {wu:>7.0f} {ws:>7.0f} |"
                  f" {dt_:>11.0f} {du:>7.0f} {ds:>7.0f} | {ds / cp:>6.2f}x {ds / dt_:>6.2f}x"
                  f" {rs / ru:>13.2f}x")
            for n in cols:
                ingest.append((size, n, n_rows / (m[(n, size)][1] * 1e-6),
                               n_rows * rb / (m[(n, size)][1] * 1e-6) / 1e9,
                               n_rows * rb / (m[(n, size)][0] * 1e-6) / 1e9))
        print("worker ingest (rows and bytes per second of worker_us: last byte to reply) and"
              " end to end (bytes per second of RTT)")
        print(f"{'rows bytes':>10} {'transport':>9} | {'rows/s':>10} {'GB/s':>6} | {'e2e GB/s':>8}")
        for size, n, rps, gbs, e2e in ingest:
            print(f"{shapes[size][1] * rb:>10} {n:>9} | {rps:>10.0f} {gbs:>6.2f} | {e2e:>8.2f}")
        for c in clients.values():
            c.sock.close()
        if w.stop() != 0:
            raise SystemExit("worker did not exit 0")


def taps_25600_checkpoint(directory: str) -> str:
    """A small random drafter that reads Qwen3-4B-shaped taps (5 layers x 2560, bf16: 25,600
    bytes per row): the engine-shaped run's rows are real-sized, its drafting cheap."""
    import torch

    from dspark_worker.drafter.checkpoint import save_checkpoint
    from dspark_worker.drafter.config import DrafterConfig
    from dspark_worker.drafter.embedded import init_random_
    from dspark_worker.drafter.families import build_model

    cfg = DrafterConfig(
        hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, intermediate_size=256, vocab_size=512, rms_norm_eps=1e-6,
        rope_theta=10000.0, target_layer_ids=(1, 9, 17, 25, 33), block_size=7,
        mask_token_id=511, markov_rank=16, markov_head_type="vanilla",
        enable_confidence_head=True, confidence_head_with_markov=True,
        target_hidden_size=2560, num_target_layers=36).validated("taps-25600")
    model = build_model(cfg, None, device=torch.device("cpu"), dtype=torch.float32)
    init_random_(model, seed=1)
    save_checkpoint(model, directory)
    return directory


def bench_engine_shaped(steps: int, threads: int, device: str) -> None:
    import json
    import subprocess

    from tests.support.worker_proc import start_worker

    tmp = tempfile.mkdtemp(prefix="dspark-bench-")
    ckpt = taps_25600_checkpoint(f"{tmp}/ckpt")
    path = f"{tmp}/w.sock"
    # W 16: the first round resyncs 64 x 16 rows (26 MB); later rounds carry 64 x 5 rows
    # (8.2 MB). max_rows_per_step 2048 keeps the client's region (52 MB) under the default limit.
    extra = ["--checkpoint", ckpt, "--window", "16", "--max-slots", "64",
             "--max-total-slots", "192", "--max-rows-per-step", "2048", "--device", device,
             "--metrics-listen", "none", "--log-level", "WARNING", "--unix", path]
    with start_worker(*extra, env={"OMP_NUM_THREADS": str(threads)}) as w:
        for endpoint in (f"tcp://{w.host}:{w.port}", f"unix://{path}", f"unix+shm://{path}"):
            cmd = [sys.executable, "-m", "dspark_client.cli", "--endpoint", endpoint,
                   "--timeout", "30", "bench",
                   "--batch", "64", "--accept", "4", "--steps", str(steps), "--warmup", "10",
                   "--json", "--no-progress"]
            out = subprocess.run(cmd, capture_output=True, text=True, check=False,
                                 cwd=str(ROOT), env={**os.environ, "PYTHONPATH": str(ROOT)})
            if out.returncode != 0:
                raise SystemExit(f"{' '.join(cmd)} failed: {out.stderr[-2000:]}")
            r = json.loads(out.stdout)
            rt, rd = r["rtt_us"], r["round_us"]
            print(f"{endpoint.split('://')[0]:>8}: row_bytes {r['row_bytes']}, batch {r['batch']},"
                  f" {r['accepted_rows_per_slot']} rows/slot/round; rtt p50 {rt['p50']:.0f}"
                  f" p90 {rt['p90']:.0f} us; round p50 {rd['p50']:.0f} p90 {rd['p90']:.0f} us;"
                  f" {r['rounds_per_s']:.1f} rounds/s, {r['rows_per_s']:.0f} rows/s"
                  f" ({r['rows_per_s'] * r['row_bytes'] / 1e9:.2f} GB/s)")
        if w.stop() != 0:
            raise SystemExit("worker did not exit 0")


def bench_handoffs(iters: int, threads: int, device: str) -> None:
    """The two cross-thread hand-offs of a STEP (event loop -> device thread -> loop), from the
    worker's own to_device / from_device stages (STATS latency_us), per transport, for a
    one-row STEP (the hand-offs do not depend on size) and a 4 MiB one."""
    import json

    from dspark_worker.drafter import embedded_default
    from protocol.constants import OP_STATS
    from protocol.shm import set_rows_at
    from tests.support.worker_proc import start_worker

    d = embedded_default()
    rb = d.row_bytes
    tmp = tempfile.mkdtemp(prefix="dspark-bench-")
    path = f"{tmp}/w.sock"
    print(f"{'transport':>9} {'rows':>6} | {'to_device p50':>13} {'p90':>6} |"
          f" {'from_device p50':>15} {'p90':>6} | {'step p50':>8} | {'RTT p50':>7}  (us)")
    for name in ("tcp", "unix", "shm"):
        for n_rows in (1, 5460):
            extra = ["--window", str(WINDOW), "--max-rows-per-step", "8192", "--max-slots",
                     "8", "--max-total-slots", "8", "--metrics-listen", "none", "--log-level",
                     "WARNING", "--device", device, "--unix", path]
            with start_worker(*extra, env={"OMP_NUM_THREADS": str(threads)}) as w:
                c: RawClient = (RawClient((w.host, w.port)) if name == "tcp"
                                else ShmRawClient(path))
                hello = Hello(sample_mode=0, window=WINDOW, num_spec=d.num_spec, max_slots=8,
                              max_rows_per_step=8192, row_bytes=rb, vocab_size=d.vocab_size,
                              n_taps=d.n_taps, hidden=d.target_hidden,
                              drafter_identity=d.drafter_identity,
                              markov_identity=d.markov_identity, client_name="handoffs")
                c.seq = 1
                c.exchange(frame(OP_HELLO, 1, 0xB0C, hello.pack()))
                n_req = -(-n_rows // WINDOW)
                per = n_rows // n_req
                entries = [ReqEntry(slot=i, generation=1, anchor_pos=per, anchor_token=1,
                                    n_rows=per, flags=RF_RESET) for i in range(n_req)]
                rows = np.zeros((per * n_req, rb), np.uint8)
                body = pack_step(1, entries, rows.tobytes(), rb)
                if name == "shm":
                    assert isinstance(c, ShmRawClient)
                    c.attach(0xB0C, rows.nbytes)
                    prefix = bytearray(body[:rows_offset_for(n_req)])
                    set_rows_at(prefix, 0, 0)
                    body = bytes(prefix)
                data = bytearray(frame(OP_STEP, 0, 0xB0C, body))
                rtt = []
                for _ in range(iters):
                    c.seq += 1
                    SEQ.pack_into(data, SEQ_OFFSET, c.seq)
                    t0 = time.perf_counter()
                    h, _ = c.exchange(data)
                    rtt.append((time.perf_counter() - t0) * 1e6)
                    if h.status != ST_OK:
                        raise SystemExit(f"STEP refused: {h.status}")
                c.seq += 1
                c.buf = bytearray(1 << 22)
                c.view = memoryview(c.buf)
                _, stats = c.exchange(frame(OP_STATS, c.seq, 0))
                lat = json.loads(bytes(stats))["latency_us"]
                to, back, step = lat["to_device"], lat["from_device"], lat["step"]
                print(f"{name:>9} {per * n_req:>6} | {to['p50_us']:>13.0f} {to['p90_us']:>6.0f} |"
                      f" {back['p50_us']:>15.0f} {back['p90_us']:>6.0f} |"
                      f" {step['p50_us']:>8.0f} | {statistics.median(rtt):>7.0f}")
                c.sock.close()
                w.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--unix", action="store_true", help="over the Unix socket instead of TCP")
    ap.add_argument("--skip-rtt", action="store_true")
    ap.add_argument("--skip-bookkeeping", action="store_true")
    ap.add_argument("--entries", type=int, default=256)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                    help="torch intra-op threads of the worker and the ZMQ server")
    ap.add_argument("--device", default="auto",
                    help="the worker's and the ZMQ server's device (auto: CUDA when present)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="rounds of every STEP case, each followed by its floor")
    ap.add_argument("--transports", action="store_true",
                    help="rows-only STEPs over TCP, Unix and shared memory (then exit)")
    ap.add_argument("--sizes", default=",".join(str(x) for x in SWEEP_SIZES),
                    help="row bytes per STEP for --transports")
    ap.add_argument("--engine-shaped", action="store_true",
                    help="dspark-client bench with 25,600-byte rows over each transport")
    ap.add_argument("--steps", type=int, default=100, help="rounds of --engine-shaped")
    ap.add_argument("--handoffs", action="store_true",
                    help="the worker's to_device / from_device stages per transport")
    args = ap.parse_args()
    if args.handoffs:
        bench_handoffs(args.iters, args.threads, "cpu" if args.device == "auto"
                       else args.device)
        return
    if args.transports:
        bench_transports(args.rounds, args.threads, "cpu" if args.device == "auto"
                         else args.device, tuple(int(x) for x in args.sizes.split(",")))
        return
    if args.engine_shaped:
        bench_engine_shaped(args.steps, args.threads, "cpu" if args.device == "auto"
                            else args.device)
        return
    if not args.skip_rtt:
        bench_rtt(args.iters, args.unix, args.rounds, args.threads, args.device)
    if not args.skip_bookkeeping:
        bench_bookkeeping(args.entries, max(200, args.iters))


if __name__ == "__main__":
    main()
