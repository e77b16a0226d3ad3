"""StructuredOutputs: the constraint a request's output must follow (a JSON schema, any JSON object, a regex,
one of a list of strings, or an EBNF grammar), vLLM's `StructuredOutputsParams` names. Plain data checked
for shape here; whether a schema or pattern compiles is the grammar compiler's check (`swaserve.grammar`)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputs:
    """Exactly one of the constraint fields is set. `json`: a JSON schema (a dict, or its JSON text);
    `json_object`: any JSON object; `regex`; `choice`: the output is one of these strings; `grammar`: EBNF
    (GBNF-style, as xgrammar reads it). `disable_any_whitespace`: JSON without free whitespace between
    tokens (compact output; fewer tokens a small model can wander into).

    Invariant after construction: `kind` names the one field set; `key` is a hashable, canonical text of
    the constraint (equal constraints have equal keys: the compiled-grammar cache's key)."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured_outputs needs exactly one of json, regex, choice, grammar, json_object; "
                             f"got {', '.join(given) if given else 'none'}")
        if isinstance(self.json, str):
            try:
                object.__setattr__(self, "json", json.loads(self.json))
            except ValueError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
        if self.json is not None and not isinstance(self.json, dict):
            raise ValueError(f"structured_outputs.json must be a JSON schema object, got {type(self.json).__name__}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", list(self.choice))
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise ValueError("structured_outputs.json_object must be a bool")
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError("structured_outputs.disable_any_whitespace must be a bool")

    @classmethod
    def coerce(cls, value: StructuredOutputs | dict[str, Any]) -> StructuredOutputs:
        """From itself or its dict form (what crosses the engine-core IPC); ValueError for unknown keys."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"structured_outputs must be an object, got {type(value).__name__}")
        unknown = set(value) - {*KINDS, "disable_any_whitespace"}
        if unknown:
            raise ValueError(f"structured_outputs: unknown field(s) {', '.join(sorted(unknown))}; "
                             f"known: {', '.join(KINDS)}, disable_any_whitespace")
        return cls(**value)

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (only the fields set), what `coerce` reads back."""
        return {k: v for k, v in asdict(self).items() if v not in (None, False)}
