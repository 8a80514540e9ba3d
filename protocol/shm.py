"""The wire parts of the same-host shared-memory rows region (docs/contract.md section 13).

* ``ShmAttach``: the body of an ``OP_SHM_ATTACH`` request (``region_bytes``, ``phase``), and
  ``ShmAttachReply``: the body of every answer to one (the worker's limit and what it mapped).
* ``decode_step_shm``: a STEP with ``SF_ROWS_SHM`` decoded against the connection's region: the
  body is the prefix only (StepHeader and entries), the rows are a view of the region at the
  header's ``rows_at``; every offset and length is checked against the region first.
* ``set_rows_at``: write ``rows_at`` and the flag into a packed StepHeader (the client).

Sans-IO like the rest of ``protocol``: no descriptors, no mappings. The worker passes the region
as a buffer it mapped (``dspark_worker.shm``); the client maps its own (``dspark_client.shm``).
"""

from __future__ import annotations

import struct
from typing import Final

import msgspec
import numpy as np

from .constants import SF_ROWS_SHM, STEP_HEADER_SIZE
from .errors import BadFrameError, LimitsError
from .messages import ENTRY_DTYPE, StepHeader, StepView, rows_offset_for

Buffer = bytes | bytearray | memoryview

# OP_SHM_ATTACH phases (13.2): OFFER asks whether a region of this size may be attached; MAP is
# the frame that carries the memfd (SCM_RIGHTS) and is sent only after an accepted OFFER.
SHM_OFFER: Final = 1
SHM_MAP: Final = 2
SHM_PHASE_NAMES: Final[dict[int, str]] = {SHM_OFFER: "OFFER", SHM_MAP: "MAP"}
# region_bytes u64, phase u8, 7 reserved bytes (0)
SHM_ATTACH_STRUCT: Final = struct.Struct("<QB7x")
# max_region_bytes u64 (the worker's limit; 0: no regions), region_bytes u64 (mapped; 0: none)
SHM_REPLY_STRUCT: Final = struct.Struct("<QQ")
# The StepHeader's reserved u64 at this offset carries rows_at on an SF_ROWS_SHM STEP.
ROWS_AT_OFFSET: Final = 24
# rows_at must be a multiple of this: rows are read as bf16 words, and socket rows start 8-byte
# aligned in their frame too (7.3).
ROWS_ALIGN: Final = 8
_STEP_FLAGS_OFFSET: Final = 20
_U32: Final = struct.Struct("<I")
_U64: Final = struct.Struct("<Q")


class ShmAttach(msgspec.Struct, frozen=True):
    region_bytes: int
    phase: int

    def pack(self) -> bytes:
        try:
            return SHM_ATTACH_STRUCT.pack(self.region_bytes, self.phase)
        except struct.error as exc:
            raise BadFrameError(f"SHM_ATTACH field out of range: {exc} ({self!r})") from exc

    @classmethod
    def unpack(cls, body: Buffer) -> ShmAttach:
        if len(body) != SHM_ATTACH_STRUCT.size:
            raise BadFrameError(f"SHM_ATTACH body is {len(body)} bytes, not"
                                f" {SHM_ATTACH_STRUCT.size}", field="body_len", value=len(body),
                                limit=SHM_ATTACH_STRUCT.size)
        region_bytes, phase = SHM_ATTACH_STRUCT.unpack(body)
        if bytes(memoryview(body)[9:16]) != bytes(7):
            raise BadFrameError("SHM_ATTACH reserved bytes are not 0", field="reserved")
        if phase not in SHM_PHASE_NAMES:
            raise BadFrameError(f"SHM_ATTACH phase {phase} is neither OFFER ({SHM_OFFER}) nor"
                                f" MAP ({SHM_MAP})", field="phase", value=phase)
        return cls(region_bytes, phase)


