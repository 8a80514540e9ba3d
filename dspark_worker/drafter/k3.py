"""The Kimi-K3 family: ``Inferact/Kimi-K3-DSpark`` and drafters of its layout (vLLM's
``K3DSparkModel``; docs/architecture.md, "Model families").

A DSpark drafter whose layers are DeepSeek-V3 MLA: a q-LoRA query, a 512-wide compressed K/V
latent and a 64-wide RoPE key shared by every head, interleaved RoPE with DeepSeek-YaRN, dense
SwiGLU MLPs, the shared Markov and confidence heads and the target's embedding and head. What
differs from the Qwen3 family:

- config.json: ``model_type`` ``k3_dspark`` (a DeepSeek-V3 config plus DSpark keys);
  ``num_target_layers`` is the number of taps (the target's depth is
  ``target_num_hidden_layers``); the confidence head's two flags default to false; a
  ``sample_from_anchor`` false drafts from rows 1..N of an N + 1 row block (N = block_size
  in both modes); ``logit_scale`` multiplies the base logits and the Markov bias. Options that
  make another model are refused by name (:data:`REFUSED`).
- tensors: ``context_proj`` / ``context_norm`` / ``final_norm`` (Qwen3's ``fc`` /
  ``hidden_norm`` / ``norm``); the embedding and the head are always the target's (the
  drafter's frozen ``embed_tokens`` copy is never read, ``protocol.formats``).
- the ring holds the **latent**: per layer and position ``[c_kv ; k_pe]``, the RMS-normed
  latent (``kv_a_layernorm`` over the latent only) and the RoPE'd shared key, kv_lora + rope
  values (1,152 bytes in bf16 for 512 + 64). In ring terms: one plane (K and V share it), one
  "KV head", head_dim kv_lora + rope; V is its first kv_lora values.
- attention with ``kv_b_proj`` absorbed: per head ``q_lat = q_nope W_UK[h]``, scores
  ``(q_lat . c_kv + q_pe . k_pe) * scale`` over ring and block latents, ``o = (sum p c_kv)
  W_UV[h]^T``: the expanded per-head K/V of DeepSeek-V3, up to rounding, never built. No mask
  inside the block; the block's own latents are never stored.
- RoPE: interleaved pairs (x[2i], x[2i+1]), fp32 angles and math; with ``yarn`` the
  DeepSeek-YaRN frequencies, cos/sin times m(f, mscale) / m(f, mscale_all_dim) and the
  softmax scale times m(f, mscale_all_dim)^2.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from protocol import formats

from .config import ConfigReader, DrafterConfig, DrafterConfigError, temperatures
from .limits import MAX_SCALE
from .model import (
    MLP,
    ConfidenceHead,
    ContextSource,
    DraftModel,
    MarkovHead,
    RMSNorm,
    _embedding,
    attend,
    context_bias,
    head_shapes,
)
from .speculators import yarn_frequencies, yarn_mscale

MODEL_TYPES = formats.K3_MODEL_TYPES
ARCHITECTURES = formats.K3_ARCHITECTURES
ROPE_TYPES = ("default", "yarn")
DEFAULT_ROPE_THETA = 50000.0  # vLLM's K3 config when no RoPE key is set (not transformers' 1e4)
# Options that would make another model than vLLM's K3DSparkModel drafts, refused when true:
# (key, what it is).
REFUSED: tuple[tuple[str, str], ...] = (
    ("mla_use_nope", "NoPE MLA, another model (NeMo's K3 draft variant); vLLM refuses it too"),
    ("mla_use_output_gate", "an MLA output gate, which vLLM's K3 drafter refuses"),
    ("mla_use_qk_norm", "MLA q/k norms, which vLLM's K3 drafter refuses"),
    ("dspark_bonus_anchor", "the anchor as a bonus token, which vLLM's K3 drafter refuses"),
    ("attention_bias", "attention biases (vLLM's K3 layers have none)"),
    ("is_causal", "a causal block: a causally trained drafter is another model"),
    ("dflash_config.causal", "a causal block: a causally trained drafter is another model"),
    ("fc_norm", "per-tap norms (TokenSpeed's layout, absent from vLLM's K3 drafter)"),
)


@dataclass(frozen=True)
class K3Config(DrafterConfig):
    """A K3 DSpark drafter's config. ``num_key_value_heads`` (1) and ``head_dim`` (kv_lora +
    rope) are the latent ring's geometry, not the attention's: H heads of qk head
    ``qk_nope_head_dim + qk_rope_head_dim`` and v head ``v_head_dim``.
    ``num_target_layers`` holds ``target_num_hidden_layers`` (the target's depth) where set."""

    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_type: str = "default"
    rope_factor: float = 1.0
    rope_original_max: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    sample_from_anchor: bool = True
    logit_scale: float = 1.0

    @property
    def lead_rows(self) -> int:
        """The anchor's row drafts nothing when ``sample_from_anchor`` is false."""
        return 0 if self.sample_from_anchor else 1

    @property
    def num_spec(self) -> int:
        """N = block_size in both anchor modes (vLLM's ``num_speculative_tokens``)."""
        return self.block_size

    @property
    def latent_width(self) -> int:
        """Values per layer and position in the ring: the latent and the shared RoPE key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        scale = float((self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5)
        if self.rope_type == "yarn":
            scale *= yarn_mscale(self.rope_factor, self.mscale_all_dim) ** 2
        return scale

    @property
    def rope_cos_factor(self) -> float:
        """The factor cos and sin are multiplied by (1 without YaRN)."""
        if self.rope_type != "yarn":
            return 1.0
        return (yarn_mscale(self.rope_factor, self.mscale)
                / yarn_mscale(self.rope_factor, self.mscale_all_dim))

    def to_json_dict(self) -> dict[str, Any]:
        """config.json in the released drafter's layout."""
        rope: dict[str, Any] = {"rope_type": self.rope_type, "rope_theta": self.rope_theta}
        if self.rope_type == "yarn":
            rope.update(factor=self.rope_factor,
                        original_max_position_embeddings=self.rope_original_max,
                        beta_fast=self.beta_fast, beta_slow=self.beta_slow,
                        mscale=self.mscale, mscale_all_dim=self.mscale_all_dim)
        out: dict[str, Any] = {
            "architectures": list(ARCHITECTURES),
            "model_type": MODEL_TYPES[0],
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_attention_heads,
            "q_lora_rank": self.q_lora_rank,
            "kv_lora_rank": self.kv_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "vocab_size": self.vocab_size,
            "rope_parameters": rope,
            "attention_bias": False,
            "n_routed_experts": 0,
            "target_hidden_size": self.target_hidden_size,
            "num_target_layers": self.n_taps,
            "target_layer_ids": list(self.target_layer_ids),
            "block_size": self.block_size,
            "mask_token_id": self.mask_token_id,
            "markov_rank": self.markov_rank,
            "markov_head_type": self.markov_head_type,
            "enable_confidence_head": self.enable_confidence_head,
            "confidence_head_with_markov": self.confidence_head_with_markov,
            "sample_from_anchor": self.sample_from_anchor,
            "logit_scale": self.logit_scale,
        }
        if self.num_target_layers is not None:
            out["target_num_hidden_layers"] = self.num_target_layers
        if self.confidence_temperatures is not None:
            out["confidence_temperatures"] = list(self.confidence_temperatures)
        return out

    def validated(self, source: str = "config") -> K3Config:
        def fail(field: str, value: object, why: str, limit: object = None) -> None:
            raise DrafterConfigError(f"{source}: {field} {value!r} {why}", field=field,
                                     value=value, limit=limit)

        for name in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                     "v_head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                fail(name, value, "must be a positive integer")
        if self.qk_rope_head_dim % 2:
            fail("qk_rope_head_dim", self.qk_rope_head_dim,
                 "must be even (interleaved RoPE rotates pairs)")
        super().validated(source)
        scale = self.logit_scale
        if not (math.isfinite(scale) and 0 < scale <= MAX_SCALE):
            fail("logit_scale", scale, f"must be a number in (0, {MAX_SCALE:g}]", MAX_SCALE)
        if self.rope_type == "yarn":
            where = "rope_parameters"
            if not (math.isfinite(self.rope_factor) and self.rope_factor > 0):
                fail(f"{where}.factor", self.rope_factor, "must be a positive finite number")
            if self.rope_original_max <= 0:
                fail(f"{where}.original_max_position_embeddings", self.rope_original_max,
                     "must be a positive integer")
            for name in ("beta_fast", "beta_slow"):
                value = getattr(self, name)
                if not (math.isfinite(value) and value > 0):
                    fail(f"{where}.{name}", value, "must be a positive finite number")
            for name in ("mscale", "mscale_all_dim"):
                value = getattr(self, name)
                if not (math.isfinite(value) and 0 <= value <= MAX_SCALE):
                    fail(f"{where}.{name}", value, f"must be a number in [0, {MAX_SCALE:g}]",
                         MAX_SCALE)
        return self


def parse_k3_config(raw: Mapping[str, Any], source: str = "config.json") -> K3Config:
    """A validated :class:`K3Config` from a parsed ``k3_dspark`` config.json; every option
    vLLM's K3DSparkModel does not serve as this family computes it is refused by name."""
    r = ConfigReader(raw, source)

    def refuse(field: str, value: object, why: str) -> DrafterConfigError:
        return DrafterConfigError(f"{source}: {field} {value!r} is not served ({why})",
                                  field=field, value=value)

    for name, what in REFUSED:
        value = r.get(name, default=None)
        if value is not None and value is not False:
            raise refuse(name, value, what)
    if raw.get("q_lora_rank") is None:
        raise refuse("q_lora_rank", None, "a full-rank query; vLLM's K3 config requires q-LoRA")
    experts = r.get("n_routed_experts", default=None)
    if experts is not None and experts != 0:
        raise refuse("n_routed_experts", experts, "MoE draft layers; the K3 drafter's MLPs are"
                     " dense")
    act = r.get("hidden_act", default="silu")
    if act != "silu":
        raise refuse("hidden_act", act, "the K3 drafter's MLP is SiLU-gated; only 'silu'")
    kind = r.str_("markov_head_type", default="vanilla").lower()
    if kind != "vanilla":
        raise refuse("markov_head_type", kind, "vLLM's K3 drafter has the vanilla Markov head"
                     " only")
    topk = r.get("dspark_draft_topk", default=None)
    if topk is not None and topk != 0:
        raise refuse("dspark_draft_topk", topk, "vLLM's candidate walk is the Qwen3 DSpark"
                     " drafter's; a K3 drafter walks the whole vocabulary")
    vocab = r.int_("vocab_size")
    draft_vocab = r.get("draft_vocab_size", default=None)
    if draft_vocab is not None and draft_vocab != vocab:
        raise refuse("draft_vocab_size", draft_vocab, f"a reduced vocabulary; the K3 drafter"
                     f" drafts over the target's vocab_size {vocab}")
    taps = tuple(r.int_list("target_layer_ids", aliases=(
        "dflash_config.target_layer_ids", "dspark_target_layer_ids")))
    if not taps:
        raise refuse("target_layer_ids", [], "no taps; a K3 drafter reads 1 or more target"
                     " layers")
    n_taps = r.int_("num_target_layers", default=None)
    if n_taps is not None and n_taps != len(taps):
        raise refuse("num_target_layers", n_taps, f"it counts the taps in a K3 config and"
                     f" target_layer_ids {list(taps)} has {len(taps)}; the target's depth is"
                     " target_num_hidden_layers")
    rope = _rope(r, source)
    hidden = r.int_("hidden_size")
    kv_lora, rope_dim = r.int_("kv_lora_rank"), r.int_("qk_rope_head_dim")
    config = K3Config(
        hidden_size=hidden,
        num_hidden_layers=r.int_("num_hidden_layers"),
        num_attention_heads=r.int_("num_attention_heads"),
        num_key_value_heads=1,  # the latent ring: one shared "head"
        head_dim=kv_lora + rope_dim,
        intermediate_size=r.int_("intermediate_size"),
        vocab_size=vocab,
        rms_norm_eps=r.float_("rms_norm_eps", default=1e-6),
        rope_theta=cast(float, rope["rope_theta"]),
        target_layer_ids=taps,
        block_size=r.int_("block_size", aliases=("dspark_block_size",)),
        mask_token_id=r.int_("mask_token_id", aliases=(
            "dflash_config.mask_token_id", "dspark_noise_token_id")),
        markov_rank=r.int_("markov_rank", aliases=("dspark_markov_rank",), default=0),
        markov_head_type=kind,
        enable_confidence_head=r.bool_("enable_confidence_head", default=False),
        confidence_head_with_markov=r.bool_("confidence_head_with_markov", default=False),
        target_hidden_size=r.int_("target_hidden_size", default=hidden),
        num_target_layers=r.int_("target_num_hidden_layers", default=None),
        confidence_temperatures=temperatures(r.get("confidence_temperatures", default=None),
                                             source),
        q_lora_rank=r.int_("q_lora_rank"),
        kv_lora_rank=kv_lora,
        qk_nope_head_dim=r.int_("qk_nope_head_dim"),
        qk_rope_head_dim=rope_dim,
        v_head_dim=r.int_("v_head_dim"),
        sample_from_anchor=r.bool_("sample_from_anchor", default=True),
        logit_scale=r.float_("logit_scale", default=1.0),
        **{k: v for k, v in rope.items() if k != "rope_theta"},
    )
    return config.validated(source)


def _rope(r: ConfigReader, source: str) -> dict[str, Any]:
    """The RoPE fields: ``rope_parameters`` (``rope_scaling`` the older spelling), default at
    θ 5e4 when absent; ``yarn`` with its factor, original length, betas and mscales."""
    params = r.get("rope_parameters", aliases=("rope_scaling",), default=None)
    theta = r.float_("rope_theta", nested=("rope_parameters", "rope_theta"),
                     default=DEFAULT_ROPE_THETA)
    if params is None:
        return {"rope_theta": theta}
    if not isinstance(params, Mapping):
        raise DrafterConfigError(f"{source}: rope_parameters {params!r} is not an object",
                                 field="rope_parameters", value=params)
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise DrafterConfigError(
            f"{source}: rope_parameters.rope_type {kind!r} is not served (only"
            f" {list(ROPE_TYPES)}; vLLM's K3 drafter turns any other type into DeepSeek-YaRN)",
            field="rope_parameters.rope_type", value=kind)
    if params.get("attention_factor") is not None:
        value = params["attention_factor"]
        raise DrafterConfigError(
            f"{source}: rope_parameters.attention_factor {value!r} is not served (vLLM then"
            " drops the mscale² softmax factor and transformers scales cos/sin by it: no"
            " reading of it is safe)", field="rope_parameters.attention_factor", value=value)
    if kind == "default":
        return {"rope_theta": theta}
    sub = ConfigReader(params, f"{source}: rope_parameters")
    return {
        "rope_theta": theta,
        "rope_type": "yarn",
        "rope_factor": sub.float_("factor"),
        "rope_original_max": sub.int_("original_max_position_embeddings"),
        "beta_fast": sub.float_("beta_fast", default=32.0),
        "beta_slow": sub.float_("beta_slow", default=1.0),
        "mscale": sub.float_("mscale", default=1.0),
        "mscale_all_dim": sub.float_("mscale_all_dim", default=0.0),
    }


def k3_shapes(c: DrafterConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the K3 layout with its shape; ``embed_tokens`` and ``lm_head`` are the
    target's (the drafter's shipped embedding copy is never read)."""
    k = _k3(c)
    d, heads, i_size = k.hidden_size, k.num_attention_heads, k.intermediate_size
    qk = k.qk_nope_head_dim + k.qk_rope_head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "embed_tokens.weight": (k.vocab_size, d),
        "lm_head.weight": (k.vocab_size, d),
        "context_proj.weight": (d, k.tap_width),
        "context_norm.weight": (d,),
        "final_norm.weight": (d,),
    }
    for i in range(k.num_hidden_layers):
        p = f"layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (d,),
            p + "post_attention_layernorm.weight": (d,),
            p + "self_attn.q_a_proj.weight": (k.q_lora_rank, d),
            p + "self_attn.q_a_layernorm.weight": (k.q_lora_rank,),
            p + "self_attn.q_b_proj.weight": (heads * qk, k.q_lora_rank),
            p + "self_attn.kv_a_proj_with_mqa.weight": (k.latent_width, d),
            p + "self_attn.kv_a_layernorm.weight": (k.kv_lora_rank,),
            p + "self_attn.kv_b_proj.weight": (heads * (k.qk_nope_head_dim + k.v_head_dim),
                                               k.kv_lora_rank),
            p + "self_attn.o_proj.weight": (d, heads * k.v_head_dim),
            p + "mlp.gate_proj.weight": (i_size, d),
            p + "mlp.up_proj.weight": (i_size, d),
            p + "mlp.down_proj.weight": (d, i_size),
        })
    shapes.update(head_shapes(k))
    return shapes


def _k3(config: DrafterConfig) -> K3Config:
    if not isinstance(config, K3Config):
        raise TypeError(f"a K3 drafter needs a K3Config, not {type(config).__name__}")
    return config


# -- the network ------------------------------------------------------------------------------


class MLAAttention(nn.Module):
    """DeepSeek-V3 MLA projections under the checkpoint's names (no biases)."""

    def __init__(self, c: K3Config) -> None:
        super().__init__()
        d, heads, eps = c.hidden_size, c.num_attention_heads, c.rms_norm_eps
        self.q_a_proj = nn.Linear(d, c.q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(c.q_lora_rank, eps)
        self.q_b_proj = nn.Linear(c.q_lora_rank,
                                  heads * (c.qk_nope_head_dim + c.qk_rope_head_dim), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, c.latent_width, bias=False)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, eps)
        self.kv_b_proj = nn.Linear(c.kv_lora_rank, heads * (c.qk_nope_head_dim + c.v_head_dim),
                                   bias=False)
        self.o_proj = nn.Linear(heads * c.v_head_dim, d, bias=False)


class K3DecoderLayer(nn.Module):
    def __init__(self, c: K3Config) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = MLAAttention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)


