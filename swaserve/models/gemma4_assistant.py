"""Gemma 4's assistant drafter (transformers `gemma4_assistant`): a Gemma 4 text stack whose every layer
reads the K/V the target cached for its last full-attention and last sliding layer and stores none. Its
input is `pre_projection([target embedding of a token, a target-width hidden state])`; each step gives
the next such hidden state, `post_projection(h)`, and a draft token (LM head, or the centroid-masked head).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from swaserve.layers.attention import SelfAttention
from swaserve.layers.embedding import LMHead, VocabEmbedding
from swaserve.layers.mlp import GatedMLP
from swaserve.layers.norm import RMSNorm
from swaserve.layers.rotary import RotaryEmbedding, rope_from_config
from swaserve.model_config import FULL, SLIDING, ModelConfig, layer_attention_shape
from swaserve.models.gemma4 import Gemma4DecoderLayer
from swaserve.models.named_weights import NamedWeights

if TYPE_CHECKING:
    from swaserve.runner.forward_batch import ForwardBatch


class CentroidHead(nn.Module):
    """HF's `masked_embedding` (`use_ordered_embeddings`): the hidden state picks its `top_k` best
    centroids, and only the tokens of those clusters (`token_ordering` viewed `[centroids, vocab /
    centroids]`) get logits; every other token is below all of them, so the greedy token is the best
    of the candidates."""

    def __init__(self, hidden_size: int, vocab_size: int, num_centroids: int, top_k: int):
        super().__init__()
        if vocab_size % num_centroids:
            raise ValueError(f"num_centroids {num_centroids} does not divide the vocabulary ({vocab_size})")
        self.num_centroids, self.top_k = num_centroids, top_k
        self.centroids = nn.Linear(hidden_size, num_centroids, bias=False)
        self.register_buffer("token_ordering", torch.zeros(vocab_size, dtype=torch.int64))  # [vocab] int64

    def greedy(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """`[n, hidden]` and the LM head's `[vocab, hidden]` -> `[n]` int64."""
        top = self.centroids(hidden).topk(self.top_k, dim=-1).indices  # [n, top_k]
        clusters = self.token_ordering.view(self.num_centroids, -1)
        cand = clusters[top].flatten(1)  # [n, top_k * tokens per centroid]
        logits = torch.einsum("nh,nch->nc", hidden, weight[cand])
        return cand.gather(1, logits.argmax(dim=-1, keepdim=True)).squeeze(1)


