"""Pool sizing: split a KV byte budget between the full pool and the SWA pool, and how many requests
of a given length the pools hold at once.

A request at context L holds up to L full-pool slots. In the SWA pool it keeps at most
K = `swa_slots_kept(W, margin, evict_chunk)` = W - 2 + margin + chunk slots right after out-of-window
freeing (`memory.window`, at most L), plus whatever one step adds on top before the next freeing: one
decode token per request, or a prefill chunk (at most the step budget, shared by a step's requests).
Sizing both pools in the ratio S : L with S = min(L, W + margin + chunk) for a planned request length L,
plus one step budget of SWA headroom, makes a workload of L-token requests fill both pools at about the
same time; shorter requests fill the SWA pool first, longer ones the full pool. L is the max context
unless the caller plans for shorter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from swaserve.memory.window import swa_slots_kept
from swaserve.model_config import KVGroup


@dataclass(frozen=True)
class MemoryPlan:
    """Pool sizes derived at run time; `swa_tokens == 0` means no SWA pool (non-hybrid)."""

    full_tokens: int
    swa_tokens: int
    full_bytes_per_token: int  # every layer cached in the full pool, summed
    swa_bytes_per_token: int
    swa_tokens_per_request: int  # the split's SWA share of a request: W + margin + chunk, at most max_context
    max_context: int
    hybrid: bool
    full_group: KVGroup | None = None  # the K/V shape of each pool, for `describe`
    swa_group: KVGroup | None = None
    kv_shared_layers: int = 0  # layers reading another layer's K/V: no bytes in either pool
    planned_request_tokens: int = 0  # the request length the split was sized for (hybrid plans)
    swa_kept_per_request: int = 0  # hybrid plans: SWA slots a request keeps right after out-of-window freeing
    step_tokens: int = 0  # new tokens one step adds at most (the prefill budget), on top of what is kept
    full_dtype: torch.dtype | None = None  # storage dtype of the full pool (every layer without a hybrid SWA pool)
    swa_dtype: torch.dtype | None = None  # of the hybrid SWA pool

    def kv_dtype_bits(self, pool: str) -> int:
        """Bits per stored K/V element of pool "full" or "swa" (0: no such pool or dtype unknown)."""
        dtype = self.full_dtype if pool == "full" else (self.swa_dtype if self.hybrid else None)
        return torch.empty((), dtype=dtype).element_size() * 8 if dtype is not None else 0

    @property
    def total_bytes(self) -> int:
        return self.full_tokens * self.full_bytes_per_token + self.swa_tokens * self.swa_bytes_per_token

    def max_concurrent_requests(self, context: int) -> int:
        """How many requests of `context` tokens (prompt + output) fit at once, whatever the split of
        their tokens between prompt and output: none of them is ever retracted or kept waiting for
        memory (tests/unit/test_capacity.py runs it).

        Full pool: n * context <= full_tokens. SWA pool: a request holds at most `context` slots,
        and right after out-of-window freeing at most K = `swa_kept_per_request`; one step adds at
        most max(step budget, one decode token per request) before the next freeing, and a prompt is
        admitted only with a slot left for each running request's next decode token (up to n - 1 beyond
        the K each keeps), so n requests fit if
        min(n * context, n * K + max(step_tokens, n) + max(0, n - 1 - K)) <= swa_tokens."""
        if context <= 0:
            raise ValueError("context must be positive")
        n = self.full_tokens // context
        if self.hybrid:
            n = min(n, self._swa_fit(context))
        return n

    def _swa_fit(self, context: int) -> int:
        """The largest n with min(n * context, n * K + max(step, n) + max(0, n - 1 - K)) <= swa_tokens. The
        last term is the scheduler's admission reserve: a prompt starts only if the SWA pool also leaves a
        slot for each running request's next decode token (`Scheduler._schedule_extend`), up to n - 1 of
        them beside the K each keeps, which out-of-window freeing hands back first only where K covers them
        (windows of a few tokens, or more requests than K). Both sides grow with n: a binary search."""
        swa, step, kept = self.swa_tokens, self.step_tokens, min(context, self.swa_kept_per_request)

        def fits(n: int) -> bool:
            return min(n * context, n * kept + max(step, n) + max(0, n - 1 - kept)) <= swa

        lo, hi = 0, swa  # fits(0); every request needs a slot, so n <= swa
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
        return lo

    def describe(self) -> str:
        """One line: each pool's tokens, K/V shape and bytes per token, and the total."""
        mib = 1 << 20

        def shape(*groups: KVGroup | None) -> str:
            parts = [g.describe() for g in groups if g is not None and g.num_layers]
            return f"{' + '.join(parts)}, " if parts else ""

        def dt(dtype: torch.dtype | None) -> str:
            return "" if dtype is None else f"{kv_dtype_name(dtype)}, "

        if self.hybrid:
            s = (f"hybrid: full pool {self.full_tokens} tokens ({shape(self.full_group)}{dt(self.full_dtype)}"
                 f"{self.full_bytes_per_token} B/token), "
                 f"SWA pool {self.swa_tokens} tokens ({shape(self.swa_group)}{dt(self.swa_dtype)}"
                 f"{self.swa_bytes_per_token} B/token)")
        else:
            s = (f"single index space: {self.full_tokens} tokens "
                 f"({shape(self.full_group, self.swa_group)}{dt(self.full_dtype)}{self.full_bytes_per_token} B/token)")
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
    swa_dtype: torch.dtype | None = None,
) -> MemoryPlan:
    """Size the pools for `budget_bytes` of K/V, stored as `dtype` (the full pool) and `swa_dtype`
    (a hybrid SWA pool; default `dtype`): FP8 pools take 1 byte per element.

    With `hybrid=False` (or a model with no SWA layers) every layer is cached in the full pool.
    `request_tokens`: the request length (prompt + output) the split is sized for (default and at most
    `max_context`). `swa_full_tokens_ratio` overrides the SWA:full token ratio the planner would pick.
    """
    if budget_bytes <= 0:
        raise ValueError("KV budget must be positive")
    hybrid = hybrid and swa_group.num_layers > 0
    swa_dtype = (swa_dtype or dtype) if hybrid else dtype
    full_b = full_group.bytes_per_token(dtype)
    swa_b = swa_group.bytes_per_token(swa_dtype)
    if not hybrid:
        per_token = full_b + swa_b
        tokens = budget_bytes // per_token
        if tokens < 1:
            raise ValueError(f"KV budget {budget_bytes} B holds no token ({per_token} B/token)")
        return MemoryPlan(int(tokens), 0, per_token, 0, 0, max_context, hybrid=False, full_group=full_group,
                          swa_group=swa_group, kv_shared_layers=kv_shared_layers, full_dtype=dtype)
    assert window is not None
    swa_per_req = min(max_context, window + evict_margin + evict_chunk)
    kept = min(max_context, swa_slots_kept(window, evict_margin, evict_chunk))
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
                      planned_request_tokens=planned, swa_kept_per_request=kept, step_tokens=prefill_chunk,
                      full_dtype=dtype, swa_dtype=swa_dtype)


def kv_dtype_name(dtype: torch.dtype) -> str:
    """How the options and logs name a KV storage dtype: fp8_e4m3, bfloat16, float16, float32."""
    return "fp8_e4m3" if dtype == torch.float8_e4m3fn else str(dtype).removeprefix("torch.")
