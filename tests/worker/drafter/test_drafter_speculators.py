"""The speculators family: speculators' own drafts on the shared tiny vectors, an independent
plain implementation (float64) for longer contexts, sliding windows that wrap, batches of lanes,
sampled mode over a reduced vocabulary (9.2, 9.3), bf16 on the CPU, RoPE scaling against
transformers' values, config.json parsing and refusals, checkpoints with their target, and the
engine's HELLO.

``data/speculators_tiny`` holds three tiny checkpoints saved by speculators' ``save_pretrained``,
the target tensors they need and cases whose greedy drafts, confidences and margins came from
speculators' own modules in fp32, and two more made the same way (``cases_extra.json``: a llama
layer config with attention biases, yarn RoPE, no Markov head and the bonus layout; the rnn head
in the bonus layout over a reduced vocabulary; its README)."""

from __future__ import annotations

import copy
import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from drafter_support import (
    DROP,
    assert_same,
    bf16_taps,
    check_bf16_many_lanes,
    check_sampled,
    params,
    refuse_host_reads,
    set_key,
    static_and_eager,
    with_static_step,
)
from safetensors.torch import load_file, save_file

from dspark_client import hello_from_checkpoint, tap_layers
from dspark_worker.drafter import (
    CheckpointError,
    Drafter,
    DrafterConfigError,
    SamplingParams,
    SpeculatorsConfig,
    SpeculatorsDrafterModel,
    build_model,
    detect_family,
    encode_bf16_rows,
    from_tensors,
    load_drafter,
    parse_config,
    random_tensors,
    save_checkpoint,
)
from dspark_worker.drafter.step import StaticStep
from protocol.identity import identities_from_checkpoint

DATA = Path(__file__).resolve().parent / "data" / "speculators_tiny"
TARGET = DATA / "target"
NAMES = ("vanilla_anchor_reduced", "gated_bonus_full_sliding", "rnn_anchor_reduced_mixed_noconf")
EXTRA = ("llama_bias_yarn_bonus_nomarkov", "rnn_bonus_reduced_causal")
CONF_TOL, MARGIN_TOL = 1e-4, 1e-3  # against speculators' fp32 drafts


@pytest.fixture(scope="module")
def drafters() -> dict[str, Drafter]:
    return {name: load_drafter(DATA / name, TARGET) for name in NAMES + EXTRA}


@pytest.fixture(scope="module")
def cases() -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for name in ("cases.json", "cases_extra.json"):
        out += json.loads((DATA / name).read_text())["cases"]
    return out


@pytest.fixture(scope="module")
def taps() -> dict[str, np.ndarray]:
    """Each case's wire rows, uint8 [n_rows, row_bytes] (the vectors' bf16 bytes)."""
    out: dict[str, np.ndarray] = {}
    for name in ("taps.safetensors", "taps_extra.safetensors"):
        out.update({k: t.view(torch.int16).numpy().view(np.uint8).reshape(t.shape[0], -1)
                    for k, t in load_file(str(DATA / name)).items()})
    return out


def raw_config(name: str = "vanilla_anchor_reduced") -> dict[str, Any]:
    out: dict[str, Any] = json.loads((DATA / name / "config.json").read_text())
    return out


def weights(drafter: Drafter) -> dict[str, torch.Tensor]:
    """Every tensor the drafter runs with (target ones included), float64 where float."""
    return {k: (v.double() if v.is_floating_point() else v)
            for k, v in drafter.model.state_dict().items()}


def wire_taps(rows: np.ndarray) -> np.ndarray:
    return torch.from_numpy(rows.copy()).view(torch.bfloat16).float().numpy()


# -- an independent plain implementation (SPECULATORS.md section 5, float64) ------------------


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def _rope(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor, scale: float
          ) -> torch.Tensor:
    ang = pos.double()[:, None] * inv_freq.double()[None, :]  # [T, hd/2]
    cos = torch.cat([ang.cos(), ang.cos()], -1)[:, None] * scale
    sin = torch.cat([ang.sin(), ang.sin()], -1)[:, None] * scale
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rot * sin


