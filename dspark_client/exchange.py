"""The exchange: one STEP on the link's current connection, and every reply check of the
contract (docs/contract.md sections 6.3, 7.5 and 9; 13 for rows in shared memory).

``StepExchange.step`` takes a ready connection, its session and its epoch from the link
(``WorkerLink.connection``), packs the STEP's headers and entries, takes the next seq
(``WorkerLink.take_seq``, which refuses when the link left that connection meanwhile), sends
[headers, rows] and checks the reply. It owns the seq's use, the packing, the send, the reply
buffer and the sampled checks' scratch, and nothing about connecting: what a reply or a refusal
means for the link it says through the link's methods (``mark_failed``, ``disable``,
``drained``, ``reply_failed``, ``replies_recovered``, ``newer_drafter``), never by touching
its fields.

Locks. A STEP runs under the link's ``io_lock`` (one request at a time on the connection),
taken after the packing and counted against the round's deadline; ``take_seq`` then takes the
link's ``lock`` for one read and one increment. The reply buffer and the scratch arrays are
used only under ``io_lock``. Nothing here waits past ``timeout_ms``.

Replies. A STEP reply is accepted only if it echoes op, session, seq, step_id and every
generation; its shape matches the STEP; its values keep section 6.3
(``protocol.validate.check_reply_values``); and, on a sampled session, its proposals keep
section 9.2 and every draw re-derives from (seed, generation, position) (section 9.3; both in
one pass, ``protocol.sampled.check_reply``). What the checks need of the request alone is
made while the reply is on its way (``_Ahead``). A refused reply fails the round: the
connection is dropped and every slot of the STEP resyncs. A fatal frame status (section 5)
disables remote drafting for the engine run, except ST_BAD_FRAME on a STEP over
``SIZE_SUSPECT_BYTES``, which may be the worker's frame limit: that round fails and
``DraftRounds`` lowers its row budget. ST_NO_SESSION and ST_STALE_SEQ HELLO again at once,
ST_DRAINING moves to the next worker at once, ST_INTERNAL HELLOs again after a backoff,
ST_BUSY fails the round alone.

Reply arrays of an outcome are numpy views over the exchange's reply buffer: they stay valid
until the next ``step()``.
"""

from __future__ import annotations

import logging
import math
import operator
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final, cast

import numpy as np
import numpy.typing as npt

from protocol import wire
from protocol.constants import STEP_HEADER_SIZE
from protocol.messages import ENTRY_DTYPE, SampleMeta, reply_layout
from protocol.sampled import ReplyCheck, Scratch
from protocol.shm import ROWS_ALIGN, set_rows_at
from protocol.validate import ValuesAhead, check_reply_values

from .acceptance import ClientAcceptance
from .config import RemoteConfig
from .link import CONNECT_FAIL_LOG_S, WorkerLink
from .metrics import RTT_KEY, STEP_RTT_BUCKETS
from .stats import Stats
from .transport import RpcClient, TransportError, TransportTimeout, WaitingRpcClient

__all__ = ["SIZE_SUSPECT_BYTES", "StepExchange", "StepOutcome"]

log = logging.getLogger("dspark_client")

# A STEP body above this may be refused for its size alone (a worker's --max-frame-bytes is never
# below 64 KiB): ST_BAD_FRAME on such a STEP fails the round instead of disabling the client,
# and DraftRounds lowers its row budget after repeated ones (7.5).
SIZE_SUSPECT_BYTES: Final = 64 << 10
_ENTRIES_AT: Final = wire.APP_HEADER_SIZE + STEP_HEADER_SIZE  # entries' offset in a STEP frame
_USABLE: Final = np.isin(np.arange(256), sorted(wire.USABLE_REQ_STATUS))  # by status (u8)


@dataclass
class StepOutcome:
    """What one STEP gave. ``ok``: ``reply`` passed every check, and ``drafted[i]`` is how
    many positions entry i carries (``k`` of section 6.3). Not ok: ``reason`` is a short
    counter key; ``unknown_apply`` means the worker may have applied the STEP without us
    knowing (timeout, transport error, refused reply), so every slot in it must resync."""

    ok: bool
    reply: wire.StepReply | None = None
    reason: str | None = None
    rtt_us: float = 0.0
    unknown_apply: bool = False
    drafted: npt.NDArray[np.int64] | None = None
    status: int = wire.ST_OK  # the frame status when the worker answered one


