"""MiMoMTPHead: one of MiMo-V2-Flash's multi-token-prediction layers (`model.mtp.layers.{i}.*` in the
target's own checkpoint). `h = eh_proj(cat(enorm(embed(token t + 1)), hnorm(state t)))`, then one
pre-norm decoder block shaped like the target's sliding layers (their K/V heads, widths, learned sinks,
V scale and rope θ; a dense MLP of `intermediate_size`), then `final_layernorm`; the token embedding
and LM head are the target's (shared by the drafter, `share_target`). Block-FP8 checkpoints: the block's
projections are FP8 as the checkpoint stores them (`head_config`); each tensor is loaded in the form the
head keeps (`MiMoMTPHead.load_weights`)."""

from __future__ import annotations

import copy
import re
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from swaserve.layers import fp8
from swaserve.layers.norm import RMSNorm
from swaserve.model_config import SLIDING
from swaserve.models.named_weights import STACKED_PARAMS, NamedWeights
from swaserve.models.quantization import keep_stored_dtypes

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
# The block's projections (checkpoint names after `model.mtp.layers.{i}.`), by the GEMM that runs them.
_GEMMS = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("self_attn.o_proj",),
          ("mlp.gate_proj", "mlp.up_proj"), ("mlp.down_proj",))
_SCALE = "weight_scale_inv"


def head_config(target_hf: Any, stored: Mapping[str, torch.dtype] | None = None, index: int = 0) -> Any:
    """The target's config reduced to the MTP layer: one sliding-attention layer with a dense MLP. For a
    block-FP8 target, a quantization_config naming the block's unquantised projections: `stored` (the
    layer's checkpoint dtypes by name after `model.mtp.layers.{index}.`; None for dummy weights) decides
    for an offline FP8 checkpoint, the config's ignore list (read for the MTP layer's own names) for
    dummy weights and online FP8."""
    hf = copy.deepcopy(target_hf)
    hf.num_hidden_layers = 1
    hf.layer_types = [SLIDING]
    hf.mlp_layer_types = ["dense"]
    cfg = fp8.fp8_config(target_hf)
    if cfg is not None:
        hf.quantization_config = _head_fp8_config(cfg, stored, index)
    return hf


def _head_fp8_config(cfg: fp8.Fp8Config, stored: Mapping[str, torch.dtype] | None, index: int) -> dict:
    """The target's ignore list is written for `model.layers.*`, and MTP projections may be stored either
    way, so the head's list is made afresh, in the skeleton's names (`model.layers.0.*`). A merged GEMM is
    FP8 when any of its parts is stored FP8 (the others are quantised at load)."""

    def is_fp8(rest: str) -> bool:
        if stored is not None and not cfg.online:
            return stored.get(f"{rest}.weight") == fp8.FP8
        return cfg.quantizes(f"model.mtp.layers.{index}.{rest}")

    kept = [f"model.layers.0.{rest}" for gemm in _GEMMS if not any(map(is_fp8, gemm)) for rest in gemm]
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": [fp8.BLOCK, fp8.BLOCK], "ignored_layers": kept, fp8.ONLINE_KEY: cfg.online}


