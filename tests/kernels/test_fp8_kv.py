"""FP8 (e4m3) KV pools in every kernel that stores or reads K/V: the stores (`store_kv`, the fused
`qk_norm_rope_store`) give the torch quantiser's bits (`memory.kv_pool.quantize_kv`: x / scale, clamped
to +-448, rounded to nearest even); decode, extend (with a cached prefix) and the batch-invariant
unified kernel, in both index spaces (full pool; SWA pool through `full_to_swa`, evicted positions
poisoned), read `e4m3 * scale` exactly as the float64 reference on the dequantised K/V does, with
scales other than 1 so a missing or misplaced scale shows."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed; kernel tests need it (CPU: TRITON_INTERPRET=1)")

from kernel_ref import attend_ref, make_pools, tolerances, window_mask  # noqa: E402

from swaserve.kernels.decode_attention import decode_attention  # noqa: E402
from swaserve.kernels.extend_attention import extend_attention  # noqa: E402
from swaserve.kernels.common import interpret_mode  # noqa: E402
from swaserve.kernels.index_builders import build_kv_indices, kv_indices_capacity  # noqa: E402
from swaserve.kernels.kv_quant import fp8_cvt_asm  # noqa: E402
from swaserve.kernels.qk_norm_rope import qk_norm_rope_store  # noqa: E402
from swaserve.kernels.store_kv import store_kv  # noqa: E402
from swaserve.kernels.unified_attention import unified_attention  # noqa: E402
from swaserve.memory.kv_pool import FP8_KV, dequantize_kv, quantize_kv  # noqa: E402

K_SCALE, V_SCALE = 0.25, 3.0  # not 1: a dropped scale (or K's and V's swapped) changes the result
W = 8


def _scales(device: str) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.tensor([K_SCALE], device=device), torch.tensor([V_SCALE], device=device))


def _to_fp8(pools, device):
    """The pools' buffers quantised in place of the float ones (NaN poison stays NaN in e4m3), and the
    per-request K/V the reference reads: dequantised, so the kernels must match it to fp32 rounding."""
    ks, vs = _scales("cpu")
    for name, s in (("k_full", ks), ("v_full", vs), ("k_swa", ks), ("v_swa", vs)):
        setattr(pools, name, quantize_kv(getattr(pools, name).cpu(), s).to(device))
    pools.k_true = [dequantize_kv(quantize_kv(k, ks), ks).double() for k in pools.k_true]
    pools.v_true = [dequantize_kv(quantize_kv(v, vs), vs).double() for v in pools.v_true]
    return pools


# ---- stores ------------------------------------------------------------------------------------

def test_store_kv_fp8_matches_torch_quantiser(device, seed):
    """Translated through full_to_swa, -1 skipped, strided K/V, values past +-448 * scale saturate: the
    stored bytes are the torch quantiser's, and no other slot changes."""
    g = torch.Generator().manual_seed(seed)
    full, swa, hkv, dk, dv, T = 40, 20, 2, 48, 32, 7
    f2s = torch.zeros(full + 2, dtype=torch.int32)
    f2s[-1] = -1
    full_locs = torch.randperm(full, generator=g)[:T] + 1
    swa_slots = torch.randperm(swa, generator=g)[:T] + 1
    f2s[full_locs] = swa_slots.int()
    locs = full_locs.clone()
    locs[2] = -1
    fused = torch.randn(T, hkv, dk + dv + 8, generator=g) * 4
    fused[0, 0, :3] = torch.tensor([1e4, -1e4, 1e-4])  # saturate high and low, underflow to 0
    k, v = fused[:, :, :dk], fused[:, :, dk + 8:]
    k_buf = torch.full((swa + 1, hkv, dk), 7.0).to(FP8_KV)
    v_buf = torch.full((swa + 1, hkv, dv), -5.0).to(FP8_KV)
    expect_k, expect_v = k_buf.clone(), v_buf.clone()
    ks, vs = _scales(device)
    kd, vd = k_buf.to(device), v_buf.to(device)
    store_kv(kd, vd, locs.to(device), k.to(device), v.to(device), loc_map=f2s.to(device), k_scale=ks, v_scale=vs)
    keep = torch.arange(T) != 2
    expect_k[swa_slots[keep]] = quantize_kv(k[keep], ks.cpu())
    expect_v[swa_slots[keep]] = quantize_kv(v[keep], vs.cpu())
    assert torch.equal(kd.cpu().view(torch.uint8), expect_k.view(torch.uint8)), f"seed={seed}"
    assert torch.equal(vd.cpu().view(torch.uint8), expect_v.view(torch.uint8)), f"seed={seed}"
    assert kd.cpu()[swa_slots[0], 0, :2].tolist() == [448.0, -448.0]


