"""A real ``dspark-worker`` subprocess and an unlucky operator or a guessing stranger: signals
(a logrotate ``kill -HUP``), two workers on one ``--unix`` path, a port file that is a
directory, HTTP requests ended with a bare LF or not at all, repeated HELLOs with a wrong
tag, and a checkpoint whose weights are NaN."""

from __future__ import annotations

import json
import os
import signal
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from worker_harness import Client, make_hello, tap_rows

from protocol.constants import RF_NEED_DRAFT, ST_AUTH, ST_INTERNAL, ST_OK
from protocol.messages import Hello, ReqEntry
from tests.support.worker_proc import WorkerStartError, start_worker, worker_stats

SMALL = ("--window", "32", "--max-slots", "16", "--max-total-slots", "48",
         "--max-rows-per-step", "256", "--no-warmup")


def _wait(pred: Any, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_hup_reloads_usr_signals_are_logged_none_kills_quit_drains() -> None:
    with start_worker(*SMALL) as w:
        assert w.host and w.port
        w.proc.send_signal(signal.SIGHUP)  # the same embedded drafter: nothing to change
        assert _wait(lambda: "reload of the drafter unchanged" in w.log_text())
        for sig in (signal.SIGUSR1, signal.SIGUSR2):
            w.proc.send_signal(sig)
            assert _wait(lambda s=sig: f"{signal.Signals(s).name}: ignored" in w.log_text())
        assert w.running
        with Client((w.host, w.port)) as c:
            assert c.ping(session=0).status == ST_OK
        w.proc.send_signal(signal.SIGQUIT)
        assert w.proc.wait(30) == 0
        log = w.log_text()
        assert "SIGQUIT: shutting down" in log and "stopped" in log.lower()
        assert "Traceback" not in log


def test_a_second_worker_on_a_live_unix_path_refuses_to_start(tmp_path: Path) -> None:
    path = str(tmp_path / "w.sock")
    with start_worker(*SMALL, "--unix", path) as first:
        try:
            extra = start_worker(*SMALL, "--unix", path, timeout=60)
        except WorkerStartError as exc:
            assert "another process is serving on" in str(exc)
        else:
            extra.stop()  # it started: stop it, then fail
            raise AssertionError("a second worker started on a live --unix path")
        with Client(path) as c:  # the first one still answers on its path
            assert c.ping(session=0).status == ST_OK
        # Someone removes the path and a new worker takes it: the first one, stopping, leaves
        # the new one's socket alone.
        os.unlink(path)
        with start_worker(*SMALL, "--unix", path) as second:
            assert first.stop() == 0
            assert os.path.exists(path)
            with Client(path) as c:
                assert c.ping(session=0).status == ST_OK
            assert second.running
        assert not os.path.exists(path)  # its own socket is removed when it stops
    # A socket file nothing listens on (a crashed run's) is replaced.
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(path)
    stale.close()
    with start_worker(*SMALL, "--unix", path) as third, Client(path) as c:
        assert c.ping(session=0).status == ST_OK and third.running


def test_a_port_file_that_is_a_directory_fails_before_listening(tmp_path: Path) -> None:
    folder = tmp_path / "ports"
    folder.mkdir()
    t0 = time.monotonic()
    with pytest.raises(WorkerStartError) as info:
        start_worker(*SMALL, "--port-file", str(folder), timeout=60)
    assert f"port file {folder}: is a directory" in str(info.value)
    assert "listening on" not in str(info.value)
    assert list(folder.iterdir()) == [] and list(tmp_path.glob("*.tmp")) == []
    assert time.monotonic() - t0 < 60


def _http(host: str, port: int, data: bytes, *, half_close: bool = False,
          timeout: float = 10.0) -> tuple[bytes, float]:
    t = time.perf_counter()
    with socket.create_connection((host, port), timeout=timeout) as s:
        s.sendall(data)
        if half_close:
            s.shutdown(socket.SHUT_WR)
        out = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            out += chunk
    return out, time.perf_counter() - t


def test_metrics_port_answers_bare_lf_and_unterminated_requests() -> None:
    with start_worker(*SMALL) as w:
        assert w.metrics_url
        host, port = w.metrics_url.removeprefix("http://").rsplit(":", 1)
        out, took = _http(host, int(port), b"GET /healthz HTTP/1.0\n\n")
        assert out.startswith(b"HTTP/1.1 200") and out.endswith(b"ok\n") and took < 1.0
        out, took = _http(host, int(port), b"GET /metrics HTTP/1.0\r\n", half_close=True)
        assert out.startswith(b"HTTP/1.1 200") and b"dspark_worker_ready 1.0" in out
        assert took < 1.0
        out, took = _http(host, int(port), b"GET /healthz HTTP/1.0\r\nHost: x")  # never ends
        assert out.startswith(b"HTTP/1.1 408") and 1.5 < took < 5.0
        # A request a byte at a time, blank lines first, is still one request.
        with socket.create_connection((host, int(port)), timeout=5.0) as s:
            for b in b"\r\n\nGET /healthz HTTP/1.0\r\n\r\n":
                s.sendall(bytes([b]))
            assert s.recv(65536).startswith(b"HTTP/1.1 200")


def test_each_port_tells_a_stray_client_which_port_it_wanted(
        drafter: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """An engine or tool given the metrics port instead of --listen: its HELLO (no line end
    in it, so an HTTP server would wait for one) is answered at once, in HTTP, with the flag
    to use, and the client's error says so. A scrape or probe given the draft port: answered
    in HTTP with the metrics port, then closed."""
    from dspark_client.cli import main as client_main
    from protocol import wire

    with start_worker(*SMALL) as w:
        assert w.metrics_url
        host, port = w.metrics_url.removeprefix("http://").rsplit(":", 1)
        frame = wire.frame(wire.OP_HELLO, 1, 0, make_hello(drafter).pack())
        out, took = _http(host, int(port), frame)
        assert out.startswith(b"HTTP/1.1 400") and b"--listen" in out and took < 1.0
        capsys.readouterr()
        t = time.perf_counter()
        code = client_main(["--endpoint", f"{host}:{port}", "--timeout", "10", "ping"])
        took = time.perf_counter() - t
        err = capsys.readouterr().err
        assert code == 3 and took < 2.0, (code, took, err)
        assert "answers HTTP, not dspark frames" in err and "--metrics-listen" in err
        assert w.host and w.port
        out, took = _http(w.host, w.port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        assert out.startswith(b"HTTP/1.1 400") and took < 1.0
        assert f"served on port {port} (--metrics-listen)".encode() in out


def test_wrong_hello_tags_close_the_connection_after_three(tmp_path: Path,
                                                           drafter: Any) -> None:
    secret = tmp_path / "secret"
    secret.write_text("s3cret-for-the-test")
    secret.chmod(0o600)
    with start_worker(*SMALL, "--auth-secret-file", str(secret)) as w:
        assert w.host and w.port
        with Client((w.host, w.port)) as c:
            for _ in range(3):
                assert c.hello(make_hello(drafter), secret=b"guess").status == ST_AUTH
            assert c.is_closed()
        with Client((w.host, w.port)) as c:  # a new connection has its tries again
            assert c.hello(make_hello(drafter), secret=b"s3cret-for-the-test").status == ST_OK


def test_a_drafter_with_nan_weights_is_an_internal_error_and_unhealthy(
        tmp_path: Path) -> None:
    import torch

    from dspark_client.client import RemoteDraftClient
    from dspark_client.config import RemoteConfig
    from dspark_worker.drafter import load_drafter, save_checkpoint

    d = load_drafter(None)
    with torch.no_grad():
        d.model.lm_head.weight.fill_(float("nan"))
    save_checkpoint(d.model, tmp_path / "nan")
    with start_worker(*SMALL, "--warmup", "--checkpoint", str(tmp_path / "nan")) as w:
        assert w.host and w.port and w.metrics_url
        # the start-up check found it: unhealthy before any engine came
        try:
            urllib.request.urlopen(w.metrics_url + "/healthz", timeout=10)
            raise AssertionError("healthz said ok")
        except urllib.error.HTTPError as e:
            assert e.code == 503 and b"not finite" in e.read()
        assert "the drafter's own check failed" in w.log_text()
        stats = worker_stats(w)
        g = stats["geometry"]
        hello = Hello(sample_mode=0, window=32, num_spec=g["num_spec"], max_slots=4,
                      max_rows_per_step=64, row_bytes=g["row_bytes"],
                      vocab_size=g["vocab_size"], n_taps=g["n_taps"], hidden=g["hidden"],
                      drafter_identity=bytes.fromhex(stats["drafter_identity"]),
                      markov_identity=bytes.fromhex(stats["markov_identity"]),
                      client_name="nan")
        with Client((w.host, w.port)) as c:
            assert c.hello(hello).status == ST_OK
            entries = [ReqEntry(slot=0, generation=1, anchor_pos=8, anchor_token=3, n_rows=8,
                                flags=RF_NEED_DRAFT)]
            r = c.step(entries, tap_rows(g["row_bytes"], 0, 1, 0, 8), g["row_bytes"])
            assert r.status == ST_INTERNAL
        try:
            urllib.request.urlopen(w.metrics_url + "/healthz", timeout=10)
            raise AssertionError("healthz said ok")
        except urllib.error.HTTPError as e:
            assert e.code == 503 and b"not finite" in e.read()
        # The engine's client backs off instead of re-HELLOing many times a second.
        cfg = RemoteConfig(endpoint=w.endpoint or "", timeout_ms=2000, backoff_ms=20,
                           backoff_max_ms=2000)
        client = RemoteDraftClient(cfg, hello)
        try:
            assert client.wait_ready(10)
            buf = bytearray(1 << 16)
            rows = tap_rows(g["row_bytes"], 0, 1, 0, 8)
            t_end = time.monotonic() + 2.0
            while time.monotonic() < t_end:
                client.step(buf, entries, 8, 1, rows=np.ascontiguousarray(rows))
                time.sleep(0.01)
            hellos = client.stats.snapshot().get("hellos", 0)
        finally:
            client.close()
        assert 2 <= hellos <= 8, hellos  # 20, 40, 80, 160, 320, 640 ms apart
        log = w.log_text()
    assert "not finite" in log and "Traceback" not in log
    json.dumps(stats)  # it was a real STATS object


@pytest.fixture()
def drafter() -> Any:
    from tests.support.local_drafts import reference_drafter_one_thread

    yield from reference_drafter_one_thread()
