"""The runner: batches STEPs of every session onto the device (docs/contract.md 7.2 steps 4-7,
7.4, 8, 9.2; DRAFTER.md "What makes it fast").

Dispatch does everything host-side on arrival (decode, shape checks, generations, seq) and hands
the runner a ``StepItem``; the runner owns the drafter's ``RingPool``, which is not thread-safe:
every ring operation (allocate, free, release, apply, draft) happens here, one batch at a time,
in the order it was submitted.

How a batch forms: the runner task sleeps until something is queued, then takes the queue from
the front, in order, and runs it as one batch on the device thread (``run_in_executor``), so the
event loop keeps receiving while the device works. Everything that arrives meanwhile waits and
becomes the next batch: STEPs from several engines that arrive while the device is busy are
drafted together. A batch is cut before a STEP or lane operation of a session that already has a
STEP in it, so one session's STEPs are never reordered or merged (its second STEP must see the
rings after the first one's draft).

One batch on the device: for each operation in order, lane work (allocate / free / release) or a
STEP's rows (one ``pool.apply`` per STEP, for all its entries) and its window statuses (7.2 step
5); then ONE ``drafter.draft`` over the union of every drafting entry of the batch (one per
drafter version while a reload's old and new versions both serve); then each
STEP's reply is encoded in place (``StepReply.into``) into a buffer its connection reuses. If the
batched draft raises, each STEP is drafted alone so that only the one that fails is refused
(ST_INTERNAL, and dispatch drops its session).

Between batches, when nothing is queued, the runner gives the device to shadow work (the
canary, ``dspark_worker.canary``): one bounded chunk at a time, so a STEP that arrives meanwhile
waits for at most that chunk.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Final, Protocol

import numpy as np
import numpy.typing as npt

from protocol.constants import (
    APP_HEADER_SIZE,
    HF_FOLLOW,
    RPF_MARGIN,
    RPF_NEWER_DRAFTER,
    RPF_NO_CONFIDENCE,
    RPF_SAMPLED,
    RS_NO_WINDOW,
    RS_OK,
    RS_PARTIAL_WINDOW,
    RS_SHED,
    RS_STALE_GENERATION,
)
from protocol.errors import InternalError
from protocol.header import AppHeader
from protocol.messages import StepReply, StepView, reply_layout

from .sessions import Session, StepPlan

log = logging.getLogger(__name__)

Buffer = bytearray | memoryview
_NO_ENTRIES: npt.NDArray[np.intp] = np.zeros(0, dtype=np.intp)
_NO_ENTRIES.flags.writeable = False


class Drafter(Protocol):
    """What the runner needs of ``dspark_worker.drafter`` (its loaded drafter)."""

    num_spec: int

    def draft(self, pool: Any, lanes: Any, anchor_pos: Any, anchor_token: Any, num_spec: int,
              sampling: Any = None) -> Any: ...


class StepItem:
    """One accepted STEP on its way through the device, and then its answer."""

    __slots__ = ("all_ok", "apply_s", "conn", "draft_s", "drafted", "drafting", "encode_s",
                 "error", "header", "n_drafted", "plan", "reply", "reply_buf", "session", "shed",
                 "skipped", "status", "storage", "t_arrival", "t_exec0", "t_exec1", "t_queued",
                 "t_start", "view", "window_rows")

    def __init__(self, conn: Any, header: AppHeader, session: Session, view: StepView,
                 plan: StepPlan, storage: Buffer | None, reply_buf: Buffer, t_arrival: float,
                 shed: bool) -> None:
        self.conn = conn
        self.header = header
        self.session = session
        self.view = view
        self.plan = plan
        self.storage = storage  # the frame body's buffer: back to the pool once answered
        self.reply_buf = reply_buf  # the reply is encoded at offset APP_HEADER_SIZE
        self.t_arrival = t_arrival  # perf_counter at the frame's last byte
        self.shed = shed
        self.t_queued = time.perf_counter()
        self.t_start = 0.0
        self.t_exec0 = self.t_exec1 = 0.0  # the device thread's batch began / ended
        self.apply_s = self.draft_s = self.encode_s = 0.0
        self.status: npt.NDArray[np.uint8] | None = None
        self.window_rows: npt.NDArray[np.int64] | None = None
        self.drafting: npt.NDArray[np.intp] = _NO_ENTRIES
        self.all_ok = False  # every entry RS_OK (status counted without a bincount)
        self.drafted: _Drafted | None = None  # this STEP's rows of the batch's draft
        self.reply: StepReply | None = None
        self.n_drafted = 0
        self.error: BaseException | None = None
        self.skipped = False  # the session was gone before the batch: nothing applied


class LaneOp:
    """Ring work that must happen in order with the STEPs: ``allocate`` a new session's lanes,
    ``free`` a dropped session's, ``release`` (RESET) some slots' windows."""

    __slots__ = ("kind", "session", "slots")

    def __init__(self, kind: str, session: Session,
                 slots: npt.NDArray[np.intp] | None = None) -> None:
        self.kind = kind
        self.session = session
        self.slots = slots


class DeviceCall:
    """A function to run on the device thread in order with the STEPs (freeing the memory of a
    version whose last session's lanes were just freed). What it raises is logged."""

    __slots__ = ("args", "fn", "session")

    def __init__(self, fn: Callable[..., Any], *args: Any) -> None:
        self.fn = fn
        self.args = args
        self.session = None


Op = StepItem | LaneOp | DeviceCall


class Runner:
    """Owns the ring pool; drafts batches of STEPs on the device thread."""

    def __init__(self, drafter: Drafter, pool: Any, *, window: int,
                 complete: Callable[[StepItem], None],
                 on_batch: Callable[[int, int], None] | None = None,
                 make_sampling: Callable[..., Any] | None = None,
                 device_thread: ThreadPoolExecutor | None = None) -> None:
        self.drafter = drafter
        self._on_batch = on_batch
        self._make_sampling = make_sampling or _sampling_params
        self.pool = pool
        self.window = window
        self.num_spec = int(drafter.num_spec)
        # Every reply of a drafter without a confidence head says so (contract 7.4).
        self._reply_flags = RPF_MARGIN | (0 if getattr(drafter, "has_confidence", True)
                                          else RPF_NO_CONFIDENCE)
        self._complete = complete
        self._queue: deque[Op] = deque()
        self.queued_steps = 0
        self._wake = asyncio.Event()
        self._gate = asyncio.Event()
        self._gate.set()
        self._idle = asyncio.Event()
        self._idle.set()
        # The thread that does all device work; the app passes the one that loaded the drafter.
        self._executor = device_thread or new_device_thread()
        self._task: asyncio.Task[None] | None = None
        self.batches = 0
        # Filled by the last batch (the thread writes, the loop reads after the batch).
        self.last_batch_steps = 0
        self.last_batch_entries = 0
        self.batch_log: deque[tuple[int, int]] = deque(maxlen=64)  # (steps, entries) per batch
        # Shadow work for when no STEP waits (the canary, dspark_worker.canary): ``shadow()``
        # gives it or None; it offers pending(), take() (loop thread), run(chunk) (device
        # thread) and drafted(result) (loop thread).
        self.shadow: Callable[[], Any] | None = None
        self.shadow_errors = 0
        self.room = IdleRoom()

    # -- loop side --------------------------------------------------------------------------------
    def start(self, on_death: Callable[[BaseException], None] | None = None) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="dspark-runner")

        def died(task: asyncio.Task[None]) -> None:
            if task.cancelled():
                return
            exc = task.exception()
            if exc is not None:  # a bug: no STEP can be answered any more
                log.critical("the runner stopped: %s: %s", type(exc).__name__, exc,
                             exc_info=exc)
                if on_death is not None:
                    on_death(exc)

        self._task.add_done_callback(died)

    def submit_call(self, fn: Callable[..., Any], *args: Any) -> None:
        self.submit(DeviceCall(fn, *args))

    def submit(self, op: Op) -> None:
        if isinstance(op, StepItem):
            if not self._queue and self._idle.is_set():
                self.room.step_arrived(op.t_arrival)
            self.queued_steps += 1
        self._queue.append(op)
        self._idle.clear()
        self._wake.set()

    def hold(self) -> None:
        """Test hook: stop taking batches (what is queued stays queued) until ``release``."""
        self._gate.clear()

    def release(self) -> None:
        self._gate.set()

    @property
    def alive(self) -> bool:
        return self._task is not None and not self._task.done()

    @property
    def busy(self) -> bool:
        return not self._idle.is_set()

    async def drain(self) -> None:
        """Until every submitted operation has run and been answered."""
        self._gate.set()
        await self._idle.wait()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self._executor.shutdown(wait=True)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._queue and self._gate.is_set() and self.shadow is not None:
                shadow = self.shadow()
                if shadow is not None and shadow.pending():
                    wait = self.room.wait(time.perf_counter())
                    if wait <= 0:
                        await self._run_shadow(loop, shadow)  # the device has room
                        continue
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(self._wake.wait(), wait)
                    continue
            await self._wake.wait()
            await self._gate.wait()
            batch = self._take_batch()
            if not self._queue:
                self._wake.clear()
            if batch:
                # In its own frame: once answered, nothing here holds the items (their rows may
                # be views of a connection's shared-memory region, mapped until the last goes).
                await self._run_batch(loop, batch)
                batch = []
            if not self._queue:
                self._idle.set()

    async def _run_shadow(self, loop: asyncio.AbstractEventLoop, shadow: Any) -> None:
        """One bounded chunk of shadow work on the device thread, then back to the queue."""
        chunk = shadow.take()
        if not chunk:
            return
        t = time.perf_counter()
        try:
            result = await loop.run_in_executor(self._executor, shadow.run, chunk)
            self.room.chunk_done(time.perf_counter() - t)
        except Exception as exc:
            self.shadow_errors += 1
            if self.shadow_errors == 1 or self.shadow_errors % 1000 == 0:
                log.error("canary drafting failed (%d times): %s: %s", self.shadow_errors,
                          type(exc).__name__, exc, exc_info=exc)
            result = []
        shadow.drafted(result)

    async def _run_batch(self, loop: asyncio.AbstractEventLoop, batch: list[Op]) -> None:
        t = time.perf_counter()
        steps = [op for op in batch if isinstance(op, StepItem)]
        for item in steps:
            item.t_start = t
        answered: asyncio.Future[None] = loop.create_future()

        def done(fut: Future[None]) -> None:  # the device thread, as the batch ends
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody to answer
                loop.call_soon_threadsafe(self._answer, steps, fut, answered)

        # The STEPs are answered from the one callback the device thread posts to the loop,
        # not after the asyncio future of run_in_executor wakes this task: one loop turn less
        # between the batch's end and its replies.
        self._executor.submit(self._execute, batch).add_done_callback(done)
        await answered

    def _answer(self, steps: list[StepItem], fut: Future[None],
                answered: asyncio.Future[None]) -> None:
        exc: BaseException | None = (InternalError("the device thread was shut down")
                                     if fut.cancelled() else fut.exception())
        if exc is not None:  # _execute catches per item; this is a bug
            log.error("runner batch failed: %s: %s", type(exc).__name__, exc, exc_info=exc)
            for item in steps:
                if item.error is None and not item.skipped:
                    item.error = exc
        self.batches += 1
        self.room.batch_done(time.perf_counter())
        if self._on_batch is not None:
            self._on_batch(len(steps), self.last_batch_entries)
        for item in steps:
            try:
                self._complete(item)
            except Exception:
                log.exception("completing STEP seq %d failed", item.header.seq)
        steps.clear()
        if not answered.done():
            answered.set_result(None)

    def _take_batch(self) -> list[Op]:
        batch: list[Op] = []
        stepped: set[int] = set()  # id() of sessions with a STEP in this batch
        q = self._queue
        while q:
            op = q[0]
            sid = id(op.session)
            if sid in stepped:
                break
            q.popleft()
            if isinstance(op, StepItem):
                self.queued_steps -= 1
                if not op.session.alive:
                    op.skipped = True
                else:
                    stepped.add(sid)
            batch.append(op)
        return batch

    # -- device side (the device thread) ----------------------------------------------------------
    def _execute(self, batch: list[Op]) -> None:
        t_exec0 = time.perf_counter()
        steps: list[StepItem] = []
        for op in batch:
            if isinstance(op, LaneOp):
                self._lane_op(op)
                continue
            if isinstance(op, DeviceCall):
                try:
                    op.fn(*op.args)
                except Exception:
                    log.exception("device call %s failed", getattr(op.fn, "__name__", op.fn))
                continue
            if op.skipped:
                continue
            t = time.perf_counter()
            try:
                self._apply(op)
            except Exception as exc:
                op.error = exc
            op.apply_s = time.perf_counter() - t
            if op.error is None:
                steps.append(op)
        self._draft_all([s for s in steps if s.drafting.size])
        for item in steps:
            if item.error is not None:
                continue
            t = time.perf_counter()
            try:
                self._encode(item)
            except Exception as exc:
                item.error = exc
            item.encode_s = time.perf_counter() - t
        t_exec1 = time.perf_counter()
        for op in batch:
            if isinstance(op, StepItem):
                op.t_exec0, op.t_exec1 = t_exec0, t_exec1

    def _drafter_of(self, s: Session) -> tuple[Any, Any]:
        """The drafter and ring pool of the session's version (the runner's own for a session
        made without one)."""
        v = s.version
        return (self.drafter, self.pool) if v is None else (v.drafter, v.pool)

    def _lane_op(self, op: LaneOp) -> None:
        s = op.session
        pool = self._drafter_of(s)[1]
        try:
            if op.kind == "allocate":
                s.lanes = pool.allocate(s.max_slots)
            elif s.lanes is None:
                return
            elif op.kind == "free":
                pool.free(s.lanes)
                s.lanes = None
            elif op.kind == "release":
                lanes = s.lanes if op.slots is None else s.lanes[op.slots]
                pool.release(lanes)
        except Exception:
            # The session's STEPs will find no lanes and be answered ST_INTERNAL.
            log.exception("ring %s for session %#010x failed", op.kind, s.session_id)

    def _apply(self, item: StepItem) -> None:
        """7.2 steps 4 and 5 for one STEP."""
        s, plan = item.session, item.plan
        pool = self._drafter_of(s)[1]
        lanes_all = s.lanes
        if lanes_all is None:
            raise InternalError(f"session {s.session_id:#010x} holds no ring lanes")
        anchor, counts = plan.anchor_pos, plan.n_rows
        n = anchor.size
        applied = plan.apply
        # A steady STEP applies every entry: whole columns instead of a boolean selection.
        pick: slice | npt.NDArray[np.bool_] = slice(None) if plan.steady else applied
        wr = np.zeros(n, dtype=np.int64)
        if plan.steady or applied.any():
            lanes = lanes_all[plan.slots[pick]]
            rows = item.view.rows
            if not plan.steady and not applied.all() and counts[~applied].any():
                # A stale entry's rows are left out (7.1): gather the others' rows (a copy; a
                # stale generation is rare and ends the session on the client's side).
                ends = np.cumsum(counts)
                keep = np.concatenate([np.arange(end - c, end) for end, c, a
                                       in zip(ends, counts, applied, strict=True) if a and c]
                                      or [np.zeros(0, dtype=np.int64)])
                rows = rows[keep]
            pool.apply(lanes, anchor[pick], counts[pick], plan.reset[pick], rows)
            wr[pick] = pool.window_rows(lanes, anchor[pick])
        if not plan.steady and plan.release.any():
            pool.release(lanes_all[plan.slots[plan.release]])
        expected = np.minimum(anchor, self.window)
        wr = np.minimum(wr, expected)
        need = plan.need_draft
        full = wr == expected
        if not item.shed and need.all() and full.all():  # the usual STEP: every entry drafts
            item.status = np.full(n, RS_OK, dtype=np.uint8)
            item.window_rows = wr
            item.drafting = np.arange(n, dtype=np.intp)
            item.all_ok = True
            return
        status = np.full(n, RS_OK, dtype=np.uint8)
        status[plan.stale] = RS_STALE_GENERATION
        full &= need
        partial = need & (wr > 0) & (wr < expected)
        status[partial] = RS_PARTIAL_WINDOW
        status[need & (wr == 0) & (expected > 0)] = RS_NO_WINDOW
        drafting = full | partial
        if item.shed:
            status[drafting] = RS_SHED
            drafting[:] = False
        item.status = status
        item.window_rows = wr
        item.drafting = np.flatnonzero(drafting)

    def _draft_all(self, items: list[StepItem]) -> None:
        """One drafter call per version for every drafting entry of the batch (one call in
        all, but while a reload's old and new versions both serve); split the results back."""
        self.last_batch_steps = len(items)
        self.last_batch_entries = int(sum(it.drafting.size for it in items))
        self.batch_log.append((self.last_batch_steps, self.last_batch_entries))
        if not items:
            return
        groups: dict[int, list[StepItem]] = {}
        for item in items:
            groups.setdefault(id(item.session.version), []).append(item)
        for group in groups.values():
            self._draft_group(group)

    def _draft_group(self, items: list[StepItem]) -> None:
        t = time.perf_counter()
        try:
            result = self._draft(items)
        except Exception as exc:
            if len(items) == 1:
                items[0].error = exc
                items[0].draft_s = time.perf_counter() - t
                return
            log.warning("batched draft of %d STEPs failed (%s); drafting each alone",
                        len(items), exc)
            for item in items:
                t1 = time.perf_counter()
                try:
                    self._split(self._draft([item]), [item])
                except Exception as exc1:
                    item.error = exc1
                item.draft_s = time.perf_counter() - t1
            return
        draft_s = time.perf_counter() - t
        for item in items:
            item.draft_s = draft_s
        self._split(result, items)

    def _draft(self, items: list[StepItem]) -> Any:
        lanes, anchor, token = [], [], []  # per item, for its drafting entries
        for item in items:
            s, plan, idx = item.session, item.plan, item.drafting
            if s.lanes is None:
                raise InternalError(f"session {s.session_id:#010x} holds no ring lanes")
            if idx.size == plan.slots.size:  # every entry drafts: the columns as they are
                lanes.append(s.lanes[plan.slots])
                anchor.append(plan.anchor_pos)
                token.append(plan.anchor_token)
            else:
                lanes.append(s.lanes[plan.slots[idx]])
                anchor.append(plan.anchor_pos[idx])
                token.append(plan.anchor_token[idx])

        def joined(cols: list[Any]) -> Any:
            return cols[0] if len(cols) == 1 else np.concatenate(cols)

        # Sampling fields matter only where a sampled session's entry asks for top_k > 0.
        sampling = None
        if any(item.session.sampled for item in items):
            picked = [item.view.entries[item.drafting] for item in items]
            if any(item.session.sampled and bool((e["top_k"] > 0).any())
                   for item, e in zip(items, picked, strict=True)):
                def column(name: str, dtype: Any) -> Any:
                    return joined([e[name] for e in picked]).astype(dtype)

                sampling = self._make_sampling(
                    top_k=column("top_k", np.int64),
                    temperature=column("temperature", np.float32),
                    top_p=column("top_p", np.float32), seed=column("seed", np.uint64),
                    generation=column("generation", np.uint32))
        drafter, pool = self._drafter_of(items[0].session)  # one version (_draft_all)
        return drafter.draft(pool, joined(lanes).astype(np.int64, copy=False),
                             joined(anchor), joined(token), self.num_spec, sampling=sampling)

    @staticmethod
    def _split(result: Any, items: list[StepItem]) -> None:
        """Hand each item its rows of the batched result (views, copied at encode)."""
        at = 0
        for item in items:
            b = item.drafting.size
            item.drafted = _Drafted(result, at, at + b)
            at += b

    def _encode(self, item: StepItem) -> None:
        """7.4 in place: the reply lands at APP_HEADER_SIZE in the connection's buffer."""
        s, plan, N = item.session, item.plan, self.num_spec
        if item.status is None or item.window_rows is None:  # pragma: no cover - by _apply
            raise InternalError("STEP reached encode without statuses")
        v = s.version
        flags = (self._reply_flags if v is None else
                 RPF_MARGIN | (0 if v.has_confidence else RPF_NO_CONFIDENCE))
        flags |= RPF_SAMPLED if s.sampled else 0
        if v is not None and v.superseded and s.hello.flags & HF_FOLLOW:
            flags |= RPF_NEWER_DRAFTER  # 6.5: its client moves to the newest version
        n = plan.slots.size
        reply = StepReply.into(item.reply_buf, APP_HEADER_SIZE, int(item.view.header.step_id),
                               n, N, flags)
        reply.status[:] = item.status
        reply.window_rows[:] = item.window_rows
        reply.generation[:] = plan.generation
        idx, drafted = item.drafting, item.drafted
        if idx.size and drafted is not None:
            # Every entry drafting (the usual STEP) writes whole arrays: slices, not an index.
            to: slice | npt.NDArray[np.intp] = slice(None) if idx.size == n else idx
            n_out = plan.n_out[to]
            r, sl = drafted.result, slice(drafted.lo, drafted.hi)
            if not ((n_out > 0) & (n_out < N)).any():  # every entry wants all N positions
                live = None
                reply.draft_ids[to] = np.asarray(r.draft_ids)[sl, :N]
                reply.confidence[to] = np.asarray(r.confidence)[sl, :N]
                if reply.margin is not None:
                    reply.margin[to] = np.asarray(r.margin)[sl, :N]
                item.n_drafted = idx.size * N
            else:
                ks = np.where(n_out == 0, N, np.minimum(n_out, N))  # [b]
                live = np.arange(N)[None, :] < ks[:, None]  # [b, N]
                reply.draft_ids[to] = np.where(live, np.asarray(r.draft_ids)[sl, :N], 0)
                reply.confidence[to] = np.where(live, np.asarray(r.confidence)[sl, :N], 0.0)
                if reply.margin is not None:
                    reply.margin[to] = np.where(live, np.asarray(r.margin)[sl, :N], 0.0)
                item.n_drafted = int(ks.sum())
            if not (np.isfinite(reply.confidence[to]).all()
                    and (reply.margin is None or np.isfinite(reply.margin[to]).all())):
                # A broken checkpoint (NaN weights): a wrong answer, not a draft to send.
                raise NonFiniteOutput("the drafter's confidences or margins are not finite (NaN"
                                      " or inf): its weights or inputs are broken")
            if reply.sampled_mask is not None and reply.support_ids is not None \
                    and reply.proposal_q is not None:
                smp = item.view.entries["top_k"][idx] > 0  # greedy entries carry no q
                if smp.any():
                    rows = idx[smp]
                    reply.sampled_mask[rows] = 1
                    support = np.asarray(r.support_ids)[sl][smp][:, :N]
                    q = np.asarray(r.proposal_q)[sl][smp][:, :N]
                    if live is not None:
                        m3 = live[smp][:, :, None]  # [b', N, 1]
                        support, q = np.where(m3, support, 0), np.where(m3, q, 0)
                    reply.support_ids[rows] = support
                    reply.proposal_q[rows] = q
        item.reply = reply


