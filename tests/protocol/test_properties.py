"""Properties (hypothesis): every message round-trips, and arbitrary bytes either decode or raise
the protocol's own error, never anything else (the h11 fuzz invariant, STYLE.md)."""

from __future__ import annotations

import contextlib
import itertools
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from protocol import sampled
from protocol.constants import APP_HEADER_SIZE, MAX_TOP_K, RPF_MARGIN, RPF_SAMPLED
from protocol.errors import BadFrameError, ReplyValueError, WireError
from protocol.framing import Frame, FrameDecoder, frame
from protocol.header import AppHeader
from protocol.messages import (
    HELLO_REP,
    HELLO_STRUCT,
    REPLY_HEADER_STRUCT,
    STEP_HEADER_STRUCT,
    Hello,
    HelloReply,
    ReqEntry,
    StepReply,
    decode_reset,
    decode_step,
    entries_from_view,
    pack_reset,
    pack_step,
    pack_step_prefix,
    reply_layout,
    rows_offset_for,
)
from protocol.validate import check_reply_values, check_step_shape

# On a failure hypothesis imports libcst (when installed), which touches the deprecated
# mypy_extensions.TypedDict: under filterwarnings=error that warning would replace the failure
# report (and its falsifying example) with a pytest INTERNALERROR.
pytestmark = pytest.mark.filterwarnings(
    "ignore:mypy_extensions.TypedDict is deprecated:DeprecationWarning")

PROPS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

u8 = st.integers(0, 2**8 - 1)
u16 = st.integers(0, 2**16 - 1)
u32 = st.integers(0, 2**32 - 1)
u64 = st.integers(0, 2**64 - 1)
blob32 = st.binary(min_size=32, max_size=32)
# at most 8 characters of at most 4 UTF-8 bytes each: always fits the 32-byte field
names = st.text(alphabet=st.characters(exclude_categories=("Cs",), exclude_characters="\0"),
                max_size=8)
f32 = st.floats(width=32, allow_nan=False)

headers = st.builds(AppHeader, op=u8, seq=u64, session=u32, body_len=u32, status=u8,
                    version=u16)
hellos = st.builds(Hello, sample_mode=u8, window=u16, num_spec=u16, max_slots=u32,
                   max_rows_per_step=u32, row_bytes=u32, vocab_size=u32, n_taps=u16,
                   hidden=u32, drafter_identity=blob32, markov_identity=blob32,
                   client_name=names, auth_tag=blob32, tap_dtype=u8, version=u16)
hello_replies = st.builds(HelloReply, capabilities=u16, window=u16, num_spec=u16,
                          max_slots=u32, max_rows_per_step=u32, row_bytes=u32, vocab_size=u32,
                          drafter_identity=blob32, markov_identity=blob32, worker_name=names,
                          resumed=u8, n_taps=u16, hidden=u32, version=u16)
entries = st.builds(ReqEntry, slot=u32, generation=st.integers(0, 2**40), anchor_pos=u32,
                    anchor_token=u32, n_rows=st.integers(0, 3), n_out=u16, flags=u16,
                    seed=u64, top_k=u16, temperature=f32, top_p=f32)


# -- round trips ----------------------------------------------------------------------------------
@PROPS
@given(headers)
def test_app_header_round_trip(hd: AppHeader) -> None:
    raw = hd.pack()
    assert len(raw) == APP_HEADER_SIZE
    assert AppHeader.unpack(raw) == hd
    assert AppHeader.unpack(b"pad" + raw, 3) == hd


@PROPS
@given(hellos)
def test_hello_round_trip(hello: Hello) -> None:
    raw = hello.pack()
    assert len(raw) == HELLO_STRUCT.size == 160
    assert Hello.unpack(raw) == hello


@PROPS
@given(hello_replies)
def test_hello_reply_round_trip(rep: HelloReply) -> None:
    raw = rep.pack()
    assert len(raw) == HELLO_REP.size == 128
    assert HelloReply.unpack(raw) == rep


@PROPS
@given(st.lists(entries, max_size=6), u64, st.integers(0, 9), u32, st.booleans(),
       st.integers(0, 40))
