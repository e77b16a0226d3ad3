"""`moe_experts`: a token's top-k expert MLPs (stacked, output-major, gate rows first; dense, MXFP4 or
block FP8, optional per-expert biases) weighted and summed. CUDA runs the sorted grouped-GEMM kernels
(`kernels.fused_moe`); other devices, and the tests' oracle, run `moe_experts_reference`, a plain loop
over the experts that got tokens (quantised experts dequantised at use, one expert at a time). Under
expert parallelism the weights hold a run of the experts (`expert_start`); slots routed to other
ranks' experts add nothing, and the MoE layer's all-reduce sums the ranks."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from swaserve.layers import fp8, mxfp4
from swaserve.layers.activation import get_activation

# Names as `kernels.moe_gemm.MOE_ACTS` spells them -> the HF activation computing the same function.
_REFERENCE_ACT = {"silu": "silu", "gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh"}


def moe_experts(
    x: torch.Tensor,  # [n, H]
    w_gate_up: torch.Tensor,  # [E, 2I, H], gate rows first (dense or e4m3); MXFP4: [E, 2I, H/32, 16] uint8
    w_down: torch.Tensor,  # [E, H, I] (dense or e4m3); MXFP4: [E, H, I/32, 16] uint8 codes
    topk_weights: torch.Tensor,  # [n, k] float
    topk_ids: torch.Tensor,  # [n, k] int
    activation: str,  # "silu", "gelu", "gelu_tanh" or "swiglu_oai" (GPT-OSS, with alpha and limit)
    row_valid: torch.Tensor | None = None,  # [n] bool: False rows (padded graph rows) route nothing, give 0
    batch_invariant: bool = False,  # deterministic mode: a token's result does not depend on the others
    **extra: torch.Tensor | float | None,  # gate_up_scales, down_scales, gate_up_bias, down_bias, alpha, limit;
    # FP8: gate_up_scale_rows, act_fp8 (the kernels' activation mode; the reference is weight-only);
    # expert_start (expert parallelism: ids are global, the weights hold experts expert_start + 0..E-1)
) -> torch.Tensor:  # [n, H], x's dtype
    if x.is_cuda:
        from swaserve.kernels.fused_moe import fused_moe

        return fused_moe(x, w_gate_up, w_down, topk_weights, topk_ids, activation, row_valid,
                         batch_invariant=batch_invariant, **extra)
    return moe_experts_reference(x, w_gate_up, w_down, topk_weights, topk_ids, activation, row_valid,
                                 batch_invariant, **extra)


def moe_experts_reference(
    x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor,
    topk_ids: torch.Tensor, activation: str, row_valid: torch.Tensor | None = None,
    batch_invariant: bool = False, *,
    gate_up_scales: torch.Tensor | None = None,  # [E, 2I, H/32] uint8 (MXFP4); FP8: [E, ceil(2I/sr), ceil(H/128)] fp32
    down_scales: torch.Tensor | None = None,  # [E, H, I/32] uint8 (MXFP4); FP8: [E, ceil(H/128), ceil(I/128)] fp32
    gate_up_bias: torch.Tensor | None = None,  # [E, 2I], gate first
    down_bias: torch.Tensor | None = None,  # [E, H]
    alpha: float | None = None,
    limit: float | None = None,
    gate_up_scale_rows: int = fp8.BLOCK,  # FP8: w_gate_up rows per scale
    act_fp8: bool | None = None,  # the kernels' FP8 activation mode: the reference dequantises weights only
    expert_start: int | None = None,  # expert parallelism: w_* hold global experts expert_start + 0..E-1
) -> torch.Tensor:
    """Each expert's GEMMs in x's dtype as HF runs them (F.linear with the bias, then act(gate) * up, or
    GPT-OSS's clamped SwiGLU); an MXFP4 or FP8 expert's weights dequantised to x's dtype when it is hit;
    each pair's output times its weight in float32, summed over the k slots in order 0..k-1, cast at the end.
    With `expert_start`, slots routed outside the held experts contribute exactly 0."""
    act = _gated_reference(activation, alpha, limit)
    if batch_invariant:  # an expert's GEMM rows are the tokens routed to it: their count varies
        from swaserve.layers.batch_invariant import invariant_linear as linear
    else:
        linear = F.linear
    n, k = topk_ids.shape
    y = torch.zeros(n, k, x.shape[1], dtype=x.dtype, device=x.device)  # [n, k, H]
    ids = topk_ids.long()
    if expert_start is not None:
        ids = ids - expert_start
        ids = torch.where((ids >= 0) & (ids < w_gate_up.shape[0]), ids, -1)
    if row_valid is not None:
        ids = torch.where(row_valid[:, None], ids, -1)
    for e in torch.unique(ids[ids >= 0]).tolist():
        token, slot = torch.where(ids == e)
        w1 = _expert(w_gate_up, gate_up_scales, e, x.dtype, gate_up_scale_rows)
        w2 = _expert(w_down, down_scales, e, x.dtype, fp8.BLOCK)
        gate, up = linear(x[token], w1, _row(gate_up_bias, e)).chunk(2, dim=-1)
        y[token, slot] = linear(act(gate, up), w2, _row(down_bias, e))
    out = torch.zeros(n, x.shape[1], dtype=torch.float32, device=x.device)
    for j in range(k):  # slot order, as the fused combine sums
        out += topk_weights[:, j, None].float() * y[:, j].float()
    if row_valid is not None:
        out = torch.where(row_valid[:, None], out, 0.0)
    return out.to(x.dtype)


def _expert(w: torch.Tensor, scales: torch.Tensor | None, e: int, dtype: torch.dtype, scale_rows: int) -> torch.Tensor:
    """Expert e's weight `[out, in]` in dtype (a quantised one dequantised now: no copy is kept)."""
    if scales is None:
        return w[e]
    if w.dtype == fp8.FP8:
        return fp8.dequantize(w[e], scales[e], dtype, scale_rows)
    return mxfp4.dequantize(w[e], scales[e], dtype)


def _row(bias: torch.Tensor | None, e: int) -> torch.Tensor | None:
    return None if bias is None else bias[e]


def _gated_reference(activation: str, alpha: float | None, limit: float | None):
    """(gate, up) -> the gated activation, in the inputs' dtype as the torch ops round it."""
    if activation == "swiglu_oai":
        if alpha is None or limit is None:
            raise ValueError("the swiglu_oai activation needs alpha and limit")

        def swiglu_oai(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:  # as HF's GptOssExperts
            gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
            return (up + 1) * (gate * torch.sigmoid(gate * alpha))

        return swiglu_oai
    if activation not in _REFERENCE_ACT:
        names = sorted([*_REFERENCE_ACT, "swiglu_oai"])
        raise ValueError(f"unsupported activation {activation!r}; supported: {names}")
    fn = get_activation(_REFERENCE_ACT[activation])
    return lambda gate, up: fn(gate) * up
