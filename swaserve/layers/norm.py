"""RMSNorm in the two forms the supported families use: Llama's `w * x̂` and Gemma's `(1 + w) * x̂`."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dim; statistics always in float32.

    `unit_offset=True` is Gemma's form: the stored weight is a delta from 1 and the product is taken
    in float32 before casting back. Otherwise the weight multiplies the normalised input after it is
    cast back to the input dtype (Llama), or in float32 with `fp32_weight=True` (GPT-OSS keeps its
    norms in float32). The forms only differ in rounding below float32.
    """

    def __init__(self, dim: int, eps: float = 1e-6, *, unit_offset: bool = False, fp32_weight: bool = False):
        super().__init__()
        self.eps = eps
        self.unit_offset = unit_offset
        self.fp32_weight = fp32_weight
        self.weight = nn.Parameter(torch.empty(dim))  # [dim]

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """norm(x), or `residual + norm(x)` in x's dtype (one fused kernel on CUDA)."""
        if x.is_cuda:
            from swaserve.kernels.norm import rms_norm

            return rms_norm(x, self.weight, self.eps, unit_offset=self.unit_offset, weight_fp32=self.fp32_weight,
                            residual=residual)
        y = self._reference(x)
        return y if residual is None else residual + y

    def _reference(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (xf * (1.0 + self.weight.float())).to(x.dtype)
        if self.fp32_weight:
            return (self.weight.float() * xf).to(x.dtype)
        return self.weight * xf.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, unit_offset={self.unit_offset}"


def add_norm(
    x: torch.Tensor, residual: torch.Tensor, post: RMSNorm | None, nxt: RMSNorm
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add between two blocks and the next block's input norm: `h = residual + post(x)`
    (`residual + x` without a post norm, Gemma's sandwich norm with one), returns `(h, nxt(h))`.
    One fused launch on CUDA, rounded as the separate calls are; `post` and `nxt` share their form.
    On CUDA `x` may be float32 split-K partial sums `[S, T, dim]` (`OutLinear`), summed in the launch."""
    if x.is_cuda:
        from swaserve.kernels.norm import add_rms_norm

        return add_rms_norm(x, residual, post.weight if post is not None else None, nxt.weight, nxt.eps,
                            unit_offset=nxt.unit_offset, weight_fp32=nxt.fp32_weight)
    h = post(x, residual=residual) if post is not None else residual + x
    return h, nxt(h)
