"""decode_attention (+ build_kv_indices) vs a dense float64 reference: window boundaries, SWA-space
lists, GQA, soft-cap, sinks, Dk != Dv, non-power-of-2 dims, split-K, empty and padded requests."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip(
    "triton", reason="triton is not installed; kernel tests need it (CPU: TRITON_INTERPRET=1)"
)

from kernel_ref import attend_ref, make_pools, tolerances, window_mask

from swaserve.kernels.decode_attention import decode_attention
from swaserve.kernels.index_builders import build_kv_indices, kv_indices_capacity

W = 8
# Query positions W-1, W, W+1, 2W+3 (lens = position + 1), plus a 1-token request.
LENS = [W, W + 1, W + 2, 2 * W + 4, 1]

CASES = [
    # H, Hkv, Dk, Dv, dtype, window, softcap, sinks, splits
    pytest.param(4, 4, 64, 64, torch.float32, W, 0.0, False, 1, id="mha-swa-direct"),
    pytest.param(4, 2, 48, 32, torch.float32, W, 0.0, True, 3, id="gqa2-swa-dk48dv32-sinks-split3"),
    pytest.param(8, 2, 80, 80, torch.float32, None, 30.0, False, 4, id="gqa4-full-d80-softcap-split4"),
    pytest.param(8, 2, 80, 80, torch.bfloat16, W, 30.0, True, 2, id="gqa4-swa-bf16-softcap-sinks"),
    pytest.param(4, 2, 48, 32, torch.bfloat16, None, 0.0, False, 1, id="gqa2-full-bf16-direct"),
    pytest.param(40, 1, 32, 16, torch.float32, W, 5.0, True, 2, id="gqa40-headblocks-swa"),
]


def _counters(bs: int, device) -> torch.Tensor:
    """Split counters for the one-launch combine (`split_counters`): zeros, generously sized."""
    return torch.zeros(bs * 64, dtype=torch.int32, device=device)


# Every split case again with the splits combined in stage 1 (`split_counters`).
FUSED_CASES = [pytest.param(*c.values, True, id=f"{c.id}-fused") for c in CASES if c.values[-1] > 1]


@pytest.mark.parametrize("H,Hkv,Dk,Dv,dtype,window,softcap,use_sinks,splits,fused",
                         [pytest.param(*c.values, False, id=c.id) for c in CASES] + FUSED_CASES)
def test_decode_vs_dense(H, Hkv, Dk, Dv, dtype, window, softcap, use_sinks, splits, fused, device, seed):
    scaling = Dk**-0.5 * (4.0 if softcap else 1.0)  # bigger logits so the soft-cap matters
    _check_decode(H, Hkv, Dk, Dv, dtype, window, softcap, use_sinks, splits, fused, device, seed, LENS, scaling,
                  block_n=16)


# Gemma 4: sliding layers d256 (26B-A4B: 16 q / 8 kv heads, a GQA group of 2), full layers d512
# (16 q / 2 kv heads, group 8); scaling 1.0 (q and k are RMS-normed), no soft-cap, no sinks. Fewer
# heads than the real model, same groups. The window spans several 16-key blocks and ends mid-block.
W4 = 40
LENS4 = [W4, W4 + 1, W4 + 2, 2 * W4 + 4, 1]
GEMMA4_CASES = [
    # H, Hkv, D, dtype, window, splits, fused
    pytest.param(4, 2, 256, torch.float32, W4, 1, False, id="d256-g2-swa-direct"),
    pytest.param(4, 2, 256, torch.bfloat16, W4, 3, False, id="d256-g2-swa-bf16-split3"),
    pytest.param(8, 1, 256, torch.float32, W4, 2, True, id="d256-g8-swa-split2-fused"),
    pytest.param(8, 1, 512, torch.float32, None, 1, False, id="d512-g8-full-direct"),
    pytest.param(8, 1, 512, torch.bfloat16, None, 4, True, id="d512-g8-full-bf16-split4-fused"),
    pytest.param(8, 1, 512, torch.bfloat16, W4, 2, False, id="d512-g8-swa-bf16-split2"),
    pytest.param(4, 2, 512, torch.float32, W4, 3, False, id="d512-g2-swa-split3"),
]


@pytest.mark.parametrize("H,Hkv,D,dtype,window,splits,fused", GEMMA4_CASES)
def test_decode_gemma4_head_dims(H, Hkv, D, dtype, window, splits, fused, device, seed):
    """Queries at positions W-1, W, W+1 and 2W+3 (and 0), scaling 1.0 with q at RMS D**-0.5 * 2, so
    the logits spread like normed q/k and the softmax is neither flat nor one-hot."""
    _check_decode(H, Hkv, D, D, dtype, window, 0.0, False, splits, fused, device, seed, LENS4, 1.0, block_n=16,
                  q_std=2 * D**-0.5)


def _check_decode(H, Hkv, Dk, Dv, dtype, window, softcap, use_sinks, splits, fused, device, seed, lens, scaling,
                  block_n=None, q_std=1.0):
    g = torch.Generator().manual_seed(seed)
    bs = len(lens)
    swa = window is not None
    # SWA layers: positions older than the window were evicted (unmapped, NaN in the pool), so any
    # read outside the list's window poisons the output.
    swa_from = [max(0, L - window) for L in lens] if swa else None
    pools = make_pools(lens, Hkv, Dk, Dv, dtype, g, device, swa_from=swa_from)
    k_buf, v_buf = (pools.k_swa, pools.v_swa) if swa else (pools.k_full, pools.v_full)
    C = pools.req_to_token.shape[1]
    kv_indptr = torch.empty(bs + 1, dtype=torch.int32, device=device)
    kv_indices = torch.full((kv_indices_capacity(bs, C, window),), 10**6, dtype=torch.int32, device=device)
    build_kv_indices(
        pools.req_to_token,
        pools.rows,
        torch.tensor(lens, dtype=torch.int32, device=device),
        kv_indptr,
        kv_indices,
        window=window,
        full_to_swa=pools.full_to_swa if swa else None,
    )

    q = (torch.randn(bs, H, Dk, generator=g) * q_std).to(dtype)
    sinks = torch.randn(H, generator=g) * 2 if use_sinks else None
    out = torch.full((bs, H, Dv), float("nan"), dtype=dtype, device=device)
    kw = {}
    if splits > 1:  # poisoned scratch: stage 2 must read only splits stage 1 wrote
        kw["mid_o"] = torch.full((bs, H, splits, Dv), float("nan"), device=device)
        kw["mid_lse"] = torch.full((bs, H, splits), float("nan"), device=device)
    block_h = 16 if H // Hkv > 16 else None
    if fused:
        kw["split_counters"] = _counters(bs, device)
    decode_attention(
        q.to(device),
        k_buf,
        v_buf,
        kv_indptr,
        kv_indices,
        out,
        scaling,
        logit_softcap=softcap,
        sinks=None if sinks is None else sinks.to(device),
        num_kv_splits=splits,
        block_n=block_n,
        block_h=block_h,
        **kw,
    )
    out = out.cpu()
    assert not out.isnan().any(), f"output not fully written or NaN read (seed={seed})"
    if fused:
        assert not kw["split_counters"].any(), "the combining program must leave its counter at 0"
    for b, L in enumerate(lens):
        pos = torch.arange(L)
        vis = window_mask(torch.tensor([L - 1]), pos, window)
        ref = attend_ref(q[b : b + 1], pools.k_true[b], pools.v_true[b], vis, scaling, softcap, sinks)
        torch.testing.assert_close(
            out[b : b + 1].double(),
            ref,
            **tolerances(dtype),
            msg=lambda m, b=b, L=L: f"request {b} (len {L}) seed={seed}: {m}",
        )


@pytest.mark.parametrize("splits,fused", [(1, False), (4, False), (4, True)])
@pytest.mark.parametrize("use_sinks", [False, True])
def test_decode_empty_and_padded_rows(splits, fused, use_sinks, device, seed):
    """A request with 0 keys gives 0 (no NaN); a padded graph row (one key, dummy slot 0) gives the
    finite attention over slot 0; a real request next to them is unaffected."""
    g = torch.Generator().manual_seed(seed)
    H, Hkv, D = 4, 2, 32
    pools = make_pools([13], Hkv, D, D, torch.float32, g, device, finite_dummy=True)
    real = pools.req_to_token[pools.rows[0], :13].cpu()
    kv_indptr = torch.tensor([0, 0, 1, 14, 14], dtype=torch.int64)  # empty, padded, real, empty
    kv_indices = torch.cat(
        [torch.zeros(1, dtype=torch.int32), real, torch.full((5,), 10**6, dtype=torch.int32)]
    )
    q = torch.randn(4, H, D, generator=g)
    sinks = torch.randn(H, generator=g) if use_sinks else None
    out = torch.full((4, H, D), float("nan"), device=device)
    decode_attention(
        q.to(device),
        pools.k_full,
        pools.v_full,
        kv_indptr.to(device),
        kv_indices.to(device),
        out,
        D**-0.5,
        sinks=None if sinks is None else sinks.to(device),
        num_kv_splits=splits,
        block_n=16,
        split_counters=_counters(4, device) if fused else None,
    )
    out = out.cpu().double()
    assert not out.isnan().any()
    assert (out[0] == 0).all() and (out[3] == 0).all(), "0-key requests must output 0"
    k0, v0 = pools.k_full.cpu()[:1], pools.v_full.cpu()[:1]
    one = torch.ones(1, 1, dtype=torch.bool)
    torch.testing.assert_close(
        out[1:2], attend_ref(q[1:2], k0, v0, one, D**-0.5, 0.0, sinks), atol=1e-4, rtol=1e-4
    )
    vis = torch.ones(1, 13, dtype=torch.bool)
    ref = attend_ref(q[2:3], pools.k_true[0], pools.v_true[0], vis, D**-0.5, 0.0, sinks)
    torch.testing.assert_close(out[2:3], ref, atol=1e-4, rtol=1e-4, msg=lambda m: f"seed={seed}: {m}")


def test_decode_fixed_split_tile_is_batch_invariant(device, seed):
    """With min_split_len = a fixed tile, the reduction order depends only on the request's length:
    bitwise-equal results whatever num_kv_splits (e.g. chosen per graph batch size) is."""
    g = torch.Generator().manual_seed(seed)
    H, Hkv, D, L = 4, 1, 32, 70
    pools = make_pools([L], Hkv, D, D, torch.float32, g, device)
    idx = pools.req_to_token[pools.rows[0], :L].contiguous()
    indptr = torch.tensor([0, L], dtype=torch.int32, device=device)
    q = torch.randn(1, H, D, generator=g).to(device)
    outs = []
    for splits in (3, 5):
        out = torch.full((1, H, D), float("nan"), device=device)
        decode_attention(
            q,
            pools.k_full,
            pools.v_full,
            indptr,
            idx,
            out,
            0.2,
            num_kv_splits=splits,
            block_n=16,
            min_split_len=32,
        )
        outs.append(out.cpu())
    assert torch.equal(outs[0], outs[1])
    ref = attend_ref(q.cpu(), pools.k_true[0], pools.v_true[0], torch.ones(1, L, dtype=torch.bool), 0.2)
    torch.testing.assert_close(outs[0].double(), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "Dk,Dv,H,Hkv,window",
    [(256, 256, 8, 4, None), (512, 512, 8, 1, None), (192, 128, 16, 4, None), (64, 64, 16, 2, None),
     (256, 256, 16, 8, 64), (512, 512, 16, 2, None)],
    ids=["gemma-d256", "gemma4-full-d512", "mimo-dk192-dv128", "gptoss-d64", "gemma4-26b-swa-d256",
         "gemma4-26b-full-d512"],
)
def test_decode_real_head_dims_default_blocks(Dk, Dv, H, Hkv, window, device, seed):
    """The production head dims with default block sizes (several key blocks per list) and the
    backend's default split count."""
    _check_decode(H, Hkv, Dk, Dv, torch.bfloat16, window, 0.0, True, 8, False, device, seed, [70, 1, 130],
                  Dk**-0.5)


