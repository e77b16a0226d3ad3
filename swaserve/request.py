"""Per-request user-facing types: SamplingParams (validated at the boundary) and the outputs the engine
returns (CompletionOutput, RequestOutput). The scheduler's per-request state class also lives here."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar, overload

from swaserve.structured_outputs import StructuredOutputs

T = TypeVar("T")

FinishReason = Literal["stop", "length"]

# Below this a temperature is treated as greedy: dividing logits by it would overflow float32.
GREEDY_TEMPERATURE_EPS = 1e-5
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100  # OpenAI's range for each bias


def _check_number(name: str, value: Any) -> float:
    # bool is an int subclass; `temperature=True` is a caller bug, not 1.0.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return float(value)


def _check_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    return value


@dataclass
class SamplingParams:
    """How to sample one request's completion(s). Mirrors vLLM's names and defaults.

    Invariants after construction: every field has its declared type (ints are ints, floats are
    floats), values are in range, `stop` is a list of non-empty strings, `stop_token_ids` is a list.
    Invalid input raises ValueError naming the field; it is user input, so this is the boundary.
    """

    temperature: float = 1.0  # 0 (or < GREEDY_TEMPERATURE_EPS) means greedy
    top_p: float = 1.0  # (0, 1]; 1 disables
    top_k: int = -1  # -1 disables, else >= 1
    min_p: float = 0.0  # [0, 1]; keep tokens with p >= min_p * p_max; 0 disables
    max_tokens: int = 16
    stop: str | list[str] | None = None  # normalised to list[str]
    stop_token_ids: list[int] | None = None  # normalised to list[int]
    seed: int | None = None  # same seed -> same tokens, whatever else shares the batch
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; k: the sampled token's logprob plus the top-k
    n: int = 1
    repetition_penalty: float = 1.0  # HF semantics, over prompt + output tokens; 1 disables
    presence_penalty: float = 0.0  # OpenAI semantics, over output tokens
    frequency_penalty: float = 0.0  # OpenAI semantics, over output tokens
    # OpenAI semantics: token id -> a bias in [-100, 100] added to its logit before sampling (greedy too).
    logit_bias: dict[int, float] | None = None
    # vLLM semantics: None, or k: each prompt token's logprob (after the first) plus the top-k at its position.
    prompt_logprobs: int | None = None
    # The output must follow this (JSON schema, regex, choice, grammar); a dict is read as its fields.
    structured_outputs: StructuredOutputs | dict[str, Any] | None = None

    def __post_init__(self) -> None:
        self.temperature = _check_number("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature:g}")
        self.top_p = _check_number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p:g}")
        self.top_k = _check_int("top_k", self.top_k)
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or >= 1, got {self.top_k}")
        self.min_p = _check_number("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p:g}")
        self.max_tokens = _check_int("max_tokens", self.max_tokens)
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        self.n = _check_int("n", self.n)
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.seed is not None:
            self.seed = _check_int("seed", self.seed)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {type(self.ignore_eos).__name__}")
        if self.logprobs is not None:
            self.logprobs = _check_int("logprobs", self.logprobs)
            if not 0 <= self.logprobs <= MAX_LOGPROBS:
                raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        self.repetition_penalty = _check_number("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty:g}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = _check_number(name, getattr(self, name))
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value:g}")
            setattr(self, name, value)
        self.logit_bias = _normalise_logit_bias(self.logit_bias)
        if self.prompt_logprobs is not None:
            self.prompt_logprobs = _check_int("prompt_logprobs", self.prompt_logprobs)
            if not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
                raise ValueError(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}")
        self.stop = self._normalise_stop(self.stop)
        self.stop_token_ids = self._normalise_stop_token_ids(self.stop_token_ids)
        if self.structured_outputs is not None:
            self.structured_outputs = StructuredOutputs.coerce(self.structured_outputs)

    @staticmethod
    def _normalise_stop(stop: Any) -> list[str]:
        if stop is None:
            return []
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, (list, tuple)):
            raise ValueError(f"stop must be a string or a list of strings, got {type(stop).__name__}")
        for s in stop:
            if not isinstance(s, str):
                raise ValueError(f"stop must contain only strings, got {type(s).__name__} {s!r}")
            if not s:
                raise ValueError("stop strings must be non-empty")
        return list(stop)

    @staticmethod
    def _normalise_stop_token_ids(ids: Any) -> list[int]:
        if ids is None:
            return []
        if not isinstance(ids, (list, tuple)):
            raise ValueError(f"stop_token_ids must be a list of ints, got {type(ids).__name__}")
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(f"stop_token_ids must contain non-negative ints, got {t!r}")
        return list(ids)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS

    @property
    def uses_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
        )


def _normalise_logit_bias(bias: Any) -> dict[int, float] | None:
    """{token id: bias} with int ids >= 0 and finite biases in [-100, 100]; None when empty. (Ids beyond
    the vocabulary are the engine's to refuse: it knows the vocabulary.)"""
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must be a dict of token id -> bias, got {type(bias).__name__}")
    out: dict[int, float] = {}
    for tid, value in bias.items():
        if isinstance(tid, bool) or not isinstance(tid, int) or tid < 0:
            raise ValueError(f"logit_bias keys must be non-negative token ids, got {tid!r}")
        v = _check_number(f"logit_bias[{tid}]", value)
        if not -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias[{tid}] must be in [-{MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}], got {v:g}")
        out[tid] = v
    return out or None


class ListSlice(Sequence[T]):
    """`items[start:stop]` of a list that is only ever appended to, without copying it: a snapshot
    that stays valid while the list grows. Streaming outputs use it so that reporting a request after
    every step costs O(1), not O(tokens so far); finished outputs hold plain lists."""

    __slots__ = ("_items", "_start", "_stop")

    def __init__(self, items: list[T], start: int, stop: int):
        self._items, self._start, self._stop = items, start, stop

    def __len__(self) -> int:
        return self._stop - self._start

    @overload
    def __getitem__(self, i: int) -> T: ...
    @overload
    def __getitem__(self, i: slice) -> list[T]: ...
    def __getitem__(self, i: int | slice) -> T | list[T]:
        if isinstance(i, slice):
            r = range(self._start, self._stop)[i]
            return self._items[r.start : r.stop] if r.step == 1 else [self._items[j] for j in r]
        n = self._stop - self._start
        if not -n <= i < n:
            raise IndexError("ListSlice index out of range")
        return self._items[self._start + (i % n)]

    def __iter__(self):
        return iter(self._items[self._start : self._stop])

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (ListSlice, list, tuple)):
            return list(self) == list(other)
        return NotImplemented

    def __repr__(self) -> str:
        return repr(list(self))


