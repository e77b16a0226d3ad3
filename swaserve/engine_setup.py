"""What an engine (and every tensor-parallel rank, and a draft model) is built from: the device and
dtype asked for, the loaded model with its context cap, and whether overlap scheduling pays off; and
how an engine lets go of it (`release_engine`)."""

from __future__ import annotations

import dataclasses
import gc
from typing import Any

import torch

from swaserve.config import RunnerConfig, SchedulerConfig
from swaserve.loader import LoadedModel
from swaserve.model_config import ModelConfig

CPU_DEFAULT_MAX_CONTEXT = 4096  # keeps the CPU pools and request table small; override with max_context

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def resolve_device_dtype(device: str | torch.device | None, dtype: str | torch.dtype | None) -> tuple[torch.device, torch.dtype]:
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but no CUDA GPU is available")
    if dtype is None or dtype == "auto":
        return dev, (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    if isinstance(dtype, torch.dtype):
        return dev, dtype
    if dtype not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; choose one of {sorted(_DTYPES)} or 'auto'")
    return dev, _DTYPES[dtype]


def load_engine_model(model: str | LoadedModel | None, device: torch.device, dtype: torch.dtype,
                      sched_cfg: SchedulerConfig, runner_cfg: RunnerConfig) -> tuple[LoadedModel, ModelConfig]:
    """The loaded model (this rank's shard under tensor parallelism) and its config with the context
    cap applied (`max_context`; 4096 on CPU by default): what every rank builds its runtime from."""
    from swaserve.loader import load_model

    loaded = (model if isinstance(model, LoadedModel)
              else load_model(model, device, dtype, load_format=runner_cfg.load_format,
                              quantization=runner_cfg.quantization))
    cap = sched_cfg.max_context or (CPU_DEFAULT_MAX_CONTEXT if device.type == "cpu" else None)
    config = loaded.config
    if cap is not None:
        config = dataclasses.replace(config, max_context=min(cap, config.max_context))
    return loaded, config


def default_overlap(device: torch.device) -> bool:
    """Overlap scheduling pays off where the model runs asynchronously to the host: on a GPU."""
    return device.type == "cuda"


# The attributes that hold device memory (the scheduler holds the pools, a drafter its model) or ranks.
_DEVICE_STATE = ("tp", "_runtime", "runner", "scheduler", "allocator", "launcher", "_inflight", "_groups")


def release_engine(state: dict[str, Any], device: torch.device) -> None:
    """`Engine.close()`, and what garbage collection of an engine runs: stop the other tensor-parallel
    ranks, drop everything that holds device tensors, hand the memory back to the device."""
    from swaserve.runner.memory_budget import release_device_memory

    tp = state.get("tp")
    if tp is not None:
        tp.close()
    for name in _DEVICE_STATE:
        state.pop(name, None)
    if device.type == "cuda":  # graph runners and drafters sit in reference cycles: free them now
        gc.collect()
        release_device_memory(device)
