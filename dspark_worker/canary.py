"""The canary: a candidate drafter that drafts in the shadow of the serving versions, judged on
the tokens the engines actually produce (docs/operations.md, "The canary"; contract section 8).

For a fraction of each session's slots, every answered STEP's rows and draft requests are
queued for the canary, which has ring lanes of its own. The runner gives it the device between
batches, a bounded chunk at a time, only when the idle gaps leave room (``runner.IdleRoom``);
under load the backlog is shed oldest first, and a slot whose canary window then lacks rows is
not drafted until it holds exactly the rows the serving drafter drafted from.

Judging: after a STEP at anchor ``p`` with serving drafts ``d``, the slot's next STEP (same
generation, no reset or release, the session's very next STEP) at anchor ``p'`` accepted
``a = p' - p - 1`` of them, so the tokens at ``p + 1 .. p'`` are ``d[:a]`` and the new anchor
token. These accumulate per slot in a chain (a reset, a new generation, a release or a gap ends
it). A canary block drafted at ``p`` counts once its outcome is certain: at its first draft that
differs from the produced token, or once all its k drafts matched; under greedy verification
that is exactly the acceptance it would have had. A block its chain cannot decide counts
nowhere (censored). Sampled sessions: drawn with the session's seed and judged by the same
match, an estimate. The serving versions' outcomes on the same blocks are kept beside it.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import numpy.typing as npt
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from protocol.acceptance import AcceptanceTotals
from protocol.constants import USABLE_REQ_STATUS

from .acceptance import acceptance_families
from .metrics import PREFIX
from .runner import StepItem
from .sessions import Session

log = logging.getLogger("dspark_worker")

# Entries one chunk of canary work drafts at most: a STEP arriving while a chunk runs waits for
# it, so a chunk stays about as long as one small batch of serving drafts.
CHUNK_ENTRIES: Final = 64
# Rows copied for the canary and not yet applied (its backlog); past it the oldest STEPs are
# shed. 64 MiB: ~2600 rows of a Qwen3-4B target, several rounds of a busy worker.
MAX_BACKLOG_BYTES: Final = 64 << 20
# Positions of revealed tokens a chain keeps behind its newest one: a canary block older than
# that (a canary that lags this far) is censored.
CHAIN_TOKENS: Final = 4096
# Sessions whose judged blocks are kept apart for the per-session figures (the most recent),
# and the judged blocks a session needs before it counts there.
SESSIONS_KEPT: Final = 4096
SESSION_MIN_BLOCKS: Final = 16
_USABLE: Final = np.isin(np.arange(256), sorted(USABLE_REQ_STATUS))

Ints = npt.NDArray[np.int64]


def shadowed_slots(session_id: int, key: bytes, max_slots: int, fraction: float
                   ) -> npt.NDArray[np.bool_]:
    """Which slots of a session the canary shadows: ``floor(fraction * max_slots)`` or one
    more of them, spread evenly from an offset keyed by the session (a low-discrepancy pick, so
    small sessions get their share too)."""
    digest = hashlib.blake2b(session_id.to_bytes(4, "little"), key=key, digest_size=8).digest()
    u = int.from_bytes(digest, "little") / 2.0**64
    s = np.arange(max_slots, dtype=np.float64)
    return np.floor((s + 1) * fraction + u) > np.floor(s * fraction + u)


class _Chain:
    """The tokens one slot's request revealed so far, and the canary blocks waiting on them."""

    __slots__ = ("base", "closed", "owner", "pending", "serving", "tokens")

    def __init__(self, anchor: int, token: int, owner: int) -> None:
        self.owner = owner  # the session whose STEPs revealed its tokens
        self.base = anchor  # position of tokens[0]
        self.tokens: list[int] = [token]
        self.closed = False
        # anchor -> the canary block drafted there, until judged
        self.pending: dict[int, _Block] = {}
        # anchor -> (version, k, accepted, confidences) of the serving block judged there
        self.serving: dict[int, tuple[Any, int, int, npt.NDArray[np.float32]]] = {}

    @property
    def end(self) -> int:
        return self.base + len(self.tokens)

    def reveal(self, tokens: list[int]) -> None:
        self.tokens.extend(tokens)
        if len(self.tokens) > 2 * CHAIN_TOKENS:  # keep the newest CHAIN_TOKENS
            cut = len(self.tokens) - CHAIN_TOKENS
            del self.tokens[:cut]
            self.base += cut
            for p in [p for p in self.serving if p < self.base]:
                del self.serving[p]

    def outcome(self, block: _Block) -> int | None:
        """Drafts of ``block`` the target accepted, once certain (None: not yet)."""
        p = block.anchor
        if p + 1 < self.base:
            return None
        for j in range(block.k):
            pos = p + 1 + j
            if pos >= self.end:
                return None
            if self.tokens[pos - self.base] != int(block.ids[j]):
                return j
        return block.k


