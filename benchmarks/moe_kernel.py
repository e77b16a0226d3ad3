"""Fused MoE kernel at Gemma-4-26B-A4B's expert shape (hidden 2816, 128 experts, top-8, intermediate
704, bf16): microseconds per call in a CUDA graph, bytes actually read (the distinct experts the
routing hits, plus activations) and the fraction of the measured copy bandwidth. JSON lines + table.

    python benchmarks/moe_kernel.py [--tokens 1,16,64,256]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import copy_bandwidth, graph_us, hardware  # noqa: E402

H, E, K, I = 2816, 128, 8, 704


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="1,16,64,256")
    a = ap.parse_args()
    from swaserve.kernels.fused_moe import fused_moe

    dev = torch.device("cuda")
    bw = copy_bandwidth(dev)
    print(f"# {hardware()}; copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    g = torch.Generator(device=dev).manual_seed(0)
    w1 = (0.02 * torch.randn(E, 2 * I, H, generator=g, device=dev)).bfloat16()
    w2 = (0.02 * torch.randn(E, H, I, generator=g, device=dev)).bfloat16()
    per_expert = (w1[0].numel() + w2[0].numel()) * 2
    rows = []
    for n in [int(t) for t in a.tokens.split(",")]:
        x = torch.randn(n, H, generator=g, device=dev).bfloat16()
        w, ids = torch.softmax(torch.randn(n, E, generator=g, device=dev), -1).topk(K, -1)
        w = (w / w.sum(-1, keepdim=True)).float()
        us = graph_us(lambda i: fused_moe(x, w1, w2, w, ids, "gelu_tanh"), calls=10)
        hit = int(torch.unique(ids).numel())
        nbytes = hit * per_expert + n * H * 2 * 2 + n * K * (2 * I + H) * 2 * 2  # weights + x/out + pair buffers
        r = dict(tokens=n, experts_hit=hit, us=round(us, 1), gb_per_s=round(nbytes / us / 1e3, 1),
                 roofline_frac=round(nbytes / bw / (us * 1e-6), 3))
        rows.append(r)
        print(json.dumps(r), flush=True)
    print(f"\n{'tokens':>6} {'experts':>7} {'us':>8} {'GB/s':>7} {'of roofline':>11}")
    for r in rows:
        print(f"{r['tokens']:>6} {r['experts_hit']:>7} {r['us']:>8} {r['gb_per_s']:>7} {r['roofline_frac'] * 100:>10.1f}%")


if __name__ == "__main__":
    main()
