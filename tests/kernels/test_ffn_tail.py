"""ffn_tail (a Gemma 4 layer's end, feed-forward outputs to the next layer's normed input, in one launch)
against the launches it replaces, bit for bit (a float32 row on a GPU: within an ulp, `_assert_same`):
`rms_norm` (with its residual) for each norm and the layer scalar's product in torch; and against the
torch reference norms. MoE and dense layers, split-K partial sums for the MLP output, strided rows and
an empty batch."""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")

from swaserve.kernels.ffn_tail import ffn_tail  # noqa: E402
from swaserve.kernels.norm import rms_norm  # noqa: E402
from swaserve.layers.norm import RMSNorm  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# bf16 loads are broken in Triton 3.9's CPU interpreter (test_fused_norm.py); natively both dtypes
DTYPES = [torch.float32] if INTERPRET else [torch.float32, torch.bfloat16]
FORMS = [dict(fp32_weight=True), dict(unit_offset=True)]  # Gemma 4's form, and Gemma's


def _norms(n: int, dim: int, form: dict, dtype: torch.dtype, device: str,
           g: torch.Generator) -> list[RMSNorm]:
    out = []
    for _ in range(n):
        norm = RMSNorm(dim, eps=1e-6, **form)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(dim, generator=g) * 0.3 + (0 if form.get("unit_offset") else 1))
        out.append(norm.to(device=device, dtype=torch.float32 if form.get("fp32_weight") else dtype))
    return out


def _assert_same(got: tuple, want: tuple, dtype: torch.dtype, seed: int) -> None:
    """Bit for bit, but for a float32 row on a GPU: there `norm_1(mlp) + norm_2(moe)` is a sum of two
    unrounded products, and the compiler may contract either one into an FMA where the separate launches
    (the first product stored) can only contract the second: an ulp apart."""
    for g, w in zip(got, want):
        if dtype == torch.float32 and not INTERPRET:
            torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6, msg=lambda m: f"seed={seed}: {m}")
        else:
            assert torch.equal(g, w), f"seed={seed}"


def _kw(form: dict) -> dict:
    return dict(unit_offset=form.get("unit_offset", False), weight_fp32=form.get("fp32_weight", False))


def _separate(mlp, moe, h, n1, n2, post, scalar, nxt, form):
    """The launches ffn_tail replaces, as `Gemma4DecoderLayer.forward` makes them."""
    kw = _kw(form)
    ff = mlp
    if moe is not None:
        ff = rms_norm(moe, n2.weight, 1e-6, residual=rms_norm(mlp, n1.weight, 1e-6, **kw), **kw)
    h = rms_norm(ff, post.weight, 1e-6, residual=h, **kw)
    h = h * scalar
    return h, rms_norm(h, nxt.weight, 1e-6, **kw)


def _reference(mlp, moe, h, n1, n2, post, scalar, nxt):
    """The same in torch's reference norms."""
    ff = mlp if moe is None else n1._reference(mlp) + n2._reference(moe)
    h = (h + post._reference(ff)) * scalar
    return h, nxt._reference(h)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("moe", [True, False])
@pytest.mark.parametrize("dim", [64, 1000, 2816])
def test_ffn_tail_equals_the_separate_launches(device, seed, dtype, form, moe, dim):
    g = torch.Generator().manual_seed(seed)
    n1, n2, post, nxt = _norms(4, dim, form, dtype, device, g)
    mlp = (torch.randn(5, dim, generator=g) * 3).to(device, dtype)
    out = (torch.randn(5, dim, generator=g) * 2).to(device, dtype) if moe else None
    h = torch.randn(5, dim, generator=g).to(device, dtype)
    scalar = torch.tensor([0.7], device=device, dtype=dtype)
    got_h, got_x = ffn_tail(mlp, out, h, n1.weight if moe else None, n2.weight if moe else None, post.weight,
                            scalar, nxt.weight, 1e-6, **_kw(form))
    want_h, want_x = _separate(mlp, out, h, n1, n2, post, scalar, nxt, form)
    _assert_same((got_h, got_x), (want_h, want_x), dtype, seed)
    ref_h, ref_x = _reference(mlp, out, h, n1, n2, post, scalar, nxt)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got_h, ref_h, **tol, msg=lambda m: f"seed={seed}: {m}")
    torch.testing.assert_close(got_x, ref_x, **tol, msg=lambda m: f"seed={seed}: {m}")


def test_ffn_tail_sums_split_k_partials_strided_rows_and_empty(device, seed):
    """The MLP's output as float32 split-K partial sums (summed in order and rounded, as the GEMM's
    output would be), rows of `h` and the experts' output strided, and no rows at all."""
    g = torch.Generator().manual_seed(seed)
    dim, form = 640, dict(fp32_weight=True)
    n1, n2, post, nxt = _norms(4, dim, form, torch.float32, device, g)
    parts = torch.randn(3, 4, dim, generator=g).to(device)
    wide = torch.randn(4, dim + 64, generator=g).to(device)
    h, moe = wide[:, :dim], torch.randn(4, dim + 32, generator=g).to(device)[:, 16:16 + dim]
    scalar = torch.tensor([1.3], device=device)
    got = ffn_tail(parts, moe, h, n1.weight, n2.weight, post.weight, scalar, nxt.weight, 1e-6, **_kw(form))
    mlp = parts[0] + parts[1] + parts[2]
    want = _separate(mlp, moe, h, n1, n2, post, scalar, nxt, form)
    _assert_same(got, want, torch.float32, seed)
    empty = ffn_tail(mlp[:0], None, h[:0], None, None, post.weight, scalar, nxt.weight, 1e-6, **_kw(form))
    assert empty[0].shape == empty[1].shape == (0, dim)


@pytest.mark.parametrize("family", ["gemma4_moe", "gemma4"])
def test_gemma4_layer_fused_tail_matches_its_unfused_end(device, seed, family):
    """The wiring in `Gemma4DecoderLayer`: `_fused_tail` hands the kernel the layer's norms in the right
    roles and gives what the layer's unfused end computes (torch's reference norms here)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
    import families

    from swaserve.model_config import ModelConfig
    from swaserve.models.registry import build_model

    hf = getattr(families, family)()
    hf.architectures = ["Gemma4ForCausalLM"]
    model = build_model(ModelConfig.from_hf(hf), torch.float32, "cpu")
    with torch.no_grad():  # norms around their identity (HF's init), then jittered
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
    families.randomize_(model, seed)
    layer, nxt = model.model.layers[0], model.model.layers[1].input_layernorm
    g = torch.Generator().manual_seed(seed)
    ff, h = (torch.randn(3, hf.hidden_size, generator=g) for _ in range(2))
    moe = torch.randn(3, hf.hidden_size, generator=g) if layer.moe is not None else None
    want = ff
    if moe is not None:
        want = layer.post_feedforward_layernorm_2(moe, residual=layer.post_feedforward_layernorm_1(ff))
    want_h = layer.post_feedforward_layernorm(want, residual=h) * layer.layer_scalar
    got_h, got_x = layer.to(device)._fused_tail(ff.to(device), moe.to(device) if moe is not None else None,
                                                h.to(device), nxt.to(device))
    torch.testing.assert_close(got_h.cpu(), want_h, rtol=1e-5, atol=1e-5, msg=lambda m: f"seed={seed}: {m}")
    torch.testing.assert_close(got_x.cpu(), nxt.cpu()(want_h), rtol=1e-5, atol=1e-5,
                               msg=lambda m: f"seed={seed}: {m}")
