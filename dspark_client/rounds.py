"""Rank 0's side of the draft rounds (docs/contract.md sections 7.1, 7.3 and 7.5).

The engine calls ``DraftRounds.run_batch`` (or ``run``, the same with one ``SlotRequest`` per
slot) once per step with, per slot it schedules, the slot's generation, anchor, the tap rows
committed since the last call and the draft depth it wants. ``run_batch`` takes them as arrays
(the form an engine's input batch already has) and does its work in numpy calls over all
slots at once, so its cost hardly grows with the slots; ``run`` gathers the requests' fields
into those arrays and calls it. ``DraftRounds``:

* keeps every slot's newest W rows in a ``TapRing`` (a resync sends them again): every round's
  new rows go into it in one scatter;
* decides, per slot, whether the worker's window can be continued or must be resynced: a new
  generation, a new epoch (every accepted HELLO), an unknown apply (timeout, transport error,
  refused reply), a failed round, a PARTIAL_WINDOW or NO_WINDOW reply while the ring holds more,
  or rows that do not continue what the worker last saw. (7.5 resyncs every PARTIAL_WINDOW and
  NO_WINDOW slot; when the ring holds no more than the worker reported, because the engine never
  handed over older rows, that resync would resend the same rows every round, so it is skipped);
* builds the STEP's entries as one ``ENTRY_DTYPE`` array (RF_RESET with the newest
  ``min(W, anchor_pos)`` rows from the ring for a resync, RF_RELEASE for finished slots) and
  sends [headers, rows] through ``RemoteDraftClient.step``;
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

Copies per round: every new row is copied once into the ring. When every slot continues with
exactly its new rows (the usual round), the STEP's rows are the engine's own array, sent as it
is (on a ``unix+shm://`` endpoint copied once into the shared region instead); otherwise the
STEP's rows are gathered from the ring into the staging buffer in one call. Nothing is copied
after that: the STEP goes out as [headers, rows] with scatter-gather.

Lifetime: the arrays of a ``RoundResult`` are views over the client's reply buffer (or this
object's zero arrays) and stay valid until the next round. Copy what must live longer.

What lives apart, and what cannot. The row budget (the limit, its cuts and probes, every slot's
age and which entries go when a round is over it) is ``dspark_client.budget.RowBudget``, and
the result assembly (the reply's arrays in the engine's order, or a target-only round) is
``dspark_client.results.Results``: each reads nothing of the per-slot state below and is told
what happened. The input checks, the resync planning, the usual-round shortcut, the ring writes,
the staging and the entries stay here, in one class of about a thousand lines, because they
are one pass over the same per-slot arrays (the engine's generation, the worker's generation
and window end, the epoch each window is valid in, the last usual round): the checks refuse a
generation against the slot's current one, the plan decides continue or resync from the
worker's view, the shortcut skips the plan only because the last round left every one of those
arrays in a known state, and a failed STEP rolls all of them back together. Split across
modules, each would either hand these arrays to the others every round or keep a copy of the
shortcut's invariant, and the invariant is what a change here must keep.
"""

from __future__ import annotations

import logging
import operator
import time
from collections.abc import Iterable, Sequence
from typing import Any, Final

import msgspec
import numpy as np
import numpy.typing as npt

from protocol import wire
from protocol.constants import MAX_TOP_K

from .budget import (
    MIN_ROW_BUDGET_PARTS,
    PROBE_AFTER_OK_STEPS,
    SIZE_FAILURES_TO_SHRINK,
    RowBudget,
    fair_bound_rounds,
)
from .client import SIZE_SUSPECT_BYTES, RemoteDraftClient
from .results import NOT_SENT, Results, RoundResult
from .ring import TapRing

__all__ = ["MIN_ROW_BUDGET_PARTS", "NOT_SENT", "PROBE_AFTER_OK_STEPS", "SIZE_FAILURES_TO_SHRINK",
           "DraftRounds", "RoundResult", "SlotRequest", "fair_bound_rounds"]

log = logging.getLogger("dspark_client")

Ints = npt.NDArray[np.int64]

_NO_EPOCH: Final = -1
_NONE: Final = -1  # "no generation" in the per-slot generation arrays
# Entry kinds of a round's plan.
_CONT: Final = 0  # continues the worker's window: new rows, or a backlog from the ring
_RESYNC: Final = 1  # RF_RESET with the ring's newest rows (or its oldest part, when split)
_NO_ENTRIES: Final = np.zeros(0, wire.ENTRY_DTYPE)
# Generations are kept as int64 (the wire carries the low 32 bits, 7.1).
_MAX_GENERATION: Final = (1 << 63) - 1
_U8: Final = np.dtype(np.uint8)
# While rounds go without drafts for want of a worker (none reachable, or the client disabled
# by a refusal), one WARNING per this many seconds says so with the reason: the client's own
# lines come once, at the failure, and scroll away while the engine serves target-only.
NO_WORKER_LOG_S: Final = 60.0
_BASE: Final = operator.attrgetter("base")


class SlotRequest(msgspec.Struct, gc=False):
    """One slot's part of a round (``DraftRounds.run``).

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


class _Round(msgspec.Struct, gc=False):
    """One round's requests as arrays (int64 unless said), checked."""

    slots: Ints
    generation: Ints
    anchor_pos: Ints
    anchor_token: Ints
    n_out: Ints
    n_rows: Ints
    rows: npt.NDArray[np.uint8] | None
    row_offsets: Ints | None  # None: back to back in ``rows``, in request order
    seed: npt.NDArray[np.uint64] | None  # the sampling fields, None on a greedy session
    top_k: Ints | None
    temperature: npt.NDArray[np.float64] | None
    top_p: npt.NDArray[np.float64] | None
    # The checks found it continuing the last round (``_Usual``): the same slots in the same
    # order, the same generations, the rows starting where the last anchors were.
    usual: bool = False
    same_sampling: bool = False  # the sampling columns are the last round's (``_Usual``)
    # ``run``'s requests' own row arrays, in request order, when they go out as they are
    # (``rows`` is then None until ``_write_rows`` joins them for the ring).
    parts: list[npt.NDArray[np.uint8]] | None = None


