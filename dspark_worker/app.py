"""The worker's life: load, warm up, listen, serve, drain (docs/contract.md sections 8, 10-12).

``WorkerApp`` puts the parts together: metrics server first (so ``/healthz`` answers 503 while
the drafter loads), then the drafter and its ring pool, the runner, dispatch and the listeners;
then the port file, which says the worker is listening and ready. ``stop()`` is the graceful
shutdown of SIGTERM/SIGINT: first a drain of up to ``drain_s`` in which HELLO and STEP are answered
``ST_DRAINING`` (engines move to another worker without a timeout, contract section 5) while
every STEP already accepted finishes; it ends once no connection is left. Then stop accepting
and reading, let every STEP still queued finish and be answered, close the connections, exit 0.
SIGHUP reloads --checkpoint (and --canary-checkpoint) beside what serves
(``versions.Reloader``, docs/operations.md "Ship a new drafter").
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import gc
import json
import logging
import os
import signal
import socket
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry

from protocol.auth import read_secret_file
from protocol.constants import CAP_MARGIN, CAP_NO_CONFIDENCE, CAP_TAPS_BF16, CAP_TOP32
from protocol.identity import NO_MARKOV_HEAD

from . import __version__
from .admission import peer_host
from .buffers import BufferPool, pinned_factory
from .canary import Canary, CanaryFamilies, canary_lanes
from .config import (
    WorkerConfig,
    config_warnings,
    exposure_warning,
    frame_limit,
    parse_host_port,
)
from .dispatch import Dispatcher, WorkerInfo, rss_bytes
from .metrics import Metrics, VersionFamilies
from .runner import Runner, new_device_thread
from .server import MetricsServer, WorkerServer, bind_tcp, bind_unix, unlink_own_socket
from .sessions import SessionTable
from .shm import ShmOps, cuda_host_register
from .versions import (
    Reloader,
    ReloadFailed,
    ReloadOutcome,
    Version,
    Versions,
    failure_words,
    geometry_problem,
    loader_thread,
    make_version,
    version_name,
    weights_bytes,
)

log = logging.getLogger("dspark_worker")

# How often idle sessions are looked for: a small fraction of the idle limit, at most 5 s.
EXPIRY_SCAN_MAX_S = 5.0
# How often the drain looks whether every connection has gone.
DRAIN_POLL_S = 0.02
# The drain also ends when no frame arrived for this long: an engine that steps hears DRAINING
# within one round (milliseconds while it serves), so what is left are idle connections, which
# the close tells soon enough; a slow engine round must not end it early.
DRAIN_QUIET_S = 2.0


class StartupError(RuntimeError):
    """The worker cannot start (a bad checkpoint, an unreadable secret, a port in use)."""


def read_secret(path: str) -> bytes:
    """The shared secret of section 11, by ``protocol.auth.read_secret_file`` (the client reads
    the same file by the same rule); a file others can read is logged."""
    try:
        raw = read_secret_file(path)
        mode = Path(path).stat().st_mode
    except (ValueError, OSError) as exc:
        raise StartupError(f"auth_secret_file {exc}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("auth_secret_file %s can be read by group or others (mode %o)", path,
                    stat.S_IMODE(mode))
    return raw


def _why(exc: OSError) -> str:
    """An OSError as the words after the colon: "address already in use", not a repr."""
    text = exc.strerror or str(exc) or type(exc).__name__
    return text[:1].lower() + text[1:]


def _in_use(exc: OSError) -> bool:
    return exc.errno == errno.EADDRINUSE


def resolve_device(name: str) -> str:
    if name != "auto":
        return name
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def check_device(name: str) -> None:
    """A CUDA device asked of a torch without CUDA (or without a GPU) fails in one line."""
    if not name.startswith("cuda"):
        return
    import torch

    if torch.version.cuda is None:
        raise StartupError(f"--device {name}: this torch ({torch.__version__}) is a CPU-only"
                           " build; use --device cpu, or install a CUDA build of torch")
    if not torch.cuda.is_available():
        raise StartupError(f"--device {name}: no CUDA device is visible (CUDA_VISIBLE_DEVICES"
                           f"={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); use --device"
                           " cpu")


def set_threads(threads: int) -> int:
    """Torch intra-op threads on the calling thread (the device thread, which runs every torch
    call); 0 keeps torch's default. Returns the count in force."""
    import torch

    if threads > 0:
        torch.set_num_threads(threads)
    return int(torch.get_num_threads())


def _device_dtype(config: WorkerConfig) -> tuple[str, Any]:
    import torch

    return (resolve_device(config.device),
            None if config.dtype == "auto" else getattr(torch, config.dtype))


def load_drafter_for(config: WorkerConfig) -> Any:
    """Load and return the drafter the config names (slow: run it off the event loop). A
    folder it cannot serve raises ``drafter.CheckpointRefused`` before any of the drafter's
    memory is allocated, host or device."""
    from .drafter import load_drafter

    device, dtype = _device_dtype(config)
    return load_drafter(config.checkpoint, target_checkpoint=config.target_checkpoint,
                        device=device, dtype=dtype, draft_topk=config.dspark_draft_topk)


