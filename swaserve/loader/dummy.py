"""Random weights in a model's real shapes (`load_format="dummy"`): for benchmarks and load tests of
checkpoints too large to ship, e.g. a Gemma-4-26B-A4B config.json with no safetensors beside it.
"""

from __future__ import annotations

import torch
from torch import nn

from swaserve.layers import mxfp4
from swaserve.layers.norm import RMSNorm

# 1-d parameters that multiply activations (an identity at 1), not biases or deltas (at 0).
_MULTIPLIERS = ("layer_scalar", "router.scale", "per_expert_scale")


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Fill every parameter in place, on its device: matrices ~ N(0, std); norm weights near their
    identity (around 0 for Gemma's `1 + w` form, around 1 otherwise); output scalars 1; other vectors
    (biases, sinks) ~ N(0, 0.05); MXFP4 experts (uint8 `*_blocks` / `*_scales`, as the checkpoint stores
    them) random codes with scales that give weights of RMS ~0.02. Activations then stay O(1) through any
    depth, and greedy outputs vary with the input, so the model behaves like a real one for memory and speed."""
    norm_weights = {id(m.weight): m.unit_offset for m in model.modules() if isinstance(m, RMSNorm) and m.weight is not None}
    gens: dict[torch.device, torch.Generator] = {}
    for name, p in model.named_parameters():
        g = gens.setdefault(p.device, torch.Generator(device=p.device).manual_seed(seed))
        if p.dtype == torch.uint8:
            if not name.endswith(("_blocks", "_scales")):
                raise ValueError(f"no random draw for the uint8 parameter {name!r}")
            (mxfp4.random_codes_ if name.endswith("_blocks") else mxfp4.random_scales_)(p, g)
        elif id(p) in norm_weights:
            p.normal_(0.0, 0.05, generator=g)
            if not norm_weights[id(p)]:
                p.add_(1.0)
        elif name.endswith(_MULTIPLIERS):
            p.fill_(1.0)
        elif p.ndim >= 2:
            p.normal_(0.0, std, generator=g)
        else:
            p.normal_(0.0, 0.05, generator=g)
