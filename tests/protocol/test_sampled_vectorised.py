"""``protocol.sampled.validate`` and ``check_draws`` are one vectorised pass each; this checks
them against the contract's rules written entry by entry, place by place, in plain Python
(sections 9.2 and 9.3), on random valid replies and on replies broken in random and in
adversarial ways (hypothesis). The fast path must accept exactly what the rules accept."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest
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
    return first_offender(mask, sup, q, drafts, needed, top_ks) is None


def first_offender(mask: Any, sup: Any, q: Any, drafts: Any, needed: Any,
                   top_ks: Any) -> tuple[int, int | None] | None:
    """Section 9.2, entry by entry: the first (entry, position) that breaks it (position None
    for the entry's mask), or None."""
    n, N = drafts.shape
    for i in range(n):
        want = bool(needed[i]) and int(top_ks[i]) > 0
        if int(mask[i]) not in (0, 1) or bool(mask[i]) != want:
            return i, None
        for j in range(N):
            ids = [int(x) for x in sup[i, j]]
            qq = [int(x) for x in q[i, j]]
            d = int(drafts[i, j])
            if not mask[i]:
                if any(ids) or any(qq):
                    return i, j
                continue
            if not any(ids) and not any(qq) and d == 0:
                continue  # not drafted
            used = [p for p in range(MAX_TOP_K) if qq[p] > 0]
            if used != list(range(len(used))) or sum(qq) != Q_TOTAL:
                return i, j
            for p in range(MAX_TOP_K):
                if qq[p] > 0 and not (0 <= ids[p] < VOCAB and p < int(top_ks[i])):
                    return i, j
                if qq[p] == 0 and ids[p] != 0:
                    return i, j
            if len({ids[p] for p in used}) != len(used):
                return i, j
            for a, b in itertools.pairwise(used):
                if not (qq[a] > qq[b] or (qq[a] == qq[b] and ids[a] < ids[b])):
                    return i, j
            if d not in [ids[p] for p in used]:
                return i, j
    return None


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
    else:  # the refusal names the first offender of the rules
        first = first_offender(r["mask"], r["sup"], r["q"], r["drafts"], r["needed"],
                               r["top_ks"])
        err = refusal(lambda: sampled.validate(r["mask"], r["sup"], r["q"], r["drafts"],
                                               r["needed"], VOCAB, r["top_ks"]))
        assert err is not None and first is not None
        assert (err.entry, err.position) == first, str(err)
    # The client's one-pass check refuses exactly what the two in turn refuse, with the same words.
    assert message(refusal(lambda: combined(r))) == message(refusal(lambda: in_turn(r)))


def refusal(fn: Any) -> ReplyValueError | None:
    try:
        fn()
    except ReplyValueError as exc:
        return exc
    return None


def message(err: ReplyValueError | None) -> str | None:
    return None if err is None else str(err)


def combined(r: dict[str, Any]) -> None:
    sampled.check_reply(r["mask"], r["sup"], r["q"], r["drafts"], r["needed"], VOCAB,
                        r["top_ks"], r["seeds"], r["gens"], r["anchors"])


def in_turn(r: dict[str, Any]) -> None:
    sampled.validate(r["mask"], r["sup"], r["q"], r["drafts"], r["needed"], VOCAB, r["top_ks"])
    sampled.check_draws(r["mask"], r["sup"], r["q"], r["drafts"], r["seeds"], r["gens"],
                        r["anchors"])


def test_a_draft_outside_its_support_is_named_by_9_2_in_the_combined_check() -> None:
    """A draft that is no support id fails both 9.2 and the draw; 9.2 comes first, also when
    an earlier entry's draw is wrong (its draft a support id, so 9.2 holds there)."""
    r = build(5, 64, 3)
    drafted = np.argwhere(r["q"].any(axis=-1) & (r["mask"][:, None] == 1))
    two = [(i, j) for i, j in drafted if (r["q"][i, j] > 0).sum() > 1]
    (i0, j0), (i1, j1) = two[0], two[-1]
    assert i0 < i1
    ids = r["sup"][i0, j0][r["q"][i0, j0] > 0]
    r["drafts"][i0, j0] = ids[ids != r["drafts"][i0, j0]][0]  # valid 9.2, wrong draw
    r["drafts"][i1, j1] = VOCAB - 1 if VOCAB - 1 not in r["sup"][i1, j1] else VOCAB - 2
    err = refusal(lambda: combined(r))
    assert err is not None and (err.entry, err.position) == (i1, j1)
    assert "is not a support id" in str(err)
    assert message(err) == message(refusal(lambda: in_turn(r)))
    r["drafts"][i1, j1] = build(5, 64, 3)["drafts"][i1, j1]  # only the wrong draw is left
    err = refusal(lambda: combined(r))
    assert err is not None and (err.entry, err.position) == (i0, j0)
    assert "is not the draw" in str(err)


def test_one_scratch_serves_replies_of_every_size() -> None:
    """Scratch arrays grow to the largest reply and are reused: replies larger, smaller and of
    other N after one another, valid and broken, each get their own verdict, the same as with
    fresh arrays."""
    scratch = sampled.Scratch()
    sizes = ((1, 200, 7), (2, 3, 2), (3, 64, 5), (4, 17, 1), (5, 256, 7), (6, 1, 1))
    for seed, n, N in sizes * 2:
        for broken in (False, True):
            r = build(seed, n, N)
            if broken:
                i, j = np.argwhere(r["q"].any(axis=-1))[-1]
                r["q"][i, j, 0] += 1  # the sum is one over
            got = refusal(lambda r=r: sampled.check_reply(
                r["mask"], r["sup"], r["q"], r["drafts"], r["needed"], VOCAB, r["top_ks"],
                r["seeds"], r["gens"], r["anchors"], scratch=scratch))
            assert message(got) == message(refusal(lambda r=r: combined(r)))
            assert (got is None) == (not broken), (seed, n, N, broken)
            assert message(refusal(lambda r=r: sampled.validate(
                r["mask"], r["sup"], r["q"], r["drafts"], r["needed"], VOCAB, r["top_ks"],
                scratch=scratch))) == message(got)


def _two_used(r: dict[str, Any]) -> tuple[int, int]:
    at = np.argwhere((r["q"][..., 1] > 0) & (r["mask"][:, None] == 1))
    return int(at[0][0]), int(at[0][1])


def _id0_twice(r: dict[str, Any]) -> None:
    i, j = _two_used(r)
    r["sup"][i, j, :2] = 0


def _id0_once(r: dict[str, Any]) -> None:  # valid when 0 is not already used elsewhere
    i, j = _two_used(r)
    used = r["q"][i, j] > 0
    if 0 not in r["sup"][i, j][used]:
        r["sup"][i, j, int(used.sum()) - 1] = 0


def _tie(r: dict[str, Any], ascending: bool) -> None:
    """The first two places of a position get equal q (their total is even there)."""
    q64 = r["q"].astype(np.int64)
    at = np.argwhere((q64[..., 1] > 0) & ((q64[..., 0] + q64[..., 1]) % 2 == 0)
                     & (r["mask"][:, None] == 1))
    i, j = (int(x) for x in at[0])
    q = r["q"][i, j]
    q[0] = q[1] = (int(q[0]) + int(q[1])) // 2
    lo, hi = sorted(int(x) for x in r["sup"][i, j, :2])
    r["sup"][i, j, :2] = (lo, hi) if ascending else (hi, lo)


def _wide_int(r: dict[str, Any]) -> None:  # an id that wraps to a valid int32
    r["sup"] = r["sup"].astype(np.int64)
    i, j = _two_used(r)
    r["sup"][i, j, 0] += 1 << 32


def _q_wraps(r: dict[str, Any]) -> None:  # q that sums to 2**24 only modulo 2**32
    r["q"] = r["q"].astype(np.int64)
    i, j = _two_used(r)
    r["q"][i, j, 0] += 1 << 32


def _empty_but_drafted(r: dict[str, Any]) -> None:
    i, j = _two_used(r)
    r["q"][i, j] = 0
    r["sup"][i, j] = 0  # the draft id stays: drafted without q


def _top_k_wide(r: dict[str, Any]) -> None:  # a top_k past MAX_TOP_K is only a bound
    r["top_ks"][r["top_ks"] > 0] = 200


ADVERSARIAL = {"id0_twice": _id0_twice, "id0_once": _id0_once,
               "tie_ascending": lambda r: _tie(r, True), "tie_descending": lambda r: _tie(r, False),
               "wide_int": _wide_int, "q_wraps": _q_wraps, "empty_but_drafted": _empty_but_drafted,
               "top_k_wide": _top_k_wide}


@pytest.mark.parametrize("case", sorted(ADVERSARIAL))
def test_adversarial_replies_get_the_rules_verdict(case: str) -> None:
    """Cases aimed at the shortcuts of the one pass: id 0 (an unused place's id) used once or
    twice, equal q on both sides of the id order, integers that wrap into range, a drafted
    position without q, a top_k past 32. Every entry 8 places deep so that the sort and the
    neighbour tests see several positions."""
    for seed in range(6):
        r = build(seed, 40, 4)
        r["top_ks"][r["top_ks"] > 0] = np.minimum(r["top_ks"][r["top_ks"] > 0] + 24, 32)
        r = rebuild(r)
        ADVERSARIAL[case](r)
        ok = rules_accept(r["mask"], r["sup"], r["q"], r["drafts"], r["needed"], r["top_ks"])
        assert fast_accepts(r) == ok, (case, seed)
        assert message(refusal(lambda r=r: combined(r))) == message(refusal(lambda r=r: in_turn(r)))
        if case in ("wide_int", "q_wraps", "id0_twice", "empty_but_drafted", "tie_descending"):
            assert not ok
        if case in ("id0_once", "tie_ascending", "top_k_wide"):
            assert ok


def rebuild(r: dict[str, Any]) -> dict[str, Any]:
    """``build`` again with the (raised) top_ks kept: the sampled positions are drawn anew."""
    rng = np.random.default_rng(99)
    n, N = r["drafts"].shape
    for i in range(n):
        if not r["mask"][i]:
            continue
        for j in range(N):
            if not r["q"][i, j].any():
                continue
            ids, qq = sampled.build_q(rng.normal(size=VOCAB) * 0.5, int(r["top_ks"][i]), 1.0)
            r["sup"][i, j], r["q"][i, j] = ids, qq
            u = splitmix_u(int(r["seeds"][i]), int(r["gens"][i]), int(r["anchors"][i]) + j + 1)
            r["drafts"][i, j] = sampled.draw(ids, qq, u)
    assert rules(r) and draws(r)
    return r


@pytest.mark.parametrize("entry", [0, 1, 127, 128, 254, 255])
def test_the_first_offender_of_256_entries_is_named(entry: int) -> None:
    """The failure path searches for the first failing entry with the one pass: an offender
    anywhere, and a second one after it, name the first."""
    r = build(21, 256, 3)
    drafted = np.argwhere(r["q"].any(axis=-1) & (r["mask"][:, None] == 1))
    later = [(int(i), int(j)) for i, j in drafted if i >= entry]
    (i, j), (i2, j2) = later[0], later[-1]
    r["q"][i, j, 0] += 1
    if (i2, j2) != (i, j):
        r["sup"][i2, j2, MAX_TOP_K - 1] = 3  # an unused place with an id
    err = refusal(lambda: combined(r))
    assert err is not None and (err.entry, err.position) == (i, j)
    assert f"q sums to {Q_TOTAL + 1}" in str(err)


# -- the check made ahead (ReplyCheck), its edges --------------------------------------------------
def redraw(r: dict[str, Any]) -> None:
    """Every drafted position's draft drawn anew from its q (after seeds or anchors change)."""
    n, N = r["drafts"].shape
    for i in range(n):
        for j in range(N):
            if r["mask"][i] and r["q"][i, j].any():
                u = splitmix_u(int(r["seeds"][i]), int(r["gens"][i]), int(r["anchors"][i]) + j + 1)
                r["drafts"][i, j] = sampled.draw(r["sup"][i, j], r["q"][i, j], u)


def build_full(seed: int, n: int, N: int, top: int = 32) -> dict[str, Any]:
    """A valid sampled reply of the usual kind: every entry sampled (top_k at most ``top``),
    every position drafted (the check then sums q with each position's u taken off, as
    made ahead)."""
    r = build(seed, n, N)
    rng = np.random.default_rng(seed + 1)
    r["needed"][:] = True
    r["mask"][:] = 1
    r["top_ks"] = rng.integers(1, top + 1, n).astype(np.int32)
    for i in range(n):
        for j in range(N):
            ids, qq = sampled.build_q(rng.normal(size=VOCAB) * 2, int(r["top_ks"][i]), 1.0)
            r["sup"][i, j], r["q"][i, j] = ids, qq
    redraw(r)
    assert rules(r) and draws(r)
    return r


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 12), N=st.integers(1, 5),
       muts=mutations(), asked=st.sampled_from(["all", "needed", "more", "fewer"]),
       full=st.sampled_from([0, 8, 16, 32]))
