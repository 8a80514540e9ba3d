"""``remote_dspark``: vLLM's DSpark speculative method with the drafter on a dspark-worker.

A ``DSparkSpeculatorConfig``, so vLLM's adaptive verification takes the worker's confidences
(``adaptive_verification_uses_draft_logits`` is False there) and the target outputs the aux
hidden states of the drafter's taps. What differs from a local DSpark draft: no draft model is
built or loaded on the engine (the draft model config is the target's, carrying the drafter's
taps, as vLLM's own ``extract_hidden_states`` method does), no draft KV cache, no draft forward
pass (no lookahead slots, no cap on the batch), greedy drafts only, no prefill context
parallelism. The speculator is ``dspark_vllm.speculator.RemoteDSparkSpeculator``.

vLLM imports config modules in every process; this one imports neither the speculator nor
torch (docs/vllm.md).
"""

from __future__ import annotations

import copy
import logging
import os
from typing import TYPE_CHECKING, Any

from vllm.v1.worker.gpu.spec_decode.dspark.config import DSparkSpeculatorConfig

from dspark_client.adapter.options import RemoteDSparkOptions, drafter_hello, parse_options
from dspark_client.adapter.worker import hello_with_terms
from dspark_client.hello import tap_layers

if TYPE_CHECKING:
    from vllm.config import ParallelConfig, SpeculativeConfig

__all__ = ["METHOD", "RemoteDSparkSpeculatorConfig"]

from . import METHOD

log = logging.getLogger("dspark_vllm")


def checkpoint_of(spec: SpeculativeConfig) -> str | None:
    """The served model's folder, where a drafter lacking embed_tokens / lm_head finds them
    for its identity; None when the model is a hub name (set target_checkpoint then)."""
    target = spec.target_model_config
    model = getattr(target, "model", None)
    return model if isinstance(model, str) and os.path.isdir(model) else None


def drafter_of(spec: SpeculativeConfig) -> str:
    """The drafter's folder on this host: vLLM's ``model``."""
    if spec.model is None:
        raise ValueError(f"speculative method {METHOD!r} needs model: the drafter's folder on"
                         " this host")
    return spec.model


def hello_for(spec: SpeculativeConfig, *, max_slots: int, client_name: str,
              identities_needed: bool = True, window: int | None = None,
              max_rows_per_step: int | None = None) -> Any:
    """The HELLO of this engine's drafter (``model``), its options and the served model
    (``identities_needed`` False: for its geometry alone, without hashing the weights;
    ``window``, ``max_rows_per_step``: where the options leave them unset)."""
    opts = parse_options(spec.speculator_options)
    return drafter_hello(drafter_of(spec), opts, max_slots=max_slots, client_name=client_name,
                         target_hidden_size=spec.target_model_config.get_hidden_size(),
                         draft_topk=spec.dspark_draft_topk,
                         target_checkpoint=checkpoint_of(spec),
                         identities_needed=identities_needed, window=window,
                         max_rows_per_step=max_rows_per_step)


def engine_hello(spec: SpeculativeConfig, opts: RemoteDSparkOptions, *, max_num_seqs: int,
                 client_name: str, timeout: float) -> tuple[Any, str]:
    """The HELLO rank 0 sends, and where its terms came from (``hello_with_terms``: what the
    options leave unset is the worker's); max_slots is at most ``max_num_seqs``."""
    return hello_with_terms(
        lambda **terms: hello_for(spec, client_name=client_name, **terms), opts,
        max_requests=max_num_seqs, client_name=client_name, timeout=timeout)


