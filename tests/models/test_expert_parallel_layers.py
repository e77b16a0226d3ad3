"""Expert parallelism layer by layer, every rank simulated in this process (no collectives: each rank's
`partial` output, summed in rank order, is what the MoE's all-reduce computes): stacked experts loaded
stacked (Gemma 4) and one by one (MiMo-V2), block-FP8 experts, GPT-OSS's biased experts dense and MXFP4;
7 experts over 2 and 3 ranks (uneven). Each rank holds only its experts' weights (and FP8 scales, MXFP4
blocks and scales, biases), dummy weights are the same whole draws whatever the layout, and the options
that cannot work are refused with the reason."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from torch import nn

from swaserve.distributed.state import TPGroup, set_tp_group, split_experts, tp_group
from swaserve.layers import fp8, mxfp4
from swaserve.layers.fp8_linear import convert_experts
from swaserve.layers.gpt_oss_experts import GptOssExperts
from swaserve.layers.moe import StackedExperts
from swaserve.loader.dummy import init_dummy_weights

E, H, I, K, N = 7, 32, 24, 3, 10


@contextmanager
def as_rank(rank: int, size: int, expert_parallel: bool = True) -> Iterator[None]:
    """Layers built inside are rank `rank`'s of `size` (no process group: only `partial` is run)."""
    before = tp_group()
    set_tp_group(TPGroup(rank, size, expert_parallel=expert_parallel))
    try:
        yield
    finally:
        set_tp_group(before)


def routing(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(N)])
    weights = torch.softmax(torch.randn(N, K, generator=g), -1)
    valid = torch.arange(N) != 6  # a padded graph row: routes nothing on any rank
    return x, weights, ids, valid


def ranks_sum(build, size: int, x, weights, ids, valid) -> tuple[torch.Tensor, list[nn.Module]]:
    """Each rank's layer (`build()` under `as_rank`) and the sum of their partial outputs in rank order."""
    layers = []
    for r in range(size):
        with as_rank(r, size):
            layers.append(build())
    out = layers[0].partial(x, weights, ids, valid)
    for m in layers[1:]:
        out = out + m.partial(x, weights, ids, valid)
    return out, layers


def stacked_tensors(seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"gate_up_proj": 0.2 * torch.randn(E, 2 * I, H, generator=g),
            "down_proj": 0.2 * torch.randn(E, H, I, generator=g)}


def load_stacked(m: StackedExperts, tensors: dict[str, torch.Tensor]) -> StackedExperts:
    for name, t in tensors.items():
        if not m.load_param(name, t, quantize=m.fp8 is not None):
            getattr(m, name).data.copy_(m.tp_slice(name, t))
    return m


def load_per_expert(m: StackedExperts, tensors: dict[str, torch.Tensor]) -> StackedExperts:
    """As MiMo-V2's checkpoints store experts: one tensor per expert and projection; a rank loads its own."""
    gate, up = tensors["gate_up_proj"].chunk(2, dim=1)
    for e in range(E):
        if m.expert_split.holds(e):
            for proj, t in (("gate_proj", gate[e]), ("up_proj", up[e]), ("down_proj", tensors["down_proj"][e])):
                m.load_expert(e, proj, t, quantize=m.fp8 is not None)
    return m


def fp8_experts() -> StackedExperts:
    m = StackedExperts(E, H, I, "silu")
    convert_experts(m, online=True, name="experts")
    return m


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("form", ["stacked", "per_expert", "fp8_stacked", "fp8_per_expert"])
def test_stacked_experts_ranks_sum_to_one_rank(form, size):
    x, weights, ids, valid = routing()
    tensors = stacked_tensors()
    make = fp8_experts if form.startswith("fp8") else lambda: StackedExperts(E, H, I, "silu")
    load = load_per_expert if form.endswith("per_expert") else load_stacked
    whole = load(make(), tensors).partial(x, weights, ids, valid)
    out, layers = ranks_sum(lambda: load(make(), tensors), size, x, weights, ids, valid)
    torch.testing.assert_close(out, whole, rtol=1e-5, atol=1e-6)
    assert (out[~valid] == 0).all()
    held = [split_experts(E, r, size, True) for r in range(size)]
    assert [s.count for s in held] == ([4, 3] if size == 2 else [3, 2, 2])
    for m, s in zip(layers, held):  # only its experts, each whole: the width is not split
        assert m.gate_up_proj.shape[:2] == (s.count, 2 * I) and m.down_proj.shape[:2] == (s.count, H)
        if m.fp8 is not None:
            assert m.gate_up_proj_scale_inv.shape[0] == m.down_proj_scale_inv.shape[0] == s.count
            # Each expert's blocks are its own: the rank holds exactly the one-rank layer's values.
            one = load(make(), tensors)
            run = slice(s.start, s.start + s.count)
            assert torch.equal(m.gate_up_proj.view(torch.uint8), one.gate_up_proj[run].view(torch.uint8))
            assert torch.equal(m.down_proj_scale_inv, one.down_proj_scale_inv[run])


def test_another_ranks_expert_is_refused_by_load_expert():
    with as_rank(1, 2):
        m = StackedExperts(E, H, I, "silu")  # holds experts 4..6
    with pytest.raises(ValueError, match="expert 2 is held by another rank"):
        m.load_expert(2, "gate_proj", torch.zeros(I, H))


