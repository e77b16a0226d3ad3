"""RMSNorm in the forms the supported families use: Llama's `w * x̂`, Gemma's `(1 + w) * x̂`, the
float32-weight form (GPT-OSS, Gemma 4) and no weight at all (Gemma 4's value and router norms)."""

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

    def __init__(self, dim: int, eps: float = 1e-6, *, unit_offset: bool = False, fp32_weight: bool = False,
                 scale: bool = True):
        super().__init__()
        self.dim = dim
        self.eps = eps
        self.unit_offset = unit_offset
        # No weight (Gemma 4's v_norm and router norm): x̂ cast back, the fp32-weight form with w = 1.
        self.fp32_weight = fp32_weight or not scale
        self.weight = nn.Parameter(torch.empty(dim)) if scale else None  # [dim]
        self._ones: dict[torch.device, torch.Tensor] = {}  # the unscaled form's kernel weight, per device

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """norm(x), or `residual + norm(x)` in x's dtype (one fused kernel on CUDA)."""
        if x.is_cuda:
            from swaserve.kernels.norm import rms_norm

            return rms_norm(x, self.kernel_weight(x.device), self.eps, unit_offset=self.unit_offset,
                            weight_fp32=self.fp32_weight, residual=residual)
        y = self._reference(x)
        return y if residual is None else residual + y

    def kernel_weight(self, device: torch.device) -> torch.Tensor:
        """The weight a fused kernel multiplies by: ones (float32, cached per device) for the
        unscaled form, which `(1.0 * x̂).to(dtype)` leaves exact."""
        if self.weight is not None:
            return self.weight
        if device not in self._ones:
            self._ones[device] = torch.ones(self.dim, dtype=torch.float32, device=device)
        return self._ones[device]

    def _reference(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight is None:
            return xf.to(x.dtype)
        if self.unit_offset:
            return (xf * (1.0 + self.weight.float())).to(x.dtype)
        if self.fp32_weight:
            return (self.weight.float() * xf).to(x.dtype)
        return self.weight * xf.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}, unit_offset={self.unit_offset}, scale={self.weight is not None}"


def add_norm(
    x: torch.Tensor, residual: torch.Tensor, post: RMSNorm | None, nxt: RMSNorm
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add between two blocks and the next block's input norm: `h = residual + post(x)`
    (`residual + x` without a post norm, Gemma's sandwich norm with one), returns `(h, nxt(h))`.
    One fused launch on CUDA, rounded as the separate calls are; `post` and `nxt` share their form.
    On CUDA `x` may be float32 split-K partial sums `[S, T, dim]` (`OutLinear`), summed in the launch."""
    if x.is_cuda:
        from swaserve.kernels.norm import add_rms_norm

        pw = post.kernel_weight(x.device) if post is not None else None
        return add_rms_norm(x, residual, pw, nxt.kernel_weight(x.device), nxt.eps,
                            unit_offset=nxt.unit_offset, weight_fp32=nxt.fp32_weight)
    h = post(x, residual=residual) if post is not None else residual + x
    return h, nxt(h)
