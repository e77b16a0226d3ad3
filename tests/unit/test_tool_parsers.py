"""Tool calls in each family's own format, parsed from recorded replies (whole and streamed in pieces of
every size): Hermes-style JSON in `<tool_call>` tags, Gemma 4's `<|tool_call>call:...` blocks, MiMo-V2's
`<function=..>` blocks, GPT-OSS harmony commentary messages; the forced-call scanner, the fallback tool
prompt for templates without tools, and the request checks (400s)."""

from __future__ import annotations

import json

import pytest

from swaserve.chat.tool_parsers import (
    Gemma4Format,
    HermesFormat,
    MimoFormat,
    TaggedToolCalls,
    ToolCall,
    block_format,
    tool_family,
)
from swaserve.chat.tool_prompt import fallback_messages, template_messages, template_takes_tools
from swaserve.server.api_errors import APIError
from swaserve.server.tools import ToolReply, _ArrayScanner, response_format_constraint, tool_plan

WEATHER = {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"}}}}
TOOLS = [{"type": "function", "function": WEATHER},
         {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {
             "a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}}}]

# Recorded replies in each family's format (model output as decoded with special tokens kept).
HERMES = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'
          '</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2.5}}\n</tool_call>')
GEMMA4 = ('<|tool_call>call:get_weather{city:<|"|>São Paulo, "BR"<|"|>,days:3,metric:true,'
          'opts:{units:[<|"|>c<|"|>,<|"|>mm<|"|>],level:null}}<tool_call|>')
MIMO = ("I will look it up.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n</function>\n</tool_call>")


def stream(fmt, text: str, piece: int) -> tuple[str, list[ToolCall]]:
    parser = TaggedToolCalls(fmt)
    content, calls = "", []
    for i in range(0, len(text), piece):
        c, k = parser.feed(text[i : i + piece])
        content, calls = content + c, calls + k
    c, k = parser.feed("", final=True)
    return content + c, calls + k


@pytest.mark.parametrize("piece", [1, 2, 3, 7, 10_000])
def test_hermes(piece: int) -> None:
    content, calls = stream(HermesFormat(), HERMES, piece)
    assert content == "Let me check.\n\n"
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "days": 3}), ("add", {"a": 1, "b": 2.5})]


@pytest.mark.parametrize("piece", [1, 4, 10_000])
def test_gemma4(piece: int) -> None:
    content, calls = stream(Gemma4Format(), "Sure. " + GEMMA4, piece)
    assert content == "Sure. "
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {
        "city": 'São Paulo, "BR"', "days": 3, "metric": True, "opts": {"units": ["c", "mm"], "level": None}})]


def test_gemma4_call_cut_by_a_stop_token_still_parses() -> None:
    # The model may end on its tool-response token (a stop id: not in the text) without the end tag.
    content, calls = stream(Gemma4Format(), "<|tool_call>call:add{a:1,b:2}", 5)
    assert content == "" and calls == [ToolCall("add", '{"a": 1, "b": 2}')]


@pytest.mark.parametrize("piece", [1, 5, 10_000])
def test_mimo(piece: int) -> None:
    content, calls = stream(MimoFormat([WEATHER]), MIMO, piece)
    assert content == "I will look it up.\n"
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "days": 3, "metric": True})]


def test_malformed_blocks_stay_content() -> None:
    text = "a <tool_call>{not json}</tool_call> b <tool_ca"
    content, calls = stream(HermesFormat(), text, 3)
    assert calls == [] and content == text
    assert Gemma4Format().parse("call:f{a:<|\"|>open") is None
    assert MimoFormat().parse("<function=f>no end") is None


def test_families() -> None:
    class Hf:
        unk_token_id = 3

        def __init__(self, vocab):
            self.vocab = vocab

        def convert_tokens_to_ids(self, t):
            return self.vocab.get(t, 3)

    class Tok:
        def __init__(self, vocab, template=""):
            self.hf, self.chat_template = Hf(vocab), template

    assert tool_family(Tok({"<|tool_call>": 48})) == "gemma4"
    assert tool_family(Tok({}, "...<function={{ name }}>...")) == "mimo"
    assert tool_family(Tok({})) == "hermes"
    assert isinstance(block_format("mimo"), MimoFormat) and isinstance(block_format("x"), HermesFormat)


