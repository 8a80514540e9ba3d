"""The DFlash family against its vectors (data/dflash_tiny: the shared cases, made with each
format's own classes, and the extra ones of tools/gen_dflash_vectors.py): speculators dflash and
dflash2, z-lab DFlash and DFlash2 in the legacy and the nested layout. Through the rings, the
from-scratch reference and the static step; the engine's HELLO from the same folders; refusals
by name; bf16 on the CPU; sampled DFlash2 drafts under contract section 9."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
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
    encode_bf16_rows,
    load_drafter,
    parse_config,
)
from dspark_worker.drafter.dflash import DFlashConfig
from dspark_worker.drafter.families import detect_family
from dspark_worker.drafter.step import StaticStep
from protocol import formats

DATA = Path(__file__).resolve().parent / "data" / "dflash_tiny"
SPECULATORS_TINY = Path(__file__).resolve().parent / "data" / "speculators_tiny"
MARGIN_TOL = 1e-3
W = 32  # the extra cases' rows cross multiples of 32: their windows wrap the ring


def vectors() -> tuple[dict[str, Any], list[dict[str, Any]]]:
    checkpoints: dict[str, Any] = {}
    cases: list[dict[str, Any]] = []
    for suffix in ("", "_extra"):
        raw = json.loads((DATA / f"cases{suffix}.json").read_text())
        checkpoints.update(raw["checkpoints"])
        cases += raw["cases"]
    return checkpoints, cases


CHECKPOINTS, CASES = vectors()
NAMES = sorted(CHECKPOINTS)


@pytest.fixture(scope="module")
def drafters() -> dict[str, Drafter]:
    return {name: load_drafter(DATA / name, DATA / c["target"], record_identities=False)
            for name, c in CHECKPOINTS.items()}


@pytest.fixture(scope="module")
def taps() -> dict[str, np.ndarray]:
    out = {}
    for suffix in ("", "_extra"):
        for key, t in load_file(str(DATA / f"taps{suffix}.safetensors")).items():
            out[key] = t.view(torch.int16).numpy().view(np.uint8).reshape(t.shape[0], -1)
    return out


def mine(name: str) -> list[dict[str, Any]]:
    return [c for c in CASES if c["checkpoint"] == name]


def test_formats_families_and_the_engines_hello(drafters: dict[str, Drafter]) -> None:
    """Each checkpoint is read as the format its own classes wrote, by the worker and by the
    engine's HELLO alike: N, taps (DeepSpec numbering), row size, identities."""
    for name, c in CHECKPOINTS.items():
        d = drafters[name]
        assert d.family == "dflash" and not d.has_confidence
        assert c["format"].startswith(d.config.format)
        assert (d.num_spec, d.n_taps, d.target_hidden, d.vocab_size) == (
            c["num_spec"], c["n_taps"], c["hidden"], c["target_vocab"])
        h = hello_from_checkpoint(DATA / name, window=W, max_slots=4,
                                  target_checkpoint=DATA / c["target"])
        assert (h.num_spec, h.row_bytes, h.vocab_size, h.n_taps, h.hidden) == (
            d.num_spec, d.row_bytes, d.vocab_size, d.n_taps, d.target_hidden), name
        assert (h.drafter_identity, h.markov_identity) == (d.drafter_identity,
                                                           d.markov_identity)
        assert tap_layers(DATA / name) == d.config.target_layer_ids
    zlab = json.loads((DATA / "zlab_legacy_b8" / "config.json").read_text())
    assert tap_layers(DATA / "zlab_legacy_b8") == tuple(zlab["dflash_config"]["target_layer_ids"])
    spec = json.loads((DATA / "spec_qwen3_full_tied" / "config.json").read_text())
    assert tap_layers(DATA / "spec_qwen3_full_tied") == tuple(
        k - 1 for k in spec["aux_hidden_state_layer_ids"])


@pytest.mark.parametrize("name", NAMES)
def test_vectors_from_the_rings_and_the_reference(drafters: dict[str, Drafter],
                                                  taps: dict[str, np.ndarray], name: str) -> None:
    """Every case: ids exact, margins within 1e-3 (fp32), confidence 1.0 (no head), from a ring
    of W = 32 (the extra cases wrap it) and from the from-scratch reference."""
    d, cs = drafters[name], mine(name)
    pool = d.new_pool(len(cs), W)
    lanes = pool.allocate(len(cs))
    pool.apply(lanes, [c["anchor_pos"] for c in cs], [c["n_rows"] for c in cs],
               [True] * len(cs), np.concatenate([taps[c["taps_key"]] for c in cs]))
    anchors, tokens = [c["anchor_pos"] for c in cs], [c["anchor_token"] for c in cs]
    got = d.draft(pool, lanes, anchors, tokens)
    ref = d.reference_draft([taps[c["taps_key"]] for c in cs], anchors, tokens)
    for i, c in enumerate(cs):
        for out in (got, ref):
            assert out.draft_ids[i].tolist() == c["ids"], (name, c["case"])
            np.testing.assert_allclose(out.margin[i], c["margin"], atol=MARGIN_TOL, rtol=0)
            assert out.confidence[i].tolist() == [1.0] * d.num_spec


