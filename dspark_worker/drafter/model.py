"""The DSpark drafter network: the interface every model family provides (:class:`DraftModel`)
and the Qwen3 family (DRAFTER.md, "The draft step").

Module and parameter names follow the DeepSpec checkpoint layout exactly, so ``state_dict()`` keys
are the safetensors keys (``layers.0.self_attn.q_proj.weight`` ...). The numerics mirror
DeepSpec's ``Qwen3DSparkModel`` (HF Qwen3 RMSNorm, rotary embedding and eager attention):

- context rows: ``c = hidden_norm(fc(taps))``; per layer ``K = rope(k_norm(k_proj(c)))`` at the
  row's absolute position, ``V = v_proj(c)``; no input_layernorm. These are what the ring stores.
- block rows: ``[anchor, mask x (N-1)]`` at positions ``anchor_pos + j``; pre-norm decoder layers
  whose attention reads ``[context K/V ; block K/V]`` with no causal mask; GQA.
- ``hf = norm(h)``, base logits ``U = lm_head(hf)`` in fp32.
- the Markov walk and the confidence head live in :mod:`.walk`; their weights live here.

Markov head variants (DeepSpec ``markov_head.py``), with ``e = markov_w1[prev]`` ([V, r] lookup):

- vanilla: ``bias = markov_w2(e)`` (w2 weight [V, r]);
- gated: ``bias = markov_w2(sigmoid(gate_proj([hf_j ; e])) * e)``, gate_proj Linear(d + r -> r);
- rnn: a GRU-like state ``s`` (zeros before position 0): ``[g ; c ; o] = joint_proj([s ; e ;
  hf_j])`` (Linear(2r + d -> 3r)), ``s = sigmoid(g) * s + (1 - sigmoid(g)) * tanh(c)``,
  ``bias = markov_w2(tanh(o))``.

The confidence head always reads ``[hf_j ; e]`` (or ``hf_j`` alone when
``confidence_head_with_markov`` is false), with ``e`` the embedding of the token before position
j, also for the rnn head.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, TypeVar, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import DrafterConfig


class RMSNorm(nn.Module):
    """Qwen3RMSNorm: normalise in fp32, scale in the input dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x32 = x.float()  # [..., dim]
        var = x32.pow(2).mean(-1, keepdim=True)  # [..., 1]
        out: Tensor = self.weight * (x32 * torch.rsqrt(var + self.eps)).to(dtype)  # [..., dim]
        return out


class Attention(nn.Module):
    """q/k/v/o projections with per-head q and k norms; ``bias``: the projections have biases
    (no released DeepSpec drafter does; speculators' ``attention_bias``)."""

    def __init__(self, c: DrafterConfig, bias: bool = False) -> None:
        super().__init__()
        d, hd = c.hidden_size, c.head_dim
        self.num_heads = c.num_attention_heads
        self.num_kv_heads = c.num_key_value_heads
        self.head_dim = hd
        self.q_proj = nn.Linear(d, self.num_heads * hd, bias=bias)
        self.k_proj = nn.Linear(d, self.num_kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(d, self.num_kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * hd, d, bias=bias)
        self.q_norm = RMSNorm(hd, c.rms_norm_eps)
        self.k_norm = RMSNorm(hd, c.rms_norm_eps)


class MLP(nn.Module):
    """The gated MLP: ``down(act(gate(x)) * up(x))``; SiLU in Qwen3, a family may pass its own."""

    def __init__(self, c: DrafterConfig,
                 act: Callable[[Tensor], Tensor] = F.silu) -> None:
        super().__init__()
        self.act = act
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))  # [..., d]
        return out


class BlockConv(Protocol):
    """An in-block convolution around a sublayer (DFlash2's): ``prepare`` its input, returning
    the convolved input and what ``finish`` needs to convolve its output."""

    def prepare(self, x: Tensor) -> tuple[Tensor, Tensor]: ...

    def finish(self, x: Tensor, delta: Tensor) -> Tensor: ...


