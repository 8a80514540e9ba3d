"""The names engine code imports (``from protocol import wire``), with the meanings of
docs/contract.md. Nothing is defined here; this module only gathers them in one place so the
import surface engines depend on is explicit and tested.
"""

from __future__ import annotations

from .constants import (
    APP_HEADER_SIZE,
    CAP_MARGIN,
    CAP_TAPS_BF16,
    CAP_TOP32,
    FATAL_FRAME_STATUS,
    FRAME_STATUS_NAMES,
    MAX_TOP_K,
    OP_HELLO,
    OP_PING,
    OP_RESET,
    OP_STATS,
    OP_STEP,
    Q_TOTAL,
    REQ_STATUS_NAMES,
    RF_NEED_DRAFT,
    RF_RELEASE,
    RF_RESET,
    RPF_MARGIN,
    RPF_SAMPLED,
    RS_NO_WINDOW,
    RS_OK,
    RS_PARTIAL_WINDOW,
    RS_SHED,
    RS_STALE_GENERATION,
    SAMPLE_GREEDY,
    SAMPLE_TOP32,
    ST_AUTH,
    ST_BAD_FRAME,
    ST_BUSY,
    ST_GEOMETRY,
    ST_IDENTITY,
    ST_INTERNAL,
    ST_LIMITS,
    ST_NO_SESSION,
    ST_OK,
    ST_STALE_SEQ,
    ST_VERSION,
    TAPS_BF16,
    U32_MASK,
    USABLE_REQ_STATUS,
    VERSION,
)
from .errors import WireError
from .framing import FrameDecoder, frame, split_frame
from .header import AppHeader
from .messages import (
    HELLO_REP,
    HELLO_STRUCT,
    Hello,
    HelloReply,
    ReqEntry,
    StepHeader,
    StepReply,
    decode_step,
    pack_reset,
    pack_step_prefix,
    rows_offset_for,
)

__all__ = [
    "APP_HEADER_SIZE", "CAP_MARGIN", "CAP_TAPS_BF16", "CAP_TOP32", "FATAL_FRAME_STATUS",
    "FRAME_STATUS_NAMES", "HELLO_REP", "HELLO_STRUCT", "MAX_TOP_K", "OP_HELLO", "OP_PING",
    "OP_RESET", "OP_STATS", "OP_STEP", "Q_TOTAL", "REQ_STATUS_NAMES", "RF_NEED_DRAFT",
    "RF_RELEASE", "RF_RESET", "RPF_MARGIN", "RPF_SAMPLED", "RS_NO_WINDOW", "RS_OK",
    "RS_PARTIAL_WINDOW", "RS_SHED", "RS_STALE_GENERATION", "SAMPLE_GREEDY", "SAMPLE_TOP32",
    "ST_AUTH", "ST_BAD_FRAME", "ST_BUSY", "ST_GEOMETRY", "ST_IDENTITY", "ST_INTERNAL",
    "ST_LIMITS", "ST_NO_SESSION", "ST_OK", "ST_STALE_SEQ", "ST_VERSION", "TAPS_BF16",
    "U32_MASK", "USABLE_REQ_STATUS", "VERSION", "AppHeader", "FrameDecoder", "Hello",
    "HelloReply", "ReqEntry", "StepHeader", "StepReply", "WireError", "decode_step", "frame",
    "pack_reset", "pack_step_prefix", "rows_offset_for", "split_frame",
]
