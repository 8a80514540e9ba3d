"""The MiniMax-M3 family against its vectors (data/minimax_m3_tiny: the shared cases, made with
transformers' MiniMax-M3 modules and checked by an independent float64 implementation): MXFP8
and BF16 checkpoints, standalone and in the target's ``dspark/`` subfolder. Through the rings,
the from-scratch reference and the static step; the engine's HELLO from the same folders;
refusals by name; MXFP8 read exactly and defensively; bf16 on the CPU."""

from __future__ import annotations

import copy
import dataclasses
import json
import shutil
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from drafter_support import (
    DROP,
    assert_same,
    bf16_taps,
    check_bf16_many_lanes,
    check_sampled,
    params,
    set_key,
    static_and_eager,
    with_static_step,
)
from safetensors.torch import load_file

from dspark_client import hello_from_checkpoint, tap_layers
from dspark_worker.drafter import (
    Drafter,
    DrafterConfigError,
    encode_bf16_rows,
    from_tensors,
    load_drafter,
    parse_config,
)
from dspark_worker.drafter import checkpoint as checkpoint_module
from dspark_worker.drafter.limits import CheckpointRefused
from dspark_worker.drafter.minimax import MiniMaxConfig
from dspark_worker.drafter.quant import dequantize_mxfp8
from protocol.formats import held_drafter
from protocol.identity import drafter_refs, identities_from_checkpoint, read_config

DATA = Path(__file__).resolve().parent / "data" / "minimax_m3_tiny"


def vectors() -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, str]]:
    """The shared cases and the extra ones of tools/gen_minimax_vectors.py (MQA, mixed sliding
    and full layers, a sharded MXFP8 checkpoint, the released SwiGLU limit, full rotary)."""
    checkpoints: dict[str, Any] = {}
    cases: list[dict[str, Any]] = []
    taps_files: dict[str, str] = {}
    for suffix in ("", "_extra"):
        raw = json.loads((DATA / f"cases{suffix}.json").read_text())
        checkpoints.update(raw["checkpoints"])
        cases += raw["cases"]
        taps_files[suffix] = raw["taps_file"]
    return checkpoints, cases, taps_files


CHECKPOINTS, CASES, TAPS_FILES = vectors()
NAMES = sorted(CHECKPOINTS)
W = 64
PREFIX = "language_model.model.dspark."


@pytest.fixture(scope="module")
def drafters() -> dict[str, Drafter]:
    return {name: load_drafter(DATA / name, DATA / c["target"], record_identities=False)
            for name, c in CHECKPOINTS.items()}


@pytest.fixture(scope="module")
def taps() -> dict[str, np.ndarray]:
    return {key: t.view(torch.int16).numpy().view(np.uint8).reshape(t.shape[0], -1)
            for name in TAPS_FILES.values()
            for key, t in load_file(str(DATA / name)).items()}


def mine(name: str) -> list[dict[str, Any]]:
    return [c for c in CASES if c["checkpoint"] == name]


def raw_config(name: str = "m31_mxfp8_n7_w12") -> dict[str, Any]:
    out: dict[str, Any] = json.loads((DATA / name / "config.json").read_text())
    return out


@pytest.mark.parametrize("name", NAMES)
def test_vectors_from_the_rings_and_the_reference(drafters: dict[str, Drafter],
                                                  taps: dict[str, np.ndarray], name: str) -> None:
    """Every case: ids exact, confidences within 1e-4, margins within 1e-3 (fp32), from a ring
    of W = 64 (the 72-row cases wrap it) and from the from-scratch reference."""
    d, cs = drafters[name], mine(name)
    assert d.family == "minimax_m3" and d.has_confidence
    pool = d.new_pool(len(cs), W)
    lanes = pool.allocate(len(cs))
    rows = [taps[c["taps_key"]] for c in cs]
    pool.apply(lanes, [c["anchor_pos"] for c in cs], [len(r) for r in rows],
               [True] * len(cs), np.concatenate(rows))
    anchors, tokens = [c["anchor_pos"] for c in cs], [c["anchor_token"] for c in cs]
    got = d.draft(pool, lanes, anchors, tokens)
    ref = d.reference_draft([r[-W:] for r in rows], anchors, tokens)
    for i, c in enumerate(cs):
        for out in (got, ref):
            assert out.draft_ids[i].tolist() == c["ids"], (name, c["case"])
            np.testing.assert_allclose(out.confidence[i], c["confidence"], atol=1e-4, rtol=0)
            np.testing.assert_allclose(out.margin[i], c["margin"], atol=1e-3, rtol=0)


