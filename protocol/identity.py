"""Drafter and Markov identities from safetensors files, without a framework
(docs/contract.md section 6.4).

Each identity is a SHA-256 over tensors sorted by name; each tensor is fed as::

    name (UTF-8) 0x00  dtype (safetensors spelling, e.g. "BF16") 0x00
    ndim u32 LE, each dim u64 LE, nbytes u64 LE, then the raw little-endian bytes

``markov_identity`` covers the tensors named ``markov_head.*``; ``drafter_identity`` every other
tensor the drafter runs with, including ``embed_tokens.weight`` and ``lm_head.weight`` when they
come from the target checkpoint (they shape every draft, so they belong to its identity), and
then the drafter's config.json, fed as one more such record (``config_bytes``): the drafter
computes from its config as much as from its weights. The file order, the split into shards,
the tensor order inside a file and the config file's layout do not change the result.

A checkpoint folder is read as one: ``CheckpointFolder`` resolves it once and holds it open,
each file is opened once through it and read through that descriptor (``RegularFile``), and
``check_unchanged`` refuses a folder whose files changed while they were read, so an identity
(or a drafter) never mixes two folders.

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
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Final

from .constants import IDENTITY_BYTES
from .errors import BadFrameError

MARKOV_PREFIX: Final = "markov_head."
# The Markov identity of a drafter with no Markov head (DFlash): the digest of no tensors (6.4).
# On the wire it is a value like any other; logs and summaries say "none" for it.
NO_MARKOV_HEAD: Final = hashlib.sha256().digest()
# Where a multimodal target (Gemma-4's ConditionalGeneration layout, current and older
# transformers) nests its text model's embedding.
NESTED_TEXT_EMBEDDINGS: Final = ("model.language_model.embed_tokens.weight",
                                 "language_model.model.embed_tokens.weight")
# Where such a target keeps an untied head (Kimi-K3's, whose text model's tensors carry a
# ``language_model.`` prefix; MiniMax-M3's VL wrapper): looked up before the embeddings,
# which only a tied target uses as its head.
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
IDENTITY_FILE_FORMAT: Final = 2  # 1: identities of the tensors alone, before config.json
# config.json: a drafter's is a few KB; a bound far above that keeps an endless or huge file
# (a symlink to /dev/zero) from filling memory.
MAX_CONFIG_BYTES: Final = 1 << 20
# config.json keys no draft depends on, left out of the identity: what the tools that wrote
# the file say of themselves, and the dtype it was saved in (the tensors' own dtypes are in
# the identity; the worker runs its --dtype).
CONFIG_KEYS_UNHASHED: Final = ("_name_or_path", "transformers_version", "torch_dtype")

TensorBytes = bytes | bytearray | memoryview


class SafetensorsError(BadFrameError):
    """A checkpoint file is unreadable or lacks a tensor."""


class TensorRef:
    """Where one tensor's bytes lie: a file, a byte range, its dtype and shape; ``file`` the
    open file it is read through (a ``CheckpointFolder``'s), None to open ``path`` to read."""

    __slots__ = ("dtype", "end", "file", "path", "shape", "start")

    def __init__(self, path: Path, dtype: str, shape: tuple[int, ...], start: int,
                 end: int, file: RegularFile | None = None) -> None:
        self.path, self.dtype, self.shape, self.start, self.end = path, dtype, shape, start, end
        self.file = file

    def detached(self) -> TensorRef:
        """The same range, read by opening ``path`` again (the folder it came from is closed)."""
        return TensorRef(self.path, self.dtype, self.shape, self.start, self.end)


def _file_kind(mode: int) -> str:
    for test, kind in ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return kind
    return "not a regular file"


def _cannot_read(path: Path | str, exc: OSError) -> SafetensorsError:
    return SafetensorsError(f"{path}: cannot read ({exc.strerror or exc})", field=str(path))


def _open_regular_fd(path: Path | str, name: Path | str, dir_fd: int | None
                     ) -> tuple[int, os.stat_result]:
    """A descriptor of ``name`` (under ``dir_fd`` when given; ``path`` is how messages call
    it) and its status, if it is a regular file (a symlink to one is fine, as in a Hugging Face
    cache): a FIFO would block the open or the read forever, and a device such as /dev/zero
    never ends. Raises SafetensorsError naming the path and what it is."""
    try:
        st = os.stat(name, dir_fd=dir_fd)  # follows symlinks: what would be read
    except OSError as exc:
        raise _cannot_read(path, exc) from exc
    if not stat.S_ISREG(st.st_mode):
        raise SafetensorsError(f"{path}: is {_file_kind(st.st_mode)}, not a regular file",
                               field=str(path), value=_file_kind(st.st_mode))
    try:
        # O_NONBLOCK: a FIFO put in its place since the stat cannot block the open either
        fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0),
                     dir_fd=dir_fd)
    except OSError as exc:
        raise _cannot_read(path, exc) from exc
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise SafetensorsError(f"{path}: is {_file_kind(st.st_mode)}, not a regular file",
                               field=str(path), value=_file_kind(st.st_mode))
    os.set_blocking(fd, True)
    return fd, st


