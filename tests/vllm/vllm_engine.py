"""vLLM 0.34's GPU model runner, as far as the speculator sees it, on the CPU: the calls it
makes (``add_request``, ``on_requests_finished``, ``propose``) with the arguments it passes,
built with vLLM's own classes where they build here.

* The configs are vLLM's (``ModelConfig``, ``SpeculativeConfig``, ``VllmConfig``), the batch
  is vLLM's ``InputBatch``, filled as ``GPUModelRunner.prepare_inputs`` fills it (query starts
  from the scheduled counts, positions from the computed counts, CUDA-graph padding).
* ``RequestState`` cannot be built without pinned memory (it allocates UVA buffers), so the
  tensors of it that ``propose`` receives are made here with its shapes and dtypes:
  ``last_sampled_tokens`` int64 ``[max_num_reqs, 1]``, ``next_prefill_tokens`` int32
  ``[1, max_num_reqs]`` (one prefill lookahead token); request indices are handed out as its
  ``free_indices.pop()`` does (the highest first).
* ``num_sampled`` / ``num_rejected`` are int32 ``[num_reqs]``, as the rejection sampler
  returns them; the aux hidden states are bf16 ``[num_tokens_after_padding, hidden]``, one
  per tap layer in layer order, as the target model returns them.

Beside the speculator, a reference: a second session on the same worker, driven through
``DraftRounds`` with the rows the speculator should have sent (the verified positions' taps),
so every step's drafts can be compared with what the worker drafts for those rows.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dspark_client import DraftRounds, SlotRequest

HIDDEN, N_TAPS, VOCAB, LAYERS = 128, 3, 260, 4  # the reference pair's target (config.json)
CPU = torch.device("cpu")


def target_folder(root: Path, *, vocab: int = VOCAB, hidden: int = HIDDEN,
                  layers: int = LAYERS) -> Path:
    """A Qwen3 target's config.json (vLLM reads no weights to build its configs)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": hidden,
        "intermediate_size": 3 * hidden, "num_hidden_layers": layers, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 32, "vocab_size": vocab,
        "max_position_embeddings": 4096, "torch_dtype": "bfloat16", "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "tie_word_embeddings": False}))
    return root


def model_config(folder: Path) -> Any:
    from vllm.config import ModelConfig

    return ModelConfig(model=str(folder), tokenizer=str(folder), skip_tokenizer_init=True,
                       dtype="bfloat16")


def speculative_config(target: Any, drafter: Path | str | None, **kw: Any) -> Any:
    from vllm.config import ParallelConfig, SpeculativeConfig

    return SpeculativeConfig(method="remote_dspark", model=None if drafter is None
                             else str(drafter), target_model_config=target,
                             target_parallel_config=ParallelConfig(), **kw)


def vllm_config(target: Any, spec: Any, *, max_num_seqs: int) -> Any:
    from vllm.config import DeviceConfig, SchedulerConfig, VllmConfig

    return VllmConfig(model_config=target, speculative_config=spec,
                      scheduler_config=SchedulerConfig(
                          max_num_seqs=max_num_seqs, max_num_batched_tokens=512,
                          max_model_len=target.max_model_len, is_encoder_decoder=False),
                      device_config=DeviceConfig(device="cpu"))


@dataclass
class Request:
    req_id: str
    index: int  # request-state index
    prompt: int  # prompt tokens
    computed: int  # tokens whose KV the target holds (num_computed_tokens)
    generation: int  # the reference session's generation of this request's slot
    ref_slot: int
    table: np.ndarray  # float32 [max_len, N_TAPS * HIDDEN]: this request's tap rows by position
    last_token: int = 0
    scheduled_drafts: int = 0  # drafts the next decode step verifies
    fresh: int = 0  # rows the reference has not been sent yet


@dataclass
class Step:
    """What one propose gave, and what the reference drafted for the same rows."""

    req_ids: list[str]
    drafts: np.ndarray  # int64 [n, K] (the speculator's, on every rank)
    confidence: np.ndarray  # float32 [n, K]
    ref_drafts: dict[str, np.ndarray] = field(default_factory=dict)  # req -> int32 [k]
    ref_confidence: dict[str, np.ndarray] = field(default_factory=dict)
    seconds: float = 0.0


