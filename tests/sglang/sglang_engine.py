"""SGLang 0.5.23's scheduler, as far as ``REMOTE_DSPARK``'s worker sees it, on the CPU.

* The server arguments are SGLang's ``ServerArgs``, resolved by its own pipeline (our
  algorithm's hooks included) and published as its runtime context; the process groups are
  SGLang's, initialised on gloo (one rank).
* The request table is SGLang's ``ReqToTokenPool`` (rows and their ``req_generation``); a
  batch carries what ``DSparkWorkerV2`` reads of a ``ScheduleBatch`` (``req_pool_indices``,
  ``seq_lens``, ``reqs``' rids; for a prefill ``prefix_lens`` and ``extend_lens``).
* The target worker is a stand-in (no model runs here): its model runner has the request
  table, the target's ``model_config`` (hidden size, model type) and no attention backend.
  Its hidden states at the tap layers are what SGLang's aux capture hands the worker: bf16
  ``[tokens, n_taps * H]``, the taps side by side in ascending layer order; for a verify
  ``[bs * (gamma + 1), n_taps * H]``.

The engine drives the worker as ``DSparkWorkerV2._forward_prefill`` / ``_forward_decode``
do: ``_kv_injector.place_prefill`` and ``inject_prefill`` around a prefill,
``_proposer.propose`` before a verify, SGLang's ``accept_draft_tokens`` and
``build_accept_outs`` on the drafts, then ``_verify_executor.commit_hidden`` with the verify's
hidden states, and ``note_request_finished``. Beside it a reference session on the same
dspark-worker, driven through ``DraftRounds`` with the rows and anchors the worker should have
sent, so every step's drafts can be compared.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from dspark_client.hello import tap_layers
from dspark_client.rounds import DraftRounds

_PUBLISHED: dict[str, Any] = {}


def server_args(drafter: Path, target: Path, *extra: str) -> Any:
    """SGLang's ``ServerArgs`` for ``REMOTE_DSPARK``, parsed and resolved by SGLang, with the
    plugins loaded first as SGLang's launcher loads them."""
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args

    load_plugins()

    args = prepare_server_args(["--model-path", str(target), "--speculative-algorithm",
                                "REMOTE_DSPARK", "--speculative-draft-model-path",
                                str(drafter), "--device", "cpu", *extra])
    args.resolve_once()
    return args


def publish(args: Any) -> None:
    """Publish ``args`` as this process's runtime context (last publish wins) and set up
    SGLang's process groups once (gloo, one rank)."""
    from sglang.srt import runtime_context as rc
    from sglang.srt.distributed.parallel_state import (
        init_distributed_environment,
        initialize_model_parallel,
    )

    rc.publish(args, role="scheduler", ranks=rc.SpawnRanks(world_rank=0, gpu_id=None))
    if not _PUBLISHED:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{port}")
        initialize_model_parallel()
        _PUBLISHED["groups"] = True


def stand_in_target(hidden: int, rows: int = 8, context: int = 256) -> Any:
    """The target worker as the DSpark worker reads it, with SGLang's request table."""
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    pool = ReqToTokenPool(size=rows, max_context_len=context, device="cpu",
                          enable_memory_saver=False)
    runner = SimpleNamespace(
        req_to_token_pool=pool, attn_backend=None, model=None,
        spec_algorithm=SpeculativeAlgorithm.from_string("REMOTE_DSPARK"),
        model_config=SimpleNamespace(hidden_size=hidden,
                                     hf_text_config=SimpleNamespace(model_type="qwen3")))
    return SimpleNamespace(model_runner=runner, device="cpu", random_seed=0)


@dataclass
class Req:
    rid: str
    row: int
    seq_len: int  # tokens committed (the next anchor's position)
    bonus: int  # the token at seq_len, sampled by the target


@dataclass
class Step:
    drafts: np.ndarray  # [bs, gamma] as the worker returned them
    confidence: np.ndarray
    ref_drafts: np.ndarray  # the reference session's for the same rows and anchors
    ref_confidence: np.ndarray
    commit_lens: np.ndarray  # SGLang's accept: tokens committed per request
    bonus: np.ndarray
    seconds: float = 0.0


