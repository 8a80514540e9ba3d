"""bench/soak.py keeps working: a tiny run (1 engine x 3 slots, a few seconds, a small fuzz
storm, the kill -9 / restart) must finish clean. The figures come from the full run
(bench/README.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_soak_smoke() -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "soak.py"), "--engines", "1", "--slots", "3",
         "--window", "16", "--duration", "4", "--interval", "1", "--fuzz-frames", "300",
         "--fuzz-threads", "2", "--step-ms", "5",
         "--worker-arg=--no-warmup"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "SOAK OK" in out and "kill -9" in out, out[-4000:]
    summary = json.loads(out.split("summary ", 1)[1].splitlines()[0])
    assert summary["fuzz_frames"] >= 300 and summary["wrong_drafts"] == 0
    assert summary["checked_drafts"] > 0 and summary["failures"] == []
    assert summary["worst_rounds_after_reconnect"] <= summary["bound"]


def test_soak_flood_smoke() -> None:
    """``--flood``: a few seconds of pipelined STATS beside one engine; the engine drafts during
    the flood and every new connection is answered."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "soak.py"), "--engines", "1", "--slots", "3",
         "--window", "16", "--duration", "5", "--interval", "1", "--fuzz-frames", "0",
         "--fuzz-at", "0.2", "--kill-at", "0.8", "--flood", "pipeline", "--no-kill",
         "--step-ms", "5", "--worker-arg=--no-warmup"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    summary = json.loads(out.split("summary ", 1)[1].splitlines()[0])
    flood = summary["flood"]
    assert flood["flood"]["rounds_ok"] > 0 and flood["flood"]["drafted"] > 0, flood
    assert flood["new_connection"]["probes"] > 0 and flood["new_connection"]["refused"] == 0
