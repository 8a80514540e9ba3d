"""Shared pieces for the drafter tests: a tiny config, drafters over random weights, tap rows.

A module with its own name (not conftest) so that test files import it unambiguously."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
import torch

from dspark_worker.drafter import (
    Drafter,
    DrafterConfig,
    DraftResult,
    SamplingParams,
    encode_bf16_rows,
    from_tensors,
    random_tensors,
)
from dspark_worker.drafter.step import EagerReplay
from protocol import sampled

TINY = DrafterConfig(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
    vocab_size=300,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    target_layer_ids=(0, 2, 4),
    block_size=6,
    mask_token_id=299,
    markov_rank=16,
    markov_head_type="vanilla",
    enable_confidence_head=True,
    confidence_head_with_markov=True,
    target_hidden_size=48,
    num_target_layers=6,
).validated("tiny")


def tiny_config(**changes: Any) -> DrafterConfig:
    return dataclasses.replace(TINY, **changes).validated("tiny")


def make_drafter(config: DrafterConfig = TINY, seed: int = 7,
                 tensors: dict[str, torch.Tensor] | None = None) -> Drafter:
    return from_tensors(config, tensors if tensors is not None else random_tensors(config, seed),
                        device="cpu", dtype=torch.float32)


def check_sampled(out: DraftResult, sampling: SamplingParams, anchors: Any,
                  vocab_size: int) -> None:
    """A sampled draft keeps the contract's rules for what a client receives (9.2, 9.3): its
    proposals are valid top-k distributions and its draws are the ones the seeds give."""
    assert out.support_ids is not None and out.proposal_q is not None
    top_k = np.asarray(sampling.top_k)
    sampled.validate((top_k > 0).astype(np.uint8), out.support_ids, out.proposal_q,
                     out.draft_ids, np.ones(top_k.size, dtype=bool), vocab_size, top_k)
    sampled.check_draws(top_k > 0, out.support_ids, out.proposal_q, out.draft_ids,
                        np.asarray(sampling.seed, dtype=np.uint64), sampling.generation,
                        anchors)


def bf16_taps(rng: np.random.Generator, n: int, width: int) -> np.ndarray:
    """Random taps that are exact in bf16 (what the wire carries), as float32."""
    vals = rng.standard_normal((n, width)).astype(np.float32) * 2.0
    return torch.from_numpy(vals).bfloat16().float().numpy()


def check_bf16_many_lanes(fp: Drafter, bf: Drafter) -> None:
    """A bf16 drafter against the fp32 reference of the same checkpoint on 16 lanes of a
    16-row ring with random contexts up to 3 windows long: the first draft agrees on most
    lanes, confidences within bf16's tolerance where it does, margins finite and >= 0."""
    rng = np.random.default_rng(9)
    n_lanes, window = 16, 16
    counts = rng.integers(1, 3 * window, n_lanes)
    rows_l = [encode_bf16_rows(bf16_taps(rng, int(n), fp.config.tap_width)) for n in counts]
    pool = bf.new_pool(n_lanes, window)
    lanes = pool.allocate(n_lanes)
    pool.apply(lanes, counts, counts, np.ones(n_lanes, dtype=bool), np.concatenate(rows_l))
    tokens = rng.integers(0, fp.vocab_size, n_lanes)
    got = bf.draft(pool, lanes, counts, tokens)
    ref = fp.reference_draft([r[-window:] for r in rows_l], counts, tokens)
    agree = got.draft_ids[:, 0] == ref.draft_ids[:, 0]
    assert agree.mean() >= 0.75
    np.testing.assert_allclose(got.confidence[agree, 0], ref.confidence[agree, 0], atol=0.05)
    assert np.isfinite(got.margin).all() and (got.margin >= 0).all()


def make_rows(rng: np.random.Generator, n: int, config: DrafterConfig = TINY) -> np.ndarray:
    """n random tap rows as wire bytes, uint8 [n, row_bytes]."""
    values = rng.standard_normal((n, config.tap_width)).astype(np.float32) * 2.0
    return encode_bf16_rows(values)


# -- the static draft step ---------------------------------------------------------------------


