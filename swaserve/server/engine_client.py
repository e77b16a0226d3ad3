"""EngineClient: the frontend's side of the engine core. Tokenizes (chat templates included), sends requests
to the core process, reads its per-step outputs on the event loop, detokenizes incrementally (stop
strings end a request here), and hands `Update`s to per-request asyncio queues.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.asyncio

from swaserve.core.engine_core import CoreSpec
from swaserve.core.messages import AbortRequests, AddRequest, RequestDelta, StepOutputs
from swaserve.core.process import CoreProcess
from swaserve.detokenizer import IncrementalDetokenizer
from swaserve.request import SamplingParams
from swaserve.server.generation import Generation
from swaserve.server.messages import SubRequest, Update
from swaserve.server.metrics import ServerMetrics
from swaserve.server.protocol import APIError

logger = logging.getLogger(__name__)
LIVENESS_POLL_MS = 200  # with no output for this long, check that the core is still alive

_SHUTTING_DOWN = APIError(503, "server is shutting down", code="shutting_down")
_CORE_DEAD = APIError(500, "the engine core process died; the server is restarting or exiting", code="engine_dead")
_ENGINE_ERROR = APIError(500, "internal engine error", code="engine_error")


@dataclass(slots=True)
class _Track:
    """One sub-request in flight: where its updates go, its detokenizer, and what was sent."""

    sub: SubRequest
    queue: asyncio.Queue[list[Update]]
    arrival: float
    prompt_tokens: int
    detok: IncrementalDetokenizer
    accepted: bool = False
    tokens: int = 0  # token ids handed out (posted or pending)
    chars: int = 0  # characters of detok.text handed out
    last_token: float = 0.0
    posted: bool = False  # an update with tokens or text was posted
    pending: Update | None = None  # held back until stream_interval tokens (or the end)


class EngineClient:
    """Frontend handle on one engine-core process.

    Invariants: only the event loop touches this object after `start()`; every open sub-request has
    a `_Track`, and leaves it exactly once (finished, stopped by a stop string, aborted, refused or
    failed), and the core is told to abort every one that leaves it unfinished. When the core dies,
    every open request gets a 500 at once, `alive` turns False (/health: 503), and `on_fatal` runs.
    """

    def __init__(self, spec: CoreSpec, tokenizer: Any, metrics: ServerMetrics | None = None,
                 stream_interval: int = 1, on_fatal: Callable[[], None] | None = None):
        self.spec = spec
        self.tokenizer = tokenizer
        self.metrics = metrics or ServerMetrics()
        self.stream_interval = max(1, int(stream_interval))
        self.on_fatal = on_fatal
        self.snapshot: dict[str, int] = {}
        self.core: CoreProcess | None = None
        self.model_name = "swaserve"
        self.max_context = 0
        self.core_died = False
        self._stopping = False
        self._tracks: dict[str, _Track] = {}
        self._posts: dict[int, tuple[asyncio.Queue[list[Update]], list[Update]]] = {}
        self._token_text: dict[int, str] = {}
        self._reader: asyncio.Task | None = None

    # ---- lifecycle ---------------------------------------------------------------------------------

    def start_core(self) -> None:
        """Start the engine core and wait until it is ready (before the HTTP server starts)."""
        self.core = CoreProcess(self.spec)
        try:
            ready = self.core.start()
        except BaseException:
            self.core.kill()
            self.core.close()
            raise
        self.model_name, self.max_context = ready.model_name, ready.max_context

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start reading the core's outputs on the running event loop."""
        assert self.core is not None, "start_core() first"
        self._reader = asyncio.ensure_future(self._read(zmq.asyncio.Socket.from_socket(self.core.outputs)))

    async def stop(self, timeout: float = 30.0) -> None:
        """Fail what is still open with a 503, stop the core (waiting up to `timeout` s) and the reader."""
        self._stopping = True
        self._fail_all(_SHUTTING_DOWN, tell_core=False)
        if self._reader is not None:
            self._reader.cancel()
        if self.core is not None:
            core, self.core = self.core, None
            await asyncio.to_thread(core.stop, timeout)

    @property
    def alive(self) -> bool:
        return self.core is not None and not self._stopping and not self.core_died

    @property
    def core_pid(self) -> int | None:
        return self.core.pid if self.core is not None else None

    # ---- requests ----------------------------------------------------------------------------------

    def generate(self, subs: list[SubRequest]) -> Generation:
        if not self.alive:
            raise _CORE_DEAD if self.core_died else _SHUTTING_DOWN
        gen = Generation(subs, abort=self.abort)
        arrival = time.monotonic()
        for sub in subs:
            try:
                ids = self._prompt_ids(sub)
                params = self._sampling_params(sub, len(ids))
            except (APIError, ValueError) as e:
                self.metrics.count_rejected()
                gen.queue.put_nowait([Update(sub.index, error=e if isinstance(e, APIError) else
                                             APIError(400, str(e), code="invalid_value"))])
                continue
            detok = IncrementalDetokenizer(self.tokenizer, ids, stop=params.stop)
            self._tracks[sub.request_id] = _Track(sub, gen.queue, arrival, len(ids), detok)
            sampling = {k: v for k, v in sub.sampling.items() if k != "stop"}
            sampling["max_tokens"] = params.max_tokens
            self.core.send(AddRequest(sub.request_id, ids, sampling))  # type: ignore[union-attr]
        return gen

    def abort(self, request_id: str) -> None:
        if self._tracks.pop(request_id, None) is not None:
            self.metrics.count_aborted()
            self._tell_abort([request_id])

    def _tell_abort(self, request_ids: list[str]) -> None:
        if self.core is not None and not self.core_died:
            self.core.send(AbortRequests(request_ids))

    def _prompt_ids(self, sub: SubRequest) -> list[int]:
        tok = self.tokenizer
        prompt = sub.prompt
        if sub.messages is not None:
            try:
                prompt = tok.apply_chat_template(sub.messages, add_generation_prompt=True)
            except ValueError as e:  # no template (a base model), or the template rejected the messages
                raise APIError(400, f"messages: {e}", param="messages") from e
            except Exception as e:  # template errors (jinja raise_exception) are about the input
                raise APIError(400, f"messages: the chat template rejected them: {e}", param="messages") from e
        ids = tok.encode(prompt) if isinstance(prompt, str) else list(prompt or [])
        if not ids:
            raise APIError(400, "prompt is empty after tokenization", param="prompt")
        return ids

    def _sampling_params(self, sub: SubRequest, prompt_len: int) -> SamplingParams:
        kw = dict(sub.sampling)
        param = "messages" if sub.messages is not None else "prompt"
        room = self.max_context - prompt_len
        if kw.get("max_tokens") is None:
            if room < 1:
                raise APIError(
                    400, f"This model's maximum context length is {self.max_context} tokens, but the "
                    f"{param} has {prompt_len} tokens, leaving no room for a completion.",
                    param=param, code="context_length_exceeded",
                )
            kw["max_tokens"] = room
        elif prompt_len + kw["max_tokens"] > self.max_context:
            raise APIError(
                400, f"This model's maximum context length is {self.max_context} tokens. However, you "
                f"requested {prompt_len + kw['max_tokens']} tokens ({prompt_len} in the {param}, "
                f"{kw['max_tokens']} in the completion). Please reduce the {param} or max_tokens.",
                param="max_tokens" if room >= 1 else param, code="context_length_exceeded",
            )
        return SamplingParams(**kw)

    # ---- outputs -----------------------------------------------------------------------------------

    async def _read(self, sock: zmq.asyncio.Socket) -> None:
        core = self.core
        assert core is not None
        try:
            while True:
                if not await sock.poll(LIVENESS_POLL_MS):
                    if not core.alive:
                        break
                    continue
                msg = core.codec.decode_from_core(await sock.recv())
                if isinstance(msg, StepOutputs):
                    self._on_step(msg)
        except asyncio.CancelledError:
            return
        except Exception:
            logger.exception("reading the engine core's outputs failed")
        if not self._stopping:
            self._on_core_death()

    def _on_core_death(self) -> None:
        code = self.core.proc.returncode if self.core is not None and self.core.proc is not None else None
        logger.error("the engine core died (exit code %s); failing every open request", code)
        self.core_died = True
        self._fail_all(_CORE_DEAD, tell_core=False)
        if self.on_fatal is not None:
            self.on_fatal()

    def _on_step(self, msg: StepOutputs) -> None:
        self.snapshot = msg.counters
        for rid in msg.accepted:
            track = self._tracks.get(rid)
            if track is not None:
                track.accepted = True
                self._post(track, Update(track.sub.index, accepted=True, prompt_tokens=track.prompt_tokens))
        for rej in msg.rejected:
            track = self._tracks.pop(rej.request_id, None)
            if track is not None:
                self.metrics.count_rejected()
                err = APIError(400, rej.message, code="invalid_value") if rej.status == 400 else _ENGINE_ERROR
                self._post(track, Update(track.sub.index, error=err))
        for rid in msg.failed:
            track = self._tracks.pop(rid, None)
            if track is not None:
                self._post(track, Update(track.sub.index, error=_ENGINE_ERROR))
        now = time.monotonic()
        for delta in msg.deltas:
            track = self._tracks.get(delta.request_id)
            if track is not None:  # None: aborted or stopped here while its step ran
                self._on_delta(track, delta, now)
        self._flush()

    def _on_delta(self, track: _Track, delta: RequestDelta, now: float) -> None:
        ids, finish, detok = delta.token_ids, delta.finish_reason, track.detok
        # A core-side "stop" ends on a stop token (EOS or stop_token_ids): in token_ids, but no text.
        text_ids = ids[:-1] if finish == "stop" and ids else ids
        taken = len(ids)
        for k, tid in enumerate(text_ids):
            detok.step([tid])
            if detok.stopped:  # a stop string: this token is the last one reported
                taken, finish = k + 1, "stop"
                self._tell_abort([delta.request_id])
                break
        if finish is not None and not detok.stopped:
            detok.flush()
        new_ids = ids[:taken] if taken < len(ids) else ids
        if new_ids:
            if track.tokens == 0:
                self.metrics.ttft.observe(now - track.arrival)
            else:
                self.metrics.itl.observe((now - track.last_token) / len(new_ids), len(new_ids))
            track.last_token = now
        upd = track.pending or Update(track.sub.index)
        if delta.cached_tokens is not None:
            upd.cached_tokens, upd.seed = delta.cached_tokens, delta.seed
        upd.text += detok.text[track.chars :]
        track.chars = len(detok.text)
        upd.token_ids += new_ids
        if delta.logprobs is not None:
            lps = delta.logprobs[: len(new_ids)]
            upd.logprobs = (upd.logprobs or []) + lps
            if track.sub.token_strings:
                upd.token_strs = {**(upd.token_strs or {}), **self._token_strings(lps)}
        track.tokens += len(new_ids)
        track.pending = None
        if finish is not None:
            upd.finish_reason = finish
            del self._tracks[delta.request_id]
            self.metrics.count_finished(finish)
            self.metrics.e2e.observe(now - track.arrival)
        elif not (upd.text or upd.token_ids):
            return
        elif not track.sub.stream or (track.posted and len(upd.token_ids) < self.stream_interval):
            track.pending = upd  # stream_interval: the first token goes at once, then every N
            return
        track.posted = True
        self._post(track, upd)

    def _token_strings(self, logprobs: list[dict[int, float]]) -> dict[int, str]:
        cache, decode = self._token_text, self.tokenizer.decode
        out: dict[int, str] = {}
        for entry in logprobs:
            for tid in entry:
                if tid not in cache:
                    cache[tid] = decode([tid])
                out[tid] = cache[tid]
        return out

    def _fail_all(self, error: APIError, tell_core: bool) -> None:
        tracks, self._tracks = self._tracks, {}
        for track in tracks.values():
            self._post(track, Update(track.sub.index, error=error))
        if tell_core and tracks:
            self._tell_abort(list(tracks))
        self._flush()

    def _post(self, track: _Track, update: Update) -> None:
        self._posts.setdefault(id(track.queue), (track.queue, []))[1].append(update)

    def _flush(self) -> None:
        posts, self._posts = self._posts, {}
        for queue, updates in posts.values():
            queue.put_nowait(updates)
