"""Prometheus collectors and the STATS latency windows (docs/contract.md sections 10 and 12).

Every collector lives on the ``CollectorRegistry`` passed in, never on the global default one,
so tests build a fresh registry per worker and several workers can share a process. Names follow
Prometheus conventions: prefix ``dspark_worker_``, ``_total`` on counters, base units (seconds,
bytes).

Families:

==========================================  =========  ==========================================
name                                        type       labels / meaning
==========================================  =========  ==========================================
dspark_worker_frames_total                  counter    op, status: frames answered
dspark_worker_request_status_total          counter    status: STEP entries by request status
dspark_worker_received_rows_total           counter    tap rows received in accepted STEPs
dspark_worker_received_bytes_total          counter    bytes of every frame received
dspark_worker_sent_bytes_total              counter    bytes of every reply sent
dspark_worker_drafted_positions_total       counter    draft positions returned (k per entry)
dspark_worker_hello_refusals_total          counter    status: HELLOs refused
dspark_worker_sessions_dropped_total        counter    reason: replaced, recreated, expired, ...
dspark_worker_connections_total             counter    connections accepted
dspark_worker_connections_refused_total     counter    connections closed at once (limit)
dspark_worker_connections_closed_total      counter    reason: peer, bad_magic, too_large,
                                                       handshake_timeout, idle_timeout, ...
dspark_worker_stranger_waits_total          counter    kind (hello, other), limit (peer,
                                                       worker): frames without a session held
                                                       back by a rate (admission.py)
dspark_worker_sessions                      gauge      sessions held
dspark_worker_active_slots                  gauge      slots with a live generation
dspark_worker_connections_open              gauge      connections open
dspark_worker_queue_steps                   gauge      STEPs waiting for the device
dspark_worker_window_memory_bytes           gauge      ring pool reserved at start
dspark_worker_window_memory_used_bytes      gauge      ring memory of the lanes sessions hold
dspark_worker_ready                         gauge      1 once the drafter is loaded and warm
dspark_worker_start_time_seconds            gauge      Unix time the worker started (restarts)
dspark_worker_resident_memory_bytes         gauge      the process's resident set size
dspark_worker_receive_buffers_bytes         gauge      pooled receive buffers held now (in use
                                                       plus idle; pinned on CUDA)
dspark_worker_device_memory_allocated_bytes gauge      CUDA only: torch tensors on the device
dspark_worker_device_memory_reserved_bytes  gauge      CUDA only: torch's caching allocator
dspark_worker_confidence_head               gauge      1: the drafter has a confidence head; 0:
                                                       none (nothing predicted)
dspark_worker_info                          gauge      1; labels version, worker_name, device,
                                                       dtype, drafter_identity, markov_identity
dspark_worker_stage_duration_seconds        histogram  stage: decode, queue, apply, draft,
                                                       encode, step (frame's last byte to reply),
                                                       to_device, from_device (the hand-offs)
dspark_worker_batch_steps                   histogram  STEPs per device batch
dspark_worker_batch_entries                 histogram  entries drafted per drafter call
dspark_worker_gc_pause_seconds              histogram  generation (0, 1, 2): pauses of the cyclic
                                                       garbage collector (the loop waits)
dspark_worker_cuda_graphs                   gauge      captured draft-step graphs in use (0:
                                                       the eager step)
dspark_worker_cuda_graph_fallbacks_total    counter    start-up captures or self-checks that
                                                       failed (the worker then drafts eagerly)
dspark_worker_drafter_info                  gauge      1 per drafter loaded; labels version, name,
                                                       role (newest, older, canary),
                                                       drafter_identity, markov_identity
dspark_worker_version_sessions              gauge      version, name: sessions it serves
dspark_worker_version_weights_bytes         gauge      version, name: its weights' memory
dspark_worker_reloads_total                 counter    what (drafter, canary), result (ok,
                                                       unchanged, failed): reloads done
dspark_worker_acceptance_rounds_total       counter    draft blocks the next STEP judged
dspark_worker_acceptance_drafted_total      counter    position: judged blocks with a draft there
dspark_worker_acceptance_accepted_total     counter    position: drafts accepted there
dspark_worker_acceptance_predicted_total    counter    position: confidence survival, summed
                                                       (absent without a confidence head)
dspark_worker_acceptance_sessions_judged    gauge      sessions the quantiles below are over
dspark_worker_acceptance_session_accepted_  gauge      quantile: over sessions, each one's mean
drafts                                                 accepted drafts in its last 10 minutes
==========================================  =========  ==========================================

The acceptance families are ``acceptance.WorkerAcceptance``'s (docs/operations.md,
"Acceptance").
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Callable, Iterator
from itertools import accumulate
from typing import Final

import numpy as np
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from protocol.constants import FRAME_STATUS_NAMES, OP_NAMES, REQ_STATUS_NAMES, RS_OK

PREFIX: Final = "dspark_worker"
# to_device: accepted STEP to the device thread starting its batch; from_device: the batch done
# to its STEP being answered on the loop (the two cross-thread hand-offs of a STEP).
STAGES: Final = ("decode", "queue", "apply", "draft", "encode", "step", "to_device",
                 "from_device")
# 20 us .. 5 s: a STEP's host work is tens of microseconds, a large batch's draft many ms.
LATENCY_BUCKETS: Final = (20e-6, 50e-6, 100e-6, 200e-6, 500e-6, 1e-3, 2e-3, 5e-3, 10e-3, 20e-3,
                          50e-3, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
_LE: Final = [str(floatToGoString(b)) for b in LATENCY_BUCKETS] + [  # type: ignore[no-untyped-call]
    "+Inf"]
BATCH_BUCKETS: Final = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
GC_BUCKETS: Final = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
# Samples kept per stage for the STATS quantiles: the last few seconds at full load.
LATENCY_WINDOW: Final = 2048


def op_label(op: int) -> str:
    return OP_NAMES.get(op, "unknown")


def frame_status_label(status: int) -> str:
    return FRAME_STATUS_NAMES.get(status, str(status))


class LatencyWindow:
    """The last ``size`` samples of one stage, for STATS quantiles. Loop thread only: the
    device thread measures, dispatch records once the batch is back."""

    def __init__(self, size: int = LATENCY_WINDOW) -> None:
        self._values = [0.0] * size
        self._size = size
        self._n = 0

    def add(self, seconds: float) -> None:
        self._values[self._n % self._size] = seconds
        self._n += 1

    def quantiles(self) -> dict[str, float | int]:
        """count (all time) and p50/p90/p99/max in microseconds over the window."""
        n = min(self._n, self._size)
        data = np.asarray(self._values[:n], dtype=np.float64)
        total = self._n
        if n == 0:
            return {"count": total}
        p50, p90, p99 = (float(x) for x in np.percentile(data, [50, 90, 99]))
        return {"count": total, "p50_us": round(p50 * 1e6, 1), "p90_us": round(p90 * 1e6, 1),
                "p99_us": round(p99 * 1e6, 1), "max_us": round(float(data.max()) * 1e6, 1)}


class Metrics:
    """The worker's collectors on an injected registry, plus the STATS latency windows."""

    def __init__(self, registry: CollectorRegistry) -> None:
        # No *_created series beside each counter (as most exporters): they double the series
        # and nothing reads them; restarts come from start_time_seconds. Process-wide.
        disable_created_metrics()  # type: ignore[no-untyped-call]
        self.registry = registry
        p = PREFIX
        r = registry
        self.hello_refusals = Counter(f"{p}_hello_refusals", "HELLOs refused, by frame status.",
                                      ["status"], registry=r)
        self.sessions_dropped = Counter(f"{p}_sessions_dropped",
                                        "Sessions dropped with their windows, by reason.",
                                        ["reason"], registry=r)
        self.connections_total = Counter(f"{p}_connections", "Connections accepted.",
                                         registry=r)
        self.connections_refused = Counter(f"{p}_connections_refused",
                                           "Connections closed at once: over the limit or"
                                           " draining.", registry=r)
        self.connections_closed = Counter(f"{p}_connections_closed",
                                          "Connections closed, by reason.", ["reason"],
                                          registry=r)
        self.stranger_waits = Counter(f"{p}_stranger_waits",
                                      "Frames of connections without a session held back by"
                                      " a rate (kind hello or other; limit peer or worker).",
                                      ["kind", "limit"], registry=r)
        self.sessions = Gauge(f"{p}_sessions", "Sessions held.", registry=r)
        self.active_slots = Gauge(f"{p}_active_slots", "Slots with a live generation.",
                                  registry=r)
        self.connections = Gauge(f"{p}_connections_open", "Connections open.", registry=r)
        self.shm_mapped = Gauge(f"{p}_shm_mapped_bytes",
                                "Bytes of shared-memory rows regions mapped now (section 13).",
                                registry=r)
        self.queue_steps = Gauge(f"{p}_queue_steps", "STEPs waiting for the device.",
                                 registry=r)
        self.window_memory = Gauge(f"{p}_window_memory_bytes",
                                   "Ring pool memory reserved at start.", registry=r)
        self.window_memory_used = Gauge(f"{p}_window_memory_used_bytes",
                                        "Ring memory of the lanes sessions hold.", registry=r)
        self.ready = Gauge(f"{p}_ready", "1 once the drafter is loaded and warmed up.",
                           registry=r)
        self.cuda_graphs = Gauge(f"{p}_cuda_graphs", "Captured draft-step graphs in use (one"
                                 " per batch bucket and sampling mode; 0: the eager step).",
                                 registry=r)
        self.cuda_graph_fallbacks = Counter(
            f"{p}_cuda_graph_fallbacks", "Start-up captures or self-checks of the draft-step"
            " graphs that failed; the worker then drafts eagerly.", registry=r)
        # A gauge, not the counters' *_created series: some setups drop those (the OpenMetrics
        # option of prometheus_client, relabelling), and a restart alert must not depend on it.
        self.start_time = Gauge(f"{p}_start_time_seconds",
                                "Unix time the worker process started.", registry=r)
        self.start_time.set(time.time())
        self.resident_memory = Gauge(f"{p}_resident_memory_bytes",
                                     "Resident set size of the worker process.", registry=r)
        self.receive_buffers = Gauge(f"{p}_receive_buffers_bytes",
                                     "Receive buffers the worker holds now, in use and idle"
                                     " (power-of-two size classes; pinned host memory on CUDA).",
                                     registry=r)
        self.confidence_head = Gauge(
            f"{p}_confidence_head", "1: the drafter has a confidence head; 0: it has none (its"
            " confidences are 1.0 and predict nothing; no acceptance_predicted series).",
            registry=r)
        self.info = Gauge(f"{p}_info", "Constant 1; what this worker runs.",
                          ["version", "worker_name", "device", "dtype", "drafter_identity",
                           "markov_identity"], registry=r)
        self.reloads = Counter(f"{p}_reloads", "Reloads (SIGHUP, RELOAD) of the drafter or the"
                               " canary, by result: ok (a new version serves new HELLOs),"
                               " unchanged (the files hold a version already serving), failed"
                               " (nothing changed; the log says why).", ["what", "result"],
                               registry=r)
        for what in ("drafter", "canary"):
            for result in ("ok", "unchanged", "failed"):
                self.reloads.labels(what=what, result=result)
        self.batch_steps = Histogram(f"{p}_batch_steps", "STEPs per device batch.",
                                     buckets=BATCH_BUCKETS, registry=r)
        self.gc_pause = Histogram(f"{p}_gc_pause_seconds",
                                  "Pauses of the cyclic garbage collector, by generation: the"
                                  " event loop and the device thread wait for them.",
                                  ["generation"], buckets=GC_BUCKETS, registry=r)
        self.batch_entries = Histogram(f"{p}_batch_entries",
                                       "Entries drafted per drafter call.",
                                       buckets=BATCH_BUCKETS, registry=r)
        # The per-STEP families are plain numbers here, exported when scraped (_StepFamilies):
        # a prometheus_client child costs a lock per update, and a STEP makes about ten.
        self.windows = {s: LatencyWindow() for s in STAGES}
        self.frame_counts: dict[tuple[int, int], int] = {}
        self.request_counts = [0] * (max(REQ_STATUS_NAMES) + 1)
        self.stage_buckets = {s: [0] * (len(LATENCY_BUCKETS) + 1) for s in STAGES}
        self.stage_sums = dict.fromkeys(STAGES, 0.0)
        # Totals, for STATS and for the counters of the same names.
        self.totals: dict[str, int] = {"steps": 0, "rows": 0, "drafted_positions": 0,
                                       "frames": 0, "received_bytes": 0, "sent_bytes": 0}
        self.refusals: dict[str, int] = {}
        registry.register(_StepFamilies(self))

    def watch_memory(self, rss: Callable[[], int],
                     device: tuple[Callable[[], int], Callable[[], int]] | None = None) -> None:
        """Read the memory gauges at scrape time: ``rss()`` bytes, and on CUDA ``device``'s
        (allocated, reserved) bytes. The device gauges exist only when ``device`` is given: on
        the CPU the drafter's tensors are part of the resident set."""
        self.resident_memory.set_function(rss)
        if device is None:
            return
        allocated, reserved = device
        Gauge(f"{PREFIX}_device_memory_allocated_bytes",
              "Device memory held by torch tensors (weights, ring pool, working memory).",
              registry=self.registry).set_function(allocated)
        Gauge(f"{PREFIX}_device_memory_reserved_bytes",
              "Device memory reserved by torch's caching allocator (allocated plus cached"
              " blocks).", registry=self.registry).set_function(reserved)

    def observe_stage(self, stage: str, seconds: float) -> None:
        self.stage_buckets[stage][bisect_left(LATENCY_BUCKETS, seconds)] += 1
        self.stage_sums[stage] += seconds
        self.windows[stage].add(seconds)

    def frame(self, op: int, status: int) -> None:
        key = (op, status)
        self.frame_counts[key] = self.frame_counts.get(key, 0) + 1
        self.totals["frames"] += 1
        if status:
            name = f"{op_label(op)}:{frame_status_label(status)}"
            self.refusals[name] = self.refusals.get(name, 0) + 1

    def request_statuses(self, counts: np.ndarray) -> None:
        """``counts[rs]`` entries answered with request status ``rs``."""
        mine = self.request_counts
        for rs, n in enumerate(counts[:len(mine)].tolist()):
            mine[rs] += n

    def request_status_ok(self, n: int) -> None:
        """``n`` entries answered RS_OK (the usual STEP)."""
        self.request_counts[RS_OK] += n

    def step_accepted(self, rows: int, received_bytes: int) -> None:
        self.totals["steps"] += 1
        self.totals["rows"] += rows

    def drafted(self, positions: int) -> None:
        self.totals["drafted_positions"] += positions

    def received(self, nbytes: int) -> None:
        self.totals["received_bytes"] += nbytes

    def sent(self, nbytes: int) -> None:
        self.totals["sent_bytes"] += nbytes

    def latency_quantiles(self) -> dict[str, dict[str, float | int]]:
        return {s: w.quantiles() for s, w in self.windows.items()}


