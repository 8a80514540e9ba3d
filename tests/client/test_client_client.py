"""RemoteDraftClient against the scripted fake worker: HELLO, epochs, reconnects, refusals,
every reply check (6.3, 9.2, the re-derived draws), fork and lifetime."""

from __future__ import annotations

import gc
import os
import socket
import struct
import threading
import time
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from client_fakes import (
    MAX_SLOTS,
    ROW_BYTES,
    VOCAB,
    FakeWorker,
    RecordingTransport,
    StepCtx,
    fake_draft,
    make_hello,
    make_hello_reply,
    rows_for,
)

import dspark_client.exchange as exchange_mod
from dspark_client.client import RemoteDraftClient
from dspark_client.config import RemoteConfig
from dspark_client.stats import Stats
from dspark_client.transport import TransportError
from protocol import wire


def cfg(endpoint: str, **over: Any) -> RemoteConfig:
    base: dict[str, Any] = dict(endpoint=endpoint, connect_timeout_ms=1000, timeout_ms=300,
                                backoff_ms=20, backoff_max_ms=100, jitter=0.1)
    base.update(over)
    return RemoteConfig(**base)


@pytest.fixture
def fw() -> Iterator[FakeWorker]:
    with FakeWorker() as w:
        yield w


@pytest.fixture
def client(fw: FakeWorker) -> Iterator[RemoteDraftClient]:
    c = RemoteDraftClient(cfg(fw.endpoint), make_hello())
    assert c.wait_ready(3.0), c.last_error
    yield c
    c.close()


def entry(slot: int, gen: int, anchor: int, token: int, n_rows: int, n_out: int = 0,
          flags: int = wire.RF_NEED_DRAFT, **kw: Any) -> wire.ReqEntry:
    return wire.ReqEntry(slot=slot, generation=gen, anchor_pos=anchor, anchor_token=token,
                         n_rows=n_rows, n_out=n_out, flags=flags, **kw)


def prefill(client: RemoteDraftClient, slot: int = 0, gen: int = 1, anchor: int = 8,
            token: int = 5, step_id: int = 1, **kw: Any) -> Any:
    rows = rows_for(slot, gen, 0, anchor)
    buf = bytearray(4096)
    e = entry(slot, gen, anchor, token, anchor, flags=wire.RF_NEED_DRAFT | wire.RF_RESET, **kw)
    return client.step(buf, [e], anchor, step_id, rows=rows)


def wait_for(pred: Any, timeout: float = 3.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.005)
    return bool(pred())


# -- HELLO ---------------------------------------------------------------------------------------
def test_hello_accepted_starts_epoch_one(fw: FakeWorker, client: RemoteDraftClient) -> None:
    assert client.ready and client.epoch == 1 and client.connection_epoch() == 1
    assert client.worker_info is not None and client.worker_info.worker_name == "fake-worker"
    assert client.stats.get("hellos") == 1
    assert client.session in fw.sessions
    h = fw.frames[0][1]
    assert h.op == wire.OP_HELLO and h.seq == 1 and h.session == client.session


def test_hello_identity_refusal_disables_with_both_identities() -> None:
    with FakeWorker(hello_reply=make_hello_reply(drafter_identity=b"\xaa" * 32),
                    hello_status=wire.ST_IDENTITY) as fw:
        c = RemoteDraftClient(cfg(fw.endpoint), make_hello())
        assert not c.wait_ready(2.0)
        assert c.disabled and c.disabled_reason is not None
        assert "HELLO refused: IDENTITY" in c.disabled_reason
        assert "aaaaaaaa" in c.disabled_reason and "00010203" in c.disabled_reason
        # last_error, where an engine looks first, says the same.
        assert c.last_error == f"remote drafting disabled: {c.disabled_reason}"
        assert c.step(bytearray(256), [], 0, 1).reason == "disabled"
        thread = c.link.thread
        assert thread is not None and wait_for(lambda: not thread.is_alive())
        c.close()


