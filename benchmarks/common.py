"""Shared benchmark pieces: random-weight models in real Gemma 3 shapes, the measured copy
bandwidth, and the decode-step byte count that defines the roofline."""

from __future__ import annotations

import platform
import time

import torch

# Published Gemma 3 text shapes (hidden, layers, heads, kv heads, head dim, ffn, window).
GEMMA3_SHAPES = {
    "270m": dict(hidden_size=640, num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                 intermediate_size=2048, sliding_window=512),
    "1b": dict(hidden_size=1152, num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
               intermediate_size=6912, sliding_window=512),
    "4b": dict(hidden_size=2560, num_hidden_layers=34, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
               intermediate_size=10240, sliding_window=1024),
    "12b": dict(hidden_size=3840, num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=8, head_dim=256,
                intermediate_size=15360, sliding_window=1024),
}


def gemma3_hf_config(shape: str, max_positions: int = 32768):
    from transformers import Gemma3TextConfig

    s = GEMMA3_SHAPES[shape]
    layer_types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(s["num_hidden_layers"])]
    cfg = Gemma3TextConfig(vocab_size=262144, query_pre_attn_scalar=256, layer_types=layer_types,
                           max_position_embeddings=max_positions, **s)
    cfg.architectures = ["Gemma3ForCausalLM"]
    return cfg


@torch.no_grad()
def random_model(shape: str, device: torch.device, dtype: torch.dtype, seed: int = 0, max_positions: int = 32768):
    """A LoadedModel of Gemma 3 `shape` with random weights (no tokenizer: prompts are token ids)."""
    from swaserve.config import ModelConfig
    from swaserve.loader import LoadedModel
    from swaserve.runner.model_runner import build_model

    hf = gemma3_hf_config(shape, max_positions)
    config = ModelConfig.from_hf(hf)
    model = build_model(config, dtype, device)
    g = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        if p.ndim >= 2:
            p.normal_(0.0, 0.02, generator=g)
        else:
            p.normal_(0.0, 0.05, generator=g)  # Gemma norms are (1 + w)
    return LoadedModel(config, model, None, f"random-gemma3-{shape}")


def param_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def decode_step_bytes(loaded, bs: int, ctx: int, kv_dtype: torch.dtype) -> int:
    """Fewest bytes one decode step must read: every weight once (the tied embedding counts once,
    as the LM head reads all of it) plus each request's K/V — full layers the whole context, SWA
    layers the last min(ctx, W) keys."""
    cfg = loaded.config
    kv = cfg.full_group.bytes_per_token(kv_dtype) * ctx
    if cfg.sliding_window:
        kv += cfg.swa_group.bytes_per_token(kv_dtype) * min(ctx, cfg.sliding_window)
    return param_bytes(loaded.model) + bs * kv


def graph_us(fn, calls: int, replays: int = 3) -> float:
    """Microseconds per call of fn(i), i in range(calls), timed over CUDA-graph replays (no launch
    overhead, as in decode): warmed up (and compiled) once outside the capture, median of 5."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(0)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / (replays * calls))
    return sorted(times)[len(times) // 2]


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus written."""
    if device.type != "cuda":
        return float("nan")
    src = torch.empty(nbytes // 2, dtype=torch.int16, device=device).random_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    return 2 * nbytes / times[len(times) // 2]


def hardware() -> str:
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        return f"{p.name} ({p.multi_processor_count} SMs, {p.total_memory / 2**30:.0f} GiB), torch {torch.__version__}"
    return f"{platform.processor() or platform.machine()} CPU, torch {torch.__version__}"


def fast_paths() -> str:
    """The opt-in kernel paths as this process will actually run them (PDL also needs sm_90+ and a
    Triton with the launch option, so the env var alone does not say it is on)."""
    import os

    from swaserve.kernels.pdl import pdl_supported

    def env(name: str) -> str:
        return "on" if os.environ.get(name) == "1" else "off"

    blas = str(torch.backends.cuda.preferred_blas_library()).rsplit(".", 1)[-1] if torch.cuda.is_available() else "-"
    return (f"BLAS {blas}, skinny GEMMs {env('SWASERVE_SKINNY_GEMM')}, PDL {'on' if pdl_supported() else 'off'}"
            f" (env {env('SWASERVE_PDL')}), fused split combine {env('SWASERVE_FUSED_SPLIT_COMBINE')}")


def new_compiles(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """Kernels compiled between two `swaserve.kernels.common.compiled_variants()` snapshots."""
    return {k: v - before.get(k, 0) for k, v in after.items() if v > before.get(k, 0)}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def now(device: torch.device) -> float:
    sync(device)
    return time.perf_counter()
