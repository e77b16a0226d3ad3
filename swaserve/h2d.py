"""Host-to-device copies that never wait for the device.

A copy from pageable host memory may make the driver wait for the stream (to stage the data), which
stalls the host while a launched step runs and defeats overlap scheduling. Staging through pinned
memory from the caching host allocator keeps every step-path copy asynchronous; the allocator only
reuses a pinned block once the copy that read it has completed.
"""

from __future__ import annotations

import torch


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """`dst.copy_(src)` for a CPU `src`, asynchronous when `dst` is on a GPU (no staging tensor)."""
    if dst.is_cuda:
        dst.copy_(src.pin_memory(), non_blocking=True)
    else:
        dst.copy_(src)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` (a CPU tensor) on `device`, copied asynchronously on the current stream when it is a GPU."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