@pytest.mark.parametrize("over, words", [
    ({"window": 16}, "window 16 != ours 8"),
    ({"row_bytes": 64}, "row_bytes 64 != ours 32"),
    ({"max_slots": 2}, "max_slots 2 < ours 8"),
    ({"capabilities": wire.CAP_TAPS_BF16}, None),  # greedy does not need TOP32
    ({"markov_identity": b"\x01" * 32}, "markov identity"),
])
def test_hello_reply_mismatch_disables(over: dict[str, Any], words: str | None) -> None:
    with FakeWorker(hello_reply=make_hello_reply(**over)) as fw:
        c = RemoteDraftClient(cfg(fw.endpoint), make_hello())
        ok = c.wait_ready(2.0)
        if words is None:
            assert ok
        else:
            assert not ok and c.disabled_reason is not None and words in c.disabled_reason
        c.close()


def test_sampled_session_needs_top32_capability() -> None:
    with FakeWorker(hello_reply=make_hello_reply(capabilities=wire.CAP_TAPS_BF16)) as fw:
        c = RemoteDraftClient(cfg(fw.endpoint), make_hello(sampled=True))
        assert not c.wait_ready(2.0)
        assert "top32" in (c.disabled_reason or "")
        c.close()


def test_busy_hello_retries_with_backoff_then_connects() -> None:
    with FakeWorker(hello_status=wire.ST_BUSY) as fw:
        c = RemoteDraftClient(cfg(fw.endpoint), make_hello())
        assert wait_for(lambda: c.stats.get("connect_failures", 0) >= 2)
        assert not c.ready and not c.disabled
        fw.hello_status = None
        assert c.wait_ready(2.0)
        assert c.epoch == 1
        c.close()


def test_auth_secret_signs_hello(tmp_path: Any) -> None:
    secret_file = tmp_path / "secret"
    secret_file.write_bytes(b"s3cret\n")
    with FakeWorker(secret=b"s3cret") as fw:
        good = RemoteDraftClient(cfg(fw.endpoint, auth_secret_file=str(secret_file)),
                                 make_hello())
        assert good.wait_ready(2.0)
        good.close()
        bad = RemoteDraftClient(cfg(fw.endpoint, auth_secret=b"wrong"), make_hello(
            client_name="other"))
        assert not bad.wait_ready(2.0)
        assert "AUTH" in (bad.disabled_reason or "")
        bad.close()
        none = RemoteDraftClient(cfg(fw.endpoint), make_hello(client_name="third"))
        assert not none.wait_ready(2.0) and "AUTH" in (none.disabled_reason or "")
        none.close()


def test_failover_to_the_next_endpoint(fw: FakeWorker) -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    dead = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    s.close()
    config = cfg(dead, endpoints=(fw.endpoint,), failover_after=3)
    # a client name whose home (stable hash) is the dead endpoint
    name = next(f"e{i}" for i in range(100) if config.home_index(f"e{i}") == 0)
    c = RemoteDraftClient(config, make_hello(client_name=name))
    assert c.wait_ready(3.0)
    assert c.endpoint == fw.endpoint
    assert c.stats.get("connect_failures") == 3 and c.stats.get("failovers") == 1
    c.close()


def test_backoff_doubles_with_jitter_and_caps() -> None:
    c = RemoteDraftClient(cfg("tcp://127.0.0.1:9", backoff_ms=100, backoff_max_ms=400,
                              jitter=0.25), make_hello(), background=False)
    delays = []
    with c.link.lock:
        for _ in range(6):
            delays.append(c.link.schedule_retry_locked())
    bases = [0.1, 0.2, 0.4, 0.4, 0.4, 0.4]
    for d, b in zip(delays, bases, strict=True):
        assert b * 0.75 <= d <= b * 1.25
    assert len({round(d, 6) for d in delays[2:]}) > 1  # jittered, not lockstep
    c.close()


