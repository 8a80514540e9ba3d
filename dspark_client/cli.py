"""``dspark-client``: talk to a draft worker from a shell.

    dspark-client [--endpoint E] [--timeout S] [--auth-secret-file F] [-v] COMMAND [...]

    ping [-c N]          PING, print the round-trip time (a min/avg/max summary for N > 1)
    stats [--json]       STATS: a short summary, or the worker's JSON
    reset [SLOT ...]     check the worker's RESET on a session of our own (RESET only ever
                         acts on the sender's session: no engine's windows are touched)
    reload [--no-wait]   RELOAD (signed with --auth-secret-file): the worker reads its drafter
                         and canary folders again; waits for the outcome and prints it
    bench [...]          drive the worker with synthetic rows, print RTT percentiles and rates
    demo [...]           speculative decoding with the reference pair (needs torch)

The global options may also follow the command (``dspark-client ping --endpoint ...``). An
endpoint is ``tcp://HOST:PORT``, ``unix:///PATH``, ``dns+tcp://NAME:PORT`` (every worker the
name resolves to: ``ping`` and ``stats`` ask each, the other commands the first), or a bare
``HOST:PORT`` (TCP).

A good citizen on a shared worker: commands that need a session (reset, bench, demo) learn the
worker's geometry, identities and limits from STATS (section 10), so they never send a HELLO the
worker refuses (a refusal counts in ``hello_refusals_total`` and may page an operator), and they
check the worker's capacity before asking. Each releases its session with GOODBYE when it ends:
normally, on an error, and on Ctrl-C (the first Ctrl-C lets the request in flight finish and
releases the session; a second one quits at once, and the worker then releases the session
after its ``session_idle_s``).

Exit status: 0 ok; 1 the worker answered an error (a refusal, a bad reply, BUSY) or more than
1% of bench's measured rounds failed; 2 usage error; 3 connection error (cannot connect, timed
out, connection lost); 130 interrupted; 141 the output pipe closed (``| head``), quietly.
Failures print one line on stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import signal
import socket
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any, Final, TextIO

import msgspec
import numpy as np

from protocol import wire
from protocol.auth import reload_body
from protocol.identity import NO_MARKOV_HEAD
from protocol.messages import pack_reset

from . import __version__
from .client import RemoteDraftClient
from .config import DEFAULT_ENDPOINT, RemoteConfig, RemoteConfigError, load_auth_secret
from .discovery import Discovery, check_endpoint, is_dns_endpoint
from .rounds import DraftRounds, SlotRequest
from .transport import (
    EndpointError,
    SocketClient,
    TransportError,
    TransportTimeout,
    make_client,
    parse_endpoint,
)

__all__ = ["BENCH_MAX_FAILED_SHARE", "main", "normalise_endpoint"]

EXIT_OK: Final = 0
EXIT_WORKER: Final = 1
EXIT_USAGE: Final = 2
EXIT_CONNECTION: Final = 3
EXIT_INTERRUPTED: Final = 130
EXIT_CLOSED_PIPE: Final = 141  # 128 + SIGPIPE, as a shell reports a tool a closed pipe ended
# bench fails (exit 1) when more than this share of its measured rounds failed: a worker that
# drops one round in a hundred is degraded, not healthy.
BENCH_MAX_FAILED_SHARE: Final = 0.01
# Seconds allowed to each warm-up round of bench: the first round carries every slot's whole
# window (up to max_rows_per_step rows: 105 MB at 4096 rows of 25,600 bytes) and the worker's
# first batches of a new shape are slow, so the per-request --timeout would fail it.
DEFAULT_WARMUP_TIMEOUT_S: Final = 60.0
# How long the demo waits for a worker at the default endpoint before starting its own.
DEMO_PROBE_TIMEOUT_S: Final = 0.5


class CliError(Exception):
    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def _worker_error(message: str) -> CliError:
    return CliError(message, EXIT_WORKER)


def _conn_error(message: str) -> CliError:
    return CliError(message, EXIT_CONNECTION)


def normalise_endpoint(text: str) -> str:
    """``HOST:PORT`` -> ``tcp://HOST:PORT``; ``/PATH`` -> ``unix:///PATH``; else as given."""
    text = text.strip()
    if "://" in text:
        return text
    if text.startswith("/"):
        return f"unix://{text}"
    return f"tcp://{text}"


# -- Ctrl-C ----------------------------------------------------------------------------------
class Interrupt:
    """The first SIGINT only sets a flag: the command finishes the request in flight (within
    its timeout), releases its session and exits 130. A second SIGINT raises
    KeyboardInterrupt at once."""

    def __init__(self) -> None:
        self.requested = False
        # What the first Ctrl-C lets happen before the exit; a command without a session
        # (ping) says so.
        self.then = "releasing the session"

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        old = signal.signal(signal.SIGINT, self._on_sigint)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, old)

    def _on_sigint(self, signum: int, frame: Any) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        print(f"\ndspark-client: interrupted; {self.then} (Ctrl-C again to quit now)",
              file=sys.stderr, flush=True)

    def check(self) -> None:
        if self.requested:
            raise CliError("", EXIT_INTERRUPTED)


