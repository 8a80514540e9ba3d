"""What a checkpoint folder may declare, and how its files are read: the checks every family
gets, before anything is allocated for the drafter (docs/operations.md, "Checkpoints as
input").

* :class:`CheckpointRefused`: the one exception a refused folder raises (its config, a file, a
  size, a tensor), with ``field``, ``value`` and ``limit``; ``DrafterConfigError`` and
  ``CheckpointError`` are its kinds. The worker's start and a reload both catch it, and it
  always comes before the weights are read or the device is touched.
* :data:`SIZE_LIMITS`: upper bounds for the sizes a config declares, checked when a family's
  parser reads them (``ConfigReader``) and again on every ``DrafterConfig``.
* :func:`read_json_file`: a small JSON file read with a bound (a regular file only: never a
  FIFO, a device or an endless file).
* :func:`check_host_memory`: the tensors must fit in the host memory available now.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Final

from protocol.constants import MAX_NUM_SPEC
from protocol.identity import MAX_CONFIG_BYTES, SafetensorsError, load_json, read_small_file

# Sizes a config.json may declare, with why each bound is safe: each is far above what any
# drafter or target uses, and low enough that nothing built from the config before its tensors
# are checked (a layer list, a table per layer) can take the machine's memory or time.
SIZE_LIMITS: Final[dict[str, tuple[int, str]]] = {
    "hidden_size": (1 << 16, "the widest models use 16,384 to 18,432"),
    "target_hidden_size": (1 << 16, "the widest models use 16,384 to 18,432"),
    "num_hidden_layers": (256, "a DSpark drafter has 1 to 8 layers"),
    "num_attention_heads": (1024, "the largest models use 128"),
    "num_key_value_heads": (1024, "the largest models use 128"),
    "num_global_key_value_heads": (1024, "the largest models use 128"),
    "head_dim": (2048, "the widest in use is 512 (Gemma 4's global layers)"),
    "global_head_dim": (2048, "the widest in use is 512 (Gemma 4's global layers)"),
    "intermediate_size": (1 << 18, "the largest dense MLPs are about 53,000 wide"),
    "q_lora_rank": (1 << 16, "MLA query ranks in use are 768 to 1536"),
    "kv_lora_rank": (1 << 16, "MLA latents in use are 512 wide"),
    "qk_nope_head_dim": (2048, "MLA heads in use are 128 to 192 wide"),
    "qk_rope_head_dim": (2048, "MLA RoPE keys in use are 64 wide"),
    "v_head_dim": (2048, "MLA value heads in use are 128 wide"),
    "vocab_size": (1 << 22, "the largest vocabularies have 262,144 tokens"),
    "draft_vocab_size": (1 << 22, "the largest vocabularies have 262,144 tokens"),
    "markov_rank": (1 << 16, "DSpark's Markov heads have rank 64 to 512"),
    "num_target_layers": (1 << 12, "the deepest targets have about 160 layers"),
    "max_position_embeddings": (1 << 26, "the longest contexts in use are about 10M tokens"),
    "original_max_position_embeddings": (1 << 26, "the longest contexts in use are about"
                                                   " 10M tokens"),
    "sliding_window": (1 << 26, "the longest contexts in use are about 10M tokens"),
    "max_window_layers": (1 << 12, "the deepest targets have about 160 layers"),
}
# block_size: N = block_size less the lead rows is HELLO's num_spec, and the contract's
# MAX_NUM_SPEC (64) bounds the positions a reply names per entry; DSpark blocks are 4 to 16.
MAX_BLOCK_SPEC: Final = MAX_NUM_SPEC
# target_layer_ids: a tap row is n_taps x hidden bf16 values; DSpark drafters tap 3 to 5 layers.
MAX_TAPS: Final = 64
# A logit soft cap (Gemma's final_logit_softcapping is 30): by 1e6 tanh(U / cap) * cap caps
# nothing a drafter produces, and past float32's range the cap is infinite and every draft NaN.
MAX_SOFTCAP: Final = 1e6
# A multiplier of embeddings or logits (DFlash's input_embedding_scale, output_multiplier are
# about 1 to 100): beyond this the bf16 activations overflow to inf and the drafts are NaN.
MAX_SCALE: Final = 1e6


class CheckpointRefused(ValueError):
    """A checkpoint folder cannot be served: ``field`` (the config key, file or tensor),
    ``value`` and ``limit`` say what and why. Raised before any of the drafter's memory is
    allocated, host or device, so whoever loads (the start, a reload) keeps what it had."""

    def __init__(self, message: str, *, field: str | None = None, value: object = None,
                 limit: object = None) -> None:
        super().__init__(message)
        self.field = field
        self.value = value
        self.limit = limit


def size_problem(name: str, value: object) -> tuple[str, int] | None:
    """(why, the bound) when an integer size ``name`` (a config key, nested keys by their last
    part) is over its bound, else None."""
    bound = SIZE_LIMITS.get(name.rsplit(".", 1)[-1])
    if bound is None or isinstance(value, bool) or not isinstance(value, int):
        return None
    limit, why = bound
    return (f"is over {limit} ({why})", limit) if value > limit else None


def read_json_file(path: Path, limit: int = MAX_CONFIG_BYTES) -> tuple[Any, int]:
    """The JSON value in ``path`` and its size; CheckpointRefused naming the file when it is not
    a regular file of at most ``limit`` bytes of UTF-8 JSON."""
    try:
        data = read_small_file(path, limit)
        return load_json(data, path), len(data)
    except SafetensorsError as exc:
        raise CheckpointRefused(str(exc), field=path.name, value=exc.value,
                                limit=exc.limit) from None


def host_memory_available() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (None where there is none)."""
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_host_memory(nbytes: int, what: str) -> None:
    """Refuse to read ``nbytes`` of tensors that the host's available memory cannot hold."""
    available = host_memory_available()
    if available is not None and nbytes > available:
        raise CheckpointRefused(f"{what}: the tensors hold {nbytes} bytes, more than the"
                                f" {available} bytes of memory this host has available"
                                " (MemAvailable); loading them would exhaust it",
                                field="tensors", value=nbytes, limit=available)
