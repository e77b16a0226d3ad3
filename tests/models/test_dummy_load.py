"""`load_format="dummy"`: an HF directory with only config.json loads with random weights in the
model's shapes (norm weights near their identity), runs, and bad formats are a clear error."""

from __future__ import annotations

import pytest
import torch
from families import gemma3, gemma4
from harness import Harness

from swaserve.loader import load_model
from swaserve.layers.norm import RMSNorm


@pytest.mark.parametrize("make_config", [gemma3, gemma4], ids=["gemma3", "gemma4"])
def test_config_only_directory_loads_random_weights(tmp_path, make_config):
    cfg = make_config()
    cfg.architectures = [type(cfg).__name__.replace("TextConfig", "ForCausalLM")]
    cfg.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path), torch.device("cpu"), torch.float32, load_format="dummy")
    assert loaded.tokenizer is None  # none in the directory: prompts are token ids
    for m in loaded.model.modules():
        if isinstance(m, RMSNorm) and m.weight is not None:
            centre = 0.0 if m.unit_offset else 1.0
            assert (m.weight - centre).abs().max() < 0.5
    assert all(torch.isfinite(p).all() for p in loaded.model.parameters())
    h = Harness(loaded.config, loaded.model, hybrid=True, full_tokens=96, swa_tokens=64)
    _, tokens = h.generate([list(range(5, 25)), list(range(30, 41))], 6)
    assert all(len(t) == 6 for t in tokens)
    h.assert_empty()


def test_unknown_load_format_is_a_clear_error(tmp_path):
    gemma3().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="load_format must be one of auto, dummy"):
        load_model(str(tmp_path), torch.device("cpu"), torch.float32, load_format="npz")
