"""Fused MoE kernel at Gemma-4-26B-A4B's expert shape vs the bytes of the experts it hits.

Hidden 2816, 128 experts, top-8, intermediate 704, bf16: microseconds per call in a CUDA graph
(CUDA-event timed replays), the bytes it must read (the weights of the distinct experts the routing
hits, counted from the ids, plus x and the output) and the fraction of the measured copy bandwidth;
also the pair sort and the combine alone, so the two GEMMs' share is the rest. JSON lines, then a table.

    python benchmarks/moe_kernel.py [--tokens 1,16,64,256] [--calls 10]
    python benchmarks/moe_kernel.py --smoke     # a tiny expert shape, Triton's interpreter on the CPU (CI)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bench_device, copy_bandwidth, graph_us, hardware, parse_args  # noqa: E402

SHAPE = "2816,128,8,704"  # hidden, experts, top-k, expert intermediate: Gemma-4-26B-A4B


def expected_experts_hit(n: int, E: int, K: int) -> float:
    """Distinct experts among n tokens' top-k picks under uniform routing."""
    return E * (1 - (1 - K / E) ** n)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="1,16,64,256", help="comma-separated token counts n")
    ap.add_argument("--calls", type=int, default=10, help="calls captured in one graph (distinct routings)")
    ap.add_argument("--shape", default=SHAPE, help="HIDDEN,EXPERTS,TOP_K,INTERMEDIATE")
    a = parse_args(ap, argv, smoke=dict(tokens="1,5", calls=1, shape="64,8,2,32"))
    H, E, K, I = (int(x) for x in a.shape.split(","))
    from swaserve.kernels.fused_moe import _block_m, align_pairs, combine, fused_moe
    from swaserve.kernels.pdl import pdl_supported

    dev = bench_device(a.smoke)
    bw = copy_bandwidth(dev)
    print(f"# {hardware()}; copy bandwidth {bw / 1e12:.2f} TB/s; PDL {'on' if pdl_supported() else 'off'}",
          flush=True)
    g = torch.Generator(device=dev).manual_seed(0)
    w1 = (0.02 * torch.randn(E, 2 * I, H, generator=g, device=dev)).bfloat16()
    w2 = (0.02 * torch.randn(E, H, I, generator=g, device=dev)).bfloat16()
    per_expert = (w1[0].numel() + w2[0].numel()) * w1.element_size()
    rows = []
    for n in [int(t) for t in a.tokens.split(",")]:
        # One routing per captured call, so consecutive calls hit different experts as layers do.
        xs = [torch.randn(n, H, generator=g, device=dev).bfloat16() for _ in range(a.calls)]
        logits = [torch.randn(n, E, generator=g, device=dev) for _ in range(a.calls)]
        routes = [torch.softmax(z, -1).topk(K, -1) for z in logits]
        ws = [(w / w.sum(-1, keepdim=True)).float() for w, _ in routes]
        ids = [i for _, i in routes]
        us = graph_us(lambda i: fused_moe(xs[i], w1, w2, ws[i], ids[i], "gelu_tanh"), calls=a.calls)
        bm = _block_m(n * K, E)
        align = graph_us(lambda i: align_pairs(ids[i], E, bm), calls=a.calls)
        ys = torch.randn(n * K, H, generator=g, device=dev).bfloat16()
        comb = graph_us(lambda i: combine(ys, ws[i], None, torch.bfloat16), calls=a.calls)
        hit = sum(int(torch.unique(i).numel()) for i in ids) / a.calls
        nbytes = hit * per_expert + 2 * n * H * xs[0].element_size()  # hit experts' weights, x in, out
        r = dict(tokens=n, experts_hit=round(hit, 1),
                 experts_expected=round(expected_experts_hit(n, E, K), 1),
                 block_m=bm, us=round(us, 1), align_us=round(align, 1), combine_us=round(comb, 1),
                 mb=round(nbytes / 1e6, 1), gb_per_s=round(nbytes / us / 1e3, 1),
                 roofline_us=round(nbytes / bw * 1e6, 1), roofline_frac=round(nbytes / bw / (us * 1e-6), 3))
        rows.append(r)
        print(json.dumps(r), flush=True)
    print(f"\n{'tokens':>6} {'experts':>7} {'us':>8} {'align':>6} {'comb':>6} {'GB/s':>7} {'roof us':>8} "
          f"{'of roof':>8}")
    for r in rows:
        print(f"{r['tokens']:>6} {r['experts_hit']:>7} {r['us']:>8} {r['align_us']:>6} {r['combine_us']:>6} "
              f"{r['gb_per_s']:>7} {r['roofline_us']:>8} {r['roofline_frac'] * 100:>7.1f}%")


if __name__ == "__main__":
    main()
