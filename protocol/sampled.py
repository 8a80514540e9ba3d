"""Sampled proposals, dyadic24 (docs/contract.md section 9).

* ``build_q``: the proposal q of one drafted position from its logits (9.1): top-K, top-p,
  a float softmax, then integer arithmetic only, so the sum is exactly ``Q_TOTAL``.
* ``draw_u`` / ``draw``: the counter-based draw (9.3). ``u`` depends only on (seed, generation,
  position), so anyone holding q can recompute the draft.
* ``validate``: what a sampled reply must satisfy (9.2), vectorised, naming the first offender.
* ``check_draws``: the stricter check that re-derives every draw.
* ``check_reply``: both in one pass, as the client runs them on every sampled reply;
  ``ReplyCheck`` the same, its request-only part (every u) done ahead, while the reply is on
  its way.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any, Final, NoReturn, cast

import numpy as np
import numpy.typing as npt

from .constants import MAX_TOP_K, Q_BITS, Q_TOTAL
from .errors import ReplyValueError

__all__ = ["MAX_TOP_K", "Q_BITS", "Q_TOTAL", "ReplyCheck", "Scratch", "build_q", "check_draws",
           "check_reply", "draw", "draw_u", "quantize", "top_k_probs", "validate"]

# SplitMix64 constants (Steele, Lea and Flood, 2014).
_GOLDEN: Final = np.uint64(0x9E3779B97F4A7C15)
_MIX1: Final = np.uint64(0xBF58476D1CE4E5B9)
_MIX2: Final = np.uint64(0x94D049BB133111EB)
_U32: Final = np.uint64(0xFFFFFFFF)
_ONE, _27, _30, _32 = (np.uint64(x) for x in (1, 27, 30, 32))
_SHIFT: Final = np.uint64(64 - Q_BITS)
_BYTES: Final = np.uint64(0x0101010101010101)  # a word times this: its bytes' sum, top byte
_56: Final = np.uint64(56)
_FIVE: Final = np.uint32(5)

ArrayLike = Any


def top_k_probs(logits: ArrayLike, top_k: int, temperature: float,
                top_p: float = 0.0) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float64]]:
    """The support (ids, in descending logit order, ties to the lower id) and its float64
    probabilities after temperature, top-K and top-p (section 9.1 up to the softmax)."""
    z = np.asarray(logits)
    if z.ndim != 1 or z.size == 0:
        raise ValueError(f"logits must be one non-empty row, got shape {z.shape}")
    if not 1 <= top_k <= MAX_TOP_K:
        raise ValueError(f"top_k {top_k} outside [1, {MAX_TOP_K}]")
    if not (np.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature {temperature!r} is not a finite positive number")
    if not (np.isfinite(top_p) and 0.0 <= top_p <= 1.0):
        raise ValueError(f"top_p {top_p!r} outside [0, 1]")
    z = z.astype(np.float64) / float(temperature)
    if not np.isfinite(z).all():
        bad = int(np.flatnonzero(~np.isfinite(z))[0])
        raise ValueError(f"logit at id {bad} is {float(z[bad])!r} after temperature")
    k = min(top_k, z.size)
    # Candidates: every id at or above the k-th largest value (ties kept), then a stable sort on
    # the value, so equal values keep ascending ids.
    kth = np.partition(z, z.size - k)[z.size - k]
    cand = np.flatnonzero(z >= kth)
    ids = cand[np.argsort(-z[cand], kind="stable")[:k]]
    zk = z[ids]
    p = np.exp(zk - zk[0])
    p /= p.sum()
    if 0.0 < top_p < 1.0:
        keep = int(np.searchsorted(np.cumsum(p), top_p, side="left")) + 1
        keep = min(keep, p.size)
        ids, p = ids[:keep], p[:keep] / p[:keep].sum()
    return ids.astype(np.int64), p


def quantize(p: ArrayLike) -> npt.NDArray[np.int64]:
    """Integers summing to exactly ``Q_TOTAL``: floor of ``p * 2**24``, then the remainder one
    unit at a time to the largest fractional parts (ties to the lower index)."""
    p = np.asarray(p, dtype=np.float64)
    scaled = p * float(Q_TOTAL)
    q = np.floor(scaled).astype(np.int64)
    frac = scaled - q
    rest = Q_TOTAL - int(q.sum())
    if rest > 0:
        order = np.argsort(-frac, kind="stable")
        np.add.at(q, order[np.arange(rest) % q.size], 1)
    elif rest < 0:  # a float sum above 1: take units back from the smallest fractional parts
        order = np.argsort(frac, kind="stable")
        order = order[q[order] > 0]
        np.add.at(q, order[np.arange(-rest) % order.size], -1)
    return np.asarray(q, dtype=np.int64)


def build_q(logits: ArrayLike, top_k: int, temperature: float,
            top_p: float = 0.0) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.uint32]]:
    """Support ids and q (each ``[MAX_TOP_K]``) for one drafted position, in canonical order:
    q descending, ties by id ascending; unused places id 0, q 0."""
    ids, p = top_k_probs(logits, top_k, temperature, top_p)
    q = quantize(p)
    nz = q > 0
    ids, q = ids[nz], q[nz]
    order = np.lexsort((ids, -q))
    out_ids = np.zeros(MAX_TOP_K, dtype=np.int32)
    out_q = np.zeros(MAX_TOP_K, dtype=np.uint32)
    out_ids[:ids.size] = ids[order]
    out_q[:q.size] = q[order]
    return out_ids, out_q


def draw_u(seed: ArrayLike, generation: ArrayLike, position: ArrayLike) -> npt.NDArray[np.uint32]:
    """24-bit uniforms keyed by (seed u64, generation u32, position u32): SplitMix64 of the state
    ``seed + (counter + 1) * golden`` with ``counter = generation << 32 | position``, top 24 bits.
    Broadcasts like numpy; the part of the state that does not depend on the position is
    computed once per (seed, generation), so ``[n, 1]`` seeds against ``[n, N]`` positions
    cost one multiply-add per position before the mix."""
    s = np.asarray(seed, dtype=np.uint64)
    g = np.asarray(generation, dtype=np.uint64) & _U32
    p = np.asarray(position, dtype=np.uint64) & _U32
    with np.errstate(over="ignore"):
        # (counter + 1) * golden = ((g << 32) + 1) * golden + p * golden, all mod 2**64
        z = np.array((s + ((g << _32) + _ONE) * _GOLDEN) + p * _GOLDEN, dtype=np.uint64, ndmin=1)
        _mix(z, np.empty_like(z))
    return z.reshape(np.broadcast_shapes(s.shape, g.shape, p.shape)).astype(np.uint32)


def _mix(z: Any, t: Any, out: Any = None) -> Any:
    """SplitMix64's output function on the states z (uint64, changed; t a scratch array of
    the same shape), keeping the top 24 bits: into ``out`` (e.g. uint32), else z. Its last
    step, ``z ^= z >> 31``, changes no bit above bit 32, so it is left out."""
    np.right_shift(z, _30, out=t)
    z ^= t
    z *= _MIX1
    np.right_shift(z, _27, out=t)
    z ^= t
    z *= _MIX2
    return np.right_shift(z, _SHIFT, out=z if out is None else out, casting="unsafe")


def draw(support_ids: ArrayLike, q: ArrayLike, u: ArrayLike) -> npt.NDArray[np.int32]:
    """The drawn ids: the first place whose running sum of q exceeds u (arrays ``[..., K]``)."""
    ids = np.asarray(support_ids)
    qq = np.asarray(q, dtype=np.int64)
    uu = np.asarray(u, dtype=np.int64)
    lead = np.broadcast_shapes(ids.shape[:-1], qq.shape[:-1], uu.shape)
    ids = np.broadcast_to(ids, (*lead, ids.shape[-1]))
    csum = np.cumsum(np.broadcast_to(qq, (*lead, qq.shape[-1])), axis=-1)
    place = np.argmax(csum > np.broadcast_to(uu, lead)[..., None], axis=-1)
    return np.take_along_axis(ids, place[..., None], axis=-1)[..., 0].astype(np.int32)


class Scratch:
    """Scratch arrays of the checks, kept between calls: hand one to ``validate`` /
    ``check_draws`` / ``check_reply`` on a hot path (the client keeps one; it checks replies on
    the engine thread only). A reply of 256 entries x N = 7 makes temporaries of up to 57,344
    places; allocated afresh on every call, the allocator's mapping and unmapping of them
    doubled the cost or not depending on the heap's state. The arrays of one reply shape are
    made once (``_Plan``), few and reused from one rule to the next, so that what the checks
    touch stays in the core's cache beside the reply. Not to be shared between threads.
    Without one, each call allocates its own."""

    def __init__(self) -> None:
        self.bufs: dict[str, Any] = {}
        self.plans: dict[tuple[int, int, int], _Plan] = {}

    def get(self, name: str, dtype: Any, size: int) -> Any:
        buf = self.bufs.get(name)
        if buf is None or buf.size < size or buf.dtype != dtype:
            buf = self.bufs[name] = np.empty(max(size, 1024), dtype)
        return buf[:size]

    def plan(self, n: int, N: int, W: int) -> _Plan:
        p = self.plans.get((n, N, W))
        if p is None:
            if len(self.plans) >= 4:  # an engine sees a few shapes; a stranger's are not kept
                self.plans.clear()
            p = self.plans[(n, N, W)] = _Plan(n, N, W)
        return p


def _halves(W: int) -> np.dtype[Any]:
    """A support row (MAX_TOP_K 4-byte places) as two opaque fields: its first W places and
    the rest. Copying a field is one memcpy per row, several times faster than copying W
    strided integers."""
    dt = _HALVES.get(W)
    if dt is None:
        dt = _HALVES[W] = np.dtype({
            "names": ["head", "rest"], "formats": [f"V{4 * W}", f"V{4 * (MAX_TOP_K - W)}"],
            "offsets": [0, 4 * W], "itemsize": 4 * MAX_TOP_K})
    return dt


_HALVES: dict[int, np.dtype[Any]] = {}


class _Plan:
    """The arrays the checks of one reply shape use (n entries of N positions, W places read
    of each, M = n * N positions, P = M * W places), made once, with the views the rules use
    (so a check makes few new arrays). When W < MAX_TOP_K, ``ids`` and ``q`` hold copies of
    each position's first W places and ``rest`` the other places; ``q`` then becomes the
    running sum in place. ``work`` serves one rule after the other: the sort keys, then the
    draws' differences; ``t1`` likewise holds one rule's marks at a time."""

    def __init__(self, n: int, N: int, W: int) -> None:
        M = n * N
        P = M * W
        self.M, self.W = M, W
        self.G = G = max(1, 256 // W)  # positions sorted together: rows of about 256 keys
        self.Mp = -(-M // G) * G
        if W < MAX_TOP_K:
            halves = _halves(W)
            self.halves = halves
            self.ids_h = np.empty(M, halves["head"])
            self.q_h = np.empty(M, halves["head"])
            self.rest = np.empty(2 * M, halves["rest"])  # the ids' rests, then q's
            self.rest_ids, self.rest_q = self.rest[:M], self.rest[M:]
            self.rest_u = self.rest.view(np.uint32)
            self.ids = self.ids_h.view(np.int32)
            self.q = self.q_h.view(np.uint32)
        else:
            self.q = np.empty(P, np.uint32)
        self.used = np.empty(P, bool)
        self.used_next = self.used[1:]
        self.t1 = np.empty(self.Mp * W, bool)  # the sort's neighbours need Mp * W - 1
        self.t1P = self.t1[:P]
        self.cand = self.t1P[:-1]
        self.marks = self.t1P.reshape(M, W)
        self.words = self.marks.view(np.uint64)  # [M, W / 8]: what _row_counts adds
        self.q_lo, self.q_hi = self.q[:-1], self.q[1:]
        self.base = np.empty(M, np.uint32)
        self.T = np.empty(M, np.uint32)
        self.work = np.empty(self.Mp * W, np.uint32)
        self.work_P = self.work[:P]
        self.acc = np.empty(M, np.uint64)
        self.starts = np.arange(0, P, W, dtype=np.int64)
        self.z = np.empty((n, N), np.uint64)
        self.zt = np.empty(M, np.uint64)
        self.u = np.empty(M, np.uint32)
        # Where every position is to be drafted (``ReplyCheck``): what each position's first
        # place gives up before the running sum (``_fold``), and each position's end then.
        self.delta = np.empty(M, np.uint32)
        self.ends = np.empty(M, np.uint32)
        self.q_first, self.q_ends = self.q[::W], self.q[W - 1::W]
        self.every = np.ones(M, bool)
        self.steps = _steps_golden(N)
        self.stamps: dict[int, tuple[Any, Any]] = {}

    def patterns(self, b: int, dt: Any) -> tuple[Any, Any]:
        """For one row of G * W sort keys: ``A = stamp + place`` (an unused place's key, with
        ``stamp = (position % G) << b``) and ``W - place`` (what a used place adds)."""
        got = self.stamps.get(b)
        if got is None:
            k = np.arange(self.G * self.W, dtype=dt)
            place = k % self.W
            got = self.stamps[b] = (((k // self.W) << dt(b)) + place, self.W - place)
        return got


class _Scan:
    """What the one pass of section 9.2 leaves for 9.3, over each position's first W places
    (W: the largest top_k rounded up to 8; every later place was checked to be 0): ids
    ``[M * W]`` (M = n * N positions), the running sum C of q over the whole reply, the sum
    before each position, which places are used, the drafts, and which positions are drafted.
    In the one pass C is uint32, every q having been checked to be at most 2**24: its
    wrapping differences are then exact (a position's places sum to at most 32 * 2**24 <
    2**32); ``check_draws``, which reads q unchecked, sums in int64. ``folded``: C is already
    each place's running sum within its position less the position's u (``_fold``)."""

    __slots__ = ("C", "M", "N", "W", "base", "d", "drafted", "every", "folded", "ids", "plan",
                 "used")

    def __init__(self, d: Any, N: int, W: int, plan: _Plan | None = None) -> None:
        self.d, self.N, self.W, self.plan = d, N, W, plan
        self.M = d.size
        self.drafted: Any = None  # set by a pass that found the reply good
        self.every: Any = None  # drafted, when it is known to be every position
        self.folded = False
        self.ids: Any = None
        self.used: Any = None
        self.C: Any = None
        self.base: Any = None

    def sums(self, q: Any, out: Any, base: Any, totals: Any) -> Any:
        """Set C (into ``out``, which may be q itself) and base (into ``base``) from the flat
        q ``[M * W]``; return each position's q total (into ``totals``)."""
        self.C = np.add.accumulate(q, dtype=out.dtype, out=out)
        ends = self.C[self.W - 1::self.W]
        self.base = base
        base[:1] = 0
        base[1:] = ends[:-1]
        return np.subtract(ends, base, out=totals)

    def draws(self, u: Any, work: Any, below: Any, acc: Any, starts: Any) -> Any:
        """Per position the id at its draw: the first place whose running sum exceeds u, i.e.
        the number of places whose running sum within the position is at most u (sums that
        never fall, since q is unsigned): places where ``C - (base + u) <= 0``, read as signed
        (exact for uint32 C: the difference lies within +-2**29). Only drafted positions of a
        reply that passed 9.2 get a meaningful id."""
        M, W = self.M, self.W
        if self.folded:  # C is that difference already
            signed = self.C.view(np.int32)
        else:
            limits = np.repeat(np.add(self.base, u, dtype=self.C.dtype, casting="unsafe"), W)
            over = np.subtract(self.C, limits, out=work)
            signed = over.view(np.int32 if over.dtype == np.uint32 else np.int64)
        np.less_equal(signed, 0, out=below)
        place = _row_counts(below.reshape(M, W).view(np.uint64), acc)
        place += starts  # W (no place) only where not drafted: any id will do, in range
        return np.take(self.ids, place, mode="clip")

    def bad_draws(self, seeds: ArrayLike, generations: ArrayLike, anchor_pos: ArrayLike,
                  w: Scratch, u: Any = None) -> tuple[Any, Any, Any]:
        """The drafted positions (flat) whose draft is not their draw, ascending; with every
        position's drawn id and u (given, or computed here), for the message."""
        if not (self.folded or self.drafted.any()):  # folded: every position drafted
            return np.zeros(0, np.int64), None, None
        M, W = self.M, self.W
        p = self.plan
        if p is None:  # check_draws: arrays of its own
            n = M // self.N
            u = _uniforms(seeds, generations, anchor_pos, np.empty((n, self.N), np.uint64),
                          np.empty(M, np.uint64), np.empty(M, np.uint32),
                          _steps_golden(self.N))
            expect = self.draws(u, w.get("work64", np.int64, M * W), w.get("t1", bool, M * W),
                                np.empty(M, np.uint64), np.arange(0, M * W, W))
        else:
            if u is None:
                u = _uniforms(seeds, generations, anchor_pos, p.z, p.zt, p.u, p.steps)
            expect = self.draws(u, p.work_P, p.t1P, p.acc, p.starts)
        wrong = expect != self.d
        if self.drafted is not self.every:
            wrong &= self.drafted
        return np.flatnonzero(wrong), expect, u


