"""CausalLM: the decoder-only skeleton every family shares (embed -> layers -> final norm -> LM head)
and weight loading by HF parameter name. Family files override small hooks, nothing more.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from swaserve.layers.attention import SelfAttention
from swaserve.layers.embedding import LMHead, VocabEmbedding
from swaserve.layers.mlp import GatedMLP
from swaserve.layers.norm import RMSNorm, add_norm
from swaserve.layers.rotary import RotaryEmbedding, rope_from_config
from swaserve.model_config import FULL, SLIDING, ModelConfig, layer_attention_shape
from swaserve.models.kv_scales import layer_kv_scales, take_kv_scale
from swaserve.models.named_weights import NamedWeights, hf_module_names
from swaserve.models.quantization import apply_fp8, check_quant_method, keep_stored_dtypes

if TYPE_CHECKING:
    from swaserve.runner.forward_batch import ForwardBatch

class DecoderLayer(nn.Module):
    """Pre-norm residual block. `sandwich=True` (Gemma) also norms the attention and MLP outputs
    before they join the residual; HF names: input_layernorm, post_attention_layernorm and, for
    sandwich, pre_feedforward_layernorm / post_feedforward_layernorm.
    """

    def __init__(self, self_attn: SelfAttention, mlp: nn.Module, hidden_size: int, norm: dict, sandwich: bool):
        super().__init__()
        self.sandwich = sandwich
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(hidden_size, **norm)
        self.post_attention_layernorm = RMSNorm(hidden_size, **norm)
        if sandwich:
            self.pre_feedforward_layernorm = RMSNorm(hidden_size, **norm)
            self.post_feedforward_layernorm = RMSNorm(hidden_size, **norm)

    def forward(
        self, h: torch.Tensor, x: torch.Tensor, batch: ForwardBatch, next_norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`h`: the residual stream `[num_tokens, hidden]`; `x = input_layernorm(h)`, computed by the
        caller together with the previous residual add. Returns the new `h` and `next_norm(h)` (the
        next layer's input norm, or the final norm), so each residual add and the norm after it run
        as one fused launch on the GPU."""
        # The output projections may hand add_norm split-K partial sums (decode batches on the GPU).
        attn = self.self_attn(x, batch, partial_sums=True)
        if self.sandwich:
            h, x = add_norm(attn, h, self.post_attention_layernorm, self.pre_feedforward_layernorm)
            return add_norm(self.mlp(x, partial_sums=True), h, self.post_feedforward_layernorm, next_norm)
        h, x = add_norm(attn, h, None, self.post_attention_layernorm)
        return add_norm(self.mlp(x, partial_sums=True), h, None, next_norm)