@dataclass
class _Block:
    anchor: int
    k: int
    ids: npt.NDArray[np.int32]
    confidence: npt.NDArray[np.float32]


class _Slot:
    """A shadowed slot as the loop thread follows it: its generation and chain, and the
    serving drafter's block of the session's latest STEP that carried the slot."""

    __slots__ = ("anchor", "chain", "confidence", "generation", "ids", "k", "step", "version")

    def __init__(self) -> None:
        self.generation = -1
        self.step = -2
        self.anchor = 0
        self.k = 0  # serving drafts at ``anchor`` (0: none)
        self.ids: npt.NDArray[np.int32] = np.zeros(0, np.int32)
        self.confidence: npt.NDArray[np.float32] = np.zeros(0, np.float32)
        self.chain: _Chain | None = None
        self.version: Any = None


class _Shadow:
    """A session as the canary follows it."""

    __slots__ = ("shadowed", "slots", "steps")

    def __init__(self, shadowed: npt.NDArray[np.bool_]) -> None:
        self.shadowed = shadowed
        self.slots: dict[int, _Slot] = {}
        self.steps = 0


@dataclass
class _StepWork:
    """One STEP's shadowed entries for the device thread, the rows they apply copied."""

    session: Session
    slots: Ints
    anchor: Ints
    n_rows: Ints
    reset: npt.NDArray[np.bool_]
    release: npt.NDArray[np.bool_]
    rows: npt.NDArray[np.uint8]
    draft: npt.NDArray[np.bool_]  # the serving drafter drafted the entry (and it has a chain)
    window_rows: Ints  # ... from this many rows
    n_out: Ints
    token: Ints
    sampling: dict[str, Any] | None
    chains: list[_Chain | None]

    @property
    def nbytes(self) -> int:
        return int(self.rows.nbytes)

    @property
    def entries(self) -> int:
        return int(self.slots.size)


@dataclass
class _FreeLanes:
    """A dropped session's canary lanes, freed in order with the STEPs before it."""

    session: Session
    nbytes: int = 0
    entries: int = 0


_Work = _StepWork | _FreeLanes


