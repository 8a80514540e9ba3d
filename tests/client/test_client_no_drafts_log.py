"""An engine whose worker refuses it, or is not there, hears of it in its own log: the client's
lines at the failure, then one WARNING per ``NO_WORKER_LOG_S`` from the rounds with the reason,
and a line when drafting resumes (docs/vllm.md, "When the engine gets no drafts")."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from client_fakes import FakeWorker, W, make_hello, make_hello_reply

import dspark_client.rounds as rounds_mod
from dspark_client.client import RemoteDraftClient
from dspark_client.config import RemoteConfig
from dspark_client.rounds import DraftRounds
from protocol import wire


def _round(rounds: DraftRounds) -> bool:
    rows = np.zeros((4, rounds.row_bytes), np.uint8)
    return rounds.run_batch(slots=np.array([0]), generation=1, anchor_pos=np.array([4]),
                            anchor_token=np.array([1]), n_out=rounds.num_spec, rows=rows,
                            n_rows=np.array([4])).ok


def test_a_refused_engine_warns_with_the_workers_reason_at_a_bounded_rate(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    with FakeWorker(hello_reply=make_hello_reply(window=2 * W),
                    hello_status=wire.ST_GEOMETRY) as fw:
        client = RemoteDraftClient(RemoteConfig(endpoint=fw.endpoint), make_hello(),
                                   background=False)
        rounds = DraftRounds(client)
        with caplog.at_level(logging.WARNING, logger="dspark_client"):
            assert not client.connect_now()
            assert not _round(rounds)  # the first round: the client's ERROR line said it
            monkeypatch.setattr(rounds_mod, "NO_WORKER_LOG_S", 0.0)
            assert not _round(rounds)
            assert not _round(rounds)
            monkeypatch.setattr(rounds_mod, "NO_WORKER_LOG_S", 3600.0)
            assert not _round(rounds)  # within the interval: counted, not logged
        why = f"HELLO refused: GEOMETRY (window {2 * W} != ours {W})"
        lines = [(r.levelname, r.getMessage()) for r in caplog.records]
        assert lines[0] == ("ERROR", f"remote DSpark disabled for this engine run: {why}")
        reminders = [m for level, m in lines[1:] if level == "WARNING"]
        assert len(reminders) == 2 and reminders[-1].startswith("remote DSpark: no drafts for")
        assert reminders[-1].endswith(f"(3 rounds target-only): remote drafting disabled: {why}")
        client.close()


def test_drafting_again_is_said_once_the_worker_answers(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    with FakeWorker() as fw:
        client = RemoteDraftClient(RemoteConfig(endpoint=fw.endpoint), make_hello(),
                                   background=False)
        rounds = DraftRounds(client)
        monkeypatch.setattr(rounds_mod, "NO_WORKER_LOG_S", 0.0)
        with caplog.at_level(logging.INFO, logger="dspark_client"):
            assert not _round(rounds) and not _round(rounds)
            assert client.connect_now()
            assert _round(rounds)
        said = [r.getMessage() for r in caplog.records]
        assert any(m.endswith("(2 rounds target-only): no worker has answered yet")
                   for m in said), said
        assert any(m.startswith("remote DSpark: drafting again after") and
                   m.endswith("(2 rounds target-only)") for m in said), said
        client.close()
