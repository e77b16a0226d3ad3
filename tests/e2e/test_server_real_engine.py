"""A subset of the server tests on the real engine (embedded Gemma 3 270M, CPU, small max_tokens)."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from test_server_load import make_workload, run_load


def test_real_completion_stream_matches(real_server):
    c = real_server.client()
    kw = {"model": real_server.model, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    whole = c.completions.create(logprobs=2, **kw)
    assert whole.usage.completion_tokens == len(whole.choices[0].logprobs.tokens) <= 8
    assert whole.usage.prompt_tokens > 3 and whole.choices[0].text
    assert "".join(whole.choices[0].logprobs.tokens) == whole.choices[0].text
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(stream=True, **kw))
    assert streamed == whole.choices[0].text
    ids = c.completions.create(**{**kw, "prompt": [2, 818, 5279, 529, 7001, 563]})  # token-id prompt
    assert ids.usage.prompt_tokens == 6


def test_real_chat_on_base_model_is_a_400(real_server):
    """The embedded model is a base model without a chat template: chat is refused, not guessed."""
    body = {"model": real_server.model, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 6}
    r = httpx.post(real_server.base_url + "/chat/completions", json=body, timeout=30)
    err = r.json()["error"]
    assert r.status_code == 400 and "no chat template" in err["message"] and err["param"] == "messages"
    assert "--chat-template" in err["message"]


def test_real_bad_inputs(real_server):
    base = real_server.base_url
    r = httpx.post(base + "/completions", json={"prompt": "x " * 600, "max_tokens": 4})
    assert r.status_code == 400 and "maximum context length" in r.json()["error"]["message"]
    r = httpx.post(base + "/completions", json={"prompt": [1, 2, 10**9]})
    assert r.status_code == 400 and "token ids" in r.json()["error"]["message"]
    r = httpx.post(base + "/completions", json={"prompt": "x", "top_k": 0})
    assert r.status_code == 400 and "top_k" in r.json()["error"]["message"]


def test_real_stream_disconnect_frees_memory(real_server):
    body = {"prompt": "Once upon a time", "max_tokens": 200, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as http, http.stream("POST", real_server.base_url + "/completions", json=body) as r:
        lines = r.iter_lines()
        for _ in range(4):
            next(lines)
    t0 = time.monotonic()
    m = real_server.wait_idle(timeout=30)
    assert m['swaserve_kv_used_tokens{pool="full"}'] == 0 and m['swaserve_kv_used_tokens{pool="swa"}'] == 0
    assert time.monotonic() - t0 < 20


def test_real_nonstream_disconnect_frees_memory(real_server):
    body = {"prompt": "Once upon a time", "max_tokens": 300, "temperature": 0, "ignore_eos": True}
    aborted = real_server.metrics()["swaserve_requests_aborted_total"]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(real_server.base_url + "/completions", json=body, timeout=httpx.Timeout(60, read=1.0))
    m = real_server.wait_idle(timeout=30)
    assert m['swaserve_kv_used_tokens{pool="full"}'] == 0 and m['swaserve_kv_used_tokens{pool="swa"}'] == 0
    assert m["swaserve_requests_aborted_total"] == aborted + 1


def test_real_load_200_at_concurrency_128(real_server):
    run_load(real_server, make_workload(24, 6, seed=3, chat=False), 200, 128, timeout=240)


def test_real_prefix_cache_reports_cached_tokens(real_server):
    """A resent prompt prefills only its last token: usage.prompt_tokens_details.cached_tokens says so
    (streamed usage too), the text is unchanged, and /metrics counts the hits."""
    prompt = " ".join(f"item{i}" for i in range(120))  # ~300 tokens, unique to this test
    body = {"model": real_server.model, "prompt": prompt, "max_tokens": 6, "temperature": 0}
    hits0 = real_server.metrics()["swaserve_prefix_cache_hit_tokens_total"]
    first = httpx.post(real_server.base_url + "/completions", json=body, timeout=60).json()
    second = httpx.post(real_server.base_url + "/completions", json=body, timeout=60).json()
    n = first["usage"]["prompt_tokens"]
    first_cached = first["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert first_cached <= 1, "a new prompt shares at most the BOS token with earlier ones"
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == n - 1  # the last token is recomputed
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    stream = {**body, "prompt": prompt + " and more", "stream": True, "stream_options": {"include_usage": True}}
    with httpx.Client(timeout=60) as http, http.stream("POST", real_server.base_url + "/completions", json=stream) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    cached = events[-1]["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert n - 8 <= cached <= n, "the shared prefix (up to where the tokenizations diverge) is reused"
    m = real_server.wait_idle(timeout=30)
    assert m["swaserve_prefix_cache_hit_tokens_total"] - hits0 == first_cached + n - 1 + cached
    assert m['swaserve_kv_used_tokens{pool="full"}'] == 0 and m['swaserve_kv_cached_tokens{pool="full"}'] >= n


def test_real_seeded_request_reports_its_seed(real_server):
    body = {"model": real_server.model, "prompt": "Once upon a time", "max_tokens": 5, "temperature": 0.9, "seed": 7}
    choice = httpx.post(real_server.base_url + "/completions", json=body, timeout=60).json()["choices"][0]
    assert choice["seed"] == 7
    greedy = httpx.post(real_server.base_url + "/completions", json={**body, "temperature": 0, "seed": None},
                        timeout=60).json()["choices"][0]
    assert "seed" not in greedy, "greedy and unseeded outside deterministic mode: no seed to report"
