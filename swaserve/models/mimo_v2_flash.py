"""MiMo-V2-Flash (Xiaomi), as transformers' `models/mimo_v2_flash` defines it: Q/K heads of `head_dim`
(192) and V heads of `v_head_dim` (128), V scaled by `attention_value_scale` before it is cached,
sliding layers with twice the K/V heads of full layers and learned sinks, partial rotary (the first
third of each head) with a θ per layer type, a dense first layer and routed-expert layers after it
(sigmoid router, grouped top-k, no shared experts). The checkpoint's MTP layers (`model.mtp.*`) are
skipped here: the MTP drafter (`speculative/mimo_mtp.py`) loads them itself.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from swaserve.layers.mlp import GatedMLP
from swaserve.layers.moe import GroupedTopKRouter, StackedExperts, routed_rows
from swaserve.layers.rotary import RotaryEmbedding, rope_from_config
from swaserve.model_config import SLIDING
from swaserve.models.base import CausalLM, DecoderLayer, RoutedDecoderLayer
from swaserve.models.named_weights import NamedWeights

if TYPE_CHECKING:
    from swaserve.runner.forward_batch import ForwardBatch

# transformers' MiMoV2FlashRotaryEmbedding assumes this factor where a layer type's rope dict names none.
_PARTIAL_ROTARY = 0.334
# Released checkpoints store experts one by one (transformers fuses them on load; its state_dict is fused).
_PER_EXPERT = re.compile(
    r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|weight_scale_inv)$")
_MTP_PREFIX = "model.mtp."


class MiMoMoE(nn.Module):
    """Routed experts only. HF names: gate.weight, gate.e_score_correction_bias and either
    experts.{gate_up_proj, down_proj} (stacked) or experts.{e}.{gate,up,down}_proj.weight (per expert)."""

    def __init__(self, hf: Any):
        super().__init__()
        scaling = getattr(hf, "routed_scaling_factor", None) or 1.0
        self.gate = GroupedTopKRouter(hf.hidden_size, hf.n_routed_experts, hf.num_experts_per_tok, hf.n_group,
                                      hf.topk_group, bool(hf.norm_topk_prob), scaling)
        self.experts = StackedExperts(hf.n_routed_experts, hf.hidden_size, hf.moe_intermediate_size, hf.hidden_act)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:  # [num_tokens, hidden]
        weights, ids = self.gate(x)
        return self.experts(x, weights, ids, routed_rows(batch, x))


class MiMoV2FlashForCausalLM(CausalLM):
    """Llama-form norms and skeleton; the per-layer-type K/V head counts come from
    `config.layer_attention_shape`, so the pools and the layers agree. Routers stay float32 in any
    model dtype. Loads stacked or per-expert expert weights and checks that every expert arrived."""

    def __init__(self, hf_config: Any):
        self._experts_loaded: dict[str, set[tuple[int, str]]] = {}
        super().__init__(hf_config)

    def is_moe(self, layer_id: int) -> bool:
        kinds = getattr(self.hf_config, "mlp_layer_types", None)
        return (kinds[layer_id] if kinds is not None else "dense" if layer_id == 0 else "sparse") == "sparse"

    def rotary(self, layer_id: int) -> RotaryEmbedding:
        kind = self.layer_type(layer_id)
        if kind not in self._ropes:
            self._ropes[kind] = rope_from_config(self.hf_config, self.head_dim(layer_id), kind,
                                                 default_partial=_PARTIAL_ROTARY)
        return self._ropes[kind]

    def attention_kwargs(self, layer_id: int) -> dict[str, Any]:
        hf = self.hf_config
        v_scale = getattr(hf, "attention_value_scale", None)
        return {
            **super().attention_kwargs(layer_id),
            "o_bias": False,  # HF's o_proj never has a bias (attention_bias is q/k/v only)
            "v_head_dim": hf.v_head_dim,
            "v_scale": None if v_scale in (None, 1.0) else float(v_scale),
            "sinks": self.layer_type(layer_id) == SLIDING,
        }

    def build_layer(self, layer_id: int) -> nn.Module:
        hf = self.hf_config
        attn = self.build_attention(layer_id)
        if self.is_moe(layer_id):
            return RoutedDecoderLayer(attn, MiMoMoE(hf), hf.hidden_size, self.norm_kw, sandwich=False)
        return DecoderLayer(attn, GatedMLP(hf.hidden_size, hf.intermediate_size, hf.hidden_act), hf.hidden_size,
                            self.norm_kw, sandwich=False)

    def map_weight_name(self, name: str) -> str | None:
        if name.startswith(_MTP_PREFIX):
            return None
        name = name.replace(".self_attn.attention_sink_bias", ".self_attn.sinks")
        return super().map_weight_name(name)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self._experts_loaded = {}
        super().load_weights(weights)
        for prefix, seen in self._experts_loaded.items():
            experts = self.get_submodule(prefix)
            # FP8 checkpoints also carry each expert's scales (online FP8 makes them at load).
            scaled = experts.fp8 is not None and not experts.fp8.online
            projs = [p + s for p in ("gate_proj", "up_proj", "down_proj") for s in ("", ".weight_scale_inv")[:1 + scaled]]
            split = experts.expert_split
            want = {(e, p) for e in range(split.start, split.start + split.count) for p in projs}
            if want - seen:
                missing = sorted(want - seen)[:3]
                raise ValueError(f"checkpoint is missing {len(want - seen)} expert weights of {prefix}, e.g. {missing}")

    def keeps_weight(self, name: str) -> bool:
        """Whether the checkpoint tensor `name` is worth reading: not another expert-parallel rank's expert
        (anything unknown is read, and refused by name when it loads)."""
        target = self.map_weight_name(name)
        m = _PER_EXPERT.match(target) if target is not None else None
        if m is None:
            return True
        try:
            split = self.get_submodule(m.group(1)).expert_split
        except AttributeError:
            return True
        expert = int(m.group(2))
        return split.holds(expert) or expert >= split.total

    def load_one(self, named: NamedWeights, name: str, target: str, tensor: torch.Tensor) -> None:
        m = _PER_EXPERT.match(target)
        if m is None:
            named.load(name, target, tensor)
            return
        prefix, expert, proj, param = m.group(1), int(m.group(2)), m.group(3), m.group(4)
        experts = self.get_submodule(prefix)
        if not isinstance(experts, StackedExperts) or expert >= experts.expert_split.total:
            raise ValueError(f"unknown weight {name!r} for {type(self).__name__}")
        if experts.expert_split.holds(expert):  # expert parallelism: another rank's expert is skipped
            experts.load_expert(expert, proj, tensor, param)
            self._experts_loaded.setdefault(prefix, set()).add((expert, proj if param == "weight" else f"{proj}.{param}"))
        # Counts the stacked parameters as present; `load_weights` checks that every expert filled them.
        stacked = f"{prefix}.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}"
        named.mark(stacked if param == "weight" else f"{stacked}_scale_inv")
        if experts.fp8 is not None and experts.fp8.online:
            named.mark(f"{stacked}_scale_inv")
