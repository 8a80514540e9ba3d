"""Decoders view the frame, encoders write in place (docs/contract.md sections 7.3, 7.4)."""

from __future__ import annotations

import numpy as np
import pytest

from protocol.constants import APP_HEADER_SIZE, OP_STEP, RPF_MARGIN, RPF_SAMPLED
from protocol.errors import BadFrameError
from protocol.framing import FrameDecoder, frame, split_frame
from protocol.header import AppHeader
from protocol.messages import (
    ENTRY_DTYPE,
    ReqEntry,
    StepReply,
    decode_step,
    pack_step,
    pack_step_prefix,
    reply_layout,
    rows_offset_for,
)

ROW_BYTES = 32
ENTRIES = [
    ReqEntry(slot=0, generation=1, anchor_pos=9, anchor_token=1, n_rows=3, flags=1),
    ReqEntry(slot=4, generation=2, anchor_pos=5, anchor_token=2, n_rows=2, n_out=1, flags=3),
]
N_ROWS = 5
ROWS = bytes(range(N_ROWS * ROW_BYTES))


def _step_frame() -> bytearray:
    """A received STEP frame in a buffer of its own (as a transport's receive buffer)."""
    return bytearray(frame(OP_STEP, 3, 7, pack_step(11, ENTRIES, ROWS, ROW_BYTES)))


def test_decode_step_views_the_frame() -> None:
    buf = _step_frame()
    whole = np.frombuffer(buf, dtype=np.uint8)
    _, body = split_frame(buf)
    view = decode_step(body)
    assert np.shares_memory(view.rows, whole)
    assert np.shares_memory(view.entries, whole)
    assert view.rows.tobytes() == ROWS
    # the rows start where the contract says, 8-byte aligned in the frame
    start = view.rows.__array_interface__["data"][0] - whole.__array_interface__["data"][0]
    assert start == APP_HEADER_SIZE + rows_offset_for(2)
    assert start % 8 == 0
    # a write to the frame shows through the views: they are not copies
    buf[start] = 0xEE
    assert view.rows[0, 0] == 0xEE
    buf[APP_HEADER_SIZE + 32 + 48] = 9  # entry 1's slot, low byte
    assert int(view.entries["slot"][1]) == 9


def test_decode_step_views_a_decoder_frame_storage() -> None:
    storage: list[bytearray] = []

    def alloc(n: int) -> bytearray:
        storage.append(bytearray(n))
        return storage[-1]

    (f,) = FrameDecoder(alloc=alloc).feed(bytes(_step_frame()))
    view = decode_step(f.body)
    whole = np.frombuffer(storage[0], dtype=np.uint8)
    assert np.shares_memory(view.rows, whole) and np.shares_memory(view.entries, whole)


@pytest.mark.parametrize("flags", [0, RPF_MARGIN, RPF_SAMPLED, RPF_MARGIN | RPF_SAMPLED])
def test_step_reply_unpack_views_the_body(flags: int) -> None:
    rep = StepReply.empty(5, 3, 4, flags)
    rep.draft_ids[:] = 7
    rep.finish(1)
    received = bytearray(APP_HEADER_SIZE) + bytearray(rep.pack())  # a reply buffer with header
    whole = np.frombuffer(received, dtype=np.uint8)
    got = StepReply.unpack(memoryview(received)[APP_HEADER_SIZE:])
    arrays = [got.status, got.window_rows, got.generation, got.draft_ids, got.confidence,
              got.margin, got.sampled_mask, got.support_ids, got.proposal_q]
    present = [a for a in arrays if a is not None]
    assert len(present) == 5 + bool(flags & RPF_MARGIN) + 3 * bool(flags & RPF_SAMPLED)
    for a in present:
        assert np.shares_memory(a, whole)
        assert a.__array_interface__["data"][0] % 8 == whole.__array_interface__["data"][0] % 8
    assert (got.draft_ids == 7).all()
    lo = reply_layout(3, 4, flags)
    received[APP_HEADER_SIZE + lo.draft_ids] = 9
    assert got.draft_ids[0, 0] == 9


