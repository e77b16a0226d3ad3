"""Block-FP8 GEMM and FP8 MoE experts against bf16 at real shapes: MiMo-V2-Flash and Gemma-4-26B-A4B
projections (N x K) and expert blocks, decode rows (1-256) and prefill rows (2k-16k).

Per (shape, rows): bf16 (`F.linear`, cuBLAS; `fused_moe` on bf16 experts), FP8 weight-only (bf16
activations, weights upcast in registers) and FP8 W8A8 (activations quantised per row and 128 inputs,
fp8 MMAs; the quantiser's launch included), each timed in a CUDA graph. Reported: microseconds, GB/s of
the bytes the call must read (weights as stored, plus activations in and out; MoE: the experts the
routing hits), the fraction of the measured copy bandwidth, and TFLOP/s (2 M N K). JSON lines, a
table, then one summary row per (shape, rows): bf16 against the faster FP8 mode and the mode `fp8_gemm`
picks by default (`W8A8_MIN_ROWS`) — the numbers that set that threshold.

    python benchmarks/fp8_gemm.py [--model mimo-v2-flash|gemma4-26b-a4b|all] [--rows 1,16,64,256,2048,8192,16384]
    python benchmarks/fp8_gemm.py --smoke     # tiny shapes, Triton's interpreter on the CPU (CI)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bench_device, copy_bandwidth, graph_us, hardware, parse_args

# (name, N, K) of the dense projections; (hidden, experts, top-k, intermediate) of the experts.
GEMMS = {
    "mimo-v2-flash": [("qkv_swa", 14848, 4096), ("qkv_full", 13568, 4096), ("dense_gate_up", 32768, 4096),
                      ("dense_down", 4096, 16384)],
    "gemma4-26b-a4b": [("qkv_swa", 8192, 2816), ("o_proj", 2816, 4096), ("gate_up", 4224, 2816),
                       ("down", 2816, 2112)],
    "tiny": [("qkv", 96, 160), ("down", 64, 272)],
}
EXPERTS = {"mimo-v2-flash": (4096, 256, 8, 2048), "gemma4-26b-a4b": (2816, 128, 8, 704), "tiny": (160, 8, 2, 136)}
PREFILL_MOE_MAX = 8192  # expert rows beyond this: the routed (n x k) buffers alone are GBs


def _dense(name: str, N: int, K: int, rows: list[int], dev: torch.device, bw: float, calls: int) -> list[dict]:
    from swaserve.kernels.fp8_gemm import W8A8_MIN_ROWS, fp8_gemm
    from swaserve.layers import fp8

    g = torch.Generator(device=dev).manual_seed(0)
    w = (0.02 * torch.randn(N, K, generator=g, device=dev)).bfloat16()
    q, s = fp8.quantize(w)
    out = []
    for m in rows:
        xs = [torch.randn(m, K, generator=g, device=dev).bfloat16() for _ in range(calls)]
        act = 2 * m * K + 2 * m * N  # bf16 in and out
        for fmt, fn, wbytes in (
            ("bf16", lambda i: F.linear(xs[i], w), 2 * N * K),  # noqa: B023
            ("fp8_w8a16", lambda i: fp8_gemm(xs[i], q, s, act_fp8=False), N * K + 4 * s.numel()),  # noqa: B023
            ("fp8_w8a8", lambda i: fp8_gemm(xs[i], q, s, act_fp8=True), N * K + 4 * s.numel()),  # noqa: B023
        ):
            us = graph_us(fn, calls=calls)
            nbytes = wbytes + act
            r = dict(kind="gemm", shape=name, n=N, k=K, rows=m, format=fmt, us=round(us, 1),
                     gb_per_s=round(nbytes / us / 1e3, 1), roofline_frac=round(nbytes / bw / (us * 1e-6), 3),
                     tflops=round(2 * m * N * K / us / 1e6, 1), default=fmt == "bf16" or (fmt == "fp8_w8a8") == (
                         m >= W8A8_MIN_ROWS))
            out.append(r)
            print(json.dumps(r), flush=True)
    return out


def _moe(model: str, rows: list[int], dev: torch.device, bw: float, calls: int) -> list[dict]:
    from swaserve.kernels.fused_moe import fused_moe
    from swaserve.layers import fp8

    H, E, K, I = EXPERTS[model]
    g = torch.Generator(device=dev).manual_seed(1)
    w1 = (0.02 * torch.randn(E, 2 * I, H, generator=g, device=dev)).bfloat16()
    w2 = (0.02 * torch.randn(E, H, I, generator=g, device=dev)).bfloat16()
    q2, s2 = fp8.quantize(w2)
    if I % fp8.BLOCK:  # gate/up parts are not whole 128-row blocks: a scale per row, as the layer holds them
        (qg, sg), (qu, su) = fp8.quantize(w1[:, :I]), fp8.quantize(w1[:, I:])
        q1 = torch.cat([qg.view(torch.uint8), qu.view(torch.uint8)], 1).view(fp8.FP8)
        s1 = torch.cat([fp8.expand_scale_rows(sg, I), fp8.expand_scale_rows(su, I)], 1).contiguous()
        sr = 1
    else:
        (q1, s1), sr = fp8.quantize(w1), fp8.BLOCK
    out = []
    for n in [m for m in rows if m * K <= PREFILL_MOE_MAX * K]:
        xs = [torch.randn(n, H, generator=g, device=dev).bfloat16() for _ in range(calls)]
        routes = [torch.randn(n, E, generator=g, device=dev).softmax(-1).topk(K, -1) for _ in range(calls)]
        ws, ids = [r.values.float() for r in routes], [r.indices for r in routes]
        hit = sum(int(torch.unique(i).numel()) for i in ids) / calls
        per_expert = {"bf16": 2 * 3 * H * I, "fp8": 3 * H * I + 4 * (s1[0].numel() + s2[0].numel())}
        for fmt, args, extra in (
            ("bf16", (w1, w2), {}),
            ("fp8_w8a16", (q1, q2), {"act_fp8": False}),
            ("fp8_w8a8", (q1, q2), {"act_fp8": True}),
        ):
            kw = {} if fmt == "bf16" else {"gate_up_scales": s1, "down_scales": s2, "gate_up_scale_rows": sr, **extra}
            us = graph_us(lambda i: fused_moe(xs[i], *args, ws[i], ids[i], "silu", **kw), calls=calls)  # noqa: B023
            nbytes = hit * per_expert[fmt[:4].rstrip("_")] + 4 * n * H
            r = dict(kind="moe", shape=f"{model}-experts", n=E, k=H, rows=n, format=fmt, experts_hit=round(hit, 1),
                     us=round(us, 1), gb_per_s=round(nbytes / us / 1e3, 1),
                     roofline_frac=round(nbytes / bw / (us * 1e-6), 3),
                     tflops=round(2 * n * K * 3 * H * I / us / 1e6, 1))
            out.append(r)
            print(json.dumps(r), flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="all", choices=[*sorted(GEMMS), "all"], help="shapes to time")
    ap.add_argument("--rows", default="1,16,64,256,2048,8192,16384", help="comma-separated row counts (tokens)")
    ap.add_argument("--calls", type=int, default=4, help="calls captured in one graph")
    a = parse_args(ap, argv, smoke=dict(model="tiny", rows="1,3", calls=1))
    dev = bench_device(a.smoke)
    bw = copy_bandwidth(dev)
    print(f"# {hardware()}; copy bandwidth {bw / 1e12:.2f} TB/s; block-FP8 e4m3, 128x128 scales", flush=True)
    rows = [int(r) for r in a.rows.split(",")]
    models = ["mimo-v2-flash", "gemma4-26b-a4b"] if a.model == "all" else [a.model]
    results = []
    for model in models:
        for name, N, K in GEMMS[model]:
            results += _dense(f"{model}:{name}", N, K, rows, dev, bw, a.calls)
        results += _moe(model, rows, dev, bw, a.calls)
    print(f"\n{'shape':>28} {'rows':>6} {'format':>10} {'us':>9} {'GB/s':>7} {'of copy':>8} {'TFLOP/s':>8}")
    for r in results:
        print(f"{r['shape']:>28} {r['rows']:>6} {r['format']:>10} {r['us']:>9} {r['gb_per_s']:>7} "
              f"{r['roofline_frac'] * 100:>7.1f}% {r['tflops']:>8}")
    print(f"\n# summary: bf16 vs the faster FP8 mode\n{'shape':>28} {'rows':>6} {'bf16 us':>9} {'fp8 us':>9} "
          f"{'mode':>10} {'speedup':>8}")
    by = {}
    for r in results:
        by.setdefault((r["shape"], r["rows"]), {})[r["format"]] = r["us"]
    for (shape, m), t in by.items():
        best = min(("fp8_w8a16", "fp8_w8a8"), key=lambda f: t[f])
        print(f"{shape:>28} {m:>6} {t['bf16']:>9} {t[best]:>9} {best:>10} {t['bf16'] / t[best]:>7.2f}x")


if __name__ == "__main__":
    main()
