"""Draft step and ingest timings of the drafter (dspark_worker.drafter).

    python bench/bench_drafter.py                                  # CPU, embedded default
    python bench/bench_drafter.py --device cuda --shape qwen3-4b   # H100/H200-class GPU

For each batch size B (lanes, one per slot), with every window full (W rows ending at the
anchor):
  draft ms      one ``Drafter.draft`` call for B lanes, N positions, greedy (median, p90);
                on CUDA timed with CUDA events around the call (the call ends with the download
                of its results, so the events cover the whole step)
  sampled ms    the same with every lane sampled (top_k 32, top_p 0.9), when --sampled
  step ingest   one ``RingPool.apply`` of 4 new rows per lane (a typical STEP: the accepted
                tokens of the last round), in ms
  fill GB/s     tap-row bytes per second while filling the rings (W rows per lane, up to
                ``--chunk-rows`` rows per apply): upload, projection and scatter together
and the ring memory per lane. The large shapes have random weights (no checkpoint is needed to
time them):

- qwen3-4b: d 2560, 5 layers, 32/8 heads of 128, intermediate 9728, vocab 151936, 5 taps of
  hidden 2560, Markov rank 256;
- gemma4-12b (the released ``dspark_gemma4_12b_block7``): d 3840, 5 layers, 16/1 heads of 512
  (K = V), intermediate 15360, vocab 262144, 5 taps of hidden 3840, Markov rank 256, softcap
  30, partial RoPE; 3.4 G parameters (6.8 GB in bf16);
- speculators-8b (a drafter trained with vLLM's speculators for a Qwen3-8B target, its
  training defaults): d 4096, 5 layers, all sliding (window 2048, causal in the block),
  32/8 heads of 128, intermediate 12288, target vocab 151936 with a draft vocabulary of 32000
  (lm_head and Markov W2 over 32000, d2t back), 5 taps of hidden 4096, block 8 in the bonus
  layout (N 7), Markov rank 256;
- kimi-k3 (``Inferact/Kimi-K3-DSpark``): d 7168, 5 MLA layers of 64 heads (q_lora 1536,
  kv_lora 512, nope 128, rope 64, v 128; DeepSeek-YaRN factor 32), intermediate 14336, vocab
  163840, 5 taps of hidden 7168, Markov rank 256; W 4096 by default; its ring holds the
  latent (576 values per layer and position). 2.4 G parameters of its own plus the target's
  embedding and head (2.3 G): 9.5 GB in bf16, so on the CPU pass ``--dtype bf16``.
- minimax-m3 (the released MiniMax-M3.1 DSpark drafter, MXFP8 on disk, dequantised to bf16):
  d 6144, 5 layers, all sliding (window 4096, per query row), 64/4 heads of 128 with partial
  RoPE (64 of 128), clamped SwiGLU of 12288, vocab 200064, 5 taps of hidden 6144 (the last
  target layer among them), N 7, Markov rank 256; 1.96 G parameters (3.9 GB in bf16, 4.9 GB
  more for the target's embedding and head). W defaults to 4096: every row a window reads.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from dspark_worker.drafter import (
    Drafter,
    DrafterConfig,
    Gemma4Config,
    RingPool,
    SamplingParams,
    SpeculatorsConfig,
    embedded_default,
    encode_bf16_rows,
)
from dspark_worker.drafter.embedded import init_random_
from dspark_worker.drafter.families import build_model
from dspark_worker.drafter.k3 import K3Config
from dspark_worker.drafter.minimax import MiniMaxConfig

QWEN3_4B = DrafterConfig(
    hidden_size=2560,
    num_hidden_layers=5,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=9728,
    vocab_size=151936,
    rms_norm_eps=1e-6,
    rope_theta=1_000_000.0,
    target_layer_ids=(1, 9, 17, 25, 33),
    block_size=7,
    mask_token_id=151669,
    markov_rank=256,
    markov_head_type="vanilla",
    enable_confidence_head=True,
    confidence_head_with_markov=True,
    target_hidden_size=2560,
    num_target_layers=36,
).validated("qwen3-4b shape")

GEMMA4_12B = Gemma4Config(
    hidden_size=3840,
    num_hidden_layers=5,
    num_attention_heads=16,
    num_key_value_heads=1,  # num_global_key_value_heads (attention_k_eq_v)
    head_dim=512,  # global_head_dim
    intermediate_size=15360,
    vocab_size=262144,
    rms_norm_eps=1e-6,
    rope_theta=1_000_000.0,
    target_layer_ids=(5, 17, 29, 41, 46),
    block_size=7,
    mask_token_id=4,
    markov_rank=256,
    markov_head_type="vanilla",
    enable_confidence_head=True,
    confidence_head_with_markov=True,
    target_hidden_size=3840,
    num_target_layers=48,
    partial_rotary_factor=0.25,
    final_logit_softcapping=30.0,
).validated("gemma4-12b shape")

SPECULATORS_8B = SpeculatorsConfig(
    hidden_size=4096,
    num_hidden_layers=5,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=12288,
    vocab_size=151936,
    rms_norm_eps=1e-6,
    rope_theta=1_000_000.0,
    target_layer_ids=(1, 9, 17, 25, 33),  # aux_hidden_state_layer_ids 2, 10, 18, 26, 34
    block_size=8,
    mask_token_id=151669,
    markov_rank=256,
    markov_head_type="vanilla",
    enable_confidence_head=True,
    confidence_head_with_markov=True,
    target_hidden_size=4096,
    draft_vocab_size=32000,
    sample_from_anchor=False,
    layer_types=("sliding_attention",) * 5,
    sliding_window=2048,
    max_position_embeddings=40960,
).validated("speculators-8b shape")

KIMI_K3 = K3Config(
    hidden_size=7168,
    num_hidden_layers=5,
    num_attention_heads=64,
    num_key_value_heads=1,  # the latent ring: one "head" ...
    head_dim=576,  # ... of kv_lora 512 + rope 64
    intermediate_size=14336,
    vocab_size=163840,
    rms_norm_eps=1e-5,
    rope_theta=50000.0,
    target_layer_ids=(2, 23, 47, 71, 89),
    block_size=7,
    mask_token_id=163837,
    markov_rank=256,
    markov_head_type="vanilla",
    enable_confidence_head=True,
    confidence_head_with_markov=True,
    target_hidden_size=7168,
    num_target_layers=93,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    rope_type="yarn",
    rope_factor=32.0,
    rope_original_max=32768,
    mscale=1.0,
    mscale_all_dim=1.0,
).validated("kimi-k3 shape")

MINIMAX_M3 = MiniMaxConfig(
    hidden_size=6144,
    num_hidden_layers=5,
    num_attention_heads=64,
    num_key_value_heads=4,
    head_dim=128,
    intermediate_size=12288,  # dspark_ffn_hidden_size
    vocab_size=200064,
    rms_norm_eps=1e-6,
    rope_theta=5e6,
    target_layer_ids=(3, 17, 31, 45, 59),
    block_size=7,
    mask_token_id=200058,
    markov_rank=256,
    markov_head_type="vanilla",
    enable_confidence_head=True,
    confidence_head_with_markov=True,
    target_hidden_size=6144,
    rotary_dim=64,
    partial_rotary_factor=0.5,
    swiglu_alpha=1.702,
    swiglu_limit=7.0,
    sliding_window=4096,
    layer_types=("sliding_attention",) * 5,
    quantization="mxfp8",
).validated("minimax-m3 shape")

SHAPES: dict[str, tuple[DrafterConfig | None, tuple[int, ...], int]] = {
    "tiny": (None, (1, 16, 64), 256),
    "qwen3-4b": (QWEN3_4B, (1, 16, 64, 256), 1024),
    "gemma4-12b": (GEMMA4_12B, (1, 16, 64, 256), 1024),
    "speculators-8b": (SPECULATORS_8B, (1, 16, 64, 256), 1024),
    "kimi-k3": (KIMI_K3, (1, 16, 64, 256), 4096),
    "minimax-m3": (MINIMAX_M3, (1, 16, 64), 4096),
}
STEP_ROWS = 4  # rows per lane in the "step ingest" measurement


def build(shape: str, device: torch.device, dtype: torch.dtype | None) -> Drafter:
    config = SHAPES[shape][0]
    if config is None:
        return embedded_default(device=device, dtype=dtype)
    dt = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    model = build_model(config, None, device=device, dtype=dt)
    init_random_(model, seed=1)
    return Drafter(model, drafter_identity=bytes(32), markov_identity=bytes(32), source=shape)


class Timer:
    """Milliseconds of a callable: CUDA events on a GPU, perf_counter on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def ms(self, fn: Callable[[], object]) -> float:
        if self.cuda:
            start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            start.record()
            fn()
            end.record()
            end.synchronize()
            return float(start.elapsed_time(end))
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3


