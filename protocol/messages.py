"""Message bodies: Hello, HelloReply, ReqEntry, StepHeader, STEP, StepReply, RESET
(docs/contract.md sections 4, 6.1, 7.3, 7.4).

Encoders write into caller-owned buffers at an offset so a header can go in front without a copy.
Decoders return zero-copy numpy views over the frame: the worker reads entries and rows of a STEP
in place, and the client reads every array of a StepReply in place. Decoders check structure
(sizes, lengths, known flag bits); the value rules live in ``protocol.validate``.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from functools import lru_cache
from typing import Any, Final

import msgspec
import numpy as np
import numpy.typing as npt

from .constants import (
    IDENTITY_BYTES,
    KNOWN_HELLO_FLAGS,
    KNOWN_REPLY_FLAGS,
    MAX_TOP_K,
    NAME_BYTES,
    OP_GOODBYE,
    REPLY_ALIGN,
    REPLY_HEADER_SIZE,
    REQ_ENTRY_SIZE,
    RPF_MARGIN,
    RPF_SAMPLED,
    STEP_HEADER_SIZE,
    U32_MASK,
    VERSION,
)
from .errors import BadFrameError, WireError
from .framing import frame

Buffer = bytes | bytearray | memoryview

# -- HELLO (6.1) ----------------------------------------------------------------------------------
# version sample_mode tap_dtype window num_spec max_slots max_rows_per_step row_bytes vocab_size
# n_taps flags hidden drafter_identity markov_identity client_name auth_tag
HELLO_STRUCT: Final = struct.Struct("<HBBHHIIIIHHI32s32s32s32s")
# version capabilities window num_spec max_slots max_rows_per_step row_bytes vocab_size
# drafter_identity markov_identity worker_name resumed (1 reserved) n_taps hidden
HELLO_REP: Final = struct.Struct("<HHHHIIII32s32s32sBxHI")
AUTH_TAG_OFFSET: Final = HELLO_STRUCT.size - 32


def encode_name(name: str, field: str) -> bytes:
    """A client or worker name as the wire carries it; BadFrameError for one too long (UTF-8)
    or holding a NUL."""
    raw = name.encode("utf-8")
    if len(raw) > NAME_BYTES:
        raise BadFrameError(
            f"{field} {name!r} is {len(raw)} bytes in UTF-8, more than {NAME_BYTES}",
            field=field, value=len(raw), limit=NAME_BYTES,
        )
    if b"\0" in raw:
        raise BadFrameError(f"{field} {name!r} holds a NUL byte", field=field, value=name)
    return raw


def _decode_name(raw: bytes, field: str) -> str:
    stripped = raw.rstrip(b"\0")
    if b"\0" in stripped:
        raise BadFrameError(f"{field} {raw!r} has a NUL before its end", field=field, value=raw)
    try:
        return stripped.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadFrameError(f"{field} {raw!r} is not UTF-8", field=field, value=raw) from exc


def _check_blob(value: bytes, field: str, size: int) -> None:
    if len(value) != size:
        raise BadFrameError(f"{field} is {len(value)} bytes, not {size}",
                            field=field, value=len(value), limit=size)


def _check_hello_flags(flags: int) -> None:
    if flags & ~KNOWN_HELLO_FLAGS:
        raise BadFrameError(f"HELLO flags {flags:#06x} hold bits this contract does not define"
                            f" (known: {KNOWN_HELLO_FLAGS:#06x})", field="flags", value=flags,
                            limit=KNOWN_HELLO_FLAGS)


def _body_size(body: Buffer, what: str, size: int) -> None:
    if len(body) != size:
        raise BadFrameError(f"{what} body is {len(body)} bytes, not {size}",
                            field="body_len", value=len(body), limit=size)


class Hello(msgspec.Struct, frozen=True):
    """A client's HELLO: what it will send and what it expects the worker to be."""

    sample_mode: int
    window: int
    num_spec: int
    max_slots: int
    max_rows_per_step: int
    row_bytes: int
    vocab_size: int
    n_taps: int
    hidden: int
    drafter_identity: bytes
    markov_identity: bytes
    client_name: str = ""
    auth_tag: bytes = bytes(32)
    tap_dtype: int = 1
    version: int = VERSION
    flags: int = 0  # HF_* bits

    def pack(self) -> bytes:
        _check_blob(self.drafter_identity, "drafter_identity", IDENTITY_BYTES)
        _check_blob(self.markov_identity, "markov_identity", IDENTITY_BYTES)
        _check_blob(self.auth_tag, "auth_tag", 32)
        _check_hello_flags(self.flags)
        try:
            return HELLO_STRUCT.pack(
                self.version, self.sample_mode, self.tap_dtype, self.window, self.num_spec,
                self.max_slots, self.max_rows_per_step, self.row_bytes, self.vocab_size,
                self.n_taps, self.flags, self.hidden, self.drafter_identity, self.markov_identity,
                encode_name(self.client_name, "client_name"), self.auth_tag,
            )
        except struct.error as exc:
            raise BadFrameError(f"Hello field out of range: {exc} ({self!r})") from exc

    @classmethod
    def unpack(cls, body: Buffer) -> Hello:
        _body_size(body, "HELLO", HELLO_STRUCT.size)
        (version, sample_mode, tap_dtype, window, num_spec, max_slots, max_rows_per_step,
         row_bytes, vocab_size, n_taps, flags, hidden, drafter_identity, markov_identity,
         client_name, auth_tag) = HELLO_STRUCT.unpack_from(body)
        _check_hello_flags(flags)
        return cls(
            version=version, sample_mode=sample_mode, tap_dtype=tap_dtype, window=window,
            num_spec=num_spec, max_slots=max_slots, max_rows_per_step=max_rows_per_step,
            row_bytes=row_bytes, vocab_size=vocab_size, n_taps=n_taps, hidden=hidden,
            drafter_identity=drafter_identity, markov_identity=markov_identity,
            client_name=_decode_name(client_name, "client_name"), auth_tag=auth_tag, flags=flags,
        )

    def without_auth(self) -> Hello:
        return msgspec.structs.replace(self, auth_tag=bytes(32))


