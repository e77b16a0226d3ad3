"""extend_attention (+ build_kv_indices for the prefix) vs a dense float64 reference: causal and
window masks across the prefix/new boundary, SWA-space prefix lists, GQA, soft-cap, sinks."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip(
    "triton", reason="triton is not installed; kernel tests need it (CPU: TRITON_INTERPRET=1)"
)

from kernel_ref import attend_ref, make_pools, tolerances, window_mask

from swaserve.kernels.extend_attention import extend_attention
from swaserve.kernels.index_builders import build_kv_indices, kv_indices_capacity

W = 8
# (prefix_len, new tokens): queries cover positions W-1, W, W+1, 2W+3 and cross the prefix edge.
WITH_PREFIX = [(0, 21), (5, 7), (13, 19), (W - 1, 1), (30, 4)]
NO_PREFIX = [(0, 20), (0, 1), (0, 9)]

CASES = [
    # H, Hkv, Dk, Dv, dtype, window, softcap, sinks, reqs
    pytest.param(4, 2, 48, 32, torch.float32, W, 0.0, True, WITH_PREFIX, id="gqa2-swa-dk48dv32-sinks"),
    pytest.param(2, 2, 64, 64, torch.float32, None, 0.0, False, WITH_PREFIX, id="mha-full-prefix"),
    pytest.param(8, 2, 80, 80, torch.float32, W, 30.0, False, WITH_PREFIX, id="gqa4-swa-d80-softcap"),
    pytest.param(4, 1, 32, 32, torch.bfloat16, W, 30.0, True, WITH_PREFIX, id="gqa4-swa-bf16-softcap-sinks"),
    pytest.param(4, 2, 32, 16, torch.float32, None, 0.0, True, NO_PREFIX, id="gqa2-full-no-prefix-sinks"),
    pytest.param(4, 2, 32, 16, torch.float32, W, 0.0, False, NO_PREFIX, id="gqa2-swa-no-prefix"),
]


def _run(H, Hkv, Dk, Dv, dtype, window, softcap, use_sinks, reqs, device, seed, pass_start, blocks=16,
         scaling=None, q_std=1.0):
    g = torch.Generator().manual_seed(seed)
    bs = len(reqs)
    lens = [p + e for p, e in reqs]
    swa = window is not None
    # SWA layers: prefix positions no new query can see were evicted (unmapped, NaN in the pool).
    swa_from = [max(0, p - window + 1) for p, _ in reqs] if swa else None
    pools = make_pools(lens, Hkv, Dk, Dv, dtype, g, device, swa_from=swa_from)
    k_buf, v_buf = (pools.k_swa, pools.v_swa) if swa else (pools.k_full, pools.v_full)
    C = pools.req_to_token.shape[1]
    prefix = torch.tensor([p for p, _ in reqs], dtype=torch.int32, device=device)
    kv_indptr = torch.empty(bs + 1, dtype=torch.int64, device=device)
    kv_indices = torch.full((kv_indices_capacity(bs, C, window),), 10**6, dtype=torch.int32, device=device)
    kv_start = torch.empty(bs, dtype=torch.int32, device=device)
    build_kv_indices(
        pools.req_to_token,
        pools.rows,
        prefix,
        kv_indptr,
        kv_indices,
        window=window,
        full_to_swa=pools.full_to_swa if swa else None,
        first_query_pos=prefix,
        kv_start=kv_start,
    )

    qo = torch.tensor([0] + [e for _, e in reqs]).cumsum(0).to(torch.int32)
    T = int(qo[-1])
    q = (torch.randn(T, H, Dk, generator=g) * q_std).to(dtype)
    k_new = torch.cat([pools.k_true[b][p:] for b, (p, _) in enumerate(reqs)])
    v_new = torch.cat([pools.v_true[b][p:] for b, (p, _) in enumerate(reqs)])
    sinks = torch.randn(H, generator=g) * 2 if use_sinks else None
    if scaling is None:
        scaling = Dk**-0.5 * (4.0 if softcap else 1.0)
    out = torch.full((T, H, Dv), float("nan"), dtype=dtype, device=device)
    extend_attention(
        q.to(device),
        k_new.to(device),
        v_new.to(device),
        out,
        k_buf,
        v_buf,
        qo.to(device),
        kv_indptr,
        kv_indices,
        prefix,
        scaling,
        max_extend_len=max(e for _, e in reqs),
        window=window,
        logit_softcap=softcap,
        sinks=None if sinks is None else sinks.to(device),
        prefix_start=kv_start if pass_start else None,
        block_m=blocks,
        block_n=blocks,
    )
    out = out.cpu()
    assert not out.isnan().any(), f"output not fully written or NaN read (seed={seed})"
    for b, (p, e) in enumerate(reqs):
        vis = window_mask(torch.arange(p, p + e), torch.arange(p + e), window)
        ref = attend_ref(q[qo[b] : qo[b + 1]], pools.k_true[b], pools.v_true[b], vis, scaling, softcap, sinks)
        torch.testing.assert_close(
            out[qo[b] : qo[b + 1]].double(),
            ref,
            **tolerances(dtype),
            msg=lambda m, b=b, p=p, e=e: f"request {b} (prefix {p}, new {e}) seed={seed}: {m}",
        )


@pytest.mark.parametrize("H,Hkv,Dk,Dv,dtype,window,softcap,use_sinks,reqs", CASES)
def test_extend_vs_dense(H, Hkv, Dk, Dv, dtype, window, softcap, use_sinks, reqs, device, seed):
    _run(H, Hkv, Dk, Dv, dtype, window, softcap, use_sinks, reqs, device, seed, pass_start=False)


def test_extend_explicit_prefix_start(device, seed):
    """prefix_start from the builder's kv_start gives the same answer as the derived default."""
    _run(4, 2, 32, 32, torch.float32, W, 0.0, False, WITH_PREFIX, device, seed, pass_start=True)


