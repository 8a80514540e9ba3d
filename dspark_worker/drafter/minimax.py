"""The MiniMax-M3 family: the DSpark drafter of MiniMax-M3 (M3.1), ``DSparkMiniMaxDraftModel``
(docs/architecture.md, "Model families"; MINIMAX_M3.md defines it op by op).

The Qwen3 drafter built from MiniMax-M3 parts. What differs, and nothing else:

- config.json is a VL wrapper: ``architectures`` and ``quantization_config`` at the top level,
  every model key inside ``text_config`` (DSpark's keys spelled ``dspark_*``); the MLP width is
  ``dspark_ffn_hidden_size``, never ``intermediate_size`` (the target's expert width);
- the folder is standalone or the target's ``dspark/`` subfolder (``protocol.formats.
  held_drafter``); tensors are named ``language_model.model.dspark.<name>`` (the prefix is
  dropped on reading, ``protocol.identity.drafter_tensors``) with a ``.decoder_layer.`` infix
  per layer and ``final_norm``; the embedding and the head are always the target's
  (``language_model.model.embed_tokens.weight``, ``language_model.lm_head.weight``: untied);
- the layers' seven linears may be MXFP8 (E4M3 values, E8M0 scales per 1 x 32 block), decided
  per tensor from the stored dtypes and dequantised on load (:mod:`.quant`);
- every RMSNorm scales by ``(1 + w)``, in fp32, then casts back;
- partial NeoX RoPE: the first ``rotary_dim = int(head_dim * partial_rotary_factor)`` dims
  rotate, pairs (j, j + rotary_dim / 2), frequencies ``theta ** (-2j / rotary_dim)``;
- the MLP is the clamped SwiGLU-OAI: ``g = min(g, L)``, ``u = clamp(u, -L, L)``,
  ``g * sigmoid(alpha * g) * (u + 1)``;
- attention is non-causal, and a ``sliding_attention`` layer lets query position p see key q
  only where ``|p - q| <= S - 1``: block row r sees the newest ``S - 1 - r`` context rows and the
  whole block (N <= S).

The ring stores, per layer, K after k_norm and RoPE and V as projected: the same
[L, kv_heads, head_dim] per position as every family.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from protocol.formats import MINIMAX_ARCHITECTURE

from . import quant
from .config import ConfigReader, DrafterConfig, DrafterConfigError
from .model import (
    MLP,
    ConfidenceHead,
    ContextSource,
    DecoderLayer,
    DrafterModel,
    MarkovHead,
    _embedding,
    attend,
    context_bias,
    head_shapes,
    per_query_window_bias,
    rotate_half,
)

ARCHITECTURES = (MINIMAX_ARCHITECTURE,)
LAYER_TYPES = ("sliding_attention", "full_attention")
QUANT_METHODS = ("mxfp8",)
MXFP8_BLOCK_SIZE = [1, quant.MXFP8_BLOCK]
# transformers' MiniMax-M3 defaults (configuration_minimax_m3_vl.py) and vLLM's rotary default.
DEFAULT_ROPE_THETA = 5e6
DEFAULT_PARTIAL_ROTARY_FACTOR = 0.5
DEFAULT_SWIGLU_ALPHA = 1.702
DEFAULT_SWIGLU_LIMIT = 7.0
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
# The linears' weights may be stored as MXFP8 values; their scales are always U8.
WEIGHT_DTYPES = ("BF16", "F16", "F32", quant.MXFP8_VALUES)
SCALE_DTYPES = (quant.MXFP8_SCALES,)
INFIX = ".decoder_layer."
# Options of the text config that change the computation in ways this family does not define,
# or that vLLM would silently misread: (key, the value served, what it is). A value of None:
# must be absent or null; False: absent, null or false.
UNSUPPORTED: tuple[tuple[str, object, str], ...] = (
    ("dspark_hybrid_context_fusion", False, "hybrid context fusion"),
    ("dspark_config.hybrid_context_fusion", False, "hybrid context fusion"),
    ("sparse_attention_config", None, "sparse attention"),
    ("dflash_config.use_swa", False, "DFlash's own sliding-window switch"),
    ("attention_sink_bias", False, "attention sinks"),
    ("attention_value_scale", None, "a scaled attention value"),
    ("dspark_bonus_anchor", False, "the bonus-anchor layout"),
    ("eagle_aux_hidden_state_layer_ids", None, "taps in capture numbering (use"
     " dspark_target_layer_ids)"),
    ("dflash_config.target_layer_ids", None, "taps spelled the DFlash way (use"
     " dspark_target_layer_ids)"),
    ("moe_quant_algo", None, "quantised MoE experts"),
)


@dataclass(frozen=True)
class MiniMaxConfig(DrafterConfig):
    """A MiniMax-M3 drafter's config (``text_config``). ``intermediate_size`` holds
    ``dspark_ffn_hidden_size``; ``rotary_dim`` is ``int(head_dim * partial_rotary_factor)``."""

    rotary_dim: int = 0
    partial_rotary_factor: float = DEFAULT_PARTIAL_ROTARY_FACTOR
    swiglu_alpha: float = DEFAULT_SWIGLU_ALPHA
    swiglu_limit: float = DEFAULT_SWIGLU_LIMIT
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    quantization: str | None = None  # quantization_config.quant_method (None: none)

    def to_json_dict(self) -> dict[str, Any]:
        """config.json in the released wrapper layout (``text_config`` holding the model)."""
        text: dict[str, Any] = {
            "model_type": "minimax_m3_vl_text",
            "num_hidden_layers": self.num_hidden_layers,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "dspark_ffn_hidden_size": self.intermediate_size,
            "hidden_act": "swigluoai",
            "swiglu_alpha": self.swiglu_alpha,
            "swiglu_limit": self.swiglu_limit,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": False,
            "use_gemma_norm": True,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta,
                                "partial_rotary_factor": self.partial_rotary_factor},
            "dspark_target_layer_ids": list(self.target_layer_ids),
            "dspark_block_size": self.block_size,
            "dspark_noise_token_id": self.mask_token_id,
            "dspark_markov_rank": self.markov_rank,
            "dspark_markov_head_type": self.markov_head_type,
            "dspark_use_dense_ffn": True,
            "enable_confidence_head": self.enable_confidence_head,
            "confidence_head_with_markov": self.confidence_head_with_markov,
            "sliding_window": self.sliding_window,
            "layer_types": list(self.layer_types),
            "moe_layer_freq": [0] * self.num_hidden_layers,
        }
        out: dict[str, Any] = {"architectures": list(ARCHITECTURES),
                               "model_type": "minimax_m3_vl", "text_config": text}
        if self.quantization is not None:
            out["quantization_config"] = {"quant_method": self.quantization,
                                          "weight_block_size": MXFP8_BLOCK_SIZE}
        return out

    def validated(self, source: str = "config") -> MiniMaxConfig:
        super().validated(source)

        def fail(field: str, value: object, why: str, limit: object = None) -> None:
            raise DrafterConfigError(f"{source}: {field} {value!r} {why}", field=field,
                                     value=value, limit=limit)

        p = self.partial_rotary_factor
        if not (math.isfinite(p) and 0.0 < p <= 1.0):
            fail("rope_parameters.partial_rotary_factor", p, "is outside (0, 1]", 1.0)
        rd = self.rotary_dim
        if rd != int(self.head_dim * p):
            fail("rotary_dim", rd, f"disagrees with int(head_dim {self.head_dim} x"
                 f" partial_rotary_factor {p}) = {int(self.head_dim * p)}, which vLLM uses")
        if rd <= 0 or rd % 2 or rd > self.head_dim:
            fail("rotary_dim", rd, f"must be even and in 2..head_dim {self.head_dim} (NeoX"
                 " rotation pairs its halves)", self.head_dim)
        for name in ("swiglu_alpha", "swiglu_limit"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                fail(name, value, "must be a positive finite number")
        if len(self.layer_types) != self.num_hidden_layers:
            fail("layer_types", list(self.layer_types), "must list one type per draft layer"
                 f" (num_hidden_layers {self.num_hidden_layers})")
        for kind in self.layer_types:
            if kind not in LAYER_TYPES:
                fail("layer_types", list(self.layer_types), f"holds {kind!r}; this drafter"
                     f" runs {list(LAYER_TYPES)} only")
        s = self.sliding_window
        if "sliding_attention" in self.layer_types:
            if s is None or s < 1:
                fail("sliding_window", s, "must be a positive integer for sliding_attention"
                     " layers")
            elif self.num_spec > s:
                fail("dspark_block_size", self.block_size, f"is over sliding_window {s}"
                     " (the block must see itself whole)", s)
        if self.markov_head_type != "vanilla":
            fail("dspark_markov_head_type", self.markov_head_type, "is not supported (only"
                 " 'vanilla' exists for this family)")
        return self


def parse_minimax_config(raw: Mapping[str, Any], source: str = "config.json") -> MiniMaxConfig:
    """A validated :class:`MiniMaxConfig` from a parsed MiniMax-M3 DSpark config.json."""
    archs = raw.get("architectures")
    if archs != list(ARCHITECTURES):
        raise DrafterConfigError(
            f"{source}: architectures {archs!r} is not supported (a MiniMax-M3 DSpark drafter"
            f" has {list(ARCHITECTURES)})", field="architectures", value=archs)
    text = raw.get("text_config")
    if not isinstance(text, Mapping):
        raise DrafterConfigError(f"{source}: text_config {text!r} is missing or not an object"
                                 " (the model's keys live there)", field="text_config",
                                 value=text)
    for key, value in raw.items():
        if key in text and key != "model_type" and text[key] != value:
            raise DrafterConfigError(
                f"{source}: {key} {value!r} and text_config.{key} {text[key]!r} disagree",
                field=key, value=value)
    if raw.get("moe_quant_algo") is not None:
        raise DrafterConfigError(f"{source}: moe_quant_algo {raw['moe_quant_algo']!r} is not"
                                 " supported (the drafter has no experts)",
                                 field="moe_quant_algo", value=raw["moe_quant_algo"])
    quantization = _quantization(raw.get("quantization_config"), source)
    where = f"{source} (text_config)"
    r = ConfigReader(text, where)
    for name, served, what in UNSUPPORTED:
        value = r.get(name, default=None)
        if value is not None and not (served is False and value is False):
            need = "absent or null" if served is None else "absent, null or false"
            raise DrafterConfigError(f"{where}: {name} {value!r} is not supported ({what};"
                                     f" the drafter runs only {need})", field=name, value=value)
    for name in ("dspark_use_dense_ffn", "use_gemma_norm", "is_neox_style",
                 "sample_from_anchor"):
        value = r.get(name, default=None)
        if value is None and name == "dspark_use_dense_ffn":
            raise DrafterConfigError(f"{where}: dspark_use_dense_ffn is missing (vLLM serves"
                                     " only the dense-FFN drafter: true)", field=name)
        if value is not None and value is not True:
            raise DrafterConfigError(f"{where}: {name} {value!r} is not supported (only"
                                     " true)", field=name, value=value)
    causal = r.get("is_causal", default=None)
    spelled = "is_causal"
    if causal is None:
        causal, spelled = r.get("dflash_config.causal", default=None), "dflash_config.causal"
    if causal is not None and causal is not False:
        raise DrafterConfigError(f"{where}: {spelled} {causal!r} is not supported (the block"
                                 " attends both ways: false)", field=spelled, value=causal)
    moe = r.get("moe_layer_freq", default=None)
    if moe is not None and (not isinstance(moe, list) or any(f != 0 for f in moe)):
        raise DrafterConfigError(f"{where}: moe_layer_freq {moe!r} is not supported (dense"
                                 " layers only: every entry 0)", field="moe_layer_freq",
                                 value=moe)
    r.check_rope_type()
    num_layers = r.int_("num_hidden_layers")
    hidden = r.int_("hidden_size")
    heads = r.int_("num_attention_heads")
    head_dim = r.int_("head_dim", default=hidden // heads if heads > 0 else 0)
    vocab = r.int_("vocab_size")
    draft_vocab = r.int_("draft_vocab_size", default=vocab)
    if draft_vocab != vocab:
        raise DrafterConfigError(f"{where}: draft_vocab_size {draft_vocab!r} is not supported"
                                 f" (drafts are over the whole vocabulary: vocab_size {vocab})",
                                 field="draft_vocab_size", value=draft_vocab, limit=vocab)
    factor = r.get("rope_parameters.partial_rotary_factor", ("partial_rotary_factor",),
                   default=DEFAULT_PARTIAL_ROTARY_FACTOR)
    if isinstance(factor, bool) or not isinstance(factor, int | float):
        raise DrafterConfigError(f"{where}: partial_rotary_factor {factor!r} is not a number",
                                 field="partial_rotary_factor", value=factor)
    rotary = r.int_("rotary_dim", default=None)
    layer_types = r.get("layer_types", default=None)
    if layer_types is None:
        layer_types = ["full_attention"] * num_layers
    if not isinstance(layer_types, list):
        raise DrafterConfigError(f"{where}: layer_types {layer_types!r} is not a list",
                                 field="layer_types", value=layer_types)
    window = r.get("dflash_config.swa_window_size", default=None)
    window = r.int_("sliding_window", default=None) if window is None else r.int_(
        "dflash_config.swa_window_size")
    markov_rank = r.int_("dspark_markov_rank", ("markov_rank",), default=0)
    confidence = r.bool_("enable_confidence_head", default=False)
    config = MiniMaxConfig(
        hidden_size=hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=r.int_("num_key_value_heads"),
        head_dim=head_dim,
        intermediate_size=r.int_("dspark_ffn_hidden_size", ("dense_intermediate_size",)),
        vocab_size=vocab,
        rms_norm_eps=r.float_("rms_norm_eps", default=1e-6),
        rope_theta=r.float_("rope_theta", nested=("rope_parameters", "rope_theta"),
                            default=DEFAULT_ROPE_THETA),
        target_layer_ids=tuple(r.int_list("dspark_target_layer_ids")),
        block_size=r.int_("block_size", ("dspark_block_size",)),
        mask_token_id=r.int_("dflash_config.mask_token_id", ("mask_token_id",
                                                             "dspark_noise_token_id")),
        markov_rank=markov_rank,
        markov_head_type=r.str_("dspark_markov_head_type", default="vanilla"),
        enable_confidence_head=confidence,
        confidence_head_with_markov=r.bool_("confidence_head_with_markov",
                                            default=confidence and markov_rank > 0),
        target_hidden_size=hidden,
        rotary_dim=int(head_dim * factor) if rotary is None else rotary,
        partial_rotary_factor=float(factor),
        swiglu_alpha=r.float_("swiglu_alpha", default=DEFAULT_SWIGLU_ALPHA),
        swiglu_limit=r.float_("swiglu_limit", default=DEFAULT_SWIGLU_LIMIT),
        sliding_window=window,
        layer_types=tuple(layer_types),
        quantization=quantization,
    )
    return config.validated(where)


def _quantization(value: object, source: str) -> str | None:
    """quantization_config's method (None where there is none): MXFP8 in 1 x 32 blocks only."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise DrafterConfigError(f"{source}: quantization_config {value!r} is not an object",
                                 field="quantization_config", value=value)
    method = value.get("quant_method")
    if method not in QUANT_METHODS:
        raise DrafterConfigError(f"{source}: quantization_config.quant_method {method!r} is not"
                                 f" supported (only {list(QUANT_METHODS)})",
                                 field="quantization_config.quant_method", value=method)
    block = value.get("weight_block_size", MXFP8_BLOCK_SIZE)
    if block != MXFP8_BLOCK_SIZE:
        raise DrafterConfigError(f"{source}: quantization_config.weight_block_size {block!r} is"
                                 f" not supported (MXFP8 blocks are {MXFP8_BLOCK_SIZE})",
                                 field="quantization_config.weight_block_size", value=block,
                                 limit=MXFP8_BLOCK_SIZE)
    if value.get("moe_quant_algo") is not None:
        raise DrafterConfigError(f"{source}: quantization_config.moe_quant_algo"
                                 f" {value['moe_quant_algo']!r} is not supported (the drafter"
                                 " has no experts)", field="quantization_config.moe_quant_algo",
                                 value=value["moe_quant_algo"])
    return str(method)


