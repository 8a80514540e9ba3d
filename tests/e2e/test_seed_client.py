"""The engine-side reference client (shared/seeds/004_remote_client_formatted.py) runs UNCHANGED
against our worker once its relative imports point at our modules.

The seed file is copied into a temporary package with only its import lines rewritten
(``from . import wire`` -> ``from protocol import wire``, ``.config``/``.stats``/``.transport``
-> ``dspark_client.*``, ``.sampled_wire`` -> ``protocol.sampled``), imported, and driven through
HELLO and greedy and sampled STEPs against a real worker process. Its drafts must equal the
in-process reference drafter's on the same rows. This pins every name the engine code uses:
RemoteConfig's fields, Stats.inc/set, RpcClient's connect/request/request_parts/close,
TransportError, TransportTimeout and make_client.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from protocol import wire

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.support.local_drafts import reference_drafter_one_thread  # noqa: E402
from tests.support.worker_proc import WorkerProcess, start_worker  # noqa: E402

# The design folder beside the checkout (as CI lays it out), then the verbatim copy kept with
# the tests (tests/protocol/test_wire_names.py checks the copy against the original).
SEED_CANDIDATES = [
    Path(os.environ["DSPARK_SEEDS"]) / "004_remote_client_formatted.py"
    if "DSPARK_SEEDS" in os.environ else None,
    ROOT.parent / "shared" / "seeds" / "004_remote_client_formatted.py",
    ROOT / "tests" / "protocol" / "data" / "seed_remote_client.py.txt",
]
REWRITES = [
    ("from . import wire", "from protocol import wire"),
    ("from .config import", "from dspark_client.config import"),
    ("from .stats import", "from dspark_client.stats import"),
    ("from .transport import", "from dspark_client.transport import"),
    ("from .sampled_wire import", "from protocol.sampled import"),
]
W, N_SLOTS = 16, 4


def seed_source() -> str:
    for path in SEED_CANDIDATES:
        if path is not None and path.is_file():
            return path.read_text()
    raise FileNotFoundError(f"the seed client is in none of {SEED_CANDIDATES}")


@pytest.fixture(scope="module")
def seed_module(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    text = seed_source()
    for old, new in REWRITES:
        assert old in text, f"the seed no longer contains {old!r}"
        text = text.replace(old, new)
    assert "from ." not in text, "a relative import was left unrewritten"
    pkg = tmp_path_factory.mktemp("seedpkg") / "dspark_seed_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "remote_client.py").write_text(text)
    sys.path.insert(0, str(pkg.parent))
    try:
        yield importlib.import_module("dspark_seed_pkg.remote_client")
    finally:
        sys.path.remove(str(pkg.parent))
        for name in [m for m in sys.modules if m.startswith("dspark_seed_pkg")]:
            del sys.modules[name]


@pytest.fixture(scope="module")
def drafter() -> Iterator[Any]:
    yield from reference_drafter_one_thread()


@pytest.fixture(scope="module")
def worker() -> Iterator[WorkerProcess]:
    with start_worker("--window", str(W), "--max-slots", "8", "--max-total-slots", "16",
                      "--device", "cpu") as w:
        yield w


def _hello(drafter: Any, sampled: bool, name: str) -> wire.Hello:
    return wire.Hello(sample_mode=wire.SAMPLE_TOP32 if sampled else wire.SAMPLE_GREEDY,
                      window=W, num_spec=drafter.num_spec, max_slots=N_SLOTS,
                      max_rows_per_step=256, row_bytes=drafter.row_bytes,
                      vocab_size=drafter.vocab_size, n_taps=drafter.n_taps,
                      hidden=drafter.target_hidden, drafter_identity=drafter.drafter_identity,
                      markov_identity=drafter.markov_identity, client_name=name)


def wait_ready(client: Any, timeout: float = 10.0) -> None:
    """Until the seed client's HELLO is accepted; never disabled on the way."""
    import time

    deadline = time.monotonic() + timeout
    while not client.ready and time.monotonic() < deadline:
        assert client.disabled_reason is None, client.disabled_reason
        time.sleep(0.01)
    assert client.ready, client.last_error