def test_both_layouts_and_the_engines_hello(drafters: dict[str, Drafter], tmp_path: Path) -> None:
    """The worker and the engine's HELLO read each checkpoint alike from text_config (N, taps,
    tap width, identities), the target's folder names its dspark/ drafter (and is its target),
    the head is the target's untied language_model.lm_head.weight, and the identities are of
    the tensors as stored (F8_E4M3 and U8, named without the wrapper's prefix)."""
    for name, c in CHECKPOINTS.items():
        d = drafters[name]
        assert (d.num_spec, d.n_taps, d.target_hidden, d.vocab_size, d.row_bytes) == (
            c["num_spec"], c["n_taps"], c["hidden"], c["target_vocab"], 3 * 64 * 2)
        h = hello_from_checkpoint(DATA / name, window=W, max_slots=4,
                                  target_checkpoint=DATA / c["target"])
        assert (h.num_spec, h.row_bytes, h.vocab_size, h.n_taps, h.hidden) == (
            d.num_spec, d.row_bytes, d.vocab_size, d.n_taps, d.target_hidden), name
        assert (h.drafter_identity, h.markov_identity) == (d.drafter_identity,
                                                           d.markov_identity)
        assert tap_layers(DATA / name) == d.config.target_layer_ids
    target = load_file(str(DATA / "target" / "model.safetensors"))
    d = drafters["m31_mxfp8_n7_w12"]
    assert torch.equal(d.model.lm_head.weight, target["language_model.lm_head.weight"].float())
    assert torch.equal(d.model.embed_tokens.weight,
                       target["language_model.model.embed_tokens.weight"].float())
    assert d.config.target_layer_ids[-1] == 5  # the 6-layer target's last layer is a tap
    # the target's folder and its dspark/ subfolder, with and without --target-checkpoint
    inner = drafters["target/dspark"]
    for where, target_dir in ((DATA / "target", None), (DATA / "target" / "dspark", None),
                              (DATA / "target", DATA / "target")):
        h = hello_from_checkpoint(where, window=W, max_slots=4, target_checkpoint=target_dir)
        assert (h.drafter_identity, h.num_spec) == (inner.drafter_identity, 5), where
        assert tap_layers(where) == (0, 2, 4)
    # the engine adapters' HELLO (vLLM's plugin): the served model's folder names the drafter
    from dspark_client.adapter.options import drafter_hello, parse_options

    h = drafter_hello(DATA / "target", parse_options({"endpoint": "tcp://127.0.0.1:1"}),
                      max_slots=1, client_name="", target_hidden_size=64)
    assert (h.drafter_identity, h.markov_identity) == (inner.drafter_identity,
                                                       inner.markov_identity)
    again = load_drafter(DATA / "target", record_identities=False)
    assert again.drafter_identity == inner.drafter_identity
    refs = drafter_refs(DATA / "m31_mxfp8_n7_w12", DATA / "target")
    scale = "layers.0.decoder_layer.self_attn.q_proj.weight_scale_inv"
    assert refs[scale].dtype == "U8" and refs[scale[:-len("_scale_inv")]].dtype == "F8_E4M3"
    assert "final_norm.weight" in refs and not any(n.startswith(PREFIX) for n in refs)
    # a standalone drafter has no target of its own: said in the worker's words
    alone = tmp_path / "alone"
    shutil.copytree(DATA / "bf16_n6_w20", alone)
    with pytest.raises(CheckpointRefused, match=r"no embed_tokens\.weight"):
        load_drafter(alone, record_identities=False)


