"""Tests of the SGLang plugin, against SGLang 0.5.23's own classes on the CPU (docs/sglang.md).

They need SGLang, which the project's own environment does not have: without it this folder
is not collected (the rest of the suite runs as ever). ``.ci/run`` builds a venv with SGLang
and runs this folder there with ``DSPARK_REQUIRE_SGLANG=1``, under which an SGLang that does
not import is an error, not a skip.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest

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

HAVE_SGLANG = engine_installed("sglang", "DSPARK_REQUIRE_SGLANG")
collect_ignore_glob = [] if HAVE_SGLANG else ["test_*.py"]
if HAVE_SGLANG:
    import torchvision_stub

    torchvision_stub.install()
    # SGLang's modules, imported once here, where their import-time warnings (CPU fallbacks of
    # its kernels, deprecations; nothing of ours) are not the errors the suite makes of them.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import sglang.srt.plugins
        import sglang.srt.server_args
        import sglang.srt.speculative.dspark_components.dspark_verify
        import sglang.srt.speculative.dspark_components.dspark_worker_v2
        import sglang.srt.speculative.spec_info  # noqa: F401


__all__ = ["drafter_dirs", "reference_copy", "worker"]


@pytest.fixture(scope="session")
def target_dir(tmp_path_factory: pytest.TempPathFactory, reference_copy: Path) -> Path:
    """A served model's folder as SGLang's argument pipeline reads it: config.json alone (a
    Qwen3 config of the reference drafter's hidden size; no weights are loaded here)."""
    import json

    cfg = json.loads((reference_copy / "config.json").read_text())
    target = tmp_path_factory.mktemp("target")
    keep = {k: cfg[k] for k in ("model_type", "hidden_act", "hidden_size", "num_attention_heads",
                                "num_key_value_heads", "head_dim", "intermediate_size",
                                "vocab_size", "rms_norm_eps", "rope_theta")}
    keep.update(architectures=["Qwen3ForCausalLM"], num_hidden_layers=cfg["num_target_layers"],
                max_position_embeddings=4096)
    (target / "config.json").write_text(json.dumps(keep))
    return target
