"""Tensor parallelism on two GPUs with real-shape random weights (`load_format="dummy"`: every tensor drawn
whole, then sharded, so TP=2 and TP=1 hold the same model): Gemma-3-12B's layer shapes cut to 6 layers
(5 sliding, 1 full). TP=2 gives TP=1's greedy fp32 tokens with CUDA graphs, piecewise graphs and overlap
on; a `with` block, garbage collection and `close()` each give both GPUs' memory back (the rank process
exits, rank 0 drops its pools, graphs and weights) and another TP engine starts in the same process;
deterministic mode (bf16, all-reduces summed in rank order) gives probes bitwise the same tokens and
logprobs alone and among other requests."""

from __future__ import annotations

import gc
import random
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from common import GEMMA3_SHAPES
from engine_driver import record

from swaserve import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.multi_gpu]
GIB = 1 << 30
# What a closed engine may leave behind per GPU: this process's CUDA context growth (cuBLAS workspaces,
# loaded kernels). The engine itself holds >= 10 GiB on each GPU (weights, KV pools, graphs).
LEFT_BEHIND = 1 * GIB
OPTIONS = {"device": "cuda", "load_format": "dummy", "max_running_requests": 8, "max_prefill_tokens": 512,
           "max_context": 2048}


@pytest.fixture(scope="module")
def shape_dir(tmp_path_factory):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    from transformers import Gemma3TextConfig

    s = {**GEMMA3_SHAPES["12b"], "num_hidden_layers": 6}
    layer_types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(6)]
    cfg = Gemma3TextConfig(vocab_size=262144, query_pre_attn_scalar=256, layer_types=layer_types,
                           max_position_embeddings=4096, **s)
    cfg.architectures = ["Gemma3ForCausalLM"]
    path = tmp_path_factory.mktemp("gemma3_12b_6l")
    cfg.save_pretrained(path)  # config.json only: the engines draw the weights
    return str(path)


def prompts() -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(10, 200000) for _ in range(n)] for n in (1500, 40, 7, 300)]  # one past the window


def greedy(llm: LLM, steps: int = 12) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts(), params, use_tqdm=False)]


def held_gib() -> float:
    """What this process holds on its GPU through PyTorch (weights, pools, graph pools, cached blocks).
    Per process: the test processes that share these GPUs in `scripts/gpu_check.py` do not count (the
    GPU's free memory moved by GiBs under them)."""
    gc.collect()
    return torch.cuda.memory_reserved(0) / GIB


def rank_processes() -> list[psutil.Process]:
    """This process's tensor-parallel ranks (spawned children, not the resource tracker)."""
    return [p for p in psutil.Process().children(recursive=True)
            if "spawn_main" in " ".join(p.cmdline()) and "resource_tracker" not in " ".join(p.cmdline())]


def record_allocations() -> None:
    """Keep each allocation's Python stack from here on, for `live_blocks` to name what outlives an
    engine. Python frames only: recording C++ frames too, the TP=2 test below did not finish in 330 s
    on 2x H200 (150 s without recording on 4x H100), so it records nothing."""
    torch.cuda.memory._record_memory_history(stacks="python", max_entries=200_000)


def live_blocks(n: int = 6) -> str:
    """The `n` largest allocations still live on GPU 0, each with the frames (swaserve's and the tests')
    that made it."""
    blocks = [b for seg in torch.cuda.memory._snapshot()["segments"] if seg["device"] == 0
              for b in seg["blocks"] if b["state"] == "active_allocated"]
    lines = []
    for b in sorted(blocks, key=lambda b: -b["size"])[:n]:
        frames = [f"{f['filename'].rsplit('/', 2)[-1]}:{f['line']} {f['name']}" for f in b.get("frames", [])
                  if "swaserve" in f["filename"] or "tests" in f["filename"]][:8]
        lines.append(f"  {b['size'] / GIB:.3f} GiB <- " + " < ".join(frames))
    return "\n".join(lines) or "  (no live allocations: cached blocks only)"


