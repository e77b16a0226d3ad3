"""Greedy parity of swaserve vs HF transformers on the same weights, on CUDA: HF `generate` per
prompt alone vs all prompts batched through our scheduler (chunked prefill, triton attention, CUDA-
graph decode with padded rows); per-prompt rows of first divergence and logit differences."""

from __future__ import annotations

import copy
import gc
from dataclasses import dataclass
from typing import Any

import torch
import transformers as tf
from engine_driver import count_replays, forward, make_req

from swaserve.config import CacheConfig, RunnerConfig, SchedulerConfig
from swaserve.model_config import ModelConfig
from swaserve.models.registry import build_model
from swaserve.runtime import build_runtime

DEV = "cuda"


@dataclass(frozen=True)
class Setup:
    steps: int  # greedy tokens per prompt
    max_context: int
    prefill_chunk: int  # tokens per prefill chunk: prompts longer than this are split
    kv_cache_bytes: int = 512 << 20
    max_running: int = 8  # captured decode size: fewer prompts leave padded rows
    policy: str = "mixed"  # SchedulerConfig.schedule_policy


@torch.inference_mode()
def hf_greedy(model, prompt: list[int], steps: int) -> tuple[torch.Tensor, list[int]]:
    """HF `generate` alone on one prompt, greedy, no EOS stop: logits `[steps, vocab]` float32, tokens."""
    ids = torch.tensor([prompt], device=DEV)
    gen = tf.GenerationConfig(max_new_tokens=steps, do_sample=False, eos_token_id=None, pad_token_id=0,
                              output_logits=True, return_dict_in_generate=True)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen)
    return torch.cat(out.logits).float(), out.sequences[0, len(prompt):].tolist()


def ours_greedy(hf_model, dtype: torch.dtype, prompts: list[list[int]], s: Setup,
                checkpoint: tuple[Any, dict[str, torch.Tensor]] | None = None) -> tuple[list, list, list]:
    """All prompts batched through our scheduler: per prompt, logits `[steps, vocab]` and tokens.
    `checkpoint`: (HF config, weights) to load instead of the HF model's own, for a quantised checkpoint
    whose HF model holds the dequantised weights."""
    hf_config, weights = checkpoint or (hf_model.config, hf_model.state_dict())
    config = ModelConfig.from_hf(hf_config, max_context=s.max_context)
    model = build_model(config, dtype, DEV)
    model.load_weights(weights.items())
    sched = SchedulerConfig(max_running_requests=s.max_running, max_prefill_tokens=s.prefill_chunk,
                            schedule_policy=s.policy)
    rt = build_runtime(config, model, torch.device(DEV), dtype, CacheConfig(kv_cache_bytes=s.kv_cache_bytes), sched,
                       RunnerConfig(attention_backend="triton"))
    assert type(rt.runner.graph_runner).__name__ == "CudaGraphRunner"
    replays = count_replays(rt)
    reqs = [make_req(f"p{i}", p, s.steps) for i, p in enumerate(prompts)]
    for r in reqs:
        rt.scheduler.add(r)
    logits: dict[str, list[torch.Tensor]] = {r.rid: [] for r in reqs}
    while rt.scheduler.has_unfinished():
        batch, lg = forward(rt, DEV)
        for j, i in enumerate(batch.sample_indices()):
            logits[batch.reqs[i].rid].append(lg[j])
        rt.scheduler.process_output(batch, lg.argmax(-1).tolist())
    assert rt.scheduler.retractions_total == 0
    # Decode graphs ran, some with padded rows (requests start and finish decoding at different steps
    # under mixed scheduling, so the live count varies).
    assert replays and (len(prompts) == 1 or any(raw < bs for raw, bs in replays)), replays
    out = [torch.stack(logits[r.rid]) for r in reqs], [r.output_ids for r in reqs], replays
    del rt, model
    gc.collect()  # the replay counter's closure makes a cycle that holds the runner (and weights)
    torch.cuda.empty_cache()
    return out


def compare(hf_model, dtype: torch.dtype, prompts: list[list[int]], s: Setup,
            checkpoint: tuple[Any, dict[str, torch.Tensor]] | None = None) -> tuple[list[dict], int]:
    """Rows per prompt (first divergence, logit differences up to it) and the number of decode replays."""
    ref = [hf_greedy(hf_model, p, s.steps) for p in prompts]
    our_logits, our_tokens, replays = ours_greedy(hf_model, dtype, prompts, s, checkpoint)
    return divergence_rows(prompts, ref, list(zip(our_logits, our_tokens)), s.steps), len(replays)


