"""The engine side's metrics: the client's ``Stats`` as metric families, as a plain dict
(``client_metrics``) or through a prometheus-client collector that an engine registers in its
own registry (``prometheus_collector``). docs/operations.md, "Engine-side metrics", lists them.

Both read one snapshot of the ``Stats`` per call (per scrape), so the engine's thread pays
nothing for them. Names map by rule, not one by one: a counter added to ``Stats`` later appears
as ``dspark_client_<key>_total`` without a line here (``_us_total`` keys as ``_seconds_total``),
a numeric value (``Stats.set``) as the gauge ``dspark_client_<key>``; the tables below only give
names, help texts and labels to the ones that need them.

prometheus_client stays optional: it is imported inside ``prometheus_collector`` only.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any, Final, NamedTuple

from .acceptance import ClientAcceptance
from .stats import COUNTERS as STATS_COUNTERS
from .stats import GAUGES as STATS_GAUGES
from .stats import Stats

__all__ = ["PREFIX", "STEP_RTT_BUCKETS", "MetricFamily", "acceptance_families", "client_metrics",
           "families", "prometheus_collector"]

PREFIX: Final = "dspark_client"
# STEP round trips: 50 us (loopback, small STEP) .. 5 s (far past any sane timeout_ms).
STEP_RTT_BUCKETS: Final = (50e-6, 100e-6, 200e-6, 500e-6, 1e-3, 2e-3, 5e-3, 10e-3, 20e-3, 50e-3,
                           0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
RTT_KEY: Final = "step_rtt_seconds"  # the Stats histogram the client observes

# Stats counter -> (family name without prefix and _total, help). Values in microseconds are
# scaled to seconds by the _us_total rule.
COUNTERS: Final[Mapping[str, tuple[str, str]]] = {
    "rounds_ok": ("rounds_drafted", "Rounds the worker answered with drafts (DraftRounds.run)."),
    "hellos": ("hellos", "HELLOs accepted: connections that became ready (each starts an"
                         " epoch)."),
    "reconnects": ("reconnects", "HELLOs accepted after the first: reconnects, failovers and"
                                 " new sessions."),
    "disconnects": ("disconnects", "Connections dropped (timeouts, transport errors, refused"
                                   " replies, new sessions)."),
    "connect_failures": ("connect_failures", "Connect or HELLO attempts that failed."),
    "failovers": ("failovers", "Moves to the next endpoint after repeated connect failures."),
    "new_sessions": ("new_sessions", "New session ids started (RS_STALE_GENERATION and the"
                                     " like)."),
    "slots_resynced": ("slots_resynced", "Slot entries sent as a resync (RF_RESET with the"
                                         " newest window rows)."),
    "deferred_slots_total": ("deferred_slots", "Slot entries left out of a round by the row"
                                               " budget (no drafts for that slot that round;"
                                               " they go oldest first)."),
    "starved_slots_total": ("starved_slots", "Times a slot was left out of fair_bound_rounds"
                                             " rounds in a row (see starved_slots_now)."),
    "steps": ("steps", "STEPs answered by the worker (any status)."),
    "steps_ok": ("steps_ok", "STEP replies that passed every check (not draft acceptance:"
                             " see dspark_client_acceptance_accepted_total)."),
    "step_timeouts": ("step_timeouts", "STEPs not answered within timeout_ms."),
    "step_transport_errors": ("step_transport_errors", "STEPs lost to a connection error."),
    "bad_replies": ("bad_replies", "STEP replies refused by the client's checks."),
    "bytes_sent": ("sent_bytes", "Bytes of STEP frames sent."),
    "bytes_received": ("received_bytes", "Bytes of STEP replies received."),
    "worker_us_total": ("step_worker_seconds", "Time the worker reported for answered STEPs"
                                               " (worker_us)."),
    "client_us_total": ("step_client_seconds", "Client time of answered STEPs outside the"
                                               " round trip (packing, checks)."),
    "round_us_total": ("round_seconds", "Time in DraftRounds.run for rounds with drafts."),
    "remote_disabled": ("remote_disabled", "Times remote drafting was turned off for the"
                                           " engine run (a fatal status)."),
}
# Stats counter prefix -> (family, help, label): the rest of the key is the label's value.
LABELLED: Final[Mapping[str, tuple[str, str, str]]] = {
    "rounds_failed_": ("rounds_target_only", "Target-only rounds, by reason (timeout,"
                       " not_ready, deferred, frame_busy, ...).", "reason"),
    "step_frame_": ("step_refusals", "STEPs answered with a frame status other than OK, by"
                    " status.", "status"),
}
# Stats values (``set``) that are numbers or flags -> (gauge name, help); other numeric values
# appear as ``dspark_client_<key>`` gauges by the same rule as the counters.
GAUGES: Final[Mapping[str, tuple[str, str]]] = {
    "epoch": ("epoch", "Connection epoch: HELLOs accepted by this client so far."),
    "connected": ("connected", "1 while a connection to a worker is ready for STEPs."),
}
# Label values exported from 0 on (the usual reasons), like the counters of COUNTERS.
INITIAL_LABELS: Final[Mapping[str, tuple[str, ...]]] = {
    "rounds_failed_": ("timeout", "not_ready", "deferred", "transport_error", "bad_reply",
                       "disabled"),
}
# Sums of a labelled family, or the RTT histogram's sum: not exported twice.
SKIPPED: Final = frozenset({"rounds_failed", "rtt_us_total"})
_NAME_CHARS: Final = re.compile(r"[^a-zA-Z0-9_]")


class MetricFamily(NamedTuple):
    """One family: ``kind`` counter, gauge or histogram. ``samples`` maps label values (a
    tuple, empty without labels) to a number, or for a histogram to
    ``{"buckets": [(le, cumulative count), ...], "count": n, "sum": seconds}``."""

    name: str  # full name, counters without _total
    kind: str
    help: str
    labels: tuple[str, ...]
    samples: dict[tuple[str, ...], Any]


def _stats_of(source: Any) -> Stats:
    """A ``Stats``, or whatever holds one: a RemoteDraftClient (``.stats``) or a DraftRounds
    (``.client.stats``)."""
    if isinstance(source, Stats):
        return source
    for path in (("stats",), ("client", "stats")):
        obj = source
        for attr in path:
            obj = getattr(obj, attr, None)
        if isinstance(obj, Stats):
            return obj
    raise TypeError(f"{type(source).__name__} is not a Stats and holds none (.stats,"
                    " .client.stats)")


def _acceptance_of(source: Any) -> ClientAcceptance | None:
    """The ``ClientAcceptance`` of a RemoteDraftClient (``.acceptance``) or a DraftRounds
    (``.client.acceptance``); None for a bare ``Stats``."""
    for obj in (source, getattr(source, "client", None)):
        acc = getattr(obj, "acceptance", None)
        if isinstance(acc, ClientAcceptance):
            return acc
    return None


def acceptance_families(acc: ClientAcceptance) -> list[MetricFamily]:
    """The acceptance totals (docs/operations.md, "Acceptance") as counters by position."""
    t, p = acc.totals(), f"{PREFIX}_acceptance"
    out = [MetricFamily(f"{p}_rounds", "counter", "Draft blocks whose outcome the slot's next"
                        " STEP showed (judged blocks).", (), {(): t.rounds}),
           MetricFamily(f"{p}_verified_rounds", "counter", "Judged blocks for which the engine"
                        " said how many drafts it verified (record_verified).", (),
                        {(): t.verified_rounds})]
    kinds = [
        ("drafted", "Judged blocks with a draft at this block position.", t.drafted),
        ("accepted", "Drafts the target accepted at this block position (the drafts before"
         " it were accepted too).", t.accepted),
        ("predicted", "The confidence head's probability that the draft at this position is"
         " accepted (prefix survival), summed over judged blocks.", t.predicted),
        ("verified", "Drafts the engine verified at this block position, of the blocks it"
         " reported (record_verified).", t.verified)]
    for name, text, values in kinds:
        if name == "predicted" and not t.has_confidence:
            continue  # a drafter without a confidence head predicts nothing
        out.append(MetricFamily(f"{p}_{name}", "counter", text, ("position",),
                                {(str(j),): v for j, v in enumerate(values.tolist())}))
    return out


def families(source: Any) -> list[MetricFamily]:
    """The client's metric families, from one snapshot of its stats."""
    stats = _stats_of(source)
    snap, values = stats.split_snapshot()
    hists = stats.histograms()
    p = PREFIX
    counters: dict[str, MetricFamily] = {}

    def add(name: str, help_: str, value: float, label: str | None = None,
            label_value: str = "") -> None:
        fam = counters.get(name)
        if fam is None:
            fam = counters[name] = MetricFamily(f"{p}_{name}", "counter", help_,
                                                (label,) if label else (), {})
        key = (label_value,) if label else ()
        fam.samples[key] = fam.samples.get(key, 0) + value

    for name, help_ in COUNTERS.values():  # from 0, so rate() sees the first event
        add(name, help_, 0)
    for prefix, label_values in INITIAL_LABELS.items():
        name, help_, label = LABELLED[prefix]
        for label_value in label_values:
            add(name, help_, 0, label, label_value)
    for key, value in sorted(snap.items()):
        if key in SKIPPED:
            continue
        if key in COUNTERS:
            name, help_ = COUNTERS[key]
            add(name, help_, value * (1e-6 if key.endswith("_us_total") else 1))
            continue
        for prefix, (name, help_, label) in LABELLED.items():
            if key.startswith(prefix):
                label_value = key[len(prefix):]
                add(name, help_, value, label,
                    label_value.upper() if label == "status" else label_value)
                break
        else:
            stem = _NAME_CHARS.sub("_", key)
            if stem.endswith("_us_total"):
                add(stem[:-len("_us_total")] + "_seconds", f"Client time {key}, in seconds.",
                    value * 1e-6)
            else:
                add(stem.removesuffix("_total"),
                    STATS_COUNTERS.get(key, f"Client counter {key}."), value)
    out = list(counters.values())
    gauges: dict[str, int | float] = dict.fromkeys(GAUGES, 0)  # 0 before the first HELLO
    gauges.update({k: int(v) if isinstance(v, bool) else v for k, v in values.items()
                   if isinstance(v, (int, float))})
    for key, value in sorted(gauges.items()):
        name, help_ = GAUGES.get(key) or (_NAME_CHARS.sub("_", key),
                                          STATS_GAUGES.get(key, f"Client value {key}."))
        out.append(MetricFamily(f"{p}_{name}", "gauge", help_, (), {(): value}))
    out.append(MetricFamily(f"{p}_disabled", "gauge", "1 once remote drafting is off for this"
                            " engine run (a fatal status; the log says why).", (),
                            {(): 1 if snap.get("remote_disabled") else 0}))
    worker = values.get("worker")
    if isinstance(worker, dict):
        out.append(MetricFamily(f"{p}_worker_info", "gauge", "Constant 1: the worker this"
                                " client last connected to.", ("worker_name", "endpoint"),
                                {(str(worker.get("name", "")), str(worker.get("endpoint", ""))):
                                 1}))
    rtt = hists.get(RTT_KEY)
    buckets = rtt["buckets"] if rtt else [(b, 0) for b in (*STEP_RTT_BUCKETS, float("inf"))]
    out.append(MetricFamily(f"{p}_step_rtt_seconds", "histogram", "STEP round trip, request"
                            " sent to reply received, of STEPs the worker answered.", (),
                            {(): {"buckets": buckets, "count": rtt["count"] if rtt else 0,
                                  "sum": rtt["sum"] if rtt else 0.0}}))
    acc = _acceptance_of(source)
    if acc is not None:
        out.extend(acceptance_families(acc))
    return out


