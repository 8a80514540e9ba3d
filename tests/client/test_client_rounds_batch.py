"""DraftRounds.run_batch, the array form of a round, against run, the SlotRequest form: the
same STEPs (byte for byte) and the same results on random engine histories with new requests,
accepted drafts, slots left out of rounds, releases, size-bounded rounds (deferrals, resyncs in
parts), refused rounds, cut connections and reconnects, worker RESETs (partial windows), on
greedy and sampled sessions. The worker is the scripted fake of ``client_fakes``, answering
in-process (no socket), so a history is deterministic and fast; it checks every row it gets.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from client_fakes import MAX_SLOTS, ROW_BYTES, FakeWorker, N, W, make_hello, rows_for
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dspark_client.client import RemoteDraftClient
from dspark_client.config import RemoteConfig
from dspark_client.rounds import DraftRounds, RoundResult, SlotRequest
from dspark_client.transport import TransportError
from protocol import wire

SESSION = 0x5EED


class InProcess:
    """An RpcClient whose worker is a ``FakeWorker`` handled in the caller's thread: every
    frame goes to its ``_handle`` as a socket would deliver it, and ``while_waiting`` runs
    between the two, as the socket transport runs it. ``cut`` makes the next STEP fail as a
    connection cut while sending does (nothing delivered, nothing run while waiting); ``busy``
    answers the next STEP ST_BUSY."""

    runs_while_waiting = True

    def __init__(self, fw: FakeWorker, conn_id: int, link: Link) -> None:
        self.fw, self.conn_id, self.link = fw, conn_id, link

    def connect(self, timeout: float) -> None:
        pass

    def request(self, msg: Any, buf: bytearray, timeout: float) -> int:
        return self.request_parts((msg,), buf, timeout)

    def request_parts(self, parts: Any, buf: bytearray, timeout: float, fds: Any = (),
                      while_waiting: Callable[[], None] | None = None) -> int:
        data = b"".join(bytes(memoryview(p).cast("B")) for p in parts)
        h = wire.AppHeader.unpack(data[:wire.APP_HEADER_SIZE])
        if h.op == wire.OP_STEP:
            self.link.steps.append(data)
            if self.link.cut:
                self.link.cut = False
                raise TransportError("connection cut")
        if while_waiting is not None:
            while_waiting()
        if h.op == wire.OP_STEP and self.link.busy:
            self.link.busy = False
            out = wire.frame(h.op, h.seq, h.session, b"", status=wire.ST_BUSY)
            buf[:len(out)] = out
            return len(out)
        with self.fw.lock:
            kind, payload = self.fw._handle(self.conn_id, h, data[wire.APP_HEADER_SIZE:])
        if kind != "send":
            raise TransportError(f"fake worker: {kind}")
        buf[:len(payload)] = payload
        return len(payload)

    def close(self) -> None:
        pass


@dataclass
class Link:
    """One client's way to its fake worker, and what it sent."""

    fw: FakeWorker
    steps: list[bytes] = field(default_factory=list)
    cut: bool = False
    busy: bool = False
    conns: int = 0

    def factory(self, endpoint: str) -> InProcess:
        self.conns += 1
        return InProcess(self.fw, self.conns, self)


def make_pair(sampled: bool, max_rows: int) -> tuple[tuple[Link, RemoteDraftClient,
                                                            DraftRounds], ...]:
    out = []
    for _ in range(2):
        link = Link(FakeWorker())
        client = RemoteDraftClient(
            RemoteConfig(endpoint="tcp://127.0.0.1:9", timeout_ms=1000),
            make_hello(sampled=sampled, max_rows_per_step=max_rows), background=False,
            session=SESSION, transport_factory=link.factory)
        assert client.connect_now(), client.last_error
        out.append((link, client, DraftRounds(client)))
    return tuple(out)


