"""Make the extra Kimi-K3 DSpark vectors in tests/worker/drafter/data/k3_tiny/: what the shared
set does not cover (other head geometries, a bigger vocabulary, another N, ``logit_scale``,
``sample_from_anchor`` false, a cos/sin YaRN factor other than 1, RoPE keys absent, no
confidence head, contexts up to 500 rows sent over many STEPs so that the ring wraps many
times).

The reference is transformers' own DeepSeek-V3 modules (``DeepseekV3Attention`` with
``rope_interleave``, ``DeepseekV3MLP``, ``DeepseekV3RMSNorm``, ``DeepseekV3RotaryEmbedding``;
eager attention, float32 on the CPU) composed as vLLM's ``K3DSparkModel`` wires them: the
context rows ``context_norm(context_proj(taps))`` (the newest W) and the block's
``input_layernorm(h)`` go through each layer's attention together at positions
``[context ; block]`` under an all-zero mask (the block sees itself both ways and every
context row), only the block's outputs kept; ``q_a_layernorm`` / ``kv_a_layernorm`` at the
config's ``rms_norm_eps``; then ``final_norm``, the target's head times ``logit_scale``, the
Markov walk (its bias times ``logit_scale``) and the confidence head on the final-normed hidden.

transformers is not a dependency of the project: install it somewhere of your own and put it
on the path, e.g.::

    python -m pip install --target .venv-ref transformers==5.25.0   # then drop its numpy copy
    PYTHONPATH=.venv-ref:. python tools/gen_k3_vectors.py

Writes ``extra_*/`` checkpoints (and their ``extra_*_target/`` targets), ``taps_extra.safetensors``
and ``cases_extra.json`` (the schema of ``cases.json`` plus per case ``chunk``: the rows go
to the worker ``chunk`` at a time, one STEP each, before the drafting STEP).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3Attention,
    DeepseekV3MLP,
    DeepseekV3RMSNorm,
    DeepseekV3RotaryEmbedding,
)

OUT = Path(__file__).resolve().parents[1] / "tests" / "worker" / "drafter" / "data" / "k3_tiny"
WINDOW = 128
MIN_MARGIN = 5e-3

# name: (config keys, seed, cases as (n_rows, anchor_pos, chunk))
CHECKPOINTS: dict[str, tuple[dict[str, Any], int, list[tuple[int, int, int]]]] = {
    "extra_lead_scaled_v2000": ({
        "hidden_size": 48, "intermediate_size": 40, "num_hidden_layers": 2,
        "num_attention_heads": 2, "q_lora_rank": 24, "kv_lora_rank": 12,
        "qk_nope_head_dim": 8, "qk_rope_head_dim": 6, "v_head_dim": 20, "vocab_size": 2000,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 20000.0, "factor": 16.0,
                            "original_max_position_embeddings": 32, "beta_fast": 32,
                            "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 1.0},
        "target_layer_ids": [0, 3], "block_size": 4, "markov_rank": 6,
        "enable_confidence_head": True, "confidence_head_with_markov": True,
        "sample_from_anchor": False, "logit_scale": 1.5,
    }, 401, [(1, 1, 1), (100, 100, 100), (500, 500, 37), (128, 900, 128)]),
    "extra_norope_keys_n9": ({
        "hidden_size": 64, "intermediate_size": 48, "num_hidden_layers": 3,
        "num_attention_heads": 3, "q_lora_rank": 16, "kv_lora_rank": 20,
        "qk_nope_head_dim": 12, "qk_rope_head_dim": 4, "v_head_dim": 8, "vocab_size": 500,
        "target_layer_ids": [1, 2, 5, 7], "block_size": 9, "markov_rank": 4,
        "sample_from_anchor": True,
    }, 402, [(2, 2, 2), (300, 300, 11), (64, 700, 64)]),
}


def bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).float()


def make_tensors(cfg: dict[str, Any], gen: torch.Generator) -> dict[str, torch.Tensor]:
    d, heads, vocab = cfg["hidden_size"], cfg["num_attention_heads"], cfg["vocab_size"]
    qk = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    n_taps, r = len(cfg["target_layer_ids"]), cfg["markov_rank"]

    def lin(rows: int, cols: int, gain: float = 1.0) -> torch.Tensor:
        return bf16(torch.randn(rows, cols, generator=gen) * gain / math.sqrt(cols))

    def norm(n: int) -> torch.Tensor:
        return bf16(1 + 0.2 * torch.randn(n, generator=gen))

    t = {"context_proj.weight": lin(d, n_taps * d), "context_norm.weight": norm(d),
         "final_norm.weight": norm(d)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        t.update({
            p + "input_layernorm.weight": norm(d),
            p + "post_attention_layernorm.weight": norm(d),
            p + "self_attn.q_a_proj.weight": lin(cfg["q_lora_rank"], d),
            p + "self_attn.q_a_layernorm.weight": norm(cfg["q_lora_rank"]),
            p + "self_attn.q_b_proj.weight": lin(heads * qk, cfg["q_lora_rank"], 2.0),
            p + "self_attn.kv_a_proj_with_mqa.weight": lin(
                cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"], d, 2.0),
            p + "self_attn.kv_a_layernorm.weight": norm(cfg["kv_lora_rank"]),
            p + "self_attn.kv_b_proj.weight": lin(
                heads * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"]), cfg["kv_lora_rank"], 1.5),
            p + "self_attn.o_proj.weight": lin(d, heads * cfg["v_head_dim"], 3.0),
            p + "mlp.gate_proj.weight": lin(cfg["intermediate_size"], d),
            p + "mlp.up_proj.weight": lin(cfg["intermediate_size"], d),
            p + "mlp.down_proj.weight": lin(d, cfg["intermediate_size"], 3.0),
        })
    t["markov_head.markov_w1.weight"] = bf16(torch.randn(vocab, r, generator=gen))
    t["markov_head.markov_w2.weight"] = lin(vocab, r, 1.5)
    if cfg.get("enable_confidence_head"):
        width = d + (r if cfg.get("confidence_head_with_markov") else 0)
        t["confidence_head.proj.weight"] = lin(1, width, 2.0)
        t["confidence_head.proj.bias"] = bf16(0.3 * torch.randn(1, generator=gen))
    return t


def full_config(keys: dict[str, Any]) -> dict[str, Any]:
    return {"architectures": ["K3DSparkModel"], "model_type": "k3_dspark",
            "num_key_value_heads": keys["num_attention_heads"], "hidden_act": "silu",
            "rms_norm_eps": 1e-5, "max_position_embeddings": 4096, "attention_bias": False,
            "n_routed_experts": 0, "mla_use_nope": False, "target_hidden_size":
            keys["hidden_size"], "num_target_layers": len(keys["target_layer_ids"]),
            "target_num_hidden_layers": 8, "mask_token_id": keys["vocab_size"] - 3,
            "markov_head_type": "vanilla", **keys}


class Reference:
    """The composition of transformers' modules described in the module docstring."""

    def __init__(self, cfg: dict[str, Any], t: dict[str, torch.Tensor],
                 embed: torch.Tensor, head: torch.Tensor) -> None:
        rope = cfg.get("rope_parameters") or {"rope_type": "default", "rope_theta": 50000.0}
        self.hf = DeepseekV3Config(
            vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=cfg["num_attention_heads"],
            num_key_value_heads=cfg["num_attention_heads"], q_lora_rank=cfg["q_lora_rank"],
            kv_lora_rank=cfg["kv_lora_rank"], qk_nope_head_dim=cfg["qk_nope_head_dim"],
            qk_rope_head_dim=cfg["qk_rope_head_dim"], v_head_dim=cfg["v_head_dim"],
            rms_norm_eps=cfg["rms_norm_eps"], max_position_embeddings=4096,
            rope_parameters=dict(rope), rope_interleave=True, attention_bias=False,
            n_routed_experts=0, first_k_dense_replace=cfg["num_hidden_layers"])
        self.hf._attn_implementation = "eager"
        self.cfg, self.t, self.embed, self.head = cfg, t, embed, head
        eps = cfg["rms_norm_eps"]
        self.rotary = DeepseekV3RotaryEmbedding(self.hf)
        self.layers = []
        for i in range(cfg["num_hidden_layers"]):
            attn = DeepseekV3Attention(self.hf, i)
            attn.q_a_layernorm.variance_epsilon = eps  # vLLM's reading: the config's eps
            attn.kv_a_layernorm.variance_epsilon = eps
            mlp = DeepseekV3MLP(self.hf)
            norms = (DeepseekV3RMSNorm(cfg["hidden_size"], eps),
                     DeepseekV3RMSNorm(cfg["hidden_size"], eps))
            prefix = f"layers.{i}."
            attn.load_state_dict({k[len(prefix + "self_attn."):]: v for k, v in t.items()
                                  if k.startswith(prefix + "self_attn.")})
            mlp.load_state_dict({k[len(prefix + "mlp."):]: v for k, v in t.items()
                                 if k.startswith(prefix + "mlp.")})
            norms[0].weight.data = t[prefix + "input_layernorm.weight"]
            norms[1].weight.data = t[prefix + "post_attention_layernorm.weight"]
            self.layers.append((attn, mlp, norms))
        self.context_norm = DeepseekV3RMSNorm(cfg["hidden_size"], eps)
        self.context_norm.weight.data = t["context_norm.weight"]
        self.final_norm = DeepseekV3RMSNorm(cfg["hidden_size"], eps)
        self.final_norm.weight.data = t["final_norm.weight"]

    @torch.no_grad()
    def draft(self, taps: torch.Tensor, anchor_pos: int, anchor_token: int
              ) -> tuple[list[int], list[float], list[float]]:
        cfg = self.cfg
        n = cfg["block_size"]
        lead = 0 if cfg.get("sample_from_anchor", True) else 1
        rows = taps[-WINDOW:]
        ctx = self.context_norm(rows @ self.t["context_proj.weight"].T)  # [S, d]
        s = ctx.shape[0]
        ids = torch.full((lead + n,), cfg["mask_token_id"])
        ids[0] = anchor_token
        h = self.embed[ids]  # [lead + N, d]
        pos = torch.cat([torch.arange(anchor_pos - s, anchor_pos),
                         torch.arange(anchor_pos, anchor_pos + lead + n)]).unsqueeze(0)
        cos_sin = self.rotary(h.unsqueeze(0), pos)
        mask = torch.zeros(1, 1, pos.shape[1], pos.shape[1])
        for attn, mlp, (in_norm, post_norm) in self.layers:
            x = torch.cat([ctx, in_norm(h)]).unsqueeze(0)
            out = attn(x, cos_sin, mask)[0][0, s:]
            h = h + out
            h = h + mlp(post_norm(h))
        hf = self.final_norm(h)[lead:]  # [N, d]
        scale = float(cfg.get("logit_scale", 1.0))
        base = scale * (hf @ self.head.T)  # [N, V]
        prev, out_ids, confs, margins = anchor_token, [], [], []
        w1, w2 = self.t["markov_head.markov_w1.weight"], self.t["markov_head.markov_w2.weight"]
        for j in range(n):
            e = w1[prev]
            z = base[j] + scale * (w2 @ e)
            x_j = int(torch.argmax(z))
            top = torch.topk(z, 2).values
            margins.append(float(top[0] - top[1]))
            if cfg.get("enable_confidence_head"):
                feats = torch.cat([hf[j], e]) if cfg.get("confidence_head_with_markov") else hf[j]
                score = feats @ self.t["confidence_head.proj.weight"][0] + \
                    self.t["confidence_head.proj.bias"][0]
                confs.append(float(torch.sigmoid(score)))
            else:
                confs.append(1.0)
            out_ids.append(x_j)
            prev = x_j
        return out_ids, confs, margins


