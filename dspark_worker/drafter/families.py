"""Model families: the one place that reads a checkpoint's config.json, picks the family and
builds its model (docs/architecture.md, "Model families").

A family is its config parser, its checkpoint layout (every tensor name with its shape) and
its :class:`~.model.DraftModel` subclass. The rings, the Markov walk, sampling, the runner and
the protocol see only :class:`~.config.DrafterConfig` geometry and the ``DraftModel``
interface. A family is picked from ``speculators_model_type`` (a checkpoint saved by vLLM's
speculators library), else ``model_type`` and ``architectures``; a config.json with none of them
is the Qwen3 layout (the first DSpark checkpoints wrote no ``model_type``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from protocol import formats

from . import dflash, gemma4, k3, minimax, speculators
from .config import DrafterConfig, DrafterConfigError, parse_qwen3_config, read_config_json
from .model import DrafterModel, DraftModel, instantiate
from .model import expected_shapes as qwen3_shapes


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]  # config.json ``model_type`` values it claims
    architectures: tuple[str, ...]  # config.json ``architectures`` entries it claims
    config_type: type[DrafterConfig]
    parse: Callable[[Mapping[str, Any], str], DrafterConfig]
    expected_shapes: Callable[[DrafterConfig], dict[str, tuple[int, ...]]]
    model_type: type[DraftModel]
    # Integer tensors of the layout and the safetensors dtypes they may have (floats: any).
    index_dtypes: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    # Tensors only the target checkpoint may supply (a drafter checkpoint holding one is refused).
    from_target: Callable[[DrafterConfig], tuple[str, ...]] = lambda config: ()
    # Checks across loaded tensors beyond their shapes (raise ValueError).
    check_tensors: Callable[[DrafterConfig, Mapping[str, Tensor]], None] = (
        lambda config, tensors: None)
    # What an unexpected tensor is, where the family knows (for the refusal's message).
    explain_tensor: Callable[[str], str | None] = lambda name: None
    # Checks of the checkpoint folder beyond config.json and the weights (raise ValueError).
    check_folder: Callable[[Path], None] = lambda directory: None
    # Tensors a checkpoint may hold beside the layout (a quantised weight's scales), by shape.
    optional_shapes: Callable[[DrafterConfig], dict[str, tuple[int, ...]]] = (
        lambda config: {})
    # The safetensors dtypes a tensor may be stored in, where the family says (None: any float).
    stored_dtypes: Callable[[str], tuple[str, ...] | None] = lambda name: None
    # The loaded tensors (stored dtypes and names, identities already taken) as the model takes
    # them: quantised weights dequantised, names mapped (raise CheckpointRefused).
    model_tensors: Callable[[DrafterConfig, dict[str, Tensor], str], dict[str, Tensor]] = (
        lambda config, tensors, source: tensors)


QWEN3 = Family(
    name="qwen3",
    model_types=("qwen3",),
    architectures=("Qwen3DSparkModel",),
    config_type=DrafterConfig,
    parse=parse_qwen3_config,
    expected_shapes=qwen3_shapes,
    model_type=DrafterModel,
)
GEMMA4 = Family(
    name="gemma4",
    model_types=gemma4.MODEL_TYPES,
    architectures=gemma4.ARCHITECTURES,
    config_type=gemma4.Gemma4Config,
    parse=gemma4.parse_gemma4_config,
    expected_shapes=gemma4.gemma4_shapes,
    model_type=gemma4.Gemma4DrafterModel,
)
SPECULATORS = Family(
    name="speculators",
    model_types=(),  # picked by speculators_model_type (detect_family)
    architectures=speculators.ARCHITECTURES,
    config_type=speculators.SpeculatorsConfig,
    parse=speculators.parse_speculators_config,
    expected_shapes=speculators.speculators_shapes,
    model_type=speculators.SpeculatorsDrafterModel,
    index_dtypes=speculators.INDEX_DTYPES,
    from_target=speculators.from_target,
    check_tensors=speculators.check_tensors,
)
DFLASH = Family(
    name="dflash",
    model_types=(),  # picked by speculators_model_type or architectures (protocol.formats)
    architectures=dflash.ARCHITECTURES,
    config_type=dflash.DFlashConfig,
    parse=dflash.parse_dflash_config,
    expected_shapes=dflash.dflash_shapes,
    model_type=dflash.DFlashDrafterModel,
    index_dtypes=speculators.INDEX_DTYPES,
    from_target=dflash.from_target,
    check_tensors=dflash.check_tensors,
    explain_tensor=dflash.explain_tensor,
    check_folder=dflash.check_folder,
)
K3 = Family(
    name="k3_dspark",
    model_types=k3.MODEL_TYPES,
    architectures=k3.ARCHITECTURES,
    config_type=k3.K3Config,
    parse=k3.parse_k3_config,
    expected_shapes=k3.k3_shapes,
    model_type=k3.K3DrafterModel,
)
MINIMAX = Family(
    name="minimax_m3",
    model_types=(),  # the target's own model_type: picked by architectures
    architectures=minimax.ARCHITECTURES,
    config_type=minimax.MiniMaxConfig,
    parse=minimax.parse_minimax_config,
    expected_shapes=minimax.minimax_shapes,
    model_type=minimax.MiniMaxDrafterModel,
    from_target=minimax.from_target,
    optional_shapes=minimax.minimax_scale_shapes,
    stored_dtypes=minimax.stored_dtypes,
    model_tensors=minimax.model_tensors,
)
FAMILIES: tuple[Family, ...] = (QWEN3, GEMMA4, SPECULATORS, DFLASH, K3, MINIMAX)


def detect_family(raw: Mapping[str, Any], source: str = "config.json") -> Family:
    """The family a parsed config.json belongs to. A DFlash format (``protocol.formats``:
    speculators' dflash / dflash2, z-lab's architectures) first; then ``speculators_model_type``
    where it is present (its parser refuses the formats it does not serve, by name); else
    ``architectures`` where it names a known drafter class; else ``model_type``; a config with
    none of them is Qwen3."""
    try:
        if formats.dflash_format(raw, source) is not None:
            return DFLASH
    except ValueError as exc:
        raise DrafterConfigError(str(exc), field="architectures",
                                 value=raw.get("architectures")) from None
    if speculators.MODEL_TYPE_KEY in raw:
        return SPECULATORS
    archs = raw.get("architectures")
    if isinstance(archs, list):
        for family in FAMILIES:
            if any(a in family.architectures for a in archs):
                return family
    model_type = raw.get("model_type")
    if model_type is None:
        return QWEN3
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    known = sorted(t for f in FAMILIES for t in f.model_types)
    raise DrafterConfigError(
        f"{source}: model_type {model_type!r} (architectures {archs!r}) is not a drafter family"
        f" the worker serves (model_type one of {known})", field="model_type", value=model_type)


def family_of(config: DrafterConfig) -> Family:
    """The family of a parsed config (by its exact type)."""
    for family in FAMILIES:
        if type(config) is family.config_type:
            return family
    raise TypeError(f"no model family parses into {type(config).__name__}")


def parse_config(raw: Mapping[str, Any], source: str = "config.json") -> DrafterConfig:
    """A validated config of the family ``raw`` belongs to."""
    return detect_family(raw, source).parse(raw, source)


def load_config(path: str | Path) -> DrafterConfig:
    """Read, recognise and validate ``config.json`` (a file, or a checkpoint directory)."""
    raw, source = read_config_json(path)
    return parse_config(raw, source)


def expected_shapes(config: DrafterConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the config's checkpoint layout with its shape."""
    return family_of(config).expected_shapes(config)


def build_model(config: DrafterConfig, tensors: dict[str, Tensor] | None, *,
                device: torch.device | str, dtype: torch.dtype) -> DraftModel:
    """The family's model holding ``tensors`` (checkpoint layout, shape-checked) cast to
    ``dtype`` on ``device``; ``tensors=None`` leaves the weights uninitialised."""
    return instantiate(family_of(config).model_type, config, tensors, device=device, dtype=dtype)
