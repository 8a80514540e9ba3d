"""Speculative decoding end to end with the shipped reference pair: the reference target here,
the reference drafter in a real worker process, drafts over the wire.

* lossless: greedy speculative decoding produces exactly target-only greedy decoding;
* remote equals local: the accepted lengths over the wire equal those of the same drafter
  called in-process on the same rows;
* sampled: with exact rejection sampling on the dyadic q the worker sends, the first generated
  token follows the target's own sampling distribution (chi-square);
* the trained drafter reaches a mean accepted length >= 2.0 on held-out text.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from dspark_client import hello_from_checkpoint
from dspark_client.client import RemoteDraftClient
from dspark_client.config import RemoteConfig
from dspark_client.demo.corpus import heldout_prompts
from dspark_client.demo.speculative import (
    RemoteDrafts,
    SpeculativeDecoder,
    target_only_greedy,
)
from dspark_client.demo.target import TargetModel, default_target_dir, encode_text, load_target
from dspark_client.rounds import DraftRounds
from dspark_worker.drafter import load_drafter
from dspark_worker.drafter.drafter import REFERENCE_DIR
from tests.support.local_drafts import LocalDrafts
from tests.support.worker_proc import WorkerProcess, start_worker

W, SLOTS, MAX_LEN = 256, 64, 512
WORKER_ARGS = ("--window", str(W), "--max-slots", str(SLOTS), "--max-total-slots",
               str(2 * SLOTS), "--max-rows-per-step", "4096", "--device", "cpu")


@pytest.fixture(scope="module")
def target() -> TargetModel:
    torch.set_num_threads(1)
    return load_target(default_target_dir())


@pytest.fixture(scope="module")
def worker() -> Iterator[WorkerProcess]:
    with start_worker(*WORKER_ARGS) as w:
        yield w


def remote(worker: WorkerProcess, target: TargetModel, *, sampled: bool = False,
           name: str = "e2e") -> tuple[RemoteDraftClient, RemoteDrafts]:
    """A session under one client name: each test's HELLO replaces the previous test's session
    on the worker (6.2), as a restarted engine would."""
    hello = hello_from_checkpoint(REFERENCE_DIR, window=W, max_slots=SLOTS,
                                  max_rows_per_step=4096, sampled=sampled, client_name=name)
    assert hello.row_bytes == target.config.row_bytes  # the pair's tap geometry agrees
    assert worker.endpoint is not None
    client = RemoteDraftClient(RemoteConfig(endpoint=worker.endpoint, timeout_ms=10_000,
                                            connect_timeout_ms=10_000), hello)
    assert client.wait_ready(20.0), (client.disabled_reason, client.last_error)
    return client, RemoteDrafts(DraftRounds(client))


PROMPTS = [encode_text(t) for t in (
    "import os\nimport sys\n\n\ndef main(argv):\n    ",
    "class Parser:\n    def __init__(self, text):\n        self.",
    "    for key, value in sorted(items.items()):\n",
)]


@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_speculative_decoding_is_lossless(worker: WorkerProcess, target: TargetModel,
                                                 batch: int) -> None:
    prompts = PROMPTS[:batch]
    client, source = remote(worker, target)
    try:
        dec = SpeculativeDecoder(target, source, max_len=MAX_LEN, stop_at_eos=False)
        out = dec.generate(prompts, 96)
    finally:
        client.close()
    assert dec.stats.failed_rounds == 0
    assert dec.stats.accept_lengths, "no round carried drafts"
    for prompt, got in zip(prompts, out, strict=True):
        assert got == target_only_greedy(target, prompt, 96, max_len=MAX_LEN)


def test_the_workers_acceptance_figures_equal_the_decoders(worker: WorkerProcess,
                                                          target: TargetModel) -> None:
    """Every block the decoder verified is judged by the worker too, the last of each sequence
    included (its closing entry tells the worker what was accepted): the mean accepted length
    and the acceptance by position in STATS are the demo's own figures."""
    import json

    from protocol import wire

    client, source = remote(worker, target)
    try:
        dec = SpeculativeDecoder(target, source, max_len=MAX_LEN, stop_at_eos=False)
        dec.generate(PROMPTS[:2], 40)
        st = dec.stats
        deadline = time.monotonic() + 5.0  # STATS counters are rebuilt every 50 ms
        while True:
            status, body = client.simple_request(wire.OP_STATS)  # our connection: our session
            assert status == wire.ST_OK
            (mine,) = [s for s in json.loads(body)["sessions"]
                       if s.get("client_name") == client.hello.client_name]
            acc = mine["acceptance"]
            if acc["rounds"] >= len(st.accept_lengths) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    finally:
        client.close()
    assert acc["rounds"] == len(st.accept_lengths) == st.verify_rounds
    assert acc["mean_accepted_length"] == pytest.approx(st.mean_accepted_length, abs=1e-4)
    assert acc["accepted_by_position"] == st.accepted.tolist()


def test_remote_accepted_lengths_equal_local(worker: WorkerProcess,
                                             target: TargetModel) -> None:
    prompts = heldout_prompts(4, 96)
    client, source = remote(worker, target)
    try:
        remote_dec = SpeculativeDecoder(target, source, max_len=MAX_LEN, stop_at_eos=False)
        remote_out = remote_dec.generate(prompts, 64)
    finally:
        client.close()
    local = LocalDrafts(load_drafter(None), max_slots=SLOTS, window=W)
    local_dec = SpeculativeDecoder(target, local, max_len=MAX_LEN, stop_at_eos=False)
    local_out = local_dec.generate(prompts, 64)
    assert remote_out == local_out
    assert remote_dec.stats.accept_lengths == local_dec.stats.accept_lengths
    assert remote_dec.stats.accepted.tolist() == local_dec.stats.accepted.tolist()