def open_regular(path: Path | str) -> io.BufferedReader:
    """``path`` opened for reading, if it is a regular file (``_open_regular_fd``)."""
    fd, _ = _open_regular_fd(path, path, None)
    return open(fd, "rb")


class RegularFile:
    """One regular file open for reading, with its status when it was opened (``stat``): every
    read goes through this descriptor, so what is read is that file whatever its name comes to
    mean meanwhile."""

    __slots__ = ("fd", "name", "path", "stat", "tracked")

    def __init__(self, path: Path, *, name: str | None = None, dir_fd: int | None = None,
                 tracked: bool = True) -> None:
        self.path, self.name, self.tracked = Path(path), name or Path(path).name, tracked
        self.fd, self.stat = _open_regular_fd(path, path if name is None else name, dir_fd)

    @property
    def size(self) -> int:
        return self.stat.st_size

    def read_into(self, view: memoryview, offset: int) -> int:
        """Fill ``view`` from byte ``offset``; the bytes read (fewer only at the file's end)."""
        got = 0
        try:
            while got < len(view):
                n = os.preadv(self.fd, [view[got:]], offset + got)
                if not n:
                    break
                got += n
        except OSError as exc:
            raise _cannot_read(self.path, exc) from exc
        return got

    def read(self, offset: int, n: int) -> bytes:
        buf = bytearray(n)
        return bytes(buf[:self.read_into(memoryview(buf), offset)])

    def read_small(self, limit: int) -> bytes:
        """The whole file, at most ``limit`` bytes (SafetensorsError otherwise, naming its size
        and the limit); never more than ``limit + 1`` bytes are read, whatever the file does
        meanwhile."""
        if self.size > limit:
            raise SafetensorsError(f"{self.path}: {self.size} bytes, over the {limit}-byte"
                                   " limit for this file", field=str(self.path),
                                   value=self.size, limit=limit)
        data = self.read(0, limit + 1)
        if len(data) > limit:
            raise SafetensorsError(f"{self.path}: more than {limit} bytes, the limit for this"
                                   " file", field=str(self.path), value=len(data), limit=limit)
        return data

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> RegularFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_small_file(path: Path | str, limit: int) -> bytes:
    """The whole of a regular file of at most ``limit`` bytes (``RegularFile.read_small``)."""
    with RegularFile(Path(path)) as f:
        return f.read_small(limit)


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


def read_header(path: Path | RegularFile) -> dict[str, TensorRef]:
    """The tensors of one safetensors file, by name (``__metadata__`` left out). The header's
    length, every entry's dtype, shape and byte range are checked against the file before
    anything is allocated for them: a truncated file or a lying header is refused here. Given
    an open ``RegularFile``, its tensors are read through it later; given a path, by
    opening the path again."""
    if not isinstance(path, RegularFile):
        with RegularFile(Path(path)) as f:
            return {name: ref.detached() for name, ref in read_header(f).items()}
    f, path = path, path.path
    size = f.size
    head = f.read(0, 8)
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
    raw = f.read(8, n)
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
        ref = TensorRef(path, dtype, tuple(shape), base + offsets[0], base + offsets[1], f)
        if ref.end > size:
            raise SafetensorsError(f"{path}: tensor {name!r} bytes [{ref.start}, {ref.end})"
                                   f" lie outside the file of {size} bytes", field=name,
                                   value=ref.end, limit=size)
        out[name] = ref
    return out


