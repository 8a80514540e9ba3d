"""Reload corner cases on an in-process worker (real sockets): going back to a version still
loaded, the bound on versions, a reload that runs out of memory, the canary reloaded,
HF_FOLLOW's rules, and how the canary picks its slots. The whole path against real processes
is tests/worker/test_worker_reload_proc.py and tests/e2e/test_canary.py."""

from __future__ import annotations

import io
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from worker_harness import ThreadWorker, make_hello, tap_rows, thread_worker, wait_until

import dspark_worker.app as app_module
from dspark_client import cli
from dspark_worker.canary import shadowed_slots
from dspark_worker.drafter import load_drafter
from dspark_worker.drafter.drafter import REFERENCE_DIR
from protocol.auth import reload_body
from protocol.constants import (
    HF_FOLLOW,
    OP_RELOAD,
    RF_NEED_DRAFT,
    SAMPLE_TOP32,
    ST_AUTH,
    ST_BAD_FRAME,
    ST_OK,
)
from protocol.messages import ReqEntry
from tests.support.drafters import broken_copy, perturbed_reference


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("reload")
    shutil.copytree(REFERENCE_DIR, root / "A")
    out = {"A": root / "A", "B": perturbed_reference(root / "B", seed=1),
           "C": perturbed_reference(root / "C", seed=2), "nan": broken_copy(root / "nan"),
           "current": root / "current", "canary": root / "canary"}
    return out


def point(link: Path, target: Path) -> None:
    if link.is_symlink():
        link.unlink()
    link.symlink_to(target)


@pytest.fixture
def reloading(folders: dict[str, Path], drafter: Any,
              request: pytest.FixtureRequest) -> Iterator[ThreadWorker]:
    point(folders["current"], folders["A"])  # the drafter fixture is the reference: version 1
    overrides = getattr(request, "param", {})
    with thread_worker(drafter, checkpoint=str(folders["current"]), **overrides) as w:
        yield w


def reload(w: ThreadWorker) -> dict[str, Any]:
    app = w.app
    assert w.call(lambda: app.request_reload("test")) is not None
    assert wait_until(lambda: not w.call(lambda: app.reloader.running), 30)
    return dict(w.call(lambda: app.reloader.last.summary()))


def versions(w: ThreadWorker) -> list[tuple[int, str, int]]:
    return [(v["version"], v["role"], v["sessions"])
            for v in w.call(lambda: w.app.dispatcher.stats())["versions"]]


def test_back_to_a_version_still_loaded_and_the_one_left_unused_goes(
        reloading: ThreadWorker, folders: dict[str, Path], drafter: Any) -> None:
    with reloading.connect() as c:
        assert c.hello(make_hello(drafter, client_name="pinned")).status == ST_OK
        point(folders["current"], folders["B"])
        assert reload(reloading)["result"] == "ok"
        assert versions(reloading) == [(1, "older", 1), (2, "newest", 0)]
        point(folders["current"], folders["A"])
        back = reload(reloading)
        assert back["result"] == "ok" and back["version"] == 1
        assert "serves new HELLOs again" in back["why"]
        assert versions(reloading) == [(1, "newest", 1), (2, "unloaded", 0)]
        assert reload(reloading)["result"] == "unchanged"


@pytest.mark.parametrize("reloading", [{"max_versions": 2}], indirect=True)
def test_a_reload_past_max_versions_fails_and_changes_nothing(
        reloading: ThreadWorker, folders: dict[str, Path], drafter: Any) -> None:
    with reloading.connect() as a, reloading.connect() as b:
        assert a.hello(make_hello(drafter, client_name="a")).status == ST_OK
        point(folders["current"], folders["B"])
        assert reload(reloading)["result"] == "ok"
        b_drafter = load_drafter(folders["B"])
        assert b.hello(make_hello(b_drafter, client_name="b")).status == ST_OK
        point(folders["current"], folders["C"])
        out = reload(reloading)
        assert out["result"] == "failed"
        assert "2 versions are loaded, the limit (--max-versions 2)" in out["why"]
        assert versions(reloading) == [(1, "older", 1), (2, "newest", 1)]