@dataclass
class CompletionOutput:
    """One completion (of `n`) of a request, as seen after the latest step.

    `token_ids` and `logprobs` are lists once the completion is finished; while it runs they are
    `ListSlice` snapshots (read-only sequences). `logprobs` is None unless requested; otherwise one dict per generated token mapping token id to
    logprob, holding the top-`logprobs` tokens plus the sampled token (so 1 or k+1 entries).
    `finish_reason` is None while the completion is still running.
    """

    index: int
    text: str
    token_ids: Sequence[int]
    logprobs: Sequence[dict[int, float]] | None = None
    finish_reason: FinishReason | None = None
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """What the engine reports for one request after a step; `finished` once every completion is.
    `num_cached_tokens`: prompt tokens whose K/V came from the prefix cache (for n > 1, the fewest
    of any sequence: the first one computes the shared prompt, the others reuse it)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0
    # The sampling seed used: the request's own, or, in deterministic mode, one drawn at admission
    # for a sampled request without one (resend it to reproduce the completion); None otherwise.
    seed: int | None = None
    # Speculative decoding: tokens drafted for this request's sequences, and how many were accepted.
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    # SamplingParams.prompt_logprobs: per prompt position, {token: logprob} of the top-k plus the prompt's own
    # token (None for the first position, which nothing predicts), and that token's rank (1 = most likely).
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_logprob_ranks: list[int | None] | None = None
