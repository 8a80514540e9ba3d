"""What every engine adapter's rank 0 does around ``DraftRounds.run_batch``, engine-neutral
and torch-free: start the client from the checked options, run a round that never raises, and
lay its drafts and confidences into one int64 array for the other ranks (contract 7.1, 7.5).

A round's array ``[n, 2K]`` holds, per request of the engine's batch, its ``K`` drafts, then
the float32 bits of their ``K`` confidences. Zeros are the fill of a failed round and of a
request without a slot: draft 0 with confidence 0, which an engine's confidence-driven
verification does not admit (without it the target verifies and rejects them, and its output
stays exact)."""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable
from typing import Final

import numpy as np

from dspark_client.client import RemoteDraftClient
from dspark_client.config import RemoteConfig
from dspark_client.rounds import DraftRounds, RoundResult
from protocol import wire

__all__ = ["ERROR_LOG_INTERVAL_S", "GuardedRounds", "fill_round", "start_rounds"]

# A round that raised (a bug in an adapter, never the worker: its failures are target-only
# rounds) is logged with its traceback at most once per this many seconds; the rest counted.
ERROR_LOG_INTERVAL_S: Final = 60.0


def start_rounds(remote: RemoteConfig, hello: wire.Hello, *, owner: object,
                 log: logging.Logger, wait: float | None = None, note: str = ""
                 ) -> DraftRounds:
    """Rank 0's rounds on a client of ``remote`` saying ``hello``; GOODBYE when ``owner`` is
    collected. Waits for the worker once, ``wait`` seconds (the connect timeout by default):
    the first requests then get drafts, and the worker has said whether its drafter has a
    confidence head. ``note``: said after the HELLO's terms in the log line."""
    client = RemoteDraftClient(remote, hello)
    weakref.finalize(owner, client.close)
    ready = client.wait_ready(remote.connect_timeout_ms / 1000.0 if wait is None else wait)
    log.info("remote DSpark: %s as %r (%d slots, W %d, N %d%s)%s", client.endpoint,
             hello.client_name, hello.max_slots, hello.window, hello.num_spec, note,
             "" if ready else f"; no worker answered yet ({client.last_error})")
    return DraftRounds(client)


def fill_round(out: np.ndarray, ours: np.ndarray, res: RoundResult) -> None:
    """Lay the drafts and confidences of ``res`` (one row per request in ``ours``, the batch
    rows that had a slot) into ``out`` ``[n, 2K]``; a failed round leaves ``out`` as it is
    (zeros: target-only)."""
    if not res.ok:
        return
    K = out.shape[1] // 2
    out[ours, :K] = res.draft_ids[:, :K]
    out[ours, K:] = res.confidence[:, :K].view(np.int32)


class GuardedRounds:
    """A round that never raises: the other ranks wait in the broadcast for what rank 0
    returns, so an error is logged (its traceback at most once per ERROR_LOG_INTERVAL_S) and
    the step gets no drafts."""

    def __init__(self, log: logging.Logger) -> None:
        self.errors = 0
        self._log = log
        self._logged = -float("inf")

    def run(self, out: np.ndarray, fill: Callable[[np.ndarray], None]) -> np.ndarray:
        try:
            fill(out)
        except Exception:
            out[:] = 0
            self.errors += 1
            now = time.monotonic()
            if now - self._logged >= ERROR_LOG_INTERVAL_S:
                self._logged = now
                self._log.exception("remote DSpark: a round failed here (%d so far); this"
                                    " step is served without drafts", self.errors)
        return out