@dataclass
class Engine:
    """The scheduler's side: requests on rows of the request table, prefill and verify steps
    through the worker, and the reference session."""

    worker: Any
    target: Any
    drafter: Path
    reference: DraftRounds | None = None
    reqs: dict[str, Req] = field(default_factory=dict)
    taps: list[int] = field(default_factory=list)
    rng: np.random.Generator = field(default_factory=lambda: np.random.default_rng(7))
    _ref_slot: dict[str, tuple[int, int]] = field(default_factory=dict)
    _ref_next: int = 0
    _ref_rows: dict[str, np.ndarray] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.taps = list(tap_layers(self.drafter))
        self.H = int(self.target.model_runner.model_config.hidden_size)
        self.pool = self.target.model_runner.req_to_token_pool
        self.gamma = self.worker.gamma

    # -- hidden states as SGLang's aux capture hands them ---------------------------------------
    def _hidden(self, n: int) -> torch.Tensor:
        """``[n, n_taps * H]`` bf16: random taps side by side in ascending layer order."""
        x = self.rng.standard_normal((n, len(self.taps) * self.H)).astype(np.float32)
        return torch.from_numpy(x).to(torch.bfloat16)

    def _drafter_rows(self, hidden: torch.Tensor) -> np.ndarray:
        """The HELLO's rows of ``hidden``: the taps in the drafter's order, bf16 bytes."""
        ascending = sorted(self.taps)
        parts = hidden.split(self.H, dim=1)
        rows = torch.cat([parts[ascending.index(t)] for t in self.taps], dim=1)
        return rows.contiguous().view(torch.uint8).numpy().copy()

    # -- the scheduler's calls --------------------------------------------------------------------
    def prefill(self, prompts: dict[str, int], *, cached: dict[str, int] | None = None,
                rows: dict[str, int] | None = None, last: dict[str, int] | None = None
                ) -> None:
        """New requests (rid: prompt length), ``cached`` tokens of each a prefix-cache hit
        (no hidden states for them); ``rows`` puts a request on a given free row; ``last``:
        the target keeps the hidden states of only these many last tokens of a request
        (``hidden_states_token_indices``)."""
        cached, last = cached or {}, last or {}
        new = []
        for rid, n in prompts.items():
            if rows and rid in rows:
                self.pool.free_slots.remove(rows[rid])
                self.pool.free_slots.append(rows[rid])
            row = self.pool.alloc_rows(1)[0]
            new.append(Req(rid, row, n, int(self.rng.integers(0, 250))))
        prefix = [cached.get(r.rid, 0) for r in new]
        extend = [r.seq_len - p for r, p in zip(new, prefix, strict=True)]
        batch = SimpleNamespace(
            req_pool_indices=torch.tensor([r.row for r in new], dtype=torch.int64),
            prefix_lens=prefix, extend_lens=extend,
            reqs=[SimpleNamespace(rid=r.rid) for r in new])
        placement = self.worker._kv_injector.place_prefill(batch)
        hidden = self._hidden(sum(extend))
        keep = np.concatenate([np.arange(at + n - last.get(r.rid, n), at + n) for r, n, at in
                               zip(new, extend, np.cumsum(extend) - extend, strict=True)])
        selected = None if not last else torch.from_numpy(keep)
        self.worker._kv_injector.inject_prefill(
            placement, target_hidden=hidden if selected is None else hidden[selected],
            token_indices=selected, target_hidden_is_projected=False)
        host = self._drafter_rows(hidden)
        at = 0
        for r, n in zip(new, extend, strict=True):
            self.reqs[r.rid] = r
            self._ref_rows[r.rid] = host[at + n - last.get(r.rid, n):at + n]
            at += n
            self._ref_new(r.rid)

    def _ref_new(self, rid: str) -> None:
        slot = self._ref_next
        self._ref_next += 1
        self._ref_slot[rid] = (slot, 1)

    def finish(self, rid: str) -> None:
        req = self.reqs.pop(rid)
        self.pool.free_rows([req.row])
        self.worker.note_request_finished(rid=rid, natural_stop=True)

    def decode(self, accept: dict[str, int] | None = None) -> Step:
        """One verify step of every running request: the worker's drafts, the target agreeing
        with the first ``accept[rid]`` of them (all when not given), SGLang's accept, the
        committed rows handed back."""
        import time

        from sglang.srt.speculative.dspark_components.dspark_verify import (
            accept_draft_tokens,
            build_accept_outs,
        )
        from sglang.srt.speculative.spec_tp_sync import SpecTpSyncSite

        accept = accept or {}
        reqs = list(self.reqs.values())
        bs, g, vw = len(reqs), self.gamma, self.gamma + 1
        batch = SimpleNamespace(
            req_pool_indices=torch.tensor([r.row for r in reqs], dtype=torch.int64),
            seq_lens=torch.tensor([r.seq_len for r in reqs], dtype=torch.int64),
            reqs=[SimpleNamespace(rid=r.rid) for r in reqs])
        draft_input = SimpleNamespace(
            bonus_tokens=torch.tensor([r.bonus for r in reqs], dtype=torch.int64))
        t0 = time.monotonic()
        proposal = self.worker._proposer.propose(
            batch=batch, draft_input=draft_input, verify_window=None, bs=bs, device="cpu",
            target_model=None, sampling_info=None)
        seconds = time.monotonic() - t0
        drafts = proposal.draft_block.draft_tokens
        assert drafts.shape == (bs, g) and drafts.dtype == torch.int64
        conf = proposal.confidence
        assert conf is not None and conf.shape == (bs, g) and conf.dtype == torch.float32
        ref_d, ref_c = self._reference(reqs)
        # The target's logits: it agrees with the first accept[rid] drafts, then says
        # another token; the verify window is [bonus, drafts...].
        verify_ids = torch.cat([proposal.draft_block_ids[:, :1], drafts], dim=1)
        vocab = 260
        logits = torch.zeros(bs * vw, vocab, dtype=torch.float32)
        for i, r in enumerate(reqs):
            k = min(accept.get(r.rid, g), g)
            for j in range(vw):
                want = int(verify_ids[i, j + 1]) if j < k else int(
                    (int(verify_ids[i, min(j + 1, g)]) + 1) % vocab)
                logits[i * vw + j, want] = 1.0
        correct_len, bonus, cap_trim = accept_draft_tokens(
            candidates=verify_ids, target_logits=logits, draft_block=proposal.draft_block,
            sampling_info=None, draft_input=draft_input, gamma=g, verify_num_draft_tokens=vw)
        outs = build_accept_outs(
            correct_len=correct_len, bonus=bonus, cap_trim_lens=cap_trim,
            prefix_lens=batch.seq_lens, draft_tokens=drafts, gamma=g,
            verify_num_draft_tokens=vw, tp_sync=self.worker._tp_sync,
            sync_site=SpecTpSyncSite.DSPARK_ACCEPT_GREEDY)
        commit = outs.commit_lens.to(torch.int64).numpy()
        hidden = self._hidden(bs * vw)
        self.worker._verify_executor.commit_hidden(
            batch=batch, layout=None, hidden_strided=None, verify_window=None,
            logits_output=SimpleNamespace(hidden_states=hidden), commit_lens=outs.commit_lens,
            bs=bs, run_compact=False)
        host = self._drafter_rows(hidden)
        new_bonus = outs.bonus.view(-1).to(torch.int64).numpy()
        for i, r in enumerate(reqs):
            self._ref_rows[r.rid] = host[i * vw:i * vw + int(commit[i])]
            r.seq_len += int(commit[i])
            r.bonus = int(new_bonus[i])
        return Step(drafts.numpy().copy(), conf.numpy().copy(), ref_d, ref_c, commit,
                    new_bonus, seconds)

    def _reference(self, reqs: list[Req]) -> tuple[np.ndarray, np.ndarray]:
        """The reference session's drafts for the same anchors and rows."""
        bs, g = len(reqs), self.gamma
        if self.reference is None:
            return np.zeros((bs, g), np.int64), np.zeros((bs, g), np.float32)
        slots = np.array([self._ref_slot[r.rid][0] for r in reqs], np.int64)
        gens = np.array([self._ref_slot[r.rid][1] for r in reqs], np.int64)
        parts = [self._ref_rows.pop(r.rid, np.zeros((0, 0), np.uint8)) for r in reqs]
        counts = np.array([len(p) for p in parts], np.int64)
        rows = np.concatenate([p for p in parts if len(p)]) if counts.any() else None
        res = self.reference.run_batch(slots, gens, [r.seq_len for r in reqs],
                                       [r.bonus for r in reqs], g, rows, counts)
        assert res.ok, res.reason
        return (res.draft_ids[:, :g].astype(np.int64).copy(),
                res.confidence[:, :g].copy())
