"""Sampler: batched on-device sampling (logit bias -> penalties -> temperature -> top-k -> top-p -> min-p -> draw)
over one step's logits, with per-request seeds; its parameters come in a SamplingBatch."""

from __future__ import annotations

from typing import NamedTuple

import torch

from swaserve.runner.sampling_batch import SamplingBatch


class SamplerOutput(NamedTuple):
    """Result of one sampling step. `logprobs` are log-softmax of the biased, penalised logits at temperature 1,
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

    Order (HF's, after vLLM's logit bias): each row's logit_bias added to the raw logits, penalties, then
    temperature, top-k, top-p (over the top-k
    renormalised distribution), min-p, and an exponential-race draw argmax(p / E), E ~ Exp(1), which is
    an exact sample of p. Greedy rows take the argmax of the penalised logits (lowest index on ties).
    A seeded row draws its E from its own generator seeded by (seed, tokens generated so far), on the
    logits' device, so its tokens do not depend on anything else in the batch. On CUDA the draw is
    the same race in log space with the LM head sampler's hashed noise (`SamplingBatch.seeds`).

    `batch_invariant` (deterministic mode): logprobs from a per-row log-softmax instead of
    `logsumexp`, whose CUDA reduction splits a row across blocks when the batch has few rows.
    """

    def __init__(self, batch_invariant: bool = False):
        self.batch_invariant = batch_invariant

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        assert logits.dim() == 2 and logits.shape == (batch.batch_size, batch.vocab_size), logits.shape
        logits = self._apply_penalties(self._apply_logit_bias(logits.float(), batch), batch)

        next_ids = logits.argmax(dim=-1)  # [bs] int64
        if not batch.all_greedy:
            assert batch.greedy is not None and batch.temperatures is not None
            sampled = self._draw(self._truncate(logits / batch.temperatures[:, None], batch), batch)
            next_ids = torch.where(batch.greedy, next_ids, sampled)
        if batch.max_num_logprobs is None:
            return SamplerOutput(next_ids, None, None, None)
        if self.batch_invariant:
            logp = torch.log_softmax(logits, dim=-1)  # one program per row on CUDA and CPU alike
            top_vals, top_ids = logp.topk(batch.max_num_logprobs, dim=-1)
            return SamplerOutput(next_ids, logp.gather(1, next_ids[:, None]).squeeze(1), top_ids, top_vals)
        # No [bs, vocab] log-softmax: the top-n and the sampled token need just the normaliser.
        log_z = torch.logsumexp(logits, dim=-1)  # [bs] float32
        top_vals, top_ids = logits.topk(batch.max_num_logprobs, dim=-1)
        chosen = logits.gather(1, next_ids[:, None]).squeeze(1) - log_z
        return SamplerOutput(next_ids, chosen, top_ids, top_vals - log_z[:, None])

    @staticmethod
    def _apply_logit_bias(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """OpenAI's logit_bias: each row's biases added to its logits (out of place: `logits` may be the
        runner's). A row's token ids are distinct, so the sum has one term per entry and is deterministic."""
        if batch.logit_bias is None:
            return logits
        rows, ids, vals = batch.logit_bias
        return logits.index_put((rows, ids), vals, accumulate=True)

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
        if batch.need_top_p and not batch.need_top_k and logits.is_cuda:
            # No drawing row has a top-k: search each row's nucleus threshold instead of sorting
            # the vocabulary (kernels/top_p.py; 1B at 64 rows: see benchmarks/sampler.py).
            from swaserve.kernels.top_p import top_p_threshold

            threshold = top_p_threshold(logits.contiguous(), batch.top_p)  # [bs, 1]
            logits = torch.where(logits < threshold, neg_inf, logits)
        elif batch.need_top_k or batch.need_top_p:
            # One descending order serves both (values only: thresholds are values). When every
            # drawing row has a top-k, its k best suffice (torch.topk: ~5x cheaper than a sort of
            # 262,144 logits on an H100); a row that only has a top-p needs the full sort.
            if batch.top_k_width is not None:
                sorted_logits = logits.topk(batch.top_k_width, dim=-1).values  # [bs, width]
            else:
                sorted_logits = logits.sort(dim=-1, descending=True).values  # [bs, vocab]
            # [bs] int64: how many sorted entries survive (rows not drawing may exceed the width)
            keep = batch.top_k.clamp(max=sorted_logits.shape[1])
            if batch.need_top_p:
                ranks = torch.arange(sorted_logits.shape[1], device=logits.device)
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
        if batch.seeds is not None:  # CUDA: argmax(logits + Gumbel) = argmax(p / E), E ~ Exp(1)
            from swaserve.kernels.lm_head_argmax import gumbel_noise

            return (logits + gumbel_noise(batch.seeds, logits.shape[1])).argmax(dim=-1)
        probs = torch.softmax(logits, dim=-1)  # [bs, vocab] float32
        noise = torch.empty_like(probs).exponential_()  # default generator for unseeded rows
        for row, seed in batch.seeded_rows:
            gen = torch.Generator(device=probs.device)
            gen.manual_seed(seed)
            noise[row].exponential_(generator=gen)
        # A zero E would turn a zero-probability token into 0/0 = NaN, which argmax would pick.
        noise.clamp_(min=torch.finfo(noise.dtype).tiny)
        return (probs / noise).argmax(dim=-1)
