"""Shared pieces for the drafter tests: a tiny config, drafters over random weights, tap rows.

A module with its own name (not conftest) so that test files import it unambiguously."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from dspark_worker.drafter import (
    Drafter,
    DrafterConfig,
    encode_bf16_rows,
    from_tensors,
    random_tensors,
)

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


def make_rows(rng: np.random.Generator, n: int, config: DrafterConfig = TINY) -> np.ndarray:
    """n random tap rows as wire bytes, uint8 [n, row_bytes]."""
    values = rng.standard_normal((n, config.tap_width)).astype(np.float32) * 2.0
    return encode_bf16_rows(values)
