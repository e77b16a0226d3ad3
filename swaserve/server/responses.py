"""OpenAI response bodies and SSE chunks (completions and chat), built from the engine's `Update`s."""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from swaserve.server.api_errors import APIError
from swaserve.server.generation import Generation
from swaserve.server.messages import Update
from swaserve.server.prompt_render import echo_logprobs, prompt_logprobs_field

_MIN_LOGPROB = -9999.0  # JSON has no -inf; OpenAI-compatible servers clamp like this


_encode = msgspec.json.Encoder().encode


def dumps(obj: Any) -> bytes:
    try:
        return _encode(obj)  # ~5x faster than json.dumps on a chunk; UTF-8, no ASCII escapes
    except (UnicodeEncodeError, TypeError, OverflowError):  # lone surrogates, exotic values
        return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "replace")


def sse(obj: Any) -> bytes:
    return b"data: " + dumps(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def _lp(value: float | None) -> float | None:
    if value is None:
        return None
    return value if math.isfinite(value) else _MIN_LOGPROB


def merge(batch: list[Update]) -> list[Update]:
    """Fold several updates of one choice (a consumer that fell behind) into one, in arrival order."""
    if len(batch) == 1:  # the common case while streaming keeps up: nothing to fold
        return batch
    merged: dict[int, Update] = {}
    for upd in batch:
        prev = merged.get(upd.index)
        if prev is None:
            merged[upd.index] = Update(
                upd.index, upd.text, upd.reasoning, list(upd.token_ids),
                None if upd.logprobs is None else list(upd.logprobs),
                None if upd.token_strs is None else dict(upd.token_strs), upd.finish_reason,
                cached_tokens=upd.cached_tokens, seed=upd.seed, spec=upd.spec, prompt_ids=upd.prompt_ids,
                prompt_logprobs=upd.prompt_logprobs, prompt_ranks=upd.prompt_ranks, echo_text=upd.echo_text,
                tool_calls=None if upd.tool_calls is None else list(upd.tool_calls),
            )
            continue
        if upd.tool_calls:
            prev.tool_calls = (prev.tool_calls or []) + upd.tool_calls
        prev.spec = upd.spec or prev.spec
        if prev.prompt_ids is None and upd.prompt_ids is not None:  # the first update of a choice came later
            prev.prompt_ids, prev.prompt_logprobs, prev.prompt_ranks = upd.prompt_ids, upd.prompt_logprobs, upd.prompt_ranks
            prev.echo_text = upd.echo_text + prev.echo_text
        if prev.cached_tokens is None:
            prev.cached_tokens, prev.seed = upd.cached_tokens, upd.seed
        prev.text += upd.text
        prev.reasoning += upd.reasoning
        prev.token_ids += upd.token_ids
        if upd.logprobs is not None:
            prev.logprobs = (prev.logprobs or []) + upd.logprobs
        if upd.token_strs is not None:
            prev.token_strs = {**(prev.token_strs or {}), **upd.token_strs}
        prev.finish_reason = upd.finish_reason or prev.finish_reason
    return list(merged.values())


def add_tool_call(calls: list[dict[str, Any]], entry: dict[str, Any]) -> None:
    """Fold one streaming `tool_calls` entry into a choice's whole calls: an entry with an id starts a
    call; one without continues the call at its index (more of its arguments)."""
    if "id" in entry:
        calls.append({"id": entry["id"], "type": "function", "function": dict(entry["function"])})
    else:
        calls[entry["index"]]["function"]["arguments"] += entry["function"].get("arguments", "")


class CompletionLogprobs:
    """Legacy completions logprobs of one choice: tokens, token_logprobs, top_logprobs, text_offset."""

    def __init__(self) -> None:
        self.offset = 0  # characters of token text so far, for text_offset

    def render(self, upd: Update) -> dict[str, list[Any]]:
        out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        strs = upd.token_strs or {}
        for tid, entry in zip(upd.token_ids, upd.logprobs or []):
            text = strs.get(tid, "")
            out["tokens"].append(text)
            out["token_logprobs"].append(_lp(entry.get(tid)))
            ranked = sorted(entry.items(), key=lambda kv: kv[1], reverse=True)
            out["top_logprobs"].append({strs.get(t, ""): _lp(v) for t, v in ranked})
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out


def chat_logprobs(upd: Update, top: int) -> list[dict[str, Any]]:
    strs = upd.token_strs or {}
    content = []
    for tid, entry in zip(upd.token_ids, upd.logprobs or []):
        text = strs.get(tid, "")
        ranked = sorted(entry.items(), key=lambda kv: kv[1], reverse=True)[:top]
        content.append({
            "token": text, "logprob": _lp(entry.get(tid)), "bytes": list(text.encode("utf-8")),
            "top_logprobs": [
                {"token": strs.get(t, ""), "logprob": _lp(v), "bytes": list(strs.get(t, "").encode("utf-8"))}
                for t, v in ranked
            ],
        })
    return content


class Choices:
    """Accumulates every choice of one request; renders the non-streaming body and the usage.

    `reasoning` (chat of a model with a reasoning format, reasoning separated): messages and deltas carry
    `reasoning_content` beside `content`, as vLLM and SGLang send it."""

    def __init__(self, num_choices: int, choices_per_prompt: int, chat: bool, logprobs: int | None,
                 reasoning: bool = False, prompt_logprobs: int | None = None, echo: bool = False):
        self.chat = chat
        self.echo = echo  # completions: each choice's text (and logprobs) start with its prompt's
        self.prompt_logprobs = prompt_logprobs  # vLLM's field: each choice's (chat: the response's) prompt_logprobs
        self.prompt_field: list[list[Any] | None] = [None] * num_choices
        self.reasoning = reasoning
        self.logprobs = logprobs
        self.per_prompt = choices_per_prompt
        self.text = [""] * num_choices
        self.reasoning_text = [""] * num_choices
        self.tokens = [0] * num_choices
        self.finish: list[str | None] = [None] * num_choices
        self.cached = [0] * num_choices  # prompt tokens served from the prefix cache
        self.seed: list[int | None] = [None] * num_choices  # the sampling seed in use, where there is one
        self.spec: list[tuple[int, int] | None] = [None] * num_choices  # (drafted, accepted) so far
        self.lp_completion = [CompletionLogprobs() for _ in range(num_choices)]
        self.tool_calls: list[list[dict[str, Any]]] = [[] for _ in range(num_choices)]  # whole calls
        self.lp: list[Any] = [
            [] if chat else {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
            for _ in range(num_choices)
        ]

    def note_first(self, upd: Update) -> None:
        """Record what an update carries besides tokens: cached prompt tokens and seed (the first
        update of a choice), speculative counts (the latest)."""
        if upd.cached_tokens is not None:
            self.cached[upd.index], self.seed[upd.index] = upd.cached_tokens, upd.seed
        if upd.spec is not None:
            self.spec[upd.index] = upd.spec

    def prompt_part(self, upd: Update) -> tuple[str, dict[str, list[Any]] | None]:
        """A choice's first update: record its prompt_logprobs field; for echo, the prompt text and (with
        logprobs) the prompt's legacy logprobs that go in front of the completion's."""
        i = upd.index
        if self.prompt_logprobs is not None and upd.prompt_logprobs is not None:
            self.prompt_field[i] = prompt_logprobs_field(upd, self.prompt_logprobs)
        if not self.echo:
            return "", None
        if self.logprobs is None or upd.prompt_logprobs is None:
            return upd.echo_text, None
        lp, self.lp_completion[i].offset = echo_logprobs(upd, self.logprobs, self.lp_completion[i].offset)
        return upd.echo_text, lp

    def add(self, upd: Update) -> None:
        i = upd.index
        self.note_first(upd)
        if upd.prompt_ids is not None:
            text, lp = self.prompt_part(upd)
            self.text[i] += text
            for key, values in (lp or {}).items():
                self.lp[i][key] += values
        self.text[i] += upd.text
        self.reasoning_text[i] += upd.reasoning
        self.tokens[i] += len(upd.token_ids)
        self.finish[i] = upd.finish_reason or self.finish[i]
        for entry in upd.tool_calls or ():
            add_tool_call(self.tool_calls[i], entry)
        if self.logprobs is not None and upd.logprobs is not None:
            if self.chat:
                self.lp[i] += chat_logprobs(upd, self.logprobs)
            else:
                for key, values in self.lp_completion[i].render(upd).items():
                    self.lp[i][key] += values

    def usage(self, prompt_tokens: dict[int, int]) -> dict[str, Any]:
        # The prompt is counted once per prompt, not once per choice (as OpenAI does for n > 1).
        firsts = range(0, len(self.text), self.per_prompt)
        prompt = sum(prompt_tokens.get(i, 0) for i in firsts)
        # A prompt's n choices share its K/V; the fewest any of them found cached is what it saved.
        cached = sum(min(self.cached[i : i + self.per_prompt]) for i in firsts)
        completion = sum(self.tokens)
        out: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion,
                               "total_tokens": prompt + completion, "prompt_tokens_details": {"cached_tokens": cached}}
        spec = [s for s in self.spec if s is not None]
        if spec:  # speculative decoding: drafted tokens the model accepted or rejected (OpenAI's names)
            drafted, accepted = sum(s[0] for s in spec), sum(s[1] for s in spec)
            out["completion_tokens_details"] = {"accepted_prediction_tokens": accepted,
                                                "rejected_prediction_tokens": drafted - accepted}
        return out

    def body(self, head: dict[str, Any], prompt_tokens: dict[int, int]) -> dict[str, Any]:
        choices = []
        for i, text in enumerate(self.text):
            lp = None if self.logprobs is None else ({"content": self.lp[i]} if self.chat else self.lp[i])
            if self.chat:
                message: dict[str, Any] = {"role": "assistant", "content": text}
                if self.tool_calls[i]:
                    message["content"] = text or None
                    message["tool_calls"] = self.tool_calls[i]
                if self.reasoning:
                    message["reasoning_content"] = self.reasoning_text[i] or None
                choice = {"index": i, "message": message, "logprobs": lp, "finish_reason": self.finish[i]}
            else:
                choice = {"index": i, "text": text, "logprobs": lp, "finish_reason": self.finish[i]}
                if self.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = self.prompt_field[i]
            if self.seed[i] is not None:
                choice["seed"] = self.seed[i]  # resend with this seed for the same tokens
            choices.append(choice)
        body = {**head, "choices": choices, "usage": self.usage(prompt_tokens)}
        if self.chat and self.prompt_logprobs is not None:  # vLLM's place: one prompt for every choice
            body["prompt_logprobs"] = self.prompt_field[0]
        return body


async def stream_chunks(
    gen: Generation, head: dict[str, Any], choices: Choices, include_usage: bool
) -> AsyncIterator[bytes]:
    """SSE body: (chat: a role chunk per choice), one chunk per choice update, usage, [DONE]."""
    chat = choices.chat
    usage_field = {"usage": None} if include_usage else {}
    if chat:
        for i in range(len(choices.text)):
            delta = {"role": "assistant", "content": ""}
            yield sse({**head, "choices": [{"index": i, "delta": delta, "logprobs": None,
                                             "finish_reason": None}], **usage_field})
    try:
        async for batch in gen.updates():
            for upd in merge(batch):
                choices.tokens[upd.index] += len(upd.token_ids)
                choices.note_first(upd)
                lp: Any = None
                echo, echo_lp = choices.prompt_part(upd) if upd.prompt_ids is not None else ("", None)
                if choices.logprobs is not None and upd.logprobs:
                    lp = ({"content": chat_logprobs(upd, choices.logprobs)} if chat
                          else choices.lp_completion[upd.index].render(upd))
                if echo_lp is not None:
                    lp = {key: echo_lp[key] + (lp[key] if lp else []) for key in echo_lp}
                upd.text = echo + upd.text
                if not (upd.text or upd.reasoning or upd.finish_reason or lp or upd.tool_calls):
                    continue
                if chat:
                    delta = {"reasoning_content": upd.reasoning} if upd.reasoning else {}
                    if upd.text or (lp and not upd.reasoning):
                        delta["content"] = upd.text
                    if upd.tool_calls:
                        delta["tool_calls"] = upd.tool_calls
                    choice = {"index": upd.index, "delta": delta, "logprobs": lp, "finish_reason": upd.finish_reason}
                else:
                    choice = {"index": upd.index, "text": upd.text, "logprobs": lp,
                              "finish_reason": upd.finish_reason}
                if upd.seed is not None:
                    choice["seed"] = upd.seed
                yield sse({**head, "choices": [choice], **usage_field})
    except APIError as e:
        yield sse(e.body())
        yield SSE_DONE
        return
    if include_usage:
        yield sse({**head, "choices": [], "usage": choices.usage(gen.prompt_tokens)})
    yield SSE_DONE
