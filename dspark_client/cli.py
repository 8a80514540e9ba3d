"""``dspark-client``: talk to a draft worker from a shell.

    dspark-client [--endpoint E] [--timeout S] [--auth-secret-file F] COMMAND

    ping [-c N]          PING, print the round-trip time
    stats                STATS, print the worker's JSON (pretty)
    reset [SLOT ...]     HELLO a session of our own, then RESET those slots (all when none)
    bench [...]          drive the worker with synthetic rows, print RTT percentiles and rates
    demo [...]           speculative decoding with the reference pair (needs torch); starts a
                         worker on loopback unless an endpoint is given

Commands that HELLO (reset, bench, demo) first learn the worker's geometry: a probe HELLO is
answered with a HelloReply that carries the worker's own W, N, row_bytes, vocab_size, tap
geometry, identities and limits, also when it refuses (6.1).

Exit status: 0 ok; 1 the worker answered an error (a refusal, a bad reply); 2 usage or
connection error. Failures print one line on stderr.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import secrets
import sys
import time
from collections.abc import Sequence
from typing import Any, Final, TextIO

import numpy as np

from protocol import wire
from protocol.auth import sign_hello
from protocol.messages import pack_reset

from .client import RemoteDraftClient
from .config import DEFAULT_ENDPOINT, RemoteConfig, RemoteConfigError, load_auth_secret
from .rounds import DraftRounds, SlotRequest
from .transport import SocketClient, TransportError, make_client

__all__ = ["main"]

EXIT_OK: Final = 0
EXIT_WORKER: Final = 1
EXIT_USAGE: Final = 2


class CliError(Exception):
    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def _worker_error(message: str) -> CliError:
    return CliError(message, EXIT_WORKER)


def _conn_error(message: str) -> CliError:
    return CliError(message, EXIT_USAGE)


# -- plumbing ------------------------------------------------------------------------------------
class Ctx:
    def __init__(self, args: argparse.Namespace) -> None:
        self.endpoint: str = args.endpoint or DEFAULT_ENDPOINT
        self.timeout: float = args.timeout
        self.secret: bytes | None = (load_auth_secret(args.auth_secret_file)
                                     if args.auth_secret_file else None)
        self._seq = 0

    def config(self) -> RemoteConfig:
        ms = self.timeout * 1000.0
        return RemoteConfig(endpoint=self.endpoint, connect_timeout_ms=ms, timeout_ms=ms,
                            auth_secret=self.secret)

    def connect(self) -> SocketClient:
        conn = make_client(self.endpoint)
        try:
            conn.connect(self.timeout)
        except TransportError as exc:
            raise _conn_error(str(exc)) from None
        return conn

    def request(self, conn: SocketClient, op: int, body: bytes = b"", session: int = 0,
                buf: bytearray | None = None) -> tuple[wire.AppHeader, bytes]:
        self._seq += 1
        seq = self._seq
        buf = buf if buf is not None else bytearray(1 << 16)
        try:
            n = conn.request(wire.frame(op, seq, session, body), buf, self.timeout)
        except TransportError as exc:
            raise _conn_error(str(exc)) from None
        try:
            h, rb = wire.split_frame(memoryview(buf)[:n])
        except wire.WireError as exc:
            raise _worker_error(f"unreadable reply: {exc}") from None
        if h.op != op or h.seq != seq or h.session != session:
            raise _worker_error(f"reply echoes op={h.op} seq={h.seq} session={h.session:#x};"
                                f" sent op={op} seq={seq} session={session:#x}")
        return h, bytes(rb)


def _status_name(status: int) -> str:
    return wire.FRAME_STATUS_NAMES.get(status, f"status {status}")


def _worker_stats(ctx: Ctx) -> dict[str, Any]:
    with ctx.connect() as conn:
        h, body = ctx.request(conn, wire.OP_STATS)
    if h.status != wire.ST_OK:
        raise _worker_error(f"STATS refused: {_status_name(h.status)}")
    try:
        out = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise _worker_error(f"STATS reply is not JSON: {exc}") from None
    if not isinstance(out, dict):
        raise _worker_error(f"STATS reply is JSON {type(out).__name__}, not an object")
    return out


def discover(ctx: Ctx, *, sampled: bool, max_slots: int | None = None,
             client_name: str = "dspark-client") -> wire.Hello:
    """A Hello that this worker accepts: its own geometry and identities, learnt from a probe
    HELLO's reply (6.1), which the worker fills with its own values also when it refuses."""
    probe = wire.Hello(sample_mode=wire.SAMPLE_TOP32 if sampled else wire.SAMPLE_GREEDY,
                       window=1, num_spec=1, max_slots=1, max_rows_per_step=1, row_bytes=2,
                       vocab_size=1, n_taps=1, hidden=1, drafter_identity=bytes(32),
                       markov_identity=bytes(32), client_name=client_name)
    session = secrets.randbits(32) or 1
    with ctx.connect() as conn:
        seq = ctx._seq + 1
        signed = sign_hello(ctx.secret, session, seq, probe)
        h, body = ctx.request(conn, wire.OP_HELLO, signed.pack(), session=session)
    if h.status in (wire.ST_AUTH, wire.ST_VERSION):
        hint = " (pass --auth-secret-file)" if h.status == wire.ST_AUTH and not ctx.secret else ""
        raise _worker_error(f"HELLO refused: {_status_name(h.status)}{hint}")
    if len(body) != wire.HELLO_REP.size:
        raise _worker_error(f"HELLO answered {_status_name(h.status)} with a {len(body)}-byte"
                            f" body, not a HelloReply")
    rep = wire.HelloReply.unpack(body)
    if sampled and not rep.capabilities & wire.CAP_TOP32:
        raise _worker_error("the worker does not serve sampled (top32) sessions")
    n_taps, hidden = rep.n_taps, rep.hidden
    if n_taps * hidden * 2 != rep.row_bytes:
        raise _worker_error(f"the worker's HelloReply names n_taps {n_taps} and hidden {hidden},"
                            f" which do not make its row_bytes {rep.row_bytes}")
    slots = rep.max_slots if max_slots is None else min(max_slots, rep.max_slots)
    return wire.Hello(sample_mode=probe.sample_mode, window=rep.window, num_spec=rep.num_spec,
                      max_slots=slots, max_rows_per_step=rep.max_rows_per_step,
                      row_bytes=rep.row_bytes, vocab_size=rep.vocab_size, n_taps=n_taps,
                      hidden=hidden, drafter_identity=rep.drafter_identity,
                      markov_identity=rep.markov_identity, client_name=client_name)