class History:
    """An engine's view of its slots: generation, anchor, rows committed since last handed
    over (and, for a request that hands over only its newest rows, how many it skips)."""

    def __init__(self) -> None:
        self.gen: dict[int, int] = {}
        self.anchor: dict[int, int] = {}
        self.fresh: dict[int, int] = {}

    def admit(self, slot: int, prompt: int) -> None:
        self.gen[slot] = self.gen.get(slot, 0) + 1
        self.anchor[slot] = prompt
        self.fresh[slot] = prompt

    def accept(self, slot: int, k: int) -> None:
        self.anchor[slot] += k + 1
        self.fresh[slot] += k + 1

    def requests(self, slots: list[int], n_out: list[int], skip: list[int],
                 sampling: list[tuple[int, int, float, float]] | None) -> list[SlotRequest]:
        out = []
        for j, s in enumerate(slots):
            a, g = self.anchor[s], self.gen[s]
            n = max(0, self.fresh[s] - skip[j])  # an engine may hand over only the newest rows
            self.fresh[s] = 0
            kw: dict[str, Any] = {}
            if sampling is not None:
                seed, top_k, temp, top_p = sampling[j]
                kw = dict(seed=seed, top_k=top_k, temperature=temp, top_p=top_p)
            out.append(SlotRequest(slot=s, generation=g, anchor_pos=a,
                                   anchor_token=(a * 13 + s) % 97,
                                   rows=rows_for(s, g, a - n, a) if n else None,
                                   n_out=n_out[j], **kw))
        return out


def as_batch(rounds: DraftRounds, reqs: list[SlotRequest], release: list[int],
             gaps: list[int] | None) -> RoundResult:
    """The same round through run_batch: the rows in one 2-D array, back to back, or (gaps)
    with that many junk rows before each request's (row_offsets), as an engine whose hidden
    states keep rejected positions would hand them."""
    counts = [0 if r.rows is None else len(r.rows) for r in reqs]
    parts, offsets, at = [], [], 0
    for j, r in enumerate(reqs):
        if gaps is not None:
            parts.append(np.full((gaps[j], ROW_BYTES), 0xEE, np.uint8))
            at += gaps[j]
        offsets.append(at)
        if counts[j]:
            parts.append(r.rows)
            at += counts[j]
    rows = np.concatenate(parts) if parts else None
    given = rounds.sampled or any(r.top_k or r.seed or r.temperature or r.top_p for r in reqs)
    sampled = {} if not given else dict(
        seed=[r.seed for r in reqs], top_k=[r.top_k for r in reqs],
        temperature=[r.temperature for r in reqs], top_p=[r.top_p for r in reqs])
    return rounds.run_batch(
        np.array([r.slot for r in reqs], np.int64), [r.generation for r in reqs],
        np.array([r.anchor_pos for r in reqs], np.int64), [r.anchor_token for r in reqs],
        np.array([r.n_out for r in reqs], np.int32), rows, counts,
        row_offsets=offsets if gaps is not None else None, release=np.array(release, int),
        **sampled)


FIELDS = ("ok", "reason", "resynced", "rows_sent")
ARRAYS = ("num_drafted", "status", "draft_ids", "confidence", "margin", "support_ids",
          "proposal_q")


def same_result(a: RoundResult, b: RoundResult) -> None:
    for f in FIELDS:
        assert getattr(a, f) == getattr(b, f), f
    for f in ARRAYS:
        x, y = getattr(a, f), getattr(b, f)
        assert (x is None) == (y is None), f
        if x is not None:
            assert x.dtype == y.dtype and np.array_equal(x, y), f


slot_ids = st.integers(0, MAX_SLOTS - 1)
# A round draws, from its seed: which live slots it asks for (most), which it releases (few),
# their depths, rows handed over short, sampling, and the drafts each slot accepts after it.
event = st.one_of(
    st.tuples(st.just("admit"), slot_ids, st.integers(1, 3 * W)),
    st.tuples(st.just("round"), st.integers(0, 2 ** 32)),
    st.tuples(st.just("round"), st.integers(0, 2 ** 32)),
    st.tuples(st.just("round"), st.integers(0, 2 ** 32)),
    st.tuples(st.just("cut")), st.tuples(st.just("busy")), st.tuples(st.just("reconnect")),
    st.tuples(st.just("reset_worker")),
    st.tuples(st.just("budget"), st.integers(1, 3 * W)),
)
admits = st.lists(st.tuples(st.just("admit"), slot_ids, st.integers(1, 3 * W)), min_size=1,
                  max_size=MAX_SLOTS)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sampled=st.booleans(), max_rows=st.integers(W, 4 * W), gaps=st.booleans(),
       start=admits, events=st.lists(event, min_size=1, max_size=40))
