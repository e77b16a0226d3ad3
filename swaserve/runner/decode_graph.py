"""DecodeGraphRunner: what the CUDA and CPU graph runners share — captured batch sizes, the static
input buffers, padding a live batch up to a captured size, and slicing the outputs back."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

from swaserve.runner.graph_buffers import (
    SEQ_LEN_FILL,
    DecodeInputBuffers,
    ScratchSlots,
    capture_batch_sizes,
    padded_batch_size,
)

if TYPE_CHECKING:
    from swaserve.runner.forward_batch import ForwardBatch
    from swaserve.runner.graph_target import GraphTarget


class DecodeGraphRunner(ABC):
    """Runs decode steps of up to `max_bs` requests through per-batch-size captured programs.

    A live batch of raw_bs runs in the smallest captured bs >= raw_bs; `populate` resets the padded
    rows (DESIGN.md §4) before copying the live ones, and outputs are sliced to raw_bs. Larger
    batches and extend steps fall back to the eager runner (`can_run` says which).
    """

    def __init__(self, runner: GraphTarget, max_bs: int):
        self.runner = runner
        self.model = runner.model
        self.backend = runner.attn_backend
        self.full_to_swa = runner.attn_backend.full_to_swa
        self.sizes = capture_batch_sizes(max_bs)
        self.buffers = DecodeInputBuffers(self.sizes[-1], runner.device, hybrid=self.full_to_swa is not None)
        self.scratch = ScratchSlots(runner.decode_scratch_inputs, runner.scratch_outputs, self.sizes[-1],
                                    runner.dtype, runner.device)
        # The scratch outputs of the last replay, `[raw_bs, D]` each (`aux_hidden`: the auxiliary
        # states an EAGLE-3 drafter reads); views valid until the next replay.
        self.last_scratch: dict[str, torch.Tensor] = {}

    def can_run(self, batch: ForwardBatch) -> bool:
        return batch.is_decode and batch.batch_size <= self.sizes[-1]

    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        """Final hidden states `[raw_bs, hidden]`; a view valid until the next replay."""
        raw = batch.batch_size
        bs = padded_batch_size(raw, self.sizes)
        assert bs is not None, "can_run() must be checked first"
        self.buffers.populate(batch, bs)
        self.scratch.fill(batch, bs)
        hidden, written = self._replay(bs, batch.seq_lens_cpu + [SEQ_LEN_FILL] * (bs - raw))
        self.last_scratch = {k: v[:raw] for k, v in written.items()}
        return hidden[:raw]

    def _static_batch(self, bs: int, seq_lens_cpu: list[int]) -> ForwardBatch:
        """The batch a captured program reads, its derived inputs recomputed from the live buffers."""
        self.buffers.derive(bs, self.runner.last_tokens, self.full_to_swa)
        fb = self.buffers.forward_batch(bs, seq_lens_cpu)
        fb.attn_backend = self.backend
        self.scratch.bind(fb, bs)
        return fb

    @abstractmethod
    def _replay(self, bs: int, seq_lens_cpu: list[int]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Run the captured program for bs rows over the static buffers: `[bs, hidden]` states, and
        the scratch outputs it wrote (`ScratchSlots.written`)."""
