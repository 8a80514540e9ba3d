"""dspark-client: commands against the fake worker, exit codes (0 ok, 1 worker error, 2 usage,
3 connection error) and one clear line on stderr. Against a real worker:
tests/e2e/test_cli_worker.py."""

from __future__ import annotations

import argparse
import io
import json
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from client_fakes import FakeWorker, make_hello, make_hello_reply

from dspark_client.cli import build_parser, main, normalise_endpoint
from dspark_client.client import RemoteDraftClient
from dspark_client.config import RemoteConfig
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
    code, out = run("--endpoint", fw.endpoint, "ping", "-c", "3", "-i", "0")
    assert code == 0 and out.count("pong from") == 3
    summary = out.strip().splitlines()[-1]
    assert "3 pings" in summary and "min/avg/max" in summary and summary.endswith(" ms")
    lo, avg, hi = (float(x) for x in summary.split("= ")[1].split()[0].split("/")[:3])
    assert 0 < lo <= avg <= hi
    code, out = run("--endpoint", fw.endpoint, "ping")
    assert code == 0 and "min/avg/max" not in out  # one PING: no summary


def test_stats_summary_and_json(fw: FakeWorker) -> None:
    code, out = run("--endpoint", fw.endpoint, "stats")
    assert code == 0 and out.startswith("worker fake-worker at " + fw.endpoint)
    assert "sessions 0/64, slots reserved 0/512" in out and "{" not in out
    code, out = run("--endpoint", fw.endpoint, "stats", "--json")
    assert code == 0 and json.loads(out)["worker_name"] == "fake-worker"
    assert "\n  " in out


def test_global_options_after_the_command_and_bare_host_port(fw: FakeWorker) -> None:
    host_port = fw.endpoint.removeprefix("tcp://")
    code, out = run("ping", "--endpoint", host_port, "--timeout", "5")
    assert code == 0 and f"pong from {fw.endpoint}:" in out
    # After the command wins over before it.
    code, out = run("--endpoint", dead_endpoint(), "stats", "--endpoint", fw.endpoint)
    assert code == 0 and "fake-worker" in out


def test_every_option_says_its_default() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, p in [("", parser), *sub.choices.items()]:
        for action in p._actions:
            if isinstance(action, argparse._HelpAction | argparse._SubParsersAction
                          | argparse._VersionAction):
                continue
            assert action.help and "default" in action.help, (name, action.dest)


def test_reset(fw: FakeWorker) -> None:
    code, out = run("--endpoint", fw.endpoint, "reset", "1", "3")
    assert code == 0 and "reset 1, 3 of session" in out
    assert "no engine's windows changed" in out  # it says what it did not do
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
    assert set(result["rtt_ms"]) >= {"p50", "p90", "p99", "max"}
    assert result["rounds_per_s"] > 0 and result["drafted_positions_per_s"] > 0
    assert fw.errors == []
    assert "12/" not in capsys.readouterr().out  # the progress bar goes to stderr only
    ops = [h.op for _, h, _ in fw.frames]
    # Geometry from STATS (no probe HELLO), one HELLO, and the session released at the end.
    assert ops[0] == wire.OP_STATS and ops.count(wire.OP_HELLO) == 1
    assert ops[-1] == wire.OP_GOODBYE and fw.sessions == {}
    if sampled:
        top_ks = {int(e.top_k) for _, entries in fw.steps for e in entries}
        assert top_ks == {wire.MAX_TOP_K}


class FakeTty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_bench_text_output_and_progress(fw: FakeWorker, monkeypatch: pytest.MonkeyPatch) -> None:
    tty = FakeTty()
    monkeypatch.setattr(sys, "stderr", tty)
    code, out = run("--endpoint", fw.endpoint, "bench", "--batch", "2", "--steps", "5",
                    "--warmup", "3")
    assert code == 0 and "rtt    p50" in out and "rounds/s" in out
    assert "5 measured rounds after 3 warm-up" in out
    rtt = out.split("rtt    p50")[1].split()
    assert rtt[1] == "ms"  # figures in ms
    err = tty.getvalue()
    # Warm-up counted apart from the measured rounds, on a terminal only.
    assert "warm-up" in err and "] 3/3" in err and "measured" in err and "] 5/5" in err
    assert "/8" not in err and err.endswith("\n")


