"""The frontend streams a request's first token ahead of the running requests' next ones: the streams wake
in the order their updates are posted, and in a mixed step's message the new request's delta comes after
the decodes' (its prefill rows follow the decode rows)."""

from __future__ import annotations

import asyncio

from swaserve.core.messages import RequestDelta, StepOutputs
from swaserve.detokenizer import IncrementalDetokenizer
from swaserve.loader.default_model import default_model_path
from swaserve.server.engine_client import EngineClient
from swaserve.server.messages import SubRequest
from swaserve.server.track import Track
from swaserve.tokenizer import Tokenizer


def test_first_tokens_are_posted_before_the_running_requests_next_tokens():
    tok = Tokenizer.from_gguf(default_model_path())
    client = EngineClient(spec=None, tokenizer=tok)  # type: ignore[arg-type]  # no core: the dispatch alone
    client.snapshots = [{}]
    ids = tok.encode("Hello there")
    queues = {}
    for rid, seen in (("old0", 3), ("old1", 5), ("new", 0), ("old2", 1)):
        queues[rid] = asyncio.Queue()
        client._tracks[rid] = Track(SubRequest(rid, 0, prompt=ids), queues[rid], 0.0, len(ids),
                                    IncrementalDetokenizer(tok, ids), 0, tokens=seen)
    order: list[str] = []
    flush = client._flush

    def recording_flush() -> None:
        order.extend(next(r for r, q in queues.items() if id(q) == key) for key in client._posts)
        flush()

    client._flush = recording_flush  # type: ignore[method-assign]
    step = StepOutputs([RequestDelta(rid, [ids[0]]) for rid in ("old0", "old1", "new", "old2")], [], [], [], {})
    client._on_step(0, step)
    assert order == ["new", "old0", "old1", "old2"]
    for rid, q in queues.items():  # every stream got its token, once
        (update,) = q.get_nowait()
        assert update.token_ids == [ids[0]], rid
    assert client._tracks["new"].tokens == 1
