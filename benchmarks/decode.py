"""Fixed-batch decode sweep on random-weight shapes (`common.hf_config`: Gemma 3 `1b`, `4b`, ...,
`gemma4-26b-a4b`, `gpt-oss-20b`, `gpt-oss-120b`, `gpt-oss-20b-bf16`): step time, tok/s and the fraction of
the HBM roofline (weights as stored + K/V bytes one step must read ÷ the copy bandwidth measured first).

    python benchmarks/decode.py [--shapes 1b,4b] [--batch-sizes 1,16,64,256] [--contexts 512,2048,8192] [--quick]
    python benchmarks/decode.py --shapes gemma4-26b-a4b --quantization none,fp8   # bf16 vs online FP8 weights
    python benchmarks/decode.py --smoke     # tiny CPU run (CI): Gemma 3, Gemma 4 MoE and GPT-OSS (MXFP4) shapes

`--quantization fp8`: the same random weights quantised at load as `--quantization fp8 --load-format dummy`
does (128 x 128 blocks; the FP8 GEMM and fused-MoE kernels run), its roofline counting the FP8 bytes;
`none,fp8` runs both, one model after the other, and the table gives FP8's speed-up over the unquantised.

Each point: bs requests with ctx-token prompts are prefilled (untimed), then `--steps` decode steps
of the whole batch are timed end to end through Engine.step() (scheduling, graph replay, sampling
and the token copy back included). JSON lines per point, a table at the end.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    bench_device, bench_dtype, copy_bandwidth, decode_step_bytes, empty_cache, fast_paths, hardware, now,
    param_bytes, parse_args, random_model,
)


def bench_point(engine, loaded, bs: int, ctx: int, steps: int, warm: int, bw: float, seed: int) -> dict:
    from swaserve.request import SamplingParams

    g = torch.Generator().manual_seed(seed)
    vocab = min(200000, engine.model_config.vocab_size)
    # The engine prefills first (schedule_policy="prefill_first"): nothing decodes until every prompt is
    # in, so each request enters the timed steps with the same few output tokens. Under the mixed policy
    # the first prompts decoded while the rest prefilled (256 x 8k prompts at 16k tokens a step: ~130
    # steps) and ran out of max_tokens mid-measurement: the batch shrank by the ~2 requests a step that
    # had been prefilled together, with no retraction.
    params = SamplingParams(temperature=0, max_tokens=engine.scheduler.max_context - ctx, ignore_eos=True)
    ids = [f"p{bs}-{ctx}-{i}" for i in range(bs)]
    for rid in ids:
        engine.add_request(rid, torch.randint(10, vocab, (ctx,), generator=g).tolist(), params)
    while engine.scheduler.waiting or any(r.pending > 1 for r in engine.scheduler.running):
        engine.step()
    for _ in range(warm):
        engine.step()
    assert len(engine.scheduler.running) == bs, "the whole batch must decode together"
    retractions = engine.scheduler.retractions_total
    t0 = now(engine.device)
    shapes = []
    for _ in range(steps):
        engine.step()
        shapes.append(engine.last_step)
    dt = now(engine.device) - t0
    if not all(sh == ("decode", bs, bs) for sh in shapes):
        sched = engine.scheduler
        raise AssertionError(f"not all timed steps decoded {bs}: {sorted(set(shapes))}; retractions during them: "
                             f"{sched.retractions_total - retractions}; still running: {len(sched.running)}")
    for rid in ids:
        engine.abort(rid)
    step = dt / steps
    plan = engine.plan
    nbytes = decode_step_bytes(loaded, bs, ctx + warm + steps // 2, plan.full_dtype or engine.dtype,
                               plan.swa_dtype if plan.hybrid else plan.full_dtype)
    roof = nbytes / bw
    return dict(bs=bs, ctx=ctx, step_ms=round(step * 1e3, 3), tok_per_s=round(bs / step, 1),
                roofline_step_ms=round(roof * 1e3, 3), roofline_frac=round(roof / step, 3), bytes_per_step=nbytes)


def engine_options(bss: list[int], ctxs: list[int], steps: int, warm: int) -> dict:
    """Engine options for timing batches of `bss` requests of `ctxs` prompt tokens (`bench_point`)."""
    return dict(max_running_requests=max(bss), max_context=max(ctxs) + 2 * (steps + warm) + 64,  # + the decode steps
                max_prefill_tokens=16384, schedule_policy="prefill_first")


def sweep(engine, loaded, bss: list[int], ctxs: list[int], steps: int, warm: int, bw: float, label: dict,
          max_tokens_in_flight: int = 1 << 62) -> list[dict]:
    """`bench_point` at every context x batch size whose batch fits both pools at once (else it would be
    retracted), each row `label` + the point, printed as a JSON line when measured."""
    rows = []
    for ctx in ctxs:
        for bs in bss:
            need = ctx + steps + warm + 2
            if bs * ctx > max_tokens_in_flight or engine.plan.max_concurrent_requests(need) < bs:
                what = ", ".join(f"{k} {v}" for k, v in label.items())
                print(f"# skipped: {what}, bs {bs} x ctx {ctx} (over --max-tokens-in-flight, or the pools hold "
                      f"{engine.plan.max_concurrent_requests(need)} such requests)", flush=True)
                continue
            rows.append({**label, **bench_point(engine, loaded, bs, ctx, steps, warm, bw, seed=bs * 7 + ctx)})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def print_table(rows: list[dict]) -> None:
    """The sweep's table; a quantised row (`quantization` set) also gives its speed-up over the
    unquantised row of the same shape, batch and context."""
    base = {(r["shape"], r["bs"], r["ctx"]): r["step_ms"] for r in rows if r.get("quantization") is None}
    print(f"\n{'shape':<16} {'quant':>5} {'bs':>4} {'ctx':>5} {'step ms':>8} {'tok/s':>9} {'roof ms':>8} "
          f"{'of roofline':>11} {'speed-up':>8}")
    for r in rows:
        ref = base.get((r["shape"], r["bs"], r["ctx"])) if r.get("quantization") else None
        speedup = f"{ref / r['step_ms']:.2f}x" if ref else ""
        print(f"{r['shape']:<16} {r.get('quantization') or '-':>5} {r['bs']:>4} {r['ctx']:>5} {r['step_ms']:>8} "
              f"{r['tok_per_s']:>9} {r['roofline_step_ms']:>8} {r['roofline_frac'] * 100:>10.1f}% {speedup:>8}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="1b,4b")
    ap.add_argument("--batch-sizes", default="1,16,64,128,256")
    ap.add_argument("--contexts", default="512,2048,8192")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--max-tokens-in-flight", type=int, default=1 << 20, help="skip points with bs*ctx above this")
    ap.add_argument("--quick", action="store_true", help="1B at bs 1/64, ctx 512/2048; 4B at bs 1, ctx 1024")
    ap.add_argument("--disable-cuda-graph", action="store_true")
    ap.add_argument("--skinny-gemm", action="store_true",
                    help="A/B: decode GEMMs as the skinny Triton kernels (SWASERVE_SKINNY_GEMM=1)")
    ap.add_argument("--pdl", action="store_true", help="A/B: PDL launches for the step's Triton kernels (SWASERVE_PDL=1)")
    ap.add_argument("--fused-combine", action="store_true",
                    help="A/B: decode splits combined in stage 1, no stage-2 launch (SWASERVE_FUSED_SPLIT_COMBINE=1)")
    ap.add_argument("--blas", choices=["cublas", "cublaslt"], help="A/B: torch's preferred BLAS library for the GEMMs")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8_e4m3"],
                    help="A/B: K/V storage (fp8_e4m3: every pool, unless --swa-kv-cache-dtype auto)")
    ap.add_argument("--swa-kv-cache-dtype", default=None, choices=["auto", "fp8_e4m3"],
                    help="the sliding-window pool's K/V storage (default: --kv-cache-dtype's)")
    ap.add_argument("--quantization", default="none",
                    help="A/B: weights as drawn (none) or online FP8 (fp8), or both in turn (none,fp8)")
    a = parse_args(ap, argv, smoke=dict(shapes="tiny,gemma4-tiny,gpt-oss-tiny", batch_sizes="1,3", contexts="40",
                                        steps=3, warmup=1))
    if a.blas:
        torch.backends.cuda.preferred_blas_library(a.blas)
    if a.skinny_gemm:
        os.environ["SWASERVE_SKINNY_GEMM"] = "1"
    if a.pdl:
        os.environ["SWASERVE_PDL"] = "1"
    if a.fused_combine:
        os.environ["SWASERVE_FUSED_SPLIT_COMBINE"] = "1"
    quants = [None if q == "none" else q for q in a.quantization.split(",")]
    if not quants or any(q not in (None, "fp8") for q in quants):
        ap.error(f"--quantization: none, fp8 or none,fp8; got {a.quantization!r}")
    from swaserve.engine import Engine

    dev = bench_device(a.smoke)
    dtype = bench_dtype(dev)
    bw = copy_bandwidth(dev)
    kv_note = "" if a.kv_cache_dtype == "auto" and a.swa_kv_cache_dtype is None else (
        f"; KV {a.kv_cache_dtype} (SWA pool {a.swa_kv_cache_dtype or a.kv_cache_dtype})")
    fp8_note = "; online FP8 weights (128 x 128 blocks) where quant is fp8" if "fp8" in quants else ""
    print(f"# {hardware()}; copy bandwidth {bw / 1e12:.2f} TB/s; {str(dtype).removeprefix('torch.')} weights and KV"
          f"{kv_note}{fp8_note}", flush=True)
    print(f"# {fast_paths()}", flush=True)
    plan = {s: ([int(b) for b in a.batch_sizes.split(",")], [int(c) for c in a.contexts.split(",")]) for s in a.shapes.split(",")}
    if a.quick:
        plan = {"1b": ([1, 64], [512, 2048]), "4b": ([1], [1024])}
    rows = []
    for (shape, (bss, ctxs)), quant in itertools.product(plan.items(), quants):
        loaded = random_model(shape, dev, dtype, quantization=quant)
        engine = Engine(loaded, device=dev, dtype=dtype, **engine_options(bss, ctxs, a.steps, a.warmup),
                        disable_cuda_graph=a.disable_cuda_graph, kv_cache_dtype=a.kv_cache_dtype,
                        swa_kv_cache_dtype=a.swa_kv_cache_dtype)
        print(f"# {loaded.name}: weights {param_bytes(loaded.model) / 2**30:.2f} GiB as stored; {engine.plan.describe()}; "
              f"requests of 8192 tokens at once: {engine.plan.max_concurrent_requests(8192)}", flush=True)
        rows += sweep(engine, loaded, bss, ctxs, a.steps, a.warmup, bw, {"shape": shape, "quantization": quant},
                      a.max_tokens_in_flight)
        del engine, loaded
        gc.collect()  # the runner and its graph runner reference each other
        empty_cache(dev)
    print_table(rows)


if __name__ == "__main__":
    main()
