"""Rotary position embedding (rotate-half / NeoX layout) with HF's frequency schemes: default,
linear, llama3, YaRN and proportional (Gemma 4), read from a transformers config's `rope_parameters`
(per layer type if nested), over the whole head or its leading `partial_rotary_factor` part (MiMo-V2).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """Rotates q and k by position. Holds no parameters: `inv_freq` is a float32 CPU tensor computed
    at construction (explicitly on the CPU, so meta-device model init does not erase it), moved to
    the positions' device on first use. cos/sin are computed in float32 and cast to the q/k dtype
    before the rotation, as HF does.

    Partial rotary (HF `partial_rotary_factor`): the tables cover `rotary_dim = 2 * len(inv_freq)`
    channels; a head wider than that rotates its first `rotary_dim` channels (rotate-half within
    them) and passes the rest through.
    """

    def __init__(self, inv_freq: torch.Tensor, attention_scaling: float = 1.0):
        super().__init__()
        self.inv_freq = inv_freq.float().cpu()  # [rotary_dim / 2] float32, cpu
        self.rotary_dim = 2 * inv_freq.numel()
        self.attention_scaling = attention_scaling  # YaRN scales cos/sin (both q and k)
        self._on_device: dict[torch.device, torch.Tensor] = {}

    def cos_sin(self, positions: torch.Tensor, cache: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`[num_tokens, head_dim / 2]` float32 tables, computed once per forward: `cache` is the
        batch's per-forward scratch dict, so layers sharing this module share the tables and nothing
        outlives the step (a graph capture records the computation itself)."""
        hit = cache.get(id(self)) if cache is not None else None
        if hit is not None:
            return hit
        inv_freq = self._on_device.get(positions.device)
        if inv_freq is None:
            inv_freq = self._on_device.setdefault(positions.device, self.inv_freq.to(positions.device))
        freqs = positions.float()[:, None] * inv_freq[None, :]  # [num_tokens, head_dim / 2] float32
        tables = (freqs.cos() * self.attention_scaling, freqs.sin() * self.attention_scaling)
        if cache is not None:
            cache[id(self)] = tables
        return tables

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens] int64
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor | None,  # [num_tokens, num_kv_heads, head_dim]; None: a KV-shared layer (q only)
        cache: dict | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        cos, sin = self.cos_sin(positions, cache)
        r = self.rotary_dim
        if q.is_cuda:  # one fused launch, in place (on the leading r channels' views when partial)
            from swaserve.kernels.rotary import apply_rotary_

            apply_rotary_(q[..., :r], k[..., :r] if k is not None else q[:, :0, :r], cos, sin)
            return q, k
        cos, sin = cos[:, None, :], sin[:, None, :]
        q = _rotate_leading(q, cos.to(q.dtype), sin.to(q.dtype), r)
        return q, (_rotate_leading(k, cos.to(k.dtype), sin.to(k.dtype), r) if k is not None else None)

    def extra_repr(self) -> str:
        return f"dim={self.rotary_dim}, attention_scaling={self.attention_scaling}"


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # Pairs (i, i + d/2) rotate together: [x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin].
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _rotate_leading(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    if x.shape[-1] == rotary_dim:
        return _rotate(x, cos, sin)
    return torch.cat((_rotate(x[..., :rotary_dim], cos, sin), x[..., rotary_dim:]), dim=-1)


def rope_parameters(hf: Any, layer_type: str | None = None) -> dict[str, Any]:
    """The RoPE dict for `layer_type` (Gemma 3 nests one per layer type), with legacy fallbacks."""
    params = getattr(hf, "rope_parameters", None)
    if params is None:  # configs that predate `rope_parameters`
        params = dict(getattr(hf, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf, "rope_theta", 10000.0))
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params = params[layer_type]
    return dict(params)


def rope_from_config(hf: Any, head_dim: int, layer_type: str | None = None,
                     default_partial: float = 1.0) -> RotaryEmbedding:
    """Build the rotary embedding HF would use for a layer of `layer_type`. A `partial_rotary_factor`
    (`default_partial` where the config names none: MiMo-V2's transformers model assumes 0.334)
    rotates the first `int(head_dim * factor)` channels, frequencies spread over those only, as HF's
    rope initialisers compute them."""
    p = rope_parameters(hf, layer_type)
    rope_type = p.get("rope_type", p.get("type", "default"))
    base = float(p["rope_theta"])
    if rope_type == "proportional":
        return RotaryEmbedding(_proportional(p, base, head_dim))
    partial = p.get("partial_rotary_factor", default_partial)
    dim = int(head_dim * partial)
    if not 0 < dim <= head_dim:
        raise ValueError(f"partial_rotary_factor {partial} leaves no rotary channels of head_dim {head_dim}")
    exponent = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim  # [dim / 2]
    inv_freq = 1.0 / (base**exponent)
    if rope_type == "default":
        return RotaryEmbedding(inv_freq)
    if rope_type == "linear":
        return RotaryEmbedding(inv_freq / p["factor"])
    if rope_type == "llama3":
        return RotaryEmbedding(_llama3(inv_freq, p))
    if rope_type == "yarn":
        return _yarn(hf, p, base, dim)
    raise ValueError(f"unsupported rope_type {rope_type!r}; supported: default, linear, llama3, yarn, proportional")


def _proportional(p: dict[str, Any], base: float, head_dim: int) -> torch.Tensor:
    # Gemma 4's full layers: the first `partial_rotary_factor` of the rotate-half pairs rotate with
    # exponents over the whole head dim; the rest get frequency 0 (cos 1, sin 0: left as they are).
    angles = int(p.get("partial_rotary_factor", 1.0) * head_dim // 2)
    exponent = torch.arange(0, 2 * angles, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = torch.zeros(head_dim // 2, device="cpu")
    inv_freq[:angles] = 1.0 / (base**exponent)
    return inv_freq / p.get("factor", 1.0)


def _llama3(inv_freq: torch.Tensor, p: dict[str, Any]) -> torch.Tensor:
    # Long wavelengths (beyond the original context / low_freq_factor) are slowed by `factor`, short
    # ones kept; in between, a smooth blend.
    factor, lo, hi = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_ctx = p["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_ctx / lo, old_ctx / hi
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(hf: Any, p: dict[str, Any], base: float, dim: int) -> RotaryEmbedding:
    # YaRN: interpolate (divide by `factor`) the low-frequency dims, extrapolate the high ones, blend
    # linearly in between; cos/sin are scaled by the attention factor (0.1 ln(factor) + 1).
    orig_ctx = p["original_max_position_embeddings"]
    factor = p.get("factor") or hf.max_position_embeddings / orig_ctx

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn_factor = p.get("attention_factor")
    if attn_factor is None:
        m, m_all = p.get("mscale"), p.get("mscale_all_dim")
        attn_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig_ctx / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, device="cpu").float() / dim)
    extrapolate = 1 - ramp  # weight of the unscaled frequency
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return RotaryEmbedding(inv_freq, float(attn_factor))