def test_step_reply_into_fills_the_callers_buffer_in_place() -> None:
    lo = reply_layout(2, 3, RPF_MARGIN)
    buf = bytearray(b"\xa5" * (APP_HEADER_SIZE + lo.size + 16))
    rep = StepReply.into(buf, APP_HEADER_SIZE, 77, 2, 3, RPF_MARGIN)
    whole = np.frombuffer(buf, dtype=np.uint8)
    assert np.shares_memory(rep.draft_ids, whole) and rep.margin is not None
    assert np.shares_memory(rep.margin, whole)
    # the reply's region is zeroed, nothing around it is touched
    assert buf[:APP_HEADER_SIZE] == b"\xa5" * APP_HEADER_SIZE
    assert buf[APP_HEADER_SIZE + lo.size:] == b"\xa5" * 16
    rep.draft_ids[1, 2] = 42
    rep.margin[0, 0] = 0.5
    assert rep.finish(99) == lo.size
    AppHeader(op=OP_STEP, seq=1, session=2, body_len=lo.size).pack_into(buf, 0)
    _, body = split_frame(buf[:APP_HEADER_SIZE + lo.size])
    got = StepReply.unpack(body, expect_n_req=2, expect_num_spec=3)
    assert (got.step_id, got.worker_us, int(got.draft_ids[1, 2])) == (77, 99, 42)
    assert got.margin is not None and float(got.margin[0, 0]) == 0.5


def test_pack_step_prefix_leaves_the_rows_region_alone() -> None:
    ro = rows_offset_for(len(ENTRIES))
    size = APP_HEADER_SIZE + ro + N_ROWS * ROW_BYTES
    buf = bytearray(b"\x5a" * (size + 8))
    got = pack_step_prefix(buf, APP_HEADER_SIZE, 11, ENTRIES, N_ROWS, ROW_BYTES)
    assert got == ro
    assert buf[:APP_HEADER_SIZE] == b"\x5a" * APP_HEADER_SIZE  # the AppHeader is the caller's
    assert buf[APP_HEADER_SIZE + ro:] == b"\x5a" * (N_ROWS * ROW_BYTES + 8)
    prefix = bytes(buf[APP_HEADER_SIZE:APP_HEADER_SIZE + ro])
    assert prefix == pack_step(11, ENTRIES, ROWS, ROW_BYTES)[:ro]
    assert b"\x5a" not in prefix[24:32]  # reserved and padding are written as zeros


def test_pack_step_prefix_into_a_memoryview_slice() -> None:
    """Headers in one buffer, rows in another: the two-part send."""
    ro = rows_offset_for(len(ENTRIES))
    head = bytearray(b"\xff" * (APP_HEADER_SIZE + ro))
    rows = np.frombuffer(ROWS, dtype=np.uint8).reshape(N_ROWS, ROW_BYTES)
    pack_step_prefix(memoryview(head), APP_HEADER_SIZE, 11, ENTRIES, N_ROWS, ROW_BYTES)
    AppHeader(op=OP_STEP, seq=3, session=7, body_len=ro + rows.nbytes).pack_into(head, 0)
    assert bytes(head) + rows.tobytes() == bytes(_step_frame())


def _entries_array(entries: list[ReqEntry]) -> np.ndarray:
    """The entries as an ENTRY_DTYPE array, as an engine that keeps its requests' fields in
    arrays would fill one."""
    out = np.zeros(len(entries), ENTRY_DTYPE)
    for name in ("slot", "generation", "anchor_pos", "anchor_token", "n_rows", "n_out", "flags",
                 "seed", "top_k", "temperature", "top_p"):
        out[name] = [getattr(e, name) & 0xFFFFFFFF if name == "generation" else getattr(e, name)
                     for e in entries]
    return out


def test_pack_step_prefix_takes_an_entries_array() -> None:
    """An ENTRY_DTYPE array goes in whole: the same bytes as the objects give, reserved fields
    written as zeros whatever the array holds there."""
    sampled = [*ENTRIES, ReqEntry(slot=7, generation=(1 << 32) + 5, anchor_pos=2,
                                  anchor_token=3, flags=1, seed=2**64 - 1, top_k=32,
                                  temperature=0.7, top_p=0.9)]
    ro = rows_offset_for(len(sampled))
    want = bytearray(b"\x5a" * (ro + 8))
    pack_step_prefix(want, 0, 11, sampled, N_ROWS, ROW_BYTES)
    arr = _entries_array(sampled)
    arr["reserved0"] = 0xBEEF
    arr["reserved1"] = 7
    got = bytearray(b"\x5a" * (ro + 8))
    assert pack_step_prefix(got, 0, 11, arr, N_ROWS, ROW_BYTES) == ro
    assert got == want
    assert arr["reserved0"][0] == 0xBEEF  # the caller's array is left as it was
    spaced = np.zeros(2 * len(sampled), ENTRY_DTYPE)  # a strided view is copied field by field
    spaced[::2] = arr
    got[:] = b"\x5a" * len(got)
    pack_step_prefix(got, 0, 11, spaced[::2], N_ROWS, ROW_BYTES)
    assert got == want


