"""Overlap scheduling on the embedded Gemma 3 270M (CPU): an engine that schedules step N+1 before
it has seen step N's tokens gives the same results as one that waits, through chunked prefill,
retraction, stop strings, EOS, penalties, seeds, logprobs and n > 1, and leaves clean pools."""

from __future__ import annotations

import pytest

from swaserve import SamplingParams
from swaserve.engine import Engine
from swaserve.loader import LoadedModel

from engine_prompts import prompt_of


def twin_engine(llm, overlap: bool, **options) -> Engine:
    """An engine over the session model's weights (no second load)."""
    e = llm.engine
    loaded = LoadedModel(e.model_config, e.runner.model, e.tokenizer, e.model_name)
    return Engine(loaded, device="cpu", overlap_schedule=overlap, **options)


def run_all(engine: Engine, requests: list[tuple[str, object, SamplingParams]]) -> dict:
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    done = {}
    for _ in range(10_000):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
            engine.scheduler.check_integrity()
    assert not engine.has_unfinished()
    return done


def workload(long_ids: list[int]) -> list[tuple[str, object, SamplingParams]]:
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    return [
        ("greedy-long", prompt_of(long_ids, 700), greedy),
        ("greedy-short", prompt_of(long_ids, 20, 3), SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)),
        ("seeded", "Once upon a time", SamplingParams(temperature=0.9, top_p=0.9, max_tokens=16, seed=11)),
        ("penalties", prompt_of(long_ids, 90, 5), SamplingParams(temperature=0.7, seed=3, max_tokens=16,
                                                                 frequency_penalty=0.8, presence_penalty=0.4,
                                                                 repetition_penalty=1.3, ignore_eos=True)),
        ("greedy-penalty", prompt_of(long_ids, 60, 9), SamplingParams(temperature=0, max_tokens=16,
                                                                      frequency_penalty=1.5, ignore_eos=True)),
        ("logprobs-n", "The colour of the sky is", SamplingParams(temperature=1.0, n=2, seed=5, max_tokens=8,
                                                                  logprobs=2)),
        ("stop", "1, 2, 3, 4,", SamplingParams(temperature=0, max_tokens=30, stop=[" 9"])),
        ("eos", "Question: what is 2+2?\nAnswer:", SamplingParams(temperature=0, max_tokens=30)),
        ("one-token", prompt_of(long_ids, 300, 1), SamplingParams(temperature=0, max_tokens=1)),
    ]


# 270M: 36 KiB of K/V per token in both pools (ratio 1): 730 slots hold the 700-token prompt with
# room for only a few more, so the requests admitted beside it must be retracted as they grow.
TIGHT = dict(kv_cache_bytes=730 * 36864, swa_full_tokens_ratio=1.0, max_prefill_tokens=128)


@pytest.mark.parametrize("options", [dict(max_prefill_tokens=256), TIGHT], ids=["chunked", "retracting"])
def test_overlap_matches_waiting_engine(llm, long_ids, options):
    reqs = workload(long_ids)
    sync = run_all(twin_engine(llm, False, **options), reqs)
    ov_engine = twin_engine(llm, True, **options)
    ov = run_all(ov_engine, reqs)
    assert sync.keys() == ov.keys() == {rid for rid, _, _ in reqs}
    for rid in sync:
        for a, b in zip(sync[rid].outputs, ov[rid].outputs):
            assert a.token_ids == b.token_ids, rid
            assert a.text == b.text and a.finish_reason == b.finish_reason, rid
            assert (a.logprobs is None) == (b.logprobs is None), rid
            for da, db in zip(a.logprobs or [], b.logprobs or []):
                assert da.keys() == db.keys() and all(abs(da[t] - db[t]) < 1e-4 for t in da), rid
    assert sync["stop"].outputs[0].finish_reason == "stop"
    if "kv_cache_bytes" in options:
        assert ov_engine.stats.retractions_total > 0, "the small pool must force retractions"
    assert ov_engine.runner.last_tokens[0] == 0, "row 0 (padding) of the last-token table is never written"
    s = ov_engine.memory_stats()
    assert s["full_tokens_used"] == 0 and s["swa_tokens_used"] == 0 and s["running"] == s["waiting"] == 0


def test_overlap_reports_one_step_late_and_abort_mid_flight_frees_memory(llm, long_ids):
    engine = twin_engine(llm, True)
    engine.add_request("a", prompt_of(long_ids, 50), SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert engine.step() == [], "the first step is launched, not yet reported"
    first = engine.step()
    assert len(first) == 1 and len(first[0].outputs[0].token_ids) == 1
    engine.add_request("b", "Hello", SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    engine.step()  # b's prefill is launched while a's token is in flight
    engine.abort("b")
    engine.abort("a")
    assert engine.has_unfinished(), "the step in flight still has to be drained"
    assert engine.step() == [], "results of aborted requests are dropped"
    assert not engine.has_unfinished()
    engine.scheduler.check_integrity()
    s = engine.memory_stats()
    assert s["full_tokens_used"] == 0 and s["swa_tokens_used"] == 0


def test_step_deltas_rebuild_what_step_reports(llm, long_ids):
    """The engine core's per-step report (new tokens only) concatenates to `step()`'s cumulative
    outputs: tokens, logprobs and finish reasons, n > 1 included, through retraction and overlap."""
    reqs = workload(long_ids)
    sync = run_all(twin_engine(llm, False, **TIGHT), reqs)
    engine = twin_engine(llm, True, **TIGHT)
    for rid, prompt, params in reqs:
        engine.add_request(rid, prompt, params)
    tokens: dict[tuple[str, int], list[int]] = {}
    logprobs: dict[tuple[str, int], list[dict[int, float]]] = {}
    finish: dict[tuple[str, int], str] = {}
    while engine.has_unfinished():
        for d in engine.step_deltas():
            key = (d.request_id, d.index)
            assert key not in finish, f"{key} reported after its last delta"
            tokens.setdefault(key, []).extend(d.token_ids)
            if d.logprobs is not None:
                logprobs.setdefault(key, []).extend(d.logprobs)
            if d.finish_reason is not None:
                finish[key] = d.finish_reason
        engine.scheduler.check_integrity()
    assert engine.stats.retractions_total > 0
    expected = {(rid, c.index): c for rid, out in sync.items() for c in out.outputs}
    assert finish.keys() == expected.keys()
    for key, comp in expected.items():
        assert tokens[key] == list(comp.token_ids) and finish[key] == comp.finish_reason, key
        if comp.logprobs is not None:
            assert [d.keys() for d in logprobs[key]] == [d.keys() for d in comp.logprobs], key
    assert not engine._groups, "finished groups are dropped"
    s = engine.memory_stats()
    assert s["full_tokens_used"] == 0 and s["running"] == s["waiting"] == 0
