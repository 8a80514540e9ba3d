"""Which DFlash checkpoint format a drafter's config.json is, told apart one way for the worker
(``dspark_worker.drafter.families``) and the engine's HELLO (``dspark_client.hello``), so the two
never read one checkpoint as different layouts (docs/architecture.md, "Model families").

A DFlash drafter comes in two formats: vLLM's ``speculators`` (``speculators_model_type``
``dflash`` or ``dflash2``, the geometry in ``transformer_layer_config``) and z-lab's (a
transformers Qwen3Config dump with ``architectures`` ``DFlashDraftModel`` or
``DFlash2DraftModel`` and a ``dflash_config``). A z-lab drafter drafts N = block_size - 1 tokens
after the anchor; read as the DeepSpec Qwen3 layout (N = block_size, the anchor's row drafting
the first) it would draft other tokens, so a ``dflash_config`` in a config that names neither
format nor a DSpark drafter is refused rather than guessed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

__all__ = ["DFLASH_ARCHITECTURES", "K3_ARCHITECTURES", "K3_MODEL_TYPES", "SPECULATORS_DFLASH",
           "SPECULATORS_DFLASH2", "ZLAB_DFLASH", "ZLAB_DFLASH2", "dflash_format",
           "target_owned_tensors"]

SPECULATORS_DFLASH: Final = "speculators-dflash"
SPECULATORS_DFLASH2: Final = "speculators-dflash2"
ZLAB_DFLASH: Final = "zlab-dflash"
ZLAB_DFLASH2: Final = "zlab-dflash2"
DFLASH_ARCHITECTURES: Final = {"DFlashDraftModel": ZLAB_DFLASH, "DFlash2DraftModel": ZLAB_DFLASH2}
SPECULATORS_TYPES: Final = {"dflash": SPECULATORS_DFLASH, "dflash2": SPECULATORS_DFLASH2}
# What marks a DeepSpec-layout DSpark drafter (whose config may spell its taps and mask id with
# dflash_config aliases): its architecture, or a Markov or confidence head.
DSPARK_ARCHITECTURES: Final = ("Qwen3DSparkModel", "Gemma4DSparkModel", "K3DSparkModel")
DSPARK_HEAD_KEYS: Final = ("markov_rank", "dspark_markov_rank", "enable_confidence_head")
# Kimi-K3 DSpark drafters (vLLM's K3DSparkModel): they ship a frozen copy of the target's
# embedding that vLLM never uses; the target's own embedding and head draft.
K3_MODEL_TYPES: Final = ("k3_dspark",)
K3_ARCHITECTURES: Final = ("K3DSparkModel",)
K3_TARGET_OWNED: Final = ("embed_tokens.weight",)


def dflash_format(raw: Mapping[str, Any], source: str = "config.json") -> str | None:
    """The DFlash format of a parsed config.json (one of the names above), or None when it is
    not a DFlash drafter. Raises ValueError, naming the keys, for a ``dflash_config`` that no
    architecture places."""
    kind = raw.get("speculators_model_type")
    if kind is not None:
        return SPECULATORS_TYPES.get(kind) if isinstance(kind, str) else None
    archs = raw.get("architectures")
    names = archs if isinstance(archs, list) else []
    for name in names:
        if isinstance(name, str) and name in DFLASH_ARCHITECTURES:
            return DFLASH_ARCHITECTURES[name]
    if "dflash_config" not in raw or any(a in DSPARK_ARCHITECTURES for a in names):
        return None
    if any(raw.get(key) for key in DSPARK_HEAD_KEYS):
        return None  # a DeepSpec DSpark drafter spelling its taps the DFlash way
    raise ValueError(
        f"{source}: dflash_config is set but architectures {archs!r} names neither a DFlash"
        f" drafter ({' or '.join(DFLASH_ARCHITECTURES)}: N = block_size - 1, after the anchor)"
        f" nor a DSpark one ({' or '.join(DSPARK_ARCHITECTURES)}: N = block_size); set"
        " architectures to say which")


def target_owned_tensors(raw: Mapping[str, Any]) -> tuple[str, ...]:
    """Drafter tensors always taken from the target checkpoint for this config.json, even where
    the drafter folder holds a copy (a Kimi-K3 drafter's frozen ``embed_tokens``): the worker
    loads and both sides hash the target's, so the copy is never read."""
    archs = raw.get("architectures")
    names = archs if isinstance(archs, list) else []
    if raw.get("model_type") in K3_MODEL_TYPES or any(a in K3_ARCHITECTURES for a in names):
        return K3_TARGET_OWNED
    return ()
