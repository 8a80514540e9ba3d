"""The remote speculator driven as vLLM 0.34's model runner drives it (``engine.py``), against
a real dspark-worker: its drafts and confidences are what the worker drafts for the verified
rows through ``DraftRounds``; requests finish, are preempted and come back; a worker that stops
answering or dies gives empty drafts within the timeout."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from vllm_engine import (
    CPU,
    Engine,
    model_config,
    speculative_config,
    target_folder,
    vllm_config,
)

from tests.support.engine_plugin import reference_rounds, run_ranks
from tests.support.worker_proc import start_worker, worker_stats

K, W, MAX_REQS = 7, 16, 6
TIMEOUT_MS = 300


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    return model_config(target_folder(tmp_path_factory.mktemp("target")))


def make_speculator(target: Any, drafter: Path, endpoint: str, **options: Any) -> Any:
    from dspark_vllm.speculator import RemoteDSparkSpeculator

    opts = {"endpoint": endpoint, "window": W, "timeout_ms": TIMEOUT_MS,
            "connect_timeout_ms": 5000, "backoff_ms": 50, "backoff_max_ms": 200, **options}
    spec = speculative_config(target, drafter, speculator_options=opts)
    return RemoteDSparkSpeculator(vllm_config(target, spec, max_num_seqs=MAX_REQS), CPU)


def check(step: Any, *, drafting: set[str]) -> int:
    """The speculator's drafts equal the reference's where it drafted, zeros elsewhere;
    every request in ``drafting`` got a full block. Returns the positions compared."""
    compared = 0
    for i, req_id in enumerate(step.req_ids):
        want = step.ref_drafts[req_id]
        k = len(want)
        if req_id in drafting:
            assert k == K, f"{req_id}: the reference drafted {k} positions"
        assert step.drafts[i, :k].tolist() == want.tolist(), req_id
        assert np.allclose(step.confidence[i, :k], step.ref_confidence[req_id], atol=1e-4)
        assert not step.drafts[i, k:].any() and not step.confidence[i, k:].any()
        compared += k
    return compared


def session_of(worker: Any, max_slots: int) -> dict[str, Any]:
    sessions = [s for s in worker_stats(worker)["sessions"] if s["max_slots"] == max_slots]
    assert len(sessions) == 1, sessions
    return sessions[0]


def slots_in_use(worker: Any, max_slots: int, want: int) -> int:
    """The session's ``slots_in_use`` in STATS once it says ``want`` (or after 2 s): STATS
    to a connection without a session may be up to 0.25 s old (docs/operations.md, Limits)."""
    deadline = time.monotonic() + 2.0
    while True:
        got = int(session_of(worker, max_slots)["slots_in_use"])
        if got == want or time.monotonic() > deadline:
            return got
        time.sleep(0.02)


def test_drafts_equal_the_workers_through_draft_rounds(worker: Any, target: Any,
                                                       drafter_dirs: dict[str, Path]) -> None:
    """Prefill in chunks (one longer than W), a prefix-cache hit, decode steps that accept
    some drafts and verify fewer than K (adaptive verification's shorter queries), a finished
    request, a preempted one that comes back under another index, a new one in a freed slot:
    every step's drafts and confidences are the reference session's for the verified rows."""
    spec = make_speculator(target, drafter_dirs["host"], worker.endpoint)
    assert spec.rounds.client.ready, spec.rounds.client.last_error
    ref = reference_rounds(drafter_dirs["full"], worker.endpoint, window=W, max_slots=16)
    eng = Engine(spec, max_num_reqs=MAX_REQS, num_spec=K, window=W, reference=ref)
    eng.admit("a", 20)
    eng.admit("b", 9, cached=4)  # prefix cache: positions 0..3 never computed, no rows
    compared = 0
    step = eng.step({"a": (12, 0), "b": (5, 0)})  # a mid-prefill: rows, no draft
    compared += check(step, drafting={"b"})
    assert not step.drafts[0].any()
    compared += check(eng.step({"a": (8, 0), "b": (8, 3)}), drafting={"a", "b"})
    compared += check(eng.step({"a": (8, 7), "b": (4, 0)}), drafting={"a", "b"})
    eng.admit("c", 30)  # longer than W: only the newest W rows matter
    compared += check(eng.step({"a": (5, 2), "b": (8, 1), "c": (30, 0)}),
                      drafting={"a", "b", "c"})
    assert slots_in_use(worker, MAX_REQS, 3) == 3
    eng.finish("a")  # finished: released in the next round
    eng.preempt("b")  # preempted: its index freed, no call
    compared += check(eng.step({"c": (8, 6)}), drafting={"c"})
    assert slots_in_use(worker, MAX_REQS, 2) == 2  # a released, b's slot kept
    eng.admit("b", 13, cached=8)  # b comes back under another index: a new generation
    eng.admit("d", 6)
    compared += check(eng.step({"b": (5, 0), "c": (8, 0), "d": (6, 0)}),
                      drafting={"b", "c", "d"})
    for _ in range(3):
        compared += check(eng.step({"b": (8, 4), "c": (3, 2), "d": (8, 7)}),
                          drafting={"b", "c", "d"})
    # b's old slot went back when b showed up under its new index
    assert slots_in_use(worker, MAX_REQS, 3) == 3
    assert compared >= 12 * K
    stats = spec.rounds.client.stats.snapshot()
    assert stats["rounds_ok"] == spec.rounds.rounds and stats.get("rounds_failed", 0) == 0
    spec.rounds.client.close()
    ref.client.close()


def test_a_silent_or_dead_worker_gives_empty_drafts_within_the_timeout(
        target: Any, drafter_dirs: dict[str, Path]) -> None:
    """SIGSTOP (the worker holds the STEP): the step ends within timeout_ms with no drafts;
    after SIGCONT drafts come back; killed: empty drafts at once, and again every step."""
    with start_worker("--checkpoint", str(drafter_dirs["full"]), "--device", "cpu",
                      "--window", str(W), "--max-slots", "8", "--max-total-slots", "8") as w:
        spec = make_speculator(target, drafter_dirs["full"], w.endpoint)
        assert spec.rounds.client.ready, spec.rounds.client.last_error
        eng = Engine(spec, max_num_reqs=MAX_REQS, num_spec=K, window=W)
        eng.admit("a", 10)
        eng.admit("b", 7)
        first = eng.step({"a": (10, 0), "b": (7, 0)})
        assert first.drafts.any(axis=1).all() and (first.confidence > 0).any()
        os.kill(w.pid, signal.SIGSTOP)
        try:
            late = eng.step({"a": (8, 3), "b": (8, 1)})
        finally:
            os.kill(w.pid, signal.SIGCONT)
        assert not late.drafts.any() and not late.confidence.any()
        assert late.seconds < TIMEOUT_MS / 1000 + 0.5, late.seconds
        # The client reconnects in the background (the STEP's effect was unknown: both slots
        # resync); drafts come back within a few steps.
        deadline = time.monotonic() + 20
        while True:
            again = eng.step({"a": (1, 0), "b": (1, 0)})
            if again.drafts.any(axis=1).all():
                break
            assert time.monotonic() < deadline, spec.rounds.client.last_error
            time.sleep(0.05)
        w.kill()
        for _ in range(3):
            dead = eng.step({"a": (1, 0), "b": (1, 0)})
            assert not dead.drafts.any() and not dead.confidence.any()
            assert dead.seconds < TIMEOUT_MS / 1000 + 0.5, dead.seconds
        stats = spec.rounds.client.stats.snapshot()
        assert stats["rounds_failed"] >= 4
        spec.rounds.client.close()


def test_tensor_parallel_ranks_share_rank_0s_drafts(worker: Any, drafter_dirs: dict[str, Path],
                                                    tmp_path: Path) -> None:
    """Two ranks of a TP-2 engine in vLLM's own distributed setup (gloo on the CPU): only rank
    0 has a client (one session on the worker), and every step both ranks hold the same drafts
    and confidences, rank 0's, with the same adaptive-verification flag."""
    import sys

    from tests.client.real_engine import free_port

    def goodbyes() -> int:
        return int(worker_stats(worker)["totals"]["sessions_dropped"].get("goodbye", 0))

    before = goodbyes()
    port = str(free_port())
    script = Path(__file__).with_name("tp_rank.py")
    outs = [tmp_path / f"rank{r}.npz" for r in (0, 1)]
    run_ranks([[sys.executable, str(script), str(r), port, worker.endpoint,
                str(drafter_dirs["full"]), str(outs[r])] for r in (0, 1)], timeout=120)
    rank0, rank1 = (np.load(o) for o in outs)
    assert bool(rank0["driver"]) and bool(rank0["has_client"])
    assert not bool(rank1["driver"]) and not bool(rank1["has_client"])
    assert rank0["drafts"].any(axis=2).all(), "rank 0 drafted nothing"
    assert np.array_equal(rank0["drafts"], rank1["drafts"])
    assert np.array_equal(rank0["confidence"].view(np.int32), rank1["confidence"].view(np.int32))
    assert bool(rank0["adaptive"]) and bool(rank1["adaptive"])
    assert int(rank0["rounds"]) == 3
    # One session came and went (GOODBYE as the speculator was dropped): rank 1 had none.
    assert goodbyes() == before + 1


def test_requests_beyond_max_slots_are_served_without_drafts(
        worker: Any, target: Any, drafter_dirs: dict[str, Path]) -> None:
    """Two slots for three requests: the third gets no drafts (and sends nothing) until a
    slot is free; then its request-state index takes one, as a new generation."""
    spec = make_speculator(target, drafter_dirs["host"], worker.endpoint, max_slots=2)
    ref = reference_rounds(drafter_dirs["full"], worker.endpoint, window=W, max_slots=16)
    eng = Engine(spec, max_num_reqs=MAX_REQS, num_spec=K, window=W, reference=ref)
    for name in "abc":
        eng.admit(name, 9)
    step = eng.step({"a": (9, 0), "b": (9, 0), "c": (9, 0)})
    assert step.drafts[:2].any(axis=1).all() and not step.drafts[2].any()
    assert spec._slots.refused == 1
    for i in (0, 1):  # the two with slots draft what the worker drafts for their rows
        assert step.drafts[i].tolist() == step.ref_drafts[step.req_ids[i]].tolist()
    eng.finish("a")
    eng.finish("c")  # c never had a slot: nothing to release
    eng.admit("d", 5)  # a's slot is free again
    again = eng.step({"b": (8, 2), "d": (5, 0)})
    assert again.drafts.any(axis=1).all()
    assert again.drafts[1].tolist() == again.ref_drafts["d"].tolist()
    spec.rounds.client.close()
    ref.client.close()


@pytest.mark.parametrize(("has_confidence", "adaptive"), [(False, False), (None, True),
                                                          (True, True)])
def test_a_drafter_without_confidence_turns_adaptive_verification_off(
        worker: Any, target: Any, drafter_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch,
        has_confidence: bool | None, adaptive: bool) -> None:
    """What the client reports of the worker's drafter (``has_confidence``: False for a
    drafter without a confidence head, None while no HELLO was accepted) decides whether the
    speculator keeps vLLM's adaptive verification, which it reads as the effective flag.
    The worker here has a confidence head; the report is set on the client class (a real
    head-less worker: tests/client/test_client_confidence.py)."""
    from dspark_client import RemoteDraftClient
    from dspark_vllm.speculator import RemoteDSparkSpeculator

    monkeypatch.setattr(RemoteDraftClient, "has_confidence", has_confidence)
    spec = speculative_config(target, drafter_dirs["host"], speculator_options={
        "endpoint": worker.endpoint, "window": W})
    config = vllm_config(target, spec, max_num_seqs=2)
    spec.enable_adaptive_verification = True  # (vLLM refuses it without CUDA graphs)
    speculator = RemoteDSparkSpeculator(config, CPU)
    assert speculator.enable_adaptive_verification is adaptive
    speculator.rounds.client.close()