def read_ref(ref: TensorRef, view: memoryview, offset: int = 0) -> int:
    """Bytes ``offset`` onwards of ``ref``'s range into ``view`` (as many as fit), through its
    open file, else by opening its path; the bytes read."""
    view = view[:max(0, ref.end - ref.start - offset)]
    if ref.file is not None:
        return ref.file.read_into(view, ref.start + offset)
    with RegularFile(ref.path) as f:
        return f.read_into(view, ref.start + offset)


# -- one checkpoint folder, read as it was ---------------------------------------------------
CONFIG_FILE: Final = "config.json"
CHANGED_WHILE_READ: Final = "the checkpoint changed while it was read"


class CheckpointChanged(SafetensorsError):
    """A file of a checkpoint folder was rewritten, replaced, added or removed while it was
    read: what was read may mix two checkpoints, and is not used."""


def _signature(st: os.stat_result) -> tuple[int, int, int, int]:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def _chooses_files(name: str) -> bool:
    """Whether a name in a checkpoint folder decides what is read from it (``_weight_names``)."""
    return name.endswith(".safetensors") or name in (INDEX_FILE, CONFIG_FILE)


class CheckpointFolder:
    """A checkpoint folder resolved once and held open (its descriptor): every file is opened
    once, through that descriptor, and read through its own (``RegularFile``), so a symlink
    to the folder switched meanwhile (``ln -sfn v8 current``) changes nothing of what is read.
    ``check_unchanged`` after the reads refuses a folder whose files were rewritten, replaced,
    added or removed meanwhile. ``path`` is the folder's absolute path with no symlink in it,
    checked to name the folder held."""

    def __init__(self, path: Path | str, *, name: str | None = None,
                 dir_fd: int | None = None) -> None:
        """``path`` opened; or ``name`` under the folder open as ``dir_fd`` (``path`` is then
        how messages call it: ``subfolder``, ``parent``)."""
        self.given = Path(path)
        try:
            # O_NONBLOCK: a FIFO named like the folder cannot block the open
            self.fd = os.open(path if name is None else name,
                              os.O_RDONLY | os.O_DIRECTORY | os.O_NONBLOCK
                              | getattr(os, "O_CLOEXEC", 0), dir_fd=dir_fd)
        except OSError as exc:
            raise SafetensorsError(f"{path}: not a checkpoint directory ({exc.strerror or exc})",
                                   field="checkpoint", value=str(path)) from None
        self._files: dict[str, RegularFile] = {}
        self._small: dict[str, bytes] = {}
        try:
            self.path = self._held_path()
            self.listing = self._listing()
        except BaseException:
            self.close()
            raise

    def _held_path(self) -> Path:
        held = os.fstat(self.fd)
        candidates = [os.path.realpath(self.given)]
        with contextlib.suppress(OSError):
            candidates.insert(0, os.readlink(f"/proc/self/fd/{self.fd}"))
        for candidate in candidates:
            try:
                st = os.stat(candidate)
            except OSError:
                continue
            if (st.st_dev, st.st_ino) == (held.st_dev, held.st_ino):
                return Path(candidate)
        raise CheckpointChanged(f"{self.given}: {CHANGED_WHILE_READ} (the folder was moved as"
                                " it was opened)", field="checkpoint", value=str(self.given))

    def _listing(self) -> tuple[str, ...]:
        try:
            return tuple(sorted(n for n in os.listdir(self.fd) if _chooses_files(n)))
        except OSError as exc:
            raise _cannot_read(self.path, exc) from exc

    def __truediv__(self, name: str) -> Path:
        return self.path / name

    def _name(self, name: str) -> str:
        if not name or name != Path(name).name or name in (".", ".."):
            raise SafetensorsError(f"{self.path}: {name!r} is not a file name in the folder",
                                   field=name, value=name)
        return name

    def exists(self, name: str) -> bool:
        try:
            os.stat(self._name(name), dir_fd=self.fd)
        except OSError:
            return False
        return True

    def is_file(self, name: str) -> bool:
        try:
            return stat.S_ISREG(os.stat(self._name(name), dir_fd=self.fd).st_mode)
        except OSError:
            return False

    def subfolder(self, name: str) -> CheckpointFolder:
        """The folder ``name`` in this one, opened through this folder's descriptor (what the
        name leads to in the folder held, whatever this folder's own name leads to now)."""
        return CheckpointFolder(self.given / self._name(name), name=name, dir_fd=self.fd)

    def parent(self) -> CheckpointFolder:
        """The folder holding this one, opened through this folder's descriptor."""
        return CheckpointFolder(self.path.parent, name="..", dir_fd=self.fd)

    def names(self) -> list[str]:
        """The names in the folder, sorted."""
        try:
            return sorted(os.listdir(self.fd))
        except OSError as exc:
            raise _cannot_read(self.path, exc) from exc

    def file(self, name: str, *, tracked: bool = True) -> RegularFile:
        """``name`` opened once: later calls give the same open file. ``tracked``: whether
        ``check_unchanged`` checks it (not a file others may rewrite, the identity record)."""
        f = self._files.get(name)
        if f is None:
            f = self._files[name] = RegularFile(self.path / self._name(name), name=name,
                                                   dir_fd=self.fd, tracked=tracked)
        return f

    def read_small(self, name: str, limit: int, *, tracked: bool = True) -> bytes:
        """The whole of a small file (``RegularFile.read_small``), read once."""
        if name not in self._small:
            self._small[name] = self.file(name, tracked=tracked).read_small(limit)
        return self._small[name]

    def header(self, name: str) -> dict[str, TensorRef]:
        """The tensors of one safetensors file of the folder, read through its open file."""
        return read_header(self.file(name))

    def check_unchanged(self) -> None:
        """CheckpointChanged naming the file when a file read since the folder was opened is
        not the file it was (another inode, size or modification time, through the open
        descriptor or under its name), or when files that choose what is read were added or
        removed."""
        for name, f in self._files.items():
            if not f.tracked:
                continue
            try:
                named: os.stat_result | None = os.stat(name, dir_fd=self.fd)
            except OSError:
                named = None
            what = ("rewritten" if _signature(os.fstat(f.fd)) != _signature(f.stat)
                    else "removed" if named is None
                    else "replaced" if _signature(named) != _signature(f.stat) else None)
            if what is not None:
                raise CheckpointChanged(f"{f.path}: {CHANGED_WHILE_READ} (the file was {what});"
                                        " nothing read from the folder is used", field=name,
                                        value=what)
        listing = self._listing()
        if listing != self.listing:
            added = sorted(set(listing) - set(self.listing))
            gone = sorted(set(self.listing) - set(listing))
            raise CheckpointChanged(
                f"{self.path}: {CHANGED_WHILE_READ} (" + "; ".join(
                    w for w in (f"added {added}" if added else "",
                                f"removed {gone}" if gone else "") if w)
                + "); nothing read from the folder is used", field="checkpoint",
                value=added or gone)

    def write_file(self, name: str, data: bytes) -> None:
        """``data`` as the file ``name`` of the folder, written whole under a temporary name
        then renamed, so a reader never sees half of it (OSError when it cannot be)."""
        tmp = f".{self._name(name)}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
                     | getattr(os, "O_CLOEXEC", 0), 0o644, dir_fd=self.fd)
        try:
            with open(fd, "wb") as out:
                out.write(data)
            os.replace(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=self.fd)
            raise

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> CheckpointFolder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def held_folder(path: Path | str | CheckpointFolder) -> Iterator[CheckpointFolder]:
    """A folder held for the ``with`` block: one given open stays open after it, a path is
    opened (and closed after)."""
    if isinstance(path, CheckpointFolder):
        yield path
        return
    with CheckpointFolder(path) as folder:
        yield folder


