"""Every number of the wire contract, named once (docs/contract.md sections 3-9).

Nothing here computes; other modules import these names, and so do engine code and the worker.
"""

from __future__ import annotations

from typing import Final

# -- section 3: framing ---------------------------------------------------------------------------
MAGIC: Final = 0x4B505344  # the bytes b"DSPK" read as a little-endian u32
VERSION: Final = 1
APP_HEADER_SIZE: Final = 24
U32_MASK: Final = 0xFFFFFFFF
U64_MASK: Final = 0xFFFFFFFFFFFFFFFF

# -- section 4: operations ------------------------------------------------------------------------
OP_HELLO: Final = 1
OP_STEP: Final = 2
OP_PING: Final = 3
OP_STATS: Final = 4
OP_RESET: Final = 5
OP_GOODBYE: Final = 6  # release the session and all its slots now (6.2)
OP_SHM_ATTACH: Final = 7  # section 13: a shared-memory rows region for this connection
OP_RELOAD: Final = 8  # section 10: reload the drafter, signed with the shared secret
OP_NAMES: Final[dict[int, str]] = {
    OP_HELLO: "HELLO",
    OP_STEP: "STEP",
    OP_PING: "PING",
    OP_STATS: "STATS",
    OP_RESET: "RESET",
    OP_GOODBYE: "GOODBYE",
    OP_SHM_ATTACH: "SHM_ATTACH",
    OP_RELOAD: "RELOAD",
}

# -- section 5: frame statuses --------------------------------------------------------------------
ST_OK: Final = 0
ST_NO_SESSION: Final = 1
ST_STALE_SEQ: Final = 2
ST_BUSY: Final = 3
ST_INTERNAL: Final = 4
# The worker is shutting down: it applied nothing; the client goes to another worker at once.
ST_DRAINING: Final = 5
ST_BAD_FRAME: Final = 16
ST_VERSION: Final = 17
ST_IDENTITY: Final = 18
ST_GEOMETRY: Final = 19
ST_LIMITS: Final = 20
ST_AUTH: Final = 21
FRAME_STATUS_NAMES: Final[dict[int, str]] = {
    ST_OK: "OK",
    ST_NO_SESSION: "NO_SESSION",
    ST_STALE_SEQ: "STALE_SEQ",
    ST_BUSY: "BUSY",
    ST_INTERNAL: "INTERNAL",
    ST_DRAINING: "DRAINING",
    ST_BAD_FRAME: "BAD_FRAME",
    ST_VERSION: "VERSION",
    ST_IDENTITY: "IDENTITY",
    ST_GEOMETRY: "GEOMETRY",
    ST_LIMITS: "LIMITS",
    ST_AUTH: "AUTH",
}
# The client disables remote drafting for the engine run on any of these.
FATAL_FRAME_STATUS: Final = frozenset(
    {ST_BAD_FRAME, ST_VERSION, ST_IDENTITY, ST_GEOMETRY, ST_LIMITS, ST_AUTH}
)

# -- section 6.1: HELLO ---------------------------------------------------------------------------
SAMPLE_GREEDY: Final = 0
SAMPLE_TOP32: Final = 1
SAMPLE_MODE_NAMES: Final[dict[int, str]] = {SAMPLE_GREEDY: "greedy", SAMPLE_TOP32: "top32"}
TAPS_BF16: Final = 1
TAP_DTYPE_NAMES: Final[dict[int, str]] = {TAPS_BF16: "bf16"}
TAP_DTYPE_BYTES: Final[dict[int, int]] = {TAPS_BF16: 2}
CAP_TAPS_BF16: Final = 1
CAP_TOP32: Final = 2
CAP_MARGIN: Final = 4
CAP_SHM_ROWS: Final = 8  # section 13: STEP rows may come from a shared-memory region
# The drafter has no confidence head (a DFlash drafter): every reply says so (RPF_NO_CONFIDENCE)
# and its confidences are 1.0, which a client that ignores the bit reads as "verify all".
CAP_NO_CONFIDENCE: Final = 16
KNOWN_CAPABILITIES: Final = (CAP_TAPS_BF16 | CAP_TOP32 | CAP_MARGIN | CAP_SHM_ROWS
                             | CAP_NO_CONFIDENCE)
