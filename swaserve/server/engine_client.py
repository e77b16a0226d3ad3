"""EngineClient: the engine thread (the only thread that touches the engine and its tokenizer) and the
command queue the event loop feeds it; results go back as `Update`s on per-request asyncio queues.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from swaserve.request import SamplingParams
from swaserve.server.generation import Generation
from swaserve.server.messages import SubRequest, Update
from swaserve.server.metrics import ServerMetrics
from swaserve.server.protocol import APIError

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Add:
    """Command: add these sub-requests of one HTTP request; their updates go to `queue`."""

    queue: asyncio.Queue[list[Update]]
    subs: list[SubRequest]
    arrival: float


@dataclass(slots=True)
class _Track:
    """Engine-thread bookkeeping of one running sub-request: how much of its output was sent."""

    sub: SubRequest
    queue: asyncio.Queue[list[Update]]
    arrival: float
    chars: int = 0
    tokens: int = 0
    logprobs: int = 0
    last_token: float = 0.0


class EngineClient:
    """Runs `engine.step()` in a dedicated thread so HTTP handling never waits on model compute.

    Invariants: only the engine thread calls the engine or its tokenizer; the event loop talks to it
    through `_commands` (adds, aborts; drained between steps, in order) and gets results as lists of
    `Update`s on per-HTTP-request asyncio queues, delivered with one `call_soon_threadsafe` per step.
    The thread sleeps on `_cv` when the engine is idle. `snapshot` is replaced, never mutated, after
    every step, so readers on other threads see a consistent dict.
    """

    def __init__(self, engine: Any, metrics: ServerMetrics | None = None):
        self._engine = engine
        self.metrics = metrics or ServerMetrics()
        self.model_name: str = getattr(engine, "model_name", None) or "swaserve"
        self.max_context: int = int(engine.model_config.max_context)
        self.snapshot: dict[str, int] = {}
        self._cv = threading.Condition()
        self._commands: list[_Add | str] = []  # str: a request id to abort
        self._stopping = False
        self._busy = False
        self._tracks: dict[str, _Track] = {}
        self._posts: dict[int, tuple[asyncio.Queue[list[Update]], list[Update]]] = {}
        self._token_text: dict[int, str] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()

    # ---- event-loop side -------------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop or asyncio.get_running_loop()
        # Daemon: a wedged step() must not keep the process alive after shutdown gave up on it.
        self._thread = threading.Thread(target=self._run, name="swaserve-engine", daemon=True)
        self._thread.start()
        self._ready.wait(timeout=60)

    def stop(self, timeout: float = 30.0) -> None:
        """Fail whatever is still in flight with a 503, let the engine thread exit, and join it."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning("engine thread did not exit within %.0fs", timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    def generate(self, subs: list[SubRequest]) -> Generation:
        gen = Generation(subs, abort=self.abort)
        self._submit(_Add(gen.queue, subs, time.monotonic()))
        return gen

    def abort(self, request_id: str) -> None:
        self._submit(request_id)

    def _submit(self, command: _Add | str) -> None:
        with self._cv:
            if isinstance(command, _Add) and (self._stopping or self._thread is None):
                raise APIError(503, "server is shutting down", code="shutting_down")
            self._commands.append(command)
            self._cv.notify()

    # ---- engine thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._publish()
            self._ready.set()
            self._serve()
        except BaseException:
            logger.exception("engine thread crashed; failing every request")
        finally:
            self._ready.set()
            with self._cv:
                self._stopping = True  # `alive` turns False, /health reports it, new requests get a 503
                commands, self._commands = self._commands, []
            error = APIError(503, "server is shutting down", code="shutting_down")
            for command in commands:
                if isinstance(command, _Add):
                    for sub in command.subs:
                        self._post(command.queue, Update(sub.index, error=error))
            self._fail_all(error)
            self._publish()
            self._flush()

    def _serve(self) -> None:
        while True:
            with self._cv:
                while not self._commands and not self._stopping and not self._busy:
                    self._cv.wait()
                commands, self._commands = self._commands, []
                stopping = self._stopping
            for command in commands:
                try:
                    self._abort(command) if isinstance(command, str) else self._add(command)
                except Exception:
                    logger.exception("engine command failed")
            if stopping:
                return
            idle_step = False
            if self._engine.has_unfinished():
                t0 = time.monotonic()
                try:
                    outputs = self._engine.step()
                    self._dispatch(outputs)
                    idle_step = not outputs and time.monotonic() - t0 < 1e-3
                except Exception:
                    logger.exception("engine step failed; failing the requests in flight")
                    self._fail_all(APIError(500, "internal engine error", code="engine_error"))
                    idle_step = True
            self._busy = self._engine.has_unfinished()
            self._publish()
            self._flush()
            if idle_step:
                # The engine has work it cannot schedule yet (or keeps failing): nap instead of spinning,
                # but wake at once for a new command.
                with self._cv:
                    if not self._commands and not self._stopping:
                        self._cv.wait(0.005)

    def _add(self, cmd: _Add) -> None:
        for sub in cmd.subs:
            try:
                ids = self._prompt_ids(sub)
                params = self._sampling_params(sub, len(ids))
                self._engine.add_request(sub.request_id, ids, params)
            except Exception as e:
                if isinstance(e, (APIError, ValueError)):
                    self.metrics.count_rejected()
                    err = e if isinstance(e, APIError) else APIError(400, str(e), code="invalid_value")
                else:
                    logger.exception("add_request failed")
                    err = APIError(500, "internal engine error", code="engine_error")
                self._post(cmd.queue, Update(sub.index, error=err))
                continue
            self._tracks[sub.request_id] = _Track(sub, cmd.queue, cmd.arrival)
            self._post(cmd.queue, Update(sub.index, accepted=True, prompt_tokens=len(ids)))

    def _prompt_ids(self, sub: SubRequest) -> list[int]:
        tok = self._engine.tokenizer
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

    def _abort(self, request_id: str) -> None:
        if self._tracks.pop(request_id, None) is not None:
            self.metrics.count_aborted()
        self._engine.abort(request_id)

    def _dispatch(self, outputs: list[Any]) -> None:
        now = time.monotonic()
        for out in outputs:
            track = self._tracks.get(out.request_id)
            if track is None:  # aborted while its step ran
                continue
            completion = out.outputs[0]
            new_ids = list(completion.token_ids[track.tokens :])
            upd = Update(track.sub.index, text=completion.text[track.chars :], token_ids=new_ids)
            if new_ids:
                if track.tokens == 0:
                    self.metrics.ttft.observe(now - track.arrival)
                else:
                    self.metrics.itl.observe((now - track.last_token) / len(new_ids), len(new_ids))
                track.last_token = now
            if completion.logprobs is not None:
                upd.logprobs = list(completion.logprobs[track.logprobs :])
                track.logprobs += len(upd.logprobs)
                if track.sub.token_strings:
                    upd.token_strs = self._token_strings(upd.logprobs)
            track.tokens += len(new_ids)
            track.chars += len(upd.text)
            if out.finished:
                upd.finish_reason = completion.finish_reason or "stop"
                del self._tracks[out.request_id]
                self.metrics.count_finished(upd.finish_reason)
                self.metrics.e2e.observe(now - track.arrival)
            if upd.text or new_ids or upd.finish_reason:
                self._post(track.queue, upd)

    def _token_strings(self, logprobs: list[dict[int, float]]) -> dict[int, str]:
        cache, decode = self._token_text, self._engine.tokenizer.decode
        out: dict[int, str] = {}
        for entry in logprobs:
            for tid in entry:
                if tid not in cache:
                    cache[tid] = decode([tid])
                out[tid] = cache[tid]
        return out

    def _fail_all(self, error: APIError) -> None:
        for request_id, track in list(self._tracks.items()):
            self._post(track.queue, Update(track.sub.index, error=error))
            try:
                self._abort(request_id)
            except Exception:
                logger.exception("abort of %s failed", request_id)
        self._tracks.clear()

    def _publish(self) -> None:
        try:
            snap = {k: int(v) for k, v in self._engine.memory_stats().items() if isinstance(v, (int, float))}
            stats = self._engine.stats
            for key in ("prompt_tokens_total", "generation_tokens_total", "retractions_total"):
                snap[key] = int(getattr(stats, key, 0))
        except Exception:
            logger.exception("engine memory_stats failed")
            return
        self.snapshot = snap

    def _post(self, queue: asyncio.Queue[list[Update]], update: Update) -> None:
        self._posts.setdefault(id(queue), (queue, []))[1].append(update)

    def _flush(self) -> None:
        if not self._posts or self._loop is None:
            return
        posts, self._posts = list(self._posts.values()), {}
        try:
            self._loop.call_soon_threadsafe(_deliver, posts)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass


def _deliver(posts: list[tuple[asyncio.Queue[list[Update]], list[Update]]]) -> None:
    for queue, updates in posts:
        queue.put_nowait(updates)
