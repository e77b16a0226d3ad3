"""HF architecture name -> model class, imported lazily so only the family in use is loaded, and
`build_model`, which instantiates that class without initialising its weights."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from swaserve.model_config import ModelConfig

_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("swaserve.models.llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("swaserve.models.llama", "Qwen3ForCausalLM"),
    "MistralForCausalLM": ("swaserve.models.mistral", "MistralForCausalLM"),
    "Gemma2ForCausalLM": ("swaserve.models.gemma2", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("swaserve.models.gemma3", "Gemma3ForCausalLM"),
    # Text-only use of a multimodal checkpoint: the vision weights are skipped.
    "Gemma3ForConditionalGeneration": ("swaserve.models.gemma3", "Gemma3ForCausalLM"),
    "Gemma4ForCausalLM": ("swaserve.models.gemma4", "Gemma4ForCausalLM"),
    "Gemma4ForConditionalGeneration": ("swaserve.models.gemma4", "Gemma4ForCausalLM"),
    "GptOssForCausalLM": ("swaserve.models.gpt_oss", "GptOssForCausalLM"),
    "MiMoV2FlashForCausalLM": ("swaserve.models.mimo_v2_flash", "MiMoV2FlashForCausalLM"),
}

# For configs that carry no `architectures` (built in code, or by the GGUF loader).
_BY_MODEL_TYPE: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gemma3": "Gemma3ForConditionalGeneration",
    "gemma4_text": "Gemma4ForCausalLM",
    "gemma4": "Gemma4ForConditionalGeneration",
    "gpt_oss": "GptOssForCausalLM",
    "mimo_v2_flash": "MiMoV2FlashForCausalLM",
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(architecture: str, model_type: str | None = None) -> type[nn.Module]:
    """The class for HF `architecture`, falling back to the config's `model_type`."""
    if architecture not in _MODELS and model_type in _BY_MODEL_TYPE:
        architecture = _BY_MODEL_TYPE[model_type]
    if architecture not in _MODELS:
        raise ValueError(
            f"unsupported model architecture {architecture!r}; supported: {', '.join(supported_architectures())}"
        )
    module, name = _MODELS[architecture]
    return getattr(importlib.import_module(module), name)


def build_model(model_config: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> nn.Module:
    """The registry class for `model_config`, with uninitialised weights of `dtype` on `device`.

    Built on the meta device first so no time goes into random init that `load_weights` overwrites
    (rotary tables are computed explicitly on the CPU and survive this).
    """
    hf = model_config.hf_config
    if hf is None:
        raise ValueError("ModelConfig has no hf_config; build it with ModelConfig.from_hf")
    cls = get_model_class(model_config.architecture, getattr(hf, "model_type", None))
    with torch.device("meta"):
        model = cls(hf)
    return model.to(dtype=dtype).to_empty(device=torch.device(device)).eval()