def test_bench_no_progress_frames_off_a_terminal(fw: FakeWorker,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    code, _ = run("--endpoint", fw.endpoint, "bench", "--batch", "2", "--steps", "5")
    assert code == 0 and "\r" not in capsys.readouterr().err


def test_bench_fails_when_rounds_fail(fw: FakeWorker, capsys: pytest.CaptureFixture[str]) -> None:
    steps = 0

    def busy_after_warmup(ctx: Any) -> Any:
        nonlocal steps
        steps += 1
        return ("status", wire.ST_BUSY) if steps > 2 and steps % 3 == 0 else None

    fw.step_hook = busy_after_warmup
    code, out = run("--endpoint", fw.endpoint, "bench", "--batch", "2", "--steps", "30",
                    "--warmup", "2", "--json")
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1, err
    result = json.loads(out)
    assert result["failed_rounds"] == 10 and result["failed_reasons"] == {"frame_busy": 10}
    assert len(err) == 1 and "10 of 30 measured rounds failed" in err[0] and "1%" in err[0]
    assert fw.sessions == {}  # released on the error path too


def test_connection_error_exits_3(capsys: pytest.CaptureFixture[str]) -> None:
    ep = dead_endpoint()
    code, _ = run("--endpoint", ep, "--timeout", "0.5", "ping")
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 3 and len(err) == 1 and "connect failed" in err[0] and ep in err[0]
    code, _ = run("--endpoint", ep, "--timeout", "0.5", "bench")
    assert code == 3


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


def test_busy_says_why_once(capsys: pytest.CaptureFixture[str]) -> None:
    with FakeWorker(check_rows=False) as fw:
        fw.stats_limits.update(max_total_slots=12)
        holder = RemoteDraftClient(RemoteConfig(endpoint=fw.endpoint, timeout_ms=5000),
                                   make_hello(max_slots=8, client_name="vllm-dp0@host-a"),
                                   background=False)
        assert holder.connect_now()
        # Seen in STATS before any HELLO: nothing is asked of the worker.
        code, _ = run("--endpoint", fw.endpoint, "bench", "--batch", "8", "--steps", "2")
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 1 and len(err) == 1, err
        assert "worker busy" in err[0] and "8 slots asked, 4 of its max_total_slots 12" in err[0]
        assert f"session {holder.session:012x} 8 slots (0 in use" in err[0]
        assert "session_idle_s 600" in err[0]
        assert [h.op for _, h, _ in fw.frames].count(wire.OP_HELLO) == 1  # the holder's only
        # Refused BUSY at HELLO time (the room went between STATS and HELLO): the same reason.
        fw.stats_limits.update(max_total_slots=512)
        fw.hello_hook = lambda h, hello: (("status", wire.ST_BUSY)
                                          if hello.client_name.startswith("dspark-bench")
                                          else None)
        calls = 0
        real = fw.stats_json

        def shrinking() -> bytes:
            nonlocal calls
            calls += 1
            fw.stats_limits.update(max_sessions=1 if calls > 1 else 64)
            return real()

        fw.stats_json = shrinking  # type: ignore[method-assign]
        code, _ = run("--endpoint", fw.endpoint, "bench", "--batch", "8", "--steps", "2")
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 1 and len(err) == 1, err
        assert "it holds 1 sessions and its limit (max_sessions) is 1" in err[0]
        holder.close()


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


def test_normalise_endpoint() -> None:
    assert normalise_endpoint("10.0.0.7:7600") == "tcp://10.0.0.7:7600"
    assert normalise_endpoint("[::1]:7600") == "tcp://[::1]:7600"
    assert normalise_endpoint("/run/dspark.sock") == "unix:///run/dspark.sock"
    assert normalise_endpoint("tcp://h:1") == "tcp://h:1"
    assert normalise_endpoint("unix:///x") == "unix:///x"


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def test_help_of_both_console_scripts_and_every_command(
        capsys: pytest.CaptureFixture[str]) -> None:
    """What ``dspark-client [COMMAND] --help`` and ``dspark-worker --help`` run: the entry
    points pyproject names, each exiting 0 with its usage (a stray % in a help text used to
    end the top-level one in a TypeError)."""
    from pathlib import Path

    import msgspec.toml

    from dspark_worker import cli as worker_cli

    scripts = msgspec.toml.decode((Path(__file__).parents[2] / "pyproject.toml").read_bytes())[
        "project"]["scripts"]
    assert scripts == {"dspark-worker": "dspark_worker.cli:main",
                       "dspark-client": "dspark_client.cli:main"}
    commands = _subcommands(build_parser())
    assert set(commands) == {"ping", "stats", "reset", "reload", "bench", "demo"}
    cases: list[tuple[Any, list[str], str]] = [(worker_cli.main, ["--help"], "dspark-worker")]
    for flag in ("--help", "-h"):
        cases.append((main, [flag], "dspark-client"))
        cases += [(main, [name, flag], f"dspark-client {name}") for name in commands]
    for entry, argv, prog in cases:
        with pytest.raises(SystemExit) as info:
            entry(argv)
        out = capsys.readouterr().out
        assert info.value.code == 0, argv
        assert out.startswith(f"usage: {prog}"), (argv, out[:200])
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    out = capsys.readouterr().out
    assert "more than 1% of the measured rounds fail" in out
    assert all(name in out for name in commands)


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    import dspark_client
    import dspark_worker

    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"dspark-client {dspark_client.__version__}"
    assert dspark_client.__version__ == dspark_worker.__version__


def test_an_unknown_option_gets_its_commands_usage(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["ping", "--bogus"])
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert err.startswith("usage: dspark-client ping")
    assert "dspark-client ping: error: unrecognized arguments: --bogus" in err


def test_connection_errors_say_what_to_check(capsys: pytest.CaptureFixture[str],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    ep = dead_endpoint()
    monkeypatch.setenv("DSPARK_ENDPOINT", ep)
    code, _ = run("--timeout", "0.5", "ping")
    err = capsys.readouterr().err
    assert code == 3 and "Connection refused" in err
    assert f"is dspark-worker running and listening at {ep} (endpoint from DSPARK_ENDPOINT)?" \
        in err
    monkeypatch.setenv("DSPARK_ENDPOINT", "http://x:1")
    code, _ = run("ping")
    assert code == 2
    assert "DSPARK_ENDPOINT 'http://x:1': " in capsys.readouterr().err


def test_a_metrics_port_is_named_as_such(capsys: pytest.CaptureFixture[str]) -> None:
    """An HTTP server (the worker's --metrics-listen port) never answers a frame: after the
    timeout the error says what the endpoint is."""
    import http.server
    import threading

    class Quiet(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        code, _ = run("--endpoint", f"127.0.0.1:{server.server_address[1]}", "--timeout",
                      "0.5", "ping")
    finally:
        server.shutdown()
        server.server_close()
    err = capsys.readouterr().err
    assert code == 3 and "timed out" in err
    assert "answers HTTP: it is a metrics port (--metrics-listen)" in err


def _interrupt_soon(delay: float) -> Any:
    import os
    import signal
    import threading

    timer = threading.Timer(delay, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    return timer


def test_ctrl_c_in_ping_prints_the_summary(fw: FakeWorker,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    timer = _interrupt_soon(0.5)
    try:
        code, out = run("--endpoint", fw.endpoint, "ping", "-c", "1000", "-i", "0.05")
    finally:
        timer.cancel()
    err = capsys.readouterr().err
    assert code == 130
    assert "stopping after this PING" in err and "session" not in err
    assert "pong from" in out and "pings, rtt min/avg/max/mdev" in out.splitlines()[-1]


def test_ctrl_c_in_bench_prints_what_was_measured(fw: FakeWorker,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    timer = _interrupt_soon(1.0)
    try:
        code, out = run("--endpoint", fw.endpoint, "bench", "--batch", "2", "--warmup", "1",
                        "--steps", "1000000", "--json")
    finally:
        timer.cancel()
    assert code == 130
    result = json.loads(out)
    assert result["interrupted"] and 0 < result["steps"] < 1000000
    assert result["rtt_ms"]["p50"] > 0
    assert "printing the rounds measured so far" in capsys.readouterr().err


def test_a_closed_pipe_ends_a_command_quietly(fw: FakeWorker) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "dspark_client.cli", "--endpoint",
                             fw.endpoint, "ping", "-c", "100000", "-i", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.readline().startswith(b"pong from")
    proc.stdout.close()  # what `| head -1` does once it has its line
    err = proc.stderr.read()
    proc.stderr.close()
    assert proc.wait(60) == 141 and err == b"", err


def test_stats_summary_shows_acceptance() -> None:
    from dspark_client.cli import stats_summary
    from protocol.acceptance import AcceptanceTotals

    t = AcceptanceTotals(3)
    empty = {"totals": {"acceptance": t.summary()}, "sessions": []}
    assert "acceptance: no judged draft blocks yet" in stats_summary(empty, "tcp://w:1")
    # Four blocks: two of 3 drafts, two of 2; accepted 0, 1, 2 and 2 of them.
    t.drafted_hist[:], t.lengths[:] = [0, 0, 2, 2], [1, 1, 2, 0]
    t.predicted[:] = [3.2, 1.6, 0.5]
    acc = t.summary()
    st = {"totals": {"acceptance": acc},
          "sessions": [{"label": "abc", "max_slots": 4, "acceptance": acc}]}
    text = stats_summary(st, "tcp://w:1")
    assert "acceptance: 4 judged blocks, mean accepted length 2.25 (bonus token incl.)" in text
    assert "by position 0.75 0.50 0.00; predicted 0.80 0.40 0.25" in text
    (line,) = [x for x in text.splitlines() if x.strip().startswith("session abc")]
    assert line.endswith(", accepted length 2.25")
    st["sessions"].append({"label": "b3nch", "max_slots": 2, "synthetic": True,
                           "acceptance": acc})
    text = stats_summary(st, "tcp://w:1")
    assert "(bonus token incl.) (1 synthetic session left out)" in text
    (line,) = [x for x in text.splitlines() if x.strip().startswith("session b3nch")]
    assert line.endswith(", accepted length 2.25, synthetic (not in acceptance)")


def test_a_dns_endpoint_names_every_worker(fw: FakeWorker, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    """``dns+tcp://NAME:PORT``, as the library and the Kubernetes docs write it: ping and stats
    ask every address the name resolves to (one that does not answer is named on stderr and
    sets the exit code), the other commands use the first; a name with no address is a
    connection error."""
    import dspark_client.discovery as discovery

    port = int(fw.endpoint.rsplit(":", 1)[1])
    answers = {"workers.test": ["127.0.0.1", "127.0.0.2"], "none.test": []}
    monkeypatch.setattr(discovery, "system_resolver", lambda name, _port: answers[name])
    # 127.0.0.2 is loopback too, and nothing listens there on the fake worker's port.
    code, out = run("--endpoint", f"dns+tcp://workers.test:{port}", "ping")
    err = capsys.readouterr().err
    assert code == 3 and out.count(f"pong from tcp://127.0.0.1:{port}") == 1, (out, err)
    assert f"dspark-client: tcp://127.0.0.2:{port}: " in err
    code, out = run("--endpoint", f"dns+tcp://workers.test:{port}", "stats", "--json")
    every = json.loads(out)
    assert code == 3 and set(every) == {f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.2:{port}"}
    assert every[f"tcp://127.0.0.1:{port}"]["worker_name"] == "fake-worker"
    assert "error" in every[f"tcp://127.0.0.2:{port}"]
    answers["workers.test"] = ["127.0.0.1"]
    code, out = run("--endpoint", f"dns+tcp://workers.test:{port}", "stats")
    assert code == 0 and out.startswith(f"worker fake-worker at tcp://127.0.0.1:{port}")
    code, _ = run("--endpoint", f"dns+tcp://none.test:{port}", "ping")
    assert code == 3 and "names no worker" in capsys.readouterr().err


def test_stats_summary_says_a_drafter_has_no_markov_head() -> None:
    """A DFlash drafter's Markov identity is the digest of no tensors: said in words, not
    shown as a digest that names nothing."""
    from dspark_client.cli import stats_summary
    from protocol.identity import NO_MARKOV_HEAD

    st = {"drafter_name": "dflash@1234abcd", "drafter_identity": "ab" * 32,
          "markov_identity": NO_MARKOV_HEAD.hex(), "sessions": []}
    text = stats_summary(st, "tcp://w:1")
    assert f"  drafter dflash@1234abcd: {'ab' * 8}..  no Markov head" in text
    assert NO_MARKOV_HEAD.hex()[:16] not in text
    st["markov_identity"] = "cd" * 32
    assert f"  markov {'cd' * 8}.." in stats_summary(st, "tcp://w:1")


def test_stats_summary_names_the_engine_of_each_session() -> None:
    """A stranger sees each session's label and the engine it belongs to (a keyed hash of
    its client name, the same across that engine's sessions), never the name itself."""
    from dspark_client.cli import stats_summary

    st = {"sessions": [{"label": "a1b2c3d4e5f6", "engine": "0f1e2d3c4b5a", "max_slots": 4},
                       {"label": "ffeeddccbbaa", "engine": None, "max_slots": 2}]}
    lines = [x.strip() for x in stats_summary(st, "tcp://w:1").splitlines()]
    assert any(x.startswith("session a1b2c3d4e5f6 of engine 0f1e2d3c4b5a  4 slots")
               for x in lines), lines
    assert any(x.startswith("session ffeeddccbbaa") and "engine" not in x for x in lines)