def plain_draft(t: dict[str, torch.Tensor], cfg: SpeculatorsConfig, inv_freq: torch.Tensor,
                scale: float, taps: np.ndarray, anchor_pos: int, token: int
                ) -> tuple[list[int], np.ndarray, np.ndarray]:
    """One lane: every context row projected from scratch at its absolute position, each
    layer's visibility as speculators trains it, the Markov walk in target ids."""
    eps, nh, hd = cfg.rms_norm_eps, cfg.num_attention_heads, cfg.head_dim
    hk = cfg.num_key_value_heads
    blk, ln = cfg.block_size, taps.shape[0]
    ctx = _rms(torch.from_numpy(taps).double() @ t["fc.weight"].T, t["hidden_norm.weight"], eps)
    ids = torch.tensor([token] + [cfg.mask_token_id] * (blk - 1))
    h = t["embed_tokens.weight"][ids]
    ctx_pos, blk_pos = torch.arange(anchor_pos - ln, anchor_pos), torch.arange(anchor_pos,
                                                                               anchor_pos + blk)
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."

        def lin(x: torch.Tensor, name: str, p: str = p) -> torch.Tensor:
            out = x @ t[p + name + ".weight"].T
            bias = t.get(p + name + ".bias")
            return out if bias is None else out + bias

        x = _rms(h, t[p + "input_layernorm.weight"], eps)
        q = _rms(lin(x, "self_attn.q_proj").view(blk, nh, hd), t[p + "self_attn.q_norm.weight"],
                 eps)
        q = _rope(q, blk_pos, inv_freq, scale)
        kv_in = torch.cat([ctx, x])
        k = _rms(lin(kv_in, "self_attn.k_proj").view(ln + blk, hk, hd),
                 t[p + "self_attn.k_norm.weight"], eps)
        k = _rope(k, torch.cat([ctx_pos, blk_pos]), inv_freq, scale)
        v = lin(kv_in, "self_attn.v_proj").view(ln + blk, hk, hd)
        see = torch.ones(blk, ln + blk, dtype=torch.bool)
        if cfg.layer_types[i] == "sliding_attention":
            see[:, :ln] = torch.arange(ln) >= ln - cast(int, cfg.sliding_window)
            if not cfg.sliding_window_non_causal:
                see[:, ln:] = torch.arange(blk)[None, :] <= torch.arange(blk)[:, None]
        g = nh // hk
        scores = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(g, 1)) * hd**-0.5
        att = torch.softmax(scores.masked_fill(~see, float("-inf")), -1)
        o = torch.einsum("hqk,khd->qhd", att, v.repeat_interleave(g, 1)).reshape(blk, nh * hd)
        h = h + lin(o, "self_attn.o_proj")
        y = _rms(h, t[p + "post_attention_layernorm.weight"], eps)
        h = h + (F.silu(y @ t[p + "mlp.gate_proj.weight"].T) * (y @ t[p + "mlp.up_proj.weight"].T)
                 ) @ t[p + "mlp.down_proj.weight"].T
    hf = _rms(h, t["norm.weight"], eps)
    u = hf @ t["lm_head.weight"].T  # [B, Vd]
    kind, r = cfg.markov_head_type, cfg.markov_rank
    state = torch.zeros(r, dtype=torch.float64)

    def markov(prev: int, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        nonlocal state
        e = t["markov_head.markov_w1.weight"][prev]
        w2 = t["markov_head.markov_w2.weight"]
        if kind == "gated":
            gate = torch.sigmoid(torch.cat([hf[j], e]) @ t["markov_head.gate_proj.weight"].T
                                 + t["markov_head.gate_proj.bias"])
            return e, w2 @ (gate * e)
        if kind == "rnn":
            gu_o = (torch.cat([state, e, hf[j]]) @ t["markov_head.joint_proj.weight"].T
                    + t["markov_head.joint_proj.bias"])
            gr, ur, orw = gu_o.chunk(3)
            state = torch.sigmoid(gr) * state + (1 - torch.sigmoid(gr)) * torch.tanh(ur)
            return e, w2 @ torch.tanh(orw)
        return e, w2 @ e

    lead = 0 if cfg.sample_from_anchor else 1
    if lead and r and kind == "rnn":
        markov(token, 0)  # the state steps through the anchor's row
    d2t = t.get("d2t")
    prev, out, confs, margins = token, [], [], []
    for j in range(lead, blk):
        e: torch.Tensor | None = None
        z = u[j]
        if r:
            e, bias = markov(prev, j)
            z = z + bias
        top = torch.topk(z, 2).values
        d = int(torch.argmax(z))
        x = d + int(d2t[d]) if d2t is not None else d
        if cfg.enable_confidence_head:
            feats = torch.cat([hf[j], e]) if cfg.confidence_head_with_markov and e is not None \
                else hf[j]
            logit = feats @ t["confidence_head.proj.weight"][0] + t["confidence_head.proj.bias"][0]
            confs.append(float(torch.sigmoid(logit)))
        else:
            confs.append(1.0)
        margins.append(float(top[0] - top[1]))
        out.append(x)
        prev = x
    return out, np.array(confs, np.float32), np.array(margins, np.float32)


def oracle(drafter: Drafter, taps: np.ndarray, anchor_pos: int, token: int
           ) -> tuple[list[int], np.ndarray, np.ndarray]:
    model = cast(SpeculatorsDrafterModel, drafter.model)
    return plain_draft(weights(drafter), cast(SpeculatorsConfig, drafter.config),
                       model.inv_freq, model.attention_scaling, taps, anchor_pos, token)


# -- speculators' own drafts --------------------------------------------------------------------


def test_families_and_geometry(drafters: dict[str, Drafter]) -> None:
    v, g, r = (drafters[n] for n in NAMES)
    for d in (v, g, r):
        assert isinstance(d.config, SpeculatorsConfig) and d.family == "speculators"
        assert (d.vocab_size, d.num_spec, d.target_hidden) == (300, 4, 64)
    assert (v.config.draft_vocab, v.config.block_size, v.config.target_layer_ids) == (
        120, 4, (1, 4, 7))
    assert (g.config.draft_vocab, g.config.block_size, g.config.lead_rows) == (300, 5, 1)
    assert g.config.sliding_layers == (0, 1) and g.config.sliding_window == 6
    assert (r.config.layer_types, r.config.rope_type) == (
        ("sliding_attention", "full_attention"), "llama3")
    assert (v.n_taps, g.n_taps, r.n_taps) == (3, 2, 4)
    assert r.model.confidence_head is None and r.config.markov_head_type == "rnn"
    y, b = (drafters[n] for n in EXTRA)
    assert (y.config.layer_model_type, y.config.attention_bias, y.config.rope_type) == (
        "llama", True, "yarn")
    assert y.model.markov_head is None and y.config.confidence_input_dim == 64
    assert (y.num_spec, y.config.draft_vocab, b.num_spec, b.config.draft_vocab) == (4, 100, 4, 150)
    assert (b.config.markov_head_type, b.config.num_kv_groups) == ("rnn", 4)


@pytest.mark.parametrize("window", [20, 64])
def test_vectors_from_the_rings(drafters: dict[str, Drafter], cases: list[dict[str, Any]],
                                taps: dict[str, np.ndarray], window: int) -> None:
    """Each checkpoint's four cases in one batch of lanes, rows fed in two chunks (W = 20 holds
    every case's rows: the largest has 20)."""
    for name, d in drafters.items():
        mine = [c for c in cases if c["checkpoint"] == name]
        pool = d.new_pool(6, window)
        lanes = pool.allocate(6)[[5, 0, 3, 2]]
        for c, lane in zip(mine, lanes, strict=True):
            rows, a, n = taps[c["taps_key"]], c["anchor_pos"], c["n_rows"]
            half = n // 2
            pool.apply([lane], [a - n + half], [half], [True], rows[:half])
            pool.apply([lane], [a], [n - half], [False], rows[half:])
        out = d.draft(pool, lanes, [c["anchor_pos"] for c in mine],
                      [c["anchor_token"] for c in mine])
        for i, c in enumerate(mine):
            assert out.window_rows[i] == c["n_rows"]
            assert out.draft_ids[i].tolist() == c["ids"], (name, c["case"])
            np.testing.assert_allclose(out.confidence[i], c["confidence"], atol=CONF_TOL, rtol=0)
            np.testing.assert_allclose(out.margin[i], c["margin"], atol=MARGIN_TOL, rtol=0)


def test_vectors_from_the_reference_and_the_plain_oracle(
        drafters: dict[str, Drafter], cases: list[dict[str, Any]],
        taps: dict[str, np.ndarray]) -> None:
    for c in cases:
        d = drafters[c["checkpoint"]]
        rows = taps[c["taps_key"]]
        ref = d.reference_draft([rows], [c["anchor_pos"]], [c["anchor_token"]])
        assert ref.draft_ids[0].tolist() == c["ids"]
        np.testing.assert_allclose(ref.margin[0], c["margin"], atol=MARGIN_TOL, rtol=0)
        ids, conf, margin = oracle(d, wire_taps(rows), c["anchor_pos"], c["anchor_token"])
        assert ids == c["ids"], (c["checkpoint"], c["case"])
        np.testing.assert_allclose(conf, c["confidence"], atol=CONF_TOL, rtol=0)
        np.testing.assert_allclose(margin, c["margin"], atol=MARGIN_TOL, rtol=0)


def test_each_difference_changes_the_drafts(drafters: dict[str, Drafter],
                                            cases: list[dict[str, Any]],
                                            taps: dict[str, np.ndarray]) -> None:
    """The vectors see the sliding window, the causal block, the bonus layout's rnn step and
    the d2t offsets: serving any of them the DeepSpec way moves the drafts."""
    def moved(name: str, case: int, **change: Any) -> bool:
        d = drafters[name]
        c = next(k for k in cases if k["checkpoint"] == name and k["case"] == case)
        config = dataclasses.replace(d.config, **change)
        other = from_tensors(config, d.model.state_dict(), dtype=torch.float32)
        got = other.reference_draft([taps[c["taps_key"]]], [c["anchor_pos"]],
                                    [c["anchor_token"]])
        return (got.draft_ids[0].tolist() != c["ids"]
                or float(np.abs(got.margin[0] - c["margin"]).max()) > 1e-2)

    assert moved("gated_bonus_full_sliding", 2, layer_types=("full_attention",) * 2)
    assert moved("gated_bonus_full_sliding", 0, sliding_window_non_causal=True)
    assert moved("rnn_anchor_reduced_mixed_noconf", 2, sliding_window_non_causal=False)
    assert moved("rnn_anchor_reduced_mixed_noconf", 1, sliding_window=64)
    assert moved("rnn_anchor_reduced_mixed_noconf", 3, rope_type="default", rope_scaling=())
    # d2t read as absolute ids instead of offsets
    d = drafters["vanilla_anchor_reduced"]
    assert int(d.model.target_ids(torch.tensor([5]))) != 5


# -- longer contexts, windows, batches ----------------------------------------------------------


@pytest.mark.parametrize("name", ["gated_bonus_full_sliding", "rnn_anchor_reduced_mixed_noconf"])
def test_long_context_and_wrapping_windows(drafters: dict[str, Drafter], name: str) -> None:
    """200 rows in uneven chunks: a 256-slot ring holds them all, a 16-slot one wraps many
    times and a 4-slot one holds fewer rows than the sliding window; each equals the plain
    oracle on the rows it holds, at their absolute positions."""
    d = drafters[name]
    rng = np.random.default_rng(5)
    total = 200
    values = bf16_taps(rng, total, d.config.tap_width)
    wire_rows = encode_bf16_rows(values)
    for window in (256, 16, 4):
        pool = d.new_pool(1, window)
        lane = pool.allocate(1)
        at = 0
        while at < total:
            n = min(int(rng.integers(1, 30)), total - at)
            pool.apply(lane, [at + n], [n], [at == 0], wire_rows[at:at + n])
            at += n
        token = 123
        got = d.draft(pool, lane, [total], [token])
        held = min(window, total)
        assert got.window_rows[0] == held
        ids, conf, margin = oracle(d, values[total - held:], total, token)
        assert got.draft_ids[0].tolist() == ids, window
        np.testing.assert_allclose(got.confidence[0], conf, atol=CONF_TOL, rtol=0)
        np.testing.assert_allclose(got.margin[0], margin, atol=MARGIN_TOL, rtol=0)


def test_several_slots_in_one_batch_equal_each_alone(drafters: dict[str, Drafter]) -> None:
    """Lanes of different lengths (under, at and over the sliding window and the ring) and
    anchors, gathered from non-contiguous lanes, equal the reference lane by lane."""
    rng = np.random.default_rng(6)
    for name in ("gated_bonus_full_sliding", "rnn_anchor_reduced_mixed_noconf"):
        d = drafters[name]
        window = 12
        pool = d.new_pool(8, window)
        lanes = pool.allocate(8)[[6, 1, 3, 0, 5]]
        counts = [3, 12, 30, 1, 6]
        anchors = [c + 40 * i for i, c in enumerate(counts)]
        rows = [encode_bf16_rows(bf16_taps(rng, n, d.config.tap_width)) for n in counts]
        pool.apply(lanes, anchors, counts, [True] * 5, np.concatenate(rows))
        tokens = rng.integers(0, d.vocab_size, 5)
        got = d.draft(pool, lanes, anchors, tokens)
        ref = d.reference_draft([r[-window:] for r in rows], anchors, tokens)
        np.testing.assert_array_equal(got.draft_ids, ref.draft_ids)
        np.testing.assert_allclose(got.confidence, ref.confidence, atol=CONF_TOL, rtol=0)
        np.testing.assert_allclose(got.margin, ref.margin, atol=MARGIN_TOL, rtol=0)
        assert got.window_rows.tolist() == [min(n, window) for n in counts]


def test_fewer_drafts_in_the_bonus_layout_are_a_prefix(drafters: dict[str, Drafter],
                                                      cases: list[dict[str, Any]],
                                                      taps: dict[str, np.ndarray]) -> None:
    """Every layer of this drafter is causal inside the block, so asking for n < N drafts (a
    block of n + 1 rows: the anchor's, then n) gives the first n of the N drafts."""
    name = "gated_bonus_full_sliding"
    d = drafters[name]
    mine = [c for c in cases if c["checkpoint"] == name]
    pool = d.new_pool(4, 64)
    lanes = pool.allocate(4)
    pool.apply(lanes, [c["anchor_pos"] for c in mine], [c["n_rows"] for c in mine], [True] * 4,
               np.concatenate([taps[c["taps_key"]] for c in mine]))
    for n in (1, 2, 3):
        got = d.draft(pool, lanes, [c["anchor_pos"] for c in mine],
                      [c["anchor_token"] for c in mine], num_spec=n)
        assert got.draft_ids.shape == (4, n)
        for i, c in enumerate(mine):
            assert got.draft_ids[i].tolist() == c["ids"][:n]
            np.testing.assert_allclose(got.margin[i], c["margin"][:n], atol=MARGIN_TOL, rtol=0)
    with pytest.raises(ValueError, match=r"num_spec 5 outside \[1, 4\]"):
        d.draft(pool, lanes, [c["anchor_pos"] for c in mine], [c["anchor_token"] for c in mine],
                num_spec=5)


def test_fused_ingest_with_biases_equals_the_layer_loop(drafters: dict[str, Drafter]) -> None:
    """The one-matmul ingest adds every layer's k/v biases as the layer loop does."""
    d = drafters["llama_bias_yarn_bonus_nomarkov"]
    model = cast(SpeculatorsDrafterModel, d.model)
    assert model.decoder_layers[0].self_attn.k_proj.bias is not None
    taps = torch.from_numpy(bf16_taps(np.random.default_rng(7), 11, d.config.tap_width))
    pos = torch.arange(100, 111)
    with torch.inference_mode():
        k, v = model.project_context(taps, pos)
        kv = model.project_context_kv(taps, pos)
    torch.testing.assert_close(kv[0], k, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kv[1], v, atol=1e-5, rtol=1e-5)


# -- sampled mode over a reduced vocabulary -------------------------------------------------------


@pytest.mark.parametrize("name", ["vanilla_anchor_reduced", "rnn_anchor_reduced_mixed_noconf"])
def test_sampled_drafts_satisfy_the_contract(drafters: dict[str, Drafter], name: str) -> None:
    """q over the draft vocabulary, its support mapped to target ids: 9.2's rules hold on
    target ids (range, distinct, canonical order, the draft in the support) and 9.3's draws
    re-derive; support ids are ids the draft vocabulary holds; q equals the host build."""
    d = drafters[name]
    in_draft = cast(torch.Tensor, d.model.t2d).numpy()  # [V] bool
    rng = np.random.default_rng(8)
    counts = [9, 20, 4, 13]
    rows = [encode_bf16_rows(bf16_taps(rng, n, d.config.tap_width)) for n in counts]
    pool = d.new_pool(4, 16)
    lanes = pool.allocate(4)
    pool.apply(lanes, counts, counts, [True] * 4, np.concatenate(rows))
    sp = SamplingParams(top_k=[32, 4, 0, 7], temperature=[1.0, 0.7, 1.0, 2.0],
                        top_p=[0.0, 0.9, 0.0, 0.5], seed=[11, 12, 13, 14],
                        generation=[0, 3, 0, 9])
    tokens = [5, 299, 7, 150]
    out = d.draft(pool, lanes, counts, tokens, sampling=sp)
    check_sampled(out, sp, counts, d.vocab_size)
    assert out.support_ids is not None and out.proposal_q is not None
    live = out.proposal_q > 0
    assert in_draft[out.support_ids[live]].all()
    assert in_draft[out.draft_ids].all()
    assert int(out.support_ids[live].max()) > d.config.draft_vocab  # target ids, not draft ids
    ref = d.reference_draft([r[-16:] for r in rows], counts, tokens, sampling=sp)
    assert ref.support_ids is not None and ref.proposal_q is not None
    np.testing.assert_array_equal(out.draft_ids, ref.draft_ids)
    np.testing.assert_array_equal(out.support_ids, ref.support_ids)
    diff = np.abs(out.proposal_q.astype(np.int64) - ref.proposal_q.astype(np.int64))
    assert int(diff.max()) <= 256
    greedy = d.draft(pool, lanes[2:3], counts[2:3], tokens[2:3])
    np.testing.assert_array_equal(out.draft_ids[2], greedy.draft_ids[0])


# -- bf16 on the CPU ----------------------------------------------------------------------------


def test_bf16_on_the_cpu_close_to_fp32(drafters: dict[str, Drafter]) -> None:
    """bf16 weights and activations (what a GPU runs) against the fp32 drafter: bf16 moves
    logits by about 1e-2, so a near tie may flip and the walk then parts; hold the first
    position of many lanes to a rate and confidences to a tolerance."""
    for name in ("vanilla_anchor_reduced", "gated_bonus_full_sliding"):
        fp = drafters[name]
        bf = load_drafter(DATA / name, TARGET, dtype=torch.bfloat16)
        assert bf.dtype == torch.bfloat16 and bf.drafter_identity == fp.drafter_identity
        if name == "vanilla_anchor_reduced":  # the index tensor keeps its dtype
            assert bf.model.d2t.dtype == torch.int64
        check_bf16_many_lanes(fp, bf)


# -- RoPE scaling ---------------------------------------------------------------------------------


def test_rope_scaling_equals_transformers() -> None:
    """yarn and llama3 frequencies, yarn's cos/sin factor and cos, sin themselves: exactly
    what transformers 5.19's Qwen3RotaryEmbedding computes (values recorded in the data)."""
    ref = json.loads((DATA / "rope_transformers.json").read_text())
    pos = torch.tensor(ref["positions"])
    for case in ref["cases"]:
        raw = raw_config()
        raw["transformer_layer_config"]["rope_parameters"] = case["rope_parameters"]
        raw["transformer_layer_config"].update(case["layer"])
        model = build_model(parse_config(raw), None, device="cpu", dtype=torch.float32)
        assert isinstance(model, SpeculatorsDrafterModel)
        torch.testing.assert_close(model.inv_freq, torch.tensor(case["inv_freq"]), rtol=0, atol=0)
        assert model.attention_scaling == pytest.approx(case["scaling"], abs=1e-12)
        cos, sin = model.rope(pos)
        torch.testing.assert_close(cos, torch.tensor(case["cos"]), rtol=0, atol=1e-7)
        torch.testing.assert_close(sin, torch.tensor(case["sin"]), rtol=0, atol=1e-7)


def test_other_geometry_with_biases_yarn_and_no_markov_head(tmp_path: Path) -> None:
    """A geometry the vectors lack: attention biases, yarn RoPE, a llama layer config, a full
    vocabulary, the bonus layout, no Markov head and a confidence head on hf alone, random
    weights: the rings equal the plain oracle; save and reload keep drafts and identities."""
    raw = raw_config("gated_bonus_full_sliding")
    layer = raw["transformer_layer_config"]
    layer.update(model_type="llama", attention_bias=True, layer_types=[
        "full_attention", "sliding_attention"], num_attention_heads=8, num_key_value_heads=2,
        rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                         "original_max_position_embeddings": 64})
    raw.update(markov_rank=0, confidence_head_with_markov=False, block_size=6)
    raw["speculators_config"]["proposal_methods"][0]["speculative_tokens"] = 5
    config = parse_config(raw)
    assert isinstance(config, SpeculatorsConfig) and config.num_spec == 5
    tensors = random_tensors(config, 3)
    assert "layers.1.self_attn.o_proj.bias" in tensors and "markov_head.markov_w1.weight" \
        not in tensors
    d = from_tensors(config, tensors, dtype=torch.float32)
    rng = np.random.default_rng(12)
    values = bf16_taps(rng, 40, config.tap_width)
    pool = d.new_pool(1, 64)
    lane = pool.allocate(1)
    pool.apply(lane, [90], [40], [True], encode_bf16_rows(values))
    got = d.draft(pool, lane, [90], [9])
    ids, conf, margin = oracle(d, values, 90, 9)
    assert got.draft_ids[0].tolist() == ids
    np.testing.assert_allclose(got.confidence[0], conf, atol=CONF_TOL, rtol=0)
    np.testing.assert_allclose(got.margin[0], margin, atol=MARGIN_TOL, rtol=0)
    # save (no embed_tokens / lm_head: the target's) and reload with a target folder
    save_checkpoint(d.model, tmp_path / "ckpt")
    assert "embed_tokens.weight" not in load_file(str(tmp_path / "ckpt" / "model.safetensors"))
    target = tmp_path / "target"
    target.mkdir()
    save_file({"model.embed_tokens.weight": tensors["embed_tokens.weight"],
               "lm_head.weight": tensors["lm_head.weight"]}, str(target / "model.safetensors"))
    again = load_drafter(tmp_path / "ckpt", target)
    assert again.config == config
    assert (again.drafter_identity, again.markov_identity) == (d.drafter_identity,
                                                              d.markov_identity)
    pool2 = again.new_pool(1, 64)
    lane2 = pool2.allocate(1)
    pool2.apply(lane2, [90], [40], [True], encode_bf16_rows(values))
    np.testing.assert_array_equal(again.draft(pool2, lane2, [90], [9]).draft_ids, got.draft_ids)


