"""The self-attention block shared by every family: projections, optional q/k norm, rotary, and a
call into the attention backend carried by the batch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from swaserve.attention.base import AttentionSpec
from swaserve.distributed.state import shard_heads
from swaserve.layers.linear import MergedLinear, OutLinear
from swaserve.layers.norm import RMSNorm
from swaserve.layers.rotary import RotaryEmbedding

if TYPE_CHECKING:
    from swaserve.runner.forward_batch import ForwardBatch


class SelfAttention(nn.Module):
    """q/k/v (one merged GEMM, shards q=0 k=1 v=2) -> per-head norms -> rotary -> backend -> o_proj.

    `spec.layer_id` is the GLOBAL layer id, the one `ModelConfig` and `SWAKVPool` use; the backend
    stores this layer's K/V under it. HF weight names: q_proj, k_proj, v_proj, o_proj, q_norm,
    k_norm, sinks. Gemma 4 forms: `k_eq_v` (no v_proj: V is the raw key projection), `v_norm` (V
    RMS-normed without weight), `kv_shared` (q_proj only: the layer reads the K/V its source layer
    wrote this step and stores nothing; the pool routes its layer id to the source's buffers).
    MiMo-V2 forms: `v_head_dim` narrower than the q/k `head_dim` (o_proj reads `num_heads * v_head_dim`),
    `v_scale` multiplying V before it is cached, and partial rotary (the rotary module's
    `rotary_dim` < `head_dim`). The fused norm/rotary/store kernel covers none of these: such layers
    rotate and store through the unfused path on every backend.

    Tensor parallelism: `num_heads`/`num_kv_heads` are the model's; the layer holds this rank's
    heads (`distributed.state.HeadShard`), column-parallel q/k/v, row-parallel o_proj.
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
        v_norm: dict | None = None,  # RMSNorm kwargs (eps) when V is normed per head without weight
        k_eq_v: bool = False,
        kv_shared: bool = False,
        v_head_dim: int | None = None,  # default: head_dim
        v_scale: float | None = None,  # V *= v_scale before it is cached (MiMo-V2 attention_value_scale)
    ):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        self.num_heads_total, self.num_kv_heads_total = num_heads, num_kv_heads
        part = shard_heads(num_heads, num_kv_heads)
        self.q_start = part.q_start
        num_heads, num_kv_heads = part.num_heads, part.num_kv_heads
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        dv = self.v_head_dim = v_head_dim or head_dim
        if k_eq_v and dv != head_dim:
            raise ValueError("k_eq_v needs v_head_dim == head_dim")
        self.k_eq_v, self.kv_shared, self.v_scale = k_eq_v, kv_shared, v_scale
        q_size, k_size, v_size = num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * dv
        q = (part.q_start * head_dim, self.num_heads_total * head_dim)
        k = (part.kv_start * head_dim, self.num_kv_heads_total * head_dim)
        v = (part.kv_start * dv, self.num_kv_heads_total * dv)
        sizes, rows = ([q_size], [q]) if kv_shared else ([q_size, k_size], [q, k]) if k_eq_v else (
            [q_size, k_size, v_size], [q, k, v])
        self.qkv_proj = MergedLinear(hidden_size, sizes, qkv_bias, rows)
        self.o_proj = OutLinear(num_heads * dv, hidden_size, bias=o_bias,
                                shard=(part.q_start * dv, self.num_heads_total * dv))
        self.q_norm = RMSNorm(head_dim, **qk_norm) if qk_norm is not None else None
        self.k_norm = RMSNorm(head_dim, **qk_norm) if qk_norm is not None and not kv_shared else None
        self.v_norm = RMSNorm(head_dim, **v_norm, scale=False) if v_norm is not None and not kv_shared else None
        self.sinks = nn.Parameter(torch.empty(num_heads)) if sinks else None  # [num_heads]
        self.rotary = rotary
        self.fusable = dv == head_dim and v_scale is None and rotary.rotary_dim == head_dim
        self.spec = AttentionSpec(
            layer_id=layer_id,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            v_head_dim=dv,
            scaling=scaling,
            sliding_window=sliding_window,
            logit_softcap=logit_softcap,
        )

    def tp_slice(self, param_name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's query heads of the per-head sinks."""
        if param_name == "sinks" and tensor.shape[0] == self.num_heads_total != self.num_heads:
            return tensor.narrow(0, self.q_start, self.num_heads)
        return tensor

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch, partial_sums: bool = False) -> torch.Tensor:
        """`[num_tokens, hidden]` -> `[num_tokens, hidden]`, or o_proj's split-K partial sums
        (`OutLinear`) when `partial_sums` and the batch is decode-sized."""
        n = hidden.shape[0]
        backend = batch.attn_backend
        assert backend is not None, "ModelRunner sets batch.attn_backend before the model runs"
        qkv = self.qkv_proj(hidden)
        # Every Gemma/Llama/GPT-OSS form fuses; the torch-native oracle keeps the unfused path, as do
        # MiMo-V2's layers (narrow V, V scale, partial rotary: see the class docstring).
        fused = backend.fused_kv_store and self.fusable
        if fused:  # norm + rotary + K/V store in one launch, in place on qkv
            self._norm_rotate_store(qkv, batch)
        parts = qkv.split(self.qkv_proj.out_sizes, dim=-1)
        q = parts[0].view(n, self.num_heads, self.head_dim)
        k = v = None
        if not self.kv_shared:
            k = parts[1].view(n, self.num_kv_heads, self.head_dim)
            v = k if self.k_eq_v else parts[2].view(n, self.num_kv_heads, self.v_head_dim)
        if not fused:
            q, k, v = self._norm_rotate(q, k, v, batch)
        elif self.k_eq_v:
            v = None  # normed raw k, which the kernel only stored: the backend reads V back from the pool
        # A KV-shared layer's K/V are in the pool already: its source layer stored them this step.
        out = backend.forward(q, k, v, self.spec, batch, self.sinks, kv_stored=fused or self.kv_shared)
        return self.o_proj(out.reshape(n, self.num_heads * self.v_head_dim), partial_sums)

    def _norm_rotate(
        self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        if self.v_norm is not None:
            v = self.v_norm(v)  # before k is normed: with k_eq_v, v is the raw key projection
        if self.v_scale is not None and v is not None:
            v = v * self.v_scale
        if self.q_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k) if k is not None else None
        if v is k and v is not None:
            v = v.clone()  # the rotation below may run in place on k
        q, k = self.rotary(batch.positions, q, k, batch.scratch)
        return q, k, v

    def _norm_rotate_store(self, qkv: torch.Tensor, batch: ForwardBatch) -> None:
        """qkv `[num_tokens, sum(out_sizes)]`: q, k (and a normed V) rewritten in place, K/V stored;
        a KV-shared layer rewrites q only (its source layer stored the K/V)."""
        from swaserve.kernels.qk_norm_rope import qk_norm_rope_store

        assert batch.attn_backend is not None
        cos, sin = self.rotary.cos_sin(batch.positions, batch.scratch)
        k_buf = v_buf = locs = scales = None
        if not self.kv_shared:
            k_buf, v_buf, locs = batch.attn_backend.kv_target(self.spec, batch)
            scales = batch.attn_backend.kv_scales(self.spec)  # FP8 pools: quantised as stored
        qn, kn, vn = self.q_norm, self.k_norm, self.v_norm
        qk_norm_rope_store(
            qkv, self.num_heads, self.num_kv_heads, self.head_dim, cos, sin,
            qn.weight if qn is not None else None, kn.weight if kn is not None else None,
            qn.eps if qn is not None else 0.0, k_buf, v_buf, locs,
            unit_offset=qn.unit_offset if qn is not None else False,
            weight_fp32=qn.fp32_weight if qn is not None else False,
            v_norm=vn is not None, v_from_k=self.k_eq_v, v_eps=vn.eps if vn is not None else None,
            k_scale=scales[0] if scales is not None else None, v_scale=scales[1] if scales is not None else None,
        )
