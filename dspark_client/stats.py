"""Counters and last values of the client, shared by the engine thread and the connect thread.

``inc`` adds to a counter, ``set`` records a value (a string, a dict), ``observe`` adds a sample
to a histogram (fixed buckets), ``get`` reads one and ``snapshot`` / ``histograms`` return plain
dict copies for logs, ``dspark-client stats`` or the metrics of ``dspark_client.metrics``.
A lock guards every call: the engine thread and the background connect thread both write, and
a snapshot must never see a dict mid-update. Each call holds the lock for one dict operation.

``COUNTERS`` and ``GAUGES`` name what the client and ``DraftRounds`` write and what each means
(docs/operations.md lists them too), for exporters; counters only rise, and one never written
reads as 0. Per-status families are written as ``rounds_failed_<reason>`` and
``step_frame_<status>``.
"""

from __future__ import annotations

import copy
import threading
from bisect import bisect_left
from collections.abc import Mapping, Sequence
from typing import Any, Final

__all__ = ["COUNTERS", "GAUGES", "Stats"]

COUNTERS: Final[dict[str, str]] = {
    "hellos": "HELLOs accepted (each starts a connection epoch; every live slot resyncs)",
    "connect_failures": "connect or HELLO attempts that failed",
    "reconnects": "HELLOs accepted after the first: reconnects, failovers, moves and new"
                  " sessions",
    "goodbyes": "GOODBYEs the worker accepted (close(), and a move leaving a worker)",
    "slots_resynced": "slot entries sent as a resync (RF_RESET with the newest window rows)",
    "moves": "moves to a better-ranked worker (placement), each after its HELLO was accepted",
    "move_failures": "moves that did not happen (the target refused or failed the HELLO)",
    "drained": "ST_DRAINING answers: the worker is shutting down, the client moves on at once",
    "resolves": "DNS resolutions of a dns+tcp:// endpoint",
    "resolve_failures": "DNS resolutions that failed or returned nothing (the last set is kept)",
    "disconnects": "connections dropped by the client (timeouts, errors, refused replies)",
    "failovers": "moves to the next endpoint of a failover list",
    "new_sessions": "new session ids (RS_STALE_GENERATION, or a HELLO refused STALE_SEQ)",
    "hello_stale_seq_total": "HELLOs refused STALE_SEQ: another connection holds the session"
                             " with a higher seq (taken over or replayed); a new id follows",
    "remote_disabled": "1 once remote drafting is disabled for the engine run",
    "steps": "STEPs answered by the worker (any status)",
    "steps_ok": "STEPs whose reply passed every check",
    "step_timeouts": "STEPs without a reply within timeout_ms",
    "step_transport_errors": "STEPs whose connection failed while sending or receiving",
    "bad_replies": "STEP replies refused by the client's checks",
    "bytes_sent": "STEP bytes sent, headers included",
    "bytes_received": "STEP reply bytes received",
    "rtt_us_total": "sum of STEP round trips of good STEPs, microseconds",
    "worker_us_total": "sum of the worker's own time of good STEPs, microseconds",
    "client_us_total": "sum of the client's own time per good STEP, microseconds",
    "rounds_ok": "rounds that got a checked reply",
    "rounds_failed": "target-only rounds (rounds_failed_<reason> says why)",
    "round_us_total": "sum of DraftRounds.run time of good rounds, microseconds",
    "deferred_slots_total": "slots left out of a round by the row budget (no drafts that"
                            " round; each waits its turn, oldest first), one per slot and round",
    "starved_slots_total": "times a slot became starved (see starved_slots_now)",
    "resync_parts_total": "entries that carried only a part of a resync or backlog (row budget"
                          " under what the slot needed)",
    "step_size_refusals_total": "STEPs over 64 KiB cut off while sending or refused BAD_FRAME"
                                " (a frame limit below the STEP)",
    "row_budget_cuts_total": "times the row budget was halved after size refusals",
    "row_budget_probes_total": "times a lowered row budget was doubled again to try",
    "step_frame_bad_frame": "STEPs answered ST_BAD_FRAME (step_frame_<status> for the others)",
    "shm_attached": "connections whose rows go through the shared-memory region",
    "shm_fallbacks": "times shared-memory rows were refused or unavailable: rows on the socket",
    "shm_rows_copied": "STEPs whose rows were copied into the shared-memory region first",
}
GAUGES: Final[dict[str, str]] = {
    "starved_slots_now": "slots left out of more rounds in a row than fair_bound_rounds - 1,"
                         " which the oldest-first rule never allows for a fixed set of slots"
                         " asked each round: non-zero means a row budget below W (resyncs in"
                         " parts) or slots asked only now and then",
    "epoch": "connection epoch: HELLOs accepted by this client so far",
    "connected": "1 while a connection to a worker is ready for STEPs",
    "workers": "workers in the live set (the resolved or listed endpoints)",
    "row_budget": "rows per STEP in force (max_rows_per_step, lower after size refusals)",
    "fair_bound_rounds": "rounds within which every slot asked in each of them goes out, for"
                         " max_slots slots and the row budget in force",
}
# The counters every answered STEP adds to (``Stats.step_answered``), kept in a list by their
# place here: a STEP costs an add per counter rather than a dict update per key, and readers
# see them as counters like the others (absent while 0).
STEP_COUNTERS: Final = ("steps", "steps_ok", "steps_shm", "bytes_sent", "bytes_received",
                        "rtt_us_total", "worker_us_total", "client_us_total")
