"""Speculative decoding end to end: the reference target verifies what a draft source proposes.

This is what an engine does around ``DraftRounds``, written small enough to read: per sequence,
prefill the prompt (its tap rows go to the drafter in the first round), then rounds of
draft -> verify -> commit:

* the anchor is the newest committed token, not yet run by the target (``anchor_pos`` its
  position); the rows sent are those of positions the drafter has not seen;
* the target runs ``[anchor, d_1 .. d_k]`` in one forward over its KV cache;
* greedy: accept drafts while each equals the target's argmax, then the target's own token
  (the bonus); the output is exactly target-only greedy decoding;
* sampled: exact rejection sampling with the proposal q the worker sent (dyadic24, section 9):
  accept ``d`` with probability ``min(1, p(d) / q(d))``, on a rejection draw from
  ``max(p - q, 0)`` renormalised, and after k acceptances draw the bonus from ``p``. The tokens
  are distributed exactly as the target's own sampling at that temperature;
* the rows of the anchor and of the accepted drafts are committed; the cache is cut back to them.

A failed round (no drafts) is a target-only step. ``DraftSource`` is anything with
``round(requests) -> RoundResult`` and ``release(slots)``: ``RemoteDrafts`` wraps
``DraftRounds`` (the worker over the wire); tests wrap the drafter in-process the same way.
The sequences here are objects, one per request, each with its own rows, so the round is
handed over as one ``SlotRequest`` per sequence (``DraftRounds.run``); an engine whose batch
is arrays calls ``DraftRounds.run_batch`` with them instead (the same STEPs).

Importing this module imports torch.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
import torch

from protocol.constants import Q_TOTAL

from ..rounds import DraftRounds, RoundResult, SlotRequest
from ..schedule import SpsTable, schedule_greedy
from .target import EOS, KVCache, TargetModel, taps_to_rows


class DraftSource(Protocol):
    num_spec: int
    window: int
    sampled: bool

    def round(self, requests: Sequence[SlotRequest]) -> RoundResult: ...

    def release(self, slots: Sequence[int]) -> None: ...


class RemoteDrafts:
    """Drafts from a worker through ``DraftRounds``."""

    def __init__(self, rounds: DraftRounds) -> None:
        self.rounds = rounds
        self.num_spec = rounds.num_spec
        self.window = rounds.window
        self.sampled = rounds.sampled
        self._release: list[int] = []

    def round(self, requests: Sequence[SlotRequest]) -> RoundResult:
        release, self._release = self._release, []
        return self.rounds.run(requests, release=release)

    def release(self, slots: Sequence[int]) -> None:
        self._release.extend(slots)


@dataclass
class DecodeSeq:
    slot: int
    generation: int
    tokens: list[int]
    prompt_len: int
    cache: KVCache
    rows: npt.NDArray[np.uint8]  # [capacity, row_bytes]: committed tap rows by position
    rows_sent: int = 0  # positions [0, rows_sent) were handed to the draft source
    seed: int = 0
    done: bool = False
    rng: np.random.Generator = field(default_factory=lambda: np.random.default_rng(0))

    @property
    def anchor_pos(self) -> int:
        return len(self.tokens) - 1

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len:]


@dataclass
class DecodeStats:
    num_spec: int
    rounds: int = 0
    failed_rounds: int = 0
    tokens: int = 0  # committed by verify rounds (accepted drafts + bonus)
    verify_rounds: int = 0  # per-sequence verify steps
    offered: npt.NDArray[np.int64] = field(init=False)  # drafts offered at position j
    accepted: npt.NDArray[np.int64] = field(init=False)  # drafts accepted at position j
    accept_lengths: list[int] = field(default_factory=list)  # per verify step, bonus included
    rtt_us: list[float] = field(default_factory=list)
    seconds: float = 0.0

    def __post_init__(self) -> None:
        self.offered = np.zeros(self.num_spec, np.int64)
        self.accepted = np.zeros(self.num_spec, np.int64)

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verify round, the bonus token included."""
        return float(np.mean(self.accept_lengths)) if self.accept_lengths else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        return [float(a / o) if o else 0.0 for a, o in zip(self.accepted, self.offered,
                                                            strict=True)]

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


