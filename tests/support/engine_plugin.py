"""What the engine plugins' test suites (tests/vllm, tests/sglang) share: a real dspark-worker
serving the reference drafter, the drafter's folder as an engine host holds it, and a
reference session on the same worker through ``DraftRounds``.

A conftest imports the fixtures by name (``from tests.support.engine_plugin import
drafter_dirs, reference_copy, worker``)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from dspark_client.client import RemoteDraftClient
from dspark_client.config import RemoteConfig
from dspark_client.hello import hello_from_checkpoint
from dspark_client.rounds import DraftRounds

__all__ = ["REFERENCE", "drafter_dirs", "engine_installed", "reference_copy", "reference_rounds",
           "run_ranks", "worker"]

REFERENCE = Path(__file__).resolve().parents[2] / "dspark_worker" / "drafter" / "reference"


def engine_installed(module: str, require_env: str) -> bool:
    """Whether the engine ``module`` is installed; where ``require_env`` is "1" its absence
    is an error, not a skip. (Where it is not installed, its name still resolves to the test
    folder of the same name as a namespace package once tests/ is on sys.path: a spec without
    an origin.)"""
    spec = importlib.util.find_spec(module)
    found = spec is not None and spec.origin is not None
    if not found and os.environ.get(require_env) == "1":
        raise pytest.UsageError(f"{require_env}=1 but {module} is not importable in"
                                f" {sys.executable}")
    return found


@pytest.fixture(scope="session")
def reference_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The reference drafter (config.json and weights) in a folder the worker may write to."""
    full = tmp_path_factory.mktemp("drafter") / "full"
    shutil.copytree(REFERENCE, full, ignore=shutil.ignore_patterns("dspark_identity.json"))
    return full


@pytest.fixture(scope="session")
def worker(reference_copy: Path) -> Iterator[object]:
    """A real dspark-worker serving the reference drafter from ``reference_copy`` at W = 16
    (it writes dspark_identity.json there as it loads it)."""
    from tests.support.worker_proc import start_worker

    with start_worker("--checkpoint", str(reference_copy), "--device", "cpu", "--window", "16",
                      "--max-slots", "16", "--max-total-slots", "48") as w:
        yield w


@pytest.fixture(scope="session")
def drafter_dirs(worker: object, reference_copy: Path) -> dict[str, Path]:
    """The reference drafter in two forms: ``full`` (config.json and weights, as the worker
    loads them) and ``host`` (what an engine host needs: config.json and the
    dspark_identity.json the worker wrote)."""
    host = reference_copy.parent / "host"
    host.mkdir(exist_ok=True)
    for name in ("config.json", "dspark_identity.json"):
        shutil.copy(reference_copy / name, host / name)
    return {"full": reference_copy, "host": host}


def reference_rounds(drafter: Path, endpoint: str, *, window: int, max_slots: int
                     ) -> DraftRounds:
    """A second session on the worker at ``endpoint``, for the drafts an engine's should be."""
    hello = hello_from_checkpoint(drafter, window=window, max_slots=max_slots,
                                  client_name="reference-engine")
    client = RemoteDraftClient(RemoteConfig(endpoint=endpoint, timeout_ms=5000), hello)
    if not client.wait_ready(30):
        raise RuntimeError(f"the reference session found no worker: {client.last_error}")
    return DraftRounds(client)


def run_ranks(commands: list[list[str]], timeout: float) -> None:
    """Run the ranks of a tensor-parallel engine, one process each, to the end; a rank that
    fails fails the test with its log (one failing leaves the others waiting: all are ended)."""
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for cmd in commands]
    try:
        logs = [p.communicate(timeout=timeout)[0].decode(errors="replace") for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    for r, (p, log) in enumerate(zip(procs, logs, strict=True)):
        assert p.returncode == 0, f"rank {r}:\n{log[-3000:]}"