class _Ahead:
    """What the reply's checks need of the request alone, for one STEP: the 6.3 side
    (``protocol.validate.ValuesAhead``) and, on a sampled session, the draws' side
    (``protocol.sampled.ReplyCheck``: every position's u); and the acceptance the STEP's
    entries show (``ClientAcceptance.step_sent``). Made when called: the transport
    calls it once the STEP is sent, while the reply is on its way. Should that fail or not
    happen, the checks make their parts when the reply is in (raising there)."""

    __slots__ = ("also", "asked", "draws", "exchange", "sent", "values")

    def __init__(self, exchange: StepExchange, sent: np.ndarray,
                 also: Callable[[], None] | None = None) -> None:
        self.exchange, self.sent, self.also = exchange, sent, also
        self.values: ValuesAhead | None = None
        self.draws: ReplyCheck | None = None
        self.asked: np.ndarray | None = None

    def __call__(self) -> None:
        # The STEP's entries judge the blocks of the rounds before (they need no reply).
        self.exchange.acceptance.step_sent(self.sent)
        try:
            self.values = ValuesAhead(self.sent, self.exchange.hello.num_spec,
                                      self.exchange.hello.window)
            if self.exchange.sampled:
                self.draws = self._draws()
        except Exception:  # made again, and raised, where the reply is checked
            self.values = self.draws = None
        if self.also is not None:  # the caller's own work for the round trip (step())
            self.also()

    def sampled_check(self) -> tuple[ReplyCheck, np.ndarray | None]:
        """The draws' check, and per entry whether it asked for a draft (None: every one)."""
        if self.draws is None:
            self.draws = self._draws()
        return self.draws, self.asked

    def _draws(self) -> ReplyCheck:
        s, hello = self.sent, self.exchange.hello
        if self.values is not None and self.values.usual:  # every entry asks for all N
            self.asked = n_out = None
        else:
            self.asked = (s["flags"] & wire.RF_NEED_DRAFT) != 0
            n_out = s["n_out"]
        return ReplyCheck(s["seed"], s["generation"], s["anchor_pos"], s["top_k"],
                          hello.num_spec, hello.vocab_size, asked=self.asked, n_out=n_out,
                          scratch=self.exchange.scratch)


_NBYTES: Final = operator.attrgetter("nbytes")


def _nbytes(rows: Any) -> int:
    """The bytes of ``step()``'s rows: one buffer, or a list of arrays."""
    if isinstance(rows, list):
        return sum(map(_NBYTES, rows))
    return rows.nbytes if hasattr(rows, "nbytes") else len(rows)


