"""OpenAI wire schemas the server accepts (completions, chat); their errors are `api_errors.APIError`s.

Validation here is shape and range only; whatever needs the tokenizer or the context length (prompt
too long, token ids outside the vocabulary) is checked where the tokenizer lives (the EngineClient) or by the engine core.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from swaserve.server.api_errors import short_repr

MAX_N = 16  # choices per prompt
MAX_CHOICES = 128  # prompts x n in one request
MAX_STOP = 16  # OpenAI allows 4; extra room costs nothing
MAX_LOGPROBS = 20
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
# vLLM's structured-output fields before v0.12, which replaced them with `structured_outputs`.
_REMOVED_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                   "guided_grammar": "grammar"}

class _Strict(BaseModel):
    # strict: "1" is not a number and true is not an int; NaN/inf are rejected outright.
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(_Strict):
    """`stream_options`: with include_usage, a last chunk (no choices) carries the usage."""

    include_usage: bool | None = False


class _SamplingRequest(_Strict):
    """Fields shared by completions and chat; every optional field also accepts an explicit null."""

    model: str | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int | None = Field(None, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**63 - MAX_N)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Extensions, with vLLM's names.
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0, le=10)
    ignore_eos: bool | None = False
    stop_token_ids: list[int] | None = None
    # OpenAI: {"token id": bias in [-100, 100]} (JSON keys are strings); ids past the vocabulary: the engine's 400.
    logit_bias: dict[str, Any] | None = None
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # vLLM's: logprobs of the prompt's tokens
    # vLLM's extension (docs/structured_outputs.md): {"json" | "regex" | "choice" | "grammar" | "json_object": ...}
    structured_outputs: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _no_guided_fields(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for old, new in _REMOVED_GUIDED.items():
                if data.get(old) is not None:
                    raise ValueError(f"{old} is vLLM's old name (removed in vLLM 0.12); use "
                                     f"structured_outputs: {{\"{new}\": ...}}")
        return data

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v: str | list[str] | None) -> list[str] | None:
        stops = [v] if isinstance(v, str) else v
        if stops is None:
            return None
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences are allowed, got {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty strings")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, v: dict[str, Any] | None) -> dict[int, float] | None:
        return _logit_bias(v)

    def sampling_kwargs(self, seed_offset: int = 0) -> dict[str, Any]:
        """SamplingParams keyword arguments (without max_tokens / logprobs, which differ by endpoint)."""
        kw: dict[str, Any] = {
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "top_k": -1 if self.top_k is None else self.top_k,
            "min_p": self.min_p or 0.0,
            "stop": self.stop,
            "stop_token_ids": self.stop_token_ids,
            "seed": None if self.seed is None else self.seed + seed_offset,
            "ignore_eos": bool(self.ignore_eos),
            "presence_penalty": self.presence_penalty or 0.0,
            "frequency_penalty": self.frequency_penalty or 0.0,
            "repetition_penalty": 1.0 if self.repetition_penalty is None else self.repetition_penalty,
        }
        if self.logit_bias:
            kw["logit_bias"] = self.logit_bias
        if self.prompt_logprobs is not None:
            kw["prompt_logprobs"] = self.prompt_logprobs
        return kw

    @property
    def num_choices(self) -> int:
        return self.n or 1

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


def _logit_bias(v: dict[str, Any] | None) -> dict[int, float] | None:
    if not v:
        return None
    out: dict[int, float] = {}
    for key, bias in v.items():
        if not (key.isascii() and key.isdigit()):
            raise ValueError(f"logit_bias keys must be token ids (non-negative integers), got {short_repr(key)}")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise ValueError(f"logit_bias[{key}] must be a number in [-100, 100], got {short_repr(bias)}")
        out[int(key)] = float(bias)
    return out


class CompletionRequest(_SamplingRequest):
    """POST /v1/completions. After validation `prompt` is a non-empty list of str / token-id lists.
    `echo`: the prompt comes back in front of the completion (with its tokens' logprobs when `logprobs` is
    set, the first one null); `max_tokens: 0` with `echo` returns the prompt alone (lm-eval's loglikelihood)."""

    prompt: Any  # str | list[str] | list[int] | list[list[int]], checked below
    max_tokens: int | None = Field(None, ge=0)  # None: OpenAI's default of 16; 0 only with echo
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, v: Any) -> list[str | list[int]]:
        return _normalise_prompt(v)

    @model_validator(mode="after")
    def _check_unsupported(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens must be at least 1 (0 is allowed only with echo)")
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs is not available when streaming (echo with logprobs is)")
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.best_of not in (None, 1, self.n):
            raise ValueError("best_of is not supported")
        if len(self.prompt) * self.num_choices > MAX_CHOICES:
            raise ValueError(f"prompts x n must be at most {MAX_CHOICES}")
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        return self.prompt  # type: ignore[no-any-return]  # normalised by the validator

    @property
    def engine_prompt_logprobs(self) -> int | None:
        """Prompt logprobs the engine computes: those asked for, and echo's when logprobs are (vLLM's rule)."""
        if self.echo and self.logprobs is not None:
            return max(self.logprobs, self.prompt_logprobs or 0)
        return self.prompt_logprobs


def _is_token_list(v: Any) -> bool:
    return isinstance(v, list) and all(type(t) is int for t in v)


def _normalise_prompt(v: Any) -> list[str | list[int]]:
    shape = "prompt must be a string, a list of strings, a list of token ids or a list of token-id lists"
    if v is None:
        raise ValueError("prompt is required")
    if isinstance(v, str):
        prompts: list[Any] = [v]
    elif _is_token_list(v) and v:
        prompts = [v]
    elif isinstance(v, list) and v and all(isinstance(p, str) or _is_token_list(p) for p in v):
        prompts = v
    elif isinstance(v, list) and not v:
        raise ValueError("prompt must not be empty")
    else:
        raise ValueError(shape)
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty" if len(prompts) > 1 else "prompt must not be empty")
        if isinstance(p, list) and min(p) < 0:
            raise ValueError(f"token ids must be non-negative, got {min(p)}")
    if len(prompts) > MAX_CHOICES:
        raise ValueError(f"at most {MAX_CHOICES} prompts per request, got {len(prompts)}")
    return prompts


class ContentPart(_Strict):
    """One part of a message's content; only {"type": "text", "text": ...} is supported."""

    type: str
    text: str | None = None

    @model_validator(mode="after")
    def _text_only(self) -> ContentPart:
        if self.type != "text" or self.text is None:
            raise ValueError(f"only text content parts are supported, got type {self.type!r}")
        return self


class ChatMessage(_Strict):
    """A chat message; the role is one of CHAT_ROLES and only assistant messages may omit content.
    Assistant messages may carry the `tool_calls` the model made; `tool` messages answer one by id."""

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    @field_validator("role")
    @classmethod
    def _known_role(cls, v: str) -> str:
        if v not in CHAT_ROLES:
            raise ValueError(f"unknown role {v!r}; supported roles: {', '.join(CHAT_ROLES)}")
        return v

    @model_validator(mode="after")
    def _needs_content(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise ValueError(f"content is required for {self.role} messages")
        return self

    def as_template_dict(self) -> dict[str, Any]:
        content = self.content or ""
        if isinstance(content, list):
            content = "".join(p.text or "" for p in content)
        # Most chat templates know only system/user/assistant; "developer" is OpenAI's new system.
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": content}
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.role == "tool" and self.name is not None:
            out["name"] = self.name
        return out


class ChatCompletionRequest(_SamplingRequest):
    """POST /v1/chat/completions. No max_tokens means: as many as the context leaves."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # wins over max_tokens, as in OpenAI
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    response_format: dict[str, Any] | None = None
    reasoning_effort: Literal["low", "medium", "high"] | None = None  # models with a reasoning format (GPT-OSS)
    # SGLang's name: False leaves the reasoning in `content` (the reply as written); None: the server's setting.
    separate_reasoning: bool | None = None
    include_reasoning: bool | None = True  # vLLM's: False drops the reasoning (no reasoning_content)
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: extra template variables (enable_thinking)

    @model_validator(mode="after")
    def _check_options(self) -> ChatCompletionRequest:
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs is not available when streaming")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        if self.functions:
            raise ValueError("functions (the deprecated form) are not supported; use tools")
        forced = [name for name, on in (("response_format", self.response_format and
                                         self.response_format.get("type") not in (None, "text")),
                                        ("structured_outputs", self.structured_outputs),
                                        ("tool_choice", self.tool_choice not in (None, "auto", "none")))
                  if on]
        if len(forced) > 1:
            raise ValueError(f"{' and '.join(forced)} cannot be combined: each constrains the whole reply")
        return self

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def engine_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


Endpoint = Literal["completion", "chat"]
