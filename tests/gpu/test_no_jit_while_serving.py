"""No Triton compile on the request path: after Engine start-up (warm-up forward + decode graph
capture), serving prompts of every awkward shape (1 token, odd and even counts, chunked prefill,
batch sizes 1 to many, finished requests leaving odd batches; greedy, temperature-only and top-p
sampling) compiles nothing new. A compile
costs ~0.3-1 s of stalled serving; on an H100 the first offline run of 256 requests paid 9 of
them (~1.2 s) before batch fields were aligned and batch sizes unspecialised."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch
from engine_driver import record

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from common import new_compiles, random_model  # noqa: E402

from swaserve.engine import Engine  # noqa: E402
from swaserve.kernels.common import compiled_variants  # noqa: E402
from swaserve.request import SamplingParams  # noqa: E402

pytestmark = pytest.mark.gpu
# Every way a step picks tokens: greedy and temperature-only in the LM head, top-p in the Sampler.
KINDS = [{"temperature": 0.0}, {"temperature": 0.7, "seed": 1}, {"temperature": 0.9, "top_p": 0.9}]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_serving_compiles_nothing_after_startup():
    e = Engine(random_model("270m", torch.device("cuda"), torch.bfloat16), device="cuda", dtype=torch.bfloat16,
               max_running_requests=24, max_prefill_tokens=512, max_context=2048, kv_cache_bytes=1 << 30)
    at_start = compiled_variants()
    assert at_start, "start-up compiled nothing: the kernels did not run"
    rng = random.Random(0)
    lens = [1, 2, 3, 16, 17, 31, 513, 700, 1, 5] + [rng.randint(1, 1200) for _ in range(30)]
    for wave in (lens[:1], lens[1:3], lens[3:]):  # batch sizes 1, 2, then many
        for i, n in enumerate(wave):
            e.add_request(f"{len(wave)}-{i}", [rng.randint(10, 200000) for _ in range(n)],
                          SamplingParams(max_tokens=rng.randint(1, 40), ignore_eos=True, **KINDS[i % len(KINDS)]))
        while e.has_unfinished():
            e.step()
    added = new_compiles(at_start, compiled_variants())
    record({"test": "no_jit_while_serving", "kernels_at_start": sum(at_start.values()), "compiled_while_serving": added})
    assert not added, f"kernels compiled while serving: {added}"
