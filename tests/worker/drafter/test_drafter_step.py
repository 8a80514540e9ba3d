"""The bucketed static draft step (``drafter.step``) against the eager step, on the CPU: the
stand-in replay runs the same static step a CUDA graph captures, so everything but the capture
itself is exercised here (padding, static buffers, the self-check and its fallback). Also the
candidate walk (``dspark_draft_topk``) against the from-scratch reference."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from drafter_support import (
    TINY,
    CountingReplay,
    assert_same,
    make_drafter,
    make_rows,
    params,
    refuse_host_reads,
    tiny_config,
)

from dspark_worker.drafter import Drafter, RingPool, load_drafter
from dspark_worker.drafter.config import DrafterConfigError
from dspark_worker.drafter.step import (
    EagerReplay,
    Replay,
    StaticStep,
    bucket_sizes,
    random_inputs,
)
from protocol import sampled
from protocol.identity import markov_walk_identity

W = 8
GEMMA4_TINY = Path(__file__).resolve().parent / "data" / "gemma4_tiny"


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """One intra-op thread: tiny ops on two shared cores wait at every barrier otherwise."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def fill(drafter: Drafter, pool: RingPool, lanes: np.ndarray, seed: int) -> list[int]:
    """Windows of different lengths, most of them wrapping the ring's end: returns anchors."""
    rng = np.random.default_rng(seed)
    anchors = [0] * lanes.size
    for _ in range(4):
        counts = [int(rng.integers(0, W + 3)) for _ in lanes]
        rows = [make_rows(rng, c, drafter.config) for c in counts]
        anchors = [a + c for a, c in zip(anchors, counts, strict=True)]
        pool.apply(lanes, anchors, counts, [False] * lanes.size, np.concatenate(rows))
    return anchors


def family_drafter(name: str) -> Drafter:
    if name == "gemma4":
        return load_drafter(GEMMA4_TINY)
    if name == "qwen3-no-markov":  # markov_rank 0, as a family without the head drafts
        return make_drafter(tiny_config(markov_rank=0, confidence_head_with_markov=False),
                            seed=5)
    return make_drafter(tiny_config(markov_head_type=name.removeprefix("qwen3-")), seed=5)


@pytest.mark.parametrize("name", ["qwen3-vanilla", "qwen3-gated", "qwen3-rnn", "qwen3-no-markov",
                                  "gemma4"])
def test_static_step_equals_eager(name: str) -> None:
    """Both families, all three Markov heads, greedy and sampled; b lanes in buckets with and
    without padded lanes, lanes in any order (not a contiguous span of the pool)."""
    drafter = family_drafter(name)
    pool = drafter.new_pool(12, W)
    report = drafter.prepare_graphs(pool, 8, replay=CountingReplay)
    assert report.fallback is None, report.fallback
    assert report.buckets == (1, 2, 4, 8) and report.graphs == 8
    graphs = drafter.graphs
    assert graphs is not None
    lanes = pool.allocate(12)
    anchors = fill(drafter, pool, lanes, seed=3)
    rng = np.random.default_rng(4)
    for b in (1, 3, 4, 7):
        pick = rng.permutation(12)[:b]
        tokens = rng.integers(0, drafter.vocab_size, b)
        for sampling in (None, params(b, b)):
            before = CountingReplay.count
            got = drafter.draft(pool, lanes[pick], np.array(anchors)[pick], tokens,
                                sampling=sampling)
            assert CountingReplay.count == before + 1, "the static step was not taken"
            drafter.graphs = None
            want = drafter.draft(pool, lanes[pick], np.array(anchors)[pick], tokens,
                                 sampling=sampling)
            drafter.graphs = graphs
            assert got.draft_ids.shape == (b, drafter.num_spec)
            assert_same(got, want, exact=b in graphs.buckets)
    # more lanes than the largest bucket, or fewer positions: the eager step
    before = CountingReplay.count
    drafter.draft(pool, lanes[:9], anchors[:9], np.zeros(9, dtype=np.int64))
    drafter.draft(pool, lanes[:2], anchors[:2], [1, 2], num_spec=drafter.num_spec - 1)
    assert CountingReplay.count == before


