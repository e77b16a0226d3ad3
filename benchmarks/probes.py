"""Greedy probes shared by the scripts that compare two ways of running one model (FP8 KV cache, FP8 weights,
deterministic mode): prompts of random token ids decoded greedily, their tokens and (optionally) logits
recorded for one variant at a time, and a variant compared with a reference run."""

from __future__ import annotations

import gc
from dataclasses import dataclass

import torch
from common import empty_cache


def random_prompts(n: int, lengths: tuple[int, int], vocab: int, seed: int = 0) -> list[list[int]]:
    """`n` prompts of random ids in [100, vocab) (above the special tokens), lengths drawn in `lengths`."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(100, vocab, (int(torch.randint(*lengths, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def drain(engine, reqs: list[tuple[str, list[int], object]]) -> dict[str, list[int]]:
    """Add `reqs` (id, prompt, SamplingParams) and step until every one finished: id -> output tokens."""
    for rid, prompt, params in reqs:
        engine.add_request(rid, prompt, params)
    out = {}
    while engine.has_unfinished():
        for o in engine.step(finished_only=True):
            out[o.request_id] = list(o.outputs[0].token_ids)
    return out


class WindowLogits:
    """A launcher observer (`StepLauncher.set_observer`, the drafters' interface: the final hidden states
    of every token a step computed) keeping, on the host, the float32 logits each request's positions
    `prompt_len - before .. prompt_len + after - 1` produce: the prompt's last `before` (teacher-forced:
    every run reads the same tokens there; the last one gives the first generated token) and the first
    `after` generated tokens' (comparable between runs while their generated tokens agree)."""

    def __init__(self, runner, before: int, after: int):
        self.runner, self.before, self.after = runner, before, after
        self.rows: dict[tuple[str, int], torch.Tensor] = {}  # (request id, position) -> [vocab] float32, host

    def observe(self, reqs, states: torch.Tensor, offsets: list[int], counts: list[int]) -> None:
        for r, off, n in zip(reqs, offsets, counts):
            start = r.kv_len - n  # this step computed positions start .. kv_len - 1
            lo, hi = max(start, r.prompt_len - self.before), min(r.kv_len, r.prompt_len + self.after)
            if lo < hi:
                logits = self.runner.logits(states[off + lo - start : off + hi - start]).float().cpu()
                self.rows.update({(r.group_id, lo + j): row for j, row in enumerate(logits)})

    def take(self, rid: str, prompt_len: int) -> torch.Tensor:
        """`[before + after, vocab]` float32: request `rid`'s rows, removed from the store."""
        positions = range(prompt_len - self.before, prompt_len + self.after)
        missing = [p for p in positions if (rid, p) not in self.rows]
        if missing:  # a prompt tail served from the prefix cache computes no states
            raise RuntimeError(f"no logits of request {rid} at positions {missing}: run with disable_prefix_cache")
        return torch.stack([self.rows.pop((rid, p)) for p in positions])


@dataclass
class ProbeRun:
    tokens: list[list[int]]  # each probe's greedy output
    logits: torch.Tensor | None  # [probes, before + after, vocab] float32, host (`WindowLogits`); None: not kept
    before: int = 0  # rows of `logits` that are prompt positions


def run_probes(engine, prompts: list[list[int]], max_tokens: int, logits: tuple[int, int] = (0, 0),
               alone: bool = False) -> ProbeRun:
    """Greedy `max_tokens` of every prompt on `engine`. `logits`: how many of the last prompt positions
    and first generated positions to keep the logits of (`WindowLogits`; the generated ones capped at
    `max_tokens - 1`: the last token is never read); `alone`: one prompt at a time (the control for what
    batch shape alone changes), else all of them in one batch."""
    from swaserve.request import SamplingParams

    before, after = logits[0], min(logits[1], max_tokens - 1)
    if before > min(len(p) for p in prompts):
        raise ValueError(f"logits of the last {before} prompt positions: a prompt is shorter")
    window = None
    if before or after:
        window = WindowLogits(engine.runner, before, after)
        engine.launcher.set_observer(window)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    reqs = [(str(i), p, params) for i, p in enumerate(prompts)]
    toks = {}
    for batch in ([r] for r in reqs) if alone else [reqs]:
        toks.update(drain(engine, batch))
    if window is not None:
        engine.launcher.set_observer(None)
    kept = None if window is None else torch.stack([window.take(str(i), len(p)) for i, p in enumerate(prompts)])
    return ProbeRun([toks[str(i)] for i in range(len(prompts))], kept, before)


def release(engine, dev: torch.device) -> None:
    """Close `engine` and hand its memory back now (its model too, where nothing else holds it)."""
    engine.close()
    gc.collect()
    empty_cache(dev)


def compare(ref: ProbeRun, got: ProbeRun) -> dict:
    """`got`'s greedy tokens and logits against `ref`'s (the same prompts): probes whose tokens are all
    identical, tokens equal position by position, where they first differ, the first token's agreement;
    with logits, |got - ref| / std of ref's row over the vocabulary (max and mean) and top-1 agreement at
    the prompt positions (teacher-forced) and at the generated positions before the first difference,
    and ref's median top-1 margin in stds (how close its greedy choices are)."""
    n = len(ref.tokens)
    pairs = list(zip(ref.tokens, got.tokens))
    first = [next((j for j, (a, b) in enumerate(zip(r, t)) if a != b), len(r)) for r, t in pairs]
    res = {"identical": sum(r == t for r, t in pairs), "probes": n,
           "token_agreement": round(sum(a == b for r, t in pairs for a, b in zip(r, t)) / sum(map(len, ref.tokens)), 4),
           "median_first_difference": sorted(first)[n // 2],
           "first_token_agreement": round(sum(r[0] == t[0] for r, t in pairs) / n, 4)}
    if ref.logits is None or got.logits is None:
        return res
    # Generated position j (0-based) reads generated token j: comparable while tokens 0..j agree.
    after = ref.logits.shape[1] - ref.before
    gen_ok = torch.arange(after)[None, :] < torch.tensor(first)[:, None]  # [probes, after]
    for part, sl, ok in (("prompt", slice(0, ref.before), None), ("generated", slice(ref.before, None), gen_ok)):
        a, b = ref.logits[:, sl], got.logits[:, sl]  # [probes, positions, vocab]
        if ok is not None:
            a, b = a[ok], b[ok]
        a, b = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
        if a.shape[0] == 0:
            continue
        std = a.std(dim=-1, keepdim=True)
        err = (b - a).abs() / std
        top2 = a.topk(2, dim=-1).values
        res[f"{part}_positions"] = a.shape[0]
        res[f"{part}_logit_err_max"] = round(err.max().item(), 4)
        res[f"{part}_logit_err_mean"] = round(err.mean().item(), 5)
        if ok is None:  # (generated positions are chosen where the tokens agree: top-1 agreement is biased)
            res[f"{part}_top1_agreement"] = round((a.argmax(-1) == b.argmax(-1)).float().mean().item(), 4)
        res[f"{part}_median_top1_margin"] = round(((top2[:, 0] - top2[:, 1]) / std[:, 0]).median().item(), 4)
    return res
