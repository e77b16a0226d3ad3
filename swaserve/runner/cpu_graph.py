"""CpuGraphRunner: decode through `torch.compile`d model code per captured batch size, with the
same static buffers and padding rules as the CUDA graph runner."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from swaserve.runner.decode_graph import DecodeGraphRunner

if TYPE_CHECKING:
    from swaserve.runner.graph_target import GraphTarget


class CpuGraphRunner(DecodeGraphRunner):
    """The model forward is compiled once (sizes vary only in the batch and key-list lengths, marked
    dynamic); attention metadata is built eagerly from the static buffers before each call, so
    every replay sees the live rows and the reset padded rows."""

    def __init__(self, runner: GraphTarget, max_bs: int, compile_backend: str = "inductor"):
        super().__init__(runner, max_bs)
        self._compiled: Any = torch.compile(self._model_step, backend=compile_backend, dynamic=True)
        for bs in reversed(self.sizes):  # compile/warm every size up front, like a capture
            self._replay(bs, [1] * bs)

    def _model_step(self, fb: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return self.model(fb), self.scratch.written(fb)

    @torch.inference_mode()
    def _replay(self, bs: int, seq_lens_cpu: list[int]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        fb = self._static_batch(bs, seq_lens_cpu)
        self.backend.init_forward_metadata(fb)
        return self._compiled(fb)
