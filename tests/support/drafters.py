"""Drafter checkpoint folders for tests that load a drafter other than the embedded reference:
a seeded perturbation of the reference (same geometry, lower acceptance), a broken one (NaN
weights, cut-short files) and one of another geometry. Real safetensors files in the layout the
worker reads; every value is from a fixed seed, so the identities are the same on every run.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

from dspark_worker.drafter.drafter import REFERENCE_DIR

__all__ = ["broken_copy", "cut_short_copy", "other_geometry", "perturbed_reference"]

# The backbone's tensors the perturbation touches (embed_tokens and lm_head are the target's
# and stay; the drafter keeps its vocabulary and geometry).
_BACKBONE = ("layers.", "fc.", "markov_head.")


def _reference_tensors() -> dict[str, np.ndarray]:
    return load_file(str(REFERENCE_DIR / "model.safetensors"))


def _write(out: Path, tensors: dict[str, np.ndarray], config_from: Path = REFERENCE_DIR) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(config_from / "config.json", out / "config.json")
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def perturbed_reference(out: Path, *, scale: float = 0.25, seed: int = 1) -> Path:
    """The reference drafter with every backbone weight scaled by ``1 + scale * g`` (g a seeded
    standard normal per element): the same geometry and ring layout, other drafts."""
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, t in sorted(_reference_tensors().items()):
        if name.startswith(_BACKBONE) and t.dtype.kind == "f":
            noise = rng.standard_normal(t.shape).astype(np.float32)
            t = (t.astype(np.float32) * (1.0 + scale * noise)).astype(t.dtype)
        tensors[name] = np.ascontiguousarray(t)
    return _write(out, tensors)


def broken_copy(out: Path) -> Path:
    """The reference drafter with NaN in its final norm: it loads, and drafts NaN."""
    tensors = dict(_reference_tensors())
    tensors["norm.weight"] = np.full_like(tensors["norm.weight"], np.nan)
    return _write(out, tensors)


def cut_short_copy(out: Path) -> Path:
    """The reference drafter whose safetensors file lost its last kilobyte."""
    _write(out, dict(_reference_tensors()))
    path = out / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:-1024])
    return out


def other_geometry(out: Path) -> Path:
    """A drafter of another block size (N) over the same target, random weights from a seed:
    a valid checkpoint the worker cannot serve beside the reference."""
    import torch

    from dspark_worker.drafter import from_tensors, parse_config, random_tensors, save_checkpoint
    from dspark_worker.drafter.config import read_config_json

    raw, _ = read_config_json(REFERENCE_DIR)
    config = parse_config(dict(raw, block_size=int(raw["block_size"]) - 2))
    drafter = from_tensors(config, random_tensors(config, seed=7), dtype=torch.float32)
    save_checkpoint(drafter.model, out)
    return out
