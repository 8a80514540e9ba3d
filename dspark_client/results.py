"""What a round gives the engine: ``RoundResult``, assembled from a checked STEP reply or for a
target-only round (docs/contract.md 7.2).

``Results`` owns the assembly and nothing else: which requests went out and how many positions
each may use is decided before (``DraftRounds``, the exchange's checks); here the reply's
arrays become the result's, in the order of the engine's requests, with zeros and
``NOT_SENT`` where a request was not in the STEP. The arrays are views over the reply buffer
(or this object's zero arrays) and stay valid until the next round.
"""

from __future__ import annotations

from typing import Any, Final

import msgspec
import numpy as np
import numpy.typing as npt

from protocol import wire
from protocol.constants import MAX_TOP_K

__all__ = ["NOT_SENT", "Results", "RoundResult"]

Ints = npt.NDArray[np.int64]

# Request status reported for a slot that was not in the STEP (failed round, deferred).
NOT_SENT: Final = 255


class RoundResult(msgspec.Struct, gc=False):
    """What one round gives, in the order of the requests passed to ``run`` / ``run_batch``.

    ok: the worker answered (False: target-only round; ``reason`` says why).
    num_drafted[i]: usable draft positions of request i (0: target-only for that slot).
    draft_ids / confidence / margin ``[n, N]``; support_ids / proposal_q ``[n, N, 32]`` on a
    sampled session. Positions ``j >= num_drafted[i]`` carry zeros. ``status[i]``: the
    request status of section 7.2, or NOT_SENT. ``has_confidence`` False: the drafter has no
    confidence head (``RPF_NO_CONFIDENCE``): its confidences are 1.0 and predict nothing, so a
    depth policy verifies a static number of drafts (``schedule_greedy(None, ...)``)."""

    ok: bool
    reason: str | None
    num_drafted: npt.NDArray[np.int32]
    status: npt.NDArray[np.uint8]
    draft_ids: npt.NDArray[np.int32]
    confidence: npt.NDArray[np.float32]
    margin: npt.NDArray[np.float32] | None = None
    support_ids: npt.NDArray[np.int32] | None = None
    proposal_q: npt.NDArray[np.uint32] | None = None
    resynced: int = 0
    rows_sent: int = 0
    rtt_us: float = 0.0
    has_confidence: bool = True


class Results:
    """The results of one ``DraftRounds``' rounds, for up to ``max_slots`` requests of
    ``num_spec`` positions."""

    def __init__(self, max_slots: int, num_spec: int, sampled: bool) -> None:
        S, N = max_slots, num_spec
        self._zero_ids = np.zeros((S, N), np.int32)
        self._zero_conf = np.zeros((S, N), np.float32)
        self._zero_sup = np.zeros((S, N, MAX_TOP_K), np.int32) if sampled else None
        self._zero_q = np.zeros((S, N, MAX_TOP_K), np.uint32) if sampled else None

    def target_only(self, n: int, reason: str, has_confidence: bool) -> RoundResult:
        """A round without drafts for its ``n`` requests (``reason``: why)."""
        return RoundResult(
            ok=False, reason=reason, num_drafted=np.zeros(n, np.int32),
            status=np.full(n, NOT_SENT, np.uint8), draft_ids=self._zero_ids[:n],
            confidence=self._zero_conf[:n], margin=self._zero_conf[:n],
            support_ids=None if self._zero_sup is None else self._zero_sup[:n],
            proposal_q=None if self._zero_q is None else self._zero_q[:n],
            has_confidence=has_confidence)

    def from_reply(self, n: int, included: Ints, reply: wire.StepReply,
                   drafted: npt.NDArray[np.int64]) -> RoundResult:
        """A round the worker answered: ``included`` are the requests (of ``n``) its entries
        were for, in order; ``drafted`` the usable positions per entry (the reply's checks)."""
        m = len(included)
        if m == n:  # every request went out, in order: the reply's rows are the result's
            return RoundResult(
                ok=True, reason=None, num_drafted=drafted[:n].astype(np.int32),
                status=reply.status[:n],
                draft_ids=reply.draft_ids[:n], confidence=reply.confidence[:n],
                margin=None if reply.margin is None else reply.margin[:n],
                support_ids=None if reply.support_ids is None else reply.support_ids[:n],
                proposal_q=None if reply.proposal_q is None else reply.proposal_q[:n],
                has_confidence=not reply.flags & wire.RPF_NO_CONFIDENCE)
        # Some requests were deferred: scatter the reply's rows to the requests' places.
        num = np.zeros(n, np.int32)
        idx = included
        num[idx] = drafted[:m]
        status = np.full(n, NOT_SENT, np.uint8)
        status[idx] = reply.status[:m]

        def scatter(a: Any) -> Any:
            if a is None:
                return None
            out = np.zeros((n, *a.shape[1:]), a.dtype)
            out[idx] = a[:m]
            return out

        return RoundResult(
            ok=True, reason=None, num_drafted=num, status=status,
            draft_ids=scatter(reply.draft_ids), confidence=scatter(reply.confidence),
            margin=scatter(reply.margin), support_ids=scatter(reply.support_ids),
            proposal_q=scatter(reply.proposal_q),
            has_confidence=not reply.flags & wire.RPF_NO_CONFIDENCE)
