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
docs/operations.md ("Acceptance") says what each side measures. A STEP costs its feeder a copy
of its entries (and of its reply's confidences) into a log; the log is judged when it fills
(``LOG_STEPS`` STEPs or ``LOG_ENTRIES`` entries) and whenever a reader asks, run by run: a run
is STEPs that carry the same slots in the same order, without RESET or RELEASE (an engine's
usual rounds), so each of its rows judges the row before it in place, and only a run's first
STEP gathers per-slot state. Numpy's fixed cost per call is paid per run, not per STEP, and no
loop runs per slot.
"""

from __future__ import annotations

import itertools
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
    (the client's ``record_verified``; blocks it said nothing of are not in them).
    ``has_confidence`` False: the drafter has no confidence head (its confidences are 1.0 and
    predict nothing), so nothing is predicted: ``predicted`` stays 0 and the summary has no
    predicted figures."""

    __slots__ = ("drafted_hist", "has_confidence", "lengths", "num_spec", "predicted",
                 "verified_hist")

    def __init__(self, num_spec: int, has_confidence: bool = True) -> None:
        self.num_spec = num_spec
        self.has_confidence = has_confidence
        self.lengths = np.zeros(num_spec + 1, np.int64)  # judged blocks by accepted count
        self.drafted_hist = np.zeros(num_spec + 1, np.int64)  # ... by drafted count
        self.verified_hist = np.zeros(num_spec + 1, np.int64)  # reported ones by verified count
        self.predicted = np.zeros(num_spec, np.float64)

    def copy(self) -> AcceptanceTotals:
        out = AcceptanceTotals(self.num_spec, self.has_confidence)
        for name in self.__slots__:
            if name not in ("num_spec", "has_confidence"):
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
        drafted; the predicted lists ``None`` without a confidence head, and
        ``confidence_head`` says which)."""
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
            "predicted_by_position": [round(x, 3) for x in self.predicted.tolist()]
            if self.has_confidence else None,
            "acceptance_by_position": ratio(accepted, drafted),
            "predicted_acceptance_by_position": ratio(self.predicted, drafted)
            if self.has_confidence else None,
            "confidence_head": self.has_confidence,
        }


# Judged blocks' confidences wait in a list until this many rows, then their prefix survival
# is computed for all of them at once (a few ufunc calls over long rows instead of a few per
# STEP): 16384 rows of N = 7 hold 448 KiB. ``flush`` computes it at once for a reader.
PENDING_ROWS = 16384
# STEPs wait in the log until this many (or LOG_ENTRIES entries, 304 KiB of them with their
# confidences at N = 7), then are judged together: numpy's fixed cost per call, most of the
# work for a STEP of a few entries, is paid once per run of them (judging 255 one-entry STEPs
# takes about 70 us, 0.3 us a STEP).
LOG_STEPS = 256
LOG_ENTRIES = 4096


def _plus_one(k: npt.NDArray[np.uint32]) -> npt.NDArray[np.uint32]:
    """k + 1 where a block was drafted (k > 0), 0 where not: the per-slot ``kp1`` form."""
    return k + (k > 0).astype(np.uint32)


class Acceptance:
    """One session's draft chains, judged as its STEPs come (see the module docstring).

    Each STEP is fed in order: ``judge(entries)`` when it is sent or applied, then
    ``keep(drafted, confidence)`` when its reply is in (``observe`` does both). ``also`` are
    further totals each judged block is added to (the worker's over every session).
    ``totals`` judges the log when read; its ``predicted`` is complete after ``flush()``
    (and so are the ``also`` totals)."""

    __slots__ = ("_a1", "_conf", "_gen", "_kp1", "_log_calls", "_log_conf", "_log_entries",
                 "_log_k", "_log_n", "_log_replies", "_log_rows", "_pending", "_pending_rows",
                 "_seen", "_steps", "_tail", "_totals", "_verified", "also", "num_spec")

    def __init__(self, max_slots: int, num_spec: int,
                 also: tuple[AcceptanceTotals, ...] = (), has_confidence: bool = True) -> None:
        self.num_spec = num_spec
        self._totals = AcceptanceTotals(num_spec, has_confidence)
        self.also = also
        self._steps = 0  # STEPs fed so far: the next one's index
        # The STEPs not yet judged, a list per column (joined in one call each when judged):
        # their entries' bytes, entry counts, drafted k (int64 arrays as the reply's check
        # made them) and confidences' bytes ([n, N] float32; both None: no reply yet, or
        # none), and the record_verified calls after them (by index in the log).
        self._log_entries: list[bytes] = []
        self._log_n: list[int] = []
        self._log_k: list[npt.NDArray[np.int64] | None] = []
        self._log_conf: list[bytes | None] = []
        self._log_calls: dict[int, list[tuple[Any, Any]]] = {}
        self._log_rows = 0  # entries in the log
        self._log_replies = 0  # logged STEPs whose drafts were kept
        # The newest STEP's slots once judged, while its reply may still come (None: came).
        self._tail: npt.NDArray[np.intp] | None = None
        self._pending: list[npt.NDArray[np.float32]] = []  # judged blocks' confidences
        self._pending_rows = 0
        # Per slot, the pending block of the slot's newest judged entry: k + 1 (0: none),
        # anchor + 1, generation, the STEP it came in, what the engine said it verified (-1:
        # nothing), the confidences [max_slots, N].
        self._kp1 = np.zeros(max_slots, np.uint32)
        self._a1 = np.zeros(max_slots, np.uint32)
        self._gen = np.zeros(max_slots, np.uint32)
        self._seen = np.full(max_slots, -2, np.int64)
        self._verified = np.full(max_slots, -1, np.int64)
        self._conf = np.zeros((max_slots, num_spec), np.float32)

    @property
    def totals(self) -> AcceptanceTotals:
        """This session's totals, the log judged first."""
        self._judge_log()
        return self._totals

    def set_has_confidence(self, has_confidence: bool) -> None:
        """Whether the drafter has a confidence head (nothing predicted is kept without)."""
        self._totals.has_confidence = has_confidence

    def observe(self, entries: npt.NDArray[Any], drafted: npt.NDArray[Any] | None,
                confidence: npt.NDArray[Any] | None) -> None:
        """One STEP: its entries (``ENTRY_DTYPE`` records, as sent or received), the positions
        drafted for each (``drafted``, k of section 6.3; None: none) and the reply's
        confidences ([n, N], 0 past k as 6.3 requires): ``judge`` then ``keep``."""
        self.judge(entries)
        self.keep(drafted, confidence)

    def judge(self, entries: npt.NDArray[Any]) -> None:
        """A STEP, as sent or applied (a client feeds it while the reply is on its way): its
        entries judge the blocks drafted before, and become the slots' newest, with no drafts
        until ``keep``. The entries are copied: the caller may reuse their buffer."""
        if len(self._log_n) >= LOG_STEPS or self._log_rows >= LOG_ENTRIES:
            self._judge_log()  # every STEP logged so far is complete: this one is newer
        n = entries.shape[0]
        self._log_entries.append(entries.tobytes())
        self._log_n.append(n)
        self._log_k.append(None)
        self._log_conf.append(None)
        self._log_rows += n
        self._steps += 1

    def keep(self, drafted: npt.NDArray[Any] | None,
             confidence: npt.NDArray[Any] | None) -> None:
        """The drafts the reply to the STEP last judged carried (``observe``'s arguments; the
        confidences are copied, a reply buffer is reused, the drafted counts are kept as
        they are). Not called, or with None, for a STEP without a usable reply: its slots
        then hold no pending block."""
        if drafted is None or confidence is None or not len(drafted):
            return
        k = np.asarray(drafted, np.int64)
        if self._log_n:
            if self._log_k[-1] is None:
                self._log_replies += 1
            self._log_k[-1] = k
            self._log_conf[-1] = np.asarray(confidence, np.float32).tobytes()
        elif self._tail is not None and self._tail.size == k.size:
            # A reader judged the log between this STEP and its reply: the STEP's entries
            # are the slots' newest, so the drafts go straight to the per-slot state.
            inside = self._tail < self._kp1.size
            slots = self._tail[inside]
            self._kp1[slots] = _plus_one(k[inside].astype(np.uint32))
            self._conf[slots] = confidence[inside]
            self._tail = None

    def flush(self) -> None:
        """Judge the log, and add the prefix survival of every judged block still waiting to
        ``predicted``: the totals are then complete."""
        self._judge_log()
        self._sum_pending()

    def record_verified(self, slots: npt.ArrayLike, counts: npt.ArrayLike) -> None:
        """The engine verified ``counts[i]`` drafts of slot ``slots[i]``'s block of the last
        STEP (its depth policy may verify fewer than were drafted). Counted when the block is
        judged; a count above the drafts the block has is taken as all of them; a slot the
        last STEP did not draft for is ignored."""
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
        if self._log_n:
            self._log_calls.setdefault(len(self._log_n) - 1, []).append((s, c))
            return
        in_last = self._seen[s] == self._steps - 1  # slots of the last STEP, judged
        newest, c = s[in_last], c[in_last]
        k = self._kp1[newest].astype(np.int64) - 1
        self._verified[newest] = np.where(k >= 0, np.minimum(c, k), -1)

    def _judge_log(self) -> None:
        """Judge every logged STEP, run by run: a run is STEPs each of which carries the same
        slots and generations in the same order as the one before, without RESET or RELEASE
        (an engine's usual rounds), so its rows judge the row before them in place; the
        run's first STEP judges the per-slot state, which its last then replaces."""
        sizes = self._log_n
        if not sizes:
            return
        ks, confs, calls = self._log_k, self._log_conf, self._log_calls
        complete = self._log_replies == len(sizes)
        tail_waits = ks[-1] is None and sizes[-1] > 0  # the newest STEP's reply may still come
        words = np.frombuffer(b"".join(self._log_entries), _U4).reshape(
            -1, REQ_ENTRY_SIZE // 4)
        self._log_entries, self._log_n, self._log_k, self._log_conf = [], [], [], []
        self._log_calls, self._log_rows, self._log_replies = {}, 0, 0
        N = self.num_spec
        # A STEP without a reply has no drafts: zeros in its place.
        k_parts: list[Any] = ks if complete else [
            np.zeros(n, np.int64) if k is None else k for k, n in zip(ks, sizes, strict=True)]
        conf_parts: list[Any] = confs if complete else [
            bytes(4 * n * N) if c is None else c for c, n in zip(confs, sizes, strict=True)]
        kp1 = _plus_one(np.frombuffer(b"".join(k_parts), np.int64).astype(np.uint32))
        conf = np.frombuffer(b"".join(conf_parts), np.float32).reshape(-1, N)
        verified = np.full(kp1.size, -1, np.int64)
        if calls:  # what the engine said it verified, on the blocks of the STEP before
            starts = [0, *itertools.accumulate(sizes)]
            for t, made in calls.items():
                rows = slice(starts[t], starts[t + 1])
                self._verify(made, words[rows, 0], kp1[rows], verified[rows])
        first_step = self._steps - len(sizes)
        at = 0
        i = 0
        while i < len(sizes):  # one run [i, j) of STEPs of n entries, rows [at, at + (j-i) n)
            n, j = sizes[i], i + 1
            while j < len(sizes) and sizes[j] == n:
                j += 1
            if n == 0:
                i = j
                continue
            w = words[at:at + (j - i) * n].reshape(j - i, n, REQ_ENTRY_SIZE // 4)
            # Where a STEP does not continue the one before, the run ends there.
            goes_on = ((w[1:, :, :2] == w[:-1, :, :2]).all(axis=(1, 2))
                       & ((w[1:, :, 5] & _ENDS_CHAIN_WORD5) == 0).all(axis=1))
            cut = np.flatnonzero(~goes_on)
            j = i + 1 + int(cut[0]) if cut.size else j
            rows = slice(at, at + (j - i) * n)
            self._judge_run(first_step + i, w[:j - i], kp1[rows].reshape(j - i, n),
                            conf[rows].reshape(j - i, n, N), verified[rows].reshape(j - i, n))
            at += (j - i) * n
            i = j
        # A reader judged the log in the newest STEP's round trip: its reply goes to the slots.
        self._tail = (words[words.shape[0] - sizes[-1]:, 0].astype(np.intp) if tail_waits
                      else None)

    def _judge_run(self, first: int, w: npt.NDArray[np.uint32], kp1: npt.NDArray[np.uint32],
                   conf: npt.NDArray[np.float32], verified: npt.NDArray[np.int64]) -> None:
        """A run of T STEPs of n entries ([T, n] columns, the first STEP's index ``first``):
        its first row against the per-slot state, every other row against the row before.
        Entries for slots past max_slots (a STEP the worker refuses) are left out."""
        inside = w[0, :, 0] < self._kp1.size
        if not inside.all():
            w, kp1, conf, verified = w[:, inside], kp1[:, inside], conf[:, inside], \
                verified[:, inside]
        if not w.shape[1]:
            return
        slots = w[0, :, 0].astype(np.intp)
        anchor = w[:, :, 2]
        # accepted = anchor - (old anchor + 1), in u32: a negative one wraps above any k + 1,
        # so one comparison says 0 <= accepted <= k (and k > 0).
        p_kp1 = self._kp1[slots]
        accepted = anchor[0] - self._a1[slots]
        judged = ((accepted < p_kp1) & (self._seen[slots] == first - 1)
                  & (self._gen[slots] == w[0, :, 1]) & ((w[0, :, 5] & _ENDS_CHAIN_WORD5) == 0))
        self._count(accepted, judged, p_kp1, self._conf[slots], self._verified[slots])
        if w.shape[0] > 1:
            accepted = (anchor[1:] - anchor[:-1] - np.uint32(1)).reshape(-1)
            n_prev = kp1[:-1].reshape(-1)
            self._count(accepted, accepted < n_prev, n_prev,
                        conf[:-1].reshape(-1, self.num_spec), verified[:-1].reshape(-1))
        self._kp1[slots], self._a1[slots] = kp1[-1], anchor[-1] + np.uint32(1)
        self._gen[slots], self._seen[slots] = w[-1, :, 1], first + w.shape[0] - 1
        self._conf[slots], self._verified[slots] = conf[-1], verified[-1]

    @staticmethod
    def _verify(calls: list[tuple[Any, Any]], slots: npt.NDArray[np.uint32],
                kp1: npt.NDArray[np.uint32], verified: npt.NDArray[np.int64]) -> None:
        """record_verified calls after one STEP, on its entries' blocks (in place)."""
        for s, c in calls:
            row, col = np.nonzero(slots[:, None] == s[None, :])
            k = kp1[row].astype(np.int64) - 1
            verified[row] = np.where(k >= 0, np.minimum(c[col], k), -1)

    def _sum_pending(self) -> None:
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
        for t in (self._totals, *self.also):
            t.predicted += predicted

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
        if rows is not None and self._totals.has_confidence:  # judged blocks have them (kp1 > 0)
            self._pending.append(rows)
            self._pending_rows += rows.shape[0]
        verified_hist = None
        if verified is not None:
            told = judged & (verified >= 0)
            if told.any():
                verified_hist = np.bincount(np.where(told, verified, top),
                                            minlength=top + 1)[:top]
        for t in (self._totals, *self.also):
            t.lengths += lengths
            t.drafted_hist += drafted
            if verified_hist is not None:
                t.verified_hist += verified_hist
        if self._pending_rows >= PENDING_ROWS:
            self._sum_pending()