class CountingReplay(EagerReplay):
    """The CPU stand-in, counting its replays (to see the static step was taken)."""

    count = 0

    def replay(self) -> None:
        CountingReplay.count += 1
        super().replay()


def params(b: int, seed: int) -> SamplingParams:
    """Mixed sampling parameters for b lanes: lane 0 sampled, lane 1 greedy, the rest random."""
    rng = np.random.default_rng(seed)
    top_k = rng.integers(0, 33, b)
    top_k[0] = 32  # at least one sampled lane, and greedy ones beside it where b > 1
    if b > 1:
        top_k[1] = 0
    return SamplingParams(top_k=top_k, temperature=rng.uniform(0.5, 1.5, b),
                          top_p=np.where(rng.random(b) < 0.5, 0.9, 0.0),
                          seed=rng.integers(0, 2**63, b, dtype=np.uint64),
                          generation=rng.integers(0, 9, b))


def assert_same(got: DraftResult, want: DraftResult, exact: bool = True) -> None:
    """Ids exactly. ``exact``: q and every float bit for bit too (same shapes: a bucket the
    batch fills); else q within a few units of 2**24 and floats within 1e-5, since the GEMMs
    of a padded batch have more rows and may round differently in the last bit."""
    for name in ("draft_ids", "window_rows"):
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
    if got.proposal_q is not None and want.proposal_q is not None:
        assert got.support_ids is not None and want.support_ids is not None
        if exact:
            np.testing.assert_array_equal(got.support_ids, want.support_ids)
            np.testing.assert_array_equal(got.proposal_q, want.proposal_q)
        else:  # the same support, each id's q within a few units (two near-equal q may swap)
            for a, b in zip(support_q(got), support_q(want), strict=True):
                assert a.keys() == b.keys()
                assert max((abs(a[i] - b[i]) for i in a), default=0) <= 64
    for name in ("confidence", "margin"):
        tol = 0.0 if exact else 1e-5
        np.testing.assert_allclose(getattr(got, name), getattr(want, name), rtol=tol,
                                   atol=tol, err_msg=name)


def support_q(r: DraftResult) -> list[dict[int, int]]:
    """Per lane and position: support id -> q, over the places holding some."""
    assert r.support_ids is not None and r.proposal_q is not None
    ids, q = r.support_ids.reshape(-1, r.support_ids.shape[-1]), r.proposal_q.reshape(
        -1, r.proposal_q.shape[-1])
    return [{int(i): int(v) for i, v in zip(ri, rq, strict=True) if v} for ri, rq in zip(ids, q,
                                                                                      strict=True)]


def with_static_step(d: Drafter, pool: Any, largest: int = 8, draft_topk: int = 0) -> Drafter:
    """The same model with its own bucketed static step over ``pool``, self-checked."""
    s = d.with_draft_topk(draft_topk)
    report = s.prepare_graphs(pool, largest, replay=CountingReplay)
    assert report.fallback is None, report.fallback
    assert s.graphs is not None and report.graphs == 2 * len(report.buckets)
    return s


def static_and_eager(s: Drafter, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
    """One draft through the static step (checked to be taken), then the same eagerly."""
    before = CountingReplay.count
    got = s.draft(*args, **kwargs)
    assert CountingReplay.count == before + 1, "the static step was not taken"
    graphs, s.graphs = s.graphs, None
    try:
        want = s.draft(*args, **kwargs)
    finally:
        s.graphs = graphs
    return got, want


def refuse_host_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every way to read a tensor's value on the host (what a CUDA graph cannot capture)
    raises until ``monkeypatch`` undoes it."""
    def refuse(*_: object) -> None:
        raise AssertionError("a host read of a tensor's value inside the step")

    for attr in ("item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__",
                 "cpu"):
        monkeypatch.setattr(torch.Tensor, attr, refuse)


# -- config.json edits ----------------------------------------------------------------------------

DROP = object()  # set_key's value that removes the key


def set_key(raw: dict[str, Any], dotted: str, value: Any) -> None:
    """``raw[a][b][c] = value`` for ``dotted`` ``"a.b.c"`` (``DROP``: delete it)."""
    node = raw
    *path, last = dotted.split(".")
    for part in path:
        node = node[part]
    if value is DROP:
        del node[last]
    else:
        node[last] = value
