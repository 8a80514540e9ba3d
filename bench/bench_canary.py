"""What a canary and a second drafter version cost.

    python bench/bench_canary.py rtt [--pairs 3] [--prompts 4] [--tokens 96]
    python bench/bench_canary.py memory DIR    # DIR from: python bench/bench_loading.py make DIR

``rtt``: two real workers on the reference drafter, one with a canary (the reference drafter
perturbed, ``--canary-fraction 1``: every slot shadowed) and one without. The engine's STEPs
are recorded once (the reference target decoding held-out prompts greedily through
``DraftRounds``), then replayed against each worker in turn on new sessions: with
``--think-ms`` between rounds (the engine verifying on its own device: the room the canary
drafts in; a sleep, so that the engine's own compute does not compete for the worker's CPU)
and back to back (no room: the canary must wait, not delay). Prints the round trip's
percentiles per worker and mode, their ratio, and the blocks the canary judged and shed.
Pairs alternate which worker goes first.

``memory``: one worker on a real-size checkpoint (bf16 on the CPU, a small ring pool), a session
pinned to it, then a reload of a second version (the same files under a config whose candidate
walk differs, so the identities and the weights loaded are another copy); prints the resident
set and STATS' ``weights_bytes`` with one version, with two, and after the pinned session has
gone and the first version was unloaded, and the peak resident set during the reload.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
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

from dspark_client import hello_from_checkpoint  # noqa: E402
from dspark_client.client import RemoteDraftClient  # noqa: E402
from dspark_client.config import RemoteConfig  # noqa: E402
from dspark_client.rounds import DraftRounds  # noqa: E402
from tests.support.worker_proc import WorkerProcess, start_worker, worker_stats  # noqa: E402

W, SLOTS = 256, 8


def connect(w: WorkerProcess, folder: Path, name: str, *, window: int = W,
            max_slots: int = SLOTS) -> RemoteDraftClient:
    hello = hello_from_checkpoint(folder, window=window, max_slots=max_slots,
                                  max_rows_per_step=4096, client_name=name)
    client = RemoteDraftClient(RemoteConfig(endpoint=w.endpoint or "", timeout_ms=60_000,
                                            connect_timeout_ms=60_000), hello)
    if not client.wait_ready(120.0):
        raise RuntimeError(f"no HELLO: {client.disabled_reason or client.last_error}")
    return client


def settle(w: WorkerProcess) -> None:
    """Until the worker's canary (if any) has no backlog left."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        canary = worker_stats(w)["canary"]
        if canary is None or not canary["backlog_steps"]:
            return
        time.sleep(0.05)


def percentiles(us: list[float]) -> dict[str, float]:
    a = np.asarray(us)
    return {f"p{q}_us": round(float(np.percentile(a, q)), 1) for q in (50, 90, 99)} | {
        "rounds": int(a.size)}


def recording(drafts: type) -> type:
    """``RemoteDrafts`` that keeps each round's requests and releases, to replay them."""

    class Recording(drafts):  # type: ignore[misc, valid-type]
        def __init__(self, rounds: DraftRounds) -> None:
            super().__init__(rounds)
            self.log: list[tuple[list[Any], list[int]]] = []

        def round(self, requests: Any) -> Any:
            release = list(self._release)
            res = super().round(requests)
            self.log.append((list(requests), release))
            return res

    return Recording


