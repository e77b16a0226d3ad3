"""qk_norm_rope_store (per-head q/k norm + rotary in place + K/V pool write) against the unfused torch
forms: RMSNorm per head, `_rotate`, and a plain index assignment into the pool."""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")

from swaserve.kernels.qk_norm_rope import qk_norm_rope_store  # noqa: E402
from swaserve.layers.norm import RMSNorm  # noqa: E402
from swaserve.layers.rotary import RotaryEmbedding, _rotate  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# Triton 3.9's CPU interpreter mishandles bf16 loads in these kernels (NaN); bf16 runs natively on
# the GPU (scripts/gpu_check.sh runs this directory with SWASERVE_KERNEL_TESTS_ON_GPU=1).
DTYPES = [torch.float32] if INTERPRET else [torch.float32, torch.bfloat16]
SLOTS = 40


def _case(seed, device, dtype, hq, hk, d, T=5, pad=0, norm=True, unit_offset=True, weight_fp32=False):
    """Inputs (qkv with `pad` extra columns per row, a strided view) and the unfused reference."""
    g = torch.Generator().manual_seed(seed)
    width = (hq + 2 * hk) * d
    qkv = (torch.randn(T, width + pad, generator=g) * 2).to(device, dtype)[:, :width]
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    positions = torch.randint(0, 8192, (T,), generator=g).to(device)
    cos, sin = RotaryEmbedding(inv_freq, attention_scaling=1.25).cos_sin(positions)
    q_norm = k_norm = None
    if norm:
        q_norm, k_norm = (RMSNorm(d, eps=1e-6, unit_offset=unit_offset, fp32_weight=weight_fp32)
                          for _ in range(2))
        for m in (q_norm, k_norm):
            with torch.no_grad():
                m.weight.copy_(torch.randn(d, generator=g) * 0.3)
        q_norm, k_norm = q_norm.to(device, dtype), k_norm.to(device, dtype)
    q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    q, k, v = q.reshape(T, hq, d), k.reshape(T, hk, d), v.reshape(T, hk, d)
    if norm:
        q, k = q_norm._reference(q), k_norm._reference(k)
    c, s = cos[:, None].to(dtype), sin[:, None].to(dtype)  # as RotaryEmbedding.forward on the CPU
    ref = torch.cat([_rotate(q, c, s).reshape(T, -1), _rotate(k, c, s).reshape(T, -1), v.reshape(T, -1)], -1)
    weights = (q_norm.weight, k_norm.weight) if norm else (None, None)
    return qkv, cos, sin, weights, ref, g


def _pool(hk, d, device, dtype=torch.float32):
    return (torch.full((SLOTS, hk, d), float("nan"), device=device, dtype=dtype),
            torch.full((SLOTS, hk, d), -7.0, device=device, dtype=dtype))


def _tol(dtype):
    return dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1.6e-2)


def _check_pool(k_buf, v_buf, ref, slots, hq, hk, d, dtype, seed):
    """Rows of tokens with a slot >= 0 land there; every other slot keeps its poison."""
    T = ref.shape[0]
    k_ref = ref[:, hq * d:(hq + hk) * d].reshape(T, hk, d)
    v_ref = ref[:, (hq + hk) * d:].reshape(T, hk, d)
    written = torch.zeros(SLOTS, dtype=torch.bool)
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        written[slot] = True
        torch.testing.assert_close(k_buf[slot].float(), k_ref[t].float(), **_tol(dtype), msg=f"seed={seed}")
        torch.testing.assert_close(v_buf[slot].float(), v_ref[t].float(), rtol=0, atol=0, msg=f"seed={seed}")
    assert torch.isnan(k_buf[~written]).all(), f"a k slot outside locs was written, seed={seed}"
    assert (v_buf[~written] == -7.0).all(), f"a v slot outside locs was written, seed={seed}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq, hk, d", [(8, 2, 16), (4, 1, 256), (2, 2, 80)])
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("loc_dtype", [torch.int32, torch.int64])
def test_qk_norm_rope_store_matches_unfused(device, seed, dtype, hq, hk, d, norm, loc_dtype):
    qkv, cos, sin, (qw, kw), ref, g = _case(seed, device, dtype, hq, hk, d, pad=24, norm=norm)
    assert qkv.stride(0) > qkv.shape[1]
    slots = torch.randperm(SLOTS - 1, generator=g)[: qkv.shape[0]] + 1
    slots[1] = -1  # skipped, never wrapped onto the last slot
    slots[3] = 0  # a padded token writes the dummy slot
    k_buf, v_buf = _pool(hk, d, device, dtype)
    qk_norm_rope_store(qkv, hq, hk, d, cos, sin, qw, kw, 1e-6, k_buf, v_buf, slots.to(device, loc_dtype))
    torch.testing.assert_close(qkv, ref, **_tol(dtype), msg=lambda m: f"seed={seed}: {m}")
    assert torch.equal(qkv[:, (hq + hk) * d:], ref[:, (hq + hk) * d:]), "v must be left as it was"
    k_got = qkv[:, hq * d:(hq + hk) * d].reshape(-1, hk, d)
    for t, slot in enumerate(slots.tolist()):  # the pool holds exactly the k left in qkv
        assert slot < 0 or torch.equal(k_buf[slot], k_got[t]), f"seed={seed}"
    _check_pool(k_buf.cpu(), v_buf.cpu(), ref.cpu(), slots, hq, hk, d, dtype, seed)