class HelloReply(msgspec.Struct, frozen=True):
    """The worker's own values, sent on acceptance and on refusal alike."""

    capabilities: int
    window: int
    num_spec: int
    max_slots: int
    max_rows_per_step: int
    row_bytes: int
    vocab_size: int
    drafter_identity: bytes
    markov_identity: bytes
    worker_name: str = ""
    resumed: int = 0
    n_taps: int = 0
    hidden: int = 0
    version: int = VERSION

    def pack(self) -> bytes:
        _check_blob(self.drafter_identity, "drafter_identity", IDENTITY_BYTES)
        _check_blob(self.markov_identity, "markov_identity", IDENTITY_BYTES)
        try:
            return HELLO_REP.pack(
                self.version, self.capabilities, self.window, self.num_spec, self.max_slots,
                self.max_rows_per_step, self.row_bytes, self.vocab_size, self.drafter_identity,
                self.markov_identity, encode_name(self.worker_name, "worker_name"), self.resumed,
                self.n_taps, self.hidden,
            )
        except struct.error as exc:
            raise BadFrameError(f"HelloReply field out of range: {exc} ({self!r})") from exc

    @classmethod
    def unpack(cls, body: Buffer) -> HelloReply:
        _body_size(body, "HelloReply", HELLO_REP.size)
        (version, capabilities, window, num_spec, max_slots, max_rows_per_step, row_bytes,
         vocab_size, drafter_identity, markov_identity, worker_name, resumed, n_taps,
         hidden) = HELLO_REP.unpack_from(body)
        return cls(
            version=version, capabilities=capabilities, window=window, num_spec=num_spec,
            max_slots=max_slots, max_rows_per_step=max_rows_per_step, row_bytes=row_bytes,
            vocab_size=vocab_size, drafter_identity=drafter_identity,
            markov_identity=markov_identity,
            worker_name=_decode_name(worker_name, "worker_name"), resumed=resumed,
            n_taps=n_taps, hidden=hidden,
        )


# -- STEP (7.3) -----------------------------------------------------------------------------------
STEP_HEADER_STRUCT: Final = struct.Struct("<QIIIIQ")  # step_id n_req n_rows row_bytes flags res.
ENTRY_STRUCT: Final = struct.Struct("<IIIIIHHQHxxffxxxx")
ENTRY_DTYPE: Final = np.dtype({
    "names": ["slot", "generation", "anchor_pos", "anchor_token", "n_rows", "n_out", "flags",
              "seed", "top_k", "reserved0", "temperature", "top_p", "reserved1"],
    "formats": ["<u4", "<u4", "<u4", "<u4", "<u4", "<u2", "<u2",
                "<u8", "<u2", "<u2", "<f4", "<f4", "<u4"],
    "offsets": [0, 4, 8, 12, 16, 20, 22, 24, 32, 34, 36, 40, 44],
    "itemsize": REQ_ENTRY_SIZE,
})

