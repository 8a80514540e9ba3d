"""Sessions, slots and generations: the worker's host-side bookkeeping (docs/contract.md 6.2,
7.1, 7.2 steps 2 and 4, section 8's lane reservation).

Pure: no sockets, no clocks (callers pass ``now``), no threads, no torch. What it owns:

* the session table: creation, reconnect (resume or re-create), replacement by client name,
  binding to the connection of the latest accepted HELLO, the seq guard, idle expiry;
* per session and slot, the generation last seen (serial-number arithmetic on u32, 7.1);
* the count of ring lanes reserved by all sessions, so a HELLO that does not fit is refused
  (ST_BUSY, naming the limit: the pool, one connection's or one peer host's share) before
  anything changes; a reservation that sent no STEP for ``reservation_idle_s`` gives its lanes
  up to a HELLO that needs them.

The rings themselves (windows of projected K/V) are the drafter's ``RingPool``, which only the
runner touches; a session's ``lanes`` (slot -> lane id) are set by the runner when it allocates
them, in order with every other ring operation. A table method either raises (a refusal: nothing
changed) or commits; nothing is half applied.
"""

from __future__ import annotations

import enum
import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from protocol.constants import (
    HF_SYNTHETIC,
    REQ_ENTRY_SIZE,
    RF_NEED_DRAFT,
    RF_RELEASE,
    RF_RESET,
    SAMPLE_TOP32,
)
from protocol.errors import BusyError, NoSessionError, StaleSeqError
from protocol.messages import Hello

HALF_RANGE = 1 << 31  # serial-number arithmetic on u32 (RFC 1982): newer iff 0 < diff < 2**31
# Ids of sessions the table let go, remembered with their last seq so that a HELLO for one of
# them must carry a higher seq (6.2, 11): a captured HELLO cannot bring a dropped session back
# and, through its client name, drop the one that replaced it. Oldest forgotten first; 16384
# ids (about 2 MiB) outlast session_idle_s at any rate of new sessions an engine fleet makes.
RETIRED_SESSIONS_MAX = 16384
# Besides, the last few ids each client name let go, kept whatever other names do: the ids a
# replay would target (an engine's previous sessions) survive a churn of other sessions.
RETIRED_PER_NAME = 4
RETIRED_NAMES_MAX = 4096
# Sessions bound to one connection at once: a client holds one (a tool or a test a few).
MAX_SESSIONS_PER_CONNECTION = 4
# Rows a second per reserved lane below which a session's reservation counts as underused
# once it has had reservation_idle_s to show its use: an engine drafting for a request adds
# a row or more per round to its slot, tens of rounds a second, so one at a tenth of its
# slots is above this; a session that keeps a large reservation alive with a row now and then
# is far below. Rows are counted over about reservation_idle_s (a decaying average).
UNDERUSED_ROWS_PER_LANE_S = 1.0


class Outcome(str, enum.Enum):
    """What an accepted HELLO did (6.2)."""

    CREATED = "created"
    RESUMED = "resumed"
    RECREATED = "recreated"


class DropReason(str, enum.Enum):
    """Why a session and its windows went away (6.2, 7.2 step 7)."""

    REPLACED = "replaced"  # a HELLO under another id with the same client name
    RECREATED = "recreated"  # a reconnect HELLO whose fields differ from the first
    EXPIRED = "expired"  # no frame for session_idle_s
    UNUSED = "unused"  # no STEP for reservation_idle_s, and a HELLO needed its lanes
    UNDERUSED = "underused"  # fewer rows than UNDERUSED_ROWS_PER_LANE_S, a HELLO needed them
    GOODBYE = "goodbye"  # the client released it (OP_GOODBYE)
    INTERNAL = "internal"  # the worker failed while applying one of its STEPs
    SHUTDOWN = "shutdown"


