"""The drafter's geometry, read from a DeepSpec-style ``config.json`` (DRAFTER.md, Checkpoints),
and the Qwen3 family's parser.

One frozen type, :class:`DrafterConfig`, validated once on load; a family whose config has more
than this geometry subclasses it (``gemma4.Gemma4Config``), and ``families`` picks the parser.
Every refusal is a :class:`DrafterConfigError` whose message names the file, the field and the
value, for example
``config.json: num_key_value_heads 3 does not divide num_attention_heads 8``.

Aliases accepted (DeepSpec, vLLM and SGLang spell some fields differently):

- ``block_size``: ``dspark_block_size``
- ``mask_token_id``: ``dflash_config.mask_token_id``, ``dspark_noise_token_id``
- ``target_layer_ids``: ``dflash_config.target_layer_ids``, ``dspark_target_layer_ids``
- ``markov_rank``: ``dspark_markov_rank``
- ``rope_theta``: ``rope_parameters.rope_theta`` (transformers 5 writes the nested form)

When a field and its alias are both present they must agree.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from protocol.identity import CONFIG_FILE, CheckpointFolder, SafetensorsError, read_config

from .limits import MAX_BLOCK_SPEC, MAX_TAPS, CheckpointRefused, read_json_file, size_problem

MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")
TAP_BYTES = 2  # tap rows are bf16 (CONTRACT 1, "Tap row")


class DrafterConfigError(CheckpointRefused):
    """A config.json field is missing or holds a value the drafter cannot run."""


@dataclass(frozen=True)
class DrafterConfig:
    """Everything the drafter's shapes depend on. Built by :func:`parse_config`, never by hand
    outside tests and the embedded default (which still go through :meth:`validated`)."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    target_layer_ids: tuple[int, ...]
    block_size: int
    mask_token_id: int
    markov_rank: int
    markov_head_type: str
    enable_confidence_head: bool
    confidence_head_with_markov: bool
    target_hidden_size: int
    num_target_layers: int | None = None
    # Per-position temperatures of sequential temperature scaling: confidence_j =
    # sigmoid(l_j / T_j). None means T_j = 1 everywhere.
    confidence_temperatures: tuple[float, ...] | None = None

    # -- derived geometry ---------------------------------------------------------------------
    @property
    def n_taps(self) -> int:
        return len(self.target_layer_ids)

    @property
    def tap_width(self) -> int:
        """Elements in one tap row: n_taps * target_hidden_size."""
        return self.n_taps * self.target_hidden_size

    @property
    def row_bytes(self) -> int:
        """Bytes of one bf16 tap row on the wire (CONTRACT 6.1: n_taps * hidden * 2)."""
        return self.tap_width * TAP_BYTES

    @property
    def num_kv_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def draft_vocab(self) -> int:
        """Rows of ``lm_head`` and ``markov_w2``: the vocabulary drafts are picked in. The
        target's ``vocab_size`` unless a family reduces it (the model maps drafts back)."""
        return self.vocab_size

    @property
    def lead_rows(self) -> int:
        """Block rows before the first drafted one (1 where the anchor is the bonus token)."""
        return 0

    @property
    def num_spec(self) -> int:
        """Drafts per block (HELLO's N): ``block_size`` less the lead rows."""
        return self.block_size - self.lead_rows

    @property
    def has_markov_head(self) -> bool:
        return self.markov_rank > 0

    @property
    def confidence_input_dim(self) -> int:
        return self.hidden_size + (self.markov_rank if self.confidence_head_with_markov else 0)

    # -- (de)serialisation -----------------------------------------------------------------------
    def to_json_dict(self) -> dict[str, Any]:
        """The config.json this config is read back from (DeepSpec Qwen3 layout plus
        ``target_hidden_size`` and ``confidence_temperatures`` when they are not defaults)."""
        out: dict[str, Any] = {
            "architectures": ["Qwen3DSparkModel"],
            "model_type": "qwen3",
            "hidden_act": "silu",
            "attention_bias": False,
            "tie_word_embeddings": False,
        }
        raw = asdict(self)
        raw["target_layer_ids"] = list(self.target_layer_ids)
        if self.confidence_temperatures is None:
            del raw["confidence_temperatures"]
        else:
            raw["confidence_temperatures"] = list(self.confidence_temperatures)
        if self.num_target_layers is None:
            del raw["num_target_layers"]
        out.update(raw)
        return out

    def validated(self, source: str = "config") -> DrafterConfig:
        """Return self after the checks of :func:`parse_config`; raise on the first bad field."""
        _check_config(self, source)
        return self