def test_batch_and_list_forms_send_and_give_the_same(
        sampled: bool, max_rows: int, gaps: bool, start: list[tuple[Any, ...]],
        events: list[tuple[Any, ...]]) -> None:
    (la, ca, ra), (lb, cb, rb) = make_pair(sampled, max_rows)
    hist = History()
    rounds_run = 0
    try:
        for ev in start + events:
            kind = ev[0]
            if kind == "admit":
                hist.admit(ev[1], ev[2])
            elif kind == "cut":
                la.cut = lb.cut = True
            elif kind == "busy":
                la.busy = lb.busy = True
            elif kind == "reconnect":
                for c in (ca, cb):
                    if c.connection_epoch() is None:
                        assert c.connect_now(), c.last_error
            elif kind == "reset_worker":
                for c in (ca, cb):
                    if c.connection_epoch() is not None:
                        assert c.simple_request(wire.OP_RESET, wire.pack_reset([]))[0] == 0
            elif kind == "budget":
                ra.row_budget = rb.row_budget = min(ev[1], max_rows)  # as size refusals do
            elif kind == "round":
                rng = np.random.default_rng(ev[1])
                if rng.random() < 0.5:  # the connect thread's reconnect, in the history
                    for c in (ca, cb):
                        if c.connection_epoch() is None:
                            assert c.connect_now(), c.last_error
                live = sorted(hist.gen)
                slots = [s for s in rng.permutation(live).tolist() if rng.random() < 0.8]
                release = [s for s in live if rng.random() < 0.1]
                n_out = rng.integers(0, N + 1, len(slots)).tolist()
                skip = [int(x) if rng.random() < 0.2 else 0 for x in rng.integers(0, 4, len(slots))]
                sampling = None
                if sampled:
                    sampling = [(int(rng.integers(0, 2 ** 63)), int(rng.choice([0, 1, 4, 32])),
                                 float(rng.uniform(0.3, 2.0)), float(rng.choice([0.0, 0.9, 1.0])))
                                for _ in slots]
                reqs = hist.requests(slots, n_out, skip, sampling)
                with_rows = [j for j, r in enumerate(reqs) if r.rows is not None]
                if with_rows and rng.random() < 0.25:
                    # One request's rows as a strided view: run copies the round's rows
                    # before the send instead of sending each request's array.
                    j = with_rows[int(rng.integers(len(with_rows)))]
                    reqs[j].rows = np.repeat(reqs[j].rows, 2, axis=0)[::2]
                gap = rng.integers(0, 3, len(slots)).tolist() if gaps else None
                res_a = ra.run(reqs, release=release)
                res_b = as_batch(rb, reqs, release, gap)
                same_result(res_a, res_b)
                for s in release:
                    if s not in slots:
                        hist.gen.pop(s), hist.anchor.pop(s), hist.fresh.pop(s)
                for s in slots:  # the target verified: the anchor and some drafts commit
                    if s in hist.gen:
                        hist.accept(s, int(rng.integers(0, N)))
                rounds_run += 1
        assert la.steps == lb.steps  # every STEP, byte for byte, seq and step_id included
        assert la.fw.errors == [] and lb.fw.errors == []
        sa, sb = ca.stats.snapshot(), cb.stats.snapshot()
        for key in set(sa) | set(sb):
            if not key.endswith("us_total") and key != "rtt_seconds":
                assert sa.get(key) == sb.get(key), key
        assert np.array_equal(ra.ring.start, rb.ring.start)
        assert np.array_equal(ra.ring.end, rb.ring.end)
        for s in range(MAX_SLOTS):
            a, e = ra.ring.held(s)
            assert np.array_equal(ra.ring.rows(s, e, e - a), rb.ring.rows(s, e, e - a))
    finally:
        for link, c in ((la, ca), (lb, cb)):
            c.close()
            link.fw.close()


BAD: list[tuple[dict[str, Any], str]] = [
    (dict(slot=99), "slot 99 outside"),
    (dict(slot=-1), "slot -1 outside"),
    (dict(n_out=N + 1), f"slot 0: n_out {N + 1} outside"),
    (dict(generation=-2), "slot 0: generation -2 < 0"),
    (dict(anchor_pos=2 ** 32), r"slot 0: anchor_pos 4294967296 outside \[0, 2\*\*32\)"),
    (dict(anchor_token=2 ** 40), "slot 0: anchor_token 1099511627776 outside"),
    (dict(top_k=4, temperature=1.0), "slot 0: sampling fields on a greedy session"),
    (dict(rows=np.zeros((9, ROW_BYTES), np.uint8)),
     "slot 0: 9 rows but anchor_pos 8; rows exist only before the anchor"),
]


