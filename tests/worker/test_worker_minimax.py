"""MiniMax-M3 drafters served by a real worker process: every shared case of each checkpoint
(MXFP8 standalone, MXFP8 in the target's dspark/ subfolder named by the target's folder, BF16)
over the socket, against a HELLO the engine side makes from the same folder; and in-process,
two sessions batched as one device call through the static step."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from worker_harness import Client, WithReplay, check_vectors_and_batching, thread_worker

from dspark_client import hello_from_checkpoint
from dspark_worker.drafter.step import EagerReplay
from protocol.constants import RF_NEED_DRAFT, RF_RESET, RPF_MARGIN, ST_OK
from protocol.messages import ReqEntry
from tests.support.worker_proc import start_worker

DATA = Path(__file__).resolve().parent / "drafter" / "data" / "minimax_m3_tiny"
W = 64


def case_rows(name: str) -> tuple[list[dict[str, Any]], np.ndarray]:
    """The checkpoint's cases (a 72-row context as its newest W rows, all a ring of W keeps)
    and their wire rows, in case order."""
    import torch
    from safetensors.torch import load_file

    cases = [{**c, "n_rows": min(c["n_rows"], W)}
             for c in json.loads((DATA / "cases.json").read_text())["cases"]
             if c["checkpoint"] == name]
    taps = load_file(str(DATA / "taps.safetensors"))
    rows = np.concatenate([taps[c["taps_key"]].view(torch.int16).numpy().view(np.uint8)
                           .reshape(-1, taps[c["taps_key"]].shape[1] * 2)[-c["n_rows"]:]
                           for c in cases])
    return cases, rows


@pytest.mark.parametrize("name", ["m31_mxfp8_n7_w12", "target/dspark", "bf16_n6_w20"])
def test_every_case_from_a_worker_process(tmp_path: Path, name: str) -> None:
    """The target's dspark/ drafter is served from --checkpoint naming the target's folder
    (its own target); the standalone ones with --target-checkpoint. Ids exact, confidences
    within 1e-4, margins within 1e-3; the log says what MXFP8 costs on the device."""
    target = tmp_path / "target"
    shutil.copytree(DATA / "target", target)
    if name == "target/dspark":
        folder, args = target, ["--checkpoint", str(target)]
    else:
        folder = tmp_path / name
        shutil.copytree(DATA / name, folder)
        args = ["--checkpoint", str(folder), "--target-checkpoint", str(target)]
    hello = hello_from_checkpoint(folder, window=W, max_slots=4, max_rows_per_step=256,
                                  target_checkpoint=None if name == "target/dspark" else target)
    cases, rows = case_rows(name)
    with start_worker(*args, "--window", str(W), "--max-rows-per-step", "256",
                      "--no-warmup") as w:
        assert w.host is not None and w.port is not None
        with Client((w.host, w.port)) as c:
            assert c.hello(hello).status == ST_OK
            entries = [ReqEntry(slot=i, generation=1, anchor_pos=k["anchor_pos"],
                                anchor_token=k["anchor_token"], n_rows=k["n_rows"],
                                flags=RF_NEED_DRAFT | RF_RESET) for i, k in enumerate(cases)]
            got = c.step(entries, rows, hello.row_bytes).step()
        log = w.log_text()
    assert got.flags & RPF_MARGIN and got.margin is not None
    for i, k in enumerate(cases):
        assert got.draft_ids[i].tolist() == k["ids"], (name, k["case"])
        np.testing.assert_allclose(got.confidence[i], k["confidence"], atol=1e-4, rtol=0)
        np.testing.assert_allclose(got.margin[i], k["margin"], atol=1e-3, rtol=0)
    mxfp8 = "MXFP8 linears dequantised on load" in log
    assert mxfp8 == (name != "bf16_n6_w20"), log


def test_sessions_batched_through_the_static_step() -> None:
    from dspark_worker.drafter import load_drafter

    d: Any = WithReplay(load_drafter(DATA / "m31_mxfp8_n7_w12", DATA / "target",
                                     record_identities=False), EagerReplay)
    cases, rows = case_rows("m31_mxfp8_n7_w12")
    with thread_worker(d, window=W) as w:
        assert d.modes == ["auto"] and d._inner.graphs is not None
        check_vectors_and_batching(w, d, cases, rows, window=W, probe_token=290)
