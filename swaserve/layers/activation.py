"""Activation functions by HF name and the tanh soft-cap (GPT-OSS's clamped SwiGLU: `layers.fused_moe`)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,  # exact (erf)
    "gelu_pytorch_tanh": _gelu_tanh,
    "gelu_new": _gelu_tanh,
    "gelu_fast": _gelu_tanh,
    "relu": F.relu,
}


# HF activation name -> the name `kernels.activation.act_and_mul` computes it under.
_FUSED = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh",
          "gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh"}


def fused_activation_name(name: str) -> str | None:
    """The fused act-and-mul kernel's name for HF activation `name`; None if it has none."""
    return _FUSED.get(name)


def get_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The elementwise activation HF calls `name` (config `hidden_act` / `hidden_activation`)."""
    if name not in _ACTIVATIONS:
        raise ValueError(f"unsupported activation {name!r}; supported: {sorted(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


def soft_cap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """`cap * tanh(x / cap)`: squashes logits into (-cap, cap) (Gemma 2 attention and final logits)."""
    return x if cap is None else cap * torch.tanh(x / cap)
