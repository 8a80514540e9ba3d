"""The worker's shape rules for a STEP (docs/contract.md section 7.2 step 3):
``protocol.decode_step`` (exact body length) and ``protocol.validate.check_step_shape``."""

from __future__ import annotations

import math
import struct
from collections.abc import Callable
from typing import Any

import msgspec
import pytest

from protocol.constants import RF_NEED_DRAFT, RF_RELEASE, RF_RESET, ST_BAD_FRAME
from protocol.errors import BadFrameError
from protocol.messages import ReqEntry, StepView, decode_step, pack_step
from protocol.validate import check_step_shape

ROW_BYTES, MAX_SLOTS, MAX_ROWS, N = 4, 8, 16, 4

GREEDY = [
    # a resync with NEED_DRAFT, all N positions
    ReqEntry(slot=0, generation=1, anchor_pos=10, anchor_token=1, n_rows=2,
             flags=RF_NEED_DRAFT | RF_RESET),
    # as many rows as anchor_pos allows, n_out < N
    ReqEntry(slot=5, generation=2, anchor_pos=3, anchor_token=2, n_rows=3, n_out=2,
             flags=RF_NEED_DRAFT),
    # a RELEASE: no rows, no NEED_DRAFT
    ReqEntry(slot=2, generation=3, anchor_pos=7, anchor_token=3, flags=RF_RELEASE),
    # rows only
    ReqEntry(slot=7, generation=2**32 + 4, anchor_pos=1, anchor_token=4, n_rows=1),
    # the very first position, n_out == N
    ReqEntry(slot=3, generation=5, anchor_pos=0, anchor_token=5, n_out=N, flags=RF_NEED_DRAFT),
]
SAMPLED = [
    msgspec.structs.replace(GREEDY[0], seed=2**64 - 1, top_k=32, temperature=0.7, top_p=1.0),
    msgspec.structs.replace(GREEDY[1], seed=1, top_k=1, temperature=5.0, top_p=0.0),
    GREEDY[2],
    # a greedy entry in a sampled session may carry a seed: only top_k > 0 entries sample
    msgspec.structs.replace(GREEDY[3], seed=99, temperature=0.0),
    msgspec.structs.replace(GREEDY[4], top_k=4, temperature=1e-3, top_p=0.5),
]


def body_of(entries: list[ReqEntry], step_flags: int = 0) -> bytearray:
    n_rows = sum(e.n_rows for e in entries)
    return bytearray(pack_step(7, entries, bytes(range(n_rows * ROW_BYTES)), ROW_BYTES,
                               step_flags))


def check(body: bytes | bytearray, *, sampled: bool = False, **limits: int) -> StepView:
    view = decode_step(bytes(body))
    kw: dict[str, Any] = {"row_bytes": ROW_BYTES, "max_slots": MAX_SLOTS,
                          "max_rows_per_step": MAX_ROWS, "num_spec": N}
    kw.update(limits)
    check_step_shape(view, sampled=sampled, **kw)
    return view


def with_entry(entries: list[ReqEntry], i: int, **changes: Any) -> list[ReqEntry]:
    out = list(entries)
    out[i] = msgspec.structs.replace(out[i], **changes)
    return out


# -- what passes ----------------------------------------------------------------------------------
def test_a_valid_greedy_step_passes() -> None:
    view = check(body_of(GREEDY))
    assert view.header.n_rows == 6 and view.rows.shape == (6, ROW_BYTES)


def test_a_valid_sampled_step_passes() -> None:
    check(body_of(SAMPLED), sampled=True)


def test_a_greedy_step_passes_on_a_sampled_session() -> None:
    check(body_of(GREEDY), sampled=True)


def test_an_empty_step_passes() -> None:
    check(body_of([]))
    check(body_of([]), sampled=True, max_slots=0, max_rows_per_step=0)


def test_limits_are_inclusive() -> None:
    entries = [ReqEntry(slot=i, generation=1, anchor_pos=4, anchor_token=0, n_rows=4,
                        n_out=N, flags=RF_NEED_DRAFT) for i in range(4)]
    check(body_of(entries), max_slots=4, max_rows_per_step=16)


# -- one test per rule ----------------------------------------------------------------------------
def _patch(entries: list[ReqEntry], fmt: str, offset: int, value: Any,
           extra: bytes = b"") -> Callable[[], bytearray]:
    def build() -> bytearray:
        b = body_of(entries)
        struct.pack_into(fmt, b, offset, value)
        return b + extra
    return build