def test_trained_drafter_accepts_at_least_two_tokens_per_round(worker: WorkerProcess,
                                                               target: TargetModel) -> None:
    """Held-out text the pair never trained on, block 7, greedy: tokens per verify round, the
    bonus token included (the full figure is in bench/README.md)."""
    prompts = heldout_prompts(8, 128)
    client, source = remote(worker, target)
    try:
        dec = SpeculativeDecoder(target, source, max_len=MAX_LEN, stop_at_eos=False)
        dec.generate(prompts, 96)
    finally:
        client.close()
    assert dec.stats.failed_rounds == 0
    assert dec.stats.mean_accepted_length >= 2.0, dec.stats.per_position_acceptance


def _chi2_critical(df: int, z: float = 3.090) -> float:
    """Upper critical value of chi-square at the normal quantile z (3.090: p = 0.001), by the
    Wilson-Hilferty approximation."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def test_sampled_first_token_follows_the_target_distribution(worker: WorkerProcess,
                                                             target: TargetModel) -> None:
    temperature = 1.0
    prompt = encode_text("def load(path):\n    with open(path) as f:\n        return ")
    with torch.no_grad():
        logits, _ = target(torch.tensor([prompt], dtype=torch.long))
    p = torch.softmax(logits[0, -1].double() / temperature, dim=-1).numpy()
    client, source = remote(worker, target, sampled=True)
    counts = np.zeros(p.size, np.int64)
    drafted_first = 0
    rounds = 24
    try:
        dec = SpeculativeDecoder(target, source, temperature=temperature, seed=0,
                                 max_len=MAX_LEN, stop_at_eos=False)
        for r in range(rounds):
            seqs = [dec.start(s, prompt, seed=1000 * r + s) for s in range(SLOTS)]
            before = dec.stats.accepted[0]
            dec.step(seqs)
            drafted_first += int(dec.stats.accepted[0] - before)
            for s in seqs:
                counts[s.tokens[len(prompt)]] += 1
            source.release([s.slot for s in seqs])
    finally:
        client.close()
    n = counts.sum()
    assert n == rounds * SLOTS and dec.stats.failed_rounds == 0
    # the drafts were really used: most first tokens came from accepted drafts
    assert drafted_first > n // 4
    expected = p * n
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    stat = float((((obs - exp) ** 2)[keep] / exp[keep]).sum())
    df = int(keep.sum()) - 1
    assert df >= 3, "the prompt should leave several likely next tokens"
    assert stat < _chi2_critical(df), (stat, df)


def test_demo_target_threads_stay_few(monkeypatch: pytest.MonkeyPatch) -> None:
    """The demo's own target never takes every core: half of them, at most 2, at least 1."""
    from dspark_client.demo import run

    for cores, want in ((1, 1), (2, 1), (4, 2), (64, 2)):
        monkeypatch.setattr(run.os, "sched_getaffinity", lambda _pid, n=cores: set(range(n)))
        assert run.demo_threads() == want
    assert "--threads" in run.DEMO_WORKER_ARGS
    assert run.DEMO_WORKER_ARGS[run.DEMO_WORKER_ARGS.index("--threads") + 1] == "1"


def test_demo_closing_note_agrees_with_its_figures() -> None:
    from dspark_client.demo.run import closing_note

    assert closing_note(200.0, 100.0).startswith("Speculative decoding ran 2.0x as fast")
    slower = closing_note(50.0, 100.0)
    assert slower.startswith("Speculative decoding ran at 0.5x the target-only speed")
    assert closing_note(100.0, 98.0).startswith("Speculative decoding ran about as fast")
    for note in (closing_note(200.0, 100.0), slower):
        assert "no wall-clock speedup" not in note and "toy" in note


def test_demo_says_a_worker_for_another_model_on_stderr(
        capsys: pytest.CaptureFixture[str]) -> None:
    """A worker named by --endpoint that drafts for another model: the demo's error goes to
    stderr as every dspark-client error does, stdout keeps only the demo's own output."""
    import io

    import msgspec

    from dspark_client import cli
    from dspark_client.demo.run import DEFAULT_PROMPT, run_demo

    args = cli.build_parser().parse_args(["demo"])
    args.prompt = DEFAULT_PROMPT
    other = msgspec.structs.replace(hello_from_checkpoint(REFERENCE_DIR, window=16, max_slots=1),
                                    hidden=256, row_bytes=3 * 256 * 2)
    out = io.StringIO()
    assert run_demo(lambda *_: other, args, out, endpoint="tcp://127.0.0.1:9",
                    note="using the worker at tcp://127.0.0.1:9 (--endpoint)") == 1
    assert out.getvalue() == "using the worker at tcp://127.0.0.1:9 (--endpoint)\n"
    err = capsys.readouterr().err
    assert err.startswith("dspark-client: the worker at tcp://127.0.0.1:9 drafts for 3 taps of"
                          " 256, vocab 260; the reference target has 3 taps of 128"), err


def test_demo_marks_text_from_accepted_drafts(monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    from dspark_client.demo.run import Marks

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.setenv("TERM", "xterm")
    assert Marks.for_stream(Tty()).drafted("ab") == "\x1b[32mab\x1b[0m"
    assert Marks.for_stream(io.StringIO()).drafted("ab") == "\u00abab\u00bb"
    assert Marks.for_stream(Tty()).drafted("") == ""
    monkeypatch.setenv("NO_COLOR", "1")
    assert Marks.for_stream(Tty()).drafted("ab") == "\u00abab\u00bb"
