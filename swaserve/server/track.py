"""Track: one sub-request in flight at the frontend (where its updates go, its detokenizer, what was
handed out) and `Track.absorb`, which turns an engine core's delta into the `Update` the client posts;
`TokenNames`: token ids' text, decoded once each (logprobs' token strings)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from swaserve.chat import ParsedReply
from swaserve.core.messages import RequestDelta
from swaserve.detokenizer import IncrementalDetokenizer
from swaserve.server.messages import SubRequest, Update
from swaserve.server.tools import ToolReply


class TokenNames:
    """Each token id's own text, decoded once and kept (a vocabulary's worth at most)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._text: dict[int, str] = {}

    def of(self, logprobs: list[dict[int, float]]) -> dict[int, str]:
        """The text of every token id keyed in `logprobs`."""
        cache, decode = self._text, self.tokenizer.decode
        out: dict[int, str] = {}
        for entry in logprobs:
            for tid in entry:
                if tid not in cache:
                    cache[tid] = decode([tid])
                out[tid] = cache[tid]
        return out


@dataclass(slots=True)
class Track:
    """One sub-request in flight: where its updates go, its detokenizer, and what was sent."""

    sub: SubRequest
    queue: asyncio.Queue[list[Update]]
    arrival: float
    prompt_tokens: int
    detok: IncrementalDetokenizer | ParsedReply | ToolReply  # ParsedReply: a chat reply of a model with a
    # reasoning format; ToolReply: a chat reply with tools (around either)
    replica: int  # the engine core that runs it
    prompt_ids: list[int] | None = None  # kept for the first update (echo, prompt logprobs)
    accepted: bool = False
    tokens: int = 0  # token ids handed out (posted or pending)
    chars: int = 0  # characters of detok.text handed out
    reasoning_chars: int = 0  # characters of detok.reasoning handed out (ParsedReply)
    calls: int = 0  # entries of detok.calls handed out (ToolReply)
    last_token: float = 0.0
    posted: bool = False  # an update with tokens or text was posted
    pending: Update | None = None  # held back until stream_interval tokens (or the end)

    def absorb(self, delta: RequestDelta, names: TokenNames) -> tuple[Update, list[int], str | None, bool]:
        """`delta`'s tokens through the detokenizer into the held-back update (or a new one): (the update,
        the token ids it hands out, the finish reason, whether a stop string ended the request here: the
        core must then be told to abort it). The update's own `finish_reason` is left to the caller."""
        ids, finish, detok = delta.token_ids, delta.finish_reason, self.detok
        if self.sub.echo_only:  # max_tokens 0: the one token the engine ran for is not part of the answer
            ids, finish = [], ("length" if finish is not None else None)
        # A core-side "stop" ends on a stop token (EOS or stop_token_ids): in token_ids, but no text.
        text_ids = ids[:-1] if finish == "stop" and ids else ids
        taken, stopped_here = len(ids), False
        for k, tid in enumerate(text_ids):
            detok.step([tid])
            if detok.stopped:  # a stop string: this token is the last one reported
                taken, finish, stopped_here = k + 1, "stop", True
                break
        if finish is not None and not detok.stopped:
            detok.flush()
        new_ids = ids[:taken] if taken < len(ids) else ids
        upd = self.pending or Update(self.sub.index)
        if delta.cached_tokens is not None:
            upd.cached_tokens, upd.seed = delta.cached_tokens, delta.seed
        if delta.spec is not None:
            upd.spec = delta.spec
        upd.text += detok.text[self.chars :]
        self.chars = len(detok.text)
        if not isinstance(detok, IncrementalDetokenizer) and len(detok.reasoning) > self.reasoning_chars:
            if self.sub.include_reasoning:
                upd.reasoning += detok.reasoning[self.reasoning_chars :]
            self.reasoning_chars = len(detok.reasoning)
        if isinstance(detok, ToolReply):
            if len(detok.calls) > self.calls:
                upd.tool_calls = (upd.tool_calls or []) + detok.calls[self.calls :]
                self.calls = len(detok.calls)
            if finish == "stop" and detok.num_calls:
                finish = "tool_calls"
        upd.token_ids += new_ids
        if delta.prompt_logprobs is not None or self.prompt_ids is not None:
            self._prompt_extras(upd, delta, names)
        if delta.logprobs is not None and not self.sub.echo_only:
            lps = delta.logprobs[: len(new_ids)]
            upd.logprobs = (upd.logprobs or []) + lps
            if self.sub.token_strings:
                upd.token_strs = {**(upd.token_strs or {}), **names.of(lps)}
        self.tokens += len(new_ids)
        self.pending = None
        return upd, new_ids, finish, stopped_here

    def _prompt_extras(self, upd: Update, delta: RequestDelta, names: TokenNames) -> None:
        """The first update's prompt logprobs (with their token strings) and, for echo, the prompt itself."""
        if delta.prompt_logprobs is not None:
            upd.prompt_logprobs, upd.prompt_ranks = delta.prompt_logprobs
            if self.sub.token_strings:
                upd.token_strs = {**(upd.token_strs or {}), **names.of(upd.prompt_logprobs)}
        if self.prompt_ids is not None:  # once
            ids, self.prompt_ids = self.prompt_ids, None
            upd.prompt_ids, prompt = ids, self.sub.prompt
            if self.sub.echo:
                upd.echo_text = prompt if isinstance(prompt, str) else names.tokenizer.decode(ids)
            if self.sub.token_strings:
                upd.token_strs = {**(upd.token_strs or {}), **names.of([dict.fromkeys(ids, 0.0)])}