@contextlib.contextmanager
def held_target(path: Path | str | CheckpointFolder | None
                ) -> Iterator[CheckpointFolder | None]:
    """``held_folder`` for a folder that may not be given (a target checkpoint): None stays
    None."""
    if path is None:
        yield None
        return
    with held_folder(path) as folder:
        yield folder


def _weight_names(folder: CheckpointFolder) -> list[str]:
    """The safetensors files of a checkpoint folder: the shards named by its index, else
    ``model.safetensors``, else every ``*.safetensors`` file in it."""
    if folder.exists(INDEX_FILE):
        return sorted(set(weight_map(folder).values()))
    if folder.is_file(SINGLE_FILE):
        return [SINGLE_FILE]
    found = [n for n in folder.names() if n.endswith(".safetensors")]
    if not found:
        raise SafetensorsError(f"{folder.path}: no safetensors files", field="checkpoint")
    return found


def weight_map(folder: CheckpointFolder) -> dict[str, str]:
    """A held folder's safetensors index (read once, through the folder): its map of tensor
    names to shard file names, each shard a plain file name in the folder (no path leads out
    of it)."""
    index = folder / INDEX_FILE
    record = load_json(folder.read_small(INDEX_FILE, MAX_INDEX_BYTES), index)
    mapping = record.get("weight_map") if isinstance(record, dict) else None
    if not isinstance(mapping, dict) or not all(isinstance(v, str) for v in mapping.values()):
        raise SafetensorsError(f"{index}: not a safetensors index (no weight_map of"
                               " tensor names to file names)", field="weight_map")
    for name in sorted(set(mapping.values())):
        if not name or name != Path(name).name or name in (".", ".."):
            raise SafetensorsError(f"{index}: weight_map names {name!r}, not a file name"
                                   " in the checkpoint folder", field="weight_map",
                                   value=name)
    return mapping