# -- STEP ----------------------------------------------------------------------------------------
def test_step_greedy_drafts(fw: FakeWorker, client: RemoteDraftClient) -> None:
    out = prefill(client, anchor=8, token=5)
    assert out.ok, out.reason
    assert out.reply is not None and out.drafted is not None
    assert out.reply.status.tolist() == [wire.RS_OK]
    assert out.drafted.tolist() == [4]
    assert out.reply.draft_ids[0].tolist() == [fake_draft(5, 8, j) for j in range(4)]
    assert fw.errors == []
    # continue with 3 new rows, n_out 2: only 2 positions carry drafts
    rows = rows_for(0, 1, 8, 11)
    out = client.step(bytearray(4096), [entry(0, 1, 11, 9, 3, n_out=2)], 3, 2, rows=rows)
    assert out.ok and out.drafted is not None and out.drafted.tolist() == [2]
    assert out.reply is not None
    assert out.reply.draft_ids[0].tolist() == [fake_draft(9, 8, 0), fake_draft(9, 8, 1), 0, 0]
    assert client.stats.get("steps_ok") == 2 and fw.errors == []


def test_step_with_rows_staged_in_the_buffer(fw: FakeWorker, client: RemoteDraftClient) -> None:
    e = entry(3, 7, 5, 2, 5, flags=wire.RF_NEED_DRAFT | wire.RF_RESET)
    ro = wire.APP_HEADER_SIZE + wire.rows_offset_for(1)
    buf = bytearray(ro + 5 * ROW_BYTES)
    buf[ro:] = rows_for(3, 7, 0, 5).tobytes()
    out = client.step(buf, [e], 5, 11)
    assert out.ok, out.reason
    assert out.reply is not None and out.reply.window_rows.tolist() == [5]
    assert fw.errors == []


def test_rows_size_mismatch_is_a_caller_error(client: RemoteDraftClient) -> None:
    with pytest.raises(ValueError, match="rows hold 64 bytes, 3 rows of 32 need 96"):
        client.step(bytearray(4096), [entry(0, 1, 3, 0, 3)], 3, 1,
                    rows=np.zeros((2, ROW_BYTES), np.uint8))


def test_not_ready_and_reconnected_refuse_without_sending() -> None:
    c = RemoteDraftClient(cfg("tcp://127.0.0.1:9"), make_hello(), background=False)
    assert c.step(bytearray(256), [], 0, 1).reason == "not_ready"
    c.close()
    with FakeWorker() as fw:
        c = RemoteDraftClient(cfg(fw.endpoint), make_hello())
        assert c.wait_ready(2.0)
        sent = len(fw.frames)
        out = c.step(bytearray(256), [], 0, 1, epoch=c.epoch - 1)
        assert out.reason == "reconnected" and len(fw.frames) == sent
        c.close()


def test_rows_go_out_without_a_copy() -> None:
    """The rows part handed to the transport is the caller's own memory."""
    replies: list[bytes] = []

    def answer(parts: list[Any]) -> bytes:
        h = wire.AppHeader.unpack(bytes(parts[0][:wire.APP_HEADER_SIZE]))
        if h.op == wire.OP_HELLO:
            return wire.frame(h.op, h.seq, h.session, make_hello_reply().pack())
        step = wire.StepHeader.unpack(bytes(parts[0][wire.APP_HEADER_SIZE:]))
        r = wire.StepReply.empty(step.step_id, step.n_req, 4, wire.RPF_MARGIN)
        r.generation[:] = 1
        r.window_rows[:] = 8
        replies.append(r.pack())
        return wire.frame(h.op, h.seq, h.session, replies[-1])

    rec = RecordingTransport(answer)
    c = RemoteDraftClient(cfg("tcp://127.0.0.1:9"), make_hello(), background=False,
                          transport_factory=lambda ep: rec)
    assert c.connect_now()
    staging = np.zeros((64, ROW_BYTES), np.uint8)
    rows = staging[:8]
    out = c.step(bytearray(4096), [entry(0, 1, 8, 0, 8, flags=wire.RF_RESET)], 8, 1, rows=rows)
    assert out.ok, out.reason
    parts = rec.sent[-1]
    assert len(parts) == 2
    assert np.shares_memory(np.frombuffer(memoryview(parts[1]).cast("B"), np.uint8), staging)
    c.close()


