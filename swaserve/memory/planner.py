"""Pool sizing: split a KV byte budget between the full pool and the SWA pool.

A request at context L holds L full-pool slots and at most min(L, S) SWA-pool slots, where
S = W + margin + evict_chunk is the eviction bound of `memory.window`. Sizing both pools in the
ratio min(L, S) : L for a planned request length L (plus one prefill chunk of SWA headroom) makes a
workload of L-token requests fill both pools at about the same time; shorter requests fill the SWA
pool first, longer ones the full pool. L is the max context unless the caller plans for shorter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from swaserve.config import KVGroup


@dataclass(frozen=True)
class MemoryPlan:
    """Pool sizes derived at run time; `swa_tokens == 0` means no SWA pool (non-hybrid)."""

    full_tokens: int
    swa_tokens: int
    full_bytes_per_token: int  # every layer cached in the full pool, summed
    swa_bytes_per_token: int
    swa_tokens_per_request: int  # at max context: the eviction bound, capped by the context
    max_context: int
    hybrid: bool
    full_group: KVGroup | None = None  # the K/V shape of each pool, for `describe`
    swa_group: KVGroup | None = None
    kv_shared_layers: int = 0  # layers reading another layer's K/V: no bytes in either pool
    planned_request_tokens: int = 0  # the request length the split was sized for (hybrid plans)

    @property
    def total_bytes(self) -> int:
        return self.full_tokens * self.full_bytes_per_token + self.swa_tokens * self.swa_bytes_per_token

    def max_concurrent_requests(self, context: int) -> int:
        """How many requests of `context` tokens (prompt + output) fit at once."""
        if context <= 0:
            raise ValueError("context must be positive")
        n = self.full_tokens // context
        if self.hybrid:
            n = min(n, self.swa_tokens // min(context, self.swa_tokens_per_request))
        return n

    def describe(self) -> str:
        """One line: each pool's tokens, K/V shape and bytes per token, and the total."""
        mib = 1 << 20

        def shape(*groups: KVGroup | None) -> str:
            parts = [g.describe() for g in groups if g is not None and g.num_layers]
            return f"{' + '.join(parts)}, " if parts else ""

        if self.hybrid:
            s = (f"hybrid: full pool {self.full_tokens} tokens ({shape(self.full_group)}{self.full_bytes_per_token} B/token), "
                 f"SWA pool {self.swa_tokens} tokens ({shape(self.swa_group)}{self.swa_bytes_per_token} B/token)")
        else:
            s = (f"single index space: {self.full_tokens} tokens "
                 f"({shape(self.full_group, self.swa_group)}{self.full_bytes_per_token} B/token)")
        if self.kv_shared_layers:
            s += f", {self.kv_shared_layers} KV-shared layers (no K/V of their own)"
        return s + f", {self.total_bytes / mib:.1f} MiB"


def plan_memory(
    budget_bytes: int,
    full_group: KVGroup,
    swa_group: KVGroup,
    dtype: torch.dtype,
    max_context: int,
    window: int | None,
    *,
    hybrid: bool = True,
    swa_full_tokens_ratio: float | None = None,
    evict_margin: int = 1,
    evict_chunk: int = 64,
    prefill_chunk: int = 0,
    kv_shared_layers: int = 0,
    request_tokens: int | None = None,
) -> MemoryPlan:
    """Size the pools for `budget_bytes` of K/V.

    With `hybrid=False` (or a model with no SWA layers) every layer is cached in the full pool.
    `request_tokens`: the request length (prompt + output) the split is sized for (default and at most
    `max_context`). `swa_full_tokens_ratio` overrides the SWA:full token ratio the planner would pick.
    """
    if budget_bytes <= 0:
        raise ValueError("KV budget must be positive")
    full_b = full_group.bytes_per_token(dtype)
    swa_b = swa_group.bytes_per_token(dtype)
    hybrid = hybrid and swa_group.num_layers > 0
    if not hybrid:
        per_token = full_b + swa_b
        tokens = budget_bytes // per_token
        if tokens < 1:
            raise ValueError(f"KV budget {budget_bytes} B holds no token ({per_token} B/token)")
        return MemoryPlan(int(tokens), 0, per_token, 0, 0, max_context, hybrid=False, full_group=full_group,
                          swa_group=swa_group, kv_shared_layers=kv_shared_layers)
    assert window is not None
    swa_per_req = min(max_context, window + evict_margin + evict_chunk)
    planned = max_context if request_tokens is None else min(request_tokens, max_context)
    if planned < 1:
        raise ValueError("request_tokens must be positive")
    ratio = swa_full_tokens_ratio if swa_full_tokens_ratio is not None else min(swa_per_req, planned) / planned
    if ratio <= 0:
        raise ValueError("swa_full_tokens_ratio must be positive")
    # Headroom for one prefill chunk in the SWA pool: a chunk holds its new tokens before eviction.
    headroom = prefill_chunk if swa_full_tokens_ratio is None else 0
    full_tokens = (budget_bytes - headroom * swa_b) / (full_b + ratio * swa_b)
    if full_tokens < 1:
        raise ValueError(f"KV budget {budget_bytes} B is too small for one token in both pools")
    full_tokens = int(full_tokens)
    swa_tokens = int(full_tokens * ratio) + headroom
    return MemoryPlan(full_tokens, swa_tokens, full_b, swa_b, swa_per_req, max_context, hybrid=True,
                      full_group=full_group, swa_group=swa_group, kv_shared_layers=kv_shared_layers,
                      planned_request_tokens=planned)
