"""The prefix cache on the embedded Gemma 3 270M (W = 512, fp32, greedy): a shared part longer than
the window, follow-ups diverging inside and after it, n > 1 and aborts give the same tokens as
without the cache, report the cached tokens, and leave nothing behind."""

from __future__ import annotations

import pytest

from swaserve import SamplingParams

from engine_prompts import prompt_of

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def no_cache():
    from swaserve.engine import Engine

    return Engine(device="cpu", disable_prefix_cache=True)


def _generate(engine, prompts, params=GREEDY):
    for i, p in enumerate(prompts):
        engine.add_request(f"p{i}", p, params)
    outs = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o
        engine.scheduler.check_integrity()
    return [outs[f"p{i}"] for i in range(len(prompts))]


def test_cache_on_equals_off_and_counts_cached_tokens(llm, long_ids, no_cache):
    engine = llm.engine
    llm.reset_prefix_cache()
    system = prompt_of(long_ids, 600, 21)  # longer than the window
    q1, q2 = long_ids[1500:1520], long_ids[1700:1712]
    first = system + q1
    stats0 = engine.counters()
    seq = [first, system + q2]  # one after the other: the second finds the first's prompt
    on = [_generate(engine, [p])[0] for p in seq]
    off = [_generate(no_cache, [p])[0] for p in seq]
    follow = first + list(on[0].outputs[0].token_ids) + long_ids[1800:1805]  # diverges after the first's end
    inside = system[:-100] + q2  # diverges 100 tokens before the cached prompt's end (inside the window)
    on += [_generate(engine, [p])[0] for p in (follow, inside)]
    off += [_generate(no_cache, [p])[0] for p in (follow, inside)]
    for a, b in zip(on, off):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert b.num_cached_tokens == 0
    # The second shares the whole system prompt; the follow-up everything the first computed
    # (its prompt and all outputs but the last, whose K/V was never computed); the third the part
    # of the system prompt before it diverges.
    assert [o.num_cached_tokens for o in on] == [0, len(system), len(first) + 7, len(system) - 100]
    stats = engine.counters()
    assert stats["prefix_cache_hit_tokens_total"] - stats0["prefix_cache_hit_tokens_total"] == sum(
        o.num_cached_tokens for o in on)
    queried = sum(len(p) for p in (*seq, follow, inside))
    assert (stats["prefix_cache_hit_tokens_total"] + stats["prefix_cache_miss_tokens_total"]
            - stats0["prefix_cache_hit_tokens_total"] - stats0["prefix_cache_miss_tokens_total"]) == queried
    assert stats["full_tokens_cached"] >= len(follow) and stats["full_tokens_used"] == 0
    assert 0 < stats["swa_tokens_cached"] <= stats["full_tokens_cached"]


def test_n_sequences_share_one_prefill_and_aborts_free_everything(llm, long_ids):
    engine = llm.engine
    llm.reset_prefix_cache()
    prompt = prompt_of(long_ids, 300, 77)
    before = engine.counters()["prefix_cache_hit_tokens_total"]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, n=3)
    out = _generate(engine, [prompt], params)[0]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 1, "greedy siblings agree"
    assert engine.counters()["prefix_cache_hit_tokens_total"] - before == 2 * (len(prompt) - 1)
    # Aborts at every stage (waiting, mid-prefill, decoding) with the cache holding their prefixes.
    engine.add_request("x", prompt + long_ids[900:910], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    engine.add_request("y", prompt_of(long_ids, 700, 5), SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    engine.add_request("z", "Hello there", SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    for _ in range(3):
        engine.step()
        engine.scheduler.check_integrity()
    for rid in ("x", "y", "z"):
        engine.abort(rid)
        engine.scheduler.check_integrity()
    while engine.has_unfinished():
        engine.step()
    s = engine.memory_stats()
    assert s["full_tokens_used"] == 0 and s["swa_tokens_used"] == 0 and s["running"] == s["waiting"] == 0
    llm.reset_prefix_cache()
    s = engine.memory_stats()
    assert s["full_tokens_cached"] == 0 and engine.allocator.full.available() == engine.allocator.full.size
    assert engine.allocator.swa.available() == engine.allocator.swa.size
    engine.scheduler.check_integrity()
