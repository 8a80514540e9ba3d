"""The drafter's device check, one script: the GPU tests, then the CUDA benchmarks.

    python bench/gpu_drafter.py            # under 10 minutes (limits below), fits one run call
    python bench/gpu_drafter.py --quick    # the large shapes at B = 1, 64 only
    python bench/gpu_drafter.py --shapes speculators-8b   # the tests, then only that shape

Runs, each under its own time limit so that one hang cannot eat the device budget:
  1. pytest -m gpu tests/worker/drafter       (CUDA path of the CPU equalities, every family)
  2. bench_drafter --device cuda --shape tiny
  3. bench_drafter --device cuda --shape qwen3-4b --sampled     (B = 1, 16, 64, 256, W = 1024)
  4. bench_drafter --device cuda --shape gemma4-12b --sampled   (B = 1, 16, 64, 256, W = 1024)
  5. bench_drafter --device cuda --shape speculators-8b --sampled   (the same B and W)
Everything printed is also written to $OUT/gpu_drafter.txt when $OUT is set. The exit status is
the tests' (a benchmark failure is reported but does not hide a test result).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(title: str, cmd: list[str], timeout_s: int, log: list[str]) -> int:
    header = f"== {title}: {' '.join(cmd)} (limit {timeout_s} s)"
    print(header, flush=True)
    log.append(header)
    t0 = time.perf_counter()
    try:
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s,
                              check=False)
        text, rc = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        text, rc = out + f"\nTIMED OUT after {timeout_s} s\n", 124
    footer = f"-- rc {rc}, {time.perf_counter() - t0:.1f} s"
    print(text, footer, sep="", flush=True)
    log.extend([text, footer])
    return rc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--shapes", default="qwen3-4b,gemma4-12b,speculators-8b",
                        help="comma-separated large shapes to time")
    args = parser.parse_args()
    py = sys.executable
    log: list[str] = []
    tests_rc = run("gpu tests", [py, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                                 "tests/worker/drafter"], 130, log)
    batches = "1,64" if args.quick else "1,16,64,256"
    run("tiny on cuda", [py, "bench/bench_drafter.py", "--device", "cuda", "--shape", "tiny",
                         "--batches", "1,16,64,256", "--sampled"], 35, log)
    limits = {"qwen3-4b": 140, "gemma4-12b": 150, "speculators-8b": 140}
    for shape in args.shapes.split(","):
        limit_s = limits[shape]
        run(f"{shape} shape on cuda", [py, "bench/bench_drafter.py", "--device", "cuda",
                                       "--shape", shape, "--batches", batches, "--sampled"],
            limit_s, log)
    out = os.environ.get("OUT")
    if out:
        Path(out, "gpu_drafter.txt").write_text("\n".join(log))
    sys.exit(tests_rc)


if __name__ == "__main__":
    main()