def _open_client(ctx: Ctx, hello: wire.Hello) -> RemoteDraftClient:
    client = RemoteDraftClient(ctx.config(), hello, background=False)
    if not client.connect_now():
        client.close()
        if client.disabled_reason:
            raise _worker_error(client.disabled_reason)
        raise _conn_error(client.last_error or "connect failed")
    return client


# -- commands ------------------------------------------------------------------------------------
def cmd_ping(ctx: Ctx, args: argparse.Namespace, out: TextIO) -> int:
    with ctx.connect() as conn:
        for _ in range(args.count):
            t0 = time.perf_counter()
            h, _body = ctx.request(conn, wire.OP_PING)
            rtt_ms = (time.perf_counter() - t0) * 1e3
            if h.status != wire.ST_OK:
                raise _worker_error(f"PING refused: {_status_name(h.status)}")
            print(f"pong from {ctx.endpoint}: {rtt_ms:.3f} ms", file=out)
    return EXIT_OK


def cmd_stats(ctx: Ctx, args: argparse.Namespace, out: TextIO) -> int:
    print(json.dumps(_worker_stats(ctx), indent=2, sort_keys=True), file=out)
    return EXIT_OK


def cmd_reset(ctx: Ctx, args: argparse.Namespace, out: TextIO) -> int:
    hello = discover(ctx, sampled=False, max_slots=max([*args.slots, 0]) + 1)
    for s in args.slots:
        if s >= hello.max_slots:
            raise CliError(f"slot {s} is not below the worker's max_slots {hello.max_slots}",
                           EXIT_USAGE)
    client = _open_client(ctx, hello)
    try:
        try:
            status, _ = client.simple_request(wire.OP_RESET, pack_reset(list(args.slots)))
        except (TransportError, wire.WireError) as exc:
            raise _conn_error(f"RESET: {exc}") from None
    finally:
        client.close()
    if status != wire.ST_OK:
        raise _worker_error(f"RESET refused: {_status_name(status)}")
    what = ", ".join(map(str, args.slots)) if args.slots else "every slot"
    print(f"reset {what} of session {client.session:#010x}: OK", file=out)
    return EXIT_OK


class Progress:
    """A one-line progress bar on stderr, redrawn at most 10 times a second."""

    def __init__(self, total: int, stream: TextIO, enabled: bool) -> None:
        self.total, self.stream, self.enabled = total, stream, enabled
        self._last = 0.0

    def update(self, done: int, note: str = "") -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if done < self.total and now - self._last < 0.1:
            return
        self._last = now
        width = 30
        fill = int(width * done / max(self.total, 1))
        self.stream.write(f"\r[{'#' * fill}{'.' * (width - fill)}] {done}/{self.total} {note}")
        if done >= self.total:
            self.stream.write("\n")
        self.stream.flush()


