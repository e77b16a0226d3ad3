"""Shared benchmark pieces: random-weight models in real Gemma 3, Gemma 4 and GPT-OSS shapes (and tiny ones for
`--smoke`), the measured copy bandwidth, the decode-step byte count that defines the roofline, and the
`--smoke` switch every script has: a tiny CPU run of its whole code path that CI runs
(tests/benchmarks/test_smoke.py), so a script that no longer runs fails there."""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import torch

SMOKE_HELP = ("a tiny CPU run of the whole script (tiny shapes and counts, Triton kernels in the "
              "interpreter): seconds; CI runs it so the script cannot rot silently. Its numbers mean nothing")

# A smoke run executes the Triton kernels on CPU tensors, i.e. in Triton's interpreter, which is chosen
# when a kernel is decorated: set it before any kernel module is imported (scripts import this module
# first). Under pytest the tests' conftest has already set it.
if "--smoke" in sys.argv[1:]:
    os.environ.setdefault("TRITON_INTERPRET", "1")

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
    # --smoke: both layer kinds (one full layer in six), a window short prompts cross, a vocabulary that
    # holds the token ids the serving benchmarks send (1000-20000).
    "tiny": dict(hidden_size=64, num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=1,
                 head_dim=32, intermediate_size=128, sliding_window=32, vocab_size=32768,
                 query_pre_attn_scalar=32),
}


# Gemma-4-26B-A4B's published text config: 5 sliding (8 K/V heads x 256) : 1 full (2 K/V heads x 512,
# K = V) layers, window 1024, a 128-expert top-8 block beside a small dense MLP in every layer.
GEMMA4_SHAPES = {
    "26b-a4b": dict(hidden_size=2816, num_hidden_layers=30, num_attention_heads=16, num_key_value_heads=8,
                    head_dim=256, global_head_dim=512, num_global_key_value_heads=2, attention_k_eq_v=True,
                    intermediate_size=2112, enable_moe_block=True, num_experts=128, top_k_experts=8,
                    moe_intermediate_size=704, sliding_window=1024, hidden_size_per_layer_input=0,
                    final_logit_softcapping=30.0, eos_token_id=[1, 106]),
    # --smoke: the same structure (5 sliding : 1 full, K = V full layers, experts beside a dense MLP), tiny.
    "tiny": dict(hidden_size=64, num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=1,
                 head_dim=32, global_head_dim=64, num_global_key_value_heads=1, attention_k_eq_v=True,
                 intermediate_size=64, enable_moe_block=True, num_experts=8, top_k_experts=2,
                 moe_intermediate_size=32, sliding_window=32, hidden_size_per_layer_input=0,
                 final_logit_softcapping=30.0, eos_token_id=[1, 106], vocab_size=32768),
}


def gemma4_hf_config(shape: str, max_positions: int = 32768, num_layers: int | None = None):
    """`num_layers` cuts the stack (keeping the 5:1 pattern and a full last layer) for HF parity runs."""
    from transformers import Gemma4TextConfig

    s = {"vocab_size": 262144, **GEMMA4_SHAPES[shape]}
    n = num_layers or s.pop("num_hidden_layers")
    s.pop("num_hidden_layers", None)
    layer_types = ["full_attention" if (i + 1) % 6 == 0 or i == n - 1 else "sliding_attention" for i in range(n)]
    cfg = Gemma4TextConfig(num_hidden_layers=n, layer_types=layer_types,
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


def mimo_full_hf_config(max_positions: int = 32768):
    """MiMo-V2-Flash as released (309B): transformers' MiMoV2FlashConfig defaults (48 layers, the first
    dense, 256 experts), 3 MTP layers declared, block-FP8 weights (e4m3, 128 x 128 scales, dynamic
    activations, every attention o_proj kept bf16 as the release does), and Gemma's vocabulary so the
    carried Gemma tokenizer can serve it (random weights: `--load-format dummy` draws them in FP8)."""
    from transformers import MiMoV2FlashConfig

    cfg = MiMoV2FlashConfig(vocab_size=262144, max_position_embeddings=max_positions, sliding_window=129,
                            num_nextn_predict_layers=3)
    cfg.quantization_config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                               "weight_block_size": [128, 128], "ignored_layers": ["model.layers.*.self_attn.o_proj"]}
    cfg.architectures = ["MiMoV2FlashForCausalLM"]
    return cfg


