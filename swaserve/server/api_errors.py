"""The OpenAI-style error body (`APIError`: status, message, type, param, code) and the 400 a request
that fails schema validation gets, naming the offending field."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

_ERROR_TYPES = {401: "authentication_error", 404: "invalid_request_error", 413: "invalid_request_error"}


class APIError(Exception):
    """An error answered to the client as `{"error": {message, type, param, code}}` with `status`."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None,
        type: str | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _ERROR_TYPES.get(status) or (
            "server_error" if status >= 500 else "invalid_request_error"
        )

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def validation_error(exc: ValidationError) -> APIError:
    """A pydantic error as a 400 naming the offending field (and how many other fields are wrong)."""
    errors = exc.errors(include_url=False)
    if errors[0]["type"] == "json_invalid":
        return APIError(400, f"malformed JSON body: {errors[0]['msg']}", code="invalid_json")
    # Our own validators' messages say the most; among a union's branch errors, prefer them.
    first = next((e for e in errors if e["type"] == "value_error"), errors[0])
    loc = _field_path(first["loc"])
    param = ".".join(loc) or None
    msg = first["msg"].removeprefix("Value error, ")
    if first["type"] == "model_type" and not loc:
        msg = "request body must be a JSON object"
    text = f"{param}: {msg}" if param else msg
    if "input" in first and first["type"] not in ("missing", "model_type", "value_error") and param:
        text += f" (got {short_repr(first['input'])})"
    others = {".".join(_field_path(e["loc"])) for e in errors} - {param or ""}
    if others:
        text += f" (and {len(others)} more invalid field{'s' if len(others) > 1 else ''})"
    return APIError(400, text, param=param, code="invalid_value")


_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _field_path(loc: tuple[int | str, ...]) -> list[str]:
    # Drop pydantic's union-branch labels ("str", "list[ContentPart]", "constrained-int") from the path.
    return [str(p) for p in loc
            if isinstance(p, int) or not ("[" in p or "-" in p or p in _UNION_TAGS)]


def short_repr(value: Any) -> str:
    s = repr(value)
    return s if len(s) <= 60 else s[:57] + "..."
