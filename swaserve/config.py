"""The engine's options: frozen dataclasses per owner (cache, scheduler, server, runner, parallel,
speculative), each field declared once with its default and help (`_opt`), from which every CLI derives its
flags; `split_engine_options` routes keyword options to their owners. The model's shape is
`model_config.ModelConfig`; sizes discovered at run time (pool sizes) live in `memory.planner.MemoryPlan`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


def _opt(default: Any, help: str, **meta: Any) -> Any:
    """A config field that is also a command-line option (`swaserve.options` derives the flags)."""
    return field(default=default, metadata={"help": help, **meta})


KV_CACHE_DTYPES = ("auto", "fp8_e4m3")


@dataclass(frozen=True)
class CacheConfig:
    """How the KV memory is budgeted and split between the full and SWA pools."""

    kv_cache_bytes: int | None = _opt(
        None, "KV cache budget in MiB (default: 512 on CPU, --gpu-memory-fraction of free GPU memory)",
        flag="kv-cache-mb", scale=1 << 20)
    gpu_memory_fraction: float = _opt(0.85, "fraction of free GPU memory after the weights given to the KV cache")
    cpu_kv_cache_bytes: int = _opt(512 << 20, "KV budget on CPU when --kv-cache-mb is not given", cli=False)
    dtype: torch.dtype | None = _opt(None, "KV dtype (default: the model dtype)", cli=False)
    kv_cache_dtype: str = _opt(
        "auto", "K/V storage: auto (the model dtype) or fp8_e4m3 (float8 e4m3 with a float32 scale per layer: "
        "the checkpoint's k_scale/v_scale, else 1.0; half the bytes of bf16, about twice the KV tokens, lossy); "
        "applies to every pool, the sliding-window pool too unless --swa-kv-cache-dtype says otherwise",
        choices=KV_CACHE_DTYPES)
    swa_kv_cache_dtype: str | None = _opt(
        None, "K/V storage of the hybrid sliding-window pool: auto (the model dtype, e.g. to keep the sliding "
        "layers exact when long requests make that pool a small share of the KV bytes) or fp8_e4m3 "
        "(default: --kv-cache-dtype's)", choices=KV_CACHE_DTYPES)
    plan_request_tokens: int | None = _opt(
        None, "request length (prompt + output tokens) the full:SWA pool split is sized for: requests of this "
        "length fill both pools together, shorter ones the SWA pool first (default: min(max context, 4096))")
    swa_full_tokens_ratio: float | None = _opt(None, "override the planner's SWA:full pool token ratio")
    disable_hybrid_swa: bool = _opt(False, "cache sliding-window layers in the full pool (comparisons)")
    swa_evict_margin: int = _opt(1, "positions kept beyond the window for steps in flight")
    swa_evict_chunk: int = _opt(64, "free out-of-window SWA slots in chunks of this many")
    disable_prefix_cache: bool = _opt(False, "do not reuse the K/V of shared prompt prefixes across requests")

    def kv_dtypes(self, model_dtype: torch.dtype) -> tuple[torch.dtype, torch.dtype]:
        """(full pool, hybrid SWA pool) storage dtypes. Without a hybrid SWA pool every layer is
        cached at the first (`swa_kv_cache_dtype` is refused there)."""
        if self.dtype is not None:
            return self.dtype, self.dtype

        def pick(name: str) -> torch.dtype:
            return torch.float8_e4m3fn if name == "fp8_e4m3" else model_dtype

        return pick(self.kv_cache_dtype), pick(self.swa_kv_cache_dtype or self.kv_cache_dtype)


SCHEDULE_POLICIES = ("mixed", "prefill_first")


@dataclass(frozen=True)
class SchedulerConfig:
    max_running_requests: int | None = _opt(
        None, "requests decoded at once (default: on CUDA as many 512-token requests as the KV pools hold, at "
        "most 1024 / 512 / 256 on GPUs of 70+ / 35+ / fewer GiB; 64 on CPU)")
    max_prefill_tokens: int | None = _opt(
        None, "token budget of one step: prefill chunk size (mixed: decodes included) (default: 8192 / 4096 / 2048 "
        "on GPUs of 70+ / 35+ / fewer GiB; 2048 on CPU)")
    max_mixed_prefill_tokens: int | None = _opt(
        None, "mixed: prefill tokens a step may carry while requests decode (default: the rest of the step budget); "
        "smaller keeps streams' inter-token latency low while prompts arrive, larger prefills them sooner")
    max_context: int | None = _opt(None, "max prompt + output tokens (default: the model's; 4096 on CPU)")
    schedule_policy: str = _opt(
        "mixed", "mixed: every step decodes all running requests and prefills under the rest of the budget; "
        "prefill_first: a step prefills (no decode) while prompts wait", choices=SCHEDULE_POLICIES)


@dataclass(frozen=True)
class ServerConfig:
    """The HTTP frontend's settings (every entry point takes the same flags, `swaserve.options`)."""

    host: str = _opt("127.0.0.1", "address to bind (127.0.0.1: local only)")
    port: int = _opt(8000, "port (0: any free port)")
    api_key: str | None = _opt(None, "require `Authorization: Bearer KEY` on /v1 routes (default: $SWASERVE_API_KEY)",
                               env="SWASERVE_API_KEY")
    served_model_name: str | None = _opt(None, "model name clients must use (default: the model's)")
    max_body_bytes: int = _opt(8 << 20, "larger request bodies get a 413")
    graceful_timeout: float = _opt(10.0, "seconds in-flight requests get to finish on SIGTERM/SIGINT")
    log_level: str = _opt("warning", "server log level", choices=("debug", "info", "warning", "error"))
    access_log: bool = _opt(False, "log every request")
    stream_interval: int = _opt(1, "tokens per SSE chunk (larger: fewer, bigger chunks; the last is sent at once)")
    chat_template: str | None = _opt(None, "Jinja chat template FILE for models without one (or `gemma`: the "
                                     "built-in Gemma turn format); chat without a template is an error")
    separate_reasoning: bool = _opt(
        True, "chat replies of models with a reasoning format (GPT-OSS: harmony's analysis channel; Gemma 4 and "
        "MiMo-V2 thinking blocks) put it in "
        "`reasoning_content` and the answer in `content`; --no-separate-reasoning leaves the reply as written, "
        "markers included, in `content` (a request's `separate_reasoning` overrides)")
    api_server_count: int = _opt(1, "HTTP frontend processes sharing the port, each tokenizing, detokenizing and "
                                 "streaming its own requests (more than one when one frontend's CPU is the limit)")
    data_parallel_size: int = _opt(1, "independent engine replicas (one engine-core process each; on CUDA replica i "
                                   "runs on the i-th GPU); a new request goes to the one with the fewest in flight")


