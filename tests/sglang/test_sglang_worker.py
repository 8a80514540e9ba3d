"""``REMOTE_DSPARK``'s worker driven as SGLang 0.5.23's ``DSparkWorkerV2`` drives its draft
side (``sglang_engine.py``), against a real dspark-worker: every step's drafts and confidences
are what the worker drafts for the same rows and anchors through ``DraftRounds``; SGLang's own
accept and verify planner take them; requests finish, rows are reused under a new generation,
a prefix-cache hit brings no rows for its cached tokens; a worker that stops answering or dies
gives empty drafts within the timeout."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from sglang_engine import Engine, publish, server_args, stand_in_target

from tests.support.engine_plugin import reference_rounds, run_ranks
from tests.support.worker_proc import start_worker

W, GAMMA, TIMEOUT_MS = 16, 7, 300


def make_worker(drafter: Path, target_dir: Path, endpoint: str, monkeypatch: pytest.MonkeyPatch,
                **options: Any) -> Any:
    """The worker as SGLang's scheduler builds it: options from the environment, server
    arguments resolved and published, a stand-in target with SGLang's request table."""
    from dspark_sglang.worker import RemoteDSparkWorker

    monkeypatch.setenv("SGLANG_REMOTE_DSPARK_OPTIONS", json.dumps(
        {"endpoint": endpoint, "window": W, "timeout_ms": TIMEOUT_MS, **options}))
    args = server_args(drafter, target_dir, "--disable-overlap-schedule")
    publish(args)
    target = stand_in_target(hidden=128)
    return RemoteDSparkWorker(args, 0, 0, target), target


def same(step: Any) -> None:
    np.testing.assert_array_equal(step.drafts, step.ref_drafts)
    np.testing.assert_array_equal(step.confidence, step.ref_confidence)


