"""Sampled proposals, dyadic24 (docs/contract.md section 9).

* ``build_q``: the proposal q of one drafted position from its logits (9.1): top-K, top-p,
  a float softmax, then integer arithmetic only, so the sum is exactly ``Q_TOTAL``.
* ``draw_u`` / ``draw``: the counter-based draw (9.3). ``u`` depends only on (seed, generation,
  position), so anyone holding q can recompute the draft.
* ``validate``: what a sampled reply must satisfy (9.2), vectorised, naming the first offender.
* ``check_draws``: the stricter check that re-derives every draw.
* ``check_reply``: both in one pass, as the client runs them on every sampled reply.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from .constants import MAX_TOP_K, Q_BITS, Q_TOTAL
from .errors import ReplyValueError

__all__ = ["MAX_TOP_K", "Q_BITS", "Q_TOTAL", "Scratch", "build_q", "check_draws", "check_reply",
           "draw", "draw_u", "quantize", "top_k_probs", "validate"]

# SplitMix64 constants (Steele, Lea and Flood, 2014).
_GOLDEN: Final = np.uint64(0x9E3779B97F4A7C15)
_MIX1: Final = np.uint64(0xBF58476D1CE4E5B9)
_MIX2: Final = np.uint64(0x94D049BB133111EB)
_U32: Final = np.uint64(0xFFFFFFFF)
_ONE, _27, _30, _31, _32 = (np.uint64(x) for x in (1, 27, 30, 31, 32))
_SHIFT: Final = np.uint64(64 - Q_BITS)

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
        z = (s + ((g << _32) + _ONE) * _GOLDEN) + p * _GOLDEN
        z ^= z >> _30
        z *= _MIX1
        z ^= z >> _27
        z *= _MIX2
        z ^= z >> _31
        z >>= _SHIFT
    return np.asarray(z).astype(np.uint32)


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
    """Scratch arrays of the checks, grown to the largest reply seen and reused: hand one to
    ``validate`` / ``check_draws`` / ``check_reply`` on a hot path (the client keeps one; it
    checks replies on the engine thread only). A reply of 256 entries x N = 7 makes temporaries
    of 57,344 places (458 KB for the running sum); allocated afresh on every call, the
    allocator's mapping and unmapping of them doubled the cost or not depending on the heap's
    state. Not to be shared between threads. Without one, each call allocates its own."""

    def __init__(self) -> None:
        self.bufs: dict[str, Any] = {}

    def get(self, name: str, dtype: Any, size: int) -> Any:
        buf = self.bufs.get(name)
        if buf is None or buf.size < size:
            buf = self.bufs[name] = np.empty(max(size, 1024), dtype)
        return buf[:size]


class _Scan:
    """What the one pass of section 9.2 leaves for 9.3: ids and q flat (``[M * K]``, M = n * N
    positions, K = MAX_TOP_K), q's running sum over the whole reply (non-decreasing: q is
    unsigned), each position's q total and whether it is drafted."""

    __slots__ = ("C", "K", "M", "N", "T", "base", "d", "drafted", "ids", "q")

    def __init__(self, ids: Any, q: Any, d: Any, N: int, w: Scratch) -> None:
        self.ids, self.q, self.d, self.N = ids, q, d, N
        self.K = K = MAX_TOP_K
        self.M = d.size
        self.C = np.cumsum(q, dtype=np.int64, out=w.get("C", np.int64, q.size))
        ends = self.C[K - 1::K]
        self.base = np.empty_like(ends)  # the running sum before each position
        self.base[:1] = 0
        self.base[1:] = ends[:-1]
        self.T = ends - self.base  # each position's q total
        self.drafted: Any = None

    def draws(self, u: Any) -> Any:
        """Per position the id at its draw: the first place whose running sum exceeds u, found
        by one binary search over the reply's running sum for all positions at once (a drafted
        position's sum rises from its base to base + 2**24 > u within its own K places). Only
        drafted positions of a reply that passed 9.2 get a meaningful id."""
        at = np.searchsorted(self.C, self.base + u, side="right")
        np.minimum(at, self.C.size - 1, out=at)
        return self.ids[at]

    def bad_draws(self, seeds: ArrayLike, generations: ArrayLike,
                  anchor_pos: ArrayLike) -> tuple[Any, Any, Any, Any]:
        """The drafted positions (flat) whose draft is not their draw, ascending; with every
        position's drawn id, u and token position, for the message."""
        if not self.drafted.any():
            return np.zeros(0, np.int64), None, None, None
        u, pos = _uniforms(seeds, generations, anchor_pos, self.M // self.N, self.N)
        expect = self.draws(u)
        return np.flatnonzero((expect != self.d) & self.drafted), expect, u, pos


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
    return ids.reshape(-1), q.reshape(-1), fits


def _pass_92(mask: Any, support_ids: Any, proposal_q: Any, drafts: Any, need: Any,
             vocab_size: int, tk: Any, member: bool, w: Scratch) -> tuple[_Scan, bool]:
    """Section 9.2 over every position at once: the scan, and whether the reply passes.
    ``member``: also check that each draft is a support id with q > 0 (a draft that
    re-derives under 9.3 is one, so the combined check leaves it to the draw).

    Every rule is an elementwise test over the flat places plus one reduction of the whole
    reply, never one reduction per position (numpy pays per call, and a position has only 32
    places):

    * q total: one running sum, read at each position's end; the empty positions;
    * ids in [0, vocab_size): the largest id read as unsigned;
    * an unused place (q 0) carries id 0;
    * canonical order: a pair of neighbouring places is suspect when the right one is used and
      q does not fall; only suspects (equal q: rare) are compared on ids;
    * top_k: with q non-increasing, the place at top_k must be unused;
    * distinct ids: one sort of each position's first D places (D the largest top_k; past it
      every place is unused), then equal non-zero neighbours, and id 0 used twice."""
    n, N = drafts.shape
    K = MAX_TOP_K
    M = n * N
    sampled = mask == 1
    if (((mask != 0) & ~sampled) | (sampled != (need & (tk > 0)))).any():
        return _Scan(np.zeros(0, np.int32), np.zeros(0, np.uint32), np.zeros(0), N, w), False
    ids, q, fits = _wire_arrays(support_ids, proposal_q, vocab_size)
    s = _Scan(ids, q, drafts.reshape(-1), N, w)
    full = s.T == Q_TOTAL
    if sampled.all() and full.all():  # the usual reply: every position drafted
        s.drafted = full
    else:
        rows_s = np.repeat(sampled, N)
        empty = s.T == 0
        z = np.flatnonzero(empty)
        if z.size:
            empty[z] = ~ids.reshape(M, K)[z].any(axis=1)
        s.drafted = rows_s & ~(empty & (s.d == 0))
        if ((~rows_s & ~empty) | (s.drafted & ~full)).any():
            return s, False
    if not fits or not M:
        return s, fits
    short = np.flatnonzero(sampled & (tk < K))
    if short.size:  # the place at top_k is unused (order then keeps every later one unused)
        at = (short * N)[:, None] + np.arange(N)
        if q.reshape(M, K)[at, tk[short][:, None]].any():
            return s, False
    if int(ids.view(np.uint32).max()) >= vocab_size:
        return s, False
    used = np.not_equal(q, 0, out=w.get("used", bool, q.size))
    nz = np.not_equal(ids, 0, out=w.get("nz", bool, q.size))
    if np.greater(nz, used, out=w.get("t1", bool, q.size)).any():  # unused, id not 0
        return s, False
    if _out_of_order(ids, q, used, w):
        return s, False
    if sampled.any() and _repeats(ids, used, nz, M, min(K, int(tk[sampled].max())), w):
        return s, False
    if member and not (_members(ids, used, s.d, M, w) == s.drafted).all():
        return s, False
    return s, True


def _out_of_order(ids: Any, q: Any, used: Any, w: Scratch) -> bool:
    """Is any pair of neighbouring places (p, p + 1) of one position out of canonical order:
    q rises, or equal used q with ids not ascending?"""
    K = MAX_TOP_K
    cand = np.less_equal(q[:-1], q[1:], out=w.get("t1", bool, q.size - 1))
    cand &= used[1:]
    cand[K - 1::K] = False  # the last place of one position and the first of the next
    if not cand.any():
        return False
    at = np.flatnonzero(cand)
    return bool(((q[at] < q[at + 1]) | (ids[at] >= ids[at + 1])).any())


def _repeats(ids: Any, used: Any, nz: Any, M: int, D: int, w: Scratch) -> bool:
    """Does a used id appear twice at one position? Unused places carry id 0 and, past the
    first D, every place is unused; so after sorting each position's first D ids, a repeat is
    an equal non-zero neighbour, or id 0 used at two places."""
    K = MAX_TOP_K
    if D <= 1:
        return False
    srt = w.get("srt", np.int32, M * D).reshape(M, D)
    np.copyto(srt, ids.reshape(M, K)[:, :D])
    srt.sort(axis=1)
    srt = srt.reshape(-1)
    dup = np.equal(srt[1:], srt[:-1], out=w.get("t1", bool, srt.size - 1))
    dup &= np.not_equal(srt[1:], 0, out=w.get("t2", bool, srt.size - 1))
    dup[D - 1::D] = False  # the last place of one position and the first of the next
    if dup.any():
        return True
    zero_used = np.greater(used, nz, out=w.get("t1", bool, used.size))
    if not zero_used.any():
        return False
    rows = np.flatnonzero(zero_used) // K  # ascending: a repeat is two equal neighbours
    return bool((rows[1:] == rows[:-1]).any())


def _members(ids: Any, used: Any, d: Any, M: int, w: Scratch) -> Any:
    """Per position: is its draft id one of its used support ids? Used ids are distinct (the
    distinctness rule runs first), so a position matches at one place or none."""
    K = MAX_TOP_K
    hit = np.equal(ids.reshape(M, K), d[:, None],
                   out=w.get("t2", bool, M * K).reshape(M, K)).reshape(-1)
    hit &= used
    out = np.zeros(M, bool)
    out[np.flatnonzero(hit) // K] = True
    return out


def _inputs(sampled_mask: ArrayLike, support_ids: ArrayLike, proposal_q: ArrayLike,
            draft_ids: ArrayLike, needed: ArrayLike, top_ks: ArrayLike) -> tuple[Any, ...]:
    mask = np.asarray(sampled_mask)
    sup, q = np.asarray(support_ids), np.asarray(proposal_q)
    drafts = np.asarray(draft_ids)
    need = np.asarray(needed, dtype=bool)
    tk = np.asarray(top_ks).astype(np.int64)
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
    support id, so 9.2's membership test is left to the draw)."""
    w = scratch or Scratch()
    s, refuse_92 = _checked_92(sampled_mask, support_ids, proposal_q, draft_ids, needed,
                               vocab_size, top_ks, False, w)
    bad, expect, u, pos = s.bad_draws(seeds, generations, anchor_pos)
    if not bad.size:
        return
    # A draft outside its support fails 9.2, which comes first: name that one if any.
    if not _members(s.ids, s.q != 0, s.d, s.M, w)[bad].all():
        refuse_92()
    _raise_draw(int(bad[0]), s.N, s.d, expect, u, pos, seeds, generations)


def _checked_92(sampled_mask: ArrayLike, support_ids: ArrayLike, proposal_q: ArrayLike,
                draft_ids: ArrayLike, needed: ArrayLike, vocab_size: int, top_ks: ArrayLike,
                member: bool, w: Scratch) -> tuple[_Scan, Callable[[], None]]:
    """Section 9.2 decided by the one pass, the first offender named when it fails; the scan,
    and what names the first offender should a later check find one."""
    mask, sup, q, drafts, need, tk = _inputs(sampled_mask, support_ids, proposal_q, draft_ids,
                                             needed, top_ks)
    s, ok = _pass_92(mask, sup, q, drafts, need, vocab_size, tk, member, w)

    def refuse() -> None:
        _raise_first(mask, sup, q, drafts, need, vocab_size, tk, w)

    if not ok:
        refuse()
    return s, refuse


def _uniforms(seeds: ArrayLike, generations: ArrayLike, anchor_pos: ArrayLike, n: int,
              N: int) -> tuple[Any, Any]:
    """u of every position, flat ``[n * N]`` int64, and the positions ``[n, N]``."""
    pos = np.asarray(anchor_pos, dtype=np.int64)[:, None] + 1 + np.arange(N)[None, :]
    u = draw_u(np.asarray(seeds, dtype=np.uint64)[:, None],
               np.asarray(generations, dtype=np.uint64)[:, None], pos)
    return u.reshape(-1).astype(np.int64), pos


def _raise_draw(at: int, N: int, d: Any, expect: Any, u: Any, pos: Any, seeds: ArrayLike,
                generations: ArrayLike) -> None:
    i, j = divmod(at, N)
    raise ReplyValueError(
        f"entry {i} position {j}: draft id {int(d[at])} is not the draw"
        f" {int(expect[at])} of seed {int(np.asarray(seeds)[i])}, generation"
        f" {int(np.asarray(generations)[i])}, position {int(pos[i, j])} (u {int(u[at])})",
        entry=i, position=j, field="draft_ids", value=int(d[at]), limit=int(expect[at]))


def check_draws(sampled_mask: ArrayLike, support_ids: ArrayLike, proposal_q: ArrayLike,
                draft_ids: ArrayLike, seeds: ArrayLike, generations: ArrayLike,
                anchor_pos: ArrayLike, *, scratch: Scratch | None = None) -> None:
    """Re-derive every drafted position's draw (9.3) and refuse a reply whose draft differs.
    Run after ``validate``. Position j of entry i is the token at ``anchor_pos[i] + j + 1``.
    One running sum of q over the whole reply and one binary search for all positions
    (``_Scan.draws``)."""
    mask = np.asarray(sampled_mask).astype(bool)
    N = np.asarray(draft_ids).shape[1]
    ids, q, _ = _wire_arrays(support_ids, proposal_q, 1 << 31)
    s = _Scan(ids, q, np.asarray(draft_ids).reshape(-1), N, scratch or Scratch())
    s.drafted = (s.T > 0) & np.repeat(mask, N)
    bad, expect, u, pos = s.bad_draws(seeds, generations, anchor_pos)
    if bad.size:
        _raise_draw(int(bad[0]), N, s.d, expect, u, pos, seeds, generations)


def _raise_first(mask: Any, sup: Any, q: Any, drafts: Any, need: Any, vocab_size: int,
                 tk: Any, w: Scratch) -> None:
    """Name the first offender of section 9.2 (the failure path only: the one pass has refused
    the reply). The rules hold entry by entry, so whether the first k entries pass is monotone
    in k: a binary search with the one pass finds the first failing entry, and ``_explain``
    reads that entry rule by rule."""
    lo, hi = 0, drafts.shape[0]  # entries [0, lo) pass, [0, hi) do not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _pass_92(mask[:mid], sup[:mid], q[:mid], drafts[:mid], need[:mid], vocab_size,
                    tk[:mid], True, w)[1]:
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