def test_the_check_made_ahead_gives_check_replys_verdict(seed: int, n: int, N: int, muts: Any,
                                                         asked: str, full: int) -> None:
    """ReplyCheck made from the request (u, the places read, and should every position be
    drafted what the running sum takes off each position) then checking the reply says what
    check_reply says, whichever entries the request says asked for a draft: all, the ones
    the reply's statuses let draft, more, or fewer (then a sampled entry can need more places
    than were planned, and the check plans again). ``full``: every position drafted, top_k at
    most that (so 8 or 16 places read of 32, or all 32)."""
    r = build_full(seed, n, N, full) if full else build(seed, n, N)
    mutate(r, muts)
    rng = np.random.default_rng(seed)
    extra = rng.random(n) < 0.5
    mask = {"all": None, "needed": r["needed"], "more": r["needed"] | extra,
            "fewer": r["needed"] & extra}[asked]
    scratch = sampled.Scratch()
    ahead = sampled.ReplyCheck(r["seeds"], r["gens"], r["anchors"], r["top_ks"], N, VOCAB,
                               asked=mask, scratch=scratch)
    got = refusal(lambda: ahead.check(r["mask"], r["sup"], r["q"], r["drafts"], r["needed"]))
    assert message(got) == message(refusal(lambda: combined(r)))
    assert message(got) == message(refusal(lambda: in_turn(r)))


