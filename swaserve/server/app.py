"""The FastAPI app: OpenAI routes (/v1/completions, /v1/chat/completions, /v1/models), /health, /metrics,
request parsing with a body-size limit, API-key check, OpenAI-style errors, and client-disconnect aborts.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from swaserve.server.api_errors import APIError, validation_error
from swaserve.server.engine_client import EngineClient
from swaserve.server.generation import Generation
from swaserve.server.messages import SubRequest
from swaserve.server.protocol import ChatCompletionRequest, CompletionRequest
from swaserve.server.responses import Choices, dumps, stream_chunks
from swaserve.server.tokenize import add_tokenize_routes
from swaserve.server.tools import chat_constraints, check_structured

logger = logging.getLogger(__name__)
DEFAULT_MAX_BODY_BYTES = 8 << 20
_DRAIN_LIMIT = 64 << 20  # past this an oversized body is not read to its end before the 413
T = TypeVar("T", bound=BaseModel)


def create_app(
    engine_client: EngineClient,
    served_model_name: str | None = None,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> FastAPI:
    """The app over started engine cores (`client.start_core()`); its lifespan starts reading the cores'
    outputs and, on shutdown, fails what is left and stops the cores."""
    client = engine_client
    model_name = served_model_name or client.model_name
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        client.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            await client.stop()

    app = FastAPI(title="swaserve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine_client = client
    app.state.model_name = model_name
    if api_key:
        app.add_middleware(_BearerAuth, api_key=api_key)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> Response:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> Response:
        return JSONResponse(APIError(400, f"invalid request: {exc.errors()}").body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Response:
        message = {404: f"no route {request.url.path}", 405: f"method {request.method} not allowed"}
        err = APIError(exc.status_code, message.get(exc.status_code, str(exc.detail)), code=str(exc.status_code))
        return JSONResponse(err.body(), status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> Response:
        # Starlette re-raises after answering, so the traceback still reaches the server log.
        return JSONResponse(APIError(500, "internal server error").body(), status_code=500)

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise APIError(404, f"The model `{name}` does not exist; this server serves `{model_name}`.",
                           param="model", code="model_not_found")

    @app.get("/health")
    async def health() -> Response:
        if not client.alive:
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        text = client.metrics.render(client.snapshots, model_name, client.in_flight)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    def model_card() -> dict[str, Any]:
        return {"id": model_name, "object": "model", "created": created, "owned_by": "swaserve",
                "max_model_len": client.max_context}

    @app.get("/v1/models")
    async def list_models() -> Response:
        return JSONResponse({"object": "list", "data": [model_card()]})

    @app.get("/v1/models/{name:path}")
    async def get_model(name: str) -> Response:
        check_model(name)
        return JSONResponse(model_card())

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        arrival = time.monotonic()
        req = await _parse(request, CompletionRequest, max_body_bytes)
        check_model(req.model)
        rid, n = f"cmpl-{uuid.uuid4().hex}", req.num_choices
        echo_only = bool(req.echo) and req.max_tokens == 0  # the engine runs one token, which is not reported
        max_tokens = 1 if echo_only else (req.max_tokens or 16)
        prompt_lps = req.engine_prompt_logprobs
        constraint = (check_structured(req.structured_outputs, "structured_outputs")
                      if req.structured_outputs is not None else None)
        subs = [
            SubRequest(
                f"{rid}-{p * n + j}", p * n + j, prompt=prompt,
                sampling={**req.sampling_kwargs(seed_offset=j), "max_tokens": max_tokens, "logprobs": req.logprobs,
                          "prompt_logprobs": prompt_lps,
                          # echo alone generates nothing to constrain (checked all the same)
                          "structured_outputs": None if echo_only else constraint},
                token_strings=req.logprobs is not None or prompt_lps is not None, stream=bool(req.stream),
                echo=bool(req.echo), echo_only=echo_only,
            )
            for p, prompt in enumerate(req.prompts)
            for j in range(n)
        ]
        head = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model_name}
        choices = Choices(len(subs), n, chat=False, logprobs=req.logprobs, prompt_logprobs=req.prompt_logprobs,
                          echo=bool(req.echo))
        return await _respond(request, client.generate(subs, arrival), head, choices, req.stream, req.include_usage)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        arrival = time.monotonic()
        req = await _parse(request, ChatCompletionRequest, max_body_bytes)
        check_model(req.model)
        if req.reasoning_effort is not None and not client.chat.has_reasoning:
            raise APIError(400, "reasoning_effort applies only to models with a reasoning format (GPT-OSS)",
                           param="reasoning_effort")
        rid, messages = f"chatcmpl-{uuid.uuid4().hex}", [m.as_template_dict() for m in req.messages]
        logprobs = req.engine_logprobs
        split = client.splits_reasoning(req.separate_reasoning)
        # A constrained reply (response_format, structured_outputs, a forced tool call) is content from its
        # first token: the grammar leaves no room for a reasoning block, so it is read as written (with
        # `reasoning_content` null where the reasoning would have been split out).
        plan, constraint = chat_constraints(req)
        subs = [
            SubRequest(
                f"{rid}-{j}", j, messages=messages,
                sampling={**req.sampling_kwargs(seed_offset=j), "max_tokens": req.max_new_tokens,
                          "logprobs": logprobs, "structured_outputs": constraint},
                token_strings=logprobs is not None or req.prompt_logprobs is not None, stream=bool(req.stream),
                reasoning_effort=req.reasoning_effort, separate_reasoning=split and constraint is None,
                include_reasoning=req.include_reasoning is not False, template_kwargs=req.chat_template_kwargs,
                tools=plan.prompt_tools if plan is not None else None,
                tool_plan=plan if plan is not None and plan.mode != "none" else None,
            )
            for j in range(req.num_choices)
        ]
        head = {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model_name}
        choices = Choices(len(subs), len(subs), chat=True, logprobs=logprobs,
                          reasoning=split and req.include_reasoning is not False, prompt_logprobs=req.prompt_logprobs)
        return await _respond(request, client.generate(subs, arrival), head, choices, req.stream, req.include_usage)

    add_tokenize_routes(app, client, check_model, lambda request, model: _parse(request, model, max_body_bytes))
    return app


async def _respond(
    request: Request, gen: Generation, head: dict[str, Any], choices: Choices, stream: bool | None,
    include_usage: bool,
) -> Response:
    await gen.start()  # raises the engine's refusal (prompt too long, ...) as a 400 before any byte is sent
    if stream:
        chunk_head = {**head, "object": head["object"] + ".chunk"} if choices.chat else head
        return _SSEResponse(stream_chunks(gen, chunk_head, choices, include_usage), on_close=gen.close)
    try:
        await _until_disconnect(request.receive, _collect(gen, choices))
    except _ClientGone:
        return Response(status_code=499)
    finally:
        gen.close()
    return Response(dumps(choices.body(head, gen.prompt_tokens)), media_type="application/json")


async def _collect(gen: Generation, choices: Choices) -> None:
    async for batch in gen.updates():
        for upd in batch:
            choices.add(upd)


class _ClientGone(Exception):
    """The client disconnected before its response was ready."""


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _until_disconnect(receive: Receive, work: Any) -> None:
    """Run `work`; raise _ClientGone (cancelling it) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        task.cancel()
    if not task.done() or task.cancelled():
        raise _ClientGone
    task.result()


