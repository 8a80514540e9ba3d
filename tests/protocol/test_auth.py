"""HELLO authentication (docs/contract.md section 11)."""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from pathlib import Path

import msgspec
import pytest

from protocol.auth import ZERO_TAG, hello_auth_tag, sign_hello, verify_hello
from protocol.messages import AUTH_TAG_OFFSET, Hello

SECRET = b"a shared secret"
SESSION, SEQ = 0x1234ABCD, 41

HELLO = Hello(sample_mode=1, window=64, num_spec=4, max_slots=8, max_rows_per_step=512,
              row_bytes=96, vocab_size=1000, n_taps=3, hidden=16,
              drafter_identity=bytes(range(32)), markov_identity=bytes(range(32, 64)),
              client_name="vllm-dp0@host-a")


def test_the_tag_is_the_contract_hmac() -> None:
    signed = sign_hello(SECRET, SESSION, SEQ, HELLO)
    body = HELLO.pack()
    assert AUTH_TAG_OFFSET == 128
    assert body[AUTH_TAG_OFFSET:] == ZERO_TAG
    want = hmac.new(SECRET, struct.pack("<IQ", SESSION, SEQ) + body, hashlib.sha256).digest()
    assert signed.auth_tag == want
    assert signed.pack()[AUTH_TAG_OFFSET:] == want
    assert signed.without_auth() == HELLO
    # the tag over the packed body (a worker holding bytes) is the same
    assert hello_auth_tag(SECRET, SESSION, SEQ, signed.pack()) == want


def test_a_signed_hello_verifies_after_the_wire() -> None:
    signed = sign_hello(SECRET, SESSION, SEQ, HELLO)
    assert verify_hello(SECRET, SESSION, SEQ, Hello.unpack(signed.pack()))


def test_signing_twice_gives_the_same_tag() -> None:
    once = sign_hello(SECRET, SESSION, SEQ, HELLO)
    assert sign_hello(SECRET, SESSION, SEQ, once) == once


@pytest.mark.parametrize(("secret", "session", "seq"), [
    (b"another secret", SESSION, SEQ),
    (SECRET + b"!", SESSION, SEQ),
    (SECRET, SESSION + 1, SEQ),
    (SECRET, SESSION ^ 0x80000000, SEQ),
    (SECRET, SESSION, SEQ + 1),
    (SECRET, SESSION, SEQ - 1),
])
def test_another_secret_session_or_seq_fails(secret: bytes, session: int, seq: int) -> None:
    signed = sign_hello(SECRET, SESSION, SEQ, HELLO)
    assert not verify_hello(secret, session, seq, signed)


# Offsets of one byte in each kind of field (6.1): numbers, identities, the name, the tag.
FLIPS = {"version": 0, "sample_mode": 2, "tap_dtype": 3, "window": 4, "num_spec": 6,
         "max_slots": 8, "max_rows_per_step": 12, "row_bytes": 16, "vocab_size": 20,
         "n_taps": 24, "hidden": 28, "drafter_identity": 45, "markov_identity": 95,
         "client_name": 96, "auth_tag_first": 128, "auth_tag_last": 159}


@pytest.mark.parametrize("field", list(FLIPS))
def test_a_flipped_byte_fails(field: str) -> None:
    raw = bytearray(sign_hello(SECRET, SESSION, SEQ, HELLO).pack())
    raw[FLIPS[field]] ^= 0x01  # 'v' -> 'w' in the name: still UTF-8
    tampered = Hello.unpack(bytes(raw))
    assert not verify_hello(SECRET, SESSION, SEQ, tampered)


def test_without_a_secret_the_tag_is_zero_and_anything_passes() -> None:
    for secret in (None, b""):
        unsigned = sign_hello(secret, SESSION, SEQ, HELLO)
        assert unsigned.auth_tag == ZERO_TAG
        assert verify_hello(secret, SESSION, SEQ, unsigned)
        junk = msgspec.structs.replace(HELLO, auth_tag=b"\x5a" * 32)
        assert verify_hello(secret, 1, 2, junk)


def test_a_secret_refuses_an_unsigned_hello() -> None:
    assert not verify_hello(SECRET, SESSION, SEQ, HELLO)
    assert not verify_hello(SECRET, SESSION, SEQ, sign_hello(None, SESSION, SEQ, HELLO))


def test_read_secret_file_one_rule(tmp_path: Path) -> None:
    from protocol.auth import MAX_SECRET_FILE_BYTES, read_secret_file

    f = tmp_path / "s"
    f.write_bytes(b"  top secret\n")
    assert read_secret_file(f) == b"top secret"
    f.write_bytes(b" \n\t")
    with pytest.raises(ValueError, match="empty secret"):
        read_secret_file(f)
    f.write_bytes(b"x" * (MAX_SECRET_FILE_BYTES + 1))
    with pytest.raises(ValueError, match="not a secret file"):
        read_secret_file(f)
    with pytest.raises(ValueError, match="cannot be read"):
        read_secret_file(tmp_path / "missing")
    # a FIFO would block the open for ever, a device never ends: refused by name, at once
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match=f"'{fifo}' cannot be read as a secret file: is a"
                                         " FIFO, not a regular file"):
        read_secret_file(fifo)
    with pytest.raises(ValueError, match="is a character device, not a regular file"):
        read_secret_file("/dev/zero")