SampleMeta = tuple[int, int, float, float]  # (seed, top_k, temperature, top_p) per entry


class ReqEntry(msgspec.Struct, gc=False):
    """One slot's part of a STEP. ``generation`` may be wider than 32 bits: the wire carries
    ``generation & 0xFFFFFFFF``."""

    slot: int
    generation: int
    anchor_pos: int
    anchor_token: int
    n_rows: int = 0
    n_out: int = 0
    flags: int = 0
    seed: int = 0
    top_k: int = 0
    temperature: float = 0.0
    top_p: float = 0.0


class StepHeader(msgspec.Struct, frozen=True, gc=False):
    step_id: int
    n_req: int
    n_rows: int
    row_bytes: int
    step_flags: int = 0
    reserved: int = 0

    def pack_into(self, buf: bytearray | memoryview, offset: int = 0) -> None:
        try:
            STEP_HEADER_STRUCT.pack_into(buf, offset, self.step_id, self.n_req, self.n_rows,
                                         self.row_bytes, self.step_flags, self.reserved)
        except struct.error as exc:
            raise BadFrameError(f"StepHeader field out of range: {exc} ({self!r})") from exc

    @classmethod
    def unpack(cls, body: Buffer, offset: int = 0) -> StepHeader:
        if len(body) - offset < STEP_HEADER_SIZE:
            raise BadFrameError(
                f"STEP body is {len(body) - offset} bytes, shorter than its"
                f" {STEP_HEADER_SIZE}-byte header",
                field="body_len", value=len(body) - offset, limit=STEP_HEADER_SIZE,
            )
        return cls(*STEP_HEADER_STRUCT.unpack_from(body, offset))


def rows_offset_for(n_req: int) -> int:
    """Where the rows start in a STEP body of ``n_req`` entries (8-byte aligned)."""
    return STEP_HEADER_SIZE + REQ_ENTRY_SIZE * n_req


def pack_step_prefix(
    buf: bytearray | memoryview,
    offset: int,
    step_id: int,
    entries: list[ReqEntry] | npt.NDArray[Any],
    n_rows: int,
    row_bytes: int,
    step_flags: int = 0,
    sample_meta: list[SampleMeta] | None = None,
) -> int:
    """Write the StepHeader and the entries at ``offset`` in ``buf``; return where the rows start,
    relative to the body (``rows_offset_for(len(entries))``).

    ``entries``: ReqEntry objects, or the entries already laid out, a one-dimensional
    ``ENTRY_DTYPE`` array (an engine that keeps its requests' fields in arrays fills one with a
    few vectorised writes; it is copied in whole, 48 bytes an entry, its reserved fields
    zeroed, where objects cost a packing call each). ``sample_meta`` (one ``(seed, top_k,
    temperature, top_p)`` per entry) overrides the entries' own sampling fields. The rows
    themselves are not touched: the caller staged them already or sends them as a second
    part."""
    n = len(entries)
    ro = rows_offset_for(n)
    if len(buf) < offset + ro:
        raise ValueError(f"buffer of {len(buf)} bytes cannot hold a {ro}-byte STEP prefix at"
                         f" offset {offset}")
    if sample_meta is not None and len(sample_meta) != n:
        raise ValueError(f"sample_meta has {len(sample_meta)} tuples for {n} entries")
    if isinstance(entries, np.ndarray):
        _copy_entries(buf, offset + STEP_HEADER_SIZE, entries, n_rows, sample_meta)
        StepHeader(step_id, n, n_rows, row_bytes, step_flags).pack_into(buf, offset)
        return ro
    at = offset + STEP_HEADER_SIZE
    try:
        total = _pack_entries(buf, at, entries, sample_meta)
    except struct.error:
        # A generation past 32 bits (the wire carries its low half), or a field out of range.
        wide = [e if e.generation & U32_MASK == e.generation
                else msgspec.structs.replace(e, generation=e.generation & U32_MASK)
                for e in entries]
        try:
            total = _pack_entries(buf, at, wide, sample_meta)
        except struct.error as exc:
            i, err = _first_out_of_range(wide, sample_meta)
            raise BadFrameError(f"entry {i} (slot {entries[i].slot}) has a field out of"
                                f" range: {err}", entry=i, slot=entries[i].slot) from exc
    if total != n_rows:
        raise ValueError(f"entries carry {total} rows in all, but n_rows is {n_rows}")
    StepHeader(step_id, n, n_rows, row_bytes, step_flags).pack_into(buf, offset)
    return ro


