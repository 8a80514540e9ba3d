"""The DFlash family: DFlash and DFlash2 drafters in speculators' format
(``speculators_model_type`` ``dflash`` / ``dflash2``) and in z-lab's (a Qwen3Config dump with
``architectures`` ``DFlashDraftModel`` / ``DFlash2DraftModel`` and a ``dflash_config``, legacy or
nested); docs/architecture.md, "Model families".

DFlash is the speculators family's backbone with no Markov and no confidence head; what differs,
and nothing else:

- N = block_size - 1 by default: the anchor is the bonus token and rows 1..B-1 draft the
  positions after it (speculators' ``sample_from_anchor`` true: N = B, as DSpark);
- z-lab: the geometry at the top level (dflash_config's value first), taps numbered as they are
  (``target_layer_ids``: DeepSpec's numbering), the full target vocabulary, the block's
  embeddings times ``input_embedding_scale``, the logits times ``output_multiplier`` and then
  soft-capped by ``final_logit_softcapping``; attention per z-lab's newer code: a sliding layer
  reads, per query row r at position p, the keys at p - S < pos <= p (row r sees the newest
  S - 1 - r context rows), symmetric |p - pos| < S where ``is_causal`` is false; a full layer is
  causal only where ``is_causal`` is true (speculators: the same S rows for every block row,
  full layers never causal);
- DFlash2: a grouped dynamic causal convolution over the block rows before and after each
  layer's attention and MLP (``attention_conv``, ``mlp_conv``), and the candidate selector: the
  ``selector_top_k`` best base logits reranked by ``U[c] + (P[prev] * proj(hf)) . Q[c]``, the
  previous draft (the anchor first) as predecessor (:class:`CandidateSelector`, run by the
  walk's candidate path). A sampled lane draws from those scores as the logits of its k
  candidates (contract section 9, as z-lab's own sampled mode does).

No head means no confidence: the model has no ``confidence_head``, every drafted position's
confidence is 1.0 and the worker says so (``CAP_NO_CONFIDENCE``, ``RPF_NO_CONFIDENCE``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from protocol import formats

from .config import ConfigReader, DrafterConfig, DrafterConfigError
from .limits import MAX_SCALE, MAX_SOFTCAP
from .model import ContextSource, MarkovHead, context_bias, per_query_window_bias
from .speculators import (
    LAYER_PREFIX,
    MODEL_TYPE_KEY,
    SpeculatorsConfig,
    SpeculatorsDrafterModel,
    check_speculative_tokens,
    layer_geometry,
    shared_top_level,
    speculators_shapes,
    top_level,
    transformer_layer_config,
)
from .speculators import check_tensors as speculators_check_tensors
from .speculators import from_target as speculators_from_target

ARCHITECTURES = tuple(formats.DFLASH_ARCHITECTURES)
# speculators' DFlashSpeculatorConfig / DFlash2SpeculatorConfig defaults.
SPECULATORS_DEFAULTS: dict[int, dict[str, Any]] = {
    1: {"draft_vocab_size": 32000, "block_size": 8, "sample_from_anchor": False,
        "sliding_window_non_causal": False},
    2: {"draft_vocab_size": 32000, "block_size": 8, "sample_from_anchor": False,
        "sliding_window_non_causal": True},
}
DFLASH2_DEFAULTS: dict[str, int] = {"conv_kernel_size": 2, "conv_group_size": 16,
                                    "selector_rank": 256, "selector_top_k": 16}
# z-lab's newer code (dflash/model.py, the one that reads the nested layout) drafts blocks of 16
# where neither dflash_config nor the top level sets block_size.
ZLAB_DEFAULT_BLOCK = 16
# dflash_config keys z-lab's code reads (each may also sit at the top level, dflash_config first).
ZLAB_KEYS = ("target_layer_ids", "mask_token_id", "block_size", "input_embedding_scale",
             "output_multiplier", "final_logit_softcapping", "conv_kernel_size",
             "conv_group_size", "selector_rank", "selector_top_k", "projector_type")
# Options other DFlash implementations (vLLM 0.34's qwen3_dflash, Laguna/gpt-oss-style drafters)
# read that change the computation: refused unless they hold what this family runs (None: must
# be absent or null), in dflash_config or at the top level.
ZLAB_UNSUPPORTED: tuple[tuple[str, object, str], ...] = (
    ("use_swa", False, "vLLM's sliding-window switch; the layers' sliding windows come from"
     " layer_types and sliding_window"),
    ("swa_window_size", None, "vLLM's sliding-window size"),
    ("causal", None, "vLLM's causal override; z-lab's own is the top-level is_causal"),
    ("attention_sink_bias", None, "attention sinks"),
    ("attention_value_scale", None, "a scale on the attention values"),
    ("attention_mode", None, "another attention mode"),
    ("projector_type", "dflash", "the dflash projector only"),
    ("is_neox_style", True, "neox-style rotary halves only"),
    ("no_rope_layers", None, "layers without RoPE"),
)
# Tensors of other DFlash variants, refused with what they are (a name not in the layout).
FOREIGN_TENSORS: tuple[tuple[str, str], ...] = (
    ("qkv_proj", "fused q/k/v projections (split them into q_proj, k_proj and v_proj)"),
    ("g_proj", "an attention output gate"),
    ("aux_hidden_norms", "per-tap norms of the target's hidden states"),
    ("sinks", "attention sinks"),
)
MASK_EMBEDDING_FILE = "mask_embedding.pt"


@dataclass(frozen=True)
class DFlashConfig(SpeculatorsConfig):
    """A DFlash or DFlash2 drafter's config in either format: the speculators fields (no Markov
    or confidence head) and z-lab's. ``target_layer_ids`` in DeepSpec numbering."""

    layout: str = "speculators"  # or "zlab"
    version: int = 1  # 2: DFlash2
    is_causal: bool | None = None  # z-lab's top-level is_causal (None: unset)
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    conv_kernel_size: int = 0
    conv_group_size: int = 0
    selector_rank: int = 0
    selector_top_k: int = 0

    @property
    def format(self) -> str:
        """``speculators-dflash``, ``speculators-dflash2``, ``zlab-dflash``, ``zlab-dflash2``."""
        return f"{self.layout}-dflash{'2' if self.version == 2 else ''}"

    @property
    def zlab(self) -> bool:
        return self.layout == "zlab"

    def causal(self, kind: str) -> bool:
        """Whether a layer of ``kind`` is causal inside the block."""
        if self.zlab:
            return kind == "sliding_attention" if self.is_causal is None else self.is_causal
        return kind == "sliding_attention" and not self.sliding_window_non_causal

    def to_json_dict(self) -> dict[str, Any]:
        """config.json in the layout of the format (z-lab: the nested dflash_config one)."""
        out = super().to_json_dict()
        for key in ("markov_rank", "markov_head_type", "enable_confidence_head",
                    "confidence_head_with_markov"):
            del out[key]
        dflash2 = {"conv_kernel_size": self.conv_kernel_size,
                   "conv_group_size": self.conv_group_size, "selector_rank": self.selector_rank,
                   "selector_top_k": self.selector_top_k} if self.version == 2 else {}
        arch = ARCHITECTURES[self.version - 1]
        if not self.zlab:
            kind = "dflash2" if self.version == 2 else "dflash"
            out.update(architectures=[arch], **{MODEL_TYPE_KEY: kind}, **dflash2)
            out["speculators_config"]["algorithm"] = kind
            return out
        layer = out["transformer_layer_config"]
        rope = layer.pop("rope_parameters")
        zlab: dict[str, Any] = dict(layer, architectures=[arch], rope_parameters=rope,
                                    num_target_layers=self.num_target_layers,
                                    tie_word_embeddings=False)
        zlab["dflash_config"] = {
            "block_size": self.block_size, "mask_token_id": self.mask_token_id,
            "target_layer_ids": list(self.target_layer_ids),
            "input_embedding_scale": self.input_embedding_scale,
            "output_multiplier": self.output_multiplier,
            "final_logit_softcapping": self.final_logit_softcapping, **dflash2}
        if self.is_causal is not None:
            zlab["is_causal"] = self.is_causal
        if self.num_target_layers is None:
            del zlab["num_target_layers"]
        return zlab

    def validated(self, source: str = "config") -> DFlashConfig:
        def fail(field: str, value: object, why: str) -> None:
            raise DrafterConfigError(f"{source}: {field} {value!r} {why}", field=field,
                                     value=value)

        where = "" if self.zlab else LAYER_PREFIX
        if self.block_size < 2:
            fail("block_size", self.block_size, "must be at least 2 (the anchor and a draft)")
        super().validated(source)
        if self.markov_rank or self.enable_confidence_head:
            fail("markov_rank", self.markov_rank, "must be 0: a DFlash drafter has no Markov or"
                 " confidence head")
        for name in ("input_embedding_scale", "output_multiplier"):
            value = getattr(self, name)
            if not math.isfinite(value) or value == 0 or abs(value) > MAX_SCALE:
                fail(name, value, f"must be a finite non-zero number of magnitude at most"
                     f" {MAX_SCALE:g}")
        cap = self.final_logit_softcapping
        if cap is not None and not (math.isfinite(cap) and 0 < cap <= MAX_SOFTCAP):
            fail("final_logit_softcapping", cap, f"must be a number in (0, {MAX_SOFTCAP:g}] or"
                 " null")
        if self.version != 2:
            return self
        if self.reduced_vocab:
            fail("draft_vocab_size", self.draft_vocab_size, f"must be the target's"
                 f" {where}vocab_size {self.vocab_size}: DFlash2 needs the full vocabulary")
        if not 1 <= self.conv_kernel_size <= self.block_size:
            fail("conv_kernel_size", self.conv_kernel_size,
                 f"is outside [1, block_size {self.block_size}]")
        if self.conv_group_size < 1 or self.hidden_size % self.conv_group_size:
            fail("conv_group_size", self.conv_group_size,
                 f"must be a positive divisor of {where}hidden_size {self.hidden_size}")
        if self.selector_rank < 1:
            fail("selector_rank", self.selector_rank, "must be a positive integer")
        if not 2 <= self.selector_top_k <= self.vocab_size:
            fail("selector_top_k", self.selector_top_k,
                 f"is outside [2, {where}vocab_size {self.vocab_size}]")
        return self