# openai/gpt-oss-20b and -120b as published: 2880 hidden, 64 query heads x 64 and 8 K/V heads with biases and
# sinks, sliding (128) and full layers alternating, YaRN (factor 32 over 4096, theta 150k), top-4 experts of
# intermediate 2880 with the SwiGLU clamp at 7, vocab 201088; MXFP4 experts, everything else bf16.
GPT_OSS_20B = dict(vocab_size=201088, hidden_size=2880, intermediate_size=2880, head_dim=64, num_attention_heads=64,
                   num_key_value_heads=8, num_hidden_layers=24, num_local_experts=32, num_experts_per_tok=4,
                   sliding_window=128, eos_token_id=200002, pad_token_id=199999)
GPT_OSS_SHAPES = {
    "20b": GPT_OSS_20B,
    "120b": {**GPT_OSS_20B, "num_hidden_layers": 36, "num_local_experts": 128},
    # --smoke: the same structure, tiny (dims multiples of 32, as MXFP4 needs).
    "tiny": {**GPT_OSS_20B, "vocab_size": 32768, "hidden_size": 64, "intermediate_size": 64, "head_dim": 16,
             "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 4, "num_local_experts": 8,
             "sliding_window": 32, "eos_token_id": None, "pad_token_id": None},
}
GPT_OSS_MXFP4 = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}


def gpt_oss_hf_config(shape: str, num_layers: int | None = None, mxfp4: bool = True):
    """`20b`, `120b` or `tiny`; `num_layers` cuts the stack (HF parity runs); `mxfp4=False`: bf16 experts.
    The published max_position_embeddings (131072 = 32 x 4096) stays: YaRN's scaling reads it."""
    from transformers import GptOssConfig

    s = dict(GPT_OSS_SHAPES[shape])
    n = num_layers or s.pop("num_hidden_layers")
    s.pop("num_hidden_layers", None)
    rope = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "truncate": False, "original_max_position_embeddings": 4096}
    cfg = GptOssConfig(num_hidden_layers=n, rope_parameters=rope, swiglu_limit=7.0, max_position_embeddings=131072,
                       layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)],
                       attention_bias=True, tie_word_embeddings=False, **s)
    if mxfp4:
        cfg.quantization_config = dict(GPT_OSS_MXFP4)
    cfg.architectures = ["GptOssForCausalLM"]
    return cfg


def hf_config(shape: str, max_positions: int = 32768):
    """`1b`, `4b`, ... (Gemma 3), `gemma4-26b-a4b`, `mimo-6l` (MiMo-V2-Flash, 6 layers, 32 experts, bf16),
    `mimo-v2-flash` (as released: 48 layers, 256 experts, FP8),
    `gpt-oss-20b` / `gpt-oss-120b` (MXFP4 experts) or `gpt-oss-20b-bf16` (bf16 experts); `tiny`,
    `gemma4-tiny` and `gpt-oss-tiny` for --smoke."""
    if shape.startswith("gpt-oss-"):
        size, _, fmt = shape.removeprefix("gpt-oss-").partition("-")
        if size not in GPT_OSS_SHAPES or fmt not in ("", "bf16"):
            raise ValueError(f"unknown GPT-OSS shape {shape!r}: gpt-oss-{{20b,120b,tiny}}[-bf16]")
        return gpt_oss_hf_config(size, mxfp4=fmt != "bf16")
    if shape.startswith("gemma4-"):
        return gemma4_hf_config(shape.removeprefix("gemma4-"), max_positions)
    if shape == "mimo-6l":
        return mimo_hf_config(max_positions)
    if shape == "mimo-v2-flash":
        return mimo_full_hf_config(max_positions)
    return gemma3_hf_config(shape, max_positions)


def gemma3_hf_config(shape: str, max_positions: int = 32768):
    from transformers import Gemma3TextConfig

    s = {"vocab_size": 262144, "query_pre_attn_scalar": 256, **GEMMA3_SHAPES[shape]}
    layer_types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(s["num_hidden_layers"])]
    cfg = Gemma3TextConfig(layer_types=layer_types, max_position_embeddings=max_positions, **s)
    cfg.architectures = ["Gemma3ForCausalLM"]
    return cfg


@torch.no_grad()
def random_model(shape: str, device: torch.device, dtype: torch.dtype, seed: int = 0, max_positions: int = 32768,
                 quantization: str | None = None):
    """A LoadedModel of `shape` (see `hf_config`) with random weights (no tokenizer: prompts are token ids).
    `quantization="fp8"`: online FP8 as `--quantization fp8 --load-format dummy` builds it, holding the
    same random weights as the unquantised model quantised."""
    from swaserve.layers.fp8 import with_online_fp8
    from swaserve.loader import LoadedModel
    from swaserve.loader.dummy import init_dummy_weights
    from swaserve.model_config import ModelConfig
    from swaserve.models.registry import build_model

    hf = hf_config(shape, max_positions)
    if quantization == "fp8":
        with_online_fp8(hf)
    elif quantization is not None:
        raise ValueError(f"quantization: None or 'fp8', got {quantization!r}")
    config = ModelConfig.from_hf(hf)
    model = build_model(config, dtype, device)
    init_dummy_weights(model, seed)
    name = shape if shape.startswith(("gemma4-", "gpt-oss-", "mimo-")) else f"gemma3-{shape}"
    return LoadedModel(config, model, None, f"random-{name}" + (f"-{quantization}" if quantization else ""))


