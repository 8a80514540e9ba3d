"""Quantised checkpoint weights, dequantised on load (docs/operations.md, "Quantised
checkpoints").

A function here takes tensors already read from a checkpoint, in the dtypes stored, and returns
the dense weights the model runs with: whichever reader produced them, nothing here touches a
file. A quantised checkpoint therefore takes its *dequantised* size on the device.

MXFP8 (OCP microscaling; MINIMAX_M3.md section 4): ``weight`` holds E4M3 values
(``F8_E4M3``: 1 sign, 4 exponent bits of bias 7, 3 mantissa bits; no infinities, S.1111.111 is
NaN, 448 the largest finite), ``weight_scale_inv`` one E8M0 byte per 1 x 32 block along the
input (last) dimension: ``w[r, c] = e4m3(q[r, c]) * 2**(scale[r, c // 32] - 127)``. Despite its
name the scale multiplies. An E4M3 value has 4 significant bits and bf16 8, so for scale bytes
3..246 the product is exact in bf16; below 3 it would round there (the weights come out in fp32
instead, exact too), above 246 it overflows to infinity (refused), and 255 is NaN (refused).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, MutableMapping

import torch
from torch import Tensor

from .limits import CheckpointRefused

log = logging.getLogger("dspark_worker.quant")

# safetensors dtypes of quantised values and their scales, as torch reads their bytes.
STORED_DTYPES: dict[str, torch.dtype] = {"F8_E4M3": torch.float8_e4m3fn, "U8": torch.uint8}
MXFP8_VALUES = "F8_E4M3"
MXFP8_SCALES = "U8"
MXFP8_BLOCK = 32  # values per scale, along the input dimension
E8M0_BIAS = 127
E8M0_NAN = 255
# Scale bytes whose products are exact in bf16: below, bf16's subnormals round them; above,
# 448 * 2**(s - 127) is past the largest finite bf16 (and fp32) value.
EXACT_BF16_SCALES = (3, 246)
SCALE_SUFFIX = "_scale_inv"  # "<linear>.weight" -> "<linear>.weight_scale_inv"


def _spelled(dtype: torch.dtype) -> str:
    """A torch dtype as safetensors spells it (BF16, F8_E4M3 ...)."""
    names = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32",
             torch.float64: "F64", torch.float8_e4m3fn: MXFP8_VALUES, torch.uint8: MXFP8_SCALES}
    return names.get(dtype, str(dtype).removeprefix("torch."))


def scale_name(weight: str) -> str:
    return weight + SCALE_SUFFIX


def mxfp8_scale_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The E8M0 scales' shape for MXFP8 values of ``shape`` [rows, cols]: [rows, cols / 32]."""
    rows, cols = shape
    return rows, cols // MXFP8_BLOCK