# -- plumbing ------------------------------------------------------------------------------------
class Ctx:
    def __init__(self, args: argparse.Namespace) -> None:
        env = os.environ.get("DSPARK_ENDPOINT")
        if args.endpoint:
            self.endpoint, self.endpoint_source = normalise_endpoint(args.endpoint), "--endpoint"
        elif env:
            self.endpoint, self.endpoint_source = normalise_endpoint(env), "DSPARK_ENDPOINT"
        else:
            self.endpoint, self.endpoint_source = DEFAULT_ENDPOINT, "default"
        given = args.endpoint if self.endpoint_source == "--endpoint" else env
        try:
            check_endpoint(self.endpoint)
        except EndpointError as exc:
            raise CliError(f"{self.endpoint_source} {given!r}: {exc}", EXIT_USAGE) from None
        # A dns+tcp:// name stands for every worker it resolves to: ping and stats go to each
        # of them, the other commands to the first.
        self.name: str | None = None
        self.workers = [self.endpoint]
        if is_dns_endpoint(self.endpoint):
            self.name = self.endpoint
            discovery = Discovery([self.endpoint])
            found = discovery.resolve()
            if not found:
                raise _conn_error(f"{self.endpoint} (from {self.endpoint_source}) names no"
                                  f" worker: {discovery.last_error}")
            self.workers, self.endpoint = found, found[0]
        self.timeout: float = args.timeout
        self.secret: bytes | None = (load_auth_secret(args.auth_secret_file)
                                     if args.auth_secret_file else None)
        self.interrupt = Interrupt()
        self._seq = 0

    def config(self, timeout: float | None = None) -> RemoteConfig:
        ms = (timeout or self.timeout) * 1000.0
        return RemoteConfig(endpoint=self.endpoint, connect_timeout_ms=ms, timeout_ms=ms,
                            auth_secret=self.secret)

    def connect(self, timeout: float | None = None) -> SocketClient:
        conn = make_client(self.endpoint)
        try:
            conn.connect(timeout or self.timeout)
        except TransportError as exc:
            raise _conn_error(f"{exc}{self.connect_hint(exc)}") from None
        return conn

    def connect_hint(self, exc: BaseException) -> str:
        """What a failed connect most likely means, for the one error line."""
        text = str(exc).lower()
        if "refused" in text or "no such file" in text:
            return (f"; is dspark-worker running and listening at {self.endpoint}"
                    f" (endpoint from {self.endpoint_source})? A worker still loading its"
                    " drafter refuses connections until it is ready: its metrics port's"
                    " /healthz then answers 503 'loading: ...'")
        return ""

    def speaks_http(self) -> bool:
        """Whether a TCP endpoint answers an HTTP request: then it is the worker's metrics
        port (--metrics-listen), not the one it serves frames on (--listen)."""
        ep = parse_endpoint(self.endpoint)
        if ep.kind != "tcp":
            return False
        wait = min(self.timeout, 1.0)
        try:
            with socket.create_connection((ep.host, ep.port), timeout=wait) as sock:
                sock.sendall(b"GET /healthz HTTP/1.0\r\n\r\n")
                return sock.recv(5) == b"HTTP/"
        except OSError:
            return False

    def request(self, conn: SocketClient, op: int, body: bytes = b"", session: int = 0,
                buf: bytearray | None = None,
                timeout: float | None = None) -> tuple[wire.AppHeader, bytes]:
        self._seq += 1
        seq = self._seq
        buf = buf if buf is not None else bytearray(1 << 16)
        try:
            n = conn.request(wire.frame(op, seq, session, body), buf, timeout or self.timeout)
        except TransportTimeout as exc:
            hint = (f"; {self.endpoint} answers HTTP: it is a metrics port (--metrics-listen),"
                    " give the worker's --listen address" if self.speaks_http() else "")
            raise _conn_error(f"{exc}{hint}") from None
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


def worker_stats(ctx: Ctx, timeout: float | None = None) -> dict[str, Any]:
    """The worker's STATS JSON object (section 10)."""
    with ctx.connect(timeout) as conn:
        h, body = ctx.request(conn, wire.OP_STATS, timeout=timeout)
    if h.status != wire.ST_OK:
        raise _worker_error(f"STATS refused: {_status_name(h.status)}")
    try:
        out = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise _worker_error(f"STATS reply is not JSON: {exc}") from None
    if not isinstance(out, dict):
        raise _worker_error(f"STATS reply is JSON {type(out).__name__}, not an object")
    return out


def hello_from_stats(stats: dict[str, Any], *, sampled: bool, max_slots: int | None,
                     client_name: str, synthetic: bool = False) -> wire.Hello:
    """A Hello this worker accepts, from its STATS: geometry, identities and limits. No HELLO
    is sent to learn them, so nothing is refused. ``synthetic``: the session's rows are made
    up (``HF_SYNTHETIC``: the worker keeps it out of its acceptance figures)."""
    try:
        geo, limits = stats["geometry"], stats["limits"]
        n_taps, hidden = int(geo["n_taps"]), int(geo["hidden"])
        row_bytes, capabilities = int(geo["row_bytes"]), int(geo["capabilities"])
        worker_slots, rows = int(limits["max_slots"]), int(limits["max_rows_per_step"])
        hello = wire.Hello(
            sample_mode=wire.SAMPLE_TOP32 if sampled else wire.SAMPLE_GREEDY,
            window=int(geo["window"]), num_spec=int(geo["num_spec"]),
            max_slots=worker_slots if max_slots is None else min(max_slots, worker_slots),
            max_rows_per_step=rows, row_bytes=row_bytes, vocab_size=int(geo["vocab_size"]),
            n_taps=n_taps, hidden=hidden,
            drafter_identity=bytes.fromhex(stats["drafter_identity"]),
            markov_identity=bytes.fromhex(stats["markov_identity"]), client_name=client_name,
            flags=wire.HF_SYNTHETIC if synthetic else 0)
    except (KeyError, TypeError, ValueError, msgspec.ValidationError) as exc:
        raise _worker_error(f"the worker's STATS lacks its geometry or identities ({exc!r}):"
                            " a worker older than this client?") from None
    if sampled and not capabilities & wire.CAP_TOP32:
        raise _worker_error("the worker does not serve sampled (top32) sessions")
    if n_taps * hidden * 2 != row_bytes:
        raise _worker_error(f"the worker's STATS names n_taps {n_taps} and hidden {hidden},"
                            f" which do not make its row_bytes {row_bytes}")
    return hello


def _holder(s: dict[str, Any]) -> str:
    """A session as STATS shows it to a stranger: its label (client names and ids go only to
    the session's own connection)."""
    if s.get("client_name"):
        return str(s["client_name"])
    name = f"session {s['label']}" if s.get("label") else "(unnamed)"
    return f"{name} of engine {s['engine']}" if s.get("engine") else name


