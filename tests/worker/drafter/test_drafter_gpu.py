"""The CUDA path of the drafter's equalities (skipped without CUDA).

fp32 on CUDA must draft what the from-scratch reference drafts and what the CPU drafts; bf16
(the default on CUDA) is held to a tolerance; sampled drafts must pass the contract's own
checks (9.2, and 9.3 re-derived draws: integer arithmetic, exact on any device)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from drafter_support import TINY, check_sampled, make_drafter, make_rows

from dspark_worker.drafter import Drafter, RingPool, SamplingParams, from_tensors, random_tensors
from protocol import sampled

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

W = 8


def cuda_drafter(dtype: torch.dtype) -> Drafter:
    return from_tensors(TINY, random_tensors(TINY, 7), device="cuda", dtype=dtype)


def ingest_schedule(drafter: Drafter, seed: int) -> tuple[RingPool, np.ndarray,
                                                           list[np.ndarray], list[int]]:
    """Three lanes fed in chunks across the ring's end; returns the newest rows per lane."""
    rng = np.random.default_rng(seed)
    pool = drafter.new_pool(3, W)
    lanes = pool.allocate(3)
    history: list[list[np.ndarray]] = [[], [], []]
    anchors = [0, 0, 0]
    for step in range(6):
        counts = [int(rng.integers(1, 6)), int(rng.integers(0, 3)), 13 if step == 3 else 2]
        rows = [make_rows(rng, n) for n in counts]
        for i in range(3):
            anchors[i] += counts[i]
            history[i].extend(rows[i])
        # a read-only buffer, as a received frame would be
        pool.apply(lanes, anchors, counts, [False] * 3, np.concatenate(rows).tobytes())
    newest = [np.stack(h[-W:]) if h else np.zeros((0, TINY.row_bytes), np.uint8)
              for h in history]
    return pool, lanes, newest, list(anchors)


def test_cuda_fp32_equals_reference_and_cpu() -> None:
    gpu = cuda_drafter(torch.float32)
    cpu = make_drafter()
    pool, lanes, newest, anchors = ingest_schedule(gpu, 1)
    tokens = [3, 4, 5]
    got = gpu.draft(pool, lanes, anchors, tokens)
    ref = gpu.reference_draft(newest, anchors, tokens)
    on_cpu = cpu.reference_draft(newest, anchors, tokens)
    np.testing.assert_array_equal(got.draft_ids, ref.draft_ids)
    np.testing.assert_array_equal(got.draft_ids, on_cpu.draft_ids)
    np.testing.assert_allclose(got.confidence, ref.confidence, atol=1e-4)
    np.testing.assert_allclose(got.confidence, on_cpu.confidence, atol=1e-4)
    assert gpu.drafter_identity == cpu.drafter_identity


def test_cuda_bf16_close_to_fp32() -> None:
    """bf16 drafts from the rings against the fp32 CPU reference on the same rows. bf16 moves
    logits by about 1e-2, so a near tie may flip and the walk then parts: hold position 0 of
    many lanes to a rate, and its confidence to a tolerance."""
    gpu = cuda_drafter(torch.bfloat16)
    assert gpu.dtype == torch.bfloat16
    cpu = make_drafter()
    rng = np.random.default_rng(2)
    lanes_n = 32
    pool = gpu.new_pool(lanes_n, W)
    lanes = pool.allocate(lanes_n)
    counts = rng.integers(1, 2 * W, lanes_n)
    rows = [make_rows(rng, int(n)) for n in counts]
    pool.apply(lanes, counts, counts, np.ones(lanes_n, dtype=bool), np.concatenate(rows))
    tokens = rng.integers(0, TINY.vocab_size, lanes_n)
    got = gpu.draft(pool, lanes, counts, tokens)
    ref = cpu.reference_draft([r[-W:] for r in rows], counts, tokens)
    agree = got.draft_ids[:, 0] == ref.draft_ids[:, 0]
    assert agree.mean() >= 0.75
    np.testing.assert_allclose(got.confidence[agree, 0], ref.confidence[agree, 0], atol=0.05)
    assert np.isfinite(got.margin).all() and (got.margin >= 0).all()
    assert ((got.confidence >= 0) & (got.confidence <= 1)).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_sampled_satisfies_the_contract(dtype: torch.dtype) -> None:
    gpu = cuda_drafter(dtype)
    pool, lanes, _, anchors = ingest_schedule(gpu, 3)
    params = SamplingParams(top_k=[32, 4, 0], temperature=[1.0, 0.8, 1.0], top_p=[0.0, 0.9, 0.0],
                            seed=[1, 2, 3], generation=[0, 5, 0])
    out = gpu.draft(pool, lanes, anchors, [3, 4, 5], sampling=params, keep_logits=True)
    assert out.support_ids is not None and out.proposal_q is not None and out.logits is not None
    check_sampled(out, params, anchors, TINY.vocab_size)
    top_k = np.array(params.top_k)
    temps = np.asarray(params.temperature, dtype=np.float32)
    top_ps = np.asarray(params.top_p, dtype=np.float32)
    # q against the host build on the same logits: CUDA's exp may differ in the last bit, so
    # allow a rare unit of difference
    same = total = 0
    for i in (0, 1):
        for j in range(TINY.block_size):
            ids, q = sampled.build_q(out.logits[i, j], int(top_k[i]), float(temps[i]),
                                     float(top_ps[i]))
            np.testing.assert_array_equal(out.support_ids[i, j][q > 0], ids[q > 0])
            assert np.abs(out.proposal_q[i, j].astype(np.int64) - q).max() <= 2
            same += int(np.array_equal(out.proposal_q[i, j], q))
            total += 1
    assert same >= total - 2


