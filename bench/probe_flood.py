"""Health probes under a flood of both ports: how long /livez takes to answer while strangers
open connections to the metrics port, each with a request head they never finish, and (with
``--draft-rate``) to the draft port, each with a burst of 32 STATS never read. Each flood runs
in processes of its own (their own interpreter locks, as an attacker's would be); the probe is
a plain HTTP GET every 0.1 s from this process. Prints the probes' p50 / p90 / max.

    python bench/probe_flood.py --metrics-rate 1000 --draft-rate 1000 --duration 10
"""

from __future__ import annotations

import argparse
import http.client
import multiprocessing as mp
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for where in (ROOT, ROOT / "bench"):  # protocol, and soak's flood beside this script
    if str(where) not in sys.path:
        sys.path.insert(0, str(where))

from protocol import wire  # noqa: E402


def flood(host: str, port: int, rate: float, seconds: float, payload: bytes) -> None:
    """One flood process: ``soak.churn`` for ``seconds``."""
    from soak import churn

    stop = time.monotonic() + seconds
    churn(host, port, rate, payload, lambda: time.monotonic() >= stop)


def probe(host: str, port: int, path: str) -> float:
    t = time.perf_counter()
    c = http.client.HTTPConnection(host, port, timeout=10)
    try:
        c.request("GET", path)
        c.getresponse().read()
    finally:
        c.close()
    return time.perf_counter() - t


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--metrics-rate", type=float, default=1000.0,
                   help="new connections a second to the metrics port (2 processes)")
    p.add_argument("--draft-rate", type=float, default=0.0,
                   help="new connections a second to the draft port (2 processes; 0: none)")
    p.add_argument("--duration", type=float, default=10.0, help="seconds of flood")
    a = p.parse_args(argv)

    from tests.support.worker_proc import start_worker

    with start_worker("--window", "32", "--no-warmup") as w:
        assert w.metrics_url and w.host and w.port
        host, mport = w.metrics_url.removeprefix("http://").rsplit(":", 1)
        head = b"GET /metrics HTTP/1.1\r\nHost: x\r\n"  # the empty line never comes
        burst = b"".join(wire.frame(wire.OP_STATS, i + 1, 0) for i in range(32))
        ctx = mp.get_context("spawn")
        floods = [ctx.Process(target=flood, args=(host, int(mport), a.metrics_rate / 2,
                                                  a.duration, head)) for _ in range(2)]
        if a.draft_rate:
            floods += [ctx.Process(target=flood, args=(w.host, w.port, a.draft_rate / 2,
                                                       a.duration, burst)) for _ in range(2)]
        for f in floods:
            f.start()
        time.sleep(1.0)  # the floods are on
        took: list[float] = []
        t_end = time.monotonic() + a.duration - 1.5
        while time.monotonic() < t_end:
            took.append(probe(host, int(mport), "/livez"))
            time.sleep(0.1)
        for f in floods:
            f.join()
        took.sort()
        print(f"metrics {a.metrics_rate:g}/s, draft {a.draft_rate:g}/s: {len(took)} probes of"
              f" /livez, p50 {took[len(took) // 2] * 1e3:.1f} ms, p90"
              f" {took[int(0.9 * len(took))] * 1e3:.1f} ms, max {took[-1] * 1e3:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
