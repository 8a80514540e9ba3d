"""Worker memory under connections that send a header and nothing more (not a test: figures for
bench/README.md).

Starts ``python -m dspark_worker`` from the current directory (so running it from another
checkout measures that checkout's worker), opens N connections that each send one 24-byte header
naming a B-byte body, and prints the worker's VmRSS before, while the connections are open, and
after they close, with what the worker answered.

    python bench/attack_memory.py --connections 256 --body-bytes 4194304 --max-frame-bytes 67108864
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def header(op: int, seq: int, session: int, body_len: int) -> bytes:
    import struct

    return struct.pack("<IHBBIIQ", 0x4B505344, 1, op, 0, session, body_len, seq)


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--connections", type=int, default=256)
    ap.add_argument("--body-bytes", type=int, default=4 << 20)
    ap.add_argument("--max-frame-bytes", type=int, default=64 << 20)
    ap.add_argument("--op", type=int, default=2, help="op of the headers (2 = STEP, 1 = HELLO)")
    ap.add_argument("--hold-s", type=float, default=2.0, help="wait before measuring")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    port_file = tmp / "ports.json"
    log = open(tmp / "worker.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [sys.executable, "-m", "dspark_worker", "--listen", "127.0.0.1:0", "--metrics-listen",
         "none", "--port-file", str(port_file), "--window", "32", "--max-slots", "16",
         "--max-total-slots", "48", "--no-warmup", "--max-frame-bytes",
         str(args.max_frame_bytes), "--max-connections", str(args.connections + 8),
         "--log-level", "ERROR"], stdout=log, stderr=subprocess.STDOUT,
        env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        deadline = time.monotonic() + 120
        while not port_file.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                print(Path(tmp / "worker.log").read_text())
                return 1
            time.sleep(0.05)
        host, _, port = json.loads(port_file.read_text())["listen"].rpartition(":")
        time.sleep(0.5)
        before = rss(proc.pid)
        socks = []
        for i in range(args.connections):
            s = socket.create_connection((host, int(port)), timeout=10)
            s.sendall(header(args.op, i + 1, i + 1, args.body_bytes))
            socks.append(s)
        time.sleep(args.hold_s)
        during = rss(proc.pid)
        answered = 0
        for s in socks:
            s.settimeout(0.2)
            try:
                data = s.recv(64)
                answered += len(data) >= 24
            except (TimeoutError, OSError):
                pass
            s.close()
        time.sleep(0.5)
        after = rss(proc.pid)
        mib = 2 ** 20
        print(f"{args.connections} connections x 1 header naming {args.body_bytes} bytes"
              f" (op {args.op}), --max-frame-bytes {args.max_frame_bytes}:")
        print(f"  worker RSS before {before / mib:.1f} MiB, with the connections open"
              f" {during / mib:.1f} MiB (+{(during - before) / mib:.1f} MiB), after"
              f" {after / mib:.1f} MiB; {answered} answered at the header")
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
