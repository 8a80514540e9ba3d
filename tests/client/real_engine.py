"""A stand-in for an engine's rank 0 against the real worker (tiny embedded drafter): real bf16
tap rows per (slot, generation, position), slots admitted with prompts, rounds that accept a
varying number of drafts, and the reference check: every usable draft must equal the in-process
reference drafter run from scratch on the same newest rows (``Drafter.reference_draft``).

Imports torch and the worker's drafter: tests only, never the client package.
"""

from __future__ import annotations

import socket
from typing import Any

import numpy as np

from dspark_client.rounds import DraftRounds, RoundResult, SlotRequest
from protocol import wire

TOP_K, TEMPERATURE, TOP_P = 8, 0.9, 0.95
Q_TOLERANCE = 256  # units of 2**-24 (1.5e-5): float rounding, not a different distribution


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = int(s.getsockname()[1])
    s.close()
    return port


def hello_for(drafter: Any, *, window: int, max_slots: int, sampled: bool = False,
              max_rows_per_step: int = 1024, client_name: str = "test-engine") -> wire.Hello:
    return wire.Hello(sample_mode=wire.SAMPLE_TOP32 if sampled else wire.SAMPLE_GREEDY,
                      window=window, num_spec=drafter.num_spec, max_slots=max_slots,
                      max_rows_per_step=max_rows_per_step, row_bytes=drafter.row_bytes,
                      vocab_size=drafter.vocab_size, n_taps=drafter.n_taps,
                      hidden=drafter.target_hidden, drafter_identity=drafter.drafter_identity,
                      markov_identity=drafter.markov_identity, client_name=client_name)


class RealEngine:
    def __init__(self, rounds: DraftRounds, drafter: Any, *, seed: int = 0,
                 sampled: bool = False) -> None:
        from dspark_worker.drafter import encode_bf16_rows  # torch: tests only

        self._encode = encode_bf16_rows
        self.rounds = rounds
        self.drafter = drafter
        self.sampled = sampled
        self.rng = np.random.default_rng(seed)
        self.W, self.N = rounds.window, rounds.num_spec
        self.tap_width = drafter.row_bytes // 2
        self.gen: dict[int, int] = {}
        self.history: dict[int, np.ndarray] = {}  # committed rows, positions [0, anchor)
        self.anchor_token: dict[int, int] = {}
        self.fresh: dict[int, int] = {}
        self.checked = 0  # drafted positions compared with the reference

    # -- engine state ----------------------------------------------------------------------------
    def _new_rows(self, n: int) -> np.ndarray:
        vals = self.rng.uniform(-2.0, 2.0, size=(n, self.tap_width)).astype(np.float32)
        return np.asarray(self._encode(vals))

    def admit(self, slot: int, prompt: int) -> None:
        self.gen[slot] = self.gen.get(slot, 0) + 1
        self.history[slot] = self._new_rows(prompt)
        self.anchor_token[slot] = int(self.rng.integers(0, self.drafter.vocab_size - 1))
        self.fresh[slot] = prompt

    def accept(self, slot: int, k: int) -> None:
        self.history[slot] = np.concatenate([self.history[slot], self._new_rows(k + 1)])
        self.anchor_token[slot] = int(self.rng.integers(0, self.drafter.vocab_size - 1))
        self.fresh[slot] = k + 1

    def anchor(self, slot: int) -> int:
        return int(self.history[slot].shape[0])

    def sampling_of(self, slot: int) -> dict[str, Any]:
        if not self.sampled or slot % 2:  # odd slots draft greedily in a sampled session
            return {}
        return dict(seed=1000 + slot, top_k=TOP_K, temperature=TEMPERATURE, top_p=TOP_P)

    def request(self, slot: int, n_out: int | None = None) -> SlotRequest:
        a, n = self.anchor(slot), self.fresh[slot]
        self.fresh[slot] = 0
        return SlotRequest(slot=slot, generation=self.gen[slot], anchor_pos=a,
                           anchor_token=self.anchor_token[slot],
                           rows=self.history[slot][a - n:a], n_out=self.N if n_out is None
                           else n_out, **self.sampling_of(slot))

    def run(self, slots: list[int], release: tuple[int, ...] = (),
            n_out: dict[int, int] | None = None) -> tuple[list[SlotRequest], RoundResult]:
        reqs = [self.request(s, None if n_out is None else n_out.get(s)) for s in slots]
        return reqs, self.rounds.run(reqs, release=release)

    # -- the reference ----------------------------------------------------------------------------
    def check(self, reqs: list[SlotRequest], res: RoundResult) -> None:
        """Every usable draft equals the reference drafter's on the newest min(W, anchor)
        rows; the confidences agree to float tolerance; sampled q are identical."""
        from dspark_worker.drafter import SamplingParams

        lanes = [i for i, _ in enumerate(reqs) if res.num_drafted[i] > 0]
        if not lanes:
            return
        rows = [self.history[reqs[i].slot][max(0, reqs[i].anchor_pos - self.W):
                                           reqs[i].anchor_pos] for i in lanes]
        sampling = None
        if self.sampled:
            sampling = SamplingParams(
                top_k=[reqs[i].top_k for i in lanes],
                temperature=[reqs[i].temperature for i in lanes],
                top_p=[reqs[i].top_p for i in lanes], seed=[reqs[i].seed for i in lanes],
                generation=[reqs[i].generation & wire.U32_MASK for i in lanes])
        ref = self.drafter.reference_draft(rows, [reqs[i].anchor_pos for i in lanes],
                                           [reqs[i].anchor_token for i in lanes],
                                           sampling=sampling)
        for li, i in enumerate(lanes):
            k = int(res.num_drafted[i])
            assert k == min(reqs[i].n_out or self.N, self.N)
            got = res.draft_ids[i, :k].tolist()
            want = ref.draft_ids[li, :k].tolist()
            assert got == want, (f"slot {reqs[i].slot} anchor {reqs[i].anchor_pos}: drafts"
                                 f" {got} != reference {want}")
            assert np.allclose(res.confidence[i, :k], ref.confidence[li, :k], atol=1e-4)
            if self.sampled and reqs[i].top_k:
                assert res.support_ids is not None and res.proposal_q is not None
                assert ref.support_ids is not None and ref.proposal_q is not None
                assert np.array_equal(res.support_ids[i, :k], ref.support_ids[li, :k])
                # The worker's softmax runs batched on the device, the reference's in float64
                # on the host: q may differ by a few units of 2**-24 (both sum to 2**24).
                diff = np.abs(res.proposal_q[i, :k].astype(np.int64)
                              - ref.proposal_q[li, :k].astype(np.int64))
                assert int(diff.max()) <= Q_TOLERANCE, f"q differs by {int(diff.max())} units"
            self.checked += k