def rtt(args: argparse.Namespace) -> None:
    import torch

    from dspark_client.demo.corpus import heldout_prompts
    from dspark_client.demo.speculative import RemoteDrafts, SpeculativeDecoder
    from dspark_client.demo.target import default_target_dir, load_target
    from dspark_worker.drafter.drafter import REFERENCE_DIR
    from tests.support.drafters import perturbed_reference

    torch.set_num_threads(1)
    Recording = recording(RemoteDrafts)
    target = load_target(default_target_dir())
    tmp = Path(tempfile.mkdtemp(prefix="bench-canary-"))
    candidate = perturbed_reference(tmp / "candidate")
    common = ("--window", str(W), "--max-slots", str(SLOTS), "--max-total-slots",
              str(2 * SLOTS), "--device", "cpu", "--threads", "1", "--log-level", "WARNING")
    modes = {"room": args.think_ms / 1000.0, "back-to-back": 0.0}
    out: dict[str, dict[str, list[float]]] = {m: {"off": [], "on": []} for m in modes}
    # per pair and mode, the p50 of each worker's run: their ratio, pair by pair, is what holds
    # while the machine's speed drifts
    pair_p50: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    waiting: dict[str, list[Any]] = {m: [] for m in modes}
    canary = {"judged": 0, "shed": 0}
    try:
        with start_worker(*common) as off, start_worker(
                "--canary-checkpoint", str(candidate), "--canary-fraction", "1",
                *common) as on:
            # The engine's STEPs, once: the reference target decoding greedily.
            client = connect(off, REFERENCE_DIR, "bench-record")
            source = Recording(DraftRounds(client))
            SpeculativeDecoder(target, source, max_len=512, stop_at_eos=False).generate(
                heldout_prompts(args.prompts, 96), args.tokens)
            client.close()
            workers = {"off": off, "on": on}
            for pair in range(args.pairs):
                order = ("off", "on") if pair % 2 == 0 else ("on", "off")
                for mode in modes:
                    pair_p50[mode].append({})
                for which in order:
                    w = workers[which]
                    for mode, think in modes.items():
                        before = worker_stats(w)["canary"]
                        client = connect(w, REFERENCE_DIR, f"bench-{which}-{pair}-{mode}")
                        rounds = DraftRounds(client)
                        run: list[float] = []
                        for reqs, release in source.log:
                            res = rounds.run(reqs, release=release)
                            if res.ok and res.rtt_us:
                                run.append(res.rtt_us)
                            if think:
                                time.sleep(think)  # the engine verifies on its own device
                        client.close()
                        if which == "on":  # what waited for the canary when the run ended
                            c = worker_stats(w)["canary"]
                            waiting[mode].append((c["backlog_steps"], c["device_room"]))
                        out[mode][which] += run
                        pair_p50[mode][-1][which] = float(np.median(run))
                        settle(w)  # the canary's catch-up must not overlap the next run
                        if which == "on":
                            after = worker_stats(w)["canary"]
                            canary["judged"] += (after["acceptance"]["rounds"]
                                                 - before["acceptance"]["rounds"])
                            canary["shed"] += after["shed_entries"] - before["shed_entries"]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    result: dict[str, Any] = {"prompts": args.prompts, "tokens": args.tokens,
                              "rounds_per_run": len(source.log), "pairs": args.pairs,
                              "think_ms": args.think_ms, "canary": canary}
    for mode, by in out.items():
        off_p, on_p = percentiles(by["off"]), percentiles(by["on"])
        ratios = sorted(p["on"] / p["off"] for p in pair_p50[mode])
        result[mode] = {"off": off_p, "on": on_p,
                        "ratio_p50": round(on_p["p50_us"] / off_p["p50_us"], 3),
                        "ratio_p90": round(on_p["p90_us"] / off_p["p90_us"], 3),
                        "pair_ratios_p50": [round(r, 3) for r in ratios],
                        "median_pair_ratio_p50": round(float(np.median(ratios)), 3),
                        "canary_backlog_and_room_at_end": waiting[mode]}
    print(json.dumps(result, indent=1))


def memory(args: argparse.Namespace) -> None:
    src = Path(args.checkpoint).resolve()
    tmp = Path(tempfile.mkdtemp(prefix="bench-versions-"))
    try:
        second = tmp / "second"  # the same weights, another candidate walk: another version
        second.mkdir()
        for f in src.iterdir():
            if f.suffix == ".safetensors" or f.name.endswith(".index.json"):
                (second / f.name).symlink_to(f)
        config = json.loads((src / "config.json").read_text())
        config["dspark_draft_topk"] = 64
        (second / "config.json").write_text(json.dumps(config))
        link = tmp / "current"
        link.symlink_to(src)
        env = {"MALLOC_MMAP_THRESHOLD_": str(128 << 10)}  # freed tensors leave the RSS
        with start_worker("--checkpoint", str(link), "--device", "cpu", "--dtype", "bfloat16",
                          "--window", "256", "--max-slots", "8", "--max-total-slots", "8",
                          "--threads", "1", "--log-level", "WARNING", env=env,
                          timeout=600) as w:
            pinned = connect(w, src, "pinned", window=256, max_slots=4)
            rows = [figures("one version", w)]
            asked = worker_stats(w)["reloads"]["asked"]
            Path(f"/proc/{w.pid}/clear_refs").write_text("5")  # its VmHWM := VmRSS
            link.unlink()
            link.symlink_to(second)
            os.kill(w.pid, signal.SIGHUP)
            deadline = time.monotonic() + 600
            while time.monotonic() < deadline:
                st = worker_stats(w)["reloads"]
                if st["asked"] > asked and not st["running"]:
                    break
                time.sleep(0.5)
            rows.append(figures(f"two versions (reload: {st['last']['result']},"
                                f" {st['last']['seconds']:.1f} s)", w))
            rows[-1]["peak_rss_during_reload_gib"] = round(hwm_bytes(w.pid) / 2**30, 3)
            pinned.close()
            time.sleep(1.0)
            rows.append(figures("the first unloaded", w))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(rows, indent=1))


def hwm_bytes(pid: int) -> int:
    """The process's peak resident set since its last reset (Linux ``VmHWM``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM")


def figures(what: str, w: WorkerProcess) -> dict[str, Any]:
    st = worker_stats(w)
    return {"state": what, "rss_gib": round(st["memory"]["rss_bytes"] / 2**30, 3),
            "versions": [(v["version"], v["role"], round(v["weights_bytes"] / 2**30, 3))
                         for v in st["versions"]]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("rtt")
    r.add_argument("--pairs", type=int, default=3)
    r.add_argument("--prompts", type=int, default=4)
    r.add_argument("--tokens", type=int, default=96)
    r.add_argument("--think-ms", type=float, default=20.0,
                   help="the engine's verify between rounds in the room mode (default: 20)")
    m = sub.add_parser("memory")
    m.add_argument("checkpoint")
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    {"rtt": rtt, "memory": memory}[args.cmd](args)


if __name__ == "__main__":
    main()
