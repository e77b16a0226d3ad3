"""Decode GEMMs on the GPU: cuBLAS (`torch.mm`) against `skinny_gemm` (split-K, partial sums left
for the next kernel) over Gemma 3 projection shapes and decode batch sizes, with a small sweep of
launch settings; for gate/up, cuBLAS + `act_and_mul` against `skinny_gated_gemm` (one launch).
Prints achieved weight bandwidth (weight bytes ÷ time).

    python benchmarks/skinny_gemm_sweep.py [--quick] [--shapes 1b,4b] [--batch-sizes 1,16,64]
        [--projs qkv,o,gate_up,down,gated]
    python benchmarks/skinny_gemm_sweep.py --smoke     # tiny shapes, Triton's interpreter on the CPU (CI)
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bench_device, graph_us, parse_args  # noqa: E402

# hidden, q heads, kv heads, head dim, intermediate (tiny: --smoke)
MODELS = {"1b": (1152, 4, 1, 256, 6912), "4b": (2560, 8, 4, 256, 10240), "12b": (3840, 16, 8, 256, 15360),
          "tiny": (64, 2, 1, 32, 128)}
STREAM_BYTES = 256 << 20  # weight copies cycled per graph so nothing is served from L2 (--stream-mb)


def projections(model: str) -> dict[str, tuple[int, int]]:
    hidden, hq, hkv, d, inter = MODELS[model]
    return {"qkv": ((hq + 2 * hkv) * d, hidden), "o": (hidden, hq * d), "gate_up": (2 * inter, hidden),
            "down": (hidden, inter)}


def weight_copies(N: int, K: int, g: torch.Generator, stream_bytes: int = STREAM_BYTES) -> list[torch.Tensor]:
    """Enough bf16 [N, K] weights (on `g`'s device) to cycle through `stream_bytes`, so each call streams
    from HBM."""
    return [torch.randn(N, K, device=g.device, generator=g, dtype=torch.bfloat16) * 0.02
            for _ in range(max(2, stream_bytes // (N * K * 2)))]


def result_row(model: str, proj: str, N: int, K: int, M: int, cublas: float, results: list, default_key) -> dict:
    """`results`: (us, block_n, block_k, stages, warps, splits) per config; the fastest is `best`."""
    results.sort()
    default = next((r for r in results if r[1:5] == default_key), results[0])
    best, nbytes = results[0], N * K * 2
    row = {"model": model, "proj": proj, "N": N, "K": K, "M": M, "cublas_us": round(cublas, 2),
           "cublas_tbps": round(nbytes / cublas / 1e6, 2), "default_us": round(default[0], 2),
           "best_us": round(best[0], 2), "best_tbps": round(nbytes / best[0] / 1e6, 2),
           "best": dict(zip(("block_n", "block_k", "stages", "warps", "splits"), best[1:])),
           "partial_mb": round(best[5] * M * N * 4 / 1e6, 2) if best[5] > 1 else 0.0}
    print(json.dumps(row), flush=True)
    return row


def gated_case(model: str, N: int, K: int, batch_sizes: list[int], configs, dev: torch.device,
               stream_bytes: int) -> list[dict]:
    from swaserve.kernels.activation import act_and_mul
    from swaserve.kernels.skinny_gemm import skinny_gated_gemm

    ws = weight_copies(N, K, torch.Generator(device=dev).manual_seed(0), stream_bytes)
    rows = []
    for M in batch_sizes:
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        out = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
        cublas = graph_us(lambda i, x=x, out=out: act_and_mul(torch.mm(x, ws[i].T, out=out), "gelu_tanh"), len(ws))
        results = []
        for bn, bk, stages, warps in configs:
            try:
                us = graph_us(lambda i, x=x, bn=bn, bk=bk, warps=warps, stages=stages: skinny_gated_gemm(
                    x, ws[i], "gelu_tanh", block_n=bn, block_k=bk, num_warps=warps, num_stages=stages), len(ws))
            except Exception as e:  # noqa: BLE001 -- a config over the shared-memory limit: report, go on
                print(f"# {model} gated M={M} bn{bn} bk{bk} st{stages} w{warps}: {type(e).__name__}")
                continue
            results.append((us, bn, bk, stages, warps, 1))
        rows.append(result_row(model, "gated", N, K, M, cublas, results, (64, 128, 3, 4)))
    return rows


def case(model: str, proj: str, N: int, K: int, batch_sizes: list[int], configs, dev: torch.device,
         stream_bytes: int) -> list[dict]:
    from swaserve.kernels.common import num_sms
    from swaserve.kernels.skinny_gemm import skinny_gemm, skinny_gemm_splits

    ws = weight_copies(N, K, torch.Generator(device=dev).manual_seed(0), stream_bytes)
    rows = []
    for M in batch_sizes:
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        out = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
        cublas = graph_us(lambda i, x=x, out=out: torch.mm(x, ws[i].T, out=out), len(ws))
        results = []
        for bn, bk, stages, warps, mult in configs:
            splits = max(1, int(skinny_gemm_splits(N, K, num_sms(dev), bn, bk) * mult))
            part = torch.empty((splits, M, N) if splits > 1 else (M, N), device=dev,
                               dtype=torch.float32 if splits > 1 else torch.bfloat16)
            try:
                us = graph_us(lambda i, x=x, s=splits, bn=bn, bk=bk, warps=warps, stages=stages, part=part: skinny_gemm(
                    x, ws[i], s, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages, out=part), len(ws))
            except Exception as e:  # noqa: BLE001 -- a config over the shared-memory limit: report, go on
                print(f"# {model} {proj} M={M} bn{bn} bk{bk} st{stages} w{warps}: {type(e).__name__}")
                continue
            results.append((us, bn, bk, stages, warps, splits))
        rows.append(result_row(model, proj, N, K, M, cublas, results, (64, 128, 4, 4)))
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="1b,4b", help=f"of {','.join(MODELS)}")
    ap.add_argument("--batch-sizes", default="1,16,64")
    ap.add_argument("--projs", default="qkv,o,gate_up,down,gated")
    ap.add_argument("--quick", action="store_true", help="the default launch settings only")
    ap.add_argument("--stream-mb", type=int, default=STREAM_BYTES >> 20, help="weight copies per graph")
    args = parse_args(ap, argv, smoke=dict(shapes="tiny", batch_sizes="3", quick=True, stream_mb=0))
    dev = bench_device(args.smoke)
    stream_bytes = args.stream_mb << 20
    if args.quick:
        configs = [(64, 128, 4, 4, 1.0)]
    else:
        configs = [c for c in itertools.product((32, 64, 128), (64, 128, 256), (4,), (4,), (0.5, 1.0, 2.0))
                   if c[0] * c[1] <= 128 * 128]
    gated_configs = [(64, 128, 3, 4)] if args.quick else list(
        itertools.product((32, 64, 128), (64, 128), (3, 4), (4, 8)))
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    projs = args.projs.split(",")
    rows = []
    for model in args.shapes.split(","):
        for proj, (N, K) in projections(model).items():
            if proj in projs:
                rows += case(model, proj, N, K, batch_sizes, configs, dev, stream_bytes)
        if "gated" in projs:
            N, K = projections(model)["gate_up"]
            rows += gated_case(model, N, K, batch_sizes, gated_configs, dev, stream_bytes)
    print(f"\n{'model':5} {'proj':8} {'M':>4} {'cuBLAS us':>9} {'TB/s':>5} {'ours us':>8} {'TB/s':>5} "
          f"{'default':>8}  best (bn bk stages warps splits)  partials MB")
    for r in rows:
        b = r["best"]
        print(f"{r['model']:5} {r['proj']:8} {r['M']:>4} {r['cublas_us']:>9} {r['cublas_tbps']:>5} {r['best_us']:>8} "
              f"{r['best_tbps']:>5} {r['default_us']:>8}  {b['block_n']} {b['block_k']} {b['stages']} {b['warps']} "
              f"{b['splits']}  {r['partial_mb']}")


if __name__ == "__main__":
    main()
