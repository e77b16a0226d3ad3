"""FP8 e4m3 K/V storage inside the kernels: the store side (`_to_pool`: `x / scale`, clamped to +-448,
rounded to nearest even, as `memory.kv_pool.quantize_kv` in torch) and the launch arguments every
attention and store kernel takes for it (`kv_scale_args`). Reads dequantise by folding the scales into
the math: K's into the logit scale (`q . k8 * k_scale * scaling`), V's into the accumulated output
(`sum p * v8 * v_scale`), so a tile of e4m3 values is converted to the compute dtype (exact) and
nothing else runs per element."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from swaserve.kernels.common import interpret_mode
from swaserve.kernels.fp8_gemm import _round_e4m3

FP8_KV = torch.float8_e4m3fn


@triton.jit
def _to_pool(x, buf, scale, FP8: tl.constexpr, EMULATE: tl.constexpr):
    """`x` as pool `buf` stores it: FP8 (e4m3) `x / scale` clamped to +-448; else cast to its dtype."""
    if FP8:
        # div_rn: IEEE division, as the torch quantiser's (`/` is the GPU's approximate one)
        return _round_e4m3(tl.clamp(tl.math.div_rn(x.to(tl.float32), scale), -448.0, 448.0), EMULATE)
    return x.to(buf.dtype.element_ty)


def fp8_cvt_asm(device: torch.device) -> bool:
    """Whether the unified attention kernel converts e4m3 K/V tiles to fp16 as they arrive, by the
    hardware's pair conversion in inline PTX (`_e4m3_tile`; sm_89 and later), so the tiles sit in shared
    memory as 16-bit values and reach the MMA through `ldmatrix`, as bf16 tiles do. Without it Triton
    stages the e4m3 bytes and converts them in the MMA's operand layout, which for V (whose MMA reduces
    over tokens, the strided dimension) means one shared-memory load per byte (`ld.shared.b8`) and, for
    the 16-row decode tile, operands 4 wide along K: another summation order than bf16's, which the
    64-row tile has to avoid (`unified_launch.decode_config`). On by default; `SWASERVE_FP8_CVT_ASM=0`
    turns it off. Measured on an H200 (4B, bs 64, ctx 8k, deterministic decode): 15.15 -> 7.88 ms a
    step. Never in the interpreter (it cannot run PTX). The split-KV decode kernel does not take it:
    there it measured slower (default mode, same shape: 8.28 -> 9.18 ms)."""
    if os.environ.get("SWASERVE_FP8_CVT_ASM") == "0" or interpret_mode() or device.type != "cuda":
        return False
    if device not in _CVT_CAPABLE:  # read once per device: this runs at every launch
        _CVT_CAPABLE[device] = torch.cuda.get_device_capability(device) >= (8, 9)
    return _CVT_CAPABLE[device]


_CVT_CAPABLE: dict[torch.device, bool] = {}


@triton.jit
def _e4m3_tile(x, dtype: tl.constexpr, ASM: tl.constexpr):
    """A K or V tile in the compute dtype: e4m3 values are exact in fp16 and bf16. `ASM` (an e4m3 tile,
    `fp8_cvt_asm`): four values a register through `cvt.rn.f16x2.e4m3x2` twice, as an impure inline
    op, which Triton neither moves past the tile's staging in shared memory nor merges with others."""
    if ASM:
        x = tl.inline_asm_elementwise(
            asm="{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; "
                "cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
            constraints="=r,=r,r", args=[x.to(tl.uint8, bitcast=True)], dtype=tl.float16, is_pure=False,
            pack=4)
    return x.to(dtype)


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