class RemoteDSparkSpeculatorConfig(DSparkSpeculatorConfig):
    """The config of ``method="remote_dspark"`` (registered by ``dspark_vllm.register``)."""

    speculator_class = "dspark_vllm.speculator.RemoteDSparkSpeculator"
    # dspark_draft_topk picks the worker's candidate walk (it enters the Markov identity);
    # draft_lm_head_quantization is the worker's business.
    supported_options = frozenset({"speculator_options", "dspark_draft_topk"})
    # Nothing runs on the engine's GPU but the target: no workspace lane, no draft-side
    # watermarking, no prefill context parallelism (its batch is partitioned per rank).
    uses_separate_workspace_lane = False
    supports_watermarking = False
    supports_pcp = False

    @classmethod
    def matches(cls, spec: SpeculativeConfig) -> bool:
        return False  # chosen by name only

    @classmethod
    def default_model(cls, spec: SpeculativeConfig) -> str | None:
        raise ValueError(f"speculative method {METHOD!r} needs model: the drafter's folder on"
                         " this host (its config.json, and its weights or the"
                         " dspark_identity.json the worker writes beside them)")

    @classmethod
    def configure(cls, spec: SpeculativeConfig) -> None:
        """The draft side from the drafter's config.json: N, taps and geometry checked
        against the served model; the draft model config is a copy of the target's whose HF
        config names the taps (as vLLM's aux hidden-state layers)."""
        spec.prompt_lookup_max = 0
        spec.prompt_lookup_min = 0
        target = spec.target_model_config
        if target is None:
            raise ValueError(f"speculative method {METHOD!r} needs the target model config")
        if spec.draft_sample_method != "greedy":
            raise ValueError(
                f"speculative method {METHOD!r} drafts greedily: draft_sample_method"
                f" {spec.draft_sample_method!r} needs draft logits, which the worker does not"
                " send (greedy drafts keep the target's distribution exact)")
        # The geometry alone: the speculator makes the HELLO it sends, identities and all
        # (the weights are hashed once, there); max_slots only bounds this one.
        hello = hello_for(spec, max_slots=1, client_name="", identities_needed=False)
        vocab = target.get_vocab_size()
        if hello.vocab_size != vocab:
            raise ValueError(f"{spec.model}/config.json: the drafter's vocabulary is"
                             f" {hello.vocab_size} tokens, the served model's {vocab}; drafts"
                             " are target token ids, so both must use one tokenizer")
        taps = list(tap_layers(drafter_of(spec)))
        num_layers = target.get_total_num_hidden_layers()
        bad = [t for t in taps if not -1 <= t < num_layers]
        if bad or len(set(taps)) != len(taps):
            raise ValueError(f"{spec.model}/config.json: tap layers {taps} must be distinct and"
                             f" in [-1, {num_layers}) for the served model's {num_layers}"
                             " layers")
        if spec.num_speculative_tokens is None:
            spec.num_speculative_tokens = hello.num_spec
        elif spec.num_speculative_tokens > hello.num_spec:
            raise ValueError(f"num_speculative_tokens {spec.num_speculative_tokens} is more than"
                             f" the drafter's block of {hello.num_spec} (its config.json)")
        draft = copy.copy(target)
        hf_config = copy.copy(target.hf_config)
        # vLLM numbers aux hidden states by the layer whose input they are: tap t (the
        # output of decoder layer t, -1 the embedding output) is aux layer t + 1.
        hf_config.eagle_aux_hidden_state_layer_ids = [t + 1 for t in taps]
        draft.hf_config = hf_config
        spec.draft_model_config = draft
        spec.draft_parallel_config = spec.target_parallel_config
        spec.draft_tensor_parallel_size = spec.target_parallel_config.tensor_parallel_size

    @classmethod
    def apply_options(cls, spec: SpeculativeConfig) -> None:
        return  # checked in configure, which needs the drafter's config

    @property
    def num_lookahead_tokens(self) -> int:
        return 0  # the engine writes no draft KV: nothing to reserve past the query

    # (DFlash narrows the base's "int | None" to int; None is the base's "unlimited")
    def max_num_draft_seqs(self, max_num_batched_tokens: int) -> int | None:  # type: ignore[override]
        return None  # no draft forward pass on the engine to size the batch by

    def hash_factors(self) -> list[Any]:
        return [METHOD, self.spec_config.enable_adaptive_verification]

    def pcp_unsupported_reason(self, parallel_config: ParallelConfig) -> str | None:
        return (f"speculative method {METHOD!r} does not support prefill context"
                " parallelism: its tap rows are taken from the unpartitioned batch")