def test_padded_lanes_read_lane_zero_and_are_dropped(tiny: Drafter) -> None:
    """A batch of 3 in bucket 4: the padded lane reads ring lane 0 with an empty window and
    greedy parameters, and only 3 lanes come back."""
    pool = tiny.new_pool(4, W)
    step = StaticStep(tiny.model, pool, 4, tiny.num_spec, sampled=True)
    rng = np.random.default_rng(1)
    ints, floats, u = random_inputs(rng, 3, tiny.num_spec, pool, tiny.vocab_size, True)
    assert floats is not None and u is not None
    step.load(ints, floats, u)
    np.testing.assert_array_equal(step.ints[:, 3].numpy(), [0, 0, 0, 0, 0, 1, 0])
    np.testing.assert_array_equal(step.floats[:, 3].numpy(), [1.0, 0.0])
    assert not step.u[3].any()
    np.testing.assert_array_equal(step.ints[:, :3].numpy(), ints)
    with pytest.raises(ValueError, match="do not fit"):
        step.load(np.zeros((7, 5), dtype=np.int64), floats, u)
    with pytest.raises(ValueError, match="needs its floats and u"):
        step.load(ints, None, None)


def test_static_step_has_no_host_sync(tiny: Drafter, monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing in the step reads a tensor's value on the host (what a CUDA graph cannot
    capture): every way to do so raises while it runs, in both sampling modes."""
    pool = tiny.new_pool(4, W)
    steps = [StaticStep(tiny.model, pool, 4, tiny.num_spec, s, k)
             for s in (False, True) for k in (0, 64)]

    refuse_host_reads(monkeypatch)
    with torch.inference_mode():
        for step in steps:
            out = step.compute()
            assert set(out) >= {"draft_ids", "confidence", "margin"}


class WrongReplay(EagerReplay):
    """A deliberately wrong step: the last lane's first id is off by one in bucket 4."""

    def replay(self) -> None:
        super().replay()
        if self.step.size == 4:
            ids = self.outputs["draft_ids"].clone()
            ids[2, 0] = (ids[2, 0] + 1) % self.step.model.config.vocab_size
            self.outputs["draft_ids"] = ids


class FailingReplay(Replay):
    def __init__(self, step: StaticStep) -> None:
        raise RuntimeError("capture failed (operation not permitted when stream is capturing)")


@pytest.mark.parametrize(("replay", "said"), [
    (WrongReplay, "bucket 4 (greedy): draft_ids[2, 0]"),
    (FailingReplay, "RuntimeError: capture failed"),
])
def test_self_check_falls_back_to_eager(replay: type[Replay], said: str) -> None:
    drafter = make_drafter()
    pool = drafter.new_pool(6, W)
    report = drafter.prepare_graphs(pool, 6, replay=replay)
    assert report.graphs == 0 and drafter.graphs is None
    assert report.fallback is not None and said in report.fallback
    assert not pool.kv.any(), "the self-check leaves the rings as it found them"
    lanes = pool.allocate(3)
    anchors = fill(drafter, pool, lanes, seed=2)
    got = drafter.draft(pool, lanes, anchors, [1, 2, 3])  # eager, and right
    ref = drafter.reference_draft([pool_rows for pool_rows in newest(drafter, lanes, anchors,
                                                                      seed=2)], anchors,
                                  [1, 2, 3])
    np.testing.assert_array_equal(got.draft_ids, ref.draft_ids)


def newest(drafter: Drafter, lanes: np.ndarray, anchors: list[int], seed: int) -> list[np.ndarray]:
    """The rows ``fill`` left in each lane's window (the same generator, replayed)."""
    rng = np.random.default_rng(seed)
    history: list[list[np.ndarray]] = [[] for _ in lanes]
    for _ in range(4):
        counts = [int(rng.integers(0, W + 3)) for _ in lanes]
        for i, c in enumerate(counts):
            history[i].extend(make_rows(rng, c, drafter.config))
    return [np.stack(h[-min(W, len(h)):]) if h else np.zeros((0, TINY.row_bytes), np.uint8)
            for h in history]


def test_graphs_off_and_cpu_auto_keep_the_eager_step(tiny: Drafter) -> None:
    pool = tiny.new_pool(2, W)
    assert tiny.prepare_graphs(pool, 2, "off", replay=EagerReplay).graphs == 0
    report = tiny.prepare_graphs(pool, 2)  # auto on the CPU: nothing to capture
    assert report.graphs == 0 and report.fallback is None and tiny.graphs is None
    with pytest.raises(ValueError, match="cuda_graphs 'on' is not one of auto, off"):
        tiny.prepare_graphs(pool, 2, "on")


