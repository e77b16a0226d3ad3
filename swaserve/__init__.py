"""swaserve: an inference engine and OpenAI-compatible server for hybrid sliding-window-attention LLMs."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["LLM", "SamplingParams", "RequestOutput"]
__version__ = "0.1.0"

if TYPE_CHECKING:
    from swaserve.llm import LLM
    from swaserve.request import RequestOutput, SamplingParams


def __getattr__(name: str) -> Any:
    # Lazy: `import swaserve` stays cheap for the CLI's --help.
    if name == "LLM":
        from swaserve.llm import LLM

        return LLM
    if name in ("SamplingParams", "RequestOutput"):
        from swaserve import request

        return getattr(request, name)
    raise AttributeError(name)