# -- config.json ---------------------------------------------------------------------------------


def test_detection_and_missing_keys_take_speculators_defaults() -> None:
    raw = raw_config()
    assert detect_family(raw).name == "speculators"
    for key in ("sample_from_anchor", "sliding_window_non_causal", "markov_head_type"):
        del raw[key]
    for key in ("attention_bias", "hidden_act", "rms_norm_eps", "layer_types"):
        del raw["transformer_layer_config"][key]
    del raw["transformer_layer_config"]["rope_parameters"]["rope_theta"]
    c = parse_config(raw)
    assert isinstance(c, SpeculatorsConfig)
    assert (c.sample_from_anchor, c.sliding_window_non_causal, c.markov_head_type) == (
        True, False, "vanilla")
    assert (c.attention_bias, c.rms_norm_eps, c.layer_types, c.rope_theta) == (
        False, 1e-6, ("full_attention", "full_attention"), 10000.0)
    # a config lacking block_size / draft_vocab_size / markov_rank / the heads' switches
    # takes speculators' defaults (8, 32000, 256, true, true): here the vocab is too small
    for key in ("block_size", "draft_vocab_size", "markov_rank", "enable_confidence_head",
                "confidence_head_with_markov", "speculators_config"):
        del raw[key]
    with pytest.raises(DrafterConfigError, match="draft_vocab_size 32000 is outside"):
        parse_config(raw)
    raw["draft_vocab_size"] = 300
    c = parse_config(raw)
    assert isinstance(c, SpeculatorsConfig)
    assert (c.block_size, c.markov_rank, c.enable_confidence_head,
            c.confidence_head_with_markov) == (8, 256, True, True)
    # transformers 4 spelling: rope_theta / rope_scaling beside the layer keys
    raw = raw_config("rnn_anchor_reduced_mixed_noconf")
    layer = raw["transformer_layer_config"]
    rope = layer.pop("rope_parameters")
    layer["rope_theta"] = rope.pop("rope_theta")
    layer["rope_scaling"] = rope
    assert parse_config(raw) == parse_config(raw_config("rnn_anchor_reduced_mixed_noconf"))