# -- failures ------------------------------------------------------------------------------------
def test_timeout_fails_fast_and_reconnects(fw: FakeWorker, client: RemoteDraftClient) -> None:
    assert prefill(client).ok
    fw.step_hook = lambda ctx: "silent"
    t0 = time.monotonic()
    out = prefill(client, step_id=2)
    elapsed = time.monotonic() - t0
    assert not out.ok and out.reason == "timeout" and out.unknown_apply
    assert elapsed < 0.3 + 0.25, f"the round blocked {elapsed:.3f} s past a 0.3 s timeout"
    fw.step_hook = None
    assert wait_for(lambda: client.connection_epoch() == 2)
    assert fw.connections == 2
    assert prefill(client, step_id=3).ok


def test_transport_error_is_unknown_apply(fw: FakeWorker, client: RemoteDraftClient) -> None:
    fw.step_hook = lambda ctx: "cut"
    out = prefill(client)
    assert not out.ok and out.reason == "transport_error" and out.unknown_apply
    fw.step_hook = None
    assert wait_for(lambda: client.connection_epoch() == 2)


def _mutate(fn: Any) -> Any:
    def hook(ctx: StepCtx) -> None:
        if ctx.reply is not None:
            fn(ctx)
    return hook


def _bad_echo(ctx: StepCtx) -> Any:
    h = ctx.header
    return ("frame", wire.frame(h.op, h.seq + 5, h.session, ctx.reply.pack()))  # type: ignore[union-attr]


@pytest.mark.parametrize("hook, words", [
    (_bad_echo, "reply echoes op=2 seq="),
    (_mutate(lambda c: setattr(c.reply, "step_id", 999)), "step_id 999"),
    (_mutate(lambda c: c.reply.generation.__setitem__(0, 77)), "generation echo 77"),
    (_mutate(lambda c: c.reply.confidence.__setitem__((0, 1), np.nan)), "confidence nan"),
    (_mutate(lambda c: c.reply.confidence.__setitem__((0, 0), 1.5)), "confidence 1.5"),
    (_mutate(lambda c: c.reply.draft_ids.__setitem__((0, 2), VOCAB)), f"draft id {VOCAB}"),
    (_mutate(lambda c: c.reply.draft_ids.__setitem__((0, 0), -1)), "draft id -1"),
    (_mutate(lambda c: c.reply.margin.__setitem__((0, 0), -1.0)), "margin -1.0"),
    (_mutate(lambda c: c.reply.window_rows.__setitem__(0, 9)), "window_rows 9"),
    (_mutate(lambda c: c.reply.status.__setitem__(0, 9)), "unknown request status 9"),
])
def test_bad_reply_is_refused(fw: FakeWorker, client: RemoteDraftClient, hook: Any,
                              words: str) -> None:
    fw.step_hook = hook
    out = prefill(client)
    assert not out.ok and out.reason == "bad_reply" and out.unknown_apply
    assert words in str(client.stats.get("last_bad_reply")), client.stats.get("last_bad_reply")
    fw.step_hook = None
    assert wait_for(lambda: client.connection_epoch() == 2)  # dropped, reconnected


def test_nonzero_tail_past_n_out_is_refused(fw: FakeWorker, client: RemoteDraftClient) -> None:
    fw.step_hook = _mutate(lambda c: c.reply.draft_ids.__setitem__((0, 3), 1))
    e = entry(0, 1, 8, 5, 8, n_out=2, flags=wire.RF_NEED_DRAFT | wire.RF_RESET)
    out = client.step(bytearray(4096), [e], 8, 1, rows=rows_for(0, 1, 0, 8))
    assert out.reason == "bad_reply"
    assert "where the contract requires 0" in str(client.stats.get("last_bad_reply"))


