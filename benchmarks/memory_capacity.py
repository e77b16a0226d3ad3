"""Long-context capacity: with a fixed KV budget and max-context requests on a Gemma-3-12B shape,
how many requests run at once with hybrid pools vs one pool for every layer, against MemoryPlan's
theoretical numbers, and the decode throughput at that load.

    python benchmarks/memory_capacity.py [--shape 12b] [--kv-gib 40] [--context 32768] [--kv-cache-dtype fp8_e4m3]
    python benchmarks/memory_capacity.py --smoke     # tiny CPU run (CI)
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    bench_device, bench_dtype, empty_cache, hardware, now, parse_args, random_model,
)


def run_mode(loaded, dev, dtype, hybrid: bool, kv_bytes: int, ctx: int, new_tokens: int,
             prefill: int, kv_cache_dtype: str = "auto") -> dict:
    from swaserve.engine import Engine
    from swaserve.request import SamplingParams

    # The pools split for this workload's requests: every one is `ctx` tokens long.
    engine = Engine(loaded, device=dev, dtype=dtype, kv_cache_bytes=kv_bytes, max_context=ctx, plan_request_tokens=ctx,
                    max_running_requests=48, max_prefill_tokens=prefill, disable_hybrid_swa=not hybrid,
                    kv_cache_dtype=kv_cache_dtype)
    theory = engine.plan.max_concurrent_requests(ctx)
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    g = torch.Generator().manual_seed(1)
    vocab = min(200000, loaded.config.vocab_size)
    for i in range(theory + 1):  # one more than fits: it must wait (or be retracted), never corrupt
        prompt = torch.randint(10, vocab, (ctx - new_tokens,), generator=g).tolist()
        engine.add_request(str(i), prompt, params)
    max_running, decode_times = 0, []
    while engine.has_unfinished():
        t = now(dev)
        engine.step()
        dt = now(dev) - t
        if engine.last_step and engine.last_step[0] == "decode":
            decode_times.append((engine.last_step[1], dt))
            max_running = max(max_running, engine.last_step[1])
    full_decodes = [t for n, t in decode_times if n == max_running]
    step = sorted(full_decodes)[len(full_decodes) // 2] if full_decodes else float("nan")
    out = dict(hybrid=hybrid, plan=engine.plan.describe(), theoretical_concurrent=theory, max_running=max_running,
               decode_step_ms=round(step * 1e3, 2), decode_tok_per_s=round(max_running / step, 1),
               retractions=engine.stats.retractions_total)
    del engine
    gc.collect()  # the runner and its graph runner reference each other: free the pools now
    empty_cache(dev)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="12b")
    ap.add_argument("--kv-gib", type=float, default=40)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--prefill-chunk", type=int, default=4096)
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8_e4m3"], help="K/V storage of every pool")
    # smoke: 128-token requests, window 32: room for ~11 with hybrid pools, 4 with one pool
    a = parse_args(ap, argv, smoke=dict(shape="tiny", kv_gib=0.0008, context=128, new_tokens=4,
                                        prefill_chunk=64))
    dev = bench_device(a.smoke)
    dtype = bench_dtype(dev)
    loaded = random_model(a.shape, dev, dtype, max_positions=a.context)
    kv = int(a.kv_gib * (1 << 30))
    rows = [run_mode(loaded, dev, dtype, h, kv, a.context, a.new_tokens, a.prefill_chunk, a.kv_cache_dtype)
            for h in (False, True)]
    single, hyb = rows
    theory_ratio = hyb["theoretical_concurrent"] / max(single["theoretical_concurrent"], 1)
    measured = hyb["max_running"] / max(single["max_running"], 1)
    for r in rows:
        print(json.dumps(dict(shape=a.shape, kv_gib=a.kv_gib, context=a.context, kv_cache_dtype=a.kv_cache_dtype,
                              hardware=hardware(), **r)))
    print(f"\n{'mode':<12} {'theory':>6} {'running':>7} {'step ms':>8} {'tok/s':>8}  plan")
    for r in rows:
        print(f"{'hybrid' if r['hybrid'] else 'single pool':<12} {r['theoretical_concurrent']:>6} {r['max_running']:>7} "
              f"{r['decode_step_ms']:>8} {r['decode_tok_per_s']:>8}  {r['plan']}")
    print(f"concurrency ratio: measured {measured:.2f}x vs theoretical {theory_ratio:.2f}x "
          f"({measured / theory_ratio:.2f} of theory)")


if __name__ == "__main__":
    main()