def _fold(qf: Any, p: _Plan) -> bool:
    """The running sum where every position is to be drafted, with each position's u taken
    off as it goes: position m's first q gives up ``delta[m] = 2**24 + u[m] - u[m - 1]``
    (``u[0]`` for the first), so that the running sum C over q's copy ``qf`` (``p.q``: it is
    summed in place) reads, at place j of position m, ``C[m, j] - m * 2**24 - u[m]``, C the
    plain running sum. Every total is 2**24 exactly when each position ends at
    ``2**24 - u[m]`` (``p.ends``): the totals then telescope (modulo 2**32, and each lies in
    [0, 2**29) since q <= 2**24). Returns whether they do; the draws then need no base and no
    u (``_Scan.draws``). When not, q's copy is spent: the caller copies q again."""
    if qf is not p.q:
        np.copyto(p.q, qf)
    np.subtract(p.q_first, p.delta, out=p.q_first)
    np.add.accumulate(p.q, out=p.q)
    return bool((p.q_ends == p.ends).all())


def _row_counts(words: Any, acc: Any) -> Any:
    """How many places of each row are marked, into ``acc`` (uint64 ``[M]``): ``words`` is a
    bool ``[M, W]`` (W a multiple of 8, at most 255 marks a row) read as ``[M, W / 8]``
    words; they are added, and the word's bytes summed by one multiplication (each byte holds
    at most W / 8, so no byte carries)."""
    if words.shape[1] == 1:
        np.copyto(acc, words[:, 0])
    else:
        np.add(words[:, 0], words[:, 1], out=acc)
    for c in range(2, words.shape[1]):
        acc += words[:, c]
    acc *= _BYTES
    acc >>= _56
    return acc.view(np.int64)


