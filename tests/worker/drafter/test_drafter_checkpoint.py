"""Checkpoints in the DeepSpec layout, config.json parsing, identities, head variants and the
embedded default."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from drafter_support import TINY, make_drafter, make_rows, tiny_config
from safetensors.torch import load_file, save_file

from dspark_client.hello import hello_from_checkpoint
from dspark_worker.drafter import (
    EMBEDDED_CONFIG,
    CheckpointError,
    Drafter,
    DrafterConfigError,
    embedded_identities,
    load_drafter,
    parse_config,
    random_default,
    random_identities,
    random_tensors,
    save_checkpoint,
)
from dspark_worker.drafter.drafter import REFERENCE_DIR
from dspark_worker.drafter.embedded import EMBEDDED_SEED
from dspark_worker.drafter.model import expected_shapes
from protocol.identity import IDENTITY_FILE, identities_from_checkpoint


def drafts_of(drafter: Drafter, seed: int = 11, n_rows: int = 9, window: int = 16
              ) -> np.ndarray:
    """Greedy drafts of two lanes after one ingest (a fingerprint of the weights)."""
    rng = np.random.default_rng(seed)
    pool = drafter.new_pool(2, window)
    lanes = pool.allocate(2)
    rows = make_rows(rng, 2 * n_rows, drafter.config)
    pool.apply(lanes, [n_rows, n_rows], [n_rows, n_rows], [True, True], rows)
    out = drafter.draft(pool, lanes, [n_rows, n_rows], [5, 17])
    return np.concatenate([out.draft_ids, out.confidence], axis=None)


def raw_config(**changes: object) -> dict[str, object]:
    raw = TINY.to_json_dict()
    raw.update(changes)
    return raw


# -- config.json ----------------------------------------------------------------------------------


def test_config_round_trip() -> None:
    assert parse_config(json.loads(json.dumps(TINY.to_json_dict()))) == TINY


def test_config_aliases() -> None:
    raw = raw_config()
    for name in ("block_size", "mask_token_id", "target_layer_ids", "markov_rank", "rope_theta"):
        del raw[name]
    raw.update({
        "dspark_block_size": 6,
        "dflash_config": {"mask_token_id": 299, "target_layer_ids": [0, 2, 4]},
        "dspark_markov_rank": 16,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
    })
    assert parse_config(raw) == TINY
    raw["dspark_noise_token_id"] = 299  # agreeing aliases are fine
    assert parse_config(raw) == TINY


@pytest.mark.parametrize(("changes", "message"), [
    ({"num_attention_heads": 8, "num_key_value_heads": 3},
     "config.json: num_key_value_heads 3 does not divide num_attention_heads 8"),
    ({"hidden_size": None}, "config.json: hidden_size is missing"),
    ({"hidden_size": 0}, "config.json: hidden_size 0 must be a positive integer"),
    ({"vocab_size": "300"}, "config.json: vocab_size '300' is not an integer"),
    ({"mask_token_id": 300}, "config.json: mask_token_id 300 is outside [0, vocab_size 300)"),
    ({"target_layer_ids": [4, 2]}, "config.json: target_layer_ids [4, 2] must be strictly"),
    ({"target_layer_ids": [0, 2, 6]}, "names a layer past num_target_layers 6"),
    ({"markov_head_type": "lstm"}, "config.json: markov_head_type 'lstm' is not one of"),
    ({"head_dim": 15}, "config.json: head_dim 15 must be even"),
    ({"rope_theta": -1.0}, "config.json: rope_theta -1.0 must be a finite number above 1"),
    ({"hidden_act": "gelu"}, "config.json: hidden_act 'gelu' is not supported"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
     "config.json: rope_scaling.rope_type 'yarn' is not supported"),
    ({"confidence_temperatures": [1.0, 2.0]},
     "config.json: confidence_temperatures [1.0, 2.0] has 2 entries, block_size is 6"),
    ({"dspark_block_size": 7}, "config.json: block_size 6 and dspark_block_size 7 disagree"),
    ({"markov_rank": 0, "confidence_head_with_markov": True},
     "confidence_head_with_markov True needs a Markov head"),
])
def test_config_refusals_name_field_and_value(changes: dict[str, object], message: str) -> None:
    raw = raw_config(**changes)
    for name, value in changes.items():
        if value is None:
            del raw[name]
    with pytest.raises(DrafterConfigError) as info:
        parse_config(raw)
    assert message in str(info.value)


def test_config_from_file(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(raw_config(num_key_value_heads=3)))
    with pytest.raises(DrafterConfigError, match="num_key_value_heads 3 does not divide"):
        load_drafter(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(DrafterConfigError, match="not valid JSON"):
        load_drafter(tmp_path)


def test_row_bytes_and_geometry(tiny: Drafter) -> None:
    assert tiny.n_taps == 3
    assert tiny.target_hidden == 48
    assert tiny.row_bytes == 3 * 48 * 2
    assert (tiny.vocab_size, tiny.num_spec) == (300, 6)
    assert parse_config({k: v for k, v in raw_config().items()
                         if k != "target_hidden_size"}).target_hidden_size == 64


# -- round trips ----------------------------------------------------------------------------------


def test_single_file_round_trip(tmp_path: Path, tiny: Drafter) -> None:
    files = save_checkpoint(tiny.model, tmp_path)
    assert [f.name for f in files] == ["model.safetensors"]
    assert set(load_file(str(files[0]))) == set(expected_shapes(TINY))
    loaded = load_drafter(tmp_path)
    np.testing.assert_array_equal(drafts_of(loaded), drafts_of(tiny))
    # Hashed from the loaded bytes, the same as hashed from the files (nothing recorded used)
    ids = identities_from_checkpoint(tmp_path, use_identity_file=False)
    assert (loaded.drafter_identity, loaded.markov_identity) == ids
    # ... and recorded beside the checkpoint, where an engine's HELLO finds it.
    record = json.loads((tmp_path / IDENTITY_FILE).read_text())
    assert (record["drafter_identity"], record["markov_identity"]) == (ids[0].hex(),
                                                                       ids[1].hex())
    hello = hello_from_checkpoint(tmp_path, window=16, max_slots=4)
    assert (hello.drafter_identity, hello.markov_identity) == ids
    # fp32 in memory and in the file: the identity of the tensors is the identity of the file
    assert (loaded.drafter_identity, loaded.markov_identity) == (tiny.drafter_identity,
                                                                 tiny.markov_identity)


def test_sharded_round_trip(tmp_path: Path, tiny: Drafter) -> None:
    files = save_checkpoint(tiny.model, tmp_path, max_shard_bytes=60_000)
    assert len(files) > 2
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(expected_shapes(TINY))
    loaded = load_drafter(tmp_path)
    np.testing.assert_array_equal(drafts_of(loaded), drafts_of(tiny))
    assert loaded.drafter_identity == tiny.drafter_identity  # shards do not change identity


def test_bf16_checkpoint_loads(tmp_path: Path, tiny: Drafter) -> None:
    half = make_drafter()
    half.model.to(torch.bfloat16)
    save_checkpoint(half.model, tmp_path)
    loaded = load_drafter(tmp_path)
    assert loaded.dtype == torch.float32
    assert loaded.drafter_identity != tiny.drafter_identity  # dtype is part of the identity
    assert (loaded.drafter_identity, loaded.markov_identity) == identities_from_checkpoint(
        tmp_path, use_identity_file=False)
    assert torch.equal(loaded.model.fc.weight, half.model.fc.weight.float())  # bf16 upcast


@pytest.mark.parametrize("tied", [False, True])
def test_embed_and_head_from_target(tmp_path: Path, tied: bool) -> None:
    tensors = random_tensors(TINY, 3)
    if tied:
        tensors["lm_head.weight"] = tensors["embed_tokens.weight"].clone()
    full = make_drafter(tensors=tensors)
    draft_dir, target_dir = tmp_path / "draft", tmp_path / "target"
    save_checkpoint(full.model, draft_dir, exclude=["embed_tokens.weight", "lm_head.weight"])
    target_dir.mkdir()
    target = {
        "model.embed_tokens.weight": tensors["embed_tokens.weight"],
        # a tensor the drafter never reads
        "model.layers.0.mlp.up_proj.weight": torch.zeros(8, 8),
    }
    if not tied:
        target["lm_head.weight"] = tensors["lm_head.weight"]
    save_file(target, str(target_dir / "model.safetensors"))

    with pytest.raises(CheckpointError, match=r"has no embed_tokens\.weight and no target") as info:
        load_drafter(draft_dir)
    # The engine's HELLO from the same folder fails with the same check and the same words.
    with pytest.raises(ValueError) as client_info:
        hello_from_checkpoint(draft_dir, window=16, max_slots=4)
    assert str(client_info.value) == str(info.value)
    assert "--target-checkpoint" in str(info.value) and "target_checkpoint=" in str(info.value)
    loaded = load_drafter(draft_dir, target_checkpoint=target_dir)
    np.testing.assert_array_equal(drafts_of(loaded), drafts_of(full))
    # the target's tensors count in the identity exactly as if the drafter had them
    assert loaded.drafter_identity == full.drafter_identity
    assert (loaded.drafter_identity, loaded.markov_identity) == identities_from_checkpoint(
        draft_dir, target_dir, use_identity_file=False)


def test_target_without_the_tensors(tmp_path: Path, tiny: Drafter) -> None:
    save_checkpoint(tiny.model, tmp_path / "d", exclude=["lm_head.weight"])
    (tmp_path / "t").mkdir()
    save_file({"model.norm.weight": torch.ones(4)}, str(tmp_path / "t" / "model.safetensors"))
    with pytest.raises(CheckpointError,
                       match=r"has no lm_head\.weight, and the target checkpoint .* either"
                       ) as info:
        load_drafter(tmp_path / "d", target_checkpoint=tmp_path / "t")
    with pytest.raises(ValueError) as client_info:
        hello_from_checkpoint(tmp_path / "d", window=16, max_slots=4,
                              target_checkpoint=tmp_path / "t")
    assert str(client_info.value) == str(info.value)


def test_loading_says_where_embed_and_head_come_from(tmp_path: Path, tiny: Drafter,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    save_checkpoint(tiny.model, tmp_path / "d", exclude=["lm_head.weight"])
    (tmp_path / "t").mkdir()
    save_file({"lm_head.weight": tiny.model.state_dict()["lm_head.weight"].clone()},
              str(tmp_path / "t" / "model.safetensors"))
    with caplog.at_level("INFO", logger="dspark_worker.checkpoint"):
        load_drafter(tmp_path / "d", target_checkpoint=tmp_path / "t")
    text = caplog.text
    assert f"embed_tokens.weight (F32 [{TINY.vocab_size}, {TINY.hidden_size}]): from the" \
           f" drafter checkpoint, {tmp_path / 'd'}" in text
    assert f"lm_head.weight (F32 [{TINY.vocab_size}, {TINY.hidden_size}]): from the target" \
           f" checkpoint, {tmp_path / 't'}" in text
    caplog.clear()
    save_checkpoint(tiny.model, tmp_path / "full")
    with caplog.at_level("INFO", logger="dspark_worker.checkpoint"):
        load_drafter(tmp_path / "full", target_checkpoint=tmp_path / "t")
    assert (f"target checkpoint {tmp_path / 't'} ignored: the drafter checkpoint has its own"
            " embed_tokens.weight and lm_head.weight") in caplog.text


def test_wrong_shape_named(tmp_path: Path, tiny: Drafter) -> None:
    save_checkpoint(tiny.model, tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    state["layers.1.self_attn.k_proj.weight"] = torch.zeros(16, 64)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError) as info:
        load_drafter(tmp_path)
    assert "tensor layers.1.self_attn.k_proj.weight has shape [16, 64], expected [32, 64]" in \
        str(info.value)
    assert info.value.tensor == "layers.1.self_attn.k_proj.weight"
    assert (info.value.shape, info.value.expected) == ((16, 64), (32, 64))


def test_missing_and_unexpected_tensor_named(tmp_path: Path, tiny: Drafter) -> None:
    save_checkpoint(tiny.model, tmp_path, exclude=["layers.1.mlp.down_proj.weight"])
    with pytest.raises(CheckpointError,
                       match=r"missing tensor layers.1.mlp.down_proj.weight \(expected shape"
                             r" \[64, 128\]\)"):
        load_drafter(tmp_path)
    state = {k: v.contiguous() for k, v in tiny.model.state_dict().items()}
    state["markov_head.gate_proj.weight"] = torch.zeros(16, 80)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"unexpected tensor markov_head\.gate_proj\.weight"):
        load_drafter(tmp_path)


def test_no_checkpoint_files(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(raw_config()))
    with pytest.raises(CheckpointError, match="no safetensors files"):
        load_drafter(tmp_path)


# -- heads ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn"])
def test_each_markov_head_loads_and_drafts(tmp_path: Path, kind: str) -> None:
    config = tiny_config(markov_head_type=kind)
    drafter = make_drafter(config, seed=4)
    save_checkpoint(drafter.model, tmp_path)
    loaded = load_drafter(tmp_path)
    assert loaded.config.markov_head_type == kind
    got = drafts_of(loaded)
    np.testing.assert_array_equal(got, drafts_of(drafter))
    # the head shapes the drafts: with markov_w2 zeroed the drafts change
    with torch.no_grad():
        assert loaded.model.markov_head is not None
        loaded.model.markov_head.markov_w2.weight.zero_()
    assert not np.array_equal(drafts_of(loaded), got)


def test_rnn_head_matches_reference(tiny: Drafter) -> None:
    drafter = make_drafter(tiny_config(markov_head_type="rnn"), seed=8)
    rng = np.random.default_rng(2)
    pool = drafter.new_pool(1, 8)
    lane = pool.allocate(1)
    rows = make_rows(rng, 12)
    pool.apply(lane, [12], [12], [True], rows)
    got = drafter.draft(pool, lane, [12], [9])
    ref = drafter.reference_draft([rows[-8:]], [12], [9])
    np.testing.assert_array_equal(got.draft_ids, ref.draft_ids)
    np.testing.assert_allclose(got.confidence, ref.confidence, atol=1e-5)


def test_markov_head_steers_a_crafted_case() -> None:
    """Put all of the Markov mass on 'anchor -> t': position 0 drafts t with the head and the
    backbone's own argmax without it."""
    tensors = random_tensors(TINY, 12)
    base = make_drafter(tensors={**tensors,
                                 "markov_head.markov_w2.weight": torch.zeros(300, 16)})
    anchor = 5
    first = int(drafts_of(base)[0])
    target = (first + 1) % TINY.vocab_size
    w1 = torch.zeros(300, 16)
    w1[anchor, 0] = 1.0
    w2 = torch.zeros(300, 16)
    w2[target, 0] = 1000.0
    steered = make_drafter(tensors={**tensors, "markov_head.markov_w1.weight": w1,
                                    "markov_head.markov_w2.weight": w2})
    rng = np.random.default_rng(11)
    pool = steered.new_pool(1, 16)
    lane = pool.allocate(1)
    pool.apply(lane, [9], [9], [True], make_rows(rng, 9))
    out = steered.draft(pool, lane, [9], [anchor])
    assert int(out.draft_ids[0, 0]) == target != first
    assert out.margin[0, 0] > 900  # the bias dominates position 0's logits