class Session:
    """One engine run's state on the worker."""

    __slots__ = (
        "alive",
        "client_name",
        "conn_id",
        "created_at",
        "drafted",
        "generation",
        "hello",
        "lanes",
        "last_active",
        "last_seq",
        "last_step_at",
        "live",
        "max_slots",
        "n_live",
        "peer",
        "rate",
        "rate_at",
        "rows",
        "sampled",
        "session_id",
        "steps",
        "synthetic",
        "use_since",
        "version",
    )

    def __init__(self, session_id: int, hello: Hello, conn_id: int, seq: int,
                 now: float) -> None:
        self.session_id = session_id
        self.hello = hello.without_auth()  # the first HELLO: what a reconnect is compared to
        self.client_name = hello.client_name
        self.conn_id = conn_id
        self.last_seq = seq
        self.created_at = now
        self.last_active = now
        self.last_step_at = now  # its HELLO, then each STEP: how long its lanes went unused
        self.use_since = now  # its use is judged from reservation_idle_s after this
        self.rate = 0.0  # rows a second, a decaying average as of rate_at
        self.rate_at = now
        self.max_slots = hello.max_slots
        self.sampled = hello.sample_mode == SAMPLE_TOP32
        self.synthetic = bool(hello.flags & HF_SYNTHETIC)  # kept out of acceptance figures
        self.generation = np.zeros(self.max_slots, dtype=np.uint32)  # [max_slots]
        self.live = np.zeros(self.max_slots, dtype=bool)  # [max_slots] a generation is known
        self.n_live = 0
        self.lanes: npt.NDArray[np.int64] | None = None  # [max_slots] lane ids, set by runner
        self.alive = True
        self.peer = ""  # the host of its connection (what per-peer limits count by)
        self.steps = 0
        self.rows = 0
        self.drafted = 0
        self.version: Any = None  # the drafter version serving it (versions.Version)

    def __repr__(self) -> str:
        return (f"Session({self.session_id:#010x}, client {self.client_name!r},"
                f" {self.max_slots} slots, {self.n_live} live)")


@dataclass(frozen=True)
class StepPlan:
    """7.1 decided for every entry of one STEP, before anything is applied. Arrays are [n_req].

    ``apply``: the entry's rows (or cut) go into its window; ``reset``: its window is cleared
    first (RF_RESET or a new request); ``release``: RF_RELEASE, the window is freed and the
    generation forgotten; ``stale``: RS_STALE_GENERATION, nothing of the entry applies;
    ``need_draft``: it asks for a draft and is not stale.

    ``steady``: every entry continues its slot's known generation with no RESET or RELEASE (the
    usual STEP): nothing is stale, reset or released, every entry applies, and committing it
    changes no generation. ``anchor_pos``, ``anchor_token``, ``n_rows``, ``n_out`` (int64)
    and ``generation`` (u32, a view of the frame) are the entries' columns, read once for everyone
    downstream."""

    slots: npt.NDArray[np.intp]
    stale: npt.NDArray[np.bool_]
    reset: npt.NDArray[np.bool_]
    release: npt.NDArray[np.bool_]
    apply: npt.NDArray[np.bool_]
    need_draft: npt.NDArray[np.bool_]
    anchor_pos: npt.NDArray[np.int64]
    anchor_token: npt.NDArray[np.int64]
    n_rows: npt.NDArray[np.int64]
    n_out: npt.NDArray[np.int64]
    generation: npt.NDArray[np.uint32]
    steady: bool


def generation_order(new: npt.ArrayLike, old: npt.ArrayLike) -> npt.NDArray[np.int8]:
    """Per element: 1 if ``new`` is newer than ``old`` (serial-number arithmetic on u32:
    ``(new - old) mod 2**32`` in ``[1, 2**31)``), 0 if equal, -1 if older."""
    diff = (np.asarray(new, dtype=np.uint32) - np.asarray(old, dtype=np.uint32)).astype(np.uint32)
    out = np.where(diff == 0, 0, np.where(diff < HALF_RANGE, 1, -1))
    return out.astype(np.int8)


