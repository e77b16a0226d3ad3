"""The messages between the HTTP frontend and an engine core, and their msgpack codec (msgspec; no pickle).

Frontend -> core: `AddRequest`, `AbortRequests`, `Shutdown`. Core -> frontend: `Ready` (or
`StartupFailed`) once, then one `StepOutputs` per engine step (every request's new tokens in one
message), or after inputs that changed something while no step ran. With several frontend processes
(`--api-server-count`) each has its own pair of sockets to the core, and each step's message to a
frontend carries only the requests it sent (and the engine's counters).
"""

from __future__ import annotations

from typing import Any, Union

import msgspec


class AddRequest(msgspec.Struct, tag="add", array_like=True):
    request_id: str
    prompt_ids: list[int]
    sampling: dict[str, Any]  # SamplingParams keywords; stop strings stay in the frontend (it detokenizes)
    frontend: int = 0  # which frontend process sent it (`--api-server-count`): its outputs go back there


class AbortRequests(msgspec.Struct, tag="abort", array_like=True):
    request_ids: list[str]


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    pass


class Ready(msgspec.Struct, tag="ready", array_like=True):
    model_name: str
    max_context: int
    pid: int


class StartupFailed(msgspec.Struct, tag="startup_failed", array_like=True):
    error_type: str  # "ValueError": bad user input (a CLI exit code 2), else an internal failure
    message: str


class RequestDelta(msgspec.Struct, array_like=True):
    """One request's tokens since its previous delta; `finish_reason` set on its last one."""

    request_id: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    cached_tokens: int | None = None  # first delta only: prompt tokens served from the prefix cache
    seed: int | None = None  # first delta only: the sampling seed in use (None: greedy, unseeded)
    spec: tuple[int, int] | None = None  # speculative decoding: (drafted, accepted) tokens so far
    # First delta, prompt_logprobs asked: {token: logprob} per prompt token after the first, and its rank.
    prompt_logprobs: tuple[list[dict[int, float]], list[int]] | None = None


class Rejected(msgspec.Struct, array_like=True):
    request_id: str
    status: int  # 400: the engine refused the input; 500: it failed
    message: str


class StepOutputs(msgspec.Struct, tag="step", array_like=True):
    deltas: list[RequestDelta]
    accepted: list[str]  # request ids added since the previous message
    rejected: list[Rejected]
    failed: list[str]  # request ids ended by an engine failure (the core keeps running)
    counters: dict[str, int]  # the engine's counters after the step (Engine.counters() names)


ToCore = Union[AddRequest, AbortRequests, Shutdown]
FromCore = Union[Ready, StartupFailed, StepOutputs]


class Codec:
    """msgpack encoders/decoders for one direction each (reusable; not thread-safe)."""

    def __init__(self) -> None:
        self._enc = msgspec.msgpack.Encoder()
        self._to_core = msgspec.msgpack.Decoder(ToCore)
        self._from_core = msgspec.msgpack.Decoder(FromCore)

    def encode(self, msg: Any) -> bytes:
        return self._enc.encode(msg)

    def decode_to_core(self, data: bytes) -> ToCore:
        return self._to_core.decode(data)

    def decode_from_core(self, data: bytes) -> FromCore:
        return self._from_core.decode(data)
