"""The gated MLP of dense decoder layers: down(act(gate(x)) * up(x))."""

from __future__ import annotations

import torch
from torch import nn

from swaserve.layers.activation import get_activation
from swaserve.layers.linear import MergedLinear


class GatedMLP(nn.Module):
    """gate and up projections run as one merged GEMM (`gate_up_proj`, shards 0 and 1)."""

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str, bias: bool = False):
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden_size, [intermediate_size, intermediate_size], bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.act = get_activation(activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden]
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)
