"""The speculator vLLM 0.34's GPU model runner calls for ``remote_dspark``: one
``DraftRounds.run_batch`` per engine step on tensor-parallel rank 0, the drafts and
confidences broadcast to the other ranks (docs/vllm.md; contract 7.1, 7.5).

Per step (``propose``), on rank 0:

1. one device-to-host copy of the batch's layout: query starts, sampled and rejected counts,
   first positions, sampled and next prefill tokens (the only wait on the GPU);
2. per request, its newly verified positions are the first ``n_ctx - n_rejected`` of its
   query; their tap rows (the aux hidden states, concatenated in the drafter's tap order, as
   bf16 bytes) are gathered on the device, newest ``W`` only (the worker keeps no more), and
   copied to the host in one piece; the anchor is the position after them and its token the
   one just sampled (mid-prefill: the next prompt token, and no draft is asked for);
3. ``run_batch`` with every scheduled request's slot, generation, anchor and rows, and
   ``RF_RELEASE`` for slots whose requests are gone; it never waits past ``timeout_ms``, and a
   failed round gives zeros: draft 0 with confidence 0, which adaptive verification does not
   admit (without it the target verifies and rejects them, and its output stays exact);
4. drafts and confidences packed into one int64 tensor (confidence bits in the upper half),
   copied to the device and broadcast over the tensor-parallel group, as vLLM's DSpark
   speculator shares batch-sharded drafts; every rank unpacks them into ``draft_tokens`` and
   ``draft_token_confidence_probs``, which the runner hands to adaptive verification.

Slots are this speculator's own (``max_slots``), taken when vLLM assigns a request its
request-state index (``add_request``) and given back when the request finishes, or when vLLM
reuses the index or schedules the request under another one (it was preempted and came back):
the worker sees a new generation for every new or returning request. Nothing here is captured
in a CUDA graph: ``capture`` has nothing to capture, and ``propose`` runs eagerly after the
target's graph replay, as the runner calls every speculator.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.v1.worker.gpu.spec_decode.speculator import BaseSpeculator

from dspark_client.acceptance import record_verified
from dspark_client.adapter.device import RoundTensors, TapRowGather, client_tag
from dspark_client.adapter.engine import GuardedRounds, fill_round, start_rounds
from dspark_client.adapter.options import default_client_name, parse_options
from dspark_client.adapter.slots import NO_SLOT, SlotTable
from dspark_client.hello import tap_layers
from dspark_client.rounds import DraftRounds

from .config import drafter_of, engine_hello

if TYPE_CHECKING:
    from vllm.config import SpeculativeConfig, VllmConfig
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.worker.gpu.dp_utils import DPSyncState
    from vllm.v1.worker.gpu.input_batch import InputBatch

__all__ = ["RemoteDSparkSpeculator", "tp_group"]

log = logging.getLogger("dspark_vllm")


def tp_group() -> Any:
    """vLLM's tensor-parallel group of this rank, or None when it has one rank (or no group
    exists: a runner built outside vLLM's distributed setup)."""
    from vllm.distributed.parallel_state import get_tp_group, model_parallel_is_initialized

    if not model_parallel_is_initialized():  # type: ignore[no-untyped-call]  # (vLLM's)
        return None
    group = get_tp_group()
    return group if group.world_size > 1 else None


