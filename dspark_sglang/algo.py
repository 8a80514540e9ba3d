"""``REMOTE_DSPARK``'s place in SGLang: a ``CustomSpecAlgo`` that answers SGLang's DSpark
questions as DSpark does (so the scheduler, the model runner and the verify planner take their
DSpark paths), the server arguments it resolves and refuses at start, and its worker class.

What differs from SGLang's own ``DSPARK``: no draft weights, KV cache or CUDA graphs on the
engine (``has_draft_kv`` is False), greedy drafts only, one pipeline stage, no prefill/decode
disaggregation and no attention data parallelism (each would give several ranks their own
batches; rank 0 alone talks to the worker).
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from sglang.srt.speculative.spec_registry import CustomSpecAlgo

from dspark_client.adapter.options import RemoteDSparkOptions, drafter_hello, parse_options
from dspark_client.hello import tap_layers

from . import ALGORITHM, OPTIONS_ENV

__all__ = ["RemoteDSparkAlgo", "check_options", "drafter_confidence", "options_from_env",
           "worker_class"]

log = logging.getLogger("dspark_sglang")

_DRAFTER_FLAG = "--speculative-draft-model-path"


def options_from_env(environ: dict[str, str] | None = None) -> RemoteDSparkOptions:
    """The options in ``SGLANG_REMOTE_DSPARK_OPTIONS`` (a JSON object; unset: every default),
    checked as vLLM's ``speculator_options`` are, every refusal naming the variable."""
    raw = (os.environ if environ is None else environ).get(OPTIONS_ENV)
    if raw is None or not raw.strip():
        return parse_options(None, where=OPTIONS_ENV)
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{OPTIONS_ENV} = {raw!r}: not JSON ({exc.msg} at character"
                         f" {exc.pos}); give one object, e.g."
                         """ '{"endpoint": "tcp://10.0.0.5:7600"}'""") from None
    return parse_options(value, where=OPTIONS_ENV)


