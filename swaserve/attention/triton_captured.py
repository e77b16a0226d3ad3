"""A captured extend step's attention (prefill chunks and mixed steps as one CUDA graph replay): the
metadata it reads and the two unified-attention launches of each layer.

The step's request-level inputs live in static buffers of `R` request rows (`CapturedExtendInputs`): a
live request's table row, its tokens with K/V after the step and where its queries start in the step's
`N` tokens (`qo_indptr`); a padded row has no queries. Each layer runs a decode launch over all R rows,
which takes the rows with one query (a mixed step's decodes, split over key chunks where that fills the
GPU), and an extend launch over the tile list that `extend_tiles` builds from `qo_indptr` on the device.
Both grids depend on R and N only, and nothing is read on the host, so the whole step can be recorded
once per N and replayed. The unified kernel gives a query the same bits from either launch, so the step
computes what the eager deterministic path computes, in either mode.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from swaserve.h2d import copy_into
from swaserve.kernels.index_builders import window_slots
from swaserve.kernels.unified_attention import extend_rows, extend_tile_queries, unified_attention
from swaserve.kernels.unified_work import extend_tile_capacity, extend_tiles

if TYPE_CHECKING:
    from swaserve.attention.base import AttentionSpec
    from swaserve.memory.req_to_token import ReqToTokenPool


@dataclass
class CapturedExtendInputs:
    """Static request-level inputs of a captured extend step (device tensors, rewritten every replay)."""

    rows: torch.Tensor  # [R] int64: table rows (0: padding)
    seq_lens: torch.Tensor  # [R] int32: tokens with K/V after the step (padding: 1)
    qo_indptr: torch.Tensor  # [R+1] int32: request b's queries are qo_indptr[b] .. qo_indptr[b+1]-1

    @classmethod
    def allocate(cls, max_requests: int, device: torch.device) -> CapturedExtendInputs:
        return cls(torch.zeros(max_requests, dtype=torch.int64, device=device),
                   torch.ones(max_requests, dtype=torch.int32, device=device),
                   torch.zeros(max_requests + 1, dtype=torch.int32, device=device))

    def write(self, rows: torch.Tensor, seq_lens: torch.Tensor, ext_lens: list[int]) -> None:
        """A live batch's requests into the first rows, the rest reset to padding (no queries)."""
        bs = rows.numel()
        assert bs <= self.rows.numel(), f"{bs} requests, room for {self.rows.numel()}"
        self.rows[:bs].copy_(rows)
        self.rows[bs:].zero_()
        self.seq_lens[:bs].copy_(seq_lens)
        self.seq_lens[bs:].fill_(1)
        qo = torch.zeros(self.qo_indptr.numel(), dtype=torch.int32)
        qo[1: bs + 1] = torch.tensor(ext_lens, dtype=torch.int32).cumsum(0)
        qo[bs + 1:] = qo[bs]
        copy_into(self.qo_indptr, qo)


@dataclass
class CapturedExtendMetadata:
    """What a captured step's layers read: the static inputs, the SWA write locations, and the tile
    list per tile height (built at the first layer that needs it, inside the recorded step)."""

    inputs: CapturedExtendInputs
    num_tokens: int  # N: the captured token count
    swa_out_cache_loc: torch.Tensor | None
    work: dict[int, torch.Tensor] = field(default_factory=dict)
    slots: dict[int, torch.Tensor] = field(default_factory=dict)  # by window: `window_slots` of all R rows

    def tiles(self, toks: int) -> torch.Tensor:
        if toks not in self.work:
            cap = extend_tile_capacity(self.num_tokens, self.inputs.rows.numel(), toks)
            self.work[toks] = extend_tiles(self.inputs.qo_indptr, toks, cap)
        return self.work[toks]

    def window_slots(self, table: torch.Tensor, full_to_swa: torch.Tensor, window: int) -> torch.Tensor:
        """`[R, window]` SWA slots of each row's last window (`window_slots`), built at the first sliding layer
        in the SWA pool and read by every such layer's decode launch: one gather a key, as in a decode step,
        not the table then `full_to_swa`. Rows with other than one query never read theirs."""
        if window not in self.slots:
            self.slots[window] = window_slots(table, self.inputs.rows, self.inputs.seq_lens, full_to_swa, window)
        return self.slots[window]


def captured_attention(meta: CapturedExtendMetadata, req_to_token: ReqToTokenPool, q: torch.Tensor,
                       k_buf: torch.Tensor, v_buf: torch.Tensor, spec: AttentionSpec,
                       full_to_swa: torch.Tensor | None, sinks: torch.Tensor | None,
                       scales: dict[str, torch.Tensor]) -> torch.Tensor:
    """One layer of a captured step: the decode launch (a sliding layer's over its rows' window slots), then
    the extend launch, into one output."""
    inp = meta.inputs
    out = q.new_zeros(q.shape[0], spec.num_heads, spec.v_head_dim)  # padded tokens: 0, as in every step
    kw = dict(window=spec.sliding_window, full_to_swa=full_to_swa, logit_softcap=spec.logit_softcap or 0.0,
              sinks=sinks, **scales)
    table = req_to_token.req_to_token
    # Decode rows split over key chunks: their count varies from step to step under the static R, and
    # one program per row (what a decode step of R rows would take) streams a long context serially.
    slots = None
    if spec.sliding_window is not None and full_to_swa is not None:
        slots = meta.window_slots(table, full_to_swa, spec.sliding_window)
    unified_attention(q, out, k_buf, v_buf, table, inp.rows, inp.seq_lens, inp.qo_indptr, spec.scaling,
                      max_extend_len=1, programs="chunk", slots=slots, **kw)
    group = spec.num_heads // spec.num_kv_heads
    rows = extend_rows(q.shape[0], group, spec.num_kv_heads, k_buf)  # the tile height its launch takes
    unified_attention(q, out, k_buf, v_buf, table, inp.rows, inp.seq_lens, inp.qo_indptr, spec.scaling,
                      max_extend_len=meta.num_tokens, work=meta.tiles(extend_tile_queries(group, rows)),
                      tile_rows=rows, **kw)
    return out
