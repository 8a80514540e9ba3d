"""A fleet on one machine: E engine processes x S slots over K workers behind one DNS name,
with the worker set scaled during the run, to see what a scale event costs.

Workers run on loopback addresses 127.0.0.2, .3, ... (one port, the embedded tiny drafter on
the CPU); the engines' endpoint is ``dns+tcp://fleet.bench:PORT`` and their resolver reads the
DNS answer from a file this script rewrites (the engines are separate processes). Each engine
is a ``RemoteDraftClient`` + ``DraftRounds`` with synthetic tap rows, one round every
``--interval-ms``, accepting a random number of drafts per slot.

Timeline: a steady phase on K workers, then one event per phase:

* ``add``: a (K+1)-th worker joins the DNS answer (a StatefulSet scaled up);
* ``drain``: one worker is taken out of the answer and sent SIGTERM (scaled down: it answers
  ST_DRAINING while it drains);
* ``kill``: one worker is SIGKILLed and taken out of the answer a second later (a node lost).

Per phase it prints the rounds, target-only rounds (the worker did not answer: failed or
moving), slot-rounds without drafts (slots waiting for their resync rows, or in a target-only
round), RTT percentiles of the drafted rounds, resync rows (rows sent beyond the rows the
engines produced in the phase: what the moves cost) and their bytes, and per event the engines
that moved against the rendezvous ideal (E/(n+1) for an add, the engines on the worker for a
removal; a modulo placement would move about E x n/(n+1)). Not a CI test: run it by hand,

    python bench/fleet.py --engines 6 --slots 8 --workers 2 --phase-s 6

Figures go in bench/README.md with the command that produced them.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing as mp
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

NAME = "fleet.bench"
REFERENCE_DIR = ROOT / "dspark_worker" / "drafter" / "reference"  # the embedded default's files


class FileResolver:
    """A resolver whose answer is a file of addresses, one per line (picklable)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __call__(self, name: str, port: int) -> list[str]:
        if name != NAME:
            raise OSError(f"{name}: no such name")
        return Path(self.path).read_text().split()


