"""Sampled proposals on the device (CONTRACT 9): a torch mirror of ``protocol.sampled.build_q``
and ``protocol.sampled.draw`` over a batch, with no host synchronisation.

The mirror follows the numpy definition step by step, including the order in which floats are
added (numpy's pairwise ``sum`` and the sequential ``cumsum``), so that on the CPU it returns
the same q as ``protocol.sampled.build_q`` for the same fp32 logits. The one operation that can
differ is ``exp``: torch and numpy may round it differently in the last bit (about 1 value in
20 on x86), which changes q only when ``p * 2**24`` lies within an ulp of an integer, two
fractional parts tie within an ulp, or a cumulative probability lies within an ulp of top_p.
The contract does not need q to match a host recomputation (the client checks that q is valid
and re-derives the draw from q); the draw itself is exact integer arithmetic here and there.

Shapes: B lanes, V vocabulary, K = ``MAX_TOP_K`` support places.
"""

from __future__ import annotations

import torch
from torch import Tensor

from protocol.sampled import MAX_TOP_K, Q_TOTAL

_PAIRWISE_LANES = 8  # numpy's pairwise_sum unrolls 8 partial sums for 8 <= n <= 128


def numpy_sum(x: Tensor, n: Tensor) -> Tensor:
    """``np.sum(row[:n])`` of each float64 row of x [B, K] (K <= 128, x >= 0), bit for bit.

    numpy sums a contiguous float64 array of n < 8 elements left to right; for 8 <= n <= 128 it
    keeps 8 running sums over the whole blocks of 8, folds them as
    ((r0+r1)+(r2+r3))+((r4+r5)+(r6+r7)) and then adds the leftover elements in order. Adding an
    exact +0.0 never changes a non-negative float, which lets every lane run the same ops.
    """
    b, k = x.shape
    dev = x.device
    zero = torch.zeros((), dtype=x.dtype, device=dev)
    place = torch.arange(k, device=dev)  # [K]
    xs = torch.where(place.unsqueeze(0) < n.unsqueeze(1), x, zero)  # [B, K]
    seq = xs[:, 0]  # [B]
    for i in range(1, min(k, _PAIRWISE_LANES)):
        seq = seq + xs[:, i]
    if k < _PAIRWISE_LANES:
        return seq
    n_blocks = k // _PAIRWISE_LANES
    blocks = xs[:, :n_blocks * _PAIRWISE_LANES].view(b, n_blocks, _PAIRWISE_LANES)  # [B, nb, 8]
    whole = n // _PAIRWISE_LANES  # [B] whole blocks of this row
    in_whole = torch.arange(n_blocks, device=dev).unsqueeze(0) < whole.unsqueeze(1)  # [B, nb]
    blocks = torch.where(in_whole.unsqueeze(2), blocks, zero)  # [B, nb, 8]
    r = blocks[:, 0]  # [B, 8]
    for j in range(1, n_blocks):
        r = r + blocks[:, j]
    left = (r[:, 0] + r[:, 1]) + (r[:, 2] + r[:, 3])  # [B]
    total = left + ((r[:, 4] + r[:, 5]) + (r[:, 6] + r[:, 7]))  # [B]
    tail_at = (whole * _PAIRWISE_LANES).unsqueeze(1) + torch.arange(
        _PAIRWISE_LANES - 1, device=dev)  # [B, 7]
    tail = xs.gather(1, tail_at.clamp_max(k - 1))  # [B, 7]
    tail = torch.where(tail_at < n.unsqueeze(1), tail, zero)  # [B, 7]
    for i in range(_PAIRWISE_LANES - 1):
        total = total + tail[:, i]
    return torch.where(n >= _PAIRWISE_LANES, total, seq)  # [B]


def _inverse_rank(order: Tensor) -> Tensor:
    """rank[b, order[b, r]] = r."""
    rank = torch.empty_like(order)  # [B, K]
    ranks = torch.arange(order.shape[1], device=order.device).expand_as(order)  # [B, K]
    return rank.scatter_(1, order, ranks)