# -- config.json ------------------------------------------------------------------------------


def parse_dflash_config(raw: Mapping[str, Any], source: str = "config.json") -> DFlashConfig:
    """A validated :class:`DFlashConfig` from a DFlash config.json of either format."""
    kind = formats.dflash_format(raw, source)
    if kind in (formats.SPECULATORS_DFLASH, formats.SPECULATORS_DFLASH2):
        return _parse_speculators(raw, source, 2 if kind == formats.SPECULATORS_DFLASH2 else 1)
    if kind in (formats.ZLAB_DFLASH, formats.ZLAB_DFLASH2):
        return _parse_zlab(raw, source, 2 if kind == formats.ZLAB_DFLASH2 else 1)
    raise DrafterConfigError(
        f"{source}: not a DFlash drafter ({MODEL_TYPE_KEY} {raw.get(MODEL_TYPE_KEY)!r},"
        f" architectures {raw.get('architectures')!r}; DFlash drafters have {MODEL_TYPE_KEY}"
        f" dflash or dflash2, or architectures {list(ARCHITECTURES)})",
        field="architectures", value=raw.get("architectures"))


def _check_architectures(raw: Mapping[str, Any], source: str, version: int,
                         required: bool) -> None:
    archs = raw.get("architectures")
    want = ARCHITECTURES[version - 1]
    if archs is None and not required:
        return
    if archs != [want]:
        kind = "DFlash2" if version == 2 else "DFlash"
        raise DrafterConfigError(
            f"{source}: architectures {archs!r} is not supported (a {kind} drafter of this"
            f" format has [{want!r}])", field="architectures", value=archs)


