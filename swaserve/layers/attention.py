"""The self-attention block shared by every family: projections, optional q/k norm, rotary, and a
call into the attention backend carried by the batch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from swaserve.attention.base import AttentionSpec
from swaserve.layers.linear import MergedLinear, OutLinear
from swaserve.layers.norm import RMSNorm
from swaserve.layers.rotary import RotaryEmbedding

if TYPE_CHECKING:
    from swaserve.runner.forward_batch import ForwardBatch


class SelfAttention(nn.Module):
    """q/k/v (one merged GEMM, shards q=0 k=1 v=2) -> per-head norm -> rotary -> backend -> o_proj.

    `spec.layer_id` is the GLOBAL layer id, the one `ModelConfig` and `SWAKVPool` use; the backend
    stores this layer's K/V under it. HF weight names: q_proj, k_proj, v_proj, o_proj, q_norm,
    k_norm, sinks.
    """

    def __init__(
        self,
        *,
        layer_id: int,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rotary: RotaryEmbedding,
        scaling: float,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
        qkv_bias: bool = False,
        o_bias: bool = False,
        qk_norm: dict | None = None,  # RMSNorm kwargs (eps, unit_offset) when q/k are normed per head
        sinks: bool = False,
    ):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.qkv_proj = MergedLinear(hidden_size, [q_size, kv_size, kv_size], qkv_bias)
        self.o_proj = OutLinear(q_size, hidden_size, bias=o_bias)
        self.q_norm = RMSNorm(head_dim, **qk_norm) if qk_norm is not None else None
        self.k_norm = RMSNorm(head_dim, **qk_norm) if qk_norm is not None else None
        self.sinks = nn.Parameter(torch.empty(num_heads)) if sinks else None  # [num_heads]
        self.rotary = rotary
        self.spec = AttentionSpec(
            layer_id=layer_id,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            v_head_dim=head_dim,
            scaling=scaling,
            sliding_window=sliding_window,
            logit_softcap=logit_softcap,
        )

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch, partial_sums: bool = False) -> torch.Tensor:
        """`[num_tokens, hidden]` -> `[num_tokens, hidden]`, or o_proj's split-K partial sums
        (`OutLinear`) when `partial_sums` and the batch is decode-sized."""
        n = hidden.shape[0]
        backend = batch.attn_backend
        assert backend is not None, "ModelRunner sets batch.attn_backend before the model runs"
        qkv = self.qkv_proj(hidden)
        fused = backend.fused_kv_store
        if fused:  # norm + rotary + K/V store in one launch, in place on qkv
            self._norm_rotate_store(qkv, batch)
        q, k, v = qkv.split(self.qkv_proj.out_sizes, dim=-1)
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        if not fused:
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = self.rotary(batch.positions, q, k, batch.scratch)
        out = backend.forward(q, k, v, self.spec, batch, self.sinks, kv_stored=fused)
        return self.o_proj(out.reshape(n, self.num_heads * self.head_dim), partial_sums)

    def _norm_rotate_store(self, qkv: torch.Tensor, batch: ForwardBatch) -> None:
        from swaserve.kernels.qk_norm_rope import qk_norm_rope_store

        assert batch.attn_backend is not None
        cos, sin = self.rotary.cos_sin(batch.positions, batch.scratch)
        k_buf, v_buf, locs = batch.attn_backend.kv_target(self.spec, batch)
        qn, kn = self.q_norm, self.k_norm
        qk_norm_rope_store(
            qkv, self.num_heads, self.num_kv_heads, self.head_dim, cos, sin,
            qn.weight if qn is not None else None, kn.weight if kn is not None else None,
            qn.eps if qn is not None else 0.0, k_buf, v_buf, locs,
            unit_offset=qn.unit_offset if qn is not None else False,
            weight_fp32=qn.fp32_weight if qn is not None else False,
        )