@pytest.mark.parametrize(("key", "value", "message"), [
    # the dflash family serves these, and a DSpark checkpoint is not one of theirs
    ("speculators_model_type", "dflash",
     r"architectures \['DSparkDraftModel'\] is not supported \(a DFlash drafter of this format"
     r" has \['DFlashDraftModel'\]\)"),
    ("speculators_model_type", "dflash2", r"a DFlash2 drafter of this format has"
     r" \['DFlash2DraftModel'\]"),
    ("transformer_layer_config", DROP, "transformer_layer_config None is missing"),
    ("transformer_layer_config.model_type", "mistral",
     r"transformer_layer_config.model_type 'mistral' is not supported \(one of \['qwen3',"
     r" 'llama'\]\)"),
    ("transformer_layer_config.hidden_act", "gelu",
     r"transformer_layer_config.hidden_act 'gelu' is not supported \(only 'silu'\)"),
    ("transformer_layer_config.layer_types", ["full_attention", "chunked_attention"],
     r"layer_types 'chunked_attention' is not supported \(one of \['full_attention',"
     r" 'sliding_attention'\]\)"),
    ("transformer_layer_config.layer_types", ["full_attention"],
     "layer_types .* must list one type per draft layer .num_hidden_layers 2."),
    ("transformer_layer_config.layer_types", ["sliding_attention", "full_attention"],
     "transformer_layer_config.sliding_window None must be a positive integer where"),
    ("transformer_layer_config.rope_parameters", {"rope_type": "dynamic", "factor": 2.0},
     r"rope_parameters.rope_type 'dynamic' is not supported \(one of \['default', 'llama3',"
     r" 'yarn'\]\)"),
    ("transformer_layer_config.rope_parameters", {"rope_type": "llama3", "factor": 8.0},
     "rope_parameters.low_freq_factor None is missing .rope_type 'llama3' needs it."),
    ("transformer_layer_config.rope_parameters", {"rope_type": "yarn", "factor": 4.0,
                                                  "long_factor": [1.0]},
     r"rope_parameters.long_factor \[1.0\] is not supported for rope_type 'yarn'"),
    ("transformer_layer_config.rope_parameters", {"rope_type": "default",
                                                  "partial_rotary_factor": 0.5},
     r"partial_rotary_factor 0.5 is not supported \(only 1.0\)"),
    ("target_hidden_size", 128, "target_hidden_size 128 is not supported .fc takes n_taps"),
    ("projector_type", "domino", "projector_type 'domino' is not supported"),
    ("shift_label", True, "shift_label True is not supported"),
    ("speculators_config.proposal_methods", [{"speculative_tokens": 3}],
     "speculative_tokens 3 disagrees with the layout's N 4 .block_size 4, sample_from_anchor"
     " true."),
    ("markov_rank", 0, "confidence_head_with_markov true needs markov_rank > 0"),
    ("markov_head_type", "lstm", r"markov_head_type 'lstm' is not one of \['vanilla'"),
    ("draft_vocab_size", 301, r"draft_vocab_size 301 is outside \[2, transformer_layer_config"
     r".vocab_size 300\]"),
    ("aux_hidden_state_layer_ids", [5, 2], r"aux_hidden_state_layer_ids \[5, 2\] must be"
     " strictly increasing HF hidden_states indices"),
    ("aux_hidden_state_layer_ids", DROP, "aux_hidden_state_layer_ids is missing"),
    ("mask_token_id", 300, r"mask_token_id 300 is outside \[0, vocab_size 300\)"),
])
def test_config_refusals(key: str, value: Any, message: str) -> None:
    raw = raw_config()
    set_key(raw, key, value)
    with pytest.raises(DrafterConfigError, match=message):
        parse_config(raw)