# Hello flags (the u16 at offset 26). HF_SYNTHETIC: the session's rows and tokens are made up
# (a benchmark, a load test): the worker keeps its drafts out of every acceptance figure.
HF_SYNTHETIC: Final = 1
# HF_FOLLOW: serve whatever drafter the worker serves now (6.5): the HELLO's identities are
# zero, the reply's say which version the session got.
HF_FOLLOW: Final = 2
KNOWN_HELLO_FLAGS: Final = HF_SYNTHETIC | HF_FOLLOW
NAME_BYTES: Final = 32  # client_name / worker_name: UTF-8, NUL padded
IDENTITY_BYTES: Final = 32  # SHA-256
AUTH_TAG_BYTES: Final = 32  # HMAC-SHA256

# -- section 7: STEP ------------------------------------------------------------------------------
RS_OK: Final = 0
RS_PARTIAL_WINDOW: Final = 1
RS_NO_WINDOW: Final = 2
RS_STALE_GENERATION: Final = 3
RS_SHED: Final = 4
REQ_STATUS_NAMES: Final[dict[int, str]] = {
    RS_OK: "OK",
    RS_PARTIAL_WINDOW: "PARTIAL_WINDOW",
    RS_NO_WINDOW: "NO_WINDOW",
    RS_STALE_GENERATION: "STALE_GENERATION",
    RS_SHED: "SHED",
}
USABLE_REQ_STATUS: Final = frozenset({RS_OK, RS_PARTIAL_WINDOW})

RF_NEED_DRAFT: Final = 1
RF_RESET: Final = 2
RF_RELEASE: Final = 4
KNOWN_REQ_FLAGS: Final = RF_NEED_DRAFT | RF_RESET | RF_RELEASE
# Section 13: the rows are in the connection's shared-memory region, at the offset the StepHeader's
# ``reserved`` field carries (``rows_at``), not in the body. ``protocol.shm.decode_step_shm``
# takes it off; no other step flag is defined, so the shape check (7.2 step 3) still wants 0.
SF_ROWS_SHM: Final = 1
KNOWN_STEP_FLAGS: Final = 0

STEP_HEADER_SIZE: Final = 32
REQ_ENTRY_SIZE: Final = 48

# -- section 7.4: StepReply -----------------------------------------------------------------------
REPLY_HEADER_SIZE: Final = 24
RPF_MARGIN: Final = 1
RPF_SAMPLED: Final = 2
RPF_NO_CONFIDENCE: Final = 4  # the confidences carry no prediction (CAP_NO_CONFIDENCE)
# Only on sessions that HELLOed with HF_FOLLOW: the worker serves new HELLOs with another drafter
# version than this session's (6.5). Layout unchanged.
RPF_NEWER_DRAFTER: Final = 8
KNOWN_REPLY_FLAGS: Final = RPF_MARGIN | RPF_SAMPLED | RPF_NO_CONFIDENCE | RPF_NEWER_DRAFTER
REPLY_ALIGN: Final = 8  # every reply array starts at a multiple of this from the body's start

# -- section 9: sampled proposals (dyadic24) ------------------------------------------------------
MAX_TOP_K: Final = 32  # support places per drafted position
Q_BITS: Final = 24
Q_TOTAL: Final = 1 << Q_BITS  # every drafted position's q sums to exactly this

# -- section 11: limits (defaults; the worker may be configured tighter or looser) ----------------
# Largest frame body the decoder will buffer: a 4096-row resync of 32 KiB rows plus headers.
DEFAULT_MAX_BODY_BYTES: Final = 256 << 20
# Largest number of draft positions per entry the wire can name (num_spec is u16); the worker's
# own N is far smaller.
MAX_NUM_SPEC: Final = 64
