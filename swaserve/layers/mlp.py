"""The gated MLP of dense decoder layers: down(act(gate(x)) * up(x))."""

from __future__ import annotations

import torch
from torch import nn

from swaserve.layers.activation import fused_activation_name, get_activation
from swaserve.layers.linear import MergedLinear


class GatedMLP(nn.Module):
    """gate and up projections run as one merged GEMM (`gate_up_proj`, shards 0 and 1)."""

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str, bias: bool = False):
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden_size, [intermediate_size, intermediate_size], bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.act = get_activation(activation)
        self.fused_act = fused_activation_name(activation)  # None: no fused kernel for it

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden]
        gate_up = self.gate_up_proj(x)
        if gate_up.is_cuda and self.fused_act is not None:
            from swaserve.kernels.activation import act_and_mul

            return self.down_proj(act_and_mul(gate_up, self.fused_act))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)
