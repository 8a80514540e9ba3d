"""Client overhead without the network: what ``RemoteDraftClient.step()`` costs rank 0 per round
(pack the STEP prefix, hand [headers, rows] to the transport, unpack the reply, check it: echo,
6.3 values, and on sampled sessions 9.2 plus the re-derived draws), and what
``DraftRounds.run()`` adds (ring writes, resync decisions, the one gather into staging).

The transport is a stub that copies a precomputed valid reply into the client's buffer (with
the request's seq patched in), so the figures are the client's own CPU time plus one memcpy of
the reply. Run:

    python bench/bench_client.py            # table
    python bench/bench_client.py --json     # machine-readable
    python bench/bench_client.py --quick    # fewer iterations (CI smoke)
    python bench/bench_client.py --rtt-us 0 # without the round-trip column
    python bench/bench_client.py --live 100 # step() against a real worker: client time per STEP
    python bench/bench_client.py --after-sleep 0,5,50  # the same against the stub, after a wait
    python bench/bench_client.py --acceptance 4  # the acceptance hook alone, 1, 64, 256 entries
    python bench/bench_client.py --paired 1000 --slots 1,64,256  # step() and the rounds in turn
    python bench/bench_client.py --paired 1000 --slots 1 --step-only  # step() cases alone
    python bench/bench_client.py --paired 400 --slots 1,256 --forms list  # same set everywhere
    python bench/bench_client.py --paired 300 --slots 64 --row-bytes 25600 --new-rows 5

The script runs unchanged at an older revision of the project (copy it into that checkout's
bench/), which is how before-and-after figures are taken.

Rounds (``bench_rounds``): ``DraftRounds.run_batch`` and ``run`` (one ``SlotRequest`` per slot)
with every slot continuing with 4 new rows of 768 bytes, against the same stub; ``--repeat``
prints them beside ``step()`` with the ratio of each round to ``step()`` alone (``--slots 1,256``
for other sizes); ``--paired`` calls every case once in turn instead, so that the ratios share
the machine's noise (``--row-bytes`` and ``--new-rows`` for an engine's row sizes). Each call
is given whole and as its ``critical`` time: the whole less the work it hands the transport to
run while the reply is on its way (``step()``'s checks made ahead of the reply, and the usual
round's ring write), which the stub, answering at once, runs inside the call; against a real
round trip longer than that work, the critical time is what the call adds to it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import struct
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dspark_client.client import RemoteDraftClient
from dspark_client.config import RemoteConfig
from dspark_client.rounds import DraftRounds, SlotRequest
from protocol import sampled as psampled
from protocol import wire
from protocol.messages import ENTRY_DTYPE
from protocol.validate import check_reply_values

N, W, VOCAB, ROW_BYTES, TOP_K = 7, 64, 32000, 768, 16
_SEQ = struct.Struct("<Q")


class StubTransport:
    """Answers HELLO with a fixed HelloReply, every STEP with one precomputed reply (copied
    into the client's buffer with one memcpy, as a socket's ``recv_into`` copies it out of the
    kernel) and anything else with an empty body. Like the socket transport it runs the
    client's ``while_waiting`` once the request is "sent"; with ``rtt_us`` it then waits
    (spinning) until that long after the send before it answers, a round trip's stand-in."""

    runs_while_waiting = True

    def __init__(self, hello_reply: bytes) -> None:
        self.hello_reply = hello_reply
        self.step_reply = b""
        self.rtt_us = 0.0
        self.sleep_s = 0.0
        self.waited_us = 0.0  # time spent in the client's while_waiting work, all calls

    def connect(self, timeout: float) -> None:
        pass

    def request(self, msg: Any, buf: bytearray, timeout: float) -> int:
        return self.request_parts((msg,), buf, timeout)

    def request_parts(self, parts: Any, buf: bytearray, timeout: float, fds: Any = (),
                      while_waiting: Callable[[], None] | None = None) -> int:
        sent_at = time.perf_counter()
        if while_waiting is not None:
            while_waiting()
            self.waited_us += (time.perf_counter() - sent_at) * 1e6
        if self.rtt_us:
            until = sent_at + self.rtt_us * 1e-6
            while time.perf_counter() < until:
                pass
        if self.sleep_s:
            time.sleep(self.sleep_s)
        head = parts[0]
        h = wire.AppHeader.unpack(head)
        if h.op != wire.OP_STEP:  # HELLO, and GOODBYE when the client closes
            out = wire.frame(h.op, h.seq, h.session,
                             self.hello_reply if h.op == wire.OP_HELLO else b"")
            buf[:len(out)] = out
            return len(out)
        n = len(self.step_reply)
        memoryview(buf)[:n] = self.step_reply  # one memcpy, as recv_into's copy out of the kernel
        _SEQ.pack_into(buf, 16, h.seq)  # echo the seq, as the worker would
        return n

    def close(self) -> None:
        pass


