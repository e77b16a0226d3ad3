"""Every family vs HF transformers (fp32, eager attention) on tiny random-weight checkpoints loaded
through swaserve's HF-directory loader: prefill and per-step logits (max abs diff < 1e-4) and 32
greedy tokens identical to HF `generate` on each prompt alone, for a batch of prompts of different
lengths that cross the window; hybrid (small SWA pool, eviction) and single-pool memory, one-shot
and chunked prefill; integrity checked after every release and both pools empty at the end.
"""

from __future__ import annotations

import pytest
import torch
from families import FAMILIES, hf_greedy, make_hf_model
from harness import Harness

from swaserve.loader.hf_dir import load_model_from_dir

STEPS = 32
LOGIT_ATOL = 1e-4
PROMPT_LENS = (23, 9, 40, 17)  # windows are 8-12: three prompts cross them, one barely does
MAX_DIFF: dict[str, float] = {}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """(name, our model config + model, prompts, HF reference per prompt) — built once per family."""
    name = request.param
    path = tmp_path_factory.mktemp(name)
    hf_model = make_hf_model(name, path)
    g = torch.Generator().manual_seed(1)
    vocab = hf_model.config.vocab_size
    prompts = [torch.randint(1, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]
    ref = [hf_greedy(hf_model, p, STEPS) for p in prompts]
    config, model = load_model_from_dir(path, device="cpu", dtype=torch.float32)
    return name, config, model, prompts, ref


@pytest.mark.parametrize(
    "hybrid,chunk", [(True, None), (False, None), (True, 5)], ids=["hybrid", "single_pool", "hybrid_chunked"]
)
def test_greedy_matches_hf(family, hybrid, chunk):
    name, config, model, prompts, ref = family
    total = sum(len(p) + STEPS for p in prompts)
    # The SWA pool holds the prompts but not their decode tokens: decoding fits only if
    # out-of-window slots are freed and reused.
    swa_tokens = sum(len(p) for p in prompts) + len(prompts)
    h = Harness(config, model, hybrid=hybrid, full_tokens=total + 8, swa_tokens=swa_tokens)
    logits, tokens = h.generate(prompts, STEPS, chunk=chunk)
    h.assert_empty()

    worst = 0.0
    for i, (lg, toks) in enumerate(zip(logits, tokens)):
        ref_logits, ref_tokens = ref[i]
        assert torch.isfinite(lg).all()
        diff = (lg - ref_logits).abs().max().item()
        worst = max(worst, diff)
        assert toks == ref_tokens, f"{name} prompt {i} (len {len(prompts[i])}): tokens differ from HF"
        assert diff < LOGIT_ATOL, f"{name} prompt {i}: max |logit diff| {diff:.2e}"
    MAX_DIFF[f"{name}/{'hybrid' if h.hybrid else 'single'}{'/chunked' if chunk else ''}"] = worst
    # The reference must not be degenerate: greedy output varies.
    assert len({t for toks in tokens for t in toks}) > 4


def test_report_max_diffs():
    """Prints the per-family worst logit difference (pytest -s); runs last in this module."""
    for key, diff in sorted(MAX_DIFF.items()):
        print(f"{key:32s} max |logit - HF| = {diff:.2e}")
