"""A real ``dspark-worker`` subprocess under attack and misconfiguration (docs/contract.md
sections 3, 11): memory for header-only connections, start-up failures that are one line each,
and a seeded fuzz of mutated, truncated, oversized and garbage frames next to a legitimate
session whose drafts must not change."""

from __future__ import annotations

import contextlib
import json
import math
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from worker_harness import Client, make_hello, tap_rows

from protocol.constants import (
    OP_HELLO,
    OP_PING,
    OP_RESET,
    OP_STATS,
    OP_STEP,
    RF_NEED_DRAFT,
    ST_OK,
)
from protocol.framing import frame
from protocol.header import AppHeader
from protocol.messages import ReqEntry, pack_reset, pack_step
from tests.support.worker_proc import start_worker

ROOT = Path(__file__).resolve().parents[2]
SMALL = ("--window", "32", "--max-slots", "16", "--max-total-slots", "48",
         "--max-rows-per-step", "256", "--no-warmup")


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _ping(host: str, port: int) -> int:
    with Client((host, port), timeout=20) as c:
        return c.ping(session=0).status


# -- 2: memory for connections that only send headers ---------------------------------------
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc (Linux)")
def test_header_only_connections_do_not_take_memory() -> None:
    """256 connections that send a header and nothing more, with a 64 MiB frame limit: half
    announce a 4 MiB body (refused at the header, closed), half a small HELLO body that never
    comes (held until the partial-frame deadline). The worker's RSS rises by far less than
    the 1 GiB those headers name."""
    n = 256
    with start_worker(*SMALL, "--max-frame-bytes", str(64 << 20),
                      "--max-connections", str(n + 8)) as w:
        assert w.host and w.port
        assert _ping(w.host, w.port) == ST_OK
        before = _rss_bytes(w.pid)
        socks = []
        try:
            for i in range(n):
                s = socket.create_connection((w.host, w.port), timeout=20)
                socks.append(s)
                op = (OP_STEP, OP_HELLO, 42, OP_RESET)[i % 4] if i % 2 == 0 else OP_HELLO
                body_len = 4 << 20 if i % 2 == 0 else 4096
                s.sendall(AppHeader(op=op, seq=i + 1, session=i + 1, body_len=body_len).pack())
            for s in socks[::2]:  # every large announcement is answered and closed
                data = b""
                while True:
                    chunk = s.recv(4096)
                    if not chunk:
                        break
                    data += chunk
                assert AppHeader.unpack(data).status != ST_OK
            grown = _rss_bytes(w.pid) - before
            assert _ping(w.host, w.port) == ST_OK  # and an engine still gets in
        finally:
            for s in socks:
                s.close()
        assert grown < 64 << 20, f"RSS grew {grown / 2**20:.1f} MiB"
        assert "Traceback" not in w.log_text()


