"""Drafter and Markov identities from safetensors files, without a framework
(docs/contract.md section 6.4).

Each identity is a SHA-256 over tensors sorted by name; each tensor is fed as::

    name (UTF-8) 0x00  dtype (safetensors spelling, e.g. "BF16") 0x00
    ndim u32 LE, each dim u64 LE, nbytes u64 LE, then the raw little-endian bytes

``markov_identity`` covers the tensors named ``markov_head.*``; ``drafter_identity`` every other
tensor the drafter runs with, including ``embed_tokens.weight`` and ``lm_head.weight`` when they
come from the target checkpoint (they shape every draft, so they belong to its identity). The
file order, the split into shards and the tensor order inside a file do not change the result.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import struct
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Final

from .errors import BadFrameError

MARKOV_PREFIX: Final = "markov_head."
# Where a multimodal target (Gemma-4's ConditionalGeneration layout, current and older
# transformers) nests its text model's embedding.
NESTED_TEXT_EMBEDDINGS: Final = ("model.language_model.embed_tokens.weight",
                                 "language_model.model.embed_tokens.weight")
# Tensors a DeepSpec drafter checkpoint may omit, and where a target checkpoint keeps them, first
# match wins (a target with tied embeddings, Gemma-4's among them, has no lm_head.weight: the
# embedding serves as both).
TARGET_FALLBACKS: Final[dict[str, tuple[str, ...]]] = {
    "embed_tokens.weight": ("model.embed_tokens.weight", "embed_tokens.weight",
                            *NESTED_TEXT_EMBEDDINGS),
    "lm_head.weight": ("lm_head.weight", "model.embed_tokens.weight", "embed_tokens.weight",
                       *NESTED_TEXT_EMBEDDINGS),
}
SINGLE_FILE: Final = "model.safetensors"
INDEX_FILE: Final = "model.safetensors.index.json"
# A safetensors JSON header larger than this is refused as malformed.
MAX_HEADER_BYTES: Final = 100 << 20

TensorBytes = bytes | bytearray | memoryview


class SafetensorsError(BadFrameError):
    """A checkpoint file is unreadable or lacks a tensor."""


class TensorRef:
    """Where one tensor's bytes lie: a file, a byte range, its dtype and shape."""

    __slots__ = ("dtype", "end", "path", "shape", "start")

    def __init__(self, path: Path, dtype: str, shape: tuple[int, ...], start: int,
                 end: int) -> None:
        self.path, self.dtype, self.shape, self.start, self.end = path, dtype, shape, start, end


