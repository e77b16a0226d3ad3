"""Frozen configuration: the model's shape as the engine sees it, and the cache/scheduler knobs.

Sizes discovered at run time (pool sizes) live in `memory.planner.MemoryPlan`, not here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

SLIDING = "sliding_attention"
FULL = "full_attention"


@dataclass(frozen=True)
class KVGroup:
    """Shape of the K/V cached per token by one group of layers (all SWA layers, or all full ones)."""

    layer_ids: tuple[int, ...]  # global layer ids, in order
    num_kv_heads: int
    k_head_dim: int
    v_head_dim: int

    @property
    def num_layers(self) -> int:
        return len(self.layer_ids)

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return self.num_layers * self.num_kv_heads * (self.k_head_dim + self.v_head_dim) * itemsize


@dataclass(frozen=True)
class ModelConfig:
    """What the engine needs to know about a model; the model classes read `hf_config` directly.

    Invariant: every layer id is in exactly one of `full_group.layer_ids` / `swa_group.layer_ids`,
    and `sliding_window` (W keys including the current one, HF convention) is set iff the SWA group
    is non-empty.
    """

    architecture: str
    num_layers: int
    vocab_size: int
    max_context: int
    full_group: KVGroup
    swa_group: KVGroup
    sliding_window: int | None
    eos_token_ids: tuple[int, ...] = ()
    hf_config: Any = field(default=None, compare=False, repr=False)

    @property
    def is_hybrid(self) -> bool:
        return self.swa_group.num_layers > 0

    def is_sliding(self, layer_id: int) -> bool:
        return layer_id in self.swa_group.layer_ids

    @classmethod
    def from_hf(cls, hf: Any, max_context: int | None = None) -> ModelConfig:
        """Build from a transformers `PretrainedConfig` (text config for multimodal models)."""
        arch = (getattr(hf, "architectures", None) or [type(hf).__name__])[0]
        n = hf.num_hidden_layers
        window = getattr(hf, "sliding_window", None)
        layer_types = getattr(hf, "layer_types", None)
        if layer_types is None:
            layer_types = [SLIDING if window else FULL] * n
        layer_types = list(layer_types)[:n]
        if getattr(hf, "use_sliding_window", True) is False:  # Qwen-style switch
            layer_types = [FULL] * n
        unknown = set(layer_types) - {SLIDING, FULL}
        if unknown:
            raise ValueError(f"unsupported layer types {sorted(unknown)}; supported: {SLIDING}, {FULL}")
        swa_ids = tuple(i for i, t in enumerate(layer_types) if t == SLIDING)
        full_ids = tuple(i for i, t in enumerate(layer_types) if t == FULL)
        if swa_ids and not window:
            raise ValueError("config has sliding-attention layers but no sliding_window")
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        kv_heads = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
        v_head_dim = getattr(hf, "v_head_dim", None) or head_dim
        # Families whose SWA layers have their own K/V shape (Gemma 4, MiMo-V2) name them swa_*.
        swa_kv_heads = getattr(hf, "swa_num_key_value_heads", None) or kv_heads
        swa_head_dim = getattr(hf, "swa_head_dim", None) or head_dim
        swa_v_head_dim = getattr(hf, "swa_v_head_dim", None) or v_head_dim
        eos = getattr(hf, "eos_token_id", None)
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        ctx = max_context or getattr(hf, "max_position_embeddings", None) or 8192
        return cls(
            architecture=arch,
            num_layers=n,
            vocab_size=hf.vocab_size,
            max_context=int(ctx),
            full_group=KVGroup(full_ids, kv_heads, head_dim, v_head_dim),
            swa_group=KVGroup(swa_ids, swa_kv_heads, swa_head_dim, swa_v_head_dim),
            sliding_window=int(window) if swa_ids else None,
            eos_token_ids=eos_ids,
            hf_config=hf,
        )


@dataclass(frozen=True)
class CacheConfig:
    """How the KV memory is budgeted and split between the full and SWA pools."""

    kv_cache_bytes: int | None = None  # explicit budget; None: derived from device memory
    gpu_memory_fraction: float = 0.85  # of free GPU memory after weights, when kv_cache_bytes is None
    cpu_kv_cache_bytes: int = 512 << 20  # default budget on CPU
    dtype: torch.dtype | None = None  # KV dtype; None: the model dtype
    swa_full_tokens_ratio: float | None = None  # override the planner's SWA:full split
    disable_hybrid_swa: bool = False  # cache SWA layers in the full pool (comparisons)
    swa_evict_margin: int = 1  # positions kept beyond the window for steps in flight
    swa_evict_chunk: int = 64  # free out-of-window SWA slots in chunks of this many


@dataclass(frozen=True)
class SchedulerConfig:
    max_running_requests: int = 64
    max_prefill_tokens: int = 2048  # token budget of one extend step (chunked prefill size)
    max_context: int | None = None  # cap on prompt + output; None: the model's


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None
    max_body_bytes: int = 8 << 20


@dataclass(frozen=True)
class RunnerConfig:
    attention_backend: str | None = None  # None: triton on CUDA, torch_native elsewhere
    disable_cuda_graph: bool = False
    enable_cpu_graph: bool = False
    overlap_schedule: bool | None = None  # schedule step N+1 while N runs; None: on for CUDA


_OPTION_OWNERS = (CacheConfig, SchedulerConfig, RunnerConfig)


def split_engine_options(options: dict[str, Any]) -> tuple[CacheConfig, SchedulerConfig, RunnerConfig]:
    """Distribute flat `LLM(**engine_options)` keywords over the config dataclasses by field name."""
    from dataclasses import fields

    owned = {cls: {f.name for f in fields(cls)} for cls in _OPTION_OWNERS}
    valid = sorted(set().union(*owned.values()))
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ValueError(f"unknown engine option(s) {unknown}; valid options: {', '.join(valid)}")
    built = [cls(**{k: v for k, v in options.items() if k in owned[cls]}) for cls in _OPTION_OWNERS]
    cache, sched, runner = built
    if sched.max_running_requests < 1:
        raise ValueError("max_running_requests must be >= 1")
    if sched.max_prefill_tokens < 1:
        raise ValueError("max_prefill_tokens must be >= 1")
    if cache.swa_evict_chunk < 1 or cache.swa_evict_margin < 0:
        raise ValueError("swa_evict_chunk must be >= 1 and swa_evict_margin >= 0")
    return cache, sched, runner  # type: ignore[return-value]
