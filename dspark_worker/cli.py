"""``dspark-worker``: command line, logging, uvloop, start (docs/contract.md sections 2, 11).

Every ``WorkerConfig`` field is a flag (``max_slots`` -> ``--max-slots``) and a key of the
``--config`` TOML file; flags given on the command line override the file. Exit codes: 0 after a
graceful shutdown (SIGTERM, SIGINT), 2 for a bad option or config file, 1 when the worker cannot
start (drafter, secret, port).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from typing import Any, Final

from . import __version__
from .config import (
    CUDA_GRAPHS,
    DEFAULT_CANARY_FRACTION,
    DEFAULT_CONNECTION_IDLE_S,
    DEFAULT_DRAIN_S,
    DEFAULT_HANDSHAKE_TIMEOUT_S,
    DEFAULT_LISTEN,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_ROWS_PER_STEP,
    DEFAULT_MAX_SESSIONS,
    DEFAULT_MAX_SHM_MAPPED_BYTES,
    DEFAULT_MAX_SHM_REGION_BYTES,
    DEFAULT_MAX_SLOTS,
    DEFAULT_MAX_TOTAL_SLOTS,
    DEFAULT_MAX_VERSIONS,
    DEFAULT_METRICS_LISTEN,
    DEFAULT_PARTIAL_FRAME_TIMEOUT_S,
    DEFAULT_RESERVATION_IDLE_S,
    DEFAULT_SESSION_IDLE_S,
    DEFAULT_SHED_QUEUE_STEPS,
    DEFAULT_SHUTDOWN_TIMEOUT_S,
    DEFAULT_THREADS,
    DEFAULT_WINDOW,
    DEVICES,
    DTYPES,
    LOG_LEVELS,
    ConfigError,
    WorkerConfig,
    build_config,
    path_problems,
)

log = logging.getLogger("dspark_worker")

# (field, metavar, type, help). One row per WorkerConfig field; a test checks the two agree.
OPTIONS: Final[list[tuple[str, str, Any, str]]] = [
    ("checkpoint", "DIR", str,
     "drafter checkpoint folder (config.json + safetensors): DeepSpec's layout (Qwen3,"
     " Gemma4), a speculators training run's saved folder (dspark, dflash, dflash2: its"
     " <epoch>/ or checkpoint_best/) or a z-lab DFlash release; the last two need"
     " --target-checkpoint (their embed_tokens is the target's). SIGHUP reads it"
     " again and, when it holds another drafter, loads it beside the serving one as a new"
     " version (docs/operations.md, \"Ship a new drafter\"). Default: the embedded reference"
     " drafter (a small byte-level pair shipped with dspark, for trying the worker, the demo"
     " and the tests)."),
    ("target_checkpoint", "DIR", str,
     "target model checkpoint to read embed_tokens / lm_head from when the drafter"
     " checkpoint lacks them: required for speculators and DFlash drafters (read again on"
     " SIGHUP too)."),
    ("device", "DEV", str,
     f"where the drafter runs: {', '.join(DEVICES)} or cuda:N. auto = cuda if available,"
     " else cpu. Default: auto."),
    ("dtype", "DTYPE", str,
     f"drafter weights and rings: {', '.join(DTYPES)} (or bf16, fp16, fp32). auto = bfloat16"
     " on CUDA, float32 on CPU. Default: auto."),
    ("threads", "N", int,
     f"torch intra-op threads. More than one only pays on a CPU worker with cores of its own:"
     f" with several, one thread descheduled by a busy neighbour process stalls every op."
     f" 0 = torch's default (one per core, or $OMP_NUM_THREADS). Default: {DEFAULT_THREADS}."),
    ("window", "W", int,
     f"rows of context kept per slot (W, section 8); a client's HELLO must name the same"
     f" (an engine that leaves its window unset learns it from STATS)."
     f" Memory is max_total_slots x W x per-row K/V bytes. Default: {DEFAULT_WINDOW}."),
    ("max_slots", "N", int,
     f"most slots one session may declare in its HELLO (else ST_LIMITS). Default:"
     f" {DEFAULT_MAX_SLOTS}."),
    ("max_rows_per_step", "N", int,
     f"most tap rows one STEP may carry (else ST_LIMITS at HELLO). Default:"
     f" {DEFAULT_MAX_ROWS_PER_STEP}."),
    ("max_sessions", "N", int,
     f"most sessions held at once; a HELLO over it gets ST_BUSY. Default:"
     f" {DEFAULT_MAX_SESSIONS}."),
    ("max_sessions_per_peer", "N", int,
     "most sessions one peer host (all Unix connections together) may hold; a HELLO over"
     " it gets ST_BUSY. Set it where the port is reachable by hosts other than the engines'"
     " and there is no shared secret, so one host cannot take every session. Default: 0 ="
     " max_sessions (no limit of its own)."),
    ("max_total_slots", "N", int,
     f"window rings reserved at start for all sessions together; a HELLO whose max_slots"
     f" does not fit in what is free gets ST_BUSY. Default: {DEFAULT_MAX_TOTAL_SLOTS}."),
    ("max_slots_per_connection", "N", int,
     "most slots the sessions bound to one connection may reserve together; a HELLO over it"
     " gets ST_BUSY. Default: 0 = max_slots (one full session)."),
    ("max_slots_per_peer", "N", int,
     "most slots the sessions of one peer host (all Unix connections together) may reserve"
     " together; a HELLO over it gets ST_BUSY. Raise it to serve several engines from one"
     " host. Default: 0 = max_total_slots - max_slots, at least max_slots (room for a full"
     " session from another host: 256 of 512 at the defaults)."),
    ("reservation_idle_s", "SECONDS", float,
     f"a session that sent no STEP for this long (since its HELLO or its last STEP) gives"
     f" its slots up to a HELLO that would not fit otherwise (dropped, reason unused). An"
     f" idle engine keeps them while nobody needs them. Default:"
     f" {DEFAULT_RESERVATION_IDLE_S:g}."),
    ("peer_prefix_v4", "BITS", int,
     "IPv4 peers in one network of this prefix length count as one peer host for the per-peer"
     " limits (sessions, slots, the rates of frames without a session). Lower it where one"
     " party holds a block of addresses. Default: 32 (each address)."),
    ("peer_prefix_v6", "BITS", int,
     "the same for IPv6 peers: a host is given a /64 and may use any address in it. Default:"
     " 64."),
    ("loopback_one_peer", "BOOL", None,
     "count every loopback address (127.0.0.0/8, ::1) as one peer host: any process on the"
     " worker's host may use any of them. --no-loopback-one-peer counts each as its own (a"
     " test bed standing in for hosts with loopback addresses; never where strangers share"
     " the host). Default: on."),
    ("max_connections", "N", int,
     f"open connections. At the limit a new one pushes out the oldest connection that holds"
     f" no session; when every one holds a session it is closed at once. Default:"
     f" {DEFAULT_MAX_CONNECTIONS}."),
    ("max_frame_bytes", "BYTES", int,
     "largest frame body accepted; a larger one gets ST_BAD_FRAME and the connection is"
     " closed, and a HELLO whose largest STEP would be larger gets ST_LIMITS. Default: 0 ="
     " the largest legal STEP (max_slots entries, max_rows_per_step rows)."),
    ("max_shm_region_bytes", "BYTES", int,
     f"largest shared-memory rows region (a sealed memfd) one Unix connection may attach"
     f" (section 13); larger gets ST_LIMITS. 0 offers none. Default:"
     f" {DEFAULT_MAX_SHM_REGION_BYTES}."),
    ("max_shm_mapped_bytes", "BYTES", int,
     f"what the shared-memory regions of every connection may map together: the pages the"
     f" worker reads are charged to its memory (page-locked on CUDA). A region over it gets"
     f" ST_LIMITS (its client sends rows on the socket). 0 = no limit of its own. Default:"
     f" {DEFAULT_MAX_SHM_MAPPED_BYTES}."),
    ("session_idle_s", "SECONDS", float,
     f"a session with no frame for this long is dropped with its windows. Default:"
     f" {DEFAULT_SESSION_IDLE_S:g}."),
    ("partial_frame_timeout_s", "SECONDS", float,
     f"a frame begun and not finished within this time closes its connection. Default:"
     f" {DEFAULT_PARTIAL_FRAME_TIMEOUT_S:g}."),
    ("handshake_timeout_s", "SECONDS", float,
     f"a connection that holds no session and sends no frame for this long is closed (from"
     f" connect until its HELLO; a health checker's PING or STATS restarts the clock); and"
     f" a session that never sent a STEP is dropped this long after its connection went."
     f" Default: {DEFAULT_HANDSHAKE_TIMEOUT_S:g}."),
    ("connection_idle_s", "SECONDS", float,
     f"a connection whose session is gone (expired, replaced, HELLOed on another"
     f" connection) and that sends no frame for this long is closed. Default:"
     f" {DEFAULT_CONNECTION_IDLE_S:g}."),
    ("shed_queue_steps", "N", int,
     f"STEPs waiting for the device above which new STEPs apply their rows but skip"
     f" drafting (RS_SHED). Default: {DEFAULT_SHED_QUEUE_STEPS}."),
    ("drain_s", "SECONDS", float,
     f"on SIGTERM, how long HELLO and STEP are answered ST_DRAINING (engines move to another"
     f" worker at once) before the worker stops listening; ends early once every connection"
     f" has closed; 0 skips it. Default: {DEFAULT_DRAIN_S:g}."),
    ("shutdown_timeout_s", "SECONDS", float,
     f"on SIGTERM, how long in-flight STEPs may take before connections are closed anyway."
     f" Default: {DEFAULT_SHUTDOWN_TIMEOUT_S:g}."),
    ("listen", "HOST:PORT", str,
     f"TCP address to serve on ('none' for Unix only; port 0 picks one, see --port-file)."
     f" Default: {DEFAULT_LISTEN}."),
    ("unix", "PATH", str, "also (or only) serve on this Unix socket path."),
    ("metrics_listen", "HOST:PORT", str,
     f"HTTP address for /metrics (Prometheus) and /healthz ('none' to turn it off)."
     f" Default: {DEFAULT_METRICS_LISTEN}."),
    ("worker_name", "NAME", str,
     "name in HelloReply, STATS and metrics (at most 32 UTF-8 bytes). Default:"
     " dspark@<hostname>."),
    ("auth_secret_file", "PATH", str,
     "file holding the shared secret for HELLO authentication (HMAC-SHA256, section 11);"
     " surrounding whitespace is ignored. Default: no authentication."),
    ("port_file", "PATH", str,
     'once listening and ready, write {"listen": "host:port", "unix": path or null,'
     ' "metrics": "host:port" or null, "pid": int} as JSON to this file.'),
    ("log_level", "LEVEL", str, f"{', '.join(LOG_LEVELS)}. Default: INFO."),
    ("warmup", "BOOL", None,
     "run one ingest and draft before serving (--no-warmup skips it). Default: on."),
    ("cuda_graphs", "MODE", str,
     f"{', '.join(CUDA_GRAPHS)}. auto: on CUDA the draft step runs as one captured CUDA graph"
     " per batch bucket (1, 2, 4, ..., 256 and max_slots lanes), each checked against the"
     " eager step at start; any failure is logged once, counted in"
     " dspark_worker_cuda_graph_fallbacks_total, and the worker drafts eagerly. off: always"
     " eager. Default: auto."),
    ("max_versions", "N", int,
     f"drafter versions loaded at once: the newest and older ones that sessions pinned to"
     f" them still use (each costs its weights; the ring memory is shared). A reload that"
     f" would load one more fails. At least 2. Default: {DEFAULT_MAX_VERSIONS}."),
    ("canary_checkpoint", "DIR", str,
     "a candidate drafter (same geometry) that drafts in the shadow of the serving one for"
     " --canary-fraction of the slots, after the replies are sent and only while the device"
     " is idle; its acceptance is judged on the tokens the engines' next STEPs reveal and"
     " shown beside the serving version's (STATS, metrics). SIGHUP reads it again. Default:"
     " none."),
    ("canary_fraction", "F", float,
     f"share of each session's slots the canary drafts for, in (0, 1]. Default:"
     f" {DEFAULT_CANARY_FRACTION:g}."),
    ("dspark_draft_topk", "K", int,
     "vLLM's candidate walk: the Markov bias is added to the K best base logits of each"
     " position only (other tokens count as -inf). It changes drafts, so it changes the"
     " Markov identity the HELLO reply carries (contract section 6.4); K at least 32. 0: off."
     " Default: the checkpoint config's dspark_draft_topk, else off."),
]


def _flag(field: str) -> str:
    return "--" + field.replace("_", "-")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dspark-worker",
        description="Serve DSpark speculative-decoding drafts to serving engines over TCP and"
                    " Unix sockets (the wire contract: docs/contract.md). With no arguments it"
                    f" serves the embedded reference drafter on {DEFAULT_LISTEN}.",
        epilog="Every option can also be set in the --config TOML file under its name with"
               " underscores (max_slots = 128); flags override the file. SIGTERM or SIGINT"
               " drains in-flight STEPs and exits 0.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", metavar="FILE",
                   help="TOML file with any of the options below (flags override it).")
    for field, metavar, typ, text in OPTIONS:
        if typ is None:
            p.add_argument(_flag(field), dest=field, action=argparse.BooleanOptionalAction,
                           default=None, help=text)
        else:
            p.add_argument(_flag(field), dest=field, metavar=metavar, type=typ, default=None,
                           help=text)
    p.add_argument("--version", action="version", version=f"dspark-worker {__version__}")
    return p


def parse_config(argv: list[str] | None = None) -> WorkerConfig:
    """argv -> WorkerConfig; exits 2 with a message naming field and value on a bad one."""
    parser = build_parser()
    args = parser.parse_args(argv)
    overrides = {field: getattr(args, field) for field in WorkerConfig.__struct_fields__}
    try:
        return build_config(args.config, overrides)
    except ConfigError as exc:
        parser.exit(2, f"dspark-worker: error: {exc}\n")
        raise  # pragma: no cover - exit raises


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(), stream=sys.stderr,
        format="%(asctime)s.%(msecs)03d %(levelname)-7s %(name)s: %(message)s",
        datefmt="%Y-%m-%dT%H:%M:%S")


def main(argv: list[str] | None = None) -> None:
    config = parse_config(argv)
    setup_logging(config.log_level)
    for problem in path_problems(config):  # at once, before torch is imported
        log.error("cannot start: %s", problem)
        sys.exit(1)
    from .app import StartupError, WorkerApp

    async def _run() -> int:
        return await WorkerApp(config).run()

    log.info("dspark-worker %s starting (pid %d)", __version__, os.getpid())
    try:
        code = _event_loop_run(_run())
    except StartupError as exc:
        log.error("cannot start: %s", exc)
        code = 1
    except KeyboardInterrupt:  # a second ^C before the handlers were installed
        code = 0
    # The worker has stopped (connections closed, port file removed, logs written): leave now.
    # The interpreter's teardown would spend seconds in torch's static destructors freeing a
    # fragmented heap, and a supervisor would see a worker that said "stopped:" still running.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _event_loop_run(coro: Any) -> int:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency of the worker extra
        log.warning("uvloop is not installed; running on the default asyncio loop")
        return int(asyncio.run(coro))
    return int(uvloop.run(coro))
