"""The DSpark drafter on torch: model, checkpoints, context rings, drafting (DRAFTER.md;
CONTRACT 7.2 steps 4-6, 8 and 9). No networking and no asyncio: the runner calls in.

The worker's entry points:

- :func:`load_drafter` (``None`` checkpoint: :func:`embedded_default`, the shipped reference
  drafter) -> :class:`Drafter`; a folder it cannot serve raises :class:`CheckpointRefused`
  before anything is allocated for it
- :meth:`Drafter.new_pool` -> :class:`RingPool`: ``allocate`` / ``free`` lanes, ``apply`` the
  rows of a STEP, ``release`` windows, ``window_rows``
- :meth:`Drafter.draft` -> :class:`DraftResult` (``SamplingParams`` for sampled sessions)
"""

from .checkpoint import CheckpointError, LoadedCheckpoint, load_checkpoint, save_checkpoint
from .config import DrafterConfig, DrafterConfigError
from .drafter import (
    Drafter,
    DraftResult,
    ReadDrafter,
    SamplingParams,
    embedded_default,
    embedded_identities,
    from_tensors,
    load_drafter,
    random_default,
    random_identities,
    read_drafter,
)
from .embedded import EMBEDDED_CONFIG, random_tensors
from .families import (
    FAMILIES,
    Family,
    build_model,
    detect_family,
    expected_shapes,
    family_of,
    load_config,
    parse_config,
)
from .gemma4 import Gemma4Config, Gemma4DrafterModel
from .limits import CheckpointRefused
from .model import DrafterModel, DraftModel
from .rings import PoolExhaustedError, RingPool, decode_bf16_rows, encode_bf16_rows
from .speculators import SpeculatorsConfig, SpeculatorsDrafterModel

__all__ = [
    "EMBEDDED_CONFIG",
    "FAMILIES",
    "CheckpointError",
    "CheckpointRefused",
    "DraftModel",
    "DraftResult",
    "Drafter",
    "DrafterConfig",
    "DrafterConfigError",
    "DrafterModel",
    "Family",
    "Gemma4Config",
    "Gemma4DrafterModel",
    "LoadedCheckpoint",
    "PoolExhaustedError",
    "ReadDrafter",
    "RingPool",
    "SamplingParams",
    "SpeculatorsConfig",
    "SpeculatorsDrafterModel",
    "build_model",
    "decode_bf16_rows",
    "detect_family",
    "embedded_default",
    "embedded_identities",
    "encode_bf16_rows",
    "expected_shapes",
    "family_of",
    "from_tensors",
    "load_checkpoint",
    "load_config",
    "load_drafter",
    "parse_config",
    "random_default",
    "random_identities",
    "random_tensors",
    "read_drafter",
    "save_checkpoint",
]
