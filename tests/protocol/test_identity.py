"""Drafter and Markov identities from real safetensors files (docs/contract.md section 6.4)."""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from protocol.errors import BadFrameError, WireError
from protocol.identity import (
    CHANGED_WHILE_READ,
    IDENTITY_FILE,
    CheckpointChanged,
    CheckpointFolder,
    SafetensorsError,
    drafter_refs,
    identities_from_arrays,
    identities_from_checkpoint,
    identities_from_files,
    identities_from_refs,
    missing_target_tensor_message,
    read_header,
    read_identity_file,
    write_identity_file,
)

Tensor = tuple[str, tuple[int, ...], bytes]  # safetensors dtype, shape, raw LE bytes

_rng = np.random.default_rng(64)
ARRAYS: dict[str, np.ndarray] = {
    "layers.0.attn.weight": _rng.normal(size=(3, 4)).astype("<f4"),
    "layers.0.attn.bias": _rng.normal(size=4).astype("<f2"),
    "layers.1.index": np.arange(5, dtype="<i4") - 2,
    "fc.weight": _rng.normal(size=(2, 3)).astype("<f4"),
    "markov_head.weight": _rng.normal(size=(4, 2)).astype("<f4"),
    "markov_head.bias": _rng.normal(size=2).astype("<f4"),
    "embed_tokens.weight": _rng.normal(size=(10, 3)).astype("<f4"),
    "lm_head.weight": _rng.normal(size=(10, 3)).astype("<f4"),
}
# bf16: numpy has no such dtype and safetensors.numpy cannot write it; raw u16 bit patterns
NORM_BF16 = np.array([0x3F80, 0x4000, 0xBF80, 0x0000, 0x7F7F, 0x3E80], dtype="<u2")
DTYPES = {"float32": "F32", "float16": "F16", "int32": "I32"}


def tensors(arrays: dict[str, np.ndarray] = ARRAYS, with_bf16: bool = True) -> dict[str, Tensor]:
    out = {name: (DTYPES[a.dtype.name], a.shape, a.tobytes()) for name, a in arrays.items()}
    if with_bf16:
        out["norm.weight"] = ("BF16", NORM_BF16.shape, NORM_BF16.tobytes())
    return out


ALL = tensors()
DRAFTER_NAMES = [n for n in ALL if n not in ("embed_tokens.weight", "lm_head.weight")]


def write_safetensors(path: Path, items: list[tuple[str, Tensor]],
                      metadata: dict[str, str] | None = None) -> None:
    """A safetensors file written by hand, tensors in the order given: u64 LE header length,
    the JSON header (padded with spaces to 8 bytes), then the data."""
    header: dict[str, object] = {}
    if metadata is not None:
        header["__metadata__"] = metadata
    off = 0
    for name, (dtype, shape, data) in items:
        end = off + len(data)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, end]}
        off = end
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(t[2] for _, t in items))


