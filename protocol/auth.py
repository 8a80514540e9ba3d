"""HELLO authentication (docs/contract.md section 11).

``auth_tag = HMAC-SHA256(secret, session u32 LE || seq u64 LE || Hello body, auth_tag zeroed)``.
Binding the tag to session and seq means a captured HELLO cannot be replayed under another
session, and the seq guard refuses it under the same one.
"""

from __future__ import annotations

import hashlib
import hmac
import struct

import msgspec

from .messages import AUTH_TAG_OFFSET, Hello

ZERO_TAG = bytes(32)


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
