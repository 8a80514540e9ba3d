"""The reference target: a small byte-level causal language model (torch).

It stands in for the serving engine's target model in the demo, the end-to-end tests and the
training of the reference drafter: it produces logits and, per position, the tap rows the drafter
reads (the raw residual outputs of ``tap_layers``, before the final norm, concatenated in layer
order, bf16 on the wire). Qwen3-like blocks: RMSNorm, RoPE, q/k norms, SwiGLU.

Vocabulary: the 256 byte values, then BOS, EOS, PAD and the drafter's MASK id. ``KVCache`` lets
the demo append tokens a few at a time (a verify round) and cut rejected ones off.

Importing this module imports torch; ``import dspark_client`` never does.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

BOS, EOS, PAD, MASK = 256, 257, 258, 259
VOCAB_SIZE = 260
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


@dataclass(frozen=True)
class TargetConfig:
    vocab_size: int = VOCAB_SIZE
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    head_dim: int = 32
    intermediate_size: int = 384
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tap_layers: tuple[int, ...] = field(default=(0, 1, 2))

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "head_dim",
                     "intermediate_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"target config: {name} {getattr(self, name)} must be > 0")
        if not self.tap_layers or any(not 0 <= i < self.num_layers - 1 for i in self.tap_layers):
            raise ValueError(f"target config: tap_layers {self.tap_layers} must lie in"
                             f" [0, {self.num_layers - 1}) (the last layer is never a tap)")

    @property
    def n_taps(self) -> int:
        return len(self.tap_layers)

    @property
    def row_bytes(self) -> int:
        return self.n_taps * self.hidden_size * 2

    @classmethod
    def load(cls, path: Path) -> TargetConfig:
        raw = json.loads(Path(path).read_text())
        raw["tap_layers"] = tuple(raw["tap_layers"])
        return cls(**raw)

    def save(self, path: Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2) + "\n")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()  # [..., d]
        return self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
                              ).to(x.dtype)  # [..., d]


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


class Block(nn.Module):
    def __init__(self, c: TargetConfig) -> None:
        super().__init__()
        d, h, hd = c.hidden_size, c.num_heads, c.head_dim
        self.input_layernorm = RMSNorm(d, c.rms_norm_eps)
        self.q_proj = nn.Linear(d, h * hd, bias=False)
        self.k_proj = nn.Linear(d, h * hd, bias=False)
        self.v_proj = nn.Linear(d, h * hd, bias=False)
        self.o_proj = nn.Linear(h * hd, d, bias=False)
        self.q_norm = RMSNorm(hd, c.rms_norm_eps)
        self.k_norm = RMSNorm(hd, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(d, c.rms_norm_eps)
        self.gate_proj = nn.Linear(d, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(d, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, d, bias=False)


class KVCache:
    """Keys and values of every layer for B sequences, ``length`` tokens each (all equal)."""

    def __init__(self, c: TargetConfig, batch: int, capacity: int, device: torch.device,
                 dtype: torch.dtype) -> None:
        shape = (c.num_layers, batch, c.num_heads, capacity, c.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)  # [L, B, H, T, D]
        self.v = torch.zeros(shape, device=device, dtype=dtype)  # [L, B, H, T, D]
        self.length = 0
        self.capacity = capacity

    def truncate(self, length: int) -> None:
        """Forget every token from ``length`` on (rejected drafts)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"truncate to {length} outside [0, {self.length}]")
        self.length = length