def dequantize_mxfp8(name: str, values: Tensor, scales: Tensor) -> Tensor:
    """The dense weight of one MXFP8 linear: ``values`` [rows, cols] float8_e4m3fn, ``scales``
    [rows, cols / 32] uint8 -> bf16 (fp32 where a scale byte is below 3, where bf16 would round).
    Exact either way. CheckpointRefused, naming ``name``, the value and the limit, for a shape
    that is not the format's, a NaN value or a scale that is NaN or overflows."""
    if values.dtype != torch.float8_e4m3fn or values.dim() != 2:
        raise CheckpointRefused(
            f"tensor {name}: MXFP8 values must be a 2-D F8_E4M3 matrix, not"
            f" {_spelled(values.dtype)} of shape {list(values.shape)}",
            field=name, value=list(values.shape))
    rows, cols = values.shape
    if cols % MXFP8_BLOCK:
        raise CheckpointRefused(
            f"tensor {name}: {cols} input columns are not a multiple of the MXFP8 block of"
            f" {MXFP8_BLOCK}", field=name, value=cols, limit=MXFP8_BLOCK)
    want = mxfp8_scale_shape((rows, cols))
    sname = scale_name(name)
    if scales.dtype != torch.uint8 or tuple(scales.shape) != want:
        raise CheckpointRefused(
            f"tensor {sname}: E8M0 scales of {name} [{rows}, {cols}] must be U8 of shape"
            f" {list(want)} (one per 1 x {MXFP8_BLOCK} block along the input dimension), not"
            f" {_spelled(scales.dtype)} {list(scales.shape)}",
            field=sname, value=list(scales.shape), limit=list(want))
    low, high = EXACT_BF16_SCALES
    top = int(scales.max()) if scales.numel() else E8M0_BIAS
    if top > high:
        r, b = divmod(int(torch.argmax(scales.reshape(-1).int())), want[1])
        what = "NaN in E8M0" if top == E8M0_NAN else "past the largest finite weight"
        raise CheckpointRefused(
            f"tensor {sname}: scale byte {top} at [{r}, {b}] is {what} (2**({top} - 127) x 448;"
            f" the largest a finite weight allows is {high})", field=sname, value=top,
            limit=high)
    # E4M3's NaN is S.1111.111: the low seven bits all set.
    bits = values.view(torch.uint8)
    nan = (bits & 0x7F) == 0x7F
    if bool(nan.any()):
        r, c = divmod(int(torch.argmax(nan.reshape(-1).int())), cols)
        raise CheckpointRefused(
            f"tensor {name}: value byte 0x{int(bits[r, c]):02X} at [{r}, {c}] is NaN in E4M3",
            field=name, value=int(bits[r, c]), limit=0x7E)
    fine = scales.numel() == 0 or int(scales.min()) >= low
    dtype = torch.bfloat16 if fine else torch.float32
    out = values.to(dtype)  # every E4M3 value is exact in bf16
    # Times 2**(s - 127) per 1 x 32 block (block c // 32), in place and in the output dtype:
    # the product of a 4-bit significand and a power of two in range is exact there, so this
    # equals vLLM's fp32 multiply then cast, without an fp32 copy (2.8x faster on the CPU).
    factor = torch.exp2(scales.float() - E8M0_BIAS).to(dtype)  # [rows, cols / 32]
    out.view(rows, cols // MXFP8_BLOCK, MXFP8_BLOCK).mul_(factor.unsqueeze(-1))
    return out


def quantize_mxfp8(weight: Tensor) -> tuple[Tensor, Tensor]:
    """(E4M3 values, E8M0 scales) of a dense weight [rows, cols] (cols a multiple of 32), as
    vLLM's quantizer picks them: per block s = ceil(log2(amax / 448)) + 127, values rounded to
    the nearest E4M3. For making checkpoints (benchmarks, tests); loading never calls it."""
    rows, cols = weight.shape
    blocks = weight.float().view(rows, cols // MXFP8_BLOCK, MXFP8_BLOCK)
    amax = blocks.abs().amax(-1).clamp_min(2.0 ** -100)  # an all-zero block gets a tiny scale
    s = (torch.ceil(torch.log2(amax / 448.0)) + E8M0_BIAS).clamp(*EXACT_BF16_SCALES)
    values = (blocks / torch.exp2(s - E8M0_BIAS).unsqueeze(-1)).to(torch.float8_e4m3fn)
    return values.view(rows, cols), s.to(torch.uint8)


def dequantize_linears(tensors: MutableMapping[str, Tensor], weights: Iterable[str],
                       source: str) -> tuple[int, int, int]:
    """Replace, in ``tensors``, each of ``weights`` stored as MXFP8 by its dense weight and drop
    its scales. A linear is MXFP8 exactly when its weight is F8_E4M3 with a scale tensor
    beside it: an F8_E4M3 weight without scales, or scales beside a weight that is not F8_E4M3,
    is refused. Returns (linears dequantised, their bytes as stored, their bytes now)."""
    done = stored = dense = 0
    for name in weights:
        sname = scale_name(name)
        weight, scales = tensors.get(name), tensors.get(sname)
        if weight is None:
            continue
        quantised = weight.dtype == torch.float8_e4m3fn
        if quantised and scales is None:
            raise CheckpointRefused(
                f"{source}: tensor {name} is F8_E4M3 but {sname} (its MXFP8 scales) is"
                " missing; the weights cannot be read without them", field=sname)
        if scales is not None and not quantised:
            raise CheckpointRefused(
                f"{source}: tensor {sname} holds MXFP8 scales but {name} is"
                f" {_spelled(weight.dtype)}, not F8_E4M3", field=sname,
                value=_spelled(weight.dtype), limit=MXFP8_VALUES)
        if scales is None:
            continue
        try:
            out = dequantize_mxfp8(name, weight, scales)
        except CheckpointRefused as exc:
            raise CheckpointRefused(f"{source}: {exc}", field=exc.field, value=exc.value,
                                    limit=exc.limit) from None
        stored += weight.nbytes + scales.nbytes
        dense += out.nbytes
        done += 1
        tensors[name] = out
        del tensors[sname], weight, scales
    return done, stored, dense


def log_dequantized(source: str, counts: tuple[int, int, int]) -> None:
    done, stored, dense = counts
    if done:
        log.info("%s: %d MXFP8 linears dequantised on load: %d bytes in the files, %d bytes"
                 " dense; the device holds the dense size (cast to the worker's dtype)",
                 source, done, stored, dense)
