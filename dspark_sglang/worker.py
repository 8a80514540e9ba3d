"""The speculative worker of ``REMOTE_DSPARK``: SGLang 0.5.23's ``DSparkWorkerV2`` with the
drafter on a dspark-worker (docs/sglang.md; contract 7.1, 7.5).

``DSparkWorkerV2`` runs a step as: the target's prefill or verify forward, its hidden states at
the drafter's tap layers (SGLang's aux capture, ``[tokens, n_taps * H]``, the taps side by side
in ascending layer order) handed to a KV injector, and before each verify a draft proposal,
the verify planner's budgets from its confidences, SGLang's accept. This class keeps all of
that but the draft side: its constructor builds no draft model runner, KV pool, weights or
CUDA graphs, and puts in their place

* ``RemoteDrafts`` as the KV injector (``_kv_injector``): it catches the tap rows where they
  arrive, after a prefill (one row per extend token; a prefix-cache hit's cached tokens have
  none) and after a verify (the committed ``accepted + 1`` rows of each request), rank 0
  keeping each request's newest W on the host;
* the same object as the proposer (``_proposer``): one ``DraftRounds.run_batch`` per decode
  step on tensor-parallel rank 0, with per request the slot of its ``req_pool_indices`` row,
  the anchor position ``seq_lens[i]`` and token ``bonus_tokens[i]`` and the rows caught since
  its last round; the drafts and confidences broadcast to the other ranks; SGLang's planner
  and accept take them as they take a local drafter's.

Slots are rank 0's own (``SlotTable``): a row takes a fresh one when SGLang's
``req_generation`` of it changes (a new request there, or an aborted or preempted one's row
reused), and gives it back when its request finishes (``note_request_finished``) or leaves the
decode batch without finishing. A failed or late round is a target-only step: draft 0 with
confidence 0 for every request, within the client's timeout.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from types import SimpleNamespace
from typing import Any, NamedTuple

import numpy as np
import torch
from sglang.srt.layers.dp_attention import get_dp_tp_group
from sglang.srt.runtime_context import get_parallel, get_schedule, get_spec
from sglang.srt.speculative.base_spec_worker import BaseSpecWorker
from sglang.srt.speculative.draft_worker_common import build_block_pos_offsets
from sglang.srt.speculative.dspark_components.dspark_draft import (
    DraftBlockResult,
    DraftProposal,
    resolve_draft_params,
)
from sglang.srt.speculative.dspark_components.dspark_kv_inject import PrefillPlacement
from sglang.srt.speculative.dspark_components.dspark_observability import DsparkStepObservers
from sglang.srt.speculative.dspark_components.dspark_planner import DSparkVerifyPlanner
from sglang.srt.speculative.dspark_components.dspark_verify import TargetVerifyExecutor
from sglang.srt.speculative.dspark_components.dspark_worker_v2 import DSparkWorkerV2
from sglang.srt.speculative.spec_tp_sync import SpecTpSync

from dspark_client.adapter.device import RoundTensors, TapRowGather, client_tag
from dspark_client.adapter.engine import GuardedRounds, fill_round, start_rounds
from dspark_client.adapter.options import default_client_name, drafter_hello
from dspark_client.adapter.slots import NO_SLOT, SlotTable
from dspark_client.adapter.worker import hello_with_terms
from dspark_client.hello import tap_layers
from dspark_client.rounds import DraftRounds

from . import OPTIONS_ENV
from .algo import drafter_confidence, options_from_env

__all__ = ["RemoteDSparkWorker", "RemoteDrafts"]

log = logging.getLogger("dspark_sglang")


class _Pending(NamedTuple):
    """A request's tap rows caught since its last round: positions ``[first, first + n)``."""

    generation: int
    first: int
    rows: np.ndarray  # uint8 [n, row_bytes]


