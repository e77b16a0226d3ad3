"""Deterministic mode's GEMM (`bi_linear`) on the GPU, per Gemma 3 projection and batch size M:
cuBLAS (`F.linear`, the default mode) against `bi_linear` with its tiling rule and other tilings;
and the fact the rule rests on, checked bitwise: every tiling, split or not, gives each row the same bits at every M.

    python benchmarks/bi_gemm_sweep.py [--shapes 1b,4b] [--ms 1,8,64,256,512,2048,8192]

Times are CUDA-graph replays cycling weight copies (nothing served from L2); "roof" is the time
floor max(bytes / HBM bandwidth, FLOPs / bf16 dense peak) over the measured time.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import graph_us  # noqa: E402
from skinny_gemm_sweep import projections, weight_copies  # noqa: E402

from swaserve.kernels import bi_matmul  # noqa: E402
from swaserve.kernels.bi_matmul import Tiling, bi_linear  # noqa: E402

HBM, PEAK = 3.35e12, 989e12  # H100 SXM: bytes/s, bf16 dense FLOP/s
CANDIDATES = [Tiling(16, 32, 4, 6), Tiling(16, 64, 4, 4), Tiling(16, 64, 4, 6), Tiling(64, 64, 4, 4),
              Tiling(64, 128, 4, 4), Tiling(128, 128, 4, 4), Tiling(128, 128, 8, 3), Tiling(128, 128, 8, 4),
              Tiling(128, 256, 8, 3)]


def floor_us(M: int, N: int, K: int) -> float:
    return max(2 * (M * K + N * K + M * N) / HBM, 2 * M * N * K / PEAK) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="1b,4b")
    ap.add_argument("--ms", default="1,8,64,128,256,512,2048,8192")
    ap.add_argument("--projs", default="qkv,o,gate_up,down,lm_head")
    args = ap.parse_args()
    ms = [int(m) for m in args.ms.split(",")]
    g = torch.Generator(device="cuda").manual_seed(0)
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, bf16")
    mismatches = 0
    rows = []
    for shape in args.shapes.split(","):
        projs = projections(shape) | {"lm_head": (262144, projections(shape)["o"][0])}
        for proj, (N, K) in projs.items():
            if proj not in args.projs.split(","):
                continue
            ws = weight_copies(N, K, g)
            chunks = bi_matmul.num_chunks(N, K, bi_matmul.num_sms(ws[0].device))
            proj_ms = [m for m in ms if proj != "lm_head" or m <= 512]
            xs = torch.randn(max(proj_ms), K, device="cuda", generator=g, dtype=torch.bfloat16)
            ref = bi_linear(xs, ws[0], tile=CANDIDATES[3], split=False)
            for M in proj_ms:
                x = xs[:M]
                for t in CANDIDATES:  # the invariance the tiling table rests on
                    for split in (False, True):
                        if not torch.equal(bi_linear(x, ws[0], tile=t, split=split), ref[:M]):
                            mismatches += 1
                            print(f"MISMATCH {shape} {proj} M={M} {t} split={split}")
                cublas = graph_us(lambda i: F.linear(x, ws[i % len(ws)]), 8)
                table = graph_us(lambda i: bi_linear(x, ws[i % len(ws)]), 8)
                per_tile = {f"{t.block_m}x{t.block_n}w{t.num_warps}s{t.num_stages}":
                            round(graph_us(lambda i: bi_linear(x, ws[i % len(ws)], tile=t), 8), 1) for t in CANDIDATES}
                best = min(per_tile, key=per_tile.get)
                row = dict(shape=shape, proj=proj, N=N, K=K, M=M, chunks=chunks[0], cublas_us=round(cublas, 1),
                           table_us=round(table, 1), best=best, best_us=per_tile[best],
                           floor_us=round(floor_us(M, N, K), 1), tilings=per_tile)
                print(json.dumps(row), flush=True)
                rows.append(row)
            del ws
            torch.cuda.empty_cache()
    print(f"\n{'shape':<5} {'proj':<8} {'M':>5} {'ch':>3} {'cuBLAS':>7} {'table':>7} {'table/cuBLAS':>12} "
          f"{'roof':>5}  best tiling")
    for r in rows:
        print(f"{r['shape']:<5} {r['proj']:<8} {r['M']:>5} {r['chunks']:>3} {r['cublas_us']:>7} {r['table_us']:>7} "
              f"{r['table_us'] / r['cublas_us']:>11.2f}x {r['floor_us'] / r['table_us']:>5.0%}  "
              f"{r['best']} {r['best_us']}")
    print(f"\ninvariance: {mismatches} mismatching (tiling, split, M) cases of "
          f"{len(rows) * len(CANDIDATES) * 2}")


if __name__ == "__main__":
    main()
