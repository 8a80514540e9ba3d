"""dspark-client against a real worker subprocess, watched through its /metrics and STATS: the
commands refuse nothing on the worker (hello_refusals_total stays as it was), every command
releases its session when it ends (normally and on Ctrl-C; on an error: test_client_cli.py), and
bench at the worker's full slot count runs twice in a row. Also the worker's --threads default."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.worker_proc import WorkerProcess, start_worker, worker_stats

ROOT = Path(__file__).resolve().parents[2]
SLOTS = 256  # the worker's max_slots and max_total_slots: bench --batch SLOTS takes every lane


@pytest.fixture(scope="module")
def worker() -> Iterator[WorkerProcess]:
    # OMP_NUM_THREADS=3 in its environment: the --threads default (1) still wins.
    with start_worker("--max-slots", str(SLOTS), "--max-total-slots", str(SLOTS),
                      "--window", "32", "--device", "cpu", "--no-warmup",
                      env={"OMP_NUM_THREADS": "3"}) as w:
        yield w


def cli(worker: WorkerProcess, *args: str,
        timeout: float = 240) -> subprocess.CompletedProcess[str]:
    assert worker.endpoint is not None
    return subprocess.run([sys.executable, "-m", "dspark_client.cli", *args,
                           "--endpoint", worker.endpoint.removeprefix("tcp://")],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def refusals(worker: WorkerProcess) -> float:
    """Every hello_refusals_total sample on /metrics, summed (a real scrape)."""
    with urllib.request.urlopen(f"{worker.metrics_url}/metrics", timeout=10) as r:
        text = r.read().decode()
    values = re.findall(r"^dspark_worker_hello_refusals_total\{[^}]*\} (\S+)$", text, re.M)
    return sum(float(v) for v in values)


def test_commands_refuse_nothing_and_release_their_sessions(worker: WorkerProcess) -> None:
    before = refusals(worker)
    for args in (["reset", "0", "3"], ["bench", "--batch", "4", "--steps", "3"],
                 ["bench", "--sampled", "--batch", "2", "--steps", "3", "--json"]):
        out = cli(worker, *args)
        assert out.returncode == 0, (args, out.stderr)
    assert refusals(worker) == before
    st = worker_stats(worker)
    assert st["sessions"] == [] and st["totals"]["sessions_dropped"].get("goodbye", 0) >= 3
    assert not any(k.startswith("HELLO:") for k in st["totals"]["refusals"])


def test_bench_at_every_slot_twice_in_a_row(worker: WorkerProcess) -> None:
    for _ in range(2):
        out = cli(worker, "bench", "--batch", str(SLOTS), "--steps", "3", "--warmup", "1",
                  "--json")
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["failed_rounds"] == 0
    assert worker_stats(worker)["sessions"] == []


def test_ctrl_c_releases_the_session(worker: WorkerProcess) -> None:
    assert worker.endpoint is not None
    proc = subprocess.Popen([sys.executable, "-m", "dspark_client.cli", "--endpoint",
                             worker.endpoint, "bench", "--batch", "4", "--steps", "100000"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            held = [s for s in worker_stats(worker)["sessions"] if s["steps"] > 2]  # bench's own
            if held:
                break
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.2)
        assert held, "bench never started"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert "releasing the session" in err
    # The rounds measured before Ctrl-C are printed (on a loaded machine Ctrl-C may come
    # during the warm-up, and bench says so).
    assert ("interrupted after" in out and "rtt " in out) or \
        "interrupted during the warm-up, before any measured round" in out, out
    assert worker_stats(worker)["sessions"] == []


def test_threads_default(worker: WorkerProcess) -> None:
    assert worker_stats(worker)["threads"] == 1
    assert "torch intra-op threads: 1" in worker.log_text()
