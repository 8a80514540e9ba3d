"""The embedded default drafter and random weights (DRAFTER.md "A reference pair").

The embedded default lets the worker run with no checkpoint: a tiny Qwen3-layout config built in
code and weights generated from a fixed seed. The weights come from SplitMix64 over each
tensor's element index in numpy integer arithmetic, scaled with exact float64 operations and
rounded once to fp32, so they are the same bytes on every machine and every numpy or torch
version (a torch.Generator stream is only promised per torch version); the identities then
never move. :func:`init_random_` is the fast variant for large benchmark shapes (torch
generator on the device; deterministic per torch version and device only).
"""

from __future__ import annotations

import hashlib
import math

import numpy as np
import numpy.typing as npt
import torch

from .config import DrafterConfig
from .families import expected_shapes
from .model import DraftModel

EMBEDDED_SEED = 0x4453_5041_524B  # "DSPARK"
EMBEDDED_CONFIG = DrafterConfig(
    hidden_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    intermediate_size=384,
    vocab_size=512,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    target_layer_ids=(1, 3, 5),
    block_size=7,
    mask_token_id=511,
    markov_rank=32,
    markov_head_type="vanilla",
    enable_confidence_head=True,
    confidence_head_with_markov=True,
    target_hidden_size=128,
    num_target_layers=8,
).validated("embedded default")

_U64 = np.uint64
_GOLDEN = _U64(0x9E3779B97F4A7C15)
_MIX1 = _U64(0xBF58476D1CE4E5B9)
_MIX2 = _U64(0x94D049BB133111EB)
_UNIFORM_BITS = 24


def _uniform(key: int, count: int) -> npt.NDArray[np.float64]:
    """count values in [-1, 1), SplitMix64 of (key, index), 24 bits each (exact in float64)."""
    index = np.arange(count, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = _U64(key) + (index + _U64(1)) * _GOLDEN
        z = (z ^ (z >> _U64(30))) * _MIX1
        z = (z ^ (z >> _U64(27))) * _MIX2
        z = z ^ (z >> _U64(31))
    top = (z >> _U64(64 - _UNIFORM_BITS)).astype(np.float64)
    return top / float(1 << (_UNIFORM_BITS - 1)) - 1.0


def weight_scale(name: str, shape: tuple[int, ...], config: DrafterConfig) -> tuple[float, float]:
    """(offset, half-width) of the uniform init of one tensor: norms near 1, biases small,
    matrices with unit-variance outputs, logits and Markov bias a few units wide so that drafts
    depend on the context and on the Markov head."""
    if name.endswith("norm.weight") or name.endswith(".layer_scalar"):
        return 1.0, 0.2
    if name.endswith(".bias"):
        return 0.0, 0.1
    unit = math.sqrt(3.0)  # a uniform in [-sqrt 3, sqrt 3) has variance 1
    if name in ("embed_tokens.weight", "markov_head.markov_w1.weight"):
        return 0.0, unit
    fan_in = shape[-1]
    gain = 3.0 if name in ("lm_head.weight", "markov_head.markov_w2.weight") else 1.0
    return 0.0, gain * unit / math.sqrt(fan_in)


def vocab_map(config: DrafterConfig, seed: int) -> dict[str, torch.Tensor]:
    """A reduced vocabulary's ``t2d`` [V] bool and ``d2t`` [Vd] int64 for a seeded subset of
    the target ids (speculators' layout: target id = d + d2t[d], increasing); empty on a full
    vocabulary."""
    v, vd = config.vocab_size, config.draft_vocab
    if vd == v:
        return {}
    key = int.from_bytes(hashlib.sha256(f"{seed}:vocab".encode()).digest()[:8], "little")
    ids = np.sort(np.argsort(_uniform(key, v), kind="stable")[:vd])  # [Vd] increasing
    t2d = np.zeros(v, dtype=np.bool_)
    t2d[ids] = True
    return {"t2d": torch.from_numpy(t2d), "d2t": torch.from_numpy(ids - np.arange(vd))}


def random_tensors(config: DrafterConfig, seed: int) -> dict[str, torch.Tensor]:
    """Every tensor of ``config``'s checkpoint layout, fp32 on the CPU, machine-independent."""
    out: dict[str, torch.Tensor] = vocab_map(config, seed)
    for name, shape in expected_shapes(config).items():
        if name in out:
            continue
        digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
        key = int.from_bytes(digest[:8], "little")
        offset, half = weight_scale(name, shape, config)
        values = offset + half * _uniform(key, math.prod(shape))
        out[name] = torch.from_numpy(values.astype(np.float32).reshape(shape))
    return out


@torch.no_grad()
def init_random_(model: DraftModel, seed: int) -> None:
    """Fill every weight of ``model`` in place from a torch generator on its device."""
    device = model.fc.weight.device
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    for name, param in model.named_parameters():
        offset, half = weight_scale(name, tuple(param.shape), model.config)
        param.uniform_(-half, half, generator=gen).add_(offset)
    for name, t in vocab_map(model.config, seed).items():
        getattr(model, name).copy_(t)
