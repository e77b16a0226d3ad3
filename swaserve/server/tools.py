"""Chat tools and structured outputs on the wire: `tools` / `tool_choice` / `parallel_tool_calls` and
`response_format` checked (400 on bad input) and turned into what the engine enforces (a
`structured_outputs` constraint: the JSON schema of the forced calls, or of the response), and
`ToolReply`, a sequence's reply split into content and OpenAI `tool_calls` deltas as it streams."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from swaserve.chat.tool_parsers import TaggedToolCalls, ToolCall, block_format
from swaserve.grammar import check_constraint
from swaserve.server.api_errors import APIError

TOOL_CHOICES = ("none", "auto", "required")


@dataclass(frozen=True)
class ToolPlan:
    """A chat request's tools: `functions` (OpenAI `function` objects), `mode` ("none", "auto",
    "required" or "named": one function, `name`), whether several calls may come in one reply."""

    functions: list[dict[str, Any]]
    mode: str
    name: str | None = None
    parallel: bool = True

    @property
    def prompt_tools(self) -> list[dict[str, Any]] | None:
        """What the chat template is given: the functions, unless tool_choice is "none"."""
        return [{"type": "function", "function": f} for f in self.functions] if self.mode != "none" else None

    def constraint(self) -> dict[str, Any] | None:
        """The `structured_outputs` that forces the reply to be the calls ("required", "named"): for a
        named function its arguments object; for "required" a JSON array of {name, arguments} objects
        (one of the functions each; exactly one without parallel calls)."""
        # Compact JSON (no free whitespace): arguments are read by programs, and a small model given
        # free whitespace may write nothing else.
        if self.mode == "named":
            fn = next(f for f in self.functions if f["name"] == self.name)
            return {"json": fn.get("parameters") or {"type": "object"}, "disable_any_whitespace": True}
        if self.mode != "required":
            return None
        calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [f["name"]]},
                                                   "arguments": f.get("parameters") or {"type": "object"}},
                  "required": ["name", "arguments"], "additionalProperties": False} for f in self.functions]
        schema: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
        if not self.parallel:
            schema["maxItems"] = 1
        return {"json": schema, "disable_any_whitespace": True}


def tool_plan(tools: list[Any] | None, tool_choice: Any, parallel: bool | None) -> ToolPlan | None:
    """The request's tools checked (400 naming the field); None without tools."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        return None
    functions = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise APIError(400, f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}",
                           param=f"tools[{i}]")
        params = fn.get("parameters")
        if params is not None:
            if not isinstance(params, dict):
                raise APIError(400, f"tools[{i}].function.parameters must be a JSON schema object",
                               param=f"tools[{i}].function.parameters")
            _check_schema(params, f"tools[{i}].function.parameters")
        functions.append({k: fn[k] for k in ("name", "description", "parameters") if fn.get(k) is not None})
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise APIError(400, "tools: function names must be unique", param="tools")
    mode, name = tool_choice or "auto", None
    if isinstance(mode, dict):
        name = (mode.get("function") or {}).get("name") if mode.get("type") == "function" else None
        if name not in names:
            raise APIError(400, f"tool_choice names no function among the tools (got {name!r})", param="tool_choice")
        mode = "named"
    elif mode not in TOOL_CHOICES:
        raise APIError(400, f"tool_choice must be one of {', '.join(TOOL_CHOICES)} or a named function",
                       param="tool_choice")
    return ToolPlan(functions, mode, name, parallel is not False)


def response_format_constraint(fmt: dict[str, Any] | None) -> dict[str, Any] | None:
    """`response_format` as a `structured_outputs` dict: json_schema (its `schema`, strict or not: both
    are enforced), json_object, or text (None)."""
    if not fmt or fmt.get("type") in (None, "text"):
        return None
    kind = fmt.get("type")
    if kind == "json_object":
        return {"json_object": True}
    if kind != "json_schema":
        raise APIError(400, f"response_format type must be text, json_object or json_schema, got {kind!r}",
                       param="response_format")
    spec = fmt.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(schema, dict):
        raise APIError(400, "response_format.json_schema.schema must be a JSON schema object",
                       param="response_format.json_schema")
    constraint = {"json": schema}
    _check_schema(schema, "response_format.json_schema.schema", constraint)
    return constraint


def chat_constraints(req: Any) -> tuple[ToolPlan | None, dict[str, Any] | None]:
    """A chat request's tool plan and the one constraint on its reply (response_format, structured_outputs
    or forced tool calls; the protocol refuses more than one); 400 on bad input."""
    plan = tool_plan(req.tools, req.tool_choice, req.parallel_tool_calls)
    if req.structured_outputs is not None:
        return plan, check_structured(req.structured_outputs, "structured_outputs")
    constraint = response_format_constraint(req.response_format)
    if constraint is None and plan is not None:
        constraint = plan.constraint()  # the functions' schemas were checked by tool_plan
    return plan, constraint


