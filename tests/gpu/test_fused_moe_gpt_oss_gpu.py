"""The fused MoE in GPT-OSS's form at the released expert shapes on CUDA (hidden 2880, intermediate 2880,
top-4 of gpt-oss-20b's 32 and -120b's 128 experts; also the 1440 and 736 / 704 shares of TP 2 and 4):
MXFP4 experts (codes dequantised in registers) and bf16 experts, biases and the clamped SwiGLU, vs the
per-expert reference (MXFP4 dequantised at use) at decode and prefill sizes; the MXFP4 kernel vs the bf16
kernel on the same weights; captured in a CUDA graph with padded rows, equal to eager bit for bit on
both pair sorts."""

from __future__ import annotations

import pytest
import torch
from engine_driver import record

from swaserve.kernels.fused_moe import fused_moe
from swaserve.kernels.moe_align import ALIGN_KERNEL_MAX_PAIRS
from swaserve.layers import mxfp4
from swaserve.layers.fused_moe import moe_experts_reference

pytestmark = pytest.mark.gpu
H, K = 2880, 4
ACT = {"alpha": 1.702, "limit": 7.0}


def _experts(E: int, I: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """MXFP4 codes and scales (weights of RMS ~0.03) and bf16 biases, as `fused_moe` keywords."""
    g = torch.Generator(device="cuda").manual_seed(seed)

    def packed(rows: int, n_in: int) -> tuple[torch.Tensor, torch.Tensor]:
        codes = torch.randint(0, 256, (E, rows, n_in // 32, 16), generator=g, device="cuda", dtype=torch.uint8)
        return codes, torch.randint(119, 122, (E, rows, n_in // 32), generator=g, device="cuda", dtype=torch.uint8)

    (b1, s1), (b2, s2) = packed(2 * I, H), packed(H, I)
    return {"w_gate_up": b1, "w_down": b2, "gate_up_scales": s1, "down_scales": s2,
            "gate_up_bias": (0.1 * torch.randn(E, 2 * I, generator=g, device="cuda")).bfloat16(),
            "down_bias": (0.1 * torch.randn(E, H, generator=g, device="cuda")).bfloat16()}


def _dense(w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same experts as bf16 weights (exactly: every MXFP4 value is a bf16 value)."""
    out = {k: v for k, v in w.items() if k.endswith("_bias")}
    out["w_gate_up"] = mxfp4.dequantize(w["w_gate_up"], w["gate_up_scales"], torch.bfloat16)
    out["w_down"] = mxfp4.dequantize(w["w_down"], w["down_scales"], torch.bfloat16)
    return out


def _route(n: int, E: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(n, H, generator=g, device="cuda").bfloat16()
    top, ids = torch.randn(n, E, generator=g, device="cuda").topk(K, -1)
    return x, torch.softmax(top, -1), ids  # GPT-OSS's router: softmax over the top-k logits


def _call(fn, x, w, ids, kw, valid=None):
    kw = dict(kw)
    return fn(x, kw.pop("w_gate_up"), kw.pop("w_down"), w, ids, "swiglu_oai", valid, **kw, **ACT)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


@pytest.fixture(scope="module")
def experts_20b():
    return _experts(32, 2880)


@pytest.mark.parametrize("fmt", ["mxfp4", "bf16"])
@pytest.mark.parametrize("n", [1, 16, 64, 256, 2048])
def test_20b_matches_reference(experts_20b, fmt, n):
    kw = experts_20b if fmt == "mxfp4" else _dense(experts_20b)
    x, w, ids = _route(n, 32, n)
    err = _rel(_call(fused_moe, x, w, ids, kw), _call(moe_experts_reference, x, w, ids, kw))
    record({"test": "gpt_oss_fused_moe_vs_reference", "shape": "20b", "format": fmt, "n": n, "max_rel_err": err})
    assert err < 2e-2, err


@pytest.mark.parametrize("n", [1, 64, 1024])
def test_mxfp4_kernel_equals_bf16_kernel_on_the_same_weights(experts_20b, n):
    # Same bf16 weights, different K order (the MXFP4 GEMM splits each step into even and odd inputs).
    x, w, ids = _route(n, 32, 100 + n)
    err = _rel(_call(fused_moe, x, w, ids, experts_20b), _call(fused_moe, x, w, ids, _dense(experts_20b)))
    record({"test": "gpt_oss_mxfp4_vs_bf16_kernel", "n": n, "max_rel_err": err})
    assert err < 1e-2, err


@pytest.mark.parametrize("inter", [1440, 736, 704], ids=["tp2", "tp4_r0", "tp4_r3"])
def test_tensor_parallel_shares(inter):
    kw = _experts(32, inter, seed=1)
    for n in (1, 64):
        x, w, ids = _route(n, 32, n)
        err = _rel(_call(fused_moe, x, w, ids, kw), _call(moe_experts_reference, x, w, ids, kw))
        assert err < 2e-2, (inter, n, err)


@pytest.mark.parametrize("n", [1, 256])
def test_120b_matches_reference(n):
    kw = _experts(128, 2880, seed=2)
    x, w, ids = _route(n, 128, n)
    err = _rel(_call(fused_moe, x, w, ids, kw), _call(moe_experts_reference, x, w, ids, kw))
    record({"test": "gpt_oss_fused_moe_vs_reference", "shape": "120b", "format": "mxfp4", "n": n, "max_rel_err": err})
    assert err < 2e-2, err


@pytest.mark.parametrize("n", [1, 64, 2 * ALIGN_KERNEL_MAX_PAIRS // K])  # the last sorts by torch ops
def test_cuda_graph_replay_with_padded_rows(experts_20b, n):
    x, w, ids = _route(n, 32, 1)
    static = [x.clone(), w.clone(), ids.clone(), torch.ones(n, dtype=torch.bool, device="cuda")]
    _call(fused_moe, *static[:3], experts_20b, static[3])  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _call(fused_moe, *static[:3], experts_20b, static[3])
    for seed, live in ((2, n), (3, (n + 1) // 2), (4, 1)):
        x, w, ids = _route(n, 32, seed)
        valid = torch.arange(n, device="cuda") < live
        for buf, new in zip(static, (x, w, ids, valid)):
            buf.copy_(new)
        graph.replay()
        eager = _call(fused_moe, x, w, ids, experts_20b, valid)
        assert torch.equal(out, eager), f"graph replay differs from eager with {live} of {n} live rows"
        assert (out[live:] == 0).all()
        err = _rel(out[:live], _call(moe_experts_reference, x[:live], w[:live], ids[:live], experts_20b))
        assert err < 2e-2, err


@pytest.mark.parametrize("n", [1, 64, 2 * ALIGN_KERNEL_MAX_PAIRS // K])  # the last sorts by torch ops
def test_expert_parallel_halves_sum_to_the_whole(experts_20b, n):
    """Expert parallelism at the 20b shape: each half of the 32 experts (blocks, scales, biases) with
    `expert_start` matches the reference of that half, the halves sum to the whole layer's output (within
    bf16 rounding of the two partials), and a half replays in a CUDA graph with padded rows equal to eager."""
    x, w, ids = _route(n, 32, 7)
    whole = _call(fused_moe, x, w, ids, experts_20b)
    total = torch.zeros_like(whole, dtype=torch.float32)
    for start in (0, 16):
        half = {k: v[start : start + 16] for k, v in experts_20b.items()}
        part = _call(fused_moe, x, w, ids, {**half, "expert_start": start})
        ref = _call(moe_experts_reference, x, w, ids, {**half, "expert_start": start})
        assert _rel(part, ref) < 2e-2, (start, n)
        total += part.float()
    assert _rel(total, whole) < 2e-2, n
    half = {k: v[16:] for k, v in experts_20b.items()} | {"expert_start": 16}
    static = [x.clone(), w.clone(), ids.clone(), torch.ones(n, dtype=torch.bool, device="cuda")]
    _call(fused_moe, *static[:3], half, static[3])  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _call(fused_moe, *static[:3], half, static[3])
    x2, w2, ids2 = _route(n, 32, 8)
    live = (n + 1) // 2
    valid = torch.arange(n, device="cuda") < live
    for buf, new in zip(static, (x2, w2, ids2, valid)):
        buf.copy_(new)
    graph.replay()
    assert torch.equal(out, _call(fused_moe, x2, w2, ids2, half, valid))
    assert (out[live:] == 0).all()
