"""A new drafter without a restart, against real worker processes and real clients: drafter
versions, SIGHUP reload and its failures, unloading, and the follow option (contract 6.5).

One worker serves ``--checkpoint current``, a symlink the tests point at other folders before
each SIGHUP, as an operator would:

* a pinned engine (its HELLO names the first drafter) keeps stepping through three failed
  reloads (NaN weights, another geometry, a cut-short file) and a good one: no round lost, no
  reconnect, every draft that of its own drafter (computed in-process on the same rows);
* a new engine pinned to the new drafter gets exactly the drafts of a fresh worker on it;
* once the pinned engine says GOODBYE its version is unloaded, and a HELLO for it is refused;
* an engine that follows the worker moves to the next version with at most one resync per
  slot, and drafts with it from then on.
"""

from __future__ import annotations

import shutil
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from dspark_client import hello_from_checkpoint
from dspark_client.client import RemoteDraftClient
from dspark_client.config import RemoteConfig
from dspark_client.rounds import DraftRounds, RoundResult, SlotRequest
from dspark_worker.drafter import load_drafter
from dspark_worker.drafter.drafter import REFERENCE_DIR
from protocol import wire
from protocol.constants import RF_RESET
from tests.support.drafters import (
    broken_copy,
    cut_short_copy,
    other_geometry,
    perturbed_reference,
)
from tests.support.local_drafts import LocalDrafts
from tests.support.worker_proc import WorkerProcess, reload_to, start_worker, worker_stats

W, SLOTS, ROWS = 64, 4, 256
ARGS = ("--window", str(W), "--max-slots", str(SLOTS), "--max-total-slots", str(4 * SLOTS),
        "--max-rows-per-step", str(ROWS), "--device", "cpu", "--threads", "1")


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("drafters")
    shutil.copytree(REFERENCE_DIR, root / "A")
    out = {"root": root, "A": root / "A", "B": perturbed_reference(root / "B"),
           "nan": broken_copy(root / "nan"), "geometry": other_geometry(root / "geometry"),
           "cut": cut_short_copy(root / "cut"), "current": root / "current"}
    (root / "current").symlink_to("A")
    return out


@pytest.fixture(scope="module")
def worker(folders: dict[str, Path]) -> Iterator[WorkerProcess]:
    with start_worker("--checkpoint", str(folders["current"]), *ARGS) as w:
        yield w


def scrape(w: WorkerProcess) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"{w.metrics_url}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def reload(w: WorkerProcess, folders: dict[str, Path], target: str,
           meanwhile: Callable[[], None] = lambda: None) -> dict[str, Any]:
    """Point ``current`` at ``target``, SIGHUP, and call ``meanwhile`` (engine rounds) until
    the reload is done; its outcome."""
    return reload_to(w, folders["current"], target, meanwhile)