# -- checkpoint layout ----------------------------------------------------------------------------


def _minimax(c: DrafterConfig) -> MiniMaxConfig:
    if not isinstance(c, MiniMaxConfig):
        raise TypeError(f"the minimax_m3 family needs a MiniMaxConfig, not {type(c).__name__}")
    return c


def minimax_shapes(c: DrafterConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the released layout, by its name less ``language_model.model.dspark.``
    (the per-layer ``.decoder_layer.`` infix and ``final_norm`` as stored), with the target's
    embedding and head; the linears' MXFP8 scales are :func:`minimax_scale_shapes`."""
    d, v, hd, i_ = c.hidden_size, c.vocab_size, c.head_dim, c.intermediate_size
    q_dim, kv_dim = c.num_attention_heads * hd, c.num_key_value_heads * hd
    shapes: dict[str, tuple[int, ...]] = {
        "embed_tokens.weight": (v, d),
        "lm_head.weight": (v, d),
        "fc.weight": (d, c.tap_width),
        "hidden_norm.weight": (d,),
        "final_norm.weight": (d,),
    }
    for n in range(c.num_hidden_layers):
        p = f"layers.{n}{INFIX}"
        shapes.update({
            p + "input_layernorm.weight": (d,),
            p + "post_attention_layernorm.weight": (d,),
            p + "self_attn.q_norm.weight": (hd,),
            p + "self_attn.k_norm.weight": (hd,),
            p + "self_attn.q_proj.weight": (q_dim, d),
            p + "self_attn.k_proj.weight": (kv_dim, d),
            p + "self_attn.v_proj.weight": (kv_dim, d),
            p + "self_attn.o_proj.weight": (d, q_dim),
            p + "mlp.gate_proj.weight": (i_, d),
            p + "mlp.up_proj.weight": (i_, d),
            p + "mlp.down_proj.weight": (d, i_),
        })
    shapes.update(head_shapes(c))
    return shapes


def linear_weights(c: DrafterConfig) -> list[str]:
    """The stored names of the linears that may be MXFP8."""
    return [f"layers.{n}{INFIX}{linear}.weight" for n in range(c.num_hidden_layers)
            for linear in LINEARS]


def minimax_scale_shapes(c: DrafterConfig) -> dict[str, tuple[int, ...]]:
    """The MXFP8 scales a linear's weight may have beside it (present exactly when the weight is
    F8_E4M3; :func:`quant.dequantize_linears` checks the pairs)."""
    shapes = minimax_shapes(c)
    return {quant.scale_name(w): quant.mxfp8_scale_shape(cast(tuple[int, int], shapes[w]))
            for w in linear_weights(c)}


def stored_dtypes(name: str) -> tuple[str, ...] | None:
    """The dtypes a tensor of this layout may be stored in (None: any float)."""
    if name.endswith(quant.SCALE_SUFFIX):
        return SCALE_DTYPES
    if any(name.endswith(f"{linear}.weight") for linear in LINEARS):
        return WEIGHT_DTYPES
    return None


def from_target(c: DrafterConfig) -> tuple[str, ...]:
    return ("embed_tokens.weight", "lm_head.weight")


def model_tensors(c: DrafterConfig, tensors: dict[str, Tensor], source: str
                  ) -> dict[str, Tensor]:
    """The stored tensors as the model takes them: MXFP8 linears dequantised (their scales
    dropped), the ``.decoder_layer.`` infix removed and ``final_norm`` named ``norm``. Each
    linear is replaced as it is converted, so at most one extra dense weight is alive at once."""
    quant.log_dequantized(source, quant.dequantize_linears(tensors, linear_weights(c), source))
    out: dict[str, Tensor] = {}
    for name in list(tensors):
        model_name = "norm.weight" if name == "final_norm.weight" else name.replace(INFIX, ".")
        out[model_name] = tensors.pop(name)
    return out


# -- the network ------------------------------------------------------------------------------


class GemmaRMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * (1 + w), in fp32, cast back to the input dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return gemma_rms(x, self.weight, self.eps)


def gemma_rms(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """The (1 + w) RMSNorm over x's last axis; ``weight`` broadcasts against it."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * (1.0 + weight.float())).to(x.dtype)


class ClampedSwiGLU(MLP):
    """The SwiGLU-OAI MLP: ``down(g * sigmoid(alpha * g) * (u + 1))`` with the gate clamped
    above at ``limit`` and the up projection to [-limit, limit]."""

    def __init__(self, c: MiniMaxConfig) -> None:
        super().__init__(c)
        self.alpha, self.limit = c.swiglu_alpha, c.swiglu_limit

    def forward(self, x: Tensor) -> Tensor:
        g = self.gate_proj(x).clamp(max=self.limit)  # [..., I]
        u = self.up_proj(x).clamp(-self.limit, self.limit)  # [..., I]
        out: Tensor = self.down_proj(g * torch.sigmoid(self.alpha * g) * (u + 1))  # [..., d]
        return out


def minimax_layer(c: MiniMaxConfig) -> DecoderLayer:
    """A Qwen3-shaped decoder layer with MiniMax-M3's norms and MLP."""
    layer = DecoderLayer(c)
    d, hd, eps = c.hidden_size, c.head_dim, c.rms_norm_eps
    layer.input_layernorm = GemmaRMSNorm(d, eps)  # type: ignore[assignment]
    layer.post_attention_layernorm = GemmaRMSNorm(d, eps)  # type: ignore[assignment]
    layer.self_attn.q_norm = GemmaRMSNorm(hd, eps)  # type: ignore[assignment]
    layer.self_attn.k_norm = GemmaRMSNorm(hd, eps)  # type: ignore[assignment]
    layer.mlp = ClampedSwiGLU(c)
    return layer


class MiniMaxDrafterModel(DrafterModel):
    """The MiniMax-M3 family's weights and forward pieces (see the module docstring). The
    modules are named as the stored tensors less the infix (``model_tensors``)."""

    config: MiniMaxConfig

    def __init__(self, config: DrafterConfig) -> None:
        nn.Module.__init__(self)  # DrafterModel's constructor builds Qwen3's layers
        c = _minimax(config)
        self.config = c
        self.embed_tokens = _embedding(c.vocab_size, c.hidden_size)
        self.fc = nn.Linear(c.tap_width, c.hidden_size, bias=False)
        self.hidden_norm = GemmaRMSNorm(c.hidden_size, c.rms_norm_eps)  # type: ignore[assignment]
        self.layers = nn.ModuleList(minimax_layer(c) for _ in range(c.num_hidden_layers))
        self.norm = GemmaRMSNorm(c.hidden_size, c.rms_norm_eps)  # type: ignore[assignment]
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        self.markov_head = MarkovHead(c) if c.has_markov_head else None
        self.confidence_head = ConfidenceHead(c) if c.enable_confidence_head else None
        self.scaling = c.head_dim**-0.5
        self.init_buffers()

    def inv_freq_values(self, device: torch.device) -> Tensor:
        """theta ** (-2j / rotary_dim) for j < rotary_dim / 2 (the exponent's denominator is
        the rotary width, not head_dim) -> [rotary_dim / 2] fp32."""
        c = self.config
        exponent = torch.arange(0, c.rotary_dim, 2, dtype=torch.int64, device=device).float()
        inv_freq: Tensor = 1.0 / (c.rope_theta ** (exponent / c.rotary_dim))
        return inv_freq

    def rotate(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """Partial NeoX RoPE on x [..., hd] with cos, sin [..., rotary_dim]: the first
        rotary_dim dims rotate in halves, the rest pass through."""
        rd = self.config.rotary_dim
        if rd == x.shape[-1]:
            return x * cos + rotate_half(x) * sin
        head = x[..., :rd]
        return torch.cat([head * cos + rotate_half(head) * sin, x[..., rd:]], dim=-1)

    # -- ingest -------------------------------------------------------------------------------
    def project_context(self, taps: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """Context K/V of every layer, layer by layer (the definition that
        :meth:`project_context_kv` computes fused): no input_layernorm; K normed then roped;
        V as projected. -> K, V [L, R, kv_heads, head_dim]."""
        c = self.config
        rows = taps.shape[0]
        ctx = self.hidden_norm(self.fc(taps))  # [R, d]
        cos, sin = self.rope(positions)  # [R, rd]
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [R, 1, rd]
        ks, vs = [], []
        for layer in self.decoder_layers:
            attn = layer.self_attn
            k = attn.k_norm(attn.k_proj(ctx).view(rows, c.num_key_value_heads, c.head_dim))
            ks.append(self.rotate(k, cos, sin))  # [R, Hkv, D]
            vs.append(attn.v_proj(ctx).view(rows, c.num_key_value_heads, c.head_dim))
        k_all = torch.nan_to_num(torch.stack(ks), nan=0.0, posinf=0.0, neginf=0.0)
        v_all = torch.nan_to_num(torch.stack(vs), nan=0.0, posinf=0.0, neginf=0.0)
        return k_all, v_all  # [L, R, Hkv, D] each

    def project_context_kv(self, taps: Tensor, positions: Tensor) -> Tensor:
        """:meth:`project_context` with every layer's k_proj and v_proj as one matmul (the
        Qwen3 family's fused weights) -> [2 (K, V), L, R, kv_heads, head_dim]."""
        c = self.config
        r, n_layers, hkv, hd = taps.shape[0], c.num_hidden_layers, c.num_key_value_heads, c.head_dim
        w_kv, k_norm = self._fused_context_weights()  # [L*2*Hkv*D, d], [1, L, 1, D]
        with torch.no_grad():
            ctx = self.hidden_norm(self.fc(taps))  # [R, d]
            kv = F.linear(ctx, w_kv).view(r, n_layers, 2, hkv, hd)
            k = gemma_rms(kv[:, :, 0], k_norm, c.rms_norm_eps)  # [R, L, Hkv, D]
            cos, sin = self.rope(positions)  # [R, rd]
            k = self.rotate(k, cos.view(r, 1, 1, -1), sin.view(r, 1, 1, -1))
            out = torch.stack([k, kv[:, :, 1]]).transpose(1, 2)  # [2, L, R, Hkv, D]
            return torch.nan_to_num_(out, nan=0.0, posinf=0.0, neginf=0.0)

    # -- one block ----------------------------------------------------------------------------
    def layer_biases(self, context: ContextSource, n: int) -> list[Tensor]:
        """Each layer's context bias: a full layer sees every valid slot ([B, 1, 1, S]); a
        sliding one, per block row r, the newest S - 1 - r ([B, 1, G*N, S])."""
        c = self.config
        full = context_bias(context.valid)
        window = c.sliding_window
        sliding = (per_query_window_bias(context, n, window, c.num_kv_groups)
                   if window is not None and "sliding_attention" in c.layer_types else full)
        return [sliding if kind == "sliding_attention" else full for kind in c.layer_types]

    def backbone(self, block_ids: Tensor, block_pos: Tensor, context: ContextSource) -> Tensor:
        """Final hidden states hf [B, N, d]; block_ids, block_pos [B, N] int64; the context
        K/V per layer [B, Hkv, S, D] with ``context.valid`` [B, S]. The block attends to itself
        both ways."""
        c = self.config
        b, n = block_ids.shape
        nh, hkv, g, hd = c.num_attention_heads, c.num_key_value_heads, c.num_kv_groups, c.head_dim
        h = self.embed_tokens(block_ids)  # [B, N, d]
        cos, sin = self.rope(block_pos)  # [B, N, rd]
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [B, 1, N, rd]
        biases = self.layer_biases(context, n)
        for index, layer in enumerate(self.decoder_layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)  # [B, N, d]
            q = attn.q_norm(attn.q_proj(x).view(b, n, nh, hd)).transpose(1, 2)  # [B, H, N, D]
            q = self.rotate(q, cos, sin).reshape(b, hkv, g * n, hd)  # repeat_kv order
            k = attn.k_norm(attn.k_proj(x).view(b, n, hkv, hd)).transpose(1, 2)  # [B, Hkv, N, D]
            k = self.rotate(k, cos, sin)
            v = attn.v_proj(x).view(b, n, hkv, hd).transpose(1, 2)  # [B, Hkv, N, D]
            k_ctx, v_ctx = context.layer(index)  # [B, Hkv, S, D] each
            out = attend(q, k, v, k_ctx, v_ctx, biases[index], self.scaling)  # [B, Hkv, G*N, D]
            out = out.view(b, nh, n, hd).transpose(1, 2).reshape(b, n, nh * hd)  # [B, N, H*D]
            h = h + attn.o_proj(out)  # [B, N, d]
            h = h + layer.mlp(layer.post_attention_layernorm(h))  # [B, N, d]
        hf: Tensor = self.norm(h)  # [B, N, d]
        return hf
