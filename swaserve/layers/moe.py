"""Mixture-of-experts blocks. GPT-OSS: a biased top-k router (its experts: `layers.gpt_oss_experts`).
Gemma 4: a normed, scaled router and bias-free stacked experts run by `fused_moe.moe_experts`. MiMo-V2:
a sigmoid router with grouped top-k selection over the same stacked experts (loaded expert by expert
from per-expert checkpoints).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from swaserve.distributed.state import all_reduce, shard_size, split_experts, tp_group
from swaserve.layers.fp8_linear import Fp8Spec, load_expert_part, load_stacked_param

if TYPE_CHECKING:
    from swaserve.runner.forward_batch import ForwardBatch


def fused_router() -> bool:
    """On CUDA unless SWASERVE_FUSED_ROUTER=0: the routers' top-k selection and weights in one launch
    (`kernels.router_topk`) instead of six to nine torch launches, MiMo-V2's grouped sigmoid selection in
    one (`router_topk.route_grouped`) instead of eight to fifteen, and Gemma 4's router and expert inputs
    in one (`kernels.moe_inputs`) instead of four. H200: the routing alone 18.6 -> 2.4 us a layer at one
    token (Gemma 4; GPT-OSS 10.7 -> 2.3, MiMo-V2 18.1 -> 2.7); with `SWASERVE_FUSED_TAIL` a
    Gemma-4-26B-A4B decode step at 1k context 5.04 -> 4.11 ms at bs 1 (`benchmarks/results/
    h200_router_fusions_2026-11-29.log`)."""
    return os.environ.get("SWASERVE_FUSED_ROUTER") != "0"


class TopKRouter(nn.Module):
    """Picks `top_k` experts per token; their weights are a softmax over the selected logits only.
    Logits in float32 from float32 parameters (the owning model keeps them so whatever its dtype):
    bf16 logits round to steps of 1/8 at the magnitudes routers reach, which reorders experts that are
    close (measured at gpt-oss-20b widths on an H100: 1.7-2.3% of tokens routed to another expert set
    than in fp32, each a large error in that token's output)."""

    batch_invariant = False  # deterministic mode (`layers.batch_invariant`)
    float32_params = True  # `CausalLM._apply` keeps weight and bias float32

    def __init__(self, hidden_size: int, num_experts: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))  # [E, hidden]
        self.bias = nn.Parameter(torch.empty(num_experts))  # [E]

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = _linear(x.float(), self.weight, self.bias, self.batch_invariant)  # [n, E] float32
        if logits.is_cuda and fused_router():  # one launch (`kernels.router_topk`): the same experts and weights
            from swaserve.kernels.router_topk import route_topk

            return route_topk(logits, self.top_k)
        top, ids = torch.topk(logits, self.top_k, dim=-1)  # [n, k]
        return torch.softmax(top, dim=-1), ids


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, batch_invariant: bool) -> torch.Tensor:
    if batch_invariant:
        from swaserve.layers.batch_invariant import invariant_linear

        return invariant_linear(x, weight, bias)
    return F.linear(x, weight, bias)


