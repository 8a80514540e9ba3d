"""Memory and time of loading a drafter at real size, worker and engine side.

    python bench/bench_loading.py make /tmp/q4b             # a Qwen3-4B-shaped checkpoint
    python bench/bench_loading.py worker /tmp/q4b           # load_drafter: peak RSS, time
    python bench/bench_loading.py engine /tmp/q4b           # hello_from_checkpoint: same
    python bench/bench_loading.py engine /tmp/q4b --no-identity-file

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


def worker(directory: Path) -> dict[str, Any]:
    import torch

    from dspark_worker.drafter import load_drafter

    before = rss_bytes()
    t0 = time.perf_counter()
    d = load_drafter(directory, device="cpu", dtype=torch.bfloat16)
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
    p.add_argument("what", choices=["make", "worker", "engine"])
    p.add_argument("directory", type=Path)
    p.add_argument("--no-identity-file", action="store_true",
                   help="engine: hash the weights even when dspark_identity.json is current")
    args = p.parse_args()
    if args.what == "make":
        make(args.directory)
        return
    out = (worker(args.directory) if args.what == "worker"
           else engine(args.directory, not args.no_identity_file))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
