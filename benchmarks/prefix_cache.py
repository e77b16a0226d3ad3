"""Prefix cache on vs off in one call, offline engine: a long shared system prompt followed by many short
questions, multi-turn chats (each turn resends the whole conversation), and distinct long documents asked
two questions each (where keeping only the window's SWA K/V per cached prefix saves memory). Reports TTFT p50/p99,
output and prompt throughput, the cache hit rate, and the memory the cache holds per cached prefix
against a cache that kept SWA K/V for every cached token (table + one JSON line per row).

    # H100, random weights in the Gemma 3 1B / 4B shapes (a config-only dir; --shape writes one)
    PYTHONPATH=. python benchmarks/prefix_cache.py --shape 1b --load-format dummy
    PYTHONPATH=. python benchmarks/prefix_cache.py --model DIR --load-format dummy --request-rate 20
    # tiny CPU run (CI): --shape tiny --device cpu --system-len 96 --num-questions 8 --chats 3 ...
    PYTHONPATH=. python benchmarks/prefix_cache.py --smoke
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import empty_cache, model_dir, parse_args  # noqa: E402


def system_workload(args, rng) -> list[tuple[float, list[int], int]]:
    """(arrival offset s, prompt, max_tokens): one system prompt, then questions."""
    system = [rng.randrange(10, 1000) for _ in range(args.system_len)]
    lo, hi = (int(x) for x in args.question_len.split(","))
    t, out = 0.0, []
    for _ in range(args.num_questions):
        out.append((t, system + [rng.randrange(10, 1000) for _ in range(rng.randint(lo, hi))], args.max_tokens))
        if args.request_rate != float("inf"):
            t += rng.expovariate(args.request_rate)
    return out


def run(args, engine_opts: dict, workload: str) -> dict:
    from swaserve.engine import Engine
    from swaserve.request import SamplingParams

    engine = Engine(args.model, device=args.device, dtype=args.dtype, detokenize=False,
                    load_format=args.load_format, **engine_opts)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    rng = random.Random(args.seed)
    # Warm-up on unrelated prompts of the workload's lengths (kernels compile here), then forget them.
    for i, n in enumerate((args.system_len + 32, 64) if workload != "docs" else (args.doc_len + 32, 64)):
        engine.add_request(f"warm{i}", [rng.randrange(10, 1000) for _ in range(n)], params)
    while engine.has_unfinished():
        engine.step()
    engine.scheduler.reset_prefix_cache()
    before = engine.counters()
    rng = random.Random(args.seed + 1)  # the same requests with the cache on and off
    arrivals: dict[str, float] = {}
    first: dict[str, float] = {}
    out_tokens = prompt_tokens = 0
    if workload == "system":
        todo = [(at, f"q{i}", p) for i, (at, p, _) in enumerate(system_workload(args, rng))]
    elif workload == "docs":  # distinct long documents, each asked two questions (all at once)
        docs = [[rng.randrange(10, 1000) for _ in range(args.doc_len)] for _ in range(args.docs)]
        todo = [(0.0, f"d{d}q{q}", docs[d] + [rng.randrange(10, 1000) for _ in range(32)])
                for q in range(2) for d in range(args.docs)]
    else:  # chats: turn 1 arrives at once; each later turn when the previous answer is complete
        system = [rng.randrange(10, 1000) for _ in range(args.system_len // 4)]
        convo = {c: system + [rng.randrange(10, 1000) for _ in range(48)] for c in range(args.chats)}
        todo = [(0.0, f"c{c}t0", convo[c]) for c in range(args.chats)]
    start = time.monotonic()
    while todo or engine.has_unfinished():
        now = time.monotonic() - start
        due = [x for x in todo if x[0] <= now]
        for x in due:
            todo.remove(x)
            engine.add_request(x[1], x[2], params)
            arrivals[x[1]] = time.monotonic()
            prompt_tokens += len(x[2])
        if not engine.has_unfinished():
            time.sleep(max(0.0, min(x[0] for x in todo) - now))
            continue
        for o in engine.step():
            t = time.monotonic()
            first.setdefault(o.request_id, t)
            if not o.finished:
                continue
            ids = list(o.outputs[0].token_ids)
            out_tokens += len(ids)
            if workload == "chat":
                c, turn = o.request_id[1:].split("t")
                if int(turn) + 1 < args.turns:
                    convo[int(c)] = list(o.prompt_token_ids) + ids + [rng.randrange(10, 1000) for _ in range(32)]
                    todo.append((time.monotonic() - start, f"c{c}t{int(turn) + 1}", convo[int(c)]))
    duration = time.monotonic() - start
    stats = engine.counters()
    hit = stats["prefix_cache_hit_tokens_total"] - before["prefix_cache_hit_tokens_total"]
    miss = stats["prefix_cache_miss_tokens_total"] - before["prefix_cache_miss_tokens_total"]
    ttft = sorted(first[r] - arrivals[r] for r in arrivals)
    plan = engine.plan
    prefix = engine.scheduler.prefix
    row = {
        "workload": workload, "cache": not engine_opts.get("disable_prefix_cache", False),
        "requests": len(arrivals), "duration_s": round(duration, 3),
        "ttft_p50_ms": round(1e3 * _pct(ttft, 50), 2), "ttft_p99_ms": round(1e3 * _pct(ttft, 99), 2),
        "output_tok_s": round(out_tokens / duration, 1), "prompt_tok_s": round(prompt_tokens / duration, 1),
        "hit_rate": round(hit / max(1, hit + miss), 4),
    }
    if prefix is not None:
        # What the cache holds now, and what it would hold keeping SWA K/V for every cached token.
        cache = prefix.cache
        branches = sum(1 for n in cache.nodes() if not n.children) or 1
        held = cache.full_cached * plan.full_bytes_per_token + cache.swa_cached * plan.swa_bytes_per_token
        every = cache.full_cached * (plan.full_bytes_per_token + plan.swa_bytes_per_token)
        row.update(cached_tokens=cache.full_cached, cached_swa_tokens=cache.swa_cached, branches=branches,
                   mib_per_branch=round(held / branches / 2**20, 2),
                   mib_per_branch_all_swa=round(every / branches / 2**20, 2))
    device = engine.device
    del engine
    gc.collect()
    empty_cache(device)
    return row


def _pct(xs: list[float], q: float) -> float:
    return xs[min(len(xs) - 1, int(len(xs) * q / 100))] if xs else float("nan")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="HF directory (config only with --load-format dummy)")
    p.add_argument("--shape", help="write a config-only dir of this shape (1b, 4b, ..., tiny: "
                   "benchmarks/common.py) and use it")
    p.add_argument("--load-format", default="dummy", choices=("auto", "dummy"))
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--workloads", default="system,chat,docs")
    p.add_argument("--system-len", type=int, default=2048)
    p.add_argument("--question-len", default="16,64")
    p.add_argument("--num-questions", type=int, default=128)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="questions/s (Poisson); inf: all at once")
    p.add_argument("--docs", type=int, default=16, help="docs workload: distinct documents, two questions each")
    p.add_argument("--doc-len", type=int, default=8192)
    p.add_argument("--chats", type=int, default=32)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-running-requests", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    args = parse_args(p, argv, smoke=dict(shape="tiny", device="cpu", system_len=96, num_questions=8, chats=3,
                                          turns=3, docs=3, doc_len=80, max_tokens=8))
    if args.model is None:
        if args.shape is None:
            p.error("give --model DIR or --shape SHAPE")
        args.model = model_dir(args.shape)
    import torch

    dev = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    hw = torch.cuda.get_device_name() if dev.startswith("cuda") else platform.processor() or platform.machine()
    print(f"# {hw}, model {args.model}, system prompt {args.system_len}, questions {args.question_len} x "
          f"{args.num_questions} @ {args.request_rate}/s, chats {args.chats} x {args.turns} turns, "
          f"max_tokens {args.max_tokens}")
    rows = []
    for workload in args.workloads.split(","):
        for off in (True, False):
            opts = dict(disable_prefix_cache=off, max_running_requests=args.max_running_requests)
            rows.append(run(args, opts, workload))
            print(json.dumps(rows[-1]), flush=True)
    cols = ("workload", "cache", "requests", "ttft_p50_ms", "ttft_p99_ms", "output_tok_s", "prompt_tok_s", "hit_rate",
            "mib_per_branch", "mib_per_branch_all_swa")
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(str(r.get(c, "-")) for c in cols))


if __name__ == "__main__":
    main()