class _Usual(msgspec.Struct, gc=False):
    """The last round, kept when every request went out whole and every window the worker
    holds stayed valid (no resync owed): a round with the same slots in the same order, the
    same generations and new rows that start at the last anchors continues every slot, which
    three whole-array comparisons show, so its checks and decisions need nothing else."""

    slots: Ints  # copies: the engine may reuse its arrays
    generation: Ints
    anchor_pos: Ints
    epoch: int
    entries: npt.NDArray[Any]  # that STEP's entries: slot and generation stay as they are
    # A sampled session's (seed, top_k, temperature, top_p) of that round, as checked (the
    # seed zero where top_k is): a round that gives them again needs no checks for them, and
    # its entries' sampling fields are already written.
    sampling: tuple[Any, Any, Any, Any] | None = None


class _Later:
    """Work for the round trip (``RemoteDraftClient.step(while_waiting=...)``): run once, in
    the transport or, when the STEP was never sent, by ``finish``; an error is raised from
    ``finish``, not inside the transport."""

    __slots__ = ("args", "done", "error", "fn")

    def __init__(self, fn: Any, *args: Any) -> None:
        self.fn, self.args = fn, args
        self.done = False
        self.error: BaseException | None = None

    def __call__(self) -> None:
        if not self.done:
            self.done = True
            try:
                self.fn(*self.args)
            except BaseException as exc:  # raised again by finish()
                self.error = exc

    def finish(self) -> None:
        self()
        if self.error is not None:
            raise self.error


def _column(values: Any, n: int, name: str, dtype: Any) -> Any:
    """``values`` (one per request, or one for all) as an array of ``dtype``. Values the dtype
    cannot hold are kept as Python objects, so that the range checks name them."""
    if type(values) is np.ndarray and values.dtype == dtype and values.shape == (n,):
        return values  # the usual batch column: as it is
    if type(values) is int and dtype is np.int64 and -(1 << 63) <= values < (1 << 63):
        return np.full(n, values, np.int64)  # one value for all, as it is
    raw = np.asarray(values)
    if raw.ndim == 0:
        raw = np.full(n, raw[()], raw.dtype)
    if raw.shape != (n,):
        raise ValueError(f"{name} has shape {raw.shape}, expected ({n},): one per request")
    if not n:
        return np.zeros(0, dtype)
    kind, want = raw.dtype.kind, np.dtype(dtype).kind
    if kind == "O":
        return raw
    if kind not in ("iub" if want in "iu" else "iubf"):
        raise ValueError(f"{name} must be {'integers' if want in 'iu' else 'numbers'},"
                         f" got {raw.dtype}")
    if n and ((kind == "u" and want == "i" and raw.max() > np.iinfo(np.int64).max)
              or (kind == "i" and want == "u" and raw.min() < 0)):
        return raw.astype(object)
    return raw.astype(dtype, copy=False)


# Up to this many requests, a column's bounds and comparisons go through Python ints: on a few
# values numpy's fixed cost per call is most of the work.
_FEW: Final = 4


def _bounds(x: Any) -> tuple[Any, Any]:
    """(min, max) of a non-empty column."""
    if len(x) <= _FEW:
        v = x.tolist()
        return min(v), max(v)
    return x.min(), x.max()


