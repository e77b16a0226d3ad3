"""A step on its way through the device (`LaunchedStep`, what `launcher.StepLauncher.launch` returns) and
what sampling it needs from the host (`SamplePlan`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from swaserve.grammar import MaskJob
    from swaserve.prompt_scores import PromptScores
    from swaserve.runner.sampler import SamplerOutput
    from swaserve.runner.sampling_batch import SamplingBatch
    from swaserve.scheduler.batch import ScheduleBatch
    from swaserve.scheduler.req import Req


@dataclass
class SamplePlan:
    """What sampling a step's rows needs from the host, taken when the step's inputs are all known (for a
    deferred step: once the step before it committed, before the next one is scheduled); `masks` may
    still be filling."""

    params: list
    greedy: bool  # every row plain greedy
    sb: SamplingBatch | None  # None where greedy
    masks: MaskJob | None  # None: no row has a live grammar


@dataclass
class LaunchedStep:
    """A step on its way through the device. `reqs` are the requests that sample, in the order of
    `batch.sample_indices()`; `out` holds host tensors that are valid once `ready` has fired.
    `deferred`: the model ran but sampling waits (hidden states, request rows) until the host has seen
    the tokens a constrained row's mask depends on (`StepLauncher.sample_deferred`); `masks`: their fill,
    started as soon as those tokens were accepted, or taken as accepted (`StepLauncher.start_masks`); `plan`: its sampling
    prepared since (`StepLauncher.prepare_deferred`). `constrained`: some row samples under a grammar."""

    batch: ScheduleBatch
    reqs: list[Req]
    asked: list[int | None] | None  # each sampling row's `logprobs` setting; None: no row asked
    out: SamplerOutput | None  # on the host (pinned on CUDA); None when no row samples
    ready: torch.cuda.Event | None  # None: the copy was synchronous (CPU)
    prompt: PromptScores | None = None  # prompt logprobs scored in this step (record after `wait`)
    deferred: tuple[torch.Tensor, torch.Tensor] | None = None  # ([n, hidden], [n] int64 rows), device
    plan: SamplePlan | None = None
    head_greedy: bool | None = None  # the LM-head path sampling was announced to take (`StepLauncher.head_greedy`)
    constrained: bool = False
    masks: MaskJob | None = None

    def wait(self) -> tuple[list[int], list[dict[int, float] | None] | None]:
        """Block until the step is done; its sampled tokens and, if any row asked, logprobs."""
        assert self.deferred is None, "a deferred step samples (StepLauncher.sample_deferred) before wait()"
        if self.ready is not None:
            self.ready.synchronize()
        if self.out is None:
            return [], None
        tokens = self.out.next_token_ids.tolist()
        if self.asked is None:
            return tokens, None
        return tokens, self.out.logprob_dicts(self.asked)
