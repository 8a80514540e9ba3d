"""The client's sampled-reply checks (docs/contract.md 9.2 and 9.3) at 1, 64 and 256 entries,
N = 7: ``protocol.sampled.validate`` and ``check_draws`` as they are, and optionally as they were
at a git revision (loaded from ``git show REV:protocol/sampled.py``), timed alternately in one
process so that their ratio is measured under the same load.

    python bench/bench_sampled.py [--baseline REV] [--seconds 2]

The reply is bench/bench_client.py's: every entry sampled (top_k 8, T 0.8, top_p 0.95), every
position drafted and its draw re-derivable.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import bench_client as bc  # noqa: E402

from protocol import sampled, wire  # noqa: E402
from protocol.messages import ENTRY_DTYPE  # noqa: E402


def load_revision(rev: str) -> ModuleType:
    src = subprocess.run(["git", "show", f"{rev}:protocol/sampled.py"], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "sampled_baseline.py"
    path.write_text(src.replace("from .constants", "from protocol.constants")
                    .replace("from .errors", "from protocol.errors"))
    spec = importlib.util.spec_from_file_location("sampled_baseline", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def case(n: int) -> tuple[Any, Any]:
    entries = bc.make_entries(n, True, 1)
    reply = wire.StepReply.unpack(memoryview(bc.make_reply(1, entries, True, 1))[24:])
    buf = bytearray(1 << 20)
    wire.pack_step_prefix(buf, 24, 1, entries, n, bc.ROW_BYTES)
    sent = np.frombuffer(buf, ENTRY_DTYPE, count=n, offset=56)
    return reply, sent


def timed(fn: Any, seconds: float) -> float:
    fn()
    times = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", default=None, help="a git revision to compare with")
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    impls: dict[str, ModuleType] = {"now": sampled}
    if args.baseline:
        impls[args.baseline] = load_revision(args.baseline)
    print(f"median us per call, N = {bc.N}; each figure the median of {args.rounds} rounds,"
          " implementations alternating")
    print(f"{'n':>4} {'impl':>10} | {'validate':>9} {'check_draws':>11} {'both':>8}")
    for n in (1, 64, 256):
        reply, sent = case(n)
        needed = np.ones(n, bool)
        res: dict[str, list[tuple[float, float]]] = {k: [] for k in impls}
        for _ in range(args.rounds):
            for name, mod in impls.items():
                v = timed(lambda mod=mod, r=reply, s=sent, nd=needed: mod.validate(
                    r.sampled_mask, r.support_ids, r.proposal_q, r.draft_ids, nd, bc.VOCAB,
                    s["top_k"]), args.seconds / 2)
                c = timed(lambda mod=mod, r=reply, s=sent: mod.check_draws(
                    r.sampled_mask, r.support_ids, r.proposal_q, r.draft_ids, s["seed"],
                    s["generation"], s["anchor_pos"]), args.seconds / 2)
                res[name].append((v, c))
        for name in impls:
            v = statistics.median(x[0] for x in res[name])
            c = statistics.median(x[1] for x in res[name])
            print(f"{n:>4} {name:>10} | {v:>9.1f} {c:>11.1f} {v + c:>8.1f}")


if __name__ == "__main__":
    main()
