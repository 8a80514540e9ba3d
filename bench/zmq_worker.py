"""The same STEP served the "just use ZeroMQ and JSON" way, for bench_worker.py to compare with.

A LIL-style draft server: pyzmq REQ/REP, a request of two parts (a JSON header with the step id
and one ``[slot, generation, anchor_pos, anchor_token, n_rows, flags]`` list per entry, then the
tap rows as raw bytes, received without a copy), a synchronous loop that applies the rows to the
same ``RingPool`` and drafts with the same embedded drafter as the worker, and a JSON reply
(window rows, drafts, confidences, margins as lists). It checks nothing and keeps no sessions:
the least a server of that design does, so the comparison flatters it, not us.

    from zmq_worker import ZmqDraftServer
    with ZmqDraftServer(window=1024, lanes=16, threads=2) as z:
        rtt_us = z.round_trip(entries, rows)  # full round trip, microseconds

The server runs in its own process, like the worker, on the device the worker would pick
(``auto``: CUDA when there is one).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import socket
import time
from typing import Any

import numpy as np

from protocol.constants import RF_NEED_DRAFT, RF_RESET


def _serve(addr: str, window: int, lanes: int, threads: int, device: str, ready: Any) -> None:
    import torch
    import zmq

    from dspark_worker.app import resolve_device
    from dspark_worker.drafter import embedded_default

    torch.set_num_threads(threads)
    torch.set_grad_enabled(False)
    drafter = embedded_default(resolve_device(device))  # the worker's device and dtype rule
    drafter.warmup()
    pool = drafter.new_pool(lanes, window)
    lane_ids = pool.allocate(lanes)
    ctx = zmq.Context()
    s = ctx.socket(zmq.REP)
    s.bind(addr)
    ready.set()
    while True:
        parts = s.recv_multipart(copy=False)
        t0 = time.perf_counter()
        head = json.loads(bytes(parts[0].buffer))
        if head.get("stop"):
            s.send(b"{}")
            break
        e = np.asarray(head["entries"], dtype=np.int64).reshape(-1, 6)
        rows = np.frombuffer(parts[1].buffer, dtype=np.uint8).reshape(-1, drafter.row_bytes)
        ln = lane_ids[e[:, 0]]
        pool.apply(ln, e[:, 2], e[:, 4], (e[:, 5] & RF_RESET) != 0, rows)
        out: dict[str, Any] = {"step_id": head["step_id"],
                               "window_rows": pool.window_rows(ln, e[:, 2]).tolist()}
        need = (e[:, 5] & RF_NEED_DRAFT) != 0
        if need.any():
            r = drafter.draft(pool, ln[need], e[need, 2], e[need, 3])
            out["draft_ids"] = np.asarray(r.draft_ids).tolist()
            out["confidence"] = np.asarray(r.confidence).tolist()
            out["margin"] = np.asarray(r.margin).tolist()
        out["server_us"] = int((time.perf_counter() - t0) * 1e6)
        s.send(json.dumps(out).encode())
    s.close(linger=0)
    ctx.term()


class ZmqDraftServer:
    """The server process and a REQ client connected to it."""

    def __init__(self, window: int, lanes: int, threads: int, device: str = "auto") -> None:
        self.window, self.lanes, self.threads, self.device = window, lanes, threads, device

    def __enter__(self) -> ZmqDraftServer:
        import zmq

        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        self.addr = f"tcp://127.0.0.1:{port}"
        ctx = mp.get_context("spawn")
        ready = ctx.Event()
        args = (self.addr, self.window, self.lanes, self.threads, self.device, ready)
        self.proc = ctx.Process(target=_serve, args=args, daemon=True)
        self.proc.start()
        if not ready.wait(120):
            raise RuntimeError("the ZMQ draft server did not start")
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.REQ)
        self.sock.connect(self.addr)
        return self

    def round_trip(self, entries: list[list[int]], rows: bytes, step_id: int = 1) -> float:
        """One STEP: send, receive and decode the reply; the round trip in microseconds. The
        server's own time (its ``worker_us``) is left in ``last_server_us``."""
        t0 = time.perf_counter()
        self.sock.send_multipart([json.dumps({"step_id": step_id, "entries": entries}).encode(),
                                  rows], copy=False)
        reply = json.loads(self.sock.recv())
        dt = (time.perf_counter() - t0) * 1e6
        if reply.get("step_id") != step_id:
            raise RuntimeError(f"ZMQ draft server answered {reply!r}")
        self.last_server_us = int(reply["server_us"])
        return dt

    def __exit__(self, *exc: object) -> None:
        self.sock.send_multipart([b'{"stop": true}', b""])
        self.sock.recv()
        self.sock.close(linger=0)
        self.ctx.term()
        self.proc.join(10)
