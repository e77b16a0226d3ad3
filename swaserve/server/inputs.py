"""A sub-request's engine input, checked at the boundary: prompt token ids (chat format applied) and
SamplingParams within the context length; bad input is a 400 `APIError`."""

from __future__ import annotations

from typing import Any

from swaserve.request import SamplingParams
from swaserve.server.api_errors import APIError
from swaserve.server.messages import SubRequest


def prompt_ids(tok: Any, chat: Any, sub: SubRequest) -> list[int]:
    """The prompt's token ids (chat messages through the model's chat format, `swaserve.chat`); 400 for bad
    input."""
    prompt = sub.prompt
    if sub.messages is not None:
        try:
            prompt = chat.prompt_ids(sub.messages, reasoning_effort=sub.reasoning_effort,
                                     template_kwargs=sub.template_kwargs, tools=sub.tools)
        except ValueError as e:  # no template (a base model), the template rejected the messages, bad options
            raise APIError(400, f"messages: {e}", param="messages") from e
        except Exception as e:  # template errors (jinja raise_exception) are about the input
            raise APIError(400, f"messages: the chat template rejected them: {e}", param="messages") from e
    ids = tok.encode(prompt) if isinstance(prompt, str) else list(prompt or [])
    if not ids:
        raise APIError(400, "prompt is empty after tokenization", param="prompt")
    return ids


def sampling_params(sub: SubRequest, prompt_len: int, max_context: int) -> SamplingParams:
    """SamplingParams with max_tokens filled in (default: the rest of the context) and checked against it."""
    kw = dict(sub.sampling)
    param = "messages" if sub.messages is not None else "prompt"
    room = max_context - prompt_len
    if kw.get("max_tokens") is None:
        if room < 1:
            raise APIError(
                400, f"This model's maximum context length is {max_context} tokens, but the "
                f"{param} has {prompt_len} tokens, leaving no room for a completion.",
                param=param, code="context_length_exceeded",
            )
        kw["max_tokens"] = room
    elif prompt_len + kw["max_tokens"] > max_context:
        raise APIError(
            400, f"This model's maximum context length is {max_context} tokens. However, you "
            f"requested {prompt_len + kw['max_tokens']} tokens ({prompt_len} in the {param}, "
            f"{kw['max_tokens']} in the completion). Please reduce the {param} or max_tokens.",
            param="max_tokens" if room >= 1 else param, code="context_length_exceeded",
        )
    return SamplingParams(**kw)