@pytest.mark.parametrize("bad, words", BAD)
def test_both_forms_refuse_alike_and_send_nothing(bad: dict[str, Any], words: str) -> None:
    """The engine's mistakes raise the same message, naming the slot, from either form, and
    change nothing: the next good round is the one it would have been."""
    (la, ca, ra), (lb, cb, rb) = make_pair(False, 4 * W)
    try:
        good = SlotRequest(slot=1, generation=1, anchor_pos=5, anchor_token=3,
                           rows=rows_for(1, 1, 0, 5), n_out=N)
        args: dict[str, Any] = dict(slot=0, generation=1, anchor_pos=8, anchor_token=1,
                                    rows=rows_for(0, 1, 0, 8), n_out=N)
        args.update(bad)
        reqs = [good, SlotRequest(**args)]
        errors = []
        for call in (lambda: ra.run(reqs), lambda: as_batch(rb, reqs, [], None)):
            with pytest.raises(ValueError, match=words) as info:
                call()
            errors.append(str(info.value))
        assert errors[0] == errors[1]
        assert la.steps == lb.steps == []
        assert ra.ring.held(1) == rb.ring.held(1) == (0, 0)
        same_result(ra.run([good]), as_batch(rb, [good], [], None))
        assert la.steps == lb.steps
    finally:
        for link, c in ((la, ca), (lb, cb)):
            c.close()
            link.fw.close()


def spy_parts(client: RemoteDraftClient) -> list[Any]:
    """The parts of every frame the client's transport is given from now on."""
    seen: list[Any] = []
    conn: Any = client.link.conn
    real = conn.request_parts

    def spy(parts: Any, buf: bytearray, timeout: float, **kw: Any) -> int:
        seen.append(parts)
        return int(real(parts, buf, timeout, **kw))

    conn.request_parts = spy
    return seen


def test_usual_round_sends_the_engines_rows_as_they_are() -> None:
    """Every slot continuing with its new rows, back to back: the STEP's rows part is the
    engine's own array (no staging copy); one of them resyncing: gathered into staging."""
    (la, ca, _), (lb, cb, rb) = make_pair(False, 4 * W)
    try:
        seen = spy_parts(cb)
        slots = np.array([0, 1, 2])
        first = np.concatenate([rows_for(s, 1, 0, 6) for s in range(3)])
        assert rb.run_batch(slots, 1, 6, 7, N, first, [6, 6, 6]).ok
        assert np.shares_memory(seen[-1][1], rb.staging)  # resyncs: from the ring
        new = np.concatenate([rows_for(s, 1, 6, 8) for s in range(3)])
        res = rb.run_batch(slots, 1, 8, 7, N, new, [2, 2, 2])
        assert res.ok and res.resynced == 0 and res.rows_sent == 6
        assert np.shares_memory(seen[-1][1], new) and not np.shares_memory(seen[-1][1],
                                                                           rb.staging)
        assert np.array_equal(rb.ring.rows(2, 8, 8), rows_for(2, 1, 0, 8))
        # The ring takes a usual round's rows while the reply is on its way; a STEP cut off
        # before that still leaves them there, and the resync after the reconnect sends them.
        lb.cut = True
        new = np.concatenate([rows_for(s, 1, 8, 11) for s in range(3)])
        res = rb.run_batch(slots, 1, 11, 7, N, new, 3)
        assert not res.ok and res.reason == "transport_error"
        assert np.array_equal(rb.ring.rows(1, 11, W), rows_for(1, 1, 11 - W, 11))
        assert cb.connect_now()
        res = rb.run_batch(slots, 1, 11, 7, N)
        assert res.ok and res.resynced == 3 and res.rows_sent == 3 * W
        assert lb.fw.errors == []
    finally:
        for link, c in ((la, ca), (lb, cb)):
            c.close()
            link.fw.close()


