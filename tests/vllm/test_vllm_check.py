"""What an engine learns before and at its start: ``python -m dspark_vllm check`` against a
worker that accepts and one that refuses; the worker's window taken where ``window`` is unset;
the WARNING lines of an engine without drafts; and the README's worker command with the
README's plugin options, which draft together."""

from __future__ import annotations

import json
import logging
import re
import shlex
import socket
from pathlib import Path
from typing import Any

import pytest
from vllm_engine import CPU, Engine, model_config, speculative_config, target_folder, vllm_config

from tests.support.worker_proc import start_worker, worker_stats

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    return target_folder(tmp_path_factory.mktemp("target"))


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def check(target: Path, spec: dict[str, Any], *extra: str) -> tuple[int, str]:
    import io

    from dspark_vllm.check import run_check

    out = io.StringIO()
    code = run_check([str(target), "--speculative-config", json.dumps(spec), *extra], out)
    return code, out.getvalue()


def test_check_says_this_engine_will_draft_and_leaves(
        target_dir: Path, drafter_dirs: dict[str, Path], worker: Any) -> None:
    """vLLM's own parsing and the plugin's checks, the worker's W learnt (window unset), a
    HELLO the worker accepts, then GOODBYE: no session of the check is left on the worker."""
    code, text = check(target_dir, {
        "method": "remote_dspark", "model": str(drafter_dirs["host"]),
        "speculator_options": {"endpoint": worker.endpoint, "max_slots": 11}},
        "--max-num-seqs", "12")
    assert code == 0, text
    assert text.startswith("this engine will draft: N 7 (verifying up to 7), W 16, drafter"
                           f" {drafter_dirs['host']} (")
    assert text.rstrip().endswith(
        f"; 11 slots (max_num_seqs 12: --max-num-seqs); W and limits the worker's, at"
        f" {worker.endpoint}")
    assert not [s for s in worker_stats(worker)["sessions"] if s["max_slots"] == 11]


def test_check_names_why_this_engine_will_not_draft(
        target_dir: Path, drafter_dirs: dict[str, Path], worker: Any,
        capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture) -> None:
    """As ``python -m dspark_vllm check`` runs it (its ``main``): a window the worker does not
    serve is the worker's refusal, with both values, exit 1; a worker that is not there and a
    misspelt option likewise, each with its reason. (The worker's default max_slots, 256 on
    this machine, is more than the worker's 16: the worker's limit is taken.)"""
    from dspark_vllm.check import main

    spec = {"method": "remote_dspark", "model": str(drafter_dirs["host"]),
            "speculator_options": {"endpoint": worker.endpoint, "window": 32}}
    code = main(["check", str(target_dir), "--speculative-config", json.dumps(spec)])
    out = capsys.readouterr().out
    assert code == 1, out
    assert out.strip() == ("this engine will not draft: remote drafting disabled: HELLO"
                           " refused: GEOMETRY (window 16 != ours 32)")
    assert re.search(r"the worker at \S+ takes at most 16 slots per session \(its"
                     r" --max-slots\), fewer than the engine's \d+ requests at once",
                     caplog.text), caplog.text
    gone = f"tcp://127.0.0.1:{closed_port()}"
    code, text = check(target_dir, {**spec, "speculator_options": {
        "endpoint": gone, "window": 16, "connect_timeout_ms": 300}})
    assert code == 1 and text.startswith(f"this engine will not draft: {gone}: connect failed:"
                                         ), text
    code, text = check(target_dir, {**spec, "speculator_options": {"endpiont": gone}})
    assert code == 1 and "unknown option 'endpiont' (did you mean 'endpoint'?)" in text, text


