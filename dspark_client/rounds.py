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

Rows in one STEP are bounded by ``max_rows_per_step``: continuing slots go first, then resyncs
(the longest waiting first); a slot that does not fit waits for a later round (target-only this
round, its rows kept in the ring, still marked for resync). Entries keep the engine's order.

Copies per round: a continuing slot's new rows are copied once into staging and scattered from
there into the ring in one call; a resync's rows are gathered from the ring into staging. The
STEP goes out as [headers, staging view] with scatter-gather, so nothing is copied after that.

Lifetime: the arrays of a ``RoundResult`` are views over the client's reply buffer (or this
object's zero arrays) and stay valid until the next ``run``. Copy what must live longer.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Any, Final

import msgspec
import numpy as np
import numpy.typing as npt

from protocol import wire
from protocol.constants import MAX_TOP_K
from protocol.messages import ReqEntry

from .client import RemoteDraftClient
from .ring import TapRing

__all__ = ["NOT_SENT", "DraftRounds", "RoundResult", "SlotRequest"]

# Request status reported for a slot that was not in the STEP (failed round, deferred).
NOT_SENT: Final = 255
_NO_EPOCH: Final = -1


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
        self._waiting: list[int] = [0] * h.max_slots  # rounds a resync was deferred
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
        out = client.step(self._headers, entries, n_rows, self._step_id, epoch=epoch,
                          rows=self.staging[:n_rows])
        resynced = sum(1 for item in plan if item[2])
        synced = self._synced_epoch
        if not out.ok or out.reply is None or out.drafted is None:
            for r in requests:
                synced[r.slot] = _NO_EPOCH
            res = self._failed(n, out.reason or "failed")
            res.rtt_us = out.rtt_us
            return res
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
        (request index, entry, is_resync) per request that fits this round, and the rows
        staged. A continuing slot's new rows are copied once, into staging, and go from there
        to the ring in one scatter; a resync's rows are gathered from the ring."""
        W = self.window
        ring = self.ring
        staging = self.staging
        synced, worker_gen, worker_end = self._synced_epoch, self._worker_gen, self._worker_end
        sampled = self.sampled
        kinds: list[tuple[int, bool, int, int]] = []  # (index, is_resync, rows to send, n_new)
        total = 0
        for i, r in enumerate(requests):
            self._new_request_check(r)
            s, a = r.slot, r.anchor_pos
            rows = r.rows
            n_new = 0 if rows is None else rows.shape[0]
            if synced[s] == epoch and worker_gen[s] == r.generation and \
                    worker_end[s] == a - n_new:
                k = n_new if n_new <= W else W  # the worker keeps only the newest W
                kinds.append((i, False, k, n_new))
            else:
                if n_new:
                    ring.write(s, a - n_new, rows)
                k = ring.available(s, a)  # newest min(W, anchor_pos) when all were given
                kinds.append((i, True, k, n_new))
            total += k
        if total > self.max_rows_per_step:
            kinds = self._fit_budget(requests, kinds)
        plan: list[tuple[int, wire.ReqEntry, bool]] = []
        off = 0
        c_slots: list[int] = []
        c_first: list[int] = []
        c_k: list[int] = []
        c_off: list[int] = []
        for i, is_resync, k, n_new in kinds:
            r = requests[i]
            s, a = r.slot, r.anchor_pos
            if is_resync:
                if k:
                    ring.gather(s, a, k, staging[off:off + k])
                flags = wire.RF_RESET
            else:
                if k:
                    staging[off:off + k] = r.rows[n_new - k:]
                    ring.advance(s, a - k, k)
                    c_slots.append(s)
                    c_first.append(a - k)
                    c_k.append(k)
                    c_off.append(off)
                flags = 0
            if r.n_out:
                flags |= wire.RF_NEED_DRAFT
            # Positional: (slot, generation, anchor_pos, anchor_token, n_rows, n_out, flags,
            # seed, top_k, temperature, top_p), the field order of ReqEntry.
            if sampled and r.top_k:
                e = ReqEntry(s, r.generation, a, r.anchor_token, k, r.n_out, flags, r.seed,
                             r.top_k, r.temperature, r.top_p)
            else:
                e = ReqEntry(s, r.generation, a, r.anchor_token, k, r.n_out, flags)
            plan.append((i, e, is_resync))
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

    def _fit_budget(self, requests: Sequence[SlotRequest], kinds: list[tuple[int, bool, int, int]]
                    ) -> list[tuple[int, bool, int, int]]:
        """Over max_rows_per_step: continuing slots first, then resyncs (the longest waiting
        first); what does not fit waits (its rows still go to the ring, and it resyncs)."""
        waiting = self._waiting
        cont = [x for x in kinds if not x[1]]
        resync = sorted((x for x in kinds if x[1]),
                        key=lambda x: -waiting[requests[x[0]].slot])
        budget = self.max_rows_per_step
        used = 0
        keep = []
        for x in cont + resync:
            i, is_resync, k, n_new = x
            r = requests[i]
            s = r.slot
            if used + k > budget:
                if not is_resync and n_new:  # its rows reach the ring now, the worker later
                    self.ring.write(s, r.anchor_pos - n_new, r.rows)
                self._synced_epoch[s] = _NO_EPOCH
                waiting[s] += 1
                self.client.stats.inc("slots_deferred")
                continue
            used += k
            waiting[s] = 0
            keep.append(x)
        keep.sort(key=lambda x: x[0])  # entries in the engine's order
        return keep

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
