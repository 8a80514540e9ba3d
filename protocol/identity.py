"""Drafter and Markov identities from safetensors files, without a framework
(docs/contract.md section 6.4).

Each identity is a SHA-256 over tensors sorted by name; each tensor is fed as::

    name (UTF-8) 0x00  dtype (safetensors spelling, e.g. "BF16") 0x00
    ndim u32 LE, each dim u64 LE, nbytes u64 LE, then the raw little-endian bytes

``markov_identity`` covers the tensors named ``markov_head.*``; ``drafter_identity`` every other
tensor the drafter runs with, including ``embed_tokens.weight`` and ``lm_head.weight`` when they
come from the target checkpoint (they shape every draft, so they belong to its identity). The
file order, the split into shards and the tensor order inside a file do not change the result.

A drafter folder lacking ``embed_tokens.weight`` or ``lm_head.weight`` with no target that has
it is refused here, for worker and engine alike (``drafter_refs``). ``dspark_identity.json``
beside a checkpoint records identities with their inputs, so that an engine's HELLO need not
hash gigabytes of weights the worker already hashed (``read_identity_file``).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import stat
import struct
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Final

from .constants import IDENTITY_BYTES
from .errors import BadFrameError

MARKOV_PREFIX: Final = "markov_head."
# Where a multimodal target (Gemma-4's ConditionalGeneration layout, current and older
# transformers) nests its text model's embedding.
NESTED_TEXT_EMBEDDINGS: Final = ("model.language_model.embed_tokens.weight",
                                 "language_model.model.embed_tokens.weight")
# Where an untied multimodal target (MiniMax-M3's VL wrapper) keeps its text model's head:
# looked up before the embeddings, which only a tied target uses as its head.
NESTED_TEXT_HEADS: Final = ("language_model.lm_head.weight",)
# Tensors a DeepSpec drafter checkpoint may omit, and where a target checkpoint keeps them, first
# match wins (a target with tied embeddings, Gemma-4's among them, has no lm_head.weight: the
# embedding serves as both).
TARGET_FALLBACKS: Final[dict[str, tuple[str, ...]]] = {
    "embed_tokens.weight": ("model.embed_tokens.weight", "embed_tokens.weight",
                            *NESTED_TEXT_EMBEDDINGS),
    "lm_head.weight": ("lm_head.weight", *NESTED_TEXT_HEADS, "model.embed_tokens.weight",
                       "embed_tokens.weight", *NESTED_TEXT_EMBEDDINGS),
}
# Prefixes a drafter checkpoint may put before every tensor name (MiniMax-M3's DSpark drafter
# keeps its tensors under the VL wrapper's text model): removed from every name when all of a
# folder's tensors carry one, so that identities and layouts use the drafter's own names.
DRAFTER_PREFIXES: Final = ("language_model.model.dspark.",)
SINGLE_FILE: Final = "model.safetensors"
INDEX_FILE: Final = "model.safetensors.index.json"
# A safetensors JSON header larger than this is refused as malformed: a tensor's entry is about
# 100 bytes, so this is some 300,000 tensors in one file (the largest checkpoints hold a few
# thousand per shard), and parsing it costs a few hundred MiB at most.
MAX_HEADER_BYTES: Final = 32 << 20
# model.safetensors.index.json: a weight map of a few hundred thousand names.
MAX_INDEX_BYTES: Final = 64 << 20
# dspark_identity.json: two digests and a line per tensor.
MAX_IDENTITY_FILE_BYTES: Final = 16 << 20
# Hashing reads files through one buffer of this size: large enough that SHA-256, not the
# reads, sets the pace; small beside any weights.
HASH_CHUNK_BYTES: Final = 8 << 20
# Beside a checkpoint: its identities and what they were computed from (section 6.4), so that
# an engine building its HELLO need not read the weights again (``cached_identities``).
IDENTITY_FILE: Final = "dspark_identity.json"
IDENTITY_FILE_FORMAT: Final = 1

TensorBytes = bytes | bytearray | memoryview


class SafetensorsError(BadFrameError):
    """A checkpoint file is unreadable or lacks a tensor."""


class TensorRef:
    """Where one tensor's bytes lie: a file, a byte range, its dtype and shape."""

    __slots__ = ("dtype", "end", "path", "shape", "start")

    def __init__(self, path: Path, dtype: str, shape: tuple[int, ...], start: int,
                 end: int) -> None:
        self.path, self.dtype, self.shape, self.start, self.end = path, dtype, shape, start, end


