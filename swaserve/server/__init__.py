"""OpenAI-compatible HTTP frontend: FastAPI app, the engine-core client, metrics, launch helpers."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["EngineClient", "build_server", "create_app", "run_server", "serve_main"]

if TYPE_CHECKING:
    from swaserve.server.app import create_app
    from swaserve.server.engine_client import EngineClient
    from swaserve.server.launch import build_server, run_server, serve_main


def __getattr__(name: str) -> Any:
    # Lazy: importing the package (e.g. for the CLI's --help) must not import fastapi/uvicorn.
    if name == "create_app":
        from swaserve.server.app import create_app

        return create_app
    if name == "EngineClient":
        from swaserve.server.engine_client import EngineClient

        return EngineClient
    if name in ("build_server", "run_server", "serve_main"):
        from swaserve.server import launch

        return getattr(launch, name)
    raise AttributeError(name)
