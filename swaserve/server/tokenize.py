"""/tokenize and /detokenize (vLLM's routes and shapes): a prompt or chat messages to token ids, as the
completion routes would encode them, and token ids back to text."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from pydantic import model_validator
from starlette.responses import JSONResponse, Response

from swaserve.server.api_errors import APIError
from swaserve.server.protocol import ChatMessage, _Strict


class TokenizeRequest(_Strict):
    """Either `prompt` (text, encoded with the model's special tokens unless `add_special_tokens` is false)
    or `messages` (through the chat format, with the generation prompt unless `add_generation_prompt` is
    false)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt; chat templates write their own
    add_generation_prompt: bool | None = True
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool | None = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        if self.messages is not None and not self.messages:
            raise ValueError("messages must not be empty")
        return self


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


def add_tokenize_routes(app: FastAPI, client: Any, check_model: Callable[[str | None], None],
                        parse: Callable[[Request, type], Awaitable[Any]]) -> None:
    """`parse(request, model)`: the app's body reader (size limit, UTF-8, validation as a 400)."""

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        req: TokenizeRequest = await parse(request, TokenizeRequest)
        check_model(req.model)
        tok = client.tokenizer
        try:
            if req.messages is not None:
                ids = _chat_ids(client, req)
            else:
                ids = tok.encode(req.prompt, add_special_tokens=req.add_special_tokens is not False)
        except ValueError as e:
            raise APIError(400, str(e), param="messages" if req.messages is not None else "prompt") from e
        body: dict[str, Any] = {"count": len(ids), "max_model_len": client.max_context, "tokens": ids,
                                "token_strs": None}
        if req.return_token_strs:
            body["token_strs"] = tok.hf.convert_ids_to_tokens(ids)
        return JSONResponse(body)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        req: DetokenizeRequest = await parse(request, DetokenizeRequest)
        check_model(req.model)
        try:
            text = client.tokenizer.decode(req.tokens)
        except ValueError as e:
            raise APIError(400, f"tokens: {e}", param="tokens") from e
        return JSONResponse({"prompt": text})


def _chat_ids(client: Any, req: TokenizeRequest) -> list[int]:
    """The chat prompt's ids as the chat route builds them (harmony or the template, generation prompt on)."""
    messages = [m.as_template_dict() for m in req.messages or []]
    if req.add_generation_prompt is not False:
        return list(client.chat.prompt_ids(messages, template_kwargs=req.chat_template_kwargs))
    text = client.tokenizer.apply_chat_template(messages, add_generation_prompt=False,
                                                template_kwargs=req.chat_template_kwargs)
    return list(client.tokenizer.encode(text, add_special_tokens=bool(req.add_special_tokens)))
