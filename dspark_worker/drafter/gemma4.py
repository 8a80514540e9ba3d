"""The Gemma4 family: the released ``dspark_gemma4_12b_block7`` drafter (docs/architecture.md,
"Model families"; the op-by-op definition is DeepSpec's ``Gemma4DSparkModel``).

What differs from the Qwen3 family, and nothing else:

- config.json: the draft copies the target's *text* config (``model_type``
  ``gemma4_unified_text``); the draft's head geometry is ``global_head_dim`` and
  ``num_global_key_value_heads`` (``head_dim`` and ``num_key_value_heads`` describe the target's
  sliding layers and are ignored); ``rope_parameters`` holds one entry per layer type
  (``full_attention`` is the one the draft uses) beside stray top-level keys.
- the token embedding is scaled by sqrt(d), the scale cast to the weight dtype first (62.0 in
  bf16 for d = 3840);
- ``attention_k_eq_v``: no ``v_proj``; V is the k_proj output RMS-normalised without a weight
  and without RoPE; K is ``rope(k_norm(k_proj(x)))`` as in Qwen3;
- attention scale 1.0; proportional partial RoPE (the first ``partial_rotary_factor * hd / 2``
  frequency pairs rotate with exponent denominator hd, the rest pass through);
- sandwich layers: ``h += post_attention_layernorm(attn(input_layernorm(h)))``,
  ``h += post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))``, ``h *= layer_scalar``
  (a saved [1] tensor); tanh-GELU MLP;
- RMSNorm multiplies by its weight in fp32 before the cast back (same math as Qwen3's);
- logits soft-capped, ``tanh(U / cap) * cap``, before the Markov bias is added.

The ring stores, per draft layer, K after k_norm and RoPE and V after its weightless norm: the
same [L, kv_heads, head_dim] per position as every family.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import ConfigReader, DrafterConfig, DrafterConfigError, temperatures
from .limits import MAX_SOFTCAP
from .model import (
    MLP,
    ConfidenceHead,
    ContextSource,
    DraftModel,
    MarkovHead,
    _embedding,
    attend,
    context_bias,
    expected_shapes,
    rotate_half,
)

MODEL_TYPES = ("gemma4_unified_text", "gemma4_text", "gemma4_unified", "gemma4")
ARCHITECTURES = ("Gemma4DSparkModel",)
ROPE_TYPES = ("proportional", "default")
HIDDEN_ACTIVATION = "gelu_pytorch_tanh"
# Options of the Gemma4 text config that change the draft's computation and that no released
# Gemma4 DSpark drafter uses: refused with the value we would need (None: must be absent/null).
UNSUPPORTED: tuple[tuple[str, object, str], ...] = (
    ("enable_moe_block", False, "the MoE block"),
    ("hidden_size_per_layer_input", 0, "per-layer inputs"),
    ("num_kv_shared_layers", 0, "KV sharing across layers"),
    ("use_double_wide_mlp", False, "the double-wide MLP"),
    ("attention_bias", False, "attention biases"),
    ("attn_logit_softcapping", None, "attention logit soft-capping"),
)


@dataclass(frozen=True)
class Gemma4Config(DrafterConfig):
    """A Gemma4 drafter's config. ``head_dim`` / ``num_key_value_heads`` hold the draft's
    (global) attention geometry: ``global_head_dim`` / ``num_global_key_value_heads``."""

    partial_rotary_factor: float = 1.0
    final_logit_softcapping: float | None = None

    @property
    def rotary_pairs(self) -> int:
        """Frequency pairs that rotate; the other ``head_dim / 2 - rotary_pairs`` pass through."""
        return int(self.partial_rotary_factor * self.head_dim // 2)

    def to_json_dict(self) -> dict[str, Any]:
        """config.json in the layout DeepSpec's ``save_pretrained`` writes (stray top-level
        ``rope_parameters`` keys included, as transformers 5.10 writes them)."""
        out: dict[str, Any] = {
            "architectures": list(ARCHITECTURES),
            "model_type": "gemma4_unified_text",
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "global_head_dim": self.head_dim,
            "num_global_key_value_heads": self.num_key_value_heads,
            "attention_k_eq_v": True,
            "attention_bias": False,
            "intermediate_size": self.intermediate_size,
            "hidden_activation": HIDDEN_ACTIVATION,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "final_logit_softcapping": self.final_logit_softcapping,
            "layer_types": ["full_attention"] * self.num_hidden_layers,
            "rope_parameters": {
                "full_attention": {"rope_type": "proportional",
                                   "partial_rotary_factor": self.partial_rotary_factor,
                                   "rope_theta": self.rope_theta},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "rope_theta": None,
                "rope_type": "default",
            },
            "enable_moe_block": False,
            "hidden_size_per_layer_input": 0,
            "num_kv_shared_layers": 0,
            "use_double_wide_mlp": False,
            "tie_word_embeddings": False,
            "target_layer_ids": list(self.target_layer_ids),
            "block_size": self.block_size,
            "mask_token_id": self.mask_token_id,
            "markov_rank": self.markov_rank,
            "markov_head_type": self.markov_head_type,
            "enable_confidence_head": self.enable_confidence_head,
            "confidence_head_with_markov": self.confidence_head_with_markov,
        }
        if self.num_target_layers is not None:
            out["num_target_layers"] = self.num_target_layers
        if self.target_hidden_size != self.hidden_size:
            out["target_hidden_size"] = self.target_hidden_size
        if self.confidence_temperatures is not None:
            out["confidence_temperatures"] = list(self.confidence_temperatures)
        return out

    def validated(self, source: str = "config") -> Gemma4Config:
        # The two head fields under the names config.json gives them for this family.
        heads, kv, hd = self.num_attention_heads, self.num_key_value_heads, self.head_dim
        if isinstance(kv, int) and isinstance(heads, int) and kv > 0 and heads % kv:
            raise DrafterConfigError(
                f"{source}: num_global_key_value_heads {kv} does not divide num_attention_heads"
                f" {heads}", field="num_global_key_value_heads", value=kv)
        if isinstance(hd, int) and hd > 0 and hd % 2:
            raise DrafterConfigError(
                f"{source}: global_head_dim {hd} must be even (rotary embedding pairs halves)",
                field="global_head_dim", value=hd)
        super().validated(source)
        p = self.partial_rotary_factor
        if not (math.isfinite(p) and 0.0 < p <= 1.0):
            raise DrafterConfigError(
                f"{source}: rope_parameters.full_attention.partial_rotary_factor {p!r} is"
                " outside (0, 1]", field="partial_rotary_factor", value=p)
        cap = self.final_logit_softcapping
        if cap is not None and not (math.isfinite(cap) and 0 < cap <= MAX_SOFTCAP):
            raise DrafterConfigError(
                f"{source}: final_logit_softcapping {cap!r} must be a number in (0,"
                f" {MAX_SOFTCAP:g}] or null (Gemma's is 30)", field="final_logit_softcapping",
                value=cap, limit=MAX_SOFTCAP)
        return self


def parse_gemma4_config(raw: Mapping[str, Any], source: str = "config.json") -> Gemma4Config:
    """A validated :class:`Gemma4Config` from a parsed Gemma4 DSpark config.json."""
    r = ConfigReader(raw, source)
    for name, supported, what in UNSUPPORTED:
        value = r.get(name, default=None)
        if value is not None and value != supported:
            need = "absent or null" if supported is None else repr(supported)
            raise DrafterConfigError(
                f"{source}: {name} {value!r} is not supported ({what}; the drafter runs only"
                f" {need})", field=name, value=value)
    if not r.bool_("attention_k_eq_v", default=False):
        k_eq_v = r.get("attention_k_eq_v", default=None)
        said = "is missing" if k_eq_v is None else f"{k_eq_v!r} is not supported"
        raise DrafterConfigError(
            f"{source}: attention_k_eq_v {said} (the drafter runs only true: V from k_proj, no"
            " v_proj, as in every Gemma4 DSpark drafter)", field="attention_k_eq_v",
            value=k_eq_v)
    for spelled in ("hidden_activation", "hidden_act"):
        act = r.get(spelled, default=None)
        if act is not None and act != HIDDEN_ACTIVATION:
            raise DrafterConfigError(
                f"{source}: {spelled} {act!r} is not supported (only {HIDDEN_ACTIVATION!r})",
                field=spelled, value=act)
    num_layers = r.int_("num_hidden_layers")
    layer_types = r.get("layer_types", default=None)
    if layer_types is not None:
        if not isinstance(layer_types, list) or len(layer_types) != num_layers:
            raise DrafterConfigError(
                f"{source}: layer_types {layer_types!r} must list one type per draft layer"
                f" (num_hidden_layers {num_layers})", field="layer_types", value=layer_types)
        for i, kind in enumerate(layer_types):
            if kind != "full_attention":
                raise DrafterConfigError(
                    f"{source}: layer_types[{i}] {kind!r} is not supported (draft layers use"
                    " full_attention only)", field="layer_types", value=kind)
    rope_theta, partial = _rope(r, source)
    cap = r.get("final_logit_softcapping", default=None)
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int | float)):
        raise DrafterConfigError(f"{source}: final_logit_softcapping {cap!r} is not a number",
                                 field="final_logit_softcapping", value=cap)
    hidden_size = r.int_("hidden_size")
    markov_rank = r.int_("markov_rank", aliases=("dspark_markov_rank",), default=0)
    enable_confidence_head = r.bool_("enable_confidence_head", default=False)
    config = Gemma4Config(
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=r.int_("num_attention_heads"),
        num_key_value_heads=r.int_("num_global_key_value_heads"),
        # The draft's layers are all global: global_head_dim, or head_dim where it is null.
        head_dim=r.int_("global_head_dim" if r.get("global_head_dim", default=None) is not None
                        else "head_dim"),
        intermediate_size=r.int_("intermediate_size"),
        vocab_size=r.int_("vocab_size"),
        rms_norm_eps=r.float_("rms_norm_eps", default=1e-6),
        rope_theta=rope_theta,
        target_layer_ids=tuple(r.int_list("target_layer_ids", aliases=(
            "dflash_config.target_layer_ids", "dspark_target_layer_ids"))),
        block_size=r.int_("block_size", aliases=("dspark_block_size",)),
        mask_token_id=r.int_("mask_token_id", aliases=(
            "dflash_config.mask_token_id", "dspark_noise_token_id")),
        markov_rank=markov_rank,
        markov_head_type=r.str_("markov_head_type", default="vanilla").lower(),
        enable_confidence_head=enable_confidence_head,
        confidence_head_with_markov=r.bool_(
            "confidence_head_with_markov", default=enable_confidence_head and markov_rank > 0),
        target_hidden_size=r.int_("target_hidden_size", default=hidden_size),
        num_target_layers=r.int_("num_target_layers", default=None),
        confidence_temperatures=temperatures(r.get("confidence_temperatures", default=None),
                                             source),
        partial_rotary_factor=partial,
        final_logit_softcapping=None if cap is None else float(cap),
    )
    return config.validated(source)


def _rope(r: ConfigReader, source: str) -> tuple[float, float]:
    """(rope_theta, partial_rotary_factor) of the draft's full-attention layers: the
    ``rope_parameters.full_attention`` entry (the top-level ``rope_theta`` / ``rope_type`` that
    transformers 5.10 writes beside it are ignored), or a flat ``rope_parameters``."""
    params = r.get("rope_parameters", default=None)
    if not isinstance(params, Mapping):
        raise DrafterConfigError(
            f"{source}: rope_parameters {params!r} is missing or not an object",
            field="rope_parameters", value=params)
    where = "rope_parameters"
    entry: Any = params
    if "full_attention" in params:
        entry, where = params["full_attention"], "rope_parameters.full_attention"
    if not isinstance(entry, Mapping):
        raise DrafterConfigError(f"{source}: {where} {entry!r} is not an object",
                                 field=where, value=entry)
    kind = entry.get("rope_type", "default")
    if kind not in ROPE_TYPES:
        raise DrafterConfigError(
            f"{source}: {where}.rope_type {kind!r} is not supported (only {list(ROPE_TYPES)})",
            field=f"{where}.rope_type", value=kind)
    theta = entry.get("rope_theta")
    if isinstance(theta, bool) or not isinstance(theta, int | float):
        raise DrafterConfigError(f"{source}: {where}.rope_theta {theta!r} is not a number",
                                 field=f"{where}.rope_theta", value=theta)
    if not (math.isfinite(theta) and theta > 1):
        raise DrafterConfigError(f"{source}: {where}.rope_theta {theta!r} must be a finite"
                                 " number above 1 (the rotary base)",
                                 field=f"{where}.rope_theta", value=theta, limit=1)
    partial = entry.get("partial_rotary_factor", 1.0) if kind == "proportional" else 1.0
    if isinstance(partial, bool) or not isinstance(partial, int | float):
        raise DrafterConfigError(
            f"{source}: {where}.partial_rotary_factor {partial!r} is not a number",
            field=f"{where}.partial_rotary_factor", value=partial)
    return float(theta), float(partial)


def gemma4_shapes(c: DrafterConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the Gemma4 checkpoint layout with its shape (DeepSpec key names): the
    Qwen3 layout without ``v_proj`` (V is the k_proj output, ``attention_k_eq_v``), with the
    sandwich norms around the MLP and each layer's saved ``layer_scalar``."""
    shapes = expected_shapes(c)
    d = c.hidden_size
    for i in range(c.num_hidden_layers):
        p = f"layers.{i}."
        del shapes[p + "self_attn.v_proj.weight"]
        shapes.update({
            p + "pre_feedforward_layernorm.weight": (d,),
            p + "post_feedforward_layernorm.weight": (d,),
            p + "layer_scalar": (1,),
        })
    return shapes


