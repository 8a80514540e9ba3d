"""The speculators family: DSpark drafters trained and saved by vLLM's ``speculators`` library
(``speculators_model_type: dspark``; docs/architecture.md, "Model families").

The network is the Qwen3 family's (``c = hidden_norm(fc(taps))`` feeds every layer's K/V, pre-norm
SwiGLU layers with q_norm/k_norm, GQA, the same Markov and confidence heads). What differs, and
nothing else, is what speculators trains:

- config.json: the decoder geometry sits in the nested ``transformer_layer_config`` (a Qwen3 or
  Llama config, Qwen3-shaped layers either way); a missing key there takes that config class's
  default, a missing top-level key speculators' own default. ``aux_hidden_state_layer_ids`` are
  HF ``hidden_states`` indices, ours + 1;
- the bonus layout (``sample_from_anchor`` false): the block still has B rows but row 0, the
  anchor, drafts nothing, so N = B - 1; the rnn head's state steps through row 0
  (``config.lead_rows``);
- a reduced draft vocabulary (``draft_vocab_size`` Vd < V): ``lm_head`` and ``markov_w2`` have
  Vd rows, drafts are picked there and mapped back by ``d2t`` offsets (target = d + d2t[d]);
  ``markov_w1`` and the block's input ids stay target ids;
- ``embed_tokens`` always comes from the target, and on a full vocabulary ``lm_head`` too;
- per-layer attention: ``full_attention`` reads the whole context and the whole block (as
  DeepSpec); ``sliding_attention`` reads the newest ``sliding_window`` context rows (the same for
  every block row) and is causal inside the block unless ``sliding_window_non_causal``;
- q/k/v/o biases with ``attention_bias``; RoPE from ``rope_parameters`` with ``llama3`` or
  ``yarn`` scaling (yarn also scales cos and sin, as HF does);
- the confidence head is a plain sigmoid (no temperature table).

Where vLLM 0.33 reads these checkpoints differently (its sliding window is per query position and
always causal), the worker serves what the drafter was trained to compute: speculators'.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor, nn

from .config import ConfigReader, DrafterConfig, DrafterConfigError
from .model import (
    ConfidenceHead,
    ContextSource,
    DecoderLayer,
    DrafterModel,
    MarkovHead,
    RMSNorm,
    _embedding,
    attend,
    context_bias,
    expected_shapes,
    rotate_half,
)

MODEL_TYPE_KEY = "speculators_model_type"
SPECULATORS_MODEL_TYPES = ("dspark",)
ARCHITECTURES = ("DSparkDraftModel",)
LAYER_MODEL_TYPES = ("qwen3", "llama")
LAYER_TYPES = ("full_attention", "sliding_attention")
ROPE_TYPES = ("default", "llama3", "yarn")
HIDDEN_ACT = "silu"
# The index tensors of a reduced vocabulary and the safetensors dtypes they are stored in.
INDEX_DTYPES: dict[str, tuple[str, ...]] = {"d2t": ("I64",), "t2d": ("BOOL",)}

# transformers' config-class defaults for the keys read here (Qwen3Config, LlamaConfig): a key
# that ``to_diff_dict`` left out, or a hand-written config lacks, means this value.
LAYER_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen3": {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016,
              "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
              "head_dim": 128, "hidden_act": "silu", "max_position_embeddings": 32768,
              "rms_norm_eps": 1e-6, "attention_bias": False, "use_sliding_window": False,
              "sliding_window": 4096, "max_window_layers": 28},
    "llama": {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
              "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": None,
              "head_dim": None, "hidden_act": "silu", "max_position_embeddings": 2048,
              "rms_norm_eps": 1e-6, "attention_bias": False, "use_sliding_window": False,
              "sliding_window": None, "max_window_layers": 0},
}
DEFAULT_ROPE_THETA = 10000.0
# Top-level defaults of speculators' DSparkSpeculatorConfig (and its DFlash parent).
TOP_DEFAULTS: dict[str, Any] = {
    "draft_vocab_size": 32000, "block_size": 8, "sample_from_anchor": True,
    "sliding_window_non_causal": False, "markov_rank": 256, "markov_head_type": "vanilla",
    "enable_confidence_head": True, "confidence_head_with_markov": True,
}
# Top-level options of newer speculators releases that change the computation: refused unless
# they hold the value this family implements.
UNSUPPORTED: tuple[tuple[str, object, str], ...] = (
    ("projector_type", "dflash", "the dflash projector only"),
    ("shift_label", False, "unshifted targets only"),
)
# rope_parameters keys each scaling type needs (beside rope_type and rope_theta) and may have.
# (transformers 5 fills original_max_position_embeddings from max_position_embeddings.)
ROPE_REQUIRED = {"default": (), "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
                 "yarn": ("factor",)}
ROPE_OPTIONAL = {"default": (), "llama3": ("original_max_position_embeddings",),
                 "yarn": ("original_max_position_embeddings", "attention_factor", "beta_fast",
                          "beta_slow", "mscale", "mscale_all_dim", "truncate")}
# What each scaling parameter may be: (smallest, largest, whether the smallest is allowed).
# factor: the context extensions in use are 4x to 160x. The others are divided by or taken
# the logarithm of (so zero is out), or scale cos and sin (so they stay positive).
ROPE_RANGES: dict[str, tuple[float, float, bool]] = {
    "factor": (1.0, 1024.0, True),
    "low_freq_factor": (0.0, 1e6, False),
    "high_freq_factor": (0.0, 1e6, False),
    "original_max_position_embeddings": (0.0, float(1 << 26), False),
    "attention_factor": (0.0, 1e6, False),
    "beta_fast": (0.0, 1e6, False),
    "beta_slow": (0.0, 1e6, False),
    "mscale": (0.0, 1e6, True),
    "mscale_all_dim": (0.0, 1e6, True),
}


@dataclass(frozen=True)
class SpeculatorsConfig(DrafterConfig):
    """A speculators DSpark drafter's config. ``vocab_size`` is the target's V (input ids,
    ``markov_w1``, the ids on the wire); ``target_layer_ids`` are in DeepSpec numbering
    (``aux_hidden_state_layer_ids`` - 1)."""

    draft_vocab_size: int = 0
    sample_from_anchor: bool = True
    attention_bias: bool = False
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    sliding_window_non_causal: bool = False
    rope_type: str = "default"
    rope_scaling: tuple[tuple[str, float], ...] = ()  # the scaling type's parameters
    max_position_embeddings: int = 32768
    layer_model_type: str = "qwen3"
    verifier: str | None = None  # speculators_config.verifier.name_or_path (written back)

    @property
    def draft_vocab(self) -> int:
        return self.draft_vocab_size

    @property
    def reduced_vocab(self) -> bool:
        return self.draft_vocab_size < self.vocab_size

    @property
    def lead_rows(self) -> int:
        return 0 if self.sample_from_anchor else 1

    @property
    def aux_hidden_state_layer_ids(self) -> tuple[int, ...]:
        return tuple(i + 1 for i in self.target_layer_ids)

    @property
    def sliding_layers(self) -> tuple[int, ...]:
        return tuple(i for i, kind in enumerate(self.layer_types) if kind == "sliding_attention")

    def rope_param(self, name: str, default: float | None = None) -> float | None:
        return dict(self.rope_scaling).get(name, default)

    @property
    def rope_original_length(self) -> float:
        """The pre-scaling context length (``original_max_position_embeddings``, by default
        ``max_position_embeddings``, as transformers fills it)."""
        return cast(float, self.rope_param("original_max_position_embeddings",
                                           float(self.max_position_embeddings)))

    def to_json_dict(self) -> dict[str, Any]:
        """config.json in the layout speculators' ``save_pretrained`` writes (the keys this
        family reads)."""
        rope: dict[str, Any] = {"rope_type": self.rope_type, "rope_theta": self.rope_theta}
        rope.update({k: (bool(v) if k == "truncate" else v) for k, v in self.rope_scaling})
        layer: dict[str, Any] = {
            "model_type": self.layer_model_type,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "hidden_act": HIDDEN_ACT,
            "attention_bias": self.attention_bias,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_parameters": rope,
            "layer_types": list(self.layer_types),
            "use_sliding_window": self.sliding_window is not None,
            "sliding_window": self.sliding_window,
        }
        return {
            "architectures": list(ARCHITECTURES),
            MODEL_TYPE_KEY: "dspark",
            "transformer_layer_config": layer,
            "draft_vocab_size": self.draft_vocab_size,
            "block_size": self.block_size,
            "sample_from_anchor": self.sample_from_anchor,
            "aux_hidden_state_layer_ids": list(self.aux_hidden_state_layer_ids),
            "mask_token_id": self.mask_token_id,
            "target_hidden_size": None,
            "sliding_window_non_causal": self.sliding_window_non_causal,
            "markov_rank": self.markov_rank,
            "markov_head_type": self.markov_head_type,
            "enable_confidence_head": self.enable_confidence_head,
            "confidence_head_with_markov": self.confidence_head_with_markov,
            "speculators_config": {
                "algorithm": "dspark",
                "proposal_methods": [{"proposal_type": "greedy",
                                      "speculative_tokens": self.num_spec}],
                "verifier": {"name_or_path": self.verifier},
            },
        }

    def validated(self, source: str = "config") -> SpeculatorsConfig:
        def fail(field: str, value: object, why: str, limit: object = None) -> None:
            raise DrafterConfigError(f"{source}: {field} {value!r} {why}", field=field,
                                     value=value, limit=limit)

        super().validated(source)
        if not 2 <= self.draft_vocab_size <= self.vocab_size:
            fail("draft_vocab_size", self.draft_vocab_size,
                 f"is outside [2, transformer_layer_config.vocab_size {self.vocab_size}]")
        if len(self.layer_types) != self.num_hidden_layers:
            fail("transformer_layer_config.layer_types", list(self.layer_types),
                 f"must list one type per draft layer (num_hidden_layers"
                 f" {self.num_hidden_layers})")
        for kind in self.layer_types:
            if kind not in LAYER_TYPES:
                fail("transformer_layer_config.layer_types", kind,
                     f"is not supported (one of {list(LAYER_TYPES)})")
        if self.sliding_layers and (self.sliding_window is None or self.sliding_window < 1):
            fail("transformer_layer_config.sliding_window", self.sliding_window,
                 "must be a positive integer where layer_types has sliding_attention"
                 " (use_sliding_window true)")
        if self.rope_type not in ROPE_TYPES:
            fail("transformer_layer_config.rope_parameters.rope_type", self.rope_type,
                 f"is not supported (one of {list(ROPE_TYPES)})")
        for name in ROPE_REQUIRED[self.rope_type]:
            if self.rope_param(name) is None:
                fail(f"transformer_layer_config.rope_parameters.{name}", None,
                     f"is missing (rope_type {self.rope_type!r} needs it)")
        for name, value in self.rope_scaling:
            low, high, low_ok = ROPE_RANGES.get(name, (-math.inf, math.inf, True))
            if not (math.isfinite(value) and (low <= value if low_ok else low < value)
                    and value <= high):
                fail(f"transformer_layer_config.rope_parameters.{name}", value,
                     f"must be a finite number in {'[' if low_ok else '('}{low:g}, {high:g}]",
                     high)
        low_f, high_f = self.rope_param("low_freq_factor"), self.rope_param("high_freq_factor")
        if low_f is not None and high_f is not None and not high_f > low_f:
            fail("transformer_layer_config.rope_parameters.high_freq_factor", high_f,
                 f"must be above low_freq_factor {low_f} (llama3 interpolates between them)",
                 low_f)
        if self.rope_type != "default" and not self.rope_original_length > 0:
            fail("transformer_layer_config.max_position_embeddings",
                 self.max_position_embeddings, "must be positive (the scaling's original"
                 " context length)", 0)
        return self


# -- config.json ------------------------------------------------------------------------------


def model_type_of(raw: Mapping[str, Any]) -> str | None:
    value = raw.get(MODEL_TYPE_KEY)
    return value if isinstance(value, str) else None


def parse_speculators_config(raw: Mapping[str, Any],
                             source: str = "config.json") -> SpeculatorsConfig:
    """A validated :class:`SpeculatorsConfig` from a speculators DSpark config.json."""
    kind = raw.get(MODEL_TYPE_KEY)
    if kind not in SPECULATORS_MODEL_TYPES:
        raise DrafterConfigError(
            f"{source}: {MODEL_TYPE_KEY} {kind!r} is not supported (not a DSpark drafter; the"
            f" worker serves {list(SPECULATORS_MODEL_TYPES)})", field=MODEL_TYPE_KEY,
            value=kind)
    r = ConfigReader(raw, source)
    geometry = layer_geometry(r, transformer_layer_config(raw, source), LAYER_PREFIX)
    top = top_level(r, TOP_DEFAULTS)
    markov_rank = top["markov_rank"]
    conf = top["enable_confidence_head"]
    with_markov = conf and top["confidence_head_with_markov"]
    if with_markov and markov_rank == 0:
        raise DrafterConfigError(
            f"{source}: confidence_head_with_markov true needs markov_rank > 0 (markov_rank 0:"
            " no Markov head)", field="confidence_head_with_markov", value=True)
    config = SpeculatorsConfig(
        **geometry,
        **shared_top_level(r, raw, top, geometry["hidden_size"]),
        markov_rank=markov_rank,
        markov_head_type=top["markov_head_type"],
        enable_confidence_head=conf,
        confidence_head_with_markov=with_markov,
    )
    config.validated(source)
    check_speculative_tokens(raw, config, source)
    return config


LAYER_PREFIX = "transformer_layer_config."


def transformer_layer_config(raw: Mapping[str, Any], source: str) -> Mapping[str, Any]:
    """The nested decoder config of a speculators checkpoint, with the top-level options this
    family refuses checked first."""
    layer = raw.get("transformer_layer_config")
    if not isinstance(layer, Mapping):
        raise DrafterConfigError(
            f"{source}: transformer_layer_config {layer!r} is missing or not an object",
            field="transformer_layer_config", value=layer)
    r = ConfigReader(raw, source)
    for name, supported, what in UNSUPPORTED:
        value = r.get(name, default=None)
        if value is not None and value != supported:
            raise DrafterConfigError(f"{source}: {name} {value!r} is not supported ({what}:"
                                     f" {supported!r})", field=name, value=value)
    return layer


def layer_geometry(r: ConfigReader, layer: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    """The decoder geometry of a Qwen3- or Llama-config mapping (``layer``, spelled
    ``<prefix><key>`` in errors: the nested ``transformer_layer_config`` of a speculators
    checkpoint, or the top level of a z-lab one) as config fields; a missing key takes the config
    class's default."""
    source = r.source
    layer_kind = layer.get("model_type", "qwen3")
    if layer_kind not in LAYER_MODEL_TYPES:
        raise DrafterConfigError(
            f"{source}: {prefix}model_type {layer_kind!r} is not supported"
            f" (one of {list(LAYER_MODEL_TYPES)})", field=f"{prefix}model_type",
            value=layer_kind)
    lay = _LayerReader(r, layer_kind, prefix)
    act = lay.get("hidden_act")
    if act != HIDDEN_ACT:
        raise DrafterConfigError(
            f"{source}: {prefix}hidden_act {act!r} is not supported (only"
            f" {HIDDEN_ACT!r})", field=f"{prefix}hidden_act", value=act)
    hidden = lay.int_("hidden_size")
    heads = lay.int_("num_attention_heads")
    num_layers = lay.int_("num_hidden_layers")
    layer_types, window = _layer_types(lay, num_layers, source)
    rope_type, theta, scaling = _rope(r, layer, source, prefix)
    if rope_type != "default" and isinstance(layer.get("original_max_position_embeddings"), int):
        # transformers gives a top-level original_max_position_embeddings priority (Phi3's)
        scaling = tuple(sorted(dict(scaling, original_max_position_embeddings=float(
            layer["original_max_position_embeddings"])).items()))
    return {
        "hidden_size": hidden,
        "num_hidden_layers": num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": lay.int_("num_key_value_heads", fallback=heads),
        "head_dim": lay.int_("head_dim", fallback=hidden // heads if heads > 0 else 0),
        "intermediate_size": lay.int_("intermediate_size"),
        "vocab_size": lay.int_("vocab_size"),
        "rms_norm_eps": lay.float_("rms_norm_eps"),
        "rope_theta": theta,
        "attention_bias": lay.bool_("attention_bias"),
        "layer_types": layer_types,
        "sliding_window": window,
        "rope_type": rope_type,
        "rope_scaling": scaling,
        "max_position_embeddings": lay.int_("max_position_embeddings"),
        "layer_model_type": layer_kind,
    }


def top_level(r: ConfigReader, defaults: Mapping[str, Any]) -> dict[str, Any]:
    """Top-level keys with the format class's defaults, each of its default's type."""
    return {name: (r.bool_(name, default=value) if isinstance(value, bool) else
                   r.int_(name, default=value) if isinstance(value, int) else
                   r.str_(name, default=value).lower())
            for name, value in defaults.items()}


def shared_top_level(r: ConfigReader, raw: Mapping[str, Any], top: Mapping[str, Any],
                     hidden: int) -> dict[str, Any]:
    """The config fields every speculators format of this layout (dspark, dflash, dflash2)
    keeps at the top level: taps, block, vocabulary, mask, sliding causality, verifier."""
    source = r.source
    target_hidden = r.get("target_hidden_size", default=None)
    if target_hidden is not None and target_hidden != hidden:
        raise DrafterConfigError(
            f"{source}: target_hidden_size {target_hidden!r} is not supported (fc takes"
            f" n_taps x transformer_layer_config.hidden_size {hidden}: null or {hidden})",
            field="target_hidden_size", value=target_hidden)
    aux = r.int_list("aux_hidden_state_layer_ids")
    if not aux or min(aux) < 0 or any(b <= a for a, b in itertools.pairwise(aux)):
        raise DrafterConfigError(
            f"{source}: aux_hidden_state_layer_ids {aux!r} must be strictly increasing HF"
            " hidden_states indices >= 0 (0 the embedding output, k the output of decoder"
            " layer k - 1)", field="aux_hidden_state_layer_ids", value=aux)
    return {
        "target_layer_ids": tuple(k - 1 for k in aux),
        "block_size": top["block_size"],
        "mask_token_id": r.int_("mask_token_id"),
        "target_hidden_size": hidden,
        "draft_vocab_size": top["draft_vocab_size"],
        "sample_from_anchor": top["sample_from_anchor"],
        "sliding_window_non_causal": top["sliding_window_non_causal"],
        "verifier": _verifier(raw),
    }


def check_speculative_tokens(raw: Mapping[str, Any], config: DrafterConfig,
                             source: str) -> None:
    """``speculators_config.proposal_methods[0].speculative_tokens`` must be the layout's N
    (vLLM sizes its query block from it; speculators always runs B rows)."""
    tokens = _speculative_tokens(raw)
    if tokens is not None and tokens != config.num_spec:
        anchor = getattr(config, "sample_from_anchor", True)
        raise DrafterConfigError(
            f"{source}: speculators_config.proposal_methods[0].speculative_tokens {tokens!r}"
            f" disagrees with the layout's N {config.num_spec} (block_size"
            f" {config.block_size}, sample_from_anchor {str(anchor).lower()})",
            field="speculative_tokens", value=tokens)


class _LayerReader:
    """Decoder-config keys with their config-class defaults (``LAYER_DEFAULTS[kind]``); errors
    name the key as ``<prefix><key>``."""

    def __init__(self, r: ConfigReader, kind: str, prefix: str) -> None:
        self.r, self.kind, self.prefix = r, kind, prefix
        self.defaults = LAYER_DEFAULTS[kind]

    def get(self, key: str) -> Any:
        return self.r.get(self.prefix + key, default=self.defaults.get(key))

    def int_(self, key: str, fallback: int | None = None) -> int:
        default = self.defaults.get(key)
        value: int = self.r.int_(self.prefix + key,
                                 default=fallback if default is None else default)
        return value

    def float_(self, key: str) -> float:
        return self.r.float_(self.prefix + key, default=self.defaults[key])

    def bool_(self, key: str) -> bool:
        return self.r.bool_(self.prefix + key, default=self.defaults[key])


def _layer_types(lay: _LayerReader, num_layers: int,
                 source: str) -> tuple[tuple[str, ...], int | None]:
    """Each draft layer's attention type and the sliding window, as transformers' config class
    derives them. Qwen3Config: ``sliding_window`` only with ``use_sliding_window``; without
    ``layer_types`` a layer slides from ``max_window_layers`` on. LlamaConfig knows neither
    key: it keeps both as they are written (and a layer slides only where ``layer_types``
    says so), which is what speculators reads."""
    where = f"{lay.prefix}sliding_window"
    if lay.kind == "llama":
        window = lay.r.get(where, default=None)
    else:
        window = lay.get("sliding_window") if lay.bool_("use_sliding_window") else None
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)):
        raise DrafterConfigError(f"{source}: {where} {window!r} is not an integer",
                                 field=where, value=window)
    types = lay.get("layer_types")
    if types is None:
        first = lay.int_("max_window_layers") if lay.kind != "llama" else num_layers
        types = ["sliding_attention" if window is not None and i >= first else "full_attention"
                 for i in range(num_layers)]
    if not isinstance(types, list) or not all(isinstance(t, str) for t in types):
        raise DrafterConfigError(
            f"{source}: {lay.prefix}layer_types {types!r} is not a list of names",
            field=f"{lay.prefix}layer_types", value=types)
    return tuple(types), window


