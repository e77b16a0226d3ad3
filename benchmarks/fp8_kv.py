"""FP8 (e4m3) KV cache against the model-dtype (bf16) cache, three numbers (issue 37):

1. KV tokens at 32k-token requests: the pools the planner sizes for a KV budget (`--kv-gib`) on a
   shape's K/V (Gemma 3 `12b` by default), bf16 vs FP8 everywhere vs FP8 with the SWA pool in bf16:
   full and SWA pool tokens and how many 32k requests fit at once.
2. Decode step time at bs 64 (`--ctx` tokens each, CUDA graphs on), random weights of `--decode-shape`
   (Gemma 3 `4b`: its weights and a bf16 cache of 64 x 8k fit one GPU), the three caches one after the
   other in one process (benchmarks/decode.py's timed steps).
3. Greedy agreement on 64 probes with the embedded Gemma 3 270M (real weights): the same prompts
   (random token ids, 64-1500 tokens: across its 512-token window) decoded greedily 48 tokens with each
   cache; probes whose tokens are identical, tokens equal position by position, and where they first
   differ.

    python benchmarks/fp8_kv.py [--shape 12b] [--kv-gib 40] [--decode-shape 4b] [--ctx 8192] [--probes 64]
    python benchmarks/fp8_kv.py --smoke     # tiny CPU run (CI): planner numbers, 2 probes, bs 4
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    bench_device,
    bench_dtype,
    copy_bandwidth,
    hardware,
    hf_config,
    parse_args,
    random_model,
)
from decode import bench_point, engine_options  # noqa: E402
from probes import compare, random_prompts, release, run_probes  # noqa: E402

CACHES = {"bf16": {}, "fp8": {"kv_cache_dtype": "fp8_e4m3"},
          "fp8 (SWA pool bf16)": {"kv_cache_dtype": "fp8_e4m3", "swa_kv_cache_dtype": "auto"}}


def capacity(shape: str, kv_gib: float, ctx: int, step: int) -> list[dict]:
    """The planner's pools for `ctx`-token requests, per cache."""
    from swaserve.config import CacheConfig
    from swaserve.memory.planner import plan_memory
    from swaserve.model_config import ModelConfig

    cfg = ModelConfig.from_hf(hf_config(shape, max_positions=ctx), max_context=ctx)
    rows = []
    for name, opts in CACHES.items():
        full, swa = CacheConfig(**opts).kv_dtypes(torch.bfloat16)
        p = plan_memory(int(kv_gib * (1 << 30)), cfg.full_group, cfg.swa_group, full, ctx, cfg.sliding_window,
                        prefill_chunk=step, request_tokens=ctx, swa_dtype=swa)
        rows.append(dict(cache=name, full_tokens=p.full_tokens, swa_tokens=p.swa_tokens,
                         requests_at_ctx=p.max_concurrent_requests(ctx), plan=p.describe()))
    return rows


def decode_times(shape: str, bs: int, ctx: int, steps: int, warm: int, dev, dtype,
                 deterministic: bool = False) -> list[dict]:
    from swaserve.engine import Engine

    bw = copy_bandwidth(dev)
    loaded = random_model(shape, dev, dtype, max_positions=ctx + 2 * (steps + warm) + 64)
    rows = []
    for name, opts in CACHES.items():
        engine = Engine(loaded, device=dev, dtype=dtype, **engine_options([bs], [ctx], steps, warm), **opts,
                        enable_deterministic_inference=deterministic)
        r = bench_point(engine, loaded, bs, ctx, steps, warm, bw, seed=bs * 7 + ctx)
        rows.append(dict(cache=name, **r))
        release(engine, dev)
    return rows


def agreement(model, probes: int, max_tokens: int, lengths: tuple[int, int], vocab: int, dev, dtype) -> dict:
    """Greedy tokens of each cache against bf16's on `probes` prompts of `lengths` tokens (`model`: None
    for the embedded Gemma 3 270M, or a LoadedModel)."""
    from swaserve.engine import Engine

    prompts = random_prompts(probes, lengths, vocab)
    out = {}
    for name, opts in CACHES.items():
        engine = Engine(model, device=dev, dtype=dtype, **opts)
        out[name] = run_probes(engine, prompts, max_tokens)
        release(engine, dev)
    return {name: compare(out["bf16"], out[name]) for name in list(CACHES)[1:]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="12b")
    ap.add_argument("--kv-gib", type=float, default=40)
    ap.add_argument("--context", type=int, default=32768, help="request length the capacity numbers plan for")
    ap.add_argument("--decode-shape", default="4b")
    ap.add_argument("--bs", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=8192, help="prompt tokens of each decoding request")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--probes", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--deterministic", action="store_true",
                    help="the decode part in deterministic mode (batch-invariant kernels; FP8 pools' decode tiles differ)")
    ap.add_argument("--parts", default="capacity,decode,agreement",
                    help="which numbers (the agreement needs the embedded model's package: on a GPU machine "
                         "without it, run `--parts agreement` where it is installed)")
    a = parse_args(ap, argv, smoke=dict(shape="tiny", decode_shape="tiny", kv_gib=0.01, context=512, bs=4, ctx=40, steps=2, warmup=1,
                                        probes=2, max_tokens=4))
    dev = bench_device(a.smoke)
    dtype = bench_dtype(dev)
    parts = set(a.parts.split(","))
    print(f"# {hardware()}", flush=True)
    caps = {r["cache"]: r for r in capacity(a.shape, a.kv_gib, a.context, 8192)} if "capacity" in parts else {}
    for r in caps.values():
        print(json.dumps(dict(part="capacity", shape=a.shape, kv_gib=a.kv_gib, context=a.context, **r)), flush=True)
    times = (decode_times(a.decode_shape, a.bs, a.ctx, a.steps, a.warmup, dev, dtype, a.deterministic)
             if "decode" in parts else [])
    for r in times:
        print(json.dumps(dict(part="decode", shape=a.decode_shape, deterministic=a.deterministic, **r)), flush=True)
    agree: dict = {}
    if "agreement" in parts:
        if a.smoke:  # the embedded 270M is minutes on a CPU: the tiny random shape instead
            model, label, lengths, vocab = random_model("tiny", dev, dtype), "tiny (random)", (8, 60), 150
        else:
            model, label, lengths, vocab = None, "gemma-3-270m", (64, 1500), 30000
        agree = agreement(model, a.probes, a.max_tokens, lengths, vocab, dev, dtype)
        for name, r in agree.items():
            print(json.dumps(dict(part="agreement", model=label, cache=name, **r)), flush=True)
    print(f"\n{'cache':<22} {'full tok':>9} {'SWA tok':>8} {f'{a.context} reqs':>10} {'step ms':>8} "
          f"{'tok/s':>8} {'identical':>10} {'tokens eq':>9}")
    steps = {t["cache"]: t for t in times}
    for name in CACHES:
        c, t, g = caps.get(name, {}), steps.get(name, {}), agree.get(name)
        ident = f"{g['identical']}/{g['probes']}" if g else ("ref" if agree else "-")
        teq = f"{g['token_agreement'] * 100:.1f}%" if g else ("ref" if agree else "-")
        print(f"{name:<22} {c.get('full_tokens', '-'):>9} {c.get('swa_tokens', '-'):>8} {c.get('requests_at_ctx', '-'):>10} "
              f"{t.get('step_ms', '-'):>8} {t.get('tok_per_s', '-'):>8} {ident:>10} {teq:>9}")

if __name__ == "__main__":
    main()
