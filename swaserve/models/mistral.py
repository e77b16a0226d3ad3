"""Mistral: Llama with a sliding window on every layer when the config sets `sliding_window`."""

from __future__ import annotations

from swaserve.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    """No code of its own: ModelConfig.from_hf marks every layer sliding when `sliding_window` is
    set and the config has no `layer_types`, which is what HF Mistral does."""