class VersionFamilies(Collector):
    """The drafter versions (and the canary) as families read at scrape time: ``rows()``
    gives (version label, name, role, drafter identity hex, markov identity hex, sessions,
    weights bytes) per drafter loaded."""

    def __init__(self, rows: Callable[[], list[tuple[str, str, str, str, str, int, int]]]
                 ) -> None:
        self.rows = rows

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        rows = self.rows()
        info = GaugeMetricFamily(f"{PREFIX}_drafter_info", "Constant 1 per drafter loaded:"
                                 " its version, name, role (newest: serves new HELLOs that"
                                 " follow the worker; older: only the sessions that said HELLO"
                                 " to it; canary) and identities.",
                                 labels=["version", "name", "role", "drafter_identity",
                                         "markov_identity"])
        sessions = GaugeMetricFamily(f"{PREFIX}_version_sessions",
                                     "Sessions served by each drafter version.",
                                     labels=["version", "name"])
        weights = GaugeMetricFamily(f"{PREFIX}_version_weights_bytes",
                                    "Memory of each loaded drafter's weights (the ring memory"
                                    " is shared by every version).", labels=["version", "name"])
        for version, name, role, d_id, m_id, n, nbytes in rows:
            info.add_metric([version, name, role, d_id, m_id], 1)
            weights.add_metric([version, name], nbytes)
            if role != "canary":
                sessions.add_metric([version, name], n)
        yield info
        yield sessions
        yield weights


