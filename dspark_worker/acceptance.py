"""Draft acceptance on the worker: what its sessions' STEPs say about the drafts it sent
(``protocol.acceptance``; docs/operations.md, "Acceptance").

Fed once per answered STEP (``Dispatcher.complete``), in the session's order; a session's
chains go when the session does. Totals over every session are exported as Prometheus families
read at scrape time (``dspark_worker_acceptance_*``, label ``position`` 0..N-1, bounded), and
per session in STATS (client names are unbounded: no labels for them). A synthetic session
(``HF_SYNTHETIC``: a benchmark's made-up rows) is judged for its own STATS entry only, never
added to the worker's totals.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from protocol.acceptance import Acceptance, AcceptanceTotals

from .metrics import PREFIX
from .runner import StepItem
from .sessions import Session

__all__ = ["WorkerAcceptance"]


class WorkerAcceptance:
    """Every session's chains and the worker's totals."""

    def __init__(self, num_spec: int, registry: CollectorRegistry | None = None) -> None:
        self.num_spec = num_spec
        self._totals = AcceptanceTotals(num_spec)
        self._by_session: dict[Session, Acceptance] = {}
        # The loop thread writes; a scrape (the metrics server's thread) reads.
        self._lock = threading.Lock()
        if registry is not None:
            registry.register(_AcceptanceFamilies(self))

    def step_answered(self, item: StepItem) -> None:
        """A STEP answered ST_OK: judge what it resolves, keep what it drafted."""
        s = item.session
        if not s.alive:  # dropped while its STEP was on the device: nothing to keep
            return
        acc = self._by_session.get(s)
        if acc is None:
            also = () if s.synthetic else (self._totals,)
            acc = self._by_session[s] = Acceptance(s.max_slots, self.num_spec, also)
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
        # complete(): it is only reused by a later receive, never while this runs.
        with self._lock:
            acc.observe(item.view.entries, drafted, confidence)

    def forget(self, session: Session) -> None:
        with self._lock:
            acc = self._by_session.pop(session, None)
            if acc is not None:
                acc.flush()  # its judged blocks stay in the worker's totals (if it adds to them)

    def totals(self) -> AcceptanceTotals:
        """A copy of the worker's totals, complete (every session's waiting confidences are
        summed first)."""
        with self._lock:
            for acc in self._by_session.values():
                acc.flush()
            return self._totals.copy()

    def session_summary(self, session: Session) -> dict[str, Any]:
        with self._lock:
            acc = self._by_session.get(session)
            if acc is None:
                return AcceptanceTotals(self.num_spec).summary()
            acc.flush()
            return acc.totals.summary()


class _AcceptanceFamilies(Collector):
    """The worker's acceptance totals as counters, read at scrape time."""

    def __init__(self, owner: WorkerAcceptance) -> None:
        self.owner = owner

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        t, p = self.owner.totals(), f"{PREFIX}_acceptance"
        yield CounterMetricFamily(f"{p}_rounds", "Draft blocks whose outcome the slot's next"
                                  " STEP showed (judged blocks).", value=t.rounds)
        for name, text, values in (
                ("drafted", "Judged blocks with a draft at this block position.", t.drafted),
                ("accepted", "Drafts the target accepted at this block position (the drafts"
                 " before it were accepted too).", t.accepted),
                ("predicted", "The confidence head's probability that the draft at this"
                 " position is accepted (prefix survival), summed over judged blocks.",
                 t.predicted)):
            fam = CounterMetricFamily(f"{p}_{name}", text, labels=["position"])
            for j, v in enumerate(values.tolist()):
                fam.add_metric([str(j)], v)
            yield fam
