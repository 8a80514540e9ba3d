"""The shared-memory rows region (docs/contract.md section 13) against a real worker process over
a real Unix socket: the two-phase attach, STEPs whose rows are read from the region, and hostile
clients (descriptors that are no sealed memfd, a region too large, rows outside the region, rows
rewritten mid-STEP, descriptors sent with other frames). After every refusal the connection and
the session still work; the region is unmapped when its connection closes."""

from __future__ import annotations

import fcntl
import mmap
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from worker_harness import Client, make_hello, tap_rows, thread_worker

from protocol.constants import (
    APP_HEADER_SIZE,
    CAP_SHM_ROWS,
    OP_PING,
    OP_SHM_ATTACH,
    OP_STEP,
    RF_NEED_DRAFT,
    RF_RESET,
    RS_OK,
    ST_BAD_FRAME,
    ST_LIMITS,
    ST_NO_SESSION,
    ST_OK,
)
from protocol.framing import frame
from protocol.messages import ReqEntry, StepReply, pack_step, pack_step_prefix, rows_offset_for
from protocol.shm import SHM_MAP, SHM_OFFER, ShmAttach, ShmAttachReply, set_rows_at
from tests.support.worker_proc import WorkerProcess, start_worker

LIMIT = 1 << 20  # the worker's --max-shm-region-bytes in these tests
REGION = 256 << 10
# The sessions' largest STEP: 4096 rows of 768 bytes, 3 MiB (a region may not be larger).
ROWS = 4096
ARGS = ("--window", "64", "--max-slots", "8", "--max-total-slots", "32", "--device", "cpu",
        "--max-shm-region-bytes", str(LIMIT), "--partial-frame-timeout-s", "5")


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerProcess]:
    path = tmp_path_factory.mktemp("shm") / "w.sock"
    with start_worker(*ARGS, "--unix", str(path)) as w:
        yield w


def memfd(size: int, seals: int = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL,
          sealing: bool = True) -> int:
    fd = os.memfd_create("test-rows", os.MFD_CLOEXEC | (os.MFD_ALLOW_SEALING if sealing else 0))
    os.ftruncate(fd, size)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


class ShmClient(Client):
    """The harness client plus the attach and SF_ROWS_SHM STEPs."""

    def send_fds(self, op: int, body: bytes, fds: list[int]) -> Any:
        seq = self.next_seq()
        socket.send_fds(self.sock, [frame(op, seq, self.session, body)], fds)
        return self.recv()

    def offer(self, size: int) -> Any:
        return self.request(OP_SHM_ATTACH, ShmAttach(size, SHM_OFFER).pack())

    def map(self, size: int, fds: list[int]) -> Any:
        return self.send_fds(OP_SHM_ATTACH, ShmAttach(size, SHM_MAP).pack(), fds)

    def attach(self, fd: int, size: int) -> Any:
        r = self.offer(size)
        assert r.status == ST_OK, r.header
        return self.map(size, [fd])

    def step_shm(self, entries: list[ReqEntry], row_bytes: int, rows_at: int, *,
                 extra: bytes = b"", n_rows: int | None = None) -> Any:
        n_rows = sum(e.n_rows for e in entries) if n_rows is None else n_rows
        body = bytearray(rows_offset_for(len(entries)))
        pack_step_prefix(body, 0, self.seq + 1, entries, sum(e.n_rows for e in entries),
                         row_bytes)
        set_rows_at(body, 0, rows_at)
        if n_rows != sum(e.n_rows for e in entries):
            body[12:16] = n_rows.to_bytes(4, "little")
        return self.request(OP_STEP, bytes(body) + extra)


@pytest.fixture
def client(worker: WorkerProcess, drafter: Any) -> Iterator[ShmClient]:
    assert worker.unix_path is not None
    with ShmClient(worker.unix_path, timeout=20) as c:
        r = c.hello(make_hello(drafter, window=64, max_slots=8, max_rows_per_step=ROWS,
                                   client_name="shm-fixture"))
        assert r.status == ST_OK
        assert r.hello().capabilities & CAP_SHM_ROWS
        yield c


