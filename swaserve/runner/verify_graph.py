"""VerifyGraphRunner: extend steps of at most `q_len` new tokens per request — speculative verify
steps (each request's input token plus up to K drafts) — run as one captured CUDA graph per batch
size over static buffers.

Layout: request b owns the token slots [b*Q, (b+1)*Q); its n_b <= Q new tokens fill the first n_b,
the rest are padding. Padding rules (DESIGN.md §4), per slot and per row: a padded slot carries
token 0 at position 0 and writes its K/V only to slot 0 of both pools (`out_cache_loc` 0, SWA
location translated from it, so 0); a padded row reads table row 0 with no prefix. A real token
never sees a padded slot: padding follows a row's real tokens and attention inside a row is causal.
Every replay rewrites the whole padded range, so nothing of an earlier, larger batch survives.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from swaserve.h2d import to_device
from swaserve.runner.forward_batch import ForwardBatch, ForwardMode
from swaserve.runner.graph_buffers import ScratchSlots, capture_batch_sizes, padded_batch_size

if TYPE_CHECKING:
    from swaserve.runner.graph_target import GraphTarget

log = logging.getLogger(__name__)


class VerifyGraphRunner:
    """`replay(batch)` gives the hidden states of every new token of `batch` in its own (unpadded)
    token order, and the scratch outputs the program wrote (`ScratchSlots`: the target's auxiliary
    states, a drafter head's pre-norm output) in the same order; a head's per-token state input
    (`runner.extend_scratch_inputs`) goes in through static buffers, padded slots reading zeros. `capture=False` runs the same padded
    program eagerly instead of replaying a CUDA graph (the CPU tests of the padding rules, with the
    Triton backend interpreted). Needs a backend with `init_forward_metadata_strided` (triton)."""

    def __init__(self, runner: GraphTarget, max_bs: int, q_len: int, capture: bool = True):
        self.runner = runner
        self.model = runner.model
        self.backend = runner.attn_backend
        self.full_to_swa = runner.attn_backend.full_to_swa
        self.q = q_len
        self.sizes = capture_batch_sizes(max_bs)
        max_bs = self.sizes[-1]
        dev = runner.device
        # Host-given inputs: per slot (input id, position, full-pool slot), per row (table row, prefix).
        self.tokens = torch.zeros(3, max_bs * q_len, dtype=torch.int64, device=dev)  # [3, max_bs*Q] int64
        self.rows = torch.zeros(2, max_bs, dtype=torch.int64, device=dev)  # [2, max_bs] int64
        # Derived on the device inside the graph.
        self.prefix_lens = torch.zeros(max_bs, dtype=torch.int32, device=dev)  # [max_bs] int32
        self.seq_lens = torch.zeros(max_bs, dtype=torch.int32, device=dev)  # [max_bs] int32: prefix + Q
        self.swa_out_cache_loc = (torch.zeros(max_bs * q_len, dtype=torch.int32, device=dev)
                                  if self.full_to_swa is not None else None)  # [max_bs*Q] int32: SWA pool
        self.qo_indptr = torch.arange(max_bs + 1, dtype=torch.int32, device=dev) * q_len  # [max_bs+1] int32
        self.scratch = ScratchSlots(runner.extend_scratch_inputs, runner.scratch_outputs, max_bs * q_len,
                                    runner.dtype, dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[torch.Tensor, dict[str, torch.Tensor]]] = {}
        self.capture = capture
        if not hasattr(self.backend, "init_forward_metadata_strided"):
            raise ValueError(f"{type(self.backend).__name__} cannot run verify graphs; use triton")
        self.backend.init_graph_state(max_bs)
        if capture:
            self._capture()

    def can_run(self, batch: ForwardBatch) -> bool:
        return (not batch.is_decode and batch.table_inputs is None and batch.batch_size <= self.sizes[-1]
                and batch.extend_seq_lens_cpu is not None and max(batch.extend_seq_lens_cpu) <= self.q)

    @torch.inference_mode()
    def replay(self, batch: ForwardBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """`[num_tokens, hidden]` states of the batch's new tokens and the scratch outputs, `[num_tokens,
        D]` each (fresh tensors, not views of the graph's output)."""
        raw = batch.batch_size
        bs = padded_batch_size(raw, self.sizes)
        assert bs is not None and self.can_run(batch), "can_run() must be checked first"
        dest = self._populate(batch, bs)
        self.scratch.fill(batch, bs * self.q, dest)
        if self.capture:
            self.graphs[bs].replay()
            hidden, written = self.outputs[bs]
        else:
            hidden, written = self._run_once(bs)
        return hidden[dest], {k: v[dest] for k, v in written.items()}

    def _populate(self, batch: ForwardBatch, bs: int) -> torch.Tensor:
        """Copy the live batch into rows [0, raw) and reset everything else up to bs; the device
        index of each live token's slot."""
        ext, prefix = batch.extend_seq_lens_cpu, batch.extend_prefix_lens_cpu
        assert ext is not None and prefix is not None and batch.input_ids is not None
        raw, q = len(ext), self.q
        dest_host = [b * q + j for b, n in enumerate(ext) for j in range(n)]
        packed = to_device(torch.tensor(dest_host + list(prefix), dtype=torch.int64), self.runner.device)
        dest, prefix_d = packed[: len(dest_host)], packed[len(dest_host):]
        self.tokens[:, : bs * q].zero_()
        self.tokens.index_copy_(1, dest, torch.stack([batch.input_ids, batch.positions, batch.out_cache_loc]))
        self.rows[:, :bs].zero_()
        self.rows[0, :raw].copy_(batch.req_pool_indices)
        self.rows[1, :raw].copy_(prefix_d)
        return dest

    def _static_batch(self, bs: int) -> ForwardBatch:
        """The batch the program reads; its derived inputs recomputed from the static buffers."""
        T = bs * self.q
        self.prefix_lens[:bs].copy_(self.rows[1, :bs])
        torch.add(self.prefix_lens[:bs], self.q, out=self.seq_lens[:bs])
        swa = None
        if self.swa_out_cache_loc is not None:
            assert self.full_to_swa is not None
            swa = self.swa_out_cache_loc[:T]
            torch.index_select(self.full_to_swa, 0, self.tokens[2, :T], out=swa)
        # The host lists are placeholders (only their lengths are read): the program reads the device.
        fb = ForwardBatch(mode=ForwardMode.EXTEND, input_ids=self.tokens[0, :T], positions=self.tokens[1, :T],
                          req_pool_indices=self.rows[0, :bs], seq_lens=self.seq_lens[:bs],
                          out_cache_loc=self.tokens[2, :T], seq_lens_cpu=[self.q] * bs,
                          extend_prefix_lens_cpu=[0] * bs, extend_seq_lens_cpu=[self.q] * bs, swa_out_cache_loc=swa)
        fb.attn_backend = self.backend
        self.scratch.bind(fb, T)
        return fb

    def _run_once(self, bs: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        fb = self._static_batch(bs)
        self.backend.init_forward_metadata_strided(fb, self.q, self.prefix_lens[:bs], self.qo_indptr[: bs + 1])
        return self.model(fb), self.scratch.written(fb)

    def _capture(self) -> None:
        from swaserve.runner.cuda_graph import capture_per_size

        self.graphs, self.outputs = capture_per_size(self.sizes, self._run_once, self.runner.device)
        log.info("captured verify CUDA graphs (%d tokens per request) for batch sizes %s", self.q, self.sizes)
