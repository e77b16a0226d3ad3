"""SamplingParams: defaults, normalisation, and a ValueError naming the field for every bad value."""

from __future__ import annotations

import dataclasses

import pytest

from swaserve.request import CompletionOutput, RequestOutput, SamplingParams


def test_defaults() -> None:
    p = SamplingParams()
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (1.0, 1.0, -1, 0.0)
    assert (p.max_tokens, p.n, p.seed, p.logprobs, p.ignore_eos) == (16, 1, None, None, False)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
    assert p.stop == [] and p.stop_token_ids == []
    assert not p.is_greedy and not p.uses_penalties


def test_normalisation() -> None:
    p = SamplingParams(temperature=0, top_p=1, stop="###", stop_token_ids=(3, 4))
    assert p.is_greedy and isinstance(p.temperature, float) and isinstance(p.top_p, float)
    assert p.stop == ["###"] and p.stop_token_ids == [3, 4]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    # replace() re-validates and keeps the normalised form
    assert dataclasses.replace(p, temperature=0.5).stop == ["###"]


def test_valid_edges() -> None:
    SamplingParams(temperature=0.0, top_p=1e-9, top_k=1, min_p=1.0, max_tokens=1, logprobs=0)
    SamplingParams(logprobs=20, presence_penalty=-2, frequency_penalty=2, repetition_penalty=1e-3, seed=-5)
    assert SamplingParams(repetition_penalty=1.2).uses_penalties


BAD = [
    ("temperature", -1),
    ("temperature", float("nan")),
    ("temperature", float("inf")),
    ("temperature", "1.0"),
    ("temperature", True),
    ("top_p", 0.0),
    ("top_p", 1.5),
    ("top_p", -0.1),
    ("top_p", float("nan")),
    ("top_k", 0),
    ("top_k", -2),
    ("top_k", 2.0),
    ("top_k", True),
    ("min_p", -0.1),
    ("min_p", 1.1),
    ("max_tokens", 0),
    ("max_tokens", -3),
    ("max_tokens", "16"),
    ("max_tokens", 16.0),
    ("max_tokens", True),
    ("n", 0),
    ("n", "2"),
    ("logprobs", -1),
    ("logprobs", 21),
    ("logprobs", True),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("presence_penalty", 2.5),
    ("presence_penalty", -2.01),
    ("frequency_penalty", 3),
    ("frequency_penalty", float("inf")),
    ("stop", ""),
    ("stop", ["ok", ""]),
    ("stop", ["ok", 3]),
    ("stop", 5),
    ("stop_token_ids", [1, -1]),
    ("stop_token_ids", ["1"]),
    ("stop_token_ids", 7),
    ("seed", 1.5),
    ("seed", "7"),
    ("ignore_eos", 1),
]


@pytest.mark.parametrize(("field", "value"), BAD, ids=[f"{f}={v!r}" for f, v in BAD])
def test_bad_value_raises_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_error_message_reports_value() -> None:
    with pytest.raises(ValueError, match=r"^temperature must be >= 0, got -1$"):
        SamplingParams(temperature=-1)


def test_outputs() -> None:
    c = CompletionOutput(index=0, text="hi", token_ids=[1, 2], logprobs=None, finish_reason=None)
    assert not c.finished and c.cumulative_logprob is None
    c.finish_reason = "length"
    r = RequestOutput(request_id="r0", prompt="p", prompt_token_ids=[5], outputs=[c], finished=True)
    assert r.outputs[0].finished and r.finished
