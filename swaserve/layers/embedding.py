"""Token embedding (with Gemma's sqrt(hidden) scale) and the LM head that turns hidden states into logits."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from swaserve.distributed.state import all_gather_last, all_reduce, tp_group, vocab_parallel_argmax, vocab_shard
from swaserve.layers.activation import soft_cap

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _vocab_rows(tensor: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """This rank's block of an HF `[vocab, ...]` tensor, zero-padded to the common block size."""
    start, rows, padded = vocab_shard(vocab_size)
    if tensor.shape[0] != vocab_size or padded == vocab_size:
        return tensor
    block = tensor.new_zeros(padded, *tensor.shape[1:])
    block[:rows] = tensor[start : start + rows]
    return block


class VocabEmbedding(nn.Module):
    """Looks up token rows; `scale` (Gemma: sqrt(hidden)) is rounded to the model dtype first, as HF does.

    Vocab-parallel under tensor parallelism: each rank holds a block of `ceil(vocab / ranks)` rows
    (`distributed.state.vocab_shard`), looks up the ids in its block (zeros elsewhere), and the
    ranks' results are summed.
    """

    def __init__(self, vocab_size: int, hidden_size: int, scale: float | None = None):
        super().__init__()
        self.vocab_size = vocab_size
        self.start, _, rows = vocab_shard(vocab_size)
        self.scale = scale
        # The scale rounded to each float dtype, computed here so no forward (traced or captured
        # ones included) ever converts a tensor to a Python number.
        self._scaled: dict[torch.dtype, float] = (
            {} if scale is None else {dt: float(torch.tensor(scale, dtype=dt, device="cpu")) for dt in _FLOAT_DTYPES}
        )
        self.parallel = tp_group().enabled
        self.weight = nn.Parameter(torch.empty(rows, hidden_size))  # [vocab (this rank's block), hidden]

    def tp_slice(self, param_name: str, tensor: torch.Tensor) -> torch.Tensor:
        return _vocab_rows(tensor, self.vocab_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [num_tokens] int64 -> [num_tokens, hidden]
        if self.parallel:
            local = input_ids - self.start
            mine = (local >= 0) & (local < self.weight.shape[0])
            h = F.embedding(local * mine, self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
            all_reduce(h)
        else:
            h = F.embedding(input_ids, self.weight)
        if self.scale is not None:
            # sqrt(3072) = 55.43 becomes 55.5 in bf16; HF multiplies by the rounded value. A Python
            # float (exactly that rounded value) keeps the multiply free of host-to-device copies,
            # which a CUDA graph capture forbids.
            h = h * self._scaled[h.dtype]
        return h


class LMHead(nn.Module):
    """hidden -> float32 logits, with an optional final soft-cap, or straight to tokens (greedy, sampled).

    Owns a weight only when untied; a tied head reads the embedding's weight, passed at call time,
    so no parameter is shared between modules (meta-device init and `to_empty` stay simple).

    `batch_invariant` (deterministic mode): logits from `invariant_linear`; sampled tokens from those
    logits, greedy ones from the fused argmax kernel, whose logits are the same bits (no soft-cap).
    Vocab-parallel under tensor parallelism (the embedding's row blocks): each rank's logits block
    is gathered, so every rank holds the whole row; greedy is the argmax of that.
    """

    batch_invariant = False

    def __init__(self, vocab_size: int, hidden_size: int, tied: bool, final_softcap: float | None = None):
        super().__init__()
        self.tied = tied
        self.vocab_size = vocab_size
        self.final_softcap = final_softcap
        self.parallel = tp_group().enabled
        rows = vocab_shard(vocab_size)[2]
        self.weight = None if tied else nn.Parameter(torch.empty(rows, hidden_size))  # [vocab (rank's block), hidden]

    def tp_slice(self, param_name: str, tensor: torch.Tensor) -> torch.Tensor:
        return _vocab_rows(tensor, self.vocab_size)

    def forward(self, hidden: torch.Tensor, embedding: VocabEmbedding, out: torch.Tensor | None = None) -> torch.Tensor:
        """`[n, vocab]` float32 logits, written into `out` when given. On CUDA a 16-bit model's GEMM
        writes float32 directly (one pass over the logits instead of three, and no rounding of the
        logits to 16 bits); elsewhere the GEMM runs in the model dtype and is cast."""
        weight = embedding.weight if self.tied else self.weight
        dst = None if self.parallel else out  # a rank's GEMM writes its vocab block only
        if self.batch_invariant:
            from swaserve.layers.batch_invariant import invariant_linear

            logits = invariant_linear(hidden, weight, out_dtype=torch.float32)
        elif hidden.is_cuda and hidden.dtype in (torch.bfloat16, torch.float16):
            if dst is None:
                dst = torch.empty(hidden.shape[0], weight.shape[0], dtype=torch.float32, device=hidden.device)
            logits = torch.mm(hidden, weight.t(), out_dtype=torch.float32, out=dst)
        else:
            logits = F.linear(hidden, weight).float()
        if self.parallel:
            logits = all_gather_last(logits)[:, : self.vocab_size]
        if out is not None and logits is not out:
            logits = out.copy_(logits)
        if self.final_softcap is None:
            return logits
        if out is None:
            return soft_cap(logits, self.final_softcap)
        return logits.div_(self.final_softcap).tanh_().mul_(self.final_softcap)  # in place, same ops

    def greedy(self, hidden: torch.Tensor, embedding: VocabEmbedding,
               allowed: tuple[torch.Tensor, torch.Tensor | None] | None = None) -> torch.Tensor:
        """`[n]` int64: each row's argmax of the (soft-capped) logits, lowest index on ties. On CUDA
        a 16-bit model takes it without writing the logits (`kernels.lm_head_argmax`); elsewhere
        it is the argmax of `forward`. `allowed` (structured outputs, one rank): `(masks, rows)` as
        `runner.token_mask.apply_token_bitmask` takes them; those rows take the argmax over the tokens
        their mask allows."""
        weight = embedding.weight if self.tied else self.weight
        # Deterministic mode too: the fused kernel's logits are bi_matmul's bit for bit (one MMA chain
        # along K), so a row's token is the argmax of the logits a mixed batch's Sampler sees; not
        # with a soft-cap, which it computes with other float ops than `soft_cap`.
        fused = not self.batch_invariant or self.final_softcap is None
        if self.parallel:
            assert allowed is None, "masked greedy under tensor parallelism takes the gathered logits"
            return self._vocab_parallel_greedy(hidden, weight, fused)
        if hidden.is_cuda and hidden.dtype in (torch.bfloat16, torch.float16) and fused:
            from swaserve.kernels.lm_head_argmax import lm_head_argmax

            x = hidden if hidden.stride(1) == 1 else hidden.contiguous()
            if allowed is None:
                return lm_head_argmax(x, weight, self.final_softcap)
            return lm_head_argmax(x, weight, self.final_softcap, **_mask_args(allowed, x.shape[0], x.device))
        logits = self.forward(hidden, embedding)
        if allowed is not None:
            from swaserve.runner.token_mask import apply_token_bitmask

            apply_token_bitmask(logits, *allowed)
        return logits.argmax(dim=-1)

    def _vocab_parallel_greedy(self, hidden: torch.Tensor, weight: torch.Tensor, fused: bool) -> torch.Tensor:
        """Tensor parallelism: each rank's best token in its vocabulary block (the fused kernel where it
        runs, else its block's logits), then one gather of (best logit, token id) per row and rank
        (`state.vocab_parallel_argmax`): the whole rows' logits never move. The same token as the
        argmax of the gathered logits: each block's logits are the same bits either way."""
        start, rows, _ = vocab_shard(self.vocab_size)
        weight = weight[:rows]  # the last block's zero padding must not compete (a 0 logit can win)
        n = hidden.shape[0]
        if rows == 0:  # a vocabulary smaller than the ranks' blocks: this rank holds none of it
            best = torch.full((n,), float("-inf"), device=hidden.device)
            index = torch.zeros(n, dtype=torch.int64, device=hidden.device)
        elif hidden.is_cuda and hidden.dtype in (torch.bfloat16, torch.float16) and fused:
            from swaserve.kernels.lm_head_argmax import lm_head_argmax

            x = hidden if hidden.stride(1) == 1 else hidden.contiguous()
            best = torch.empty(n, dtype=torch.float32, device=hidden.device)
            index = lm_head_argmax(x, weight, self.final_softcap, values=best)
        else:
            if self.batch_invariant:
                from swaserve.layers.batch_invariant import invariant_linear

                logits = invariant_linear(hidden, weight, out_dtype=torch.float32)
            else:
                logits = F.linear(hidden, weight).float()
            if self.final_softcap is not None:
                logits = soft_cap(logits, self.final_softcap)
            best, index = logits.max(dim=-1)
        return vocab_parallel_argmax(best.contiguous(), index + start)

    def sample(self, hidden: torch.Tensor, embedding: VocabEmbedding, inv_temperature: torch.Tensor,
               seeds: torch.Tensor, allowed: tuple[torch.Tensor, torch.Tensor | None] | None = None) -> torch.Tensor:
        """`[n]` int64 on CUDA, without writing the logits: a draw from `softmax(logits * inv_t)` per
        row with a positive inverse temperature (Gumbel noise from the row's seed), the argmax where
        it is 0 (`kernels.lm_head_argmax`). `allowed`: structured outputs' masks, as `greedy` takes them;
        those rows draw among the tokens their mask allows (the softmax of their logits with the others at
        -inf)."""
        if not hidden.is_cuda or self.batch_invariant or self.parallel:
            raise ValueError("sampling in the LM head runs on CUDA outside deterministic mode and tensor "
                             "parallelism; elsewhere use the logits and the Sampler")
        from swaserve.kernels.lm_head_argmax import lm_head_argmax

        weight = embedding.weight if self.tied else self.weight
        x = hidden if hidden.stride(1) == 1 else hidden.contiguous()
        masked = {} if allowed is None else _mask_args(allowed, x.shape[0], x.device)
        return lm_head_argmax(x, weight, self.final_softcap, inv_temperature, seeds, **masked)


def _mask_args(allowed: tuple[torch.Tensor, torch.Tensor | None], n: int, device: torch.device) -> dict:
    """`lm_head_argmax`'s mask arguments from `(masks, rows)` (rows None: row r's mask is masks[r])."""
    masks, rows = allowed
    index = None
    if rows is not None:  # row r's mask row, -1 where it has none
        index = torch.full((n,), -1, dtype=torch.int32, device=device)
        index[rows] = torch.arange(rows.shape[0], dtype=torch.int32, device=device)
    return {"allowed": masks, "allowed_index": index}
