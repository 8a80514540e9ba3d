"""The 24-byte AppHeader that starts every frame (docs/contract.md section 3)."""

from __future__ import annotations

import struct
from typing import Final

import msgspec

from .constants import APP_HEADER_SIZE, MAGIC, OP_NAMES, VERSION
from .errors import BadFrameError, FrameHeaderError

HEADER_STRUCT: Final = struct.Struct("<IHBBIIQ")  # magic version op status session body_len seq


class AppHeader(msgspec.Struct, gc=False):
    """One frame's header. ``version`` and ``magic`` default to this contract's."""

    op: int
    seq: int = 0
    session: int = 0
    body_len: int = 0
    status: int = 0
    version: int = VERSION
    magic: int = MAGIC

    def pack_into(self, buf: bytearray | memoryview, offset: int = 0) -> None:
        try:
            HEADER_STRUCT.pack_into(
                buf, offset, self.magic, self.version, self.op, self.status,
                self.session, self.body_len, self.seq,
            )
        except struct.error as exc:
            raise BadFrameError(
                f"AppHeader does not fit its fields ({exc}): op {self.op}, status {self.status},"
                f" session {self.session}, body_len {self.body_len}, seq {self.seq}",
                field="header",
            ) from exc

    def pack(self) -> bytes:
        buf = bytearray(APP_HEADER_SIZE)
        self.pack_into(buf)
        return bytes(buf)

    @classmethod
    def unpack(cls, buf: bytes | bytearray | memoryview, offset: int = 0) -> AppHeader:
        """Read a header; a wrong magic raises FrameHeaderError (the stream must close)."""
        if len(buf) - offset < APP_HEADER_SIZE:
            raise BadFrameError(
                f"frame holds {len(buf) - offset} bytes, fewer than the {APP_HEADER_SIZE}-byte"
                " header",
                field="header", value=len(buf) - offset, limit=APP_HEADER_SIZE,
            )
        magic, version, op, status, session, body_len, seq = HEADER_STRUCT.unpack_from(buf, offset)
        if magic != MAGIC:
            raise FrameHeaderError(
                f"header magic {magic:#010x} is not {MAGIC:#010x} (b'DSPK')",
                field="magic", value=magic, limit=MAGIC,
            )
        return cls(op=op, seq=seq, session=session, body_len=body_len, status=status,
                   version=version, magic=magic)

    def reply(self, status: int, body_len: int) -> AppHeader:
        """The header of the reply to this request: op, session and seq echoed."""
        return AppHeader(op=self.op, seq=self.seq, session=self.session, body_len=body_len,
                         status=status, version=self.version)

    @property
    def op_name(self) -> str:
        return OP_NAMES.get(self.op, f"op {self.op}")