def test_without_markov_and_confidence_heads(tmp_path: Path) -> None:
    config = tiny_config(markov_rank=0, enable_confidence_head=False,
                         confidence_head_with_markov=False)
    drafter = make_drafter(config)
    assert not any(k.startswith(("markov_head.", "confidence_head."))
                   for k in drafter.model.state_dict())
    save_checkpoint(drafter.model, tmp_path)
    loaded = load_drafter(tmp_path)
    rng = np.random.default_rng(0)
    pool = loaded.new_pool(1, 8)
    lane = pool.allocate(1)
    pool.apply(lane, [4], [4], [True], make_rows(rng, 4))
    out = loaded.draft(pool, lane, [4], [1])
    np.testing.assert_array_equal(out.confidence, np.ones((1, 6), dtype=np.float32))
    assert (out.margin >= 0).all()


def test_confidence_head_without_markov_features(tmp_path: Path) -> None:
    config = tiny_config(confidence_head_with_markov=False)
    drafter = make_drafter(config)
    assert drafter.model.state_dict()["confidence_head.proj.weight"].shape == (1, 64)
    rng = np.random.default_rng(0)
    pool = drafter.new_pool(1, 8)
    lane = pool.allocate(1)
    rows = make_rows(rng, 4)
    pool.apply(lane, [4], [4], [True], rows)
    got = drafter.draft(pool, lane, [4], [1])
    ref = drafter.reference_draft([rows], [4], [1])
    np.testing.assert_allclose(got.confidence, ref.confidence, atol=1e-5)


