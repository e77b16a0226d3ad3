"""A checkpoint's static FP8 KV-cache scales (`model.layers.N.self_attn.k_scale` / `v_scale`, or the
older single `kv_scale`, as FP8-KV calibration tools write them): collected at load, per layer, for
the runtime to hand to the FP8 pools (`runtime.apply_kv_scales`). Stored K = e4m3(K / k_scale)."""

from __future__ import annotations

import re

import torch

_NAME = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(k_scale|v_scale|kv_scale)$")


def take_kv_scale(scales: dict[int, dict[str, float]], target: str, tensor: torch.Tensor) -> bool:
    """Record `tensor` if the mapped name `target` is a KV-cache scale (True), else leave it (False).
    Per-tensor scales only: a scale per head (or any other shape) is refused by name."""
    m = _NAME.match(target)
    if m is None:
        return False
    if tensor.numel() != 1:
        raise ValueError(f"{target!r}: swaserve takes one KV-cache scale per layer, got shape {tuple(tensor.shape)}")
    value = float(tensor.float().reshape(()))
    if not (value > 0 and value < float("inf")):
        raise ValueError(f"{target!r}: a KV-cache scale must be positive and finite, got {value}")
    layer, kind = int(m.group(1)), m.group(2)
    entry = scales.setdefault(layer, {})
    for key in (("k_scale", "v_scale") if kind == "kv_scale" else (kind,)):
        entry[key] = value
    return True


def layer_kv_scales(scales: dict[int, dict[str, float]]) -> dict[int, tuple[float, float]]:
    """layer id -> (k_scale, v_scale); a layer that names only one of them keeps 1.0 for the other."""
    return {layer: (e.get("k_scale", 1.0), e.get("v_scale", 1.0)) for layer, e in scales.items()}