class RemoteDrafts:
    """The draft side of ``RemoteDSparkWorker``: SGLang's KV injector (the tap rows) and its
    proposer (the drafts) in one, over a dspark-worker. Rank 0 talks to the worker; every
    rank reads the drafts it broadcasts."""

    # What DSparkWorkerV2 reads of an injector: no draft pool (so no SWA ring to fill).
    draft_model_runner = SimpleNamespace(token_to_kv_pool=None)
    swa_ring_size = None

    def __init__(self, *, gamma: int, max_rows: int, taps: list[int], hidden: int,
                 device: torch.device, rounds: DraftRounds | None, slots: SlotTable | None,
                 window: int, req_generation: torch.Tensor, tp_group: Any,
                 confidence: bool = True) -> None:
        self.gamma = self.query_token_num = gamma
        self.confidence = confidence  # (False: a drafter without a confidence head)
        self.device = torch.device(device)
        self.rounds = rounds
        self.slots = slots
        self.window = window
        self.hidden = hidden
        # SGLang captures the taps in ascending layer order; the HELLO's rows take the
        # drafter's order: column block j of a row is SGLang's block _order[j].
        ascending = sorted(taps)
        self._order = [ascending.index(t) for t in taps]
        self._req_generation = req_generation
        self._tp = tp_group
        self._out = RoundTensors(max_rows, gamma, self.device)
        self._gather = TapRowGather(self.device)
        self._guard = GuardedRounds(log)
        self._pending: dict[int, _Pending] = {}
        self._seen = np.full(max_rows, -1, np.int64)  # the generation each row's slot is for
        self._decoding: set[int] = set()  # the slots of the last decode batch
        self._placed: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None

    @property
    def is_driver(self) -> bool:
        return self.rounds is not None

    # -- the injector: tap rows where they arrive ----------------------------------------------
    def place_prefill(self, batch: Any) -> PrefillPlacement:
        """Before the prefill's target forward: which rows of the batch its hidden states
        will be, read while the scheduler's tables still hold them."""
        if batch.extend_lens is None or batch.prefix_lens is None:
            raise RuntimeError("remote DSpark expected extend_lens / prefix_lens in extend"
                               " mode, got None")
        positions = torch.empty(0, dtype=torch.int64, device=self.device)
        if self.is_driver:
            rows = batch.req_pool_indices.to("cpu", torch.int64).numpy()
            self._placed = (rows, self._req_generation[rows].numpy().copy(),
                            np.asarray(batch.prefix_lens, np.int64),
                            np.asarray(batch.extend_lens, np.int64))
        return PrefillPlacement(cache_loc=positions, positions=positions, state_slot=None,
                                final_pos=None, swa_loc=None)

    def inject_prefill(self, placement: PrefillPlacement, *, target_hidden: torch.Tensor,
                       token_indices: torch.Tensor | None,
                       target_hidden_is_projected: bool) -> None:
        """After the prefill: request i's extend tokens are positions ``[prefix_lens[i],
        prefix_lens[i] + extend_lens[i])``, rows of ``target_hidden`` in request order."""
        if not self.is_driver or self._placed is None:
            return
        rows, generation, prefix, extend = self._placed
        self._placed = None
        if target_hidden_is_projected:
            raise RuntimeError("the target projected its hidden states for a local drafter;"
                               " the remote drafter needs the tap rows as captured")
        starts = np.cumsum(extend) - extend
        if token_indices is None:
            self._catch(target_hidden, rows, generation, prefix, starts, extend)
            return
        # Hidden row k is the batch's token token_indices[k] (SGLang kept only those): per
        # request, the rows of the selected tokens that run up to its last token.
        idx = token_indices.to("cpu", torch.int64).numpy()
        ends = starts + extend
        owner = np.searchsorted(ends, idx, side="right")
        begin = np.zeros_like(extend)
        count = np.zeros_like(extend)
        for i in range(len(rows)):
            mine = np.flatnonzero(owner == i)
            tokens = idx[mine]
            run = 0
            while run < len(tokens) and tokens[-1 - run] == ends[i] - 1 - run:
                run += 1
            begin[i] = mine[len(mine) - run] if run else 0
            count[i] = run
        self._catch(target_hidden, rows, generation, prefix + extend - count, begin, count)

    def catch_verify(self, batch: Any, hidden: torch.Tensor, commit_lens: torch.Tensor,
                     bs: int) -> None:
        """After a verify: request i's committed tokens are positions ``[seq_lens[i],
        seq_lens[i] + commit_lens[i])``, rows ``i * stride + [0, commit_lens[i])`` of the
        verify's hidden states (``[bs * stride, n_taps * H]``)."""
        if not self.is_driver:
            return
        stride = hidden.shape[0] // max(bs, 1)
        rows = batch.req_pool_indices[:bs].to("cpu", torch.int64).numpy()
        counts = commit_lens[:bs].to("cpu", torch.int64).numpy()
        first = batch.seq_lens[:bs].to("cpu", torch.int64).numpy()
        self._catch(hidden, rows, self._req_generation[rows].numpy(), first,
                    np.arange(bs, dtype=np.int64) * stride, counts)

    def _catch(self, hidden: torch.Tensor, rows: np.ndarray, generation: np.ndarray,
               first: np.ndarray, begin: np.ndarray, count: np.ndarray) -> None:
        """Request i's ``count[i]`` rows from ``hidden[begin[i]]`` on, of positions from
        ``first[i]`` on: the newest W of them onto its pending rows, on the host."""
        keep = np.minimum(count, self.window)
        skip = count - keep
        taps = torch.split(hidden, self.hidden, dim=1)
        host = self._gather.gather([taps[j] for j in self._order], begin + skip, keep)
        if host is None:
            return
        at = 0
        for i, row in enumerate(rows.tolist()):
            n = int(keep[i])
            if not n:
                continue
            new = _Pending(int(generation[i]), int(first[i] + skip[i]),
                           host[at:at + n].copy())  # (the gather's buffer is reused)
            at += n
            old = self._pending.get(row)
            if old is not None and old.generation == new.generation and \
                    old.first + len(old.rows) == new.first:
                joined = np.concatenate([old.rows, new.rows])[-self.window:]
                new = _Pending(new.generation, new.first + n - len(joined), joined)
            self._pending[row] = new

    # -- the proposer: one round per decode step ------------------------------------------------
    def propose(self, *, batch: Any, draft_input: Any, verify_window: Any, bs: int,
                device: Any, target_model: Any, sampling_info: Any,
                anchor_prepared: bool = False) -> DraftProposal:
        """The step's drafts ``[bs, gamma]`` and their confidences, the same on every rank."""
        bonus = draft_input.bonus_tokens.view(-1)[:bs]
        host = None
        if self.is_driver:
            host = self._guard.run(np.zeros((bs, 2 * self.gamma), np.int64),
                                   lambda out: self._round(out, batch, bonus, bs))
        self._out.publish(bs, host, self._tp)
        params = resolve_draft_params(sampling_info=sampling_info, bs=bs, device=self.device)
        block = DraftBlockResult(draft_tokens=self._out.draft_tokens[:bs],
                                 corrected_logits=None, greedy_mask=params.greedy_mask,
                                 temperatures=params.temperatures, greedy_draft=True)
        return DraftProposal(draft_block_ids=bonus.view(bs, 1).to(torch.int64),
                             draft_block=block,
                             confidence=self._out.confidence[:bs] if self.confidence else None)

    def _round(self, out: np.ndarray, batch: Any, bonus: torch.Tensor, bs: int) -> None:
        assert self.rounds is not None and self.slots is not None  # (the driver's)
        rows = batch.req_pool_indices[:bs].to("cpu", torch.int64).numpy()
        generation = self._req_generation[rows].numpy()
        anchor = batch.seq_lens[:bs].to("cpu", torch.int64).numpy()
        token = bonus.to("cpu", torch.int64).numpy()
        slots = self._slots_of(rows, generation, [req.rid for req in batch.reqs[:bs]])
        ours = np.flatnonzero(slots != NO_SLOT)
        n_rows = np.zeros(len(ours), np.int64)
        parts = []
        for k, i in enumerate(ours.tolist()):
            got = self._pending.pop(int(rows[i]), None)
            # rows that continue up to the anchor; anything else the client resyncs from
            if got is not None and got.generation == generation[i] and \
                    got.first + len(got.rows) == anchor[i]:
                parts.append(got.rows)
                n_rows[k] = len(got.rows)
        s = slots[ours]
        res = self.rounds.run_batch(s, self.slots.generation[s], anchor[ours], token[ours],
                                    self.gamma, np.concatenate(parts) if parts else None,
                                    n_rows, release=self.slots.take_release())
        fill_round(out, ours, res)

    def _slots_of(self, rows: np.ndarray, generation: np.ndarray, rids: list[str]
                  ) -> np.ndarray:
        """The batch's slots: a row whose generation changed (a new request there) or that
        holds none takes a fresh one; slots of the last decode batch that are not in this
        one are dropped (their requests left without finishing)."""
        table = self.slots
        assert table is not None
        for i in np.flatnonzero((self._seen[rows] != generation) |
                                (table.of_index[rows] == NO_SLOT)).tolist():
            table.add(int(rows[i]))
            self._seen[rows[i]] = generation[i]
        slots: np.ndarray = table.of_index[rows]
        table.name(slots, rids)
        now = set(slots[slots != NO_SLOT].tolist())
        for slot in self._decoding - now:
            if table.index_of[slot] != NO_SLOT:
                table.drop(slot)
        self._decoding = now
        return slots

    def finished(self, rid: str) -> None:
        if self.slots is not None:
            self.slots.finished((rid,))

    # -- what DSparkWorkerV2 may ask of a proposer beside propose -------------------------------
    def run_idle_participation(self, batch: Any) -> None:
        return  # no draft forward for an idle rank to join

    def attach_draft_sampler(self, draft_sampler: Any) -> None:
        return