def write_dir(path: Path, shards: list[list[str]], source: dict[str, Tensor] = ALL,
              index: bool = True, reverse_index: bool = False) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for s, names in enumerate(shards):
        fname = f"model-{s + 1:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(path / fname, [(n, source[n]) for n in names])
        weight_map.update({n: fname for n in names})
    if index:
        items = sorted(weight_map.items(), reverse=reverse_index)
        (path / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": 0}, "weight_map": dict(items)}))
    return path


def recipe(items: dict[str, Tensor]) -> tuple[bytes, bytes]:
    """Section 6.4 by hand: name 0x00 dtype 0x00 | ndim u32 | dims u64 | nbytes u64 | bytes."""
    drafter, markov = hashlib.sha256(), hashlib.sha256()
    for name in sorted(items):
        dtype, shape, data = items[name]
        h = markov if name.startswith("markov_head.") else drafter
        h.update(name.encode() + b"\0" + dtype.encode() + b"\0")
        h.update(struct.pack("<I", len(shape)))
        for d in shape:
            h.update(struct.pack("<Q", d))
        h.update(struct.pack("<Q", len(data)) + data)
    return drafter.digest(), markov.digest()


@pytest.fixture
def single(tmp_path: Path) -> Path:
    d = tmp_path / "single"
    d.mkdir()
    write_safetensors(d / "model.safetensors", list(ALL.items()))
    return d


# -- the recipe -----------------------------------------------------------------------------------
def test_identities_follow_the_contract_recipe(single: Path) -> None:
    got = identities_from_checkpoint(single)
    assert got == recipe(ALL)
    assert got == identities_from_arrays(ALL)
    assert got[0] != got[1]


def test_golden_identities_of_a_tiny_checkpoint() -> None:
    tiny: dict[str, Tensor] = {
        "w": ("F32", (2,), struct.pack("<2f", 1.0, 2.0)),
        "markov_head.b": ("BF16", (1, 1), b"\x80\x3f"),
    }
    drafter, markov = identities_from_arrays(tiny)
    assert drafter == hashlib.sha256(
        b"w\0F32\0" + bytes.fromhex("01000000 0200000000000000 0800000000000000")
        + bytes.fromhex("0000803f 00000040")).digest()
    assert markov == hashlib.sha256(
        b"markov_head.b\0BF16\0"
        + bytes.fromhex("02000000 0100000000000000 0100000000000000 0200000000000000")
        + b"\x80\x3f").digest()
    assert drafter.hex() == recipe(tiny)[0].hex()
    # no Markov tensors: the digest of nothing
    assert identities_from_arrays({"w": tiny["w"]})[1] == hashlib.sha256(b"").digest()


# -- what does not change it ----------------------------------------------------------------------
def test_the_safetensors_package_file_gives_the_same_identities(single: Path,
                                                                tmp_path: Path) -> None:
    d = tmp_path / "pkg"
    d.mkdir()
    save_file(dict(ARRAYS), str(d / "model.safetensors"), metadata={"format": "np"})
    write_safetensors(d / "norm.safetensors", [("norm.weight", ALL["norm.weight"])])
    # model.safetensors wins over other files when it exists: add the bf16 tensor by index
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        **{n: "model.safetensors" for n in ARRAYS}, "norm.weight": "norm.safetensors"}}))
    assert identities_from_checkpoint(d) == identities_from_checkpoint(single)


def test_tensor_order_inside_a_file_does_not_matter(single: Path, tmp_path: Path) -> None:
    d = tmp_path / "reversed"
    d.mkdir()
    write_safetensors(d / "model.safetensors", list(reversed(ALL.items())),
                      metadata={"note": "anything"})
    assert identities_from_checkpoint(d) == identities_from_checkpoint(single)


@pytest.mark.parametrize("reverse_index", [False, True])
def test_shard_split_and_file_order_do_not_matter(single: Path, tmp_path: Path,
                                                  reverse_index: bool) -> None:
    names = list(ALL)
    three = write_dir(tmp_path / "three", [names[5:], names[:2], names[2:5]],
                      reverse_index=reverse_index)
    one_each = write_dir(tmp_path / "one_each", [[n] for n in reversed(names)])
    want = identities_from_checkpoint(single)
    assert identities_from_checkpoint(three) == want
    assert identities_from_checkpoint(one_each) == want


def test_a_folder_without_index_uses_every_safetensors_file(single: Path,
                                                            tmp_path: Path) -> None:
    names = list(ALL)
    d = write_dir(tmp_path / "glob", [names[:4], names[4:]], index=False)
    assert identities_from_checkpoint(d) == identities_from_checkpoint(single)


def test_file_list_order_does_not_matter(tmp_path: Path) -> None:
    names = list(ALL)
    d = write_dir(tmp_path / "files", [names[:3], names[3:6], names[6:]], index=False)
    paths = sorted(d.glob("*.safetensors"))
    want = recipe(ALL)
    assert identities_from_files(paths) == want
    assert identities_from_files(list(reversed(paths))) == want
    assert identities_from_files([str(p) for p in paths[1:] + paths[:1]]) == want


# -- what changes it, and which one ---------------------------------------------------------------
def _flip(path: Path, name: str, at: int) -> None:
    ref = read_header(path)[name]
    raw = bytearray(path.read_bytes())
    raw[ref.start + at % (ref.end - ref.start)] ^= 0x01
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("name", list(ALL))
@pytest.mark.parametrize("at", [0, -1])
def test_one_byte_of_one_tensor_changes_only_its_identity(single: Path, name: str,
                                                          at: int) -> None:
    before = identities_from_checkpoint(single)
    _flip(single / "model.safetensors", name, at)
    after = identities_from_checkpoint(single)
    if name.startswith("markov_head."):
        assert after[0] == before[0] and after[1] != before[1]
    else:
        assert after[0] != before[0] and after[1] == before[1]


def _changed(name: str, dtype: str | None = None, shape: tuple[int, ...] | None = None,
             rename: str | None = None) -> dict[str, Tensor]:
    out = dict(ALL)
    d, s, data = out.pop(name)
    out[rename or name] = (dtype or d, shape or s, data)
    return out


