"""Acceptance of the reference pair end to end, through a real worker.

    python bench/bench_e2e.py [--prompts 16] [--new-tokens 128] [--plot bench/acceptance.png]

Held-out prompts (standard library files the training never saw), the reference target
verifying greedily, drafts from a worker process on loopback serving the embedded reference
drafter. Reported:

* mean accepted length (tokens per verify round, bonus included) and acceptance by block
  position, for W = 16, 64, 256 and the full context;
* the confidence-scheduled depth policy (Algorithm 1 over a modelled SPS table: a 20 ms step
  plus 0.25 ms per verified token) against verifying every draft: accepted length, drafts
  verified per round, and the expected tokens per second the table predicts;
* a PNG plot of acceptance by position for each W.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dspark_client import hello_from_checkpoint  # noqa: E402
from dspark_client.client import RemoteDraftClient  # noqa: E402
from dspark_client.config import RemoteConfig  # noqa: E402
from dspark_client.demo.corpus import heldout_prompts  # noqa: E402
from dspark_client.demo.speculative import (  # noqa: E402
    DecodeStats,
    RemoteDrafts,
    SpeculativeDecoder,
    sps_table_model,
)
from dspark_client.demo.target import TargetModel, default_target_dir, load_target  # noqa: E402
from dspark_client.rounds import DraftRounds  # noqa: E402
from dspark_client.schedule import SpsTable  # noqa: E402
from dspark_worker.drafter.drafter import REFERENCE_DIR  # noqa: E402
from tests.support.worker_proc import start_worker  # noqa: E402

FULL = 2048  # "full context": more than any prompt plus its generation
SLOTS = 16


def run(target: TargetModel, window: int, prompts: list[list[int]], new_tokens: int,
        depth: SpsTable | None) -> tuple[DecodeStats, int]:
    """Decode through a fresh worker of this W; returns the stats and drafts verified."""
    args = ("--window", str(window), "--max-slots", str(SLOTS), "--max-total-slots",
            str(SLOTS), "--max-rows-per-step", str(max(4096, window)), "--device", "cpu")
    with start_worker(*args) as w:
        assert w.endpoint is not None
        hello = hello_from_checkpoint(REFERENCE_DIR, window=window, max_slots=SLOTS,
                                      max_rows_per_step=max(4096, window),
                                      client_name="bench-e2e")
        client = RemoteDraftClient(RemoteConfig(endpoint=w.endpoint, timeout_ms=30_000,
                                                connect_timeout_ms=30_000), hello)
        try:
            if not client.wait_ready(60):
                raise SystemExit(f"no session: {client.last_error}")
            dec = SpeculativeDecoder(target, RemoteDrafts(DraftRounds(client)), depth=depth,
                                     max_len=FULL + 64, stop_at_eos=False)
            dec.generate(prompts, new_tokens)
        finally:
            client.close()
    return dec.stats, int(dec.stats.offered.sum())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-bytes", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--plot", type=Path, default=ROOT / "bench" / "acceptance.png")
    args = ap.parse_args()
    torch.set_num_threads(1)
    target = load_target(default_target_dir())
    prompts = heldout_prompts(args.prompts, args.prompt_bytes)
    print(f"{len(prompts)} held-out prompts of {args.prompt_bytes} bytes, {args.new_tokens}"
          " new tokens each, greedy, N = 7")
    print(f"{'W':>6}  {'accepted length':>15}  acceptance by position")
    curves: dict[str, list[float]] = {}
    for window in (16, 64, 256, FULL):
        st, _ = run(target, window, prompts, args.new_tokens, None)
        label = "full" if window == FULL else str(window)
        curves[label] = st.per_position_acceptance
        print(f"{label:>6}  {st.mean_accepted_length:15.2f}  "
              + " ".join(f"{x:.2f}" for x in st.per_position_acceptance))
    table = sps_table_model()
    print("\ndepth policy (W = full; SPS model: 20 ms + 0.25 ms per verified token)")
    print(f"{'policy':>10}  {'accepted length':>15}  {'drafts verified/round':>21}"
          f"  {'expected tokens/s':>17}")
    for name, depth in (("off", None), ("algorithm1", table)):
        st, verified = run(target, FULL, prompts, args.new_tokens, depth)
        rounds = max(st.rounds, 1)
        per_round = verified / rounds
        tokens_per_round = st.tokens / rounds
        batch_tokens = len(prompts) + per_round
        sps = float(np.interp(batch_tokens, table.batch_tokens, table.steps_per_s))
        print(f"{name:>10}  {st.mean_accepted_length:15.2f}  {per_round:21.1f}"
              f"  {tokens_per_round * sps:17.0f}")
    plot(curves, args.plot)
    print(f"\nplot: {args.plot}")


def plot(curves: dict[str, list[float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    for label, ys in curves.items():
        ax.plot(range(1, len(ys) + 1), ys, marker="o", label=f"W = {label}")
    ax.set_xlabel("draft position in the block")
    ax.set_ylabel("acceptance (accepted / offered)")
    ax.set_ylim(0, 1)
    ax.set_title("Reference pair, held-out text, greedy, N = 7")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    main()