def test_the_dspark_subfolder_is_opened_through_the_folder_named(
        drafters: dict[str, Drafter], tmp_path: Path) -> None:
    """The folder named is resolved once: its dspark/ subfolder (and a dspark/ drafter's
    parent, its target) is opened through the folder held, so a name switched to another
    target meanwhile changes nothing of what is read; the identity covers dspark/config.json."""
    first, other = tmp_path / "first", tmp_path / "other"
    for where in (first, other):
        shutil.copytree(DATA / "target", where)
    for name in ("config.json", "dspark/config.json"):  # another depth, another rope_theta
        raw = json.loads((other / name).read_text())
        raw["text_config"]["rope_theta" if "dspark" in name else "num_hidden_layers"] = 7.0
        (other / name).write_text(json.dumps(raw))
    current = tmp_path / "current"
    for named, want_target in ((current, first), (current / "dspark", first)):
        current.symlink_to(first)
        with held_drafter(named) as (drafter, target):
            current.unlink()
            current.symlink_to(other)
            assert target is not None and read_config(target) == json.loads(
                (want_target / "config.json").read_text())
            ids = identities_from_checkpoint(drafter, target, use_identity_file=False)
        assert ids[0] == drafters["target/dspark"].drafter_identity, named
        h = hello_from_checkpoint(named, window=W, max_slots=1)
        assert h.drafter_identity != ids[0], named  # the other dspark/config.json, now named
        current.unlink()


def test_static_step_equals_eager_and_the_reference(drafters: dict[str, Drafter]) -> None:
    """The captured step's stand-in: three lanes (one padded) over rings of 16 rows that wrap,
    greedy and sampled (top-32), MQA with sliding (S = 10) and full layers: the static step
    equals the eager one and both the reference on the rows each ring holds."""
    d = drafters["extra_mqa_mixed_sharded"]
    rng = np.random.default_rng(8)
    for window in (16,):
        pool = d.new_pool(4, window)
        s = with_static_step(d, pool, largest=4)
        lanes = pool.allocate(4)[[3, 0, 2]]
        counts = [3, 30, 1]
        anchors = [c + 40 * i for i, c in enumerate(counts)]
        rows = [encode_bf16_rows(bf16_taps(rng, n, d.config.tap_width)) for n in counts]
        pool.apply(lanes, anchors, counts, [True] * 3, np.concatenate(rows))
        tokens = rng.integers(0, d.vocab_size, 3)
        for sp in (None, params(3, window)):
            got, want = static_and_eager(s, pool, lanes, anchors, tokens, sampling=sp)
            assert_same(got, want, exact=False)
            ref = d.reference_draft([r[-window:] for r in rows], anchors, tokens, sampling=sp)
            np.testing.assert_array_equal(got.draft_ids, ref.draft_ids)
            np.testing.assert_allclose(got.margin, ref.margin, atol=1e-3, rtol=0)
            if sp is not None:
                check_sampled(got, sp, anchors, d.vocab_size)


def test_bf16_on_the_cpu(drafters: dict[str, Drafter]) -> None:
    fp = drafters["m31_mxfp8_n7_w12"]
    bf = load_drafter(DATA / "m31_mxfp8_n7_w12", DATA / "target", dtype=torch.bfloat16,
                      record_identities=False)
    assert bf.model.fc.weight.dtype == torch.bfloat16
    check_bf16_many_lanes(fp, bf)


def test_each_misreading_changes_the_drafts(drafters: dict[str, Drafter],
                                            taps: dict[str, np.ndarray]) -> None:
    """The vectors tell the rules apart: the window one row wider, or the target's embedding
    as the head, changes some case's drafts."""
    name = "m31_mxfp8_n7_w12"
    d, cs = drafters[name], mine(name)

    def drafts(x: Drafter) -> list[list[int]]:
        out = x.reference_draft([taps[c["taps_key"]] for c in cs],
                                [c["anchor_pos"] for c in cs], [c["anchor_token"] for c in cs])
        return [list(map(int, r)) for r in out.draft_ids]

    want = [c["ids"] for c in cs]
    assert drafts(d) == want
    state = dict(d.model.state_dict())
    config = d.config
    assert isinstance(config, MiniMaxConfig)
    wider = from_tensors(dataclasses.replace(config, sliding_window=13), state)
    assert drafts(wider) != want
    tied = from_tensors(config, {**state, "lm_head.weight": state["embed_tokens.weight"]})
    assert drafts(tied) != want


