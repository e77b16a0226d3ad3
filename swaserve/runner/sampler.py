"""Batched on-device sampling: SamplingBatch (per-step parameter tensors built from the live requests)
and Sampler (penalties -> temperature -> top-k -> top-p -> min-p -> draw), with per-request seeds."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import NamedTuple

import torch

from swaserve.h2d import to_device
from swaserve.request import SamplingParams

_MASK64 = (1 << 64) - 1


def _row_seed(seed: int, step: int, sample_index: int) -> int:
    """Mix (seed, step, sample) into one 64-bit generator seed (splitmix64 finaliser).

    Deriving the generator from the step, instead of keeping one generator alive per request, makes
    a seeded request reproducible across retraction/recompute and independent of batch composition.
    """
    x = (seed * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9 + sample_index * 0x94D049BB133111EB) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


@dataclass
class SamplingBatch:
    """The sampling parameters of one step's `bs` rows as device tensors, plus host-side flags that let
    the Sampler skip work no row needs (so no device sync is needed to decide).

    Invariants: every tensor has `bs` rows in the order of the logits; disabled settings hold their
    neutral value (top_k == vocab_size, top_p == 1, min_p == 0, penalties 1/0/0); greedy rows hold
    temperature 1 so the division is harmless (their token comes from argmax, not from the draw).
    """

    vocab_size: int
    batch_size: int
    # The per-row settings; None in a plain greedy batch (no draw, penalties or logprobs anywhere).
    greedy: torch.Tensor | None  # [bs] bool, device
    temperatures: torch.Tensor | None  # [bs] float32, device
    top_k: torch.Tensor | None  # [bs] int64, device; vocab_size where disabled
    top_p: torch.Tensor | None  # [bs] float32, device
    min_p: torch.Tensor | None  # [bs] float32, device
    repetition_penalties: torch.Tensor | None  # [bs] float32, device; None when no row uses it
    presence_penalties: torch.Tensor | None  # [bs] float32, device; None when no row uses penalties
    frequency_penalties: torch.Tensor | None  # [bs] float32, device
    prompt_mask: torch.Tensor | None  # [bs, vocab] bool, device; token occurs in prompt (rep. penalty only)
    output_counts: torch.Tensor | None  # [bs, vocab] int32, device; occurrences in output so far
    seeded_rows: list[tuple[int, int]]  # (row, generator seed) of rows with a per-request seed
    all_greedy: bool
    need_top_k: bool
    need_top_p: bool
    need_min_p: bool
    max_num_logprobs: int | None  # largest `logprobs` asked for in the batch; None when nobody asked

    @classmethod
    def plain_greedy(cls, bs: int, vocab_size: int) -> SamplingBatch:
        """A batch that only takes each row's argmax: no tensors, nothing to copy."""
        return cls(vocab_size, bs, None, None, None, None, None, None, None, None, None, None, [], True,
                   False, False, False, None)

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        output_token_ids: list[list[int]],
        prompt_token_ids: list[list[int]],
        vocab_size: int,
        device: torch.device | str,
        sample_indices: list[int] | None = None,
        step_indices: list[int] | None = None,
        unseen_tokens: torch.Tensor | None = None,
    ) -> SamplingBatch:
        """Build from the live requests' host state, one row per entry of `params`.

        Args:
            params: each row's SamplingParams.
            output_token_ids: tokens generated so far per row, as the host knows them; they feed
                the penalties.
            prompt_token_ids: prompt tokens per row; read only for rows with a repetition penalty.
            vocab_size: width of the logits.
            device: where the logits live.
            sample_indices: which of a request's `n` completions each row is (default 0), so parallel
                samples of a seeded request differ from one another.
            step_indices: which output token of its request each row samples, seeding its generator
                (default: `len(output_token_ids[i])`, right when the host has seen every earlier token).
            unseen_tokens: `[bs]` int64 on `device`: an earlier output token of each row that the host
                has not seen yet (sampled by a step still in flight), -1 where there is none. Counted
                by the penalties; read only on the device, so building needs no sync.
        """
        bs = len(params)
        assert len(output_token_ids) == bs and len(prompt_token_ids) == bs
        dev = torch.device(device)
        distinct = distinct_params(params)
        if is_plain_greedy(distinct):
            return cls.plain_greedy(bs, vocab_size)
        samples = sample_indices if sample_indices is not None else [0] * bs
        steps = step_indices if step_indices is not None else [len(out) for out in output_token_ids]

        def put(xs: list[float] | list[int] | list[bool], dtype: torch.dtype) -> torch.Tensor:
            return _to_device(xs, dtype, dev)  # one host-to-device copy per field

        greedy = [p.is_greedy for p in params]
        top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
        asked = [p.logprobs for p in distinct if p.logprobs is not None]

        rep_pen = pres_pen = freq_pen = prompt_mask = counts = None
        if any(p.repetition_penalty != 1.0 for p in distinct):
            rep_pen = put([p.repetition_penalty for p in params], torch.float32)
            # Rows without the penalty contribute no tokens: their mask is never read.
            rows = [ids if p.repetition_penalty != 1.0 else [] for p, ids in zip(params, prompt_token_ids)]
            prompt_mask = _token_counts(rows, vocab_size, dev).bool()
        if any(p.uses_penalties for p in distinct):
            pres_pen = put([p.presence_penalty for p in params], torch.float32)
            freq_pen = put([p.frequency_penalty for p in params], torch.float32)
            rows = [ids if p.uses_penalties else [] for p, ids in zip(params, output_token_ids)]
            counts = _token_counts(rows, vocab_size, dev)
            if unseen_tokens is not None:
                seen = unseen_tokens >= 0
                counts.scatter_add_(1, unseen_tokens.clamp(min=0)[:, None], seen.to(torch.int32)[:, None])

        return cls(
            vocab_size=vocab_size,
            batch_size=bs,
            greedy=put(greedy, torch.bool),
            temperatures=put([1.0 if g else p.temperature for g, p in zip(greedy, params)], torch.float32),
            top_k=put(top_k, torch.int64),
            top_p=put([p.top_p for p in params], torch.float32),
            min_p=put([p.min_p for p in params], torch.float32),
            repetition_penalties=rep_pen,
            presence_penalties=pres_pen,
            frequency_penalties=freq_pen,
            prompt_mask=prompt_mask,
            output_counts=counts,
            seeded_rows=[
                (i, _row_seed(p.seed, step, s))
                for i, (p, step, s) in enumerate(zip(params, steps, samples))
                if p.seed is not None and not p.is_greedy
            ],
            all_greedy=all(greedy),
            # Settings only matter on rows that draw: greedy rows take the argmax whatever they are.
            need_top_k=any(k < vocab_size and not g for k, g in zip(top_k, greedy)),
            need_top_p=any(p.top_p < 1.0 and not g for p, g in zip(params, greedy)),
            need_min_p=any(p.min_p > 0.0 and not g for p, g in zip(params, greedy)),
            max_num_logprobs=max(asked) if asked else None,
        )


