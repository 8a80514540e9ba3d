"""Draft acceptance on the worker: what its sessions' STEPs say about the drafts it sent
(``protocol.acceptance``; docs/operations.md, "Acceptance").

Fed once per answered STEP (``Dispatcher.complete``), in the session's order; a session's
chains go when the session does. Totals over every session are exported as Prometheus families
read at scrape time (``dspark_worker_acceptance_*``, labels ``version`` and ``name`` of the
drafter version that drafted, bounded by ``versions.VERSIONS_KEPT``, and ``position`` 0..N-1),
and per session in STATS (client names are unbounded: no labels for them). A synthetic session
(``HF_SYNTHETIC``: a benchmark's made-up rows) is judged for its own STATS entry only, never
added to the worker's totals.

The totals weigh every judged block alike, so one session that drafts much (or lies about what
it accepted: its anchors are its own word) moves them at will. Beside them the worker exports
what sessions show one by one: each session's mean accepted drafts over its last
``RECENT_S`` seconds, as quantiles over the sessions that judged at least
``MIN_RECENT_BLOCKS`` blocks in that time; the median is what the acceptance alert reads.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from protocol.acceptance import Acceptance, AcceptanceTotals

from .metrics import PREFIX
from .runner import StepItem
from .sessions import Session
from .versions import VERSIONS_KEPT, Version

__all__ = ["WorkerAcceptance", "acceptance_families"]

# A session's recent figures are its totals less a snapshot of them taken at least RECENT_S
# ago (one snapshot a minute is kept): ten minutes react to a drop well inside the alert's
# 30 minutes. A session counts once it judged MIN_RECENT_BLOCKS blocks in that time, so that
# a session that barely drafts does not weigh as much as a busy one's hundreds.
RECENT_S = 600.0
SNAPSHOT_S = 60.0
MIN_RECENT_BLOCKS = 32
SESSION_QUANTILES = (0.1, 0.5, 0.9)


class _Chains:
    """One session's chains and the snapshots (time, rounds, accepted drafts) of its
    totals its recent figures are taken against."""

    __slots__ = ("acc", "snaps")

    def __init__(self, acc: Acceptance, now: float) -> None:
        self.acc = acc
        self.snaps: deque[tuple[float, int, int]] = deque([(now, 0, 0)])

    def snapshot(self, now: float) -> None:
        if now - self.snaps[-1][0] < SNAPSHOT_S:
            return
        t = self.acc.totals
        self.snaps.append((now, t.rounds, t.accepted_drafts))
        while len(self.snaps) > 1 and self.snaps[1][0] <= now - RECENT_S:
            self.snaps.popleft()  # the oldest left is the newest at least RECENT_S old

    def recent_mean(self) -> float | None:
        """Mean accepted drafts per judged block since the oldest snapshot, None with fewer
        than MIN_RECENT_BLOCKS blocks."""
        t = self.acc.totals
        _, rounds, accepted = self.snaps[0]
        judged = t.rounds - rounds
        return (t.accepted_drafts - accepted) / judged if judged >= MIN_RECENT_BLOCKS else None


class WorkerAcceptance:
    """Every session's chains and the worker's totals."""

    def __init__(self, num_spec: int, registry: CollectorRegistry | None = None,
                 clock: Callable[[], float] = time.monotonic, *,
                 has_confidence: bool = True) -> None:
        self.num_spec = num_spec
        self.clock = clock
        # False: the drafter has no confidence head; nothing predicted is kept or shown.
        self.has_confidence = has_confidence
        self._totals = AcceptanceTotals(num_spec, has_confidence)
        # version number -> (its name, its totals): the last VERSIONS_KEPT versions
        self._by_version: OrderedDict[int, tuple[str, AcceptanceTotals]] = OrderedDict()
        self._by_session: dict[Session, _Chains] = {}
        # The loop thread writes; a scrape (the metrics server's thread) reads.
        self._lock = threading.Lock()
        if registry is not None:
            registry.register(_AcceptanceFamilies(self))

    def step_answered(self, item: StepItem) -> None:
        """A STEP answered ST_OK: judge what it resolves, keep what it drafted."""
        s = item.session
        if not s.alive:  # dropped while its STEP was on the device: nothing to keep
            return
        now = self.clock()
        chains = self._by_session.get(s)
        if chains is None:
            v = s.version
            also: tuple[AcceptanceTotals, ...] = ()
            if not s.synthetic:
                also = (self._totals,) if v is None else (self._totals, self.version_added(v))
            has_confidence = self.has_confidence if v is None else v.has_confidence
            chains = self._by_session[s] = _Chains(
                Acceptance(s.max_slots, self.num_spec, also, has_confidence), now)
        plan, reply, idx = item.plan, item.reply, item.drafting
        drafted = confidence = None
        if idx.size and reply is not None:
            n_out, n = plan.n_out, self.num_spec
            k = np.where(n_out == 0, n, np.minimum(n_out, n))
            if idx.size != k.size:
                keep = np.zeros(k.size, dtype=bool)
                keep[idx] = True
                k = np.where(keep, k, 0)
            drafted, confidence = k, reply.confidence
        # The entries are a view of the STEP's frame, whose buffer goes back to the pool in
        # complete(): observe copies what it keeps.
        with self._lock:
            chains.acc.observe(item.view.entries, drafted, confidence)
            chains.snapshot(now)

    def version_added(self, version: Version, *, newest: bool = False) -> AcceptanceTotals:
        """The totals of ``version`` (made at zero the first time, so that its series exist
        from its load on). ``newest``: it was just made the newest, so it is kept longest, as
        ``Versions.kept`` keeps it (an older version made newest again moves to the end)."""
        with self._lock:
            entry = self._by_version.get(version.number)
            if entry is None:
                entry = self._by_version[version.number] = (
                    version.name, AcceptanceTotals(self.num_spec, version.has_confidence))
            elif newest:
                self._by_version.move_to_end(version.number)
            while len(self._by_version) > VERSIONS_KEPT:
                self._by_version.popitem(last=False)
        return entry[1]

    def by_version(self) -> dict[int, tuple[str, AcceptanceTotals]]:
        """Copies of every kept version's totals, complete."""
        with self._lock:
            for chains in self._by_session.values():
                chains.acc.flush()
            return {n: (name, t.copy()) for n, (name, t) in self._by_version.items()}

    def forget(self, session: Session) -> None:
        with self._lock:
            chains = self._by_session.pop(session, None)
            if chains is not None:
                chains.acc.flush()  # its judged blocks stay in the worker's totals, if in them

    def totals(self) -> AcceptanceTotals:
        """A copy of the worker's totals, complete (every session's waiting confidences are
        summed first)."""
        with self._lock:
            for chains in self._by_session.values():
                chains.acc.flush()
            return self._totals.copy()

    def session_means(self) -> list[float]:
        """Each real (not synthetic) session's recent mean accepted drafts per judged block,
        for the sessions with enough blocks judged lately (``MIN_RECENT_BLOCKS``)."""
        with self._lock:
            means = [chains.recent_mean() for s, chains in self._by_session.items()
                     if not s.synthetic]
        return [m for m in means if m is not None]

    def session_summary(self, session: Session) -> dict[str, Any]:
        with self._lock:
            chains = self._by_session.get(session)
            if chains is None:
                return AcceptanceTotals(self.num_spec, self.has_confidence).summary()
            chains.acc.flush()
            return chains.acc.totals.summary()


