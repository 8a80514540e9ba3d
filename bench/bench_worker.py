"""STEP round trips against a real ``dspark-worker`` subprocess, and the worker's host-side
bookkeeping per STEP without torch.

    python bench/bench_worker.py [--iters 300] [--rounds 3] [--threads N] [--device auto]
                                 [--unix] [--skip-rtt] [--skip-bookkeeping]

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
2. Bookkeeping at 256 entries, in this process, with a drafter and ring pool that do nothing:
   decode + shape checks + generations/session bookkeeping (dispatch) + the runner's window
   statuses + the drafter's inputs + reply encode + reply header (dispatch.complete). Only the
   time inside the (null) drafter call is excluded.
"""

from __future__ import annotations

import argparse
import contextlib
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
    OP_STEP,
    RF_NEED_DRAFT,
    RF_RESET,
    ST_OK,
)
from protocol.framing import frame  # noqa: E402
from protocol.header import AppHeader  # noqa: E402
from protocol.messages import Hello, ReqEntry, pack_step  # noqa: E402

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


def run_case(c: RawClient, case: Case, z: ZmqDraftServer | None) -> tuple[float, ...]:
    """One round of one case: the worker, then the held floor and the ZMQ + JSON server for
    the same STEP, one after the other (two torch processes taking turns STEP by STEP would
    slow each other: a finished parallel region keeps its threads spinning for a while).
    (RTT p50, p99, worker_us p50, p99, RTT - worker_us p50, p99, floor p50, ZMQ RTT p50, ZMQ
    server time p50)."""
    n, data = case.iters, case.frame
    rtt, wus = [], []
    reply_len = 0
    for i in range(n + n // 10):
        c.seq += 1
        SEQ.pack_into(data, SEQ_OFFSET, c.seq)
        t0 = time.perf_counter()
        h, reply = c.exchange(data)
        dt = (time.perf_counter() - t0) * 1e6
        if h.status != ST_OK:
            raise SystemExit(f"STEP refused: status {h.status}")
        reply_len = APP_HEADER_SIZE + len(reply)
        if i >= n // 10:
            rtt.append(dt)
            wus.append(REPLY_HEADER.unpack_from(reply)[4])
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
    args = ap.parse_args()
    if not args.skip_rtt:
        bench_rtt(args.iters, args.unix, args.rounds, args.threads, args.device)
    if not args.skip_bookkeeping:
        bench_bookkeeping(args.entries, max(200, args.iters))


if __name__ == "__main__":
    main()
