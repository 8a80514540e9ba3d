"""Fixtures of the worker tests: one tiny embedded drafter for the whole run, and a fresh
in-process worker (real sockets on port 0) per test."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# The harness and tests.support import as modules of the repository root.
_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

from worker_harness import ThreadWorker, worker_config  # noqa: E402


@pytest.fixture(scope="session")
def drafter() -> Iterator[Any]:
    import torch

    from dspark_worker.drafter import load_drafter

    # Two cores shared with other suites: one intra-op thread keeps timings steady (restored
    # afterwards, so other suites in the same run keep their setting).
    before = torch.get_num_threads()
    torch.set_num_threads(int(os.environ.get("DSPARK_TEST_TORCH_THREADS", "1")))
    yield load_drafter(None, device="cpu")
    torch.set_num_threads(before)


@pytest.fixture
def worker(drafter: Any) -> Iterator[ThreadWorker]:
    w = ThreadWorker(worker_config(), drafter)
    yield w
    w.stop()