def busy_reason(stats: dict[str, Any], wanted_slots: int) -> str | None:
    """Why a HELLO for ``wanted_slots`` would get ST_BUSY now, from STATS (None: it fits):
    which limit, how many sessions and slots are held, and by whom."""
    limits = stats.get("limits") or {}
    sessions = [s for s in stats.get("sessions") or [] if isinstance(s, dict)]
    max_sessions = limits.get("max_sessions")
    total = limits.get("max_total_slots")
    reserved = sum(int(s.get("max_slots", 0)) for s in sessions)
    if isinstance(max_sessions, int) and len(sessions) >= max_sessions:
        which = (f"it holds {len(sessions)} sessions and its limit (max_sessions) is"
                 f" {max_sessions}")
    elif isinstance(total, int) and reserved + wanted_slots > total:
        which = (f"{wanted_slots} slots asked, {max(total - reserved, 0)} of its"
                 f" max_total_slots {total} free")
    else:
        return None
    busiest = sorted(sessions, key=lambda s: -int(s.get("max_slots", 0)))
    shown = []
    for s in busiest[:4]:
        idle = s.get("idle_s")
        shown.append(f"{_holder(s)} {s.get('max_slots')} slots"
                     f" ({s.get('slots_in_use', '?')} in use"
                     + (f", idle {idle:.0f} s" if isinstance(idle, int | float) else "")
                     + ("" if s.get("connected", True) else ", disconnected") + ")")
    more = f" and {len(busiest) - 4} more" if len(busiest) > 4 else ""
    idle_s = limits.get("session_idle_s")
    hint = (f"; an idle session is released after session_idle_s {idle_s:g} s"
            if isinstance(idle_s, int | float) else "")
    return (f"worker busy: {which}; {len(sessions)} sessions hold {reserved} slots: "
            f"{', '.join(shown) or 'none listed'}{more}{hint}")


def discover(ctx: Ctx, *, sampled: bool, max_slots: int | None = None,
             client_name: str = "dspark-client", synthetic: bool = False) -> wire.Hello:
    """A Hello the worker accepts and has room for, learnt from STATS (no refused HELLO)."""
    stats = worker_stats(ctx)
    hello = hello_from_stats(stats, sampled=sampled, max_slots=max_slots,
                             client_name=client_name, synthetic=synthetic)
    why = busy_reason(stats, hello.max_slots)
    if why is not None:
        raise _worker_error(why)
    return hello


def open_client(ctx: Ctx, hello: wire.Hello, timeout: float | None = None
                ) -> RemoteDraftClient:
    """A connected client (one HELLO, no background thread); its close() says GOODBYE."""
    client = RemoteDraftClient(ctx.config(timeout), hello, background=False)
    if client.connect_now():
        return client
    client.close()
    if client.disabled_reason:
        hint = (" (pass --auth-secret-file)" if "AUTH" in client.disabled_reason
                and ctx.secret is None else "")
        raise _worker_error(client.disabled_reason + hint)
    if client.last_refusal == wire.ST_BUSY:
        why = None
        with contextlib.suppress(CliError):
            why = busy_reason(worker_stats(ctx), hello.max_slots)
        raise _worker_error(why or "HELLO refused: BUSY (the worker had no room at that"
                            " moment)")
    if client.last_refusal is not None:
        raise _worker_error(f"HELLO refused: {_status_name(client.last_refusal)}")
    raise _conn_error(client.last_error or "connect failed")


# -- commands ------------------------------------------------------------------------------------
def each_worker(ctx: Ctx, command: Any, args: argparse.Namespace, out: TextIO) -> int:
    """``command`` at every worker a dns+tcp:// endpoint names, one after the other; a worker
    that fails is reported on stderr and the others still run (the first failure's code)."""
    code = EXIT_OK
    for endpoint in ctx.workers:
        ctx.endpoint = endpoint
        try:
            got = command(ctx, args, out)
        except CliError as exc:
            if len(ctx.workers) == 1:
                raise
            print(f"dspark-client: {endpoint}: {exc}", file=sys.stderr)
            got = exc.code
        code = code or got
        if ctx.interrupt.requested:
            break
    return code


def cmd_ping(ctx: Ctx, args: argparse.Namespace, out: TextIO) -> int:
    return each_worker(ctx, _ping, args, out)


def _ping(ctx: Ctx, args: argparse.Namespace, out: TextIO) -> int:
    rtts: list[float] = []
    ctx.interrupt.then = "stopping after this PING"  # ping holds no session
    code = EXIT_OK
    with ctx.connect() as conn:
        for i in range(args.count):
            if ctx.interrupt.requested:
                code = EXIT_INTERRUPTED
                break
            if i:
                time.sleep(args.interval)
                if ctx.interrupt.requested:
                    code = EXIT_INTERRUPTED
                    break
            t0 = time.perf_counter()
            h, _body = ctx.request(conn, wire.OP_PING)
            rtt_ms = (time.perf_counter() - t0) * 1e3
            if h.status != wire.ST_OK:
                raise _worker_error(f"PING refused: {_status_name(h.status)}")
            rtts.append(rtt_ms)
            print(f"pong from {ctx.endpoint}: {rtt_ms:.3f} ms", file=out, flush=True)
    if len(rtts) > 1 or (rtts and code != EXIT_OK):
        a = np.asarray(rtts)
        print(f"--- {ctx.endpoint}: {len(rtts)} pings, rtt min/avg/max/mdev ="
              f" {a.min():.3f}/{a.mean():.3f}/{a.max():.3f}/{a.std():.3f} ms", file=out)
    return code


def _bytes(n: Any) -> str:
    if not isinstance(n, int | float):
        return "-"
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def _duration(s: Any) -> str:
    if not isinstance(s, int | float):
        return "-"
    s = int(s)
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