def plan_step(session: Session, entries: npt.NDArray[Any]) -> StepPlan:
    """7.1 for each entry (ENTRY_DTYPE records, already shape-checked). Pure."""
    # The records as u32 words (section 7.3): 0 slot, 1 generation, 2 anchor_pos, 4 n_rows,
    # 5 n_out | flags << 16. Plain column slices are cheaper than structured-field views.
    w = entries.view(np.dtype("<u4")).reshape(-1, REQ_ENTRY_SIZE // 4)
    slots = w[:, 0].astype(np.intp)
    gen = w[:, 1]
    w5 = w[:, 5]
    flags = w5 >> 16
    n_out = (w5 & 0xFFFF).astype(np.int64)
    anchor = w[:, 2].astype(np.int64)
    token = w[:, 3].astype(np.int64)
    n_rows = w[:, 4].astype(np.int64)
    need_draft = (flags & RF_NEED_DRAFT) != 0
    n = slots.size
    known, current = session.live[slots], session.generation[slots]
    if known.all() and not (flags & (RF_RESET | RF_RELEASE)).any() and (current == gen).all():
        no = np.zeros(n, dtype=bool)
        return StepPlan(slots, no, no, no, np.ones(n, dtype=bool), need_draft, anchor, token,
                        n_rows, n_out, gen, True)
    order = generation_order(gen, current)
    stale = known & (order < 0)
    new_request = ~known | (order > 0)
    release = ((flags & RF_RELEASE) != 0) & ~stale
    reset = (new_request | ((flags & RF_RESET) != 0)) & ~stale & ~release
    apply = ~stale & ~release
    need_draft &= ~stale
    return StepPlan(slots, stale, reset, release, apply, need_draft, anchor, token, n_rows, n_out,
                    gen, False)


@dataclass
class HelloResult:
    session: Session
    outcome: Outcome
    dropped: list[tuple[Session, DropReason]] = field(default_factory=list)
    kept: list[Session] = field(default_factory=list)  # same client name, live elsewhere


class SessionTable:
    """Every session the worker holds, by id."""

    def __init__(self, *, max_sessions: int, lane_capacity: int, idle_s: float,
                 retired_max: int = RETIRED_SESSIONS_MAX,
                 max_per_connection: int = MAX_SESSIONS_PER_CONNECTION,
                 max_per_peer: int | None = None,
                 unused_idle_s: float | None = None,
                 lanes_per_connection: int | None = None,
                 lanes_per_peer: int | None = None,
                 reservation_idle_s: float | None = None) -> None:
        self.max_sessions = max_sessions
        self.max_per_connection = max_per_connection
        self.max_per_peer = max_sessions if max_per_peer is None else max_per_peer
        # Lanes the sessions bound to one connection, and those of one peer host, may reserve
        # together (None: the pool's).
        self.lanes_per_connection = lane_capacity if lanes_per_connection is None \
            else lanes_per_connection
        self.lanes_per_peer = lane_capacity if lanes_per_peer is None else lanes_per_peer
        # A session whose latest STEP (or HELLO, before any) is this old gives its lanes up to
        # a HELLO that cannot fit otherwise (None: never).
        self.reservation_idle_s = reservation_idle_s
        # How long a session's rows are averaged over (its use, what underused means).
        self._use_s = reservation_idle_s or 5.0
        # A session that never sent a STEP and whose connection is gone is dropped after this
        # (not idle_s): sessions HELLOed and left behind cannot hold the table for long.
        self.unused_idle_s = idle_s if unused_idle_s is None else min(unused_idle_s, idle_s)
        self.lane_capacity = lane_capacity
        self.idle_s = idle_s
        self.retired_max = retired_max
        self._by_id: dict[int, Session] = {}
        self._retired: OrderedDict[int, int] = OrderedDict()  # session id -> its last seq
        # client name -> {session id: last seq} of its latest RETIRED_PER_NAME retired ids
        self._retired_by_name: OrderedDict[str, dict[int, int]] = OrderedDict()
        self.lanes_reserved = 0
        self._active_slots = 0

    def __len__(self) -> int:
        return len(self._by_id)

    def __iter__(self) -> Any:
        return iter(list(self._by_id.values()))

    def get(self, session_id: int) -> Session | None:
        return self._by_id.get(session_id)

    @property
    def active_slots(self) -> int:
        """Slots with a live generation, over every session."""
        return self._active_slots

    # -- HELLO (6.2) ------------------------------------------------------------------------------
    def hello(self, session_id: int, seq: int, hello: Hello, conn_id: int,
              now: float, live: Callable[[Session], bool] | None = None,
              peer: str = "", connected: Callable[[int], bool] | None = None) -> HelloResult:
        """Accept a HELLO that passed version, auth, identity, geometry and limits: resume,
        re-create or create the session. Raises StaleSeqError or BusyError with nothing
        changed.

        Sessions under the same client name (6.2) are replaced, except: one whose connection
        (``connected(conn_id)``) is open on another peer host is kept (a client name proves
        nothing without a secret, so a stranger's HELLO cannot drop an engine that is still
        connected); one in use on this host (``live(s)``: its connection open, a frame
        lately) is kept while the new session fits beside it, and replaced when it does not
        (a respawned engine is not locked out by its predecessor, stopped moments ago). Kept
        sessions are in ``HelloResult.kept``."""
        # Others bound here that stay (one under the same client name would be replaced).
        here = sum(1 for s in self._by_id.values() if s.conn_id == conn_id
                   and s.session_id != session_id
                   and not (hello.client_name and s.client_name == hello.client_name))
        if here >= self.max_per_connection:
            raise BusyError(f"this connection holds {here} sessions, the limit per connection"
                            f" is {self.max_per_connection}", field="sessions_per_connection",
                            value=here,
                            limit=self.max_per_connection)
        existing = self._by_id.get(session_id)
        clean = hello.without_auth()
        to_drop: list[tuple[Session, DropReason]] = []
        if existing is not None:
            if seq <= existing.last_seq:
                raise StaleSeqError(
                    f"session {session_id:#010x}: HELLO seq {seq} is not above the last seq"
                    f" {existing.last_seq}", field="seq", value=seq, limit=existing.last_seq)
            if clean == existing.hello:
                existing.conn_id = conn_id
                existing.peer = peer
                existing.last_seq = seq
                existing.last_active = now
                return HelloResult(existing, Outcome.RESUMED)
            to_drop.append((existing, DropReason.RECREATED))
            outcome = Outcome.RECREATED
        else:
            retired_seq = self.retired_seq(session_id, hello.client_name)
            if retired_seq is not None and seq <= retired_seq:
                raise StaleSeqError(
                    f"session {session_id:#010x} was dropped; HELLO seq {seq} is not above its"
                    f" last seq {retired_seq}", field="seq", value=seq, limit=retired_seq)
            outcome = Outcome.CREATED
        kept: list[Session] = []
        in_use: list[Session] = []  # on this host and in use: kept while the new one fits
        if hello.client_name:
            for s in self._by_id.values():
                if s.client_name != hello.client_name or s.session_id == session_id:
                    continue
                if s.conn_id == conn_id:
                    to_drop.append((s, DropReason.REPLACED))
                elif s.peer != peer and connected is not None and connected(s.conn_id):
                    kept.append(s)
                elif live is not None and live(s):
                    in_use.append(s)
                else:
                    to_drop.append((s, DropReason.REPLACED))
        try:
            evict = self._place(hello, conn_id, peer, now, to_drop)
        except BusyError:
            if not in_use:
                raise
            to_drop += [(s, DropReason.REPLACED) for s in in_use]
            in_use = []
            evict = self._place(hello, conn_id, peer, now, to_drop)
        unused = [s for s in evict if self.unused(s, now)]
        to_drop += [(s, DropReason.UNUSED if s in unused else DropReason.UNDERUSED)
                    for s in evict]
        for s, _ in to_drop:
            self._remove(s)
        session = Session(session_id, hello, conn_id, seq, now)
        # Lanes that went unused stay unused until a STEP: a re-created session keeps its
        # first's clock, and one that took an unused reservation's lanes keeps that clock, so
        # a hoarder re-HELLOing for the lanes it just lost holds them no longer than before.
        for old in ([existing] if existing is not None else []) + unused:
            session.last_step_at = min(session.last_step_at, old.last_step_at)
        if existing is not None:  # a re-created session is judged on its first's use
            session.use_since = existing.use_since
            session.rate, session.rate_at = existing.rate, existing.rate_at
        session.peer = peer
        self._by_id[session_id] = session
        self._retired.pop(session_id, None)
        self._retired_by_name.get(hello.client_name, {}).pop(session_id, None)
        self.lanes_reserved += session.max_slots
        return HelloResult(session, outcome, to_drop, kept + in_use)

    def _place(self, hello: Hello, conn_id: int, peer: str, now: float,
               going: list[tuple[Session, DropReason]]) -> list[Session]:
        """Whether a new session for ``hello`` fits once ``going`` are dropped: the sessions
        left unused that must give their lanes up for it (none if it fits as it is), or
        BusyError naming the limit it is over. Changes nothing."""
        gone = {s.session_id for s, _ in going}
        stay = [s for s in self._by_id.values() if s.session_id not in gone]
        on_conn = sum(s.max_slots for s in stay if s.conn_id == conn_id)
        if on_conn + hello.max_slots > self.lanes_per_connection:
            raise BusyError(f"HELLO asks for {hello.max_slots} slots; this connection's other"
                            f" sessions hold {on_conn}, the limit per connection is"
                            f" {self.lanes_per_connection} slots (--max-slots-per-connection)",
                            field="max_slots_per_connection", value=on_conn + hello.max_slots,
                            limit=self.lanes_per_connection)
        # What does not fit otherwise takes the lanes of reservations left unused (never a
        # STEP for reservation_idle_s), the longest unused first; then those of underused
        # ones, the least used first.
        unused = sorted((s for s in stay if self.unused(s, now)),
                        key=lambda s: s.last_step_at)
        unused += sorted((s for s in stay if not self.unused(s, now)
                          and self.underused(s, now)), key=lambda s: self.use(s, now))
        evict: dict[int, Session] = {}  # by id, in the order taken

        def take(candidates: list[Session], short: Callable[[], bool]) -> None:
            for s in candidates:
                if not short():
                    return
                evict.setdefault(s.session_id, s)

        def peer_sessions() -> int:
            return sum(1 for s in stay if s.peer == peer and s.session_id not in evict)

        def peer_lanes() -> int:
            return sum(s.max_slots for s in stay if s.peer == peer
                       and s.session_id not in evict)

        def sessions_after() -> int:
            return len(stay) - len(evict) + 1

        def free_lanes() -> int:
            return self.lane_capacity - sum(s.max_slots for s in stay
                                            if s.session_id not in evict)

        mine = [s for s in unused if s.peer == peer]
        take(mine, lambda: peer_sessions() >= self.max_per_peer)
        take(mine, lambda: peer_lanes() + hello.max_slots > self.lanes_per_peer)
        take(unused, lambda: sessions_after() > self.max_sessions)
        take(unused, lambda: hello.max_slots > free_lanes())
        if peer_sessions() >= self.max_per_peer:
            raise BusyError(f"{peer or 'this peer'} holds {peer_sessions()} sessions, the limit"
                            f" per peer is {self.max_per_peer} (--max-sessions-per-peer)",
                            field="max_sessions_per_peer", value=peer_sessions(),
                            limit=self.max_per_peer)
        if peer_lanes() + hello.max_slots > self.lanes_per_peer:
            raise BusyError(f"HELLO asks for {hello.max_slots} slots; sessions from"
                            f" {peer or 'this peer'} hold {peer_lanes()}, the limit per peer"
                            f" is {self.lanes_per_peer} slots (--max-slots-per-peer)",
                            field="max_slots_per_peer", value=peer_lanes() + hello.max_slots,
                            limit=self.lanes_per_peer)
        if sessions_after() > self.max_sessions:
            raise BusyError(f"the worker holds {len(stay) - len(evict)} sessions, its limit is"
                            f" {self.max_sessions} (--max-sessions)", field="max_sessions",
                            value=len(stay) - len(evict), limit=self.max_sessions)
        if hello.max_slots > free_lanes():
            raise BusyError(f"HELLO asks for {hello.max_slots} slots; the ring pool has"
                            f" {free_lanes()} of {self.lane_capacity} free"
                            " (--max-total-slots)", field="max_total_slots",
                            value=hello.max_slots, limit=free_lanes())
        return list(evict.values())

    def unused(self, s: Session, now: float) -> bool:
        """``s`` reserved lanes and sent no STEP for ``reservation_idle_s``."""
        return (self.reservation_idle_s is not None
                and now - s.last_step_at >= self.reservation_idle_s)

    def use(self, s: Session, now: float) -> float:
        """Rows ``s`` sent a second per lane it reserved, over about ``reservation_idle_s``."""
        return s.rate * math.exp((s.rate_at - now) / self._use_s) / s.max_slots

    def underused(self, s: Session, now: float) -> bool:
        """``s`` had ``reservation_idle_s`` to show its use and sends fewer than
        UNDERUSED_ROWS_PER_LANE_S rows a second per lane it reserved."""
        return (self.reservation_idle_s is not None
                and now - s.use_since >= self.reservation_idle_s
                and self.use(s, now) < UNDERUSED_ROWS_PER_LANE_S)

    def reclaimable(self, s: Session, now: float) -> bool:
        """``s`` does not draft in earnest: unused or underused, its lanes (and the version
        it holds) may go to one who needs them."""
        return self.unused(s, now) or self.underused(s, now)

    # -- frames of a session (7.2 step 2) ---------------------------------------------------------
    def bound(self, session_id: int, conn_id: int, seq: int) -> Session:
        """The session, if held and bound to this connection and seq is above its last.
        Changes nothing."""
        s = self._by_id.get(session_id)
        if s is None:
            raise NoSessionError(f"no session {session_id:#010x}", field="session",
                                 value=session_id)
        if s.conn_id != conn_id:
            raise NoSessionError(f"session {session_id:#010x} belongs to another connection",
                                 field="session", value=session_id)
        if seq <= s.last_seq:
            raise StaleSeqError(f"session {session_id:#010x}: seq {seq} is not above the last"
                                f" seq {s.last_seq}", field="seq", value=seq, limit=s.last_seq)
        return s

    @staticmethod
    def touch(session: Session, seq: int, now: float) -> None:
        """An accepted frame of the session: its seq and idle clock move."""
        session.last_seq = seq
        session.last_active = now

    def commit_step(self, session: Session, plan: StepPlan, entries: npt.NDArray[Any], seq: int,
                    now: float) -> None:
        """Record the generations of an accepted STEP (7.1) and its seq."""
        slots = plan.slots
        if slots.size and not plan.steady:  # a steady STEP continues every known generation
            before = int(session.live[slots].sum())
            keep = plan.apply
            session.generation[slots[keep]] = plan.generation[keep]
            session.live[slots[keep]] = True
            session.live[slots[plan.release]] = False
            delta = int(session.live[slots].sum()) - before
            session.n_live += delta
            if session.alive and self._by_id.get(session.session_id) is session:
                self._active_slots += delta
        session.last_seq = seq
        session.steps += 1
        rows = 0
        if slots.size:
            rows = int(plan.n_rows.sum() if plan.steady else plan.n_rows[plan.apply].sum())
            session.rows += rows
        # the decaying average of rows a second: what was, decayed, and these rows
        session.rate = (session.rate * math.exp((session.rate_at - now) / self._use_s)
                        + rows / self._use_s)
        session.last_active = session.last_step_at = session.rate_at = now

    # -- life -------------------------------------------------------------------------------------
    def expire(self, now: float,
               connected: Callable[[int], bool] | None = None) -> list[Session]:
        """Drop every session idle for ``idle_s`` or longer, and every one that never sent a
        STEP, whose connection is gone (``connected(conn_id)`` false) and that is idle for
        ``unused_idle_s``; return them."""
        gone = [s for s in self._by_id.values()
                if now - s.last_active >= self.idle_s
                or (connected is not None and not s.steps
                    and now - s.last_active >= self.unused_idle_s
                    and not connected(s.conn_id))]
        for s in gone:
            self._remove(s)
        return gone

    def drop(self, session: Session) -> bool:
        """Drop the session if it is still the one held under its id; True if it was."""
        if self._by_id.get(session.session_id) is not session:
            return False
        self._remove(session)
        return True

    def retired_seq(self, session_id: int, client_name: str = "") -> int | None:
        """The last seq of a session the table let go, while it is remembered (by id, or among
        the last ids of ``client_name``)."""
        seq = self._retired.get(session_id)
        if seq is None and client_name:
            seq = self._retired_by_name.get(client_name, {}).get(session_id)
        return seq

    def _remove(self, s: Session) -> None:
        del self._by_id[s.session_id]
        self.lanes_reserved -= s.max_slots
        self._active_slots -= s.n_live
        s.alive = False
        retired = self._retired
        last = max(s.last_seq, retired.pop(s.session_id, 0))
        retired[s.session_id] = last
        while len(retired) > self.retired_max:
            retired.popitem(last=False)
        if s.client_name:
            by_name = self._retired_by_name.pop(s.client_name, {})
            by_name.pop(s.session_id, None)
            by_name[s.session_id] = last
            while len(by_name) > RETIRED_PER_NAME:
                del by_name[next(iter(by_name))]
            self._retired_by_name[s.client_name] = by_name
            while len(self._retired_by_name) > RETIRED_NAMES_MAX:
                self._retired_by_name.popitem(last=False)