def main() -> None:
    checkpoints: dict[str, Any] = {}
    cases: list[dict[str, Any]] = []
    taps_out: dict[str, torch.Tensor] = {}
    for name, (keys, seed, plan) in CHECKPOINTS.items():
        cfg = full_config(keys)
        gen = torch.Generator().manual_seed(seed)
        d, vocab = cfg["hidden_size"], cfg["vocab_size"]
        embed = bf16(torch.randn(vocab, d, generator=gen))
        head = bf16(0.5 * torch.randn(vocab, d, generator=gen))
        t = make_tensors(cfg, gen)
        ck, target = OUT / name, OUT / f"{name}_target"
        ck.mkdir(exist_ok=True)
        target.mkdir(exist_ok=True)
        (ck / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        shipped = {k: v.to(torch.bfloat16) for k, v in t.items()}
        shipped["embed_tokens.weight"] = embed.to(torch.bfloat16)  # the frozen copy
        save_file(shipped, str(ck / "model.safetensors"))
        save_file({"model.embed_tokens.weight": embed.to(torch.bfloat16),
                   "lm_head.weight": head.to(torch.bfloat16)},
                  str(target / "model.safetensors"))
        (target / "config.json").write_text(json.dumps(
            {"hidden_size": d, "vocab_size": vocab, "tie_word_embeddings": False}) + "\n")
        ref = Reference(cfg, t, embed, head)
        checkpoints[name] = {"target": target.name, "num_spec": cfg["block_size"],
                             "n_taps": len(cfg["target_layer_ids"]), "hidden": d,
                             "target_vocab": vocab, "format": "k3-dspark",
                             "sample_from_anchor": cfg.get("sample_from_anchor", True),
                             "rope": (cfg.get("rope_parameters") or {}).get("rope_type",
                                                                            "absent")}
        for index, (n_rows, anchor_pos, chunk) in enumerate(plan):
            for attempt in range(50):
                g = torch.Generator().manual_seed(1000 * seed + 17 * index + 7919 * attempt)
                taps = bf16(2 * torch.randn(n_rows, len(cfg["target_layer_ids"]) * d,
                                            generator=g))
                token = int(torch.randint(0, vocab - 3, (1,), generator=g))
                ids, confs, margins = ref.draft(taps, anchor_pos, token)
                if min(margins) >= MIN_MARGIN:
                    break
            else:
                raise RuntimeError(f"{name} case {index}: no draw with margins >= {MIN_MARGIN}")
            key = f"{name}/{index}"
            taps_out[key] = taps.to(torch.bfloat16)
            cases.append({"checkpoint": name, "target": target.name, "case": index,
                          "taps_key": key, "n_rows": n_rows, "anchor_pos": anchor_pos,
                          "anchor_token": token, "num_spec": cfg["block_size"],
                          "context_rows": min(n_rows, WINDOW), "chunk": chunk,
                          "ring_wraps": n_rows // WINDOW, "ids": ids, "confidence": confs,
                          "margin": margins})
            print(name, index, ids, f"min margin {min(margins):.4f}")
    save_file(taps_out, str(OUT / "taps_extra.safetensors"))
    (OUT / "cases_extra.json").write_text(json.dumps(
        {"window": WINDOW, "checkpoints": checkpoints, "cases": cases}, indent=1) + "\n")


if __name__ == "__main__":
    main()
