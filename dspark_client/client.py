"""Rank 0's client of a draft worker: session, seq, HELLO, background reconnect, and the STEP
exchange with every reply check of the contract (docs/contract.md sections 5, 6, 7.5 and 9).

Threads. The engine thread calls ``step()``; it never connects and never waits past
``timeout_ms``. A daemon thread owns connect + HELLO (capped exponential backoff with jitter)
and hands a ready connection over under the lock; every accepted HELLO starts a new epoch, and
STEP entries built for an older epoch are refused unsent (7.5). The thread holds only a weak
reference to the client between attempts (the pattern of vLLM's ``BackgroundResources``): a
client that the engine drops is collected, and a ``weakref.finalize`` then stops the thread
and closes the connection.

Replies. A STEP reply is accepted only if it echoes op, session, seq, step_id and every
generation; its shape matches the STEP; its values keep section 6.3
(``protocol.validate.check_reply_values``); and, on a sampled session, its proposals keep
section 9.2 and every draw re-derives from (seed, generation, position) (section 9.3; both in
one pass, ``protocol.sampled.check_reply``). A refused reply fails the round: the connection
is dropped and every slot of the STEP resyncs. A fatal frame status (section 5) disables remote
drafting for the engine run, except ST_BAD_FRAME on a STEP over ``SIZE_SUSPECT_BYTES``, which
may be the worker's frame limit: that round fails and ``DraftRounds`` lowers its row budget. A
HELLO refused ST_STALE_SEQ (the id is held with a higher seq: taken over or replayed) moves the
client to a new random session id (7.5).

Workers. The endpoints name a set of workers (static, or ``dns+tcp://name:port`` resolved on
the connect thread, ``discovery``); the client works with the best-ranked one for its client
name by rendezvous hashing (``placement``), fails over to the next after repeated failed
connects, leaves a worker that answers ST_DRAINING at once, and moves to a better-ranked
worker that became eligible by connecting there before it swaps (docs/operations.md,
"Placement"). Every move is a new session and a new epoch.

Fork. Threads do not survive ``fork()`` and the lock may be held at that moment, so a client
used from a process other than the one that made it refuses to run (``disabled_reason`` says
so): make a new client, with its own ``client_name``, in the child.

Reply arrays returned by ``step()`` are numpy views over the client's reply buffer: they stay
valid until the next ``step()`` of this client.

Shared-memory rows (section 13). With a ``unix+shm://`` endpoint the client makes one sealed
memfd for the run (``dspark_client.shm``) and, after each accepted HELLO whose reply offers
``CAP_SHM_ROWS``, attaches it to the connection (OFFER, then MAP with the descriptor). STEPs on
such a connection carry ``SF_ROWS_SHM`` and the rows' offset instead of the rows: rows passed
to ``step()`` that lie in the region (``rows_buffer``) are sent as they are, other rows are
copied into it first. Any refusal of the attach means rows on the socket for that connection.
"""

from __future__ import annotations

import functools
import logging
import math
import operator
import random
import secrets
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final, cast

import msgspec
import numpy as np
import numpy.typing as npt

from protocol import wire
from protocol.auth import sign_hello
from protocol.constants import CAP_SHM_ROWS, IDENTITY_BYTES, STEP_HEADER_SIZE
from protocol.messages import ENTRY_DTYPE, SampleMeta, reply_layout
from protocol.sampled import ReplyCheck, Scratch
from protocol.shm import ROWS_ALIGN, set_rows_at
from protocol.validate import ValuesAhead, check_reply_values

from .acceptance import ClientAcceptance
from .config import RemoteConfig
from .discovery import RESOLVE_RETRY_S, Discovery, Resolver, is_dns_endpoint
from .metrics import RTT_KEY, STEP_RTT_BUCKETS
from .placement import Placement
from .shm import ShmRegion, shm_available
from .shm import attach as shm_attach
from .stats import Stats
from .transport import (
    RpcClient,
    TransportError,
    TransportTimeout,
    WaitingRpcClient,
    make_client,
    parse_endpoint,
    process_id,
)

__all__ = ["CONNECT_FAIL_LOG_S", "SIZE_SUSPECT_BYTES", "RemoteDraftClient", "StepOutcome"]

log = logging.getLogger("dspark_client")

# While the worker stays unreachable the thread retries every backoff interval, so only the
# first failure of a run and then one line per CONNECT_FAIL_LOG_S are logged; the counter
# connect_failures counts them all.
CONNECT_FAIL_LOG_S: Final = 60.0
# Reply buffer of a request other than STEP (PING, RESET, STATS JSON); it grows when needed.
AUX_REPLY_BYTES: Final = 1 << 16
# close() waits this long at most for the worker to answer GOODBYE: the worker frees the
# session's slots at once instead of after its idle time, but closing never hangs on it.
GOODBYE_TIMEOUT_S: Final = 0.5
# The HELLO reply buffer: a HelloReply fits many times over.
HELLO_REPLY_BYTES: Final = 1 << 12
# A STEP body above this may be refused for its size alone (a worker's --max-frame-bytes is never
# below 64 KiB): ST_BAD_FRAME on such a STEP fails the round instead of disabling the client,
# and DraftRounds lowers its row budget after repeated ones (7.5).
SIZE_SUSPECT_BYTES: Final = 64 << 10
_ENTRIES_AT: Final = wire.APP_HEADER_SIZE + STEP_HEADER_SIZE  # entries' offset in a STEP frame
_USABLE: Final = np.isin(np.arange(256), sorted(wire.USABLE_REQ_STATUS))  # by status (u8)
# While connected, the thread wakes for re-resolution and placement changes no more often
# than this.
MIN_TICK_S: Final = 0.01


