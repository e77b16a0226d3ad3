"""Host time per launch (no sync in between) of the attention kernels an eager step calls once per
layer, against a plain torch op and an empty Triton kernel with as many arguments: what a piecewise
mixed step's eager attention costs the host on this machine. Shapes: Gemma-3-1B (4 query heads, 1
KV head, head dim 256), a mixed step of 40 decodes (700-token prefixes) and a 280-token prompt.

    python benchmarks/launch_overhead.py [--calls 300]
    python benchmarks/launch_overhead.py --smoke     # tiny shapes, Triton's interpreter on the CPU (CI)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bench_device, hardware, parse_args, sync  # noqa: E402

# isort: split
# after common: --smoke picks Triton's interpreter before triton is imported
import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _empty(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15, a16, a17, a18, a19,
           a20, a21, a22, a23, a24, a25, a26, a27, a28, C0: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr):
    pass


def per_call_us(fn, dev: torch.device, n: int = 300) -> float:
    for _ in range(min(20, n)):
        fn()
    sync(dev)
    t = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t) / n * 1e6
    sync(dev)
    return host


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=300, help="timed calls of each launch")
    ap.add_argument("--heads", default="4,1,256", help="query heads, K/V heads, head dim")
    ap.add_argument("--mixed", default="40,700,280", help="decodes, their prefix length, prompt tokens")
    ap.add_argument("--slots", type=int, default=100_000, help="K/V pool slots")
    a = parse_args(ap, argv, smoke=dict(calls=1, heads="2,1,32", mixed="2,16,8", slots=512))
    from swaserve.kernels import decode_attention, extend_attention

    dev = bench_device(a.smoke)
    H, HKV, D = (int(x) for x in a.heads.split(","))
    dec, ctx, chunk = (int(x) for x in a.mixed.split(","))
    slots = a.slots
    k_buf = torch.randn(slots, HKV, D, device=dev, dtype=torch.bfloat16)
    v_buf = torch.randn_like(k_buf)
    T = dec + chunk
    q = torch.randn(T, H, D, device=dev, dtype=torch.bfloat16)
    k_new, v_new = torch.randn(T, HKV, D, device=dev, dtype=torch.bfloat16), torch.randn(T, HKV, D, device=dev,
                                                                                         dtype=torch.bfloat16)
    out = torch.empty_like(q)
    ext = [1] * dec + [chunk]
    prefix = [ctx] * dec + [0]
    qo = torch.tensor([0] + list(torch.tensor(ext).cumsum(0)), dtype=torch.int32, device=dev)
    kv_ind = torch.tensor([0] + list(torch.tensor(prefix).cumsum(0)), dtype=torch.int32, device=dev)
    idx = torch.randint(1, slots, (sum(prefix) + 1,), dtype=torch.int32, device=dev)
    plen = torch.tensor(prefix, dtype=torch.int32, device=dev)
    d_ind = torch.arange(dec + 1, dtype=torch.int32, device=dev) * (ctx + 1)
    d_idx = torch.randint(1, slots, (dec * (ctx + 1),), dtype=torch.int32, device=dev)
    x = torch.randn(1024, device=dev)
    args = [x] * 10 + [1, 2, 3, 4, 5, 6, 7, 8, 9, 10] + [0.5] * 9
    rows = [
        ("torch add (1 kernel)", lambda: x.add_(1.0)),
        ("empty Triton kernel, 29 args + 3 constexpr", lambda: _empty[(1,)](*args, C0=1, C1=2, C2=3)),
        (f"extend_attention {dec}x{ctx}+{chunk}", lambda: extend_attention(
            q, k_new, v_new, out, k_buf, v_buf, qo, kv_ind, idx, plen, 0.06, max_extend_len=chunk)),
        (f"decode_attention {dec}x{ctx + 1}, 4 splits", lambda: decode_attention(
            q[:dec], k_buf, v_buf, d_ind, d_idx, out[:dec], 0.06, num_kv_splits=4)),
    ]
    print(f"launch overhead, {hardware()}, triton {triton.__version__}")
    for name, fn in rows:
        us = per_call_us(fn, dev, a.calls)
        print(json.dumps({"launch": name, "host_us_per_call": round(us, 1)}))
        print(f"  {name:<48} {us:7.1f} us host per call", flush=True)


if __name__ == "__main__":
    main()