# -- the network ------------------------------------------------------------------------------


def rms_fp32(x: Tensor, eps: float) -> Tensor:
    """x / sqrt(mean(x^2) + eps) over the last axis, in fp32 (Gemma4RMSNorm's normalisation)."""
    x32 = x.float()
    return x32 * torch.pow(x32.pow(2).mean(-1, keepdim=True) + eps, -0.5)


class Gemma4RMSNorm(nn.Module):
    """Normalise and scale in fp32, then cast back (``weight`` multiplies directly, not 1+w)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return (rms_fp32(x, self.eps) * self.weight.float()).to(x.dtype)


class Gemma4Attention(nn.Module):
    def __init__(self, c: DrafterConfig) -> None:
        super().__init__()
        d, hd = c.hidden_size, c.head_dim
        self.q_proj = nn.Linear(d, c.num_attention_heads * hd, bias=False)
        self.k_proj = nn.Linear(d, c.num_key_value_heads * hd, bias=False)  # K and V (k_eq_v)
        self.o_proj = nn.Linear(c.num_attention_heads * hd, d, bias=False)
        self.q_norm = Gemma4RMSNorm(hd, c.rms_norm_eps)
        self.k_norm = Gemma4RMSNorm(hd, c.rms_norm_eps)


def gelu_tanh(x: Tensor) -> Tensor:
    """Gemma4's MLP activation (``hidden_activation: gelu_pytorch_tanh``)."""
    return F.gelu(x, approximate="tanh")