class TargetModel(nn.Module):
    inv_freq: Tensor  # [D/2] fp32, not a weight

    def __init__(self, config: TargetConfig) -> None:
        super().__init__()
        c = self.config = config
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(Block(c) for _ in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        exponent = torch.arange(0, c.head_dim, 2).float() / c.head_dim
        self.register_buffer("inv_freq", 1.0 / (c.rope_theta ** exponent), persistent=False)

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        w = self.embed_tokens.weight
        return KVCache(self.config, batch, capacity, w.device, w.dtype)

    def forward(self, ids: Tensor, cache: KVCache | None = None) -> tuple[Tensor, Tensor]:
        """ids [B, T] -> logits [B, T, V] fp32 and taps [B, T, n_taps * d] (model dtype).

        With a cache, the T tokens follow the cache's ``length`` tokens and are appended."""
        c = self.config
        b, t = ids.shape
        start = cache.length if cache is not None else 0
        if cache is not None and start + t > cache.capacity:
            raise ValueError(f"cache of {cache.capacity} tokens cannot take {start} + {t}")
        pos = torch.arange(start, start + t, device=ids.device)  # [T]
        freqs = pos.float()[:, None] * self.inv_freq  # [T, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [T, D]
        cos, sin = emb.cos().to(self.embed_tokens.weight.dtype), emb.sin().to(
            self.embed_tokens.weight.dtype)  # [T, D]
        # causal over the whole sequence: query i (absolute start + i) sees keys <= start + i
        total = start + t
        mask = torch.ones(t, total, dtype=torch.bool, device=ids.device).tril(start)  # [T, S]
        h = self.embed_tokens(ids)  # [B, T, d]
        taps = []
        blocks: list[Block] = list(self.layers)  # type: ignore[arg-type]
        for li, blk in enumerate(blocks):
            x = blk.input_layernorm(h)  # [B, T, d]
            q = blk.q_norm(blk.q_proj(x).view(b, t, c.num_heads, c.head_dim)).transpose(1, 2)
            k = blk.k_norm(blk.k_proj(x).view(b, t, c.num_heads, c.head_dim)).transpose(1, 2)
            v = blk.v_proj(x).view(b, t, c.num_heads, c.head_dim).transpose(1, 2)  # [B, H, T, D]
            q = q * cos + _rotate_half(q) * sin  # [B, H, T, D]
            k = k * cos + _rotate_half(k) * sin  # [B, H, T, D]
            if cache is not None:
                cache.k[li, :, :, start:total] = k
                cache.v[li, :, :, start:total] = v
                k, v = cache.k[li, :, :, :total], cache.v[li, :, :, :total]  # [B, H, S, D]
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [B, H, T, D]
            out = out.transpose(1, 2).reshape(b, t, c.num_heads * c.head_dim)  # [B, T, H*D]
            h = h + blk.o_proj(out)  # [B, T, d]
            y = blk.post_attention_layernorm(h)  # [B, T, d]
            h = h + blk.down_proj(F.silu(blk.gate_proj(y)) * blk.up_proj(y))  # [B, T, d]
            if li in c.tap_layers:
                taps.append(h)
        if cache is not None:
            cache.length = total
        logits = self.lm_head(self.norm(h)).float()  # [B, T, V]
        return logits, torch.cat(taps, dim=-1)  # [B, T, n_taps * d]


def taps_to_rows(taps: Tensor) -> Tensor:
    """Tap rows as they travel: bf16 bytes, [..., n_taps * d] -> uint8 [..., row_bytes]."""
    t = taps.detach().to(torch.bfloat16).contiguous()
    return t.view(torch.uint8)  # bf16 -> 2 bytes per value, little-endian on every host we run


def encode_text(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def decode_ids(ids: list[int]) -> str:
    return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def save_target(model: TargetModel, directory: Path) -> None:
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model.config.save(directory / CONFIG_FILE)
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(state, str(directory / WEIGHTS_FILE))


def load_target(directory: Path, device: str | torch.device = "cpu",
                dtype: torch.dtype = torch.float32) -> TargetModel:
    from safetensors.torch import load_file

    directory = Path(directory)
    config = TargetConfig.load(directory / CONFIG_FILE)
    model = TargetModel(config)
    state = load_file(str(directory / WEIGHTS_FILE))
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{directory}: target weights missing {missing}, unexpected {unexpected}")
    model.to(device=device, dtype=dtype)
    model.eval()
    model.requires_grad_(False)
    return model


def default_target_dir() -> Path:
    """The reference target shipped with the package."""
    return Path(__file__).resolve().parent / "reference_target"