def assert_back(before: float, ranks: list[psutil.Process], what: str) -> None:
    """The rank processes exited (the driver frees all of an exited process's memory) and this process
    gave back what the engine took."""
    _, alive = psutil.wait_procs(ranks, timeout=10)
    assert not alive, f"{what}: rank processes still running: {alive}"
    held = held_gib()
    assert held <= before + LEFT_BEHIND / GIB, (
        f"{what}: this process holds {held - before:.2f} GiB more than before (of which allocated: "
        f"{torch.cuda.memory_allocated(0) / GIB:.2f} GiB); largest live allocations:\n"
        f"{live_blocks()}")


def test_tp2_greedy_fp32_equals_tp1_on_real_shape_dummy_weights(shape_dir):
    with LLM(shape_dir, dtype="float32", kv_cache_bytes=2 * GIB, **OPTIONS) as llm:
        one = greedy(llm)
        assert llm.engine.runner.graph_runner is not None, "decode CUDA graphs are on"
    with LLM(shape_dir, dtype="float32", kv_cache_bytes=2 * GIB, tensor_parallel_size=2, **OPTIONS) as llm:
        assert llm.engine.runner.graph_runner is not None and llm.engine.overlap
        two = greedy(llm)
        llm.engine.check_integrity()
        closing = time.monotonic()
    record({"test": "tp2_close_seconds", "seconds": round(time.monotonic() - closing, 2)})
    assert len({tuple(t) for t in one}) > 1, "the dummy model's tokens depend on the prompt"
    assert two == one


def test_tp2_with_block_gc_and_close_give_both_gpus_memory_back(shape_dir):
    before = held_gib()
    kw = {"dtype": "bfloat16", "tensor_parallel_size": 2, "gpu_memory_fraction": 0.5, **OPTIONS}
    with LLM(shape_dir, **kw) as llm:
        first = greedy(llm, 6)
        ranks = rank_processes()
        assert len(ranks) == 1 and held_gib() > before + 10, "the engine holds its pools on GPU 0, a rank runs"
    assert_back(before, ranks, "after the with block")

    llm = LLM(shape_dir, **kw)  # the second engine in this process (the process group was destroyed)
    assert greedy(llm, 6) == first
    ranks = rank_processes()
    del llm
    assert_back(before, ranks, "after the engine was garbage-collected")

    llm = LLM(shape_dir, **kw)
    assert greedy(llm, 6) == first
    ranks = rank_processes()
    llm.close()
    assert_back(before, ranks, "after close()")


def test_tp1_close_gives_the_gpu_memory_back(shape_dir):
    record_allocations()
    before = held_gib()
    llm = LLM(shape_dir, dtype="bfloat16", gpu_memory_fraction=0.5, **OPTIONS)
    greedy(llm, 4)
    assert held_gib() > before + 10
    llm.close()
    assert_back(before, [], "after a one-rank engine's close()")


def test_tp2_deterministic_probes_identical_alone_and_among_other_requests(shape_dir):
    rng = random.Random(5)
    probes = [(f"p{i}", [rng.randrange(10, 200000) for _ in range(rng.choice([5, 60, 1100]))],
               SamplingParams(temperature=0 if i % 2 else 0.8, seed=i, max_tokens=16, ignore_eos=True, logprobs=2))
              for i in range(8)]
    others = [(f"o{j}", [rng.randrange(10, 200000) for _ in range(rng.randrange(3, 900))],
               SamplingParams(temperature=rng.choice([0.0, 1.0]), max_tokens=rng.randrange(2, 24), ignore_eos=True))
              for j in range(24)]
    with LLM(shape_dir, dtype="bfloat16", kv_cache_bytes=4 * GIB, tensor_parallel_size=2,
             enable_deterministic_inference=True, disable_prefix_cache=True, **OPTIONS) as llm:
        assert llm.engine.tp.group.ordered
        alone = {rid: llm.generate([p], sp, use_tqdm=False)[0].outputs[0] for rid, p, sp in probes}
        mixed = probes + others
        rng.shuffle(mixed)
        outs = llm.generate([p for _, p, _ in mixed], [sp for _, _, sp in mixed], use_tqdm=False)
        batched = {rid: o.outputs[0] for (rid, _, _), o in zip(mixed, outs)}
    for rid, a in alone.items():
        b = batched[rid]
        assert list(b.token_ids) == list(a.token_ids), rid
        assert [sorted(d.items()) for d in b.logprobs] == [sorted(d.items()) for d in a.logprobs], rid
