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
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from protocol import wire
from protocol.constants import SAMPLE_GREEDY, SAMPLE_TOP32
from protocol.identity import identities_from_checkpoint

__all__ = ["hello_from_checkpoint"]


def _field(cfg: dict[str, Any], path: Path, *names: str) -> Any:
    for name in names:
        node: Any = cfg
        for part in name.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if node is not None:
            return node
    raise ValueError(f"{path}: none of {', '.join(names)} is set")


def hello_from_checkpoint(checkpoint: str | Path, *, window: int, max_slots: int,
                          max_rows_per_step: int | None = None, sampled: bool = False,
                          client_name: str = "", target_checkpoint: str | Path | None = None,
                          target_hidden_size: int | None = None) -> wire.Hello:
    """A Hello for the drafter in ``checkpoint``.

    window / max_slots: what the engine will use (the worker must serve this W and at least
    these slots). max_rows_per_step: the most rows one STEP will carry (default
    ``max(window, 4 * max_slots)``: one resync, or a few rows per slot; the worker must allow
    it). target_checkpoint: where embed_tokens / lm_head come from when the drafter
    lacks them (they enter the identity). target_hidden_size: the target's hidden size when the
    drafter's config does not name it (``target_hidden_size``, else its ``hidden_size``)."""
    path = Path(checkpoint)
    cfg_path = path / "config.json"
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{cfg_path}: cannot read the drafter config ({exc})") from exc
    if not isinstance(cfg, dict):
        raise ValueError(f"{cfg_path}: not a JSON object")
    num_spec = int(_field(cfg, cfg_path, "block_size", "dspark_block_size"))
    vocab = int(_field(cfg, cfg_path, "vocab_size"))
    taps = _field(cfg, cfg_path, "target_layer_ids", "dflash_config.target_layer_ids",
                  "dspark_target_layer_ids")
    hidden = target_hidden_size or int(_field(cfg, cfg_path, "target_hidden_size",
                                              "hidden_size"))
    n_taps = len(taps)
    drafter_id, markov_id = identities_from_checkpoint(path, target_checkpoint)
    rows = max_rows_per_step if max_rows_per_step is not None else max(window, 4 * max_slots)
    return wire.Hello(sample_mode=SAMPLE_TOP32 if sampled else SAMPLE_GREEDY, window=window,
                      num_spec=num_spec, max_slots=max_slots, max_rows_per_step=rows,
                      row_bytes=n_taps * hidden * 2, vocab_size=vocab, n_taps=n_taps,
                      hidden=hidden, drafter_identity=drafter_id, markov_identity=markov_id,
                      client_name=client_name)
