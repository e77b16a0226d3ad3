"""What sampling settings cost per decode step on the GPU: the LM head and the Sampler from the final
hidden states, for Gemma 3's vocabulary (262,144) at 1B's hidden size, by batch size. Greedy takes
the no-logits head, and so does temperature-only sampling (the launcher's routing); everything else
writes float32 logits and runs the Sampler. Compare each row with the decode step (1B at 64 rows:
~2 ms).

    python benchmarks/sampler.py [--batch-sizes 1,64,256]
    python benchmarks/sampler.py --smoke     # tiny vocabulary on the CPU (CI)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bench_device, graph_us, hardware, parse_args  # noqa: E402

from swaserve.layers.embedding import LMHead, VocabEmbedding  # noqa: E402
from swaserve.request import SamplingParams  # noqa: E402
from swaserve.runner.sampler import Sampler  # noqa: E402
from swaserve.runner.sampling_batch import SamplingBatch  # noqa: E402

VOCAB, HIDDEN = 262144, 1152  # Gemma 3, 1B (--vocab, --hidden)
SETTINGS = {
    "greedy": None,
    "temperature 0.7": SamplingParams(temperature=0.7),
    "top_k 50": SamplingParams(temperature=0.7, top_k=50),
    "top_p 0.9": SamplingParams(temperature=0.7, top_p=0.9),
    "top_k 64 + top_p 0.95": SamplingParams(temperature=1.0, top_k=64, top_p=0.95),  # Gemma's defaults
    "min_p 0.05": SamplingParams(temperature=0.7, min_p=0.05),
    "logprobs 5 (greedy)": SamplingParams(temperature=0.0, logprobs=5),
}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", default="1,64,256")
    ap.add_argument("--vocab", type=int, default=VOCAB)
    ap.add_argument("--hidden", type=int, default=HIDDEN)
    ap.add_argument("--calls", type=int, default=2, help="calls per captured graph")
    args = parse_args(ap, argv, smoke=dict(batch_sizes="1,3", vocab=512, hidden=64, calls=1))
    dev = bench_device(args.smoke)
    print(f"# {hardware()}; vocab {args.vocab}, hidden {args.hidden}, bf16; us per step, CUDA-graph timed")
    emb = VocabEmbedding(args.vocab, args.hidden).to(dev, torch.bfloat16)
    torch.nn.init.normal_(emb.weight, std=0.02)
    head = LMHead(args.vocab, args.hidden, tied=True)
    sampler = Sampler()
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    rows = []
    for name, params in SETTINGS.items():
        cells = []
        for bs in sizes:
            hidden = torch.randn(bs, args.hidden, device=dev, dtype=torch.bfloat16)
            sb = (None if params is None
                  else SamplingBatch.build([params] * bs, [[]] * bs, [[]] * bs, args.vocab, dev))

            def step(i, hidden=hidden, sb=sb):
                if sb is None:
                    return head.greedy(hidden, emb)
                if sb.inv_temperatures is not None:
                    return head.sample(hidden, emb, sb.inv_temperatures, sb.seeds)
                return sampler(head(hidden, emb), sb)
            with torch.inference_mode():
                cells.append(graph_us(step, calls=args.calls))
        rows.append((name, cells))
        us = {str(bs): round(c, 1) for bs, c in zip(sizes, cells)}
        print(json.dumps({"setting": name, "us": us}), flush=True)
    print(f"\n{'setting':<22}" + "".join(f"{'bs ' + str(b):>10}" for b in sizes))
    for name, cells in rows:
        print(f"{name:<22}" + "".join(f"{c:>10.1f}" for c in cells))


if __name__ == "__main__":
    main()