def _wire_arrays(support_ids: Any, proposal_q: Any, vocab_size: int) -> tuple[Any, Any, bool]:
    """Flat int32 ids and uint32 q, as the wire carries them. Other integer arrays are taken
    when every value fits (an id in [0, vocab_size), q in [0, 2**32)); the flag says whether
    they did (when not, the reply is refused whatever else it holds)."""
    ids, q = np.asarray(support_ids), np.asarray(proposal_q)
    if ids.dtype.kind not in "iu" or q.dtype.kind not in "iu":
        raise ValueError(f"support ids ({ids.dtype}) and q ({q.dtype}) must be integer arrays")
    fits = True
    if ids.dtype != np.int32:
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
            fits, ids = False, np.zeros(ids.shape, np.int32)
        ids = ids.astype(np.int32)
    if q.dtype != np.uint32:
        if q.size and (int(q.min()) < 0 or int(q.max()) > 0xFFFFFFFF):
            fits, q = False, np.zeros(q.shape, np.uint32)
        q = q.astype(np.uint32)
    return np.ascontiguousarray(ids).reshape(-1), np.ascontiguousarray(q).reshape(-1), fits


class _Planned:
    """What ``ReplyCheck`` fixes from the request for the one pass: per entry ``top_k > 0``
    and whether it may be sampled (asked for a draft, top_k > 0); D, the largest top_k of
    those, and W; whether any of them has top_k below W. A reply whose sampled entries are
    among them is read W places deep (any W at least the reply's own gives the same rules)."""

    __slots__ = ("D", "W", "covered", "every", "folded", "short", "tk_pos")

    def __init__(self, tk: Any, asked: Any) -> None:
        self.folded = False  # set by ReplyCheck when it made what _fold needs
        lo = int(tk.min()) if tk.size and asked is None else 0
        if lo > 0:  # every entry asked, each with top_k > 0: two reductions decide
            self.every = True  # every entry covered
            self.tk_pos = self.covered = np.ones(tk.size, bool)
            self.D = min(MAX_TOP_K, int(tk.max()))
            self.W = _width(self.D)
            self.short = lo < self.W
        else:
            self.tk_pos = tk > 0
            self.covered = self.tk_pos if asked is None else self.tk_pos & asked
            self.every = bool(self.covered.all())
            self.D = min(MAX_TOP_K, int((tk * self.covered).max())) if tk.size else 0
            self.W = _width(self.D)
            self.short = bool((self.covered & (tk < self.W)).any())


