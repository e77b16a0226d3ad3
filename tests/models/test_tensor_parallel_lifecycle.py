"""Tensor-parallel engines end cleanly and start again (CPU, two gloo ranks, fp32, random weights drawn
by `load_format="dummy"`): one closed by a `with` block, one dropped and garbage-collected, one
closed by `close()`, one after the other in this process, each leaving no rank process; all three give
the same greedy tokens as the one-rank engine on the same dummy weights (every tensor drawn whole,
then sharded). A second engine while one is open is refused before it starts a rank. Deterministic
mode sums every all-reduce in rank order: probes alone and among other requests are bitwise equal."""

from __future__ import annotations

import gc
import json
import os
import random
import subprocess
import sys

import psutil
import pytest
import torch
from families import make_hf_model
from test_deterministic import GREEDY as GREEDY_LOGPROBS
from test_deterministic import PROBES, _drain, _sampled

from swaserve import LLM, SamplingParams
from swaserve.distributed.state import tp_group

OPTIONS = {"device": "cpu", "dtype": "float32", "load_format": "dummy", "max_prefill_tokens": 16,
           "max_running_requests": 4, "max_context": 128, "kv_cache_bytes": 4 << 20}
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def rank_processes() -> list[psutil.Process]:
    """This process's tensor-parallel ranks (spawned children, not the resource tracker)."""
    return [p for p in psutil.Process().children(recursive=True)
            if "spawn_main" in " ".join(p.cmdline()) and "resource_tracker" not in " ".join(p.cmdline())]


def assert_gone(ranks: list[psutil.Process]) -> None:
    assert len(ranks) == 1, "the engine ran its second rank in a process of its own"
    _gone, alive = psutil.wait_procs(ranks, timeout=5)
    assert not alive, f"rank processes still running: {alive}"
    assert not rank_processes()


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    """Gemma 4 with routed experts (K/V heads and every expert's width split over the ranks); the
    engines draw its weights (`load_format="dummy"`)."""
    path = tmp_path_factory.mktemp("gemma4_moe")
    make_hf_model("gemma4_moe", path)
    return str(path)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(1, 150, (n,), generator=g).tolist() for n in (23, 9, 40)]


def tokens(llm: LLM) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts(), GREEDY, use_tqdm=False)]


@pytest.mark.slow
def test_with_block_garbage_collection_and_close_each_end_the_engine(moe_dir):
    with LLM(moe_dir, **OPTIONS) as llm:
        one = tokens(llm)  # one rank: the reference
    assert len({tuple(t) for t in one}) > 1, "the dummy model's tokens depend on the prompt"

    names = []  # each engine's group names are its own: symmetric memory keeps a store per name
    with LLM(moe_dir, tensor_parallel_size=2, **OPTIONS) as llm:
        assert tokens(llm) == one
        names.append(tp_group().group.group_name)
        ranks = rank_processes()
        with pytest.raises(ValueError, match="another tensor-parallel engine is open"):
            LLM(moe_dir, tensor_parallel_size=2, **OPTIONS)
        assert rank_processes() == ranks, "the refused engine started a rank"
    assert_gone(ranks)

    llm = LLM(moe_dir, tensor_parallel_size=2, **OPTIONS)
    assert tokens(llm) == one
    names.append(tp_group().group.group_name)
    assert len(set(names)) == 2, names
    ranks = rank_processes()
    del llm
    gc.collect()
    assert_gone(ranks)

    llm = LLM(moe_dir, tensor_parallel_size=2, **OPTIONS)
    assert tokens(llm) == one
    ranks = rank_processes()
    llm.close()
    assert_gone(ranks)
    llm.close()  # idempotent
    with pytest.raises(RuntimeError, match="the engine is closed"):
        llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)


