"""`l2_prefetch`: pull a tensor's bytes into the GPU's L2 cache without reading them into an SM.

Each lane issues one `cp.async.bulk.prefetch.L2` (Hopper and newer) for a `chunk`-byte piece and the
program exits; the copy engine fetches in the background. A prefetch is only a hint: it never
changes a result, so a stale or partly evicted prefetch costs bandwidth, never correctness.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

CHUNK = 16384  # bytes per prefetch instruction
LANES = 128  # instructions per program


@triton.jit
def _l2_prefetch_kernel(base, nbytes, CHUNK: tl.constexpr, LANES: tl.constexpr):
    offs = (tl.program_id(0) * LANES + tl.arange(0, LANES)).to(tl.int64) * CHUNK
    live = offs < nbytes
    offs = tl.where(live, offs, 0)
    size = tl.minimum(nbytes - offs, CHUNK).to(tl.int32)  # a multiple of 16: nbytes is
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $3; mov.b32 $0, 0; }",
        "=r,l,r,r", [base + offs, live.to(tl.int32), size], dtype=tl.int32, is_pure=False, pack=1,
    )


@functools.cache
def l2_prefetch_supported(device_index: int) -> bool:
    """Bulk L2 prefetch needs compute capability 9.0 or newer."""
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def l2_prefetch(t: torch.Tensor, nbytes: int | None = None, chunk: int = CHUNK) -> None:
    """Start fetching the first `nbytes` (default: all) of contiguous CUDA tensor `t` into L2 on
    the current stream. The launch returns once the requests are issued, not when they land."""
    assert t.is_cuda and t.is_contiguous(), "prefetch a contiguous CUDA tensor"
    total = t.numel() * t.element_size()
    n = min(total, nbytes if nbytes is not None else total) // 16 * 16
    if n == 0 or t.data_ptr() % 16:
        return
    base = t.view(-1).view(torch.uint8)
    _l2_prefetch_kernel[(triton.cdiv(n, chunk * LANES),)](base, n, CHUNK=chunk, LANES=LANES, num_warps=4)
