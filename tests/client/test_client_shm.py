"""The client over ``unix+shm://`` (docs/contract.md section 13) against a real worker process:
rounds whose rows go through the shared-memory region draft exactly what the same rounds over
the socket draft (and what the reference drafter drafts), ``rows_buffer`` sends no row bytes and
copies nothing, and where the region cannot be used rows go on the socket: a TCP endpoint, a
plain ``unix://`` endpoint (a region over the worker's limit: tests/worker/test_worker_shm.py)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from real_engine import RealEngine, hello_for

from dspark_client.client import RemoteDraftClient
from dspark_client.config import RemoteConfig
from dspark_client.rounds import DraftRounds
from dspark_client.transport import EndpointError, parse_endpoint
from protocol import wire
from tests.support.local_drafts import reference_drafter_one_thread
from tests.support.worker_proc import WorkerProcess, start_worker

W, SLOTS = 16, 6
LIMIT = 1 << 20  # the worker's region limit: 1024 rows of 768 bytes fit


@pytest.fixture(scope="module")
def drafter() -> Iterator[Any]:
    yield from reference_drafter_one_thread()


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerProcess]:
    path = tmp_path_factory.mktemp("shm") / "w.sock"
    with start_worker("--window", str(W), "--max-slots", "8", "--max-total-slots", "96",
                      "--max-rows-per-step", "1024",
                      "--device", "cpu", "--max-shm-region-bytes", str(LIMIT),
                      "--unix", str(path), "--no-warmup") as w:
        yield w


def make(endpoint: str, drafter: Any, name: str, *, sampled: bool = False,
         max_rows: int = 1024) -> RemoteDraftClient:
    c = RemoteDraftClient(
        RemoteConfig(endpoint=endpoint, connect_timeout_ms=5000, timeout_ms=5000,
                     backoff_ms=20, backoff_max_ms=200),
        hello_for(drafter, window=W, max_slots=SLOTS, sampled=sampled, client_name=name,
                  max_rows_per_step=max_rows))
    assert c.wait_ready(20.0), (c.last_error, c.disabled_reason)
    return c


def run_engine(client: RemoteDraftClient, drafter: Any, sampled: bool) -> list[np.ndarray]:
    """A fixed run of rounds (admits, accepts, a slot reused, a release); every usable draft
    is checked against the reference; returns each round's draft ids."""
    eng = RealEngine(DraftRounds(client), drafter, seed=5, sampled=sampled)
    out = []
    for slot, prompt in zip(range(4), (3, W, 40, 1), strict=True):
        eng.admit(slot, prompt)
    for step in range(6):
        reqs, res = eng.run([s for s in range(4) if s in eng.gen])
        assert res.ok, res.reason
        eng.check(reqs, res)
        out.append(res.draft_ids.copy())
        for i, r in enumerate(reqs):
            eng.accept(r.slot, int(min(res.num_drafted[i], 1 + (step + r.slot) % 3)))
        if step == 3:
            eng.admit(2, 5)  # a new request in a used slot: a new generation
    assert eng.checked > 0
    return out


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_shm_rounds_draft_what_socket_rounds_draft(worker: WorkerProcess, drafter: Any,
                                                   sampled: bool) -> None:
    assert worker.unix_path is not None
    shm = make(f"unix+shm://{worker.unix_path}", drafter, f"shm-{sampled}", sampled=sampled)
    plain = make(f"unix://{worker.unix_path}", drafter, f"sock-{sampled}", sampled=sampled)
    try:
        assert shm.rows_in_shm and not plain.rows_in_shm
        assert shm.shm_region is not None and plain.shm_region is None
        a = run_engine(shm, drafter, sampled)
        b = run_engine(plain, drafter, sampled)
        for x, y in zip(a, b, strict=True):
            assert np.array_equal(x, y)
        s = shm.stats.snapshot()
        assert s["steps_shm"] == s["steps"] == 6 and "shm_rows_copied" not in s
        assert "steps_shm" not in plain.stats.snapshot()
        # Rows went through the region: the socket carried prefixes only.
        assert s["bytes_sent"] < plain.stats.snapshot()["bytes_sent"] / 4
    finally:
        shm.close()
        plain.close()