def _entries(entries: list[ReqEntry], step_flags: int = 0) -> Callable[[], bytearray]:
    return lambda: body_of(entries, step_flags)


E3 = 32 + 3 * 48  # entry 3's offset in the body
# case: body, sampled, limits, field, entry (None: a header rule), value, limit
CASES: dict[str, tuple[Callable[[], bytearray], bool, dict[str, int], str, int | None, Any,
                       Any]] = {
    # row_bytes equals the session's
    "row_bytes": (_entries(GREEDY), False, {"row_bytes": 8}, "row_bytes", None, 4, 8),
    # step_flags are 0 (none are defined)
    "step_flags": (_entries(GREEDY, step_flags=1), False, {}, "step_flags", None, 1, 0),
    # the header's reserved field is 0
    "header_reserved": (_patch(GREEDY, "<Q", 24, 1 << 40), False, {}, "reserved", None,
                        1 << 40, 0),
    # n_req <= max_slots
    "n_req": (_entries(GREEDY), False, {"max_slots": 4}, "n_req", None, 5, 4),
    # n_rows <= max_rows_per_step
    "n_rows_over_limit": (_entries(GREEDY), False, {"max_rows_per_step": 5}, "n_rows", None, 6,
                          5),
    # sum(entry.n_rows) == n_rows
    "n_rows_sum": (_patch(GREEDY, "<I", 12, 7, extra=bytes(ROW_BYTES)), False, {}, "n_rows",
                   None, 6, 7),
    "n_rows_sum_no_entries": (_patch([], "<I", 12, 2, extra=bytes(2 * ROW_BYTES)), False, {},
                              "n_rows", None, 0, 2),
    # slots < max_slots
    "slot_too_large": (_entries(with_entry(GREEDY, 3, slot=MAX_SLOTS)), False, {}, "slot", 3,
                       MAX_SLOTS, MAX_SLOTS),
    "slot_u32_max": (_entries(with_entry(GREEDY, 1, slot=2**32 - 1)), False, {}, "slot", 1,
                     2**32 - 1, MAX_SLOTS),
    # slots distinct
    "slot_repeated": (_entries(with_entry(GREEDY, 3, slot=0)), False, {}, "slot", 3, 0, None),
    # entry.n_rows <= anchor_pos
    "rows_before_position_0": (_entries(with_entry(GREEDY, 1, anchor_pos=2)), False, {},
                               "n_rows", 1, 3, 2),
    # n_out <= N
    "n_out": (_entries(with_entry(GREEDY, 1, n_out=N + 1)), False, {}, "n_out", 1, N + 1, N),
    # top_k <= 32
    "top_k_sampled": (_entries(with_entry(SAMPLED, 0, top_k=33)), True, {}, "top_k", 0, 33, 32),
    "top_k_greedy": (_entries(with_entry(GREEDY, 4, top_k=2**16 - 1)), False, {}, "top_k", 4,
                     2**16 - 1, 32),
    # unknown flag bits are 0
    "flag_bit_3": (_entries(with_entry(GREEDY, 3, flags=8)), False, {}, "flags", 3, 8, 7),
    "flag_bit_15": (_entries(with_entry(GREEDY, 0, flags=0x8000 | RF_NEED_DRAFT)), False, {},
                    "flags", 0, 0x8001, 7),
    # a RELEASE entry has no rows and no NEED_DRAFT
    "release_with_rows": (_entries(with_entry(GREEDY, 2, n_rows=1)), False, {}, "flags", 2,
                          RF_RELEASE, None),
    "release_with_need_draft": (_entries(with_entry(GREEDY, 2, flags=RF_RELEASE | 1)), False,
                                {}, "flags", 2, RF_RELEASE | 1, None),
    # reserved fields of an entry are 0
    "entry_reserved0": (_patch(GREEDY, "<H", E3 + 34, 1), False, {}, "reserved0", 3, 1, 0),
    "entry_reserved1": (_patch(GREEDY, "<I", E3 + 44, 2**31), False, {}, "reserved1", 3,
                        2**31, 0),
    # sampling fields are 0 on a greedy session
    "greedy_seed": (_entries(with_entry(GREEDY, 3, seed=12)), False, {}, "seed", 3, 12, 0),
    "greedy_top_k": (_entries(with_entry(GREEDY, 3, top_k=3)), False, {}, "top_k", 3, 3, 0),
    "greedy_temperature": (_entries(with_entry(GREEDY, 3, temperature=0.5)), False, {},
                           "temperature", 3, 0.5, 0),
    "greedy_top_p": (_entries(with_entry(GREEDY, 3, top_p=0.25)), False, {}, "top_p", 3,
                     0.25, 0),
    # a sampled entry has a finite temperature > 0 and a top_p in [0, 1]
    "temperature_zero": (_entries(with_entry(SAMPLED, 1, temperature=0.0)), True, {},
                         "temperature", 1, 0.0, None),
    "temperature_negative": (_entries(with_entry(SAMPLED, 1, temperature=-1.0)), True, {},
                             "temperature", 1, -1.0, None),
    "temperature_nan": (_entries(with_entry(SAMPLED, 4, temperature=math.nan)), True, {},
                        "temperature", 4, math.nan, None),
    "temperature_inf": (_entries(with_entry(SAMPLED, 0, temperature=math.inf)), True, {},
                        "temperature", 0, math.inf, None),
    "top_p_above_1": (_entries(with_entry(SAMPLED, 0, top_p=1.5)), True, {}, "top_p", 0, 1.5,
                      (0.0, 1.0)),
    "top_p_negative": (_entries(with_entry(SAMPLED, 4, top_p=-0.5)), True, {}, "top_p", 4,
                       -0.5, (0.0, 1.0)),
    "top_p_nan": (_entries(with_entry(SAMPLED, 1, top_p=math.nan)), True, {}, "top_p", 1,
                  math.nan, (0.0, 1.0)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_refusal_names_the_field_entry_and_value(case: str) -> None:
    build, is_sampled, limits, field, entry, value, limit = CASES[case]
    body = build()
    with pytest.raises(BadFrameError) as info:
        check(body, sampled=is_sampled, **limits)
    err = info.value
    assert err.status == ST_BAD_FRAME
    assert err.field == field
    assert err.entry == entry
    msg = str(err)
    if isinstance(value, float) and math.isnan(value):
        assert isinstance(err.value, float) and math.isnan(err.value)
    else:
        assert err.value == value
    if limit is not None:
        assert err.limit == limit
    if entry is not None:
        slot = decode_step(bytes(body)).entries["slot"][entry]
        assert err.slot == slot
        assert f"slot {slot}" in msg or f"entry {entry}" in msg
    shown = repr(value) if isinstance(value, float) else str(value)
    if field == "flags":
        shown = f"{value:#x}"
    assert shown in msg, msg


def test_a_repeated_slot_names_both_entries() -> None:
    with pytest.raises(BadFrameError) as info:
        check(body_of(with_entry(GREEDY, 3, slot=5)))
    assert info.value.entry == 3 and info.value.slot == 5
    assert "entry 3" in str(info.value) and "entry 1" in str(info.value)


def test_the_first_offending_entry_is_named() -> None:
    entries = with_entry(with_entry(GREEDY, 1, n_out=N + 1), 4, n_out=N + 2)
    with pytest.raises(BadFrameError) as info:
        check(body_of(entries))
    assert info.value.entry == 1


# -- body length exact (decode_step) --------------------------------------------------------------
@pytest.mark.parametrize("delta", [-1, 1, ROW_BYTES, -ROW_BYTES])
def test_body_length_must_be_exact(delta: int) -> None:
    body = body_of(GREEDY)
    wrong = bytes(body[:delta]) if delta < 0 else bytes(body) + bytes(delta)
    with pytest.raises(BadFrameError) as info:
        decode_step(wrong)
    need = 32 + 48 * len(GREEDY) + 6 * ROW_BYTES
    assert (info.value.field, info.value.value, info.value.limit) == (
        "body_len", need + delta, need)
    assert str(need) in str(info.value)


@pytest.mark.parametrize("size", [0, 1, 31])
def test_a_body_shorter_than_its_header_is_refused(size: int) -> None:
    with pytest.raises(BadFrameError) as info:
        decode_step(bytes(size))
    assert (info.value.field, info.value.value, info.value.limit) == ("body_len", size, 32)


def test_counts_from_a_hostile_header_do_not_allocate() -> None:
    hd = struct.pack("<QIIIIQ", 1, 2**32 - 1, 2**32 - 1, 2**32 - 1, 0, 0)
    with pytest.raises(BadFrameError) as info:
        decode_step(hd)
    assert info.value.field == "body_len"