def test_step_round_trip(ents: list[ReqEntry], step_id: int, row_bytes: int, step_flags: int,
                         use_meta: bool, offset: int) -> None:
    n_rows = sum(e.n_rows for e in ents)
    ro = rows_offset_for(len(ents))
    rows = bytes((i * 31 + 7) % 256 for i in range(n_rows * row_bytes))
    buf = bytearray(offset + ro + len(rows))
    buf[offset + ro:] = rows
    meta = [(e.seed, e.top_k, e.temperature, e.top_p) for e in ents] if use_meta else None
    plain = [ReqEntry(e.slot, e.generation, e.anchor_pos, e.anchor_token, e.n_rows, e.n_out,
                      e.flags) for e in ents]
    got = pack_step_prefix(buf, offset, step_id, plain if use_meta else ents, n_rows, row_bytes,
                           step_flags, sample_meta=meta)
    assert got == ro
    view = decode_step(memoryview(buf)[offset:])
    hd = view.header
    assert (hd.step_id, hd.n_req, hd.n_rows, hd.row_bytes, hd.step_flags, hd.reserved) == (
        step_id, len(ents), n_rows, row_bytes, step_flags, 0)
    masked = [ReqEntry(e.slot, e.generation & 0xFFFFFFFF, e.anchor_pos, e.anchor_token,
                       e.n_rows, e.n_out, e.flags, e.seed, e.top_k, e.temperature, e.top_p)
              for e in ents]
    assert entries_from_view(view.entries) == masked
    assert view.rows.tobytes() == rows
    assert view.rows.shape == (n_rows, row_bytes)


@PROPS
@given(st.integers(0, 4), st.integers(0, 5), st.integers(0, 3), u64, st.integers(-5, 2**33),
       st.data())
def test_step_reply_round_trip(n: int, N: int, flags: int, step_id: int, worker_us: int,
                               data: st.DataObject) -> None:
    rep = StepReply.empty(step_id, n, N, flags)
    rep.status[:] = data.draw(arrays(np.uint8, (n,)))
    rep.window_rows[:] = data.draw(arrays(np.uint16, (n,)))
    rep.generation[:] = data.draw(arrays(np.uint32, (n,)))
    rep.draft_ids[:] = data.draw(arrays(np.int32, (n, N)))
    rep.confidence[:] = data.draw(arrays(np.float32, (n, N)))
    if flags & RPF_MARGIN:
        assert rep.margin is not None
        rep.margin[:] = data.draw(arrays(np.float32, (n, N)))
    else:
        assert rep.margin is None
    if flags & RPF_SAMPLED:
        assert rep.sampled_mask is not None and rep.support_ids is not None
        assert rep.proposal_q is not None
        rep.sampled_mask[:] = data.draw(arrays(np.uint8, (n,)))
        rep.support_ids[:] = data.draw(arrays(np.int32, (n, N, MAX_TOP_K)))
        rep.proposal_q[:] = data.draw(arrays(np.uint32, (n, N, MAX_TOP_K)))
    else:
        assert rep.sampled_mask is None and rep.support_ids is None and rep.proposal_q is None
    size = rep.finish(worker_us)
    body = rep.pack()
    assert size == len(body) == reply_layout(n, N, flags).size
    assert size % 8 == 0
    got = StepReply.unpack(body, expect_n_req=n, expect_num_spec=N)
    assert got == rep
    assert (got.step_id, got.n_req, got.num_spec, got.flags) == (step_id, n, N, flags)
    assert got.worker_us == min(max(worker_us, 0), 2**32 - 1)
    for name in ("status", "window_rows", "generation", "draft_ids", "confidence", "margin",
                 "sampled_mask", "support_ids", "proposal_q"):
        a, b = getattr(rep, name), getattr(got, name)
        assert (a is None) == (b is None)
        if a is not None:
            assert a.dtype == b.dtype and a.shape == b.shape
            assert a.tobytes() == b.tobytes()  # bitwise: NaN payloads included


@PROPS
@given(st.lists(u32, max_size=64))
def test_reset_round_trip(slots: list[int]) -> None:
    body = pack_reset(slots)
    assert len(body) == 4 + 4 * len(slots)
    assert struct.unpack_from("<I", body)[0] == len(slots)
    assert decode_reset(body) == slots


# -- the decoder on arbitrary streams -------------------------------------------------------------
valid_frames = st.builds(lambda op, seq, session, body: frame(op, seq, session, body),
                         u8, u64, u32, st.binary(max_size=80))


@st.composite
def streams(draw: st.DrawFn) -> bytes:
    """Valid frames, some damaged (a flipped byte, a cut), some random bytes between them."""
    parts = []
    for piece in draw(st.lists(st.one_of(valid_frames, st.binary(max_size=40)), max_size=6)):
        raw = bytearray(piece)
        if raw and draw(st.booleans()):
            i = draw(st.integers(0, len(raw) - 1))
            raw[i] ^= draw(st.integers(1, 255))
        parts.append(bytes(raw))
    return b"".join(parts)


def _feed_chunks(dec: FrameDecoder, data: bytes, cuts: list[int]) -> list[Frame]:
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    out: list[Frame] = []
    for a, b in itertools.pairwise(points):
        out.extend(dec.feed(data[a:b]))
    return out


