"""A random-weight model of Gemma 3 1B's shape (26 layers, every 6th full, window 512, vocab 262144)
vs HF transformers on CUDA: six prompts of 100-1500 tokens batched through the scheduler (chunked
prefill, triton attention, CUDA-graph decode), 48 greedy steps each, vs HF `generate` per prompt.
fp32: identical tokens and logits within 1e-3; bf16: parts from HF only at near-ties (reported).
"""

from __future__ import annotations


import hf_parity
import pytest
import torch
import transformers as tf
from engine_driver import record

pytestmark = pytest.mark.gpu
DEV = "cuda"
SHAPE = {"vocab_size": 262144, "hidden_size": 1152, "num_hidden_layers": 26, "num_attention_heads": 4,
         "num_key_value_heads": 1, "head_dim": 256, "intermediate_size": 6912, "sliding_window": 512,
         "query_pre_attn_scalar": 256, "max_position_embeddings": 32768}
PROMPT_LENS = (100, 511, 512, 513, 700, 1500)  # short, at the window edge, and well past it
STEPS = 48
MAX_CONTEXT = 2048
SETUP = hf_parity.Setup(steps=STEPS, max_context=MAX_CONTEXT, prefill_chunk=1024)
# fp32: both sides compute in true fp32 (no TF32 by default), so logits agree to ~1e-5 and greedy
# tokens must be identical. A flip is excused only at a near-tie: HF's own top-1 and our pick less
# than 2 * FP32_ATOL apart (then no implementation is wrong); the prompt is compared up to there.
FP32_ATOL = 1e-3
# bf16: both sides round activations, scores and logits to bf16 (logits near the top are ~3, where a
# bf16 step is 0.016; hidden states differ by ~1% after 26 layers of different kernels), so greedy
# outputs legitimately part once a step's top-1/top-2 gap (~0.1 on average for these logits, std
# ~0.7) falls below that noise; how early is luck, so token agreement is reported, not asserted. What
# a correct engine does guarantee is that it parts only at near-ties: at the first divergence our
# pick is within BF16_GAP of HF's top-1 in HF's own logits (noise is a few 0.01s; a wrong window or
# stale K/V picks a token far down HF's ranking, gaps of 1-3). Finer errors are the fp32 test's job.
BF16_GAP = 0.5


@pytest.fixture(scope="module")
def hf_fp32():
    layer_types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(26)]
    cfg = tf.Gemma3TextConfig(**SHAPE, layer_types=layer_types)
    cfg._attn_implementation = "eager"  # the plainest reference
    torch.manual_seed(0)
    with torch.device(DEV):
        model = tf.Gemma3ForCausalLM(cfg).eval()
    g = torch.Generator(device=DEV).manual_seed(0)
    with torch.no_grad():  # HF inits norms at 0 ((1 + w) form): jitter them so their loading matters
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn(p.shape, generator=g, device=DEV))
    yield model
    del model
    torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(10, SHAPE["vocab_size"], (n,), generator=g).tolist() for n in PROMPT_LENS]


def compare(hf_model, dtype: torch.dtype, prompts: list[list[int]]) -> list[dict]:
    # 1024-token prefill chunks: the 512/513/700/1500-token prompts are split, so prefix lists cross
    # the window; decode runs 6 requests in the captured size 8 (two padded rows).
    rows, replays = hf_parity.compare(hf_model, dtype, prompts, SETUP)
    record({"test": "gemma3_1b_vs_hf", "dtype": str(dtype).removeprefix("torch."), "steps": STEPS,
            "decode_replays": replays, "prompts": rows})
    return rows


def test_fp32_tokens_identical_to_hf(hf_fp32, prompts):
    hf_parity.assert_fp32_parity(compare(hf_fp32, torch.float32, prompts), FP32_ATOL)


def test_bf16_diverges_only_at_near_ties(hf_fp32, prompts):
    hf_parity.assert_bf16_near_ties(hf_parity.bf16_rows(hf_fp32, prompts, compare), BF16_GAP)
