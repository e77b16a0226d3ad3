"""GPT-OSS's routed experts on the fused MoE path (`fused_moe.moe_experts`): biased expert MLPs with the
clamped SwiGLU, held as the checkpoint stores them (dense bf16/fp32, or MXFP4 codes and scales that are
never dequantised into a resident copy), in the kernels' layout: output-major, gate rows before up rows."""

from __future__ import annotations

import torch
from torch import nn

from swaserve.distributed.state import all_reduce, split_experts, tp_group
from swaserve.layers import mxfp4


def expert_shard(total: int, group: int, rank: int, size: int) -> tuple[int, int]:
    """`(start, local)`: rank's run of an intermediate size of `total`, split on `group` boundaries as
    evenly as they allow (MXFP4 packs the down projection's inputs 32 to a scale, so a rank's share of
    gpt-oss-20b's 2880 at TP 4 is 736, 736, 704 or 704 rather than 720)."""
    if total % group:
        raise ValueError(f"expert intermediate size {total} is not a multiple of {group}")
    groups = total // group
    if groups < size:
        raise ValueError(f"tensor_parallel_size {size} exceeds the {groups} groups of {group} inputs of the "
                         f"expert intermediate size ({total}); every rank needs at least one")
    base, extra = divmod(groups, size)
    return group * (rank * base + min(rank, extra)), group * (base + (rank < extra))


