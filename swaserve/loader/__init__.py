"""Model loading: resolve what `model` names (embedded default, a GGUF file, an HF directory) and
return the config, the weights-loaded module and the tokenizer."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from swaserve.layers.fp8 import QUANTIZATIONS, with_online_fp8
from swaserve.model_config import ModelConfig

if TYPE_CHECKING:
    from torch import nn

    from swaserve.tokenizer import Tokenizer


@dataclass
class LoadedModel:
    config: ModelConfig
    model: nn.Module
    tokenizer: Tokenizer | None  # None for random-weight benchmark models: prompts are token ids
    name: str  # served model name


LOAD_FORMATS = ("auto", "dummy")


def load_hf_config(model: str | None) -> Any:
    """The transformers config of `model` (None: the embedded default), without loading weights."""
    from swaserve.loader.resolve import resolve_model

    resolved = resolve_model(model)
    if resolved.kind == "gguf":
        from swaserve.loader.gguf import load_gguf_config

        return load_gguf_config(Path(resolved.path))
    from swaserve.loader.hf_dir import load_hf_config as from_dir

    return from_dir(Path(resolved.path))


def load_model(model: str | None, device: torch.device, dtype: torch.dtype, max_context: int | None = None,
               load_format: str = "auto", quantization: str | None = None) -> LoadedModel:
    """`load_format="dummy"`: the model's shapes with random weights (`loader.dummy`); an HF
    directory then needs only config.json (and tokenizer files, for text prompts). `quantization="fp8"`:
    an unquantised checkpoint's projections and experts quantised to block FP8 as they load."""
    from swaserve.loader.resolve import resolve_model
    from swaserve.models.registry import build_model
    from swaserve.tokenizer import Tokenizer

    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {load_format!r}")
    if quantization not in (None, *QUANTIZATIONS):
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}")
    resolved = resolve_model(model)
    path = Path(resolved.path)
    if resolved.kind == "gguf":
        from swaserve.loader.gguf import iter_gguf_tensors, load_gguf_config

        hf_config = load_gguf_config(path)
        tokenizer = Tokenizer.from_gguf(path)
        weights = iter_gguf_tensors(path)
    else:
        from swaserve.loader.hf_dir import load_hf_config
        from swaserve.loader.safetensors import iter_safetensors

        hf_config = load_hf_config(path)
        has_tokenizer = any((path / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"))
        # No tokenizer files (e.g. a random-weight test checkpoint): prompts must be token ids.
        tokenizer = Tokenizer.from_hf_dir(path) if has_tokenizer else None
        weights = None  # read once the model is built: it may skip tensors (`keeps_weight`)
    if quantization == "fp8":
        with_online_fp8(hf_config)
    config = ModelConfig.from_hf(hf_config, max_context=max_context)
    module = build_model(config, dtype, device)
    if load_format == "dummy":
        from swaserve.distributed.state import tp_group
        from swaserve.loader.dummy import init_dummy_weights, whole_parameter_shapes

        init_dummy_weights(module, whole_shapes=whole_parameter_shapes(config) if tp_group().enabled else None)
    else:
        if weights is None:
            weights = iter_safetensors(path, keep=getattr(module, "keeps_weight", None))
        module.load_weights(weights)
    name = "gemma-3-270m" if model is None else (path.stem if resolved.kind == "gguf" else path.name)
    return LoadedModel(config, module, tokenizer, name)