def _pack_entries(buf: bytearray | memoryview, at: int, entries: Sequence[ReqEntry],
                  sample_meta: list[SampleMeta] | None) -> int:
    """Pack the entries from ``at``, one ``pack_into`` each (CPython's floor for objects; a
    generation past 32 bits raises ``struct.error`` like any field out of range); return
    their rows in all."""
    total = 0
    pack = ENTRY_STRUCT.pack_into
    offsets = range(at, at + REQ_ENTRY_SIZE * len(entries), REQ_ENTRY_SIZE)
    if sample_meta is None:
        for off, e in zip(offsets, entries, strict=True):
            pack(buf, off, e.slot, e.generation, e.anchor_pos, e.anchor_token, e.n_rows,
                 e.n_out, e.flags, e.seed, e.top_k, e.temperature, e.top_p)
            total += e.n_rows
    else:
        for off, e, (seed, top_k, temperature, top_p) in zip(offsets, entries, sample_meta,
                                                             strict=True):
            pack(buf, off, e.slot, e.generation, e.anchor_pos, e.anchor_token, e.n_rows,
                 e.n_out, e.flags, seed, top_k, temperature, top_p)
            total += e.n_rows
    return total


def _first_out_of_range(entries: Sequence[ReqEntry],
                        sample_meta: list[SampleMeta] | None) -> tuple[int, struct.error]:
    """The first entry that does not pack, and why (the failure path only)."""
    scratch = bytearray(REQ_ENTRY_SIZE)
    for i, e in enumerate(entries):
        try:
            _pack_entries(scratch, 0, [e], None if sample_meta is None else [sample_meta[i]])
        except struct.error as exc:
            return i, exc
    raise AssertionError("the entries packed one by one")  # pragma: no cover


def _copy_entries(buf: bytearray | memoryview, at: int, entries: npt.NDArray[Any], n_rows: int,
                  sample_meta: list[SampleMeta] | None) -> None:
    if entries.dtype != ENTRY_DTYPE or entries.ndim != 1:
        raise ValueError(f"entries array has dtype {entries.dtype} and shape {entries.shape};"
                         " a STEP takes a one-dimensional ENTRY_DTYPE array")
    if sample_meta is not None:
        raise ValueError("sample_meta overrides ReqEntry objects' fields; an entries array"
                         " carries its own")
    dst = np.frombuffer(buf, ENTRY_DTYPE, count=entries.size, offset=at)
    if entries.flags.c_contiguous:  # the bytes as they are: one memcpy
        dst.view(np.uint8)[...] = entries.view(np.uint8)
    else:
        dst[...] = entries
    dst["reserved0"] = 0
    dst["reserved1"] = 0
    total = int(dst["n_rows"].sum())
    if total != n_rows:
        raise ValueError(f"entries carry {total} rows in all, but n_rows is {n_rows}")


def pack_step(step_id: int, entries: list[ReqEntry], rows: Buffer, row_bytes: int,
              step_flags: int = 0) -> bytes:
    """A whole STEP body in one new buffer (tests and tools; the hot path uses the prefix)."""
    n_rows = sum(e.n_rows for e in entries)
    ro = rows_offset_for(len(entries))
    buf = bytearray(ro + n_rows * row_bytes)
    pack_step_prefix(buf, 0, step_id, entries, n_rows, row_bytes, step_flags)
    if len(rows) != n_rows * row_bytes:
        raise ValueError(f"rows hold {len(rows)} bytes, {n_rows} rows of {row_bytes} need"
                         f" {n_rows * row_bytes}")
    buf[ro:] = rows
    return bytes(buf)