@FUZZ
@given(st.one_of(streams(), st.binary(max_size=300)), st.lists(st.integers(0, 10**6),
       max_size=12), st.integers(0, 120))
def test_decoder_on_arbitrary_bytes_gives_frames_or_wire_errors(
        data: bytes, cuts: list[int], max_body: int) -> None:
    dec = FrameDecoder(max_body=max_body)
    try:
        frames = _feed_chunks(dec, data, cuts)
    except WireError as exc:
        assert dec.error is exc
        with pytest.raises(WireError):
            dec.feed(b"\0")
        return
    # no error: the frames do not depend on how the stream was cut
    whole = FrameDecoder(max_body=max_body).feed(data)
    assert [(f.header, bytes(f.body)) for f in frames] == [
        (f.header, bytes(f.body)) for f in whole]
    assert sum(24 + f.header.body_len for f in frames) + dec.partial_bytes == len(data)


@PROPS
@given(st.lists(valid_frames, min_size=1, max_size=8), st.lists(st.integers(0, 10**6),
       max_size=12))
def test_valid_streams_decode_whole_under_any_chunking(
        frames_in: list[bytes], cuts: list[int]) -> None:
    data = b"".join(frames_in)
    dec = FrameDecoder()
    got = _feed_chunks(dec, data, cuts)
    assert [AppHeader.unpack(f) for f in frames_in] == [f.header for f in got]
    assert [f[24:] for f in frames_in] == [bytes(f.body) for f in got]
    assert not dec.has_partial


# -- body decoders on arbitrary bytes -------------------------------------------------------------
@FUZZ
@given(st.one_of(st.binary(max_size=300), st.binary(min_size=160, max_size=160),
                 st.binary(min_size=128, max_size=128)))
def test_hello_decoders_raise_only_wire_errors(body: bytes) -> None:
    for decode in (Hello.unpack, HelloReply.unpack):
        with contextlib.suppress(WireError):
            decode(body)


@FUZZ
@given(st.binary(max_size=200))
def test_reset_decoder_raises_only_wire_errors(body: bytes) -> None:
    try:
        slots = decode_reset(body)
    except WireError:
        return
    assert pack_reset(slots) == body


@st.composite
def step_bodies(draw: st.DrawFn) -> bytes:
    """A StepHeader with small counts and a body of about the length it needs."""
    n_req, n_rows, row_bytes = draw(st.integers(0, 5)), draw(st.integers(0, 6)), draw(
        st.integers(0, 8))
    hd = STEP_HEADER_STRUCT.pack(draw(u64), n_req, n_rows, row_bytes,
                                 draw(st.sampled_from([0, 0, 0, 1])),
                                 draw(st.sampled_from([0, 0, 0, 5])))
    need = rows_offset_for(n_req) - 32 + n_rows * row_bytes
    size = max(0, need + draw(st.sampled_from([0, 0, 0, 0, -1, 1])))
    # entries mostly small numbers, so that many decoded STEPs reach the deeper rules
    rest = draw(st.one_of(st.binary(min_size=size, max_size=size),
                          st.lists(st.sampled_from([0, 0, 0, 1, 2, 4, 0x80, 0xFF]),
                                   min_size=size, max_size=size).map(bytes)))
    return hd + rest


@FUZZ
@given(st.one_of(st.binary(max_size=200), step_bodies()), st.integers(0, 8),
       st.integers(0, 8), st.integers(0, 12), st.integers(0, 6), st.booleans())
def test_step_decoder_and_shape_check_raise_only_wire_errors(
        body: bytes, row_bytes: int, max_slots: int, max_rows: int, num_spec: int,
        is_sampled: bool) -> None:
    try:
        view = decode_step(body)
    except WireError:
        return
    assert view.entries.shape == (view.header.n_req,)
    try:
        check_step_shape(view, row_bytes=row_bytes, max_slots=max_slots,
                         max_rows_per_step=max_rows, num_spec=num_spec, sampled=is_sampled)
    except BadFrameError as exc:
        assert exc.field is not None, f"the search found no offender: {exc}"


@st.composite
def reply_bodies(draw: st.DrawFn) -> bytes:
    n, N = draw(st.integers(0, 3)), draw(st.integers(0, 3))
    flags = draw(st.sampled_from([0, 1, 2, 3, 3, 4, 0x8001]))
    hd = REPLY_HEADER_STRUCT.pack(draw(u64), n, N, flags, draw(u32), 0)
    size = reply_layout(n, N, flags & 3).size - 24 + draw(st.sampled_from([0, 0, 0, -1, 8]))
    size = max(size, 0)
    rest = draw(st.one_of(st.binary(min_size=size, max_size=size),
                          st.lists(st.sampled_from([0, 0, 0, 0, 1, 2, 3, 0x3F, 0x80, 0xFF]),
                                   min_size=size, max_size=size).map(bytes)))
    return hd + rest


