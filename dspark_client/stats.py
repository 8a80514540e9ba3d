"""Counters and last values of the client, shared by the engine thread and the connect thread.

``inc`` adds to a counter, ``set`` records a value (a string, a dict), ``observe`` adds a sample
to a histogram (fixed buckets), ``get`` reads one and ``snapshot`` / ``histograms`` return plain
dict copies for logs, ``dspark-client stats`` or the metrics of ``dspark_client.metrics``.
A lock guards every call: the engine thread and the background connect thread both write, and
a snapshot must never see a dict mid-update. Each call holds the lock for one dict operation.
"""

from __future__ import annotations

import copy
import threading
from bisect import bisect_left
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["Stats"]


class Stats:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counters: dict[str, int | float] = {}
        self._values: dict[str, Any] = {}
        # key -> (upper bounds, per-bucket counts with +Inf last, [sum])
        self._hists: dict[str, tuple[tuple[float, ...], list[int], list[float]]] = {}

    def inc(self, key: str, n: int | float = 1) -> None:
        with self._lock:
            self._counters[key] = self._counters.get(key, 0) + n

    def inc_many(self, counts: Mapping[str, int | float]) -> None:
        """Several ``inc`` under one lock acquisition (the per-STEP counters)."""
        with self._lock:
            c = self._counters
            for key, n in counts.items():
                c[key] = c.get(key, 0) + n

    def observe(self, key: str, value: float, buckets: Sequence[float]) -> None:
        """One sample into histogram ``key`` (``buckets``: ascending upper bounds, inclusive;
        the first observation of a key fixes them)."""
        with self._lock:
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
            if key in self._counters:
                return self._counters[key]
            return self._values.get(key, default)

    def snapshot(self) -> dict[str, Any]:
        """Counters and values in one plain dict (values deep-copied, so the caller may keep
        or change it freely)."""
        with self._lock:
            out: dict[str, Any] = dict(self._counters)
            values = dict(self._values)
        out.update(copy.deepcopy(values))
        return out

    def split_snapshot(self) -> tuple[dict[str, int | float], dict[str, Any]]:
        """(counters, values) as separate copies, for an exporter that types them apart."""
        with self._lock:
            counters = dict(self._counters)
            values = dict(self._values)
        return counters, copy.deepcopy(values)

    def reset(self) -> None:
        with self._lock:
            self._counters.clear()
            self._values.clear()
            self._hists.clear()

    def __repr__(self) -> str:
        return f"Stats({self.snapshot()!r})"
