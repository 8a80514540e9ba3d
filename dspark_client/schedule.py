"""Confidence-scheduled verification length (the DSpark paper's Algorithm 1, and the variant
its production deployment runs). Pure functions over numpy arrays: no clocks, no I/O besides
reading an SPS table file.

Terms. For request r the drafter's confidence ``c[r, j]`` is the probability that draft j is
accepted given drafts ``0..j-1`` were. Its prefix survival ``s[r, j] = c[r, 0] * ... * c[r, j]``
is the probability that draft j is accepted. Verifying ``L_r`` drafts of every request costs a
target step of ``B = R + sum L_r`` tokens (each request also verifies its bonus token) and
gains ``tau = R + sum_r sum_{j < L_r} s[r, j]`` expected tokens. ``SPS(B)``, target steps per
second at B tokens, comes from a measured table. The scheduler maximises expected tokens per
second ``tau * SPS(B)``.

* ``schedule_greedy`` (Algorithm 1): all (r, j) candidates sorted by survival, descending;
  admit them in that order while ``tau * SPS(B)`` rises, stop at the first candidate that does
  not raise it (a tie is not a rise: verifying a token that adds nothing is not free).
* ``schedule_global`` (production): the same order, but the admitted count is the global argmax
  of ``tau * SPS(B)`` over every prefix of it (ties to the smaller B), so a local dip in a
  measured table does not stop admission early. Production feeds it the confidences of two
  steps earlier (``ConfidenceHistory``), because the target's batch for step t is laid out
  before step t's drafts exist.

Sorting by survival admits drafts of a request in order (survival never rises along j, and the
sort is stable), so the admitted candidates of each request form a prefix: ``L_r`` is a count.
B never exceeds the table's largest ``batch_tokens``: beyond the measured range the cost is
unknown, and engines cap tokens per step anyway.

A drafter without a confidence head (``RoundResult.has_confidence`` / ``client.has_confidence``
False: a DFlash drafter) gives confidences that predict nothing: pass ``confidence=None`` and
both schedulers fall back to ``schedule_static``, a static length (every drafted position, or
``static_length``), as engines verify such drafters; its expected tokens are unknown (NaN).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt

__all__ = [
    "ConfidenceHistory",
    "Schedule",
    "SpsTable",
    "expected_tokens_per_s",
    "schedule_global",
    "schedule_greedy",
    "schedule_static",
    "survival",
]

FloatArray = npt.NDArray[np.float64]


class SpsTable:
    """Target steps per second against tokens per step, interpolated linearly between measured
    points and held constant below the first one. JSON: ``{"batch_tokens": [...],
    "steps_per_s": [...]}`` with batch_tokens strictly rising integers >= 1 and steps_per_s
    finite and > 0."""

    __slots__ = ("batch_tokens", "steps_per_s")

    def __init__(self, batch_tokens: Sequence[float], steps_per_s: Sequence[float]) -> None:
        b = np.asarray(batch_tokens, dtype=np.float64)
        v = np.asarray(steps_per_s, dtype=np.float64)
        if b.ndim != 1 or v.ndim != 1 or b.size == 0:
            raise ValueError(f"SPS table: batch_tokens and steps_per_s must be non-empty lists,"
                             f" got shapes {b.shape} and {v.shape}")
        if b.size != v.size:
            raise ValueError(f"SPS table: {b.size} batch_tokens but {v.size} steps_per_s")
        bad = np.flatnonzero(~np.isfinite(b) | (b < 1) | (b != np.floor(b)))
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"SPS table: batch_tokens[{i}] = {float(b[i])!r} is not an integer"
                             " >= 1")
        bad = np.flatnonzero(np.diff(b) <= 0)
        if bad.size:
            i = int(bad[0]) + 1
            raise ValueError(f"SPS table: batch_tokens[{i}] = {b[i]:g} does not rise above"
                             f" batch_tokens[{i - 1}] = {b[i - 1]:g}")
        bad = np.flatnonzero(~np.isfinite(v) | (v <= 0))
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"SPS table: steps_per_s[{i}] = {float(v[i])!r} is not a finite number"
                             " > 0")
        self.batch_tokens = b
        self.steps_per_s = v

    @property
    def max_batch_tokens(self) -> int:
        return int(self.batch_tokens[-1])

    def __call__(self, batch_tokens: Any) -> Any:
        """SPS at ``batch_tokens`` (a number or an array)."""
        return np.interp(batch_tokens, self.batch_tokens, self.steps_per_s)

    @classmethod
    def from_dict(cls, raw: Any, source: str = "SPS table") -> SpsTable:
        if not isinstance(raw, dict):
            raise ValueError(f"{source}: expected a JSON object, got {type(raw).__name__}")
        missing = [k for k in ("batch_tokens", "steps_per_s") if k not in raw]
        if missing:
            raise ValueError(f"{source}: missing {', '.join(missing)}")
        for key in ("batch_tokens", "steps_per_s"):
            value = raw[key]
            if not isinstance(value, list) or not all(
                    isinstance(x, (int, float)) and not isinstance(x, bool) for x in value):
                raise ValueError(f"{source}: {key} must be a list of numbers, got {value!r:.80}")
        try:
            return cls(raw["batch_tokens"], raw["steps_per_s"])
        except ValueError as exc:
            raise ValueError(f"{source}: {str(exc).removeprefix('SPS table: ')}") from None

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> SpsTable:
        try:
            with open(path, "rb") as f:
                raw = json.loads(f.read())
        except (OSError, ValueError) as exc:
            raise ValueError(f"SPS table {os.fspath(path)!r}: {exc}") from None
        return cls.from_dict(raw, source=f"SPS table {os.fspath(path)!r}")

    def __repr__(self) -> str:
        return (f"SpsTable(batch_tokens={self.batch_tokens.tolist()},"
                f" steps_per_s={self.steps_per_s.tolist()})")


class Schedule(msgspec.Struct, frozen=True):
    """lengths[r]: drafts of request r to verify. batch_tokens: ``R + sum(lengths)``.
    expected_tokens: tau. score: ``tau * SPS(batch_tokens)``, expected tokens per second."""

    lengths: npt.NDArray[np.int64]
    batch_tokens: int
    expected_tokens: float
    score: float


def survival(confidence: Any, num_drafted: Any = None) -> FloatArray:
    """Prefix survival ``[R, N]``: the cumulative product of confidences along each row, 0 at
    positions ``j >= num_drafted[r]``. Refuses confidences outside [0, 1] (NaN included)."""
    c = np.asarray(confidence, dtype=np.float64)
    if c.ndim != 2:
        raise ValueError(f"confidence must be [requests, positions], got shape {c.shape}")
    ok = (c >= 0.0) & (c <= 1.0)
    if not ok.all():
        r, j = (int(x) for x in np.argwhere(~ok)[0])
        raise ValueError(f"confidence[{r}, {j}] = {float(c[r, j])!r} is not a probability")
    s = np.cumprod(c, axis=1)
    if num_drafted is not None:
        k = np.asarray(num_drafted, dtype=np.int64)
        if k.shape != (c.shape[0],):
            raise ValueError(f"num_drafted has shape {k.shape}, expected ({c.shape[0]},)")
        if (k < 0).any() or (k > c.shape[1]).any():
            raise ValueError(f"num_drafted must lie in [0, {c.shape[1]}], got {k.tolist()}")
        s = np.where(np.arange(c.shape[1])[None, :] < k[:, None], s, 0.0)
    return np.asarray(s, dtype=np.float64)


def _candidates(s: FloatArray) -> tuple[npt.NDArray[np.int64], FloatArray]:
    """Request index and survival of every candidate with survival > 0, in admission order:
    survival descending; ties by request, then position (a stable sort of the row-major
    flattening)."""
    flat = s.reshape(-1)
    order = np.argsort(-flat, kind="stable")
    order = order[flat[order] > 0.0]
    return order // s.shape[1], flat[order]


def _scores(R: int, surv_sorted: FloatArray, sps: SpsTable) -> tuple[FloatArray, FloatArray]:
    """tau and tau * SPS(B) for admitting the first m candidates, m = 0..M (B <= the table's
    largest batch)."""
    m_max = min(surv_sorted.size, max(sps.max_batch_tokens - R, 0))
    tau = R + np.concatenate(([0.0], np.cumsum(surv_sorted[:m_max])))
    batch = R + np.arange(m_max + 1, dtype=np.float64)
    return tau, tau * sps(batch)


def _build(R: int, N: int, req: npt.NDArray[np.int64], m: int, tau: FloatArray,
           score: FloatArray) -> Schedule:
    lengths = np.bincount(req[:m], minlength=R).astype(np.int64)
    return Schedule(lengths=lengths, batch_tokens=R + m, expected_tokens=float(tau[m]),
                    score=float(score[m]))


def _empty(R: int, sps: SpsTable) -> Schedule:
    return Schedule(lengths=np.zeros(R, np.int64), batch_tokens=R, expected_tokens=float(R),
                    score=float(R * sps(R)) if R else 0.0)


def schedule_static(num_drafted: Any, sps: SpsTable | None = None,
                    static_length: int | None = None) -> Schedule:
    """The static length, for drafts without confidences: request r verifies
    ``min(num_drafted[r], static_length)`` drafts (every drafted one by default), admitted
    position by position across the requests while B stays within ``sps``'s largest
    ``batch_tokens``. ``expected_tokens`` and ``score`` are NaN: nothing predicts them."""
    k = np.asarray(num_drafted, dtype=np.int64)
    if k.ndim != 1 or (k < 0).any():
        raise ValueError(f"num_drafted must be counts >= 0 per request, got {k.tolist()!r}")
    if static_length is not None and (isinstance(static_length, bool)
                                      or not isinstance(static_length, int)
                                      or static_length < 0):
        raise ValueError(f"static_length {static_length!r} is not a count >= 0")
    lengths = k if static_length is None else np.minimum(k, static_length)
    R = lengths.size
    if sps is not None:
        room = max(sps.max_batch_tokens - R, 0)
        if int(lengths.sum()) > room:
            # position-major: every request's draft 0, then every draft 1, ... up to the room
            # each draft's position in its request: 0..lengths[r]-1, request after request
            pos = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
            order = np.argsort(pos, kind="stable")
            req = np.repeat(np.arange(R), lengths)[order[:room]]
            lengths = np.bincount(req, minlength=R)
    lengths = lengths.astype(np.int64)
    return Schedule(lengths=lengths, batch_tokens=R + int(lengths.sum()),
                    expected_tokens=math.nan, score=math.nan)


def schedule_greedy(confidence: Any, sps: SpsTable, num_drafted: Any = None, *,
                    static_length: int | None = None) -> Schedule:
    """Algorithm 1: admit candidates by survival while ``tau * SPS(B)`` rises; stop at the
    first that does not raise it. ``confidence`` None (a drafter without a confidence head):
    ``schedule_static(num_drafted, sps, static_length)``."""
    if confidence is None:
        return _static(num_drafted, sps, static_length)
    s = survival(confidence, num_drafted)
    R, N = s.shape
    if R == 0 or N == 0 or sps.max_batch_tokens < R:
        return _empty(R, sps)
    req, surv = _candidates(s)
    tau, score = _scores(R, surv, sps)
    rises = score[1:] > score[:-1]
    m = int(np.argmin(rises)) if not rises.all() else rises.size
    return _build(R, N, req, m, tau, score)


def schedule_global(confidence: Any, sps: SpsTable, num_drafted: Any = None, *,
                    static_length: int | None = None) -> Schedule:
    """The production variant: the admitted count maximises ``tau * SPS(B)`` over every prefix
    of the survival order (the smallest B among equal maxima). Pass it the confidences of two
    steps earlier (``ConfidenceHistory.lagged``) when the batch must be laid out before the
    current drafts exist. ``confidence`` None: ``schedule_static``, as for ``schedule_greedy``."""
    if confidence is None:
        return _static(num_drafted, sps, static_length)
    s = survival(confidence, num_drafted)
    R, N = s.shape
    if R == 0 or N == 0 or sps.max_batch_tokens < R:
        return _empty(R, sps)
    req, surv = _candidates(s)
    tau, score = _scores(R, surv, sps)
    m = int(np.argmax(score))  # first maximum: the smallest B
    return _build(R, N, req, m, tau, score)


def _static(num_drafted: Any, sps: SpsTable, static_length: int | None) -> Schedule:
    if num_drafted is None:
        raise ValueError("without confidences (a drafter without a confidence head) the"
                         " schedule needs num_drafted")
    return schedule_static(num_drafted, sps, static_length)


class ConfidenceHistory:
    """Per slot, the confidences of its last ``lag`` rounds, for the lagged production
    scheduler. A slot's history belongs to one generation: a new request starts empty, and a
    slot without ``lag`` rounds of history gets ``default`` (a prior, e.g. the mean confidence
    per position of recent traffic)."""

    def __init__(self, max_slots: int, num_spec: int, lag: int = 2) -> None:
        if lag < 1:
            raise ValueError(f"lag {lag} must be >= 1")
        self.lag = lag
        self.num_spec = num_spec
        self._hist = np.zeros((max_slots, lag, num_spec), np.float64)  # ring per slot
        self._count = np.zeros(max_slots, np.int64)  # pushes for the current generation
        self._gen: list[int | None] = [None] * max_slots

    def push(self, slots: Sequence[int], generations: Sequence[int], confidence: Any) -> None:
        """Record one round's confidences ``[len(slots), N]`` (zeros past what was drafted)."""
        c = np.asarray(confidence, dtype=np.float64)
        if c.shape != (len(slots), self.num_spec):
            raise ValueError(f"confidence has shape {c.shape}, expected"
                             f" ({len(slots)}, {self.num_spec})")
        for i, (s, g) in enumerate(zip(slots, generations, strict=True)):
            if self._gen[s] != g:
                self._gen[s] = g
                self._count[s] = 0
            self._hist[s, self._count[s] % self.lag] = c[i]
            self._count[s] += 1

    def lagged(self, slots: Sequence[int], generations: Sequence[int],
               default: Any) -> FloatArray:
        """Confidences ``[len(slots), N]`` pushed ``lag`` rounds ago for each slot's current
        generation, or ``default`` (one row ``[N]``) where there is no such round."""
        d = np.broadcast_to(np.asarray(default, dtype=np.float64), (self.num_spec,))
        out = np.empty((len(slots), self.num_spec), np.float64)
        for i, (s, g) in enumerate(zip(slots, generations, strict=True)):
            n = int(self._count[s])
            if self._gen[s] == g and n >= self.lag:
                out[i] = self._hist[s, n % self.lag]  # the oldest of the last `lag` pushes
            else:
                out[i] = d
        return out


def expected_tokens_per_s(lengths: Any, confidence: Any, sps: SpsTable) -> float:
    """``tau * SPS(B)`` of given lengths (for comparing policies in benchmarks and tests)."""
    s = survival(confidence)
    L = np.asarray(lengths, dtype=np.int64)
    R = s.shape[0]
    live = np.arange(s.shape[1])[None, :] < L[:, None]
    tau = R + float(s[live].sum())
    B = R + int(L.sum())
    return tau * float(sps(B)) if R else math.nan
