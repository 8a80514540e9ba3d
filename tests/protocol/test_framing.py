"""FrameDecoder and whole-frame helpers (docs/contract.md section 3)."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from protocol.constants import APP_HEADER_SIZE, MAGIC, OP_PING, OP_STATS, OP_STEP
from protocol.errors import BadFrameError, FrameHeaderError, FrameTooLargeError, WireError
from protocol.framing import SCRATCH_BYTES, Frame, FrameDecoder, frame, split_frame
from protocol.header import AppHeader


def _frames(n: int, body_of: int = 0) -> list[bytes]:
    return [frame(OP_STATS if i % 2 else OP_PING, seq=i, session=i % 3,
                  body=bytes([i % 251]) * ((i * 7) % (body_of + 1))) for i in range(n)]


def _summary(frames: list[Frame]) -> list[tuple[int, int, int, bytes]]:
    return [(f.header.op, f.header.seq, f.header.session, bytes(f.body)) for f in frames]


def test_frame_and_split_frame_round_trip() -> None:
    data = frame(OP_STEP, seq=2**64 - 1, session=2**32 - 1, body=b"abc", status=4)
    hd, body = split_frame(data)
    assert (hd.op, hd.seq, hd.session, hd.status, hd.body_len) == (2, 2**64 - 1, 2**32 - 1, 4, 3)
    assert bytes(body) == b"abc"


def test_split_frame_refuses_short_and_mismatched_frames() -> None:
    with pytest.raises(BadFrameError) as info:
        split_frame(b"DSPK")
    assert info.value.field == "header"
    assert info.value.value == 4 and info.value.limit == APP_HEADER_SIZE
    data = frame(OP_PING, seq=1, session=0, body=b"xy")
    with pytest.raises(BadFrameError) as info:
        split_frame(data[:-1])
    assert (info.value.field, info.value.value, info.value.limit) == ("body_len", 2, 1)
    assert "body_len 2" in str(info.value)


def test_header_pack_refuses_out_of_range_fields() -> None:
    with pytest.raises(BadFrameError) as info:
        AppHeader(op=256).pack()
    assert "op 256" in str(info.value)
    with pytest.raises(BadFrameError):
        AppHeader(op=1, seq=2**64).pack()
    with pytest.raises(BadFrameError):
        frame(OP_PING, seq=-1, session=0)


def test_reply_header_echoes_op_session_and_seq() -> None:
    req = AppHeader(op=OP_STEP, seq=77, session=0xDEADBEEF, body_len=500)
    rep = req.reply(status=3, body_len=0)
    assert (rep.op, rep.seq, rep.session, rep.status, rep.body_len) == (
        OP_STEP, 77, 0xDEADBEEF, 3, 0)
    assert req.op_name == "STEP"
    assert AppHeader(op=99).op_name == "op 99"


def test_partial_header_then_partial_body() -> None:
    data = frame(OP_STEP, seq=5, session=9, body=bytes(range(100)))
    dec = FrameDecoder()
    assert not dec.has_partial and dec.partial_bytes == 0
    assert dec.feed(data[:10]) == []
    assert dec.has_partial and dec.partial_bytes == 10
    assert dec.feed(data[10:24]) == []  # the whole header, no body yet
    assert dec.has_partial and dec.partial_bytes == 24
    assert dec.feed(data[24:60]) == []
    assert dec.has_partial and dec.partial_bytes == 60
    frames = dec.feed(data[60:])
    assert _summary(frames) == [(OP_STEP, 5, 9, bytes(range(100)))]
    assert not dec.has_partial and dec.partial_bytes == 0
    assert dec.frames_decoded == 1


def test_empty_feed_and_empty_bodies() -> None:
    dec = FrameDecoder()
    assert dec.feed(b"") == []
    frames = dec.feed(frame(OP_PING, 1, 0) + frame(OP_PING, 2, 0))
    assert [(f.header.seq, len(f.body)) for f in frames] == [(1, 0), (2, 0)]


def test_many_small_frames_in_one_feed() -> None:
    frames_in = _frames(5000, body_of=20)
    stream = b"".join(frames_in)
    assert len(stream) > 2 * SCRATCH_BYTES  # the scratch buffer is reused many times over
    dec = FrameDecoder()
    got = dec.feed(stream)
    assert len(got) == 5000
    assert _summary(got) == _summary([Frame(*split_frame(f)) for f in frames_in])
    assert not dec.has_partial
    assert dec.frames_decoded == 5000


@pytest.mark.parametrize("chunk", [1, 7, 23, 24, 25, 4096, SCRATCH_BYTES + 3])
def test_chunking_does_not_change_the_frames(chunk: int) -> None:
    frames_in = [*_frames(300, body_of=40), frame(OP_STEP, 999, 1, bytes(70_000))]
    stream = b"".join(frames_in)
    dec = FrameDecoder()
    got: list[Frame] = []
    for i in range(0, len(stream), chunk):
        got.extend(dec.feed(stream[i:i + chunk]))
    assert _summary(got) == _summary(FrameDecoder().feed(stream))
    assert len(got) == 301


def test_every_cut_point_between_two_frames() -> None:
    a = frame(OP_STEP, 1, 7, b"first body")
    b = frame(OP_STATS, 2, 7, b"{}")
    stream = a + b
    for cut in range(len(stream) + 1):
        dec = FrameDecoder()
        got = dec.feed(stream[:cut]) + dec.feed(stream[cut:])
        assert _summary(got) == [(OP_STEP, 1, 7, b"first body"), (OP_STATS, 2, 7, b"{}")]


def test_a_frame_body_outlives_the_decoder_moving_on() -> None:
    dec = FrameDecoder()
    (first,) = dec.feed(frame(OP_STEP, 1, 1, b"A" * 50))
    for i in range(2, 100):
        dec.feed(frame(OP_STEP, i, 1, bytes([i]) * 50))
    assert bytes(first.body) == b"A" * 50


def test_body_over_max_body_is_refused_from_its_header() -> None:
    allocated: list[int] = []

    def alloc(n: int) -> bytearray:
        allocated.append(n)
        return bytearray(n)

    dec = FrameDecoder(max_body=100, alloc=alloc)
    ok = dec.feed(frame(OP_STEP, 1, 5, bytes(100)))  # exactly at the limit is fine
    assert len(ok) == 1 and allocated == [100]
    big = AppHeader(op=OP_STEP, seq=2, session=5, body_len=101).pack()
    with pytest.raises(FrameTooLargeError) as info:
        dec.feed(big)  # the header alone: not one byte of the body has been sent
    err = info.value
    assert isinstance(err, BadFrameError) and err.status == 16
    assert (err.field, err.value, err.limit) == ("body_len", 101, 100)
    assert "101" in str(err) and "100" in str(err)
    assert allocated == [100]  # nothing was allocated for the refused body
    assert dec.error is err
    assert dec.error_header is not None
    assert (dec.error_header.op, dec.error_header.seq, dec.error_header.session) == (
        OP_STEP, 2, 5)
    assert dec.error_header.body_len == 101
    # the decoder refuses any further input, in both shapes
    with pytest.raises(FrameTooLargeError):
        dec.feed(frame(OP_PING, 3, 0))
    with pytest.raises(FrameTooLargeError):
        dec.get_buffer()
    with pytest.raises(FrameTooLargeError):
        dec.buffer_updated(0)


def test_huge_body_len_is_refused_without_allocating() -> None:
    def alloc(n: int) -> bytearray:
        raise AssertionError(f"alloc({n}) for a refused frame")

    dec = FrameDecoder(alloc=alloc)  # the default limit
    with pytest.raises(FrameTooLargeError) as info:
        dec.feed(AppHeader(op=OP_STEP, seq=1, session=1, body_len=2**32 - 1).pack())
    assert info.value.value == 2**32 - 1


def test_bad_magic_is_a_header_error_and_closes_the_decoder() -> None:
    dec = FrameDecoder()
    good = frame(OP_PING, 1, 0)
    assert len(dec.feed(good)) == 1
    bad = bytearray(frame(OP_PING, 2, 0))
    bad[0] ^= 0xFF
    with pytest.raises(FrameHeaderError) as info:
        dec.feed(bad)
    assert info.value.field == "magic"
    assert info.value.value == MAGIC ^ 0xFF
    assert info.value.limit == MAGIC
    assert f"{MAGIC ^ 0xFF:#010x}" in str(info.value)
    assert dec.error is info.value
    assert dec.error_header is None
    with pytest.raises(FrameHeaderError):
        dec.feed(good)


def test_bad_magic_waits_for_a_whole_header() -> None:
    dec = FrameDecoder()
    assert dec.feed(b"XXXX") == []  # fewer than 24 bytes: nothing can be decided yet
    with pytest.raises(FrameHeaderError):
        dec.feed(bytes(20))
    assert isinstance(dec.error, WireError)


def test_negative_max_body_is_refused() -> None:
    with pytest.raises(ValueError, match="-1"):
        FrameDecoder(max_body=-1)


def _receive(dec: FrameDecoder, stream: bytes, chunk: int) -> list[Frame]:
    """Drive the decoder like asyncio.BufferedProtocol: it hands out memory, we fill it."""
    frames: list[Frame] = []
    pos = 0
    while pos < len(stream):
        buf = dec.get_buffer(chunk)
        n = min(len(buf), chunk, len(stream) - pos)
        assert n > 0
        buf[:n] = stream[pos:pos + n]
        pos += n
        frames.extend(dec.buffer_updated(n))
    return frames


def test_buffered_protocol_receives_a_large_body_into_the_allocated_buffer() -> None:
    allocated: list[bytearray] = []

    def alloc(n: int) -> bytearray:
        buf = bytearray(n)
        allocated.append(buf)
        return buf

    body = np.random.default_rng(1).integers(0, 256, size=3 << 20, dtype=np.uint8).tobytes()
    data = frame(OP_STEP, 11, 3, body)
    dec = FrameDecoder(alloc=alloc, preallocate=lambda h: True)  # a trusted sender
    # the header and the first 1000 body bytes arrive in scratch
    first = dec.get_buffer(-1)
    first[:24 + 1000] = data[:24 + 1000]
    assert dec.buffer_updated(24 + 1000) == []
    assert len(allocated) == 1 and len(allocated[0]) == len(body)
    # from here on the decoder hands out the frame's own buffer: the body lands in place
    nxt = dec.get_buffer(-1)
    assert len(nxt) == len(body) - 1000
    storage_view = np.frombuffer(allocated[0], dtype=np.uint8)
    assert np.shares_memory(np.frombuffer(nxt, dtype=np.uint8), storage_view)
    frames = _receive(dec, data[24 + 1000:], 1 << 16)
    assert len(frames) == 1
    f = frames[0]
    assert f.storage is allocated[0]
    assert np.shares_memory(np.frombuffer(f.body, dtype=np.uint8), storage_view)
    assert bytes(f.body) == body
    assert (f.header.op, f.header.seq, f.header.session) == (OP_STEP, 11, 3)
    assert not dec.has_partial


def test_alloc_from_a_pool_larger_than_the_body() -> None:
    pool = bytearray(1 << 20)

    def alloc(n: int) -> memoryview:
        return memoryview(pool)[: max(n, 4096)]  # a pinned-pool slab, larger than asked

    body = bytes(range(256)) * 1000
    stream = frame(OP_STEP, 1, 1, body) + frame(OP_PING, 2, 1)
    dec = FrameDecoder(alloc=alloc)
    frames = _receive(dec, stream[:-24], 1500)
    assert len(frames) == 1
    assert len(frames[0].body) == len(body)
    assert bytes(frames[0].body) == body
    assert np.shares_memory(np.frombuffer(frames[0].body, dtype=np.uint8),
                            np.frombuffer(pool, dtype=np.uint8))
    assert _summary(_receive(dec, stream[-24:], 1500)) == [(OP_PING, 2, 1, b"")]


@pytest.mark.parametrize("chunk", [1, 5, 24, 1000, 1 << 16])
def test_buffered_protocol_and_feed_agree(chunk: int) -> None:
    stream = b"".join(_frames(200, body_of=300)) + frame(OP_STEP, 500, 2, bytes(200_000))
    assert _summary(_receive(FrameDecoder(), stream, chunk)) == _summary(
        FrameDecoder().feed(stream))


# -- memory follows the bytes that arrived -------------------------------------------------------
def test_a_header_alone_allocates_no_body() -> None:
    """A header naming a 200 MiB body makes the decoder allocate nothing for it: the storage
    grows with the bytes that arrive (an untrusted sender can hold only what it sent)."""
    calls: list[int] = []

    def alloc(n: int) -> bytearray:
        calls.append(n)
        return bytearray(n)

    dec = FrameDecoder(max_body=256 << 20, alloc=alloc)
    tracemalloc.start()
    try:
        header = AppHeader(op=OP_STEP, seq=1, session=2, body_len=200 << 20).pack()
        assert dec.feed(header) == []
        assert dec.feed(b"x" * 1000) == []
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert calls == []
    assert peak < 1 << 20, peak
    assert dec.body_remaining == (200 << 20) - 1000


@pytest.mark.parametrize("chunk", [1000, 65536, 100_000, 1 << 20])
def test_a_growing_body_is_decoded_whole_into_the_allocated_storage(chunk: int) -> None:
    allocated: list[bytearray] = []

    def alloc(n: int) -> bytearray:
        buf = bytearray(n)
        allocated.append(buf)
        return buf

    body = np.random.default_rng(2).integers(0, 256, size=(3 << 20) + 5, dtype=np.uint8).tobytes()
    data = frame(OP_STEP, 4, 5, body) + frame(OP_PING, 5, 5)
    dec = FrameDecoder(alloc=alloc)
    frames = _receive(dec, data, chunk)
    assert [f.header.op for f in frames] == [OP_STEP, OP_PING]
    assert bytes(frames[0].body) == body
    # only the final, exact-size buffer came from alloc (the pool): growth steps did not
    big = [b for b in allocated if len(b) > 64 << 10]
    assert len(big) == 1 and len(big[0]) == len(body) and frames[0].storage is big[0]


def test_a_limit_per_header_refuses_before_allocating() -> None:
    calls: list[int] = []

    def alloc(n: int) -> bytearray:
        calls.append(n)
        return bytearray(n)

    def limit(h: AppHeader) -> tuple[int, str]:
        return (4096, "for a connection without a session") if h.op != OP_PING else (0, "")

    dec = FrameDecoder(max_body=64 << 20, alloc=alloc, limit=limit)
    assert [f.header.op for f in dec.feed(frame(OP_STEP, 1, 0, b"s" * 100))] == [OP_STEP]
    header = AppHeader(op=OP_STEP, seq=2, session=7, body_len=5000).pack()
    with pytest.raises(FrameTooLargeError) as info:
        dec.feed(header)
    text = str(info.value)
    assert "STEP" in text and "5000" in text and "4096" in text and "without a session" in text
    assert info.value.limit == 4096 and info.value.value == 5000
    assert dec.error_header is not None and dec.error_header.seq == 2
    assert calls == [100]


def test_scratch_grows_only_when_receives_fill_it() -> None:
    from protocol.framing import INITIAL_SCRATCH_BYTES

    dec = FrameDecoder()
    assert len(dec.get_buffer(-1)) == INITIAL_SCRATCH_BYTES  # an idle connection: 4 KiB
    dec.buffer_updated(0)
    assert dec.feed(frame(OP_PING, 1, 0)) and len(dec.get_buffer(-1)) < SCRATCH_BYTES
    stream = b"".join(_frames(2000, body_of=40))  # many small frames arriving together
    frames = _receive(dec, stream, 1 << 20)
    assert len(frames) == 2000 and len(dec.get_buffer(-1)) == SCRATCH_BYTES


@pytest.mark.parametrize("chunk", [1, 7, 4096, 1 << 20])
def test_a_discarded_body_is_dropped_unbuffered_and_the_stream_stays_aligned(chunk: int) -> None:
    """``discard(header)``: the body is read and thrown away (never allocated, never over a
    limit), its frame comes out with an empty body and ``discarded``; the next frame is whole."""
    calls: list[int] = []

    def alloc(n: int) -> bytearray:
        calls.append(n)
        return bytearray(n)

    dec = FrameDecoder(max_body=1 << 20, alloc=alloc, limit=lambda h: (16, "small"),
                       discard=lambda h: h.op == OP_STEP)
    stream = (frame(OP_STEP, 1, 5, bytes(range(256)) * 1000) + frame(OP_PING, 2, 0)
              + frame(OP_STEP, 3, 5, b"x") + frame(OP_STATS, 4, 0, b"ok"))
    got: list[Frame] = []
    for i in range(0, len(stream), chunk):
        got.extend(dec.feed(stream[i:i + chunk]))
    assert [(f.header.op, f.header.seq, f.header.body_len, bytes(f.body), f.discarded)
            for f in got] == [(OP_STEP, 1, 256_000, b"", True), (OP_PING, 2, 0, b"", False),
                              (OP_STEP, 3, 1, b"", True), (OP_STATS, 4, 2, b"ok", False)]
    assert calls == [0, 2] and not dec.has_partial
