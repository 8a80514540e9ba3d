"""Tests of the vLLM plugin, against vLLM 0.34's own classes on the CPU (docs/vllm.md).

They need vLLM, which the project's own environment does not have: without it this folder is
not collected (the rest of the suite runs as ever). ``.ci/run`` builds a venv with vLLM and
runs this folder there with ``DSPARK_REQUIRE_VLLM=1``, under which a vLLM that does not import
is an error, not a skip.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

_HERE = Path(__file__).resolve().parent
_ROOT = _HERE.parents[1]
for _path in (str(_HERE), str(_ROOT)):  # this folder's helpers by name, and tests.support
    if _path not in sys.path:
        sys.path.insert(0, _path)

# (An installed vLLM: where none is, "vllm" still resolves to this folder as a namespace
# package once tests/ is on sys.path, a spec without an origin.)
_VLLM = importlib.util.find_spec("vllm")
HAVE_VLLM = _VLLM is not None and _VLLM.origin is not None
if not HAVE_VLLM and os.environ.get("DSPARK_REQUIRE_VLLM") == "1":
    raise pytest.UsageError("DSPARK_REQUIRE_VLLM=1 but vllm is not importable in "
                            f"{sys.executable}")
collect_ignore_glob = [] if HAVE_VLLM else ["test_*.py"]
if HAVE_VLLM:
    # vLLM's modules, imported once here, where their import-time deprecation warnings (torch's
    # and vLLM's own, nothing of ours) are not the errors the suite makes of warnings.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import vllm.config
        import vllm.plugins
        import vllm.v1.worker.gpu.input_batch
        import vllm.v1.worker.gpu.spec_decode.speculator  # noqa: F401

REFERENCE = _ROOT / "dspark_worker" / "drafter" / "reference"


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
