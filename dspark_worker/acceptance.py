"""Draft acceptance on the worker: what its sessions' STEPs say about the drafts it sent
(``protocol.acceptance``; docs/operations.md, "Acceptance").

Fed once per answered STEP (``Dispatcher.complete``), in the session's order; a session's
chains go when the session does. Totals over every session are exported as Prometheus families
read at scrape time (``dspark_worker_acceptance_*``, label ``position`` 0..N-1, bounded), and
per session in STATS (client names are unbounded: no labels for them).
"""

from __future__ import annotations

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
        self.totals = AcceptanceTotals(num_spec)
        self._by_session: dict[Session, Acceptance] = {}
        if registry is not None:
            registry.register(_AcceptanceFamilies(self.totals))

    def step_answered(self, item: StepItem) -> None:
        """A STEP answered ST_OK: judge what it resolves, keep what it drafted."""
        s = item.session
        if not s.alive:  # dropped while its STEP was on the device: nothing to keep
            return
        acc = self._by_session.get(s)
        if acc is None:
            acc = self._by_session[s] = Acceptance(s.max_slots, self.num_spec, (self.totals,))
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
        flags = item.view.entries["flags"]
        acc.observe(plan.slots, plan.generation, plan.anchor_pos, flags, drafted, confidence)

    def forget(self, session: Session) -> None:
        self._by_session.pop(session, None)

    def session_summary(self, session: Session) -> dict[str, Any]:
        acc = self._by_session.get(session)
        return (acc.totals if acc is not None else AcceptanceTotals(self.num_spec)).summary()


class _AcceptanceFamilies(Collector):
    """The worker's acceptance totals as counters, read at scrape time (the loop thread is the
    only writer; a scrape may see one STEP's positions half added, never a torn number)."""

    def __init__(self, totals: AcceptanceTotals) -> None:
        self.totals = totals

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        t, p = self.totals, f"{PREFIX}_acceptance"
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
