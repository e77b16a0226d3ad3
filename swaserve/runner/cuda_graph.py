"""CudaGraphRunner: decode captured as one CUDA graph per batch size, replayed over static buffers."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import torch

from swaserve import step_rows
from swaserve.distributed.state import new_cuda_graph
from swaserve.runner.decode_graph import DecodeGraphRunner

if TYPE_CHECKING:
    from swaserve.runner.graph_target import GraphTarget

log = logging.getLogger(__name__)
T = TypeVar("T")


@torch.inference_mode()
def capture_per_size(sizes: list[int], run_once: Callable[[int], T], device: torch.device,
                     ) -> tuple[dict[int, torch.cuda.CUDAGraph], dict[int, T]]:
    """One CUDA graph of `run_once(bs)` per size, and what each capture returned (its output
    tensors, which live in the graphs' memory pool). Captured on a side stream after two warm-ups,
    largest size first so the smaller graphs reuse the blocks of the largest one's pool."""
    graphs: dict[int, torch.cuda.CUDAGraph] = {}
    outputs: dict[int, T] = {}
    pool = None
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))  # weights and pools are ready
    for bs in sorted(sizes, reverse=True):
        with torch.cuda.stream(stream), step_rows.within(bs):
            for _ in range(2):
                run_once(bs)
            stream.synchronize()
            graph = new_cuda_graph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                outputs[bs] = run_once(bs)
        pool = graph.pool() if pool is None else pool
        graphs[bs] = graph
    torch.cuda.synchronize(device)
    return graphs, outputs


class CudaGraphRunner(DecodeGraphRunner):
    """Captures metadata building (device index builders) and the model up to the final hidden states
    for each batch size, largest first, into one shared memory pool after two warm-ups. The LM head
    runs after the replay, on the live rows only, as logits or straight to greedy tokens.

    What a graph reads is recomputed from the static buffers on every replay: input ids are
    gathered in-graph from the runner's last-token table, the index lists are rebuilt in-graph from
    `req_pool_indices`/`seq_lens`, and the SWA write locations are translated in-graph from the live
    `out_cache_loc` (padded rows 0). Nothing batch-dependent is frozen into a capture.
    """

    def __init__(self, runner: GraphTarget, max_bs: int):
        super().__init__(runner, max_bs)
        if not hasattr(self.backend, "init_forward_metadata_graph"):
            raise ValueError(f"{type(self.backend).__name__} cannot be captured in a CUDA graph; use triton")
        self.backend.init_graph_state(self.sizes[-1])
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # bs -> the graph's outputs (in its pool): `[bs, hidden]` states and its scratch outputs
        self.outputs: dict[int, tuple[torch.Tensor, dict[str, torch.Tensor]]] = {}
        self._capture()

    def _run_once(self, bs: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        fb = self._static_batch(bs, [1] * bs)
        self.backend.init_forward_metadata_graph(fb)
        return self.model(fb), self.scratch.written(fb)  # [bs, hidden]: one token per request

    def _capture(self) -> None:
        self.graphs, self.outputs = capture_per_size(self.sizes, self._run_once, self.runner.device)
        log.info("captured decode CUDA graphs for batch sizes %s", self.sizes)

    def _replay(self, bs: int, seq_lens_cpu: list[int]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        self.graphs[bs].replay()
        return self.outputs[bs]
