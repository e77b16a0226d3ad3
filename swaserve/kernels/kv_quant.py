"""FP8 e4m3 K/V storage inside the kernels: the store side (`_to_pool`: `x / scale`, clamped to +-448,
rounded to nearest even, as `memory.kv_pool.quantize_kv` in torch) and the launch arguments every
attention and store kernel takes for it (`kv_scale_args`). Reads dequantise by folding the scales into
the math: K's into the logit scale (`q . k8 * k_scale * scaling`), V's into the accumulated output
(`sum p * v8 * v_scale`), so a tile of e4m3 values is converted to the compute dtype (exact) and
nothing else runs per element."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from swaserve.kernels.fp8_gemm import _round_e4m3

FP8_KV = torch.float8_e4m3fn


@triton.jit
def _to_pool(x, buf, scale, FP8: tl.constexpr, EMULATE: tl.constexpr):
    """`x` as pool `buf` stores it: FP8 (e4m3) `x / scale` clamped to +-448; else cast to its dtype."""
    if FP8:
        # div_rn: IEEE division, as the torch quantiser's (`/` is the GPU's approximate one)
        return _round_e4m3(tl.clamp(tl.math.div_rn(x.to(tl.float32), scale), -448.0, 448.0), EMULATE)
    return x.to(buf.dtype.element_ty)


@triton.jit
def _load_scale(ptr, FP8: tl.constexpr):
    """A layer's float32 K or V scale (1.0 for a pool in the compute dtype, whose pointer is a stand-in)."""
    if FP8:
        return tl.load(ptr).to(tl.float32)
    return 1.0


def kv_scale_args(k_buf: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
                  stand_in: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(k_scale, v_scale, FP8) for a launch over pool `k_buf`: an FP8 pool needs both scales (`[1]`
    float32 on the device: pointers, so a captured graph reads the live values); another pool takes none,
    and `stand_in` fills the pointer slots."""
    fp8 = k_buf.dtype == FP8_KV
    if fp8 != (k_scale is not None and v_scale is not None):
        raise ValueError(f"a {k_buf.dtype} pool takes {'both' if fp8 else 'no'} K/V scales")
    if not fp8:
        return stand_in, stand_in, False
    assert k_scale.dtype == torch.float32 and v_scale.dtype == torch.float32, (k_scale.dtype, v_scale.dtype)
    return k_scale, v_scale, True
