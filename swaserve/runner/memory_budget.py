"""How many bytes the KV pools may take on a device (the only place that asks CUDA for free memory)."""

from __future__ import annotations

import torch

from swaserve.config import CacheConfig


def kv_budget_bytes(device: torch.device, cache: CacheConfig) -> int:
    if cache.kv_cache_bytes is not None:
        if cache.kv_cache_bytes <= 0:
            raise ValueError("kv_cache_bytes must be positive")
        return int(cache.kv_cache_bytes)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        free, _total = torch.cuda.mem_get_info(device)
        if not 0 < cache.gpu_memory_fraction <= 1:
            raise ValueError("gpu_memory_fraction must be in (0, 1]")
        return int(free * cache.gpu_memory_fraction)
    return int(cache.cpu_kv_cache_bytes)
