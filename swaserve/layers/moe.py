"""Mixture of experts, GPT-OSS layout: a biased top-k router and experts with biased, interleaved
gate/up weights. A plain torch reference (a loop over the experts that got tokens).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


class TopKRouter(nn.Module):
    """Picks `top_k` experts per token; their weights are a softmax over the selected logits only."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))  # [E, hidden]
        self.bias = nn.Parameter(torch.empty(num_experts))  # [E]

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x, self.weight, self.bias)  # [n, E]
        top, ids = torch.topk(logits, self.top_k, dim=-1)  # [n, k]
        return torch.softmax(top, dim=-1), ids


class Experts(nn.Module):
    """E expert MLPs stored stacked, input-major (`x @ W`), as GPT-OSS checkpoints store them."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 act: Callable[[torch.Tensor], torch.Tensor]):
        super().__init__()
        self.num_experts = num_experts
        self.act = act  # maps [.., 2I] gate_up to [.., I]
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, hidden_size, 2 * intermediate_size))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden_size))

    def forward(
        self,
        x: torch.Tensor,  # [n, hidden]
        weights: torch.Tensor,  # [n, k] routing weights
        ids: torch.Tensor,  # [n, k] int64 expert ids
    ) -> torch.Tensor:
        out = torch.zeros_like(x)
        counts = torch.bincount(ids.flatten(), minlength=self.num_experts).tolist()
        for e, count in enumerate(counts):
            if count == 0:
                continue
            token, slot = torch.where(ids == e)
            h = self.act(x[token] @ self.gate_up_proj[e] + self.gate_up_proj_bias[e])
            y = h @ self.down_proj[e] + self.down_proj_bias[e]
            out.index_add_(0, token, (y * weights[token, slot, None]).to(x.dtype))
        return out


class MoE(nn.Module):
    """router + experts; HF names `router.{weight,bias}`, `experts.{gate_up_proj,down_proj}[_bias]`."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 act: Callable[[torch.Tensor], torch.Tensor]):
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"top_k {top_k} must be in 1..num_experts ({num_experts})")
        self.router = TopKRouter(hidden_size, num_experts, top_k)
        self.experts = Experts(num_experts, hidden_size, intermediate_size, act)

    def forward(self, x: torch.Tensor, partial_sums: bool = False) -> torch.Tensor:  # [num_tokens, hidden]
        """Always the summed `[num_tokens, hidden]`: the experts add their outputs up themselves
        (`partial_sums` is the dense layers' option, accepted so the decoder layer need not ask)."""
        weights, ids = self.router(x)
        return self.experts(x, weights, ids)