class _RemoteVerifyExecutor(TargetVerifyExecutor):
    """SGLang's target verify, whose hidden-state commit hands the committed rows to
    ``RemoteDrafts`` instead of writing a draft KV cache."""

    def commit_hidden(self, *, batch: Any, layout: Any, hidden_strided: Any,
                      verify_window: Any, logits_output: Any, commit_lens: torch.Tensor,
                      bs: int, run_compact: bool) -> None:
        hidden = hidden_strided if run_compact else logits_output.hidden_states
        if hidden is None:
            raise RuntimeError("remote DSpark's verify needs the target's tap hidden states,"
                               " got None")
        hidden = hidden.reshape(bs * self.verify_num_draft_tokens, -1)
        self.kv_injector.catch_verify(batch, hidden, commit_lens, bs)


class RemoteDSparkWorker(DSparkWorkerV2):
    """``DSparkWorkerV2`` over a dspark-worker: the target, SGLang's planner and accept, and
    ``RemoteDrafts`` for the draft side."""

    def __init__(self, server_args: Any, gpu_id: int, nccl_port: int, target_worker: Any,
                 draft_worker_cls: Any = None) -> None:
        BaseSpecWorker.__init__(self)
        self.server_args = server_args
        self.gpu_id = gpu_id
        self.nccl_port = nccl_port
        self._target_worker = target_worker
        self.model_runner = runner = target_worker.model_runner
        self.page_size = get_schedule().page_size
        self.device = target_worker.device
        self._draft_worker = None
        self.enable_dp_spec_prefill_coordination = False
        self._hosts_draft = True  # (one pipeline stage: the algorithm refuses more)
        self._draft_is_moe = False
        self._is_pd_prefill = False
        self._decode_graph_allowed = False  # (no draft graph; the target keeps its own)
        spec = get_spec()
        self.verify_num_draft_tokens = self.speculative_num_draft_tokens = int(
            spec.speculative_num_draft_tokens)
        self.gamma = self.verify_num_draft_tokens - 1
        self.query_token_num = self.gamma
        self.sample_from_anchor = True
        self._target_tp_rank = parallel_rank = get_parallel().tp_rank
        self._tp_sync = SpecTpSync(get_dp_tp_group())
        self._block_pos_offsets = build_block_pos_offsets(length=self.verify_num_draft_tokens,
                                                          device=self.device)
        self._target_hidden_projection_enabled = False
        self._need_mamba_verify_commit = False
        self._simulate_acc_len = 0.0
        self._simulated_correct_len = None
        self._sim_draw_ahead = False
        self._simulate_acc_greedy = False
        self._greedy_draft = True
        self._verify_epilogue = None
        self._sampling_accept_graph = None
        self._rejection_noise = None
        self._verify_inputs_ready = None
        self._forced_budget_frac = None

        drafter = server_args.speculative_draft_model_path
        has_confidence = drafter_confidence(drafter)
        self._proposer = self._kv_injector = self._remote_drafts(
            server_args, drafter, runner, parallel_rank, has_confidence)
        # The planner asks its drafter for a confidence head: a stand-in with none when the
        # drafter's config.json has none (SGLang's static verify mode, the default).
        head = SimpleNamespace(sts_temperatures=None) if has_confidence else None
        self._verify_planner = DSparkVerifyPlanner(
            draft_model=SimpleNamespace(confidence_head=head), gamma=self.gamma,
            model_runner=runner, device=self.device, tp_rank=parallel_rank,
            verify_num_draft_tokens=self.verify_num_draft_tokens, tp_sync=self._tp_sync)
        self._verify_executor = _RemoteVerifyExecutor(
            target_worker=target_worker, gamma=self.gamma,
            verify_num_draft_tokens=self.verify_num_draft_tokens, model_runner=runner,
            kv_injector=self._kv_injector, tp_sync=self._tp_sync,
            block_verification=spec.speculative_use_block_verification)
        self._observers = DsparkStepObservers(
            planner=self._verify_planner, gamma=self.gamma,
            verify_num_draft_tokens=self.verify_num_draft_tokens, tp_rank=parallel_rank,
            device=self.device, simulate_acc_len=0.0)

    def _remote_drafts(self, server_args: Any, drafter: str, runner: Any, tp_rank: int,
                       confidence: bool) -> RemoteDrafts:
        opts = options_from_env()
        pool = runner.req_to_token_pool
        max_rows = int(pool.req_generation.shape[0])
        taps = list(tap_layers(drafter))
        hidden = int(runner.model_config.hidden_size)
        tp = get_parallel().tp_group
        group = tp if tp is not None and tp.world_size > 1 else None
        rounds = slots = None
        window = 0  # (rows are kept on rank 0 alone: it takes the HELLO's W)
        if tp_rank == 0:
            # (row 0 of SGLang's table is never a request's: pool.size rows are)
            name = opts.client_name or default_client_name(
                client_tag(torch.device(self.device),
                           int(getattr(server_args, "dp_rank", None) or 0)), engine="sglang")
            wait = opts.remote.connect_timeout_ms / 1000.0
            deadline = time.monotonic() + wait
            hello, terms_from = hello_with_terms(
                lambda **terms: drafter_hello(
                    drafter, opts, client_name=name, target_hidden_size=hidden,
                    target_checkpoint=_local_dir(server_args.model_path), where=OPTIONS_ENV,
                    folder="--speculative-draft-model-path", **terms),
                opts, max_requests=int(pool.size), client_name=name, timeout=wait)
            rounds = start_rounds(opts.remote, hello, owner=self, log=log,
                                  wait=max(deadline - time.monotonic(), 0.0),
                                  note=f"; W and limits {terms_from}")
            slots = SlotTable(max_rows, hello.max_slots, engine="SGLang")
            window = hello.window
            if rounds.client.has_confidence is False:
                log.warning("remote DSpark: the worker's drafter has no confidence head; its"
                            " confidences are 1.0, so every step verifies %d drafts",
                            self.gamma)
        return RemoteDrafts(gamma=self.gamma, max_rows=max_rows, taps=taps, hidden=hidden,
                            device=self.device, rounds=rounds, slots=slots, window=window,
                            req_generation=pool.req_generation, tp_group=group,
                            confidence=confidence)

    # -- no draft model, KV or graphs ------------------------------------------------------------
    def weight_update_runners(self) -> list[tuple[str, Any]]:
        return []

    @property
    def spec_v2_attn_backends(self) -> tuple[Any, ...]:
        return (self._target_worker.model_runner.attn_backend,)

    def _draft_context(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def alloc_memory_pool(self, memory_pool_config: Any = None, req_to_token_pool: Any = None,
                          token_to_kv_pool_allocator: Any = None) -> None:
        return

    def init_attention_backends(self) -> None:
        return

    def init_cuda_graphs(self) -> None:
        return

    def clear_cache_pool(self) -> None:
        return

    def note_request_finished(self, *, rid: str, natural_stop: bool) -> None:
        self._proposer.finished(rid)
        self._observers.note_request_finished(rid=rid, natural_stop=natural_stop)


def _local_dir(path: Any) -> str | None:
    """The served model's folder where it is one (a drafter without its own embeddings takes
    them from there for its identity); None for a hub name."""
    return path if isinstance(path, str) and os.path.isdir(path) else None
