"""The prefix cache on a tiny random Gemma 3 (W = 8, fp32, greedy): randomised workloads of prompts
sharing prefixes longer than the window, diverging inside and after it, with n > 1 and aborts, give
the same tokens with the cache on and off, with and without overlap; integrity after every step;
nothing leaks."""

from __future__ import annotations

import random

import pytest
import torch
from families import make_hf_model

from swaserve.engine import Engine
from swaserve.loader import LoadedModel
from swaserve.loader.hf_dir import load_model_from_dir
from swaserve.request import SamplingParams


def _engine(path, overlap: bool, cache: bool) -> Engine:
    config, model = load_model_from_dir(path, "cpu", torch.float32)
    return Engine(LoadedModel(config, model, None, "tiny"), device="cpu", dtype=torch.float32,
                  kv_cache_bytes=90_000, swa_full_tokens_ratio=0.3, swa_evict_chunk=2,
                  max_running_requests=4, max_prefill_tokens=9, overlap_schedule=overlap,
                  disable_prefix_cache=not cache)


def _workload(seed: int) -> list[tuple[int, str, list[int], SamplingParams, int | None]]:
    """(arrival step, id, prompt, params, abort step): a few 'system prompts' of 10-30 tokens,
    each followed by short questions; some arrive as a follow-up of an earlier prompt."""
    rng = random.Random(seed)
    systems = [[rng.randrange(1, 160) for _ in range(rng.randrange(10, 30))] for _ in range(3)]
    out = []
    for i in range(10):
        base = systems[rng.randrange(3)]
        cut = len(base) - rng.choice([0, 0, 2, 5, 12])  # diverge at its end, inside or before the window
        prompt = base[:max(1, cut)] + [rng.randrange(1, 160) for _ in range(rng.randrange(1, 6))]
        n = 2 if i % 4 == 3 else 1
        params = SamplingParams(temperature=0, max_tokens=rng.randrange(3, 10), ignore_eos=True, n=n)
        abort = rng.randrange(1, 8) if i % 5 == 4 else None
        out.append((rng.randrange(0, 30), f"r{i}", prompt, params, abort))
    return out


def _run(engine: Engine, work) -> dict[str, list[list[int]]]:
    out: dict[str, list[list[int]]] = {}
    step, aborted = 0, set()
    while step < 600 and (engine.has_unfinished() or step <= max(w[0] for w in work)):
        for at, rid, prompt, params, abort in work:
            if at == step:
                engine.add_request(rid, prompt, params)
            if abort is not None and at + abort == step:
                engine.abort(rid)
                aborted.add(rid)
        for o in engine.step():
            if o.finished:
                out[o.request_id] = [list(c.token_ids) for c in o.outputs]
        engine.scheduler.check_integrity()
        step += 1
    assert not engine.has_unfinished()
    return {k: v for k, v in out.items() if k not in aborted}


@pytest.mark.parametrize("seed,overlap", [(0, False), (1, True), (2, True)])
def test_cache_on_and_off_give_the_same_tokens(tmp_path, seed, overlap):
    make_hf_model("gemma3", tmp_path, seed=5)
    work = _workload(seed)
    off = _run(_engine(tmp_path, overlap, cache=False), work)
    engine = _engine(tmp_path, overlap, cache=True)
    on = _run(engine, work)
    assert on == off
    stats = engine.counters()
    assert stats["prefix_cache_hit_tokens_total"] > 0, "the shared prompts were reused"
    assert stats["full_tokens_used"] == 0 and stats["swa_tokens_used"] == 0, "only unlocked cache is left"
    engine.scheduler.reset_prefix_cache()
    engine.scheduler.check_integrity()
    alloc = engine.allocator
    assert alloc.full.available() == alloc.full.size and alloc.swa.available() == alloc.swa.size, "no leak"