def read_config_json(path: str | Path | CheckpointFolder) -> tuple[dict[str, Any], str]:
    """The object in ``config.json`` (a file, a checkpoint directory holding one, or a held
    folder, read through it) and the name errors call it by. ``families.load_config`` picks
    the family and parses it."""
    if isinstance(path, CheckpointFolder):
        try:
            raw = read_config(path)
        except SafetensorsError as exc:
            raise DrafterConfigError(str(exc), field=CONFIG_FILE, value=exc.value,
                                     limit=exc.limit) from None
        if raw is None:
            raise DrafterConfigError(no_config_message(path.path), field=None,
                                     value=str(path / CONFIG_FILE))
        return raw, CONFIG_FILE
    path = Path(path)
    if path.is_dir():
        path = path / CONFIG_FILE
    if not path.exists():
        raise DrafterConfigError(no_config_message(path.parent) if path.name == CONFIG_FILE
                                 else f"{path}: no config.json", field=None, value=str(path))
    try:
        raw, _ = read_json_file(path)
    except CheckpointRefused as exc:
        raise DrafterConfigError(str(exc), field=exc.field, value=exc.value,
                                 limit=exc.limit) from None
    if not isinstance(raw, dict):
        raise DrafterConfigError(f"{path}: the top level is {type(raw).__name__}, not an object")
    return raw, path.name


# Sub-folders named when a folder without config.json holds checkpoints one level down.
SUBFOLDERS_NAMED = 8


def no_config_message(directory: Path) -> str:
    """A folder without config.json: say so, and name its sub-folders that hold one (a
    speculators training run keeps a checkpoint per epoch, ``0/``, ``1/``, and
    ``checkpoint_best/``)."""
    text = f"{directory / CONFIG_FILE}: no config.json"
    try:
        found = [entry.name for entry in sorted(os.scandir(directory), key=_subfolder_order)
                 if entry.is_dir() and os.path.isfile(os.path.join(entry.path, CONFIG_FILE))]
    except OSError:
        return text
    if not found:
        return text
    named = ", ".join(f"{name}/" for name in found[:SUBFOLDERS_NAMED])
    more = f" and {len(found) - SUBFOLDERS_NAMED} more" if len(found) > SUBFOLDERS_NAMED else ""
    return (f"{text}; it is not a checkpoint folder but holds {len(found)} with a config.json"
            f" (a training run's checkpoints?): {named}{more}; pass one of them as the"
            " checkpoint")


def _subfolder_order(entry: os.DirEntry[str]) -> tuple[bool, int, str]:
    """Numbered sub-folders (epochs) first, by number; then the others by name."""
    name = entry.name
    return (not name.isdigit(), int(name) if name.isdigit() else 0, name)


def parse_qwen3_config(raw: Mapping[str, Any], source: str = "config.json") -> DrafterConfig:
    """Build a validated Qwen3-family :class:`DrafterConfig` from a parsed config.json object
    (``families.parse_config`` picks the family first)."""
    r = ConfigReader(raw, source)
    hidden_size = r.int_("hidden_size")
    num_attention_heads = r.int_("num_attention_heads")
    head_dim_default = hidden_size // num_attention_heads if num_attention_heads > 0 else 0
    markov_rank = r.int_("markov_rank", aliases=("dspark_markov_rank",), default=0)
    markov_head_type = r.str_("markov_head_type", default="vanilla").lower()
    enable_confidence_head = r.bool_("enable_confidence_head", default=False)
    with_markov_default = enable_confidence_head and markov_rank > 0
    temps = r.get("confidence_temperatures", default=None)
    r.check_fixed("hidden_act", "silu")
    r.check_fixed("attention_bias", False)
    rope_theta = r.float_("rope_theta", nested=("rope_parameters", "rope_theta"))
    r.check_rope_type()
    target_layer_ids = r.int_list("target_layer_ids", aliases=(
        "dflash_config.target_layer_ids", "dspark_target_layer_ids"))
    config = DrafterConfig(
        hidden_size=hidden_size,
        num_hidden_layers=r.int_("num_hidden_layers"),
        num_attention_heads=num_attention_heads,
        num_key_value_heads=r.int_("num_key_value_heads"),
        head_dim=r.int_("head_dim", default=head_dim_default),
        intermediate_size=r.int_("intermediate_size"),
        vocab_size=r.int_("vocab_size"),
        rms_norm_eps=r.float_("rms_norm_eps", default=1e-6),
        rope_theta=rope_theta,
        target_layer_ids=tuple(target_layer_ids),
        block_size=r.int_("block_size", aliases=("dspark_block_size",)),
        mask_token_id=r.int_("mask_token_id", aliases=(
            "dflash_config.mask_token_id", "dspark_noise_token_id")),
        markov_rank=markov_rank,
        markov_head_type=markov_head_type,
        enable_confidence_head=enable_confidence_head,
        confidence_head_with_markov=r.bool_(
            "confidence_head_with_markov", default=with_markov_default),
        target_hidden_size=r.int_("target_hidden_size", default=hidden_size),
        num_target_layers=r.int_("num_target_layers", default=None),
        confidence_temperatures=temperatures(temps, source),
    )
    return config.validated(source)


