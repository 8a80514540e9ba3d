"""Frames on a byte stream, sans-IO (docs/contract.md section 3).

``frame``/``split_frame`` build and read one whole frame. ``FrameDecoder`` cuts a stream into
frames: bytes in, ``Frame`` objects out, no sockets. It can be driven two ways:

* ``feed(data)``: the caller hands it bytes it received (copied once into place);
* ``get_buffer(hint)`` / ``buffer_updated(n)``: the shape of ``asyncio.BufferedProtocol``. The
  transport receives straight into the decoder's memory, and a frame's body is received straight
  into the buffer that the frame will own (from ``alloc``, e.g. a pool of pinned buffers), so a
  large rows region is never assembled from chunks.

A body over its limit is refused from its header, before a byte of it is buffered. The limit
is ``max_body``, or what ``limit(header)`` says for that header (the worker allows a
connection without a session only small bodies). Memory follows the bytes that arrived: a
header alone never makes the decoder allocate its body, unless ``preallocate(header)`` says the
sender is trusted with it (the worker: a STEP of a session this connection HELLOed). Other
bodies over ``PREALLOCATE_BYTES`` grow, doubling, as their bytes arrive. A body that
``discard(header)`` names is read and thrown away as it arrives, never buffered: its frame
comes out with an empty body and ``discarded`` set, so the reader can answer it from its header
and the stream stays aligned (the worker: a frame for a session the connection no longer holds).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

import msgspec

from .constants import APP_HEADER_SIZE, DEFAULT_MAX_BODY_BYTES
from .errors import BadFrameError, FrameTooLargeError
from .header import AppHeader

Buffer = bytes | bytearray | memoryview

# Bytes the decoder reads at once while it waits for headers: many small frames per receive.
SCRATCH_BYTES: Final = 64 << 10
# Scratch a new decoder starts with; it grows to SCRATCH_BYTES once a receive fills all of it (more
# was waiting), so an idle or header-only connection holds a few KiB, not 64.
INITIAL_SCRATCH_BYTES: Final = 4 << 10
# Bodies up to this size are allocated whole from their header (cheaper than growing them); a
# larger one, unless ``preallocate`` trusts its sender, grows with what arrives.
PREALLOCATE_BYTES: Final = 64 << 10

# limit(header) -> (largest body_len accepted for it, what the limit is, for the error message)
LimitFn = Callable[[AppHeader], tuple[int, str]]
# Where the bytes of a discarded body are received (their content is never read).
_SINK = bytearray(SCRATCH_BYTES)


def frame(op: int, seq: int, session: int, body: Buffer = b"", status: int = 0) -> bytes:
    """One whole frame: header and body."""
    out = bytearray(APP_HEADER_SIZE + len(body))
    AppHeader(op=op, seq=seq, session=session, body_len=len(body), status=status).pack_into(out)
    out[APP_HEADER_SIZE:] = body
    return bytes(out)


def split_frame(buf: Buffer) -> tuple[AppHeader, memoryview]:
    """Header and body (a view) of one whole frame; the body length must match exactly."""
    h = AppHeader.unpack(buf)
    have = len(buf) - APP_HEADER_SIZE
    if h.body_len != have:
        raise BadFrameError(f"frame header says body_len {h.body_len}, the frame holds {have}",
                            field="body_len", value=h.body_len, limit=have)
    return h, memoryview(buf)[APP_HEADER_SIZE:]


class Frame(msgspec.Struct, gc=False):
    """A whole frame. ``body`` is a view of ``len == header.body_len`` into a buffer this frame
    owns (``storage``): it stays valid after the decoder moves on."""

    header: AppHeader
    body: memoryview
    storage: bytearray | memoryview | None = None
    discarded: bool = False  # the body was read and thrown away (``FrameDecoder``'s discard)


class FrameDecoder:
    """Cut a byte stream into frames.

    Errors are raised from ``feed``/``buffer_updated``: ``FrameHeaderError`` (bad magic: the
    stream cannot be resynchronised and must be closed) and ``FrameTooLargeError`` (body_len over
    ``max_body``; ``error_header`` then holds the header so the reply can echo it). After an error
    the decoder refuses further input. Frames completed by the same call before the error are
    not returned: with one request in flight per connection (section 2) there are none."""

    def __init__(self, max_body: int = DEFAULT_MAX_BODY_BYTES,
                 alloc: Callable[[int], bytearray | memoryview] = bytearray, *,
                 limit: LimitFn | None = None,
                 preallocate: Callable[[AppHeader], bool] | None = None,
                 discard: Callable[[AppHeader], bool] | None = None) -> None:
        if max_body < 0:
            raise ValueError(f"max_body {max_body} is negative")
        self.max_body = max_body
        self._alloc = alloc
        self._limit = limit
        self._preallocate = preallocate
        self._discard = discard
        self._skip = 0  # bytes of a discarded body still to arrive
        self._scratch = bytearray(INITIAL_SCRATCH_BYTES)
        self._scratch_offered = 0  # bytes of scratch the last get_buffer handed out
        self._have = 0  # bytes held in scratch, not yet parsed
        self._header: AppHeader | None = None  # header of the frame whose body is arriving
        self._body: bytearray | memoryview | None = None
        self._body_have = 0
        self.error: BadFrameError | None = None
        self.error_header: AppHeader | None = None
        self.frames_decoded = 0

    # -- state ------------------------------------------------------------------------------------
    @property
    def has_partial(self) -> bool:
        """True while part of a frame has arrived and the rest has not."""
        return self._header is not None or self._have > 0

    @property
    def body_remaining(self) -> int:
        """Bytes of the body being received that have not arrived yet (0 between bodies)."""
        if self._header is None:
            return 0
        if self._body is None:
            return self._skip
        return self._header.body_len - self._body_have

    @property
    def partial_bytes(self) -> int:
        return self._have + (APP_HEADER_SIZE + self._body_have if self._header else 0)

    # -- BufferedProtocol shape ------------------------------------------------------------------
    def get_buffer(self, sizehint: int = -1) -> memoryview:
        """Where the next received bytes go: the rest of a body being received, or scratch."""
        self._check_usable()
        if self._skip:
            return memoryview(_SINK)[:min(self._skip, len(_SINK))]
        if self._body is not None and self._header is not None:
            if self._body_have == len(self._body):  # a growing body is full: double it
                self._grow_body()
            end = min(self._header.body_len, len(self._body))
            return memoryview(self._body)[self._body_have:end]
        view = memoryview(self._scratch)[self._have:]
        self._scratch_offered = len(view)
        return view

    def buffer_updated(self, nbytes: int) -> list[Frame]:
        """``nbytes`` were written into the last ``get_buffer``; return the frames completed."""
        self._check_usable()
        frames: list[Frame] = []
        if self._skip:
            self._skip -= nbytes
            if not self._skip:
                self._emit_discarded(frames)
            return frames
        if self._body is not None and self._header is not None:
            self._body_have += nbytes
            if self._body_have < self._header.body_len:
                return frames
            self._emit_body(frames)
            return frames
        self._have += nbytes
        self._parse_scratch(frames)
        if nbytes >= self._scratch_offered and len(self._scratch) < SCRATCH_BYTES:
            # The receive filled all it was offered: more is arriving than a few KiB at a time.
            bigger = bytearray(SCRATCH_BYTES)
            bigger[:self._have] = self._scratch[:self._have]
            self._scratch = bigger
        return frames

    # -- plain shape ------------------------------------------------------------------------------
    def feed(self, data: Buffer) -> list[Frame]:
        """Take received bytes; return the frames they complete, in order."""
        frames: list[Frame] = []
        mv = memoryview(data).cast("B")
        while mv:
            dst = self.get_buffer(len(mv))
            n = min(len(dst), len(mv))
            dst[:n] = mv[:n]
            mv = mv[n:]
            frames.extend(self.buffer_updated(n))
        return frames

    # -- inner work ------------------------------------------------------------------------------
    def _check_usable(self) -> None:
        if self.error is not None:
            raise self.error

    def _fail(self, exc: BadFrameError) -> BadFrameError:
        self.error = exc
        return exc

    def _parse_scratch(self, frames: list[Frame]) -> None:
        scratch = self._scratch
        pos = 0
        try:
            while self._have - pos >= APP_HEADER_SIZE:
                h = AppHeader.unpack(scratch, pos)
                if h.body_len > self.max_body:
                    self.error_header = h
                    raise FrameTooLargeError(
                        f"{h.op_name} frame body_len {h.body_len} is over the limit of"
                        f" {self.max_body} bytes (seq {h.seq})",
                        field="body_len", value=h.body_len, limit=self.max_body)
                skip = bool(h.body_len) and self._discard is not None and self._discard(h)
                if self._limit is not None and not skip:
                    limit, what = self._limit(h)
                    if h.body_len > limit:
                        self.error_header = h
                        raise FrameTooLargeError(
                            f"{h.op_name} frame body_len {h.body_len} is over the limit of"
                            f" {limit} bytes {what} (seq {h.seq})",
                            field="body_len", value=h.body_len, limit=limit)
                pos += APP_HEADER_SIZE
                avail = self._have - pos
                if skip:
                    took = min(avail, h.body_len)
                    pos += took
                    self._header = h
                    self._skip = h.body_len - took
                    if self._skip:
                        break
                    self._emit_discarded(frames)
                    continue
                if avail >= h.body_len:
                    storage = self._alloc(h.body_len)
                    storage[:h.body_len] = scratch[pos:pos + h.body_len]
                    pos += h.body_len
                    frames.append(Frame(h, memoryview(storage)[:h.body_len], storage))
                    self.frames_decoded += 1
                    continue
                # Body larger than what is here: move the part received into the frame's own
                # buffer; the rest is received straight into it. That buffer is the whole body
                # only for a small body or a trusted sender; otherwise it starts at what has
                # arrived and doubles as more does.
                size = h.body_len
                if size > PREALLOCATE_BYTES and not (
                        self._preallocate is not None and self._preallocate(h)):
                    size = min(size, max(PREALLOCATE_BYTES, 2 * avail))
                storage = self._alloc(size) if size == h.body_len else bytearray(size)
                storage[:avail] = scratch[pos:self._have]
                self._header, self._body, self._body_have = h, storage, avail
                pos = self._have
                break
        except BadFrameError as exc:
            self._have = 0
            raise self._fail(exc) from None
        rest = self._have - pos
        if rest and pos:
            scratch[:rest] = scratch[pos:self._have]
        self._have = rest

    def _grow_body(self) -> None:
        h, old = self._header, self._body
        if h is None or old is None:  # pragma: no cover - guarded by the caller
            return
        size = min(h.body_len, 2 * len(old))
        # The last step lands in the frame's own storage (from ``alloc``), sized to the body.
        new = self._alloc(size) if size == h.body_len else bytearray(size)
        new[:self._body_have] = old[:self._body_have]
        self._body = new

    def _emit_discarded(self, frames: list[Frame]) -> None:
        h, self._header = self._header, None
        if h is not None:
            frames.append(Frame(h, memoryview(b""), None, True))
            self.frames_decoded += 1

    def _emit_body(self, frames: list[Frame]) -> None:
        h, storage = self._header, self._body
        if h is None or storage is None:  # pragma: no cover - guarded by the caller
            return
        self._header, self._body, self._body_have = None, None, 0
        frames.append(Frame(h, memoryview(storage)[:h.body_len], storage))
        self.frames_decoded += 1
