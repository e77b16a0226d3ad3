"""The frontend streams a request's first token ahead of the running requests' next ones: their updates are
posted first, and their streams run (write their chunks) before the running requests' deltas of the same step
are even detokenized. In a mixed step's message the new request's delta comes after the decodes' (its prefill
rows follow the decode rows)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from swaserve.core.messages import RequestDelta, StepOutputs
from swaserve.detokenizer import IncrementalDetokenizer
from swaserve.loader.default_model import default_model_path
from swaserve.server.engine_client import EngineClient
from swaserve.server.messages import SubRequest
from swaserve.server.track import Track
from swaserve.tokenizer import Tokenizer

_SEEN = {"old0": 3, "old1": 5, "new": 0, "old2": 1}


def _client() -> tuple[EngineClient, dict[str, asyncio.Queue], list[int]]:
    tok = Tokenizer.from_gguf(default_model_path())
    client = EngineClient(spec=None, tokenizer=tok)  # type: ignore[arg-type]  # no core: the dispatch alone
    client.snapshots = [{}]
    ids = tok.encode("Hello there")
    queues = {}
    for rid, seen in _SEEN.items():
        queues[rid] = asyncio.Queue()
        client._tracks[rid] = Track(SubRequest(rid, 0, prompt=ids), queues[rid], 0.0, len(ids),
                                    IncrementalDetokenizer(tok, ids), 0, tokens=seen)
    return client, queues, ids


def _step(ids: list[int]) -> StepOutputs:
    return StepOutputs([RequestDelta(rid, [ids[0]]) for rid in _SEEN], [], [], [], {})


def test_first_tokens_are_posted_before_the_running_requests_next_tokens():
    client, queues, ids = _client()
    later = client._on_step(0, _step(ids))
    assert [t.sub.request_id for t, _ in later] == ["old0", "old1", "old2"]
    assert queues["new"].qsize() == 1 and all(q.empty() for r, q in queues.items() if r != "new")
    del client._tracks["old1"]  # its client went away before the rest of the step was decoded
    client._on_later(later)
    for rid, q in queues.items():  # every stream still here got its token, once
        if rid == "old1":
            assert q.empty()
            continue
        (update,) = q.get_nowait()
        assert update.token_ids == [ids[0]], rid
        assert client._tracks[rid].tokens == _SEEN[rid] + 1


def test_a_first_tokens_stream_runs_before_the_running_requests_deltas_are_decoded():
    client, queues, ids = _client()
    seen_by_new_stream: dict[str, int] = {}

    async def stream_of_new() -> None:  # what the SSE handler does: wake on its update, write it
        await queues["new"].get()
        seen_by_new_stream.update({rid: t.tokens for rid, t in client._tracks.items()})

    class Socket:  # one step's message, then the core is gone
        def __init__(self) -> None:
            self.messages = [_step(ids)]

        async def recv(self) -> StepOutputs:
            if not self.messages:
                await asyncio.Event().wait()  # nothing more: the liveness timeout finds the core gone
            return self.messages.pop()

    core = SimpleNamespace(alive=False, returncode=0, codec=SimpleNamespace(decode_from_core=lambda m: m))
    client.cores = SimpleNamespace(cores=[core])  # type: ignore[assignment]
    client.core_died = True  # the end of the messages is not a death to report

    async def main() -> None:
        stream = asyncio.create_task(stream_of_new())
        await asyncio.sleep(0)  # the stream waits on its queue
        await client._read(0, Socket())  # type: ignore[arg-type]
        await stream

    asyncio.run(main())
    assert seen_by_new_stream == {**_SEEN, "new": 1}  # the running requests' deltas were not yet absorbed
    assert {rid: t.tokens for rid, t in client._tracks.items()} == {rid: n + 1 for rid, n in _SEEN.items()}
