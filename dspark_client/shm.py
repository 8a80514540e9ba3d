"""The client's shared-memory rows region (docs/contract.md section 13), torch-free.

``ShmRegion`` is a memfd sized for the session's largest STEP (``max_rows_per_step *
row_bytes``), sealed against shrinking and growing (``F_SEAL_SHRINK | F_SEAL_GROW``, then
``F_SEAL_SEAL`` so no one can change that), and mapped read-write here. The client makes one per
engine run and attaches it to every connection it opens to a ``unix+shm://`` endpoint, so the
memory the engine writes rows into (``RemoteDraftClient.rows_buffer``) stays the same across
reconnects, and an engine registers it for pinned copies once.

``attach`` runs the two-phase OP_SHM_ATTACH on a fresh connection (after its HELLO): OFFER with
the size, then, once accepted, MAP with the memfd over ``SCM_RIGHTS``. Any refusal leaves the
connection usable with rows on the socket: the caller falls back.

Rule of the region (13.4): rows of a STEP stay untouched from ``step()`` until its reply (or
until the connection is dropped after a timeout); writing them earlier can only spoil that
STEP's own drafts.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
from collections.abc import Callable
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from protocol import wire
from protocol.constants import OP_SHM_ATTACH
from protocol.shm import ROWS_ALIGN, SHM_MAP, SHM_OFFER, ShmAttach, ShmAttachReply

__all__ = ["ShmRegion", "attach", "shm_available"]

SEALS: Final = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL if hasattr(
    fcntl, "F_SEAL_SHRINK") else 0
_REPLY_BYTES: Final = 256


def shm_available() -> bool:
    """memfd_create and file seals exist here (Linux)."""
    return hasattr(os, "memfd_create") and bool(SEALS)


class ShmRegion:
    """A sealed memfd mapped read-write: ``array`` is its bytes (uint8)."""

    def __init__(self, nbytes: int, name: str = "dspark-rows") -> None:
        if nbytes <= 0:
            raise ValueError(f"region of {nbytes} bytes; it must be positive")
        if not shm_available():
            raise OSError("shared-memory rows need memfd_create and file seals (Linux)")
        page = mmap.PAGESIZE
        size = (nbytes + page - 1) // page * page
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED,
                           prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        self.fd: int = fd
        self.nbytes = size
        # The array keeps the mapping alive, as do views of it handed to the engine.
        self.array: npt.NDArray[np.uint8] = np.frombuffer(mm, dtype=np.uint8)
        del mm
        self.address = int(self.array.ctypes.data)

    def rows(self, n: int, row_bytes: int, offset: int = 0) -> npt.NDArray[np.uint8]:
        """``uint8 [n, row_bytes]`` of the region from ``offset``."""
        end = offset + n * row_bytes
        if offset < 0 or offset % ROWS_ALIGN or end > self.nbytes:
            raise ValueError(f"{n} rows of {row_bytes} bytes at offset {offset} do not fit the"
                             f" {self.nbytes}-byte region (offsets are multiples of"
                             f" {ROWS_ALIGN})")
        return self.array[offset:end].reshape(n, row_bytes)

    def offset_of(self, rows: Any) -> int | None:
        """Where ``rows`` (a C-contiguous array or buffer) start in the region, or None when
        they are not wholly inside it."""
        try:
            view = memoryview(rows)
        except TypeError:
            return None
        if not view.c_contiguous:
            return None
        start = np.frombuffer(view.cast("B"), dtype=np.uint8).ctypes.data if view.nbytes else 0
        at = int(start) - self.address
        if view.nbytes == 0 or at < 0 or at + view.nbytes > self.nbytes:
            return None
        return at

    def close(self) -> None:
        """Close the descriptor; the mapping goes with the last view of it."""
        fd, self.fd = self.fd, -1
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)

    def __del__(self) -> None:
        self.close()


def _which_limit(status: int, nbytes: int, rep: ShmAttachReply | None) -> str:
    """The limit a refused region met, from the reply (13.2: on ST_LIMITS its region_bytes is
    the largest region the worker could map for the session now)."""
    if rep is None:
        return ""
    if status != wire.ST_LIMITS:
        return f" (the worker's limit per region is {rep.max_region_bytes} bytes)"
    if nbytes > rep.max_region_bytes:
        return (f": over the worker's limit per region, {rep.max_region_bytes} bytes (its"
                " --max-shm-region-bytes)")
    return (f": the worker could map {rep.region_bytes} bytes for this session now; its cap on"
            " the regions of all connections together (--max-shm-mapped-bytes) is taken by"
            " others, or the region is larger than this session's largest STEP")


def attach(conn: Any, region: ShmRegion, session: int, next_seq: Callable[[], int],
           timeout: float) -> tuple[bool, str]:
    """OFFER then MAP on ``conn`` (a connected ``SocketClient`` whose session is HELLOed).
    Returns (True, "") once the worker mapped the region, (False, why) when it refused; raises
    TransportError when the connection failed (it is then closed)."""
    buf = bytearray(_REPLY_BYTES)
    for phase in (SHM_OFFER, SHM_MAP):
        seq = next_seq()
        msg = wire.frame(OP_SHM_ATTACH, seq, session, ShmAttach(region.nbytes, phase).pack())
        if phase == SHM_OFFER:
            n = conn.request(msg, buf, timeout)
        else:
            n = conn.request_fds(msg, [region.fd], buf, timeout)
        h, body = wire.split_frame(memoryview(buf)[:n])
        if h.op != OP_SHM_ATTACH or h.seq != seq or h.session != session:
            raise wire.WireError(f"SHM_ATTACH reply echoes op={h.op} seq={h.seq} session="
                                 f"{h.session:#x}; sent op={OP_SHM_ATTACH} seq={seq}")
        rep = ShmAttachReply.unpack(body) if len(body) == 16 else None
        if h.status != wire.ST_OK:
            name = wire.FRAME_STATUS_NAMES.get(h.status, str(h.status))
            return False, (f"SHM_ATTACH {'OFFER' if phase == SHM_OFFER else 'MAP'} of"
                           f" {region.nbytes} bytes refused: {name}"
                           f"{_which_limit(h.status, region.nbytes, rep)}")
        if rep is None:
            raise wire.WireError(f"SHM_ATTACH reply body is {len(body)} bytes, not 16")
    return True, ""
