"""Shared pieces of the model tests that drive a real Runtime through its scheduler."""

from __future__ import annotations

import torch

from swaserve.config import CacheConfig, RunnerConfig, SchedulerConfig
from swaserve.loader.hf_dir import load_model_from_dir
from swaserve.runtime import build_runtime


class Params:  # the SamplingParams fields the scheduler reads
    def __init__(self, max_tokens: int):
        self.max_tokens, self.ignore_eos, self.stop_token_ids = max_tokens, True, []
        self.prompt_logprobs = None


def small_hybrid_runtime(path, backend: str, kv_cache_dtype: str = "auto"):
    """A CPU fp32 runtime of the model at `path` with a small SWA pool (~1/4 of the full one) that
    recycles slots, so full and SWA indices diverge (an untranslated list would read the wrong
    rows), eviction at once (margin 0, chunk 1), and prefill chunks of 7 tokens. `fp8_e4m3`: the
    same pool sizes, in a quarter of the bytes."""
    config, model = load_model_from_dir(path, "cpu", torch.float32)
    budget = 60_000 if kv_cache_dtype == "auto" else 15_000
    cache = CacheConfig(kv_cache_bytes=budget, swa_full_tokens_ratio=0.25, swa_evict_margin=0, swa_evict_chunk=1,
                        kv_cache_dtype=kv_cache_dtype)
    sched = SchedulerConfig(max_running_requests=4, max_prefill_tokens=7)  # chunks cross W = 8
    return build_runtime(config, model, torch.device("cpu"), torch.float32, cache, sched,
                         RunnerConfig(attention_backend=backend))


def greedy_tokens(engine, prompts: list[list[int]], steps: int, after_step=None) -> dict[str, list[int]]:
    """Run `prompts` (request ids "0", "1", ...) through a real Engine, `steps` greedy tokens each (EOS
    ignored), calling `after_step()` after every step; each request's output token ids."""
    from swaserve.request import SamplingParams

    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True))
    out: dict[str, list[int]] = {}
    while engine.has_unfinished():
        out.update({o.request_id: list(o.outputs[0].token_ids) for o in engine.step() if o.finished})
        if after_step is not None:
            after_step()
    return out


def spy_with_truth(drafter, plain: dict[str, list[int]]) -> list[tuple[list[int], int, list[int]]]:
    """Wrap a state-head drafter's `propose` (EAGLE-3, MiMo MTP): record each proposal as (ids, the
    sequence's base, drafts), and hand the target the first a = (call number) % 4 true tokens (from
    `plain`, the plain greedy outputs) in front of the rest, so verify steps accept 0..3 drafts (a
    random head alone has none accepted) and the head's cache must follow accepted drafts too.
    Returns the record list, filled as the engine runs."""
    records: list[tuple[list[int], int, list[int]]] = []
    propose = drafter.propose

    def spy(reqs, ks):
        out = propose(reqs, ks)
        records.extend((list(r.ids), drafter.seqs[r.rid].base, d) for r, d in zip(reqs, out) if d)
        a = len(records) % 4
        truth = [plain[r.group_id][len(r.ids) - r.prompt_len:] for r in reqs]
        return [(t[:a] + d[a:])[: len(d)] if d else d for t, d in zip(truth, out)]

    drafter.propose = spy
    return records
