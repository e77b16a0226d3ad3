"""Deterministic-inference mode for the layers: `invariant_linear` (a GEMM whose rows do not depend on
the batch) and `make_batch_invariant(model)`, which switches every GEMM of a model over to it.

Measured on CPU (MKL/oneDNN, torch 2.13): a row of `F.linear` changes bitwise with M in float32
(gemv at M=1, other kernels for 2-15 and >= 16 rows) and in bf16 from 64 rows on; fixed 32-row
blocks (zero-padded) give every row the same kernel and order. On CUDA `kernels.bi_matmul` does it.
Per-row RMSNorm, softmax and log-softmax are already per-row on both devices (kernels/norm.py: one
program per row; ATen CPU: serial per row below 32k columns).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

CPU_ROW_BLOCK = 32  # rows per CPU GEMM call: every call has the same shape


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """`x @ weight.T + bias` (`x` [..., K], `weight` [N, K]) with each row reduced the same way
    whatever else is in `x`: one Triton tiling on CUDA, fixed zero-padded row blocks on CPU."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x.is_cuda:
        from swaserve.kernels.bi_matmul import bi_linear

        y = bi_linear(x2 if x2.stride(1) == 1 else x2.contiguous(), weight, bias, out_dtype=out_dtype)
    else:
        y = _cpu_blocked(x2, weight, bias)
        if out_dtype is not None:
            y = y.to(out_dtype)
    return y.reshape(*lead, weight.shape[0])


def _cpu_blocked(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    m = x.shape[0]
    pad = (-m) % CPU_ROW_BLOCK
    if pad:
        x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
    blocks = [F.linear(x[i: i + CPU_ROW_BLOCK], weight, bias) for i in range(0, x.shape[0], CPU_ROW_BLOCK)]
    return torch.cat(blocks)[:m]


class InvariantLinear(nn.Linear):
    """An `nn.Linear` whose forward is `invariant_linear` (same parameters, same state-dict names);
    `make_batch_invariant` retypes a model's plain linears to it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return invariant_linear(x, self.weight, self.bias)


def make_batch_invariant(model: nn.Module) -> nn.Module:
    """Switch `model` into deterministic mode in place: layers with a `batch_invariant` switch
    (merged/output projections, the LM head, MoE experts and routers) turn it on; plain `nn.Linear`s
    become `InvariantLinear`s. The per-model switch (not a process-wide one) keeps another engine in
    the same process on its default kernels."""
    for module in model.modules():
        if hasattr(module, "batch_invariant"):
            module.batch_invariant = True
        elif type(module) is nn.Linear:
            module.__class__ = InvariantLinear  # only forward differs: parameters stay as loaded
    return model