def active_param_bytes(loaded, bs: int) -> int:
    """Weight bytes one decode step of `bs` tokens reads: every dense weight once (of an untied input
    embedding only the `bs` rows looked up; a tied one counts once, as the LM head reads it all), and of
    each MoE layer's experts only those some token routes to: E * (1 - (1 - k/E)^bs) of them in
    expectation for uniform routing (random weights route near-uniformly). Bytes as stored: MXFP4
    experts count their 4-bit codes and scales (plus their bf16 biases)."""
    total = param_bytes(loaded.model)
    head = getattr(loaded.model, "lm_head", None)
    if head is not None and not head.tied:  # an untied embedding table: only the batch's rows are read
        embed = loaded.model.model.embed_tokens.weight
        total -= (embed.shape[0] - min(bs, embed.shape[0])) * embed.shape[1] * embed.element_size()
    hf = loaded.config.hf_config
    experts = [m for name, m in loaded.model.named_modules() if name.endswith(".experts")]
    # Gemma 4: num_experts / top_k_experts; GPT-OSS: num_local_experts / num_experts_per_tok; MiMo: n_routed_experts.
    E = next((getattr(hf, a) for a in ("num_experts", "num_local_experts", "n_routed_experts")
              if getattr(hf, a, None)), None)
    k = next((getattr(hf, a) for a in ("top_k_experts", "num_experts_per_tok") if getattr(hf, a, None)), None)
    if not experts or not E or not k:
        return total
    hit = E * (1 - (1 - k / E) ** bs)
    expert_bytes = sum(p.numel() * p.element_size() for m in experts for p in m.parameters())
    return int(total - expert_bytes + expert_bytes * hit / E)


def param_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def decode_step_bytes(loaded, bs: int, ctx: int, kv_dtype: torch.dtype, swa_kv_dtype: torch.dtype | None = None) -> int:
    """Fewest bytes one decode step must read: the weights `active_param_bytes` counts plus each
    request's K/V — full layers the whole context, SWA layers the last min(ctx, W) keys — as stored
    (`swa_kv_dtype`: the SWA pool's, when it differs; FP8 pools 1 byte an element)."""
    cfg = loaded.config
    kv = cfg.full_group.bytes_per_token(kv_dtype) * ctx
    if cfg.sliding_window:
        kv += cfg.swa_group.bytes_per_token(swa_kv_dtype or kv_dtype) * min(ctx, cfg.sliding_window)
    return active_param_bytes(loaded, bs) + bs * kv


def graph_us(fn, calls: int, replays: int = 3) -> float:
    """Microseconds per call of fn(i), i in range(calls), timed over CUDA-graph replays (no launch
    overhead, as in decode): warmed up (and compiled) once outside the capture, median of 5. Without
    a GPU (--smoke: Triton's interpreter, nothing to compile) the calls run once each, timed by the
    host clock."""
    if not torch.cuda.is_available():
        t = time.perf_counter()
        for i in range(calls):
            fn(i)
        return (time.perf_counter() - t) * 1e6 / calls
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
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus written (on the CPU: a
    host memory copy of at most 64 MiB, the rough roofline a CPU run is measured against)."""
    if device.type != "cuda":
        src = torch.ones(min(nbytes, 64 << 20) // 2, dtype=torch.int16)
        dst = torch.empty_like(src)
        dst.copy_(src)
        times = []
        for _ in range(3):
            t = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t)
        return 2 * src.numel() * 2 / min(times)
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

    from swaserve.kernels.gemv import _ENABLED as gemv
    from swaserve.kernels.pdl import pdl_supported

    def env(name: str) -> str:
        return "on" if os.environ.get(name) == "1" else "off"

    blas = str(torch.backends.cuda.preferred_blas_library()).rsplit(".", 1)[-1] if torch.cuda.is_available() else "-"
    return (f"BLAS {blas}, skinny GEMMs {env('SWASERVE_SKINNY_GEMM')}, one-row GEMV {'on' if gemv else 'off'}, PDL {'on' if pdl_supported() else 'off'}"
            f" (env {env('SWASERVE_PDL')}, rows <= {os.environ.get('SWASERVE_PDL_MAX_ROWS', 'any')}), fused split combine"
            f" {env('SWASERVE_FUSED_SPLIT_COMBINE')}")


def new_compiles(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """Kernels compiled between two `swaserve.kernels.common.compiled_variants()` snapshots."""
    return {k: v - before.get(k, 0) for k, v in after.items() if v > before.get(k, 0)}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def now(device: torch.device) -> float:
    sync(device)
    return time.perf_counter()



# -- --smoke ------------------------------------------------------------------------------------------


def parse_args(ap: argparse.ArgumentParser, argv: list[str] | None = None,
               smoke: dict | None = None) -> argparse.Namespace:
    """`ap`'s arguments plus `--smoke`, whose run takes the `smoke` values as defaults (flags given on the
    command line still win); the namespace's `smoke` says which run this is."""
    ap.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    if smoke is not None and ap.parse_known_args(argv)[0].smoke:
        ap.set_defaults(**smoke)
    return ap.parse_args(argv)