def distinct_params(params: list[SamplingParams]) -> list[SamplingParams]:
    """Batches usually share a few SamplingParams objects: flags are decided over those."""
    return list({id(p): p for p in params}.values())


def is_plain_greedy(distinct: list[SamplingParams]) -> bool:
    return all(p.is_greedy and not p.uses_penalties and p.logprobs is None for p in distinct)


def _to_device(
    xs: list[float] | list[int] | list[bool], dtype: torch.dtype, dev: torch.device
) -> torch.Tensor:
    return to_device(torch.tensor(xs, dtype=dtype), dev)


def _token_counts(rows: list[list[int]], vocab_size: int, dev: torch.device) -> torch.Tensor:
    """Per-row token occurrence counts, `[bs, vocab]` int32 on `dev`, from one flat host-to-device copy."""
    lens = [len(r) for r in rows]
    counts = torch.zeros(len(rows), vocab_size, dtype=torch.int32, device=dev)
    if sum(lens) == 0:
        return counts
    ids = _to_device(list(chain.from_iterable(rows)), torch.int64, dev)  # [sum(lens)] int64, device
    row_idx = torch.repeat_interleave(  # [sum(lens)] int64, device; output_size avoids a device sync
        torch.arange(len(rows), device=dev), _to_device(lens, torch.int64, dev), output_size=ids.numel()
    )
    counts.index_put_((row_idx, ids), torch.ones_like(ids, dtype=torch.int32), accumulate=True)
    return counts


class SamplerOutput(NamedTuple):
    """Result of one sampling step. `logprobs` are log-softmax of the penalised logits at temperature 1,
    before top-k/top-p/min-p truncation (so every sampled token has a finite logprob and values do not
    depend on the temperature), the same distribution the top-n lists are taken from."""

    next_token_ids: torch.Tensor  # [bs] int64, device
    logprobs: torch.Tensor | None  # [bs] float32, device: logprob of the sampled token; None if unasked
    top_logprob_ids: torch.Tensor | None  # [bs, k] int64, device; k = batch max `logprobs`; None if unasked
    top_logprob_vals: torch.Tensor | None  # [bs, k] float32, device

    def logprob_dicts(self, num_logprobs: list[int | None]) -> list[dict[int, float] | None]:
        """Per row, {token: logprob} for the top `num_logprobs[i]` tokens plus the sampled one (vLLM
        semantics), or None where the row did not ask. One device-to-host copy per tensor."""
        tokens = self.next_token_ids.tolist()
        assert self.logprobs is not None, "no row asked for logprobs"
        sampled = self.logprobs.tolist()
        top_ids = self.top_logprob_ids.tolist() if self.top_logprob_ids is not None else None
        top_vals = self.top_logprob_vals.tolist() if self.top_logprob_vals is not None else None
        out: list[dict[int, float] | None] = []
        for i, k in enumerate(num_logprobs):
            if k is None:
                out.append(None)
                continue
            d = dict(zip(top_ids[i][:k], top_vals[i][:k])) if k and top_ids is not None else {}
            d.setdefault(tokens[i], sampled[i])
            out.append(d)
        return out


