"""The drafter called in-process, behind the same ``round(requests) -> RoundResult`` interface
as ``RemoteDrafts`` (tests and benchmarks: it imports torch and the worker's drafter).

It keeps one ring lane per slot and applies each request's rows the way the worker does
(a new generation resets the window; otherwise 7.2 step 4), then drafts every request in one
batched call, so "remote equals local" compares the wire path with the same drafter here.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from dspark_client.rounds import RoundResult, SlotRequest
from dspark_worker.drafter import Drafter, SamplingParams


def reference_drafter_one_thread() -> Iterator[Drafter]:
    """The embedded reference drafter, for a module-scoped fixture (``yield from`` this). The
    2 cores are shared with a worker process: one intra-op thread keeps the reference drafts
    from fighting it, and the count is restored afterwards."""
    import torch

    from dspark_worker.drafter import load_drafter

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield load_drafter(None)
    torch.set_num_threads(before)


class LocalDrafts:
    def __init__(self, drafter: Drafter, *, max_slots: int, window: int,
                 sampled: bool = False) -> None:
        self.drafter = drafter
        self.num_spec = drafter.num_spec
        self.window = window
        self.sampled = sampled
        self.pool = drafter.new_pool(max_slots, window)
        self.lanes = self.pool.allocate(max_slots)
        self._gen: dict[int, int] = {}

    def release(self, slots: Sequence[int]) -> None:
        for s in slots:
            self._gen.pop(s, None)
            self.pool.release(self.lanes[[s]])

    def round(self, requests: Sequence[SlotRequest]) -> RoundResult:
        N = self.num_spec
        lanes = self.lanes[[r.slot for r in requests]]
        anchor = np.array([r.anchor_pos for r in requests], np.int64)
        n_rows = np.array([0 if r.rows is None else r.rows.shape[0] for r in requests], np.int64)
        reset = np.array([self._gen.get(r.slot) != r.generation for r in requests])
        for r in requests:
            self._gen[r.slot] = r.generation
        rows = [r.rows for r in requests if r.rows is not None and r.rows.shape[0]]
        table = (np.concatenate(rows) if rows
                 else np.zeros((0, self.drafter.row_bytes), np.uint8))
        self.pool.apply(lanes, anchor, n_rows, reset, table)
        sampling = None
        if self.sampled:
            sampling = SamplingParams(
                top_k=np.array([r.top_k for r in requests]),
                temperature=np.array([r.temperature for r in requests], np.float32),
                top_p=np.array([r.top_p for r in requests], np.float32),
                seed=np.array([r.seed for r in requests], np.uint64),
                generation=np.array([r.generation for r in requests], np.uint64))
        out: Any = self.drafter.draft(self.pool, lanes, anchor,
                                      np.array([r.anchor_token for r in requests]), N,
                                      sampling=sampling)
        wr = self.pool.window_rows(lanes, anchor)
        expected = np.minimum(self.window, anchor)
        usable = (wr == expected) | (wr > 0)
        k = np.array([min(r.n_out or N, N) for r in requests], np.int32) * usable
        live = np.arange(N)[None, :] < k[:, None]
        return RoundResult(
            ok=True, reason=None, num_drafted=k.astype(np.int32),
            status=np.where(wr == expected, 0, np.where(wr > 0, 1, 2)).astype(np.uint8),
            draft_ids=np.where(live, out.draft_ids, 0).astype(np.int32),
            confidence=np.where(live, out.confidence, 0).astype(np.float32),
            margin=np.where(live, out.margin, 0).astype(np.float32),
            support_ids=None if out.support_ids is None
            else np.where(live[..., None], out.support_ids, 0).astype(np.int32),
            proposal_q=None if out.proposal_q is None
            else np.where(live[..., None], out.proposal_q, 0).astype(np.uint32))
