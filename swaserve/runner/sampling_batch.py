"""SamplingBatch: one step's per-row sampling parameters as device tensors, built from the live
requests, plus host-side flags that let the Sampler (and the LM head's sampler) skip work no row
needs."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import torch

from swaserve.h2d import to_device
from swaserve.request import SamplingParams

_MASK64 = (1 << 64) - 1
TOP_K_SELECT = 1024  # top-k up to here truncates with torch.topk instead of a sort


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
    # CUDA only. `seeds`: every row's noise seed, in [0, 2**63) (a seeded row's from its seed and
    # step, others fresh): rows draw with `kernels.lm_head_argmax`'s Gumbel noise, whether the LM
    # head samples or the Sampler does, so a seeded row's tokens do not depend on its neighbours.
    # `inv_temperatures` is set when every row is greedy or temperature-only (no truncation,
    # penalties or logprobs): the LM head then samples without logits (`ModelRunner.sample_tokens`).
    seeds: torch.Tensor | None = None  # [bs] int64, device
    inv_temperatures: torch.Tensor | None = None  # [bs] float32, device; 0 on greedy rows
    # The largest top-k of the rows that draw, when every one of them has a top-k of at most
    # TOP_K_SELECT: the Sampler then truncates among that many best logits instead of sorting.
    top_k_width: int | None = None
    # SamplingParams.logit_bias of every row, flattened: (row, token id, bias); None when no row has one.
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # [n] int64, int64, float32; device

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

        need_top_k = any(k < vocab_size and not g for k, g in zip(top_k, greedy))
        drawn_k = [k for k, g in zip(top_k, greedy) if not g]
        top_k_width = max(drawn_k) if drawn_k and max(drawn_k) <= TOP_K_SELECT else None
        need_top_p = any(p.top_p < 1.0 and not g for p, g in zip(params, greedy))
        need_min_p = any(p.min_p > 0.0 and not g for p, g in zip(params, greedy))
        row_seeds = [
            _row_seed(p.seed, step, s) if p.seed is not None and not p.is_greedy else None
            for p, step, s in zip(params, steps, samples)
        ]
        bias = _logit_bias(params, dev) if any(p.logit_bias for p in distinct) else None
        inv_t = seeds = None
        if dev.type == "cuda":
            fresh = torch.randint(0, 1 << 62, (bs,)).tolist()  # unseeded rows: the default generator
            seeds = put([f if r is None else r >> 1 for r, f in zip(row_seeds, fresh)], torch.int64)
            plain = not (need_top_k or need_top_p or need_min_p or asked)
            if plain and rep_pen is None and counts is None and bias is None:
                inv_t = put([0.0 if g else 1.0 / p.temperature for g, p in zip(greedy, params)],
                            torch.float32)
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
            seeded_rows=[(i, r) for i, r in enumerate(row_seeds) if r is not None],
            all_greedy=all(greedy),
            # Settings only matter on rows that draw: greedy rows take the argmax whatever they are.
            need_top_k=need_top_k,
            need_top_p=need_top_p,
            need_min_p=need_min_p,
            max_num_logprobs=max(asked) if asked else None,
            inv_temperatures=inv_t,
            seeds=seeds,
            top_k_width=top_k_width,
            logit_bias=bias,
        )


def distinct_params(params: list[SamplingParams]) -> list[SamplingParams]:
    """Batches usually share a few SamplingParams objects: flags are decided over those."""
    return list({id(p): p for p in params}.values())


def is_plain_greedy(distinct: list[SamplingParams]) -> bool:
    return all(p.is_greedy and not p.uses_penalties and p.logprobs is None and not p.logit_bias for p in distinct)


def _logit_bias(params: list[SamplingParams], dev: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows = [i for i, p in enumerate(params) for _ in (p.logit_bias or ())]
    ids = [t for p in params for t in (p.logit_bias or ())]
    vals = [v for p in params for v in (p.logit_bias or {}).values()]
    return (_to_device(rows, torch.int64, dev), _to_device(ids, torch.int64, dev),
            _to_device(vals, torch.float32, dev))


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
