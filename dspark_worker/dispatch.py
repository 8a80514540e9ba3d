"""Op -> handler, and the one place where an exception becomes a frame status (docs/contract.md
sections 3-7, 10, 11).

``Dispatcher.handle`` takes one whole frame from a connection and returns the reply frame, or
``None`` when the frame is a STEP handed to the runner (its reply comes through ``complete``).
Every refusal is raised as a ``protocol.errors.WireError`` subclass by whatever finds it, and
turned into its status in ``handle`` (or ``complete`` for ST_INTERNAL): nothing else in the
worker maps errors to statuses. A refused frame changes no state: handlers check everything
before they commit anything.

What each op does:

* HELLO (6.1, 6.2, 6.5): refusals in the order version, auth, identities (the drafter version
  they name, or with HF_FOLLOW the newest), geometry, limits, then the session table (seq of a
  reconnect, capacity: ST_BUSY). The reply always carries the HelloReply of the version that
  serves the session (of the newest on a refusal).
* STEP (7.2): session and seq, decode, shape, generations (host side, on arrival), then the
  runner applies rows and drafts.
* While draining (SIGTERM, section 5): HELLO and STEP get ST_DRAINING, nothing applied, and the
  connection closes after the reply; STEPs accepted before the drain began finish normally.
* PING (10): answered at once, with or without a session.
* STATS (10): the JSON below, with or without a session.
* RESET (10): the listed slots' windows (count 0: all) are dropped, in order with the STEPs.
* GOODBYE (6.2, 10): the session, bound to this connection, is dropped with all its slots.

STATS JSON (UTF-8 object; fields are only ever added, except that a session's id and client name
go only to its own connection)::

    {
      "worker_name": str, "version": str, "contract_version": 1,
      "uptime_s": float, "ready": bool, "draining": bool,
      "device": str, "dtype": str,
      "geometry": {"window": W, "num_spec": N, "row_bytes": int, "vocab_size": int,
                   "n_taps": int, "hidden": int, "capabilities": int},
      "drafter_identity": hex, "markov_identity": hex, "drafter_name": str,
      "confidence_head": bool (false: confidences predict nothing, CAP_NO_CONFIDENCE),
      "versions": [{"version": int, "name": str, "role": "newest" | "older" | "unloaded",
                    "source": str, "loaded_at": float, "sessions": int,
                    "drafter_identity": hex, "markov_identity": hex, "weights_bytes": int,
                    "acceptance": ACCEPTANCE}],
      "canary": null | {"version": int, "name": str, "source": str,
                        "drafter_identity": hex, "markov_identity": hex, "fraction": float,
                        "lanes": int, "lanes_used": int, "backlog_steps": int,
                        "shed_entries": int, "censored_blocks": int,
                        "device_room": {"gap_ms": float | null, "chunk_ms": float | null},
                        "acceptance": ACCEPTANCE, "serving_acceptance": ACCEPTANCE,
                        "per_session": {"sessions": int,
                                        "mean_accepted_drafts": float | null,
                                        "serving_mean_accepted_drafts": float | null}},
      "limits": {"max_slots", "max_rows_per_step", "max_sessions", "max_total_slots",
                 "max_sessions_per_peer", "max_slots_per_connection", "max_slots_per_peer",
                 "reservation_idle_s", "max_connections", "max_frame_bytes",
                 "max_shm_region_bytes", "max_shm_mapped_bytes", "session_idle_s",
                 "partial_frame_timeout_s", "handshake_timeout_s", "connection_idle_s",
                 "shed_queue_steps"},
      "threads": int, "connections": int, "queue_steps": int,
      "reloads": {"asked": int, "running": bool, "results": {"<what>:<result>": int},
                  "last": null | {"number": int, "what": "drafter" | "canary",
                                  "result": "ok" | "unchanged" | "failed", "why": str,
                                  "at": float, "version": int | null, "seconds": float},
                  "recent": [the last 8 outcomes, as "last"]},
      "sessions": [{"label": str, "engine": str | null, "session": int (own only),
                    "client_name": str (own only), "version": int,
                    "sample_mode": "greedy" | "top32", "synthetic": bool,
                    "max_slots": int, "slots_in_use": int, "connected": bool,
                    "age_s": float, "idle_s": float, "steps": int, "rows": int,
                    "drafted_positions": int, "acceptance": ACCEPTANCE}],
      "totals": {"frames", "steps", "rows", "drafted_positions", "received_bytes",
                 "sent_bytes", "batches": int,
                 "refusals": {"<OP>:<STATUS>": int},
                 "request_status": {"OK" | "PARTIAL_WINDOW" | ...: int},
                 "sessions_dropped": {"replaced" | "recreated" | "expired" | "goodbye" | ...: int},
                 "acceptance": ACCEPTANCE},
      "latency_us": {"decode" | "queue" | "apply" | "draft" | "encode" | "step" |
                     "to_device" | "from_device":
                     {"count": int, "p50_us", "p90_us", "p99_us", "max_us": float}},
      "memory": {"window_bytes": int, "window_used_bytes": int, "window_bytes_per_slot": int,
                 "receive_buffers_bytes": int, "rss_bytes": int,
                 "device_allocated_bytes": int | null}
    }

ACCEPTANCE is ``protocol.acceptance.AcceptanceTotals.summary()`` over the draft blocks the
next STEP judged (docs/operations.md, "Acceptance"; the totals leave out synthetic sessions,
``HF_SYNTHETIC``, whose own entries still show theirs): ``rounds``, ``accepted_drafts``,
``mean_accepted_drafts`` and ``mean_accepted_length`` (the bonus token included; null before
the first block), and N-long lists ``drafted_by_position``, ``accepted_by_position``,
``predicted_by_position``, ``acceptance_by_position`` and ``predicted_acceptance_by_position``
(null where nothing was drafted; the two predicted lists null for a drafter without a confidence
head), and ``confidence_head``.

``session`` and ``client_name`` appear only in the entry of the session bound to the connection
that asked (section 11); every entry has ``label``, a keyed hash of the id (12 hex digits).
Latency quantiles are over the last 2048 samples of each stage; ``step`` is the time from a
STEP's last byte to its reply (the ``worker_us`` of 7.4).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import msgspec
import numpy as np

from protocol.acceptance import AcceptanceTotals
from protocol.auth import RELOAD_MAX_SKEW_S, verify_hello, verify_reload
from protocol.constants import (
    APP_HEADER_SIZE,
    CAP_NO_CONFIDENCE,
    CAP_SHM_ROWS,
    FRAME_STATUS_NAMES,
    HF_FOLLOW,
    IDENTITY_BYTES,
    OP_GOODBYE,
    OP_HELLO,
    OP_PING,
    OP_RELOAD,
    OP_RESET,
    OP_SHM_ATTACH,
    OP_STATS,
    OP_STEP,
    REQ_STATUS_NAMES,
    RF_NEED_DRAFT,
    SAMPLE_GREEDY,
    SAMPLE_MODE_NAMES,
    SAMPLE_TOP32,
    SF_ROWS_SHM,
    ST_AUTH,
    ST_BUSY,
    ST_DRAINING,
    ST_INTERNAL,
    ST_LIMITS,
    ST_NO_SESSION,
    ST_OK,
    ST_VERSION,
    TAP_DTYPE_BYTES,
    TAPS_BF16,
    VERSION,
)
from protocol.errors import (
    AuthError,
    BadFrameError,
    BusyError,
    DrainingError,
    FrameTooLargeError,
    GeometryError,
    IdentityError,
    InternalError,
    LimitsError,
    NoSessionError,
    VersionError,
    WireError,
)
from protocol.framing import Frame, frame
from protocol.header import AppHeader
from protocol.messages import Hello, HelloReply, StepView, decode_step, reset_slots
from protocol.shm import decode_step_shm
from protocol.validate import check_step_shape

from .acceptance import WorkerAcceptance
from .config import LIVE_SESSION_S, max_step_body_bytes
from .metrics import Metrics
from .runner import LaneOp, NonFiniteOutput, Runner, StepItem, reply_bytes
from .sessions import (
    UNDERUSED_ROWS_PER_LANE_S,
    DropReason,
    Outcome,
    Session,
    SessionTable,
    plan_step,
)
from .shm import ShmOps
from .versions import Version, Versions, make_version

log = logging.getLogger(__name__)

# HELLOs with a wrong tag one connection may send before it is closed; a peer host that sent
# this many within the window is closed after each one.
AUTH_FAILURES_PER_CONNECTION = 3
AUTH_FAILURES_PER_PEER = 20
AUTH_WINDOW_S = 60.0
# A STATS body for connections without a session is reused for this long at most (while no
# other frame came): a peer pipelining STATS gets the same bytes, not a fresh JSON each time.
STATS_CACHE_S = 0.25
# ... and rebuilt at most this often for what only moves its counters (each STEP, each
# connection opened or closed): a body costs about a millisecond, so strangers' STATS cost at
# most 2% of the loop however many ask while engines step. A session created or dropped makes
# it fresh at once.
STATS_REBUILD_S = 0.05

Buffer = bytes | bytearray | memoryview


class Conn(Protocol):
    """What dispatch needs of a connection (server.Connection implements it)."""

    conn_id: int
    peer: str
    peer_host: str
    session_id: int  # the session of the latest HELLO accepted on this connection; 0: none

    def reply_buffer(self, nbytes: int) -> bytearray: ...

    def complete(self, data: Buffer, close: bool = False) -> None: ...

    def release_storage(self, storage: Any) -> None: ...


@dataclass(frozen=True)
class WorkerInfo:
    """The worker's own values: what HelloReply carries and HELLOs are checked against."""

    worker_name: str
    drafter_identity: bytes
    markov_identity: bytes
    window: int
    num_spec: int
    row_bytes: int
    vocab_size: int
    n_taps: int
    hidden: int
    max_slots: int
    max_rows_per_step: int
    capabilities: int
    sample_modes: frozenset[int] = frozenset({SAMPLE_GREEDY, SAMPLE_TOP32})
    bytes_per_slot: int = 0  # ring memory of one slot (window_memory_used_bytes)
    device: str = "cpu"
    dtype: str = "float32"
    version: str = "0"
    limits: dict[str, Any] = field(default_factory=dict)

    @property
    def has_confidence(self) -> bool:
        """The drafter has a confidence head (no ``CAP_NO_CONFIDENCE``)."""
        return not self.capabilities & CAP_NO_CONFIDENCE

    def hello_reply(self, resumed: bool = False, extra_capabilities: int = 0) -> HelloReply:
        return HelloReply(
            capabilities=self.capabilities | extra_capabilities, window=self.window,
            num_spec=self.num_spec,
            max_slots=self.max_slots, max_rows_per_step=self.max_rows_per_step,
            row_bytes=self.row_bytes, vocab_size=self.vocab_size,
            drafter_identity=self.drafter_identity, markov_identity=self.markov_identity,
            worker_name=self.worker_name, resumed=int(resumed), n_taps=self.n_taps,
            hidden=self.hidden, version=VERSION)