@pytest.mark.parametrize("bad, words", [
    (lambda a: a.astype([(n, "<f8" if n == "temperature" else a.dtype.fields[n][0])
                         for n in a.dtype.names]), "dtype"),
    (lambda a: a[["slot", "generation"]], "dtype"),
    (lambda a: a.reshape(1, -1), "shape (1, 2)"),
])
def test_pack_step_prefix_refuses_an_entries_array_of_another_layout(bad: object,
                                                                     words: str) -> None:
    buf = bytearray(rows_offset_for(2))
    with pytest.raises(ValueError, match=r"ENTRY_DTYPE") as info:
        pack_step_prefix(buf, 0, 1, bad(_entries_array(ENTRIES)), N_ROWS, ROW_BYTES)  # type: ignore[operator]
    assert words in str(info.value)
    assert buf == bytearray(rows_offset_for(2))  # nothing written


def test_pack_step_prefix_checks_an_entries_arrays_row_count() -> None:
    buf = bytearray(rows_offset_for(2))
    with pytest.raises(ValueError, match="entries carry 5 rows in all, but n_rows is 4"):
        pack_step_prefix(buf, 0, 1, _entries_array(ENTRIES), 4, ROW_BYTES)
    with pytest.raises(ValueError, match="sample_meta"):
        pack_step_prefix(buf, 0, 1, _entries_array(ENTRIES), N_ROWS, ROW_BYTES,
                         sample_meta=[(0, 0, 0.0, 0.0)] * 2)


def _entry(i: int, **kw: int) -> ReqEntry:
    fields = dict(slot=i, generation=10 + i, anchor_pos=20 + i, anchor_token=i, n_rows=1,
                  flags=1)
    fields.update(kw)
    return ReqEntry(**fields)


@pytest.mark.parametrize("field,value", [("anchor_pos", 1 << 32), ("anchor_token", -1),
                                         ("n_out", 1 << 16), ("slot", -3)])
def test_pack_step_prefix_names_the_entry_with_a_field_out_of_range(field: str,
                                                                    value: int) -> None:
    entries = [_entry(i) for i in range(6)]
    entries[4] = _entry(4, **{field: value})
    entries[5] = _entry(5, anchor_pos=-1)  # a second offender, after the first
    with pytest.raises(BadFrameError) as info:
        pack_step_prefix(bytearray(rows_offset_for(6)), 0, 1, entries, 6, ROW_BYTES)
    slot = entries[4].slot
    assert (info.value.entry, info.value.slot) == (4, slot)
    assert f"entry 4 (slot {slot}) has a field out of range" in str(info.value)


@pytest.mark.parametrize("meta", [False, True])
def test_pack_step_prefix_carries_a_generations_low_32_bits(meta: bool) -> None:
    """A generation past 32 bits, or negative, goes out as its low half (as the contract
    says), whichever entry has it, with sample_meta or without."""
    gens = [7, (1 << 32) + 5, -1, (3 << 40) | 9]
    entries = [_entry(i, generation=g) for i, g in enumerate(gens)]
    sample_meta = [(100 + i, 4, 0.5, 0.9) for i in range(4)] if meta else None
    buf = bytearray(rows_offset_for(4))
    pack_step_prefix(buf, 0, 1, entries, 4, ROW_BYTES, sample_meta=sample_meta)
    view = decode_step(buf + bytes(4 * ROW_BYTES)).entries
    assert view["generation"].tolist() == [g & 0xFFFFFFFF for g in gens]
    assert view["anchor_pos"].tolist() == [20, 21, 22, 23]
    assert view["seed"].tolist() == ([100, 101, 102, 103] if meta else [0] * 4)
    assert [e.generation for e in entries] == gens  # the caller's objects are untouched
    with pytest.raises(BadFrameError, match=r"entry 0 .* out of range"):
        pack_step_prefix(buf, 0, 1, entries, 4, ROW_BYTES,
                         sample_meta=[(1, 1 << 16, 0.5, 0.9)] * 4)