class DecoderLayer(nn.Module):
    def __init__(self, c: DrafterConfig, bias: bool = False) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c, bias)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)
        # In-block convolutions around the attention and the MLP (DFlash2's; a module
        # assigned later replaces these Nones).
        self.attention_conv: BlockConv | None = None
        self.mlp_conv: BlockConv | None = None


class MarkovHead(nn.Module):
    def __init__(self, c: DrafterConfig) -> None:
        super().__init__()
        r, v, d = c.markov_rank, c.vocab_size, c.hidden_size
        self.kind = c.markov_head_type
        self.markov_w1 = _embedding(v, r)  # weight [V, r]: rows are target ids
        self.markov_w2 = nn.Linear(r, c.draft_vocab, bias=False)  # weight [Vd, r]
        if self.kind == "gated":
            self.gate_proj = nn.Linear(d + r, r)
        elif self.kind == "rnn":
            self.joint_proj = nn.Linear(2 * r + d, 3 * r)

    def step(self, prev: Tensor, hf_j: Tensor, state: Tensor | None) -> tuple[Tensor, Tensor,
                                                                             Tensor | None]:
        """One position: (e, bias, new rnn state). prev [B] int64 (target ids), hf_j [B, d];
        bias [B, Vd] over the draft vocabulary."""
        e, x, state = self.step_input(prev, hf_j, state)
        return e, self.markov_w2(x), state  # bias [B, Vd]

    def step_input(self, prev: Tensor, hf_j: Tensor, state: Tensor | None
                   ) -> tuple[Tensor, Tensor, Tensor | None]:
        """One position up to ``markov_w2``: (e, x, new rnn state) with bias = markov_w2(x)."""
        e = self.markov_w1(prev)  # [B, r]
        if self.kind == "gated":
            gate = torch.sigmoid(self.gate_proj(torch.cat([hf_j, e], dim=-1)))  # [B, r]
            return e, gate * e, state
        if self.kind == "rnn":
            if state is None:
                state = torch.zeros_like(e)  # [B, r]
            proj = self.joint_proj(torch.cat([state, e, hf_j], dim=-1))  # [B, 3r]
            g_raw, c_raw, o_raw = proj.chunk(3, dim=-1)  # 3 x [B, r]
            g = torch.sigmoid(g_raw)  # [B, r]
            state = g * state + (1.0 - g) * torch.tanh(c_raw)  # [B, r]
            return e, torch.tanh(o_raw), state
        return e, e, state

    def bias_at(self, x: Tensor, ids: Tensor) -> Tensor:
        """markov_w2(x) at the ids only: x [B, r], ids [B, K] int64 -> [B, K] (K rows of
        ``markov_w2`` read per lane instead of all Vd)."""
        rows = F.embedding(ids, self.markov_w2.weight)  # [B, K, r]
        out: Tensor = torch.bmm(rows, x.unsqueeze(2)).squeeze(2)  # [B, K]
        return out


class ConfidenceHead(nn.Module):
    def __init__(self, c: DrafterConfig) -> None:
        super().__init__()
        self.proj = nn.Linear(c.confidence_input_dim, 1)  # weight [1, d (+ r)], bias [1]


def _embedding(num: int, dim: int) -> nn.Embedding:
    """An embedding with a zero weight (loaded or filled after): nn.Embedding's own normal_
    init costs about a second on the meta device at its first use in a process."""
    return nn.Embedding(num, dim, _weight=torch.zeros(num, dim))


def rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


