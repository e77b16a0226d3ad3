"""FrozenKVGraphRunner: the frozen-KV drafter's whole K-step chain (Gemma 4's assistant over the target's
pools) captured as one CUDA graph per batch size, replayed over static buffers.

Per row the host gives (target table row, kv_len, input token); the graph reads only those: it derives
`seq_lens`, builds the decode key lists in the drafter's own backend's graph buffers, gathers the rows'
hidden states from the drafter's `states` table, and runs K chained steps into `[bs, K]` tokens.
Padding rules (DESIGN.md §4), per padded row: table row 0 (all zeros), kv_len 1 (the query at
position 1 reads slot 0 only), token 0, state row 0 (never written: no request owns table row 0).
Nothing is stored (KV-shared layers; the write slots are the constant slot 0 of both pools), so a
padded row cannot corrupt a pool, and it reads no live row's state or keys. Every replay rewrites all
`bs` rows, so nothing of an earlier, larger batch survives.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Protocol

import torch

from swaserve.h2d import copy_into
from swaserve.runner.forward_batch import ForwardBatch, ForwardMode
from swaserve.runner.graph_buffers import SEQ_LEN_FILL, capture_batch_sizes, padded_batch_size

if TYPE_CHECKING:
    from torch import nn

log = logging.getLogger(__name__)

PAD = (0, SEQ_LEN_FILL, 0)  # (table row, kv_len, token) of a padded row


class ChainParts(Protocol):
    """What the graph runner reads of the drafter that builds it (`frozen_kv.FrozenKVDrafter`, attached)."""

    model: nn.Module  # the assistant: (token embedding and state concatenated, batch) -> (state, token)
    embed: Any  # the target's (scaled) token embedding
    states: torch.Tensor | None  # [max_reqs+1, D] model dtype, device: per table row, the state to draft from
    backend: Any  # the drafter's own attention backend (triton)
    device: torch.device


class FrozenKVGraphRunner:
    """`run(rows, kv_lens, tokens)` gives `[n, steps]` drafted tokens (a view of the graph's output,
    valid until the next run). `capture=False` runs the same padded program eagerly instead of
    replaying a CUDA graph (the CPU tests of the padding rules, with the Triton kernels interpreted).
    Needs the drafter's backend to build decode metadata from device tensors (triton, not deterministic)."""

    def __init__(self, drafter: ChainParts, max_bs: int, steps: int, capture: bool = True):
        backend = drafter.backend
        if not hasattr(backend, "init_forward_metadata_graph") or getattr(backend, "deterministic", False):
            raise ValueError(f"{type(backend).__name__} cannot run the drafter's graphs; use triton")
        assert drafter.states is not None and drafter.embed is not None, "attach() first"
        self.model, self.embed, self.states = drafter.model, drafter.embed, drafter.states
        self.backend = backend
        self.device = drafter.device
        self.steps = steps
        self.sizes = capture_batch_sizes(max_bs)
        max_bs = self.sizes[-1]
        dev = self.device
        # Host-given, per row: table row, kv_len (= the query's position), input token.
        self.inputs = torch.tensor(PAD, dtype=torch.int64, device=dev)[:, None].repeat(1, max_bs)  # [3, max_bs] int64
        # Derived in the graph.
        self.seq_lens = torch.full((max_bs,), SEQ_LEN_FILL, dtype=torch.int32, device=dev)  # [max_bs] int32
        # Constant write slots: slot 0 of both pools (nothing is stored; KV-shared layers).
        self.out_cache_loc = torch.zeros(max_bs, dtype=torch.int64, device=dev)  # [max_bs] int64
        self.swa_out_cache_loc = (torch.zeros(max_bs, dtype=torch.int32, device=dev)
                                  if backend.full_to_swa is not None else None)  # [max_bs] int32
        backend.init_graph_state(max_bs)  # the drafter's own backend: its buffers are not the target's
        self.capture = capture
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # bs -> [bs, steps] int64, the graph's output
        if capture:
            self._capture()

    def can_run(self, n: int, steps: int) -> bool:
        return 0 < n <= self.sizes[-1] and steps <= self.steps

    @torch.inference_mode()
    def run(self, rows: list[int], kv_lens: list[int], tokens: list[int]) -> torch.Tensor:
        raw = len(rows)
        bs = padded_batch_size(raw, self.sizes)
        assert bs is not None and self.can_run(raw, 0), "can_run() must be checked first"
        # The padded rows are filled in the same copy as the live ones.
        host = torch.tensor(PAD, dtype=torch.int64)[:, None].repeat(1, bs)
        host[:, :raw] = torch.tensor([rows, kv_lens, tokens], dtype=torch.int64)
        copy_into(self.inputs[:, :bs], host)
        if self.capture:
            self.graphs[bs].replay()
            out = self.outputs[bs]
        else:
            out = self._run_once(bs)
        return out[:raw]

    def _run_once(self, bs: int) -> torch.Tensor:
        """The program a graph records: device tensors only, everything recomputed from `inputs`."""
        rows, kv_lens, token = self.inputs[0, :bs], self.inputs[1, :bs], self.inputs[2, :bs]
        self.seq_lens[:bs].copy_(kv_lens)
        swa = self.swa_out_cache_loc[:bs] if self.swa_out_cache_loc is not None else None
        # seq_lens_cpu is a placeholder (only its length is read).
        fb = ForwardBatch(mode=ForwardMode.DECODE, input_ids=None, positions=kv_lens, req_pool_indices=rows,
                          seq_lens=self.seq_lens[:bs], out_cache_loc=self.out_cache_loc[:bs],
                          seq_lens_cpu=[SEQ_LEN_FILL] * bs, swa_out_cache_loc=swa)
        fb.attn_backend = self.backend
        self.backend.init_forward_metadata_graph(fb)
        hidden = self.states.index_select(0, rows)
        drafted = []
        for _ in range(self.steps):
            hidden, token = self.model(torch.cat([self.embed(token), hidden], dim=-1), fb)
            drafted.append(token)
        return torch.stack(drafted, dim=1)  # [bs, steps] int64

    @torch.inference_mode()
    def _capture(self) -> None:
        from swaserve.runner.cuda_graph import capture_per_size

        # After the target's pools and weights are ready (side stream, two warm-ups, largest first, one pool).
        self.graphs, self.outputs = capture_per_size(self.sizes, self._run_once, self.device)
        log.info("captured frozen-KV drafter CUDA graphs (%d steps) for batch sizes %s", self.steps, self.sizes)
