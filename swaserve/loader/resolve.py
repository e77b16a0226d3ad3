"""What a `--model` argument names: the embedded default GGUF (None), a GGUF file, or a local
HF checkpoint directory. One entry point, `resolve_model`, with errors that say what was expected.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

ModelKind = Literal["gguf", "hf_dir"]


@dataclass(frozen=True)
class ResolvedModel:
    """A model source that exists on disk and whose format is known.

    Invariant: `kind == "gguf"` -> `path` is a file starting with the GGUF magic;
    `kind == "hf_dir"` -> `path` is a directory holding `config.json`. `path` is absolute.
    """

    kind: ModelKind
    path: Path
    is_default: bool = False  # the embedded Gemma 3 270M

    @property
    def name(self) -> str:
        """A short display name (file stem or directory name), e.g. for `served_model_name`."""
        return self.path.stem if self.kind == "gguf" else self.path.name


def _is_gguf(path: Path) -> bool:
    with path.open("rb") as f:
        return f.read(4) == b"GGUF"


def resolve_model(model: str | Path | None) -> ResolvedModel:
    """Resolve `model` (None: the embedded Gemma 3 270M, assembled on first use).

    Raises:
        ValueError: the path does not exist, or is neither a GGUF file nor a directory with
            config.json (the message lists any .gguf files found in such a directory).
    """
    if model is None:
        from swaserve.loader.default_model import default_model_path

        return ResolvedModel("gguf", default_model_path().resolve(), is_default=True)
    if not isinstance(model, (str, Path)) or not str(model).strip():
        raise ValueError(f"model must be a non-empty path, got {model!r}")
    path = Path(model).expanduser()
    if not path.exists():
        hint = (
            " (downloading from a model hub is not supported; pass a local path)" if "/" in str(model) else ""
        )
        raise ValueError(f"model path does not exist: {path}{hint}")
    path = path.resolve()
    if path.is_file():
        if _is_gguf(path):
            return ResolvedModel("gguf", path)
        raise ValueError(
            f"{path} is not a GGUF file (no GGUF magic); expected a .gguf file or an HF model directory"
        )
    if path.is_dir():
        if (path / "config.json").is_file():
            return ResolvedModel("hf_dir", path)
        ggufs = sorted(p.name for p in path.glob("*.gguf"))
        hint = f"; it holds GGUF files, pass one of them: {', '.join(ggufs)}" if ggufs else ""
        raise ValueError(f"{path} is a directory without config.json, so not an HF model directory{hint}")
    raise ValueError(f"{path} is neither a file nor a directory")