def input_batch(req_ids: list[str], index: np.ndarray, scheduled: np.ndarray,
                computed: np.ndarray, prompt: np.ndarray, num_tokens_padded: int) -> Any:
    """vLLM's ``InputBatch`` as ``prepare_inputs`` fills it for requests at request-state
    ``index`` with ``scheduled`` tokens each after ``computed`` ones (a request with
    ``computed < prompt`` is prefilling, the others verify ``scheduled - 1`` drafts), padded
    to ``num_tokens_padded`` tokens as for a CUDA graph."""
    from vllm.v1.worker.gpu.input_batch import InputBatch

    n = len(req_ids)
    sched = np.asarray(scheduled, np.int32)
    computed = np.asarray(computed, np.int32)
    prompt = np.asarray(prompt, np.int32)
    qsl_np = np.zeros(n + 1, np.int32)
    np.cumsum(sched, out=qsl_np[1:])
    T, T_pad = int(qsl_np[-1]), num_tokens_padded
    positions = torch.zeros(T_pad, dtype=torch.int64)
    positions[:T] = torch.from_numpy(np.repeat(computed - qsl_np[:-1], sched) + np.arange(T))
    prefilling = computed < prompt
    drafts = np.where(prefilling, 0, sched - 1).astype(np.int32)
    idx_np = np.asarray(index, np.intp)
    idx = torch.from_numpy(idx_np.astype(np.int64))
    qsl = torch.from_numpy(qsl_np)
    return InputBatch(
        req_ids=list(req_ids), num_reqs=n, num_reqs_after_padding=n, idx_mapping=idx,
        idx_mapping_np=idx_np, expanded_idx_mapping=idx,
        expanded_local_pos=torch.zeros(n, dtype=torch.int32), num_scheduled_tokens=sched,
        num_tokens=T, num_tokens_after_padding=T_pad, num_draft_tokens=int(drafts.sum()),
        num_draft_tokens_per_req=drafts, query_start_loc=qsl, query_start_loc_np=qsl_np,
        seq_lens=torch.from_numpy(computed + sched),
        seq_lens_cpu_upper_bound=torch.from_numpy(computed + sched), dcp_local_seq_lens=None,
        num_computed_tokens_np=computed, prefill_len_np=prompt,
        num_computed_prefill_tokens_np=np.minimum(computed, prompt),
        is_prefilling_np=prefilling, has_prefill=bool(prefilling.any()),
        decode_graph_eligible=not prefilling.any(),
        input_ids=torch.zeros(T_pad, dtype=torch.int32), positions=positions,
        is_padding=torch.arange(T_pad) >= T, logits_indices=qsl[1:] - 1,
        cu_num_logits=torch.arange(n + 1, dtype=torch.int32),
        cu_num_logits_np=np.arange(n + 1, dtype=np.int32), has_structured_output_reqs=False,
        prompt_lens=None)


def propose(spec: Any, batch: Any, aux: list[torch.Tensor], sampled: np.ndarray,
            rejected: np.ndarray, last_sampled: torch.Tensor, next_prefill: torch.Tensor,
            num_spec: int) -> torch.Tensor:
    """``propose`` as ``GPUModelRunner.sample_tokens`` calls it (positional, then keywords)."""
    max_num_reqs = last_sampled.shape[0]
    return spec.propose(
        batch, {}, {}, aux[-1], aux, torch.from_numpy(sampled), torch.from_numpy(rejected),
        last_sampled, next_prefill, torch.zeros(max_num_reqs),
        torch.zeros(max_num_reqs, dtype=torch.int64), num_speculative_tokens=num_spec)