class StepExchange:
    """One STEP at a time on the link's current connection, with every reply check of the
    contract. ``stats`` and ``acceptance`` are shared with the link (``RemoteDraftClient``
    makes all three)."""

    def __init__(self, link: WorkerLink, cfg: RemoteConfig, hello: wire.Hello, stats: Stats,
                 acceptance: ClientAcceptance) -> None:
        self.link, self.cfg, self.hello = link, cfg, hello
        self.stats, self.acceptance = stats, acceptance
        self.sampled = hello.sample_mode == wire.SAMPLE_TOP32
        self.scratch = Scratch()  # the sampled checks' arrays; used under the link's io_lock
        self._resp = bytearray(self._step_reply_bytes())  # used under the link's io_lock
        self._no_session_logged = -math.inf

    def _step_reply_bytes(self) -> int:
        """The largest STEP reply of this session's geometry (a release entry per extra slot
        is not possible: slots are distinct, so n_req <= max_slots)."""
        flags = wire.RPF_MARGIN | (wire.RPF_SAMPLED if self.sampled else 0)
        return wire.APP_HEADER_SIZE + reply_layout(self.hello.max_slots, self.hello.num_spec,
                                                   flags).size

    # -- STEP -------------------------------------------------------------------------------------
    def step(
        self,
        buf: bytearray | memoryview,
        entries: Sequence[wire.ReqEntry] | npt.NDArray[Any],
        n_rows: int,
        step_id: int,
        step_flags: int = 0,
        epoch: int | None = None,
        rows: Any = None,
        sample_meta: list[SampleMeta] | None = None,
        while_waiting: Callable[[], None] | None = None,
    ) -> StepOutcome:
        """Send one STEP and check its reply.

        Without ``rows``: ``buf`` is writable and its rows already sit at
        ``wire.APP_HEADER_SIZE + wire.rows_offset_for(len(entries))``; the headers are written
        in front of them and the frame goes out as one buffer. With ``rows`` (``n_rows x
        row_bytes`` bytes, C-contiguous, e.g. a numpy view of a staging buffer, or a list of
        such arrays whose bytes, back to back, are the rows): ``buf`` takes only the headers
        and entries, and the frame goes out as [headers, rows...] with scatter-gather, so the
        rows are neither copied nor written to.

        ``epoch``: the connection epoch the entries were built for; when the connection is
        newer the STEP is not sent (reason "reconnected": its slots were never resynced).
        ``sample_meta``: per entry ``(seed, top_k, temperature, top_p)``, overriding the
        entries' sampling fields. ``entries`` may also be a one-dimensional
        ``wire.ENTRY_DTYPE`` array (``wire.pack_step_prefix``), copied in whole.
        ``while_waiting``: the caller's own work for the round trip (it needs no reply), run
        once the STEP is sent; it must not raise. It is not run when the STEP is not sent, so
        the caller checks."""
        link = self.link
        if link.disabled_reason is not None or link.forked():
            return StepOutcome(False, reason="disabled")
        conn, session, conn_epoch = link.connection()
        if conn is None:
            return StepOutcome(False, reason="not_ready")
        if epoch is not None and conn_epoch != epoch:
            return StepOutcome(False, reason="reconnected")
        hello = self.hello
        row_bytes = hello.row_bytes
        n = len(entries)
        if n > hello.max_slots:
            raise ValueError(f"{n} entries, more than max_slots {hello.max_slots}")
        timeout = self.cfg.timeout_ms / 1000.0
        t_start = time.perf_counter()
        ro = wire.pack_step_prefix(buf, wire.APP_HEADER_SIZE, step_id,
                                   entries if isinstance(entries, (list, np.ndarray))
                                   else list(entries),
                                   n_rows, row_bytes, step_flags, sample_meta=sample_meta)
        body_len = ro + n_rows * row_bytes
        shm_at = self._rows_at(conn, rows, n_rows * row_bytes) if n_rows else None
        if shm_at is not None:  # section 13: the rows stay where they are, the prefix travels
            set_rows_at(buf, wire.APP_HEADER_SIZE, shm_at)
            body_len = ro
            parts: tuple[Any, ...] = (memoryview(buf)[:wire.APP_HEADER_SIZE + ro],)
        elif rows is None:
            if len(buf) < wire.APP_HEADER_SIZE + body_len:
                raise ValueError(f"buffer of {len(buf)} bytes cannot hold a"
                                 f" {wire.APP_HEADER_SIZE + body_len}-byte STEP")
            parts = (memoryview(buf)[:wire.APP_HEADER_SIZE + body_len],)
        else:
            nbytes = _nbytes(rows)
            if nbytes != n_rows * row_bytes:
                raise ValueError(f"rows hold {nbytes} bytes, {n_rows} rows of {row_bytes}"
                                 f" need {n_rows * row_bytes}")
            head = memoryview(buf)[:wire.APP_HEADER_SIZE + ro]
            parts = (head, *rows) if isinstance(rows, list) else (head, rows)
        # The entries as sent, read back through the protocol's dtype: echo and draw checks
        # use these columns without a Python loop over the entries.
        sent = np.frombuffer(buf, dtype=ENTRY_DTYPE, count=n, offset=_ENTRIES_AT)
        if not link.io_lock.acquire(timeout=timeout):
            return StepOutcome(False, reason="local_busy")
        # One deadline for the round: waiting for the connection counts against it.
        timeout -= time.perf_counter() - t_start
        try:
            if timeout <= 0:
                return StepOutcome(False, reason="local_busy")
            seq = link.take_seq(conn, session)  # None: the link left it while we packed
            if seq is None:
                return StepOutcome(False, reason="not_ready")
            wire.AppHeader(op=wire.OP_STEP, seq=seq, session=session,
                           body_len=body_len).pack_into(buf, 0)
            # What the reply's checks need of the request alone is computed while the reply
            # is on its way, where the transport offers that.
            ahead = _Ahead(self, sent, while_waiting)
            t0 = time.perf_counter()
            try:
                if getattr(conn, "runs_while_waiting", False):
                    size = cast(WaitingRpcClient, conn).request_parts(
                        parts, self._resp, timeout, while_waiting=ahead)
                else:
                    ahead()
                    if len(parts) == 1:
                        size = conn.request(parts[0], self._resp, timeout)
                    else:
                        size = conn.request_parts(parts, self._resp, timeout)
            except TransportTimeout:
                self.stats.inc("step_timeouts")
                link.mark_failed("STEP timed out")
                return StepOutcome(False, reason="timeout", unknown_apply=True,
                                   rtt_us=(time.perf_counter() - t0) * 1e6)
            except TransportError as e:
                self.stats.inc("step_transport_errors")
                link.mark_failed(f"STEP transport: {e}")
                return StepOutcome(False, reason="transport_error", unknown_apply=True,
                                   rtt_us=(time.perf_counter() - t0) * 1e6)
            rtt_us = (time.perf_counter() - t0) * 1e6
            out = self._check_step_reply(size, seq, session, step_id, entries, sent, rtt_us,
                                         body_len, ahead)
            good: tuple[float, float, float] | None = None
            if out.ok and out.reply is not None:
                self.acceptance.reply_in(out.drafted, out.reply.confidence)
                if out.reply.flags & wire.RPF_NEWER_DRAFTER:
                    link.newer_drafter()  # the connect thread follows it
                if link.failing_replies:
                    link.replies_recovered()
                good = (rtt_us, out.reply.worker_us,
                        (time.perf_counter() - t_start) * 1e6 - rtt_us)
            self.stats.step_answered(wire.APP_HEADER_SIZE + body_len, size, shm_at is not None,
                                     good, (RTT_KEY, rtt_us * 1e-6, STEP_RTT_BUCKETS))
            return out
        finally:
            link.io_lock.release()

    def _rows_at(self, conn: RpcClient, rows: Any, nbytes: int) -> int | None:
        """Where this STEP's rows lie in the region when the connection takes them from there
        (copied in first when the caller's rows are elsewhere), else None."""
        region = self.link.shm_region
        if region is None or rows is None or not self.link.rows_in_shm_on(conn):
            return None
        have = _nbytes(rows)
        if have != nbytes:
            raise ValueError(f"rows hold {have} bytes, the STEP needs {nbytes}")
        at = None if isinstance(rows, list) else region.offset_of(rows)
        if at is None or at % ROWS_ALIGN:
            filled = 0  # bytes copied to the region's start so far
            for part in rows if isinstance(rows, list) else (rows,):
                src = (part.reshape(-1).view(np.uint8) if isinstance(part, np.ndarray)
                       else np.frombuffer(memoryview(part).cast("B"), np.uint8))
                region.array[filled:filled + len(src)] = src
                filled += len(src)
            self.stats.inc("shm_rows_copied")
            at = 0
        return at

    def _check_step_reply(self, size: int, seq: int, session: int, step_id: int,
                          entries: Sequence[wire.ReqEntry] | npt.NDArray[Any],
                          sent: np.ndarray, rtt_us: float, body_len: int = 0,
                          ahead: _Ahead | None = None) -> StepOutcome:
        hello = self.hello
        try:
            h, body = wire.split_frame(memoryview(self._resp)[:size])
            if h.op != wire.OP_STEP or h.seq != seq or h.session != session:
                raise wire.WireError(f"reply echoes op={h.op} seq={h.seq} session="
                                     f"{h.session:#x}; sent op={wire.OP_STEP} seq={seq}"
                                     f" session={session:#x}")
        except wire.WireError as e:
            return self._bad_reply(e, rtt_us)
        if h.status == wire.ST_BAD_FRAME and body_len > SIZE_SUSPECT_BYTES:
            # Possibly its size alone (the worker's frame limit): not a reason to stop for the
            # engine run yet. The worker closes the connection after a too-large frame.
            self.stats.inc("step_frame_bad_frame")
            log.warning("remote DSpark: STEP of %d bytes refused BAD_FRAME (over the worker's"
                        " frame limit?)", wire.APP_HEADER_SIZE + body_len)
            self.link.mark_failed(f"STEP of {wire.APP_HEADER_SIZE + body_len} bytes refused"
                             " BAD_FRAME")
            return StepOutcome(False, reason="frame_bad_frame_size", rtt_us=rtt_us,
                               status=h.status)
        if h.status != wire.ST_OK:
            return self._refused(h.status, rtt_us)
        try:
            reply = wire.StepReply.unpack(body, expect_n_req=len(entries),
                                          expect_num_spec=hello.num_spec)
            if reply.step_id != step_id:
                raise wire.WireError(f"reply step_id {reply.step_id} != sent {step_id}",
                                     field="step_id", value=reply.step_id, limit=step_id)
            if reply.flags & wire.RPF_NO_CONFIDENCE != self.link.reply_no_confidence:
                raise wire.WireError(
                    f"reply flags {reply.flags:#x}: RPF_NO_CONFIDENCE disagrees with the"
                    f" worker's HELLO (has_confidence {self.link.has_confidence})", field="flags",
                    value=reply.flags)
            if self.sampled:
                self._check_sampled(reply, sent, ahead)
            elif reply.support_ids is not None:
                raise wire.WireError("sampled arrays in a reply on a greedy session",
                                     field="flags", value=reply.flags)
            # The packed entries, not the objects: the check runs vectorised over them, and it
            # covers the generation echo (6.3).
            if ahead is not None and ahead.values is not None:
                drafted = ahead.values.check(reply, hello.vocab_size)
            else:
                drafted = check_reply_values(reply, sent, vocab_size=hello.vocab_size,
                                             window=hello.window)
        except wire.WireError as e:
            return self._bad_reply(e, rtt_us)
        return StepOutcome(True, reply=reply, rtt_us=rtt_us, drafted=drafted)

    def _check_sampled(self, reply: wire.StepReply, sent: np.ndarray,
                       ahead: _Ahead | None = None) -> None:
        mask, sup, q = reply.sampled_mask, reply.support_ids, reply.proposal_q
        if mask is None or sup is None or q is None:
            raise wire.WireError("sampled session reply without sampled q; refusing its drafts",
                                 field="flags", value=reply.flags)
        try:
            check, asked = (ahead or _Ahead(self, sent)).sampled_check()
            usable = _USABLE[reply.status]
            check.check(mask, sup, q, reply.draft_ids, usable if asked is None else asked & usable)
        except wire.WireError:
            raise
        except ValueError as exc:  # shape errors of the caller's arrays
            raise wire.WireError(str(exc)) from exc

    def _bad_reply(self, e: wire.WireError, rtt_us: float) -> StepOutcome:
        self.stats.inc("bad_replies")
        self.stats.set("last_bad_reply", str(e))
        log.warning("remote DSpark: STEP reply refused (round fails, slots resync): %s", e)
        self.link.reply_failed()
        self.link.mark_failed(f"bad reply: {e}")
        return StepOutcome(False, reason="bad_reply", rtt_us=rtt_us, unknown_apply=True)

    def _refused(self, status: int, rtt_us: float) -> StepOutcome:
        name = wire.FRAME_STATUS_NAMES.get(status, str(status))
        link = self.link
        self.stats.inc(f"step_frame_{name.lower()}")
        if status in wire.FATAL_FRAME_STATUS:
            link.disable(f"STEP refused: {name}")
        elif status in (wire.ST_NO_SESSION, wire.ST_STALE_SEQ):
            # Not applied; a fresh HELLO on a new connection fixes the session at once.
            now = time.monotonic()
            if now - self._no_session_logged >= CONNECT_FAIL_LOG_S:
                self._no_session_logged = now
                log.warning("remote DSpark: STEP refused %s: the worker no longer holds session"
                            " %#010x on this connection (dropped by its idle time, a GOODBYE,"
                            " or a HELLO elsewhere under client name %r); HELLO again and"
                            " resync (one line per %g s)", name, link.session,
                            self.hello.client_name, CONNECT_FAIL_LOG_S)
            link.mark_failed(f"STEP refused: {name}", backoff=False)
        elif status == wire.ST_DRAINING:
            # Not applied; the worker is going away: the connect thread holds it off and
            # connects to the next-ranked worker at once (no backoff, not a failure).
            link.drained(f"STEP refused: {name}")
        elif status == wire.ST_INTERNAL:
            # The worker dropped the session; HELLO again, after a backoff delay so that a
            # worker failing every STEP is not hammered.
            link.reply_failed()
            link.mark_failed(f"STEP refused: {name}")
        elif status not in wire.FRAME_STATUS_NAMES:
            link.mark_failed(f"STEP answered unknown status {status}")
            return StepOutcome(False, reason="bad_reply", rtt_us=rtt_us, unknown_apply=True,
                               status=status)
        # ST_BUSY: not applied, connection fine; the round fails and the slots resync.
        return StepOutcome(False, reason=f"frame_{name.lower()}", rtt_us=rtt_us,
                           unknown_apply=False, status=status)

