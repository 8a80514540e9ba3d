"""dspark-client: commands against the fake worker, exit codes (0 ok, 1 worker error, 2 usage or
connection error) and one clear line on stderr."""

from __future__ import annotations

import io
import json
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from client_fakes import FakeWorker, make_hello_reply

from dspark_client.cli import main
from protocol import wire
from protocol.messages import decode_reset


@pytest.fixture
def fw() -> Iterator[FakeWorker]:
    with FakeWorker(check_rows=False) as w:  # bench rows are synthetic
        yield w


def run(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    code = main(list(argv), out=out)
    return code, out.getvalue()


def dead_endpoint() -> str:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"tcp://127.0.0.1:{port}"


def test_ping(fw: FakeWorker) -> None:
    code, out = run("--endpoint", fw.endpoint, "ping", "-c", "3")
    assert code == 0 and out.count("pong from") == 3


def test_stats_prints_pretty_json(fw: FakeWorker) -> None:
    code, out = run("--endpoint", fw.endpoint, "stats")
    assert code == 0 and json.loads(out)["worker_name"] == "fake-worker"
    assert "\n  " in out


def test_reset(fw: FakeWorker) -> None:
    code, out = run("--endpoint", fw.endpoint, "reset", "1", "3")
    assert code == 0 and "reset 1, 3 of session" in out
    resets = [h for _, h, _ in fw.frames if h.op == wire.OP_RESET]
    body = next(b for _, h, b in fw.frames if h.op == wire.OP_RESET)
    assert len(resets) == 1 and decode_reset(body) == [1, 3]


@pytest.mark.parametrize("sampled", [False, True])
def test_bench(fw: FakeWorker, sampled: bool, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--endpoint", fw.endpoint, "bench", "--batch", "3", "--steps", "12", "--warmup",
            "2", "--json"]
    if sampled:
        args.append("--sampled")
    code, out = run(*args)
    assert code == 0
    result = json.loads(out)
    assert result["batch"] == 3 and result["failed_rounds"] == 0
    assert set(result["rtt_us"]) >= {"p50", "p90", "p99", "max"}
    assert result["rounds_per_s"] > 0 and result["drafted_positions_per_s"] > 0
    assert fw.errors == []
    assert "12/" not in capsys.readouterr().out  # the progress bar goes to stderr only
    hellos = [h for _, h, _ in fw.frames if h.op == wire.OP_HELLO]
    assert len(hellos) == 2  # the probe, then the HELLO with the worker's geometry


def test_bench_text_output_and_progress(fw: FakeWorker,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    code, out = run("--endpoint", fw.endpoint, "bench", "--batch", "2", "--steps", "5",
                    "--warmup", "0")
    assert code == 0 and "rtt    p50" in out and "rounds/s" in out
    err = capsys.readouterr().err
    assert "] 5/5" in err and err.endswith("\n")  # the progress bar, on stderr


def test_connection_error_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    ep = dead_endpoint()
    code, _ = run("--endpoint", ep, "--timeout", "0.5", "ping")
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "connect failed" in err[0] and ep in err[0]


def test_bad_endpoint_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    code, _ = run("--endpoint", "http://x:1", "ping")
    assert code == 2 and "unknown scheme 'http'" in capsys.readouterr().err


def test_usage_error_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["frobnicate"])
    assert info.value.code == 2
    with pytest.raises(SystemExit) as info:
        main(["--timeout", "-1", "ping"])
    assert info.value.code == 2
    assert "must be a number > 0" in capsys.readouterr().err


def test_worker_refusal_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    with FakeWorker(hello_status=wire.ST_AUTH) as fw:
        code, _ = run("--endpoint", fw.endpoint, "bench", "--steps", "2")
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1 and "HELLO refused: AUTH" in err[0]
    assert "--auth-secret-file" in err[0]


def test_worker_without_top32_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    with FakeWorker(hello_reply=make_hello_reply(capabilities=wire.CAP_TAPS_BF16)) as fw:
        code, _ = run("--endpoint", fw.endpoint, "bench", "--sampled", "--steps", "2")
    assert code == 1 and "top32" in capsys.readouterr().err


def test_auth_secret_file(tmp_path: Any) -> None:
    secret = tmp_path / "secret"
    secret.write_text("hunter2\n")
    with FakeWorker(secret=b"hunter2") as fw:
        code, out = run("--endpoint", fw.endpoint, "--auth-secret-file", str(secret),
                        "bench", "--steps", "3", "--batch", "1", "--json", "--no-progress")
        assert code == 0 and json.loads(out)["failed_rounds"] == 0


def test_console_script(fw: FakeWorker) -> None:
    exe = shutil.which("dspark-client")
    cmd = [exe] if exe else [sys.executable, "-m", "dspark_client.cli"]
    out = subprocess.run([*cmd, "--endpoint", fw.endpoint, "ping"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and "pong" in out.stdout
