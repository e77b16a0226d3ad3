"""Tool calls in a model's own output format, parsed from the reply's text as it streams: JSON in
`<tool_call>` tags (Hermes style: Qwen, Llama fine-tunes, and the fallback for templates without tools),
Gemma 4's `<|tool_call>call:name{...}<tool_call|>`, and MiMo-V2's `<function=..><parameter=..>` blocks.
(GPT-OSS calls tools in harmony's commentary channel: `swaserve.chat.harmony` keeps those messages.)"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One call: the function's name and its arguments as JSON text (an object)."""

    name: str
    arguments: str


class BlockFormat(Protocol):
    """A family's tool-call block: the tags around it and how its inside becomes a call."""

    start: str
    end: str

    def parse(self, block: str) -> ToolCall | None:
        """None when the block is not a well-formed call (its text then stays content)."""
        ...


class HermesFormat:
    """`<tool_call>{"name": "f", "arguments": {...}}</tool_call>` ("parameters" read too)."""

    start, end = "<tool_call>", "</tool_call>"

    def parse(self, block: str) -> ToolCall | None:
        try:
            obj = json.loads(block)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except ValueError:
                return None
        if not isinstance(args, dict):
            return None
        return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


_G4_QUOTE = '<|"|>'  # Gemma 4's string delimiter token


class Gemma4Format:
    """`<|tool_call>call:name{key:<|"|>text<|"|>,n:3,flag:true,obj:{k:[1,2]}}<tool_call|>`: bare keys,
    strings between `<|"|>` tokens, other values as in JSON."""

    start, end = "<|tool_call>", "<tool_call|>"
    _head = re.compile(r"\s*call:([\w.\-]+)\s*")

    def parse(self, block: str) -> ToolCall | None:
        m = self._head.match(block)
        if m is None:
            return None
        try:
            args, i = _g4_value(block, m.end())
        except (ValueError, IndexError):
            return None
        if not isinstance(args, dict) or block[i:].strip():
            return None
        return ToolCall(m.group(1), json.dumps(args, ensure_ascii=False))


def _g4_skip(s: str, i: int) -> int:
    while i < len(s) and s[i].isspace():
        i += 1
    return i


def _g4_value(s: str, i: int) -> tuple[Any, int]:
    """One Gemma 4 value starting at s[i] (after spaces) and the index after it; ValueError if malformed."""
    i = _g4_skip(s, i)
    if s.startswith(_G4_QUOTE, i):
        j = s.find(_G4_QUOTE, i + len(_G4_QUOTE))
        if j < 0:
            raise ValueError("unterminated string")
        return s[i + len(_G4_QUOTE) : j], j + len(_G4_QUOTE)
    if s[i] in "{[":
        close = "}" if s[i] == "{" else "]"
        obj: Any = {} if close == "}" else []
        i = _g4_skip(s, i + 1)
        while s[i] != close:
            if close == "}":
                colon = s.index(":", i)
                key = s[i:colon].strip().strip('"')
                if not key:
                    raise ValueError("empty key")
                obj[key], i = _g4_value(s, colon + 1)
            else:
                value, i = _g4_value(s, i)
                obj.append(value)
            i = _g4_skip(s, i)
            if s[i] == ",":
                i = _g4_skip(s, i + 1)
            elif s[i] != close:
                raise ValueError(f"expected ',' or {close!r}")
        return obj, i + 1
    m = re.compile(r"[^,}\]]+").match(s, i)
    if m is None:
        raise ValueError("missing value")
    raw = m.group(0).strip()
    try:
        return json.loads(raw), m.end()
    except ValueError:
        return raw, m.end()  # an unquoted word: its text


class MimoFormat:
    """`<tool_call>\\n<function=name>\\n<parameter=key>value</parameter>\\n</function>\\n</tool_call>`:
    values are text; a parameter whose schema type is not a string is read as JSON where it parses."""

    start, end = "<tool_call>", "</tool_call>"
    _function = re.compile(r"\s*<function=([^>\s]+)>(.*?)</function>\s*$", re.DOTALL)
    _param = re.compile(r"<parameter=([^>\s]+)>(.*?)</parameter>", re.DOTALL)

    def __init__(self, tools: list[dict[str, Any]] | None = None):
        self._types = {t["name"]: {k: (v or {}).get("type") for k, v in
                                   (t.get("parameters") or {}).get("properties", {}).items()}
                       for t in tools or []}

    def parse(self, block: str) -> ToolCall | None:
        m = self._function.match(block)
        if m is None:
            return None
        name, types = m.group(1), self._types.get(m.group(1), {})
        args: dict[str, Any] = {}
        for key, raw in self._param.findall(m.group(2)):
            value = raw.strip("\n")
            if types.get(key) not in (None, "string"):
                try:
                    value = json.loads(value)
                except ValueError:
                    pass
            args[key] = value
        return ToolCall(name, json.dumps(args, ensure_ascii=False))


class TaggedToolCalls:
    """One reply's text, fed as it streams, split into content and the tool calls in `fmt`'s blocks.
    Text that may begin a start tag is held back until it is clear; a block is parsed when its end tag
    arrives (or the reply ends: models may stop on a stop token instead of the end tag). A block that
    does not parse stays in the content as written. Invariant: content + blocks = the text fed."""

    def __init__(self, fmt: BlockFormat):
        self.fmt = fmt
        self._buf = ""
        self._in_call = False

    def feed(self, text: str, final: bool = False) -> tuple[str, list[ToolCall]]:
        """Content released and calls completed by `text`; `final`: the reply ended."""
        self._buf += text
        content: list[str] = []
        calls: list[ToolCall] = []
        start, end = self.fmt.start, self.fmt.end
        while True:
            if not self._in_call:
                pos = self._buf.find(start)
                if pos < 0:
                    keep = 0 if final else _partial_suffix(self._buf, start)
                    content.append(self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep :]
                    break
                content.append(self._buf[:pos])
                self._buf, self._in_call = self._buf[pos + len(start) :], True
            pos = self._buf.find(end)
            if pos < 0 and not final:
                break
            block = self._buf if pos < 0 else self._buf[:pos]
            call = self.fmt.parse(block)
            if call is not None:
                calls.append(call)
            else:
                content.append(start + block + ("" if pos < 0 else end))
            self._buf = "" if pos < 0 else self._buf[pos + len(end) :]
            self._in_call = False
            if pos < 0:
                break
        return "".join(content), calls


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def tool_family(tokenizer: Any) -> str:
    """The tool-call format of `tokenizer`'s model (look once: it reads the vocabulary): "gemma4" where the
    vocabulary has the `<|tool_call>` token, "mimo" where the chat template writes `<function=` blocks,
    else "hermes", JSON in `<tool_call>` tags (also what the fallback tool prompt asks for)."""
    hf = getattr(tokenizer, "hf", None)
    if hf is not None and hf.convert_tokens_to_ids(Gemma4Format.start) not in (None, hf.unk_token_id):
        return "gemma4"
    if "<function=" in (getattr(tokenizer, "chat_template", None) or ""):
        return "mimo"
    return "hermes"


def block_format(family: str, tools: list[dict[str, Any]] | None = None) -> BlockFormat:
    """The `BlockFormat` of a `tool_family` (`tools`: the request's functions, whose parameter types MiMo's
    text values are read by)."""
    if family == "gemma4":
        return Gemma4Format()
    if family == "mimo":
        return MimoFormat(tools)
    return HermesFormat()
