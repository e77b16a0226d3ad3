"""StepLauncher: puts one scheduled step on the device without waiting for it (model, sampling, the
last-token table, an asynchronous copy of the sampled tokens to the host); `LaunchedStep.wait()`
collects the result. With one step in flight the host schedules the next while the device works.
Above both the scheduler (whose batches it launches) and the runner (which it drives). A step in flight
is a `launched_step.LaunchedStep`."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from swaserve.grammar import MaskJob, MaskRows, PendingAccept, TokenMasks, start_fill
from swaserve.h2d import to_device
from swaserve.launched_step import LaunchedStep, SamplePlan
from swaserve.prompt_scores import PromptScores, plan_prompt
from swaserve.runner.sampler import Sampler, SamplerOutput
from swaserve.runner.sampling_batch import SamplingBatch, distinct_params, is_plain_greedy
from swaserve.runner.token_mask import apply_token_bitmask

if TYPE_CHECKING:
    from swaserve.distributed.lead import StepLead
    from swaserve.runner.model_runner import ModelRunner
    from swaserve.scheduler.batch import ScheduleBatch
    from swaserve.scheduler.req import Req


class StepLauncher:
    """Launches scheduled steps on the runner's device: the only code that moves sampled tokens
    between the device and the host. Nothing here waits on the device. Under tensor parallelism
    (`lead`, rank 0) each step's inputs go to the other ranks first and its tokens after sampling."""

    def __init__(self, runner: ModelRunner, lead: StepLead | None = None, sampler: Sampler | None = None,
                 verify: Callable[[StepLauncher, ScheduleBatch], Any] | None = None):
        self.runner = runner
        self.lead = lead
        self.sampler = sampler or Sampler(batch_invariant=runner.deterministic)
        self.device = runner.device
        self.vocab_size = runner.model_config.vocab_size
        # A drafter that reads the target's states (`Drafter.observe`, scheduler/speculate.py):
        # given every step's states of the tokens each request confirmed. Setting it turns on
        # `runner.keep_states`.
        self.observer: Any = None
        # Launches the batches that carry drafts (speculative verify steps; `speculative/verify_step.py`),
        # plugged in by whoever turns speculation on: the launcher imports no speculative code.
        self.verify = verify
        self.prompt_tokens_scored = 0  # prompt positions whose logprobs were computed (the LM head's extra rows)
        self.mask_fill_seconds = 0.0  # host time filling structured outputs' token masks (a worker's, mostly)
        self.mask_wait_seconds = 0.0  # time the step loop waited for masks to be filled
        self.masked_rows = 0  # rows sampled under a grammar's mask
        self.grammar_rejected = 0  # tokens refused by accepts the mask worker made (`PendingAccept`)
        self._mask_rows: MaskRows | None = None  # the host buffer masks are filled into (made on first use)
        self.grammar_threads: int | None = None  # most xgrammar threads per fill (None: `fill_threads`' default)

    def set_observer(self, observer: Any) -> None:
        self.observer = observer
        self.runner.keep_states = observer is not None

    def launch(self, batch: ScheduleBatch) -> LaunchedStep:
        if batch.drafts is not None:  # a speculative verify step
            assert self.verify is not None, "a batch with drafts needs StepLauncher(verify=launch_verify)"
            return self.verify(self, batch)
        inputs = batch.forward_inputs()
        idx = batch.sample_indices()
        # Which LM-head path sampling takes: under tensor parallelism the ranks join its collective,
        # so it is fixed now and sent with the step (one rank: decided when sampling, no extra pass).
        head_greedy = None
        if self.lead is not None:
            head_greedy = self.head_greedy([batch.reqs[i] for i in idx])
            self.lead.send(inputs, idx, greedy=head_greedy)
        fb = inputs.build(self.device)
        hidden, prompt = self.forward_scoring(batch, fb)  # [bs, hidden]
        if self.observer is not None:
            offsets = list(itertools.accumulate(batch.extend_lens, initial=0))[:-1]
            self.observe(batch.reqs, offsets, batch.extend_lens)
        if not idx:
            return LaunchedStep(batch, [], None, None, self._event() if prompt is not None else None, prompt)
        reqs = [batch.reqs[i] for i in idx]
        rows = fb.req_pool_indices
        if len(idx) != len(batch.reqs):
            sel = to_device(torch.tensor(idx), self.device)
            hidden, rows = hidden[sel], rows[sel]
        constrained = any(r.grammar is not None for r in reqs)
        step = LaunchedStep(batch, reqs, None, None, None, prompt, deferred=(hidden, rows), head_greedy=head_greedy,
                            constrained=constrained)
        # Overlap: a constrained row's mask needs the token its previous step (still in flight) picks.
        # The model runs now; the engine samples once it has committed that step.
        if not (constrained and any(r.grammar is not None and r.inflight > 1 for r in reqs)):
            self.sample_deferred(step)
        return step

    def start_masks(self, step: LaunchedStep, accept: PendingAccept | None = None, same_rows: bool = False) -> None:
        """A deferred step's grammars have accepted the tokens before it (the rest of that step is not yet
        committed), or taken them as accepted (`accept`: the worker makes xgrammar's call first): start
        filling its masks on the worker thread, while the step loop commits, schedules the next step and
        the device runs this step's model. A row that ends with the step committing gets a mask it will
        not need; a row whose grammar ended gets none. `same_rows`: `step` runs the requests of the step
        whose tokens `accept` holds, in its order, so its live rows are the ones `accept_later` listed."""
        assert step.deferred is not None and step.masks is None
        if same_rows:
            assert accept is not None, "the rows `accept_later` listed"
            step.masks = start_fill(accept.live, self.vocab_size, self._mask_buffers(), True, self.grammar_threads,
                                    accept)
        else:
            step.masks = self._start_masks(step.reqs, background=True, accept=accept, constrained=step.constrained)
        if step.masks is None and accept is not None:  # no row left to fill: the accept alone, here
            accept.run()
            self.grammar_rejected += accept.rejected

    def prepare_deferred(self, step: LaunchedStep) -> None:
        """A deferred step's tokens before it are all committed: take what its sampling needs from the
        host (its masks fill since `start_masks`, or start now on the worker thread)."""
        assert step.deferred is not None and step.plan is None
        masks, step.masks = step.masks, None
        step.plan = self._prepare(step.reqs, step.deferred[1], background=True, masks=masks,
                                  constrained=step.constrained)

    def sample_deferred(self, step: LaunchedStep) -> None:
        """Sample a launched step's rows (under the masks of constrained rows, filled on the host while
        the device runs the model), record the tokens and start their copy to the host."""
        assert step.deferred is not None
        (hidden, rows), step.deferred = step.deferred, None
        plan, step.plan = step.plan or self._prepare(step.reqs, rows, background=False,
                                                     constrained=step.constrained), None
        out, step.asked = self._finish(hidden, plan, step.head_greedy)
        if self.lead is not None:
            self.lead.share(out.next_token_ids)
        self.runner.record_sampled(rows, out.next_token_ids)
        if self.device.type != "cuda":
            step.out = out
            return
        step.out = SamplerOutput(*(t.to("cpu", non_blocking=True) if t is not None else None for t in out))
        step.ready = self._event()

    def _event(self) -> torch.cuda.Event | None:
        if self.device.type != "cuda":
            return None
        ready = torch.cuda.Event()
        ready.record()
        return ready

    def forward_scoring(self, batch: ScheduleBatch, fb: Any,
                        extra: torch.Tensor | None = None) -> tuple[torch.Tensor, PromptScores | None]:
        """The step's forward: each request's last hidden state `[bs, H]` (or, given `extra` token indices,
        theirs), plus the prompt logprobs the step's prefill chunks owe (`swaserve/prompt_scores.py`),
        scored from the same forward."""
        plan = plan_prompt(batch)
        if plan is None:
            return self.runner.forward_hidden(fb, extra), None
        sel = fb.last_token_indices() if extra is None else extra
        more = to_device(torch.tensor(plan.token_indices, dtype=torch.int64), self.device)
        states = self.runner.forward_hidden(fb, torch.cat([sel, more]))
        self.prompt_tokens_scored += len(plan.token_indices)
        return states[: sel.numel()], plan.score(self.runner, states[sel.numel() :])

    def observe(self, reqs: list[Req], offsets: list[int], counts: list[int]) -> None:
        """Hand the drafter the states of the tokens each request confirmed this step: rows
        `offsets[i] .. offsets[i] + counts[i]` of `runner.step_states` (the last of them predicted
        the request's newest token when it sampled)."""
        states = self.runner.step_states
        assert states is not None, "runner.keep_states is off"
        self.observer.observe(reqs, states, offsets, counts)

    @staticmethod
    def head_greedy(reqs: list[Req]) -> bool:
        """Whether sampling `reqs` takes the LM head's greedy path (`runner.greedy_tokens`): every row
        plain greedy and none under a grammar. Decided at launch, before the rows' grammars can end."""
        return (bool(reqs) and not any(r.grammar is not None for r in reqs)
                and is_plain_greedy(distinct_params([r.params for r in reqs])))

    def sample(self, hidden: torch.Tensor, reqs: list[Req], rows: torch.Tensor,
               head_greedy: bool | None = None) -> tuple[SamplerOutput, list | None]:
        """Next tokens for `reqs` from their last hidden states (`rows`: their request-table rows):
        greedy straight from the LM head where every row is plain greedy, else through the
        sampling parameters; and each row's `logprobs` setting where any row asked for them.
        `head_greedy`: the path announced to the tensor-parallel ranks (`head_greedy`), which must be
        the one taken: False keeps greedy rows on the logits (None: the greedy path may be taken,
        except under tensor parallelism, where the ranks were told to gather logits)."""
        return self._finish(hidden, self._prepare(reqs, rows, background=False), head_greedy)

    def _prepare(self, reqs: list[Req], rows: torch.Tensor, background: bool,
                 masks: MaskJob | None = None, constrained: bool | None = None) -> SamplePlan:
        """The host's part of `sample`, which reads the requests' state as it is now. Structured outputs:
        the allowed-token bitmasks of the rows with a live grammar start filling (inline, or on the worker
        thread with `background`), unless `masks` is their fill already started. `constrained`: whether
        any row has a grammar, when the caller knows (None: looked up)."""
        params = [r.params for r in reqs]
        distinct = distinct_params(params)
        if masks is None and constrained is not False:
            masks = self._start_masks(reqs, background, constrained=constrained)
        greedy = is_plain_greedy(distinct)
        return SamplePlan(params, greedy, None if greedy else self._sampling_batch(reqs, params, distinct, rows), masks)

    def _start_masks(self, reqs: list[Req], background: bool, accept: PendingAccept | None = None,
                     constrained: bool | None = None) -> MaskJob | None:
        """The fill of `reqs`' masks (`start_fill`); `constrained`: whether any row has a grammar, when the
        caller knows (None: looked up, the one pass an unconstrained batch costs)."""
        if constrained is None:
            constrained = any(r.grammar is not None for r in reqs)
        if not constrained:
            return None
        return start_fill([None if r.finished else r.grammar for r in reqs], self.vocab_size, self._mask_buffers(),
                          background, self.grammar_threads, accept)

    def _mask_buffers(self) -> MaskRows:
        if self._mask_rows is None:
            self._mask_rows = MaskRows((self.vocab_size + 31) // 32)
        return self._mask_rows

    def _finish(self, hidden: torch.Tensor, plan: SamplePlan,
                head_greedy: bool | None = None) -> tuple[SamplerOutput, list | None]:
        """The device's part of `sample`. Plain greedy rows take the LM head's greedy path, their masks
        with them (no logits written on a GPU); other rows with masks need the logits, so they skip the
        LM head's sampling kernel (`head_greedy`: see `sample`)."""
        masks = None
        if plan.masks is not None:
            start = time.perf_counter()
            masks = plan.masks.result()
            self.mask_wait_seconds += time.perf_counter() - start
            self.mask_fill_seconds += plan.masks.fill_seconds
            self.masked_rows += len(masks.rows)
            self.grammar_rejected += plan.masks.rejected
        fast = head_greedy if head_greedy is not None else self.lead is None
        if plan.greedy and fast:  # the common case: no logits, no per-row host work (masked rows too)
            tokens = (self.runner.greedy_tokens(hidden) if masks is None
                      else self.runner.greedy_tokens(hidden, self._device_masks(masks)))
            return SamplerOutput(tokens, None, None, None), None
        if plan.greedy:  # tensor parallelism: the gathered (masked) logits' argmax (what the Sampler would take)
            logits = self.runner.logits(hidden) if masks is None else self._masked_logits(hidden, masks)
            return SamplerOutput(logits.argmax(dim=-1), None, None, None), None
        sb = plan.sb
        assert sb is not None
        # Temperature only: sampled in the LM head, masked rows too (not in deterministic mode: there every
        # draw goes through the Sampler, so a row's path does not depend on its neighbours' settings; nor
        # under tensor parallelism, where the head's logits are gathered first).
        if sb.inv_temperatures is not None and not self.runner.deterministic and self.lead is None:
            allowed = None if masks is None else self._device_masks(masks)
            out = SamplerOutput(self.runner.sample_tokens(hidden, sb.inv_temperatures, sb.seeds, allowed),
                                None, None, None)
        else:
            out = self.sampler(self.runner.logits(hidden) if masks is None else self._masked_logits(hidden, masks), sb)
        return out, ([p.logprobs for p in plan.params] if sb.max_num_logprobs is not None else None)

    def _masked_logits(self, hidden: torch.Tensor, masks: TokenMasks) -> torch.Tensor:
        """The rows' logits with every token their grammar disallows at -inf."""
        logits = self.runner.logits(hidden)
        apply_token_bitmask(logits, *self._device_masks(masks))
        return logits

    def _device_masks(self, masks: TokenMasks) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`(masks, rows)` on the device: only the constrained rows' masks cross (rows None: every row)."""
        rows = None if masks.every_row else to_device(torch.tensor(masks.rows), self.device)
        return self._mask_rows.upload(masks.masks, self.device), rows  # type: ignore[union-attr]

    def _sampling_batch(self, reqs: list[Req], params: list, distinct: list, rows: torch.Tensor) -> SamplingBatch:
        penalties = any(p.uses_penalties for p in distinct)
        none: list[list[int]] = [[]] * len(reqs)  # token lists are read only for penalties
        return SamplingBatch.build(
            params,
            [r.output_ids for r in reqs] if penalties else none,
            [r.ids[: r.prompt_len] for r in reqs] if penalties else none,
            self.vocab_size,
            self.device,
            sample_indices=[r.index for r in reqs],
            # This step's token is already counted in `inflight`; an earlier one may be too.
            step_indices=[r.num_sampled - 1 for r in reqs],
            unseen_tokens=self._unseen_tokens(reqs, rows) if penalties else None,
        )

    def _unseen_tokens(self, reqs: list[Req], rows: torch.Tensor) -> torch.Tensor | None:
        """`[n]` int64, device: the token each row sampled in the step still in flight (its input
        now, so the last-token table holds it), -1 where the host has seen every token."""
        pending = [r.inflight > 1 for r in reqs]
        if not any(pending):
            return None
        last = self.runner.last_tokens[rows]
        return torch.where(to_device(torch.tensor(pending), self.device), last, torch.full_like(last, -1))

