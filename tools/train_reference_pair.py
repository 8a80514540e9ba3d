"""Train the reference target + DSpark drafter pair that ships with dspark.

    python tools/train_reference_pair.py [--out DIR] [--target-steps N] [--drafter-steps N]

No public checkpoint can be downloaded where dspark is tested, and random weights cannot show
that drafting works, so the project makes its own small pair on a corpus every machine has: the
``.py`` files of Python's standard library (files whose name hashes to 0 mod 10 are held out).

1. The target: a byte-level causal LM (``dspark_client.demo.target``), next-byte cross-entropy.
2. A distillation corpus: continuations the target writes itself from training-text prompts,
   half greedy and half sampled, because at serving time the drafter drafts for text the target
   is writing.
3. The drafter (``dspark_worker.drafter``'s model, DeepSpec layout): the target's taps (bf16, as
   on the wire) projected as context, a block ``[anchor, MASK x (N-1)]`` after a random anchor,
   trained with the DSpark loss: cross-entropy against the target's greedy token, L1 between the
   draft and target distributions, and BCE of the confidence head against
   ``sum(min(p_draft, p_target))``. ``embed_tokens`` and ``lm_head`` are the target's, frozen.

Seeded and CPU-only; it prints progress and final metrics (held-out loss of the target; top-1
agreement per block position and mean accepted length of the drafter under teacher forcing).
The pair is written to ``dspark_worker/drafter/reference/`` (drafter, the embedded default of
the worker) and ``dspark_client/demo/reference_target/`` (target) unless ``--out`` says else.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dspark_client.demo.corpus import stdlib_sources  # noqa: E402
from dspark_client.demo.target import (  # noqa: E402
    BOS,
    MASK,
    VOCAB_SIZE,
    TargetConfig,
    TargetModel,
    save_target,
)
from dspark_worker.drafter.checkpoint import save_checkpoint  # noqa: E402
from dspark_worker.drafter.config import DrafterConfig  # noqa: E402
from dspark_worker.drafter.model import DenseContext, DrafterModel  # noqa: E402

BLOCK = 7


# -- corpus --------------------------------------------------------------------------------------
def corpus(max_bytes: int) -> tuple[bytes, bytes]:
    """(train, held-out) text of the standard library's .py files, in a fixed order."""
    train, held = bytearray(), bytearray()
    for _, data, held_out in stdlib_sources():
        (held if held_out else train).extend(data + b"\n")
        if len(train) >= max_bytes and len(held) >= max_bytes // 10:
            break
    return bytes(train[:max_bytes]), bytes(held[:max_bytes // 10])


def batches(data: torch.Tensor, batch: int, seq: int, gen: torch.Generator) -> torch.Tensor:
    """[batch, seq] random windows of ``data``, each starting with BOS."""
    starts = torch.randint(0, data.numel() - seq, (batch,), generator=gen)
    rows = torch.stack([data[s:s + seq - 1] for s in starts.tolist()])  # [B, T-1]
    return torch.cat([torch.full((batch, 1), BOS, dtype=torch.long), rows], dim=1)  # [B, T]


def lr_at(step: int, total: int, peak: float, warmup: int = 50) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


# -- target --------------------------------------------------------------------------------------
def train_target(train: torch.Tensor, held: torch.Tensor, steps: int, seq: int,
                 batch: int, gen: torch.Generator) -> TargetModel:
    model = TargetModel(TargetConfig())
    model.apply(_init_weights)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.05, betas=(0.9, 0.95))
    t0 = time.time()
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, 3e-3)
        ids = batches(train, batch, seq + 1, gen)  # [B, T+1]
        logits, _ = model(ids[:, :-1])  # [B, T, V]
        loss = F.cross_entropy(logits.reshape(-1, VOCAB_SIZE), ids[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 50 == 0 or step == steps - 1:
            print(f"target step {step:5d}/{steps}  loss {loss.item():.3f} nats/byte"
                  f"  {time.time() - t0:6.0f} s", flush=True)
    model.eval()
    with torch.no_grad():
        ids = batches(held, 32, seq + 1, torch.Generator().manual_seed(1))
        logits, _ = model(ids[:, :-1])
        held_loss = F.cross_entropy(logits.reshape(-1, VOCAB_SIZE), ids[:, 1:].reshape(-1))
    print(f"target held-out loss {held_loss.item():.3f} nats/byte"
          f" ({held_loss.item() / math.log(2):.2f} bits/byte)", flush=True)
    return model


def _init_weights(m: torch.nn.Module) -> None:
    if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)):
        torch.nn.init.normal_(m.weight, std=0.02)


