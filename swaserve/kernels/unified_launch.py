"""Launch settings of the unified attention kernel (`unified_attention`), from static shapes only (head
dims, GQA group, dtype, layer kind, the launch's request and token counts), never from a batch's contents:
what lets a launch be captured, and what keeps a query's reduction order fixed."""

from __future__ import annotations

import os

import torch
import triton

BLOCK_M = 64  # rows of an extend tile: (token, query head of the kv head's group) pairs
DECODE_BLOCK_M = 16  # rows of a decode tile at least (one token's query heads, padded: the MMA's minimum)
MAX_BLOCK_PARTIALS = 256  # per-block decode programs only where a query has at most this many partials
# Decode programs per (request, kv head) from this many per SM: H100, Gemma 3 heads, 1,024-key contexts
# (results/h100_unified_attention_sweep_request_programs_slots.log): chunk programs win at 128 pairs
# (1-5%), request programs at 192 and more (3-11%), within 1-4% of the default kernel there.
REQUEST_PROGRAM_WAVES = 1.25
PROGRAMS = ("block", "chunk", "request")
# Extend programs reduce their keys in one loop (`unified_reduce._keys_flat`, the chunk loop's bits) where
# the device holds its launch (5 pipeline stages at d256 in bf16, 232,448 B of shared memory: sm_90's limit),
# so the next key block's K/V loads across a chunk's end. One H200, us a layer, chunk loop -> one loop at each
# shape's default tile (benchmarks/results/h200_unified_flat_2026-11-29.log): 1B 1x1024 full / sliding 54.3 /
# 44.8 -> 52.1 / 37.6 (32 rows), 4B 1x1024 65.1 / 55.9 -> 63.9 / 50.4, 1B 4x2048 305.1 / 204.8 -> 290.2 /
# 183.8, 4B 4x2048 554.8 / 386.4 -> 520.2 / 338.7 (64 rows); in the 1B shape's whole-graph steps of 512-2048
# tokens 11-20% less attention time, the steps 1-5% shorter. SWASERVE_UNIFIED_FLAT=0 / 1: off / on whatever
# the device.
UNIFIED_FLAT = {"0": False, "1": True}.get(os.environ.get("SWASERVE_UNIFIED_FLAT", ""))
FLAT_SHARED_MEMORY = 232_448
_FLAT: dict[torch.device, bool] = {}


def flat_extend(device: torch.device) -> bool:
    """Whether extend launches on `device` take the one-loop form: `UNIFIED_FLAT` when set, else where the
    device's shared memory a block may opt into holds its 64-row launch (Hopper and later)."""
    if UNIFIED_FLAT is not None:
        return UNIFIED_FLAT
    if device.type != "cuda":
        return False
    if device not in _FLAT:
        props = torch.cuda.get_device_properties(device)
        _FLAT[device] = getattr(props, "shared_memory_per_block_optin", 0) >= FLAT_SHARED_MEMORY
    return _FLAT[device]


def extend_tile_queries(group: int, rows: int = BLOCK_M) -> int:
    """Queries an extend tile of `rows` rows holds: its rows over the GQA group padded to a power of two."""
    return rows // triton.next_power_of_2(group)