@pytest.mark.parametrize("status, reason, reconnect, disabled", [
    (wire.ST_BUSY, "frame_busy", False, False),
    (wire.ST_NO_SESSION, "frame_no_session", True, False),
    (wire.ST_STALE_SEQ, "frame_stale_seq", True, False),
    (wire.ST_INTERNAL, "frame_internal", True, False),
    (wire.ST_BAD_FRAME, "frame_bad_frame", False, True),
    (wire.ST_LIMITS, "frame_limits", False, True),
])
def test_frame_statuses(fw: FakeWorker, client: RemoteDraftClient, status: int, reason: str,
                        reconnect: bool, disabled: bool) -> None:
    fw.step_hook = lambda ctx: ("status", status)
    out = prefill(client)
    assert not out.ok and out.reason == reason and not out.unknown_apply
    assert out.status == status
    fw.step_hook = None
    assert client.disabled == disabled
    if reconnect:
        assert wait_for(lambda: client.connection_epoch() == 2)
    elif not disabled:
        assert client.connection_epoch() == 1 and prefill(client, step_id=2).ok


def test_new_session_replaces_the_old_one(fw: FakeWorker, client: RemoteDraftClient) -> None:
    old = client.session
    client.new_session("test")
    assert client.session != old
    assert wait_for(lambda: client.connection_epoch() == 2)
    assert client.session in fw.sessions and old not in fw.sessions  # same client name
    assert client.stats.get("new_sessions") == 1


def test_session_moves_with_reconnect_and_seq_keeps_rising(fw: FakeWorker,
                                                          client: RemoteDraftClient) -> None:
    assert prefill(client).ok
    fw.drop_connections()
    out = prefill(client, step_id=2)
    assert not out.ok
    assert wait_for(lambda: client.connection_epoch() == 2)
    assert prefill(client, step_id=3).ok
    seqs = [h.seq for _, h, _ in fw.frames if h.session == client.session]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)


# -- sampled -------------------------------------------------------------------------------------
@pytest.fixture
def sampled_client(fw: FakeWorker) -> Iterator[RemoteDraftClient]:
    c = RemoteDraftClient(cfg(fw.endpoint), make_hello(sampled=True))
    assert c.wait_ready(3.0), c.last_error
    yield c
    c.close()


def sampled_prefill(c: RemoteDraftClient, step_id: int = 1) -> Any:
    es = [entry(0, 3, 8, 5, 8, flags=wire.RF_NEED_DRAFT | wire.RF_RESET, seed=42, top_k=8,
                temperature=0.8, top_p=0.95),
          entry(1, 4, 6, 7, 6, flags=wire.RF_NEED_DRAFT | wire.RF_RESET)]  # greedy entry
    rows = np.concatenate([rows_for(0, 3, 0, 8), rows_for(1, 4, 0, 6)])
    return c.step(bytearray(4096), es, 14, step_id, rows=rows)


def test_sampled_reply_passes_every_check(fw: FakeWorker,
                                          sampled_client: RemoteDraftClient) -> None:
    out = sampled_prefill(sampled_client)
    assert out.ok, sampled_client.stats.get("last_bad_reply")
    assert out.reply is not None and out.reply.sampled_mask is not None
    assert out.reply.sampled_mask.tolist() == [1, 0]
    assert fw.errors == []


def _swap_draw(ctx: StepCtx) -> None:
    r = ctx.reply
    assert r is not None and r.support_ids is not None and r.proposal_q is not None
    ids, q = r.support_ids[0, 1], r.proposal_q[0, 1]
    other = [int(i) for i, qq in zip(ids, q, strict=True) if qq > 0 and i != r.draft_ids[0, 1]]
    r.draft_ids[0, 1] = other[0]  # still a support id with q > 0: only the draw is wrong


@pytest.mark.parametrize("hook, words", [
    (_mutate(_swap_draw), "is not the draw"),
    (_mutate(lambda c: c.reply.proposal_q.__setitem__((0, 0, 0), 5)), "q sums to"),
    (_mutate(lambda c: c.reply.sampled_mask.__setitem__(1, 1)), "sampled_mask 1"),
])
def test_sampled_bad_replies(fw: FakeWorker, sampled_client: RemoteDraftClient, hook: Any,
                             words: str) -> None:
    fw.step_hook = hook
    out = sampled_prefill(sampled_client)
    assert out.reason == "bad_reply"
    assert words in str(sampled_client.stats.get("last_bad_reply"))