def test_each_difference_changes_the_drafts(drafters: dict[str, Drafter],
                                            taps: dict[str, np.ndarray]) -> None:
    """The vectors tell the rules apart: z-lab's sliding rule read as speculators' (or the
    reverse), is_causal dropped, z-lab's scales dropped, the selector skipped: each changes
    some case's drafts."""
    import dataclasses

    from dspark_worker.drafter import from_tensors

    def drafts(d: Drafter, name: str) -> list[list[int]]:
        cs = mine(name)
        out = d.reference_draft([taps[c["taps_key"]] for c in cs],
                                [c["anchor_pos"] for c in cs], [c["anchor_token"] for c in cs])
        return [list(map(int, r)) for r in out.draft_ids]

    for name, change in (
            ("zlab_nested_sliding_b6", {"layout": "speculators"}),
            ("spec_llama_sliding_reduced", {"layout": "zlab"}),
            ("extra_zlab_legacy_noncausal", {"is_causal": None}),
            ("extra_zlab2_scaled_yarn", {"input_embedding_scale": 1.0}),
            ("extra_zlab2_scaled_yarn", {"final_logit_softcapping": None,
                                         "output_multiplier": 1.0})):
        d = drafters[name]
        want = [c["ids"] for c in mine(name)]
        assert drafts(d, name) == want
        tensors = dict(d.model.state_dict())
        other = from_tensors(dataclasses.replace(d.config, **change), tensors)
        assert drafts(other, name) != want, (name, change)
    d = drafters["spec_dflash2_b5"]
    plain = from_tensors(dataclasses.replace(d.config, version=1), {
        k: v for k, v in d.model.state_dict().items() if "conv" not in k
        and not k.startswith("candidate_selector")})
    assert drafts(plain, "spec_dflash2_b5") != [c["ids"] for c in mine("spec_dflash2_b5")]


@pytest.mark.parametrize("name", ["spec_dflash2_b5", "zlab_nested_sliding_b6",
                                  "extra_zlab2_scaled_yarn", "extra_spec_mqa_hd32_anchor"])
def test_static_step_equals_eager_and_the_reference(drafters: dict[str, Drafter],
                                                    name: str) -> None:
    """The captured step's stand-in: five lanes (three padded) over rings of 12 and 4 rows that
    wrap, greedy and sampled: the static step equals the eager one and both the reference on
    the rows each ring holds (z-lab's per-query window, the convolutions, the selector)."""
    d = drafters[name]
    rng = np.random.default_rng(8)
    for window in (12, 4):
        pool = d.new_pool(8, window)
        s = with_static_step(d, pool)
        lanes = pool.allocate(8)[[6, 1, 3, 0, 5]]
        counts = [3, 12, 30, 1, 6]
        anchors = [c + 40 * i for i, c in enumerate(counts)]
        rows = [encode_bf16_rows(bf16_taps(rng, n, d.config.tap_width)) for n in counts]
        pool.apply(lanes, anchors, counts, [True] * 5, np.concatenate(rows))
        tokens = rng.integers(0, d.vocab_size, 5)
        for sp in (None, params(5, window)):
            got, want = static_and_eager(s, pool, lanes, anchors, tokens, sampling=sp)
            assert_same(got, want, exact=False)
            ref = d.reference_draft([r[-window:] for r in rows], anchors, tokens, sampling=sp)
            np.testing.assert_array_equal(got.draft_ids, ref.draft_ids)
            np.testing.assert_allclose(got.margin, ref.margin, atol=MARGIN_TOL, rtol=0)
            if sp is not None:
                check_sampled(got, sp, anchors, d.vocab_size)


