"""Load a model from a local HF directory (config.json + safetensors shards) into a swaserve model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from swaserve.loader.safetensors import iter_safetensors, safetensors_files
from swaserve.model_config import ModelConfig


def load_hf_config(path: str | Path) -> Any:
    """The transformers config of `path` (local files only); for a multimodal model, its text config
    (keeping the outer `architectures`, so the registry can pick the text-only class)."""
    from transformers import AutoConfig

    root = Path(path)
    if not (root / "config.json").is_file():
        raise FileNotFoundError(f"expected an HF model directory with config.json at {root}")
    config = AutoConfig.from_pretrained(str(root), local_files_only=True)
    if getattr(config, "text_config", None) is not None:
        text = config.get_text_config()
        if text is not config:
            text.architectures = list(getattr(config, "architectures", None) or []) or None
            text.torch_dtype_hint = getattr(config, "dtype", None)
            return text
    return config


def _config_dtype(hf: Any) -> torch.dtype:
    dtype = getattr(hf, "torch_dtype_hint", None) or getattr(hf, "dtype", None) or getattr(hf, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32


def load_model_from_dir(
    path: str | Path,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    max_context: int | None = None,
) -> tuple[ModelConfig, nn.Module]:
    """Build the model for the HF directory `path` and load its safetensors weights.

    `dtype` None: the checkpoint's dtype from config.json (float32 if it names none).
    """
    from swaserve.models.registry import build_model

    hf = load_hf_config(path)
    if not safetensors_files(path):
        raise FileNotFoundError(f"no *.safetensors weights in {path} (config.json found)")
    model_config = ModelConfig.from_hf(hf, max_context=max_context)
    model = build_model(model_config, dtype or _config_dtype(hf), device)
    model.load_weights(iter_safetensors(path))
    return model_config, model
