"""The o200k_base vocabulary file openai-harmony reads (`o200k_base.tiktoken` in $TIKTOKEN_ENCODINGS_BASE):
taken from that variable when set, else regenerated offline from the model's own byte-level BPE vocabulary."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

ENV = "TIKTOKEN_ENCODINGS_BASE"
FILE_NAME = "o200k_base.tiktoken"
SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"  # what harmony checks
NUM_RANKS = 199_998  # o200k_base's mergeable ranks: ids 0..199997 of GPT-OSS's o200k_harmony


def byte_decoder() -> dict[str, int]:
    """Byte-level BPE's printable stand-ins (GPT-2's map): bytes that print as themselves keep their code
    point, the other 68 take code points 256, 257, ... in byte order. Maps the stand-in back to the byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    kept = set(keep)
    out = {chr(b): b for b in keep}
    others = [b for b in range(256) if b not in kept]
    out.update({chr(256 + i): b for i, b in enumerate(others)})
    return out


def o200k_from_vocab(vocab: Mapping[str, int]) -> bytes:
    """The tiktoken file (one line per rank: base64 of the token's bytes, a space, the rank) of ranks
    0..NUM_RANKS-1 of a byte-level BPE vocabulary (token string -> id, as in tokenizer.json).

    Raises ValueError if an id is missing or a token is not written in byte-level stand-ins."""
    by_id: list[str | None] = [None] * NUM_RANKS
    for token, i in vocab.items():
        if 0 <= i < NUM_RANKS:
            by_id[i] = token
    missing = [i for i, t in enumerate(by_id) if t is None]
    if missing:
        raise ValueError(f"the vocabulary has no token for ids {missing[:5]} (expected o200k_base's {NUM_RANKS} ranks)")
    decoder = byte_decoder()
    lines = []
    for rank, token in enumerate(by_id):
        try:
            raw = bytes(decoder[c] for c in token)  # type: ignore[union-attr]
        except KeyError:
            raise ValueError(f"token {rank} ({token!r}) is not byte-level BPE (not an o200k vocabulary)") from None
        lines.append(base64.b64encode(raw) + b" " + str(rank).encode())
    return b"\n".join(lines) + b"\n"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def vocab_dir(model_vocab: Any, cache: Path) -> Path:
    """The directory harmony should read o200k_base.tiktoken from: $TIKTOKEN_ENCODINGS_BASE when set, else
    `cache`, where the file is regenerated from `model_vocab()` (token -> id of the model's tokenizer) and
    written once (atomically). ValueError, naming the variable, when the model's vocabulary is not o200k's."""
    given = os.environ.get(ENV)
    if given:
        path = Path(given).expanduser()
        if not (path / FILE_NAME).is_file():
            raise ValueError(f"${ENV} is {given!r}, which holds no {FILE_NAME}; point it at a directory that does, "
                             "or unset it to regenerate the file from the model's tokenizer")
        return path
    data = o200k_from_vocab(model_vocab())
    if _sha256(data) != SHA256:
        raise ValueError(
            f"the model's tokenizer does not hold o200k_base's ranks (its first {NUM_RANKS} tokens give sha256 "
            f"{_sha256(data)[:16]}..., not {SHA256[:16]}...); set ${ENV} to a directory holding the real "
            f"{FILE_NAME} (sha256 {SHA256})")
    target = cache / FILE_NAME
    if not (target.is_file() and _sha256(target.read_bytes()) == SHA256):
        cache.mkdir(parents=True, exist_ok=True)
        tmp = cache / f".{FILE_NAME}.{os.getpid()}.tmp"
        tmp.write_bytes(data)
        os.replace(tmp, target)  # readers see the whole file or none
    return cache


@contextlib.contextmanager
def encodings_base(path: Path) -> Iterator[None]:
    """$TIKTOKEN_ENCODINGS_BASE set to `path` while harmony loads (it never downloads then), restored after."""
    before = os.environ.get(ENV)
    os.environ[ENV] = str(path)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = before
