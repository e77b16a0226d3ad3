"""Attention backend interface: builds per-step index metadata and computes attention per layer."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from swaserve.memory.req_to_token import ReqToTokenPool
    from swaserve.memory.swa import SWAKVPool
    from swaserve.runner.forward_batch import ForwardBatch


@dataclass(frozen=True)
class AttentionSpec:
    """Static description of one attention layer, as the backend needs it."""

    layer_id: int
    num_heads: int
    num_kv_heads: int
    head_dim: int  # q/k head dim
    v_head_dim: int
    scaling: float
    sliding_window: int | None = None  # W keys including the current one; None = full attention
    logit_softcap: float | None = None  # logits -> cap * tanh(logits / cap)


class AttentionBackend(ABC):
    """Owns how attention reads the KV pools.

    Contract (DESIGN.md §5): K/V of new tokens are written at `batch.out_cache_loc` for full-pool
    layers and at the translated SWA slots for layers stored in the SWA pool; every index list
    handed to an SWA-pool layer is in SWA space. The window: a query at p sees keys p-W+1 .. p.
    """

    # True if a layer may write its new K/V itself, fused with its q/k norm and rotary, at
    # `kv_target(...)`, and then call `forward(..., kv_stored=True)`.
    fused_kv_store: bool = False
    # True if an extend step (prefill chunks, mixed steps) can run on static request buffers with a
    # grid fixed by its token count, so a CUDA graph can record it whole (`captured_extend_metadata`).
    captures_extend: bool = False

    def __init__(self, kv: SWAKVPool, req_to_token: ReqToTokenPool, full_to_swa: torch.Tensor | None):
        self.kv = kv
        self.req_to_token = req_to_token
        self.full_to_swa = full_to_swa  # [full_size+2] int32, device; None without an SWA pool

    def kv_target(self, spec: AttentionSpec, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`(k_buf, v_buf, locs)`: where this step's new K/V of layer `spec.layer_id` go, `locs` in
        the layer's own index space (SWA slots for a layer in the SWA pool). Needs the metadata."""
        lid = spec.layer_id
        if self.kv.uses_swa_space(lid):
            assert spec.sliding_window is not None, f"full-attention layer {lid} stored in the SWA pool"
            locs = batch.attn_metadata.swa_out_cache_loc
            assert locs is not None, f"layer {lid} lives in the SWA pool but no SWA write locations were built"
        else:
            locs = batch.out_cache_loc
        return self.kv.k_buffer(lid), self.kv.v_buffer(lid), locs

    def kv_scales(self, spec: AttentionSpec) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`(k_scale, v_scale)` (`[1]` float32, device) a store at `kv_target` quantises with, where
        the layer's pool is FP8 e4m3; None for a pool in the compute dtype."""
        return self.kv.kv_scales(spec.layer_id)

    @abstractmethod
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Build index lists for both index spaces and store them in `batch.attn_metadata`."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor | None,  # [num_tokens, num_kv_heads, head_dim]; may be None when kv_stored
        v: torch.Tensor | None,  # [num_tokens, num_kv_heads, v_head_dim]; may be None when kv_stored
        spec: AttentionSpec,
        batch: ForwardBatch,
        sinks: torch.Tensor | None = None,  # [num_heads] float: per-head sink logits (GPT-OSS)
        kv_stored: bool = False,
    ) -> torch.Tensor:
        """Store k/v into the layer's pool (unless `kv_stored`: the layer wrote them at `kv_target`
        itself, fused with its norms, or it is a KV-shared layer whose source layer wrote them this
        step), then attend; returns `[num_tokens, num_heads, v_head_dim]`. With `kv_stored`, k/v may
        be None and are then read back from the pool where a kernel needs them."""