@pytest.mark.parametrize("anchor", [2**32 - 6, 2**32 - 3, 2**32 - 1, 2**32 + 5])
def test_positions_past_the_counters_low_half_wrap_as_the_contract_says(anchor: int) -> None:
    """A position's low 32 bits go into u's counter: positions at and past 2**32 wrap. The
    check takes the per-entry shortcut only when no position of the reply wraps."""
    r = build(8, 16, 5)
    r["anchors"] = np.full(16, anchor, np.int64)
    r["anchors"][::2] = 100  # some entries far from the wrap: both paths in one reply
    redraw(r)
    assert draws(r)
    assert refusal(lambda: combined(r)) is None
    i, j = (int(x) for x in np.argwhere(r["q"].any(axis=-1) & (r["mask"][:, None] == 1)
                                        & (r["anchors"][:, None] == anchor))[0])
    ids = r["sup"][i, j][r["q"][i, j] > 0]
    if ids.size > 1:
        r["drafts"][i, j] = ids[ids != r["drafts"][i, j]][0]
        err = refusal(lambda: combined(r))
        assert err is not None and (err.entry, err.position) == (i, j)
        assert f"position {anchor + j + 1}" in str(err)


@pytest.mark.parametrize("vocab", [1 << 27, (1 << 31) - 1, (1 << 32) - 1])
def test_vocabularies_too_wide_for_32_bit_sort_keys(vocab: int) -> None:
    """Ids whose sort key does not fit 32 bits beside the position's stamp take 64-bit keys:
    repeats are still found, and a negative id is out of range even when the vocabulary size
    (a u32 in HELLO) is past 2**31."""
    r = build(3, 24, 4)

    def verdict() -> str | None:
        return message(refusal(lambda: sampled.check_reply(
            r["mask"], r["sup"], r["q"], r["drafts"], r["needed"], vocab, r["top_ks"],
            r["seeds"], r["gens"], r["anchors"])))

    assert verdict() is None
    # Every id moved up to just below the vocabulary's end: order, draws and distinctness
    # are unchanged, so the reply stays good.
    offset = min(vocab, 1 << 31) - VOCAB
    used = r["q"] > 0
    r["sup"][used] += offset
    drafted = used.any(axis=-1) & (r["mask"][:, None] == 1)
    r["drafts"][drafted] += offset
    assert verdict() is None
    i, j = _two_used(r)
    r["sup"][i, j, 1] = r["sup"][i, j, 0]
    got = verdict()
    assert got is not None and f"support id {int(r['sup'][i, j, 0])} appears twice" in got
    r["sup"][i, j, 1] = -1
    got = verdict()
    assert got is not None and "support id -1 outside" in got


