"""``protocol.sampled.validate`` and ``check_draws`` are one vectorised pass each; this checks
them against the contract's rules written entry by entry, place by place, in plain Python
(sections 9.2 and 9.3), on random valid replies and on replies broken in random and in
adversarial ways (hypothesis). The fast path must accept exactly what the rules accept."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol import sampled
from protocol.constants import MAX_TOP_K, Q_TOTAL
from protocol.errors import ReplyValueError

VOCAB = 40
MASK64 = (1 << 64) - 1


def splitmix_u(seed: int, generation: int, position: int) -> int:
    """Section 9.3's pseudo-code, in Python integers."""
    counter = ((generation & 0xFFFFFFFF) << 32) | (position & 0xFFFFFFFF)
    z = (seed + (counter + 1) * 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    z = z ^ (z >> 31)
    return z >> 40


def rules_accept(mask: Any, sup: Any, q: Any, drafts: Any, needed: Any, top_ks: Any) -> bool:
    """Section 9.2, entry by entry."""
    n, N = drafts.shape
    for i in range(n):
        want = bool(needed[i]) and int(top_ks[i]) > 0
        if int(mask[i]) not in (0, 1) or bool(mask[i]) != want:
            return False
        for j in range(N):
            ids = [int(x) for x in sup[i, j]]
            qq = [int(x) for x in q[i, j]]
            d = int(drafts[i, j])
            if not mask[i]:
                if any(ids) or any(qq):
                    return False
                continue
            if not any(ids) and not any(qq) and d == 0:
                continue  # not drafted
            used = [p for p in range(MAX_TOP_K) if qq[p] > 0]
            if used != list(range(len(used))) or sum(qq) != Q_TOTAL:
                return False
            for p in range(MAX_TOP_K):
                if qq[p] > 0 and not (0 <= ids[p] < VOCAB and p < int(top_ks[i])):
                    return False
                if qq[p] == 0 and ids[p] != 0:
                    return False
            if len({ids[p] for p in used}) != len(used):
                return False
            for a, b in itertools.pairwise(used):
                if not (qq[a] > qq[b] or (qq[a] == qq[b] and ids[a] < ids[b])):
                    return False
            if d not in [ids[p] for p in used]:
                return False
    return True


def draws_hold(mask: Any, sup: Any, q: Any, drafts: Any, seeds: Any, gens: Any,
               anchors: Any) -> bool:
    """Section 9.3, position by position: the first place whose running sum exceeds u."""
    n, N = drafts.shape
    for i in range(n):
        if not mask[i]:
            continue
        for j in range(N):
            qq = [int(x) for x in q[i, j]]
            if not any(qq):
                continue
            u = splitmix_u(int(seeds[i]), int(gens[i]), int(anchors[i]) + j + 1)
            run, pick = 0, 0
            for p in range(MAX_TOP_K):
                run += qq[p]
                if run > u:
                    pick = p
                    break
            if int(sup[i, j, pick]) != int(drafts[i, j]):
                return False
    return True


def build(seed: int, n: int, N: int) -> dict[str, Any]:
    """A valid sampled reply: entries alternate sampled, greedy and undrafted."""
    rng = np.random.default_rng(seed)
    mask = np.zeros(n, np.uint8)
    sup = np.zeros((n, N, MAX_TOP_K), np.int32)
    q = np.zeros((n, N, MAX_TOP_K), np.uint32)
    drafts = np.zeros((n, N), np.int32)
    needed = rng.random(n) < 0.8
    top_ks = rng.integers(0, 9, n).astype(np.int32)
    seeds = rng.integers(0, 1 << 63, n, dtype=np.uint64)
    gens = rng.integers(0, 1 << 32, n, dtype=np.uint64)
    anchors = rng.integers(0, 1000, n)
    for i in range(n):
        if needed[i] and top_ks[i] > 0:
            mask[i] = 1
            k = int(rng.integers(1, N + 1))
            for j in range(k):
                ids, qq = sampled.build_q(rng.normal(size=VOCAB) * 2, int(top_ks[i]),
                                          float(rng.uniform(0.3, 2)), float(rng.uniform(0, 1)))
                sup[i, j], q[i, j] = ids, qq
                u = splitmix_u(int(seeds[i]), int(gens[i]), int(anchors[i]) + j + 1)
                drafts[i, j] = sampled.draw(ids, qq, u)
        elif needed[i]:
            drafts[i] = rng.integers(0, VOCAB, N)  # greedy drafts carry no q
    return dict(mask=mask, sup=sup, q=q, drafts=drafts, needed=needed, top_ks=top_ks,
                seeds=seeds, gens=gens, anchors=anchors)


def fast_accepts(r: dict[str, Any]) -> bool:
    try:
        sampled.validate(r["mask"], r["sup"], r["q"], r["drafts"], r["needed"], VOCAB,
                         r["top_ks"])
    except ReplyValueError:
        return False
    return True


def fast_draws_hold(r: dict[str, Any]) -> bool:
    try:
        sampled.check_draws(r["mask"], r["sup"], r["q"], r["drafts"], r["seeds"], r["gens"],
                            r["anchors"])
    except ReplyValueError:
        return False
    return True


def rules(r: dict[str, Any]) -> bool:
    return rules_accept(r["mask"], r["sup"], r["q"], r["drafts"], r["needed"], r["top_ks"])


def draws(r: dict[str, Any]) -> bool:
    return draws_hold(r["mask"], r["sup"], r["q"], r["drafts"], r["seeds"], r["gens"],
                      r["anchors"])


SPECIAL = [0, 1, -1, VOCAB - 1, VOCAB, Q_TOTAL, Q_TOTAL - 1, (1 << 31) - 1, 1 << 23]


@st.composite
def mutations(draw: Any) -> list[tuple[str, int, int, int, int]]:
    kinds = st.sampled_from(["sup", "q", "drafts", "mask", "swap", "dup", "move", "seed",
                             "top_k", "top_k_below", "needed"])
    one = st.tuples(kinds, st.integers(0, 63), st.integers(0, 63), st.integers(0, 31),
                    st.one_of(st.sampled_from(SPECIAL), st.integers(-5, 1 << 24)))
    return draw(st.lists(one, max_size=3))


def mutate(r: dict[str, Any], muts: list[tuple[str, int, int, int, int]]) -> None:
    n, N = r["drafts"].shape
    for kind, a, b, p, v in muts:
        i, j = a % n, b % N
        if kind == "sup":
            r["sup"][i, j, p] = v
        elif kind == "q":
            r["q"][i, j, p] = v % (1 << 32)
        elif kind == "drafts":
            r["drafts"][i, j] = v
        elif kind == "mask":
            r["mask"][i] = v % 3
        elif kind == "swap":  # two places exchanged: order broken unless equal
            pq = (p + 1) % MAX_TOP_K
            for name in ("sup", "q"):
                r[name][i, j, [p, pq]] = r[name][i, j, [pq, p]]
        elif kind == "dup":  # a used id repeated at the next place, q moved to keep the sum
            if r["q"][i, j, 1] > 0:
                r["sup"][i, j, 1] = r["sup"][i, j, 0]
        elif kind == "move":  # one unit of q from the first place to the second
            if r["q"][i, j, 0] > 0:
                r["q"][i, j, 0] -= 1
                r["q"][i, j, 1] += 1
        elif kind == "seed":
            r["seeds"][i] = np.uint64(v % (1 << 64))
        elif kind == "top_k":
            r["top_ks"][i] = v % 40
        elif kind == "top_k_below":  # top_k one below a drafted position's used places
            used = int((r["q"][i, j] > 0).sum())
            if used > 1:
                r["top_ks"][i] = used - 1
        elif kind == "needed":
            r["needed"][i] = not r["needed"][i]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 12), N=st.integers(1, 5),
       muts=mutations())