# -- 9: start-up failures -------------------------------------------------------------------
def test_startup_failures_are_one_line_before_loading(tmp_path: Path) -> None:
    """Each bad listener or path: exit 1, one ``cannot start: <what> <where>: <why>`` line, no
    traceback, nothing after it, and the drafter never loaded. The five run in parallel."""
    busy_draft = socket.socket()
    busy_draft.bind(("127.0.0.1", 0))
    busy_draft.listen(1)
    busy_metrics = socket.socket()
    busy_metrics.bind(("127.0.0.1", 0))
    busy_metrics.listen(1)
    dport, mport = busy_draft.getsockname()[1], busy_metrics.getsockname()[1]
    missing = tmp_path / "no-such-folder"
    cases: dict[str, tuple[list[str], str]] = {
        "busy metrics port": (["--metrics-listen", f"127.0.0.1:{mport}"],
                              f"cannot start: metrics listener 127.0.0.1:{mport}: address"
                              " already in use"),
        "bad listen host": (["--listen", "no-such-host.invalid:0"],
                            "cannot start: draft listener no-such-host.invalid:0: "),
        "missing unix folder": (["--unix", str(missing / "w.sock")],
                                f"cannot start: unix socket {missing / 'w.sock'}: folder"
                                f" {missing} does not exist"),
        "missing port-file folder": (["--port-file", str(missing / "ports.json")],
                                     f"cannot start: port file {missing / 'ports.json'}:"
                                     f" folder {missing} does not exist"),
        "busy draft port": (["--listen", f"127.0.0.1:{dport}"],
                            f"cannot start: draft listener 127.0.0.1:{dport}: address already"
                            " in use"),
    }
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    procs = {}
    try:
        for name, (args, _) in cases.items():
            base = ["--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0", *SMALL]
            procs[name] = subprocess.Popen(
                [sys.executable, "-m", "dspark_worker", *base, *args], cwd=str(ROOT),
                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        for name, (_, want) in cases.items():
            out, _ = procs[name].communicate(timeout=120)
            text = out.decode(errors="replace")
            assert procs[name].returncode == 1, (name, text)
            lines = [ln for ln in text.splitlines() if "cannot start:" in ln]
            assert len(lines) == 1 and want in lines[0], (name, text)
            assert text.splitlines()[-1] == lines[0], (name, text)  # nothing after it
            assert "Traceback" not in text and "ready:" not in text, (name, text)
            assert "loading drafter" not in text, (name, text)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(10)
        busy_draft.close()
        busy_metrics.close()


def _hostile_checkpoints(tmp: Path) -> dict[str, tuple[list[str], list[str]]]:
    """Folders that broke start-up before (a traceback at warm-up, a hang, memory without
    end, an arithmetic error, NaN drafts): (worker arguments, what the one line names)."""
    spec = ROOT / "tests" / "worker" / "drafter" / "data" / "speculators_tiny"
    ref = ROOT / "dspark_worker" / "drafter" / "reference"

    def copy(base: Path, name: str, **changes: object) -> Path:
        out = tmp / name
        out.mkdir()
        for f in base.iterdir():
            if f.name not in ("config.json", "dspark_identity.json"):
                (out / f.name).symlink_to(f)
        config = json.loads((base / "config.json").read_text())
        for key, value in changes.items():
            node = config
            *parents, last = key.split(".")
            for k in parents:
                node = node[k]
            node[last] = value
        (out / "config.json").write_text(json.dumps(config))
        return out

    target = ["--target-checkpoint", str(spec / "target")]
    n_past_u16 = copy(spec / "vanilla_anchor_reduced", "n", block_size=100000)
    del_tokens = json.loads((n_past_u16 / "config.json").read_text())
    del_tokens.pop("speculators_config", None)  # no proposal count to disagree with
    (n_past_u16 / "config.json").write_text(json.dumps(del_tokens))
    zero = copy(ref, "zero")
    (zero / "config.json").unlink()
    (zero / "config.json").symlink_to("/dev/zero")
    fifo = copy(ref, "fifo")
    (fifo / "model.safetensors").unlink()
    os.mkfifo(fifo / "model.safetensors")
    yarn = spec / "llama_bias_yarn_bonus_nomarkov"
    return {
        "N past HELLO's u16": (["--checkpoint", str(n_past_u16), *target],
                               ["block_size 100000", "1..64"]),
        "config.json -> /dev/zero": (["--checkpoint", str(zero)],
                                     ["config.json", "is a character device"]),
        "a FIFO of weights": (["--checkpoint", str(fifo)],
                              ["model.safetensors", "is a FIFO"]),
        "yarn over rope_theta 1": (["--checkpoint", str(copy(
            yarn, "yarn1", **{"transformer_layer_config.rope_parameters.rope_theta": 1})),
            *target], ["rope_parameters.rope_theta 1", "above 1"]),
        "NaN beta_fast": (["--checkpoint", str(copy(
            yarn, "nan", **{"transformer_layer_config.rope_parameters.beta_fast": math.nan})),
            *target], ["beta_fast nan", "finite"]),
    }


def test_hostile_checkpoints_are_one_line_each(tmp_path: Path) -> None:
    """Each hostile checkpoint folder: exit 1 within the bound, one ``cannot start: cannot load
    the drafter (...)`` line naming the key, its value and the limit, nothing after it, no
    traceback, and never ready. The five run in parallel."""
    cases = _hostile_checkpoints(tmp_path)
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    procs = {}
    try:
        for name, (args, _) in cases.items():
            procs[name] = subprocess.Popen(
                [sys.executable, "-m", "dspark_worker", "--listen", "127.0.0.1:0",
                 "--metrics-listen", "none", *SMALL, *args], cwd=str(ROOT), env=env,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        for name, (_, words) in cases.items():
            out, _ = procs[name].communicate(timeout=120)
            text = out.decode(errors="replace")
            assert procs[name].returncode == 1, (name, text)
            lines = [ln for ln in text.splitlines() if "cannot start:" in ln]
            assert len(lines) == 1 and "cannot load the drafter" in lines[0], (name, text)
            assert all(w in lines[0] for w in words), (name, lines[0])
            assert text.splitlines()[-1] == lines[0], (name, text)
            assert "Traceback" not in text and "ready:" not in text, (name, text)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(10)


# -- the fuzz -------------------------------------------------------------------------------
FUZZ_SEED = 20261201
FUZZ_FRAMES = 3000
FUZZ_SECONDS = 8.0  # a bound for slow machines; the frame count usually ends it first
LEGIT_ROUNDS = 40


def _legit_script(c: Client, d: Any) -> list[tuple[bytes, bytes, np.ndarray]]:
    """A fixed sequence of STEPs over 3 slots; each reply's statuses, drafted tokens and
    confidences."""
    out = []
    pos = [0, 0, 0]
    for rnd in range(LEGIT_ROUNDS):
        entries, rows = [], []
        for slot in range(3):
            n = 6 if rnd == 0 else 1 + (rnd + slot) % 3
            rows.append(tap_rows(d.row_bytes, slot, 1, pos[slot], n))
            pos[slot] += n
            entries.append(ReqEntry(slot=slot, generation=1, anchor_pos=pos[slot],
                                    anchor_token=(rnd * 7 + slot) % d.vocab_size, n_rows=n,
                                    flags=RF_NEED_DRAFT))
        r = c.step(entries, np.concatenate(rows), d.row_bytes, step_id=rnd + 1)
        assert r.status == ST_OK, r.header
        rep = r.step()
        out.append((rep.status.tobytes(), rep.draft_ids.tobytes(), rep.confidence.copy()))
    return out


def _fuzz_frames(rng: np.random.Generator, d: Any, session: int) -> list[bytes]:
    """A burst for one connection: mutated, truncated, oversized and garbage frames."""
    hello = make_hello(d, client_name=f"fuzz-{session}", max_slots=2,
                       max_rows_per_step=128).pack()
    step = pack_step(1, [ReqEntry(slot=0, generation=1, anchor_pos=3, anchor_token=9,
                                  n_rows=3, flags=RF_NEED_DRAFT)],
                     tap_rows(d.row_bytes, 0, 1, 0, 3).tobytes(), d.row_bytes)
    templates = [(OP_HELLO, hello), (OP_STEP, step), (OP_PING, b""), (OP_STATS, b""),
                 (OP_RESET, pack_reset([0, 1]))]
    out: list[bytes] = []
    if rng.random() < 0.5:  # a sessioned burst: a valid HELLO first
        out.append(frame(OP_HELLO, 1, session, hello))
    for i in range(int(rng.integers(5, 25))):
        op, body = templates[int(rng.integers(len(templates)))]
        seq = i + 2
        kind = int(rng.integers(6))
        if kind == 0:  # header bytes (op, status, version, session, seq)
            raw = bytearray(frame(op, seq, session, body))
            for _ in range(int(rng.integers(1, 3))):
                raw[int(rng.choice([4, 5, 6, 7, 8, 9, 16, 17, 23]))] = int(rng.integers(256))
            out.append(bytes(raw))
        elif kind == 1:  # body bytes
            b = bytearray(body)
            for _ in range(int(rng.integers(1, 9))):
                if b:
                    b[int(rng.integers(len(b)))] = int(rng.integers(256))
            out.append(frame(op, seq, session, bytes(b)))
        elif kind == 2:  # oversized: a header naming far more than follows
            h = AppHeader(op=op, seq=seq, session=session,
                          body_len=int(rng.choice([5000, 1 << 20, (1 << 32) - 1])))
            out.append(h.pack() + body[:int(rng.integers(len(body) + 1))])
            break  # the worker closes the stream here
        elif kind == 3:  # truncated: the stream ends inside a frame
            raw = frame(op, seq, session, body)
            out.append(raw[:int(rng.integers(1, len(raw)))])
            break
        elif kind == 4:  # garbage
            out.append(rng.integers(0, 256, int(rng.integers(1, 200)), dtype=np.uint8)
                       .tobytes())
            break
        else:  # body length changed, consistent header
            b = body[:int(rng.integers(len(body) + 1))] if rng.random() < 0.5 else \
                body + rng.integers(0, 256, int(rng.integers(1, 64)), dtype=np.uint8).tobytes()
            out.append(frame(op, seq, session, b))
    return out


def test_fuzz_against_a_live_worker(drafter: Any) -> None:
    d = drafter
    # Limits that cannot all be used (a frame limit under the largest STEP of max_slots 64,
    # max_slots over max_total_slots): warned at start, and HELLOs that fit are served.
    with start_worker(*SMALL, "--max-frame-bytes", "150000", "--max-slots", "64") as w:
        text = w.log_text()
        assert "max_frame_bytes 150000 is below the largest STEP body" in text
        assert "max_slots 64 is above max_total_slots 48" in text
        assert "WITHOUT AUTHENTICATION" not in text  # loopback
        addr = (w.host or "127.0.0.1", w.port or 0)
        with Client(addr, timeout=30) as ref:  # the undisturbed run
            assert ref.hello(make_hello(d, client_name="reference", max_slots=4,
                                        max_rows_per_step=128)).status == ST_OK
            expected = _legit_script(ref, d)
        rng = np.random.default_rng(FUZZ_SEED)
        sent = {"frames": 0, "bursts": 0}
        stop = threading.Event()

        def fuzz() -> None:
            t_end = time.monotonic() + FUZZ_SECONDS
            while sent["frames"] < FUZZ_FRAMES and time.monotonic() < t_end and \
                    not stop.is_set():
                session = int(rng.integers(1, 1 << 31))
                burst = _fuzz_frames(rng, d, session)
                with contextlib.suppress(OSError), \
                        socket.create_connection(addr, timeout=10) as s:
                    s.sendall(b"".join(burst))
                    s.shutdown(socket.SHUT_WR)
                    s.settimeout(5)
                    with contextlib.suppress(OSError):
                        while s.recv(65536):
                            pass
                sent["frames"] += len(burst)
                sent["bursts"] += 1

        t = threading.Thread(target=fuzz, name="fuzz")
        t.start()
        try:
            with Client(addr, timeout=30) as legit:
                assert legit.hello(make_hello(d, client_name="legit", max_slots=4,
                                              max_rows_per_step=128)).status == ST_OK
                got = _legit_script(legit, d)
        finally:
            t.join(FUZZ_SECONDS + 60)
            stop.set()
        assert sent["frames"] >= 500, sent  # the fuzz did run alongside
        # the legitimate session saw nothing of it: the same drafts; confidences equal up to
        # float rounding (a batch shared with fuzz sessions sums in another order)
        assert [g[:2] for g in got] == [e[:2] for e in expected]
        for g, e in zip(got, expected, strict=True):
            np.testing.assert_allclose(g[2], e[2], rtol=1e-4, atol=1e-6)
        assert _ping(*addr) == ST_OK
        code = w.stop()
        text = w.log_text()
    assert code == 0
    assert "Traceback" not in text and " ERROR " not in text, text[-3000:]
    # refusals are rate-limited per host and reason: a few hundred lines at most
    assert len(text.splitlines()) < 300, len(text.splitlines())