def _width(D: int) -> int:
    """The places read closely for a largest top_k D: D rounded up to 8, at most MAX_TOP_K."""
    return min(MAX_TOP_K, (D + 7) & ~7)


def _pass_92(mask: Any, support_ids: Any, proposal_q: Any, drafts: Any, need: Any,
             vocab_size: int, tk: Any, member: bool, w: Scratch,
             planned: _Planned | None = None) -> tuple[_Scan, bool]:
    """Section 9.2 over every position at once: the scan, and whether the reply passes.
    ``member``: also check that each draft is a support id with q > 0 (a draft that
    re-derives under 9.3 is one, so the combined check leaves it to the draw). ``planned``:
    what ``ReplyCheck`` fixed from the request, used when it covers the reply.

    Only the first W places of a position are read closely, W the largest top_k of a sampled
    entry rounded up to 8: every later place must carry id 0 and q 0. Every rule is then an
    elementwise test over those places plus one reduction of the whole reply, never one
    reduction per position (numpy pays per call, and a position has few places):

    * ids in [0, vocab_size): the largest id read as unsigned;
    * q at most 2**24 anywhere (a larger q makes a total over 2**24): the running sum of q is
      then exact in uint32;
    * an unused place (q 0) carries id 0;
    * canonical order: a pair of neighbouring places is suspect when the right one is used and
      q does not fall; only suspects (equal q: rare) are compared on ids;
    * q total: the running sum read at each position's end; the empty positions;
    * top_k: with q non-increasing, the place at top_k must be unused;
    * distinct ids: one sort of keys ``stamp + id``, about 256 to a row, the stamp telling
      apart the positions of a row (``_repeats``)."""
    n, N = drafts.shape
    K = MAX_TOP_K
    M = n * N
    d = drafts.reshape(-1)
    # folded: whether _fold may sum q (planned for this reply, every position to be drafted)
    folded = planned is not None and planned.folded and bool(need.all())
    if folded:  # every entry asked, has top_k > 0 and a usable status: every one is sampled
        sampled = cast(_Planned, planned).tk_pos
        if (mask != 1).any():
            return _Scan(d, N, 0), False
    else:
        sampled = need & (tk > 0 if planned is None else planned.tk_pos)
        if (mask != sampled.view(np.uint8)).any():  # also any mask value but 0 and 1
            return _Scan(d, N, 0), False
    ids, q, fits = _wire_arrays(support_ids, proposal_q, vocab_size)
    if not fits:
        return _Scan(d, N, 0), False
    if folded or (planned is not None and not (sampled > planned.covered).any()):
        planned = cast(_Planned, planned)
        D, W, short_any = planned.D, planned.W, planned.short
    else:
        D = min(K, int((tk * sampled).max())) if n else 0
        W = _width(D)
        short_any = True
    if not M or not W:
        s = _Scan(d, N, W)
        s.drafted = np.zeros(M, bool)
        return s, not (q.any() or ids.any())
    p = w.plan(n, N, W)
    s = _Scan(d, N, W, p)
    if W < K:  # contiguous copies of the places that matter; the rest must be 0
        rows_i, rows_q = ids.view(p.halves), q.view(p.halves)
        np.copyto(p.ids_h, rows_i["head"])
        np.copyto(p.rest_ids, rows_i["rest"])
        np.copyto(p.q_h, rows_q["head"])
        np.copyto(p.rest_q, rows_q["rest"])
        if p.rest_u.max():
            return s, False
        s.ids, qf, q_lo, q_hi = p.ids, p.q, p.q_lo, p.q_hi
    else:
        s.ids, qf, q_lo, q_hi = ids, q, q[:-1], q[1:]
    if int(s.ids.view(np.uint32).max()) >= min(vocab_size, 1 << 31) or int(qf.max()) > Q_TOTAL:
        return s, False
    s.used = used = np.not_equal(qf, 0, out=p.used)
    nz = np.not_equal(s.ids, 0, out=p.t1P)
    if np.greater(nz, used, out=nz).any():  # unused, id not 0
        return s, False
    cand = np.less_equal(q_lo, q_hi, out=p.cand)  # order: suspects
    cand &= p.used_next
    cand[W - 1::W] = False  # the last place of one position and the first of the next
    if cand.any():
        at = np.flatnonzero(cand)
        if ((qf[at] < qf[at + 1]) | (s.ids[at] >= s.ids[at + 1])).any():
            return s, False
    if D > 1 and _repeats(s.ids, qf, p, vocab_size):
        return s, False
    if folded and _fold(qf, p):  # the usual reply: every position drafted
        s.C, s.folded = p.q, True
        s.drafted = s.every = p.every
    else:
        if folded and W < K:  # _fold summed q's copy in place: copy q again
            np.copyto(p.q_h, rows_q["head"])
        # The running sum, over q's own copy when it has one (q is not read again).
        T = s.sums(qf, p.q, p.base, p.T)
        full = T == Q_TOTAL
        rows_s = np.repeat(sampled, N)
        empty = T == 0  # every place unused; their ids are 0 (above)
        s.drafted = rows_s & ~(empty & (d == 0))
        if ((~rows_s & ~empty) | (s.drafted & ~full)).any():
            return s, False
    short = np.flatnonzero(sampled & (tk < W)) if short_any else ()
    if len(short):  # the place at top_k is unused (order then keeps every later one unused)
        at = (short * N)[:, None] + np.arange(N)
        if used.reshape(M, W)[at, tk[short][:, None]].any():
            return s, False
    if member and not (_members(s.ids, used, d, p) == s.drafted).all():
        return s, False
    return s, True