def checkpoint_files(directory: Path | str | CheckpointFolder) -> list[Path]:
    """The safetensors files of a checkpoint folder (``_weight_names``), under the folder's
    path as given, or a held folder's resolved path."""
    if isinstance(directory, CheckpointFolder):
        return [directory / name for name in _weight_names(directory)]
    with CheckpointFolder(directory) as folder:
        return [Path(directory) / name for name in _weight_names(folder)]


def partial_tensor_index(folder: CheckpointFolder, names: Iterable[str]
                         ) -> dict[str, TensorRef]:
    """Where those of ``names`` that a held checkpoint folder holds lie, reading only what is
    needed, through the folder: in a sharded folder the index and the headers of the shards
    that hold them (a target of hundreds of GB may be present on the drafter's host as its
    index and two shards); otherwise every file's header. Names the folder lacks are left
    out."""
    if not folder.exists(INDEX_FILE):
        wanted = set(names)
        return {n: r for n, r in tensor_index(folder).items() if n in wanted}
    mapping = weight_map(folder)
    out: dict[str, TensorRef] = {}
    headers: dict[str, dict[str, TensorRef]] = {}
    for name in names:
        shard = mapping.get(name)
        if shard is None or name in out:
            continue
        if shard not in headers:
            headers[shard] = folder.header(shard)
        ref = headers[shard].get(name)
        if ref is None:
            raise SafetensorsError(f"{folder / INDEX_FILE}: names {shard} for tensor"
                                   f" {name!r}, which that shard does not hold", field=name,
                                   value=shard)
        out[name] = ref
    return out


def _merge(parts: Iterable[tuple[Path, dict[str, TensorRef]]]) -> dict[str, TensorRef]:
    """Every tensor over several files; a name in two files is an error."""
    out: dict[str, TensorRef] = {}
    for path, refs in parts:
        for name, ref in refs.items():
            if name in out:
                raise SafetensorsError(f"tensor {name!r} appears in both {out[name].path} and"
                                       f" {path}", field=name)
            out[name] = ref
    return out


def tensor_index(paths: Iterable[Path] | CheckpointFolder) -> dict[str, TensorRef]:
    """Every tensor over several files (a held folder: its weight files, read through it); a
    name in two files is an error."""
    if isinstance(paths, CheckpointFolder):
        folder = paths
        return _merge((folder / n, folder.header(n)) for n in _weight_names(folder))
    return _merge((Path(p), read_header(Path(p))) for p in paths)