class IdleRoom:
    """Whether the device has room for a chunk of shadow work now: the shortest of the last
    GAPS gaps between a batch's end and the next STEP (taken while nothing was queued) against
    how long a chunk takes (a moving average). A chunk runs when it should end before the next
    STEP is due, or once that STEP is overdue (traffic paused). The shortest, not a mean: one
    engine that starts sending STEPs back to back stops the shadow work at its first short
    gap, and it resumes only after GAPS long ones."""

    GAPS: Final = 8
    WEIGHT: Final = 0.2  # of the newest chunk in the moving average

    def __init__(self) -> None:
        self._gaps: deque[float] = deque(maxlen=self.GAPS)
        self.chunk: float | None = None
        self._end = 0.0

    @property
    def gap(self) -> float | None:
        return min(self._gaps) if self._gaps else None

    def batch_done(self, t: float) -> None:
        self._end = t

    def step_arrived(self, t: float) -> None:
        self._gaps.append(max(t - self._end, 0.0))

    def chunk_done(self, seconds: float) -> None:
        self.chunk = (seconds if self.chunk is None
                      else self.chunk + self.WEIGHT * (seconds - self.chunk))

    def wait(self, now: float) -> float:
        """Seconds to wait before a chunk fits (0: now)."""
        gap = self.gap
        if gap is None or self.chunk is None:
            return 0.0
        idle = now - self._end
        if gap - idle >= self.chunk:
            return 0.0
        return max(0.0, 2 * gap + self.chunk - idle)


