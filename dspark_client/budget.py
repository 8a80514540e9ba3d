"""The row budget: how many rows one STEP may carry, and which slots go when a round asks
for more (docs/architecture.md, "The row budget"; docs/contract.md 7.5).

``RowBudget`` owns the budget in force (``limit``: ``max_rows_per_step``, halved after
repeated size refusals and probed upwards again after a run of good STEPs) and every slot's age
(rounds in a row it was asked for and left out) with the starved flags. ``fit`` picks a round's
entries under the limit, oldest first; ``DraftRounds`` plans the round, asks ``fit`` only when
the plan is over the limit, and reports each STEP's fate (``step_ok``, ``size_refused``). It
reads no other per-slot state and sends nothing. Single-threaded, as ``DraftRounds`` is.
"""

from __future__ import annotations

import logging
import math
from typing import Final

import numpy as np
import numpy.typing as npt

from protocol import wire

from .stats import Stats

__all__ = ["MIN_ROW_BUDGET_PARTS", "PROBE_AFTER_OK_STEPS", "SIZE_FAILURES_TO_SHRINK", "RowBudget",
           "fair_bound_rounds"]

log = logging.getLogger("dspark_client")

Ints = npt.NDArray[np.int64]

# Size refusals in a row (STEPs over SIZE_SUSPECT_BYTES cut off or refused ST_BAD_FRAME) that
# halve the row budget: one alone is as likely a worker restart or a network cut.
SIZE_FAILURES_TO_SHRINK: Final = 2
# Good STEPs after which a lowered budget is doubled again (the worker may have been restarted
# with a larger limit); the wait doubles after every probe that fails, so a worker that keeps
# refusing sees one probe every 256, 512, 1024 ... rounds.
PROBE_AFTER_OK_STEPS: Final = 256
# The row budget never goes under ceil(W / MIN_ROW_BUDGET_PARTS): a resync in at most this many
# STEPs. A worker refusing even that is unusable and the client is disabled, with the sizes.
MIN_ROW_BUDGET_PARTS: Final = 8