def _parse_speculators(raw: Mapping[str, Any], source: str, version: int) -> DFlashConfig:
    _check_architectures(raw, source, version, required=False)
    r = ConfigReader(raw, source)
    for key in ("markov_rank", "enable_confidence_head"):
        value = r.get(key, default=None)
        if value:
            raise DrafterConfigError(
                f"{source}: {key} {value!r} is not supported ({MODEL_TYPE_KEY}"
                f" {raw[MODEL_TYPE_KEY]!r} has no Markov or confidence head; a DSpark"
                f" checkpoint says {MODEL_TYPE_KEY} 'dspark')", field=key, value=value)
    geometry = layer_geometry(r, transformer_layer_config(raw, source), LAYER_PREFIX)
    top = top_level(r, SPECULATORS_DEFAULTS[version])
    extra: dict[str, Any] = top_level(r, DFLASH2_DEFAULTS) if version == 2 else {}
    config = DFlashConfig(
        **geometry,
        **shared_top_level(r, raw, top, geometry["hidden_size"]),
        markov_rank=0, markov_head_type="vanilla", enable_confidence_head=False,
        confidence_head_with_markov=False, layout="speculators", version=version, **extra)
    config.validated(source)
    check_speculative_tokens(raw, config, source)
    return config


def _parse_zlab(raw: Mapping[str, Any], source: str, version: int) -> DFlashConfig:
    _check_architectures(raw, source, version, required=True)
    r = ConfigReader(raw, source)
    model_type = raw.get("model_type", "qwen3")
    if model_type != "qwen3":
        raise DrafterConfigError(
            f"{source}: model_type {model_type!r} is not supported (a z-lab DFlash drafter of"
            " Qwen3 layers only: model_type 'qwen3')", field="model_type", value=model_type)
    nested = raw.get("dflash_config", {})
    if not isinstance(nested, Mapping):
        raise DrafterConfigError(f"{source}: dflash_config {nested!r} is not an object",
                                 field="dflash_config", value=nested)
    for name, supported, what in ZLAB_UNSUPPORTED:
        for spelled in (f"dflash_config.{name}", name):
            value = r.get(spelled, default=None)
            if value is not None and value != supported and value != []:
                need = "absent or null" if supported is None else repr(supported)
                raise DrafterConfigError(
                    f"{source}: {spelled} {value!r} is not supported ({what}; the drafter runs"
                    f" only {need})", field=spelled, value=value)
    unknown = sorted(set(nested) - set(ZLAB_KEYS) - {n for n, _, _ in ZLAB_UNSUPPORTED})
    if unknown:
        raise DrafterConfigError(
            f"{source}: dflash_config.{unknown[0]} {nested[unknown[0]]!r} is not supported"
            f" (dflash_config keys the drafter reads: {list(ZLAB_KEYS)})",
            field=f"dflash_config.{unknown[0]}", value=nested[unknown[0]])
    geometry = layer_geometry(r, raw, "")
    hidden = geometry["hidden_size"]

    def number(name: str, default: float | None) -> float | None:
        got = r.get(f"dflash_config.{name}", (name,), default)
        if got is None:
            return None
        if isinstance(got, bool) or not isinstance(got, int | float):
            raise DrafterConfigError(f"{source}: dflash_config.{name} {got!r} is not a number",
                                     field=f"dflash_config.{name}", value=got)
        return float(got)

    def integer(name: str, default: object) -> int:
        got: int = r.int_(f"dflash_config.{name}", (name,), default)
        return got

    taps = r.int_list("dflash_config.target_layer_ids", ("target_layer_ids",))
    is_causal = r.get("is_causal", default=None)
    if is_causal is not None and not isinstance(is_causal, bool):
        raise DrafterConfigError(f"{source}: is_causal {is_causal!r} is not true, false or null",
                                 field="is_causal", value=is_causal)
    target_hidden = r.get("target_hidden_size", default=None)
    if target_hidden is not None and target_hidden != hidden:
        raise DrafterConfigError(
            f"{source}: target_hidden_size {target_hidden!r} is not supported (fc takes n_taps"
            f" x hidden_size {hidden})", field="target_hidden_size", value=target_hidden)
    cap = number("final_logit_softcapping", None)
    extra: dict[str, Any] = {name: integer(name, default)
                             for name, default in DFLASH2_DEFAULTS.items()} if version == 2 else {}
    config = DFlashConfig(
        **geometry,
        target_layer_ids=tuple(taps),
        block_size=integer("block_size", ZLAB_DEFAULT_BLOCK),
        mask_token_id=r.int_("dflash_config.mask_token_id", ("mask_token_id",)),
        markov_rank=0, markov_head_type="vanilla", enable_confidence_head=False,
        confidence_head_with_markov=False,
        target_hidden_size=hidden,
        num_target_layers=r.int_("num_target_layers", default=None),
        draft_vocab_size=geometry["vocab_size"],
        sample_from_anchor=False,
        layout="zlab", version=version, is_causal=is_causal,
        input_embedding_scale=float(number("input_embedding_scale", 1.0) or 0.0),
        output_multiplier=float(number("output_multiplier", 1.0) or 0.0),
        # z-lab soft-caps only for a cap > 0
        # (a NaN cap is kept, for validated() to refuse by name)
        final_logit_softcapping=None if cap is None or cap <= 0 else cap,
        **extra)
    return config.validated(source)