def _repeats(ids: Any, q: Any, p: _Plan, vocab_size: int) -> bool:
    """Does a used id appear twice at one position? Every place gets a key: a used one
    ``stamp + W + id``, an unused one ``stamp + place``, so that unused places never match;
    ``stamp = (position % G) << b`` (ids below ``2**b - W``) tells apart the G positions whose
    keys are sorted together in one row of G * W keys (about 256: numpy sorts such rows
    several times faster per key than rows of 16 or 32). A repeat is then an equal pair of
    neighbours within a row. The keys are ``A + (W - place if q > 0 else 0) + id`` with
    ``A = stamp + place``: four passes of 4-byte integers (``_keys``)."""
    M, W, G = p.M, p.W, p.G
    b = (min(vocab_size, 1 << 31) - 1 + W).bit_length()
    dt: Any = np.uint32
    if G << b <= 1 << 31:
        keys = p.work.view(np.uint32)
    else:  # ids too wide for a stamp in 32 bits
        keys = np.empty(p.Mp * W, np.uint64)
        dt = np.uint64
    A, step = p.patterns(b, dt)
    full = M // G * G * W
    _keys(keys[:full], q[:full], ids[:full], A, step)
    if full < M * W:  # the last row: the remaining positions, then unused places
        rest = M * W - full
        keys[full:] = A
        _keys(keys[full:full + rest], q[full:], ids[full:], A[:rest], step[:rest])
    rows = keys.view(np.int32 if dt == np.uint32 else np.int64).reshape(-1, G * W)
    rows.sort(axis=1)
    # The last key of a row and the first of the next are never equal: every row holds keys
    # of stamps 0 and G - 1 (G >= 8), its first sorted key is of stamp 0, its last of G - 1.
    return bool(np.equal(keys[1:], keys[:-1], out=p.t1[:keys.size - 1]).any())