class Reply:
    """A reply frame to write now; ``close``: close the connection once it is written, with
    this reason (``connections_closed_total``); "" keeps it open."""

    __slots__ = ("close", "data")

    def __init__(self, data: Buffer, close: str = "") -> None:
        self.data = data
        self.close = close


class RateLimitedLog:
    """One line per key per ``interval_s``: a flood of bad frames must not become a flood of log
    lines. Keys name a peer host (not host:port: every new connection has a new port) and a
    reason. What is held back is counted, and said in one line when the window ends (``flush``,
    called every second or so, or the key's next line)."""

    def __init__(self, logger: logging.Logger, interval_s: float = 10.0, *,
                 clock: Callable[[], float] = time.monotonic, max_keys: int = 4096) -> None:
        self._log = logger
        self._interval = interval_s
        self._clock = clock
        self._max_keys = max_keys
        # key -> [window start, lines held back, what they are, log level]
        self._windows: dict[Any, list[Any]] = {}

    def error(self, key: Any, what: str, msg: str, *args: Any,
              exc_info: BaseException | None = None) -> None:
        """As ``warning``, at ERROR, with ``exc_info``'s traceback on the lines that are
        logged."""
        self._emit(logging.ERROR, key, what, msg, args, exc_info)

    def warning(self, key: Any, what: str, msg: str, *args: Any) -> None:
        self._emit(logging.WARNING, key, what, msg, args)

    def info(self, key: Any, what: str, msg: str, *args: Any) -> None:
        self._emit(logging.INFO, key, what, msg, args)

    def _emit(self, level: int, key: Any, what: str, msg: str, args: tuple[Any, ...],
              exc_info: BaseException | None = None) -> None:
        now = self._clock()
        w = self._windows.get(key)
        if w is not None:
            if now - w[0] < self._interval:
                w[1] += 1
                return
            self._summarise(self._windows.pop(key))
        if len(self._windows) >= self._max_keys:  # keep the map bounded under a flood
            self.flush(now, everything=True)
        self._windows[key] = [now, 0, what, level]
        self._log.log(level, msg, *args, exc_info=exc_info)

    def flush(self, now: float | None = None, *, everything: bool = False) -> None:
        """Say what was held back in every window that has ended."""
        now = self._clock() if now is None else now
        ended = [k for k, w in self._windows.items()
                 if everything or now - w[0] >= self._interval]
        for k in ended:
            self._summarise(self._windows.pop(k))

    def _summarise(self, w: list[Any]) -> None:
        if w[1]:
            self._log.log(w[3], "%d more %s were not logged (one line per %g s)",
                          w[1], w[2], self._interval)