@FUZZ
@given(st.one_of(st.binary(max_size=200), reply_bodies()), st.data())
def test_reply_decoder_and_value_checks_raise_only_wire_errors(
        body: bytes, data: st.DataObject) -> None:
    try:
        rep = StepReply.unpack(body)
    except WireError:
        return
    n = rep.n_req
    ents = data.draw(st.lists(st.builds(
        ReqEntry, slot=st.integers(0, 7), generation=st.integers(0, 3),
        anchor_pos=st.integers(0, 4), anchor_token=st.just(0), n_out=st.integers(0, 4),
        flags=st.integers(0, 7)), min_size=n, max_size=n))
    try:
        check_reply_values(rep, ents, vocab_size=data.draw(st.integers(1, 300)),
                           window=data.draw(st.integers(0, 4)))
    except ReplyValueError as exc:
        assert exc.field is not None, f"the search found no offender: {exc}"
    if rep.sampled_mask is not None:
        assert rep.support_ids is not None and rep.proposal_q is not None
        needed = np.array(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)),
                          dtype=bool)
        top_ks = np.array(data.draw(st.lists(st.integers(0, 32), min_size=n, max_size=n)),
                          dtype=np.int64)
        try:
            sampled.validate(rep.sampled_mask, rep.support_ids, rep.proposal_q, rep.draft_ids,
                             needed, 300, top_ks)
        except ReplyValueError as exc:
            assert exc.entry is not None, f"the search found no offender: {exc}"



_WORD_VALUES = [0, 1, 2, 3, 4, 7, 8, 32, 33, 0xFFFF, 0x10000, 0x20000, 0x40000, 0x50000,
                0x80000, 0x3F800000, 0x7F800000, 0x7FC00000, 0x80000000, 0xBF800000,
                0xFFFFFFFF]


@FUZZ
@given(st.integers(1, 6), st.integers(1, 8), st.integers(0, 8), st.booleans(), st.data())
def test_step_shape_fast_pass_agrees_with_the_entry_by_entry_search(
        n_req: int, max_slots: int, num_spec: int, is_sampled: bool,
        data: st.DataObject) -> None:
    """The vectorised pass of check_step_shape accepts a STEP exactly when the record-by-record
    search (the rules as written) finds no offender: valid entries with a few words mutated."""
    from protocol.validate import _raise_first_shape

    n_req = min(n_req, max_slots)
    slots = data.draw(st.permutations(range(max_slots)))[:n_req]
    entries = []
    for slot in slots:
        top_k = data.draw(st.sampled_from([0, 1, 32])) if is_sampled else 0
        rows = data.draw(st.integers(0, 2))
        entries.append(ReqEntry(
            slot=slot, generation=data.draw(st.integers(0, 3)),
            anchor_pos=rows + data.draw(st.integers(0, 1)), anchor_token=1, n_rows=rows,
            n_out=data.draw(st.integers(0, num_spec)),
            flags=data.draw(st.sampled_from([0, 1, 2, 3])), seed=9 if is_sampled else 0,
            top_k=top_k, temperature=0.7 if top_k else 0.0, top_p=0.9 if top_k else 0.0))
    n_rows = sum(e.n_rows for e in entries)
    body = bytearray(pack_step(1, entries, bytes(n_rows * 4), 4))
    words = np.frombuffer(body, dtype="<u4", count=12 * n_req, offset=32).reshape(n_req, 12)
    for _ in range(data.draw(st.integers(0, 2))):
        # every word a rule reads except n_rows (the header's total must still match)
        i, j = data.draw(st.integers(0, n_req - 1)), data.draw(st.sampled_from(
            [0, 2, 5, 6, 7, 8, 9, 10, 11]))
        words[i, j] = data.draw(st.one_of(st.integers(0, 4), st.sampled_from(_WORD_VALUES)))
    view = decode_step(bytes(body))
    kw = dict(row_bytes=4, max_slots=max_slots, max_rows_per_step=64, num_spec=num_spec)
    try:
        check_step_shape(view, sampled=is_sampled, **kw)  # type: ignore[arg-type]
        passed = True
    except BadFrameError as exc:
        passed = False
        assert exc.field is not None, f"the vectorised pass refused what the search accepts: {exc}"
    if passed:
        with pytest.raises(BadFrameError) as found:
            _raise_first_shape(view, max_slots, num_spec, is_sampled)
        assert found.value.field is None, f"the vectorised pass accepted an offender: {found.value}"