class _WorkerDraining(wire.WireError):
    """The worker answered ST_DRAINING: go to another one now; not a failure."""


@dataclass
class StepOutcome:
    """What one STEP gave. ``ok``: ``reply`` passed every check, and ``drafted[i]`` is how
    many positions entry i carries (``k`` of section 6.3). Not ok: ``reason`` is a short
    counter key; ``unknown_apply`` means the worker may have applied the STEP without us
    knowing (timeout, transport error, refused reply), so every slot in it must resync."""

    ok: bool
    reply: wire.StepReply | None = None
    reason: str | None = None
    rtt_us: float = 0.0
    unknown_apply: bool = False
    drafted: npt.NDArray[np.int64] | None = None
    status: int = wire.ST_OK  # the frame status when the worker answered one


class _Ahead:
    """What the reply's checks need of the request alone, for one STEP: the 6.3 side
    (``protocol.validate.ValuesAhead``) and, on a sampled session, the draws' side
    (``protocol.sampled.ReplyCheck``: every position's u); and the acceptance the STEP's
    entries show (``ClientAcceptance.step_sent``). Made when called: the transport
    calls it once the STEP is sent, while the reply is on its way. Should that fail or not
    happen, the checks make their parts when the reply is in (raising there)."""

    __slots__ = ("also", "asked", "client", "draws", "sent", "values")

    def __init__(self, client: RemoteDraftClient, sent: np.ndarray,
                 also: Callable[[], None] | None = None) -> None:
        self.client, self.sent, self.also = client, sent, also
        self.values: ValuesAhead | None = None
        self.draws: ReplyCheck | None = None
        self.asked: np.ndarray | None = None

    def __call__(self) -> None:
        # The STEP's entries judge the blocks of the rounds before (they need no reply).
        self.client.acceptance.step_sent(self.sent)
        try:
            self.values = ValuesAhead(self.sent, self.client.hello.num_spec,
                                      self.client.hello.window)
            if self.client.sampled:
                self.draws = self._draws()
        except Exception:  # made again, and raised, where the reply is checked
            self.values = self.draws = None
        if self.also is not None:  # the caller's own work for the round trip (step())
            self.also()

    def sampled_check(self) -> tuple[ReplyCheck, np.ndarray | None]:
        """The draws' check, and per entry whether it asked for a draft (None: every one)."""
        if self.draws is None:
            self.draws = self._draws()
        return self.draws, self.asked

    def _draws(self) -> ReplyCheck:
        s, hello = self.sent, self.client.hello
        if self.values is not None and self.values.usual:  # every entry asks for all N
            self.asked = n_out = None
        else:
            self.asked = (s["flags"] & wire.RF_NEED_DRAFT) != 0
            n_out = s["n_out"]
        return ReplyCheck(s["seed"], s["generation"], s["anchor_pos"], s["top_k"],
                          hello.num_spec, hello.vocab_size, asked=self.asked, n_out=n_out,
                          scratch=self.client._scratch)


class _Shared:
    """State the connect thread and the finalizer share with the client. It holds no reference
    to the client, so the thread never keeps the client alive."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.ready_event = threading.Event()
        self.stop = False
        self.conn: RpcClient | None = None


def _shutdown(shared: _Shared) -> None:
    """The finalizer: stop the thread and close the connection (no reference to the client)."""
    shared.stop = True
    shared.wake.set()
    conn, shared.conn = shared.conn, None
    if conn is not None:
        conn.close()


def _connect_loop(ref: weakref.ReferenceType[RemoteDraftClient], shared: _Shared) -> None:
    while not shared.stop:
        shared.wake.clear()  # before looking at the state: a wake after this is never lost
        client = ref()
        if client is None:
            return
        try:
            wait = client._background_tick()
        except Exception as exc:  # the thread must survive a bug in one attempt
            log.exception("remote DSpark: connect thread error")
            client.last_error = f"connect thread error: {type(exc).__name__}: {exc}"
            wait = 1.0
        finally:
            del client
        if wait is None:
            return
        shared.wake.wait(None if math.isinf(wait) else wait)


_NBYTES: Final = operator.attrgetter("nbytes")


def _nbytes(rows: Any) -> int:
    """The bytes of ``step()``'s rows: one buffer, or a list of arrays."""
    if isinstance(rows, list):
        return sum(map(_NBYTES, rows))
    return rows.nbytes if hasattr(rows, "nbytes") else len(rows)