def gpt_oss_tensors(quantized: bool, seed: int = 2) -> dict[str, torch.Tensor]:
    """HF's layouts: dense gate/up interleaved input-major `[E, H, 2I]`, down `[E, I, H]`; MXFP4 blocks
    and scales; nonzero biases (each must be added once over the ranks)."""
    g = torch.Generator().manual_seed(seed)
    t = {"gate_up_proj_bias": torch.randn(E, 2 * I2, generator=g), "down_proj_bias": torch.randn(E, H, generator=g)}
    if quantized:
        t["gate_up_proj_blocks"] = torch.randint(0, 256, (E, 2 * I2, H // 32, 16), generator=g, dtype=torch.uint8)
        t["gate_up_proj_scales"] = torch.randint(121, 124, (E, 2 * I2, H // 32), generator=g, dtype=torch.uint8)
        t["down_proj_blocks"] = torch.randint(0, 256, (E, H, I2 // 32, 16), generator=g, dtype=torch.uint8)
        t["down_proj_scales"] = torch.randint(121, 124, (E, H, I2 // 32), generator=g, dtype=torch.uint8)
    else:
        t["gate_up_proj"] = 0.2 * torch.randn(E, H, 2 * I2, generator=g)
        t["down_proj"] = 0.2 * torch.randn(E, I2, H, generator=g)
    return t


I2 = 64  # GPT-OSS: an intermediate size of whole MXFP4 groups


def gpt_oss(quantized: bool, tensors: dict[str, torch.Tensor]) -> GptOssExperts:
    m = GptOssExperts(E, H, I2, 1.702, 1.5, quantized)
    for name, t in tensors.items():
        getattr(m, name).data.copy_(m.tp_slice(name, t))
    return m


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("quantized", [False, True], ids=["dense", "mxfp4"])
def test_gpt_oss_experts_ranks_sum_to_one_rank(quantized, size):
    x, weights, ids, valid = routing(3)
    tensors = gpt_oss_tensors(quantized)
    whole = gpt_oss(quantized, tensors).partial(x, weights, ids, valid)
    out, layers = ranks_sum(lambda: gpt_oss(quantized, tensors), size, x, weights, ids, valid)
    torch.testing.assert_close(out, whole, rtol=1e-5, atol=1e-5)
    for r, m in enumerate(layers):
        s = split_experts(E, r, size, True)
        for name, p in m.named_parameters():
            assert p.shape[0] == s.count, name
        # Every rank keeps its experts' down biases (tensor parallelism zeroes them on ranks > 0).
        assert torch.equal(m.down_proj_bias, tensors["down_proj_bias"][s.start : s.start + s.count])
        w = m.gate_up_proj_blocks if quantized else m.gate_up_proj
        assert w.shape[1] == 2 * I2, "expert parallelism keeps every expert's whole width"


class Holder(nn.Module):
    def __init__(self, experts: nn.Module):
        super().__init__()
        self.experts = experts


@pytest.mark.parametrize("kind", ["stacked", "fp8", "mxfp4"])
def test_dummy_weights_are_the_same_whole_draws_under_expert_parallelism(kind):
    """`load_format=dummy`: each rank's experts equal the one-rank model's same experts, so EP=N and
    TP=1 runs of random weights compare token for token."""
    def build() -> Holder:
        if kind == "mxfp4":
            return Holder(GptOssExperts(E, H, I2, 1.702, 7.0, True))
        return Holder(fp8_experts() if kind == "fp8" else StackedExperts(E, H, I, "gelu_pytorch_tanh"))

    one = build()
    init_dummy_weights(one, seed=3)
    shapes = {n: tuple(p.shape) for n, p in one.named_parameters()}
    for r in range(3):
        with as_rank(r, 3):
            part = build()
        init_dummy_weights(part, seed=3, whole_shapes=shapes)
        s = part.experts.expert_split
        assert s.parallel
        for name, p in part.named_parameters():
            want = one.get_parameter(name)[s.start : s.start + s.count]
            assert p.shape == want.shape, name
            same = torch.equal(p.view(torch.uint8), want.view(torch.uint8)) if p.dtype == fp8.FP8 else torch.equal(p, want)
            assert same, f"rank {r}: {name} differs from the one-rank draw"
    if kind == "mxfp4":
        assert mxfp4.dequantize(one.experts.down_proj_blocks, one.experts.down_proj_scales, torch.float32).std() > 0


def test_options_that_cannot_work_are_refused(tmp_path):
    import argparse

    from families import FAMILIES, fp8_config

    from swaserve.config import split_engine_options
    from swaserve.distributed.lead import check_model_splits
    from swaserve.options import add_engine_flags, engine_options

    with pytest.raises(ValueError, match="needs tensor_parallel_size > 1"):
        split_engine_options({"enable_expert_parallel": True})
    with pytest.raises(ValueError, match="needs at least 4 experts per MoE layer; this model has 3"):
        split_experts(3, 0, 4, True)
    for family in ("gemma3", "gemma4_moe"):  # config.json is all the split check reads
        FAMILIES[family][0]().save_pretrained(tmp_path / family)
    with pytest.raises(ValueError, match="Gemma3ForCausalLM has no routed experts"):
        check_model_splits(str(tmp_path / "gemma3"), 2, expert_parallel=True)
    check_model_splits(str(tmp_path / "gemma4_moe"), 2, expert_parallel=True)
    # An FP8 cut inside a 128-input block on rank 1 (o_proj's 64 inputs, the dense MLP's 96) is found
    # before any rank starts, not by rank 1 as it builds.
    config = FAMILIES["mimo_v2_flash"][0]()
    config.quantization_config = fp8_config([])
    config.save_pretrained(tmp_path / "fp8")
    with pytest.raises(ValueError, match="rank's inputs start at 32, inside a 128-input FP8 scale block"):
        check_model_splits(str(tmp_path / "fp8"), 2, expert_parallel=True)
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    opts = engine_options(parser.parse_args(["--tp", "2", "--enable-expert-parallel"]))
    assert opts == {"tensor_parallel_size": 2, "enable_expert_parallel": True}
