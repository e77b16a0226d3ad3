"""GPT-OSS: biased attention with per-head sinks, alternating sliding/full layers, YaRN rotary, and a
top-k MoE with clamped SwiGLU experts. bf16/fp32 weights only (MXFP4 is rejected).
"""

from __future__ import annotations

from functools import partial
from typing import Any, ClassVar

from torch import nn

from swaserve.layers.activation import clamped_swiglu
from swaserve.layers.moe import MoE
from swaserve.models.base import CausalLM

_MXFP4 = "GPT-OSS MXFP4-quantised checkpoints are not supported yet; use a bf16 checkpoint"


def _is_mxfp4(hf: Any) -> bool:
    qc = getattr(hf, "quantization_config", None)
    if qc is None:
        return False
    method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", None)
    return str(getattr(method, "value", method)).lower() == "mxfp4"


class GptOssForCausalLM(CausalLM):
    """The MoE replaces the gated MLP; norms keep their weight in float32 (HF keeps them fp32)."""

    norm_kwargs: ClassVar[dict[str, Any]] = {"fp32_weight": True}

    def __init__(self, hf_config: Any):
        if _is_mxfp4(hf_config):
            raise ValueError(_MXFP4)
        super().__init__(hf_config)

    def attention_kwargs(self, layer_id: int) -> dict[str, Any]:
        return {**super().attention_kwargs(layer_id), "sinks": True}

    def build_mlp(self, layer_id: int) -> nn.Module:
        hf = self.hf_config
        act = partial(clamped_swiglu, alpha=hf.swiglu_alpha, limit=hf.swiglu_limit)
        return MoE(hf.hidden_size, hf.intermediate_size, hf.num_local_experts, hf.num_experts_per_tok, act)

    def map_weight_name(self, name: str) -> str | None:
        if name.endswith(("_blocks", "_scales")):
            raise ValueError(f"{_MXFP4} (found {name!r})")
        return super().map_weight_name(name)