def test_fast_checks_accept_exactly_what_the_rules_accept(seed: int, n: int, N: int,
                                                          muts: Any) -> None:
    r = build(seed, n, N)
    assert rules(r) and fast_accepts(r) and draws(r) and fast_draws_hold(r)
    mutate(r, muts)
    ok = rules(r)
    assert fast_accepts(r) == ok
    if ok:  # check_draws runs only on replies that passed validate
        assert fast_draws_hold(r) == draws(r)


def test_draws_re_derived_at_256_entries() -> None:
    r = build(11, 256, 7)
    assert fast_accepts(r) and fast_draws_hold(r)
    i, j = np.argwhere(r["q"].any(axis=-1) & (r["mask"][:, None] == 1))[-1]
    ids = r["sup"][i, j][r["q"][i, j] > 0]
    if ids.size > 1:
        r["drafts"][i, j] = ids[ids != r["drafts"][i, j]][0]  # another support id: valid q,
        assert fast_accepts(r) and not fast_draws_hold(r) and not draws(r)  # wrong draw


def test_a_repeat_across_q_levels_is_found() -> None:
    """Order cannot see a repeat at places with different q: only the distinctness rule."""
    r = build(3, 64, 3)
    q = r["q"].astype(np.int64)
    i, j = np.argwhere((q[..., 0] > q[..., 1]) & (q[..., 1] > q[..., 2]) & (q[..., 2] > 0))[0]
    r["sup"][i, j, 2] = r["sup"][i, j, 0]
    assert not rules(r) and not fast_accepts(r)
    with np.testing.assert_raises_regex(ReplyValueError, "appears twice"):
        sampled.validate(r["mask"], r["sup"], r["q"], r["drafts"], r["needed"], VOCAB,
                         r["top_ks"])
