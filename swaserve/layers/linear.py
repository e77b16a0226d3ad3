"""Merged projections: one GEMM for several HF weights that read the same input (q/k/v, gate/up);
and output projections whose result the next kernel can take as split-K partial sums. Either may hold
block-FP8 weights (`layers.fp8_linear`: e4m3 `weight` + float32 `weight_scale_inv`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from swaserve.distributed.state import all_reduce, tp_group
from swaserve.layers.fp8_linear import Fp8Spec, fp8_linear, load_merged_shard, load_out_param


class MergedLinear(nn.Module):
    """`y = x @ W.T (+ b)` where W stacks the row blocks of several HF projections.

    Invariant: shard i occupies output rows `offsets[i] : offsets[i] + out_sizes[i]` of `weight` and
    `bias`; `load_shard` is the only way an HF tensor gets into a block. Column-parallel (tensor
    parallelism): `shards[i] = (start, hf_rows)`: HF tensor i has `hf_rows` rows, of which this rank
    holds `out_sizes[i]` from `start`.
    """

    batch_invariant = False  # deterministic mode: rows do not depend on the batch (`layers.batch_invariant`)
    fp8: Fp8Spec | None = None  # block-FP8 weight (`fp8_linear.convert_merged`): e4m3 weight + weight_scale_inv

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool,
                 shards: list[tuple[int, int]] | None = None):
        super().__init__()
        self.in_features = in_features
        self.out_sizes = list(out_sizes)
        self.shards = list(shards) if shards is not None else [(0, n) for n in out_sizes]
        self.offsets = [sum(out_sizes[:i]) for i in range(len(out_sizes))]
        total = sum(out_sizes)
        self.weight = nn.Parameter(torch.empty(total, in_features))  # [sum(out_sizes), in]
        self.bias = nn.Parameter(torch.empty(total)) if bias else None  # [sum(out_sizes)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp8 is not None:
            return fp8_linear(x, self.weight, self.weight_scale_inv, self.bias, self.fp8.scale_rows, self.batch_invariant)
        if self.batch_invariant:
            from swaserve.layers.batch_invariant import invariant_linear

            return invariant_linear(x, self.weight, self.bias)
        return _linear(x, self.weight, self.bias)

    def load_shard(self, shard: int, param_name: str, tensor: torch.Tensor, quantize: bool | None = None
                   ) -> tuple[str, ...]:
        """Copy HF tensor `tensor` into block `shard` of `weight`, `bias` or (FP8) `weight_scale_inv`
        (`param_name`); returns the parameters it filled (an FP8 weight quantised here fills its scales
        too: online, or `quantize`)."""
        if self.fp8 is not None and param_name in ("weight", "weight_scale_inv"):
            return load_merged_shard(self, shard, param_name, tensor, quantize)
        param = getattr(self, param_name)
        block = param.data.narrow(0, self.offsets[shard], self.out_sizes[shard])
        start, hf_rows = self.shards[shard]
        if hf_rows != block.shape[0] and tensor.shape[0] == hf_rows:
            tensor = tensor.narrow(0, start, block.shape[0])  # this rank's rows
        if tuple(tensor.shape) != tuple(block.shape):
            raise ValueError(f"shard {shard} of {param_name}: expected shape {tuple(block.shape)}, "
                             f"got {tuple(tensor.shape)}")
        block.copy_(tensor)
        return (param_name,)

    def extra_repr(self) -> str:
        fp8 = "" if self.fp8 is None else f", fp8 (scale rows {self.fp8.scale_rows})"
        return f"in={self.in_features}, out={self.out_sizes}, bias={self.bias is not None}{fp8}"


class OutLinear(nn.Linear):
    """An output projection (o_proj, down_proj) feeding a residual add.

    Row-parallel under tensor parallelism: built with this rank's `in_features` (its heads or its
    slice of the intermediate size; `shard = (start, hf_in_features)` places it in the HF input); the partial
    products are summed over the ranks, then the (replicated) bias is added once.

    `forward(x, partial_sums=True)` may return float32 split-K partial sums `[S, M, N]` instead of
    `[M, N]`: without bias, where `skinny_gemm.use_skinny(x)` (opt-in, CUDA, decode-sized batches):
    the weight stream needs more programs than N's tiles give. `add_norm` and `kernels.ffn_tail` sum
    them; nothing else should ask for them. The split count depends on the weight shape and the GPU only.
    """

    _splits: int | None = None
    batch_invariant = False  # deterministic mode: always `[M, N]` from `invariant_linear`
    fp8: Fp8Spec | None = None  # block-FP8 weight (`fp8_linear.convert_out`): never split-K partial sums

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 shard: tuple[int, int] | None = None):
        """`shard = (start, hf_in_features)`: row-parallel, this rank's inputs start at `start`."""
        super().__init__(in_features, out_features, bias=bias)
        self.shard = shard if shard is not None else (0, in_features)
        self.reduce = tp_group().enabled

    def tp_slice(self, param_name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's input columns of an HF weight (the bias is whole on every rank)."""
        start, hf_in = self.shard
        if param_name == "weight" and hf_in != self.in_features and tensor.shape[-1] == hf_in:
            return tensor.narrow(1, start, self.in_features)
        return tensor

    def load_param(self, param_name: str, tensor: torch.Tensor, quantize: bool | None = None) -> tuple[str, ...]:
        """FP8: `weight_scale_inv` (this rank's input blocks) or an unquantised weight quantised here;
        () where the default slice-and-copy loads it."""
        return load_out_param(self, param_name, tensor, quantize) if self.fp8 is not None else ()

    def forward(self, x: torch.Tensor, partial_sums: bool = False) -> torch.Tensor:
        if self.reduce:
            y = self._local(x, None)
            all_reduce(y)
            return y + self.bias if self.bias is not None else y
        return self._local(x, self.bias, partial_sums)

    def _local(self, x: torch.Tensor, bias: torch.Tensor | None, partial_sums: bool = False) -> torch.Tensor:
        if self.fp8 is not None:
            return fp8_linear(x, self.weight, self.weight_scale_inv, bias, self.fp8.scale_rows, self.batch_invariant)
        if self.batch_invariant:
            from swaserve.layers.batch_invariant import invariant_linear

            return invariant_linear(x, self.weight, bias)
        if partial_sums and x.is_cuda and bias is None:
            from swaserve.kernels.common import num_sms
            from swaserve.kernels.skinny_gemm import skinny_gemm, skinny_gemm_splits, use_skinny

            if use_skinny(x):
                if self._splits is None:
                    self._splits = skinny_gemm_splits(self.out_features, self.in_features, num_sms(x.device))
                return skinny_gemm(x if x.stride(1) == 1 else x.contiguous(), self.weight, self._splits)
        return _linear(x, self.weight, bias)


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear`, or for one row on a GPU the weight-streaming GEMV where enabled (`gemv.use_gemv`)."""
    if x.is_cuda and x.dim() == 2 and x.shape[0] == 1:  # (many-token steps skip the import)
        from swaserve.kernels.gemv import gemv, use_gemv

        if use_gemv(x, weight):
            return gemv(x.contiguous(), weight, bias)
    return F.linear(x, weight, bias)
