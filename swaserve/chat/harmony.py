"""GPT-OSS chat in its harmony format through `openai-harmony`: conversations rendered to prompt ids, replies
parsed by channel (analysis -> reasoning, final -> content), the assistant's stop tokens."""

from __future__ import annotations

import datetime
import json
import logging
from collections.abc import Callable
from typing import Any

from swaserve.chat.o200k import ENV, FILE_NAME, SHA256, encodings_base, vocab_dir
from swaserve.chat.reply import RawReply, ReplyDelta, ReplyParser

logger = logging.getLogger(__name__)
REASONING_EFFORTS = ("low", "medium", "high")


def load_encoding(tokenizer: Any) -> Any:
    """harmony's GPT-OSS encoding, its vocabulary from $TIKTOKEN_ENCODINGS_BASE or regenerated from
    `tokenizer`'s (never downloaded). ValueError with what to do when it cannot be had."""
    import openai_harmony as oh

    from swaserve.loader.default_model import cache_dir

    def model_vocab() -> dict[str, int]:
        backend = getattr(tokenizer.hf, "backend_tokenizer", None)
        if backend is None:
            raise ValueError(f"GPT-OSS chat needs {FILE_NAME}: the model's tokenizer is not a fast (tokenizer.json) "
                             f"one to regenerate it from; set ${ENV} to a directory holding it (sha256 {SHA256})")
        return backend.get_vocab(with_added_tokens=False)  # type: ignore[no-any-return]

    base = vocab_dir(model_vocab, cache_dir() / "harmony")
    try:
        with encodings_base(base):
            return oh.load_harmony_encoding(oh.HarmonyEncodingName.HARMONY_GPT_OSS)
    except oh.HarmonyError as e:
        raise ValueError(f"openai-harmony could not load {base / FILE_NAME} ({e}); ${ENV} must name a directory "
                         f"holding the exact o200k_base vocabulary (sha256 {SHA256})") from e


class HarmonyChat:
    """Chat for GPT-OSS: `prompt_ids` renders OpenAI messages as a harmony conversation (a system message
    with the reasoning effort and today's date, OpenAI system/developer content as developer instructions,
    earlier assistant replies as final-channel messages), `reply_parser` splits a reply by channel, and
    `stop_token_ids` are the assistant's action ends (<|return|>, <|call|>), not <|end|>, which only
    closes a message (the analysis one) inside a reply."""

    has_reasoning = True

    def __init__(self, tokenizer: Any, today: Callable[[], datetime.date] = datetime.date.today):
        import openai_harmony as oh

        self._oh = oh
        self.tokenizer = tokenizer
        self.encoding = load_encoding(tokenizer)
        self.stop_token_ids: list[int] = sorted(self.encoding.stop_tokens_for_assistant_actions())  # a set
        self.today = today  # the system message's date (tests fix it)

    def prompt_ids(self, messages: list[dict[str, Any]], reasoning_effort: str | None = None,
                   template_kwargs: dict[str, Any] | None = None,
                   tools: list[dict[str, Any]] | None = None) -> list[int]:
        if template_kwargs:
            raise ValueError("chat_template_kwargs do not apply to GPT-OSS: its prompt is rendered by harmony")
        oh = self._oh
        effort = reasoning_effort or "medium"
        if effort not in REASONING_EFFORTS:
            raise ValueError(f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}, got {effort!r}")
        system = (oh.SystemContent.new().with_reasoning_effort(oh.ReasoningEffort(effort.capitalize()))
                  .with_conversation_start_date(self.today().isoformat()))
        conversation = [oh.Message.from_role_and_content(oh.Role.SYSTEM, system)]
        instructions = "\n\n".join(m["content"] for m in messages if m["role"] in ("system", "developer") and m["content"])
        if instructions or tools:  # the tools are declared in the developer message (as `functions.<name>`)
            developer = oh.DeveloperContent.new()
            if instructions:
                developer = developer.with_instructions(instructions)
            if tools:
                developer = developer.with_function_tools([
                    oh.ToolDescription.new(t["function"]["name"], t["function"].get("description", ""),
                                           parameters=t["function"].get("parameters"))
                    for t in tools])
            conversation.append(oh.Message.from_role_and_content(oh.Role.DEVELOPER, developer))
        called: dict[str, str] = {}  # tool call id -> function name, for the tool messages answering them
        for i, m in enumerate(messages):
            role, content = m["role"], m["content"]
            if role in ("system", "developer"):
                continue
            if role == "user":
                conversation.append(oh.Message.from_role_and_content(oh.Role.USER, content))
            elif role == "assistant" and m.get("tool_calls"):
                if content:  # a preamble to the calls
                    conversation.append(oh.Message.from_role_and_content(oh.Role.ASSISTANT, content)
                                        .with_channel("commentary"))
                for call in m["tool_calls"]:
                    fn = call["function"]
                    called[call.get("id", "")] = fn["name"]
                    args = fn.get("arguments")
                    conversation.append(
                        oh.Message.from_role_and_content(oh.Role.ASSISTANT, args if isinstance(args, str) else
                                                         json.dumps(args or {}))
                        .with_channel("commentary").with_recipient(f"functions.{fn['name']}")
                        .with_content_type("<|constrain|>json"))
            elif role == "assistant":
                conversation.append(oh.Message.from_role_and_content(oh.Role.ASSISTANT, content).with_channel("final"))
            elif role == "tool":
                name = m.get("name") or called.get(m.get("tool_call_id") or "")
                if not name:
                    raise ValueError(f"messages[{i}]: a tool message needs the tool_call_id of an earlier call")
                author = oh.Author.new(oh.Role.TOOL, f"functions.{name}")
                conversation.append(oh.Message.from_author_and_content(author, content).with_channel("commentary")
                                    .with_recipient("assistant"))
            else:
                raise ValueError(f"messages[{i}]: role {role!r} is not supported in GPT-OSS chat")
        convo = oh.Conversation.from_messages(conversation)
        return list(self.encoding.render_conversation_for_completion(convo, oh.Role.ASSISTANT))

    def reply_parser(self, separate_reasoning: bool = True, prompt_ids: list[int] | None = None,
                     tool_markers: bool = False) -> ReplyParser:
        """A parser for one reply; `separate_reasoning=False`: the raw reply, channels and all, as content.
        (`tool_markers` changes nothing: harmony's parser keeps the calls as messages.)"""
        return HarmonyReplyParser(self) if separate_reasoning else RawReply(self.tokenizer)


