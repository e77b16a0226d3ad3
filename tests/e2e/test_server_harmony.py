"""GPT-OSS chat through the server: a tiny GPT-OSS directory (real o200k_harmony vocabulary) served over a
scripted engine whose reply has an analysis and a final channel. /v1/chat/completions puts them in
`reasoning_content` and `content`, streaming and not (official openai client and raw SSE); n > 1, stop
strings, the request override and the server flag that leave the reply in `content`; completions unchanged."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from harmony_model import gpt_oss_dir
from live_server import LiveServer, fake_spec, start_server

from swaserve.chat.harmony import HarmonyChat
from swaserve.chat.o200k import ENV
from swaserve.tokenizer import Tokenizer

ANALYSIS = "User says hello. Reply briefly, in French? No: English. 😀"
FINAL = "Hello! How can I help you today?"
REPLY = f"<|channel|>analysis<|message|>{ANALYSIS}<|end|><|start|>assistant<|channel|>final<|message|>{FINAL}"
MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Tokenizer, HarmonyChat]]:
    tok = Tokenizer.from_hf_dir(gpt_oss_dir())
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SWASERVE_CACHE", str(tmp_path_factory.mktemp("cache")))
        mp.delenv(ENV, raising=False)  # the server regenerates the vocabulary from the model's tokenizer.json
        yield tok, HarmonyChat(tok)


def _ids(chat: HarmonyChat, text: str) -> list[int]:
    return list(chat.encoding.encode(text, allowed_special="all"))


def _server(tok: Tokenizer, script: list[int], **cfg: object) -> LiveServer:
    # No EOS ids in the engine: a chat reply ends on the <|return|> the frontend adds as a stop id.
    spec = fake_spec("scripted_engine:ScriptedEngine", script=script, vocab_size=tok.vocab_size, name="gpt-oss-tiny")
    return start_server(spec, tok, **cfg)


@pytest.fixture(scope="module")
def server(setup: tuple[Tokenizer, HarmonyChat]) -> Iterator[LiveServer]:
    tok, chat = setup
    live = _server(tok, _ids(chat, REPLY + "<|return|>"))
    yield live
    live.stop()


def test_chat_splits_reasoning_and_content(server: LiveServer, setup: tuple[Tokenizer, HarmonyChat]) -> None:
    _, chat = setup
    r = server.client().chat.completions.create(model=server.model, messages=MSGS)
    msg, choice = r.choices[0].message, r.choices[0]
    assert (msg.reasoning_content, msg.content, choice.finish_reason) == (ANALYSIS, FINAL, "stop")
    assert r.usage.prompt_tokens == len(chat.prompt_ids(MSGS))  # rendered by harmony
    assert r.usage.completion_tokens == len(_ids(chat, REPLY)) + 1  # ... and <|return|>


def test_chat_streaming_deltas(server: LiveServer) -> None:
    stream = server.client().chat.completions.create(model=server.model, messages=MSGS, stream=True,
                                                     stream_options={"include_usage": True})
    kinds, reasoning, content, finish = [], "", "", None
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        r, c = getattr(delta, "reasoning_content", None), delta.content
        if r:
            kinds.append("r")
            reasoning += r
        if c:
            kinds.append("c")
            content += c
        finish = chunk.choices[0].finish_reason or finish
    assert (reasoning, content, finish) == (ANALYSIS, FINAL, "stop")
    assert kinds == sorted(kinds, reverse=True) and len(kinds) > 10  # token by token, reasoning first
    # The raw SSE: vLLM's / SGLang's field names, one kind per delta here.
    body = {"model": server.model, "messages": MSGS, "stream": True}
    with httpx.stream("POST", server.base_url + "/chat/completions", json=body, timeout=30) as resp:
        events = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    deltas = [e["choices"][0]["delta"] for e in events]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert "".join(d.get("reasoning_content", "") for d in deltas) == ANALYSIS
    assert "".join(d.get("content", "") for d in deltas) == FINAL


def test_n_and_stop_strings_apply_to_content(server: LiveServer) -> None:
    c = server.client()
    r = c.chat.completions.create(model=server.model, messages=MSGS, n=2, stop=["briefly", "help"])
    for choice in r.choices:  # a stop string in the reasoning does not end the reply
        assert choice.message.reasoning_content == ANALYSIS and choice.finish_reason == "stop"
        assert choice.message.content == FINAL[: FINAL.index("help")]
    streamed = ["", ""]
    for chunk in c.chat.completions.create(model=server.model, messages=MSGS, n=2, stop="help", stream=True):
        for ch in chunk.choices:
            streamed[ch.index] += ch.delta.content or ""
    assert streamed == [FINAL[: FINAL.index("help")]] * 2
    short = c.chat.completions.create(model=server.model, messages=MSGS, max_tokens=6)  # cut inside the analysis
    assert short.choices[0].finish_reason == "length" and short.choices[0].message.content == ""
    assert ANALYSIS.startswith(short.choices[0].message.reasoning_content) and short.usage.completion_tokens == 6


def test_request_keeps_reasoning_in_content(server: LiveServer) -> None:
    c = server.client()
    r = c.chat.completions.create(model=server.model, messages=MSGS, extra_body={"separate_reasoning": False})
    assert r.choices[0].message.content == REPLY and r.choices[0].finish_reason == "stop"
    assert "reasoning_content" not in r.choices[0].message.model_dump(exclude_none=False)
    chunks = c.chat.completions.create(model=server.model, messages=MSGS, stream=True,
                                       extra_body={"separate_reasoning": False})
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == REPLY


def test_constrained_reply_is_read_as_written(server: LiveServer) -> None:
    """A reply under response_format is content from its first token (the grammar leaves no room for
    channels): not split, `reasoning_content` null. (The scripted engine ignores the constraint, so its
    harmony reply comes back whole, as the parser read it.)"""
    r = server.client().chat.completions.create(model=server.model, messages=MSGS,
                                                response_format={"type": "json_object"})
    msg = r.choices[0].message
    assert (msg.content, msg.reasoning_content, r.choices[0].finish_reason) == (REPLY, None, "stop")


def test_completions_unchanged(server: LiveServer, setup: tuple[Tokenizer, HarmonyChat]) -> None:
    tok, chat = setup
    script = _ids(chat, REPLY)
    r = server.client().completions.create(model=server.model, prompt="hello", max_tokens=len(script))
    # No harmony parsing and no harmony stop ids: the engine's tokens as text, special tokens skipped.
    assert r.choices[0].text == tok.decode(script) and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(tok.encode("hello"))


def test_server_flag_and_reasoning_effort(setup: tuple[Tokenizer, HarmonyChat]) -> None:
    """--no-separate-reasoning: the reply as written, in content. This server's engine echoes the prompt
    first, so the content shows the rendered conversation: reasoning effort, today's date, instructions."""
    tok, chat = setup
    tail = "<|channel|>final<|message|>ok"
    live = _server(tok, [-1, *_ids(chat, tail + "<|return|>")], separate_reasoning=False)
    try:
        c = live.client()
        r = c.chat.completions.create(model=live.model, messages=MSGS, reasoning_effort="high")
        prompt = tok.decode(chat.prompt_ids(MSGS, reasoning_effort="high"), skip_special_tokens=False)
        assert r.choices[0].message.content == prompt + tail and "Reasoning: high" in prompt
        assert "# Instructions\n\nBe brief.<|end|>" in prompt and chat.today().isoformat() in prompt
        split = c.chat.completions.create(model=live.model, messages=MSGS, extra_body={"separate_reasoning": True})
        assert split.choices[0].message.model_extra is not None and "reasoning_content" in split.choices[0].message.model_extra
        bad = httpx.post(live.base_url + "/chat/completions", json={"messages": MSGS, "reasoning_effort": "max"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "reasoning_effort"
    finally:
        live.stop()


@pytest.mark.slow  # ~15 s on 2 CPU cores: the engine-core process loads torch, the 201k-token tokenizer, the model
def test_real_engine_on_random_weights(setup: tuple[Tokenizer, HarmonyChat]) -> None:
    """The real engine (random weights in the tiny GPT-OSS's shapes) behind the server: the harmony prompt
    fits its vocabulary, and whatever it writes comes back as a well-formed reply, streamed or not."""
    tok, chat = setup
    spec = fake_spec("swaserve.engine:Engine", model=str(gpt_oss_dir()), device="cpu", load_format="dummy",
                     max_context=512, max_running_requests=8, detokenize=False)
    live = start_server(spec, tok)
    try:
        c = live.client()
        r = c.chat.completions.create(model=live.model, messages=MSGS, max_tokens=12, temperature=0)
        msg = r.choices[0].message
        assert r.usage.prompt_tokens == len(chat.prompt_ids(MSGS)) and r.usage.completion_tokens <= 12
        assert r.choices[0].finish_reason in ("stop", "length") and (msg.content or msg.reasoning_content)
        reasoning, content = "", ""
        for chunk in c.chat.completions.create(model=live.model, messages=MSGS, max_tokens=12, temperature=0,
                                               stream=True):
            reasoning += getattr(chunk.choices[0].delta, "reasoning_content", None) or ""
            content += chunk.choices[0].delta.content or ""
        assert (reasoning or None, content) == (msg.reasoning_content, msg.content)
    finally:
        live.stop()


def test_reasoning_effort_needs_a_reasoning_format(fake_server: LiveServer) -> None:
    r = httpx.post(fake_server.base_url + "/chat/completions",
                   json={"messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "low"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort"
    plain = fake_server.client().chat.completions.create(model=fake_server.model, max_tokens=4,
                                                         messages=[{"role": "user", "content": "hi"}])
    assert "reasoning_content" not in (plain.choices[0].message.model_extra or {})


def test_missing_vocabulary_fails_at_start(setup: tuple[Tokenizer, HarmonyChat], tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    tok, _ = setup
    monkeypatch.setenv(ENV, str(tmp_path))
    with pytest.raises(ValueError, match=f"\\${ENV} is .* holds no o200k_base.tiktoken"):
        _server(tok, [1])
