"""Decode-attention launch settings on the GPU: for Gemma 3 head shapes, batch sizes and key counts,
time `decode_attention` over a grid of (splits, block_n, warps, stages) and compare the best with
what `num_kv_splits_for` and the defaults pick. Prints achieved K/V bandwidth (bytes of keys and
values read once ÷ time).

    python benchmarks/decode_attention_sweep.py [--quick] [--shapes 1b,4b] [--batch-sizes 1,16,64,256]
    python benchmarks/decode_attention_sweep.py --smoke     # tiny, Triton's interpreter on the CPU (CI)
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

# heads, kv heads, head dim (tiny: --smoke)
SHAPES = {"1b": (4, 1, 256), "4b": (8, 4, 256), "12b": (16, 8, 256), "tiny": (2, 1, 32)}


REPS = 8  # calls per captured graph, each over its own keys so the data does not sit in L2 (--calls)


def case(shape: str, bs: int, n: int, configs: list[tuple[int, int, int, int]], dev: torch.device,
         reps: int = REPS) -> dict:
    from swaserve.kernels import decode_attention, num_kv_splits_for
    from swaserve.kernels.common import num_sms

    H, HKV, D = SHAPES[shape]
    slots = reps * bs * n + 1
    g = torch.Generator(device=dev).manual_seed(0)
    k_buf = torch.randn(slots, HKV, D, device=dev, generator=g).to(torch.bfloat16)
    v_buf = torch.randn(slots, HKV, D, device=dev, generator=g).to(torch.bfloat16)
    q = torch.randn(bs, H, D, device=dev, generator=g).to(torch.bfloat16)
    perm = (torch.randperm(slots - 1, device=dev, generator=g) + 1).to(torch.int32)
    lists = perm[: reps * bs * n].view(reps, bs * n)  # disjoint random slots per call
    indptr = torch.arange(0, bs * n + 1, n, device=dev, dtype=torch.int32)
    out = torch.empty(bs, H, D, device=dev, dtype=torch.bfloat16)
    nbytes = 2 * bs * n * HKV * D * 2

    def t(splits: int, block_n: int | None, warps: int | None, stages: int | None) -> float:
        """Microseconds per call, timed over CUDA-graph replays (no launch overhead, as in decode)."""
        def fn(i: int) -> None:
            decode_attention(q, k_buf, v_buf, indptr, lists[i], out, D**-0.5, num_kv_splits=splits,
                             block_n=block_n, num_warps=warps, num_stages=stages)

        return graph_us(fn, reps, replays=4)

    heur = num_kv_splits_for(bs, H, HKV, n, num_sms(dev))
    default_us = t(heur, None, None, None)  # what the backend launches today
    timed = []
    for splits, block_n, warps, stages in configs:
        if splits > 1 and splits * block_n > 2 * n:
            continue  # splits beyond the keys are empty programs
        try:
            timed.append((t(splits, block_n, warps, stages), splits, block_n, warps, stages))
        except Exception as e:  # out of shared memory etc.: not a candidate
            timed.append((float("inf"), splits, block_n, warps, f"{stages} ({type(e).__name__})"))
    best = min(timed)
    return dict(shape=shape, bs=bs, keys=n, heuristic_splits=heur, default_us=round(default_us, 2),
                default_tbps=round(nbytes / default_us / 1e6, 2), best_us=round(best[0], 2),
                best_tbps=round(nbytes / best[0] / 1e6, 2), best=dict(splits=best[1], block_n=best[2],
                                                                        warps=best[3], stages=best[4]),
                top5=[list(x) for x in sorted(timed)[:5]])


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="no 4096-key cases, no batch of 256")
    ap.add_argument("--shapes", default="1b,4b", help=f"of {','.join(SHAPES)}")
    ap.add_argument("--batch-sizes", default="1,16,64,256")
    ap.add_argument("--keys", default="512,1024,4096", help="keys per request")
    ap.add_argument("--splits", default="1,2,4,8,16,32", help="the grid: key splits")
    ap.add_argument("--block-n", default="32,64", help="the grid: keys per block")
    ap.add_argument("--warps", default="4,8", help="the grid: warps")
    ap.add_argument("--stages", default="1,2,3", help="the grid: pipeline stages")
    ap.add_argument("--calls", type=int, default=REPS, help="calls per graph, each over its own keys")
    a = parse_args(ap, argv, smoke=dict(shapes="tiny", batch_sizes="2", keys="64", calls=2, splits="1,2",
                                        block_n="32", warps="4", stages="2"))
    dev = bench_device(a.smoke)
    configs = list(itertools.product(ints(a.splits), ints(a.block_n), ints(a.warps), ints(a.stages)))
    cases = [(s, bs, n) for s in a.shapes.split(",") for bs in ints(a.batch_sizes) for n in ints(a.keys)]
    if a.quick:
        cases = [(s, bs, n) for s, bs, n in cases if n != 4096 and bs in (1, 16, 64)]
    rows = []
    for shape, bs, n in cases:
        if a.calls * bs * n > 256 * 4096:
            continue
        r = case(shape, bs, n, configs, dev, a.calls)
        rows.append(r)
        print(json.dumps(r), flush=True)
    print(f"\n{'shape':<5} {'bs':>4} {'keys':>5} {'heur':>4} {'default us':>10} {'TB/s':>5} {'best us':>8} {'TB/s':>5}  best")
    for r in rows:
        b = r["best"]
        print(f"{r['shape']:<5} {r['bs']:>4} {r['keys']:>5} {r['heuristic_splits']:>4} {r['default_us']:>10} "
              f"{r['default_tbps']:>5} {r['best_us']:>8} {r['best_tbps']:>5}  "
              f"s{b['splits']} n{b['block_n']} w{b['warps']} st{b['stages']}")


if __name__ == "__main__":
    main()
