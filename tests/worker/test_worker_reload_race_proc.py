"""A reload reads exactly one checkpoint, against a real worker process: ``current`` is
switched between folders (atomically, as fast as a loop can) and the weights of one folder are
replaced by rename, while SIGHUP reloads run and an engine that follows the worker drafts.

Every draft the engine gets is that of one shipped folder's drafter on the same rows; every
version the worker loaded holds the identities of the folder it is named after; every
``dspark_identity.json`` holds its own folder's identities; a reload that met a change fails
with "the checkpoint changed while it was read" and changes nothing. And a reload where only
config.json changed is a new version (its identity covers the config), drafting as a fresh
worker on that folder does, while a changed block size is refused as another geometry.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dspark_client.rounds import DraftRounds
from dspark_worker.drafter import load_drafter
from dspark_worker.drafter.drafter import REFERENCE_DIR
from protocol.identity import (
    CHANGED_WHILE_READ,
    IDENTITY_FILE,
    identities_from_checkpoint,
    read_identity_record,
)
from tests.support.drafters import perturbed_reference
from tests.support.local_drafts import LocalDrafts
from tests.support.worker_proc import WorkerProcess, start_worker, worker_stats
from tests.worker.test_worker_reload_proc import (
    ARGS,
    SLOTS,
    Engine,
    W,
    connect,
    hello_for,
    reload,
    same_drafts,
)

RELOADS = 8


def _ids(folder: Path) -> tuple[str, str]:
    d, m = identities_from_checkpoint(folder, use_identity_file=False)
    return d.hex(), m.hex()


def _config_variant(out: Path, **changes: Any) -> Path:
    """The reference drafter's weights with config.json keys changed."""
    shutil.copytree(REFERENCE_DIR, out)
    config = json.loads((out / "config.json").read_text())
    config.update(changes)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("race")
    shutil.copytree(REFERENCE_DIR, root / "A")
    out = {"root": root, "A": root / "A", "B": perturbed_reference(root / "B", seed=1),
           "C": perturbed_reference(root / "C", seed=2), "R": root / "R",
           "stage": root / "stage", "current": root / "current"}
    # R: a folder whose weights are swapped by rename between A's and C's
    shutil.copytree(out["A"], out["R"])
    out["stage"].mkdir()
    for name in ("A", "C"):
        shutil.copyfile(out[name] / "model.safetensors", out["stage"] / name)
    out["current"].symlink_to("A")
    return out


@pytest.fixture(scope="module")
def worker(folders: dict[str, Path]) -> Iterator[WorkerProcess]:
    with start_worker("--checkpoint", str(folders["current"]), "--no-warmup", *ARGS) as w:
        yield w


def _churn(folders: dict[str, Path], stop: threading.Event) -> Callable[[], int]:
    """Start a thread that points ``current`` at A, B, C, R in turn (an atomic rename of a new
    symlink, as fast as it can) and swaps R's weights between A's and C's (a rename of a hard
    link); returns a function that stops it and says how many changes it made."""
    root, changes = folders["root"], [0]

    def run() -> None:
        targets = ("B", "R", "C", "A")
        i = 0
        while not stop.is_set():
            tmp = root / "current.tmp"
            tmp.symlink_to(targets[i % len(targets)])
            os.replace(tmp, folders["current"])
            staged = folders["stage"] / ("A", "C")[i % 2]
            os.link(staged, folders["R"] / "swap.tmp")
            os.replace(folders["R"] / "swap.tmp", folders["R"] / "model.safetensors")
            changes[0] += 2
            i += 1
            time.sleep(0.002)

    thread = threading.Thread(target=run, name="churn", daemon=True)
    thread.start()

    def finish() -> int:
        stop.set()
        thread.join(10)
        return changes[0]

    return finish