def fair_bound_rounds(n_slots: int, budget: int, window: int) -> int:
    """Rounds within which every slot asked for in each of them is sent, for ``n_slots`` slots
    and a row budget ``>= window``: ``ceil(n / (budget // W))`` (docs/architecture.md). A
    slot is *starved* when it has been left out of more rounds in a row than this minus one."""
    if budget < window:  # split resyncs: one slot at a time, ceil(W / budget) parts each
        return max(1, n_slots) * math.ceil(window / max(1, budget))
    return max(1, math.ceil(n_slots / (budget // window)))


class RowBudget:
    """The row budget of one ``DraftRounds`` (its geometry; ``stats`` takes the gauges and
    counters)."""

    def __init__(self, max_slots: int, window: int, row_bytes: int, max_rows_per_step: int,
                 stats: Stats) -> None:
        self.max_slots, self.window, self.row_bytes = max_slots, window, row_bytes
        self.max_rows_per_step = max_rows_per_step
        self.stats = stats
        # Rounds in a row each slot was asked for and left out (its age for the row budget).
        self._waiting: Ints = np.zeros(max_slots, np.int64)
        self._starved = np.zeros(max_slots, bool)
        # The row budget in force: max_rows_per_step, lowered after size refusals.
        self.limit = max_rows_per_step
        self._size_failures = 0  # size refusals in a row
        self._ok_since_cut = 0  # good STEPs since the budget was last lowered
        self._probe_after = PROBE_AFTER_OK_STEPS
        self._probing = False  # the budget was just raised again: a failure lowers it at once
        self._publish()
        stats.set("starved_slots_now", 0)

    def fit(self, s: Ints, a: Ints, kind: Ints, k: Ints) -> tuple[Ints, Ints, Ints, Ints]:
        """Over the row budget: entries oldest first (rounds left out in a row), then
        continuing before resync, then the engine's order, while they fit. The first always
        goes: whole, or its oldest ``budget`` rows when it needs more (a resync in parts). What
        is left out keeps its rows in the ring and ages by one. ``s``, ``a``, ``kind``, ``k``:
        per request its slot, anchor, kind (0 continuing, 1 resync) and rows; returns the
        entries that go, in the engine's order: their requests' indices, kinds, rows and the
        anchors they reach."""
        budget = self.limit
        n = len(s)
        order = np.lexsort((np.arange(n), kind, -self._waiting[s]))
        ko = k[order]
        take = np.zeros(n, bool)  # by place in ``order``: goes out whole
        part = -1  # place in ``order`` of the entry that goes out in part
        rem = budget
        live = np.arange(n)
        # Greedy in order: the longest prefix that fits goes, the entry after it does not;
        # what follows is tried again with what is left. An entry larger than what is left can
        # never fit later (what is left only shrinks), so each pass drops those first.
        while len(live):
            c = np.cumsum(ko[live])
            fit = int(np.searchsorted(c, rem, side="right"))
            take[live[:fit]] = True
            if fit:
                rem -= int(c[fit - 1])
            if fit == len(live):
                break
            if rem == budget:  # nothing with rows went yet: the oldest part now, the rest later
                part = int(live[fit])
                rem = 0
            rest = live[fit + 1:]
            live = rest[ko[rest] <= rem]
        whole = order[take]
        self.sent(s[whole])
        picked = whole
        if part >= 0:
            picked = np.append(whole, order[part])
            self.stats.inc("resync_parts_total")
        picked = np.sort(picked)  # entries in the engine's order
        kp, endp = k[picked], a[picked]
        if part >= 0:
            j = int(np.searchsorted(picked, order[part]))
            endp = endp.copy()
            endp[j] = a[order[part]] - k[order[part]] + budget
            kp = kp.copy()
            kp[j] = budget
        left = np.ones(n, bool)
        left[whole] = False
        left_out = s[left]
        if len(left_out):
            bound = fair_bound_rounds(n, budget, self.window)
            waiting, starved = self._waiting, self._starved
            waiting[left_out] += 1
            newly = left_out[(waiting[left_out] >= bound) & ~starved[left_out]]
            counts = {"deferred_slots_total": len(left_out)}
            if len(newly):
                starved[newly] = True
                counts["starved_slots_total"] = len(newly)
                self.stats.set("starved_slots_now", int(starved.sum()))
                log.warning("remote DSpark: %d slots left out of %d or more rounds in a row by"
                            " the row budget (%d rows per STEP, W %d, %d slots asked)",
                            len(newly), bound, budget, self.window, n)
            self.stats.inc_many(counts)
        return picked, kind[picked], kp, endp

    def forget(self, slots: Ints) -> None:
        """Slots whose requests ended: no age."""
        self._waiting[slots] = 0
        if self._starved[slots].any():
            self._starved[slots] = False
            self.stats.set("starved_slots_now", int(self._starved.sum()))

    def sent(self, slots: Ints) -> None:
        """Slots that went out whole: their age starts again."""
        waiting = self._waiting
        if waiting[slots].any():
            waiting[slots] = 0
            if self._starved[slots].any():
                self._starved[slots] = False
                self.stats.set("starved_slots_now", int(self._starved.sum()))

    # -- the limit after size refusals ------------------------------------------------------------
    def _publish(self) -> None:
        self.stats.set("row_budget", self.limit)
        self.stats.set("fair_bound_rounds",
                              fair_bound_rounds(self.max_slots, self.limit, self.window))

    def step_ok(self) -> None:
        """A STEP went out and was answered: a lowered budget is probed upwards again after
        a run of these."""
        self._size_failures = 0
        self._probing = False
        if self.limit < self.max_rows_per_step:
            self._ok_since_cut += 1
            if self._ok_since_cut >= self._probe_after:
                self.limit = min(self.max_rows_per_step, 2 * self.limit)
                self._ok_since_cut = 0
                self._probing = True
                self.stats.inc("row_budget_probes_total")
                self._publish()
                log.info("remote DSpark: trying STEPs of up to %d rows again",
                         self.limit)

    def size_refused(self, n_rows: int, body: int, reason: str) -> str | None:
        """A STEP of ``n_rows`` rows (``body`` bytes) was cut off or refused for its size
        (``reason``: the outcome's). Returns why the client must be disabled when the budget
        cannot go lower, else None."""
        self._size_failures += 1
        stats = self.stats
        stats.inc("step_size_refusals_total")
        if self._size_failures < SIZE_FAILURES_TO_SHRINK and not self._probing:
            return None
        if self._probing:
            self._probe_after *= 2
        self._probing = False
        self._size_failures = 0
        self._ok_since_cut = 0
        floor = math.ceil(self.window / MIN_ROW_BUDGET_PARTS)
        what = ("refused BAD_FRAME" if reason == "frame_bad_frame_size"
                else "cut off while sending")
        if self.limit <= floor or n_rows <= floor:
            msg = (f"STEPs of {n_rows} rows ({body} bytes) keep being {what}, and a resync"
                   f" cannot be split finer than {floor} rows per STEP (W {self.window},"
                   f" {self.row_bytes}-byte rows); raise the worker's --max-frame-bytes to at"
                   f" least {wire.APP_HEADER_SIZE + body} or check the network path")
            return msg
        self.limit = max(floor, min(self.limit, n_rows) // 2)
        stats.inc("row_budget_cuts_total")
        self._publish()
        log.warning("remote DSpark: STEPs of %d rows (%d bytes) were %s %d times in a row;"
                    " sending at most %d rows (%d bytes) per STEP from now on%s. The worker's"
                    " --max-frame-bytes is probably below the STEPs max_rows_per_step %d allows",
                    n_rows, body, what, SIZE_FAILURES_TO_SHRINK, self.limit,
                    wire.rows_offset_for(self.max_slots) + self.limit * self.row_bytes,
                    ", resyncs split" if self.limit < self.window else "",
                    self.max_rows_per_step)
        return None