class NormRouter(nn.Module):
    """Gemma 4's router: weightless RMS norm, a per-channel `scale` and 1/sqrt(hidden), a projection
    to expert logits, a float32 softmax over ALL experts, the top k of those probabilities
    renormalised to sum to 1, times a learned `per_expert_scale`. HF names: proj, scale, per_expert_scale.
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, eps: float):
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"top_k {top_k} must be in 1..num_experts ({num_experts})")
        from swaserve.layers.norm import RMSNorm

        self.top_k = top_k
        self.root_size = hidden_size**-0.5
        self.norm = RMSNorm(hidden_size, eps, scale=False)
        self.proj = nn.Linear(hidden_size, num_experts, bias=False)
        self.scale = nn.Parameter(torch.empty(hidden_size))  # [hidden]
        self.per_expert_scale = nn.Parameter(torch.empty(num_experts))  # [E]

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`[n, hidden]` -> routing weights `[n, k]` float32 and expert ids `[n, k]` int64."""
        return self.route(self.norm(h) * self.scale * self.root_size)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` from the projection on: `x` is `norm(h) * scale * root_size` (`kernels.moe_inputs`)."""
        logits = self.proj(x)  # [n, E]
        if logits.is_cuda and fused_router():
            # one launch: the renormalised top-k probabilities are a softmax over the top-k logits
            from swaserve.kernels.router_topk import route_topk

            return route_topk(logits, self.top_k, self.per_expert_scale)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top, ids = torch.topk(probs, self.top_k, dim=-1)
        top = top / top.sum(dim=-1, keepdim=True)
        return top * self.per_expert_scale[ids], ids


class StackedExperts(nn.Module):
    """E gated expert MLPs stored output-major (`x @ W.T`, nn.Linear style) without biases, as Gemma 4
    checkpoints store them: `gate_up_proj` [E, 2I, hidden] (gate rows first), `down_proj` [E, hidden, I].
    Runs `fused_moe.moe_experts`: a sorted grouped GEMM on CUDA, a per-expert loop elsewhere. Tensor
    parallelism splits every expert's intermediate size; expert parallelism (`expert_split`) gives each
    rank a run of whole experts instead (the parameters' first dim, local index = global - start).
    Either way the outputs are summed over the ranks. Expert ids passed in and out are global."""

    batch_invariant = False  # deterministic mode (`layers.batch_invariant`)
    fp8: Fp8Spec | None = None  # block FP8 (`fp8_linear.convert_experts`): e4m3 weights + `*_scale_inv` float32

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, activation: str):
        super().__init__()
        from swaserve.layers.activation import fused_activation_name

        act = fused_activation_name(activation)
        if act is None:
            raise ValueError(f"no fused expert activation for {activation!r}")
        self.activation = act
        self.tp = tp_group()
        self.hf_intermediate = intermediate_size
        self.expert_split = split_experts(num_experts)
        E = self.expert_split.count
        if not self.expert_split.parallel:
            intermediate_size = shard_size(intermediate_size, "expert intermediate size")
        # This rank's run of every expert's intermediate size: all of it under expert parallelism.
        self.width_start = self.tp.rank * intermediate_size if intermediate_size != self.hf_intermediate else 0
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(E, hidden_size, intermediate_size))

    def tp_slice(self, param_name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A stacked HF tensor `[E, ...]` (weights or FP8 scale grids) as this rank holds it: its experts
        (expert parallelism) or every expert's run of the intermediate size (tensor parallelism)."""
        split = self.expert_split
        if split.parallel:
            return tensor.narrow(0, split.start, split.count) if tensor.shape[0] == split.total else tensor
        if not self.tp.enabled:
            return tensor
        full, local = self.hf_intermediate, self.hf_intermediate // self.tp.size
        start = self.width_start
        if param_name == "gate_up_proj":  # gate rows then up rows: this rank's run of each
            return torch.cat([tensor.narrow(1, start, local), tensor.narrow(1, full + start, local)], dim=1)
        if param_name == "down_proj":
            return tensor.narrow(2, start, local)
        return tensor

    def load_param(self, param_name: str, tensor: torch.Tensor, quantize: bool | None = None) -> tuple[str, ...]:
        """FP8: stacked scales, or unquantised stacked weights quantised here (`fp8_linear.load_stacked_param`);
        () where the default slice-and-copy loads it."""
        return load_stacked_param(self, param_name, tensor, quantize) if self.fp8 is not None else ()

    def load_expert(self, expert: int, proj: str, tensor: torch.Tensor, param: str = "weight",
                    quantize: bool | None = None) -> None:
        """One expert's HF weight, for checkpoints that store experts one by one: `gate_proj` or
        `up_proj` `[I, hidden]`, `down_proj` `[hidden, I]` (this rank's part of I taken here); FP8: also
        `param="weight_scale_inv"`, and an unquantised weight quantised here when online or `quantize`.
        `expert` is global: ValueError for one another rank holds (callers skip those: `expert_split`)."""
        what = f"expert {expert} {proj}"
        expert = self.expert_split.local(expert)
        if self.fp8 is not None:
            load_expert_part(self, expert, proj, param, tensor, quantize)
            return
        if param != "weight":
            raise ValueError(f"{what}.{param}: these experts are not FP8")
        local = self.gate_up_proj.shape[1] // 2
        start = self.width_start
        if proj == "down_proj":
            dst, dim = self.down_proj.data[expert], 1
        elif proj in ("gate_proj", "up_proj"):
            dst, dim = self.gate_up_proj.data[expert].narrow(0, 0 if proj == "gate_proj" else local, local), 0
        else:
            raise ValueError(f"unknown expert projection {proj!r}")
        if tensor.ndim == 2 and tensor.shape[dim] == self.hf_intermediate != local:
            tensor = tensor.narrow(dim, start, local)
        if tuple(tensor.shape) != tuple(dst.shape):
            raise ValueError(f"{what}: expected shape {tuple(dst.shape)}, got {tuple(tensor.shape)}")
        dst.copy_(tensor)

    def forward(
        self,
        x: torch.Tensor,  # [n, hidden]
        weights: torch.Tensor,  # [n, k] float32
        ids: torch.Tensor,  # [n, k] int64
        row_valid: torch.Tensor | None = None,  # [n] bool: False for a padded graph row (routes nothing)
    ) -> torch.Tensor:
        return all_reduce(self.partial(x, weights, ids, row_valid))

    def partial(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                row_valid: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's share of the output `[n, hidden]` (its experts' slots, or its width of every
        expert), before the sum over ranks."""
        from swaserve.layers.fused_moe import moe_experts

        scales = {} if self.fp8 is None else {
            "gate_up_scales": self.gate_up_proj_scale_inv, "down_scales": self.down_proj_scale_inv,
            "gate_up_scale_rows": self.fp8.scale_rows}
        if self.expert_split.parallel:
            scales["expert_start"] = self.expert_split.start
        return moe_experts(x, self.gate_up_proj, self.down_proj, weights, ids, self.activation, row_valid,
                           self.batch_invariant, **scales)


class GroupedTopKRouter(nn.Module):
    """MiMo-V2's router (DeepSeek-V3's selection): sigmoid scores of float32 logits; experts chosen by
    `scores + e_score_correction_bias` within the `topk_group` of `n_group` groups whose two best
    biased scores sum highest; their weights are the unbiased scores, renormalised to sum to 1 when
    `norm_topk_prob` (+1e-20, as HF), times `routed_scaling_factor`. The owning model keeps weight
    and bias float32 whatever its dtype, as the checkpoints store them (bf16 would flip choices).
    HF names: weight, e_score_correction_bias."""

    batch_invariant = False  # deterministic mode (`layers.batch_invariant`)
    float32_params = True  # `CausalLM._apply` keeps weight and bias float32

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, n_group: int, topk_group: int,
                 norm_topk_prob: bool, routed_scaling_factor: float):
        super().__init__()
        if num_experts % n_group or num_experts // n_group < 2:
            raise ValueError(f"n_group {n_group} must split {num_experts} experts into groups of at least 2")
        if not 0 < topk_group <= n_group or not 0 < top_k <= topk_group * num_experts // n_group:
            raise ValueError(f"top_k {top_k} / topk_group {topk_group} cannot be chosen from {n_group} groups")
        self.top_k, self.n_group, self.topk_group = top_k, n_group, topk_group
        self.norm_topk_prob, self.scale = norm_topk_prob, float(routed_scaling_factor)
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))  # [E, hidden] float32
        self.e_score_correction_bias = nn.Parameter(torch.empty(num_experts))  # [E] float32

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`[n, hidden]` -> routing weights `[n, k]` float32 and expert ids `[n, k]` int64."""
        logits = _linear(x.float(), self.weight.float(), None, self.batch_invariant)  # [n, E]
        if logits.is_cuda and fused_router():
            from swaserve.kernels.router_topk import grouped_supported, route_grouped

            if grouped_supported(logits.shape[1], self.n_group):  # one launch, the same selection and weights
                return route_grouped(logits, self.e_score_correction_bias, self.top_k, self.n_group,
                                     self.topk_group, self.norm_topk_prob, self.scale)
        scores = logits.sigmoid()
        biased = scores + self.e_score_correction_bias.float()
        n, e = biased.shape
        if self.n_group > 1:
            grouped = biased.view(n, self.n_group, e // self.n_group)
            group_score = grouped.topk(2, dim=-1).values.sum(-1)  # [n, n_group]
            keep = torch.zeros_like(group_score, dtype=torch.bool)
            keep.scatter_(1, group_score.topk(self.topk_group, dim=-1).indices, True)
            biased = grouped.masked_fill(~keep[:, :, None], float("-inf")).view(n, e)
        ids = biased.topk(self.top_k, dim=-1).indices  # [n, k]
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * self.scale, ids


def routed_rows(batch: ForwardBatch, h: torch.Tensor) -> torch.Tensor | None:
    """`[num_tokens]` bool, once per forward (shared by every MoE layer): False for padded tokens,
    which must route nothing: the padded rows of a replayed decode graph (they point at request row
    0), and a piecewise graph's padded tokens (its runner sets the mask). None elsewhere (an eager
    extend batch has no padding; the CPU reference path needs no mask)."""
    if "moe_routed_rows" in batch.scratch:
        return batch.scratch["moe_routed_rows"]
    if not (batch.is_decode and h.is_cuda):
        return None
    batch.scratch["moe_routed_rows"] = batch.req_pool_indices != 0
    return batch.scratch["moe_routed_rows"]
