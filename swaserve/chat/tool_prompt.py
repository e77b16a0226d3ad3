"""Tools in a chat prompt: the request's functions and the conversation's tool calls and results, given to
a chat template that takes them (`tools=`, `tool_calls`, `tool` messages), or, for a template that knows no
tools (Gemma 3's), written into the messages: the functions and the `<tool_call>` JSON format in the system
message, earlier calls as tagged JSON, results as user turns in `<tool_response>` tags."""

from __future__ import annotations

import json
from typing import Any

FALLBACK_INSTRUCTIONS = (
    "You may call one or more functions to help with the user's request. The functions, as JSON schemas:\n"
    "<tools>\n{tools}\n</tools>\n"
    "To call a function, write one JSON object per call with its name and arguments inside tags:\n"
    '<tool_call>\n{{"name": "function name", "arguments": {{"argument": "value"}}}}\n</tool_call>'
)


def template_takes_tools(template: str | None) -> bool:
    """Whether a Jinja chat template renders tools (it reads a `tools` variable or tool messages)."""
    return bool(template) and ("tools" in template or "tool_calls" in template)  # type: ignore[operator]


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages for a template that takes tools: assistant tool calls with their arguments as objects
    (templates write them with `tojson`), as transformers' chat templates expect."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            m = {**m, "tool_calls": [{**c, "function": {**c["function"],
                                                         "arguments": _arguments(c["function"].get("arguments"))}}
                                     for c in calls]}
        out.append(m)
    return out


def fallback_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The conversation for a template without tools: the instructions in the (first) system message,
    assistant calls as `<tool_call>` JSON, tool results as user turns (consecutive ones merged, so user and
    assistant turns still alternate)."""
    out: list[dict[str, Any]] = []
    if tools:
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        text = FALLBACK_INSTRUCTIONS.format(tools=listing)
        if messages and messages[0]["role"] == "system":
            text = f"{messages[0]['content']}\n\n{text}"
            messages = messages[1:]
        out.append({"role": "system", "content": text})
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            calls = [json.dumps({"name": c["function"]["name"], "arguments": _arguments(c["function"].get("arguments"))},
                                ensure_ascii=False) for c in m["tool_calls"]]
            content = "\n".join([content, *(f"<tool_call>\n{c}\n</tool_call>" for c in calls)]).strip()
        elif role == "tool":
            role, content = "user", f"<tool_response>\n{content}\n</tool_response>"
        if out and role == "user" and out[-1]["role"] == "user" and m["role"] == "tool":
            out[-1] = {"role": "user", "content": f"{out[-1]['content']}\n{content}"}
            continue
        out.append({"role": role, "content": content})
    return out


def _arguments(raw: Any) -> Any:
    """A call's arguments as an object (OpenAI sends JSON text; a template wants the value)."""
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except ValueError:
            return raw
    return raw if raw is not None else {}