def test_static_step_has_no_host_sync(drafters: dict[str, Drafter],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    steps = [StaticStep(drafters[name].model, drafters[name].new_pool(4, 8), 4,
                        drafters[name].num_spec, sampled)
             for name in ("extra_zlab2_scaled_yarn", "extra_zlab_legacy_noncausal")
             for sampled in (False, True)]
    refuse_host_reads(monkeypatch)
    with torch.inference_mode():
        for step in steps:
            assert step.compute()["draft_ids"].shape == (4, step.n)


@pytest.mark.parametrize(("name", "k"), [("extra_zlab2_scaled_yarn", 6),
                                         ("extra_spec2_causal_top40", 40)])
def test_sampled_dflash2_draws_from_the_selector_scores(drafters: dict[str, Drafter],
                                                        taps: dict[str, np.ndarray], name: str,
                                                        k: int) -> None:
    """A sampled DFlash2 lane: q is contract 9.1 over the selector's scores of its k
    candidates (at most k places, every one a candidate: the unary top-k), 9.2 and 9.3 hold,
    and a greedy lane beside it drafts the vectors."""
    d, cs = drafters[name], mine(name)
    pool = d.new_pool(4, W)
    lanes = pool.allocate(4)
    pool.apply(lanes, [c["anchor_pos"] for c in cs], [c["n_rows"] for c in cs], [True] * 4,
               np.concatenate([taps[c["taps_key"]] for c in cs]))
    anchors, tokens = [c["anchor_pos"] for c in cs], [c["anchor_token"] for c in cs]
    sp = params(4, 5)
    got = d.draft(pool, lanes, anchors, tokens, sampling=sp, keep_logits=True)
    check_sampled(got, sp, anchors, d.vocab_size)
    assert got.support_ids is not None and got.proposal_q is not None and got.logits is not None
    used = (got.proposal_q > 0).sum(-1)
    assert used.max() <= min(k, 32)
    finite = np.isfinite(got.logits)  # the candidates: the only ids not -inf
    assert (finite.sum(-1) == k).all()
    for i, j, p in zip(*np.nonzero(got.proposal_q > 0), strict=True):
        assert finite[i, j, got.support_ids[i, j, p]]
    greedy = np.asarray(sp.top_k) == 0
    for i in np.flatnonzero(greedy):
        assert got.draft_ids[i].tolist() == cs[i]["ids"]
    ref = d.reference_draft([taps[c["taps_key"]] for c in cs], anchors, tokens, sampling=sp)
    np.testing.assert_array_equal(got.draft_ids, ref.draft_ids)


def test_bf16_on_the_cpu_close_to_fp32(drafters: dict[str, Drafter]) -> None:
    for name in ("spec_dflash2_b5", "zlab_nested_sliding_b6"):
        fp = drafters[name]
        bf = load_drafter(DATA / name, DATA / CHECKPOINTS[name]["target"], dtype=torch.bfloat16,
                          record_identities=False)
        assert bf.dtype == torch.bfloat16 and bf.drafter_identity == fp.drafter_identity
        check_bf16_many_lanes(fp, bf)


def test_a_speculators_dspark_checkpoint_without_its_head_has_no_confidence() -> None:
    d = load_drafter(SPECULATORS_TINY / "rnn_anchor_reduced_mixed_noconf",
                     SPECULATORS_TINY / "target", record_identities=False)
    assert d.family == "speculators" and not d.has_confidence
    assert load_drafter(SPECULATORS_TINY / "vanilla_anchor_reduced", SPECULATORS_TINY / "target",
                        record_identities=False).has_confidence


def test_dspark_draft_topk_is_refused_for_dflash2(drafters: dict[str, Drafter]) -> None:
    with pytest.raises(DrafterConfigError, match=r"dspark_draft_topk 64 is not supported for"
                       r" this drafter \(0 only\): its candidate selector reranks its own"
                       r" selector_top_k 8 candidates"):
        drafters["spec_dflash2_b5"].with_draft_topk(64)
    assert drafters["spec_qwen3_full_tied"].with_draft_topk(64).draft_topk == 64


# -- config.json: the legacy misread, and refusals by name ---------------------------------------


def raw(name: str) -> dict[str, Any]:
    out: dict[str, Any] = json.loads((DATA / name / "config.json").read_text())
    return out


def test_the_legacy_zlab_config_is_never_read_as_deepspec() -> None:
    """A z-lab legacy config (model_type qwen3, a dflash_config) once parsed as the DeepSpec
    Qwen3 layout (N = B, the anchor's row drafting). Its architectures route it to this family
    (N = B - 1); without them it is refused, naming both readings."""
    legacy = raw("zlab_legacy_b8")
    c = parse_config(legacy)
    assert isinstance(c, DFlashConfig) and c.num_spec == legacy["block_size"] - 1
    assert detect_family(legacy).name == "dflash"
    del legacy["architectures"]
    with pytest.raises(DrafterConfigError, match=r"dflash_config is set but architectures None"
                       r" names neither a DFlash drafter .*N = block_size - 1.* nor a DSpark"
                       r" one .*N = block_size\); set architectures to say which"):
        parse_config(legacy)
    with pytest.raises(ValueError, match="set architectures to say which"):
        formats.dflash_format(legacy)
    legacy["markov_rank"] = 8  # a DeepSpec DSpark drafter spelling its taps the DFlash way
    assert formats.dflash_format(legacy) is None




@pytest.mark.parametrize(("name", "key", "value", "message"), [
    ("zlab_nested_sliding_b6", "architectures", ["DFlashDraftModel", "LlamaForCausalLM"],
     r"architectures \['DFlashDraftModel', 'LlamaForCausalLM'\] is not supported \(a DFlash"
     r" drafter of this format has \['DFlashDraftModel'\]\)"),
    ("zlab_nested_sliding_b6", "model_type", "laguna",
     r"model_type 'laguna' is not supported \(a z-lab DFlash drafter of Qwen3 layers only"),
    ("zlab_nested_sliding_b6", "dflash_config.use_swa", True,
     r"dflash_config.use_swa True is not supported \(vLLM's sliding-window switch"),
    ("zlab_nested_sliding_b6", "dflash_config.swa_window_size", 128,
     r"dflash_config.swa_window_size 128 is not supported .* absent or null"),
    ("zlab_nested_sliding_b6", "dflash_config.causal", True,
     r"dflash_config.causal True is not supported \(vLLM's causal override"),
    ("zlab_nested_sliding_b6", "dflash_config.attention_sink_bias", True,
     r"dflash_config.attention_sink_bias True is not supported \(attention sinks"),
    ("zlab_nested_sliding_b6", "dflash_config.attention_value_scale", 2.0,
     r"dflash_config.attention_value_scale 2.0 is not supported"),
    ("zlab_nested_sliding_b6", "dflash_config.projector_type", "mlp",
     r"dflash_config.projector_type 'mlp' is not supported \(the dflash projector only"),
    ("zlab_nested_sliding_b6", "dflash_config.attention_mode", "mla",
     r"dflash_config.attention_mode 'mla' is not supported"),
    ("zlab_nested_sliding_b6", "dflash_config.token_shift", 1,
     r"dflash_config.token_shift 1 is not supported \(dflash_config keys the drafter reads:"),
    ("zlab_nested_sliding_b6", "is_neox_style", False,
     r"is_neox_style False is not supported \(neox-style rotary halves only"),
    ("zlab_nested_sliding_b6", "no_rope_layers", [1],
     r"no_rope_layers \[1\] is not supported \(layers without RoPE"),
    ("zlab_nested_sliding_b6", "rope_parameters.rope_type", "linear",
     r"rope_parameters.rope_type 'linear' is not supported \(one of \['default', 'llama3',"
     r" 'yarn'\]\)"),
    ("zlab_nested_sliding_b6", "hidden_act", "gelu",
     r"hidden_act 'gelu' is not supported \(only 'silu'\)"),
    ("zlab_nested_sliding_b6", "dflash_config.mask_token_id", DROP,
     r"dflash_config.mask_token_id or mask_token_id is missing"),
    ("zlab_nested_sliding_b6", "dflash_config.target_layer_ids", DROP,
     r"dflash_config.target_layer_ids or target_layer_ids is missing"),
    ("zlab_nested_sliding_b6", "dflash_config.block_size", 1,
     r"block_size 1 must be at least 2"),
    ("zlab_nested_sliding_b6", "dflash_config.target_layer_ids", [0, 3, 7, 16],
     r"target_layer_ids \[0, 3, 7, 16\] names a layer past num_target_layers 16"),
    ("zlab_legacy_b8", "dflash_config.block_size", 16,
     r"dflash_config.block_size 16 and block_size 8 disagree"),
    ("zlab_legacy_b8", "is_causal", "yes", r"is_causal 'yes' is not true, false or null"),
    ("extra_zlab2_scaled_yarn", "dflash_config.conv_kernel_size", 7,
     r"conv_kernel_size 7 is outside \[1, block_size 6\]"),
    ("extra_zlab2_scaled_yarn", "dflash_config.selector_top_k", 301,
     r"selector_top_k 301 is outside \[2, vocab_size 300\]"),
    ("extra_zlab2_scaled_yarn", "dflash_config.conv_group_size", 7,
     r"conv_group_size 7 must be a positive divisor of hidden_size 64"),
    ("extra_zlab2_scaled_yarn", "dflash_config.final_logit_softcapping", "12",
     r"dflash_config.final_logit_softcapping '12' is not a number"),
    ("extra_zlab2_scaled_yarn", "dflash_config.final_logit_softcapping", float("nan"),
     r"final_logit_softcapping nan must be a number in \(0,"),  # not read as "no cap"
    ("spec_dflash2_b5", "draft_vocab_size", 120,
     r"draft_vocab_size 120 must be the target's transformer_layer_config.vocab_size 300:"
     r" DFlash2 needs the full vocabulary"),
    ("spec_dflash2_b5", "architectures", ["DFlashDraftModel"],
     r"architectures \['DFlashDraftModel'\] is not supported \(a DFlash2 drafter of this format"
     r" has \['DFlash2DraftModel'\]\)"),
    ("spec_qwen3_full_tied", "enable_confidence_head", True,
     r"enable_confidence_head True is not supported \(speculators_model_type 'dflash' has no"
     r" Markov or confidence head"),
    ("spec_qwen3_full_tied", "speculators_config.proposal_methods", [{"speculative_tokens": 4}],
     r"speculative_tokens 4 disagrees with the layout's N 3 \(block_size 4, sample_from_anchor"
     r" false\)"),
    ("spec_qwen3_full_tied", "transformer_layer_config.hidden_act", "relu",
     r"transformer_layer_config.hidden_act 'relu' is not supported"),
])
def test_config_refusals_name_key_value_and_what_is_supported(name: str, key: str, value: Any,
                                                              message: str) -> None:
    cfg = copy.deepcopy(raw(name))
    set_key(cfg, key, value)
    with pytest.raises(DrafterConfigError, match=message):
        parse_config(cfg)


def test_speculators_defaults_where_keys_are_missing() -> None:
    """A hand-made speculators dflash config lacking the top-level keys takes the class's own
    defaults: sample_from_anchor false (DSpark's is true), sliding causal (dflash2: non-causal),
    block 8."""
    cfg = raw("spec_qwen3_full_tied")
    for k in ("sample_from_anchor", "sliding_window_non_causal", "block_size",
              "speculators_config"):
        del cfg[k]
    c = parse_config(cfg)
    assert isinstance(c, DFlashConfig)
    assert (c.block_size, c.num_spec, c.sample_from_anchor) == (8, 7, False)
    two = raw("spec_dflash2_b5")
    for k in ("sliding_window_non_causal", "conv_kernel_size", "selector_top_k"):
        del two[k]
    c2 = parse_config(two)
    assert isinstance(c2, DFlashConfig)
    assert (c2.sliding_window_non_causal, c2.conv_kernel_size, c2.selector_top_k) == (True, 2, 16)
    nested = raw("zlab_nested_sliding_b6")
    del nested["dflash_config"]["block_size"]
    assert parse_config(nested).block_size == 16  # z-lab's newer code's default


def copy_checkpoint(tmp_path: Path, name: str) -> Path:
    out = tmp_path / name
    shutil.copytree(DATA / name, out)
    return out


@pytest.mark.parametrize(("tensor", "what"), [
    ("layers.0.self_attn.qkv_proj.weight", "fused q/k/v projections"),
    ("layers.0.self_attn.g_proj.weight", "an attention output gate"),
    ("aux_hidden_norms.0.weight", "per-tap norms"),
    ("layers.1.self_attn.sinks", "attention sinks"),
])
def test_foreign_tensors_and_files_are_refused_by_name(tmp_path: Path, tensor: str,
                                                       what: str) -> None:
    ckpt = copy_checkpoint(tmp_path, "zlab_nested_sliding_b6")
    t = load_file(str(ckpt / "model.safetensors"))
    t[tensor] = torch.zeros(4, 4)
    save_file(t, str(ckpt / "model.safetensors"))
    with pytest.raises(CheckpointError, match=rf"unexpected tensor {tensor} .*: {what}.*, which"
                       r" the dflash drafter does not run"):
        load_drafter(ckpt, DATA / "target_tied", record_identities=False)


def test_a_mask_embedding_file_and_an_embedding_are_refused(tmp_path: Path) -> None:
    ckpt = copy_checkpoint(tmp_path, "zlab_legacy_b8")
    (ckpt / "mask_embedding.pt").write_bytes(b"\0" * 16)
    with pytest.raises(DrafterConfigError, match=r"mask_embedding.pt: a learned mask embedding"
                       r" is not supported"):
        load_drafter(ckpt, DATA / "target", record_identities=False)
    (ckpt / "mask_embedding.pt").unlink()
    t = load_file(str(ckpt / "model.safetensors"))
    t["embed_tokens.weight"] = torch.zeros(300, 64)
    save_file(t, str(ckpt / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"holds embed_tokens.weight .* which a dflash"
                       r" drafter takes from its target"):
        load_drafter(ckpt, DATA / "target", record_identities=False)
