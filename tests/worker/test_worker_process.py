"""The worker as a program (tests.support.worker_proc): config file and flags end to end, TCP and
Unix sockets, /healthz, logs, SIGTERM draining in-flight STEPs and exiting 0, startup errors."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from worker_harness import Client, make_hello, tap_rows

from protocol.constants import OP_STEP, RF_NEED_DRAFT, RS_OK, ST_OK
from protocol.framing import frame
from protocol.messages import ReqEntry, pack_step
from tests.support.worker_proc import WorkerStartError, start_worker


def test_worker_process_end_to_end(tmp_path: Path, drafter: Any) -> None:
    d = drafter
    toml = tmp_path / "worker.toml"
    toml.write_text('window = 48\nmax_slots = 8\nmax_total_slots = 16\n'
                    'worker_name = "from-file"\n')
    sock = str(tmp_path / "w.sock")
    with start_worker("--config", str(toml), "--worker-name", "from-cli", "--unix", sock,
                      "--no-warmup") as w:
        assert w.endpoint is not None and w.endpoint.startswith("tcp://127.0.0.1:")
        assert w.unix_path == sock and w.unix_endpoint == f"unix://{sock}"
        with urllib.request.urlopen(f"{w.metrics_url}/healthz", timeout=10) as r:
            assert r.status == 200
        assert w.host is not None and w.port is not None
        c = Client((w.host, w.port))
        r = c.hello(make_hello(d, window=48, max_slots=8, client_name="proc-test"))
        assert r.status == ST_OK
        rep = r.hello()
        assert (rep.worker_name, rep.window, rep.max_slots) == ("from-cli", 48, 8)  # flag wins
        rows = tap_rows(d.row_bytes, 0, 1, 0, 10)
        e = [ReqEntry(slot=0, generation=1, anchor_pos=10, anchor_token=3, n_rows=10,
                      flags=RF_NEED_DRAFT)]
        s = c.step(e, rows, d.row_bytes)
        assert s.status == ST_OK and s.step().status.tolist() == [RS_OK]
        with Client(sock) as u:
            assert u.ping(session=0).status == ST_OK
        # SIGTERM with a STEP just sent: the STEP is answered, then the worker exits 0.
        c.send_raw(frame(OP_STEP, c.next_seq(), c.session,
                         pack_step(9, [ReqEntry(slot=0, generation=1, anchor_pos=10,
                                                anchor_token=4, flags=RF_NEED_DRAFT)],
                                   b"", d.row_bytes)))
        w.proc.send_signal(signal.SIGTERM)
        last = c.recv()
        assert last.status == ST_OK and last.step().step_id == 9
        assert w.proc.wait(30) == 0
        c.close()
        log = w.log_text()
    assert "SIGTERM: shutting down" in log
    assert f"drafter_identity {d.drafter_identity.hex()}" in log
    assert re.search(r"listening on tcp://127\.0\.0\.1:\d+", log)
    assert f"listening on unix://{sock}" in log
    assert re.search(r"ring pool: 16 slots x W 48 = [\d.]+ MiB", log)
    assert re.search(r"session 0x[0-9a-f]{8} created: client 'proc-test'", log)
    assert not Path(sock).exists()  # the Unix socket is removed on exit


def test_defaults_with_no_options(drafter: Any) -> None:
    """No options but the harness's: the embedded model, W 1024, 256 slots per session."""
    with start_worker("--metrics-listen", "none") as w:
        ports = json.loads((w.log_path.parent / "ports.json").read_text())
        assert set(ports) == {"listen", "unix", "metrics", "pid"}
        assert ports["metrics"] is None and ports["unix"] is None and ports["pid"] == w.pid
        assert w.metrics_url is None and ports["listen"] == f"{w.host}:{w.port}"
        assert w.host is not None and w.port is not None
        with Client((w.host, w.port)) as c:
            r = c.hello(make_hello(drafter, window=1024, max_slots=256, max_rows_per_step=4096))
            assert r.status == ST_OK
            rep = r.hello()
            assert (rep.window, rep.num_spec, rep.max_slots) == (1024, 7, 256)
            rows = tap_rows(drafter.row_bytes, 0, 1, 0, 40)
            s = c.step([ReqEntry(slot=0, generation=1, anchor_pos=40, anchor_token=3,
                                 n_rows=40, flags=RF_NEED_DRAFT)], rows, drafter.row_bytes)
            assert s.status == ST_OK and s.step().draft_ids.any()
        assert w.stop() == 0


@pytest.mark.parametrize(("args", "message"), [
    (["--checkpoint", "/nonexistent/ckpt"], "cannot start: --checkpoint /nonexistent/ckpt:"
                                            " does not exist"),
    (["--target-checkpoint", "/nonexistent/target"],  # checked also when it is not needed
     "cannot start: --target-checkpoint /nonexistent/target: does not exist"),
    (["--auth-secret-file", "/nonexistent/secret"], "auth_secret_file"),
])
def test_startup_errors_exit_1(args: list[str], message: str) -> None:
    with pytest.raises(WorkerStartError) as e:
        start_worker(*args, timeout=60)
    assert "exited with 1" in str(e.value) and message in str(e.value)
    if "checkpoint" in message:  # said before the drafter (and torch) loads
        assert "loading drafter" not in str(e.value)


