"""Per-sequence scheduler state: tokens, where its K/V live, and how it finished."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from swaserve.request import SamplingParams


class ReqStatus(enum.Enum):
    WAITING = "waiting"  # queued; may hold a partial prefill (the chunked request)
    RUNNING = "running"  # prefilled; decodes one token a step
    FINISHED = "finished"


@dataclass(eq=False)
class Req:
    """One sequence (a request with n > 1 becomes n of these).

    Invariants: positions [0, kv_len) have K/V in the pools through row `row`, written by steps
    already launched (kv_len advances when a step is scheduled, not when it completes); positions
    [0, cache_len) belong to the prefix cache, [cache_len, kv_len) to this request; of its own
    positions, [cache_len, swa_evicted) have had their SWA slots freed; `inflight` tokens were sampled by launched
    steps whose results the host has not seen yet (one per such step, so at most 2 with one step
    in flight and the next scheduled; their values are on the device, in the runner's last-token
    table). An unfinished request always has a next query: `kv_len < len(ids) + inflight`.
    """

    rid: str
    group_id: str  # the user's request id
    index: int  # which of the n sequences
    prompt_len: int
    ids: list[int]  # prompt + output token ids
    params: SamplingParams
    arrival: int  # monotonically increasing admission order
    eos_ids: frozenset[int]
    detok: Any = None  # IncrementalDetokenizer; None in scheduler-only tests
    seed: int | None = None
    status: ReqStatus = ReqStatus.WAITING
    row: int | None = None
    kv_len: int = 0
    swa_evicted: int = 0
    finish_reason: str | None = None
    output_logprobs: list[dict[int, float]] | None = None
    num_retractions: int = 0
    inflight: int = 0
    extra: dict[str, Any] = field(default_factory=dict)  # timing for metrics
    # Prefix cache (scheduler/prefix.py): positions [0, cache_len) are the tree's, through the
    # locked path ending at cache_node (a TreeNode).
    cache_node: Any = None
    cache_len: int = 0
    swa_locked: bool = False
    swa_lo: int = 0  # with swa_locked: the path's nodes from this position on are SWA-locked
    prefill_end: int = 0  # len(ids) when admitted: the prefix handed to the tree once prefilled
    committed: bool = True  # False while prefilled K/V waits to be handed to the tree
    num_cached_tokens: int | None = None  # prompt tokens matched at the first admission
    last_appended: int = 0  # tokens the last committed step appended (several after a verify step)
    spec_drafted: int = 0  # speculative decoding: tokens drafted for this sequence
    spec_accepted: int = 0  # and accepted by the target
    # SamplingParams.prompt_logprobs (`swaserve/prompt_scores.py`): prompt positions [0, prompt_scored) are
    # scored by launched steps; entry j of prompt_lps / prompt_ranks is prompt token j + 1's.
    prompt_scored: int = 0
    prompt_lps: list[dict[int, float]] | None = None
    prompt_ranks: list[int] | None = None
    # Structured outputs: the sequence's grammar state (`grammar.SequenceGrammar`: `accept(token)`,
    # `terminated`); None when unconstrained. Advanced by every appended token; the launcher masks
    # each sampling row's logits with what it allows next.
    grammar: Any = None

    @property
    def output_ids(self) -> list[int]:
        return self.ids[self.prompt_len :]

    @property
    def scores_prompt(self) -> bool:
        """Whether prompt logprobs were asked for and some prompt position has no step launched to score it
        (only the first of n sequences scores: its siblings have the same prompt)."""
        return self.params.prompt_logprobs is not None and self.index == 0 and self.prompt_scored < self.prompt_len - 1

    @property
    def num_output(self) -> int:
        return len(self.ids) - self.prompt_len

    @property
    def pending(self) -> int:
        """Tokens (known or in flight) no step has been scheduled to compute K/V for; > 1 means
        prefill work is left."""
        return len(self.ids) + self.inflight - self.kv_len

    @property
    def num_sampled(self) -> int:
        """Output tokens sampled so far, the ones still in flight included."""
        return len(self.ids) + self.inflight - self.prompt_len

    def needs_decode(self, max_context: int) -> bool:
        """Whether another decode step is useful: False once the tokens sampled so far (in flight
        included) already reach max_tokens or the context limit, so the request ends by length as
        soon as they are processed."""
        n = len(self.ids) + self.inflight  # per request per step: no property calls
        return n - self.prompt_len < self.params.max_tokens and n < max_context

    @property
    def finished(self) -> bool:
        return self.status is ReqStatus.FINISHED

    def max_len(self, max_context: int) -> int:
        """Most tokens this sequence can ever have (bounded by max_tokens and the context)."""
        return min(self.prompt_len + self.params.max_tokens, max_context)

    def append_token(self, token: int, logprobs: dict[int, float] | None, max_context: int) -> None:
        """Record a sampled token and decide whether the sequence is done."""
        self.ids.append(token)
        if logprobs is not None:
            if self.output_logprobs is None:
                self.output_logprobs = []
            self.output_logprobs.append(logprobs)
        p = self.params
        g = self.grammar
        if g is not None:
            if g.ahead:  # `SequenceGrammar.appended` inlined (a call a row a step is ~15 us at 256 rows)
                g.ahead -= 1
            else:
                g.accept(token)
            if g.terminated:  # the grammar accepted a stop token: the output is complete
                self.finish_reason = "stop"
                return
        if (not p.ignore_eos and token in self.eos_ids) or (p.stop_token_ids and token in p.stop_token_ids):
            self.finish_reason = "stop"  # the stop token stays in token_ids but adds no text
            return
        if self.detok is not None:
            self.detok.step([token])
            if self.detok.stopped:
                self.finish_reason = "stop"
                return
        n = len(self.ids)
        if n - self.prompt_len >= p.max_tokens or n >= max_context:
            self.finish_reason = "length"