def test_num_kv_splits_for():
    from swaserve.kernels.decode_attention import num_kv_splits_for

    assert num_kv_splits_for(64, 8, 4, 8192, 132) == 1  # enough programs: no stage 2
    assert num_kv_splits_for(8, 64, 8, 8192, 132) == 5  # 64 programs: about two waves
    assert num_kv_splits_for(1, 8, 4, 32768, 132) == 64  # capped by max_splits
    assert num_kv_splits_for(1, 8, 4, 512, 132) == 16  # one 32-key block per split
    assert num_kv_splits_for(1, 8, 4, 32, 132) == 1  # a one-block window is never split


def test_fused_combine_equals_stage2_and_replays(device, seed):
    """The one-launch combine gives what stage 2 gives, bit for bit, and its counters stay usable
    launch after launch (as in graph replays over one buffer)."""
    g = torch.Generator().manual_seed(seed)
    H, Hkv, D = 8, 2, 32
    lens = [5, 40, 1, 77, 0, 33]
    pools = make_pools([L for L in lens if L], Hkv, D, D, torch.float32, g, device)
    parts, j = [], 0
    for L in lens:
        parts.append(pools.req_to_token[pools.rows[j], :L].cpu() if L else torch.zeros(0, dtype=torch.int64))
        j += bool(L)
    indices = torch.cat(parts).to(torch.int32).to(device)
    indptr = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    counters = _counters(len(lens), device)
    for step in range(3):
        q = torch.randn(len(lens), H, D, generator=g).to(device)
        ref = torch.full((len(lens), H, D), float("nan"), device=device)
        got = torch.full_like(ref, float("nan"))
        decode_attention(q, pools.k_full, pools.v_full, indptr, indices, ref, 0.2, num_kv_splits=5, block_n=16)
        decode_attention(q, pools.k_full, pools.v_full, indptr, indices, got, 0.2, num_kv_splits=5, block_n=16,
                         split_counters=counters)
        assert torch.equal(got, ref), f"step {step} seed={seed}"
        assert not counters.any()