def _rows(drafter: Any, rng: np.random.Generator, n: int) -> np.ndarray:
    from dspark_worker.drafter import encode_bf16_rows

    vals = rng.uniform(-2, 2, size=(n, drafter.row_bytes // 2)).astype(np.float32)
    return np.asarray(encode_bf16_rows(vals))


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_seed_client_hello_and_steps(seed_module: Any, drafter: Any, worker: WorkerProcess,
                                     sampled: bool) -> None:
    from dspark_client.config import RemoteConfig
    from dspark_client.stats import Stats
    from dspark_worker.drafter import SamplingParams

    assert worker.endpoint is not None
    cfg = RemoteConfig(endpoint=worker.endpoint, connect_timeout_ms=2000, timeout_ms=2000,
                       backoff_ms=20, backoff_max_ms=200)
    stats = Stats()
    client = seed_module.RemoteDraftClient(cfg, _hello(drafter, sampled, f"seed-{sampled}"),
                                           stats=stats)
    try:
        wait_ready(client)
        assert stats.get("hellos") == 1 and client.epoch == 1
        rng = np.random.default_rng(5 if sampled else 4)
        N = drafter.num_spec
        anchors = [9, 20]
        history = [_rows(drafter, rng, a) for a in anchors]
        buf = bytearray(1 << 16)
        for step_id in (1, 2, 3):
            entries, parts = [], []
            meta: list[tuple[int, int, float, float]] = []
            for slot, a in enumerate(anchors):
                if step_id == 1:
                    n = min(W, a)
                    flags = wire.RF_NEED_DRAFT | wire.RF_RESET
                else:
                    n = 3
                    history[slot] = np.concatenate([history[slot], _rows(drafter, rng, n)])
                    anchors[slot] = a = a + n
                    flags = wire.RF_NEED_DRAFT
                parts.append(history[slot][a - n:a])
                entries.append(wire.ReqEntry(slot=slot, generation=1, anchor_pos=a,
                                             anchor_token=7 + slot, n_rows=n, n_out=0,
                                             flags=flags))
                meta.append((100 + slot, 8 if slot == 0 else 0, 0.8, 0.9))
            rows = np.ascontiguousarray(np.concatenate(parts))
            out = client.step(buf, entries, rows.shape[0], step_id, epoch=client.epoch,
                              rows=rows, sample_meta=meta if sampled else None)
            assert out.ok, (out.reason, stats.get("last_bad_reply"))
            reply = out.reply
            assert reply.status.tolist() == [wire.RS_OK, wire.RS_OK]
            sampling = None
            if sampled:
                sampling = SamplingParams(top_k=[m[1] for m in meta],
                                          temperature=[m[2] for m in meta],
                                          top_p=[m[3] for m in meta],
                                          seed=[m[0] for m in meta], generation=[1, 1])
            ref = drafter.reference_draft([h[max(0, a - W):a] for h, a in zip(history, anchors,
                                                                              strict=True)],
                                          anchors, [7, 8], sampling=sampling)
            assert reply.draft_ids.tolist() == ref.draft_ids[:, :N].tolist()
            assert np.allclose(reply.confidence, ref.confidence, atol=1e-4)
        status, body = client.simple_request(wire.OP_STATS)
        assert status == wire.ST_OK and b"worker_name" in body
    finally:
        client.close()


def test_seed_client_meets_a_draining_worker(seed_module: Any, drafter: Any) -> None:
    """ST_DRAINING (5) is a status the seed client does not know. On STEP it fails that round
    (not applied, no resync needed) and, the worker having closed the connection, reconnects;
    a HELLO answered DRAINING is a failed connect retried with backoff. It is never disabled."""
    import signal
    import time

    from dspark_client.config import RemoteConfig
    from dspark_client.stats import Stats
    from dspark_client.transport import make_client

    with start_worker("--window", str(W), "--max-slots", "8", "--max-total-slots", "16",
                      "--device", "cpu", "--no-warmup", "--drain-s", "60") as w:
        assert w.endpoint is not None
        cfg = RemoteConfig(endpoint=w.endpoint, connect_timeout_ms=2000, timeout_ms=2000,
                           backoff_ms=20, backoff_max_ms=100)
        stats = Stats()
        client = seed_module.RemoteDraftClient(cfg, _hello(drafter, False, "seed-drain"),
                                               stats=stats)
        # A second connection that keeps PINGing holds the drain open (it ends once no frame
        # came for a second), so the seed's reconnect meets a draining worker too.
        keeper = make_client(w.endpoint)
        keeper.connect(2.0)
        kbuf = bytearray(1 << 12)
        seq = [0]

        def ping() -> int:
            seq[0] += 1
            n = keeper.request(wire.frame(wire.OP_PING, seq[0], 0, b""), kbuf, 5.0)
            return wire.split_frame(memoryview(kbuf)[:n])[0].status

        try:
            deadline = time.monotonic() + 20
            while not client.ready:
                assert time.monotonic() < deadline and client.disabled_reason is None, (
                    client.last_error, client.disabled_reason)
                time.sleep(0.01)
            rng = np.random.default_rng(9)
            rows = _rows(drafter, rng, 9)
            entries = [wire.ReqEntry(slot=0, generation=1, anchor_pos=9, anchor_token=7,
                                     n_rows=9, flags=wire.RF_NEED_DRAFT | wire.RF_RESET)]
            buf = bytearray(1 << 16)
            out = client.step(buf, entries, 9, 1, epoch=client.epoch, rows=rows)
            assert out.ok, out.reason
            assert ping() == wire.ST_OK
            w.proc.send_signal(signal.SIGTERM)
            time.sleep(0.3)
            assert ping() == wire.ST_OK  # PING is still answered while draining
            out = client.step(buf, entries, 9, 2, epoch=client.epoch, rows=rows)
            assert not out.ok and out.reason == "frame_draining" and not out.unknown_apply
            assert client.disabled_reason is None
            # The worker closed that connection: the next round fails on the transport, and
            # the seed reconnects; its HELLO meets DRAINING and is retried with backoff.
            out = client.step(buf, entries, 9, 3, epoch=client.epoch, rows=rows)
            assert not out.ok
            deadline = time.monotonic() + 20
            while "DRAINING" not in (client.last_error or ""):
                assert time.monotonic() < deadline, client.last_error
                assert ping() == wire.ST_OK
                time.sleep(0.1)
            assert stats.get("connect_failures") >= 1
            assert client.disabled_reason is None and not client.disabled
        finally:
            client.close()
            keeper.close()
        assert w.proc.wait(30) == 0


def test_seed_client_against_a_dflash_worker(seed_module: Any) -> None:
    """A drafter without a confidence head: the seed ignores CAP_NO_CONFIDENCE and
    RPF_NO_CONFIDENCE, accepts the replies (confidence 1.0 where drafted, so it verifies whole
    blocks) and gets the drafts of the DFlash vectors."""
    import json

    import torch
    from safetensors.torch import load_file

    from dspark_client.config import RemoteConfig
    from dspark_client.stats import Stats
    from dspark_worker.drafter import load_drafter
    from tests.worker.worker_harness import make_hello, thread_worker

    data = ROOT / "tests" / "worker" / "drafter" / "data" / "dflash_tiny"
    name = "spec_llama_sliding_reduced"
    vectors = json.loads((data / "cases.json").read_text())
    cases = [c for c in vectors["cases"] if c["checkpoint"] == name]
    taps = load_file(str(data / "taps.safetensors"))
    rows = np.concatenate([taps[c["taps_key"]].view(torch.int16).numpy().view(np.uint8)
                           .reshape(c["n_rows"], -1) for c in cases])
    d = load_drafter(data / name, data / vectors["checkpoints"][name]["target"],
                     record_identities=False)
    with thread_worker(d, window=64) as w:
        host, port = w.address
        client = seed_module.RemoteDraftClient(
            RemoteConfig(endpoint=f"tcp://{host}:{port}", connect_timeout_ms=2000,
                         timeout_ms=5000, backoff_ms=20, backoff_max_ms=200),
            make_hello(d, window=64, max_slots=4, client_name="seed-dflash"), stats=Stats())
        try:
            wait_ready(client)
            assert client.worker_info.capabilities & wire.CAP_NO_CONFIDENCE
            entries = [wire.ReqEntry(slot=i, generation=1, anchor_pos=k["anchor_pos"],
                                     anchor_token=k["anchor_token"], n_rows=k["n_rows"],
                                     flags=wire.RF_NEED_DRAFT | wire.RF_RESET)
                       for i, k in enumerate(cases)]
            out = client.step(bytearray(1 << 16), entries, rows.shape[0], 1,
                              epoch=client.epoch, rows=np.ascontiguousarray(rows))
            assert out.ok, out.reason
            assert out.reply.flags & wire.RPF_NO_CONFIDENCE
            for i, k in enumerate(cases):
                assert out.reply.draft_ids[i].tolist() == k["ids"]
                assert out.reply.confidence[i].tolist() == [1.0] * d.num_spec
        finally:
            client.close()
