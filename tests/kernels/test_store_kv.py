"""store_kv: scatter of new K/V rows, int32/int64 slots, on-the-fly full->SWA translation."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip(
    "triton", reason="triton is not installed; kernel tests need it (CPU: TRITON_INTERPRET=1)"
)

from swaserve.kernels.store_kv import store_kv


@pytest.mark.parametrize("loc_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("buf_dtype", [torch.float32, torch.bfloat16])
def test_store_kv_scatter(loc_dtype, buf_dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    size, hkv, dk, dv, T = 37, 2, 48, 32, 9
    k_buf = torch.randn(size + 1, hkv, dk, generator=g).to(buf_dtype)
    v_buf = torch.randn(size + 1, hkv, dv, generator=g).to(buf_dtype)
    before_k, before_v = k_buf.clone(), v_buf.clone()
    locs = torch.randperm(size, generator=g)[:T] + 1
    locs[3] = 0  # a padded token writes the dummy slot
    # K/V as strided views of a fused qkv-like buffer (row stride != hkv * d).
    fused = torch.randn(T, hkv, dk + dv + 16, generator=g)
    k, v = fused[:, :, :dk], fused[:, :, dk + 16 :]
    k_buf, v_buf = k_buf.to(device), v_buf.to(device)
    store_kv(k_buf, v_buf, locs.to(device, loc_dtype), k.to(device), v.to(device))
    exp_k, exp_v = before_k.clone(), before_v.clone()
    exp_k[locs], exp_v[locs] = k.to(buf_dtype), v.to(buf_dtype)
    if buf_dtype == torch.bfloat16 and device == "cpu":
        # The 3.9 interpreter truncates fp32 -> bf16 (GPU rounds to nearest even): allow 1 ulp.
        tol = {"rtol": 2**-7, "atol": 0.0}
        torch.testing.assert_close(k_buf.cpu(), exp_k, **tol, msg=f"seed={seed}")
        torch.testing.assert_close(v_buf.cpu(), exp_v, **tol, msg=f"seed={seed}")
    else:
        assert torch.equal(k_buf.cpu(), exp_k) and torch.equal(v_buf.cpu(), exp_v), f"seed={seed}"
    untouched = torch.ones(size + 1, dtype=torch.bool)
    untouched[locs] = False
    assert torch.equal(k_buf.cpu()[untouched], before_k[untouched]), "a slot outside locs was written"


@pytest.mark.parametrize("loc_dtype", [torch.int32, torch.int64])
def test_store_kv_translated_and_negative(loc_dtype, device, seed):
    """With loc_map (full_to_swa) rows land at the SWA slots; -1 (and a map entry of -1) is skipped,
    never wrapped onto the last slot."""
    g = torch.Generator().manual_seed(seed)
    full, swa, hkv, d, T = 50, 12, 1, 64, 6
    f2s = torch.zeros(full + 2, dtype=torch.int32)
    f2s[-1] = -1
    full_locs = torch.randperm(full, generator=g)[:T] + 1
    swa_slots = torch.randperm(swa, generator=g)[:T] + 1
    f2s[full_locs] = swa_slots.int()
    locs = full_locs.clone()
    locs[1] = -1  # sentinel: must be skipped
    locs[4] = full + 1  # maps to the table's trailing -1: skipped too
    k_buf = torch.zeros(swa + 1, hkv, d)
    v_buf = torch.zeros(swa + 1, hkv, d)
    k = torch.randn(T, hkv, d, generator=g)
    v = torch.randn(T, hkv, d, generator=g)
    k_dev, v_dev = k_buf.to(device), v_buf.to(device)
    store_kv(k_dev, v_dev, locs.to(device, loc_dtype), k.to(device), v.to(device), loc_map=f2s.to(device))
    keep = torch.tensor([i not in (1, 4) for i in range(T)])
    k_buf[swa_slots[keep]], v_buf[swa_slots[keep]] = k[keep], v[keep]
    assert torch.equal(k_dev.cpu(), k_buf) and torch.equal(v_dev.cpu(), v_buf), f"seed={seed}"


def test_store_kv_empty(device):
    k_buf = torch.zeros(4, 1, 16, device=device)
    store_kv(
        k_buf,
        k_buf.clone(),
        torch.zeros(0, dtype=torch.int64, device=device),
        torch.zeros(0, 1, 16, device=device),
        torch.zeros(0, 1, 16, device=device),
    )
    assert not k_buf.any()
