"""`moe_experts`: a token's top-k expert MLPs (Gemma 4 layout: stacked, output-major, no bias) weighted
and summed. CUDA runs the sorted grouped-GEMM kernels (`kernels.fused_moe`); other devices, and the
tests' oracle, run `moe_experts_reference`, a plain loop over the experts that got tokens."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from swaserve.layers.activation import get_activation

# Names as `kernels.activation.ACTS` spells them -> the HF activation computing the same function.
_REFERENCE_ACT = {"silu": "silu", "gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh"}


def moe_experts(
    x: torch.Tensor,  # [n, H]
    w_gate_up: torch.Tensor,  # [E, 2I, H], gate rows first
    w_down: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [n, k] float32
    topk_ids: torch.Tensor,  # [n, k] int
    activation: str,  # "silu", "gelu" or "gelu_tanh"
    row_valid: torch.Tensor | None = None,  # [n] bool: False rows (padded graph rows) route nothing, give 0
    batch_invariant: bool = False,  # deterministic mode: a token's result does not depend on the others
) -> torch.Tensor:  # [n, H], x's dtype
    if x.is_cuda:
        from swaserve.kernels.fused_moe import fused_moe

        return fused_moe(x, w_gate_up, w_down, topk_weights, topk_ids, activation, row_valid,
                         batch_invariant=batch_invariant)
    return moe_experts_reference(x, w_gate_up, w_down, topk_weights, topk_ids, activation, row_valid,
                                 batch_invariant)


def moe_experts_reference(
    x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor,
    topk_ids: torch.Tensor, activation: str, row_valid: torch.Tensor | None = None,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """Each expert's GEMMs in x's dtype as HF runs them (F.linear, then act(gate) * up); each pair's
    output times its weight in float32, summed over the k slots in order 0..k-1, cast at the end."""
    act = get_activation(_REFERENCE_ACT[activation])
    if batch_invariant:  # an expert's GEMM rows are the tokens routed to it: their count varies
        from swaserve.layers.batch_invariant import invariant_linear as linear
    else:
        linear = F.linear
    n, k = topk_ids.shape
    y = torch.zeros(n, k, x.shape[1], dtype=x.dtype, device=x.device)  # [n, k, H]
    ids = topk_ids.long()
    if row_valid is not None:
        ids = torch.where(row_valid[:, None], ids, -1)
    for e in torch.unique(ids[ids >= 0]).tolist():
        token, slot = torch.where(ids == e)
        gate, up = linear(x[token], w_gate_up[e]).chunk(2, dim=-1)
        y[token, slot] = linear(act(gate) * up, w_down[e])
    out = torch.zeros(n, x.shape[1], dtype=torch.float32, device=x.device)
    for j in range(k):  # slot order, as the fused combine sums
        out += topk_weights[:, j, None].float() * y[:, j].float()
    if row_valid is not None:
        out = torch.where(row_valid[:, None], out, 0.0)
    return out.to(x.dtype)
