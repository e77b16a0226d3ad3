"""Typed values between the HTTP routes and the EngineClient: `SubRequest` in, `Update` out (the IPC with
the engine core is `swaserve.core.messages`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from swaserve.server.api_errors import APIError


@dataclass(slots=True)
class SubRequest:
    """One engine request: a prompt (text, token ids, or chat messages) and SamplingParams kwargs."""

    request_id: str
    index: int  # choice index in the HTTP response
    prompt: str | list[int] | None = None
    messages: list[dict[str, str]] | None = None
    sampling: dict[str, Any] = field(default_factory=dict)  # max_tokens None: the rest of the context
    token_strings: bool = False  # also send the text of every token id in logprobs
    stream: bool = True  # False: the route wants the whole completion, so one update at the end
    reasoning_effort: str | None = None  # chat, models with a reasoning format
    separate_reasoning: bool = False  # chat: the reply's reasoning goes to `Update.reasoning`, not `text`
    include_reasoning: bool = True  # chat, vLLM's include_reasoning: False drops the separated reasoning
    template_kwargs: dict[str, Any] | None = None  # chat: extra chat-template variables (chat_template_kwargs)
    echo: bool = False  # completions: the prompt comes back first (`Update.echo_text`)
    echo_only: bool = False  # completions, max_tokens 0 with echo: the engine's one token is not reported
    tools: list[dict[str, Any]] | None = None  # chat: the functions the chat template is given
    tool_plan: Any = None  # chat with tools (`server.tools.ToolPlan`): how the reply's tool calls are read


@dataclass(slots=True)
class Update:
    """EngineClient -> a route, for one sub-request: everything new since its previous update."""

    index: int
    text: str = ""  # chat: the content
    reasoning: str = ""  # chat with separate reasoning: the reasoning content
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    token_strs: dict[int, str] | None = None
    finish_reason: str | None = None
    accepted: bool = False  # the first update of an added request, carrying `prompt_tokens`
    prompt_tokens: int = 0
    cached_tokens: int | None = None  # with the first tokens: prompt tokens served from the prefix cache
    seed: int | None = None  # with the first tokens: the sampling seed in use
    spec: tuple[int, int] | None = None  # speculative decoding: (drafted, accepted) tokens so far
    tool_calls: list[dict[str, Any]] | None = None  # chat with tools: new OpenAI streaming tool_calls entries
    error: APIError | None = None  # add refused, engine failure or shutdown; ends the sub-request
    # With the first tokens, where asked: the prompt's ids (echo or prompt logprobs), its logprobs ({token:
    # logprob} per token after the first) and their ranks, and for echo its text.
    prompt_ids: list[int] | None = None
    prompt_logprobs: list[dict[int, float]] | None = None
    prompt_ranks: list[int] | None = None
    echo_text: str = ""