def random_rows(n: int, drafter: Drafter, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    values = rng.standard_normal((n, drafter.config.tap_width), dtype=np.float32)
    return encode_bf16_rows(values)


def fill(pool: RingPool, drafter: Drafter, lanes: np.ndarray, window: int, chunk_rows: int,
         timer: Timer) -> tuple[float, np.ndarray]:
    """Reset every lane to W rows ending at position W; returns (GB/s, anchors)."""
    per_apply = max(1, min(lanes.size, chunk_rows // window))
    buf = random_rows(per_apply * window, drafter, seed=3)
    timer.sync()
    t0 = time.perf_counter()
    for lo in range(0, lanes.size, per_apply):
        group = lanes[lo:lo + per_apply]
        g = group.size
        pool.apply(group, np.full(g, window), np.full(g, window), np.ones(g, dtype=bool),
                   buf[:g * window])
    timer.sync()
    seconds = time.perf_counter() - t0
    gb = lanes.size * window * drafter.row_bytes / 1e9
    return gb / seconds, np.full(lanes.size, window, dtype=np.int64)


def quantiles(values: list[float]) -> tuple[float, float]:
    ordered = sorted(values)
    return statistics.median(ordered), ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]


def bench_batch(drafter: Drafter, b: int, window: int, args: argparse.Namespace,
                timer: Timer) -> dict[str, float]:
    pool = drafter.new_pool(b, window)
    lanes = pool.allocate(b)
    fill_gbs, anchors = fill(pool, drafter, lanes, window, args.chunk_rows, timer)
    tokens = np.arange(b, dtype=np.int64) % drafter.vocab_size

    step_rows = random_rows(b * STEP_ROWS, drafter, seed=4)
    counts = np.full(b, STEP_ROWS)
    no_reset = np.zeros(b, dtype=bool)
    ingest: list[float] = []
    for _ in range(args.warmup + args.iters):
        anchors = anchors + STEP_ROWS

        def step(a: np.ndarray = anchors) -> None:
            pool.apply(lanes, a, counts, no_reset, step_rows)

        ingest.append(timer.ms(step))
    ingest = ingest[args.warmup:]

    def draft(sampling: SamplingParams | None) -> list[float]:
        times = [timer.ms(lambda: drafter.draft(pool, lanes, anchors, tokens, sampling=sampling))
                 for _ in range(args.warmup + args.iters)]
        return times[args.warmup:]

    rows = pool.window_rows(lanes, anchors)
    assert (rows == min(window, int(anchors[0]))).all(), "windows must be full for the timing"
    out: dict[str, float] = {}
    out["draft_med"], out["draft_p90"] = quantiles(draft(None))
    if args.sampled:
        params = SamplingParams(top_k=np.full(b, 32), temperature=np.ones(b),
                                top_p=np.full(b, 0.9), seed=np.arange(b, dtype=np.uint64),
                                generation=np.zeros(b))
        out["sampled_med"], out["sampled_p90"] = quantiles(draft(params))
    out["ingest_med"], _ = quantiles(ingest)
    out["fill_gbs"] = fill_gbs
    out["ring_mib"] = pool.nbytes / 2**20
    return out


def step_cost(drafter: Drafter, b: int, window: int) -> tuple[float, float]:
    """(FLOPs, bytes) one draft step of b lanes must at least spend: every matmul of the
    backbone over B * (lead rows + N) block rows with attention over W + those keys (sliding
    layers counted as full ones), the LM head and the dense Markov bias (over the draft
    vocabulary) at B * N positions; every weight it multiplies read once, and the lanes'
    rings."""
    c = drafter.config
    n, d, v = drafter.num_spec, c.hidden_size, c.draft_vocab
    rows = c.lead_rows + n
    layer_params = sum(p.numel() for name, p in drafter.model.named_parameters()
                       if name.startswith("layers.") and p.dim() == 2)
    head = v * d + (v * c.markov_rank if c.has_markov_head else 0)  # lm_head, markov_w2
    attn = 4 * c.num_hidden_layers * c.num_attention_heads * c.head_dim * (window + rows)
    flops = 2.0 * b * (rows * layer_params + n * head) + b * rows * attn
    elem = torch.finfo(drafter.dtype).bits // 8
    ring = (b * window * drafter.model.ring_planes * c.num_hidden_layers
            * c.num_key_value_heads * c.head_dim * elem)
    return flops, float((layer_params + head) * elem + ring)


def floor_ms(drafter: Drafter, b: int, window: int, timer: Timer) -> tuple[float, float]:
    """The step's floor measured on this device: (ms of one bf16 GEMM of the step's FLOPs,
    ms of a device copy moving the step's bytes, half read and half written)."""
    flops, nbytes = step_cost(drafter, b, window)
    dev = drafter.device
    m, k = b * drafter.num_spec, drafter.config.hidden_size
    cols = max(1, int(flops / (2 * m * k)))
    a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    w = torch.randn(k, cols, device=dev, dtype=torch.bfloat16)
    src = torch.empty(int(nbytes // 2), dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    gemm = [timer.ms(lambda: torch.matmul(a, w)) for _ in range(8)][3:]
    copy = [timer.ms(lambda: dst.copy_(src)) for _ in range(8)][3:]
    return statistics.median(gemm), statistics.median(copy)


def bench_graphs(drafter: Drafter, batches: list[int], window: int, args: argparse.Namespace,
                 timer: Timer) -> None:
    """Eager and captured draft steps on one ring pool of max(B) lanes, every window full, and
    the step's floor at each B."""
    from dspark_worker.drafter.step import EagerReplay

    largest = max(batches)
    pool = drafter.new_pool(largest, window)
    # On the CPU the stand-in replay runs the static step (checks this script, times nothing
    # a GPU would see).
    report = drafter.prepare_graphs(pool, largest, replay=None if timer.cuda else EagerReplay)
    print(f"graphs: {report.graphs} for buckets {report.buckets} in {report.seconds:.1f} s"
          f" (fallback: {report.fallback})", flush=True)
    lanes = pool.allocate(largest)
    _, anchors = fill(pool, drafter, lanes, window, args.chunk_rows, timer)
    graphs = drafter.graphs
    print(f"{'B':>5} {'eager ms':>9} {'graph ms':>9} {'eager smp':>10} {'graph smp':>10}"
          f" {'gemm ms':>8} {'copy ms':>8} {'floor ms':>9} {'graph/floor':>12}"
          f" {'eager/graph':>12}")
    for b in batches:
        sub, at = lanes[:b], anchors[:b]
        tokens = np.arange(b, dtype=np.int64) % drafter.vocab_size
        params = SamplingParams(top_k=np.full(b, 32), temperature=np.ones(b),
                                top_p=np.full(b, 0.9), seed=np.arange(b, dtype=np.uint64),
                                generation=np.zeros(b))

        def timed(sampling: SamplingParams | None, sub: np.ndarray = sub, at: np.ndarray = at,
                  tokens: np.ndarray = tokens) -> float:
            times = [timer.ms(lambda: drafter.draft(pool, sub, at, tokens, sampling=sampling))
                     for _ in range(args.warmup + args.iters)]
            return statistics.median(times[args.warmup:])

        drafter.graphs = None
        eager, eager_s = timed(None), timed(params)
        drafter.graphs = graphs
        graph, graph_s = (timed(None), timed(params)) if graphs is not None else (
            float("nan"), float("nan"))
        gemm, copy = floor_ms(drafter, b, window, timer)
        floor = max(gemm, copy)
        print(f"{b:>5} {eager:>9.3f} {graph:>9.3f} {eager_s:>10.3f} {graph_s:>10.3f}"
              f" {gemm:>8.3f} {copy:>8.3f} {floor:>9.3f} {graph / floor:>12.2f}"
              f" {eager / graph:>12.2f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default=None,
                        help="default: bf16 on CUDA, fp32 on the CPU")
    parser.add_argument("--batches", default=None, help="comma-separated B values")
    parser.add_argument("--window", type=int, default=None)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--chunk-rows", type=int, default=4096)
    parser.add_argument("--sampled", action="store_true", help="also time sampled drafts")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--graphs", action="store_true",
                        help="eager against captured steps (CUDA), with the measured floor")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, None: None}[args.dtype]
    _, default_batches, default_window = SHAPES[args.shape]
    batches = ([int(x) for x in args.batches.split(",")] if args.batches else
               list(default_batches))
    window = args.window or default_window
    timer = Timer(device)

    t0 = time.perf_counter()
    drafter = build(args.shape, device, dtype)
    drafter.warmup()
    build_s = time.perf_counter() - t0
    c = drafter.config
    per_lane = drafter.new_pool(1, window).bytes_per_lane
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else \
        f"cpu, {torch.get_num_threads()} threads"
    print(f"shape {args.shape}: d {c.hidden_size}, {c.num_hidden_layers} layers, "
          f"{c.num_attention_heads}/{c.num_key_value_heads} heads of {c.head_dim}, "
          f"vocab {c.vocab_size} (drafts over {c.draft_vocab}), {c.n_taps} taps of "
          f"{c.target_hidden_size}, row {drafter.row_bytes} B")
    print(f"device {name}, dtype {str(drafter.dtype).removeprefix('torch.')}, W {window}, "
          f"N {drafter.num_spec}, built and warmed up in {build_s:.1f} s")
    print(f"ring bytes per lane: {per_lane} ({per_lane / 2**10:.1f} KiB; "
          f"{per_lane / window:.0f} B per position, raw row {drafter.row_bytes} B)")
    if args.graphs:
        bench_graphs(drafter, batches, window, args, timer)
        return
    head = f"{'B':>5} {'draft ms':>9} {'p90':>7}"
    if args.sampled:
        head += f" {'sampled ms':>11} {'p90':>7}"
    head += f" {'ingest ms (' + str(STEP_ROWS) + ' rows/lane)':>24} {'fill GB/s':>10} " \
            f"{'rings MiB':>10}"
    print(head)
    for b in batches:
        r = bench_batch(drafter, b, window, args, timer)
        if timer.cuda:
            torch.cuda.empty_cache()  # the last B's rings are gone: hand their memory back
        line = f"{b:>5} {r['draft_med']:>9.2f} {r['draft_p90']:>7.2f}"
        if args.sampled:
            line += f" {r['sampled_med']:>11.2f} {r['sampled_p90']:>7.2f}"
        line += f" {r['ingest_med']:>24.2f} {r['fill_gbs']:>10.3f} {r['ring_mib']:>10.1f}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
