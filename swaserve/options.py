"""Command-line flags derived from the option declarations in `swaserve.config` (each engine and server
option is declared once there: name, type, default, help); every entry point builds its flags here.
"""

from __future__ import annotations

import argparse
import os
import typing
from dataclasses import MISSING, Field, fields
from typing import Any

from swaserve.config import ENGINE_OPTION_OWNERS, ServerConfig


def _flag_type(cls: type, f: Field) -> type:
    hint = typing.get_type_hints(cls)[f.name]
    args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    return args[0]


def _cli_fields(cls: type) -> list[tuple[Field, type]]:
    return [(f, _flag_type(cls, f)) for f in fields(cls) if f.metadata.get("cli", True) and "help" in f.metadata]


def _add_field(group: Any, cls: type, f: Field, kind: type) -> None:
    meta = f.metadata
    flag = "--" + meta.get("flag", f.name.replace("_", "-"))
    default = f.default if f.default is not MISSING else None
    shown = default // meta["scale"] if meta.get("scale") and default is not None else default
    help_text = meta["help"] + ("" if shown is None or shown is False else f" (default: {shown})")
    if kind is bool:
        action = "store_true" if default is False else argparse.BooleanOptionalAction
        group.add_argument(flag, dest=f.name, action=action, default=None, help=help_text)
        for alias in meta.get("aliases", ()):
            group.add_argument(alias, dest=f.name, action="store_const", const=False, help=argparse.SUPPRESS)
        return
    metavar = None if meta.get("choices") else flag[2:].replace("-", "_").upper()
    group.add_argument(flag, *meta.get("alt_flags", ()), dest=f.name, type=kind, default=None, choices=meta.get("choices"), metavar=metavar,
                       help=help_text)


def add_model_flags(parser: argparse.ArgumentParser) -> None:
    """What to load and where: --model, --device, --dtype."""
    g = parser.add_argument_group("model")
    g.add_argument("--model", default=None, help="GGUF file or HF model directory (default: embedded Gemma 3 270M)")
    g.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    g.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: bf16 on GPU, fp32 on CPU)")


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per field of the cache, scheduler and runner configs."""
    g = parser.add_argument_group("engine")
    for cls in ENGINE_OPTION_OWNERS:
        for f, kind in _cli_fields(cls):
            _add_field(g, cls, f, kind)


def add_server_flags(parser: argparse.ArgumentParser, only: tuple[str, ...] | None = None) -> None:
    """One flag per `ServerConfig` field (`only`: a subset, e.g. `swaserve generate` takes chat_template)."""
    g = parser.add_argument_group("server")
    for f, kind in _cli_fields(ServerConfig):
        if only is None or f.name in only:
            _add_field(g, ServerConfig, f, kind)


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """Engine keyword arguments for the flags that were given (the others keep the config defaults)."""
    out: dict[str, Any] = {}
    for cls in ENGINE_OPTION_OWNERS:
        for f, _ in _cli_fields(cls):
            value = getattr(args, f.name, None)
            if value is not None:
                out[f.name] = value * f.metadata["scale"] if f.metadata.get("scale") else value
    return out


def server_config(args: argparse.Namespace) -> ServerConfig:
    """ServerConfig from the flags given, environment defaults (e.g. $SWASERVE_API_KEY), then the declared ones."""
    kw: dict[str, Any] = {}
    for f, _ in _cli_fields(ServerConfig):
        value = getattr(args, f.name, None)
        if value is None and f.metadata.get("env"):
            value = os.environ.get(f.metadata["env"]) or None
        if value is not None:
            kw[f.name] = value
    config = ServerConfig(**kw)
    if config.stream_interval < 1:
        raise ValueError("stream_interval must be >= 1")
    if config.max_body_bytes < 1:
        raise ValueError("max_body_bytes must be >= 1")
    if config.data_parallel_size < 1:
        raise ValueError(f"data_parallel_size must be >= 1, got {config.data_parallel_size}")
    if config.api_server_count < 1:
        raise ValueError(f"api_server_count must be >= 1, got {config.api_server_count}")
    return config


def add_serve_flags(parser: argparse.ArgumentParser) -> None:
    """Every flag of `swaserve serve` (and `python -m swaserve.server`, which takes the same ones)."""
    add_model_flags(parser)
    add_engine_flags(parser)
    add_server_flags(parser)