class Engine:
    """Rounds of a made-up engine over SLOTS slots: rows of seeded bf16 values, anchors that
    advance 1..3 positions a round; the same requests can be replayed anywhere."""

    def __init__(self, row_bytes: int, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.row_bytes = row_bytes
        self.anchor = np.full(SLOTS, 12)
        self.first = True

    def rows(self, n: int) -> np.ndarray:
        vals = self.rng.uniform(-2, 2, (n, self.row_bytes // 2)).astype(np.float32)
        return (vals.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(n, -1)

    def requests(self) -> list[SlotRequest]:
        out = []
        for slot in range(SLOTS):
            a0 = int(self.anchor[slot])
            a = a0 if self.first else a0 + int(self.rng.integers(1, 4))
            n = a if self.first else a - a0
            self.anchor[slot] = a
            out.append(SlotRequest(slot=slot, generation=1, anchor_pos=a,
                                   anchor_token=int(self.rng.integers(0, 256)),
                                   rows=self.rows(n), n_out=7))
        self.first = False
        return out


def connect(w: WorkerProcess, hello: wire.Hello, **cfg: Any) -> RemoteDraftClient:
    assert w.endpoint is not None
    client = RemoteDraftClient(RemoteConfig(endpoint=w.endpoint, timeout_ms=10_000,
                                            connect_timeout_ms=10_000, **cfg), hello)
    assert client.wait_ready(20.0), (client.disabled_reason, client.last_error)
    return client


def same_drafts(got: RoundResult, want: RoundResult) -> None:
    assert got.ok, got.reason
    assert got.num_drafted.tolist() == want.num_drafted.tolist()
    assert np.array_equal(got.draft_ids, want.draft_ids)
    np.testing.assert_allclose(got.confidence, want.confidence, rtol=1e-5, atol=1e-6)


def hello_for(folder: Path, name: str) -> wire.Hello:
    return hello_from_checkpoint(folder, window=W, max_slots=SLOTS, max_rows_per_step=ROWS,
                                 client_name=name)


def test_pinned_engine_runs_through_reloads_and_a_new_engine_gets_the_new_drafter(
        worker: WorkerProcess, folders: dict[str, Path]) -> None:
    pinned = connect(worker, hello_for(folders["A"], "pinned"))
    rounds = DraftRounds(pinned)
    local = LocalDrafts(load_drafter(folders["A"]), max_slots=SLOTS, window=W)
    engine = Engine(pinned.hello.row_bytes, seed=1)
    steps = 0

    def step() -> None:
        nonlocal steps
        reqs = engine.requests()
        same_drafts(rounds.run(reqs), local.round(reqs))
        steps += 1

    for _ in range(3):
        step()
    failed = {target: reload(worker, folders, target, step)
              for target in ("nan", "geometry", "cut")}
    assert all(o["result"] == "failed" for o in failed.values()), failed
    assert "not finite" in failed["nan"]["why"]
    assert "num_spec 5 (serving 7)" in failed["geometry"]["why"]
    assert "outside the file" in failed["cut"]["why"]
    done = reload(worker, folders, "B", step)
    assert done["result"] == "ok" and done["version"] == 2, done
    for _ in range(3):
        step()
    # Not a round lost, not a reconnect (which would have resynced every slot).
    assert pinned.epoch == 1 and pinned.stats.get("rounds_failed", 0) == 0 and steps >= 10
    st = worker_stats(worker)
    assert [(v["version"], v["role"], v["sessions"]) for v in st["versions"]] == [
        (1, "older", 1), (2, "newest", 0)]
    assert st["drafter_name"].startswith("B@") and st["versions"][0]["name"].startswith("A@")
    pinned_entry = next(s for s in st["sessions"] if s["version"] == 1)
    assert pinned_entry["acceptance"]["rounds"] > 0
    m = scrape(worker)
    assert m[("dspark_worker_reloads_total", (("result", "failed"), ("what", "drafter")))] == 3
    assert m[("dspark_worker_reloads_total", (("result", "ok"), ("what", "drafter")))] == 1
    info = {dict(k[1])["version"]: dict(k[1]) for k in m if k[0] == "dspark_worker_drafter_info"}
    assert {v: (i["role"], i["name"][:2]) for v, i in info.items()} == {
        "1": ("older", "A@"), "2": ("newest", "B@")}
    assert m[("dspark_worker_version_sessions", (("name", info["1"]["name"]),
                                                 ("version", "1")))] == 1
    assert m[("dspark_worker_acceptance_rounds_total", (("name", info["1"]["name"]),
                                                        ("version", "1")))] > 0

    # A new engine pinned to the new drafter: the drafts of a fresh worker serving it.
    fresh_engine = Engine(pinned.hello.row_bytes, seed=2)
    newer = connect(worker, hello_for(folders["B"], "newer"))
    with start_worker("--checkpoint", str(folders["B"]), *ARGS) as fresh:
        alone = connect(fresh, hello_for(folders["B"], "alone"))
        a, b = DraftRounds(newer), DraftRounds(alone)
        for _ in range(4):
            reqs = fresh_engine.requests()
            same_drafts(a.run(reqs), b.run(reqs))
        alone.close()
    newer.close()

    # The pinned engine leaves: its version goes, and nobody can HELLO it any more.
    pinned.close()
    deadline = time.monotonic() + 10
    while worker_stats(worker)["versions"][0]["role"] != "unloaded" and time.monotonic() < deadline:
        time.sleep(0.05)
    st = worker_stats(worker)
    assert [(v["version"], v["role"]) for v in st["versions"]] == [(1, "unloaded"),
                                                                   (2, "newest")]
    assert st["versions"][0]["weights_bytes"] == 0 and st["versions"][1]["weights_bytes"] > 0
    assert not any(k[0] == "dspark_worker_drafter_info" and ("version", "1") in k[1]
                   for k in scrape(worker))
    late = RemoteDraftClient(RemoteConfig(endpoint=worker.endpoint or "", timeout_ms=5000,
                                          connect_timeout_ms=5000),
                             hello_for(folders["A"], "late"), background=False)
    assert not late.connect_now()
    assert late.disabled_reason is not None and "IDENTITY" in late.disabled_reason
    assert "versions loaded: B@" in worker.log_text()
    late.close()


def test_a_following_engine_moves_to_the_new_version_resyncing_each_slot_once(
        worker: WorkerProcess, folders: dict[str, Path]) -> None:
    newest = worker_stats(worker)["versions"][-1]
    client = connect(worker, hello_for(folders["A"], "follower"), follow_drafter=True)
    assert client.worker_info is not None
    assert client.worker_info.drafter_identity.hex() == newest["drafter_identity"]
    sent: list[np.ndarray] = []
    step_fn = client.step

    def spy(buf: Any, entries: Any, *args: Any, **kwargs: Any) -> Any:
        sent.append(np.array(entries, copy=True))
        return step_fn(buf, entries, *args, **kwargs)

    client.step = spy  # type: ignore[method-assign]
    rounds = DraftRounds(client)
    engine = Engine(client.hello.row_bytes, seed=3)
    before = LocalDrafts(load_drafter(folders["B"]), max_slots=SLOTS, window=W)
    after = LocalDrafts(load_drafter(folders["A"]), max_slots=SLOTS, window=W)
    for _ in range(3):
        reqs = engine.requests()
        after.round(reqs)  # the same rows in its windows, for the drafts after the move
        same_drafts(rounds.run(reqs), before.round(reqs))
    first_epoch, at_reload = client.epoch, len(sent)
    # A back in the folder: not loaded any more, so it comes back as version 3.
    done = reload(worker, folders, "A")
    assert done["result"] == "ok" and done["version"] == 3, done
    moved = False
    for _ in range(8):
        reqs = engine.requests()
        res = rounds.run(reqs)
        want = after.round(reqs)
        assert res.ok, res.reason
        if client.epoch > first_epoch:
            if moved:  # from the round after the move on: version 3's drafts
                same_drafts(res, want)
            moved = True
        time.sleep(0.02)  # the engine's verify: the connect thread moves meanwhile
    assert client.epoch == first_epoch + 1 and client.stats.get("drafter_follows") == 1
    assert client.worker_info.drafter_identity.hex() == worker_stats(worker)["drafter_identity"]
    resets = np.concatenate([e["slot"][(e["flags"] & RF_RESET) != 0] for e in sent[at_reload:]])
    assert sorted(resets.tolist()) == list(range(SLOTS))  # one resync per slot, no more
    client.close()
