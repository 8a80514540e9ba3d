"""Drafter versions: the drafters a worker holds at once, which one serves a HELLO, how a new
one is loaded beside them (reload) and when an old one goes (docs/contract.md 6.1 and 6.5;
docs/operations.md, "Ship a new drafter").

A ``Version`` is one loaded drafter with its identities, source folder, load time and short
name (the folder's name and a hash prefix of its identities). Every version's ring pool is a
``RingPool.sibling`` over the same ring memory and lanes, so a second version costs its weights,
not a second ring pool; a drafter of another ring layout cannot be a version (a restart serves
it). A HELLO that names a version's identities is served by it for its whole session; the
newest serves HELLOs that follow the worker (``HF_FOLLOW``). A version other than the newest
is unloaded when its last session is gone.

``Reloader`` runs a reload: the files are read, the model built, warmed up and self-checked on
a loader thread (never the event loop, never the device thread's batches), and only once all
of that passed is the version added as the newest. Any failure leaves what serves as it was
and is said in one log line.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Final

from protocol.constants import CAP_NO_CONFIDENCE

from .config import DEFAULT_MAX_VERSIONS

log = logging.getLogger("dspark_worker")

# Versions (loaded or not) whose acceptance stays in STATS and /metrics: the bound of the
# ``version`` label, and enough to compare the drafters of the last few reloads.
VERSIONS_KEPT: Final = 8
# The loader's refusals whose message says what is wrong in words (bad or missing files, a
# geometry the worker cannot serve, a refused read); any other exception is logged with its
# class name.
# Reload outcomes STATS lists (``reloads.recent``): a few reloads of the drafter and canary.
RECENT_OUTCOMES: Final = 8
RELOAD_REFUSALS: Final[tuple[type[BaseException], ...]] = (ValueError, OSError)


class ReloadFailed(Exception):
    """A candidate drafter that cannot become a version; the message says why."""


@dataclass(eq=False)
class Version:
    """One loaded drafter version."""

    number: int  # 1, 2, ... in the order this worker loaded them
    name: str
    drafter: Any  # None once unloaded (its model and rings' view freed)
    pool: Any  # its RingPool over the shared ring memory; None once unloaded
    info: Any  # the WorkerInfo its HELLO replies carry (its identities)
    source: str
    loaded_at: float  # Unix time
    weights_bytes: int
    drafter_identity: bytes
    markov_identity: bytes
    has_confidence: bool = True  # False: a drafter without a confidence head
    sessions: int = 0
    loaded: bool = True
    superseded: bool = False  # another version serves new HELLOs (RPF_NEWER_DRAFTER)

    @property
    def label(self) -> str:
        """The ``version`` label of its metric series."""
        return str(self.number)

    def __repr__(self) -> str:
        return f"Version({self.number}, {self.name!r}, {self.sessions} sessions)"


def version_name(source: str, drafter_identity: bytes, markov_identity: bytes) -> str:
    """``<folder>@<8 hex>``: the name of the checkpoint folder the drafter was read from (the
    loader's resolved folder, so that ``current -> v7`` reads ``v7``: never resolved again
    here, where ``current`` may lead elsewhere by now) and a prefix of SHA-256 over both
    identities."""
    folder = Path(source).name or "drafter"
    digest = hashlib.sha256(drafter_identity + markov_identity).hexdigest()[:8]
    return f"{folder}@{digest}"


def weights_bytes(drafter: Any) -> int:
    """Bytes of the drafter's parameters and buffers (what a version costs beside the rings)."""
    model = getattr(drafter, "model", None)
    if model is None:
        return 0
    seen: set[int] = set()
    total = 0
    for t in (*model.parameters(), *model.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return int(total)


def geometry_problem(config: Any, info: Any) -> str | None:
    """Why a drafter of ``config`` (a ``DrafterConfig``) cannot serve beside what ``info``
    describes (the wire geometry every HELLO is checked against), or None."""
    diffs = [f"{name} {mine} (serving {theirs})" for name, mine, theirs in (
        ("num_spec", config.num_spec, info.num_spec),
        ("row_bytes", config.row_bytes, info.row_bytes),
        ("vocab_size", config.vocab_size, info.vocab_size),
        ("n_taps", config.n_taps, info.n_taps),
        ("hidden", config.target_hidden_size, info.hidden)) if mine != theirs]
    if not diffs:
        return None
    return "another geometry: " + ", ".join(diffs) + " (engines would need another HELLO;" \
        " a restart serves it)"


def make_version(number: int, drafter: Any, pool: Any, base_info: Any) -> Version:
    """Version ``number`` of ``drafter``: its HelloReply values are ``base_info``'s with its
    own identities and confidence capability (6.1, 6.5)."""
    # the folder the loader read (resolved once, there): never resolved again
    source = str(getattr(drafter, "source", "") or "drafter")
    d_id, m_id = bytes(drafter.drafter_identity), bytes(drafter.markov_identity)
    has_confidence = bool(getattr(drafter, "has_confidence", True))
    caps = base_info.capabilities & ~CAP_NO_CONFIDENCE | (0 if has_confidence
                                                         else CAP_NO_CONFIDENCE)
    return Version(number=number, name=version_name(source, d_id, m_id), drafter=drafter,
                   pool=pool, info=replace(base_info, drafter_identity=d_id,
                                           markov_identity=m_id, capabilities=caps),
                   source=source, loaded_at=time.time(), weights_bytes=weights_bytes(drafter),
                   drafter_identity=d_id, markov_identity=m_id, has_confidence=has_confidence)


class Versions:
    """The loaded versions (newest last), and the last ``VERSIONS_KEPT`` ever loaded."""

    def __init__(self, first: Version, max_versions: int = DEFAULT_MAX_VERSIONS) -> None:
        self.max_versions = max_versions
        self.loaded: list[Version] = [first]
        self.kept: OrderedDict[int, Version] = OrderedDict({first.number: first})
        self._next = first.number + 1
        # Called with each version as it is unloaded (metrics, logs).
        self.on_unload: Callable[[Version], None] = lambda v: None

    @property
    def newest(self) -> Version:
        return self.loaded[-1]

    def __iter__(self) -> Iterator[Version]:
        return iter(list(self.loaded))

    def __len__(self) -> int:
        return len(self.loaded)

    def next_number(self) -> int:
        n = self._next
        self._next += 1
        return n

    def find(self, drafter_identity: bytes, markov_identity: bytes) -> Version | None:
        for v in reversed(self.loaded):
            if v.drafter_identity == drafter_identity and v.markov_identity == markov_identity:
                return v
        return None

    def add(self, version: Version) -> list[Version]:
        """Make ``version`` the newest (a loaded one moves to the end); the versions this
        unloads (the one it replaces, when no session holds it)."""
        before = self.newest
        if version in self.loaded:
            self.loaded.remove(version)
        self.loaded.append(version)
        before.superseded = before is not version
        version.superseded = False
        self.kept[version.number] = version
        self.kept.move_to_end(version.number)
        while len(self.kept) > VERSIONS_KEPT:
            self.kept.popitem(last=False)
        return self._unload_if_unused(before)

    def session_added(self, version: Version) -> None:
        version.sessions += 1

    def session_gone(self, version: Version) -> list[Version]:
        version.sessions -= 1
        return self._unload_if_unused(version)

    def room(self) -> str | None:
        """Why another version cannot be loaded now, or None."""
        if len(self.loaded) < self.max_versions:
            return None
        held = ", ".join(f"version {v.number} {v.name} ({v.sessions} sessions)"
                         for v in self.loaded[:-1])
        return (f"{len(self.loaded)} versions are loaded, the limit (--max-versions"
                f" {self.max_versions}); {held} still serve sessions that draft with them")

    def _unload_if_unused(self, version: Version) -> list[Version]:
        if version is self.newest or version.sessions > 0 or not version.loaded:
            return []
        self.loaded.remove(version)
        version.loaded = False
        # ``on_unload`` lets go of the model and its rings' view once every lane operation of
        # its dropped sessions has run (in order on the device thread).
        log.info("version %d %s unloaded: no session holds it any more (%d loaded, newest %d"
                 " %s)", version.number, version.name, len(self.loaded), self.newest.number,
                 self.newest.name)
        self.on_unload(version)
        return [version]


@dataclass
class ReloadOutcome:
    """What one reload did: ``result`` "ok", "unchanged" or "failed"; ``why`` in words."""

    what: str  # "drafter" or "canary"
    result: str
    why: str
    number: int  # reloads asked so far, this one included
    at: float = field(default_factory=time.time)
    version: int | None = None  # the version now newest (or the canary's), when not failed
    seconds: float = 0.0

    def summary(self) -> dict[str, Any]:
        return {"number": self.number, "what": self.what, "result": self.result,
                "why": self.why, "at": round(self.at, 3), "version": self.version,
                "seconds": round(self.seconds, 3)}


def failure_words(exc: BaseException) -> str:
    """An exception of a reload as the words after "failed: "."""
    text = str(exc)
    if isinstance(exc, MemoryError) or "out of memory" in text.lower() \
            or "can't allocate memory" in text.lower():
        return f"no memory: {text or type(exc).__name__}"
    if isinstance(exc, (ReloadFailed, *RELOAD_REFUSALS)):
        return text or type(exc).__name__
    return f"{type(exc).__name__}: {text}"


class Reloader:
    """Runs reloads one at a time; a reload asked while one runs is run once after it
    (several such asks are one), so that the files read last are those on disk at the last
    ask. ``steps`` maps what is reloaded ("drafter", "canary") to the coroutine that does it
    and returns ``(result, why, version)``."""

    def __init__(self, steps: Mapping[str, Callable[[], Awaitable[tuple[str, str, int | None]]]],
                 on_outcome: Callable[[ReloadOutcome], None]) -> None:
        self.steps = steps
        self.on_outcome = on_outcome
        self.asked = 0  # reloads asked (SIGHUP, RELOAD)
        self.last: ReloadOutcome | None = None
        self.recent: deque[ReloadOutcome] = deque(maxlen=RECENT_OUTCOMES)
        self.outcomes: dict[tuple[str, str], int] = {}
        self._task: asyncio.Task[None] | None = None
        self._again = False

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def request(self, trigger: str) -> int:
        """Ask for a reload of everything in ``steps``; returns its number (STATS
        ``reloads.last.number`` reaches it once it is done)."""
        self.asked += 1
        if self.running:
            self._again = True
            log.info("reload asked (%s) while one runs: another follows it", trigger)
            return self.asked
        self._task = asyncio.get_running_loop().create_task(self._run(),
                                                            name="dspark-reload")
        return self.asked

    def cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def wait(self) -> None:
        while self.running:
            assert self._task is not None
            await asyncio.shield(self._task)

    async def _run(self) -> None:
        while True:
            self._again = False
            number = self.asked
            for what, step in self.steps.items():
                t0 = time.perf_counter()
                try:
                    result, why, version = await step()
                except asyncio.CancelledError:
                    raise
                except BaseException as exc:  # nothing a reload meets may stop the worker
                    result, why, version = "failed", failure_words(exc), None
                outcome = ReloadOutcome(what, result, why, number, version=version,
                                        seconds=time.perf_counter() - t0)
                self.last = outcome
                self.recent.append(outcome)
                key = (what, result)
                self.outcomes[key] = self.outcomes.get(key, 0) + 1
                self.on_outcome(outcome)
            if not self._again:
                return

    def summary(self) -> dict[str, Any]:
        return {"asked": self.asked, "running": self.running,
                "results": {f"{what}:{result}": n for (what, result), n
                            in sorted(self.outcomes.items())},
                "last": self.last.summary() if self.last is not None else None,
                "recent": [o.summary() for o in self.recent]}


def loader_thread(threads: int) -> ThreadPoolExecutor:
    """The thread a reload reads files and builds, warms up and checks its model on, with the
    device thread's torch thread count (a new thread would take torch's default: every core)."""
    def init() -> None:
        import torch

        if threads > 0:
            torch.set_num_threads(threads)

    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="dspark-loader",
                              initializer=init)
