"""RemoteConfig validation (messages name the field and the value), secrets, Stats, and the
import guard: dspark_client never loads torch, uvloop, prometheus_client or the worker."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from dspark_client.config import RemoteConfig, RemoteConfigError, load_auth_secret
from dspark_client.stats import Stats

ROOT = Path(__file__).resolve().parents[2]


def test_defaults() -> None:
    c = RemoteConfig()
    assert c.endpoint == "tcp://127.0.0.1:7600" and c.all_endpoints == (c.endpoint,)
    assert c.timeout_ms > 0 and c.backoff_ms <= c.backoff_max_ms and 0 <= c.jitter < 1
    assert c.secret() is None


@pytest.mark.parametrize("over, field, words", [
    ({"endpoint": "localhost:7600"}, "endpoint", "no scheme"),
    ({"endpoints": ("tcp://a:1", "udp://b:2")}, "endpoints[1]", "unknown scheme 'udp'"),
    ({"timeout_ms": 0}, "timeout_ms", "finite number of ms above 0"),
    ({"connect_timeout_ms": float("inf")}, "connect_timeout_ms", "finite"),
    ({"backoff_ms": -5}, "backoff_ms", "above 0"),
    ({"backoff_ms": 500, "backoff_max_ms": 100}, "backoff_max_ms", "at least backoff_ms"),
    ({"jitter": 1.0}, "jitter", "fraction in [0, 1)"),
    ({"jitter": float("nan")}, "jitter", "fraction"),
    ({"auth_secret": b""}, "auth_secret", "empty secret"),
    ({"auth_secret": b"x", "auth_secret_file": "/f"}, "auth_secret_file", "not both"),
    ({"max_reply_bytes": 10}, "max_reply_bytes", "at least 1024"),
])
def test_refusals_name_field_and_value(over: dict[str, Any], field: str, words: str) -> None:
    with pytest.raises(RemoteConfigError) as info:
        RemoteConfig(**over)
    assert info.value.field == field
    assert str(info.value).startswith(f"RemoteConfig.{field} = ")
    assert words in str(info.value)


def test_from_dict_refuses_unknown_keys_and_bad_values() -> None:
    c = RemoteConfig.from_dict({"endpoint": "unix:///run/w.sock", "timeout_ms": 50,
                                "endpoints": ["tcp://10.0.0.2:7600"]})
    assert c.timeout_ms == 50 and c.endpoints == ("tcp://10.0.0.2:7600",)
    with pytest.raises(ValueError, match="unknown field `timout_ms`"):
        RemoteConfig.from_dict({"timout_ms": 50})
    with pytest.raises(ValueError, match=r"RemoteConfig.jitter = 2.0"):
        RemoteConfig.from_dict({"jitter": 2.0})


def test_secret_file(tmp_path: Path) -> None:
    f = tmp_path / "s"
    f.write_bytes(b"abc\r\n")
    assert load_auth_secret(f) == b"abc"
    f.write_bytes(b"  abc def\n\n")
    assert load_auth_secret(f) == b"abc def"  # surrounding whitespace, as the worker reads it
    assert RemoteConfig(auth_secret_file=str(f)).secret() == b"abc def"
    f.write_bytes(b"\n")
    with pytest.raises(RemoteConfigError, match="empty secret"):
        load_auth_secret(f)
    with pytest.raises(RemoteConfigError, match="cannot be read"):
        load_auth_secret(tmp_path / "missing")
    fifo = tmp_path / "fifo"  # speculator_options.auth_secret_file: the engine's start
    os.mkfifo(fifo)           # must not block in open()
    with pytest.raises(RemoteConfigError, match="is a FIFO, not a regular file"):
        RemoteConfig(auth_secret_file=str(fifo)).secret()


def test_stats_counters_values_snapshot() -> None:
    s = Stats()
    s.inc("steps")
    s.inc("steps", 2)
    s.inc("rtt_us_total", 1.5)
    s.set("worker", {"name": "w"})
    assert s.get("steps") == 3 and s.get("missing") is None and s.get("missing", 0) == 0
    snap = s.snapshot()
    assert snap == {"steps": 3, "rtt_us_total": 1.5, "worker": {"name": "w"}}
    snap["worker"]["name"] = "changed"
    assert s.get("worker") == {"name": "w"}  # the snapshot is a copy
    json.dumps(snap)
    s.reset()
    assert s.snapshot() == {}


def test_stats_step_counters_read_as_counters() -> None:
    """``step_answered``'s counters are read as the others are: by ``get``, ``snapshot`` and
    ``split_snapshot``, added to what ``inc`` gave the same key, absent while 0, cleared by
    ``reset``; its sample lands in the histogram."""
    s = Stats()
    s.inc("steps", 5)
    s.step_answered(100, 40, False, None, ("rtt", 2e-4, (1e-4, 1e-3)))
    s.step_answered(300, 60, True, (150.0, 20.0, 7.5), ("rtt", 5e-5, (1e-4, 1e-3)))
    want = {"steps": 7, "steps_ok": 1, "steps_shm": 1, "bytes_sent": 400,
            "bytes_received": 100, "rtt_us_total": 150.0, "worker_us_total": 20.0,
            "client_us_total": 7.5}
    assert s.snapshot() == want
    assert s.split_snapshot() == (want, {})
    assert s.get("steps") == 7 and s.get("steps_ok") == 1 and s.get("bytes_sent") == 400
    assert s.histograms()["rtt"]["buckets"] == [(1e-4, 1), (1e-3, 2), (float("inf"), 2)]
    s.reset()
    s.step_answered(10, 4, False, None, ("rtt", 2e-4, (1e-4, 1e-3)))
    assert s.snapshot() == {"steps": 1, "bytes_sent": 10, "bytes_received": 4}
    assert s.get("steps_ok") is None and s.get("steps_ok", 0) == 0


def test_stats_is_thread_safe() -> None:
    s = Stats()

    def work() -> None:
        for _ in range(5000):
            s.inc("n")

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert s.get("n") == 20000


def test_import_guard_in_a_fresh_interpreter() -> None:
    code = (
        "import importlib, pkgutil, sys, json\n"
        "import dspark_client\n"
        "mods = ['dspark_client.' + m.name for m in pkgutil.iter_modules(dspark_client.__path__)"
        " if not m.ispkg]\n"
        "for m in mods: importlib.import_module(m)\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in"
        " ('torch', 'uvloop', 'prometheus_client', 'dspark_worker'))\n"
        "print(json.dumps({'modules': mods, 'bad': bad}))\n"
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, cwd=str(ROOT), timeout=60, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    for name in ("transport", "config", "stats", "client", "ring", "rounds", "schedule", "cli"):
        assert f"dspark_client.{name}" in result["modules"]
    assert result["bad"] == []