def read_drafter_for(config: WorkerConfig, checkpoint: str | None) -> Any:
    """A reload's first half (a loader thread): ``checkpoint`` (None: the embedded reference
    drafter) read, checked and identified in host memory, nothing on the device yet."""
    from .drafter import read_drafter
    from .drafter.drafter import REFERENCE_DIR

    if checkpoint is None:
        return read_drafter(REFERENCE_DIR, record_identities=False,
                            draft_topk=config.dspark_draft_topk, source="embedded")
    return read_drafter(checkpoint, config.target_checkpoint,
                        draft_topk=config.dspark_draft_topk)


def build_drafter_for(config: WorkerConfig, read: Any) -> Any:
    """A reload's second half (a loader thread): the model built on the worker's device."""
    return read.build(*_device_dtype(config))


def release_device_memory(device: Any) -> None:
    """Give the caching allocator's free blocks back to the device (after a version went or
    a reload failed), so that what the device reports is what the worker holds."""
    if str(device).startswith("cuda"):
        import torch

        torch.cuda.empty_cache()


def freeze_heap(collect: bool) -> None:
    """Keep what lives now (torch, the model, the worker's tables: some 300,000 objects) out of
    the cyclic garbage collector's full passes. A full pass walks every object and runs on
    whatever thread allocates, the event loop's included: under a connection flood they came
    every second or two and each held the loop 40-360 ms (bench/README.md). With the heap
    frozen it walks only what came since (a few milliseconds). ``collect``: drop what is
    garbage first (start-up, a version unloaded); a reload's new objects are frozen as they
    are."""
    if collect:
        gc.unfreeze()
        gc.collect()
    gc.freeze()
    # Once more over what is left (nothing much): full passes are then judged against a heap
    # this small (one comes when it has grown by a quarter), not the frozen 300,000 objects.
    gc.collect()


class GcTimer:
    """Each pause of the cyclic garbage collector into ``gc_pause_seconds{generation}``
    (installed while the worker runs)."""

    def __init__(self, histogram: Any) -> None:
        self._by_gen = [histogram.labels(generation=str(g)) for g in range(3)]
        self._t0 = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self._by_gen[min(int(info["generation"]), 2)].observe(time.perf_counter() - self._t0)

    def install(self) -> GcTimer:
        gc.callbacks.append(self)
        return self

    def remove(self) -> None:
        with contextlib.suppress(ValueError):
            gc.callbacks.remove(self)