@pytest.mark.parametrize("form", [dict(unit_offset=True), dict(unit_offset=False),
                                  dict(unit_offset=False, weight_fp32=True)])
def test_qk_norm_rope_store_loc_map(device, seed, form):
    """Full-pool locs translated through full_to_swa on the fly; a -1 loc and a map entry of -1 are
    skipped. All three norm forms (Gemma, Llama, fp32 weight)."""
    hq, hk, d, T = 4, 2, 64, 6
    qkv, cos, sin, (qw, kw), ref, g = _case(seed, device, torch.float32, hq, hk, d, T=T, **form)
    full = 60
    f2s = torch.zeros(full + 2, dtype=torch.int32)
    f2s[-1] = -1
    full_locs = torch.randperm(full, generator=g)[:T] + 1
    swa_slots = torch.randperm(SLOTS - 1, generator=g)[:T].int() + 1
    f2s[full_locs] = swa_slots
    locs = full_locs.clone()
    locs[1] = -1  # sentinel: must stay -1 (not index the table from its end)
    locs[4] = full + 1  # maps to the trailing -1
    expect = swa_slots.clone()
    expect[1] = expect[4] = -1
    k_buf, v_buf = _pool(hk, d, device)
    qk_norm_rope_store(qkv, hq, hk, d, cos, sin, qw, kw, 1e-6, k_buf, v_buf, locs.to(device),
                       loc_map=f2s.to(device), **form)
    torch.testing.assert_close(qkv, ref, rtol=1e-5, atol=1e-5, msg=lambda m: f"seed={seed}: {m}")
    _check_pool(k_buf.cpu(), v_buf.cpu(), ref.cpu(), expect, hq, hk, d, torch.float32, seed)


def test_qk_norm_rope_store_casts_to_pool_dtype(device, seed):
    """An fp32 qkv into a bf16 pool: stored values are the rounded rotated k and the rounded v."""
    hq, hk, d = 2, 1, 32
    qkv, cos, sin, (qw, kw), ref, _ = _case(seed, device, torch.float32, hq, hk, d, T=3)
    k_buf = torch.zeros(SLOTS, hk, d, device=device, dtype=torch.bfloat16)
    v_buf = torch.zeros_like(k_buf)
    slots = torch.tensor([5, 9, 2])
    qk_norm_rope_store(qkv, hq, hk, d, cos, sin, qw, kw, 1e-6, k_buf, v_buf, slots.to(device))
    # The 3.9 interpreter truncates fp32 -> bf16 (GPU rounds to nearest even): allow 1 ulp.
    tol = dict(rtol=2**-7, atol=1e-5)
    ref, k_got, v_got = ref.cpu(), k_buf.cpu()[slots].float(), v_buf.cpu()[slots].float()
    torch.testing.assert_close(k_got, ref[:, hq * d:(hq + hk) * d].reshape(3, hk, d), **tol)
    torch.testing.assert_close(v_got, ref[:, (hq + hk) * d:].reshape(3, hk, d), **tol)


def test_qk_norm_rope_store_empty(device):
    d = 16
    qkv = torch.zeros(0, 3 * d, device=device)
    cos = torch.zeros(0, d // 2, device=device)
    k_buf = torch.zeros(4, 1, d, device=device)
    qk_norm_rope_store(qkv, 1, 1, d, cos, cos, None, None, 1e-6, k_buf, k_buf.clone(),
                       torch.zeros(0, dtype=torch.int64, device=device))
    assert not k_buf.any()