def read_header(path: Path) -> dict[str, TensorRef]:
    """The tensors of one safetensors file, by name (``__metadata__`` left out)."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise SafetensorsError(f"{path}: {len(head)} bytes, too short for safetensors")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES:
                raise SafetensorsError(f"{path}: header of {n} bytes is over the"
                                       f" {MAX_HEADER_BYTES}-byte limit", value=n,
                                       limit=MAX_HEADER_BYTES)
            raw = f.read(n)
            f.seek(0, 2)
            size = f.tell()
    except OSError as exc:
        raise SafetensorsError(f"{path}: cannot read ({exc})") from exc
    if len(raw) != n:
        raise SafetensorsError(f"{path}: header says {n} bytes, the file holds {len(raw)}"
                               " after the length", value=len(raw), limit=n)
    try:
        meta: dict[str, Any] = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SafetensorsError(f"{path}: header is not JSON ({exc})") from exc
    if not isinstance(meta, dict):
        raise SafetensorsError(f"{path}: header is JSON {type(meta).__name__}, not an object")
    base = 8 + n
    out: dict[str, TensorRef] = {}
    for name, info in meta.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = (int(x) for x in info["data_offsets"])
            ref = TensorRef(path, str(info["dtype"]), tuple(int(d) for d in info["shape"]),
                            base + begin, base + end)
        except (KeyError, TypeError, ValueError) as exc:
            raise SafetensorsError(f"{path}: tensor {name!r} has a malformed entry {info!r}"
                                   ) from exc
        if not base <= ref.start <= ref.end <= size:
            raise SafetensorsError(f"{path}: tensor {name!r} bytes [{ref.start}, {ref.end})"
                                   f" lie outside the file of {size} bytes")
        out[name] = ref
    return out


def checkpoint_files(directory: Path) -> list[Path]:
    """The safetensors files of a checkpoint folder: the shards named by its index, else
    ``model.safetensors``, else every ``*.safetensors`` file in it."""
    directory = Path(directory)
    index = directory / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            return [directory / name for name in sorted(set(weight_map.values()))]
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise SafetensorsError(f"{index}: not a safetensors index ({exc})") from exc
    if (directory / SINGLE_FILE).is_file():
        return [directory / SINGLE_FILE]
    found = sorted(directory.glob("*.safetensors"))
    if not found:
        raise SafetensorsError(f"{directory}: no safetensors files", field="checkpoint")
    return found


def tensor_index(paths: Iterable[Path]) -> dict[str, TensorRef]:
    """Every tensor over several files; a name in two files is an error."""
    out: dict[str, TensorRef] = {}
    for path in paths:
        for name, ref in read_header(Path(path)).items():
            if name in out:
                raise SafetensorsError(f"tensor {name!r} appears in both {out[name].path} and"
                                       f" {path}", field=name)
            out[name] = ref
    return out


def _feed(h: Any, name: str, dtype: str, shape: tuple[int, ...], data: TensorBytes) -> None:
    nbytes = memoryview(data).nbytes
    h.update(name.encode("utf-8") + b"\0" + dtype.encode("ascii") + b"\0")
    h.update(struct.pack(f"<I{len(shape)}QQ", len(shape), *shape, nbytes))
    h.update(data)


def _is_markov(name: str) -> bool:
    return name.startswith(MARKOV_PREFIX)


def identities_from_refs(refs: Mapping[str, TensorRef]) -> tuple[bytes, bytes]:
    """Identities of tensors lying in files, read through a memory map (never all at once)."""
    drafter, markov = hashlib.sha256(), hashlib.sha256()
    maps: dict[Path, mmap.mmap] = {}
    try:
        for name in sorted(refs):
            ref = refs[name]
            mm = maps.get(ref.path)
            if mm is None:
                with open(ref.path, "rb") as f:
                    mm = maps[ref.path] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            view = memoryview(mm)[ref.start:ref.end]
            try:
                _feed(markov if _is_markov(name) else drafter, name, ref.dtype, ref.shape, view)
            finally:
                view.release()
    finally:
        for mm in maps.values():
            mm.close()
    return drafter.digest(), markov.digest()


def identities_from_arrays(
    tensors: Mapping[str, tuple[str, tuple[int, ...], TensorBytes]],
) -> tuple[bytes, bytes]:
    """Identities of tensors held in memory: name -> (safetensors dtype, shape, raw LE bytes)."""
    drafter, markov = hashlib.sha256(), hashlib.sha256()
    for name in sorted(tensors):
        dtype, shape, data = tensors[name]
        _feed(markov if _is_markov(name) else drafter, name, dtype, tuple(shape), data)
    return drafter.digest(), markov.digest()


def resolve_fallbacks(refs: dict[str, TensorRef],
                      target_refs: Mapping[str, TensorRef] | None) -> dict[str, TensorRef]:
    """Add ``embed_tokens.weight`` / ``lm_head.weight`` from the target where the drafter lacks
    them (section 6.4: they are part of the drafter's identity)."""
    out = dict(refs)
    for name, sources in TARGET_FALLBACKS.items():
        if name in out or target_refs is None:
            continue
        for src in sources:
            if src in target_refs:
                out[name] = target_refs[src]
                break
    return out


def identities_from_files(
    paths: Iterable[Path | str],
    extra: Mapping[str, Path | str | tuple[Path | str, str]] | None = None,
) -> tuple[bytes, bytes]:
    """Identities of the tensors in ``paths``; ``extra`` adds a drafter tensor from another
    file: ``name -> path`` (looked up under the name, then its target spellings) or
    ``name -> (path, name_in_that_file)``."""
    refs = tensor_index(Path(p) for p in paths)
    for name, where in (extra or {}).items():
        candidates: tuple[str, ...]
        if isinstance(where, tuple):
            path, candidates = Path(where[0]), (where[1],)
        else:
            path, candidates = Path(where), (name, *TARGET_FALLBACKS.get(name, ()))
        other = read_header(path)
        src = next((c for c in candidates if c in other), None)
        if src is None:
            raise SafetensorsError(f"{path}: holds none of {list(candidates)} for {name!r}",
                                   field=name)
        refs[name] = other[src]
    return identities_from_refs(refs)


def identities_from_checkpoint(checkpoint: Path | str,
                               target_checkpoint: Path | str | None = None) -> tuple[bytes, bytes]:
    """Identities of a DeepSpec drafter checkpoint folder, taking ``embed_tokens`` and
    ``lm_head`` from the target checkpoint folder when the drafter has none."""
    refs = tensor_index(checkpoint_files(Path(checkpoint)))
    target = (tensor_index(checkpoint_files(Path(target_checkpoint)))
              if target_checkpoint is not None else None)
    return identities_from_refs(resolve_fallbacks(refs, target))
