"""HELLO and RELOAD authentication (docs/contract.md sections 10 and 11).

``auth_tag = HMAC-SHA256(secret, session u32 LE || seq u64 LE || Hello body, auth_tag zeroed)``.
Binding the tag to session and seq means a captured HELLO cannot be replayed under another
session, and the seq guard refuses it under the same one. A RELOAD body is ``at_ms`` u64 LE
(Unix time of signing), an 8-byte nonce and ``HMAC-SHA256(secret, "dspark RELOAD" 0x00 ||
at_ms || nonce)``: the worker refuses one signed too far from its clock or seen before.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from pathlib import Path

import msgspec

from .errors import AuthError, BadFrameError
from .identity import RegularFile, SafetensorsError
from .messages import AUTH_TAG_OFFSET, Hello

ZERO_TAG = bytes(32)
# A secret file is a few dozen bytes; anything this large is the wrong file.
MAX_SECRET_FILE_BYTES = 64 << 10


def read_secret_file(path: str | os.PathLike[str]) -> bytes:
    """The shared secret in a file, the one rule for worker and client alike: surrounding
    whitespace (the newline of ``echo secret > file`` or of a Kubernetes secret) is not part
    of it. Raises ValueError naming the file for an unreadable, oversized or empty one. It is
    read as a checkpoint's files are: a regular file only (a FIFO, which would block the open
    for ever, or a device is refused by name), opened without blocking, at most
    ``MAX_SECRET_FILE_BYTES + 1`` bytes read."""
    try:
        with RegularFile(Path(path)) as f:
            size = f.size
            data = f.read(0, MAX_SECRET_FILE_BYTES + 1)
    except SafetensorsError as exc:
        raise ValueError(f"{os.fspath(path)!r} cannot be read as a secret file:"
                         f" {str(exc).removeprefix(f'{Path(path)}: ')}") from None
    if max(size, len(data)) > MAX_SECRET_FILE_BYTES:
        raise ValueError(f"{os.fspath(path)!r} is over {MAX_SECRET_FILE_BYTES} bytes; not a"
                         " secret file")
    data = data.strip()
    if not data:
        raise ValueError(f"{os.fspath(path)!r} holds an empty secret")
    return data


def hello_auth_tag(secret: bytes, session: int, seq: int, hello: Hello | bytes) -> bytes:
    body = hello.without_auth().pack() if isinstance(hello, Hello) else (
        bytes(hello[:AUTH_TAG_OFFSET]) + ZERO_TAG)
    return hmac.new(secret, struct.pack("<IQ", session, seq) + body, hashlib.sha256).digest()


def sign_hello(secret: bytes | None, session: int, seq: int, hello: Hello) -> Hello:
    """The Hello with its tag set (zeros when there is no secret)."""
    tag = hello_auth_tag(secret, session, seq, hello) if secret else ZERO_TAG
    return msgspec.structs.replace(hello, auth_tag=tag)


def verify_hello(secret: bytes | None, session: int, seq: int, hello: Hello) -> bool:
    """Constant-time check. With no secret configured every tag is accepted."""
    if not secret:
        return True
    return hmac.compare_digest(hello_auth_tag(secret, session, seq, hello), hello.auth_tag)


RELOAD_DOMAIN = b"dspark RELOAD\0"
RELOAD_BODY = struct.Struct("<Q8s32s")  # at_ms, nonce, tag: 48 bytes
# How far a RELOAD's signing time may be from the worker's clock: a captured one is refused
# after this (and within it, its nonce has been seen).
RELOAD_MAX_SKEW_S = 60.0


def reload_tag(secret: bytes, at_ms: int, nonce: bytes) -> bytes:
    return hmac.new(secret, RELOAD_DOMAIN + struct.pack("<Q", at_ms) + nonce,
                    hashlib.sha256).digest()


def reload_body(secret: bytes, at_ms: int, nonce: bytes | None = None) -> bytes:
    """A RELOAD request body signed at ``at_ms`` (the Unix time now, in ms) with a fresh
    nonce."""
    n = os.urandom(8) if nonce is None else nonce
    return RELOAD_BODY.pack(at_ms, n, reload_tag(secret, at_ms, n))


def verify_reload(secret: bytes, body: bytes | memoryview, now_s: float) -> tuple[int, bytes]:
    """(at_ms, nonce) of a RELOAD body whose tag verifies and whose time is within
    ``RELOAD_MAX_SKEW_S`` of ``now_s``; BadFrameError for its size, AuthError otherwise."""
    if len(body) != RELOAD_BODY.size:
        raise BadFrameError(f"RELOAD body is {len(body)} bytes, not {RELOAD_BODY.size}",
                            field="body_len", value=len(body), limit=RELOAD_BODY.size)
    at_ms, nonce, tag = RELOAD_BODY.unpack(bytes(body))
    if not hmac.compare_digest(reload_tag(secret, at_ms, nonce), tag):
        raise AuthError("RELOAD authentication tag does not verify", field="auth_tag")
    skew = at_ms / 1000.0 - now_s
    if abs(skew) > RELOAD_MAX_SKEW_S:
        raise AuthError(f"RELOAD signed {skew:+.0f} s from the worker's clock (at most"
                        f" {RELOAD_MAX_SKEW_S:g} s either way)", field="at_ms", value=at_ms)
    return at_ms, nonce