def extend_tile_rows(tokens: int, group_p: int, kv_heads: int, sms: int) -> int:
    """Rows of the extend tiles of a launch over `tokens` queries: the tallest of 64, 32 and 16 whose tiles
    (x kv heads: the programs) fill 7/8 of the SMs, else the shortest that holds a GQA group. A short
    prefill's 64-row tiles leave most SMs idle: Gemma-3-1B (one kv head, 4 queries a token) has 32 of them
    at 512 tokens for 132 SMs. One H200, bf16, d256, one request's prefill, us per layer, full / sliding
    (`unified_attention_sweep.py --extend`, benchmarks/results/h200_unified_extend_tiles_2026-11-29.log):

        1B 512 tokens:  64 rows 37.4 / 48.2, 32 rows 29.3 / 36.9, 16 rows 27.4 / 30.1   (32 / 64 / 128 programs)
        1B 1024:        64 rows 63.0 / 55.3, 32 rows 53.8 / 44.4, 16 rows 54.8 / 39.0   (64 / 128 / 256)
        4B 512:         64 rows 35.8 / 48.8, 32 rows 29.6 / 40.5, 16 rows 32.8 / 36.7   (64 / 128 / 256)
        4B 1024:        64 rows 65.3 / 54.9, 32 rows 81.6 / 77.8                        (128 / 256)
        4 x 2048 (1B, 4B): 64 rows fastest by 1.1-2x

    A tile's height changes no query's bits: every reduction along a row is independent of it
    (`unified_attention`'s module docstring), as the 16-row decode and 64-row extend tiles already show."""
    floor = max(DECODE_BLOCK_M, group_p)
    for rows in (BLOCK_M, BLOCK_M // 2, BLOCK_M // 4):
        if rows < floor:
            break
        if 8 * -(-tokens * group_p // rows) * kv_heads >= 7 * sms:
            return rows
    return floor


def extend_launch(rows: int, block_d: int, elem_bytes: int, flat: bool = False) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) of an extend program of `rows` rows: `unified_config`'s, with 4 warps
    and at most 2 stages for a 16-row tile (1B and 4B at 512-1024 tokens: 16 x 4 x 2 within 5% of the best
    16-row setting or faster; 16 x 8 x 3 up to 1.5x slower, same sweep); `flat` (`flat_extend`): 5 stages
    for 32 and 64 rows at d256 in bf16 (at 32 rows 3 and 5 stages measured within 3-7% of each other, either
    way round: the sweep's 1B 1x1024 layers favoured 3, the whole-graph steps 5)."""
    block_n, warps, stages = unified_config(block_d, elem_bytes)
    if rows <= DECODE_BLOCK_M:
        return block_n, 4, min(stages, 2)
    if flat and block_d == 256 and elem_bytes == 2:
        return block_n, warps, 5
    return block_n, warps, stages


def unified_config(block_d: int, elem_bytes: int) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) of an extend program by padded head dim and element size: a
    layer's constants, never the batch's. Wide heads and fp32 take narrower key blocks (shared
    memory); from d256 a program holds three [64, d] float32 tiles (result, chunk, block), so 8 warps
    keep them in registers (H100, 4 x 2048-token prefill, d256: 305 against 491 us with 4 warps,
    `unified_attention_sweep.py --extend`). A float32 d512 program stages one block at a time: with two
    in flight it needs 264 KiB of shared memory, beyond an H100's or H200's 227 (196608 B with one,
    `tests/kernels/compile_sm90.py`; Gemma 4's full layers in fp32)."""
    if elem_bytes >= 4 and block_d > 256:
        return 32, 4, 1
    if elem_bytes >= 4 and block_d > 128:
        return 32, 4, 2
    if block_d > 256:
        return 32, 8, 2
    if block_d == 256:
        return 64, 8, 3
    return 64, 4, 2


def decode_config(group_p: int, sliding: bool, programs: str = "chunk",
                  fp8_warps: int | None = None) -> tuple[int, int, int]:
    """(rows, num_warps, num_stages) of a decode program: one token's query heads in the smallest
    tile the MMA takes; its key block is the extend tile's. A sliding layer's keys sit behind a
    gather more (its window's slot table, or the table then `full_to_swa`): a third stage in flight
    helps there, and in a program that streams a request's whole context, not in a full layer's
    chunk or block program (H100, benchmarks/results/h100_unified_attention_sweep*.log).

    `fp8_warps` (an e4m3 pool): the extend tile's 64 rows and warps. On the older MMA that a 16-row tile
    gets, a tile loaded as e4m3 bytes is fed as operands 4 wide along K (bf16: 2; `tests/kernels/
    compile_sm90.py` shows it): another summation order, so an FP8 pool's decode parted from its extend
    and from a bf16 pool holding the same values by a few outputs (H200, tests/gpu/test_unified_fp8_gpu.py).
    The 64-row tile (the warpgroup MMA, as the extend) agrees, at twice the deterministic decode step
    (docs/memory.md, which also has the 16-row variants tried and measured). With `kv_quant.fp8_cvt_asm`
    (the default on sm_89+) the tiles are staged as fp16 (operands 2 wide, as bf16's) and the caller keeps
    the 16-row tile: decode == extend == a bf16 pool on an H200, at half the 64-row tile's step."""
    stages = 3 if sliding or programs == "request" else 2
    if fp8_warps is not None:
        return BLOCK_M, fp8_warps, stages
    return max(DECODE_BLOCK_M, group_p), 4, stages


def decode_chunks(max_context: int, chunk: int, window: int | None) -> int:
    """Key chunks a decode query can overlap: all of `max_context`'s, or as many as a window spans."""
    nc = triton.cdiv(max_context, chunk)
    return nc if window is None else min(nc, (window - 1) // chunk + 2)


def decode_programs(pairs: int, chunks: int, blocks_per_chunk: int, sms: int) -> str:
    """How a decode step spreads `pairs` (request, kv head) queries over programs, from static
    shapes only: one program per key block where chunk programs would leave most SMs idle (a few
    requests; partials stay few), one per request where those alone fill the SMs `REQUEST_PROGRAM_WAVES`
    times over (no partials, no merge, no programs past a short context's last chunk), else one per
    chunk. The same bits every way: each block's state from zero, folded in one order."""
    if pairs * chunks < sms and chunks * blocks_per_chunk <= MAX_BLOCK_PARTIALS:
        return "block"
    return "request" if pairs >= REQUEST_PROGRAM_WAVES * sms else "chunk"