def stats_summary(st: dict[str, Any], endpoint: str) -> str:
    """A few lines for a human: who, what it serves, who holds it, how it is doing."""
    geo, limits = st.get("geometry") or {}, st.get("limits") or {}
    sessions = [s for s in st.get("sessions") or [] if isinstance(s, dict)]
    totals, mem = st.get("totals") or {}, st.get("memory") or {}
    state = ("draining" if st.get("draining") else "ready" if st.get("ready") else "not ready")
    caps = int(geo.get("capabilities") or 0)
    modes = "greedy" + (", top32" if caps & wire.CAP_TOP32 else "")
    lines = [
        f"worker {st.get('worker_name', '?')} at {endpoint}: {state}, up"
        f" {_duration(st.get('uptime_s'))}, version {st.get('version', '?')}, contract"
        f" {st.get('contract_version', '?')}",
        f"  serves W {geo.get('window', '?')}, N {geo.get('num_spec', '?')}, row_bytes"
        f" {geo.get('row_bytes', '?')} ({geo.get('n_taps', '?')} taps x"
        f" {geo.get('hidden', '?')}), vocab {geo.get('vocab_size', '?')}, {modes};"
        f" {st.get('device', '?')} {st.get('dtype', '?')}",
        f"  drafter {st.get('drafter_name', '?')}: {str(st.get('drafter_identity', '?'))[:16]}.."
        + ("  no Markov head" if st.get("markov_identity") == NO_MARKOV_HEAD.hex()
           else f"  markov {str(st.get('markov_identity', '?'))[:16]}..")
        + ("; no confidence head (confidences predict nothing)"
           if st.get("confidence_head") is False or caps & wire.CAP_NO_CONFIDENCE else ""),
    ]
    lines.extend(_version_lines(st))
    reserved = sum(int(s.get("max_slots", 0)) for s in sessions)
    lines.append(f"  sessions {len(sessions)}/{limits.get('max_sessions', '?')}, slots reserved"
                 f" {reserved}/{limits.get('max_total_slots', '?')}, connections"
                 f" {st.get('connections', '?')}")
    for s in sorted(sessions, key=lambda s: -int(s.get("max_slots", 0)))[:8]:
        idle = s.get("idle_s")
        mean = (s.get("acceptance") or {}).get("mean_accepted_length")
        lines.append(f"    {_holder(s):<44} {s.get('max_slots')} slots"
                     f" ({s.get('slots_in_use', '?')} in use), {s.get('sample_mode', '?')},"
                     f" idle {_duration(idle)}"
                     + (f", accepted length {mean:.2f}" if isinstance(mean, int | float) else "")
                     + (f", version {s['version']}" if len(st.get("versions") or []) > 1
                        and s.get("version") is not None else "")
                     + (", synthetic (not in acceptance)" if s.get("synthetic") else "")
                     + ("" if s.get("connected", True) else ", disconnected"))
    if len(sessions) > 8:
        lines.append(f"    ... and {len(sessions) - 8} more (--json lists them)")
    refusals = totals.get("refusals") or {}
    ref = ", ".join(f"{k} {v}" for k, v in sorted(refusals.items())) or "none"
    lines.append(f"  totals: {totals.get('steps', 0)} steps, {totals.get('rows', 0)} rows,"
                 f" {totals.get('drafted_positions', 0)} drafted positions; refusals: {ref}")
    lines.extend(_acceptance_lines(totals.get("acceptance"),
                                   sum(1 for s in sessions if s.get("synthetic"))))
    step = (st.get("latency_us") or {}).get("step") or {}
    if step.get("count"):
        lines.append(f"  step latency p50 {step.get('p50_us', 0) / 1e3:.2f} ms, p99"
                     f" {step.get('p99_us', 0) / 1e3:.2f} ms over the last {step['count']}")
    if mem:
        lines.append(f"  memory: rss {_bytes(mem.get('rss_bytes'))}, windows"
                     f" {_bytes(mem.get('window_used_bytes'))} used of"
                     f" {_bytes(mem.get('window_bytes'))}, receive buffers"
                     f" {_bytes(mem.get('receive_buffers_bytes'))}"
                     + (f", device {_bytes(mem['device_allocated_bytes'])}"
                        if mem.get("device_allocated_bytes") is not None else ""))
    return "\n".join(lines)


def _row(values: Any) -> str:
    """Figures by block position, 2 decimals, "-" where nothing was drafted."""
    return " ".join("-" if v is None else f"{v:.2f}" for v in values or [])


def _accepted_length(acc: Any) -> str:
    mean = acc.get("mean_accepted_length") if isinstance(acc, dict) else None
    return f"accepted length {mean:.2f}" if isinstance(mean, int | float) else "nothing judged"


def _version_lines(st: dict[str, Any]) -> list[str]:
    """The drafter versions by name, the canary beside what serves, the last reload."""
    lines = []
    versions = [v for v in st.get("versions") or [] if isinstance(v, dict)]
    if len(versions) > 1 or any(v.get("role") != "newest" for v in versions):
        lines.append("  versions: " + "; ".join(
            f"{v.get('version')} {v.get('name')} {v.get('role')}"
            + (f", {v.get('sessions', 0)} sessions" if v.get("role") != "unloaded" else "")
            + f", {_accepted_length(v.get('acceptance'))}" for v in versions))
    canary = st.get("canary")
    if isinstance(canary, dict):
        acc, base = canary.get("acceptance") or {}, canary.get("serving_acceptance") or {}
        lines.append(f"  canary {canary.get('version')} {canary.get('name')} on"
                     f" {float(canary.get('fraction') or 0):.0%} of the slots:"
                     f" {acc.get('rounds', 0)} judged blocks, {_accepted_length(acc)} against"
                     f" {_accepted_length(base).removeprefix('accepted length ')} for the"
                     " serving versions on the same blocks"
                     + (f"; {canary['shed_entries']} entries shed under load"
                        if canary.get("shed_entries") else ""))
        lines.append(f"    by position canary {_row(acc.get('acceptance_by_position'))};"
                     f" serving {_row(base.get('acceptance_by_position'))}")
    last = (st.get("reloads") or {}).get("last")
    if isinstance(last, dict):
        lines.append(f"  last reload ({last.get('what')}): {last.get('result')}:"
                     f" {last.get('why')}")
    return lines


