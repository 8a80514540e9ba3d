"""RemoteDraftClient.close() says GOODBYE (docs/contract.md 6.2): the worker releases the
session at once; a worker that does not answer never holds close() up for long."""

from __future__ import annotations

import time
from typing import Any

from client_fakes import FakeWorker, make_hello

from dspark_client.client import GOODBYE_TIMEOUT_S, RemoteDraftClient
from dspark_client.config import RemoteConfig
from protocol import wire


def client_for(fw: FakeWorker, **kw: Any) -> RemoteDraftClient:
    return RemoteDraftClient(RemoteConfig(endpoint=fw.endpoint, timeout_ms=5000,
                                          connect_timeout_ms=5000), make_hello(**kw),
                             background=False)


def test_close_releases_the_session() -> None:
    with FakeWorker() as fw:
        c = client_for(fw)
        assert c.connect_now() and c.session in fw.sessions
        c.close()
        goodbyes = [h for _, h, _ in fw.frames if h.op == wire.OP_GOODBYE]
        assert len(goodbyes) == 1 and goodbyes[0].session == c.session
        assert goodbyes[0].body_len == 0 and fw.sessions == {}
        assert c.stats.get("goodbyes") == 1
        c.close()  # idempotent: nothing more is sent
        assert [h.op for _, h, _ in fw.frames].count(wire.OP_GOODBYE) == 1


def test_close_does_not_wait_on_a_silent_worker() -> None:
    with FakeWorker() as fw:
        c = client_for(fw)
        assert c.connect_now()
        real = fw._handle

        def silent_goodbye(conn_id: int, h: wire.AppHeader, body: bytes) -> Any:
            return ("silent", None) if h.op == wire.OP_GOODBYE else real(conn_id, h, body)

        fw._handle = silent_goodbye  # type: ignore[method-assign]
        t0 = time.monotonic()
        c.close()
        assert time.monotonic() - t0 < GOODBYE_TIMEOUT_S + 5  # bounded, not timeout_ms-long
        assert c.stats.get("goodbyes") is None


def test_no_goodbye_without_a_session() -> None:
    with FakeWorker(hello_status=wire.ST_IDENTITY) as fw:
        c = client_for(fw)
        assert not c.connect_now() and c.disabled
        c.close()
        assert wire.OP_GOODBYE not in [h.op for _, h, _ in fw.frames]
