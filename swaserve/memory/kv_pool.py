"""K/V storage of one pool: per-layer K and V buffers indexed by slot."""

from __future__ import annotations

import torch


class KVPool:
    """Per-layer K and V buffers `[size + 1, kv_heads, head_dim]`; row 0 is the dummy slot.

    K and V head dims may differ (MiMo-V2: 192 / 128). Layer ids here are local to the pool; the
    hybrid `SWAKVPool` maps global layer ids onto its two pools.
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

    def k_buffer(self, layer: int) -> torch.Tensor:
        return self._k[layer]

    def v_buffer(self, layer: int) -> torch.Tensor:
        return self._v[layer]

    def set_kv(self, layer: int, locs: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write K/V rows of new tokens; `locs` are slots of *this* pool, `[n]` int32/int64 on device."""
        self._k[layer][locs] = k.to(self.dtype)
        self._v[layer][locs] = v.to(self.dtype)

    def bytes_per_token(self) -> int:
        return self.num_layers * self.num_kv_heads * (self.k_head_dim + self.v_head_dim) * self._k[0].element_size() if self.num_layers else 0

    def total_bytes(self) -> int:
        return self.bytes_per_token() * (self.size + 1)
