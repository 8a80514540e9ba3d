"""An engine-shaped round against a real worker: where the time of ``DraftRounds.run_batch``
goes, per round, between the client, the worker's host side and the device.

    python bench/bench_engine_round.py [--rounds 100] [--slots 64] [--rows 5] [--window 64]
                                       [--device cpu] [--threads 1] [--sampled] [--form list]
                                       [--taps kimi-k3] [--resync-every 10] [--reconnect-at 50]

The worker serves a small random drafter that reads Qwen3-4B-shaped taps (5 layers x 2560,
bf16: 25,600-byte rows; ``bench_worker.taps_25600_checkpoint``, written to a temporary
folder; ``--taps kimi-k3``: a small random Kimi-K3 drafter reading Kimi-K3's taps, 5 x 7168:
71,680-byte rows, with its target's embedding and head in a folder beside it), so the rows are
real-sized and the drafting cheap. Each of ``--slots`` slots resyncs
once (a prompt of W rows), then every round continues every slot with ``--rows`` new rows and
asks for all N drafts. Over tcp:// and unix+shm:// in turn (and unix+shm:// with the rows put in
``DraftRounds.staging``, the region, before each round, as an engine's device-to-host copy
could land them), per round (medians over the
rounds, µs; each as a share of the round's median):

* round: ``run_batch`` from call to return, as the engine waits for it;
* client: the round less the STEP's round trip (send to reply: the client's own work before
  the send and after the reply; what it does during the round trip is not in it);
* worker host: the worker's time from the STEP's last byte to its reply that is not the
  device thread's: decode and checks, the hand-off to the device thread, the hand-off back
  (STATS ``latency_us`` medians of ``decode``, ``to_device``, ``from_device``);
* device: the device thread's time on the STEP (apply, draft, encode and what lies between):
  ``worker_us`` less the worker host time;
* transport: the rest of the round trip (sending the rows, the reply's way back, wake-ups).

The worker's stage medians (STATS ``latency_us``) are printed beside them. ``--form list``
makes the rounds through ``DraftRounds.run`` instead, one ``SlotRequest`` per slot whose rows
are that slot's part of the round's array (built before the round is timed), over tcp:// and
unix+shm://.

``--resync-every R``: every R-th round a quarter of the slots (in turn) start a new generation,
which the client resyncs with W rows from its ring beside the others' continuing rows.
``--reconnect-at R``: at round R the client is closed and a new one connects (a new session,
every slot resynced with W rows in its first round). Both print the rounds' p99 and maximum by
kind (continuing, with resyncs, the reconnect's first) and the reconnect's time to ready.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_worker import taps_25600_checkpoint  # noqa: E402

from dspark_client.client import RemoteDraftClient  # noqa: E402
from dspark_client.config import RemoteConfig  # noqa: E402
from dspark_client.hello import hello_from_checkpoint  # noqa: E402
from dspark_client.rounds import DraftRounds, SlotRequest  # noqa: E402
from protocol import wire  # noqa: E402
from tests.support.worker_proc import start_worker  # noqa: E402

STAGES = ("decode", "to_device", "apply", "draft", "encode", "from_device", "step")


def bf16_rows(rng: np.random.Generator, n: int, row_bytes: int) -> np.ndarray:
    rows = rng.integers(0, 256, (n, row_bytes), dtype=np.uint8)
    rows.view(np.uint16)[:] &= 0x3FFF  # finite bf16 values
    return rows


def stats(client: RemoteDraftClient) -> dict[str, Any]:
    status, body = client.simple_request(wire.OP_STATS)
    if status != wire.ST_OK:
        raise SystemExit(f"STATS refused: {status}")
    return dict(json.loads(body))


def k3_taps_checkpoint(directory: str) -> tuple[str, str]:
    """A small random Kimi-K3 drafter reading Kimi-K3's taps (5 x 7168, bf16: 71,680 bytes a
    row) and its target's embedding and head: (drafter folder, target folder)."""
    import torch
    from safetensors.torch import save_file

    from dspark_worker.drafter.checkpoint import save_checkpoint
    from dspark_worker.drafter.embedded import init_random_
    from dspark_worker.drafter.families import build_model
    from dspark_worker.drafter.k3 import K3Config

    cfg = K3Config(
        hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
        head_dim=48, intermediate_size=256, vocab_size=512, rms_norm_eps=1e-5,
        rope_theta=50000.0, target_layer_ids=(2, 23, 47, 71, 89), block_size=7,
        mask_token_id=509, markov_rank=16, markov_head_type="vanilla",
        enable_confidence_head=True, confidence_head_with_markov=True,
        target_hidden_size=7168, num_target_layers=93, q_lora_rank=64, kv_lora_rank=32,
        qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32).validated("taps-71680")
    model = build_model(cfg, None, device=torch.device("cpu"), dtype=torch.float32)
    init_random_(model, seed=1)
    target = Path(directory) / "target"
    target.mkdir(parents=True)
    save_file({"model.embed_tokens.weight": model.embed_tokens.weight.contiguous(),
               "lm_head.weight": model.lm_head.weight.contiguous()},
              str(target / "model.safetensors"))
    ckpt = str(Path(directory) / "ckpt")
    save_checkpoint(model, ckpt, exclude=("embed_tokens.weight", "lm_head.weight"))
    return ckpt, str(target)