def test_bucket_sizes() -> None:
    assert bucket_sizes(256) == (1, 2, 4, 8, 16, 32, 64, 128, 256)
    assert bucket_sizes(300) == (1, 2, 4, 8, 16, 32, 64, 128, 256, 300)
    assert bucket_sizes(48) == (1, 2, 4, 8, 16, 32, 48)
    assert bucket_sizes(1) == (1,)
    with pytest.raises(ValueError, match="largest bucket 0"):
        bucket_sizes(0)


# -- the candidate walk -------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["vanilla", "rnn"])
def test_candidate_walk_equals_reference(kind: str) -> None:
    """dspark_draft_topk k: the Markov bias on the k best base logits, -inf elsewhere; the
    ring drafts (eager and static) equal the from-scratch reference, greedy and sampled."""
    drafter = make_drafter(tiny_config(markov_head_type=kind), seed=6).with_draft_topk(40)
    pool = drafter.new_pool(5, W)
    assert drafter.prepare_graphs(pool, 8, replay=EagerReplay).fallback is None
    lanes = pool.allocate(5)
    anchors = fill(drafter, pool, lanes, seed=9)
    rows = newest(drafter, lanes, anchors, seed=9)
    tokens = [3, 9, 27, 81, 243]
    for sampling in (None, params(5, 1)):
        ref = drafter.reference_draft(rows, anchors, tokens, sampling=sampling)
        static = drafter.draft(pool, lanes, anchors, tokens, sampling=sampling)
        graphs, drafter.graphs = drafter.graphs, None
        eager = drafter.draft(pool, lanes, anchors, tokens, sampling=sampling)
        drafter.graphs = graphs
        assert_same(static, eager, exact=False)
        # the reference adds the dense bias (one GEMM over the vocabulary), the walk k dot
        # products: the same values but for the last bit
        assert_same(eager, ref, exact=False)
        if sampling is not None:
            assert eager.support_ids is not None and eager.proposal_q is not None
            top_k = np.asarray(sampling.top_k)
            sampled.check_draws(top_k > 0, eager.support_ids, eager.proposal_q, eager.draft_ids,
                                np.asarray(sampling.seed, dtype=np.uint64),
                                sampling.generation, anchors)


def test_candidate_walk_changes_drafts_and_identity(tiny: Drafter) -> None:
    """Few candidates change some drafts (the walk is a different drafter); all of the
    vocabulary as candidates drafts what the full walk drafts. Either way the Markov identity
    says which walk runs."""
    pool = tiny.new_pool(16, W)
    lanes = pool.allocate(16)
    anchors = fill(tiny, pool, lanes, seed=5)
    tokens = np.arange(16) * 7
    full = tiny.draft(pool, lanes, anchors, tokens)
    narrow = tiny.with_draft_topk(32)
    whole = tiny.with_draft_topk(tiny.vocab_size)
    assert narrow.model is tiny.model  # one model, one ring pool, two walks
    assert (narrow.draft(pool, lanes, anchors, tokens).draft_ids != full.draft_ids).any()
    np.testing.assert_array_equal(whole.draft(pool, lanes, anchors, tokens).draft_ids,
                                  full.draft_ids)
    assert tiny.markov_identity == tiny.tensors_markov_identity
    assert narrow.markov_identity == markov_walk_identity(tiny.markov_identity, 32)
    assert narrow.markov_identity not in (tiny.markov_identity, whole.markov_identity)
    assert narrow.drafter_identity == tiny.drafter_identity


@pytest.mark.parametrize("k", [1, 31, 301, -4, 2.5, True])
def test_draft_topk_refused(tiny: Drafter, k: object) -> None:
    with pytest.raises(DrafterConfigError, match=r"dspark_draft_topk .* \[32, vocab_size 300\]"):
        tiny.with_draft_topk(k)  # type: ignore[arg-type]


def test_draft_topk_from_the_checkpoint(tmp_path: Path) -> None:
    import json
    import shutil

    folder = tmp_path / "g4"
    shutil.copytree(GEMMA4_TINY, folder)
    raw = json.loads((folder / "config.json").read_text())
    raw["dspark_draft_topk"] = 64
    (folder / "config.json").write_text(json.dumps(raw))
    assert load_drafter(folder).draft_topk == 64
    assert load_drafter(folder, draft_topk=0).draft_topk == 0
    assert load_drafter(GEMMA4_TINY).draft_topk == 0