def test_the_draws_request_side_is_made_while_the_reply_is_on_its_way(
        fw: FakeWorker, sampled_client: RemoteDraftClient, monkeypatch: Any) -> None:
    """The socket transport runs the client's request-only work between send and receive:
    the ReplyCheck (every u) is made while the worker has the STEP and not yet answered."""
    received, made = threading.Event(), threading.Event()
    seen_by_client: list[bool] = []
    seen_by_worker: list[bool] = []
    real = exchange_mod.ReplyCheck

    def spy(*a: Any, **kw: Any) -> Any:  # the STEP must be at the worker already
        seen_by_client.append(received.wait(5))
        made.set()
        return real(*a, **kw)

    def hook(ctx: StepCtx) -> None:  # and the worker answers only once the check is made
        received.set()
        seen_by_worker.append(made.wait(5))

    monkeypatch.setattr(exchange_mod, "ReplyCheck", spy)
    fw.step_hook = hook
    out = sampled_prefill(sampled_client)
    assert out.ok, sampled_client.stats.get("last_bad_reply")
    assert seen_by_client == [True] and seen_by_worker == [True]


def test_a_failure_while_waiting_is_made_good_when_the_reply_is_in(
        fw: FakeWorker, sampled_client: RemoteDraftClient, monkeypatch: Any) -> None:
    """The request-only work must not raise inside the transport (that would drop the
    connection): what fails there is made again once the reply is in, and a reply that is
    good still passes."""
    real = exchange_mod.ReplyCheck
    calls = {"n": 0}

    def flaky(*a: Any, **kw: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 1:
            raise MemoryError("scratch")
        return real(*a, **kw)

    monkeypatch.setattr(exchange_mod, "ReplyCheck", flaky)
    epoch = sampled_client.connection_epoch()
    out = sampled_prefill(sampled_client)
    assert out.ok, sampled_client.stats.get("last_bad_reply")
    assert calls["n"] == 2
    assert sampled_client.connection_epoch() == epoch  # the connection was kept
    fw.step_hook = _mutate(_swap_draw)  # and the remade check still refuses a wrong draw
    calls["n"] = 0
    assert sampled_prefill(sampled_client, step_id=2).reason == "bad_reply"
    assert "is not the draw" in str(sampled_client.stats.get("last_bad_reply"))


def test_step_takes_its_entries_as_an_array(fw: FakeWorker,
                                           sampled_client: RemoteDraftClient) -> None:
    """Entries laid out ahead (an ENTRY_DTYPE array) make the same STEP as the objects, and
    its reply passes the same checks."""
    es = [entry(0, 3, 8, 5, 8, flags=wire.RF_NEED_DRAFT | wire.RF_RESET, seed=42, top_k=8,
                temperature=0.8, top_p=0.95),
          entry(1, 4, 6, 7, 6, flags=wire.RF_NEED_DRAFT | wire.RF_RESET)]
    rows = np.concatenate([rows_for(0, 3, 0, 8), rows_for(1, 4, 0, 6)])
    scratch = bytearray(wire.rows_offset_for(2))
    wire.pack_step_prefix(scratch, 0, 1, es, 14, rows.shape[1])
    arr = np.frombuffer(scratch, wire.ENTRY_DTYPE, count=2,
                        offset=wire.STEP_HEADER_SIZE).copy()
    by_objects = sampled_client.step(bytearray(4096), es, 14, 1, rows=rows)
    by_array = sampled_client.step(bytearray(4096), arr, 14, 2, rows=rows)
    assert by_objects.ok and by_array.ok, sampled_client.stats.get("last_bad_reply")
    assert by_array.reply is not None and by_objects.reply is not None
    assert np.array_equal(by_array.reply.draft_ids, by_objects.reply.draft_ids)
    bodies = [body for _, h, body in fw.frames if h.op == wire.OP_STEP]
    assert bytes(bodies[-1])[8:] == bytes(bodies[-2])[8:]  # all but the step_id


def test_sampled_session_refuses_reply_without_q() -> None:
    with FakeWorker() as fw:
        c = RemoteDraftClient(cfg(fw.endpoint), make_hello(sampled=True))
        assert c.wait_ready(2.0)

        def strip(ctx: StepCtx) -> Any:
            r = ctx.reply
            assert r is not None
            g = wire.StepReply.empty(r.step_id, r.n_req, r.num_spec, wire.RPF_MARGIN)
            g.generation[:] = r.generation
            g.window_rows[:] = r.window_rows
            h = ctx.header
            return ("frame", wire.frame(h.op, h.seq, h.session, g.pack()))

        fw.step_hook = strip
        assert sampled_prefill(c).reason == "bad_reply"
        assert "without sampled q" in str(c.stats.get("last_bad_reply"))
        c.close()


# -- tools, lifetime, fork ------------------------------------------------------------------------
def test_simple_request(fw: FakeWorker, client: RemoteDraftClient) -> None:
    assert client.simple_request(wire.OP_PING) == (wire.ST_OK, b"")
    status, body = client.simple_request(wire.OP_STATS)
    assert status == wire.ST_OK and b"fake-worker" in body
    assert client.simple_request(wire.OP_RESET, wire.pack_reset([1]))[0] == wire.ST_OK
    c = RemoteDraftClient(cfg(fw.endpoint), make_hello(), background=False)
    with pytest.raises(TransportError, match="not connected"):
        c.simple_request(wire.OP_PING)
    c.close()


def test_dropped_client_is_collected_and_its_thread_ends(fw: FakeWorker) -> None:
    c = RemoteDraftClient(cfg(fw.endpoint), make_hello(), stats=Stats())
    assert c.wait_ready(2.0)
    thread = c.link.thread
    assert thread is not None and thread.is_alive()
    ref = weakref.ref(c)
    del c
    gc.collect()
    assert ref() is None, "the background thread kept the client alive"
    thread.join(2.0)
    assert not thread.is_alive()
    assert wait_for(lambda: not fw._conns)  # the connection was closed by the finalizer


def test_close_is_idempotent_and_stops_thread(fw: FakeWorker) -> None:
    c = RemoteDraftClient(cfg(fw.endpoint), make_hello())
    assert c.wait_ready(2.0)
    c.close()
    c.close()
    assert not c.ready
    assert c.link.thread is not None
    c.link.thread.join(2.0)
    assert not c.link.thread.is_alive()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_client_used_after_fork_refuses(fw: FakeWorker, client: RemoteDraftClient) -> None:
    r, w = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:
        code = 1
        try:
            out = client.step(bytearray(4096), [], 0, 1)
            ok = (out.reason == "disabled" and "after fork" in (client.disabled_reason or "")
                  and client.connection_epoch() is None)
            os.write(w, struct.pack("<?", ok))
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    data = os.read(r, 1)
    os.close(r)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0 and struct.unpack("<?", data)[0]
    # The parent is untouched.
    assert client.ready and not client.disabled and prefill(client).ok


def test_step_and_simple_request_from_two_threads_do_not_interleave(
        fw: FakeWorker, client: RemoteDraftClient) -> None:
    errors: list[str] = []

    def tool() -> None:
        for _ in range(30):
            try:
                st, _ = client.simple_request(wire.OP_PING)
                if st != wire.ST_OK:
                    errors.append(f"ping status {st}")
            except Exception as exc:
                errors.append(repr(exc))

    t = threading.Thread(target=tool)
    t.start()
    for i in range(30):
        out = prefill(client, step_id=i + 1)
        if not out.ok and out.reason != "local_busy":
            errors.append(f"step {out.reason}")
    t.join()
    assert errors == [] and client.epoch == 1


def test_step_validates_entry_count(client: RemoteDraftClient) -> None:
    es = [entry(i % MAX_SLOTS, 1, 1, 0, 0) for i in range(MAX_SLOTS + 1)]
    with pytest.raises(ValueError, match="more than max_slots"):
        client.step(bytearray(8192), es, 0, 1)