@pytest.mark.parametrize(("variant", "which"), [
    (_changed("fc.weight", dtype="I32"), 0),
    (_changed("fc.weight", shape=(3, 2)), 0),
    (_changed("fc.weight", shape=(6,)), 0),
    (_changed("fc.weight", rename="fc.weights"), 0),
    (_changed("markov_head.bias", dtype="I32"), 1),
    (_changed("markov_head.weight", shape=(2, 4)), 1),
    (_changed("markov_head.bias", rename="markov_head.bias2"), 1),
])
def test_dtype_shape_and_name_are_part_of_the_identity(variant: dict[str, Tensor],
                                                       which: int) -> None:
    base, new = identities_from_arrays(ALL), identities_from_arrays(variant)
    assert new[which] != base[which]
    assert new[1 - which] == base[1 - which]


def test_moving_a_tensor_under_markov_head_moves_it_between_identities() -> None:
    moved = _changed("fc.weight", rename="markov_head.fc.weight")
    base, new = identities_from_arrays(ALL), identities_from_arrays(moved)
    assert new[0] != base[0] and new[1] != base[1]


# -- embed_tokens and lm_head from the target -----------------------------------------------------
@pytest.fixture
def full_drafter(tmp_path: Path) -> Path:
    return write_dir(tmp_path / "full", [list(ALL)], index=False)


@pytest.fixture
def bare_drafter(tmp_path: Path) -> Path:
    return write_dir(tmp_path / "bare", [DRAFTER_NAMES], index=False)


TARGET_OTHER: Tensor = ("F32", (2, 2), np.arange(4, dtype="<f4").tobytes())


def test_target_fallbacks_equal_a_drafter_that_holds_them(full_drafter: Path, bare_drafter: Path,
                                                          tmp_path: Path) -> None:
    target_src = {"model.embed_tokens.weight": ALL["embed_tokens.weight"],
                  "lm_head.weight": ALL["lm_head.weight"],
                  "model.layers.0.mlp.weight": TARGET_OTHER,
                  "model.norm.weight": ALL["norm.weight"]}
    target = write_dir(tmp_path / "target", [["model.embed_tokens.weight"],
                                              ["lm_head.weight", "model.layers.0.mlp.weight",
                                               "model.norm.weight"]], source=target_src)
    want = identities_from_checkpoint(full_drafter)
    assert identities_from_checkpoint(bare_drafter, target) == want
    # Without the target there is no identity to compute: the drafter cannot run.
    with pytest.raises(SafetensorsError) as info:
        identities_from_checkpoint(bare_drafter)
    assert str(info.value) == missing_target_tensor_message(bare_drafter, "embed_tokens.weight",
                                                            None)
    assert info.value.field == "embed_tokens.weight"


def test_a_tied_target_serves_its_embedding_as_lm_head(bare_drafter: Path,
                                                       tmp_path: Path) -> None:
    emb = ALL["embed_tokens.weight"]
    target = write_dir(tmp_path / "tied", [["embed_tokens.weight"]],
                       source={"embed_tokens.weight": emb})
    names = [*DRAFTER_NAMES, "embed_tokens.weight", "lm_head.weight"]
    tied_full = write_dir(tmp_path / "tied_full", [names], source={**ALL, "lm_head.weight": emb},
                          index=False)
    assert identities_from_checkpoint(bare_drafter, target) == identities_from_checkpoint(
        tied_full)


def test_the_drafter_own_tensors_win_over_the_target(full_drafter: Path,
                                                     tmp_path: Path) -> None:
    other = ("F32", (10, 3), bytes(120))
    target = write_dir(tmp_path / "other_target", [["model.embed_tokens.weight",
                                                    "lm_head.weight"]],
                       source={"model.embed_tokens.weight": other, "lm_head.weight": other})
    assert identities_from_checkpoint(full_drafter, target) == identities_from_checkpoint(
        full_drafter)


def test_extra_tensors_by_file(full_drafter: Path, bare_drafter: Path, tmp_path: Path) -> None:
    tfile = tmp_path / "target.safetensors"
    write_safetensors(tfile, [("model.embed_tokens.weight", ALL["embed_tokens.weight"]),
                              ("output.weight", ALL["lm_head.weight"])])
    paths = sorted(bare_drafter.glob("*.safetensors"))
    got = identities_from_files(paths, extra={"embed_tokens.weight": tfile,
                                              "lm_head.weight": (tfile, "output.weight")})
    assert got == identities_from_checkpoint(full_drafter)
    with pytest.raises(SafetensorsError) as info:
        identities_from_files(paths, extra={"lm_head.weight": (tfile, "missing.weight")})
    assert str(tfile) in str(info.value) and "lm_head.weight" in str(info.value)