@torch.no_grad()
def distill_corpus(target: TargetModel, train: torch.Tensor, n_seq: int, prompt: int,
                   seq: int, gen: torch.Generator) -> torch.Tensor:
    """[n_seq, seq] sequences: a training-text prompt, then the target's own continuation
    (greedy for the first half of each batch, sampled at temperature 0.8 for the rest)."""
    out = []
    chunk = 64
    t0 = time.time()
    for first in range(0, n_seq, chunk):
        b = min(chunk, n_seq - first)
        ids = batches(train, b, prompt, gen)  # [b, P]
        cache = target.new_cache(b, seq)
        logits, _ = target(ids, cache)
        seqs = [ids]
        nxt_logits = logits[:, -1]  # [b, V]
        greedy = torch.arange(b) < b // 2
        for _ in range(seq - prompt):
            probs = torch.softmax(nxt_logits / 0.8, dim=-1)
            sampled = torch.multinomial(probs, 1, generator=gen)[:, 0]
            tok = torch.where(greedy, nxt_logits.argmax(-1), sampled)  # [b]
            seqs.append(tok[:, None])
            logits, _ = target(tok[:, None], cache)
            nxt_logits = logits[:, -1]
        out.append(torch.cat(seqs, dim=1))
        print(f"distillation corpus {first + b}/{n_seq} sequences  {time.time() - t0:5.0f} s",
              flush=True)
    return torch.cat(out)  # [n_seq, seq]


# -- drafter -------------------------------------------------------------------------------------
def drafter_config(target: TargetModel) -> DrafterConfig:
    tc = target.config
    return DrafterConfig(
        hidden_size=tc.hidden_size, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, intermediate_size=384, vocab_size=tc.vocab_size,
        rms_norm_eps=1e-6, rope_theta=10000.0, target_layer_ids=tuple(tc.tap_layers),
        block_size=BLOCK, mask_token_id=MASK, markov_rank=64, markov_head_type="vanilla",
        enable_confidence_head=True, confidence_head_with_markov=True,
        target_hidden_size=tc.hidden_size, num_target_layers=tc.num_layers,
    ).validated("reference drafter")


def draft_losses(drafter: DrafterModel, target: TargetModel, ids: torch.Tensor,
                 anchors_per_seq: int, gen: torch.Generator
                 ) -> tuple[torch.Tensor, dict[str, float], torch.Tensor]:
    """The DSpark loss on one batch of sequences [B, T]; also per-position top-1 agreement."""
    c = drafter.config
    b, t = ids.shape
    n = c.block_size
    with torch.no_grad():
        t_logits, taps = target(ids)  # [B, T, V], [B, T, n_taps*d]
        taps = taps.to(torch.bfloat16).float()  # the wire carries bf16
    pos = torch.arange(t).repeat(b)  # [B*T]
    k, v = drafter.project_context(taps.reshape(b * t, -1), pos)  # [L, B*T, Hkv, D]
    layers, _, hkv, hd = k.shape
    k = k.view(layers, b, t, hkv, hd).transpose(2, 3)  # [L, B, Hkv, T, D]
    v = v.view(layers, b, t, hkv, hd).transpose(2, 3)  # [L, B, Hkv, T, D]
    m = anchors_per_seq
    anchor = torch.randint(1, t - n, (b, m), generator=gen)  # [B, M] positions
    seq_idx = torch.arange(b).repeat_interleave(m)  # [B*M]
    a = anchor.reshape(-1)  # [B*M]
    offs = torch.arange(n)  # [N]
    block_pos = a[:, None] + offs  # [BM, N]
    block_ids = torch.full((b * m, n), c.mask_token_id, dtype=torch.long)
    block_ids[:, 0] = ids[seq_idx, a]  # anchor first
    valid = torch.arange(t)[None, :] < a[:, None]  # [BM, T] rows before the anchor
    ctx = DenseContext(k[:, seq_idx], v[:, seq_idx], valid)
    hf = drafter.backbone(block_ids, block_pos, ctx)  # [BM, N, d]
    base = drafter.logits(hf)  # [BM, N, V]
    prev = ids[seq_idx[:, None], block_pos]  # [BM, N]: the token before each predicted one
    assert drafter.markov_head is not None and drafter.confidence_head is not None
    e = drafter.markov_head.markov_w1(prev)  # [BM, N, r]
    z = base + drafter.markov_head.markov_w2(e)  # [BM, N, V]
    p_t = torch.softmax(t_logits[seq_idx[:, None], block_pos], dim=-1)  # [BM, N, V]
    label = p_t.argmax(-1)  # [BM, N] the target's greedy token
    log_q = torch.log_softmax(z, dim=-1)  # [BM, N, V]
    q = log_q.exp()
    ce = F.nll_loss(log_q.reshape(-1, c.vocab_size), label.reshape(-1))
    l1 = (q - p_t).abs().sum(-1).mean()
    accept = torch.minimum(q, p_t).sum(-1).detach()  # [BM, N]
    conf_logit = drafter.confidence_head.proj(torch.cat([hf, e], dim=-1))[..., 0]  # [BM, N]
    bce = F.binary_cross_entropy_with_logits(conf_logit, accept)
    loss = ce + 0.5 * l1 + 0.5 * bce
    hit = (z.argmax(-1) == label).float()  # [BM, N]
    return loss, {"ce": ce.item(), "l1": l1.item(), "bce": bce.item()}, hit


