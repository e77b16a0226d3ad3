"""Structured outputs and tool calls through the official `openai` client against a live server on the
embedded Gemma 3 270M (CPU; a base model, given a small Gemma-style chat template, so tools go through the
fallback tool prompt): `beta.chat.completions.parse` with a pydantic model (with logprobs and
prompt_logprobs beside the constraint), named and required tool calls whose arguments validate against
their schemas (whole and streamed as deltas), json_object, regex and choice on completions (echo with
logprobs, logit_bias inside the constraint), n > 1, tool turns in the conversation, and an invalid schema
answered 400 while another stream goes on; the vocabulary table built at start, before any constraint.
One server for the module; few, short requests."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator

import httpx
import openai
import pydantic
import pytest
from live_server import LiveServer, fake_spec, start_server

# System turns become user turns (Gemma 3 has no system role); no alternation check, unlike Gemma's own.
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else 'user' }}"
            "\n{{ m['content'] }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=10)
    age: int = pydantic.Field(ge=0, le=99)


class Weather(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    city: str = pydantic.Field(max_length=12)
    days: int = pydantic.Field(ge=1, le=7)


class Add(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    a: int = pydantic.Field(ge=0, le=9)
    b: int = pydantic.Field(ge=0, le=9)


ARGS = {"get_weather": Weather, "add": Add}
TOOLS = [{"type": "function", "function": {"name": name, "description": f"{name} tool",
                                           "parameters": model.model_json_schema()}} for name, model in ARGS.items()]


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    from swaserve.tokenizer import Tokenizer

    spec = fake_spec("swaserve.engine:Engine", model=None, device="cpu", max_context=1024, max_running_requests=16,
                     detokenize=False, chat_template=TEMPLATE)
    live = start_server(spec, Tokenizer.load(None).with_chat_template(TEMPLATE))
    yield live
    live.stop()


def chat(server: LiveServer, content: str, **kw):
    kw.setdefault("temperature", 0)
    return server.client(timeout=300).chat.completions.create(model=server.model, messages=[{"role": "user", "content": content}],
                                                   **kw)


def test_vocabulary_table_is_built_before_the_first_constraint(server: LiveServer) -> None:
    """The engine core builds xgrammar's vocabulary table before it reports ready, so the first constrained
    request does not hold every stream's steps for it (first in this file: nothing constrained has run
    yet). Counters reach /metrics with each step: a plain request drives one."""
    deadline, metrics = time.monotonic() + 120, {}
    while time.monotonic() < deadline:
        server.client(timeout=60).completions.create(model=server.model, prompt="Hi", max_tokens=1)
        metrics = server.metrics()
        if metrics.get("swaserve_grammar_vocab_build_ms", 0) > 0:
            break
        time.sleep(0.5)
    assert metrics.get("swaserve_grammar_vocab_build_ms", 0) > 0, "the table was not built at start"
    assert metrics["swaserve_grammar_cache_misses_total"] == 0  # no constraint compiled it


def test_parse_with_a_pydantic_model_and_prompt_logprobs(server: LiveServer) -> None:
    r = server.client(timeout=300).beta.chat.completions.parse(
        model=server.model, messages=[{"role": "user", "content": "A person, as JSON."}], response_format=Person,
        max_tokens=24, temperature=0, logprobs=True, extra_body={"prompt_logprobs": 1})
    choice = r.choices[0]
    assert isinstance(choice.message.parsed, Person) and choice.finish_reason == "stop"
    # The output's logprobs are those of the constrained tokens; the prompt's are scored as usual.
    assert "".join(t.token for t in choice.logprobs.content) == choice.message.content
    prompt_lps = r.model_extra["prompt_logprobs"]
    assert len(prompt_lps) == r.usage.prompt_tokens and prompt_lps[0] is None
    assert all(any(v["rank"] >= 1 and v["logprob"] <= 0 for v in p.values()) for p in prompt_lps[1:])


def test_required_tool_calls_n2(server: LiveServer) -> None:
    r = chat(server, "Add 2 and 3.", tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=24,
             n=2, temperature=0.8, seed=7)
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
        call = choice.message.tool_calls[0].function
        ARGS[call.name].model_validate_json(call.arguments)


def test_streamed_tool_call_deltas(server: LiveServer) -> None:
    stream = chat(server, "Weather in Rome for 2 days?", tools=TOOLS, max_tokens=24, stream=True,
                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    deltas, finish = [], None
    for chunk in stream:
        c = chunk.choices[0]
        deltas += c.delta.tool_calls or []
        finish = c.finish_reason or finish
    assert finish == "tool_calls" and deltas[0].id.startswith("call_") and deltas[0].function.name == "get_weather"
    assert len(deltas) > 2 and all(d.index == 0 and d.id is None for d in deltas[1:])  # arguments as they come
    Weather.model_validate_json("".join(d.function.arguments or "" for d in deltas))


def test_tool_turns_and_auto(server: LiveServer) -> None:
    messages = [{"role": "user", "content": "Add 2 and 3."},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "5"}]
    r = server.client(timeout=300).chat.completions.create(model=server.model, messages=messages, tools=TOOLS, max_tokens=6,
                                                temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls") and r.usage.prompt_tokens > 60


def test_json_object_and_completion_constraints(server: LiveServer) -> None:
    r = chat(server, "Reply with an empty JSON object.", response_format={"type": "json_object"}, max_tokens=10)
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # a base model may go on inside the object: what it wrote is still a JSON object's beginning
        assert r.choices[0].message.content.lstrip().startswith("{")
    c = server.client(timeout=300)
    prompt, choices = "Is the sky blue? Answer:", ["yes", "no"]
    r = c.completions.create(model=server.model, prompt=prompt, max_tokens=5, temperature=0, echo=True, logprobs=1,
                             extra_body={"structured_outputs": {"choice": choices}})
    text, lp = r.choices[0].text, r.choices[0].logprobs
    assert text.startswith(prompt) and text[len(prompt):] in choices and r.choices[0].finish_reason == "stop"
    # The echoed prompt's tokens (the first one's logprob null), then the answer's (the stop token last).
    n = r.usage.prompt_tokens
    assert len(lp.tokens) == n + r.usage.completion_tokens and lp.token_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:]) and "".join(lp.tokens[n:]).startswith(text[len(prompt):])
    # logit_bias acts inside the constraint: +100 on the other answer's first token picks it.
    other = "no" if text.endswith("yes") else "yes"
    first = server.client_state.tokenizer.encode(other, add_special_tokens=False)[0]
    r = c.completions.create(model=server.model, prompt=prompt, max_tokens=5, temperature=0,
                             logit_bias={str(first): 100},
                             extra_body={"structured_outputs": {"choice": choices}})
    assert r.choices[0].text == other and r.choices[0].finish_reason == "stop"
    r = c.completions.create(model=server.model, prompt="An email address:", max_tokens=16, temperature=0,
                             extra_body={"structured_outputs": {"regex": r"[a-z]{2,6}@[a-z]{2,6}\.com"}})
    assert re.fullmatch(r"[a-z]{2,6}@[a-z]{2,6}\.com", r.choices[0].text)


def test_invalid_schema_is_a_400_while_a_stream_goes_on(server: LiveServer) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=300) as http, http.stream("POST", server.base_url + "/completions", json=body) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        for bad, message in [({"structured_outputs": {"json": {"type": "objectx"}}}, "invalid JSON schema"),
                             ({"structured_outputs": {"regex": "(a"}}, "invalid regex"),
                             ({"guided_json": {"type": "object"}}, "structured_outputs"),
                             ({"structured_outputs": {"choice": ["a"], "regex": "a"}}, "exactly one")]:
            resp = http.post(server.base_url + "/completions", json={"prompt": "x", "max_tokens": 2, **bad})
            assert resp.status_code == 400 and message in resp.json()["error"]["message"], resp.text
        resp = http.post(server.base_url + "/chat/completions", json={
            "messages": [{"role": "user", "content": "x"}], "response_format": {
                "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "required": 3}}}})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "response_format.json_schema.schema"
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]" and json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "length"
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        chat(server, "x", tools=TOOLS, tool_choice={"type": "function", "function": {"name": "missing"}})