def _file_kind(mode: int) -> str:
    for test, kind in ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return kind
    return "not a regular file"


def open_regular(path: Path | str) -> io.BufferedReader:
    """``path`` opened for reading, if it is a regular file (a symlink to one is fine, as in a
    Hugging Face cache): a FIFO would block the open or the read forever, and a device such as
    /dev/zero never ends. Raises SafetensorsError naming the path and what it is."""
    try:
        st = os.stat(path)  # follows symlinks: what would be read
    except OSError as exc:
        raise SafetensorsError(f"{path}: cannot read ({exc.strerror or exc})",
                               field=str(path)) from exc
    if not stat.S_ISREG(st.st_mode):
        raise SafetensorsError(f"{path}: is {_file_kind(st.st_mode)}, not a regular file",
                               field=str(path), value=_file_kind(st.st_mode))
    try:
        # O_NONBLOCK: a FIFO put in its place since the stat cannot block the open either
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise SafetensorsError(f"{path}: cannot read ({exc.strerror or exc})",
                               field=str(path)) from exc
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise SafetensorsError(f"{path}: is {_file_kind(mode)}, not a regular file",
                               field=str(path), value=_file_kind(mode))
    os.set_blocking(fd, True)
    return open(fd, "rb")


def read_small_file(path: Path | str, limit: int) -> bytes:
    """The whole of a regular file of at most ``limit`` bytes (SafetensorsError otherwise,
    naming its size and the limit); never more than ``limit + 1`` bytes are read, whatever
    the file does meanwhile."""
    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        if size > limit:
            raise SafetensorsError(f"{path}: {size} bytes, over the {limit}-byte limit for"
                                   " this file", field=str(path), value=size, limit=limit)
        try:
            data = f.read(limit + 1)
        except OSError as exc:
            raise SafetensorsError(f"{path}: cannot read ({exc.strerror or exc})",
                                   field=str(path)) from exc
    if len(data) > limit:
        raise SafetensorsError(f"{path}: more than {limit} bytes, the limit for this file",
                               field=str(path), value=len(data), limit=limit)
    return data


def load_json(data: bytes, path: Path | str) -> Any:
    """``data`` (UTF-8 JSON) parsed; SafetensorsError naming ``path`` otherwise (bad UTF-8,
    bad JSON, nesting too deep for the parser, an integer of thousands of digits)."""
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SafetensorsError(f"{path}: not valid JSON ({exc})", field=str(path)) from exc
    except (RecursionError, ValueError) as exc:
        raise SafetensorsError(f"{path}: not JSON this reader accepts ({exc})",
                               field=str(path)) from exc


