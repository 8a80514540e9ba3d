"""A Kimi-K3 DSpark drafter under the plugin's config check, with vLLM 0.34's own config classes:
a K3-shaped target (DeepSeek-V3 MLA text geometry: the K3 language model's; vLLM's
``KimiK3ForConditionalGeneration`` wrapper itself cannot be inspected on this CPU build) takes
the drafter's block in both anchor modes and its taps as aux layers, and a target of another
width or depth is refused naming both sides."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from vllm_engine import model_config, speculative_config

DRAFTERS = Path(__file__).resolve().parents[1] / "worker" / "drafter" / "data" / "k3_tiny"


def k3_target(root: Path, *, hidden: int = 64, layers: int = 6, vocab: int = 300) -> Any:
    """A K3-shaped target's config.json: MLA (q-LoRA, latent 16 + RoPE 8), MoE after the
    first layer, as the K3 text model is laid out (no weights: vLLM reads none for configs)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps({
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": 2 * hidden,
        "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 4,
        "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
        "v_head_dim": 16, "max_position_embeddings": 4096, "n_routed_experts": 4,
        "num_experts_per_tok": 2, "moe_intermediate_size": 32, "first_k_dense_replace": 1,
        "torch_dtype": "bfloat16", "tie_word_embeddings": False}))
    return model_config(root)


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    return k3_target(tmp_path_factory.mktemp("k3_target"))


def test_a_k3_drafter_for_a_k3_shaped_target(target: Any, tmp_path: Path) -> None:
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import (
        get_eagle3_aux_layers_from_config,
    )

    from dspark_vllm.config import RemoteDSparkSpeculatorConfig

    assert target.is_deepseek_mla and target.get_total_num_hidden_layers() == 6
    spec = speculative_config(target, DRAFTERS / "k3_yarn32_n7",
                              speculator_options={"endpoint": "tcp://127.0.0.1:1"})
    assert isinstance(spec.speculator_config, RemoteDSparkSpeculatorConfig)
    assert spec.num_speculative_tokens == 7  # block_size
    assert get_eagle3_aux_layers_from_config(spec) == (2, 4, 5)  # taps 1, 3, 4
    # sample_from_anchor false: N + 1 rows on the worker, still N = block_size drafts
    lead = tmp_path / "lead"
    shutil.copytree(DRAFTERS / "k3_yarn32_n7", lead)
    cfg = json.loads((lead / "config.json").read_text())
    (lead / "config.json").write_text(json.dumps({**cfg, "sample_from_anchor": False}))
    assert speculative_config(target, lead).num_speculative_tokens == 7


def test_a_k3_drafter_for_another_target_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="hidden size 64; the served model's is 128"):
        speculative_config(k3_target(tmp_path / "wide", hidden=128), DRAFTERS / "k3_yarn32_n7")
    with pytest.raises(ValueError, match=r"tap layers \[1, 3, 4\] must be distinct and in"
                                         r" \[-1, 4\)"):
        speculative_config(k3_target(tmp_path / "shallow", layers=4),
                           DRAFTERS / "k3_yarn32_n7")
    with pytest.raises(ValueError, match="vocabulary is 300 tokens, the served model's 400"):
        speculative_config(k3_target(tmp_path / "vocab", vocab=400), DRAFTERS / "k3_yarn32_n7")