def test_bonus_layout_needs_two_rows() -> None:
    raw = raw_config("gated_bonus_full_sliding")
    raw["block_size"] = 1
    del raw["speculators_config"]
    with pytest.raises(DrafterConfigError, match="block_size 1 gives N = 0 drafts per block,"
                                                 " less 1 lead row"):
        parse_config(raw)


# -- checkpoints, targets, identities, HELLO ------------------------------------------------------


def copy_checkpoint(tmp_path: Path, name: str = "vanilla_anchor_reduced") -> Path:
    out = tmp_path / name
    shutil.copytree(DATA / name, out, ignore=shutil.ignore_patterns("dspark_identity.json"))
    return out


def edit_tensors(ckpt: Path, fn: Any) -> None:
    tensors = load_file(str(ckpt / "model.safetensors"))
    fn(tensors)
    save_file(tensors, str(ckpt / "model.safetensors"))


def test_target_tensors_and_where_they_come_from(tmp_path: Path,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    ckpt = copy_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match=r"has no embed_tokens\.weight and no target"):
        load_drafter(ckpt)
    with caplog.at_level("INFO", logger="dspark_worker.checkpoint"):
        d = load_drafter(ckpt, TARGET)
    log = caplog.text
    assert "embed_tokens.weight (F32 [300, 64]): from the target checkpoint" in log
    assert "lm_head.weight (F32 [120, 64]): from the drafter checkpoint" in log
    assert "speculators drafter, N 4 (block 4), vocab 300 (drafts over 120)" in log
    assert "taps of target layers [1, 4, 7]" in log
    target = load_file(str(TARGET / "model.safetensors"))
    torch.testing.assert_close(d.model.embed_tokens.weight, target["model.embed_tokens.weight"])
    # the full-vocabulary drafter takes the target's lm_head too
    g = load_drafter(copy_checkpoint(tmp_path, "gated_bonus_full_sliding"), TARGET)
    torch.testing.assert_close(g.model.lm_head.weight, target["lm_head.weight"])


