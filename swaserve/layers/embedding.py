"""Token embedding (with Gemma's sqrt(hidden) scale) and the LM head that turns hidden states into logits."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from swaserve.layers.activation import soft_cap


class VocabEmbedding(nn.Module):
    """Looks up token rows; `scale` (Gemma: sqrt(hidden)) is rounded to the model dtype first, as HF does."""

    def __init__(self, vocab_size: int, hidden_size: int, scale: float | None = None):
        super().__init__()
        self.scale = scale
        self._scaled: dict[torch.dtype, float] = {}  # scale rounded to each dtype seen
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))  # [vocab, hidden]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [num_tokens] int64 -> [num_tokens, hidden]
        h = F.embedding(input_ids, self.weight)
        if self.scale is not None:
            # sqrt(3072) = 55.43 becomes 55.5 in bf16; HF multiplies by the rounded value. A Python
            # float (exactly that rounded value) keeps the multiply free of host-to-device copies,
            # which a CUDA graph capture forbids.
            scale = self._scaled.get(h.dtype)
            if scale is None:
                scale = self._scaled.setdefault(h.dtype, float(torch.tensor(self.scale, dtype=h.dtype)))
            h = h * scale
        return h


class LMHead(nn.Module):
    """hidden -> float32 logits, with an optional final soft-cap.

    Owns a weight only when untied; a tied head reads the embedding's weight, passed at call time,
    so no parameter is shared between modules (meta-device init and `to_empty` stay simple).
    """

    def __init__(self, vocab_size: int, hidden_size: int, tied: bool, final_softcap: float | None = None):
        super().__init__()
        self.tied = tied
        self.final_softcap = final_softcap
        self.weight = None if tied else nn.Parameter(torch.empty(vocab_size, hidden_size))  # [vocab, hidden]

    def forward(self, hidden: torch.Tensor, embedding: VocabEmbedding) -> torch.Tensor:
        weight = embedding.weight if self.tied else self.weight
        logits = F.linear(hidden, weight).float()  # [n, vocab] float32
        return soft_cap(logits, self.final_softcap)
