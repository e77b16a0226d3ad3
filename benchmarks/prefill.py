"""Prefill of one long prompt on a random-weight Gemma 3 shape: tokens/s and model FLOP
utilisation against the matmul rate measured first (an 8192^3 bf16 GEMM on the GPU).

    python benchmarks/prefill.py [--shape 4b] [--tokens 8192] [--repeats 3]
    python benchmarks/prefill.py --smoke     # tiny CPU run (CI)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bench_device, bench_dtype, hardware, now, parse_args, random_model  # noqa: E402


def matmul_peak(dev: torch.device, dtype: torch.dtype, n: int = 8192) -> float:
    a = torch.randn(n, n, device=dev, dtype=dtype)
    b = torch.randn(n, n, device=dev, dtype=dtype)
    for _ in range(3):
        a @ b
    t = now(dev)
    for _ in range(10):
        a @ b
    return 10 * 2 * n**3 / (now(dev) - t)


def prefill_flops(loaded, n: int) -> float:
    """2 x (non-embedding weights + LM head for the last token) x tokens, plus attention
    (QK^T and PV: 4 x heads x head_dim per query-key pair; SWA layers see at most W keys)."""
    hf = loaded.config.hf_config
    emb = hf.vocab_size * hf.hidden_size
    dense = sum(p.numel() for p in loaded.model.parameters()) - emb
    flops = 2.0 * dense * n + 2.0 * emb
    W = loaded.config.sliding_window
    pairs_full = n * (n + 1) / 2
    pairs_swa = sum(min(i + 1, W) for i in range(n)) if W else pairs_full
    per_pair = 4 * hf.num_attention_heads * hf.head_dim
    flops += per_pair * (loaded.config.full_group.num_layers * pairs_full + loaded.config.swa_group.num_layers * pairs_swa)
    return flops


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="4b")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--peak-size", type=int, default=8192, help="N of the N^3 GEMM measuring the matmul rate")
    a = parse_args(ap, argv, smoke=dict(shape="tiny", tokens=96, repeats=1, peak_size=128))
    from swaserve.engine import Engine
    from swaserve.request import SamplingParams

    dev = bench_device(a.smoke)
    dtype = bench_dtype(dev)
    peak = matmul_peak(dev, dtype, a.peak_size)
    loaded = random_model(a.shape, dev, dtype)
    engine = Engine(loaded, device=dev, dtype=dtype, max_running_requests=4,
                    max_context=a.tokens + 8, max_prefill_tokens=a.tokens)
    vocab = min(200000, loaded.config.vocab_size)
    times = []
    for i in range(a.repeats + 1):
        engine.add_request(f"p{i}", torch.randint(10, vocab, (a.tokens,)).tolist(),
                           SamplingParams(temperature=0, max_tokens=1))
        t = now(dev)
        while engine.has_unfinished():
            engine.step()
        if i:  # the first run warms the kernels up
            times.append(now(dev) - t)
    dt = sorted(times)[len(times) // 2]
    flops = prefill_flops(loaded, a.tokens)
    r = dict(shape=a.shape, tokens=a.tokens, seconds=round(dt, 4), tok_per_s=round(a.tokens / dt, 1),
             tflops=round(flops / dt / 1e12, 1), peak_tflops=round(peak / 1e12, 1), mfu=round(flops / dt / peak, 3),
             hardware=hardware())
    print(json.dumps(r))
    print(f"\nprefill {a.shape} {a.tokens} tokens: {r['tok_per_s']} tok/s, {r['tflops']} TFLOP/s, "
          f"MFU {r['mfu'] * 100:.1f}% of the measured {r['peak_tflops']} TFLOP/s")


if __name__ == "__main__":
    main()
