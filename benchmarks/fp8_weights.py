"""Online FP8 weights (`--quantization fp8`) against bf16 weights on one random-weight model (issue 37;
Gemma-4-26B-A4B by default): the decode table and greedy agreement with logit error, in one process.

The bf16 model runs first, then its FP8 version (the 26B-A4B's 47 GiB of bf16 and its 25 GiB FP8 copy do not fit
one 80 GB GPU together: one is freed before the other is built). A dummy model built with online FP8 holds
the bf16 model's random weights quantised to 128 x 128 blocks (`loader.dummy`), so the two differ by the
quantisation only. On each model's one engine:

1. Probes: `--probes` prompts of random token ids (`--min-len`..`--max-len` tokens) decoded greedily
   `--max-tokens` tokens in one batch (and, with `--control`, on by default, by the bf16 model again each
   alone: what batch shape alone changes, the floor the FP8 numbers stand on; random weights give flat
   logits whose top-1 margins flip easily). Against the bf16 batch: probes whose tokens are all identical,
   the first token's agreement, and the logit error |x - bf16| / (std of the bf16 logits over the
   vocabulary), max and mean, at the last `--logit-positions` prompt positions (teacher-forced: the same
   tokens in; prefill, where FP8 runs its W8A8 kernels from 128 rows) and at the first `--logit-positions`
   generated positions before the tokens first differ (decode: weight-only W8A16).
2. Decode table (`--batch-sizes`, `--contexts`; '' skips it): benchmarks/decode.py's timed steps and
   roofline (FP8 weights counted at their bytes as stored), FP8's speed-up over bf16 per point.

    python benchmarks/fp8_weights.py [--shape gemma4-26b-a4b] [--batch-sizes 1,16,64] [--contexts 1024,8192]
                                     [--probes 64] [--max-tokens 32] [--no-control]
    python benchmarks/fp8_weights.py --smoke     # tiny CPU run (CI): the tiny Gemma 4 MoE shape, 3 probes
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    bench_device, bench_dtype, copy_bandwidth, hardware, hf_config, param_bytes, parse_args, random_model,
)
from decode import engine_options, print_table, sweep  # noqa: E402
from probes import ProbeRun, compare, random_prompts, release, run_probes  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="gemma4-26b-a4b", help="a shape of benchmarks/common.py (unquantised)")
    ap.add_argument("--probes", type=int, default=64)
    ap.add_argument("--min-len", type=int, default=64, help="shortest prompt (tokens)")
    ap.add_argument("--max-len", type=int, default=512, help="longest prompt (tokens)")
    ap.add_argument("--max-tokens", type=int, default=32, help="greedy tokens per probe")
    ap.add_argument("--logit-positions", type=int, default=8,
                    help="prompt positions, and generated positions, whose logits are compared")
    ap.add_argument("--control", action=argparse.BooleanOptionalAction, default=True,
                    help="also the bf16 model with each probe alone (batch-shape noise)")
    ap.add_argument("--batch-sizes", default="1,16,64", help="decode table: requests per batch ('': no table)")
    ap.add_argument("--contexts", default="1024", help="decode table: prompt tokens of each request")
    ap.add_argument("--steps", type=int, default=32, help="decode table: timed steps per point")
    ap.add_argument("--warmup", type=int, default=4)
    a = parse_args(ap, argv, smoke=dict(shape="gemma4-tiny", probes=3, min_len=8, max_len=60, max_tokens=5,
                                        logit_positions=3, batch_sizes="1,3", contexts="40", steps=2, warmup=1))
    from swaserve.engine import Engine

    dev = bench_device(a.smoke)
    dtype = bench_dtype(dev)
    bw = copy_bandwidth(dev)
    bss, ctxs = ([int(x) for x in v.split(",") if x] for v in (a.batch_sizes, a.contexts))
    print(f"# {hardware()}; copy bandwidth {bw / 1e12:.2f} TB/s; {a.shape}, {str(dtype).removeprefix('torch.')}; "
          f"{a.probes} probes of {a.min_len}-{a.max_len} tokens, {a.max_tokens} greedy tokens each", flush=True)
    prompts = random_prompts(a.probes, (a.min_len, a.max_len + 1), min(200000, hf_config(a.shape).vocab_size))
    # No prefix cache: the control's prompts must be computed again (and their logits with them).
    opts = {**engine_options(bss or [1], ctxs or [1], a.steps, a.warmup), "disable_prefix_cache": True}
    opts["max_running_requests"] = max(opts["max_running_requests"], a.probes)
    opts["max_context"] = max(opts["max_context"], a.max_len + a.max_tokens + 8)
    window = (a.logit_positions, a.logit_positions)
    dense = "bf16" if dtype == torch.bfloat16 else str(dtype).removeprefix("torch.")  # float32 on a CPU

    def measure(quantization: str | None) -> tuple[dict[str, ProbeRun], list[dict]]:
        t = time.perf_counter()
        loaded = random_model(a.shape, dev, dtype, quantization=quantization)
        built = time.perf_counter()
        engine = Engine(loaded, device=dev, dtype=dtype, **opts)
        times = [f"built in {built - t:.0f} s", f"engine in {time.perf_counter() - built:.0f} s"]
        print(f"# {loaded.name}: weights {param_bytes(loaded.model) / 2**30:.2f} GiB as stored; "
              f"{engine.plan.describe()}", flush=True)
        t = time.perf_counter()
        runs = {quantization or dense: run_probes(engine, prompts, a.max_tokens, window)}
        times.append(f"probes {time.perf_counter() - t:.0f} s")
        if quantization is None and a.control:
            t = time.perf_counter()
            runs[f"{dense}, each probe alone"] = run_probes(engine, prompts, a.max_tokens, window, alone=True)
            times.append(f"control {time.perf_counter() - t:.0f} s")
        t = time.perf_counter()
        rows = sweep(engine, loaded, bss, ctxs, a.steps, a.warmup, bw, {"shape": a.shape, "quantization": quantization})
        times.append(f"decode table {time.perf_counter() - t:.0f} s")
        del loaded
        release(engine, dev)  # the weights go with it: the next model is built after
        if dev.type == "cuda":
            times.append(f"{torch.cuda.memory_allocated(dev) / 2**30:.2f} GiB still allocated after")
        print(f"# {quantization or dense}: {', '.join(times)}", flush=True)
        return runs, rows

    def agree(runs: dict[str, ProbeRun]) -> list[dict]:
        rows = [{"shape": a.shape, "weights": name, "against": f"{dense} batch", **compare(ref, run)}
                for name, run in runs.items()]
        for r in rows:
            print(json.dumps(r), flush=True)
        return rows

    runs, table = measure(None)
    ref = runs.pop(dense)
    rows = agree(runs)  # the control, before the FP8 model (a run cut short keeps it)
    runs, fp8_table = measure("fp8")
    rows += agree(runs)
    if table:
        print_table(table + fp8_table)
    print_agreement(rows, a.logit_positions, dense)


def print_agreement(rows: list[dict], positions: int, ref: str) -> None:
    print(f"\n{'weights':<24} {'identical':>9} {'1st tok':>7} {'tok eq':>7} | {'prompt err max':>14} {'mean':>7} "
          f"{'top-1':>6} | {'gen err max':>11} {'mean':>7} {'pos':>4} | {'margin':>6}")
    for r in rows:
        cells = dict.fromkeys(("p_max", "p_mean", "p_top1", "g_max", "g_mean", "g_pos", "margin"), "-")
        if "prompt_positions" in r:
            cells.update(p_max=f"{r['prompt_logit_err_max']:.3f}", p_mean=f"{r['prompt_logit_err_mean']:.4f}",
                         p_top1=f"{r['prompt_top1_agreement'] * 100:.1f}%",
                         margin=f"{r['prompt_median_top1_margin']:.3f}")
        if "generated_positions" in r:
            cells.update(g_max=f"{r['generated_logit_err_max']:.3f}", g_mean=f"{r['generated_logit_err_mean']:.4f}",
                         g_pos=str(r["generated_positions"]))
        ident = f"{r['identical']}/{r['probes']}"
        print(f"{r['weights']:<24} {ident:>9} {r['first_token_agreement'] * 100:>6.1f}% "
              f"{r['token_agreement'] * 100:>6.1f}% | {cells['p_max']:>14} {cells['p_mean']:>7} {cells['p_top1']:>6} | "
              f"{cells['g_max']:>11} {cells['g_mean']:>7} {cells['g_pos']:>4} | {cells['margin']:>6}")
    print(f"err: |x - {ref}| / std of the {ref} logits over the vocabulary at the last {positions} prompt positions "
          "(teacher-forced) and at the generated positions before the first differing token (pos: how many); "
          f"margin: {ref}'s median top-1 minus top-2 logit at the prompt positions, in stds")


if __name__ == "__main__":
    main()
