"""hello_from_checkpoint: the engine's HELLO from its drafter checkpoint (6.1, 6.4)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from dspark_client import hello_from_checkpoint
from protocol import wire
from protocol.identity import identities_from_checkpoint, markov_walk_identity

REFERENCE = Path(__file__).resolve().parents[2] / "dspark_worker" / "drafter" / "reference"


def test_hello_from_the_reference_drafter() -> None:
    h = hello_from_checkpoint(REFERENCE, window=64, max_slots=4, client_name="engine-a")
    cfg = json.loads((REFERENCE / "config.json").read_text())
    assert (h.num_spec, h.vocab_size, h.n_taps, h.hidden) == (
        cfg["block_size"], cfg["vocab_size"], len(cfg["target_layer_ids"]),
        cfg["target_hidden_size"])
    assert h.row_bytes == h.n_taps * h.hidden * 2
    assert (h.drafter_identity, h.markov_identity) == identities_from_checkpoint(REFERENCE)
    # Default budget: every slot's resync in one STEP (W x max_slots, up to 4096).
    assert h.window == 64 and h.max_slots == 4 and h.max_rows_per_step == 64 * 4
    assert h.sample_mode == wire.SAMPLE_GREEDY and h.client_name == "engine-a"
    assert hello_from_checkpoint(REFERENCE, window=8, max_slots=4,
                                 sampled=True).sample_mode == wire.SAMPLE_TOP32


def test_aliases_and_a_missing_field(tmp_path: Path) -> None:
    ckpt = tmp_path / "d"
    shutil.copytree(REFERENCE, ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["dspark_block_size"] = cfg.pop("block_size")
    cfg["dflash_config"] = {"target_layer_ids": cfg.pop("target_layer_ids")}
    (ckpt / "config.json").write_text(json.dumps(cfg))
    h = hello_from_checkpoint(ckpt, window=16, max_slots=2)
    assert h.num_spec == cfg["dspark_block_size"] and h.n_taps == 3
    del cfg["vocab_size"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="vocab_size"):
        hello_from_checkpoint(ckpt, window=16, max_slots=2)


def test_draft_topk_enters_the_markov_identity(tmp_path: Path) -> None:
    """The candidate walk (dspark_draft_topk) drafts other tokens: the HELLO names it through
    the Markov identity, from the checkpoint's config or the engine's own setting."""
    ckpt = tmp_path / "d"
    shutil.copytree(REFERENCE, ckpt)
    plain = identities_from_checkpoint(REFERENCE)[1]
    walk = markov_walk_identity(plain, 64)
    assert walk != plain and markov_walk_identity(plain, 0) == plain
    assert hello_from_checkpoint(ckpt, window=8, max_slots=1, draft_topk=64).markov_identity \
        == walk
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["dspark_draft_topk"] = 64
    (ckpt / "config.json").write_text(json.dumps(cfg))
    assert hello_from_checkpoint(ckpt, window=8, max_slots=1).markov_identity == walk
    assert hello_from_checkpoint(ckpt, window=8, max_slots=1, draft_topk=0).markov_identity \
        == plain


def test_the_targets_hidden_size_is_taken_only_where_the_config_names_none(
        tmp_path: Path) -> None:
    """``target_hidden_size`` fills in for a config without one; a config that names its own
    keeps it (the caller then sees the two disagree), and with neither it is refused."""
    cfg = json.loads((REFERENCE / "config.json").read_text())
    ids = (bytes(32), bytes(32))
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    h = hello_from_checkpoint(tmp_path, window=8, max_slots=1, identities=ids,
                              target_hidden_size=4096)
    assert h.hidden == cfg["target_hidden_size"] != 4096
    del cfg["target_hidden_size"], cfg["hidden_size"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    h = hello_from_checkpoint(tmp_path, window=8, max_slots=1, identities=ids,
                              target_hidden_size=4096)
    assert h.hidden == 4096 and h.row_bytes == h.n_taps * 4096 * 2
    with pytest.raises(ValueError, match="none of target_hidden_size, hidden_size is set"):
        hello_from_checkpoint(tmp_path, window=8, max_slots=1, identities=ids)


def test_a_drafter_without_embeddings_and_no_target_is_a_plain_value_error(
        tmp_path: Path) -> None:
    """The drafter lacks embed_tokens and no target_checkpoint was passed: a missing argument,
    said as a ValueError naming it, not the error type of a broken safetensors file."""
    import struct

    shutil.copy(REFERENCE / "config.json", tmp_path / "config.json")
    header = json.dumps({"norm.weight": {"dtype": "F32", "shape": [2],
                                         "data_offsets": [0, 8]}}).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header
                                                 + bytes(8))
    with pytest.raises(ValueError) as info:
        hello_from_checkpoint(tmp_path, window=16, max_slots=2)
    assert type(info.value) is ValueError
    assert "has no embed_tokens.weight and no target checkpoint was given" in str(info.value)
    assert "target_checkpoint=" in str(info.value)
