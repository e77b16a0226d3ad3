"""Batch-1 projections on the GPU: the library GEMM (`F.linear`, cuBLAS) against `kernels.gemv` (one
program a block of weight rows over the whole of K, no split, no reduce launch) over the dense
projections of Gemma 3 1B / 4B, Gemma-4-26B-A4B (sliding and full layers) and GPT-OSS-20B (with
biases), one row, the default launch settings and a sweep of others. Timed in CUDA graphs over
enough weight copies that each call streams from HBM (`skinny_gemm_sweep.weight_copies`); prints
achieved weight bandwidth (weight bytes / time), the fraction of the measured copy bandwidth, and
whether the layers take the kernel for that shape (`gemv.use_gemv`: outputs at most twice the input; never
on the CPU).

    python benchmarks/gemv_sweep.py [--models 1b,4b,g4,gptoss] [--quick]
    python benchmarks/gemv_sweep.py --smoke     # tiny shapes, Triton's interpreter on the CPU (CI)
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bench_device, copy_bandwidth, graph_us, parse_args
from skinny_gemm_sweep import STREAM_BYTES, weight_copies

# (name, N, K, bias) per model: the projections one decode step runs per layer, as the engine merges them
SHAPES = {
    "1b": [("qkv", 1536, 1152, False), ("o", 1152, 1024, False), ("gate_up", 13824, 1152, False),
           ("down", 1152, 6912, False)],
    "4b": [("qkv", 4096, 2560, False), ("o", 2560, 2048, False), ("gate_up", 20480, 2560, False),
           ("down", 2560, 10240, False)],
    "g4": [("qkv", 8192, 2816, False), ("o", 2816, 4096, False), ("qkv_full", 9216, 2816, False),
           ("o_full", 2816, 8192, False), ("gate_up", 4224, 2816, False), ("down", 2816, 2112, False)],
    "gptoss": [("qkv", 5120, 2880, True), ("o", 2880, 4096, True)],
    "tiny": [("qkv", 96, 64, True), ("o", 64, 96, False)],
}


def case(model: str, name: str, N: int, K: int, bias: bool, configs, dev: torch.device, stream_bytes: int,
         bw: float) -> dict:
    from swaserve.kernels.common import num_sms
    from swaserve.kernels.gemv import gemv, gemv_config, use_gemv

    ws = weight_copies(N, K, torch.Generator(device=dev).manual_seed(0), stream_bytes)
    b = torch.randn(N, device=dev, dtype=torch.bfloat16) if bias else None
    default = gemv_config(N, K, num_sms(dev) if dev.type == "cuda" else 8)
    x = torch.randn(1, K, device=dev, dtype=torch.bfloat16)
    out = torch.empty(1, N, device=dev, dtype=torch.bfloat16)
    err = (gemv(x, ws[0], b).float() - F.linear(x, ws[0], b).float()).abs().max().item()
    lib = graph_us(lambda i: F.linear(x, ws[i], b), len(ws))
    results = []
    for bn, bk, warps in [default] + [c for c in configs if c != default]:
        try:
            us = graph_us(lambda i, bn=bn, bk=bk, w=warps: gemv(x, ws[i], b, block_n=bn, block_k=bk, num_warps=w,
                                                                out=out), len(ws))
        except Exception as e:  # noqa: BLE001 -- a launch over a limit: report, go on
            print(f"# {model} {name} bn{bn} bk{bk} w{warps}: {type(e).__name__}")
            continue
        results.append((us, bn, bk, warps))
    ours, best = results[0], min(results)
    nbytes = N * K * 2
    row = {"model": model, "proj": name, "N": N, "K": K, "bias": bias, "taken": use_gemv(x, ws[0]),
           "max_abs_err": err, "cublas_us": round(lib, 2), "cublas_tbps": round(nbytes / lib / 1e6, 2),
           "gemv_us": round(ours[0], 2), "gemv_tbps": round(nbytes / ours[0] / 1e6, 2),
           "gemv_of_copy": round(nbytes / ours[0] / 1e6 / (bw / 1e12), 3), "default": list(default),
           "best_us": round(best[0], 2), "best": list(best[1:]),
           "all": {f"{bn} {bk} {w}": round(us, 2) for us, bn, bk, w in results}}
    print(json.dumps(row), flush=True)
    return row


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="1b,4b,g4,gptoss", help=f"of {','.join(SHAPES)}")
    ap.add_argument("--quick", action="store_true", help="the default launch settings only")
    ap.add_argument("--stream-mb", type=int, default=STREAM_BYTES >> 20, help="weight copies per graph")
    args = parse_args(ap, argv, smoke={"models": "tiny", "quick": True, "stream_mb": 0})
    dev = bench_device(args.smoke)
    bw = copy_bandwidth(dev) if dev.type == "cuda" else 1e12
    configs = [] if args.quick else list(itertools.product((2, 4, 8), (512, 1024), (4, 8)))
    rows = []
    for model in args.models.split(","):
        for name, N, K, bias in SHAPES[model]:
            rows.append(case(model, name, N, K, bias, configs, dev, args.stream_mb << 20, bw))
    print(f"\ncopy bandwidth {bw / 1e12:.2f} TB/s")
    print(f"{'model':6} {'proj':9} {'N':>6} {'K':>6} {'taken':>5} {'cuBLAS us':>9} {'TB/s':>5} {'gemv us':>8} "
          f"{'TB/s':>5} {'of copy':>7} {'best us':>8}  best (bn bk warps)")
    for r in rows:
        print(f"{r['model']:6} {r['proj']:9} {r['N']:>6} {r['K']:>6} {'yes' if r['taken'] else 'no':>5} {r['cublas_us']:>9} "
              f"{r['cublas_tbps']:>5} {r['gemv_us']:>8} {r['gemv_tbps']:>5} {r['gemv_of_copy']:>7} {r['best_us']:>8}  "
              f"{' '.join(map(str, r['best']))}")


if __name__ == "__main__":
    main()
