"""Draft acceptance on the engine's side: what the STEPs this client sends say about the
drafts it received (``protocol.acceptance``; docs/operations.md, "Acceptance").

``RemoteDraftClient.step`` feeds every STEP it sends (judged while the reply is on its way)
and the drafts of every reply that passed its checks, so engines that drive ``step()``
themselves are counted as well as ``DraftRounds``. An engine may also say how many
drafts of each slot's block it verified (its depth policy): ``record_verified``. The totals
are families of ``dspark_client.metrics`` (``dspark_client_acceptance_*``, label ``position``).
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import numpy.typing as npt

from protocol.acceptance import Acceptance, AcceptanceTotals

__all__ = ["ClientAcceptance", "record_verified"]


class ClientAcceptance:
    """One client's chains and totals (all its sessions: every move or reconnect resyncs each
    live slot, which ends its chain). The engine thread writes, a scrape reads: one lock,
    held for one STEP's update or one read."""

    __slots__ = ("_acc", "_lock", "num_spec")

    def __init__(self, max_slots: int, num_spec: int) -> None:
        self.num_spec = num_spec
        self._acc = Acceptance(max_slots, num_spec)
        self._lock = threading.Lock()

    def step_sent(self, sent: npt.NDArray[Any]) -> None:
        """A STEP is on its way: ``sent`` its entries (ENTRY_DTYPE, as packed). Judges the
        blocks they resolve (``Acceptance.judge``); ``step()`` runs it in the round trip."""
        with self._lock:
            self._acc.judge(sent)

    def reply_in(self, drafted: npt.NDArray[np.int64] | None,
                 confidence: npt.NDArray[np.float32] | None) -> None:
        """The reply to the STEP last sent passed every check: its drafts and confidences
        (``Acceptance.keep``). Not called for a STEP without one."""
        with self._lock:
            self._acc.keep(drafted, confidence)

    def set_has_confidence(self, has_confidence: bool) -> None:
        """The worker's drafter has a confidence head, or not (its HELLO's CAP_NO_CONFIDENCE):
        without one nothing predicted is kept or shown."""
        with self._lock:
            self._acc.set_has_confidence(bool(has_confidence))

    def record_verified(self, slots: npt.ArrayLike, counts: npt.ArrayLike) -> None:
        with self._lock:
            self._acc.record_verified(slots, counts)

    def totals(self) -> AcceptanceTotals:
        """A copy of the totals, complete (the confidences still waiting are summed first)."""
        with self._lock:
            self._acc.flush()
            return self._acc.totals.copy()

    def summary(self) -> dict[str, Any]:
        return self.totals().summary()


def record_verified(client: Any, slots: npt.ArrayLike, counts: npt.ArrayLike) -> None:
    """Tell ``client`` (a ``RemoteDraftClient`` or its ``DraftRounds``) that the engine verified
    ``counts[i]`` of the drafts it got for ``slots[i]`` in the last round, before the next
    round. Optional: without it ``dspark_client_acceptance_verified_*`` stay 0. A count above
    the drafts the slot got is taken as all of them."""
    acc = getattr(client, "acceptance", None) or getattr(getattr(client, "client", None),
                                                         "acceptance", None)
    if not isinstance(acc, ClientAcceptance):
        raise TypeError(f"{type(client).__name__} holds no ClientAcceptance (.acceptance)")
    acc.record_verified(slots, counts)
