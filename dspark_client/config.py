"""The client's configuration: where the worker is, how long to wait, how to back off.

``RemoteConfig`` is one frozen msgspec Struct, validated when it is made (also when it is
decoded from JSON or a dict with ``RemoteConfig.from_dict``); every refusal names the field and
the value. Times are milliseconds, as engines configure them.
"""

from __future__ import annotations

import math
import os
from typing import Any, Final

import msgspec

from protocol.auth import read_secret_file

from .discovery import check_endpoint
from .placement import rank
from .transport import DEFAULT_MAX_REPLY_BYTES, EndpointError

__all__ = ["DEFAULT_ENDPOINT", "RemoteConfig", "RemoteConfigError", "load_auth_secret"]

DEFAULT_ENDPOINT: Final = "tcp://127.0.0.1:7600"
# A secret file larger than this is not a secret file (a wrong path, a log): refuse it.


class RemoteConfigError(ValueError):
    """A RemoteConfig field holds a value the client cannot run with."""

    def __init__(self, field: str, value: object, why: str) -> None:
        super().__init__(f"RemoteConfig.{field} = {value!r}: {why}")
        self.field = field
        self.value = value


class RemoteConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Where the worker is and the client's clocks.

    endpoint: ``tcp://host:port``, ``unix:///path``, or ``dns+tcp://name:port`` for every
        worker whose address ``name`` resolves to (A and AAAA records; a Kubernetes headless
        Service), resolved again while the client runs (``dspark_client.discovery``).
    endpoints: further workers (any of the same forms). The worker set is all of them; the
        client works with the best-ranked one for its client name by rendezvous hashing
        (``dspark_client.placement``): engines spread over the set, each comes back to the same
        worker after a restart, and adding or removing one of n workers moves about 1/n of the
        engines. A move is under a new session: the new worker starts one with empty windows
        and the epoch change resyncs every slot (7.5).
    failover_after: consecutive failed connects or HELLOs on one worker before moving to the
        next-ranked one. A worker answering ``ST_DRAINING`` is left at once.
    return_after_ms: the quiet period. A worker that failed, drained or newly appeared becomes
        a candidate again only after this long without failing (and listed this long); then an
        engine that ranks it higher moves there (connecting first, so no round waits).
    resolve_interval_ms: how often ``dns+tcp`` endpoints are resolved again.
    connect_timeout_ms: deadline of one connect plus HELLO (background thread only).
    timeout_ms: deadline of one STEP round trip; the engine never waits longer (7.5).
    backoff_ms / backoff_max_ms: reconnect delay after a failure, doubled per failure up to the
        cap, reset by an accepted HELLO.
    jitter: each delay is scaled by a uniform factor in ``[1 - jitter, 1 + jitter]`` so that
        many engines do not reconnect to a restarted worker in lockstep.
    auth_secret / auth_secret_file: the shared secret of section 11 (at most one of them).
    max_reply_bytes: largest reply body accepted from the worker.
    follow_drafter: draft with whatever drafter the worker serves now (contract 6.5) instead of
        the one the HELLO's identities name: the HELLO carries ``HF_FOLLOW`` and no identities,
        the reply's say which drafter serves (``worker_info``). When the worker loads a new
        version (a reload), the client moves its session to it between two rounds: every live
        slot resyncs once. Off: the session keeps the drafter it names, and a worker that no
        longer serves it refuses the HELLO ``ST_IDENTITY``.
    """

    endpoint: str = DEFAULT_ENDPOINT
    endpoints: tuple[str, ...] = ()
    failover_after: int = 2
    return_after_ms: float = 10000.0
    resolve_interval_ms: float = 5000.0
    connect_timeout_ms: float = 1000.0
    timeout_ms: float = 100.0
    backoff_ms: float = 100.0
    backoff_max_ms: float = 5000.0
    jitter: float = 0.2
    auth_secret: bytes | None = None
    auth_secret_file: str | None = None
    max_reply_bytes: int = DEFAULT_MAX_REPLY_BYTES
    follow_drafter: bool = False

    def __post_init__(self) -> None:
        for i, ep in enumerate((self.endpoint, *self.endpoints)):
            field = "endpoint" if i == 0 else f"endpoints[{i - 1}]"
            try:
                check_endpoint(ep)
            except EndpointError as exc:
                raise RemoteConfigError(field, ep, str(exc)) from None
        if isinstance(self.failover_after, bool) or self.failover_after < 1:
            raise RemoteConfigError("failover_after", self.failover_after,
                                    "must be an integer >= 1")
        for field in ("connect_timeout_ms", "timeout_ms", "backoff_ms", "backoff_max_ms",
                      "resolve_interval_ms"):
            value = getattr(self, field)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise RemoteConfigError(field, value, "must be a finite number of ms above 0")
        if not (isinstance(self.return_after_ms, (int, float))
                and math.isfinite(self.return_after_ms) and self.return_after_ms >= 0):
            raise RemoteConfigError("return_after_ms", self.return_after_ms,
                                    "must be a finite number of ms >= 0")
        if self.backoff_max_ms < self.backoff_ms:
            raise RemoteConfigError("backoff_max_ms", self.backoff_max_ms,
                                    f"must be at least backoff_ms ({self.backoff_ms})")
        if not (math.isfinite(self.jitter) and 0.0 <= self.jitter < 1.0):
            raise RemoteConfigError("jitter", self.jitter, "must be a fraction in [0, 1)")
        if self.auth_secret is not None and self.auth_secret_file is not None:
            raise RemoteConfigError("auth_secret_file", self.auth_secret_file,
                                    "set auth_secret or auth_secret_file, not both")
        if self.auth_secret is not None and not self.auth_secret:
            raise RemoteConfigError("auth_secret", self.auth_secret,
                                    "an empty secret authenticates nothing; leave it unset")
        if self.auth_secret_file is not None and not self.auth_secret_file:
            raise RemoteConfigError("auth_secret_file", self.auth_secret_file, "empty path")
        if self.max_reply_bytes < 1024:
            raise RemoteConfigError("max_reply_bytes", self.max_reply_bytes,
                                    "must be at least 1024 bytes")

    @property
    def all_endpoints(self) -> tuple[str, ...]:
        """``endpoint`` then ``endpoints``, as configured (DNS ones unresolved)."""
        return (self.endpoint, *self.endpoints)

    def home_index(self, client_name: str) -> int:
        """Where in ``all_endpoints`` a client of this name starts when all are up: its
        best-ranked endpoint by rendezvous hashing (``placement.rank``: SHA-256 of the name
        and the endpoint), the same in every process and on every host. For a ``dns+tcp``
        endpoint the ranking is over its resolved addresses instead."""
        eps = self.all_endpoints
        return eps.index(rank(client_name, eps)[0])

    def secret(self) -> bytes | None:
        """The shared secret, reading ``auth_secret_file`` if that is how it is given."""
        if self.auth_secret_file is not None:
            return load_auth_secret(self.auth_secret_file)
        return self.auth_secret

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> RemoteConfig:
        """Build from a plain mapping (JSON, YAML, an engine's config); unknown keys are
        refused so that a typo does not silently keep a default."""
        try:
            return msgspec.convert(raw, cls, strict=False)
        except msgspec.ValidationError as exc:
            raise ValueError(f"RemoteConfig: {exc}") from None


def load_auth_secret(path: str | os.PathLike[str]) -> bytes:
    """The secret in a file, read by ``protocol.auth.read_secret_file`` (surrounding whitespace
    is not part of it), the rule the worker reads its ``--auth-secret-file`` by, so one file
    serves both."""
    try:
        return read_secret_file(path)
    except ValueError as exc:
        raise RemoteConfigError("auth_secret_file", os.fspath(path), str(exc)) from None
