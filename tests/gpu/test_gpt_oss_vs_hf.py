"""gpt-oss-20b's real layer shapes (hidden 2880; 64 query heads x 64 and 8 K/V heads with biases and sinks;
window 128 alternating with full layers; 32 experts top-4 of intermediate 2880; vocab 201088) cut to 4
layers, with random MXFP4 experts as the released checkpoints store them, vs HF transformers on CUDA
running the same experts dequantised by transformers' own `convert_moe_packed_tensors`: prompts around
and past the window batched through the scheduler (chunked prefill, triton attention, the MXFP4 fused MoE,
CUDA-graph decode with padded rows), greedy, vs HF `generate` per prompt. fp32: identical tokens (near-ties
excused), logits within 1e-3 of HF's relative to their spread; bf16: logits no further from HF fp32's than HF's own bf16
model's are. SwiGLU limit
7.0 and alpha 1.702: the values transformers 5.17 hard-codes (it reads neither from the config).
"""

from __future__ import annotations

import sys
from pathlib import Path

import hf_parity
import pytest
import torch
import transformers as tf
from engine_driver import record

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from common import gpt_oss_hf_config

pytestmark = pytest.mark.gpu
DEV = "cuda"
PROMPT_LENS = (50, 127, 128, 129, 300)
STEPS = 24
SETUP = hf_parity.Setup(steps=STEPS, max_context=1024, prefill_chunk=256, kv_cache_bytes=2 << 30)
# fp32: logits within FP32_REL_RMS of HF's (relative to their spread) over every step, and no single
# logit further than FP32_ATOL. The differences come as one-step spikes over a floor of ~1e-4, the
# signature of an expert at the edge of a token's top 4 whose logit ties the next one's to within fp32
# rounding (the two implementations sum in different orders) and swaps for it, at a routing weight far
# below the decisive experts'. Measured, the same on one H100 and on 4x H100: relative RMS <= 1.5e-4,
# spikes of 0.0030 (prompt 127, step 1) and 0.0075 (prompt 128, step 14) at a logit spread (std) of 2.7.
FP32_REL_RMS = 1e-3
FP32_ATOL = 2e-2
# bf16 logits' RMS difference from HF's fp32 relative to the logits' spread (up to a parting), mean over
# prompts: below this, or within 2x of HF's own bf16 model's (measured on 4x H100: ours 0.33, HF's 0.35).
BF16_REL_RMS = 0.1


@torch.no_grad()
def build(cfg, device: str, seed: int = 0, scales: tuple[int, int] = (119, 121)):
    """(HF model in fp32 holding the dequantised experts, our checkpoint: its weights with the experts as
    random MXFP4 codes and e8m0 scales drawn from `scales`, RMS ~0.025)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    hf_cfg = tf.GptOssConfig.from_dict({k: v for k, v in cfg.to_dict().items() if k != "quantization_config"})
    hf_cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    with torch.device(device):
        model = tf.GptOssForCausalLM(hf_cfg).float().eval()
    g = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        if ".experts." in name and not name.endswith("_bias"):
            continue
        if p.ndim >= 2:
            # Attention at std 0.02 keeps scores O(1); the router scaled so that the top-4 choices are
            # decisive (no fp32 rounding difference between two implementations flips one).
            p.normal_(0.0, 0.02 if ".self_attn." in name else 0.05, generator=g)
            if name.endswith("router.weight"):
                p.mul_(10.0)
        elif "norm" in name:
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g, device=device))
        else:  # biases and sinks
            p.normal_(0.0, 0.1 if name.endswith("sinks") else 0.02, generator=g)
    checkpoint = dict(model.state_dict())
    for i, layer in enumerate(model.model.layers):
        for proj in ("gate_up_proj", "down_proj"):
            param = getattr(layer.mlp.experts, proj)  # [E, in, out]
            E, n_in, n_out = param.shape
            codes = torch.randint(0, 256, (E, n_out, n_in // 32, 16), generator=g, device=device, dtype=torch.uint8)
            exps = torch.randint(scales[0], scales[1] + 1, (E, n_out, n_in // 32), generator=g, device=device,
                                 dtype=torch.uint8)
            param.copy_(convert_moe_packed_tensors(codes, exps, dtype=torch.float32))
            name = f"model.layers.{i}.mlp.experts.{proj}"
            del checkpoint[name]
            checkpoint[f"{name}_blocks"], checkpoint[f"{name}_scales"] = codes, exps
    return model, checkpoint


@pytest.fixture(scope="module")
def setup():
    cfg = gpt_oss_hf_config("20b", num_layers=4)
    model, checkpoint = build(cfg, DEV)
    yield model, (cfg, checkpoint)
    del model, checkpoint
    torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(10, 200000, (n,), generator=g).tolist() for n in PROMPT_LENS]


def compare(hf_model, dtype: torch.dtype, prompts: list[list[int]], checkpoint) -> list[dict]:
    rows, replays = hf_parity.compare(hf_model, dtype, prompts, SETUP, checkpoint)
    record({"test": "gpt_oss_20b_4layer_mxfp4_vs_hf", "dtype": str(dtype).removeprefix("torch."), "steps": STEPS,
            "transformers": tf.__version__, "decode_replays": replays, "prompts": rows})
    return rows


def test_fp32_tokens_identical_to_hf(setup, prompts):
    hf, checkpoint = setup
    rows = compare(hf, torch.float32, prompts, checkpoint)
    hf_parity.assert_fp32_parity(rows, FP32_ATOL)
    assert all(r["rel_logit_rms"] < FP32_REL_RMS for r in rows), [r["rel_logit_rms"] for r in rows]


def test_bf16_no_further_from_exact_than_hf_bf16(setup, prompts):
    """Ours in bf16 against HF in fp32 (the exact reference, not HF's own bf16: two bf16 runs that
    disagree do not say which is off), with HF's own bf16 model against the same fp32 run as the
    yardstick. A bf16 MoE routes a token to another expert set wherever a router's k-th and (k+1)-th
    logits are closer than the bf16 rounding of the hidden states (2% of tokens a layer here, with
    float32 router logits), and such a token's logits move by several units, in HF's bf16 as in ours:
    measured on 4x H100, HF bf16 itself parted from HF fp32 at the first token of three of the five
    prompts where fp32's top two were 1.1-1.3 apart. So the near-tie rule of the dense families'
    tests does not hold for either; what must hold is that ours is no further from exact than HF's."""
    hf, checkpoint = setup
    hf_own = hf_parity.hf_bf16_rows(hf, prompts, STEPS)
    rows = compare(hf, torch.bfloat16, prompts, checkpoint)
    record({"test": "gpt_oss_20b_4layer_mxfp4_bf16_vs_hf_fp32", "prompts": rows, "hf_bf16_vs_hf_fp32": hf_own})
    ours = sum(r["rel_logit_rms"] for r in rows) / len(rows)
    theirs = sum(r["rel_logit_rms"] for r in hf_own) / len(hf_own)
    assert ours < max(BF16_REL_RMS, 2 * theirs), (
        [r["rel_logit_rms"] for r in rows], [r["rel_logit_rms"] for r in hf_own])
