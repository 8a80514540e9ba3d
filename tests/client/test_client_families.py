"""Every model family served by real worker processes, one after the other: a fresh worker
on the Gemma4 checkpoint (DeepSpec's tiny vectors drafted over the wire, then greedy and sampled
rounds checked against the in-process reference), then a fresh worker on the Qwen3 reference
drafter, then one per speculators checkpoint (``--target-checkpoint`` beside it; speculators'
own vectors over the wire, then rounds), then one per shared DFlash checkpoint. The engine
side builds each HELLO from the checkpoint (``hello_from_checkpoint``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from real_engine import RealEngine

from dspark_client import hello_from_checkpoint
from dspark_client.client import RemoteDraftClient
from dspark_client.config import RemoteConfig
from dspark_client.rounds import DraftRounds
from tests.support.worker_proc import start_worker

ROOT = Path(__file__).resolve().parents[2]
GEMMA4 = ROOT / "tests" / "worker" / "drafter" / "data" / "gemma4_tiny"
SPECULATORS = ROOT / "tests" / "worker" / "drafter" / "data" / "speculators_tiny"
QWEN3 = ROOT / "dspark_worker" / "drafter" / "reference"
W, SLOTS = 9, 4  # W = the cases' 9 rows: case 2 (anchor 40) drafts from exactly those


@pytest.fixture(scope="module")
def torch_one_thread() -> Any:
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)  # two cores shared with the worker process
    yield
    torch.set_num_threads(before)


def rounds_for(endpoint: str, checkpoint: Path, *, sampled: bool, window: int = W,
               target: Path | None = None) -> tuple[RemoteDraftClient, DraftRounds]:
    cfg = RemoteConfig(endpoint=endpoint, connect_timeout_ms=5000, timeout_ms=10000,
                       backoff_ms=20, backoff_max_ms=200)
    hello = hello_from_checkpoint(checkpoint, window=window, max_slots=SLOTS, sampled=sampled,
                                  max_rows_per_step=4 * window, target_checkpoint=target,
                                  client_name=f"{checkpoint.name[:24]}-{sampled}")
    client = RemoteDraftClient(cfg, hello)
    assert client.wait_ready(20.0), (client.last_error, client.disabled_reason)
    return client, DraftRounds(client)


def serve_and_check(checkpoint: Path, drafter: Any, cases: list[dict[str, Any]], *,
                    family: str, window: int = W, target: Path | None = None,
                    margins: bool = False) -> int:
    """One fresh worker on ``checkpoint``: the cases (and their margins), then a few rounds
    greedy and sampled; the client's and each round's ``has_confidence`` are the drafter's."""
    checked = 0
    extra = ("--target-checkpoint", str(target)) if target is not None else ()
    with start_worker("--checkpoint", str(checkpoint), *extra, "--window", str(window),
                      "--max-slots", str(SLOTS), "--max-total-slots", "16", "--device", "cpu",
                      "--cuda-graphs", "auto", timeout=120) as w:
        assert w.endpoint is not None
        assert f"({family} family" in w.log_text()
        assert "drafting eagerly" not in w.log_text()  # on a CPU: nothing to capture, no fallback
        # Qwen3's sampled path over the wire is covered by test_client_worker
        for sampled in (False, True) if cases else (False,):
            client, rounds = rounds_for(w.endpoint, checkpoint, sampled=sampled, window=window,
                                        target=target)
            try:
                assert client.has_confidence is drafter.has_confidence
                eng = RealEngine(rounds, drafter, seed=5, sampled=sampled)
                for slot, case in enumerate(cases if not sampled else []):
                    eng.gen[slot] = 1
                    # positions [0, anchor - L) are never sent: the resync carries L rows
                    rows = drafter_rows(case["taps"])
                    pad = np.zeros((case["anchor_pos"] - len(rows), rows.shape[1]), np.uint8)
                    eng.history[slot] = np.concatenate([pad, rows])
                    eng.anchor_token[slot] = case["anchor_token"]
                    eng.fresh[slot] = len(case["taps"])
                if cases and not sampled:
                    reqs, res = eng.run(list(range(len(cases))))
                    assert res.ok, res.reason
                    assert res.has_confidence is drafter.has_confidence
                    for i, case in enumerate(cases):
                        assert res.draft_ids[i].tolist() == case["ids"]
                        np.testing.assert_allclose(res.confidence[i], case["confidence"],
                                                   atol=1e-4)
                        if margins:
                            assert res.margin is not None
                            np.testing.assert_allclose(res.margin[i], case["margin"],
                                                       atol=1e-3, rtol=0)
                    # the reference reads min(W, anchor) rows: only where the case has them all
                    if all(len(c["taps"]) >= min(window, c["anchor_pos"]) for c in cases):
                        eng.check(reqs, res)
                    eng.gen.clear()
                for slot, prompt in zip(range(SLOTS), (3, window, 40, 1), strict=True):
                    eng.admit(slot, prompt)
                live = list(range(SLOTS))
                for step in range(1 if sampled else 2):
                    if step:
                        for s in live:
                            eng.accept(s, int(eng.rng.integers(0, eng.N)))
                    reqs, res = eng.run(live)
                    assert res.ok, res.reason
                    assert res.has_confidence is drafter.has_confidence
                    eng.check(reqs, res)
                checked += eng.checked
                if not drafter.has_confidence:  # nothing predicted in the client's metrics
                    from dspark_client import client_metrics

                    assert "dspark_client_acceptance_predicted_total" not in \
                        client_metrics(client)
            finally:
                client.close()
    return checked


