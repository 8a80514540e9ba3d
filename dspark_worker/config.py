"""The worker's configuration: one frozen type, its defaults and limits, and how a TOML file and
command-line flags become one validated value (docs/contract.md section 11, limits).

Precedence: built-in defaults < the ``--config`` TOML file < command-line flags. Every field of
:class:`WorkerConfig` can be set from the file under its own name (``max_slots = 128``) and from
the command line as ``--max-slots 128``. A bad value is refused with a :class:`ConfigError` that
names the field and the value (``max_slots: 0 is not a positive integer``).
"""

from __future__ import annotations

import difflib
import math
import re
import socket
from pathlib import Path
from typing import Any, Final

import msgspec
import msgspec.toml

# -- limits: each a named default with the reason for its size ----------------------------------
# Loopback only unless told otherwise (section 11); 7600/7601 are the engines' default endpoints.
DEFAULT_LISTEN: Final = "127.0.0.1:7600"
DEFAULT_METRICS_LISTEN: Final = "127.0.0.1:7601"
# W: 1024 rows cover the recent context that a block of N <= 16 drafts attends to in practice,
# keep one slot's ring at ~20 MiB for Qwen3-4B shapes (bf16 K/V of 5 layers) and a full resync
# of one slot at 1024 * 25.6 KiB = 25 MiB on the wire. The client's HELLO must name the same W.
DEFAULT_WINDOW: Final = 1024
# Slots one session may use: vLLM's default max_num_seqs is 256.
DEFAULT_MAX_SLOTS: Final = 256
# Rows one STEP may carry: a resync of four full windows, 105 MB at Qwen3-4B's 25.6 KiB rows.
DEFAULT_MAX_ROWS_PER_STEP: Final = 4096
# Sessions held at once: bounds the bookkeeping and the STATS reply, not memory (lanes do that).
DEFAULT_MAX_SESSIONS: Final = 64
# Window rings reserved at start for all sessions together (section 8): two engines of 256 slots.
# The ring memory is max_total_slots * W * (per-position K/V bytes); it is logged at start.
DEFAULT_MAX_TOTAL_SLOTS: Final = 512
# A session that sent no STEP for this long (since its HELLO, or its last STEP) gives its lanes
# up to a HELLO that would not fit otherwise: an engine steps every few milliseconds while it
# serves, so lanes unused this long are a reservation left behind, or a stranger's hoard (and
# a new engine waits this long at most for them). An idle engine keeps its lanes while nobody
# needs them. As LIVE_SESSION_S: such a session no longer counts as in use either.
DEFAULT_RESERVATION_IDLE_S: Final = 5.0
# Open connections: an engine holds one per rank-0 process; more is a leak or a flood.
DEFAULT_MAX_CONNECTIONS: Final = 256
# 6.2: a session with no frame for this long is dropped with its windows.
DEFAULT_SESSION_IDLE_S: Final = 600.0
# A frame whose first byte arrived this long ago and whose last has not: the peer stalled or is
# a slowloris; the largest legal frame (~100 MB) crosses a 1 Gb/s link in under a second.
DEFAULT_PARTIAL_FRAME_TIMEOUT_S: Final = 30.0
# A connection that holds no session and sends no frame for this long is closed: long enough
# for an engine to connect and send its HELLO on a loaded host, short enough that idle or
# abandoned sockets do not keep engines out at max_connections. A health checker's PINGs (or
# STATS) restart the clock, so a checker that keeps its connection open stays connected.
DEFAULT_HANDSHAKE_TIMEOUT_S: Final = 10.0
# A connection whose session is gone (expired, replaced, re-HELLOed on another connection) and
# that sends no frame for this long is closed: its engine had a minute to HELLO again.
DEFAULT_CONNECTION_IDLE_S: Final = 60.0
# STEPs waiting for the device above which new STEPs apply their rows but skip drafting
# (RS_SHED): each waiting STEP adds its drafting to everyone's next batch, and past this depth a
# late draft is worth less to the engine than a target-only round now.
DEFAULT_SHED_QUEUE_STEPS: Final = 32
# SIGTERM: how long in-flight STEPs may take to finish before connections are closed anyway.
DEFAULT_SHUTDOWN_TIMEOUT_S: Final = 30.0
# SIGTERM: how long the worker keeps answering HELLO and STEP with ST_DRAINING (so every engine
# hears "go elsewhere" on its next round instead of timing out) before it stops listening; it
# ends sooner once every connection has closed. Well inside Kubernetes' 30 s grace period.
DEFAULT_DRAIN_S: Final = 5.0
# Torch intra-op threads of the worker. One: a CPU worker's batches are small, and with more
# threads every op waits at a barrier for all of them, so one thread descheduled by a busy
# neighbour process stalls every op (on 2 shared cores the p50 round trip was 45 ms with one
# thread, 348 ms with two, and past 2 s with one more busy process: bench/README.md "CPU
# threads"). On CUDA the device does the work and the host needs no thread pool.
DEFAULT_THREADS: Final = 1
# Drafter versions loaded at once (the newest and the older ones their sessions still hold):
# each costs its weights, not ring memory (the versions share the rings). Three let a reload
# come while the sessions of the last two are still pinned to theirs.
DEFAULT_MAX_VERSIONS: Final = 3
# The share of each session's slots the canary drafts in the shadow of: enough judged blocks
# for a comparison within minutes of an engine's traffic, at a tenth of the drafting work.
DEFAULT_CANARY_FRACTION: Final = 0.1
# Frames received on one connection and not yet answered before the worker stops reading from
# it: the contract allows one in flight, so more is a misbehaving client; bounds its memory.
MAX_PENDING_FRAMES_PER_CONNECTION: Final = 4
# Bodies of frames other than STEP (HELLO 200 B, RESET 4 + 4 * slots) never need more.
MIN_FRAME_BYTES: Final = 64 << 10
# Section 13: the largest shared-memory rows region one Unix connection may attach. The region
# is the client's memory (the worker maps it, it allocates nothing), so this bounds address
# space and what one connection can make the device read: the largest legal STEP's rows at the
# default limits (4096 rows of Qwen3-8B's 40 KiB) fit. 0 offers no regions (no CAP_SHM_ROWS).
DEFAULT_MAX_SHM_REGION_BYTES: Final = 256 << 20
# Section 13: what every connection's regions may map together. The pages the worker reads are
# charged to it (and page-locked on CUDA): four of the largest regions, or many smaller ones.
DEFAULT_MAX_SHM_MAPPED_BYTES: Final = 4 * DEFAULT_MAX_SHM_REGION_BYTES
# Largest body a connection that holds no session may send (HELLO is 160 bytes, PING, STATS and
# GOODBYE have none): a stranger's frames cost the worker at most this much each (section 11).
SESSIONLESS_MAX_BODY_BYTES: Final = 4 << 10
# A HELLO under a client name replaces the sessions held under that name (a respawned engine
# clears its predecessor's state, 6.2), except one whose connection is open and that had a frame
# this recently: that is a second live engine using the same name, and both are served.
LIVE_SESSION_S: Final = 5.0
# Connections without a session one peer host may hold; its next one closes its oldest. A
# health checker or a tool needs one or two; an engine's connection holds a session.
MAX_SESSIONLESS_PER_PEER: Final = 16

