"""GPT-OSS: biased attention with per-head sinks, alternating sliding/full layers, YaRN rotary, and a
top-k MoE of clamped-SwiGLU experts on the fused MoE path, dense or MXFP4 as the checkpoint stores them
(openai/gpt-oss-20b and -120b: MXFP4 experts, everything else bf16).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from swaserve.layers import mxfp4
from swaserve.layers.gpt_oss_experts import GptOssExperts
from swaserve.layers.moe import TopKRouter, routed_rows
from swaserve.models.base import CausalLM, RoutedDecoderLayer

if TYPE_CHECKING:
    from swaserve.runner.forward_batch import ForwardBatch

# The released model's SwiGLU constants. Its config.json carries `swiglu_limit` but no alpha, and not every
# transformers version defaults either field, so neither is read from a library default.
SWIGLU_ALPHA = 1.702
SWIGLU_LIMIT = 7.0
# Expert weight names, dense or MXFP4 (the biases are dense either way).
_EXPERT_WEIGHTS = tuple(f".mlp.experts.{proj}{part}" for proj in ("gate_up_proj", "down_proj")
                        for part in ("", "_blocks", "_scales"))


def swiglu_params(hf: Any) -> tuple[float, float]:
    """(alpha, limit): the config's values where it has them, else the released model's constants."""
    alpha = getattr(hf, "swiglu_alpha", None)
    limit = getattr(hf, "swiglu_limit", None)
    return float(SWIGLU_ALPHA if alpha is None else alpha), float(SWIGLU_LIMIT if limit is None else limit)


class GptOssMoE(nn.Module):
    """HF's `mlp`: router.{weight,bias} and experts.* (`GptOssExperts`)."""

    def __init__(self, hf: Any, quantized: bool):
        super().__init__()
        if not 0 < hf.num_experts_per_tok <= hf.num_local_experts:
            raise ValueError(f"num_experts_per_tok {hf.num_experts_per_tok} must be in 1..num_local_experts "
                             f"({hf.num_local_experts})")
        alpha, limit = swiglu_params(hf)
        self.router = TopKRouter(hf.hidden_size, hf.num_local_experts, hf.num_experts_per_tok)
        self.experts = GptOssExperts(hf.num_local_experts, hf.hidden_size, hf.intermediate_size, alpha, limit,
                                     quantized)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:  # [num_tokens, hidden]
        weights, ids = self.router(x)
        return self.experts(x, weights, ids, routed_rows(batch, x))


class GptOssForCausalLM(CausalLM):
    """Norms keep their weight in float32 (HF keeps them fp32). A `quantization_config` of `mxfp4` makes
    every layer's experts MXFP4 unless `modules_to_not_convert` names them; any other method is refused."""

    norm_kwargs: ClassVar[dict[str, Any]] = {"fp32_weight": True}
    quant_methods: ClassVar[tuple[str, ...]] = ("mxfp4",)

    def __init__(self, hf_config: Any):
        mxfp4.quant_method(hf_config)  # a method this model cannot run fails here, naming it
        super().__init__(hf_config)

    def experts_quantized(self, layer_id: int) -> bool:
        return mxfp4.is_quantized(self.hf_config, f"model.layers.{layer_id}.mlp.experts")

    def attention_kwargs(self, layer_id: int) -> dict[str, Any]:
        return {**super().attention_kwargs(layer_id), "sinks": True}

    def build_layer(self, layer_id: int) -> nn.Module:
        hf = self.hf_config
        moe = GptOssMoE(hf, self.experts_quantized(layer_id))
        attn = self.build_attention(layer_id)
        return RoutedDecoderLayer(attn, moe, hf.hidden_size, self.norm_kw, sandwich=False)

    def map_weight_name(self, name: str) -> str | None:
        if name.startswith("model.layers.") and name.endswith(_EXPERT_WEIGHTS):
            layer_id = int(name.split(".")[2])
            packed = name.endswith(("_blocks", "_scales"))
            if layer_id < len(self.model.layers) and packed != self.experts_quantized(layer_id):
                stored, config = ("MXFP4", "dense") if packed else ("dense", "MXFP4")
                qc = getattr(self.hf_config, "quantization_config", None)
                raise ValueError(f"checkpoint stores {stored} experts ({name!r}) but its config.json makes them "
                                 f"{config} (quantization_config: {qc})")
        return super().map_weight_name(name)
