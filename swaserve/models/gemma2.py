"""Gemma 2: sandwich norms in Gemma's (1 + w) form, sqrt(hidden) embedding scale, attention scaled
by query_pre_attn_scalar, tanh soft-caps on attention logits and final logits.
"""

from __future__ import annotations

from typing import Any, ClassVar

from swaserve.models.base import CausalLM


class Gemma2ForCausalLM(CausalLM):
    """Alternating sliding/full layers (from `layer_types`), one rotary for both."""

    sandwich_norms = True
    norm_kwargs: ClassVar[dict[str, Any]] = {"unit_offset": True}

    def __init__(self, hf_config: Any):
        if getattr(hf_config, "use_bidirectional_attention", False):
            raise ValueError("bidirectional (embedding-model) Gemma attention is not supported")
        super().__init__(hf_config)

    def embed_scale(self) -> float | None:
        return self.hf_config.hidden_size**0.5

    def attention_kwargs(self, layer_id: int) -> dict[str, Any]:
        hf = self.hf_config
        return {
            **super().attention_kwargs(layer_id),
            "scaling": hf.query_pre_attn_scalar**-0.5,
            "logit_softcap": getattr(hf, "attn_logit_softcapping", None),
        }