class Engine:
    """Requests admitted, scheduled, verified, finished and preempted as the runner does it."""

    def __init__(self, speculator: Any, *, max_num_reqs: int, num_spec: int, window: int,
                 reference: DraftRounds | None = None, seed: int = 0) -> None:
        self.spec = speculator
        self.max_num_reqs = max_num_reqs
        self.K = num_spec
        self.W = window
        self.ref = reference
        self.rng = np.random.default_rng(seed)
        self.free_indices = list(range(max_num_reqs))  # RequestState's
        self.requests: dict[str, Request] = {}
        self.last_sampled = torch.zeros(max_num_reqs, 1, dtype=torch.int64)
        self.next_prefill = torch.zeros(1, max_num_reqs, dtype=torch.int32)
        self._ref_slots = 0
        self._ref_release: list[int] = []
        self._ref_gen: dict[str, int] = {}

    # -- the runner's request calls ---------------------------------------------------------------
    def admit(self, req_id: str, prompt: int, cached: int = 0) -> Request:
        """scheduled_new_reqs: a new request, or a preempted one that came back (its state
        was removed; it prefills again from ``cached`` tokens of prefix cache)."""
        index = self.free_indices.pop()
        old = self.requests.get(req_id)
        table = old.table if old is not None else self.rng.uniform(
            -2, 2, (4096, N_TAPS * HIDDEN)).astype(np.float32)
        gen = self._ref_gen.get(req_id, 0) + 1
        self._ref_gen[req_id] = gen
        slot = old.ref_slot if old is not None else self._new_ref_slot()
        r = Request(req_id, index, prompt, cached, gen, slot, table)
        self.requests[req_id] = r
        self.spec.add_request(index)
        return r

    def _new_ref_slot(self) -> int:
        self._ref_slots += 1
        return self._ref_slots - 1

    def finish(self, *req_ids: str) -> None:
        """finish_requests: on_requests_finished, then the request states are removed."""
        self.spec.on_requests_finished(set(req_ids))
        for req_id in req_ids:
            r = self.requests.pop(req_id)
            self.free_indices.append(r.index)
            self._ref_release.append(r.ref_slot)

    def preempt(self, req_id: str) -> None:
        """A preempted request's state is removed without on_requests_finished."""
        r = self.requests[req_id]
        self.free_indices.append(r.index)
        r.index = -1

    # -- one step ---------------------------------------------------------------------------------
    def step(self, plan: dict[str, tuple[int, int]], *, pad_to: int = 8) -> Step:
        """One engine step: per request ``(tokens, accepted)``: a prefill chunk of ``tokens``
        (accepted ignored), or for a decoding request 1 + verified drafts with ``accepted`` of
        them accepted. The batch goes through propose; the reference drafts the same rows."""
        reqs = [self.requests[i] for i in plan]
        n = len(reqs)
        sched = np.array([plan[r.req_id][0] for r in reqs], np.int32)
        qsl_np = np.zeros(n + 1, np.int32)
        np.cumsum(sched, out=qsl_np[1:])
        T = int(qsl_np[-1])
        T_pad = -(-T // pad_to) * pad_to
        rows = np.zeros((T_pad, N_TAPS * HIDDEN), np.float32)
        rows[T:] = 9.0  # padding: never a row the worker may see
        sampled = np.zeros(n, np.int32)
        rejected = np.zeros(n, np.int32)
        prefilling = np.array([r.computed < r.prompt for r in reqs])
        valid = np.zeros(n, np.int64)
        for i, r in enumerate(reqs):
            tokens, accepted = plan[r.req_id]
            at = np.arange(r.computed, r.computed + tokens)
            if prefilling[i]:
                if r.computed + tokens > r.prompt:
                    raise ValueError(f"{r.req_id}: a chunk past its prompt")
                valid[i] = tokens
                sampled[i] = 1 if r.computed + tokens == r.prompt else 0
            else:
                if tokens - 1 > r.scheduled_drafts or accepted > tokens - 1:
                    raise ValueError(f"{r.req_id}: verifies more drafts than it has")
                valid[i] = accepted + 1
                sampled[i] = accepted + 1
                rejected[i] = tokens - 1 - accepted
            block = r.table[at].copy()
            block[valid[i]:] *= -1.0  # rejected positions: rows the worker must never see
            rows[qsl_np[i]:qsl_np[i + 1]] = block
            token = int(self.rng.integers(0, VOCAB))
            if sampled[i]:
                self.last_sampled[r.index, 0] = token
            else:
                self.next_prefill[0, r.index] = token  # the prompt token after the chunk
            r.last_token = token
        taps = torch.from_numpy(rows).to(torch.bfloat16)
        aux = [taps[:, j * HIDDEN:(j + 1) * HIDDEN].contiguous() for j in range(N_TAPS)]
        batch = input_batch([r.req_id for r in reqs], np.array([r.index for r in reqs]), sched,
                            np.array([r.computed for r in reqs]),
                            np.array([r.prompt for r in reqs]), T_pad)
        t0 = time.perf_counter()
        drafts = propose(self.spec, batch, aux, sampled, rejected, self.last_sampled,
                         self.next_prefill, self.K)
        seconds = time.perf_counter() - t0
        out = Step(req_ids=[r.req_id for r in reqs], drafts=drafts.numpy().copy(),
                   confidence=self.spec.draft_token_confidence_probs[:n].numpy().copy(),
                   seconds=seconds)
        for i, r in enumerate(reqs):
            r.computed += int(valid[i])
            r.fresh += int(valid[i])
            r.scheduled_drafts = self.K if sampled[i] else 0
        if self.ref is not None:
            self._reference(reqs, sampled, out)
        return out

    def _reference(self, reqs: list[Request], sampled: np.ndarray, out: Step) -> None:
        """The same rows through DraftRounds in a session of its own."""
        requests = []
        for i, r in enumerate(reqs):
            a = r.computed
            k = min(r.fresh, self.W)
            rows = torch.from_numpy(r.table[a - k:a]).to(torch.bfloat16).view(torch.uint8)
            r.fresh = 0
            requests.append(SlotRequest(slot=r.ref_slot, generation=r.generation, anchor_pos=a,
                                        anchor_token=r.last_token, rows=rows.numpy(),
                                        n_out=self.K if sampled[i] else 0))
        release, self._ref_release = self._ref_release, []
        assert self.ref is not None
        res = self.ref.run(requests, release=release)
        assert res.ok, res.reason
        for i, r in enumerate(reqs):
            k = int(res.num_drafted[i])
            out.ref_drafts[r.req_id] = res.draft_ids[i, :k].copy()
            out.ref_confidence[r.req_id] = res.confidence[i, :k].copy()
