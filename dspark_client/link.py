"""The link to the worker set: which worker rank 0 talks to, over which connection, in which
session and epoch (docs/contract.md sections 5, 6, 7.5 and 13; docs/operations.md, "Placement").

``WorkerLink`` owns everything about being connected and nothing about a STEP: the background
thread, connect and HELLO with capped exponential backoff and jitter, epochs, the worker set and
where in it to be, ST_DRAINING, following a newer drafter, the shared-memory attach and its
fallback, GOODBYE, the fork guard, the disabled state and ``last_error``. The STEP itself is
``dspark_client.exchange``: the link hands it a ready connection with its session and epoch
(``connection``, then ``take_seq`` under ``io_lock``), and the exchange tells the link what a
reply or a refusal means for it (``mark_failed``, ``disable``, ``drained``, ``reply_failed``,
``replies_recovered``, ``newer_drafter``). Neither reads the other's state.

Threads and locks. The engine thread steps and never connects or waits past ``timeout_ms``. A
daemon thread owns connect + HELLO and hands a ready connection over under ``lock``; every
accepted HELLO starts a new epoch, and STEP entries built for an older epoch are refused unsent
(7.5). ``lock`` guards session, seq, epoch, the connection and ``ready`` (held for a few field
reads or writes, never across I/O). ``io_lock`` keeps one request at a time on the connection
(the exchange's STEP, GOODBYE, PING/STATS/RESET, a move's GOODBYE, a drafter follow); when both
are taken, ``io_lock`` comes first. The worker set (``dspark_client.workers.WorkerSet``:
discovery, placement, the failure counters) and the backoff are the connect thread's alone; the
engine thread hands the set a drained endpoint through one field. The thread holds only a weak
reference to the link between attempts (the pattern of vLLM's ``BackgroundResources``): a link
that the engine drops is collected, and a ``weakref.finalize`` then stops the thread and closes
the connection.

HELLO. A fatal frame status (section 5) or a reply that does not match this engine disables
remote drafting for the engine run; a HELLO refused ST_STALE_SEQ (the id is held with a higher
seq: taken over or replayed) moves the link to a new random session id (7.5).

Workers. The endpoints name a set of workers (static, or ``dns+tcp://name:port`` resolved on
the connect thread, ``discovery``); the link works with the best-ranked one for its client
name by rendezvous hashing (``placement``), fails over to the next after repeated failed
connects, leaves a worker that answers ST_DRAINING at once, and moves to a better-ranked
worker that became eligible by connecting there before it swaps. Every move is a new session
and a new epoch.

Fork. Threads do not survive ``fork()`` and the lock may be held at that moment, so a link
used from a process other than the one that made it refuses to run (``disabled_reason`` says
so).

Shared-memory rows (section 13). With a ``unix+shm://`` endpoint the link makes one sealed
memfd for the run (``dspark_client.shm``) and, after each accepted HELLO whose reply offers
``CAP_SHM_ROWS``, attaches it to the connection (OFFER, then MAP with the descriptor); any
refusal of the attach means rows on the socket for that connection (``rows_in_shm_on``).

One piece at about 900 lines (the worker set and the HELLO reply's checks live apart, in
``workers`` and ``hello_check``): connect, move, follow, drop and close each change the same
fields (connection, session, epoch, ready) under the same two locks in the same order, and
read apart they would hide that protocol, which is what a change here must keep.
"""

from __future__ import annotations

import functools
import logging
import math
import random
import secrets
import threading
import time
import weakref
from collections.abc import Callable
from typing import Final

import msgspec
import numpy as np
import numpy.typing as npt

from protocol import wire
from protocol.auth import sign_hello
from protocol.constants import CAP_SHM_ROWS, IDENTITY_BYTES

from .acceptance import ClientAcceptance
from .config import RemoteConfig
from .discovery import Resolver, is_dns_endpoint
from .hello_check import limits_hint, reply_problems
from .shm import ShmRegion, shm_available
from .shm import attach as shm_attach
from .stats import Stats
from .transport import (
    RpcClient,
    TransportError,
    TransportTimeout,
    make_client,
    parse_endpoint,
    process_id,
)
from .workers import CONNECT_FAIL_LOG_S, WorkerSet

__all__ = ["CONNECT_FAIL_LOG_S", "GOODBYE_TIMEOUT_S", "WorkerLink"]

log = logging.getLogger("dspark_client")

# Reply buffer of a request other than STEP (PING, RESET, STATS JSON); it grows when needed.
AUX_REPLY_BYTES: Final = 1 << 16
# close() waits this long at most for the worker to answer GOODBYE: the worker frees the
# session's slots at once instead of after its idle time, but closing never hangs on it.
GOODBYE_TIMEOUT_S: Final = 0.5
# The HELLO reply buffer: a HelloReply fits many times over.
HELLO_REPLY_BYTES: Final = 1 << 12
# While connected, the thread wakes for re-resolution and placement changes no more often
# than this.
MIN_TICK_S: Final = 0.01