def drafter_tensors(directory: Path | str | CheckpointFolder) -> dict[str, TensorRef]:
    """Every tensor of a drafter checkpoint folder, by the drafter's own name: a prefix of
    ``DRAFTER_PREFIXES`` that every name carries is removed. A held folder is read through
    (and its tensors later); a path is opened for this call alone, its tensors read by path
    again."""
    if not isinstance(directory, CheckpointFolder):
        with CheckpointFolder(directory) as folder:
            return {n: ref.detached() for n, ref in drafter_tensors(folder).items()}
    refs = tensor_index(directory)
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


def config_bytes(config: Mapping[str, Any]) -> bytes:
    """A drafter's config.json object as its identity covers it (section 6.4): every key but
    those of ``CONFIG_KEYS_UNHASHED``, as JSON with sorted keys, no whitespace and ASCII only,
    so neither the file's layout nor its key order changes the identity."""
    kept = {k: v for k, v in config.items() if k not in CONFIG_KEYS_UNHASHED}
    return json.dumps(kept, sort_keys=True, separators=(",", ":"),
                      ensure_ascii=True).encode("ascii")


def _feed_config(h: Any, config: Mapping[str, Any] | None) -> None:
    """The config after the tensors, fed as a tensor named ``config.json`` of dtype ``JSON``
    holding ``config_bytes`` (nothing when there is no config)."""
    if config is not None:
        data = config_bytes(config)
        _feed(h, CONFIG_FILE, "JSON", (len(data),), data)


def identities_from_refs(refs: Mapping[str, TensorRef],
                         config: Mapping[str, Any] | None = None) -> tuple[bytes, bytes]:
    """Identities of tensors lying in files and of the drafter's ``config`` (config.json's
    object), the tensors read through one reused buffer of HASH_CHUNK_BYTES: the process never
    holds more of the weights than that (a memory map would leave every page it touched
    resident)."""
    drafter, markov = hashlib.sha256(), hashlib.sha256()
    view = memoryview(bytearray(HASH_CHUNK_BYTES))
    with contextlib.ExitStack() as opened:
        by_path: dict[Path, RegularFile] = {}  # a ref without its open file: one per path
        for name in sorted(refs):
            ref = refs[name]
            f = ref.file
            if f is None:
                f = by_path.get(ref.path)
                if f is None:
                    f = by_path[ref.path] = opened.enter_context(RegularFile(ref.path))
            h = markov if _is_markov(name) else drafter
            size = ref.end - ref.start
            _feed_head(h, name, ref.dtype, ref.shape, size)
            done = 0
            while done < size:
                n = f.read_into(view[:min(size - done, HASH_CHUNK_BYTES)], ref.start + done)
                if not n:
                    raise SafetensorsError(f"{ref.path}: tensor {name!r} is cut short")
                h.update(view[:n])
                done += n
    _feed_config(drafter, config)
    return drafter.digest(), markov.digest()


def identities_from_arrays(
    tensors: Mapping[str, tuple[str, tuple[int, ...], TensorBytes]],
    config: Mapping[str, Any] | None = None,
) -> tuple[bytes, bytes]:
    """Identities of tensors held in memory (name -> (safetensors dtype, shape, raw LE bytes))
    and of the drafter's ``config`` (config.json's object)."""
    drafter, markov = hashlib.sha256(), hashlib.sha256()
    for name in sorted(tensors):
        dtype, shape, data = tensors[name]
        _feed(markov if _is_markov(name) else drafter, name, dtype, tuple(shape), data)
    _feed_config(drafter, config)
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
    config: Mapping[str, Any] | None = None,
) -> tuple[bytes, bytes]:
    """Identities of the tensors in ``paths`` and of ``config`` (config.json's object, None:
    the tensors alone); ``extra`` adds a drafter tensor from another file: ``name -> path``
    (looked up under the name, then its target spellings) or ``name -> (path,
    name_in_that_file)``."""
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
    return identities_from_refs(refs, config)


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


