"""Golden frames, byte by byte (docs/contract.md sections 3, 6.1, 7.3, 7.4).

Every vector is written out as hex, field by field, from the contract's tables (not from the
encoder), so these tests check the layout itself. Each frame is decoded three ways (whole, one
byte at a time, and followed by trailing bytes), its fields are checked, and the encoder must
produce exactly the same bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np
import pytest

from protocol import sampled, wire
from protocol.errors import BadFrameError
from protocol.framing import Frame, FrameDecoder, frame, split_frame
from protocol.header import AppHeader
from protocol.messages import (
    Hello,
    HelloReply,
    ReqEntry,
    StepReply,
    decode_step,
    entries_from_view,
    pack_step,
    pack_step_prefix,
    rows_offset_for,
)
from protocol.validate import check_reply_values, check_step_shape

SESSION = 0x11223344
DRAFTER_ID = bytes(range(32))
MARKOV_ID = bytes(range(32, 64))
IDENT_HEX = "000102030405060708090a0b0c0d0e0f 101112131415161718191a1b1c1d1e1f"
MARKOV_HEX = "202122232425262728292a2b2c2d2e2f 303132333435363738393a3b3c3d3e3f"


def h(text: str) -> bytes:
    """Hex with whitespace between fields (bytes.fromhex skips it)."""
    return bytes.fromhex(text)


# -- section 3: the contract's own example, a PING with session 0 and seq 1 -----------------------
#                 magic    ver  op st session  body_len seq
PING_DOC = h("4453504b 0100 03 00 00000000 00000000 0100000000000000")
# A PING with seq 7: only the seq field differs.
PING = h("4453504b 0100 03 00 00000000 00000000 0700000000000000")
# A STEP refused with ST_BAD_FRAME (16): empty body, status byte at offset 7.
STEP_REFUSED = h("4453504b 0100 02 10 44332211 00000000 0300000000000000")

# -- section 6.1: HELLO, 160 bytes ----------------------------------------------------------------
HELLO = h(
    "4453504b 0100 01 00 44332211 a0000000 0100000000000000"  # AppHeader, body_len 160
    "0100"  # 0 version 1
    "01"  # 2 sample_mode SAMPLE_TOP32
    "01"  # 3 tap_dtype TAPS_BF16
    "4000"  # 4 window 64
    "0400"  # 6 num_spec 4
    "08000000"  # 8 max_slots 8
    "00020000"  # 12 max_rows_per_step 512
    "60000000"  # 16 row_bytes 96 = 3 taps * 16 hidden * 2
    "e8030000"  # 20 vocab_size 1000
    "0300"  # 24 n_taps 3
    "0000"  # 26 flags 0
    "10000000"  # 28 hidden 16
    + IDENT_HEX  # 32 drafter_identity
    + MARKOV_HEX  # 64 markov_identity
    + "656e672d61" + "00" * 27  # 96 client_name "eng-a", NUL padded
    + "aa" * 32  # 128 auth_tag
)

# -- section 6.1: HelloReply, 128 bytes -----------------------------------------------------------
HELLO_REPLY = h(
    "4453504b 0100 01 00 44332211 80000000 0100000000000000"  # AppHeader, body_len 128
    "0100"  # 0 version 1
    "0700"  # 2 capabilities TAPS_BF16 | TOP32 | MARGIN
    "4000"  # 4 window 64
    "0400"  # 6 num_spec 4
    "10000000"  # 8 max_slots 16
    "00040000"  # 12 max_rows_per_step 1024
    "60000000"  # 16 row_bytes 96
    "e8030000"  # 20 vocab_size 1000
    + IDENT_HEX  # 24 drafter_identity
    + MARKOV_HEX  # 56 markov_identity
    + "7730" + "00" * 30  # 88 worker_name "w0"
    + "01"  # 120 resumed
    + "00"  # 121 reserved
    + "0300"  # 122 n_taps 3
    + "10000000"  # 124 hidden 16 (row_bytes 96 = 3 * 16 * 2)
)

# -- section 7.3: a STEP with 2 entries and 3 rows of 4 bytes (body 32 + 2 * 48 + 12 = 140) -------
STEP = h(
    "4453504b 0100 02 00 44332211 8c000000 0200000000000000"  # AppHeader, seq 2, body_len 140
    # StepHeader: step_id 9, n_req 2, n_rows 3, row_bytes 4, step_flags 0, reserved 0
    "0900000000000000 02000000 03000000 04000000 00000000 0000000000000000"
    # entry 0: slot 3, generation 0x1_00000005 on the wire as 5, anchor_pos 10, anchor_token 777,
    # n_rows 1, n_out 0, flags NEED_DRAFT|RESET, seed 0x0123456789abcdef, top_k 8, reserved,
    # temperature 0.5, top_p 0.75, reserved
    "03000000 05000000 0a000000 09030000 01000000 0000 0300"
    "efcdab8967452301 0800 0000 0000003f 0000403f 00000000"
    # entry 1: slot 0, generation 2, anchor_pos 4, anchor_token 5, n_rows 2, n_out 2,
    # flags NEED_DRAFT, greedy (sampling fields 0)
    "00000000 02000000 04000000 05000000 02000000 0200 0100"
    "0000000000000000 0000 0000 00000000 00000000 00000000"
    # rows, entry by entry: entry 0's one row, then entry 1's two
    "a0a1a2a3 b0b1b2b3 c0c1c2c3"
)
STEP_ENTRIES = [
    ReqEntry(slot=3, generation=(1 << 32) | 5, anchor_pos=10, anchor_token=777, n_rows=1,
             n_out=0, flags=3, seed=0x0123456789ABCDEF, top_k=8, temperature=0.5, top_p=0.75),
    ReqEntry(slot=0, generation=2, anchor_pos=4, anchor_token=5, n_rows=2, n_out=2, flags=1),
]
STEP_ROWS = h("a0a1a2a3 b0b1b2b3 c0c1c2c3")

# -- section 7.4: a greedy StepReply with margins, n = 2, N = 3 (body 120) ------------------------
GREEDY_REPLY = h(
    "4453504b 0100 02 00 44332211 78000000 0200000000000000"  # AppHeader, body_len 120
    # ReplyHeader: step_id 9, n_req 2, num_spec 3, flags RPF_MARGIN, worker_us 1234, reserved
    "0900000000000000 02000000 0300 0100 d2040000 00000000"
    "00 01 000000000000"  # 24 status [OK, PARTIAL_WINDOW], padded to 32
    "0a00 0300 00000000"  # 32 window_rows [10, 3], padded to 40
    "05000000 02000000"  # 40 generation [5, 2]
    "0b000000 0c000000 0d000000 15000000 16000000 00000000"  # 48 draft_ids [[11,12,13],[21,22,0]]
    "0000003f 0000803e 0000803f 0000403f 0000003e 00000000"  # 72 confidence .5 .25 1 .75 .125 0
    "00000040 0000003f 00000000 0000c03f 0000803e 00000000"  # 96 margin 2 .5 0 1.5 .25 0
)
GREEDY_ENTRIES = [
    ReqEntry(slot=3, generation=(1 << 32) | 5, anchor_pos=10, anchor_token=777, n_rows=1,
             flags=3),
    ReqEntry(slot=0, generation=2, anchor_pos=4, anchor_token=5, n_rows=2, n_out=2, flags=1),
]

# -- sections 7.4 and 9: a sampled StepReply, n = 1, N = 1, no margin (body 328) -----------------
SAMPLED_SEED = 0x0123456789ABCDEF
SAMPLED_REPLY = h(
    "4453504b 0100 02 00 44332211 48010000 0400000000000000"  # AppHeader, seq 4, body_len 328
    # ReplyHeader: step_id 10, n_req 1, num_spec 1, flags RPF_SAMPLED, worker_us 0, reserved
    "0a00000000000000 01000000 0100 0200 00000000 00000000"
    "00 00000000000000"  # 24 status [OK]
    "0a00 000000000000"  # 32 window_rows [10]
    "05000000 00000000"  # 40 generation [5]
    "07000000 00000000"  # 48 draft_ids [[7]]
    "0000003f 00000000"  # 56 confidence [[0.5]]
    "01 00000000000000"  # 64 sampled_mask [1]
    "07000000 03000000" + "00000000" * 30  # 72 support_ids [[[7, 3, 0...]]]
    + "0000c000 00004000" + "00000000" * 30  # 200 proposal_q [[[0xc00000, 0x400000, 0...]]]
)
SAMPLED_ENTRIES = [
    ReqEntry(slot=3, generation=5, anchor_pos=10, anchor_token=777, n_rows=0, flags=1,
             seed=SAMPLED_SEED, top_k=2, temperature=1.0, top_p=0.0),
]


# -- what each body must decode to --------------------------------------------------------------
def check_empty(body: memoryview) -> None:
    assert len(body) == 0


def check_hello(body: memoryview) -> None:
    hello = Hello.unpack(body)
    assert (hello.version, hello.sample_mode, hello.tap_dtype) == (1, 1, 1)
    assert (hello.window, hello.num_spec) == (64, 4)
    assert (hello.max_slots, hello.max_rows_per_step) == (8, 512)
    assert (hello.row_bytes, hello.vocab_size, hello.n_taps, hello.hidden) == (96, 1000, 3, 16)
    assert hello.row_bytes == hello.n_taps * hello.hidden * 2
    assert hello.drafter_identity == DRAFTER_ID
    assert hello.markov_identity == MARKOV_ID
    assert hello.client_name == "eng-a"
    assert hello.auth_tag == b"\xaa" * 32


def check_hello_reply(body: memoryview) -> None:
    rep = HelloReply.unpack(body)
    assert (rep.version, rep.capabilities, rep.window, rep.num_spec) == (1, 7, 64, 4)
    assert (rep.max_slots, rep.max_rows_per_step) == (16, 1024)
    assert (rep.row_bytes, rep.vocab_size) == (96, 1000)
    assert rep.drafter_identity == DRAFTER_ID
    assert rep.markov_identity == MARKOV_ID
    assert rep.worker_name == "w0"
    assert rep.resumed == 1
    assert (rep.n_taps, rep.hidden) == (3, 16)


def check_step(body: memoryview) -> None:
    view = decode_step(body)
    hd = view.header
    assert (hd.step_id, hd.n_req, hd.n_rows, hd.row_bytes, hd.step_flags, hd.reserved) == (
        9, 2, 3, 4, 0, 0)
    e = view.entries
    assert e["slot"].tolist() == [3, 0]
    assert e["generation"].tolist() == [5, 2]  # the wire carries generation & 0xFFFFFFFF
    assert e["anchor_pos"].tolist() == [10, 4]
    assert e["anchor_token"].tolist() == [777, 5]
    assert e["n_rows"].tolist() == [1, 2]
    assert e["n_out"].tolist() == [0, 2]
    assert e["flags"].tolist() == [3, 1]
    assert e["seed"].tolist() == [0x0123456789ABCDEF, 0]
    assert e["top_k"].tolist() == [8, 0]
    assert e["temperature"].tolist() == [0.5, 0.0]
    assert e["top_p"].tolist() == [0.75, 0.0]
    assert e["reserved0"].tolist() == [0, 0]
    assert e["reserved1"].tolist() == [0, 0]
    masked = [ReqEntry(**{**_fields(x), "generation": x.generation & 0xFFFFFFFF})
              for x in STEP_ENTRIES]
    assert entries_from_view(e) == masked
    assert view.rows.shape == (3, 4)
    assert view.rows[0].tobytes() == h("a0a1a2a3")  # entry 0's row
    assert view.rows[1:3].tobytes() == h("b0b1b2b3 c0c1c2c3")  # entry 1's rows
    # A sampled session with N = 4 accepts it.
    check_step_shape(view, row_bytes=4, max_slots=8, max_rows_per_step=16, num_spec=4,
                     sampled=True)


def check_greedy_reply(body: memoryview) -> None:
    rep = StepReply.unpack(body, expect_n_req=2, expect_num_spec=3)
    assert (rep.step_id, rep.n_req, rep.num_spec, rep.flags, rep.worker_us) == (9, 2, 3, 1, 1234)
    assert rep.status.tolist() == [0, 1]
    assert rep.window_rows.tolist() == [10, 3]
    assert rep.generation.tolist() == [5, 2]
    assert rep.draft_ids.tolist() == [[11, 12, 13], [21, 22, 0]]
    assert rep.confidence.tolist() == [[0.5, 0.25, 1.0], [0.75, 0.125, 0.0]]
    assert rep.margin is not None
    assert rep.margin.tolist() == [[2.0, 0.5, 0.0], [1.5, 0.25, 0.0]]
    assert rep.sampled_mask is None and rep.support_ids is None and rep.proposal_q is None
    ks = check_reply_values(rep, GREEDY_ENTRIES, vocab_size=100, window=64)
    assert list(ks) == [3, 2]


def check_sampled_reply(body: memoryview) -> None:
    rep = StepReply.unpack(body, expect_n_req=1, expect_num_spec=1)
    assert (rep.step_id, rep.n_req, rep.num_spec, rep.flags, rep.worker_us) == (10, 1, 1, 2, 0)
    assert rep.status.tolist() == [0]
    assert rep.window_rows.tolist() == [10]
    assert rep.generation.tolist() == [5]
    assert rep.draft_ids.tolist() == [[7]]
    assert rep.confidence.tolist() == [[0.5]]
    assert rep.margin is None
    assert rep.sampled_mask is not None and rep.support_ids is not None
    assert rep.proposal_q is not None
    assert rep.sampled_mask.tolist() == [1]
    assert rep.support_ids.shape == (1, 1, 32) and rep.proposal_q.shape == (1, 1, 32)
    assert rep.support_ids[0, 0].tolist() == [7, 3] + [0] * 30
    assert rep.proposal_q[0, 0].tolist() == [0xC00000, 0x400000] + [0] * 30
    assert int(rep.proposal_q.sum()) == 1 << 24
    sampled.validate(rep.sampled_mask, rep.support_ids, rep.proposal_q, rep.draft_ids,
                     np.array([True]), 1000, np.array([2]))
    # the draft re-derives: u(seed, generation 5, position anchor_pos + 1 = 11) < 0xc00000
    assert int(sampled.draw_u(SAMPLED_SEED, 5, 11)) == 0xA3B44F
    sampled.check_draws(rep.sampled_mask, rep.support_ids, rep.proposal_q, rep.draft_ids,
                        np.array([SAMPLED_SEED], dtype=np.uint64), np.array([5]),
                        np.array([10]))
    check_reply_values(rep, SAMPLED_ENTRIES, vocab_size=1000, window=64)


def _fields(e: ReqEntry) -> dict[str, Any]:
    return {f: getattr(e, f) for f in e.__struct_fields__}


# -- what each vector must be, and how it is built ---------------------------------------------
def build_ping_doc() -> bytes:
    return frame(3, 1, 0)


def build_ping() -> bytes:
    return frame(3, 7, 0)


def build_step_refused() -> bytes:
    return AppHeader(op=2, seq=3, session=SESSION, status=16).pack()


def build_hello() -> bytes:
    hello = Hello(sample_mode=1, window=64, num_spec=4, max_slots=8, max_rows_per_step=512,
                  row_bytes=96, vocab_size=1000, n_taps=3, hidden=16,
                  drafter_identity=DRAFTER_ID, markov_identity=MARKOV_ID, client_name="eng-a",
                  auth_tag=b"\xaa" * 32)
    return frame(1, 1, SESSION, hello.pack())


def build_hello_reply() -> bytes:
    rep = HelloReply(capabilities=7, window=64, num_spec=4, max_slots=16,
                     max_rows_per_step=1024, row_bytes=96, vocab_size=1000,
                     drafter_identity=DRAFTER_ID, markov_identity=MARKOV_ID, worker_name="w0",
                     resumed=1, n_taps=3, hidden=16)
    return frame(1, 1, SESSION, rep.pack())


def build_step() -> bytes:
    return frame(2, 2, SESSION, pack_step(9, STEP_ENTRIES, STEP_ROWS, 4))


def build_greedy_reply() -> bytes:
    rep = StepReply.empty(9, 2, 3, 1)
    rep.status[:] = [0, 1]
    rep.window_rows[:] = [10, 3]
    rep.generation[:] = [5, 2]
    rep.draft_ids[:] = [[11, 12, 13], [21, 22, 0]]
    rep.confidence[:] = [[0.5, 0.25, 1.0], [0.75, 0.125, 0.0]]
    assert rep.margin is not None
    rep.margin[:] = [[2.0, 0.5, 0.0], [1.5, 0.25, 0.0]]
    size = rep.finish(1234)
    return frame(2, 2, SESSION, rep.pack()[:size])


def build_sampled_reply() -> bytes:
    rep = StepReply.empty(10, 1, 1, 2)
    rep.window_rows[:] = [10]
    rep.generation[:] = [5]
    rep.confidence[:] = [[0.5]]
    assert rep.sampled_mask is not None and rep.support_ids is not None
    assert rep.proposal_q is not None
    rep.sampled_mask[:] = [1]
    logits = np.full(1000, -50.0)
    logits[7], logits[3] = np.log(3.0), 0.0  # p = [0.75, 0.25] over ids 7 and 3
    ids, q = sampled.build_q(logits, top_k=2, temperature=1.0)
    rep.support_ids[0, 0], rep.proposal_q[0, 0] = ids, q
    u = sampled.draw_u(SAMPLED_SEED, 5, 11)
    rep.draft_ids[0, 0] = sampled.draw(ids, q, u)
    rep.finish(0)
    return frame(2, 4, SESSION, rep.pack())


Vector = tuple[bytes, tuple[int, int, int, int, int], Callable[[memoryview], None],
               Callable[[], bytes]]
#            frame, (op, status, session, seq, body_len), body check, encoder
VECTORS: dict[str, Vector] = {
    "ping_doc": (PING_DOC, (3, 0, 0, 1, 0), check_empty, build_ping_doc),
    "ping": (PING, (3, 0, 0, 7, 0), check_empty, build_ping),
    "step_refused": (STEP_REFUSED, (2, 16, SESSION, 3, 0), check_empty, build_step_refused),
    "hello": (HELLO, (1, 0, SESSION, 1, 160), check_hello, build_hello),
    "hello_reply": (HELLO_REPLY, (1, 0, SESSION, 1, 128), check_hello_reply, build_hello_reply),
    "step": (STEP, (2, 0, SESSION, 2, 140), check_step, build_step),
    "greedy_reply": (GREEDY_REPLY, (2, 0, SESSION, 2, 120), check_greedy_reply,
                     build_greedy_reply),
    "sampled_reply": (SAMPLED_REPLY, (2, 0, SESSION, 4, 328), check_sampled_reply,
                      build_sampled_reply),
}
NAMES = list(VECTORS)


def _check_header(hd: AppHeader, want: tuple[int, int, int, int, int]) -> None:
    assert hd.magic == 0x4B505344
    assert hd.version == 1
    assert (hd.op, hd.status, hd.session, hd.seq, hd.body_len) == want


def test_vector_lengths() -> None:
    assert len(PING) == 24
    assert len(HELLO) == 24 + 160
    assert len(HELLO_REPLY) == 24 + 128
    assert len(STEP) == 24 + 140
    assert len(GREEDY_REPLY) == 24 + 120
    assert len(SAMPLED_REPLY) == 24 + 328
    assert PING[:4] == b"DSPK"


@pytest.mark.parametrize("name", NAMES)
def test_encoder_writes_the_vector(name: str) -> None:
    data, _, _, build = VECTORS[name]
    assert build().hex() == data.hex()


@pytest.mark.parametrize("name", NAMES)
def test_decode_whole(name: str) -> None:
    data, want, check, _ = VECTORS[name]
    hd, body = split_frame(data)
    _check_header(hd, want)
    assert len(body) == want[4]
    check(body)


@pytest.mark.parametrize("name", NAMES)
def test_decode_one_byte_at_a_time(name: str) -> None:
    data, want, check, _ = VECTORS[name]
    dec = FrameDecoder()
    got: list[Frame] = []
    for i in range(len(data)):
        frames = dec.feed(data[i:i + 1])
        if i < len(data) - 1:
            assert frames == []
            assert dec.has_partial
            assert dec.partial_bytes == i + 1
        got.extend(frames)
    assert len(got) == 1
    assert not dec.has_partial and dec.partial_bytes == 0
    _check_header(got[0].header, want)
    assert bytes(got[0].body) == data[24:]
    check(got[0].body)


# Trailing bytes: the start of another frame, cut inside its header, and inside its body.
TRAILERS = {"in_header": STEP[:10], "in_body": STEP[:24 + 37]}


@pytest.mark.parametrize("trail", list(TRAILERS))
@pytest.mark.parametrize("name", NAMES)
def test_decode_with_trailing_bytes(name: str, trail: str) -> None:
    data, want, check, _ = VECTORS[name]
    rest = TRAILERS[trail]
    stream = bytearray(data + rest)
    before = bytes(stream)
    dec = FrameDecoder()
    frames = dec.feed(stream)
    assert bytes(stream) == before  # the caller's bytes are left as they were
    assert len(frames) == 1
    _check_header(frames[0].header, want)
    check(frames[0].body)
    # the trailing bytes stay in the decoder as a partial frame, and complete it later
    assert dec.has_partial
    assert dec.partial_bytes == len(rest)
    more = dec.feed(STEP[len(rest):])
    assert len(more) == 1
    assert not dec.has_partial
    _check_header(more[0].header, VECTORS["step"][1])
    check_step(more[0].body)
    # the first frame's body is its own: the second frame did not overwrite it
    assert bytes(frames[0].body) == data[24:]
    # a header reads the same with bytes after it; split_frame wants the frame alone
    _check_header(AppHeader.unpack(bytes(stream)), want)
    with pytest.raises(BadFrameError) as info:
        split_frame(bytes(stream))
    assert info.value.field == "body_len"
    assert info.value.value == want[4]
    assert info.value.limit == want[4] + len(rest)


def test_all_vectors_in_one_stream() -> None:
    stream = b"".join(VECTORS[name][0] for name in NAMES)
    frames = FrameDecoder().feed(stream)
    assert [f.header.seq for f in frames] == [VECTORS[n][1][3] for n in NAMES]
    for f, name in zip(frames, NAMES, strict=True):
        _, want, check, _ = VECTORS[name]
        _check_header(f.header, want)
        check(f.body)


def test_step_prefix_in_front_of_staged_rows() -> None:
    """The seed client's hot path: rows staged behind a gap, headers written in front."""
    ro = rows_offset_for(2)
    assert ro == 32 + 2 * 48
    buf = bytearray(24 + ro + len(STEP_ROWS))
    buf[24 + ro:] = STEP_ROWS
    got = pack_step_prefix(buf, 24, 9, STEP_ENTRIES, 3, 4)
    assert got == ro
    AppHeader(op=2, seq=2, session=SESSION, body_len=ro + 12).pack_into(buf, 0)
    assert bytes(buf).hex() == STEP.hex()
    assert (24 + ro) % 8 == 0  # the rows start 8-byte aligned in the frame


def test_hello_flags_at_offset_26() -> None:
    """HF_SYNTHETIC and HF_FOLLOW travel in the u16 at offset 26 (6.1, 6.5); a bit the
    contract does not define is refused both ways, naming the field."""
    body = HELLO[24:]
    synthetic = Hello.unpack(body[:26] + b"\x01\x00" + body[28:])
    assert synthetic.flags == wire.HF_SYNTHETIC
    assert synthetic.pack() == body[:26] + b"\x01\x00" + body[28:]
    assert Hello.unpack(body[:26] + b"\x02\x00" + body[28:]).flags == wire.HF_FOLLOW
    assert Hello.unpack(body).flags == 0
    with pytest.raises(BadFrameError, match="flags 0x0004") as info:
        Hello.unpack(body[:26] + b"\x04\x00" + body[28:])
    assert info.value.field == "flags" and info.value.value == 4
    with pytest.raises(BadFrameError, match="flags 0x8001"):
        msgspec.structs.replace(synthetic, flags=0x8001).pack()