class GptOssExperts(nn.Module):
    """E expert MLPs: `gate_up = x W1^T + b1`, `h = (clamp(up, ±limit) + 1) * g * sigmoid(alpha g)` with
    `g = min(gate, limit)`, `y = h W2^T + b2`. Parameters (this rank's share of I):
    dense: `gate_up_proj` [E, 2I, H], `down_proj` [E, H, I]; MXFP4: `{gate_up,down}_proj_blocks` uint8
    [E, 2I, H/32, 16] / [E, H, I/32, 16] and `_scales` uint8 [E, 2I, H/32] / [E, H, I/32]; always
    `gate_up_proj_bias` [E, 2I] and `down_proj_bias` [E, H]. Gate rows come first: HF interleaves
    gate/up pairs (gate even, up odd) and stores dense weights input-major; `tp_slice` converts.
    Tensor parallelism gives each rank a run of whole pairs (on 32-input groups for MXFP4); the down
    bias is added on rank 0 only, before the sum over ranks. Expert parallelism (`expert_split`) gives
    each rank a run of whole experts (E above is then its count) with their own down biases: every
    (token, slot) pair runs on exactly one rank, so each bias is added once."""

    batch_invariant = False  # deterministic mode (`layers.batch_invariant`)

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, alpha: float, limit: float,
                 quantized: bool):
        super().__init__()
        self.alpha, self.limit, self.quantized = float(alpha), float(limit), quantized
        self.tp = tp_group()
        group = mxfp4.GROUP if quantized else 1
        if quantized and hidden_size % mxfp4.GROUP:
            raise ValueError(f"MXFP4 experts need a hidden size that is a multiple of 32, got {hidden_size}")
        self.expert_split = split_experts(num_experts)
        rank, size = (self.tp.rank, self.tp.size) if self.tp.enabled and not self.expert_split.parallel else (0, 1)
        self.start, self.local = expert_shard(intermediate_size, group, rank, size)
        local = self.local
        E, H, G = self.expert_split.count, hidden_size, mxfp4.GROUP
        if quantized:
            u8 = {"dtype": torch.uint8}
            self.gate_up_proj_blocks = _frozen(torch.empty(E, 2 * local, H // G, G // 2, **u8))
            self.gate_up_proj_scales = _frozen(torch.empty(E, 2 * local, H // G, **u8))
            self.down_proj_blocks = _frozen(torch.empty(E, H, local // G, G // 2, **u8))
            self.down_proj_scales = _frozen(torch.empty(E, H, local // G, **u8))
        else:
            self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * local, H))
            self.down_proj = nn.Parameter(torch.empty(E, H, local))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(E, 2 * local))
        self.down_proj_bias = nn.Parameter(torch.empty(E, H))

    def tp_slice(self, param_name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The HF tensor `param_name` as this rank's parameter: its run of gate/up pairs, de-interleaved
        into gate rows then up rows; dense weights transposed to output-major; MXFP4 bytes untouched."""
        tensor, local = self._held_experts(tensor), self.local
        if param_name == "gate_up_proj":  # HF [E, H, 2I] -> [E, 2I, H]
            return _gate_first(tensor.transpose(1, 2), self.start, local)
        if param_name in ("gate_up_proj_bias", "gate_up_proj_blocks", "gate_up_proj_scales"):
            return _gate_first(tensor, self.start, local)
        if param_name == "down_proj":  # HF [E, I, H] -> [E, H, I]
            return tensor.narrow(1, self.start, local).transpose(1, 2)
        if param_name in ("down_proj_blocks", "down_proj_scales"):
            return tensor.narrow(2, self.start // mxfp4.GROUP, local // mxfp4.GROUP)
        if param_name == "down_proj_bias" and self._bias_elsewhere():
            return torch.zeros_like(tensor)
        return tensor

    def tp_slice_stored(self, param_name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of a whole parameter as one rank stores it (gate rows, then up rows; dense
        weights output-major): `load_format=dummy` draws those whole."""
        start, local, G = self.start, self.local, mxfp4.GROUP
        tensor = self._held_experts(tensor)
        if param_name.startswith("gate_up_proj"):
            full = tensor.shape[1] // 2
            return torch.cat([tensor.narrow(1, start, local), tensor.narrow(1, full + start, local)], dim=1)
        if param_name == "down_proj":
            return tensor.narrow(2, start, local)
        if param_name in ("down_proj_blocks", "down_proj_scales"):
            return tensor.narrow(2, start // G, local // G)
        if param_name == "down_proj_bias" and self._bias_elsewhere():
            return torch.zeros_like(tensor)
        return tensor

    def _held_experts(self, tensor: torch.Tensor) -> torch.Tensor:
        """A whole `[E, ...]` tensor's run of this rank's experts (all of them without expert parallelism)."""
        split = self.expert_split
        return tensor.narrow(0, split.start, split.count) if split.parallel else tensor

    def _bias_elsewhere(self) -> bool:
        """The down bias is another rank's to add: tensor parallelism's ranks after 0 (each runs every pair)."""
        return self.tp.enabled and self.tp.rank != 0 and not self.expert_split.parallel

    def forward(
        self,
        x: torch.Tensor,  # [n, hidden]
        weights: torch.Tensor,  # [n, k] routing weights
        ids: torch.Tensor,  # [n, k] int64 global expert ids
        row_valid: torch.Tensor | None = None,  # [n] bool: False for a padded graph row (routes nothing)
    ) -> torch.Tensor:
        return all_reduce(self.partial(x, weights, ids, row_valid))

    def partial(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                row_valid: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's share of the output `[n, hidden]`, before the sum over ranks."""
        from swaserve.layers.fused_moe import moe_experts

        if self.quantized:
            w1, w2 = self.gate_up_proj_blocks, self.down_proj_blocks
            scales = {"gate_up_scales": self.gate_up_proj_scales, "down_scales": self.down_proj_scales}
        else:
            w1, w2, scales = self.gate_up_proj, self.down_proj, {}
        if self.expert_split.parallel:
            scales["expert_start"] = self.expert_split.start
        return moe_experts(x, w1, w2, weights, ids, "swiglu_oai", row_valid, self.batch_invariant,
                           gate_up_bias=self.gate_up_proj_bias, down_bias=self.down_proj_bias,
                           alpha=self.alpha, limit=self.limit, **scales)


def _frozen(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


def _gate_first(t: torch.Tensor, start: int, local: int) -> torch.Tensor:
    """Pairs `start .. start+local` of dim 1 (rows 2p gate, 2p+1 up) as `[gates; ups]`."""
    pairs = t.narrow(1, 2 * start, 2 * local)
    return torch.cat([pairs[:, 0::2], pairs[:, 1::2]], dim=1)
