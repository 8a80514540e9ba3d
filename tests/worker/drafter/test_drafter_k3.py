"""The Kimi-K3 family on the drafter: every option that makes another model refused by name,
the target's embedding and head (the shipped embedding copy never read, a sharded target whose
names carry ``language_model.`` read through its index and the two shards that hold them), the
latent ring's size, sampled drafts against the plain reference, and bf16."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from dspark_client.hello import hello_from_checkpoint
from dspark_worker.drafter import (
    DrafterConfigError,
    SamplingParams,
    load_drafter,
    parse_config,
)
from dspark_worker.drafter.k3 import K3Config
from protocol.constants import Q_TOTAL
from protocol.identity import identities_from_checkpoint

DATA = Path(__file__).resolve().parent / "data" / "k3_tiny"
CASES = json.loads((DATA / "cases.json").read_text())
NAME = "k3_yarn32_n7"


def raw_config(name: str = NAME) -> dict[str, Any]:
    out: dict[str, Any] = json.loads((DATA / name / "config.json").read_text())
    return out


def case_rows(name: str) -> tuple[list[dict[str, Any]], list[np.ndarray]]:
    cases = [c for c in CASES["cases"] if c["checkpoint"] == name]
    taps = load_file(str(DATA / "taps.safetensors"))
    return cases, [taps[c["taps_key"]].view(torch.int16).numpy().view(np.uint8)
                   .reshape(c["n_rows"], -1) for c in cases]


def drafts(d: Any, name: str, sampling: SamplingParams | None = None) -> Any:
    """The checkpoint's cases drafted through a ring pool, one lane each, in one batch."""
    cases, rows = case_rows(name)
    pool = d.new_pool(len(cases), 64)
    lanes = pool.allocate(len(cases))
    anchors = [k["anchor_pos"] for k in cases]
    pool.apply(lanes, anchors, [k["n_rows"] for k in cases], [True] * len(cases),
               np.concatenate(rows))
    return d.draft(pool, lanes, anchors, [k["anchor_token"] for k in cases], sampling=sampling)


# -- config.json ------------------------------------------------------------------------------

REFUSALS: dict[str, tuple[dict[str, Any], str]] = {
    "mla_use_nope": ({"mla_use_nope": True}, "NoPE"),
    "mla_use_output_gate": ({"mla_use_output_gate": True}, "output gate"),
    "mla_use_qk_norm": ({"mla_use_qk_norm": True}, "q/k norms"),
    "dspark_bonus_anchor": ({"dspark_bonus_anchor": True}, "bonus token"),
    "q_lora_rank": ({"q_lora_rank": None}, "full-rank query"),
    "draft_vocab_size": ({"draft_vocab_size": 200}, "reduced vocabulary"),
    "num_target_layers": ({"num_target_layers": 6}, "counts the taps"),
    "target_layer_ids": ({"target_layer_ids": []}, "no taps"),
    "dspark_draft_topk": ({"dspark_draft_topk": 64}, "candidate walk"),
    "markov_head_type": ({"markov_head_type": "gated"}, "vanilla"),
    "hidden_act": ({"hidden_act": "situ"}, "silu"),
    "attention_bias": ({"attention_bias": True}, "biases"),
    "rope_parameters.rope_type": ({"rope_parameters": {"rope_type": "llama3",
                                                        "rope_theta": 5e4}}, "YaRN"),
    "rope_parameters.attention_factor": ({"rope_parameters.attention_factor": 1.2},
                                         "mscale²"),
    "is_causal": ({"is_causal": True}, "causal"),
    "dflash_config.causal": ({"dflash_config": {"causal": True}}, "causal"),
    "fc_norm": ({"fc_norm": True}, "per-tap norms"),
    "n_routed_experts": ({"n_routed_experts": 8}, "MoE"),
}


@pytest.mark.parametrize("key", sorted(REFUSALS))
def test_every_option_of_another_model_is_refused_by_name(key: str) -> None:
    changes, why = REFUSALS[key]
    raw = raw_config()
    for dotted, value in changes.items():
        node = raw
        *parents, last = dotted.split(".")
        for part in parents:
            node = node[part]
        node[last] = value
    with pytest.raises(DrafterConfigError) as info:
        parse_config(raw)
    assert info.value.field == key and key in str(info.value) and why in str(info.value)
    assert "not served" in str(info.value)


