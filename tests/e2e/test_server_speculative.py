"""The server with speculative decoding (embedded model, CPU, n-gram drafter): the same text as without,
streamed and not, and the usage reports the drafted tokens accepted and rejected
(`completion_tokens_details`, OpenAI's names); /metrics counts them."""

from __future__ import annotations

import pytest
from live_server import fake_spec, start_server

CODE = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n" * 4 + "def mul(a, b):"


@pytest.fixture(scope="module")
def spec_server():
    from swaserve.tokenizer import Tokenizer

    spec = fake_spec("swaserve.engine:Engine", model=None, device="cpu", max_context=512, max_running_requests=8,
                     detokenize=False, speculative_method="ngram")
    live = start_server(spec, Tokenizer.load(None))
    yield live
    live.stop()


@pytest.mark.slow
def test_speculative_server_answers_like_plain(spec_server, real_server):
    kw = {"prompt": CODE, "max_tokens": 24, "temperature": 0}
    plain = real_server.client().completions.create(model=real_server.model, **kw).choices[0].text
    c = spec_server.client()
    whole = c.completions.create(model=spec_server.model, **kw)
    assert whole.choices[0].text == plain
    details = whole.usage.completion_tokens_details
    assert details is not None, whole.usage
    assert details.accepted_prediction_tokens > 0 and details.rejected_prediction_tokens >= 0
    chunks = list(c.completions.create(model=spec_server.model, stream=True,
                                       stream_options={"include_usage": True}, **kw))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == plain
    assert chunks[-1].usage.completion_tokens_details.accepted_prediction_tokens > 0
    m = spec_server.wait_idle(timeout=30)
    assert m["swaserve_spec_accepted_tokens_total"] > 0
    assert m["swaserve_spec_draft_tokens_total"] >= m["swaserve_spec_accepted_tokens_total"]
    assert m['swaserve_kv_used_tokens{pool="full"}'] == 0