@pytest.mark.parametrize("seed,top", [(0, 32), (1, 32), (2, 16), (3, 16)])
def test_a_wrong_draw_where_every_position_is_drafted_is_named(seed: int, top: int) -> None:
    """The usual reply (every position drafted) is checked with one running sum that takes
    each position's u off as it goes (made ahead): a draft that is another of its support
    ids, anywhere, is named."""
    r = build_full(seed, 32, 7, top)
    ahead = sampled.ReplyCheck(r["seeds"], r["gens"], r["anchors"], r["top_ks"], 7, VOCAB)
    assert ahead.planned.folded
    assert refusal(lambda: ahead.check(r["mask"], r["sup"], r["q"], r["drafts"],
                                       r["needed"])) is None
    assert ahead.usual  # decided by the sum with each position's u taken off
    rng = np.random.default_rng(seed)
    two = np.argwhere((r["q"] > 0).sum(axis=-1) > 1)
    i, j = (int(x) for x in two[rng.integers(len(two))])
    ids = r["sup"][i, j][r["q"][i, j] > 0]
    r["drafts"][i, j] = ids[ids != r["drafts"][i, j]][0]
    err = refusal(lambda: ahead.check(r["mask"], r["sup"], r["q"], r["drafts"], r["needed"]))
    assert err is not None and (err.entry, err.position) == (i, j)
    assert "is not the draw" in str(err)
    assert message(err) == message(refusal(lambda: in_turn(r)))