def test_confidence_temperatures() -> None:
    temps = (1.0, 2.0, 0.5, 1.5, 3.0, 1.0)
    plain = make_drafter()
    scaled = make_drafter(tiny_config(confidence_temperatures=temps))
    rng = np.random.default_rng(1)
    rows = make_rows(rng, 6)
    outs = []
    for drafter in (plain, scaled):
        pool = drafter.new_pool(1, 8)
        lane = pool.allocate(1)
        pool.apply(lane, [6], [6], [True], rows)
        outs.append(drafter.draft(pool, lane, [6], [2]))
    np.testing.assert_array_equal(outs[0].draft_ids, outs[1].draft_ids)

    def logit(p: np.ndarray) -> np.ndarray:
        p64 = p.astype(np.float64)
        return np.log(p64 / (1 - p64))

    np.testing.assert_allclose(logit(outs[1].confidence) * np.array(temps),
                               logit(outs[0].confidence), rtol=1e-4, atol=1e-4)


# -- embedded default -----------------------------------------------------------------------------


def test_embedded_default_is_the_shipped_reference_drafter(tmp_path: Path) -> None:
    drafter = load_drafter(None)
    assert drafter.source == "embedded"
    c = drafter.config
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads,
            c.head_dim, c.vocab_size, c.n_taps, c.target_hidden_size, c.block_size,
            c.mask_token_id, c.markov_rank) == (128, 2, 4, 2, 32, 260, 3, 128, 7, 259, 64)
    assert drafter.row_bytes == 3 * 128 * 2
    ids = (drafter.drafter_identity, drafter.markov_identity)
    assert ids == embedded_identities() == identities_from_checkpoint(REFERENCE_DIR)
    # pinned: the shipped files do not change unless the pair is retrained on purpose
    assert ids[0].hex() == REFERENCE_DRAFTER_ID and ids[1].hex() == REFERENCE_MARKOV_ID
    # saved again from the loaded model, the files give the same identities
    save_checkpoint(drafter.model, tmp_path)
    assert identities_from_checkpoint(tmp_path) == ids
    assert parse_config(json.loads((tmp_path / "config.json").read_text())) == c
    drafter.warmup()


