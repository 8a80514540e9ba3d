"""Which worker an engine talks to: rendezvous hashing over the live set, failover, and the
return home after a quiet period (docs/operations.md, "Placement").

Pure bookkeeping, no sockets and no threads: the client's connect thread feeds it what it
learns (the members discovery resolved, a failed connect, a worker answering ``ST_DRAINING``)
and asks where to be. Times are ``time.monotonic()`` seconds passed in by the caller.

* **Rank.** Each member gets the score ``sha256(client_name NUL endpoint)`` (its first 8 bytes,
  big-endian); an engine's preference order is the members by falling score (highest random
  weight, Thaler and Ravishankar). Adding one worker to n makes it the top of about 1/(n + 1) of
  the engines and changes nothing for the others; removing one moves only the engines it was
  top for, each to its own next-ranked worker, so they spread over the rest.
* **Eligible.** A member is eligible when it is not held off and has been listed for the quiet
  period (``return_after_s``); members of the first listing are eligible at once. A member is
  held off for the quiet period after ``failover_after`` failed connects in a row, after one
  failed move to it, and after it answered ``ST_DRAINING``. A member that leaves the listing and
  comes back starts its quiet period again. These are the hysteresis: an engine neither follows
  a flapping worker back and forth nor moves to one that just appeared.
* **Target.** Where to connect when not connected: the best-ranked eligible member; if none is
  eligible, the best-ranked one not held off (a new member beats none); if every member is held
  off, the one whose hold ends first.
* **Better.** While connected: the best-ranked eligible member that ranks above the current
  one (any eligible member when the current one is no longer listed), which the client moves to
  by connecting there first and swapping only on an accepted HELLO.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Sequence

__all__ = ["Placement", "rank", "score"]


def score(client_name: str, endpoint: str) -> int:
    """The rendezvous weight of ``endpoint`` for ``client_name``: stable across processes,
    hosts and Python versions (SHA-256, not the salted ``hash``)."""
    digest = hashlib.sha256(client_name.encode("utf-8") + b"\0" + endpoint.encode("utf-8"))
    return int.from_bytes(digest.digest()[:8], "big")


def rank(client_name: str, endpoints: Iterable[str]) -> list[str]:
    """``endpoints`` (duplicates dropped) in ``client_name``'s order of preference."""
    return sorted(set(endpoints), key=lambda ep: (-score(client_name, ep), ep))


class _Member:
    __slots__ = ("failures", "held_until", "listed_since")

    def __init__(self, listed_since: float) -> None:
        self.listed_since = listed_since
        self.failures = 0  # failed connects in a row
        self.held_until = -math.inf


class Placement:
    """One client's view of the worker set (see the module docstring)."""

    def __init__(self, client_name: str, *, failover_after: int, return_after_s: float) -> None:
        if failover_after < 1:
            raise ValueError(f"failover_after {failover_after} must be >= 1")
        if not (math.isfinite(return_after_s) and return_after_s >= 0):
            raise ValueError(f"return_after_s {return_after_s} must be finite and >= 0")
        self.client_name = client_name
        self.failover_after = failover_after
        self.return_after_s = return_after_s
        self._members: dict[str, _Member] = {}
        self._ranked: list[str] = []
        self._listed_once = False

    # -- the member set ---------------------------------------------------------------------------
    @property
    def members(self) -> list[str]:
        """The listed members, best-ranked first."""
        return list(self._ranked)

    def update(self, endpoints: Sequence[str], now: float) -> tuple[list[str], list[str]]:
        """Take a new listing; returns (added, removed). An empty listing is ignored (a failed
        or empty DNS answer must not make the engine forget every worker)."""
        new = set(endpoints)
        if not new:
            return [], []
        added = sorted(new - self._members.keys())
        removed = sorted(self._members.keys() - new)
        since = -math.inf if not self._listed_once else now
        for ep in removed:
            del self._members[ep]
        for ep in added:
            self._members[ep] = _Member(since)
        self._listed_once = True
        if added or removed:
            self._ranked = rank(self.client_name, self._members)
        return added, removed

    def is_listed(self, endpoint: str) -> bool:
        return endpoint in self._members

    # -- what happened ----------------------------------------------------------------------------
    def connected(self, endpoint: str) -> None:
        m = self._members.get(endpoint)
        if m is not None:
            m.failures = 0
            m.held_until = -math.inf

    def connect_failed(self, endpoint: str, now: float) -> bool:
        """A failed connect or HELLO. True when this one reached ``failover_after`` in a row and
        the member is now held off (the caller moves on)."""
        m = self._members.get(endpoint)
        if m is None:
            return True  # no longer listed: nothing to stay for
        m.failures += 1
        if m.failures >= self.failover_after:
            self.hold(endpoint, now)
            return True
        return False

    def hold(self, endpoint: str, now: float) -> None:
        """Keep away from ``endpoint`` for the quiet period (draining, a failed move, failover)."""
        m = self._members.get(endpoint)
        if m is not None:
            m.failures = 0
            m.held_until = now + self.return_after_s

    # -- where to be ------------------------------------------------------------------------------
    def _eligible(self, m: _Member, now: float) -> bool:
        return m.held_until <= now and m.listed_since + self.return_after_s <= now

    def target(self, now: float) -> str | None:
        """Where to connect when not connected (None: nothing listed)."""
        if not self._ranked:
            return None
        for ep in self._ranked:
            if self._eligible(self._members[ep], now):
                return ep
        for ep in self._ranked:
            if self._members[ep].held_until <= now:
                return ep
        return min(self._ranked, key=lambda ep: self._members[ep].held_until)

    def better(self, current: str, now: float) -> str | None:
        """An eligible member to move to from ``current``, or None to stay."""
        for ep in self._ranked:
            if ep == current:
                return None
            if self._eligible(self._members[ep], now):
                return ep
        return None

    def next_change(self, now: float) -> float:
        """Seconds until a hold or a quiet period ends (when ``better`` may change answer);
        inf when nothing is pending."""
        ends = [t for m in self._members.values()
                for t in (m.held_until, m.listed_since + self.return_after_s) if t > now]
        return min(ends) - now if ends else math.inf