def test_one_rank_engine_close_and_garbage_collection_drop_its_device_state(moe_dir):
    """Without ranks too: `close()` drops the model, pools and graphs (on a GPU it also collects their
    reference cycles and hands the memory back to the device); so does dropping the engine."""
    import weakref

    from swaserve.engine import Engine

    engine = Engine(moe_dir, **OPTIONS)
    model, pools = weakref.ref(engine.runner.model), weakref.ref(engine._runtime.kv)
    engine.close()
    gc.collect()
    assert model() is None and pools() is None
    assert not engine.has_unfinished()
    with pytest.raises(RuntimeError, match="the engine is closed"):
        engine.add_request("a", [1, 2, 3])
    engine = Engine(moe_dir, **OPTIONS)
    model = weakref.ref(engine.runner.model)
    del engine
    gc.collect()
    assert model() is None


@pytest.mark.slow
def test_deterministic_tp2_probes_identical_alone_and_among_other_requests(tmp_path):
    make_hf_model("gemma3", tmp_path, seed=5)
    probes = [("g", PROBES[1], GREEDY_LOGPROBS), ("s", PROBES[2], _sampled(2))]  # past the window, chunked
    with LLM(str(tmp_path), tensor_parallel_size=2, enable_deterministic_inference=True, disable_prefix_cache=True,
             **{**OPTIONS, "load_format": "auto", "max_running_requests": 8, "max_prefill_tokens": 7}) as llm:
        engine = llm.engine
        assert engine.tp.group.ordered
        alone = {}
        for rid, prompt, params in probes:
            alone.update(_drain(engine, [(0, rid, prompt, params)]))
        rng = random.Random(1)
        others = [(f"o{j}", [rng.randrange(2, 150) for _ in range(rng.randrange(3, 26))],
                   SamplingParams(temperature=rng.choice([0.0, 1.0]), max_tokens=rng.randrange(2, 8),
                                  ignore_eos=True)) for j in range(4)]
        reqs = probes + others
        rng.shuffle(reqs)
        loaded = _drain(engine, [(rng.randrange(0, 3), rid, p, sp) for rid, p, sp in reqs])
    assert {k: loaded[k] for k in alone} == alone


# Rank r's partials (float32): summed in rank order, element 0 is (1e8 - 1e8) + 1 = 1 and element 1 is
# (1 + 1e8) - 1e8 = 0; any other order gets one of them wrong (1e8 + (-1e8 + 1) = 0, 1 + (1e8 - 1e8) = 1).
PARTIALS = [[1e8, 1.0, 3.0], [-1e8, 1e8, 0.1], [1.0, -1e8, 0.7]]
ORDERED_RANK = """
import json, os, sys, torch
from swaserve.distributed.launch import init_rank
from swaserve.distributed.state import all_reduce
rank, world, addr = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
init_rank(rank, world, addr, torch.device("cpu"), ordered=True)
x = torch.tensor(json.loads(sys.argv[4])[rank]).repeat(2, 1)  # [2, 3]: the same partials in two rows
print(json.dumps(all_reduce(x).tolist()), flush=True)
torch.distributed.destroy_process_group()
# As the engine's ranks do (distributed/worker.py): skip the interpreter's teardown, where gloo's threads
# can still be joinable when C++ statics go and std::terminate aborts a rank that finished (seen in CI).
os._exit(0)
"""


def test_ordered_all_reduce_sums_in_rank_order():
    """Three gloo ranks (`ordered`, deterministic mode's all-reduce): every rank gets ((p0 + p1) + p2)."""
    from swaserve.distributed.launch import free_local_addr

    addr = free_local_addr()
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    procs = [subprocess.Popen([sys.executable, "-c", ORDERED_RANK, str(r), "3", addr, json.dumps(PARTIALS)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(3)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    parts = torch.tensor(PARTIALS)  # [rank, element] float32
    want = (parts[0] + parts[1]) + parts[2]
    assert want[:2].tolist() == [1.0, 0.0]
    for out, _ in outs:
        assert json.loads(out) == [want.tolist()] * 2
