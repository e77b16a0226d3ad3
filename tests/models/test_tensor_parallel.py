"""Tensor parallelism on CPU (gloo, two rank processes, fp32): the same greedy tokens at TP=2 as at
TP=1 on tiny random models of the families whose layers it splits differently: K/V heads sharded
(Gemma 3), one K/V head replicated and a vocabulary that does not split evenly (Gemma 3 MQA), attention
sinks and biased experts (GPT-OSS; its MXFP4 form split unevenly on 32-input groups: 64 and 32 of 96),
K = V full layers with one K/V head beside sharded sliding layers
and a routed-experts block (Gemma 4 MoE), per-layer embeddings and KV-shared layers (Gemma 4 PLE),
V narrower than K with sliding layers holding twice the K/V heads and per-expert checkpoints (MiMo-V2).
Prompts cross the window, prefill is chunked, requests batch; every rank's request table and SWA
mapping equal rank 0's after every step, and both pools are empty at the end."""

from __future__ import annotations

import pytest
import torch
from families import make_hf_model
from scheduled import greedy_tokens

from swaserve.engine import Engine

PROMPT_LENS = (23, 9, 40, 17)
STEPS = 12
OPTIONS = {"max_prefill_tokens": 16, "max_running_requests": 4, "max_context": 128, "kv_cache_bytes": 4 << 20}


def generate(path: str, prompts: list[list[int]], tp: int, overlap: bool = False) -> dict[str, list[int]]:
    engine = Engine(path, device="cpu", dtype="float32", tensor_parallel_size=tp, overlap_schedule=overlap, **OPTIONS)
    try:
        out = greedy_tokens(engine, prompts, STEPS, engine.check_integrity)  # every rank's tables included
        stats = engine.memory_stats()
        assert stats["full_tokens_used"] == 0 and stats["swa_tokens_used"] == 0
        return out
    finally:
        engine.close()


@pytest.mark.slow
@pytest.mark.parametrize(("family", "overlap"), [("gemma3", False), ("gemma3_mqa", True), ("gpt_oss", False),
                                                 ("gpt_oss_mxfp4", False), ("gemma4_moe", False),
                                                 ("gemma4_ple", False), ("mimo_v2_flash", False)])
def test_tp2_tokens_equal_tp1(family, overlap, tmp_path):
    """`overlap`: rank 0 schedules step N+1 (and sends it) before it has step N's tokens."""
    hf = make_hf_model(family, tmp_path)
    vocab = hf.config.vocab_size
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(1, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]
    one = generate(str(tmp_path), prompts, 1)
    two = generate(str(tmp_path), prompts, 2, overlap)
    assert sorted(one) == [str(i) for i in range(len(prompts))]
    assert two == one


def test_tp_that_does_not_split_the_heads_is_refused_before_any_rank_starts(tmp_path):
    import multiprocessing

    import transformers as tf
    from families import COMMON

    make_hf_model("gemma3", tmp_path / "a")  # 4 query heads, 2 K/V heads
    with pytest.raises(ValueError, match="tensor_parallel_size 3 must divide the number of attention heads"):
        Engine(str(tmp_path / "a"), device="cpu", tensor_parallel_size=3)
    # 6 query heads, 3 K/V heads: 2 ranks would hold 1.5 K/V heads each; 6 ranks would each hold half a group.
    tf.Gemma3TextConfig(**{**COMMON, "hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 3},
                        num_hidden_layers=2,
                        head_dim=16, sliding_window=8).save_pretrained(tmp_path / "b")
    for tp, match in ((2, "must divide the number of K/V heads"), (4, "must divide the number of attention heads")):
        with pytest.raises(ValueError, match=match):
            Engine(str(tmp_path / "b"), device="cpu", load_format="dummy", tensor_parallel_size=tp)
    assert not multiprocessing.active_children(), "a refused configuration started a rank"


def test_tp_on_more_gpus_than_there_are_is_refused():
    from swaserve.config import ParallelConfig
    from swaserve.distributed.launch import check_devices

    with pytest.raises(ValueError, match=r"needs \d+ GPUs per node from cuda:0; this node has \d+"):
        check_devices(torch.device("cuda"), ParallelConfig(tensor_parallel_size=torch.cuda.device_count() + 2
                                                           if torch.cuda.device_count() else 2))


@pytest.mark.slow
def test_two_nodes_on_one_machine(tmp_path):
    """`--nnodes 2`: node 1 runs `swaserve serve --node-rank 1` (ranks only), node 0 the engine; the
    rendezvous at --dist-init-addr. Both on this machine, over loopback."""
    import os
    import subprocess
    import sys

    from swaserve.distributed.launch import free_local_addr

    hf = make_hf_model("gemma3", tmp_path)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, hf.config.vocab_size, (n,), generator=g).tolist() for n in PROMPT_LENS]
    one = generate(str(tmp_path), prompts, 1)
    addr = free_local_addr()
    flags = ["--model", str(tmp_path), "--device", "cpu", "--dtype", "float32", "--tp", "2", "--nnodes", "2",
             "--dist-init-addr", addr, "--max-prefill-tokens", "16", "--max-running-requests", "4",
             "--max-context", "128", "--kv-cache-mb", "4"]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    node1 = subprocess.Popen([sys.executable, "-m", "swaserve", "serve", *flags, "--node-rank", "1"], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        engine = Engine(str(tmp_path), device="cpu", dtype="float32", tensor_parallel_size=2, nnodes=2,
                        dist_init_addr=addr, **{**OPTIONS, "kv_cache_bytes": 4 << 20})
        try:
            two = greedy_tokens(engine, prompts, STEPS)
            engine.check_integrity()
        finally:
            engine.close()
        assert two == one
        assert node1.wait(timeout=30) == 0, node1.stderr.read()
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait()
