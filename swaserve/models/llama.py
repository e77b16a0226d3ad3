"""Llama and Qwen3: the plain pre-norm decoder; Qwen3 adds per-head RMSNorm on q and k."""

from __future__ import annotations

from typing import Any

from swaserve.models.base import CausalLM


class LlamaForCausalLM(CausalLM):
    """Everything is the shared skeleton: rotary (default / linear / llama3 / yarn), SiLU gated MLP,
    optional attention and MLP biases, tied or untied head. A `sliding_window` with `layer_types`
    (Qwen-style) is honoured through ModelConfig."""


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Llama plus q/k RMSNorm over head_dim, applied before rotary."""

    def attention_kwargs(self, layer_id: int) -> dict[str, Any]:
        return {**super().attention_kwargs(layer_id), "qk_norm": {"eps": self.hf_config.rms_norm_eps}}