def test_reloads_under_switching_folders_load_one_folder_each(
        worker: WorkerProcess, folders: dict[str, Path]) -> None:
    ids = {name: _ids(folders[name]) for name in ("A", "B", "C")}
    assert len(set(ids.values())) == 3
    # what each folder may hold: R holds A's weights or C's (its config.json is A's)
    holds = {"A": {ids["A"]}, "B": {ids["B"]}, "C": {ids["C"]}, "R": {ids["A"], ids["C"]}}
    client = connect(worker, hello_for(folders["A"], "follower"), follow_drafter=True)
    rounds = DraftRounds(client)
    engine = Engine(client.hello.row_bytes, seed=7)
    local = {name: LocalDrafts(load_drafter(folders[name], record_identities=False),
                               max_slots=SLOTS, window=W) for name in ("A", "B", "C")}
    judged = 0

    def step() -> None:
        nonlocal judged
        reqs = engine.requests()
        got = rounds.run(reqs)
        wants = {name: drafts.round(reqs) for name, drafts in local.items()}
        if not got.ok:  # a round lost to the move to a new version: no drafts to judge
            return
        for i in range(len(reqs)):
            if got.num_drafted[i]:
                owners = [name for name, want in wants.items()
                          if np.array_equal(got.draft_ids[i], want.draft_ids[i])]
                assert owners, f"slot {i}: drafts {got.draft_ids[i]} match no folder's drafter"
                judged += 1

    step()
    stop = threading.Event()
    finish = _churn(folders, stop)
    try:
        for _ in range(RELOADS):
            asked = worker_stats(worker)["reloads"]["asked"]
            os.kill(worker.pid, signal.SIGHUP)
            deadline = time.monotonic() + 30
            while True:
                step()
                st = worker_stats(worker)["reloads"]
                if st["asked"] > asked and not st["running"]:
                    break
                assert time.monotonic() < deadline, worker.log_text()[-2000:]
                time.sleep(0.01)  # the engine's verify: the worker's loader gets the cores
            outcome = st["last"]
            assert outcome["result"] in ("ok", "unchanged", "failed"), outcome
            if outcome["result"] == "failed":  # the only failure a switch may cause
                assert CHANGED_WHILE_READ in outcome["why"], outcome
    finally:
        changes = finish()
    assert changes > 4 * RELOADS
    for _ in range(3):
        step()
    assert judged > 0
    st = worker_stats(worker)
    results = st["reloads"]["results"]
    assert results.get("drafter:ok", 0) >= 2, results
    for v in st["versions"]:
        folder, digest = v["name"].split("@")
        held = (v["drafter_identity"], v["markov_identity"])
        assert held in holds[folder], (v, holds)
        assert Path(v["source"]) == folders[folder].resolve()
        assert digest == hashlib.sha256(bytes.fromhex(held[0])
                                        + bytes.fromhex(held[1])).hexdigest()[:8]
    for name, allowed in holds.items():
        if (folders[name] / IDENTITY_FILE).exists():
            record = read_identity_record(folders[name])
            assert record is not None and (record[0].hex(), record[1].hex()) in allowed, name
    client.close()


def test_a_config_change_alone_is_a_new_version_and_block_size_another_geometry(
        worker: WorkerProcess, folders: dict[str, Path]) -> None:
    root = folders["root"]
    rope = _config_variant(root / "rope", rope_theta=50000.0)
    _config_variant(root / "block", block_size=5)  # N 5: another geometry
    # the same weights as A, another config: another drafter identity, the same Markov one
    assert _ids(rope)[0] != _ids(folders["A"])[0] and _ids(rope)[1] == _ids(folders["A"])[1]

    assert reload(worker, folders, "A")["result"] in ("ok", "unchanged")
    done = reload(worker, folders, "rope")
    assert done["result"] == "ok", done
    assert worker_stats(worker)["drafter_name"].startswith("rope@")
    refused = reload(worker, folders, "block")
    assert refused["result"] == "failed" and "num_spec" in refused["why"], refused
    # an engine pinned to the new config's identity gets that drafter's drafts
    pinned = connect(worker, hello_for(rope, "rope"))
    rounds = DraftRounds(pinned)
    local = LocalDrafts(load_drafter(rope, record_identities=False), max_slots=SLOTS,
                        window=W)
    other = LocalDrafts(load_drafter(folders["A"], record_identities=False),
                        max_slots=SLOTS, window=W)
    engine = Engine(pinned.hello.row_bytes, seed=11)
    differs = False
    for _ in range(4):
        reqs = engine.requests()
        got, want = rounds.run(reqs), local.round(reqs)
        same_drafts(got, want)
        differs |= not np.array_equal(want.draft_ids, other.round(reqs).draft_ids)
    assert differs, "rope_theta 50000 drafted as 10000 on every row: the test shows nothing"
    pinned.close()
