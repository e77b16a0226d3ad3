"""Bad input is a 4xx with an OpenAI error body naming the problem, and never disturbs other requests."""

from __future__ import annotations

import threading
import time

import httpx

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]


def _c(**kw):
    return {"model": "fake-model", "prompt": "hello", **kw}


def _m(**kw):
    return {"model": "fake-model", "messages": USER, **kw}


# (name, method, path, body: dict | bytes | None, expected status, substring of the message)
CASES = [
    ("malformed json", "POST", CMPL, b'{"prompt": "x",', 400, "malformed json"),
    ("not an object", "POST", CMPL, b"[1, 2, 3]", 400, "json object"),
    ("invalid utf-8", "POST", CMPL, b'{"prompt": "\xff\xfe"}', 400, "utf-8"),
    ("empty body", "POST", CMPL, b"", 400, "malformed json"),
    ("temperature negative", "POST", CMPL, _c(temperature=-0.5), 400, "temperature"),
    ("temperature NaN", "POST", CMPL, b'{"prompt": "x", "temperature": NaN}', 400, "temperature"),
    ("temperature string", "POST", CMPL, _c(temperature="hot"), 400, "temperature"),
    ("top_p zero", "POST", CMPL, _c(top_p=0), 400, "top_p"),
    ("top_p above one", "POST", CMPL, _c(top_p=1.5), 400, "top_p"),
    ("max_tokens zero", "POST", CMPL, _c(max_tokens=0), 400, "max_tokens"),
    ("max_tokens negative", "POST", CHAT, _m(max_tokens=-3), 400, "max_tokens"),
    ("max_tokens fractional", "POST", CMPL, _c(max_tokens=1.5), 400, "max_tokens"),
    ("max_tokens beyond context", "POST", CMPL, _c(max_tokens=100000), 400, "maximum context length"),
    ("prompt beyond context", "POST", CMPL, _c(prompt="y" * 600), 400, "maximum context length"),
    ("chat beyond context", "POST", CHAT, _m(messages=[{"role": "user", "content": "z" * 600}]), 400,
     "maximum context length"),
    ("empty prompt", "POST", CMPL, _c(prompt=""), 400, "prompt must not be empty"),
    ("empty prompt list", "POST", CMPL, _c(prompt=[]), 400, "prompt must not be empty"),
    ("empty prompt in batch", "POST", CMPL, _c(prompt=["ok", ""]), 400, "prompt 1 is empty"),
    ("missing prompt", "POST", CMPL, {"model": "fake-model"}, 400, "prompt"),
    ("prompt wrong type", "POST", CMPL, _c(prompt={"text": "x"}), 400, "prompt must be a string"),
    ("token id out of vocab", "POST", CMPL, _c(prompt=[1, 2, 99999]), 400, "token ids"),
    ("negative token id", "POST", CMPL, _c(prompt=[5, -1]), 400, "non-negative"),
    ("empty messages", "POST", CHAT, _m(messages=[]), 400, "messages"),
    ("messages not a list", "POST", CHAT, _m(messages="hi"), 400, "messages"),
    ("unknown role", "POST", CHAT, _m(messages=[{"role": "wizard", "content": "x"}]), 400, "unknown role"),
    ("missing content", "POST", CHAT, _m(messages=[{"role": "user"}]), 400, "content is required"),
    ("image content", "POST", CHAT,
     _m(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]), 400,
     "only text content"),
    ("template rejects", "POST", CHAT, _m(messages=[*USER, {"role": "system", "content": "late"}]), 400,
     "chat template"),
    ("unknown model", "POST", CMPL, _c(model="gpt-9"), 404, "does not exist"),
    ("unknown model chat", "POST", CHAT, _m(model="gpt-9"), 404, "does not exist"),
    ("n zero", "POST", CMPL, _c(n=0), 400, "n:"),
    ("n too large", "POST", CHAT, _m(n=1000), 400, "n:"),
    ("logprobs too large", "POST", CMPL, _c(logprobs=50), 400, "logprobs"),
    ("top_logprobs without logprobs", "POST", CHAT, _m(top_logprobs=3), 400, "top_logprobs"),
    ("empty stop string", "POST", CMPL, _c(stop=["ok", ""]), 400, "stop"),
    ("stream not a bool", "POST", CMPL, _c(stream="yes"), 400, "stream"),
    ("presence_penalty out of range", "POST", CMPL, _c(presence_penalty=5), 400, "presence_penalty"),
    ("seed string", "POST", CMPL, _c(seed="abc"), 400, "seed"),
    ("top_k zero (engine check)", "POST", CMPL, _c(top_k=0), 400, "top_k"),
    ("repetition_penalty zero", "POST", CMPL, _c(repetition_penalty=0), 400, "repetition_penalty"),
    ("max_tokens 0 without echo", "POST", CMPL, _c(max_tokens=0), 400, "only with echo"),
    ("logit_bias out of range", "POST", CMPL, _c(logit_bias={"5": 100.5}), 400, "logit_bias[5]"),
    ("logit_bias key not a token id", "POST", CHAT, _m(logit_bias={"-3": 1}), 400, "token ids"),
    ("prompt_logprobs streaming", "POST", CMPL, _c(prompt_logprobs=1, stream=True), 400, "streaming"),
    ("chat_template_kwargs not a dict", "POST", CHAT, _m(chat_template_kwargs=[1]), 400, "chat_template_kwargs"),
    ("tool without a function", "POST", CHAT, _m(tools=[{"type": "function"}]), 400, "tools[0] must be"),
    ("bad regex", "POST", CMPL, _c(structured_outputs={"regex": "[a-"}), 400, "invalid regex"),
    ("vLLM's removed guided_json", "POST", CMPL, _c(guided_json={"type": "object"}), 400, "structured_outputs"),
    ("unknown response_format", "POST", CHAT, _m(response_format={"type": "xml"}), 400, "response_format"),
    ("oversized body", "POST", CMPL, _c(prompt="a" * (2 << 20)), 413, "limit"),
    ("wrong method", "GET", CMPL, None, 405, "not allowed"),
    ("unknown route", "POST", "/v1/embeddings", _c(), 404, "no route"),
]