def accepted_length(hit: torch.Tensor) -> float:
    """Mean tokens per verify round under greedy verification: accepted prefix + bonus."""
    prefix = torch.cumprod(hit, dim=-1).sum(-1)  # [BM]
    return float(prefix.mean().item()) + 1.0


def train_drafter(target: TargetModel, corpus_ids: torch.Tensor, held_ids: torch.Tensor,
                  steps: int, batch: int, gen: torch.Generator) -> DrafterModel:
    config = drafter_config(target)
    drafter = DrafterModel(config)
    drafter.apply(_init_weights)
    drafter.init_buffers()
    drafter.embed_tokens.weight.data.copy_(target.embed_tokens.weight.data)
    drafter.lm_head.weight.data.copy_(target.lm_head.weight.data)
    drafter.embed_tokens.weight.requires_grad_(False)
    drafter.lm_head.weight.requires_grad_(False)
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=2e-3, weight_decay=0.01, betas=(0.9, 0.95))
    t0 = time.time()
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, 2e-3)
        rows = torch.randint(0, corpus_ids.shape[0], (batch,), generator=gen)
        loss, parts, hit = draft_losses(drafter, target, corpus_ids[rows],
                                        max(8, corpus_ids.shape[1] // 32), gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % 50 == 0 or step == steps - 1:
            print(f"drafter step {step:5d}/{steps}  loss {loss.item():.3f}  ce {parts['ce']:.3f}"
                  f"  l1 {parts['l1']:.3f}  bce {parts['bce']:.3f}"
                  f"  accept_len {accepted_length(hit):.2f}  {time.time() - t0:6.0f} s",
                  flush=True)
    drafter.eval()
    with torch.no_grad():
        _, _, hit = draft_losses(drafter, target, held_ids, 8,
                                 torch.Generator().manual_seed(2))
    per_pos = hit.mean(0).tolist()
    print("drafter held-out top-1 agreement by position: "
          + " ".join(f"{x:.2f}" for x in per_pos), flush=True)
    print(f"drafter held-out mean accepted length (block {BLOCK}, teacher forcing):"
          f" {accepted_length(hit):.2f}", flush=True)
    return drafter


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target-out", type=Path,
                    default=ROOT / "dspark_client" / "demo" / "reference_target")
    ap.add_argument("--drafter-out", type=Path,
                    default=ROOT / "dspark_worker" / "drafter" / "reference")
    ap.add_argument("--corpus-bytes", type=int, default=6 << 20)
    ap.add_argument("--target-steps", type=int, default=1200)
    ap.add_argument("--drafter-steps", type=int, default=1500)
    ap.add_argument("--distill-seqs", type=int, default=1024)
    ap.add_argument("--seq", type=int, default=512,
                    help="sequence length of training (the context the pair is good for)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(args.seed)
    t0 = time.time()
    train_b, held_b = corpus(args.corpus_bytes)
    print(f"corpus: {len(train_b)} training bytes, {len(held_b)} held-out bytes", flush=True)
    train = torch.frombuffer(bytearray(train_b), dtype=torch.uint8).long()
    held = torch.frombuffer(bytearray(held_b), dtype=torch.uint8).long()
    # Tokens per step stay 4096 whatever the sequence length.
    target = train_target(train, held, args.target_steps, seq=args.seq,
                          batch=max(1, 4096 // args.seq), gen=gen)
    target.requires_grad_(False)
    distilled = distill_corpus(target, train, args.distill_seqs, prompt=64, seq=args.seq,
                               gen=gen)
    held_prompts = distill_corpus(target, held, 64, prompt=64, seq=args.seq,
                                  gen=torch.Generator().manual_seed(3))
    drafter = train_drafter(target, distilled, held_prompts, args.drafter_steps,
                            batch=max(1, 2048 // args.seq), gen=gen)
    save_target(target, args.target_out)
    drafter.requires_grad_(False)
    save_checkpoint(drafter, args.drafter_out)
    print(f"wrote {args.target_out} and {args.drafter_out} in {time.time() - t0:.0f} s",
          flush=True)


if __name__ == "__main__":
    main()
