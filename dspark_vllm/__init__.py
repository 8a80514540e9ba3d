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


class _ThroughVllm(logging.Handler):
    """Hands our records to the handlers vLLM's logger has when the record is made: vLLM
    configures its logging in each of its processes, possibly after the plugin loads and
    again later (``configure_logging``), so the handlers are looked up at each record. Where
    vLLM has none (``VLLM_CONFIGURE_LOGGING=0``) and nothing else handles the record, a
    WARNING or worse goes to stderr as it would without this handler."""

    def emit(self, record: logging.LogRecord) -> None:
        handlers = logging.getLogger("vllm").handlers
        if not handlers:
            if record.levelno >= logging.WARNING and not logging.getLogger().handlers and \
                    logging.lastResort is not None:
                logging.lastResort.handle(record)
            return
        for handler in handlers:
            if record.levelno >= handler.level:
                handler.handle(record)


def log_through_vllm() -> None:
    """Our loggers write through vLLM's own handlers (its format and stream), at vLLM's
    level (``VLLM_LOGGING_LEVEL``), as its own lines do: without it only WARNING and above
    would reach stderr, bare, through Python's last-resort handler. They still propagate (to
    the root logger, which vLLM leaves without handlers). Idempotent."""
    from vllm import envs

    for name in LOGGERS:
        ours = logging.getLogger(name)
        if not any(isinstance(h, _ThroughVllm) for h in ours.handlers):
            ours.addHandler(_ThroughVllm())
        if ours.level == logging.NOTSET:
            ours.setLevel(envs.VLLM_LOGGING_LEVEL)


def register() -> None:
    """The plugin: register ``remote_dspark`` (idempotent, as vLLM may load a plugin twice)."""
    from vllm.v1.worker.gpu.spec_decode.speculator_config import register_speculative_method

    register_speculative_method(METHOD, CONFIG_CLASS)
    log_through_vllm()
