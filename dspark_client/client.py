"""Rank 0's client of a draft worker: the face that joins the link to the worker set and the
STEP exchange (docs/contract.md sections 5, 6, 7.5, 9 and 13).

``RemoteDraftClient`` is what engines, their adapters and tools hold. It makes three parts and
keeps none of their state itself:

* ``link`` (``dspark_client.link.WorkerLink``): which worker, which connection, session and
  epoch; the background thread that connects and HELLOs with backoff and jitter, placement and
  moves, ST_DRAINING, following a newer drafter, the shared-memory attach, GOODBYE, the fork
  guard, the disabled state and ``last_error``;
* ``exchange`` (``dspark_client.exchange.StepExchange``): one STEP on the link's current
  connection, its seq, packing and send, every reply check, and what a refusal means for the
  link;
* ``stats`` and ``acceptance``, which both report into.

Threads. The engine thread calls ``step()``; it never connects and never waits past
``timeout_ms``. The link's daemon thread holds only a weak reference to the link, so a client
that the engine drops is collected and its thread stops (``dspark_client.link`` says which lock
guards what).

Fork. A client used from a process other than the one that made it refuses to run
(``disabled_reason`` says so): make a new client, with its own ``client_name``, in the child.

Reply arrays returned by ``step()`` are numpy views over the client's reply buffer: they stay
valid until the next ``step()`` of this client.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from protocol import wire

from .acceptance import ClientAcceptance
from .config import RemoteConfig
from .discovery import Resolver
from .exchange import SIZE_SUSPECT_BYTES, StepExchange, StepOutcome
from .link import CONNECT_FAIL_LOG_S, GOODBYE_TIMEOUT_S, WorkerLink
from .shm import ShmRegion
from .stats import Stats
from .transport import RpcClient

__all__ = ["CONNECT_FAIL_LOG_S", "GOODBYE_TIMEOUT_S", "SIZE_SUSPECT_BYTES", "RemoteDraftClient",
           "StepOutcome"]


class RemoteDraftClient:
    """One engine run's client of one draft worker at a time, out of the set its endpoints name.

    ``hello`` is what this engine sends: geometry, identities, client name. The auth tag is
    computed for each HELLO when ``cfg`` has a secret. ``resolver``: ``(name, port) ->
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
        self.stats = stats if stats is not None else Stats()
        self.acceptance = ClientAcceptance(hello.max_slots, hello.num_spec)
        self.link = WorkerLink(cfg, hello, self.stats, self.acceptance,
                               transport_factory=transport_factory, background=False,
                               session=session, resolver=resolver)
        self.hello = self.link.hello  # as sent: without its auth tag, HF_FOLLOW when following
        self.exchange = StepExchange(self.link, cfg, self.hello, self.stats, self.acceptance)
        # ``step(buf, entries, n_rows, step_id, ...)``: one STEP and its reply's checks,
        # ``StepExchange.step`` itself (documented there), so the hot path takes no hop
        # through this face.
        self.step = self.exchange.step
        if background:
            self.link.start_background()

    @property
    def cfg(self) -> RemoteConfig:
        return self.link.cfg

    @cfg.setter
    def cfg(self, cfg: RemoteConfig) -> None:
        self.link.cfg = self.exchange.cfg = cfg

    # -- the link's state -------------------------------------------------------------------------
    @property
    def session(self) -> int:
        return self.link.session

    @session.setter
    def session(self, session: int) -> None:
        with self.link.lock:
            self.link.session = session

    @property
    def epoch(self) -> int:
        """Accepted HELLOs so far."""
        return self.link.epoch

    @property
    def disabled_reason(self) -> str | None:
        return self.link.disabled_reason

    @property
    def worker_info(self) -> wire.HelloReply | None:
        return self.link.worker_info

    @property
    def last_refusal(self) -> int | None:
        """The frame status of the last non-fatal HELLO refusal."""
        return self.link.last_refusal

    @property
    def sampled(self) -> bool:
        return self.exchange.sampled

    @property
    def ready(self) -> bool:
        return self.link.ready

    @property
    def has_confidence(self) -> bool | None:
        """Whether the worker's drafter has a confidence head: None until a HELLO is accepted;
        False: confidences predict nothing, verify a static length
        (``WorkerLink.has_confidence``)."""
        return self.link.has_confidence

    @property
    def disabled(self) -> bool:
        return self.link.disabled

    @property
    def last_error(self) -> str | None:
        """Why the client is not drafting, or last failed to; None before any
        (``WorkerLink.last_error``)."""
        return self.link.last_error

    @last_error.setter
    def last_error(self, reason: str | None) -> None:
        self.link.last_error = reason

    @property
    def endpoint(self) -> str:
        """The endpoint the next connect tries (the current one while connected); a
        ``dns+tcp`` endpoint until its first resolution."""
        return self.link.endpoint

    @property
    def workers(self) -> list[str]:
        """The worker set as last resolved, in this client's order of preference."""
        return self.link.workers

    @property
    def follows(self) -> bool:
        """The session asks for whatever drafter the worker serves (HF_FOLLOW, 6.5)."""
        return self.link.follows

    @property
    def rows_in_shm(self) -> bool:
        """Whether the ready connection takes STEP rows from the shared-memory region."""
        return self.link.rows_in_shm

    @property
    def shm_region(self) -> ShmRegion | None:
        """The run's region (None without a ``unix+shm://`` endpoint)."""
        return self.link.shm_region

    # -- the link's actions -----------------------------------------------------------------------
    def start_background(self) -> None:
        self.link.start_background()

    def wait_ready(self, timeout: float) -> bool:
        """Block until a HELLO is accepted or the client is disabled (tools and tests; the
        engine never waits)."""
        return self.link.wait_ready(timeout)

    def connection_epoch(self) -> int | None:
        """The epoch of the ready connection, or None when there is none."""
        return self.link.connection_epoch()

    def connect_now(self) -> bool:
        """Connect and HELLO once (the connect thread calls this; tools may call it directly
        with ``background=False``). True when a HELLO was accepted."""
        return self.link.connect_now()

    def close(self) -> None:
        """Say GOODBYE (best effort: the worker frees this session's slots now rather than
        after its idle time), stop the connect thread and close the connection. Idempotent."""
        self.link.close()

    def __enter__(self) -> RemoteDraftClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def disable(self, reason: str) -> None:
        """Stop remote drafting for this engine run (every round is target-only from now)."""
        self.link.disable(reason)

    def new_session(self, reason: str) -> None:
        """Start a new session and reconnect at once (RS_STALE_GENERATION, 7.1): every live
        slot resyncs from rank 0's ring."""
        self.link.new_session(reason)

    def mark_failed(self, reason: str, *, backoff: bool = True) -> None:
        """Drop the connection; the connect thread reconnects (after a backoff delay unless
        ``backoff`` is False)."""
        self.link.mark_failed(reason, backoff=backoff)

    def rows_buffer(self, n: int) -> npt.NDArray[np.uint8]:
        """``uint8 [n, row_bytes]`` to write a STEP's rows into (``WorkerLink.rows_buffer``:
        on a ``unix+shm://`` endpoint a view of the shared-memory region, so a
        ``step(rows=...)`` of it sends no row bytes at all)."""
        return self.link.rows_buffer(n)

    def simple_request(self, op: int, body: bytes = b"") -> tuple[int, bytes]:
        """PING / STATS / RESET on the engine's connection (not on the hot path). Returns the
        frame status and the reply body."""
        return self.link.simple_request(op, body)

    def __repr__(self) -> str:
        return f"RemoteDraftClient({self.link.describe()})"
