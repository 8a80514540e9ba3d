"""``dspark-client demo``: speculative decoding with the reference pair, end to end.

The reference target runs here (torch, CPU, a thread or two: ``demo_threads``); drafts come
from a worker over the wire: the one ``--endpoint`` or ``DSPARK_ENDPOINT`` names, else one
running at the default endpoint, else one started on loopback (one thread, the embedded
reference drafter). The target verifies the drafts, the generated text is printed as it is
committed (the tokens taken from accepted drafts marked: green on a terminal, between
guillemets otherwise), and a table follows: mean accepted length, acceptance by block position,
tokens/s against target-only decoding, round-trip percentiles, and the verified drafts. The pair
is a toy: on a CPU its target costs about one round trip, so the speedup that matters is in
tokens per verify; the closing note says what the wall-clock figures showed.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

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
                    "--max-sessions", "4", "--metrics-listen", "none", "--device", "cpu",
                    "--threads", "1")


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
            stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
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


def _matches(hello: Any, tc: Any) -> bool:
    return bool((hello.n_taps, hello.hidden, hello.vocab_size)
                == (tc.n_taps, tc.hidden_size, tc.vocab_size))


def run_demo(hello_for: Any, args: Any, out: TextIO, *, endpoint: str | None = None,
             note: str = "", own_worker_if_mismatch: bool = False,
             interrupt: Any = None) -> int:
    """``hello_for(endpoint, sampled, max_slots)`` returns the Hello the worker accepts (the
    CLI learns it from STATS). ``endpoint``: the worker to use; None starts one on loopback, as
    does a worker at the default endpoint that serves another drafter when
    ``own_worker_if_mismatch``. ``interrupt()`` is called as tokens arrive and raises to stop."""
    torch.set_num_threads(demo_threads())
    target = load_target(Path(args.target) if args.target else default_target_dir())
    prompt = encode_text(args.prompt)
    sampled = args.temperature > 0
    tc = target.config
    shm = bool(getattr(args, "shm", False))
    with contextlib.ExitStack() as stack:
        if note:
            out.write(note + "\n")
        if endpoint is None:
            endpoint = stack.enter_context(spawned_worker(shm=shm))
        hello = hello_for(endpoint, sampled, max(args.batch, 1))
        if not _matches(hello, tc) and own_worker_if_mismatch:
            out.write(f"the worker at {endpoint} drafts for another model ({hello.n_taps} taps"
                      f" of {hello.hidden}, vocab {hello.vocab_size}): starting one on"
                      " loopback\n")
            endpoint = stack.enter_context(spawned_worker(shm=shm))
            hello = hello_for(endpoint, sampled, max(args.batch, 1))
        if not _matches(hello, tc):  # an error: stderr, as every dspark-client error
            print(f"dspark-client: the worker at {endpoint} drafts for {hello.n_taps} taps of"
                  f" {hello.hidden}, vocab {hello.vocab_size}; the reference target has"
                  f" {tc.n_taps} taps of {tc.hidden_size}, vocab {tc.vocab_size}: serve the"
                  " embedded reference drafter", file=sys.stderr)
            return 1
        client = RemoteDraftClient(RemoteConfig(endpoint=endpoint, timeout_ms=5000,
                                                connect_timeout_ms=5000), hello)
        stack.callback(client.close)  # GOODBYE: the worker frees the slots at once
        if not client.wait_ready(30.0):
            print(f"dspark-client: no session with the worker: {client.last_error}",
                  file=sys.stderr)
            return 1
        source = RemoteDrafts(DraftRounds(client))
        dec = SpeculativeDecoder(target, source, temperature=args.temperature, seed=args.seed)
        out.write(f"worker {client.worker_info.worker_name if client.worker_info else '?'} at"
                  f" {endpoint}; {'sampled T=' + str(args.temperature) if sampled else 'greedy'},"
                  f" N={source.num_spec}, W={source.window}, batch {args.batch}\n")
        marks = Marks.for_stream(out)
        out.write(f"text the target took from accepted drafts is {marks.legend}; the rest is"
                  " its own token of each round\n")
        if args.batch > 1:
            out.write(f"showing sequence 1 of {args.batch}; every one is decoded and counted"
                      " in the figures below\n")
        out.write("-" * 72 + "\n" + args.prompt)
        out.flush()

        def show(seq: DecodeSeq, new: list[int]) -> None:
            if interrupt is not None:
                interrupt()
            if seq.slot == 0 and new:
                # A round commits the drafts the target accepted, then one token of its own.
                out.write(marks.drafted(decode_ids(new[:-1])) + decode_ids(new[-1:]))
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
        offered, accepted = int(st.offered.sum()), int(st.accepted.sum())
        out.write(f"\nverified drafts: {accepted} of {offered} drafted tokens accepted"
                  f" ({accepted / max(offered, 1):.0%}); {st.mean_accepted_length:.2f} tokens"
                  " per verify instead of 1.\n")
        out.write(textwrap.fill(closing_note(st.tokens_per_s, base.stats.tokens_per_s), 100)
                  + "\n")
    return 0


def closing_note(speculative_tps: float, target_only_tps: float) -> str:
    """What the wall-clock figures above mean, in words that agree with them."""
    ratio = speculative_tps / target_only_tps if target_only_tps > 0 else 0.0
    toy = ("The reference pair is a toy whose target costs about one round trip to the worker"
           " on a CPU, so wall-clock time here says little about a real deployment; what"
           " carries over is the accepted length and the verified drafts, since a large"
           " target's forward pass dominates each round.")
    if ratio >= 1.1:
        return f"Speculative decoding ran {ratio:.1f}x as fast as target-only here. {toy}"
    if 0 < ratio <= 0.9:
        return (f"Speculative decoding ran at {ratio:.1f}x the target-only speed here: each"
                f" round's trip to the worker cost more than the verify saved. {toy}")
    return f"Speculative decoding ran about as fast as target-only here. {toy}"


class Marks:
    """How the demo shows text from accepted drafts: green on a colour terminal (unless
    NO_COLOR is set), else between guillemets."""

    def __init__(self, start: str, end: str, legend: str) -> None:
        self.start, self.end, self.legend = start, end, legend

    @classmethod
    def for_stream(cls, stream: TextIO) -> Marks:
        try:
            tty = stream.isatty()
        except (AttributeError, ValueError):
            tty = False
        if tty and not os.environ.get("NO_COLOR") and os.environ.get("TERM") != "dumb":
            return cls("\x1b[32m", "\x1b[0m", "\x1b[32mgreen\x1b[0m")
        return cls("\u00ab", "\u00bb", "\u00abmarked\u00bb")

    def drafted(self, text: str) -> str:
        return f"{self.start}{text}{self.end}" if text else ""


def demo_threads() -> int:
    """Intra-op threads of the demo's own target: few, so that a busy neighbour (the worker
    it starts, another process) cannot make every op wait on a descheduled thread."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(2, cores // 2))