class DraftModel(nn.Module):
    """What the rings, the Markov walk and the drafter need of a model family (docs/
    architecture.md, "Model families"). A family subclasses it and provides:

    - the shared modules under their checkpoint names: ``embed_tokens``, ``fc``,
      ``hidden_norm``, ``layers``, ``norm``, ``lm_head``, ``markov_head`` (or None),
      ``confidence_head`` (or None); ``config`` (a :class:`DrafterConfig`, whose
      ``num_hidden_layers``, ``num_key_value_heads`` and ``head_dim`` size the rings);
    - :meth:`inv_freq_values`: its rotary frequencies (used by :meth:`rope`);
    - :meth:`project_context_kv`: tap rows -> the K/V a ring stores, every layer at once;
    - :meth:`backbone`: one block for B lanes against a :class:`ContextSource`;
    - :meth:`logits`: the base logits U (fp32) that the Markov bias is added to, over
      ``config.draft_vocab``, as :meth:`head_logits` (the LM head GEMM, model dtype) then
      :meth:`finish_logits` (elementwise to fp32): the walk runs the GEMM once for every
      position and finishes one position at a time, so no [B, N, Vd] fp32 tensor is made;
    - :meth:`target_ids`: that vocabulary's ids -> target ids (the identity unless the family
      reduces it; a device gather, so the walk maps its picks without a host sync);
    - :attr:`walk_head` and :attr:`walk_candidates` where the walk is not the Markov head's
      over the whole vocabulary.
    """

    config: DrafterConfig
    embed_tokens: nn.Embedding
    fc: nn.Linear
    lm_head: nn.Linear
    markov_head: MarkovHead | None
    confidence_head: ConfidenceHead | None
    inv_freq: Tensor  # [hd/2] fp32, non-persistent (init_buffers)
    # Tensors per ring slot: 2, K and V ([2, L, R, Hkv, D] from project_context_kv); 1 where
    # one tensor serves as both (K3's latent).
    ring_planes: int = 2
    confidence_temperature: Tensor  # [block_size] fp32, non-persistent (init_buffers)

    # -- buffers that are not weights --------------------------------------------------------
    def init_buffers(self) -> None:
        """(Re)make the non-persistent buffers on the weights' device. Call after loading."""
        c = self.config
        device = self.fc.weight.device
        self.register_buffer("inv_freq", self.inv_freq_values(device), persistent=False)
        temps = c.confidence_temperatures or (1.0,) * c.block_size
        self.register_buffer(
            "confidence_temperature",
            torch.tensor(temps, dtype=torch.float32, device=device),  # [block_size]
            persistent=False,
        )

    def inv_freq_values(self, device: torch.device) -> Tensor:  # pragma: no cover - interface
        """The rotary inverse frequencies [head_dim / 2], fp32."""
        raise NotImplementedError

    def rope(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos, sin [..., hd] in the model dtype for int64 positions [...]."""
        freqs = positions.float().unsqueeze(-1) * self.inv_freq  # [..., hd/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [..., hd]
        dtype = self.fc.weight.dtype
        return emb.cos().to(dtype), emb.sin().to(dtype)

    # -- the forward pieces -------------------------------------------------------------------
    def project_context_kv(self, taps: Tensor, positions: Tensor
                           ) -> Tensor:  # pragma: no cover - interface
        """taps [R, tap_width] (model dtype), positions [R] int64 -> the ring's K and V
        [ring_planes, L, R, kv_heads, head_dim], non-finite values replaced by 0."""
        raise NotImplementedError

    def backbone(self, block_ids: Tensor, block_pos: Tensor,
                 context: ContextSource) -> Tensor:  # pragma: no cover - interface
        """block_ids, block_pos [B, N] int64 -> final hidden states hf [B, N, d]."""
        raise NotImplementedError

    def logits(self, hf: Tensor) -> Tensor:
        """The base logits U [..., Vd] fp32: ``finish_logits(head_logits(hf))``."""
        return self.finish_logits(self.head_logits(hf))

    def head_logits(self, hf: Tensor) -> Tensor:
        """The LM head's output [..., Vd] in the model dtype: the one vocabulary-wide GEMM."""
        out: Tensor = self.lm_head(hf)
        return out

    def finish_logits(self, head: Tensor) -> Tensor:
        """U in fp32 from :meth:`head_logits` (elementwise, so the walk may apply it one
        position at a time); a family with a logit transform overrides this."""
        return head.float()

    def target_ids(self, ids: Tensor) -> Tensor:
        """Draft-vocabulary ids -> target ids (the same ids unless a family reduces the
        vocabulary; ``config.draft_vocab``)."""
        return ids

    # -- the walk ---------------------------------------------------------------------------
    # Candidates per position the family's own walk reranks (DFlash2's selector_top_k); 0: the
    # walk runs over the whole vocabulary unless the worker asks for vLLM's candidate walk.
    walk_candidates: int = 0

    @property
    def walk_head(self) -> MarkovHead | None:
        """The head whose bias the walk adds given the previous token: the Markov head, or a
        family's own (DFlash2's candidate selector); None: the base logits alone."""
        return self.markov_head


class DrafterModel(DraftModel):
    """The Qwen3 family: the drafter's weights and its two forward pieces:
    :meth:`project_context` (ingest) and :meth:`backbone` (one block for B lanes). Inference
    only; build with ``families.build_model``."""

    _fused: tuple[Tensor, Tensor]  # project_context_kv's weights, rebuilt when they change
    _fused_bias: Tensor | None = None  # their k/v biases where the layers have them
    _fused_key: tuple[tuple[int, int], ...] | None = None

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        c = config
        self.config = c
        self.embed_tokens = _embedding(c.vocab_size, c.hidden_size)
        self.fc = nn.Linear(c.tap_width, c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(c) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        self.markov_head = MarkovHead(c) if c.has_markov_head else None
        self.confidence_head = ConfidenceHead(c) if c.enable_confidence_head else None
        self.scaling = c.head_dim**-0.5
        self.init_buffers()

    @property
    def decoder_layers(self) -> list[DecoderLayer]:
        return [cast(DecoderLayer, layer) for layer in self.layers]

    def inv_freq_values(self, device: torch.device) -> Tensor:
        c = self.config
        # HF Qwen3RotaryEmbedding "default": computed in fp32 exactly this way.
        exponent = torch.arange(0, c.head_dim, 2, dtype=torch.int64, device=device).float()
        inv_freq: Tensor = 1.0 / (c.rope_theta ** (exponent / c.head_dim))  # [hd/2]
        return inv_freq

    # -- ingest -------------------------------------------------------------------------------
    def project_context(self, taps: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """Context K/V of every layer for R tap rows, layer by layer (the definition; what
        training differentiates). Inference uses :meth:`project_context_kv`, the same values
        from one matmul for every layer.

        taps [R, n_taps * target_hidden] (model dtype), positions [R] int64 ->
        K, V [L, R, kv_heads, head_dim]. Non-finite values become 0 so that a poisoned row can
        never leak through a masked ring slot (0 * NaN is NaN).
        """
        c = self.config
        rows = taps.shape[0]
        ctx = self.hidden_norm(self.fc(taps))  # [R, d]
        cos, sin = self.rope(positions)  # [R, hd]
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [R, 1, hd]
        ks, vs = [], []
        for layer in self.decoder_layers:
            attn = layer.self_attn
            k = attn.k_norm(attn.k_proj(ctx).view(rows, c.num_key_value_heads, c.head_dim))
            k = k * cos + rotate_half(k) * sin  # [R, Hkv, D]
            v = attn.v_proj(ctx).view(rows, c.num_key_value_heads, c.head_dim)  # [R, Hkv, D]
            ks.append(k)
            vs.append(v)
        k_all = torch.nan_to_num(torch.stack(ks), nan=0.0, posinf=0.0, neginf=0.0)  # [L, R, Hkv, D]
        v_all = torch.nan_to_num(torch.stack(vs), nan=0.0, posinf=0.0, neginf=0.0)  # [L, R, Hkv, D]
        return k_all, v_all

    def project_context_kv(self, taps: Tensor, positions: Tensor) -> Tensor:
        """:meth:`project_context` for inference, stacked: [2 (K, V), L, R, kv_heads, head_dim].

        Every layer's k_proj and v_proj run as one matmul over weights concatenated once (and
        again whenever one of them changes); k_norm and RoPE run on all layers at once. About
        a tenth of the operations of the layer loop: what ingest costs per STEP is mostly
        their count, on the CPU and in kernel launches on a GPU. The concatenated weights are a
        second copy of every k_proj and v_proj (52 MB in bf16 for a Qwen3-4B-shaped drafter:
        5 layers, 8 KV heads of 128, hidden 2560). No autograd through it."""
        c = self.config
        r, n_layers, hkv, hd = taps.shape[0], c.num_hidden_layers, c.num_key_value_heads, c.head_dim
        w_kv, k_norm = self._fused_context_weights()  # [L*2*Hkv*D, d], [1, L, 1, D]
        with torch.no_grad():
            ctx = self.hidden_norm(self.fc(taps))  # [R, d]
            kv = F.linear(ctx, w_kv, self._fused_bias).view(r, n_layers, 2, hkv, hd)
            k, v = kv[:, :, 0], kv[:, :, 1]  # [R, L, Hkv, D] each
            dtype = k.dtype
            k32 = k.float()
            var = k32.pow(2).mean(-1, keepdim=True)  # [R, L, Hkv, 1]
            k = k_norm * (k32 * torch.rsqrt(var + c.rms_norm_eps)).to(dtype)  # k_norm per layer
            cos, sin = self.rope(positions)  # [R, hd]
            cos, sin = cos.view(r, 1, 1, hd), sin.view(r, 1, 1, hd)
            k = k * cos + rotate_half(k) * sin  # [R, L, Hkv, D]
            out = torch.stack([k, v]).transpose(1, 2)  # [2, L, R, Hkv, D]
            return torch.nan_to_num_(out, nan=0.0, posinf=0.0, neginf=0.0)

    def _fused_context_weights(self) -> tuple[Tensor, Tensor]:
        layers = [layer.self_attn for layer in self.decoder_layers]
        params = [p for a in layers for p in (a.k_proj.weight, a.v_proj.weight, a.k_norm.weight)]
        biases: list[Tensor] = [b for a in layers for b in (a.k_proj.bias, a.v_proj.bias)
                                if b is not None]
        key = tuple((p.data_ptr(), p._version) for p in params + biases)
        if self._fused_key != key:
            with torch.no_grad():
                w_kv = torch.cat([w for a in layers
                                  for w in (a.k_proj.weight, a.v_proj.weight)])  # [L*2*Hkv*D, d]
                k_norm = torch.stack([a.k_norm.weight for a in layers])  # [L, D]
                self._fused_bias = torch.cat(biases) if biases else None  # [L*2*Hkv*D]
            self._fused = (w_kv, k_norm.view(1, len(layers), 1, -1))
            self._fused_key = key
        return self._fused

    # -- one block ----------------------------------------------------------------------------
    def backbone(
        self,
        block_ids: Tensor,
        block_pos: Tensor,
        context: ContextSource,
    ) -> Tensor:
        """Final hidden states hf [B, N, d] of the block.

        block_ids, block_pos [B, N] int64. ``context.layer(l)`` gives that layer's context
        K, V [B, Hkv, S, D] and ``context.valid`` [B, S] bool marks the slots a lane may read.
        """
        c = self.config
        b, n = block_ids.shape
        hkv, g, hd = c.num_key_value_heads, c.num_kv_groups, c.head_dim
        h = self.embed_tokens(block_ids)  # [B, N, d]
        cos, sin = self.rope(block_pos)  # [B, N, hd]
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [B, 1, N, hd]
        ctx_bias = context_bias(context.valid)  # [B, 1, 1, S]
        for index, layer in enumerate(self.decoder_layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)  # [B, N, d]
            q = attn.q_norm(attn.q_proj(x).view(b, n, c.num_attention_heads, hd))  # [B, N, H, D]
            k = attn.k_norm(attn.k_proj(x).view(b, n, hkv, hd))  # [B, N, Hkv, D]
            v = attn.v_proj(x).view(b, n, hkv, hd)  # [B, N, Hkv, D]
            # Heads of one KV group sit next to each other (HF repeat_kv order): view the
            # queries as [B, Hkv, G*N, D] so no K/V copy per query head is needed.
            q = q.transpose(1, 2)  # [B, H, N, D]
            q = q * cos + rotate_half(q) * sin  # [B, H, N, D]
            q = q.reshape(b, hkv, g * n, hd)  # [B, Hkv, G*N, D]
            k = k.transpose(1, 2)  # [B, Hkv, N, D]
            k = k * cos + rotate_half(k) * sin  # [B, Hkv, N, D]
            v = v.transpose(1, 2)  # [B, Hkv, N, D]
            k_ctx, v_ctx = context.layer(index)  # [B, Hkv, S, D] each
            out = attend(q, k, v, k_ctx, v_ctx, ctx_bias, self.scaling)  # [B, Hkv, G*N, D]
            out = out.view(b, c.num_attention_heads, n, hd)  # [B, H, N, D]
            out = out.transpose(1, 2).reshape(b, n, c.num_attention_heads * hd)  # [B, N, H*D]
            h = h + attn.o_proj(out)  # [B, N, d]
            h = h + layer.mlp(layer.post_attention_layernorm(h))  # [B, N, d]
        hf: Tensor = self.norm(h)  # [B, N, d]
        return hf


def context_bias(valid: Tensor) -> Tensor:
    """The additive mask over [context ; block] for valid [B, S] bool: the block sees every
    valid context slot and the whole block (no causal mask). -> [B, 1, 1, S] fp32."""
    b, s = valid.shape
    bias = torch.zeros((b, s), dtype=torch.float32, device=valid.device)  # [B, S]
    bias.masked_fill_(~valid, float("-inf"))
    return bias.view(b, 1, 1, s)


def attend(q: Tensor, k: Tensor, v: Tensor, k_ctx: Tensor, v_ctx: Tensor, ctx_bias: Tensor,
           scaling: float, block_bias: Tensor | None = None) -> Tensor:
    """Block attention over [context ; block], the heads of one KV group side by side:
    q [B, Hkv, G*N, D], k, v [B, Hkv, N, D], k_ctx, v_ctx [B, Hkv, S, D], ctx_bias
    [B, 1, 1, S] -> [B, Hkv, G*N, D]. No mask inside the block unless ``block_bias``
    [G*N, N] (fp32, added to the block scores). Scores and softmax in fp32."""
    s = k_ctx.shape[-2]
    s_ctx = torch.matmul(q, k_ctx.transpose(-1, -2)) * scaling  # [B, Hkv, G*N, S]
    s_blk = torch.matmul(q, k.transpose(-1, -2)) * scaling  # [B, Hkv, G*N, N]
    s_ctx = s_ctx.float() + ctx_bias  # [B, Hkv, G*N, S]
    s_blk = s_blk.float() if block_bias is None else s_blk.float() + block_bias
    scores = torch.cat([s_ctx, s_blk], dim=-1)  # [B, Hkv, G*N, S+N]
    probs = torch.softmax(scores, dim=-1).to(q.dtype)  # [B, Hkv, G*N, S+N]
    out: Tensor = torch.matmul(probs[..., :s], v_ctx) + torch.matmul(probs[..., s:], v)
    return out


def per_query_window_bias(context: ContextSource, n: int, window: int, groups: int) -> Tensor:
    """A sliding window of ``window`` around each block row, over the context: query row r
    sees the newest ``window - 1 - r`` context rows (keys within window - 1 positions of its
    own, the context ending just before the block) -> [B, 1, G*N, S] fp32 (repeat_kv order)."""
    per_row = torch.stack([context.newest(max(window - 1 - r, 0)) for r in range(n)], 1)
    bias = torch.zeros(per_row.shape, dtype=torch.float32, device=per_row.device)
    bias.masked_fill_(~per_row, float("-inf"))  # [B, N, S]
    return bias.repeat(1, groups, 1).unsqueeze(1)  # [B, 1, G*N, S]


class ContextSource:
    """Context K/V for :meth:`DrafterModel.backbone`, one layer at a time (a ring gather, or a
    from-scratch projection in the reference)."""

    valid: Tensor  # [B, S] bool

    def layer(self, index: int) -> tuple[Tensor, Tensor]:  # pragma: no cover - interface
        raise NotImplementedError

    def newest(self, count: int) -> Tensor:  # pragma: no cover - interface
        """``valid`` [B, S] narrowed to each lane's newest ``count`` rows (what a
        sliding-window layer reads)."""
        raise NotImplementedError


class DenseContext(ContextSource):
    """Context already laid out per lane: K, V [L, B, Hkv, S, D] and valid [B, S], the slots
    in position order."""

    def __init__(self, k: Tensor, v: Tensor, valid: Tensor) -> None:
        self.k, self.v, self.valid = k, v, valid

    def layer(self, index: int) -> tuple[Tensor, Tensor]:
        return self.k[index], self.v[index]

    def newest(self, count: int) -> Tensor:
        at_or_after = self.valid.flip(-1).cumsum(-1).flip(-1)  # [B, S] valid slots from s on
        return self.valid & (at_or_after <= count)


M = TypeVar("M", bound=DraftModel)


def instantiate(model_type: type[M], config: DrafterConfig, tensors: dict[str, Tensor] | None,
                *, device: torch.device | str, dtype: torch.dtype) -> M:
    """A ``model_type`` holding ``tensors`` (keys = the checkpoint layout, already
    shape-checked) cast to ``dtype`` on ``device``; with ``tensors=None`` the weights are left
    uninitialised (the caller fills them). ``families.build_model`` picks ``model_type``."""
    with torch.device("meta"):
        model = model_type(config)
    if tensors is None:
        # dtype first, on the meta device: no full-size fp32 copy is ever allocated
        model.to(dtype=dtype)
        model.to_empty(device=device)
    else:
        # Index tensors (a reduced vocabulary's d2t / t2d) keep their integer dtype.
        state = {name: t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype)
                 for name, t in tensors.items()}
        model.load_state_dict(state, strict=True, assign=True)
    model.requires_grad_(False)
    model.eval()
    model.init_buffers()
    return model


def expected_shapes(c: DrafterConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the Qwen3 checkpoint layout with its shape, in the DeepSpec key names."""
    d, v, hd = c.hidden_size, c.vocab_size, c.head_dim
    q_dim, kv_dim = c.num_attention_heads * hd, c.num_key_value_heads * hd
    shapes: dict[str, tuple[int, ...]] = {
        "embed_tokens.weight": (v, d),
        "fc.weight": (d, c.tap_width),
        "hidden_norm.weight": (d,),
        "norm.weight": (d,),
        "lm_head.weight": (v, d),
    }
    for i in range(c.num_hidden_layers):
        p = f"layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (d,),
            p + "self_attn.q_proj.weight": (q_dim, d),
            p + "self_attn.k_proj.weight": (kv_dim, d),
            p + "self_attn.v_proj.weight": (kv_dim, d),
            p + "self_attn.o_proj.weight": (d, q_dim),
            p + "self_attn.q_norm.weight": (hd,),
            p + "self_attn.k_norm.weight": (hd,),
            p + "post_attention_layernorm.weight": (d,),
            p + "mlp.gate_proj.weight": (c.intermediate_size, d),
            p + "mlp.up_proj.weight": (c.intermediate_size, d),
            p + "mlp.down_proj.weight": (d, c.intermediate_size),
        })
    shapes.update(head_shapes(c))
    return shapes


def head_shapes(c: DrafterConfig) -> dict[str, tuple[int, ...]]:
    """The Markov and confidence heads' tensors, the same in every family."""
    d, v = c.hidden_size, c.vocab_size
    shapes: dict[str, tuple[int, ...]] = {}
    r = c.markov_rank
    if c.has_markov_head:
        shapes["markov_head.markov_w1.weight"] = (v, r)
        shapes["markov_head.markov_w2.weight"] = (c.draft_vocab, r)
        if c.markov_head_type == "gated":
            shapes["markov_head.gate_proj.weight"] = (r, d + r)
            shapes["markov_head.gate_proj.bias"] = (r,)
        elif c.markov_head_type == "rnn":
            shapes["markov_head.joint_proj.weight"] = (3 * r, 2 * r + d)
            shapes["markov_head.joint_proj.bias"] = (3 * r,)
    if c.enable_confidence_head:
        shapes["confidence_head.proj.weight"] = (1, c.confidence_input_dim)
        shapes["confidence_head.proj.bias"] = (1,)
    return shapes

