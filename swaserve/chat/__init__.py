"""Chat formats: how a model family's chat messages become prompt ids and its replies become reasoning and
content (`chat_for`: the Jinja chat template, or GPT-OSS's harmony format through openai-harmony)."""

from __future__ import annotations

from typing import Any, Protocol

from swaserve.chat.reply import ParsedReply, RawReply, ReplyDelta, ReplyParser

__all__ = ["ChatFormat", "ParsedReply", "RawReply", "ReplyDelta", "ReplyParser", "TemplateChat", "chat_for"]


class ChatFormat(Protocol):
    """A model's chat: prompt ids for OpenAI-style messages, token ids that end a reply, and (for families
    with a reasoning format, `has_reasoning`) a `ReplyParser` per reply."""

    stop_token_ids: list[int]
    has_reasoning: bool

    def prompt_ids(self, messages: list[dict[str, str]], reasoning_effort: str | None = None) -> list[int]:
        """ValueError for messages or options the format cannot take (the server answers 400)."""
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

    def prompt_ids(self, messages: list[dict[str, str]], reasoning_effort: str | None = None) -> list[int]:
        if reasoning_effort is not None:
            raise ValueError("reasoning_effort applies only to models with a reasoning format (GPT-OSS)")
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return list(self.tokenizer.encode(text))

    def reply_parser(self, separate_reasoning: bool = True) -> ReplyParser | None:
        return None


def chat_for(tokenizer: Any) -> ChatFormat:
    """The chat format of `tokenizer`'s model (`Tokenizer.chat_format`); GPT-OSS's loads harmony's
    vocabulary now, so a server fails at start, not at its first chat request, when it cannot be had."""
    if getattr(tokenizer, "chat_format", None) == "harmony":
        from swaserve.chat.harmony import HarmonyChat

        return HarmonyChat(tokenizer)
    return TemplateChat(tokenizer)