def _send(client: httpx.Client, method: str, path: str, body: dict | bytes | None) -> httpx.Response:
    if isinstance(body, bytes):
        return client.request(method, path, content=body, headers={"content-type": "application/json"})
    return client.request(method, path, json=body)


def test_bad_inputs_while_a_stream_runs(fake_server, slow_server):
    assert len(CASES) >= 25
    kw = {"model": fake_server.model, "prompt": "a long one", "max_tokens": 480, "temperature": 0.0,
          "extra_body": {"ignore_eos": True}}
    expected = fake_server.client().completions.create(**kw).choices[0].text  # the toy model is deterministic
    # The slow engine (20 ms a step) keeps the stream running while every bad request is answered.
    client = slow_server.client()
    result: dict[str, object] = {}

    def long_stream() -> None:
        parts = []
        for i, ch in enumerate(client.completions.create(stream=True, **kw)):
            if i == 0:
                result["started"] = time.monotonic()
            parts.append(ch.choices[0].text)
            result["finish"] = ch.choices[0].finish_reason
        result["text"] = "".join(parts)
        result["done"] = time.monotonic()

    runner = threading.Thread(target=long_stream)
    runner.start()
    while "started" not in result and runner.is_alive():
        time.sleep(0.005)
    failures = []
    with httpx.Client(base_url=slow_server.url, timeout=30) as http:
        for name, method, path, body, status, needle in CASES:
            r = _send(http, method, path, body)
            try:
                err = r.json()["error"]
                ok = (r.status_code == status and set(err) == {"message", "type", "param", "code"}
                      and needle.lower() in err["message"].lower())
            except Exception:  # noqa: BLE001
                ok, err = False, r.text
            if not ok:
                failures.append(f"{name}: {r.status_code} {err}")
    bad_done = time.monotonic()
    runner.join(60)
    assert not failures, "\n".join(failures)
    assert result.get("text") == expected and result.get("finish") == "length"
    assert result["done"] > bad_done, "the long stream should still have been running"
    m = slow_server.wait_idle()
    assert m['swaserve_kv_used_tokens{pool="full"}'] == 0
    assert httpx.get(slow_server.url + "/health").status_code == 200


def test_error_bodies_name_the_parameter(fake_server):
    r = httpx.post(fake_server.base_url + "/completions", json=_c(temperature=-1))
    assert r.json()["error"]["param"] == "temperature" and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(fake_server.base_url + "/completions", json=_c(max_tokens=100000))
    assert r.json()["error"]["param"] == "max_tokens"
    assert r.json()["error"]["code"] == "context_length_exceeded"
