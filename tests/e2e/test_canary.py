"""The canary against live traffic: the reference target decodes greedily with the reference
drafter over the wire while a worse drafter (the reference, perturbed) drafts in its shadow.

The canary's counted acceptance must be exactly what that drafter gets when it serves live:
the same STEPs (recorded from the serving run, rows and all) are replayed against a fresh
worker serving the perturbed drafter, its drafts judged against the greedy sequences the target
produced, position by position, with the canary's rule for blocks whose outcome the worker
never saw (the last of each request: counted nowhere). The serving drafter's own acceptance on
the same blocks comes beside it, and is the better one.
"""

from __future__ import annotations

import io
import itertools
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from dspark_client import cli, hello_from_checkpoint
from dspark_client.client import RemoteDraftClient
from dspark_client.config import RemoteConfig
from dspark_client.demo.corpus import heldout_prompts
from dspark_client.demo.speculative import RemoteDrafts, SpeculativeDecoder
from dspark_client.demo.target import TargetModel, default_target_dir, load_target
from dspark_client.rounds import DraftRounds, RoundResult, SlotRequest
from dspark_worker.drafter.drafter import REFERENCE_DIR
from tests.support.drafters import perturbed_reference
from tests.support.worker_proc import WorkerProcess, start_worker, worker_stats

W, SLOTS, MAX_LEN, NEW_TOKENS = 256, 4, 512, 64
ARGS = ("--window", str(W), "--max-slots", str(SLOTS), "--max-total-slots", str(2 * SLOTS),
        "--max-rows-per-step", "4096", "--device", "cpu", "--threads", "1")


@pytest.fixture(scope="module")
def target() -> TargetModel:
    torch.set_num_threads(1)
    return load_target(default_target_dir())


