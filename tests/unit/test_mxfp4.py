"""The MXFP4 format helpers: the dequantiser equals transformers' `convert_moe_packed_tensors` bit for bit
(every code byte, scales 2^-126..2^127, fp32 and bf16); `quantization_config` parsing (dict or object
form, unsupported methods named); `modules_to_not_convert` globs; the dummy draw's range."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from swaserve.layers import mxfp4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_equals_transformers(dtype):
    g = torch.Generator().manual_seed(0)
    E, out, groups = 3, 40, 5
    blocks = torch.arange(E * out * groups * 16).remainder(256).to(torch.uint8)
    blocks = blocks[torch.randperm(blocks.numel(), generator=g)].view(E, out, groups, 16)
    scales = torch.randint(1, 255, (E, out, groups), generator=g, dtype=torch.uint8)
    scales[0, 0, :2] = torch.tensor([1, 254], dtype=torch.uint8)
    ours = mxfp4.dequantize(blocks, scales, dtype)  # [E, out, in]
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # [E, in, out]: HF's input-major layout
    assert ours.dtype == dtype and ours.shape == (E, out, groups * 32)
    assert torch.equal(ours, theirs.transpose(1, 2))


def test_dequantize_rejects_what_is_not_mxfp4():
    with pytest.raises(ValueError, match="must be uint8"):
        mxfp4.dequantize(torch.zeros(1, 1, 16), torch.zeros(1, 1, dtype=torch.uint8), torch.float32)
    with pytest.raises(ValueError, match="do not match"):
        mxfp4.dequantize(torch.zeros(1, 2, 16, dtype=torch.uint8), torch.zeros(1, 1, dtype=torch.uint8), torch.float32)


def test_quant_method():
    assert mxfp4.quant_method(SimpleNamespace()) is None
    assert mxfp4.quant_method(SimpleNamespace(quantization_config=None)) is None
    assert mxfp4.quant_method(SimpleNamespace(quantization_config={"quant_method": "MXFP4"})) == "mxfp4"
    obj = SimpleNamespace(quant_method=SimpleNamespace(value="mxfp4"), modules_to_not_convert=None)
    assert mxfp4.quant_method(SimpleNamespace(quantization_config=obj)) == "mxfp4"
    with pytest.raises(ValueError, match="quant_method 'gptq' is not supported"):
        mxfp4.quant_method(SimpleNamespace(quantization_config={"quant_method": "gptq"}))


def test_modules_to_not_convert_globs():
    skip = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head", "model.layers.5"]
    hf = SimpleNamespace(quantization_config={"quant_method": "mxfp4", "modules_to_not_convert": skip})
    assert mxfp4.is_quantized(hf, "model.layers.3.mlp.experts")
    assert not mxfp4.is_quantized(hf, "model.layers.3.mlp.router")
    assert not mxfp4.is_quantized(hf, "model.layers.5.mlp.experts")  # a module above it is listed
    assert not mxfp4.is_quantized(hf, "model.layers.15.self_attn.q_proj")
    assert not mxfp4.is_quantized(SimpleNamespace(), "model.layers.3.mlp.experts")


def test_dummy_draws():
    g = torch.Generator().manual_seed(0)
    blocks = torch.empty(4, 64, 3, 16, dtype=torch.uint8)
    scales = torch.empty(4, 64, 3, dtype=torch.uint8)
    mxfp4.random_codes_(blocks, g)
    mxfp4.random_scales_(scales, g)
    assert blocks.unique().numel() == 256 and set(scales.unique().tolist()) == set(mxfp4.DUMMY_SCALES)
    rms = mxfp4.dequantize(blocks, scales, torch.float32).pow(2).mean().sqrt()
    assert 0.012 < rms < 0.03, rms