def n_taps() -> int:
    """Taps of the stub's drafter: 3 for the default 768-byte rows (3 x 128 x bf16), 5 for
    row sizes that 6 does not divide (25,600: Qwen3-4B's 5 x 2560 x bf16)."""
    return 3 if ROW_BYTES % 6 == 0 else 5


def hello(max_slots: int, sampled: bool) -> wire.Hello:
    return wire.Hello(sample_mode=wire.SAMPLE_TOP32 if sampled else wire.SAMPLE_GREEDY,
                      window=W, num_spec=N, max_slots=max_slots,
                      max_rows_per_step=(W + 8) * max_slots,
                      row_bytes=ROW_BYTES, vocab_size=VOCAB, n_taps=n_taps(),
                      hidden=ROW_BYTES // (2 * n_taps()),
                      drafter_identity=bytes(32), markov_identity=bytes(32),
                      client_name="bench")


def hello_reply(max_slots: int) -> bytes:
    return wire.HelloReply(capabilities=7, window=W, num_spec=N, max_slots=max_slots,
                           max_rows_per_step=(W + 8) * max_slots, row_bytes=ROW_BYTES,
                           vocab_size=VOCAB, drafter_identity=bytes(32),
                           markov_identity=bytes(32), worker_name="stub", n_taps=n_taps(),
                           hidden=ROW_BYTES // (2 * n_taps())).pack()


def make_entries(n: int, sampled: bool, rows_per_entry: int) -> list[wire.ReqEntry]:
    out = []
    for i in range(n):
        kw: dict[str, Any] = {}
        if sampled:
            kw = dict(seed=1000 + i, top_k=TOP_K, temperature=0.8, top_p=0.95)
        out.append(wire.ReqEntry(slot=i, generation=3, anchor_pos=500 + i, anchor_token=i,
                                 n_rows=rows_per_entry, n_out=0, flags=wire.RF_NEED_DRAFT,
                                 **kw))
    return out


def ok_reply(step_id: int, n: int, sampled: bool,
             rng: np.random.Generator) -> wire.StepReply:
    """A reply whose n entries are OK with every position drafted: W rows, generation 3,
    random confidences, margin 1; greedy ids random; sampled entries marked, their supports,
    q and draws left to the caller."""
    flags = wire.RPF_MARGIN | (wire.RPF_SAMPLED if sampled else 0)
    r = wire.StepReply.empty(step_id, n, N, flags)
    r.status[:] = wire.RS_OK
    r.window_rows[:] = W
    r.generation[:] = 3
    r.confidence[:] = rng.uniform(0, 1, (n, N)).astype(np.float32)
    assert r.margin is not None
    r.margin[:] = 1.0
    if sampled:
        assert r.sampled_mask is not None
        r.sampled_mask[:] = 1
    else:
        r.draft_ids[:] = rng.integers(0, VOCAB, (n, N), dtype=np.int32)
    return r


def make_reply(step_id: int, entries: list[wire.ReqEntry], sampled: bool, session: int) -> bytes:
    rng = np.random.default_rng(0)
    r = ok_reply(step_id, len(entries), sampled, rng)
    if sampled:
        assert r.support_ids is not None and r.proposal_q is not None
        for i, e in enumerate(entries):
            u = psampled.draw_u(e.seed, e.generation, e.anchor_pos + 1 + np.arange(N))
            for j in range(N):
                ids, q = psampled.build_q(rng.normal(size=256) * 2, e.top_k, e.temperature,
                                          e.top_p)
                r.support_ids[i, j], r.proposal_q[i, j] = ids, q
                r.draft_ids[i, j] = int(psampled.draw(ids, q, u[j]))
    return wire.frame(wire.OP_STEP, 0, session, r.pack())


def timeit(fn: Callable[[], Any], seconds: float, min_iters: int = 50) -> dict[str, float]:
    for _ in range(10):
        fn()
    times: list[float] = []
    deadline = time.perf_counter() + seconds
    while len(times) < min_iters or time.perf_counter() < deadline:
        t0 = time.perf_counter_ns()
        fn()
        times.append((time.perf_counter_ns() - t0) / 1000.0)
    times.sort()
    return {"median_us": statistics.median(times), "p90_us": times[int(0.9 * len(times))],
            "min_us": times[0], "iters": float(len(times))}


def entries_array(entries: list[wire.ReqEntry]) -> Any:
    """The entries laid out as the wire has them (an ENTRY_DTYPE array), as an engine that
    keeps its requests' fields in arrays would hand them to ``step()``."""
    buf = bytearray(wire.rows_offset_for(len(entries)))
    wire.pack_step_prefix(buf, 0, 1, entries, sum(e.n_rows for e in entries), ROW_BYTES)
    return np.frombuffer(buf, ENTRY_DTYPE, count=len(entries),
                         offset=wire.STEP_HEADER_SIZE).copy()


def has_acceptance() -> bool:
    """Whether this revision counts acceptance in ``step()``."""
    try:
        import dspark_client.acceptance  # noqa: F401
    except ImportError:
        return False
    return True


def takes_arrays() -> bool:
    """Whether this revision's ``pack_step_prefix`` takes an entries array."""
    entries = make_entries(1, False, 1)
    try:
        wire.pack_step_prefix(bytearray(wire.rows_offset_for(1)), 0, 1, entries_array(entries),
                              1, ROW_BYTES)
    except (TypeError, AttributeError, ValueError):
        return False
    return True


def step_case(n: int, sampled: bool, as_array: bool = False) -> tuple[
        StubTransport, RemoteDraftClient, Callable[[], Callable[[], Any]], Any, bytearray]:
    """``step()`` alone: n entries of one row each, every entry asking for all N positions
    (as objects, or as an ENTRY_DTYPE array with ``as_array``), the same STEP every call.
    Returns the stub, the client, ``prepare`` (which returns the call to time), the entries
    and the request buffer."""
    stub, client = stub_client(n, sampled)
    objects = make_entries(n, sampled, rows_per_entry=1)
    stub.step_reply = make_reply(1, objects, sampled, client.session)
    entries: Any = entries_array(objects) if as_array else objects
    rows = np.zeros((n, ROW_BYTES), np.uint8)
    buf = bytearray(1 << 20)
    out = client.step(buf, entries, n, 1, rows=rows)
    assert out.ok, (out.reason, client.stats.get("last_bad_reply"))

    def call() -> Any:
        return client.step(buf, entries, n, 1, rows=rows)

    return stub, client, lambda: call, entries, buf


def bench_step(n: int, sampled: bool, seconds: float, rtt_us: float = 0.0,
               as_array: bool = False) -> dict[str, Any]:
    stub, client, prepare, entries, buf = step_case(n, sampled, as_array)
    call = prepare()
    res = timeit(call, seconds)
    critical = [timed_call(stub, call, client)[1] for _ in range(int(res["iters"]))]
    res["critical_us"] = statistics.median(critical)
    if rtt_us:  # what step() adds to a round trip of rtt_us: its time less the round trip
        stub.rtt_us = rtt_us
        added = timeit(call, seconds)
        stub.rtt_us = 0.0
        res["added_us"] = added["median_us"] - rtt_us
        res["added_p90_us"] = added["p90_us"] - rtt_us
    # Parts, to say where the time goes.
    parts: dict[str, dict[str, float]] = {}
    parts["pack_step_prefix"] = timeit(lambda: wire.pack_step_prefix(
        buf, wire.APP_HEADER_SIZE, 1, entries, n, ROW_BYTES), seconds / 4)
    body = memoryview(stub.step_reply)[wire.APP_HEADER_SIZE:]
    parts["unpack"] = timeit(lambda: wire.StepReply.unpack(body, expect_n_req=n,
                                                           expect_num_spec=N), seconds / 4)
    reply = wire.StepReply.unpack(body)
    sent = np.frombuffer(buf, ENTRY_DTYPE, count=n, offset=wire.APP_HEADER_SIZE + 32)
    parts["check_reply_values"] = timeit(lambda: check_reply_values(
        reply, sent, vocab_size=VOCAB, window=W), seconds / 4)
    if sampled:
        assert reply.sampled_mask is not None and reply.support_ids is not None
        assert reply.proposal_q is not None
        needed = np.ones(n, bool)
        scratch = psampled.Scratch()
        if hasattr(psampled, "ReplyCheck"):  # absent at older revisions
            parts["sampled.ReplyCheck"] = timeit(lambda: psampled.ReplyCheck(
                sent["seed"], sent["generation"], sent["anchor_pos"], sent["top_k"], N, VOCAB,
                scratch=scratch), seconds / 4)
        parts["sampled.check_reply"] = timeit(lambda: psampled.check_reply(
            reply.sampled_mask, reply.support_ids, reply.proposal_q, reply.draft_ids, needed,
            VOCAB, sent["top_k"], sent["seed"], sent["generation"], sent["anchor_pos"],
            scratch=scratch),
            seconds / 4)
    client.close()
    return {"what": "step[array]" if as_array else "step", "n": n, "N": N, "sampled": sampled,
            **res, "parts": {k: round(v["median_us"], 1) for k, v in parts.items()}}


def bench_acceptance(n: int, seconds: float) -> dict[str, Any]:
    """The acceptance hook ``step()`` runs once a reply is in (``ClientAcceptance``), on its
    dearest path: every entry continues its slot and judges the block drafted last round (the
    anchors advance by 1..N+1 each call). The anchors' update is timed alone and taken off.
    ``median_us`` is a call's median, which leaves out the calls that judge the log;
    ``mean_us`` is a call's share of 1,024 calls in a row, those included."""
    from dspark_client.acceptance import ClientAcceptance

    rng = np.random.default_rng(2)
    sent = entries_array(make_entries(n, False, rows_per_entry=1))
    drafted = np.full(n, N, np.int64)
    conf = rng.uniform(0.2, 1.0, (n, N)).astype(np.float32)
    advance = rng.integers(1, N + 2, (256, n)).astype(np.uint32)
    acc = ClientAcceptance(n, N)
    state = {"i": 0}

    def move() -> None:
        sent["anchor_pos"] += advance[state["i"] & 255]
        state["i"] += 1

    def one() -> None:
        move()
        if hasattr(acc, "step_sent"):  # judged in the round trip, drafts kept after the reply
            acc.step_sent(sent)
            acc.reply_in(drafted, conf)
        else:  # older revisions: one call after the reply
            acc.step_answered(sent, drafted, conf)

    res = timeit(one, seconds)
    base = timeit(move, seconds / 2)
    calls = 1024
    t0 = time.perf_counter_ns()
    for _ in range(calls):
        one()
    mean = (time.perf_counter_ns() - t0) / 1000.0 / calls
    if acc.totals().rounds == 0:
        raise RuntimeError("no block was judged: the benchmark misses the path it times")
    return {"what": "acceptance", "n": n, "N": N, "sampled": False,
            "median_us": res["median_us"] - base["median_us"],
            "p90_us": res["p90_us"] - base["median_us"],
            "mean_us": mean - base["median_us"]}


def bench_live(n: int, steps: int, top_k: int) -> dict[str, Any]:
    """``step()`` against a real worker process over TCP on loopback (the embedded reference
    drafter on the CPU, one intra-op thread): every entry RF_RESET with one row (so every STEP
    re-applies the same window) and RF_NEED_DRAFT, sampled with ``top_k`` (0: greedy). The
    client's own time per STEP is its ``client_us_total`` counter: the STEP's time in
    ``step()`` less the round trip (send to reply), so work done inside the round trip is not
    in it."""
    import importlib.util

    from dspark_client.hello import hello_from_checkpoint

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(
        __file__))), "tests"))
    from support.worker_proc import start_worker

    spec = importlib.util.find_spec("dspark_worker")
    assert spec is not None and spec.submodule_search_locations
    drafter = os.path.join(spec.submodule_search_locations[0], "drafter", "reference")
    with start_worker("--max-total-slots", str(max(n, 256)), "--max-slots", str(max(n, 1)),
                      "--metrics-listen", "none", "--log-level", "WARNING") as w:
        hello = hello_from_checkpoint(drafter, window=1024, max_slots=n, sampled=top_k > 0,
                                      client_name="bench-live")
        client = RemoteDraftClient(RemoteConfig(endpoint=f"tcp://{w.host}:{w.port}",
                                                timeout_ms=60_000), hello)
        assert client.wait_ready(30.0), client.last_error
        kw: dict[str, Any] = dict(top_k=top_k, temperature=0.8, top_p=0.95) if top_k else {}
        entries = [wire.ReqEntry(slot=i, generation=1, anchor_pos=1, anchor_token=i % 256,
                                 n_rows=1, flags=wire.RF_NEED_DRAFT | wire.RF_RESET,
                                 **({**kw, "seed": 1000 + i} if kw else {})) for i in range(n)]
        rows = np.random.default_rng(0).integers(0, 256, (n, hello.row_bytes), dtype=np.uint8)
        rows.view(np.uint16)[:] &= 0x3FFF  # finite bf16 values
        buf = bytearray(1 << 20)
        for step in range(1, 6):  # warm-up
            out = client.step(buf, entries, n, step, rows=rows)
            assert out.ok, (out.reason, client.stats.get("last_bad_reply"))
        ids = itertools.count(6)  # a new step_id each STEP
        us, outs = client_us_per_step(
            client, lambda: client.step(buf, entries, n, next(ids), rows=rows), steps)
        client.close()
    return {"what": "live", "n": n, "N": hello.num_spec, "top_k": top_k, "steps": steps,
            "client_us": us, "rtt_p50_us": statistics.median(o.rtt_us for o in outs)}


