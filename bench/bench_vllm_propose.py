"""The vLLM plugin's ``propose`` at a real row size: what the speculator adds to the round.

    python bench/bench_vllm_propose.py [--steps 50] [--reqs 64] [--accept 4] [--window 64]

Run in an environment with vLLM 0.34 (``.venv-vllm``, made by ``.ci/run``). A real worker
serves ``bench_worker.taps_25600_checkpoint`` (Qwen3-4B-shaped taps: 5 layers x 2560, bf16,
25,600-byte rows; N = 7) on the CPU; ``RemoteDSparkSpeculator`` is built from vLLM's configs
for a Qwen3-shaped target of that hidden size. Every request prefills W tokens, then each step
every request verifies its 7 drafts and accepts ``--accept`` (so ``accept + 1`` new rows per
request and step, ``reqs * (accept + 1)`` rows per round). Per step, medians over the steps,
µs:

* propose: the call, as the runner waits for it;
* run_batch: the ``DraftRounds.run_batch`` inside it (client work and the round trip);
* speculator: propose less run_batch: the layout copy, the row gather, cast and host copy,
  packing and unpacking the drafts (here on the CPU, so the "device" work is CPU work too).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "tests" / "vllm")]

from bench_worker import taps_25600_checkpoint  # noqa: E402

from tests.support.worker_proc import start_worker  # noqa: E402

HIDDEN, TAPS, LAYERS, N = 2560, 5, 36, 7


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--reqs", type=int, default=64)
    p.add_argument("--accept", type=int, default=4)
    p.add_argument("--window", type=int, default=64)
    args = p.parse_args()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import torch
        from vllm.plugins import load_general_plugins
        from vllm_engine import (
            CPU,
            input_batch,
            model_config,
            propose,
            speculative_config,
            target_folder,
            vllm_config,
        )

        from dspark_vllm.speculator import RemoteDSparkSpeculator
    load_general_plugins()
    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="dspark-bench-vllm-"))
    ckpt = taps_25600_checkpoint(str(tmp / "ckpt"))
    target = model_config(target_folder(tmp / "target", vocab=512, hidden=HIDDEN,
                                        layers=LAYERS))
    R, W, a = args.reqs, args.window, args.accept
    with start_worker("--checkpoint", ckpt, "--window", str(W), "--max-slots", str(R),
                      "--max-total-slots", str(R), "--max-rows-per-step", str(R * W),
                      "--device", "cpu") as w:
        spec = speculative_config(target, ckpt, speculator_options={
            "endpoint": w.endpoint, "window": W, "timeout_ms": 60_000,
            "connect_timeout_ms": 30_000, "max_rows_per_step": R * W})
        speculator = RemoteDSparkSpeculator(vllm_config(target, spec, max_num_seqs=R), CPU)
        rounds = speculator.rounds
        assert rounds is not None and rounds.client.ready, rounds.client.last_error
        inner: list[float] = []
        run_batch = rounds.run_batch

        def timed(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return run_batch(*a, **k)
            finally:
                inner.append(time.perf_counter() - t0)

        rounds.run_batch = timed  # type: ignore[method-assign]
        for i in range(R):
            speculator.add_request(i)
        ids = [f"r{i}" for i in range(R)]
        index = np.arange(R)
        last = torch.zeros(R, 1, dtype=torch.int64)
        nxt = torch.zeros(1, R, dtype=torch.int32)
        rng = torch.Generator().manual_seed(0)

        def step(sched: int, computed: int, prompt: int, sampled: int, rejected: int) -> float:
            batch = input_batch(ids, index, np.full(R, sched), np.full(R, computed),
                                np.full(R, prompt), R * sched)
            aux = [torch.randn(R * sched, HIDDEN, generator=rng).to(torch.bfloat16)
                   for _ in range(TAPS)]
            t0 = time.perf_counter()
            out = propose(speculator, batch, aux, np.full(R, sampled, np.int32),
                          np.full(R, rejected, np.int32), last, nxt, N)
            took = time.perf_counter() - t0
            if not out.any():
                raise SystemExit(f"no drafts: {rounds.client.stats.snapshot()}")
            return took

        step(W, 0, W, 1, 0)  # the prompts: W rows each
        computed, total, within = W, [], []
        for s in range(args.warmup + args.steps):
            took = step(N + 1, computed, W, a + 1, N - a)
            computed += a + 1
            if s >= args.warmup:
                total.append(took)
                within.append(inner[-1])
        rounds.client.close()
    us = 1e6
    med_p, med_r = statistics.median(total) * us, statistics.median(within) * us
    rows = R * (a + 1)
    print(f"{R} requests, {rows} rows of {TAPS * HIDDEN * 2} bytes per round"
          f" ({rows * TAPS * HIDDEN * 2 / 1e6:.1f} MB), W {W}, N {N}; medians of {args.steps}")
    print(f"propose      {med_p:9.0f} us")
    print(f"run_batch    {med_r:9.0f} us")
    print(f"speculator   {med_p - med_r:9.0f} us  ({(med_p - med_r) / med_p:.0%} of propose)")


if __name__ == "__main__":
    main()