# -- malformed files ------------------------------------------------------------------------------
GOOD_HEAD = {"t": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}


def _file(header: object, data: bytes = bytes(4), declared: int | None = None) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    n = len(raw) if declared is None else declared
    return struct.pack("<Q", n) + raw + data


MALFORMED: dict[str, bytes] = {
    "too_short": b"\x01\x02\x03",
    "header_over_limit": struct.pack("<Q", 1 << 40) + b"{}",
    "header_past_the_end": _file(GOOD_HEAD, data=b"", declared=10_000),
    "header_not_json": _file(b"{not json"),
    "header_not_utf8": _file(b'{"\xff\xfe": 1}'),
    "header_a_list": _file([1, 2, 3]),
    "entry_without_offsets": _file({"t": {"dtype": "F32", "shape": [1]}}),
    "entry_not_an_object": _file({"t": "F32"}),
    "offsets_not_numbers": _file({"t": {"dtype": "F32", "shape": [1],
                                        "data_offsets": ["a", "b"]}}),
    "offsets_past_the_end": _file({"t": {"dtype": "F32", "shape": [2],
                                         "data_offsets": [0, 8]}}),
    "offsets_reversed": _file({"t": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}}),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_file_names_itself(tmp_path: Path, case: str) -> None:
    path = tmp_path / f"{case}.safetensors"
    path.write_bytes(MALFORMED[case])
    with pytest.raises(SafetensorsError) as info:
        identities_from_files([path])
    assert isinstance(info.value, BadFrameError) and isinstance(info.value, WireError)
    assert str(path) in str(info.value)
    with pytest.raises(SafetensorsError):
        identities_from_checkpoint(tmp_path)


def test_missing_file_and_directory_are_named(tmp_path: Path) -> None:
    missing = tmp_path / "nope.safetensors"
    with pytest.raises(SafetensorsError) as info:
        identities_from_files([missing])
    assert str(missing) in str(info.value)
    with pytest.raises(SafetensorsError) as info:
        identities_from_files([tmp_path])
    assert str(tmp_path) in str(info.value)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(SafetensorsError) as info:
        identities_from_checkpoint(empty)
    assert str(empty) in str(info.value)


def test_a_tensor_in_two_shards_names_both(tmp_path: Path) -> None:
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    write_safetensors(a, [("x", ALL["fc.weight"])])
    write_safetensors(b, [("x", ALL["fc.weight"])])
    with pytest.raises(SafetensorsError) as info:
        identities_from_checkpoint(tmp_path)
    assert str(a) in str(info.value) and str(b) in str(info.value)
    assert info.value.field == "x"


@pytest.mark.parametrize("index", [b"{", b"[]", b'{"weight_map": [1, 2]}', b'{"other": {}}',
                                   b'{"weight_map": {"x": 5, "y": "a.safetensors"}}'])
def test_a_malformed_index_names_itself(tmp_path: Path, index: bytes) -> None:
    (tmp_path / "model.safetensors.index.json").write_bytes(index)
    with pytest.raises(SafetensorsError) as info:
        identities_from_checkpoint(tmp_path)
    assert "model.safetensors.index.json" in str(info.value)


# -- the identity file beside a checkpoint ---------------------------------------------------------
def test_identity_file_answers_without_the_weights_and_goes_stale(full_drafter: Path) -> None:
    refs = drafter_refs(full_drafter)
    real = identities_from_checkpoint(full_drafter, use_identity_file=False)
    assert read_identity_file(full_drafter, refs) is None  # none written yet
    assert identities_from_checkpoint(full_drafter) == real  # hashed; nothing written
    assert not (full_drafter / IDENTITY_FILE).exists()
    # A recorded value is taken as it stands while the files are as recorded: the weights
    # are not read (a made-up record shows it).
    made_up = (bytes(range(32)), bytes(range(1, 33)))
    path = write_identity_file(full_drafter, refs, made_up)
    assert path == full_drafter / IDENTITY_FILE
    assert identities_from_checkpoint(full_drafter) == made_up
    assert identities_from_checkpoint(full_drafter, use_identity_file=False) == real
    # A weights file touched since: stale, hashed again.
    shard = sorted(full_drafter.glob("*.safetensors"))[0]
    st = shard.stat()
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert read_identity_file(full_drafter, drafter_refs(full_drafter)) is None
    assert identities_from_checkpoint(full_drafter) == real
    # Unreadable or foreign content is ignored, never an error.
    for text in ("{", "[]", '{"format": 99}', '{"format": 1, "inputs": {}}'):
        (full_drafter / IDENTITY_FILE).write_text(text)
        assert identities_from_checkpoint(full_drafter) == real


