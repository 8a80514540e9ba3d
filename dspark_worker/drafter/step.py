"""The draft step over static device buffers, one per batch bucket, and on CUDA one captured
graph per bucket (docs/architecture.md, "The draft step on a GPU").

:func:`draft_step` is the step itself: backbone over N query positions, then the Markov walk,
the confidence head and (sampled lanes) q. Run eagerly, one step is a few hundred kernel
launches; at small B on an H100/H200 class GPU their CPU cost, not the GPU, sets the time.

:class:`StaticStep` runs the same function over buffers that never move: a batch of b lanes is
padded to its bucket (1, 2, 4, ..., 256, and the largest the worker serves), every input lands
in the step's device buffers (lanes, anchor positions and tokens, each window's first position
and length, the sampling parameters and the u of CONTRACT 9.3), and padded lanes read ring lane
0 with an empty window, greedy, and are never returned. Nothing inside the step synchronises
with the host or branches in Python on a tensor's value, so it can be captured once and replayed.

A :class:`Replay` holds the step's outputs after ``replay()``: :class:`CudaGraphReplay` replays a
captured ``torch.cuda.CUDAGraph``; :class:`EagerReplay` runs the step's operations as they are
(what the CPU tests drive, and what a deliberately wrong replay in the tests subclasses).
:class:`StepGraphs` holds one replay per (bucket, greedy or sampled) and the start-up
self-check that compares every replay with the eager step on random lanes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from torch import Tensor

from .model import ContextSource, DraftModel
from .rings import RingPool
from .walk import DeviceSampling, markov_walk

# Batch buckets: a batch of b lanes runs as the smallest bucket >= b. Powers of two up to 256
# (vLLM's default max_num_seqs), and the worker's own largest (its --max-slots).
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# Rows of the packed integer inputs: lanes, anchor_pos, anchor_token, window start, window rows,
# then for a sampled step top_k and is_sampled.
INT_ROWS = 5
SAMPLED_INT_ROWS = 7
# What a padded lane holds: ring lane 0 with an empty window at position 0, token 0, greedy.
PAD_INTS = (0, 0, 0, 0, 0, 1, 0)
PAD_FLOATS = (1.0, 0.0)  # temperature, top_p
OUTPUTS = ("draft_ids", "confidence", "margin", "support_ids", "proposal_q")


def bucket_sizes(largest: int) -> tuple[int, ...]:
    """The buckets for batches of up to ``largest`` lanes, ascending."""
    if largest < 1:
        raise ValueError(f"largest bucket {largest} must be positive")
    return (*(b for b in BUCKETS if b < largest), largest)


def draft_step(model: DraftModel, anchor: Tensor, token: Tensor, n: int, context: ContextSource,
               sampling: DeviceSampling | None, keep_logits: bool = False,
               draft_topk: int = 0) -> dict[str, Tensor]:
    """One draft step for B lanes: anchor positions and tokens [B] int64 on the device. The
    block has the config's lead rows (the bonus-token anchor's row, no draft) before the N
    drafted ones; draft and support ids come back as target ids."""
    rows = model.config.lead_rows + n
    block_ids = torch.full((anchor.shape[0], rows), model.config.mask_token_id,
                           dtype=torch.int64, device=anchor.device)  # [B, lead + N]
    block_ids[:, 0] = token
    block_pos = anchor.unsqueeze(1) + torch.arange(rows, device=anchor.device)  # [B, lead + N]
    hf = model.backbone(block_ids, block_pos, context)  # [B, lead + N, d]
    out = markov_walk(model, hf, None, token, sampling, keep_logits, draft_topk)
    result = {"draft_ids": out.draft_ids, "confidence": out.confidence, "margin": out.margin}
    if out.support_ids is not None and out.proposal_q is not None:
        result["support_ids"] = out.support_ids
        result["proposal_q"] = out.proposal_q
    if out.logits is not None:
        result["logits"] = out.logits
    return result


class StaticStep:
    """:func:`draft_step` for ``size`` lanes over static device buffers (one bucket, greedy or
    sampled). ``load`` pads a batch into the buffers; ``compute`` runs the step on them."""

    def __init__(self, model: DraftModel, pool: RingPool, size: int, n: int, sampled: bool,
                 draft_topk: int = 0) -> None:
        self.model, self.pool = model, pool
        self.size, self.n, self.sampled, self.draft_topk = size, n, sampled, draft_topk
        dev = pool.device
        self.ints = torch.zeros((SAMPLED_INT_ROWS if sampled else INT_ROWS, size),
                                dtype=torch.int64, device=dev)
        self.floats = torch.zeros((2, size), dtype=torch.float64, device=dev)
        self.u = torch.zeros((size, n), dtype=torch.int64, device=dev)
        self._pad_ints = np.array(PAD_INTS[:self.ints.shape[0]], dtype=np.int64)[:, None]
        self._pad_floats = np.array(PAD_FLOATS, dtype=np.float64)[:, None]
        self.load(np.zeros((self.ints.shape[0], 0), dtype=np.int64),
                  np.zeros((2, 0)) if sampled else None,
                  np.zeros((0, n), dtype=np.int64) if sampled else None)

    def load(self, ints: npt.NDArray[np.int64], floats: npt.NDArray[np.float64] | None,
             u: npt.NDArray[np.int64] | None) -> None:
        """ints [5 (7 sampled), b], floats [2, b] (temperature, top_p) and u [b, N] of b <= size
        lanes into the buffers, padded lanes after them: one copy per buffer."""
        b = ints.shape[1]
        if b > self.size or ints.shape[0] != self.ints.shape[0]:
            raise ValueError(f"inputs {ints.shape} do not fit the step's {tuple(self.ints.shape)}")
        pad = self.size - b
        self._copy(self.ints, np.concatenate([ints, np.repeat(self._pad_ints, pad, axis=1)],
                                             axis=1))
        if self.sampled:
            if floats is None or u is None:
                raise ValueError("a sampled step needs its floats and u")
            self._copy(self.floats, np.concatenate(
                [floats, np.repeat(self._pad_floats, pad, axis=1)], axis=1))
            self._copy(self.u, np.concatenate([u, np.zeros((pad, self.n), dtype=np.int64)]))

    def _copy(self, dst: Tensor, src: npt.NDArray[np.generic]) -> None:
        host = torch.from_numpy(np.ascontiguousarray(src))
        if dst.device.type == "cuda":
            host = host.pin_memory()
        dst.copy_(host, non_blocking=dst.device.type == "cuda")

    def compute(self) -> dict[str, Tensor]:
        """The step on the buffers: outputs [size, ...] on the device (padded lanes last)."""
        lanes, anchor, token, start, rows = self.ints[:INT_ROWS]
        context = self.pool.context(None, lanes, start, rows)
        sampling = None
        if self.sampled:
            sampling = DeviceSampling(is_sampled=self.ints[6] > 0, top_k=self.ints[5],
                                      temperature=self.floats[0], top_p=self.floats[1], u=self.u)
        return draft_step(self.model, anchor, token, self.n, context, sampling,
                          draft_topk=self.draft_topk)


class Replay:
    """One bucket's step, run by ``replay()``; its results are in ``outputs`` afterwards."""

    outputs: dict[str, Tensor]

    def __init__(self, step: StaticStep) -> None:
        self.step = step
        self.outputs = {}

    def replay(self) -> None:  # pragma: no cover - interface
        raise NotImplementedError