def drafter_refs(checkpoint: Path | str | CheckpointFolder,
                 target_checkpoint: Path | str | CheckpointFolder | None = None
                 ) -> dict[str, TensorRef]:
    """Where each tensor of a DeepSpec drafter checkpoint folder lies, ``embed_tokens`` and
    ``lm_head`` taken from the target checkpoint folder when the drafter has none; either one
    missing from both is an error (``missing_target_tensor_message``). A tensor the target
    always supplies (``target_owned``) is taken from it even where the drafter folder holds a
    copy, and a sharded target is read through its index and only the shards it needs
    (``partial_tensor_index``). Headers only. Held folders (``CheckpointFolder``, both of
    them) are read through, and so are the tensors later; paths are opened for this call
    alone, and the tensors read by path again."""
    if not isinstance(checkpoint, CheckpointFolder) or (
            target_checkpoint is not None
            and not isinstance(target_checkpoint, CheckpointFolder)):
        with held_folder(checkpoint) as folder, held_target(target_checkpoint) as target:
            return {n: ref.detached() for n, ref in drafter_refs(folder, target).items()}
    refs = drafter_tensors(checkpoint)
    for name in target_owned(checkpoint):  # a copy in the drafter folder is never read
        refs.pop(name, None)
    lacking = [name for name in TARGET_FALLBACKS if name not in refs]
    if not lacking:
        return refs
    wanted = [src for name in lacking for src in TARGET_FALLBACKS[name]]
    refs = resolve_fallbacks(refs, partial_tensor_index(target_checkpoint, wanted)
                             if target_checkpoint is not None else None)
    for name in lacking:
        if name not in refs:
            raise SafetensorsError(missing_target_tensor_message(
                checkpoint.given, name,
                target_checkpoint.given if target_checkpoint is not None else None), field=name)
    return refs


def read_config(folder: CheckpointFolder) -> dict[str, Any] | None:
    """A held folder's config.json object, read once (None when it has none)."""
    if not folder.exists(CONFIG_FILE):
        return None
    data = load_json(folder.read_small(CONFIG_FILE, MAX_CONFIG_BYTES), folder / CONFIG_FILE)
    if not isinstance(data, dict):
        raise SafetensorsError(f"{folder / CONFIG_FILE}: the top level is"
                               f" {type(data).__name__}, not an object", field=CONFIG_FILE)
    return data


def target_owned(folder: CheckpointFolder) -> tuple[str, ...]:
    """The drafter tensors its target supplies even where the held folder holds a copy
    (``formats.target_owned_tensors`` of its config.json, read through the folder; none
    without a config.json)."""
    # formats reads folders through this module: imported here, when both are loaded
    from .formats import target_owned_tensors

    raw = read_config(folder)
    return target_owned_tensors(raw) if raw is not None else ()


def identities_from_checkpoint(checkpoint: Path | str | CheckpointFolder,
                               target_checkpoint: Path | str | CheckpointFolder | None = None,
                               *, use_identity_file: bool = True) -> tuple[bytes, bytes]:
    """Identities of a DeepSpec drafter checkpoint folder (its tensors and its config.json),
    taking ``embed_tokens`` and ``lm_head`` from the target checkpoint folder when the drafter
    has none. Each folder is resolved once and each file read once through one descriptor;
    a folder that changed meanwhile raises ``CheckpointChanged``. With ``use_identity_file``,
    a current ``dspark_identity.json`` beside the checkpoint (the worker writes it when it
    loads the folder) answers without reading the weights; otherwise they are hashed. Nothing
    is written here."""
    with held_folder(checkpoint) as folder, held_target(target_checkpoint) as target:
        config = read_config(folder)
        refs = drafter_refs(folder, target)
        ids = read_identity_file(folder, refs) if use_identity_file else None
        if ids is None:
            ids = identities_from_refs(refs, config)
        for held in (folder, target):
            if held is not None:
                held.check_unchanged()
        return ids


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
def identity_inputs(checkpoint: Path | str | CheckpointFolder,
                    refs: Mapping[str, TensorRef]) -> dict[str, Any]:
    """What identities are computed from, cheaply checkable: every tensor's file, byte range,
    dtype and shape, and the size and modification time of every such file and of config.json
    (a file rewritten since makes a recorded identity stale). Files inside the checkpoint
    folder are named relative to it, others (a target checkpoint's) by absolute path. A held
    folder's files are described as they were opened, not as their names read now."""
    folder = checkpoint if isinstance(checkpoint, CheckpointFolder) else None
    root = checkpoint.path if isinstance(checkpoint, CheckpointFolder) \
        else Path(checkpoint).resolve()

    def label(path: Path) -> str:
        p = Path(path) if folder is not None else Path(path).resolve()
        return str(p.relative_to(root)) if p.is_relative_to(root) else str(p)

    def status(path: Path, file: RegularFile | None) -> dict[str, int]:
        st = file.stat if file is not None else os.stat(path)
        return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}

    files: dict[str, dict[str, int]] = {}
    for ref in refs.values():
        key = label(ref.path)
        if key not in files:
            files[key] = status(ref.path, ref.file)
    if folder is not None:
        if folder.exists(CONFIG_FILE):
            files[CONFIG_FILE] = status(folder / CONFIG_FILE, folder.file(CONFIG_FILE))
    elif (root / CONFIG_FILE).exists():
        files[CONFIG_FILE] = status(root / CONFIG_FILE, None)
    tensors = {name: [label(ref.path), ref.dtype, list(ref.shape), ref.start, ref.end]
               for name, ref in sorted(refs.items())}
    return {"files": dict(sorted(files.items())), "tensors": tensors}