def divergence_rows(prompts: list[list[int]], ref: list, got: list, steps: int) -> list[dict]:
    """Per prompt, greedy run `got` (logits `[steps, vocab]`, tokens) against `ref`: the first step
    whose token differs and the logit differences up to it (past it the histories differ)."""
    rows = []
    for p, (hl, ht), (ol, ot) in zip(prompts, ref, got):
        assert ol.shape == hl.shape and len(ot) == steps
        assert torch.isfinite(ol).all(), f"prompt of {len(p)} tokens: non-finite logits"
        d = next((i for i in range(steps) if ot[i] != ht[i]), None)
        upto = steps if d is None else d + 1  # logits up to the divergence share one history
        o, h = ol[:upto], hl[:upto]
        row = {"prompt_len": len(p), "first_divergence": d,
               "max_logit_diff": (o - h).abs().max().item(),
               "rel_logit_rms": ((o - h).norm() / (h - h.mean()).norm()).item(),
               "logit_std": hl[0].std().item(), "unique_tokens": len(set(ht)),
               "step_max_diff": [round(x, 5) for x in (o - h).abs().amax(-1).tolist()]}
        if d is not None:
            row["hf_gap_at_divergence"] = (hl[d, ht[d]] - hl[d, ot[d]]).item()
            row["our_gap_at_divergence"] = (ol[d, ot[d]] - ol[d, ht[d]]).item()
        rows.append(row)
    return rows


def assert_fp32_parity(rows: list[dict], atol: float) -> None:
    """fp32: logits within `atol` of HF's, and greedy tokens identical unless HF's own top two were
    closer than 2 * atol where they parted (a near-tie no implementation is wrong about)."""
    for row in rows:
        d = row["first_divergence"]
        assert row["max_logit_diff"] < atol, f"fp32 logits differ from HF: {row}"
        near_tie = d is not None and row["hf_gap_at_divergence"] < 2 * atol
        assert d is None or near_tie, f"fp32 greedy tokens differ from HF: {row}"


def bf16_copy(hf_fp32):
    """A bf16 copy of the fp32 HF model whose rotary frequencies stay float32, as `from_pretrained` in
    bf16 leaves them (and as ours keep them): `.to(bfloat16)` alone also rounds the `inv_freq` buffers,
    which turns positions into angles off by up to 3e-3 relative (measured on CPU at gpt-oss widths:
    HF bf16's own first-token error vs fp32 0.042 with rounded frequencies, 0.021 without)."""
    hf_bf16 = copy.deepcopy(hf_fp32).to(torch.bfloat16)
    for name, buf in hf_fp32.named_buffers():
        owner, _, leaf = name.rpartition(".")
        if leaf in ("inv_freq", "original_inv_freq"):
            setattr(hf_bf16.get_submodule(owner), leaf, buf.detach().clone())
    return hf_bf16


def bf16_rows(hf_fp32, prompts: list[list[int]], compare) -> list[dict]:
    """`compare` run on a bf16 copy of the fp32 HF model (`bf16_copy`, freed afterwards)."""
    hf_bf16 = bf16_copy(hf_fp32)
    rows = compare(hf_bf16, torch.bfloat16, prompts)
    del hf_bf16
    torch.cuda.empty_cache()
    return rows


def hf_bf16_rows(hf_fp32, prompts: list[list[int]], steps: int) -> list[dict]:
    """HF's own bf16 model (`bf16_copy`, freed afterwards) greedy against HF fp32, as `divergence_rows`:
    how far the bf16 reference itself is from the exact one (a yardstick for ours in bf16)."""
    hf_bf16 = bf16_copy(hf_fp32)
    got = [hf_greedy(hf_bf16, p, steps) for p in prompts]
    del hf_bf16
    torch.cuda.empty_cache()
    return divergence_rows(prompts, [hf_greedy(hf_fp32, p, steps) for p in prompts], got, steps)


def assert_bf16_near_ties(rows: list[dict], gap: float) -> None:
    """bf16: greedy output may part from HF only where HF's top two are less than `gap` apart."""
    for row in rows:
        assert row["first_divergence"] is None or row["hf_gap_at_divergence"] < gap, (
            f"bf16 parted from HF at a clear HF choice (not a near-tie): {row}")
