"""``remote_dspark``'s ``speculator_options``: checked once when vLLM builds its speculative
config, read again in each GPU worker process (the dict travels with the config). Imports
neither vLLM nor torch, so every refusal is testable on its own.

Two groups of keys (docs/vllm.md has the table):

* the client's: every ``RemoteConfig`` field but ``auth_secret`` (a secret on a command line is
  visible to every user of the host; ``auth_secret_file`` names a file instead), with
  ``RemoteConfig``'s defaults and checks;
* the HELLO's: ``window``, ``max_slots``, ``max_rows_per_step``, ``client_name`` and
  ``target_checkpoint``, as ``hello_from_checkpoint`` takes them. ``window`` left unset is the
  worker's (``dspark_client.adapter.worker.learn_window``): W is the worker's to decide.

Every value is checked for its type the same way (a string where a number belongs is refused,
never converted) and against an upper bound where one would otherwise block the engine or
exhaust its memory (``UPPER``).

The drafter is vLLM's ``model``: a folder on the engine host with the drafter's ``config.json``
(taps, N, vocabulary, hidden size) and either its weights or the ``dspark_identity.json`` the
worker writes beside them (its identities, contract 6.4), nothing else; with
``follow_drafter`` (the worker's newest drafter, contract 6.5) config.json alone.
"""

from __future__ import annotations

import difflib
import socket
from pathlib import Path
from typing import Any, Final

import msgspec

from dspark_client.config import RemoteConfig
from dspark_client.hello import hello_from_checkpoint
from protocol import wire
from protocol.constants import IDENTITY_BYTES, NAME_BYTES
from protocol.formats import locate_drafter
from protocol.identity import (
    IDENTITY_FILE,
    SafetensorsError,
    checkpoint_files,
    read_identity_record,
)
from protocol.messages import encode_name

__all__ = ["CLIENT_KEYS", "DEFAULT_WINDOW", "HELLO_KEYS", "UPPER", "RemoteDSparkOptions",
           "default_client_name", "drafter_hello", "parse_options", "recorded_identities"]

# The worker's default --window: the W an engine assumes when it leaves window unset and no
# worker answered at its start to say its own.
DEFAULT_WINDOW: Final = 1024
# The wire's window field is a u16 (contract 6.1).
MAX_WINDOW: Final = 0xFFFF
# RemoteConfig's fields, less the inline secret (see the module docstring).
CLIENT_KEYS: Final = frozenset(f.name for f in msgspec.structs.fields(RemoteConfig)) - {
    "auth_secret"}
HELLO_KEYS: Final = frozenset({"window", "max_slots", "max_rows_per_step", "client_name",
                               "target_checkpoint"})
_WHERE: Final = "speculative_config.speculator_options"
# The most each numeric option may be, and why: past these a value blocks the engine (rank 0
# waits connect_timeout_ms at start; a STEP never waits past timeout_ms, so a larger one is a
# hung engine step) or asks for memory no host has (max_rows_per_step rows are staged per STEP).
UPPER: Final[dict[str, tuple[float, str]]] = {
    "connect_timeout_ms": (60_000, "a minute (rank 0 waits this long for the worker at start)"),
    "timeout_ms": (10_000, "10 s (every engine step waits up to this long for its drafts)"),
    "backoff_ms": (60_000, "a minute"),
    "backoff_max_ms": (600_000, "10 minutes"),
    "return_after_ms": (3_600_000, "an hour"),
    "resolve_interval_ms": (3_600_000, "an hour"),
    "failover_after": (1000, "1000 attempts"),
    "max_reply_bytes": (1 << 30, "1 GiB"),
    "max_slots": (0xFFFFFFFF, "the HELLO's u32"),
    "max_rows_per_step": (1 << 20, "1,048,576 rows (the rows of one STEP are staged in memory;"
                          " the worker's default is 4096)"),
}
# msgspec's name of a type, as the refusal says what the option takes.
_KINDS: Final = {"float": "a number", "int": "an integer", "bool": "true or false",
                 "str": "a string", "array": "a list of endpoint strings",
                 "str | null": "a string"}


class RemoteDSparkOptions(msgspec.Struct, frozen=True, kw_only=True):
    """The options as checked: the client's config and the HELLO's fields (None: default)."""

    remote: RemoteConfig
    window: int | None = None  # None: the worker's
    max_slots: int | None = None
    max_rows_per_step: int | None = None
    client_name: str | None = None
    target_checkpoint: str | None = None


