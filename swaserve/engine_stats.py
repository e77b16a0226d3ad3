"""What an engine (`swaserve.engine.Engine`, passed in) reports: its counters (`LLM.stats()`, the names
/metrics exports), its pools' occupancy (`memory_stats`) and storage dtypes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from swaserve.grammar import GrammarCompiler
from swaserve.memory.planner import kv_dtype_name


@dataclass
class EngineStats:
    """The engine's own running totals (the rest of `engine_counters` is read from its parts)."""

    prompt_tokens_total: int = 0
    retractions_total: int = 0
    step_wait_seconds: float = 0.0  # the step loop blocked on the device for a step's tokens
    grammar_rejected: int = 0  # sampled tokens a grammar refused (0 unless one was drawn past its mask)


def engine_counters(engine: Any) -> dict[str, int]:
    """`memory_stats()` plus the token, retraction and prefix-cache totals: the names /metrics
    exports. `prefix_cache_hit_tokens_total` + `prefix_cache_miss_tokens_total` = prompt tokens
    of every sequence's first admission (n > 1 counts each sequence)."""
    prefix = engine.scheduler.prefix
    hit, query = (prefix.hit_tokens, prefix.query_tokens) if prefix is not None else (0, 0)
    spec = engine.scheduler.speculation
    return {**engine.memory_stats(), "prompt_tokens_total": engine.stats.prompt_tokens_total,
            "generation_tokens_total": engine.scheduler.generated_total,
            "retractions_total": engine.stats.retractions_total,
            "prefix_cache_hit_tokens_total": hit, "prefix_cache_miss_tokens_total": query - hit,
            "spec_draft_tokens_total": spec.drafted_total if spec is not None else 0,
            "spec_accepted_tokens_total": spec.accepted_total if spec is not None else 0,
            "prompt_logprob_tokens_total": engine.launcher.prompt_tokens_scored,
            "grammar_mask_fill_ms_total": int(engine.launcher.mask_fill_seconds * 1000),
            "grammar_mask_wait_ms_total": int(engine.launcher.mask_wait_seconds * 1000),
            "grammar_masked_rows_total": engine.launcher.masked_rows,
            "grammar_rejected_tokens_total": engine.stats.grammar_rejected + engine.launcher.grammar_rejected,
            "step_wait_ms_total": int(engine.stats.step_wait_seconds * 1000),
            **(engine.grammars.counters() if engine.grammars is not None
               else GrammarCompiler.idle_counters())}


def memory_stats(engine: Any) -> dict[str, int]:
    """Per pool: `used` (held by requests, or by cache they lock), `cached` (held by the prefix
    cache, locked or not), `total`. Slots neither used nor free are unlocked cache, which an
    allocation evicts when it needs them: used + free + (cached - locked cache) = total. And each
    pool's storage width (`*_kv_dtype_bits`; the dtypes by name: `kv_cache_dtypes()`)."""
    alloc = engine.allocator
    full = getattr(alloc, "full", alloc)
    swa = getattr(alloc, "swa", None)
    prefix = engine.scheduler.prefix
    cache = prefix.cache if prefix is not None else None
    return {
        "full_tokens_used": full.used() - (cache.full_evictable if cache is not None else 0),
        "full_tokens_cached": cache.full_cached if cache is not None else 0,
        "full_tokens_total": full.size,
        "swa_tokens_used": (swa.used() - (cache.swa_evictable if cache is not None else 0))
        if swa is not None else 0,
        "swa_tokens_cached": cache.swa_cached if cache is not None else 0,
        "swa_tokens_total": swa.size if swa is not None else 0,
        # Bits per stored K/V element: 8 for an FP8 (e4m3) pool, 16 for bf16/fp16, 0 without the pool.
        "full_kv_dtype_bits": engine.plan.kv_dtype_bits("full"),
        "swa_kv_dtype_bits": engine.plan.kv_dtype_bits("swa"),
        "running": len(engine.scheduler.running),
        "waiting": len(engine.scheduler.waiting),
        "retractions": engine.scheduler.retractions_total,
    }


def kv_cache_dtypes(plan: Any) -> dict[str, str]:
    """Each pool's K/V storage dtype by name ("full", and "swa" for a hybrid SWA pool): e.g.
    {"full": "fp8_e4m3", "swa": "bfloat16"}."""
    out = {"full": kv_dtype_name(plan.full_dtype)} if plan.full_dtype is not None else {}
    if plan.hybrid and plan.swa_dtype is not None:
        out["swa"] = kv_dtype_name(plan.swa_dtype)
    return out