@dataclass(frozen=True)
class RunnerConfig:
    load_format: str = _opt("auto", "weights: auto (from the model files) or dummy (random weights in the model's "
                            "shapes, for benchmarks; an HF directory then needs only config.json)",
                            choices=("auto", "dummy"))
    quantization: str | None = _opt(
        None, "quantise an unquantised (bf16/fp16/fp32) checkpoint's weights at load: fp8 = e4m3 with a float32 scale "
        "per 128x128 block for every attention/MLP projection and expert (LM head and embeddings stay as stored); "
        "checkpoints that are already quantised are refused", choices=("fp8",))
    attention_backend: str | None = _opt(None, "attention backend (default: triton on CUDA, torch_native elsewhere)",
                                         choices=("triton", "torch_native"))
    disable_cuda_graph: bool = _opt(False, "run decode eagerly on the GPU")
    enable_piecewise_cuda_graph: bool | None = _opt(
        None, "capture prefill chunks and mixed steps of up to 2048 tokens as CUDA graphs in pieces between "
        "attention calls (default: on where decode runs in CUDA graphs); --no-enable-piecewise-cuda-graph runs "
        "them eagerly", aliases=("--disable-piecewise-cuda-graph",))
    extend_graph: str = _opt(
        "auto", "how those extend steps are captured: whole (one graph per step, attention included: the Triton "
        "backend's unified kernel on a grid fixed by the token count, its work list built on the device), pieces "
        "(graphs cut at every attention call, attention run eagerly between them), or auto (whole where the "
        "attention backend can be captured so, else pieces)", choices=("auto", "whole", "pieces"))
    enable_cpu_graph: bool = _opt(False, "torch.compile the CPU decode step (~1.2x faster steps, ~100 s longer start)")
    overlap_schedule: bool | None = _opt(
        None, "schedule step N+1 while N runs (default: on for CUDA); --no-overlap-schedule waits for each step",
        aliases=("--disable-overlap-schedule",))
    enable_deterministic_inference: bool = _opt(
        False, "batch-invariant kernels: a request gets the same tokens alone or in any batch (costs some speed)")
    grammar_cache_size: int = _opt(
        128, "compiled grammars kept for structured outputs and forced tool calls (least recently used go first)")
    grammar_threads: int | None = _opt(
        None, "most threads filling structured outputs' token masks each step, one per 64 constrained rows "
        "(default: a quarter of this process's CPUs, at most 8)")


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism: one process per rank, each with its shard of the model and its own pools
    (expert parallelism: the MoE layers' shard is a run of whole experts)."""

    tensor_parallel_size: int = _opt(1, "ranks (devices) the model is split over: attention heads, MLP and "
                                     "expert widths, vocabulary", alt_flags=("--tp",))
    enable_expert_parallel: bool = _opt(
        False, "MoE models under --tp N: each rank holds 1/N of the routed experts whole instead of 1/N of every "
        "expert's width (attention stays tensor-parallel); each rank runs the tokens routed to its experts and "
        "the MoE's all-reduce sums the ranks")
    nnodes: int = _opt(1, "nodes the tensor-parallel ranks span (ranks split evenly)")
    node_rank: int = _opt(0, "this node's index (0 runs the engine and the server; others only ranks)")
    dist_init_addr: str | None = _opt(None, "HOST:PORT of node 0 for torch.distributed's rendezvous "
                                      "(default: a free local port; needed with --nnodes > 1)")
    disable_custom_all_reduce: bool = _opt(
        False, "send every all-reduce through NCCL (default on GPUs: messages up to 2 MiB go one-shot over "
        "peer memory, summed in rank order; distributed/one_shot.py)")


SPECULATIVE_METHODS = ("ngram", "draft", "eagle3", "mtp")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: a drafter proposes tokens, the target checks them in one forward."""

    speculative_method: str | None = _opt(
        None, "drafter: ngram (lookup in the request's own tokens), draft (a smaller model with the same "
        "tokenizer), eagle3 (an EAGLE-3 head over three target layers) or mtp (a multi-token-prediction "
        "drafter: Gemma 4's assistant, which reads the target's KV cache, or MiMo-V2-Flash's own MTP layer); "
        "default: off",
        choices=SPECULATIVE_METHODS)
    speculative_num_tokens: int = _opt(4, "tokens drafted per request per step (K)")
    speculative_draft_model: str | None = _opt(
        None, "draft model for --speculative-method draft (GGUF file or HF directory; default: the embedded "
        "model), eagle3 (the EAGLE-3 head's HF directory) or mtp (the assistant's HF directory; none for "
        "MiMo-V2-Flash, whose checkpoint holds its MTP layers)")
    speculative_ngram_max: int = _opt(4, "longest suffix n-gram the ngram drafter looks up")
    speculative_ngram_min: int = _opt(1, "shortest suffix n-gram the ngram drafter looks up")
    speculative_max_batch_size: int = _opt(
        32, "speculate only in steps with at most this many decoding requests (larger batches are compute-bound)")

    @property
    def verify_shape(self) -> tuple[int, int]:
        """(largest batch, tokens per request) of the verify steps (their CUDA graphs)."""
        return self.speculative_max_batch_size, self.speculative_num_tokens + 1

    @property
    def reads_target_vocab(self) -> bool:
        """The drafter looks tokens up in the target's embedding (and LM head): EAGLE-3 and MiMo's MTP.
        Under tensor parallelism rank 0 gathers whole copies of them for it."""
        return self.speculative_method == "eagle3" or (
            self.speculative_method == "mtp" and self.speculative_draft_model is None)


ENGINE_OPTION_OWNERS = (CacheConfig, SchedulerConfig, RunnerConfig, ParallelConfig, SpeculativeConfig)


def split_engine_options(
    options: dict[str, Any],
) -> tuple[CacheConfig, SchedulerConfig, RunnerConfig, ParallelConfig, SpeculativeConfig]:
    """Distribute flat `LLM(**engine_options)` keywords over the config dataclasses by field name."""
    from dataclasses import fields

    owned = {cls: {f.name for f in fields(cls)} for cls in ENGINE_OPTION_OWNERS}
    valid = sorted(set().union(*owned.values()))
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ValueError(f"unknown engine option(s) {unknown}; valid options: {', '.join(valid)}")
    built = [cls(**{k: v for k, v in options.items() if k in owned[cls]}) for cls in ENGINE_OPTION_OWNERS]
    cache, sched, runner, par, spec = built
    if sched.max_running_requests is not None and sched.max_running_requests < 1:
        raise ValueError("max_running_requests must be >= 1")
    if sched.max_prefill_tokens is not None and sched.max_prefill_tokens < 1:
        raise ValueError("max_prefill_tokens must be >= 1")
    if cache.plan_request_tokens is not None and cache.plan_request_tokens < 1:
        raise ValueError("plan_request_tokens must be >= 1")
    if sched.max_mixed_prefill_tokens is not None and sched.max_mixed_prefill_tokens < 1:
        raise ValueError("max_mixed_prefill_tokens must be >= 1")
    if sched.schedule_policy not in SCHEDULE_POLICIES:
        raise ValueError(f"schedule_policy must be one of {', '.join(SCHEDULE_POLICIES)}, got {sched.schedule_policy!r}")
    if runner.grammar_threads is not None and runner.grammar_threads < 1:
        raise ValueError("grammar_threads must be >= 1")
    check_kv_cache_dtypes(cache)
    if cache.swa_evict_chunk < 1 or cache.swa_evict_margin < 0:
        raise ValueError("swa_evict_chunk must be >= 1 and swa_evict_margin >= 0")
    if par.tensor_parallel_size < 1 or par.nnodes < 1 or not 0 <= par.node_rank < par.nnodes:
        raise ValueError("tensor_parallel_size and nnodes must be >= 1 and node_rank in [0, nnodes)")
    if par.enable_expert_parallel and par.tensor_parallel_size == 1:
        raise ValueError("enable_expert_parallel splits the experts over the tensor-parallel ranks: it needs "
                         "tensor_parallel_size > 1")
    if par.tensor_parallel_size % par.nnodes:
        raise ValueError(f"nnodes {par.nnodes} must divide tensor_parallel_size {par.tensor_parallel_size}")
    if par.nnodes > 1 and not par.dist_init_addr:
        raise ValueError("nnodes > 1 needs dist_init_addr (HOST:PORT of node 0)")
    if spec.speculative_method is not None and spec.speculative_method not in SPECULATIVE_METHODS:
        raise ValueError(f"speculative_method must be one of {', '.join(SPECULATIVE_METHODS)}, "
                         f"got {spec.speculative_method!r}")
    if spec.speculative_num_tokens < 1 or spec.speculative_max_batch_size < 1:
        raise ValueError("speculative_num_tokens and speculative_max_batch_size must be >= 1")
    if not 1 <= spec.speculative_ngram_min <= spec.speculative_ngram_max:
        raise ValueError("need 1 <= speculative_ngram_min <= speculative_ngram_max")
    return cache, sched, runner, par, spec  # type: ignore[return-value]


def check_kv_cache_dtypes(cache: CacheConfig) -> None:
    """Bad `kv_cache_dtype` / `swa_kv_cache_dtype` values and combinations that cannot work: ValueError."""
    for name in ("kv_cache_dtype", "swa_kv_cache_dtype"):
        value = getattr(cache, name)
        if value is not None and value not in KV_CACHE_DTYPES:
            raise ValueError(f"{name} must be one of {', '.join(KV_CACHE_DTYPES)}, got {value!r}")
    if cache.dtype is not None and (cache.kv_cache_dtype != "auto" or cache.swa_kv_cache_dtype is not None):
        raise ValueError("give the KV dtype once: CacheConfig.dtype or kv_cache_dtype / swa_kv_cache_dtype, not both")
    if cache.swa_kv_cache_dtype is not None and cache.disable_hybrid_swa:
        raise ValueError("swa_kv_cache_dtype sets the sliding-window pool's dtype, and disable_hybrid_swa caches every "
                         "layer in the full pool: use kv_cache_dtype")
