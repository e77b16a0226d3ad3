"""Block-FP8 projections and experts: `convert_model` turns a built model's merged / output projections
and stacked experts that a checkpoint's FP8 config quantises into e4m3 weights with float32 scales (in
place, before weights load), `fp8_linear` runs them (the Triton GEMM on CUDA, dequantise-at-use
elsewhere), and the loaders put a checkpoint's `weight` + `weight_scale_inv` (or, online, an unquantised
weight quantised here) into their rows, cut for tensor parallelism on 128-blocks.

Scale layouts (`Fp8Spec.scale_rows`): 128 (the checkpoint's blocks) where every part of a merged weight
starts on a 128-row boundary; otherwise 1, a scale per row and 128 inputs, expanded from the blocks at
load (q/k/v or gate/up parts that are not whole blocks: the kernels index `row // scale_rows`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from swaserve.layers import fp8
from swaserve.layers.fp8 import BLOCK, FP8, cdiv

# The layers own their FP8 form through these functions (they import this module, never the reverse):
# `MergedLinear`, `OutLinear` and `StackedExperts` arguments are typed as the nn.Module they are.
MergedLinear = OutLinear = StackedExperts = nn.Module
SCALE = "weight_scale_inv"


@dataclass(frozen=True)
class Fp8Spec:
    scale_rows: int  # weight rows per scale: 128 (blocks) or 1 (per row)
    online: bool  # the checkpoint's weights are unquantised: quantise each as it loads


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
               scale_rows: int, batch_invariant: bool) -> torch.Tensor:
    """`x @ dequant(weight).T + bias`; `x` [..., K], `weight` [N, K] e4m3, `scale` [ceil(N/scale_rows), ceil(K/128)]."""
    if x.is_cuda:
        from swaserve.kernels.fp8_gemm import fp8_gemm

        x2 = x.reshape(-1, x.shape[-1])
        y = fp8_gemm(x2 if x2.stride(1) == 1 else x2.contiguous(), weight, scale, bias, scale_rows=scale_rows,
                     batch_invariant=batch_invariant)
        return y.reshape(*x.shape[:-1], weight.shape[0])
    w = fp8.dequantize(weight, scale, x.dtype, scale_rows)
    if batch_invariant:
        from swaserve.layers.batch_invariant import invariant_linear

        return invariant_linear(x, w, bias)
    return F.linear(x, w, bias)


def _frozen(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


def _weight_and_scale(module: nn.Module, name: str, shape: tuple[int, ...], scale_rows: int) -> None:
    """Replace `module.<name>` by an e4m3 parameter of `shape` [.., N, K] and add `<name>_scale_inv`
    (`weight_scale_inv` for a weight) [.., ceil(N/scale_rows), ceil(K/128)] float32."""
    dev = getattr(module, name).device
    setattr(module, name, _frozen(shape, FP8, dev))
    *lead, n, k = shape
    scale_name = SCALE if name == "weight" else f"{name}_scale_inv"
    module.register_parameter(scale_name, _frozen((*lead, cdiv(n, scale_rows), cdiv(k, BLOCK)), torch.float32, dev))


def convert_merged(m: MergedLinear, online: bool) -> None:
    aligned = all(start % BLOCK == 0 for start, _ in m.shards) and all(n % BLOCK == 0 for n in m.out_sizes[:-1])
    m.fp8 = Fp8Spec(BLOCK if aligned else 1, online)
    _weight_and_scale(m, "weight", tuple(m.weight.shape), m.fp8.scale_rows)


def convert_out(m: OutLinear, online: bool, name: str) -> None:
    start = m.shard[0]
    if start % BLOCK and not online:
        raise ValueError(f"{name}: this tensor-parallel rank's inputs start at {start}, inside a {BLOCK}-input FP8 "
                         "scale block; use a tensor_parallel_size that splits it on 128-input boundaries")
    m.fp8 = Fp8Spec(BLOCK, online)
    _weight_and_scale(m, "weight", tuple(m.weight.shape), BLOCK)


def convert_experts(m: StackedExperts, online: bool, name: str) -> None:
    local, start = m.down_proj.shape[2], m.width_start
    if start % BLOCK and not online:
        raise ValueError(f"{name}: this tensor-parallel rank's expert inputs start at {start}, inside a {BLOCK}-input "
                         "FP8 scale block; use a tensor_parallel_size that splits the expert intermediate size on "
                         "128-input boundaries")
    m.fp8 = Fp8Spec(BLOCK if local % BLOCK == 0 and start % BLOCK == 0 else 1, online)
    _weight_and_scale(m, "gate_up_proj", tuple(m.gate_up_proj.shape), m.fp8.scale_rows)
    _weight_and_scale(m, "down_proj", tuple(m.down_proj.shape), BLOCK)


def _to_layout(scale: torch.Tensor, rows: int, scale_rows: int) -> torch.Tensor:
    """Block scales of `rows` weight rows in the layout `scale_rows` asks for."""
    return scale if scale_rows == BLOCK else fp8.expand_scale_rows(scale, rows)


def _quantize_into(weight: torch.Tensor, scale: torch.Tensor, tensor: torch.Tensor, scale_rows: int) -> None:
    """Quantise `tensor` [.., rows, K] to 128 x 128 blocks into `weight` and (in its layout) `scale`."""
    if tuple(tensor.shape) != tuple(weight.shape):
        raise ValueError(f"expected shape {tuple(weight.shape)}, got {tuple(tensor.shape)}")
    q, s = fp8.quantize(tensor.to(weight.device))
    weight.copy_(q)
    scale.copy_(_to_layout(s, tensor.shape[-2], scale_rows))


def _check_quantized(tensor: torch.Tensor, spec: Fp8Spec, quantize: bool | None, what: str) -> bool:
    """Whether `tensor` (for an FP8 weight) must be quantised here: an unquantised weight is expected
    online (or when asked, dummy draws), otherwise an error naming the mismatch."""
    if tensor.dtype == FP8:
        return False
    if spec.online if quantize is None else quantize:
        return True
    raise ValueError(f"{what} is stored as {tensor.dtype} but the checkpoint's FP8 quantization_config quantises it "
                     "(is it missing from ignored_layers / modules_to_not_convert?)")


def load_merged_shard(m: MergedLinear, shard: int, param_name: str, tensor: torch.Tensor,
                      quantize: bool | None) -> tuple[str, ...]:
    """`MergedLinear.load_shard` for an FP8 weight: returns the parameters it filled."""
    spec, rows, off = m.fp8, m.out_sizes[shard], m.offsets[shard]
    start, hf_rows = m.shards[shard]
    sr = spec.scale_rows
    scale_block = m.weight_scale_inv.data.narrow(0, off // sr, cdiv(rows, sr))
    what = f"shard {shard} of {type(m).__name__}.{param_name}"
    if param_name == "weight":
        if hf_rows != rows and tensor.shape[0] == hf_rows:
            tensor = tensor.narrow(0, start, rows)
        block = m.weight.data.narrow(0, off, rows)
        if _check_quantized(tensor, spec, quantize, what):
            _quantize_into(block, scale_block, tensor, sr)
            return ("weight", SCALE)
        if tuple(tensor.shape) != tuple(block.shape):
            raise ValueError(f"{what}: expected shape {tuple(block.shape)}, got {tuple(tensor.shape)}")
        block.copy_(tensor)
        return ("weight",)
    assert param_name == SCALE, param_name
    want = (cdiv(hf_rows, BLOCK), cdiv(m.in_features, BLOCK))
    if tuple(tensor.shape) != want:
        raise ValueError(f"{what}: expected shape {want}, got {tuple(tensor.shape)}")
    part = (tensor.narrow(0, start // BLOCK, cdiv(rows, BLOCK)) if sr == BLOCK
            else fp8.expand_scale_rows(tensor, hf_rows).narrow(0, start, rows))
    scale_block.copy_(part)
    return (SCALE,)


def load_out_param(m: OutLinear, param_name: str, tensor: torch.Tensor, quantize: bool | None) -> tuple[str, ...]:
    """An output projection's `weight` (quantised here when unquantised, online) or `weight_scale_inv`
    (this rank's 128-input columns); () when the default copy applies."""
    start, hf_in = m.shard
    if param_name == SCALE and hf_in != m.in_features and tensor.shape[-1] == cdiv(hf_in, BLOCK):
        tensor = tensor.narrow(1, start // BLOCK, m.weight_scale_inv.shape[1])
    if param_name == SCALE:
        if tuple(tensor.shape) != tuple(m.weight_scale_inv.shape):
            raise ValueError(f"{SCALE}: expected shape {tuple(m.weight_scale_inv.shape)}, got {tuple(tensor.shape)}")
        m.weight_scale_inv.data.copy_(tensor)
        return (SCALE,)
    if param_name == "weight" and _check_quantized(tensor, m.fp8, quantize, f"{type(m).__name__}.weight"):
        _quantize_into(m.weight.data, m.weight_scale_inv.data, m.tp_slice("weight", tensor), BLOCK)
        return ("weight", SCALE)
    return ()


def load_expert_part(m: StackedExperts, expert: int, proj: str, param: str, tensor: torch.Tensor,
                     quantize: bool | None) -> None:
    """One expert's HF `gate_proj` / `up_proj` / `down_proj` `weight` or `weight_scale_inv` (whole
    intermediate size; this rank's part taken here) into the stacked FP8 parameters (`expert`: the
    rank's local index)."""
    spec, local = m.fp8, m.down_proj.shape[2]
    full, start = m.hf_intermediate, m.width_start
    if proj == "down_proj":
        w, s = m.down_proj.data[expert], m.down_proj_scale_inv.data[expert]
        if param == "weight":
            if tensor.shape[1] == full != local:
                tensor = tensor.narrow(1, start, local)
            if _check_quantized(tensor, spec, quantize, f"expert {expert} down_proj"):
                _quantize_into(w, s, tensor, BLOCK)
                return
            _copy(w, tensor, f"expert {expert} down_proj")
        else:
            if tensor.shape[1] == cdiv(full, BLOCK) != s.shape[1]:
                tensor = tensor.narrow(1, start // BLOCK, s.shape[1])
            _copy(s, tensor, f"expert {expert} down_proj {SCALE}")
        return
    if proj not in ("gate_proj", "up_proj"):
        raise ValueError(f"unknown expert projection {proj!r}")
    row0 = 0 if proj == "gate_proj" else local
    sr = spec.scale_rows
    w = m.gate_up_proj.data[expert].narrow(0, row0, local)
    s = m.gate_up_proj_scale_inv.data[expert].narrow(0, row0 // sr, cdiv(local, sr))
    if param == "weight":
        if tensor.shape[0] == full != local:
            tensor = tensor.narrow(0, start, local)
        if _check_quantized(tensor, spec, quantize, f"expert {expert} {proj}"):
            _quantize_into(w, s, tensor, sr)
            return
        _copy(w, tensor, f"expert {expert} {proj}")
        return
    if tuple(tensor.shape) != (cdiv(full, BLOCK), cdiv(m.gate_up_proj.shape[2], BLOCK)):
        raise ValueError(f"expert {expert} {proj} {SCALE}: shape {tuple(tensor.shape)} does not match the weight")
    part = (tensor.narrow(0, start // BLOCK, cdiv(local, BLOCK)) if sr == BLOCK
            else fp8.expand_scale_rows(tensor, full).narrow(0, start, local))
    _copy(s, part, f"expert {expert} {proj} {SCALE}")


def load_stacked_param(m: StackedExperts, param_name: str, tensor: torch.Tensor, quantize: bool | None
                       ) -> tuple[str, ...]:
    """Stacked checkpoints (transformers' fused names): `gate_up_proj` [E, 2I, H] / `down_proj` [E, H, I]
    and their `_scale_inv` block grids, this rank's rows (or experts) taken; unquantised weights quantised
    (online)."""
    local, full, start = m.down_proj.shape[2], m.hf_intermediate, m.width_start
    sr = m.fp8.scale_rows
    if param_name in ("gate_up_proj", "down_proj"):
        scale = getattr(m, f"{param_name}_scale_inv").data
        if _check_quantized(tensor, m.fp8, quantize, f"experts.{param_name}"):
            _quantize_into(getattr(m, param_name).data, scale, m.tp_slice(param_name, tensor),
                           sr if param_name == "gate_up_proj" else BLOCK)
            return (param_name, f"{param_name}_scale_inv")
        return ()  # e4m3 bytes: the default slice and copy
    if param_name.endswith("_scale_inv"):
        tensor = m.tp_slice(param_name, tensor)  # expert parallelism: this rank's experts
    if param_name == "gate_up_proj_scale_inv":
        rows = fp8.expand_scale_rows(tensor, 2 * full)  # [E, 2I, kb]
        if local != full:
            rows = torch.cat([rows.narrow(1, start, local), rows.narrow(1, full + start, local)], dim=1)
        _copy(m.gate_up_proj_scale_inv.data, rows[:, ::BLOCK] if sr == BLOCK else rows, "experts.gate_up_proj_scale_inv")
        return (param_name,)
    if param_name == "down_proj_scale_inv":
        if local != full:
            tensor = tensor.narrow(2, start // BLOCK, m.down_proj_scale_inv.shape[2])
        _copy(m.down_proj_scale_inv.data, tensor, "experts.down_proj_scale_inv")
        return (param_name,)
    return ()


def _copy(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    if tuple(src.shape) != tuple(dst.shape):
        raise ValueError(f"{what}: expected shape {tuple(dst.shape)}, got {tuple(src.shape)}")
    dst.copy_(src)