def test_cuda_staging_reuse_across_steps() -> None:
    """Many small applies in a row reuse the pinned staging buffer; later ones must not corrupt
    earlier rows (the copy is waited for before the buffer is overwritten)."""
    gpu = cuda_drafter(torch.float32)
    rng = np.random.default_rng(4)
    pool = gpu.new_pool(1, 64)
    lane = pool.allocate(1)
    rows = make_rows(rng, 40)
    for p in range(40):
        pool.apply(lane, [p + 1], [1], [False], rows[p:p + 1])
    got = gpu.draft(pool, lane, [40], [7])
    ref = gpu.reference_draft([rows], [40], [7])
    np.testing.assert_array_equal(got.draft_ids, ref.draft_ids)
    np.testing.assert_allclose(got.confidence, ref.confidence, atol=1e-4)


def test_cuda_warmup_and_embedded_default() -> None:
    from dspark_worker.drafter import embedded_default

    drafter = embedded_default(device="cuda")
    assert drafter.dtype == torch.bfloat16
    drafter.warmup()
    assert drafter.drafter_identity == embedded_default().drafter_identity


# -- the captured draft step (one CUDA graph per bucket) --------------------------------------


GEMMA4_TINY = Path(__file__).resolve().parent / "data" / "gemma4_tiny"
SPECULATORS_TINY = Path(__file__).resolve().parent / "data" / "speculators_tiny"
# The speculators checkpoints with the most to capture: the bonus layout's lead row and rnn
# step, a reduced vocabulary's d2t map, sliding layers causal in the block.
SPECULATORS_GRAPHED = ("rnn_bonus_reduced_causal", "gated_bonus_full_sliding")


DFLASH_TINY = Path(__file__).resolve().parent / "data" / "dflash_tiny"
# DFlash checkpoints with the most to capture: DFlash2's convolutions and selector, z-lab's
# per-query sliding window with its scales and softcap.
DFLASH_GRAPHED = {"spec_dflash2_b5": "target", "extra_zlab2_scaled_yarn": "target_tied"}
MINIMAX_TINY = Path(__file__).resolve().parent / "data" / "minimax_m3_tiny"
# MiniMax-M3: MXFP8 dequantised, MQA, the per-row window beside a full layer.
MINIMAX_GRAPHED = ("extra_mqa_mixed_sharded",)


K3_TINY = Path(__file__).resolve().parent / "data" / "k3_tiny"
# The K3 checkpoint with the most to capture: an anchor lead row, logit_scale, YaRN's factors.
K3_GRAPHED = ("extra_lead_scaled_v2000",)


def family_on_cuda(family: str, dtype: torch.dtype) -> Drafter:
    from dspark_worker.drafter import load_drafter

    if family in K3_GRAPHED:
        return load_drafter(K3_TINY / family, K3_TINY / f"{family}_target", device="cuda",
                            dtype=dtype, record_identities=False)
    if family == "qwen3":
        return cuda_drafter(dtype)
    if family == "gemma4":
        return load_drafter(GEMMA4_TINY, device="cuda", dtype=dtype)
    if family in MINIMAX_GRAPHED:
        return load_drafter(MINIMAX_TINY / family, MINIMAX_TINY / "target", device="cuda",
                            dtype=dtype, record_identities=False)
    if family in DFLASH_GRAPHED:
        return load_drafter(DFLASH_TINY / family, DFLASH_TINY / DFLASH_GRAPHED[family],
                            device="cuda", dtype=dtype, record_identities=False)
    return load_drafter(SPECULATORS_TINY / family, SPECULATORS_TINY / "target", device="cuda",
                        dtype=dtype)


