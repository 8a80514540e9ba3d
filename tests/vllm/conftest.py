"""Tests of the vLLM plugin, against vLLM 0.34's own classes on the CPU (docs/vllm.md).

They need vLLM, which the project's own environment does not have: without it this folder is
not collected (the rest of the suite runs as ever). ``.ci/run`` builds a venv with vLLM and
runs this folder there with ``DSPARK_REQUIRE_VLLM=1``, under which a vLLM that does not import
is an error, not a skip.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

_HERE = Path(__file__).resolve().parent
_ROOT = _HERE.parents[1]
for _path in (str(_HERE), str(_ROOT)):  # this folder's helpers by name, and tests.support
    if _path not in sys.path:
        sys.path.insert(0, _path)

# The shared fixtures, by name (tests/vllm and tests/sglang use the same ones).
from tests.support.engine_plugin import (  # noqa: E402
    drafter_dirs,
    engine_installed,
    reference_copy,
    worker,
)

HAVE_VLLM = engine_installed("vllm", "DSPARK_REQUIRE_VLLM")
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


__all__ = ["drafter_dirs", "reference_copy", "worker"]
