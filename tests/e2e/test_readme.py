"""The README's quickstart commands and its engine example run as written, against a worker
this test starts (the commands reach it through DSPARK_ENDPOINT, as the README says)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.worker_proc import WorkerProcess, start_worker

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


def blocks(lang: str, after: str) -> list[str]:
    """The fenced ``lang`` blocks of the README section whose heading is ``after``."""
    text = README.read_text(encoding="utf-8")
    start = text.index(f"## {after}")
    end = text.find("\n## ", start + 1)
    section = text[start:end if end > 0 else None]
    return re.findall(rf"```{lang}\n(.*?)```", section, flags=re.S)


@pytest.fixture(scope="module")
def worker() -> Iterator[WorkerProcess]:
    with start_worker("--max-slots", "16", "--max-total-slots", "32", "--device", "cpu") as w:
        yield w


def env_for(worker: WorkerProcess) -> dict[str, str]:
    assert worker.endpoint is not None
    bin_dir = str(Path(sys.executable).parent)  # where pip put dspark-client
    # The console script imports this tree, also where the environment's editable install
    # points at another checkout.
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "DSPARK_ENDPOINT": worker.endpoint,
            "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""),
            "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}


def test_quickstart_commands_run_as_written(worker: WorkerProcess) -> None:
    (script,) = blocks("bash", "Quickstart")
    commands = [line for line in script.splitlines() if line.strip()]
    assert [c.split()[:2] for c in commands] == [
        ["dspark-client", "ping"], ["dspark-client", "stats"], ["dspark-client", "bench"],
        ["dspark-client", "demo"]]
    outputs = []
    for command in commands:
        proc = subprocess.run(command, shell=True, env=env_for(worker), capture_output=True,
                              text=True, timeout=240, cwd=ROOT)
        assert proc.returncode == 0, (command, proc.stdout[-2000:], proc.stderr[-2000:])
        outputs.append(proc.stdout)
    ping, stats, bench, demo = outputs
    assert "ms" in ping or "us" in ping
    assert "sessions" in stats and "slots reserved" in stats
    assert "p50" in bench or "p50" in bench.lower()
    assert "mean accepted length" in demo and "tokens/s target-only" in demo
    assert "(DSPARK_ENDPOINT)" in demo and "verified drafts" in demo and "toy" in demo


def test_engine_example_runs_as_written(worker: WorkerProcess) -> None:
    (code,) = blocks("python", "How an engine uses the client")
    proc = subprocess.run([sys.executable, "-c", code], env=env_for(worker),
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("drafts [")


def test_demo_sampled_and_batched(worker: WorkerProcess) -> None:
    proc = subprocess.run(["dspark-client", "demo", "--temperature", "0.8", "--batch", "2",
                           "--max-new-tokens", "24", "--seed", "3"], env=env_for(worker),
                          capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "sampled T=0.8" in proc.stdout and "batch 2" in proc.stdout
    assert "showing sequence 1 of 2" in proc.stdout
    # Off a terminal, text from accepted drafts is marked between guillemets.
    assert "is \u00abmarked\u00bb" in proc.stdout
    assert proc.stdout.count("\u00ab") == proc.stdout.count("\u00bb") >= 2
    rounds = re.search(r"rounds \(failed\)\s+(\d+) \((\d+)\)", proc.stdout)
    assert rounds is not None and int(rounds.group(1)) > 0 and rounds.group(2) == "0"


def test_engine_example_says_why_a_worker_refused_it() -> None:
    """The README's speculators command serves W 2048 where its engine example asks for 1024:
    the example exits naming the refusal and both windows (``last_error`` holds the reason
    whatever disabled the client), not a bare "None"."""
    (code,) = blocks("python", "How an engine uses the client")
    with start_worker("--max-slots", "8", "--max-total-slots", "8", "--device", "cpu",
                      "--window", "2048") as other:
        proc = subprocess.run([sys.executable, "-c", code], env=env_for(other),
                              capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 1, (proc.stdout, proc.stderr[-2000:])
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("remote drafting unavailable: remote drafting disabled: HELLO"
                           " refused: GEOMETRY (window 2048 != ours 1024"), last


def test_engine_example_names_an_absent_worker_once() -> None:
    """No worker at the endpoint: the example's last line names it once (the transport's
    error names it; the client does not add it again)."""
    import socket

    (code,) = blocks("python", "How an engine uses the client")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        endpoint = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    env = {**os.environ, "DSPARK_ENDPOINT": endpoint, "PYTHONPATH": str(ROOT)}
    code = code.replace("wait_ready(10.0)", "wait_ready(0.5)")  # nothing will answer
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1 and last.count(endpoint) == 1, last
    assert last.startswith(f"remote drafting unavailable: {endpoint}: connect failed"), last