class MiMoMTPHead(nn.Module):
    """The engine's model interface over a draft forward. `forward(batch)` reads the hidden input from
    `batch.scratch[HIDDEN_INPUT]` (absent: zeros, as are the embeddings before `share_target`; a
    warm-up) and returns the `final_layernorm`-ed states, which both pick the draft token and feed the
    next chained step. Build it under `torch.device("meta")`: the decoder block comes from a one-layer
    `MiMoV2FlashForCausalLM` whose vocabulary-sized tensors stay on the meta device. With a block-FP8
    `hf` (`head_config`) the skeleton's constructor makes the projections it covers FP8; `eh_proj` stays
    an unquantised `nn.Linear`."""

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

    def _apply(self, fn, recurse: bool = True) -> nn.Module:
        return super()._apply(keep_stored_dtypes(self, fn), recurse)  # `.to(bf16)` keeps e4m3 and scales

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

    def greedy_tokens(self, hidden: torch.Tensor, allowed: tuple | None = None) -> torch.Tensor:
        assert self.lm_head is not None, "share_target() first"
        return self.lm_head.greedy(hidden, self.embed_tokens, allowed)  # type: ignore[arg-type]

    def sample_tokens(self, hidden: torch.Tensor, inv_temperature: torch.Tensor, seeds: torch.Tensor,
                      allowed: tuple | None = None) -> torch.Tensor:
        assert self.lm_head is not None, "share_target() first"
        return self.lm_head.sample(hidden, self.embed_tokens, inv_temperature, seeds, allowed)  # type: ignore[arg-type]

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], index: int = 0) -> None:
        """The tensors of `model.mtp.layers.{index}.*` (others are skipped). A weight stored FP8 (`weight`
        e4m3 + `weight_scale_inv`) loads as is into a projection the head keeps FP8 and dequantised into
        one it keeps unquantised (`eh_proj`); an unquantised weight of an FP8 projection is quantised to
        128 x 128 blocks. Raises ValueError on unknown, misshapen or missing weights."""
        named = NamedWeights(self, f"MTP layer {index}")
        layer: dict[str, tuple[str, torch.Tensor]] = {}
        for name, tensor in weights:
            m = MTP_LAYER.match(name)
            if m is not None and int(m.group(1)) == index:
                layer[m.group(2)] = (name, tensor)
        for rest, (name, tensor) in layer.items():
            if rest.endswith("." + _SCALE):
                if rest[: -len(_SCALE)] + "weight" not in layer:
                    raise ValueError(f"{name!r}: an FP8 scale without its weight in MTP layer {index}")
                continue  # loads with its weight
            for part, t in self._as_kept(rest, name, tensor, layer):
                named.load(name, _local_name(part), t)
        named.finish()

    def _as_kept(self, rest: str, name: str, tensor: torch.Tensor, layer: dict[str, tuple[str, torch.Tensor]]
                 ) -> list[tuple[str, torch.Tensor]]:
        """Checkpoint tensor `rest` (+ its scale) as (name, tensor) pairs in the form the head keeps."""
        param = self._param(_local_name(rest))
        if not rest.endswith(".weight") or param is None:
            return [(rest, tensor)]  # norms, sinks; anything unknown is refused by name when it loads
        scale_name = rest[: -len("weight")] + _SCALE
        scale = layer.get(scale_name, (None, None))[1]
        keeps_fp8 = param.dtype == fp8.FP8
        if tensor.dtype == fp8.FP8:
            if scale is None:
                raise ValueError(f"{name!r} is stored as FP8 without its {_SCALE}")
            if keeps_fp8:
                return [(rest, tensor), (scale_name, scale)]
            try:
                return [(rest, fp8.dequantize(tensor, scale, param.dtype))]
            except ValueError as e:
                raise ValueError(f"{name!r}: {e}") from None
        if scale is not None:
            raise ValueError(f"{name!r} is stored as {tensor.dtype} but has a {_SCALE} (FP8 weights are e4m3)")
        if keeps_fp8:
            q, s = fp8.quantize(tensor)
            return [(rest, q), (scale_name, s)]
        return [(rest, tensor)]

    def _param(self, target: str) -> torch.Tensor | None:
        """The parameter `target` (this module's name of a checkpoint tensor) loads into: q/k/v and
        gate/up into their merged weight."""
        params = dict(self.named_parameters())
        for src, dst, _ in STACKED_PARAMS:
            merged = target.replace(src, dst)
            if src in target and merged in params:
                return params[merged]
        return params.get(target)


def _local_name(rest: str) -> str:
    rest = rest.replace("self_attn.attention_sink_bias", "self_attn.sinks")
    for src, dst in _RENAMES:
        if rest.startswith(src):
            return dst + rest[len(src):]
    return rest
