"""Speculation: the scheduler's side of speculative decoding. `schedule` turns a decode step into a
verify step (each request's input token plus the tokens its drafter proposes, extend-shaped, windows
respected); `commit` appends what the target accepted and gives back the K/V slots of the rejected
drafts in both pools (the request table entries return to 0, `full_to_swa` entries are cleared by
the allocator), so out-of-window SWA freeing only ever counts accepted tokens. `speculates` says which
requests get drafts.

Runs without overlap scheduling: a verify step is scheduled after the previous step's tokens are in,
so a decoding request has `kv_len == len(ids) - 1` (its last token is the next input)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from swaserve.runner.forward_batch import ForwardMode
from swaserve.scheduler.batch import ScheduleBatch

if TYPE_CHECKING:
    from swaserve.request import SamplingParams
    from swaserve.scheduler.req import Req
    from swaserve.scheduler.scheduler import Scheduler


def speculates(params: SamplingParams) -> bool:
    """Requests that get drafts: those whose next-token distribution `speculative.verify.accept`
    reproduces: greedy, or temperature alone (no top-k/top-p/min-p, penalties or logprobs; those
    decode one token a step; so do rows with a logit_bias, whose verify would have to bias every drafted
    position's logits). Constrained rows (structured outputs) decode one token a step too: their drafts
    are not checked against the grammar."""
    if (params.logprobs is not None or params.uses_penalties or params.logit_bias
            or params.structured_outputs is not None):
        return False
    return params.is_greedy or (params.top_p >= 1.0 and params.top_k < 1 and params.min_p <= 0.0)


class Drafter(Protocol):
    """What a drafter implements. Optional: `attach(runtime)`, called once the target's runtime is
    built (drafters that read the target's pools or embeddings), and `observe(reqs, states,
    offsets, counts)`, which turns on `ModelRunner.keep_states` and is called after every target
    step with rows `offsets[i] .. offsets[i] + counts[i]` of `states` (device, valid during the
    call) holding the target's states for the tokens reqs[i] confirmed: its prefill chunk, its
    decode input, or its verify input plus the accepted drafts (the last row predicted the token
    the request appends, if it samples)."""

    def propose(self, reqs: list[Req], ks: list[int]) -> list[list[int]]:
        """Up to ks[i] tokens to follow reqs[i].ids."""
        ...

    def release(self, req: Req) -> None:
        """The request is done (finished, aborted or retracted): drop any state kept for it."""
        ...


class Speculation:
    """`k` tokens drafted per request, in steps of at most `max_batch` decoding requests (larger
    batches decode plainly: the step is compute-bound there and a rejected draft costs real work).
    Counts drafted and accepted tokens (`spec_draft_tokens_total`, `spec_accepted_tokens_total`)."""

    def __init__(self, drafter: Drafter, k: int, max_batch: int):
        self.drafter, self.k, self.max_batch = drafter, k, max_batch
        self.drafted_total = 0
        self.accepted_total = 0

    def release(self, req: Req) -> None:
        self.drafter.release(req)

    def schedule(self, sched: Scheduler, reqs: list[Req]) -> ScheduleBatch | None:
        """A verify batch for `reqs` (the requests due a decode), or None: decode them plainly (batch
        too large, nothing drafted, or not enough free slots for the drafts)."""
        if len(reqs) > self.max_batch:
            return None
        ks = []
        for r in reqs:
            assert r.inflight == 0 and r.kv_len == len(r.ids) - 1, "speculation runs without overlap scheduling"
            room = min(r.params.max_tokens - r.num_output, sched.max_context - len(r.ids)) - 1
            ks.append(min(self.k, room) if speculates(r.params) else 0)
        drafts = self.drafter.propose(reqs, ks) if any(ks) else [[] for _ in reqs]
        drafts = [d[:k] for d, k in zip(drafts, ks)]
        need = len(reqs) + sum(len(d) for d in drafts)
        if not any(drafts) or sched.slots.available() < need:
            return None
        slots = sched.slots.alloc(need)
        prefix = [r.kv_len for r in reqs]
        lens = [1 + len(d) for d in drafts]
        rows = [r.row for r, n in zip(reqs, lens) for _ in range(n)]
        positions = [p for r, n in zip(reqs, lens) for p in range(r.kv_len, r.kv_len + n)]
        sched.table.write_tokens(rows, positions, slots)  # type: ignore[arg-type]  (one copy)
        for r, n in zip(reqs, lens):
            r.kv_len += n
            r.inflight += 1
        return ScheduleBatch(ForwardMode.EXTEND, reqs, prefix, lens, slots, [True] * len(reqs),
                             num_decode=len(reqs), drafts=drafts)

    def commit(self, sched: Scheduler, batch: ScheduleBatch, tokens: list[list[int]],
               logprobs: list[dict[int, float] | None] | None) -> list[Req]:
        """`tokens[j]`: what sampling row j (`batch.sample_indices()`) appends: accepted drafts and one
        token from the target for a verify row, the sampled token for a prefill row. The sequences
        advanced."""
        assert batch.drafts is not None
        nv = len(batch.drafts)
        progressed: list[Req] = []
        rejected: list[tuple[int, int, int]] = []  # (row, first, end) of rejected drafts' K/V
        for j, i in enumerate(batch.sample_indices()):
            r = batch.reqs[i]
            if r.finished:
                continue
            r.inflight -= 1
            appended = 0
            for t in tokens[j]:
                lp = logprobs[j] if logprobs and len(tokens[j]) == 1 else None
                r.append_token(t, lp, sched.max_context)
                appended += 1
                if r.finish_reason is not None:
                    break
            r.last_appended = appended
            sched.generated_total += appended
            if i < nv:
                drafted, accepted = len(batch.drafts[i]), len(tokens[j]) - 1
                r.spec_drafted += drafted
                r.spec_accepted += accepted
                self.drafted_total += drafted
                self.accepted_total += accepted
                keep, end = batch.prefix_lens[i] + appended, batch.prefix_lens[i] + batch.extend_lens[i]
                if end > keep and r.row is not None:
                    rejected.append((r.row, keep, end))
                    r.kv_len = keep
            progressed.append(r)
        self._free_rejected(sched, rejected)
        for r in progressed:
            if r.finish_reason is not None:
                sched._finish(r)
        sched.slots.evict_due(batch.reqs)
        return progressed

    @staticmethod
    def _free_rejected(sched: Scheduler, rejected: list[tuple[int, int, int]]) -> None:
        """Give back the rejected drafts' slots in both pools and zero their table entries (one
        free, one table copy for the whole batch)."""
        if not rejected:
            return
        sched.allocator.free(torch.cat([sched.table.slots(row, a, b) for row, a, b in rejected]))
        rows = [row for row, a, b in rejected for _ in range(a, b)]
        positions = [p for _, a, b in rejected for p in range(a, b)]
        sched.table.write_tokens(rows, positions, torch.zeros(len(positions), dtype=torch.int32))
