"""Ingest: ``project_context_kv`` (every layer's K/V from one matmul, what the ring pool and the
reference draft use) gives the values of ``project_context``, the layer-by-layer definition
that training differentiates, and follows the weights when they change."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from drafter_support import make_drafter, make_rows, tiny_config

from dspark_worker.drafter import decode_bf16_rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_projection_equals_the_layer_loop(dtype: torch.dtype) -> None:
    d = make_drafter(tiny_config(num_hidden_layers=3))
    model = d.model.to(dtype)
    rng = np.random.default_rng(1)
    taps = torch.from_numpy(decode_bf16_rows(make_rows(rng, 9), model.config.tap_width))
    taps = taps.to(dtype)
    taps[4, 3] = float("nan")  # a poisoned row becomes zeros in both
    positions = torch.tensor([0, 1, 2, 3, 4, 100, 101, 5000, 70000])
    k, v = model.project_context(taps, positions)  # [L, R, Hkv, D]
    with torch.inference_mode():
        kv = model.project_context_kv(taps, positions)  # [2, L, R, Hkv, D]
    assert kv.shape == (2, *k.shape) and kv.dtype == dtype
    assert torch.isfinite(kv).all()
    tol = {"atol": 1e-6, "rtol": 1e-6} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(kv[0], k, **tol)
    torch.testing.assert_close(kv[1], v, **tol)


def test_fused_projection_follows_weight_changes() -> None:
    d = make_drafter(tiny_config())
    model = d.model
    taps = torch.randn(4, model.config.tap_width)
    positions = torch.arange(4)
    with torch.inference_mode():
        before = model.project_context_kv(taps, positions).clone()
    with torch.no_grad():
        model.layers[1].self_attn.v_proj.weight.mul_(2.0)  # in place: a new version
        model.layers[0].self_attn.k_norm.weight.add_(0.5)
    with torch.inference_mode():
        after = model.project_context_kv(taps, positions)
    k, v = model.project_context(taps, positions)
    torch.testing.assert_close(after[0], k)
    torch.testing.assert_close(after[1], v)
    torch.testing.assert_close(after[1, 1], 2.0 * before[1, 1])
    assert not torch.allclose(after[0, 0], before[0, 0])
    torch.testing.assert_close(after[0, 1], before[0, 1])  # layer 1's K did not change