def test_a_reload_without_memory_says_so(reloading: ThreadWorker, folders: dict[str, Path],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    def no_memory(config: Any, read: Any) -> Any:
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(app_module, "build_drafter_for", no_memory)
    point(folders["current"], folders["B"])
    out = reload(reloading)
    assert out["result"] == "failed" and out["why"].startswith("no memory: CUDA out of memory")
    assert versions(reloading) == [(1, "newest", 0)]
    _, text = reloading.scrape()
    assert 'dspark_worker_reloads_total{result="failed",what="drafter"} 1.0' in text


def test_the_canary_reloads_and_a_broken_one_leaves_it(folders: dict[str, Path],
                                                       drafter: Any,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    released: list[str] = []
    monkeypatch.setattr(app_module, "release_device_memory",
                        lambda device: released.append(str(device)))
    point(folders["canary"], folders["B"])
    with thread_worker(drafter, canary_checkpoint=str(folders["canary"])) as w:
        first = w.call(lambda: w.app.canary.summary())
        assert first["name"].startswith("B@") and first["version"] == 2
        point(folders["canary"], folders["nan"])
        released.clear()
        assert reload(w)["result"] == "failed"
        assert released == ["cpu"]  # what the broken canary took of the device goes back
        assert w.call(lambda: w.app.canary.number) == 2  # still the first canary
        point(folders["canary"], folders["C"])
        out = reload(w)
        assert (out["what"], out["result"], out["version"]) == ("canary", "ok", 3)
        assert w.call(lambda: w.app.canary.summary())["name"].startswith("C@")
        assert reload(w)["result"] == "unchanged"
        _, text = w.scrape()
        assert 'dspark_worker_drafter_info{' in text and 'role="canary"' in text
        assert 'dspark_worker_reloads_total{result="failed",what="canary"} 1.0' in text


def test_follow_hellos_carry_no_identities(worker: ThreadWorker, drafter: Any) -> None:
    with worker.connect() as c:
        named = make_hello(drafter, flags=HF_FOLLOW)
        r = c.hello(named)
        assert r.status == ST_BAD_FRAME
        r = c.hello(make_hello(drafter, flags=HF_FOLLOW, drafter_identity=bytes(32),
                               markov_identity=bytes(32)))
        assert r.status == ST_OK
        assert r.hello().drafter_identity == drafter.drafter_identity  # what it got


@pytest.mark.parametrize("fraction", [0.1, 0.25, 0.5, 1.0])
def test_the_canary_shadows_its_share_of_every_session(fraction: float) -> None:
    for max_slots in (1, 3, 8, 256):
        counts = {int(shadowed_slots(sid, b"k" * 16, max_slots, fraction).sum())
                  for sid in range(1, 200)}
        share = fraction * max_slots
        assert counts <= {int(np.floor(share)), int(np.ceil(share))}, (max_slots, counts)


def test_reload_over_the_wire_under_the_secret(folders: dict[str, Path], drafter: Any,
                                               tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_bytes(b"reload-secret\n")
    secret.chmod(0o600)
    wrong = tmp_path / "wrong"
    wrong.write_bytes(b"not-it\n")
    point(folders["current"], folders["B"])
    with thread_worker(drafter, checkpoint=str(folders["current"]),
                       auth_secret_file=str(secret)) as w:
        endpoint = "tcp://{}:{}".format(*w.address)
        out = io.StringIO()
        code = cli.main(["reload", "--endpoint", endpoint, "--auth-secret-file", str(secret)],
                        out=out)
        assert code == 0, out.getvalue()
        assert out.getvalue().splitlines()[1].startswith(
            "  drafter: ok in ") and "version 2 B@" in out.getvalue()
        assert cli.main(["reload", "--endpoint", endpoint, "--auth-secret-file", str(wrong)],
                        out=io.StringIO()) == 1
        assert cli.main(["reload", "--endpoint", endpoint], out=io.StringIO()) == 2
        with w.connect() as c:  # a captured RELOAD, sent again: refused
            body = reload_body(b"reload-secret", int(time.time() * 1000))
            assert c.request(OP_RELOAD, body, session=0).status == ST_OK
            assert c.request(OP_RELOAD, body, session=0).status == ST_AUTH
            old = reload_body(b"reload-secret", at_ms=int((time.time() - 120) * 1000))
            assert c.request(OP_RELOAD, old, session=0).status == ST_AUTH
        assert wait_until(lambda: not w.call(lambda: w.app.reloader.running))
        assert w.call(lambda: w.app.reloader.asked) == 2  # the refused ones asked nothing


def test_reload_over_the_wire_needs_a_secret(worker: ThreadWorker) -> None:
    with worker.connect() as c:
        body = reload_body(b"x", int(time.time() * 1000))
        assert c.request(OP_RELOAD, body, session=0).status == ST_AUTH


def test_the_canary_shadows_sampled_sessions_with_their_own_seeds(
        folders: dict[str, Path], drafter: Any) -> None:
    """A sampled session's shadow drafts are drawn with the entries' sampling fields and
    judged like any other (the figure is an estimate there: docs/operations.md)."""
    point(folders["canary"], folders["B"])
    with thread_worker(drafter, canary_checkpoint=str(folders["canary"]),
                       canary_fraction=1.0) as w, w.connect() as c:
        hello = make_hello(drafter, sample_mode=SAMPLE_TOP32, max_slots=2, client_name="s")
        assert c.hello(hello).status == ST_OK
        rb, anchor, rows = drafter.row_bytes, 12, 12
        for _ in range(12):
            entries = [ReqEntry(slot=s, generation=1, anchor_pos=anchor + s, anchor_token=7 + s,
                                n_rows=rows, flags=RF_NEED_DRAFT, seed=99 + s, top_k=32,
                                temperature=0.7, top_p=0.95) for s in range(2)]
            data = np.concatenate([tap_rows(rb, s, 1, anchor + s - rows, rows)
                                   for s in range(2)])
            r = c.step(entries, data, rb)
            assert r.status == ST_OK
            anchor, rows = anchor + 1, 1  # nothing accepted: the next token is the anchor's
            time.sleep(0.01)
        assert wait_until(lambda: w.call(lambda: w.app.canary.backlog_steps) == 0)
        summary = w.call(lambda: w.app.canary.summary())
        assert w.call(lambda: w.app.runner.shadow_errors) == 0
        assert summary["lanes_used"] == 2
        judged = summary["acceptance"]["rounds"]
        assert judged + summary["censored_blocks"] >= 20 and judged > 0
        assert summary["serving_acceptance"]["rounds"] == judged


def test_acceptance_keeps_the_versions_the_worker_keeps() -> None:
    """A version made newest again is kept as long as ``Versions.kept`` keeps it: its
    acceptance series are not the first to go when more versions come."""
    from types import SimpleNamespace

    from dspark_worker.acceptance import WorkerAcceptance
    from dspark_worker.versions import VERSIONS_KEPT

    acc = WorkerAcceptance(4)

    def version(n: int) -> Any:
        return SimpleNamespace(number=n, name=f"v{n}", has_confidence=True)

    first = version(1)
    totals = acc.version_added(first, newest=True)
    for n in range(2, VERSIONS_KEPT + 1):
        acc.version_added(version(n), newest=True)
    assert acc.version_added(first, newest=True) is totals  # back to version 1
    acc.version_added(version(VERSIONS_KEPT + 1), newest=True)
    kept = acc.by_version()
    assert 1 in kept and 2 not in kept and len(kept) == VERSIONS_KEPT