class Sampler:
    """Picks one token per row from float32 logits. Stateless: all per-step state is in SamplingBatch.

    Order (HF's): penalties on the raw logits, then temperature, top-k, top-p (over the top-k
    renormalised distribution), min-p, and an exponential-race draw argmax(p / E), E ~ Exp(1), which is
    an exact sample of p. Greedy rows take the argmax of the penalised logits (lowest index on ties).
    A seeded row draws its E from its own generator seeded by (seed, tokens generated so far), on the
    logits' device, so its tokens do not depend on anything else in the batch.
    """

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        assert logits.dim() == 2 and logits.shape == (batch.batch_size, batch.vocab_size), logits.shape
        logits = self._apply_penalties(logits.float(), batch)

        next_ids = logits.argmax(dim=-1)  # [bs] int64
        if not batch.all_greedy:
            assert batch.greedy is not None and batch.temperatures is not None
            sampled = self._draw(self._truncate(logits / batch.temperatures[:, None], batch), batch)
            next_ids = torch.where(batch.greedy, next_ids, sampled)
        if batch.max_num_logprobs is None:
            return SamplerOutput(next_ids, None, None, None)
        # No [bs, vocab] log-softmax: the top-n and the sampled token need just the normaliser.
        log_z = torch.logsumexp(logits, dim=-1)  # [bs] float32
        top_vals, top_ids = logits.topk(batch.max_num_logprobs, dim=-1)
        chosen = logits.gather(1, next_ids[:, None]).squeeze(1) - log_z
        return SamplerOutput(next_ids, chosen, top_ids, top_vals - log_z[:, None])

    @staticmethod
    def _apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        if batch.output_counts is None:
            return logits
        counts = batch.output_counts
        if batch.repetition_penalties is not None:
            assert batch.prompt_mask is not None
            # HF/vLLM: a seen token's logit moves toward "less likely" whatever its sign.
            seen = batch.prompt_mask | (counts > 0)
            pen = batch.repetition_penalties[:, None]
            logits = torch.where(seen, torch.where(logits > 0, logits / pen, logits * pen), logits)
        assert batch.presence_penalties is not None and batch.frequency_penalties is not None
        logits = logits - batch.frequency_penalties[:, None] * counts
        return logits - batch.presence_penalties[:, None] * (counts > 0)

    @staticmethod
    def _truncate(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Mask (to -inf) tokens outside each row's top-k / top-p / min-p set; a row's top token is
        always kept. Thresholds are values, so tokens tied with the last kept one are kept too."""
        neg_inf = float("-inf")  # a Python scalar: no host-to-device copy per step
        if batch.need_top_k or batch.need_top_p:
            # One sort serves both; stable so equal logits keep index order like argmax does.
            sorted_logits, _ = logits.sort(dim=-1, descending=True, stable=True)  # [bs, vocab]
            keep = batch.top_k  # [bs] int64: how many sorted entries survive
            if batch.need_top_p:
                ranks = torch.arange(logits.shape[1], device=logits.device)
                in_k = ranks[None, :] < batch.top_k[:, None]
                probs = torch.softmax(torch.where(in_k, sorted_logits, neg_inf), dim=-1)
                # Keep the smallest prefix whose mass reaches top_p: an entry survives iff the mass
                # strictly above it is still < top_p. The top entry always survives (mass 0).
                mass_above = probs.cumsum(dim=-1) - probs
                in_p = (mass_above < batch.top_p[:, None]) | (batch.top_p[:, None] >= 1.0)
                keep = torch.minimum(keep, (in_k & in_p).sum(dim=-1))
            threshold = sorted_logits.gather(1, (keep - 1).clamp(min=0)[:, None])  # [bs, 1]
            logits = torch.where(logits < threshold, neg_inf, logits)
        if batch.need_min_p:
            # p_i >= min_p * p_max  <=>  logit_i - logit_max >= log(min_p); log(0) = -inf keeps all.
            max_logit = logits.max(dim=-1, keepdim=True).values
            logits = torch.where(logits - max_logit < batch.min_p[:, None].log(), neg_inf, logits)
        return logits

    @staticmethod
    def _draw(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        probs = torch.softmax(logits, dim=-1)  # [bs, vocab] float32
        noise = torch.empty_like(probs).exponential_()  # default generator for unseeded rows
        for row, seed in batch.seeded_rows:
            gen = torch.Generator(device=probs.device)
            gen.manual_seed(seed)
            noise[row].exponential_(generator=gen)
        # A zero E would turn a zero-probability token into 0/0 = NaN, which argmax would pick.
        noise.clamp_(min=torch.finfo(noise.dtype).tiny)
        return (probs / noise).argmax(dim=-1)
