"""Shared benchmark pieces: random-weight models in real Gemma 3 and Gemma 4 shapes, the measured copy
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


# Gemma-4-26B-A4B's published text config: 5 sliding (8 K/V heads x 256) : 1 full (2 K/V heads x 512,
# K = V) layers, window 1024, a 128-expert top-8 block beside a small dense MLP in every layer.
GEMMA4_SHAPES = {
    "26b-a4b": dict(hidden_size=2816, num_hidden_layers=30, num_attention_heads=16, num_key_value_heads=8,
                    head_dim=256, global_head_dim=512, num_global_key_value_heads=2, attention_k_eq_v=True,
                    intermediate_size=2112, enable_moe_block=True, num_experts=128, top_k_experts=8,
                    moe_intermediate_size=704, sliding_window=1024, hidden_size_per_layer_input=0,
                    final_logit_softcapping=30.0, eos_token_id=[1, 106]),
}


def gemma4_hf_config(shape: str, max_positions: int = 32768, num_layers: int | None = None):
    """`num_layers` cuts the stack (keeping the 5:1 pattern and a full last layer) for HF parity runs."""
    from transformers import Gemma4TextConfig

    s = dict(GEMMA4_SHAPES[shape])
    n = num_layers or s.pop("num_hidden_layers")
    s.pop("num_hidden_layers", None)
    layer_types = ["full_attention" if (i + 1) % 6 == 0 or i == n - 1 else "sliding_attention" for i in range(n)]
    cfg = Gemma4TextConfig(vocab_size=262144, num_hidden_layers=n, layer_types=layer_types,
                           max_position_embeddings=max_positions, **s)
    cfg.architectures = ["Gemma4ForCausalLM"]
    return cfg


def mimo_hf_config(max_positions: int = 32768, num_layers: int = 6, num_experts: int = 32):
    """MiMo-V2-Flash's real layer shapes (transformers' MiMoV2FlashConfig defaults: hidden 4096, Q/K heads
    of 192 and V of 128, sinks, window 128 + the query, 8-of-256 experts of 2048) cut to `num_layers`
    (the real pattern's first block: full, sliding..., full) and `num_experts` experts, one MTP layer
    declared, and Gemma's vocabulary so the carried Gemma tokenizer can serve it (random weights)."""
    from transformers import MiMoV2FlashConfig

    cfg = MiMoV2FlashConfig(num_hidden_layers=num_layers, n_routed_experts=num_experts, vocab_size=262144,
                            max_position_embeddings=max_positions, sliding_window=129, num_nextn_predict_layers=1)
    cfg.architectures = ["MiMoV2FlashForCausalLM"]
    return cfg


def hf_config(shape: str, max_positions: int = 32768):
    """`1b`, `4b`, ... (Gemma 3), `gemma4-26b-a4b` or `mimo-6l` (MiMo-V2-Flash, 6 layers, 32 experts)."""
    if shape.startswith("gemma4-"):
        return gemma4_hf_config(shape.removeprefix("gemma4-"), max_positions)
    if shape == "mimo-6l":
        return mimo_hf_config(max_positions)
    return gemma3_hf_config(shape, max_positions)


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
    """A LoadedModel of `shape` (see `hf_config`) with random weights (no tokenizer: prompts are token ids)."""
    from swaserve.config import ModelConfig
    from swaserve.loader import LoadedModel
    from swaserve.loader.dummy import init_dummy_weights
    from swaserve.runner.model_runner import build_model

    hf = hf_config(shape, max_positions)
    config = ModelConfig.from_hf(hf)
    model = build_model(config, dtype, device)
    init_dummy_weights(model, seed)
    name = shape if shape.startswith("gemma4-") else f"gemma3-{shape}"
    return LoadedModel(config, model, None, f"random-{name}")


def active_param_bytes(loaded, bs: int) -> int:
    """Weight bytes one decode step of `bs` tokens reads: every dense weight once, and of each MoE
    layer's experts only those some token routes to: E * (1 - (1 - k/E)^bs) of them in expectation
    for uniform routing (random weights route near-uniformly)."""
    total = param_bytes(loaded.model)
    hf = loaded.config.hf_config
    experts = [m for name, m in loaded.model.named_modules() if name.endswith(".experts")]
    if not experts or not getattr(hf, "num_experts", None):
        return total
    E, k = hf.num_experts, hf.top_k_experts
    hit = E * (1 - (1 - k / E) ** bs)
    expert_bytes = sum(p.numel() * p.element_size() for m in experts for p in m.parameters())
    return int(total - expert_bytes + expert_bytes * hit / E)


def param_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def decode_step_bytes(loaded, bs: int, ctx: int, kv_dtype: torch.dtype) -> int:
    """Fewest bytes one decode step must read: every weight once (the tied embedding counts once,
    as the LM head reads all of it; of MoE experts only the active ones) plus each request's K/V — full layers the whole context, SWA
    layers the last min(ctx, W) keys."""
    cfg = loaded.config
    kv = cfg.full_group.bytes_per_token(kv_dtype) * ctx
    if cfg.sliding_window:
        kv += cfg.swa_group.bytes_per_token(kv_dtype) * min(ctx, cfg.sliding_window)
    return active_param_bytes(loaded, bs) + bs * kv


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