# -- config.json refusals ------------------------------------------------------------------


@pytest.mark.parametrize(("key", "value", "field"), [
    ("architectures", ["MiniMaxM3ForCausalLM", "DSparkMiniMaxDraftModel"], "architectures"),
    ("text_config", None, "text_config"),
    ("vocab_size", 301, "vocab_size"),  # top level disagreeing with text_config
    ("quantization_config.quant_method", "fp8", "quantization_config.quant_method"),
    ("quantization_config.weight_block_size", [1, 64], "quantization_config.weight_block_size"),
    ("quantization_config.moe_quant_algo", "mxfp4", "quantization_config.moe_quant_algo"),
    ("text_config.dspark_use_dense_ffn", DROP, "dspark_use_dense_ffn"),
    ("text_config.dspark_use_dense_ffn", False, "dspark_use_dense_ffn"),
    ("text_config.use_gemma_norm", False, "use_gemma_norm"),
    ("text_config.dspark_markov_head_type", "gated", "dspark_markov_head_type"),
    ("text_config.dspark_hybrid_context_fusion", True, "dspark_hybrid_context_fusion"),
    ("text_config.dspark_config.hybrid_context_fusion", True,
     "dspark_config.hybrid_context_fusion"),
    ("text_config.moe_layer_freq", [0, 1, 0], "moe_layer_freq"),
    ("text_config.sparse_attention_config", {"topk": 4}, "sparse_attention_config"),
    ("text_config.layer_types", ["sliding_attention", "minimax_m3_sparse", "full_attention"],
     "layer_types"),
    ("text_config.layer_types", ["sliding_attention"] * 2, "layer_types"),
    ("text_config.sliding_window", DROP, "sliding_window"),
    ("text_config.is_causal", True, "is_causal"),
    ("text_config.dflash_config", {"causal": True}, "dflash_config.causal"),
    ("text_config.dflash_config", {"use_swa": True}, "dflash_config.use_swa"),
    ("text_config.attention_sink_bias", True, "attention_sink_bias"),
    ("text_config.attention_value_scale", 0.5, "attention_value_scale"),
    ("text_config.is_neox_style", False, "is_neox_style"),
    ("text_config.sample_from_anchor", False, "sample_from_anchor"),
    ("text_config.dspark_bonus_anchor", True, "dspark_bonus_anchor"),
    ("text_config.draft_vocab_size", 200, "draft_vocab_size"),
    ("text_config.rope_parameters", {"rope_type": "yarn", "factor": 4.0},
     "rope_parameters.rope_type"),
    ("text_config.rotary_dim", 16, "rotary_dim"),
    ("text_config.partial_rotary_factor", 0.3125, "rotary_dim"),  # 5 of 16: odd
    ("text_config.dspark_block_size", 13, "dspark_block_size"),  # N over S = 12
    ("text_config.dspark_noise_token_id", 300, "mask_token_id"),
    ("text_config.dspark_target_layer_ids", [3, 1, 5], "target_layer_ids"),
    ("text_config.eagle_aux_hidden_state_layer_ids", [2, 4, 6],
     "eagle_aux_hidden_state_layer_ids"),
    ("text_config.block_size", 6, "block_size"),  # disagrees with dspark_block_size 7
    ("text_config.mask_token_id", 296, "dflash_config.mask_token_id"),
    ("moe_quant_algo", "mxfp4", "moe_quant_algo"),
])
def test_config_refusals_by_name(key: str, value: object, field: str) -> None:
    raw = copy.deepcopy(raw_config())
    if key == "vocab_size":
        raw["vocab_size"] = value
    else:
        set_key(raw, key, value)
    with pytest.raises(DrafterConfigError) as e:
        parse_config(raw)
    assert e.value.field == field, str(e.value)
    assert "\n" not in str(e.value)


