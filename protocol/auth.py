"""HELLO authentication (docs/contract.md section 11).

``auth_tag = HMAC-SHA256(secret, session u32 LE || seq u64 LE || Hello body, auth_tag zeroed)``.
Binding the tag to session and seq means a captured HELLO cannot be replayed under another
session, and the seq guard refuses it under the same one.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct

import msgspec

from .messages import AUTH_TAG_OFFSET, Hello

ZERO_TAG = bytes(32)
# A secret file is a few dozen bytes; anything this large is the wrong file.
MAX_SECRET_FILE_BYTES = 64 << 10


def read_secret_file(path: str | os.PathLike[str]) -> bytes:
    """The shared secret in a file, the one rule for worker and client alike: surrounding
    whitespace (the newline of ``echo secret > file`` or of a Kubernetes secret) is not part
    of it. Raises ValueError naming the file for an unreadable, oversized or empty one."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_SECRET_FILE_BYTES + 1)
    except OSError as exc:
        raise ValueError(f"{os.fspath(path)!r} cannot be read: {exc.strerror or exc}") from None
    if len(data) > MAX_SECRET_FILE_BYTES:
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
