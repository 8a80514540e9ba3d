"""The floor under a STEP round trip on loopback: what the same byte counts cost with no worker.

    python bench/floor.py [--iters 2000] [--sizes 4096,262144,4194304]

For request sizes of 4 KiB, 256 KiB and 4 MiB (a STEP's frame) and a reply of the size the
worker sends back for it (a greedy StepReply frame for that STEP's entries):

* ``raw``: blocking TCP sockets (TCP_NODELAY), a server thread that receives the request into a
  reused buffer with ``recv_into`` and answers from a reused buffer: the cost of the bytes alone.
* ``zmq``: pyzmq REQ/REP, the request as two parts (a JSON header naming step_id, n_req,
  n_rows, row_bytes, then the rows), the server ``json.loads`` the header and replies
  [JSON header, reply bytes]: the usual "just use ZeroMQ and JSON" design of the same exchange.

Prints RTT p50/p99 in microseconds per size. The server runs in a thread of this process, so on
a 2-core machine client and server share the GIL; bench_worker.py runs the worker in its own
process (compare with ``--server-process`` here, which forks the raw server).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import socket
import struct
import threading
import time
from typing import Any

import numpy as np

from protocol.constants import APP_HEADER_SIZE, RPF_MARGIN
from protocol.messages import reply_layout

N = 7
ROW_BYTES = 768  # the embedded default drafter's rows (3 taps x 128 x bf16)
SIZES = (4 << 10, 256 << 10, 4 << 20)
HOLD = struct.Struct("<d")


def shape_for(size: int) -> tuple[int, int]:
    """(n_req, n_rows) of the STEP bench_worker.py sends for a frame of about ``size`` bytes."""
    n_req = 1 if size <= 8 << 10 else (4 if size <= 512 << 10 else 8)
    rows = max(1, (size - APP_HEADER_SIZE - 32 - 48 * n_req) // ROW_BYTES)
    return n_req, rows - rows % n_req or n_req


def reply_size(n_req: int) -> int:
    return APP_HEADER_SIZE + reply_layout(n_req, N, RPF_MARGIN).size


def quantiles(xs: list[float]) -> tuple[float, float]:
    a = np.asarray(xs) * 1e6
    return float(np.percentile(a, 50)), float(np.percentile(a, 99))


# -- raw sockets ------------------------------------------------------------------------------
def _recv_exact(sock: socket.socket, view: memoryview) -> bool:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if not n:
            return False
        got += n
    return True


def raw_server(listener: socket.socket, req: int, rep: int, hold_s: float = 0.0) -> None:
    """Echo ``rep`` bytes per ``req`` received. With ``hold_s``, busy-wait that long before each
    reply (as the worker computes between a STEP's last byte and its reply) and put the time
    held, in seconds, in the reply's first 8 bytes (as the worker reports worker_us)."""
    conn, _ = listener.accept()
    if conn.family != socket.AF_UNIX:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = memoryview(bytearray(req))
    out = bytearray(rep)
    while _recv_exact(conn, buf):
        if hold_s:
            t0 = time.perf_counter()
            end = t0 + hold_s
            while time.perf_counter() < end:
                pass
            HOLD.pack_into(out, 0, time.perf_counter() - t0)
        conn.sendall(out)
    conn.close()


def _listener(unix_path: str | None) -> socket.socket:
    if unix_path is None:
        return socket.create_server(("127.0.0.1", 0))
    ls = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    ls.bind(unix_path)
    ls.listen(1)
    return ls


def _raw_server_proc(port_q: Any, req: int, rep: int, hold_s: float,
                     unix_path: str | None = None) -> None:
    ls = _listener(unix_path)
    port_q.put(ls.getsockname()[1] if unix_path is None else 0)
    raw_server(ls, req, rep, hold_s)


def bench_raw(req: int, rep: int, iters: int, process: bool,
              hold_s: float = 0.0, unix_path: str | None = None) -> tuple[float, float]:
    """RTT p50/p99 in µs of the raw echo (over TCP, or the Unix socket ``unix_path``); with
    ``hold_s``, RTT minus the time the server held each request (compare with the worker's
    RTT - worker_us)."""
    if process:
        q: Any = mp.get_context("fork").Queue()
        p = mp.get_context("fork").Process(target=_raw_server_proc,
                                           args=(q, req, rep, hold_s, unix_path))
        p.start()
        port = q.get(timeout=10)
    else:
        ls = _listener(unix_path)
        port = ls.getsockname()[1] if unix_path is None else 0
        t = threading.Thread(target=raw_server, args=(ls, req, rep, hold_s), daemon=True)
        t.start()
    if unix_path is None:
        c = socket.create_connection(("127.0.0.1", port))
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    else:
        c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        c.connect(unix_path)
    payload = bytes(req)
    reply = memoryview(bytearray(rep))
    times = []
    for i in range(iters + iters // 10):
        t0 = time.perf_counter()
        c.sendall(payload)
        _recv_exact(c, reply)
        dt = time.perf_counter() - t0
        if i >= iters // 10:  # warm-up excluded
            times.append(dt - (HOLD.unpack_from(reply)[0] if hold_s else 0.0))
    c.close()
    if process:
        p.join(10)
    return quantiles(times)


# -- ZeroMQ REQ/REP with a JSON header --------------------------------------------------------
def zmq_server(ctx: Any, addr: str, rep: int, ready: threading.Event) -> None:
    import zmq

    s = ctx.socket(zmq.REP)
    s.bind(addr)
    ready.set()
    out = bytes(rep - 64)
    while True:
        try:
            parts = s.recv_multipart(copy=False)
        except zmq.ContextTerminated:
            break
        head = json.loads(bytes(parts[0].buffer))
        if head.get("stop"):
            s.send_multipart([b"{}"])
            break
        rows = parts[1].buffer  # the rows, zero-copy
        reply_head = json.dumps({"step_id": head["step_id"], "status": 0,
                                 "n_req": head["n_req"], "rows_seen": len(rows)}).encode()
        s.send_multipart([reply_head, out], copy=False)
    s.close(linger=0)


def bench_zmq(req: int, rep: int, n_req: int, n_rows: int, iters: int) -> tuple[float, float]:
    import zmq

    ctx = zmq.Context()
    addr = "tcp://127.0.0.1:" + str(_free_port())
    ready = threading.Event()
    t = threading.Thread(target=zmq_server, args=(ctx, addr, rep, ready), daemon=True)
    t.start()
    ready.wait(10)
    c = ctx.socket(zmq.REQ)
    c.connect(addr)
    rows = bytes(req)
    times = []
    for i in range(iters + iters // 10):
        t0 = time.perf_counter()
        head = json.dumps({"step_id": i, "n_req": n_req, "n_rows": n_rows,
                           "row_bytes": ROW_BYTES}).encode()
        c.send_multipart([head, rows], copy=False)
        parts = c.recv_multipart()
        json.loads(parts[0])
        if i >= iters // 10:
            times.append(time.perf_counter() - t0)
    c.send_multipart([b'{"stop": true}', b""])
    c.recv_multipart()
    c.close(linger=0)
    t.join(5)
    ctx.term()
    return quantiles(times)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--sizes", default=",".join(str(s) for s in SIZES))
    ap.add_argument("--server-process", action="store_true",
                    help="run the raw echo server in a forked process instead of a thread")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    print(f"loopback floor, {args.iters} round trips per size; RTT in microseconds")
    print(f"{'request bytes':>14} {'reply':>6} {'raw p50':>9} {'raw p99':>9}"
          f" {'zmq+json p50':>13} {'zmq+json p99':>13}")
    for size in sizes:
        n_req, n_rows = shape_for(size)
        req = APP_HEADER_SIZE + 32 + 48 * n_req + n_rows * ROW_BYTES
        rep = reply_size(n_req)
        iters = max(50, args.iters if size <= 256 << 10 else args.iters // 4)
        rp50, rp99 = bench_raw(req, rep, iters, args.server_process)
        zp50, zp99 = bench_zmq(n_rows * ROW_BYTES, rep, n_req, n_rows, iters)
        print(f"{req:>14} {rep:>6} {rp50:>9.1f} {rp99:>9.1f} {zp50:>13.1f} {zp99:>13.1f}")


if __name__ == "__main__":
    main()