_STEP_PLACE: Final = {key: i for i, key in enumerate(STEP_COUNTERS)}


class Stats:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counters: dict[str, int | float] = {}
        self._step: list[int | float] = [0] * len(STEP_COUNTERS)
        self._values: dict[str, Any] = {}
        # key -> (upper bounds, per-bucket counts with +Inf last, [sum])
        self._hists: dict[str, tuple[tuple[float, ...], list[int], list[float]]] = {}

    def inc(self, key: str, n: int | float = 1) -> None:
        with self._lock:
            self._counters[key] = self._counters.get(key, 0) + n

    def inc_many(self, counts: Mapping[str, int | float],
                 sample: tuple[str, float, Sequence[float]] | None = None) -> None:
        """Several ``inc`` under one lock acquisition (the per-STEP counters), and ``sample``
        (key, value, buckets) into its histogram as ``observe`` does."""
        with self._lock:
            c = self._counters
            for key, n in counts.items():
                c[key] = c.get(key, 0) + n
            if sample is not None:
                self._observe(*sample)

    def step_answered(self, bytes_sent: int, bytes_received: int, shm: bool,
                      good: tuple[float, float, float] | None,
                      sample: tuple[str, float, Sequence[float]]) -> None:
        """One answered STEP (the client's hot path): ``steps``, ``bytes_sent``,
        ``bytes_received``, ``steps_shm`` when its rows went through the shared-memory region;
        for a reply that passed every check (``good``: its round trip, the worker's own time
        and the client's, µs) ``steps_ok`` and the three ``*_us_total``; and ``sample`` into
        its histogram as ``observe`` does."""
        with self._lock:
            c = self._step
            c[0] += 1
            c[3] += bytes_sent
            c[4] += bytes_received
            if shm:
                c[2] += 1
            if good is not None:
                c[1] += 1
                c[5] += good[0]
                c[6] += good[1]
                c[7] += good[2]
            self._observe(*sample)

    def _counters_locked(self) -> dict[str, int | float]:
        """A copy of every counter, the STEP ones included."""
        out = dict(self._counters)
        for key, n in zip(STEP_COUNTERS, self._step, strict=True):
            if n:
                out[key] = out.get(key, 0) + n
        return out

    def observe(self, key: str, value: float, buckets: Sequence[float]) -> None:
        """One sample into histogram ``key`` (``buckets``: ascending upper bounds, inclusive;
        the first observation of a key fixes them)."""
        with self._lock:
            self._observe(key, value, buckets)

    def _observe(self, key: str, value: float, buckets: Sequence[float]) -> None:
        h = self._hists.get(key)
        if h is None:
            bounds = tuple(buckets)
            h = self._hists[key] = (bounds, [0] * (len(bounds) + 1), [0.0])
        h[1][bisect_left(h[0], value)] += 1
        h[2][0] += value

    def histograms(self) -> dict[str, dict[str, Any]]:
        """Per histogram: ``{"buckets": [(upper bound, cumulative count), ..., (inf, n)],
        "count": n, "sum": total}``."""
        with self._lock:
            raw = {k: (b, list(c), s[0]) for k, (b, c, s) in self._hists.items()}
        out: dict[str, dict[str, Any]] = {}
        for key, (bounds, counts, total) in raw.items():
            cumulative, n = [], 0
            for bound, c in zip((*bounds, float("inf")), counts, strict=True):
                n += c
                cumulative.append((bound, n))
            out[key] = {"buckets": cumulative, "count": n, "sum": total}
        return out

    def set(self, key: str, value: Any) -> None:
        with self._lock:
            self._values[key] = value

    def get(self, key: str, default: Any = None) -> Any:
        """A counter or a value; ``default`` when neither was ever written."""
        with self._lock:
            place = _STEP_PLACE.get(key)
            if place is not None and self._step[place]:
                return self._counters.get(key, 0) + self._step[place]
            if key in self._counters:
                return self._counters[key]
            return self._values.get(key, default)

    def snapshot(self) -> dict[str, Any]:
        """Counters and values in one plain dict (values deep-copied, so the caller may keep
        or change it freely)."""
        with self._lock:
            out: dict[str, Any] = self._counters_locked()
            values = dict(self._values)
        out.update(copy.deepcopy(values))
        return out

    def split_snapshot(self) -> tuple[dict[str, int | float], dict[str, Any]]:
        """(counters, values) as separate copies, for an exporter that types them apart."""
        with self._lock:
            counters = self._counters_locked()
            values = dict(self._values)
        return counters, copy.deepcopy(values)

    def reset(self) -> None:
        with self._lock:
            self._counters.clear()
            self._step = [0] * len(STEP_COUNTERS)
            self._values.clear()
            self._hists.clear()

    def __repr__(self) -> str:
        return f"Stats({self.snapshot()!r})"