def test_the_config_as_vllm_reads_it() -> None:
    """Routed by model_type or architectures alone; num_target_layers counts the taps (the
    target's depth beside it); the confidence flags default to false; absent RoPE keys are
    default RoPE at θ 5e4; sample_from_anchor false keeps N = block_size."""
    raw = raw_config()
    c = parse_config(raw)
    assert isinstance(c, K3Config) and c.n_taps == 3 and c.num_target_layers == 6
    assert (c.num_key_value_heads, c.head_dim) == (1, 24)  # the ring: one latent of 16 + 8
    assert abs(c.softmax_scale / 24**-0.5 - (0.1 * np.log(32) + 1) ** 2) < 1e-12
    for drop in ("model_type", "architectures"):
        assert isinstance(parse_config({k: v for k, v in raw.items() if k != drop}), K3Config)
    bare = {k: v for k, v in raw.items() if k not in (
        "rope_parameters", "enable_confidence_head", "confidence_head_with_markov")}
    c = parse_config({**bare, "sample_from_anchor": False})
    assert (c.rope_type, c.rope_theta, c.enable_confidence_head) == ("default", 5e4, False)
    assert (c.num_spec, c.lead_rows) == (7, 1)


# -- the target's tensors ---------------------------------------------------------------------


def test_the_shipped_embedding_copy_is_never_read(tmp_path: Path) -> None:
    """A drafter whose embed_tokens copy differs from its target's drafts as vLLM does, with
    the target's; worker and engine hash the target's (the copy enters no identity)."""
    ck = tmp_path / NAME
    shutil.copytree(DATA / NAME, ck)
    tensors = load_file(str(ck / "model.safetensors"))
    tensors["embed_tokens.weight"] = torch.randn_like(tensors["embed_tokens.weight"])
    save_file(tensors, str(ck / "model.safetensors"))
    d = load_drafter(ck, DATA / "target", record_identities=False)
    cases, _ = case_rows(NAME)
    assert drafts(d, NAME).draft_ids.tolist() == [k["ids"] for k in cases]
    ids = (d.drafter_identity, d.markov_identity)
    assert identities_from_checkpoint(ck, DATA / "target", use_identity_file=False) == ids
    assert identities_from_checkpoint(DATA / NAME, DATA / "target",
                                      use_identity_file=False) == ids