class StepView(msgspec.Struct, gc=False):
    """A decoded STEP: ``entries`` (ENTRY_DTYPE) and ``rows`` (uint8 [n_rows, row_bytes]) are
    views over the frame's body, not copies."""

    header: StepHeader
    entries: npt.NDArray[Any]
    rows: npt.NDArray[np.uint8]


def decode_step(body: Buffer) -> StepView:
    """Decode a STEP body without copying it. Structural errors raise BadFrameError; the value
    rules of section 7.2 step 3 are ``protocol.validate.check_step_shape``."""
    h = StepHeader.unpack(body)
    ro = rows_offset_for(h.n_req)
    expect = ro + h.n_rows * h.row_bytes
    if len(body) != expect:
        raise BadFrameError(
            f"STEP body is {len(body)} bytes; a header with n_req {h.n_req}, n_rows {h.n_rows}"
            f" and row_bytes {h.row_bytes} needs exactly {expect}",
            field="body_len", value=len(body), limit=expect,
        )
    entries = np.frombuffer(body, dtype=ENTRY_DTYPE, count=h.n_req, offset=STEP_HEADER_SIZE)
    rows = np.frombuffer(body, dtype=np.uint8, count=h.n_rows * h.row_bytes, offset=ro)
    return StepView(header=h, entries=entries, rows=rows.reshape(h.n_rows, h.row_bytes))


def entries_from_view(entries: npt.NDArray[Any]) -> list[ReqEntry]:
    """ReqEntry objects from a decoded entries view (tests and tools)."""
    return [
        ReqEntry(slot=int(r["slot"]), generation=int(r["generation"]),
                 anchor_pos=int(r["anchor_pos"]), anchor_token=int(r["anchor_token"]),
                 n_rows=int(r["n_rows"]), n_out=int(r["n_out"]), flags=int(r["flags"]),
                 seed=int(r["seed"]), top_k=int(r["top_k"]),
                 temperature=float(r["temperature"]), top_p=float(r["top_p"]))
        for r in entries
    ]


# -- RESET (4) ------------------------------------------------------------------------------------
def pack_reset(slots: list[int]) -> bytes:
    """RESET body: count, then the slots; an empty list means every slot."""
    try:
        return struct.pack(f"<I{len(slots)}I", len(slots), *slots)
    except struct.error as exc:
        raise BadFrameError(f"RESET slots {slots!r} do not fit u32: {exc}",
                            field="slots") from exc


def goodbye_frame(seq: int, session: int) -> bytes:
    """A GOODBYE request (section 4): the session in the header, no body. The worker releases
    the session and all its slots (6.2)."""
    return frame(OP_GOODBYE, seq, session)


def reset_slots(body: Buffer, max_count: int | None = None) -> npt.NDArray[np.uint32]:
    """RESET body -> its slots, a zero-copy ``<u4`` view of the body ([count]; empty: every
    slot). ``count`` is checked against ``max_count`` and the body length before anything is
    decoded, so a huge count costs nothing."""
    n = len(body)
    if n < 4:
        raise BadFrameError(f"RESET body is {n} bytes, shorter than its u32 count",
                            field="body_len", value=n, limit=4)
    (count,) = struct.unpack_from("<I", body)
    if max_count is not None and count > max_count:
        raise BadFrameError(f"RESET lists {count} slots; the session has {max_count}",
                            field="count", value=count, limit=max_count)
    if n != 4 + 4 * count:
        raise BadFrameError(f"RESET body is {n} bytes; count {count} needs {4 + 4 * count}",
                            field="body_len", value=n, limit=4 + 4 * count)
    return np.frombuffer(body, dtype=_U32, count=count, offset=4)


def decode_reset(body: Buffer, max_count: int | None = None) -> list[int]:
    """RESET body -> its slots as a list (``reset_slots`` for the array)."""
    return [int(x) for x in reset_slots(body, max_count).tolist()]


# -- StepReply (7.4) ------------------------------------------------------------------------------
REPLY_HEADER_STRUCT: Final = struct.Struct("<QIHHII")  # step_id n_req num_spec flags worker_us res
_U8, _U16, _U32 = np.dtype(np.uint8), np.dtype("<u2"), np.dtype("<u4")
_I32, _F32, _U64 = np.dtype("<i4"), np.dtype("<f4"), np.dtype("<u8")


def _align(n: int) -> int:
    return (n + REPLY_ALIGN - 1) & ~(REPLY_ALIGN - 1)


