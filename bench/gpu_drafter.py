"""The drafter's device check, one script: the GPU tests, then the captured-step benchmarks.

    python bench/gpu_drafter.py            # under 10 minutes (limits below), fits one run call
    python bench/gpu_drafter.py --quick    # the large shapes at B = 1, 64 only
    python bench/gpu_drafter.py --shapes speculators-8b   # the tests, then only that shape
    python bench/gpu_drafter.py --shapes kimi-k3   # the tests, then Kimi-K3 (W = 4096)

For a GPU host as found: torch with CUDA, numpy, safetensors, uvloop and prometheus-client
installed, the project not installed (its torch pin would refuse the host's torch) but put on
PYTHONPATH here, and what is missing (msgspec; pytest and its few dependencies) brought as
wheels in ``.whl/`` beside this checkout (or ``--wheels DIR``), unpacked into a temporary folder
that goes on PYTHONPATH too; nothing is installed into the host's environment. Fill ``.whl/``
where there is network, for the host's Python:

    pip download --only-binary :all: --no-deps -d .whl --python-version 3.11 \\
        msgspec pytest pluggy iniconfig packaging pygments

Runs, each under its own time limit so that one hang cannot eat the device budget:
  1. pytest -m gpu tests/worker/drafter
       (the CPU equalities on CUDA, every family; each bucket's graph captured, self-checked
        and equal to the eager step; no host synchronisation inside the step)
  2. bench_drafter --device cuda --shape qwen3-4b --graphs        (B = 1, 8, 64, 256, W = 1024)
  3. bench_drafter --device cuda --shape gemma4-12b --graphs      (B = 1, 8, 64, 256, W = 1024)
  4. bench_drafter --device cuda --shape speculators-8b --graphs  (B = 1, 8, 64, 256, W = 1024)
  5. bench_drafter --device cuda --shape minimax-m3 --graphs      (B = 1, 8, 64, 256, W = 4096)
  (--shapes kimi-k3: bench_drafter --device cuda --shape kimi-k3 --graphs, B = 1, 8, 64, 256 at
   W = 4096, 9.5 GB of bf16 weights; 150 + 240 s, a run call of its own)
Each benchmark prints per B the eager and graph step times (greedy and sampled), the step's own
floor measured in the same run (a bf16 GEMM of its FLOPs, a device copy moving its weight and
ring bytes) and the ratios. The limits sum to 510 s. Everything printed is also written to
$OUT/gpu_drafter.txt when $OUT is set. The exit status is the tests' (a benchmark failure is
reported but does not hide a test result).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NEEDED = ("msgspec", "pytest")  # modules the host may lack
TESTS_LIMIT_S = 150
# Each large shape's benchmark limit: with the tests' they sum to 510 s, one run call's 600 s
# less the start and the wheels.
LIMITS = {"qwen3-4b": 90, "gemma4-12b": 90, "speculators-8b": 90, "minimax-m3": 90,
          "kimi-k3": 240}  # kimi-k3 is not in the default run: ``--shapes kimi-k3`` alone


def run(title: str, cmd: list[str], timeout_s: int, log: list[str], env: dict[str, str]) -> int:
    header = f"== {title}: {' '.join(cmd)} (limit {timeout_s} s)"
    print(header, flush=True)
    log.append(header)
    t0 = time.perf_counter()
    try:
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s,
                              check=False, env=env)
        text, rc = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        text, rc = out + f"\nTIMED OUT after {timeout_s} s\n", 124
    footer = f"-- rc {rc}, {time.perf_counter() - t0:.1f} s"
    print(text, footer, sep="", flush=True)
    log.extend([text, footer])
    return rc


def unpack_wheels(folder: Path, into: Path, log: list[str]) -> list[str]:
    """Unpack every wheel of ``folder`` into ``into`` (a wheel is a zip of its import tree) when
    one of NEEDED is missing; returns what it unpacked."""
    missing = [m for m in NEEDED if importlib.util.find_spec(m) is None]
    if not missing:
        return []
    wheels = sorted(folder.glob("*.whl")) if folder.is_dir() else []
    note = f"== missing {', '.join(missing)}: unpacking {len(wheels)} wheels from {folder}"
    print(note, flush=True)
    log.append(note)
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as z:
            z.extractall(into)
    return [w.name for w in wheels]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--wheels", type=Path, default=ROOT / ".whl")
    parser.add_argument("--shapes", default="qwen3-4b,gemma4-12b,speculators-8b,minimax-m3",
                        help="comma-separated large shapes to time")
    args = parser.parse_args()
    unknown = sorted(set(args.shapes.split(",")) - set(LIMITS))
    if unknown:
        parser.error(f"--shapes {','.join(unknown)}: not one of {', '.join(LIMITS)}")
    py = sys.executable
    log: list[str] = []
    with tempfile.TemporaryDirectory(prefix="dspark-wheels-") as site:
        unpack_wheels(args.wheels, Path(site), log)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            [str(ROOT), site] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        tests = [py, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                 "tests/worker/drafter"]
        tests_rc = run("gpu tests", tests, TESTS_LIMIT_S, log, env)
        batches = "1,64" if args.quick else "1,8,64,256"
        for shape in args.shapes.split(","):
            run(f"{shape} shape on cuda, eager and graphs",
                [py, "bench/bench_drafter.py", "--device", "cuda", "--shape", shape,
                 "--batches", batches, "--graphs", "--iters", "20"], LIMITS[shape], log, env)
    out = os.environ.get("OUT")
    if out:
        Path(out, "gpu_drafter.txt").write_text("\n".join(log))
    sys.exit(tests_rc)


if __name__ == "__main__":
    main()
