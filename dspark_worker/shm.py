"""The worker's side of the shared-memory rows region (docs/contract.md section 13).

* ``map_region``: check a received descriptor (a memfd: a regular shmem file whose seals include
  ``F_SEAL_SHRINK`` and ``F_SEAL_GROW``, of exactly the offered size, within the limit) and map it
  read-only. With the shrink seal the file can never become shorter than the mapping, so a
  client cannot make a read of it fault (SIGBUS); without it the region is refused.
* ``Region``: the mapping as a uint8 array. Views of it (a STEP's rows) keep it mapped while the
  runner uses them; ``close`` drops the connection's reference, and the mapping goes (and, on
  CUDA, is unregistered first) when the last view does: at once when no STEP is in flight.
* ``ConnShm``: one connection's state: a pending OFFER, the region, and the descriptors that
  arrived with a frame (``SCM_RIGHTS``) until the MAP handler takes them.
* ``FdReceiver``: after an accepted OFFER the connection stops reading through its transport and
  reads the next frame's bytes itself with ``recvmsg`` so the memfd that comes with them is not
  lost (a plain receive discards ancillary data: the kernel closes such descriptors, which is
  also what happens to descriptors sent with any other frame).
* ``ShmOps``: the OP_SHM_ATTACH handler that dispatch calls (both phases).
* ``cuda_host_register``: page-lock a mapping for the device's copies (torch's cudart), so a
  STEP's rows go from the client's memory to the device in one DMA read.
"""

from __future__ import annotations

import array
import contextlib
import fcntl
import logging
import mmap
import os
import socket
import stat
import weakref
from collections.abc import Callable
from typing import Any, Final

import numpy as np

from protocol.constants import APP_HEADER_SIZE
from protocol.errors import BadFrameError, LimitsError
from protocol.shm import (
    SHM_OFFER,
    ShmAttach,
    ShmAttachReply,
    check_region_size,
)

log = logging.getLogger(__name__)

# Seals a region must carry: SHRINK keeps every mapped page backed (no SIGBUS); GROW keeps the
# size the worker checked. WRITE is not asked for: the client writes rows there every round.
REQUIRED_SEALS: Final = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
# After an accepted OFFER the next frame's header is read with recvmsg: a descriptor sent with
# the frame arrives with its first byte. The body (of MAP or whatever came) follows as usual.
FD_HEADER_BYTES: Final = APP_HEADER_SIZE
# Descriptors one recvmsg accepts; more are cut by the kernel (MSG_CTRUNC) and the MAP refused.
MAX_FDS_PER_FRAME: Final = 4
# cudaHostRegister flags: the mapping is read-only, so the pages are pinned for reading only.
CUDA_HOST_REGISTER_READ_ONLY: Final = 0x08
# A region larger than its session's largest STEP rows (max_rows_per_step x row_bytes) holds
# memory the session can never use: refused, after rounding that size up to this (the largest
# page size a client rounds its memfd to).
REGION_ROUND_BYTES: Final = 64 << 10

Unregister = Callable[[], None]
Register = Callable[[int, int], "Unregister | None"]


