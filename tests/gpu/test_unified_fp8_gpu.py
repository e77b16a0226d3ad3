"""Deterministic attention over an FP8 (e4m3) KV pool, compiled on the GPU, bf16 queries, real head
shapes: a one-token query gives the same bits as a decode (each way of spreading its keys over
programs) and inside a mixed step's extend launch, and the same bits as over a bf16 pool that holds
the dequantised values (scale 1: then only the e4m3 -> bf16 conversion differs, which is exact).

Why: with an FP8 cache, deterministic mode on the GPU parted a probe alone (a decode step) from the
same probe among others (a mixed step) in a full-attention layer, while a bf16 cache held
(docs/memory.md); the CPU interpreter's test (`tests/kernels/test_fp8_kv.py`) could not see it.

    SWASERVE_KERNEL_TESTS_ON_GPU=1 python -m pytest -q -m gpu -s tests/gpu/test_unified_fp8_gpu.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
if torch.cuda.get_device_capability() < (8, 9):
    pytest.skip("FP8 e4m3 needs compute capability 8.9+", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))
from kernel_ref import make_pools

from swaserve.kernels.unified_attention import unified_attention
from swaserve.memory.kv_pool import dequantize_kv, quantize_kv

DEV = "cuda"
MAX_CONTEXT = 8192  # the engine's: chunks of 256 keys


def _pools(lens: list[int], hkv: int, d: int, seed: int, subnormals: bool):
    """FP8 pools with the real 270M's magnitudes (|K| to ~76, |V| to ~125, most values normal; with
    `subnormals` every 7th column scaled into e4m3's subnormal range), and bf16 pools holding exactly
    the dequantised values."""
    g = torch.Generator().manual_seed(seed)
    p = make_pools(lens, hkv, d, d, torch.float32, g, "cpu", finite_dummy=True, max_context=MAX_CONTEXT)
    p.req_to_token, p.rows = p.req_to_token.to(DEV), p.rows.to(DEV)
    one = torch.ones(1)
    fp8 = {}
    for name, mag in (("k_full", 20.0), ("v_full", 30.0)):
        x = getattr(p, name) * mag
        if subnormals:
            x[:, :, ::7] *= 1e-3  # e4m3 values below 2^-6
        fp8[name] = quantize_kv(x, one)
    bf16 = {n: dequantize_kv(t, one).to(torch.bfloat16) for n, t in fp8.items()}
    assert all(torch.equal(bf16[n].float(), dequantize_kv(fp8[n], one)) for n in fp8), "bf16 holds e4m3 exactly"
    to = lambda d_: {n: t.to(DEV) for n, t in d_.items()}
    return p, to(fp8), to(bf16)


@pytest.mark.parametrize("subnormals", [True, False], ids=["subnormals", "normal"])
@pytest.mark.parametrize("heads", [(4, 1, 256), (8, 4, 256), (16, 8, 128)], ids=["270m", "4b", "d128"])
@pytest.mark.parametrize("seed", [0, 1])
def test_fp8_unified_decode_extend_and_bf16_same_bits(heads, seed, subnormals):
    H, Hkv, D = heads
    # A mixed step: one-token rows first (its decodes), then prefill chunks, as the scheduler lays it out.
    reqs = [(700, 1), (1500, 1), (37, 1), (3000, 1), (0, 300), (512, 64), (2000, 129)]
    lens = [p + n for p, n in reqs]
    pools, fp8, bf16 = _pools(lens, Hkv, D, seed, subnormals)
    g = torch.Generator().manual_seed(100 + seed)
    T = sum(n for _, n in reqs)
    q = (torch.randn(T, H, D, generator=g) * 2).to(torch.bfloat16).to(DEV)
    qo = torch.tensor([0] + [n for _, n in reqs], device=DEV).cumsum(0).int()
    seq = torch.tensor(lens, dtype=torch.int32, device=DEV)
    one = torch.ones(1, device=DEV)

    def extend(k, v, scales):
        out = torch.full((T, H, D), float("nan"), dtype=torch.bfloat16, device=DEV)
        return unified_attention(q, out, k, v, pools.req_to_token, pools.rows, seq, qo, D**-0.5,
                                 max_extend_len=max(n for _, n in reqs), **scales)

    def decode(b, k, v, scales, programs):
        out = torch.full((1, H, D), float("nan"), dtype=torch.bfloat16, device=DEV)
        row = qo[b].item()
        return unified_attention(q[row: row + 1], out, k, v, pools.req_to_token, pools.rows[b: b + 1],
                                 seq[b: b + 1], torch.tensor([0, 1], dtype=torch.int32, device=DEV), D**-0.5,
                                 max_extend_len=1, programs=programs, **scales)[0]

    f8 = (fp8["k_full"], fp8["v_full"], {"k_scale": one, "v_scale": one})
    b16 = (bf16["k_full"], bf16["v_full"], {})
    ext8, ext16 = extend(*f8), extend(*b16)
    assert not ext8.isnan().any()
    diff = (ext8.float() - ext16.float()).abs()
    assert torch.equal(ext8, ext16), f"extend: FP8 pool vs bf16 pool of the same values, {int((diff > 0).sum())} " \
        f"elements differ (max {diff.max().item():.3g})"
    failures = []
    for b in range(4):
        row = qo[b].item()
        for programs in ("block", "chunk", "request"):
            d8, d16 = decode(b, *f8, programs), decode(b, *b16, programs)
            if not torch.equal(d16, ext16[row]):
                failures.append(f"req {b} {programs}: bf16 decode != bf16 extend")
            if not torch.equal(d8, d16):
                failures.append(f"req {b} {programs}: FP8 decode != bf16 decode "
                                f"({int((d8 != d16).sum())} elements)")
            if not torch.equal(d8, ext8[row]):
                failures.append(f"req {b} {programs}: FP8 decode != FP8 extend "
                                f"({int((d8 != ext8[row]).sum())} elements)")
    assert not failures, "; ".join(failures)
