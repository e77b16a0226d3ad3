"""Prompt helpers for the engine tests."""

from __future__ import annotations


def prompt_of(long_ids: list[int], n: int, shift: int = 0) -> list[int]:
    """An n-token prompt: BOS, then prose starting `shift` tokens in (distinct prompts per shift)."""
    return [long_ids[0]] + long_ids[1 + shift : n + shift]