class RoutedDecoderLayer(DecoderLayer):
    """The pre-norm block whose MLP is routed experts that also get the batch, so the padded rows of a
    replayed decode graph route nothing (GPT-OSS, MiMo-V2's MoE layers)."""

    def forward(
        self, h: torch.Tensor, x: torch.Tensor, batch: ForwardBatch, next_norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`DecoderLayer.forward`'s contract."""
        attn = self.self_attn(x, batch, partial_sums=True)
        h, x = add_norm(attn, h, None, self.post_attention_layernorm)
        return add_norm(self.mlp(x, batch), h, None, next_norm)


def keep_aux_hidden(batch: ForwardBatch, layers: tuple[int, ...], seen: dict[int, torch.Tensor]) -> None:
    """`batch.scratch["aux_hidden"]` `[num_tokens, len(layers) * hidden]`: the residual streams `seen`
    entering `layers` (id = the layer count: the last layer's output, before the final norm), in order."""
    batch.scratch["aux_hidden"] = torch.cat([seen[i] for i in layers], dim=-1)


class DecoderStack(nn.Module):
    """HF's `model.` prefix: embed_tokens, layers, norm. `aux_hidden_layers` (set by an EAGLE-3
    drafter before decode graphs are captured): also keep the residual stream entering those layers
    (`keep_aux_hidden`)."""

    aux_hidden_layers: tuple[int, ...] = ()

    def __init__(self, embed_tokens: VocabEmbedding, layers: list[DecoderLayer], norm: RMSNorm):
        super().__init__()
        self.embed_tokens = embed_tokens
        self.layers = nn.ModuleList(layers)
        self.norm = norm

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        h = self.embed_tokens(batch.input_ids)
        x = self.layers[0].input_layernorm(h)
        seen: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            if i in self.aux_hidden_layers:
                seen[i] = h
            nxt = self.layers[i + 1].input_layernorm if i + 1 < len(self.layers) else self.norm
            h, x = layer(h, x, batch, nxt)
        if self.aux_hidden_layers:
            seen[len(self.layers)] = h
            keep_aux_hidden(batch, self.aux_hidden_layers, seen)
        return x


class CausalLM(nn.Module):
    """A decoder-only LM built from a transformers config; the engine's model interface.

    `forward(batch)` returns the final hidden states `[num_tokens, hidden]`, `compute_logits` float32
    logits, `greedy_tokens` their argmax and `sample_tokens` a temperature draw (both without the
    logits on a GPU), `load_weights` consumes (HF name, tensor) pairs and raises ValueError on
    unknown or missing names. Which layers slide, and their window, come from
    `ModelConfig.from_hf`, so the model and the KV pools agree on layer ids by construction.
    """

    sandwich_norms = False  # Gemma: extra norms after attention and MLP
    norm_kwargs: ClassVar[dict[str, Any]] = {}  # RMSNorm form (Gemma: unit_offset=True)
    quant_methods: ClassVar[tuple[str, ...]] = ("fp8",)  # quantization_config methods the family runs

    def __init__(self, hf_config: Any):
        check_quant_method(hf_config, self.quant_methods, type(self).__name__)
        super().__init__()
        hf = self.hf_config = hf_config
        self.config = ModelConfig.from_hf(hf)
        self.norm_kw = {"eps": hf.rms_norm_eps, **self.norm_kwargs}
        self._ropes: dict[str, RotaryEmbedding] = {}
        layers = [self.build_layer(i) for i in range(hf.num_hidden_layers)]
        embed = VocabEmbedding(hf.vocab_size, hf.hidden_size, self.embed_scale())
        self.model = self.build_stack(embed, layers, RMSNorm(hf.hidden_size, **self.norm_kw))
        tied = bool(getattr(hf, "tie_word_embeddings", False))
        softcap = getattr(hf, "final_logit_softcapping", None)
        self.lm_head = LMHead(hf.vocab_size, hf.hidden_size, tied, softcap)
        # Block-FP8 checkpoints (or --quantization fp8): the projections and experts they cover, e4m3.
        self.fp8 = apply_fp8(self, hf, self.map_weight_name, hf_module_names)
        # layer id -> (k_scale, v_scale): the checkpoint's FP8 KV-cache scales, if it has them (`models.kv_scales`).
        self.kv_cache_scales: dict[int, tuple[float, float]] = {}

    def _apply(self, fn, recurse: bool = True) -> nn.Module:
        # `model.to(dtype)` casts every parameter: FP8 weights and their scales keep their dtypes, and
        # modules that declare `float32_params` (the MoE routers, whose choices bf16 would flip) get
        # theirs back in float32.
        super()._apply(keep_stored_dtypes(self, fn), recurse)
        for m in self.modules():
            if getattr(m, "float32_params", False) and any(p.dtype != torch.float32 for p in m.parameters()):
                m.float()
        return self

    # ---- hooks for family files -----------------------------------------------------------------

    def embed_scale(self) -> float | None:
        return None

    def build_layer(self, layer_id: int) -> nn.Module:
        return DecoderLayer(self.build_attention(layer_id), self.build_mlp(layer_id), self.hf_config.hidden_size,
                            self.norm_kw, self.sandwich_norms)

    def build_stack(self, embed: VocabEmbedding, layers: list[nn.Module], norm: RMSNorm) -> nn.Module:
        return DecoderStack(embed, layers, norm)

    def layer_type(self, layer_id: int) -> str:
        return SLIDING if self.config.is_sliding(layer_id) else FULL

    def head_dim(self, layer_id: int) -> int:
        return layer_attention_shape(self.hf_config, layer_id, self.layer_type(layer_id))[0]

    def rotary(self, layer_id: int) -> RotaryEmbedding:
        # One module per layer type: Gemma 3 gives each type its own base; others share one dict.
        kind = self.layer_type(layer_id)
        if kind not in self._ropes:
            self._ropes[kind] = rope_from_config(self.hf_config, self.head_dim(layer_id), kind)
        return self._ropes[kind]

    def attention_kwargs(self, layer_id: int) -> dict[str, Any]:
        hf = self.hf_config
        bias = bool(getattr(hf, "attention_bias", False))
        head_dim, kv_heads = layer_attention_shape(hf, layer_id, self.layer_type(layer_id))
        return {
            "layer_id": layer_id,
            "hidden_size": hf.hidden_size,
            "num_heads": hf.num_attention_heads,
            "num_kv_heads": kv_heads,
            "head_dim": head_dim,
            "rotary": self.rotary(layer_id),
            "scaling": head_dim**-0.5,
            "sliding_window": self.config.sliding_window if self.config.is_sliding(layer_id) else None,
            "qkv_bias": bias,
            "o_bias": bias,
        }

    def build_attention(self, layer_id: int) -> SelfAttention:
        return SelfAttention(**self.attention_kwargs(layer_id))

    def build_mlp(self, layer_id: int) -> nn.Module:
        hf = self.hf_config
        act = getattr(hf, "hidden_activation", None) or hf.hidden_act
        return GatedMLP(hf.hidden_size, hf.intermediate_size, act, bias=bool(getattr(hf, "mlp_bias", False)))

    def map_weight_name(self, name: str) -> str | None:
        """HF checkpoint name -> this module's name; None skips the tensor."""
        if name.endswith("rotary_emb.inv_freq"):
            return None
        if name.startswith("lm_head.") and self.lm_head.tied:
            return None  # some tied checkpoints store a copy of the embedding
        return name

    # ---- the engine interface -------------------------------------------------------------------

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        return self.model(batch)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """`[n, hidden]` -> `[n, vocab]` float32 logits (into `out` when given)."""
        return self.lm_head(hidden, self.model.embed_tokens, out)

    def greedy_tokens(self, hidden: torch.Tensor,
                      allowed: tuple[torch.Tensor, torch.Tensor | None] | None = None) -> torch.Tensor:
        """`[n, hidden]` -> `[n]` int64: `compute_logits(hidden).argmax(-1)`, without the logits on a GPU;
        `allowed`: structured outputs' masks (`LMHead.greedy`)."""
        return self.lm_head.greedy(hidden, self.model.embed_tokens, allowed)

    def sample_tokens(
        self, hidden: torch.Tensor, inv_temperature: torch.Tensor, seeds: torch.Tensor,
        allowed: tuple[torch.Tensor, torch.Tensor | None] | None = None,
    ) -> torch.Tensor:
        """`[n, hidden]` -> `[n]` int64 on CUDA: temperature sampling (greedy where `inv_temperature`
        is 0) without the logits; `allowed`: structured outputs' masks. See `LMHead.sample`."""
        return self.lm_head.sample(hidden, self.model.embed_tokens, inv_temperature, seeds, allowed)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        named = NamedWeights(self)
        kv_scales: dict[int, dict[str, float]] = {}
        for name, tensor in weights:
            target = self.map_weight_name(name)
            if target is not None and not take_kv_scale(kv_scales, target, tensor):
                self.load_one(named, name, target, tensor)
        named.finish()
        self.kv_cache_scales = layer_kv_scales(kv_scales)

    def load_one(self, named: NamedWeights, name: str, target: str, tensor: torch.Tensor) -> None:
        """One mapped tensor into the model (a family whose checkpoints store experts one by one
        overrides this)."""
        named.load(name, target, tensor)
