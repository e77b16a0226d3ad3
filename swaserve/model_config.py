"""The model's shape as the engine sees it (`ModelConfig`): which layers slide, their window, the K/V
shape of each pool's layers and which layers share K/V, read from a transformers config once, so the
model and the KV pools agree on layer ids by construction.
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

    def same_shape(self, other: KVGroup) -> bool:
        return (self.num_kv_heads, self.k_head_dim, self.v_head_dim) == (other.num_kv_heads, other.k_head_dim, other.v_head_dim)

    def describe(self) -> str:
        """e.g. '25 layers x 8 heads x (256 + 256)'"""
        return f"{self.num_layers} layers x {self.num_kv_heads} heads x ({self.k_head_dim} + {self.v_head_dim})"

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return self.num_layers * self.num_kv_heads * (self.k_head_dim + self.v_head_dim) * itemsize


@dataclass(frozen=True)
class ModelConfig:
    """What the engine needs to know about a model; the model classes read `hf_config` directly.

    Invariants: every layer id is in exactly one of `full_group.layer_ids` / `swa_group.layer_ids`,
    or is a KV-shared layer in `kv_source` (Gemma 4's tail layers: they read the K/V of an earlier
    layer of the same type, own no slots and never write); a source is never itself shared.
    `sliding_window` (W keys including the current one, HF convention) is set iff some layer slides.
    """

    architecture: str
    num_layers: int
    vocab_size: int
    max_context: int
    full_group: KVGroup
    swa_group: KVGroup
    sliding_window: int | None
    eos_token_ids: tuple[int, ...] = ()
    kv_source: tuple[tuple[int, int], ...] = ()  # (shared layer, layer whose K/V it reads)
    hf_config: Any = field(default=None, compare=False, repr=False)

    @property
    def is_hybrid(self) -> bool:
        return self.swa_group.num_layers > 0

    @property
    def kv_sources(self) -> dict[int, int]:
        return dict(self.kv_source)

    def kv_layer(self, layer_id: int) -> int:
        """The layer whose K/V `layer_id` reads and writes (itself unless it is KV-shared)."""
        return self.kv_sources.get(layer_id, layer_id)

    def is_sliding(self, layer_id: int) -> bool:
        return self.kv_layer(layer_id) in self.swa_group.layer_ids

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
        sources = _kv_sources(hf, layer_types)
        swa_ids = tuple(i for i, t in enumerate(layer_types) if t == SLIDING and i not in sources)
        full_ids = tuple(i for i, t in enumerate(layer_types) if t == FULL and i not in sources)
        if SLIDING in layer_types and not window:
            raise ValueError("config has sliding-attention layers but no sliding_window")
        eos = getattr(hf, "eos_token_id", None)
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        ctx = max_context or getattr(hf, "max_position_embeddings", None) or 8192
        return cls(
            architecture=arch,
            num_layers=n,
            vocab_size=hf.vocab_size,
            max_context=int(ctx),
            full_group=KVGroup(full_ids, *_kv_shape(hf, full_ids, FULL)),
            swa_group=KVGroup(swa_ids, *_kv_shape(hf, swa_ids, SLIDING)),
            sliding_window=int(window) if SLIDING in layer_types else None,
            eos_token_ids=eos_ids,
            kv_source=tuple(sorted(sources.items())),
            hf_config=hf,
        )


def layer_attention_shape(hf: Any, layer_id: int, layer_type: str) -> tuple[int, int]:
    """(head_dim, num_kv_heads) of one layer. Gemma 4's full layers are wider than its sliding ones:
    transformers >= 5 states that per layer (`per_layer_config`, and then forbids reading the global
    value); raw configs name the wide shape `global_head_dim` / `num_global_key_value_heads` (the
    latter only with `attention_k_eq_v`). MiMo-V2's sliding layers have twice the K/V heads of its
    full ones, a rule of its transformers model rather than a config field."""
    head_dim, kv_heads = _declared_attention_shape(hf, layer_id, layer_type)
    if layer_type == SLIDING and getattr(hf, "model_type", None) == "mimo_v2_flash":
        kv_heads *= 2  # transformers' MiMoV2FlashAttention doubles num_key_value_heads on sliding layers
    return head_dim, kv_heads


def _declared_attention_shape(hf: Any, layer_id: int, layer_type: str) -> tuple[int, int]:
    per_layer = getattr(hf, "per_layer_config", None)
    if per_layer is not None:
        layer = per_layer[layer_id]
        head_dim = getattr(layer, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        return int(head_dim), int(getattr(layer, "num_key_value_heads", None) or hf.num_attention_heads)
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    kv_heads = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
    if layer_type == FULL and getattr(hf, "global_head_dim", None):
        head_dim = hf.global_head_dim
        if getattr(hf, "attention_k_eq_v", False) and getattr(hf, "num_global_key_value_heads", None):
            kv_heads = hf.num_global_key_value_heads
    return int(head_dim), int(kv_heads)


def _kv_shape(hf: Any, layer_ids: tuple[int, ...], layer_type: str) -> tuple[int, int, int]:
    """(num_kv_heads, k_head_dim, v_head_dim) shared by every layer of one pool."""
    shapes = {layer_attention_shape(hf, i, layer_type) for i in layer_ids} or {layer_attention_shape(hf, 0, layer_type)}
    if len(shapes) > 1:
        raise ValueError(f"{layer_type} layers of one model must share a K/V shape, got (head_dim, kv_heads) {sorted(shapes)}")
    head_dim, kv_heads = shapes.pop()
    v_head_dim = getattr(hf, "v_head_dim", None) or head_dim  # MiMo-V2: V narrower than K (128 vs 192)
    return int(kv_heads), int(head_dim), int(v_head_dim)


def _kv_sources(hf: Any, layer_types: list[str]) -> dict[int, int]:
    """Gemma 4's `num_kv_shared_layers`: each of the last layers reads the K/V of the last earlier,
    non-shared layer of its own type."""
    shared = int(getattr(hf, "num_kv_shared_layers", 0) or 0)
    if shared <= 0:
        return {}
    n = len(layer_types)
    first = n - shared
    if first <= 0:
        raise ValueError(f"num_kv_shared_layers ({shared}) leaves no layer that computes its own K/V")
    sources = {}
    for i in range(first, n):
        owners = [j for j in range(first) if layer_types[j] == layer_types[i]]
        if not owners:
            raise ValueError(f"KV-shared layer {i} ({layer_types[i]}) has no earlier layer of its type to read from")
        sources[i] = owners[-1]
    return sources
