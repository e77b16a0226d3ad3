"""Offline generation speed on this machine: swaserve vs HF transformers `generate` on the same weights
(by default the embedded model, its GGUF dequantised for HF), batch 1 and batch 16, in one run.

    python benchmarks/cpu_generate.py [--batch-sizes 1,16] [--prompt-len 128] [--new-tokens 64] [--model DIR]
    python benchmarks/cpu_generate.py --smoke     # a tiny random model (CI)

Prints one JSON line per (engine, batch) and a table at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import model_dir, parse_args  # noqa: E402


def prompts_for(tok, bs: int, prompt_len: int) -> list[list[int]]:
    base = tok.encode("The history of the city begins with a small settlement by the river, and " * 64)
    return [base[i : i + prompt_len] for i in range(bs)]  # different prompts of equal length


def bench_swaserve(model: str | None, bs_list: list[int], prompt_len: int,
                   new_tokens: int) -> tuple[list[dict], object]:
    from swaserve import LLM, SamplingParams

    llm = LLM(model=model, device="cpu")
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    rows = []
    for bs in bs_list:
        prompts = prompts_for(llm.tokenizer, bs, prompt_len)
        llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t
        n = sum(len(o.outputs[0].token_ids) for o in outs)
        rows.append(dict(engine="swaserve", bs=bs, prompt_len=prompt_len, new_tokens=new_tokens,
                         seconds=round(dt, 2), out_tok_per_s=round(n / dt, 1)))
        print(json.dumps(rows[-1]), flush=True)
    return rows, llm


def hf_model(model: str | None):
    """HF transformers' model on the same weights: the GGUF dequantised, or the HF directory."""
    from transformers import AutoModelForCausalLM

    if model is None:
        from swaserve.loader.default_model import default_model_path

        model = str(default_model_path())
    if model.endswith(".gguf"):
        path = Path(model)
        return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                    torch_dtype=torch.float32)
    return AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.float32)


def bench_hf(model: str | None, llm, bs_list: list[int], prompt_len: int, new_tokens: int) -> list[dict]:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf = hf_model(model).eval()
    rows = []
    for bs in bs_list:
        ids = torch.tensor(prompts_for(llm.tokenizer, bs, prompt_len))
        kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        with torch.inference_mode():
            hf.generate(ids[:1], **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})  # warm-up
            t = time.perf_counter()
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), **kw)
            dt = time.perf_counter() - t
        n = (out.shape[1] - prompt_len) * bs
        rows.append(dict(engine="hf-transformers", bs=bs, prompt_len=prompt_len, new_tokens=new_tokens,
                         seconds=round(dt, 2), out_tok_per_s=round(n / dt, 1)))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF file or HF dir with weights (default: embedded)")
    ap.add_argument("--batch-sizes", default="1,16")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--skip-hf", action="store_true")
    a = parse_args(ap, argv, smoke=dict(batch_sizes="1,3", prompt_len=16, new_tokens=4))
    if a.smoke and a.model is None:
        a.model = model_dir("tiny", weights=True, tokenizer="words")
    bs_list = [int(x) for x in a.batch_sizes.split(",")]
    name = a.model or "embedded Gemma 3 270M"
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"threads {torch.get_num_threads()}, fp32, {name}", flush=True)
    rows, llm = bench_swaserve(a.model, bs_list, a.prompt_len, a.new_tokens)
    if not a.skip_hf:
        rows += bench_hf(a.model, llm, bs_list, a.prompt_len, a.new_tokens)
    print(f"\n{'engine':<16} {'batch':>5} {'prompt':>6} {'new':>5} {'seconds':>8} {'out tok/s':>10}")
    for r in rows:
        print(f"{r['engine']:<16} {r['bs']:>5} {r['prompt_len']:>6} {r['new_tokens']:>5} {r['seconds']:>8} {r['out_tok_per_s']:>10}")


if __name__ == "__main__":
    main()