def test_head_groups_split_the_lm_head_not_the_drafts(tiny: Drafter,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the LM head budget the positions go through the head in groups: the same drafts."""
    from dspark_worker.drafter import walk

    assert walk.head_groups(tiny.model, 64, 7) == 7  # one GEMM for all positions
    assert walk.head_groups(tiny.model, 64, 7, budget=3 * 64 * 300 * 4) == 3
    assert walk.head_groups(tiny.model, 64, 7, budget=1) == 1
    pool = tiny.new_pool(6, W)
    lanes = pool.allocate(6)
    anchors = fill(tiny, pool, lanes, seed=8)
    tokens = np.arange(6) * 11
    whole = tiny.draft(pool, lanes, anchors, tokens, sampling=params(6, 3))
    for budget in (2 * 6 * 300 * 4, 1):  # two positions per GEMM, then one
        monkeypatch.setattr(walk, "HEAD_BYTES_BUDGET", budget)
        assert_same(tiny.draft(pool, lanes, anchors, tokens, sampling=params(6, 3)), whole,
                    exact=False)


@pytest.mark.parametrize("name", ["qwen3-rnn", "gemma4"])
def test_walk_finishing_each_position_equals_the_whole_logits(name: str) -> None:
    """The walk's own LM head (one GEMM, each position finished to fp32 when reached) gives
    bit for bit what the walk over the whole [B, N, V] fp32 logits gave: ids, q, floats."""
    from dspark_worker.drafter.walk import DeviceSampling, markov_walk

    drafter = family_drafter(name)
    model = drafter.model
    rng = np.random.default_rng(12)
    b, n = 5, drafter.num_spec
    hf = torch.randn(b, n, drafter.config.hidden_size)
    token = torch.from_numpy(rng.integers(0, drafter.vocab_size, b))
    smp = DeviceSampling(is_sampled=torch.tensor([True, True, False, True, True]),
                         top_k=torch.tensor([32, 5, 1, 17, 2]),
                         temperature=torch.tensor([1.0, 0.7, 1.0, 1.3, 0.9], dtype=torch.float64),
                         top_p=torch.tensor([0.0, 0.9, 0.0, 0.5, 0.0], dtype=torch.float64),
                         u=torch.from_numpy(rng.integers(0, 1 << 24, (b, n))))
    with torch.inference_mode():
        for sampling in (None, smp):
            whole = markov_walk(model, hf, model.logits(hf), token, sampling)
            walked = markov_walk(model, hf, None, token, sampling)
            for field in ("draft_ids", "confidence", "margin", "support_ids", "proposal_q"):
                a, c = getattr(whole, field), getattr(walked, field)
                assert (a is None and c is None) or torch.equal(a, c), field


def test_a_second_drafter_captures_its_step_over_shared_rings_keeping_live_windows() -> None:
    """A reload's drafter gets a sibling of the serving pool (the same ring memory and lanes,
    its own model) and checks its captured step on the lanes no session holds: the live
    lanes' K/V stay as they were, the checked ones are zero again, and it drafts through the
    captured step with the windows the serving drafter's sessions left."""
    first = make_drafter(tiny_config(), seed=5)
    second = make_drafter(tiny_config(), seed=6)
    pool = first.new_pool(12, W)
    live = pool.allocate(5)
    anchors = fill(first, pool, live, seed=3)
    before = pool.kv.clone()
    sibling = pool.sibling(second.model)
    assert sibling.kv is pool.kv and sibling.model is second.model
    free = np.flatnonzero(~pool._in_use).astype(np.int64)
    report = second.prepare_graphs(sibling, 4, replay=CountingReplay, lanes=free)
    assert report.fallback is None and report.graphs == 6
    assert torch.equal(pool.kv[:, :, live], before[:, :, live])
    assert not pool.kv[:, :, free].any()
    assert pool.allocate(1)[0] == 5  # one lane space: the sibling's allocations are the pool's
    count = CountingReplay.count
    got = second.draft(sibling, live[:3], anchors[:3], [1, 2, 3])
    assert CountingReplay.count == count + 1
    second.graphs = None
    assert_same(got, second.draft(sibling, live[:3], anchors[:3], [1, 2, 3]), exact=False)
    other = make_drafter(tiny_config(num_hidden_layers=1), seed=7)
    with pytest.raises(ValueError, match=r"ring layout differs: layers 1 \(serving 2\)"):
        pool.sibling(other.model)