@pytest.mark.parametrize("family", ["qwen3", "gemma4", *SPECULATORS_GRAPHED, *DFLASH_GRAPHED,
                                    *K3_GRAPHED, *MINIMAX_GRAPHED])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graphs_capture_check_and_equal_eager(dtype: torch.dtype, family: str) -> None:
    """Every bucket captures and passes the start-up self-check (graph replay against the eager
    step on the same buffers, ids exactly); drafts through the graphs then equal eager drafts of
    the same lanes: ids exactly in fp32, and to bf16's near-tie rate in bf16, where the padded
    bucket's GEMMs may round differently."""
    gpu = family_on_cuda(family, dtype)
    config = gpu.config
    pool = gpu.new_pool(16, W)
    report = gpu.prepare_graphs(pool, 12)
    assert report.fallback is None, report.fallback
    assert report.buckets == (1, 2, 4, 8, 12) and report.graphs == 10
    graphs = gpu.graphs
    assert graphs is not None
    rng = np.random.default_rng(5)
    lanes = pool.allocate(16)
    counts = rng.integers(1, 3 * W, 16)
    rows = [make_rows(rng, int(n), config) for n in counts]
    pool.apply(lanes, counts, counts, np.ones(16, dtype=bool), np.concatenate(rows))
    for b in (1, 3, 8, 11):
        pick = rng.permutation(16)[:b]
        tokens = rng.integers(0, config.vocab_size, b)
        params = SamplingParams(top_k=rng.integers(0, 33, b), temperature=np.ones(b),
                                top_p=np.full(b, 0.9), seed=np.arange(b, dtype=np.uint64),
                                generation=np.zeros(b))
        for sampling in (None, params):
            got = gpu.draft(pool, lanes[pick], counts[pick], tokens, sampling=sampling)
            gpu.graphs = None
            want = gpu.draft(pool, lanes[pick], counts[pick], tokens, sampling=sampling)
            gpu.graphs = graphs
            agree = (got.draft_ids == want.draft_ids).mean()
            assert agree == 1.0 if dtype == torch.float32 else agree >= 0.9
            if sampling is not None:
                check_sampled(got, params, counts[pick], config.vocab_size)


def test_cuda_graph_step_has_no_host_sync() -> None:
    """The static step run eagerly under CUDA's sync debug mode: any synchronisation inside it
    (what capture would refuse) raises."""
    from dspark_worker.drafter.step import StaticStep

    for family in ("qwen3", *SPECULATORS_GRAPHED):
        gpu = family_on_cuda(family, torch.bfloat16)
        pool = gpu.new_pool(4, W)
        for sampled_mode in (False, True):
            step_without_sync(StaticStep(gpu.model, pool, 4, gpu.num_spec, sampled_mode))


def step_without_sync(step: Any) -> None:
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.inference_mode():
            step.compute()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_cuda_self_check_falls_back_on_a_wrong_graph() -> None:
    """A captured step that differs from the eager one is caught at start-up: no graphs."""
    from dspark_worker.drafter.step import CudaGraphReplay

    class Wrong(CudaGraphReplay):
        def replay(self) -> None:
            super().replay()
            self.outputs = {**self.outputs, "draft_ids": self.outputs["draft_ids"] + 1}

    gpu = cuda_drafter(torch.bfloat16)
    pool = gpu.new_pool(4, W)
    report = gpu.prepare_graphs(pool, 4, replay=Wrong)
    assert report.graphs == 0 and gpu.graphs is None
    assert report.fallback is not None and "draft_ids" in report.fallback


@pytest.mark.parametrize("family", ["qwen3", "rnn_bonus_reduced_causal"])
def test_cuda_graphs_of_the_candidate_walk(family: str) -> None:
    """dspark_draft_topk: its graphs capture and pass the self-check too (over a reduced draft
    vocabulary for the speculators checkpoint)."""
    gpu = family_on_cuda(family, torch.bfloat16).with_draft_topk(64)
    pool = gpu.new_pool(8, W)
    report = gpu.prepare_graphs(pool, 8)
    assert report.fallback is None, report.fallback
    assert report.graphs == 8 and gpu.graphs is not None