def _percentiles(values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {}
    a = np.asarray(values, dtype=np.float64)
    qs = np.percentile(a, [50, 90, 99])
    return {"p50": float(qs[0]), "p90": float(qs[1]), "p99": float(qs[2]),
            "max": float(a.max()), "mean": float(a.mean())}


def cmd_bench(ctx: Ctx, args: argparse.Namespace, out: TextIO) -> int:
    hello = discover(ctx, sampled=args.sampled, max_slots=args.batch,
                     client_name=f"dspark-bench-{os.getpid()}")
    if hello.max_slots < args.batch:
        raise CliError(f"--batch {args.batch} is over the worker's max_slots"
                       f" {hello.max_slots}", EXIT_USAGE)
    client = _open_client(ctx, hello)
    rounds = DraftRounds(client)
    rng = np.random.default_rng(args.seed)
    W, N, rb = hello.window, hello.num_spec, hello.row_bytes
    B = args.batch
    accept = min(args.accept if args.accept is not None else max(N // 2, 0), N)
    # Synthetic rows: a pool of random bf16 bit patterns (finite values, as taps would be).
    pool = _synthetic_rows(rng, max(W, accept + 1) * 2, rb)
    prompt = max(W, 1)
    anchor = [prompt] * B
    gens = [1] * B
    rtts: list[float] = []
    rounds_us: list[float] = []
    failed = drafted = rows = 0
    progress = Progress(args.warmup + args.steps, sys.stderr,
                        enabled=not args.no_progress)
    t_start = time.perf_counter()
    try:
        for step in range(args.warmup + args.steps):
            reqs = []
            for s in range(B):
                n_new = anchor[s] if step == 0 else accept + 1
                if step > 0:
                    anchor[s] += n_new
                at = (anchor[s] * 7 + s) % (pool.shape[0] - n_new)
                reqs.append(SlotRequest(
                    slot=s, generation=gens[s], anchor_pos=anchor[s],
                    anchor_token=int(rng.integers(hello.vocab_size)),
                    rows=pool[at:at + n_new] if n_new <= pool.shape[0] else None, n_out=N,
                    seed=s + 1 if args.sampled else 0, top_k=8 if args.sampled else 0,
                    temperature=1.0 if args.sampled else 0.0))
            t0 = time.perf_counter()
            res = rounds.run(reqs)
            dt_us = (time.perf_counter() - t0) * 1e6
            if step >= args.warmup:
                rounds_us.append(dt_us)
                if res.ok:
                    rtts.append(res.rtt_us)
                    drafted += int(res.num_drafted.sum())
                    rows += res.rows_sent
                else:
                    failed += 1
            elif step == 0 and not res.ok:
                raise _worker_error(f"first round failed: {res.reason}"
                                    f" ({client.disabled_reason or client.last_error})")
            progress.update(step + 1, f"rtt {res.rtt_us / 1e3:.2f} ms")
            if client.disabled:
                raise _worker_error(client.disabled_reason or "disabled")
    finally:
        client.close()
    elapsed = time.perf_counter() - t_start
    measured = sum(rounds_us) / 1e6
    result = {
        "endpoint": ctx.endpoint, "batch": B, "steps": args.steps, "num_spec": N,
        "window": W, "row_bytes": rb, "sampled": bool(args.sampled),
        "accepted_rows_per_slot": accept + 1, "failed_rounds": failed,
        "rtt_us": _percentiles(rtts), "round_us": _percentiles(rounds_us),
        "rounds_per_s": args.steps / measured if measured else math.nan,
        "rows_per_s": rows / measured if measured else math.nan,
        "drafted_positions_per_s": drafted / measured if measured else math.nan,
        "elapsed_s": elapsed,
    }
    if args.json:
        print(json.dumps(result, indent=2), file=out)
    else:
        r, t = result["rtt_us"], result["round_us"]
        print(f"{ctx.endpoint}: batch {B}, N {N}, W {W}, row_bytes {rb},"
              f" {'sampled' if args.sampled else 'greedy'}, {args.steps} rounds"
              f" ({failed} failed)", file=out)
        if r:
            print(f"  rtt    p50 {r['p50']:9.1f} us  p90 {r['p90']:9.1f} us"
                  f"  p99 {r['p99']:9.1f} us  max {r['max']:9.1f} us", file=out)
        if t:
            print(f"  round  p50 {t['p50']:9.1f} us  p90 {t['p90']:9.1f} us"
                  f"  p99 {t['p99']:9.1f} us  max {t['max']:9.1f} us", file=out)
        print(f"  {result['rounds_per_s']:.1f} rounds/s, {result['rows_per_s']:.0f} rows/s,"
              f" {result['drafted_positions_per_s']:.0f} drafted positions/s", file=out)
    return EXIT_WORKER if failed == args.steps and args.steps else EXIT_OK


def _synthetic_rows(rng: np.random.Generator, n: int, row_bytes: int) -> np.ndarray:
    """Rows of bf16 values in [-2, 2): what tap rows look like on the wire."""
    vals = rng.uniform(-2.0, 2.0, size=(n, row_bytes // 2)).astype(np.float32)
    bf16 = (vals.view(np.uint32) >> 16).astype(np.uint16)
    out = np.zeros((n, row_bytes), np.uint8)
    out[:, :bf16.shape[1] * 2] = bf16.view(np.uint8).reshape(n, -1)
    return out


# -- entry ---------------------------------------------------------------------------------------
def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r} must be a number > 0")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be > 0")
    return value


def _slot(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"slot {text!r} is not an integer") from None
    if not 0 <= value <= 0xFFFFFFFF:
        raise argparse.ArgumentTypeError(f"slot {value} outside [0, 2**32)")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dspark-client",
                                description="Talk to a DSpark draft worker.")
    p.add_argument("--endpoint", default=os.environ.get("DSPARK_ENDPOINT"),
                   help="tcp://HOST:PORT, unix:///PATH or unix+shm:///PATH (rows through"
                        " shared memory on the same host) (default: $DSPARK_ENDPOINT or"
                        f" {DEFAULT_ENDPOINT})")
    p.add_argument("--timeout", type=_positive_float, default=2.0,
                   help="seconds for a connect and for each request (default 2)")
    p.add_argument("--auth-secret-file", default=None,
                   help="file holding the shared secret that signs HELLOs (section 11)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    ping = sub.add_parser("ping", help="PING the worker, print the round trip")
    ping.add_argument("-c", "--count", type=_positive_int, default=1)
    sub.add_parser("stats", help="print the worker's STATS JSON")
    reset = sub.add_parser("reset", help="RESET slots (all when none) of a session of our own")
    reset.add_argument("slots", nargs="*", type=_slot, metavar="SLOT")
    bench = sub.add_parser("bench", help="drive the worker with synthetic rows")
    bench.add_argument("--batch", type=_positive_int, default=8, help="slots per round")
    bench.add_argument("--steps", type=_positive_int, default=200, help="measured rounds")
    bench.add_argument("--warmup", type=int, default=10, help="unmeasured rounds first")
    bench.add_argument("--accept", type=int, default=None,
                       help="accepted drafts per slot per round (default N/2)")
    bench.add_argument("--sampled", action="store_true", help="a top32 sampled session")
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--json", action="store_true", help="print the result as JSON")
    bench.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    demo = sub.add_parser("demo", help="speculative decoding with the reference target and"
                                       " pair drafter (torch); starts a worker if no endpoint")
    demo.add_argument("--prompt", default=None, help="text to continue (default: Python code)")
    demo.add_argument("--max-new-tokens", type=_positive_int, default=200)
    demo.add_argument("--temperature", type=float, default=0.0,
                      help="0: greedy; > 0: sampled with exact rejection sampling")
    demo.add_argument("--batch", type=_positive_int, default=1, help="sequences at once")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--shm", action="store_true",
                      help="the worker the demo starts serves a Unix socket and the rows go"
                           " through shared memory (unix+shm://); with --endpoint, give"
                           " unix+shm:///PATH instead")
    demo.add_argument("--target", default=None,
                      help="a reference target folder (default: the one shipped)")
    return p


def cmd_demo(ctx: Ctx, args: argparse.Namespace, out: TextIO) -> int:
    try:
        from .demo.run import DEFAULT_PROMPT, run_demo
    except ImportError as exc:  # torch is optional for the client
        raise _conn_error(f"the demo needs torch: {exc}") from None
    if args.prompt is None:
        args.prompt = DEFAULT_PROMPT
    if args.temperature < 0:
        raise _conn_error(f"--temperature {args.temperature} is negative")

    def hello_for(endpoint: str, sampled: bool) -> wire.Hello:
        ctx.endpoint = endpoint
        return discover(ctx, sampled=sampled, client_name="dspark-demo")

    return run_demo(hello_for, args, out)


COMMANDS = {"ping": cmd_ping, "stats": cmd_stats, "reset": cmd_reset, "bench": cmd_bench,
            "demo": cmd_demo}


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)  # usage errors: argparse prints usage and exits 2
    out = out if out is not None else sys.stdout
    if args.command == "bench" and (args.warmup < 0 or (args.accept is not None
                                                        and args.accept < 0)):
        print("dspark-client: error: --warmup and --accept must be >= 0", file=sys.stderr)
        return EXIT_USAGE
    try:
        ctx = Ctx(args)
        return COMMANDS[args.command](ctx, args, out)
    except CliError as exc:
        print(f"dspark-client: {exc}", file=sys.stderr)
        return exc.code
    except (RemoteConfigError, TransportError) as exc:
        print(f"dspark-client: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("dspark-client: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
