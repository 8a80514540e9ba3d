"""dspark for stock vLLM (0.34): the speculative method ``remote_dspark``, drafting on a
dspark-worker through ``dspark_client`` (docs/vllm.md).

vLLM loads ``register`` from the ``vllm.general_plugins`` entry point in every one of its
processes; it registers the method by the qualified name of its config, so nothing of vLLM,
torch or the worker is imported until vLLM resolves it. This package is imported only inside
vLLM; ``dspark_client`` never imports it.
"""

from __future__ import annotations

from typing import Final

__all__ = ["CONFIG_CLASS", "METHOD", "register"]

METHOD: Final = "remote_dspark"
CONFIG_CLASS: Final = "dspark_vllm.config.RemoteDSparkSpeculatorConfig"


def register() -> None:
    """The plugin: register ``remote_dspark`` (idempotent, as vLLM may load a plugin twice)."""
    from vllm.v1.worker.gpu.spec_decode.speculator_config import register_speculative_method

    register_speculative_method(METHOD, CONFIG_CLASS)
