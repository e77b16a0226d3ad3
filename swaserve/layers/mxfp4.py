"""MXFP4 weights as GPT-OSS checkpoints store them: `*_blocks` uint8 [.., out, in/32, 16] (two FP4 e2m1
values a byte, the low nibble the even index) and `*_scales` uint8 e8m0 [.., out, in/32] (2^(s-127) per
32 inputs). The torch dequantiser (the oracle the Triton kernels are tested against), random draws for
`--load-format dummy`, and which modules a `quantization_config` quantises."""

from __future__ import annotations

import fnmatch
from typing import Any

import torch

GROUP = 32  # inputs per e8m0 scale
# e2m1 code -> value: sign bit 3, exponent bits 2-1, mantissa bit 0 (code 1 is the subnormal 0.5).
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# Scale exponents the dummy loader draws: FP4 codes drawn uniformly have an RMS of 2.93, so weights
# of RMS ~0.018 (like the N(0, 0.02) draw of bf16 weights), two scales so the per-group scale matters.
DUMMY_SCALES = (119, 120)  # consecutive: drawn as a range
SUPPORTED_QUANT_METHODS = ("mxfp4",)


def dequantize(
    blocks: torch.Tensor,  # [.., out, in/32, 16] uint8
    scales: torch.Tensor,  # [.., out, in/32] uint8
    dtype: torch.dtype,
) -> torch.Tensor:  # [.., out, in] in dtype
    """Every value exactly (an e2m1 value times a power of two is representable in bf16 and fp32)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != GROUP // 2:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).long()  # [.., out, G, 16, 2]: even, odd
    values = lut[codes].flatten(-3)  # [.., out, G * 32]
    exps = (scales.to(torch.int32) - 127).repeat_interleave(GROUP, dim=-1)
    return torch.ldexp(values, exps.float()).to(dtype)


def quant_method(hf: Any) -> str | None:
    """The config's `quantization_config.quant_method` (lower case), None without one; a method this
    project cannot run is a ValueError naming it."""
    qc = getattr(hf, "quantization_config", None)
    if not qc:
        return None
    method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", None)
    method = str(getattr(method, "value", method)).lower()
    if method not in SUPPORTED_QUANT_METHODS:
        raise ValueError(f"quantization_config.quant_method {method!r} is not supported (supported: "
                         f"{', '.join(SUPPORTED_QUANT_METHODS)}); use an unquantised checkpoint")
    return method


def is_quantized(hf: Any, module: str) -> bool:
    """Whether the MXFP4 config quantises the HF module named `module` (e.g. `model.layers.3.mlp.experts`):
    not when `modules_to_not_convert` lists it or a module above it (HF's glob patterns)."""
    if quant_method(hf) != "mxfp4":
        return False
    qc = hf.quantization_config
    key = "modules_to_not_convert"
    skip = qc.get(key) if isinstance(qc, dict) else getattr(qc, key, None)
    parts = module.split(".")
    prefixes = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
    return not any(fnmatch.fnmatchcase(p, pattern) for pattern in skip or () for p in prefixes)


@torch.no_grad()
def random_codes_(blocks: torch.Tensor, generator: torch.Generator) -> None:
    """Fill MXFP4 blocks (uint8) with uniformly random e2m1 code pairs, in place."""
    blocks.random_(0, 256, generator=generator)


@torch.no_grad()
def random_scales_(scales: torch.Tensor, generator: torch.Generator) -> None:
    """Fill e8m0 scales (uint8) with `DUMMY_SCALES`, drawn uniformly, in place."""
    scales.random_(DUMMY_SCALES[0], DUMMY_SCALES[-1] + 1, generator=generator)