# -- checkpoint layout ----------------------------------------------------------------------------


def _dflash(c: DrafterConfig) -> DFlashConfig:
    if not isinstance(c, DFlashConfig):
        raise TypeError(f"the dflash family needs a DFlashConfig, not {type(c).__name__}")
    return c


def dflash_shapes(c: DrafterConfig) -> dict[str, tuple[int, ...]]:
    """The speculators layout (no Markov or confidence head) and, for DFlash2, each layer's two
    convolutions and the candidate selector (its codebooks without a ``.weight`` suffix)."""
    c = _dflash(c)
    shapes = speculators_shapes(c)
    if c.version != 2:
        return shapes
    d, k = c.hidden_size, c.conv_kernel_size
    for i in range(c.num_hidden_layers):
        for conv in ("attention_conv", "mlp_conv"):
            p = f"layers.{i}.{conv}."
            shapes[p + "base_kernel"] = (2, k, d)
            shapes[p + "kernel_projection.weight"] = (2 * k * d // c.conv_group_size, d)
    v, rank = c.vocab_size, c.selector_rank
    shapes["candidate_selector.predecessor_codebook"] = (v, rank)
    shapes["candidate_selector.successor_codebook"] = (v, rank)
    shapes["candidate_selector.hidden_projection.weight"] = (rank, d)
    return shapes


def explain_tensor(name: str) -> str | None:
    """What an unexpected tensor is where another DFlash variant has it (None: nothing known)."""
    for part, what in FOREIGN_TENSORS:
        if part in name.split("."):
            return what
    return None


def check_folder(directory: Path) -> None:
    """A checkpoint folder holding ``mask_embedding.pt`` (a learned mask-row embedding vLLM
    reads) drafts with it: refused, not ignored."""
    path = directory / MASK_EMBEDDING_FILE
    if path.exists():
        raise DrafterConfigError(
            f"{path}: a learned mask embedding is not supported (the drafter embeds the mask"
            " rows with the target's embedding of mask_token_id); remove it only if the"
            " drafter was not trained with it", field=MASK_EMBEDDING_FILE, value=str(path))


from_target = speculators_from_target
check_tensors = speculators_check_tensors


# -- the network ------------------------------------------------------------------------------


class GroupedDynamicConv(nn.Module):
    """DFlash2's in-block convolution: ``out[r, ch] = sum_{t < K, t <= r} (base_kernel[s, t, ch]
    + delta_r[s, t, ch // g]) * src[r - t, ch]`` over the block rows, ``delta`` the
    ``kernel_projection`` of the ``prepare`` input (side s = 0 before the sublayer, 1 after)."""

    def __init__(self, hidden: int, kernel_size: int, group_size: int) -> None:
        super().__init__()
        self.kernel_size, self.group_size = kernel_size, group_size
        self.groups = hidden // group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, kernel_size, hidden))
        self.kernel_projection = nn.Linear(hidden, 2 * kernel_size * self.groups, bias=False)

    def prepare(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x [B, N, d] -> (its convolution, the output side's delta [B, N, K, d/g])."""
        b, n, _ = x.shape
        delta = self.kernel_projection(x).view(b, n, 2, self.kernel_size, self.groups)
        return self._convolve(x, delta[:, :, 0], 0), delta[:, :, 1]

    def finish(self, x: Tensor, delta: Tensor) -> Tensor:
        return self._convolve(x, delta, 1)

    def _convolve(self, x: Tensor, delta: Tensor, side: int) -> Tensor:
        b, n, d = x.shape
        rows = x.view(b, n, self.groups, self.group_size)  # [B, N, d/g, g]
        out = torch.zeros_like(rows)
        for t in range(min(self.kernel_size, n)):
            # row r reads row r - t of the block (rows before the block's first count as 0)
            src = rows if t == 0 else F.pad(rows[:, :n - t], (0, 0, 0, 0, t, 0))
            base = self.base_kernel[side, t].view(1, 1, self.groups, self.group_size)
            out = out + src * (base + delta[:, :, t].unsqueeze(-1))  # [B, N, d/g, g]
        return out.view(b, n, d)


class CandidateSelector(MarkovHead):
    """DFlash2's candidate selector as the walk's head: ``e = P[prev]``, ``x = e * proj(hf_j)``,
    bias at candidate c ``Q[c] . x`` (P, Q the predecessor and successor codebooks, [V, r])."""

    def __init__(self, c: DFlashConfig) -> None:
        nn.Module.__init__(self)  # MarkovHead's tensors are not this head's
        self.kind = "selector"
        v, rank = c.vocab_size, c.selector_rank
        self.predecessor_codebook = nn.Parameter(torch.zeros(v, rank))
        self.successor_codebook = nn.Parameter(torch.zeros(v, rank))
        self.hidden_projection = nn.Linear(c.hidden_size, rank, bias=False)

    def step(self, prev: Tensor, hf_j: Tensor, state: Tensor | None
             ) -> tuple[Tensor, Tensor, Tensor | None]:
        e, x, state = self.step_input(prev, hf_j, state)
        return e, F.linear(x, self.successor_codebook), state  # bias [B, V]

    def step_input(self, prev: Tensor, hf_j: Tensor, state: Tensor | None
                   ) -> tuple[Tensor, Tensor, Tensor | None]:
        e = F.embedding(prev, self.predecessor_codebook)  # [B, r]
        return e, e * self.hidden_projection(hf_j), state

    def bias_at(self, x: Tensor, ids: Tensor) -> Tensor:
        rows = F.embedding(ids, self.successor_codebook)  # [B, K, r]
        out: Tensor = torch.bmm(rows, x.unsqueeze(2)).squeeze(2)  # [B, K]
        return out


class DFlashDrafterModel(SpeculatorsDrafterModel):
    """The DFlash family's weights and forward pieces (see the module docstring): the
    speculators backbone and ingest, z-lab's visibility, scales and logit transform, DFlash2's
    convolutions and selector."""

    config: DFlashConfig

    def __init__(self, config: DrafterConfig) -> None:
        c = _dflash(config)
        super().__init__(c)
        self.candidate_selector: CandidateSelector | None = None
        if c.version == 2:
            for layer in self.decoder_layers:
                layer.attention_conv = GroupedDynamicConv(c.hidden_size, c.conv_kernel_size,
                                                          c.conv_group_size)
                layer.mlp_conv = GroupedDynamicConv(c.hidden_size, c.conv_kernel_size,
                                                    c.conv_group_size)
            self.candidate_selector = CandidateSelector(c)
            self.walk_candidates = c.selector_top_k

    @property
    def walk_head(self) -> MarkovHead | None:
        return self.candidate_selector

    def embed_block(self, block_ids: Tensor) -> Tensor:
        h: Tensor = self.embed_tokens(block_ids)  # [B, N, d]
        scale = self.config.input_embedding_scale
        return h if scale == 1.0 else h * scale

    def finish_logits(self, head: Tensor) -> Tensor:
        out = head.float()  # [..., V]
        c = self.config
        if c.output_multiplier != 1.0:
            out = out * c.output_multiplier
        if c.final_logit_softcapping is not None:
            out = torch.tanh(out / c.final_logit_softcapping) * c.final_logit_softcapping
        return out

    def layer_biases(self, context: ContextSource, n: int, device: torch.device
                     ) -> list[tuple[Tensor, Tensor | None]]:
        c = self.config
        if not c.zlab:
            return super().layer_biases(context, n, device)
        full = context_bias(context.valid)  # [B, 1, 1, S]
        rows = torch.arange(n, device=device)
        offset = rows.view(-1, 1) - rows.view(1, -1)  # [N, N] query row - key row
        window = c.sliding_window or 0
        by_kind: dict[str, tuple[Tensor, Tensor | None]] = {}  # the biases of a layer kind
        for kind in dict.fromkeys(c.layer_types):
            slides = kind == "sliding_attention"
            visible = offset >= 0 if c.causal(kind) else None  # [N, N] bool
            ctx = full
            if slides:
                near = offset.abs() < window
                visible = near if visible is None else visible & near
                ctx = per_query_window_bias(context, n, window, c.num_kv_groups)
            by_kind[kind] = (ctx, None if visible is None else self._block_bias(visible))
        return [by_kind[kind] for kind in c.layer_types]
