"""Chat formats: how a model family's chat messages become prompt ids and its replies become reasoning and
content (`chat_for`: the Jinja chat template, or GPT-OSS's harmony format through openai-harmony)."""

from __future__ import annotations

from typing import Any, Protocol

from swaserve.chat.reply import ParsedReply, RawReply, ReplyDelta, ReplyParser
from swaserve.chat.tool_parsers import tool_family
from swaserve.chat.tool_prompt import fallback_messages, template_messages, template_takes_tools

__all__ = ["ChatFormat", "ParsedReply", "RawReply", "ReplyDelta", "ReplyParser", "TemplateChat", "chat_for"]


class ChatFormat(Protocol):
    """A model's chat: prompt ids for OpenAI-style messages, token ids that end a reply, and (for families
    with a reasoning format, `has_reasoning`) a `ReplyParser` per reply."""

    stop_token_ids: list[int]
    has_reasoning: bool

    def prompt_ids(self, messages: list[dict[str, Any]], reasoning_effort: str | None = None,
                   tools: list[dict[str, Any]] | None = None) -> list[int]:
        """ValueError for messages or options the format cannot take (the server answers 400). `tools`:
        the functions the model may call (OpenAI's `function` objects: name, description, parameters)."""
        ...

    def reply_parser(self, separate_reasoning: bool = True) -> ReplyParser | None:
        """None: replies are plain text (no reasoning to split)."""
        ...


class TemplateChat:
    """Chat through the tokenizer's Jinja chat template; replies are plain text."""

    has_reasoning = False

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.stop_token_ids: list[int] = []  # the template's turn ends are already the tokenizer's EOS ids
        self._tool_family: str | None = None

    @property
    def tool_family(self) -> str:
        """How this model writes tool calls (`tool_parsers.tool_family`), looked up once."""
        if self._tool_family is None:
            self._tool_family = tool_family(self.tokenizer)
        return self._tool_family

    def prompt_ids(self, messages: list[dict[str, Any]], reasoning_effort: str | None = None,
                   tools: list[dict[str, Any]] | None = None) -> list[int]:
        if reasoning_effort is not None:
            raise ValueError("reasoning_effort applies only to models with a reasoning format (GPT-OSS)")
        tok = self.tokenizer
        if not tools and not any(m["role"] == "tool" or m.get("tool_calls") for m in messages):
            text = tok.apply_chat_template(messages, add_generation_prompt=True)
        elif template_takes_tools(tok.chat_template):
            text = tok.apply_chat_template(template_messages(messages), add_generation_prompt=True, tools=tools)
        else:  # a template without tools (Gemma 3): the tools and tool turns written into the messages
            text = tok.apply_chat_template(fallback_messages(messages, tools), add_generation_prompt=True)
        return list(tok.encode(text))

    def reply_parser(self, separate_reasoning: bool = True) -> ReplyParser | None:
        return None


def chat_for(tokenizer: Any) -> ChatFormat:
    """The chat format of `tokenizer`'s model (`Tokenizer.chat_format`); GPT-OSS's loads harmony's
    vocabulary now, so a server fails at start, not at its first chat request, when it cannot be had."""
    if getattr(tokenizer, "chat_format", None) == "harmony":
        from swaserve.chat.harmony import HarmonyChat

        return HarmonyChat(tokenizer)
    return TemplateChat(tokenizer)