def test_config_spellings() -> None:
    """rope_theta flat or nested, the factor from rope_parameters or flat, the MLP width from
    dspark_ffn_hidden_size (never intermediate_size), a missing layer_types all full."""
    flat = parse_config(raw_config())
    assert isinstance(flat, MiniMaxConfig)
    assert (flat.rope_theta, flat.rotary_dim, flat.intermediate_size, flat.swiglu_limit) == (
        5e6, 8, 96, 1.5)
    nested = parse_config(raw_config("target/dspark"))
    assert isinstance(nested, MiniMaxConfig)
    assert (nested.rope_theta, nested.rotary_dim, nested.sliding_window) == (1e4, 8, 24)
    raw = raw_config()
    del raw["text_config"]["layer_types"]
    full = parse_config(raw)
    assert isinstance(full, MiniMaxConfig) and full.layer_types == ("full_attention",) * 3
    assert parse_config(flat.to_json_dict()) == dataclasses.replace(flat, quantization="mxfp8")


# -- MXFP8 ---------------------------------------------------------------------------------------


def e4m3_value(byte: int) -> float:
    """An E4M3 byte's value from the format's definition (bias 7; e = 0 subnormal)."""
    sign = -1.0 if byte & 0x80 else 1.0
    e, m = (byte >> 3) & 0xF, byte & 0x7
    return sign * (2.0 ** (e - 7) * (1 + m / 8) if e else 2.0 ** -6 * m / 8)


def test_mxfp8_dequantisation_is_exact() -> None:
    """Every finite E4M3 byte in every column of a block, times 2**(s - 127) for scales over
    the range: bit-exact in bf16 for s in 3..246, in fp32 below; the scale multiplies, per
    block c // 32 along the input dimension."""
    finite = [b for b in range(256) if b & 0x7F != 0x7F]  # 254 values
    q = torch.tensor(finite * 4, dtype=torch.uint8)[:32 * 31].view(31, 32)
    q = torch.cat([q, q.flip(0)], dim=1)  # [31, 64]: two blocks per row
    for scales_row, dtype in (((3, 246), torch.bfloat16), ((127, 118), torch.bfloat16),
                              ((0, 130), torch.float32)):
        scales = torch.tensor([scales_row] * 31, dtype=torch.uint8)
        got = dequantize_mxfp8("w", q.view(torch.float8_e4m3fn), scales)
        assert got.dtype == dtype
        want = np.array([[e4m3_value(int(q[r, c])) * 2.0 ** (scales_row[c // 32] - 127)
                          for c in range(64)] for r in range(31)])
        np.testing.assert_array_equal(got.double().numpy(), want)


def test_mxfp8_quantizer_round_trip() -> None:
    """quant.quantize_mxfp8 (what the load benchmark writes) picks vLLM's scale: each block's
    largest value lands in [224, 448], and dequantising gives each weight back to E4M3's
    rounding (a relative error of at most 2**-4)."""
    from dspark_worker.drafter.quant import quantize_mxfp8

    w = torch.randn(8, 96, generator=torch.Generator().manual_seed(3))
    w = w * torch.exp2(torch.arange(-3, 3).repeat(8, 3)[:, :3].float()).repeat_interleave(32, 1)
    q, s = quantize_mxfp8(w)
    top = q.float().abs().view(8, 3, 32).amax(-1)
    assert bool(((top >= 224) & (top <= 448)).all())  # E4M3 may round 224+ to 224
    back = dequantize_mxfp8("w", q, s).float()
    assert bool(((back - w).abs() <= w.abs() * 2.0 ** -4 + 2.0 ** -20).all())


def write_safetensors(path: Path, tensors: dict[str, tuple[str, list[int], bytes]],
                      lie: dict[str, int] | None = None) -> None:
    """A safetensors file written by hand, so a test can make its header lie: ``lie`` gives a
    tensor's byte count in the header where it differs from its data."""
    header: dict[str, Any] = {}
    offset = 0
    for name, (dtype, shape, data) in tensors.items():
        size = (lie or {}).get(name, len(data))
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header).encode()
    body = b"".join(data for _, _, data in tensors.values())
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + body.ljust(offset, b"\0"))


