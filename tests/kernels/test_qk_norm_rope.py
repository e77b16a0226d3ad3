"""qk_norm_rope_store (per-head q/k norm + rotary in place + K/V pool write) against the unfused torch
forms: RMSNorm per head, `_rotate`, and a plain index assignment into the pool; Gemma 4's forms (V norm,
K = V, q only) also through SelfAttention's fused path against its unfused one."""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")

from kernel_ref import gemma4_attention, run_both_paths  # noqa: E402

from swaserve.kernels.qk_norm_rope import qk_norm_rope_store  # noqa: E402
from swaserve.layers.norm import RMSNorm  # noqa: E402
from swaserve.layers.rotary import RotaryEmbedding, _proportional, _rotate  # noqa: E402

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


# ---- Gemma 4's forms, against the layer's own unfused path (`SelfAttention._norm_rotate`) ----------

GEMMA4_FORMS = ["v_norm", "k_eq_v", "kv_shared"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq, hk, d", [(4, 2, 256), (4, 1, 512), (8, 2, 16)])
@pytest.mark.parametrize("form", GEMMA4_FORMS)
def test_gemma4_forms_fused_match_unfused_layer(device, seed, dtype, hq, hk, d, form):
    """SelfAttention's fused path (one `qk_norm_rope_store` launch) against its unfused path on the
    same inputs: q handed to attention, the pool's K/V, and any k/v handed over with the K/V already
    stored equal what the unfused path computed (the extend kernel reads them as the new tokens' K/V)."""
    g = torch.Generator().manual_seed(seed)
    attn = gemma4_attention(form, hq, hk, d, dtype, device, g)
    T = 6
    hidden = (torch.randn(T, 32, generator=g) * 3).to(device, dtype)
    positions = torch.randint(0, 8192, (T,), generator=g).to(device)
    slots = torch.randperm(SLOTS - 1, generator=g)[:T] + 1
    slots[2] = -1  # skipped
    res = run_both_paths(attn, hidden, positions, slots.to(device), lambda: _pool(hk, d, device, dtype))
    (ref, *ref_pools), (got, *got_pools) = res[False], res[True]
    assert got["kv_stored"], "the fused path stored the K/V (or has none to store)"
    tol = _tol(dtype)
    torch.testing.assert_close(got["q"], ref["q"], **tol, msg=lambda m: f"q, seed={seed}: {m}")
    for name in ("k", "v"):
        if form == "kv_shared":
            assert got[name] is None and ref[name] is None
        elif got[name] is not None:
            torch.testing.assert_close(got[name], ref[name], **tol, msg=lambda m, n=name: f"{n}, seed={seed}: {m}")
    if form == "k_eq_v":
        assert got["v"] is None, "k_eq_v's V exists only in the pool: the backend must read it back"
    # NaN / -7 poison on both sides: unwritten slots compare equal, skipped tokens leave theirs.
    for buf_ref, buf_got, name in zip(ref_pools, got_pools, ("k pool", "v pool")):
        torch.testing.assert_close(buf_got.cpu(), buf_ref.cpu(), **tol, equal_nan=True,
                                   msg=lambda m, n=name: f"{n} seed={seed}: {m}")
    if form == "kv_shared":
        k_pool, v_pool = got_pools
        assert torch.isnan(k_pool).all() and (v_pool == -7.0).all(), "a KV-shared layer stores nothing"


def _gemma4_inputs(seed, device, dtype, hq, hk, d, v_from_k, T=5):
    """qkv (strided rows), proportional-RoPE cos/sin, fp32-weight q/k norms, a weightless V norm."""
    g = torch.Generator().manual_seed(seed)
    nkv = hk if v_from_k else 2 * hk
    qkv = (torch.randn(T, (hq + nkv) * d + 8, generator=g) * 2).to(device, dtype)[:, : (hq + nkv) * d]
    rope = RotaryEmbedding(_proportional({"partial_rotary_factor": 0.25}, 1e6, d))
    cos, sin = rope.cos_sin(torch.randint(0, 8192, (T,), generator=g).to(device))
    norms = [RMSNorm(d, eps=1e-6, fp32_weight=True) for _ in range(2)]
    for m in norms:
        with torch.no_grad():
            m.weight.copy_(torch.randn(d, generator=g) * 0.3)
    return qkv, cos, sin, [m.to(device, dtype) for m in norms], RMSNorm(d, eps=0.1, scale=False), g


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq, hk, d", [(4, 2, 256), (2, 1, 512), (4, 2, 16)])
@pytest.mark.parametrize("v_from_k", [False, True])
@pytest.mark.parametrize("v_norm", [True, False])
def test_qk_norm_rope_store_v_forms(device, seed, dtype, hq, hk, d, v_from_k, v_norm):
    """`v_norm` and `v_from_k` against RMSNorm (fp32 weight) + `_rotate` + index assignment, with a
    full-to-SWA loc map: V is the weightless RMS norm (own eps) of v, or of the raw k before its norm."""
    qkv, cos, sin, (qn, kn), vn, g = _gemma4_inputs(seed, device, dtype, hq, hk, d, v_from_k)
    T = qkv.shape[0]
    q, k = qkv[:, : hq * d].reshape(T, hq, d), qkv[:, hq * d : (hq + hk) * d].reshape(T, hk, d)
    v = k if v_from_k else qkv[:, (hq + hk) * d :].reshape(T, hk, d)
    v_ref = vn(v) if v_norm else v.clone()
    c, s = cos[:, None].to(dtype), sin[:, None].to(dtype)
    q_ref, k_ref = _rotate(qn(q), c, s), _rotate(kn(k), c, s)
    f2s = torch.zeros(50, dtype=torch.int32)
    f2s[-1] = -1
    full_locs = torch.randperm(48, generator=g)[:T] + 1
    swa = torch.randperm(SLOTS - 1, generator=g)[:T].int() + 1
    f2s[full_locs] = swa
    full_locs[3] = 49  # maps to -1: skipped
    k_buf, v_buf = _pool(hk, d, device, dtype)
    qk_norm_rope_store(qkv, hq, hk, d, cos, sin, qn.weight, kn.weight, 1e-6, k_buf, v_buf, full_locs.to(device),
                       unit_offset=False, weight_fp32=True, loc_map=f2s.to(device), v_norm=v_norm,
                       v_from_k=v_from_k, v_eps=0.1)
    tol = _tol(dtype)
    torch.testing.assert_close(qkv[:, : hq * d].reshape(T, hq, d), q_ref, **tol, msg=lambda m: f"q seed={seed}: {m}")
    torch.testing.assert_close(qkv[:, hq * d : (hq + hk) * d].reshape(T, hk, d), k_ref, **tol,
                               msg=lambda m: f"k seed={seed}: {m}")
    if not v_from_k:  # the v slice holds the V attention reads: normed in place, or left as it was
        torch.testing.assert_close(qkv[:, (hq + hk) * d :].reshape(T, hk, d), v_ref, **tol,
                                   msg=lambda m: f"v slice seed={seed}: {m}")
    expect = swa.clone()
    expect[3] = -1
    ref = torch.cat([q_ref.reshape(T, -1), k_ref.reshape(T, -1), v_ref.reshape(T, -1)], -1)
    if v_norm:  # the V norm rounds (and on the GPU may differ by an ulp): compare with a tolerance
        v_got = v_buf.cpu()[expect[expect >= 0].long()]
        torch.testing.assert_close(v_got.float(), v_ref.cpu()[expect >= 0].float(), **tol)
        v_buf = v_buf.clone()
        v_buf[expect[expect >= 0].to(device).long()] = v_ref[expect >= 0].to(v_buf.dtype)
    _check_pool(k_buf.cpu(), v_buf.cpu(), ref.cpu(), expect, hq, hk, d, dtype, seed)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq, d", [(4, 256), (2, 512), (3, 80)])
@pytest.mark.parametrize("norm", [True, False])
def test_qk_norm_rope_q_only(device, seed, dtype, hq, d, norm):
    """KV-shared layers: qkv holds q alone; q normed (fp32 weight) and rotated in place, no pool."""
    g = torch.Generator().manual_seed(seed)
    T = 4
    qkv = (torch.randn(T, hq * d + 16, generator=g) * 2).to(device, dtype)[:, : hq * d]
    cos, sin = RotaryEmbedding(1.0 / (1e4 ** (torch.arange(0, d, 2).float() / d))).cos_sin(
        torch.randint(0, 8192, (T,), generator=g).to(device))
    qn = RMSNorm(d, eps=1e-6, fp32_weight=True)
    with torch.no_grad():
        qn.weight.copy_(torch.randn(d, generator=g) * 0.3)
    qn = qn.to(device, dtype)
    q = qkv.reshape(T, hq, d)
    ref = _rotate(qn(q) if norm else q.clone(), cos[:, None].to(dtype), sin[:, None].to(dtype))
    after = qkv.as_strided((T, 16), (qkv.stride(0), 1), hq * d).clone()  # the padding past q
    qk_norm_rope_store(qkv, hq, 1, d, cos, sin, qn.weight if norm else None, None, 1e-6, None, None, None,
                       unit_offset=False, weight_fp32=True)
    torch.testing.assert_close(qkv.reshape(T, hq, d), ref, **_tol(dtype), msg=lambda m: f"seed={seed}: {m}")
    assert torch.equal(qkv.as_strided((T, 16), (qkv.stride(0), 1), hq * d), after), "wrote past q"
