"""The PDL row limit (`kernels/pdl.py`, SWASERVE_PDL_MAX_ROWS): a launch takes PDL only inside a step of at
most that many rows, and the runner states a step's rows while it runs it."""

from __future__ import annotations

import pytest
import torch
from families import gemma3
from harness import Harness

pdl = pytest.importorskip("swaserve.kernels.pdl")

from swaserve import step_rows
from swaserve.models.registry import build_model


class _CudaTensor:
    is_cuda = True


def test_pdl_only_within_the_row_limit(monkeypatch):
    monkeypatch.setattr(pdl, "pdl_supported", lambda: True)
    on = {"USE_PDL": True, "launch_pdl": True}
    monkeypatch.setattr(pdl, "_MAX_ROWS", None)  # no limit: every launch
    assert pdl.pdl_kwargs(_CudaTensor()) == on
    with step_rows.within(256):
        assert pdl.pdl_kwargs(_CudaTensor()) == on
    monkeypatch.setattr(pdl, "_MAX_ROWS", 1)
    assert pdl.pdl_kwargs(_CudaTensor()) == {"USE_PDL": False}  # outside a step
    with step_rows.within(1):
        assert pdl.pdl_kwargs(_CudaTensor()) == on
        with step_rows.within(64):
            assert pdl.pdl_kwargs(_CudaTensor()) == {"USE_PDL": False}
        assert pdl.pdl_kwargs(_CudaTensor()) == on  # the outer step's rows come back
    assert step_rows.current() is None
    assert pdl.pdl_kwargs(torch.zeros(1)) == {"USE_PDL": False}  # a CPU tensor never


def test_the_runner_states_each_steps_rows():
    from swaserve.model_config import ModelConfig

    torch.manual_seed(0)
    config = ModelConfig.from_hf(gemma3())
    h = Harness(config, build_model(config, torch.float32, "cpu"), hybrid=True, full_tokens=96, swa_tokens=64)
    seen = []
    init = h.runner.attn_backend.init_forward_metadata

    def spy(batch):
        seen.append(step_rows.current())
        return init(batch)

    h.runner.attn_backend.init_forward_metadata = spy
    h.generate([list(range(5, 12)), list(range(20, 25))], 3)  # one prefill of 7 + 5 tokens, two decodes of 2 rows
    assert seen == [12, 2, 2], seen
    assert step_rows.current() is None
