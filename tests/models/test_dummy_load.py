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


@pytest.mark.parametrize("quantized", [False, True], ids=["dense", "mxfp4"])
def test_gpt_oss_experts_stored_slice_agrees_with_the_checkpoint_slice(quantized):
    """Dummy weights under tensor parallelism cut a rank's part out of the one-rank parameter
    (`tp_slice_stored`); a checkpoint's out of the HF tensor (`tp_slice`). From the same HF tensor both
    give each rank the same part (an uneven MXFP4 split: 64 and 32 of 96)."""
    from swaserve.distributed.state import TPGroup, set_tp_group, single_rank
    from swaserve.layers.gpt_oss_experts import GptOssExperts

    def experts() -> GptOssExperts:
        return GptOssExperts(3, 64, 96, 1.702, 7.0, quantized)

    with single_rank():
        one = experts()
    ranks = []
    for r in range(2):
        set_tp_group(TPGroup(r, 2))
        try:
            ranks.append(experts())
        finally:
            set_tp_group(TPGroup())
    g = torch.Generator().manual_seed(0)
    for name, p in one.named_parameters():
        if name in ("gate_up_proj", "down_proj"):  # HF stores dense experts input-major
            hf = torch.randn(p.shape[0], p.shape[2], p.shape[1], generator=g)
        else:
            hf = torch.randint(0, 256, p.shape, generator=g).to(p.dtype)
        whole = one.tp_slice(name, hf)
        assert whole.shape == p.shape
        for rank in ranks:
            want = rank.tp_slice(name, hf)
            assert want.shape == getattr(rank, name).shape
            assert torch.equal(rank.tp_slice_stored(name, whole), want), name
