"""Decode-attention launch settings on the GPU: for Gemma 3 head shapes, batch sizes and key counts,
time `decode_attention` over a grid of (splits, block_n, warps, stages) and compare the best with
what `num_kv_splits_for` and the defaults pick. Prints achieved K/V bandwidth (bytes of keys and
values read once ÷ time).

    python benchmarks/decode_attention_sweep.py [--quick]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import graph_us  # noqa: E402

SHAPES = {"1b": (4, 1, 256), "4b": (8, 4, 256), "12b": (16, 8, 256)}  # heads, kv heads, head dim


REPS = 8  # calls per captured graph, each over its own keys so the data does not sit in L2


def case(shape: str, bs: int, n: int, configs: list[tuple[int, int, int, int]], num_sms: int) -> dict:
    from swaserve.kernels import decode_attention, num_kv_splits_for

    H, HKV, D = SHAPES[shape]
    slots = REPS * bs * n + 1
    g = torch.Generator(device="cuda").manual_seed(0)
    k_buf = torch.randn(slots, HKV, D, device="cuda", generator=g).to(torch.bfloat16)
    v_buf = torch.randn(slots, HKV, D, device="cuda", generator=g).to(torch.bfloat16)
    q = torch.randn(bs, H, D, device="cuda", generator=g).to(torch.bfloat16)
    perm = (torch.randperm(slots - 1, device="cuda", generator=g) + 1).to(torch.int32)
    lists = perm[: REPS * bs * n].view(REPS, bs * n)  # disjoint random slots per call
    indptr = torch.arange(0, bs * n + 1, n, device="cuda", dtype=torch.int32)
    out = torch.empty(bs, H, D, device="cuda", dtype=torch.bfloat16)
    nbytes = 2 * bs * n * HKV * D * 2

    def t(splits: int, block_n: int | None, warps: int | None, stages: int | None) -> float:
        """Microseconds per call, timed over CUDA-graph replays (no launch overhead, as in decode)."""
        def fn(i: int) -> None:
            decode_attention(q, k_buf, v_buf, indptr, lists[i], out, D**-0.5, num_kv_splits=splits,
                             block_n=block_n, num_warps=warps, num_stages=stages)

        return graph_us(fn, REPS, replays=4)

    heur = num_kv_splits_for(bs, H, HKV, n, num_sms)
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    configs = list(itertools.product([1, 2, 4, 8, 16, 32], [32, 64], [4, 8], [1, 2, 3]))
    cases = [(s, bs, n) for s in ("1b", "4b") for bs in (1, 16, 64, 256) for n in (512, 1024, 4096)]
    if a.quick:
        cases = [(s, bs, n) for s, bs, n in cases if n != 4096 and bs in (1, 16, 64)]
    rows = []
    for shape, bs, n in cases:
        if REPS * bs * n > 256 * 4096:
            continue
        r = case(shape, bs, n, configs, num_sms)
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
