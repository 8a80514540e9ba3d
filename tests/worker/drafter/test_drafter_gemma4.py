"""The Gemma4 family: DeepSpec's own drafts on the tiny vectors, an independent plain
implementation for longer contexts, windows that wrap, batches of lanes, sampled mode (9.2,
9.3), bf16 on the CPU, config.json parsing and refusals, checkpoints with a multimodal target
and the engine's HELLO.

``data/gemma4_tiny`` is a tiny checkpoint saved by DeepSpec's own classes
(``Gemma4DSparkModel.save_pretrained``) with two cases whose ids, confidences and margins came
from DeepSpec's own greedy path in fp32."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from drafter_support import bf16_taps, check_bf16_many_lanes, check_sampled
from safetensors.torch import load_file, save_file

from dspark_client import hello_from_checkpoint
from dspark_worker.drafter import (
    CheckpointError,
    Drafter,
    DrafterConfig,
    DrafterConfigError,
    Gemma4Config,
    Gemma4DrafterModel,
    RingPool,
    SamplingParams,
    build_model,
    detect_family,
    encode_bf16_rows,
    expected_shapes,
    from_tensors,
    load_drafter,
    parse_config,
    random_tensors,
    save_checkpoint,
)
from protocol.identity import identities_from_checkpoint

DATA = Path(__file__).resolve().parent / "data" / "gemma4_tiny"
REFERENCE = Path(__file__).resolve().parents[3] / "dspark_worker" / "drafter" / "reference"
TOL = 1e-4  # confidence and margin against DeepSpec's fp32 path


@pytest.fixture(scope="module")
def g4() -> Drafter:
    return load_drafter(DATA)


@pytest.fixture(scope="module")
def cases() -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = json.loads((DATA / "cases.json").read_text())
    return out


@pytest.fixture(scope="module")
def weights() -> dict[str, torch.Tensor]:
    return load_file(str(DATA / "model.safetensors"))


def raw_config() -> dict[str, Any]:
    out: dict[str, Any] = json.loads((DATA / "config.json").read_text())
    return out


# -- an independent plain implementation (the published op-by-op description, fp32) -----------


def _rms(x: torch.Tensor, w: torch.Tensor | None, eps: float = 1e-6) -> torch.Tensor:
    y = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)
    return y if w is None else y * w


def _rope(x: torch.Tensor, pos: torch.Tensor, hd: int, pairs: int, theta: float) -> torch.Tensor:
    """Rotate dims (j, j + hd/2) for j < pairs by pos * theta^(-2j/hd); others unchanged."""
    j = torch.arange(pairs, dtype=torch.float64)
    ang = pos.double()[:, None] * theta ** (-2.0 * j / hd)  # [T, pairs]
    cos, sin = ang.cos().float(), ang.sin().float()
    out = x.clone()
    half = hd // 2
    a, b = x[..., :pairs], x[..., half:half + pairs]  # [T, heads, pairs]
    out[..., :pairs] = a * cos[:, None] - b * sin[:, None]
    out[..., half:half + pairs] = b * cos[:, None] + a * sin[:, None]
    return out


def plain_draft(t: dict[str, torch.Tensor], cfg: Gemma4Config, taps: np.ndarray, anchor_pos: int,
                token: int) -> tuple[list[int], np.ndarray, np.ndarray]:
    """One lane, every context row projected from scratch at its absolute position."""
    d, nh, hd, hk, n = (cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim,
                        cfg.num_key_value_heads, cfg.block_size)
    pairs, theta, cap = cfg.rotary_pairs, cfg.rope_theta, cfg.final_logit_softcapping
    ln = taps.shape[0]
    ctx = _rms(torch.from_numpy(taps).float() @ t["fc.weight"].T, t["hidden_norm.weight"])
    ids = torch.tensor([token] + [cfg.mask_token_id] * (n - 1))
    h = t["embed_tokens.weight"][ids] * math.sqrt(d)
    ctx_pos = torch.arange(anchor_pos - ln, anchor_pos)
    blk_pos = torch.arange(anchor_pos, anchor_pos + n)
    all_pos = torch.cat([ctx_pos, blk_pos])
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        x = _rms(h, t[p + "input_layernorm.weight"])
        q = _rms((x @ t[p + "self_attn.q_proj.weight"].T).view(n, nh, hd),
                 t[p + "self_attn.q_norm.weight"])
        q = _rope(q, blk_pos, hd, pairs, theta)
        kraw = (torch.cat([ctx, x]) @ t[p + "self_attn.k_proj.weight"].T).view(ln + n, hk, hd)
        k = _rope(_rms(kraw, t[p + "self_attn.k_norm.weight"]), all_pos, hd, pairs, theta)
        v = _rms(kraw, None)
        group = nh // hk
        k_h = k.repeat_interleave(group, dim=1)  # [T, nh, hd]
        v_h = v.repeat_interleave(group, dim=1)
        att = torch.softmax(torch.einsum("qhd,khd->hqk", q, k_h), dim=-1)  # scale 1.0
        o = torch.einsum("hqk,khd->qhd", att, v_h).reshape(n, nh * hd)
        h = h + _rms(o @ t[p + "self_attn.o_proj.weight"].T,
                     t[p + "post_attention_layernorm.weight"])
        y = _rms(h, t[p + "pre_feedforward_layernorm.weight"])
        y = (F.gelu(y @ t[p + "mlp.gate_proj.weight"].T, approximate="tanh")
             * (y @ t[p + "mlp.up_proj.weight"].T)) @ t[p + "mlp.down_proj.weight"].T
        h = (h + _rms(y, t[p + "post_feedforward_layernorm.weight"])) * t[p + "layer_scalar"]
    hf = _rms(h, t["norm.weight"])
    u = hf @ t["lm_head.weight"].T
    if cap is not None:
        u = torch.tanh(u / cap) * cap
    prev, out, confs, margins = token, [], [], []
    w1, w2 = t["markov_head.markov_w1.weight"], t["markov_head.markov_w2.weight"]
    for j in range(n):
        e = w1[prev]
        z = u[j] + w2 @ e
        top = torch.topk(z, 2).values
        tok = int(torch.argmax(z))
        feats = torch.cat([hf[j], e])
        logit = feats @ t["confidence_head.proj.weight"][0] + t["confidence_head.proj.bias"][0]
        confs.append(float(torch.sigmoid(logit)))
        margins.append(float(top[0] - top[1]))
        out.append(tok)
        prev = tok
    return out, np.array(confs, np.float32), np.array(margins, np.float32)


# -- DeepSpec's own drafts --------------------------------------------------------------------


def test_family_and_geometry(g4: Drafter) -> None:
    assert isinstance(g4.config, Gemma4Config) and isinstance(g4.model, Gemma4DrafterModel)
    c = g4.config
    assert (c.head_dim, c.num_key_value_heads, c.rotary_pairs) == (32, 1, 4)
    assert (c.rope_theta, c.final_logit_softcapping, c.mask_token_id) == (1e6, 30.0, 4)
    assert (g4.num_spec, g4.n_taps, g4.target_hidden, g4.row_bytes) == (4, 3, 64, 384)
    # the saved layer_scalar values are applied (0.875 and 1.125 in this checkpoint)
    scalars = [float(layer.layer_scalar) for layer in g4.model.decoder_layers]
    assert scalars == [0.875, 1.125]


@pytest.mark.parametrize("window", [9, 16, 64])
def test_vectors_from_the_rings(g4: Drafter, cases: list[dict[str, Any]], window: int) -> None:
    """Both cases in one batch of lanes, rows fed in two chunks; W = L exactly, and larger."""
    pool = g4.new_pool(3, window)
    lanes = pool.allocate(2)
    taps = [np.asarray(c["taps"], np.float32) for c in cases]
    anchors = [c["anchor_pos"] for c in cases]
    for lo, hi in ((0, 5), (5, 9)):
        rows = np.concatenate([encode_bf16_rows(t[lo:hi]) for t in taps])
        pool.apply(lanes, [a - 9 + hi for a in anchors], [hi - lo] * 2, [lo == 0] * 2, rows)
    out = g4.draft(pool, lanes, anchors, [c["anchor_token"] for c in cases])
    for i, c in enumerate(cases):
        assert out.window_rows[i] == 9
        assert out.draft_ids[i].tolist() == c["ids"]
        np.testing.assert_allclose(out.confidence[i], c["confidence"], atol=TOL, rtol=0)
        np.testing.assert_allclose(out.margin[i], c["margin"], atol=TOL, rtol=0)


def test_vectors_from_the_reference_and_the_plain_oracle(
        g4: Drafter, cases: list[dict[str, Any]], weights: dict[str, torch.Tensor]) -> None:
    assert isinstance(g4.config, Gemma4Config)
    for c in cases:
        taps = np.asarray(c["taps"], np.float32)
        ref = g4.reference_draft([encode_bf16_rows(taps)], [c["anchor_pos"]], [c["anchor_token"]])
        assert ref.draft_ids[0].tolist() == c["ids"]
        np.testing.assert_allclose(ref.margin[0], c["margin"], atol=TOL, rtol=0)
        ids, conf, margin = plain_draft(weights, g4.config, taps, c["anchor_pos"],
                                        c["anchor_token"])
        assert ids == c["ids"]
        np.testing.assert_allclose(conf, c["confidence"], atol=TOL, rtol=0)
        np.testing.assert_allclose(margin, c["margin"], atol=TOL, rtol=0)


def test_each_published_difference_changes_the_drafts(g4: Drafter,
                                                      cases: list[dict[str, Any]]) -> None:
    """The vectors see the softcap and the partial RoPE: without them the drafts move."""
    c = cases[1]
    rows = encode_bf16_rows(np.asarray(c["taps"], np.float32))
    for change in ({"final_logit_softcapping": None}, {"partial_rotary_factor": 1.0}):
        config = dataclasses.replace(g4.config, **change)
        tensors = load_file(str(DATA / "model.safetensors"))
        other = from_tensors(config, tensors, dtype=torch.float32)
        got = other.reference_draft([rows], [c["anchor_pos"]], [c["anchor_token"]])
        assert (got.draft_ids[0].tolist() != c["ids"]
                or np.abs(got.margin[0] - c["margin"]).max() > 1e-2), change


# -- longer contexts, windows, batches ----------------------------------------------------------


def test_long_context_and_a_wrapping_window(g4: Drafter, weights: dict[str, torch.Tensor]
                                            ) -> None:
    """300 rows fed in uneven chunks: a 512-slot ring holds them all, a 16-slot ring wraps many
    times; both equal the plain oracle on the rows each holds, at their absolute positions."""
    assert isinstance(g4.config, Gemma4Config)
    rng = np.random.default_rng(5)
    total = 300
    taps = bf16_taps(rng, total, g4.config.tap_width)
    wire_rows = encode_bf16_rows(taps)
    for window in (512, 16):
        pool = g4.new_pool(1, window)
        lane = pool.allocate(1)
        at = 0
        while at < total:
            n = min(int(rng.integers(1, 40)), total - at)
            pool.apply(lane, [at + n], [n], [at == 0], wire_rows[at:at + n])
            at += n
        token = 123
        got = g4.draft(pool, lane, [total], [token])
        held = min(window, total)
        assert got.window_rows[0] == held
        ids, conf, margin = plain_draft(weights, g4.config, taps[total - held:], total, token)
        assert got.draft_ids[0].tolist() == ids
        np.testing.assert_allclose(got.confidence[0], conf, atol=TOL, rtol=0)
        np.testing.assert_allclose(got.margin[0], margin, atol=TOL, rtol=0)


def test_several_slots_in_one_batch_equal_each_alone(g4: Drafter) -> None:
    """Five lanes of different lengths, windows and anchors drafted together (a gather over
    non-contiguous lanes) equal the from-scratch reference lane by lane."""
    rng = np.random.default_rng(6)
    window = 12
    pool = g4.new_pool(8, window)
    lanes = pool.allocate(8)[[6, 1, 3, 0, 5]]
    counts = [3, 12, 30, 1, 17]
    rows = [encode_bf16_rows(bf16_taps(rng, n, g4.config.tap_width)) for n in counts]
    pool.apply(lanes, counts, counts, [True] * 5, np.concatenate(rows))
    tokens = rng.integers(0, g4.vocab_size, 5)
    got = g4.draft(pool, lanes, counts, tokens)
    ref = g4.reference_draft([r[-window:] for r in rows], counts, tokens)
    np.testing.assert_array_equal(got.draft_ids, ref.draft_ids)
    np.testing.assert_allclose(got.confidence, ref.confidence, atol=TOL, rtol=0)
    np.testing.assert_allclose(got.margin, ref.margin, atol=TOL, rtol=0)
    assert got.window_rows.tolist() == [min(n, window) for n in counts]


def test_fused_projection_equals_the_layer_loop(g4: Drafter) -> None:
    assert isinstance(g4.model, Gemma4DrafterModel)
    rng = np.random.default_rng(7)
    taps = torch.from_numpy(bf16_taps(rng, 11, g4.config.tap_width))
    pos = torch.arange(100, 111)
    with torch.inference_mode():
        k, v = g4.model.project_context(taps, pos)
        kv = g4.model.project_context_kv(taps, pos)
    torch.testing.assert_close(kv[0], k, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kv[1], v, atol=1e-5, rtol=1e-5)
    # V has no RoPE: the same row at another position has the same V and another K
    with torch.inference_mode():
        moved = g4.model.project_context_kv(taps, pos + 1000)
    torch.testing.assert_close(moved[1], kv[1])
    assert not torch.allclose(moved[0], kv[0])


# -- sampled mode -----------------------------------------------------------------------------


def test_sampled_drafts_satisfy_the_contract(g4: Drafter) -> None:
    """q from the soft-capped, Markov-corrected logits: 9.2's rules and 9.3's draws hold, and
    q equals the host build on the same logits (the reference) to rounding."""
    rng = np.random.default_rng(8)
    counts = [9, 20, 4]
    rows = [encode_bf16_rows(bf16_taps(rng, n, g4.config.tap_width)) for n in counts]
    pool = g4.new_pool(3, 16)
    lanes = pool.allocate(3)
    pool.apply(lanes, counts, counts, [True] * 3, np.concatenate(rows))
    params = SamplingParams(top_k=[32, 4, 0], temperature=[1.0, 0.7, 1.0], top_p=[0.0, 0.9, 0.0],
                            seed=[11, 12, 13], generation=[0, 3, 0])
    tokens = [5, 6, 7]
    out = g4.draft(pool, lanes, counts, tokens, sampling=params, keep_logits=True)
    assert out.support_ids is not None and out.proposal_q is not None and out.logits is not None
    check_sampled(out, params, counts, g4.vocab_size)
    # corrected logits are bounded by the softcap plus the Markov bias: q sees the cap
    assert np.abs(out.logits).max() < 30.0 + 50.0
    ref = g4.reference_draft([r[-16:] for r in rows], counts, tokens, sampling=params)
    assert ref.support_ids is not None and ref.proposal_q is not None
    np.testing.assert_array_equal(out.draft_ids, ref.draft_ids)
    np.testing.assert_array_equal(out.support_ids, ref.support_ids)
    diff = np.abs(out.proposal_q.astype(np.int64) - ref.proposal_q.astype(np.int64))
    assert int(diff.max()) <= 256
    # the greedy lane of a sampled batch drafts the argmax
    greedy = g4.draft(pool, lanes[2:], counts[2:], tokens[2:])
    np.testing.assert_array_equal(out.draft_ids[2], greedy.draft_ids[0])


# -- bf16 on the CPU ----------------------------------------------------------------------------


def test_bf16_on_the_cpu_close_to_fp32(cases: list[dict[str, Any]]) -> None:
    """bf16 weights and activations (what a GPU runs) against DeepSpec's fp32 drafts and the
    fp32 drafter: bf16 moves logits by about 1e-2, so a near tie may flip and the walk then
    parts; hold the first position of many lanes to a rate and confidences to a tolerance."""
    bf = load_drafter(DATA, dtype=torch.bfloat16)
    fp = load_drafter(DATA)
    assert bf.dtype == torch.bfloat16 and bf.drafter_identity == fp.drafter_identity
    assert float(bf.model.embed_scale) == 8.0  # type: ignore[arg-type]
    for c in cases:
        rows = encode_bf16_rows(np.asarray(c["taps"], np.float32))
        pool = bf.new_pool(1, 16)
        lane = pool.allocate(1)
        pool.apply(lane, [c["anchor_pos"]], [9], [True], rows)
        got = bf.draft(pool, lane, [c["anchor_pos"]], [c["anchor_token"]])
        assert got.draft_ids[0, 0] == c["ids"][0]
        assert abs(float(got.confidence[0, 0]) - c["confidence"][0]) < 0.05
        assert abs(float(got.margin[0, 0]) - c["margin"][0]) < 0.25
    check_bf16_many_lanes(fp, bf)


# -- config.json --------------------------------------------------------------------------------


def config_12b() -> dict[str, Any]:
    """The released 12B drafter's config.json layout (values from its training config)."""
    raw = raw_config()
    raw.update(hidden_size=3840, num_hidden_layers=5, num_target_layers=48,
               num_attention_heads=16, global_head_dim=512, head_dim=256,
               num_global_key_value_heads=1, num_key_value_heads=8, intermediate_size=15360,
               vocab_size=262144, layer_types=["full_attention"] * 5,
               target_layer_ids=[5, 17, 29, 41, 46], block_size=7, markov_rank=256)
    return raw


