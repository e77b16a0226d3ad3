"""Random weights in a model's real shapes (`load_format="dummy"`): for benchmarks and load tests of
checkpoints too large to ship, e.g. a Gemma-4-26B-A4B config.json with no safetensors beside it. Each
tensor is drawn whole from its own seed, then a tensor-parallel rank keeps its part (its share of the
widths, or under expert parallelism its experts), so every rank count and layout holds the same model
(TP=N, TP=N with experts split, and TP=1 compare token for token).
"""

from __future__ import annotations

import zlib
from typing import TYPE_CHECKING

import torch
from torch import nn

from swaserve.layers import fp8, mxfp4
from swaserve.layers.linear import MergedLinear
from swaserve.layers.moe import StackedExperts
from swaserve.layers.norm import RMSNorm

if TYPE_CHECKING:
    from swaserve.model_config import ModelConfig

# 1-d parameters that multiply activations (an identity at 1), not biases or deltas (at 0).
_MULTIPLIERS = ("layer_scalar", "router.scale", "per_expert_scale")


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int = 0, std: float = 0.02,
                       whole_shapes: dict[str, tuple[int, ...]] | None = None) -> None:
    """Fill every parameter in place, on its device: matrices ~ N(0, std); norm weights near their
    identity (around 0 for Gemma's `1 + w` form, around 1 otherwise); output scalars 1; other vectors
    (biases, sinks) ~ N(0, 0.05); MXFP4 experts (uint8 `*_blocks` / `*_scales`, as the checkpoint stores
    them) random codes with scales that give weights of RMS ~0.02; block-FP8 weights (e4m3 + float32
    `*_scale_inv`) the N(0, std) draw quantised to 128 x 128 blocks as a checkpoint's would be (scales
    ~amax/448 of each block). Activations then stay O(1) through any depth, and greedy outputs vary
    with the input, so the model behaves like a real one for memory and speed.

    Every tensor (each block of a merged projection, each expert's projection apart) is drawn from a
    generator seeded by `seed` and its name, in the dtype the model's unquantised weights take, so a
    model built with `--quantization fp8` holds exactly this model's bf16 weights quantised (what
    benchmarks comparing the two rely on). `whole_shapes` (tensor parallelism: `whole_parameter_shapes`):
    each parameter's shape at one rank; the whole tensor is drawn, then this rank keeps its part
    (`tp_slice_stored`, else `tp_slice`, of the parameter's module), as it would of a checkpoint's tensor."""
    norm_weights = {id(m.weight): m.unit_offset for m in model.modules() if isinstance(m, RMSNorm) and m.weight is not None}
    dense = _unquantised_dtype(model)
    for name, p in model.named_parameters():
        owner_name, _, pname = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        norm = norm_weights.get(id(p))

        def draw(shape: tuple[int, ...], key: str, name: str = name, p: nn.Parameter = p,
                 norm: bool | None = norm) -> torch.Tensor:
            g = torch.Generator(device=p.device).manual_seed((seed << 32) + zlib.crc32(key.encode()))
            dtype = dense if p.dtype == fp8.FP8 else p.dtype  # FP8: quantised by its owner
            return _draw(torch.empty(shape, dtype=dtype, device=p.device), name, norm, std, g)

        if pname.endswith("_scale_inv"):
            continue  # filled when its weight is quantised
        if isinstance(owner, (MergedLinear, StackedExperts)) or p.dtype == fp8.FP8:
            _draw_parts(owner, pname, name, p, draw, whole_shapes)
            continue
        whole = draw(tuple(whole_shapes[name]) if whole_shapes is not None else tuple(p.shape), name)
        if whole_shapes is not None:
            part = getattr(owner, "tp_slice_stored", None) or getattr(owner, "tp_slice", None)
            whole = part(pname, whole) if part is not None else whole
        if whole.shape != p.shape:
            raise ValueError(f"dummy weights: no rank's part of {name!r} {tuple(whole.shape)} fits its "
                             f"parameter {tuple(p.shape)}")
        p.copy_(whole)


