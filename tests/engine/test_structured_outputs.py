"""Structured outputs on the embedded Gemma 3 270M (CPU): every constraint kind holds on greedy, sampled
and n > 1 outputs, a grammar ends its sequence ("stop"), compiled grammars are cached (counters in
`LLM.stats()`), a bad constraint is a ValueError with nothing queued, and overlap scheduling (masks of
step N+1 computed after step N commits, its model already running) and deterministic mode give the same
tokens as the plain engine, with constrained and unconstrained rows in one batch."""

from __future__ import annotations

import json
import re
import threading

import pytest
from test_overlap import run_all, twin_engine

from swaserve import SamplingParams

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}


def constrained_workload() -> list[tuple[str, object, SamplingParams]]:
    return [
        ("json", "A person as JSON:", SamplingParams(temperature=0, max_tokens=24,
                                                     structured_outputs={"json": PERSON, "disable_any_whitespace": True})),
        ("choice-n", "Is water wet? Answer:", SamplingParams(temperature=1.0, seed=4, n=3, max_tokens=6,
                                                             structured_outputs={"choice": ["yes", "no", "maybe"]})),
        ("regex", "Email:", SamplingParams(temperature=0.8, seed=2, max_tokens=14,
                                           structured_outputs={"regex": r"[a-z]{1,6}@[a-z]{1,6}\.(com|org)"})),
        ("free", "Once upon a time", SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)),
        ("grammar", "Count:", SamplingParams(temperature=0, max_tokens=8,
                                             structured_outputs={"grammar": 'root ::= ("one" | "two") " " [0-9]'})),
    ]


def check_outputs(done: dict) -> None:
    person = json.loads(done["json"].outputs[0].text)
    assert set(person) == {"name", "age"} and 0 <= person["age"] <= 99 and len(person["name"]) <= 12
    assert [c.text in ("yes", "no", "maybe") for c in done["choice-n"].outputs] == [True] * 3
    assert re.fullmatch(r"[a-z]{1,6}@[a-z]{1,6}\.(com|org)", done["regex"].outputs[0].text)
    assert re.fullmatch(r"(one|two) [0-9]", done["grammar"].outputs[0].text)
    for rid in ("json", "choice-n", "regex", "grammar"):  # each grammar ran to its end
        assert {c.finish_reason for c in done[rid].outputs} == {"stop"}, rid
    assert done["free"].outputs[0].finish_reason == "length"


def test_constraints_hold_and_grammars_are_cached(llm):
    outs = llm.generate([p for _, p, _ in constrained_workload()], [sp for _, _, sp in constrained_workload()],
                        use_tqdm=False)
    check_outputs({rid: o for (rid, _, _), o in zip(constrained_workload(), outs)})
    before = llm.stats()
    llm.generate("Is fire hot? Answer:", SamplingParams(temperature=0, max_tokens=4,
                                                        structured_outputs={"choice": ["maybe", "no", "yes"]}),
                 use_tqdm=False)
    llm.generate("Is fire hot? Answer:", SamplingParams(temperature=0, max_tokens=4,
                                                        structured_outputs={"choice": ["maybe", "no", "yes"]}),
                 use_tqdm=False)
    after = llm.stats()
    assert after["grammar_cache_misses_total"] == before["grammar_cache_misses_total"] + 1  # a new choice list
    assert after["grammar_cache_hits_total"] == before["grammar_cache_hits_total"] + 1  # then cached
    assert after["grammar_cache_entries"] >= 5 and after["grammar_compile_ms_total"] > 0


def test_bad_constraints_are_value_errors(llm):
    e = llm.engine
    for so, message in [({"json": {"type": "objectx"}}, "invalid JSON schema"),
                        ({"regex": "[a-"}, "invalid regex"),
                        ({"grammar": "root ::= undefined_rule"}, "invalid grammar"),
                        ({"json": {"type": "object"}, "regex": "a"}, "exactly one"),
                        ({"choice": []}, "non-empty list"),
                        ({"jsonschema": {}}, "unknown field")]:
        with pytest.raises(ValueError, match=message):
            e.add_request("bad", "x", SamplingParams(structured_outputs=so))
        assert not e.has_unfinished() and "bad" not in e._groups