def test_rows_buffer_is_the_region_and_nothing_is_copied(worker: WorkerProcess,
                                                         drafter: Any) -> None:
    assert worker.unix_path is not None
    c = make(f"unix+shm://{worker.unix_path}", drafter, "rows-buffer")
    try:
        rb = drafter.row_bytes
        region = c.shm_region
        assert region is not None
        buf = c.rows_buffer(8)
        assert buf.shape == (8, rb) and np.shares_memory(buf, region.array)
        rng = np.random.default_rng(1)
        vals = rng.uniform(-1, 1, size=(8, rb // 2)).astype(np.float32)
        buf[:] = ((vals.view(np.uint32) >> 16).astype(np.uint16)).view(np.uint8)
        hdr = bytearray(wire.APP_HEADER_SIZE + wire.rows_offset_for(1))
        e = [wire.ReqEntry(slot=0, generation=1, anchor_pos=8, anchor_token=3, n_rows=8,
                           flags=wire.RF_RESET | wire.RF_NEED_DRAFT)]
        out = c.step(hdr, e, 8, 1, rows=buf)
        assert out.ok and out.reply is not None, out.reason
        assert out.reply.status.tolist() == [wire.RS_OK]
        snap = c.stats.snapshot()
        assert snap["steps_shm"] == 1 and "shm_rows_copied" not in snap
        # Rows from elsewhere are copied into the region once, and draft the same.
        e2 = [wire.ReqEntry(slot=1, generation=1, anchor_pos=8, anchor_token=3, n_rows=8,
                            flags=wire.RF_RESET | wire.RF_NEED_DRAFT)]
        other = c.step(hdr, e2, 8, 2, rows=np.array(buf))
        assert other.ok and other.reply is not None
        assert c.stats.snapshot()["shm_rows_copied"] == 1
        assert np.array_equal(other.reply.draft_ids, out.reply.draft_ids)
        # As a list of arrays (one per request, say), they are copied in back to back.
        e3 = [wire.ReqEntry(slot=2, generation=1, anchor_pos=8, anchor_token=3, n_rows=8,
                            flags=wire.RF_RESET | wire.RF_NEED_DRAFT)]
        pieces = [np.array(buf[:3]), np.array(buf[3:4]), np.array(buf[4:])]
        third = c.step(hdr, e3, 8, 3, rows=pieces)
        assert third.ok and third.reply is not None
        assert c.stats.snapshot()["shm_rows_copied"] == 2
        assert np.array_equal(third.reply.draft_ids, out.reply.draft_ids)
        with pytest.raises(ValueError):
            c.rows_buffer(1025)
    finally:
        c.close()


def test_tcp_endpoint_keeps_rows_on_the_socket(worker: WorkerProcess, drafter: Any) -> None:
    assert worker.endpoint is not None
    c = make(worker.endpoint, drafter, "tcp")
    try:
        assert c.shm_region is None and not c.rows_in_shm
        assert c.worker_info is not None
        assert not c.worker_info.capabilities & wire.CAP_SHM_ROWS  # not offered over TCP
        buf = c.rows_buffer(4)
        assert buf.shape == (4, drafter.row_bytes)
    finally:
        c.close()


def test_shm_reconnect_attaches_the_same_region_again(worker: WorkerProcess,
                                                      drafter: Any) -> None:
    assert worker.unix_path is not None
    c = make(f"unix+shm://{worker.unix_path}", drafter, "reconnect")
    try:
        region = c.shm_region
        c.mark_failed("test", backoff=False)
        assert c.wait_ready(20.0)
        assert c.rows_in_shm and c.shm_region is region
        assert c.stats.snapshot()["shm_attached"] == 2
        eng = RealEngine(DraftRounds(c), drafter, seed=4)
        eng.admit(0, 12)
        reqs, res = eng.run([0])
        assert res.ok, res.reason
        eng.check(reqs, res)
    finally:
        c.close()


def test_unix_shm_endpoints_parse() -> None:
    ep = parse_endpoint("unix+shm:///run/dspark.sock")
    assert (ep.kind, ep.path, ep.shm) == ("unix", "/run/dspark.sock", True)
    assert not parse_endpoint("unix:///run/dspark.sock").shm
    with pytest.raises(EndpointError, match="absolute"):
        parse_endpoint("unix+shm://run/dspark.sock")
    RemoteConfig(endpoint="unix+shm:///run/dspark.sock")  # accepted by the config too


def test_cli_bench_over_unix_shm(worker: WorkerProcess) -> None:
    """``dspark-client bench`` takes a unix+shm:// endpoint; its rounds go through the region
    (the worker counts the STEPs, the socket carries no rows)."""
    import io
    import json

    from dspark_client.cli import main

    assert worker.unix_path is not None
    mapped = worker.log_text().count("shared-memory rows region")
    out = io.StringIO()
    code = main(["--endpoint", f"unix+shm://{worker.unix_path}", "bench", "--batch", "4",
                 "--steps", "6", "--warmup", "1", "--accept", "2", "--json", "--no-progress"],
                out=out)
    assert code == 0
    result = json.loads(out.getvalue())
    assert result["failed_rounds"] == 0 and result["rows_per_s"] > 0
    assert worker.log_text().count("shared-memory rows region") == mapped + 1


def test_an_empty_rows_view_is_sent_as_nothing() -> None:
    """A round with no new rows passes ``staging[:0]`` (shape (0, row_bytes)); memoryview.cast
    refuses zero shapes, so the transport once failed such a STEP before sending it."""
    from dspark_client.transport import _byte_view

    assert _byte_view(np.empty((4, 768), np.uint8)[:0]).nbytes == 0
    assert _byte_view(np.zeros((2, 3), np.uint8)).nbytes == 6
