"""A real ``dspark-worker`` in a subprocess, for tests of every layer (worker, client, e2e).

Public API (kept stable; other test suites depend on it)::

    from tests.support.worker_proc import start_worker, WorkerProcess, WorkerStartError

    with start_worker("--window", "64", "--max-total-slots", "32") as w:
        w.endpoint      # "tcp://127.0.0.1:PORT"
        w.host, w.port  # "127.0.0.1", PORT
        w.unix_path     # the Unix socket path when "--unix PATH" was passed, else None
        w.unix_endpoint # "unix:///path" or None
        w.metrics_url   # "http://127.0.0.1:MPORT" (GET /metrics, /healthz)
        w.proc          # the subprocess.Popen
        w.pid
        w.log_path      # the worker's stderr+stdout, a file
        w.port_file     # the --port-file it wrote once ready
        w.log_text()    # its contents so far
        w.stop()        # SIGTERM, wait (timeout 30 s); returns the exit code
        w.kill()        # SIGKILL, wait; returns the exit code

``start_worker(*extra_args, env=None, timeout=60)`` runs ``python -m dspark_worker --listen
127.0.0.1:0 --metrics-listen 127.0.0.1:0 --port-file <tmp> *extra_args`` (later flags win, so
extra args may override --listen and --metrics-listen) and returns once the worker wrote its port
file, i.e. it is listening and its drafter is loaded and warm. With no checkpoint argument it
serves the embedded tiny default model on the CPU unless ``--device`` says otherwise. If the
worker exits or is not ready within ``timeout`` seconds, ``WorkerStartError`` carries the tail of
its log. Leaving the ``with`` block stops the worker (SIGTERM, then SIGKILL if it hangs).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

__all__ = ["WorkerProcess", "WorkerStartError", "start_worker"]


class WorkerStartError(RuntimeError):
    """The worker exited or did not become ready in time; the message ends with its log."""


class WorkerProcess:
    """A running worker subprocess (see the module docstring)."""

    def __init__(self, proc: subprocess.Popen[bytes], tmpdir: Path, ports: dict[str, Any],
                 log_path: Path) -> None:
        self.proc = proc
        self.pid = proc.pid
        self._tmpdir = tmpdir
        self.log_path = log_path
        self.port_file = tmpdir / "ports.json"
        listen = ports.get("listen")
        self.host: str | None = None
        self.port: int | None = None
        self.endpoint: str | None = None
        if listen:
            host, _, port = listen.rpartition(":")
            self.host, self.port = host, int(port)
            self.endpoint = f"tcp://{listen}"
        self.unix_path: str | None = ports.get("unix")
        self.unix_endpoint = f"unix://{self.unix_path}" if self.unix_path else None
        metrics = ports.get("metrics")
        self.metrics_url = f"http://{metrics}" if metrics else None

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    @property
    def running(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM and wait; SIGKILL if it has not exited within ``timeout``. The exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._cleanup()
        return int(self.proc.returncode)

    def kill(self) -> int:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._cleanup()
        return int(self.proc.returncode)

    def _cleanup(self) -> None:
        shutil.rmtree(self._tmpdir, ignore_errors=True)

    def __enter__(self) -> WorkerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"WorkerProcess(pid={self.pid}, endpoint={self.endpoint!r})"


def start_worker(*extra_args: str, env: dict[str, str] | None = None,
                 timeout: float = 60.0) -> WorkerProcess:
    """Start ``python -m dspark_worker`` on free ports and wait until it is ready."""
    tmpdir = Path(tempfile.mkdtemp(prefix="dspark-worker-"))
    port_file = tmpdir / "ports.json"
    log_path = tmpdir / "worker.log"
    args = [sys.executable, "-m", "dspark_worker", "--listen", "127.0.0.1:0",
            "--metrics-listen", "127.0.0.1:0", "--port-file", str(port_file), *extra_args]
    full_env = dict(os.environ)
    full_env.setdefault("PYTHONUNBUFFERED", "1")
    # Two workers or a worker and a test on a small CI box: one intra-op thread each is faster.
    full_env.setdefault("OMP_NUM_THREADS", "1")
    if env:
        full_env.update(env)
    root = Path(__file__).resolve().parents[2]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=full_env,
                                cwd=str(root))
    deadline = time.monotonic() + timeout
    while True:
        if port_file.exists():
            try:
                ports = json.loads(port_file.read_text())
                break
            except (OSError, ValueError):
                pass  # written by rename, so this is a race with a half-made directory only
        code = proc.poll()
        if code is not None:
            text = _tail(log_path)
            shutil.rmtree(tmpdir, ignore_errors=True)
            raise WorkerStartError(f"dspark-worker exited with {code} before it was ready:\n"
                                   f"{text}")
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait(10)
            text = _tail(log_path)
            shutil.rmtree(tmpdir, ignore_errors=True)
            raise WorkerStartError(f"dspark-worker not ready after {timeout:g} s:\n{text}")
        time.sleep(0.05)
    return WorkerProcess(proc, tmpdir, ports, log_path)


def _tail(path: Path, lines: int = 40) -> str:
    try:
        text: Iterable[str] = path.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return "(no log)"
    return "\n".join(text)


def worker_stats(worker: WorkerProcess) -> dict[str, Any]:
    """The worker's STATS object, asked over a connection of our own (no session)."""
    from dspark_client.transport import make_client
    from protocol import wire

    assert worker.endpoint is not None
    conn = make_client(worker.endpoint)
    with conn:
        conn.connect(10.0)
        buf = bytearray(1 << 16)
        n = conn.request(wire.frame(wire.OP_STATS, 1, 0), buf, 10.0)
    h, body = wire.split_frame(memoryview(buf)[:n])
    assert h.status == wire.ST_OK
    result: dict[str, Any] = json.loads(bytes(body))
    return result


def reload_to(worker: WorkerProcess, link: Path, target: str | Path,
              meanwhile: Callable[[], None] = lambda: None) -> dict[str, Any]:
    """Point the symlink ``link`` (the worker's --checkpoint) at ``target``, SIGHUP, and call
    ``meanwhile`` (engine rounds) until the reload is done; its outcome (STATS
    ``reloads.last``)."""
    link.unlink()
    link.symlink_to(target)
    asked = worker_stats(worker)["reloads"]["asked"]
    os.kill(worker.pid, signal.SIGHUP)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        meanwhile()
        st = worker_stats(worker)["reloads"]
        if st["asked"] > asked and not st["running"]:
            return dict(st["last"])
    raise AssertionError(f"the reload did not finish: {worker.log_text()[-2000:]}")
