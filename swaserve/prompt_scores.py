"""Prompt logprobs (`SamplingParams.prompt_logprobs`): which of a step's prefill tokens predict a prompt token
whose logprob was asked for (`plan`), their LM-head logits scored on the device (`PromptPlan.score`), and
the host-side results recorded into each request (`PromptScores.record`).

A chunk of positions [p, p + n) predicts prompt tokens p + 1 .. p + n: the hidden state at position q
gives the logprob of `ids[q + 1]`. Positions are planned once, at launch (`Req.prompt_scored` is the
launch-side frontier), so a request retracted and recomputed is not scored twice; a request that still
has positions to score matches no cached prefix (`PrefixSharing.match`), since a cached prefix's logits
were never kept."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from swaserve.h2d import to_device
from swaserve.runner.forward_batch import ForwardMode

if TYPE_CHECKING:
    from swaserve.scheduler.batch import ScheduleBatch
    from swaserve.scheduler.req import Req

SCORE_ROWS = 256  # LM-head rows per pass: 256 x 262,144 float32 logits (Gemma) is 268 MB


@dataclass
class PromptPlan:
    """The prompt positions one step scores: `token_indices` into the step's tokens, the prompt token each
    predicts, and per request (req, first position, count) in that order; `top`: the largest top-k asked."""

    token_indices: list[int]
    targets: list[int]
    jobs: list[tuple[Req, int, int]]
    top: int

    def score(self, runner: Any, hidden: torch.Tensor) -> PromptScores:
        """`hidden`: `[len(token_indices), H]` final states. Logits, log-softmax and ranks on the device, in
        passes of SCORE_ROWS rows; the results are copied to the host without waiting (pinned on CUDA: valid
        once the launcher's event fired). The logits are the model's own: no logit bias or penalty."""
        targets = to_device(torch.tensor(self.targets, dtype=torch.int64), hidden.device)
        chosen, ranks, top_vals, top_ids = [], [], [], []
        for lo in range(0, hidden.shape[0], SCORE_ROWS):
            logp = torch.log_softmax(runner.logits(hidden[lo : lo + SCORE_ROWS]).float(), dim=-1)  # [m, vocab]
            tgt = logp.gather(1, targets[lo : lo + SCORE_ROWS, None])  # [m, 1]
            chosen.append(tgt.squeeze(1))
            ranks.append((logp > tgt).sum(dim=-1) + 1)  # ties share the better rank
            if self.top:
                vals, ids = logp.topk(self.top, dim=-1)
                top_vals.append(vals)
                top_ids.append(ids)
        tensors = [torch.cat(chosen), torch.cat(ranks)]
        if self.top:
            tensors += [torch.cat(top_vals), torch.cat(top_ids)]
        if hidden.is_cuda:
            tensors = [t.to("cpu", non_blocking=True) for t in tensors]
        return PromptScores(self, tensors)


@dataclass
class PromptScores:
    """One step's scored prompt positions (host tensors, valid once the step is done)."""

    plan: PromptPlan
    tensors: list[torch.Tensor]  # chosen [m] float32, ranks [m] int64, (top values [m, k], top ids [m, k])

    def record(self) -> None:
        """Append each request's new positions: {token: logprob} of its top-k plus the prompt's token,
        and that token's rank (`Req.prompt_lps`, `Req.prompt_ranks`)."""
        chosen, ranks = self.tensors[0].tolist(), self.tensors[1].tolist()
        top_vals = self.tensors[2].tolist() if self.plan.top else None
        top_ids = self.tensors[3].tolist() if self.plan.top else None
        row = 0
        for req, _, count in self.plan.jobs:
            k = req.params.prompt_logprobs or 0
            if req.prompt_lps is None:
                req.prompt_lps, req.prompt_ranks = [], []
            for j in range(row, row + count):
                entry = dict(zip(top_ids[j][:k], top_vals[j][:k])) if k and top_ids and top_vals else {}
                entry.setdefault(self.plan.targets[j], chosen[j])
                req.prompt_lps.append(entry)
                req.prompt_ranks.append(ranks[j])
            row += count


def plan_prompt(batch: ScheduleBatch) -> PromptPlan | None:
    """The prompt positions of `batch` still to score (advancing each request's `prompt_scored`), or None
    when no request in it asked for prompt logprobs. A decode step owes none (every prompt position was
    launched in a prefill chunk before its request decodes): no per-row scan on the decode hot path."""
    if batch.mode is ForwardMode.DECODE:
        return None
    indices: list[int] = []
    targets: list[int] = []
    jobs: list[tuple[Req, int, int]] = []
    off = 0
    for r, p, n in zip(batch.reqs, batch.prefix_lens, batch.extend_lens):
        if r.scores_prompt:
            assert p <= r.prompt_scored, "prompt positions skipped: a prompt-logprob request matched the cache"
            lo, hi = r.prompt_scored, min(p + n, r.prompt_len - 1)
            if hi > lo:
                indices.extend(range(off + lo - p, off + hi - p))
                targets.extend(r.ids[lo + 1 : hi + 1])
                jobs.append((r, lo, hi - lo))
                r.prompt_scored = hi
        off += n
    if not jobs:
        return None
    return PromptPlan(indices, targets, jobs, max(r.params.prompt_logprobs or 0 for r, _, _ in jobs))