class _SSEResponse(StreamingResponse):
    """An SSE stream that notices a vanished client even between chunks, and always runs `on_close`."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None]):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await _until_disconnect(receive, self.stream_response(send))
        except (_ClientGone, OSError):
            pass
        finally:
            self._on_close()


async def _parse(request: Request, model: type[T], limit: int) -> T:
    body = await _read_body(request, limit)
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"request body is not valid UTF-8 (byte {e.start})", code="invalid_encoding") from e
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise validation_error(e) from None


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and not declared.isdigit():
        raise APIError(400, "invalid Content-Length header")
    if declared is not None and int(declared) > _DRAIN_LIMIT:
        raise APIError(413, f"request body exceeds the limit of {limit} bytes", code="body_too_large")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size <= limit:
            chunks.append(chunk)
        elif size > _DRAIN_LIMIT:
            break
    # The body is read to its end (up to _DRAIN_LIMIT) before a 413: a client still writing it would
    # otherwise see a connection reset instead of the answer.
    if size > limit or (declared is not None and int(declared) > limit):
        raise APIError(413, f"request body exceeds the limit of {limit} bytes", code="body_too_large")
    return b"".join(chunks)


class _BearerAuth:
    """401 for /v1 routes without `Authorization: Bearer <api_key>`; /health and /metrics stay open."""

    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self._expected):
                err = APIError(401, "missing or invalid API key (expected `Authorization: Bearer <key>`)",
                               code="invalid_api_key")
                await JSONResponse(err.body(), status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)
