"""The engine side of dspark: a torch-free client of a remote DSpark draft worker.

Runs inside an LLM serving engine's rank 0 (vLLM, SGLang, TensorRT-LLM). Layers, bottom up:

* ``transport``: blocking TCP / Unix sockets, scatter-gather send, replies into reused buffers;
* ``client``: ``RemoteDraftClient`` (session, HELLO, reconnect with backoff, checked STEPs);
* ``ring`` / ``rounds``: rank 0's ring of the newest W tap rows per slot and ``DraftRounds``,
  which turns the engine's per-step slot states into STEPs, resyncs and per-slot drafts;
* ``schedule``: confidence-scheduled verification lengths (DSpark Algorithm 1);
* ``config`` / ``stats``; ``metrics``: the stats as a dict or a prometheus-client collector.

Imports numpy, msgspec and ``protocol`` only: never torch, uvloop, prometheus_client or the
worker.

In an engine's rank 0::

    hello = hello_from_checkpoint("/models/dspark-qwen3-8b", window=W, max_slots=256,
                                  client_name="vllm-dp0@host-a")
    client = RemoteDraftClient(RemoteConfig(endpoint="tcp://10.0.0.7:7600", timeout_ms=50),
                               hello)
    rounds = DraftRounds(client)            # connects and HELLOs in the background
    ...
    # every engine step, per scheduled slot: the rows committed since the last step
    res = rounds.run([SlotRequest(slot, generation, anchor_pos, anchor_token, rows=new_rows,
                                  n_out=N) for ...], release=finished_slots)
    if res.ok:   # else: target-only this step (never waits past timeout_ms)
        # a drafter without a confidence head (res.has_confidence False): a static length
        conf = res.confidence if res.has_confidence else None
        lengths = schedule_greedy(conf, sps_table, res.num_drafted).lengths
        ...      # verify res.draft_ids[i, :lengths[i]]
        record_verified(rounds, slots, lengths)   # optional: what the engine verified
"""

from .acceptance import record_verified
from .client import RemoteDraftClient, StepOutcome
from .config import RemoteConfig, RemoteConfigError
from .hello import hello_from_checkpoint, tap_layers
from .metrics import client_metrics, prometheus_collector
from .ring import TapRing
from .rounds import DraftRounds, RoundResult, SlotRequest
from .schedule import (
    ConfidenceHistory,
    Schedule,
    SpsTable,
    schedule_global,
    schedule_greedy,
    schedule_static,
)
from .stats import Stats
from .transport import EndpointError, TransportError, TransportTimeout, make_client

__version__ = "0.1.0"

__all__ = [
    "ConfidenceHistory",
    "DraftRounds",
    "EndpointError",
    "RemoteConfig",
    "RemoteConfigError",
    "RemoteDraftClient",
    "RoundResult",
    "Schedule",
    "SlotRequest",
    "SpsTable",
    "Stats",
    "StepOutcome",
    "TapRing",
    "TransportError",
    "TransportTimeout",
    "client_metrics",
    "hello_from_checkpoint",
    "make_client",
    "prometheus_collector",
    "record_verified",
    "schedule_global",
    "schedule_greedy",
    "schedule_static",
    "tap_layers",
]
