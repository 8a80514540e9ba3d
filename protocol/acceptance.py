"""Draft acceptance as a session's STEPs show it, with no field of its own on the wire.

For a continuing slot the rows of the next STEP are those of the anchor and of the drafts the
target accepted (docs/contract.md section 8), and the token after them is the new anchor. So
for the block the slot was last drafted from, ``accepted = new anchor_pos - old anchor_pos - 1``.
A block is judged only when that reading is certain: the slot's very next STEP continues it
(same generation, no ``RF_RESET`` or ``RF_RELEASE``) and ``0 <= accepted <= k`` (k the
positions drafted). A resync, a new generation, a release, a STEP that left the slot out (its
rows then span more than one round) or a round the target ran without these drafts ends the
chain, and the block counts nowhere: neither drafted nor accepted.

``Acceptance`` holds one session's chains (per slot: the block last drafted, its anchor,
generation and prefix survival) and ``AcceptanceTotals`` what the judged blocks add up to.
Both the worker (STEPs as applied) and the client (STEPs as sent) feed it; docs/operations.md
("Acceptance") says what each side measures. Pure numpy over a STEP's entries: no loop per
slot.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from .constants import RF_RELEASE, RF_RESET

__all__ = ["Acceptance", "AcceptanceTotals"]

_ENDS_CHAIN = RF_RESET | RF_RELEASE


class AcceptanceTotals:
    """What judged blocks add up to, by block position j (arrays of N).

    ``rounds``: blocks judged; ``drafted[j]``: judged blocks with a draft at position j;
    ``accepted[j]``: those whose draft j the target accepted (so drafts 0..j were);
    ``predicted[j]``: the confidence head's probability of that, summed (prefix survival
    ``c_0 * ... * c_j``); ``lengths[a]``: blocks with exactly ``a`` drafts accepted (0..N).
    ``verified[j]`` and ``verified_rounds``: the same for positions the engine said it verified
    (the client's ``record_verified``; blocks it said nothing of are not in them)."""

    __slots__ = ("accepted", "drafted", "lengths", "num_spec", "predicted", "rounds",
                 "verified", "verified_rounds")

    def __init__(self, num_spec: int) -> None:
        self.num_spec = num_spec
        self.rounds = 0
        self.verified_rounds = 0
        self.drafted = np.zeros(num_spec, np.int64)
        self.accepted = np.zeros(num_spec, np.int64)
        self.verified = np.zeros(num_spec, np.int64)
        self.predicted = np.zeros(num_spec, np.float64)
        self.lengths = np.zeros(num_spec + 1, np.int64)

    @property
    def accepted_drafts(self) -> int:
        return int(self.accepted.sum())

    def summary(self) -> dict[str, Any]:
        """Plain numbers for STATS and ``client_metrics``: the counts, the mean accepted
        drafts per judged block, the mean accepted length (the bonus token included: tokens
        per verify round) and, by position, accepted over drafted and predicted over drafted
        (``None`` where nothing was drafted)."""
        r = self.rounds
        mean = self.accepted_drafts / r if r else None

        def ratio(a: npt.NDArray[Any], b: npt.NDArray[Any]) -> list[float | None]:
            return [round(float(x) / float(y), 4) if y else None
                    for x, y in zip(a.tolist(), b.tolist(), strict=True)]

        return {
            "rounds": r,
            "accepted_drafts": self.accepted_drafts,
            "mean_accepted_drafts": round(mean, 4) if mean is not None else None,
            "mean_accepted_length": round(1.0 + mean, 4) if mean is not None else None,
            "drafted_by_position": self.drafted.tolist(),
            "accepted_by_position": self.accepted.tolist(),
            "predicted_by_position": [round(x, 3) for x in self.predicted.tolist()],
            "acceptance_by_position": ratio(self.accepted, self.drafted),
            "predicted_acceptance_by_position": ratio(self.predicted, self.drafted),
        }


def _at_least(values: npt.NDArray[np.int64], num_spec: int) -> npt.NDArray[np.int64]:
    """Per position j < num_spec, how many of ``values`` (each in 0..num_spec) exceed j."""
    hist = np.bincount(values, minlength=num_spec + 1)
    return np.cumsum(hist[::-1])[::-1][1:]


class Acceptance:
    """One session's draft chains, judged as its STEPs come (see the module docstring).

    ``observe`` takes every STEP of the session in order; ``also`` are further totals each
    judged block is added to (the worker's over every session)."""

    __slots__ = ("_anchor", "_gen", "_k", "_seen", "_steps", "_surv", "_verified", "also",
                 "num_spec", "totals")

    def __init__(self, max_slots: int, num_spec: int,
                 also: tuple[AcceptanceTotals, ...] = ()) -> None:
        self.num_spec = num_spec
        self.totals = AcceptanceTotals(num_spec)
        self.also = also
        self._steps = 0
        self._k = np.zeros(max_slots, np.int64)  # positions drafted for the pending block
        self._anchor = np.zeros(max_slots, np.int64)  # its anchor_pos
        self._gen = np.zeros(max_slots, np.uint32)  # its generation (as on the wire)
        self._seen = np.full(max_slots, -2, np.int64)  # the STEP (count) that drafted it
        self._verified = np.full(max_slots, -1, np.int64)  # what the engine said; -1: nothing
        self._surv = np.zeros((max_slots, num_spec), np.float32)  # prefix survival per position

    def observe(self, slots: npt.NDArray[Any], generation: npt.NDArray[Any],
                anchor_pos: npt.NDArray[Any], flags: npt.NDArray[Any],
                drafted: npt.NDArray[Any] | None, confidence: npt.NDArray[Any] | None) -> None:
        """One STEP: its entries' columns ([n]), the positions drafted for each entry
        (``drafted``, k of section 6.3; None: the STEP drafted nothing) and the reply's
        confidences ([n, N], 0 past k as 6.3 requires). Judges the blocks the STEP resolves,
        then makes its own drafts the slots' pending blocks."""
        step = self._steps
        self._steps = step + 1
        if not slots.size:
            return
        slots = slots.astype(np.intp, copy=False)
        anchor = anchor_pos.astype(np.int64, copy=False)
        k_prev = self._k[slots]
        judged = ((k_prev > 0) & (self._seen[slots] == step - 1)
                  & (self._gen[slots] == generation) & ((flags & _ENDS_CHAIN) == 0))
        if judged.any():
            accepted = anchor - self._anchor[slots] - 1
            judged &= (accepted >= 0) & (accepted <= k_prev)
            if judged.any():
                self._judge(slots[judged], accepted[judged], k_prev[judged])
        self._anchor[slots] = anchor
        self._gen[slots] = generation
        self._seen[slots] = step
        self._verified[slots] = -1
        if drafted is None:
            self._k[slots] = 0
            return
        self._k[slots] = drafted
        if confidence is not None:
            # Prefix survival: the probability that drafts 0..j are all accepted.
            self._surv[slots] = np.cumprod(confidence, axis=1)

    def record_verified(self, slots: npt.ArrayLike, counts: npt.ArrayLike) -> None:
        """The engine verified ``counts[i]`` drafts of slot ``slots[i]``'s pending block (its
        depth policy may verify fewer than were drafted). Counted when the block is judged."""
        s = np.asarray(slots, dtype=np.intp)
        c = np.asarray(counts, dtype=np.int64)
        if s.shape != c.shape:
            raise ValueError(f"record_verified: {s.size} slots but {c.size} counts")
        if s.size and (int(s.min()) < 0 or int(s.max()) >= self._k.size):
            raise ValueError(f"record_verified: slot {int(s.max())} is not in"
                             f" 0..{self._k.size - 1}")
        if c.size and int(c.min()) < 0:
            raise ValueError(f"record_verified: count {int(c.min())} is negative")
        self._verified[s] = np.minimum(c, self._k[s])

    def _judge(self, slots: npt.NDArray[np.intp], accepted: npt.NDArray[np.int64],
               drafted: npt.NDArray[np.int64]) -> None:
        n = self.num_spec
        acc_by_pos = _at_least(accepted, n)
        drafted_by_pos = _at_least(drafted, n)
        lengths = np.bincount(accepted, minlength=n + 1)
        predicted = self._surv[slots].sum(axis=0, dtype=np.float64)
        verified = self._verified[slots]
        told = verified >= 0
        n_told = int(told.sum())
        verified_by_pos = _at_least(verified[told], n) if n_told else None
        for t in (self.totals, *self.also):
            t.rounds += slots.size
            t.accepted += acc_by_pos
            t.drafted += drafted_by_pos
            t.lengths += lengths
            t.predicted += predicted
            if verified_by_pos is not None:
                t.verified_rounds += n_told
                t.verified += verified_by_pos