def test_list_form_sends_the_requests_rows_as_they_are() -> None:
    """``run`` over a socket (no shared region): the STEP's rows are the requests' own arrays,
    one part each, and the ring takes them while the reply is on its way; a request whose
    rows are a strided view is copied instead, and either way the STEP is the batch form's."""
    (la, ca, ra), (lb, cb, rb) = make_pair(False, 4 * W)
    try:
        seen = spy_parts(ca)

        def reqs(a: int, b: int, strided: bool = False) -> list[SlotRequest]:
            out = []
            for s in range(3):
                rows = rows_for(s, 1, a, b)
                if strided and s == 1:  # the same rows, every other row of a larger array
                    rows = np.repeat(rows, 2, axis=0)[::2]
                if s == 2 and b > 6:  # asks for drafts again at its anchor, with no new rows
                    out.append(SlotRequest(slot=s, generation=1, anchor_pos=6, anchor_token=7,
                                           n_out=N))
                    continue
                out.append(SlotRequest(slot=s, generation=1, anchor_pos=b, anchor_token=7,
                                       rows=rows, n_out=N))
            return out

        for a, b, strided in ((0, 6, False), (6, 8, False), (8, 10, True)):
            got = reqs(a, b, strided)
            same_result(ra.run(got), as_batch(rb, reqs(a, b, strided), [], None))
            assert la.steps[-1] == lb.steps[-1]
        # The second round: each slot continues, slot 2 without rows; the parts are the
        # requests' arrays themselves.
        parts = seen[1][1:]
        assert len(parts) == 2 and all(not np.shares_memory(p, ra.staging) for p in parts)
        assert all(np.array_equal(p, rows_for(s, 1, 6, 8)) for s, p in enumerate(parts))
        # The third: the strided rows of slot 1 were copied, so the rows went out joined.
        assert len(seen[2]) == 2
        for s, end in ((0, 10), (1, 10), (2, 6)):
            held = min(W, end)
            assert np.array_equal(ra.ring.rows(s, end, held), rows_for(s, 1, end - held, end))
        assert la.fw.errors == [] and lb.fw.errors == []
    finally:
        for link, c in ((la, ca), (lb, cb)):
            c.close()
            link.fw.close()


def test_list_form_rows_in_staging_out_of_order() -> None:
    """Requests whose rows are views of ``staging`` itself, in another order than the
    requests: joining them there would overwrite some before they are read, so they are
    joined elsewhere, and the STEP and the ring hold the right rows."""
    (la, ca, ra), (lb, cb, rb) = make_pair(False, 4 * W)
    try:
        for a, b in ((0, 6), (6, 8)):
            k = b - a
            for s in range(3):  # slot s's rows at staging rows [(2 - s) * k, (3 - s) * k)
                ra.staging[(2 - s) * k:(3 - s) * k] = rows_for(s, 1, a, b)
            reqs = [SlotRequest(slot=s, generation=1, anchor_pos=b, anchor_token=7,
                                rows=ra.staging[(2 - s) * k:(3 - s) * k], n_out=N)
                    for s in range(3)]
            same_result(ra.run(reqs), as_batch(rb, [SlotRequest(
                slot=s, generation=1, anchor_pos=b, anchor_token=7, rows=rows_for(s, 1, a, b),
                n_out=N) for s in range(3)], [], None))
            assert la.steps[-1] == lb.steps[-1]
        for s in range(3):
            assert np.array_equal(ra.ring.rows(s, 8, 8), rows_for(s, 1, 0, 8))
        assert la.fw.errors == []
    finally:
        for link, c in ((la, ca), (lb, cb)):
            c.close()
            link.fw.close()


def test_batch_form_checks_its_arrays() -> None:
    (la, ca, _), (lb, cb, rb) = make_pair(False, 4 * W)
    try:
        rows = rows_for(0, 1, 0, 4)
        cases: list[tuple[Callable[[], Any], str]] = [
            (lambda: rb.run_batch([0], 1, 4, 1, N, rows, [3]), "n_rows add up to 3 rows, 4 given"),
            (lambda: rb.run_batch([0], 1, 4, 1, N, rows.astype(np.uint16), [4]), "uint8 array"),
            (lambda: rb.run_batch([0, 1], [1], 4, 1, N, rows, [4, 0]),
             r"generation has shape \(1,\), expected \(2,\)"),
            (lambda: rb.run_batch([0], 1, 4, 1, N, rows, [4], row_offsets=[1]),
             r"slot 0: rows \[1, 5\) outside the 4 rows given"),
            (lambda: rb.run_batch([0.5], 1, 4, 1, N, rows, [4]), "slots must be integers"),
            (lambda: rb.run_batch([0], 1, 4, 1, N, rows, [-4]), "row counts are >= 0"),
            (lambda: rb.run_batch([0], 1, 4, 1, N, rows, [4], release=[8]), "slot 8 outside"),
        ]
        for call, words in cases:
            with pytest.raises(ValueError, match=words):
                call()
        assert lb.steps == [] and rb.ring.held(0) == (0, 0)
    finally:
        for link, c in ((la, ca), (lb, cb)):
            c.close()
            link.fw.close()