def bench_after_sleep(n: int, sleep_ms: float, steps: int) -> dict[str, Any]:
    """Sampled ``step()`` against the stub, which sleeps ``sleep_ms`` between the request and
    the reply (a wait in ``recv`` of that long): the client's own time per STEP, from its
    ``client_us_total`` counter (its time in ``step()`` outside the round trip)."""
    stub, client = stub_client(n, True)
    entries = make_entries(n, True, rows_per_entry=1)
    stub.step_reply = make_reply(1, entries, True, client.session)
    rows = np.zeros((n, ROW_BYTES), np.uint8)
    buf = bytearray(1 << 20)
    stub.sleep_s = sleep_ms / 1e3
    for _ in range(5):
        client.step(buf, entries, n, 1, rows=rows)
    us, _ = client_us_per_step(client, lambda: client.step(buf, entries, n, 1, rows=rows),
                               steps)
    client.close()
    return {"sleep_ms": sleep_ms, "client_us": us}


def stub_client(n: int, sampled: bool) -> tuple[StubTransport, RemoteDraftClient]:
    """A client of n slots connected to a stub transport (no background thread)."""
    stub = StubTransport(hello_reply(max(n, 1)))
    cfg = RemoteConfig(endpoint="tcp://127.0.0.1:9", timeout_ms=1000)
    client = RemoteDraftClient(cfg, hello(max(n, 1), sampled), background=False,
                               transport_factory=lambda ep: stub)
    assert client.connect_now()
    return stub, client