def _py(value: Any) -> Any:
    """A numpy scalar as the Python value (for messages)."""
    return value.item() if isinstance(value, np.generic) else value


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
        # Rows that do not go out as the engine's own array are gathered here. On a
        # unix+shm:// endpoint this is the shared-memory region (section 13), so the gather is
        # the only copy of a round's rows and nothing crosses the socket.
        self.staging: npt.NDArray[np.uint8] = client.rows_buffer(h.max_rows_per_step)
        self._shm = client.shm_region is not None
        # The array whose memory staging is: what views of it (an engine's own, say) name
        # as their base.
        self._staging_owner = self.staging if self.staging.base is None else self.staging.base
        self._headers = bytearray(wire.APP_HEADER_SIZE + wire.rows_offset_for(h.max_slots))
        self._step_id = 0
        S = h.max_slots
        # Per slot: the engine's generation of its current request (_NONE: free), what the
        # worker last applied (generation, anchor), and the epoch its window is valid in.
        self._gen: Ints = np.full(S, _NONE, np.int64)
        self._worker_gen: Ints = np.full(S, _NONE, np.int64)
        self._worker_end: Ints = np.zeros(S, np.int64)
        self._synced_epoch: Ints = np.full(S, _NO_EPOCH, np.int64)
        # The rows one STEP may carry, and every slot's age for it.
        self.budget = RowBudget(S, h.window, h.row_bytes, h.max_rows_per_step, client.stats)
        N = h.num_spec
        self.results = Results(S, N, self.sampled)
        self.rounds = 0
        self.failed_rounds = 0
        # The last round when the next may continue it (``_Usual``); False: never (the rounds
        # then always take the general path, which gives the same STEPs, for tests).
        self._usual: _Usual | None = None
        self.fast_path = True
        self._all = np.arange(S, dtype=np.int64)
        self._zeros = np.zeros(S, np.int64)
        # Since when rounds have had no worker (None: they have one), the rounds since, and
        # when that was last logged.
        self._no_worker_since: float | None = None
        self._no_worker_rounds = 0
        self._no_worker_logged = 0.0

    # -- public -------------------------------------------------------------------------------
    @property
    def row_budget(self) -> int:
        """The rows one STEP may carry now (``RowBudget.limit``)."""
        return self.budget.limit

    @row_budget.setter
    def row_budget(self, rows: int) -> None:
        self.budget.limit = rows

    def needs_resync(self, slot: int) -> bool:
        """Whether the slot's next entry will be a resync (for tests and tools)."""
        epoch = self.client.connection_epoch()
        return epoch is None or int(self._synced_epoch[slot]) != epoch

    def forget(self, slot: int) -> None:
        """Drop rank 0's state of a slot without telling the worker (e.g. after RESET)."""
        self._forget(np.asarray([slot], np.int64))

    def run(self, requests: Sequence[SlotRequest], release: Iterable[int] = ()) -> RoundResult:
        """One round, one ``SlotRequest`` per slot: ``run_batch`` with the requests' fields
        gathered into arrays. Over a socket the usual round sends each request's rows array
        as it is (when all are C-contiguous ``uint8 [n, row_bytes]``) and joins them for the
        ring while the reply is on its way; otherwise, and on a ``unix+shm://`` endpoint, they
        are copied back to back once first (into the staging buffer when they fit).

        ``release``: slots whose requests finished; the worker frees them (RF_RELEASE) and rank
        0 forgets them. A slot both released and requested is taken as a new request."""
        n = len(requests)
        if n:
            (slots, gens, anchors, tokens, rows_in, n_out, seeds, top_ks, temps,
             top_ps) = zip(*map(msgspec.structs.astuple, requests), strict=True)
        else:
            slots = gens = anchors = tokens = rows_in = n_out = seeds = top_ks = temps = \
                top_ps = ()
        if n:
            # The five integer columns in one conversion; any value int64 cannot hold (or not
            # an integer) leaves them to the per-column checks, which name it.
            ints = np.asarray((slots, gens, anchors, tokens, n_out))
            if ints.dtype == np.int64:
                slots, gens, anchors, tokens, n_out = ints
        flat, counts, parts, bad_rows = self._request_rows(rows_in)
        rnd = self._round(slots, gens, anchors, tokens, n_out, flat, counts, None,
                          self._sampling_of(seeds, top_ks, temps, top_ps), bad_rows=bad_rows,
                          rows_in=rows_in, parts=parts)
        return self._run(rnd, release)

    def _request_rows(self, rows_in: Sequence[Any]) -> tuple[
            npt.NDArray[np.uint8] | None, Ints, list[npt.NDArray[np.uint8]] | None, int]:
        """``run``'s requests' rows as the round takes them: (rows back to back, or None;
        every request's row count; the requests' own arrays when the STEP sends them as they
        are, else None; the first request whose rows are not uint8 [n, row_bytes], or -1)."""
        # Off a shared-memory region the STEP can send the requests' arrays as they are
        # (scatter-gather): no copy of the rows before the send.
        sendable = None if self._shm else self._sendable(rows_in)
        if sendable is not None:
            return None, sendable[1], sendable[0], -1
        n, rb = len(rows_in), self.row_bytes
        parts = [r for r in rows_in if r is not None]
        flat = None
        try:
            # Every part must be a uint8 [n, row_bytes] array: concatenate refuses other
            # widths, ranks and (casting "no") dtypes, isinstance other objects (the set of
            # types is the cheap look, isinstance the one for subclasses).
            if set(map(type, parts)) - {np.ndarray} and \
                    not all(isinstance(r, np.ndarray) for r in parts):
                raise TypeError("rows that are not arrays")
            if len(parts) == n:  # every request has rows: len is each one's row count
                counts = np.fromiter(map(len, parts), np.int64, count=n)
            else:
                counts = np.fromiter((0 if r is None else r.shape[0] for r in rows_in),
                                     np.int64, count=n)
            total = int(counts.sum())
            if len(parts) == 1 and parts[0].dtype == np.uint8 and parts[0].ndim == 2 and \
                    parts[0].shape[1] == rb:
                flat = parts[0]
            elif total or parts:
                flat = self._join(parts, total)
            if flat is not None and flat.shape[1:] != (rb,):
                raise ValueError("rows of another width")
        except (TypeError, ValueError, IndexError, AttributeError):
            # Name the first offender (the checks of run_batch report it in request order).
            counts = np.zeros(n, np.int64)
            for i, r in enumerate(rows_in):
                if r is None:
                    continue
                if not isinstance(r, np.ndarray) or r.dtype != np.uint8 or r.ndim != 2 or \
                        r.shape[1] != rb:
                    counts[i:] = 0
                    return None, counts, None, i
                counts[i] = r.shape[0]
            raise
        return flat, counts, None, -1

    def _join(self, parts: list[Any], total: int) -> npt.NDArray[np.uint8]:
        """``run``'s row arrays back to back: into staging when they fit (the round reads them
        before it gathers into staging) and none of them is a view of the staging buffer's
        memory, since ``np.concatenate`` does not guard its output against overlapping an
        input; else into a new array."""
        if total <= len(self.staging) and \
                id(self._staging_owner) not in set(map(id, map(_BASE, parts))):
            out = self.staging[:total]
        else:
            out = np.empty((total, self.row_bytes), np.uint8)
        # (casting "no": rows of another dtype are refused, not converted)
        return np.concatenate(parts, out=out, casting="no")

    def _sampling_of(self, seeds: Sequence[Any], top_ks: Sequence[Any], temps: Sequence[Any],
                     top_ps: Sequence[Any]) -> tuple[Any, Any, Any, Any] | None:
        """``run``'s sampling columns; None on a greedy session whose requests leave them all
        0 (the checks refuse any other value there)."""
        if self.sampled or any(top_ks) or any(seeds) or any(temps) or any(top_ps):
            return seeds, top_ks, temps, top_ps
        return None

    def _sendable(self, rows_in: Sequence[Any]
                  ) -> tuple[list[npt.NDArray[np.uint8]], Ints] | None:
        """The requests' row arrays that hold rows, and every request's row count, when each
        is a C-contiguous ``uint8 [n, row_bytes]`` array (strides ``(row_bytes, 1)``), so the
        STEP can send it as it is; else None (the general path copies or refuses them)."""
        nd, u8, rb, strides = np.ndarray, _U8, self.row_bytes, (self.row_bytes, 1)
        parts, counts = [], []
        for r in rows_in:
            if r is None:
                counts.append(0)
            elif type(r) is nd and r.dtype is u8 and r.strides == strides and \
                    r.shape[1] == rb:
                parts.append(r)
                counts.append(len(r))
            else:
                return None
        return parts, np.array(counts, np.int64)

    def run_batch(self, slots: Any, generation: Any, anchor_pos: Any, anchor_token: Any,
                  n_out: Any, rows: npt.NDArray[np.uint8] | None = None,
                  n_rows: Any = None, *, row_offsets: Any = None, release: Any = (),
                  seed: Any = None, top_k: Any = None, temperature: Any = None,
                  top_p: Any = None) -> RoundResult:
        """One round, given as arrays with one value per request (a scalar stands for all):
        apply the rows to the ring, send one STEP, return the drafts.

        slots, generation, anchor_pos, anchor_token, n_out: as the ``SlotRequest`` fields.
        rows ``uint8 [R, row_bytes]``, n_rows: request i's new rows, of positions
        ``[anchor_pos[i] - n_rows[i], anchor_pos[i])``, are ``n_rows[i]`` rows of ``rows``,
        back to back in request order, or from ``row_offsets[i]`` on when given (an engine
        whose hidden states hold rejected positions between requests' accepted ones). No
        rows: ``rows`` None (n_rows then all 0). seed, top_k, temperature, top_p: sampled
        sessions only (None: greedy entries). ``release``: as in ``run``.

        The result's arrays follow the request order; it stays valid until the next round.
        The arrays are read, never kept or written: the engine may reuse them at once. The
        rows may lie in ``self.staging`` from its start (where an engine's device-to-host copy
        can land them): on a ``unix+shm://`` endpoint that is the shared region, and the usual
        round then copies no row before the send."""
        n = int(np.size(slots))
        if rows is not None and (not isinstance(rows, np.ndarray) or rows.dtype != np.uint8
                                 or rows.ndim != 2 or rows.shape[1] != self.row_bytes):
            raise ValueError(
                f"rows must be a uint8 array [n, {self.row_bytes}], got"
                f" {getattr(rows, 'dtype', type(rows).__name__)} {getattr(rows, 'shape', '')}")
        counts = _column(0 if n_rows is None else n_rows, n, "n_rows", np.int64)
        if counts.dtype == object or (n and _bounds(counts)[0] < 0):
            i = int(np.flatnonzero(counts < 0)[0]) if counts.dtype != object else 0
            raise ValueError(f"n_rows[{i}] is {_py(counts[i])}: row counts are >= 0")
        have = 0 if rows is None else rows.shape[0]
        offsets = None
        if row_offsets is not None:
            offsets = _column(row_offsets, n, "row_offsets", np.int64)
            past = (offsets < 0) | (offsets + counts > have)
            if past.any():
                i = int(np.flatnonzero(past)[0])
                raise ValueError(f"slot {int(np.asarray(slots).reshape(-1)[i])}: rows"
                                 f" [{_py(offsets[i])}, {offsets[i] + counts[i]}) outside the"
                                 f" {have} rows given")
            if (offsets == np.cumsum(counts) - counts).all():
                offsets = None
        elif int(counts.sum()) != have:
            raise ValueError(f"n_rows add up to {int(counts.sum())} rows, {have} given")
        sampling = None if seed is None and top_k is None and temperature is None and \
            top_p is None else (0 if seed is None else seed, 0 if top_k is None else top_k,
                                0.0 if temperature is None else temperature,
                                0.0 if top_p is None else top_p)
        rnd = self._round(slots, generation, anchor_pos, anchor_token, n_out, rows, counts,
                          offsets, sampling)
        return self._run(rnd, release)

    # -- checks -------------------------------------------------------------------------------
    def _round(self, slots: Any, generation: Any, anchor_pos: Any, anchor_token: Any,
               n_out: Any, rows: npt.NDArray[np.uint8] | None, counts: Ints,
               offsets: Ints | None, sampling: tuple[Any, Any, Any, Any] | None, *,
               bad_rows: int = -1, rows_in: Sequence[Any] = (),
               parts: list[npt.NDArray[np.uint8]] | None = None) -> _Round:
        """The round's arrays, refused when they would make the worker answer ST_BAD_FRAME
        (fatal for the engine run): these are the engine's programming errors, raised before
        anything is sent or changed, naming the first request (in order) that breaks a rule
        and the first rule it breaks."""
        s = _column(slots, int(np.size(slots)), "slots", np.int64)
        n = len(s)
        g = _column(generation, n, "generation", np.int64)
        a = _column(anchor_pos, n, "anchor_pos", np.int64)
        t = _column(anchor_token, n, "anchor_token", np.int64)
        k = _column(n_out, n, "n_out", np.int64)
        if sampling is not None:
            seed = _column(sampling[0], n, "seed", np.uint64)
            top_k = _column(sampling[1], n, "top_k", np.int64)
            temp = _column(sampling[2], n, "temperature", np.float64)
            top_p = _column(sampling[3], n, "top_p", np.float64)
        on_s = self.sampled and sampling is not None
        usual = bad_rows < 0 and self._continues(s, g, a, counts)
        same = usual and on_s and self._same_sampling(seed, top_k, temp, top_p)
        if bad_rows < 0 and self._looks_fine(s, g, a, t, k, counts, None if same else (
                sampling and (seed, top_k, temp, top_p)), usual):
            if same:
                assert self._usual is not None and self._usual.sampling is not None
                seed = self._usual.sampling[0]
            elif on_s:
                seed = np.where(top_k != 0, seed, 0).astype(np.uint64)
            return _Round(
                slots=s, generation=g, anchor_pos=a, anchor_token=t, n_out=k, n_rows=counts,
                rows=rows, row_offsets=offsets, seed=seed if on_s else None,
                top_k=top_k if on_s else None, temperature=temp if on_s else None,
                top_p=top_p if on_s else None, usual=usual, same_sampling=same, parts=parts)
        S, N, U32 = self.max_slots, self.num_spec, wire.U32_MASK
        in_range = (s >= 0) & (s < S)
        # Each check: (where it fails, its message for request i), in the order of the rules;
        # ``at(i)`` names the request's slot.

        def at(i: int) -> str:
            return f"slot {_py(s[i])}"

        checks: list[tuple[Any, Any]] = [
            (~in_range, lambda i: f"slot {_py(s[i])!r} outside [0, {S})")]
        if n and not in_range.all():
            self._raise_first(checks, n)
        su = s.astype(np.int64)
        twice = np.zeros(n, bool)
        if n and np.bincount(su, minlength=S).max() > 1:
            order = np.argsort(su, kind="stable")
            twice[order[1:][su[order[1:]] == su[order[:-1]]]] = True  # every later occurrence
        prev_g = self._gen[su]
        checks += [
            (twice, lambda i: f"{at(i)} appears twice in one round"),
            (g < 0, lambda i: f"{at(i)}: generation {_py(g[i])} < 0"),
            ((prev_g != _NONE) & (g < prev_g),
             lambda i: f"{at(i)}: generation {_py(g[i])} is older than the slot's"
                       f" {_py(prev_g[i])}; generations only rise (7.1)"),
            ((a < 0) | (a > U32), lambda i: f"{at(i)}: anchor_pos {_py(a[i])} outside [0, 2**32)"),
            ((t < 0) | (t > U32),
             lambda i: f"{at(i)}: anchor_token {_py(t[i])} outside [0, 2**32)"),
        ]
        if bad_rows >= 0:
            r = rows_in[bad_rows]
            bad = np.zeros(n, bool)
            bad[bad_rows] = True
            checks.append((bad, lambda i: (
                f"{at(i)}: rows must be a uint8 array [n, {self.row_bytes}], got "
                f"{getattr(r, 'dtype', type(r).__name__)} {getattr(r, 'shape', '')}")))
        checks += [
            (counts > a, lambda i: f"{at(i)}: {_py(counts[i])} rows but anchor_pos {_py(a[i])};"
                                   " rows exist only before the anchor"),
            ((k < 0) | (k > N), lambda i: f"{at(i)}: n_out {_py(k[i])} outside [0, {N}]"),
        ]
        if sampling is not None and self.sampled:
            on = top_k != 0
            checks += [
                (on & ((top_k < 0) | (top_k > MAX_TOP_K)),
                 lambda i: f"{at(i)}: top_k {_py(top_k[i])} outside [0, {MAX_TOP_K}]"),
                (on & ~(np.isfinite(temp.astype(np.float64)) & (temp > 0)),
                 lambda i: f"{at(i)}: temperature {_py(temp[i])!r} must be a finite number > 0"
                           " when top_k > 0"),
                (on & ~(np.isfinite(top_p.astype(np.float64)) & (top_p >= 0) & (top_p <= 1)),
                 lambda i: f"{at(i)}: top_p {_py(top_p[i])!r} outside [0, 1]"),
                (on & ((seed < 0) | (seed >= (1 << 64))),
                 lambda i: f"{at(i)}: seed {_py(seed[i])} outside [0, 2**64)"),
            ]
        elif sampling is not None:
            checks.append(((top_k != 0) | (seed != 0) | (temp != 0) | (top_p != 0),
                           lambda i: f"{at(i)}: sampling fields on a greedy session (top_k"
                                     f" {_py(top_k[i])}, seed {_py(seed[i])}); HELLO with"
                                     " SAMPLE_TOP32 to sample"))
        if n:
            self._raise_first(checks, n)
        if g.dtype == object:  # every check passed, yet past int64
            i = int(np.flatnonzero(g > _MAX_GENERATION)[0])
            raise ValueError(f"{at(i)}: generation {_py(g[i])} outside [0, 2**63)")
        return _Round(
            slots=su, generation=g, anchor_pos=a.astype(np.int64),
            anchor_token=t.astype(np.int64), n_out=k, n_rows=counts, rows=rows,
            row_offsets=offsets,
            seed=np.where(top_k != 0, seed, 0).astype(np.uint64) if on_s else None,
            top_k=top_k if on_s else None, temperature=temp if on_s else None,
            top_p=top_p if on_s else None, parts=parts)

    def _continues(self, s: Any, g: Any, a: Any, counts: Ints) -> bool:
        """Whether the round continues the last one (``_Usual``): same slots in the same order,
        same generations, every slot's new rows starting at its last anchor."""
        u = self._usual
        if u is None or len(s) != len(u.slots) or not self.fast_path:
            return False
        if s.dtype == object or g.dtype == object or a.dtype == object:
            return False
        if len(s) <= _FEW:
            return bool(s.tolist() == u.slots.tolist() and g.tolist() == u.generation.tolist()
                        and (a - counts).tolist() == u.anchor_pos.tolist())
        return bool((s == u.slots).all() and (g == u.generation).all()
                    and (a - counts == u.anchor_pos).all())

    def _same_sampling(self, seed: Any, top_k: Any, temp: Any, top_p: Any) -> bool:
        """Whether a usual round's sampling columns are the last round's (NaN never is)."""
        last = self._usual.sampling if self._usual is not None else None
        if last is None or any(x.dtype == object for x in (seed, top_k, temp, top_p)):
            return False
        # The seeds kept are zero where top_k is: compared only where top_k is not.
        return bool((top_k == last[1]).all() and (temp == last[2]).all()
                    and (top_p == last[3]).all()
                    and ((seed == last[0]) | (top_k == 0)).all())

    def _looks_fine(self, s: Any, g: Any, a: Any, t: Any, k: Any, counts: Ints,
                    sampling: tuple[Any, Any, Any, Any] | None, usual: bool = False) -> bool:
        """The rules of ``_round`` by a few reductions over whole columns: True when every
        request keeps them (the usual round); False sends the round through the request by
        request checks, which name the first offender. ``usual``: the round continues the
        last (``_continues``), whose slots and generations passed, and whose anchors were
        >= 0, so the new ones (no lower) are >= their row counts."""
        if not len(s):
            return True
        if any(x.dtype == object for x in (s, g, a, t, k)):
            return False
        S, U32 = self.max_slots, wire.U32_MASK
        if not usual:
            s_lo, s_hi = _bounds(s)
            if s_lo < 0 or s_hi >= S or np.bincount(s, minlength=S).max() > 1:
                return False
            # A free slot's generation is _NONE (-1): below every generation >= 0.
            if _bounds(g)[0] < 0 or (g < self._gen[s]).any():
                return False
            if _bounds(a)[0] < 0 or (counts > a).any():
                return False
        t_lo, t_hi = _bounds(t)
        k_lo, k_hi = _bounds(k)
        if _bounds(a)[1] > U32 or t_lo < 0 or t_hi > U32 or k_lo < 0 or k_hi > self.num_spec:
            return False
        if sampling is None:
            return True
        seed, top_k, temp, top_p = sampling
        if any(x.dtype == object for x in sampling):
            return False
        if not self.sampled:
            return not (top_k.any() or seed.any() or temp.any() or top_p.any())
        if top_k.min() < 0 or top_k.max() > MAX_TOP_K:
            return False
        on = top_k != 0
        return not (on & ~(np.isfinite(temp) & (temp > 0) & np.isfinite(top_p) & (top_p >= 0)
                           & (top_p <= 1))).any()

    @staticmethod
    def _raise_first(checks: list[tuple[Any, Any]], n: int) -> None:
        masks = [np.asarray(m, bool) for m, _ in checks]
        bad = np.logical_or.reduce(masks) if len(masks) > 1 else masks[0]
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            for m, (_, msg) in zip(masks, checks, strict=True):
                if m[i]:
                    raise ValueError(msg(i))
            raise AssertionError("unreachable")

    # -- the round ----------------------------------------------------------------------------
    def _run(self, rnd: _Round, release: Any) -> RoundResult:
        t0 = time.perf_counter()
        n = len(rnd.slots)
        releases = self._releases(rnd.slots, release)
        self.rounds += 1
        client = self.client
        epoch = client.connection_epoch()
        if epoch is not None and self._no_worker_since is not None:
            self._worker_back()
        # Taken until this round ends well: any other way out leaves no usual round behind.
        usual, self._usual = self._usual, None
        n_rows = -1  # rows in the STEP
        if usual is not None and rnd.usual and epoch == usual.epoch and \
                _bounds(rnd.n_rows)[1] <= self.window:
            n_rows = int(rnd.n_rows.sum())
        if 0 <= n_rows <= self.budget.limit:
            # Every slot continues with exactly its new rows within the budget: the plan of
            # ``_plan``'s first case, known without looking at the per-slot state (the last
            # round left every window valid, sent every slot whole and reset their ages).
            chosen, kind, k, end, written = self._all[:n], self._zeros[:n], rnd.n_rows, \
                rnd.anchor_pos, False
        else:
            usual = None
            self._new_requests(rnd)
        synced = self._synced_epoch
        if usual is None:
            if epoch is None:  # target-only: the ring takes the rows, for the resync later
                self._write_rows(rnd)
                synced[rnd.slots] = _NO_EPOCH
                self._no_worker()
                return self._failed(n, "disabled" if client.disabled else "not_ready")
            chosen, kind, k, end, written = self._plan(rnd, epoch)
        assert epoch is not None  # (on the short way it is the last round's)
        m = len(chosen)
        if m + len(releases) == 0:  # everything deferred: nothing to send this round
            return self._failed(n, "deferred")
        slots = rnd.slots if m == n else rnd.slots[chosen]
        if usual is None:
            n_rows = int(k.sum())
        # The usual round: every request continues with exactly its new rows, in order, so
        # the STEP's rows are the engine's array, and they reach the ring while the reply is
        # on its way (the ring write is the round's largest memory traffic).
        rows_in = rnd.rows
        direct = not written and rnd.row_offsets is None and (
            rnd.parts is not None or (rows_in is not None and rows_in.flags.c_contiguous)) and \
            (k is rnd.n_rows or bool((k == rnd.n_rows).all()))
        if not written and not direct:
            self._write_rows(rnd)
        rows = self._stage(rnd, chosen, k, end, n_rows, direct)
        if usual is not None and not len(releases):
            entries = self._entries_again(rnd, usual)
        else:
            entries = self._entries(rnd, chosen, kind, k, end, releases)
        self._step_id += 1
        later = _Later(self._write_rows, rnd) if direct else None
        # No rows (every slot only asks for drafts): the headers are the whole frame.
        try:
            out = client.step(self._headers, entries, n_rows, self._step_id, epoch=epoch,
                              rows=rows, while_waiting=later)
        finally:
            if later is not None:
                later.finish()  # when the STEP was never sent
        resynced = 0 if usual is not None else int(np.count_nonzero(kind == _RESYNC))
        if resynced:
            client.stats.inc("slots_resynced", resynced)
        if not out.ok or out.reply is None or out.drafted is None:
            synced[rnd.slots] = _NO_EPOCH
            body = wire.rows_offset_for(len(entries)) + n_rows * self.row_bytes
            if body > SIZE_SUSPECT_BYTES and out.reason in ("transport_error",
                                                            "frame_bad_frame_size"):
                why = self.budget.size_refused(n_rows, body, out.reason)
                if why is not None:
                    client.disable(why)
            res = self._failed(n, out.reason or "failed")
            res.rtt_us = out.rtt_us
            return res
        self.budget.step_ok()
        reply = out.reply
        status = reply.status[:m]
        if usual is not None and not status.any():  # every status RS_OK (0)
            # Every slot applied its rows: its window ends at the new anchor; generations and
            # the epoch stay as the last round left them.
            self._worker_end[slots] = end
            usual.anchor_pos = rnd.anchor_pos.copy()
            if not rnd.same_sampling:
                usual.sampling = self._sampling_kept(rnd)
            self._usual = usual
        else:
            self._applied(rnd, chosen, slots, end, status, reply, epoch, m == n and
                          end is rnd.anchor_pos and len(entries) >= n, entries)
        res = self.results.from_reply(n, chosen, reply, out.drafted)
        res.resynced = resynced
        res.rows_sent = n_rows
        res.rtt_us = out.rtt_us
        client.stats.inc_many({"rounds_ok": 1,
                               "round_us_total": (time.perf_counter() - t0) * 1e6})
        return res

    def _applied(self, rnd: _Round, chosen: Ints, slots: Ints, end: Ints,
                 status: npt.NDArray[np.uint8], reply: wire.StepReply, epoch: int,
                 whole: bool, entries: npt.NDArray[Any]) -> None:
        """What the worker now holds, per entry, and whether the slot must resync next time;
        ``whole``: every request went out whole, so with no resync owed the next round may
        be a usual one."""
        synced = self._synced_epoch
        m = len(chosen)
        stale = status == wire.RS_STALE_GENERATION
        applied = ~stale
        at = slots[applied]
        self._worker_gen[at] = rnd.generation[chosen][applied]
        self._worker_end[at] = end[applied]
        synced[at] = epoch
        # 7.5 resyncs PARTIAL_WINDOW and NO_WINDOW slots; when rank 0's ring holds no more than
        # the worker has (the engine never handed over older rows), a resync would send the
        # same rows again every round, so only a shortfall against the ring counts.
        short = applied & ((status == wire.RS_PARTIAL_WINDOW) | (status == wire.RS_NO_WINDOW))
        if short.any():
            short &= reply.window_rows[:m] < self.ring.available_batch(slots, end)
            synced[slots[short]] = _NO_EPOCH
        if stale.any():
            synced[slots[stale]] = _NO_EPOCH
            self.client.new_session("RS_STALE_GENERATION: the worker holds a newer generation"
                                    " than rank 0 sent")
        elif whole and m and not short.any() and self.fast_path:
            self._usual = _Usual(slots=rnd.slots.copy(), generation=rnd.generation.copy(),
                                 anchor_pos=rnd.anchor_pos.copy(), epoch=epoch,
                                 entries=entries[:m], sampling=self._sampling_kept(rnd))

    @staticmethod
    def _sampling_kept(rnd: _Round) -> tuple[Any, Any, Any, Any] | None:
        """The round's sampling columns as ``_Usual.sampling`` keeps them (copies)."""
        if rnd.seed is None or rnd.top_k is None or rnd.temperature is None or \
                rnd.top_p is None:
            return None
        return (rnd.seed.copy(), rnd.top_k.copy(), rnd.temperature.copy(), rnd.top_p.copy())

    def _new_requests(self, rnd: _Round) -> None:
        """A new generation in a slot is a new request: its ring starts empty. A window that
        ends past the anchor is cut there (as the worker does, 7.2 step 4)."""
        s, g, a = rnd.slots, rnd.generation, rnd.anchor_pos
        ring = self.ring
        new = self._gen[s] != g
        if new.any():
            ns = s[new]
            self._gen[ns] = g[new]
            ring.start[ns] = ring.end[ns] = 0
        cut = ~new & (ring.end[s] > a)
        if cut.any():
            cs, ca = s[cut], a[cut]
            ring.end[cs] = ca
            ring.start[cs] = np.minimum(ring.start[cs], ca)

    def _write_rows(self, rnd: _Round) -> None:
        """The round's new rows into the ring, in one scatter (a resync sends them later).
        ``run``'s arrays are joined first, into staging when they fit: the gather into staging
        comes after this."""
        if rnd.parts is not None and rnd.rows is None:
            rnd.rows = self._join(rnd.parts, int(rnd.n_rows.sum())) if rnd.parts else None
        if rnd.rows is not None:
            self.ring.write_batch(rnd.slots, rnd.anchor_pos - rnd.n_rows, rnd.n_rows, rnd.rows,
                                  rnd.row_offsets)

    def _plan(self, rnd: _Round, epoch: int) -> tuple[Ints, Ints, Ints, Ints, bool]:
        """Which requests go out and how: per entry, its request's index, kind (_CONT or
        _RESYNC), rows sent and anchor (the request's, or the end of the part sent when a
        resync or backlog goes out in parts); and whether the new rows are in the ring yet
        (not when every request continues within the budget: nothing here needs them)."""
        s, a, n_new = rnd.slots, rnd.anchor_pos, rnd.n_rows
        W = self.window
        valid = (self._synced_epoch[s] == epoch) & (self._worker_gen[s] == rnd.generation)
        wend = self._worker_end[s]
        # Continuing: the new rows follow what the worker holds (it keeps only the newest W).
        cont = valid & (wend == a - n_new)
        k = np.minimum(n_new, W)
        chosen = np.arange(len(s), dtype=np.int64)
        if cont.all() and int(k.sum()) <= self.budget.limit:
            self.budget.sent(s)
            return chosen, np.zeros(len(s), np.int64), k, a, False
        self._write_rows(rnd)
        if not cont.all():
            held = self.ring.available_batch(s, a)  # newest min(W, anchor_pos) when all given
            # Left out of earlier rounds: the worker's window still ends at wend, and the ring
            # holds everything after it. Send that backlog, not a resync.
            backlog = ~cont & valid & (a - held <= wend) & (wend < a - n_new)
            k = np.where(cont, k, np.where(backlog, a - wend, held))
            kind = np.where(cont | backlog, _CONT, _RESYNC)
        else:
            kind = np.zeros(len(s), np.int64)
        if int(k.sum()) > self.budget.limit:
            return (*self.budget.fit(s, a, kind, k), True)
        self.budget.sent(s)
        return chosen, kind, k, a, True

    def _stage(self, rnd: _Round, chosen: Ints, k: Ints, end: Ints, n_rows: int,
               direct: bool) -> Any:
        """The STEP's rows: the engine's own array or ``run``'s requests' arrays
        (``direct``), else gathered from the ring into staging."""
        if not n_rows:
            return None
        if direct and rnd.parts is not None:
            return rnd.parts
        if direct and rnd.rows is not None:
            rows = rnd.rows[:n_rows]
            if not self._shm or rows.ctypes.data == self.staging.ctypes.data:
                return rows  # (run() may have put the requests' rows in staging already)
            # On a region the rows must lie in it: one copy, as the gather would be.
            np.copyto(self.staging[:n_rows], rows)
            return self.staging[:n_rows]
        self.ring.gather_batch(rnd.slots[chosen], end, k, self.staging)
        return self.staging[:n_rows]

    def _entries(self, rnd: _Round, chosen: Ints, kind: Ints, k: Ints, end: Ints,
                 releases: npt.NDArray[Any]) -> npt.NDArray[Any]:
        """The STEP's entries, laid out as the wire has them, releases last."""
        m = len(chosen)
        e = np.zeros(m + len(releases), wire.ENTRY_DTYPE)
        all_in = m == len(rnd.slots)

        def pick(x: Any) -> Any:
            return x if all_in else x[chosen]
        e["slot"][:m] = pick(rnd.slots)
        e["generation"][:m] = pick(rnd.generation) & wire.U32_MASK
        e["anchor_pos"][:m] = end
        e["anchor_token"][:m] = pick(rnd.anchor_token)
        e["n_rows"][:m] = k
        # A part drafts nothing: its anchor is behind the request's.
        n_out = pick(rnd.n_out)
        if end is not rnd.anchor_pos:
            n_out = np.where(end == rnd.anchor_pos[chosen], n_out, 0)
        e["n_out"][:m] = n_out
        e["flags"][:m] = np.where(kind == _RESYNC, wire.RF_RESET, 0) | \
            np.where(n_out != 0, wire.RF_NEED_DRAFT, 0)
        self._sampling(e, rnd, m, pick)
        e[m:] = releases
        return e

    def _entries_again(self, rnd: _Round, usual: _Usual) -> npt.NDArray[Any]:
        """The usual round's entries: the last round's array, whose slots and generations are
        this round's, with the rest written again (every entry continues: no RF_RESET)."""
        e = usual.entries
        e["anchor_pos"] = rnd.anchor_pos
        e["anchor_token"] = rnd.anchor_token
        e["n_rows"] = rnd.n_rows
        e["n_out"] = rnd.n_out
        e["flags"] = np.where(rnd.n_out != 0, wire.RF_NEED_DRAFT, 0)
        if rnd.top_k is not None:
            if not rnd.same_sampling:
                self._sampling(e, rnd, len(e))
        elif usual.sampling is not None:  # no sampling this round: greedy entries
            for name in ("seed", "top_k", "temperature", "top_p"):
                e[name] = 0
        return e

    def _sampling(self, e: npt.NDArray[Any], rnd: _Round, m: int,
                  pick: Any = lambda x: x) -> None:
        """The entries' sampling fields (a sampled session's)."""
        if rnd.top_k is not None and rnd.seed is not None and rnd.temperature is not None \
                and rnd.top_p is not None:
            top_k = pick(rnd.top_k)
            e["seed"][:m] = pick(rnd.seed)  # zero where top_k is (``_round``)
            e["top_k"][:m] = top_k
            if top_k.all():
                e["temperature"][:m] = pick(rnd.temperature)
                e["top_p"][:m] = pick(rnd.top_p)
            else:  # a greedy entry of a sampled session: fields zero
                on = top_k != 0
                e["temperature"][:m] = np.where(on, pick(rnd.temperature), 0.0)
                e["top_p"][:m] = np.where(on, pick(rnd.top_p), 0.0)

    def _releases(self, requested: Ints, release: Any) -> npt.NDArray[Any]:
        """RF_RELEASE entries for finished slots (not requested this round), forgetting them."""
        if isinstance(release, (tuple, list)) and not release:
            return _NO_ENTRIES
        rel = np.asarray(list(release) if not isinstance(release, np.ndarray) else release)
        if not rel.size:
            return _NO_ENTRIES
        rel = rel.reshape(-1)
        # Every value that is not an integer slot in range is refused (the first named).
        bad = (rel < 0) | (rel >= self.max_slots) if rel.dtype.kind in "iu" else \
            np.ones(len(rel), bool)
        if bad.any():
            raise ValueError(f"slot {_py(rel[int(np.flatnonzero(bad)[0])])!r} outside"
                             f" [0, {self.max_slots})")
        rel = rel.astype(np.int64)
        _, first = np.unique(rel, return_index=True)
        rel = rel[np.sort(first)]  # each once, in the engine's order
        rel = rel[~np.isin(rel, requested)]
        gen = self._worker_gen[rel]
        self._forget(rel)
        rel, gen = rel[gen != _NONE], gen[gen != _NONE]
        out = np.zeros(len(rel), wire.ENTRY_DTYPE)
        out["slot"] = rel
        out["generation"] = gen & wire.U32_MASK
        out["flags"] = wire.RF_RELEASE
        return out

    def _forget(self, slots: Ints) -> None:
        self._usual = None
        self._gen[slots] = _NONE
        self._worker_gen[slots] = _NONE
        self._synced_epoch[slots] = _NO_EPOCH
        self.budget.forget(slots)
        self.ring.start[slots] = self.ring.end[slots] = 0

    # -- the row budget ---------------------------------------------------------------------------
    def _no_worker(self) -> None:
        """A round without a worker: say so at WARNING once NO_WORKER_LOG_S have gone by
        without one, and once per NO_WORKER_LOG_S after that."""
        now = time.monotonic()
        self._no_worker_rounds += 1
        if self._no_worker_since is None:
            self._no_worker_since = self._no_worker_logged = now
        elif now - self._no_worker_logged >= NO_WORKER_LOG_S:
            self._no_worker_logged = now
            log.warning("remote DSpark: no drafts for %.0f s (%d rounds target-only): %s",
                        now - self._no_worker_since, self._no_worker_rounds,
                        self.client.last_error or "no worker has answered yet")

    def _worker_back(self) -> None:
        since = self._no_worker_since
        if since is not None and self._no_worker_logged > since:
            log.info("remote DSpark: drafting again after %.0f s (%d rounds target-only)",
                     time.monotonic() - since, self._no_worker_rounds)
        self._no_worker_since = None
        self._no_worker_rounds = 0

    def _failed(self, n: int, reason: str) -> RoundResult:
        self.failed_rounds += 1
        self.client.stats.inc("rounds_failed")
        self.client.stats.inc(f"rounds_failed_{reason}")
        return self.results.target_only(n, reason, self.client.has_confidence is not False)