def _unquantised_dtype(model: nn.Module) -> torch.dtype:
    """The dtype the model was built in, which its unquantised weights take: that of most of its
    non-FP8 floating-point parameters (float32 routers and FP8 scales are few)."""
    sizes: dict[torch.dtype, int] = {}
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != fp8.FP8:
            sizes[p.dtype] = sizes.get(p.dtype, 0) + p.numel()
    return max(sizes, key=sizes.__getitem__) if sizes else torch.float32


def _draw_parts(owner: nn.Module, pname: str, name: str, p: nn.Parameter, draw,
                whole_shapes: dict[str, tuple[int, ...]] | None) -> None:
    """A parameter loaded part by part as a checkpoint's tensors are: each HF tensor drawn dense and
    whole, then this rank's part taken; an FP8 weight's loaded as an FP8 checkpoint's (merged projections:
    quantised whole, this rank's rows and scales taken) or as an unquantised tensor is online (this rank's
    part quantised to 128 x 128 blocks). Stacked experts go one expert and projection at a time, whatever
    their dtype, so no dense copy of a whole layer's experts is ever made and bf16 and FP8 models draw
    the same experts."""
    quantize = p.dtype == fp8.FP8
    if isinstance(owner, MergedLinear):  # one tensor per HF projection
        for i, (_, hf_rows) in enumerate(owner.shards):
            dense = draw((hf_rows, *p.shape[1:]), f"{name}#{i}")
            if not quantize or owner.fp8.online:  # unquantised, or --quantization fp8: each rank quantises its rows
                owner.load_shard(i, pname, dense, quantize=quantize)
                continue
            # As a checkpoint stores it (the whole tensor in 128 x 128 blocks), then this rank's rows: the
            # same weights where a rank's rows cut a block (their scales then go per row).
            q, scale = fp8.quantize(dense)
            owner.load_shard(i, pname, q)
            owner.load_shard(i, f"{pname}_scale_inv", scale)
    elif isinstance(owner, StackedExperts):
        hidden, full = owner.down_proj.shape[1], owner.hf_intermediate
        split = owner.expert_split  # global ids: each expert is drawn the same whichever rank holds it
        for e in range(split.start, split.start + split.count):
            if pname == "gate_up_proj":
                for proj in ("gate_proj", "up_proj"):
                    owner.load_expert(e, proj, draw((full, hidden), f"{name}#{e}#{proj}"), quantize=quantize)
            else:
                owner.load_expert(e, "down_proj", draw((hidden, full), f"{name}#{e}"), quantize=quantize)
    else:  # an output projection: the whole HF weight, this rank's input columns quantised
        shape = tuple(whole_shapes[name]) if whole_shapes is not None else tuple(p.shape)
        if not owner.load_param(pname, draw(shape, name), quantize=True):
            raise ValueError(f"dummy weights: no FP8 draw for {name!r}")


def _draw(t: torch.Tensor, name: str, norm: bool | None, std: float, g: torch.Generator) -> torch.Tensor:
    """`t` filled as parameter `name` is (`norm`: None, or the norm weight's `unit_offset`)."""
    if t.dtype == torch.uint8:
        if not name.endswith(("_blocks", "_scales")):
            raise ValueError(f"no random draw for the uint8 parameter {name!r}")
        (mxfp4.random_codes_ if name.endswith("_blocks") else mxfp4.random_scales_)(t, g)
    elif norm is not None:
        t.normal_(0.0, 0.05, generator=g)
        if not norm:
            t.add_(1.0)
    elif name.endswith(_MULTIPLIERS):
        t.fill_(1.0)
    elif t.ndim >= 2:
        t.normal_(0.0, std, generator=g)
    else:
        t.normal_(0.0, 0.05, generator=g)
    return t


def whole_parameter_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Each parameter's shape in the model of `config` at one rank (built on the meta device)."""
    from swaserve.distributed.state import single_rank
    from swaserve.models.registry import get_model_class

    hf = config.hf_config
    cls = get_model_class(config.architecture, getattr(hf, "model_type", None))
    with single_rank(), torch.device("meta"):
        model = cls(hf)
    return {n: tuple(p.shape) for n, p in model.named_parameters()}
