"""Chat replies split into reasoning and content: the per-family `ReplyParser` interface, `RawReply` (the
reply as written, markers included, all in content) and `ParsedReply` (a parser plus stop strings)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from swaserve.detokenizer import IncrementalDetokenizer, StopStrings


@dataclass(frozen=True, slots=True)
class ReplyDelta:
    """Text a reply gained from some tokens: `reasoning` (the model's thinking) and `content` (the answer)."""

    reasoning: str = ""
    content: str = ""


class ReplyParser(Protocol):
    """One sequence's generated tokens as they stream -> reasoning and content text deltas. A family with a
    reasoning format (GPT-OSS's harmony channels; thinking blocks later) implements this; one per sequence.
    Text held back (an incomplete character or marker) comes out in a later delta or from `finish`."""

    def feed(self, token_ids: list[int]) -> ReplyDelta: ...

    def finish(self) -> ReplyDelta:
        """The reply ended (stop token, length, abort): whatever is still held back."""
        ...


class RawReply:
    """A `ReplyParser` that leaves the reasoning in the content: the reply's text as the model wrote it,
    special tokens (channel and message markers) included, so a client can split it itself."""

    def __init__(self, tokenizer: Any):
        self._detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)

    def feed(self, token_ids: list[int]) -> ReplyDelta:
        return ReplyDelta(content=self._detok.step(token_ids))

    def finish(self) -> ReplyDelta:
        return ReplyDelta(content=self._detok.flush())


class ParsedReply:
    """One chat reply through a `ReplyParser`, with the request's stop strings applied to its content (the
    reasoning is not the answer: a stop string there does not end it). The frontend's per-sequence text
    state, with the surface of `IncrementalDetokenizer` (`step`, `flush`, `text`, `stopped`) plus
    `reasoning`. Invariants: `text` and `reasoning` only grow; nothing is added once `stopped`."""

    def __init__(self, parser: ReplyParser, stop: list[str] | None = None):
        self.parser = parser
        self._stops = StopStrings(stop)
        self.reasoning = ""
        self.stopped = False
        self.finish_matched: str | None = None

    @property
    def text(self) -> str:
        return self._stops.text

    def step(self, new_token_ids: list[int] | int) -> str:
        """Add generated tokens; return the newly released content."""
        if self.stopped:
            return ""
        ids = [new_token_ids] if isinstance(new_token_ids, int) else new_token_ids
        return self._take(self.parser.feed(ids), final=False)

    def flush(self) -> str:
        """The reply ended without a stop string: release everything held back."""
        if self.stopped:
            return ""
        return self._take(self.parser.finish(), final=True)

    def _take(self, delta: ReplyDelta, final: bool) -> str:
        self.reasoning += delta.reasoning
        released = self._stops.push(delta.content, final)
        if self._stops.matched is not None:
            self.stopped, self.finish_matched = True, self._stops.matched
        return released