# Gemma 4: sliding layers d256 (26B-A4B: 16 q / 8 kv heads, a GQA group of 2), full layers d512
# (16 q / 2 kv heads, group 8); scaling 1.0, no soft-cap, no sinks. Fewer heads, same groups. The
# window spans several 16-key blocks; new queries sit at positions W-1, W, W+1 and 2W+3, with and
# without a cached prefix, and a one-token extend at 2W+3 reads only the prefix window.
W4 = 40
GEMMA4_REQS = [(0, 2 * W4 + 4), (W4 - 2, 5), (2 * W4 + 3, 1), (29, 2 * W4 - 20)]
GEMMA4_CASES = [
    # H, Hkv, D, dtype, window
    pytest.param(4, 2, 256, torch.float32, W4, id="d256-g2-swa"),
    pytest.param(4, 2, 256, torch.bfloat16, W4, id="d256-g2-swa-bf16"),
    pytest.param(8, 1, 256, torch.float32, W4, id="d256-g8-swa"),
    pytest.param(8, 1, 512, torch.float32, None, id="d512-g8-full"),
    pytest.param(8, 1, 512, torch.bfloat16, W4, id="d512-g8-swa-bf16"),
    pytest.param(4, 2, 512, torch.bfloat16, None, id="d512-g2-full-bf16"),
]


@pytest.mark.parametrize("H,Hkv,D,dtype,window", GEMMA4_CASES)
def test_extend_gemma4_head_dims(H, Hkv, D, dtype, window, device, seed):
    """Scaling 1.0 with q at RMS D**-0.5 * 2, so the logits spread like normed q/k."""
    _run(H, Hkv, D, D, dtype, window, 0.0, False, GEMMA4_REQS, device, seed, pass_start=True,
         scaling=1.0, q_std=2 * D**-0.5)


@pytest.mark.parametrize(
    "Dk,Dv,H,Hkv,window",
    [(256, 256, 4, 2, 16), (512, 512, 2, 1, None), (192, 128, 4, 1, 16), (256, 256, 16, 8, 48),
     (512, 512, 16, 2, None)],
    ids=["gemma-d256-swa", "gemma4-full-d512", "mimo-dk192-dv128-swa", "gemma4-26b-swa-d256",
         "gemma4-26b-full-d512"],
)
def test_extend_real_head_dims_default_blocks(Dk, Dv, H, Hkv, window, device, seed):
    """The production head dims with default block sizes (several M and N blocks)."""
    _run(
        H,
        Hkv,
        Dk,
        Dv,
        torch.bfloat16,
        window,
        0.0,
        True,
        [(40, 70), (0, 33)],
        device,
        seed,
        pass_start=False,
        blocks=None,
    )