def drafter_confidence(drafter: str) -> bool:
    """Whether the drafter's config.json says it has a confidence head (the worker's HELLO
    reply says so again; a drafter without one runs SGLang's static verify mode)."""
    with open(os.path.join(drafter, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    nested = {**(cfg.get("dflash_config") or {}), **(cfg.get("dspark_config") or {})}
    return bool(nested.get("enable_confidence_head", cfg.get("enable_confidence_head", False)))


def check_options(server_args: Any) -> None:
    """SGLang's ``validate_server_args`` for ``REMOTE_DSPARK``: the options and the drafter
    folder, refused at start by name."""
    opts = options_from_env()
    drafter = getattr(server_args, "speculative_draft_model_path", None)
    if not drafter:
        raise ValueError(f"--speculative-algorithm {ALGORITHM} needs {_DRAFTER_FLAG}: the"
                         " drafter's folder on this host (its config.json, and its weights"
                         " or the dspark_identity.json the worker writes beside them)")
    # The geometry alone (the worker's HELLO is made in the scheduler, weights hashed there).
    drafter_hello(drafter, opts, max_slots=1, client_name="", target_hidden_size=_hidden(drafter),
                  identities_needed=False, where=OPTIONS_ENV, folder=_DRAFTER_FLAG)


def _hidden(drafter: str) -> int:
    """The target hidden size the drafter's config names (the served model's is checked
    against it when the scheduler builds the HELLO)."""
    from dspark_client.hello import hello_from_checkpoint

    return hello_from_checkpoint(drafter, window=1, max_slots=1,
                                 identities=(bytes(32), bytes(32))).hidden


def _resolve(server_args: Any) -> None:
    """SGLang's DSpark resolutions for a remote drafter: one step, top-k 1, and a verify
    window of gamma + 1 tokens, gamma the drafter's block N or a smaller
    ``--speculative-dspark-block-size``."""
    cfg = server_args
    if getattr(cfg, "pp_size", 1) != 1:
        raise ValueError(f"{ALGORITHM} runs on one pipeline stage: --pp-size {cfg.pp_size}")
    if getattr(cfg, "disaggregation_mode", "null") != "null":
        raise ValueError(f"{ALGORITHM} does not serve prefill/decode disaggregation:"
                         f" --disaggregation-mode {cfg.disaggregation_mode}")
    if int(getattr(cfg, "dp_size", 1) or 1) > 1 and getattr(cfg, "enable_dp_attention", False):
        raise ValueError(f"{ALGORITHM} does not serve attention data parallelism"
                         " (--enable-dp-attention): each DP rank has its own batch")
    drafter = cfg.speculative_draft_model_path
    hello = drafter_hello(drafter, options_from_env(), max_slots=1, client_name="",
                          target_hidden_size=_hidden(drafter), identities_needed=False,
                          where=OPTIONS_ENV, folder=_DRAFTER_FLAG)
    tap_layers(drafter)  # (read by SGLang's aux capture too; refused here when missing)
    n = hello.num_spec
    block = getattr(cfg, "speculative_dspark_block_size", None)
    gamma = n if block is None else int(block)
    if not 1 <= gamma <= n:
        raise ValueError(f"--speculative-dspark-block-size {block}: the drafter drafts {n}"
                         f" tokens a round ({drafter}/config.json), so gamma is in [1, {n}]")
    drafts = getattr(cfg, "speculative_num_draft_tokens", None)
    if drafts is not None and int(drafts) != gamma + 1 and block is not None:
        raise ValueError(f"--speculative-num-draft-tokens {drafts} must be gamma + 1 ="
                         f" {gamma + 1} (--speculative-dspark-block-size {block})")
    if drafts is not None and block is None:
        if not 2 <= int(drafts) <= n + 1:
            raise ValueError(f"--speculative-num-draft-tokens {drafts}: the drafter drafts {n}"
                             f" tokens a round ({drafter}/config.json), so it is in"
                             f" [2, {n + 1}]")
        gamma = int(drafts) - 1
    cfg.speculative_num_steps = 1
    cfg.speculative_eagle_topk = 1
    cfg.speculative_num_draft_tokens = gamma + 1
    from sglang.srt.speculative.ragged_verify import RaggedVerifyMode, read_ragged_verify_mode

    mode = read_ragged_verify_mode()
    if mode is not RaggedVerifyMode.STATIC and not drafter_confidence(drafter):
        raise ValueError(f"SGLANG_RAGGED_VERIFY_MODE={mode.value} schedules verify lengths by"
                         f" the drafter's confidences; {drafter}/config.json has no confidence"
                         " head: leave it unset (static: every step verifies gamma drafts)")


class RemoteDSparkAlgo(CustomSpecAlgo):
    """``REMOTE_DSPARK``: DSpark to every SGLang path that asks, with no draft KV."""

    def is_dspark(self) -> bool:
        return True

    def is_dflash_family(self) -> bool:
        return True

    def supports_target_verify_for_draft(self) -> bool:
        return True

    def supports_prefill_shared_read_done(self) -> bool:
        return True

    def supports_mixed_chunk(self) -> bool:
        return True

    def supports_ragged_verify(self) -> bool:
        return True

    def supports_grammar_overlap(self) -> bool:
        return True

    def has_draft_kv(self) -> bool:
        return False  # the drafter's context lives on the worker

    # -- what SGLang 0.5.23's scheduler calls that CustomSpecAlgo lacks -----------------------
    def need_topk(self) -> bool:
        return False

    def carries_draft_hidden_states(self) -> bool:
        return False

    def create_future_map(self, device: Any, req_to_token_pool: Any,
                          needs_cpu_seq_lens: bool = True,
                          needs_confidence_relay: bool = False) -> Any:
        from sglang.srt.managers.overlap_utils import FutureMap

        return FutureMap(device, self, req_to_token_pool, needs_cpu_seq_lens,
                         needs_confidence_relay)

    def handle_server_args(self, server_args: Any) -> None:
        _resolve(server_args)

    def get_num_tokens_per_req_for_target_verify(self, num_draft_tokens: int,
                                                 is_draft_worker: bool) -> int:
        return num_draft_tokens  # (no draft worker: only the target verifies)


def worker_class(server_args: Any) -> type:
    """SGLang's worker factory: the class the scheduler builds as its speculative worker."""
    from .worker import RemoteDSparkWorker

    return RemoteDSparkWorker
