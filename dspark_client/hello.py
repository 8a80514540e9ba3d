"""The engine's HELLO from the drafter checkpoint it was configured with (docs/contract.md 6.1,
6.4).

An engine knows which drafter it wants; ``hello_from_checkpoint`` reads that checkpoint's
``config.json`` (DeepSpec layout, with its aliases; every model family keeps ``block_size``,
``vocab_size``, ``target_layer_ids`` and ``hidden_size`` at the top level: the Gemma4 drafter's
config is the target's text config, so its ``hidden_size`` is the target's) for N, the
vocabulary and the tap geometry, and its safetensors files for the identities, so that a worker
serving anything else refuses the HELLO (``ST_IDENTITY`` / ``ST_GEOMETRY``) instead of drafting
for the wrong model. No framework is loaded: the identities come from the files' raw bytes
(``protocol.identity``), or from the ``dspark_identity.json`` a worker wrote beside the
checkpoint while it matches the files. A drafter without ``embed_tokens`` / ``lm_head`` needs
``target_checkpoint``, as the worker does, and fails with the worker's message without it.

A checkpoint saved by vLLM's speculators library (``speculators_model_type`` ``dspark``,
``dflash`` or ``dflash2``) keeps its geometry in ``transformer_layer_config``: the vocabulary is
the target's (``vocab_size`` there; drafts are target ids even over a reduced draft vocabulary),
N is ``block_size`` or ``block_size - 1`` (``sample_from_anchor`` false, DFlash's default: the
anchor is the bonus token), and its ``aux_hidden_state_layer_ids`` are HF ``hidden_states``
indices, one above the layer numbering taps use here (``tap_layers``). Its ``embed_tokens``
always comes from the target checkpoint. A z-lab DFlash drafter (``architectures``
``DFlashDraftModel`` / ``DFlash2DraftModel``, ``protocol.formats``) is a Qwen3 config with a
``dflash_config``: N is ``block_size - 1``, its ``target_layer_ids`` are taps as they are, and its
``embed_tokens`` and ``lm_head`` are the target's. A MiniMax-M3 drafter (``architectures``
``DSparkMiniMaxDraftModel``) keeps its keys in ``text_config``; ``checkpoint`` may name the
target's folder, whose ``dspark/`` subfolder holds the drafter (the target is then that folder,
``protocol.formats.held_drafter``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Final

from protocol import formats, wire
from protocol.constants import SAMPLE_GREEDY, SAMPLE_TOP32
from protocol.identity import (
    CONFIG_FILE,
    TARGET_FALLBACKS,
    CheckpointFolder,
    SafetensorsError,
    held_folder,
    identities_from_checkpoint,
    markov_walk_identity,
    read_config,
)

__all__ = ["DEFAULT_MAX_ROWS_PER_STEP", "default_max_rows_per_step", "hello_from_checkpoint",
           "tap_layers"]

# The cap of the default row budget: the worker's default --max-rows-per-step (four windows of
# its default W = 1024, 105 MB at Qwen3-4B's 25.6 KiB rows). A client with defaults never
# announces more than a worker with defaults accepts, and the worker's automatic frame limit is
# sized from that same number, so such a client never sends a STEP refused for its size.
DEFAULT_MAX_ROWS_PER_STEP: Final = 4096


def default_max_rows_per_step(window: int, max_slots: int) -> int:
    """A full resync of every slot in one STEP (``W * max_slots``) where that fits under
    ``DEFAULT_MAX_ROWS_PER_STEP``; else that cap, and the rounds share it oldest first
    (``dspark_client.rounds``, docs/architecture.md). Never below W (one slot's resync)."""
    return max(window, min(DEFAULT_MAX_ROWS_PER_STEP, window * max_slots))


_REQUIRED: Final = object()


def _field(cfg: dict[str, Any], path: Path, *names: str, default: Any = _REQUIRED) -> Any:
    """The first of ``names`` (dotted: nested) that is set; ``default`` when none is, else
    ValueError."""
    for name in names:
        node: Any = cfg
        for part in name.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if node is not None:
            return node
    if default is not _REQUIRED:
        return default
    raise ValueError(f"{path}: none of {', '.join(names)} is set")


def _read_config(checkpoint: str | Path | CheckpointFolder) -> tuple[dict[str, Any], Path]:
    """config.json's object, read through the held folder (the one its identity is read from),
    with the reader's bounds: a regular file only, of at most ``MAX_CONFIG_BYTES``."""
    with held_folder(checkpoint) as folder:
        cfg_path = folder / CONFIG_FILE
        try:
            cfg = read_config(folder)
        except SafetensorsError as exc:
            raise ValueError(f"{cfg_path}: cannot read the drafter config ({exc})") from exc
    if cfg is None:
        raise ValueError(f"{cfg_path}: cannot read the drafter config (no such file)")
    return cfg, cfg_path


# speculators' defaults of the keys read here where a config lacks one: DSpark (sample_from_anchor
# true) and DFlash (false); block_size 8 in both. A z-lab DFlash drafter drafts blocks of 16 where
# neither its dflash_config nor its top level sets block_size (its newer code's default).
_SAMPLE_FROM_ANCHOR_DEFAULT: Final = {"dspark": True, "dflash": False, "dflash2": False}
_ZLAB_DEFAULT_BLOCK: Final = 16


def _geometry(cfg: dict[str, Any], cfg_path: Path) -> tuple[int, int, list[int], int | None]:
    """(num_spec, vocab_size, tap layers, hidden or None) of a drafter config.json; tap layers
    in DeepSpec numbering (the output of decoder layer i; -1 the embedding output)."""
    kind = cfg.get("speculators_model_type")
    archs = cfg.get("architectures")
    if isinstance(archs, list) and formats.MINIMAX_ARCHITECTURE in archs:
        # a VL wrapper: every model key in text_config; taps numbered as DeepSpec's
        text = cfg.get("text_config")
        if not isinstance(text, dict):
            raise ValueError(f"{cfg_path}: text_config is missing or not an object")
        taps = _field(text, cfg_path, "dspark_target_layer_ids")
        return (int(_field(text, cfg_path, "block_size", "dspark_block_size")),
                int(_field(text, cfg_path, "vocab_size")), [int(t) for t in taps],
                int(_field(text, cfg_path, "hidden_size")))
    fmt = formats.dflash_format(cfg, str(cfg_path))
    if fmt in (formats.ZLAB_DFLASH, formats.ZLAB_DFLASH2):
        # a Qwen3Config dump: the geometry at the top level, dflash_config's values first; taps
        # numbered as DeepSpec's; the anchor is the bonus token (N = B - 1)
        block = int(_field(cfg, cfg_path, "dflash_config.block_size", "block_size",
                           default=_ZLAB_DEFAULT_BLOCK))
        taps = _field(cfg, cfg_path, "dflash_config.target_layer_ids", "target_layer_ids")
        return (block - 1, int(cfg.get("vocab_size", 151936)), [int(t) for t in taps],
                int(cfg.get("hidden_size", 4096)))
    if kind is None:
        num_spec = int(_field(cfg, cfg_path, "block_size", "dspark_block_size"))
        vocab = int(_field(cfg, cfg_path, "vocab_size"))
        taps = _field(cfg, cfg_path, "target_layer_ids", "dflash_config.target_layer_ids",
                      "dspark_target_layer_ids")
        hidden = cfg.get("target_hidden_size") or cfg.get("hidden_size")
        return num_spec, vocab, [int(t) for t in taps], hidden
    if kind not in _SAMPLE_FROM_ANCHOR_DEFAULT:
        raise ValueError(f"{cfg_path}: speculators_model_type {kind!r} is not a drafter the"
                         f" worker serves (one of {sorted(_SAMPLE_FROM_ANCHOR_DEFAULT)})")
    block = int(cfg.get("block_size", 8))
    anchor = cfg.get("sample_from_anchor", _SAMPLE_FROM_ANCHOR_DEFAULT[kind])
    num_spec = block if anchor else block - 1
    layer = cfg.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise ValueError(f"{cfg_path}: transformer_layer_config is missing or not an object")
    # a key to_diff_dict left out holds the config class's default (Qwen3Config, LlamaConfig)
    vocab = int(layer.get("vocab_size", 32000 if layer.get("model_type") == "llama" else 151936))
    aux = _field(cfg, cfg_path, "aux_hidden_state_layer_ids")
    return num_spec, vocab, [int(k) - 1 for k in aux], int(layer.get("hidden_size", 4096))


def tap_layers(checkpoint: str | Path) -> tuple[int, ...]:
    """The target layers whose outputs an engine captures for this drafter, in order, numbered
    as DeepSpec's ``target_layer_ids`` (decoder layer i's output; -1 the embedding output); a
    speculators checkpoint's ``aux_hidden_state_layer_ids`` less one."""
    with formats.held_drafter(checkpoint) as (folder, _target):
        cfg, cfg_path = _read_config(folder)
    return tuple(_geometry(cfg, cfg_path)[2])


def hello_from_checkpoint(checkpoint: str | Path, *, window: int, max_slots: int,
                          max_rows_per_step: int | None = None, sampled: bool = False,
                          client_name: str = "", target_checkpoint: str | Path | None = None,
                          target_hidden_size: int | None = None,
                          draft_topk: int | None = None, synthetic: bool = False,
                          identities: tuple[bytes, bytes] | None = None) -> wire.Hello:
    """A Hello for the drafter in ``checkpoint``.

    window / max_slots: what the engine will use (the worker must serve this W and at least
    these slots). max_rows_per_step: the most rows one STEP will carry (default
    ``default_max_rows_per_step``: every slot's resync in one STEP up to 4096 rows; the worker
    must allow it). target_checkpoint: where embed_tokens / lm_head come from when the drafter
    lacks them (they enter the identity). target_hidden_size: the target's hidden size when the
    drafter's config does not name it (``target_hidden_size``, else its ``hidden_size``).
    draft_topk: the candidate walk the worker runs (vLLM's ``dspark_draft_topk``; None: the
    checkpoint config's, else none); it enters the Markov identity (6.4). synthetic: the rows
    will be made up (a benchmark): the HELLO says so (``HF_SYNTHETIC``) and the worker keeps the
    session out of its acceptance figures. identities: the (drafter, Markov) identities when
    the caller has them without the weights (a worker's ``dspark_identity.json`` copied to the
    engine host); None: from the checkpoint's files."""
    # config and weights read from one folder: a MiniMax-M3 target's dspark/ found once
    with formats.held_drafter(checkpoint) as (folder, own_target):
        return _hello(folder, window=window, max_slots=max_slots,
                      max_rows_per_step=max_rows_per_step, sampled=sampled,
                      client_name=client_name,
                      target_checkpoint=own_target if target_checkpoint is None
                      else target_checkpoint,
                      target_hidden_size=target_hidden_size, draft_topk=draft_topk,
                      synthetic=synthetic, identities=identities)


def _hello(folder: CheckpointFolder, *, window: int, max_slots: int,
           max_rows_per_step: int | None, sampled: bool, client_name: str,
           target_checkpoint: str | Path | CheckpointFolder | None,
           target_hidden_size: int | None, draft_topk: int | None, synthetic: bool,
           identities: tuple[bytes, bytes] | None) -> wire.Hello:
    cfg, cfg_path = _read_config(folder)
    num_spec, vocab, taps, config_hidden = _geometry(cfg, cfg_path)
    if config_hidden is not None:
        hidden = int(config_hidden)
    elif target_hidden_size:
        hidden = target_hidden_size
    else:
        raise ValueError(f"{cfg_path}: none of target_hidden_size, hidden_size is set")
    n_taps = len(taps)
    try:
        drafter_id, markov_id = identities or identities_from_checkpoint(folder,
                                                                         target_checkpoint)
    except SafetensorsError as exc:
        if target_checkpoint is None and exc.field in TARGET_FALLBACKS:
            # an argument the caller did not pass, not a broken file: said as such
            raise ValueError(str(exc)) from None
        raise
    if draft_topk is None:
        draft_topk = cfg.get("dspark_draft_topk") or 0
    markov_id = markov_walk_identity(markov_id, int(draft_topk))
    rows = (max_rows_per_step if max_rows_per_step is not None
            else default_max_rows_per_step(window, max_slots))
    return wire.Hello(sample_mode=SAMPLE_TOP32 if sampled else SAMPLE_GREEDY, window=window,
                      num_spec=num_spec, max_slots=max_slots, max_rows_per_step=rows,
                      row_bytes=n_taps * hidden * 2, vocab_size=vocab, n_taps=n_taps,
                      hidden=hidden, drafter_identity=drafter_id, markov_identity=markov_id,
                      client_name=client_name, flags=wire.HF_SYNTHETIC if synthetic else 0)
