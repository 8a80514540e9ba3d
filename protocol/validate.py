"""Value rules on both sides of a STEP (docs/contract.md sections 6.3 and 7.2 step 3).

* ``check_reply_values``: the client refuses a StepReply the target must not see (6.3).
* ``check_step_shape``: the worker refuses a STEP whose shape breaks 7.2 step 3.

Both are on the hot path: one vectorised pass, and only when it fails a search that names the
first offender (entry, slot, position, value, limit) in a ``WireError`` subclass.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import numpy as np
import numpy.typing as npt

from .constants import (
    KNOWN_REQ_FLAGS,
    KNOWN_STEP_FLAGS,
    MAX_TOP_K,
    REQ_ENTRY_SIZE,
    REQ_STATUS_NAMES,
    RF_NEED_DRAFT,
    RF_RELEASE,
    RS_OK,
    RS_PARTIAL_WINDOW,
    U32_MASK,
    USABLE_REQ_STATUS,
)
from .errors import BadFrameError, ReplyValueError
from .messages import ReqEntry, StepReply, StepView, entries_from_view, reply_layout


# -- 6.3: the client's check of a reply -----------------------------------------------------------
def drafted_counts(reply: StepReply, entries: Sequence[ReqEntry], window: int) -> list[int]:
    """Per entry, ``k``: the positions that carry a draft. Checks the scalar rules of 6.3
    (one entry per reply row, known status, generation echo, window_rows against
    ``min(W, anchor_pos)``) on the way."""
    N = reply.num_spec
    _check_n_req(reply, entries)
    status, wrows = reply.status.tolist(), reply.window_rows.tolist()
    gens = reply.generation.tolist()
    ks = []
    for i, e in enumerate(entries):
        rs, wr = status[i], wrows[i]
        if rs not in REQ_STATUS_NAMES:
            raise ReplyValueError(f"slot {e.slot}: unknown request status {rs}", entry=i,
                                  slot=e.slot, field="status", value=rs)
        if gens[i] != e.generation & U32_MASK:
            raise ReplyValueError(
                f"slot {e.slot}: generation echo {gens[i]} is not the entry's generation"
                f" {e.generation & U32_MASK}", entry=i, slot=e.slot, field="generation",
                value=gens[i], limit=e.generation & U32_MASK)
        expected = min(window, max(e.anchor_pos, 0))
        if wr > expected:
            raise ReplyValueError(
                f"slot {e.slot}: window_rows {wr} > {expected} readable rows (anchor_pos"
                f" {e.anchor_pos}, W {window})", entry=i, slot=e.slot, field="window_rows",
                value=wr, limit=expected)
        consumed = bool(e.flags & RF_NEED_DRAFT) and rs in USABLE_REQ_STATUS
        if consumed:
            if rs == RS_OK and wr != expected:
                raise ReplyValueError(
                    f"slot {e.slot}: status OK with window_rows {wr} != {expected}", entry=i,
                    slot=e.slot, field="window_rows", value=wr, limit=expected)
            if rs == RS_PARTIAL_WINDOW and not 0 < wr < expected:
                raise ReplyValueError(
                    f"slot {e.slot}: PARTIAL_WINDOW with window_rows {wr}, not in (0, {expected})",
                    entry=i, slot=e.slot, field="window_rows", value=wr, limit=expected)
        ks.append((N if e.n_out == 0 else min(e.n_out, N)) if consumed else 0)
    return ks


def _check_n_req(reply: StepReply, entries: Sequence[ReqEntry] | npt.NDArray[Any]) -> None:
    if len(entries) != reply.n_req:
        raise ReplyValueError(f"reply has n_req {reply.n_req}, the STEP sent {len(entries)}"
                              " entries", field="n_req", value=reply.n_req, limit=len(entries))


def _entry_columns(entries: Sequence[ReqEntry] | npt.NDArray[Any]
                   ) -> tuple[Any, Any, Any, Any]:
    """anchor_pos, n_out, flags and wire generation of every entry as int64 arrays. A packed
    ENTRY_DTYPE view (what the client just wrote into its STEP buffer) costs nothing; objects
    cost one pass."""
    if isinstance(entries, np.ndarray):
        return (entries["anchor_pos"].astype(np.int64), entries["n_out"].astype(np.int64),
                entries["flags"].astype(np.int64), entries["generation"].astype(np.int64))
    cols = np.array([(e.anchor_pos, e.n_out, e.flags, e.generation & U32_MASK)
                     for e in entries], dtype=np.int64).reshape(-1, 4)
    return cols[:, 0], cols[:, 1], cols[:, 2], cols[:, 3]


def check_reply_values(reply: StepReply, entries: Sequence[ReqEntry] | npt.NDArray[Any], *,
                       vocab_size: int, window: int) -> npt.NDArray[np.int64]:
    """Refuse a reply that breaks 6.3; return the drafted count ``k`` per entry.

    ``entries``: the STEP's ReqEntry objects, or its packed entries (an ENTRY_DTYPE array).
    Draft ids become the target's input ids and confidences feed the depth policy: positions
    ``j < k`` carry an id in ``[0, vocab_size)``, a confidence in ``[0, 1]`` and a finite margin
    ``>= 0``; every other position carries zeros. NaN fails every comparison, so it fails.
    ``ValuesAhead(...).check`` is the same check with its request-only part done first."""
    if isinstance(entries, np.ndarray):  # its check begins with the entry count
        return ValuesAhead(entries, reply.num_spec, window).check(reply, vocab_size)
    _check_n_req(reply, entries)
    return _values(reply, entries, vocab_size, window)


def _values(reply: StepReply, entries: Sequence[ReqEntry] | npt.NDArray[Any],
            vocab_size: int, window: int) -> npt.NDArray[np.int64]:
    """``check_reply_values``'s general pass (any reply)."""
    N = reply.num_spec
    anchor, n_out, flags, generation = _entry_columns(entries)
    status = reply.status.astype(np.int64)
    wr = reply.window_rows.astype(np.int64)
    expected = np.minimum(window, np.maximum(anchor, 0))
    consumed = ((flags & RF_NEED_DRAFT) != 0) & ((status == RS_OK) | (status == RS_PARTIAL_WINDOW))
    scalar_ok = (
        (status <= max(REQ_STATUS_NAMES)).all()
        and (reply.generation == generation).all()
        and (wr <= expected).all()
        and not (consumed & (status == RS_OK) & (wr != expected)).any()
        and not (consumed & (status == RS_PARTIAL_WINDOW) & ((wr >= expected) | (wr == 0))).any()
    )
    if not scalar_ok:
        drafted_counts(reply, _as_objects(entries), window)  # raises, naming the entry
    ks = np.where(consumed, np.where(n_out == 0, N, np.minimum(n_out, N)), 0)
    live = np.arange(N)[None, :] < ks[:, None]  # [n, N]
    ids, conf, m = reply.draft_ids, reply.confidence, reply.margin
    ok = (np.where(live, (ids >= 0) & (ids < vocab_size), ids == 0).all()
          and np.where(live, (conf >= 0.0) & (conf <= 1.0), conf == 0.0).all()
          and (m is None or np.where(live, np.isfinite(m) & (m >= 0.0), m == 0.0).all()))
    if not ok:
        _raise_first_value(reply, _as_objects(entries), ks.tolist(), vocab_size)
    return ks