def close_fds(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def map_region(fd: int, region_bytes: int, max_region_bytes: int,
               register: Register | None = None) -> Region:
    """Check ``fd`` against 13.2 and map it read-only. Raises BadFrameError (not a sealed memfd,
    wrong size) or LimitsError (over the limit), naming the value and the rule."""
    check_region_size(region_bytes, max_region_bytes)
    try:
        st = os.fstat(fd)
    except OSError as exc:
        raise BadFrameError(f"SHM_ATTACH descriptor cannot be inspected: {exc}",
                            field="fd") from exc
    if not stat.S_ISREG(st.st_mode):
        raise BadFrameError(f"SHM_ATTACH descriptor is not a memfd (file mode {st.st_mode:#o})",
                            field="fd", value=oct(st.st_mode))
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError as exc:
        raise BadFrameError(f"SHM_ATTACH descriptor is not a sealable memfd: {exc}",
                            field="seals") from exc
    if seals & REQUIRED_SEALS != REQUIRED_SEALS:
        raise BadFrameError(f"SHM_ATTACH memfd seals {seals:#x} lack"
                            f" {REQUIRED_SEALS & ~seals:#x} (F_SEAL_SHRINK | F_SEAL_GROW are"
                            " required)", field="seals", value=seals, limit=REQUIRED_SEALS)
    if st.st_size != region_bytes:
        raise BadFrameError(f"SHM_ATTACH memfd is {st.st_size} bytes, the OFFER said"
                            f" {region_bytes}", field="region_bytes", value=st.st_size,
                            limit=region_bytes)
    if st.st_size > max_region_bytes:  # pragma: no cover - equal to the checked offer
        raise LimitsError(f"memfd of {st.st_size} bytes over {max_region_bytes}",
                          field="region_bytes", value=st.st_size, limit=max_region_bytes)
    try:
        mm = mmap.mmap(fd, region_bytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    except (OSError, ValueError) as exc:
        raise BadFrameError(f"SHM_ATTACH memfd cannot be mapped: {exc}", field="fd") from exc
    return Region(mm, register)


class Region:
    """One connection's mapping, read-only. ``array`` is None once closed."""

    def __init__(self, mm: mmap.mmap, register: Register | None = None) -> None:
        self.nbytes = len(mm)
        # Python's mmap keeps a duplicate of the descriptor while mapped: one per region.
        arr = np.frombuffer(mm, dtype=np.uint8)  # keeps mm (and the mapping) alive
        del mm  # from here the array and its views own the mapping: it goes with the last
        self.address = int(arr.ctypes.data)
        self.registered = False
        if register is not None:
            unregister = register(self.address, self.nbytes)
            if unregister is not None:
                self.registered = True
                # Runs as the array dies, before the buffer (the mapping) is released.
                weakref.finalize(arr, unregister)
        self.array: np.ndarray | None = arr
        self.on_close: Callable[[Region], None] | None = None  # the worker's accounting
        self.conn_id = 0  # the connection it was attached on

    def close(self) -> None:
        """The connection lets go (the mapping itself goes with the last view of it)."""
        self.array = None
        done, self.on_close = self.on_close, None
        if done is not None:
            done(self)


class ConnShm:
    """A connection's shared-memory state (loop thread)."""

    __slots__ = ("fds", "offer", "region")

    def __init__(self) -> None:
        self.offer = 0  # region_bytes of an accepted OFFER awaiting its MAP
        self.region: Region | None = None
        self.fds: dict[int, list[int]] = {}  # id(frame) -> descriptors that came with it

    @property
    def rows(self) -> np.ndarray | None:
        return self.region.array if self.region is not None else None

    def take_fds(self, frame: Any) -> list[int]:
        return self.fds.pop(id(frame), [])

    def drop_fds(self, frame: Any) -> None:
        close_fds(self.fds.pop(id(frame), []))

    def close(self) -> None:
        for fds in self.fds.values():
            close_fds(fds)
        self.fds.clear()
        self.offer = 0
        if self.region is not None:
            self.region.close()
            self.region = None


class FdReceiver:
    """Read exactly ``nbytes`` of a stream socket with ``recvmsg``, keeping the descriptors that
    arrive with them; ``done(data, fds, error)`` is called once on the loop thread."""

    def __init__(self, loop: Any, sock_fd: int, nbytes: int,
                 done: Callable[[bytes, list[int], str | None], None]) -> None:
        self._loop = loop
        self._sock = socket.socket(fileno=os.dup(sock_fd))  # our own fd: the transport keeps its
        self._sock.setblocking(False)
        self._want = nbytes
        self._data = bytearray()
        self._fds: list[int] = []
        self._done: Callable[[bytes, list[int], str | None], None] | None = done
        self._truncated = False
        loop.add_reader(self._sock.fileno(), self._readable)

    def _readable(self) -> None:
        try:
            data, anc, flags, _ = self._sock.recvmsg(
                self._want - len(self._data),
                socket.CMSG_SPACE(MAX_FDS_PER_FRAME * array.array("i").itemsize),
                socket.MSG_CMSG_CLOEXEC)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._finish(f"receive failed: {exc}")
            return
        for level, kind, payload in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds = array.array("i")
                fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
                self._fds.extend(fds)
        if flags & socket.MSG_CTRUNC:
            self._truncated = True
        if not data:
            self._finish("the peer closed the connection")
            return
        self._data += data
        if len(self._data) >= self._want:
            self._finish(None)

    def _finish(self, error: str | None) -> None:
        done, self._done = self._done, None
        if done is None:
            return
        self.cancel()
        if self._truncated:
            # Too many descriptors: the kernel closed the rest; the frame may not use any.
            self._fds.append(-1)
        done(bytes(self._data), self._fds, error)

    def cancel(self) -> None:
        """Stop reading (the deadline passed or the connection went)."""
        self._done = None
        if self._sock.fileno() >= 0:
            with contextlib.suppress(Exception):
                self._loop.remove_reader(self._sock.fileno())
            self._sock.close()

    @property
    def received(self) -> int:
        return len(self._data)

    def abandon(self) -> None:
        """Cancel and close every descriptor received so far."""
        self.cancel()
        close_fds([fd for fd in self._fds if fd >= 0])
        self._fds.clear()


class ShmOps:
    """OP_SHM_ATTACH (13.2). ``max_region_bytes`` 0: the worker offers no regions.
    ``max_mapped_bytes``: what all connections' regions may map together (0: no limit of its
    own). The pages of a region that the worker reads are charged to the worker (a read of a
    hole in a sparse memfd allocates it; on CUDA every region is also page-locked), so this
    bounds the host memory clients can make the worker hold."""

    def __init__(self, max_region_bytes: int, register: Register | None = None,
                 max_mapped_bytes: int = 0) -> None:
        self.max_region_bytes = max_region_bytes
        self.max_mapped_bytes = max_mapped_bytes
        self.register = register
        self.regions_mapped = 0  # regions attached so far
        self.mapped_bytes = 0  # bytes of the regions attached now
        self.by_connection: dict[int, int] = {}  # conn_id -> bytes of its region mapped now
        # Called with the bytes a region needs when the regions mapped leave too little room:
        # dispatch lets go of sessions left unused (their regions unmap), as it does for lanes.
        self.make_room: Callable[[int], None] = lambda need: None

    @staticmethod
    def session_bound(rows_bytes: int) -> int:
        """The largest region a session whose largest STEP carries ``rows_bytes`` of rows may
        attach."""
        return -(-rows_bytes // REGION_ROUND_BYTES) * REGION_ROUND_BYTES

    def room(self, rows_bytes: int) -> int:
        """The largest region a session with ``rows_bytes`` of rows per STEP could attach now
        (the ``region_bytes`` of a ST_LIMITS reply, 13.2)."""
        out = min(self.max_region_bytes, self.session_bound(rows_bytes))
        if self.max_mapped_bytes:
            out = min(out, max(0, self.max_mapped_bytes - self.mapped_bytes))
        return out

    def reply(self, region_bytes: int = 0) -> bytes:
        return ShmAttachReply(self.max_region_bytes, region_bytes).pack()

    def attach(self, conn: Any, fr: Any, rows_bytes: int) -> bytes:
        """Handle one OP_SHM_ATTACH frame of a session bound to ``conn`` (dispatch checked
        that) whose largest STEP carries ``rows_bytes`` of rows; return the reply body of an
        accepted one, raise the refusal otherwise. Descriptors that came with the frame are
        closed whatever happens (a mapping outlives its descriptor)."""
        state: ConnShm | None = getattr(conn, "shm", None)
        fds = state.take_fds(fr) if state is not None else []
        try:
            return self._attach(conn, state, fr, fds, rows_bytes)
        finally:
            close_fds([fd for fd in fds if fd >= 0])

    def _attach(self, conn: Any, state: ConnShm | None, fr: Any, fds: list[int],
                rows_bytes: int) -> bytes:
        att = ShmAttach.unpack(fr.body)
        if state is None or not self.max_region_bytes or getattr(conn, "kind", "") != "unix":
            why = ("this worker serves no shared-memory regions" if not self.max_region_bytes
                   else "shared memory needs a Unix socket connection")
            raise BadFrameError(f"SHM_ATTACH refused: {why}", field="op")
        if att.phase == SHM_OFFER:
            if fds:
                raise BadFrameError(f"SHM_ATTACH OFFER came with {len(fds)} descriptors; only"
                                    " MAP carries one", field="fd", value=len(fds), limit=0)
            if state.region is not None:
                raise BadFrameError("SHM_ATTACH OFFER on a connection whose region is already"
                                    " attached", field="phase", value=att.phase)
            check_region_size(att.region_bytes, self.max_region_bytes)
            self._check_session(att.region_bytes, rows_bytes)
            self._check_room(att.region_bytes)
            state.offer = att.region_bytes
            conn.expect_fds(FD_HEADER_BYTES)
            return self.reply(0)
        offer, state.offer = state.offer, 0
        if not offer:
            raise BadFrameError("SHM_ATTACH MAP without an accepted OFFER right before it",
                                field="phase", value=att.phase, limit=SHM_OFFER)
        if att.region_bytes != offer:
            raise BadFrameError(f"SHM_ATTACH MAP region_bytes {att.region_bytes} is not the"
                                f" OFFER's {offer}", field="region_bytes",
                                value=att.region_bytes, limit=offer)
        if len(fds) != 1 or fds[0] < 0:
            raise BadFrameError(f"SHM_ATTACH MAP carries {sum(fd >= 0 for fd in fds)}"
                                f" descriptors{' (and more the kernel cut)' if -1 in fds else ''};"
                                " it carries exactly one memfd", field="fd",
                                value=len(fds), limit=1)
        self._check_room(att.region_bytes)
        region = map_region(fds[0], att.region_bytes, self.max_region_bytes, self.register)
        state.region = region
        self.regions_mapped += 1
        self.mapped_bytes += region.nbytes
        region.on_close = self._unmapped
        conn_id = getattr(conn, "conn_id", 0)
        region.conn_id = conn_id
        self.by_connection[conn_id] = region.nbytes
        log.info("connection %s: shared-memory rows region of %d bytes mapped%s",
                 getattr(conn, "peer", "?"), region.nbytes,
                 " and page-locked" if region.registered else "")
        return self.reply(region.nbytes)


    def _check_session(self, region_bytes: int, rows_bytes: int) -> None:
        bound = self.session_bound(rows_bytes)
        if region_bytes > bound:
            raise LimitsError(f"SHM_ATTACH region of {region_bytes} bytes is larger than this"
                              f" session can use: its largest STEP carries {rows_bytes} bytes"
                              f" of rows (HELLO max_rows_per_step x row_bytes), {bound} rounded"
                              f" up to {REGION_ROUND_BYTES // 1024} KiB; rows go on the socket",
                              field="region_bytes", value=region_bytes, limit=bound)

    def _check_room(self, region_bytes: int) -> None:
        limit = self.max_mapped_bytes
        if limit and self.mapped_bytes + region_bytes > limit:
            self.make_room(self.mapped_bytes + region_bytes - limit)
        if limit and self.mapped_bytes + region_bytes > limit:
            raise LimitsError(f"SHM_ATTACH region of {region_bytes} bytes: regions of"
                              f" {self.mapped_bytes} bytes are mapped, the worker's limit for"
                              f" all of them is {limit} bytes (--max-shm-mapped-bytes), so"
                              f" {max(0, limit - self.mapped_bytes)} bytes are free; rows go on"
                              " the socket", field="region_bytes",
                              value=self.mapped_bytes + region_bytes, limit=limit)

    def _unmapped(self, region: Region) -> None:
        self.mapped_bytes -= region.nbytes
        if self.by_connection.get(region.conn_id) == region.nbytes:
            del self.by_connection[region.conn_id]


def cuda_host_register(address: int, nbytes: int) -> Unregister | None:
    """Page-lock ``[address, address + nbytes)`` for the current CUDA device (read-only pages);
    return the matching unregister, or None when CUDA refuses (the copies then read pageable
    memory: slower, still correct)."""
    import torch

    cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
    err = cudart.cudaHostRegister(address, nbytes, CUDA_HOST_REGISTER_READ_ONLY)
    if int(err) != 0:
        with contextlib.suppress(Exception):
            cudart.cudaGetLastError()  # clear it: a failed registration is not sticky
        log.warning("cudaHostRegister of a %d-byte shared-memory region failed (%s); its rows"
                    " are copied from pageable memory", nbytes, err)
        return None

    def unregister() -> None:
        cudart.cudaHostUnregister(address)

    return unregister

