"""FP8 KV cache, host side: the options (values, combinations refused, CLI flags), the pools' storage
(quantise on write, dequantise on read, saturation, scales), and the planner counting one byte per
element (about twice bf16's KV tokens, per pool)."""

from __future__ import annotations

import argparse

import pytest
import torch

from swaserve.config import CacheConfig, split_engine_options
from swaserve.memory.kv_pool import FP8_KV, KVPool, dequantize_kv, quantize_kv
from swaserve.memory.planner import plan_memory
from swaserve.model_config import KVGroup
from swaserve.options import add_engine_flags, engine_options

# Gemma 3 27B's K/V: 10 full and 52 sliding layers of 16 heads x 128; window 1024.
FULL_27B = KVGroup(tuple(range(10)), 16, 128, 128)
SWA_27B = KVGroup(tuple(range(10, 62)), 16, 128, 128)


@pytest.mark.parametrize("options,match", [
    ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype must be one of auto, fp8_e4m3, got 'fp8'"),
    ({"kv_cache_dtype": "int8"}, "kv_cache_dtype must be one of"),
    ({"swa_kv_cache_dtype": "bf16"}, "swa_kv_cache_dtype must be one of"),
    ({"swa_kv_cache_dtype": "auto", "disable_hybrid_swa": True}, "disable_hybrid_swa caches every layer"),
    ({"kv_cache_dtype": "fp8_e4m3", "dtype": torch.bfloat16}, "give the KV dtype once"),
])
def test_bad_kv_cache_dtype_options_are_refused(options, match):
    with pytest.raises(ValueError, match=match):
        split_engine_options(options)


def test_kv_dtypes_per_pool():
    fp8, bf16 = torch.float8_e4m3fn, torch.bfloat16
    assert CacheConfig().kv_dtypes(bf16) == (bf16, bf16)
    assert CacheConfig(kv_cache_dtype="fp8_e4m3").kv_dtypes(bf16) == (fp8, fp8)
    assert CacheConfig(kv_cache_dtype="fp8_e4m3", swa_kv_cache_dtype="auto").kv_dtypes(bf16) == (fp8, bf16)
    assert CacheConfig(swa_kv_cache_dtype="fp8_e4m3").kv_dtypes(bf16) == (bf16, fp8)


def test_cli_flags_come_from_the_option_declarations():
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    args = parser.parse_args(["--kv-cache-dtype", "fp8_e4m3", "--swa-kv-cache-dtype", "auto"])
    assert engine_options(args) == {"kv_cache_dtype": "fp8_e4m3", "swa_kv_cache_dtype": "auto"}
    with pytest.raises(SystemExit):  # argparse names the choices
        parser.parse_args(["--kv-cache-dtype", "fp16"])


def test_fp8_pool_quantises_on_write_and_dequantises_on_read():
    pool = KVPool(6, 2, 2, 8, 4, dtype=FP8_KV)
    assert pool.bytes_per_token() == 2 * 2 * (8 + 4) and pool.k_buffer(1).dtype == FP8_KV
    pool.set_scales(1, 0.5, 4.0)
    k = torch.randn(3, 2, 8) * 3
    v = torch.randn(3, 2, 4) * 3
    k[0, 0, 0], v[0, 0, 0] = 1e5, -1e5  # saturate at +-448 * scale
    locs = torch.tensor([4, 1, 6])
    pool.set_kv(1, locs, k, v)
    got_k, got_v = pool.read(1, locs), pool.read(1, locs, value=True)
    assert got_k.dtype == torch.float32
    assert float(got_k[0, 0, 0]) == 448 * 0.5 and float(got_v[0, 0, 0]) == -448 * 4.0
    ok = torch.ones_like(k, dtype=torch.bool)
    ok[0, 0, 0] = False
    # e4m3: 3 mantissa bits, so within 2^-4 relative (or the smallest subnormal step near 0)
    assert ((got_k - k).abs() <= k.abs() * 2**-4 + 0.5 * 2**-9)[ok].all()
    assert torch.equal(got_k, dequantize_kv(quantize_kv(k, torch.tensor(0.5)), torch.tensor(0.5)).clamp(-224, 224))
    assert not pool.read(0, locs).any(), "another layer's buffer stays untouched"
    with pytest.raises(ValueError, match="positive and finite"):
        pool.set_scales(0, 0.0, 1.0)


def test_model_dtype_pool_has_no_scales():
    pool = KVPool(4, 1, 1, 8, dtype=torch.bfloat16)
    assert pool.scales(0) is None and pool.k_scale is None


def test_planner_counts_one_byte_per_fp8_element():
    """Gemma 3 27B, 40 GiB of KV, split for 32k-token requests: FP8 everywhere holds 26 such requests
    where bf16 holds 12 (a little over twice: the SWA pool's one-step headroom is fixed in tokens, so
    half its bytes); FP8 only in the full pool (the SWA pool in bf16) holds 21, the SWA pool being a
    small share of the bytes at that length. Split for the default 4096-token requests that share is
    large: full-only FP8 gains 1.27x (62 requests against 49), FP8 everywhere 2.1x (103)."""
    budget = 40 << 30
    kw = dict(max_context=32768, window=1024, prefill_chunk=8192)

    def plans(request_tokens: int):
        return [plan_memory(budget, FULL_27B, SWA_27B, dtype, swa_dtype=swa, request_tokens=request_tokens, **kw)
                for dtype, swa in ((torch.bfloat16, None), (FP8_KV, None), (FP8_KV, torch.bfloat16))]

    bf16, fp8, full_only = plans(32768)
    assert fp8.full_bytes_per_token * 2 == bf16.full_bytes_per_token == 10 * 16 * 256 * 2
    assert fp8.swa_bytes_per_token * 2 == bf16.swa_bytes_per_token == full_only.swa_bytes_per_token == 52 * 16 * 256 * 2
    assert 2.0 < fp8.full_tokens / bf16.full_tokens < 2.1 and 1.7 < full_only.full_tokens / bf16.full_tokens < 1.78
    assert [p.max_concurrent_requests(32768) for p in (bf16, fp8, full_only)] == [12, 26, 21]
    assert all(p.total_bytes <= budget for p in (bf16, fp8, full_only))
    assert fp8.kv_dtype_bits("full") == 8 and full_only.kv_dtype_bits("swa") == 16
    assert "fp8_e4m3, 40960 B/token" in full_only.describe() and "bfloat16, 425984 B/token" in full_only.describe()
    assert [p.max_concurrent_requests(4096) for p in plans(4096)] == [49, 103, 62]


def test_single_index_space_uses_the_full_pools_dtype():
    plan = plan_memory(1 << 26, FULL_27B, SWA_27B, FP8_KV, 4096, 1024, hybrid=False, swa_dtype=torch.bfloat16)
    assert not plan.hybrid and plan.full_bytes_per_token == 62 * 16 * 256
    assert plan.kv_dtype_bits("full") == 8 and plan.kv_dtype_bits("swa") == 0
