"""Block-FP8 weights as DeepSeek-V3 / MiMo-V2-Flash checkpoints store them: `weight` float8_e4m3fn
`[out, in]` and `weight_scale_inv` float32 `[ceil(out/128), ceil(in/128)]` (the dequantised weight is
each fp8 value times the scale of its 128 x 128 block). Which `quantization_config`s are run, which
modules they leave in their stored dtype, the torch dequantiser (the oracle every kernel is tested
against), the 128 x 128 quantiser of online FP8 (`--quantization fp8`) and per-token-group activations."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any

import torch

BLOCK = 128  # rows and inputs per weight scale; inputs per activation scale
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
ONLINE_KEY = "swaserve_online"  # marks a quantization_config made by --quantization fp8 (weights arrive unquantised)
QUANTIZATIONS = ("fp8",)  # --quantization choices
_EPS = 1e-10  # amax floor: an all-zero group (a padded row) gets a finite scale, not 0/0


@dataclass(frozen=True)
class Fp8Config:
    """A checkpoint's block-FP8 settings: `ignored` HF module names or globs (`ignored_layers` /
    `modules_to_not_convert`) stay in their stored dtype; `online`: the checkpoint is unquantised
    and each weight is quantised to 128 x 128 blocks as it loads."""

    ignored: tuple[str, ...] = ()
    online: bool = False

    def quantizes(self, module: str) -> bool:
        """Whether HF module `module` (e.g. `model.layers.3.self_attn.o_proj`) is FP8: not when an
        ignored entry names it or a module above it (fnmatch globs, as HF's lists), or ends its name
        at a dot boundary (lists that name `self_attn.o_proj` without the layer prefix)."""
        parts = module.split(".")
        prefixes = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
        for pattern in self.ignored:
            if any(fnmatch.fnmatchcase(p, pattern) for p in prefixes):
                return False
            if module.endswith("." + pattern):
                return False
        return True


def _get(qc: Any, key: str, default: Any = None) -> Any:
    return qc.get(key, default) if isinstance(qc, dict) else getattr(qc, key, default)


def fp8_config(hf: Any) -> Fp8Config | None:
    """The config's block-FP8 settings, None when it is not an FP8 checkpoint. An FP8 variant this
    project does not run (per-tensor or other block sizes, static activation scales, e8m0 scales,
    e5m2) is a ValueError naming it."""
    qc = getattr(hf, "quantization_config", None)
    if not qc:
        return None
    method = _get(qc, "quant_method")
    if str(getattr(method, "value", method)).lower() != "fp8":
        return None
    fmt = str(_get(qc, "fmt", "e4m3") or "e4m3").lower()
    if fmt not in ("e4m3", "float8_e4m3fn"):
        raise ValueError(f"FP8 checkpoints with fmt {fmt!r} are not supported (supported: e4m3)")
    scheme = str(_get(qc, "activation_scheme", "dynamic") or "dynamic").lower()
    if scheme != "dynamic":
        raise ValueError(f"FP8 activation_scheme {scheme!r} is not supported (supported: dynamic: activations are "
                         "scaled per token and 128 inputs as they arrive)")
    block = _get(qc, "weight_block_size")
    if block is None:
        raise ValueError("FP8 checkpoints with per-tensor or per-channel scales (no weight_block_size) are not "
                         f"supported; supported: weight_block_size [{BLOCK}, {BLOCK}]")
    if [int(b) for b in block] != [BLOCK, BLOCK]:
        raise ValueError(f"FP8 weight_block_size {list(block)} is not supported (supported: [{BLOCK}, {BLOCK}])")
    scale_fmt = _get(qc, "scale_fmt", "float") or "float"
    if scale_fmt != "float":
        raise ValueError(f"FP8 scale_fmt {scale_fmt!r} is not supported (supported: float32 weight_scale_inv)")
    if (_get(qc, "expert_dtype", "fp8") or "fp8") != "fp8":
        raise ValueError(f"FP8 checkpoints with expert_dtype {_get(qc, 'expert_dtype')!r} are not supported")
    ignored = [*(_get(qc, "ignored_layers") or ()), *(_get(qc, "modules_to_not_convert") or ())]
    return Fp8Config(tuple(str(p) for p in ignored), bool(_get(qc, ONLINE_KEY, False)))


def with_online_fp8(hf: Any) -> Any:
    """`hf` (changed in place and returned) as `--quantization fp8` runs it: a block-FP8
    quantization_config whose weights are quantised at load. A checkpoint that is already quantised
    is refused: its weights are not the bf16 values online quantisation starts from."""
    qc = getattr(hf, "quantization_config", None)
    if qc:
        raise ValueError(f"--quantization fp8 quantises unquantised (bf16/fp16/fp32) checkpoints; this one already "
                         f"is (quant_method {_get(qc, 'quant_method')!r}): drop --quantization")
    hf.quantization_config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                              "weight_block_size": [BLOCK, BLOCK], "ignored_layers": ["lm_head"], ONLINE_KEY: True}
    return hf


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def expand_scale_rows(scale: torch.Tensor, rows: int) -> torch.Tensor:
    """`[.., ceil(rows/128), kb]` block scales -> `[.., rows, kb]`, one row per weight row."""
    return scale.repeat_interleave(BLOCK, dim=-2).narrow(-2, 0, rows)


def dequantize(
    weight: torch.Tensor,  # [.., N, K] float8_e4m3fn
    scale: torch.Tensor,  # [.., ceil(N/scale_rows), ceil(K/128)] float32
    dtype: torch.dtype,
    scale_rows: int = BLOCK,
) -> torch.Tensor:  # [.., N, K] in dtype
    """Each fp8 value times its block's scale, in float32, then rounded once to `dtype`."""
    if weight.dtype != FP8:
        raise ValueError(f"FP8 weights must be float8_e4m3fn, got {weight.dtype}")
    n, k = weight.shape[-2:]
    want = (*weight.shape[:-2], cdiv(n, scale_rows), cdiv(k, BLOCK))
    if tuple(scale.shape) != want:
        raise ValueError(f"FP8 scales {tuple(scale.shape)} do not match weight {tuple(weight.shape)} (want {want})")
    s = scale.float().repeat_interleave(scale_rows, dim=-2).narrow(-2, 0, n)
    s = s.repeat_interleave(BLOCK, dim=-1).narrow(-1, 0, k)
    return (weight.float() * s).to(dtype)


def _div(x: torch.Tensor, d: float) -> torch.Tensor:
    """`x / d` correctly rounded on every device: CUDA torch multiplies by a Python scalar's reciprocal
    instead of dividing, a last-bit difference from the CPU's (and the kernels') scales."""
    return x / torch.full_like(x, d)


@torch.no_grad()
def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`[.., N, K]` -> (float8_e4m3fn `[.., N, K]`, float32 scales `[.., ceil(N/128), ceil(K/128)]`):
    each 128 x 128 block scaled by amax/448 (a partial block at the edges by its own amax)."""
    n, k = w.shape[-2:]
    nb, kb = cdiv(n, BLOCK), cdiv(k, BLOCK)
    lead = w.shape[:-2]
    padded = w.float().new_zeros(*lead, nb * BLOCK, kb * BLOCK)
    padded[..., :n, :k] = w.float()
    blocks = padded.view(*lead, nb, BLOCK, kb, BLOCK)
    amax = blocks.abs().amax(dim=(-3, -1))  # [.., nb, kb]
    scale = torch.where(amax > 0, _div(amax, FP8_MAX), torch.ones_like(amax))
    q = (blocks / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(*lead, nb * BLOCK, kb * BLOCK)[..., :n, :k].contiguous(), scale


def quantize_act_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations `[M, K]` -> (float8_e4m3fn `[M, K]`, float32 `[M, ceil(K/128)]`): each row's run
    of 128 inputs scaled by max(amax, 1e-10)/448 (dynamic). The torch form of `kernels.fp8_gemm`'s."""
    m, k = x.shape
    kb = cdiv(k, BLOCK)
    padded = x.float().new_zeros(m, kb * BLOCK)
    padded[:, :k] = x.float()
    groups = padded.view(m, kb, BLOCK)
    scale = _div(groups.abs().amax(dim=-1).clamp(min=_EPS), FP8_MAX)
    q = (groups / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(m, kb * BLOCK)[:, :k].contiguous(), scale