def read_identity_record(checkpoint: Path | str | CheckpointFolder
                         ) -> tuple[bytes, bytes, dict[str, Any]] | None:
    """The ``dspark_identity.json`` beside ``checkpoint``, read with a bound: its drafter and
    markov identities and the whole record; None when there is no such file. A file that is
    not such a record raises ValueError naming it."""
    with held_folder(checkpoint) as folder:
        if not folder.exists(IDENTITY_FILE):
            return None
        path = folder / IDENTITY_FILE
        try:
            record = load_json(folder.read_small(IDENTITY_FILE, MAX_IDENTITY_FILE_BYTES,
                                                 tracked=False), path)
            if not isinstance(record, dict) or record.get("format") != IDENTITY_FILE_FORMAT:
                raise ValueError(f"not format {IDENTITY_FILE_FORMAT}")
            drafter, markov = (bytes.fromhex(record[k])
                               for k in ("drafter_identity", "markov_identity"))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"{path}: not an identity record the worker wrote ({exc})"
                             ) from None
    if len(drafter) != IDENTITY_BYTES or len(markov) != IDENTITY_BYTES:
        raise ValueError(f"{path}: identities must be {IDENTITY_BYTES} bytes each")
    return drafter, markov, record


def read_identity_file(checkpoint: Path | str | CheckpointFolder,
                       refs: Mapping[str, TensorRef]) -> tuple[bytes, bytes] | None:
    """The identities recorded beside ``checkpoint`` if they were computed from exactly these
    tensors in these files and this config.json as they are now; None when there is no such
    file or it is stale, unreadable or of another format."""
    with held_folder(checkpoint) as folder:
        try:
            found = read_identity_record(folder)
        except ValueError:
            return None
        if found is None or found[2].get("inputs") != identity_inputs(folder, refs):
            return None
        return found[0], found[1]


def write_identity_file(checkpoint: Path | str | CheckpointFolder,
                        refs: Mapping[str, TensorRef], ids: tuple[bytes, bytes]) -> Path | None:
    """Record ``ids`` and their inputs beside ``checkpoint`` (a held folder: in that very
    folder, whatever its name now leads to), written whole, then renamed, so a reader never
    sees half of it. Returns the path, or None when the folder is not writable (a read-only
    volume): the identity file is only a shortcut."""
    with held_folder(checkpoint) as folder:
        record = {"format": IDENTITY_FILE_FORMAT, "drafter_identity": ids[0].hex(),
                  "markov_identity": ids[1].hex(), "inputs": identity_inputs(folder, refs)}
        try:
            folder.write_file(IDENTITY_FILE, (json.dumps(record, indent=1) + "\n").encode())
        except OSError:
            return None
        return folder / IDENTITY_FILE