def client_us_per_step(client: RemoteDraftClient, step: Callable[[], Any],
                       steps: int) -> tuple[float, list[Any]]:
    """``steps`` calls of ``step`` (each a good STEP): the client's own time per STEP from its
    ``client_us_total`` counter (its time in ``step()`` outside the round trip), and the
    outcomes."""
    before = client.stats.snapshot()
    outs = [step() for _ in range(steps)]
    after = client.stats.snapshot()
    good = after["steps_ok"] - before.get("steps_ok", 0)
    if good != steps:
        raise RuntimeError(f"{steps - good} of {steps} STEPs failed:"
                           f" {client.stats.get('last_bad_reply')}")
    return (after["client_us_total"] - before.get("client_us_total", 0)) / good, outs


class RoundReplies:
    """The stub's reply to each round of ``bench_rounds``: every entry drafts all N positions;
    on a sampled session the proposals are fixed per (slot, position) and the draws re-derived
    from each round's anchors (9.3), so the client's checks pass. Made between the timed
    calls."""

    def __init__(self, n: int, sampled: bool, seeds: np.ndarray) -> None:
        rng = np.random.default_rng(0)
        self.r = r = ok_reply(1, n, sampled, rng)
        self.sampled, self.seeds = sampled, seeds
        if sampled:
            assert r.support_ids is not None and r.proposal_q is not None
            logits = rng.normal(size=(N, 256)) * 2  # one proposal per position, every slot
            for j in range(N):
                r.support_ids[:, j], r.proposal_q[:, j] = psampled.build_q(
                    logits[j], TOP_K, 0.8, 0.95)

    def frame(self, step_id: int, anchor: np.ndarray, session: int) -> bytes:
        r = self.r
        r.step_id = step_id
        if self.sampled:
            assert r.support_ids is not None and r.proposal_q is not None
            u = psampled.draw_u(self.seeds[:, None], 3, anchor[:, None] + 1 + np.arange(N))
            r.draft_ids[:] = psampled.draw(r.support_ids, r.proposal_q, u)
        return wire.frame(wire.OP_STEP, 0, session, r.pack())