def _keys(out: Any, q: Any, ids: Any, A: Any, step: Any) -> None:
    """``out = A + min(q << 5, step) + id`` over rows of len(A) places (A and step one row):
    ``step`` where q > 0 (q at most 2**24, step at most 32), else 0. (``minimum`` with a
    scalar runs four times slower than with an array.)"""
    if not out.size:
        return
    rows = out.reshape(-1, A.size)
    np.left_shift(q, _FIVE, out=out, casting="unsafe")
    np.minimum(rows, step, out=rows)
    out += ids.view(np.uint32)
    np.add(rows, A, out=rows)


def _members(ids: Any, used: Any, d: Any, p: _Plan) -> Any:
    """Per position: is its draft id one of its used support ids? Used ids are distinct (the
    distinctness rule runs first), so a position matches at one place or none."""
    M, W = p.M, p.W
    hit = np.equal(ids.reshape(M, W), d[:, None], out=p.marks)
    hit &= used.reshape(M, W)
    return _row_counts(p.words, p.acc) != 0


def _inputs(sampled_mask: ArrayLike, support_ids: ArrayLike, proposal_q: ArrayLike,
            draft_ids: ArrayLike, needed: ArrayLike, top_ks: ArrayLike) -> tuple[Any, ...]:
    mask = np.asarray(sampled_mask)
    sup, q = np.asarray(support_ids), np.asarray(proposal_q)
    drafts = np.asarray(draft_ids)
    need = np.asarray(needed, dtype=bool)
    tk = np.asarray(top_ks).astype(np.int64, copy=False)
    n, N = drafts.shape
    if mask.shape != (n,) or sup.shape != (n, N, MAX_TOP_K) or q.shape != (n, N, MAX_TOP_K):
        raise ReplyValueError(f"sampled arrays have shapes {mask.shape}, {sup.shape},"
                              f" {q.shape}; expected ({n},), ({n}, {N}, {MAX_TOP_K}) twice")
    if need.shape != (n,) or tk.shape != (n,):
        raise ValueError(f"needed {need.shape} and top_ks {tk.shape} must both be ({n},)")
    return mask, sup, q, drafts, need, tk


def validate(sampled_mask: ArrayLike, support_ids: ArrayLike, proposal_q: ArrayLike,
             draft_ids: ArrayLike, needed: ArrayLike, vocab_size: int,
             top_ks: ArrayLike, *, scratch: Scratch | None = None) -> None:
    """Section 9.2. ``needed[i]``: entry i asked for a draft and got a usable status;
    ``top_ks[i]``: its top_k. Raises ReplyValueError naming entry, position and value.

    One vectorised pass decides (``_pass_92``); only on failure does the rule-by-rule reading
    of ``_explain`` name the first offender."""
    _checked_92(sampled_mask, support_ids, proposal_q, draft_ids, needed, vocab_size, top_ks,
                True, scratch or Scratch())


def check_reply(sampled_mask: ArrayLike, support_ids: ArrayLike, proposal_q: ArrayLike,
                draft_ids: ArrayLike, needed: ArrayLike, vocab_size: int, top_ks: ArrayLike,
                seeds: ArrayLike, generations: ArrayLike, anchor_pos: ArrayLike, *,
                scratch: Scratch | None = None) -> None:
    """``validate`` then ``check_draws`` in one pass, what the client runs on every sampled
    reply: the same verdict and the same first offender as the two in turn, for about the cost
    of ``validate`` (the running sum of q serves both, and a draft that re-derives is a used
    support id, so 9.2's membership test is left to the draw). ``ReplyCheck`` is the same
    check with the part that depends on the request alone done first."""
    N = np.asarray(draft_ids).shape[-1]
    ReplyCheck(seeds, generations, anchor_pos, top_ks, N, vocab_size, asked=needed,
               scratch=scratch).check(sampled_mask, support_ids, proposal_q, draft_ids, needed)


class ReplyCheck:
    """``check_reply`` in two parts, split where the STEP has been sent: the constructor takes
    what the request fixes (per entry its seed, generation, anchor_pos and top_k; N; the
    vocabulary size; ``asked``, per entry whether it asked for a draft, by default every one)
    and computes what depends on it alone: every position's u (section 9.3) and how many
    support places to read closely. A client builds it while the reply is on its way, off the
    round's critical path. ``check`` then takes the reply (and per entry whether its status
    let it draft) and gives ``check_reply``'s verdict and first offender.

    The arrays live in ``scratch`` (one is made when none is given): check a ReplyCheck's
    reply before making the next one on the same scratch."""

    def __init__(self, seeds: ArrayLike, generations: ArrayLike, anchor_pos: ArrayLike,
                 top_ks: ArrayLike, num_spec: int, vocab_size: int, *,
                 asked: ArrayLike | None = None, n_out: ArrayLike | None = None,
                 scratch: Scratch | None = None) -> None:
        self.scratch = w = scratch or Scratch()
        self.seeds, self.generations, self.anchor_pos = seeds, generations, anchor_pos
        self.top_ks = tk = np.asarray(top_ks).astype(np.int64)
        N = self.num_spec = int(num_spec)
        self.vocab_size = vocab_size
        n = tk.size
        self.planned = planned = _Planned(tk, None if asked is None
                                          else np.asarray(asked, dtype=bool).reshape(tk.shape))
        self.width = W = planned.W
        self.u: Any = None
        self.usual = False  # after check: the reply had every position drafted (_fold)
        if n and N and W and tk.ndim == 1:
            p = w.plan(n, N, W)
            self.u = u = _uniforms(seeds, generations, anchor_pos, p.z, p.zt, p.u, p.steps)
            if planned.every and (n_out is None or _all_positions(n_out, N)):
                # Every position is to be drafted: what _fold takes off each position's
                # first q, delta[m] = 2**24 + u[m] - u[m - 1], and where each ends,
                # 2**24 - u[m] (both modulo 2**32).
                np.subtract(Q_TOTAL, u, out=p.ends)
                np.add(u[1:], p.ends[:-1], out=p.delta[1:])
                p.delta[0] = u[0]
                planned.folded = True

    def check(self, sampled_mask: ArrayLike, support_ids: ArrayLike, proposal_q: ArrayLike,
              draft_ids: ArrayLike, needed: ArrayLike) -> None:
        """Sections 9.2 and 9.3 for the reply: raises ReplyValueError naming the first
        offender, as ``check_reply``."""
        w = self.scratch
        mask, sup, q, drafts, need, tk = _inputs(sampled_mask, support_ids, proposal_q,
                                                 draft_ids, needed, self.top_ks)
        if drafts.shape[1] != self.num_spec:
            raise ReplyValueError(f"draft_ids have shape {drafts.shape}; the request has N ="
                                  f" {self.num_spec}")
        s, ok = _pass_92(mask, sup, q, drafts, need, self.vocab_size, tk, False, w,
                         self.planned)
        self.usual = s.folded
        if not ok:
            _raise_first(mask, sup, q, drafts, need, self.vocab_size, tk)
        planned = s.plan is not None and self.width == s.W
        bad, expect, u = s.bad_draws(self.seeds, self.generations, self.anchor_pos, w,
                                     self.u if planned else None)
        if not bad.size:
            return
        # A draft outside its support fails 9.2, which comes first: name that one if any.
        if not _members(s.ids, s.used, s.d, cast(_Plan, s.plan))[bad].all():  # drafted: planned
            _raise_first(mask, sup, q, drafts, need, self.vocab_size, tk)
        _raise_draw(int(bad[0]), s.N, s.d, expect, u, self.seeds, self.generations,
                    self.anchor_pos)