def check_structured(value: dict[str, Any], param: str) -> dict[str, Any]:
    """A `structured_outputs` dict that compiles, as its canonical dict; 400 naming `param` otherwise."""
    try:
        return check_constraint(value).to_dict()
    except ValueError as e:
        raise APIError(400, f"{param}: {e}", param=param) from None


def _check_schema(schema: dict[str, Any], param: str, constraint: dict[str, Any] | None = None) -> None:
    check_structured(constraint or {"json": schema}, param)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def call_delta(index: int, call: ToolCall) -> dict[str, Any]:
    """A whole call as one streaming `tool_calls` entry (id, name and all its arguments)."""
    return {"index": index, "id": new_call_id(), "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


class ToolReply:
    """One sequence's chat reply with tools, with the surface of the frontend's detokenizers (`step`,
    `flush`, `text`, `stopped`, `reasoning`) plus `calls`: OpenAI streaming `tool_calls` entries, in order.

    "auto": calls are parsed from the model's own format (`inner` decodes with special tokens kept, so
    the markers survive); "named": the whole reply is the arguments (streamed as they come); "required":
    a JSON array of {name, arguments}, each call released when its object closes."""

    def __init__(self, inner: Any, plan: ToolPlan, family: str):
        self.inner, self.plan = inner, plan
        self.text = ""
        self.calls: list[dict[str, Any]] = []
        self._seen = 0
        self._tagged = TaggedToolCalls(block_format(family, plan.functions)) if plan.mode == "auto" else None
        self._array = _ArrayScanner() if plan.mode == "required" else None
        self._harmony_seen = 0

    @property
    def stopped(self) -> bool:
        return bool(self.inner.stopped)

    @property
    def reasoning(self) -> str:
        return getattr(self.inner, "reasoning", "")

    def step(self, token_ids: list[int] | int) -> str:
        self.inner.step(token_ids)
        return self._take(final=False)

    def flush(self) -> str:
        self.inner.flush()
        return self._take(final=True)

    def _take(self, final: bool) -> str:
        new = self.inner.text[self._seen :]
        self._seen = len(self.inner.text)
        before = len(self.text)
        if self.plan.mode == "named":
            if not self.calls:
                self.calls.append({"index": 0, "id": new_call_id(), "type": "function",
                                   "function": {"name": self.plan.name, "arguments": ""}})
            if new:
                self.calls.append({"index": 0, "function": {"arguments": new}})
        elif self._array is not None:
            for call in self._array.feed(new):
                self.calls.append(call_delta(self.num_calls, call))
        elif self._tagged is not None:
            content, calls = self._tagged.feed(new, final)
            self.text += content
            for call in [*calls, *self._harmony_calls()]:
                self.calls.append(call_delta(self.num_calls, call))
        else:
            self.text += new
        return self.text[before:]

    @property
    def num_calls(self) -> int:
        return sum(1 for c in self.calls if "id" in c)

    def _harmony_calls(self) -> list[ToolCall]:
        """GPT-OSS: commentary messages addressed to `functions.<name>` (harmony's parser keeps them)."""
        messages = getattr(getattr(self.inner, "parser", None), "messages", None)
        if not messages:
            return []
        new, self._harmony_seen = messages[self._harmony_seen :], len(messages)
        calls = []
        for m in new:
            recipient = getattr(m, "recipient", None) or ""
            if recipient.startswith("functions."):
                text = "".join(getattr(c, "text", "") for c in m.content)
                calls.append(ToolCall(recipient.removeprefix("functions."), text.strip() or "{}"))
        return calls


class _ArrayScanner:
    """The text of a JSON array of objects, fed in pieces: each element's call once its object closes
    (the grammar guarantees well-formed JSON, so only strings and nesting need tracking)."""

    def __init__(self) -> None:
        self._depth = 0
        self._in_string = self._escape = False
        self._element: list[str] = []

    def feed(self, text: str) -> list[ToolCall]:
        calls = []
        for ch in text:
            if self._depth >= 2:
                self._element.append(ch)
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif ch == "\\":
                    self._escape = True
                elif ch == '"':
                    self._in_string = False
                continue
            if ch == '"':
                self._in_string = True
            elif ch in "[{":
                self._depth += 1
                if self._depth == 2:
                    self._element = [ch]
            elif ch in "]}":
                self._depth -= 1
                if self._depth == 1:
                    obj = json.loads("".join(self._element))
                    calls.append(ToolCall(obj["name"], json.dumps(obj["arguments"], ensure_ascii=False)))
        return calls