def test_a_sharded_target_with_a_language_model_prefix(tmp_path: Path) -> None:
    """A VL target's layout: names under ``language_model.``, an index over shards. Only the
    index and the two shards holding the embedding and the head are read: the index's other
    shard is not even on this host. Drafts and identities are the plain target's."""
    target = tmp_path / "target"
    target.mkdir()
    plain = load_file(str(DATA / "target" / "model.safetensors"))
    save_file({"language_model.model.embed_tokens.weight": plain["model.embed_tokens.weight"]},
              str(target / "model-00001-of-00003.safetensors"))
    save_file({"language_model.lm_head.weight": plain["lm_head.weight"]},
              str(target / "model-00003-of-00003.safetensors"))
    weight_map = {"language_model.model.embed_tokens.weight": "model-00001-of-00003.safetensors",
                  "language_model.model.norm.weight": "model-00002-of-00003.safetensors",
                  "language_model.lm_head.weight": "model-00003-of-00003.safetensors",
                  "vision_tower.patch_embed.weight": "model-00002-of-00003.safetensors"}
    (target / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": weight_map}))
    d = load_drafter(DATA / NAME, target, record_identities=False)
    plain_d = load_drafter(DATA / NAME, DATA / "target", record_identities=False)
    assert (d.drafter_identity, d.markov_identity) == (plain_d.drafter_identity,
                                                       plain_d.markov_identity)
    cases, _ = case_rows(NAME)
    assert drafts(d, NAME).draft_ids.tolist() == [k["ids"] for k in cases]
    hello = hello_from_checkpoint(DATA / NAME, window=64, max_slots=4, target_checkpoint=target)
    assert hello.drafter_identity == d.drafter_identity
    assert (hello.num_spec, hello.n_taps, hello.hidden, hello.row_bytes) == (7, 3, 64, 384)


# -- the latent ring, sampling, bf16 ----------------------------------------------------------


def test_the_ring_holds_the_latent_only() -> None:
    d = load_drafter(DATA / NAME, DATA / "target", record_identities=False)
    pool = d.new_pool(2, 64)
    c = d.config
    assert pool.kv.shape == (1, 3, 2, 1, 64, 24) and pool.k.data_ptr() == pool.v.data_ptr()
    assert pool.bytes_per_lane == c.num_hidden_layers * 64 * (16 + 8) * 4  # fp32 here


def test_sampled_drafts_are_the_reference_ones() -> None:
    """Top-32 sampling (and greedy beside it in one batch) drafts what the plain reference
    draws through ``protocol.sampled``; ``sample_from_anchor`` false and ``logit_scale`` run
    the same way (its Markov bias scaled with the logits)."""
    raw = raw_config("k3_yarn8_n5_tied")
    variants = {"as shipped": raw, "anchor row lead": {**raw, "sample_from_anchor": False,
                                                       "logit_scale": 1.7}}
    for label, config in variants.items():
        d = load_drafter(DATA / "k3_yarn8_n5_tied", DATA / "target_tied",
                         record_identities=False)
        if config is not raw:
            from dspark_worker.drafter import from_tensors
            from dspark_worker.drafter.checkpoint import load_checkpoint

            tensors = load_checkpoint(DATA / "k3_yarn8_n5_tied", DATA / "target_tied",
                                      record_identities=False).tensors
            d = from_tensors(parse_config(config), tensors)
        cases, rows = case_rows("k3_yarn8_n5_tied")
        b = len(cases)
        sampling = SamplingParams(top_k=[0, 32, 8, 32][:b], temperature=[1.0, 0.7, 1.3, 2.0][:b],
                                  top_p=[0.0, 0.0, 0.9, 0.5][:b], seed=list(range(3, 3 + b)),
                                  generation=[1] * b)
        got = drafts(d, "k3_yarn8_n5_tied", sampling)
        ref = d.reference_draft([r[-64:] for r in rows], [k["anchor_pos"] for k in cases],
                                [k["anchor_token"] for k in cases], sampling=sampling)
        assert got.draft_ids.tolist() == ref.draft_ids.tolist(), label
        assert np.array_equal(got.support_ids, ref.support_ids), label
        # q from logits of a batch vs one lane alone may differ by float rounding (scaled by
        # logit_scale / T): close only, within 2e-5 of the total
        diff = np.abs(got.proposal_q.astype(np.int64) - ref.proposal_q.astype(np.int64))
        assert diff.max() <= Q_TOTAL * 2e-5, label
        np.testing.assert_allclose(got.confidence, ref.confidence, atol=1e-5)
        np.testing.assert_allclose(got.margin, ref.margin, atol=1e-4)


def test_bf16_on_the_cpu() -> None:
    """bf16 weights and a bf16 latent ring (1,152 bytes per layer and position at the real
    width; 48 here): the ring's drafts are the plain bf16 reference's, and they stay close to
    the fp32 vectors (a bf16 ring serves, it does not meet 1e-3 margins)."""
    d = load_drafter(DATA / NAME, DATA / "target", dtype=torch.bfloat16,
                     record_identities=False)
    assert d.new_pool(1, 64).bytes_per_lane == 3 * 64 * 24 * 2
    cases, rows = case_rows(NAME)
    got = drafts(d, NAME)
    ref = d.reference_draft([r[-64:] for r in rows], [k["anchor_pos"] for k in cases],
                            [k["anchor_token"] for k in cases])
    assert got.draft_ids.tolist() == ref.draft_ids.tolist()
    np.testing.assert_allclose(got.confidence, ref.confidence, atol=2e-2)
    same = np.mean(got.draft_ids == np.array([k["ids"] for k in cases]))
    assert same >= 0.75, same


def test_the_engines_hello_in_both_anchor_modes() -> None:
    """hello_from_checkpoint reads a K3 config: N = block_size with and without
    ``sample_from_anchor``, taps, tap width; and agrees with the worker's drafter."""
    for name, geometry in (("extra_lead_scaled_v2000", (4, 2, 48, 2000)),
                           ("extra_norope_keys_n9", (9, 4, 64, 500))):
        target = DATA / f"{name}_target"
        hello = hello_from_checkpoint(DATA / name, window=128, max_slots=2,
                                      target_checkpoint=target)
        d = load_drafter(DATA / name, target, record_identities=False)
        assert (hello.num_spec, hello.n_taps, hello.hidden, hello.vocab_size) == geometry
        assert (d.num_spec, d.n_taps, d.target_hidden, d.vocab_size) == geometry
        assert hello.row_bytes == d.row_bytes == geometry[1] * geometry[2] * 2
        assert (hello.drafter_identity, hello.markov_identity) == (d.drafter_identity,
                                                                   d.markov_identity)


def test_a_reload_across_ring_layouts_is_refused_by_its_planes() -> None:
    """A version sharing the serving pool's rings must have its layout: a K3 drafter over a
    Qwen3 pool (two planes of K and V) is refused naming the planes and the widths; one K3
    drafter over another's pool of the same latent shares it."""
    from dspark_worker.drafter import embedded_default

    k3 = load_drafter(DATA / NAME, DATA / "target", record_identities=False)
    with pytest.raises(ValueError, match=r"planes 1 \(serving 2\).*head_dim 24 \(serving 32\)"):
        embedded_default().new_pool(2, 64).sibling(k3.model)
    pool = k3.new_pool(2, 64)
    copy = load_drafter(DATA / NAME, DATA / "target", record_identities=False)
    assert pool.sibling(copy.model).kv.data_ptr() == pool.kv.data_ptr()


def test_mla_sizes_are_bounded_as_they_are_read() -> None:
    raw = {**raw_config(), "q_lora_rank": 1 << 20}
    with pytest.raises(DrafterConfigError, match=r"q_lora_rank 1048576 is over 65536") as info:
        parse_config(raw)
    assert info.value.limit == 1 << 16
