"""GraphTarget: what a graph runner reads of the runner it captures for. `ModelRunner` builds the graph
runners and passes itself; they see it only through this protocol, so none imports `model_runner`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch
    from torch import nn


class GraphTarget(Protocol):
    model: nn.Module
    attn_backend: Any  # attention.base.AttentionBackend (graph runners need its graph-state methods too)
    device: torch.device
    dtype: torch.dtype
    last_tokens: torch.Tensor  # [R+1] int64, device: each request row's last sampled token
    # Batch-scratch tensors a replay carries (key -> width), and the keys read after a replay.
    decode_scratch_inputs: dict[str, int]
    extend_scratch_inputs: dict[str, int]
    scratch_outputs: tuple[str, ...]