def _acceptance_lines(acc: Any, synthetic: int = 0) -> list[str]:
    """The worker's acceptance totals (STATS ``totals.acceptance``) in two lines, saying when
    synthetic sessions (benchmarks) are left out of them."""
    left_out = (f" ({synthetic} synthetic session{'s' * (synthetic != 1)} left out)"
                if synthetic else "")
    if not isinstance(acc, dict) or not acc.get("rounds"):
        return ([f"  acceptance: no judged draft blocks yet{left_out}"]
                if isinstance(acc, dict) else [])
    predicted = acc.get("predicted_acceptance_by_position")
    said = (f"predicted {_row(predicted)}" if predicted is not None else
            "nothing predicted (the drafter has no confidence head)")
    return [f"  acceptance: {acc['rounds']} judged blocks, mean accepted length"
            f" {acc.get('mean_accepted_length', 0):.2f} (bonus token incl.){left_out}",
            f"    by position {_row(acc.get('acceptance_by_position'))}; {said}"]


def cmd_stats(ctx: Ctx, args: argparse.Namespace, out: TextIO) -> int:
    if args.json and ctx.name is not None:  # one object: every worker's STATS by endpoint
        every: dict[str, Any] = {}
        for endpoint in ctx.workers:
            ctx.endpoint = endpoint
            try:
                every[endpoint] = worker_stats(ctx)
            except CliError as exc:
                every[endpoint] = {"error": str(exc)}
        print(json.dumps(every, indent=2, sort_keys=True), file=out)
        return EXIT_OK if all("error" not in v for v in every.values()) else EXIT_CONNECTION
    return each_worker(ctx, _stats, args, out)


def _stats(ctx: Ctx, args: argparse.Namespace, out: TextIO) -> int:
    st = worker_stats(ctx)
    if args.json:
        print(json.dumps(st, indent=2, sort_keys=True), file=out)
    else:
        print(stats_summary(st, ctx.endpoint), file=out)
    return EXIT_OK


def cmd_reload(ctx: Ctx, args: argparse.Namespace, out: TextIO) -> int:
    """RELOAD (contract section 10), then STATS until the reload it started is done."""
    if ctx.secret is None:
        raise CliError("reload needs --auth-secret-file: RELOAD is signed with the worker's"
                       " HELLO secret (without one, send the worker SIGHUP)", EXIT_USAGE)
    with ctx.connect() as conn:
        h, body = ctx.request(conn, wire.OP_RELOAD,
                              reload_body(ctx.secret, int(time.time() * 1000)))
    if h.status != wire.ST_OK:
        raise _worker_error(f"RELOAD refused: {_status_name(h.status)}")
    number = int(json.loads(body)["reload"])
    print(f"reload {number} asked of {ctx.endpoint}", file=out, flush=True)
    if args.no_wait:
        return EXIT_OK
    deadline = time.monotonic() + args.wait
    while True:
        ctx.interrupt.check()
        reloads = worker_stats(ctx).get("reloads") or {}
        done = [o for o in reloads.get("recent") or [] if int(o.get("number", 0)) >= number]
        if done and not reloads.get("running"):
            break
        if time.monotonic() > deadline:
            raise _worker_error(f"reload {number} still running after {args.wait:g} s (see"
                                " dspark-client stats)")
        time.sleep(0.2)
    last = max(int(o["number"]) for o in done)
    failed = False
    for o in done:
        if int(o["number"]) == last:
            print(f"  {o['what']}: {o['result']} in {o.get('seconds', 0):.2f} s: {o['why']}",
                  file=out)
            failed |= o["result"] == "failed"
    return EXIT_WORKER if failed else EXIT_OK


def cmd_reset(ctx: Ctx, args: argparse.Namespace, out: TextIO) -> int:
    hello = discover(ctx, sampled=False, max_slots=max([*args.slots, 0]) + 1,
                     client_name=f"dspark-reset-{os.getpid()}")
    for s in args.slots:
        if s >= hello.max_slots:
            raise CliError(f"slot {s} is not below the worker's max_slots {hello.max_slots}",
                           EXIT_USAGE)
    client = open_client(ctx, hello)
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
    print(f"reset {what} of session {client.session:#010x}: OK (a session of this command's"
          " own: RESET acts only on the sender's session, so no engine's windows changed)",
          file=out)
    return EXIT_OK


class Progress:
    """A one-line progress bar on stderr, redrawn at most 10 times a second; only on a
    terminal (a log file or a pipe gets no carriage-return frames)."""

    def __init__(self, stream: TextIO, enabled: bool) -> None:
        self.stream = stream
        self.enabled = enabled and _isatty(stream)
        self._last = 0.0
        self._open = False  # a bar is drawn and its line not ended

    def update(self, label: str, done: int, total: int, note: str = "") -> None:
        if not self.enabled or total <= 0:
            return
        now = time.monotonic()
        if done < total and now - self._last < 0.1:
            return
        self._last = now
        width = 30
        fill = int(width * done / total)
        self.stream.write(f"\r{label:<8} [{'#' * fill}{'.' * (width - fill)}] {done}/{total}"
                          f" {note}\x1b[K")
        self._open = done < total
        if not self._open:
            self.stream.write("\n")
        self.stream.flush()

    def finish(self) -> None:
        """End a bar left part drawn (an interrupted run), so what follows starts a line."""
        if self._open:
            self.stream.write("\n")
            self.stream.flush()
            self._open = False


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _percentiles_ms(values_us: Sequence[float]) -> dict[str, float]:
    if not values_us:
        return {}
    a = np.asarray(values_us, dtype=np.float64) / 1e3
    qs = np.percentile(a, [50, 90, 99])
    return {"p50": float(qs[0]), "p90": float(qs[1]), "p99": float(qs[2]),
            "max": float(a.max()), "mean": float(a.mean())}


