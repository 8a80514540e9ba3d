"""Drafter checkpoints (DeepSpec's layout, and speculators' for that family): load (with
embed/lm_head from the target when absent), check every shape and dtype, compute the
identities, and save (DRAFTER.md "Checkpoints"; CONTRACT 6.4). A family may name tensors only
its target supplies (a speculators checkpoint's ``embed_tokens``) and integer index tensors
(``d2t`` / ``t2d``), and check its tensors beyond their shapes (``families.Family``).

The tensors a drafter runs with are chosen once, by ``protocol.identity`` (its safetensors
header reader and its target fallbacks), and both the identity and the weights are read from
exactly those byte ranges: what is hashed is what is loaded. From a target checkpoint only the
two tensors needed are read (``model.embed_tokens.weight`` and ``lm_head.weight``, or the
embedding twice for a target with tied embeddings), and of a sharded one only its index and
the shards holding them. A family whose target always supplies a tensor (a Kimi-K3 drafter's
embedding) never reads the drafter folder's copy of it (``protocol.identity.target_owned``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from protocol.formats import held_drafter
from protocol.identity import (
    CONFIG_FILE,
    INDEX_FILE,
    SINGLE_FILE,
    CheckpointFolder,
    SafetensorsError,
    TensorRef,
    drafter_refs,
    drafter_tensors,
    identities_from_arrays,
    read_config,
    read_ref,
    target_owned,
    write_identity_file,
)

from .config import DrafterConfig, DrafterConfigError, read_config_json
from .families import expected_shapes, family_of, parse_config
from .limits import CheckpointRefused, check_host_memory
from .model import DraftModel
from .quant import STORED_DTYPES

log = logging.getLogger("dspark_worker.checkpoint")

# safetensors dtype spellings the drafter loads (it casts to its own dtype after loading).
TORCH_DTYPES: dict[str, torch.dtype] = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F64": torch.float64,
}
# Index tensors (a reduced vocabulary's d2t / t2d) keep their integer dtype.
INDEX_TORCH_DTYPES: dict[str, torch.dtype] = {"I64": torch.int64, "I32": torch.int32,
                                              "BOOL": torch.bool}
SAFETENSORS_DTYPES = {v: k for k, v in (TORCH_DTYPES | INDEX_TORCH_DTYPES | STORED_DTYPES).items()}
DTYPE_BYTES: dict[str, int] = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I64": 8, "I32": 4,
                               "BOOL": 1, "F8_E4M3": 1, "U8": 1}
TARGET_TENSORS = ("embed_tokens.weight", "lm_head.weight")


class CheckpointError(CheckpointRefused):
    """A checkpoint cannot be used: missing, unexpected or misshapen tensor, unreadable file."""

    def __init__(self, message: str, *, tensor: str | None = None,
                 shape: tuple[int, ...] | None = None,
                 expected: tuple[int, ...] | None = None, value: object = None,
                 limit: object = None) -> None:
        super().__init__(message, field=tensor, value=shape if value is None else value,
                         limit=expected if limit is None else limit)
        self.tensor = tensor
        self.shape = shape
        self.expected = expected


@dataclass(frozen=True)
class LoadedCheckpoint:
    config: DrafterConfig
    # CPU, as the model takes them: in the dtype stored in the files, quantised weights
    # dequantised (a family's ``model_tensors``)
    tensors: dict[str, torch.Tensor]
    drafter_identity: bytes
    markov_identity: bytes
    files: tuple[Path, ...]  # every file a tensor was read from, target files included
    folder: Path | None = None  # the folder read: absolute, no symlink in it
    config_json: Mapping[str, Any] = field(default_factory=dict)  # config.json's object


def resolve_checkpoint(checkpoint: str | Path | CheckpointFolder,
                       target_checkpoint: str | Path | CheckpointFolder | None = None
                       ) -> tuple[DrafterConfig, dict[str, TensorRef]]:
    """The config and where each drafter tensor lies, every name and shape checked. Held
    folders are read through, and so are the tensors later; paths are opened for this call
    alone (``load_checkpoint`` holds its folders for the whole load). A MiniMax-M3 target
    folder means its ``dspark/`` drafter (``protocol.formats.held_drafter``)."""
    with _held(checkpoint, target_checkpoint) as (folder, target):
        config, _raw, refs = _resolve_held(folder, target)
        if folder is not checkpoint or target is not target_checkpoint:  # closed after
            refs = {name: ref.detached() for name, ref in refs.items()}
        return config, refs


@contextlib.contextmanager
def _held(checkpoint: str | Path | CheckpointFolder,
          target_checkpoint: str | Path | CheckpointFolder | None
          ) -> Iterator[tuple[CheckpointFolder, CheckpointFolder | None]]:
    """Both folders held for the ``with`` block, the drafter's found as
    ``protocol.formats.held_drafter`` finds it; a path that is no folder is refused as
    CheckpointError."""
    try:
        with held_drafter(checkpoint, target_checkpoint) as (folder, target):
            yield folder, target
    except SafetensorsError as exc:
        raise CheckpointError(str(exc), tensor=exc.field, value=exc.value,
                              limit=exc.limit) from None


def _resolve_held(folder: CheckpointFolder, target: CheckpointFolder | None
                  ) -> tuple[DrafterConfig, dict[str, Any], dict[str, TensorRef]]:
    raw, source = read_config_json(folder)
    config = parse_config(raw, source)
    try:
        refs = _resolve(folder, config, target)
    except CheckpointError as exc:
        verifier = getattr(config, "verifier", None)  # the target it was trained against
        if verifier and exc.tensor in TARGET_TENSORS:
            raise CheckpointError(
                f"{exc}; this drafter was trained against {verifier!r} (config.json"
                " speculators_config.verifier.name_or_path): --target-checkpoint is that"
                " model's folder", tensor=exc.tensor, shape=exc.shape,
                expected=exc.expected, value=exc.value, limit=exc.limit) from exc
        raise
    if target is not None:  # after the tensors: a wrong target's embedding says so first
        check_target_depth(config, raw, target)
    return config, raw, refs


def _resolve(folder: CheckpointFolder, config: DrafterConfig,
             target_checkpoint: CheckpointFolder | None) -> dict[str, TensorRef]:
    directory = folder.path
    family = family_of(config)
    family.check_folder(directory)
    expected = expected_shapes(config)
    try:
        refs = drafter_tensors(folder)
        for name in target_owned(folder):  # a shipped copy the target's tensor replaces
            refs.pop(name, None)
        only_target = family.from_target(config)
        for name in TARGET_TENSORS:  # a family that names its target tensors owns the others
            if only_target and name not in only_target and name not in refs:
                raise CheckpointError(
                    f"{directory}: missing tensor {name} (expected shape"
                    f" {list(expected[name])}); a {family.name} drafter over a reduced"
                    " vocabulary keeps its own, never the target's", tensor=name,
                    expected=expected[name])
        for name in only_target:
            if name in refs:
                raise CheckpointError(
                    f"{refs[name].path}: holds {name} (shape {list(refs[name].shape)}), which a"
                    f" {family.name} drafter takes from its target (pass --target-checkpoint);"
                    " remove it from the drafter checkpoint", tensor=name,
                    shape=refs[name].shape)
        optional = {name: shape for name, shape in family.optional_shapes(config).items()
                    if name in refs}
        unexpected = sorted(set(refs) - set(expected) - set(optional))
        if unexpected:
            what = family.explain_tensor(unexpected[0])
            raise CheckpointError(
                f"{directory}: unexpected tensor {unexpected[0]} (shape "
                f"{list(refs[unexpected[0]].shape)}) for this config.json"
                + (f": {what}, which the {family.name} drafter does not run" if what else "")
                + (f" and {len(unexpected) - 1} more" if len(unexpected) > 1 else ""),
                tensor=unexpected[0], shape=refs[unexpected[0]].shape)
        lacking = [name for name in TARGET_TENSORS if name not in refs]
        if lacking:  # from the target, or the error engines get too (protocol.identity)
            refs = drafter_refs(folder, target_checkpoint)
    except SafetensorsError as exc:
        raise CheckpointError(str(exc), tensor=exc.field, value=exc.value,
                              limit=exc.limit) from None
    _log_target_tensors(refs, lacking,
                        target_checkpoint.path if target_checkpoint is not None else None)
    for name, shape in (expected | optional).items():
        ref = refs.get(name)
        if ref is None:  # embed_tokens / lm_head: drafter_refs said so already
            raise CheckpointError(f"{directory}: missing tensor {name} (expected shape "
                                  f"{list(shape)})", tensor=name, expected=shape)
        if ref.shape != shape:
            raise CheckpointError(
                f"{ref.path}: tensor {name} has shape {list(ref.shape)}, expected {list(shape)}",
                tensor=name, shape=ref.shape, expected=shape)
        allowed = (family.stored_dtypes(name)
                   or tuple(family.index_dtypes.get(name, sorted(TORCH_DTYPES))))
        if ref.dtype not in allowed:
            raise CheckpointError(f"{ref.path}: tensor {name} has dtype {ref.dtype}; the drafter"
                                  f" loads {list(allowed)}", tensor=name)
        nbytes, need = ref.end - ref.start, math.prod(ref.shape) * DTYPE_BYTES[ref.dtype]
        if nbytes != need:  # a header whose byte range does not hold its shape
            raise CheckpointError(f"{ref.path}: tensor {name} holds {nbytes} bytes; shape"
                                  f" {list(ref.shape)} of {ref.dtype} needs {need}",
                                  tensor=name, shape=ref.shape, value=nbytes, limit=need)
    check_derived(config, str(directory / "config.json"))
    check_host_memory(sum(ref.end - ref.start for ref in refs.values()), str(directory))
    return refs


def check_target_depth(config: DrafterConfig, raw: Mapping[str, Any],
                       target: CheckpointFolder) -> None:
    """The drafter's taps against the target checkpoint's depth (its config.json's
    ``num_hidden_layers``, or ``text_config``'s for a multimodal target; no check where it
    names none): a tap past the target's last layer is a drafter trained for another target.
    A speculators config is told in its own numbering (``aux_hidden_state_layer_ids``, HF
    ``hidden_states`` indices, up to the depth itself), as z-lab's ``num_target_layers`` is."""
    try:
        target_raw = read_config(target)
    except SafetensorsError as exc:
        raise CheckpointError(f"{exc} (the target checkpoint's config.json, read for its"
                              " depth)", tensor=exc.field, value=exc.value,
                              limit=exc.limit) from None
    text = target_raw.get("text_config") if target_raw is not None else None
    layers = next((v for v in (
        target_raw.get("num_hidden_layers") if target_raw is not None else None,
        text.get("num_hidden_layers") if isinstance(text, dict) else None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0), None)
    if layers is None or max(config.target_layer_ids) < layers:
        return
    where = f"{target / CONFIG_FILE} num_hidden_layers {layers}"
    if "aux_hidden_state_layer_ids" in raw:
        aux = [t + 1 for t in config.target_layer_ids]
        raise DrafterConfigError(
            f"config.json: aux_hidden_state_layer_ids {aux} names hidden_states index"
            f" {max(aux)}, past the target's {layers} layers ({where}: indices 0 to {layers});"
            " this drafter was trained for another target", field="aux_hidden_state_layer_ids",
            value=aux, limit=layers)
    taps = list(config.target_layer_ids)
    raise DrafterConfigError(
        f"config.json: target_layer_ids {taps} names layer {max(taps)}, past the target's"
        f" {layers} layers ({where}: layers -1 to {layers - 1}); this drafter was trained for"
        " another target", field="target_layer_ids", value=taps, limit=layers)


def check_derived(config: DrafterConfig, source: str) -> None:
    """What the family's model computes from its config alone, computed here on the CPU before
    a tensor is read: the rotary frequencies (and a scaling factor beside them) must be finite
    and not negative, and a config whose arithmetic fails (a division by zero, the logarithm
    of zero) is refused naming its rotary fields, not a traceback at warm-up."""
    where = f"rope_theta {config.rope_theta!r}"
    for name in ("rope_type", "rope_scaling", "partial_rotary_factor"):
        if hasattr(config, name):
            where += f", {name} {getattr(config, name)!r}"
    try:
        with torch.device("meta"):  # shapes only: nothing allocated
            model = family_of(config).model_type(config)
        freqs = model.inv_freq_values(torch.device("cpu"))
        scale = float(getattr(model, "attention_scaling", 1.0))
    except (ArithmeticError, ValueError) as exc:
        raise DrafterConfigError(f"{source}: the rotary embedding cannot be computed from"
                                 f" {where}: {type(exc).__name__}: {exc}", field="rope",
                                 value=where) from None
    if not (bool(torch.isfinite(freqs).all()) and bool((freqs >= 0).all())
            and math.isfinite(scale) and scale > 0):
        raise DrafterConfigError(f"{source}: {where} give rotary frequencies that are not"
                                 " finite (or a scaling factor that is not a positive finite"
                                 " number): the drafter would draft NaN", field="rope",
                                 value=where)


def load_checkpoint(checkpoint: str | Path, target_checkpoint: str | Path | None = None, *,
                    record_identities: bool = True) -> LoadedCheckpoint:
    """Read a DeepSpec drafter checkpoint folder (``model.safetensors`` or shards with
    ``model.safetensors.index.json``); ``embed_tokens`` / ``lm_head`` come from
    ``target_checkpoint`` when the drafter has none. ``record_identities``: write
    ``dspark_identity.json`` beside it (when writable) so that engines need not hash the
    weights for their HELLO.

    Exactly one checkpoint is read: each folder is resolved once and held open
    (``protocol.identity.CheckpointFolder``), each file opened once and its header and tensors
    read through that descriptor, and a folder whose files changed meanwhile (rewritten,
    replaced, added or removed) is refused with "the checkpoint changed while it was read",
    naming the file. A MiniMax-M3 target folder means its ``dspark/`` drafter, with that
    folder as the target unless one is given (``protocol.formats.held_drafter``). The loaded
    checkpoint, its identities and its identity record are those of the folder read
    (``LoadedCheckpoint.folder``), whatever its name leads to by then."""
    with _held(checkpoint, target_checkpoint) as (folder, target):
        config, raw, refs = _resolve_held(folder, target)
        tensors = {name: read_tensor(name, ref) for name, ref in refs.items()}
        try:
            for held in (folder, target):
                if held is not None:
                    held.check_unchanged()
        except SafetensorsError as exc:
            raise CheckpointError(str(exc), tensor=exc.field, value=exc.value) from None
        family = family_of(config)
        try:
            family.check_tensors(config, tensors)
        except ValueError as exc:
            raise CheckpointError(f"{folder.path}: {exc}") from exc
        log.info("%s: %s drafter, N %d (block %d), vocab %d (drafts over %d), taps of target"
                 " layers %s (outputs of those layers; -1 the embedding), %d draft layers",
                 folder.path, family.name, config.num_spec, config.block_size,
                 config.vocab_size, config.draft_vocab, list(config.target_layer_ids),
                 config.num_hidden_layers)
        # Hashed from the loaded bytes and the config read: the weights are read once, and
        # what is hashed is exactly what runs (hashing the files beside the loaded copy
        # doubled the resident memory).
        drafter_id, markov_id = identities_from_arrays(
            {name: (ref.dtype, ref.shape, _raw_bytes(tensors[name]))
             for name, ref in refs.items()}, raw)
        # Identities are of the tensors as stored; the model takes them dequantised and renamed.
        tensors = family.model_tensors(config, tensors, str(folder.path))
        if record_identities:
            written = write_identity_file(folder, refs, (drafter_id, markov_id))
            log.info("identities %s", f"recorded in {written} for engines" if written else
                     f"not recorded beside {folder.path} (not writable): engines hash the"
                     " weights")
        files = tuple(sorted({ref.path for ref in refs.values()}))
        return LoadedCheckpoint(config, tensors, drafter_id, markov_id, files,
                                folder=folder.path, config_json=raw)


def check_device_memory(tensors: dict[str, torch.Tensor], device: torch.device,
                        dtype: torch.dtype) -> None:
    """On CUDA, refuse weights that do not fit in the device's free memory, before any of them
    is copied there (a reload must leave the serving drafter's device memory alone)."""
    if device.type != "cuda":
        return
    elem = torch.empty((), dtype=dtype).element_size()
    need = sum(t.numel() * (elem if t.is_floating_point() else t.element_size())
               for t in tensors.values())
    free, _total = torch.cuda.mem_get_info(device)
    if need > free:
        raise CheckpointError(f"the drafter's weights need {need} bytes on {device} as"
                              f" {str(dtype).removeprefix('torch.')}; {free} bytes are free",
                              tensor="tensors", value=need, limit=free)


def _raw_bytes(t: torch.Tensor) -> memoryview:
    """A CPU tensor's bytes, no copy."""
    if not t.numel():
        return memoryview(b"")
    return t.reshape(-1).view(torch.uint8).numpy().data


def _log_target_tensors(refs: dict[str, TensorRef], lacking: list[str],
                        target_checkpoint: str | Path | None) -> None:
    """Say where embed_tokens and lm_head come from, and when --target-checkpoint is unused."""
    for name in TARGET_TENSORS:
        ref = refs.get(name)
        if ref is not None:
            log.info("%s (%s %s): %s", name, ref.dtype, list(ref.shape),
                     f"from the target checkpoint, {ref.path}" if name in lacking
                     else f"from the drafter checkpoint, {ref.path}")
    if target_checkpoint is not None and not lacking:
        log.info("target checkpoint %s ignored: the drafter checkpoint has its own %s",
                 target_checkpoint, " and ".join(TARGET_TENSORS))


def read_tensor(name: str, ref: TensorRef) -> torch.Tensor:
    """One tensor's bytes from its file (nothing else of the file is read), through the
    file's open descriptor where the ref has one."""
    dtype = (TORCH_DTYPES.get(ref.dtype) or INDEX_TORCH_DTYPES.get(ref.dtype)
             or STORED_DTYPES[ref.dtype])
    count = math.prod(ref.shape)
    nbytes = ref.end - ref.start
    if nbytes != count * DTYPE_BYTES[ref.dtype]:
        raise CheckpointError(f"{ref.path}: tensor {name} holds {nbytes} bytes; shape "
                              f"{list(ref.shape)} of {ref.dtype} needs"
                              f" {count * DTYPE_BYTES[ref.dtype]}", tensor=name,
                              shape=ref.shape)
    if count == 0:
        return torch.empty(ref.shape, dtype=dtype)
    data = bytearray(nbytes)
    try:
        got = read_ref(ref, memoryview(data))
    except SafetensorsError as exc:
        raise CheckpointError(str(exc), tensor=name) from None
    if got != nbytes:
        raise CheckpointError(f"{ref.path}: tensor {name} is cut short", tensor=name)
    # safetensors stores little-endian; every platform torch runs the drafter on is too.
    return torch.frombuffer(data, dtype=dtype).view(ref.shape)


def save_checkpoint(model: DraftModel, directory: str | Path, *,
                    max_shard_bytes: int | None = None,
                    exclude: Iterable[str] = ()) -> list[Path]:
    """Write ``config.json`` and the weights in the DeepSpec layout: one ``model.safetensors``,
    or shards of at most ``max_shard_bytes`` each with ``model.safetensors.index.json``.
    ``exclude`` leaves tensors out (a drafter that takes embed/lm_head from its target), and
    so are those a family only takes from the target (a speculators checkpoint's embedding).
    Tensors keep the model's dtype. Returns the safetensors files written."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    skip = set(exclude) | set(family_of(model.config).from_target(model.config))
    state = {name: t.detach().to("cpu").contiguous().clone()
             for name, t in model.state_dict().items() if name not in skip}
    (out / "config.json").write_text(json.dumps(model.config.to_json_dict(), indent=2) + "\n")
    if max_shard_bytes is None:
        path = out / SINGLE_FILE
        save_file(state, str(path), metadata={"format": "pt"})
        return [path]
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(state):
        t = state[name]
        if shards[-1] and size + t.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += t.nbytes
    paths: list[Path] = []
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        paths.append(out / fname)
        weight_map.update(dict.fromkeys(shard, fname))
    index = {"metadata": {"total_size": sum(t.nbytes for t in state.values())},
             "weight_map": weight_map}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return paths


def tensor_records(tensors: dict[str, torch.Tensor]
                   ) -> dict[str, tuple[str, tuple[int, ...], memoryview]]:
    """In-memory tensors as ``protocol.identity.identities_from_arrays`` reads them."""
    out: dict[str, tuple[str, tuple[int, ...], memoryview]] = {}
    for name, t in tensors.items():
        host = t.detach().to("cpu").contiguous()
        raw = host.reshape(-1).view(torch.uint8).numpy().tobytes() if host.numel() else b""
        out[name] = (SAFETENSORS_DTYPES[host.dtype], tuple(host.shape), memoryview(raw))
    return out
