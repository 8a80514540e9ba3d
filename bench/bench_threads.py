"""A CPU worker's round trip by ``--threads``, alone and beside busy neighbour processes.

    python bench/bench_threads.py                       # threads 1 and 0 (torch's default)
    python bench/bench_threads.py --threads 1 2 0 --busy 0 1 2 --steps 200

For each thread count a worker (embedded reference drafter, CPU, ``OMP_NUM_THREADS`` = the
core count, which is what ``--threads 0`` then keeps) is started; for each number
of busy neighbours that many processes spin on the CPU, and ``dspark-client bench --batch 8``
measures the round trip. One JSON line per case: p50 / p90 / p99 of the RTT in ms. Medians of
a shared machine move with what else runs: compare cases of one run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.support.worker_proc import start_worker  # noqa: E402

SPIN = "while True:\n    pass\n"


@contextlib.contextmanager
def busy(n: int) -> Iterator[None]:
    procs = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(n)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 0])
    p.add_argument("--busy", type=int, nargs="+", default=[0, 1])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=8)
    args = p.parse_args()
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    for threads in args.threads:
        with start_worker("--threads", str(threads), "--device", "cpu", "--window", "256",
                          "--max-total-slots", "16", "--max-slots", "16",
                          env={"OMP_NUM_THREADS": str(os.cpu_count())}) as w:
            assert w.endpoint is not None
            for n_busy in args.busy:
                with busy(n_busy):
                    out = subprocess.run(
                        [sys.executable, "-m", "dspark_client.cli", "--endpoint", w.endpoint,
                         "bench", "--batch", str(args.batch), "--steps", str(args.steps),
                         "--json"], capture_output=True, text=True, env=env, cwd=ROOT,
                        timeout=900)
                r = json.loads(out.stdout) if out.returncode == 0 else {}
                rtt = r.get("rtt_ms", {})
                print(json.dumps({"threads": threads, "busy_neighbours": n_busy,
                                  "batch": args.batch, "cores": os.cpu_count(),
                                  "rtt_p50_ms": round(rtt.get("p50", float("nan")), 2),
                                  "rtt_p90_ms": round(rtt.get("p90", float("nan")), 2),
                                  "rtt_p99_ms": round(rtt.get("p99", float("nan")), 2),
                                  "failed_rounds": r.get("failed_rounds"),
                                  "exit": out.returncode}), flush=True)


if __name__ == "__main__":
    main()