# The draft step as one captured CUDA graph per batch bucket (auto: on CUDA, after a start-up
# self-check against the eager step), or always eager (off).
CUDA_GRAPHS: Final = ("auto", "off")
LOG_LEVELS: Final = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
DEVICES: Final = ("auto", "cpu", "cuda")
DTYPES: Final = ("auto", "float32", "bfloat16", "float16")
NAME_BYTES: Final = 32  # worker_name in HelloReply: UTF-8, NUL padded


class ConfigError(ValueError):
    """A configuration value is refused; ``field`` and ``value`` say which."""

    def __init__(self, message: str, *, field: str | None = None, value: object = None) -> None:
        super().__init__(message)
        self.field = field
        self.value = value


def default_worker_name() -> str:
    """``dspark@<host>``, cut to the 32 UTF-8 bytes HelloReply carries."""
    name = f"dspark@{socket.gethostname()}"
    raw = name.encode("utf-8")[:NAME_BYTES]
    return raw.decode("utf-8", errors="ignore")


class WorkerConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Everything the worker is told. Field docs are the ``--help`` texts (cli.OPTIONS)."""

    checkpoint: str | None = None
    target_checkpoint: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    threads: int = DEFAULT_THREADS  # torch intra-op threads; 0: torch's default (every core)
    window: int = DEFAULT_WINDOW
    max_slots: int = DEFAULT_MAX_SLOTS
    max_rows_per_step: int = DEFAULT_MAX_ROWS_PER_STEP
    max_sessions: int = DEFAULT_MAX_SESSIONS
    max_sessions_per_peer: int = 0  # 0: max_sessions
    max_total_slots: int = DEFAULT_MAX_TOTAL_SLOTS
    max_slots_per_connection: int = 0  # 0: max_slots
    max_slots_per_peer: int = 0  # 0: room left for one more max_slots session from elsewhere
    reservation_idle_s: float = DEFAULT_RESERVATION_IDLE_S
    peer_prefix_v4: int = 32  # IPv4 peers in one such network count as one peer host
    peer_prefix_v6: int = 64
    loopback_one_peer: bool = True  # every loopback address is one peer host
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    max_frame_bytes: int = 0  # 0: the largest legal STEP for max_slots and max_rows_per_step
    max_shm_region_bytes: int = DEFAULT_MAX_SHM_REGION_BYTES
    max_shm_mapped_bytes: int = DEFAULT_MAX_SHM_MAPPED_BYTES
    session_idle_s: float = DEFAULT_SESSION_IDLE_S
    partial_frame_timeout_s: float = DEFAULT_PARTIAL_FRAME_TIMEOUT_S
    handshake_timeout_s: float = DEFAULT_HANDSHAKE_TIMEOUT_S
    connection_idle_s: float = DEFAULT_CONNECTION_IDLE_S
    shed_queue_steps: int = DEFAULT_SHED_QUEUE_STEPS
    shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S
    drain_s: float = DEFAULT_DRAIN_S
    listen: str | None = DEFAULT_LISTEN
    unix: str | None = None
    metrics_listen: str | None = DEFAULT_METRICS_LISTEN
    worker_name: str = ""  # "": default_worker_name()
    auth_secret_file: str | None = None
    port_file: str | None = None
    log_level: str = "INFO"
    warmup: bool = True
    cuda_graphs: str = "auto"
    dspark_draft_topk: int | None = None  # None: the checkpoint config's; 0: off
    max_versions: int = DEFAULT_MAX_VERSIONS
    canary_checkpoint: str | None = None
    canary_fraction: float = DEFAULT_CANARY_FRACTION

    def __post_init__(self) -> None:
        problems = _problems(self)
        if problems:
            field, value, why = problems[0]
            raise ConfigError(f"{field}: {value!r} {why}", field=field, value=value)

    @property
    def sessions_per_peer(self) -> int:
        return min(self.max_sessions_per_peer or self.max_sessions, self.max_sessions)

    @property
    def slots_per_connection(self) -> int:
        """Lanes the sessions of one connection may reserve together: one full session."""
        return self.max_slots_per_connection or self.max_slots

    @property
    def slots_per_peer(self) -> int:
        """Lanes the sessions of one peer host may reserve together; by default what leaves
        a full ``max_slots`` session's room for an engine on another host (at the defaults,
        256 of 512), and never less than one such session."""
        return self.max_slots_per_peer or max(self.max_total_slots - self.max_slots,
                                              self.max_slots)

    @property
    def session_slots(self) -> int:
        """The most slots one HELLO may ask for (HelloReply's max_slots): ``max_slots``, or a
        smaller share per connection or peer, which such a session could never fit."""
        return min(self.max_slots, self.slots_per_connection, self.slots_per_peer)

    @property
    def resolved_worker_name(self) -> str:
        return self.worker_name or default_worker_name()


def _problems(c: WorkerConfig) -> list[tuple[str, object, str]]:
    out: list[tuple[str, object, str]] = []

    def positive_int(field: str, upper: int | None = None) -> None:
        v = getattr(c, field)
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            out.append((field, v, "is not a positive integer"))
        elif upper is not None and v > upper:
            out.append((field, v, f"is over {upper} (the wire field's range)"))

    def non_negative_int(field: str, zero: str) -> None:
        v = getattr(c, field)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            out.append((field, v, f"is not a non-negative integer (0: {zero})"))

    def positive_seconds(field: str) -> None:
        v = getattr(c, field)
        if not (isinstance(v, int | float) and math.isfinite(v) and v > 0):
            out.append((field, v, "is not a positive, finite number of seconds"))

    positive_int("window", 0xFFFF)  # u16 in HELLO
    positive_int("max_slots", 0xFFFFFFFF)
    positive_int("max_rows_per_step", 0xFFFFFFFF)
    positive_int("max_sessions")
    non_negative_int("max_sessions_per_peer", "max_sessions")
    positive_int("max_total_slots")
    non_negative_int("max_slots_per_connection", "the default share")
    non_negative_int("max_slots_per_peer", "the default share")
    positive_seconds("reservation_idle_s")
    positive_int("peer_prefix_v4", 32)
    positive_int("peer_prefix_v6", 128)
    positive_int("max_connections")
    if isinstance(c.max_versions, bool) or not isinstance(c.max_versions, int) \
            or c.max_versions < 2:
        out.append(("max_versions", c.max_versions, "is not an integer >= 2 (the version"
                    " serving and the one a reload loads beside it)"))
    if isinstance(c.canary_fraction, bool) or not (
            isinstance(c.canary_fraction, int | float) and math.isfinite(c.canary_fraction)
            and 0 < c.canary_fraction <= 1):
        out.append(("canary_fraction", c.canary_fraction, "is not a fraction in (0, 1]"))
    positive_int("shed_queue_steps")
    non_negative_int("threads", "torch's default")
    if isinstance(c.max_frame_bytes, bool) or c.max_frame_bytes < 0:
        out.append(("max_frame_bytes", c.max_frame_bytes, "is negative (0 means automatic)"))
    elif 0 < c.max_frame_bytes < MIN_FRAME_BYTES:
        out.append(("max_frame_bytes", c.max_frame_bytes,
                    f"is below {MIN_FRAME_BYTES} bytes, too small for the frames of section 4"))
    positive_seconds("session_idle_s")
    if isinstance(c.max_shm_region_bytes, bool) or c.max_shm_region_bytes < 0:
        out.append(("max_shm_region_bytes", c.max_shm_region_bytes,
                    "is negative (0 offers no shared-memory regions)"))
    if isinstance(c.max_shm_mapped_bytes, bool) or c.max_shm_mapped_bytes < 0:
        out.append(("max_shm_mapped_bytes", c.max_shm_mapped_bytes,
                    "is negative (0: no limit of its own)"))
    positive_seconds("partial_frame_timeout_s")
    positive_seconds("handshake_timeout_s")
    positive_seconds("connection_idle_s")
    positive_seconds("shutdown_timeout_s")
    if isinstance(c.drain_s, bool) or not (isinstance(c.drain_s, (int, float))
                                           and math.isfinite(c.drain_s) and c.drain_s >= 0):
        out.append(("drain_s", c.drain_s, "must be a finite number of seconds >= 0"))
    if c.device not in DEVICES and not c.device.startswith("cuda:"):
        out.append(("device", c.device, f"is not one of {', '.join(DEVICES)} or cuda:N"))
    if c.dtype not in DTYPES:
        out.append(("dtype", c.dtype, f"is not one of {', '.join(DTYPES)}"))
    if c.cuda_graphs not in CUDA_GRAPHS:
        out.append(("cuda_graphs", c.cuda_graphs, f"is not one of {', '.join(CUDA_GRAPHS)}"))
    if c.dspark_draft_topk is not None:
        non_negative_int("dspark_draft_topk", "off")
    if c.log_level.upper() not in LOG_LEVELS:
        out.append(("log_level", c.log_level, f"is not one of {', '.join(LOG_LEVELS)}"))
    if not c.listen and not c.unix:
        out.append(("listen", c.listen, "and unix are both unset: the worker would not listen"))
    addresses = {}
    for field in ("listen", "metrics_listen"):
        v = getattr(c, field)
        if v:
            try:
                addresses[field] = parse_host_port(v)
            except ValueError as exc:
                out.append((field, v, str(exc)))
    if len(addresses) == 2 and _same_port(addresses["listen"], addresses["metrics_listen"]):
        out.append(("metrics_listen", c.metrics_listen, f"takes the port of listen {c.listen}:"
                    " give the metrics their own port (the default is 7601)"))
    raw = c.worker_name.encode("utf-8")
    if len(raw) > NAME_BYTES or "\0" in c.worker_name:
        out.append(("worker_name", c.worker_name,
                    f"is not at most {NAME_BYTES} UTF-8 bytes without NUL"))
    return out


_ANY_HOST = frozenset({"", "0.0.0.0", "::", "*"})


def _same_port(a: tuple[str, int], b: tuple[str, int]) -> bool:
    """Whether two listeners would take one port: the same nonzero port on the same host, or
    on any host where either listens on every address."""
    return (a[1] == b[1] != 0
            and (a[0] == b[0] or a[0] in _ANY_HOST or b[0] in _ANY_HOST))


def parse_host_port(text: str) -> tuple[str, int]:
    """``host:port`` (``[::1]:port`` for IPv6) into (host, port); port 0 picks a free one."""
    host, sep, port_s = text.rpartition(":")
    if not sep or not host:
        raise ValueError("is not HOST:PORT")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        port = int(port_s)
    except ValueError:
        raise ValueError(f"has port {port_s!r}, not a number") from None
    if not 0 <= port <= 65535:
        raise ValueError(f"has port {port} outside 0..65535")
    return host, port


_NONE_WORDS = frozenset({"", "none", "off"})


# The dtypes' other common spellings (torch's, vLLM's, the short ones), as their names here.
DTYPE_ALIASES: Final = {"bf16": "bfloat16", "fp16": "float16", "half": "float16",
                        "fp32": "float32", "float": "float32"}


def _normalise(values: dict[str, Any]) -> dict[str, Any]:
    """``listen = "none"`` (or "off", "") turns an optional listener off; a dtype's other
    spelling (``bf16``) is its name here (``bfloat16``)."""
    out = dict(values)
    for field in ("listen", "metrics_listen", "unix"):
        v = out.get(field)
        if isinstance(v, str) and v.strip().lower() in _NONE_WORDS:
            out[field] = None
    dtype = out.get("dtype")
    if isinstance(dtype, str):
        out["dtype"] = DTYPE_ALIASES.get(dtype.lower(), dtype)
    return out


# msgspec's type names, as the words of an error message.
_TYPE_WORDS = {"int": "an integer", "float": "a number", "str": "a string",
               "bool": "true or false", "null": "unset", "array": "a list", "object": "a table"}


def _type_words(expected: str) -> str:
    """``int | null`` -> ``an integer``: what a field takes, in words (unset is implied)."""
    names = [n.strip() for n in expected.split("|") if n.strip() != "null"]
    return " or ".join(_TYPE_WORDS.get(n, n) for n in names) or expected


def _named(where: str, field: str) -> str:
    """Where a value came from and its name: the flag alone names both (``--dtype``), a file
    or the defaults need the field too (``config file 'w.toml': dtype``)."""
    return where if where == "--" + field.replace("_", "-") else f"{where}: {field}"


def _convert(values: dict[str, Any], source: str,
             source_of: dict[str, str] | None = None) -> WorkerConfig:
    """``source_of``: where each given field came from (a flag, the file), to name in an
    error; ``source`` for the others."""
    values = _normalise(values)
    try:
        return msgspec.convert(values, WorkerConfig)  # strict: "1024" is not 1024
    except msgspec.ValidationError as exc:
        text = str(exc)
        if "`$." in text:
            # a type error: msgspec says "Expected `int`, got `str` - at `$.max_slots`"
            field = text.rsplit("`$.", 1)[1].rstrip("`")
            what = text.split(" - at ")[0]
            m = re.fullmatch(r"Expected `([^`]+)`, got `([^`]+)`", what)
            if m:
                what = (f"is not {_type_words(m.group(1))} (it is"
                        f" {_TYPE_WORDS.get(m.group(2), m.group(2))})")
            value = values.get(field)
            where = (source_of or {}).get(field, source)
            raise ConfigError(f"{_named(where, field)}: {value!r} {what}", field=field,
                              value=value) from None
        # a rule of _problems (msgspec re-raises __post_init__ errors with their message)
        field = text.split(":", 1)[0]
        if field in WorkerConfig.__struct_fields__:
            value = values.get(field, getattr(WorkerConfig(), field, None))
            where = (source_of or {}).get(field, source)
            why = text.split(":", 1)[1].strip()
            raise ConfigError(f"{_named(where, field)}: {why}", field=field,
                              value=value) from None
        raise ConfigError(f"{source}: {text}") from None


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The TOML file's table (checked against the field names, values converted later)."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise ConfigError(f"config file {str(p)!r}: {exc.strerror}", field="config",
                          value=str(p)) from None
    try:
        table = msgspec.toml.decode(raw)
    except msgspec.DecodeError as exc:
        raise ConfigError(f"config file {str(p)!r}: not valid TOML: {exc}", field="config",
                          value=str(p)) from None
    if not isinstance(table, dict):
        raise ConfigError(f"config file {str(p)!r} is not a TOML table")
    known = set(WorkerConfig.__struct_fields__)
    for key in table:
        if key not in known:
            close = difflib.get_close_matches(key.replace("-", "_"), sorted(known), n=1)
            extra = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"config file {str(p)!r}: unknown field {key!r} ="
                              f" {table[key]!r}{extra}", field=key, value=table[key])
    return dict(table)


def build_config(file: str | Path | None = None,
                 overrides: dict[str, Any] | None = None) -> WorkerConfig:
    """Defaults, then the file's values, then ``overrides`` (flags given on the command line;
    a ``None`` value means "not given")."""
    values: dict[str, Any] = {}
    source = "defaults"
    source_of: dict[str, str] = {}
    if file is not None:
        from_file = read_config_file(file)
        values.update(from_file)
        source = f"config file {str(file)!r}"
        source_of.update(dict.fromkeys(from_file, source))
    given = {k: v for k, v in (overrides or {}).items() if v is not None}
    if given:
        values.update(given)
        source_of.update({k: "--" + k.replace("_", "-") for k in given})
        source = "command line" if file is None else f"{source} and command line"
    return _convert(values, source, source_of)


def path_problems(config: WorkerConfig) -> list[str]:
    """Folders named in the configuration that do not exist, said before anything loads
    (torch included): a start-up error, not a usage error, since a volume may be mounted
    late."""
    out = []
    for field in ("checkpoint", "target_checkpoint", "canary_checkpoint"):
        value = getattr(config, field)
        if value is None:
            continue
        p = Path(value)
        flag = "--" + field.replace("_", "-")
        if not p.exists():
            out.append(f"{flag} {value}: does not exist")
        elif not p.is_dir():
            out.append(f"{flag} {value}: is not a folder (a checkpoint is a folder with"
                       " config.json and safetensors files)")
    return out


def max_step_body_bytes(max_slots: int, max_rows_per_step: int, row_bytes: int) -> int:
    """The largest STEP body legal under these limits (7.3): header, entries, rows."""
    return 32 + 48 * max_slots + max_rows_per_step * row_bytes


def frame_limit(config: WorkerConfig, row_bytes: int) -> int:
    """The frame body limit in force: configured, or the largest legal STEP."""
    if config.max_frame_bytes:
        return config.max_frame_bytes
    return max(MIN_FRAME_BYTES,
               max_step_body_bytes(config.max_slots, config.max_rows_per_step, row_bytes))


def config_warnings(config: WorkerConfig, row_bytes: int) -> list[str]:
    """Settings that are legal but cannot all be used: said once at start."""
    out: list[str] = []
    largest = max_step_body_bytes(config.max_slots, config.max_rows_per_step, row_bytes)
    if config.max_frame_bytes and config.max_frame_bytes < largest:
        out.append(f"max_frame_bytes {config.max_frame_bytes} is below the largest STEP body"
                   f" that max_slots {config.max_slots} and max_rows_per_step"
                   f" {config.max_rows_per_step} allow ({largest} bytes at row_bytes"
                   f" {row_bytes}): a HELLO asking for those limits is refused ST_LIMITS")
    if config.max_slots > config.max_total_slots:
        out.append(f"max_slots {config.max_slots} is above max_total_slots"
                   f" {config.max_total_slots}: a session can use at most"
                   f" {config.max_total_slots} slots, and a HELLO asking for more gets ST_BUSY")
    if config.session_slots < config.max_slots:
        out.append(f"max_slots_per_connection {config.slots_per_connection} or"
                   f" max_slots_per_peer {config.slots_per_peer} is below max_slots"
                   f" {config.max_slots}: a HELLO may ask for {config.session_slots} slots at"
                   " most (more gets ST_LIMITS)")
    if config.unix and 0 < config.max_shm_mapped_bytes < config.max_shm_region_bytes:
        out.append(f"max_shm_mapped_bytes {config.max_shm_mapped_bytes} is below"
                   f" max_shm_region_bytes {config.max_shm_region_bytes}: a region larger than"
                   f" {config.max_shm_mapped_bytes} bytes is refused ST_LIMITS")
    return out


def is_loopback_host(host: str) -> bool:
    """True for a host that only this machine can reach (127.0.0.0/8, ::1, localhost)."""
    import ipaddress

    if host.lower() in ("localhost", "localhost.localdomain", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def exposure_warning(config: WorkerConfig) -> str | None:
    """The loud line for a TCP listener other machines can reach with no HELLO authentication
    (None when loopback only, or when a secret is configured)."""
    if not config.listen or config.auth_secret_file:
        return None
    host, _ = parse_host_port(config.listen)
    if is_loopback_host(host):
        return None
    return (f"listening on {config.listen} WITHOUT AUTHENTICATION: any host that reaches this"
            f" port can open sessions, read STATS and use the drafter. Set auth_secret_file"
            f" (docs/operations.md, Auth) or listen on 127.0.0.1 / a Unix socket")
