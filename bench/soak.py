"""Soak: N engine processes x M slots against one real worker for a given time, with a fuzz storm
and a kill -9 / restart of the worker in the middle. Not a CI test (tests/bench/ runs a tiny one).

Each engine is a separate process running the real client (``RemoteDraftClient`` +
``DraftRounds``) with deterministic synthetic tap rows per (engine, slot, generation, position)
and anchor tokens per position, so the greedy drafts for a given key do not depend on the run's
history: the parent recomputes a sample of them with the reference drafter (the worker's
default embedded drafter, ``Drafter.reference_draft``) and any difference is a wrong draft.
Slots finish and start new requests (new generations) as they go.

Timeline of ``--duration`` seconds: steady load; from ``--fuzz-at`` (30%) a fuzz storm of
``--fuzz-frames`` frames (mutated, truncated, oversized, garbage and bad-magic frames over many
connections); at ``--kill-at`` (70%) the worker is killed with SIGKILL and restarted on the same
ports. The run goes on until ``--duration`` and at least 30% of it after the restart.

With ``--flood pipeline`` (connections pipelining STATS) or ``--flood keepalive`` (hundreds of
idle connections kept open by PINGs), that flood runs from ``--fuzz-at`` to ``--kill-at``
beside the engines, and a new connection's first reply is probed every 0.2 s; the report gives
rounds, drafted positions and round-trip percentiles before, during and after it
(``--no-kill`` leaves out the kill -9 for such a measurement).

Every ``--interval`` seconds it prints: STEPs, failed rounds, RTT p50 / p99, worker RSS. At the
end: the clients' STEPs and rows since the restart against the worker's ``/metrics``, rounds
every slot took to draft again after each reconnect against the proven bound
(``fair_bound_rounds``), drafts checked, and it exits 1 on any loss: a wrong draft, a usable
reply slot without its drafts, a slot not drafting within the bound after a reconnect, worker
RSS growth over 10% within one worker's life, counters that disagree, a fuzz storm short of its
frames, or an engine that crashed.

    python bench/soak.py --engines 8 --slots 64 --duration 300
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import queue
import random
import signal
import socket
import struct
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from protocol import wire  # noqa: E402

RSS_GROWTH_LIMIT = 0.10
RECHECK_ROUNDS = 3  # every draft of this many rounds after a reconnect is checked


# -- deterministic engine data ------------------------------------------------------------------
def rows_for(engine: int, slot: int, gen: int, first: int, last: int, width: int) -> np.ndarray:
    """bf16 tap rows of positions [first, last): uint8 [n, 2 * width], a pure function."""
    pos = np.arange(first, last, dtype=np.float64)[:, None]
    x = np.sin(pos * 0.7311 + (engine * 1009 + slot) * 1.913 + gen * 0.377
               + np.arange(width, dtype=np.float64)[None, :] * 0.0137) * 2.0
    bf = (x.astype(np.float32).view(np.uint32) >> 16).astype("<u2")
    return bf.view(np.uint8).reshape(last - first, 2 * width)


def token_at(engine: int, slot: int, gen: int, pos: int, vocab: int) -> int:
    return (pos * 2654435761 + slot * 40503 + gen * 97 + engine * 7) % (vocab - 1)


def request_len(engine: int, slot: int, gen: int) -> tuple[int, int]:
    """(prompt rows, positions until the request finishes)."""
    h = (engine * 31 + slot * 17 + gen * 13) % 97
    return 8 + h, 150 + 3 * h


def sampled_key(engine: int, slot: int, gen: int, pos: int, every: int) -> bool:
    return (pos * 7 + slot * 13 + gen * 3 + engine) % every == 0


# -- an engine process ----------------------------------------------------------------------------
def engine_main(e: int, args: dict[str, Any], hello_raw: bytes, out: Any, killed: Any,
                stop: Any) -> None:
    from dspark_client.client import RemoteDraftClient
    from dspark_client.config import RemoteConfig
    from dspark_client.rounds import DraftRounds, SlotRequest, fair_bound_rounds

    try:
        hello = wire.Hello.unpack(hello_raw)
        hello = wire.Hello(**{f: getattr(hello, f) for f in hello.__struct_fields__
                              if f != "client_name"}, client_name=f"soak-{e}")
        cfg = RemoteConfig(endpoint=args["endpoint"], timeout_ms=args["timeout_ms"],
                           connect_timeout_ms=3000, backoff_ms=50, backoff_max_ms=1000,
                           auth_secret=args["secret"])
        c = RemoteDraftClient(cfg, hello)
        if not c.wait_ready(120):
            raise RuntimeError(f"engine {e}: not ready: {c.last_error}")
        rounds = DraftRounds(c)
        M, N, W = args["slots"], hello.num_spec, hello.window
        width = hello.row_bytes // 2
        vocab = hello.vocab_size
        bound = fair_bound_rounds(M, rounds.row_budget, W)
        gen = [1] * M
        anchor = [0] * M
        fresh = [0] * M
        end = [0] * M
        for s in range(M):
            prompt, length = request_len(e, s, 1)
            anchor[s] = fresh[s] = prompt
            end[s] = prompt + length
        release: list[int] = []
        samples: list[tuple[int, int, int, int, list[int]]] = []
        rtts: list[float] = []
        tick_steps = tick_failed = tick_drafted = 0
        n_round = 0
        last_epoch = c.connection_epoch()
        since_reconnect = 0
        waiting: dict[int, int] = {}  # slot -> rounds since the reconnect without drafts
        worst_after_reconnect = 0
        reconnects = 0
        lost = 0
        baseline: dict[str, float] | None = None
        rows_ok_since = 0
        first_ok = False
        next_tick = time.monotonic() + args["interval"]
        while not stop.is_set():
            if baseline is None and killed.is_set():
                snap = c.stats.snapshot()
                baseline = {"steps_ok": snap.get("steps_ok", 0)}
                rows_ok_since = 0
            reqs = []
            for s in range(M):
                a, n = anchor[s], fresh[s]
                reqs.append(SlotRequest(slot=s, generation=gen[s], anchor_pos=a,
                                        anchor_token=token_at(e, s, gen[s], a, vocab),
                                        rows=rows_for(e, s, gen[s], a - n, a, width) if n
                                        else None, n_out=N))
                fresh[s] = 0
            res = rounds.run(reqs, release=release)
            release = []
            # The engine's own step (the target's forward pass) takes time; a target-only
            # round too.
            time.sleep(args["step_s"])
            n_round += 1
            if res.ok and not first_ok:
                first_ok = True
                out.put(("first_ok", e, time.time()))
            tick_steps += 1 if res.ok else 0
            tick_failed += 0 if res.ok else 1
            if res.ok:
                rtts.append(res.rtt_us)
                if baseline is not None:
                    rows_ok_since += res.rows_sent
            epoch = c.connection_epoch()
            if epoch is not None and epoch != last_epoch:
                reconnects += 1
                since_reconnect = 0
                waiting = {s: 0 for s in range(M)}
                last_epoch = epoch
            if res.ok:
                since_reconnect += 1
            status = res.status.tolist()
            num = res.num_drafted.tolist()
            tick_drafted += int(sum(num)) if res.ok else 0
            for s in range(M):
                k = num[s]
                st = status[s]
                if res.ok and st in (wire.RS_OK, wire.RS_PARTIAL_WINDOW) and k != N:
                    lost += 1
                if s in waiting:
                    if k:
                        worst_after_reconnect = max(worst_after_reconnect, waiting.pop(s) + 1)
                    elif res.ok and st != wire.RS_SHED:
                        waiting[s] += 1
                        if waiting[s] > bound:
                            lost += 1  # counted once per round over the bound
                if k and (since_reconnect <= RECHECK_ROUNDS or
                          sampled_key(e, s, gen[s], anchor[s], args["sample_every"])):
                    samples.append((s, gen[s], anchor[s], token_at(e, s, gen[s], anchor[s], vocab),
                                    res.draft_ids[s, :k].tolist()))
                acc = (anchor[s] * 7 + s) % (k + 1) if k else 0
                anchor[s] += acc + 1
                fresh[s] = acc + 1
                if anchor[s] >= end[s]:  # the request finished: a new one in the slot
                    release.append(s)
                    gen[s] += 1
                    prompt, length = request_len(e, s, gen[s])
                    anchor[s] = fresh[s] = prompt
                    end[s] = prompt + length
            now = time.monotonic()
            if now >= next_tick:
                out.put(("tick", e, tick_steps, tick_failed, rtts, tick_drafted))
                rtts = []
                tick_steps = tick_failed = tick_drafted = 0
                next_tick = now + args["interval"]
        snap = c.stats.snapshot()
        out.put(("done", e, {
            "stats": {k: v for k, v in snap.items() if isinstance(v, (int, float))},
            "baseline": baseline, "rows_ok_since_kill": rows_ok_since, "samples": samples,
            "rounds": n_round, "reconnects": reconnects, "lost": lost, "bound": bound,
            "worst_after_reconnect": worst_after_reconnect,
            "still_waiting": len(waiting), "disabled": c.disabled_reason}))
        c.close()
    except BaseException as exc:  # reported to the parent, which fails the run
        import traceback

        out.put(("error", e, f"{exc!r}\n{traceback.format_exc()}"))


# -- the fuzz storm -------------------------------------------------------------------------------
def _fuzz_frame(rng: random.Random, hello_body: bytes) -> bytes:
    kind = rng.randrange(8)
    op = rng.choice([wire.OP_HELLO, wire.OP_STEP, wire.OP_PING, wire.OP_STATS, wire.OP_RESET,
                     0, 9, 200])
    session = rng.choice([0, 1, rng.getrandbits(32)])
    seq = rng.getrandbits(64)
    if kind == 0:  # a HELLO with bytes flipped
        body = bytearray(hello_body)
        for _ in range(rng.randrange(1, 6)):
            body[rng.randrange(len(body))] ^= 1 << rng.randrange(8)
        return wire.frame(wire.OP_HELLO, seq, session, bytes(body))
    if kind == 1:  # a STEP of garbage
        return wire.frame(wire.OP_STEP, seq, session, rng.randbytes(rng.randrange(0, 600)))
    if kind == 2:  # a truncated STEP header
        return wire.frame(wire.OP_STEP, seq, session, rng.randbytes(rng.randrange(0, 32)))
    if kind == 3:  # PING / STATS
        return wire.frame(rng.choice([wire.OP_PING, wire.OP_STATS]), seq, 0, b"")
    if kind == 4:  # unknown op, random body
        return wire.frame(op, seq, session, rng.randbytes(rng.randrange(0, 200)))
    if kind == 5:  # a RESET with a huge count
        return wire.frame(wire.OP_RESET, seq, session, struct.pack("<I", rng.getrandbits(32)))
    if kind == 6:  # a header whose body is far over any limit (the connection then closes)
        return wire.AppHeader(op=wire.OP_STEP, seq=seq, session=session,
                              body_len=0xFFFFFFF0).pack()
    # a header with a bad magic (the connection closes)
    return rng.randbytes(wire.APP_HEADER_SIZE)


def fuzz_storm(host: str, port: int, hello_body: bytes, total: int, threads: int,
               counter: list[int], stop: threading.Event) -> None:
    def run(seed: int, quota: int) -> None:
        rng = random.Random(seed)
        sent = 0
        while sent < quota and not stop.is_set():
            try:
                with socket.create_connection((host, port), timeout=2) as s:
                    s.settimeout(0.5)
                    for _ in range(rng.randrange(1, 60)):
                        f = _fuzz_frame(rng, hello_body)
                        if rng.random() < 0.05:  # cut mid-frame
                            f = f[:rng.randrange(1, len(f))]
                            s.sendall(f)
                            sent += 1
                            break
                        s.sendall(f)
                        sent += 1
                    try:
                        while s.recv(1 << 16):
                            pass
                    except (TimeoutError, OSError):
                        pass
            except OSError:
                time.sleep(0.01)
        counter[seed] = sent

    per = -(-total // threads)
    run_all(run, [(i, per) for i in range(threads)])


def run_all(fn: Callable[..., None], args: list[tuple[Any, ...]]) -> None:
    """``fn(*a)`` for every ``a`` of ``args``, each on a thread of its own, until all return."""
    ts = [threading.Thread(target=fn, args=a, daemon=True) for a in args]
    for t in ts:
        t.start()
    for t in ts:
        t.join()


# -- floods a stranger can send without a secret -------------------------------------------------
def pipeline_flood(host: str, port: int, connections: int, stop: threading.Event,
                   counter: list[int]) -> None:
    """Each connection pipelines STATS without waiting, 2,700 (64 KiB) at a time, and reads the
    replies as they come."""
    burst = b"".join(wire.frame(wire.OP_STATS, i + 1, 0) for i in range(2700))

    def run(k: int) -> None:
        while not stop.is_set():
            try:
                with socket.create_connection((host, port), timeout=5) as s:
                    s.settimeout(0.2)

                    def send() -> None:
                        with contextlib.suppress(OSError):
                            while not stop.is_set():
                                s.sendall(burst)

                    sender = threading.Thread(target=send, daemon=True)
                    sender.start()
                    while not stop.is_set():
                        try:
                            chunk = s.recv(1 << 20)
                        except TimeoutError:
                            continue
                        if not chunk:
                            break
                        counter[k] += chunk.count(b"DSPK")
            except OSError:
                time.sleep(0.05)

    run_all(run, [(k,) for k in range(connections)])


def keepalive_flood(host: str, port: int, connections: int, stop: threading.Event,
                    counter: list[int]) -> None:
    """``connections`` idle connections, each sent a PING every 2 s; any the worker closes is
    opened again at once."""
    socks: list[socket.socket | None] = [None] * connections
    seq = 0
    while not stop.is_set():
        for i in range(connections):
            if stop.is_set():
                break
            seq += 1
            try:
                if socks[i] is None:
                    socks[i] = socket.create_connection((host, port), timeout=2)
                s = socks[i]
                assert s is not None
                s.sendall(wire.frame(wire.OP_PING, seq, 0))
                s.settimeout(0.5)
                if not s.recv(64):
                    raise ConnectionError("closed")
            except (OSError, ConnectionError):
                counter[0] += 1  # closed by the worker (pushed out, refused)
                if socks[i] is not None:
                    socks[i].close()  # type: ignore[union-attr]
                socks[i] = None
        stop.wait(2.0)
    for s in socks:
        if s is not None:
            s.close()


def churn(host: str, port: int, rate: float, payload: bytes, done: Callable[[], bool],
          made: Callable[[], None] = lambda: None, hold: int = 64,
          sources: list[str] | None = None) -> None:
    """``rate`` new connections a second until ``done()``, each sent ``payload`` in one write
    and never read; the newest ``hold`` stay open (the oldest is closed). ``sources``: local
    addresses the connections come from in turn (127.0.0.N: Linux routes 127/8 to lo)."""
    held: list[socket.socket] = []
    t_next = time.monotonic()
    turn = 0
    while not done():
        try:
            source = (sources[turn % len(sources)], 0) if sources else None
            turn += 1
            s = socket.create_connection((host, port), timeout=2, source_address=source)
            s.setblocking(False)
            with contextlib.suppress(OSError):
                s.send(payload)
            held.append(s)
            made()
        except OSError:
            pass
        while len(held) > hold:
            held.pop(0).close()
        t_next += 1.0 / rate
        delay = t_next - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        else:
            t_next = time.monotonic()  # behind: no catching up in a burst
    for s in held:
        s.close()


def churn_flood(host: str, port: int, rate: float, burst: int, op: int, sources: list[str],
                stop: threading.Event, counter: list[int]) -> None:
    """``rate`` new connections a second (over 4 threads), each sent one write of ``burst``
    STATS or PINGs whose replies it never reads; each thread keeps its newest 64 open and
    ``counter`` counts the connections made; from ``sources`` in turn (none: the default)."""
    msg = b"".join(wire.frame(op, i + 1, 0) for i in range(burst))

    def run(k: int) -> None:
        def made() -> None:
            counter[k] += 1

        churn(host, port, rate / 4, msg, stop.is_set, made, sources=sources[k::4] or None)

    run_all(run, [(k,) for k in range(4)])


def hoard_lanes(host: str, port: int, hello_body: bytes, sources: list[str], step_s: float,
                stop: threading.Event, counter: list[int]) -> None:
    """A stranger with no secret reserves every lane it can: HELLOs of ``max_slots`` slots (4
    sessions a connection, up to 8 connections, from ``sources`` in turn), each of whose
    sessions then only PINGs, and HELLOs again every 0.5 s for what frees; with ``step_s``
    each session also sends a one-row STEP that often, to keep its reservation "used".
    ``counter[0]``: the sessions it holds now, ``counter[1]``: its HELLOs refused."""
    from protocol.messages import ReqEntry, pack_step

    base = wire.Hello.unpack(hello_body)
    socks: list[tuple[socket.socket, list[int]]] = []
    seq = 0
    next_session = 0x5EED0000
    anchors: dict[int, int] = {}  # session -> its slot 0's next anchor position
    stepped = time.monotonic()

    def ask(s: socket.socket, op: int, session: int, body: bytes = b"") -> int:
        nonlocal seq
        seq += 1
        s.sendall(wire.frame(op, seq, session, body))
        buf = b""
        while len(buf) < wire.APP_HEADER_SIZE:
            chunk = s.recv(1 << 16)
            if not chunk:
                raise ConnectionError("closed")
            buf += chunk
        h = wire.AppHeader.unpack(buf[:wire.APP_HEADER_SIZE])
        while len(buf) < wire.APP_HEADER_SIZE + h.body_len:
            chunk = s.recv(1 << 16)
            if not chunk:
                raise ConnectionError("closed")
            buf += chunk
        return int(h.status)

    while not stop.is_set():
        try:
            while len(socks) < 8:
                source = (sources[len(socks) % len(sources)], 0) if sources else None
                s = socket.create_connection((host, port), timeout=2, source_address=source)
                socks.append((s, []))
            step_now = step_s > 0 and time.monotonic() - stepped >= step_s
            if step_now:
                stepped = time.monotonic()
            for s, held in socks:
                held[:] = [sid for sid in held if ask(s, wire.OP_PING, sid) == wire.ST_OK]
                for sid in held if step_now else []:
                    pos = anchors.get(sid, 1)
                    anchors[sid] = pos + 1
                    body = pack_step(seq + 1, [ReqEntry(slot=0, generation=1, anchor_pos=pos,
                                                        anchor_token=1, n_rows=1)],
                                     bytes(base.row_bytes), base.row_bytes)
                    ask(s, wire.OP_STEP, sid, body)
                while len(held) < 4:
                    next_session += 1
                    hello = wire.Hello(**{f: getattr(base, f) for f in base.__struct_fields__
                                          if f != "client_name"},
                                       client_name=f"hoard-{next_session:x}")
                    if ask(s, wire.OP_HELLO, next_session, hello.pack()) != wire.ST_OK:
                        counter[1] += 1
                        break
                    held.append(next_session)
        except OSError:
            for s, _ in socks:
                s.close()
            socks = []
        counter[0] = sum(len(held) for _, held in socks)
        stop.wait(0.5)
    for s, _ in socks:
        s.close()


def loop_probe(host: str, port: int, hello_body: bytes, secret: bytes | None,
               stop: threading.Event, out: list[tuple[float, float]]) -> None:
    """The event loop's stalls as an engine's frames meet them: a session of its own (keyed
    when the worker has a secret) PINGs on its connection every 20 ms (a session's PING waits
    for no ration); (monotonic time, round trip in seconds) of each."""
    from protocol.auth import sign_hello

    base = wire.Hello.unpack(hello_body)
    hello = wire.Hello(**{f: getattr(base, f) for f in base.__struct_fields__
                          if f not in ("client_name", "max_slots")},
                       client_name="loop-probe", max_slots=1)
    session = 0x10097
    with socket.create_connection((host, port), timeout=10) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def ask(op: int, seq: int, body: bytes = b"") -> None:
            s.sendall(wire.frame(op, seq, session, body))
            buf = b""
            while len(buf) < wire.APP_HEADER_SIZE:
                buf += s.recv(1 << 16) or b"!" * 64
            h = wire.AppHeader.unpack(buf[:wire.APP_HEADER_SIZE])
            while len(buf) < wire.APP_HEADER_SIZE + h.body_len:
                buf += s.recv(1 << 16)

        ask(wire.OP_HELLO, 1, sign_hello(secret, session, 1, hello).pack())
        seq = 1
        while not stop.is_set():
            seq += 1
            t = time.perf_counter()
            ask(wire.OP_PING, seq)
            out.append((time.monotonic(), time.perf_counter() - t))
            stop.wait(0.02)


def worker_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) the process has used."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def first_reply_probe(host: str, port: int, stop: threading.Event, out: list[float]) -> None:
    """A new connection's first PING, every 0.2 s: its connect-to-reply time in seconds (inf
    when refused)."""
    while not stop.is_set():
        t = time.perf_counter()
        try:
            with socket.create_connection((host, port), timeout=10) as s:
                s.sendall(wire.frame(wire.OP_PING, 1, 0))
                s.settimeout(10)
                got = s.recv(64)
            out.append(time.perf_counter() - t if got else float("inf"))
        except OSError:
            out.append(float("inf"))
        stop.wait(0.2)


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


# -- the parent -----------------------------------------------------------------------------------
def rss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def scrape(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            with contextlib.suppress(ValueError):
                out[name] = float(value)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


FLOODS = ("none", "pipeline", "keepalive", "churn", "hoard")


def cpu_sampler(pid_of: Callable[[], int], stop: threading.Event,
                out: list[tuple[float, float]]) -> None:
    """(monotonic time, the worker's CPU seconds) every 0.25 s."""
    while not stop.is_set():
        out.append((time.monotonic(), worker_cpu_s(pid_of())))
        stop.wait(0.25)


def cpu_share(samples: list[tuple[float, float]], t0: float, t1: float) -> float:
    """The worker's CPU use between t0 and t1 (monotonic), in cores."""
    inside = [x for x in samples if t0 <= x[0] <= t1]
    if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
        return float("nan")
    return (inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engines", type=int, default=8)
    p.add_argument("--slots", type=int, default=64)
    p.add_argument("--duration", type=float, default=300.0, help="seconds")
    p.add_argument("--interval", type=float, default=15.0, help="seconds between report lines")
    p.add_argument("--window", type=int, default=64)
    p.add_argument("--fuzz-frames", type=int, default=100_000)
    p.add_argument("--fuzz-threads", type=int, default=4)
    p.add_argument("--fuzz-at", type=float, default=0.3, help="fraction of --duration")
    p.add_argument("--kill-at", type=float, default=0.7, help="fraction of --duration")
    p.add_argument("--sample-every", type=int, default=50,
                   help="check 1 in this many drafts (and all of the rounds after a reconnect)")
    p.add_argument("--max-check", type=int, default=10_000, help="drafts checked at most")
    p.add_argument("--timeout-ms", type=int, default=10_000)
    p.add_argument("--device", default="cpu")
    p.add_argument("--worker-arg", action="append", default=[],
                   help="an extra dspark-worker argument (repeatable): --worker-arg=--no-warmup")
    p.add_argument("--step-ms", type=float, default=2.0,
                   help="each engine's own time per round (its target step), slept")
    p.add_argument("--flood", choices=FLOODS, default="none",
                   help="a flood beside the engines from --fuzz-at until --kill-at: STATS"
                        " pipelined on --flood-connections connections; that many idle"
                        " connections kept open by a PING every 2 s; --churn-rate new"
                        " connections a second each sending --churn-burst frames it never"
                        " reads; or a stranger reserving every lane it can (hoard), with one"
                        " more engine started a second later")
    p.add_argument("--flood-connections", type=int, default=0,
                   help="default: 3 for pipeline, 300 for keepalive")
    p.add_argument("--churn-rate", type=float, default=300.0,
                   help="churn: new connections a second")
    p.add_argument("--churn-burst", type=int, default=32, help="churn: frames per connection")
    p.add_argument("--churn-op", choices=("stats", "ping"), default="stats")
    p.add_argument("--flood-addresses", type=int, default=0,
                   help="churn and hoard: connections come from this many loopback addresses"
                        " (127.0.3.1 ...; the worker counts them as one host unless given"
                        " --worker-arg=--no-loopback-one-peer)")
    p.add_argument("--hoard-step-s", type=float, default=0.0,
                   help="hoard: each hoarded session also sends a one-row STEP this often")
    p.add_argument("--secret", action="store_true",
                   help="the worker has a shared secret: the engines have it, the floods not")
    p.add_argument("--no-kill", action="store_true",
                   help="no kill -9 / restart (a flood measurement)")
    a = p.parse_args(argv)

    import torch

    from dspark_worker.drafter import load_drafter
    from tests.support.worker_proc import start_worker

    torch.set_num_threads(1)
    drafter = load_drafter(None)
    port, mport = free_port(), free_port()
    secret = os.urandom(32) if a.secret else None
    secret_args: tuple[str, ...] = ()
    if secret is not None:
        import tempfile

        secret_file = Path(tempfile.mkdtemp(prefix="dspark-soak-")) / "secret"
        secret_file.write_bytes(secret.hex().encode())
        secret = secret.hex().encode()  # the file's content is the secret (stripped)
        secret_args = ("--auth-secret-file", str(secret_file))
    sources = [f"127.0.3.{i + 1}" for i in range(a.flood_addresses)]
    worker_args = (*secret_args, "--listen", f"127.0.0.1:{port}",
                   "--metrics-listen", f"127.0.0.1:{mport}",
                   "--window", str(a.window), "--max-slots", str(a.slots),
                   # the engines' lanes twice over, and one for the loop probe's session;
                   # every engine and the probe on this host: its share is the pool
                   "--max-total-slots", str(a.engines * a.slots * 2 + 1),
                   "--max-slots-per-peer", str(a.engines * a.slots * 2 + 1),
                   "--max-sessions", str(max(64, 2 * a.engines)), "--device", a.device,
                   *a.worker_arg)
    t_start = time.monotonic()
    worker = start_worker(*worker_args, timeout=180)
    lives: list[list[int]] = [[]]  # RSS samples under load, per worker life
    hello = wire.Hello(sample_mode=wire.SAMPLE_GREEDY, window=a.window,
                       num_spec=drafter.num_spec, max_slots=a.slots,
                       max_rows_per_step=min(4096, a.window * a.slots),
                       row_bytes=drafter.row_bytes, vocab_size=drafter.vocab_size,
                       n_taps=drafter.n_taps, hidden=drafter.target_hidden,
                       drafter_identity=drafter.drafter_identity,
                       markov_identity=drafter.markov_identity, client_name="soak")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    killed, stop = ctx.Event(), ctx.Event()
    eargs = dict(endpoint=f"tcp://127.0.0.1:{port}", slots=a.slots, interval=a.interval,
                 sample_every=a.sample_every, timeout_ms=a.timeout_ms,
                 step_s=a.step_ms / 1000.0, secret=secret)
    procs = [ctx.Process(target=engine_main, args=(e, eargs, hello.pack(), out, killed, stop),
                         daemon=True) for e in range(a.engines)]
    for pr in procs:
        pr.start()
    n_engines = a.engines  # the hoard flood adds one more engine
    late_started: float | None = None  # wall clock of the late engine's start
    late_first_ok: float | None = None
    cpu: list[tuple[float, float]] = []
    cpu_stop = threading.Event()
    cpu_thread = threading.Thread(target=cpu_sampler, args=(lambda: worker.pid, cpu_stop, cpu),
                                  daemon=True)
    cpu_thread.start()
    loop_s: list[tuple[float, float]] = []
    loop_stop = threading.Event()

    def probe_loop() -> None:
        with contextlib.suppress(OSError):  # the worker killed (-9): the probe ends
            loop_probe("127.0.0.1", port, hello.pack(), secret, loop_stop, loop_s)

    loop_thread = threading.Thread(target=probe_loop, daemon=True)
    loop_thread.start()
    flood_on_t = flood_off_t = 0.0  # monotonic
    print(f"soak: {a.engines} engines x {a.slots} slots, W {a.window}, {a.duration:g} s,"
          f" fuzz {a.fuzz_frames} frames at {a.fuzz_at:.0%}, kill -9 at {a.kill_at:.0%};"
          f" worker pid {worker.pid}", flush=True)
    print(f"{'t_s':>6} {'steps':>7} {'failed':>6} {'rtt_p50_ms':>10} {'rtt_p99_ms':>10}"
          f" {'worker_rss_mb':>13}  events", flush=True)
    t0 = time.monotonic()
    fuzz_stop = threading.Event()
    fuzz_count = [0] * a.fuzz_threads
    fuzz_thread: threading.Thread | None = None
    fuzz_done_at: float | None = None
    flood_stop = threading.Event()
    flood_thread: threading.Thread | None = None
    probe_thread: threading.Thread | None = None
    flood_count: list[int] = [0]
    flood_on: float | None = None
    flood_off: float | None = None
    probe_s: list[float] = []
    # by phase (before, during, after the flood): [rounds ok, rounds failed, drafted, RTTs]
    phases: dict[str, list[Any]] = {k: [0, 0, 0, []] for k in ("before", "flood", "after")}
    killed_at = restarted_at = None
    first_log = ""
    box: list[Any] = []  # the restarted worker, from its thread
    done: dict[int, dict[str, Any]] = {}
    errors: list[str] = []
    tick_steps = tick_failed = 0
    tick_rtts: list[float] = []
    next_print = t0 + a.interval
    events: list[str] = []
    failures: list[str] = []
    while True:
        now = time.monotonic()
        el = now - t0
        if a.flood != "none" and flood_thread is None and el >= a.fuzz_at * a.duration:
            n = a.flood_connections or (3 if a.flood == "pipeline" else 300)
            flood_args: tuple[Any, ...]
            if a.flood == "churn":
                n = int(a.churn_rate)
                flood_count = [0] * 4
                op = wire.OP_STATS if a.churn_op == "stats" else wire.OP_PING
                flood_args = (churn_flood, "127.0.0.1", port, a.churn_rate, a.churn_burst, op,
                              sources)
            elif a.flood == "hoard":
                n = 8
                flood_count = [0, 0]
                flood_args = (hoard_lanes, "127.0.0.1", port, hello.pack(), sources,
                              a.hoard_step_s)
            else:
                flood_count = [0] * max(n, 1)
                flood_args = (pipeline_flood if a.flood == "pipeline" else keepalive_flood,
                              "127.0.0.1", port, n)
            flood_thread = threading.Thread(target=flood_args[0],
                                            args=(*flood_args[1:], flood_stop, flood_count),
                                            daemon=True)
            flood_thread.start()
            flood_on_t = now
            probe_thread = threading.Thread(target=first_reply_probe,
                                            args=("127.0.0.1", port, flood_stop, probe_s),
                                            daemon=True)
            probe_thread.start()
            flood_on = el
            events.append(f"{a.flood} flood ({n} connections)")
        if (a.flood == "hoard" and late_started is None and flood_on is not None
                and el >= flood_on + 1.0):
            late = ctx.Process(target=engine_main, args=(n_engines, eargs, hello.pack(), out,
                                                         killed, stop), daemon=True)
            late.start()
            procs.append(late)
            late_started = time.time()
            n_engines += 1
            events.append(f"one more engine ({flood_count[0]} sessions hoarded)")
        if flood_thread is not None and flood_off is None and el >= a.kill_at * a.duration:
            flood_stop.set()
            flood_off = el
            flood_off_t = now
            events.append(f"{a.flood} flood stopped")
        if fuzz_thread is None and el >= a.fuzz_at * a.duration:
            fuzz_thread = threading.Thread(
                target=fuzz_storm, args=("127.0.0.1", port, hello.pack(), a.fuzz_frames,
                                         a.fuzz_threads, fuzz_count, fuzz_stop), daemon=True)
            fuzz_thread.start()
            events.append("fuzz storm")
        if fuzz_thread is not None and fuzz_done_at is None and not fuzz_thread.is_alive():
            fuzz_done_at = el
            events.append(f"fuzz done ({sum(fuzz_count)} frames)")
        # The kill comes after the storm has sent all its frames (a slow machine may need longer
        # than --kill-at allows): the storm is judged whole, then the restart.
        if (killed_at is None and not a.no_kill and el >= a.kill_at * a.duration
                and fuzz_done_at is not None):
            fuzz_stop.set()  # the storm must not outlive the worker it aims at
            os.kill(worker.pid, signal.SIGKILL)
            worker.proc.wait(30)
            killed.set()
            first_log = worker.log_text()
            worker.kill()  # reaped already: removes its folder
            killed_at = el
            events.append("kill -9")
            restart = threading.Thread(target=lambda: box.append(
                start_worker(*worker_args, timeout=300)), daemon=True)
            restart.start()
        if killed_at is not None and restarted_at is None and box:
            worker = box.pop()
            restarted_at = el
            lives.append([])
            events.append(f"restarted in {restarted_at - killed_at:.1f} s")
        try:
            msg = out.get(timeout=0.2)
        except queue.Empty:
            msg = None
        if msg is not None:
            if msg[0] == "tick":
                tick_steps += msg[2]
                tick_failed += msg[3]
                tick_rtts.extend(msg[4])
                ph = phases["before" if flood_on is None else "flood" if flood_off is None
                            else "after"]
                ph[0] += msg[2]
                ph[1] += msg[3]
                ph[2] += msg[5]
                ph[3].extend(msg[4])
            elif msg[0] == "first_ok" and msg[1] >= a.engines:
                late_first_ok = msg[2]
                events.append(f"the late engine drafts, {msg[2] - (late_started or 0):.2f} s"
                              " after its start")
            elif msg[0] == "error":
                errors.append(f"engine {msg[1]}: {msg[2]}")
        if time.monotonic() >= next_print:
            rss = rss_bytes(worker.pid) if killed_at is None or restarted_at else 0
            if rss and tick_steps:  # under load: warm-up and start-up samples say nothing
                lives[-1].append(rss)
            r = np.asarray(tick_rtts) / 1000.0
            p50 = float(np.percentile(r, 50)) if r.size else float("nan")
            p99 = float(np.percentile(r, 99)) if r.size else float("nan")
            line = (f"{time.monotonic() - t0:6.0f} {tick_steps:7d} {tick_failed:6d} {p50:10.2f}"
                    f" {p99:10.2f} {rss / 2**20:13.1f}  {', '.join(events)}")
            print(line.rstrip(), flush=True)
            events = []
            tick_steps = tick_failed = 0
            tick_rtts = []
            next_print += a.interval
        # The run lasts --duration, and at least 30% of it after the worker is back.
        if errors or (el >= a.duration and (a.no_kill or (
                restarted_at is not None and el >= restarted_at + 0.3 * a.duration))):
            break
    stop.set()
    deadline = time.monotonic() + 120
    while len(done) + len(errors) < n_engines and time.monotonic() < deadline:
        try:
            msg = out.get(timeout=1.0)
        except queue.Empty:
            continue
        if msg[0] == "done":
            done[msg[1]] = msg[2]
        elif msg[0] == "first_ok" and msg[1] >= a.engines and late_first_ok is None:
            late_first_ok = msg[2]
        elif msg[0] == "error":
            errors.append(f"engine {msg[1]}: {msg[2]}")
    cpu_stop.set()
    loop_stop.set()
    loop_thread.join(10)
    for pr in procs:
        pr.join(10)
        if pr.is_alive():
            pr.kill()
    fuzz_stop.set()
    flood_stop.set()
    if fuzz_thread is not None:
        fuzz_thread.join(30)
    for t in (flood_thread, probe_thread):
        if t is not None:
            t.join(30)
    metrics = scrape(worker.metrics_url or "") if worker.metrics_url else {}
    worker_log = worker.log_text()
    worker.stop()

    # -- verdict ------------------------------------------------------------------------------
    failures += errors
    if len(done) < n_engines:
        failures.append(f"only {len(done)} of {n_engines} engines reported")
    fuzz_sent = sum(fuzz_count)
    if fuzz_sent < a.fuzz_frames:
        failures.append(f"fuzz storm sent {fuzz_sent} frames, fewer than {a.fuzz_frames}")
    for i, life in enumerate(lives):
        # From the end of the first interval under load (buffers and batches at their sizes).
        stable = life[1:]
        if len(stable) < 2:
            print(f"worker life {i + 1}: too few RSS samples under load for a trend")
        else:
            growth = max(stable) / stable[0] - 1.0
            print(f"worker life {i + 1}: RSS {stable[0] / 2**20:.1f} -> max"
                  f" {max(stable) / 2**20:.1f} MiB ({growth:+.1%})")
            if growth > RSS_GROWTH_LIMIT:
                failures.append(f"worker life {i + 1}: RSS grew {growth:.1%}")
    steps_since = sum(d["stats"].get("steps_ok", 0) - (d["baseline"] or {}).get("steps_ok", 0)
                      for d in done.values())
    rows_since = sum(d["rows_ok_since_kill"] for d in done.values())
    w_steps = metrics.get('dspark_worker_frames_total{op="STEP",status="OK"}', -1.0)
    w_rows = metrics.get("dspark_worker_received_rows_total", -1.0)
    print(f"after the restart: clients {steps_since} STEPs OK / {rows_since} rows, worker"
          f" /metrics {w_steps:.0f} / {w_rows:.0f}")
    if killed_at is not None and (w_steps != steps_since or w_rows != rows_since):
        failures.append(f"counters differ: clients {steps_since} STEPs {rows_since} rows,"
                        f" worker {w_steps} STEPs {w_rows} rows")
    lost = sum(d["lost"] for d in done.values())
    worst = max((d["worst_after_reconnect"] for d in done.values()), default=0)
    bound = max((d["bound"] for d in done.values()), default=0)
    still = sum(d["still_waiting"] for d in done.values())
    disabled = [e for e, d in done.items() if d["disabled"]]
    print(f"after reconnects: every slot drafted again within {worst} rounds (bound {bound});"
          f" {still} slots still waiting at the end; lost {lost}; disabled engines {disabled}")
    if lost:
        failures.append(f"{lost} lost drafts or rounds over the bound")
    if worst > bound:
        failures.append(f"a slot needed {worst} rounds to draft after a reconnect (bound {bound})")
    if disabled:
        failures.append(f"engines disabled: {disabled}")
    # Wrong drafts: the reference drafter on the same newest rows.
    samples = [(e, *s) for e, d in done.items() for s in d["samples"]]
    rng = random.Random(0)
    if len(samples) > a.max_check:
        samples = rng.sample(samples, a.max_check)
    width = drafter.row_bytes // 2
    wrong = 0
    for i in range(0, len(samples), 64):
        batch = samples[i:i + 64]
        rows = [rows_for(e, s, g, max(0, pos - a.window), pos, width)
                for e, s, g, pos, _tok, _d in batch]
        ref = drafter.reference_draft(rows, [b[3] for b in batch], [b[4] for b in batch])
        for j, (_e, _s, _g, _pos, _tok, got) in enumerate(batch):
            if ref.draft_ids[j, :len(got)].tolist() != got:
                wrong += 1
    total_rounds = sum(d["rounds"] for d in done.values())
    reconnects = sum(d["reconnects"] for d in done.values())
    print(f"drafts checked against the reference drafter: {len(samples)}, wrong {wrong};"
          f" rounds {total_rounds}, reconnects {reconnects}, fuzz frames {fuzz_sent}")
    if wrong:
        failures.append(f"{wrong} wrong drafts")
    tracebacks = worker_log.count("Traceback") + first_log.count("Traceback")
    if tracebacks:
        failures.append(f"{tracebacks} tracebacks in the worker's logs")
    flood: dict[str, Any] = {}
    if a.flood != "none":
        for name, (ok, failed, drafted, rtts) in phases.items():
            rtt_ms = [x / 1000.0 for x in rtts]
            flood[name] = {"rounds_ok": ok, "rounds_failed": failed, "drafted": drafted,
                           "rtt_p50_ms": round(_pct(rtt_ms, 50), 2),
                           "rtt_p99_ms": round(_pct(rtt_ms, 99), 2)}
            print(f"{a.flood} flood, {name}: {ok} rounds ok, {failed} failed, {drafted}"
                  f" drafted positions, RTT p50 {_pct(rtt_ms, 50):.2f} ms p99"
                  f" {_pct(rtt_ms, 99):.2f} ms")
        finite = [x for x in probe_s if x != float("inf")]
        flood["new_connection"] = {
            "probes": len(probe_s), "refused": len(probe_s) - len(finite),
            "p50_ms": round(_pct(finite, 50) * 1e3, 2),
            "p99_ms": round(_pct(finite, 99) * 1e3, 2),
            "max_ms": round(max(finite, default=float("nan")) * 1e3, 2)}
        flood["flood_replies_or_closes"] = sum(flood_count)
        t_end = flood_off_t or time.monotonic()
        for name, lo, hi in (("before", 0.0, flood_on_t), ("flood", flood_on_t, t_end),
                             ("after", t_end, float("inf"))):
            rt = [r for t, r in loop_s if lo <= t < hi]
            ph = phases[name]
            flood[name]["ok_share"] = round(ph[0] / max(1, ph[0] + ph[1]), 4)
            flood[name]["loop_worst_ms"] = round(max(rt, default=float("nan")) * 1e3, 1)
            flood[name]["loop_p99_ms"] = round(_pct(rt, 99) * 1e3, 1)
        print("OK share / loop worst ms, before, during, after: "
              + ", ".join(f"{flood[k]['ok_share']:.1%} / {flood[k]['loop_worst_ms']}"
                          for k in ("before", "flood", "after")))
        print(f"new connections during the flood: {flood['new_connection']}")
        t_end = flood_off_t or time.monotonic()
        flood["worker_cpu_cores"] = {
            "before": round(cpu_share(cpu, flood_on_t - 5.0, flood_on_t), 2),
            "flood": round(cpu_share(cpu, flood_on_t, t_end), 2),
            "after_by_second": [round(cpu_share(cpu, t_end + i, t_end + i + 1), 2)
                                for i in range(5)]}
        print(f"worker CPU (cores): {flood['worker_cpu_cores']}")
        if a.flood == "hoard":
            took = (late_first_ok - late_started if late_first_ok is not None
                    and late_started is not None else None)
            flood["late_engine_first_ok_s"] = None if took is None else round(took, 2)
            flood["hoarded_sessions_at_end"] = flood_count[0]
            flood["hoard_hellos_refused"] = flood_count[1]
            print(f"the engine started during the hoard drafted after {took} s")
            if took is None:
                failures.append("the engine started during the hoard never drafted")
        if len(finite) < len(probe_s):
            failures.append(f"{len(probe_s) - len(finite)} new connections got no reply"
                            " during the flood")
    summary = {"engines": a.engines, "slots": a.slots, "duration_s": a.duration,
               "wall_s": round(time.monotonic() - t_start, 1), "rounds": total_rounds,
               "fuzz_frames": fuzz_sent, "killed_at_s": killed_at,
               "restart_s": None if killed_at is None or restarted_at is None
               else round(restarted_at - killed_at, 2),
               "checked_drafts": len(samples), "wrong_drafts": wrong, "lost": lost,
               "worst_rounds_after_reconnect": worst, "bound": bound, "flood": flood,
               "failures": failures}
    print("summary " + json.dumps(summary))
    if failures:
        print("SOAK FAILED:\n  " + "\n  ".join(f.splitlines()[0] for f in failures))
        return 1
    print("SOAK OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