class SpeculativeDecoder:
    """Decode a batch of prompts with a target and a draft source (``source=None``: target-only).

    temperature 0: greedy; > 0: sampled, which needs a sampled draft source (or none).
    depth: ``None`` verifies every draft offered; with an ``SpsTable`` the confidences of the
    round pick how many drafts of each sequence the target verifies (the paper's Algorithm 1,
    ``schedule_greedy``)."""

    def __init__(self, target: TargetModel, source: DraftSource | None, *,
                 temperature: float = 0.0, top_k: int = 32, seed: int = 0,
                 depth: SpsTable | None = None, max_len: int = 4096,
                 stop_at_eos: bool = True) -> None:
        if temperature < 0:
            raise ValueError(f"temperature {temperature} is negative")
        if source is not None and temperature > 0 and not source.sampled:
            raise ValueError("sampled decoding needs a sampled draft session (SAMPLE_TOP32)")
        self.target = target
        self.source = source
        self.temperature = temperature
        self.top_k = top_k
        self.seed = seed
        self.depth = depth
        self.max_len = max_len
        self.stop_at_eos = stop_at_eos
        self.num_spec = source.num_spec if source is not None else 0
        self.stats = DecodeStats(max(self.num_spec, 1))
        self._generation: dict[int, int] = {}
        # generate's finished sequences whose closing entry goes with the next round, and the
        # slots closed in the last round, released with the next (``_closing_requests``).
        self._closing: list[DecodeSeq] = []
        self._to_release: list[int] = []

    # -- setup -------------------------------------------------------------------------------
    @torch.no_grad()
    def start(self, slot: int, prompt: Sequence[int], seed: int | None = None) -> DecodeSeq:
        if len(prompt) < 1:
            raise ValueError("a prompt needs at least one token")
        gen = self._generation.get(slot, 0) + 1
        self._generation[slot] = gen
        cache = self.target.new_cache(1, self.max_len)
        row_bytes = self.target.config.row_bytes
        seq = DecodeSeq(slot=slot, generation=gen, tokens=list(prompt), prompt_len=len(prompt),
                        cache=cache, rows=np.zeros((self.max_len, row_bytes), np.uint8),
                        seed=self.seed if seed is None else seed)
        seq.rng = np.random.default_rng([seq.seed, gen, slot])
        if len(prompt) > 1:  # every token but the anchor goes through the target now
            ids = torch.tensor([list(prompt[:-1])], dtype=torch.long)
            _, taps = self.target(ids, cache)
            seq.rows[:len(prompt) - 1] = taps_to_rows(taps[0]).numpy()
        return seq

    # -- one round -----------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, live: Sequence[DecodeSeq]) -> None:
        """One round for every live sequence: draft (if a source), verify, commit."""
        res: RoundResult | None = None
        if self.source is not None:
            reqs = []
            for s in live:
                rows = s.rows[s.rows_sent:s.anchor_pos]
                sampled = self.temperature > 0
                reqs.append(SlotRequest(
                    slot=s.slot, generation=s.generation, anchor_pos=s.anchor_pos,
                    anchor_token=s.tokens[-1], rows=rows, n_out=self.num_spec,
                    seed=(s.seed if sampled else 0), top_k=(self.top_k if sampled else 0),
                    temperature=(self.temperature if sampled else 0.0),
                    top_p=0.0))
            res = self.source.round(reqs + self._closing_requests())
            for s in live:
                s.rows_sent = s.anchor_pos
            self.stats.rounds += 1
            if not res.ok:
                self.stats.failed_rounds += 1
            elif res.rtt_us:
                self.stats.rtt_us.append(res.rtt_us)
        lengths = None
        if res is not None and res.ok and self.depth is not None:
            # Confidence-scheduled verification (Algorithm 1): how many of the drafts to verify.
            # (A drafter without a confidence head: a static length, every draft offered.)
            conf = res.confidence if res.has_confidence else None
            lengths = schedule_greedy(conf, self.depth, res.num_drafted).lengths
        for i, s in enumerate(live):
            k = int(res.num_drafted[i]) if res is not None else 0
            if lengths is not None:
                k = min(k, int(lengths[i]))
            drafts = res.draft_ids[i, :k].tolist() if res is not None else []
            q = None
            if res is not None and k and self.temperature > 0:
                assert res.support_ids is not None and res.proposal_q is not None
                q = (res.support_ids[i, :k].copy(), res.proposal_q[i, :k].copy())
            self._verify(s, drafts, q)

    def _verify(self, s: DecodeSeq, drafts: list[int],
                q: tuple[npt.NDArray[np.int32], npt.NDArray[np.uint32]] | None) -> None:
        pos = s.anchor_pos
        ids = torch.tensor([[s.tokens[-1], *drafts]], dtype=torch.long)
        logits, taps = self.target(ids, s.cache)  # [1, k+1, V], [1, k+1, n_taps*d]
        logits = logits[0].double()  # [k+1, V]
        k = len(drafts)
        accepted: list[int] = []
        if self.temperature == 0:
            target_ids = logits.argmax(-1).tolist()
            for j, d in enumerate(drafts):
                if d != target_ids[j]:
                    break
                accepted.append(d)
            bonus = target_ids[len(accepted)]
        else:
            probs = torch.softmax(logits / self.temperature, dim=-1).numpy()  # [k+1, V]
            bonus = -1
            for j, d in enumerate(drafts):
                assert q is not None
                sup, qq = q[0][j], q[1][j].astype(np.float64) / Q_TOTAL
                q_full = np.zeros(probs.shape[1])
                q_full[sup[qq > 0]] = qq[qq > 0]
                p = probs[j]
                if s.rng.random() < min(1.0, p[d] / q_full[d]):
                    accepted.append(d)
                    continue
                resid = np.maximum(p - q_full, 0.0)
                total = resid.sum()
                bonus = int(s.rng.choice(p.size, p=resid / total)) if total > 0 else \
                    int(s.rng.choice(p.size, p=p))
                break
            if bonus < 0:
                bonus = int(s.rng.choice(probs.shape[1], p=probs[len(accepted)]))
        a = len(accepted)
        self.stats.offered[:k] += 1
        self.stats.accepted[:a] += 1
        s.rows[pos:pos + a + 1] = taps_to_rows(taps[0, :a + 1]).numpy()
        s.cache.truncate(pos + a + 1)
        s.tokens.extend(accepted)
        s.tokens.append(bonus)
        self.stats.tokens += a + 1
        self.stats.verify_rounds += 1
        if k:
            self.stats.accept_lengths.append(a + 1)

    def _closing_requests(self) -> list[SlotRequest]:
        """An entry for each sequence that finished in the last round: the rows and the anchor
        its last verify committed, no draft asked for. The worker learns what was accepted of
        a block from the entry after it, so without these its acceptance figures would lack
        every sequence's last block and differ from this decoder's. They go with the next
        round, beside the live sequences (a STEP without a live slot would leave that slot's
        block unjudged), or in a round of their own at the end; the slots go back after."""
        closing, self._closing = self._closing, []
        for s in closing:
            self._to_release.append(s.slot)
        reqs = [SlotRequest(slot=s.slot, generation=s.generation, anchor_pos=s.anchor_pos,
                            anchor_token=s.tokens[-1], rows=s.rows[s.rows_sent:s.anchor_pos],
                            n_out=0) for s in closing]
        for s in closing:
            s.rows_sent = s.anchor_pos
        return reqs

    # -- whole runs ------------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                 seeds: Sequence[int] | None = None,
                 on_token: Any = None) -> list[list[int]]:
        """Generate for each prompt (one slot each); return the generated ids per prompt."""
        seqs = [self.start(i, p, None if seeds is None else seeds[i])
                for i, p in enumerate(prompts)]
        t0 = time.perf_counter()
        live = list(seqs)
        while live:
            before = [len(s.tokens) for s in live]
            self.step(live)
            still = []
            for s, n0 in zip(live, before, strict=True):
                if on_token is not None:
                    on_token(s, s.tokens[n0:])
                over = len(s.generated) >= max_new_tokens
                eos = self.stop_at_eos and EOS in s.tokens[n0:]
                if over or eos or len(s.tokens) + self.num_spec + 2 >= self.max_len:
                    s.done = True
                else:
                    still.append(s)
            if self.source is not None:
                if self._to_release:  # closed in this round: their slots go in the next
                    self.source.release(self._to_release)
                    self._to_release = []
                self._closing.extend(s for s in live if s.done)
            live = still
        if self.source is not None and self._closing:
            self.source.round(self._closing_requests())  # not counted among the rounds
            self.source.release(self._to_release)
            self._to_release = []
        self.stats.seconds += time.perf_counter() - t0
        return [s.generated[:max_new_tokens] for s in seqs]


def target_only_greedy(target: TargetModel, prompt: Sequence[int], max_new_tokens: int,
                       max_len: int = 4096) -> list[int]:
    """The reference output: plain greedy decoding with the target alone."""
    dec = SpeculativeDecoder(target, None, max_len=max_len, stop_at_eos=False)
    return dec.generate([prompt], max_new_tokens)[0]


def sps_table_model(step_ms: float = 20.0, ms_per_token: float = 0.25,
                    max_tokens: int = 4096) -> SpsTable:
    """A target whose step costs ``step_ms`` plus ``ms_per_token`` per verified token (a
    memory-bound step that slowly turns compute-bound): the trade-off Algorithm 1 weighs."""
    tokens = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, max_tokens]
    return SpsTable(tokens, [1000.0 / (step_ms + ms_per_token * b) for b in tokens])
