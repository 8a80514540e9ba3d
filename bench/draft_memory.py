"""Peak host memory of one draft step: B lanes of a Qwen3-4B-shaped drafter (random weights),
fp32 on the CPU, greedy and then every lane sampled.

    python bench/draft_memory.py                        # B = 64
    PYTHONPATH=/path/to/other/tree python bench/draft_memory.py   # another version's drafter

The figure is what one ``Drafter.draft`` call adds to the process's resident set at its peak:
the high-water mark (Linux ``VmHWM``, reset through ``/proc/self/clear_refs`` just before the
call) minus the resident set just before it. Weights, rings and the draft's inputs are there
before the reset, so what is left is the step's own working memory: activations, the base
logits and the Markov walk's vocabulary-wide temporaries. It needs only the drafter API that
every version has (``build_model``, ``Drafter.draft``), so the same script measures an older
tree (``git archive <commit> | tar -x -C /tmp/before``) for the before figure.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_drafter import QWEN3_4B, random_rows

from dspark_worker.drafter import Drafter, SamplingParams
from dspark_worker.drafter.embedded import init_random_
from dspark_worker.drafter.families import build_model


def status_kib(field: str) -> int:
    text = Path("/proc/self/status").read_text()
    match = re.search(rf"^{field}:\s+(\d+) kB", text, re.MULTILINE)
    if match is None:
        raise RuntimeError(f"/proc/self/status has no {field}")
    return int(match.group(1))


def peak_mib(fn: object) -> tuple[float, float]:
    """(MiB the call adds to the resident set at its peak, seconds)."""
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = status_kib("VmRSS")
    t0 = time.perf_counter()
    fn()  # type: ignore[operator]
    seconds = time.perf_counter() - t0
    return (status_kib("VmHWM") - before) / 1024, seconds


def main() -> None:
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") is None:
        # Every allocation above 128 KiB gets its own mapping, returned to the system when
        # freed: the resident set then follows the live tensors (with glibc's default, a
        # heap grown by one draft stays resident and the figure moved by 100 MiB run to run).
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(128 << 10)
        os.execv(sys.executable, [sys.executable, *sys.argv])
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--window", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=1, help="measure each mode this often")
    parser.add_argument("--head-budget-mib", type=int, default=None,
                        help="the walk's LM head output budget (versions that have one)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    import dspark_worker
    from dspark_worker.drafter import walk

    if args.head_budget_mib is not None:
        walk.HEAD_BYTES_BUDGET = args.head_budget_mib << 20  # type: ignore[attr-defined]
    budget = getattr(walk, "HEAD_BYTES_BUDGET", None)

    b, w = args.batch, args.window
    model = build_model(QWEN3_4B, None, device="cpu", dtype=torch.float32)
    init_random_(model, seed=1)
    drafter = Drafter(model, drafter_identity=bytes(32), markov_identity=bytes(32),
                      source="qwen3-4b")
    pool = drafter.new_pool(b, w)
    lanes = pool.allocate(b)
    pool.apply(lanes, np.full(b, w), np.full(b, w), np.ones(b, dtype=bool),
               random_rows(b * w, drafter, seed=3))
    anchors = np.full(b, w, dtype=np.int64)
    tokens = np.arange(b, dtype=np.int64) * 101
    params = SamplingParams(top_k=np.full(b, 32), temperature=np.ones(b), top_p=np.full(b, 0.9),
                            seed=np.arange(b, dtype=np.uint64), generation=np.zeros(b))
    print(f"drafter from {Path(dspark_worker.__file__).resolve().parent.parent}")
    print(f"qwen3-4b shape, fp32 on the CPU, B {b}, N {drafter.num_spec}, W {w},"
          f" vocab {drafter.vocab_size}, {torch.get_num_threads()} thread(s);"
          f" resident before the draft: {status_kib('VmRSS') / 2**20:.2f} GiB")
    print(f"[B, N, V] fp32 would be {b * drafter.num_spec * drafter.vocab_size * 4 / 2**20:.0f}"
          " MiB; LM head budget: " + ("none" if budget is None else f"{budget >> 20} MiB"))
    for name, sampling in (("greedy", None), ("sampled", params)) * args.repeat:
        with torch.inference_mode():
            mib, seconds = peak_mib(lambda s=sampling: drafter.draft(pool, lanes, anchors, tokens,
                                                                     sampling=s))
        print(f"{name:>8}: peak +{mib:7.0f} MiB over the resident set, {seconds:.1f} s")


if __name__ == "__main__":
    main()