class ShmAttachReply(msgspec.Struct, frozen=True):
    max_region_bytes: int
    region_bytes: int

    def pack(self) -> bytes:
        return SHM_REPLY_STRUCT.pack(self.max_region_bytes, self.region_bytes)

    @classmethod
    def unpack(cls, body: Buffer) -> ShmAttachReply:
        if len(body) != SHM_REPLY_STRUCT.size:
            raise BadFrameError(f"SHM_ATTACH reply body is {len(body)} bytes, not"
                                f" {SHM_REPLY_STRUCT.size}", field="body_len", value=len(body),
                                limit=SHM_REPLY_STRUCT.size)
        return cls(*SHM_REPLY_STRUCT.unpack(body))


def check_region_size(region_bytes: int, max_region_bytes: int) -> None:
    """13.2: a region of 0 bytes is malformed; one over the worker's limit is ST_LIMITS."""
    if region_bytes == 0:
        raise BadFrameError("SHM_ATTACH region_bytes is 0", field="region_bytes", value=0)
    if region_bytes > max_region_bytes:
        raise LimitsError(f"SHM_ATTACH region of {region_bytes} bytes is over the worker's"
                          f" limit of {max_region_bytes}", field="region_bytes",
                          value=region_bytes, limit=max_region_bytes)


def set_rows_at(buf: bytearray | memoryview, offset: int, rows_at: int) -> None:
    """Mark the StepHeader packed at ``offset`` in ``buf`` as SF_ROWS_SHM with rows at
    ``rows_at`` in the region."""
    flags = _U32.unpack_from(buf, offset + _STEP_FLAGS_OFFSET)[0]
    _U32.pack_into(buf, offset + _STEP_FLAGS_OFFSET, flags | SF_ROWS_SHM)
    _U64.pack_into(buf, offset + ROWS_AT_OFFSET, rows_at)


def decode_step_shm(body: Buffer, region: np.ndarray | None) -> StepView:
    """Decode an SF_ROWS_SHM STEP (13.3) whose rows live in ``region`` (a uint8 view of the
    connection's mapping, or None when none is attached). The returned view's header has the
    flag and ``rows_at`` taken off, so ``check_step_shape`` applies unchanged; its rows are a view
    of the region, never a copy."""
    h = StepHeader.unpack(body)
    if not h.step_flags & SF_ROWS_SHM:  # pragma: no cover - the caller routes on the flag
        raise BadFrameError("STEP without SF_ROWS_SHM decoded as a shared-memory STEP",
                            field="step_flags", value=h.step_flags, limit=SF_ROWS_SHM)
    if region is None:
        raise BadFrameError("STEP has SF_ROWS_SHM but this connection has no shared-memory"
                            " region attached (SHM_ATTACH first)", field="step_flags",
                            value=h.step_flags)
    ro = rows_offset_for(h.n_req)
    if len(body) != ro:
        raise BadFrameError(
            f"SF_ROWS_SHM STEP body is {len(body)} bytes; with n_req {h.n_req} its prefix is"
            f" exactly {ro} (the rows are in the region)", field="body_len", value=len(body),
            limit=ro)
    size = int(region.nbytes)
    rows_at = h.reserved
    if rows_at % ROWS_ALIGN:
        raise BadFrameError(f"SF_ROWS_SHM rows_at {rows_at} is not a multiple of {ROWS_ALIGN}",
                            field="rows_at", value=rows_at, limit=ROWS_ALIGN)
    nbytes = h.n_rows * h.row_bytes
    if rows_at > size or nbytes > size - rows_at:
        raise BadFrameError(f"SF_ROWS_SHM rows [{rows_at}, {rows_at + nbytes}) ({h.n_rows} rows"
                            f" of {h.row_bytes} bytes) are not inside the {size}-byte region",
                            field="rows_at", value=rows_at, limit=size)
    entries = np.frombuffer(body, dtype=ENTRY_DTYPE, count=h.n_req, offset=STEP_HEADER_SIZE)
    rows = region[rows_at:rows_at + nbytes]
    header = StepHeader(h.step_id, h.n_req, h.n_rows, h.row_bytes,
                        h.step_flags & ~SF_ROWS_SHM, 0)
    return StepView(header=header, entries=entries, rows=rows.reshape(h.n_rows, h.row_bytes))
