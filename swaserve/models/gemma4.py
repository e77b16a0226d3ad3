"""Gemma 4 (text): per-layer-type attention shapes (wide full layers, K = V on full layers), weightless
V norms, attention scale 1, proportional RoPE on full layers, per-layer embeddings (PLE), KV-shared
tail layers, an optional MoE block beside the dense MLP, a learned per-layer output scalar. Loads the
text part of Gemma4ForConditionalGeneration checkpoints; vision and audio towers are skipped.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from swaserve.layers.activation import get_activation
from swaserve.layers.attention import SelfAttention
from swaserve.layers.embedding import VocabEmbedding
from swaserve.layers.mlp import GatedMLP
from swaserve.layers.moe import NormRouter, StackedExperts, fused_router, routed_rows
from swaserve.layers.norm import RMSNorm, add_norm
from swaserve.model_config import FULL
from swaserve.models.base import CausalLM, keep_aux_hidden

if TYPE_CHECKING:
    from swaserve.runner.forward_batch import ForwardBatch

log = logging.getLogger(__name__)

_TEXT_PREFIX = ("model.language_model.", "model.")
_TOWER_PREFIXES = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.")


def fused_tail() -> bool:
    """On CUDA unless SWASERVE_FUSED_TAIL=0: a layer without PLE ends in one launch (`kernels.ffn_tail`)
    instead of five on an MoE layer (three on a dense one), the same bits in bf16."""
    return os.environ.get("SWASERVE_FUSED_TAIL") != "0"


class Gemma4MoE(nn.Module):
    """The MoE half of a Gemma 4 feed-forward: routed on the post-attention residual `h`, experts
    fed `pre_feedforward_layernorm_2(h)`. HF names: router.*, experts.*, pre_feedforward_layernorm_2."""

    def __init__(self, hf: Any, norm: dict):
        super().__init__()
        self.router = NormRouter(hf.hidden_size, hf.num_experts, hf.top_k_experts, hf.rms_norm_eps)
        self.experts = StackedExperts(hf.num_experts, hf.hidden_size, hf.moe_intermediate_size, hf.hidden_activation)
        self.pre_feedforward_layernorm_2 = RMSNorm(hf.hidden_size, **norm)

    def forward(self, h: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        if h.is_cuda and fused_router():
            return self._fused_inputs_forward(h, batch)
        weights, ids = self.router(h)
        return self.experts(self.pre_feedforward_layernorm_2(h), weights, ids, routed_rows(batch, h))

    def _fused_inputs_forward(self, h: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """`forward` with the router's and the experts' inputs in one launch (`kernels.moe_inputs`)."""
        from swaserve.kernels.moe_inputs import moe_inputs

        router, norm = self.router, self.pre_feedforward_layernorm_2
        assert router.norm.eps == norm.eps, (router.norm.eps, norm.eps)
        router_in, experts_in = moe_inputs(h, router.scale, router.root_size, norm.kernel_weight(h.device), norm.eps,
                                           unit_offset=norm.unit_offset, weight_fp32=norm.fp32_weight)
        weights, ids = router.route(router_in)
        return self.experts(experts_in, weights, ids, routed_rows(batch, h))


class Gemma4DecoderLayer(nn.Module):
    """Sandwich-normed attention and feed-forward (dense MLP, plus the MoE block when enabled, each
    with its own post norm), then the PLE residual, then `h *= layer_scalar`."""

    def __init__(self, hf: Any, self_attn: SelfAttention, mlp: GatedMLP, norm: dict, moe: bool):
        super().__init__()
        H = hf.hidden_size
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(H, **norm)
        self.post_attention_layernorm = RMSNorm(H, **norm)
        self.pre_feedforward_layernorm = RMSNorm(H, **norm)
        self.post_feedforward_layernorm = RMSNorm(H, **norm)
        self.moe = Gemma4MoE(hf, norm) if moe else None
        if moe:
            self.post_feedforward_layernorm_1 = RMSNorm(H, **norm)
            self.post_feedforward_layernorm_2 = RMSNorm(H, **norm)
        ple = hf.hidden_size_per_layer_input or 0
        self.has_ple = ple > 0
        if self.has_ple:
            self.act = get_activation(hf.hidden_activation)
            self.per_layer_input_gate = nn.Linear(H, ple, bias=False)
            self.per_layer_projection = nn.Linear(ple, H, bias=False)
            self.post_per_layer_input_norm = RMSNorm(H, **norm)
        self.layer_scalar = nn.Parameter(torch.empty(1))  # [1]

    def forward(
        self, h: torch.Tensor, x: torch.Tensor, batch: ForwardBatch, next_norm: RMSNorm,
        per_layer_input: torch.Tensor | None,  # [num_tokens, ple_dim], this layer's slice
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Same contract as `DecoderLayer.forward`: `x = input_layernorm(h)` comes in, `(h, next_norm(h))` goes out."""
        attn = self.self_attn(x, batch, partial_sums=True)
        h, x = add_norm(attn, h, self.post_attention_layernorm, self.pre_feedforward_layernorm)
        fused = h.is_cuda and not self.has_ple and fused_tail()
        ff = self.mlp(x, partial_sums=fused)
        moe = self.moe(h, batch) if self.moe is not None else None
        if fused:
            return self._fused_tail(ff, moe, h, next_norm)
        if moe is not None:
            # norm_1(mlp) + norm_2(experts), the second added onto the first in one norm call.
            ff = self.post_feedforward_layernorm_2(moe, residual=self.post_feedforward_layernorm_1(ff))
        h = self.post_feedforward_layernorm(ff, residual=h)
        if self.has_ple:
            gated = self.act(self.per_layer_input_gate(h)) * per_layer_input
            h = self.post_per_layer_input_norm(self.per_layer_projection(gated), residual=h)
        h = h * self.layer_scalar
        return h, next_norm(h)

    def _fused_tail(self, ff: torch.Tensor, moe: torch.Tensor | None, h: torch.Tensor,
                    next_norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward`'s end from the feed-forward outputs on, in one launch (`kernels.ffn_tail`): the same bits."""
        from swaserve.kernels.ffn_tail import ffn_tail

        post = self.post_feedforward_layernorm
        n1 = self.post_feedforward_layernorm_1 if moe is not None else None
        n2 = self.post_feedforward_layernorm_2 if moe is not None else None
        dev = h.device
        w1 = n1.kernel_weight(dev) if n1 is not None else None
        w2 = n2.kernel_weight(dev) if n2 is not None else None
        return ffn_tail(ff, moe, h, w1, w2, post.kernel_weight(dev), self.layer_scalar, next_norm.kernel_weight(dev),
                        post.eps, unit_offset=post.unit_offset, weight_fp32=post.fp32_weight)


class PerLayerInputs(nn.Module):
    """PLE: every layer gets a small extra input per token, `(norm(proj(embeds) / sqrt(H)) + E_ple[id]) / sqrt(2)`.
    HF names (under `model.`): embed_tokens_per_layer, per_layer_model_projection, per_layer_projection_norm."""

    def __init__(self, hf: Any, norm: dict):
        super().__init__()
        self.num_layers, self.dim = hf.num_hidden_layers, hf.hidden_size_per_layer_input
        total = self.num_layers * self.dim
        self.embed_tokens_per_layer = VocabEmbedding(hf.vocab_size_per_layer_input, total, self.dim**0.5)
        self.per_layer_model_projection = nn.Linear(hf.hidden_size, total, bias=False)
        self.per_layer_projection_norm = RMSNorm(self.dim, **norm)
        self.projection_scale = hf.hidden_size**-0.5

    def forward(self, input_ids: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """`[T]` ids and `[T, hidden]` scaled embeddings -> `[T, num_layers, ple_dim]`."""
        shape = (embeds.shape[0], self.num_layers, self.dim)
        token = self.embed_tokens_per_layer(input_ids).view(shape)
        context = (self.per_layer_model_projection(embeds) * self.projection_scale).view(shape)
        return (self.per_layer_projection_norm(context) + token) * 2**-0.5


class Gemma4Stack(nn.Module):
    """HF's `model.`: embed_tokens, layers, norm and, with PLE, the per-layer input tables.
    `aux_hidden_layers`: as `DecoderStack`'s (EAGLE-3)."""

    aux_hidden_layers: tuple[int, ...] = ()

    def __init__(self, embed: VocabEmbedding, layers: list[Gemma4DecoderLayer], norm: RMSNorm,
                 per_layer: PerLayerInputs | None):
        super().__init__()
        self.embed_tokens = embed
        self.layers = nn.ModuleList(layers)
        self.norm = norm
        self.per_layer = per_layer

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        h = self.embed_tokens(batch.input_ids)
        ple = self.per_layer(batch.input_ids, h) if self.per_layer is not None else None
        x = self.layers[0].input_layernorm(h)
        seen: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            if i in self.aux_hidden_layers:
                seen[i] = h
            nxt = self.layers[i + 1].input_layernorm if i + 1 < len(self.layers) else self.norm
            h, x = layer(h, x, batch, nxt, ple[:, i] if ple is not None else None)
        if self.aux_hidden_layers:
            seen[len(self.layers)] = h
            keep_aux_hidden(batch, self.aux_hidden_layers, seen)
        return x


class Gemma4ForCausalLM(CausalLM):
    """Norms are Gemma 4's float32-weight form (`w * x̂`, no unit offset). Which layers are KV-shared
    (and whose K/V they read) comes from `ModelConfig.kv_source`, so model and pools agree."""

    norm_kwargs: ClassVar[dict[str, Any]] = {"fp32_weight": True}

    def __init__(self, hf_config: Any):
        if getattr(hf_config, "use_bidirectional_attention", None) == "all":
            raise ValueError("Gemma 4 with use_bidirectional_attention='all' (an encoder) is not a causal LM")
        super().__init__(hf_config)

    def embed_scale(self) -> float | None:
        return self.hf_config.hidden_size**0.5

    def is_kv_shared(self, layer_id: int) -> bool:
        return layer_id in self.config.kv_sources

    def attention_kwargs(self, layer_id: int) -> dict[str, Any]:
        hf = self.hf_config
        eps = hf.rms_norm_eps
        return {
            **super().attention_kwargs(layer_id),
            "scaling": 1.0,  # q and k are RMS-normed; HF scales by 1
            "qk_norm": {"eps": eps, "fp32_weight": True},
            "v_norm": {"eps": eps},
            "k_eq_v": bool(getattr(hf, "attention_k_eq_v", False)) and self.layer_type(layer_id) == FULL,
            "kv_shared": self.is_kv_shared(layer_id),
        }

    def build_layer(self, layer_id: int) -> nn.Module:
        hf = self.hf_config
        wide = bool(getattr(hf, "use_double_wide_mlp", False)) and self.is_kv_shared(layer_id)
        mlp = GatedMLP(hf.hidden_size, hf.intermediate_size * (2 if wide else 1), hf.hidden_activation)
        return Gemma4DecoderLayer(hf, self.build_attention(layer_id), mlp, self.norm_kw,
                                  moe=bool(getattr(hf, "enable_moe_block", False)))

    def build_stack(self, embed: VocabEmbedding, layers: list[nn.Module], norm: RMSNorm) -> nn.Module:
        hf = self.hf_config
        per_layer = PerLayerInputs(hf, self.norm_kw) if getattr(hf, "hidden_size_per_layer_input", 0) else None
        return Gemma4Stack(embed, layers, norm, per_layer)

    def map_weight_name(self, name: str) -> str | None:
        if name.startswith(_TOWER_PREFIXES):
            if not getattr(self, "_towers_logged", False):
                log.info("Gemma 4 checkpoint: loading the language model only; vision/audio towers are skipped")
                self._towers_logged = True
            return None
        if name.startswith(_TEXT_PREFIX[0]):
            name = _TEXT_PREFIX[1] + name[len(_TEXT_PREFIX[0]):]
        parts = name.split(".")
        if len(parts) > 4 and parts[:2] == ["model", "layers"] and parts[3] == "self_attn":
            # KV-shared layers keep only q_proj/q_norm/o_proj; checkpoints may still carry the rest.
            if parts[4] in ("k_proj", "v_proj", "k_norm", "v_norm") and self.is_kv_shared(int(parts[2])):
                return None
        if name.startswith(("model.embed_tokens_per_layer.", "model.per_layer_")):
            name = "model.per_layer." + name[len("model."):]
        if name.startswith("model.layers.") and any(f".{k}." in name for k in ("router", "experts", "pre_feedforward_layernorm_2")):
            name = name.replace(".router.", ".moe.router.").replace(".experts.", ".moe.experts.")
            name = name.replace(".pre_feedforward_layernorm_2.", ".moe.pre_feedforward_layernorm_2.")
        return super().map_weight_name(name)