class Gemma4DecoderLayer(nn.Module):
    def __init__(self, c: DrafterConfig) -> None:
        super().__init__()
        d, eps = c.hidden_size, c.rms_norm_eps
        self.input_layernorm = Gemma4RMSNorm(d, eps)
        self.self_attn = Gemma4Attention(c)
        self.post_attention_layernorm = Gemma4RMSNorm(d, eps)
        self.pre_feedforward_layernorm = Gemma4RMSNorm(d, eps)
        self.mlp = MLP(c, gelu_tanh)
        self.post_feedforward_layernorm = Gemma4RMSNorm(d, eps)
        # A saved [1] tensor (a buffer in DeepSpec, 1.0 after training); it still multiplies.
        self.layer_scalar = nn.Parameter(torch.ones(1))


class Gemma4DrafterModel(DraftModel):
    """The Gemma4 family's weights and forward pieces (see the module docstring)."""

    config: Gemma4Config
    embed_scale: Tensor  # [] model dtype, non-persistent (init_buffers)
    _fused: tuple[Tensor, Tensor]  # project_context_kv's weights, rebuilt when they change
    _fused_key: tuple[tuple[int, int], ...] | None = None

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        if not isinstance(config, Gemma4Config):
            raise TypeError(f"a Gemma4 drafter needs a Gemma4Config, not {type(config).__name__}")
        c = config
        self.config = c
        self.embed_tokens = _embedding(c.vocab_size, c.hidden_size)
        self.fc = nn.Linear(c.tap_width, c.hidden_size, bias=False)
        self.hidden_norm = Gemma4RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.layers = nn.ModuleList(Gemma4DecoderLayer(c) for _ in range(c.num_hidden_layers))
        self.norm = Gemma4RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        self.markov_head = MarkovHead(c) if c.has_markov_head else None
        self.confidence_head = ConfidenceHead(c) if c.enable_confidence_head else None
        self.init_buffers()

    @property
    def decoder_layers(self) -> list[Gemma4DecoderLayer]:
        return [cast(Gemma4DecoderLayer, layer) for layer in self.layers]

    def init_buffers(self) -> None:
        super().init_buffers()
        weight = self.embed_tokens.weight
        # sqrt(d) as an fp32 scalar cast to the weight dtype (62.0 in bf16 for d = 3840).
        scale = torch.tensor(math.sqrt(self.config.hidden_size), dtype=torch.float32)
        self.register_buffer("embed_scale", scale.to(weight.device, weight.dtype),
                             persistent=False)

    def inv_freq_values(self, device: torch.device) -> Tensor:
        """Proportional RoPE: pair j < rotary_pairs rotates at theta^(-2j / head_dim); the
        other pairs get frequency 0 (cos 1, sin 0: they pass through)."""
        c = self.config
        half = c.head_dim // 2
        exponent = torch.arange(0, 2 * c.rotary_pairs, 2, dtype=torch.int64,
                                device=device).float()
        rotated = 1.0 / (c.rope_theta ** (exponent / c.head_dim))  # [rotary_pairs]
        still = torch.zeros(half - c.rotary_pairs, dtype=torch.float32, device=device)
        return torch.cat([rotated, still])  # [hd/2]

    # -- ingest -------------------------------------------------------------------------------
    def project_context(self, taps: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """Context K/V of every layer, layer by layer (the definition that
        :meth:`project_context_kv` computes fused): K, V [L, R, kv_heads, head_dim]."""
        c = self.config
        rows = taps.shape[0]
        ctx = self.hidden_norm(self.fc(taps))  # [R, d]
        cos, sin = self.rope(positions)  # [R, hd]
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [R, 1, hd]
        ks, vs = [], []
        for layer in self.decoder_layers:
            attn = layer.self_attn
            raw = attn.k_proj(ctx).view(rows, c.num_key_value_heads, c.head_dim)  # [R, Hkv, D]
            k = attn.k_norm(raw)
            ks.append(k * cos + rotate_half(k) * sin)  # [R, Hkv, D]
            vs.append(rms_fp32(raw, c.rms_norm_eps).to(raw.dtype))  # [R, Hkv, D]
        k_all = torch.nan_to_num(torch.stack(ks), nan=0.0, posinf=0.0, neginf=0.0)
        v_all = torch.nan_to_num(torch.stack(vs), nan=0.0, posinf=0.0, neginf=0.0)
        return k_all, v_all  # [L, R, Hkv, D] each

    def project_context_kv(self, taps: Tensor, positions: Tensor) -> Tensor:
        """One matmul over every layer's k_proj (concatenated once, a second copy of those
        weights: 26 MB in bf16 for the 12B drafter); K and V share one normalisation.
        -> [2 (K, V), L, R, kv_heads, head_dim]."""
        c = self.config
        r, n_layers, hkv, hd = taps.shape[0], c.num_hidden_layers, c.num_key_value_heads, c.head_dim
        w_k, k_norm = self._fused_context_weights()  # [L*Hkv*D, d], [1, L, 1, D] fp32
        with torch.no_grad():
            ctx = self.hidden_norm(self.fc(taps))  # [R, d]
            raw = F.linear(ctx, w_k).view(r, n_layers, hkv, hd)  # [R, L, Hkv, D]
            normed = rms_fp32(raw, c.rms_norm_eps)  # [R, L, Hkv, D] fp32
            k = (normed * k_norm).to(raw.dtype)  # k_norm per layer
            v = normed.to(raw.dtype)  # v_norm: no weight, no RoPE
            cos, sin = self.rope(positions)  # [R, hd]
            cos, sin = cos.view(r, 1, 1, hd), sin.view(r, 1, 1, hd)
            k = k * cos + rotate_half(k) * sin  # [R, L, Hkv, D]
            out = torch.stack([k, v]).transpose(1, 2)  # [2, L, R, Hkv, D]
            return torch.nan_to_num_(out, nan=0.0, posinf=0.0, neginf=0.0)

    def _fused_context_weights(self) -> tuple[Tensor, Tensor]:
        layers = [layer.self_attn for layer in self.decoder_layers]
        params = [p for a in layers for p in (a.k_proj.weight, a.k_norm.weight)]
        key = tuple((p.data_ptr(), p._version) for p in params)
        if self._fused_key != key:
            with torch.no_grad():
                w_k = torch.cat([a.k_proj.weight for a in layers])  # [L*Hkv*D, d]
                k_norm = torch.stack([a.k_norm.weight.float() for a in layers])  # [L, D]
            self._fused = (w_k, k_norm.view(1, len(layers), 1, -1))
            self._fused_key = key
        return self._fused

    # -- one block ----------------------------------------------------------------------------
    def backbone(self, block_ids: Tensor, block_pos: Tensor, context: ContextSource) -> Tensor:
        """Final hidden states hf [B, N, d]; block_ids, block_pos [B, N] int64; the context
        K/V per layer [B, Hkv, S, D] with ``context.valid`` [B, S]."""
        c = self.config
        b, n = block_ids.shape
        nh, hkv, g, hd = c.num_attention_heads, c.num_key_value_heads, c.num_kv_groups, c.head_dim
        h = self.embed_tokens(block_ids) * self.embed_scale  # [B, N, d]
        cos, sin = self.rope(block_pos)  # [B, N, hd]
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [B, 1, N, hd]
        ctx_bias = context_bias(context.valid)  # [B, 1, 1, S]
        for index, layer in enumerate(self.decoder_layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)  # [B, N, d]
            q = attn.q_norm(attn.q_proj(x).view(b, n, nh, hd)).transpose(1, 2)  # [B, H, N, D]
            q = q * cos + rotate_half(q) * sin  # [B, H, N, D]
            q = q.reshape(b, hkv, g * n, hd)  # [B, Hkv, G*N, D] (repeat_interleave order)
            raw = attn.k_proj(x).view(b, n, hkv, hd)  # [B, N, Hkv, D]
            k = attn.k_norm(raw).transpose(1, 2)  # [B, Hkv, N, D]
            k = k * cos + rotate_half(k) * sin  # [B, Hkv, N, D]
            v = rms_fp32(raw, c.rms_norm_eps).to(raw.dtype).transpose(1, 2)  # [B, Hkv, N, D]
            k_ctx, v_ctx = context.layer(index)  # [B, Hkv, S, D] each
            out = attend(q, k, v, k_ctx, v_ctx, ctx_bias, 1.0)  # [B, Hkv, G*N, D]
            out = out.view(b, nh, n, hd).transpose(1, 2).reshape(b, n, nh * hd)  # [B, N, H*D]
            h = h + layer.post_attention_layernorm(attn.o_proj(out))  # [B, N, d]
            y = layer.mlp(layer.pre_feedforward_layernorm(h))  # [B, N, d]
            h = (h + layer.post_feedforward_layernorm(y)) * layer.layer_scalar  # [B, N, d]
        hf: Tensor = self.norm(h)  # [B, N, d]
        return hf

    def finish_logits(self, head: Tensor) -> Tensor:
        """U = lm_head(hf) in fp32, soft-capped before the Markov bias is added."""
        out: Tensor = head.float()  # [..., V]
        cap = self.config.final_logit_softcapping
        if cap is not None:
            out = torch.tanh(out / cap) * cap
        return out
