"""DeepSpec drafter checkpoints: load (with embed/lm_head from the target when absent), check
every shape, compute the identities, and save (DRAFTER.md "Checkpoints"; CONTRACT 6.4).

The tensors a drafter runs with are chosen once, by ``protocol.identity`` (its safetensors
header reader and its target fallbacks), and both the identity and the weights are read from
exactly those byte ranges: what is hashed is what is loaded. From a target checkpoint only the
two tensors needed are read (``model.embed_tokens.weight`` and ``lm_head.weight``, or the
embedding twice for a target with tied embeddings).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from protocol.identity import (
    INDEX_FILE,
    SINGLE_FILE,
    TARGET_FALLBACKS,
    SafetensorsError,
    TensorRef,
    checkpoint_files,
    identities_from_refs,
    resolve_fallbacks,
    tensor_index,
)

from .config import DrafterConfig
from .families import expected_shapes, load_config
from .model import DraftModel

# safetensors dtype spellings the drafter loads (it casts to its own dtype after loading).
TORCH_DTYPES: dict[str, torch.dtype] = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F64": torch.float64,
}
SAFETENSORS_DTYPES = {v: k for k, v in TORCH_DTYPES.items()}
TARGET_TENSORS = ("embed_tokens.weight", "lm_head.weight")


class CheckpointError(ValueError):
    """A checkpoint cannot be used: missing, unexpected or misshapen tensor, unreadable file."""

    def __init__(self, message: str, *, tensor: str | None = None,
                 shape: tuple[int, ...] | None = None,
                 expected: tuple[int, ...] | None = None) -> None:
        super().__init__(message)
        self.tensor = tensor
        self.shape = shape
        self.expected = expected


@dataclass(frozen=True)
class LoadedCheckpoint:
    config: DrafterConfig
    tensors: dict[str, torch.Tensor]  # CPU, in the dtype stored in the files
    drafter_identity: bytes
    markov_identity: bytes
    files: tuple[Path, ...]  # every file a tensor was read from, target files included


def resolve_checkpoint(checkpoint: str | Path,
                       target_checkpoint: str | Path | None = None
                       ) -> tuple[DrafterConfig, dict[str, TensorRef]]:
    """The config and where each drafter tensor lies, every name and shape checked."""
    directory = Path(checkpoint)
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: not a checkpoint directory")
    config = load_config(directory)
    expected = expected_shapes(config)
    try:
        refs = tensor_index(checkpoint_files(directory))
        unexpected = sorted(set(refs) - set(expected))
        if unexpected:
            raise CheckpointError(
                f"{directory}: unexpected tensor {unexpected[0]} (shape "
                f"{list(refs[unexpected[0]].shape)}) for this config.json"
                + (f" and {len(unexpected) - 1} more" if len(unexpected) > 1 else ""),
                tensor=unexpected[0], shape=refs[unexpected[0]].shape)
        lacking = [name for name in TARGET_TENSORS if name not in refs]
        if lacking and target_checkpoint is not None:
            target = tensor_index(checkpoint_files(Path(target_checkpoint)))
            refs = resolve_fallbacks(refs, target)
    except SafetensorsError as exc:
        raise CheckpointError(str(exc)) from exc
    for name, shape in expected.items():
        ref = refs.get(name)
        if ref is None:
            where = (f"; pass the target checkpoint to take {name} from it"
                     if name in TARGET_TENSORS and target_checkpoint is None else
                     f" nor in the target checkpoint {target_checkpoint} (which holds none of"
                     f" {list(TARGET_FALLBACKS[name])})"
                     if name in TARGET_TENSORS else "")
            raise CheckpointError(f"{directory}: missing tensor {name} (expected shape "
                                  f"{list(shape)}){where}", tensor=name, expected=shape)
        if ref.shape != shape:
            raise CheckpointError(
                f"{ref.path}: tensor {name} has shape {list(ref.shape)}, expected {list(shape)}",
                tensor=name, shape=ref.shape, expected=shape)
        if ref.dtype not in TORCH_DTYPES:
            raise CheckpointError(f"{ref.path}: tensor {name} has dtype {ref.dtype}; the drafter"
                                  f" loads {sorted(TORCH_DTYPES)}", tensor=name)
    return config, refs


def load_checkpoint(checkpoint: str | Path,
                    target_checkpoint: str | Path | None = None) -> LoadedCheckpoint:
    """Read a DeepSpec drafter checkpoint folder (``model.safetensors`` or shards with
    ``model.safetensors.index.json``); ``embed_tokens`` / ``lm_head`` come from
    ``target_checkpoint`` when the drafter has none."""
    config, refs = resolve_checkpoint(checkpoint, target_checkpoint)
    tensors = {name: read_tensor(name, ref) for name, ref in refs.items()}
    drafter_id, markov_id = identities_from_refs(refs)
    files = tuple(sorted({ref.path for ref in refs.values()}))
    return LoadedCheckpoint(config, tensors, drafter_id, markov_id, files)


def read_tensor(name: str, ref: TensorRef) -> torch.Tensor:
    """One tensor's bytes from its file (nothing else of the file is read)."""
    dtype = TORCH_DTYPES[ref.dtype]
    count = math.prod(ref.shape)
    nbytes = ref.end - ref.start
    elem = torch.finfo(dtype).bits // 8
    if nbytes != count * elem:
        raise CheckpointError(f"{ref.path}: tensor {name} holds {nbytes} bytes; shape "
                              f"{list(ref.shape)} of {ref.dtype} needs {count * elem}",
                              tensor=name, shape=ref.shape)
    if count == 0:
        return torch.empty(ref.shape, dtype=dtype)
    data = bytearray(nbytes)
    with open(ref.path, "rb") as f:
        f.seek(ref.start)
        if f.readinto(data) != nbytes:
            raise CheckpointError(f"{ref.path}: tensor {name} is cut short", tensor=name)
    # safetensors stores little-endian; every platform torch runs the drafter on is too.
    return torch.frombuffer(data, dtype=dtype).view(ref.shape)


def save_checkpoint(model: DraftModel, directory: str | Path, *,
                    max_shard_bytes: int | None = None,
                    exclude: Iterable[str] = ()) -> list[Path]:
    """Write ``config.json`` and the weights in the DeepSpec layout: one ``model.safetensors``,
    or shards of at most ``max_shard_bytes`` each with ``model.safetensors.index.json``.
    ``exclude`` leaves tensors out (a drafter that takes embed/lm_head from its target).
    Tensors keep the model's dtype. Returns the safetensors files written."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    skip = set(exclude)
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