# -- validation -----------------------------------------------------------------------------------


def _check_config(c: DrafterConfig, source: str) -> None:
    def fail(field: str, value: object, why: str, limit: object = None) -> None:
        raise DrafterConfigError(f"{source}: {field} {value!r} {why}", field=field, value=value,
                                 limit=limit)

    for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                 "head_dim", "intermediate_size", "vocab_size", "block_size",
                 "target_hidden_size"):
        value = getattr(c, name)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            fail(name, value, "must be a positive integer")
    # Every family's sizes against the bounds (limits.SIZE_LIMITS), before anything is built
    # from them; then N, which HELLO carries.
    for f in fields(c):
        over = size_problem(f.name, getattr(c, f.name))
        if over is not None:
            fail(f.name, getattr(c, f.name), *over)
    if not 1 <= c.num_spec <= MAX_BLOCK_SPEC:
        lead = f", less {c.lead_rows} lead row" if c.lead_rows else ""
        fail("block_size", c.block_size,
             f"gives N = {c.num_spec} drafts per block{lead}; N must be in"
             f" 1..{MAX_BLOCK_SPEC} (the contract's MAX_NUM_SPEC: HELLO's num_spec, the"
             " positions a reply names)", MAX_BLOCK_SPEC + c.lead_rows)
    if len(c.target_layer_ids) > MAX_TAPS:
        fail("target_layer_ids", f"{len(c.target_layer_ids)} layers",
             f"is over {MAX_TAPS} taps (a tap row is n_taps x hidden; drafters tap 3 to 5"
             " layers)", MAX_TAPS)
    if c.num_attention_heads % c.num_key_value_heads:
        fail("num_key_value_heads", c.num_key_value_heads,
             f"does not divide num_attention_heads {c.num_attention_heads}")
    if c.head_dim % 2:
        fail("head_dim", c.head_dim, "must be even (rotary embedding pairs halves)")
    if c.vocab_size < 2:
        fail("vocab_size", c.vocab_size, "must be at least 2 (the margin needs two logits)")
    if not (math.isfinite(c.rms_norm_eps) and c.rms_norm_eps > 0):
        fail("rms_norm_eps", c.rms_norm_eps, "must be a positive finite number")
    if not (math.isfinite(c.rope_theta) and c.rope_theta > 1):
        fail("rope_theta", c.rope_theta, "must be a finite number above 1 (the rotary base:"
             " 10,000 to 10,000,000 in use; at 1 or below the frequencies blow up or divide"
             " by log 1 = 0)", 1)
    if not c.target_layer_ids:
        fail("target_layer_ids", list(c.target_layer_ids), "must name at least one layer")
    previous: int | None = None
    for layer in c.target_layer_ids:
        if layer < -1:
            fail("target_layer_ids", list(c.target_layer_ids),
                 f"holds {layer}; -1 (the embedding output) is the smallest tap")
        if previous is not None and layer <= previous:
            fail("target_layer_ids", list(c.target_layer_ids), "must be strictly increasing")
        previous = layer
    if c.num_target_layers is not None:
        if c.num_target_layers <= 0:
            fail("num_target_layers", c.num_target_layers, "must be a positive integer")
        if c.target_layer_ids[-1] >= c.num_target_layers:
            fail("target_layer_ids", list(c.target_layer_ids),
                 f"names a layer past num_target_layers {c.num_target_layers}")
    if not 0 <= c.mask_token_id < c.vocab_size:
        fail("mask_token_id", c.mask_token_id, f"is outside [0, vocab_size {c.vocab_size})")
    if c.markov_rank < 0:
        fail("markov_rank", c.markov_rank, "must be >= 0 (0: no Markov head)")
    if c.markov_head_type not in MARKOV_HEAD_TYPES:
        fail("markov_head_type", c.markov_head_type, f"is not one of {list(MARKOV_HEAD_TYPES)}")
    if c.confidence_head_with_markov and not c.enable_confidence_head:
        fail("confidence_head_with_markov", True, "needs enable_confidence_head true")
    if c.confidence_head_with_markov and c.markov_rank == 0:
        fail("confidence_head_with_markov", True, "needs a Markov head (markov_rank > 0)")
    temps = c.confidence_temperatures
    if temps is not None:
        if len(temps) != c.block_size:
            fail("confidence_temperatures", list(temps),
                 f"has {len(temps)} entries, block_size is {c.block_size}")
        for t in temps:
            if not (math.isfinite(t) and t > 0):
                fail("confidence_temperatures", list(temps), f"holds {t}; each must be > 0")