class Canary:
    """The canary drafter, its rings, its backlog and its judged totals."""

    def __init__(self, drafter: Any, *, fraction: float, capacity_lanes: int, window: int,
                 number: int, name: str, source: str, num_spec: int) -> None:
        self.drafter = drafter
        self.fraction = fraction
        self.number = number
        self.name = name
        self.source = source
        self.num_spec = num_spec
        self.window = window
        self.pool = drafter.new_pool(capacity_lanes, window)
        self.capacity_lanes = capacity_lanes
        self._key = os.urandom(16)
        self._sessions: dict[Session, _Shadow] = {}
        self._backlog: deque[_Work] = deque()
        self._backlog_bytes = 0
        self._in_flight = 0  # STEPs of the chunk on the device, until drafted() has them
        self._lanes: dict[Session, dict[int, int]] = {}  # device thread only
        self.lanes_used = 0
        self.shed_entries = 0
        self.censored = 0
        self.no_lane = 0
        self.has_confidence = bool(getattr(drafter, "has_confidence", True))
        self.totals = AcceptanceTotals(num_spec, self.has_confidence)
        self.serving: dict[int, tuple[str, AcceptanceTotals]] = {}  # by serving version
        # session id -> [blocks, canary's accepted drafts, serving's accepted drafts] judged
        self.by_session: OrderedDict[int, list[int]] = OrderedDict()
        self._lock = threading.Lock()  # the scrape reads the totals

    @property
    def drafter_identity(self) -> bytes:
        return bytes(self.drafter.drafter_identity)

    @property
    def markov_identity(self) -> bytes:
        return bytes(self.drafter.markov_identity)

    @property
    def backlog_steps(self) -> int:
        """STEPs waiting for the canary, the chunk on the device included."""
        return len(self._backlog) + self._in_flight

    # -- the loop thread: what the serving STEPs show ----------------------------------------
    def observe(self, item: StepItem) -> None:
        """A STEP answered ST_OK: reveal tokens to the chains of its shadowed slots, judge what
        that decides, and queue its rows and draft requests for the canary."""
        s = item.session
        v = s.version
        if s.synthetic or not s.alive or (v is not None and v.drafter_identity ==
                                          self.drafter_identity and v.markov_identity ==
                                          self.markov_identity):
            return
        shadow = self._sessions.get(s)
        if shadow is None:
            shadow = self._sessions[s] = _Shadow(shadowed_slots(
                s.session_id, self._key, s.max_slots, self.fraction))
        step = shadow.steps
        shadow.steps = step + 1
        plan, reply = item.plan, item.reply
        picked = np.flatnonzero(shadow.shadowed[plan.slots] & ~plan.stale)
        if not picked.size or reply is None:
            return
        drafted = np.zeros(plan.slots.size, dtype=bool)
        drafted[item.drafting] = True
        status = np.asarray(reply.status)
        k_all = np.where(plan.n_out == 0, self.num_spec, np.minimum(plan.n_out, self.num_spec))
        chains: list[_Chain | None] = []
        for i in picked.tolist():
            slot = int(plan.slots[i])
            st = shadow.slots.get(slot)
            if st is None:
                st = shadow.slots[slot] = _Slot()
            chains.append(self._advance(st, step, v, int(plan.generation[i]),
                                        int(plan.anchor_pos[i]), int(plan.anchor_token[i]),
                                        bool(plan.reset[i]), bool(plan.release[i]),
                                        s.session_id))
            k = int(k_all[i]) if drafted[i] and _USABLE[status[i]] else 0
            st.k = k
            st.ids = np.array(reply.draft_ids[i, :k], dtype=np.int32)
            st.confidence = np.array(reply.confidence[i, :k], dtype=np.float32)
        self._queue(item, picked, drafted, chains, status)

    def _advance(self, st: _Slot, step: int, version: Any, generation: int, anchor: int,
                 token: int, reset: bool, release: bool, owner: int) -> _Chain | None:
        """The slot's next STEP: reveal what it shows about the last block, or end the chain
        and start another. Returns the chain a block drafted now belongs to."""
        chain = st.chain
        continues = (chain is not None and not chain.closed and st.generation == generation
                     and st.step == step - 1 and not reset and not release)
        if continues and chain is not None:
            accepted = anchor - st.anchor - 1
            if 0 <= accepted <= st.k and chain.end == st.anchor + 1:
                chain.reveal([*st.ids[:accepted].tolist(), token])
                if st.k:
                    chain.serving[st.anchor] = (st.version, st.k, accepted, st.confidence)
                self._judge(chain)
            else:
                continues = False
        if not continues:
            self._close(chain)
            chain = None if release else _Chain(anchor, token, owner)
        st.chain, st.generation, st.step, st.anchor, st.version = (chain, generation, step,
                                                                  anchor, version)
        return chain

    def _queue(self, item: StepItem, picked: Ints, drafted: npt.NDArray[np.bool_],
               chains: list[_Chain | None], status: npt.NDArray[np.uint8]) -> None:
        plan, view = item.plan, item.view
        counts = plan.n_rows
        ends = np.cumsum(counts)
        rows_of = [np.arange(ends[i] - counts[i], ends[i]) for i in picked.tolist()
                   if counts[i] and plan.apply[i]]
        table = np.asarray(view.rows).reshape(-1, self.drafter.row_bytes) if rows_of else None
        rows = (np.ascontiguousarray(table[np.concatenate(rows_of)]) if table is not None
                else np.zeros((0, self.drafter.row_bytes), np.uint8))
        n_rows = np.where(plan.apply[picked], counts[picked], 0)
        usable = _USABLE[status[picked]] & drafted[picked]
        sampling = None
        if item.session.sampled:
            e = view.entries[picked]
            sampling = {name: np.array(e[name]) for name in ("top_k", "temperature", "top_p",
                                                              "seed", "generation")}
        work = _StepWork(item.session, slots=plan.slots[picked].astype(np.int64),
                     anchor=plan.anchor_pos[picked].copy(), n_rows=n_rows.astype(np.int64),
                     reset=plan.reset[picked].copy(), release=plan.release[picked].copy(),
                     rows=rows, draft=usable & np.array([c is not None for c in chains]),
                     window_rows=np.asarray(item.window_rows)[picked].astype(np.int64),
                     n_out=plan.n_out[picked].copy(), token=plan.anchor_token[picked].copy(),
                     sampling=sampling, chains=chains)
        self._backlog.append(work)
        self._backlog_bytes += work.nbytes
        while self._backlog_bytes > MAX_BACKLOG_BYTES and self._shed_one():
            pass

    def _shed_one(self) -> bool:
        """Drop the oldest STEP of the backlog (its slots' canary windows then lack its rows
        until they refill); False when only lane frees are left."""
        for i, w in enumerate(self._backlog):
            if isinstance(w, _StepWork):
                del self._backlog[i]
                self._backlog_bytes -= w.nbytes
                self.shed_entries += w.entries
                return True
        return False

    def forget(self, session: Session) -> None:
        """The session is gone: its chains end, its canary lanes are freed in order."""
        shadow = self._sessions.pop(session, None)
        if shadow is None:
            return
        for st in shadow.slots.values():
            self._close(st.chain)
        self._backlog.append(_FreeLanes(session))

    def _close(self, chain: _Chain | None) -> None:
        """No token will come for the chain: its blocks still undecided count nowhere."""
        if chain is None or chain.closed:
            return
        chain.closed = True
        self._judge(chain)

    # -- the device thread -------------------------------------------------------------------
    def pending(self) -> bool:
        return bool(self._backlog)

    def take(self) -> list[_Work]:
        """Loop thread: the next chunk, at most one STEP per session (a session's second STEP
        must see the canary's rings after the first one's draft) and CHUNK_ENTRIES entries."""
        chunk: list[_Work] = []
        seen: set[int] = set()
        entries = 0
        while self._backlog:
            w = self._backlog[0]
            if id(w.session) in seen or (chunk and entries + w.entries > CHUNK_ENTRIES):
                break
            self._backlog.popleft()
            self._backlog_bytes -= w.nbytes
            seen.add(id(w.session))
            entries += w.entries
            chunk.append(w)
        self._in_flight = sum(isinstance(w, _StepWork) for w in chunk)
        return chunk

    def run(self, chunk: list[_Work]) -> list[tuple[_Chain, _Block]]:
        """Device thread: apply each STEP's rows to the canary's rings, then one draft for
        every entry whose canary window holds exactly the rows the serving drafter drafted
        from. Returns the blocks drafted."""
        pool, n = self.pool, self.num_spec
        lanes_all: list[Ints] = []
        anchor_all: list[Ints] = []
        token_all: list[Ints] = []
        k_all: list[Ints] = []
        chains_all: list[_Chain | None] = []
        sampling: dict[str, list[Any]] = {}
        for w in chunk:
            if isinstance(w, _FreeLanes):
                mine = self._lanes.pop(w.session, {})
                if mine:
                    pool.free(np.fromiter(mine.values(), np.int64))
                self.lanes_used -= len(mine)
                continue
            mine = self._lanes.setdefault(w.session, {})
            lanes = np.array([self._lane(mine, int(s)) for s in w.slots], np.int64)
            have = lanes >= 0
            applies = have & ~w.release
            if applies.any():
                # entries without a lane (none free) are left out, and their rows with them
                rows = w.rows if applies.all() else w.rows[np.repeat(applies, w.n_rows)]
                pool.apply(lanes[applies], w.anchor[applies], w.n_rows[applies],
                           w.reset[applies], rows)
            if (w.release & have).any():
                pool.release(lanes[w.release & have])
            draft = w.draft & have
            if not draft.any():
                continue
            wr = pool.window_rows(lanes[draft], w.anchor[draft])
            ok = wr == w.window_rows[draft]
            idx = np.flatnonzero(draft)[ok]
            if not idx.size:
                continue
            lanes_all.append(lanes[idx])
            anchor_all.append(w.anchor[idx])
            token_all.append(w.token[idx])
            k_all.append(np.where(w.n_out[idx] == 0, n, np.minimum(w.n_out[idx], n)))
            chains_all.extend(w.chains[i] for i in idx.tolist())
            for name in ("top_k", "temperature", "top_p", "seed", "generation"):
                col = (w.sampling[name][idx] if w.sampling is not None
                       else np.zeros(idx.size))
                sampling.setdefault(name, []).append(col)
        if not lanes_all:
            return []
        from .drafter import SamplingParams  # torch: the device thread has it loaded

        cat = np.concatenate
        top_k = cat(sampling["top_k"]).astype(np.int64)
        params = None
        if (top_k > 0).any():
            params = SamplingParams(top_k=top_k,
                                    temperature=cat(sampling["temperature"]).astype(np.float32),
                                    top_p=cat(sampling["top_p"]).astype(np.float32),
                                    seed=cat(sampling["seed"]).astype(np.uint64),
                                    generation=cat(sampling["generation"]).astype(np.uint32))
        r = self.drafter.draft(pool, cat(lanes_all), cat(anchor_all), cat(token_all), n,
                               sampling=params)
        ks, anchors = cat(k_all), cat(anchor_all)
        ids, conf = np.asarray(r.draft_ids), np.asarray(r.confidence)
        return [(chain, _Block(int(a), int(k), ids[i, :k].copy(), conf[i, :k].copy()))
                for i, (chain, a, k) in enumerate(zip(chains_all, anchors.tolist(),
                                                      ks.tolist(), strict=True))
                if chain is not None]

    def _lane(self, mine: dict[int, int], slot: int) -> int:
        lane = mine.get(slot)
        if lane is None:
            if self.pool.free_lanes == 0:
                self.no_lane += 1
                return -1
            lane = mine[slot] = int(self.pool.allocate(1)[0])
            self.lanes_used += 1
        return lane

    # -- the loop thread: judging -----------------------------------------------------------
    def drafted(self, blocks: list[tuple[_Chain, _Block]]) -> None:
        """The canary's drafts of a chunk are back (none when it failed): judge each against
        its chain."""
        self._in_flight = 0
        for chain, block in blocks:
            # A chain that ended still judges the blocks its tokens decide: the canary may
            # draft them well after the request (or the session) is gone.
            chain.pending[block.anchor] = block
            self._judge(chain)

    def _judge(self, chain: _Chain) -> None:
        for anchor in list(chain.pending):
            block = chain.pending[anchor]
            got = chain.outcome(block)
            if got is None:
                if chain.closed or anchor + 1 < chain.base:  # no token will come, or its
                    del chain.pending[anchor]  # tokens were let go (it lagged too far)
                    self.censored += 1
                continue
            del chain.pending[anchor]
            serving = chain.serving.get(anchor)
            if serving is None:  # cannot happen: its tokens came with the serving outcome
                self.censored += 1
                continue
            version, k_s, a_s, conf_s = serving
            with self._lock:
                _count(self.totals, block.k, got, block.confidence)
                number = version.number if version is not None else 0
                name = version.name if version is not None else "serving"
                entry = self.serving.get(number)
                if entry is None:
                    entry = self.serving[number] = (name, AcceptanceTotals(
                        self.num_spec, version.has_confidence if version is not None else True))
                _count(entry[1], k_s, a_s, conf_s)
                mine = self.by_session.pop(chain.owner, None) or [0, 0, 0]
                mine[0] += 1
                mine[1] += got
                mine[2] += a_s
                self.by_session[chain.owner] = mine
                while len(self.by_session) > SESSIONS_KEPT:
                    self.by_session.popitem(last=False)

    # -- reading ----------------------------------------------------------------------------
    def rows(self) -> Iterator[tuple[list[str], AcceptanceTotals]]:
        """Label values (drafter, version, name) and totals for the metric families."""
        with self._lock:
            yield ["canary", str(self.number), self.name], self.totals.copy()
            for number, (name, t) in sorted(self.serving.items()):
                yield ["serving", str(number), name], t.copy()

    def summary(self) -> dict[str, Any]:
        with self._lock:
            serving = AcceptanceTotals(self.num_spec, all(
                t.has_confidence for _, t in self.serving.values()))
            for _, t in self.serving.values():
                for attr in ("lengths", "drafted_hist", "predicted"):
                    getattr(serving, attr)[:] += getattr(t, attr)
            return {"version": self.number, "name": self.name, "source": self.source,
                    "drafter_identity": self.drafter_identity.hex(),
                    "markov_identity": self.markov_identity.hex(),
                    "fraction": self.fraction, "lanes": self.capacity_lanes,
                    "lanes_used": self.lanes_used, "backlog_steps": self.backlog_steps,
                    "shed_entries": self.shed_entries, "censored_blocks": self.censored,
                    "acceptance": self.totals.summary(),
                    "serving_acceptance": serving.summary(),
                    "per_session": self._per_session()}

    def _per_session(self) -> dict[str, Any]:
        """Each session one vote: the median over sessions (with SESSION_MIN_BLOCKS judged
        blocks or more) of their mean accepted drafts per block, the canary's and the serving
        drafter's on the same blocks. The pooled figures weigh sessions by their blocks, so a
        session with many slots (or an engine that reports made-up tokens) can carry them; one
        session of three or more cannot carry these."""
        counted = [v for v in self.by_session.values() if v[0] >= SESSION_MIN_BLOCKS]

        def median(values: list[float]) -> float | None:
            return round(float(np.median(values)), 4) if values else None

        return {"sessions": len(counted),
                "mean_accepted_drafts": median([c / n for n, c, _ in counted]),
                "serving_mean_accepted_drafts": median([s / n for n, _, s in counted])}