def client_metrics(source: Any) -> dict[str, Any]:
    """The families as a plain dict, keyed by the names a Prometheus scrape shows (counters
    with ``_total``): a number, ``{label value: number}`` for a family with one label, a list
    of ``{label: value, ..., "value": number}`` for more (``worker_info``), and for the RTT
    histogram ``{"buckets": {le: cumulative count}, "count": n, "sum": seconds}``.
    For logs, tests, or an engine's own stats logger."""
    out: dict[str, Any] = {}
    for fam in families(source):
        name = fam.name + ("_total" if fam.kind == "counter" else "")
        if fam.kind == "histogram":
            h = fam.samples[()]
            out[name] = {"buckets": {_le(le): n for le, n in h["buckets"]}, "count": h["count"],
                         "sum": h["sum"]}
        elif len(fam.labels) == 1:
            out[name] = {k[0]: v for k, v in fam.samples.items()}
        elif fam.labels:
            out[name] = [{**dict(zip(fam.labels, k, strict=True)), "value": v}
                         for k, v in fam.samples.items()]
        else:
            out[name] = fam.samples[()]
    return out


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(float(bound))


def prometheus_collector(source: Any, *, labels: Mapping[str, str] | None = None) -> Any:
    """A prometheus-client ``Collector`` of the client's metrics, read at scrape time::

        from prometheus_client import REGISTRY
        REGISTRY.register(dspark_client.prometheus_collector(client))

    ``source``: the ``RemoteDraftClient`` (or its ``DraftRounds``, or its ``Stats``).
    ``labels``: constant labels on every series, e.g. ``{"dp_rank": "0"}`` when one registry
    holds several clients (one collector each, with different values)."""
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
    )
    from prometheus_client.registry import Collector

    stats = _stats_of(source)  # fail now, not at the first scrape
    acc = _acceptance_of(source)
    const = dict(labels or {})
    for name in const:
        if not re.fullmatch(r"[a-zA-Z_][a-zA-Z0-9_]*", name) or name.startswith("__"):
            raise ValueError(f"label name {name!r} is not a Prometheus label name")
    const_names, const_values = list(const), list(const.values())
    kinds = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily}

    class ClientCollector(Collector):
        def describe(self) -> list[Any]:
            return []  # families appear as counters do; several clients may share a registry

        def collect(self) -> Iterator[Any]:
            for fam in families(source if acc is not None else stats):
                names = [*const_names, *fam.labels]
                if fam.kind == "histogram":
                    hist = HistogramMetricFamily(fam.name, fam.help, labels=names)
                    for key, h in fam.samples.items():
                        hist.add_metric([*const_values, *key],
                                        [(_le(le), n) for le, n in h["buckets"]], h["sum"])
                    yield hist
                    continue
                metric = kinds[fam.kind](fam.name, fam.help, labels=names)
                for key, value in sorted(fam.samples.items()):
                    metric.add_metric([*const_values, *key], value)
                yield metric

    return ClientCollector()
