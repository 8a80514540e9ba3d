"""The Markov walk and the per-position outputs (DRAFTER.md steps 5 and 6; CONTRACT 9).

``prev = anchor_token``; for j = 0..N-1: ``z_j = U_j + bias(prev)``, pick ``x_j`` (argmax, or
the draw from q for a sampled lane), ``l_j = conf_proj([hf_j ; e])``, ``prev = x_j``. Everything
stays on the device: no host synchronisation inside the loop, and no Python branch on a tensor's
value, so the walk can be captured in a CUDA graph (``step``). ``U`` comes from one LM head GEMM
in the model dtype, finished to fp32 one position at a time. With ``draft_topk`` k (vLLM's
``dspark_draft_topk``) the bias is added to the k best entries of ``U_j`` only and every other
id counts as -inf (:func:`candidate_position`). A family's own candidate walk
(``model.walk_candidates``, DFlash2's selector over its ``selector_top_k`` best base logits) runs
the same path with its head (``model.walk_head``).

A family with a reduced draft vocabulary (``config.draft_vocab`` < ``vocab_size``) picks in the
draft vocabulary and maps the pick, and every support id with q > 0, to target ids
(``model.target_ids``, a device gather; increasing, so q's canonical order holds in target
ids). Lead rows (``config.lead_rows``, the anchor's row where the anchor is the bonus token)
draft nothing; the rnn head's state steps through them with ``prev = anchor_token``.
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


def markov_walk(model: DraftModel, hf: Tensor, logits: Tensor | None, anchor_token: Tensor,
                sampled: DeviceSampling | None, keep_logits: bool = False,
                draft_topk: int = 0) -> WalkOutput:
    """hf [B, lead + N, d] (model dtype, the lead rows first), anchor_token [B] int64.
    ``logits``: the base logits U [B, N, Vd] fp32 of the drafted rows, or None to run the LM
    head here (:func:`head_groups`) and finish each position's U [B, Vd] in fp32 as the walk
    reaches it: no [B, N, Vd] fp32 tensor (at B = 256 and a 152k vocabulary that is 1.1 GB,
    written and read several times). ``draft_topk`` > 0: the candidate walk
    (:func:`candidate_position`, over the draft vocabulary). ``keep_logits`` also returns every
    position's corrected logits (tests, diagnostics)."""
    lead = model.config.lead_rows
    b, n = hf.shape[0], hf.shape[1] - lead
    group = head_groups(model, b, n)
    head_out = hf  # the current group's LM head output, [B, group, Vd] model dtype
    head = model.walk_head
    draft_topk = draft_topk or model.walk_candidates  # DFlash2's selector reranks its own k
    conf_head = model.confidence_head
    with_markov = model.config.confidence_head_with_markov
    reduced = model.config.draft_vocab != model.config.vocab_size
    prev = anchor_token  # [B]
    state: Tensor | None = None  # rnn head state [B, r]
    if head is not None and head.kind == "rnn":
        for j in range(lead):
            state = head.step_input(prev, hf[:, j], state)[2]
    drafts, confs, margins, supports, qs, zs = [], [], [], [], [], []
    for j in range(n):
        hf_j = hf[:, lead + j]  # [B, d]
        e: Tensor | None = None
        if logits is not None:
            u = logits[:, j]  # [B, Vd]
        else:
            if j % group == 0:
                head_out = model.head_logits(hf[:, lead + j:lead + j + group])  # [B, group, Vd]
            u = model.finish_logits(head_out[:, j % group])  # [B, Vd] fp32
        if draft_topk:
            x, top2, ids, q, z, e, state = candidate_position(
                model, u, hf_j, prev, state, draft_topk, sampled, keep_logits)
        else:
            z = u  # [B, Vd]
            if head is not None:
                e, bias, state = head.step(prev, hf_j, state)  # e [B, r], bias [B, Vd]
                z = z + bias.float()  # [B, Vd]
            x = torch.argmax(z, dim=-1)  # [B] first maximum: ties to the lower id
            ids = q = None
            if sampled is not None:
                ids, q = sampling.build_q(z, sampled.top_k, sampled.temperature,
                                          sampled.top_p)  # [B, K] each
            top2 = torch.topk(z, 2, dim=-1).values  # [B, 2]
        if keep_logits and z is not None:
            zs.append(z)
        if sampled is not None and ids is not None and q is not None:
            drawn = sampling.draw(ids, q, sampled.u[:, j])  # [B]
            keep = sampled.is_sampled.unsqueeze(1)  # [B, 1]
            x = torch.where(sampled.is_sampled, drawn, x)  # [B]
            if reduced:
                ids = torch.where(q > 0, model.target_ids(ids), 0)  # [B, K] target ids
            supports.append(torch.where(keep, ids, 0))
            qs.append(torch.where(keep, q, 0))
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
        logits=torch.stack(zs, dim=1) if keep_logits else None,  # [B, N, Vd]
    )


# The LM head's output held at once, at most: every B up to 256 of the released Qwen3-4B and
# Gemma4-12B shapes in bf16 runs one GEMM for all N positions (the head's weights read once);
# past it (fp32 on a CPU, larger batches) the positions go in groups that fit.
HEAD_BYTES_BUDGET = 1 << 30


def head_groups(model: DraftModel, b: int, n: int, budget: int | None = None) -> int:
    """Positions per LM head GEMM for B lanes: all N when their output fits ``budget``
    (default ``HEAD_BYTES_BUDGET``)."""
    budget = HEAD_BYTES_BUDGET if budget is None else budget
    per_position = b * model.config.draft_vocab * model.lm_head.weight.element_size()
    return max(1, min(n, budget // max(per_position, 1)))


def candidate_position(model: DraftModel, u: Tensor, hf_j: Tensor, prev: Tensor,
                       state: Tensor | None, k: int, sampled: DeviceSampling | None,
                       keep_logits: bool
                       ) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None, Tensor | None,
                                  Tensor | None, Tensor | None]:
    """One position of the candidate walk (vLLM's ``dspark_draft_topk``): the Markov bias is
    added to the k best base logits only and every other id counts as -inf; greedy, sampled,
    margin and confidence then read that truncated distribution. Reads k rows of markov_w2
    per lane instead of all V.

    -> (greedy id [B], top-2 values [B, 2], support ids, q, dense z (keep_logits), e, state).
    """
    head = model.walk_head
    vocab = u.shape[1]
    base, cand = torch.topk(u, k, dim=-1)  # [B, k] each
    e: Tensor | None = None
    z = base  # [B, k]
    if head is not None:
        e, x_in, state = head.step_input(prev, hf_j, state)  # e, x_in [B, r]
        z = z + head.bias_at(x_in, cand).float()  # [B, k]
    best = z.max(dim=1, keepdim=True).values  # [B, 1]
    x = torch.where(z == best, cand, vocab).min(dim=1).values  # [B] ties to the lower id
    top2 = torch.topk(z, 2, dim=-1).values  # [B, 2]
    ids = q = None
    if sampled is not None:
        ids, q = sampling.build_q_among(z, cand, sampled.top_k, sampled.temperature,
                                        sampled.top_p, vocab)
    dense = None
    if keep_logits:
        dense = torch.full_like(u, float("-inf")).scatter_(1, cand, z)  # [B, V]
    return x, top2, ids, q, dense, e, state
