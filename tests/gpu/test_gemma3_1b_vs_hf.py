"""A random-weight model of Gemma 3 1B's shape (26 layers, every 6th full, window 512, vocab 262144)
vs HF transformers on CUDA: six prompts of 100-1500 tokens batched through the scheduler (chunked
prefill, triton attention, CUDA-graph decode), 48 greedy steps each, vs HF `generate` per prompt.
fp32: identical tokens and logits within 1e-3; bf16: parts from HF only at near-ties (reported).
"""

from __future__ import annotations

import copy
import gc

import pytest
import torch
import transformers as tf
from engine_driver import count_replays, forward, make_req, record

from swaserve.config import CacheConfig, ModelConfig, RunnerConfig, SchedulerConfig
from swaserve.runner.model_runner import build_model
from swaserve.runtime import build_runtime

pytestmark = pytest.mark.gpu
DEV = "cuda"
SHAPE = {"vocab_size": 262144, "hidden_size": 1152, "num_hidden_layers": 26, "num_attention_heads": 4,
         "num_key_value_heads": 1, "head_dim": 256, "intermediate_size": 6912, "sliding_window": 512,
         "query_pre_attn_scalar": 256, "max_position_embeddings": 32768}
PROMPT_LENS = (100, 511, 512, 513, 700, 1500)  # short, at the window edge, and well past it
STEPS = 48
MAX_CONTEXT = 2048
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


@torch.inference_mode()
def hf_greedy(model, prompt: list[int]) -> tuple[torch.Tensor, list[int]]:
    """HF `generate` alone on one prompt, greedy, no EOS stop: logits `[STEPS, vocab]` float32, tokens."""
    ids = torch.tensor([prompt], device=DEV)
    gen = tf.GenerationConfig(max_new_tokens=STEPS, do_sample=False, eos_token_id=None, pad_token_id=0,
                              output_logits=True, return_dict_in_generate=True)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen)
    return torch.cat(out.logits).float(), out.sequences[0, len(prompt):].tolist()


def ours_greedy(hf_model, dtype: torch.dtype, prompts: list[list[int]]) -> tuple[list, list, list]:
    """All prompts batched through our scheduler: per prompt, logits `[STEPS, vocab]` and tokens."""
    config = ModelConfig.from_hf(hf_model.config, max_context=MAX_CONTEXT)
    model = build_model(config, dtype, DEV)
    model.load_weights(hf_model.state_dict().items())
    cache = CacheConfig(kv_cache_bytes=512 << 20)
    # 1024-token prefill chunks: the 512/513/700/1500-token prompts are split, so prefix lists cross
    # the window; decode runs 6 requests in the captured size 8 (two padded rows).
    sched = SchedulerConfig(max_running_requests=8, max_prefill_tokens=1024)
    runner = RunnerConfig(attention_backend="triton")
    rt = build_runtime(config, model, torch.device(DEV), dtype, cache, sched, runner)
    assert type(rt.runner.graph_runner).__name__ == "CudaGraphRunner"
    replays = count_replays(rt)
    reqs = [make_req(f"p{i}", p, STEPS) for i, p in enumerate(prompts)]
    for r in reqs:
        rt.scheduler.add(r)
    logits: dict[str, list[torch.Tensor]] = {r.rid: [] for r in reqs}
    while rt.scheduler.has_unfinished():
        batch, lg = forward(rt, DEV)
        for j, i in enumerate(batch.sample_indices()):
            logits[batch.reqs[i].rid].append(lg[j])
        rt.scheduler.process_output(batch, lg.argmax(-1).tolist())
    assert rt.scheduler.retractions_total == 0
    assert replays and all(raw == 6 and bs == 8 for raw, bs in replays), replays
    out = [torch.stack(logits[r.rid]) for r in reqs], [r.output_ids for r in reqs], replays
    del rt, model
    gc.collect()  # the replay counter's closure makes a cycle that holds the runner (and weights)
    torch.cuda.empty_cache()
    return out


def compare(hf_model, dtype: torch.dtype, prompts: list[list[int]]) -> list[dict]:
    ref = [hf_greedy(hf_model, p) for p in prompts]
    our_logits, our_tokens, replays = ours_greedy(hf_model, dtype, prompts)
    rows = []
    for p, (hl, ht), ol, ot in zip(prompts, ref, our_logits, our_tokens):
        assert ol.shape == hl.shape and len(ot) == STEPS
        assert torch.isfinite(ol).all(), f"prompt of {len(p)} tokens: non-finite logits"
        d = next((s for s in range(STEPS) if ot[s] != ht[s]), None)
        upto = STEPS if d is None else d + 1  # logits up to the divergence share one history
        o, h = ol[:upto], hl[:upto]
        row = {"prompt_len": len(p), "first_divergence": d,
               "max_logit_diff": (o - h).abs().max().item(),
               "rel_logit_rms": ((o - h).norm() / (h - h.mean()).norm()).item(),
               "logit_std": hl[0].std().item(), "unique_tokens": len(set(ht))}
        if d is not None:
            row["hf_gap_at_divergence"] = (hl[d, ht[d]] - hl[d, ot[d]]).item()
            row["our_gap_at_divergence"] = (ol[d, ot[d]] - ol[d, ht[d]]).item()
        rows.append(row)
    record({"test": "gemma3_1b_vs_hf", "dtype": str(dtype).removeprefix("torch."), "steps": STEPS,
            "decode_replays": len(replays), "prompts": rows})
    return rows


def test_fp32_tokens_identical_to_hf(hf_fp32, prompts):
    for row in compare(hf_fp32, torch.float32, prompts):
        d = row["first_divergence"]
        assert row["max_logit_diff"] < FP32_ATOL, f"fp32 logits differ from HF: {row}"
        near_tie = d is not None and row["hf_gap_at_divergence"] < 2 * FP32_ATOL
        assert d is None or near_tie, f"fp32 greedy tokens differ from HF: {row}"


def test_bf16_diverges_only_at_near_ties(hf_fp32, prompts):
    hf_bf16 = copy.deepcopy(hf_fp32).to(torch.bfloat16)
    rows = compare(hf_bf16, torch.bfloat16, prompts)
    del hf_bf16
    torch.cuda.empty_cache()
    for row in rows:
        assert row["first_divergence"] is None or row["hf_gap_at_divergence"] < BF16_GAP, (
            f"bf16 parted from HF at a clear HF choice (not a near-tie): {row}")
