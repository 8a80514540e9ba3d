"""The worker's handle on the drafter: load it, make ring pools, draft a batch of lanes
(CONTRACT 7.2 step 6, section 9), and a from-scratch reference the tests hold it to.

Host preparation (numpy: window lengths, sampling uniforms, argument checks) is apart from
device execution (one upload, backbone, Markov walk, one download). On CUDA the weights are
bf16 by default, small inputs travel through pinned buffers with non-blocking copies, and the
only synchronisation of a draft is the final download.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from torch import Tensor

from protocol import sampled as protocol_sampled
from protocol.identity import (
    identities_from_arrays,
    identities_from_checkpoint,
    markov_walk_identity,
)

from .checkpoint import LoadedCheckpoint, check_device_memory, load_checkpoint, tensor_records
from .config import DrafterConfig, DrafterConfigError
from .embedded import EMBEDDED_CONFIG, EMBEDDED_SEED, random_tensors
from .families import build_model, family_of
from .model import DenseContext, DraftModel
from .rings import RingPool, decode_bf16_rows
from .step import CudaGraphReplay, GraphReport, ReplayFactory, StepGraphs, draft_step
from .walk import DeviceSampling

log = logging.getLogger("dspark.worker.drafter")
# The reference drafter shipped with the package: the embedded default.
REFERENCE_DIR = Path(__file__).resolve().parent / "reference"

MAX_TOP_K = protocol_sampled.MAX_TOP_K
CUDA_GRAPH_MODES = ("auto", "off")


@dataclass(frozen=True)
class SamplingParams:
    """Per-lane sampling fields of a STEP's entries (CONTRACT 7.3), arrays of length B.

    ``top_k == 0``: that lane drafts greedily (CONTRACT 9.2)."""

    top_k: npt.ArrayLike
    temperature: npt.ArrayLike
    top_p: npt.ArrayLike
    seed: npt.ArrayLike
    generation: npt.ArrayLike


@dataclass(frozen=True)
class DraftResult:
    """Host arrays for B lanes and N positions."""

    draft_ids: npt.NDArray[np.int32]  # [B, N]
    confidence: npt.NDArray[np.float32]  # [B, N]
    margin: npt.NDArray[np.float32]  # [B, N]
    window_rows: npt.NDArray[np.int64]  # [B] context rows each lane drafted from
    support_ids: npt.NDArray[np.int32] | None = None  # [B, N, 32] when sampling was given
    proposal_q: npt.NDArray[np.uint32] | None = None  # [B, N, 32]
    logits: npt.NDArray[np.float32] | None = None  # [B, N, Vd] corrected logits (keep_logits)


@dataclass(frozen=True)
class _HostSampling:
    is_sampled: npt.NDArray[np.bool_]
    top_k: npt.NDArray[np.int64]
    temperature: npt.NDArray[np.float64]
    top_p: npt.NDArray[np.float64]
    u: npt.NDArray[np.int64]  # [B, N]


def default_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


class Drafter:
    """A loaded drafter on one device. Not thread-safe: one owner (the runner)."""

    def __init__(self, model: DraftModel, *, drafter_identity: bytes, markov_identity: bytes,
                 source: str, draft_topk: int = 0) -> None:
        self.model = model
        self.config: DrafterConfig = model.config
        self.device: torch.device = model.fc.weight.device
        self.dtype: torch.dtype = model.fc.weight.dtype
        # The candidate walk changes drafts: it enters the Markov identity (CONTRACT 6.4), so
        # an engine that did not ask for it is refused instead of served other drafts.
        self.draft_topk = check_draft_topk(draft_topk, self.config, source)
        self.drafter_identity = drafter_identity
        self.tensors_markov_identity = markov_identity  # of the markov_head tensors alone
        self.markov_identity = markov_walk_identity(markov_identity, self.draft_topk)
        self.source = source
        self.family = family_of(self.config).name  # for logs: "qwen3", "gemma4"
        self.graphs: StepGraphs | None = None  # the bucketed static step (prepare_graphs)

    def with_draft_topk(self, draft_topk: int) -> Drafter:
        """The same model with the candidate walk of ``draft_topk`` candidates (0: off)."""
        return Drafter(self.model, drafter_identity=self.drafter_identity,
                       markov_identity=self.tensors_markov_identity, source=self.source,
                       draft_topk=draft_topk)

    # -- geometry (CONTRACT 6.1) --------------------------------------------------------------
    @property
    def row_bytes(self) -> int:
        return self.config.row_bytes

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def num_spec(self) -> int:
        return self.config.num_spec

    @property
    def n_taps(self) -> int:
        return self.config.n_taps

    @property
    def target_hidden(self) -> int:
        return self.config.target_hidden_size

    @property
    def has_confidence(self) -> bool:
        """Whether the drafter has a confidence head. Without one (a DFlash drafter, a
        speculators checkpoint with ``enable_confidence_head`` false) every confidence is 1.0
        and predicts nothing: the worker says so (``CAP_NO_CONFIDENCE``, contract 6.1)."""
        return self.model.confidence_head is not None

    @property
    def description(self) -> str:
        """The drafter's family and format in words, for logs."""
        fmt = getattr(self.config, "format", None)
        return f"{self.family} family" + (f", {fmt} format" if fmt else "")

    def new_pool(self, capacity_lanes: int, window: int) -> RingPool:
        return RingPool(self.model, capacity_lanes, window)

    # -- drafting -----------------------------------------------------------------------------
    def draft(self, pool: RingPool, lanes: npt.ArrayLike, anchor_pos: npt.ArrayLike,
              anchor_token: npt.ArrayLike, num_spec: int | None = None,
              sampling: SamplingParams | None = None, keep_logits: bool = False) -> DraftResult:
        """Draft N positions for each lane from the rows its window holds that end exactly at
        its anchor (``pool.window_rows``; 0 rows drafts from the block alone).
        ``keep_logits`` also returns the corrected logits z [B, N, V] (tests, diagnostics)."""
        if pool.model is not self.model:
            raise ValueError("the ring pool belongs to another drafter")
        lane_ids = np.asarray(lanes, dtype=np.int64).reshape(-1)
        anchor, token, n = self._check_batch(lane_ids.size, anchor_pos, anchor_token, num_spec)
        rows = pool.window_rows(lane_ids, anchor)  # [B]
        host_sampling = self._host_sampling(sampling, anchor, n)
        b = lane_ids.size
        if b == 0:
            return self._empty(n, sampling is not None)
        ints = [lane_ids, anchor, token, anchor - rows, rows]
        if host_sampling is not None:
            ints += [host_sampling.top_k, host_sampling.is_sampled.astype(np.int64)]
        graphs = self.graphs
        if graphs is not None and not keep_logits and graphs.covers(pool, b, n):
            floats = u = None
            if host_sampling is not None:
                floats = np.stack([host_sampling.temperature, host_sampling.top_p])
                u = host_sampling.u
            with torch.inference_mode():
                return self._download(graphs.run(np.stack(ints), floats, u), rows)
        with torch.inference_mode():
            packed = self._upload(np.stack(ints))  # [5 (+2), B] int64
            lanes_t, anchor_t, token_t, start_t, rows_t = packed[:5]
            context = pool.context(lane_ids, lanes_t, start_t, rows_t)
            dev_sampling = self._device_sampling(host_sampling, packed)
            out = draft_step(self.model, anchor_t, token_t, n, context, dev_sampling,
                             keep_logits, self.draft_topk)
            return self._download(out, rows)

    def prepare_graphs(self, pool: RingPool, largest: int, mode: str = "auto", *,
                       replay: ReplayFactory | None = None,
                       lanes: npt.NDArray[np.int64] | None = None) -> GraphReport:
        """Make the bucketed static step for ``pool`` (buckets up to ``largest`` lanes), check
        it against the eager step (``StepGraphs.self_check``) and draft through it from now on.

        ``mode`` "auto": on CUDA, one captured graph per bucket and sampling mode; elsewhere the
        eager step stays. "off": the eager step. ``replay`` (tests): how each bucket's step is
        run instead of a CUDA graph, on any device. Any exception or difference leaves the
        eager step in place and says why in ``GraphReport.fallback``. The self-check writes
        random ring contents into ``lanes`` (zeroed after; None: every lane, so call it before
        any lane of ``pool`` holds a window).
        """
        if mode not in CUDA_GRAPH_MODES:
            raise ValueError(f"cuda_graphs {mode!r} is not one of {', '.join(CUDA_GRAPH_MODES)}")
        self.graphs = None
        if mode == "off" or (replay is None and self.device.type != "cuda"):
            return GraphReport(0, (), None, 0.0)
        if pool.model is not self.model:
            raise ValueError("the ring pool belongs to another drafter")
        t0 = time.perf_counter()
        factory = replay or _cuda_graph_factory(self.device)
        graphs: StepGraphs | None = None
        try:
            graphs = StepGraphs(self.model, pool, self.num_spec, largest, factory,
                                self.draft_topk)
            problem = graphs.self_check(lanes=lanes)
        except Exception as exc:  # capture can fail in many ways; each one means eager
            problem = f"{type(exc).__name__}: {exc}"
        if graphs is None or problem is not None:
            buckets = () if graphs is None else graphs.buckets
            graphs = None
            if self.device.type == "cuda":
                torch.cuda.empty_cache()  # the captured graphs' memory back to the device
            return GraphReport(0, buckets, problem, time.perf_counter() - t0)
        self.graphs = graphs
        return GraphReport(len(graphs.replays), graphs.buckets, None, time.perf_counter() - t0)

    def reference_draft(self, rows_per_lane: list[npt.NDArray[np.uint8]],
                        anchor_pos: npt.ArrayLike, anchor_token: npt.ArrayLike,
                        num_spec: int | None = None,
                        sampling: SamplingParams | None = None) -> DraftResult:
        """The same drafts computed plainly: each lane alone (B = 1), its rows projected from
        scratch at positions ``[anchor_pos - n, anchor_pos)`` in order, the Markov walk as a
        host loop, sampled positions through ``protocol.sampled`` itself. Slow; for tests."""
        anchor, token, n = self._check_batch(len(rows_per_lane), anchor_pos, anchor_token,
                                             num_spec)
        host_sampling = self._host_sampling(sampling, anchor, n)
        b = len(rows_per_lane)
        if b == 0:
            return self._empty(n, sampling is not None)
        c = self.config
        drafts = np.zeros((b, n), dtype=np.int32)
        confs = np.zeros((b, n), dtype=np.float32)
        margins = np.zeros((b, n), dtype=np.float32)
        support = np.zeros((b, n, MAX_TOP_K), dtype=np.int32)
        qs = np.zeros((b, n, MAX_TOP_K), dtype=np.uint32)
        counts = np.zeros(b, dtype=np.int64)
        model = self.model
        with torch.inference_mode():
            for i, rows in enumerate(rows_per_lane):
                table = np.asarray(rows, dtype=np.uint8).reshape(-1, c.row_bytes)
                r = table.shape[0]
                counts[i] = r
                a = int(anchor[i])
                taps = torch.from_numpy(decode_bf16_rows(table, c.tap_width))  # [r, tap_width]
                positions = torch.arange(a - r, a, dtype=torch.int64)  # [r]
                kv = model.project_context_kv(taps.to(self.device, self.dtype),
                                              positions.to(self.device))  # [planes, L, r, ...]
                k, v = kv[0], kv[-1]  # [L, r, Hkv, D] each (one plane: the same)
                ctx = DenseContext(k.permute(0, 2, 1, 3).unsqueeze(1),  # [L, 1, Hkv, r, D]
                                   v.permute(0, 2, 1, 3).unsqueeze(1),
                                   torch.ones(1, r, dtype=torch.bool, device=self.device))
                lead = c.lead_rows
                block_ids = torch.full((1, lead + n), c.mask_token_id, dtype=torch.int64)
                block_ids[0, 0] = int(token[i])
                block_pos = torch.arange(a, a + lead + n, dtype=torch.int64).unsqueeze(0)
                hf = model.backbone(block_ids.to(self.device), block_pos.to(self.device), ctx)
                logits = model.logits(hf)[0]  # [lead + N, Vd]
                prev = int(token[i])
                state: Tensor | None = None
                head = model.walk_head
                topk = self.draft_topk or model.walk_candidates
                for j in range(lead):  # the rnn state steps through the lead rows
                    if head is not None and head.kind == "rnn":
                        anchor_t = torch.tensor([prev], dtype=torch.int64, device=self.device)
                        state = head.step(anchor_t, hf[:, j], state)[2]
                for j in range(n):
                    hf_j = hf[:, lead + j]  # [1, d]
                    z = logits[lead + j]  # [Vd]
                    e: Tensor | None = None
                    if head is not None:
                        prev_t = torch.tensor([prev], dtype=torch.int64, device=self.device)
                        e, bias, state = head.step(prev_t, hf_j, state)
                    # The candidate walk: the k best base logits, ascending ids, and every
                    # other id -inf (which takes part in nothing below).
                    cand = np.arange(c.draft_vocab)
                    if topk:
                        cand = np.sort(torch.topk(z, topk).indices.cpu().numpy())
                    if e is not None:
                        z = z + bias[0].float()  # [Vd]
                    z_host = z.float().cpu().numpy()[cand]  # [k]
                    if host_sampling is not None and host_sampling.is_sampled[i]:
                        at, q = protocol_sampled.build_q(
                            z_host, int(host_sampling.top_k[i]),
                            float(host_sampling.temperature[i]), float(host_sampling.top_p[i]))
                        ids = np.where(q > 0, cand[at], 0).astype(np.int32)
                        x = int(protocol_sampled.draw(ids, q, host_sampling.u[i, j]))
                        live = q > 0
                        ids[live] = self._target_ids(ids[live].astype(np.int64))
                        support[i, j], qs[i, j] = ids, q
                    else:
                        x = int(cand[np.argmax(z_host)])
                    x = int(self._target_ids(np.array([x]))[0])
                    top2 = np.sort(z_host)[-2:]
                    margins[i, j] = top2[1] - top2[0]
                    confs[i, j] = self._reference_confidence(hf_j, e, j)
                    drafts[i, j] = x
                    prev = x
        return DraftResult(drafts, confs, margins, counts,
                           support if sampling is not None else None,
                           qs if sampling is not None else None)

    def warmup(self, window: int = 16) -> None:
        """One ingest and a greedy and a sampled draft on a scratch pool (kernel selection,
        allocator growth, CUDA context) before the first real STEP."""
        pool = self.new_pool(2, window)
        lanes = pool.allocate(2)
        n_rows = min(window, 4)
        rows = np.zeros((2 * n_rows, self.row_bytes), dtype=np.uint8)
        anchor = np.full(2, n_rows, dtype=np.int64)
        pool.apply(lanes, anchor, np.full(2, n_rows), np.ones(2, dtype=bool), rows)
        token = np.zeros(2, dtype=np.int64)
        self.draft(pool, lanes, anchor, token)
        self.draft(pool, lanes, anchor, token, sampling=SamplingParams(
            top_k=[0, MAX_TOP_K], temperature=[1.0, 1.0], top_p=[0.0, 0.9], seed=[1, 2],
            generation=[0, 0]))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # -- internals ----------------------------------------------------------------------------
    def _check_batch(self, b: int, anchor_pos: npt.ArrayLike, anchor_token: npt.ArrayLike,
                     num_spec: int | None) -> tuple[npt.NDArray[np.int64],
                                                    npt.NDArray[np.int64], int]:
        n = self.num_spec if num_spec is None else int(num_spec)
        if not 1 <= n <= self.num_spec:
            raise ValueError(f"num_spec {n} outside [1, {self.num_spec}]")
        anchor = np.asarray(anchor_pos, dtype=np.int64).reshape(-1)
        token = np.asarray(anchor_token, dtype=np.int64).reshape(-1)
        if anchor.size != b or token.size != b:
            raise ValueError(f"{b} lanes but {anchor.size} anchor_pos and {token.size}"
                             " anchor_token")
        if (anchor < 0).any():
            raise ValueError(f"anchor_pos {int(anchor.min())} is negative")
        bad = (token < 0) | (token >= self.vocab_size)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise ValueError(f"lane {i}: anchor_token {int(token[i])} outside [0, vocab_size"
                             f" {self.vocab_size})")
        return anchor, token, n

    def _host_sampling(self, sampling: SamplingParams | None, anchor: npt.NDArray[np.int64],
                       n: int) -> _HostSampling | None:
        if sampling is None:
            return None
        b = anchor.size
        top_k = np.asarray(sampling.top_k, dtype=np.int64).reshape(-1)
        temperature = np.asarray(sampling.temperature, dtype=np.float32).reshape(-1)
        top_p = np.asarray(sampling.top_p, dtype=np.float32).reshape(-1)
        seed = np.asarray(sampling.seed, dtype=np.uint64).reshape(-1)
        generation = np.asarray(sampling.generation, dtype=np.uint64).reshape(-1)
        for name, arr in (("top_k", top_k), ("temperature", temperature), ("top_p", top_p),
                          ("seed", seed), ("generation", generation)):
            if arr.size != b:
                raise ValueError(f"sampling.{name} has {arr.size} values for {b} lanes")
        is_sampled = top_k > 0
        for i in range(b):
            if not 0 <= top_k[i] <= MAX_TOP_K:
                raise ValueError(f"lane {i}: top_k {int(top_k[i])} outside [0, {MAX_TOP_K}]")
            if not is_sampled[i]:
                continue
            t, p = float(temperature[i]), float(top_p[i])
            if not (math.isfinite(t) and t > 0):
                raise ValueError(f"lane {i}: temperature {t!r} is not a finite positive number")
            if not (math.isfinite(p) and 0.0 <= p <= 1.0):
                raise ValueError(f"lane {i}: top_p {p!r} outside [0, 1]")
        # u depends only on (seed, generation, position of the drafted token): all of it is
        # known before the walk, so it is computed here and uploaded once.
        positions = anchor[:, None] + 1 + np.arange(n)[None, :]  # [B, N]
        u = protocol_sampled.draw_u(seed[:, None], generation[:, None], positions)
        return _HostSampling(
            is_sampled=is_sampled,
            top_k=np.where(is_sampled, top_k, 1),
            temperature=np.where(is_sampled, temperature.astype(np.float64), 1.0),
            top_p=np.where(is_sampled, top_p.astype(np.float64), 0.0),
            u=u.astype(np.int64),
        )

    def _device_sampling(self, host: _HostSampling | None, packed: Tensor
                         ) -> DeviceSampling | None:
        if host is None:
            return None
        floats = self._upload(np.stack([host.temperature, host.top_p]))  # [2, B] float64
        return DeviceSampling(
            is_sampled=packed[6] > 0,
            top_k=packed[5],
            temperature=floats[0],
            top_p=floats[1],
            u=self._upload(host.u),  # [B, N]
        )

    def _upload(self, array: npt.NDArray[np.generic]) -> Tensor:
        host = torch.from_numpy(np.ascontiguousarray(array))
        if self.device.type == "cuda":
            return host.pin_memory().to(self.device, non_blocking=True)
        return host

    def _download(self, out: dict[str, Tensor], rows: npt.NDArray[np.int64]) -> DraftResult:
        if self.device.type == "cuda":
            host = {}
            for name, t in out.items():
                buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                buf.copy_(t, non_blocking=True)
                host[name] = buf
            torch.cuda.current_stream(self.device).synchronize()
        else:
            host = out
        support = host.get("support_ids")
        q = host.get("proposal_q")
        z = host.get("logits")
        return DraftResult(
            draft_ids=host["draft_ids"].numpy().astype(np.int32),
            confidence=host["confidence"].numpy().astype(np.float32, copy=False),
            margin=host["margin"].numpy().astype(np.float32, copy=False),
            window_rows=rows,
            support_ids=None if support is None else support.numpy().astype(np.int32),
            proposal_q=None if q is None else q.numpy().astype(np.uint32),
            logits=None if z is None else z.numpy(),
        )

    def _empty(self, n: int, with_sampling: bool) -> DraftResult:
        return DraftResult(
            draft_ids=np.zeros((0, n), dtype=np.int32),
            confidence=np.zeros((0, n), dtype=np.float32),
            margin=np.zeros((0, n), dtype=np.float32),
            window_rows=np.zeros(0, dtype=np.int64),
            support_ids=np.zeros((0, n, MAX_TOP_K), dtype=np.int32) if with_sampling else None,
            proposal_q=np.zeros((0, n, MAX_TOP_K), dtype=np.uint32) if with_sampling else None,
        )

    def _target_ids(self, ids: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """Host draft ids -> target ids (``DraftModel.target_ids``)."""
        if self.config.draft_vocab == self.config.vocab_size:
            return ids
        t = self.model.target_ids(torch.from_numpy(np.asarray(ids, np.int64)).to(self.device))
        return t.cpu().numpy()

    def _reference_confidence(self, hf_j: Tensor, e: Tensor | None, j: int) -> float:
        head = self.model.confidence_head
        if head is None:
            return 1.0
        feats = hf_j if e is None or not self.config.confidence_head_with_markov else \
            torch.cat([hf_j, e], dim=-1)
        score = float(head.proj(feats).float()[0, 0])
        temp = float(self.model.confidence_temperature[j])
        return 1.0 / (1.0 + math.exp(-score / temp))


def check_draft_topk(k: object, config: DrafterConfig, source: str) -> int:
    """``dspark_draft_topk`` (vLLM's name): 0 or None is the walk over the whole vocabulary;
    else the candidates per position, at least the sampled support's places and at most the
    vocabulary drafts are picked in (``config.draft_vocab``)."""
    if k is None:
        return 0
    own = getattr(config, "selector_top_k", 0)
    if own and k:
        raise DrafterConfigError(
            f"{source}: dspark_draft_topk {k!r} is not supported for this drafter (0 only): its"
            f" candidate selector reranks its own selector_top_k {own} candidates",
            field="dspark_draft_topk", value=k)
    vocab = config.draft_vocab
    name = "vocab_size" if vocab == config.vocab_size else "draft_vocab_size"
    low = min(MAX_TOP_K, vocab)
    if isinstance(k, bool) or not isinstance(k, int) or not (k == 0 or low <= k <= vocab):
        raise DrafterConfigError(
            f"{source}: dspark_draft_topk {k!r} is neither 0 (off) nor a whole number in"
            f" [{low}, {name} {vocab}]", field="dspark_draft_topk", value=k)
    return k


def _cuda_graph_factory(device: torch.device) -> ReplayFactory:
    mempool = torch.cuda.graph_pool_handle()  # one pool for every bucket's graph

    def factory(step: object) -> CudaGraphReplay:
        with torch.cuda.device(device):
            return CudaGraphReplay(step, mempool)  # type: ignore[arg-type]

    return factory


# -- construction ---------------------------------------------------------------------------------


def _resolve(device: str | torch.device, dtype: torch.dtype | None
             ) -> tuple[torch.device, torch.dtype]:
    dev = torch.device(device)
    return dev, dtype if dtype is not None else default_dtype(dev)


@dataclass(frozen=True)
class ReadDrafter:
    """A drafter checkpoint read into host memory, checked and identified, not yet built on a
    device (``build``): a reload compares identities before it spends device memory."""

    loaded: LoadedCheckpoint
    source: str
    draft_topk: int

    @property
    def drafter_identity(self) -> bytes:
        return self.loaded.drafter_identity

    @property
    def markov_identity(self) -> bytes:
        """As the drafter announces it: the candidate walk included (CONTRACT 6.4)."""
        return markov_walk_identity(self.loaded.markov_identity, self.draft_topk)

    def build(self, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
              ) -> Drafter:
        dev, dt = _resolve(device, dtype)
        # the last refusal (CheckpointRefused) before the device is used
        check_device_memory(self.loaded.tensors, dev, dt)
        model = build_model(self.loaded.config, self.loaded.tensors, device=dev, dtype=dt)
        return Drafter(model, drafter_identity=self.loaded.drafter_identity,
                       markov_identity=self.loaded.markov_identity, source=self.source,
                       draft_topk=self.draft_topk)


def read_drafter(checkpoint: str | Path, target_checkpoint: str | Path | None = None, *,
                 record_identities: bool = True, draft_topk: int | None = None,
                 source: str | None = None) -> ReadDrafter:
    """Read and check a DeepSpec checkpoint folder (``load_checkpoint``) and the candidate
    walk's k (None: the checkpoint config's ``dspark_draft_topk``, else off; 0: off)."""
    loaded = load_checkpoint(checkpoint, target_checkpoint, record_identities=record_identities)
    if draft_topk is None:  # from the config read with the weights, not the file read again
        draft_topk = loaded.config_json.get("dspark_draft_topk")
    # the folder read, not its name: ``current -> v7`` switched since still reads v7
    src = str(loaded.folder or checkpoint) if source is None else source
    return ReadDrafter(loaded, src, check_draft_topk(draft_topk or 0, loaded.config, src))


def load_drafter(checkpoint: str | Path | None, target_checkpoint: str | Path | None = None,
                 device: str | torch.device = "cpu", dtype: torch.dtype | None = None, *,
                 record_identities: bool = True, draft_topk: int | None = None) -> Drafter:
    """A drafter from a DeepSpec checkpoint folder, or the embedded default when
    ``checkpoint`` is None. dtype defaults to bf16 on CUDA and fp32 on the CPU.
    ``record_identities``: see ``load_checkpoint``. ``draft_topk``: the candidate walk's k
    (None: the checkpoint config's ``dspark_draft_topk``, else off; 0: off)."""
    if checkpoint is None:
        drafter = embedded_default(device=device, dtype=dtype)
        return drafter.with_draft_topk(draft_topk) if draft_topk else drafter
    return read_drafter(checkpoint, target_checkpoint, record_identities=record_identities,
                        draft_topk=draft_topk).build(device, dtype)


def from_tensors(config: DrafterConfig, tensors: dict[str, torch.Tensor], *,
                 device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                 source: str = "in-memory", config_json: Mapping[str, Any] | None = None
                 ) -> Drafter:
    """A drafter over in-memory tensors (checkpoint layout); identities from their bytes and
    ``config_json``, the config.json object it stands for (None: the one ``save_checkpoint``
    writes for ``config``)."""
    dev, dt = _resolve(device, dtype)
    drafter_id, markov_id = identities_from_arrays(
        tensor_records(tensors), config.to_json_dict() if config_json is None else config_json)
    tensors = family_of(config).model_tensors(config, dict(tensors), source)
    model = build_model(config, tensors, device=dev, dtype=dt)
    return Drafter(model, drafter_identity=drafter_id, markov_identity=markov_id, source=source)


def embedded_default(device: str | torch.device = "cpu",
                     dtype: torch.dtype | None = None) -> Drafter:
    """The drafter the worker serves with no checkpoint: the reference drafter shipped in
    ``reference/`` (trained against the reference target of ``dspark_client.demo``, see
    ``tools/train_reference_pair.py``). Its identities are those of the shipped files."""
    if not (REFERENCE_DIR / "config.json").is_file():
        log.warning("the reference drafter is missing from %s (a stripped install?); serving"
                    " random weights instead", REFERENCE_DIR)
        return random_default(device=device, dtype=dtype)
    # The package's own folder: nothing is written into an installation.
    drafter = load_drafter(REFERENCE_DIR, device=device, dtype=dtype, record_identities=False)
    drafter.source = "embedded"
    return drafter


def random_default(device: str | torch.device = "cpu",
                   dtype: torch.dtype | None = None) -> Drafter:
    """A tiny drafter with random weights from a fixed seed (``EMBEDDED_CONFIG``): the same bytes,
    and so the same identities, on every machine. Its identities are those of its fp32 tensors,
    as ``save_checkpoint`` writes them."""
    return from_tensors(EMBEDDED_CONFIG, random_tensors(EMBEDDED_CONFIG, EMBEDDED_SEED),
                        device=device, dtype=dtype, source="random")


def embedded_identities() -> tuple[bytes, bytes]:
    """(drafter_identity, markov_identity) of the embedded default, from its files."""
    if not (REFERENCE_DIR / "config.json").is_file():
        return random_identities()
    return identities_from_checkpoint(REFERENCE_DIR, use_identity_file=False)


def random_identities() -> tuple[bytes, bytes]:
    """(drafter_identity, markov_identity) of ``random_default``, without building a model."""
    tensors = random_tensors(EMBEDDED_CONFIG, EMBEDDED_SEED)
    return identities_from_arrays(tensor_records(tensors), EMBEDDED_CONFIG.to_json_dict())