def build_q(z: Tensor, top_k: Tensor, temperature: Tensor, top_p: Tensor) -> tuple[Tensor, Tensor]:
    """Support ids and q, both int64 [B, K], in canonical order (9.1).

    z [B, V] fp32 final logits (Markov bias included); top_k [B] int64 in [1, K] (lanes that
    draft greedily pass any value in range and ignore the result); temperature [B] float64 > 0;
    top_p [B] float64 in [0, 1].
    """
    vocab = z.shape[1]
    kmax = min(MAX_TOP_K, vocab)
    # The kmax best by (value descending, id ascending): every id above the kmax-th value, then
    # the lowest ids among those equal to it. Found on the fp32 z: dividing by a temperature
    # t > 0 in float64 keeps every order and every tie of fp32 values (float64 holds z / t
    # with room to spare: no two fp32 values meet, none overflows), so no [B, V] float64 copy
    # of z is needed, and the key fits int32 (2 V < 2**31).
    kth = torch.topk(z, kmax, dim=1).values[:, -1:]  # [B, 1]
    vocab_ids = torch.arange(vocab, device=z.device, dtype=torch.int32)  # [V]
    key = torch.where(z > kth, 2 * vocab, torch.where(z == kth, vocab - vocab_ids, -1))
    chosen = torch.topk(key, kmax, dim=1).indices  # [B, kmax] unordered
    chosen, _ = torch.sort(chosen, dim=1)  # [B, kmax] ascending ids
    return _build_q_at(chosen, z.gather(1, chosen), top_k, temperature, top_p, kmax)


def build_q_among(z: Tensor, ids: Tensor, top_k: Tensor, temperature: Tensor, top_p: Tensor,
                  vocab: int) -> tuple[Tensor, Tensor]:
    """:func:`build_q` of the logits that are ``z`` [B, C] fp32 at the distinct ``ids``
    [B, C] int64 and -inf at every other id of the vocabulary (the candidate walk): ``q`` over
    the C candidates, so at most C places are used (top_k above C takes all C)."""
    kmax = min(MAX_TOP_K, vocab, ids.shape[1])
    by_id, order = torch.sort(ids, dim=1)  # [B, C] ascending ids
    zs, perm = torch.sort(z.gather(1, order), dim=1, descending=True, stable=True)  # [B, C]
    best, zk = by_id.gather(1, perm)[:, :kmax], zs[:, :kmax]  # [B, kmax]
    chosen, back = torch.sort(best, dim=1)  # ascending ids, as build_q hands them on
    return _build_q_at(chosen, zk.gather(1, back), top_k, temperature, top_p, kmax)


def _build_q_at(chosen: Tensor, z_chosen: Tensor, top_k: Tensor, temperature: Tensor,
                top_p: Tensor, kmax: int) -> tuple[Tensor, Tensor]:
    """build_q from the kmax best places: ids ``chosen`` [B, kmax] ascending, their fp32
    logits ``z_chosen``."""
    dev = chosen.device
    k = top_k.clamp(1, kmax)  # [B]
    zk = z_chosen.double() / temperature.unsqueeze(1)  # [B, kmax]
    zk, perm = torch.sort(zk, dim=1, descending=True, stable=True)  # [B, kmax]
    ids = chosen.gather(1, perm)  # [B, kmax] value desc, id asc
    place = torch.arange(kmax, device=dev).unsqueeze(0)  # [1, kmax]
    zero = torch.zeros((), dtype=torch.float64, device=dev)

    # softmax over the first k places
    p = torch.where(place < k.unsqueeze(1), torch.exp(zk - zk[:, :1]), zero)  # [B, kmax]
    p = p / numpy_sum(p, k).unsqueeze(1)  # [B, kmax]
    # top_p: the smallest prefix whose cumulative p reaches top_p, renormalised
    use_top_p = (top_p > 0.0) & (top_p < 1.0)  # [B]
    cum = torch.cumsum(p, dim=1)  # [B, kmax] (places past k add 0.0)
    below = (cum < top_p.unsqueeze(1)) & (place < k.unsqueeze(1))  # [B, kmax]
    keep = torch.minimum(below.sum(dim=1) + 1, k)  # [B]
    p_cut = torch.where(place < keep.unsqueeze(1), p, zero)  # [B, kmax]
    p_cut = p_cut / numpy_sum(p_cut, keep).unsqueeze(1)  # [B, kmax]
    p = torch.where(use_top_p.unsqueeze(1), p_cut, p)  # [B, kmax]
    size = torch.where(use_top_p, keep, k)  # [B] support places before dropping zeros
    live = place < size.unsqueeze(1)  # [B, kmax]

    return _canonical(ids, _quantize(p, live, size), kmax)