def test_a_missing_or_wrong_target_names_the_verifier(tmp_path: Path) -> None:
    """The checkpoint says which target it was trained against
    (``speculators_config.verifier.name_or_path``): the refusal of a missing or mismatched
    --target-checkpoint names it."""
    ckpt = copy_checkpoint(tmp_path)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["speculators_config"]["verifier"]["name_or_path"] = "Qwen/Qwen3-8B"
    (ckpt / "config.json").write_text(json.dumps(cfg))
    hint = r"trained against 'Qwen/Qwen3-8B' \(config.json speculators_config.verifier"
    with pytest.raises(CheckpointError, match=r"has no embed_tokens\.weight.*" + hint):
        load_drafter(ckpt)
    reference = Path(__file__).resolve().parents[3] / "dspark_worker" / "drafter" / "reference"
    with pytest.raises(CheckpointError, match=r"embed_tokens.weight has shape \[260, 128\],"
                       r" expected \[300, 64\]; this drafter was " + hint):
        load_drafter(ckpt, reference)


@pytest.mark.parametrize(("edit", "message"), [
    ("embed", r"holds embed_tokens.weight .shape \[300, 64\]., which a speculators drafter takes"
     " from its target"),
    ("no lm_head", r"missing tensor lm_head.weight .expected shape \[120, 64\].; a speculators"
     " drafter over a reduced vocabulary keeps its own, never the target's"),
    ("d2t shape", r"tensor d2t has shape \[119\], expected \[120\]"),
    ("d2t float", r"tensor d2t has dtype F32; the drafter loads \['I64'\]"),
    ("d2t order", "d2t is not increasing: draft ids 3 and 4 map to target ids"),
    ("t2d", "t2d marks 121 target ids, not the 120 that d2t maps to"),
    ("w2 rows", r"markov_head.markov_w2.weight has shape \[300, 16\], expected \[120, 16\]"),
])
def test_every_tensor_is_checked(tmp_path: Path, edit: str, message: str) -> None:
    ckpt = copy_checkpoint(tmp_path)

    def change(t: dict[str, torch.Tensor]) -> None:
        if edit == "embed":
            t["embed_tokens.weight"] = torch.zeros(300, 64)
        elif edit == "no lm_head":
            del t["lm_head.weight"]
        elif edit == "d2t shape":
            t["d2t"] = t["d2t"][:-1].clone()
        elif edit == "d2t float":
            t["d2t"] = t["d2t"].float()
        elif edit == "d2t order":
            d2t = t["d2t"].clone()
            d2t[4] = d2t[3] - 1 - (d2t[4] - d2t[3])
            t["d2t"] = d2t
        elif edit == "t2d":
            t2d = t["t2d"].clone()
            t2d[int(torch.nonzero(~t2d)[0, 0])] = True
            t["t2d"] = t2d
        else:
            t["markov_head.markov_w2.weight"] = torch.zeros(300, 16)

    edit_tensors(ckpt, change)
    with pytest.raises(CheckpointError, match=message):
        load_drafter(ckpt, TARGET)