def _rope(r: ConfigReader, layer: Mapping[str, Any], source: str, prefix: str = LAYER_PREFIX
          ) -> tuple[str, float, tuple[tuple[str, float], ...]]:
    """(rope_type, rope_theta, scaling parameters) from ``rope_parameters`` (transformers 5;
    a per-layer-type mapping uses its ``sliding_attention`` entry for every layer, as
    speculators does) or ``rope_theta`` / ``rope_scaling`` (transformers 4)."""
    where = f"{prefix}rope_parameters"
    params = layer.get("rope_parameters")
    if params is None:
        where = f"{prefix}rope_scaling"
        given = layer.get("rope_scaling") or {}
        if not isinstance(given, Mapping):
            raise DrafterConfigError(f"{source}: {where} {given!r} is not an object",
                                     field=where, value=given)
        params = dict(given)
        if layer.get("rope_theta") is not None:
            params["rope_theta"] = layer["rope_theta"]
    if not isinstance(params, Mapping):
        raise DrafterConfigError(f"{source}: {where} {params!r} is not an object",
                                 field=where, value=params)
    for kind in ("sliding_attention", "full_attention"):
        if isinstance(params.get(kind), Mapping):
            where, params = f"{where}.{kind}", params[kind]
            break
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise DrafterConfigError(
            f"{source}: {where}.rope_type {rope_type!r} is not supported (one of"
            f" {list(ROPE_TYPES)})", field=f"{where}.rope_type", value=rope_type)
    theta = params.get("rope_theta", DEFAULT_ROPE_THETA)
    if isinstance(theta, bool) or not isinstance(theta, int | float):
        raise DrafterConfigError(f"{source}: {where}.rope_theta {theta!r} is not a number",
                                 field=f"{where}.rope_theta", value=theta)
    if not (math.isfinite(theta) and theta > 1):
        raise DrafterConfigError(f"{source}: {where}.rope_theta {theta!r} must be a finite"
                                 " number above 1 (the rotary base; the yarn correction"
                                 " divides by its logarithm)", field=f"{where}.rope_theta",
                                 value=theta, limit=1)
    partial = params.get("partial_rotary_factor", layer.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise DrafterConfigError(
            f"{source}: {where}.partial_rotary_factor {partial!r} is not supported (only 1.0)",
            field=f"{where}.partial_rotary_factor", value=partial)
    known = set(ROPE_REQUIRED[rope_type]) | set(ROPE_OPTIONAL[rope_type])
    ignored = {"rope_type", "type", "rope_theta", "partial_rotary_factor"}
    scaling: list[tuple[str, float]] = []
    for name, value in sorted(params.items()):
        if name in ignored or value is None:
            continue
        if name not in known:
            raise DrafterConfigError(
                f"{source}: {where}.{name} {value!r} is not supported for rope_type"
                f" {rope_type!r} (it takes {sorted(known)})", field=f"{where}.{name}",
                value=value)
        if not isinstance(value, int | float) or (isinstance(value, bool) and name != "truncate"):
            raise DrafterConfigError(f"{source}: {where}.{name} {value!r} is not a number",
                                     field=f"{where}.{name}", value=value)
        scaling.append((name, float(value)))
    return str(rope_type), float(theta), tuple(scaling)


def _speculative_tokens(raw: Mapping[str, Any]) -> int | None:
    methods = (raw.get("speculators_config") or {}).get("proposal_methods")
    if isinstance(methods, list) and methods and isinstance(methods[0], Mapping):
        value = methods[0].get("speculative_tokens")
        return value if isinstance(value, int) and not isinstance(value, bool) else None
    return None


def _verifier(raw: Mapping[str, Any]) -> str | None:
    verifier = (raw.get("speculators_config") or {}).get("verifier")
    name = verifier.get("name_or_path") if isinstance(verifier, Mapping) else None
    return name if isinstance(name, str) else None


# -- checkpoint layout ----------------------------------------------------------------------------


def speculators_shapes(c: DrafterConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the drafter runs with and its shape: the Qwen3 layout with ``lm_head`` and
    ``markov_w2`` over the draft vocabulary, the attention biases, and ``d2t`` / ``t2d`` for a
    reduced vocabulary. ``embed_tokens`` (and on a full vocabulary ``lm_head``) are the
    target's (:func:`from_target`)."""
    c = _speculators(c)
    shapes = expected_shapes(c)
    d, hd = c.hidden_size, c.head_dim
    shapes["lm_head.weight"] = (c.draft_vocab_size, d)
    if c.attention_bias:
        q_dim, kv_dim = c.num_attention_heads * hd, c.num_key_value_heads * hd
        for i in range(c.num_hidden_layers):
            p = f"layers.{i}.self_attn."
            shapes.update({p + "q_proj.bias": (q_dim,), p + "k_proj.bias": (kv_dim,),
                           p + "v_proj.bias": (kv_dim,), p + "o_proj.bias": (d,)})
    if c.reduced_vocab:
        shapes["d2t"] = (c.draft_vocab_size,)
        shapes["t2d"] = (c.vocab_size,)
    return shapes


def from_target(c: DrafterConfig) -> tuple[str, ...]:
    """Tensors that only the target checkpoint may supply (speculators never saves them)."""
    c = _speculators(c)
    return ("embed_tokens.weight",) if c.reduced_vocab else ("embed_tokens.weight",
                                                              "lm_head.weight")


def check_vocab_map(d2t: Tensor, t2d: Tensor, vocab: int) -> None:
    """``d + d2t[d]`` must be increasing target ids in [0, vocab), exactly those ``t2d``
    marks: the order q's canonical form keeps (9.1 step 6) and what speculators builds."""
    ids = torch.arange(d2t.numel(), dtype=torch.int64) + d2t.to(torch.int64)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise ValueError(f"d2t maps draft ids to target ids outside [0, {vocab})"
                         f" ({int(ids.min())} .. {int(ids.max())})")
    if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
        at = int(torch.nonzero(ids[1:] <= ids[:-1])[0, 0])
        raise ValueError(f"d2t is not increasing: draft ids {at} and {at + 1} map to target ids"
                         f" {int(ids[at])} and {int(ids[at + 1])}")
    marked = torch.nonzero(t2d.to(torch.bool)).flatten()
    if marked.numel() != ids.numel() or not bool((marked == ids).all()):
        raise ValueError(f"t2d marks {marked.numel()} target ids, not the {ids.numel()} that"
                         " d2t maps to")


def check_tensors(c: DrafterConfig, tensors: Mapping[str, Tensor]) -> None:
    if _speculators(c).reduced_vocab:
        check_vocab_map(tensors["d2t"], tensors["t2d"], c.vocab_size)


def _speculators(c: DrafterConfig) -> SpeculatorsConfig:
    if not isinstance(c, SpeculatorsConfig):
        raise TypeError(f"the speculators family needs a SpeculatorsConfig, not"
                        f" {type(c).__name__}")
    return c


# -- RoPE -------------------------------------------------------------------------------------


def llama3_inv_freq(inv_freq: Tensor, c: SpeculatorsConfig) -> Tensor:
    """transformers' ``llama3`` rescaling of the default frequencies: long wavelengths divided
    by ``factor``, short ones kept, the band between interpolated."""
    factor = cast(float, c.rope_param("factor"))
    low = cast(float, c.rope_param("low_freq_factor"))
    high = cast(float, c.rope_param("high_freq_factor"))
    old_len = c.rope_original_length
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's m(factor, k): 1 up to factor 1, else 0.1 k ln(factor) + 1."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_inv_freq(c: SpeculatorsConfig, device: torch.device) -> tuple[Tensor, float]:
    """transformers' ``yarn`` frequencies and the factor cos and sin are scaled by: each
    frequency pair blends interpolation (÷ factor) and extrapolation by a linear ramp between
    the correction dimensions of ``beta_fast`` and ``beta_slow`` rotations."""
    base, dim = c.rope_theta, c.head_dim
    factor = cast(float, c.rope_param("factor"))  # explicit: transformers 5 only warns when
    original = c.rope_original_length  # it differs from max / original lengths
    attention = c.rope_param("attention_factor")
    mscale, mscale_all = c.rope_param("mscale"), c.rope_param("mscale_all_dim")
    if attention is None:
        attention = (yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all)
                     if mscale and mscale_all else yarn_mscale(factor))
    beta_fast = c.rope_param("beta_fast") or 32.0
    beta_slow = c.rope_param("beta_slow") or 1.0
    truncate = bool(c.rope_param("truncate", 1.0))
    return (yarn_frequencies(base, dim, factor, original, beta_fast, beta_slow, truncate,
                             device), float(attention))


def yarn_frequencies(base: float, dim: int, factor: float, original: float, beta_fast: float,
                     beta_slow: float, truncate: bool, device: torch.device) -> Tensor:
    """YaRN's inverse frequencies [dim / 2] fp32 (transformers' and vLLM's alike): each pair
    blends interpolation (÷ factor) and extrapolation by a linear ramp between the correction
    dimensions of ``beta_fast`` and ``beta_slow`` rotations over ``original`` positions."""

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    pos_freqs = base ** (torch.arange(0, dim, 2, device=device).float() / dim)  # [hd/2]
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device=device) - low)
                       / (high - low), 0, 1)
    keep = 1 - ramp  # [hd/2] weight of extrapolation
    out: Tensor = interpolation * (1 - keep) + extrapolation * keep
    return out