def test_grammar_end_finishes_even_with_ignore_eos(llm):
    out = llm.generate("Pick:", SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                                               structured_outputs={"choice": ["red", "blue"]}), use_tqdm=False)[0]
    assert out.outputs[0].text in ("red", "blue") and out.outputs[0].finish_reason == "stop"
    assert len(out.outputs[0].token_ids) < 10


def short_workload() -> list[tuple[str, object, SamplingParams]]:
    return [w for w in constrained_workload() if w[0] in ("choice-n", "grammar")] + [
        ("free", "Once upon a time", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)),
        ("json-short", "Data:", SamplingParams(temperature=0, max_tokens=12, structured_outputs={
            "json": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
            "disable_any_whitespace": True}))]


def test_same_tokens_with_overlap_and_in_deterministic_mode(llm):
    plain = run_all(twin_engine(llm, False), short_workload())
    assert json.loads(plain["json-short"].outputs[0].text) in ({"ok": True}, {"ok": False})
    for options in ({"overlap": True}, {"overlap": False, "enable_deterministic_inference": True}):
        other = run_all(twin_engine(llm, **options), short_workload())
        for rid, out in plain.items():
            assert [c.token_ids for c in other[rid].outputs] == [c.token_ids for c in out.outputs], (rid, options)


@pytest.mark.parametrize("on_worker", [True, False], ids=["accept_on_worker", "accept_in_loop"])
def test_overlap_fills_masks_on_the_worker_beside_the_commit(llm, monkeypatch, on_worker):
    """Overlap: a deferred step's masks start filling on the worker thread once the tokens of the step
    before it are accepted (by xgrammar on that worker, right before the fill, by default; or in the step
    loop), while that step commits (its sampling inputs taken after it); the step then samples once the next
    batch is scheduled (accept in the loop: before, so the device samples while the host schedules), before
    that batch launches. Greedy, seeded and penalised constrained rows beside a free one still get the plain
    engine's tokens, and no token is refused."""
    from swaserve.grammar.masks import MaskJob

    work = short_workload() + [("regex-pen", "Email:", SamplingParams(
        temperature=0.8, seed=2, max_tokens=14, frequency_penalty=0.5, presence_penalty=0.3,
        structured_outputs={"regex": r"[a-z]{1,6}@[a-z]{1,6}\.(com|org)"}))]
    plain = run_all(twin_engine(llm, False), work)
    e = twin_engine(llm, True)
    e.accept_on_worker = on_worker
    events: list[str] = []
    threads: set[str] = set()
    accepts: list[bool] = []

    def spy(name, real):
        return lambda *a, **k: events.append(name) or real(*a, **k)

    monkeypatch.setattr(e.scheduler, "schedule", spy("schedule", e.scheduler.schedule))
    monkeypatch.setattr(e.launcher, "start_masks", spy("masks", e.launcher.start_masks))
    monkeypatch.setattr(e.scheduler, "process_output", spy("commit", e.scheduler.process_output))
    monkeypatch.setattr(e.launcher, "prepare_deferred", spy("prepare", e.launcher.prepare_deferred))
    sample = e.launcher.sample_deferred  # (launch samples a step that need not wait through it too)
    monkeypatch.setattr(e.launcher, "sample_deferred",
                        lambda step: events.append("sample" if step.plan is not None else "now") or sample(step))
    run = MaskJob.run
    monkeypatch.setattr(MaskJob, "run", lambda job: threads.add(threading.current_thread().name)
                        or accepts.append(job.accept is not None) or run(job))
    got = run_all(e, work)
    for rid, out in plain.items():
        assert [c.token_ids for c in got[rid].outputs] == [c.token_ids for c in out.outputs], rid
    assert "swaserve-grammar-masks" in threads
    deferred = [i for i, ev in enumerate(events) if ev == "masks"]
    assert len(deferred) > 3 and events.count("sample") == events.count("prepare") == len(deferred)
    order = ["schedule", "sample"] if on_worker else ["sample", "schedule"]
    assert all(events[i : i + 5] == ["masks", "commit", "prepare", *order] for i in deferred), events
    assert any(accepts) == on_worker  # (the first steps' masks fill inline, with no accept before them)
    counters = e.counters()
    assert counters["grammar_masked_rows_total"] > 0 and counters["grammar_mask_wait_ms_total"] >= 0
    assert counters["grammar_rejected_tokens_total"] == 0


