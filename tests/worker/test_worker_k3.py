"""Kimi-K3 DSpark drafters behind a worker: every shared vector through a real worker process
per checkpoint (the engine's own HELLO from the checkpoint, so both sides agree on the
identities with the target's embedding in place of the shipped copy), two K3 sessions batched
as one device call through the static step, and the Qwen3 family's drafts unchanged beside
the latent ring."""

from __future__ import annotations

import contextlib
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file
from worker_harness import (
    Client,
    WithReplay,
    check_vectors_and_batching,
    make_hello,
    thread_worker,
)

from dspark_client.hello import hello_from_checkpoint
from dspark_worker.drafter.step import EagerReplay
from protocol.constants import RF_NEED_DRAFT, RF_RESET, ST_OK
from protocol.messages import ReqEntry
from tests.support.worker_proc import start_worker

DATA = Path(__file__).resolve().parent / "drafter" / "data" / "k3_tiny"
CASES = json.loads((DATA / "cases.json").read_text())


def case_rows(name: str) -> tuple[list[dict[str, Any]], np.ndarray]:
    cases = [c for c in CASES["cases"] if c["checkpoint"] == name]
    taps = load_file(str(DATA / "taps.safetensors"))
    rows = np.concatenate([taps[c["taps_key"]].view(torch.int16).numpy().view(np.uint8)
                           .reshape(c["n_rows"], -1) for c in cases])
    return cases, rows


def test_the_shared_vectors_through_a_worker_process_per_checkpoint() -> None:
    """A worker process per checkpoint (started side by side); each case in a slot of its own,
    rows and anchor in one STEP with RF_RESET: ids exact, confidences within 1e-4, margins
    within 1e-3 (fp32 on the CPU, W = 64: the cases of 65 to 70 rows wrap the ring). The HELLO
    is the engine's, from the checkpoint and its target."""
    names = sorted(CASES["checkpoints"])
    targets = {n: DATA / CASES["checkpoints"][n]["target"] for n in names}
    with ThreadPoolExecutor(len(names)) as pool, contextlib.ExitStack() as stack:
        starts = {n: pool.submit(start_worker, "--checkpoint", str(DATA / n),
                                 "--target-checkpoint", str(targets[n]), "--window", "64",
                                 "--max-slots", "8") for n in names}
        workers = {n: stack.enter_context(f.result()) for n, f in starts.items()}
        for name, w in workers.items():
            assert "k3_dspark drafter" in w.log_text()
            cases, rows = case_rows(name)
            hello = hello_from_checkpoint(DATA / name, window=64, max_slots=8,
                                          target_checkpoint=targets[name])
            with Client((w.host, w.port)) as c:
                rep = c.hello(hello)
                assert rep.status == ST_OK, rep.body
                entries = [ReqEntry(slot=i, generation=1, anchor_pos=k["anchor_pos"],
                                    anchor_token=k["anchor_token"], n_rows=k["n_rows"],
                                    flags=RF_NEED_DRAFT | RF_RESET)
                           for i, k in enumerate(cases)]
                got = c.step(entries, rows, hello.row_bytes).step()
            assert got.margin is not None
            for i, k in enumerate(cases):
                assert got.draft_ids[i].tolist() == k["ids"], (name, k["case"])
                np.testing.assert_allclose(got.confidence[i], k["confidence"], atol=1e-4)
                np.testing.assert_allclose(got.margin[i], k["margin"], atol=1e-3)


def test_two_k3_sessions_batched_through_the_static_step() -> None:
    """Two sessions' STEPs run as one device batch through the static step (the CPU stand-in
    of a captured graph, self-checked against the eager step at start) and draft what each
    drafts alone; the vectors come back exact."""
    from dspark_worker.drafter import load_drafter

    name = "k3_yarn32_n7"
    d: Any = WithReplay(load_drafter(DATA / name, DATA / "target", record_identities=False),
                        EagerReplay)
    cases, rows = case_rows(name)
    with thread_worker(d, window=64) as w:
        assert d.modes == ["auto"] and d._inner.graphs is not None
        check_vectors_and_batching(w, d, cases, rows, window=64, probe_token=290)


# The embedded Qwen3 drafter's drafts of a fixed batch (greedy, top-8 with top-p, top-32),
# recorded before the rings learned planes: the Qwen3 path is unchanged beside the latent ring.
QWEN3_IDS = [[116, 32, 48, 120, 48, 48, 48], [32, 32, 32, 32, 32, 105, 110],
             [79, 80, 120, 39, 92, 101, 114]]


def test_the_qwen3_family_beside_it_is_unchanged() -> None:
    from dspark_worker.drafter import SamplingParams, embedded_default, encode_bf16_rows

    d = embedded_default()
    pool = d.new_pool(4, 16)
    assert pool.kv.shape[0] == 2 and pool.bytes_per_lane == 2 * pool.kv[0, :, 0].nbytes
    lanes = pool.allocate(3)
    n = [5, 20, 9]
    table = np.random.default_rng(7).standard_normal((sum(n), d.config.tap_width))
    pool.apply(lanes, [5, 40, 9], n, [True] * 3, encode_bf16_rows(table.astype(np.float32)))
    got = d.draft(pool, lanes, [5, 40, 9], [3, 7, 11], sampling=SamplingParams(
        top_k=[0, 8, 32], temperature=[1.0, 0.8, 1.3], top_p=[0.0, 0.9, 0.0], seed=[1, 2, 3],
        generation=[0, 1, 2]))
    assert got.draft_ids.tolist() == QWEN3_IDS


def test_our_own_vectors_over_many_steps() -> None:
    """tools/gen_k3_vectors.py's cases (transformers' DeepSeek-V3 modules composed as vLLM
    wires them): another head geometry, V = 2000, N = 4 and 9, ``sample_from_anchor`` false,
    ``logit_scale``, a YaRN cos/sin factor other than 1, no RoPE keys, no confidence head; the
    rows of each case go over a STEP per ``chunk`` rows (up to 500 rows: the ring of W = 128
    wraps four times), then one drafting STEP."""
    from dspark_worker.drafter import load_drafter

    extra = json.loads((DATA / "cases_extra.json").read_text())
    window = extra["window"]
    taps = load_file(str(DATA / "taps_extra.safetensors"))
    for name, meta in extra["checkpoints"].items():
        d = load_drafter(DATA / name, DATA / meta["target"], record_identities=False)
        cases = [k for k in extra["cases"] if k["checkpoint"] == name]
        with thread_worker(d, window=window) as w, w.connect() as c:
            assert c.hello(make_hello(d, window=window)).status == ST_OK
            for slot, k in enumerate(cases):
                rows = taps[k["taps_key"]].view(torch.int16).numpy().view(np.uint8)
                first = k["anchor_pos"] - k["n_rows"]
                for s in range(0, k["n_rows"], k["chunk"]):
                    e = min(s + k["chunk"], k["n_rows"])
                    entry = ReqEntry(slot=slot, generation=1, anchor_pos=first + e,
                                     anchor_token=0, n_rows=e - s)
                    assert c.step([entry], rows[s:e], d.row_bytes).status == ST_OK
                probe = ReqEntry(slot=slot, generation=1, anchor_pos=k["anchor_pos"],
                                 anchor_token=k["anchor_token"], flags=RF_NEED_DRAFT)
                got = c.step([probe], b"", d.row_bytes).step()
                assert got.draft_ids[0].tolist() == k["ids"], (name, k["case"])
                np.testing.assert_allclose(got.confidence[0], k["confidence"], atol=1e-4)
                assert got.margin is not None
                np.testing.assert_allclose(got.margin[0], k["margin"], atol=1e-3)
