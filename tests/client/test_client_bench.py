"""bench/bench_client.py keeps working (a short smoke run; the figures come from the script)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def load_bench() -> Any:
    path = ROOT / "bench" / "bench_client.py"
    spec = importlib.util.spec_from_file_location("bench_client", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bench_smoke() -> None:
    bench = load_bench()
    for sampled in (False, True):
        r = bench.bench_step(8, sampled, 0.01)
        assert r["median_us"] > 0 and "check_reply_values" in r["parts"]
    for sampled in (False, True):
        for form in ("batch", "list"):
            r = bench.bench_rounds(8, sampled, 0.01, form=form)
            assert r["median_us"] > 0 and r["rows_per_slot"] == 4


def test_bench_paired_smoke(capsys: Any) -> None:
    """--paired: every case runs in turn and each round is put against step()."""
    load_bench().paired_rounds(4, 10)
    out = capsys.readouterr().out
    for name in ("step ", "run_batch", "run "):
        assert out.count(name) >= 2, out
    assert out.count("x step(): whole") == 4, out
    load_bench().paired_rounds(4, 10, forms=("list",))  # the set of a tree without run_batch
    out = capsys.readouterr().out
    assert "run_batch" not in out and out.count("x step(): whole") == 2, out
    bench = load_bench()
    r = bench.bench_acceptance(1, 0.01)
    assert r["mean_us"] > 0 and r["median_us"] > 0
