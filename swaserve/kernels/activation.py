"""Gated-MLP activation `act(gate) * up` over the merged gate/up projection in one launch
(`act_and_mul`), rounded as the two torch ops would be."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from swaserve.kernels.pdl import pdl_enter, pdl_kwargs

ACTS = {"silu": 0, "gelu": 1, "gelu_tanh": 2}


@triton.jit
def gated_act(g, u, ty: tl.constexpr, ACT: tl.constexpr):
    """`act(g) * u` rounded to `ty` as the two torch ops would be: act(g) rounded to `ty`, then the
    product in float32 and rounded. g and u are float32 holding `ty` values."""
    if ACT == 0:  # silu; exp(-g) = inf for very negative g gives -0, not NaN
        a = g / (1.0 + tl.exp(-g))
    elif ACT == 1:  # exact gelu
        # g * Phi(g) with Phi(g) = 0.5 + 0.5 erf(g / sqrt 2) in [0, 1], so no intermediate exceeds
        # |g| whatever order the compiler multiplies in (0.5 * g * (1 + erf) reaches 2g: inf near
        # the float32 limit).
        a = g * (0.5 + 0.5 * tl.math.erf(g * 0.7071067811865476))
    else:
        # gelu tanh: 0.5 * g * (1 + tanh(z)) == g * sigmoid(2z). This form needs no libdevice tanh (the
        # interpreter lacks it), has no 1 - 2/(...) cancellation, and saturates to g / -0 without NaN.
        z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        a = g / (1.0 + tl.exp(-2.0 * z))
    return (a.to(ty).to(tl.float32) * u).to(ty)


@triton.jit
def _act_and_mul_kernel(gate_up, out, stride_in, stride_out, n_cols, ACT: tl.constexpr, BLOCK: tl.constexpr,
                        USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)  # int64: T * 2I passes 2**31 on long prefills
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(gate_up + row * stride_in + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gate_up + row * stride_in + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out + row * stride_out + cols, gated_act(g, u, out.dtype.element_ty, ACT), mask=mask)


def act_and_mul(
    gate_up: torch.Tensor,  # [T, 2I]: gate in columns [0, I), up in [I, 2I); rows may be strided
    activation: str,  # "silu", "gelu" (erf) or "gelu_tanh"
    block: int = 1024,
) -> torch.Tensor:  # [T, I], gate_up's dtype
    """`act(gate) * up` in one launch; grid (T, column blocks) so wide intermediates stay parallel."""
    if activation not in ACTS:
        raise ValueError(f"unsupported activation {activation!r}; supported: {sorted(ACTS)}")
    assert gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0, gate_up.shape
    if gate_up.stride(1) != 1:
        gate_up = gate_up.contiguous()
    T, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(T, inter, dtype=gate_up.dtype, device=gate_up.device)
    if T == 0 or inter == 0:
        return out
    block = min(block, triton.next_power_of_2(inter))
    _act_and_mul_kernel[(T, triton.cdiv(inter, block))](
        gate_up, out, gate_up.stride(0), out.stride(0), inter, ACT=ACTS[activation], BLOCK=block,
        num_warps=max(1, min(4, block // 256)), **pdl_kwargs(gate_up),
    )
    return out