class NonFiniteOutput(InternalError):
    """The drafter's output is not finite: answered ST_INTERNAL, and /healthz says so."""


def new_device_thread() -> ThreadPoolExecutor:
    """The one thread for every torch call of a worker: loading, the ring pool, warm-up, then
    each batch. One thread, not several: libgomp stops its worker threads spinning between
    parallel regions once more threads own OpenMP teams than there are CPUs, and then every
    small operation waits for a wake-up (measured: a B = 1 draft on 2 threads took 1.3 ms from
    one thread, 4.2 ms once a second thread had run torch too)."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="dspark-device")


def _sampling_params(**fields: Any) -> Any:
    from .drafter import SamplingParams  # torch: imported only once a sampled entry drafts

    return SamplingParams(**fields)


class _Drafted:
    """An item's slice of a batched draft result, until its reply is encoded."""

    __slots__ = ("hi", "lo", "result")

    def __init__(self, result: Any, lo: int, hi: int) -> None:
        self.result = result
        self.lo = lo
        self.hi = hi


def reply_bytes(n_req: int, num_spec: int, sampled: bool) -> int:
    """Bytes of a STEP reply frame, header included."""
    flags = RPF_MARGIN | (RPF_SAMPLED if sampled else 0)
    return APP_HEADER_SIZE + reply_layout(n_req, num_spec, flags).size
