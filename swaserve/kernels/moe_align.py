"""The fused MoE's pair sort: (token, slot) pairs grouped by expert into blocks of `block_m` rows, one
expert a block, without a host sync: one program at decode sizes, torch ops above them."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from swaserve.kernels.common import jit_per_batch
from swaserve.kernels.pdl import pdl_enter, pdl_kwargs

# Up to this many pairs (n * k) one program sorts them (`_align_kernel`: one launch, the decode case);
# above it the sort is ~30 torch ops, whose launches are small next to a prefill's GEMMs.
ALIGN_KERNEL_MAX_PAIRS = 2048
# The kernel sorts a power of two of pairs, at least this many: few compiled sizes (256 .. 2048).
_ALIGN_MIN_PAIRS = 256
_ALIGN_CHUNK = 512  # padding slots (or unused blocks) one step of the align kernel writes


def num_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Blocks every routing of `num_pairs` pairs fits in: each expert's run is padded by fewer than
    `block_m` rows, and each used block holds at least one pair."""
    return min(triton.cdiv(num_pairs + num_experts * (block_m - 1), block_m), num_pairs)


def align_pairs(
    topk_ids: torch.Tensor,  # [n, k] int: expert of each (token, slot)
    num_experts: int,
    block_m: int,
    row_valid: torch.Tensor | None = None,  # [n] bool: False rows route nothing
    use_kernel: bool | None = None,  # None: the one-program kernel when n*k <= ALIGN_KERNEL_MAX_PAIRS
    expert_start: int = 0,  # expert parallelism: the weights hold global experts expert_start + 0..E-1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group the n*k pairs by expert into blocks of `block_m` rows, one expert per block.

    Returns `sorted_pairs` `[blocks * block_m]` int32 (pair index t*k + j, or the sentinel n*k in
    padding) and `block_expert` `[blocks]` int32 (-1: an unused block), `blocks = num_blocks(...)`.
    Used blocks come first, experts in ascending order (local index `topk_ids - expert_start`), each
    expert's pairs in token order; pairs whose expert is outside `expert_start .. + E - 1` (another
    rank's) are left out like invalid rows'. Both paths give identical results and use only device
    work sized from n: no host sync."""
    n, k = topk_ids.shape
    N, E, dev = n * k, num_experts, topk_ids.device
    blocks = num_blocks(N, E, block_m)
    if use_kernel if use_kernel is not None else N <= ALIGN_KERNEL_MAX_PAIRS:
        ids = topk_ids if topk_ids.is_contiguous() else topk_ids.contiguous()
        sorted_pairs = torch.empty(blocks * block_m, dtype=torch.int32, device=dev)
        block_expert = torch.empty(blocks, dtype=torch.int32, device=dev)
        valid = row_valid.view(torch.uint8) if row_valid is not None else ids  # bool as bytes
        pairs = max(triton.next_power_of_2(N), _ALIGN_MIN_PAIRS)
        _align_kernel[(1,)](
            ids, valid, sorted_pairs, block_expert, N, blocks,
            TOP_K=k, E=E, E_PAD=triton.next_power_of_2(E), HAS_VALID=row_valid is not None,
            EXPERT_START=expert_start, BLOCK_M=block_m, PAIRS=pairs, CHUNK=_ALIGN_CHUNK,
            num_warps=4 if pairs <= 1024 else 8, **pdl_kwargs(ids),
        )
        return sorted_pairs, block_expert
    ids = topk_ids.reshape(-1).long()
    if expert_start:
        ids = ids - expert_start
    if row_valid is not None:
        ids = torch.where(row_valid[:, None].expand(n, k).reshape(-1), ids, E)  # sentinel expert E sorts last
    ids = torch.where((ids >= 0) & (ids < E), ids, E)  # another rank's expert: the sentinel too
    counts = torch.zeros(E + 1, dtype=torch.int64, device=dev).scatter_add_(0, ids, torch.ones_like(ids))[:E]
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)  # [E] padded end of each expert's run
    starts = ends - padded
    order = torch.sort(ids, stable=True).indices  # pairs grouped by expert, token order inside
    sorted_ids = ids[order]
    first = counts.cumsum(0) - counts  # [E] start of each expert's run in `order`
    real = sorted_ids < E
    e = sorted_ids.clamp(max=E - 1)
    rank = torch.arange(N, device=dev) - first[e]
    spare = blocks * block_m
    dest = torch.where(real, starts[e] + rank, spare)  # sentinel pairs (invalid rows) go to the spare slot
    sorted_pairs = torch.full((spare + 1,), N, dtype=torch.int32, device=dev)
    sorted_pairs.scatter_(0, dest, order.to(torch.int32))
    be = torch.searchsorted(ends, torch.arange(blocks, device=dev) * block_m, right=True)
    block_expert = torch.where(be < E, be, -1).to(torch.int32)
    return sorted_pairs[:-1], block_expert


@jit_per_batch("num_pairs", "blocks")
def _align_kernel(
    ids_ptr, valid_ptr, sorted_pairs, block_expert, num_pairs, blocks,
    TOP_K: tl.constexpr, E: tl.constexpr, E_PAD: tl.constexpr, HAS_VALID: tl.constexpr,
    EXPERT_START: tl.constexpr, BLOCK_M: tl.constexpr, PAIRS: tl.constexpr, CHUNK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """`align_pairs` in one program over all `PAIRS >= num_pairs` pairs at once. A histogram counts
    each expert's pairs and lays the padded runs out; one sort of the keys `expert * PAIRS + pair`
    (left-out pairs after every expert) groups the pairs by expert in token order, so the pair at
    sorted position i goes to its run's start plus i minus its expert's first sorted position. The
    first slot of every used block holds a pair, which names the block's expert. Real slots and
    padding slots are disjoint sets, so no store overwrites another."""
    pdl_enter(USE_PDL)
    p = tl.arange(0, PAIRS)
    e = _pair_expert(ids_ptr, valid_ptr, p, num_pairs, TOP_K, HAS_VALID, EXPERT_START, E)
    counts = tl.histogram(e, E_PAD, mask=e >= 0)  # [E_PAD]; experts >= E count nothing
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)  # [E_PAD] padded end of each run
    starts = ends - padded
    first = tl.cumsum(counts, axis=0) - counts  # [E_PAD] each expert's first position in sorted order
    key = tl.sort(tl.where(e >= 0, e, E_PAD) * PAIRS + p)
    se, sp = key // PAIRS, key % PAIRS  # expert and pair at each sorted position
    placed = se < E_PAD
    dest = p + tl.gather(starts - first, tl.where(placed, se, 0), 0)
    tl.store(sorted_pairs + dest, sp, mask=placed)
    tl.store(block_expert + dest // BLOCK_M, se, mask=placed & (dest % BLOCK_M == 0))
    # Padding: each run's tail [start + count, end), then every slot (and block) after the last run.
    tail = starts[:, None] + counts[:, None] + tl.arange(0, BLOCK_M)[None, :]  # [E_PAD, BLOCK_M]
    tl.store(sorted_pairs + tail, tl.full([E_PAD, BLOCK_M], 0, tl.int32) + num_pairs,
             mask=tail < ends[:, None])
    total = tl.sum(padded, axis=0)
    for s0 in range(total, blocks * BLOCK_M, CHUNK):
        s = s0 + tl.arange(0, CHUNK)
        tl.store(sorted_pairs + s, tl.full([CHUNK], 0, tl.int32) + num_pairs, mask=s < blocks * BLOCK_M)
    for b0 in range(total // BLOCK_M, blocks, CHUNK):
        b = b0 + tl.arange(0, CHUNK)
        tl.store(block_expert + b, tl.full([CHUNK], -1, tl.int32), mask=b < blocks)


@triton.jit
def _pair_expert(ids_ptr, valid_ptr, p, num_pairs, TOP_K: tl.constexpr, HAS_VALID: tl.constexpr,
                 EXPERT_START: tl.constexpr, E: tl.constexpr):
    """Local expert of pairs `p` [CHUNK]; -1 past the end, for invalid rows and for experts outside
    `EXPERT_START .. EXPERT_START + E - 1` (another rank's)."""
    ok = p < num_pairs
    if HAS_VALID:
        ok = ok & (tl.load(valid_ptr + p // TOP_K, mask=ok, other=0) != 0)
    e = tl.load(ids_ptr + p, mask=ok, other=-1).to(tl.int32) - EXPERT_START
    return tl.where(ok & (e >= 0) & (e < E), e, -1)
