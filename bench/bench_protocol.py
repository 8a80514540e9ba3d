"""Microseconds per call of the protocol's hot-path functions (N = 7).

    python bench/bench_protocol.py [--repeat 2000]

Measures, for n = 1, 64 and 256 entries with 4 rows each of 128 bytes:
  pack_step_prefix                       (client: headers in front of staged rows)
  decode_step + check_step_shape         (worker: zero-copy views and the 7.2 step 3 rules)
  StepReply.into + fill + finish         (worker: reply encoded in a reused buffer)
  StepReply.unpack + check_reply_values  (client: views and the 6.3 value rules, with the
                                         entries as objects or as the packed STEP entries)
and checks that the decoded rows view shares memory with the frame (no copy of the rows).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np

from protocol import wire
from protocol.messages import decode_step
from protocol.validate import check_reply_values, check_step_shape

N = 7
ROW_BYTES = 128
ROWS_PER_ENTRY = 4


def per_call_us(fn: Callable[[], object], repeat: int) -> float:
    """Median over 5 rounds of the mean time per call."""
    for _ in range(min(repeat, 200)):
        fn()
    rounds = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(repeat):
            fn()
        rounds.append((time.perf_counter() - t0) / repeat * 1e6)
    return statistics.median(rounds)


def bench(n: int, repeat: int) -> dict[str, float]:
    entries = [wire.ReqEntry(slot=i, generation=3, anchor_pos=100 + i, anchor_token=7,
                             n_rows=ROWS_PER_ENTRY, n_out=N, flags=wire.RF_NEED_DRAFT)
               for i in range(n)]
    n_rows = n * ROWS_PER_ENTRY
    ro = wire.rows_offset_for(n)
    body_len = ro + n_rows * ROW_BYTES
    buf = bytearray(wire.APP_HEADER_SIZE + body_len)
    pattern = np.arange(n_rows * ROW_BYTES, dtype=np.uint32).astype(np.uint8)
    start = wire.APP_HEADER_SIZE + ro
    buf[start:] = pattern.tobytes()

    def pack() -> None:
        wire.pack_step_prefix(buf, wire.APP_HEADER_SIZE, 1, entries, n_rows, ROW_BYTES, 0)

    pack()
    body = memoryview(buf)[wire.APP_HEADER_SIZE:]

    def decode() -> None:
        view = decode_step(body)
        check_step_shape(view, row_bytes=ROW_BYTES, max_slots=1024, max_rows_per_step=1 << 16,
                         num_spec=N, sampled=False)

    view = decode_step(body)
    if not np.shares_memory(view.rows, np.frombuffer(buf, dtype=np.uint8)):
        raise SystemExit("decode_step copied the rows region")
    if bytes(view.rows.reshape(-1)) != pattern.tobytes():
        raise SystemExit("pack_step_prefix touched the rows region")

    out = bytearray(wire.APP_HEADER_SIZE + (1 << 20))
    rng = np.random.default_rng(0)
    drafts = rng.integers(0, 1000, size=(n, N), dtype=np.int32)
    conf = rng.random((n, N), dtype=np.float32)

    def encode() -> None:
        r = wire.StepReply.into(out, wire.APP_HEADER_SIZE, 1, n, N, wire.RPF_MARGIN)
        r.status[:] = wire.RS_OK
        r.window_rows[:] = 100
        r.generation[:] = 3
        r.draft_ids[:] = drafts
        r.confidence[:] = conf
        assert r.margin is not None
        r.margin[:] = conf
        r.finish(10)

    encode()
    size = wire.StepReply.into(out, wire.APP_HEADER_SIZE, 1, n, N, wire.RPF_MARGIN).size
    encode()
    reply_body = bytes(out[wire.APP_HEADER_SIZE:wire.APP_HEADER_SIZE + size])

    def unpack() -> None:
        reply = wire.StepReply.unpack(reply_body, expect_n_req=n, expect_num_spec=N)
        check_reply_values(reply, entries, vocab_size=1000, window=100)

    packed = np.frombuffer(buf, dtype=wire.ENTRY_DTYPE, count=n,
                           offset=wire.APP_HEADER_SIZE + wire.STEP_HEADER_SIZE)

    def unpack_packed() -> None:
        reply = wire.StepReply.unpack(reply_body, expect_n_req=n, expect_num_spec=N)
        check_reply_values(reply, packed, vocab_size=1000, window=100)

    unpack()
    unpack_packed()
    return {
        "pack_step_prefix": per_call_us(pack, repeat),
        "decode_step + check_step_shape": per_call_us(decode, repeat),
        "StepReply encode": per_call_us(encode, repeat),
        "StepReply.unpack + check (ReqEntry list)": per_call_us(unpack, repeat),
        "StepReply.unpack + check (packed entries)": per_call_us(unpack_packed, repeat),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=2000, help="calls per timing round")
    args = ap.parse_args()
    sizes = (1, 64, 256)
    results = {n: bench(n, args.repeat) for n in sizes}
    names = list(results[sizes[0]])
    print(f"{'us per call (N = 7)':40s}" + "".join(f"{'n=' + str(n):>10s}" for n in sizes))
    for name in names:
        print(f"{name:40s}" + "".join(f"{results[n][name]:10.1f}" for n in sizes))
    print("rows region: decoded as a view of the frame (shares memory), untouched by packing")


if __name__ == "__main__":
    main()
