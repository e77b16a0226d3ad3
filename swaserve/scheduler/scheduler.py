"""Scheduler: waiting/running queues, chunked prefill under a token budget, decode batches, SWA
freeing every step, prefix-cache reuse, and retraction when memory runs out."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Protocol

import torch

from swaserve.config import SchedulerConfig
from swaserve.memory.req_to_token import ReqToTokenPool
from swaserve.memory.window import SWAEvictor
from swaserve.prefix_cache import RadixCache
from swaserve.runner.forward_batch import ForwardMode
from swaserve.scheduler.batch import ScheduleBatch
from swaserve.scheduler.prefix import PrefixSharing
from swaserve.scheduler.req import Req, ReqStatus
from swaserve.scheduler.slots import SlotAllocator, SlotBudget, check_fits


class Speculator(Protocol):
    """What the scheduler calls on its speculation (`speculate.Speculation`, set by the engine)."""

    drafted_total: int
    accepted_total: int

    def schedule(self, sched: Scheduler, reqs: list[Req]) -> ScheduleBatch | None: ...
    def commit(self, sched: Scheduler, batch: ScheduleBatch, tokens: list[list[int]],
               logprobs: list | None) -> list[Req]: ...
    def release(self, req: Req) -> None: ...


class Scheduler:
    """Decides what each step computes and owns every request's memory.

    Policy (`schedule_policy`): "mixed" (default) gives every step a decode row for each running
    request first, then prefill chunks under what is left of the `max_prefill_tokens` budget (at most
    `max_mixed_prefill_tokens` of them while anything decodes), in one extend batch (a decode row is
    an extend row of one new token on its prefix), so arriving prompts never stall running streams
    and a burst of them lengthens their steps only so much; a step without prefill work is a plain
    decode batch (graphs). With "prefill_first" a step prefills only (no decode) while prompts wait,
    and decodes otherwise. Prefill is FIFO; a prompt that does not fit the budget is chunked across
    steps, and at most one request is mid-prefill: it stays at the head of `waiting`. When a decode
    step cannot get a slot per request, the most recently admitted requests are retracted (memory freed,
    re-queued at the front, recomputed later with their output so far), so no request starves and
    a lone request always fits (admission checks it against the whole pool).

    Overlap: `schedule()` may run while the previous step is still on the device. It commits K/V
    lengths at schedule time and needs no sampled token values (a decode reads its input token on
    the device); a request that ends by EOS or a stop string in the step in flight may be scheduled
    once more, and that step's result for it is dropped. Memory freed meanwhile may be handed out
    again at once: every later write to it is enqueued after the launched steps that read it.

    Prefix cache (`prefix_cache`, scheduler/prefix.py): a new request starts after the longest
    usable cached prefix of its tokens and allocates only the rest; its prompt goes to the tree once
    prefilled, and everything it computed when it ends. Memory counts unlocked cache as available:
    an allocation that does not fit evicts cache (SWA parts first, then LRU leaves) before any
    request is retracted.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        max_context: int,
        req_to_token: ReqToTokenPool,
        allocator: SlotAllocator,
        evictor: SWAEvictor | None,
        prefix_cache: RadixCache | None = None,
        check: Callable[[Scheduler], None] | None = None,  # integrity.check_scheduler, for check_integrity()
    ):
        self.config = config
        self.max_context = max_context
        self.table = req_to_token
        self.allocator = allocator
        self.evictor = evictor
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.retractions_total = 0
        self._arrivals = 0
        self.prefix = (PrefixSharing(prefix_cache, req_to_token, evictor)
                       if prefix_cache is not None else None)
        self.slots = SlotBudget(allocator, evictor, self.prefix)
        self.speculation: Speculator | None = None  # set by the engine (scheduler/speculate.py)
        self.check = check
        self.generated_total = 0  # output tokens committed

    # -- admission ---------------------------------------------------------------------------

    def check_fits(self, prompt_len: int, max_tokens: int) -> None:
        """Raise ValueError for a request that could never run, instead of letting it wait forever."""
        check_fits(prompt_len, max_tokens, self.max_context, getattr(self.allocator, "full", self.allocator).size)

    def add(self, req: Req) -> None:
        self.check_fits(req.prompt_len, req.params.max_tokens)
        req.arrival = self._arrivals
        self._arrivals += 1
        self.waiting.append(req)

    def abort(self, group_id: str) -> list[Req]:
        """Finish every sequence of `group_id` at whatever stage it is, freeing its memory."""
        hit = [r for r in (*self.waiting, *self.running) if r.group_id == group_id]
        for r in hit:
            r.finish_reason = "abort"
            self._finish(r)
        return hit

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- scheduling --------------------------------------------------------------------------

    def schedule(self) -> ScheduleBatch | None:
        # With a step in flight its results (and the freeing after them) come later: free what the
        # launched steps have already moved out of the window before allocating for the next one.
        mid = (self.waiting[0],) if self.waiting and self.waiting[0].kv_len else ()
        if self.prefix is not None:
            self.prefix.commit()
            self.prefix.release_swa_locks((*self.running, *mid))
        self.slots.evict_due(self.running)
        if mid:
            self.slots.evict_due(mid)
        budget = self.config.max_prefill_tokens
        if self.config.schedule_policy == "prefill_first":
            return self._schedule_extend(budget) or self._schedule_decode()
        decode = self._schedule_decode()  # decode first: its slots are taken before any prefill's
        if decode is not None:
            budget -= decode.num_tokens
            if self.config.max_mixed_prefill_tokens is not None:
                budget = min(budget, self.config.max_mixed_prefill_tokens)
        extend = self._schedule_extend(budget) if self.waiting and budget > 0 else None
        if extend is None or decode is None:
            return extend or decode
        return ScheduleBatch(
            ForwardMode.EXTEND, decode.reqs + extend.reqs, decode.prefix_lens + extend.prefix_lens,
            decode.extend_lens + extend.extend_lens, torch.cat([decode.out_cache_loc, extend.out_cache_loc]),
            decode.sample + extend.sample, num_decode=len(decode.reqs), drafts=decode.drafts,
        )

    def _schedule_extend(self, budget: int) -> ScheduleBatch | None:
        reqs: list[Req] = []
        prefix: list[int] = []
        ext: list[int] = []
        locs: list[torch.Tensor] = []
        sample: list[bool] = []
        while self.waiting and budget > 0:
            req = self.waiting[0]
            if req.inflight:
                break  # retracted while its last token was in flight: recompute once the host has it
            if req.row is None:
                if len(self.running) >= self.config.max_running_requests or not self.table.available():
                    break
                # A new admission starts after its cached prefix, leaves room for every running
                # request's next decode token, and only starts if the rest of its prompt fits the
                # full pool: admitting a prompt that cannot finish prefilling would only be
                # retracted again (SWA slots are recycled as the prefill advances, so only the
                # chunk counts there).
                m = self.prefix.match(req) if self.prefix is not None else 0
                reserve = len(self.running)
                n = min(req.pending - m, budget, self.slots.available() - reserve)
                if (self.slots.full_available() - reserve < req.pending - m or n <= 0
                        or (self.prefix is not None and self.prefix.should_wait(req, m, reqs))):
                    if self.prefix is not None:
                        self.prefix.unmatch(req)
                    break
                req.row = self.table.alloc()
                assert req.row is not None
                if self.prefix is not None:
                    self.prefix.start(req)
            else:
                n = min(req.pending, budget, self.slots.available())
                if n <= 0:
                    break
            slots = self.slots.alloc(n)
            self.table.write(req.row, req.kv_len, slots)
            reqs.append(req)
            prefix.append(req.kv_len)
            ext.append(n)
            locs.append(slots)
            budget -= n
            req.kv_len += n
            if req.pending:
                sample.append(False)
                break  # the chunked request stays at the head; nobody overtakes it
            # The prompt is complete: its last token samples, and the request decodes from the
            # next step on (reading that token on the device if the host has not seen it yet).
            self.waiting.popleft()
            if self.prefix is not None:
                self.prefix.prefilled(req)
            sample.append(True)
            req.inflight += 1
            req.status = ReqStatus.RUNNING
            self.running.append(req)
        if not reqs:
            return None
        return ScheduleBatch(ForwardMode.EXTEND, reqs, prefix, ext, torch.cat(locs), sample)

    def _schedule_decode(self) -> ScheduleBatch | None:
        # Requests whose in-flight tokens already end them by length sit this step out.
        reqs = [r for r in self.running if r.needs_decode(self.max_context)]
        if not reqs:
            return None
        if self.speculation is not None:
            verify = self.speculation.schedule(self, reqs)
            if verify is not None:
                return verify
        while self.slots.available() < len(reqs):
            if len(reqs) > 1:
                victim = reqs.pop()
                self.running.remove(victim)
                self._retract(victim)
            elif self.waiting and self.waiting[0].kv_len > 0:
                self._retract(self.waiting.popleft())  # a lone request takes back the prefill's memory
            else:
                # Only memory of requests that finish when the step in flight is processed is
                # missing (a lone request always fits: checked at admission); wait for it.
                assert len(reqs) < len(self.running), "a lone request always fits (checked at admission)"
                return None
        bs = len(reqs)
        slots = self.slots.alloc(bs)
        prefix = [r.kv_len for r in reqs]
        self.table.write_tokens([r.row for r in reqs], prefix, slots)  # type: ignore[misc]
        for r in reqs:
            r.kv_len += 1
            r.inflight += 1
        return ScheduleBatch(ForwardMode.DECODE, reqs, prefix, [1] * bs, slots, [True] * bs)

    # -- results -----------------------------------------------------------------------------

    def process_output(
        self, batch: ScheduleBatch, tokens: list[int], logprobs: list[dict[int, float] | None] | None = None
    ) -> list[Req]:
        """Commit a launched step's sampled tokens (aligned with `batch.sample_indices()`): append
        them, finish what is done, free out-of-window SWA slots. K/V lengths already advanced when
        the step was scheduled. Requests aborted since the launch are skipped; a request retracted
        since then keeps its token (it was computed before the memory was taken back)."""
        if batch.drafts is not None:
            assert self.speculation is not None
            return self.speculation.commit(self, batch, tokens, logprobs)  # type: ignore[arg-type]
        progressed: list[Req] = []
        for j, i in enumerate(batch.sample_indices()):
            r = batch.reqs[i]
            if r.finished:
                continue
            r.inflight -= 1
            r.append_token(tokens[j], logprobs[j] if logprobs else None, self.max_context)
            r.last_appended = 1
            self.generated_total += 1
            if r.finish_reason is not None:
                self._finish(r)
            progressed.append(r)
        self.slots.evict_due(batch.reqs)
        return progressed

    # -- memory ------------------------------------------------------------------------------

    def reset_prefix_cache(self) -> None:
        """Drop every cached prefix no running request holds."""
        if self.prefix is not None:
            from swaserve.prefix_cache import evict_all

            evict_all(self.prefix.cache)

    def _release(self, req: Req) -> None:
        if self.speculation is not None:
            self.speculation.release(req)
        if req.row is None:
            return
        if self.prefix is not None:
            self.prefix.release(req, self.allocator.free)
        else:
            self.allocator.free(self.table.slots(req.row, 0, req.kv_len))
        self.table.free(req.row)
        req.row = None
        req.kv_len = 0
        req.swa_evicted = 0

    def _finish(self, req: Req) -> None:
        self._release(req)
        if req.status is ReqStatus.RUNNING:
            self.running.remove(req)
        elif req.status is ReqStatus.WAITING:
            self.waiting.remove(req)
        req.status = ReqStatus.FINISHED

    def _retract(self, req: Req) -> None:
        self._release(req)
        req.status = ReqStatus.WAITING
        req.num_retractions += 1
        self.retractions_total += 1
        # Behind a mid-prefill head request, so that at most one request is ever mid-prefill.
        head_busy = bool(self.waiting) and self.waiting[0].kv_len > 0 and self.waiting[0] is not req
        self.waiting.insert(1 if head_busy else 0, req)

    def check_integrity(self) -> None:
        """Pools consistent with exactly the slots the live requests hold; queues consistent (the
        `check` given at construction: the check imports the scheduler, never the reverse)."""
        assert self.check is not None, "built without check= (scheduler.integrity.check_scheduler)"
        self.check(self)
