"""Every endpoint and request field through the official OpenAI client (FakeEngine), streaming and not."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

GREEDY = {"temperature": 0.0}


def _complete(live, **kw):
    return live.client().completions.create(model=live.model, **kw)


def _chat(live, **kw):
    return live.client().chat.completions.create(model=live.model, **kw)


def test_models_and_health(fake_server):
    c = fake_server.client()
    models = c.models.list().data
    assert [m.id for m in models] == ["fake-model"]
    assert c.models.retrieve("fake-model").id == "fake-model"
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("other-model")
    r = httpx.get(fake_server.url + "/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}


def test_completion_basic_usage_and_default_max_tokens(fake_server):
    r = _complete(fake_server, prompt="Hello there", extra_body={"ignore_eos": True}, **GREEDY)
    choice = r.choices[0]
    assert r.object == "text_completion" and r.model == "fake-model"
    assert choice.finish_reason == "length" and choice.index == 0
    assert r.usage.prompt_tokens == len(b"Hello there")
    assert r.usage.completion_tokens == 16  # OpenAI's default max_tokens
    assert r.usage.total_tokens == r.usage.prompt_tokens + 16
    assert len(choice.text) == 16  # one byte token per character in the toy model


def test_prompt_forms_agree(fake_server):
    text = "The same prompt"
    ids = list(text.encode())
    kw = {"max_tokens": 12, **GREEDY}
    single = _complete(fake_server, prompt=text, **kw).choices[0].text
    assert _complete(fake_server, prompt=ids, **kw).choices[0].text == single
    many = _complete(fake_server, prompt=[text, "another one", text], **kw)
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert many.choices[0].text == single == many.choices[2].text
    assert many.choices[1].text == _complete(fake_server, prompt="another one", **kw).choices[0].text
    assert many.usage.prompt_tokens == 2 * len(text) + len("another one")
    id_lists = _complete(fake_server, prompt=[ids, list(b"another one")], **kw)
    assert [c.text for c in id_lists.choices] == [single, many.choices[1].text]


def test_n_and_seed(fake_server):
    kw = {"prompt": "sample me", "max_tokens": 10, "temperature": 1.0, "extra_body": {"ignore_eos": True}}
    a = _complete(fake_server, n=3, seed=7, **kw)
    b = _complete(fake_server, n=3, seed=7, **kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seeded: reproducible
    assert len({c.text for c in a.choices}) > 1  # the n choices are independent samples
    assert a.usage.prompt_tokens == len("sample me") and a.usage.completion_tokens == 30
    two = _complete(fake_server, n=2, **{**kw, "prompt": ["x", "y"]})
    assert [c.index for c in two.choices] == [0, 1, 2, 3]
    chat = _chat(fake_server, messages=[{"role": "user", "content": "hi"}], n=2, max_tokens=5)
    assert [c.index for c in chat.choices] == [0, 1]


def test_stop_strings(fake_server):
    kw = {"prompt": "stop test", "max_tokens": 40, "extra_body": {"ignore_eos": True}, **GREEDY}
    full = _complete(fake_server, **kw).choices[0].text
    stop = full[10:13]
    cut = full[: full.index(stop)]
    r = _complete(fake_server, stop=[stop, "never-there"], **kw)
    assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
    streamed = "".join(ch.choices[0].text for ch in _complete(fake_server, stop=stop, stream=True, **kw))
    assert streamed == cut
    chat_full = _chat(fake_server, messages=[{"role": "user", "content": "x"}], max_tokens=30, **GREEDY)
    text = chat_full.choices[0].message.content
    if len(text) > 8:
        r = _chat(fake_server, messages=[{"role": "user", "content": "x"}], max_tokens=30, stop=text[5:8], **GREEDY)
        assert r.choices[0].message.content == text[: text.index(text[5:8])]


def test_completion_streaming_matches_and_usage(fake_server):
    kw = {"prompt": ["stream a", "stream b"], "max_tokens": 20, **GREEDY}
    whole = _complete(fake_server, **kw)
    texts, finish, usage = ["", ""], [None, None], None
    chunks = list(_complete(fake_server, stream=True, stream_options={"include_usage": True}, **kw))
    for ch in chunks:
        if not ch.choices:
            usage = ch.usage
            continue
        c = ch.choices[0]
        texts[c.index] += c.text
        finish[c.index] = c.finish_reason or finish[c.index]
    assert texts == [c.text for c in whole.choices]
    assert finish == [c.finish_reason for c in whole.choices]
    assert usage is not None and usage.model_dump() == whole.usage.model_dump()
    assert chunks[-1].usage is not None and all(ch.usage is None for ch in chunks[:-1])


def test_chat_nonstream_and_stream(fake_server):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    r = _chat(fake_server, messages=msgs, max_completion_tokens=15, **GREEDY)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    prompt = "<system>be brief\n<user>hello\n<assistant>"
    assert r.usage.prompt_tokens == len(prompt)
    assert r.usage.completion_tokens <= 15
    chunks = list(_chat(fake_server, messages=msgs, max_tokens=15, stream=True,
                        stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(ch.object == "chat.completion.chunk" for ch in chunks)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == r.choices[0].message.content
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == r.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    parts = [{"type": "text", "text": "hel"}, {"type": "text", "text": "lo"}]
    r2 = _chat(fake_server, messages=[msgs[0], {"role": "user", "content": parts}], max_tokens=15, **GREEDY)
    assert r2.choices[0].message.content == r.choices[0].message.content


def test_chat_default_max_tokens_fills_context(fake_server):
    r = _chat(fake_server, messages=[{"role": "user", "content": "long"}], extra_body={"ignore_eos": True}, **GREEDY)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.total_tokens == 512  # the FakeEngine's context


def test_completion_logprobs(fake_server):
    kw = {"prompt": "logprobs", "max_tokens": 8, "logprobs": 3, "extra_body": {"ignore_eos": True}, **GREEDY}
    r = _complete(fake_server, **kw)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 8
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(8)]
    for tok, val, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert val <= 0 and 3 <= len(top) <= 4 and top[tok] == val  # greedy: the sampled token is the top one
        assert max(top.values()) == val
    chunks = list(_complete(fake_server, stream=True, **kw))
    streamed = [t for ch in chunks if ch.choices[0].logprobs for t in ch.choices[0].logprobs.tokens]
    offsets = [o for ch in chunks if ch.choices[0].logprobs for o in ch.choices[0].logprobs.text_offset]
    assert streamed == lp.tokens and offsets == lp.text_offset
    zero = _complete(fake_server, **{**kw, "logprobs": 0}).choices[0].logprobs
    assert all(len(t) == 1 for t in zero.top_logprobs)


def test_chat_logprobs(fake_server):
    kw = {"messages": [{"role": "user", "content": "lp"}], "max_tokens": 6, "logprobs": True, "top_logprobs": 2,
          "extra_body": {"ignore_eos": True}, **GREEDY}
    r = _chat(fake_server, **kw)
    content = r.choices[0].logprobs.content
    assert len(content) == 6 and "".join(c.token for c in content) == r.choices[0].message.content
    for c in content:
        assert len(c.top_logprobs) == 2 and c.bytes == list(c.token.encode())
        assert c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob
    chunks = list(_chat(fake_server, stream=True, **kw))
    streamed = [c.token for ch in chunks if ch.choices and ch.choices[0].logprobs for c in ch.choices[0].logprobs.content]
    assert streamed == [c.token for c in content]
    plain = _chat(fake_server, **{**kw, "logprobs": False, "top_logprobs": None})
    assert plain.choices[0].logprobs is None


def test_sampling_fields_accepted(fake_server):
    r = _complete(fake_server, prompt="fields", max_tokens=5, temperature=0.7, top_p=0.9, presence_penalty=0.5,
                  frequency_penalty=-0.5, seed=3, user="u1",
                  extra_body={"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.1, "ignore_eos": True,
                              "stop_token_ids": [1]})
    assert r.usage.completion_tokens == 5
    r = _chat(fake_server, messages=[{"role": "developer", "content": "d"}, {"role": "user", "content": "u"},
                                     {"role": "assistant", "content": None}, {"role": "user", "content": "u"}],
              max_tokens=3, top_p=0.5, presence_penalty=1.0, extra_body={"top_k": 2})
    assert r.choices[0].message.content is not None


def test_raw_sse_format(fake_server):
    body = {"model": "fake-model", "prompt": "sse", "max_tokens": 4, "stream": True, "temperature": 0}
    with httpx.stream("POST", fake_server.base_url + "/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    for e in events[:-2]:
        assert e.startswith("data: ")
        json.loads(e[len("data: "):])


def test_metrics_names(fake_server):
    before = fake_server.metrics()
    _complete(fake_server, prompt="metrics", max_tokens=5, extra_body={"ignore_eos": True})
    m = fake_server.wait_idle()
    for pool in ("full", "swa"):
        assert f'swaserve_kv_used_tokens{{pool="{pool}"}}' in m
        assert m[f'swaserve_kv_total_tokens{{pool="{pool}"}}'] > 0
    for name in ("swaserve_requests_running", "swaserve_requests_waiting", "swaserve_retractions_total"):
        assert name in m
    assert m["swaserve_prompt_tokens_total"] - before["swaserve_prompt_tokens_total"] == len("metrics")
    assert m["swaserve_generation_tokens_total"] - before["swaserve_generation_tokens_total"] == 5
    for hist in ("swaserve_time_to_first_token_seconds", "swaserve_inter_token_latency_seconds"):
        assert m[f'{hist}_bucket{{le="+Inf"}}'] == m[f"{hist}_count"] > 0
        assert m[f"{hist}_sum"] > 0
    assert m["swaserve_time_to_first_token_seconds_count"] - before["swaserve_time_to_first_token_seconds_count"] == 1
    assert m["swaserve_inter_token_latency_seconds_count"] - before["swaserve_inter_token_latency_seconds_count"] == 4
    text = httpx.get(fake_server.url + "/metrics").text
    assert "# TYPE swaserve_time_to_first_token_seconds histogram" in text


def test_chat_stream_n2(fake_server):
    kw = {"messages": [{"role": "user", "content": "two"}], "max_tokens": 12, "n": 2, "seed": 11, "temperature": 1.0,
          "extra_body": {"ignore_eos": True}}
    whole = _chat(fake_server, **kw)
    texts, roles, finish = ["", ""], set(), [None, None]
    for ch in _chat(fake_server, stream=True, **kw):
        c = ch.choices[0]
        if c.delta.role:
            roles.add(c.index)
        texts[c.index] += c.delta.content or ""
        finish[c.index] = c.finish_reason or finish[c.index]
    assert roles == {0, 1}
    assert texts == [c.message.content for c in whole.choices] and finish == ["length", "length"]


def test_stream_interval_batches_tokens():
    """--stream-interval 4: the first token at once, then chunks of 4 tokens, the end at once; the text,
    finish reason and usage are the same as one token per chunk."""
    from live_server import fake_spec, start_server

    live = start_server(fake_spec(), stream_interval=4)
    try:
        body = {"model": live.model, "prompt": "chunky", "max_tokens": 19, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}, "logprobs": 0}
        with httpx.Client(timeout=30) as http, http.stream("POST", live.base_url + "/completions", json=body) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        chunks = [e["choices"][0] for e in events if e["choices"]]
        counts = [len(c["logprobs"]["tokens"]) for c in chunks]
        assert counts == [1, 4, 4, 4, 4, 2], counts
        assert chunks[-1]["finish_reason"] == "length" and events[-1]["usage"]["completion_tokens"] == 19
        whole = live.client().completions.create(model=live.model, prompt="chunky", max_tokens=19, temperature=0,
                                                 extra_body={"ignore_eos": True})
        assert "".join(c["text"] for c in chunks) == whole.choices[0].text
    finally:
        live.stop()