def test_attention_biases_are_required_and_read(tmp_path: Path) -> None:
    """attention_bias true: the four biases of every layer are part of the layout and of
    the drafts."""
    ckpt = copy_checkpoint(tmp_path)
    raw = json.loads((ckpt / "config.json").read_text())
    raw["transformer_layer_config"]["attention_bias"] = True
    (ckpt / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=r"missing tensor layers.0.self_attn.q_proj.bias"):
        load_drafter(ckpt, TARGET)
    rng = np.random.default_rng(3)

    def add(t: dict[str, torch.Tensor]) -> None:
        for i in range(2):
            for name, n in (("q", 64), ("k", 32), ("v", 32), ("o", 64)):
                t[f"layers.{i}.self_attn.{name}_proj.bias"] = torch.from_numpy(
                    rng.standard_normal(n).astype(np.float32) * 0.5)

    edit_tensors(ckpt, add)
    d = load_drafter(ckpt, TARGET)
    values = bf16_taps(rng, 9, d.config.tap_width)
    ids, conf, margin = oracle(d, values, 9, 4)
    pool = d.new_pool(1, 16)
    lane = pool.allocate(1)
    pool.apply(lane, [9], [9], [True], encode_bf16_rows(values))
    got = d.draft(pool, lane, [9], [4])
    assert got.draft_ids[0].tolist() == ids
    np.testing.assert_allclose(got.margin[0], margin, atol=MARGIN_TOL, rtol=0)
    np.testing.assert_allclose(got.confidence[0], conf, atol=CONF_TOL, rtol=0)


def test_hello_from_a_speculators_checkpoint(drafters: dict[str, Drafter]) -> None:
    for name, d in drafters.items():
        h = hello_from_checkpoint(DATA / name, window=32, max_slots=4, target_checkpoint=TARGET)
        assert (h.num_spec, h.vocab_size, h.n_taps, h.hidden, h.row_bytes) == (
            d.num_spec, d.vocab_size, d.n_taps, d.target_hidden, d.row_bytes)
        assert (h.drafter_identity, h.markov_identity) == (d.drafter_identity,
                                                          d.markov_identity)
        assert (h.drafter_identity, h.markov_identity) == identities_from_checkpoint(
            DATA / name, TARGET, use_identity_file=False)
        assert tap_layers(DATA / name) == d.config.target_layer_ids
    assert tap_layers(DATA / "vanilla_anchor_reduced") == (1, 4, 7)  # aux ids 2, 5, 8
    with pytest.raises(ValueError, match=r"has no embed_tokens\.weight and no target"):
        hello_from_checkpoint(DATA / "vanilla_anchor_reduced", window=32, max_slots=4)


def test_hello_reads_a_dflash_config_with_its_defaults(tmp_path: Path) -> None:
    """speculators_model_type dflash: sample_from_anchor defaults to false there (N = B - 1),
    where DSpark's default is true (N = B)."""
    ckpt = copy_checkpoint(tmp_path)
    raw = copy.deepcopy(raw_config())
    del raw["sample_from_anchor"], raw["speculators_config"]
    (ckpt / "config.json").write_text(json.dumps(raw))
    dspark = hello_from_checkpoint(ckpt, window=32, max_slots=4, target_checkpoint=TARGET)
    raw["speculators_model_type"] = "dflash"
    (ckpt / "config.json").write_text(json.dumps(raw))
    dflash = hello_from_checkpoint(ckpt, window=32, max_slots=4, target_checkpoint=TARGET)
    assert (dspark.num_spec, dflash.num_spec) == (raw["block_size"], raw["block_size"] - 1)


# -- CUDA (skipped without a GPU) -----------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_fp32_vectors_bf16_tolerance_and_sampled(cases: list[dict[str, Any]],
                                                      taps: dict[str, np.ndarray]) -> None:
    """fp32 on CUDA drafts speculators' vectors (every checkpoint: reduced vocabulary, bonus
    layout, sliding layers, llama3 and yarn RoPE, biases); bf16 (the CUDA default) keeps the
    first draft and its confidence within bf16's tolerance; sampled replies pass 9.2 and 9.3 on
    target ids."""
    for name in NAMES + EXTRA:
        mine = [c for c in cases if c["checkpoint"] == name]
        rows = np.concatenate([taps[c["taps_key"]] for c in mine])
        anchors = [c["anchor_pos"] for c in mine]
        for dtype in (torch.float32, torch.bfloat16):
            gpu = load_drafter(DATA / name, TARGET, device="cuda", dtype=dtype)
            pool = gpu.new_pool(4, 64)
            lanes = pool.allocate(4)
            pool.apply(lanes, anchors, [c["n_rows"] for c in mine], [True] * 4, rows)
            got = gpu.draft(pool, lanes, anchors, [c["anchor_token"] for c in mine])
            for i, c in enumerate(mine):
                if dtype == torch.float32:
                    assert got.draft_ids[i].tolist() == c["ids"]
                    np.testing.assert_allclose(got.confidence[i], c["confidence"], atol=CONF_TOL)
                    np.testing.assert_allclose(got.margin[i], c["margin"], atol=MARGIN_TOL)
                elif c["margin"][0] > 0.1:  # bf16 may flip a near tie
                    assert got.draft_ids[i, 0] == c["ids"][0]
                    assert abs(float(got.confidence[i, 0]) - c["confidence"][0]) < 0.05
            sp = SamplingParams(top_k=[32, 4, 0, 9], temperature=[1.0, 0.8, 1.0, 1.5],
                                top_p=[0.0, 0.9, 0.0, 0.6], seed=[1, 2, 3, 4],
                                generation=[0, 5, 0, 1])
            out = gpu.draft(pool, lanes, anchors, [3, 4, 5, 6], sampling=sp)
            check_sampled(out, sp, anchors, gpu.vocab_size)


def test_other_speculators_formats_are_refused_by_name() -> None:
    raw = raw_config()
    raw["speculators_model_type"] = "eagle3"
    with pytest.raises(DrafterConfigError, match=r"'eagle3' is not supported \(not a DSpark"
                       r" drafter; the worker serves \['dspark'\]\)"):
        parse_config(raw)


# -- the bucketed static step (what a CUDA graph captures; the CPU stand-in replay here) --------


def in_target_vocabulary(d: Drafter, ids: np.ndarray) -> bool:
    """Every id is a target id the draft vocabulary maps to (all of them on a full one)."""
    image = d.model.target_ids(torch.arange(d.config.draft_vocab)).numpy()
    return bool(np.isin(ids, image).all())