class _StepFamilies(Collector):
    """The per-STEP families, read from :class:`Metrics`' plain numbers at scrape time.

    The loop thread is the only writer; a scrape (another thread) reads under the GIL and may
    see a histogram observation's bucket before its sum, never a torn number."""

    def __init__(self, metrics: Metrics) -> None:
        self.m = metrics

    def describe(self) -> list[Metric]:
        return []  # no descriptions at registration: collect() is cheap and always current

    def collect(self) -> Iterator[Metric]:
        m, p, t = self.m, PREFIX, self.m.totals
        frames = CounterMetricFamily(f"{p}_frames", "Frames answered, by op and frame status.",
                                     labels=["op", "status"])
        # Ops outside OP_NAMES share the label "unknown": their counts add into one series.
        by_label: dict[tuple[str, str], int] = {}
        for (op, status), n in sorted(dict(m.frame_counts).items()):
            labels = (op_label(op), frame_status_label(status))
            by_label[labels] = by_label.get(labels, 0) + n
        for (op_name, status_name), n in by_label.items():
            frames.add_metric([op_name, status_name], n)
        yield frames
        req = CounterMetricFamily(f"{p}_request_status",
                                  "STEP entries answered, by request status.", labels=["status"])
        counts = list(m.request_counts)
        for rs, name in sorted(REQ_STATUS_NAMES.items()):
            req.add_metric([name], counts[rs])
        yield req
        for name, key, text in (
                ("received_rows", "rows", "Tap rows received in accepted STEPs."),
                ("received_bytes", "received_bytes",
                 "Bytes of frames received (headers and bodies)."),
                ("sent_bytes", "sent_bytes", "Bytes of replies sent."),
                ("drafted_positions", "drafted_positions",
                 "Draft positions returned to clients.")):
            yield CounterMetricFamily(f"{p}_{name}", text, value=t[key])
        stages = HistogramMetricFamily(
            f"{p}_stage_duration_seconds",
            "Time per STEP stage: decode (decode, checks, session bookkeeping), queue, apply"
            " (rows into rings), draft (per batch), encode, step (last byte to reply),"
            " to_device (accepted to its batch starting on the device thread), from_device"
            " (batch done to the STEP answered on the loop).",
            labels=["stage"])
        for stage in STAGES:
            per_bucket, total = list(m.stage_buckets[stage]), m.stage_sums[stage]
            cumulative = list(accumulate(per_bucket))
            stages.add_metric([stage], list(zip(_LE, cumulative, strict=True)), total)
        yield stages