def _uint(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def read_header(path: Path) -> dict[str, TensorRef]:
    """The tensors of one safetensors file, by name (``__metadata__`` left out). The header's
    length, every entry's dtype, shape and byte range are checked against the file before
    anything is allocated for them: a truncated file or a lying header is refused here."""
    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        try:
            head = f.read(8)
            if len(head) != 8:
                raise SafetensorsError(f"{path}: {len(head)} bytes, too short for safetensors")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES:
                raise SafetensorsError(f"{path}: header of {n} bytes is over the"
                                       f" {MAX_HEADER_BYTES}-byte limit", value=n,
                                       limit=MAX_HEADER_BYTES)
            if n > size - 8:
                raise SafetensorsError(f"{path}: header says {n} bytes, the file holds"
                                       f" {size - 8} after the length (cut short?)",
                                       value=n, limit=size - 8)
            raw = f.read(n)
        except OSError as exc:
            raise SafetensorsError(f"{path}: cannot read ({exc})") from exc
    if len(raw) != n:
        raise SafetensorsError(f"{path}: header says {n} bytes, the file holds {len(raw)}"
                               " after the length", value=len(raw), limit=n)
    meta = load_json(raw, f"{path} (safetensors header)")
    if not isinstance(meta, dict):
        raise SafetensorsError(f"{path}: header is JSON {type(meta).__name__}, not an object")
    base = 8 + n
    out: dict[str, TensorRef] = {}
    for name, info in meta.items():
        if name == "__metadata__":
            continue
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        shape = info.get("shape") if isinstance(info, dict) else None
        dtype = info.get("dtype") if isinstance(info, dict) else None
        if not (isinstance(dtype, str) and isinstance(shape, list) and all(map(_uint, shape))
                and isinstance(offsets, list) and len(offsets) == 2
                and all(map(_uint, offsets)) and offsets[0] <= offsets[1]):
            raise SafetensorsError(f"{path}: tensor {name!r} has a malformed entry"
                                   f" {str(info)[:200]} (dtype a string, shape a list of"
                                   " integers >= 0, data_offsets [begin, end] with"
                                   " 0 <= begin <= end)", field=name)
        ref = TensorRef(path, dtype, tuple(shape), base + offsets[0], base + offsets[1])
        if ref.end > size:
            raise SafetensorsError(f"{path}: tensor {name!r} bytes [{ref.start}, {ref.end})"
                                   f" lie outside the file of {size} bytes", field=name,
                                   value=ref.end, limit=size)
        out[name] = ref
    return out


def checkpoint_files(directory: Path) -> list[Path]:
    """The safetensors files of a checkpoint folder: the shards named by its index, else
    ``model.safetensors``, else every ``*.safetensors`` file in it."""
    directory = Path(directory)
    index = directory / INDEX_FILE
    if index.exists():
        record = load_json(read_small_file(index, MAX_INDEX_BYTES), index)
        weight_map = record.get("weight_map") if isinstance(record, dict) else None
        if not isinstance(weight_map, dict) or not all(
                isinstance(v, str) for v in weight_map.values()):
            raise SafetensorsError(f"{index}: not a safetensors index (no weight_map of"
                                   " tensor names to file names)", field="weight_map")
        names = sorted(set(weight_map.values()))
        for name in names:  # shards lie in the folder: no path leads out of it
            if not name or name != Path(name).name or name in (".", ".."):
                raise SafetensorsError(f"{index}: weight_map names {name!r}, not a file name"
                                       " in the checkpoint folder", field="weight_map",
                                       value=name)
        return [directory / name for name in names]
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


def drafter_tensors(directory: Path | str) -> dict[str, TensorRef]:
    """Every tensor of a drafter checkpoint folder, by the drafter's own name: a prefix of
    ``DRAFTER_PREFIXES`` that every name carries is removed."""
    refs = tensor_index(checkpoint_files(Path(directory)))
    for prefix in DRAFTER_PREFIXES:
        if refs and all(name.startswith(prefix) for name in refs):
            return {name.removeprefix(prefix): ref for name, ref in refs.items()}
    return refs


def _feed_head(h: Any, name: str, dtype: str, shape: tuple[int, ...], nbytes: int) -> None:
    h.update(name.encode("utf-8") + b"\0" + dtype.encode("ascii") + b"\0")
    h.update(struct.pack(f"<I{len(shape)}QQ", len(shape), *shape, nbytes))


def _feed(h: Any, name: str, dtype: str, shape: tuple[int, ...], data: TensorBytes) -> None:
    _feed_head(h, name, dtype, shape, memoryview(data).nbytes)
    h.update(data)


def _is_markov(name: str) -> bool:
    return name.startswith(MARKOV_PREFIX)


def identities_from_refs(refs: Mapping[str, TensorRef]) -> tuple[bytes, bytes]:
    """Identities of tensors lying in files, read through one reused buffer of
    HASH_CHUNK_BYTES: the process never holds more of the weights than that (a memory map
    would leave every page it touched resident)."""
    drafter, markov = hashlib.sha256(), hashlib.sha256()
    buf = bytearray(HASH_CHUNK_BYTES)
    view = memoryview(buf)
    files: dict[Path, Any] = {}
    try:
        for name in sorted(refs):
            ref = refs[name]
            f = files.get(ref.path)
            if f is None:
                f = files[ref.path] = open_regular(ref.path)
            h = markov if _is_markov(name) else drafter
            _feed_head(h, name, ref.dtype, ref.shape, ref.end - ref.start)
            f.seek(ref.start)
            left = ref.end - ref.start
            while left:
                n = f.readinto(view[:min(left, HASH_CHUNK_BYTES)])
                if not n:
                    raise SafetensorsError(f"{ref.path}: tensor {name!r} is cut short")
                h.update(view[:n])
                left -= n
    finally:
        for f in files.values():
            f.close()
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


def missing_target_tensor_message(checkpoint: Path | str, name: str,
                                  target_checkpoint: Path | str | None) -> str:
    """The one text, worker and engine alike, for a drafter checkpoint that lacks
    ``embed_tokens.weight`` or ``lm_head.weight`` with no target checkpoint that has it."""
    if target_checkpoint is None:
        return (f"{checkpoint}: the drafter checkpoint has no {name} and no target checkpoint"
                f" was given; pass the target model's checkpoint to take {name} from it"
                " (dspark-worker --target-checkpoint; hello_from_checkpoint(...,"
                " target_checkpoint=...) on the engine side, the same folder)")
    return (f"{checkpoint}: the drafter checkpoint has no {name}, and the target checkpoint"
            f" {target_checkpoint} has none of {list(TARGET_FALLBACKS[name])} either")


def drafter_refs(checkpoint: Path | str, target_checkpoint: Path | str | None = None
                 ) -> dict[str, TensorRef]:
    """Where each tensor of a DeepSpec drafter checkpoint folder lies, ``embed_tokens`` and
    ``lm_head`` taken from the target checkpoint folder when the drafter has none; either one
    missing from both is an error (``missing_target_tensor_message``). Headers only."""
    refs = drafter_tensors(checkpoint)
    lacking = [name for name in TARGET_FALLBACKS if name not in refs]
    if not lacking:
        return refs
    target = (tensor_index(checkpoint_files(Path(target_checkpoint)))
              if target_checkpoint is not None else None)
    refs = resolve_fallbacks(refs, target)
    for name in lacking:
        if name not in refs:
            raise SafetensorsError(missing_target_tensor_message(checkpoint, name,
                                                                 target_checkpoint),
                                   field=name)
    return refs


def identities_from_checkpoint(checkpoint: Path | str,
                               target_checkpoint: Path | str | None = None, *,
                               use_identity_file: bool = True) -> tuple[bytes, bytes]:
    """Identities of a DeepSpec drafter checkpoint folder, taking ``embed_tokens`` and
    ``lm_head`` from the target checkpoint folder when the drafter has none. With
    ``use_identity_file``, a current ``dspark_identity.json`` beside the checkpoint (the
    worker writes it when it loads the folder) answers without reading the weights; otherwise
    they are hashed. Nothing is written here."""
    refs = drafter_refs(checkpoint, target_checkpoint)
    if use_identity_file:
        cached = read_identity_file(checkpoint, refs)
        if cached is not None:
            return cached
    return identities_from_refs(refs)


def markov_walk_identity(markov_identity: bytes, draft_topk: int = 0) -> bytes:
    """The Markov identity a worker announces for its walk: the tensors' identity itself for
    the walk over the whole vocabulary (``draft_topk`` 0), else SHA-256 over
    ``b"dspark_draft_topk" 0x00 | k u32 LE | markov_identity``: the candidate walk drafts other
    tokens, so a HELLO for the other walk is refused (section 6.4)."""
    if not draft_topk:
        return markov_identity
    h = hashlib.sha256(b"dspark_draft_topk\x00")
    h.update(struct.pack("<I", draft_topk))
    h.update(markov_identity)
    return h.digest()


# -- the identity file ----------------------------------------------------------------------------
def identity_inputs(checkpoint: Path | str, refs: Mapping[str, TensorRef]) -> dict[str, Any]:
    """What identities are computed from, cheaply checkable: every tensor's file, byte range,
    dtype and shape, and every file's size and modification time (a file rewritten since
    makes a recorded identity stale). Files inside the checkpoint folder are named relative
    to it, others (a target checkpoint's) by absolute path."""
    root = Path(checkpoint).resolve()

    def label(path: Path) -> str:
        p = Path(path).resolve()
        return str(p.relative_to(root)) if p.is_relative_to(root) else str(p)

    files: dict[str, dict[str, int]] = {}
    for ref in refs.values():
        key = label(ref.path)
        if key not in files:
            st = os.stat(ref.path)
            files[key] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
    tensors = {name: [label(ref.path), ref.dtype, list(ref.shape), ref.start, ref.end]
               for name, ref in sorted(refs.items())}
    return {"files": dict(sorted(files.items())), "tensors": tensors}


def read_identity_record(checkpoint: Path | str) -> tuple[bytes, bytes, dict[str, Any]] | None:
    """The ``dspark_identity.json`` beside ``checkpoint``, read with a bound: its drafter and
    markov identities and the whole record; None when there is no such file. A file that is
    not such a record raises ValueError naming it."""
    path = Path(checkpoint) / IDENTITY_FILE
    if not path.exists():
        return None
    try:
        record = load_json(read_small_file(path, MAX_IDENTITY_FILE_BYTES), path)
        if not isinstance(record, dict) or record.get("format") != IDENTITY_FILE_FORMAT:
            raise ValueError(f"not format {IDENTITY_FILE_FORMAT}")
        drafter, markov = (bytes.fromhex(record[k])
                           for k in ("drafter_identity", "markov_identity"))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"{path}: not an identity record the worker wrote ({exc})") from None
    if len(drafter) != IDENTITY_BYTES or len(markov) != IDENTITY_BYTES:
        raise ValueError(f"{path}: identities must be {IDENTITY_BYTES} bytes each")
    return drafter, markov, record


def read_identity_file(checkpoint: Path | str,
                       refs: Mapping[str, TensorRef]) -> tuple[bytes, bytes] | None:
    """The identities recorded beside ``checkpoint`` if they were computed from exactly these
    tensors in these files as they are now; None when there is no such file or it is stale,
    unreadable or of another format."""
    try:
        found = read_identity_record(checkpoint)
    except ValueError:
        return None
    if found is None or found[2].get("inputs") != identity_inputs(checkpoint, refs):
        return None
    return found[0], found[1]


def write_identity_file(checkpoint: Path | str, refs: Mapping[str, TensorRef],
                        ids: tuple[bytes, bytes]) -> Path | None:
    """Record ``ids`` and their inputs beside ``checkpoint`` (written whole, then renamed, so
    a reader never sees half of it). Returns the path, or None when the folder is not
    writable (a read-only volume): the identity file is only a shortcut."""
    path = Path(checkpoint) / IDENTITY_FILE
    record = {"format": IDENTITY_FILE_FORMAT, "drafter_identity": ids[0].hex(),
              "markov_identity": ids[1].hex(),
              "inputs": identity_inputs(checkpoint, refs)}
    tmp = path.with_name(f".{IDENTITY_FILE}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()
        return None
    return path
