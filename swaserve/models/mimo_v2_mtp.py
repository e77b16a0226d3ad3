"""MiMoMTPHead: one of MiMo-V2-Flash's multi-token-prediction layers (`model.mtp.layers.{i}.*` in the
target's own checkpoint). `h = eh_proj(cat(enorm(embed(token t + 1)), hnorm(state t)))`, then one
pre-norm decoder block shaped like the target's sliding layers (their K/V heads, widths, learned sinks,
V scale and rope θ; a dense MLP of `intermediate_size`), then `final_layernorm`; the token embedding
and LM head are the target's (shared by the drafter, `share_target`)."""

from __future__ import annotations

import copy
import re
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from swaserve.config import SLIDING
from swaserve.layers.norm import RMSNorm
from swaserve.models.base import NamedWeights

if TYPE_CHECKING:
    from swaserve.layers.embedding import LMHead, VocabEmbedding
    from swaserve.runner.forward_batch import ForwardBatch

MTP_LAYER = re.compile(r"^model\.mtp\.layers\.(\d+)\.(.+)$")
# What a draft forward reads from `batch.scratch`: `[T, hidden]` the state standing beside each input
# token (the target's final, normed state, or the head's own output of the previous draft step).
HIDDEN_INPUT = "mimo_mtp_hidden"
# Checkpoint name (after `model.mtp.layers.{i}.`) -> this module's, where they differ.
_RENAMES = (("pre_mlp_layernorm.", "layer.post_attention_layernorm."),
            ("input_layernorm.", "layer.input_layernorm."), ("self_attn.", "layer.self_attn."),
            ("mlp.", "layer.mlp."))


def head_config(target_hf: Any) -> Any:
    """The target's config reduced to the MTP layer: one sliding-attention layer with a dense MLP."""
    hf = copy.deepcopy(target_hf)
    hf.num_hidden_layers = 1
    hf.layer_types = [SLIDING]
    hf.mlp_layer_types = ["dense"]
    return hf


class MiMoMTPHead(nn.Module):
    """The engine's model interface over a draft forward. `forward(batch)` reads the hidden input from
    `batch.scratch[HIDDEN_INPUT]` (absent: zeros, as are the embeddings before `share_target`; a
    warm-up) and returns the `final_layernorm`-ed states, which both pick the draft token and feed the
    next chained step. Build it under `torch.device("meta")`: the decoder block comes from a one-layer
    `MiMoV2FlashForCausalLM` whose vocabulary-sized tensors stay on the meta device."""

    def __init__(self, hf: Any):
        from swaserve.layers.fp8 import fp8_config
        from swaserve.models.mimo_v2_flash import MiMoV2FlashForCausalLM

        if fp8_config(hf) is not None:
            raise ValueError("the MiMo-V2-Flash MTP drafter does not run FP8 weights yet (FP8 checkpoints and "
                             "--quantization fp8 serve without --speculative-method mtp)")
        super().__init__()
        self.hf_config = hf
        skeleton = MiMoV2FlashForCausalLM(hf)  # builds the block the target's own way
        H = self.hidden_size = hf.hidden_size
        self.enorm = RMSNorm(H, **skeleton.norm_kw)
        self.hnorm = RMSNorm(H, **skeleton.norm_kw)
        self.eh_proj = nn.Linear(2 * H, H, bias=False)
        self.layer = skeleton.model.layers[0]
        self.final_layernorm = skeleton.model.norm
        self.embed_tokens: VocabEmbedding | None = None
        self.lm_head: LMHead | None = None

    def share_target(self, embed_tokens: VocabEmbedding, lm_head: LMHead) -> None:
        self.embed_tokens, self.lm_head = embed_tokens, lm_head

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        g = batch.scratch.get(HIDDEN_INPUT)
        if g is None:
            g = self.eh_proj.weight.new_zeros(batch.input_ids.shape[0], self.hidden_size)
        e = self.embed_tokens(batch.input_ids) if self.embed_tokens is not None else torch.zeros_like(g)
        h = self.eh_proj(torch.cat([self.enorm(e), self.hnorm(g)], dim=-1))
        _, out = self.layer(h, self.layer.input_layernorm(h), batch, self.final_layernorm)
        return out

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        assert self.lm_head is not None, "share_target() first"
        return self.lm_head(hidden, self.embed_tokens, out)  # type: ignore[arg-type]

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        assert self.lm_head is not None, "share_target() first"
        return self.lm_head.greedy(hidden, self.embed_tokens)  # type: ignore[arg-type]

    def sample_tokens(self, hidden: torch.Tensor, inv_temperature: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
        assert self.lm_head is not None, "share_target() first"
        return self.lm_head.sample(hidden, self.embed_tokens, inv_temperature, seeds)  # type: ignore[arg-type]

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], index: int = 0) -> None:
        """The tensors of `model.mtp.layers.{index}.*` (others are skipped). Raises ValueError on
        unknown, misshapen or missing weights."""
        named = NamedWeights(self, f"MTP layer {index}")
        for name, tensor in weights:
            m = MTP_LAYER.match(name)
            if m is None or int(m.group(1)) != index:
                continue
            named.load(name, _local_name(m.group(2)), tensor)
        named.finish()


def _local_name(rest: str) -> str:
    rest = rest.replace("self_attn.attention_sink_bias", "self_attn.sinks")
    for src, dst in _RENAMES:
        if rest.startswith(src):
            return dst + rest[len(src):]
    return rest
