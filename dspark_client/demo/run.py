"""``dspark-client demo``: speculative decoding with the reference pair, end to end.

The reference target runs here (torch, CPU); drafts come from a worker over the wire (one is
started on loopback when no endpoint is given, serving its embedded reference drafter); the
target verifies them, the generated text is printed as it is committed, and a table follows:
mean accepted length, acceptance by block position, tokens/s against target-only decoding, and
round-trip percentiles.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

import msgspec
import numpy as np
import torch

from ..client import RemoteDraftClient
from ..config import RemoteConfig
from ..rounds import DraftRounds
from .speculative import DecodeSeq, RemoteDrafts, SpeculativeDecoder
from .target import decode_ids, default_target_dir, encode_text, load_target

DEFAULT_PROMPT = "import os\nimport sys\n\n\ndef main(argv):\n    "
# A demo worker is small: the reference drafter's rings for a few slots.
DEMO_WORKER_ARGS = ("--window", "1024", "--max-slots", "16", "--max-total-slots", "16",
                    "--max-sessions", "4", "--metrics-listen", "none", "--device", "cpu")


@contextlib.contextmanager
def spawned_worker(timeout: float = 120.0, shm: bool = False) -> Iterator[str]:
    """A worker subprocess on a free loopback port; yields its endpoint. With ``shm`` it also
    serves a Unix socket and the endpoint is ``unix+shm://`` (rows through shared memory)."""
    with tempfile.TemporaryDirectory(prefix="dspark-demo-") as tmp:
        port_file = Path(tmp) / "port.json"
        log = open(Path(tmp) / "worker.log", "wb")  # noqa: SIM115 - closed below
        proc = subprocess.Popen(
            [sys.executable, "-m", "dspark_worker", "--listen", "127.0.0.1:0",
             "--port-file", str(port_file), *DEMO_WORKER_ARGS,
             *(("--unix", str(Path(tmp) / "w.sock")) if shm else ())],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
        try:
            deadline = time.monotonic() + timeout
            while not port_file.exists():
                if proc.poll() is not None or time.monotonic() > deadline:
                    log.close()
                    tail = (Path(tmp) / "worker.log").read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"the demo worker did not start:\n{tail}")
                time.sleep(0.05)
            time.sleep(0.05)  # the file is written in one go; let the writer finish
            info = json.loads(port_file.read_text())
            yield f"unix+shm://{info['unix']}" if shm else f"tcp://{info['listen']}"
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log.close()


def _percentiles(values: list[float]) -> str:
    if not values:
        return "-"
    a = np.asarray(values) / 1000.0
    return " / ".join(f"{np.percentile(a, q):.2f}" for q in (50, 90, 99)) + " ms"


def run_demo(hello_for: Any, args: Any, out: TextIO) -> int:
    """``hello_for(endpoint, sampled)`` returns the Hello the worker accepts (the CLI's probe)."""
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    target = load_target(Path(args.target) if args.target else default_target_dir())
    prompt = encode_text(args.prompt)
    sampled = args.temperature > 0
    with contextlib.ExitStack() as stack:
        endpoint = args.endpoint or stack.enter_context(
            spawned_worker(shm=bool(getattr(args, "shm", False))))
        hello = hello_for(endpoint, sampled)
        tc = target.config
        if (hello.n_taps, hello.hidden, hello.vocab_size) != (tc.n_taps, tc.hidden_size,
                                                              tc.vocab_size):
            out.write(f"the worker drafts for {hello.n_taps} taps of {hello.hidden}, vocab"
                      f" {hello.vocab_size}; the reference target has {tc.n_taps} taps of"
                      f" {tc.hidden_size}, vocab {tc.vocab_size}: serve the embedded reference"
                      " drafter\n")
            return 1
        hello = msgspec.structs.replace(hello, max_slots=max(args.batch, 1))
        client = RemoteDraftClient(RemoteConfig(endpoint=endpoint, timeout_ms=5000,
                                                connect_timeout_ms=5000), hello)
        stack.callback(client.close)
        if not client.wait_ready(30.0):
            out.write(f"no session with the worker: {client.disabled_reason or client.last_error}"
                      "\n")
            return 1
        source = RemoteDrafts(DraftRounds(client))
        dec = SpeculativeDecoder(target, source, temperature=args.temperature, seed=args.seed)
        out.write(f"worker {client.worker_info.worker_name if client.worker_info else '?'} at"
                  f" {endpoint}; {'sampled T=' + str(args.temperature) if sampled else 'greedy'},"
                  f" N={source.num_spec}, W={source.window}, batch {args.batch}\n")
        out.write("-" * 72 + "\n" + args.prompt)
        out.flush()

        def show(seq: DecodeSeq, new: list[int]) -> None:
            if seq.slot == 0:
                out.write(decode_ids(new))
                out.flush()

        prompts = [prompt] * args.batch
        seeds = [args.seed + i for i in range(args.batch)]
        dec.generate(prompts, args.max_new_tokens, seeds=seeds, on_token=show)
        out.write("\n" + "-" * 72 + "\n")
        base = SpeculativeDecoder(target, None, temperature=args.temperature, seed=args.seed)
        base.generate(prompts, args.max_new_tokens, seeds=seeds)
        st = dec.stats
        rows = [
            ("mean accepted length (tokens per verify, bonus incl.)",
             f"{st.mean_accepted_length:.2f}"),
            ("acceptance by position",
             " ".join(f"{x:.2f}" for x in st.per_position_acceptance)),
            ("tokens/s speculative", f"{st.tokens_per_s:.1f}"),
            ("tokens/s target-only", f"{base.stats.tokens_per_s:.1f}"),
            ("rounds (failed)", f"{st.rounds} ({st.failed_rounds})"),
            ("round trip p50 / p90 / p99", _percentiles(st.rtt_us)),
        ]
        width = max(len(k) for k, _ in rows)
        for k, v in rows:
            out.write(f"{k:<{width}}  {v}\n")
    return 0