def rounds_case(n: int, sampled: bool, form: str = "batch", accepted: int = 3
                ) -> tuple[StubTransport, RemoteDraftClient, Callable[[], Callable[[], Any]]]:
    """The round an engine makes every step: n slots continuing, ``accepted + 1`` new rows
    each, every slot asking for all N positions. ``form``: "batch" (``run_batch``, the rows
    as one array) or "list" (``run`` with one ``SlotRequest`` each, built before the call;
    this one runs at older revisions too). Returns the stub, the client and ``prepare``,
    which sets up the next round (its reply, its requests) and returns the call to time."""
    stub, client = stub_client(n, sampled)
    rounds = DraftRounds(client)
    k = accepted + 1
    slots = np.arange(n, dtype=np.int64)
    seeds = (1000 + slots).astype(np.uint64)
    kw: dict[str, Any] = dict(seed=seeds, top_k=TOP_K, temperature=0.8, top_p=0.95) \
        if sampled else {}
    anchor = np.full(n, W + 1, np.int64)
    pool = np.random.default_rng(1).integers(0, 256, (W + 64, ROW_BYTES), dtype=np.uint8)
    replies = RoundReplies(n, sampled, seeds)
    state = {"step": 1}
    # Round 1 resyncs every slot.
    stub.step_reply = replies.frame(1, anchor, client.session)
    res = rounds.run([SlotRequest(slot=i, generation=3, anchor_pos=W + 1, anchor_token=i,
                                  rows=pool[:W + 1], n_out=N,
                                  **(dict(seed=1000 + i, top_k=TOP_K, temperature=0.8,
                                          top_p=0.95) if sampled else {})) for i in range(n)])
    assert res.ok, (res.reason, client.stats.get("last_bad_reply"))
    new_rows = np.ascontiguousarray(np.concatenate([pool[:k]] * n))
    counts = np.full(n, k, np.int64)

    def prepare() -> Callable[[], Any]:
        state["step"] += 1
        anchor[:] += k
        stub.step_reply = replies.frame(state["step"], anchor, client.session)
        if form == "batch":
            a = anchor.copy()
            return lambda: rounds.run_batch(slots, 3, a, slots, N, new_rows, counts, **kw)
        reqs = [SlotRequest(slot=i, generation=3, anchor_pos=int(anchor[i]), anchor_token=i,
                            rows=new_rows[i * k:(i + 1) * k], n_out=N,
                            **(dict(seed=1000 + i, top_k=TOP_K, temperature=0.8, top_p=0.95)
                               if sampled else {})) for i in range(n)]
        return lambda: rounds.run(reqs)

    return stub, client, prepare


