"""The connect thread's view of the worker set: which workers there are, which one to be on,
and what the failures and drains so far say about them (docs/operations.md, "Placement").

``WorkerSet`` joins ``Discovery`` (the set, from static endpoints or ``dns+tcp`` names resolved
again every ``resolve_interval_ms``, and soon after a failed connect) and ``Placement`` (the
ranking for this client name, failover, holds) with the bookkeeping around them: the run of
failed connects and its log lines, the endpoint a STEP found draining, and whether the next
attempt should come at once. It connects nothing: ``WorkerLink`` asks it where to go and tells
it what happened. Only the connect thread calls it, except ``drained``, one field the engine
thread sets (a plain store; the thread takes it on its next pass).
"""

from __future__ import annotations

import logging
import math
import time
from typing import Final

from .config import RemoteConfig
from .discovery import RESOLVE_RETRY_S, Discovery, Resolver
from .placement import Placement
from .stats import Stats

__all__ = ["CONNECT_FAIL_LOG_S", "WorkerSet"]

log = logging.getLogger("dspark_client")

# While the worker stays unreachable the thread retries every backoff interval, so only the
# first failure of a run and then one line per CONNECT_FAIL_LOG_S are logged; the counter
# connect_failures counts them all.
CONNECT_FAIL_LOG_S: Final = 60.0


class WorkerSet:
    """The worker set of one link (``cfg``'s endpoints, ranked for ``client_name``)."""

    def __init__(self, cfg: RemoteConfig, client_name: str, stats: Stats,
                 resolver: Resolver | None = None) -> None:
        self.stats = stats
        self._discovery = Discovery(cfg.all_endpoints, resolver)
        self._placement = Placement(client_name, failover_after=cfg.failover_after,
                                    return_after_s=cfg.return_after_ms / 1000.0)
        self._resolve_interval_s = cfg.resolve_interval_ms / 1000.0
        self.next_resolve = 0.0
        self._last_resolve = -math.inf
        self._resolve_soon = False
        if not self._discovery.dynamic:
            self._placement.update(self._discovery.resolve(), time.monotonic())
        self.drained: str | None = None  # an endpoint whose STEP answered ST_DRAINING
        self.retry_now = False  # a draining worker was left: the next attempt comes at once
        self.fail_run = 0  # failed connects since the last accepted HELLO
        self._fail_logged = 0.0

    @property
    def dynamic(self) -> bool:
        """Whether the set comes from DNS (and may change)."""
        return self._discovery.dynamic

    @property
    def members(self) -> list[str]:
        """The set as last resolved, in this client's order of preference."""
        return self._placement.members

    @property
    def resolve_error(self) -> str | None:
        return self._discovery.last_error

    def target(self, now: float) -> str | None:
        """The worker to be on now (None: none known)."""
        return self._placement.target(now)

    def better(self, endpoint: str, now: float) -> str | None:
        """A better-ranked worker than ``endpoint`` that became eligible, if any."""
        return self._placement.better(endpoint, now)

    def next_change(self, now: float) -> float:
        """Seconds until the ranking or the set may change."""
        wait = self._placement.next_change(now)
        if self._discovery.dynamic:
            wait = min(wait, self.next_resolve - now)
        return wait

    def hold(self, endpoint: str, now: float) -> None:
        """Keep away from ``endpoint`` for the quiet period."""
        self._placement.hold(endpoint, now)

    def connected(self, endpoint: str) -> None:
        """A HELLO at ``endpoint`` was accepted."""
        self._placement.connected(endpoint)

    def refresh(self, now: float) -> None:
        """Resolve the DNS endpoints again when the interval has passed, or soon after a
        failed connect (at most every RESOLVE_RETRY_S)."""
        if not self._discovery.dynamic:
            return
        due = now >= self.next_resolve or (
            self._resolve_soon and now - self._last_resolve >= RESOLVE_RETRY_S)
        if not due:
            return
        members = self._discovery.resolve()
        self._last_resolve = now
        self.next_resolve = now + self._resolve_interval_s
        self._resolve_soon = False
        self.stats.inc("resolves")
        if self._discovery.last_error is not None:
            self.stats.inc("resolve_failures")
            self.stats.set("last_resolve_error", self._discovery.last_error)
            log.warning("remote DSpark: %s", self._discovery.last_error)
        added, removed = self._placement.update(members, now)
        if added or removed:
            self.stats.set("workers", len(self._placement.members))
            log.info("remote DSpark worker set: %d workers (+%s -%s)",
                     len(self._placement.members), added, removed)

    def take_drained(self, now: float) -> None:
        """Hold off the endpoint the engine thread found draining, if any."""
        ep, self.drained = self.drained, None
        if ep is not None:
            self._placement.hold(ep, now)

    def draining(self, endpoint: str, where: str) -> str:
        """``endpoint`` answered ST_DRAINING: keep away from it for the quiet period and, when
        there is another worker, connect to it now (no backoff, no failure counted). Returns
        the link's ``last_error``."""
        now = time.monotonic()
        self.stats.inc("drained")
        self._placement.hold(endpoint, now)
        target = self._placement.target(now)
        if target is not None and target != endpoint:
            self.retry_now = True
            log.info("remote DSpark: %s is draining; moving to %s", endpoint, target)
        else:
            log.warning("remote DSpark: %s is draining and no other worker is known", endpoint)
        return f"{endpoint} is draining ({where})"

    def connect_failed(self, endpoint: str, e: BaseException) -> str:
        """A connect or HELLO to ``endpoint`` failed with ``e``: count it, fail over after
        repeated ones, resolve again soon, log the first and then one per CONNECT_FAIL_LOG_S.
        Returns the link's ``last_error``."""
        text = str(e)  # a transport error names the endpoint itself
        self.stats.inc("connect_failures")
        self.fail_run += 1
        self._resolve_soon = True
        now = time.monotonic()
        if self._placement.connect_failed(endpoint, now):
            target = self._placement.target(now)
            if target is not None and target != endpoint:
                self.stats.inc("failovers")
                log.warning("remote DSpark: %s unreachable, failing over to %s", endpoint,
                            target)
        if self.fail_run == 1:
            self._fail_logged = now
            log.warning("remote DSpark connect/HELLO to %s failed: %s", endpoint, e)
        elif now - self._fail_logged >= CONNECT_FAIL_LOG_S:
            self._fail_logged = now
            log.warning("remote DSpark connect/HELLO to %s still failing after %d attempts: %s",
                        endpoint, self.fail_run, e)
        return text if endpoint in text else f"connect {endpoint}: {text}"
