"""Chat formats: how a model family's chat messages become prompt ids and its replies become reasoning and
content (`chat_for`: the Jinja chat template, with thinking blocks split out where the vocabulary has their
markers (Gemma 4, MiMo-V2), or GPT-OSS's harmony format through openai-harmony)."""

from __future__ import annotations

from typing import Any, Protocol

from swaserve.chat.reply import ParsedReply, RawReply, ReplyDelta, ReplyParser
from swaserve.chat.thinking import ThinkingFormat, ThinkingReplyParser, detect, opens_thinking
from swaserve.chat.tool_parsers import tool_family
from swaserve.chat.tool_prompt import fallback_messages, template_messages, template_takes_tools

__all__ = ["ChatFormat", "ParsedReply", "RawReply", "ReplyDelta", "ReplyParser", "TemplateChat", "ThinkingChat",
           "chat_for"]


class ChatFormat(Protocol):
    """A model's chat: prompt ids for OpenAI-style messages, token ids that end a reply, and (for families
    with a reasoning format, `has_reasoning`) a `ReplyParser` per reply."""

    stop_token_ids: list[int]
    has_reasoning: bool

    def prompt_ids(self, messages: list[dict[str, Any]], reasoning_effort: str | None = None,
                   template_kwargs: dict[str, Any] | None = None,
                   tools: list[dict[str, Any]] | None = None) -> list[int]:
        """ValueError for messages or options the format cannot take (the server answers 400).
        `template_kwargs`: extra variables for a Jinja template (vLLM's `chat_template_kwargs`). `tools`:
        the functions the model may call (OpenAI's `function` objects: name, description, parameters)."""
        ...

    def reply_parser(self, separate_reasoning: bool = True, prompt_ids: list[int] | None = None,
                     tool_markers: bool = False) -> ReplyParser | None:
        """None: replies are plain text (no reasoning to split). `prompt_ids`: the reply's prompt (a
        template may open the thinking block in it). `tool_markers` (a request with tools): the content
        keeps the special tokens of the model's tool-call format, for `server.tools.ToolReply` to parse."""
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
                   template_kwargs: dict[str, Any] | None = None,
                   tools: list[dict[str, Any]] | None = None) -> list[int]:
        if reasoning_effort is not None:
            raise ValueError("reasoning_effort applies only to models with a reasoning format (GPT-OSS)")
        tok = self.tokenizer
        extra: dict[str, Any] = {"template_kwargs": template_kwargs} if template_kwargs else {}
        if not tools and not any(m["role"] == "tool" or m.get("tool_calls") for m in messages):
            text = tok.apply_chat_template(messages, add_generation_prompt=True, **extra)
        elif template_takes_tools(tok.chat_template):
            text = tok.apply_chat_template(template_messages(messages), add_generation_prompt=True, tools=tools,
                                           **extra)
        else:  # a template without tools (Gemma 3): the tools and tool turns written into the messages
            text = tok.apply_chat_template(fallback_messages(messages, tools), add_generation_prompt=True, **extra)
        return list(tok.encode(text))

    def reply_parser(self, separate_reasoning: bool = True, prompt_ids: list[int] | None = None,
                     tool_markers: bool = False) -> ReplyParser | None:
        return None


class ThinkingChat(TemplateChat):
    """Chat through the Jinja template for a model that thinks in marked blocks (`chat/thinking.py`: Gemma
    4's channel, MiMo-V2's <think> tags): replies split into reasoning and content. Whether the model
    thinks at all is the template's business (both take `chat_template_kwargs: {"enable_thinking": true}`)."""

    has_reasoning = True

    def __init__(self, tokenizer: Any, fmt: ThinkingFormat, start_id: int, end_id: int):
        super().__init__(tokenizer)
        self.format, self.start_id, self.end_id = fmt, start_id, end_id

    def reply_parser(self, separate_reasoning: bool = True, prompt_ids: list[int] | None = None,
                     tool_markers: bool = False) -> ReplyParser:
        """`separate_reasoning=False`: the reply as written, markers included, all in content."""
        if not separate_reasoning:
            return RawReply(self.tokenizer)
        inside = opens_thinking(prompt_ids or [], self.start_id, self.end_id)
        return ThinkingReplyParser(self.tokenizer, self.format, self.start_id, self.end_id, inside,
                                   content_specials=tool_markers)


def chat_for(tokenizer: Any) -> ChatFormat:
    """The chat format of `tokenizer`'s model (`Tokenizer.chat_format`); GPT-OSS's loads harmony's
    vocabulary now, so a server fails at start, not at its first chat request, when it cannot be had."""
    if getattr(tokenizer, "chat_format", None) == "harmony":
        from swaserve.chat.harmony import HarmonyChat

        return HarmonyChat(tokenizer)
    thinking = detect(tokenizer) if hasattr(tokenizer, "hf") else None
    if thinking is not None:
        return ThinkingChat(tokenizer, *thinking)
    return TemplateChat(tokenizer)