def cmd_bench(ctx: Ctx, args: argparse.Namespace, out: TextIO) -> int:
    # Its rows and tokens are made up: the worker keeps its drafts out of acceptance figures.
    hello = discover(ctx, sampled=args.sampled, max_slots=args.batch,
                     client_name=f"dspark-bench-{os.getpid()}", synthetic=True)
    if hello.max_slots < args.batch:
        raise CliError(f"--batch {args.batch} is over the worker's max_slots"
                       f" {hello.max_slots}", EXIT_USAGE)
    warm_timeout = max(args.warmup_timeout, ctx.timeout)
    client = open_client(ctx, hello, timeout=warm_timeout)
    try:
        return _bench(ctx, args, out, client, hello, warm_timeout)
    finally:
        client.close()


def _bench(ctx: Ctx, args: argparse.Namespace, out: TextIO, client: RemoteDraftClient,
           hello: wire.Hello, warm_timeout: float) -> int:
    rounds = DraftRounds(client)
    rng = np.random.default_rng(args.seed)
    W, N, rb = hello.window, hello.num_spec, hello.row_bytes
    B = args.batch
    accept = min(args.accept if args.accept is not None else max(N // 2, 0), N)
    top_k = wire.MAX_TOP_K if args.sampled else 0
    # Synthetic rows: a pool of random bf16 bit patterns (finite values, as taps would be).
    pool = _synthetic_rows(rng, max(W, accept + 1) * 2, rb)
    prompt = max(W, 1)
    anchor = [prompt] * B
    rtts: list[float] = []
    rounds_us: list[float] = []
    failures: Counter[str] = Counter()
    drafted = rows = 0
    progress = Progress(sys.stderr, enabled=not args.no_progress)
    t_start = time.perf_counter()
    total = args.warmup + args.steps
    ctx.interrupt.then = "printing the rounds measured so far and releasing the session"
    for step in range(total):
        if ctx.interrupt.requested:
            break
        if step == args.warmup:  # measured rounds get the per-request deadline
            client.cfg = msgspec.structs.replace(client.cfg, timeout_ms=ctx.timeout * 1e3)
        reqs = []
        for s in range(B):
            n_new = anchor[s] if step == 0 else accept + 1
            if step > 0:
                anchor[s] += n_new
            at = (anchor[s] * 7 + s) % (pool.shape[0] - n_new)
            reqs.append(SlotRequest(
                slot=s, generation=1, anchor_pos=anchor[s],
                anchor_token=int(rng.integers(hello.vocab_size)),
                rows=pool[at:at + n_new] if n_new <= pool.shape[0] else None, n_out=N,
                seed=s + 1 if args.sampled else 0, top_k=top_k,
                temperature=1.0 if args.sampled else 0.0))
        t0 = time.perf_counter()
        res = rounds.run(reqs)
        dt_us = (time.perf_counter() - t0) * 1e6
        if client.disabled:
            raise _worker_error(client.disabled_reason or "disabled")
        measured = step >= args.warmup
        if measured:
            rounds_us.append(dt_us)
            if res.ok:
                rtts.append(res.rtt_us)
                drafted += int(res.num_drafted.sum())
                rows += res.rows_sent
            else:
                failures[res.reason or "failed"] += 1
        elif step == 0 and not res.ok:
            raise _worker_error(f"first round failed: {res.reason}"
                                f" ({client.last_error or 'no reply'}; it had"
                                f" {warm_timeout:g} s, see --warmup-timeout)")
        if measured:
            progress.update("measured", step + 1 - args.warmup, args.steps,
                            f"rtt {res.rtt_us / 1e3:.2f} ms")
        else:
            progress.update("warm-up", step + 1, args.warmup)
        # A failed round that dropped the connection (timeout, transport error, bad reply):
        # connect again under the same session, or stop here.
        if not res.ok and not client.ready and not client.connect_now():
            raise _conn_error(f"connection to {ctx.endpoint} lost after round {step + 1}:"
                              f" {client.last_error}")
    progress.finish()
    elapsed = time.perf_counter() - t_start
    measured_s = sum(rounds_us) / 1e6
    failed = sum(failures.values())
    steps = len(rounds_us)  # args.steps unless interrupted
    interrupted = ctx.interrupt.requested
    result = {
        "endpoint": ctx.endpoint, "batch": B, "steps": steps, "warmup": args.warmup,
        "interrupted": interrupted,
        "num_spec": N, "window": W, "row_bytes": rb, "sampled": bool(args.sampled),
        "top_k": top_k, "accepted_rows_per_slot": accept + 1, "failed_rounds": failed,
        "failed_reasons": dict(failures),
        "rtt_ms": _percentiles_ms(rtts), "round_ms": _percentiles_ms(rounds_us),
        "rounds_per_s": steps / measured_s if measured_s else None,
        "rows_per_s": rows / measured_s if measured_s else None,
        "drafted_positions_per_s": drafted / measured_s if measured_s else None,
        "elapsed_s": elapsed,
    }
    if args.json:
        print(json.dumps(result, indent=2), file=out)
    elif interrupted and not steps:
        print(f"{ctx.endpoint}: interrupted during the warm-up, before any measured round",
              file=out)
    else:
        r, t = result["rtt_ms"], result["round_ms"]
        print(f"{ctx.endpoint}: batch {B}, N {N}, W {W}, row_bytes {rb},"
              f" {'sampled top_k ' + str(top_k) if args.sampled else 'greedy'},"
              f" {steps} measured rounds after {args.warmup} warm-up ({failed} failed)"
              + (f", interrupted after {steps} of {args.steps}" if interrupted else ""),
              file=out)
        for name, d, what in (("rtt", r, "STEP sent to reply received"),
                              ("round", t, "DraftRounds.run: rtt plus packing and checks")):
            if d:
                print(f"  {name:<6} p50 {d['p50']:8.3f} ms  p90 {d['p90']:8.3f} ms"
                      f"  p99 {d['p99']:8.3f} ms  max {d['max']:8.3f} ms  ({what})", file=out)
        print(f"  {result['rounds_per_s']:.1f} rounds/s, {result['rows_per_s']:.0f} rows/s,"
              f" {result['drafted_positions_per_s']:.0f} drafted positions/s", file=out)
    if interrupted:
        return EXIT_INTERRUPTED
    if steps and failed / steps > BENCH_MAX_FAILED_SHARE:
        reasons = ", ".join(f"{k} {v}" for k, v in failures.most_common())
        raise _worker_error(f"{failed} of {steps} measured rounds failed"
                            f" ({100 * failed / steps:.1f}%, over the"
                            f" {BENCH_MAX_FAILED_SHARE:.0%} allowed): {reasons}")
    return EXIT_OK


def _synthetic_rows(rng: np.random.Generator, n: int, row_bytes: int) -> np.ndarray:
    """Rows of bf16 values in [-2, 2): what tap rows look like on the wire."""
    vals = rng.uniform(-2.0, 2.0, size=(n, row_bytes // 2)).astype(np.float32)
    bf16 = (vals.view(np.uint32) >> 16).astype(np.uint16)
    out = np.zeros((n, row_bytes), np.uint8)
    out[:, :bf16.shape[1] * 2] = bf16.view(np.uint8).reshape(n, -1)
    return out


def _answers(ctx: Ctx, endpoint: str, timeout: float) -> bool:
    """Whether a worker answers PING at ``endpoint`` within ``timeout``."""
    try:
        conn = make_client(endpoint)
        with conn:
            conn.connect(timeout)
            buf = bytearray(64)
            n = conn.request(wire.frame(wire.OP_PING, 1, 0), buf, timeout)
            h, _ = wire.split_frame(memoryview(buf)[:n])
            return h.op == wire.OP_PING and h.status == wire.ST_OK
    except (TransportError, wire.WireError, OSError):
        return False


def cmd_demo(ctx: Ctx, args: argparse.Namespace, out: TextIO) -> int:
    try:
        from .demo.run import DEFAULT_PROMPT, run_demo
    except ImportError as exc:  # torch is optional for the client
        raise CliError(f"the demo needs torch: {exc}", EXIT_USAGE) from None
    if args.prompt is None:
        args.prompt = DEFAULT_PROMPT
    if args.temperature < 0:
        raise CliError(f"--temperature {args.temperature} is negative", EXIT_USAGE)
    if ctx.endpoint_source != "default":
        endpoint: str | None = ctx.endpoint
        note = f"using the worker at {ctx.endpoint} ({ctx.endpoint_source})"
    elif args.shm:  # shared memory needs a Unix socket of a worker on this host: our own
        endpoint = None
        note = "starting a worker on loopback, rows through shared memory (--shm)"
    elif _answers(ctx, DEFAULT_ENDPOINT, DEMO_PROBE_TIMEOUT_S):
        endpoint = DEFAULT_ENDPOINT
        note = f"using the worker running at the default endpoint {DEFAULT_ENDPOINT}"
    else:
        endpoint = None
        note = (f"no worker answers at {DEFAULT_ENDPOINT} (nor --endpoint, DSPARK_ENDPOINT):"
                " starting one on loopback")

    def hello_for(endpoint: str, sampled: bool, max_slots: int) -> wire.Hello:
        ctx.endpoint = endpoint
        hello = discover(ctx, sampled=sampled, max_slots=max_slots,
                         client_name=f"dspark-demo-{os.getpid()}")
        if hello.max_slots < max_slots:
            raise CliError(f"--batch {max_slots} is over the max_slots {hello.max_slots} of the"
                           f" worker at {endpoint}", EXIT_USAGE)
        return hello

    return run_demo(hello_for, args, out, endpoint=endpoint, note=note,
                    own_worker_if_mismatch=ctx.endpoint_source == "default",
                    interrupt=ctx.interrupt.check)


COMMANDS = {"ping": cmd_ping, "stats": cmd_stats, "reset": cmd_reset, "reload": cmd_reload,
            "bench": cmd_bench, "demo": cmd_demo}


# -- entry ---------------------------------------------------------------------------------------
def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r} must be a number > 0")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"{text!r} must be a number >= 0")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be > 0")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 0")
    return value


def _slot(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"slot {text!r} is not an integer") from None
    if not 0 <= value <= 0xFFFFFFFF:
        raise argparse.ArgumentTypeError(f"slot {value} outside [0, 2**32)")
    return value


def _add_global(p: argparse.ArgumentParser, *, sub: bool) -> None:
    """The global options; on a subcommand they default to SUPPRESS, so that given after the
    command they override, and not given they leave the values before the command alone."""

    def d(value: Any) -> Any:
        return argparse.SUPPRESS if sub else value

    p.add_argument("--endpoint", default=d(None),
                   help="tcp://HOST:PORT, unix:///PATH, unix+shm:///PATH (rows through shared"
                        " memory on the same host), dns+tcp://NAME:PORT (every worker the name"
                        " resolves to: ping and stats ask each, the other commands the"
                        " first), or HOST:PORT (TCP) (default: $DSPARK_ENDPOINT, else"
                        f" {DEFAULT_ENDPOINT})")
    p.add_argument("--timeout", type=_positive_float, default=d(2.0), metavar="SECONDS",
                   help="deadline of a connect and of each request (default: 2)")
    p.add_argument("--auth-secret-file", default=d(None), metavar="PATH",
                   help="file holding the shared secret that signs HELLOs, section 11"
                        " (default: none)")
    p.add_argument("-v", "--verbose", action="store_true", default=d(False),
                   help="log the client's connection events on stderr (default: off)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dspark-client", description="Talk to a DSpark draft worker.",
        epilog="Exit status: 0 ok; 1 the worker answered an error (or bench: more than"
               f" {BENCH_MAX_FAILED_SHARE:.0%} of measured rounds failed); 2 usage error;"
               f" 3 connection error; {EXIT_INTERRUPTED} interrupted; {EXIT_CLOSED_PIPE} the"
               " output pipe closed. Global options may also follow the command.")
    _add_global(p, sub=False)
    p.add_argument("--version", action="version", version=f"dspark-client {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, text: str) -> argparse.ArgumentParser:
        # argparse %-formats help strings (not descriptions): a literal % must be doubled.
        c = sub.add_parser(name, help=text.replace("%", "%%"), description=text)
        _add_global(c, sub=True)
        c.set_defaults(command_parser=c)
        return c

    ping = command("ping", "PING the worker, print the round trip")
    ping.add_argument("-c", "--count", type=_positive_int, default=1,
                      help="PINGs to send; more than one ends with min/avg/max (default: 1)")
    ping.add_argument("-i", "--interval", type=_non_negative_float, default=0.2,
                      metavar="SECONDS", help="pause between PINGs (default: 0.2)")
    stats = command("stats", "print a summary of the worker's STATS")
    stats.add_argument("--json", action="store_true",
                       help="print the whole STATS JSON instead (default: the summary)")
    reload = command("reload", "ask the worker to read its drafter (and canary) folders again"
                               " (signed with --auth-secret-file); exits 1 when that failed")
    reload.add_argument("--no-wait", action="store_true",
                        help="return once the worker took the request (default: wait for"
                             " the outcome and print it)")
    reload.add_argument("--wait", type=_positive_float, default=600.0, metavar="SECONDS",
                        help="longest wait for the outcome (default: 600)")
    reset = command("reset", "check the worker's RESET: HELLO a session of our own, RESET"
                             " those slots (all when none), GOODBYE. RESET only ever acts on"
                             " the session that sends it, so no engine's windows are touched:"
                             " an engine resets its own slots (RF_RESET, or RESET on its"
                             " connection)")
    reset.add_argument("slots", nargs="*", type=_slot, metavar="SLOT",
                       help="slots to reset (default: every slot)")
    bench = command("bench", "drive the worker with synthetic rows; exits 1 when more than"
                             f" {BENCH_MAX_FAILED_SHARE:.0%} of the measured rounds fail")
    bench.add_argument("--batch", type=_positive_int, default=8,
                       help="slots per round (default: 8)")
    bench.add_argument("--steps", type=_positive_int, default=200,
                       help="measured rounds (default: 200)")
    bench.add_argument("--warmup", type=_non_negative_int, default=10,
                       help="unmeasured rounds first; the first fills every slot's window"
                            " (default: 10)")
    bench.add_argument("--warmup-timeout", type=_positive_float,
                       default=DEFAULT_WARMUP_TIMEOUT_S, metavar="SECONDS",
                       help="deadline of each warm-up round; measured rounds use --timeout"
                            f" (default: {DEFAULT_WARMUP_TIMEOUT_S:g})")
    bench.add_argument("--accept", type=_non_negative_int, default=None,
                       help="accepted drafts per slot per round (default: N/2)")
    bench.add_argument("--sampled", action="store_true",
                       help=f"a top32 sampled session, top_k {wire.MAX_TOP_K} as a sampled"
                            " engine sends (default: greedy)")
    bench.add_argument("--seed", type=int, default=0,
                       help="seed of the synthetic rows and tokens (default: 0)")
    bench.add_argument("--json", action="store_true",
                       help="print the result as JSON (default: text)")
    bench.add_argument("--no-progress", action="store_true",
                       help="no progress bar (default: a bar on stderr when it is a terminal)")
    demo = command("demo", "speculative decoding with the reference target and pair drafter"
                           " (torch)")
    demo.add_argument("--prompt", default=None, help="text to continue (default: Python code)")
    demo.add_argument("--max-new-tokens", type=_positive_int, default=200,
                      help="tokens to generate per sequence (default: 200)")
    demo.add_argument("--temperature", type=float, default=0.0,
                      help="0: greedy; > 0: sampled with exact rejection sampling (default: 0)")
    demo.add_argument("--batch", type=_positive_int, default=1,
                      help="sequences at once (default: 1)")
    demo.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    demo.add_argument("--shm", action="store_true",
                      help="the worker the demo starts serves a Unix socket and the rows go"
                           " through shared memory (unix+shm://); with --endpoint, give"
                           " unix+shm:///PATH instead (default: off)")
    demo.add_argument("--target", default=None,
                      help="a reference target folder (default: the one shipped)")
    return p


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    parser = build_parser()
    # Usage errors: argparse prints the usage and exits 2. An option no parser knows is
    # reported with the usage of the command it followed, not the top-level one.
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        args.command_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    out = out if out is not None else sys.stdout
    # The client logs connection events (for engines); here the one error line says it all.
    client_log = logging.getLogger("dspark_client")
    level = client_log.level
    if args.verbose:
        logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        client_log.setLevel(logging.INFO)
    else:
        client_log.setLevel(logging.CRITICAL)
    ctx: Ctx | None = None
    try:
        ctx = Ctx(args)
        if ctx.name is not None and len(ctx.workers) > 1 and args.command not in ("ping",
                                                                                  "stats"):
            print(f"dspark-client: {ctx.name} names {len(ctx.workers)} workers; {args.command}"
                  f" uses {ctx.endpoint} (ping and stats go to each)", file=sys.stderr)
        with ctx.interrupt.installed():
            return COMMANDS[args.command](ctx, args, out)
    except CliError as exc:
        if str(exc):
            print(f"dspark-client: {exc}", file=sys.stderr)
        return exc.code
    except RemoteConfigError as exc:
        print(f"dspark-client: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except TransportError as exc:
        print(f"dspark-client: {exc}", file=sys.stderr)
        return EXIT_CONNECTION
    except KeyboardInterrupt:
        print("dspark-client: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader went away (``| head``): stop quietly. Later writes to the closed pipe, at
        # interpreter exit too, go to /dev/null instead of raising again.
        with contextlib.suppress(OSError, ValueError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, (out if out is not None else sys.stdout).fileno())
        return EXIT_CLOSED_PIPE
    finally:
        client_log.setLevel(level)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
