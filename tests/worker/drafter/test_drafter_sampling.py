"""Sampled proposals (CONTRACT 9): the device-side q equals protocol.sampled.build_q on the same
logits, draws equal protocol.sampled.draw, and the Markov walk feeds the drawn token forward.

Equality of q is exact here on the CPU; torch and numpy may round exp differently in the last
bit, which could move one unit of q on an unlucky input (see dspark_worker/drafter/sampling.py),
so the logits below are random and well spread, not adversarial."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from drafter_support import TINY, check_sampled, make_rows
from hypothesis import given, settings
from hypothesis import strategies as st

from dspark_worker.drafter import Drafter, RingPool, SamplingParams
from dspark_worker.drafter import sampling as dev_sampling
from protocol import sampled


def torch_build_q(z: np.ndarray, top_k: np.ndarray, temperature: np.ndarray,
                  top_p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    ids, q = dev_sampling.build_q(
        torch.from_numpy(z), torch.from_numpy(top_k.astype(np.int64)),
        torch.from_numpy(temperature.astype(np.float32).astype(np.float64)),
        torch.from_numpy(top_p.astype(np.float32).astype(np.float64)))
    return ids.numpy(), q.numpy()


def assert_same_as_protocol(z: np.ndarray, top_k: np.ndarray, temperature: np.ndarray,
                            top_p: np.ndarray) -> None:
    ids, q = torch_build_q(z, top_k, temperature, top_p)
    for i in range(z.shape[0]):
        want_ids, want_q = sampled.build_q(z[i], int(top_k[i]), float(np.float32(temperature[i])),
                                           float(np.float32(top_p[i])))
        np.testing.assert_array_equal(ids[i], want_ids, err_msg=f"row {i}")
        np.testing.assert_array_equal(q[i], want_q, err_msg=f"row {i}")
    assert (q.sum(axis=1) == sampled.Q_TOTAL).all()


@pytest.mark.parametrize("vocab", [300, 20])
def test_build_q_equals_protocol(vocab: int) -> None:
    rng = np.random.default_rng(vocab)
    b = 400
    z = (rng.standard_normal((b, vocab)) * rng.uniform(0.1, 6, (b, 1))).astype(np.float32)
    z[:40, :50] = z[:40, :1]  # a tie across the top-K boundary: lower ids win
    z[40:80] = np.round(z[40:80])  # many ties everywhere
    top_k = rng.integers(1, 33, b)
    temperature = rng.uniform(0.2, 2.0, b)
    top_p = np.where(rng.random(b) < 0.5, rng.uniform(0.05, 1.0, b), 0.0)
    top_p[:10] = 1.0
    assert_same_as_protocol(z, top_k, temperature, top_p)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_build_q_equals_protocol_hypothesis(data: st.DataObject) -> None:
    vocab = data.draw(st.integers(2, 80))
    values = data.draw(st.lists(st.integers(-40, 40), min_size=vocab, max_size=vocab))
    scale = data.draw(st.sampled_from([0.05, 0.5, 1.0, 3.0]))
    z = (np.array(values, dtype=np.float32) * np.float32(scale))[None, :]
    top_k = np.array([data.draw(st.integers(1, 32))])
    temperature = np.array([data.draw(st.sampled_from([0.25, 0.7, 1.0, 1.9]))])
    top_p = np.array([data.draw(st.sampled_from([0.0, 0.3, 0.8, 0.95, 1.0]))])
    assert_same_as_protocol(z, top_k, temperature, top_p)


def test_draw_equals_protocol() -> None:
    rng = np.random.default_rng(3)
    z = (rng.standard_normal((300, 100)) * 2).astype(np.float32)
    top_k = rng.integers(1, 33, 300)
    ids, q = torch_build_q(z, top_k, np.ones(300), np.zeros(300))
    u = sampled.draw_u(rng.integers(0, 2**63, 300, dtype=np.uint64), np.arange(300),
                       np.arange(300) * 7)
    got = dev_sampling.draw(torch.from_numpy(ids), torch.from_numpy(q),
                            torch.from_numpy(u.astype(np.int64))).numpy()
    np.testing.assert_array_equal(got, sampled.draw(ids, q, u))
    # edges: u = 0 draws the first place, u = 2**24 - 1 the last place with q > 0
    edge_u = np.array([0, sampled.Q_TOTAL - 1])
    for row in range(5):
        pair = dev_sampling.draw(torch.from_numpy(ids[[row, row]]), torch.from_numpy(q[[row, row]]),
                                 torch.from_numpy(edge_u)).numpy()
        np.testing.assert_array_equal(pair, sampled.draw(ids[[row, row]], q[[row, row]], edge_u))


# -- sampled drafting -----------------------------------------------------------------------------


def filled_pool(drafter: Drafter, seed: int = 0) -> tuple[RingPool, np.ndarray, list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    pool = drafter.new_pool(4, 8)
    lanes = pool.allocate(4)
    counts = [8, 3, 0, 12]
    rows = [make_rows(rng, n) for n in counts]
    pool.apply(lanes, counts, counts, [True] * 4, np.concatenate(rows))
    return pool, lanes, [r[-8:] for r in rows]


ANCHORS = [8, 3, 0, 12]
TOKENS = [10, 20, 30, 40]
PARAMS = SamplingParams(top_k=[32, 5, 0, 1], temperature=[1.0, 0.7, 0.0, 1.3],
                        top_p=[0.0, 0.9, 0.0, 0.5], seed=[1, 2**64 - 1, 3, 4],
                        generation=[0, 7, 0, 2**32 - 1])


def test_sampled_draft_q_and_draws(tiny: Drafter) -> None:
    pool, lanes, _ = filled_pool(tiny)
    out = tiny.draft(pool, lanes, ANCHORS, TOKENS, sampling=PARAMS, keep_logits=True)
    assert out.support_ids is not None and out.proposal_q is not None and out.logits is not None
    assert out.support_ids.dtype == np.int32 and out.proposal_q.dtype == np.uint32
    n = TINY.block_size
    top_k = np.array(PARAMS.top_k)
    temps = np.asarray(PARAMS.temperature, dtype=np.float32)
    top_ps = np.asarray(PARAMS.top_p, dtype=np.float32)
    seeds = np.asarray(PARAMS.seed, dtype=np.uint64)
    gens = np.asarray(PARAMS.generation, dtype=np.uint64)
    check_sampled(out, PARAMS, ANCHORS, TINY.vocab_size)  # the contract's checks (9.2, 9.3)
    for i in range(4):
        for j in range(n):
            z = out.logits[i, j]
            if top_k[i] == 0:
                assert out.draft_ids[i, j] == int(np.argmax(z))
                assert not out.support_ids[i, j].any() and not out.proposal_q[i, j].any()
                continue
            ids, q = sampled.build_q(z, int(top_k[i]), float(temps[i]), float(top_ps[i]))
            np.testing.assert_array_equal(out.support_ids[i, j], ids)
            np.testing.assert_array_equal(out.proposal_q[i, j], q)
            u = sampled.draw_u(seeds[i], gens[i], ANCHORS[i] + j + 1)
            assert out.draft_ids[i, j] == sampled.draw(ids, q, u)
    assert (out.proposal_q[3, :, 0] == sampled.Q_TOTAL).all()  # top_k 1: all mass on one id


def test_sampled_draft_is_reproducible(tiny: Drafter) -> None:
    pool, lanes, _ = filled_pool(tiny)
    a = tiny.draft(pool, lanes, ANCHORS, TOKENS, sampling=PARAMS)
    b = tiny.draft(pool, lanes, ANCHORS, TOKENS, sampling=PARAMS)
    np.testing.assert_array_equal(a.draft_ids, b.draft_ids)
    np.testing.assert_array_equal(a.proposal_q, b.proposal_q)
    other = SamplingParams(top_k=PARAMS.top_k, temperature=PARAMS.temperature,
                           top_p=PARAMS.top_p, seed=[5, 6, 7, 8], generation=PARAMS.generation)
    c = tiny.draft(pool, lanes, ANCHORS, TOKENS, sampling=other)
    assert not np.array_equal(a.draft_ids[:2], c.draft_ids[:2])  # the seed matters


def test_greedy_lanes_in_a_sampled_batch(tiny: Drafter) -> None:
    pool, lanes, _ = filled_pool(tiny)
    greedy = tiny.draft(pool, lanes, ANCHORS, TOKENS)
    mixed = tiny.draft(pool, lanes, ANCHORS, TOKENS, sampling=PARAMS)
    assert greedy.support_ids is None
    np.testing.assert_array_equal(mixed.draft_ids[2], greedy.draft_ids[2])
    np.testing.assert_allclose(mixed.confidence[2], greedy.confidence[2], atol=1e-6)


def test_walk_feeds_the_drawn_token(tiny: Drafter) -> None:
    """The sampled walk equals the reference walk (host loop over protocol.sampled), and where a
    draw leaves the greedy path the later positions follow the drawn token, not the argmax."""
    pool, lanes, newest = filled_pool(tiny)
    hot = SamplingParams(top_k=[32] * 4, temperature=[2.0] * 4, top_p=[0.0] * 4,
                         seed=[11, 12, 13, 14], generation=[1, 1, 1, 1])
    got = tiny.draft(pool, lanes, ANCHORS, TOKENS, sampling=hot, keep_logits=True)
    ref = tiny.reference_draft(newest, ANCHORS, TOKENS, sampling=hot)
    np.testing.assert_array_equal(got.draft_ids, ref.draft_ids)
    np.testing.assert_array_equal(got.support_ids, ref.support_ids)
    assert got.proposal_q is not None and ref.proposal_q is not None
    # q from logits computed in a batch of 4 vs alone may differ by float rounding: close only
    diff = np.abs(got.proposal_q.astype(np.int64) - ref.proposal_q.astype(np.int64))
    assert diff.max() <= 64
    np.testing.assert_allclose(got.confidence, ref.confidence, atol=1e-5)
    greedy = tiny.draft(pool, lanes, ANCHORS, TOKENS)
    assert not np.array_equal(got.draft_ids, greedy.draft_ids)
    # the confidence head reads the embedding of the previous (drawn) token: where the walks
    # part at position j, position j + 1's confidence differs too
    parted = [(i, j) for i in range(4) for j in range(TINY.block_size - 1)
              if got.draft_ids[i, j] != greedy.draft_ids[i, j]]
    assert parted
    i, j = parted[0]
    assert abs(got.confidence[i, j + 1] - greedy.confidence[i, j + 1]) > 1e-6


def test_sampling_params_refused(tiny: Drafter) -> None:
    pool, lanes, _ = filled_pool(tiny)

    def params(**changes: object) -> SamplingParams:
        base: dict[str, object] = dict(top_k=[1, 1, 1, 1], temperature=[1.0] * 4,
                                       top_p=[0.0] * 4, seed=[0] * 4, generation=[0] * 4)
        base.update(changes)
        return SamplingParams(**base)  # type: ignore[arg-type]

    with pytest.raises(ValueError, match="lane 2: top_k 33 outside"):
        tiny.draft(pool, lanes, ANCHORS, TOKENS, sampling=params(top_k=[1, 1, 33, 1]))
    with pytest.raises(ValueError, match=r"lane 1: temperature 0\.0"):
        tiny.draft(pool, lanes, ANCHORS, TOKENS, sampling=params(temperature=[1, 0, 1, 1]))
    with pytest.raises(ValueError, match=r"lane 0: top_p 1\.5"):
        tiny.draft(pool, lanes, ANCHORS, TOKENS, sampling=params(top_p=[1.5, 0, 0, 0]))
    with pytest.raises(ValueError, match=r"sampling\.seed has 3 values for 4 lanes"):
        tiny.draft(pool, lanes, ANCHORS, TOKENS, sampling=params(seed=[0, 0, 0]))
    with pytest.raises(ValueError, match="anchor_token 300 outside"):
        tiny.draft(pool, lanes, ANCHORS, [1, 2, 3, 300])


def test_empty_batch(tiny: Drafter) -> None:
    pool, _, _ = filled_pool(tiny)
    out = tiny.draft(pool, [], [], [], sampling=SamplingParams([], [], [], [], []))
    assert out.draft_ids.shape == (0, TINY.block_size)
    assert out.proposal_q is not None and out.proposal_q.shape == (0, TINY.block_size, 32)
