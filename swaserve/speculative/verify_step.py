"""launch_verify: one speculative verify step on the device: the target's forward over every request's
input and drafted tokens, the logits of all of them, acceptance per request (`verify.accept`), and the
last token each request appended stored where its next decode step reads its input. Synchronous (the
acceptance needs the logits on the host); speculation runs without overlap scheduling. The engine plugs
it into the launcher (`StepLauncher.verify`)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from swaserve.h2d import to_device
from swaserve.scheduler.speculate import speculates
from swaserve.speculative.verify import accept

if TYPE_CHECKING:
    from swaserve.launcher import StepLauncher
    from swaserve.prompt_scores import PromptScores
    from swaserve.scheduler.batch import ScheduleBatch
    from swaserve.scheduler.req import Req


@dataclass
class VerifiedStep:
    """A finished verify step, shaped like `LaunchedStep`: `wait()` gives, per sampling row
    (`batch.sample_indices()` order), the tokens it appends, and logprobs where a row asked (rows
    that ask decode one token: `scheduler.speculate.speculates`)."""

    batch: ScheduleBatch
    reqs: list[Req]
    tokens: list[list[int]]
    logprobs: list[dict[int, float] | None] | None
    prompt: PromptScores | None = None  # prompt logprobs its prefill chunks scored
    constrained = False  # its tokens advance grammars as they are appended (several a row)

    def wait(self) -> tuple[list[list[int]], list[dict[int, float] | None] | None]:
        return self.tokens, self.logprobs


def launch_verify(launcher: StepLauncher, batch: ScheduleBatch) -> VerifiedStep:
    runner, device = launcher.runner, launcher.device
    assert batch.drafts is not None
    inputs = batch.forward_inputs()
    idx = batch.sample_indices()
    nv = len(batch.drafts)
    ends = list(itertools.accumulate(batch.extend_lens))
    drafted = [i < nv and speculates(batch.reqs[i].params) for i in idx]
    spec = [i for i, d in zip(idx, drafted) if d]
    plain = [i for i, d in zip(idx, drafted) if not d]
    sel = [t for i in spec for t in range(ends[i] - batch.extend_lens[i], ends[i])] + [ends[i] - 1 for i in plain]
    n_spec = len(sel) - len(plain)
    if launcher.lead is not None:  # tensor parallelism: the other ranks run the same forward and LM-head calls
        heads = ([[n_spec, len(plain)]] if plain else []) + ([[0, n_spec]] if spec else [])
        launcher.lead.send(inputs, idx, sel, heads)
    fb = inputs.build(device)
    # (prompt logprobs are refused under tensor parallelism: the ranks would not score with rank 0)
    hidden, prompt = launcher.forward_scoring(batch, fb, to_device(torch.tensor(sel, dtype=torch.int64), device))
    out: dict[int, list[int]] = {}
    lps: dict[int, dict[int, float] | None] = {}
    if plain:
        reqs = [batch.reqs[i] for i in plain]
        rows = fb.req_pool_indices[to_device(torch.tensor(plain), device)]
        sampled, asked = launcher.sample(hidden[n_spec:], reqs, rows)
        for i, t in zip(plain, sampled.next_token_ids.tolist()):
            out[i] = [t]
        if asked is not None:
            lps.update(zip(plain, sampled.logprob_dicts(asked)))
    if spec:
        # All greedy (the common case): the LM head's argmax, no logits; else logits for every row. Under
        # tensor parallelism the ranks were told to gather logits (`heads`): their argmax then.
        all_greedy = all(batch.reqs[i].params.is_greedy for i in spec)
        logits = None if all_greedy and launcher.lead is None else runner.logits(hidden[:n_spec])
        greedy = (runner.greedy_tokens(hidden[:n_spec]) if logits is None else logits.argmax(dim=-1)).tolist()
        off = 0
        for i in spec:
            n, r = batch.extend_lens[i], batch.reqs[i]
            rows = logits[off : off + n] if logits is not None and not all_greedy else None
            out[i] = accept(rows, batch.drafts[i], r.params, len(r.ids), greedy[off : off + n])
            off += n
    if launcher.observer is not None:  # the states of each row's kept inputs
        starts = [e - n for e, n in zip(ends, batch.extend_lens)]
        kept = [len(out[i]) if i < nv else n for i, n in enumerate(batch.extend_lens)]
        launcher.observe(batch.reqs, starts, kept)
    rows = fb.req_pool_indices[to_device(torch.tensor(idx), device)]
    last = to_device(torch.tensor([out[i][-1] for i in idx], dtype=torch.int64), device)
    if launcher.lead is not None:
        launcher.lead.share(last)
    runner.record_sampled(rows, last)
    logprobs = [lps.get(i) for i in idx] if lps else None
    return VerifiedStep(batch, [batch.reqs[i] for i in idx], [out[i] for i in idx], logprobs, prompt)