class _WorkerDraining(wire.WireError):
    """The worker answered ST_DRAINING: go to another one now; not a failure."""


class _Shared:
    """State the connect thread and the finalizer share with the link. It holds no reference
    to the link, so the thread never keeps the link alive."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.ready_event = threading.Event()
        self.stop = False
        self.conn: RpcClient | None = None


def _shutdown(shared: _Shared) -> None:
    """The finalizer: stop the thread and close the connection (no reference to the link)."""
    shared.stop = True
    shared.wake.set()
    conn, shared.conn = shared.conn, None
    if conn is not None:
        conn.close()


def _connect_loop(ref: weakref.ReferenceType[WorkerLink], shared: _Shared) -> None:
    while not shared.stop:
        shared.wake.clear()  # before looking at the state: a wake after this is never lost
        link = ref()
        if link is None:
            return
        try:
            wait = link._background_tick()
        except Exception as exc:  # the thread must survive a bug in one attempt
            log.exception("remote DSpark: connect thread error")
            link.last_error = f"connect thread error: {type(exc).__name__}: {exc}"
            wait = 1.0
        finally:
            del link
        if wait is None:
            return
        shared.wake.wait(None if math.isinf(wait) else wait)


class WorkerLink:
    """One engine run's link to one draft worker at a time, out of the set its endpoints name
    (the arguments are ``RemoteDraftClient``'s, which makes it; ``stats`` and ``acceptance``
    are shared with the exchange).

    ``hello`` is what this engine sends: geometry, identities, client name. The auth tag is
    computed here for each HELLO when ``cfg`` has a secret. ``resolver``: ``(name, port) ->
    addresses`` for ``dns+tcp`` endpoints instead of ``socket.getaddrinfo``."""

    def __init__(
        self,
        cfg: RemoteConfig,
        hello: wire.Hello,
        stats: Stats,
        acceptance: ClientAcceptance,
        *,
        transport_factory: Callable[..., RpcClient] | None = None,
        background: bool = True,
        session: int | None = None,
        resolver: Resolver | None = None,
    ) -> None:
        if session is not None and not 0 < session <= 0xFFFFFFFF:
            raise ValueError(f"session {session} outside 1..2**32-1")
        self.cfg = cfg
        self.hello = hello.without_auth()
        if cfg.follow_drafter:  # 6.5: no identities, the worker's newest drafter
            self.hello = msgspec.structs.replace(
                self.hello, flags=self.hello.flags | wire.HF_FOLLOW,
                drafter_identity=bytes(IDENTITY_BYTES),
                markov_identity=bytes(IDENTITY_BYTES))
        # A reply said the worker serves a newer drafter (RPF_NEWER_DRAFTER): the connect
        # thread moves the session to it; not before _follow_hold_until after a refusal.
        self._follow_wanted = False
        self._follow_hold_until = 0.0
        self.stats = stats
        self.acceptance = acceptance
        self._factory: Callable[..., RpcClient] = transport_factory or functools.partial(
            make_client, max_reply_bytes=cfg.max_reply_bytes)
        self._secret = cfg.secret()
        self.session = session or secrets.randbits(32) or 1
        self._shared = _Shared()
        self.lock = self._shared.lock  # guards session, seq, epoch, conn, ready
        self.io_lock = threading.Lock()  # one request at a time on the connection
        self._pid = process_id()
        self._seq = 0
        self._ready = False
        self.epoch = 0  # accepted HELLOs so far
        self.disabled_reason: str | None = None
        self.worker_info: wire.HelloReply | None = None
        self.reply_no_confidence = 0  # RPF_NO_CONFIDENCE as the worker's replies must carry it
        self._last_error: str | None = None
        self.last_refusal: int | None = None  # frame status of the last non-fatal HELLO refusal
        # The worker set and where in it to be; only the connect thread touches it (the
        # engine thread hands a drained endpoint over through its ``drained``).
        self._workers = WorkerSet(cfg, hello.client_name, stats, resolver)
        self._endpoint = self._workers.target(time.monotonic()) or cfg.endpoint
        self._session_endpoint: str | None = None  # where the current session was accepted
        self._rng = random.Random(secrets.randbits(64))
        self._backoff_ms = cfg.backoff_ms
        self._next_attempt = 0.0
        # Rounds in a row whose reply failed its checks or was ST_INTERNAL: while it is not 0
        # an accepted HELLO does not reset the backoff (a worker whose every reply is wrong,
        # e.g. NaN weights, is not re-HELLOed many times a second), a good reply does.
        self.failing_replies = 0
        self._aux = bytearray(AUX_REPLY_BYTES)
        # Section 13: one region for the run, attached to each connection to a unix+shm://
        # endpoint whose worker offers CAP_SHM_ROWS; _shm_conn is the connection it is attached
        # to (None: rows go on the socket).
        self._shm: ShmRegion | None = None
        self._shm_conn: RpcClient | None = None
        if any(not is_dns_endpoint(ep) and parse_endpoint(ep).shm for ep in cfg.all_endpoints):
            if shm_available():
                self._shm = ShmRegion(hello.max_rows_per_step * hello.row_bytes)
            else:
                log.warning("remote DSpark: unix+shm endpoints need memfd_create (Linux);"
                            " rows go on the socket")
        self.thread: threading.Thread | None = None
        self._finalizer = weakref.finalize(self, _shutdown, self._shared)
        if background:
            self.start_background()

    def start_background(self) -> None:
        if self.thread is None:
            self.thread = threading.Thread(
                target=_connect_loop, args=(weakref.ref(self), self._shared),
                name="dspark-client-connect", daemon=True)
            self.thread.start()

    # -- state ----------------------------------------------------------------------------------
    @property
    def sampled(self) -> bool:
        return self.hello.sample_mode == wire.SAMPLE_TOP32

    @property
    def ready(self) -> bool:
        return self._ready and self.disabled_reason is None

    @property
    def has_confidence(self) -> bool | None:
        """Whether the worker's drafter has a confidence head (contract 6.1,
        ``CAP_NO_CONFIDENCE``): None until a HELLO is accepted. False (a DFlash drafter): every
        reply says so (``RPF_NO_CONFIDENCE``, ``RoundResult.has_confidence``), its confidences
        are 1.0 and predict nothing: verify a static number of drafts, not a confidence-
        scheduled one, and read no predicted acceptance into them."""
        rep = self.worker_info
        return None if rep is None else not rep.capabilities & wire.CAP_NO_CONFIDENCE

    @property
    def disabled(self) -> bool:
        return self.disabled_reason is not None

    @property
    def last_error(self) -> str | None:
        """Why the client is not drafting, or last failed to: once disabled, the reason it was
        disabled (a refused HELLO, a reply that does not match, a fork: ``disabled_reason``),
        else the latest failure (a connect, a retryable refusal such as BUSY, a lost
        session, a draining worker); None before any."""
        if self.disabled_reason is not None:
            return f"remote drafting disabled: {self.disabled_reason}"
        return self._last_error

    @last_error.setter
    def last_error(self, reason: str | None) -> None:
        self._last_error = reason

    @property
    def endpoint(self) -> str:
        """The endpoint the next connect tries (the current one while connected); a
        ``dns+tcp`` endpoint until its first resolution."""
        return self._endpoint

    @property
    def workers(self) -> list[str]:
        """The worker set as last resolved, in this client's order of preference."""
        return self._workers.members

    def wait_ready(self, timeout: float) -> bool:
        """Block until a HELLO is accepted or the client is disabled (tools and tests; the
        engine never waits)."""
        deadline = time.monotonic() + timeout
        while True:
            if self.disabled:
                return False
            if self.ready:
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self._shared.ready_event.wait(min(left, 0.05))

    def connection_epoch(self) -> int | None:
        """The epoch of the ready connection, or None when there is none (one read under the
        lock, so ready and epoch belong to the same connection)."""
        if self.forked():
            return None
        with self.lock:
            return self.epoch if self._ready and self.disabled_reason is None else None

    def next_seq(self) -> int:
        with self.lock:
            self._seq += 1
            return self._seq

    def forked(self) -> bool:
        if self._pid == process_id():
            return False
        if self.disabled_reason is None:
            # No lock here: the parent's thread may have held it at fork time.
            self.disabled_reason = (f"client made in pid {self._pid} used in pid"
                                    f" {process_id()} after fork; make a new client in this"
                                    " process")
            self._ready = False
        return True

    def close(self) -> None:
        """Say GOODBYE (best effort: the worker frees this session's slots now rather than
        after its idle time), stop the connect thread and close the connection. Idempotent."""
        if self._pid == process_id():
            self._goodbye()
        self._ready = False
        self._shared.ready_event.clear()
        self.stats.set("connected", False)
        if self._pid == process_id():
            with self.lock:
                self._ready = False
                self._finalizer()
        else:
            self._shared.stop = True

    def _goodbye(self) -> None:
        """One GOODBYE on the ready connection, waiting at most GOODBYE_TIMEOUT_S; any failure
        is ignored (the worker still drops the session after session_idle_s)."""
        with self.lock:
            conn = self._shared.conn if self._ready and self.disabled_reason is None else None
            session = self.session
        if conn is None:
            return
        timeout = min(GOODBYE_TIMEOUT_S, self.cfg.timeout_ms / 1000.0)
        if not self.io_lock.acquire(timeout=timeout):
            return
        try:
            self._goodbye_on(conn, session, timeout)
        finally:
            self.io_lock.release()

    def _goodbye_on(self, conn: RpcClient, session: int, timeout: float) -> None:
        """GOODBYE for ``session`` on ``conn``; the caller holds ``_io_lock`` (no request in
        flight on it). Failures are logged at debug level and otherwise ignored."""
        try:
            seq = self.next_seq()
            n = conn.request(wire.goodbye_frame(seq, session), self._aux, timeout)
            h, _ = wire.split_frame(memoryview(self._aux)[:n])
            if h.status == wire.ST_OK:
                self.stats.inc("goodbyes")
            else:
                log.debug("remote DSpark: GOODBYE answered %s",
                          wire.FRAME_STATUS_NAMES.get(h.status, h.status))
        except (TransportError, wire.WireError, OSError) as e:
            log.debug("remote DSpark: GOODBYE failed: %s", e)

    def disable(self, reason: str) -> None:
        """Stop remote drafting for this engine run (every round is target-only from now)."""
        self.disabled_reason = reason
        self.stats.inc("remote_disabled")
        self.stats.set("disabled_reason", reason)
        log.error("remote DSpark disabled for this engine run: %s", reason)
        with self.lock:
            self._drop_conn_locked()
        self._shared.wake.set()

    def _drop_conn_locked(self) -> None:
        conn, self._shared.conn = self._shared.conn, None
        self._shm_conn = None
        if conn is not None:
            conn.close()
        self._ready = False
        self._shared.ready_event.clear()
        self.stats.set("connected", False)

    def new_session(self, reason: str) -> None:
        """Start a new session and reconnect at once. The HELLO with the new session id makes
        the worker drop every window of the old one (same client name, 6.2); the epoch change
        then resyncs every live slot from rank 0's ring. For a worker state that no longer
        matches rank 0's (RS_STALE_GENERATION, 7.1)."""
        if self.forked():
            return
        with self.lock:  # one critical section: no reader sees the new id on the old connection
            old = new = self.session
            while new in (old, 0):
                new = secrets.randbits(32)
            self.session = new
            self._drop_locked(backoff=False)
        self.last_error = f"new session: {reason}"
        self.stats.inc("new_sessions")
        self.stats.inc("disconnects")
        log.error("remote DSpark: new session %#010x (was %#010x): %s", new, old, reason)
        self._shared.wake.set()

    def mark_failed(self, reason: str, *, backoff: bool = True) -> None:
        """Drop the connection; the connect thread reconnects (after a backoff delay unless
        ``backoff`` is False)."""
        if self.forked():
            return
        self.last_error = reason
        with self.lock:
            self._drop_locked(backoff=backoff)
        self.stats.inc("disconnects")
        self._shared.wake.set()

    def _drop_locked(self, *, backoff: bool) -> None:
        self._drop_conn_locked()
        if backoff:
            self.schedule_retry_locked()
        else:
            self._next_attempt = time.monotonic()

    def schedule_retry_locked(self) -> float:
        """Next attempt after the current backoff (with jitter); double the backoff, capped."""
        base = self._backoff_ms
        jitter = self.cfg.jitter
        delay_ms = base * (1.0 + jitter * (2.0 * self._rng.random() - 1.0))
        self._next_attempt = time.monotonic() + delay_ms / 1000.0
        self._backoff_ms = min(base * 2.0, self.cfg.backoff_max_ms)
        return delay_ms / 1000.0

    # -- connect ----------------------------------------------------------------------------------
    def _signed_hello(self, session: int, seq: int) -> wire.Hello:
        return sign_hello(self._secret, session, seq, self.hello)

    def connect_now(self) -> bool:
        """Connect and HELLO once (the connect thread calls this; tools may call it directly
        with ``background=False``). True when a HELLO was accepted."""
        if self.disabled or self.forked():
            return False
        timeout = self.cfg.connect_timeout_ms / 1000.0
        now = time.monotonic()
        self._workers.take_drained(now)
        self._workers.refresh(now)
        target = self._workers.target(now)
        if target is None:
            self._connect_failed(self.endpoint, TransportError(
                f"no worker address resolved ({self._workers.resolve_error or 'empty answer'})"))
            return False
        endpoint = self._endpoint = target
        if self._session_endpoint is not None and endpoint != self._session_endpoint:
            # Another worker: a new session id, so that a worker we come back to later never
            # resumes windows that went stale meanwhile (every slot resyncs after the HELLO).
            with self.lock:
                self.session = self._fresh_session_locked()
            self._session_endpoint = None
        conn: RpcClient | None = None
        with self.lock:
            session = self.session
        deadline = time.monotonic() + timeout
        try:
            conn = self._factory(endpoint)
            conn.connect(timeout)
            # One deadline for connect and HELLO together.
            rep = self._hello_on(conn, session, max(deadline - time.monotonic(), 1e-3))
            if rep is None:
                conn.close()
                return False
            shm_ok = self._attach_shm(conn, endpoint, rep, session,
                                      max(deadline - time.monotonic(), 1e-3))
        except _WorkerDraining:
            if conn is not None:
                conn.close()
            self._worker_draining(endpoint, "HELLO")
            return False
        except (TransportError, wire.WireError, OSError) as e:
            if conn is not None:
                conn.close()
            self._connect_failed(endpoint, e)
            return False
        with self.lock:
            if self._shared.stop:  # closed meanwhile: never hand a connection to a dead client
                conn.close()
                return False
            stale = session != self.session  # new_session() ran meanwhile
            if not stale:
                self._drop_conn_locked()
                self._shared.conn = conn
                self._shm_conn = conn if shm_ok else None
                self._ready = True
                self.epoch += 1
                epoch = self.epoch
                self.stats.set("connected", True)  # under the lock, as the drop is
                self.stats.set("epoch", epoch)
                if not self.failing_replies:  # else the next good reply resets it
                    self._backoff_ms = self.cfg.backoff_ms
        if stale:  # HELLO again at once under the new id
            conn.close()
            return self.connect_now()
        self._session_endpoint = endpoint
        self._workers.connected(endpoint)
        self._shared.ready_event.set()
        self._worker_accepted(rep, endpoint)
        self.stats.inc_many({"hellos": 1, "reconnects": int(epoch > 1)})
        failed, self._workers.fail_run = self._workers.fail_run, 0
        log.info("remote DSpark worker %r ready at %s (session %#010x, epoch %d)%s%s",
                 rep.worker_name, endpoint, session, epoch,
                 f" after {failed} failed connect attempts" if failed else "",
                 "; its drafter has no confidence head (confidences predict nothing: verify a"
                 " static length)" if rep.capabilities & wire.CAP_NO_CONFIDENCE else "")
        return True

    def _hello_on(self, conn: RpcClient, session: int, timeout: float) -> wire.HelloReply | None:
        """HELLO on a fresh connection. Returns the reply when accepted, None when refused
        fatally (the client is then disabled); raises WireError for a refusal to retry."""
        seq = self.next_seq()
        hello = self._signed_hello(session, seq)
        msg = wire.frame(wire.OP_HELLO, seq, session, hello.pack())
        buf = bytearray(HELLO_REPLY_BYTES)
        n = conn.request(msg, buf, timeout)
        h, body = wire.split_frame(memoryview(buf)[:n])
        if h.op != wire.OP_HELLO or h.seq != seq or h.session != session:
            raise wire.WireError(f"HELLO reply echoes op={h.op} seq={h.seq} session="
                                 f"{h.session:#x}; sent op={wire.OP_HELLO} seq={seq} session="
                                 f"{session:#x}")
        rep = wire.HelloReply.unpack(body) if len(body) == wire.HELLO_REP.size else None
        if h.status != wire.ST_OK:
            name = wire.FRAME_STATUS_NAMES.get(h.status, str(h.status))
            if h.status in wire.FATAL_FRAME_STATUS:
                problems = [] if rep is None else reply_problems(self.hello, rep)
                self.disable(f"HELLO refused: {name}"
                             + (f" ({'; '.join(problems)})" if problems else "")
                             + (limits_hint(self.hello) if h.status == wire.ST_LIMITS else ""))
                return None
            self.last_refusal = h.status
            if h.status == wire.ST_STALE_SEQ:
                self._session_taken(session)
            if h.status == wire.ST_DRAINING:
                raise _WorkerDraining("HELLO refused: DRAINING")
            raise wire.WireError(f"HELLO refused: {name}")
        if rep is None:
            raise wire.WireError(f"HELLO reply body is {len(body)} bytes, not"
                                 f" {wire.HELLO_REP.size}")
        problems = reply_problems(self.hello, rep)
        if problems:
            self.disable("HELLO reply does not match this engine: " + "; ".join(problems))
            return None
        return rep

    def _worker_accepted(self, rep: wire.HelloReply, endpoint: str) -> None:
        """An accepted HELLO's reply: what the worker is and which drafter serves us."""
        self.worker_info = rep
        self.acceptance.set_has_confidence(not rep.capabilities & wire.CAP_NO_CONFIDENCE)
        # What every reply's RPF_NO_CONFIDENCE bit must then be (checked per STEP).
        self.reply_no_confidence = (wire.RPF_NO_CONFIDENCE
                                     if rep.capabilities & wire.CAP_NO_CONFIDENCE else 0)
        self.stats.set("worker", {"name": rep.worker_name, "endpoint": endpoint,
                                  "max_slots": rep.max_slots,
                                  "max_rows_per_step": rep.max_rows_per_step,
                                  "capabilities": rep.capabilities, "resumed": rep.resumed,
                                  "drafter_identity": rep.drafter_identity.hex(),
                                  "markov_identity": rep.markov_identity.hex()})

    @property
    def follows(self) -> bool:
        """The session asks for whatever drafter the worker serves (HF_FOLLOW, 6.5)."""
        return bool(self.hello.flags & wire.HF_FOLLOW)

    def _session_taken(self, session: int) -> None:
        """HELLO refused ST_STALE_SEQ: the worker holds this session id with a higher seq than
        ours, so someone else HELLOed with it (a takeover, or a replay). Our seq can never
        catch up with theirs: the next attempt uses a new random id (an empty session, so
        every slot resyncs)."""
        with self.lock:
            if self.session != session:
                return
            new = session
            while new in (session, 0):
                new = secrets.randbits(32)
            self.session = new
        self.stats.inc("new_sessions")
        self.stats.inc("hello_stale_seq_total")
        log.warning("remote DSpark: HELLO for session %#010x refused STALE_SEQ (another"
                    " connection holds it with a higher seq); starting session %#010x",
                    session, new)

    def _attach_shm(self, conn: RpcClient, endpoint: str, rep: wire.HelloReply, session: int,
                    timeout: float) -> bool:
        """Attach the rows region to a fresh connection (13.2) when the endpoint asks for it and
        the worker offers it. A refusal is no failure: rows go on the socket."""
        region = self._shm
        if region is None or not parse_endpoint(endpoint).shm:
            return False
        if not rep.capabilities & CAP_SHM_ROWS:
            self._shm_fallback(f"worker {rep.worker_name!r} at {endpoint} does not offer"
                               " shared-memory rows (CAP_SHM_ROWS)")
            return False
        ok, why = shm_attach(conn, region, session, self.next_seq, timeout)
        if not ok:
            self._shm_fallback(why)
            return False
        self.stats.inc("shm_attached")
        self.stats.set("rows_transport", "shm")
        return True

    def _shm_fallback(self, why: str) -> None:
        self.stats.inc("shm_fallbacks")
        self.stats.set("rows_transport", "socket")
        self.stats.set("shm_fallback_reason", why)
        log.warning("remote DSpark: rows go on the socket: %s", why)

    @property
    def rows_in_shm(self) -> bool:
        """Whether the ready connection takes STEP rows from the shared-memory region."""
        return self._shm_conn is not None and self._shm_conn is self._shared.conn

    def rows_buffer(self, n: int) -> npt.NDArray[np.uint8]:
        """``uint8 [n, row_bytes]`` to write a STEP's rows into: on a ``unix+shm://`` endpoint a
        view of the shared-memory region (the same memory for the whole run, across
        reconnects), so a ``step(rows=...)`` of it sends no row bytes at all; elsewhere a plain
        array. Rows written here must stay untouched until that STEP's ``step()`` returns.
        An engine can page-lock it for its device-to-host copy once (docs/operations.md)."""
        if not 0 <= n <= self.hello.max_rows_per_step:
            raise ValueError(f"{n} rows: not in 0..max_rows_per_step"
                             f" {self.hello.max_rows_per_step}")
        if self._shm is None:
            return np.empty((n, self.hello.row_bytes), np.uint8)
        return self._shm.rows(n, self.hello.row_bytes)

    @property
    def shm_region(self) -> ShmRegion | None:
        """The run's region (None without a ``unix+shm://`` endpoint)."""
        return self._shm

    def _fresh_session_locked(self) -> int:
        new = self.session
        while new in (self.session, 0):
            new = secrets.randbits(32)
        return new

    # -- the worker set (connect thread only) ------------------------------------------------------
    def _worker_draining(self, endpoint: str, where: str) -> None:
        self.last_error = self._workers.draining(endpoint, where)

    def _connect_failed(self, endpoint: str, e: BaseException) -> None:
        self.last_error = self._workers.connect_failed(endpoint, e)

    def _while_connected(self) -> float:
        """Re-resolve and move to a better-ranked worker when one became eligible; seconds
        until this is worth doing again."""
        workers = self._workers
        if not workers.dynamic and len(workers.members) < 2:
            return math.inf
        now = time.monotonic()
        workers.take_drained(now)
        workers.refresh(now)
        better = workers.better(self._endpoint, now)
        if better is not None:
            self._move_to(better)
            now = time.monotonic()
        return max(workers.next_change(now), MIN_TICK_S)

    def _move_to(self, target: str) -> bool:
        """Connect and HELLO to ``target`` under a new session while the engine keeps stepping
        on the current connection; swap only when the HELLO is accepted (a new epoch: every
        slot resyncs there). A refusal or failure holds ``target`` off for the quiet period."""
        timeout = self.cfg.connect_timeout_ms / 1000.0
        with self.lock:
            session = self._fresh_session_locked()
        old = self._endpoint
        conn: RpcClient | None = None
        deadline = time.monotonic() + timeout
        try:
            conn = self._factory(target)
            conn.connect(timeout)
            rep = self._hello_on(conn, session, max(deadline - time.monotonic(), 1e-3))
            shm_ok = rep is not None and self._attach_shm(
                conn, target, rep, session, max(deadline - time.monotonic(), 1e-3))
        except (TransportError, wire.WireError, OSError) as e:
            if conn is not None:
                conn.close()
            self._workers.hold(target, time.monotonic())
            self.stats.inc("move_failures")
            log.info("remote DSpark: staying on %s; %s did not take us: %s", old, target, e)
            return False
        if rep is None:  # refused fatally: the client is disabled
            conn.close()
            return False
        # Swap with no request in flight on the old connection: closing it under a STEP would
        # fail that STEP, and its failure would then drop the new connection.
        if not self.io_lock.acquire(timeout=2 * self.cfg.timeout_ms / 1000.0 + 1.0):
            conn.close()
            self._workers.hold(target, time.monotonic())  # try again after a quiet period
            return False
        try:
            with self.lock:
                left = self._shared.conn if self._ready else None
                left_session = self.session
            if left is not None:
                # Free the lanes we leave behind now, not after the old worker's idle time.
                self._goodbye_on(left, left_session,
                                 min(GOODBYE_TIMEOUT_S, self.cfg.timeout_ms / 1000.0))
            with self.lock:
                if self._shared.stop or self.disabled:
                    conn.close()
                    return False
                self._drop_conn_locked()
                self._shared.conn = conn
                self._shm_conn = conn if shm_ok else None
                self.session = session
                self._ready = True
                self.epoch += 1
                epoch = self.epoch
                if not self.failing_replies:
                    self._backoff_ms = self.cfg.backoff_ms
                self._endpoint = self._session_endpoint = target
        finally:
            self.io_lock.release()
        self._workers.connected(target)
        self._shared.ready_event.set()
        self._worker_accepted(rep, target)
        self.stats.inc_many({"hellos": 1, "moves": 1})
        log.info("remote DSpark: moved from %s to %s, worker %r (session %#010x, epoch %d)",
                 old, target, rep.worker_name, session, epoch)
        return True

    def _follow_drafter(self) -> None:
        """Move to the drafter the worker now serves new HELLOs with (6.5): on the same
        connection, between two STEPs, HELLO a new session (the worker drops the old one of
        the same client name first, so its slots are free for the new one) and swap. A new
        epoch: every live slot resyncs once. A refusal leaves the old session serving; the
        next try comes after the quiet period."""
        self._follow_wanted = False
        timeout = self.cfg.connect_timeout_ms / 1000.0
        if not self.io_lock.acquire(timeout=timeout):
            self._follow_wanted = True
            return
        try:
            with self.lock:
                conn = self._shared.conn if self._ready else None
                old, new = self.session, self._fresh_session_locked()
            if conn is None:
                return
            endpoint = self._endpoint
            try:
                if not self.hello.client_name:  # nothing replaces the old one: release it
                    self._goodbye_on(conn, old, timeout)
                rep = self._hello_on(conn, new, timeout)
                if rep is None:  # refused fatally: the client is disabled
                    return
                shm_ok = self._attach_shm(conn, endpoint, rep, new, timeout)
            except _WorkerDraining:
                self._worker_draining(endpoint, "HELLO")
                self.mark_failed(f"{endpoint} is draining", backoff=False)
                return
            except wire.WireError as e:  # refused (BUSY ...): nothing changed on the worker
                self._follow_hold_until = time.monotonic() + self.cfg.return_after_ms / 1000
                self.stats.inc("drafter_follow_failures")
                log.warning("remote DSpark: staying on the drafter of session %#010x: %s", old,
                            e)
                if not self.hello.client_name:  # the old one was released: HELLO again
                    self.mark_failed(f"drafter follow: {e}")
                return
            except (TransportError, OSError) as e:
                self.mark_failed(f"drafter follow: {e}")
                return
            with self.lock:
                if self._shared.stop or self.disabled or self._shared.conn is not conn:
                    return
                self.session = new
                self._shm_conn = conn if shm_ok else None
                self.epoch += 1
                epoch = self.epoch
                self.stats.set("epoch", epoch)
        finally:
            self.io_lock.release()
        self._worker_accepted(rep, endpoint)
        self.stats.inc_many({"hellos": 1, "drafter_follows": 1})
        log.info("remote DSpark: worker %r serves another drafter (%s..); session %#010x (was"
                 " %#010x) follows it, epoch %d: every slot resyncs once", rep.worker_name,
                 rep.drafter_identity.hex()[:16], new, old, epoch)

    def _background_tick(self) -> float | None:
        """One pass of the connect thread: seconds to sleep (inf: until woken), or None to
        end the thread."""
        if self.disabled or self._shared.stop:
            return None
        if self._ready:
            if self._follow_wanted:
                self._follow_drafter()
            return self._while_connected()
        delay = self._next_attempt - time.monotonic()
        if delay > 0:
            return delay
        if self.connect_now():
            return self._while_connected()
        if self.disabled:
            return None
        if self._workers.retry_now:  # a draining worker: the next one at once
            self._workers.retry_now = False
            return 0.0
        with self.lock:
            return self.schedule_retry_locked()

    # -- what the exchange asks of the link (engine thread) ----------------------------------------
    @property
    def conn(self) -> RpcClient | None:
        """The current connection (None when there is none; it may not be ready yet)."""
        return self._shared.conn

    def connection(self) -> tuple[RpcClient | None, int, int]:
        """The ready connection (None when there is none), its session and its epoch, read
        together under the lock."""
        with self.lock:
            return (self._shared.conn if self._ready else None), self.session, self.epoch

    def take_seq(self, conn: RpcClient, session: int) -> int | None:
        """The seq of the next request on ``conn`` under ``session``, or None when the link has
        left either since ``connection()`` gave them (the caller holds ``io_lock``)."""
        with self.lock:
            if self._shared.conn is not conn or self.session != session:
                return None
            self._seq += 1
            return self._seq

    def rows_in_shm_on(self, conn: RpcClient) -> bool:
        """Whether ``conn`` takes STEP rows from the shared-memory region."""
        return conn is self._shm_conn

    def drained(self, reason: str) -> None:
        """A STEP answered ST_DRAINING: not applied, the worker is going away. The connect
        thread holds it off and connects to the next-ranked worker at once (no backoff, not a
        failure)."""
        self._workers.drained = endpoint = self._endpoint
        self.stats.inc("drained")
        self.mark_failed(f"{reason} ({endpoint})", backoff=False)

    def reply_failed(self) -> None:
        """A reply failed its checks or was ST_INTERNAL: until a good one, an accepted HELLO
        keeps the backoff (a worker whose every reply is wrong is not re-HELLOed many times a
        second)."""
        self.failing_replies += 1

    def replies_recovered(self) -> None:
        """A good reply after failing ones: the backoff starts over."""
        self.failing_replies = 0
        with self.lock:
            self._backoff_ms = self.cfg.backoff_ms

    def newer_drafter(self) -> None:
        """A reply said the worker serves a newer drafter (RPF_NEWER_DRAFTER): the connect
        thread moves the session to it, unless a refusal holds that off."""
        if not self._follow_wanted and time.monotonic() >= self._follow_hold_until:
            self._follow_wanted = True
            self._shared.wake.set()

    # -- tools ------------------------------------------------------------------------------------
    def simple_request(self, op: int, body: bytes = b"") -> tuple[int, bytes]:
        """PING / STATS / RESET on the engine's connection (not on the hot path). Returns the
        frame status and the reply body."""
        if self.forked():
            raise TransportError(self.disabled_reason or "forked")
        with self.lock:
            conn = self._shared.conn if self._ready else None
            session = self.session
        if conn is None:
            raise TransportError(f"not connected to {self.endpoint}"
                                 + (f" ({self.last_error})" if self.last_error else ""))
        timeout = self.cfg.timeout_ms / 1000.0
        if not self.io_lock.acquire(timeout=timeout):
            raise TransportTimeout("the connection stayed busy with another request")
        try:
            seq = self.next_seq()
            msg = wire.frame(op, seq, session, body)
            try:
                n = conn.request(msg, self._aux, timeout)
            except TransportError as e:
                self.mark_failed(f"{wire.AppHeader(op=op).op_name}: {e}")
                raise
            h, rb = wire.split_frame(memoryview(self._aux)[:n])
            if h.op != op or h.seq != seq:
                self.mark_failed("reply does not echo the request")
                raise wire.WireError(f"reply echoes op={h.op} seq={h.seq}; sent op={op}"
                                     f" seq={seq}")
            return h.status, bytes(rb)
        finally:
            self.io_lock.release()

    def describe(self) -> str:
        """Endpoint, session, epoch and state, for a repr."""
        state = ("disabled" if self.disabled else "ready" if self.ready else "connecting")
        return f"{self.endpoint!r}, session={self.session:#010x}, epoch={self.epoch}, {state}"

    def __repr__(self) -> str:
        return f"WorkerLink({self.describe()})"
