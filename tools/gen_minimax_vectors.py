"""Extra MiniMax-M3 DSpark vectors for tests/worker/drafter/data/minimax_m3_tiny, made with
transformers' own MiniMax-M3 modules: geometries the shared cases do not cover (MQA, sliding and
full layers mixed, a sharded MXFP8 checkpoint, the released SwiGLU limit of 7 with activations
that reach it, full rotary with no layer_types).

The reference composes ``MiniMaxM3VLAttention`` (eager), ``MiniMaxM3VLRMSNorm``,
``MiniMaxM3VLDenseMLP`` and ``MiniMaxM3VLRotaryEmbedding`` of transformers 5.25.0 with vLLM
0.34's DSpark wiring (MINIMAX_M3.md section 5): each layer's attention runs over
``[hidden_norm(fc(taps)) ; input_layernorm(h)]`` with an additive mask (a sliding layer: key q
visible to query p iff |p - q| <= S - 1; a full layer: every key), the block's outputs are its
last N rows; then the final norm, the target's head, the greedy Markov walk and the confidence
head, all in fp32. Nothing of the worker is imported. The target is the shared tiny target.

CI does not install transformers: install it beside the project (``.venv/`` is gitignored; its
packages are appended to ``sys.path``, so the project's own torch and numpy win), run this, and
commit its outputs (``extra_*/``, ``cases_extra.json``, ``taps_extra.safetensors``)::

    pip install --target .venv/ref transformers==5.25.0
    PYTHONPATH=. python tools/gen_minimax_vectors.py
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "worker" / "drafter" / "data" / "minimax_m3_tiny"
PREFIX = "language_model.model.dspark."
V, D, NOISE, RANK, TAPS = 300, 64, 297, 8, [1, 3, 5]

CHECKPOINTS: dict[str, dict[str, Any]] = {
    # MQA, sliding and full layers mixed, MXFP8 in two shards, the released clamp limit
    "extra_mqa_mixed_sharded": dict(
        layers=3, heads=4, kv_heads=1, head_dim=32, inter=96, factor=0.25, theta=1e6,
        window=10, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        block=4, limit=7.0, alpha=1.702, mxfp8=True, shards=2, gate_gain=3.0, seed=401),
    # GQA 8/2, full rotary, no layer_types (all full), BF16, the released clamp limit
    "extra_full_rotary_bf16": dict(
        layers=2, heads=8, kv_heads=2, head_dim=16, inter=96, factor=1.0, theta=5e6,
        window=None, layer_types=None, block=6, limit=7.0, alpha=1.702, mxfp8=False,
        shards=1, gate_gain=3.0, seed=402),
}
CONTEXTS = [(1, 1), (20, 20), (60, 60), (40, 250)]  # (rows, anchor_pos); a ring of 64 holds all


def text_config(spec: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {
        "model_type": "minimax_m3_vl_text", "num_hidden_layers": spec["layers"],
        "hidden_size": D, "vocab_size": V, "num_attention_heads": spec["heads"],
        "num_key_value_heads": spec["kv_heads"], "head_dim": spec["head_dim"],
        "intermediate_size": 32, "dense_intermediate_size": spec["inter"],
        "dspark_ffn_hidden_size": spec["inter"], "hidden_act": "swigluoai",
        "swiglu_alpha": spec["alpha"], "swiglu_limit": spec["limit"], "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096, "tie_word_embeddings": False, "use_gemma_norm": True,
        "dspark_target_layer_ids": TAPS, "dspark_block_size": spec["block"],
        "dspark_noise_token_id": NOISE, "dspark_markov_rank": RANK,
        "dspark_markov_head_type": "vanilla", "dspark_use_dense_ffn": True,
        "enable_confidence_head": True, "confidence_head_with_markov": True,
        "moe_layer_freq": [0] * spec["layers"], "sparse_attention_config": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": spec["theta"],
                            "partial_rotary_factor": spec["factor"]},
    }
    if spec["window"] is not None:
        out["sliding_window"] = spec["window"]
    if spec["layer_types"] is not None:
        out["layer_types"] = spec["layer_types"]
    return out


def quantize_mxfp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(E4M3 values, E8M0 scales, the exact dequantised weight) of w [rows, cols]: per 1 x 32
    block s = ceil(log2(amax / 448)) + 127, values rounded to E4M3 (nearest even)."""
    rows, cols = w.shape
    blocks = w.view(rows, cols // 32, 32)
    amax = blocks.abs().amax(-1).clamp_min(1e-30)
    s = (torch.ceil(torch.log2(amax / 448.0)) + 127).clamp(3, 246)
    q = (blocks / torch.exp2(s - 127).unsqueeze(-1)).to(torch.float8_e4m3fn)
    dense = (q.float() * torch.exp2(s - 127).unsqueeze(-1)).view(rows, cols)
    return q.view(rows, cols), s.to(torch.uint8), dense


def make_weights(spec: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(the stored tensors by stored name, the weights the reference runs with)."""
    g = torch.Generator().manual_seed(spec["seed"])

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    hd, h, hk, inter = spec["head_dim"], spec["heads"], spec["kv_heads"], spec["inter"]
    stored: dict[str, torch.Tensor] = {}
    dense: dict[str, torch.Tensor] = {}

    def bf16(name: str, t: torch.Tensor) -> None:
        stored[name] = t.to(torch.bfloat16)
        dense[name] = stored[name].float()

    bf16("fc.weight", normal(D, 3 * D) / math.sqrt(3 * D))
    bf16("hidden_norm.weight", 0.3 * normal(D))
    bf16("final_norm.weight", 0.3 * normal(D))
    for i in range(spec["layers"]):
        p = f"layers.{i}.decoder_layer."
        bf16(p + "input_layernorm.weight", 0.3 * normal(D))
        bf16(p + "post_attention_layernorm.weight", 0.3 * normal(D))
        bf16(p + "self_attn.q_norm.weight", 1.2 + 0.3 * normal(hd))
        bf16(p + "self_attn.k_norm.weight", 1.2 + 0.3 * normal(hd))
        linears = {"self_attn.q_proj": (h * hd, D, 1.0), "self_attn.k_proj": (hk * hd, D, 1.0),
                   "self_attn.v_proj": (hk * hd, D, 1.0), "self_attn.o_proj": (D, h * hd, 3.0),
                   "mlp.gate_proj": (inter, D, spec["gate_gain"]),
                   "mlp.up_proj": (inter, D, spec["gate_gain"]),
                   "mlp.down_proj": (D, inter, 1.2)}
        for linear, (rows, cols, gain) in linears.items():
            w = gain * normal(rows, cols) / math.sqrt(cols)
            # each (row, 32-block) times 2**k, k in -2..2, so the scales differ and matter
            k = torch.randint(-2, 3, (rows, cols // 32), generator=g).float()
            w = w * torch.exp2(k).repeat_interleave(32, dim=1)
            name = p + linear + ".weight"
            if spec["mxfp8"]:
                q, s, deq = quantize_mxfp8(w)
                stored[name], stored[name + "_scale_inv"], dense[name] = q, s, deq
            else:
                bf16(name, w)
    bf16("markov_head.markov_w1.weight", normal(V, RANK))
    bf16("markov_head.markov_w2.weight", normal(V, RANK) / math.sqrt(RANK))
    bf16("confidence_head.proj.weight", normal(1, D + RANK) / math.sqrt(D + RANK))
    bf16("confidence_head.proj.bias", 0.3 * normal(1))
    return stored, dense


class Reference:
    """transformers' MiniMax-M3 modules holding one checkpoint's weights, wired as vLLM's
    DSpark drafter."""

    def __init__(self, spec: dict[str, Any], dense: dict[str, torch.Tensor],
                 target: dict[str, torch.Tensor]) -> None:
        from transformers.models.minimax_m3_vl import modeling_minimax_m3_vl as m
        from transformers.models.minimax_m3_vl.configuration_minimax_m3_vl import (
            MiniMaxM3VLTextConfig,
        )

        types = spec["layer_types"] or ["full_attention"] * spec["layers"]
        cfg = MiniMaxM3VLTextConfig(
            hidden_size=D, num_hidden_layers=spec["layers"], num_attention_heads=spec["heads"],
            num_key_value_heads=spec["kv_heads"], head_dim=spec["head_dim"],
            dense_intermediate_size=spec["inter"], swiglu_alpha=spec["alpha"],
            swiglu_limit=spec["limit"], rms_norm_eps=1e-6, vocab_size=V,
            max_position_embeddings=4096, layer_types=types,
            rope_parameters={"rope_type": "default", "rope_theta": spec["theta"],
                             "partial_rotary_factor": spec["factor"]})
        cfg._attn_implementation = "eager"
        self.spec, self.types = spec, types
        self.rope = m.MiniMaxM3VLRotaryEmbedding(cfg)
        self.hidden_norm = self._norm(m, D, dense["hidden_norm.weight"])
        self.final_norm = self._norm(m, D, dense["final_norm.weight"])
        self.fc = dense["fc.weight"]
        self.layers = []
        for i in range(spec["layers"]):
            p = f"layers.{i}.decoder_layer."
            attn = m.MiniMaxM3VLAttention(cfg, i)
            mlp = m.MiniMaxM3VLDenseMLP(cfg)
            with torch.no_grad():
                for name in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"):
                    getattr(attn, name).weight.copy_(dense[p + f"self_attn.{name}.weight"])
                mlp.gate_up_proj.weight.copy_(torch.cat([dense[p + "mlp.gate_proj.weight"],
                                                         dense[p + "mlp.up_proj.weight"]]))
                mlp.down_proj.weight.copy_(dense[p + "mlp.down_proj.weight"])
            self.layers.append((self._norm(m, D, dense[p + "input_layernorm.weight"]), attn,
                                self._norm(m, D, dense[p + "post_attention_layernorm.weight"]),
                                mlp))
        self.embed = target["language_model.model.embed_tokens.weight"].float()
        self.head = target["language_model.lm_head.weight"].float()
        self.w1 = dense["markov_head.markov_w1.weight"]
        self.w2 = dense["markov_head.markov_w2.weight"]
        self.conf_w = dense["confidence_head.proj.weight"]
        self.conf_b = dense["confidence_head.proj.bias"]
        self.clamped = 0  # gate or up values past the limit (so the clamp is exercised)

    @staticmethod
    def _norm(m: Any, dim: int, weight: torch.Tensor) -> Any:
        norm = m.MiniMaxM3VLRMSNorm(dim, eps=1e-6)
        with torch.no_grad():
            norm.weight.copy_(weight)
        return norm

    @torch.no_grad()
    def draft(self, taps: torch.Tensor, anchor_pos: int, anchor: int
              ) -> tuple[list[int], list[float], list[float]]:
        n, rows = self.spec["block"], taps.shape[0]
        ctx = self.hidden_norm(taps.float() @ self.fc.T)  # [L, d]
        ids = torch.tensor([anchor] + [NOISE] * (n - 1))
        h = self.embed[ids].unsqueeze(0)  # [1, N, d]
        pos = torch.arange(anchor_pos - rows, anchor_pos + n)  # context then block
        cos, sin = self.rope(h, pos.unsqueeze(0))
        dist = (pos.view(-1, 1) - pos.view(1, -1)).abs()  # [L+N, L+N]
        for (inorm, attn, pnorm, mlp), kind in zip(self.layers, self.types, strict=True):
            x = inorm(h)
            states = torch.cat([ctx.unsqueeze(0), x], dim=1)  # [1, L+N, d]
            visible = torch.ones_like(dist, dtype=torch.bool)
            if kind == "sliding_attention":
                visible = dist <= self.spec["window"] - 1
            mask = torch.zeros(dist.shape).masked_fill(~visible, float("-inf"))
            out, _ = attn(states, (cos, sin), mask.view(1, 1, *dist.shape))
            h = h + out[:, rows:]
            y = pnorm(h)
            gate, up = (y @ mlp.gate_up_proj.weight.T).chunk(2, dim=-1)
            self.clamped += int((gate > self.spec["limit"]).sum() + (up.abs() > self.spec[
                "limit"]).sum())
            h = h + mlp(y)
        hf = self.final_norm(h)[0]  # [N, d]
        logits = hf @ self.head.T  # [N, V] fp32
        prev, out_ids, confs, margins = anchor, [], [], []
        for j in range(n):
            e = self.w1[prev]
            z = logits[j] + self.w2 @ e
            top = torch.topk(z, 2).values
            pick = int(torch.argmax(z))
            confs.append(float(torch.sigmoid(self.conf_w @ torch.cat([hf[j], e]) + self.conf_b)))
            margins.append(float(top[0] - top[1]))
            out_ids.append(pick)
            prev = pick
        return out_ids, confs, margins


def save(folder: Path, spec: dict[str, Any], stored: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    config: dict[str, Any] = {"architectures": ["DSparkMiniMaxDraftModel"],
                              "model_type": "minimax_m3_vl", "text_config": text_config(spec)}
    if spec["mxfp8"]:
        config["quantization_config"] = {"quant_method": "mxfp8", "weight_block_size": [1, 32]}
    (folder / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    names = sorted(stored)
    if spec["shards"] == 1:
        save_file({PREFIX + k: stored[k].contiguous() for k in names},
                  str(folder / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    per = math.ceil(len(names) / spec["shards"])
    for i in range(spec["shards"]):
        fname = f"model-{i + 1:05d}-of-{spec['shards']:05d}.safetensors"
        part = {PREFIX + k: stored[k].contiguous() for k in names[i * per:(i + 1) * per]}
        save_file(part, str(folder / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, fname))
    index = {"metadata": {"total_size": sum(t.nbytes for t in stored.values())},
             "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=1) + "\n")


def main() -> None:
    from safetensors.torch import load_file, save_file

    target = load_file(str(DATA / "target" / "model.safetensors"))
    checkpoints: dict[str, Any] = {}
    cases: list[dict[str, Any]] = []
    taps_out: dict[str, torch.Tensor] = {}
    for name, spec in CHECKPOINTS.items():
        stored, dense = make_weights(spec)
        save(DATA / name, spec, stored)
        ref = Reference(spec, dense, target)
        checkpoints[name] = {"target": "target", "num_spec": spec["block"], "n_taps": 3,
                             "hidden": D, "target_vocab": V, "format": "minimax-m3-dspark",
                             "mxfp8": spec["mxfp8"], "sliding_window": spec["window"],
                             "layer_types": ref.types, "shards": spec["shards"]}
        g = torch.Generator().manual_seed(spec["seed"] + 1000)
        for case, (rows, anchor_pos) in enumerate(CONTEXTS):
            best: tuple[float, Any] | None = None
            for _ in range(8):  # the draw whose smallest margin is largest
                taps = (2 * torch.randn(rows, 3 * D, generator=g)).to(torch.bfloat16)
                anchor = int(torch.randint(0, V, (1,), generator=g))
                got = ref.draft(taps, anchor_pos, anchor)
                if best is None or min(got[2]) > best[0]:
                    best = (min(got[2]), (taps, anchor, got))
            assert best is not None and best[0] >= 1e-2, (name, case, best[0])
            taps, anchor, (ids, confs, margins) = best[1]
            key = f"{name}/{case}"
            taps_out[key] = taps
            cases.append({"checkpoint": name, "target": "target", "case": case,
                          "taps_key": key, "n_rows": rows, "anchor_pos": anchor_pos,
                          "anchor_token": anchor, "num_spec": spec["block"], "ids": ids,
                          "confidence": confs, "margin": margins})
        print(f"{name}: {len(CONTEXTS)} cases, {ref.clamped} activations past the SwiGLU limit")
    save_file(taps_out, str(DATA / "taps_extra.safetensors"), metadata={"format": "pt"})
    (DATA / "cases_extra.json").write_text(json.dumps({
        "format": 1,
        "made_with": {"reference": "tools/gen_minimax_vectors.py: transformers 5.25.0"
                                   " minimax_m3_vl text modules + vLLM 0.34 DSpark wiring,"
                                   f" fp32 CPU, torch {torch.__version__.split('+')[0]}"},
        "taps_file": "taps_extra.safetensors", "tap_dtype": "bf16",
        "checkpoints": checkpoints, "cases": cases}, indent=1) + "\n")


if __name__ == "__main__":
    # The private environment's packages after the project's own (its numpy and torch win).
    sys.path.append(str(ROOT / ".venv" / "ref"))
    main()