def drafter_rows(taps: list[list[float]]) -> np.ndarray:
    from dspark_worker.drafter import encode_bf16_rows

    return np.asarray(encode_bf16_rows(np.asarray(taps, dtype=np.float32)))


def test_both_families_by_fresh_workers(torch_one_thread: Any) -> None:
    from dspark_worker.drafter import load_drafter

    cases = json.loads((GEMMA4 / "cases.json").read_text())
    # the Gemma4 worker first, then the Qwen3 one: nothing carries over between processes
    assert serve_and_check(GEMMA4, load_drafter(GEMMA4), cases, family="gemma4") > 30
    assert serve_and_check(QWEN3, load_drafter(QWEN3), [], family="qwen3") > 20


def test_speculators_checkpoints_by_fresh_workers(torch_one_thread: Any) -> None:
    """``dspark-worker --checkpoint <speculators checkpoint> --target-checkpoint target``, one
    fresh process per checkpoint: speculators' own drafts come back over the socket, and
    greedy and sampled rounds equal the in-process reference."""
    from safetensors.torch import load_file

    from dspark_worker.drafter import load_drafter

    vectors = json.loads((SPECULATORS / "cases.json").read_text())
    taps = load_file(str(SPECULATORS / "taps.safetensors"))
    target = SPECULATORS / "target"
    for name in vectors["checkpoints"]:
        cases = [dict(c, taps=taps[c["taps_key"]].float().tolist())
                 for c in vectors["cases"] if c["checkpoint"] == name]
        checkpoint = SPECULATORS / name
        drafter = load_drafter(checkpoint, target)
        assert serve_and_check(checkpoint, drafter, cases, family="speculators", window=64,
                               target=target) > 30


DFLASH = ROOT / "tests" / "worker" / "drafter" / "data" / "dflash_tiny"


def test_dflash_checkpoints_by_fresh_workers(torch_one_thread: Any) -> None:
    """``dspark-worker --checkpoint <DFlash checkpoint> --target-checkpoint <its target>``, one
    fresh process per shared checkpoint (speculators dflash x2 and dflash2, z-lab legacy and
    nested): every shared case comes back over the socket (ids exact, margins within 1e-3),
    then greedy and sampled rounds equal the in-process reference; the client learns from the
    HELLO that there is no confidence head, and every round says so."""
    from safetensors.torch import load_file

    from dspark_worker.drafter import load_drafter

    vectors = json.loads((DFLASH / "cases.json").read_text())
    taps = load_file(str(DFLASH / "taps.safetensors"))
    for name, info in vectors["checkpoints"].items():
        cases = [dict(c, taps=taps[c["taps_key"]].float().tolist())
                 for c in vectors["cases"] if c["checkpoint"] == name]
        checkpoint, target = DFLASH / name, DFLASH / info["target"]
        drafter = load_drafter(checkpoint, target, record_identities=False)
        assert serve_and_check(checkpoint, drafter, cases, family="dflash", window=64,
                               target=target, margins=True) > 20