class ScaledMarkovHead(MarkovHead):
    """The vanilla Markov head whose bias is multiplied by ``logit_scale`` (vLLM applies the
    logits processor, and its scale, to the base logits and the bias alike)."""

    def __init__(self, c: K3Config) -> None:
        super().__init__(c)
        self.scale = c.logit_scale

    def step(self, prev: Tensor, hf_j: Tensor, state: Tensor | None
             ) -> tuple[Tensor, Tensor, Tensor | None]:
        e, bias, state = super().step(prev, hf_j, state)
        return e, bias * self.scale, state

    def bias_at(self, x: Tensor, ids: Tensor) -> Tensor:
        return super().bias_at(x, ids) * self.scale


def rms_latent(kv: Tensor, weight: Tensor, eps: float, cos: Tensor, sin: Tensor,
               kv_lora: int) -> Tensor:
    """``[kv_a_layernorm(kv[:kv_lora]) ; rope(kv[kv_lora:])]``: what the ring stores for a
    projected row kv [..., kv_lora + rope]. ``weight`` broadcasts over the latent (one
    layer's, or [L, kv_lora] for rows of every layer); cos, sin broadcast over the pairs."""
    latent, k_pe = kv[..., :kv_lora], kv[..., kv_lora:]
    x32 = latent.float()
    normed = weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(kv.dtype)
    return torch.cat([normed, rope_pairs(k_pe, cos, sin)], dim=-1)