def test_a_fifo_as_secret_file_is_refused_by_name(tmp_path: Path) -> None:
    """A FIFO would block the worker's open for ever: it exits at once, naming the file."""
    fifo = tmp_path / "secret"
    os.mkfifo(fifo)
    with pytest.raises(WorkerStartError) as e:
        start_worker("--auth-secret-file", str(fifo), "--no-warmup", timeout=60)
    assert "exited with 1" in str(e.value)
    assert f"auth_secret_file '{fifo}' cannot be read as a secret file: is a FIFO, not a" \
        " regular file" in str(e.value)


def test_a_dflash2_drafter_tapping_past_the_targets_layers_is_refused(tmp_path: Path) -> None:
    """A speculators dflash2 drafter whose aux_hidden_state_layer_ids go past the target's
    layers does not start (as z-lab's format with num_target_layers): key, value, limit."""
    data = Path(__file__).resolve().parent / "drafter" / "data" / "dflash_tiny"
    drafter = shutil.copytree(data / "spec_dflash2_b5", tmp_path / "drafter",
                              ignore=shutil.ignore_patterns("dspark_identity.json"))
    target = shutil.copytree(data / "target", tmp_path / "target")
    config = json.loads((target / "config.json").read_text())
    aux = json.loads((drafter / "config.json").read_text())["aux_hidden_state_layer_ids"]
    config["num_hidden_layers"] = max(aux) - 1
    (target / "config.json").write_text(json.dumps(config))
    with pytest.raises(WorkerStartError) as e:
        start_worker("--checkpoint", str(drafter), "--target-checkpoint", str(target),
                     "--no-warmup", timeout=60)
    assert f"aux_hidden_state_layer_ids {aux} names hidden_states index {max(aux)}, past the" \
        f" target's {max(aux) - 1} layers ({target}/config.json num_hidden_layers" \
        f" {max(aux) - 1}: indices 0 to {max(aux) - 1})" in str(e.value)


def test_a_training_runs_folder_names_its_checkpoints(tmp_path: Path) -> None:
    """--checkpoint at a speculators training run's folder names the sub-folders that hold a
    config.json (one per epoch, and checkpoint_best)."""
    for name in ("10", "2", "checkpoint_best", "logs"):
        (tmp_path / name).mkdir()
        if name != "logs":
            (tmp_path / name / "config.json").write_text("{}")
    with pytest.raises(WorkerStartError) as e:
        start_worker("--checkpoint", str(tmp_path), "--no-warmup", timeout=60)
    assert f"{tmp_path}/config.json: no config.json; it is not a checkpoint folder but holds 3" \
        " with a config.json (a training run's checkpoints?): 2/, 10/, checkpoint_best/; pass" \
        " one of them as the checkpoint" in str(e.value)


def test_a_checkpoint_error_is_said_in_words(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    with pytest.raises(WorkerStartError) as e:
        start_worker("--checkpoint", str(tmp_path), timeout=60)
    text = str(e.value)
    assert f"cannot load the drafter ({tmp_path}): {tmp_path}/config.json: no config.json" \
        in text
    assert "CheckpointError" not in text


def test_a_second_worker_on_the_metrics_port_is_told_the_flag() -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(WorkerStartError) as e:
            start_worker("--metrics-listen", f"127.0.0.1:{port}", "--no-warmup", timeout=60)
    assert "address already in use; another worker on this host? give this one its own" \
        " --metrics-listen" in str(e.value)


def test_a_clean_exit_removes_the_port_file_and_leaves_at_once() -> None:
    """Once the log says ``stopped:`` the process is gone promptly: the interpreter's teardown
    (seconds of torch's static destructors freeing the heap that the warm-up's intra-op
    threads left) is not waited for."""
    w = start_worker(timeout=60, env={"OMP_NUM_THREADS": "2"})
    port_file = w.port_file
    assert port_file.exists()
    proc = w.proc
    proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 60
    while "stopped:" not in w.log_text() and time.monotonic() < deadline:
        time.sleep(0.02)
    stopped_at = time.monotonic()
    assert proc.wait(60) == 0
    assert time.monotonic() - stopped_at < 1.0, "exit took long after 'stopped:'"
    assert not port_file.exists()
    w.stop()


def test_sigterm_while_the_drafter_loads_is_said_and_exits_0(tmp_path: Path) -> None:
    """A SIGTERM before the worker serves (the drafter loading, which can take minutes) stops
    the start with a line saying so, exit 0, and no port file: not the default's silent death.
    (The signal goes as soon as the log says the drafter is loading; loading, checking and
    warming up the reference drafter takes far longer than that on any machine.)"""
    log_path, port_file = tmp_path / "worker.log", tmp_path / "ports.json"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "dspark_worker", "--listen",
                                 "127.0.0.1:0", "--metrics-listen", "none", "--port-file",
                                 str(port_file), "--device", "cpu"], stdout=log,
                                stderr=subprocess.STDOUT, cwd=Path(__file__).parents[2])
    try:
        deadline = time.monotonic() + 60
        while "loading drafter" not in log_path.read_text() and time.monotonic() < deadline:
            assert proc.poll() is None, log_path.read_text()
            time.sleep(0.005)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, log_path.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log_path.read_text()
    assert re.search(r"SIGTERM while starting \(reading the drafter .*\): stopping", text), text
    assert "SIGTERM: stopped before serving" in text and "ready:" not in text
    assert not port_file.exists()


def test_bad_option_exits_2() -> None:
    p = subprocess.run([sys.executable, "-m", "dspark_worker", "--max-slots", "zero"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "--max-slots" in p.stderr