def test_the_worker_has_no_draft_model_kv_or_graphs(worker: Any, drafter_dirs: dict[str, Path],
                                                    target_dir: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    wk, _ = make_worker(drafter_dirs["host"], target_dir, worker.endpoint, monkeypatch)
    try:
        assert wk.gamma == GAMMA and wk.verify_num_draft_tokens == GAMMA + 1
        assert wk._draft_worker is None and wk.weight_update_runners() == []
        # what SGLang's scheduler asks of its speculative worker at start
        assert wk.weight_load_time == 0.0 and wk.preloaded_weights_bytes == 0
        assert wk._draft_model_runners() == () and wk.primary_draft_kv_pool is None
        assert wk.draft_parallel_layout is None and wk.draft_swa_window == 0
        assert wk.spec_v2_attn_backends == (None,)  # the target's alone
        wk.alloc_memory_pool()
        wk.init_attention_backends()
        wk.init_cuda_graphs()
        assert wk.carries_confidence  # the drafter's config.json has a confidence head
        assert wk._proposer is wk._kv_injector and wk._proposer.rounds.client.ready
        assert wk._proposer.rounds.client.hello.client_name.startswith("sglang-dp0@")
    finally:
        wk._proposer.rounds.client.close()


def test_drafts_equal_the_workers_through_draft_rounds(worker: Any,
                                                       drafter_dirs: dict[str, Path],
                                                       target_dir: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefill, verify with partial acceptance, a finished request, its row reused by a new
    request (a new generation), a prefix-cache hit: every step's drafts and confidences are
    the reference session's, and SGLang's accept took them."""
    wk, target = make_worker(drafter_dirs["host"], target_dir, worker.endpoint, monkeypatch)
    ref = reference_rounds(drafter_dirs["full"], worker.endpoint, window=W, max_slots=16)
    eng = Engine(wk, target, drafter_dirs["host"], reference=ref)
    try:
        eng.prefill({"a": 10, "b": 7})
        first = eng.decode({"a": 2, "b": 0})
        same(first)
        assert first.confidence.all()  # every request drafted
        np.testing.assert_array_equal(first.commit_lens, [3, 1])  # accepted + bonus
        same(eng.decode({"a": GAMMA, "b": 3}))
        row_a = eng.reqs["a"].row
        slot_a = wk._proposer.slots.of_index[row_a]
        eng.finish("a")
        assert slot_a in wk._proposer.slots.release  # released in the next round
        # c on a's row: SGLang bumps its generation; a cached prefix of d brings no rows
        gen = int(target.model_runner.req_to_token_pool.req_generation[row_a])
        eng.prefill({"c": 9, "d": 12}, cached={"d": 4}, rows={"c": row_a})
        assert eng.reqs["c"].row == row_a
        assert int(target.model_runner.req_to_token_pool.req_generation[row_a]) == gen + 1
        step = eng.decode({"b": 1, "c": 5, "d": 0})
        same(step)
        assert slot_a not in wk._proposer.slots.release and step.confidence.all()
        same(eng.decode())
        # a prefill whose target kept the hidden states of e's last 5 tokens only
        eng.prefill({"e": 11, "f": 6}, last={"e": 5})
        same(eng.decode({"e": 3}))
        # b leaves the batch without finishing (SGLang retracted it): its slot goes back
        slot_b = wk._proposer.slots.of_index[eng.reqs["b"].row]
        eng.reqs.pop("b")
        same(eng.decode())
        assert slot_b not in wk._proposer.slots.index_of
        assert wk._proposer._guard.errors == 0
    finally:
        wk._proposer.rounds.client.close()
        ref.client.close()


def test_sglangs_planner_turns_the_confidences_into_budgets(
        worker: Any, drafter_dirs: dict[str, Path], target_dir: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Under SGLang's cap-accept mode (per-request verify lengths from the confidences) the
    planner takes the worker's confidences as a local drafter's and gives a budget."""
    monkeypatch.setenv("SGLANG_RAGGED_VERIFY_MODE", "cap-accept")
    wk, target = make_worker(drafter_dirs["host"], target_dir, worker.endpoint, monkeypatch)
    eng = Engine(wk, target, drafter_dirs["host"])
    try:
        assert wk._verify_planner.schedules_verify_budget
        eng.prefill({"a": 10, "b": 7})
        step = eng.decode()
        conf = wk._proposer._out.confidence[:2]
        assert (conf.numpy() == step.confidence).all() and step.confidence.all()
        budget = wk._verify_planner.compute_budget_sync(
            confidence=conf, prefix_lens=None,
            req_pool_indices=torch.tensor([r.row for r in eng.reqs.values()]))
        assert budget is not None and 2 <= budget <= 2 * (GAMMA + 1), budget
    finally:
        wk._proposer.rounds.client.close()


def test_a_silent_or_dead_worker_gives_empty_drafts_within_the_timeout(
        drafter_dirs: dict[str, Path], target_dir: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGSTOP: the step ends within timeout_ms with draft 0, confidence 0 (target-only);
    killed: the same at once, every step."""
    with start_worker("--checkpoint", str(drafter_dirs["full"]), "--device", "cpu",
                      "--window", str(W), "--max-slots", "8", "--max-total-slots", "8") as w:
        wk, target = make_worker(drafter_dirs["host"], target_dir, w.endpoint, monkeypatch)
        eng = Engine(wk, target, drafter_dirs["host"])
        try:
            eng.prefill({"a": 10, "b": 7})
            assert eng.decode().confidence.all()
            os.kill(w.pid, signal.SIGSTOP)
            try:
                late = eng.decode({"a": 1, "b": 1})
            finally:
                os.kill(w.pid, signal.SIGCONT)
            assert not late.drafts.any() and not late.confidence.any()
            assert late.seconds < TIMEOUT_MS / 1000 + 0.5, late.seconds
            w.kill()
            for _ in range(2):
                t0 = time.monotonic()
                dead = eng.decode()
                assert not dead.drafts.any() and not dead.confidence.any()
                assert time.monotonic() - t0 < TIMEOUT_MS / 1000 + 0.5
        finally:
            wk._proposer.rounds.client.close()


@pytest.mark.slow  # two processes that import SGLang: 80 s on a busy 2-core machine
def test_tensor_parallel_ranks_share_rank_0s_drafts(worker: Any, drafter_dirs: dict[str, Path],
                                                    target_dir: Path, tmp_path: Path) -> None:
    """Two ranks of a TP-2 engine in SGLang's own process groups (gloo on the CPU): only rank
    0 has a client, and every step both ranks hold rank 0's drafts and confidences, and
    SGLang's accept (its TP sync included) commits the same on both."""
    import sys

    from tests.client.real_engine import free_port

    port = str(free_port())
    script = Path(__file__).with_name("tp_rank.py")
    outs = [tmp_path / f"rank{r}.npz" for r in (0, 1)]
    run_ranks([[sys.executable, str(script), str(r), port, worker.endpoint,
                str(drafter_dirs["host"]), str(target_dir), str(outs[r])] for r in (0, 1)],
              timeout=180)
    rank0, rank1 = (np.load(o) for o in outs)
    assert bool(rank0["driver"]) and not bool(rank1["driver"])
    assert rank0["confidence"].all(), "rank 0 drafted nothing"
    assert np.array_equal(rank0["drafts"], rank1["drafts"])
    assert np.array_equal(rank0["confidence"].view(np.int32), rank1["confidence"].view(np.int32))
    assert np.array_equal(rank0["commit"], rank1["commit"])
    assert int(rank0["rounds"]) == 3 and int(rank1["rounds"]) == 0


def test_a_drafter_without_a_confidence_head_runs_the_static_mode(
        worker: Any, drafter_dirs: dict[str, Path], target_dir: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A drafter config without a confidence head: SGLang's planner gets no head (static:
    every step verifies gamma drafts), the proposal carries no confidences, and a mode that
    needs them is refused at start."""
    import shutil

    host = tmp_path / "headless"
    shutil.copytree(drafter_dirs["host"], host)
    cfg = json.loads((host / "config.json").read_text())
    cfg["enable_confidence_head"] = False
    (host / "config.json").write_text(json.dumps(cfg))
    wk, target = make_worker(host, target_dir, worker.endpoint, monkeypatch)
    try:
        assert not wk.carries_confidence and wk._verify_planner.mode_value == "static"
        eng = Engine(wk, target, host)
        eng.prefill({"a": 9})
        req = eng.reqs["a"]
        proposal = wk._proposer.propose(
            batch=SimpleNamespace(req_pool_indices=torch.tensor([req.row]),
                                  seq_lens=torch.tensor([req.seq_len]),
                                  reqs=[SimpleNamespace(rid="a")]),
            draft_input=SimpleNamespace(bonus_tokens=torch.tensor([req.bonus])),
            verify_window=None, bs=1, device="cpu", target_model=None, sampling_info=None)
        drafts = proposal.draft_block.draft_tokens
        assert proposal.confidence is None and drafts.shape == (1, 7) and drafts.any()
    finally:
        wk._proposer.rounds.client.close()
    monkeypatch.setenv("SGLANG_RAGGED_VERIFY_MODE", "compact")
    with pytest.raises(ValueError, match="has no confidence head"):
        server_args(host, target_dir)
