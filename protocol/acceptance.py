"""Draft acceptance as a session's STEPs show it, with no field of its own on the wire.

For a continuing slot the rows of the next STEP are those of the anchor and of the drafts the
target accepted (docs/contract.md section 8), and the token after them is the new anchor. So
for the block the slot was last drafted from, ``accepted = new anchor_pos - old anchor_pos - 1``.
A block is judged only when that reading is certain: the slot's very next STEP continues it
(same generation, no ``RF_RESET`` or ``RF_RELEASE``) and ``0 <= accepted <= k`` (k the
positions drafted). A resync, a new generation, a release, a STEP that left the slot out (its
rows then span more than one round) or a round the target ran without these drafts ends the
chain, and the block counts nowhere: neither drafted nor accepted.

``Acceptance`` holds one session's chains and ``AcceptanceTotals`` what the judged blocks add
up to. Both the worker (STEPs as applied) and the client (STEPs as sent) feed it;
docs/operations.md ("Acceptance") says what each side measures. Numpy over a STEP's entries,
no loop per slot; the usual STEP (the same slots in the same order as the one before, with no
RESET or RELEASE) is judged against the previous STEP's columns as they are, without a gather
per slot.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from .constants import REQ_ENTRY_SIZE, RF_RELEASE, RF_RESET

__all__ = ["Acceptance", "AcceptanceTotals"]

_U4 = np.dtype("<u4")
_U8 = np.dtype("<u8")
# Entry word 5 is n_out | flags << 16: the flags that end a chain, in place.
_ENDS_CHAIN_WORD5 = (RF_RESET | RF_RELEASE) << 16


class AcceptanceTotals:
    """What judged blocks add up to, kept as histograms (cheap to add to once per STEP) and
    read by block position j (arrays of N):

    ``rounds``: blocks judged; ``drafted[j]``: judged blocks with a draft at position j;
    ``accepted[j]``: those whose draft j the target accepted (so drafts 0..j were);
    ``predicted[j]``: the confidence head's probability of that, summed (prefix survival
    ``c_0 * ... * c_j``); ``lengths[a]``: blocks with exactly ``a`` drafts accepted (0..N).
    ``verified[j]`` and ``verified_rounds``: the same for positions the engine said it verified
    (the client's ``record_verified``; blocks it said nothing of are not in them)."""

    __slots__ = ("drafted_hist", "lengths", "num_spec", "predicted", "verified_hist")

    def __init__(self, num_spec: int) -> None:
        self.num_spec = num_spec
        self.lengths = np.zeros(num_spec + 1, np.int64)  # judged blocks by accepted count
        self.drafted_hist = np.zeros(num_spec + 1, np.int64)  # ... by drafted count
        self.verified_hist = np.zeros(num_spec + 1, np.int64)  # reported ones by verified count
        self.predicted = np.zeros(num_spec, np.float64)

    def copy(self) -> AcceptanceTotals:
        out = AcceptanceTotals(self.num_spec)
        for name in self.__slots__:
            if name != "num_spec":
                getattr(out, name)[:] = getattr(self, name)
        return out

    @staticmethod
    def _by_position(hist: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """Per position j, how many blocks counted in ``hist`` (by count 0..N) exceed j."""
        return np.cumsum(hist[::-1])[::-1][1:]

    @property
    def rounds(self) -> int:
        return int(self.lengths.sum())

    @property
    def verified_rounds(self) -> int:
        return int(self.verified_hist.sum())

    @property
    def accepted(self) -> npt.NDArray[np.int64]:
        return self._by_position(self.lengths)

    @property
    def drafted(self) -> npt.NDArray[np.int64]:
        return self._by_position(self.drafted_hist)

    @property
    def verified(self) -> npt.NDArray[np.int64]:
        return self._by_position(self.verified_hist)

    @property
    def accepted_drafts(self) -> int:
        return int(self.accepted.sum())

    def summary(self) -> dict[str, Any]:
        """Plain numbers for STATS: the counts, the mean accepted drafts per judged block, the
        mean accepted length (the bonus token included: tokens per verify round) and, by
        position, accepted over drafted and predicted over drafted (``None`` where nothing was
        drafted)."""
        r, accepted, drafted = self.rounds, self.accepted, self.drafted
        mean = int(accepted.sum()) / r if r else None

        def ratio(a: npt.NDArray[Any], b: npt.NDArray[Any]) -> list[float | None]:
            return [round(float(x) / float(y), 4) if y else None
                    for x, y in zip(a.tolist(), b.tolist(), strict=True)]

        return {
            "rounds": r,
            "accepted_drafts": int(accepted.sum()),
            "mean_accepted_drafts": round(mean, 4) if mean is not None else None,
            "mean_accepted_length": round(1.0 + mean, 4) if mean is not None else None,
            "drafted_by_position": drafted.tolist(),
            "accepted_by_position": accepted.tolist(),
            "predicted_by_position": [round(x, 3) for x in self.predicted.tolist()],
            "acceptance_by_position": ratio(accepted, drafted),
            "predicted_acceptance_by_position": ratio(self.predicted, drafted),
        }


# Judged blocks' confidences wait in a list until this many rows, then their prefix survival
# is computed for all of them at once (a few ufunc calls over long rows instead of a few per
# STEP): 16384 rows of N = 7 hold 448 KiB. ``flush`` computes it at once for a reader.
PENDING_ROWS = 16384


class _Last:
    """The previous STEP's columns, in its entry order, not yet written to the per-slot
    arrays: what the usual STEP is judged against directly."""

    __slots__ = ("a1", "conf", "kp1", "sgb", "step", "verified")

    def __init__(self, step: int, sgb: bytes, a1: npt.NDArray[np.uint32],
                 kp1: npt.NDArray[np.uint32], conf: npt.NDArray[np.float32] | None) -> None:
        self.step = step
        self.sgb = sgb  # slot | generation << 32 per entry, as u64 bytes
        self.a1 = a1  # anchor_pos + 1
        self.kp1 = kp1  # k + 1 for a drafted block, 0 for none
        self.conf = conf  # [n, N] the block's confidences (None: nothing drafted)
        self.verified: npt.NDArray[np.int64] | None = None  # record_verified; -1: nothing


class Acceptance:
    """One session's draft chains, judged as its STEPs come (see the module docstring).

    ``observe`` takes every STEP of the session in order; ``also`` are further totals each
    judged block is added to (the worker's over every session). ``totals.predicted`` is
    complete after ``flush()``; the other totals always are."""

    __slots__ = ("_a1", "_conf", "_gen", "_kp1", "_last", "_pending", "_pending_rows",
                 "_seen", "_steps", "_verified", "also", "num_spec", "totals")

    def __init__(self, max_slots: int, num_spec: int,
                 also: tuple[AcceptanceTotals, ...] = ()) -> None:
        self.num_spec = num_spec
        self.totals = AcceptanceTotals(num_spec)
        self.also = also
        self._steps = 0
        self._last: _Last | None = None
        self._pending: list[npt.NDArray[np.float32]] = []  # judged blocks' confidences
        self._pending_rows = 0
        # Per slot, the pending block as of the STEP before _last (written back when the slot
        # set changes): k + 1 (0: none), anchor + 1, generation, the STEP that drafted it,
        # what the engine said it verified (-1: nothing), the confidences [max_slots, N].
        self._kp1 = np.zeros(max_slots, np.uint32)
        self._a1 = np.zeros(max_slots, np.uint32)
        self._gen = np.zeros(max_slots, np.uint32)
        self._seen = np.full(max_slots, -2, np.int64)
        self._verified = np.full(max_slots, -1, np.int64)
        self._conf = np.zeros((max_slots, num_spec), np.float32)

    def observe(self, entries: npt.NDArray[Any], drafted: npt.NDArray[Any] | None,
                confidence: npt.NDArray[Any] | None) -> None:
        """One STEP: its entries (``ENTRY_DTYPE`` records, as sent or received), the positions
        drafted for each (``drafted``, k of section 6.3; None: none) and the reply's
        confidences ([n, N], 0 past k as 6.3 requires). Judges the blocks the STEP resolves,
        then keeps its own drafts as the slots' pending blocks."""
        step = self._steps
        self._steps = step + 1
        n = entries.shape[0]
        if not n:
            self._write_back()
            return
        w = entries.view(_U4).reshape(n, REQ_ENTRY_SIZE // 4)
        sgb = w[:, :2].view(_U8).tobytes()  # slot | generation << 32: one word per entry
        anchor = w[:, 2]
        last = self._last
        if (last is not None and last.step == step - 1 and last.sgb == sgb
                and not int(np.bitwise_or.reduce(w[:, 5])) & _ENDS_CHAIN_WORD5):
            # The usual STEP: every entry continues the entry at its place in the last one.
            # accepted = anchor - (old anchor + 1), in u32: a negative one wraps above any
            # k + 1, so one comparison says 0 <= accepted <= k (and k > 0).
            accepted = anchor - last.a1
            self._count(accepted, accepted < last.kp1, last.kp1, last.conf, last.verified)
        else:
            if int(w[:, 0].max()) >= self._kp1.size:
                # Slots past max_slots (a STEP the worker refuses, 7.2 step 3): left out.
                keep = w[:, 0] < self._kp1.size
                self._steps = step
                self.observe(entries[keep], None if drafted is None
                             else np.asarray(drafted)[keep],
                             None if confidence is None else confidence[keep])
                return
            self._write_back()
            slots = w[:, 0].astype(np.intp)
            kp1 = self._kp1[slots]
            accepted = anchor - self._a1[slots]
            judged = ((accepted < kp1) & (self._seen[slots] == step - 1)
                      & (self._gen[slots] == w[:, 1]) & ((w[:, 5] & _ENDS_CHAIN_WORD5) == 0))
            self._count(accepted, judged, kp1, self._conf[slots], self._verified[slots])
        if drafted is None or confidence is None:
            kp1_new, conf = np.zeros(n, np.uint32), None
        else:
            kp1_new = np.asarray(drafted).astype(np.uint32)
            kp1_new += kp1_new > 0  # k + 1 where drafted, 0 where not
            conf = np.array(confidence, dtype=np.float32)  # the reply's buffer is reused
        self._last = _Last(step, sgb, anchor + np.uint32(1), kp1_new, conf)

    def flush(self) -> None:
        """Add the prefix survival of every judged block still waiting to ``predicted``."""
        if not self._pending:
            return
        rows = np.concatenate(self._pending) if len(self._pending) > 1 else self._pending[0]
        self._pending, self._pending_rows = [], 0
        # Prefix survival, the probability that drafts 0..j are all accepted: a running
        # product down the positions, row by row of the [N, rows] transpose (contiguous rows:
        # numpy's cumprod along the short axis of [rows, N] is several times slower).
        surv = np.array(rows.T, dtype=np.float64, order="C")
        for j in range(1, self.num_spec):
            np.multiply(surv[j], surv[j - 1], out=surv[j])
        predicted = surv.sum(axis=1)
        for t in (self.totals, *self.also):
            t.predicted += predicted

    def record_verified(self, slots: npt.ArrayLike, counts: npt.ArrayLike) -> None:
        """The engine verified ``counts[i]`` drafts of slot ``slots[i]``'s pending block (its
        depth policy may verify fewer than were drafted). Counted when the block is judged;
        a count above the drafts the block has is taken as all of them."""
        s = np.asarray(slots, dtype=np.intp).reshape(-1)
        c = np.asarray(counts, dtype=np.int64).reshape(-1)
        if s.shape != c.shape:
            raise ValueError(f"record_verified: {s.size} slots but {c.size} counts")
        max_slots = self._kp1.size
        if s.size and (int(s.min()) < 0 or int(s.max()) >= max_slots):
            bad = int(s.min()) if int(s.min()) < 0 else int(s.max())
            raise ValueError(f"record_verified: slot {bad} is not in 0..{max_slots - 1}")
        if c.size and int(c.min()) < 0:
            raise ValueError(f"record_verified: count {int(c.min())} is negative")
        last = self._last
        if last is None:  # the pending blocks are in the per-slot arrays
            k = self._kp1[s].astype(np.int64) - 1
            self._verified[s] = np.where(k >= 0, np.minimum(c, k), -1)
            return
        place = np.full(max_slots, -1, np.intp)
        last_slots = self._slots_of(last)
        place[last_slots] = np.arange(last_slots.size)
        at = place[s]
        known = at >= 0
        if not known.any():
            return
        if last.verified is None:
            last.verified = np.full(last_slots.size, -1, np.int64)
        k = last.kp1[at[known]].astype(np.int64) - 1
        last.verified[at[known]] = np.where(k >= 0, np.minimum(c[known], k), -1)

    @staticmethod
    def _slots_of(last: _Last) -> npt.NDArray[np.intp]:
        return (np.frombuffer(last.sgb, _U8) & np.uint64(0xFFFFFFFF)).astype(np.intp)

    def _write_back(self) -> None:
        """Move the last STEP's columns into the per-slot arrays (the slot set changes)."""
        last = self._last
        if last is None:
            return
        self._last = None
        sg = np.frombuffer(last.sgb, _U8)
        slots = (sg & np.uint64(0xFFFFFFFF)).astype(np.intp)
        self._kp1[slots] = last.kp1
        self._a1[slots] = last.a1
        self._gen[slots] = (sg >> np.uint64(32)).astype(np.uint32)
        self._seen[slots] = last.step
        self._conf[slots] = 0.0 if last.conf is None else last.conf
        self._verified[slots] = -1 if last.verified is None else last.verified

    def _count(self, accepted: npt.NDArray[np.uint32], judged: npt.NDArray[np.bool_],
               kp1: npt.NDArray[np.uint32], conf: npt.NDArray[np.float32] | None,
               verified: npt.NDArray[np.int64] | None) -> None:
        """Add the blocks ``judged`` marks: ``accepted`` drafts of ``kp1 - 1``, their
        confidences ([n, N]), what the engine said it verified."""
        n_judged = int(np.count_nonzero(judged))
        if not n_judged:
            return
        top = self.num_spec + 1  # counts run 0..N; the bin past them takes unjudged entries
        if n_judged == judged.size:  # the usual STEP: every block judged, no mask needed
            lengths = np.bincount(accepted, minlength=top)
            drafted = np.bincount(kp1, minlength=top + 1)[1:]
            rows = conf
        else:
            lengths = np.bincount(np.where(judged, accepted, top), minlength=top + 1)[:top]
            drafted = np.bincount(np.where(judged, kp1, 0), minlength=top + 1)[1:]
            rows = conf[judged] if conf is not None else None
        if rows is not None:  # judged blocks always have confidences: kp1 > 0
            self._pending.append(rows)
            self._pending_rows += rows.shape[0]
        verified_hist = None
        if verified is not None:
            told = judged & (verified >= 0)
            if told.any():
                verified_hist = np.bincount(np.where(told, verified, top),
                                            minlength=top + 1)[:top]
        for t in (self.totals, *self.also):
            t.lengths += lengths
            t.drafted_hist += drafted
            if verified_hist is not None:
                t.verified_hist += verified_hist
        if self._pending_rows >= PENDING_ROWS:
            self.flush()