class Gemma4Assistant(nn.Module):
    """HF names: pre_projection, post_projection, model.{embed_tokens, layers, norm}, lm_head (absent
    when tied), masked_embedding. Layer i's attention is built with the layer id of the target layer
    whose K/V it reads (`sources`), so the backend finds that layer's buffers (the SWA pool for a
    sliding one) and, as a KV-shared layer, never stores. Sliding layers see `sliding_window + 1`
    keys: HF's assistant masks with a bidirectional window of distance <= W over the keys before the
    query, which keeps the last W + 1 of them.
    """

    def __init__(self, hf: Any, target: ModelConfig):
        super().__init__()
        tc = check_assistant(hf, target)
        self.hf_config = hf
        H, B = tc.hidden_size, hf.backbone_hidden_size
        norm = {"eps": tc.rms_norm_eps, "fp32_weight": True}
        self.sources = {FULL: max(target.full_group.layer_ids, default=None),
                        SLIDING: max(target.swa_group.layer_ids, default=None)}
        self.window = int(tc.sliding_window) + 1 if SLIDING in tc.layer_types else None
        ropes: dict[str, RotaryEmbedding] = {}
        layers = []
        for i, kind in enumerate(tc.layer_types[: tc.num_hidden_layers]):
            head_dim, kv_heads = layer_attention_shape(tc, i, kind)
            rope = ropes.setdefault(kind, rope_from_config(tc, head_dim, kind))
            attn = SelfAttention(layer_id=self.sources[kind], hidden_size=H, num_heads=tc.num_attention_heads,
                                 num_kv_heads=kv_heads, head_dim=head_dim, rotary=rope, scaling=1.0,
                                 sliding_window=self.window if kind == SLIDING else None,
                                 qk_norm={"eps": tc.rms_norm_eps, "fp32_weight": True}, kv_shared=True)
            mlp = GatedMLP(H, tc.intermediate_size, tc.hidden_activation)
            layers.append(Gemma4DecoderLayer(tc, attn, mlp, norm, moe=False))
        self.model = AssistantStack(VocabEmbedding(tc.vocab_size, H), layers, RMSNorm(H, **norm))
        self.pre_projection = nn.Linear(2 * B, H, bias=False)
        self.post_projection = nn.Linear(H, B, bias=False)
        self.lm_head = LMHead(tc.vocab_size, H, tied=bool(getattr(hf, "tie_word_embeddings", True)))
        self.masked_embedding = None
        if hf.use_ordered_embeddings:
            top_k = hf.centroid_intermediate_top_k
            self.masked_embedding = CentroidHead(H, tc.vocab_size, hf.num_centroids, top_k)

    def forward(self, inputs: torch.Tensor, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """`inputs` `[bs, 2 * backbone_hidden]` (a token's target embedding, then a target-width hidden
        state) -> (the next target-width hidden state `[bs, backbone_hidden]`, the greedy token `[bs]`)."""
        x = self.model(self.pre_projection(inputs), batch)
        if self.masked_embedding is not None:
            weight = self.model.embed_tokens.weight if self.lm_head.tied else self.lm_head.weight
            token = self.masked_embedding.greedy(x, weight)
        else:
            token = self.lm_head.greedy(x, self.model.embed_tokens)
        return self.post_projection(x), token

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """HF (name, tensor) pairs; ValueError on unknown, misshapen or missing weights."""
        named = NamedWeights(self, "assistant checkpoint", buffers=True)
        for name, tensor in weights:
            if not (name.startswith("lm_head.") and self.lm_head.tied):
                named.load(name, name, tensor)
        named.finish()


class AssistantStack(nn.Module):
    """HF's `model.`: the layers over given input states (no token lookup: `embed_tokens` only feeds a
    tied LM head), then the final norm."""

    def __init__(self, embed: VocabEmbedding, layers: list[Gemma4DecoderLayer], norm: RMSNorm):
        super().__init__()
        self.embed_tokens = embed
        self.layers = nn.ModuleList(layers)
        self.norm = norm

    def forward(self, h: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        x = self.layers[0].input_layernorm(h)
        for i, layer in enumerate(self.layers):
            nxt = self.layers[i + 1].input_layernorm if i + 1 < len(self.layers) else self.norm
            h, x = layer(h, x, batch, nxt, None)
        return x


def check_assistant(hf: Any, target: ModelConfig) -> Any:
    """The assistant's text config, after checking that it drafts for `target`: ValueError where the
    checkpoint is not a Gemma 4 assistant, the target not a Gemma 4 text model, or their widths,
    vocabularies or per-layer-type K/V shapes differ."""
    if getattr(hf, "model_type", None) != "gemma4_assistant":
        raise ValueError(f"speculative_method 'mtp' needs a gemma4_assistant checkpoint, got model_type "
                         f"{getattr(hf, 'model_type', None)!r}")
    thf = target.hf_config
    if getattr(thf, "model_type", None) not in ("gemma4_text", "gemma4"):
        raise ValueError("the Gemma 4 assistant drafts for a Gemma 4 target, not "
                         f"{getattr(thf, 'model_type', None)!r}")
    tc = hf.get_text_config()
    if hf.backbone_hidden_size != thf.hidden_size:
        raise ValueError(f"the assistant was trained for a target of hidden size {hf.backbone_hidden_size}, "
                         f"this target has {thf.hidden_size}")
    if tc.vocab_size != target.vocab_size:
        raise ValueError(f"the assistant's vocabulary ({tc.vocab_size}) differs from the target's "
                         f"({target.vocab_size})")
    if (tc.hidden_size_per_layer_input or tc.enable_moe_block or tc.use_double_wide_mlp
            or tc.num_kv_shared_layers != tc.num_hidden_layers):
        raise ValueError("a Gemma 4 assistant has no per-layer inputs, MoE or double-wide MLPs, and every "
                         "layer KV-shared")
    groups = {FULL: target.full_group, SLIDING: target.swa_group}
    for i, kind in enumerate(tc.layer_types[: tc.num_hidden_layers]):
        group = groups.get(kind)
        if group is None or not group.layer_ids:
            raise ValueError(f"assistant layer {i} ({kind}) has no {kind} layer of the target to read")
        head_dim, kv_heads = layer_attention_shape(tc, i, kind)
        if (kv_heads, head_dim, head_dim) != (group.num_kv_heads, group.k_head_dim, group.v_head_dim):
            raise ValueError(f"assistant layer {i} ({kind}) expects K/V of {kv_heads} heads x {head_dim}, "
                             f"the target caches {group.num_kv_heads} x {group.k_head_dim} (K) / "
                             f"{group.v_head_dim} (V)")
    return tc