def test_an_engine_takes_the_workers_window_and_warns_when_it_cannot(
        target_dir: Path, drafter_dirs: dict[str, Path], worker: Any,
        caplog: pytest.LogCaptureFixture) -> None:
    """``window`` unset: the HELLO carries the worker's W (16 here, not the default 1024) and is
    accepted. No worker there: WARNING lines from dspark_client say so, with the reason."""
    from dspark_vllm.speculator import RemoteDSparkSpeculator

    target = model_config(target_dir)
    spec = speculative_config(target, drafter_dirs["host"], speculator_options={
        "endpoint": worker.endpoint, "client_name": "learns-w"})
    speculator = RemoteDSparkSpeculator(vllm_config(target, spec, max_num_seqs=2), CPU)
    client = speculator.rounds.client
    assert client.ready, client.last_error
    assert client.hello.window == speculator.window == 16
    client.close()
    gone = f"tcp://127.0.0.1:{closed_port()}"
    spec = speculative_config(target, drafter_dirs["host"], speculator_options={
        "endpoint": gone, "client_name": "no-worker", "connect_timeout_ms": 200})
    with caplog.at_level(logging.WARNING, logger="dspark_client"):
        speculator = RemoteDSparkSpeculator(vllm_config(target, spec, max_num_seqs=2), CPU)
    assert speculator.rounds.client.hello.window == 1024  # the default, said at WARNING
    warned = [r.getMessage() for r in caplog.records
              if r.levelno == logging.WARNING and r.name == "dspark_client"]
    assert any(m.startswith("remote DSpark: no worker told its window and limits within 200"
                            f" ms ({gone}: connect failed: ") for m in warned), warned
    assert any(m.startswith(f"remote DSpark connect/HELLO to {gone} failed: ")
               for m in warned), warned
    speculator.rounds.client.close()


def _readme_commands() -> tuple[list[str], dict[str, Any]]:
    """The README's worker command that serves the drafter its ``vllm serve`` line names, and
    that line's speculative config, as vLLM's own argument parser reads it."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    serve = re.search(r"^vllm serve (.*)$", readme[readme.index("## With vLLM"):], re.M)
    assert serve is not None
    args = EngineArgs.add_cli_args(FlexibleArgumentParser()).parse_args(
        ["--model", *shlex.split(serve.group(1))])
    raw = dict(args.speculative_config)
    commands = [shlex.split(c.replace("\\\n", " ")) for c in re.findall(
        r"^(dspark-worker --checkpoint (?:.|\\\n)*?[^\\])$", readme, re.M)]
    served = [c for c in commands if c[c.index("--checkpoint") + 1] == raw["model"]]
    assert len(served) == 1, (raw["model"], commands)
    return served[0][1:], raw


def test_the_readmes_worker_command_and_vllm_options_draft_together(
        target_dir: Path, drafter_dirs: dict[str, Path], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The README's worker command for the drafter its ``vllm serve`` line names, and that
    line's ``speculator_options`` as they are, give drafts. What stands in for the README's
    host: the drafter (the reference one), the device (CPU), the slots reserved (8: memory),
    the addresses (loopback, free ports), the secret file (a new one at the same key), and
    ``timeout_ms`` (a CPU drafter on a shared test machine is slower than a GPU's); and
    ``enable_adaptive_verification`` is left out, as vLLM refuses it without full CUDA graphs
    (the test's ``VllmConfig`` is the CPU's)."""
    from vllm.platforms import current_platform

    from dspark_vllm.speculator import RemoteDSparkSpeculator

    monkeypatch.setattr(current_platform, "device_type", "cpu")
    argv, raw = _readme_commands()
    options = raw["speculator_options"]
    secret = tmp_path / "secret"
    secret.write_text("s3cret-shared-by-both\n")
    swap = {"--checkpoint": str(drafter_dirs["full"]), "--device": "cpu",
            "--max-total-slots": "8", "--listen": "127.0.0.1:0",
            "--metrics-listen": "127.0.0.1:0", "--auth-secret-file": str(secret)}
    for flag, value in swap.items():
        if flag in argv:
            argv[argv.index(flag) + 1] = value
    at = argv.index("--target-checkpoint")  # the reference drafter has its own embeddings
    del argv[at:at + 2]
    assert "auth_secret_file" in options and "window" not in options  # W is the worker's
    with start_worker(*argv) as w:
        opts = {**options, "endpoint": w.endpoint, "auth_secret_file": str(secret),
                "timeout_ms": 5000}
        target = model_config(target_dir)
        spec = speculative_config(target, drafter_dirs["host"], speculator_options=opts,
                                  **{k: v for k, v in raw.items()
                                     if k not in ("method", "model", "speculator_options",
                                                  "enable_adaptive_verification")})
        speculator = RemoteDSparkSpeculator(vllm_config(target, spec, max_num_seqs=2), CPU)
        client = speculator.rounds.client
        assert client.ready, client.last_error
        assert client.hello.window == int(argv[argv.index("--window") + 1])
        eng = Engine(speculator, max_num_reqs=2, num_spec=7, window=client.hello.window)
        eng.admit("a", 12)
        step = eng.step({"a": (12, 0)})
        assert step.drafts.any() and (step.confidence > 0).any()
        client.close()
