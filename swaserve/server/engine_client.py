"""EngineClient: the frontend's side of the engine core(s). Tokenizes (chat templates included), sends
requests to a core process (one of `--data-parallel-size` replicas, `CorePool`), reads their per-step
outputs on the event loop, detokenizes incrementally (stop strings end a request here), and hands
`Update`s to per-request asyncio queues (`server/track.py`: a request in flight, and what one step
adds to its update).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

from swaserve.chat import ParsedReply, chat_for
from swaserve.core.engine_core import CoreSpec
from swaserve.core.messages import AbortRequests, AddRequest, RequestDelta, StepOutputs
from swaserve.core.request_trace import RequestTrace
from swaserve.detokenizer import IncrementalDetokenizer
from swaserve.server.api_errors import APIError
from swaserve.server.core_pool import CorePool, replica_specs
from swaserve.server.generation import Generation
from swaserve.server.inputs import prompt_ids, sampling_params
from swaserve.server.messages import SubRequest, Update
from swaserve.server.metrics import ServerMetrics
from swaserve.server.tools import ToolReply
from swaserve.server.track import TokenNames, Track

logger = logging.getLogger(__name__)
LIVENESS_POLL_MS = 200  # with no output for this long, check that a core is still alive

_SHUTTING_DOWN = APIError(503, "server is shutting down", code="shutting_down")
_CORE_DEAD = APIError(500, "the engine core process died; the server is restarting or exiting", code="engine_dead")
_ENGINE_ERROR = APIError(500, "internal engine error", code="engine_error")


class EngineClient:
    """Frontend handle on the engine-core processes (`data_parallel_size` replicas of `spec`).

    Invariants: only the event loop touches this object after `start()`; every open sub-request has
    a `Track` naming its replica, and leaves it exactly once (finished, stopped by a stop string,
    aborted, refused or failed; `_untrack`, which also ends its count in the pool), and its core is
    told to abort every one that leaves it unfinished. When any core dies, every open request gets a
    500 at once, `alive` turns False (/health: 503), and `on_fatal` runs (the server exits).
    """

    def __init__(self, spec: CoreSpec, tokenizer: Any, metrics: ServerMetrics | None = None,
                 stream_interval: int = 1, on_fatal: Callable[[], None] | None = None,
                 data_parallel_size: int = 1, frontend: int = 0,
                 endpoints: list[tuple[str, str]] | None = None, separate_reasoning: bool = True):
        """`frontend`, `endpoints`: this process's index among several frontends and its (input, output)
        addresses to each replica's core, which another process starts (`server/frontends.py`).
        `separate_reasoning`: chat replies of models with a reasoning format put it in `reasoning_content`
        (a request's `separate_reasoning` overrides). ValueError when the model's chat format cannot load
        (GPT-OSS without its vocabulary)."""
        self.spec = spec
        self.data_parallel_size = data_parallel_size
        self.frontend, self.endpoints = frontend, endpoints
        self.tokenizer = tokenizer
        self.chat = chat_for(tokenizer)
        self.separate_reasoning = separate_reasoning
        self.metrics = metrics or ServerMetrics()
        self.stream_interval = max(1, int(stream_interval))
        self.on_fatal = on_fatal
        self.snapshots: list[dict[str, int]] = []  # per replica: its engine counters after its last step
        self.cores: CorePool | None = None
        self.model_name = "swaserve"
        self.max_context = 0
        self.core_died = False
        self._stopping = False
        self._tracks: dict[str, Track] = {}
        self._posts: dict[int, tuple[asyncio.Queue[list[Update]], list[Update]]] = {}
        self._names = TokenNames(tokenizer)
        self._readers: list[asyncio.Task] = []
        self.requests = RequestTrace(f"frontend{frontend}")  # first-token times (off unless its env is set)

    # ---- lifecycle ---------------------------------------------------------------------------------

    def start_core(self) -> None:
        """Start the engine cores and wait until all are ready (before the HTTP server starts); ValueError
        for a bad `data_parallel_size` (more replicas than GPUs) or bad engine input."""
        specs = ([self.spec] * len(self.endpoints) if self.endpoints is not None  # started elsewhere
                 else replica_specs(self.spec, self.data_parallel_size))
        pool = CorePool(specs, self.endpoints)
        ready = pool.start()  # kills every core it started if one fails
        self.cores, self.snapshots = pool, [{} for _ in range(len(pool))]
        self.model_name, self.max_context = ready.model_name, ready.max_context

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start reading the cores' outputs on the running event loop (one reader per replica)."""
        assert self.cores is not None, "start_core() first"
        self._readers = [asyncio.ensure_future(self._read(i, zmq.asyncio.Socket.from_socket(core.outputs)))
                         for i, core in enumerate(self.cores.cores)]

    async def stop(self, timeout: float = 30.0) -> None:
        """Fail what is still open with a 503, stop the readers and the cores (waiting up to `timeout` s)."""
        self._stopping = True
        self._fail_all(_SHUTTING_DOWN)
        self.requests.close()
        for reader in self._readers:
            reader.cancel()
        await asyncio.to_thread(self.stop_cores, timeout)

    def stop_cores(self, timeout: float = 30.0) -> None:
        """Stop every core (any thread; `stop()` does it on the event loop, launch after a forced exit)."""
        cores, self.cores = self.cores, None
        if cores is not None:
            cores.stop(timeout)

    @property
    def alive(self) -> bool:
        return self.cores is not None and not self._stopping and not self.core_died

    @property
    def core_pids(self) -> list[int | None]:
        cores = self.cores  # read once: `stop_cores` may clear it from another thread
        return cores.pids if cores is not None else []

    @property
    def in_flight(self) -> list[int]:
        """Sub-requests in flight per replica (what routing balances)."""
        cores = self.cores
        return list(cores.in_flight) if cores is not None else [0] * len(self.snapshots)

    # ---- requests ----------------------------------------------------------------------------------

    def splits_reasoning(self, requested: bool | None) -> bool:
        """Whether a chat request's replies put their reasoning in `reasoning_content` (`requested`: the
        request's `separate_reasoning`, None for the server's setting)."""
        return self.chat.has_reasoning and (self.separate_reasoning if requested is None else requested)

    def generate(self, subs: list[SubRequest], arrival: float | None = None) -> Generation:
        """Send `subs` (one API request's sequences) to a core; `arrival`: when the request reached the
        server (its route handler's start; default now), what TTFT and E2E are counted from."""
        if not self.alive:
            raise _CORE_DEAD if self.core_died else _SHUTTING_DOWN
        gen = Generation(subs, abort=self.abort)
        arrival = time.monotonic() if arrival is None else arrival
        cores = self.cores
        assert cores is not None
        replica = cores.pick()  # n > 1: every choice on one replica
        for sub in subs:
            try:
                ids = prompt_ids(self.tokenizer, self.chat, sub)
                params = sampling_params(sub, len(ids), self.max_context)
            except (APIError, ValueError) as e:
                self.metrics.count_rejected()
                gen.queue.put_nowait([Update(sub.index, error=e if isinstance(e, APIError) else
                                             APIError(400, str(e), code="invalid_value"))])
                continue
            sampling = {k: v for k, v in sub.sampling.items() if k != "stop"}
            sampling["max_tokens"] = params.max_tokens
            # With tools the markers of the model's call format are text to parse: the content keeps them.
            tools = sub.tool_plan is not None
            parser = (self.chat.reply_parser(sub.separate_reasoning, ids, tool_markers=tools)
                      if sub.messages is not None else None)
            detok: IncrementalDetokenizer | ParsedReply | ToolReply
            if parser is not None:
                detok = ParsedReply(parser, stop=params.stop)
                sampling["stop_token_ids"] = [*params.stop_token_ids, *self.chat.stop_token_ids]
            else:
                detok = IncrementalDetokenizer(self.tokenizer, ids, stop=params.stop, skip_special_tokens=not tools)
            if sub.tool_plan is not None:  # reasoning (a ParsedReply's) first, calls from the content
                detok = ToolReply(detok, sub.tool_plan, getattr(self.chat, "tool_family", "hermes"))
            keep = sub.echo or params.prompt_logprobs is not None
            self._tracks[sub.request_id] = Track(sub, gen.queue, arrival, len(ids), detok, replica,
                                                  ids if keep else None)
            cores.add(replica, AddRequest(sub.request_id, ids, sampling, self.frontend))
            self.requests.arrived(sub.request_id, arrival, time.monotonic())
        return gen

    def abort(self, request_id: str) -> None:
        track = self._untrack(request_id)
        if track is not None:
            self.metrics.count_aborted()
            self._tell_abort(track.replica, [request_id])

    def _untrack(self, request_id: str) -> Track | None:
        track = self._tracks.pop(request_id, None)
        self.requests.forget(request_id)
        if track is not None and self.cores is not None:
            self.cores.done(track.replica)
        return track

    def _tell_abort(self, replica: int, request_ids: list[str]) -> None:
        if self.cores is not None and not self.core_died:
            self.cores.send(replica, AbortRequests(request_ids))

    # ---- outputs -----------------------------------------------------------------------------------

    async def _read(self, replica: int, sock: zmq.asyncio.Socket) -> None:
        assert self.cores is not None
        core = self.cores.cores[replica]
        try:
            while True:
                try:  # a plain receive (a poll first would add a zmq Poller and a loop turn to every message)
                    raw = await asyncio.wait_for(sock.recv(), LIVENESS_POLL_MS / 1000)
                except asyncio.TimeoutError:  # (TimeoutError itself from Python 3.11)
                    if not core.alive:
                        break
                    continue
                msg = core.codec.decode_from_core(raw)
                if isinstance(msg, StepOutputs):
                    later = self._on_step(replica, msg)
                    if later:  # the first tokens' streams write before the others' next tokens are decoded
                        await asyncio.sleep(0)
                        self._on_later(later)
        except asyncio.CancelledError:
            return
        except Exception:
            logger.exception("reading the engine core's outputs failed")
        if not self._stopping and not self.core_died:  # one death fails everything once
            code = core.returncode
            logger.error("the engine core died (replica %d of %d, exit code %s); failing every open request",
                         replica, len(self.snapshots), code)
            self.core_died = True
            self._fail_all(_CORE_DEAD)
            if self.on_fatal is not None:
                self.on_fatal()

    def _on_step(self, replica: int, msg: StepOutputs) -> list[tuple[Track, RequestDelta]]:
        """Post a step's news and its first tokens (detokenized and flushed, so their streams wake ahead of
        the running requests'); returns the running requests' deltas, for `_on_later` once those streams
        have written (a step of ~40 running requests takes ~1 ms of this loop to detokenize)."""
        self.snapshots[replica] = msg.counters
        for rid in msg.accepted:
            track = self._tracks.get(rid)
            if track is not None:
                track.accepted = True
                self._post(track, Update(track.sub.index, accepted=True, prompt_tokens=track.prompt_tokens))
        for rej in msg.rejected:
            track = self._untrack(rej.request_id)
            if track is not None:
                self.metrics.count_rejected()
                err = APIError(400, rej.message, code="invalid_value") if rej.status == 400 else _ENGINE_ERROR
                self._post(track, Update(track.sub.index, error=err))
        for rid in msg.failed:
            track = self._untrack(rid)
            if track is not None:
                self._post(track, Update(track.sub.index, error=_ENGINE_ERROR))
        now = time.monotonic()
        tracks, later = self._tracks, []
        for delta in msg.deltas:
            track = tracks.get(delta.request_id)
            if track is None:  # aborted or stopped here while its step ran
                continue
            if track.tokens:
                later.append((track, delta))
            else:
                self._on_delta(track, delta, now)
        self._flush()
        return later

    def _on_later(self, later: list[tuple[Track, RequestDelta]]) -> None:
        now = time.monotonic()
        tracks = self._tracks
        for track, delta in later:
            if tracks.get(delta.request_id) is track:  # not aborted (client gone) or failed meanwhile
                self._on_delta(track, delta, now)
        self._flush()

    def _on_delta(self, track: Track, delta: RequestDelta, now: float) -> None:
        first = track.tokens == 0
        upd, new_ids, finish, stopped_here = track.absorb(delta, self._names)
        if stopped_here:  # a stop string (seen here, not by the core) ended it
            self._tell_abort(track.replica, [delta.request_id])
        if new_ids:
            if first:
                self.metrics.ttft.observe(now - track.arrival)
                self.requests.first_token(delta.request_id, now)
            else:
                self.metrics.itl.observe((now - track.last_token) / len(new_ids), len(new_ids))
            track.last_token = now
        if finish is not None:
            upd.finish_reason = finish
            self._untrack(delta.request_id)
            self.metrics.count_finished(finish)
            self.metrics.e2e.observe(now - track.arrival)
        elif not (upd.text or upd.token_ids or upd.prompt_ids is not None):
            return
        elif not track.sub.stream or (track.posted and len(upd.token_ids) < self.stream_interval):
            track.pending = upd  # stream_interval: the first token goes at once, then every N
            return
        track.posted = True
        self._post(track, upd)

    def _fail_all(self, error: APIError) -> None:
        """End every open sub-request with `error` (shutdown, or a dead core: no core is told)."""
        for track in list(self._tracks.values()):
            self._untrack(track.sub.request_id)
            self._post(track, Update(track.sub.index, error=error))
        self._flush()

    def _post(self, track: Track, update: Update) -> None:
        self._posts.setdefault(id(track.queue), (track.queue, []))[1].append(update)

    def _flush(self) -> None:
        posts, self._posts = self._posts, {}
        for queue, updates in posts.values():
            queue.put_nowait(updates)