def test_the_12b_config() -> None:
    c = parse_config(config_12b())
    assert isinstance(c, Gemma4Config)
    assert (c.head_dim, c.num_key_value_heads, c.num_kv_groups, c.rotary_pairs) == (512, 1, 16, 64)
    assert (c.n_taps, c.row_bytes, c.confidence_input_dim) == (5, 5 * 3840 * 2, 4096)
    shapes = expected_shapes(c)
    assert len(shapes) == 74  # 9 global, 13 per layer x 5
    assert shapes["layers.0.self_attn.k_proj.weight"] == (512, 3840)
    assert shapes["fc.weight"] == (3840, 19200)
    assert "layers.0.self_attn.v_proj.weight" not in shapes


def test_the_benchmark_shape_is_the_released_layout() -> None:
    """bench_drafter's gemma4-12b shape is what the 12B config.json parses to, and its rings
    hold 10,240 bytes per position in bf16 (built on the meta device: no memory)."""
    spec = importlib.util.spec_from_file_location(
        "bench_drafter", Path(__file__).resolve().parents[3] / "bench" / "bench_drafter.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    shape = bench.SHAPES["gemma4-12b"][0]
    assert shape == parse_config(config_12b())
    model = build_model(shape, None, device="meta", dtype=torch.bfloat16)
    assert RingPool(model, 1, 64).bytes_per_lane == 64 * 10240


def test_config_round_trip_and_family_detection() -> None:
    c = parse_config(raw_config())
    assert isinstance(c, Gemma4Config)
    assert parse_config(c.to_json_dict()) == c
    assert detect_family(raw_config()).name == "gemma4"
    qwen = json.loads((REFERENCE / "config.json").read_text())
    assert detect_family(qwen).name == "qwen3"
    assert type(parse_config(qwen)) is DrafterConfig
    del qwen["model_type"], qwen["architectures"]
    assert type(parse_config(qwen)) is DrafterConfig  # no model_type: the Qwen3 layout
    # a flat rope_parameters (no per-layer-type entries) is read as the full-attention entry
    flat = raw_config()
    flat["rope_parameters"] = flat["rope_parameters"]["full_attention"]
    assert parse_config(flat) == c


@pytest.mark.parametrize(("change", "message"), [
    ({"enable_moe_block": True}, "enable_moe_block True is not supported .the MoE block"),
    ({"hidden_size_per_layer_input": 256}, "hidden_size_per_layer_input 256 is not supported"),
    ({"num_kv_shared_layers": 2}, "num_kv_shared_layers 2 is not supported"),
    ({"use_double_wide_mlp": True}, "use_double_wide_mlp True is not supported"),
    ({"attention_k_eq_v": False}, "attention_k_eq_v False is not supported"),
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping 50.0 is not supported"),
    ({"hidden_activation": "gelu"}, "hidden_activation 'gelu' is not supported"),
    ({"layer_types": ["full_attention", "sliding_attention"]},
     r"layer_types\[1\] 'sliding_attention' is not supported"),
    ({"layer_types": ["full_attention"]}, "one type per draft layer .num_hidden_layers 2"),
    ({"rope_parameters": {"full_attention": {"rope_type": "yarn", "rope_theta": 1e6}}},
     "rope_parameters.full_attention.rope_type 'yarn' is not supported"),
    ({"rope_parameters": {"full_attention": {"rope_type": "proportional",
                                             "partial_rotary_factor": 0.25}}},
     "rope_parameters.full_attention.rope_theta None is not a number"),
    ({"rope_parameters": {"full_attention": {"rope_type": "proportional", "rope_theta": 1e6,
                                             "partial_rotary_factor": 1.5}}},
     r"partial_rotary_factor 1.5 is outside \(0, 1\]"),
    ({"final_logit_softcapping": -1.0}, r"final_logit_softcapping -1.0 must be a number in \(0,"),
    ({"num_global_key_value_heads": 3}, "num_global_key_value_heads 3 does not divide"),
    ({"global_head_dim": 31}, "global_head_dim 31 must be even"),
    ({"model_type": "gemma3_text", "architectures": ["Gemma3DSparkModel"]},
     "model_type 'gemma3_text' .* is not a drafter family"),
])
def test_config_refusals(change: dict[str, Any], message: str) -> None:
    raw = raw_config()
    raw.update(change)
    with pytest.raises(DrafterConfigError, match=message):
        parse_config(raw)


# -- checkpoints, targets, identities, HELLO -----------------------------------------------------


def copy_checkpoint(tmp_path: Path, name: str = "ckpt") -> Path:
    out = tmp_path / name
    shutil.copytree(DATA, out)
    (out / "cases.json").unlink()
    return out


def test_save_and_reload_keep_identities_and_drafts(tmp_path: Path, g4: Drafter,
                                                    cases: list[dict[str, Any]]) -> None:
    save_checkpoint(g4.model, tmp_path / "again")
    again = load_drafter(tmp_path / "again")
    assert isinstance(again.config, Gemma4Config) and again.config == g4.config
    # the same tensors; the config.json written is the parsed config's, not the shipped file
    # (whose keys the parser does not read enter the identity too), so the drafter identity
    # is the written file's, and saving that drafter again keeps it
    assert again.markov_identity == g4.markov_identity
    assert again.drafter_identity == identities_from_checkpoint(tmp_path / "again")[0]
    save_checkpoint(again.model, tmp_path / "twice")
    assert load_drafter(tmp_path / "twice").drafter_identity == again.drafter_identity
    c = cases[0]
    got = again.reference_draft([encode_bf16_rows(np.asarray(c["taps"], np.float32))],
                                [c["anchor_pos"]], [c["anchor_token"]])
    assert got.draft_ids[0].tolist() == c["ids"]


@pytest.mark.parametrize(("edit", "message"), [
    ("drop layers.1.layer_scalar", "missing tensor layers.1.layer_scalar .expected shape .1.."),
    ("reshape layers.0.self_attn.k_proj.weight",
     r"tensor layers.0.self_attn.k_proj.weight has shape \[64, 64\], expected \[32, 64\]"),
    ("add layers.0.self_attn.v_proj.weight", "unexpected tensor layers.0.self_attn.v_proj.weight"),
    ("reshape layers.0.post_feedforward_layernorm.weight",
     r"layers.0.post_feedforward_layernorm.weight has shape \[32\], expected \[64\]"),
])
def test_every_tensor_is_checked(tmp_path: Path, edit: str, message: str) -> None:
    ckpt = copy_checkpoint(tmp_path)
    tensors = load_file(str(ckpt / "model.safetensors"))
    verb, name = edit.split()
    if verb == "drop":
        del tensors[name]
    elif verb == "add":
        tensors[name] = torch.zeros(32, 64)
    else:
        shape = tensors[name].shape
        tensors[name] = torch.zeros((shape[0] * 2, *shape[1:]) if len(shape) == 2
                                    else (shape[0] // 2,))
    save_file(tensors, str(ckpt / "model.safetensors"))
    with pytest.raises(CheckpointError, match=message):
        load_drafter(ckpt)


def test_embedding_from_a_multimodal_target(tmp_path: Path, weights: dict[str, torch.Tensor]
                                            ) -> None:
    """A Gemma-4 target ties its embedding and, as a multimodal model, nests its text weights
    (``model.language_model.embed_tokens.weight``): the drafter takes both embed_tokens and
    lm_head from it, and the engine's HELLO names the same identities."""
    ckpt = copy_checkpoint(tmp_path)
    tensors = dict(weights)
    embed = tensors.pop("embed_tokens.weight")
    del tensors["lm_head.weight"]
    save_file(tensors, str(ckpt / "model.safetensors"))
    target = tmp_path / "target"
    target.mkdir()
    save_file({"model.language_model.embed_tokens.weight": embed,
               "model.vision_tower.patch_embedder.weight": torch.zeros(4, 4),
               "model.language_model.norm.weight": torch.ones(64)},
              str(target / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"has no embed_tokens\.weight and no target"):
        load_drafter(ckpt)
    wrong = tmp_path / "not-a-target"
    wrong.mkdir()
    save_file({"vision.embed.weight": embed}, str(wrong / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"and the target checkpoint .*not-a-target"
                       r" has none of \['model\.embed_tokens\.weight'"):
        load_drafter(ckpt, target_checkpoint=wrong)
    drafter = load_drafter(ckpt, target_checkpoint=target)
    tied = dict(tensors, **{"embed_tokens.weight": embed, "lm_head.weight": embed})
    same = from_tensors(drafter.config, tied, dtype=torch.float32,
                        config_json=json.loads((ckpt / "config.json").read_text()))
    assert drafter.drafter_identity == same.drafter_identity
    rows = encode_bf16_rows(bf16_taps(np.random.default_rng(10), 9, drafter.config.tap_width))
    a = drafter.reference_draft([rows], [9], [17])
    b = same.reference_draft([rows], [9], [17])
    np.testing.assert_array_equal(a.draft_ids, b.draft_ids)
    hello = hello_from_checkpoint(ckpt, window=16, max_slots=2, target_checkpoint=target)
    assert (hello.drafter_identity, hello.markov_identity) == (
        drafter.drafter_identity, drafter.markov_identity)


def test_hello_from_a_gemma4_checkpoint(g4: Drafter) -> None:
    h = hello_from_checkpoint(DATA, window=32, max_slots=4)
    assert (h.num_spec, h.vocab_size, h.n_taps, h.hidden, h.row_bytes) == (
        g4.num_spec, g4.vocab_size, g4.n_taps, g4.target_hidden, g4.row_bytes)
    assert (h.drafter_identity, h.markov_identity) == (g4.drafter_identity, g4.markov_identity)
    assert (h.drafter_identity, h.markov_identity) == identities_from_checkpoint(DATA)


def test_random_gemma4_weights_draft_like_the_oracle() -> None:
    """A Gemma4 config of another shape (two KV heads, GQA groups of 2, no softcap, full
    rotary) with random weights: the ring path equals the plain oracle."""
    base = parse_config(raw_config())
    assert isinstance(base, Gemma4Config)
    config = dataclasses.replace(base, num_attention_heads=4, num_key_value_heads=2,
                                 head_dim=16, final_logit_softcapping=None,
                                 partial_rotary_factor=1.0, block_size=5).validated("test")
    tensors = random_tensors(config, 3)
    drafter = from_tensors(config, tensors, dtype=torch.float32)
    rng = np.random.default_rng(12)
    taps = bf16_taps(rng, 40, config.tap_width)
    pool = drafter.new_pool(1, 64)
    lane = pool.allocate(1)
    pool.apply(lane, [40], [40], [True], encode_bf16_rows(taps))
    got = drafter.draft(pool, lane, [40], [9])
    ids, conf, margin = plain_draft(tensors, config, taps, 40, 9)
    assert got.draft_ids[0].tolist() == ids
    np.testing.assert_allclose(got.confidence[0], conf, atol=TOL, rtol=0)
    np.testing.assert_allclose(got.margin[0], margin, atol=TOL, rtol=0)


# -- CUDA (skipped without a GPU) -----------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_fp32_vectors_and_bf16_tolerance(cases: list[dict[str, Any]]) -> None:
    """fp32 on CUDA drafts DeepSpec's vectors; bf16 (the CUDA default) keeps the first draft
    and its confidence within bf16's tolerance; sampled replies pass 9.2 and 9.3."""
    for dtype in (torch.float32, torch.bfloat16):
        gpu = load_drafter(DATA, device="cuda", dtype=dtype)
        pool = gpu.new_pool(2, 16)
        lanes = pool.allocate(2)
        rows = np.concatenate([encode_bf16_rows(np.asarray(c["taps"], np.float32))
                               for c in cases])
        anchors = [c["anchor_pos"] for c in cases]
        pool.apply(lanes, anchors, [9, 9], [True, True], rows)
        got = gpu.draft(pool, lanes, anchors, [c["anchor_token"] for c in cases])
        for i, c in enumerate(cases):
            if dtype == torch.float32:
                assert got.draft_ids[i].tolist() == c["ids"]
                np.testing.assert_allclose(got.confidence[i], c["confidence"], atol=TOL)
                np.testing.assert_allclose(got.margin[i], c["margin"], atol=TOL)
            else:
                assert got.draft_ids[i, 0] == c["ids"][0]
                assert abs(float(got.confidence[i, 0]) - c["confidence"][0]) < 0.05
        params = SamplingParams(top_k=[32, 4], temperature=[1.0, 0.8], top_p=[0.0, 0.9],
                                seed=[1, 2], generation=[0, 5])
        out = gpu.draft(pool, lanes, anchors, [3, 4], sampling=params)
        check_sampled(out, params, anchors, gpu.vocab_size)
