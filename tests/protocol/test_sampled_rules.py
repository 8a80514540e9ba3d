"""What a sampled reply must satisfy (docs/contract.md section 9.2, ``protocol.sampled.validate``)
and the re-derived draws (section 9.3, ``protocol.sampled.check_draws``). One test per rule."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from protocol import sampled
from protocol.constants import (
    MAX_TOP_K,
    Q_TOTAL,
    RF_NEED_DRAFT,
    RF_RESET,
    RPF_MARGIN,
    RPF_SAMPLED,
    RS_NO_WINDOW,
    RS_OK,
    RS_PARTIAL_WINDOW,
    RS_SHED,
    USABLE_REQ_STATUS,
)
from protocol.errors import ReplyValueError
from protocol.messages import ReqEntry, StepReply
from protocol.validate import check_reply_values

VOCAB, N, W = 50, 3, 8

# (entry, status, window_rows); the entry's top_k decides whether it samples
ROWS: list[tuple[ReqEntry, int, int]] = [
    # 0: sampled, every position drafted; a generation wider than 32 bits
    (ReqEntry(0, (1 << 32) | 5, 20, 1, flags=RF_NEED_DRAFT, seed=0xFEEDFACE12345678, top_k=4,
              temperature=0.8), RS_OK, 8),
    # 1: a greedy entry in a sampled session: drafts greedily, carries no q
    (ReqEntry(1, 6, 9, 2, flags=RF_NEED_DRAFT), RS_OK, 8),
    # 2: sampled but no window: nothing drafted
    (ReqEntry(2, 7, 6, 3, flags=RF_NEED_DRAFT, seed=3, top_k=5, temperature=1.0), RS_NO_WINDOW,
     0),
    # 3: sampled, partial window, n_out 1: position 0 drafted, 1 and 2 not
    (ReqEntry(3, 8, 5, 4, n_out=1, flags=RF_NEED_DRAFT, seed=4, top_k=2, temperature=2.0),
     RS_PARTIAL_WINDOW, 2),
    # 4: rows only (no NEED_DRAFT): not sampled whatever its top_k
    (ReqEntry(4, 9, 2, 5, n_rows=2, flags=RF_RESET, seed=5, top_k=3, temperature=1.0), RS_OK,
     2),
    # 5: shed: not sampled
    (ReqEntry(5, 10, 30, 6, flags=RF_NEED_DRAFT, seed=6, top_k=3, temperature=1.0), RS_SHED,
     0),
]
ENTRIES = [r[0] for r in ROWS]
NEEDED = np.array([bool(e.flags & RF_NEED_DRAFT) and st in USABLE_REQ_STATUS
                   for e, st, _ in ROWS])
TOP_KS = np.array([e.top_k for e in ENTRIES], dtype=np.int32)
SEEDS = np.array([e.seed for e in ENTRIES], dtype=np.uint64)
GENERATIONS = np.array([e.generation for e in ENTRIES], dtype=np.uint64)
ANCHORS = np.array([e.anchor_pos for e in ENTRIES])


def make_reply() -> StepReply:
    rep = StepReply.empty(3, len(ROWS), N, RPF_MARGIN | RPF_SAMPLED)
    assert rep.sampled_mask is not None and rep.support_ids is not None
    assert rep.proposal_q is not None and rep.margin is not None
    rep.status[:] = [r[1] for r in ROWS]
    rep.window_rows[:] = [r[2] for r in ROWS]
    rep.generation[:] = [r[0].generation & 0xFFFFFFFF for r in ROWS]
    rng = np.random.default_rng(7)
    for i, (e, status, _) in enumerate(ROWS):
        if not (e.flags & RF_NEED_DRAFT and status in USABLE_REQ_STATUS):
            continue
        k = N if e.n_out == 0 else min(e.n_out, N)
        for j in range(k):
            if e.top_k == 0:  # greedy
                rep.draft_ids[i, j] = 10 + j
            else:
                logits = rng.normal(size=VOCAB) * 3.0
                logits[0] = -100.0  # id 0 never in a support: a draft of 0 is always wrong
                ids, q = sampled.build_q(logits, e.top_k, e.temperature, e.top_p)
                u = sampled.draw_u(e.seed, e.generation, e.anchor_pos + 1 + j)
                rep.support_ids[i, j], rep.proposal_q[i, j] = ids, q
                rep.draft_ids[i, j] = sampled.draw(ids, q, u)
            rep.confidence[i, j] = 0.5
            rep.margin[i, j] = 1.0
        rep.sampled_mask[i] = int(e.top_k > 0)
    rep.finish(0)
    return rep


def validate(rep: StepReply, needed: Any = NEEDED, top_ks: Any = TOP_KS) -> None:
    assert rep.sampled_mask is not None and rep.support_ids is not None
    assert rep.proposal_q is not None
    sampled.validate(rep.sampled_mask, rep.support_ids, rep.proposal_q, rep.draft_ids, needed,
                     VOCAB, top_ks)


def check_draws(rep: StepReply) -> None:
    assert rep.sampled_mask is not None and rep.support_ids is not None
    assert rep.proposal_q is not None
    sampled.check_draws(rep.sampled_mask, rep.support_ids, rep.proposal_q, rep.draft_ids,
                        SEEDS, GENERATIONS, ANCHORS)


# -- what passes ----------------------------------------------------------------------------------
def test_a_valid_sampled_reply_passes_every_check() -> None:
    rep = make_reply()
    assert rep.sampled_mask is not None and rep.proposal_q is not None
    assert rep.sampled_mask.tolist() == [1, 0, 0, 1, 0, 0]
    assert (rep.proposal_q[0].sum(axis=-1) == Q_TOTAL).all()
    assert rep.proposal_q[3, 0].sum() == Q_TOTAL and rep.proposal_q[3, 1:].sum() == 0
    validate(rep)
    check_draws(rep)
    assert [int(k) for k in check_reply_values(rep, ENTRIES, vocab_size=VOCAB, window=W)] == [
        3, 3, 0, 1, 0, 0]


def test_a_valid_reply_passes_after_the_wire() -> None:
    rep = StepReply.unpack(make_reply().pack())
    validate(rep)
    check_draws(rep)


def test_check_draws_uses_the_wire_generation() -> None:
    rep = make_reply()
    assert rep.sampled_mask is not None and rep.support_ids is not None
    assert rep.proposal_q is not None
    sampled.check_draws(rep.sampled_mask, rep.support_ids, rep.proposal_q, rep.draft_ids,
                        SEEDS, GENERATIONS & np.uint64(0xFFFFFFFF), ANCHORS)


# -- 9.2, one test per rule -----------------------------------------------------------------------
Mutation = Callable[[StepReply], None]


def _set(name: str, index: tuple[int, ...], value: int) -> Mutation:
    def mutate(rep: StepReply) -> None:
        getattr(rep, name)[index] = value
    return mutate


def _position(i: int, j: int, ids: list[int], q: list[int], draft: int) -> Mutation:
    """Replace position (i, j) with this support and draft."""
    def mutate(rep: StepReply) -> None:
        assert rep.support_ids is not None and rep.proposal_q is not None
        rep.support_ids[i, j] = ids + [0] * (MAX_TOP_K - len(ids))
        rep.proposal_q[i, j] = q + [0] * (MAX_TOP_K - len(q))
        rep.draft_ids[i, j] = draft
    return mutate


def _swap_first_places(rep: StepReply) -> None:
    assert rep.support_ids is not None and rep.proposal_q is not None
    for arr in (rep.support_ids, rep.proposal_q):
        arr[0, 1, [0, 1]] = arr[0, 1, [1, 0]]


def _duplicate_id(rep: StepReply) -> None:
    assert rep.support_ids is not None
    rep.support_ids[0, 2, 1] = rep.support_ids[0, 2, 0]


def _q_plus_one(rep: StepReply) -> None:
    assert rep.proposal_q is not None
    rep.proposal_q[0, 1, 0] += 1


H = Q_TOTAL // 2
# case: mutation, entry, position (None: an entry rule), field, value, limit, words in message
CASES: dict[str, tuple[Mutation, int, int | None, str, Any, Any, str]] = {
    # sampled_mask is 1 exactly for NEED_DRAFT + usable status + top_k > 0
    "mask_on_greedy_entry": (_set("sampled_mask", (1,), 1), 1, None, "sampled_mask", 1, 0,
                             "top_k 0"),
    "mask_on_no_window": (_set("sampled_mask", (2,), 1), 2, None, "sampled_mask", 1, 0,
                          "sampled_mask 1"),
    "mask_without_need_draft": (_set("sampled_mask", (4,), 1), 4, None, "sampled_mask", 1, 0,
                                "sampled_mask 1"),
    "mask_on_shed": (_set("sampled_mask", (5,), 1), 5, None, "sampled_mask", 1, 0,
                     "sampled_mask 1"),
    "mask_missing": (_set("sampled_mask", (0,), 0), 0, None, "sampled_mask", 0, 1,
                     "sampled_mask 0"),
    "mask_not_0_or_1": (_set("sampled_mask", (3,), 2), 3, None, "sampled_mask", 2, 1,
                        "sampled_mask 2"),
    # every other entry carries zeros
    "support_on_greedy_entry": (_set("support_ids", (1, 0, 0), 3), 1, 0, "support", None, None,
                                "not sampled"),
    "q_on_no_window": (_set("proposal_q", (2, 2, 5), 9), 2, 2, "support", None, None,
                       "not sampled"),
    # q sums to exactly 2**24
    "q_sum": (_q_plus_one, 0, 1, "proposal_q", Q_TOTAL + 1, Q_TOTAL, str(Q_TOTAL + 1)),
    "q_all_zero_but_drafted": (_set("draft_ids", (3, 2), 7), 3, 2, "proposal_q", 0, Q_TOTAL,
                               "sums to 0"),
    # support ids in [0, vocab_size)
    "support_id_equals_vocab": (_position(0, 0, [VOCAB, 3], [H, H], 3), 0, 0, "support_ids",
                                VOCAB, VOCAB, f"support id {VOCAB}"),
    "support_id_negative": (_position(3, 0, [3, -1], [H, H], 3), 3, 0, "support_ids", -1,
                            VOCAB, "support id -1"),
    # no place at or past top_k is used (entry 3 has top_k 2)
    "place_past_top_k": (_position(3, 0, [5, 6, 7], [H, H // 2, H // 2], 5), 3, 0,
                         "proposal_q", 2, 2, "past top_k 2"),
    # unused places carry id 0
    "unused_place_with_id": (_set("support_ids", (0, 1, MAX_TOP_K - 1), 7), 0, 1,
                             "support_ids", 7, None, "carries id 7"),
    # used ids are distinct
    "duplicate_id": (_duplicate_id, 0, 2, "support_ids", None, None, "appears twice"),
    # canonical order: q descending, ties by id ascending, used places a prefix
    "q_ascending": (_swap_first_places, 0, 1, "proposal_q", None, None, "canonical"),
    "tie_ids_descending": (_position(0, 0, [9, 4], [H, H], 9), 0, 0, "proposal_q", None, None,
                           "canonical"),
    "hole_before_a_used_place": (_position(0, 0, [9, 0, 4], [H, 0, H], 9), 0, 0, "proposal_q",
                                 None, None, "canonical"),
    # the draft id is a support id with q > 0
    "draft_not_in_support": (_position(0, 2, [9, 4], [H + 1, H - 1], 11), 0, 2, "draft_ids", 11,
                             None, "draft id 11"),
    "draft_0_on_an_unused_place": (_position(3, 0, [9, 4], [H + 1, H - 1], 0), 3, 0,
                                   "draft_ids", 0, None, "draft id 0"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_refusal_names_entry_position_and_value(case: str) -> None:
    mutate, entry, position, field, value, limit, words = CASES[case]
    rep = make_reply()
    mutate(rep)
    with pytest.raises(ReplyValueError) as info:
        validate(rep)
    err = info.value
    assert err.entry == entry
    assert err.position == position
    assert err.field == field
    if value is not None:
        assert err.value == value
    if limit is not None:
        assert err.limit == limit
    msg = str(err)
    assert msg.startswith(f"entry {entry}")
    if position is not None:
        assert f"position {position}" in msg
    assert words in msg, msg


def test_the_mask_message_says_why() -> None:
    rep = make_reply()
    assert rep.sampled_mask is not None
    rep.sampled_mask[2] = 1
    with pytest.raises(ReplyValueError) as info:
        validate(rep)
    assert "top_k 5" in str(info.value)
    assert "usable status False" in str(info.value)


def test_sampled_arrays_of_the_wrong_shape_are_refused() -> None:
    rep = make_reply()
    assert rep.sampled_mask is not None and rep.support_ids is not None
    assert rep.proposal_q is not None
    with pytest.raises(ReplyValueError, match="shapes"):
        sampled.validate(rep.sampled_mask, rep.support_ids[:, :, :16], rep.proposal_q,
                         rep.draft_ids, NEEDED, VOCAB, TOP_KS)


def test_empty_replies_pass() -> None:
    for n, n_spec in ((0, 3), (2, 0), (0, 0)):
        rep = StepReply.empty(1, n, n_spec, RPF_SAMPLED)
        validate(rep, np.zeros(n, dtype=bool), np.zeros(n, dtype=np.int32))
        check_draws_n = np.zeros(n, dtype=np.uint64)
        assert rep.sampled_mask is not None and rep.support_ids is not None
        assert rep.proposal_q is not None
        sampled.check_draws(rep.sampled_mask, rep.support_ids, rep.proposal_q, rep.draft_ids,
                            check_draws_n, check_draws_n, check_draws_n)


# -- 9.3: the drafts re-derive --------------------------------------------------------------------
def test_a_draft_that_is_not_the_draw_is_refused() -> None:
    rep = make_reply()
    assert rep.support_ids is not None and rep.proposal_q is not None
    # the other id of a two-place support at entry 3, position 0: still valid under 9.2
    ids = rep.support_ids[3, 0, :2].tolist()
    drawn = int(rep.draft_ids[3, 0])
    other = ids[1] if drawn == ids[0] else ids[0]
    assert int(rep.proposal_q[3, 0, 1]) > 0
    rep.draft_ids[3, 0] = other
    validate(rep)
    with pytest.raises(ReplyValueError) as info:
        check_draws(rep)
    err = info.value
    assert (err.entry, err.position, err.field) == (3, 0, "draft_ids")
    assert (err.value, err.limit) == (other, drawn)
    msg = str(err)
    e = ENTRIES[3]
    assert f"draft id {other}" in msg and f"draw {drawn}" in msg
    assert f"seed {e.seed}" in msg and f"generation {e.generation}" in msg
    assert f"position {e.anchor_pos + 1}" in msg


def test_a_draw_under_another_seed_or_position_is_refused() -> None:
    rep = make_reply()
    assert rep.sampled_mask is not None and rep.support_ids is not None
    assert rep.proposal_q is not None
    refused = 0
    for seeds, anchors in ((SEEDS + np.uint64(1), ANCHORS), (SEEDS, ANCHORS + 1)):
        try:
            sampled.check_draws(rep.sampled_mask, rep.support_ids, rep.proposal_q,
                                rep.draft_ids, seeds, GENERATIONS, anchors)
        except ReplyValueError:
            refused += 1
    # fixed inputs: under either change some of the 4 sampled drafts no longer re-derive
    assert refused == 2
