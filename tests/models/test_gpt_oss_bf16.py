"""GPT-OSS in bf16 on CPU vs HF transformers in fp32 on the same tiny MXFP4 checkpoint (sinks, window
alternation, YaRN, clamped SwiGLU, top-k router with bias): our prefill logits stay within a tenth of
the logits' spread of the exact ones, as the GPU parity run (tests/gpu/test_gpt_oss_vs_hf.py) demands
of its fused path, and no further from them than HF's own bf16 model is."""

from __future__ import annotations

import copy

import torch
from families import make_hf_model
from harness import Harness

from swaserve.loader.hf_dir import load_model_from_dir

REL_RMS = 0.1  # as tests/gpu/test_gpt_oss_vs_hf.py's BF16_REL_RMS


def _rel_rms(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got - ref).norm() / (ref - ref.mean()).norm()).item()


@torch.no_grad()
def test_bf16_prefill_logits_close_to_hf_fp32(tmp_path):
    hf = make_hf_model("gpt_oss_mxfp4", tmp_path)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(1, hf.config.vocab_size, (n,), generator=g).tolist() for n in (5, 23, 40)]
    ref = [hf(torch.tensor([p])).logits[0, -1].float() for p in prompts]
    hf_bf16 = copy.deepcopy(hf).to(torch.bfloat16)
    for name, buf in hf.named_buffers():  # rotary frequencies stay float32, as from_pretrained keeps them
        owner, _, leaf = name.rpartition(".")
        setattr(hf_bf16.get_submodule(owner), leaf, buf.clone())
    hf_own = [_rel_rms(hf_bf16(torch.tensor([p])).logits[0, -1].float(), r) for p, r in zip(prompts, ref)]
    config, model = load_model_from_dir(tmp_path, device="cpu", dtype=torch.bfloat16)
    assert model.model.layers[0].mlp.experts.quantized
    h = Harness(config, model, hybrid=True, full_tokens=sum(map(len, prompts)) + 8,
                swa_tokens=sum(map(len, prompts)) + 8, dtype=torch.bfloat16)
    rows = [h.add_request() for _ in prompts]
    ours = h.extend(rows, prompts).float()
    for row in rows:
        h.release(row)
    errs = [_rel_rms(o, r) for o, r in zip(ours, ref)]
    assert all(e < REL_RMS for e in errs), (errs, hf_own)
    assert max(errs) < 2 * max(hf_own), (errs, hf_own)
