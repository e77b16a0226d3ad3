"""K/V storage of one pool: per-layer K and V buffers indexed by slot, in the model dtype or FP8 e4m3
with a float32 scale per layer (`quantize_kv` / `dequantize_kv` define the FP8 storage once)."""

from __future__ import annotations

import torch

FP8_KV = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value: stored values saturate there


def quantize_kv(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`x` (any float dtype) -> e4m3fn: `x / scale` in float32, clamped to +-448, rounded to nearest
    even. The store kernels (`kernels.kv_quant`) compute the same bits."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_KV)


def dequantize_kv(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e4m3fn rows -> float32 `x * scale` (exact: e4m3 widens to float32 exactly, then one rounding)."""
    return x.float() * scale


class KVPool:
    """Per-layer K and V buffers `[size + 1, kv_heads, head_dim]`; row 0 is the dummy slot.

    K and V head dims may differ (MiMo-V2: 192 / 128). Layer ids here are local to the pool; the
    hybrid `SWAKVPool` maps global layer ids onto its two pools.

    FP8 (`dtype=torch.float8_e4m3fn`): a buffer holds `x / scale` as e4m3 and reads back as
    `e4m3 * scale`, with one static float32 scale per layer for K and one for V (`k_scale`, `v_scale`:
    1.0, or a checkpoint's calibrated scales through `set_scales` before the first write).
    """

    def __init__(
        self,
        size: int,
        num_layers: int,
        num_kv_heads: int,
        k_head_dim: int,
        v_head_dim: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        self.size = size
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.k_head_dim = k_head_dim
        self.v_head_dim = v_head_dim or k_head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self._k = [
            torch.zeros(size + 1, num_kv_heads, k_head_dim, dtype=dtype, device=self.device) for _ in range(num_layers)
        ]  # each [size+1, kv_heads, k_head_dim], device
        self._v = [
            torch.zeros(size + 1, num_kv_heads, self.v_head_dim, dtype=dtype, device=self.device)
            for _ in range(num_layers)
        ]  # each [size+1, kv_heads, v_head_dim], device
        # FP8 only: [num_layers] float32, device; kernels read layer i's as a pointer (graph-safe).
        self.k_scale = torch.ones(num_layers, dtype=torch.float32, device=self.device) if self.is_fp8 else None
        self.v_scale = torch.ones(num_layers, dtype=torch.float32, device=self.device) if self.is_fp8 else None

    @property
    def is_fp8(self) -> bool:
        return self.dtype == FP8_KV

    def k_buffer(self, layer: int) -> torch.Tensor:
        return self._k[layer]

    def v_buffer(self, layer: int) -> torch.Tensor:
        return self._v[layer]

    def scales(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """FP8: `(k_scale, v_scale)` of `layer`, each `[1]` float32 on the device (views); else None."""
        if self.k_scale is None or self.v_scale is None:
            return None
        return self.k_scale[layer : layer + 1], self.v_scale[layer : layer + 1]

    def set_scales(self, layer: int, k_scale: float, v_scale: float) -> None:
        """A layer's static FP8 scales (a checkpoint's k_scale / v_scale); positive and finite."""
        assert self.k_scale is not None and self.v_scale is not None, "scales belong to an FP8 pool"
        for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
            if not (s > 0 and s < float("inf")):
                raise ValueError(f"{name} of KV layer {layer} must be positive and finite, got {s}")
        self.k_scale[layer] = k_scale
        self.v_scale[layer] = v_scale

    def set_kv(self, layer: int, locs: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write K/V rows of new tokens; `locs` are slots of *this* pool, `[n]` int32/int64 on device."""
        sc = self.scales(layer)
        if sc is None:
            self._k[layer][locs] = k.to(self.dtype)
            self._v[layer][locs] = v.to(self.dtype)
            return
        # uint8 views: index_put on float8 tensors is not implemented on every device.
        self._k[layer].view(torch.uint8)[locs] = quantize_kv(k, sc[0]).view(torch.uint8)
        self._v[layer].view(torch.uint8)[locs] = quantize_kv(v, sc[1]).view(torch.uint8)

    def read(self, layer: int, slots: torch.Tensor, value: bool = False) -> torch.Tensor:
        """K (or V) rows at `slots` (any shape of int indices) `[*slots.shape, kv_heads, dim]`: as stored,
        or dequantised to float32 for an FP8 pool (the reference backends' view of the cache)."""
        buf = self._v[layer] if value else self._k[layer]
        sc = self.scales(layer)
        if sc is None:
            return buf[slots]
        return dequantize_kv(buf.view(torch.uint8)[slots].view(FP8_KV), sc[1 if value else 0])

    def bytes_per_token(self) -> int:
        return self.num_layers * self.num_kv_heads * (self.k_head_dim + self.v_head_dim) * self._k[0].element_size() if self.num_layers else 0

    def total_bytes(self) -> int:
        return self.bytes_per_token() * (self.size + 1)
