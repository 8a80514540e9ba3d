"""The import surface engine code depends on: ``protocol.wire`` (docs/contract.md, all sections).

``data/seed_remote_client.py.txt`` is a copy of the engine-side reference client
(shared/seeds/004_remote_client_formatted.py; its ``wire`` is our ``protocol.wire`` and its
``sampled_wire.validate`` our ``protocol.sampled.validate``), kept here so this check runs
anywhere the repository does.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import numpy as np
import pytest

from protocol import sampled, validate, wire

SEED = Path(__file__).parent / "data" / "seed_remote_client.py.txt"

# Every name the reference client takes from ``wire``, in its code and its docstrings.
CLIENT_NAMES = (
    "APP_HEADER_SIZE", "AppHeader", "CAP_TAPS_BF16", "CAP_TOP32", "FATAL_FRAME_STATUS",
    "FRAME_STATUS_NAMES", "HELLO_REP", "Hello", "HelloReply", "OP_HELLO", "OP_STEP", "OP_PING",
    "OP_STATS", "OP_RESET", "REQ_STATUS_NAMES", "RF_NEED_DRAFT", "RS_OK", "RS_PARTIAL_WINDOW",
    "ReqEntry", "SAMPLE_TOP32", "ST_NO_SESSION", "ST_OK", "ST_STALE_SEQ", "StepReply",
    "U32_MASK", "USABLE_REQ_STATUS", "WireError", "frame", "pack_step_prefix",
    "rows_offset_for", "split_frame",
)


def _seed_tree() -> ast.Module:
    return ast.parse(SEED.read_text(encoding="utf-8"), filename=str(SEED))


def _seed_wire_attributes() -> set[str]:
    return {node.attr for node in ast.walk(_seed_tree())
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
            and node.value.id == "wire"}


@pytest.mark.parametrize("name", CLIENT_NAMES)
def test_the_client_names_are_exported(name: str) -> None:
    assert hasattr(wire, name)
    assert name in wire.__all__


def test_every_wire_attribute_of_the_seed_client_is_exported() -> None:
    used = _seed_wire_attributes()
    assert len(used) >= 25  # the parse found the client's uses
    assert used <= set(CLIENT_NAMES)
    missing = sorted(n for n in used if not hasattr(wire, n) or n not in wire.__all__)
    assert missing == []


def test_every_export_exists() -> None:
    assert len(set(wire.__all__)) == len(wire.__all__)
    assert [n for n in wire.__all__ if not hasattr(wire, n)] == []


def test_values_are_the_contract_s() -> None:
    assert wire.APP_HEADER_SIZE == 24
    assert wire.VERSION == 1
    assert (wire.OP_HELLO, wire.OP_STEP, wire.OP_PING, wire.OP_STATS, wire.OP_RESET,
            wire.OP_GOODBYE) == (1, 2, 3, 4, 5, 6)
    assert wire.goodbye_frame(7, 9) == wire.frame(wire.OP_GOODBYE, 7, 9)
    assert (wire.ST_OK, wire.ST_NO_SESSION, wire.ST_STALE_SEQ, wire.ST_BUSY,
            wire.ST_INTERNAL) == (0, 1, 2, 3, 4)
    assert (wire.ST_BAD_FRAME, wire.ST_VERSION, wire.ST_IDENTITY, wire.ST_GEOMETRY,
            wire.ST_LIMITS, wire.ST_AUTH) == (16, 17, 18, 19, 20, 21)
    assert isinstance(wire.FATAL_FRAME_STATUS, frozenset)
    assert set(wire.FATAL_FRAME_STATUS) == set(range(16, 22))
    assert set(wire.FRAME_STATUS_NAMES) == {0, 1, 2, 3, 4, 5, *range(16, 22)}
    assert wire.ST_DRAINING == 5 and wire.ST_DRAINING not in wire.FATAL_FRAME_STATUS
    assert wire.FRAME_STATUS_NAMES[wire.ST_NO_SESSION] == "NO_SESSION"
    assert (wire.SAMPLE_GREEDY, wire.SAMPLE_TOP32, wire.TAPS_BF16) == (0, 1, 1)
    assert (wire.CAP_TAPS_BF16, wire.CAP_TOP32, wire.CAP_MARGIN) == (1, 2, 4)
    assert (wire.RS_OK, wire.RS_PARTIAL_WINDOW, wire.RS_NO_WINDOW, wire.RS_STALE_GENERATION,
            wire.RS_SHED) == (0, 1, 2, 3, 4)
    assert set(wire.REQ_STATUS_NAMES) == {0, 1, 2, 3, 4}
    assert set(wire.USABLE_REQ_STATUS) == {0, 1}
    assert (wire.RF_NEED_DRAFT, wire.RF_RESET, wire.RF_RELEASE) == (1, 2, 4)
    assert (wire.RPF_MARGIN, wire.RPF_SAMPLED) == (1, 2)
    assert wire.U32_MASK == 0xFFFFFFFF
    assert wire.Q_TOTAL == 2**24 and wire.MAX_TOP_K == 32
    assert wire.HELLO_REP.size == 128
    assert wire.HELLO_STRUCT.size == 160
    assert wire.STEP_HEADER_SIZE == 32 and wire.REQ_ENTRY_SIZE == 48
    assert wire.ENTRY_DTYPE.itemsize == 48
    for n in range(0, 300, 7):
        assert wire.rows_offset_for(n) == 32 + 48 * n
    assert issubclass(wire.WireError, ValueError)  # the client wraps ValueError as WireError


# -- the calls the client makes, with the shapes it makes them --------------------------------
def test_the_seed_validate_call_matches_protocol_sampled_validate() -> None:
    calls = [node for node in ast.walk(_seed_tree()) if isinstance(node, ast.Call)
             and isinstance(node.func, ast.Name) and node.func.id == "validate"]
    assert len(calls) == 1
    assert len(calls[0].args) == 7 and calls[0].keywords == []
    sig = inspect.signature(sampled.validate).parameters.values()
    params = [p.name for p in sig if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert params == ["sampled_mask", "support_ids", "proposal_q", "draft_ids", "needed",
                      "vocab_size", "top_ks"]
    # anything added since is keyword-only with a default: the seed's call stays valid
    assert all(p.kind is p.KEYWORD_ONLY and p.default is not p.empty
               for p in sig if p.name not in params)


def test_the_seed_check_reply_values_has_the_same_signature() -> None:
    (fn,) = [node for node in _seed_tree().body if isinstance(node, ast.FunctionDef)
             and node.name == "check_reply_values"]
    seed_params = [a.arg for a in fn.args.args]
    seed_kwonly = [a.arg for a in fn.args.kwonlyargs]
    sig = inspect.signature(validate.check_reply_values)
    ours = [p.name for p in sig.parameters.values() if p.kind is p.POSITIONAL_OR_KEYWORD]
    kwonly = [p.name for p in sig.parameters.values() if p.kind is p.KEYWORD_ONLY]
    assert (ours, kwonly) == (seed_params, seed_kwonly)


def test_a_step_exchange_written_as_the_seed_client_writes_it() -> None:
    entries = [wire.ReqEntry(slot=2, generation=(3 << 32) | 9, anchor_pos=12, anchor_token=4,
                             n_rows=2, flags=wire.RF_NEED_DRAFT)]
    sample_meta = [(0xABCDEF, 3, 0.5, 0.0)]
    row_bytes, n_rows, step_id, seq, session = 8, 2, 21, 5, 0xC0FFEE
    rows = np.arange(n_rows * row_bytes, dtype=np.uint8).reshape(n_rows, row_bytes)
    buf = bytearray(1 << 12)
    ro = wire.pack_step_prefix(buf, wire.APP_HEADER_SIZE, step_id, entries, n_rows, row_bytes,
                               0, sample_meta=sample_meta)
    body_len = ro + n_rows * row_bytes
    wire.AppHeader(op=wire.OP_STEP, seq=seq, session=session, body_len=body_len).pack_into(
        buf, 0)
    sent = bytes(memoryview(buf).cast("B")[:wire.APP_HEADER_SIZE + ro]) + rows.tobytes()
    # the worker's side
    h, body = wire.split_frame(sent)
    assert (h.op, h.seq, h.session, h.body_len) == (wire.OP_STEP, seq, session, body_len)
    view = wire.decode_step(body)
    e = view.entries[0]
    assert (int(e["seed"]), int(e["top_k"]), float(e["temperature"])) == (0xABCDEF, 3, 0.5)
    assert int(e["generation"]) == 9
    assert np.array_equal(view.rows, rows)
    rep = wire.StepReply.empty(step_id, 1, 2, wire.RPF_MARGIN)
    rep.status[:] = [wire.RS_OK]
    rep.window_rows[:] = [8]
    rep.generation[:] = [int(e["generation"])]
    rep.draft_ids[0] = [5, 6]
    rep.confidence[0] = [0.9, 0.4]
    size = rep.finish(17)
    reply = wire.frame(wire.OP_STEP, seq, session, rep.pack()[:size])
    # the client's side
    h, rb = wire.split_frame(memoryview(bytearray(reply)))
    assert (h.op, h.seq, h.session, h.status) == (wire.OP_STEP, seq, session, wire.ST_OK)
    got = wire.StepReply.unpack(rb, expect_n_req=len(entries), expect_num_spec=2)
    assert got.step_id == step_id
    for ent, g in zip(entries, got.generation.tolist(), strict=True):
        assert g == (ent.generation & wire.U32_MASK)
    assert got.support_ids is None
    ks = validate.check_reply_values(got, entries, vocab_size=100, window=8)
    assert list(ks) == [2]


def test_step_reply_unpack_refuses_what_the_client_did_not_ask_for() -> None:
    rep = wire.StepReply.empty(1, 2, 3, 0)
    rep.finish(0)
    body = rep.pack()
    with pytest.raises(wire.WireError) as info:
        wire.StepReply.unpack(body, expect_n_req=3)
    assert (info.value.field, info.value.value, info.value.limit) == ("n_req", 2, 3)
    with pytest.raises(wire.WireError) as info:
        wire.StepReply.unpack(body, expect_num_spec=4)
    assert (info.value.field, info.value.value, info.value.limit) == ("num_spec", 3, 4)
    flagged = bytearray(body)
    flagged[14] = 0x80  # flags u16 at offset 14: an unknown bit
    with pytest.raises(wire.WireError) as info:
        wire.StepReply.unpack(bytes(flagged))
    assert info.value.field == "flags"
    for wrong in (body[:-1], body + bytes(8), body[:23]):
        with pytest.raises(wire.WireError) as info:
            wire.StepReply.unpack(wrong)
        assert info.value.field == "body_len"


def test_a_refused_hello_reply_still_decodes() -> None:
    rep = wire.HelloReply(capabilities=wire.CAP_TAPS_BF16, window=16, num_spec=4, max_slots=4,
                          max_rows_per_step=64, row_bytes=8, vocab_size=100,
                          drafter_identity=b"\x01" * 32, markov_identity=b"\x02" * 32,
                          worker_name="w")
    data = wire.frame(wire.OP_HELLO, 1, 7, rep.pack(), status=wire.ST_AUTH)
    h, body = wire.split_frame(memoryview(bytearray(data)))
    assert h.status in wire.FATAL_FRAME_STATUS
    assert len(body) == wire.HELLO_REP.size
    assert wire.HelloReply.unpack(body).drafter_identity.hex() == "01" * 32


def test_seed_copy_is_verbatim() -> None:
    """The copy kept with the tests is the design folder's file, byte for byte, where the design
    folder lies beside the checkout (as in CI)."""
    original = (Path(__file__).resolve().parents[3] / "shared" / "seeds"
                / "004_remote_client_formatted.py")
    if original.is_file():
        assert SEED.read_bytes() == original.read_bytes()
    else:
        assert "class RemoteDraftClient" in SEED.read_text(encoding="utf-8")