def engine_main(idx: int, a: dict[str, Any], port: int, dns_file: str, start_at: float,
                stop_at: float, out: Any) -> None:
    from dspark_client.client import RemoteDraftClient
    from dspark_client.config import RemoteConfig
    from dspark_client.hello import hello_from_checkpoint
    from dspark_client.rounds import DraftRounds, SlotRequest

    S, W = a["slots"], a["window"]
    hello = hello_from_checkpoint(REFERENCE_DIR, window=W, max_slots=S,
                                  max_rows_per_step=S * W, client_name=f"fleet-engine-{idx}")
    cfg = RemoteConfig(endpoint=f"dns+tcp://{NAME}:{port}", timeout_ms=a["timeout_ms"],
                       connect_timeout_ms=2000, backoff_ms=20, backoff_max_ms=500,
                       return_after_ms=a["quiet_ms"], resolve_interval_ms=a["resolve_ms"])
    client = RemoteDraftClient(cfg, hello, resolver=FileResolver(dns_file))
    if not client.wait_ready(120):
        out.put((idx, None, f"no session: {client.last_error}"))
        return
    rounds = DraftRounds(client)
    rng = np.random.default_rng(idx)
    row_bytes = hello.row_bytes
    anchor = [int(rng.integers(W, 4 * W)) for _ in range(S)]
    fresh = list(anchor)  # rows not yet handed to the client: the whole prompt at first
    gen = [1] * S
    records = []
    while time.time() < start_at:
        time.sleep(0.005)
    next_round = time.monotonic()
    while time.time() < stop_at:
        reqs = []
        n_fresh = 0
        for s in range(S):
            n = fresh[s]
            rows = rng.integers(0, 255, size=(n, row_bytes), dtype=np.uint8)
            rows[:, 1::2] &= 0x3F  # bf16 high bytes of small finite values
            n_fresh += n
            reqs.append(SlotRequest(slot=s, generation=gen[s], anchor_pos=anchor[s],
                                    anchor_token=int(rng.integers(0, hello.vocab_size)), rows=rows,
                                    n_out=hello.num_spec))
            fresh[s] = 0
        res = rounds.run(reqs)
        records.append((time.time(), bool(res.ok), float(res.rtt_us), int(res.rows_sent),
                        n_fresh, int(res.resynced), client.endpoint,
                        int((res.num_drafted == 0).sum())))
        for s in range(S):  # the target verifies: 0..N drafts accepted, plus its own token
            k = int(rng.integers(0, hello.num_spec + 1)) if res.ok else 0
            anchor[s] += k + 1
            fresh[s] += k + 1
        next_round += a["interval_ms"] / 1000.0
        delay = next_round - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        else:
            next_round = time.monotonic()
    client.close()
    out.put((idx, records, ""))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engines", type=int, default=6)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--workers", type=int, default=2, help="K at the start")
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--phase-s", type=float, default=6.0)
    ap.add_argument("--interval-ms", type=float, default=20.0)
    ap.add_argument("--timeout-ms", type=float, default=500.0)
    ap.add_argument("--quiet-ms", type=float, default=1000.0, help="return_after_ms")
    ap.add_argument("--resolve-ms", type=float, default=500.0, help="resolve_interval_ms")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    from dspark_client.placement import rank
    from tests.support.worker_proc import start_worker

    k0 = a.workers
    hosts = [f"127.0.0.{i + 2}" for i in range(k0 + 1)]
    s = __import__("socket").socket()
    s.bind((hosts[0], 0))
    port = s.getsockname()[1]
    s.close()
    wargs = ("--window", str(a.window), "--max-slots", str(a.slots), "--max-total-slots",
             str(a.slots * a.engines * 2), "--device", "cpu", "--drain-s", "5")
    with concurrent.futures.ThreadPoolExecutor(len(hosts)) as pool:
        workers = list(pool.map(lambda h: start_worker(*wargs, "--listen", f"{h}:{port}",
                                                       "--worker-name", f"fleet-{h}",
                                                       timeout=300), hosts))
    tmp = tempfile.mkdtemp(prefix="dspark-fleet-")
    dns_file = os.path.join(tmp, "answer")

    def answer(listed: list[str]) -> None:
        Path(dns_file + ".new").write_text("\n".join(listed) + "\n")
        os.replace(dns_file + ".new", dns_file)

    answer(hosts[:k0])
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    warm_s = 15.0  # engine processes import and HELLO before the clock starts
    start_at = time.time() + warm_s
    events = ["add", "drain", "kill"]
    phase_s = a.phase_s
    stop_at = start_at + phase_s * (len(events) + 1)
    procs = [ctx.Process(target=engine_main, args=(i, vars(a), port, dns_file, start_at,
                                                   stop_at, out)) for i in range(a.engines)]
    for p in procs:
        p.start()
    listed = hosts[:k0]
    marks = [("steady", start_at, list(listed))]
    try:
        for i, ev in enumerate(events):
            t_ev = start_at + phase_s * (i + 1)
            time.sleep(max(0.0, t_ev - time.time()))
            if ev == "add":
                listed = hosts[:k0 + 1]
                answer(listed)
            elif ev == "drain":  # a StatefulSet scaled down loses its highest ordinal
                victim = listed[-1]
                listed = [h for h in listed if h != victim]
                answer(listed)
                workers[hosts.index(victim)].proc.send_signal(signal.SIGTERM)
            elif ev == "kill":
                victim = listed[0]
                workers[hosts.index(victim)].proc.kill()
                time.sleep(1.0)
                listed = [h for h in listed if h != victim]
                answer(listed)
            marks.append((ev, t_ev, list(listed)))
        results: dict[int, list[Any]] = {}
        for _ in procs:
            idx, records, info = out.get(timeout=stop_at - time.time() + 120)
            if records is None:
                raise SystemExit(f"engine {idx}: {info}")
            results[idx] = records
        for p in procs:
            p.join(30)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for w in workers:
            w.kill()

    from dspark_client.hello import hello_from_checkpoint

    row_bytes = hello_from_checkpoint(REFERENCE_DIR, window=a.window, max_slots=1).row_bytes
    rows_out = []
    prev_where: dict[int, str] | None = None
    for pi, (label, t0, listed_now) in enumerate(marks):
        t1 = marks[pi + 1][1] if pi + 1 < len(marks) else stop_at
        recs = [(i, r) for i, rs in results.items() for r in rs if t0 <= r[0] < t1]
        ok = [r for _, r in recs if r[1]]
        rtts = np.array([r[2] for r in ok]) if ok else np.zeros(1)
        # Rows sent beyond the rows the engines produced in the phase: the resyncs.
        resync_rows = max(0, sum(r[3] for _, r in recs) - sum(r[4] for _, r in recs))
        where = {}
        for i, rs in results.items():
            last = [r for r in rs if r[0] < t1]
            if last:
                where[i] = last[-1][6]
        moved = (sum(1 for i in where if prev_where is not None and prev_where.get(i) != where[i])
                 if prev_where is not None else 0)
        n_before = len(marks[pi - 1][2]) if pi else len(listed_now)
        if label == "add":
            ideal = a.engines / len(listed_now)
        elif label in ("drain", "kill") and prev_where is not None:
            gone = {f"tcp://{h}:{port}" for h in marks[pi - 1][2]} - {
                f"tcp://{h}:{port}" for h in listed_now}
            ideal = sum(1 for i in prev_where if prev_where[i] in gone)
        else:
            ideal = 0
        rows_out.append(dict(
            phase=label, workers=len(listed_now), rounds=len(recs),
            target_only=len(recs) - len(ok),
            undrafted_slots=sum(r[7] for _, r in recs),
            rtt_p50_us=float(np.percentile(rtts, 50)), rtt_p90_us=float(np.percentile(rtts, 90)),
            rtt_p99_us=float(np.percentile(rtts, 99)), resync_rows=resync_rows,
            resync_mib=resync_rows * row_bytes / 2**20, moved=moved, ideal=round(ideal, 2),
            modulo=round(a.engines * (1 - 1 / max(n_before, len(listed_now))), 2)
            if label != "steady" else 0))
        prev_where = where
    # Every engine ended on its best-ranked live worker?
    final_listed = [f"tcp://{h}:{port}" for h in marks[-1][2]]
    placed = sum(1 for i, ep in (prev_where or {}).items()
                 if ep == rank(f"fleet-engine-{i}", final_listed)[0])
    if a.json:
        print(json.dumps(dict(args=vars(a), phases=rows_out, placed=placed), indent=1))
        return 0
    print(f"fleet: {a.engines} engines x {a.slots} slots, K = {k0} -> {k0 + 1} -> {k0} ->"
          f" {k0 - 1}, W = {a.window}, a round every {a.interval_ms:g} ms, row_bytes"
          f" {row_bytes}, quiet {a.quiet_ms:g} ms, resolve every {a.resolve_ms:g} ms")
    print(f"{'phase':<8}{'K':>3}{'rounds':>8}{'t-only':>8}{'slots':>7}{'p50 us':>9}{'p90 us':>9}"
          f"{'p99 us':>9}{'resync rows':>12}{'MiB':>8}{'moved':>7}{'ideal':>7}{'modulo':>8}")
    for r in rows_out:
        print(f"{r['phase']:<8}{r['workers']:>3}{r['rounds']:>8}{r['target_only']:>8}"
              f"{r['undrafted_slots']:>7}"
              f"{r['rtt_p50_us']:>9.0f}{r['rtt_p90_us']:>9.0f}{r['rtt_p99_us']:>9.0f}"
              f"{r['resync_rows']:>12}{r['resync_mib']:>8.2f}{r['moved']:>7}{r['ideal']:>7}"
              f"{r['modulo']:>8}")
    print(f"engines on their best-ranked live worker at the end: {placed}/{a.engines}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
