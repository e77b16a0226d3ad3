"""How many bytes the KV pools may take on a device, and how much memory it has (the only place that asks
CUDA for free or total memory)."""

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


def device_memory_gib(device: torch.device) -> float | None:
    """Total memory of a CUDA device in GiB (what the engine defaults are sized from); None elsewhere."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).total_memory / (1 << 30)


def release_device_memory(device: torch.device) -> None:
    """Wait for `device`'s queued work, then hand PyTorch's cached blocks back to the driver (an engine
    that closed has dropped its tensors and graphs: another process, or engine, can take the memory).
    cuBLAS keeps a workspace per stream it ran on (32 MiB each on Hopper) for the life of the process,
    and a live block keeps its whole cached segment reserved: after a TP engine's close on an H200, rank 0
    held 1.0 GiB reserved for 0.09 GiB allocated, the largest live blocks three of 32 MiB. The workspaces
    go too (the next GEMM makes its own again); that this frees the 1.0 GiB is not yet measured."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)  # CUDA builds of torch
        if clear_workspaces is not None:
            clear_workspaces()
        torch.cuda.empty_cache()
