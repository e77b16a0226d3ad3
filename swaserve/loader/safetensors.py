"""Stream (name, tensor) pairs out of a directory of safetensors shards, one tensor at a time."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open

_INDEX = "model.safetensors.index.json"


def safetensors_files(path: str | Path) -> list[Path]:
    """The shards that hold the model: those named by the index if there is one, else every
    `*.safetensors` (minus Mistral's `consolidated*` copy in its own naming when HF shards exist)."""
    root = Path(path)
    index = root / _INDEX
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [root / n for n in names]
        absent = [str(f) for f in files if not f.is_file()]
        if absent:
            raise FileNotFoundError(f"{index} names shards that are missing: {absent[:3]}")
        return files
    files = sorted(root.glob("*.safetensors"))
    hf_style = [f for f in files if not f.name.startswith("consolidated")]
    return hf_style or files


def iter_safetensors(path: str | Path, keep: Callable[[str], bool] | None = None
                     ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield every tensor of every shard lazily (safe_open), in shard then key order, on the CPU;
    `keep`: read only the tensors it accepts by name (an expert-parallel rank skips other ranks' experts)."""
    files = safetensors_files(path)
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as shard:
            for name in shard.keys():  # noqa: SIM118 (safe_open is not a dict)
                if keep is None or keep(name):
                    yield name, shard.get_tensor(name)