def bench_device(smoke: bool = False) -> torch.device:
    """The CPU for a smoke run, else the GPU (or the CPU where there is none)."""
    return torch.device("cuda" if torch.cuda.is_available() and not smoke else "cpu")


def bench_dtype(device: torch.device) -> torch.dtype:
    """bf16 on a GPU, float32 on the CPU (its bf16 matmuls are slow and not what anyone serves there)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def empty_cache(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


class Span:
    """Milliseconds of one span of work: CUDA events on a GPU (the device's own clock, from the start
    record to the end record), the host clock elsewhere; `stop()` synchronizes."""

    def __init__(self, device: torch.device):
        self.device = device
        if device.type == "cuda":
            self._events = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self._events[0].record()
        else:
            self._t0 = time.perf_counter()

    def stop(self) -> float:
        if self.device.type == "cuda":
            self._events[1].record()
            self._events[1].synchronize()
            return self._events[0].elapsed_time(self._events[1])
        return (time.perf_counter() - self._t0) * 1e3


def write_model_dir(path: str | Path, hf, weights: bool = False, tokenizer: str | None = None) -> None:
    """An HF directory for the HF config `hf`: config.json (random weights come from `--load-format
    dummy`), with `weights` also transformers' own random init in bf16 safetensors (what HF loads too),
    and a tokenizer (what `swaserve serve` and text prompts need): "embedded" the embedded model's,
    "words" a word-level one over the config's whole vocabulary (`w<id>`; loads in milliseconds)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(path)
    if weights:
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(hf).to(torch.bfloat16).save_pretrained(path)
    if tokenizer == "embedded":
        from swaserve.tokenizer import Tokenizer

        carried = Path(__file__).resolve().parents[1] / ".gpu_assets" / "gemma_tok"
        if carried.is_dir():  # the GPU machine has no embedded checkpoint: its tokenizer travels (gpu_suite.sh)
            import shutil

            shutil.copytree(carried, path, dirs_exist_ok=True)
        else:
            Tokenizer.load(None).hf.save_pretrained(path)
    elif tokenizer == "words":
        from tokenizers import Tokenizer, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        special = {"pad_token": "<pad>", "eos_token": "<eos>", "bos_token": "<bos>", "unk_token": "<unk>"}
        vocab = {tok: i for i, tok in enumerate(special.values())}
        vocab |= {f"w{i}": i for i in range(len(vocab), hf.vocab_size)}
        words = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
        words.pre_tokenizer = pre_tokenizers.Whitespace()
        PreTrainedTokenizerFast(tokenizer_object=words, **special).save_pretrained(path)
    elif tokenizer is not None:
        raise ValueError(f"tokenizer: 'embedded', 'words' or None, got {tokenizer!r}")


def model_dir(shape: str, weights: bool = False, tokenizer: str | None = None,
              max_positions: int = 16384) -> str:
    """`write_model_dir` for `shape` (see `hf_config`) in the temp dir, written once per distinct config."""
    import hashlib
    import shutil
    import tempfile

    hf = hf_config(shape, max_positions=max_positions)
    key = hashlib.sha1(f"{hf.to_json_string()}{weights}{tokenizer}".encode()).hexdigest()[:10]
    path = Path(tempfile.gettempdir()) / f"swaserve-bench-{shape}-{key}"
    if not (path / "complete").exists():
        shutil.rmtree(path, ignore_errors=True)  # a run cut short before marking it complete
        tmp = Path(tempfile.mkdtemp(prefix=path.name + ".", dir=path.parent))  # complete or absent
        write_model_dir(tmp, hf, weights, tokenizer)
        (tmp / "complete").touch()
        try:
            tmp.rename(path)
        except OSError:  # another process wrote it first
            shutil.rmtree(tmp, ignore_errors=True)
    return str(path)