def test_identity_file_covers_the_target(bare_drafter: Path, tmp_path: Path) -> None:
    src = {"model.embed_tokens.weight": ALL["embed_tokens.weight"],
           "lm_head.weight": ALL["lm_head.weight"]}
    t1 = write_dir(tmp_path / "t1", [list(src)], source=src)
    t2 = write_dir(tmp_path / "t2", [list(src)], source=src)
    real = identities_from_checkpoint(bare_drafter, t1)
    write_identity_file(bare_drafter, drafter_refs(bare_drafter, t1), (bytes(32), bytes(32)))
    assert identities_from_checkpoint(bare_drafter, t1) == (bytes(32), bytes(32))
    # Another target folder is another input: the record does not answer for it.
    assert read_identity_file(bare_drafter, drafter_refs(bare_drafter, t2)) is None
    assert identities_from_checkpoint(bare_drafter, t2) == real


def test_identity_file_not_writable(full_drafter: Path) -> None:
    # A place the record cannot go (as on a read-only volume; a folder in its way works for
    # root too): no error, nothing left behind, and reading falls back to hashing.
    (full_drafter / IDENTITY_FILE).mkdir()
    refs = drafter_refs(full_drafter)
    assert write_identity_file(full_drafter, refs, (bytes(32), bytes(32))) is None
    assert [p.name for p in full_drafter.iterdir() if p.name.startswith(".")] == []
    assert identities_from_checkpoint(full_drafter) == identities_from_checkpoint(
        full_drafter, use_identity_file=False)


# -- one folder, read as it was -------------------------------------------------------------------
CONFIG = {"block_size": 7, "rope_theta": 10000.0, "target_layer_ids": [1, 3],
          "rope_scaling": {"type": "yarn", "factor": 2.0}, "transformers_version": "4.56.0"}


def with_config(path: Path, config: dict[str, object] = CONFIG, indent: int | None = None
                ) -> Path:
    (path / "config.json").write_text(json.dumps(config, indent=indent))
    return path


def test_the_config_enters_the_drafter_identity_as_the_contract_says(full_drafter: Path
                                                                     ) -> None:
    tensors_only = recipe(ALL)
    with_config(full_drafter)
    got = identities_from_checkpoint(full_drafter, use_identity_file=False)
    kept = {k: v for k, v in CONFIG.items() if k != "transformers_version"}
    text = json.dumps(kept, sort_keys=True, separators=(",", ":")).encode()
    by_hand = recipe({**ALL, "config.json": ("JSON", (len(text),), text)})
    # the config after every tensor (whatever its name sorts as), in drafter_identity only
    d = hashlib.sha256()
    for name in sorted(ALL):
        if not name.startswith("markov_head."):
            dtype, shape, data = ALL[name]
            d.update(name.encode() + b"\0" + dtype.encode() + b"\0"
                     + struct.pack(f"<I{len(shape)}QQ", len(shape), *shape, len(data)) + data)
    d.update(b"config.json\0JSON\0" + struct.pack("<IQQ", 1, len(text), len(text)) + text)
    assert got == (d.digest(), tensors_only[1]) and got[1] == by_hand[1]
    assert identities_from_arrays(ALL, CONFIG) == got
    # layout, key order and the writers' bookkeeping do not matter; a model field does
    reordered = dict(reversed(list(CONFIG.items())), transformers_version="5.0.0")
    with_config(full_drafter, reordered, indent=4)
    assert identities_from_checkpoint(full_drafter, use_identity_file=False) == got
    with_config(full_drafter, {**CONFIG, "rope_theta": 50000.0})
    other = identities_from_checkpoint(full_drafter, use_identity_file=False)
    assert other[0] != got[0] and other[1] == got[1]


