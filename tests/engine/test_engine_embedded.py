"""The engine end to end on the embedded Gemma 3 270M (real weights, fp32, CPU): batching,
chunked prefill, SWA-pool bounds over long generations, seeds, bad input, and clean pools."""

from __future__ import annotations

import pytest
from engine_prompts import prompt_of

from swaserve import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def assert_pools_empty(llm) -> None:
    s = llm.memory_stats()
    assert s["full_tokens_used"] == 0 and s["swa_tokens_used"] == 0, s
    assert s["running"] == 0 and s["waiting"] == 0, s
    llm.engine.scheduler.check_integrity()


def test_batch_equals_each_prompt_alone(llm, long_ids):
    prompts = [prompt_of(long_ids, n, shift) for n, shift in ((5, 0), (40, 7), (300, 3), (530, 11), (90, 50))]
    prompts.append("Question: what is the capital of France?\nAnswer:")
    batched = llm.generate(prompts, GREEDY, use_tqdm=False)
    for p, out in zip(prompts, batched):
        alone = llm.generate([p], GREEDY, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids
        assert out.outputs[0].text == alone.outputs[0].text
        assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 12
    assert_pools_empty(llm)


def test_chunked_prefill_matches_unchunked(llm, long_ids):
    from swaserve.engine import Engine

    prompt = prompt_of(long_ids, 2000)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    whole = llm.generate([prompt], params, use_tqdm=False)[0]  # default budget 2048: one chunk
    chunked_engine = Engine(device="cpu", max_prefill_tokens=300)
    chunked_engine.add_request("c", prompt, params)
    steps = 0
    out = None
    while chunked_engine.has_unfinished():
        for o in chunked_engine.step():
            out = o
        steps += 1
    assert steps >= 7 + 7, "2000 tokens in chunks of 300 take 7 prefill steps, then 7 decode steps"
    assert out.outputs[0].token_ids == whole.outputs[0].token_ids
    assert chunked_engine.memory_stats()["swa_tokens_used"] == 0


@pytest.fixture(scope="module")
def window_64_engine(llm):
    """The embedded model's weights, layers and pools with its sliding window set to 64 instead of
    512: a generation crosses the window in 64 decode steps rather than 512 (~0.1 s each here)."""
    import copy

    from swaserve.engine import Engine
    from swaserve.loader import LoadedModel
    from swaserve.model_config import ModelConfig
    from swaserve.models.registry import build_model

    hf = copy.deepcopy(llm.engine.model_config.hf_config)
    hf.sliding_window = 64
    config = ModelConfig.from_hf(hf, max_context=llm.engine.model_config.max_context)
    model = build_model(config, llm.engine.dtype, llm.engine.device)
    model.load_state_dict(llm.engine.runner.model.state_dict())
    return Engine(LoadedModel(config, model, llm.tokenizer, "gemma-3-270m-w64"), device="cpu")


def test_long_generation_keeps_swa_usage_bounded(window_64_engine, long_ids):
    engine = window_64_engine
    window = engine.model_config.sliding_window
    assert window == 64
    bound = engine.scheduler.evictor.max_held()
    prompt = prompt_of(long_ids, window - 16)  # prefilled in one step: the decode steps are the test's cost
    new = window + 100  # the generation alone crosses a window; the context reaches past two and the bound
    engine.add_request("long", prompt, SamplingParams(temperature=0, max_tokens=new, ignore_eos=True))
    full_seen, swa_max = [], 0
    while engine.has_unfinished():
        engine.step()
        s = engine.memory_stats()
        if s["running"]:
            full_seen.append(s["full_tokens_used"])
            swa_max = max(swa_max, s["swa_tokens_used"])
            assert s["swa_tokens_used"] <= bound, (s, bound)
    assert full_seen[-1] >= len(prompt) + new - 2 > max(2 * window, bound + 64), "the full pool keeps the whole context"
    assert full_seen == sorted(full_seen), "full-pool usage only grows"
    assert window <= swa_max <= bound
    s = engine.memory_stats()
    assert s["full_tokens_used"] == 0 and s["swa_tokens_used"] == 0 and s["running"] == 0, s
    engine.scheduler.check_integrity()


def test_seed_gives_same_text_alone_and_in_batch(llm, long_ids):
    seeded = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=16, seed=1234, ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)
    prompt = "Once upon a time"
    alone = llm.generate([prompt], seeded, use_tqdm=False)[0].outputs[0]
    outs = llm.generate(
        [prompt_of(long_ids, 30, 5), prompt, prompt_of(long_ids, 200, 9)], [other, seeded, other], use_tqdm=False
    )
    assert outs[1].outputs[0].token_ids == alone.token_ids and outs[1].outputs[0].text == alone.text
    different = llm.generate([prompt], SamplingParams(temperature=0.9, top_p=0.95, max_tokens=16, seed=99), use_tqdm=False)
    assert different[0].outputs[0].token_ids != alone.token_ids
    assert_pools_empty(llm)