def _count(t: AcceptanceTotals, k: int, accepted: int, confidence: npt.NDArray[np.float32]
           ) -> None:
    """One judged block of k drafts, ``accepted`` of them accepted, into ``t``."""
    t.lengths[accepted] += 1
    t.drafted_hist[k] += 1
    if t.has_confidence:  # without a confidence head nothing is predicted
        t.predicted[:k] += np.cumprod(np.asarray(confidence[:k], dtype=np.float64))


def canary_lanes(fraction: float, max_total_slots: int) -> int:
    """The canary's ring lanes: its share of every slot the worker can hold."""
    return max(1, min(max_total_slots, math.ceil(fraction * max_total_slots)))


class CanaryFamilies(Collector):
    """``dspark_worker_canary_*``, read at scrape time from the canary ``current()`` gives
    (None: no canary, families without samples)."""

    def __init__(self, current: Callable[[], Canary | None]) -> None:
        self.current = current

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        c = self.current()
        rows = list(c.rows()) if c is not None else []
        yield from acceptance_families(
            f"{PREFIX}_canary_acceptance", "the canary (drafter=canary) and of the serving"
            " versions on the same blocks (drafter=serving)", ["drafter", "version", "name"],
            rows)
        shed = CounterMetricFamily(f"{PREFIX}_canary_shed_entries", "Shadowed STEP entries"
                                   " the canary dropped from its backlog under load (its work"
                                   " waits for an idle device).")
        backlog = GaugeMetricFamily(f"{PREFIX}_canary_backlog_steps",
                                    "STEPs whose rows and drafts wait for the canary.")
        censored = CounterMetricFamily(f"{PREFIX}_canary_censored_blocks",
                                       "Canary blocks whose request ended before their outcome"
                                       " was certain (counted nowhere).")
        if c is not None:
            shed.add_metric([], c.shed_entries)
            backlog.add_metric([], c.backlog_steps)
            censored.add_metric([], c.censored)
        yield shed
        yield backlog
        yield censored