def self_check(d: Any) -> str | None:
    """One draft through the serving path on a scratch pool, rows of ones: None when its
    confidences and margins are finite, else what is wrong (NaN weights, a broken kernel)."""
    pool = d.new_pool(1, 4)
    lanes = pool.allocate(1)
    one = np.full((4, d.row_bytes // 2), 0x3F80, dtype=np.uint16)  # bf16 1.0
    pool.apply(lanes, np.array([4]), np.array([4]), np.ones(1, dtype=bool),
               one.view(np.uint8))
    r = d.draft(pool, lanes, np.array([4]), np.zeros(1, dtype=np.int64))
    if np.isfinite(r.confidence).all() and np.isfinite(r.margin).all():
        return None
    return "the drafter's confidences or margins are not finite (NaN or inf)"


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _cuda_memory(device: Any) -> tuple[Callable[[], int], Callable[[], int]]:
    """(allocated, reserved) bytes of ``device``, read when scraped: both are host-side
    counters of torch's allocator, no device synchronisation."""
    import torch

    return (lambda: int(torch.cuda.memory_allocated(device)),
            lambda: int(torch.cuda.memory_reserved(device)))


class WorkerApp:
    """One worker: ``await start()``, then ``await stop()`` (or ``run()`` until a signal)."""

    def __init__(self, config: WorkerConfig, *, drafter: Any = None,
                 registry: CollectorRegistry | None = None) -> None:
        self.config = config
        self.drafter = drafter
        self.registry = registry if registry is not None else CollectorRegistry()
        self.metrics = Metrics(self.registry)
        self.versions: Versions | None = None
        self.reloader: Reloader | None = None
        self._loader: Any = None  # the reload's thread, made at the first reload
        self.ready = False
        self.draining = False
        self.metrics_server: MetricsServer | None = None
        self.server: WorkerServer | None = None
        self.runner: Runner | None = None
        self.dispatcher: Dispatcher | None = None
        self.pool: Any = None
        self.buffers: BufferPool | None = None
        self._expiry_task: asyncio.Task[None] | None = None
        self._gc_timer: GcTimer | None = None
        # Every torch call (load, ring pool, warm-up, batches) on one thread: see
        # runner.new_device_thread.
        self._device = new_device_thread()
        self._stop_event: asyncio.Event | None = None
        self._stopped = False
        self._stopped_starting: str | None = None  # the signal that stopped start(), if one
        self.failed = False  # the runner died: exit 1 so the worker is restarted
        self.tcp_address: tuple[str, int] | None = None
        self.unix_path: str | None = None
        self.metrics_address: tuple[str, int] | None = None
        self.threads = 0  # torch intra-op threads in force, once started
        self.phase = "starting"  # what start() is doing, for /healthz before it is ready
        self._tcp_sock: socket.socket | None = None  # bound before loading, served on after
        self._unix_sock: socket.socket | None = None

    # -- start --------------------------------------------------------------------------------
    def health(self) -> tuple[bool, str]:
        if self.draining:
            return False, "draining"
        if not self.ready:
            return False, f"loading: {self.phase}"
        broken = self.dispatcher.outputs_broken if self.dispatcher is not None else None
        if broken is not None:
            return False, f"drafter outputs are broken: {broken}"
        return True, "ok"

    def liveness(self) -> tuple[bool, str]:
        return (False, "runner stopped") if self.failed else (True, "alive")

    async def start(self) -> None:
        c = self.config
        loop = asyncio.get_running_loop()
        self._stop_event = asyncio.Event()
        try:
            await self._bind_all()
        except StartupError:
            self._close_bound()
            raise
        warning = exposure_warning(c)
        if warning:
            log.warning("%s", warning)
        secret = read_secret(c.auth_secret_file) if c.auth_secret_file else None
        check_device(c.device)
        self.threads = await loop.run_in_executor(self._device, set_threads, c.threads)
        log.info("torch intra-op threads: %d%s", self.threads,
                 " (torch's default)" if c.threads == 0 else "")
        t0 = time.perf_counter()
        if self.drafter is None:
            log.info("loading drafter: %s on %s%s", c.checkpoint or "embedded default",
                     c.device, f" ({resolve_device(c.device)})" if c.device == "auto" else "")
            self.phase = f"reading the drafter {c.checkpoint or '(embedded default)'}"
            try:
                self.drafter = await loop.run_in_executor(self._device, load_drafter_for, c)
            except Exception as exc:
                from .drafter import CheckpointRefused

                # A refused folder says what is wrong in words, naming key, value and limit;
                # anything else is a surprise, and its class name helps.
                what = str(exc) if isinstance(exc, CheckpointRefused | OSError) \
                    else f"{type(exc).__name__}: {exc}"
                raise StartupError(f"cannot load the drafter ({c.checkpoint or 'embedded'}):"
                                   f" {what}") from exc
        d = self.drafter
        device, dtype = str(d.device), _dtype_name(d.dtype)
        self.metrics.watch_memory(rss_bytes, _cuda_memory(d.device)
                                  if device.startswith("cuda") else None)
        log.info("drafter %s (%s): drafter_identity %s markov_identity %s, device %s,"
                 " dtype %s, N %d, row_bytes %d (%d taps x %d), vocab %d, loaded in %.2f s",
                 getattr(d, "source", c.checkpoint or "embedded"),
                 getattr(d, "description", f"{getattr(d, 'family', '?')} family"),
                 d.drafter_identity.hex(), "none (no Markov head)"
                 if d.markov_identity == NO_MARKOV_HEAD else d.markov_identity.hex(), device,
                 dtype, d.num_spec,
                 d.row_bytes, d.n_taps, d.target_hidden, d.vocab_size, time.perf_counter() - t0)
        has_confidence = bool(getattr(d, "has_confidence", True))
        if not has_confidence:
            log.info("confidence head: absent (every confidence is 1.0 and predicts nothing:"
                     " HELLO replies carry CAP_NO_CONFIDENCE, STEP replies RPF_NO_CONFIDENCE,"
                     " and no predicted acceptance is shown; engines verify a static length)")
        if getattr(d, "draft_topk", 0):
            log.info("candidate walk: dspark_draft_topk %d (the Markov bias on the %d best base"
                     " logits of each position; in the Markov identity)", d.draft_topk,
                     d.draft_topk)
        self.phase = f"reserving the ring pool ({c.max_total_slots} slots of W {c.window})"
        try:
            self.pool = await loop.run_in_executor(self._device, d.new_pool,
                                                   c.max_total_slots, c.window)
        except Exception as exc:
            raise StartupError(f"cannot reserve the ring pool ({c.max_total_slots} slots of"
                               f" W {c.window}): {type(exc).__name__}: {exc}") from exc
        log.info("ring pool: %d slots x W %d = %.1f MiB (%d bytes per slot)", c.max_total_slots,
                 c.window, self.pool.nbytes / 2**20, self.pool.bytes_per_lane)
        self.metrics.window_memory.set(self.pool.nbytes)
        for text in config_warnings(c, d.row_bytes):
            log.warning("%s", text)
        broken: str | None = None
        if c.warmup:
            self.phase = "warming up"
            t1 = time.perf_counter()
            try:
                await loop.run_in_executor(self._device, d.warmup)
                broken = await loop.run_in_executor(self._device, self_check, d)
            except Exception as exc:
                raise StartupError(f"cannot warm up the drafter: {type(exc).__name__}:"
                                   f" {exc}") from exc
            log.info("warmed up in %.2f s", time.perf_counter() - t1)
            if broken is not None:
                log.error("the drafter's own check failed: %s; /healthz answers 503 and every"
                          " STEP ST_INTERNAL until it drafts finite values", broken)
        await self._prepare_graphs(loop, d)

        info = WorkerInfo(
            worker_name=c.resolved_worker_name, drafter_identity=d.drafter_identity,
            markov_identity=d.markov_identity, window=c.window, num_spec=d.num_spec,
            row_bytes=d.row_bytes, vocab_size=d.vocab_size, n_taps=d.n_taps,
            hidden=d.target_hidden, max_slots=c.session_slots,
            max_rows_per_step=c.max_rows_per_step,
            capabilities=CAP_TAPS_BF16 | CAP_MARGIN | CAP_TOP32
            | (0 if has_confidence else CAP_NO_CONFIDENCE),
            bytes_per_slot=int(self.pool.bytes_per_lane), device=device, dtype=dtype,
            version=__version__, limits=self._limits(d.row_bytes))
        self.metrics.confidence_head.set(1 if has_confidence else 0)
        self.versions = Versions(make_version(1, d, self.pool, info), c.max_versions)
        self.versions.on_unload = self._version_unloaded
        first = self.versions.newest
        self._set_info_metric(first)
        self.registry.register(VersionFamilies(self._version_rows))
        log.info("version 1 %s serves: %s, %.1f MiB of weights", first.name, first.source,
                 first.weights_bytes / 2**20)
        table = SessionTable(max_sessions=c.max_sessions, lane_capacity=c.max_total_slots,
                             idle_s=c.session_idle_s, unused_idle_s=c.handshake_timeout_s,
                             max_per_peer=c.sessions_per_peer,
                             lanes_per_connection=c.slots_per_connection,
                             lanes_per_peer=c.slots_per_peer,
                             reservation_idle_s=c.reservation_idle_s)
        holder: dict[str, Dispatcher] = {}
        self.runner = Runner(d, self.pool, window=c.window,
                             complete=lambda item: holder["d"].complete(item),
                             on_batch=lambda s, e: holder["d"].record_batch(s, e),
                             device_thread=self._device)
        shm = ShmOps(c.max_shm_region_bytes if c.unix else 0,
                     register=cuda_host_register if device.startswith("cuda") else None,
                     max_mapped_bytes=c.max_shm_mapped_bytes)
        self.metrics.shm_mapped.set_function(lambda: shm.mapped_bytes)
        self.dispatcher = Dispatcher(info, table, self.runner, self.metrics, secret=secret,
                                     shed_queue_steps=c.shed_queue_steps,
                                     max_frame_bytes=frame_limit(c, d.row_bytes),
                                     stats_extra=self._stats_extra, shm=shm,
                                     versions=self.versions)
        holder["d"] = self.dispatcher
        steps = {"drafter": self._reload_drafter}
        if c.canary_checkpoint:
            steps["canary"] = self._load_canary
            try:
                _, loaded, _ = await self._load_canary()
                log.info("%s", loaded)
            except Exception as exc:
                raise StartupError(f"cannot load the canary ({c.canary_checkpoint}):"
                                   f" {failure_words(exc)}") from exc
        self.runner.shadow = lambda: self.dispatcher.canary if self.dispatcher else None
        self.dispatcher.reload_hook = self.request_reload
        self.registry.register(CanaryFamilies(lambda: self.canary))
        self.reloader = Reloader(steps, self._reloaded)
        self.dispatcher.outputs_broken = broken
        self.runner.start(on_death=self._runner_died)
        factory = pinned_factory() if device.startswith("cuda") else bytearray
        # Keep an idle receive buffer per size class for every session held: each engine may
        # have a large STEP in flight at once.
        self.buffers = BufferPool(factory, idle_per_class=lambda: len(table))
        self.metrics.receive_buffers.set_function(lambda: self.buffers.held_bytes
                                                  if self.buffers else 0)
        self.server = WorkerServer(self.dispatcher, self.metrics, self.buffers,
                                   max_frame_bytes=frame_limit(c, d.row_bytes),
                                   max_connections=c.max_connections,
                                   partial_timeout_s=c.partial_frame_timeout_s,
                                   handshake_timeout_s=c.handshake_timeout_s,
                                   connection_idle_s=c.connection_idle_s,
                                   metrics_address=self.metrics_address,
                                   peer_host_of=functools.partial(
                                       peer_host, v4_prefix=c.peer_prefix_v4,
                                       v6_prefix=c.peer_prefix_v6,
                                       loopback_one=c.loopback_one_peer))
        try:
            if c.listen:
                host, port = parse_host_port(c.listen)
                self.tcp_address = await self.server.listen_tcp(host, port, self._tcp_sock)
                self._tcp_sock = None
            if c.unix:
                self.unix_path = await self.server.listen_unix(c.unix, self._unix_sock)
                self._unix_sock = None
        except OSError as exc:
            raise StartupError(f"draft listener {c.listen or c.unix}: {_why(exc)}") from exc
        self.server.start_sweeping()
        self._expiry_task = loop.create_task(self._expire_loop(), name="dspark-expiry")
        freeze_heap(collect=True)
        self._gc_timer = GcTimer(self.metrics.gc_pause).install()
        self.ready = True
        self.metrics.ready.set(1)
        if self.tcp_address:
            log.info("listening on tcp://%s:%d", *self.tcp_address)
        if self.unix_path:
            log.info("listening on unix://%s", self.unix_path)
        if c.port_file:  # before "ready": a failure here is still a start-up failure
            try:
                self._write_port_file(c.port_file)
            except OSError as exc:
                raise StartupError(f"port file {c.port_file}: {_why(exc)}") from None
        canary = self.canary
        log.info("ready: worker %r, W %d, N %d, max_slots %d, max_rows_per_step %d,"
                 " max_sessions %d, frame limit %d bytes%s%s", info.worker_name, c.window,
                 d.num_spec, c.max_slots, c.max_rows_per_step, c.max_sessions,
                 frame_limit(c, d.row_bytes), ", HELLO authentication on" if secret else "",
                 f", canary {canary.number} {canary.name} drafting in the shadow of"
                 f" {c.canary_fraction:.0%} of each session's slots" if canary else "")

    # -- versions and reload --------------------------------------------------------------------
    def _set_info_metric(self, newest: Version) -> None:
        """``dspark_worker_info`` names the newest version's identities, and
        ``dspark_worker_confidence_head`` says whether it has a confidence head."""
        d = newest.drafter
        self.metrics.confidence_head.set(1 if newest.has_confidence else 0)
        self.metrics.info.clear()
        self.metrics.info.labels(version=__version__, worker_name=newest.info.worker_name,
                                 device=str(d.device), dtype=_dtype_name(d.dtype),
                                 drafter_identity=newest.drafter_identity.hex(),
                                 markov_identity=newest.markov_identity.hex()).set(1)

    @property
    def canary(self) -> Canary | None:
        return self.dispatcher.canary if self.dispatcher is not None else None

    def _version_rows(self) -> list[tuple[str, str, str, str, str, int, int]]:
        """For ``VersionFamilies`` (the scrape's thread: copies, under the GIL)."""
        versions = self.versions
        if versions is None:
            return []
        newest = versions.newest
        rows = [(v.label, v.name, "newest" if v is newest else "older",
                 v.drafter_identity.hex(), v.markov_identity.hex(), v.sessions,
                 v.weights_bytes) for v in versions]
        c = self.canary
        if c is not None:
            rows.append((str(c.number), c.name, "canary", c.drafter_identity.hex(),
                         c.markov_identity.hex(), 0, weights_bytes(c.drafter)))
        return rows

    async def _load_canary(self) -> tuple[str, str, int | None]:
        """Load --canary-checkpoint (at start, and on each reload when it changed): (result,
        why, its version number)."""
        c, versions, disp = self.config, self.versions, self.dispatcher
        assert versions is not None and disp is not None and c.canary_checkpoint
        loop = asyncio.get_running_loop()
        loader = self._loader_thread()
        read = await loop.run_in_executor(loader, read_drafter_for, c, c.canary_checkpoint)
        old = disp.canary
        if old is not None and (old.drafter_identity, old.markov_identity) == (
                read.drafter_identity, read.markov_identity):
            return ("unchanged", f"{c.canary_checkpoint} holds canary {old.number} {old.name},"
                    " which runs already", old.number)
        problem = geometry_problem(read.loaded.config, disp.info)
        if problem is not None:
            raise ReloadFailed(f"the canary has {problem}")
        d = None
        try:
            d = await loop.run_in_executor(loader, build_drafter_for, c, read)
            del read  # the host copy of the weights
            if c.warmup:
                await loop.run_in_executor(loader, d.warmup)
            broken = await loop.run_in_executor(loader, self_check, d)
            if broken is not None:
                raise ReloadFailed(f"the canary's self-check failed: {broken}")
            number = versions.next_number()
            name = version_name(str(d.source), bytes(d.drafter_identity),
                                bytes(d.markov_identity))
            lanes = canary_lanes(c.canary_fraction, c.max_total_slots)
            canary = await loop.run_in_executor(loader, functools.partial(
                Canary, d, fraction=c.canary_fraction, capacity_lanes=lanes, window=c.window,
                number=number, name=name, source=str(d.source),
                num_spec=d.num_spec))
        except BaseException:
            d = None  # what it took of the device goes back, as for a failed reload
            await loop.run_in_executor(loader, release_device_memory, self.drafter.device)
            raise
        disp.canary = canary  # the old one's backlog and rings go with it
        disp.state_version += 1
        newest = versions.newest
        same = (newest.drafter_identity, newest.markov_identity) == (
            canary.drafter_identity, canary.markov_identity)
        return ("ok", f"canary {number} {name} drafts in the shadow of {c.canary_fraction:.0%}"
                f" of each session's slots ({lanes} ring lanes, {canary.pool.nbytes / 2**20:.1f}"
                " MiB)" + ("; it is the drafter version that serves new HELLOs, so it shadows"
                           " only sessions of other versions" if same else ""), number)


    def _version_unloaded(self, version: Version) -> None:
        """Nothing may hold the version's model once its last lanes are freed: what the app
        and the runner keep of the drafter now is the newest's."""
        assert self.versions is not None
        newest = self.versions.newest
        self.drafter, self.pool = newest.drafter, newest.pool
        if self.runner is not None:
            self.runner.drafter, self.runner.pool = newest.drafter, newest.pool
            # in order with the STEPs: after the lane frees of its sessions
            self.runner.submit_call(self._release_version, version)

    @staticmethod
    def _release_version(version: Version) -> None:
        """The device thread, after the version's sessions' lanes were freed."""
        device = version.drafter.device if version.drafter is not None else "cpu"
        version.drafter = version.pool = None
        t0 = time.perf_counter()
        freeze_heap(collect=True)  # the version's objects were frozen: collect them now
        log.info("version %d: its objects collected in %.0f ms", version.number,
                 (time.perf_counter() - t0) * 1000)
        release_device_memory(device)

    def request_reload(self, trigger: str) -> int | None:
        """Read --checkpoint (and --canary-checkpoint) again and load what changed beside what
        serves; the reload's number (STATS ``reloads``), or None when the worker cannot now."""
        if self.reloader is None or not self.ready or self.draining:
            why = "draining" if self.draining else "still starting"
            log.info("%s: reload not done: the worker is %s", trigger, why)
            return None
        log.info("%s: reloading %s", trigger, self.config.checkpoint or "the embedded drafter")
        return self.reloader.request(trigger)

    def _loader_thread(self) -> Any:
        if self._loader is None:
            self._loader = loader_thread(self.threads)
        return self._loader

    async def _reload_drafter(self) -> tuple[str, str, int | None]:
        """One reload of --checkpoint: (result, why, version now newest)."""
        c, versions, disp = self.config, self.versions, self.dispatcher
        assert versions is not None and disp is not None
        loop = asyncio.get_running_loop()
        loader = self._loader_thread()
        source = c.checkpoint or "the embedded drafter"
        read = await loop.run_in_executor(loader, read_drafter_for, c, c.checkpoint)
        same = versions.find(read.drafter_identity, read.markov_identity)
        if same is not None and same is versions.newest:
            return ("unchanged", f"{source} holds version {same.number} {same.name}, which"
                    " serves already", same.number)
        if same is not None:
            disp.add_version(same)
            self._set_info_metric(same)
            return ("ok", f"{source} holds version {same.number} {same.name}, loaded still: it"
                    " serves new HELLOs again", same.number)
        problem = geometry_problem(read.loaded.config, disp.info)  # before any device memory
        if problem is not None:
            raise ReloadFailed(problem)
        room = versions.room()
        if room is not None:
            freed = disp.versions_give_way()
            if freed is None:
                raise ReloadFailed(room)
            log.info("reload: version %d %s let go by its sessions, which did not draft, to"
                     " make room", freed.number, freed.name)
        d = None
        try:
            d = await loop.run_in_executor(loader, build_drafter_for, c, read)
            del read  # the host copy of the weights
            try:
                pool = versions.newest.pool.sibling(d.model)
            except ValueError as exc:
                raise ReloadFailed(f"{exc} (the versions share one ring memory; a restart"
                                   " serves it)") from None
            if c.warmup:
                await loop.run_in_executor(loader, d.warmup)
            broken = await loop.run_in_executor(loader, self_check, d)
            if broken is not None:
                raise ReloadFailed(f"its self-check failed: {broken}")
            await self._prepare_version_graphs(loop, d, pool)
        except BaseException:
            d = None
            await loop.run_in_executor(loader, release_device_memory, self.drafter.device)
            raise
        version = make_version(versions.next_number(), d, pool, disp.info)
        disp.add_version(version)
        self._set_info_metric(version)
        freeze_heap(collect=False)
        return ("ok", f"version {version.number} {version.name} ({version.source},"
                f" {version.weights_bytes / 2**20:.1f} MiB of weights) serves new HELLOs",
                version.number)

    async def _prepare_version_graphs(self, loop: asyncio.AbstractEventLoop, d: Any,
                                      pool: Any) -> None:
        """A reloaded version's captured draft step (--cuda-graphs), on the device thread
        between batches; its self-check uses lanes no session holds, so live windows stay."""
        prepare = getattr(d, "prepare_graphs", None)
        if prepare is None or not str(d.device).startswith("cuda"):
            return

        def run() -> Any:
            free = np.flatnonzero(~pool._in_use)
            if not free.size:
                return None
            return prepare(pool, self.config.max_slots, self.config.cuda_graphs,
                           lanes=free.astype(np.int64))

        report = await loop.run_in_executor(self._device, run)
        if report is None:
            log.warning("cuda graphs: no free lane to check the captured step on; the new"
                        " version drafts eagerly")
        elif report.fallback is not None:
            self.metrics.cuda_graph_fallbacks.inc()
            log.warning("cuda graphs: the new version drafts eagerly, the captured step failed"
                        " its check: %s", report.fallback)

    def _reloaded(self, outcome: ReloadOutcome) -> None:
        self.metrics.reloads.labels(what=outcome.what, result=outcome.result).inc()
        if self.dispatcher is not None:
            self.dispatcher.state_version += 1
        if outcome.result == "failed":
            newest, canary = (self.versions.newest if self.versions else None), self.canary
            if outcome.what == "canary":
                kept = (f"canary {canary.number} {canary.name} keeps running" if canary
                        else "no canary runs")
            else:
                kept = (f"version {newest.number} {newest.name} keeps serving" if newest
                        else "nothing changed")
            log.error("reload of the %s failed (%.2f s): %s; %s", outcome.what,
                      outcome.seconds, outcome.why, kept)
        else:
            log.info("reload of the %s %s in %.2f s: %s", outcome.what, outcome.result,
                     outcome.seconds, outcome.why)

    async def _prepare_graphs(self, loop: asyncio.AbstractEventLoop, d: Any) -> None:
        """The draft step as captured graphs (--cuda-graphs), before any session holds a
        window: the self-check writes random ring contents."""
        c = self.config
        prepare = getattr(d, "prepare_graphs", None)
        if prepare is None:
            return
        try:
            report = await loop.run_in_executor(self._device, prepare, self.pool, c.max_slots,
                                                c.cuda_graphs)
        except Exception as exc:  # pragma: no cover - prepare_graphs catches what capture raises
            raise StartupError(f"cannot prepare the draft step: {type(exc).__name__}: {exc}"
                               ) from exc
        self.metrics.cuda_graphs.set(report.graphs)
        if report.fallback is not None:
            self.metrics.cuda_graph_fallbacks.inc()
            log.warning("cuda graphs: drafting eagerly, the captured step failed its start-up"
                        " check: %s", report.fallback)
        elif report.graphs:
            log.info("cuda graphs: %d captured for buckets %s and checked against the eager"
                     " step in %.2f s", report.graphs, ",".join(map(str, report.buckets)),
                     report.seconds)

    async def _bind_all(self) -> None:
        """Every listener bound and every path checked before anything slow is loaded: a busy
        port or a missing folder is one line at once, not a traceback minutes later."""
        c = self.config
        for what, path in (("port file", c.port_file), ("unix socket", c.unix)):
            if path:
                folder = os.path.dirname(os.path.abspath(path))
                if not os.path.isdir(folder):
                    raise StartupError(f"{what} {path}: folder {folder} does not exist")
                if not os.access(folder, os.W_OK | os.X_OK):
                    raise StartupError(f"{what} {path}: folder {folder} is not writable")
        if c.port_file and os.path.isdir(c.port_file):
            raise StartupError(f"port file {c.port_file}: is a directory; name a file in it")
        if c.listen:
            host, port = parse_host_port(c.listen)
            try:
                self._tcp_sock = bind_tcp(host, port)
            except OSError as exc:
                raise StartupError(f"draft listener {c.listen}: {_why(exc)}") from None
        if c.unix:
            try:
                self._unix_sock = bind_unix(c.unix)
            except OSError as exc:
                raise StartupError(f"unix socket {c.unix}: {_why(exc)}") from None
        if c.metrics_listen:
            self.metrics_server = MetricsServer(self.registry, self.health, self.liveness)
            try:
                self.metrics_address = await self.metrics_server.start(
                    *parse_host_port(c.metrics_listen))
            except OSError as exc:
                hint = ("; another worker on this host? give this one its own"
                        " --metrics-listen (or none)" if _in_use(exc) else "")
                raise StartupError(f"metrics listener {c.metrics_listen}: {_why(exc)}{hint}"
                                   ) from None
            log.info("metrics on http://%s:%d/metrics (and /healthz)", *self.metrics_address)

    def _close_bound(self) -> None:
        """Sockets bound by ``_bind_all`` and not yet served on (a failed start)."""
        if self._tcp_sock is not None:
            self._tcp_sock.close()
            self._tcp_sock = None
        if self._unix_sock is not None:
            unlink_own_socket(self.config.unix or "", self._unix_sock)
            self._unix_sock.close()
            self._unix_sock = None

    def _runner_died(self, exc: BaseException) -> None:
        """Nothing can be drafted any more: say so on /healthz and stop, so that the
        orchestrator restarts the worker instead of leaving engines waiting on it."""
        self.ready = False
        self.failed = True
        self.metrics.ready.set(0)
        self.request_stop()

    def _limits(self, row_bytes: int) -> dict[str, Any]:
        c = self.config
        return {"max_slots": c.max_slots, "max_rows_per_step": c.max_rows_per_step,
                "max_sessions": c.max_sessions, "max_total_slots": c.max_total_slots,
                "max_sessions_per_peer": c.sessions_per_peer,
                "max_slots_per_connection": c.slots_per_connection,
                "max_slots_per_peer": c.slots_per_peer,
                "reservation_idle_s": c.reservation_idle_s,
                "max_connections": c.max_connections,
                "max_frame_bytes": frame_limit(c, row_bytes),
                "max_shm_region_bytes": c.max_shm_region_bytes if c.unix else 0,
                "max_shm_mapped_bytes": c.max_shm_mapped_bytes,
                "session_idle_s": c.session_idle_s,
                "partial_frame_timeout_s": c.partial_frame_timeout_s,
                "handshake_timeout_s": c.handshake_timeout_s,
                "connection_idle_s": c.connection_idle_s,
                "shed_queue_steps": c.shed_queue_steps}

    def _stats_extra(self) -> dict[str, Any]:
        table = self.dispatcher.table if self.dispatcher else None
        per_lane = int(self.pool.bytes_per_lane) if self.pool is not None else 0
        device_bytes = None
        d = self.drafter
        if d is not None and str(d.device).startswith("cuda"):
            import torch

            device_bytes = int(torch.cuda.memory_allocated(d.device))
        return {
            "threads": self.threads,
            "reloads": self.reloader.summary() if self.reloader is not None else None,
            "connections": len(self.server.connections) if self.server else 0,
            "memory": {
                "window_bytes": int(self.pool.nbytes) if self.pool is not None else 0,
                "window_used_bytes": per_lane * (table.lanes_reserved if table else 0),
                "window_bytes_per_slot": per_lane,
                "receive_buffers_bytes": self.buffers.held_bytes if self.buffers else 0,
                "rss_bytes": rss_bytes(),
                "device_allocated_bytes": device_bytes,
            },
        }

    def _write_port_file(self, path: str) -> None:
        data = {
            "listen": f"{self.tcp_address[0]}:{self.tcp_address[1]}" if self.tcp_address
            else None,
            "unix": self.unix_path,
            "metrics": f"{self.metrics_address[0]}:{self.metrics_address[1]}"
            if self.metrics_address else None,
            "pid": os.getpid(),
        }
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)  # readers never see half a file

    async def _expire_loop(self) -> None:
        c = self.config
        interval = min(EXPIRY_SCAN_MAX_S, max(min(c.session_idle_s, c.handshake_timeout_s) / 10,
                                              0.05))
        while True:
            await asyncio.sleep(interval)
            if self.dispatcher is not None:
                self.dispatcher.expire_idle()

    # -- run and stop -------------------------------------------------------------------------
    def request_stop(self) -> None:
        if self._stop_event is not None:
            self._stop_event.set()

    async def run(self, install_signals: bool = True) -> int:
        """Start, serve until SIGTERM/SIGINT (or ``request_stop``), drain; the exit code."""
        loop = asyncio.get_running_loop()
        if install_signals:
            # Signals whose default action kills the process at once, with no log line and no
            # drain: SIGHUP reloads the drafter (the log goes to stderr: nothing to reopen),
            # SIGUSR1/2 are logged and write every thread's stack to stderr, SIGQUIT shuts
            # down like SIGTERM.
            for sig in (signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
                loop.add_signal_handler(sig, self._on_harmless_signal, sig)
            loop.add_signal_handler(signal.SIGQUIT, self._on_signal, signal.SIGQUIT)
            # Until it serves, SIGTERM and SIGINT stop the start (the drafter may take minutes
            # to load) with a line that says so, not the default's silent death.
            starting = asyncio.current_task()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self._on_signal_while_starting, sig, starting)
        try:
            await self.start()
        except asyncio.CancelledError:
            if self._stopped_starting is None:
                raise
            current = asyncio.current_task()
            if current is not None:
                current.uncancel()
            self._close_bound()
            with contextlib.suppress(Exception):
                await self.stop()
            log.info("%s: stopped before serving", self._stopped_starting)
            return 0
        except BaseException:
            self._close_bound()
            with contextlib.suppress(Exception):
                await self.stop()  # whatever had started: runner, listeners, metrics
            raise
        if install_signals:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self._on_signal, sig)
        if self._stop_event is not None:
            await self._stop_event.wait()
        return await self.stop()

    def _on_harmless_signal(self, sig: int) -> None:
        name = signal.Signals(sig).name
        if sig == signal.SIGHUP:
            self.request_reload("SIGHUP")
            return
        log.info("%s: ignored; the stacks of every thread follow on stderr", name)
        import faulthandler

        faulthandler.dump_traceback(all_threads=True)

    def _on_signal_while_starting(self, sig: int, starting: asyncio.Task[Any] | None) -> None:
        name = signal.Signals(sig).name
        if self._stopped_starting is not None or starting is None:
            return
        self._stopped_starting = name
        log.info("%s while starting (%s): stopping", name, self.phase)
        starting.cancel()

    def _on_signal(self, sig: int) -> None:
        if self._stop_event is not None and self._stop_event.is_set():
            log.warning("%s again: closing connections without waiting",
                        signal.Signals(sig).name)
            if self.server is not None:
                for conn in list(self.server.connections.values()):
                    conn.abort()
            return
        log.info("%s: shutting down", signal.Signals(sig).name)
        self.request_stop()

    async def _drain_connections(self, server: WorkerServer, limit_s: float) -> None:
        """Keep listening while every HELLO and STEP gets ST_DRAINING and its connection closes,
        until no connection is left, no frame came for DRAIN_QUIET_S, or ``limit_s`` passed.
        A second signal aborts the connections."""
        n = len(server.connections)
        log.info("draining: HELLO and STEP answer DRAINING for up to %.1f s (%d connections)",
                 limit_s, n)
        start = time.perf_counter()  # the clock of the frames' arrival times
        deadline = start + limit_s
        while server.connections:
            now = time.perf_counter()
            last = self.dispatcher.last_frame_at if self.dispatcher is not None else start
            if now >= deadline or now - max(start, last) >= DRAIN_QUIET_S:
                break
            await asyncio.sleep(DRAIN_POLL_S)
        if server.connections:
            log.info("drain: %d connections still open after %.1f s", len(server.connections),
                     limit_s)

    async def stop(self) -> int:
        """Graceful shutdown: drain (up to drain_s), stop accepting, answer every STEP already
        accepted (up to shutdown_timeout_s), close. The exit code: 0, or 1 when the runner had
        died."""
        if self._stopped:
            return 0
        self._stopped = True
        self.draining = True
        code = 0
        if self.reloader is not None:
            self.reloader.cancel()
        if self.dispatcher is not None:
            self.dispatcher.draining = True
        self.metrics.ready.set(0)
        if self.server is not None and self.config.drain_s > 0:
            await self._drain_connections(self.server, self.config.drain_s)
        if self.server is not None:
            await self.server.stop_accepting()
            busy = self.server.busy_connections()
            if busy:
                log.info("waiting for %d in-flight STEPs", busy)
        if self.runner is not None and self.runner.alive:
            try:
                await asyncio.wait_for(self.runner.drain(), self.config.shutdown_timeout_s)
            except asyncio.TimeoutError:
                log.warning("in-flight STEPs did not finish in %.0f s; closing anyway",
                            self.config.shutdown_timeout_s)
        if self.server is not None:
            await self.server.close_all()
        if self._expiry_task is not None:
            self._expiry_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._expiry_task
        if self.runner is not None:
            await self.runner.stop()
        self._device.shutdown(wait=False)  # the runner's, or idle if start failed before it
        if self._loader is not None:
            self._loader.shutdown(wait=False, cancel_futures=True)
        if self.dispatcher is not None:
            log.info("stopped: %d sessions held at exit, %d STEPs served",
                     len(self.dispatcher.table), self.metrics.totals["steps"])
        if self.metrics_server is not None:
            await self.metrics_server.stop()
        if self.buffers is not None:
            self.buffers.clear()
        if self._gc_timer is not None:
            self._gc_timer.remove()
        self._remove_port_file()
        return 1 if self.failed else code

    def _remove_port_file(self) -> None:
        """A clean exit takes its port file away (a stale one would point a supervisor or a
        script at a port nobody serves); one another process has rewritten since is left."""
        path = self.config.port_file
        if not path:
            return
        with contextlib.suppress(OSError, ValueError):
            if json.loads(Path(path).read_text()).get("pid") == os.getpid():
                os.unlink(path)
