"""The Markov walk and the per-position outputs (DRAFTER.md steps 5 and 6; CONTRACT 9).

``prev = anchor_token``; for j = 0..N-1: ``z_j = U_j + bias(prev)``, pick ``x_j`` (argmax, or
the draw from q for a sampled lane), ``l_j = conf_proj([hf_j ; e])``, ``prev = x_j``. Everything
stays on the device: no host synchronisation inside the loop.

A family with a reduced draft vocabulary (``config.draft_vocab`` < ``vocab_size``) picks in the
draft vocabulary and maps the pick, and every support id with q > 0, to target ids
(``model.target_ids``, increasing, so q's canonical order holds in target ids). Lead rows
(``config.lead_rows``, the anchor's row where the anchor is the bonus token) draft nothing;
the rnn head's state steps through them with ``prev = anchor_token``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from . import sampling
from .model import DraftModel


@dataclass(frozen=True)
class DeviceSampling:
    """Per-lane sampling inputs on the device."""

    is_sampled: Tensor  # [B] bool: top_k > 0
    top_k: Tensor  # [B] int64, 1..32 (1 on greedy lanes)
    temperature: Tensor  # [B] float64 (1.0 on greedy lanes)
    top_p: Tensor  # [B] float64
    u: Tensor  # [B, N] int64: draw_u(seed, generation, anchor_pos + j + 1)


@dataclass(frozen=True)
class WalkOutput:
    draft_ids: Tensor  # [B, N] int64
    confidence: Tensor  # [B, N] fp32
    margin: Tensor  # [B, N] fp32
    support_ids: Tensor | None  # [B, N, K] int64 (zeros on greedy lanes)
    proposal_q: Tensor | None  # [B, N, K] int64
    logits: Tensor | None = None  # [B, N, Vd] fp32 corrected logits z, when asked for


def markov_walk(model: DraftModel, hf: Tensor, logits: Tensor, anchor_token: Tensor,
                sampled: DeviceSampling | None, keep_logits: bool = False) -> WalkOutput:
    """hf [B, lead + N, d] (model dtype, the lead rows first), logits U [B, N, Vd] fp32 of the
    drafted rows, anchor_token [B] int64. ``keep_logits`` also returns every position's
    corrected logits (tests, diagnostics)."""
    b, n, _ = logits.shape
    head = model.markov_head
    conf_head = model.confidence_head
    with_markov = model.config.confidence_head_with_markov
    reduced = model.config.draft_vocab != model.config.vocab_size
    lead = model.config.lead_rows
    prev = anchor_token  # [B]
    state: Tensor | None = None  # rnn head state [B, r]
    if head is not None and head.kind == "rnn":
        for j in range(lead):
            state = head.step(prev, hf[:, j], state)[2]
    drafts, confs, margins, supports, qs, zs = [], [], [], [], [], []
    for j in range(n):
        hf_j = hf[:, lead + j]  # [B, d]
        e: Tensor | None = None
        z = logits[:, j]  # [B, V]
        if head is not None:
            e, bias, state = head.step(prev, hf_j, state)  # e [B, r], bias [B, V]
            z = z + bias.float()  # [B, V]
        if keep_logits:
            zs.append(z)
        x = torch.argmax(z, dim=-1)  # [B] first maximum: ties to the lower id
        if sampled is not None:
            ids, q = sampling.build_q(z, sampled.top_k, sampled.temperature,
                                      sampled.top_p)  # [B, K] each
            drawn = sampling.draw(ids, q, sampled.u[:, j])  # [B]
            keep = sampled.is_sampled.unsqueeze(1)  # [B, 1]
            x = torch.where(sampled.is_sampled, drawn, x)  # [B]
            if reduced:
                ids = torch.where(q > 0, model.target_ids(ids), 0)  # [B, K] target ids
            supports.append(torch.where(keep, ids, 0))
            qs.append(torch.where(keep, q, 0))
        top2 = torch.topk(z, 2, dim=-1).values  # [B, 2]
        margins.append(top2[:, 0] - top2[:, 1])  # [B]
        if conf_head is not None:
            feats = torch.cat([hf_j, e], dim=-1) if with_markov and e is not None else hf_j
            score = conf_head.proj(feats).float().squeeze(-1)  # [B]
            confs.append(torch.sigmoid(score / model.confidence_temperature[j]))  # [B]
        else:
            confs.append(torch.ones(b, dtype=torch.float32, device=hf.device))  # [B]
        if reduced:
            x = model.target_ids(x)  # [B] target ids
        drafts.append(x)
        prev = x
    return WalkOutput(
        draft_ids=torch.stack(drafts, dim=1),  # [B, N]
        confidence=torch.stack(confs, dim=1),  # [B, N]
        margin=torch.stack(margins, dim=1),  # [B, N]
        support_ids=torch.stack(supports, dim=1) if sampled is not None else None,  # [B, N, K]
        proposal_q=torch.stack(qs, dim=1) if sampled is not None else None,  # [B, N, K]
        logits=torch.stack(zs, dim=1) if keep_logits else None,  # [B, N, V]
    )