def _all_positions(n_out: ArrayLike, N: int) -> bool:
    """Whether every entry asks for all N positions: n_out 0 (all) or at least N."""
    k = np.asarray(n_out).astype(np.int64, copy=False)
    return bool(((k == 0) | (k >= N)).all())


def _checked_92(sampled_mask: ArrayLike, support_ids: ArrayLike, proposal_q: ArrayLike,
                draft_ids: ArrayLike, needed: ArrayLike, vocab_size: int, top_ks: ArrayLike,
                member: bool, w: Scratch) -> tuple[_Scan, Callable[[], None]]:
    """Section 9.2 decided by the one pass, the first offender named when it fails; the scan,
    and what names the first offender should a later check find one."""
    mask, sup, q, drafts, need, tk = _inputs(sampled_mask, support_ids, proposal_q, draft_ids,
                                             needed, top_ks)
    s, ok = _pass_92(mask, sup, q, drafts, need, vocab_size, tk, member, w)

    def refuse() -> None:
        _raise_first(mask, sup, q, drafts, need, vocab_size, tk)

    if not ok:
        refuse()
    return s, refuse


def _uniforms(seeds: ArrayLike, generations: ArrayLike, anchor_pos: ArrayLike, z: Any, zt: Any,
              u: Any, steps_g: Any) -> Any:
    """u of every position into ``u`` (flat ``[n * N]`` uint32; z ``[n, N]`` and zt ``[n * N]``
    uint64 scratch, steps_g ``(j + 2) * golden`` for j < N): ``draw_u`` of entry i's seed and
    generation at positions ``anchor_pos[i] + 1 .. anchor_pos[i] + N``. The state is
    ``seed + ((generation << 32) + position + 1) * golden``, position ``anchor_pos + j + 1``;
    its per-entry part ``seed + ((generation << 32) + anchor_pos) * golden`` is computed once,
    so each position costs one addition before the mix (unless a position passes 2**32 - 1,
    where the counter's low half wraps: then position by position)."""
    n, N = z.shape
    a = np.asarray(anchor_pos).astype(np.uint64).reshape(-1)
    g = np.asarray(generations)
    g = g.reshape(-1).astype(np.uint64) if g.dtype.itemsize <= 4 and g.dtype.kind == "u" else (
        np.asarray(g, dtype=np.uint64).reshape(-1) & _U32)
    s = np.asarray(seeds, dtype=np.uint64).reshape(-1)
    if n and int(a.max()) + N > 0xFFFFFFFF:
        np.add(a[:, None], _steps(N), out=z)
        z &= _U32
        z += _ONE
        z *= _GOLDEN
        z += (s + (g << _32) * _GOLDEN)[:, None]
    else:
        g <<= _32
        g += a
        g *= _GOLDEN
        g += s
        np.add(g[:, None], steps_g, out=z)
    return _mix(z.reshape(-1), zt, u)


def _steps(N: int) -> Any:
    return np.arange(1, N + 1, dtype=np.uint64)


def _steps_golden(N: int) -> Any:
    """``(j + 2) * golden`` for j < N: what ``_uniforms`` adds to an entry's part of the state
    for its position j (at ``anchor_pos + j + 1``, whose counter + 1 is ``... + j + 2``)."""
    return (_steps(N) + _ONE) * _GOLDEN


def _raise_draw(at: int, N: int, d: Any, expect: Any, u: Any, seeds: ArrayLike,
                generations: ArrayLike, anchor_pos: ArrayLike) -> None:
    i, j = divmod(at, N)
    raise ReplyValueError(
        f"entry {i} position {j}: draft id {int(d[at])} is not the draw"
        f" {int(expect[at])} of seed {int(np.asarray(seeds)[i])}, generation"
        f" {int(np.asarray(generations)[i])}, position"
        f" {int(np.asarray(anchor_pos)[i]) + j + 1} (u {int(u[at])})",
        entry=i, position=j, field="draft_ids", value=int(d[at]), limit=int(expect[at]))