def timed_call(stub: StubTransport, call: Callable[[], Any], client: RemoteDraftClient
               ) -> tuple[float, float]:
    """One call, timed: its whole time and its critical time (the whole less the work it
    ran during the round trip), µs."""
    waited = stub.waited_us
    t0 = time.perf_counter_ns()
    out = call()
    dt = (time.perf_counter_ns() - t0) / 1000.0
    if not out.ok:
        raise RuntimeError(f"call failed: {out.reason} {client.stats.get('last_bad_reply')}")
    return dt, dt - (stub.waited_us - waited)


def bench_rounds(n: int, sampled: bool, seconds: float, accepted: int = 3,
                 form: str = "batch", rtt_us: float = 0.0) -> dict[str, Any]:
    """``rounds_case``'s round, timed for ``seconds``. The time is the call's: ring write,
    decisions, entries, ``step()`` against the stub. ``rtt_us``: the stub answers that long
    after the send, and ``added_us`` is the median less it (what the round adds to a round
    trip)."""
    stub, client, prepare = rounds_case(n, sampled, form, accepted)
    stub.rtt_us = rtt_us
    times: list[float] = []
    critical: list[float] = []  # the same less the work run during the round trip
    deadline = time.perf_counter() + seconds
    while len(times) < 60 or time.perf_counter() < deadline:
        whole, crit = timed_call(stub, prepare(), client)
        times.append(whole)
        critical.append(crit)
    times = sorted(times[10:])  # the first rounds warm the caches
    critical = sorted(critical[10:])
    client.close()
    out = {"what": f"rounds.{'run_batch' if form == 'batch' else 'run'}", "n": n, "N": N,
           "sampled": sampled, "rows_per_slot": accepted + 1, "row_bytes": ROW_BYTES,
           "median_us": statistics.median(times), "p90_us": times[int(0.9 * len(times))],
           "min_us": times[0], "iters": float(len(times))}
    if rtt_us:
        out["added_us"] = out["median_us"] - rtt_us
    else:  # (with a round trip, added_us is the figure: the work runs inside it)
        out["critical_us"] = statistics.median(critical)
    return out


def repeat_rounds(n: int, repeat: int) -> None:
    """``--repeat``: step() and the rounds at n slots, ``repeat`` short medians each,
    interleaved; each round's ratio to the step() median of the same pass. The ``critical``
    figures are the time less the work run during the round trip (step()'s own checks made
    ahead, and the usual round's ring write): what a call adds to a round trip at least that
    long."""
    cases = [("step", sampled, as_array) for as_array in (False, True)
             for sampled in (False, True) if not as_array or takes_arrays()]
    forms = ("batch", "list") if hasattr(DraftRounds, "run_batch") else ("list",)
    cases += [(form, sampled, False) for form in forms for sampled in (False, True)]
    got: dict[tuple[str, bool, bool], list[float]] = {c: [] for c in cases}
    crit: dict[tuple[str, bool, bool], list[float]] = {c: [] for c in cases}
    for _ in range(repeat):
        for what, sampled, as_array in cases:
            r = (bench_step(n, sampled, 0.3, 0.0, as_array=as_array) if what == "step"
                 else bench_rounds(n, sampled, 0.3, form=what))
            got[(what, sampled, as_array)].append(r["median_us"])
            crit[(what, sampled, as_array)].append(r.get("critical_us", r["median_us"]))
    names = {"step": "step", "batch": "run_batch", "list": "run"}
    for (what, sampled, as_array), meds in got.items():
        name = "step[array]" if as_array else names[what]
        mode = "sampled" if sampled else "greedy"
        print(f"{name:<11} {mode:<8} n {n}: min {min(meds):.1f} median"
              f" {statistics.median(meds):.1f} us over {len(meds)} rounds")
        if what == "step":
            c = crit[(what, sampled, as_array)]
            print(f"{'':<20}   critical: min {min(c):.1f} median {statistics.median(c):.1f} us")
            continue
        base = got[("step", sampled, False)]  # the round against step() alone, pass by pass
        base_c = crit[("step", sampled, False)]
        c = crit[(what, sampled, as_array)]
        print(f"{'':<20}   x step(): " + " ".join(f"{m / b:.2f}" for m, b in zip(
            meds, base, strict=True)))
        print(f"{'':<20}   critical: min {min(c):.1f} median {statistics.median(c):.1f} us,"
              " x step()'s critical: " + " ".join(f"{m / b:.2f}" for m, b in zip(
                  c, base_c, strict=True)))


