"""Make the extra DFlash vectors in tests/worker/drafter/data/dflash_tiny/ (``extra_*`` checkpoints,
``cases_extra.json``, ``taps_extra.safetensors``) with each format's own model classes.

Not part of the test suite and not run by it: it needs speculators and z-lab's code, which the
project never imports. Run once, from a venv of its own (the figures in the vectors came from
speculators 0.9.0, transformers 5.19.0, torch 2.13.0 on the CPU, fp32, sdpa attention):

    python -m venv /tmp/dflash-venv
    /tmp/dflash-venv/bin/pip install torch==2.13.0 speculators==0.9.0 transformers==5.19.0
    # z-lab's dflash/model.py (the version that reads the nested layout and has DFlash2: commit
    # 1012959 of github.com/z-lab/dflash), saved as /tmp/zlab_dflash/model.py
    /tmp/dflash-venv/bin/python tools/gen_dflash_vectors.py --zlab /tmp/zlab_dflash/model.py

What each checkpoint covers beside the shared ones (the README's "Extra checkpoints" lists them):

* ``extra_spec_mqa_hd32_anchor``: speculators dflash; one KV head (MQA), head_dim 32 with
  hidden 64 and 4 heads, q/k/v/o biases, a reduced vocabulary (Vd 100), ``sample_from_anchor``
  true (N = B = 5), sliding layers non-causal in the block (``sliding_window_non_causal``) around
  a full one, a tied target;
* ``extra_spec2_causal_top40``: speculators dflash2; sliding layers causal in the block (dflash2
  defaults to non-causal), kernel 3, group 8, a selector over 40 candidates (more than a sampled
  support's 32 places);
* ``extra_zlab2_scaled_yarn``: z-lab DFlash2 (nested dflash_config): an embedding scale, an output
  multiplier and a soft cap, yarn RoPE, MQA with head_dim 24, z-lab's per-query sliding window
  narrower than the block (3 < B = 6), a selector over 6 candidates, a tied target;
* ``extra_zlab_legacy_noncausal``: z-lab DFlash in the legacy layout (top-level block_size and
  rope_theta) with ``is_causal`` false: sliding layers symmetric, full layers non-causal; biases
  and an embedding scale.

Weights: every trainable tensor redrawn bf16-exact from ``torch.Generator`` seeds 301..304 as the
shared README describes (linear N/sqrt(fan_in), o_proj and down_proj 3N/sqrt(fan_in), q/k norms
2 + 0.3N, other norms 1 + 0.2N, biases 0.3N, conv base_kernel 0.5N plus 1 on tap 0,
kernel_projection 0.5N/sqrt(fan_in), codebooks N, hidden_projection N/sqrt(fan_in)); a reduced
lm_head is the target's rows (``load_verifier_weights``). Cases: taps 2N in bf16 from seed
``1000 * model_seed + 17 * case``, the anchor token drawn after them; a case whose smallest
margin is under 5e-3 is drawn again (the next seed). Windows wrap: the worker test runs W = 32
and the cases' rows cross multiples of 32.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

OUT = Path(__file__).resolve().parents[1] / "tests" / "worker" / "drafter" / "data" / "dflash_tiny"
V, D, MASK, INTER = 300, 64, 297, 96
MIN_MARGIN = 5e-3
# (n_rows, anchor_pos) per case: W = 32 in the test, so [20, 40), [50, 70) and [90, 120) wrap
CASES = ((20, 40), (5, 5), (20, 70), (30, 120))


def bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).to(torch.float32)


def redraw(model: torch.nn.Module, seed: int, skip: tuple[str, ...] = ()) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(s in name for s in skip):
                continue
            n = torch.randn(p.shape, generator=g)
            if "base_kernel" in name:
                v = 0.5 * n
                v[:, 0] += 1.0
            elif "kernel_projection" in name:
                v = 0.5 * n / math.sqrt(p.shape[1])
            elif "codebook" in name:
                v = n
            elif name.endswith("bias"):
                v = 0.3 * n
            elif "q_norm" in name or "k_norm" in name:
                v = 2.0 + 0.3 * n
            elif "norm" in name:
                v = 1.0 + 0.2 * n
            else:  # a linear weight [out, in]
                gain = 3.0 if ("o_proj" in name or "down_proj" in name) else 1.0
                v = gain * n / math.sqrt(p.shape[1])
            p.copy_(bf16(v))


def case_inputs(seed: int, case: int, n_rows: int, width: int) -> tuple[torch.Tensor, int]:
    g = torch.Generator().manual_seed(seed)
    taps = bf16(2.0 * torch.randn(n_rows, width, generator=g))
    token = int(torch.randint(0, V, (1,), generator=g))
    return taps, token


def target_head(target: Path) -> tuple[torch.Tensor, torch.Tensor]:
    t = load_file(str(target / "model.safetensors"))
    embed = t["model.embed_tokens.weight"]
    return embed, t.get("lm_head.weight", embed)


# -- speculators ----------------------------------------------------------------------------------


def speculators_checkpoint(name: str, seed: int, *, version: int, target: str,
                           layer: dict[str, Any], top: dict[str, Any]) -> Any:
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig
    from speculators.models.dflash2 import DFlash2DraftModel, DFlash2SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import Qwen3Config

    layer_config = Qwen3Config(vocab_size=V, hidden_size=D, intermediate_size=INTER, **layer)
    layer_config._attn_implementation = "sdpa"
    block = top["block_size"]
    n = block if top.get("sample_from_anchor") else block - 1
    cls, cfg_cls = ((DFlash2DraftModel, DFlash2SpeculatorConfig) if version == 2
                    else (DFlashDraftModel, DFlashSpeculatorConfig))
    config = cfg_cls(
        transformer_layer_config=layer_config, mask_token_id=MASK, **top,
        speculators_config=SpeculatorsConfig(
            algorithm="dflash2" if version == 2 else "dflash",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=n)],
            default_proposal_method="greedy",
            verifier=VerifierConfig.from_pretrained(str(OUT / target))))
    model = cls(config)
    vd = top["draft_vocab_size"]
    if vd < V:
        g = torch.Generator().manual_seed(seed + 7)
        keep = torch.sort(torch.randperm(V, generator=g)[:vd]).values
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[keep] = True
        model.load_vocab_mappings(t2d, keep - torch.arange(vd))
    model.load_verifier_weights()
    redraw(model, seed, skip=("embed_tokens", "lm_head", "verifier_"))
    model.eval()
    folder = OUT / name
    if folder.exists():
        shutil.rmtree(folder)
    model.config.speculators_config.verifier.name_or_path = target
    model.save_pretrained(str(folder))
    (folder / "config.py").unlink(missing_ok=True)
    return model


def speculators_case(model: Any, taps: torch.Tensor, anchor_pos: int, token: int
                     ) -> tuple[list[int], list[float]]:
    """SPECULATORS.md section 6: a packed sequence of the L context rows, the anchor's row and B
    rows of padding; the anchor is the only row the loss mask admits."""
    cfg = model.config
    L, B = taps.shape[0], cfg.block_size
    T = L + 1 + B
    hidden = torch.zeros(1, T, taps.shape[1])
    hidden[0, :L] = taps
    ids = torch.zeros(1, T, dtype=torch.long)
    ids[0, L] = token
    loss = torch.zeros(1, T)
    loss[0, L] = 1
    pos = (anchor_pos - L + torch.arange(T)).unsqueeze(0)
    with torch.no_grad():
        hf, logits, *_ = model._backbone_forward(
            hidden, ids, loss, torch.zeros(1, T, D), torch.zeros(1, T, dtype=torch.long),
            pos, max_anchors=1)
    rows = range(0, B) if cfg.sample_from_anchor else range(1, B)
    out, margins, prev = [], [], token
    for j in rows:
        u = logits[0, j]
        if hasattr(model, "candidate_selector"):
            sel = model.candidate_selector
            cand = u.topk(sel.top_k).indices
            with torch.no_grad():
                scores = sel.score_candidates(u.view(1, 1, -1), hf[:, j:j + 1],
                                              torch.tensor([[prev]]), cand.view(1, 1, -1))[0, 0]
            x = int(cand[int(scores.argmax())])
            top2 = scores.topk(2).values
        else:
            d = int(u.argmax())
            x = d + int(model.d2t[d]) if model.d2t is not None else d
            top2 = u.topk(2).values
        out.append(x)
        margins.append(float(top2[0] - top2[1]))
        prev = x
    return out, margins


# -- z-lab ----------------------------------------------------------------------------------------


def zlab_module(path: Path) -> Any:
    spec = importlib.util.spec_from_file_location("zlab_dflash_model", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"{path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def zlab_checkpoint(zlab: Any, name: str, seed: int, *, version: int, fields: dict[str, Any]
                    ) -> Any:
    from transformers import Qwen3Config

    config = Qwen3Config(vocab_size=V, hidden_size=D, intermediate_size=INTER, **fields)
    config.architectures = ["DFlash2DraftModel" if version == 2 else "DFlashDraftModel"]
    cls = zlab.DFlash2DraftModel if version == 2 else zlab.DFlashDraftModel
    model = cls(config).eval()
    redraw(model, seed)
    folder = OUT / name
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    config.to_json_file(str(folder / "config.json"))
    if "rope_theta" in fields:  # the legacy layout as transformers 4.57 wrote it
        raw = json.loads((folder / "config.json").read_text())
        raw.pop("rope_parameters", None)
        raw.update(rope_theta=fields["rope_theta"], rope_scaling=None)
        (folder / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
    # as z-lab's releases store them: the selector's codebooks without a ".weight" suffix
    state = {k.removesuffix(".weight") if "codebook" in k else k: v.detach().contiguous()
             for k, v in model.state_dict().items()}
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return model


def zlab_case(zlab: Any, model: Any, head: torch.nn.Linear, embed: torch.Tensor,
              taps: torch.Tensor, anchor_pos: int, token: int) -> tuple[list[int], list[float]]:
    """z-lab's dflash_generate for one block: the model on [context taps; block] at positions
    anchor_pos - L .. anchor_pos + B - 1, then its logits on rows 1..B-1."""
    cfg = model.config
    L, B = taps.shape[0], model.block_size
    ids = torch.full((1, B), model.mask_token_id, dtype=torch.long)
    ids[0, 0] = token
    scale = float(zlab._draft_value(cfg, "input_embedding_scale", 1.0))
    with torch.no_grad():
        noise = torch.nn.functional.embedding(ids, embed) * scale
        pos = (anchor_pos - L + torch.arange(L + B)).unsqueeze(0)
        hf = model(target_hidden=taps.unsqueeze(0), noise_embedding=noise,
                   position_ids=pos)[:, 1 - B:, :]
        logits = model.compute_logits(hf, head)  # [1, B-1, V]
        if version_of(model) == 2:
            path, cand, _ = model.propose(hf, ids[:, 0], head, 0.0)
            sel = model.candidate_selector
            proj = sel.hidden_projection(hf)
            unary = logits.gather(-1, cand)
            prev, margins = ids[:, 0], []
            for j in range(B - 1):
                scores = unary[:, j] + torch.einsum(
                    "br,bkr->bk", sel.predecessor_codebook(prev) * proj[:, j],
                    sel.successor_codebook(cand[:, j]))
                top2 = scores[0].topk(2).values
                margins.append(float(top2[0] - top2[1]))
                prev = path[:, j]
            return path[0].tolist(), margins
    top2 = logits[0].topk(2, dim=-1).values
    return logits[0].argmax(-1).tolist(), (top2[:, 0] - top2[:, 1]).tolist()


def version_of(model: Any) -> int:
    return 2 if hasattr(model, "candidate_selector") else 1


# -- the checkpoints ------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--zlab", type=Path, required=True,
                    help="z-lab's dflash/model.py (commit 1012959), outside this repository")
    args = ap.parse_args()
    zlab = zlab_module(args.zlab)
    torch.set_grad_enabled(False)
    specs: list[dict[str, Any]] = [
        dict(name="extra_spec_mqa_hd32_anchor", seed=301, kind="speculators", version=1,
             target="target_tied", format="speculators-dflash",
             layer=dict(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1,
                        head_dim=32, attention_bias=True, use_sliding_window=True,
                        sliding_window=6, max_window_layers=3,
                        layer_types=["sliding_attention", "full_attention",
                                     "sliding_attention"],
                        rope_parameters={"rope_type": "default", "rope_theta": 100000.0}),
             top=dict(block_size=5, draft_vocab_size=100, sample_from_anchor=True,
                      sliding_window_non_causal=True, aux_hidden_state_layer_ids=[1, 5, 9])),
        dict(name="extra_spec2_causal_top40", seed=302, kind="speculators", version=2,
             target="target", format="speculators-dflash2",
             layer=dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, use_sliding_window=True, sliding_window=4,
                        max_window_layers=2,
                        layer_types=["sliding_attention", "sliding_attention"],
                        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
             top=dict(block_size=7, draft_vocab_size=V, sample_from_anchor=False,
                      sliding_window_non_causal=False, aux_hidden_state_layer_ids=[2, 6],
                      conv_kernel_size=3, conv_group_size=8, selector_rank=24,
                      selector_top_k=40)),
        dict(name="extra_zlab2_scaled_yarn", seed=303, kind="zlab", version=2,
             target="target_tied", format="zlab-dflash2",
             fields=dict(num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=24, use_sliding_window=True, sliding_window=3,
                         max_window_layers=3, num_target_layers=16,
                         layer_types=["sliding_attention", "full_attention",
                                      "sliding_attention"],
                         rope_parameters={"rope_type": "yarn", "rope_theta": 1000000.0,
                                          "factor": 4.0,
                                          "original_max_position_embeddings": 64},
                         dflash_config={"block_size": 6, "mask_token_id": MASK,
                                        "target_layer_ids": [0, 7, 14],
                                        "input_embedding_scale": 1.7,
                                        "output_multiplier": 0.8,
                                        "final_logit_softcapping": 12.0,
                                        "conv_kernel_size": 2, "conv_group_size": 16,
                                        "selector_rank": 16, "selector_top_k": 6})),
        dict(name="extra_zlab_legacy_noncausal", seed=304, kind="zlab", version=1,
             target="target", format="zlab-dflash-legacy",
             fields=dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, attention_bias=True, use_sliding_window=True,
                         sliding_window=4, max_window_layers=1, num_target_layers=16,
                         rope_theta=500000.0, block_size=5, is_causal=False,
                         dflash_config={"mask_token_id": MASK, "target_layer_ids": [3, 9],
                                        "input_embedding_scale": 0.5})),
    ]
    checkpoints: dict[str, Any] = {}
    cases: list[dict[str, Any]] = []
    taps_out: dict[str, torch.Tensor] = {}
    for spec in specs:
        name, seed = spec["name"], spec["seed"]
        embed, lm = target_head(OUT / spec["target"])
        if spec["kind"] == "speculators":
            model = speculators_checkpoint(name, seed, version=spec["version"],
                                           target=spec["target"], layer=spec["layer"],
                                           top=spec["top"])
            n_taps = len(spec["top"]["aux_hidden_state_layer_ids"])
            num_spec = len(speculators_case(model, torch.zeros(1, n_taps * D), 1, 0)[0])

            def run(taps: torch.Tensor, a: int, t: int, model: Any = model) -> Any:
                return speculators_case(model, taps, a, t)
        else:
            model = zlab_checkpoint(zlab, name, seed, version=spec["version"],
                                    fields=spec["fields"])
            head = torch.nn.Linear(D, V, bias=False)
            head.weight.data.copy_(lm)
            n_taps = len(spec["fields"]["dflash_config"]["target_layer_ids"])
            num_spec = model.block_size - 1

            def run(taps: torch.Tensor, a: int, t: int, model: Any = model,
                    head: Any = head, embed: torch.Tensor = embed) -> Any:
                return zlab_case(zlab, model, head, embed, taps, a, t)
        checkpoints[name] = {"target": spec["target"], "num_spec": num_spec, "n_taps": n_taps,
                             "hidden": D, "target_vocab": V, "format": spec["format"]}
        for i, (n_rows, anchor_pos) in enumerate(CASES):
            case_seed = 1000 * seed + 17 * i
            while True:
                taps, token = case_inputs(case_seed, i, n_rows, n_taps * D)
                ids, margins = run(taps, anchor_pos, token)
                if min(margins) >= MIN_MARGIN:
                    break
                case_seed += 1
            key = f"{name}/case{i}"
            taps_out[key] = taps.to(torch.bfloat16).contiguous()
            cases.append({"checkpoint": name, "case": i, "taps_key": key, "n_rows": n_rows,
                          "anchor_pos": anchor_pos, "anchor_token": token, "num_spec": num_spec,
                          "ids": ids, "confidence": [1.0] * num_spec, "margin": margins,
                          "seed": case_seed})
            print(f"{key}: ids {ids} (margin >= {min(margins):.3g})", file=sys.stderr)
    save_file(taps_out, str(OUT / "taps_extra.safetensors"))
    (OUT / "cases_extra.json").write_text(json.dumps(
        {"checkpoints": checkpoints, "cases": cases}, indent=1) + "\n")


if __name__ == "__main__":
    main()