def _quantize(p: Tensor, live: Tensor, size: Tensor) -> Tensor:
    """protocol.sampled.quantize per row over its ``size`` live places: q int64 [B, kmax]."""
    scaled = p * float(Q_TOTAL)  # [B, kmax] exact: a power of two
    floor = torch.floor(scaled)  # [B, kmax]
    frac = scaled - floor  # [B, kmax]
    q = floor.long()  # [B, kmax]
    rest = Q_TOTAL - q.sum(dim=1)  # [B]
    size_c = size.clamp_min(1).unsqueeze(1)  # [B, 1]
    # rest > 0: one unit each, cycling, to places by fractional part descending (ties: place)
    order_up = torch.sort(torch.where(live, -frac, float("inf")), dim=1, stable=True).indices
    rank_up = _inverse_rank(order_up)  # [B, kmax]
    give = (rest.unsqueeze(1) - rank_up + size_c - 1).div(size_c, rounding_mode="floor")
    give = torch.where(live & (rest.unsqueeze(1) > 0), give.clamp_min(0), 0)  # [B, kmax]
    # rest < 0 (a float sum above 1): take units back by fractional part ascending, only from
    # places holding some
    donors = live & (q > 0)  # [B, kmax]
    n_donors = donors.sum(dim=1, keepdim=True).clamp_min(1)  # [B, 1]
    order_dn = torch.sort(torch.where(donors, frac, float("inf")), dim=1, stable=True).indices
    rank_dn = _inverse_rank(order_dn)  # [B, kmax]
    take = (-rest.unsqueeze(1) - rank_dn + n_donors - 1).div(n_donors, rounding_mode="floor")
    take = torch.where(donors & (rest.unsqueeze(1) < 0), take.clamp_min(0), 0)  # [B, kmax]
    return q + give - take


def _canonical(ids: Tensor, q: Tensor, kmax: int) -> tuple[Tensor, Tensor]:
    """Order by q descending, ties by id ascending; zero places last with id 0; pad to K."""
    by_id = torch.sort(ids, dim=1, stable=True)  # ascending id
    q = q.gather(1, by_id.indices)  # [B, kmax]
    by_q = torch.sort(q, dim=1, descending=True, stable=True)
    q = by_q.values  # [B, kmax]
    ids = by_id.values.gather(1, by_q.indices)  # [B, kmax]
    ids = torch.where(q > 0, ids, 0)  # [B, kmax]
    if kmax < MAX_TOP_K:
        pad = MAX_TOP_K - kmax
        ids = torch.nn.functional.pad(ids, (0, pad))  # [B, K]
        q = torch.nn.functional.pad(q, (0, pad))  # [B, K]
    return ids, q


def draw(ids: Tensor, q: Tensor, u: Tensor) -> Tensor:
    """protocol.sampled.draw: the first place whose running sum of q exceeds u.

    ids, q [B, K] int64; u [B] int64 in [0, 2**24) -> [B] int64.
    """
    csum = torch.cumsum(q, dim=1)  # [B, K] exact integers
    place = (csum <= u.unsqueeze(1)).sum(dim=1, keepdim=True)  # [B, 1]
    place = place.clamp_max(q.shape[1] - 1)  # [B, 1] only a bad q could pass the end
    return ids.gather(1, place).squeeze(1)  # [B]
