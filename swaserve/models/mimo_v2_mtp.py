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
from swaserve.layers.linear import MergedLinear
from swaserve.layers.norm import RMSNorm
from swaserve.models.base import STACKED_PARAMS

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
        from swaserve.models.mimo_v2_flash import MiMoV2FlashForCausalLM

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
        params = dict(self.named_parameters())
        merged = {f"{n}.{p}": m for n, m in self.named_modules() if isinstance(m, MergedLinear)
                  for p in ("weight", "bias") if getattr(m, p) is not None}
        expected = {(n, None) for n in params if n not in merged}
        expected |= {(n, i) for n, m in merged.items() for i in range(len(m.out_sizes))}
        loaded: set[tuple[str, int | None]] = set()
        for name, tensor in weights:
            m = MTP_LAYER.match(name)
            if m is None or int(m.group(1)) != index:
                continue
            loaded.add(self._load_one(name, _local_name(m.group(2)), tensor, params, merged))
        missing = sorted(n + ("" if s is None else f"[shard {s}]") for n, s in expected - loaded)
        if missing:
            raise ValueError(f"MTP layer {index} is missing {len(missing)} weights, e.g. {missing[:5]}")

    @staticmethod
    def _load_one(name: str, local: str, tensor: torch.Tensor, params: dict[str, nn.Parameter],
                  merged: dict[str, MergedLinear]) -> tuple[str, int | None]:
        for src, dst, shard in STACKED_PARAMS:
            if src in local:
                pname = local.replace(src, dst)
                if pname not in merged:
                    raise ValueError(f"unknown MTP weight {name!r}")
                merged[pname].load_shard(shard, pname.rsplit(".", 1)[1], tensor)
                return pname, shard
        param = params.get(local)
        if param is None:
            raise ValueError(f"unknown MTP weight {name!r}")
        if tuple(param.shape) != tuple(tensor.shape):
            raise ValueError(f"MTP weight {name!r}: expected shape {tuple(param.shape)}, got {tuple(tensor.shape)}")
        param.data.copy_(tensor)
        return local, None


def _local_name(rest: str) -> str:
    rest = rest.replace("self_attn.attention_sink_bias", "self_attn.sinks")
    for src, dst in _RENAMES:
        if rest.startswith(src):
            return dst + rest[len(src):]
    return rest