def test_random_default(tmp_path: Path) -> None:
    drafter = random_default()
    assert drafter.source == "random" and drafter.config == EMBEDDED_CONFIG
    ids = (drafter.drafter_identity, drafter.markov_identity)
    assert ids == random_identities()
    save_checkpoint(drafter.model, tmp_path)
    assert identities_from_checkpoint(tmp_path) == ids


def test_embedded_weights_are_fixed_bytes() -> None:
    """Machine- and version-independent weights: pin a few values and the identities."""
    tensors = random_tensors(EMBEDDED_CONFIG, EMBEDDED_SEED)
    first = tensors["fc.weight"].reshape(-1)[:3].tolist()
    assert first == pytest.approx(FC_FIRST, abs=0)
    drafter_id, markov_id = random_identities()
    assert drafter_id.hex() == EMBEDDED_DRAFTER_ID
    assert markov_id.hex() == EMBEDDED_MARKOV_ID


FC_FIRST = [-0.055379558354616165, 0.054598577320575714, 0.07711483538150787]
EMBEDDED_DRAFTER_ID = "a625146c782d5f825c489d866c9b06d47b0e8393c912c6279b25fc5e1febd4af"
EMBEDDED_MARKOV_ID = "9ed50ff0e6769fd14b1396637ecee82aa336aaf38452b51ee7a5079459ecca52"
REFERENCE_DRAFTER_ID = "f48e62365f895d67746f949c66d9ba6a1dc3295931ec7179910e1fcc3cf4599e"
REFERENCE_MARKOV_ID = "dad555f86376b56f3634fc9adcc5fbcf629d32069a8888cf3a8cab4b607d4f3d"
