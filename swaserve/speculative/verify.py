"""What a verify step keeps: for each request, the drafted tokens the target agrees with and one more
token from the target (the correction at the first disagreement, or a bonus token after the last
draft). Greedy: the target's argmax, so the output equals plain decoding token for token. Sampling
(temperature only): the speculative-sampling rule for a deterministic drafter, which draws from the
target distribution exactly: accept draft d with probability p(d); on rejection draw from p with d
removed; after the last accepted draft draw from the next p. Which requests get drafts at all
(`scheduler.speculate.speculates`) is the scheduler's rule, chosen to match this one."""

from __future__ import annotations

import torch

from swaserve.request import SamplingParams


def _generator(seed: int | None, position: int) -> torch.Generator | None:
    """A draw per (seed, position): a seeded request repeats its tokens run after run."""
    if seed is None:
        return None
    return torch.Generator().manual_seed((seed * 1_000_003 + position) & ((1 << 63) - 1))


def accept(logits: torch.Tensor | None, drafts: list[int], params: SamplingParams, first_position: int,
           argmax: list[int] | None = None) -> list[int]:
    """`logits` `[len(drafts) + 1, vocab]` float32 (row i: after the input and drafts[:i]) -> the
    tokens to append, 1 to len(drafts) + 1 of them. `first_position`: the position the first of
    them will take (seeds the draws). `argmax`: the rows' argmax when the caller has it (greedy
    rows of a batch take it in one device-to-host copy; then `logits` may be None)."""
    if params.is_greedy:
        assert argmax is not None or logits is not None
        target = argmax if argmax is not None else logits.argmax(dim=-1).tolist()
        out = []
        for d, t in zip(drafts, target):
            out.append(t)
            if t != d:
                return out
        out.append(target[len(drafts)])
        return out
    assert logits is not None, "sampling needs the logits"
    probs = torch.softmax(logits.float().cpu() / params.temperature, dim=-1)
    out = []
    for i, d in enumerate(drafts):
        g = _generator(params.seed, first_position + i)
        p = probs[i]
        if float(torch.rand((), generator=g)) < float(p[d]):
            out.append(d)
            continue
        residual = p.clone()
        residual[d] = 0.0
        out.append(int(torch.multinomial(residual / residual.sum(), 1, generator=g)))
        return out
    g = _generator(params.seed, first_position + len(drafts))
    out.append(int(torch.multinomial(probs[len(drafts)], 1, generator=g)))
    return out