# -- the network ------------------------------------------------------------------------------


class SpeculatorsDrafterModel(DrafterModel):
    """The speculators family's weights and forward pieces (see the module docstring). Ingest
    (``project_context_kv``, biases included) is the Qwen3 family's."""

    config: SpeculatorsConfig
    d2t: Tensor  # [Vd] int64 target id - draft id (reduced vocabulary only)
    t2d: Tensor  # [V] bool (reduced vocabulary only)

    def __init__(self, config: DrafterConfig) -> None:
        # Biased layers, a draft-vocabulary head and the d2t map: DrafterModel's constructor
        # would build other shapes, so it is not run.
        nn.Module.__init__(self)
        c = _speculators(config)
        self.config = c
        self.embed_tokens = _embedding(c.vocab_size, c.hidden_size)
        self.fc = nn.Linear(c.tap_width, c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(c, bias=c.attention_bias)
                                    for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.markov_head = MarkovHead(c) if c.has_markov_head else None
        self.confidence_head = ConfidenceHead(c) if c.enable_confidence_head else None
        if c.reduced_vocab:
            self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.int64))
            self.register_buffer("t2d", torch.zeros(c.vocab_size, dtype=torch.bool))
        self.scaling = c.head_dim**-0.5
        self.attention_scaling = 1.0  # yarn's cos/sin factor (init_buffers)
        self.init_buffers()

    def inv_freq_values(self, device: torch.device) -> Tensor:
        c = self.config
        if c.rope_type == "yarn":
            inv_freq, self.attention_scaling = yarn_inv_freq(c, device)
            return inv_freq
        inv_freq = super().inv_freq_values(device)
        return llama3_inv_freq(inv_freq, c) if c.rope_type == "llama3" else inv_freq

    def rope(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        if self.attention_scaling == 1.0:
            return super().rope(positions)
        freqs = positions.float().unsqueeze(-1) * self.inv_freq  # [..., hd/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [..., hd]
        dtype = self.fc.weight.dtype
        scale = self.attention_scaling
        return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)

    def target_ids(self, ids: Tensor) -> Tensor:
        if not self.config.reduced_vocab:
            return ids
        return ids + self.d2t[ids]

    def block_mask(self, n: int, device: torch.device) -> Tensor | None:
        """The additive causal mask of a sliding layer's block rows [G*N, N] fp32 (row j sees
        rows 0..j), None where sliding layers are non-causal."""
        if self.config.sliding_window_non_causal:
            return None
        rows = torch.arange(n, device=device)
        return self._block_bias(rows.unsqueeze(1) >= rows.unsqueeze(0))  # key row <= query row

    def _block_bias(self, visible: Tensor) -> Tensor:
        """The additive bias of block rows [G*N, N] fp32 (repeat_kv order): 0 where
        ``visible`` [N, N] (query row, key row), -inf elsewhere."""
        bias = torch.zeros(visible.shape, dtype=torch.float32, device=visible.device)
        bias.masked_fill_(~visible, float("-inf"))
        return bias.repeat(self.config.num_kv_groups, 1)

    def embed_block(self, block_ids: Tensor) -> Tensor:
        """The block's input embeddings [B, N, d] (the target's embedding of its ids)."""
        h: Tensor = self.embed_tokens(block_ids)
        return h

    def layer_biases(self, context: ContextSource, n: int, device: torch.device
                     ) -> list[tuple[Tensor, Tensor | None]]:
        """Each layer's visibility: (context bias [B, 1, 1, S], block bias [G*N, N] or None).
        full: every valid context slot and the whole block; sliding: the newest
        ``sliding_window`` context rows, causal in the block unless non-causal."""
        c = self.config
        full = context_bias(context.valid)  # [B, 1, 1, S]
        if not c.sliding_layers:
            return [(full, None)] * c.num_hidden_layers
        sliding = context_bias(context.newest(cast(int, c.sliding_window)))  # [B, 1, 1, S]
        blk = self.block_mask(n, device)  # [G*N, N] or None
        return [(sliding, blk) if kind == "sliding_attention" else (full, None)
                for kind in c.layer_types]

    def attention(self, index: int, layer: DecoderLayer, x: Tensor, cos: Tensor, sin: Tensor,
                  context: ContextSource, ctx_bias: Tensor, blk_bias: Tensor | None) -> Tensor:
        """The attention output (o_proj applied) [B, N, d] of ``layer`` (number ``index``) for
        the block's normed rows x [B, N, d]; cos, sin [B, 1, N, hd]."""
        c = self.config
        b, n = x.shape[0], x.shape[1]
        nh, hkv, g, hd = c.num_attention_heads, c.num_key_value_heads, c.num_kv_groups, c.head_dim
        attn = layer.self_attn
        q = attn.q_norm(attn.q_proj(x).view(b, n, nh, hd)).transpose(1, 2)  # [B, H, N, D]
        q = q * cos + rotate_half(q) * sin  # [B, H, N, D]
        q = q.reshape(b, hkv, g * n, hd)  # [B, Hkv, G*N, D] (repeat_kv order)
        k = attn.k_norm(attn.k_proj(x).view(b, n, hkv, hd)).transpose(1, 2)  # [B, Hkv, N, D]
        k = k * cos + rotate_half(k) * sin  # [B, Hkv, N, D]
        v = attn.v_proj(x).view(b, n, hkv, hd).transpose(1, 2)  # [B, Hkv, N, D]
        k_ctx, v_ctx = context.layer(index)  # [B, Hkv, S, D] each
        out = attend(q, k, v, k_ctx, v_ctx, ctx_bias, self.scaling, blk_bias)  # [B, Hkv, G*N, D]
        out = out.view(b, nh, n, hd).transpose(1, 2).reshape(b, n, nh * hd)  # [B, N, H*D]
        o: Tensor = attn.o_proj(out)  # [B, N, d]
        return o

    def backbone(self, block_ids: Tensor, block_pos: Tensor, context: ContextSource) -> Tensor:
        """Final hidden states hf [B, N, d]: the Qwen3 backbone with each layer's visibility
        (:meth:`layer_biases`) and, where a layer has them, the in-block convolutions around
        its attention and its MLP (``prepare`` before, ``finish`` after)."""
        n = block_ids.shape[1]
        h = self.embed_block(block_ids)  # [B, N, d]
        cos, sin = self.rope(block_pos)  # [B, N, hd]
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [B, 1, N, hd]
        biases = self.layer_biases(context, n, block_ids.device)
        for index, layer in enumerate(self.decoder_layers):
            ctx_bias, blk_bias = biases[index]
            x = layer.input_layernorm(h)  # [B, N, d]
            conv = layer.attention_conv
            if conv is None:
                h = h + self.attention(index, layer, x, cos, sin, context, ctx_bias, blk_bias)
            else:
                x, delta = conv.prepare(x)
                o = self.attention(index, layer, x, cos, sin, context, ctx_bias, blk_bias)
                h = h + conv.finish(o, delta)  # [B, N, d]
            y = layer.post_attention_layernorm(h)  # [B, N, d]
            conv = layer.mlp_conv
            if conv is None:
                h = h + layer.mlp(y)  # [B, N, d]
            else:
                y, delta = conv.prepare(y)
                h = h + conv.finish(layer.mlp(y), delta)  # [B, N, d]
        hf: Tensor = self.norm(h)  # [B, N, d]
        return hf