def mapped_memfds(pid: int) -> int:
    return Path(f"/proc/{pid}/maps").read_text().count("/memfd:")


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def wait_for(pred: Any, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return bool(pred())


def entries_for(slot: int, n: int, anchor: int) -> list[ReqEntry]:
    return [ReqEntry(slot=slot, generation=1, anchor_pos=anchor, anchor_token=5, n_rows=n,
                     flags=RF_RESET | RF_NEED_DRAFT)]


def test_rows_from_the_region_draft_like_rows_on_the_socket(client: ShmClient, drafter: Any,
                                                            worker: WorkerProcess) -> None:
    rb = drafter.row_bytes
    fd = memfd(REGION)
    try:
        r = client.attach(fd, REGION)
        assert r.status == ST_OK
        assert ShmAttachReply.unpack(r.body) == ShmAttachReply(LIMIT, REGION)
        region = mmap.mmap(fd, REGION)
        rows = tap_rows(rb, 0, 1, 0, 20)
        at = 8 * 40
        region[at:at + rows.nbytes] = rows.tobytes()
        shm = client.step_shm(entries_for(0, 20, 20), rb, at)
        assert shm.status == ST_OK, shm.header
        # The same STEP with the rows on the socket, for another slot: the same drafts.
        sock = client.step([ReqEntry(slot=1, generation=1, anchor_pos=20, anchor_token=5,
                                     n_rows=20, flags=RF_RESET | RF_NEED_DRAFT)], rows, rb)
        a, b = shm.step(), sock.step()
        assert a.status.tolist() == b.status.tolist() == [RS_OK]
        assert np.array_equal(a.draft_ids, b.draft_ids)
        assert np.array_equal(a.confidence, b.confidence)
        region.close()
    finally:
        os.close(fd)


def test_seals_make_truncation_impossible() -> None:
    fd = memfd(REGION)
    try:
        for size in (0, REGION // 2, REGION * 2):
            with pytest.raises(PermissionError):
                os.ftruncate(fd, size)
        with pytest.raises(PermissionError):  # and no one can lift them (F_SEAL_SEAL)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)
        assert os.fstat(fd).st_size == REGION
    finally:
        os.close(fd)


@pytest.mark.parametrize("kind", ["unsealed", "no_shrink_seal", "no_sealing", "pipe",
                                  "regular_file", "two_fds", "no_fd", "wrong_size"])
def test_map_refuses_what_is_not_one_sealed_memfd_of_the_offered_size(
        client: ShmClient, worker: WorkerProcess, tmp_path: Path, kind: str) -> None:
    opened: list[int] = []
    if kind == "unsealed":
        opened = [memfd(REGION, seals=0)]
    elif kind == "no_shrink_seal":
        opened = [memfd(REGION, seals=fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)]
    elif kind == "no_sealing":
        opened = [memfd(REGION, seals=0, sealing=False)]
    elif kind == "pipe":
        opened = list(os.pipe())[:1]
    elif kind == "regular_file":
        p = tmp_path / "rows.bin"
        p.write_bytes(bytes(REGION))
        opened = [os.open(p, os.O_RDWR)]
    elif kind == "two_fds":
        opened = [memfd(REGION), memfd(REGION)]
    elif kind == "wrong_size":
        opened = [memfd(REGION // 2)]
    baseline = open_fds(worker.pid)
    try:
        assert client.offer(REGION).status == ST_OK
        r = client.map(REGION, opened)
        assert r.status == ST_BAD_FRAME, r.header
        assert ShmAttachReply.unpack(r.body).region_bytes == 0
        # Nothing attached: a STEP naming the region is refused; the session still works.
        assert client.step_shm(entries_for(0, 1, 1), 192, 0).status == ST_BAD_FRAME
        assert client.ping().status == ST_OK
        assert wait_for(lambda: open_fds(worker.pid) <= baseline)  # nothing kept open
        assert mapped_memfds(worker.pid) == 0
    finally:
        for fd in opened:
            os.close(fd)


def test_region_over_the_limit_is_st_limits(client: ShmClient) -> None:
    r = client.offer(LIMIT + 1)
    assert r.status == ST_LIMITS
    assert ShmAttachReply.unpack(r.body).max_region_bytes == LIMIT
    assert client.offer(0).status == ST_BAD_FRAME
    assert client.ping().status == ST_OK


def test_map_without_offer_and_attach_without_session(worker: WorkerProcess) -> None:
    assert worker.unix_path is not None
    fd = memfd(REGION)
    try:
        with ShmClient(worker.unix_path) as c:
            assert c.offer(REGION).status == ST_NO_SESSION  # no HELLO on this connection
            assert c.map(REGION, [fd]).status == ST_NO_SESSION
            assert c.ping(session=0).status == ST_OK
    finally:
        os.close(fd)


def test_map_must_follow_its_offer(client: ShmClient, worker: WorkerProcess) -> None:
    fd = memfd(REGION)
    try:
        assert client.map(REGION, [fd]).status == ST_BAD_FRAME  # no OFFER before it
        assert client.offer(REGION).status == ST_OK
        assert client.ping().status == ST_OK  # not the MAP: answered as usual, offer gone
        assert client.map(REGION, [fd]).status == ST_BAD_FRAME
        assert client.attach(fd, REGION).status == ST_OK  # a proper pair still works
        assert client.offer(REGION).status == ST_BAD_FRAME  # one region per connection
    finally:
        os.close(fd)


def test_descriptors_sent_with_other_frames_are_dropped(client: ShmClient,
                                                        worker: WorkerProcess) -> None:
    baseline = open_fds(worker.pid)
    fds = [memfd(REGION) for _ in range(3)]
    r, w = os.pipe()
    try:
        for _ in range(5):
            assert client.send_fds(OP_PING, b"", [*fds, r, w]).status == ST_OK
        assert wait_for(lambda: open_fds(worker.pid) <= baseline)
        assert mapped_memfds(worker.pid) == 0
    finally:
        for fd in (*fds, r, w):
            os.close(fd)


def test_rows_outside_the_region_are_refused(client: ShmClient, drafter: Any) -> None:
    rb = drafter.row_bytes
    fd = memfd(REGION)
    try:
        assert client.attach(fd, REGION).status == ST_OK
        fits = REGION // rb
        cases = [
            (entries_for(0, 1, 1), REGION, b""),  # starts at the end
            (entries_for(0, 1, 1), REGION - 8, b""),  # ends past it
            (entries_for(0, fits + 1, fits + 1), 0, b""),  # longer than the region
            (entries_for(0, 1, 1), (1 << 64) - 8, b""),  # offset near 2**64
            (entries_for(0, 1, 1), 4, b""),  # not 8-byte aligned
            (entries_for(0, 1, 1), 0, b"\0" * rb),  # rows on the socket as well
        ]
        for entries, at, extra in cases:
            r = client.step_shm(entries, rb, at, extra=extra)
            assert r.status == ST_BAD_FRAME, (at, r.header)
        # n_rows that does not match the entries: the usual shape rule, on the prefix.
        assert client.step_shm(entries_for(0, 1, 1), rb, 0, n_rows=2).status == ST_BAD_FRAME
        end = (REGION - 64 * rb) // 8 * 8  # the last 64 rows that fit, 8-byte aligned
        ok = client.step_shm(entries_for(0, 64, 64), rb, end)
        assert ok.status == ST_OK and ok.step().status.tolist() == [RS_OK]
    finally:
        os.close(fd)


def test_rows_rewritten_mid_step_cannot_hurt_the_worker(client: ShmClient, drafter: Any,
                                                        worker: WorkerProcess) -> None:
    rb = drafter.row_bytes
    fd = memfd(REGION)
    stop = threading.Event()
    try:
        assert client.attach(fd, REGION).status == ST_OK
        region = np.frombuffer(mmap.mmap(fd, REGION), dtype=np.uint8)
        rng = np.random.default_rng(0)
        noise = rng.integers(0, 256, size=(4, REGION), dtype=np.uint8)

        def scribble() -> None:
            i = 0
            while not stop.is_set():
                region[:] = noise[i % 4]  # NaN and inf bf16 patterns among them
                i += 1

        t = threading.Thread(target=scribble, daemon=True)
        t.start()
        n = 64
        for i in range(20):
            r = client.step_shm([ReqEntry(slot=i % 4, generation=1, anchor_pos=n + i,
                                          anchor_token=5, n_rows=n,
                                          flags=RF_RESET | RF_NEED_DRAFT)], rb, 0)
            assert r.status == ST_OK, r.header
            rep = r.step()
            assert rep.status.tolist() == [RS_OK]
            assert ((rep.draft_ids >= 0) & (rep.draft_ids < drafter.vocab_size)).all()
        stop.set()
        t.join(10)
        assert client.ping().status == ST_OK
        assert worker.running
    finally:
        stop.set()
        os.close(fd)


def test_region_unmapped_when_the_connection_closes(worker: WorkerProcess, drafter: Any) -> None:
    assert worker.unix_path is not None
    assert wait_for(lambda: mapped_memfds(worker.pid) == 0), [
        line for line in Path(f"/proc/{worker.pid}/maps").read_text().splitlines()
        if "memfd" in line]
    baseline = open_fds(worker.pid)
    fds = [memfd(REGION) for _ in range(3)]
    clients = []
    try:
        for i, fd in enumerate(fds):
            c = ShmClient(worker.unix_path)
            clients.append(c)
            assert c.hello(make_hello(drafter, window=64, max_slots=2, max_rows_per_step=ROWS,
                                      client_name=f"shm-unmap-{i}")).status == ST_OK
            assert c.attach(fd, REGION).status == ST_OK
        assert mapped_memfds(worker.pid) == 3
        # Per connection its socket and the mapping's own descriptor (mmap keeps a dup).
        assert open_fds(worker.pid) == baseline + 6
        clients.pop().close()
        assert wait_for(lambda: mapped_memfds(worker.pid) == 2)
        for c in clients:
            c.close()
        clients.clear()
        assert wait_for(lambda: mapped_memfds(worker.pid) == 0)
        assert wait_for(lambda: open_fds(worker.pid) <= baseline)
    finally:
        for c in clients:
            c.close()
        for fd in fds:
            os.close(fd)


def test_map_frame_that_never_comes_closes_the_connection(worker: WorkerProcess,
                                                          drafter: Any) -> None:
    assert worker.unix_path is not None
    with ShmClient(worker.unix_path) as c:
        assert c.hello(make_hello(drafter, window=64, max_slots=2, max_rows_per_step=ROWS,
                                  client_name="shm-stall")).status == ST_OK
        assert c.offer(REGION).status == ST_OK
        c.send_raw(b"\x44\x53")  # two bytes of a header, then nothing
        assert c.is_closed(timeout=20)


def test_tcp_connections_get_no_regions(worker: WorkerProcess, drafter: Any) -> None:
    assert worker.host is not None and worker.port is not None
    with ShmClient((worker.host, worker.port)) as c:
        r = c.hello(make_hello(drafter, window=64, max_slots=2, client_name="shm-tcp"))
        assert r.status == ST_OK and not r.hello().capabilities & CAP_SHM_ROWS
        assert c.offer(REGION).status == ST_BAD_FRAME
        assert c.ping().status == ST_OK


def test_worker_without_regions(tmp_path: Path, drafter: Any) -> None:
    """--max-shm-region-bytes 0: no CAP_SHM_ROWS, OFFER refused naming the limit 0, the socket
    rows work as ever (in-process worker: the flag is what is tested, not the process)."""
    path = str(tmp_path / "n.sock")
    with thread_worker(drafter, unix=path, max_shm_region_bytes=0), ShmClient(path) as c:
        r = c.hello(make_hello(drafter, max_slots=2))
        assert r.status == ST_OK and not r.hello().capabilities & CAP_SHM_ROWS
        r = c.offer(REGION)
        assert r.status == ST_BAD_FRAME
        assert ShmAttachReply.unpack(r.body).max_region_bytes == 0
        rows = tap_rows(drafter.row_bytes, 0, 1, 0, 3)
        assert c.step(entries_for(0, 3, 3), rows, drafter.row_bytes).status == ST_OK


def test_shm_step_frame_layout() -> None:
    """The prefix of an SF_ROWS_SHM STEP is a socket STEP's prefix with the flag and rows_at."""
    e = entries_for(3, 2, 9)
    plain = pack_step(1, e, b"\0" * 2 * 16, 16)
    body = bytearray(rows_offset_for(1))
    pack_step_prefix(body, 0, 1, e, 2, 16)
    set_rows_at(body, 0, 4096)
    assert body[:20] == plain[:20] and body[32:] == plain[32:rows_offset_for(1)]
    assert int.from_bytes(body[20:24], "little") == 1
    assert int.from_bytes(body[24:32], "little") == 4096
    assert APP_HEADER_SIZE + len(body) == 24 + 32 + 48
    assert StepReply is not None


def test_client_falls_back_when_its_region_is_over_the_limit(worker: WorkerProcess,
                                                             drafter: Any) -> None:
    """The engine's client, max_rows_per_step 4096 rows of 768 bytes (3 MiB) against a 1 MiB
    limit: the OFFER is refused ST_LIMITS, the client says so and sends rows on the socket."""
    from dspark_client.client import RemoteDraftClient
    from dspark_client.config import RemoteConfig

    assert worker.unix_path is not None
    c = RemoteDraftClient(RemoteConfig(endpoint=f"unix+shm://{worker.unix_path}",
                                       connect_timeout_ms=5000, timeout_ms=5000),
                          make_hello(drafter, window=64, max_slots=2, max_rows_per_step=4096,
                                     client_name="shm-too-big"))
    try:
        assert c.wait_ready(20.0), c.last_error
        snap = c.stats.snapshot()
        assert not c.rows_in_shm and not c.disabled
        assert snap["shm_fallbacks"] == 1 and snap["rows_transport"] == "socket"
        assert "LIMITS" in snap["shm_fallback_reason"] and str(LIMIT) in snap[
            "shm_fallback_reason"]
        rows = c.rows_buffer(3)
        rows[:] = tap_rows(drafter.row_bytes, 0, 1, 0, 3)
        hdr = bytearray(APP_HEADER_SIZE + rows_offset_for(1))
        out = c.step(hdr, entries_for(0, 3, 3), 3, 1, rows=rows)
        assert out.ok and out.reply is not None and out.reply.status.tolist() == [RS_OK]
        assert "steps_shm" not in c.stats.snapshot()
    finally:
        c.close()


def _memfd_mapped_bytes(pid: int) -> int:
    total = 0
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        if "/memfd:" in line:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            total += hi - lo
    return total


def test_mapped_bytes_are_capped_and_a_session_that_leaves_unmaps(tmp_path: Path,
                                                                  drafter: Any) -> None:
    """Regions of every connection together stay under --max-shm-mapped-bytes (the one over
    it is ST_LIMITS with the numbers, and the client's rows go on the socket); a session that
    moves to another connection leaves no region mapped behind it; the metric says what is
    mapped."""
    big = 4 << 20
    path = tmp_path / "w.sock"
    with start_worker(*ARGS, "--unix", str(path), "--max-shm-region-bytes", str(big),
                      "--max-shm-mapped-bytes", str(2 * big), "--max-rows-per-step",
                      "8192") as w:
        fds = [memfd(big) for _ in range(4)]
        clients = [ShmClient(str(path), timeout=20) for _ in range(3)]
        hello = make_hello(drafter, window=64, max_slots=8, max_rows_per_step=8192)
        try:
            for c in clients:
                assert c.hello(hello).status == ST_OK
            assert clients[0].attach(fds[0], big).status == ST_OK
            assert clients[1].attach(fds[1], big).status == ST_OK
            r = clients[2].offer(big)
            assert r.status == ST_LIMITS, r.header
            assert _memfd_mapped_bytes(w.pid) == 2 * big
            log = w.log_text()
            assert f"regions of {2 * big} bytes are mapped, the worker's limit for all of them"\
                   f" is {2 * big} bytes (--max-shm-mapped-bytes), so 0 bytes are free" in log
            assert ShmAttachReply.unpack(r.body).region_bytes == 0  # what it could map now
            assert clients[2].ping().status == ST_OK  # refused, still a working session
            # Session 0 moves to a new connection (a reconnect): its old region goes at once.
            mover = ShmClient(str(path), timeout=20, session=clients[0].session)
            mover.seq = clients[0].seq + 5
            assert mover.hello(hello).status == ST_OK
            assert wait_for(lambda: _memfd_mapped_bytes(w.pid) == big)
            assert clients[2].attach(fds[2], big).status == ST_OK  # room again
            assert clients[0].ping(session=0).status == ST_OK  # the old connection is open
            _, text = _scrape(w)
            (line,) = [x for x in text.splitlines()
                       if x.startswith("dspark_worker_shm_mapped_bytes ")]
            assert float(line.split()[1]) == 2 * big
            mover.close()
        finally:
            for c in clients:
                c.close()
            for fd in fds:
                os.close(fd)
        assert wait_for(lambda: _memfd_mapped_bytes(w.pid) == 0)


def _scrape(w: WorkerProcess) -> tuple[int, str]:
    import urllib.request

    with urllib.request.urlopen(f"{w.metrics_url}/metrics", timeout=10) as r:
        return r.status, r.read().decode()


def test_sparse_regions_cannot_take_the_cap_from_an_engine(tmp_path: Path, drafter: Any) -> None:
    """Strangers attach sparse memfds (costing them nothing) to take the regions' cap: a region
    larger than its session's largest STEP rows is refused (the reply's region_bytes says what
    it could map); sessions that fill the cap with regions they can use, then send no STEP,
    give them up after reservation_idle_s to the engine's client, which meanwhile sent its
    rows on the socket with a message naming the cap it met (as many as it needs)."""
    from dspark_client.client import RemoteDraftClient
    from dspark_client.config import RemoteConfig

    rows = ROWS * drafter.row_bytes  # 3 MiB: what a ROWS session may map
    path = tmp_path / "w.sock"
    with start_worker(*ARGS, "--unix", str(path), "--max-shm-region-bytes", str(4 << 20),
                      "--max-shm-mapped-bytes", str(2 * rows), "--reservation-idle-s",
                      "1.5") as w:
        wide = make_hello(drafter, window=64, max_slots=2, max_rows_per_step=ROWS)
        with ShmClient(str(path), timeout=20) as small:
            assert small.hello(make_hello(drafter, window=64, max_slots=2)).status == ST_OK
            r = small.offer(4 << 20)  # within the per-region limit, over what it can use
            assert r.status == ST_LIMITS
            assert ShmAttachReply.unpack(r.body).region_bytes == 256 * drafter.row_bytes
        assert "is larger than this session can use" in w.log_text()
        squat = [ShmClient(str(path), timeout=20) for _ in range(2)]
        fds = [memfd(rows) for _ in squat]
        t_squat = time.monotonic()
        for c, fd in zip(squat, fds, strict=True):
            assert c.hello(wide).status == ST_OK and c.attach(fd, rows).status == ST_OK
        engine = RemoteDraftClient(
            RemoteConfig(endpoint=f"unix+shm://{path}", connect_timeout_ms=5000,
                         timeout_ms=5000, backoff_ms=100, backoff_max_ms=200),
            make_hello(drafter, window=64, max_slots=2, max_rows_per_step=ROWS,
                       client_name="engine"))
        try:
            assert engine.wait_ready(20.0), engine.last_error
            reason = engine.stats.snapshot().get("shm_fallback_reason", "")
            if time.monotonic() - t_squat < 1.5:  # met the squatters' regions: says so
                assert not engine.rows_in_shm and "--max-shm-mapped-bytes" in reason, reason
                assert "the worker could map 0 bytes" in reason, reason
                time.sleep(max(0.0, t_squat + 1.6 - time.monotonic()))
                engine.mark_failed("reconnect for the region")  # as after a lost round
                assert wait_for(lambda: engine.rows_in_shm, timeout=20), engine.last_error
            assert engine.rows_in_shm  # one squatter's region gave way: as much as needed
            assert _memfd_mapped_bytes(w.pid) == 2 * rows
            assert "unused (no STEP for" in w.log_text()
        finally:
            engine.close()
            for c in squat:
                c.close()
