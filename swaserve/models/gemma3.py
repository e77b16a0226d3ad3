"""Gemma 3 (text): Gemma 2 plus per-head q/k norms and a rotary base per layer type (local 10k for
sliding layers, global rope_theta with optional scaling for full ones); no attention soft-cap.
Also loads the text part of multimodal (Gemma3ForConditionalGeneration) checkpoints.
"""

from __future__ import annotations

from typing import Any

from swaserve.models.gemma2 import Gemma2ForCausalLM

# Multimodal checkpoints: older ones prefix the text model with `language_model.`, transformers 5
# saves `model.language_model.`; the vision tower and projector are not used here.
_TEXT_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                  ("language_model.lm_head.", "lm_head."))
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Per-layer-type rotary comes from the nested `rope_parameters` (the base class asks per type)."""

    def attention_kwargs(self, layer_id: int) -> dict[str, Any]:
        return {
            **super().attention_kwargs(layer_id),
            # HF Gemma 3 keeps `attn_logit_softcapping` in its config but never applies it.
            "logit_softcap": None,
            "qk_norm": {"eps": self.hf_config.rms_norm_eps, "unit_offset": True},
        }

    def map_weight_name(self, name: str) -> str | None:
        if name.startswith(_VISION_PREFIXES):
            return None
        for old, new in _TEXT_PREFIXES:
            if name.startswith(old):
                name = new + name[len(old):]
                break
        return super().map_weight_name(name)
