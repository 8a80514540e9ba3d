"""dyadic24: building q (docs/contract.md section 9.1) and drawing from it (9.3)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from protocol import sampled
from protocol.constants import MAX_TOP_K, Q_TOTAL

H = Q_TOTAL // 2
M64 = (1 << 64) - 1


def splitmix_u(seed: int, generation: int, position: int) -> int:
    """Section 9.3's pseudo-code, in Python integers."""
    counter = (generation & 0xFFFFFFFF) << 32 | (position & 0xFFFFFFFF)
    z = (seed + (counter + 1) * 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    z ^= z >> 31
    return z >> 40


def reference_p(logits: np.ndarray, top_k: int, temperature: float,
                top_p: float) -> tuple[np.ndarray, np.ndarray]:
    """Section 9.1 steps 1-4, written independently of protocol.sampled."""
    z = logits.astype(np.float64) / temperature
    order = np.lexsort((np.arange(z.size), -z))[:top_k]  # value descending, ties to lower id
    zk = z[order]
    p = np.exp(zk - zk.max())
    p /= p.sum()
    if 0.0 < top_p < 1.0:
        # the running sum, as a running sum: on exact ties (ten places of 0.1 and top_p 0.9)
        # the rounding of the summation order decides, and the contract leaves it to floats
        cum, keep = 0.0, 0
        while keep < p.size and (keep == 0 or cum < top_p):
            cum += p[keep]
            keep += 1
        order, p = order[:keep], p[:keep] / p[:keep].sum()
    return order, p


def assert_canonical(ids: np.ndarray, q: np.ndarray, vocab: int, top_k: int) -> int:
    """The invariants of 9.1 step 6 and 9.2; returns the number of used places."""
    assert ids.shape == q.shape == (MAX_TOP_K,)
    assert ids.dtype == np.int32 and q.dtype == np.uint32
    qq = q.astype(np.int64)
    assert int(qq.sum()) == Q_TOTAL
    used = int((qq > 0).sum())
    assert 1 <= used <= min(top_k, vocab)
    assert (qq[:used] > 0).all() and (qq[used:] == 0).all() and (ids[used:] == 0).all()
    assert len(set(ids[:used].tolist())) == used
    assert ((ids[:used] >= 0) & (ids[:used] < vocab)).all()
    for a in range(used - 1):
        assert qq[a] > qq[a + 1] or (qq[a] == qq[a + 1] and ids[a] < ids[a + 1])
    return used


# -- building q -----------------------------------------------------------------------------------
def test_q_sums_to_2_24_over_many_shapes() -> None:
    rng = np.random.default_rng(2024)
    for case in range(400):
        vocab = int(rng.choice([2, 3, 5, 31, 32, 33, 100, 1000, 5000])) if case % 2 else int(
            rng.integers(2, 5001))
        temperature = float(np.exp(rng.uniform(np.log(0.05), np.log(5.0))))
        top_k = int(rng.integers(1, 33))
        top_p = float(rng.choice([0.0, 0.5, 0.9, 1.0]))
        scale = float(rng.choice([0.01, 1.0, 5.0, 30.0]))
        logits = rng.normal(size=vocab) * scale
        if case % 3 == 0:
            logits = np.round(logits)  # many exact ties
        if case % 7 == 0:
            logits = logits.astype(np.float32)
        ids, q = sampled.build_q(logits, top_k, temperature, top_p)
        used = assert_canonical(ids, q, vocab, top_k)
        order, p = reference_p(np.asarray(logits), min(top_k, vocab), temperature, top_p)
        # the support is the first places of (logit descending, id ascending), minus zeros
        assert set(ids[:used].tolist()) == set(order[:used].tolist())
        assert (p[used:] * Q_TOTAL < 1.0 + 1e-6).all()  # a dropped place had p below 2**-24
        # each q is floor(p * 2**24) or one more
        want = dict(zip(order.tolist(), (p * Q_TOTAL).tolist(), strict=True))
        for i, qi in zip(ids[:used].tolist(), q[:used].tolist(), strict=True):
            assert abs(qi - want[i]) < 1.0 + 1e-6, (case, i, qi, want[i])
        # and it is a valid sampled position
        u = sampled.draw_u(case, 1, case)
        draft = sampled.draw(ids, q, u)
        sampled.validate(np.array([1]), ids[None, None], q[None, None], draft[None, None],
                         np.array([True]), vocab, np.array([top_k]))


def test_equal_logits_go_to_the_lower_ids() -> None:
    ids, q = sampled.build_q(np.zeros(7), 3, 1.0)
    assert ids[:3].tolist() == [0, 1, 2]
    # 3 * floor(2**24 / 3) = 2**24 - 1: the remaining unit goes to the lowest place
    assert q[:3].tolist() == [5592406, 5592405, 5592405]
    assert (q[3:] == 0).all() and (ids[3:] == 0).all()


def test_a_tie_at_the_top_k_boundary_keeps_the_lower_ids() -> None:
    ids, q = sampled.build_q(np.array([1.0, 5.0, 5.0, 5.0, 0.0]), 2, 1.0)
    assert ids[:2].tolist() == [1, 2]
    assert q[:2].tolist() == [H, H]


def test_equal_q_is_ordered_by_id_even_against_logit_order() -> None:
    # id 1's logit is a hair larger, but both quantize to 2**23: canonical order is by id
    ids, q = sampled.build_q(np.array([0.0, 1e-9, -40.0]), 2, 1.0)
    assert q[:2].tolist() == [H, H]
    assert ids[:2].tolist() == [0, 1]


def test_q_follows_the_logits() -> None:
    logits = np.log(np.array([0.1, 0.4, 0.2, 0.3]))
    ids, q = sampled.build_q(logits, 32, 1.0)
    assert ids[:4].tolist() == [1, 3, 2, 0]
    assert q[:4].tolist() == [6710886, 5033165, 3355443, 1677722]


def test_top_k_larger_than_the_vocabulary() -> None:
    ids, q = sampled.build_q(np.array([3.0, 1.0, 2.0]), 32, 1.0)
    assert ids[:3].tolist() == [0, 2, 1]
    assert int(q.sum()) == Q_TOTAL and (q[3:] == 0).all()


@pytest.mark.parametrize(("top_p", "places"), [(0.0, 4), (1.0, 4), (0.3, 1), (0.5, 2),
                                               (0.65, 2), (0.8, 3), (0.95, 4)])
def test_top_p_keeps_the_shortest_prefix_reaching_it(top_p: float, places: int) -> None:
    p = np.array([0.4, 0.3, 0.2, 0.1])
    ids, q = sampled.build_q(np.log(p), 4, 1.0, top_p)
    assert ids[:places].tolist() == list(range(places))
    assert int((q > 0).sum()) == places
    want = sampled.quantize(p[:places] / p[:places].sum())
    assert q[:places].tolist() == want.tolist()


def test_temperature_divides_the_logits() -> None:
    logits = np.array([2.0, 0.0, -1.0])
    ids_hot, q_hot = sampled.build_q(logits, 3, 2.0)
    ids_cold, q_cold = sampled.build_q(logits, 3, 0.5)
    p_hot = np.exp(logits / 2.0) / np.exp(logits / 2.0).sum()
    assert ids_hot[:3].tolist() == ids_cold[:3].tolist() == [0, 1, 2]
    assert q_hot[:3].tolist() == sampled.quantize(p_hot).tolist()
    assert q_cold[0] > q_hot[0]


# -- quantize: floor, then the remainder to the largest fractional parts --------------------------
@pytest.mark.parametrize(("p", "q"), [
    # floors 1677721, 3355443, 5033164, 6710886 (sum 2**24 - 2); fractions .6 .2 .8 .4:
    # the 2 units go to places 2 (.8) and 0 (.6)
    ([0.1, 0.2, 0.3, 0.4], [1677722, 3355443, 5033165, 6710886]),
    # fractions 0, .5, .5 and one unit left: a tie, to the lower place
    ([2**23 / Q_TOTAL, (2**22 + 0.5) / Q_TOTAL, (2**22 - 0.5) / Q_TOTAL],
     [2**23, 2**22 + 1, 2**22 - 1]),
    ([1 / 3, 1 / 3, 1 / 3], [5592406, 5592405, 5592405]),
    ([1.0], [Q_TOTAL]),
    ([1.0, 0.0], [Q_TOTAL, 0]),
    ([0.5, 0.25, 0.25], [H, H // 2, H // 2]),
])
def test_quantize_remainder_rule(p: list[float], q: list[int]) -> None:
    got = sampled.quantize(np.array(p))
    assert got.tolist() == q
    assert int(got.sum()) == Q_TOTAL


def test_quantize_of_a_sum_a_little_over_1_still_sums_to_2_24() -> None:
    got = sampled.quantize(np.array([0.5, 0.5 + 2**-23]))
    assert int(got.sum()) == Q_TOTAL
    assert (got >= 0).all()


# -- refusals -------------------------------------------------------------------------------------
LOGITS = np.linspace(0.0, 1.0, 10)


@pytest.mark.parametrize(("kwargs", "shown"), [
    ({"top_k": 0}, "top_k 0"),
    ({"top_k": 33}, "top_k 33"),
    ({"top_k": -1}, "top_k -1"),
    ({"temperature": 0.0}, "0.0"),
    ({"temperature": -1.5}, "-1.5"),
    ({"temperature": math.nan}, "nan"),
    ({"temperature": math.inf}, "inf"),
    ({"top_p": -0.1}, "-0.1"),
    ({"top_p": 1.5}, "1.5"),
    ({"top_p": math.nan}, "nan"),
])
def test_build_q_refuses_bad_parameters(kwargs: dict[str, float], shown: str) -> None:
    args: dict[str, float] = {"top_k": 4, "temperature": 1.0, "top_p": 0.0}
    args.update(kwargs)
    with pytest.raises(ValueError) as info:
        sampled.build_q(LOGITS, int(args["top_k"]), args["temperature"], args["top_p"])
    assert shown in str(info.value)
    name = next(iter(kwargs))
    assert name in str(info.value)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_build_q_refuses_non_finite_logits(bad: float) -> None:
    logits = LOGITS.copy()
    logits[3] = bad
    with pytest.raises(ValueError) as info:
        sampled.build_q(logits, 4, 1.0)
    assert "id 3" in str(info.value)
    assert repr(bad) in str(info.value)


@pytest.mark.parametrize("logits", [np.zeros(0), np.zeros((2, 3))])
def test_build_q_refuses_logits_that_are_not_one_row(logits: np.ndarray) -> None:
    with pytest.raises(ValueError) as info:
        sampled.build_q(logits, 4, 1.0)
    assert str(logits.shape) in str(info.value)


# -- draws (9.3) ----------------------------------------------------------------------------------
def test_draw_u_golden_values() -> None:
    # SplitMix64's first output from state 0 is 0xE220A8397B1DCDAF: its top 24 bits
    assert int(sampled.draw_u(0, 0, 0)) == 0xE220A8
    assert int(sampled.draw_u(12345, 7, 42)) == 9543827
    assert int(sampled.draw_u(0x0123456789ABCDEF, 5, 11)) == 0xA3B44F
    assert int(sampled.draw_u(M64, 0xFFFFFFFF, 0xFFFFFFFF)) == 0xB4D055


def test_draw_u_is_the_contract_pseudo_code() -> None:
    rng = np.random.default_rng(5)
    seeds = rng.integers(0, 2**63, size=200, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    gens = rng.integers(0, 2**32, size=200, dtype=np.uint64)
    pos = rng.integers(0, 2**32, size=200, dtype=np.uint64)
    got = sampled.draw_u(seeds, gens, pos)
    assert got.dtype == np.uint32
    want = [splitmix_u(int(s), int(g), int(p)) for s, g, p in zip(seeds, gens, pos, strict=True)]
    assert got.tolist() == want
    assert (got < Q_TOTAL).all()


def test_draw_u_is_deterministic_and_broadcasts() -> None:
    seeds = np.array([1, 2, 3], dtype=np.uint64)
    grid = sampled.draw_u(seeds[:, None], 9, np.arange(5)[None, :])
    assert grid.shape == (3, 5)
    assert np.array_equal(grid, sampled.draw_u(seeds[:, None], 9, np.arange(5)[None, :]))
    for i, s in enumerate(seeds.tolist()):
        for p in range(5):
            assert int(grid[i, p]) == splitmix_u(s, 9, p)
    # only generation & 0xFFFFFFFF counts
    assert int(sampled.draw_u(77, (5 << 32) | 9, 3)) == int(sampled.draw_u(77, 9, 3))
    assert len(set(grid.ravel().tolist())) == 15


def test_draw_takes_the_first_place_whose_running_sum_exceeds_u() -> None:
    ids = np.array([5, 2, 9] + [0] * 29)
    q = np.array([H, H // 2, H // 2] + [0] * 29)
    u = np.array([0, H - 1, H, H + H // 2 - 1, H + H // 2, Q_TOTAL - 1])
    assert sampled.draw(ids, q, u).tolist() == [5, 5, 2, 2, 9, 9]


# Critical values of the chi-square distribution at p = 0.001 (upper tail).
CHI2_999 = {7: 24.322, 63: 103.442}


def _chi_square(counts: np.ndarray, expected: np.ndarray) -> float:
    return float((((counts - expected) ** 2) / expected).sum())


@pytest.mark.parametrize("vary", ["seed", "generation", "position"])
def test_draws_follow_q(vary: str) -> None:
    """20000 draws from one q, each under its own (seed, generation, position)."""
    p = np.array([0.3, 0.2, 0.15, 0.12, 0.1, 0.08, 0.04, 0.01])
    q = np.zeros(MAX_TOP_K, dtype=np.uint32)
    q[:8] = sampled.quantize(p)
    ids = np.zeros(MAX_TOP_K, dtype=np.int32)
    ids[:8] = np.arange(8) * 11 + 3
    n = 20_000
    keys = np.arange(n, dtype=np.uint64)
    seed = keys * np.uint64(0x9E3779B1) + np.uint64(17) if vary == "seed" else np.uint64(17)
    gen = keys if vary == "generation" else np.uint64(4)
    pos = keys if vary == "position" else np.uint64(100)
    u = sampled.draw_u(seed, gen, pos)
    assert u.shape == (n,)
    drafts = sampled.draw(ids, q, u)
    counts = np.array([(drafts == i).sum() for i in ids[:8]], dtype=np.float64)
    assert counts.sum() == n  # every draft is a support id
    expected = n * q[:8].astype(np.float64) / Q_TOTAL
    assert _chi_square(counts, expected) < CHI2_999[7]
    # the same counts are far from a q with two places swapped: the test has power
    assert _chi_square(counts, expected[[1, 0, 2, 3, 4, 5, 6, 7]]) > 10 * CHI2_999[7]


def test_u_is_uniform_over_24_bits() -> None:
    u = sampled.draw_u(123, 0, np.arange(20_000))
    counts = np.bincount(u >> 18, minlength=64).astype(np.float64)  # 64 equal bins
    assert counts.size == 64
    assert _chi_square(counts, np.full(64, 20_000 / 64)) < CHI2_999[63]
