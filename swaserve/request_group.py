"""One user request inside the engine: its prompt and its n sequences (`RequestGroup`), what a step
added to each sequence (`SeqDelta`, the engine core's per-step report), and the `RequestOutput`
snapshot of a group."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from swaserve.request import CompletionOutput, ListSlice, RequestOutput
from swaserve.scheduler.req import Req


class SeqDelta(NamedTuple):
    """What one step added to one sequence (the engine core's per-step report; no cumulative lists)."""

    request_id: str  # the user's request id
    index: int  # which of its n sequences
    token_ids: list[int]  # the tokens this step appended
    logprobs: list[dict[int, float]] | None  # theirs, when asked for
    finish_reason: str | None  # set on the sequence's last delta
    # On the sequence's first delta only (None after): prompt tokens served from the prefix cache,
    # and the sampling seed in use (the request's own, or the one deterministic mode drew).
    cached_tokens: int | None = None
    seed: int | None = None
    # Speculative decoding: (drafted, accepted) tokens of this sequence so far; None: none drafted.
    spec: tuple[int, int] | None = None
    # First delta, SamplingParams.prompt_logprobs: ({token: logprob} per prompt token after the first, ranks).
    prompt_logprobs: tuple[list[dict[int, float]], list[int]] | None = None


@dataclass
class RequestGroup:
    """One user request: its prompt and its n sequences."""

    prompt: str | None
    prompt_ids: list[int]
    reqs: list[Req] = field(default_factory=list)
    seed: int | None = None  # the sampling seed in use (RequestOutput.seed)

    @property
    def finished(self) -> bool:
        for r in self.reqs:
            if not r.finished:
                return False
        return True


def prompt_logprobs_of(r: Req) -> tuple[list[dict[int, float]], list[int]] | None:
    """A sequence's prompt logprobs and ranks, once every prompt position is scored (None otherwise)."""
    if r.params.prompt_logprobs is None or r.index != 0 or len(r.prompt_lps or ()) < r.prompt_len - 1:
        return None
    return list(r.prompt_lps or ()), list(r.prompt_ranks or ())


def group_output(gid: str, group: RequestGroup, finished: bool) -> RequestOutput:
    """The group as a `RequestOutput`; running completions as O(1) snapshots of their append-only lists."""
    comps = []
    for r in group.reqs:
        ids: Any = r.ids[r.prompt_len :] if r.finished else ListSlice(r.ids, r.prompt_len, len(r.ids))
        lps = r.output_logprobs
        if lps is not None:
            lps = list(lps) if r.finished else ListSlice(lps, 0, len(lps))
        text = r.detok.text if r.detok is not None else ""
        comps.append(CompletionOutput(r.index, text, ids, lps, r.finish_reason))  # type: ignore[arg-type]
    cached = min(r.num_cached_tokens or 0 for r in group.reqs)
    scored = prompt_logprobs_of(group.reqs[0])
    return RequestOutput(gid, group.prompt, group.prompt_ids, comps, finished, num_cached_tokens=cached,
                         seed=group.seed, spec_draft_tokens=sum(r.spec_drafted for r in group.reqs),
                         spec_accepted_tokens=sum(r.spec_accepted for r in group.reqs),
                         prompt_logprobs=None if scored is None else [None, *scored[0]],
                         prompt_logprob_ranks=None if scored is None else [None, *scored[1]])


def group_outputs(group_ids: set[str], groups: dict[str, RequestGroup],
                  finished_only: bool = False) -> list[RequestOutput]:
    """The `RequestOutput`s of `group_ids` (only the finished ones with `finished_only`), in id order;
    finished groups leave `groups`."""
    outs = []
    for gid in sorted(group_ids):
        group = groups.get(gid)
        if group is None:
            continue
        finished = group.finished
        if finished or not finished_only:
            outs.append(group_output(gid, group, finished))
        if finished:
            del groups[gid]
    return outs


def seq_deltas(progressed: list[Req], groups: dict[str, RequestGroup]) -> list[SeqDelta]:
    """What a step added to each sequence it advanced (`r.last_appended` tokens, and their logprobs), O(1)
    each; the first delta of a sequence also carries its cached-prefix count, seed and prompt logprobs.
    Groups whose last sequence finished leave `groups`."""
    deltas = []
    for r in progressed:
        lps = r.output_logprobs
        n = r.last_appended
        first = len(r.ids) - r.prompt_len == n
        deltas.append(SeqDelta(r.group_id, r.index, r.ids[-n:], lps[-n:] if lps is not None else None,
                               r.finish_reason, (r.num_cached_tokens or 0) if first else None,
                               r.params.seed if first else None,
                               (r.spec_drafted, r.spec_accepted) if r.spec_drafted else None,
                               prompt_logprobs_of(r) if first else None))
        if r.finish_reason is not None:
            group = groups.get(r.group_id)
            if group is not None and group.finished:
                del groups[r.group_id]
    return deltas