def test_n_logprobs_and_stop_strings(llm):
    out = llm.generate(["The colour of the sky is"], SamplingParams(temperature=1.0, n=3, max_tokens=6, seed=7, logprobs=3),
                       use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1, "n samples of a seeded request differ"
    for c in out.outputs:
        assert len(c.logprobs) == len(c.token_ids)
        for tok, lp in zip(c.token_ids, c.logprobs):
            assert tok in lp and 3 <= len(lp) <= 4 and all(v <= 0 for v in lp.values())
    base = llm.generate(["1, 2, 3, 4,"], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].outputs[0]
    stop = base.text[3:5]
    assert stop.strip(), base.text
    cut = llm.generate(["1, 2, 3, 4,"], SamplingParams(temperature=0, max_tokens=12, stop=[stop]), use_tqdm=False)[0]
    assert cut.outputs[0].finish_reason == "stop"
    assert cut.outputs[0].text == base.text[: base.text.index(stop)]


@pytest.mark.parametrize(
    "kwargs, field",
    [({"temperature": -1.0}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"max_tokens": 0}, "max_tokens"),
     ({"top_k": 0}, "top_k"), ({"n": 0}, "n"), ({"min_p": 2.0}, "min_p")],
)
def test_bad_sampling_params_raise(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bad_requests_are_rejected_and_the_engine_keeps_serving(llm, long_ids):
    engine = llm.engine
    engine.add_request("ok", "Hello there", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    engine.step()
    ctx = engine.model_config.max_context
    with pytest.raises(ValueError, match="maximum context"):
        engine.add_request("too-long", [long_ids[0]] * (ctx + 1), GREEDY)
    with pytest.raises(ValueError, match="maximum context"):
        engine.add_request("too-many", "Hi", SamplingParams(max_tokens=ctx))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("empty", "", GREEDY)
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request("vocab", [1, 10**9], GREEDY)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("ok", "again", GREEDY)
    with pytest.raises(ValueError, match="no prompts"):
        llm.generate([], GREEDY)
    done = None
    while engine.has_unfinished():
        for o in engine.step():
            done = o
    assert done.request_id == "ok" and len(done.outputs[0].token_ids) == 20
    assert_pools_empty(llm)


def test_abort_frees_memory(llm, long_ids):
    engine = llm.engine
    engine.add_request("a", prompt_of(long_ids, 700), SamplingParams(max_tokens=50))
    engine.add_request("b", "Short one", SamplingParams(max_tokens=50))
    engine.step()
    engine.step()
    assert engine.memory_stats()["full_tokens_used"] > 0
    engine.abort("a")
    engine.abort("b")
    engine.abort("never-existed")
    assert not engine.has_unfinished()
    assert_pools_empty(llm)


def test_finished_only_steps_report_just_the_finished_requests(llm):
    """`step(finished_only=True)` (what LLM.generate uses) reports each request once, when it
    finishes, with the same final output as the step-by-step reporting gives."""
    engine = llm.engine
    prompts = ["One, two,", "The sky is", "Once upon a time"]

    def run(finished_only: bool) -> dict[str, tuple]:
        for i, p in enumerate(prompts):
            engine.add_request(f"fo{i}", p, SamplingParams(temperature=0, max_tokens=2 + 2 * i, ignore_eos=True))
        final: dict[str, tuple] = {}
        while engine.has_unfinished():
            for out in engine.step(finished_only=finished_only):
                assert out.finished or not finished_only, "a running request was reported"
                if out.finished:
                    assert out.request_id not in final, "reported twice"
                    c = out.outputs[0]
                    final[out.request_id] = (c.text, list(c.token_ids), c.finish_reason)
        return final

    streamed, finished = run(False), run(True)
    assert finished == streamed and len(finished) == len(prompts)
    assert_pools_empty(llm)
