"""Speculative decoding vs plain decoding, same requests, one call: output tok/s, the speedup, tokens per
request per step (1 + accepted drafts), the share of drafts accepted, and mean step time, per batch size.

    # CPU, embedded Gemma 3 270M: n-gram on copy-heavy and on ordinary prompts
    PYTHONPATH=. python benchmarks/speculative.py --device cpu --methods plain,ngram --batch-sizes 1,4
    # GPU, random weights in the Gemma 3 1B / 4B shapes: n-gram and a self-draft (the target drafting for
    # itself: every draft is accepted, so this is the mechanism's upper bound on acceptance and its cost)
    PYTHONPATH=. python benchmarks/speculative.py --shape 1b --methods plain,ngram,draft --batch-sizes 1,8,32
    # MiMo-V2-Flash's MTP layer in real shapes, block-FP8 target and layer (random weights quantised at load),
    # over two GPUs (rank 0 drafts with the whole layer)
    PYTHONPATH=. python benchmarks/speculative.py --shape mimo-6l --methods plain,mtp --quantization fp8 --tp 2
    PYTHONPATH=. python benchmarks/speculative.py --smoke     # tiny random model on the CPU (CI)
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

CODE = ("def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n"
        "def mul(a, b):\n    return a * b\n\n")
PROSE = ("The river town grew slowly through the centuries. Merchants arrived with salt and cloth, monks copied "
         "manuscripts by candle light, and in winter the bridge froze so hard that children skated beneath it. ")


def prompts_for(kind: str, n: int, tokenizer, vocab: int, rng: random.Random) -> list:
    if tokenizer is not None:
        text = CODE * 6 + "def div(a, b):" if kind == "copy" else PROSE + "Then"
        return [text] * n if kind == "copy" else [f"{i}. " + text for i in range(n)]
    if kind == "copy":  # random weights: a motif repeated, which the n-gram drafter can look up
        motif = [rng.randrange(10, vocab) for _ in range(32)]
        return [motif * 6 for _ in range(n)]
    return [[rng.randrange(10, vocab) for _ in range(192)] for _ in range(n)]


def run(engine, prompts: list, max_tokens: int) -> dict:
    from swaserve.request import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    c0 = engine.counters()
    for i, p in enumerate(prompts):
        engine.add_request(f"r{time.monotonic_ns()}-{i}", p, params)
    rows = steps = 0
    decode_s = 0.0
    t0 = time.perf_counter()
    while engine.has_unfinished():
        s0 = time.perf_counter()
        engine.step(finished_only=True)
        if engine.last_step is not None and engine.last_step[0] in ("decode", "verify"):
            rows += engine.last_step[1]
            steps += 1
            decode_s += time.perf_counter() - s0
    wall = time.perf_counter() - t0
    c1 = engine.counters()
    gen = c1["generation_tokens_total"] - c0["generation_tokens_total"]
    drafted = c1["spec_draft_tokens_total"] - c0["spec_draft_tokens_total"]
    accepted = c1["spec_accepted_tokens_total"] - c0["spec_accepted_tokens_total"]
    # tokens_per_row_step: output tokens per request per decode/verify step (each prompt's first token
    # comes from its prefill, so plain decoding shows slightly above 1).
    return {"tok_s": gen / wall, "tokens_per_row_step": gen / max(rows, 1), "accept_rate": accepted / drafted if drafted else None,
            "step_ms": 1000 * decode_s / max(steps, 1), "generated": gen}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF / HF dir (default: embedded, or --shape)")
    ap.add_argument("--shape", default=None, help="1b, 4b, mimo-6l (benchmarks/common.py): a config-only dir with "
                    "random weights")
    ap.add_argument("--device", default=None)
    ap.add_argument("--methods", default="plain,ngram,draft")
    ap.add_argument("--workloads", default="copy,ordinary")
    ap.add_argument("--batch-sizes", default="1,8,32")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--num-tokens", type=int, default=4, help="speculative_num_tokens (K)")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (one GPU each; rank 0 drafts alone)")
    ap.add_argument("--max-context", type=int, default=None, help="max prompt + output tokens (default: the model's)")
    ap.add_argument("--quantization", choices=("fp8",), default=None,
                    help="fp8: quantise the weights at load (128 x 128 blocks: the target and MiMo-V2-Flash's MTP "
                    "layer, not a draft model)")
    args = parse_args(ap, argv, smoke=dict(shape="tiny", device="cpu", methods="plain,ngram,draft",
                                           batch_sizes="2", max_tokens=8, num_tokens=2))
    import torch

    from swaserve.engine import Engine

    model, opts = args.model, {"max_running_requests": 64, "tensor_parallel_size": args.tp,
                               "max_context": args.max_context, "quantization": args.quantization}
    if args.shape:
        model, opts["load_format"] = model_dir(args.shape), "dummy"
    dev = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    hw = torch.cuda.get_device_name() if dev == "cuda" else platform.processor() or "cpu"
    print(f"# {hw}, torch {torch.__version__}, model {args.shape or args.model or 'embedded'}, K={args.num_tokens}, "
          f"{args.max_tokens} greedy tokens per request, tp={args.tp}, weights {args.quantization or 'as stored'}",
          flush=True)
    spec = {"plain": {}, "ngram": {"speculative_method": "ngram"},
            "draft": {"speculative_method": "draft", "speculative_draft_model": model},
            "mtp": {"speculative_method": "mtp"}}
    results: dict[tuple, dict] = {}
    for method in args.methods.split(","):
        t0 = time.perf_counter()
        engine = Engine(model, device=dev, **opts, **spec[method], speculative_num_tokens=args.num_tokens)
        # Where a long run's time goes (a TP=4 MiMo MTP engine printed nothing in 250 s on 4x H200).
        print(f"# {method}: engine started in {time.perf_counter() - t0:.1f} s", flush=True)
        vocab = engine.model_config.vocab_size
        for kind in args.workloads.split(","):
            for bs in (int(b) for b in args.batch_sizes.split(",")):
                # Once untimed first: the kernels' JIT for this run's shapes (verify steps are extend-shaped).
                run(engine, prompts_for(kind, bs, engine.tokenizer, vocab, random.Random(bs)), args.max_tokens)
                row = run(engine, prompts_for(kind, bs, engine.tokenizer, vocab, random.Random(bs)), args.max_tokens)
                results[(method, kind, bs)] = row
                print(json.dumps({"method": method, "workload": kind, "bs": bs, "tp": args.tp, **row}), flush=True)
        engine.close()  # the other tensor-parallel ranks exit before the next method's start
        del engine
        gc.collect()
        empty_cache(torch.device(dev))
    print(f"\n{'method':7} {'workload':9} {'bs':>3} {'tok/s':>9} {'speedup':>8} {'tok/step':>8} {'accept':>7} {'step ms':>8}")
    for (method, kind, bs), r in results.items():
        base = results.get(("plain", kind, bs))
        speed = f"{r['tok_s'] / base['tok_s']:.2f}x" if base else "-"
        acc = f"{r['accept_rate']:.0%}" if r["accept_rate"] is not None else "-"
        print(f"{method:7} {kind:9} {bs:>3} {r['tok_s']:>9.1f} {speed:>8} {r['tokens_per_row_step']:>8.2f} {acc:>7} "
              f"{r['step_ms']:>8.2f}")


if __name__ == "__main__":
    main()