def rope_pairs(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Interleaved RoPE on x [..., rope] in fp32: pair (x[2i], x[2i+1]) turns by angle i
    (cos, sin [..., rope / 2] broadcasting over x's pairs), cast back to x's dtype."""
    pairs = x.float().reshape(*x.shape[:-1], -1, 2)  # [..., rope/2, 2]
    even, odd = pairs[..., 0], pairs[..., 1]
    out = torch.stack([even * cos - odd * sin, odd * cos + even * sin], dim=-1)
    return out.flatten(-2).to(x.dtype)


class K3DrafterModel(DraftModel):
    """The K3 family's weights and forward pieces (see the module docstring)."""

    config: K3Config
    ring_planes = 1  # K and V are one latent
    _fused: tuple[Tensor, Tensor]  # project_context_kv's weights, rebuilt when they change
    _fused_key: tuple[tuple[int, int], ...] | None = None

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        c = _k3(config)
        self.config = c
        self.embed_tokens = _embedding(c.vocab_size, c.hidden_size)
        self.context_proj = nn.Linear(c.tap_width, c.hidden_size, bias=False)
        self.context_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.layers = nn.ModuleList(K3DecoderLayer(c) for _ in range(c.num_hidden_layers))
        self.final_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        self.markov_head = (None if not c.has_markov_head else MarkovHead(c)
                            if c.logit_scale == 1.0 else ScaledMarkovHead(c))
        self.confidence_head = ConfidenceHead(c) if c.enable_confidence_head else None
        self.scaling = c.softmax_scale
        self.attention_scaling = c.rope_cos_factor  # cos and sin factor
        self.init_buffers()

    @property
    def fc(self) -> nn.Linear:
        """The context projection under the name the rings and the drafter read."""
        return self.context_proj

    @fc.setter
    def fc(self, value: nn.Linear) -> None:
        self.context_proj = value

    @property
    def decoder_layers(self) -> list[K3DecoderLayer]:
        return [cast(K3DecoderLayer, layer) for layer in self.layers]

    def inv_freq_values(self, device: torch.device) -> Tensor:
        c = self.config
        dim = c.qk_rope_head_dim
        if c.rope_type == "yarn":
            return yarn_frequencies(c.rope_theta, dim, c.rope_factor, c.rope_original_max,
                                    c.beta_fast, c.beta_slow, True, device)
        exponent = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float()
        inv_freq: Tensor = 1.0 / (c.rope_theta ** (exponent / dim))  # [rope/2]
        return inv_freq

    def rope(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos, sin [..., rope / 2] in fp32 (the pairs' angles), YaRN's factor applied."""
        angles = positions.float().unsqueeze(-1) * self.inv_freq  # [..., rope/2]
        cos, sin = angles.cos(), angles.sin()
        if self.attention_scaling != 1.0:
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        return cos, sin

    # -- ingest -------------------------------------------------------------------------------
    def project_context_kv(self, taps: Tensor, positions: Tensor) -> Tensor:
        """Tap rows -> every layer's latent ``[c_kv ; k_pe]``: [1, L, R, 1, kv_lora + rope]
        (one ring plane, one "head"). Every layer's ``kv_a_proj_with_mqa`` runs as one matmul
        over weights concatenated once; no input_layernorm on context rows."""
        c = self.config
        r, n_layers = taps.shape[0], c.num_hidden_layers
        w_kv, norms = self._fused_context_weights()  # [L*(kv_lora+rope), d], [L, kv_lora]
        with torch.no_grad():
            ctx = self.context_norm(self.context_proj(taps))  # [R, d]
            kv = F.linear(ctx, w_kv).view(r, n_layers, c.latent_width)  # [R, L, kvl+rope]
            cos, sin = self.rope(positions)  # [R, rope/2]
            latent = rms_latent(kv, norms, c.rms_norm_eps, cos.unsqueeze(1), sin.unsqueeze(1),
                                c.kv_lora_rank)  # [R, L, kvl+rope]
            out = latent.transpose(0, 1).reshape(1, n_layers, r, 1, c.latent_width)
            return torch.nan_to_num_(out, nan=0.0, posinf=0.0, neginf=0.0)

    def _fused_context_weights(self) -> tuple[Tensor, Tensor]:
        layers = [layer.self_attn for layer in self.decoder_layers]
        params = [p for a in layers for p in (a.kv_a_proj_with_mqa.weight,
                                              a.kv_a_layernorm.weight)]
        key = tuple((p.data_ptr(), p._version) for p in params)
        if self._fused_key != key:
            with torch.no_grad():
                w_kv = torch.cat([a.kv_a_proj_with_mqa.weight for a in layers])
                norms = torch.stack([a.kv_a_layernorm.weight for a in layers])  # [L, kvl]
            self._fused = (w_kv, norms)
            self._fused_key = key
        return self._fused

    # -- one block ----------------------------------------------------------------------------
    def backbone(self, block_ids: Tensor, block_pos: Tensor, context: ContextSource) -> Tensor:
        """hf [B, N, d] for block_ids, block_pos [B, N]; ``context.layer(l)`` gives layer l's
        ring latents [B, 1, S, kv_lora + rope] (both of the pair: one plane)."""
        c = self.config
        b, n = block_ids.shape
        heads, nope, kvl = c.num_attention_heads, c.qk_nope_head_dim, c.kv_lora_rank
        h = self.embed_tokens(block_ids)  # [B, N, d]
        cos, sin = self.rope(block_pos)  # [B, N, rope/2]
        ctx_bias = context_bias(context.valid)  # [B, 1, 1, S]
        for index, layer in enumerate(self.decoder_layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)  # [B, N, d]
            q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x)))  # [B, N, H*(nope+rope)]
            q = q.view(b, n, heads, -1).transpose(1, 2)  # [B, H, N, nope+rope]
            q_pe = rope_pairs(q[..., nope:], cos.unsqueeze(1), sin.unsqueeze(1))
            w_kv = attn.kv_b_proj.weight.view(heads, nope + c.v_head_dim, kvl)
            w_uk, w_uv = w_kv[:, :nope], w_kv[:, nope:]  # [H, nope, kvl], [H, v, kvl]
            q_lat = torch.matmul(q[..., :nope], w_uk.unsqueeze(0))  # [B, H, N, kvl]
            # Every head reads one latent: the heads side by side as one group over one "head".
            q_all = torch.cat([q_lat, q_pe], dim=-1).reshape(b, 1, heads * n, -1)
            own = rms_latent(attn.kv_a_proj_with_mqa(x), attn.kv_a_layernorm.weight,
                             c.rms_norm_eps, cos, sin, kvl).unsqueeze(1)  # [B, 1, N, kvl+rope]
            ring = context.layer(index)[0]  # [B, 1, S, kvl+rope]
            out = attend(q_all, own, own[..., :kvl], ring, ring[..., :kvl], ctx_bias,
                         self.scaling)  # [B, 1, H*N, kvl]
            out = torch.matmul(out.view(b, heads, n, kvl), w_uv.transpose(1, 2).unsqueeze(0))
            out = out.transpose(1, 2).reshape(b, n, heads * c.v_head_dim)  # [B, N, H*v]
            h = h + attn.o_proj(out)  # [B, N, d]
            h = h + layer.mlp(layer.post_attention_layernorm(h))  # [B, N, d]
        hf: Tensor = self.final_norm(h)  # [B, N, d]
        return hf

    def finish_logits(self, head: Tensor) -> Tensor:
        """U = logit_scale * lm_head(hf), fp32."""
        out = head.float()
        scale = self.config.logit_scale
        return out if scale == 1.0 else out * scale
