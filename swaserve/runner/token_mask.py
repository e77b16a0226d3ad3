"""Allowed-token bitmasks applied to a step's logits on the device (structured outputs): a masked token's
logit becomes -inf before penalties, temperature and truncation, so no sampling path can pick it."""

from __future__ import annotations

import sys

import torch

_BITS: dict[torch.device, torch.Tensor] = {}


def _bits(device: torch.device) -> torch.Tensor:
    bits = _BITS.get(device)
    if bits is None:  # [8] uint8: 1 << b
        bits = torch.tensor([1 << b for b in range(8)], dtype=torch.uint8, device=device)
        _BITS[device] = bits
    return bits


def disallowed_tokens(masks: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """`[n, words]` int32 bitmasks -> `[n, vocab_size]` bool, True where token t is masked: bit t % 32 of
    word t // 32 is clear. Read as bytes (a little-endian word's bit b is bit b % 8 of its byte b // 8, so
    token t is bit t % 8 of byte t // 8): one byte per token in between, not four."""
    assert sys.byteorder == "little"
    n, words = masks.shape
    assert words * 32 >= vocab_size, (masks.shape, vocab_size)
    unpacked = masks.contiguous().view(torch.uint8).unsqueeze(-1) & _bits(masks.device)  # [n, words * 4, 8]
    return unpacked.view(n, words * 32)[:, :vocab_size] == 0


def allowed_tokens(masks: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """`[n, words]` int32 bitmasks -> `[n, vocab_size]` bool: token t allowed iff bit t % 32 of word t // 32."""
    return disallowed_tokens(masks, vocab_size).logical_not_()


@torch.inference_mode()  # the logits are inference tensors: updated in place only under it
def apply_token_bitmask(logits: torch.Tensor, masks: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Set the logits of tokens a row's mask disallows to -inf, in place; `logits` `[n, vocab]` float32
    and `masks` `[m, words]` int32 on the same device: one mask per logits row, or, given `rows` (`[m]`
    int64, ascending), the masks of those rows only (the others are unchanged). Runs on the live rows
    after a graph replay, never inside a captured graph."""
    if rows is None:
        assert logits.shape[0] == masks.shape[0], (logits.shape, masks.shape)
        return logits.masked_fill_(disallowed_tokens(masks, logits.shape[1]), float("-inf"))
    assert rows.shape[0] == masks.shape[0] <= logits.shape[0], (logits.shape, masks.shape, rows.shape)
    picked = logits.index_select(0, rows).masked_fill_(disallowed_tokens(masks, logits.shape[1]), float("-inf"))
    return logits.index_copy_(0, rows, picked)
