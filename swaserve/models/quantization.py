"""Which modules of a built model a checkpoint's `quantization_config` quantises: the quant methods a
family runs (`check_quant_method`), and `apply_fp8`, which turns every merged / output projection and
stacked-experts block that a block-FP8 config covers into its FP8 form before weights load. Modules the
config lists as ignored, and every other module (embeddings, LM head, routers, norms), keep their dtype."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from swaserve.layers import fp8
from swaserve.layers.fp8_linear import convert_experts, convert_merged, convert_out
from swaserve.layers.linear import MergedLinear, OutLinear
from swaserve.layers.moe import StackedExperts


def quant_method(hf: Any) -> str | None:
    """`quantization_config.quant_method`, lower case; None without one."""
    qc = getattr(hf, "quantization_config", None)
    if not qc:
        return None
    method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", None)
    return str(getattr(method, "value", method)).lower()


def check_quant_method(hf: Any, supported: tuple[str, ...], family: str) -> None:
    """A ValueError naming the method when `family` does not run the config's quantisation."""
    method = quant_method(hf)
    if method is not None and method not in supported:
        raise ValueError(f"quantization_config.quant_method {method!r} is not supported for {family} (supported: "
                         f"{', '.join(supported) or 'none'}); use an unquantised checkpoint")


def apply_fp8(model: nn.Module, hf: Any, map_name: Callable[[str], str | None],
              hf_names: Callable[[str, nn.Module], list[str]]) -> fp8.Fp8Config | None:
    """Convert in place what the config's block-FP8 settings quantise (nothing without them).
    `map_name`: checkpoint name -> the model's (normalises the ignore list); `hf_names(name, module)`:
    the HF modules one of the model's modules holds (q/k/v of a merged qkv_proj). A merged module
    whose parts disagree (q quantised, k not) is a ValueError: one GEMM runs one format."""
    cfg = fp8.fp8_config(hf)
    if cfg is None:
        return None
    ignored = list(cfg.ignored)
    for pattern in cfg.ignored:
        mapped = map_name(pattern + ".weight")
        if mapped is not None and mapped.endswith(".weight") and mapped[:-7] != pattern:
            ignored.append(mapped[:-7])
    cfg_mapped = fp8.Fp8Config(tuple(ignored), cfg.online)
    for name, module in list(model.named_modules()):
        if not isinstance(module, (MergedLinear, OutLinear, StackedExperts)):
            continue
        names = hf_names(name, module)
        quantized = {cfg_mapped.quantizes(n) for n in names}
        if len(quantized) > 1:
            raise ValueError(f"FP8 ignored_layers keep some of {names} unquantised but not all; swaserve runs them "
                             "as one merged GEMM in one format")
        if not quantized.pop():
            continue
        if isinstance(module, MergedLinear):
            convert_merged(module, cfg.online)
        elif isinstance(module, OutLinear):
            convert_out(module, cfg.online, name)
        else:
            convert_experts(module, cfg.online, name)
    return cfg


def keep_stored_dtypes(model: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor]
                       ) -> Callable[[torch.Tensor], torch.Tensor]:
    """`fn` of `nn.Module._apply` that leaves FP8 weights e4m3 and their scales float32 (`model.to(bf16)`
    casts every floating parameter): such tensors only move device, exactly."""
    kept = {id(p) for n, p in model.named_parameters() if p.dtype == fp8.FP8 or n.endswith("_scale_inv")}
    if not kept:
        return fn

    def apply(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in kept:
            return fn(t)
        probe = fn(t.new_empty(0))  # where, and in which dtype, fn puts a tensor
        if probe.dtype == t.dtype:
            return fn(t)
        if t.device.type == "meta" or probe.device.type == "meta":
            return torch.empty_like(t, device=probe.device)
        return t.to(probe.device)

    return apply
