"""Counters and last values of the client, shared by the engine thread and the connect thread.

``inc`` adds to a counter, ``set`` records a value (a string, a dict), ``get`` reads one and
``snapshot`` returns a plain dict copy for logs, a metrics exporter or ``dspark-client stats``.
A lock guards every call: the engine thread and the background connect thread both write, and
a snapshot must never see a dict mid-update. Each call holds the lock for one dict operation.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Mapping
from typing import Any

__all__ = ["Stats"]


class Stats:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counters: dict[str, int | float] = {}
        self._values: dict[str, Any] = {}

    def inc(self, key: str, n: int | float = 1) -> None:
        with self._lock:
            self._counters[key] = self._counters.get(key, 0) + n

    def inc_many(self, counts: Mapping[str, int | float]) -> None:
        """Several ``inc`` under one lock acquisition (the per-STEP counters)."""
        with self._lock:
            c = self._counters
            for key, n in counts.items():
                c[key] = c.get(key, 0) + n

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

    def reset(self) -> None:
        with self._lock:
            self._counters.clear()
            self._values.clear()

    def __repr__(self) -> str:
        return f"Stats({self.snapshot()!r})"
