"""The prompt's side of a response: echo's prompt tokens in the legacy completions logprobs (the first one's
logprob null, as OpenAI's legacy API wrote it and lm-eval reads it) and vLLM's `prompt_logprobs` field."""

from __future__ import annotations

import math
from typing import Any

from swaserve.server.messages import Update

_MIN_LOGPROB = -9999.0  # JSON has no -inf (as in responses.py)


def _lp(value: float | None) -> float | None:
    if value is None:
        return None
    return value if math.isfinite(value) else _MIN_LOGPROB


def _ranked(entry: dict[int, float], k: int, own: int) -> list[tuple[int, float]]:
    """The `k` most likely entries, plus the prompt's own token where it is not among them."""
    top = sorted(entry.items(), key=lambda kv: kv[1], reverse=True)[:k]
    if own in entry and all(t != own for t, _ in top):
        top.append((own, entry[own]))
    return top


def echo_logprobs(upd: Update, k: int, offset: int) -> tuple[dict[str, list[Any]], int]:
    """Legacy logprobs (tokens, token_logprobs, top_logprobs, text_offset) of the echoed prompt, starting at
    character `offset`; and the offset after it."""
    out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    ids, lps, strs = upd.prompt_ids or [], upd.prompt_logprobs or [], upd.token_strs or {}
    for j, tid in enumerate(ids):
        text = strs.get(tid, "")
        entry = lps[j - 1] if 0 < j <= len(lps) else None
        out["tokens"].append(text)
        out["token_logprobs"].append(None if entry is None else _lp(entry.get(tid)))
        out["top_logprobs"].append(None if entry is None else
                                   {strs.get(t, ""): _lp(v) for t, v in _ranked(entry, k, tid)})
        out["text_offset"].append(offset)
        offset += len(text)
    return out, offset


def prompt_logprobs_field(upd: Update, k: int) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs`: None for the first prompt token, then per token {"token id": {logprob, rank,
    decoded_token}} of the `k` most likely plus the prompt's own token (its true rank; the others 1..k)."""
    strs, prompt_ids = upd.token_strs or {}, upd.prompt_ids or []
    field: list[dict[str, Any] | None] = [None]
    for j, entry in enumerate(upd.prompt_logprobs or []):
        own = prompt_ids[j + 1]
        ranked = _ranked(entry, k, own)
        field.append({
            str(t): {"logprob": _lp(v), "decoded_token": strs.get(t, ""),
                     "rank": (upd.prompt_ranks or [])[j] if t == own else r + 1}
            for r, (t, v) in enumerate(ranked)
        })
    return field