def test_cuda_fp32_drafts_the_dflash_vectors() -> None:
    """fp32 on CUDA drafts every DFlash case (ids exact, margins within 1e-3), eager and through
    the captured graphs."""
    drafts_the_vectors_on_cuda(DFLASH_TINY, 32)


def drafts_the_vectors_on_cuda(root: Path, window: int | None) -> None:
    """Every case of ``root``'s cases.json and cases_extra.json in fp32 on CUDA, each in a lane
    of its own with its rows in one apply, eager and through the captured graphs: ids exact,
    margins within 1e-3. ``window``: the pool's W (None: the vectors' own)."""
    import json

    from safetensors.torch import load_file

    from dspark_worker.drafter import load_drafter

    for suffix in ("", "_extra"):
        vectors = json.loads((root / f"cases{suffix}.json").read_text())
        taps = load_file(str(root / f"taps{suffix}.safetensors"))
        for name, info in vectors["checkpoints"].items():
            cases = [c for c in vectors["cases"] if c["checkpoint"] == name]
            gpu = load_drafter(root / name, root / info["target"], device="cuda",
                               dtype=torch.float32, record_identities=False)
            pool = gpu.new_pool(len(cases), window or vectors["window"])
            assert gpu.prepare_graphs(pool, 4).fallback is None
            lanes = pool.allocate(len(cases))
            rows = np.concatenate([taps[c["taps_key"]].view(torch.int16).numpy().view(np.uint8)
                                   .reshape(c["n_rows"], -1) for c in cases])
            anchors = [c["anchor_pos"] for c in cases]
            pool.apply(lanes, anchors, [c["n_rows"] for c in cases], [True] * len(cases), rows)
            graphs = gpu.graphs
            for g in (graphs, None):
                gpu.graphs = g
                got = gpu.draft(pool, lanes, anchors, [c["anchor_token"] for c in cases])
                for i, c in enumerate(cases):
                    assert got.draft_ids[i].tolist() == c["ids"], (name, c["case"])
                    np.testing.assert_allclose(got.margin[i], c["margin"], atol=1e-3, rtol=0)


def test_cuda_fp32_drafts_the_k3_vectors() -> None:
    """fp32 on CUDA drafts every Kimi-K3 case, shared and ours (ids exact, margins within
    1e-3), eager and through the captured graphs; the rows of each case in one apply."""
    drafts_the_vectors_on_cuda(K3_TINY, None)


def test_cuda_fp32_drafts_the_minimax_vectors() -> None:
    """fp32 on CUDA drafts every MiniMax-M3 case (ids exact, confidences within 1e-4, margins
    within 1e-3) from rings of 64, eager and through the captured graphs."""
    import json

    from safetensors.torch import load_file

    from dspark_worker.drafter import load_drafter

    for suffix in ("", "_extra"):
        vectors = json.loads((MINIMAX_TINY / f"cases{suffix}.json").read_text())
        taps = load_file(str(MINIMAX_TINY / f"taps{suffix}.safetensors"))
        for name, info in vectors["checkpoints"].items():
            cases = [c for c in vectors["cases"] if c["checkpoint"] == name]
            gpu = load_drafter(MINIMAX_TINY / name, MINIMAX_TINY / info["target"],
                               device="cuda", dtype=torch.float32, record_identities=False)
            pool = gpu.new_pool(len(cases), 64)
            assert gpu.prepare_graphs(pool, 4).fallback is None
            lanes = pool.allocate(len(cases))
            rows = [taps[c["taps_key"]].view(torch.int16).numpy().view(np.uint8)
                    .reshape(c["n_rows"], -1)[-64:] for c in cases]
            anchors = [c["anchor_pos"] for c in cases]
            pool.apply(lanes, anchors, [len(r) for r in rows], [True] * len(cases),
                       np.concatenate(rows))
            graphs = gpu.graphs
            for g in (graphs, None):
                gpu.graphs = g
                got = gpu.draft(pool, lanes, anchors, [c["anchor_token"] for c in cases])
                for i, c in enumerate(cases):
                    assert got.draft_ids[i].tolist() == c["ids"], (name, c["case"])
                    np.testing.assert_allclose(got.confidence[i], c["confidence"], atol=1e-4,
                                               rtol=0)
                    np.testing.assert_allclose(got.margin[i], c["margin"], atol=1e-3, rtol=0)