@pytest.fixture(scope="module")
def candidate(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return perturbed_reference(tmp_path_factory.mktemp("canary") / "candidate")


def connect(w: WorkerProcess, folder: Path, name: str) -> tuple[RemoteDraftClient, DraftRounds]:
    hello = hello_from_checkpoint(folder, window=W, max_slots=SLOTS, max_rows_per_step=4096,
                                  client_name=name)
    client = RemoteDraftClient(RemoteConfig(endpoint=w.endpoint or "", timeout_ms=10_000,
                                            connect_timeout_ms=10_000), hello)
    assert client.wait_ready(20.0), (client.disabled_reason, client.last_error)
    return client, DraftRounds(client)


class Recorded(RemoteDrafts):
    """RemoteDrafts that keeps every round: its requests (rows copied), the slots it
    released, and how many drafts the serving drafter gave each request."""

    def __init__(self, rounds: DraftRounds) -> None:
        super().__init__(rounds)
        self.log: list[tuple[list[SlotRequest], list[int], np.ndarray]] = []

    def round(self, requests: Sequence[SlotRequest]) -> RoundResult:
        release = list(self._release)
        res = super().round(requests)
        kept = [msgspec.structs.replace(r, rows=None if r.rows is None else r.rows.copy())
                for r in requests]
        self.log.append((kept, release, res.num_drafted.copy()))
        return res


def judge(tokens: list[int], anchor: int, drafts: Sequence[int], last: int) -> int | None:
    """Drafts accepted greedily of a block drafted at ``anchor``, when the tokens up to
    ``last`` (the newest anchor the worker saw) decide it; None when they do not."""
    for j, d in enumerate(drafts):
        pos = anchor + 1 + j
        if pos > last:
            return None
        if tokens[pos] != d:
            return j
    return len(drafts)


def by_position(blocks: list[tuple[int, int]], n: int) -> tuple[list[int], list[int]]:
    drafted, accepted = [0] * n, [0] * n
    for k, a in blocks:
        for j in range(n):
            drafted[j] += j < k
            accepted[j] += j < a
    return drafted, accepted


@pytest.fixture(scope="module")
def served(target: TargetModel, candidate: Path) -> Iterator[dict[str, Any]]:
    with start_worker("--canary-checkpoint", str(candidate), "--canary-fraction", "1",
                      *ARGS) as w:
        client, rounds = connect(w, REFERENCE_DIR, "served")
        source = Recorded(rounds)
        dec = SpeculativeDecoder(target, source, max_len=MAX_LEN, stop_at_eos=False)
        prompts = heldout_prompts(3, 96)
        seqs = [dec.start(i, p) for i, p in enumerate(prompts)]
        live = list(seqs)
        while live:  # SpeculativeDecoder.generate, keeping the sequences' whole tokens
            dec.step(live)
            done = [s for s in live if len(s.generated) >= NEW_TOKENS]
            if done:
                source.release([s.slot for s in done])
            live = [s for s in live if s not in done]
        client.close()  # GOODBYE: the session goes, and its chains end
        deadline = time.monotonic() + 20
        while (st := worker_stats(w))["canary"]["backlog_steps"] and time.monotonic() < deadline:
            time.sleep(0.05)
        yield {"stats": st, "log": source.log, "tokens": {s.slot: s.tokens for s in seqs},
               "failed": dec.stats.failed_rounds, "worker": w}


def test_canary_acceptance_equals_the_candidate_serving_live(served: dict[str, Any],
                                                             candidate: Path) -> None:
    st, log, tokens = served["stats"], served["log"], served["tokens"]
    canary = st["canary"]
    assert served["failed"] == 0
    assert canary["shed_entries"] == 0 and canary["backlog_steps"] == 0
    last = {slot: max(r.anchor_pos for reqs, _, _ in log for r in reqs if r.slot == slot)
            for slot in tokens}
    with start_worker("--checkpoint", str(candidate), *ARGS) as w:
        client, rounds = connect(w, candidate, "live")
        blocks, serving, censored = [], [], 0
        anchors: dict[int, list[int]] = {}
        for reqs, _, _ in log:
            for r in reqs:
                anchors.setdefault(r.slot, []).append(r.anchor_pos)
        # (slot, anchor) -> the slot's next anchor: what the serving block there accepted
        following = {(slot, a): b for slot, seq in anchors.items()
                     for a, b in itertools.pairwise(seq)}
        for reqs, release, served_k in log:
            res = rounds.run(reqs, release=release)
            assert res.ok, res.reason
            for i, r in enumerate(reqs):
                k = int(res.num_drafted[i])
                if not served_k[i] or not k:
                    continue
                a = judge(tokens[r.slot], r.anchor_pos, res.draft_ids[i, :k].tolist(),
                          last[r.slot])
                if a is None:
                    censored += 1
                    continue
                blocks.append((k, a))
                serving.append((int(served_k[i]),
                                following[(r.slot, r.anchor_pos)] - r.anchor_pos - 1))
        client.close()
    n = len(canary["acceptance"]["drafted_by_position"])
    drafted, accepted = by_position(blocks, n)
    assert len(blocks) > 30  # enough judged blocks for the comparison to mean something
    assert canary["acceptance"]["rounds"] == len(blocks)
    assert canary["acceptance"]["drafted_by_position"] == drafted
    assert canary["acceptance"]["accepted_by_position"] == accepted
    assert canary["censored_blocks"] == censored
    # The serving drafter on the very same blocks: counted beside it, and the better one.
    s_drafted, s_accepted = by_position(serving, n)
    assert canary["serving_acceptance"]["drafted_by_position"] == s_drafted
    assert canary["serving_acceptance"]["accepted_by_position"] == s_accepted
    assert sum(s_accepted) > sum(accepted)


def test_stats_cli_and_metrics_show_the_canary_beside_the_serving_drafter(
        served: dict[str, Any]) -> None:
    w, canary = served["worker"], served["stats"]["canary"]
    out = io.StringIO()
    assert cli.main(["stats", "--endpoint", w.endpoint or ""], out=out) == 0
    text = out.getvalue()
    assert "  drafter embedded@" in text  # the serving drafter in words
    assert f"  canary 2 {canary['name']} on 100% of the slots: {canary['acceptance']['rounds']}" \
        " judged blocks" in text
    assert "    by position canary " in text and "; serving " in text
    with urllib.request.urlopen(f"{w.metrics_url}/metrics", timeout=10) as r:
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for fam in text_string_to_metric_families(r.read().decode())
                   for s in fam.samples}
    rounds = {dict(k)["drafter"]: v for (name, k), v in samples.items()
              if name == "dspark_worker_canary_acceptance_rounds_total"}
    assert rounds == {"canary": canary["acceptance"]["rounds"],
                      "serving": canary["serving_acceptance"]["rounds"]}
    accepted = [samples[("dspark_worker_canary_acceptance_accepted_total",
                         (("drafter", "canary"), ("name", canary["name"]), ("position", str(j)),
                          ("version", "2")))] for j in range(7)]
    assert accepted == canary["acceptance"]["accepted_by_position"]
    # the start-up log says a canary runs, as STATS does
    log = w.log_text()
    assert f"canary 2 {canary['name']} drafts in the shadow of 100% of each session's slots" \
        in log
    assert f", canary 2 {canary['name']} drafting in the shadow of 100% of each session's" \
        " slots" in log