class RemoteDSparkSpeculator(BaseSpeculator):
    """vLLM's speculator interface (``BaseSpeculator``) over a remote DSpark worker."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device) -> None:
        spec = vllm_config.speculative_config
        if spec is None or spec.num_speculative_tokens is None:
            raise ValueError("remote_dspark needs a speculative config")
        self.vllm_config = vllm_config
        self.device = device
        self.num_speculative_steps = K = int(spec.num_speculative_tokens)
        self.max_num_reqs = R = int(vllm_config.scheduler_config.max_num_seqs)
        # What the runner reads after propose (every rank): the drafts it verifies next step,
        # and the per-position confidences adaptive verification ranks them by.
        self._out = RoundTensors(R, K, device)
        self.draft_tokens = self._out.draft_tokens
        self.draft_token_confidence_probs = self._out.confidence
        self._tp = tp_group()
        self.is_driver = self._tp is None or self._tp.rank_in_group == 0
        self.rounds: DraftRounds | None = None
        self._slots: SlotTable | None = None
        self._guard = GuardedRounds(log)
        self.enable_adaptive_verification = bool(spec.enable_adaptive_verification)
        if self.is_driver:
            self._start_client(spec, vllm_config, device)
        if self._tp is not None and self.enable_adaptive_verification:
            # Every rank must build the same verification: rank 0's view of the worker wins.
            self.enable_adaptive_verification = bool(self._tp.broadcast_object(
                self.enable_adaptive_verification, src=0))

    # -- rank 0's client ------------------------------------------------------------------------
    def _start_client(self, spec: SpeculativeConfig, vllm_config: VllmConfig,
                      device: torch.device) -> None:
        opts = parse_options(spec.speculator_options)
        name = opts.client_name or default_client_name(
            client_tag(device, vllm_config.parallel_config.data_parallel_rank))
        wait = opts.remote.connect_timeout_ms / 1000.0
        deadline = time.monotonic() + wait
        hello, terms_from = engine_hello(spec, opts, max_num_seqs=self.max_num_reqs,
                                         client_name=name, timeout=wait)
        max_slots = hello.max_slots
        # Waits for the worker once, within what is left of the connect timeout; GOODBYE when
        # the runner drops the speculator.
        self.rounds = start_rounds(opts.remote, hello, owner=self, log=log,
                                   wait=max(deadline - time.monotonic(), 0.0),
                                   note=f"; W and limits {terms_from}")
        self._slots = SlotTable(self.max_num_reqs, max_slots, engine="vLLM")
        taps = list(tap_layers(drafter_of(spec)))  # (engine_hello read the same config.json)
        ascending = sorted(taps)
        # vLLM hands the aux hidden states in layer order; the rows take the drafter's order.
        self._aux_order = [ascending.index(t) for t in taps]
        self.window = hello.window
        self._gather = TapRowGather(device)
        if self.enable_adaptive_verification and self._worker_lacks_confidence():
            log.warning("remote DSpark: the worker's drafter has no confidence head; adaptive"
                        " verification is off and every step verifies %d drafts",
                        self.num_speculative_steps)
            self.enable_adaptive_verification = False

    def _worker_lacks_confidence(self) -> bool:
        """Whether the worker said its drafter has no confidence head (a DFlash drafter): the
        client's ``has_confidence`` (None until a HELLO is accepted)."""
        assert self.rounds is not None
        return self.rounds.client.has_confidence is False

    # -- the runner's interface -----------------------------------------------------------------
    def init_cudagraph_manager(self, cudagraph_mode: CUDAGraphMode) -> None:
        return  # a round trip is never captured: propose runs eagerly after the target's graph

    def capture(self) -> None:
        log.info("remote DSpark: no draft CUDA graph to capture (drafting runs on the worker)")

    def add_request(self, req_index: int) -> None:
        if self._slots is not None:
            self._slots.add(req_index)

    def on_requests_finished(self, finished_req_ids: set[str]) -> None:
        if self._slots is not None:
            self._slots.finished(finished_req_ids)

    @torch.inference_mode()
    def propose(
        self,
        input_batch: InputBatch,
        attn_metadata: dict[str, Any],
        slot_mappings: dict[str, torch.Tensor],
        last_hidden_states: torch.Tensor,
        aux_hidden_states: list[torch.Tensor] | None,
        num_sampled: torch.Tensor,
        num_rejected: torch.Tensor,
        last_sampled: torch.Tensor,
        next_prefill_tokens: torch.Tensor,
        temperature: torch.Tensor,
        seeds: torch.Tensor,
        dp_sync_state: DPSyncState | None = None,
        dummy_run: bool = False,
        skip_attn_for_dummy_run: bool = False,
        mm_inputs: tuple[list[torch.Tensor], torch.Tensor] | None = None,
        is_profile: bool = False,
        num_speculative_tokens: int | None = None,
    ) -> torch.Tensor:
        n, K = input_batch.num_reqs, self.num_speculative_steps
        if dummy_run or n == 0:
            # Warmup, profiling and capture batches: no worker involved, on any rank alike.
            self._out.clear(n)
        else:
            host = None
            if self.is_driver:
                host = self._round(input_batch, aux_hidden_states, num_sampled, num_rejected,
                                   last_sampled, next_prefill_tokens,
                                   K if num_speculative_tokens is None
                                   else min(num_speculative_tokens, K))
            self._out.publish(n, host, self._tp)
        return self.draft_tokens[:n]

    # -- rank 0's round -------------------------------------------------------------------------
    def _round(self, batch: InputBatch, aux: list[torch.Tensor] | None, num_sampled: torch.Tensor,
               num_rejected: torch.Tensor, last_sampled: torch.Tensor,
               next_prefill_tokens: torch.Tensor, n_out: int) -> np.ndarray:
        """``[n, 2K]`` int64: drafts, then the confidences' float32 bits; zeros for a request
        without a slot or after a failed round. Never raises: the other ranks wait in the
        broadcast for what this returns, so an error here is logged and gives no drafts."""
        n, K = batch.num_reqs, self.num_speculative_steps
        return self._guard.run(np.zeros((n, 2 * K), np.int64), lambda out: self._round_into(
            out, batch, aux, num_sampled, num_rejected, last_sampled, next_prefill_tokens,
            n_out))

    def _round_into(self, out: np.ndarray, batch: InputBatch, aux: list[torch.Tensor] | None,
                    num_sampled: torch.Tensor, num_rejected: torch.Tensor,
                    last_sampled: torch.Tensor, next_prefill_tokens: torch.Tensor,
                    n_out: int) -> None:
        assert self.rounds is not None and self._slots is not None  # (the driver's)
        if not aux:
            raise RuntimeError("the runner passed no aux hidden states: the target model"
                               " does not output the drafter's tap layers")
        n, W = batch.num_reqs, self.window
        index = np.asarray(batch.idx_mapping_np[:n], np.int64)
        slots = self._slots.of_index[index]
        self._slots.name(slots, batch.req_ids)
        # 1. The layout, in one copy: query starts [n + 1], then per request sampled,
        # rejected, first position, sampled token, next prefill token.
        qsl = batch.query_start_loc[:n + 1].to(torch.int64)
        req = batch.idx_mapping[:n]
        layout = torch.cat([
            qsl, num_sampled[:n].to(torch.int64), num_rejected[:n].to(torch.int64),
            batch.positions.index_select(0, qsl[:n]).to(torch.int64),
            last_sampled.reshape(last_sampled.shape[0], -1)[:, 0].index_select(0, req)
            .to(torch.int64),
            next_prefill_tokens[0].index_select(0, req).to(torch.int64),
        ]).cpu().numpy()
        starts, ends = layout[:n], layout[1:n + 1]
        sampled, rejected, first, token, prefill = layout[n + 1:].reshape(5, n)
        n_query = ends - starts
        valid = n_query - rejected
        anchor = first + valid
        anchor_token = np.where(sampled > 0, token, prefill)
        # Mid-prefill (nothing sampled) the target goes on with the prompt: rows, no draft.
        wanted = np.where(sampled > 0, n_out, 0)
        # What the target verified of the last round's drafts: the query less its bonus
        # token, for requests that were decoding (the client's acceptance counts).
        decoding = ~np.asarray(batch.is_prefilling_np[:n], bool) & (sampled > 0)
        ours = np.flatnonzero(slots != NO_SLOT)
        if len(ours) < n:  # requests that found no slot are left out (no drafts)
            slots, valid, anchor, starts = slots[ours], valid[ours], anchor[ours], starts[ours]
            anchor_token, wanted, n_query = anchor_token[ours], wanted[ours], n_query[ours]
            decoding = decoding[ours]
        if decoding.any():
            record_verified(self.rounds, slots[decoding], n_query[decoding] - 1)
        # 2. The newest W verified rows of each request, in request order, as bf16 bytes.
        n_rows = np.minimum(valid, W)
        rows = self._gather.gather([aux[j] for j in self._aux_order],
                                   starts + valid - n_rows, n_rows)
        # 3. One round; 4. its drafts and confidences' bits, in the batch's order.
        s = self._slots
        res = self.rounds.run_batch(slots, s.generation[slots], anchor, anchor_token, wanted,
                                    rows, n_rows, release=s.take_release())
        fill_round(out, ours, res)
