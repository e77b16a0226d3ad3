"""Deterministic mode's GEMM (`bi_linear`) on the GPU, per Gemma 3 projection and batch size M:
cuBLAS (`F.linear`, the default mode) against `bi_linear` with its tiling rule and other tilings;
and the fact the rule rests on, checked bitwise: every tiling gives each row the same bits at every M.

    python benchmarks/bi_gemm_sweep.py [--shapes 1b,4b] [--ms 1,8,64,256,512,2048,8192]
        [--extra 16x32k256w4s6,64x64k128w4s6sw]  # more tilings, timed at every M
    python benchmarks/bi_gemm_sweep.py --smoke     # tiny shapes, Triton's interpreter on the CPU (CI)

Times are CUDA-graph replays cycling weight copies (nothing served from L2); "roof" is the time
floor max(bytes / HBM bandwidth, FLOPs / bf16 dense peak) over the measured time.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bench_device, empty_cache, graph_us, hardware, parse_args  # noqa: E402
from skinny_gemm_sweep import STREAM_BYTES, projections, weight_copies  # noqa: E402

# isort: split
# after common: --smoke picks Triton's interpreter before triton is imported
import triton  # noqa: E402

from swaserve.kernels import bi_matmul  # noqa: E402
from swaserve.kernels.bi_matmul import Tiling, bi_linear  # noqa: E402

HBM, PEAK = 3.35e12, 989e12  # H100 SXM: bytes/s, bf16 dense FLOP/s
CANDIDATES = [Tiling(16, 16, 256, 4, 4), Tiling(16, 32, 256, 4, 4), Tiling(16, 64, 128, 4, 4),
              Tiling(16, 64, 256, 4, 3), Tiling(64, 16, 256, 4, 4), Tiling(64, 32, 256, 4, 4),
              Tiling(64, 32, 128, 4, 4), Tiling(64, 64, 128, 4, 4),
              Tiling(64, 128, 64, 4, 4), Tiling(128, 64, 64, 4, 4), Tiling(128, 128, 64, 4, 4),
              Tiling(128, 128, 64, 8, 4), Tiling(128, 256, 64, 8, 3),
              # swapped (weight rows on the MMA's M side), decode sizes
              Tiling(16, 64, 256, 4, 4, True), Tiling(16, 128, 128, 4, 4, True),
              Tiling(32, 64, 256, 4, 4, True),
              Tiling(64, 64, 128, 4, 4, True), Tiling(64, 128, 64, 4, 4, True)]


def name(t: Tiling) -> str:
    return f"{t.block_m}x{t.block_n}k{t.block_k}w{t.num_warps}s{t.num_stages}{'sw' if t.swap else ''}"


def parse(text: str) -> Tiling:
    """The inverse of `name`: "16x32k256w4s6" or "64x64k128w4s4sw"."""
    m = re.fullmatch(r"(\d+)x(\d+)k(\d+)w(\d+)s(\d+)(sw)?", text)
    if m is None:
        raise ValueError(f"not a tiling: {text!r} (e.g. 16x32k256w4s6 or 64x64k128w4s4sw)")
    return Tiling(*(int(v) for v in m.groups()[:5]), m.group(6) is not None)


def candidates(M: int, extra: list[Tiling], tilings: list[Tiling] = CANDIDATES) -> list[Tiling]:
    """Tilings worth timing at M: narrow ones up to 256 rows, wide ones from 256, and the extras."""
    return [t for t in tilings if (M <= 256 or t.block_m >= 64 and t.block_n >= 64 and not t.swap)
            and (M >= 256 or t.block_m <= 64)] + extra


@functools.cache
def fits(t: Tiling, device: torch.device) -> bool:
    """Whether the tiling compiles within the GPU's shared memory (an extra may not)."""
    try:
        bi_linear(torch.zeros(1, 1024, device=device, dtype=torch.bfloat16),
                  torch.zeros(256, 1024, device=device, dtype=torch.bfloat16), tile=t)
        return True
    except triton.runtime.errors.OutOfResources as e:
        print(f"# {name(t)} skipped: {e}")
        return False


