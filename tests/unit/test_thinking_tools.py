"""Thinking blocks and tool calls in one reply (Gemma 4, MiMo-V2): the reasoning is split off first
(`ThinkingReplyParser`), then the calls are parsed from the content (`server.tools.ToolReply`); a request
with tools keeps the special tokens of the call format in the content (Gemma 4's `<|tool_call>` and `<|"|>`
are special tokens). The chat prompt takes `chat_template_kwargs` and `tools` together. Replies are written
in the formats the models' parsers document, over the byte-level test tokenizers of test_thinking_reply."""

from __future__ import annotations

import json

import pytest
from test_thinking_reply import _tokenizer

from swaserve.chat import ParsedReply, ThinkingChat, chat_for
from swaserve.server.tools import ToolReply, tool_plan
from swaserve.tokenizer import Tokenizer

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"},
                                                                         "days": {"type": "integer"}}}}}]
GEMMA4_REPLY = ('<|channel>thought\nThe user wants Paris.<channel|>Checking.'
                '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:2}<tool_call|>')
MIMO_REPLY = ("Paris, two days.</think>\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
              "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>")
MIMO_TEMPLATE = ("{% if tools %}tools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %} (<function=...>)\n"
                 "{% endif %}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}<|im_end|>{% endfor %}"
                 "assistant\n{% if enable_thinking %}<think>{% else %}<think></think>{% endif %}")


@pytest.fixture(scope="module")
def gemma4() -> Tokenizer:
    tok = _tokenizer(("<|channel>", "<channel|>", "<turn|>", "<|tool_call>", "<tool_call|>", '<|"|>'))
    return Tokenizer(tok.hf, "{% for m in messages %}{{ m['content'] }}{% endfor %}")


def _reply(chat: ThinkingChat, ids: list[int], prompt: list[int] | None, markers: bool) -> ToolReply:
    out = ToolReply(ParsedReply(chat.reply_parser(True, prompt, tool_markers=markers)),
                    tool_plan(TOOLS, "auto", None), chat.tool_family)
    for t in ids:  # token by token, as it streams
        out.step([t])
    out.flush()
    return out


def _calls(reply: ToolReply) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in reply.calls]


def test_gemma4_reasoning_then_a_call(gemma4) -> None:
    chat = chat_for(gemma4)
    assert isinstance(chat, ThinkingChat) and chat.tool_family == "gemma4"
    ids = gemma4.encode(GEMMA4_REPLY)
    out = _reply(chat, ids, None, markers=True)
    assert out.reasoning == "The user wants Paris." and out.text == "Checking."
    assert _calls(out) == [("get_weather", {"city": "Paris", "days": 2})]
    # Without the call format's special tokens in the content there is no call to find (what the flag is for).
    bare = _reply(chat, ids, None, markers=False)
    assert bare.reasoning == "The user wants Paris." and not bare.calls and "get_weather" in bare.text


def test_mimo_template_kwargs_and_tools_then_a_call() -> None:
    mimo = _tokenizer(("<think>", "</think>", "<|im_end|>"))
    tok = Tokenizer(mimo.hf, MIMO_TEMPLATE)
    chat = chat_for(tok)
    assert isinstance(chat, ThinkingChat) and chat.tool_family == "mimo"
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    prompt = chat.prompt_ids(msgs, template_kwargs={"enable_thinking": True},
                             tools=[{"type": "function", "function": TOOLS[0]["function"]}])
    text = tok.decode(prompt, skip_special_tokens=False)
    assert text.startswith("tools: get_weather") and prompt[-1] == chat.start_id  # both reached the template
    out = _reply(chat, tok.encode(MIMO_REPLY), prompt, markers=True)  # the prompt opened the block
    assert out.reasoning == "Paris, two days." and out.text.strip() == ""
    assert _calls(out) == [("get_weather", {"city": "Paris", "days": 2})]
    with pytest.raises(ValueError, match="tools"):  # tools come through `tools`, not the template kwargs
        chat.prompt_ids(msgs, template_kwargs={"tools": []})