# -- with the other request options (logit_bias, prompt logprobs, speculative decoding) ------------------


def _first_token(llm, text: str) -> int:
    return llm.tokenizer.encode(text, add_special_tokens=False)[0]


def test_logit_bias_cannot_revive_a_masked_token(llm):
    """The mask comes first (-inf), the bias is added after: +100 on a token the grammar forbids changes
    nothing, +100 on an allowed one picks it."""
    def pick(bias: dict[int, float] | None) -> str:
        params = SamplingParams(temperature=0, max_tokens=4, logit_bias=bias,
                                structured_outputs={"choice": ["red", "blue"]})
        out = llm.generate("The sky is", params, use_tqdm=False)[0].outputs[0]
        assert out.finish_reason == "stop"
        return out.text

    plain = pick(None)
    other = "blue" if plain == "red" else "red"
    assert pick({_first_token(llm, "green"): 100.0, _first_token(llm, " The"): 100.0}) == plain
    assert pick({_first_token(llm, other): 100.0}) == other


def test_prompt_logprobs_beside_a_deferred_constrained_step(llm):
    """Overlap: a prefill that scores prompt logprobs shares a step with a constrained row whose sampling
    waits for the previous step's commit; the scores are the model's own (no mask on the prompt), equal to
    the session engine's (no overlap), and so are the constrained tokens."""
    schema = {"json": {"type": "object", "properties": {"word": {"type": "string", "maxLength": 30}},
                       "required": ["word"]}, "disable_any_whitespace": True}
    scored = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=1,
                            structured_outputs={"choice": ["yes", "no"]})
    prompt = "Is the river town old? Answer:"
    e = twin_engine(llm, True)
    deferred_with_scores: list[bool] = []
    launch = e.launcher.launch

    def spy(batch):
        step = launch(batch)
        deferred_with_scores.append(step.deferred is not None and step.prompt is not None)
        return step

    e.launcher.launch = spy
    e.add_request("json", "A word as JSON:", SamplingParams(temperature=0, max_tokens=16, structured_outputs=schema))
    for _ in range(3):  # the constrained request decodes before the scored one arrives
        e.step()
    got = run_all(e, [("scored", prompt, scored)])["scored"]
    assert any(deferred_with_scores), "no deferred step carried prompt scores"
    ref = llm.generate(prompt, scored, use_tqdm=False)[0]
    ids = ref.prompt_token_ids
    assert got.outputs[0].text in ("yes", "no") and got.prompt_logprobs[0] is None
    assert max(abs(got.prompt_logprobs[j][ids[j]] - ref.prompt_logprobs[j][ids[j]]) for j in range(1, len(ids))) < 1e-4
    assert got.outputs[0].token_ids == ref.outputs[0].token_ids


def test_constrained_rows_do_not_speculate(llm):
    """n-gram speculation: an unconstrained repeating request drafts; a constrained one beside it gets no
    drafts (one token a step, sampled under its mask) and the plain engine's tokens."""
    e = twin_engine(llm, False, speculative_method="ngram")
    rep = "a b c a b c a b c a b c a b c a b c"
    work = [("rep", rep, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)),
            ("grammar", "Count:", SamplingParams(temperature=0, max_tokens=8,
                                                 structured_outputs={"grammar": 'root ::= ("one" | "two") " " [0-9]'}))]
    done = run_all(e, work)
    plain = run_all(twin_engine(llm, False), work[1:])
    assert done["rep"].spec_draft_tokens > 0 and done["grammar"].spec_draft_tokens == 0
    assert re.fullmatch(r"(one|two) [0-9]", done["grammar"].outputs[0].text)
    assert done["grammar"].outputs[0].token_ids == plain["grammar"].outputs[0].token_ids
