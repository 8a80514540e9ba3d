"""What an engine adapter asks the worker before it builds its HELLO: what the worker alone
decides, learnt from STATS (contract section 10: "a tool can learn a HELLO the worker accepts
without sending one it refuses"): its window W (its ``--window`` sizes the memory it reserves at
start) and its limits, the most slots one session may declare (``--max-slots``) and the most
rows one STEP may carry (``--max-rows-per-step``). An engine that leaves ``window``,
``max_slots`` or ``max_rows_per_step`` unset then never sends a HELLO refused for them.

Every engine adapter (vLLM, SGLang) calls ``learn_worker`` once on its rank 0, before the client
is made; it logs at WARNING (logger ``dspark_client``) when no worker answered, and the engine
then assumes the worker's defaults.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Any

import msgspec

from protocol import wire

from ..config import RemoteConfig
from ..discovery import Discovery
from ..hello import default_max_rows_per_step
from ..placement import rank
from ..transport import TransportError, make_client
from .options import RemoteDSparkOptions

__all__ = ["WorkerTerms", "hello_with_terms", "learn_worker", "worker_stats"]

log = logging.getLogger("dspark_client")


def worker_stats(endpoint: str, timeout: float, max_reply_bytes: int = 1 << 24
                 ) -> dict[str, Any]:
    """The STATS object of the worker at ``endpoint`` (no session: nothing is reserved or
    refused). TransportError when it cannot be reached; ValueError for a reply that is not a
    STATS object."""
    conn = make_client(endpoint, max_reply_bytes=max_reply_bytes)
    try:
        conn.connect(timeout)
        buf = bytearray(1 << 16)
        n = conn.request(wire.frame(wire.OP_STATS, 1, 0, b""), buf, timeout)
    finally:
        conn.close()
    h, body = wire.split_frame(memoryview(buf)[:n])
    if h.op != wire.OP_STATS or h.status != wire.ST_OK:
        raise ValueError(f"STATS answered op {h.op}, status"
                         f" {wire.FRAME_STATUS_NAMES.get(h.status, h.status)}")
    out = json.loads(bytes(body).decode("utf-8"))
    if not isinstance(out, dict):
        raise ValueError(f"STATS reply is JSON {type(out).__name__}, not an object")
    return out


class WorkerTerms(msgspec.Struct, frozen=True, kw_only=True):
    """What a worker decides for every session: its W and its limits; where it answered."""

    window: int
    max_slots: int
    max_rows_per_step: int
    endpoint: str


def learn_worker(cfg: RemoteConfig, client_name: str, timeout: float
                 ) -> tuple[WorkerTerms | None, str]:
    """(terms, endpoint) of the first worker, in the order this client name ranks them, that
    answers STATS within ``timeout`` seconds in all; (None, why) when none does (logged at
    WARNING). Every worker of one set serves one W, so the first answer is the set's."""
    deadline = time.monotonic() + timeout
    discovery = Discovery(cfg.all_endpoints)
    members = discovery.resolve()
    errors: list[str] = []
    if discovery.last_error:
        errors.append(discovery.last_error)
    for endpoint in rank(client_name, members):
        left = deadline - time.monotonic()
        if left <= 0:
            errors.append(f"{endpoint}: no time left")
            break
        try:
            stats = worker_stats(endpoint, left, cfg.max_reply_bytes)
            terms = WorkerTerms(window=int(stats["geometry"]["window"]),
                                max_slots=int(stats["limits"]["max_slots"]),
                                max_rows_per_step=int(stats["limits"]["max_rows_per_step"]),
                                endpoint=endpoint)
        except (TransportError, OSError, ValueError, KeyError, TypeError,
                wire.WireError) as exc:
            text = str(exc) or type(exc).__name__
            errors.append(text if endpoint in text else f"{endpoint}: {text}")
            continue
        return terms, endpoint
    why = "; ".join(errors) or "no worker address"
    log.warning("remote DSpark: no worker told its window and limits within %.0f ms (%s)",
                timeout * 1000.0, why)
    return None, why


def hello_with_terms(make_hello: Callable[..., wire.Hello], opts: RemoteDSparkOptions, *,
                     max_requests: int, client_name: str, timeout: float
                     ) -> tuple[wire.Hello, str]:
    """The HELLO rank 0 sends, and where its terms came from. ``make_hello(max_slots=,
    window=, max_rows_per_step=)`` builds the engine's HELLO (``drafter_hello`` with what the
    engine knows); what the options leave unset and the worker alone decides is the worker's,
    asked within ``timeout`` seconds (``learn_worker``): W, and at most its max_slots and
    max_rows_per_step; no worker answered: the defaults (said at WARNING). max_slots is at most
    ``max_requests``, the most requests the engine runs at once."""
    max_slots = min(opts.max_slots or max_requests, max_requests)
    if opts.window is not None and opts.max_slots is not None:
        return make_hello(max_slots=max_slots), "as set"
    terms, why = learn_worker(opts.remote, client_name, timeout)
    if terms is None:
        return make_hello(max_slots=max_slots), f"the defaults: {why}"
    if opts.max_slots is None and terms.max_slots < max_slots:
        log.warning("remote DSpark: the worker at %s takes at most %d slots per session"
                    " (its --max-slots), fewer than the engine's %d requests at once: requests"
                    " beyond %d at once are served without drafts", terms.endpoint,
                    terms.max_slots, max_requests, terms.max_slots)
        max_slots = terms.max_slots
    rows = None
    if opts.max_rows_per_step is None:
        w = opts.window or terms.window
        rows = min(default_max_rows_per_step(w, max_slots), terms.max_rows_per_step)
    hello = make_hello(max_slots=max_slots, window=terms.window, max_rows_per_step=rows)
    return hello, f"the worker's, at {terms.endpoint}"
