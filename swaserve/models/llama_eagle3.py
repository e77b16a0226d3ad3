"""Eagle3Head: the EAGLE-3 draft head of the published HF checkpoints (`LlamaForCausalLMEagle3`): `fc`
projects three target layers' states to the head's width, one Llama decoder layer (`midlayer`) reads the
token embedding and that state side by side (q/k/v over 2 x hidden), and its own LM head predicts over a
draft vocabulary that `d2t` maps to target ids."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from swaserve.layers.attention import SelfAttention
from swaserve.layers.embedding import LMHead, VocabEmbedding
from swaserve.layers.linear import MergedLinear
from swaserve.layers.mlp import GatedMLP
from swaserve.layers.norm import RMSNorm
from swaserve.layers.rotary import rope_from_config
from swaserve.model_config import FULL, layer_attention_shape
from swaserve.models.named_weights import NamedWeights

if TYPE_CHECKING:
    from swaserve.runner.forward_batch import ForwardBatch

EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3",)
# What a draft forward reads from `batch.scratch`: the target's concatenated layer states `[T, 3 * target
# hidden]` (projected by fc), or the head's own pre-norm output of the previous draft step `[T, hidden]`.
AUX_INPUT, HIDDEN_INPUT = "eagle3_aux", "eagle3_hidden"
PRENORM = "eagle3_prenorm"  # written: `[T, hidden]` midlayer output before the final norm


class Eagle3MidLayer(nn.Module):
    """`h = attn(cat(input_layernorm(embed), hidden_norm(g))) + g; out = mlp(post_attention_layernorm(h)) + h`.
    HF names: input_layernorm, hidden_norm, self_attn.{q,k,v,o}_proj, post_attention_layernorm, mlp.*."""

    def __init__(self, hf: Any):
        super().__init__()
        H, eps = hf.hidden_size, hf.rms_norm_eps
        head_dim, kv_heads = layer_attention_shape(hf, 0, FULL)
        bias = bool(getattr(hf, "attention_bias", False))
        self.self_attn = SelfAttention(layer_id=0, hidden_size=H, num_heads=hf.num_attention_heads,
                                       num_kv_heads=kv_heads, head_dim=head_dim,
                                       rotary=rope_from_config(hf, head_dim, FULL), scaling=head_dim**-0.5,
                                       qkv_bias=bias, o_bias=bias)
        qkv = self.self_attn.qkv_proj  # its input is the embedding and the state side by side
        self.self_attn.qkv_proj = MergedLinear(2 * H, qkv.out_sizes, bias, qkv.shards)
        act = getattr(hf, "hidden_activation", None) or hf.hidden_act
        self.mlp = GatedMLP(H, hf.intermediate_size, act, bias=bool(getattr(hf, "mlp_bias", False)))
        self.input_layernorm = RMSNorm(H, eps)
        self.hidden_norm = RMSNorm(H, eps)
        self.post_attention_layernorm = RMSNorm(H, eps)

    def forward(self, embeds: torch.Tensor, g: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(g)], dim=-1)
        h = self.self_attn(x, batch) + g
        return self.mlp(self.post_attention_layernorm(h)) + h


class Eagle3Head(nn.Module):
    """The engine's model interface (`forward`, `compute_logits`, `greedy_tokens`, `sample_tokens`)
    over a draft forward. `forward(batch)` reads its state input from `batch.scratch` (AUX_INPUT or
    HIDDEN_INPUT; neither: zeros, the runner's warm-up, as are the embeddings before the drafter
    shares the target's), writes PRENORM there and returns the normed states; the token functions return target ids (`d2t`). `embed_tokens` is the checkpoint's or,
    when it has none, set by the drafter to share the target's table (unscaled)."""

    def __init__(self, hf: Any, target_hidden: int, has_embed: bool):
        super().__init__()
        self.hf_config = hf
        H = self.hidden_size = hf.hidden_size
        self.fc = nn.Linear(3 * target_hidden, H, bias=bool(getattr(hf, "bias", False)))
        self.midlayer = Eagle3MidLayer(hf)
        self.norm = RMSNorm(H, hf.rms_norm_eps)
        self.draft_vocab = int(getattr(hf, "draft_vocab_size", None) or hf.vocab_size)
        self.lm_head = LMHead(self.draft_vocab, H, tied=False)
        self.embed_tokens: VocabEmbedding | None = VocabEmbedding(hf.vocab_size, H) if has_embed else None
        # [draft_vocab] int64: target id = draft id + d2t[draft id]; required when the draft vocabulary
        # is smaller than the target's, else zeros (identity) unless the checkpoint has one.
        self.register_buffer("d2t", torch.zeros(self.draft_vocab, dtype=torch.int64))
        self.needs_d2t = self.draft_vocab != hf.vocab_size

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        if AUX_INPUT in batch.scratch:
            g = self.fc(batch.scratch[AUX_INPUT])
        else:  # zeros: the runner's warm-up, which may run before the drafter shares the embedding
            g = batch.scratch.get(HIDDEN_INPUT)
            g = self.fc.weight.new_zeros(batch.input_ids.shape[0], self.hidden_size) if g is None else g
        embeds = self.embed_tokens(batch.input_ids) if self.embed_tokens is not None else torch.zeros_like(g)
        out = self.midlayer(embeds, g, batch)
        batch.scratch[PRENORM] = out
        return self.norm(out)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """`[n, hidden]` -> `[n, draft_vocab]` float32 logits over the draft vocabulary."""
        return self.lm_head(hidden, self.embed_tokens, out)  # type: ignore[arg-type]

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def greedy_tokens(self, hidden: torch.Tensor, allowed: tuple | None = None) -> torch.Tensor:
        """`[n, hidden]` -> `[n]` int64 target ids of the draft vocabulary's argmax (`allowed`: masks over
        the draft vocabulary, `LMHead.greedy`; only the runner's warm-up passes any)."""
        return self.to_target(self.lm_head.greedy(hidden, self.embed_tokens, allowed))  # type: ignore[arg-type]

    def sample_tokens(self, hidden: torch.Tensor, inv_temperature: torch.Tensor, seeds: torch.Tensor,
                      allowed: tuple | None = None) -> torch.Tensor:
        return self.to_target(self.lm_head.sample(hidden, self.embed_tokens, inv_temperature, seeds,  # type: ignore[arg-type]
                                                  allowed))

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """HF names (an optional `model.` prefix is dropped); `t2d` is not needed. Raises ValueError
        on unknown, misshapen or missing weights."""
        named = NamedWeights(self, "EAGLE-3 checkpoint")
        if self.needs_d2t:
            named.expect("d2t")
        self.d2t.zero_()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if name == "t2d" or name.endswith("rotary_emb.inv_freq"):
                continue
            if name == "d2t":
                if tuple(tensor.shape) != tuple(self.d2t.shape):
                    raise ValueError(f"d2t: expected {self.draft_vocab} entries (draft_vocab_size), got "
                                     f"{tuple(tensor.shape)}")
                self.d2t.copy_(tensor)
                named.mark("d2t")
                continue
            named.load(name, name, tensor)
        named.finish()