class ReplyLayout(msgspec.Struct, frozen=True):
    """Byte offsets of a StepReply's arrays from the body's start, and its total size."""

    n_req: int
    num_spec: int
    flags: int
    status: int
    window_rows: int
    generation: int
    draft_ids: int
    confidence: int
    margin: int  # -1 when absent
    sampled_mask: int  # -1 when absent
    support_ids: int
    proposal_q: int
    size: int


@lru_cache(maxsize=256)
def reply_layout(n_req: int, num_spec: int, flags: int) -> ReplyLayout:
    n, m = n_req, n_req * num_spec
    off = REPLY_HEADER_SIZE
    status = off
    off = _align(off + n)
    window_rows = off
    off = _align(off + 2 * n)
    generation = off
    off = _align(off + 4 * n)
    draft_ids = off
    off = _align(off + 4 * m)
    confidence = off
    off = _align(off + 4 * m)
    margin = sampled_mask = support_ids = proposal_q = -1
    if flags & RPF_MARGIN:
        margin = off
        off = _align(off + 4 * m)
    if flags & RPF_SAMPLED:
        sampled_mask = off
        off = _align(off + n)
        support_ids = off
        off = _align(off + 4 * m * MAX_TOP_K)
        proposal_q = off
        off = _align(off + 4 * m * MAX_TOP_K)
    return ReplyLayout(n_req, num_spec, flags, status, window_rows, generation, draft_ids,
                       confidence, margin, sampled_mask, support_ids, proposal_q, off)