def test_array_scanner_releases_each_call_when_it_closes() -> None:
    text = '[{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "get_weather", "arguments": {"city": "a\\"}]"}}]'
    scanner, calls = _ArrayScanner(), []
    for ch in text:
        calls += scanner.feed(ch)
    assert calls == [ToolCall("add", '{"a": 1, "b": 2}'), ToolCall("get_weather", '{"city": "a\\"}]"}')]


class _Text:
    """A detokenizer stand-in: each step appends the given text."""

    def __init__(self):
        self.text, self.stopped = "", False

    def step(self, piece):
        self.text += piece

    def flush(self):
        pass


def test_tool_reply_modes() -> None:
    named = ToolReply(_Text(), tool_plan(TOOLS, {"type": "function", "function": {"name": "add"}}, None), "hermes")
    for piece in ['{"a": ', "1, ", '"b": 2}']:
        named.step(piece)
    named.flush()
    assert named.text == "" and named.num_calls == 1 and named.calls[0]["function"] == {"name": "add", "arguments": ""}
    assert "".join(c["function"]["arguments"] for c in named.calls) == '{"a": 1, "b": 2}'
    auto = ToolReply(_Text(), tool_plan(TOOLS, "auto", None), "hermes")
    for i in range(0, len(HERMES), 4):
        auto.step(HERMES[i : i + 4])
    auto.flush()
    assert auto.text == "Let me check.\n\n" and [c["index"] for c in auto.calls] == [0, 1]
    assert all(c["id"].startswith("call_") for c in auto.calls)


def test_plans_and_constraints() -> None:
    plan = tool_plan(TOOLS, "required", False)
    schema = plan.constraint()["json"]
    assert schema["maxItems"] == 1 and len(schema["items"]["anyOf"]) == 2
    assert tool_plan(TOOLS, None, None).mode == "auto" and tool_plan(TOOLS, "auto", None).constraint() is None
    assert tool_plan(TOOLS, "none", None).prompt_tools is None
    assert tool_plan(None, None, None) is None
    assert response_format_constraint({"type": "json_object"}) == {"json_object": True}
    assert response_format_constraint({"type": "text"}) is None
    bad = [
        (lambda: tool_plan(TOOLS, {"type": "function", "function": {"name": "nope"}}, None), "names no function"),
        (lambda: tool_plan(TOOLS, "sometimes", None), "tool_choice must be one of"),
        (lambda: tool_plan([{"type": "function"}], None, None), r"tools\[0\] must be"),
        (lambda: tool_plan(TOOLS + TOOLS, None, None), "unique"),
        (lambda: tool_plan(None, "required", None), "needs tools"),
        (lambda: tool_plan([{"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}], None,
                           None), "invalid JSON schema"),
        (lambda: response_format_constraint({"type": "json_schema", "json_schema": {"name": "x"}}), "schema"),
        (lambda: response_format_constraint({"type": "xml"}), "response_format type"),
    ]
    for call, message in bad:
        with pytest.raises(APIError, match=message) as info:
            call()
        assert info.value.status == 400


def test_fallback_prompt_for_templates_without_tools() -> None:
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
                {"id": "c2", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 1}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "rain"}, {"role": "tool", "tool_call_id": "c2", "content": "2"}]
    out = fallback_messages(msgs, [t["function"] for t in TOOLS])
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("Be brief.\n\n") and '"name": "get_weather"' in out[0]["content"]
    assert out[2]["content"] == ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
                                 '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 1}}\n</tool_call>')
    assert out[3]["content"] == "<tool_response>\nrain\n</tool_response>\n<tool_response>\n2\n</tool_response>"
    assert template_messages(msgs)[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert template_takes_tools("{% if tools %}") and not template_takes_tools("{{ messages }}")