class HarmonyReplyParser:
    """One GPT-OSS reply, token by token, through harmony's `StreamableParser`: text of the analysis channel
    is reasoning; of the final channel (or a message without one, or a commentary message to no one: a
    preamble for the user) content. Commentary addressed to a tool (`to=functions.x`) is kept in the
    parser's messages for tool calls and not shown. A reply that breaks the format (harmony raises)
    continues as plain content from the token that broke it, decoded with its markers; one that never
    opens a message (harmony waits for a header that never ends) is content too, at its end."""

    def __init__(self, chat: HarmonyChat):
        oh = chat._oh
        self._chat = chat
        self._parser = oh.StreamableParser(chat.encoding, role=oh.Role.ASSISTANT)
        self._raw: RawReply | None = None  # set once the reply left the format
        self._before_message: list[int] | None = []  # tokens before the first message's content; None after

    @property
    def messages(self) -> list[Any]:
        """The harmony messages completed so far (tool calls live here)."""
        return self._parser.messages  # type: ignore[no-any-return]

    def feed(self, token_ids: list[int]) -> ReplyDelta:
        if self._raw is not None:
            return self._raw.feed(token_ids)
        reasoning, content = [], []
        for k, tid in enumerate(token_ids):
            try:
                self._parser.process(tid)
            except self._chat._oh.HarmonyError as e:
                logger.debug("reply left the harmony format at token %d (%s); the rest is content", tid, e)
                self._raw = RawReply(self._chat.tokenizer)
                content.append(self._raw.feed(token_ids[k:]).content)
                break
            delta = self._parser.last_content_delta
            channel = self._parser.current_channel
            if self._before_message is not None:  # (`parser.state` costs ~0.1 ms: not asked per token)
                if channel is None and delta is None:
                    self._before_message.append(tid)
                    continue
                self._before_message = None
            if not delta or (channel == "commentary" and self._parser.current_recipient):
                continue  # a tool call's arguments: kept in `messages`, not shown
            (reasoning if channel == "analysis" else content).append(delta)
        return ReplyDelta("".join(reasoning), "".join(content))

    def finish(self) -> ReplyDelta:
        if self._raw is not None:
            return self._raw.finish()
        if self._before_message is None:
            # The reply ended on a stop token the parser never sees (<|call|>, <|return|>): close the
            # message in progress, so a tool call's message joins `messages`.
            try:
                self._parser.process_eos()
            except self._chat._oh.HarmonyError as e:
                logger.debug("harmony could not close the reply's last message (%s)", e)
        if self._before_message:  # no message ever began: the reply is not harmony, show it as written
            return ReplyDelta(content=self._chat.tokenizer.decode(self._before_message, skip_special_tokens=False))
        return ReplyDelta()  # harmony releases each character as soon as its bytes are complete
