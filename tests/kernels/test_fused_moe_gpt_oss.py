"""The fused MoE in GPT-OSS's form vs the per-expert torch reference: per-expert biases, the clamped
SwiGLU (a low limit, so the clamps engage), dense and MXFP4 experts (codes and e8m0 scales dequantised in
the kernel's registers, exactly: one-hot inputs read every code and scale back), fp32 and bf16, padded
rows, experts with no tokens, poisoned intermediates, both pair sorts, and input sizes whose last K step
is partial."""

from __future__ import annotations

import pytest
import torch

from swaserve.kernels import moe_align
from swaserve.kernels.fused_moe import fused_moe
from swaserve.kernels.moe_align import align_pairs
from swaserve.kernels.moe_gemm import MX_BITS, MX_FLOAT, MX_GROUP, MX_LUT, MX_SCALED, moe_gemm
from swaserve.layers import mxfp4
from swaserve.layers.fused_moe import moe_experts_reference

ALPHA, LIMIT = 1.702, 1.5


def _weights(E, rows, n_in, quantized, g):
    """(weight, scales): MXFP4 codes + scales (2^-4..2^-2: activations reach the clamp), or dense."""
    if quantized:
        blocks = torch.randint(0, 256, (E, rows, n_in // 32, 16), generator=g, dtype=torch.uint8)
        scales = torch.randint(123, 126, (E, rows, n_in // 32), generator=g, dtype=torch.uint8)
        return blocks, scales
    return 0.3 * torch.randn(E, rows, n_in, generator=g), None


def _problem(n, E, k, H, I, dtype, device, seed, quantized, ids=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, H, generator=g).to(dtype)
    w1, s1 = _weights(E, 2 * I, H, quantized, g)
    w2, s2 = _weights(E, H, I, quantized, g)
    if not quantized:
        w1, w2 = w1.to(dtype), w2.to(dtype)
    b1 = torch.randn(E, 2 * I, generator=g).to(dtype)
    b2 = torch.randn(E, H, generator=g).to(dtype)
    if ids is None:
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(n)])
    w = torch.softmax(torch.randn(n, k, generator=g), -1)
    dev = lambda t: None if t is None else t.to(device)  # noqa: E731
    extra = {"gate_up_scales": dev(s1), "down_scales": dev(s2), "gate_up_bias": dev(b1), "down_bias": dev(b2),
             "alpha": ALPHA, "limit": LIMIT}
    return dev(x), dev(w1), dev(w2), dev(w), dev(ids), extra


def _cpu(extra):
    return {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in extra.items()}


def _check(out, x, w1, w2, w, ids, extra, dtype, valid=None):
    ref = moe_experts_reference(x.cpu(), w1.cpu(), w2.cpu(), w.cpu(), ids.cpu(), "swiglu_oai",
                                None if valid is None else valid.cpu(), **_cpu(extra))
    if dtype == torch.float32:
        torch.testing.assert_close(out.cpu(), ref, rtol=1e-4, atol=1e-4)
    else:  # a bf16 ulp of the intermediate flips with the accumulation order: compare against the scale
        err = (out.cpu().float() - ref.float()).abs().max() / ref.float().abs().max()
        assert err < 4e-2, err


@pytest.mark.parametrize("quantized", [False, True], ids=["dense", "mxfp4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 9])
def test_matches_reference(n, dtype, quantized, device, seed):
    # H = 160: five 32-input groups, so the MXFP4 GEMM's second 128-input step is partial.
    x, w1, w2, w, ids, extra = _problem(n, 6, 2, 160, 64, dtype, device, seed, quantized)
    _check(fused_moe(x, w1, w2, w, ids, "swiglu_oai", **extra), x, w1, w2, w, ids, extra, dtype)


def test_clamps_engage():
    # The reference's swiglu_oai is HF's: gate clamped from above, up on both sides, (up + 1) * glu.
    x, w1, w2, w, ids, extra = _problem(7, 4, 2, 64, 32, torch.float64, "cpu", 0, False)
    out = moe_experts_reference(x, w1, w2, w, ids, "swiglu_oai", **extra)
    dense = torch.zeros_like(out)
    for t in range(7):
        for j in range(2):
            e = int(ids[t, j])
            gu = w1[e] @ x[t] + extra["gate_up_bias"][e]
            gate, up = gu[:32], gu[32:]
            assert (gate > LIMIT).any() and (up.abs() > LIMIT).any(), "the clamps must matter here"
            gate, up = gate.clamp(max=LIMIT), up.clamp(-LIMIT, LIMIT)
            h = (up + 1) * gate * torch.sigmoid(ALPHA * gate)
            dense[t] += w[t, j] * (w2[e] @ h + extra["down_bias"][e])
    torch.testing.assert_close(out, dense, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mx_mode", [MX_BITS, MX_FLOAT, MX_GROUP, MX_SCALED, MX_LUT],
                         ids=["bits", "float", "group", "scaled", "lut"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_dequantises_every_code_and_scale_exactly(dtype, mx_mode, device, seed):
    """One-hot activations through the (ungated) down GEMM return the weight itself: every one of the
    256 code bytes, each nibble, and scales 2^-125..2^113 come back as `mxfp4.dequantize` gives them
    (bf16 holds them all: fp32's exponent range; no subnormal or inf, which a 0 x inf in the dot or a
    flush-to-zero multiply would turn into something else)."""
    E, H, n_in = 2, 16, 64
    g = torch.Generator().manual_seed(seed)
    blocks = torch.arange(E * H * n_in // 2, dtype=torch.int64).remainder(256).to(torch.uint8)
    blocks = blocks[torch.randperm(blocks.numel(), generator=g)].view(E, H, n_in // 32, 16)
    scales = torch.randint(2, 241, (E, H, n_in // 32), generator=g, dtype=torch.uint8)
    scales[0, 0] = torch.tensor([2, 240], dtype=torch.uint8)
    want = mxfp4.dequantize(blocks, scales, dtype)  # [E, H, n_in]
    # Pair p = e * n_in + i belongs to expert e and carries the one-hot input i.
    ids = torch.arange(E).repeat_interleave(n_in)[:, None]  # [E * n_in, 1]
    a = torch.eye(n_in).repeat(E, 1).to(dtype)  # [E * n_in, n_in]
    sorted_pairs, block_expert = align_pairs(ids.to(device), E, 16)
    out = torch.full((E * n_in, H), float("nan"), dtype=dtype, device=device)
    moe_gemm(a.to(device), blocks.to(device), scales.to(device), None, out, sorted_pairs, block_expert,
             E * n_in, top_k=1, a_per_token=False, gated=False, block_m=16, block_n=16, mx_mode=mx_mode)
    got = out.cpu().view(E, n_in, H).transpose(1, 2)  # [E, H, n_in]: output row h, input i
    assert torch.equal(got, want)


@pytest.mark.parametrize("mx_mode", [MX_BITS, MX_GROUP, MX_SCALED, MX_LUT], ids=["bits", "group", "scaled", "lut"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_dequantisation_mode_matches_the_reference(mx_mode, dtype, device, seed):
    """The gated, biased GPT-OSS path through each of moe_gemm's other MXFP4 modes (the default, float,
    runs in every other test), with tile and pipelining overrides as the benchmark sweeps them; an input
    size (160) that leaves the last 128-input step half full."""
    x, w1, w2, w, ids, extra = _problem(9, 6, 2, 160, 64, dtype, device, seed, True)
    tuning = {"mx_mode": mx_mode, "num_warps": 8, "num_stages": 2, "block_n": 32}
    out = fused_moe(x, w1, w2, w, ids, "swiglu_oai", **extra, tuning=tuning)
    _check(out, x, w1, w2, w, ids, extra, dtype)


def test_experts_without_tokens_padded_rows_and_poisoned_buffers(device, seed, monkeypatch):
    real_empty = torch.empty

    def nan_empty(*shape, **kw):
        t = real_empty(*shape, **kw)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    n, E = 11, 8
    ids = torch.tensor([[1, 6]] * 5 + [[6, 3]] * 6)  # experts 0, 2, 4, 5 and 7 get nothing
    x, w1, w2, w, ids, extra = _problem(n, E, 2, 64, 32, torch.float32, device, seed, True, ids=ids)
    valid = torch.tensor([True, False] * 5 + [False], device=device)
    full = fused_moe(x, w1, w2, w, ids, "swiglu_oai", **extra)
    monkeypatch.setattr(torch, "empty", nan_empty)
    masked = fused_moe(x, w1, w2, w, ids, "swiglu_oai", row_valid=valid, **extra)
    monkeypatch.setattr(torch, "empty", real_empty)
    assert torch.isfinite(masked).all() and (masked[~valid] == 0).all()
    # (Not bitwise: dropping pairs moves the real ones within their blocks, and the interpreter's
    # numpy matmul rounds a row by its offset in the block.)
    torch.testing.assert_close(masked[valid], full[valid], rtol=1e-5, atol=1e-5)
    _check(masked, x, w1, w2, w, ids, extra, torch.float32, valid)


def test_sort_by_torch_ops_and_batch_invariant_tiling(device, seed, monkeypatch):
    # Above ALIGN_KERNEL_MAX_PAIRS the pairs are sorted by torch ops (prefill); deterministic mode tiles
    # 64 x 64 whatever n: both still the reference's result.
    monkeypatch.setattr(moe_align, "ALIGN_KERNEL_MAX_PAIRS", 0)
    x, w1, w2, w, ids, extra = _problem(13, 5, 3, 64, 64, torch.float32, device, seed, True)
    valid = torch.arange(13, device=device) % 4 != 1
    _check(fused_moe(x, w1, w2, w, ids, "swiglu_oai", row_valid=valid, **extra), x, w1, w2, w, ids, extra,
           torch.float32, valid)
    bi = fused_moe(x, w1, w2, w, ids, "swiglu_oai", row_valid=valid, batch_invariant=True, **extra)
    _check(bi, x, w1, w2, w, ids, extra, torch.float32, valid)


def test_swiglu_oai_needs_its_parameters(device):
    x, w1, w2, w, ids, extra = _problem(2, 3, 1, 32, 32, torch.float32, device, 0, False)
    with pytest.raises(ValueError, match="swiglu_oai activation needs alpha and limit"):
        fused_moe(x, w1, w2, w, ids, "swiglu_oai", gate_up_bias=extra["gate_up_bias"])
    with pytest.raises(ValueError, match="swiglu_oai activation needs alpha and limit"):
        moe_experts_reference(x.cpu(), w1.cpu(), w2.cpu(), w.cpu(), ids.cpu(), "swiglu_oai", alpha=1.0)


@pytest.mark.parametrize("quantized", [False, True], ids=["dense", "mxfp4"])
def test_expert_parallel_runs_add_each_bias_once(quantized, device, seed):
    """Expert parallelism in GPT-OSS's form: each run of experts (its blocks, scales and biases) gets the
    global ids; a pair's biases are added by the one run holding its expert, so the runs sum to the whole."""
    x, w1, w2, w, ids, extra = _problem(11, 5, 2, 64, 32, torch.float32, device, seed, quantized)
    valid = torch.arange(11, device=device) != 4
    whole = fused_moe(x, w1, w2, w, ids, "swiglu_oai", row_valid=valid, **extra)
    total = torch.zeros_like(whole)
    for start, count in ((0, 3), (3, 2)):
        run = slice(start, start + count)
        part_extra = {k: v[run] if isinstance(v, torch.Tensor) else v for k, v in extra.items()}
        part = fused_moe(x, w1[run], w2[run], w, ids, "swiglu_oai", row_valid=valid, expert_start=start,
                         **part_extra)
        ref = moe_experts_reference(x.cpu(), w1[run].cpu(), w2[run].cpu(), w.cpu(), ids.cpu(), "swiglu_oai",
                                    valid.cpu(), expert_start=start, **_cpu(part_extra))
        torch.testing.assert_close(part.cpu(), ref, rtol=1e-4, atol=1e-4)
        total += part
    torch.testing.assert_close(total, whole, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("split_k", [2, 3])
@pytest.mark.parametrize("quantized", [False, True], ids=["dense", "mxfp4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_k_matches_the_reference_and_the_unsplit_gemms(split_k, quantized, dtype, device, seed):
    """Both GEMMs' inputs split over programs (float32 partials; the first's summed and activated by
    `finish_split`, the second's by the combine), biases added once: the reference's result, and the
    unsplit kernels' within the reference's float32 tolerance (another summation order: natively on an
    H200 the two parted by up to 2.5e-5). 3 splits of 5 K steps leave the last one a partial step."""
    x, w1, w2, w, ids, extra = _problem(3, 6, 2, 544, 288, dtype, device, seed, quantized)
    out = fused_moe(x, w1, w2, w, ids, "swiglu_oai", **extra, tuning={"split_k": split_k})
    _check(out, x, w1, w2, w, ids, extra, dtype)
    if dtype == torch.float32:
        whole = fused_moe(x, w1, w2, w, ids, "swiglu_oai", **extra, tuning={"split_k": 1})
        torch.testing.assert_close(out, whole, rtol=1e-4, atol=1e-4)


def test_split_k_padded_rows_and_poisoned_buffers(device, seed, monkeypatch):
    """Split partials of rows no pair wrote are never read: NaN-filled buffers, invalid rows give 0."""
    real_empty = torch.empty

    def nan_empty(*shape, **kw):
        t = real_empty(*shape, **kw)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    ids = torch.tensor([[1, 4]] * 3 + [[4, 2]] * 2)
    x, w1, w2, w, ids, extra = _problem(5, 6, 2, 288, 64, torch.float32, device, seed, True, ids=ids)
    valid = torch.tensor([True, False, True, True, False], device=device)
    monkeypatch.setattr(torch, "empty", nan_empty)
    out = fused_moe(x, w1, w2, w, ids, "swiglu_oai", row_valid=valid, **extra, tuning={"split_k": 2})
    monkeypatch.setattr(torch, "empty", real_empty)
    assert torch.isfinite(out).all() and (out[~valid] == 0).all()
    _check(out, x, w1, w2, w, ids, extra, torch.float32, valid)


def test_split_k_is_chosen_for_mxfp4_at_decode_sizes_only():
    """gpt-oss-20b's experts (hidden = intermediate = 2880, 64-column tiles) on 132 SMs: at one token
    (4 experts) each GEMM's 180 programs split 4 ways; at 16 tokens (32 experts: 1,440) none; and no split
    where each part would get fewer than two 128-input steps."""
    from swaserve.kernels.fused_moe import _split_k

    assert _split_k(4 * 45, 2880, 132) == 4
    assert _split_k(32 * 45, 2880, 132) == 1
    assert _split_k(4 * 45, 256, 132) == 1 and _split_k(1, 512, 132) == 2
