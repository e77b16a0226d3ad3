"""What `Engine.add_request` checks before queueing anything: the prompt (text or token ids) and the
sampling options the model and the parallel setup can serve. ValueError with the reason."""

from __future__ import annotations

from typing import Any

from swaserve.request import SamplingParams


def prompt_ids(prompt: str | list[int], tokenizer: Any, vocab: int) -> tuple[str | None, list[int]]:
    """(the prompt's text or None, its token ids)."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("the prompt is empty")
        if tokenizer is None:
            raise ValueError("this model has no tokenizer: give the prompt as token ids")
        return prompt, tokenizer.encode(prompt)
    if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if not prompt:
            raise ValueError("the prompt is empty")
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, {vocab}), got {bad[:5]}")
        return None, list(prompt)
    raise ValueError("a prompt must be a string or a list of token ids")


def check_options(params: SamplingParams, vocab: int, tensor_parallel: bool) -> None:
    bad = [t for t in params.logit_bias or () if t >= vocab]
    if bad:
        raise ValueError(f"logit_bias token ids must be in [0, {vocab}), got {bad[:5]}")
    if params.prompt_logprobs is not None and tensor_parallel:
        raise ValueError("prompt_logprobs (and echo with logprobs) are not supported with tensor parallelism")