def _refuse(key: str, value: object, why: str) -> ValueError:
    return ValueError(f"{_WHERE}.{key} = {value!r}: {why}")


def _int(raw: dict[str, Any], key: str, low: int, high: int | None = None) -> int | None:
    value = raw.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _refuse(key, value, f"must be an integer (got {type(value).__name__})")
    high = int(UPPER[key][0]) if high is None and key in UPPER else high
    if value < low or (high is not None and value > high):
        raise _refuse(key, value, f"must be in [{low}, {high}]" if high is not None
                      else f"must be at least {low}")
    return value


def _unknown(key: str) -> ValueError:
    known = sorted(CLIENT_KEYS | HELLO_KEYS)
    if key == "auth_secret":
        hint = " (give the secret in a file: auth_secret_file)"
    else:
        close = difflib.get_close_matches(key, known, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
    return ValueError(f"{_WHERE}: unknown option {key!r}{hint}; the options are"
                      f" {', '.join(known)}")


def _remote_config(raw: dict[str, Any]) -> RemoteConfig:
    """The client's keys as ``RemoteConfig``: types strictly (a string is never read as a
    number), then the upper bounds, then ``RemoteConfig``'s own checks, each refusal named as
    the option it came from."""
    client = {k: v for k, v in raw.items() if k in CLIENT_KEYS}
    try:
        msgspec.convert(client, RemoteConfig, strict=True)
    except msgspec.ValidationError as exc:
        text = str(exc)
        where = text.rpartition(" - at `$.")[2].rstrip("`")
        key = where.split("[")[0]
        if text.startswith("Expected `") and key in client:
            wanted = "array" if "[" in where else text.partition("Expected `")[2].partition(
                "`")[0]
            got = type(client[key]).__name__
            raise _refuse(key, client[key], f"must be {_KINDS.get(wanted, wanted)}"
                          + ("" if wanted == "array" and got == "list" else f" (got {got})")
                          ) from None
    except ValueError:
        pass  # a value check: RemoteConfig says it below, by name
    for key, (high, why) in UPPER.items():
        value = client.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > high:
            raise _refuse(key, value, f"must be at most {high:g}: {why}")
    try:
        return RemoteConfig.from_dict(client)
    except ValueError as exc:
        # RemoteConfig's own words ("RemoteConfig.timeout_ms = -1.0: ..."), named as the
        # option they came from
        why = str(exc).removeprefix("RemoteConfig: ")
        raise ValueError(f"{_WHERE}.{why.removeprefix('RemoteConfig.')}"
                         if why.startswith("RemoteConfig.") else f"{_WHERE}: {why}") from None


def parse_options(raw: Any, *, where: str = _WHERE) -> RemoteDSparkOptions:
    """``speculator_options`` (a dict, or None for every default) checked: an unknown key, a
    value of the wrong type or out of range is a ValueError naming the key and the value, as
    an option of ``where`` (where the engine's user gives them; vLLM's by default)."""
    if where != _WHERE:
        # The same checks; each message begins with the place, which becomes ``where``.
        try:
            return parse_options(raw)
        except ValueError as exc:
            raise ValueError(where + str(exc).removeprefix(_WHERE)) from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ValueError(f"{_WHERE} must be a JSON object, got {type(raw).__name__}")
    unknown = sorted(set(raw) - CLIENT_KEYS - HELLO_KEYS)
    if unknown:
        raise _unknown(unknown[0])
    remote = _remote_config(raw)
    window = _int(raw, "window", 1, MAX_WINDOW)
    max_slots = _int(raw, "max_slots", 1)
    rows = _int(raw, "max_rows_per_step", 1)
    if rows is not None and window is not None and rows < window:
        raise _refuse("max_rows_per_step", rows,
                      f"must be at least the window ({window}): one slot's resync is W rows")
    name = raw.get("client_name")
    if name is not None:
        if not isinstance(name, str) or not name:
            raise _refuse("client_name", name, "must be a non-empty string")
        try:
            encode_name(name, "client_name")  # the HELLO's own rule: 32 bytes, no NUL
        except wire.WireError as exc:
            why = str(exc).removeprefix(f"client_name {name!r} ")
            raise _refuse("client_name", name, why) from None
    target = raw.get("target_checkpoint")
    if target is not None and (not isinstance(target, str) or not target):
        raise _refuse("target_checkpoint", target, "must be a path")
    return RemoteDSparkOptions(remote=remote, window=window, max_slots=max_slots,
                               max_rows_per_step=rows, client_name=name,
                               target_checkpoint=target)


def default_client_name(tag: str, host: str | None = None, *, engine: str = "vllm") -> str:
    """``<engine>-<tag>@<host>``: stable across restarts of this engine instance (contract 1)
    and distinct per engine on a host (``tag``: what tells them apart); the host name is cut to
    fit the wire's 32 bytes."""
    prefix = f"{engine}-{tag}@"
    host = host if host is not None else socket.gethostname()
    room = NAME_BYTES - len(prefix.encode("utf-8"))
    raw = host.encode("utf-8")[:max(room, 0)]
    return prefix + raw.decode("utf-8", errors="ignore")


def recorded_identities(drafter: str | Path) -> tuple[bytes, bytes] | None:
    """The identities in the ``dspark_identity.json`` beside ``drafter``, as the worker wrote
    them when it loaded the weights, taken as they are: this host has no weights to check them
    against, and a stale record only makes the worker refuse the HELLO (ST_IDENTITY). None when
    there is no such file; a file that is not such a record is an error."""
    found = read_identity_record(drafter)
    return None if found is None else (found[0], found[1])


def _has_weights(drafter: Path) -> bool:
    try:
        return bool(checkpoint_files(drafter))
    except SafetensorsError:
        return False


def drafter_hello(drafter: str | Path, opts: RemoteDSparkOptions, *, max_slots: int,
                  client_name: str, target_hidden_size: int, draft_topk: int | None = None,
                  target_checkpoint: str | Path | None = None,
                  identities_needed: bool = True, window: int | None = None,
                  max_rows_per_step: int | None = None, where: str = _WHERE,
                  folder: str = "remote_dspark's model") -> wire.Hello:
    """The HELLO for the drafter folder ``drafter`` on this host: geometry from its
    ``config.json``; identities from its weights (or a current ``dspark_identity.json`` beside
    them), else from the ``dspark_identity.json`` alone. The hidden size is the served
    model's; a drafter config that names another is refused here, not by the worker.
    Following the worker's drafter (``follow_drafter``, 6.5) the HELLO names no identities,
    and nothing is read for them. ``identities_needed`` False: the caller wants the geometry
    alone (the weights are not hashed; a folder that could not give identities is still
    refused). ``window``, ``max_rows_per_step``: where the options leave them unset (the
    worker's, as learnt at start); W neither: ``DEFAULT_WINDOW``. A MiniMax-M3 target's folder
    means its ``dspark/`` drafter (``protocol.formats.locate_drafter``)."""
    path, own_target = locate_drafter(drafter)
    w = opts.window or window or DEFAULT_WINDOW
    if opts.max_rows_per_step is not None and opts.max_rows_per_step < w:
        raise _refuse("max_rows_per_step", opts.max_rows_per_step,
                      f"must be at least the window W ({w}): one slot's resync is W rows")
    if not (path / "config.json").is_file():
        raise ValueError(f"{path}: no config.json; {folder} is the drafter's"
                         " folder on this host (its config.json, and its weights or the"
                         f" {IDENTITY_FILE} the worker writes beside them)")
    none = (bytes(IDENTITY_BYTES), bytes(IDENTITY_BYTES))
    identities = None
    if opts.remote.follow_drafter:
        identities = none
    elif not _has_weights(path):
        identities = recorded_identities(path)
        if identities is None:
            raise ValueError(f"{path}: neither the drafter's weights (*.safetensors) nor the"
                             f" {IDENTITY_FILE} the worker writes beside them; copy one of"
                             " them next to config.json (the HELLO carries the identities),"
                             f" or set {where}.follow_drafter to draft with"
                             " whichever drafter of this geometry the worker serves")
    elif not identities_needed:
        identities = none
    hello = hello_from_checkpoint(
        path, window=w, max_slots=max_slots,
        max_rows_per_step=opts.max_rows_per_step or max_rows_per_step, client_name=client_name,
        target_checkpoint=opts.target_checkpoint or target_checkpoint or own_target,
        target_hidden_size=target_hidden_size, draft_topk=draft_topk, identities=identities)
    if hello.hidden != target_hidden_size:
        raise ValueError(f"{path}/config.json drafts for a target of hidden size"
                         f" {hello.hidden}; the served model's is {target_hidden_size}")
    return hello