class ValuesAhead:
    """``check_reply_values`` for the packed entries of one STEP, its request side done
    first: a client makes it while the reply is on its way, then calls ``check``. ``usual``:
    every entry asked for a draft of all N positions (n_out 0 or at least N); then a reply
    that gives each one status OK, its whole window (``window_rows``: min(W, anchor_pos)) and
    its generation echo has every position drafted, and 6.3 is a few bounds on the whole reply
    (``_usual_reply``). Those three arrays and their padding (0) are known now, as the 8-byte
    words the reply carries them in (``words``). It keeps a view of the entries: keep them
    unchanged until the reply is checked."""

    __slots__ = ("entries", "ks", "num_spec", "usual", "window", "words")

    def __init__(self, entries: npt.NDArray[Any], num_spec: int, window: int) -> None:
        n_out = entries["n_out"]
        self.entries, self.num_spec, self.window = entries, num_spec, window
        self.usual = bool(entries.size and num_spec
                          and np.bitwise_and.reduce(entries["flags"]) & RF_NEED_DRAFT
                          and int((n_out - _ONE16).min()) >= num_spec - 1)
        if self.usual:
            n = entries.size
            lo = reply_layout(n, num_spec, 0)
            self.words = words = np.zeros((lo.draft_ids - lo.status) // 8, np.uint64)
            # status: RS_OK (0); window_rows; generation
            rows = np.ndarray((n,), np.uint16, words, lo.window_rows - lo.status)
            np.minimum(entries["anchor_pos"], window, out=rows, casting="unsafe")
            if window > 0xFFFF and int(np.minimum(entries["anchor_pos"], window).max()) > 0xFFFF:
                self.usual = False  # a window the wire's u16 cannot report: not usual
            np.copyto(np.ndarray((n,), np.uint32, words, lo.generation - lo.status),
                      entries["generation"])
            self.ks = np.full(n, num_spec, np.int64)

    def check(self, reply: StepReply, vocab_size: int) -> npt.NDArray[np.int64]:
        """``check_reply_values(reply, entries, vocab_size=..., window=...)``."""
        _check_n_req(reply, self.entries)
        if self.usual and _usual_reply(reply, self, vocab_size):
            return self.ks
        return _values(reply, self.entries, vocab_size, self.window)


def _usual_reply(reply: StepReply, ahead: ValuesAhead, vocab_size: int) -> bool:
    """Whether the reply is of the usual kind (``ValuesAhead``) and keeps 6.3, checked with a
    few reductions over the whole reply; False also when it breaks a rule, for the general
    pass to decide (and name the offender). Statuses, window_rows and generations: one
    comparison of the words that carry them. Confidences in [0, 1] and finite margins >= 0:
    the largest of their bit patterns read as u32 (any negative number, -0.0 included, and
    NaN lie above; -0.0, allowed, is left to the general pass)."""
    if ahead.num_spec != reply.num_spec:
        return False
    if (reply.head_words() != ahead.words).any():
        return False
    m = reply.margin
    return (int(reply.draft_ids.view(np.uint32).max()) < vocab_size
            and int(reply.confidence.view(np.uint32).max()) <= _F32_ONE
            and (m is None or int(m.view(np.uint32).max()) < _F32_INF))


_ONE16 = np.uint16(1)  # n_out - 1 wraps n_out 0 to 65535: "n_out 0 or at least N" is one test
_F32_ONE = 0x3F800000  # 1.0f: the bit patterns of [+0.0, 1.0] are [0, this]
_F32_INF = 0x7F800000  # +inf: the finite non-negative floats lie below it


def _as_objects(entries: Sequence[ReqEntry] | npt.NDArray[Any]) -> Sequence[ReqEntry]:
    return entries_from_view(entries) if isinstance(entries, np.ndarray) else entries


def _raise_first_value(reply: StepReply, entries: Sequence[ReqEntry], ks: list[int],
                       vocab_size: int) -> None:
    for i, (e, k) in enumerate(zip(entries, ks, strict=True)):
        ids, conf = reply.draft_ids[i], reply.confidence[i]
        where = {"entry": i, "slot": e.slot}
        bad = np.flatnonzero((ids[:k] < 0) | (ids[:k] >= vocab_size))
        if bad.size:
            j = int(bad[0])
            raise ReplyValueError(
                f"slot {e.slot} position {j}: draft id {int(ids[j])} outside [0, {vocab_size})",
                position=j, field="draft_ids", value=int(ids[j]), limit=vocab_size, **where)
        bad = np.flatnonzero(~((conf[:k] >= 0.0) & (conf[:k] <= 1.0)))
        if bad.size:
            j = int(bad[0])
            raise ReplyValueError(
                f"slot {e.slot} position {j}: confidence {float(conf[j])!r} is not a"
                " probability", position=j, field="confidence", value=float(conf[j]),
                limit=(0.0, 1.0), **where)
        tails: list[tuple[str, Any]] = [("draft id", ids[k:]), ("confidence", conf[k:])]
        if reply.margin is not None:
            m = reply.margin[i]
            bad = np.flatnonzero(~(np.isfinite(m[:k]) & (m[:k] >= 0.0)))
            if bad.size:
                j = int(bad[0])
                raise ReplyValueError(
                    f"slot {e.slot} position {j}: margin {float(m[j])!r} is not a finite"
                    " top1 - top2", position=j, field="margin", value=float(m[j]), **where)
            tails.append(("margin", m[k:]))
        for what, tail in tails:
            bad = np.flatnonzero(tail != 0)
            if bad.size:
                j = k + int(bad[0])
                raise ReplyValueError(
                    f"slot {e.slot} position {j}: {what} {tail[j - k].item()!r} where the"
                    f" contract requires 0 (n_out {e.n_out}, status {int(reply.status[i])},"
                    f" need_draft {bool(e.flags & RF_NEED_DRAFT)})",
                    position=j, field="draft_ids" if what == "draft id" else what,
                    value=tail[j - k].item(),
                    limit=0, **where)
    raise ReplyValueError("reply values violate section 6.3")  # pass and search disagree


# -- 7.2 step 3: the worker's check of a STEP -----------------------------------------------------
def check_step_shape(view: StepView, *, row_bytes: int, max_slots: int, max_rows_per_step: int,
                     num_spec: int, sampled: bool) -> None:
    """Refuse (BadFrameError) a STEP whose shape breaks 7.2 step 3. ``decode_step`` has already
    checked that the body length is exact."""
    h, e = view.header, view.entries
    if h.row_bytes != row_bytes:
        raise BadFrameError(f"STEP row_bytes {h.row_bytes} is not the session's {row_bytes}",
                            field="row_bytes", value=h.row_bytes, limit=row_bytes)
    if h.step_flags & ~KNOWN_STEP_FLAGS:
        raise BadFrameError(f"STEP step_flags {h.step_flags:#x} hold unknown bits",
                            field="step_flags", value=h.step_flags, limit=KNOWN_STEP_FLAGS)
    if h.reserved:
        raise BadFrameError(f"STEP header reserved field is {h.reserved}, not 0",
                            field="reserved", value=h.reserved, limit=0)
    if h.n_req > max_slots:
        raise BadFrameError(f"STEP n_req {h.n_req} is over max_slots {max_slots}",
                            field="n_req", value=h.n_req, limit=max_slots)
    if h.n_rows > max_rows_per_step:
        raise BadFrameError(f"STEP n_rows {h.n_rows} is over max_rows_per_step"
                            f" {max_rows_per_step}", field="n_rows", value=h.n_rows,
                            limit=max_rows_per_step)
    # The records as 12 little-endian u32 words each (48 bytes), word layout of section 7.3:
    # 0 slot, 1 generation, 2 anchor_pos, 3 anchor_token, 4 n_rows, 5 n_out | flags << 16,
    # 6-7 seed, 8 top_k | reserved << 16, 9 temperature, 10 top_p, 11 reserved. Most rules are
    # "these bits are 0" or "at most this" on one word: one masked compare of the whole table.
    w = e.view(np.dtype("<u4")).reshape(-1, REQ_ENTRY_SIZE // 4)
    n_rows = w[:, 4]
    total = int(n_rows.sum(dtype=np.int64))
    if total != h.n_rows:
        raise BadFrameError(f"entries carry {total} rows in all, the header says n_rows"
                            f" {h.n_rows}", field="n_rows", value=total, limit=h.n_rows)
    if h.n_req == 0:
        return
    mask, upper = _word_bounds(max_slots, num_spec, sampled)
    w5 = w[:, 5]
    ok = (max_slots > 0 and not ((w & mask) > upper).any()
          and not (n_rows > w[:, 2]).any())
    if ok and (w5 & (RF_RELEASE << 16)).any():
        release = (w5 & (RF_RELEASE << 16)) != 0
        ok = not (release & ((n_rows != 0) | ((w5 & (RF_NEED_DRAFT << 16)) != 0))).any()
    if ok and sampled:
        top_k = w[:, 8]  # the reserved half is 0 by now
        floats = w[:, 9:11].view(np.dtype("<f4"))  # temperature, top_p
        temp, top_p = floats[:, 0], floats[:, 1]
        ok = bool(((top_k == 0) | (np.isfinite(temp) & (temp > 0) & np.isfinite(top_p)
                                    & (top_p >= 0) & (top_p <= 1))).all())
    # Slots are below max_slots by now: a repeat is a count above 1.
    if ok and (h.n_req == 1 or int(np.bincount(w[:, 0], minlength=1).max()) == 1):
        return
    _raise_first_shape(view, max_slots, num_spec, sampled)


@lru_cache(maxsize=64)
def _word_bounds(max_slots: int, num_spec: int, sampled: bool) -> tuple[
        npt.NDArray[np.uint32], npt.NDArray[np.uint32]]:
    """Per word of a request entry, (mask, upper): the entry passes the one-word rules of 7.2
    step 3 when ``word & mask <= upper`` for every word. Word 5 keeps n_out (low half) and the
    unknown flag bits (above bit 18): with any unknown bit set it exceeds every n_out bound.
    top_k with the reserved half-word above it, and the reserved word, are bounds too; on a
    greedy session the seed, top_k and both floats must be 0, a float -0.0 included (its sign
    bit is masked off)."""
    full = U32_MASK
    mask = np.zeros(REQ_ENTRY_SIZE // 4, dtype=np.uint32)
    upper = np.full(REQ_ENTRY_SIZE // 4, full, dtype=np.uint32)
    mask[0], upper[0] = full, max(max_slots - 1, 0)  # slot < max_slots
    # n_out <= num_spec and known flags only (num_spec is a u16, below every flag bit)
    mask[5], upper[5] = full & ~(KNOWN_REQ_FLAGS << 16), min(num_spec, 0xFFFF)
    mask[8], upper[8] = full, MAX_TOP_K  # top_k <= 32 and the reserved half 0
    mask[11], upper[11] = full, 0  # reserved
    if not sampled:
        mask[6:9] = full
        upper[6:9] = 0
        mask[9:11], upper[9:11] = 0x7FFFFFFF, 0
    mask.flags.writeable = False
    upper.flags.writeable = False
    return mask, upper


def _raise_first_shape(view: StepView, max_slots: int, num_spec: int, sampled: bool) -> None:
    seen: dict[int, int] = {}
    for i, r in enumerate(view.entries):
        slot = int(r["slot"])
        where: dict[str, Any] = {"entry": i, "slot": slot}
        flags, n_rows, anchor = int(r["flags"]), int(r["n_rows"]), int(r["anchor_pos"])
        if slot >= max_slots:
            raise BadFrameError(f"entry {i}: slot {slot} is not below max_slots {max_slots}",
                                field="slot", value=slot, limit=max_slots, **where)
        if slot in seen:
            raise BadFrameError(f"entry {i}: slot {slot} already appears in entry {seen[slot]}",
                                field="slot", value=slot, **where)
        seen[slot] = i
        if n_rows > anchor:
            raise BadFrameError(f"slot {slot}: n_rows {n_rows} is more than anchor_pos {anchor}"
                                " (rows exist only for positions before the anchor)",
                                field="n_rows", value=n_rows, limit=anchor, **where)
        if int(r["n_out"]) > num_spec:
            raise BadFrameError(f"slot {slot}: n_out {int(r['n_out'])} is over num_spec"
                                f" {num_spec}", field="n_out", value=int(r["n_out"]),
                                limit=num_spec, **where)
        if int(r["top_k"]) > MAX_TOP_K:
            raise BadFrameError(f"slot {slot}: top_k {int(r['top_k'])} is over {MAX_TOP_K}",
                                field="top_k", value=int(r["top_k"]), limit=MAX_TOP_K, **where)
        if flags & ~KNOWN_REQ_FLAGS:
            raise BadFrameError(f"slot {slot}: flags {flags:#x} hold unknown bits"
                                f" {flags & ~KNOWN_REQ_FLAGS:#x}", field="flags", value=flags,
                                limit=KNOWN_REQ_FLAGS, **where)
        if flags & RF_RELEASE and (n_rows or flags & RF_NEED_DRAFT):
            raise BadFrameError(f"slot {slot}: a RELEASE entry carries {n_rows} rows and flags"
                                f" {flags:#x}; it may carry neither rows nor NEED_DRAFT",
                                field="flags", value=flags, **where)
        for name in ("reserved0", "reserved1"):
            if int(r[name]):
                raise BadFrameError(f"slot {slot}: entry {name} is {int(r[name])}, not 0",
                                    field=name, value=int(r[name]), limit=0, **where)
        if sampled:
            temp, top_p = float(r["temperature"]), float(r["top_p"])
            if int(r["top_k"]) > 0 and not (np.isfinite(temp) and temp > 0):
                raise BadFrameError(f"slot {slot}: temperature {temp!r} is not a finite"
                                    " positive number", field="temperature", value=temp,
                                    **where)
            if int(r["top_k"]) > 0 and not (np.isfinite(top_p) and 0 <= top_p <= 1):
                raise BadFrameError(f"slot {slot}: top_p {top_p!r} outside [0, 1]",
                                    field="top_p", value=top_p, limit=(0.0, 1.0), **where)
        else:
            for name in ("seed", "top_k", "temperature", "top_p"):
                if r[name] != 0:
                    raise BadFrameError(f"slot {slot}: {name} {r[name].item()!r} on a greedy"
                                        " session, where sampling fields are 0", field=name,
                                        value=r[name].item(), limit=0, **where)
    raise BadFrameError("STEP shape violates section 7.2 step 3")  # pass and search disagree
