"""The client's sampled-reply checks (docs/contract.md 9.2 and 9.3) at 1, 64 and 256 entries,
N = 7: ``protocol.sampled.validate``, ``check_draws`` and the one-pass ``check_reply`` the client
runs (at a revision without it: the two in turn), and where there is ``ReplyCheck`` the same in
its two parts, ``ahead`` (made from the request: every u) and ``check`` (the reply; what is
left on the round's critical path), as they are and optionally as they were at a
git revision (loaded from ``git show REV:protocol/sampled.py``), timed alternately in one process
so that their ratio is measured under the same load.

    python bench/bench_sampled.py [--baseline REV] [--seconds 2] [--top-k 16]

The reply is bench/bench_client.py's: every entry sampled (top_k 16 unless --top-k says, T 0.8,
top_p 0.95), every position drafted and its draw re-derivable.
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
    ap.add_argument("--top-k", type=int, default=bc.TOP_K)
    args = ap.parse_args()
    bc.TOP_K = args.top_k
    impls: dict[str, ModuleType] = {"now": sampled}
    if args.baseline:
        impls[args.baseline] = load_revision(args.baseline)
    print(f"median us per call, N = {bc.N}; each figure the median of {args.rounds} rounds,"
          " implementations alternating")
    print(f"top_k {bc.TOP_K}")
    print(f"{'n':>4} {'impl':>10} | {'validate':>9} {'check_draws':>11} {'check_reply':>11}"
          f" {'ahead':>7} {'check':>7}")
    for n in (1, 64, 256):
        reply, sent = case(n)
        needed = np.ones(n, bool)
        res: dict[str, list[tuple[float, ...]]] = {k: [] for k in impls}
        for _ in range(args.rounds):
            for name, mod in impls.items():
                # Scratch arrays kept between calls where the revision has them (as the client)
                kw = {"scratch": mod.Scratch()} if hasattr(mod, "Scratch") else {}
                v = timed(lambda mod=mod, r=reply, s=sent, nd=needed, kw=kw: mod.validate(
                    r.sampled_mask, r.support_ids, r.proposal_q, r.draft_ids, nd, bc.VOCAB,
                    s["top_k"], **kw), args.seconds / 3)
                c = timed(lambda mod=mod, r=reply, s=sent, kw=kw: mod.check_draws(
                    r.sampled_mask, r.support_ids, r.proposal_q, r.draft_ids, s["seed"],
                    s["generation"], s["anchor_pos"], **kw), args.seconds / 3)
                b = timed(lambda mod=mod, r=reply, s=sent, nd=needed, kw=kw: both(
                    mod, r, s, nd, kw), args.seconds / 3)
                a = k = float("nan")
                if hasattr(mod, "ReplyCheck"):  # check_reply in its two parts
                    a = timed(lambda mod=mod, s=sent, kw=kw, n=n: ahead(mod, s, n, kw),
                              args.seconds / 3)
                    made = ahead(mod, sent, n, kw)
                    k = timed(lambda made=made, r=reply, nd=needed: made.check(
                        r.sampled_mask, r.support_ids, r.proposal_q, r.draft_ids, nd),
                        args.seconds / 3)
                res[name].append((v, c, b, a, k))
        for name in impls:
            v, c, b, a, k = (statistics.median(x[i] for x in res[name]) for i in range(5))
            print(f"{n:>4} {name:>10} | {v:>9.1f} {c:>11.1f} {b:>11.1f} {a:>7.1f} {k:>7.1f}")


def ahead(mod: ModuleType, s: Any, n: int, kw: dict[str, Any]) -> Any:
    """The request's part, made before the reply is in (what the client does in the round
    trip)."""
    return mod.ReplyCheck(s["seed"], s["generation"], s["anchor_pos"], s["top_k"], bc.N,
                          bc.VOCAB, asked=np.ones(n, bool), **kw)


def both(mod: ModuleType, r: Any, s: Any, needed: Any, kw: dict[str, Any]) -> None:
    """What the client runs on a sampled reply: ``check_reply``, or where a revision lacks it,
    ``validate`` then ``check_draws``."""
    args = (r.sampled_mask, r.support_ids, r.proposal_q, r.draft_ids)
    if hasattr(mod, "check_reply"):
        mod.check_reply(*args, needed, bc.VOCAB, s["top_k"], s["seed"], s["generation"],
                        s["anchor_pos"], **kw)
    else:
        mod.validate(*args, needed, bc.VOCAB, s["top_k"])
        mod.check_draws(*args, s["seed"], s["generation"], s["anchor_pos"])


if __name__ == "__main__":
    main()