class EagerReplay(Replay):
    """The step's operations run as they are: the CPU stand-in of a captured graph."""

    def replay(self) -> None:
        self.outputs = self.step.compute()


class CudaGraphReplay(Replay):
    """The step captured once as a ``torch.cuda.CUDAGraph`` (its buffers and outputs are the
    graph's; memory from ``mempool``, shared by every bucket: they never run at once)."""

    def __init__(self, step: StaticStep, mempool: Any = None) -> None:
        super().__init__(step)
        # Warm-up runs on a side stream first (cuBLAS handles, lazy kernels), as capture needs.
        side = torch.cuda.Stream(step.pool.device)  # type: ignore[no-untyped-call]
        side.wait_stream(torch.cuda.current_stream(step.pool.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                step.compute()
        torch.cuda.current_stream(step.pool.device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=mempool):
            self.outputs = step.compute()

    def replay(self) -> None:
        self.graph.replay()


ReplayFactory = Callable[[StaticStep], Replay]


@dataclass(frozen=True)
class GraphReport:
    """How the draft step runs after ``Drafter.prepare_graphs``."""

    graphs: int  # replays in use (2 per bucket: greedy and sampled); 0: eager
    buckets: tuple[int, ...]
    fallback: str | None  # why the captured step was dropped for the eager one, if it was
    seconds: float  # capture and self-check


class StepGraphs:
    """One replay per (bucket, sampled) for one ring pool; ``run`` drafts b <= largest lanes."""

    def __init__(self, model: DraftModel, pool: RingPool, n: int, largest: int,
                 factory: ReplayFactory, draft_topk: int = 0) -> None:
        self.pool, self.n = pool, n
        self.buckets = bucket_sizes(largest)
        self.largest = self.buckets[-1]
        self.replays: dict[tuple[int, bool], Replay] = {}
        with torch.inference_mode():
            for size in reversed(self.buckets):  # largest first: the others fit in its memory
                for sampled in (False, True):
                    step = StaticStep(model, pool, size, n, sampled, draft_topk)
                    self.replays[size, sampled] = factory(step)

    def covers(self, pool: RingPool, b: int, n: int) -> bool:
        return pool is self.pool and n == self.n and 1 <= b <= self.largest

    def bucket(self, b: int) -> int:
        return next(size for size in self.buckets if size >= b)

    def run(self, ints: npt.NDArray[np.int64], floats: npt.NDArray[np.float64] | None,
            u: npt.NDArray[np.int64] | None) -> dict[str, Tensor]:
        """Load b lanes (``StaticStep.load``) into their bucket, replay, and return the first b
        rows of every output (views of the static outputs: read them before the next run)."""
        b = ints.shape[1]
        replay = self.replays[self.bucket(b), floats is not None]
        replay.step.load(ints, floats, u)
        replay.replay()
        return {name: t[:b] for name, t in replay.outputs.items()}

    def self_check(self, seed: int = 0, lanes: npt.NDArray[np.int64] | None = None
                   ) -> str | None:
        """Replay every bucket on random lanes (random ring contents, windows that wrap, mixed
        window lengths, greedy and sampled lanes, padded lanes) against the eager step on the
        same buffers: ids, supports and q exactly, confidence and margin within the dtype's
        tolerance. None when all agree, else the first difference in words. ``lanes``: the
        lanes it may write (random meanwhile, zero after; None: every lane of the pool), so
        that a pool whose other lanes hold live windows keeps them."""
        rng = np.random.default_rng(seed)
        pool = self.pool
        vocab = pool.model.config.vocab_size
        tol = 1e-4 if pool.dtype == torch.float32 else 2e-2
        idx = None if lanes is None else torch.as_tensor(lanes, dtype=torch.int64,
                                                          device=pool.device)
        try:
            with torch.inference_mode():
                gen = torch.Generator(pool.device).manual_seed(seed)
                if idx is None:
                    pool.kv.normal_(generator=gen)
                else:  # [2, L, lanes, Hkv, W, D]
                    shape = (*pool.kv.shape[:2], idx.numel(), *pool.kv.shape[3:])
                    pool.kv.index_copy_(2, idx, torch.randn(shape, generator=gen,
                                                            dtype=pool.dtype,
                                                            device=pool.device))
                for (size, sampled), replay in self.replays.items():
                    b = max(1, size - 1) if size > 1 else 1  # a padded lane where there is room
                    ints, floats, u = random_inputs(rng, b, self.n, pool, vocab, sampled, lanes)
                    replay.step.load(ints, floats, u)
                    replay.replay()
                    got = {k: v.clone() for k, v in replay.outputs.items()}
                    want = replay.step.compute()
                    where = f"bucket {size} ({'sampled' if sampled else 'greedy'})"
                    problem = compare(got, want, b, tol)
                    if problem is not None:
                        return f"{where}: {problem}"
        finally:
            with torch.inference_mode():
                if idx is None:
                    pool.kv.zero_()
                else:
                    pool.kv.index_fill_(2, idx, 0)
        return None


def random_inputs(rng: np.random.Generator, b: int, n: int, pool: RingPool, vocab: int,
                  sampled: bool, among: npt.NDArray[np.int64] | None = None
                  ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float64] | None,
                             npt.NDArray[np.int64] | None]:
    """b random lanes for ``StaticStep.load``: any ring lane (or one of ``among``), windows of
    0..W rows ending at anchors up to 3 W (so many wrap the ring's end), and when sampled a mix
    of greedy lanes and lanes of every top_k, temperature and top_p."""
    w = pool.window
    lanes = (rng.integers(0, pool.capacity_lanes, b) if among is None
             else rng.choice(np.asarray(among, dtype=np.int64), b))
    anchor = rng.integers(0, 3 * w + 1, b)
    rows = np.minimum(rng.integers(0, w + 1, b), anchor)
    token = rng.integers(0, vocab, b)
    ints = [lanes, anchor, token, anchor - rows, rows]
    if not sampled:
        return np.stack(ints).astype(np.int64), None, None
    top_k = rng.integers(0, 33, b)
    is_sampled = top_k > 0
    ints += [np.where(is_sampled, top_k, 1), is_sampled]
    temperature = np.where(is_sampled, rng.uniform(0.3, 1.5, b), 1.0)
    top_p = np.where(is_sampled & (rng.random(b) < 0.5), rng.uniform(0.5, 1.0, b), 0.0)
    u = rng.integers(0, 1 << 24, (b, n))
    return (np.stack(ints).astype(np.int64), np.stack([temperature, top_p]).astype(np.float64),
            u.astype(np.int64))


def compare(got: dict[str, Tensor], want: dict[str, Tensor], b: int, tol: float) -> str | None:
    """The first difference between two steps' outputs over their first b lanes, in words."""
    if set(got) != set(want):
        return f"outputs {sorted(got)} != {sorted(want)}"
    for name in OUTPUTS:
        if name not in got:
            continue
        g, w = got[name][:b], want[name][:b]
        if g.shape != w.shape:
            return f"{name} shape {tuple(g.shape)} != {tuple(w.shape)}"
        if g.dtype in (torch.int64, torch.int32):
            bad = g != w
        else:
            bad = ~torch.isclose(g, w, rtol=tol, atol=tol)
        if bool(bad.any()):
            at = tuple(int(i) for i in torch.nonzero(bad)[0])
            return f"{name}{list(at)} {g[at].item()!r} != eager {w[at].item()!r}"
    return None
