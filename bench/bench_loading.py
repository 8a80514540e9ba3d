"""Memory and time of loading a drafter at real size, worker and engine side.

    python bench/bench_loading.py make /tmp/q4b             # a Qwen3-4B-shaped checkpoint
    python bench/bench_loading.py worker /tmp/q4b           # load_drafter: peak RSS, time
    python bench/bench_loading.py engine /tmp/q4b           # hello_from_checkpoint: same
    python bench/bench_loading.py engine /tmp/q4b --no-identity-file

A MiniMax-M3 drafter of the released geometry (bench_drafter.py's minimax-m3 shape), its MXFP8
layout against a bf16 twin of the same (dequantised) weights:

    python bench/bench_loading.py make-minimax /tmp/mm3   # target/: embedding and head,
                  # target/dspark/: the MXFP8 drafter (2.3 GB), bf16/: its twin (3.9 GB)
    python bench/bench_loading.py worker /tmp/mm3/target                # the MXFP8 drafter
    python bench/bench_loading.py worker /tmp/mm3/bf16 --target /tmp/mm3/target

``make`` writes random bf16 weights of the qwen3-4b shape of bench_drafter.py (2.78 GB, two
shards and an index; never commit it). ``worker`` loads it on the CPU in bf16 (the dtype of
the file, so that no cast adds a copy) and ``engine`` builds the HELLO an engine sends; each
prints one JSON line: seconds, the process's peak RSS (``ru_maxrss``) and the RSS before the
call, so the difference is what the call cost. Run each in a fresh process (as above): peak
RSS only grows. The figures and the commands are in bench/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def rss_bytes() -> int:
    with open("/proc/self/statm", "rb") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def make(directory: Path) -> None:
    import torch
    from safetensors.torch import save_file

    sys.path.insert(0, str(ROOT / "bench"))
    from bench_drafter import QWEN3_4B

    from dspark_worker.drafter.model import expected_shapes

    directory.mkdir(parents=True, exist_ok=True)
    shapes = expected_shapes(QWEN3_4B)
    names = sorted(shapes)
    half = len(names) // 2
    gen = torch.Generator().manual_seed(0)
    weight_map: dict[str, str] = {}
    total = 0
    for i, part in enumerate((names[:half], names[half:])):
        fname = f"model-{i + 1:05d}-of-00002.safetensors"
        tensors = {n: (torch.randn(shapes[n], generator=gen) * 0.02).to(torch.bfloat16)
                   for n in part}
        save_file(tensors, str(directory / fname), metadata={"format": "pt"})
        total += sum(t.nbytes for t in tensors.values())
        weight_map.update(dict.fromkeys(part, fname))
        del tensors
    (directory / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    (directory / "config.json").write_text(json.dumps(QWEN3_4B.to_json_dict(), indent=1))
    print(json.dumps({"made": str(directory), "weights_bytes": total}))


def make_minimax(directory: Path) -> None:
    """The MiniMax-M3 target's embedding and head (4.9 GB, two shards) in ``target/``, the
    drafter in ``target/dspark/`` (MXFP8 layer linears, one shard per layer) and its bf16 twin
    in ``bf16/``: the same weights, dequantised. One tensor in memory at a time."""
    import torch
    from safetensors.torch import save_file

    sys.path.insert(0, str(ROOT / "bench"))
    from bench_drafter import MINIMAX_M3

    from dspark_worker.drafter.minimax import linear_weights, minimax_shapes
    from dspark_worker.drafter.quant import quantize_mxfp8, scale_name

    c = MINIMAX_M3
    prefix = "language_model.model.dspark."
    target, mx, bf = directory / "target", directory / "target" / "dspark", directory / "bf16"
    for folder in (target, mx, bf):
        folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    shapes = minimax_shapes(c)
    quantised = set(linear_weights(c))
    groups: dict[str, list[str]] = {}
    for name in sorted(shapes):
        if name in ("embed_tokens.weight", "lm_head.weight"):
            continue
        groups.setdefault(name.split(".decoder_layer.")[0] if ".decoder_layer." in name
                          else "global", []).append(name)
    maps: dict[Path, dict[str, str]] = {mx: {}, bf: {}}
    sizes = {mx: 0, bf: 0}
    for i, (_, names) in enumerate(sorted(groups.items())):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        parts: dict[Path, dict[str, torch.Tensor]] = {mx: {}, bf: {}}
        for name in names:
            fan_in = shapes[name][-1]
            w = torch.randn(shapes[name], generator=gen) / fan_in ** 0.5
            if name in quantised:
                q, s = quantize_mxfp8(w)
                parts[mx][prefix + name], parts[mx][prefix + scale_name(name)] = q, s
                w = q.float() * torch.exp2(s.float() - 127).repeat_interleave(32, dim=1)
            else:
                parts[mx][prefix + name] = w.to(torch.bfloat16)
            parts[bf][prefix + name] = w.to(torch.bfloat16)
        for folder, part in parts.items():
            save_file(part, str(folder / fname), metadata={"format": "pt"})
            maps[folder].update(dict.fromkeys(part, fname))
            sizes[folder] += sum(t.nbytes for t in part.values())
        del parts
    for folder in (mx, bf):
        (folder / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": sizes[folder]}, "weight_map": maps[folder]}, indent=1))
        (folder / "config.json").write_text(json.dumps(c.to_json_dict(), indent=1))
    no_quant = json.loads((bf / "config.json").read_text())
    del no_quant["quantization_config"]
    (bf / "config.json").write_text(json.dumps(no_quant, indent=1))
    head: dict[str, str] = {}
    for i, name in enumerate(("language_model.model.embed_tokens.weight",
                              "language_model.lm_head.weight")):
        fname = f"model-{i + 1:05d}-of-00002.safetensors"
        t = torch.randn(c.vocab_size, c.hidden_size, generator=gen, dtype=torch.bfloat16)
        t.mul_(0.02)
        save_file({name: t}, str(target / fname), metadata={"format": "pt"})
        head[name] = fname
        del t
    (target / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": head}, indent=1))
    (target / "config.json").write_text(json.dumps({
        "architectures": ["MiniMaxM3SparseForConditionalGeneration"],
        "model_type": "minimax_m3_vl", "tie_word_embeddings": False,
        "text_config": {"model_type": "minimax_m3_vl_text", "vocab_size": c.vocab_size,
                        "hidden_size": c.hidden_size, "num_hidden_layers": 60,
                        "tie_word_embeddings": False}}, indent=1))
    print(json.dumps({"made": str(directory), "mxfp8_bytes": sizes[mx], "bf16_bytes": sizes[bf]}))


def worker(directory: Path, target: Path | None = None) -> dict[str, Any]:
    import torch

    from dspark_worker.drafter import load_drafter

    before = rss_bytes()
    t0 = time.perf_counter()
    d = load_drafter(directory, target, device="cpu", dtype=torch.bfloat16)
    return {"call": "load_drafter", "seconds": round(time.perf_counter() - t0, 2),
            "rss_before_bytes": before, "peak_rss_bytes": peak_rss_bytes(),
            "drafter_identity": d.drafter_identity.hex()[:16]}


def engine(directory: Path, use_file: bool) -> dict[str, Any]:
    from dspark_client.hello import hello_from_checkpoint
    from protocol import identity

    if not use_file:  # what an engine meets on a read-only volume, or before any worker ran
        identity.read_identity_file = lambda *a, **k: None  # type: ignore[assignment]
    before = rss_bytes()
    t0 = time.perf_counter()
    h = hello_from_checkpoint(directory, window=1024, max_slots=256)
    return {"call": "hello_from_checkpoint", "identity_file": use_file,
            "seconds": round(time.perf_counter() - t0, 3), "rss_before_bytes": before,
            "peak_rss_bytes": peak_rss_bytes(), "drafter_identity": h.drafter_identity.hex()[:16]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["make", "make-minimax", "worker", "engine"])
    p.add_argument("directory", type=Path)
    p.add_argument("--no-identity-file", action="store_true",
                   help="engine: hash the weights even when dspark_identity.json is current")
    p.add_argument("--target", type=Path, default=None,
                   help="worker: the target checkpoint (embedding and head)")
    args = p.parse_args()
    if args.what == "make":
        make(args.directory)
        return
    if args.what == "make-minimax":
        make_minimax(args.directory)
        return
    out = (worker(args.directory, args.target) if args.what == "worker"
           else engine(args.directory, not args.no_identity_file))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
