"""Sampled proposals, dyadic24 (docs/contract.md section 9).

* ``build_q``: the proposal q of one drafted position from its logits (9.1): top-K, top-p,
  a float softmax, then integer arithmetic only, so the sum is exactly ``Q_TOTAL``.
* ``draw_u`` / ``draw``: the counter-based draw (9.3). ``u`` depends only on (seed, generation,
  position), so anyone holding q can recompute the draft.
* ``validate``: what a sampled reply must satisfy (9.2), vectorised, naming the first offender.
* ``check_draws``: the stricter check that re-derives every draw.
"""

from __future__ import annotations

from typing import Any, Final

import numpy as np
import numpy.typing as npt

from .constants import MAX_TOP_K, Q_BITS, Q_TOTAL
from .errors import ReplyValueError

__all__ = ["MAX_TOP_K", "Q_BITS", "Q_TOTAL", "build_q", "check_draws", "draw", "draw_u",
           "quantize", "top_k_probs", "validate"]

# SplitMix64 constants (Steele, Lea and Flood, 2014).
_GOLDEN: Final = np.uint64(0x9E3779B97F4A7C15)
_MIX1: Final = np.uint64(0xBF58476D1CE4E5B9)
_MIX2: Final = np.uint64(0x94D049BB133111EB)

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
    Broadcasts like numpy."""
    s = np.asarray(seed, dtype=np.uint64)
    g = np.asarray(generation, dtype=np.uint64) & np.uint64(0xFFFFFFFF)
    p = np.asarray(position, dtype=np.uint64) & np.uint64(0xFFFFFFFF)
    with np.errstate(over="ignore"):
        counter = (g << np.uint64(32)) | p
        z = s + (counter + np.uint64(1)) * _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _MIX1
        z = (z ^ (z >> np.uint64(27))) * _MIX2
        z = z ^ (z >> np.uint64(31))
    return np.asarray(z >> np.uint64(64 - Q_BITS)).astype(np.uint32)


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


def _positions_t(support_ids: Any, proposal_q: Any) -> tuple[Any, Any]:
    """Support ids and q of every position as ``[K, M]`` (place-major) contiguous arrays. Every
    per-position rule is then an elementwise test over rows of M positions plus one reduction
    along axis 0, instead of M tiny reductions over K places (what made ``[M, K]`` slow)."""
    ids, q = np.asarray(support_ids), np.asarray(proposal_q)
    k = ids.shape[-1]
    m = ids.size // k if k else 0
    return (np.ascontiguousarray(ids.reshape(m, k).T),
            np.ascontiguousarray(q.reshape(m, k).T))


def _places_ok_t(ids: Any, q: Any, used: Any, vocab_size: int, top_k: Any) -> Any:
    """Per position (column of ``[K, M]`` ids and q): is it a canonical, complete q (9.1/9.2)?
    q sums to 2**24; used ids in [0, vocab_size), unused places carry id 0; no used place at or
    past top_k; canonical order (q non-increasing, equal q by ascending id, zeros only at the
    end); the used ids distinct."""
    k = ids.shape[0]
    place = np.arange(k)[:, None]
    ok = q.sum(axis=0, dtype=np.uint64) == Q_TOTAL
    bad = (used & ((ids < 0) | (ids >= vocab_size))) | (~used & (ids != 0))
    bad |= used & (place >= np.asarray(top_k)[None, :])
    qa, qb, ia, ib = q[:-1], q[1:], ids[:-1], ids[1:]
    bad[1:] |= ~((qa > qb) | ((qa == qb) & ((qb == 0) | (ia < ib))))
    ok &= ~bad.any(axis=0)
    # Distinct used ids: canonical order makes the used places a prefix of the first `depth`
    # places, and ascending ids within equal q; a repeat across q levels needs a sort.
    rows_used = np.flatnonzero(used.any(axis=1))
    depth = int(rows_used[-1]) + 1 if rows_used.size else 0
    if depth > 1:
        keyed = np.where(used[:depth], ids[:depth].astype(np.int64),
                         -1 - np.arange(depth, dtype=np.int64)[:, None])  # [depth, M]
        srt = np.ascontiguousarray(np.sort(keyed.T, axis=1).T)
        ok &= ~(srt[1:] == srt[:-1]).any(axis=0)
    return ok


def validate(sampled_mask: ArrayLike, support_ids: ArrayLike, proposal_q: ArrayLike,
             draft_ids: ArrayLike, needed: ArrayLike, vocab_size: int,
             top_ks: ArrayLike) -> None:
    """Section 9.2. ``needed[i]``: entry i asked for a draft and got a usable status;
    ``top_ks[i]``: its top_k. Raises ReplyValueError naming entry, position and value.

    One pass over the positions in place-major layout (``_positions_t``); only on failure the
    entry-by-entry search of ``_raise_first`` names the first offender."""
    mask = np.asarray(sampled_mask)
    sup_in = np.asarray(support_ids)
    q_in = np.asarray(proposal_q)
    drafts = np.asarray(draft_ids)
    need = np.asarray(needed, dtype=bool)
    tk = np.asarray(top_ks).astype(np.int64)
    n, N = drafts.shape
    if mask.shape != (n,) or sup_in.shape != (n, N, MAX_TOP_K) \
            or q_in.shape != (n, N, MAX_TOP_K):
        raise ReplyValueError(f"sampled arrays have shapes {mask.shape}, {sup_in.shape},"
                              f" {q_in.shape}; expected ({n},), ({n}, {N}, {MAX_TOP_K}) twice")
    if need.shape != (n,) or tk.shape != (n,):
        raise ValueError(f"needed {need.shape} and top_ks {tk.shape} must both be ({n},)")
    want = need & (tk > 0)
    sampled = mask == 1
    ids, q = _positions_t(sup_in, q_in)  # [K, M]
    if q.dtype.kind == "i":
        q = q.astype(np.int64)  # a negative q is then simply not a used place that sums right
    d = drafts.reshape(-1)  # [M]
    used = q != 0  # [K, M]; a negative q fails the sum or the order
    zero_pos = ~used.any(axis=0) & ~(ids != 0).any(axis=0)  # [M]
    drafted = ~(zero_pos & (d == 0))
    ok_rows = _places_ok_t(ids, q, used & (q > 0), vocab_size, np.repeat(tk, N)) \
        & ~(q < 0).any(axis=0)
    in_support = ((ids == d[None, :]) & (q > 0)).any(axis=0)
    pos_ok = ~drafted | (ok_rows & in_support)
    sampled_pos = np.repeat(sampled, N)
    fine = (
        ((mask == 0) | sampled).all()
        and (sampled == want).all()
        and zero_pos[~sampled_pos].all()
        and pos_ok[sampled_pos].all()
    )
    if fine:
        return
    _raise_first(mask, sup_in.astype(np.int64), q_in.astype(np.int64), drafts.astype(np.int64),
                 need, want, vocab_size, tk, zero_pos.reshape(n, N), drafted.reshape(n, N),
                 ok_rows.reshape(n, N), in_support.reshape(n, N))


def _raise_first(mask: Any, sup: Any, q: Any, drafts: Any, need: Any, want: Any, vocab_size: int,
                 tk: Any, zero_pos: Any, drafted: Any, ok_rows: Any, in_support: Any) -> None:
    n, N = drafts.shape
    for i in range(n):
        if int(mask[i]) not in (0, 1) or bool(mask[i]) != bool(want[i]):
            raise ReplyValueError(
                f"entry {i}: sampled_mask {int(mask[i])}, the contract requires"
                f" {int(want[i])} (top_k {int(tk[i])}, RF_NEED_DRAFT with a usable status"
                f" {bool(need[i])})",
                entry=i, field="sampled_mask", value=int(mask[i]), limit=int(want[i]))
        if not mask[i]:
            for j in range(N):
                if not zero_pos[i, j]:
                    raise ReplyValueError(
                        f"entry {i} position {j}: support/q carry values on an entry that is"
                        " not sampled", entry=i, position=j, field="support")
            continue
        for j in range(N):
            if not drafted[i, j]:
                continue
            ids, qq, k = sup[i, j], q[i, j], int(tk[i])
            if not ok_rows[i, j]:
                total = int(qq.sum())
                if total != Q_TOTAL:
                    raise ReplyValueError(
                        f"entry {i} position {j}: q sums to {total}, not 2**24 = {Q_TOTAL}",
                        entry=i, position=j, field="proposal_q", value=total, limit=Q_TOTAL)
                for p in range(MAX_TOP_K):
                    if qq[p] > 0 and not 0 <= ids[p] < vocab_size:
                        raise ReplyValueError(
                            f"entry {i} position {j} place {p}: support id {int(ids[p])}"
                            f" outside [0, {vocab_size})", entry=i, position=j,
                            field="support_ids", value=int(ids[p]), limit=vocab_size)
                    if qq[p] > 0 and p >= k:
                        raise ReplyValueError(
                            f"entry {i} position {j} place {p}: q {int(qq[p])} past top_k {k}",
                            entry=i, position=j, field="proposal_q", value=p, limit=k)
                    if qq[p] == 0 and ids[p] != 0:
                        raise ReplyValueError(
                            f"entry {i} position {j} place {p}: unused place carries id"
                            f" {int(ids[p])}", entry=i, position=j, field="support_ids",
                            value=int(ids[p]))
                used = ids[qq > 0].tolist()
                if len(set(used)) != len(used):
                    dup = next(x for x in used if used.count(x) > 1)
                    raise ReplyValueError(
                        f"entry {i} position {j}: support id {dup} appears twice",
                        entry=i, position=j, field="support_ids", value=dup)
                raise ReplyValueError(
                    f"entry {i} position {j}: support is not in canonical order"
                    f" (q descending, ties by id): ids {ids[qq > 0].tolist()},"
                    f" q {qq[qq > 0].tolist()}", entry=i, position=j, field="proposal_q")
            if not in_support[i, j]:
                raise ReplyValueError(
                    f"entry {i} position {j}: draft id {int(drafts[i, j])} is not a support id"
                    " with q > 0", entry=i, position=j, field="draft_ids",
                    value=int(drafts[i, j]))
    raise ReplyValueError("sampled reply violates section 9.2")  # pass and search disagree


def check_draws(sampled_mask: ArrayLike, support_ids: ArrayLike, proposal_q: ArrayLike,
                draft_ids: ArrayLike, seeds: ArrayLike, generations: ArrayLike,
                anchor_pos: ArrayLike) -> None:
    """Re-derive every drafted position's draw (9.3) and refuse a reply whose draft differs.
    Run after ``validate``. Position j of entry i is the token at ``anchor_pos[i] + j + 1``.
    Vectorised like ``validate``: running sums down the places of ``[K, M]`` q, and the drawn
    place is how many running sums are at most u (the first that exceeds it)."""
    mask = np.asarray(sampled_mask).astype(bool)
    drafts = np.asarray(draft_ids)
    n, N = drafts.shape
    pos = np.asarray(anchor_pos, dtype=np.int64)[:, None] + 1 + np.arange(N)[None, :]
    u = draw_u(np.asarray(seeds, dtype=np.uint64)[:, None],
               np.asarray(generations, dtype=np.uint64)[:, None], pos)  # [n, N]
    ids, q = _positions_t(support_ids, proposal_q)  # [K, M]
    drafted = (q != 0).any(axis=0) & np.repeat(mask, N)  # [M]
    if not drafted.any():
        return
    k, m = q.shape
    uu = u.reshape(-1).astype(np.int64)
    # The running sum place by place (np.cumsum along axis 0 walks column by column: slow);
    # past the last used place it no longer changes, so those places count at once.
    rows_used = np.flatnonzero((q != 0).any(axis=1))
    depth = int(rows_used[-1]) + 1 if rows_used.size else 0
    acc = np.zeros(m, dtype=np.int64)
    place = np.zeros(m, dtype=np.int64)
    for r in range(depth):
        acc += q[r]
        place += acc <= uu
    place += (k - depth) * (acc <= uu)
    place[place >= k] = 0  # no running sum exceeds u: like argmax of all False (q is refused)
    expect = ids[place, np.arange(m)].reshape(n, N)
    bad = drafted.reshape(n, N) & (expect != drafts)
    if bad.any():
        i, j = (int(x) for x in np.argwhere(bad)[0])
        raise ReplyValueError(
            f"entry {i} position {j}: draft id {int(drafts[i, j])} is not the draw"
            f" {int(expect[i, j])} of seed {int(np.asarray(seeds)[i])}, generation"
            f" {int(np.asarray(generations)[i])}, position {int(pos[i, j])} (u {int(u[i, j])})",
            entry=i, position=j, field="draft_ids", value=int(drafts[i, j]),
            limit=int(expect[i, j]))