def floor_us(M: int, N: int, K: int) -> float:
    return max(2 * (M * K + N * K + M * N) / HBM, 2 * M * N * K / PEAK) * 1e6


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="1b,4b", help="skinny_gemm_sweep.py's MODELS")
    ap.add_argument("--ms", default="1,16,64,128,256,512,2048,8192")
    ap.add_argument("--projs", default="qkv,o,gate_up,down,lm_head")
    ap.add_argument("--extra", default="", help="more tilings (comma-separated names), timed at every M")
    ap.add_argument("--tilings", default="", help="check and time only these candidates (default: all)")
    ap.add_argument("--vocab", type=int, default=262144, help="the LM head's rows")
    ap.add_argument("--stream-mb", type=int, default=STREAM_BYTES >> 20, help="weight copies per graph")
    ap.add_argument("--calls", type=int, default=8, help="calls per captured graph")
    args = parse_args(ap, argv, smoke=dict(shapes="tiny", ms="1,16", projs="o,lm_head", vocab=512,
                                           stream_mb=0, calls=1, tilings="16x32k256w4s4,16x64k256w4s4sw"))
    extra = [parse(t) for t in args.extra.split(",") if t]
    tilings = [parse(t) for t in args.tilings.split(",") if t] or CANDIDATES
    ms = [int(m) for m in args.ms.split(",")]
    dev = bench_device(args.smoke)
    g = torch.Generator(device=dev).manual_seed(0)
    print(f"# {hardware()}, bf16")
    mismatches = checks = 0
    rows = []
    for shape in args.shapes.split(","):
        projs = projections(shape) | {"lm_head": (args.vocab, projections(shape)["o"][0])}
        for proj, (N, K) in projs.items():
            if proj not in args.projs.split(","):
                continue
            ws = weight_copies(N, K, g, args.stream_mb << 20)
            proj_ms = [m for m in ms if proj != "lm_head" or m <= 256]
            xs = torch.randn(max(proj_ms), K, device=dev, generator=g, dtype=torch.bfloat16)
            ref = bi_linear(xs, ws[0], tile=tilings[-1])
            for M in proj_ms:
                x = xs[:M]
                for t in tilings + extra:  # the invariance the rule rests on: every tiling, every M
                    if not fits(t, dev):
                        continue
                    checks += 1
                    if not torch.equal(bi_linear(x, ws[0], tile=t), ref[:M]):
                        mismatches += 1
                        print(f"MISMATCH {shape} {proj} M={M} {name(t)}")
                cublas = graph_us(lambda i: F.linear(x, ws[i % len(ws)]), args.calls)
                rule = graph_us(lambda i: bi_linear(x, ws[i % len(ws)]), args.calls)
                per_tile = {name(t): round(graph_us(lambda i: bi_linear(x, ws[i % len(ws)], tile=t),
                                                    args.calls), 1)
                            for t in candidates(M, extra, tilings) if fits(t, dev)}
                best = min(per_tile, key=per_tile.get)
                rule_tile = bi_matmul.tiling(M, N, K, x.dtype, bi_matmul.num_sms(x.device))
                row = dict(shape=shape, proj=proj, N=N, K=K, M=M, cublas_us=round(cublas, 1),
                           rule_us=round(rule, 1), rule=name(rule_tile), best=best, best_us=per_tile[best],
                           floor_us=round(floor_us(M, N, K), 1), tilings=per_tile)
                print(json.dumps(row), flush=True)
                rows.append(row)
            del ws
            empty_cache(dev)
    print(f"\n{'shape':<5} {'proj':<8} {'M':>5} {'cuBLAS':>7} {'rule':>7} {'rule/cuBLAS':>11} {'roof':>5}  "
          f"{'rule tiling':<16} best tiling")
    for r in rows:
        print(f"{r['shape']:<5} {r['proj']:<8} {r['M']:>5} {r['cublas_us']:>7} {r['rule_us']:>7} "
              f"{r['rule_us'] / r['cublas_us']:>10.2f}x {r['floor_us'] / r['rule_us']:>5.0%}  "
              f"{r['rule']:<16} {r['best']} {r['best_us']}")
    for shape in args.shapes.split(","):
        for M in ms:
            sel = [r for r in rows if r["shape"] == shape and r["M"] == M and r["proj"] != "lm_head"]
            if sel:
                print(f"{shape} M={M}: layer GEMMs cuBLAS {sum(r['cublas_us'] for r in sel):.1f} us, "
                      f"rule {sum(r['rule_us'] for r in sel):.1f} us, "
                      f"best {sum(r['best_us'] for r in sel):.1f} us")
    print(f"\ninvariance: {mismatches} mismatching (tiling, M) cases of {checks}")


if __name__ == "__main__":
    main()
