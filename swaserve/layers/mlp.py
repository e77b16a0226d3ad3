"""The gated MLP of dense decoder layers: down(act(gate(x)) * up(x))."""

from __future__ import annotations

import torch
from torch import nn

from swaserve.distributed.state import shard_size, tp_group
from swaserve.layers.activation import fused_activation_name, get_activation
from swaserve.layers.linear import MergedLinear, OutLinear


class GatedMLP(nn.Module):
    """gate and up projections run as one merged GEMM (`gate_up_proj`, shards 0 and 1). Tensor
    parallelism splits the intermediate size: column-parallel gate/up, row-parallel down."""

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str, bias: bool = False):
        super().__init__()
        local = shard_size(intermediate_size, "intermediate size")
        part = (tp_group().rank * local, intermediate_size)
        self.gate_up_proj = MergedLinear(hidden_size, [local, local], bias, [part, part])
        self.down_proj = OutLinear(local, hidden_size, bias=bias, shard=part)
        self.act = get_activation(activation)
        self.fused_act = fused_activation_name(activation)  # None: no fused kernel for it

    def forward(self, x: torch.Tensor, partial_sums: bool = False) -> torch.Tensor:
        """`[num_tokens, hidden]` -> `[num_tokens, hidden]`, or down_proj's split-K partial sums
        (`OutLinear`) when `partial_sums` and the batch is decode-sized."""
        if x.is_cuda and self.fused_act is not None:
            return self.down_proj(self._fused_gate_up_act(x), partial_sums)
        gate_up = self.gate_up_proj(x)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up, partial_sums)

    def _fused_gate_up_act(self, x: torch.Tensor) -> torch.Tensor:
        """`act(gate) * up` on CUDA: the library GEMM and one `act_and_mul` launch, or one skinny
        launch for decode-sized batches without bias where enabled (`skinny_gemm.use_skinny`)."""
        from swaserve.kernels.activation import act_and_mul
        from swaserve.kernels.skinny_gemm import skinny_gated_gemm, use_skinny

        assert self.fused_act is not None
        if self.gate_up_proj.bias is None and not self.gate_up_proj.batch_invariant and use_skinny(x):
            return skinny_gated_gemm(x if x.stride(1) == 1 else x.contiguous(), self.gate_up_proj.weight,
                                     self.fused_act)
        return act_and_mul(self.gate_up_proj(x), self.fused_act)
