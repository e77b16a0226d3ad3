"""The end of an expert GEMM split over K (`moe_gemm`'s `split_k`): its float32 partials summed in split
order, rounded, and for the gate/up GEMM GPT-OSS's or a gated activation applied, as the unsplit kernel's
epilogue does (`fused_moe` splits MXFP4 experts at decode sizes; the down GEMM's partials are summed by
`fused_moe.combine` instead)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from swaserve.kernels.common import jit_per_batch
from swaserve.kernels.moe_gemm import MOE_ACTS, _expert_out
from swaserve.kernels.pdl import pdl_enter, pdl_kwargs


@jit_per_batch("n_rows")
def _finish_split_kernel(part_ptr, out_ptr, n_rows, n_cols, stride_ps, stride_pm, stride_om, alpha, limit,
                         SPLIT_K: tl.constexpr, GATED: tl.constexpr, ACT: tl.constexpr, BLOCK: tl.constexpr,
                         USE_PDL: tl.constexpr):
    """out[r, c] = the split-K partials of row r summed in split order, then `_expert_out` (the unsplit
    kernel's epilogue): rounded, and with GATED act(gate) * up (gate at c, up at n_cols + c of the partials)."""
    pdl_enter(USE_PDL)
    r = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n_cols
    base = part_ptr + r * stride_pm + cols
    acc = tl.zeros([BLOCK], tl.float32)
    acc_up = tl.zeros([BLOCK], tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(base + s * stride_ps, mask=ok, other=0.0)
        if GATED:
            acc_up += tl.load(base + s * stride_ps + n_cols, mask=ok, other=0.0)
    tl.store(out_ptr + r * stride_om + cols, _expert_out(acc, acc_up, alpha, limit, out_ptr.dtype.element_ty,
                                                         GATED, ACT), mask=ok)


def finish_split(parts: torch.Tensor, out: torch.Tensor, *, gated: bool, activation: str = "silu",
                 alpha: float = 1.0, limit: float = 0.0, block: int = 512) -> torch.Tensor:
    """`out` [rows, n] from `moe_gemm`'s float32 split-K partials `parts` [split_k, rows, n or 2n]: summed in
    split order, rounded to out's dtype, with `gated` the activation of gate and up (rows no pair wrote
    hold whatever the partials held: nothing reads them)."""
    split_k, rows, width = parts.shape
    n = out.shape[1]
    assert width == (2 if gated else 1) * n and out.shape[0] == rows and parts.stride(2) == out.stride(1) == 1
    if rows:
        _finish_split_kernel[(rows, triton.cdiv(n, block))](
            parts, out, rows, n, parts.stride(0), parts.stride(1), out.stride(0), float(alpha), float(limit),
            SPLIT_K=split_k, GATED=gated, ACT=MOE_ACTS[activation], BLOCK=block, num_warps=4, **pdl_kwargs(parts),
        )
    return out
