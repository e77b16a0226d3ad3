"""Parity of the embedded Gemma 3 270M (real weights, fp32, CPU) with HF transformers loading the
same GGUF: greedy continuations of 8 prompts (lengths around and past the 512-token window) are
identical for 32 tokens, and the first step's log-probabilities agree."""

from __future__ import annotations

import pytest
import torch

from swaserve import SamplingParams

from engine_prompts import prompt_of

NEW_TOKENS = 32
LOGPROB_TOL = 2e-3  # max |logprob diff| over the top-20 tokens of the first step, fp32


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from swaserve.loader.default_model import default_model_path

    hf_logging.set_verbosity_error()
    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, torch_dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


def test_greedy_and_logprobs_match_hf(llm, long_ids, hf_model):
    window = llm.engine.model_config.sliding_window
    assert window == 512
    lengths = [(7, 0), (100, 3), (window - 1, 0), (window, 1), (window + 1, 2), (640, 5), (700, 9), (900, 13)]
    prompts = [prompt_of(long_ids, n, s) for n, s in lengths]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=20)
    ours = llm.generate(prompts, params, use_tqdm=False)  # all eight in one batch
    for p, out in zip(prompts, ours):
        ids = torch.tensor([p])
        with torch.inference_mode():
            ref = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                    min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
                                    output_logits=True, return_dict_in_generate=True)
        logits = ref.logits[0][0].float()  # the first step's logits: last prompt position
        ref_tokens = ref.sequences[0, len(p):].tolist()
        got = out.outputs[0].token_ids
        assert got == ref_tokens, f"prompt of {len(p)} tokens diverges at step {_first_diff(got, ref_tokens)}"
        ref_lp = torch.log_softmax(logits, -1)
        first = out.outputs[0].logprobs[0]
        diff = max(abs(v - ref_lp[t].item()) for t, v in first.items())
        assert diff < LOGPROB_TOL, f"prompt of {len(p)} tokens: logprob diff {diff}"


def _first_diff(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
