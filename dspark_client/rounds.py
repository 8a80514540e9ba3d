"""Rank 0's side of the draft rounds (docs/contract.md sections 7.1, 7.3 and 7.5).

The engine calls ``DraftRounds.run`` once per step with, per slot it schedules, the slot's
generation, anchor, the tap rows committed since the last call and the draft depth it wants.
``DraftRounds``:

* keeps every slot's newest W rows in a ``TapRing`` (a resync sends them again);
* decides, per slot, whether the worker's window can be continued or must be resynced: a new
  generation, a new epoch (every accepted HELLO), an unknown apply (timeout, transport error,
  refused reply), a failed round, a PARTIAL_WINDOW or NO_WINDOW reply while the ring holds more,
  or rows that do not continue what the worker last saw. (7.5 resyncs every PARTIAL_WINDOW and
  NO_WINDOW slot; when the ring holds no more than the worker reported, because the engine never
  handed over older rows, that resync would resend the same rows every round, so it is skipped);
* builds the STEP's entries (RF_RESET with the newest ``min(W, anchor_pos)`` rows from the ring
  for a resync, RF_RELEASE for finished slots), gathers the rows once into a reused staging
  buffer and sends [headers, rows] through ``RemoteDraftClient.step`` without another copy;
* returns per slot the usable drafts, or a target-only round when the STEP failed. It never
  waits past the client's ``timeout_ms``, and RS_STALE_GENERATION starts a new session.

Rows in one STEP are bounded by a row budget (``max_rows_per_step``, lowered after STEPs
refused or cut off for their size, see below). Over the budget, entries go oldest first: a slot
left out of a round ages by one, and entries are taken in order of age, then continuing before
resync, then the engine's order, while they fit. The first entry always goes (a resync needs at
most W rows and the budget is at least W), so with ``q = budget // W`` a slot the engine asks for
every round waits at most ``ceil(n / q) - 1`` rounds in a row for n slots asked
(``fair_bound_rounds``); docs/architecture.md has the argument and the trade-off. A slot left
out keeps its rows in the ring and, if the worker's window was valid, stays a continuing slot
with a backlog (the worker's window still ends where it did; the next entry sends the missing
rows, at most W), so one deferral does not turn into a full resync. Entries keep the engine's
order on the wire.

Size refusals (contract 7.5). A STEP whose connection is cut while sending, or that is refused
``ST_BAD_FRAME`` while larger than ``SIZE_SUSPECT_BYTES``, twice in a row, halves the budget
(``row_budget``); below W a resync goes out in parts: RF_RESET with the oldest rows first, then
plain entries that continue it, and the slot drafts when its window reaches the anchor. The
budget is probed upwards again after a run of good STEPs. Under ``MIN_ROW_BUDGET`` the client is
disabled with a message naming the sizes.

Copies per round: a continuing slot's new rows are copied once into staging and scattered from
there into the ring in one call; a resync's rows are gathered from the ring into staging. The
STEP goes out as [headers, staging view] with scatter-gather, so nothing is copied after that.

Lifetime: the arrays of a ``RoundResult`` are views over the client's reply buffer (or this
object's zero arrays) and stay valid until the next ``run``. Copy what must live longer.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable, Sequence
from typing import Any, Final

import msgspec
import numpy as np
import numpy.typing as npt

from protocol import wire
from protocol.constants import MAX_TOP_K
from protocol.messages import ReqEntry

from .client import SIZE_SUSPECT_BYTES, RemoteDraftClient
from .ring import TapRing

__all__ = ["MIN_ROW_BUDGET_PARTS", "NOT_SENT", "PROBE_AFTER_OK_STEPS", "SIZE_FAILURES_TO_SHRINK",
           "DraftRounds", "RoundResult", "SlotRequest", "fair_bound_rounds"]

log = logging.getLogger("dspark_client")

# Request status reported for a slot that was not in the STEP (failed round, deferred).
NOT_SENT: Final = 255
_NO_EPOCH: Final = -1
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
# Entry kinds of a round's plan.
_CONT: Final = 0  # continues the worker's window: new rows, or a backlog from the ring
_RESYNC: Final = 1  # RF_RESET with the ring's newest rows (or its oldest part, when split)


def fair_bound_rounds(n_slots: int, budget: int, window: int) -> int:
    """Rounds within which every slot asked for in each of them is sent, for ``n_slots`` slots
    and a row budget ``>= window``: ``ceil(n / (budget // W))`` (docs/architecture.md). A
    slot is *starved* when it has been left out of more rounds in a row than this minus one."""
    if budget < window:  # split resyncs: one slot at a time, ceil(W / budget) parts each
        return max(1, n_slots) * math.ceil(window / max(1, budget))
    return max(1, math.ceil(n_slots / (budget // window)))


class SlotRequest(msgspec.Struct, gc=False):
    """One slot's part of a round.

    rows: the tap rows of positions ``[anchor_pos - n, anchor_pos)`` committed since the last
        round (``uint8 [n, row_bytes]``, any numpy view; None or n = 0 for none).
    n_out: draft positions wanted (1..N); 0 asks for none this round (rows still apply).
    seed, top_k, temperature, top_p: sampling of the slot's request (sampled sessions only;
        top_k = 0 drafts greedily)."""

    slot: int
    generation: int
    anchor_pos: int
    anchor_token: int
    rows: Any = None
    n_out: int = 0
    seed: int = 0
    top_k: int = 0
    temperature: float = 0.0
    top_p: float = 0.0


class RoundResult(msgspec.Struct, gc=False):
    """What one round gives, in the order of the requests passed to ``run``.

    ok: the worker answered (False: target-only round; ``reason`` says why).
    num_drafted[i]: usable draft positions of request i (0: target-only for that slot).
    draft_ids / confidence / margin ``[n, N]``; support_ids / proposal_q ``[n, N, 32]`` on a
    sampled session. Positions ``j >= num_drafted[i]`` carry zeros. ``status[i]``: the
    request status of section 7.2, or NOT_SENT."""

    ok: bool
    reason: str | None
    num_drafted: npt.NDArray[np.int32]
    status: npt.NDArray[np.uint8]
    draft_ids: npt.NDArray[np.int32]
    confidence: npt.NDArray[np.float32]
    margin: npt.NDArray[np.float32] | None = None
    support_ids: npt.NDArray[np.int32] | None = None
    proposal_q: npt.NDArray[np.uint32] | None = None
    resynced: int = 0
    rows_sent: int = 0
    rtt_us: float = 0.0


class DraftRounds:
    """Rank 0's round driver for one ``RemoteDraftClient`` (single-threaded: the engine's
    scheduler thread)."""

    def __init__(self, client: RemoteDraftClient) -> None:
        h = client.hello
        if h.max_rows_per_step < h.window:
            raise ValueError(f"max_rows_per_step {h.max_rows_per_step} is below the window"
                             f" {h.window}: a resync of one slot could never be sent")
        self.client = client
        self.max_slots = h.max_slots
        self.window = h.window
        self.num_spec = h.num_spec
        self.row_bytes = h.row_bytes
        self.max_rows_per_step = h.max_rows_per_step
        self.sampled = h.sample_mode == wire.SAMPLE_TOP32
        self.ring = TapRing(h.max_slots, h.window, h.row_bytes)
        # Rows go out from here: one gather per round, then scatter-gather send.
        # On a unix+shm:// endpoint this is the shared-memory region (section 13), so the gather
        # is the only copy of a round's rows and nothing crosses the socket.
        self.staging: npt.NDArray[np.uint8] = client.rows_buffer(h.max_rows_per_step)
        self._headers = bytearray(wire.APP_HEADER_SIZE + wire.rows_offset_for(h.max_slots))
        self._step_id = 0
        # Per slot: the engine's generation of its current request (None: free), what the
        # worker last applied (generation, anchor), and the epoch its window is valid in.
        self._gen: list[int | None] = [None] * h.max_slots
        self._worker_gen: list[int | None] = [None] * h.max_slots
        self._worker_end: list[int] = [0] * h.max_slots
        self._synced_epoch: list[int] = [_NO_EPOCH] * h.max_slots
        # Rounds in a row each slot was asked for and left out (its age for the row budget).
        self._waiting: list[int] = [0] * h.max_slots
        self._starved: set[int] = set()
        # The row budget in force: max_rows_per_step, lowered after size refusals.
        self.row_budget = h.max_rows_per_step
        self._size_failures = 0  # size refusals in a row
        self._ok_since_cut = 0  # good STEPs since the budget was last lowered
        self._probe_after = PROBE_AFTER_OK_STEPS
        self._probing = False  # the budget was just raised again: a failure lowers it at once
        self._publish_budget()
        client.stats.set("starved_slots_now", 0)
        N = h.num_spec
        self._zero_ids = np.zeros((h.max_slots, N), np.int32)
        self._zero_conf = np.zeros((h.max_slots, N), np.float32)
        self._zero_sup = np.zeros((h.max_slots, N, MAX_TOP_K), np.int32) if self.sampled else None
        self._zero_q = np.zeros((h.max_slots, N, MAX_TOP_K), np.uint32) if self.sampled else None
        self.rounds = 0
        self.failed_rounds = 0

    # -- public -------------------------------------------------------------------------------
    def needs_resync(self, slot: int) -> bool:
        """Whether the slot's next entry will be a resync (for tests and tools)."""
        epoch = self.client.connection_epoch()
        return epoch is None or self._synced_epoch[slot] != epoch

    def forget(self, slot: int) -> None:
        """Drop rank 0's state of a slot without telling the worker (e.g. after RESET)."""
        self._gen[slot] = None
        self._worker_gen[slot] = None
        self._synced_epoch[slot] = _NO_EPOCH
        self._waiting[slot] = 0
        if slot in self._starved:
            self._starved.discard(slot)
            self.client.stats.set("starved_slots_now", len(self._starved))
        self.ring.clear(slot)

    def run(self, requests: Sequence[SlotRequest], release: Iterable[int] = ()) -> RoundResult:
        """One round: apply the requests' rows to the ring, send one STEP, return the drafts.

        ``release``: slots whose requests finished; the worker frees them (RF_RELEASE) and rank
        0 forgets them. A slot both released and requested is taken as a new request."""
        t0 = time.perf_counter()
        n = len(requests)
        self._validate(requests)
        releases = self._releases(requests, release)
        self.rounds += 1
        client = self.client
        epoch = client.connection_epoch()
        if epoch is None:
            # Target-only: the ring still takes the rows, for the resync after the reconnect.
            for r in requests:
                self._new_request_check(r)
                rows = r.rows
                if rows is not None and rows.shape[0]:
                    self.ring.write(r.slot, r.anchor_pos - rows.shape[0], rows)
                self._synced_epoch[r.slot] = _NO_EPOCH
            return self._failed(n, "disabled" if client.disabled else "not_ready")
        plan, n_rows = self._plan(requests, epoch)
        entries = [item[1] for item in plan] + releases
        if not entries:  # everything deferred: nothing to send this round
            return self._failed(n, "deferred")
        self._step_id += 1
        # No rows (every slot only asks for drafts): the headers are the whole frame.
        out = client.step(self._headers, entries, n_rows, self._step_id, epoch=epoch,
                          rows=self.staging[:n_rows] if n_rows else None)
        resynced = sum(1 for item in plan if item[2])
        if resynced:
            client.stats.inc("slots_resynced", resynced)
        synced = self._synced_epoch
        if not out.ok or out.reply is None or out.drafted is None:
            for r in requests:
                synced[r.slot] = _NO_EPOCH
            body = wire.rows_offset_for(len(entries)) + n_rows * self.row_bytes
            if body > SIZE_SUSPECT_BYTES and out.reason in ("transport_error",
                                                            "frame_bad_frame_size"):
                self._size_refused(n_rows, body, out.reason)
            res = self._failed(n, out.reason or "failed")
            res.rtt_us = out.rtt_us
            return res
        self._step_ok()
        reply = out.reply
        # What the worker now holds, per entry, and whether the slot must resync next time.
        status = reply.status.tolist()
        wrows = reply.window_rows.tolist()
        worker_gen, worker_end = self._worker_gen, self._worker_end
        stale = False
        for pos, (i, e, _) in enumerate(plan):
            s = e.slot
            rs = status[pos]
            if rs == wire.RS_STALE_GENERATION:
                stale = True
                synced[s] = _NO_EPOCH
                continue
            worker_gen[s] = requests[i].generation
            worker_end[s] = e.anchor_pos
            synced[s] = epoch
            # 7.5 resyncs PARTIAL_WINDOW and NO_WINDOW slots; when rank 0's ring holds no more
            # than the worker has (the engine never handed over older rows), a resync would
            # send the same rows again every round, so only a shortfall against the ring counts.
            if (rs == wire.RS_PARTIAL_WINDOW or rs == wire.RS_NO_WINDOW) and \
                    wrows[pos] < self.ring.available(s, e.anchor_pos):
                synced[s] = _NO_EPOCH
        if stale:
            client.new_session("RS_STALE_GENERATION: the worker holds a newer generation"
                               " than rank 0 sent")
        res = self._result(n, [item[0] for item in plan], reply, out.drafted)
        res.resynced = resynced
        res.rows_sent = n_rows
        res.rtt_us = out.rtt_us
        client.stats.inc_many({"rounds_ok": 1,
                               "round_us_total": (time.perf_counter() - t0) * 1e6})
        return res

    # -- the row budget after size refusals ---------------------------------------------------
    def _publish_budget(self) -> None:
        self.client.stats.set("row_budget", self.row_budget)
        self.client.stats.set("fair_bound_rounds",
                              fair_bound_rounds(self.max_slots, self.row_budget, self.window))

    def _step_ok(self) -> None:
        self._size_failures = 0
        self._probing = False
        if self.row_budget < self.max_rows_per_step:
            self._ok_since_cut += 1
            if self._ok_since_cut >= self._probe_after:
                self.row_budget = min(self.max_rows_per_step, 2 * self.row_budget)
                self._ok_since_cut = 0
                self._probing = True
                self.client.stats.inc("row_budget_probes_total")
                self._publish_budget()
                log.info("remote DSpark: trying STEPs of up to %d rows again",
                         self.row_budget)

    def _size_refused(self, n_rows: int, body: int, reason: str) -> None:
        """A STEP of ``n_rows`` rows (``body`` bytes) was cut off or refused for its size."""
        self._size_failures += 1
        stats = self.client.stats
        stats.inc("step_size_refusals_total")
        if self._size_failures < SIZE_FAILURES_TO_SHRINK and not self._probing:
            return
        if self._probing:
            self._probe_after *= 2
        self._probing = False
        self._size_failures = 0
        self._ok_since_cut = 0
        floor = math.ceil(self.window / MIN_ROW_BUDGET_PARTS)
        what = ("refused BAD_FRAME" if reason == "frame_bad_frame_size"
                else "cut off while sending")
        if self.row_budget <= floor or n_rows <= floor:
            msg = (f"STEPs of {n_rows} rows ({body} bytes) keep being {what}, and a resync"
                   f" cannot be split finer than {floor} rows per STEP (W {self.window},"
                   f" {self.row_bytes}-byte rows); raise the worker's --max-frame-bytes to at"
                   f" least {wire.APP_HEADER_SIZE + body} or check the network path")
            self.client.disable(msg)
            return
        self.row_budget = max(floor, min(self.row_budget, n_rows) // 2)
        stats.inc("row_budget_cuts_total")
        self._publish_budget()
        log.warning("remote DSpark: STEPs of %d rows (%d bytes) were %s %d times in a row;"
                    " sending at most %d rows (%d bytes) per STEP from now on%s. The worker's"
                    " --max-frame-bytes is probably below the STEPs max_rows_per_step %d allows",
                    n_rows, body, what, SIZE_FAILURES_TO_SHRINK, self.row_budget,
                    wire.rows_offset_for(self.max_slots) + self.row_budget * self.row_bytes,
                    ", resyncs split" if self.row_budget < self.window else "",
                    self.max_rows_per_step)

    def _releases(self, requests: Sequence[SlotRequest],
                  release: Iterable[int]) -> list[wire.ReqEntry]:
        """RF_RELEASE entries for finished slots (not requested this round), forgetting them."""
        out: list[wire.ReqEntry] = []
        release = list(release)
        if not release:
            return out
        requested = {r.slot for r in requests}
        for s in dict.fromkeys(release):
            self._check_slot(s)
        for s in dict.fromkeys(release):
            if s in requested:
                continue
            g = self._worker_gen[s]
            self.forget(s)
            if g is not None:
                out.append(wire.ReqEntry(slot=s, generation=g, anchor_pos=0, anchor_token=0,
                                         flags=wire.RF_RELEASE))
        return out

    # -- inner ----------------------------------------------------------------------------------
    def _check_slot(self, slot: int) -> None:
        if not (isinstance(slot, (int, np.integer)) and 0 <= slot < self.max_slots):
            raise ValueError(f"slot {slot!r} outside [0, {self.max_slots})")

    def _validate(self, requests: Sequence[SlotRequest]) -> None:
        """Refuse what would make the worker answer ST_BAD_FRAME (fatal for the engine run):
        these are the engine's programming errors, raised before anything is sent."""
        seen: set[int] = set()
        N, rb = self.num_spec, self.row_bytes
        for r in requests:
            s = r.slot
            self._check_slot(s)
            if s in seen:
                raise ValueError(f"slot {s} appears twice in one round")
            seen.add(s)
            if r.generation < 0:
                raise ValueError(f"slot {s}: generation {r.generation} < 0")
            g = self._gen[s]
            if g is not None and r.generation < g:
                raise ValueError(f"slot {s}: generation {r.generation} is older than the"
                                 f" slot's {g}; generations only rise (7.1)")
            if not 0 <= r.anchor_pos <= wire.U32_MASK:
                raise ValueError(f"slot {s}: anchor_pos {r.anchor_pos} outside [0, 2**32)")
            if not 0 <= r.anchor_token <= wire.U32_MASK:
                raise ValueError(f"slot {s}: anchor_token {r.anchor_token} outside [0, 2**32)")
            rows = r.rows
            if rows is not None:
                if not isinstance(rows, np.ndarray) or rows.dtype != np.uint8 or \
                        rows.ndim != 2 or rows.shape[1] != rb:
                    raise ValueError(
                        f"slot {s}: rows must be a uint8 array [n, {rb}], got "
                        f"{getattr(rows, 'dtype', type(rows).__name__)}"
                        f" {getattr(rows, 'shape', '')}")
                if rows.shape[0] > r.anchor_pos:
                    raise ValueError(f"slot {s}: {rows.shape[0]} rows but anchor_pos"
                                     f" {r.anchor_pos}; rows exist only before the anchor")
            if not 0 <= r.n_out <= N:
                raise ValueError(f"slot {s}: n_out {r.n_out} outside [0, {N}]")
            if self.sampled:
                if r.top_k:
                    if not 0 < r.top_k <= MAX_TOP_K:
                        raise ValueError(f"slot {s}: top_k {r.top_k} outside [0, {MAX_TOP_K}]")
                    if not (np.isfinite(r.temperature) and r.temperature > 0):
                        raise ValueError(f"slot {s}: temperature {r.temperature!r} must be a"
                                         " finite number > 0 when top_k > 0")
                    if not (np.isfinite(r.top_p) and 0.0 <= r.top_p <= 1.0):
                        raise ValueError(f"slot {s}: top_p {r.top_p!r} outside [0, 1]")
                    if not 0 <= r.seed < (1 << 64):
                        raise ValueError(f"slot {s}: seed {r.seed} outside [0, 2**64)")
            elif r.top_k or r.seed or r.temperature or r.top_p:
                raise ValueError(f"slot {s}: sampling fields on a greedy session (top_k"
                                 f" {r.top_k}, seed {r.seed}); HELLO with SAMPLE_TOP32 to sample")

    def _new_request_check(self, r: SlotRequest) -> None:
        """A new generation in a slot is a new request: its ring starts empty. A window that
        ends past the anchor is cut there (as the worker does, 7.2 step 4)."""
        s = r.slot
        if self._gen[s] != r.generation:
            self._gen[s] = r.generation
            self.ring.clear(s)
        elif self.ring.end[s] > r.anchor_pos:
            self.ring.truncate(s, r.anchor_pos)

    def _plan(self, requests: Sequence[SlotRequest],
              epoch: int) -> tuple[list[tuple[int, wire.ReqEntry, bool]], int]:
        """Write every request's rows to the ring and stage the rows of the STEP: returns
        (request index, entry, is_resync) per request that goes out this round, and the rows
        staged. A continuing slot's new rows are copied once, into staging, and go from there
        to the ring in one scatter; a backlog's or a resync's rows are gathered from the ring."""
        W = self.window
        ring = self.ring
        staging = self.staging
        synced, worker_gen, worker_end = self._synced_epoch, self._worker_gen, self._worker_end
        sampled = self.sampled
        # (index, kind, rows to send, n_new, fast): fast = continuing with the request's own
        # rows, not yet in the ring.
        kinds: list[tuple[int, int, int, int, bool]] = []
        total = 0
        for i, r in enumerate(requests):
            self._new_request_check(r)
            s, a = r.slot, r.anchor_pos
            rows = r.rows
            n_new = 0 if rows is None else rows.shape[0]
            valid = synced[s] == epoch and worker_gen[s] == r.generation
            wend = worker_end[s]
            if valid and wend == a - n_new:
                k = n_new if n_new <= W else W  # the worker keeps only the newest W
                kinds.append((i, _CONT, k, n_new, True))
            else:
                if n_new:
                    ring.write(s, a - n_new, rows)
                k = ring.available(s, a)  # newest min(W, anchor_pos) when all were given
                if valid and a - k <= wend < a - n_new:
                    # Left out of earlier rounds: the worker's window still ends at wend, and
                    # the ring holds everything after it. Send that backlog, not a resync.
                    k = a - wend
                    kinds.append((i, _CONT, k, n_new, False))
                else:
                    kinds.append((i, _RESYNC, k, n_new, False))
            total += k
        # (index, kind, rows, n_new, fast, entry anchor): the anchor is the request's, or the
        # end of the part sent when a resync or backlog goes out in parts.
        chosen: list[tuple[int, int, int, int, bool, int]]
        if total > self.row_budget:
            chosen = self._fit_budget(requests, kinds, self.row_budget)
        else:
            chosen = [(i, kind, k, n_new, fast, requests[i].anchor_pos)
                      for i, kind, k, n_new, fast in kinds]
            waiting = self._waiting
            for i, *_ in kinds:
                if waiting[requests[i].slot]:
                    self._sent(requests[i].slot)
        plan: list[tuple[int, wire.ReqEntry, bool]] = []
        off = 0
        c_slots: list[int] = []
        c_first: list[int] = []
        c_k: list[int] = []
        c_off: list[int] = []
        for i, kind, k, n_new, fast, end in chosen:
            r = requests[i]
            s, a = r.slot, r.anchor_pos
            if fast:
                if k:
                    staging[off:off + k] = r.rows[n_new - k:]
                    ring.advance(s, a - k, k)
                    c_slots.append(s)
                    c_first.append(a - k)
                    c_k.append(k)
                    c_off.append(off)
                flags = 0
            else:
                if k:
                    ring.gather(s, end, k, staging[off:off + k])
                flags = wire.RF_RESET if kind == _RESYNC else 0
            n_out = r.n_out if end == a else 0  # a part drafts nothing: its anchor is behind
            if n_out:
                flags |= wire.RF_NEED_DRAFT
            # Positional: (slot, generation, anchor_pos, anchor_token, n_rows, n_out, flags,
            # seed, top_k, temperature, top_p), the field order of ReqEntry.
            if sampled and r.top_k:
                e = ReqEntry(s, r.generation, end, r.anchor_token, k, n_out, flags, r.seed,
                             r.top_k, r.temperature, r.top_p)
            else:
                e = ReqEntry(s, r.generation, end, r.anchor_token, k, n_out, flags)
            plan.append((i, e, kind == _RESYNC))
            off += k
        if c_slots:
            self._scatter(c_slots, c_first, c_k, c_off)
        return plan, off

    def _scatter(self, slots: list[int], firsts: list[int], ks: list[int],
                 offs: list[int]) -> None:
        """Continuing slots' rows, already in staging, into the ring in one call."""
        k = np.asarray(ks, dtype=np.int64)
        tot = int(k.sum())
        within = np.arange(tot, dtype=np.int64) - np.repeat(np.cumsum(k) - k, k)
        positions = np.repeat(np.asarray(firsts, dtype=np.int64), k) + within
        slot_idx = np.repeat(np.asarray(slots, dtype=np.int64), k)
        lo = offs[0]
        # The usual case: the continuing rows sit back to back in staging (no resync between
        # them), so the source is a view and the scatter is the only copy.
        if offs[-1] + ks[-1] - lo == tot:
            src = self.staging[lo:lo + tot]
        else:
            src = self.staging[np.repeat(np.asarray(offs, dtype=np.int64), k) + within]
        self.ring.scatter(slot_idx, positions, src)

    def _fit_budget(self, requests: Sequence[SlotRequest],
                    kinds: list[tuple[int, int, int, int, bool]], budget: int
                    ) -> list[tuple[int, int, int, int, bool, int]]:
        """Over the row budget: entries oldest first (rounds left out in a row), then
        continuing before resync, then the engine's order, while they fit. The first always
        goes: whole, or its oldest ``budget`` rows when it needs more (a resync in parts). What
        is left out keeps its rows in the ring and ages by one."""
        waiting = self._waiting
        order = sorted(kinds, key=lambda x: (-waiting[requests[x[0]].slot], x[1], x[0]))
        ring = self.ring
        used = 0
        keep: list[tuple[int, int, int, int, bool, int]] = []
        left_out: list[int] = []
        for i, kind, k, n_new, fast in order:
            r = requests[i]
            s, a = r.slot, r.anchor_pos
            if used + k <= budget:
                used += k
                keep.append((i, kind, k, n_new, fast, a))
                if waiting[s]:
                    self._sent(s)
                continue
            if fast and n_new:  # its rows reach the ring now, the worker later
                ring.write(s, a - n_new, r.rows)
            if used == 0:  # budget < W: the oldest part now, the rest in later rounds
                keep.append((i, kind, budget, n_new, False, a - k + budget))
                used = budget
                self.client.stats.inc("resync_parts_total")
            left_out.append(s)
        keep.sort(key=lambda x: x[0])  # entries in the engine's order
        if left_out:
            bound = fair_bound_rounds(len(requests), budget, self.window)
            starved = self._starved
            newly = 0
            for s in left_out:
                waiting[s] += 1
                if waiting[s] >= bound and s not in starved:
                    starved.add(s)
                    newly += 1
            counts = {"deferred_slots_total": len(left_out)}
            if newly:
                counts["starved_slots_total"] = newly
                self.client.stats.set("starved_slots_now", len(starved))
                log.warning("remote DSpark: %d slots left out of %d or more rounds in a row by"
                            " the row budget (%d rows per STEP, W %d, %d slots asked)", newly,
                            bound, budget, self.window, len(requests))
            self.client.stats.inc_many(counts)
        return keep

    def _sent(self, slot: int) -> None:
        """The slot went out whole after being left out: its age starts again."""
        self._waiting[slot] = 0
        if slot in self._starved:
            self._starved.discard(slot)
            self.client.stats.set("starved_slots_now", len(self._starved))

    def _failed(self, n: int, reason: str) -> RoundResult:
        self.failed_rounds += 1
        self.client.stats.inc("rounds_failed")
        self.client.stats.inc(f"rounds_failed_{reason}")
        return RoundResult(
            ok=False, reason=reason, num_drafted=np.zeros(n, np.int32),
            status=np.full(n, NOT_SENT, np.uint8), draft_ids=self._zero_ids[:n],
            confidence=self._zero_conf[:n], margin=self._zero_conf[:n],
            support_ids=None if self._zero_sup is None else self._zero_sup[:n],
            proposal_q=None if self._zero_q is None else self._zero_q[:n])

    def _result(self, n: int, included: list[int], reply: wire.StepReply,
                drafted: npt.NDArray[np.int64]) -> RoundResult:
        m = len(included)
        num = np.zeros(n, np.int32)
        if m == n:  # every request went out, in order: the reply's rows are the result's
            num[:] = drafted[:n]
            return RoundResult(
                ok=True, reason=None, num_drafted=num, status=reply.status[:n],
                draft_ids=reply.draft_ids[:n], confidence=reply.confidence[:n],
                margin=None if reply.margin is None else reply.margin[:n],
                support_ids=None if reply.support_ids is None else reply.support_ids[:n],
                proposal_q=None if reply.proposal_q is None else reply.proposal_q[:n])
        # Some requests were deferred: scatter the reply's rows to the requests' places.
        idx = np.asarray(included, dtype=np.int64)
        num[idx] = drafted[:m]
        status = np.full(n, NOT_SENT, np.uint8)
        status[idx] = reply.status[:m]

        def scatter(a: Any) -> Any:
            if a is None:
                return None
            out = np.zeros((n, *a.shape[1:]), a.dtype)
            out[idx] = a[:m]
            return out

        return RoundResult(
            ok=True, reason=None, num_drafted=num, status=status,
            draft_ids=scatter(reply.draft_ids), confidence=scatter(reply.confidence),
            margin=scatter(reply.margin), support_ids=scatter(reply.support_ids),
            proposal_q=scatter(reply.proposal_q))
