"""benchmarks/probes.py: the logits a probe run keeps at each position are the ones the engine took its greedy
tokens from (the last prompt position's gave the first token, generated position j's token j + 1), with
chunked prefill and with overlap scheduling; `compare` counts generated positions only while the tokens agree."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from common import random_model  # noqa: E402
from probes import ProbeRun, compare, random_prompts, release, run_probes  # noqa: E402

from swaserve.engine import Engine  # noqa: E402

CPU = torch.device("cpu")


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_kept_logits_are_those_the_greedy_tokens_came_from(overlap):
    loaded = random_model("gemma4-tiny", CPU, torch.float32)
    prompts = random_prompts(4, (8, 60), 30000)
    engine = Engine(loaded, device=CPU, dtype=torch.float32, max_running_requests=4, max_context=128,
                    max_prefill_tokens=24, disable_prefix_cache=True, overlap_schedule=overlap)  # prompts in chunks
    run = run_probes(engine, prompts, 6, (4, 9))  # generated positions: capped at 5 (the last token is never read)
    release(engine, CPU)
    assert run.logits is not None and run.logits.shape == (4, 4 + 5, loaded.config.vocab_size)
    top, tokens = run.logits.argmax(-1), torch.tensor(run.tokens)
    assert torch.equal(top[:, 3], tokens[:, 0])
    assert torch.equal(top[:, 4:], tokens[:, 1:])

    same = compare(run, run)
    assert same["identical"] == 4 and same["first_token_agreement"] == 1
    assert same["prompt_logit_err_max"] == 0 and same["generated_positions"] == 4 * 5
    other = [list(t) for t in run.tokens]
    other[0][2] += 1  # probe 0 differs from its third token: its generated positions 2.. read other tokens
    diff = compare(run, ProbeRun(other, run.logits, run.before))
    assert diff["identical"] == 3 and diff["median_first_difference"] == 6
    assert diff["generated_positions"] == 4 * 5 - 3