@pytest.mark.parametrize("top", [8, 16, 32])
def test_a_usual_request_whose_reply_leaves_positions_undrafted(top: int) -> None:
    """Every position asked for, so the check sums q with each position's u taken off; a
    reply that leaves some positions undrafted (no q, draft 0: 9.2 allows it) has positions
    that do not end where that sum expects, and is checked again the general way: accepted,
    and a wrong draw or a broken sum elsewhere in it still named."""
    r = build_full(11, 48, 5, top)
    for i, j in ((0, 0), (17, 3), (47, 4)):
        r["sup"][i, j] = 0
        r["q"][i, j] = 0
        r["drafts"][i, j] = 0
    assert rules(r) and draws(r)

    def verdict() -> str | None:
        scratch = sampled.Scratch()
        ahead = sampled.ReplyCheck(r["seeds"], r["gens"], r["anchors"], r["top_ks"], 5, VOCAB,
                                   n_out=np.zeros(48, np.uint16), scratch=scratch)
        assert ahead.planned.folded
        got = message(refusal(lambda: ahead.check(r["mask"], r["sup"], r["q"], r["drafts"],
                                                  r["needed"])))
        assert got == message(refusal(lambda: in_turn(r)))
        assert not ahead.usual  # some positions end elsewhere: the general sum decided
        return got

    assert verdict() is None
    two = np.argwhere((r["q"] > 0).sum(axis=-1) > 1)
    i, j = (int(x) for x in two[len(two) // 2])
    good = int(r["drafts"][i, j])
    ids = r["sup"][i, j][r["q"][i, j] > 0]
    r["drafts"][i, j] = ids[ids != good][0]
    got = verdict()
    assert got is not None and f"entry {i} position {j}: draft id" in got
    r["drafts"][i, j] = good
    r["q"][i, j, 0] += 1
    got = verdict()
    assert got is not None and f"entry {i} position {j}: q sums to" in got


def test_the_usual_check_is_planned_only_when_every_position_is_asked_for() -> None:
    """n_out below N for one entry: its later positions are not drafted, so the check does
    not plan on every position being drafted; n_out 0 (all N) or N or more does."""
    r = build_full(2, 8, 4, 16)
    args = (r["seeds"], r["gens"], r["anchors"], r["top_ks"], 4, VOCAB)
    n_out = np.full(8, 4, np.uint16)
    assert sampled.ReplyCheck(*args, n_out=n_out).planned.folded
    n_out[3] = 0
    n_out[5] = 9
    assert sampled.ReplyCheck(*args, n_out=n_out).planned.folded
    n_out[6] = 2
    assert not sampled.ReplyCheck(*args, n_out=n_out).planned.folded
    asked = np.ones(8, bool)
    asked[1] = False
    assert not sampled.ReplyCheck(*args, asked=asked).planned.folded


@pytest.mark.parametrize("top,folded", [(8, True), (16, True), (32, True), (16, False)])
def test_draws_at_a_running_sum_equal_to_u_and_one_past_it(top: int, folded: bool) -> None:
    """The draw is the first place whose running sum *exceeds* u: positions whose first q is
    u (the draw is the second place) or u + 1 (the first), over every way the check sums q.
    ``folded``: every position asked for (u taken off within the running sum), else one
    entry did not ask and the general sum runs."""
    r = build_full(4, 64, 4, top)
    r["top_ks"] = np.maximum(r["top_ks"], 2)
    rng = np.random.default_rng(top)
    hits = []
    for i in range(64):
        for j in range(4):
            u = splitmix_u(int(r["seeds"][i]), int(r["gens"][i]), int(r["anchors"][i]) + j + 1)
            first = u + int(rng.integers(0, 2))
            if not Q_TOTAL // 2 < first < Q_TOTAL:
                continue
            a, b = (int(x) for x in rng.choice(VOCAB, 2, replace=False))
            r["sup"][i, j] = 0
            r["q"][i, j] = 0
            r["sup"][i, j, :2] = (a, b)
            r["q"][i, j, :2] = (first, Q_TOTAL - first)
            r["drafts"][i, j] = b if first == u else a
            hits.append((i, j))
    assert len(hits) > 60 and rules(r) and draws(r)
    asked = np.ones(64, bool)
    if not folded:
        r["needed"][63] = asked[63] = False
        r["mask"][63] = 0
        r["sup"][63] = r["q"][63] = r["drafts"][63] = 0
    ahead = sampled.ReplyCheck(r["seeds"], r["gens"], r["anchors"], r["top_ks"], 4, VOCAB,
                               asked=asked)
    assert ahead.planned.folded == folded
    assert refusal(lambda: ahead.check(r["mask"], r["sup"], r["q"], r["drafts"],
                                       r["needed"])) is None
    for i, j in hits[5], hits[-1]:  # the other of the two ids
        r["drafts"][i, j] = sum(int(x) for x in r["sup"][i, j, :2]) - int(r["drafts"][i, j])
    err = refusal(lambda: ahead.check(r["mask"], r["sup"], r["q"], r["drafts"], r["needed"]))
    assert err is not None and f"entry {hits[5][0]} position {hits[5][1]}: draft id" in str(err)
    assert "is not the draw" in str(err)


@pytest.mark.parametrize("value", [0, 2, 255])
def test_a_usual_reply_with_a_wrong_sampled_mask_is_refused(value: int) -> None:
    """Every entry asked and sampled: each mask must be 1, whatever the support says."""
    r = build_full(6, 16, 3, 16)
    r["mask"][9] = value
    ahead = sampled.ReplyCheck(r["seeds"], r["gens"], r["anchors"], r["top_ks"], 3, VOCAB)
    assert ahead.planned.folded
    err = refusal(lambda: ahead.check(r["mask"], r["sup"], r["q"], r["drafts"], r["needed"]))
    assert err is not None and err.entry == 9 and err.field == "sampled_mask"
    assert message(err) == message(refusal(lambda: in_turn(r)))


def test_a_usual_reply_using_places_past_an_entrys_top_k_is_refused() -> None:
    """Every entry asked and sampled, one with a smaller top_k than the places its position
    uses (the others keep the largest top_k, so more places are read than it may use)."""
    r = build_full(8, 24, 3, 16)
    r["top_ks"][:] = 16
    used = (r["q"] > 0).sum(axis=-1)
    i = int(np.argwhere(used >= 3)[0][0])
    r["top_ks"][i] = int(used[i].max()) - 1
    ahead = sampled.ReplyCheck(r["seeds"], r["gens"], r["anchors"], r["top_ks"], 3, VOCAB)
    assert ahead.planned.folded and ahead.width == 16
    err = refusal(lambda: ahead.check(r["mask"], r["sup"], r["q"], r["drafts"], r["needed"]))
    assert err is not None and err.entry == i and "past top_k" in str(err)
    assert message(err) == message(refusal(lambda: in_turn(r)))