class RemoteDraftClient:
    """One engine run's client of one draft worker at a time, out of the set its endpoints name.

    ``hello`` is what this engine sends: geometry, identities, client name. The auth tag is
    computed here for each HELLO when ``cfg`` has a secret. ``resolver``: ``(name, port) ->
    addresses`` for ``dns+tcp`` endpoints instead of ``socket.getaddrinfo`` (an engine's own
    service discovery, or a test's); a constructor argument because ``RemoteConfig`` is plain
    data decoded from JSON."""

    def __init__(
        self,
        cfg: RemoteConfig,
        hello: wire.Hello,
        *,
        stats: Stats | None = None,
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
        self.stats = stats if stats is not None else Stats()
        self.acceptance = ClientAcceptance(hello.max_slots, hello.num_spec)
        self._factory: Callable[..., RpcClient] = transport_factory or functools.partial(
            make_client, max_reply_bytes=cfg.max_reply_bytes)
        self._secret = cfg.secret()
        self.session = session or secrets.randbits(32) or 1
        self._shared = _Shared()
        self._lock = self._shared.lock  # guards session, seq, epoch, conn, ready
        self._io_lock = threading.Lock()  # one request at a time on the connection
        self._scratch = Scratch()  # the sampled checks' arrays; used under _io_lock
        self._pid = process_id()
        self._seq = 0
        self._ready = False
        self.epoch = 0  # accepted HELLOs so far
        self.disabled_reason: str | None = None
        self.worker_info: wire.HelloReply | None = None
        self._reply_no_confidence = 0  # RPF_NO_CONFIDENCE as the worker's replies must carry it
        self._last_error: str | None = None
        self.last_refusal: int | None = None  # frame status of the last non-fatal HELLO refusal
        # The worker set and where in it to be; only the connect thread touches these (the
        # engine thread hands a drained endpoint over through _drained).
        self._discovery = Discovery(cfg.all_endpoints, resolver)
        self._placement = Placement(hello.client_name, failover_after=cfg.failover_after,
                                    return_after_s=cfg.return_after_ms / 1000.0)
        self._next_resolve = 0.0
        self._last_resolve = -math.inf
        self._resolve_soon = False
        if not self._discovery.dynamic:
            self._placement.update(self._discovery.resolve(), time.monotonic())
        self._endpoint = self._placement.target(time.monotonic()) or cfg.endpoint
        self._session_endpoint: str | None = None  # where the current session was accepted
        self._drained: str | None = None  # an endpoint whose STEP answered ST_DRAINING
        self._retry_now = False
        self._rng = random.Random(secrets.randbits(64))
        self._backoff_ms = cfg.backoff_ms
        self._next_attempt = 0.0
        self._fail_run = 0
        self._fail_logged = 0.0
        self._no_session_logged = -math.inf
        # Rounds in a row whose reply failed its checks or was ST_INTERNAL: while it is not 0
        # an accepted HELLO does not reset the backoff (a worker whose every reply is wrong,
        # e.g. NaN weights, is not re-HELLOed many times a second), a good reply does.
        self._failing_replies = 0
        self._resp = bytearray(self._step_reply_bytes())
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
        self._thread: threading.Thread | None = None
        self._finalizer = weakref.finalize(self, _shutdown, self._shared)
        if background:
            self.start_background()

    def _step_reply_bytes(self) -> int:
        """The largest STEP reply of this session's geometry (a release entry per extra slot
        is not possible: slots are distinct, so n_req <= max_slots)."""
        flags = wire.RPF_MARGIN | (wire.RPF_SAMPLED if self.sampled else 0)
        return wire.APP_HEADER_SIZE + reply_layout(self.hello.max_slots, self.hello.num_spec,
                                                   flags).size

    def start_background(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(
                target=_connect_loop, args=(weakref.ref(self), self._shared),
                name="dspark-client-connect", daemon=True)
            self._thread.start()

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
        return self._placement.members

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
        if self._forked():
            return None
        with self._lock:
            return self.epoch if self._ready and self.disabled_reason is None else None

    def _next_seq(self) -> int:
        with self._lock:
            self._seq += 1
            return self._seq

    def _forked(self) -> bool:
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
            with self._lock:
                self._ready = False
                self._finalizer()
        else:
            self._shared.stop = True

    def _goodbye(self) -> None:
        """One GOODBYE on the ready connection, waiting at most GOODBYE_TIMEOUT_S; any failure
        is ignored (the worker still drops the session after session_idle_s)."""
        with self._lock:
            conn = self._shared.conn if self._ready and self.disabled_reason is None else None
            session = self.session
        if conn is None:
            return
        timeout = min(GOODBYE_TIMEOUT_S, self.cfg.timeout_ms / 1000.0)
        if not self._io_lock.acquire(timeout=timeout):
            return
        try:
            self._goodbye_on(conn, session, timeout)
        finally:
            self._io_lock.release()

    def _goodbye_on(self, conn: RpcClient, session: int, timeout: float) -> None:
        """GOODBYE for ``session`` on ``conn``; the caller holds ``_io_lock`` (no request in
        flight on it). Failures are logged at debug level and otherwise ignored."""
        try:
            seq = self._next_seq()
            n = conn.request(wire.goodbye_frame(seq, session), self._aux, timeout)
            h, _ = wire.split_frame(memoryview(self._aux)[:n])
            if h.status == wire.ST_OK:
                self.stats.inc("goodbyes")
            else:
                log.debug("remote DSpark: GOODBYE answered %s",
                          wire.FRAME_STATUS_NAMES.get(h.status, h.status))
        except (TransportError, wire.WireError, OSError) as e:
            log.debug("remote DSpark: GOODBYE failed: %s", e)

    def __enter__(self) -> RemoteDraftClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def disable(self, reason: str) -> None:
        """Stop remote drafting for this engine run (every round is target-only from now)."""
        self._disable(reason)

    def _disable(self, reason: str) -> None:
        self.disabled_reason = reason
        self.stats.inc("remote_disabled")
        self.stats.set("disabled_reason", reason)
        log.error("remote DSpark disabled for this engine run: %s", reason)
        with self._lock:
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
        if self._forked():
            return
        with self._lock:  # one critical section: no reader sees the new id on the old connection
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
        if self._forked():
            return
        self.last_error = reason
        with self._lock:
            self._drop_locked(backoff=backoff)
        self.stats.inc("disconnects")
        self._shared.wake.set()

    def _drop_locked(self, *, backoff: bool) -> None:
        self._drop_conn_locked()
        if backoff:
            self._schedule_retry_locked()
        else:
            self._next_attempt = time.monotonic()

    def _schedule_retry_locked(self) -> float:
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
        if self.disabled or self._forked():
            return False
        timeout = self.cfg.connect_timeout_ms / 1000.0
        now = time.monotonic()
        self._take_drained(now)
        self._refresh(now)
        target = self._placement.target(now)
        if target is None:
            self._connect_failed(self.endpoint, TransportError(
                f"no worker address resolved ({self._discovery.last_error or 'empty answer'})"))
            return False
        endpoint = self._endpoint = target
        if self._session_endpoint is not None and endpoint != self._session_endpoint:
            # Another worker: a new session id, so that a worker we come back to later never
            # resumes windows that went stale meanwhile (every slot resyncs after the HELLO).
            with self._lock:
                self.session = self._fresh_session_locked()
            self._session_endpoint = None
        conn: RpcClient | None = None
        with self._lock:
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
        with self._lock:
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
                if not self._failing_replies:  # else the next good reply resets it
                    self._backoff_ms = self.cfg.backoff_ms
        if stale:  # HELLO again at once under the new id
            conn.close()
            return self.connect_now()
        self._session_endpoint = endpoint
        self._placement.connected(endpoint)
        self._shared.ready_event.set()
        self._worker_accepted(rep, endpoint)
        self.stats.inc_many({"hellos": 1, "reconnects": int(epoch > 1)})
        failed, self._fail_run = self._fail_run, 0
        log.info("remote DSpark worker %r ready at %s (session %#010x, epoch %d)%s%s",
                 rep.worker_name, endpoint, session, epoch,
                 f" after {failed} failed connect attempts" if failed else "",
                 "; its drafter has no confidence head (confidences predict nothing: verify a"
                 " static length)" if rep.capabilities & wire.CAP_NO_CONFIDENCE else "")
        return True

    def _hello_on(self, conn: RpcClient, session: int, timeout: float) -> wire.HelloReply | None:
        """HELLO on a fresh connection. Returns the reply when accepted, None when refused
        fatally (the client is then disabled); raises WireError for a refusal to retry."""
        seq = self._next_seq()
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
                self._disable(f"HELLO refused: {name}{self._differences(rep)}"
                              + (self._limits_hint() if h.status == wire.ST_LIMITS else ""))
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
        problems = self._reply_problems(rep)
        if problems:
            self._disable("HELLO reply does not match this engine: " + "; ".join(problems))
            return None
        return rep

    def _worker_accepted(self, rep: wire.HelloReply, endpoint: str) -> None:
        """An accepted HELLO's reply: what the worker is and which drafter serves us."""
        self.worker_info = rep
        self.acceptance.set_has_confidence(not rep.capabilities & wire.CAP_NO_CONFIDENCE)
        # What every reply's RPF_NO_CONFIDENCE bit must then be (checked per STEP).
        self._reply_no_confidence = (wire.RPF_NO_CONFIDENCE
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

    def _limits_hint(self) -> str:
        """What ST_LIMITS may be about beyond the HelloReply's fields: the frame limit."""
        ours = self.hello
        body = wire.rows_offset_for(ours.max_slots) + ours.max_rows_per_step * ours.row_bytes
        return (f"; this engine's largest STEP is {wire.APP_HEADER_SIZE + body} bytes"
                f" (max_slots {ours.max_slots}, max_rows_per_step {ours.max_rows_per_step},"
                f" {ours.row_bytes}-byte rows): raise the worker's --max-frame-bytes or lower"
                " max_rows_per_step")

    def _session_taken(self, session: int) -> None:
        """HELLO refused ST_STALE_SEQ: the worker holds this session id with a higher seq than
        ours, so someone else HELLOed with it (a takeover, or a replay). Our seq can never
        catch up with theirs: the next attempt uses a new random id (an empty session, so
        every slot resyncs)."""
        with self._lock:
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
        ok, why = shm_attach(conn, region, session, self._next_seq, timeout)
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

    def _reply_problems(self, rep: wire.HelloReply) -> list[str]:
        ours = self.hello
        problems = []
        if rep.version != ours.version:
            problems.append(f"version {rep.version} != {ours.version}")
        if self.follows:  # any drafter of this geometry: the reply says which (6.5)
            pass
        elif rep.drafter_identity != ours.drafter_identity:
            problems.append(f"drafter identity {rep.drafter_identity.hex()[:16]}.. !="
                            f" ours {ours.drafter_identity.hex()[:16]}..")
        if not self.follows and rep.markov_identity != ours.markov_identity:
            problems.append(f"markov identity {rep.markov_identity.hex()[:16]}.. !="
                            f" ours {ours.markov_identity.hex()[:16]}..")
        for field in ("window", "num_spec", "row_bytes", "vocab_size", "n_taps", "hidden"):
            theirs, mine = getattr(rep, field), getattr(ours, field)
            if theirs != mine:
                problems.append(f"{field} {theirs} != ours {mine}")
        if self.sampled and not rep.capabilities & wire.CAP_TOP32:
            problems.append("worker lacks the dyadic24 top32 capability")
        if not rep.capabilities & wire.CAP_TAPS_BF16:
            problems.append("worker lacks the TAPS_BF16 capability")
        if rep.max_slots < ours.max_slots:
            problems.append(f"max_slots {rep.max_slots} < ours {ours.max_slots}")
        if rep.max_rows_per_step < ours.max_rows_per_step:
            problems.append(f"max_rows_per_step {rep.max_rows_per_step} < ours"
                            f" {ours.max_rows_per_step}")
        return problems

    def _differences(self, rep: wire.HelloReply | None) -> str:
        if rep is None:
            return ""
        problems = self._reply_problems(rep)
        return f" ({'; '.join(problems)})" if problems else ""

    def _fresh_session_locked(self) -> int:
        new = self.session
        while new in (self.session, 0):
            new = secrets.randbits(32)
        return new

    # -- the worker set and placement (connect thread only) ---------------------------------------
    def _refresh(self, now: float) -> None:
        """Resolve the DNS endpoints again when the interval has passed, or soon after a
        failed connect (at most every RESOLVE_RETRY_S)."""
        if not self._discovery.dynamic:
            return
        due = now >= self._next_resolve or (
            self._resolve_soon and now - self._last_resolve >= RESOLVE_RETRY_S)
        if not due:
            return
        members = self._discovery.resolve()
        self._last_resolve = now
        self._next_resolve = now + self.cfg.resolve_interval_ms / 1000.0
        self._resolve_soon = False
        self.stats.inc("resolves")
        if self._discovery.last_error is not None:
            self.stats.inc("resolve_failures")
            self.stats.set("last_resolve_error", self._discovery.last_error)
            log.warning("remote DSpark: %s", self._discovery.last_error)
        added, removed = self._placement.update(members, now)
        if added or removed:
            self.stats.set("workers", len(self._placement.members))
            log.info("remote DSpark worker set: %d workers (+%s -%s)",
                     len(self._placement.members), added, removed)

    def _take_drained(self, now: float) -> None:
        ep, self._drained = self._drained, None
        if ep is not None:
            self._placement.hold(ep, now)

    def _worker_draining(self, endpoint: str, where: str) -> None:
        """``endpoint`` answered ST_DRAINING: keep away from it for the quiet period and, when
        there is another worker, connect to it now (no backoff, no failure counted)."""
        now = time.monotonic()
        self.stats.inc("drained")
        self._placement.hold(endpoint, now)
        target = self._placement.target(now)
        self.last_error = f"{endpoint} is draining ({where})"
        if target is not None and target != endpoint:
            self._retry_now = True
            log.info("remote DSpark: %s is draining; moving to %s", endpoint, target)
        else:
            log.warning("remote DSpark: %s is draining and no other worker is known", endpoint)

    def _connect_failed(self, endpoint: str, e: BaseException) -> None:
        text = str(e)  # a transport error names the endpoint itself
        self.last_error = text if endpoint in text else f"connect {endpoint}: {text}"
        self.stats.inc("connect_failures")
        self._fail_run += 1
        self._resolve_soon = True
        now = time.monotonic()
        if self._placement.connect_failed(endpoint, now):
            target = self._placement.target(now)
            if target is not None and target != endpoint:
                self.stats.inc("failovers")
                log.warning("remote DSpark: %s unreachable, failing over to %s", endpoint,
                            target)
        if self._fail_run == 1:
            self._fail_logged = now
            log.warning("remote DSpark connect/HELLO to %s failed: %s", endpoint, e)
        elif now - self._fail_logged >= CONNECT_FAIL_LOG_S:
            self._fail_logged = now
            log.warning("remote DSpark connect/HELLO to %s still failing after %d attempts: %s",
                        endpoint, self._fail_run, e)

    def _while_connected(self) -> float:
        """Re-resolve and move to a better-ranked worker when one became eligible; seconds
        until this is worth doing again."""
        if not self._discovery.dynamic and len(self._placement.members) < 2:
            return math.inf
        now = time.monotonic()
        self._take_drained(now)
        self._refresh(now)
        better = self._placement.better(self._endpoint, now)
        if better is not None:
            self._move_to(better)
            now = time.monotonic()
        wait = self._placement.next_change(now)
        if self._discovery.dynamic:
            wait = min(wait, self._next_resolve - now)
        return max(wait, MIN_TICK_S)

    def _move_to(self, target: str) -> bool:
        """Connect and HELLO to ``target`` under a new session while the engine keeps stepping
        on the current connection; swap only when the HELLO is accepted (a new epoch: every
        slot resyncs there). A refusal or failure holds ``target`` off for the quiet period."""
        timeout = self.cfg.connect_timeout_ms / 1000.0
        with self._lock:
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
            self._placement.hold(target, time.monotonic())
            self.stats.inc("move_failures")
            log.info("remote DSpark: staying on %s; %s did not take us: %s", old, target, e)
            return False
        if rep is None:  # refused fatally: the client is disabled
            conn.close()
            return False
        # Swap with no request in flight on the old connection: closing it under a STEP would
        # fail that STEP, and its failure would then drop the new connection.
        if not self._io_lock.acquire(timeout=2 * self.cfg.timeout_ms / 1000.0 + 1.0):
            conn.close()
            self._placement.hold(target, time.monotonic())  # try again after a quiet period
            return False
        try:
            with self._lock:
                left = self._shared.conn if self._ready else None
                left_session = self.session
            if left is not None:
                # Free the lanes we leave behind now, not after the old worker's idle time.
                self._goodbye_on(left, left_session,
                                 min(GOODBYE_TIMEOUT_S, self.cfg.timeout_ms / 1000.0))
            with self._lock:
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
                if not self._failing_replies:
                    self._backoff_ms = self.cfg.backoff_ms
                self._endpoint = self._session_endpoint = target
        finally:
            self._io_lock.release()
        self._placement.connected(target)
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
        if not self._io_lock.acquire(timeout=timeout):
            self._follow_wanted = True
            return
        try:
            with self._lock:
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
            with self._lock:
                if self._shared.stop or self.disabled or self._shared.conn is not conn:
                    return
                self.session = new
                self._shm_conn = conn if shm_ok else None
                self.epoch += 1
                epoch = self.epoch
                self.stats.set("epoch", epoch)
        finally:
            self._io_lock.release()
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
        if self._retry_now:  # a draining worker: the next one at once
            self._retry_now = False
            return 0.0
        with self._lock:
            return self._schedule_retry_locked()

    # -- STEP -------------------------------------------------------------------------------------
    def step(
        self,
        buf: bytearray | memoryview,
        entries: Sequence[wire.ReqEntry] | npt.NDArray[Any],
        n_rows: int,
        step_id: int,
        step_flags: int = 0,
        epoch: int | None = None,
        rows: Any = None,
        sample_meta: list[SampleMeta] | None = None,
        while_waiting: Callable[[], None] | None = None,
    ) -> StepOutcome:
        """Send one STEP and check its reply.

        Without ``rows``: ``buf`` is writable and its rows already sit at
        ``wire.APP_HEADER_SIZE + wire.rows_offset_for(len(entries))``; the headers are written
        in front of them and the frame goes out as one buffer. With ``rows`` (``n_rows x
        row_bytes`` bytes, C-contiguous, e.g. a numpy view of a staging buffer, or a list of
        such arrays whose bytes, back to back, are the rows): ``buf`` takes only the headers
        and entries, and the frame goes out as [headers, rows...] with scatter-gather, so the
        rows are neither copied nor written to.

        ``epoch``: the connection epoch the entries were built for; when the connection is
        newer the STEP is not sent (reason "reconnected": its slots were never resynced).
        ``sample_meta``: per entry ``(seed, top_k, temperature, top_p)``, overriding the
        entries' sampling fields. ``entries`` may also be a one-dimensional
        ``wire.ENTRY_DTYPE`` array (``wire.pack_step_prefix``), copied in whole.
        ``while_waiting``: the caller's own work for the round trip (it needs no reply), run
        once the STEP is sent; it must not raise. It is not run when the STEP is not sent, so
        the caller checks."""
        if self.disabled or self._forked():
            return StepOutcome(False, reason="disabled")
        with self._lock:
            conn = self._shared.conn if self._ready else None
            session = self.session
            moved = epoch is not None and self.epoch != epoch
        if conn is None:
            return StepOutcome(False, reason="not_ready")
        if moved:
            return StepOutcome(False, reason="reconnected")
        hello = self.hello
        row_bytes = hello.row_bytes
        n = len(entries)
        if n > hello.max_slots:
            raise ValueError(f"{n} entries, more than max_slots {hello.max_slots}")
        timeout = self.cfg.timeout_ms / 1000.0
        t_start = time.perf_counter()
        ro = wire.pack_step_prefix(buf, wire.APP_HEADER_SIZE, step_id,
                                   entries if isinstance(entries, (list, np.ndarray))
                                   else list(entries),
                                   n_rows, row_bytes, step_flags, sample_meta=sample_meta)
        body_len = ro + n_rows * row_bytes
        shm_at = self._rows_at(conn, rows, n_rows * row_bytes) if n_rows else None
        if shm_at is not None:  # section 13: the rows stay where they are, the prefix travels
            set_rows_at(buf, wire.APP_HEADER_SIZE, shm_at)
            body_len = ro
            parts: tuple[Any, ...] = (memoryview(buf)[:wire.APP_HEADER_SIZE + ro],)
        elif rows is None:
            if len(buf) < wire.APP_HEADER_SIZE + body_len:
                raise ValueError(f"buffer of {len(buf)} bytes cannot hold a"
                                 f" {wire.APP_HEADER_SIZE + body_len}-byte STEP")
            parts = (memoryview(buf)[:wire.APP_HEADER_SIZE + body_len],)
        else:
            nbytes = _nbytes(rows)
            if nbytes != n_rows * row_bytes:
                raise ValueError(f"rows hold {nbytes} bytes, {n_rows} rows of {row_bytes}"
                                 f" need {n_rows * row_bytes}")
            head = memoryview(buf)[:wire.APP_HEADER_SIZE + ro]
            parts = (head, *rows) if isinstance(rows, list) else (head, rows)
        # The entries as sent, read back through the protocol's dtype: echo and draw checks
        # use these columns without a Python loop over the entries.
        sent = np.frombuffer(buf, dtype=ENTRY_DTYPE, count=n, offset=_ENTRIES_AT)
        if not self._io_lock.acquire(timeout=timeout):
            return StepOutcome(False, reason="local_busy")
        # One deadline for the round: waiting for the connection counts against it.
        timeout -= time.perf_counter() - t_start
        try:
            if timeout <= 0:
                return StepOutcome(False, reason="local_busy")
            with self._lock:  # the connection may have been dropped while we packed
                if self._shared.conn is not conn or self.session != session:
                    return StepOutcome(False, reason="not_ready")
                self._seq += 1
                seq = self._seq
            wire.AppHeader(op=wire.OP_STEP, seq=seq, session=session,
                           body_len=body_len).pack_into(buf, 0)
            # What the reply's checks need of the request alone is computed while the reply
            # is on its way, where the transport offers that.
            ahead = _Ahead(self, sent, while_waiting)
            t0 = time.perf_counter()
            try:
                if getattr(conn, "runs_while_waiting", False):
                    size = cast(WaitingRpcClient, conn).request_parts(
                        parts, self._resp, timeout, while_waiting=ahead)
                else:
                    ahead()
                    if len(parts) == 1:
                        size = conn.request(parts[0], self._resp, timeout)
                    else:
                        size = conn.request_parts(parts, self._resp, timeout)
            except TransportTimeout:
                self.stats.inc("step_timeouts")
                self.mark_failed("STEP timed out")
                return StepOutcome(False, reason="timeout", unknown_apply=True,
                                   rtt_us=(time.perf_counter() - t0) * 1e6)
            except TransportError as e:
                self.stats.inc("step_transport_errors")
                self.mark_failed(f"STEP transport: {e}")
                return StepOutcome(False, reason="transport_error", unknown_apply=True,
                                   rtt_us=(time.perf_counter() - t0) * 1e6)
            rtt_us = (time.perf_counter() - t0) * 1e6
            out = self._check_step_reply(size, seq, session, step_id, entries, sent, rtt_us,
                                         body_len, ahead)
            good: tuple[float, float, float] | None = None
            if out.ok and out.reply is not None:
                self.acceptance.reply_in(out.drafted, out.reply.confidence)
                if out.reply.flags & wire.RPF_NEWER_DRAFTER and not self._follow_wanted \
                        and time.monotonic() >= self._follow_hold_until:
                    self._follow_wanted = True  # the connect thread follows it
                    self._shared.wake.set()
                if self._failing_replies:
                    self._failing_replies = 0
                    with self._lock:
                        self._backoff_ms = self.cfg.backoff_ms
                good = (rtt_us, out.reply.worker_us,
                        (time.perf_counter() - t_start) * 1e6 - rtt_us)
            self.stats.step_answered(wire.APP_HEADER_SIZE + body_len, size, shm_at is not None,
                                     good, (RTT_KEY, rtt_us * 1e-6, STEP_RTT_BUCKETS))
            return out
        finally:
            self._io_lock.release()

    def _rows_at(self, conn: RpcClient, rows: Any, nbytes: int) -> int | None:
        """Where this STEP's rows lie in the region when the connection takes them from there
        (copied in first when the caller's rows are elsewhere), else None."""
        region = self._shm
        if region is None or rows is None or conn is not self._shm_conn:
            return None
        have = _nbytes(rows)
        if have != nbytes:
            raise ValueError(f"rows hold {have} bytes, the STEP needs {nbytes}")
        at = None if isinstance(rows, list) else region.offset_of(rows)
        if at is None or at % ROWS_ALIGN:
            filled = 0  # bytes copied to the region's start so far
            for part in rows if isinstance(rows, list) else (rows,):
                src = (part.reshape(-1).view(np.uint8) if isinstance(part, np.ndarray)
                       else np.frombuffer(memoryview(part).cast("B"), np.uint8))
                region.array[filled:filled + len(src)] = src
                filled += len(src)
            self.stats.inc("shm_rows_copied")
            at = 0
        return at

    def _check_step_reply(self, size: int, seq: int, session: int, step_id: int,
                          entries: Sequence[wire.ReqEntry] | npt.NDArray[Any],
                          sent: np.ndarray, rtt_us: float, body_len: int = 0,
                          ahead: _Ahead | None = None) -> StepOutcome:
        hello = self.hello
        try:
            h, body = wire.split_frame(memoryview(self._resp)[:size])
            if h.op != wire.OP_STEP or h.seq != seq or h.session != session:
                raise wire.WireError(f"reply echoes op={h.op} seq={h.seq} session="
                                     f"{h.session:#x}; sent op={wire.OP_STEP} seq={seq}"
                                     f" session={session:#x}")
        except wire.WireError as e:
            return self._bad_reply(e, rtt_us)
        if h.status == wire.ST_BAD_FRAME and body_len > SIZE_SUSPECT_BYTES:
            # Possibly its size alone (the worker's frame limit): not a reason to stop for the
            # engine run yet. The worker closes the connection after a too-large frame.
            self.stats.inc("step_frame_bad_frame")
            log.warning("remote DSpark: STEP of %d bytes refused BAD_FRAME (over the worker's"
                        " frame limit?)", wire.APP_HEADER_SIZE + body_len)
            self.mark_failed(f"STEP of {wire.APP_HEADER_SIZE + body_len} bytes refused"
                             " BAD_FRAME")
            return StepOutcome(False, reason="frame_bad_frame_size", rtt_us=rtt_us,
                               status=h.status)
        if h.status != wire.ST_OK:
            return self._refused(h.status, rtt_us)
        try:
            reply = wire.StepReply.unpack(body, expect_n_req=len(entries),
                                          expect_num_spec=hello.num_spec)
            if reply.step_id != step_id:
                raise wire.WireError(f"reply step_id {reply.step_id} != sent {step_id}",
                                     field="step_id", value=reply.step_id, limit=step_id)
            if reply.flags & wire.RPF_NO_CONFIDENCE != self._reply_no_confidence:
                raise wire.WireError(
                    f"reply flags {reply.flags:#x}: RPF_NO_CONFIDENCE disagrees with the"
                    f" worker's HELLO (has_confidence {self.has_confidence})", field="flags",
                    value=reply.flags)
            if self.sampled:
                self._check_sampled(reply, sent, ahead)
            elif reply.support_ids is not None:
                raise wire.WireError("sampled arrays in a reply on a greedy session",
                                     field="flags", value=reply.flags)
            # The packed entries, not the objects: the check runs vectorised over them, and it
            # covers the generation echo (6.3).
            if ahead is not None and ahead.values is not None:
                drafted = ahead.values.check(reply, hello.vocab_size)
            else:
                drafted = check_reply_values(reply, sent, vocab_size=hello.vocab_size,
                                             window=hello.window)
        except wire.WireError as e:
            return self._bad_reply(e, rtt_us)
        return StepOutcome(True, reply=reply, rtt_us=rtt_us, drafted=drafted)

    def _check_sampled(self, reply: wire.StepReply, sent: np.ndarray,
                       ahead: _Ahead | None = None) -> None:
        mask, sup, q = reply.sampled_mask, reply.support_ids, reply.proposal_q
        if mask is None or sup is None or q is None:
            raise wire.WireError("sampled session reply without sampled q; refusing its drafts",
                                 field="flags", value=reply.flags)
        try:
            check, asked = (ahead or _Ahead(self, sent)).sampled_check()
            usable = _USABLE[reply.status]
            check.check(mask, sup, q, reply.draft_ids, usable if asked is None else asked & usable)
        except wire.WireError:
            raise
        except ValueError as exc:  # shape errors of the caller's arrays
            raise wire.WireError(str(exc)) from exc

    def _bad_reply(self, e: wire.WireError, rtt_us: float) -> StepOutcome:
        self.stats.inc("bad_replies")
        self.stats.set("last_bad_reply", str(e))
        log.warning("remote DSpark: STEP reply refused (round fails, slots resync): %s", e)
        self._failing_replies += 1
        self.mark_failed(f"bad reply: {e}")
        return StepOutcome(False, reason="bad_reply", rtt_us=rtt_us, unknown_apply=True)

    def _refused(self, status: int, rtt_us: float) -> StepOutcome:
        name = wire.FRAME_STATUS_NAMES.get(status, str(status))
        self.stats.inc(f"step_frame_{name.lower()}")
        if status in wire.FATAL_FRAME_STATUS:
            self._disable(f"STEP refused: {name}")
        elif status in (wire.ST_NO_SESSION, wire.ST_STALE_SEQ):
            # Not applied; a fresh HELLO on a new connection fixes the session at once.
            now = time.monotonic()
            if now - self._no_session_logged >= CONNECT_FAIL_LOG_S:
                self._no_session_logged = now
                log.warning("remote DSpark: STEP refused %s: the worker no longer holds session"
                            " %#010x on this connection (dropped by its idle time, a GOODBYE,"
                            " or a HELLO elsewhere under client name %r); HELLO again and"
                            " resync (one line per %g s)", name, self.session,
                            self.hello.client_name, CONNECT_FAIL_LOG_S)
            self.mark_failed(f"STEP refused: {name}", backoff=False)
        elif status == wire.ST_DRAINING:
            # Not applied; the worker is going away: the connect thread holds it off and
            # connects to the next-ranked worker at once (no backoff, not a failure).
            self._drained = self._endpoint
            self.stats.inc("drained")
            self.mark_failed(f"STEP refused: {name} ({self._endpoint})", backoff=False)
        elif status == wire.ST_INTERNAL:
            # The worker dropped the session; HELLO again, after a backoff delay so that a
            # worker failing every STEP is not hammered.
            self._failing_replies += 1
            self.mark_failed(f"STEP refused: {name}")
        elif status not in wire.FRAME_STATUS_NAMES:
            self.mark_failed(f"STEP answered unknown status {status}")
            return StepOutcome(False, reason="bad_reply", rtt_us=rtt_us, unknown_apply=True,
                               status=status)
        # ST_BUSY: not applied, connection fine; the round fails and the slots resync.
        return StepOutcome(False, reason=f"frame_{name.lower()}", rtt_us=rtt_us,
                           unknown_apply=False, status=status)

    # -- tools ------------------------------------------------------------------------------------
    def simple_request(self, op: int, body: bytes = b"") -> tuple[int, bytes]:
        """PING / STATS / RESET on the engine's connection (not on the hot path). Returns the
        frame status and the reply body."""
        if self._forked():
            raise TransportError(self.disabled_reason or "forked")
        with self._lock:
            conn = self._shared.conn if self._ready else None
            session = self.session
        if conn is None:
            raise TransportError(f"not connected to {self.endpoint}"
                                 + (f" ({self.last_error})" if self.last_error else ""))
        timeout = self.cfg.timeout_ms / 1000.0
        if not self._io_lock.acquire(timeout=timeout):
            raise TransportTimeout("the connection stayed busy with another request")
        try:
            seq = self._next_seq()
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
            self._io_lock.release()

    def __repr__(self) -> str:
        state = ("disabled" if self.disabled else "ready" if self.ready else "connecting")
        return (f"RemoteDraftClient({self.endpoint!r}, session={self.session:#010x},"
                f" epoch={self.epoch}, {state})")
