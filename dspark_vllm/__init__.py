"""dspark for stock vLLM (0.34): the speculative method ``remote_dspark``, drafting on a
dspark-worker through ``dspark_client`` (docs/vllm.md).

vLLM loads ``register`` from the ``vllm.general_plugins`` entry point in every one of its
processes; it registers the method by the qualified name of its config, so nothing of vLLM,
torch or the worker is imported until vLLM resolves it. This package is imported only inside
vLLM; ``dspark_client`` never imports it.
"""

from __future__ import annotations

import logging
from typing import Final

__all__ = ["CONFIG_CLASS", "LOGGERS", "METHOD", "register"]

METHOD: Final = "remote_dspark"
CONFIG_CLASS: Final = "dspark_vllm.config.RemoteDSparkSpeculatorConfig"
# The loggers of the plugin and of the client under it: what the engine's log shows of them.
LOGGERS: Final = ("dspark_vllm", "dspark_client")


def log_through_vllm() -> None:
    """Our loggers write through vLLM's own handler (its format, its level, its stream), as
    its own lines do: without it only WARNING and above reach stderr, bare, through Python's
    last-resort handler. They still propagate (to the root logger, which vLLM leaves without
    handlers). Nothing changes where vLLM does not configure logging
    (``VLLM_CONFIGURE_LOGGING=0``) or the engine's own configuration already handles them."""
    vllm_log = logging.getLogger("vllm")
    if not vllm_log.handlers:
        return
    for name in LOGGERS:
        ours = logging.getLogger(name)
        if ours.handlers:
            continue
        for handler in vllm_log.handlers:
            ours.addHandler(handler)
        ours.setLevel(vllm_log.level)


def register() -> None:
    """The plugin: register ``remote_dspark`` (idempotent, as vLLM may load a plugin twice)."""
    from vllm.v1.worker.gpu.spec_decode.speculator_config import register_speculative_method

    register_speculative_method(METHOD, CONFIG_CLASS)
    log_through_vllm()