def _hex8(b: bytes) -> str:
    return b.hex()[:16]


class Dispatcher:
    """Frames in, replies out; owns the session table."""

    def __init__(self, info: WorkerInfo, table: SessionTable, runner: Runner, metrics: Metrics,
                 *, secret: bytes | None = None, shed_queue_steps: int = 32,
                 max_frame_bytes: int | None = None,
                 stats_extra: Callable[[], dict[str, Any]] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 shm: ShmOps | None = None, versions: Versions | None = None) -> None:
        # The drafter versions; the newest's WorkerInfo is ``info`` (every version has the
        # same geometry and limits; only the identities differ).
        self.versions = versions if versions is not None else Versions(
            make_version(1, runner.drafter, runner.pool, info))
        self.info = cast(WorkerInfo, self.versions.newest.info)
        # The frame body limit in force: a HELLO whose largest STEP is over it is refused.
        self.max_frame_bytes = max_frame_bytes
        # Key of the session labels in STATS: a stranger can neither read an id from a label
        # nor find it by hashing all 2**32 of them.
        self._label_key = os.urandom(16)
        self.table = table
        self.runner = runner
        self.metrics = metrics
        self.secret = secret
        self.shed_queue_steps = shed_queue_steps
        self.stats_extra = stats_extra
        self.clock = clock
        self.started = clock()
        self.draining = False
        self.ready = True
        self.last_frame_at = 0.0  # perf_counter of the newest frame: the drain ends when quiet
        self.connected: Callable[[int], bool] = lambda conn_id: True
        # Called with a connection id whose session just went (dropped or moved away): the
        # server unmaps that connection's shared-memory region.
        self.session_left: Callable[[int], None] = lambda conn_id: None
        self._handlers: dict[int, Callable[[Conn, Frame, float], Reply | None]] = {
            OP_HELLO: self._hello,
            OP_STEP: self._step,
            OP_PING: self._ping,
            OP_STATS: self._stats,
            OP_RESET: self._reset,
            OP_GOODBYE: self._goodbye,
            OP_SHM_ATTACH: self._shm_attach,
            OP_RELOAD: self._reload,
        }
        # Asks the app for a reload (RELOAD): its number, or None when it cannot now.
        self.reload_hook: Callable[[str], int | None] | None = None
        self._reload_nonces: OrderedDict[bytes, float] = OrderedDict()
        # Section 13: shared-memory rows regions (max_region_bytes 0: none offered).
        self.shm = shm if shm is not None else ShmOps(0)
        self.shm.make_room = self._unused_regions_give_way
        self._refusal_log = RateLimitedLog(log)
        # Bumped by every frame but PING, STATS and STEP, and every session dropped or
        # version added: a cached STATS body is reused only while it stays the same.
        self.state_version = 0
        # Bumped by what only moves the body's counters (STEPs, connections opened and
        # closed): the body is rebuilt for them at most every STATS_REBUILD_S.
        self.counters_version = 0
        # Why the drafter's latest outputs were refused (not finite), until a STEP drafts
        # finite values again; /healthz answers 503 meanwhile.
        self.outputs_broken: str | None = None
        self._stats_cache: tuple[tuple[int, bool, bool], float, bytes, int] | None = None
        # peer host -> (window start, HELLOs whose tag did not verify since)
        self._auth_failures: OrderedDict[str, tuple[float, int]] = OrderedDict()
        self._dropped_counts: dict[str, int] = {}
        self._hello_reply_ok: dict[tuple[int, bool, int], bytes] = {}
        self.acceptance = WorkerAcceptance(info.num_spec, metrics.registry,
                                           has_confidence=info.has_confidence)
        self.canary: Any = None  # canary.Canary: drafts in the shadow of the serving versions
        for v in self.versions:
            self.acceptance.version_added(v)
        # Gauges read when scraped: nothing to keep up to date per frame.
        metrics.sessions.set_function(lambda: len(table))
        metrics.active_slots.set_function(lambda: table.active_slots)
        metrics.window_memory_used.set_function(
            lambda: table.lanes_reserved * info.bytes_per_slot)
        metrics.queue_steps.set_function(lambda: runner.queued_steps)

    def add_version(self, version: Version) -> None:
        """Make ``version`` the newest: it serves HELLOs that follow the worker, and its
        values are what refused HELLOs are answered with."""
        self.versions.add(version)
        self.acceptance.version_added(version, newest=True)
        self.info = cast(WorkerInfo, version.info)
        self.state_version += 1

    # -- the boundary -----------------------------------------------------------------------------
    def handle(self, conn: Conn, fr: Frame, t_arrival: float) -> Reply | None:
        """Answer one frame. Returns None when a STEP went to the runner."""
        h = fr.header
        self.metrics.received(APP_HEADER_SIZE + h.body_len)
        self.last_frame_at = t_arrival
        try:
            if h.version != VERSION:
                raise VersionError(f"contract version {h.version} is not spoken; this worker"
                                   f" speaks {VERSION}", field="version", value=h.version,
                                   limit=VERSION)
            if h.status != 0:
                raise BadFrameError(f"request carries status {h.status}; requests carry 0",
                                    field="status", value=h.status, limit=0)
            if self.draining and h.op in (OP_HELLO, OP_STEP):
                raise DrainingError("the worker is shutting down; connect to another worker")
            if h.op == OP_STEP:
                self.counters_version += 1
            elif h.op not in (OP_PING, OP_STATS):
                self.state_version += 1
            if fr.discarded:  # section 3: the connection's session is gone; the body was dropped
                raise NoSessionError(
                    f"session {h.session:#010x} is not held on this connection (its session is"
                    f" gone); the {h.body_len}-byte body was discarded: HELLO again",
                    field="session", value=h.session)
            handler = self._handlers.get(h.op)
            if handler is None:
                raise BadFrameError(f"unknown op {h.op}", field="op", value=h.op)
            return handler(conn, fr, t_arrival)
        except WireError as exc:
            return self._refuse(conn, h, exc)
        except Exception as exc:
            # A bug, not a bad frame: the session it touched may be half changed, so drop it.
            # (One traceback per peer host, op and error a window: a peer that can trigger the
            # bug again and again must not flood the log.)
            name = type(exc).__name__
            self._refusal_log.error((conn.peer_host, h.op, name),
                                    f"{h.op_name} {name} failures from {conn.peer_host}",
                                    "%s seq %d from %s failed", h.op_name, h.seq, conn.peer,
                                    exc_info=exc)
            s = self.table.get(h.session)
            if s is not None and s.conn_id == conn.conn_id and h.op != OP_PING:
                self._drop(s, DropReason.INTERNAL, f"{name} in {h.op_name}")
            return self._refuse(conn, h, InternalError(f"{type(exc).__name__}: {exc}"))

    def refuse_too_large(self, conn: Conn, h: AppHeader, exc: FrameTooLargeError) -> Reply:
        """A header whose body_len is over the frame limit: ST_BAD_FRAME, then close."""
        return self._refuse(conn, h, exc)

    def _refuse(self, conn: Conn, h: AppHeader, exc: WireError) -> Reply:
        status = exc.status
        # ST_DRAINING closes too: a client that does not know the status reconnects, and the
        # drain ends sooner (app.WorkerApp.stop waits for the connections to go).
        close = ("too_large" if isinstance(exc, FrameTooLargeError) else "version"
                 if status == ST_VERSION else "draining" if status == ST_DRAINING else "")
        if status == ST_AUTH and self._auth_failed(conn):
            close = "auth"
        body: bytes = b""
        if h.op == OP_HELLO:
            body = self.info.hello_reply().pack()
            self.metrics.hello_refusals.labels(status=FRAME_STATUS_NAMES[status]).inc()
        elif h.op == OP_SHM_ATTACH:  # on ST_LIMITS: the largest region it could map (13.2)
            s = self.table.get(h.session) if status == ST_LIMITS else None
            body = self.shm.reply(self.shm.room(self._rows_bytes(s)) if s is not None else 0)
        self.metrics.frame(h.op, status)
        what = f"{h.op_name} {FRAME_STATUS_NAMES[status]} refusals from {conn.peer_host}"
        # ST_BUSY says which limit: each limit's line is logged, not only the first one's
        limit = exc.field if status == ST_BUSY else None
        self._refusal_log.warning((conn.peer_host, h.op, status, limit), what,
                                  "%s seq %d session %#010x from %s refused %s: %s%s",
                                  h.op_name, h.seq, h.session, conn.peer,
                                  FRAME_STATUS_NAMES[status], exc,
                                  "; closing the connection" if close else "")
        return Reply(self._frame(h, status, body), close=close)

    def _auth_failed(self, conn: Conn) -> bool:
        """Count a HELLO whose tag does not verify; True: close the connection after the reply.
        A connection gets AUTH_FAILURES_PER_CONNECTION tries; a peer host with
        AUTH_FAILURES_PER_PEER of them within AUTH_WINDOW_S gets one try per connection, so
        each guess costs it a new connection (counted, and pushed out first, section 11)."""
        n = getattr(conn, "auth_failures", 0) + 1
        with contextlib.suppress(AttributeError):
            conn.auth_failures = n  # type: ignore[attr-defined]
        now = self.clock()
        peers = self._auth_failures
        start, count = peers.pop(conn.peer_host, (now, 0))
        if now - start >= AUTH_WINDOW_S:
            start, count = now, 0
        peers[conn.peer_host] = (start, count + 1)
        while len(peers) > 4096:
            peers.popitem(last=False)
        return n >= AUTH_FAILURES_PER_CONNECTION or count + 1 >= AUTH_FAILURES_PER_PEER

    @staticmethod
    def _frame(h: AppHeader, status: int, body: Buffer = b"") -> bytes:
        return frame(h.op, h.seq, h.session, body, status=status)

    def _ok(self, h: AppHeader, body: Buffer = b"") -> Reply:
        self.metrics.frame(h.op, ST_OK)
        return Reply(self._frame(h, ST_OK, body))

    # -- HELLO (6.1, 6.2) -------------------------------------------------------------------------
    def _hello(self, conn: Conn, fr: Frame, t_arrival: float) -> Reply:
        h = fr.header
        hello = Hello.unpack(fr.body)
        if h.session == 0:
            raise BadFrameError("HELLO for session 0; a session is a nonzero u32",
                                field="session", value=0)
        if hello.version != VERSION:
            raise VersionError(f"HELLO version {hello.version} is not spoken; this worker"
                               f" speaks {VERSION}", field="version", value=hello.version,
                               limit=VERSION)
        if not verify_hello(self.secret, h.session, h.seq, hello):
            raise AuthError("HELLO authentication tag does not verify", field="auth_tag")
        version = self._version_for(hello)
        self._check_geometry(hello)
        self._check_limits(hello)
        now = self.clock()

        def live(other: Session) -> bool:  # another engine's, in use: not a dead predecessor
            return self.connected(other.conn_id) and now - other.last_active < LIVE_SESSION_S

        before = self.table.get(h.session)
        moved_from = before.conn_id if before is not None else 0
        result = self.table.hello(h.session, h.seq, hello, conn.conn_id, now, live,
                                  conn.peer_host, self.connected)
        if moved_from and moved_from != conn.conn_id:
            self.session_left(moved_from)
        for s, reason in result.dropped:
            to = f"session {h.session:#010x} from {conn.peer}"
            if reason is DropReason.UNUSED:
                why = (f"its {s.max_slots} slots, without a STEP for"
                       f" {now - s.last_step_at:.1f} s, went to {to}")
            elif reason is DropReason.UNDERUSED:
                why = (f"its {s.max_slots} slots, given {self.table.use(s, now):.2f} rows a"
                       f" second each (under {UNDERUSED_ROWS_PER_LANE_S:g}), went to {to}")
            else:
                why = f"by {to}"
            self._dropped(s, reason, why)
        for other in result.kept:
            self._refusal_log.warning(
                ("shared_client_name", hello.client_name),
                f"HELLOs sharing client name {hello.client_name!r}",
                "client name %r: session %#010x (from %s, its connection open, active %.1f s"
                " ago) is kept beside the new session %#010x from %s: two engines use this"
                " client name, or a stranger claims it; give each engine its own, so that a"
                " respawn clears only its own state", hello.client_name, other.session_id,
                other.peer, now - other.last_active, h.session, conn.peer)
        s = result.session
        conn.session_id = s.session_id
        if result.outcome is not Outcome.RESUMED:
            s.version = version
            self.versions.session_added(version)
            self.runner.submit(LaneOp("allocate", s))
        v = s.version if s.version is not None else version
        log.info("session %#010x %s: client %r from %s, %d slots, %s%s, seq %d, label %s,"
                 " version %d %s", s.session_id, result.outcome.value, s.client_name, conn.peer,
                 s.max_slots, SAMPLE_MODE_NAMES.get(hello.sample_mode, "?"),
                 ", synthetic (kept out of acceptance)" if s.synthetic else "", h.seq,
                 self.session_label(s.session_id), v.number, v.name)
        resumed = result.outcome is Outcome.RESUMED
        # CAP_SHM_ROWS only where a region can work: a Unix connection to a worker with a limit.
        caps = (CAP_SHM_ROWS if self.shm.max_region_bytes and getattr(conn, "kind", "") == "unix"
                else 0)
        key = (v.number, resumed, caps)
        body = self._hello_reply_ok.get(key)
        if body is None:
            if len(self._hello_reply_ok) > 64:  # versions come and go: keep it small
                self._hello_reply_ok.clear()
            body = self._hello_reply_ok[key] = v.info.hello_reply(resumed, caps).pack()
        return self._ok(h, body)

    def _version_for(self, hello: Hello) -> Version:
        """The version whose identities the HELLO names, or with HF_FOLLOW the newest (6.5);
        a session keeps it for its life."""
        if hello.flags & HF_FOLLOW:
            for name in ("drafter_identity", "markov_identity"):
                if any(getattr(hello, name)):
                    raise BadFrameError(f"HELLO with HF_FOLLOW names a {name}"
                                        f" ({_hex8(getattr(hello, name))}...); it asks for"
                                        " whatever the worker serves and carries zeros",
                                        field=name, value=getattr(hello, name).hex())
            return self.versions.newest
        found = None
        if len(hello.drafter_identity) == IDENTITY_BYTES and \
                len(hello.markov_identity) == IDENTITY_BYTES:
            found = self.versions.find(hello.drafter_identity, hello.markov_identity)
        if found is not None:
            return found
        newest = self.versions.newest
        loaded = ", ".join(f"{v.name} ({_hex8(v.drafter_identity)}...)" for v in self.versions)
        name, theirs, ours = (
            ("drafter_identity", hello.drafter_identity, newest.drafter_identity)
            if hello.drafter_identity != newest.drafter_identity
            else ("markov_identity", hello.markov_identity, newest.markov_identity))
        raise IdentityError(f"HELLO {name} {_hex8(theirs)}... is not the worker's"
                            f" {_hex8(ours)}... (versions loaded: {loaded})", field=name,
                            value=theirs.hex(), limit=ours.hex())

    def _check_geometry(self, hello: Hello) -> None:
        i = self.info
        checks: list[tuple[str, int, int]] = [
            ("window", hello.window, i.window),
            ("num_spec", hello.num_spec, i.num_spec),
            ("row_bytes", hello.row_bytes, i.row_bytes),
            ("vocab_size", hello.vocab_size, i.vocab_size),
            ("tap_dtype", hello.tap_dtype, TAPS_BF16),
            ("n_taps", hello.n_taps, i.n_taps),
            ("hidden", hello.hidden, i.hidden),
        ]
        for name, theirs, ours in checks:
            if theirs != ours:
                raise GeometryError(f"HELLO {name} {theirs} is not the worker's {ours}",
                                    field=name, value=theirs, limit=ours)
        if hello.sample_mode not in i.sample_modes:
            raise GeometryError(f"HELLO sample_mode {hello.sample_mode} is not one the worker"
                                f" serves ({sorted(i.sample_modes)})", field="sample_mode",
                                value=hello.sample_mode, limit=sorted(i.sample_modes))
        per = TAP_DTYPE_BYTES[TAPS_BF16]
        if hello.row_bytes != hello.n_taps * hello.hidden * per:
            raise GeometryError(f"HELLO row_bytes {hello.row_bytes} is not n_taps {hello.n_taps}"
                                f" * hidden {hello.hidden} * {per}", field="row_bytes",
                                value=hello.row_bytes, limit=hello.n_taps * hello.hidden * per)

    def _check_limits(self, hello: Hello) -> None:
        i = self.info
        if hello.max_slots == 0 or hello.max_slots > i.max_slots:
            raise LimitsError(f"HELLO max_slots {hello.max_slots} is not in 1..{i.max_slots}",
                              field="max_slots", value=hello.max_slots, limit=i.max_slots)
        if hello.max_rows_per_step > i.max_rows_per_step:
            raise LimitsError(f"HELLO max_rows_per_step {hello.max_rows_per_step} is over the"
                              f" worker's {i.max_rows_per_step}", field="max_rows_per_step",
                              value=hello.max_rows_per_step, limit=i.max_rows_per_step)
        limit = self.max_frame_bytes
        need = max_step_body_bytes(hello.max_slots, hello.max_rows_per_step, i.row_bytes)
        if limit is not None and need > limit:
            # Accepted, the session's first full resync would be cut off at the frame limit,
            # again after every reconnect: refuse what cannot be served, with both numbers.
            raise LimitsError(f"HELLO max_slots {hello.max_slots} and max_rows_per_step"
                              f" {hello.max_rows_per_step} allow a STEP body of {need} bytes;"
                              f" the worker's frame limit is {limit} bytes",
                              field="max_rows_per_step", value=need, limit=limit)

    # -- STEP (7.2) -------------------------------------------------------------------------------
    def _step(self, conn: Conn, fr: Frame, t_arrival: float) -> Reply | None:
        h = fr.header
        s = self.table.bound(h.session, conn.conn_id, h.seq)
        view = self._decode_step(conn, fr.body)
        check_step_shape(view, row_bytes=self.info.row_bytes, max_slots=s.max_slots,
                         max_rows_per_step=s.hello.max_rows_per_step,
                         num_spec=self.info.num_spec, sampled=s.sampled)
        self._check_tokens(view.entries)
        plan = plan_step(s, view.entries)
        # Everything is checked: from here the STEP is accepted and must be answered.
        reply_buf = conn.reply_buffer(reply_bytes(view.header.n_req, self.info.num_spec,
                                                  s.sampled))
        self.table.commit_step(s, plan, view.entries, h.seq, self.clock())
        shed = self.runner.queued_steps >= self.shed_queue_steps
        item = StepItem(conn, h, s, view, plan, fr.storage, reply_buf, t_arrival, shed)
        self.metrics.step_accepted(int(view.header.n_rows), APP_HEADER_SIZE + h.body_len)
        self.metrics.observe_stage("decode", item.t_queued - t_arrival)
        self.runner.submit(item)
        return None

    @staticmethod
    def _decode_step(conn: Conn, body: memoryview) -> StepView:
        """7.3, or 13.3 when the step flags say the rows are in the connection's region."""
        if len(body) >= 24 and body[20] & SF_ROWS_SHM:  # the low byte of step_flags
            shm = getattr(conn, "shm", None)
            return decode_step_shm(body, shm.rows if shm is not None else None)
        return decode_step(body)

    def _check_tokens(self, entries: Any) -> None:
        """A drafting entry's anchor_token is the first input of the block: it must be a token
        of the vocabulary (refused like the rules of 7.2 step 3, before anything applies)."""
        if not entries.shape[0]:
            return
        tokens = entries["anchor_token"]
        if int(tokens.max()) < self.info.vocab_size:  # the usual case: nothing to look at
            return
        bad = ((entries["flags"] & RF_NEED_DRAFT) != 0) & (tokens >= self.info.vocab_size)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            slot, token = int(entries["slot"][i]), int(tokens[i])
            raise BadFrameError(f"slot {slot}: anchor_token {token} is not below vocab_size"
                                f" {self.info.vocab_size}", field="anchor_token", value=token,
                                limit=self.info.vocab_size, entry=i, slot=slot)

    def complete(self, item: StepItem) -> None:
        """The runner is done with a STEP (loop thread): reply, account, recycle its buffer."""
        t_back = time.perf_counter()
        self.counters_version += 1
        conn, h, m = item.conn, item.header, self.metrics
        conn.release_storage(item.storage)
        item.storage = None
        if item.skipped:
            data: Buffer = self._frame(h, ST_NO_SESSION)
            m.frame(h.op, ST_NO_SESSION)
            conn.complete(data)
            return
        if item.error is not None or item.reply is None:
            exc = item.error
            if isinstance(exc, NonFiniteOutput):
                self.outputs_broken = str(exc)
            name = type(exc).__name__
            self._refusal_log.error(("device", name), f"STEP {name} failures on the device",
                                    "STEP seq %d of session %#010x failed on the device: %s: %s",
                                    h.seq, h.session, name, exc,
                                    exc_info=exc if not isinstance(exc, WireError) else None)
            self._drop(item.session, DropReason.INTERNAL, f"{type(exc).__name__}: {exc}")
            m.frame(h.op, ST_INTERNAL)
            conn.complete(self._frame(h, ST_INTERNAL))
            return
        reply = item.reply
        canary = self.canary
        if canary is not None and not item.view.rows.flags.writeable:
            # Rows in the client's shared memory: it may write them again once it has the
            # reply, so the canary takes its copy first.
            canary.observe(item)
            canary = None
        t_done = time.perf_counter()
        body_len = reply.finish(int((t_done - item.t_arrival) * 1e6))
        buf = item.reply_buf
        h.reply(ST_OK, body_len).pack_into(buf, 0)
        conn.complete(memoryview(buf)[:APP_HEADER_SIZE + body_len])  # the reply leaves first
        m.frame(h.op, ST_OK)
        status = item.status
        if status is not None:
            if item.all_ok:
                m.request_status_ok(status.size)
            else:
                m.request_statuses(np.bincount(status))
        m.drafted(item.n_drafted)
        if item.n_drafted and self.outputs_broken is not None:
            self.outputs_broken = None  # finite drafts again
        item.session.drafted += item.n_drafted
        self.acceptance.step_answered(item)
        if canary is not None:
            canary.observe(item)
        m.observe_stage("queue", item.t_start - item.t_queued)
        m.observe_stage("apply", item.apply_s)
        if item.drafting.size:
            m.observe_stage("draft", item.draft_s)
        m.observe_stage("encode", item.encode_s)
        m.observe_stage("step", t_done - item.t_arrival)
        if item.t_exec1:
            m.observe_stage("to_device", item.t_exec0 - item.t_queued)
            m.observe_stage("from_device", t_back - item.t_exec1)

    def record_batch(self, steps: int, entries: int) -> None:
        self.metrics.batch_steps.observe(steps)
        if entries:
            self.metrics.batch_entries.observe(entries)

    # -- PING, STATS, RESET, GOODBYE (10) ------------------------------------------------------
    def _ping(self, conn: Conn, fr: Frame, t_arrival: float) -> Reply:
        h = fr.header
        if fr.body.nbytes:
            raise BadFrameError(f"PING carries a {fr.body.nbytes}-byte body; it has none",
                                field="body_len", value=fr.body.nbytes, limit=0)
        s = self.table.get(h.session) if h.session else None
        if s is not None and s.conn_id == conn.conn_id:
            s.last_active = self.clock()  # a PING keeps its session alive, seq untouched
        return self._ok(h)

    def _stats(self, conn: Conn, fr: Frame, t_arrival: float) -> Reply:
        h = fr.header
        if fr.body.nbytes:
            raise BadFrameError(f"STATS carries a {fr.body.nbytes}-byte body; it has none",
                                field="body_len", value=fr.body.nbytes, limit=0)
        if h.session:
            s = self.table.bound(h.session, conn.conn_id, h.seq)
            self.table.touch(s, h.seq, self.clock())
        if conn.session_id:  # its own sessions' entries show their ids: made for it alone
            return self._ok(h, msgspec.json.encode(self.stats(viewer=conn.conn_id)))
        # The view of a connection that never held a session is the same for all of them: a
        # STATS repeated while nothing else happened is answered from the last one.
        now = self.clock()
        key = (self.state_version, self.draining, self.ready)
        cached = self._stats_cache
        age = now - cached[1] if cached is not None else STATS_CACHE_S
        if (cached is None or age >= STATS_CACHE_S or cached[0] != key
                or (cached[3] != self.counters_version and age >= STATS_REBUILD_S)):
            cached = self._stats_cache = (key, now, msgspec.json.encode(self.stats()),
                                          self.counters_version)
        return self._ok(h, cached[2])

    def _reset(self, conn: Conn, fr: Frame, t_arrival: float) -> Reply:
        h = fr.header
        s = self.table.bound(h.session, conn.conn_id, h.seq)
        arr = reset_slots(fr.body, s.max_slots)  # count checked before anything is decoded
        if arr.size and int(arr.max()) >= s.max_slots:
            bad = int(arr[arr >= s.max_slots][0])
            raise BadFrameError(f"RESET slot {bad} is not below max_slots {s.max_slots}",
                                field="slot", value=bad, limit=s.max_slots, slot=bad)
        self.table.touch(s, h.seq, self.clock())
        self.runner.submit(LaneOp("release", s, np.unique(arr) if arr.size else None))
        log.debug("session %#010x RESET %s", s.session_id,
                  "every slot" if not arr.size else f"{arr.size} slots")
        return self._ok(h)

    def _goodbye(self, conn: Conn, fr: Frame, t_arrival: float) -> Reply:
        h = fr.header
        if fr.body.nbytes:
            raise BadFrameError(f"GOODBYE carries a {fr.body.nbytes}-byte body; it has none",
                                field="body_len", value=fr.body.nbytes, limit=0)
        s = self.table.bound(h.session, conn.conn_id, h.seq)
        self.table.touch(s, h.seq, self.clock())  # retired with this seq: a replay cannot pass
        self._drop(s, DropReason.GOODBYE, f"released by its client from {conn.peer}")
        return self._ok(h)

    # -- RELOAD (10) ---------------------------------------------------------------------------
    def _reload(self, conn: Conn, fr: Frame, t_arrival: float) -> Reply:
        """Reload the drafter, asked over the wire: only under the shared secret, signed within
        RELOAD_MAX_SKEW_S of the worker's clock, each signature once."""
        h = fr.header
        if self.secret is None:
            raise AuthError("RELOAD needs the worker's shared secret (--auth-secret-file); this"
                            " worker has none: send it SIGHUP instead", field="auth_tag")
        now = time.time()
        _, nonce = verify_reload(self.secret, fr.body, now)
        seen = self._reload_nonces
        while seen and next(iter(seen.values())) < now - 2 * RELOAD_MAX_SKEW_S:
            seen.popitem(last=False)  # older than any signature still within the skew
        if nonce in seen:
            raise AuthError("RELOAD replayed: its signature was used already", field="nonce")
        number = self.reload_hook(f"RELOAD from {conn.peer}") if self.reload_hook else None
        if number is None:
            raise BusyError("the worker is starting or draining: nothing reloaded")
        seen[nonce] = now
        while len(seen) > 4096:
            seen.popitem(last=False)
        return self._ok(h, msgspec.json.encode({"reload": number}))

    # -- SHM_ATTACH (13.2) -------------------------------------------------------------------------
    def _shm_attach(self, conn: Conn, fr: Frame, t_arrival: float) -> Reply:
        h = fr.header
        s = self.table.bound(h.session, conn.conn_id, h.seq)
        body = self.shm.attach(conn, fr, self._rows_bytes(s))
        self.table.touch(s, h.seq, self.clock())
        return self._ok(h, body)

    def _rows_bytes(self, s: Session) -> int:
        """The rows of the session's largest STEP: what a region of it can hold at most."""
        return s.hello.max_rows_per_step * self.info.row_bytes

    def _unused_regions_give_way(self, need: int) -> None:
        """SHM_ATTACH finds the regions' cap full: connections whose sessions all went
        reservation_idle_s without a STEP let go of them (and so of their regions), the
        largest region first, until ``need`` bytes are free; as a HELLO takes unused lanes."""
        now = self.clock()
        sessions: dict[int, list[Session]] = {}
        for s in self.table:
            sessions.setdefault(s.conn_id, []).append(s)
        for conn_id, nbytes in sorted(self.shm.by_connection.items(), key=lambda kv: -kv[1]):
            if need <= 0:
                return
            mine = sessions.get(conn_id, [])
            if mine and all(self.table.unused(s, now) for s in mine):
                for s in mine:
                    self._drop(s, DropReason.UNUSED, f"its connection's {nbytes}-byte"
                               " shared-memory region, unused (no STEP for"
                               f" {now - s.last_step_at:.1f} s), was needed by another")
                need -= nbytes

    def versions_give_way(self) -> Version | None:
        """A reload needs room (``--max-versions`` are loaded): the sessions of one older
        version that none of them drafts in earnest (each unused or underused, as a HELLO
        takes lanes) let go of it, so that it unloads; one held by following sessions only
        first (they come back on the newest at once), else the oldest. The version let go,
        or None if every older one serves a session that drafts."""
        now = self.clock()
        by_version: dict[int, list[Session]] = {}
        for s in self.table:
            if s.version is not None:
                by_version.setdefault(s.version.number, []).append(s)
        idle = [v for v in list(self.versions)[:-1]
                if all(self.table.reclaimable(s, now) for s in by_version.get(v.number, []))]
        if not idle:
            return None
        v = min(idle, key=lambda v: (not all(s.hello.flags & HF_FOLLOW
                                              for s in by_version.get(v.number, [])),
                                     v.number))
        for s in by_version.get(v.number, []):
            reason = DropReason.UNUSED if self.table.unused(s, now) else DropReason.UNDERUSED
            self._drop(s, reason, f"version {v.number} {v.name}, which it holds and does not"
                       " draft with, gave way to a reload (--max-versions)")
        return v

    # -- sessions ---------------------------------------------------------------------------------
    def expire_idle(self) -> int:
        gone = self.table.expire(self.clock(), self.connected)
        for s in gone:
            self._dropped(s, DropReason.EXPIRED,
                          f"after {self.table.idle_s:.0f} s without a frame" if s.steps else
                          f"no STEP and no connection for {self.table.unused_idle_s:g} s")
        return len(gone)

    def _drop(self, s: Session, reason: DropReason, why: str) -> None:
        if self.table.drop(s):
            self._dropped(s, reason, why)

    def _dropped(self, s: Session, reason: DropReason, why: str) -> None:
        """After the table let ``s`` go: free its lanes in order with the STEPs, account."""
        self.state_version += 1
        self.runner.submit(LaneOp("free", s))
        if s.version is not None:
            self.versions.session_gone(s.version)
        self.acceptance.forget(s)
        if self.canary is not None:
            self.canary.forget(s)
        self.session_left(s.conn_id)
        self.metrics.sessions_dropped.labels(reason=reason.value).inc()
        self._dropped_counts[reason.value] = self._dropped_counts.get(reason.value, 0) + 1
        lvl = logging.WARNING if reason is DropReason.INTERNAL else logging.INFO
        log.log(lvl, "session %#010x %s (client %r, %d live slots): %s", s.session_id,
                reason.value if reason is not DropReason.INTERNAL else "dropped", s.client_name,
                s.n_live, why)

    def flush_logs(self, now: float | None = None) -> None:
        self._refusal_log.flush(now)

    def drop_all(self, reason: DropReason = DropReason.SHUTDOWN) -> None:
        for s in self.table:
            self._drop(s, reason, "the worker is stopping")

    # -- STATS ------------------------------------------------------------------------------------
    def session_label(self, session_id: int) -> str:
        """A session's name in STATS and logs: a keyed hash of its id (12 hex digits) that does
        not give the id away to whoever reads STATS (section 11)."""
        return hashlib.blake2b(session_id.to_bytes(4, "little"), key=self._label_key,
                               digest_size=6).hexdigest()

    def engine_label(self, client_name: str) -> str | None:
        """The engine a session belongs to, in STATS: a keyed hash of its client name (12 hex
        digits), the same for every session of that name while this worker runs (a following
        engine's new session at each reload, a reconnect, a restart), that does not give the
        name away (section 11). None for a session without a name."""
        if not client_name:
            return None
        return hashlib.blake2b(b"engine\x00" + client_name.encode("utf-8"),
                               key=self._label_key, digest_size=6).hexdigest()

    def stats(self, viewer: int | None = None) -> dict[str, Any]:
        """The STATS object. Sessions are named by label; the id and client name of a session
        are shown only to the connection it is bound to (``viewer``), since with them a
        stranger could take the session over or drop it by client name (6.2, 11)."""
        i, now, m = self.info, self.clock(), self.metrics
        sessions = []
        for s in self.table:
            entry: dict[str, Any] = {"label": self.session_label(s.session_id),
                                     "engine": self.engine_label(s.client_name)}
            if viewer is not None and s.conn_id == viewer:
                entry["session"] = s.session_id
                entry["client_name"] = s.client_name
            entry.update({
                "version": s.version.number if s.version is not None else None,
                "sample_mode": SAMPLE_MODE_NAMES.get(s.hello.sample_mode, "?"),
                "synthetic": s.synthetic,
                "max_slots": s.max_slots, "slots_in_use": s.n_live,
                "connected": self.connected(s.conn_id),
                "age_s": round(now - s.created_at, 3), "idle_s": round(now - s.last_active, 3),
                "steps": s.steps, "rows": s.rows, "drafted_positions": s.drafted,
                "acceptance": self.acceptance.session_summary(s),
            })
            sessions.append(entry)
        totals: dict[str, Any] = dict(m.totals)
        totals["batches"] = self.runner.batches
        totals["refusals"] = dict(m.refusals)
        totals["request_status"] = {REQ_STATUS_NAMES[rs]: n
                                    for rs, n in enumerate(m.request_counts)
                                    if rs in REQ_STATUS_NAMES}
        totals["sessions_dropped"] = dict(self._dropped_counts)
        totals["acceptance"] = self.acceptance.totals().summary()
        out: dict[str, Any] = {
            "worker_name": i.worker_name, "version": i.version, "contract_version": VERSION,
            "uptime_s": round(now - self.started, 3), "ready": self.ready,
            "draining": self.draining, "device": i.device, "dtype": i.dtype,
            "geometry": {"window": i.window, "num_spec": i.num_spec, "row_bytes": i.row_bytes,
                         "vocab_size": i.vocab_size, "n_taps": i.n_taps, "hidden": i.hidden,
                         "capabilities": i.capabilities},
            "drafter_identity": i.drafter_identity.hex(),
            "markov_identity": i.markov_identity.hex(),
            "drafter_name": self.versions.newest.name,
            "confidence_head": i.has_confidence,
            "versions": self.versions_summary(),
            "canary": self._canary_summary(),
            "limits": dict(i.limits),
            "queue_steps": self.runner.queued_steps,
            "sessions": sessions,
            "totals": totals,
            "latency_us": m.latency_quantiles(),
        }
        if self.stats_extra is not None:
            out.update(self.stats_extra())
        return out


    def _canary_summary(self) -> dict[str, Any] | None:
        if self.canary is None:
            return None
        out: dict[str, Any] = self.canary.summary()
        room = getattr(self.runner, "room", None)
        gap, chunk = (room.gap, room.chunk) if room is not None else (None, None)
        out["device_room"] = {"gap_ms": None if gap is None else round(gap * 1e3, 3),
                              "chunk_ms": None if chunk is None else round(chunk * 1e3, 3)}
        return out

    def versions_summary(self) -> list[dict[str, Any]]:
        """The kept versions, loaded or not, for STATS."""
        newest = self.versions.newest
        accepted = self.acceptance.by_version()
        empty = AcceptanceTotals(self.info.num_spec)
        return [{"version": v.number, "name": v.name,
                 "role": "newest" if v is newest else "older" if v.loaded else "unloaded",
                 "source": v.source, "loaded_at": round(v.loaded_at, 3),
                 "sessions": v.sessions if v.loaded else 0,
                 "drafter_identity": v.drafter_identity.hex(),
                 "markov_identity": v.markov_identity.hex(),
                 "weights_bytes": v.weights_bytes if v.loaded else 0,
                 "acceptance": accepted.get(v.number, ("", empty))[1].summary()}
                for v in sorted(self.versions.kept.values(), key=lambda v: v.number)]


def rss_bytes() -> int:
    """Resident set size of this process (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0