def paired_rounds(n: int, iters: int, accepted: int = 3, blocks: int = 5,
                  step_only: bool = False, forms: tuple[str, ...] | None = None) -> None:
    """``--paired``: step() and the rounds at n slots, one call of each in turn, ``iters``
    times: every case meets the same moments of the machine's noise, so the ratios of the
    medians hold steadier than those of separate runs. Prints each case's median whole and
    critical time and its ratio to step()'s, and the ratio in each of ``blocks`` equal
    spans of the iterations (its spread). Each round continues every slot with
    ``accepted + 1`` new rows. ``step_only``: the two step() cases alone (no rounds between
    its calls to evict what it works on). ``forms``: the rounds between them ("batch",
    "list"; default every form this tree has): ``("list",)`` gives a tree with
    ``run_batch`` the same set as one without, for comparing their step()."""
    if forms is None:
        forms = ("batch", "list") if hasattr(DraftRounds, "run_batch") else ("list",)
    makers: dict[tuple[str, bool], Callable[[], Any]] = {}
    for sampled in (False, True):
        makers[("step", sampled)] = lambda s=sampled: step_case(n, s)[:3]
        for form in () if step_only else forms:
            makers[(form, sampled)] = lambda f=form, s=sampled: rounds_case(n, s, f,
                                                                            accepted)
    cases = {key: make() for key, make in makers.items()}
    whole: dict[tuple[str, bool], list[float]] = {key: [] for key in cases}
    crit: dict[tuple[str, bool], list[float]] = {key: [] for key in cases}
    for i in range(iters + 10):
        for key, (stub, client, prepare) in cases.items():
            times = timed_call(stub, prepare(), client)
            if i >= 10:  # the first calls warm the caches
                whole[key].append(times[0])
                crit[key].append(times[1])
    for _, client, _ in cases.values():
        client.close()
    names = {"step": "step", "batch": "run_batch", "list": "run"}
    span = max(1, iters // blocks)
    print(f"{n} slots, {accepted + 1} new rows of {ROW_BYTES} bytes per slot per round,"
          f" {iters} calls of each")
    for (what, sampled), w in whole.items():
        c = crit[(what, sampled)]
        line = (f"{names[what]:<9} {'sampled' if sampled else 'greedy':<7} n {n}: whole"
                f" {statistics.median(w):7.1f} critical {statistics.median(c):7.1f} us")
        if what != "step":
            bw, bc = whole[("step", sampled)], crit[("step", sampled)]

            def ratio(x: list[float], b: list[float], lo: int = 0, hi: int = iters) -> float:
                return statistics.median(x[lo:hi]) / statistics.median(b[lo:hi])

            line += (f"  x step(): whole {ratio(w, bw):.2f} critical {ratio(c, bc):.2f}"
                     "  (critical by span: " + " ".join(
                         f"{ratio(c, bc, j, j + span):.2f}" for j in range(0, iters, span))
                     + ")")
        print(line)


def main(argv: list[str] | None = None) -> int:
    global TOP_K, ROW_BYTES
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true")
    p.add_argument("--quick", action="store_true", help="short runs (smoke test)")
    p.add_argument("--top-k", type=int, default=TOP_K,
                   help=f"top_k of the sampled entries (default {TOP_K}; 32 fills every place)")
    p.add_argument("--rtt-us", type=float, default=500.0,
                   help="also time step() against a stub that answers this long after the"
                        " send, and report what step() adds to that round trip (0: not)")
    p.add_argument("--live", type=int, default=0, metavar="STEPS",
                   help="instead: STEPS STEPs of 256 entries against a real worker process,"
                        " greedy and sampled, and the client's own time per STEP")
    p.add_argument("--after-sleep", type=str, default="", metavar="MS,MS",
                   help="instead: sampled step() at 256 entries when the stub sleeps this many"
                        " ms before it answers (0 = not), the client's own time per STEP")
    p.add_argument("--repeat", type=int, default=0, metavar="ROUNDS",
                   help="instead: step() at 256 entries (--slots for others; greedy and"
                        " sampled, entries as objects and, where taken, as an array) and the"
                        " rounds (run_batch, run), ROUNDS short medians each, interleaved;"
                        " prints the smallest and the median of them (a steadier figure on a"
                        " shared machine) and each round's ratio to step(), whole and less"
                        " the work it runs during the round trip")
    p.add_argument("--forms", default="", metavar="FORMS",
                   help="--paired: the rounds between the step() calls, of batch and list"
                        " (default: both where the tree has run_batch); list alone gives"
                        " trees with and without run_batch the same set")
    p.add_argument("--step-only", action="store_true",
                   help="--paired: the step() cases alone, without the rounds between them")
    p.add_argument("--paired", type=int, default=0, metavar="ITERS",
                   help="instead: step() and the rounds (run_batch, run) at 256 slots (--slots"
                        " for others), greedy and sampled, one call of each in turn, ITERS"
                        " times; each round's median whole and critical time against"
                        " step()'s")
    p.add_argument("--row-bytes", type=int, default=ROW_BYTES,
                   help=f"bytes per tap row (default {ROW_BYTES}; 25600 is a Qwen3-4B"
                        " target's)")
    p.add_argument("--new-rows", type=int, default=4, metavar="K",
                   help="--paired: new rows per slot per round (default 4)")
    p.add_argument("--slots", type=str, default="256", metavar="N,N",
                   help="the slots --repeat and --paired run at (default 256)")
    p.add_argument("--acceptance", type=int, default=0, metavar="ROUNDS",
                   help="instead: the acceptance hook step() runs once a reply is in, on its"
                        " dearest path, at 1, 64 and 256 entries, ROUNDS short runs each")
    args = p.parse_args(argv)
    TOP_K, ROW_BYTES = args.top_k, args.row_bytes
    if args.acceptance:
        for n in (1, 64, 256):
            runs = [bench_acceptance(n, 0.3) for _ in range(args.acceptance)]
            meds = [r["median_us"] for r in runs]
            means = [r["mean_us"] for r in runs]
            print(f"acceptance n {n}: a call's median: min {min(meds):.1f} median"
                  f" {statistics.median(meds):.1f} us; with the log's judging: min"
                  f" {min(means):.1f} median {statistics.median(means):.1f} us; over"
                  f" {len(meds)} rounds")
        return 0
    if args.repeat:
        for n in (int(x) for x in args.slots.split(",")):
            repeat_rounds(n, args.repeat)
        return 0
    if args.paired:
        for n in (int(x) for x in args.slots.split(",")):
            paired_rounds(n, args.paired, args.new_rows - 1, step_only=args.step_only,
                          forms=tuple(args.forms.split(",")) if args.forms else None)
        return 0
    if args.after_sleep:
        for ms in (float(x) for x in args.after_sleep.split(",")):
            r = bench_after_sleep(256, ms, max(20, min(200, int(2000 / max(ms, 1.0)))))
            print(f"sampled n 256, reply {ms:g} ms after the request: client {r['client_us']:.1f}"
                  " us per STEP outside the round trip")
        return 0
    if args.live:
        for tk in (0, TOP_K):
            r = bench_live(256, args.live, tk)
            print(f"live {'sampled' if tk else 'greedy':<8} n {r['n']}: client {r['client_us']:.1f}"
                  f" us per STEP outside the round trip (rtt p50 {r['rtt_p50_us'] / 1e3:.1f} ms,"
                  f" {r['steps']} STEPs)")
        return 0
    seconds = 0.1 if args.quick else 1.0
    results = []
    for sampled in (False, True):
        for n in (1, 64, 256):
            results.append(bench_step(n, sampled, seconds, args.rtt_us))
    if takes_arrays():
        for sampled in (False, True):  # entries handed over as an array
            results.append(bench_step(256, sampled, seconds, args.rtt_us, as_array=True))
    for sampled in (False, True):
        for form in ("batch", "list") if hasattr(DraftRounds, "run_batch") else ("list",):
            for n in (1, 64, 256):
                results.append(bench_rounds(n, sampled, seconds, form=form,
                                            rtt_us=args.rtt_us))
    if has_acceptance():
        for n in (64, 256):
            results.append(bench_acceptance(n, seconds))
    env = {"python": sys.version.split()[0], "numpy": np.__version__,
           "machine": platform.machine(), "cpus": os.cpu_count()}
    if args.json:
        print(json.dumps({"env": env, "results": results}, indent=2))
        return 0
    print(f"client overhead, no network (python {env['python']}, numpy {env['numpy']},"
          f" {env['cpus']} cpus)")
    if args.rtt_us:
        print(f"added: what step() adds to a {args.rtt_us:.0f} us round trip (its median less"
              " the round trip; work on the request alone runs during it)")
    print("critical: the median less the work run during the round trip (step()'s checks"
          " made ahead, the usual round's ring write)")
    print(f"{'what':<11} {'mode':<8} {'n':>4} {'median us':>10} {'p90 us':>9} {'added':>7}"
          f" {'critical':>8}  parts (median us)")
    for r in results:
        if "median_us" not in r:
            continue
        mode = "sampled" if r["sampled"] else "greedy"
        parts = ", ".join(f"{k} {v}" for k, v in r.get("parts", {}).items())
        added = f"{r['added_us']:>7.1f}" if "added_us" in r else " " * 7
        critical = f"{r['critical_us']:>8.1f}" if "critical_us" in r else " " * 8
        print(f"{r['what']:<11} {mode:<8} {r['n']:>4} {r['median_us']:>10.1f}"
              f" {r['p90_us']:>9.1f} {added} {critical}  {parts}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
