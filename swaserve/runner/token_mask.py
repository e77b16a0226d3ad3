"""Allowed-token bitmasks applied to a step's logits on the device (structured outputs): a masked token's
logit becomes -inf before penalties, temperature and truncation, so no sampling path can pick it."""

from __future__ import annotations

import torch

_BITS: dict[torch.device, torch.Tensor] = {}


def _bits(device: torch.device) -> torch.Tensor:
    bits = _BITS.get(device)
    if bits is None:  # [32] int32: 1 << b (bit 31 is the sign bit: -2**31 in int32, still one bit)
        bits = torch.tensor([1 << b if b < 31 else -(1 << 31) for b in range(32)], dtype=torch.int32, device=device)
        _BITS[device] = bits
    return bits


def allowed_tokens(masks: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """`[n, words]` int32 bitmasks -> `[n, vocab_size]` bool: token t allowed iff bit t % 32 of word t // 32."""
    words = masks.shape[1]
    assert words * 32 >= vocab_size, (masks.shape, vocab_size)
    expanded = (masks.unsqueeze(-1) & _bits(masks.device)) != 0  # [n, words, 32] bool
    return expanded.reshape(masks.shape[0], words * 32)[:, :vocab_size]


@torch.inference_mode()  # the logits are inference tensors: updated in place only under it
def apply_token_bitmask(logits: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """Set the logits of tokens a row's mask disallows to -inf, in place; `logits` `[n, vocab]` float32
    and `masks` `[n, words]` int32 on the same device, one row per sampled row (a row whose mask is all
    ones is unchanged). Runs on the live rows after a graph replay, never inside a captured graph."""
    assert logits.shape[0] == masks.shape[0], (logits.shape, masks.shape)
    return logits.masked_fill_(~allowed_tokens(masks, logits.shape[1]), float("-inf"))
