"""dspark for stock SGLang (0.5.23): the speculative algorithm ``REMOTE_DSPARK``, SGLang's
DSpark with the drafter on a dspark-worker, through ``dspark_client`` (docs/sglang.md).

SGLang loads ``register`` from the ``sglang.srt.plugins`` entry point in each of its processes
(``load_plugins``: the server, the scheduler, the DP controller, the detokenizer), where
``SGLANG_PLUGINS``, when set, names it (``remote_dspark``). It registers the algorithm with
SGLang's registry; the algorithm's class and its worker are imported then, inside SGLang. This
package is imported only inside SGLang; ``dspark_client`` never imports it.
"""

from __future__ import annotations

from typing import Final

__all__ = ["ALGORITHM", "OPTIONS_ENV", "register"]

ALGORITHM: Final = "REMOTE_DSPARK"
# The worker's address, timeouts, key file and the rest: one JSON object, the keys of vLLM's
# speculator_options (dspark_client.adapter.options), in the environment of the server.
OPTIONS_ENV: Final = "SGLANG_REMOTE_DSPARK_OPTIONS"


def register() -> None:
    """The plugin: register ``REMOTE_DSPARK`` (once per process; SGLang's registry refuses a
    second registration of a name)."""
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.speculative.spec_registry import get_spec

    if get_spec(ALGORITHM) is not None:
        return
    from .algo import RemoteDSparkAlgo, check_options, worker_class

    SpeculativeAlgorithm.register(ALGORITHM, supports_overlap=True,
                                  validate_server_args=check_options,
                                  spec_class=RemoteDSparkAlgo)(worker_class)
