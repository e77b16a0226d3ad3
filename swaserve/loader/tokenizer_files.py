"""A tokenizer's files: GGUF `tokenizer.*` metadata converted once into a HF `tokenizer.json` (plus what
the conversion cannot hold: special tokens, chat template, extra stop ids), cached by content; and the
quiet construction of HF tokenizers."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_CACHE_VERSION = "1"  # bump when the cached files' meaning changes


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    # Tokenizer construction logs harmless notices (e.g. "deriving merges"); a normal start prints nothing.
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def gguf_tokenizer_entry(meta: dict[str, Any], root: Path) -> Path:
    """The cache entry (`tokenizer.json` + `swaserve.json`) of the tokenizer in GGUF metadata `meta`, under
    `root`: converted now unless an earlier load (any copy of the file) left it."""
    entry = root / content_key(meta)
    if not (entry / "swaserve.json").is_file():
        shutil.rmtree(entry, ignore_errors=True)  # a partial entry left by hand; rebuild it
        convert_into(meta, entry)
    return entry


def content_key(meta: dict[str, Any]) -> str:
    # Keyed on the tokenizer's content, not the file's path or mtime: copies share one entry.
    digest = hashlib.sha256(_CACHE_VERSION.encode())
    for k in sorted(k for k in meta if k.startswith("tokenizer.")):
        v = meta[k]
        digest.update(k.encode())
        digest.update(
            v.tobytes()
            if hasattr(v, "tobytes")
            else "\x00".join(v).encode()
            if isinstance(v, list)
            else repr(v).encode()
        )
    return digest.hexdigest()[:24]


def convert_into(meta: dict[str, Any], entry: Path) -> None:
    try:
        from transformers.integrations.gguf import convert_gguf_tokenizer
    except ImportError:  # transformers < 5
        from transformers.integrations.ggml import (  # type: ignore[attr-defined,no-redef]
            convert_gguf_tokenizer,
        )

    def g(key: str) -> Any:
        return meta.get(f"tokenizer.ggml.{key}")

    tokens: list[str] = g("tokens")
    kind = g("model")
    tok_dict: dict[str, Any] = {
        "tokenizer_type": kind,
        "pre_tokenizer_type": g("pre"),
        "tokens": tokens,
        "scores": g("scores").tolist() if g("scores") is not None else None,
        "token_type": g("token_type").tolist() if g("token_type") is not None else None,
    }
    if g("merges") is not None:
        tok_dict["merges"] = g("merges")
    if g("add_space_prefix") is not None:
        tok_dict["add_prefix_space"] = bool(g("add_space_prefix"))
    tok_dict = {k: v for k, v in tok_dict.items() if v is not None}
    with quiet_transformers():
        backend, _ = convert_gguf_tokenizer(meta["general.architecture"], tok_dict)

    def name(key: str) -> str | None:
        token_id = g(key)
        return tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None

    # llama.cpp adds BOS to sentencepiece ("llama") vocabularies unless the file says otherwise.
    add_bos = g("add_bos_token") if g("add_bos_token") is not None else kind == "llama"
    hf_kwargs = {
        "bos_token": name("bos_token_id"), "eos_token": name("eos_token_id"),
        "unk_token": name("unknown_token_id"), "pad_token": name("padding_token_id"),
        "add_bos_token": bool(add_bos), "add_eos_token": bool(g("add_eos_token")),
    }  # fmt: skip
    info = {
        "hf_kwargs": {k: v for k, v in hf_kwargs.items() if v is not None},
        "chat_template": meta.get("tokenizer.chat_template"),
        "extra_eos_ids": [int(g(k)) for k in ("eot_token_id", "eom_token_id") if g(k) is not None],
    }
    tmp = entry.with_name(f".{entry.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    backend.save(str(tmp / "tokenizer.json"))
    (tmp / "swaserve.json").write_text(json.dumps(info))
    try:
        os.replace(tmp, entry)  # atomic: readers see the whole entry or none
    except OSError:  # another process finished first; its entry is identical
        shutil.rmtree(tmp, ignore_errors=True)