def temperatures(value: object, source: str) -> tuple[float, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(
        isinstance(v, int | float) and not isinstance(v, bool) for v in value
    ):
        raise DrafterConfigError(
            f"{source}: confidence_temperatures {value!r} must be a list of numbers",
            field="confidence_temperatures", value=value)
    return tuple(float(v) for v in value)


_MISSING = object()


class ConfigReader:
    """Typed field access with aliases; every error names the field as it is spelled in the file."""

    def __init__(self, raw: Mapping[str, Any], source: str) -> None:
        self.raw = raw
        self.source = source

    def _lookup(self, dotted: str) -> object:
        node: object = self.raw
        for part in dotted.split("."):
            if not isinstance(node, Mapping) or part not in node:
                return _MISSING
            node = node[part]
        return node

    def get(self, name: str, aliases: tuple[str, ...] = (), default: object = _MISSING) -> Any:
        found: list[tuple[str, object]] = []
        for spelled in (name, *aliases):
            value = self._lookup(spelled)
            if value is not _MISSING and value is not None:
                found.append((spelled, value))
        if not found:
            if default is _MISSING:
                spelled = " or ".join((name, *aliases))
                raise DrafterConfigError(f"{self.source}: {spelled} is missing", field=name)
            return default
        first_name, first = found[0]
        for other_name, other in found[1:]:
            if other != first:
                raise DrafterConfigError(
                    f"{self.source}: {first_name} {first!r} and {other_name} {other!r} disagree",
                    field=name, value=other)
        return first

    def int_(self, name: str, aliases: tuple[str, ...] = (), default: object = _MISSING) -> Any:
        """An integer; a size named in ``limits.SIZE_LIMITS`` is checked against its bound as
        it is read, before a family builds anything from it (a list per layer)."""
        value = self.get(name, aliases, default)
        if value is None and default is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise DrafterConfigError(
                f"{self.source}: {name} {value!r} is not an integer", field=name, value=value)
        over = size_problem(name, value)
        if over is not None:
            raise DrafterConfigError(f"{self.source}: {name} {value!r} {over[0]}", field=name,
                                     value=value, limit=over[1])
        return value

    def float_(self, name: str, nested: tuple[str, str] | None = None,
               default: object = _MISSING) -> float:
        """A finite number (JSON as Python reads it allows NaN and Infinity)."""
        aliases = (".".join(nested),) if nested else ()
        value = self.get(name, aliases, default)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise DrafterConfigError(
                f"{self.source}: {name} {value!r} is not a number", field=name, value=value)
        if not math.isfinite(value):
            raise DrafterConfigError(f"{self.source}: {name} {value!r} is not a finite number",
                                     field=name, value=value)
        return float(value)

    def str_(self, name: str, default: object = _MISSING) -> str:
        value = self.get(name, (), default)
        if not isinstance(value, str):
            raise DrafterConfigError(
                f"{self.source}: {name} {value!r} is not a string", field=name, value=value)
        return value

    def bool_(self, name: str, default: object = _MISSING) -> bool:
        value = self.get(name, (), default)
        if not isinstance(value, bool):
            raise DrafterConfigError(
                f"{self.source}: {name} {value!r} is not true or false", field=name, value=value)
        return value

    def int_list(self, name: str, aliases: tuple[str, ...] = ()) -> list[int]:
        value = self.get(name, aliases)
        if not isinstance(value, list) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in value
        ):
            raise DrafterConfigError(
                f"{self.source}: {name} {value!r} is not a list of integers",
                field=name, value=value)
        return list(value)

    def check_fixed(self, name: str, supported: object) -> None:
        """Fields the Qwen3 layout allows but this drafter does not implement otherwise."""
        value = self._lookup(name)
        if value is not _MISSING and value is not None and value != supported:
            raise DrafterConfigError(
                f"{self.source}: {name} {value!r} is not supported (only {supported!r})",
                field=name, value=value)

    def check_rope_type(self) -> None:
        """Only plain RoPE: a scaled variant (yarn, linear ...) would silently shift positions."""
        for spelled in ("rope_scaling", "rope_parameters"):
            value = self._lookup(spelled)
            if value is _MISSING or value is None:
                continue
            if not isinstance(value, Mapping):
                raise DrafterConfigError(
                    f"{self.source}: {spelled} {value!r} is not an object", field=spelled,
                    value=value)
            kind = value.get("rope_type", value.get("type", "default"))
            if kind != "default":
                raise DrafterConfigError(
                    f"{self.source}: {spelled}.rope_type {kind!r} is not supported "
                    "(only 'default')", field=f"{spelled}.rope_type", value=kind)