@pytest.mark.parametrize("name", NAMES + EXTRA)
def test_static_step_serves_the_vectors(drafters: dict[str, Drafter],
                                        cases: list[dict[str, Any]],
                                        taps: dict[str, np.ndarray], name: str) -> None:
    """Every checkpoint (reduced vocabularies, the bonus layout's lead row and rnn step,
    sliding and causal layers, biases, yarn, no Markov head): speculators' drafts through the
    static step, a full bucket (bit for bit the eager step) and one with a padded lane; then
    sampled lanes, their supports in target ids."""
    d = drafters[name]
    mine = [c for c in cases if c["checkpoint"] == name]
    pool = d.new_pool(6, 20)
    s = with_static_step(d, pool)  # before any lane holds a window: the self-check writes
    lanes = pool.allocate(6)[[5, 0, 3, 2]]
    for c, lane in zip(mine, lanes, strict=True):
        pool.apply([lane], [c["anchor_pos"]], [c["n_rows"]], [True], taps[c["taps_key"]])
    anchors = [c["anchor_pos"] for c in mine]
    tokens = [c["anchor_token"] for c in mine]
    for b in (4, 3):
        got, want = static_and_eager(s, pool, lanes[:b], anchors[:b], tokens[:b])
        assert_same(got, want, exact=b == 4)
        for i, c in enumerate(mine[:b]):
            assert got.draft_ids[i].tolist() == c["ids"], (c["case"], b)
            np.testing.assert_allclose(got.confidence[i], c["confidence"], atol=CONF_TOL, rtol=0)
            np.testing.assert_allclose(got.margin[i], c["margin"], atol=MARGIN_TOL, rtol=0)
    for b in (4, 3):
        sp = params(b, 11 + b)
        got, want = static_and_eager(s, pool, lanes[:b], anchors[:b], tokens[:b], sampling=sp)
        assert_same(got, want, exact=b == 4)
        check_sampled(got, sp, anchors[:b], d.vocab_size)
        assert got.support_ids is not None and got.proposal_q is not None
        assert in_target_vocabulary(d, got.support_ids[got.proposal_q > 0])
        assert in_target_vocabulary(d, got.draft_ids)


@pytest.mark.parametrize("name", NAMES + EXTRA)
def test_static_step_over_wrapping_windows_and_sliding_layers(drafters: dict[str, Drafter],
                                                              name: str) -> None:
    """Five lanes (a bucket of 8: three padded lanes) of lengths under, at and over the sliding
    window and the ring, the rings wrapped several times, in a 12-slot ring and in a 4-slot one
    that holds fewer rows than any sliding window: the static step equals the reference on the
    rows each ring holds."""
    d = drafters[name]
    rng = np.random.default_rng(8)
    for window in (12, 4):
        pool = d.new_pool(8, window)
        s = with_static_step(d, pool)
        lanes = pool.allocate(8)[[6, 1, 3, 0, 5]]
        counts = [3, 12, 30, 1, 6]
        anchors = [c + 40 * i for i, c in enumerate(counts)]
        rows = [encode_bf16_rows(bf16_taps(rng, n, d.config.tap_width)) for n in counts]
        for chunk in range(3):  # in chunks, so the ring's end is crossed by a write
            part = [r[len(r) * chunk // 3:len(r) * (chunk + 1) // 3] for r in rows]
            ends = [a - len(r) + len(r) * (chunk + 1) // 3 for a, r in zip(anchors, rows,
                                                                            strict=True)]
            pool.apply(lanes, ends, [len(p) for p in part], [chunk == 0] * 5,
                       np.concatenate(part))
        tokens = rng.integers(0, d.vocab_size, 5)
        for sp in (None, params(5, window)):
            got, want = static_and_eager(s, pool, lanes, anchors, tokens, sampling=sp)
            assert_same(got, want, exact=False)
            ref = d.reference_draft([r[-window:] for r in rows], anchors, tokens, sampling=sp)
            np.testing.assert_array_equal(got.draft_ids, ref.draft_ids)
            np.testing.assert_allclose(got.confidence, ref.confidence, atol=CONF_TOL, rtol=0)
            np.testing.assert_allclose(got.margin, ref.margin, atol=MARGIN_TOL, rtol=0)
            assert got.window_rows.tolist() == [min(n, window) for n in counts]


@pytest.mark.parametrize("name", ["vanilla_anchor_reduced", "rnn_bonus_reduced_causal"])
def test_candidate_walk_over_the_draft_vocabulary(drafters: dict[str, Drafter],
                                                  name: str) -> None:
    """dspark_draft_topk over a reduced vocabulary: k candidates of the draft vocabulary's
    base logits; static, eager and the reference draft the same target ids, greedy and
    sampled; k = the draft vocabulary drafts what the full walk drafts; k past it is refused
    naming the draft vocabulary."""
    d = drafters[name]
    vd = d.config.draft_vocab
    assert vd < d.vocab_size
    rng = np.random.default_rng(3)
    pool = d.new_pool(5, 16)
    s = with_static_step(d, pool, draft_topk=40)
    lanes = pool.allocate(5)
    counts = [2, 9, 16, 20, 5]
    rows = [encode_bf16_rows(bf16_taps(rng, n, d.config.tap_width)) for n in counts]
    pool.apply(lanes, counts, counts, [True] * 5, np.concatenate(rows))
    tokens = rng.integers(0, d.vocab_size, 5)
    for sp in (None, params(5, 2)):
        got, want = static_and_eager(s, pool, lanes, counts, tokens, sampling=sp)
        assert_same(got, want, exact=False)
        ref = s.reference_draft([r[-16:] for r in rows], counts, tokens, sampling=sp)
        assert_same(want, ref, exact=False)
        assert in_target_vocabulary(d, got.draft_ids)
    whole = d.with_draft_topk(vd)
    np.testing.assert_array_equal(whole.draft(pool, lanes, counts, tokens).draft_ids,
                                  d.draft(pool, lanes, counts, tokens).draft_ids)
    with pytest.raises(DrafterConfigError, match=rf"\[32, draft_vocab_size {vd}\]"):
        d.with_draft_topk(vd + 1)


@pytest.mark.parametrize("name", ["gated_bonus_full_sliding", "rnn_bonus_reduced_causal",
                                  "rnn_anchor_reduced_mixed_noconf"])
def test_static_step_has_no_host_sync(drafters: dict[str, Drafter], name: str,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The lead row, the d2t map, the sliding layers' newest rows and causal block: nothing in
    the step reads a tensor's value on the host, greedy, sampled and the candidate walk."""
    d = drafters[name]
    pool = d.new_pool(4, 8)
    steps = [StaticStep(d.model, pool, 4, d.num_spec, s, k) for s in (False, True)
             for k in (0, 40)]
    refuse_host_reads(monkeypatch)
    with torch.inference_mode():
        for step in steps:
            out = step.compute()
            assert out["draft_ids"].shape == (4, d.num_spec)