class StepReply:
    """A STEP reply whose arrays are numpy views over one buffer.

    ``unpack`` views a received body (the client); ``into`` lays a zeroed reply over a writable
    buffer for the worker to fill in place, then ``finish`` writes its header."""

    __slots__ = ("_buf", "_offset", "confidence", "draft_ids", "flags", "generation", "margin",
                 "n_req", "num_spec", "proposal_q", "sampled_mask", "status", "step_id",
                 "support_ids", "window_rows", "worker_us")

    step_id: int
    n_req: int
    num_spec: int
    flags: int
    worker_us: int
    status: npt.NDArray[np.uint8]
    window_rows: npt.NDArray[np.uint16]
    generation: npt.NDArray[np.uint32]
    draft_ids: npt.NDArray[np.int32]
    confidence: npt.NDArray[np.float32]
    margin: npt.NDArray[np.float32] | None
    sampled_mask: npt.NDArray[np.uint8] | None
    support_ids: npt.NDArray[np.int32] | None
    proposal_q: npt.NDArray[np.uint32] | None

    def __init__(self, buf: Buffer, offset: int, step_id: int, layout: ReplyLayout,
                 worker_us: int = 0) -> None:
        n, N, lo = layout.n_req, layout.num_spec, layout
        self._buf = buf
        self._offset = offset
        self.step_id = step_id
        self.n_req = n
        self.num_spec = N
        self.flags = lo.flags
        self.worker_us = worker_us

        def arr(dtype: Any, at: int, shape: tuple[int, ...]) -> Any:
            # One constructor call per array (a third of frombuffer + reshape); the layout's
            # size was checked against the buffer, and numpy checks the bounds again.
            return np.ndarray(shape, dtype, buf, offset + at)

        self.status = arr(_U8, lo.status, (n,))
        self.window_rows = arr(_U16, lo.window_rows, (n,))
        self.generation = arr(_U32, lo.generation, (n,))
        self.draft_ids = arr(_I32, lo.draft_ids, (n, N))
        self.confidence = arr(_F32, lo.confidence, (n, N))
        self.margin = arr(_F32, lo.margin, (n, N)) if lo.margin >= 0 else None
        if lo.sampled_mask >= 0:
            self.sampled_mask = arr(_U8, lo.sampled_mask, (n,))
            self.support_ids = arr(_I32, lo.support_ids, (n, N, MAX_TOP_K))
            self.proposal_q = arr(_U32, lo.proposal_q, (n, N, MAX_TOP_K))
        else:
            self.sampled_mask = self.support_ids = self.proposal_q = None

    @classmethod
    def unpack(cls, body: Buffer, expect_n_req: int | None = None,
               expect_num_spec: int | None = None) -> StepReply:
        if len(body) < REPLY_HEADER_SIZE:
            raise BadFrameError(f"StepReply body is {len(body)} bytes, shorter than its"
                                f" {REPLY_HEADER_SIZE}-byte header", field="body_len",
                                value=len(body), limit=REPLY_HEADER_SIZE)
        step_id, n_req, num_spec, flags, worker_us, _ = REPLY_HEADER_STRUCT.unpack_from(body)
        if expect_n_req is not None and n_req != expect_n_req:
            raise WireError(f"StepReply has n_req {n_req}, the STEP sent {expect_n_req}",
                            field="n_req", value=n_req, limit=expect_n_req)
        if expect_num_spec is not None and num_spec != expect_num_spec:
            raise WireError(f"StepReply has num_spec {num_spec}, the session's is"
                            f" {expect_num_spec}", field="num_spec", value=num_spec,
                            limit=expect_num_spec)
        if flags & ~KNOWN_REPLY_FLAGS:
            raise WireError(f"StepReply flags {flags:#x} hold unknown bits"
                            f" {flags & ~KNOWN_REPLY_FLAGS:#x}", field="flags", value=flags)
        layout = reply_layout(n_req, num_spec, flags)
        if len(body) != layout.size:
            raise WireError(f"StepReply body is {len(body)} bytes; n_req {n_req}, num_spec"
                            f" {num_spec}, flags {flags:#x} need exactly {layout.size}",
                            field="body_len", value=len(body), limit=layout.size)
        return cls(body, 0, step_id, layout, worker_us)

    @classmethod
    def into(cls, buf: bytearray | memoryview, offset: int, step_id: int, n_req: int,
             num_spec: int, flags: int) -> StepReply:
        """A zeroed reply laid over ``buf[offset:]`` (which must hold ``reply_layout(...).size``
        bytes). Fill the arrays, then call ``finish``."""
        layout = reply_layout(n_req, num_spec, flags)
        if len(buf) < offset + layout.size:
            raise ValueError(f"buffer of {len(buf)} bytes cannot hold a {layout.size}-byte"
                             f" reply at offset {offset}")
        memoryview(buf)[offset:offset + layout.size] = bytes(layout.size)
        return cls(buf, offset, step_id, layout)

    @classmethod
    def empty(cls, step_id: int, n_req: int, num_spec: int, flags: int) -> StepReply:
        """A zeroed reply in a buffer of its own."""
        layout = reply_layout(n_req, num_spec, flags)
        return cls.into(bytearray(layout.size), 0, step_id, n_req, num_spec, flags)

    @property
    def size(self) -> int:
        return reply_layout(self.n_req, self.num_spec, self.flags).size

    def head_words(self) -> npt.NDArray[np.uint64]:
        """status, window_rows and generation with their padding, as the 8-byte words that
        carry them (from status up to draft_ids), one view over the buffer."""
        lo = reply_layout(self.n_req, self.num_spec, self.flags)
        return np.ndarray(((lo.draft_ids - lo.status) // 8,), _U64, self._buf,
                          self._offset + lo.status)

    def finish(self, worker_us: int) -> int:
        """Write the header (with ``worker_us``, clamped to u32) and return the body size."""
        self.worker_us = min(max(int(worker_us), 0), U32_MASK)
        buf = self._buf
        if not isinstance(buf, (bytearray, memoryview)):
            raise TypeError("finish() needs a reply laid over a writable buffer")
        REPLY_HEADER_STRUCT.pack_into(buf, self._offset, self.step_id, self.n_req,
                                      self.num_spec, self.flags, self.worker_us, 0)
        return self.size

    def pack(self) -> bytes:
        """The body as bytes (tests and tools)."""
        size = self.size
        out = bytearray(size)
        mv = memoryview(self._buf)[self._offset:self._offset + size]
        out[:] = mv
        REPLY_HEADER_STRUCT.pack_into(out, 0, self.step_id, self.n_req, self.num_spec,
                                      self.flags, self.worker_us, 0)
        return bytes(out)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, StepReply):
            return NotImplemented
        return self.pack() == other.pack()

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return (f"StepReply(step_id={self.step_id}, n_req={self.n_req}, num_spec={self.num_spec},"
                f" flags={self.flags:#x}, worker_us={self.worker_us},"
                f" status={self.status.tolist()}, draft_ids={self.draft_ids.tolist()})")
