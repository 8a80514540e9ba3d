"""A checkpoint folder is input: hostile and broken folders of every family are refused with
``CheckpointRefused`` (naming key, value and limit) before anything is allocated for them, and
what loads drafts finite values. A fixed table of the cases that crashed or ate memory before,
a seeded fuzz of config values over the shipped checkpoints of the three families (a fixed
hypothesis budget), and files that are not what they claim (FIFOs, devices, symlinks, folders,
truncated and lying safetensors headers, sparse files of every declared size)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import struct
import tempfile
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dspark_worker.app import self_check
from dspark_worker.drafter import CheckpointRefused, expected_shapes, load_drafter, parse_config
from dspark_worker.drafter.checkpoint import resolve_checkpoint
from dspark_worker.drafter.drafter import REFERENCE_DIR
from dspark_worker.drafter.limits import MAX_CONFIG_BYTES

DATA = Path(__file__).resolve().parent / "data"
SPEC = DATA / "speculators_tiny"
DFLASH = DATA / "dflash_tiny"
FAMILIES: dict[str, tuple[Path, Path | None]] = {
    "qwen3": (REFERENCE_DIR, None),
    "gemma4": (DATA / "gemma4_tiny", None),
    "speculators": (SPEC / "vanilla_anchor_reduced", SPEC / "target"),
    "speculators-yarn": (SPEC / "llama_bias_yarn_bonus_nomarkov", SPEC / "target"),
    "dflash-zlab": (DFLASH / "zlab_legacy_b8", DFLASH / "target"),
    "dflash2-yarn": (DFLASH / "extra_zlab2_scaled_yarn", DFLASH / "target"),
}
# A refusal comes before the weights are read: far under this on any machine (and a FIFO or
# an endless file that is read anyway fails the test here instead of hanging it).
REFUSED_WITHIN_S = 10


@contextlib.contextmanager
def deadline(seconds: int) -> Iterator[None]:
    def expired(*_: object) -> None:
        raise TimeoutError(f"not refused within {seconds} s (a blocking or endless read?)")

    before = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, before)


def folder(base: Path, into: Path, config: dict[str, Any] | None = None) -> Path:
    """A copy of checkpoint ``base`` in ``into``: its config (or ``config``), its weight files
    as symlinks (no identity file: nothing is hashed from a stale record)."""
    into.mkdir(parents=True, exist_ok=True)
    for f in base.iterdir():
        if f.name not in ("config.json", "dspark_identity.json"):
            (into / f.name).symlink_to(f)
    raw = config if config is not None else json.loads((base / "config.json").read_text())
    (into / "config.json").write_text(json.dumps(raw))
    return into


def raw(family: str) -> dict[str, Any]:
    out: dict[str, Any] = json.loads((FAMILIES[family][0] / "config.json").read_text())
    return out


def put(config: dict[str, Any], path: tuple[str, ...], value: Any) -> dict[str, Any]:
    out = json.loads(json.dumps(config))
    node = out
    for key in path[:-1]:
        node = node.setdefault(key, {})
    node[path[-1]] = value
    return out


def refused(path: Path, target: Path | None) -> CheckpointRefused:
    with deadline(REFUSED_WITHIN_S), pytest.raises(CheckpointRefused) as info:
        load_drafter(path, target, record_identities=False)
    return info.value


# -- the cases that crashed, hung or ate memory ---------------------------------------------
LAYER = ("transformer_layer_config",)
ROPE = ("transformer_layer_config", "rope_parameters")
TABLE: list[tuple[str, tuple[str, ...], Any, str]] = [
    # (family, key, value, what the line says)
    ("speculators", ("block_size",), 100000, "N must be in 1..64"),  # N past HELLO's u16
    ("speculators", ("block_size",), 20000, "N must be in 1..64"),  # over 1 GiB at warm-up
    ("qwen3", ("block_size",), 100000, "N must be in 1..64"),
    ("gemma4", ("block_size",), 2**31, "N must be in 1..64"),
    ("qwen3", ("num_hidden_layers",), 2**31, "is over 256"),  # a layer table built first
    ("speculators", (*LAYER, "num_hidden_layers"), 2**31, "is over 256"),
    ("qwen3", ("hidden_size",), 2**31, "is over 65536"),
    ("qwen3", ("vocab_size",), 2**40, "is over 4194304"),
    ("gemma4", ("intermediate_size",), 2**31, "is over 262144"),
    ("qwen3", ("target_layer_ids",), list(range(100)), "is over 64 taps"),
    ("qwen3", ("rope_theta",), 1e-300, "must be a finite number above 1"),  # NaN drafts
    ("qwen3", ("rope_theta",), math.nan, "is not a finite number"),
    ("gemma4", ("rope_parameters", "full_attention", "rope_theta"), 1e-300, "above 1"),
    ("speculators-yarn", (*ROPE, "rope_theta"), 1, "above 1"),  # ZeroDivisionError in yarn
    ("speculators-yarn", (*ROPE, "factor"), math.inf, "must be a finite number in [1, 1024]"),
    ("speculators-yarn", (*ROPE, "beta_fast"), math.nan, "must be a finite number in (0,"),
    ("speculators-yarn", (*ROPE, "original_max_position_embeddings"), 0,  # log of zero
     "must be a finite number in (0,"),
    ("speculators-yarn", (*ROPE, "mscale_all_dim"), -50.0, "must be a finite number in [0,"),
    ("speculators", (*ROPE, "rope_type"), "llama3", "is missing"),
    ("gemma4", ("final_logit_softcapping",), 1e308, "must be a number in (0, 1e+06]"),
    ("speculators", (*LAYER, "rms_norm_eps"), math.inf, "is not a finite number"),
    ("dflash-zlab", ("rope_scaling",), 5, "is not an object"),  # a TypeError before
    ("dflash2-yarn", ("dflash_config", "final_logit_softcapping"), 1e308,  # an IndexError
     "must be a number in (0, 1e+06]"),
    ("dflash2-yarn", ("dflash_config", "input_embedding_scale"), 1e308, "at most 1e+06"),
    ("dflash-zlab", ("block_size",), 100000, "N must be in 1..64"),
]


@pytest.mark.parametrize("family,key,value,says", TABLE,
                         ids=[f"{f}-{'.'.join(k)}={v!r}"[:60] for f, k, v, _ in TABLE])
def test_hostile_sizes_and_parameters_are_refused_by_name(tmp_path: Path, family: str,
                                                          key: tuple[str, ...], value: Any,
                                                          says: str) -> None:
    base, target = FAMILIES[family]
    config = put(raw(family), key, value)
    if family == "speculators" and key == (*ROPE, "rope_type"):
        config[LAYER[0]]["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 1e4,
                                              "factor": 8.0}
    err = refused(folder(base, tmp_path / "ckpt", config), target)
    text = str(err)
    assert says in text and key[-1] in text, text
    assert "config.json" in text and "\n" not in text


# -- a seeded fuzz over every family's config ----------------------------------------------
def leaves(node: Any, at: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    if isinstance(node, dict):
        for k, v in node.items():
            yield from leaves(v, (*at, k))
    elif not isinstance(node, list):
        yield at


VALUES = [0, -1, 1, 2, 3, 65, 100000, 2**31, 2**63, 1e9, math.nan, math.inf, -math.inf,
          1e-300, 1e308, 0.5, "x", None, [], {}, True, [0, 1, 2]]
CASES = [(family, path) for family in FAMILIES for path in leaves(raw(family))]


@settings(max_examples=120, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(case=st.sampled_from(CASES), value=st.sampled_from(VALUES))
def test_config_fuzz_refuses_by_name_or_loads_a_working_drafter(case: tuple[str, Any],
                                                                value: Any) -> None:
    """Any value in any key of any family's config.json: refused (CheckpointRefused, one line,
    the key's name in it), or the checkpoint resolves; 1 in 4 of those is loaded, warmed up
    and must draft finite values (the self-check the worker runs at start)."""
    family, path = case
    base, target = FAMILIES[family]
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = folder(base, Path(tmp) / "ckpt", put(raw(family), path, value))
        try:
            with deadline(REFUSED_WITHIN_S):
                resolve_checkpoint(ckpt, target)
        except CheckpointRefused as exc:
            assert "\n" not in str(exc) and exc.field is not None, str(exc)
            return
        if zlib.crc32(repr((family, path, value)).encode()) % 4 == 0:
            d = load_drafter(ckpt, target, record_identities=False)
            d.warmup()
            assert self_check(d) is None, (family, path, value)


# -- files that are not what they say --------------------------------------------------------
def _st_parts(path: Path) -> tuple[dict[str, Any], bytes]:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + n]), data[8 + n:]


def _st_write(path: Path, header: dict[str, Any], body: bytes, length: int | None = None,
              sparse: int | None = None) -> None:
    """A safetensors file; ``sparse``: no body, a hole of that many bytes instead (no disk)."""
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    path.unlink()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head) if length is None else length) + head + body)
        if sparse is not None:
            f.truncate(8 + len(head) + sparse)


def _replace(ckpt: Path, name: str) -> Path:
    (ckpt / name).unlink()
    return ckpt / name


def _lie_in_header(change: Callable[[dict[str, Any]], None]) -> Callable[[Path], None]:
    def make(ckpt: Path) -> None:
        header, body = _st_parts(ckpt / "model.safetensors")
        change(header)
        _st_write(ckpt / "model.safetensors", header, body)
    return make


def _sparse_at_the_bounds(ckpt: Path) -> None:
    """Shapes that agree with a config at the size bounds, in a sparse file of terabytes."""
    config = json.loads((ckpt / "config.json").read_text())
    config.update(vocab_size=1 << 22, hidden_size=1 << 16)
    (ckpt / "config.json").write_text(json.dumps(config))
    header, at = {}, 0
    for name, shape in expected_shapes(parse_config(config)).items():
        n = 4 * math.prod(shape)
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [at, at + n]}
        at += n
    _st_write(ckpt / "model.safetensors", header, b"", sparse=at)


def _cut(fraction: float) -> Callable[[Path], None]:
    def make(ckpt: Path) -> None:
        data = (REFERENCE_DIR / "model.safetensors").read_bytes()
        _replace(ckpt, "model.safetensors").write_bytes(data[:int(len(data) * fraction)])
    return make


def _first_tensor(header: dict[str, Any]) -> dict[str, Any]:
    entry: dict[str, Any] = header[next(k for k in sorted(header) if k != "__metadata__")]
    return entry


FILES: dict[str, tuple[Callable[[Path], None], str]] = {
    "config FIFO": (lambda c: os.mkfifo(_replace(c, "config.json")), "is a FIFO"),
    "config -> /dev/zero": (lambda c: _replace(c, "config.json").symlink_to("/dev/zero"),
                            "is a character device"),
    "config folder": (lambda c: _replace(c, "config.json").mkdir(), "is a folder"),
    "config huge": (lambda c: (c / "config.json").write_bytes(
        b" " * (MAX_CONFIG_BYTES + 1) + b"{}"), f"over the {MAX_CONFIG_BYTES}-byte limit"),
    "config nested": (lambda c: (c / "config.json").write_text("[" * 100000 + "]" * 100000),
                      "not JSON this reader accepts"),
    "config not UTF-8": (lambda c: (c / "config.json").write_bytes(b"\xff{}"),
                         "not valid JSON"),
    "config 5000-digit integer": (lambda c: (c / "config.json").write_text(
        '{"hidden_size": ' + "9" * 5000 + "}"), "not JSON this reader accepts"),
    "weights FIFO": (lambda c: os.mkfifo(_replace(c, "model.safetensors")), "is a FIFO"),
    "weights -> /dev/zero": (lambda c: _replace(c, "model.safetensors").symlink_to("/dev/zero"),
                             "is a character device"),
    "weights -> /dev/urandom": (lambda c: _replace(c, "model.safetensors").symlink_to(
        "/dev/urandom"), "is a character device"),
    "weights cut in the header": (_cut(0.0005), "the file holds"),
    "weights cut in the tensors": (_cut(0.5), "lie outside the file"),
    "header length lies": (lambda c: _st_write(
        c / "model.safetensors", *_st_parts(c / "model.safetensors"), length=1 << 40),
        "is over the 33554432-byte limit"),
    "header offsets past the end": (_lie_in_header(lambda h: _first_tensor(h).update(
        data_offsets=[0, 1 << 40])), "lie outside the file"),
    "header offsets reversed": (_lie_in_header(lambda h: _first_tensor(h).update(
        data_offsets=[8, 4])), "malformed entry"),
    "header shape of floats": (_lie_in_header(lambda h: _first_tensor(h).update(
        shape=[1.5])), "malformed entry"),
    "header bytes short of the shape": (_lie_in_header(lambda h: h["norm.weight"].update(
        data_offsets=[h["norm.weight"]["data_offsets"][0],
                      h["norm.weight"]["data_offsets"][1] - 4])), "needs"),
    "header not an object": (lambda c: _write_raw_header(c, b"[1, 2, 3] "), "not an object"),
    "index leads out of the folder": (lambda c: (_replace(c, "model.safetensors").with_name(
        "model.safetensors.index.json")).write_text(json.dumps(
            {"weight_map": {"norm.weight": "../../../etc/passwd"}})), "not a file name"),
    "index -> /dev/zero": (lambda c: (c / "model.safetensors.index.json").symlink_to(
        "/dev/zero"), "is a character device"),
    "sparse file at the size bounds": (_sparse_at_the_bounds, "MemAvailable"),
}


def _write_raw_header(ckpt: Path, head: bytes) -> None:
    path = _replace(ckpt, "model.safetensors")
    path.write_bytes(struct.pack("<Q", len(head)) + head)


@pytest.mark.parametrize("name", list(FILES))
def test_files_that_are_not_what_they_say_are_refused(tmp_path: Path, name: str) -> None:
    make, says = FILES[name]
    ckpt = folder(REFERENCE_DIR, tmp_path / "ckpt")
    (ckpt / "model.safetensors").unlink()  # a copy to lie in, not the shipped file's symlink
    shutil.copy(REFERENCE_DIR / "model.safetensors", ckpt / "model.safetensors")
    make(ckpt)
    err = refused(ckpt, None)
    assert says in str(err) and "\n" not in str(err), str(err)


def test_a_refused_folder_leaves_a_loaded_drafter_as_it_was(tmp_path: Path) -> None:
    """What a reload relies on: loading a refused folder raises before it touches anything a
    serving drafter holds; the drafter loaded before drafts the same afterwards."""
    good = load_drafter(REFERENCE_DIR, record_identities=False)
    pool = good.new_pool(1, 8)
    lanes = pool.allocate(1)
    rows = np.full((4, good.row_bytes // 2), 0x3F80, dtype=np.uint16).view(np.uint8)
    pool.apply(lanes, np.array([4]), np.array([4]), np.ones(1, dtype=bool), rows)
    before = good.draft(pool, lanes, np.array([4]), np.zeros(1, dtype=np.int64)).draft_ids
    bad = folder(REFERENCE_DIR, tmp_path / "bad", put(raw("qwen3"), ("block_size",), 100000))
    refused(bad, None)
    after = good.draft(pool, lanes, np.array([4]), np.zeros(1, dtype=np.int64)).draft_ids
    assert np.array_equal(before, after)