def check_draws(sampled_mask: ArrayLike, support_ids: ArrayLike, proposal_q: ArrayLike,
                draft_ids: ArrayLike, seeds: ArrayLike, generations: ArrayLike,
                anchor_pos: ArrayLike, *, scratch: Scratch | None = None) -> None:
    """Re-derive every drafted position's draw (9.3) and refuse a reply whose draft differs.
    Run after ``validate``. Position j of entry i is the token at ``anchor_pos[i] + j + 1``.
    One running sum of q over the whole reply (int64: q is not yet known to be in range)
    gives every position's draw at once (``_Scan.draws``)."""
    w = scratch or Scratch()
    mask = np.asarray(sampled_mask).astype(bool)
    drafts = np.asarray(draft_ids)
    N = drafts.shape[1]
    ids, q, _ = _wire_arrays(support_ids, proposal_q, 1 << 31)
    s = _Scan(drafts.reshape(-1), N, MAX_TOP_K)
    s.ids = ids
    T = s.sums(q, w.get("C64", np.int64, q.size), np.empty(s.M, np.int64),
               np.empty(s.M, np.int64))
    s.drafted = (T > 0) & np.repeat(mask, N)
    bad, expect, u = s.bad_draws(seeds, generations, anchor_pos, w)
    if bad.size:
        _raise_draw(int(bad[0]), N, s.d, expect, u, seeds, generations, anchor_pos)


def _raise_first(mask: Any, sup: Any, q: Any, drafts: Any, need: Any, vocab_size: int,
                 tk: Any) -> NoReturn:
    """Name the first offender of section 9.2 (the failure path only: the one pass has refused
    the reply). The rules hold entry by entry, so whether the first k entries pass is monotone
    in k: a binary search with the one pass finds the first failing entry, and ``_explain``
    reads that entry rule by rule."""
    lo, hi = 0, drafts.shape[0]  # entries [0, lo) pass, [0, hi) do not
    search = Scratch()  # its shapes are not kept in the caller's scratch
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _pass_92(mask[:mid], sup[:mid], q[:mid], drafts[:mid], need[:mid], vocab_size,
                    tk[:mid], True, search)[1]:
            lo = mid
        else:
            hi = mid
    err = _explain(lo, mask, sup, q, drafts, need, vocab_size, tk) if hi > lo else None
    if err is not None:
        raise err
    raise ReplyValueError("sampled reply violates section 9.2")  # pass and search disagree


def _explain(i: int, mask: Any, sup: Any, q: Any, drafts: Any, need: Any, vocab_size: int,
             tk: Any) -> ReplyValueError | None:
    N = drafts.shape[1]
    want = bool(need[i]) and int(tk[i]) > 0
    if int(mask[i]) not in (0, 1) or bool(mask[i]) != want:
        return ReplyValueError(
            f"entry {i}: sampled_mask {int(mask[i])}, the contract requires"
            f" {int(want)} (top_k {int(tk[i])}, RF_NEED_DRAFT with a usable status"
            f" {bool(need[i])})",
            entry=i, field="sampled_mask", value=int(mask[i]), limit=int(want))
    for j in range(N):
        ids = [int(x) for x in sup[i, j]]
        qq = [int(x) for x in q[i, j]]
        d = int(drafts[i, j])
        if not mask[i]:
            if any(ids) or any(qq):
                return ReplyValueError(
                    f"entry {i} position {j}: support/q carry values on an entry that is"
                    " not sampled", entry=i, position=j, field="support")
            continue
        if not any(ids) and not any(qq) and d == 0:
            continue  # not drafted
        err = _explain_position(i, j, ids, qq, d, vocab_size, int(tk[i]))
        if err is not None:
            return err
    return None


def _explain_position(i: int, j: int, ids: list[int], qq: list[int], d: int, vocab_size: int,
                      k: int) -> ReplyValueError | None:
    total = sum(qq)
    if total != Q_TOTAL:
        return ReplyValueError(
            f"entry {i} position {j}: q sums to {total}, not 2**24 = {Q_TOTAL}",
            entry=i, position=j, field="proposal_q", value=total, limit=Q_TOTAL)
    for p in range(MAX_TOP_K):
        if qq[p] < 0:
            return ReplyValueError(
                f"entry {i} position {j} place {p}: q {qq[p]} is negative", entry=i,
                position=j, field="proposal_q", value=qq[p])
        if qq[p] > 0 and not 0 <= ids[p] < vocab_size:
            return ReplyValueError(
                f"entry {i} position {j} place {p}: support id {ids[p]} outside"
                f" [0, {vocab_size})", entry=i, position=j, field="support_ids", value=ids[p],
                limit=vocab_size)
        if qq[p] > 0 and p >= k:
            return ReplyValueError(
                f"entry {i} position {j} place {p}: q {qq[p]} past top_k {k}", entry=i,
                position=j, field="proposal_q", value=p, limit=k)
        if qq[p] == 0 and ids[p] != 0:
            return ReplyValueError(
                f"entry {i} position {j} place {p}: unused place carries id {ids[p]}",
                entry=i, position=j, field="support_ids", value=ids[p])
    used = [p for p in range(MAX_TOP_K) if qq[p] > 0]
    used_ids = [ids[p] for p in used]
    if len(set(used_ids)) != len(used_ids):
        dup = next(x for x in used_ids if used_ids.count(x) > 1)
        return ReplyValueError(f"entry {i} position {j}: support id {dup} appears twice",
                               entry=i, position=j, field="support_ids", value=dup)
    canonical = used == list(range(len(used))) and all(
        qq[a] > qq[b] or (qq[a] == qq[b] and ids[a] < ids[b]) for a, b in itertools.pairwise(used))
    if not canonical:
        return ReplyValueError(
            f"entry {i} position {j}: support is not in canonical order"
            f" (q descending, ties by id): ids {used_ids}, q {[qq[p] for p in used]}",
            entry=i, position=j, field="proposal_q")
    if d not in used_ids:
        return ReplyValueError(
            f"entry {i} position {j}: draft id {d} is not a support id with q > 0",
            entry=i, position=j, field="draft_ids", value=d)
    return None