def acceptance_families(prefix: str, what: str, labels: list[str],
                        rows: Iterable[tuple[list[str], AcceptanceTotals]]
                        ) -> Iterator[Metric]:
    """``{prefix}_rounds``, ``_drafted``, ``_accepted`` and ``_predicted`` (by ``position``)
    for each row's totals, under its label values; ``what`` names whose drafts they judge. A
    drafter without a confidence head predicts nothing: its rows have no ``_predicted``."""
    rows = list(rows)
    rounds = CounterMetricFamily(f"{prefix}_rounds", f"Draft blocks of {what} whose outcome"
                                 " the slot's next STEPs showed (judged blocks).", labels=labels)
    for values, t in rows:
        rounds.add_metric(values, t.rounds)
    yield rounds
    for name, text in (
            ("drafted", "Judged blocks with a draft at this block position."),
            ("accepted", "Drafts the target accepted at this block position (the drafts"
             " before it were accepted too)."),
            ("predicted", "The confidence head's probability that the draft at this position"
             " is accepted (prefix survival), summed over judged blocks.")):
        shown = [(v, t) for v, t in rows if name != "predicted" or t.has_confidence]
        if name == "predicted" and not shown:
            continue
        fam = CounterMetricFamily(f"{prefix}_{name}", f"{text} Drafts of {what}.",
                                  labels=[*labels, "position"])
        for values, t in shown:
            for j, v in enumerate(getattr(t, name).tolist()):
                fam.add_metric([*values, str(j)], v)
        yield fam


class _AcceptanceFamilies(Collector):
    """The worker's acceptance totals by drafter version as counters, and the session
    quantiles, read at scrape time."""

    def __init__(self, owner: WorkerAcceptance) -> None:
        self.owner = owner

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        p = f"{PREFIX}_acceptance"
        rows = [([str(n), name], t) for n, (name, t) in self.owner.by_version().items()]
        yield from acceptance_families(p, "each drafter version", ["version", "name"], rows)
        means = self.owner.session_means()
        yield GaugeMetricFamily(f"{p}_sessions_judged", "Sessions (not synthetic) with at"
                                f" least {MIN_RECENT_BLOCKS} draft blocks judged in the last"
                                f" {RECENT_S:g} s: those the session quantiles are over.",
                                value=len(means))
        if means:
            gauge = GaugeMetricFamily(
                f"{p}_session_accepted_drafts", "Mean accepted drafts per judged block of each"
                f" session over its last {RECENT_S:g} s, as quantiles over the sessions: one"
                " session cannot move the median of three or more.", labels=["quantile"])
            for q, v in zip(SESSION_QUANTILES,
                            np.quantile(means, SESSION_QUANTILES).tolist(), strict=True):
                gauge.add_metric([f"{q:g}"], v)
            yield gauge
