"""The client's refusal rules for a STEP reply (docs/contract.md section 6.3):
``protocol.validate.check_reply_values``. One test per rule, each naming slot, position, value."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from protocol.constants import (
    RF_NEED_DRAFT,
    RF_RELEASE,
    RF_RESET,
    RPF_MARGIN,
    RPF_SAMPLED,
    RS_NO_WINDOW,
    RS_OK,
    RS_PARTIAL_WINDOW,
    RS_SHED,
    RS_STALE_GENERATION,
)
from protocol.errors import ReplyValueError, WireError
from protocol.messages import ReqEntry, StepReply, decode_step, pack_step_prefix, rows_offset_for
from protocol.validate import ValuesAhead, check_reply_values

W, N, VOCAB = 8, 4, 100

# entry: (ReqEntry, status, window_rows); k is what the entry may draft (6.3)
ROWS: list[tuple[ReqEntry, int, int]] = [
    # 0: drafted with a full window (min(W, 20) = 8), all N positions; generation over 32 bits
    (ReqEntry(0, (1 << 32) | 7, 20, 11, flags=RF_NEED_DRAFT), RS_OK, 8),
    # 1: a partial window (3 of min(8, 5) = 5), n_out 2 < N
    (ReqEntry(1, 3, 5, 12, n_out=2, flags=RF_NEED_DRAFT), RS_PARTIAL_WINDOW, 3),
    # 2: no window: no draft
    (ReqEntry(2, 4, 6, 13, flags=RF_NEED_DRAFT), RS_NO_WINDOW, 0),
    # 3: a RELEASE entry
    (ReqEntry(3, 5, 9, 14, flags=RF_RELEASE), RS_OK, 0),
    # 4: rows only (RESET, no NEED_DRAFT): a window, no draft
    (ReqEntry(4, 6, 3, 15, n_rows=3, flags=RF_RESET), RS_OK, 3),
    # 5: shed under overload
    (ReqEntry(5, 8, 30, 16, flags=RF_NEED_DRAFT), RS_SHED, 8),
    # 6: stale generation
    (ReqEntry(6, 9, 2, 17, flags=RF_NEED_DRAFT), RS_STALE_GENERATION, 0),
    # 7: the very first position (anchor_pos 0): expected 0, drafts from the block alone
    (ReqEntry(7, 10, 0, 18, n_out=N, flags=RF_NEED_DRAFT), RS_OK, 0),
]
ENTRIES = [r[0] for r in ROWS]
KS = [4, 2, 0, 0, 0, 0, 0, 4]


def make_reply(flags: int = RPF_MARGIN) -> StepReply:
    rep = StepReply.empty(42, len(ROWS), N, flags)
    rep.status[:] = [r[1] for r in ROWS]
    rep.window_rows[:] = [r[2] for r in ROWS]
    rep.generation[:] = [r[0].generation & 0xFFFFFFFF for r in ROWS]
    for i, k in enumerate(KS):
        rep.draft_ids[i, :k] = [VOCAB - 1 - i - j for j in range(k)]
        rep.confidence[i, :k] = np.linspace(1.0, 0.0, k) if k > 1 else 0.5
        if rep.margin is not None:
            rep.margin[i, :k] = np.arange(k, dtype=np.float32) * 0.5
    rep.finish(10)
    return rep


def check(rep: StepReply, entries: Any = None) -> list[int]:
    ks = check_reply_values(rep, ENTRIES if entries is None else entries, vocab_size=VOCAB,
                            window=W)
    return [int(k) for k in ks]


# -- what passes ----------------------------------------------------------------------------------
@pytest.mark.parametrize("flags", [0, RPF_MARGIN, RPF_SAMPLED, RPF_MARGIN | RPF_SAMPLED])
def test_a_valid_reply_passes(flags: int) -> None:
    assert check(make_reply(flags)) == KS


def test_a_valid_reply_passes_after_the_wire() -> None:
    rep = make_reply()
    assert check(StepReply.unpack(rep.pack(), expect_n_req=8, expect_num_spec=N)) == KS


def test_packed_entries_give_the_same_counts() -> None:
    """The client may pass the ENTRY_DTYPE view of the STEP it just wrote."""
    buf = bytearray(rows_offset_for(len(ENTRIES)) + 3 * 2)
    pack_step_prefix(buf, 0, 42, ENTRIES, 3, 2)
    view = decode_step(buf)
    assert check(make_reply(), view.entries) == KS
    rep = make_reply()
    rep.draft_ids[1, 3] = 9
    with pytest.raises(ReplyValueError) as info:
        check(rep, view.entries)
    assert (info.value.entry, info.value.slot, info.value.position) == (1, 1, 3)


def test_n_out_above_num_spec_drafts_num_spec() -> None:
    entries = [ReqEntry(0, 1, 50, 0, n_out=1000, flags=RF_NEED_DRAFT)]
    rep = StepReply.empty(1, 1, N, 0)
    rep.generation[:] = [1]
    rep.window_rows[:] = [W]
    rep.draft_ids[0] = [1, 2, 3, 4]
    rep.confidence[0] = [0.9, 0.8, 0.7, 0.6]
    assert [int(k) for k in check_reply_values(rep, entries, vocab_size=VOCAB, window=W)] == [N]


def test_bounds_are_inclusive_where_the_contract_says_so() -> None:
    rep = make_reply()
    rep.draft_ids[0, 0] = VOCAB - 1
    rep.draft_ids[0, 1] = 0
    rep.confidence[0, :2] = [0.0, 1.0]
    assert rep.margin is not None
    rep.margin[0, 0] = 0.0
    rep.margin[0, 1] = np.finfo(np.float32).max
    assert check(rep) == KS


# -- one test per refusal rule -------------------------------------------------------------------
Mutation = Callable[[StepReply], None]


def _set(name: str, index: tuple[int, ...], value: float) -> Mutation:
    def mutate(rep: StepReply) -> None:
        getattr(rep, name)[index] = value
    return mutate


# case: mutation, entry, position (None: an entry rule), field, value, limit
CASES: dict[str, tuple[Mutation, int, int | None, str, float, Any]] = {
    # the status is a known request status
    "unknown_status": (_set("status", (3,), 5), 3, None, "status", 5, None),
    "unknown_status_255": (_set("status", (0,), 255), 0, None, "status", 255, None),
    # the generation echo equals generation & 0xFFFFFFFF
    "generation_echo": (_set("generation", (0,), 8), 0, None, "generation", 8, 7),
    "generation_echo_unmasked": (_set("generation", (6,), 0), 6, None, "generation", 0, 9),
    # window_rows <= min(W, anchor_pos)
    "window_rows_over_W": (_set("window_rows", (5,), 9), 5, None, "window_rows", 9, 8),
    "window_rows_over_anchor": (_set("window_rows", (4,), 4), 4, None, "window_rows", 4, 3),
    "window_rows_at_position_0": (_set("window_rows", (7,), 1), 7, None, "window_rows", 1, 0),
    # NEED_DRAFT + RS_OK: window_rows == min(W, anchor_pos)
    "ok_with_fewer_rows": (_set("window_rows", (0,), 7), 0, None, "window_rows", 7, 8),
    # NEED_DRAFT + RS_PARTIAL_WINDOW: fewer rows than that
    "partial_with_every_row": (_set("window_rows", (1,), 5), 1, None, "window_rows", 5, 5),
    # ... and at least one: PARTIAL_WINDOW with no row at all is NO_WINDOW (7.2 step 5)
    "partial_with_no_row": (_set("window_rows", (1,), 0), 1, None, "window_rows", 0, 5),
    # positions j < k: draft id in [0, vocab_size)
    "draft_id_equals_vocab": (_set("draft_ids", (0, 2), VOCAB), 0, 2, "draft_ids", VOCAB,
                              VOCAB),
    "draft_id_negative": (_set("draft_ids", (1, 1), -1), 1, 1, "draft_ids", -1, VOCAB),
    "draft_id_at_position_0": (_set("draft_ids", (7, 3), 10**6), 7, 3, "draft_ids", 10**6,
                               VOCAB),
    # positions j < k: confidence in [0, 1]
    "confidence_above_1": (_set("confidence", (0, 3), 1.5), 0, 3, "confidence", 1.5,
                           (0.0, 1.0)),
    "confidence_negative": (_set("confidence", (1, 0), -0.25), 1, 0, "confidence", -0.25,
                            (0.0, 1.0)),
    "confidence_nan": (_set("confidence", (0, 1), math.nan), 0, 1, "confidence", math.nan,
                       (0.0, 1.0)),
    # positions j < k: finite margin >= 0
    "margin_negative": (_set("margin", (1, 0), -1.0), 1, 0, "margin", -1.0, None),
    "margin_nan": (_set("margin", (0, 2), math.nan), 0, 2, "margin", math.nan, None),
    "margin_inf": (_set("margin", (7, 0), math.inf), 7, 0, "margin", math.inf, None),
    # positions j >= k: draft 0, confidence 0.0, margin 0.0
    "draft_past_n_out": (_set("draft_ids", (1, 2), 5), 1, 2, "draft_ids", 5, 0),
    "draft_on_no_window": (_set("draft_ids", (2, 0), 3), 2, 0, "draft_ids", 3, 0),
    "draft_on_release": (_set("draft_ids", (3, 3), 1), 3, 3, "draft_ids", 1, 0),
    "draft_without_need_draft": (_set("draft_ids", (4, 1), 2), 4, 1, "draft_ids", 2, 0),
    "draft_on_shed": (_set("draft_ids", (5, 0), 7), 5, 0, "draft_ids", 7, 0),
    "draft_on_stale_generation": (_set("draft_ids", (6, 0), 7), 6, 0, "draft_ids", 7, 0),
    "confidence_past_n_out": (_set("confidence", (1, 3), 0.25), 1, 3, "confidence", 0.25, 0),
    "confidence_nan_in_tail": (_set("confidence", (2, 0), math.nan), 2, 0, "confidence",
                               math.nan, 0),
    "margin_past_n_out": (_set("margin", (1, 2), 0.5), 1, 2, "margin", 0.5, 0),
    "margin_on_release": (_set("margin", (3, 0), -2.0), 3, 0, "margin", -2.0, 0),
}


def _same(got: object, want: float) -> bool:
    if math.isnan(want):
        return isinstance(got, float) and math.isnan(got)
    return got == want


@pytest.mark.parametrize("case", list(CASES))
def test_refusal_names_slot_position_and_value(case: str) -> None:
    mutate, entry, position, field, value, limit = CASES[case]
    rep = make_reply()
    mutate(rep)
    with pytest.raises(ReplyValueError) as info:
        check(rep)
    err = info.value
    assert isinstance(err, WireError)
    slot = ENTRIES[entry].slot
    assert err.entry == entry
    assert err.slot == slot
    assert err.position == position
    assert err.field == field
    assert _same(err.value, value), err.value
    if limit is not None:
        assert err.limit == limit
    msg = str(err)
    assert f"slot {slot}" in msg
    if position is not None:
        assert f"position {position}" in msg
    shown = repr(float(value)) if field in ("confidence", "margin") else str(value)
    assert shown in msg, msg


@pytest.mark.parametrize("case", ["draft_past_n_out", "confidence_negative", "margin_nan"])
def test_refusals_also_hold_after_the_wire(case: str) -> None:
    mutate, entry, position, field, _, _ = CASES[case]
    rep = make_reply()
    mutate(rep)
    got = StepReply.unpack(rep.pack())
    with pytest.raises(ReplyValueError) as info:
        check(got)
    assert (info.value.entry, info.value.position, info.value.field) == (entry, position, field)


def test_the_first_offender_is_named() -> None:
    rep = make_reply()
    rep.draft_ids[1, 3] = 4  # entry 1, tail
    rep.draft_ids[5, 0] = 4  # entry 5, tail
    with pytest.raises(ReplyValueError) as info:
        check(rep)
    assert info.value.entry == 1


def test_reply_for_another_number_of_entries_is_refused() -> None:
    rep = make_reply()
    for entries in (ENTRIES[:-1], [*ENTRIES, ReqEntry(9, 1, 1, 1)]):
        with pytest.raises(ReplyValueError) as info:
            check(rep, entries)
        assert info.value.field == "n_req"
        assert info.value.value == 8
        assert info.value.limit == len(entries)
        assert "n_req 8" in str(info.value)


# -- the usual reply: every entry drafts all N positions ---------------------------------------
USUAL = [ReqEntry(i, (1 << 32) + 10 + i if i == 2 else 10 + i, [20, 3, 0, 9, 8][i], i,
                  n_out=[0, N, 1000, 0, N][i], flags=RF_NEED_DRAFT) for i in range(5)]


def usual_reply() -> StepReply:
    rep = StepReply.empty(7, len(USUAL), N, RPF_MARGIN)
    rep.window_rows[:] = [min(W, e.anchor_pos) for e in USUAL]
    rep.generation[:] = [e.generation & 0xFFFFFFFF for e in USUAL]
    rep.draft_ids[:] = np.arange(len(USUAL) * N).reshape(-1, N) % VOCAB
    rep.confidence[:] = 0.5
    assert rep.margin is not None
    rep.margin[:] = 1.0
    rep.finish(3)
    return rep


def packed(entries: list[ReqEntry]) -> Any:
    buf = bytearray(rows_offset_for(len(entries)))
    pack_step_prefix(buf, 0, 7, entries, 0, 2)
    return decode_step(buf).entries


def outcome(fn: Callable[[], Any]) -> Any:
    try:
        return [int(k) for k in fn()]
    except ReplyValueError as exc:
        return (str(exc), exc.entry, exc.slot, exc.position, exc.field)


USUAL_CASES: dict[str, Mutation] = {
    "as_is": lambda rep: None,
    "status_partial": _set("status", (1,), RS_PARTIAL_WINDOW),
    "status_unknown": _set("status", (4,), 200),
    "status_shed": _set("status", (0,), RS_SHED),
    "window_short": _set("window_rows", (3,), 7),
    "window_over": _set("window_rows", (0,), 9),
    "generation": _set("generation", (2,), 13),
    "draft_vocab": _set("draft_ids", (4, 3), VOCAB),
    "draft_negative": _set("draft_ids", (0, 0), -1),
    "confidence_over": _set("confidence", (3, 1), 1.0000001),
    "confidence_negative_zero": _set("confidence", (3, 1), -0.0),
    "confidence_nan": _set("confidence", (1, 2), math.nan),
    "margin_inf": _set("margin", (2, 0), math.inf),
    "margin_nan": _set("margin", (4, 1), math.nan),
    "margin_negative": _set("margin", (0, 3), -1e-30),
    "margin_max": _set("margin", (0, 3), float(np.finfo(np.float32).max)),
    "margin_negative_zero": _set("margin", (1, 1), -0.0),
    "padding": lambda rep: rep.head_words().view(np.uint8).__setitem__(len(USUAL), 7),
}


@pytest.mark.parametrize("case", sorted(USUAL_CASES))
@pytest.mark.parametrize("shape", ["usual", "n_out_short", "no_draft"])
def test_the_usual_replys_shortcut_says_what_the_rules_say(case: str, shape: str) -> None:
    """With packed entries of a STEP whose every entry asks for all N positions the check
    is a few bounds on the whole reply; it refuses and accepts exactly what the entry-by-entry
    rules do (same counts, same first offender), also done in two parts (ValuesAhead)."""
    entries = list(USUAL)
    if shape == "n_out_short":  # one entry asks for fewer positions: not the usual kind
        entries[3] = ReqEntry(3, 13, 9, 3, n_out=2, flags=RF_NEED_DRAFT)
    elif shape == "no_draft":
        entries[1] = ReqEntry(1, 11, 3, 1, flags=RF_RELEASE)
    rep = usual_reply()
    if shape == "n_out_short":
        rep.draft_ids[3, 2:] = 0
        rep.confidence[3, 2:] = 0
        assert rep.margin is not None
        rep.margin[3, 2:] = 0
    elif shape == "no_draft":
        rep.draft_ids[1] = 0
        rep.confidence[1] = 0
        assert rep.margin is not None
        rep.margin[1] = 0
    USUAL_CASES[case](rep)
    view = packed(entries)
    want = outcome(lambda: check_reply_values(rep, entries, vocab_size=VOCAB, window=W))
    assert outcome(lambda: check_reply_values(rep, view, vocab_size=VOCAB, window=W)) == want
    ahead = ValuesAhead(view, N, W)
    assert ahead.usual == (shape == "usual")
    assert outcome(lambda: ahead.check(rep, VOCAB)) == want
    if case in ("as_is", "confidence_negative_zero", "margin_max", "margin_negative_zero",
                "padding"):
        assert isinstance(want, list)
    elif shape == "usual":
        assert not isinstance(want, list)


def test_a_window_wider_than_the_wires_u16_is_left_to_the_general_pass() -> None:
    """window_rows is a u16 on the wire: with W and anchor_pos past 65535 the whole window
    cannot be reported, so no reply is of the usual kind; the one that reports its low 16
    bits is refused, as the rules say."""
    wide = 100_000
    entries = [ReqEntry(0, 5, 70_000, 1, flags=RF_NEED_DRAFT)]
    rep = StepReply.empty(7, 1, N, 0)
    rep.window_rows[:] = 70_000 & 0xFFFF
    rep.generation[:] = 5
    rep.confidence[:] = 0.5
    view = packed(entries)
    want = outcome(lambda: check_reply_values(rep, entries, vocab_size=VOCAB, window=wide))
    assert not isinstance(want, list) and want[4] == "window_rows"
    ahead = ValuesAhead(view, N, wide)
    assert not ahead.usual
    assert outcome(lambda: ahead.check(rep, VOCAB)) == want