def test_store_kv_fp8_needs_both_scales(device):
    buf = torch.zeros(4, 1, 16, dtype=FP8_KV, device=device)
    k = torch.zeros(1, 1, 16, device=device)
    locs = torch.ones(1, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="both"):
        store_kv(buf, buf.clone(), locs, k, k)
    with pytest.raises(ValueError, match="no K/V scales"):
        store_kv(buf.float(), buf.float(), locs, k, k, k_scale=_scales(device)[0], v_scale=_scales(device)[1])


def test_qk_norm_rope_store_fp8_matches_unfused(device, seed):
    """The fused norm + rotary + store into an FP8 pool stores the quantised K/V that the unfused path
    (the same kernel into an fp32 pool, then the torch quantiser) gives; q/k in qkv are unchanged."""
    g = torch.Generator().manual_seed(seed)
    hq, hk, d, T, slots = 4, 2, 32, 5, 16
    qkv = torch.randn(T, (hq + 2 * hk) * d, generator=g) * 3
    cos, sin = torch.rand(T, d // 2, generator=g), torch.rand(T, d // 2, generator=g)
    qw, kw = torch.randn(d, generator=g) * 0.3, torch.randn(d, generator=g) * 0.3
    locs = (torch.randperm(slots - 1, generator=g)[:T] + 1).to(device)
    norm = (cos.to(device), sin.to(device), qw.to(device), kw.to(device), 1e-6)
    ref_qkv, got_qkv = qkv.to(device), qkv.clone().to(device)  # in place: two copies
    k32, v32 = torch.zeros(slots, hk, d, device=device), torch.zeros(slots, hk, d, device=device)
    qk_norm_rope_store(ref_qkv, hq, hk, d, *norm, k32, v32, locs)
    k8 = torch.zeros(slots, hk, d, dtype=FP8_KV, device=device)
    v8 = torch.zeros_like(k8)
    ks, vs = _scales(device)
    qk_norm_rope_store(got_qkv, hq, hk, d, *norm, k8, v8, locs, k_scale=ks, v_scale=vs)
    assert torch.equal(got_qkv.cpu(), ref_qkv.cpu())
    assert torch.equal(k8.cpu().view(torch.uint8), quantize_kv(k32.cpu(), ks.cpu()).view(torch.uint8)), f"seed={seed}"
    assert torch.equal(v8.cpu().view(torch.uint8), quantize_kv(v32.cpu(), vs.cpu()).view(torch.uint8)), f"seed={seed}"


# ---- decode ------------------------------------------------------------------------------------

@pytest.mark.parametrize("window,splits,dtype", [
    pytest.param(W, 3, torch.float32, id="swa-space-split3"),
    pytest.param(None, 1, torch.float32, id="full-direct"),
    pytest.param(W, 1, torch.bfloat16, id="swa-space-bf16"),
])
def test_decode_attention_fp8(window, splits, dtype, device, seed):
    """Queries at positions W-1, W, W+1 and 2W+3, a 1-token request, and a padded graph row (one key at
    slot 0, which holds zeros in an FP8 pool): every live row as the reference on dequantised K/V."""
    g = torch.Generator().manual_seed(seed)
    H, Hkv, Dk, Dv = 4, 2, 48, 32
    lens = [W, W + 1, W + 2, 2 * W + 4, 1]
    swa = window is not None
    swa_from = [max(0, n - window) for n in lens] if swa else None
    pools = _to_fp8(make_pools(lens, Hkv, Dk, Dv, torch.float32, g, device, swa_from=swa_from), device)
    k_buf, v_buf = (pools.k_swa, pools.v_swa) if swa else (pools.k_full, pools.v_full)
    k_buf[0], v_buf[0] = 0, 0  # the dummy slot as a fresh pool holds it
    bs = len(lens) + 1
    rows = torch.cat([pools.rows, torch.zeros(1, dtype=pools.rows.dtype, device=device)])  # + a padded row
    C = pools.req_to_token.shape[1]
    indptr = torch.empty(bs + 1, dtype=torch.int32, device=device)
    indices = torch.full((kv_indices_capacity(bs, C, window),), 10**6, dtype=torch.int32, device=device)
    build_kv_indices(pools.req_to_token, rows, torch.tensor(lens + [1], dtype=torch.int32, device=device), indptr,
                     indices, window=window, full_to_swa=pools.full_to_swa if swa else None)
    q = torch.randn(bs, H, Dk, generator=g).to(dtype)
    out = torch.full((bs, H, Dv), float("nan"), dtype=dtype, device=device)
    ks, vs = _scales(device)
    decode_attention(q.to(device), k_buf, v_buf, indptr, indices, out, Dk**-0.5, num_kv_splits=splits, block_n=16,
                     k_scale=ks, v_scale=vs)
    out = out.cpu()
    assert torch.isfinite(out).all(), f"seed={seed}"
    assert (out[-1] == 0).all(), "a padded row reads slot 0's zeros"
    for b, n in enumerate(lens):
        vis = window_mask(torch.tensor([n - 1]), torch.arange(n), window)
        ref = attend_ref(q[b: b + 1], pools.k_true[b], pools.v_true[b], vis, Dk**-0.5)
        torch.testing.assert_close(out[b: b + 1].double(), ref, **tolerances(dtype), msg=lambda m: f"seed={seed}: {m}")


# ---- extend ------------------------------------------------------------------------------------

@pytest.mark.parametrize("window", [W, None], ids=["swa-space", "full"])
def test_extend_attention_fp8_with_prefix(window, device, seed):
    """New tokens over a cached FP8 prefix (window lists in SWA space, prefix slots out of the window
    evicted): the new tokens' K/V come in as the pool stores them (e4m3), so every key, cached or
    new, is read the same way."""
    g = torch.Generator().manual_seed(seed)
    H, Hkv, Dk, Dv = 4, 2, 32, 16
    reqs = [(0, 13), (5, 7), (2 * W + 3, 1), (W - 1, 4)]
    lens = [p + e for p, e in reqs]
    swa = window is not None
    swa_from = [max(0, p - window + 1) for p, _ in reqs] if swa else None
    pools = _to_fp8(make_pools(lens, Hkv, Dk, Dv, torch.float32, g, device, swa_from=swa_from), device)
    k_buf, v_buf = (pools.k_swa, pools.v_swa) if swa else (pools.k_full, pools.v_full)
    bs, C = len(reqs), pools.req_to_token.shape[1]
    prefix = torch.tensor([p for p, _ in reqs], dtype=torch.int32, device=device)
    indptr = torch.empty(bs + 1, dtype=torch.int32, device=device)
    indices = torch.full((kv_indices_capacity(bs, C, window),), 10**6, dtype=torch.int32, device=device)
    start = torch.empty(bs, dtype=torch.int32, device=device)
    build_kv_indices(pools.req_to_token, pools.rows, prefix, indptr, indices, window=window,
                     full_to_swa=pools.full_to_swa if swa else None, first_query_pos=prefix, kv_start=start)
    # The new tokens' rows as stored: their slots, read back (the backend does the same gather).
    new_slots = torch.cat([pools.req_to_token[pools.rows[b], p: p + e].long() for b, (p, e) in enumerate(reqs)])
    if swa:
        new_slots = pools.full_to_swa[new_slots].long()
    k_new, v_new = k_buf[new_slots], v_buf[new_slots]
    qo = torch.tensor([0] + [e for _, e in reqs]).cumsum(0).int()
    T = int(qo[-1])
    q = torch.randn(T, H, Dk, generator=g)
    out = torch.full((T, H, Dv), float("nan"), device=device)
    ks, vs = _scales(device)
    extend_attention(q.to(device), k_new, v_new, out, k_buf, v_buf, qo.to(device), indptr, indices, prefix,
                     Dk**-0.5, max_extend_len=max(e for _, e in reqs), window=window, prefix_start=start,
                     block_m=16, block_n=16, k_scale=ks, v_scale=vs)
    out = out.cpu()
    for b, (p, e) in enumerate(reqs):
        vis = window_mask(torch.arange(p, p + e), torch.arange(p + e), window)
        ref = attend_ref(q[qo[b]: qo[b + 1]], pools.k_true[b], pools.v_true[b], vis, Dk**-0.5)
        torch.testing.assert_close(out[qo[b]: qo[b + 1]].double(), ref, **tolerances(torch.float32),
                                   msg=lambda m, b=b: f"request {b} seed={seed}: {m}")


# ---- unified (deterministic mode) --------------------------------------------------------------

@pytest.mark.parametrize("window", [W, None], ids=["swa-space", "full"])
def test_unified_attention_fp8_matches_reference_and_decode_matches_extend(window, device, seed):
    """An FP8 pool through the request table (and full_to_swa for the SWA pool): extend and mixed rows
    match the reference on dequantised K/V, and each decode row, computed alone as a decode (keys split
    over programs and merged), has the bits the extend gives the same query."""
    g = torch.Generator().manual_seed(seed)
    H, Hkv, D = 4, 2, 32
    reqs = [(0, 21), (5, 7), (7, 1), (70, 1), (60, 10)]
    lens = [p + n for p, n in reqs]
    swa = window is not None
    swa_from = [max(0, p - window + 1) for p, _ in reqs] if swa else None
    pools = _to_fp8(make_pools(lens, Hkv, D, D, torch.float32, g, device, swa_from=swa_from), device)
    k_buf, v_buf = (pools.k_swa, pools.v_swa) if swa else (pools.k_full, pools.v_full)
    ks, vs = _scales(device)
    kw = dict(window=window, full_to_swa=pools.full_to_swa if swa else None, chunk=64, k_scale=ks, v_scale=vs)
    T = sum(n for _, n in reqs)
    q = torch.randn(T, H, D, generator=g).to(device)
    out = torch.full((T, H, D), float("nan"), device=device)
    qo = torch.tensor([0] + [n for _, n in reqs], device=device).cumsum(0).int()
    seq = torch.tensor(lens, dtype=torch.int32, device=device)
    unified_attention(q, out, k_buf, v_buf, pools.req_to_token, pools.rows, seq, qo, 0.125,
                      max_extend_len=max(n for _, n in reqs), **kw)
    off = 0
    for b, (p, n) in enumerate(reqs):
        pos = torch.arange(p + n)
        ref = attend_ref(q[off: off + n].cpu(), pools.k_true[b], pools.v_true[b], window_mask(pos[p:], pos, window),
                         0.125)
        torch.testing.assert_close(out[off: off + n].cpu().double(), ref, **tolerances(torch.float32),
                                   msg=lambda m, b=b: f"request {b} seed={seed}: {m}")
        off += n
    for b in (2, 3):  # the one-token requests again, as a decode step
        row = qo[b].item()
        dec = torch.full((1, H, D), float("nan"), device=device)
        unified_attention(q[row: row + 1], dec, k_buf, v_buf, pools.req_to_token, pools.rows[b: b + 1], seq[b: b + 1],
                          torch.tensor([0, 1], dtype=torch.int32, device=device), 0.125, max_extend_len=1,
                          programs="block", **kw)
        assert torch.equal(dec[0], out[row]), f"request {b}: decode and extend bits differ, seed={seed}"


def test_inline_e4m3_conversion_is_compiled_code_only(monkeypatch):
    """The unified kernel's inline e4m3 conversion (PTX) never reaches the interpreter, which cannot run
    PTX, nor a CPU tensor: there the tiles convert as Triton's own code does, so these tests check the
    kernels' math and `test_compile_sm90.py` the compiled form; natively (SWASERVE_KERNEL_TESTS_ON_GPU=1 on
    an sm_89+ GPU) they run the PTX, and SWASERVE_FP8_CVT_ASM=0 turns it off there."""
    monkeypatch.delenv("SWASERVE_FP8_CVT_ASM", raising=False)
    assert not fp8_cvt_asm(torch.device("cpu"))
    if torch.cuda.is_available():
        cuda = torch.device("cuda")
        assert fp8_cvt_asm(cuda) == (not interpret_mode() and torch.cuda.get_device_capability() >= (8, 9))
        monkeypatch.setenv("SWASERVE_FP8_CVT_ASM", "0")
        assert not fp8_cvt_asm(cuda)