def stored(name: str = "m31_mxfp8_n7_w12") -> dict[str, tuple[str, list[int], bytes]]:
    """The checkpoint's tensors as stored: dtype, shape, raw bytes."""
    from safetensors import safe_open

    path = str(DATA / name / "model.safetensors")
    out = {}
    with safe_open(path, "pt") as f:
        for key in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
            t = f.get_tensor(key)
            dtype = f.get_slice(key).get_dtype()
            out[key] = (dtype, list(t.shape), t.contiguous().view(torch.uint8).numpy().tobytes())
    return out


Q = PREFIX + "layers.1.decoder_layer.mlp.down_proj.weight"
S = Q + "_scale_inv"


def with_byte(data: bytes, at: int, value: int) -> bytes:
    out = bytearray(data)
    out[at] = value
    return bytes(out)


@pytest.mark.parametrize(("case", "field", "says"), [
    ("scale_shape", S, "expected [64, 3]"),
    ("scale_dtype", S, "dtype I8"),
    ("scale_nan", S, "scale byte 255 at [5, 1] is NaN in E8M0"),
    ("scale_overflow", S, "scale byte 250 at [0, 2] is past the largest finite weight"),
    ("value_nan", Q, "value byte 0x7F at [2, 40] is NaN in E4M3"),
    ("values_lie", Q, "holds 6145 bytes"),
    ("values_huge", Q, "has shape [1099511627776, 96]"),
    ("no_scale", S, "is F8_E4M3 but"),
    ("scale_beside_bf16", S, "is BF16, not F8_E4M3"),
])
def test_hostile_mxfp8_tensors_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           case: str, field: str, says: str) -> None:
    """Each refused in one line naming the tensor, its value and the limit, before the device
    is touched; a header that lies about a values tensor's size or shape is refused from the
    header, before a byte of the tensor is read."""
    tensors = stored()
    lie: dict[str, int] = {}
    dtype, shape, data = tensors[Q]
    sdtype, sshape, sdata = tensors[S]
    if case == "scale_shape":
        tensors[S] = (sdtype, [64, 2], sdata[:128])
    elif case == "scale_dtype":
        tensors[S] = ("I8", sshape, sdata)
    elif case == "scale_nan":
        tensors[S] = (sdtype, sshape, with_byte(sdata, 5 * 3 + 1, 255))
    elif case == "scale_overflow":
        tensors[S] = (sdtype, sshape, with_byte(sdata, 2, 250))
    elif case == "value_nan":
        tensors[Q] = (dtype, shape, with_byte(data, 2 * 96 + 40, 0x7F))
    elif case == "values_lie":
        lie[Q] = len(data) + 1
        tensors[Q] = (dtype, shape, data + b"\0")
    elif case == "values_huge":
        tensors[Q] = (dtype, [1 << 40, 96], data)
    elif case == "no_scale":
        del tensors[S]
    elif case == "scale_beside_bf16":
        dense = torch.zeros(shape, dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes()
        tensors[Q] = ("BF16", shape, dense)
    folder = tmp_path / "hostile"
    folder.mkdir()
    shutil.copy(DATA / "m31_mxfp8_n7_w12" / "config.json", folder)
    write_safetensors(folder / "model.safetensors", tensors, lie)
    if case in ("values_lie", "values_huge", "scale_shape", "scale_dtype"):
        def no_reads(*_: object) -> None:
            raise AssertionError("a tensor was read")
        monkeypatch.setattr(checkpoint_module, "read_tensor", no_reads)
    with pytest.raises(CheckpointRefused) as e:
        load_drafter(folder, DATA / "target", record_identities=False)
    text = str(e.value)
    assert "\n" not in text and says in text, text
    assert e.value.field in (field, field.removeprefix(PREFIX)), (e.value.field, text)
    if case in ("scale_nan", "scale_overflow"):
        assert (e.value.value, e.value.limit) == (int(says.split()[2]), 246)
