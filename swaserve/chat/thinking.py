"""Thinking blocks: replies whose reasoning sits between a start and an end marker token, Gemma 4's
`<|channel>thought\\n...<channel|>` and the `<think>...</think>` of MiMo-V2 (and Qwen3-style templates),
split into reasoning and content token by token (`ThinkingReplyParser`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from swaserve.chat.reply import ReplyDelta
from swaserve.detokenizer import IncrementalDetokenizer


@dataclass(frozen=True)
class ThinkingFormat:
    """A family's thinking block: `start` and `end` marker tokens (each one token of the vocabulary) and a
    `label` the model writes first inside the block (Gemma 4's channel name), which is not reasoning."""

    name: str
    start: str
    end: str
    label: str = ""


GEMMA4 = ThinkingFormat("gemma4", "<|channel>", "<channel|>", label="thought\n")
THINK_TAGS = ThinkingFormat("think", "<think>", "</think>")  # MiMo-V2 (Qwen3's tags)
FORMATS = (GEMMA4, THINK_TAGS)


def marker_ids(tokenizer: Any, fmt: ThinkingFormat) -> tuple[int, int] | None:
    """The (start, end) token ids of `fmt` in `tokenizer`'s vocabulary, or None unless both are single tokens."""
    vocab = tokenizer.hf.get_vocab()
    start, end = vocab.get(fmt.start), vocab.get(fmt.end)
    return None if start is None or end is None else (start, end)


def detect(tokenizer: Any) -> tuple[ThinkingFormat, int, int] | None:
    """The thinking format whose markers `tokenizer`'s vocabulary has as single tokens (the first of
    FORMATS that matches), with their ids; None for a model without one."""
    for fmt in FORMATS:
        ids = marker_ids(tokenizer, fmt)
        if ids is not None:
            return fmt, *ids
    return None


def opens_thinking(prompt_ids: list[int], start_id: int, end_id: int) -> bool:
    """Whether the prompt leaves a thinking block open (a template that writes the start marker into the
    generation prompt): the reply then begins as reasoning."""
    for tid in reversed(prompt_ids):
        if tid == start_id:
            return True
        if tid == end_id:
            return False
    return False


class ThinkingReplyParser:
    """One reply of a model with thinking blocks: tokens between the start and the end marker are reasoning
    (less the format's label, held back until it is known whether the block starts with it), the rest is
    content; the markers themselves are neither. Each run of text gets its own `IncrementalDetokenizer`
    (special tokens skipped, the tokens before it as decoding context), flushed when a marker ends it, so
    no character straddles reasoning and content. A marker out of place (an end outside a block, a start
    inside one) is dropped; a reply that never closes its block ends as reasoning (`finish_reason`
    length, typically), as vLLM's parsers report it. `content_specials` (a request with tools): content
    runs keep special tokens (Gemma 4's `<|tool_call>`, its `<|"|>` quotes), which the tool-call parser
    reads from the content; the reasoning still skips them."""

    def __init__(self, tokenizer: Any, fmt: ThinkingFormat, start_id: int, end_id: int, inside: bool = False,
                 content_specials: bool = False):
        self._tokenizer, self._fmt = tokenizer, fmt
        self._content_specials = content_specials
        self._start_id, self._end_id = start_id, end_id
        self._inside = inside
        self._ids: list[int] = []  # every token so far: decoding context for the next run
        self._detok = self._run()
        self._label_pending = inside and bool(fmt.label)  # reasoning text held until the label is decided
        self._held = ""

    def _run(self) -> IncrementalDetokenizer:
        keep = self._content_specials and not self._inside
        return IncrementalDetokenizer(self._tokenizer, self._ids[-8:], skip_special_tokens=not keep)

    def feed(self, token_ids: list[int]) -> ReplyDelta:
        reasoning, content = [], []
        for tid in token_ids:
            if tid == self._start_id or tid == self._end_id:
                opening = tid == self._start_id
                if opening != self._inside:  # a marker that switches: end this run of text
                    self._route(self._detok.flush(), reasoning, content)
                    self._route(self._release_label(final=True), reasoning, content, raw=True)
                    self._inside = opening
                    self._label_pending = opening and bool(self._fmt.label)
                    self._ids.append(tid)
                    self._detok = self._run()
                continue
            self._ids.append(tid)
            self._route(self._detok.step([tid]), reasoning, content)
        return ReplyDelta("".join(reasoning), "".join(content))

    def finish(self) -> ReplyDelta:
        reasoning: list[str] = []
        content: list[str] = []
        self._route(self._detok.flush(), reasoning, content)
        self._route(self._release_label(final=True), reasoning, content, raw=True)
        return ReplyDelta("".join(reasoning), "".join(content))

    def _route(self, text: str, reasoning: list[str], content: list[str], raw: bool = False) -> None:
        if not text:
            return
        if not self._inside:
            content.append(text)
        elif raw or not self._label_pending:
            reasoning.append(text)
        else:
            self._held += text
            reasoning.append(self._release_label(final=False))

    def _release_label(self, final: bool) -> str:
        """The held reasoning less a leading label, once it is decided (or `final`): '' while undecided."""
        if not self._label_pending:
            return ""
        label, held = self._fmt.label, self._held
        if not final and len(held) < len(label) and label.startswith(held):
            return ""
        self._label_pending, self._held = False, ""
        return held.removeprefix(label)
