"""The protocol's errors: one class per frame status (docs/contract.md section 5).

Every error carries what went wrong as attributes (``field``, ``value``, ``limit``, ``slot``,
``position``) as well as in its message, so callers decide on attributes, never on strings. The
worker turns an error into a frame status at one place (its dispatch) through ``status``.
"""

from __future__ import annotations

from typing import ClassVar

from .constants import (
    ST_AUTH,
    ST_BAD_FRAME,
    ST_BUSY,
    ST_DRAINING,
    ST_GEOMETRY,
    ST_IDENTITY,
    ST_INTERNAL,
    ST_LIMITS,
    ST_NO_SESSION,
    ST_STALE_SEQ,
    ST_VERSION,
)


class WireError(ValueError):
    """A frame or a reply breaks the contract. ``status`` is the frame status that answers it."""

    status: ClassVar[int] = ST_BAD_FRAME

    def __init__(
        self,
        message: str,
        *,
        field: str | None = None,
        value: object = None,
        limit: object = None,
        slot: int | None = None,
        position: int | None = None,
        entry: int | None = None,
    ) -> None:
        super().__init__(message)
        self.field = field
        self.value = value
        self.limit = limit
        self.slot = slot
        self.position = position
        self.entry = entry


class BadFrameError(WireError):
    """Malformed header or body (ST_BAD_FRAME)."""


class FrameHeaderError(BadFrameError):
    """The header cannot be read (wrong magic): the stream has lost its framing and must close."""


class FrameTooLargeError(BadFrameError):
    """body_len above the receiver's limit: answered ST_BAD_FRAME, then the connection closes."""


class ReplyValueError(WireError):
    """A STEP reply carries values the target must not see (sections 6.3 and 9.2)."""


class VersionError(WireError):
    status = ST_VERSION


class IdentityError(WireError):
    status = ST_IDENTITY


class GeometryError(WireError):
    status = ST_GEOMETRY


class LimitsError(WireError):
    status = ST_LIMITS


class AuthError(WireError):
    status = ST_AUTH


class NoSessionError(WireError):
    status = ST_NO_SESSION


class StaleSeqError(WireError):
    status = ST_STALE_SEQ


class BusyError(WireError):
    status = ST_BUSY


class InternalError(WireError):
    status = ST_INTERNAL


class DrainingError(WireError):
    status = ST_DRAINING


ERROR_FOR_STATUS: dict[int, type[WireError]] = {
    cls.status: cls
    for cls in (
        BadFrameError,
        VersionError,
        IdentityError,
        GeometryError,
        LimitsError,
        AuthError,
        NoSessionError,
        StaleSeqError,
        BusyError,
        InternalError,
        DrainingError,
    )
}