def run_endpoint(endpoint: str, ckpt: str, args: argparse.Namespace,
                 in_staging: bool = False, target: str | None = None) -> dict[str, Any]:
    """``in_staging``: each round's rows are first put (untimed) in ``DraftRounds.staging``,
    as an engine's device-to-host copy could land them there (the region on unix+shm://)."""
    n, k, W = args.slots, args.rows, args.window
    hello = hello_from_checkpoint(ckpt, window=W, max_slots=n, sampled=args.sampled,
                                  max_rows_per_step=n * W, client_name="bench-engine-round",
                                  synthetic=True,  # made-up rows: kept out of acceptance
                                  target_checkpoint=target)
    client = RemoteDraftClient(RemoteConfig(endpoint=endpoint, timeout_ms=60_000), hello)
    kinds: dict[str, list[float]] = {"continue": [], "resync": [], "reconnect": []}
    ready_ms = 0.0
    try:
        if not client.wait_ready(30.0):
            raise SystemExit(f"{endpoint}: {client.last_error}")
        rounds = DraftRounds(client)
        N, rb = hello.num_spec, hello.row_bytes
        rng = np.random.default_rng(0)
        slots = np.arange(n, dtype=np.int64)
        anchor = np.full(n, W, np.int64)
        tokens = slots % hello.vocab_size
        sampling: dict[str, Any] = dict(seed=1000 + slots, top_k=16, temperature=0.8,
                                        top_p=0.95) if args.sampled else {}
        res = rounds.run_batch(slots, 1, anchor, tokens, N, bf16_rows(rng, n * W, rb), W,
                               **sampling)
        if not res.ok:
            raise SystemExit(f"{endpoint}: first round failed: {res.reason}")
        # A pool of new rows, handed over in turn (an engine's device-to-host copy lands in
        # a buffer of its own each step).
        pool = [bf16_rows(rng, n * k, rb) for _ in range(4)]
        rounds_us, rtt_us, worker_us = [], [], []
        generation = np.ones(n, np.int64)
        for r in range(args.warmup + args.rounds):
            kind = "continue"
            if args.reconnect_at and r == args.reconnect_at:
                client.close()
                t0 = time.perf_counter()
                client = RemoteDraftClient(RemoteConfig(endpoint=endpoint, timeout_ms=60_000),
                                           hello)
                if not client.wait_ready(30.0):
                    raise SystemExit(f"{endpoint}: reconnect: {client.last_error}")
                ready_ms = (time.perf_counter() - t0) * 1e3
                rounds = DraftRounds(client)  # the new session's ring: every slot resyncs
                anchor += W
                t0 = time.perf_counter()
                res = rounds.run_batch(slots, generation, anchor, tokens, N,
                                       bf16_rows(rng, n * W, rb), W, **sampling)
                kinds["reconnect"].append((time.perf_counter() - t0) * 1e6)
                if not res.ok:
                    raise SystemExit(f"{endpoint}: reconnect round: {res.reason}")
                continue
            if args.resync_every and r and r % args.resync_every == 0:
                generation[slots % 4 == (r // args.resync_every) % 4] += 1
                kind = "resync"
            anchor += k
            w0 = client.stats.get("worker_us_total")
            t0 = time.perf_counter()
            rows = pool[r % 4]
            if in_staging:
                rows = rounds.staging[:n * k]
                rows[:] = pool[r % 4]
                w0 = client.stats.get("worker_us_total")
                t0 = time.perf_counter()
            if args.form == "list":  # the engine's own objects, made before the round
                reqs = [SlotRequest(slot=i, generation=1, anchor_pos=int(anchor[i]),
                                    anchor_token=int(tokens[i]), rows=rows[i * k:(i + 1) * k],
                                    n_out=N, **({key: v if np.isscalar(v) else int(v[i])
                                                 for key, v in sampling.items()}))
                        for i in range(n)]
                w0 = client.stats.get("worker_us_total")
                t0 = time.perf_counter()
                res = rounds.run(reqs)
            else:
                res = rounds.run_batch(slots, generation, anchor, tokens, N, rows, k, **sampling)
            t1 = time.perf_counter()
            if not res.ok or bool(res.resynced) != (kind == "resync"):
                raise SystemExit(f"{endpoint}: round {r}: {res.reason}, resynced {res.resynced}")
            kinds[kind].append((t1 - t0) * 1e6)
            if r >= args.warmup and kind == "continue":
                rounds_us.append((t1 - t0) * 1e6)
                rtt_us.append(res.rtt_us)
                worker_us.append(client.stats.get("worker_us_total") - w0)
        lat = stats(client)["latency_us"]  # the last 2048 STEPs: the warm-up's are few
    finally:
        client.close()
    med = statistics.median
    # The device thread's time on the STEP: the worker's time (last byte to reply) less its
    # host stages: decode and checks, the hand-off to the device thread, the hand-off back.
    host = sum(lat[s]["p50_us"] for s in ("decode", "to_device", "from_device"))
    out = {"endpoint": endpoint.split("://")[0] + (" (rows in region)" if in_staging else ""),
           "slots": n, "rows_per_slot": k,
           "row_bytes": rb, "round_us": med(rounds_us), "rtt_us": med(rtt_us),
           "worker_us": med(worker_us), "device_us": med(worker_us) - host,
           "stages_p50_us": {s: lat[s]["p50_us"] for s in STAGES if s in lat}}
    out["client_us"] = med(np.subtract(rounds_us, rtt_us).tolist())
    out["worker_host_us"] = host
    out["transport_us"] = out["rtt_us"] - out["worker_us"]
    out["by_kind_us"] = {kind: {"rounds": len(v), "p50": med(v), "p99": float(
        np.percentile(v, 99)), "max": max(v)} for kind, v in kinds.items() if v}
    out["reconnect_ready_ms"] = ready_ms
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=100)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--slots", type=int, default=64)
    p.add_argument("--rows", type=int, default=5, help="new rows per slot per round")
    p.add_argument("--window", type=int, default=64)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1, help="the worker's --threads")
    p.add_argument("--sampled", action="store_true", help="top_k 16 sampling on every slot")
    p.add_argument("--form", choices=("batch", "list"), default="batch",
                   help="batch: run_batch (default); list: run, one SlotRequest per slot")
    p.add_argument("--taps", choices=("qwen3-4b", "kimi-k3"), default="qwen3-4b",
                   help="the tap rows' shape: 25,600 or 71,680 bytes")
    p.add_argument("--resync-every", type=int, default=0,
                   help="every R-th round a quarter of the slots start a new generation")
    p.add_argument("--reconnect-at", type=int, default=0,
                   help="at round R a new client connects (every slot resynced)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    tmp = tempfile.mkdtemp(prefix="dspark-bench-")
    target: str | None = None
    if args.taps == "kimi-k3":
        ckpt, target = k3_taps_checkpoint(tmp)
    else:
        ckpt = taps_25600_checkpoint(f"{tmp}/ckpt")
    path = f"{tmp}/w.sock"
    extra = ["--checkpoint", ckpt, *(["--target-checkpoint", target] if target else []),
             "--window", str(args.window), "--max-slots",
             str(args.slots), "--max-total-slots", str(2 * args.slots), "--max-rows-per-step",
             str(args.slots * args.window), "--device", args.device, "--threads",
             str(args.threads), "--metrics-listen", "none", "--log-level", "WARNING",
             "--unix", path]
    results = []
    with start_worker(*extra) as w:
        for endpoint in (f"tcp://{w.host}:{w.port}", f"unix+shm://{path}"):
            results.append(run_endpoint(endpoint, ckpt, args, target=target))
        if args.form == "batch":
            results.append(run_endpoint(f"unix+shm://{path}", ckpt, args, in_staging=True,
                                        target=target))
        if w.stop() != 0:
            raise SystemExit("worker did not exit 0")
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    r0 = results[0]
    print(f"{r0['slots']} slots, {r0['rows_per_slot']} new rows of {r0['row_bytes']} bytes per"
          f" slot per round ({r0['slots'] * r0['rows_per_slot'] * r0['row_bytes'] / 1e6:.1f} MB),"
          f" W {args.window}, {'sampled' if args.sampled else 'greedy'}, device {args.device},"
          f" {'run (SlotRequest)' if args.form == 'list' else 'run_batch'};"
          f" medians of {args.rounds} rounds, us (share of the round)")
    print(f"{'transport':<26} {'round':>8} | {'client':>14} {'worker host':>14} {'device':>14}"
          f" {'transport':>14}")
    for r in results:
        cells = " ".join(f"{r[key]:>7.0f} ({r[key] / r['round_us']:>4.0%})"
                         for key in ("client_us", "worker_host_us", "device_us", "transport_us"))
        print(f"{r['endpoint']:<26} {r['round_us']:>8.0f} | {cells}")
    if args.resync_every or args.reconnect_at:
        print("rounds by kind, us (count: p50 / p99 / max); reconnect ready ms")
        for r in results:
            cells = "; ".join(f"{kind} {v['rounds']}: {v['p50']:.0f} / {v['p99']:.0f} /"
                              f" {v['max']:.0f}" for kind, v in r["by_kind_us"].items())
            print(f"{r['endpoint']:<26} {cells}; ready {r['reconnect_ready_ms']:.0f}")
    print("worker stages, p50 us: " + "; ".join(
        f"{r['endpoint']}: " + ", ".join(f"{s} {v:.0f}" for s, v in r["stages_p50_us"].items())
        for r in results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