def test_a_symlink_switched_while_a_folder_is_held_changes_nothing_read(
        full_drafter: Path, tmp_path: Path) -> None:
    other = write_dir(tmp_path / "other", [list(ALL)],
                      source={**ALL, "fc.weight": ("F32", (2, 3), bytes(24))}, index=False)
    with_config(full_drafter), with_config(other)
    want = identities_from_checkpoint(full_drafter, use_identity_file=False)
    assert identities_from_checkpoint(other, use_identity_file=False) != want
    current = tmp_path / "current"
    current.symlink_to("full")
    with CheckpointFolder(current) as folder:
        assert folder.path == full_drafter.resolve()
        refs = drafter_refs(folder)
        current.unlink()
        current.symlink_to("other")  # ln -sfn other current, mid-read
        assert identities_from_checkpoint(folder, use_identity_file=False) == want
        written = write_identity_file(folder, refs, want)
        folder.check_unchanged()
    # the record went into the folder read, not where the name leads now
    assert written == full_drafter.resolve() / IDENTITY_FILE
    assert not (other / IDENTITY_FILE).exists()


@pytest.mark.parametrize("change", ["replaced", "rewritten", "removed", "added"])
def test_a_folder_changed_while_it_was_read_is_refused_naming_the_file(
        full_drafter: Path, change: str) -> None:
    with_config(full_drafter)
    shard = next(full_drafter.glob("*.safetensors"))
    with CheckpointFolder(full_drafter) as folder:
        identities_from_refs(drafter_refs(folder))
        if change == "replaced":  # a new file renamed over it, as cp then mv does
            (full_drafter / "new").write_bytes(shard.read_bytes())
            os.replace(full_drafter / "new", shard)
        elif change == "rewritten":  # written in place
            st = shard.stat()
            with open(shard, "r+b") as f:
                f.write(f.read(8))
            os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
        elif change == "removed":
            shard.unlink()
        else:
            (full_drafter / "model-extra.safetensors").write_bytes(shard.read_bytes())
        with pytest.raises(CheckpointChanged, match=CHANGED_WHILE_READ) as info:
            folder.check_unchanged()
    text = str(info.value)
    if change == "added":
        assert text.startswith(f"{full_drafter.resolve()}: ") and "model-extra" in text
    else:
        assert text.startswith(f"{shard.resolve()}: ") and f"the file was {change}" in text


def test_a_fifo_or_a_folder_in_a_held_folder_is_refused_without_blocking(
        full_drafter: Path) -> None:
    os.mkfifo(full_drafter / "config.json")
    with CheckpointFolder(full_drafter) as folder, pytest.raises(
            SafetensorsError, match=r"config\.json: is a FIFO, not a regular file"):
        identities_from_checkpoint(folder)
    with pytest.raises(SafetensorsError, match="not a checkpoint directory"):
        CheckpointFolder(full_drafter / "config.json")


def test_a_sharded_target_is_read_through_its_held_folder_and_only_the_shards_needed(
        full_drafter: Path, bare_drafter: Path, tmp_path: Path) -> None:
    """The target's index and the two shards holding its embedding and head are read through
    the held folder: a shard it does not need is never opened (a FIFO there blocks nothing),
    the folder's name switched mid-read changes nothing read, and a needed shard replaced
    meanwhile is refused naming it."""
    source = {"model.embed_tokens.weight": ALL["embed_tokens.weight"],
              "lm_head.weight": ALL["lm_head.weight"], "model.norm.weight": TARGET_OTHER}
    target = write_dir(tmp_path / "target", [["model.embed_tokens.weight"],
                                              ["model.norm.weight"], ["lm_head.weight"]],
                       source=source)
    middle = target / "model-00002-of-00003.safetensors"
    middle.unlink()
    os.mkfifo(middle)
    write_dir(tmp_path / "other", [list(source)], index=False,
              source={**source, "lm_head.weight": ("F32", (10, 3), bytes(120))})
    for d in (full_drafter, bare_drafter):
        with_config(d)
    want = identities_from_checkpoint(full_drafter, use_identity_file=False)
    current = tmp_path / "current"
    current.symlink_to("target")
    with CheckpointFolder(bare_drafter) as drafter, CheckpointFolder(current) as held:
        refs = drafter_refs(drafter, held)
        current.unlink()
        current.symlink_to("other")  # ln -sfn other current, mid-read
        assert identities_from_refs(refs, CONFIG) == want
        assert identities_from_checkpoint(drafter, current, use_identity_file=False) != want
        held.check_unchanged()
        last = target / "model-00003-of-00003.safetensors"
        (target / "new").write_bytes(last.read_bytes())
        os.replace(target / "new", last)
        with pytest.raises(CheckpointChanged, match=CHANGED_WHILE_READ) as info:
            held.check_unchanged()
    assert str(info.value).startswith(f"{last.resolve()}: ")
