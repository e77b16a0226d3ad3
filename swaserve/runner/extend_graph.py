"""ExtendGraphRunner: extend steps (prefill chunks, mixed prefill + decode steps) of up to `max_tokens`
tokens as one CUDA graph replay each, attention included, for a backend that `captures_extend`.

For each captured token count N (`piecewise_token_sizes`) the whole forward, embedding to final norm,
is one graph over static inputs: per token (input id, position, full-pool slot) and per request row
(`CapturedExtendInputs`: table row, tokens with K/V, where its queries start) for up to R requests,
R being the table's request rows. Attention's metadata (SWA write locations, the extend tile list) is
built inside the graph from those, so a replay is: copy the live batch into the static inputs, replay.
Against the piecewise runner it drops the L eager attention calls between pieces and the host-built
key lists of every step.

Padding rules (DESIGN.md §4), as the piecewise runner's: tokens T..N-1 carry token 0 at position 0
with slot 0 (their K/V go to slot 0 of both pools only; `moe_routed_rows` keeps them out of every
expert); request rows past the batch have no queries, so no attention program reads or writes for
them; padded tokens' attention output is 0. Every static input is rewritten on every replay.

`capture=False` runs the same padded program eagerly (the CPU tests of these rules).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from swaserve.attention.triton_captured import CapturedExtendInputs
from swaserve.runner.cuda_graph import capture_per_size
from swaserve.runner.graph_buffers import ExtendTokenBuffers
from swaserve.runner.piecewise_graph import piecewise_token_sizes

if TYPE_CHECKING:
    from swaserve.runner.forward_batch import ForwardBatch
    from swaserve.runner.graph_target import GraphTarget

log = logging.getLogger(__name__)


class ExtendGraphRunner:
    """`replay(batch)` runs an extend batch of at most `max_tokens` tokens through the graph of the
    smallest captured size that holds it and returns the final hidden states `[num_tokens, hidden]` of
    every live token, with the scratch outputs the model wrote (`aux_hidden`): views valid until the
    next replay."""

    def __init__(self, runner: GraphTarget, max_tokens: int, capture: bool = True):
        self.runner = runner
        self.model = runner.model
        self.backend = runner.attn_backend
        assert self.backend.captures_extend, "the attention backend cannot be captured for extend steps"
        self.full_to_swa = self.backend.full_to_swa
        self.sizes = piecewise_token_sizes(max_tokens)
        n, dev = self.sizes[-1], runner.device
        self.tokens = ExtendTokenBuffers(n, dev, self.full_to_swa)
        self.requests = CapturedExtendInputs.allocate(self.backend.req_to_token.max_reqs, dev)
        self.capture = capture
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[torch.Tensor, dict[str, torch.Tensor]]] = {}
        if capture:
            self._capture()

    def can_run(self, batch: ForwardBatch) -> bool:
        return (not batch.is_decode and batch.num_tokens <= self.sizes[-1]
                and batch.batch_size <= self.requests.rows.numel() and not self.runner.extend_scratch_inputs)

    @torch.inference_mode()
    def replay(self, batch: ForwardBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        T = batch.num_tokens
        n = next(s for s in self.sizes if s >= T)
        assert batch.input_ids is not None and batch.extend_seq_lens_cpu is not None and self.can_run(batch)
        self.tokens.populate(batch, n)
        self.requests.write(batch.req_pool_indices, batch.seq_lens, batch.extend_seq_lens_cpu)
        if self.capture:
            self.graphs[n].replay()
            hidden, written = self.outputs[n]
        else:
            hidden, written = self._run_once(n)
        return hidden[:T], {k: v[:T] for k, v in written.items()}

    def _run_once(self, n: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The forward of n static tokens, its metadata built from the static inputs."""
        req = self.requests
        fb = self.tokens.batch(n, req_pool_indices=req.rows, seq_lens=req.seq_lens,
                               seq_lens_cpu=[1] * req.rows.numel())
        fb.attn_backend = self.backend
        self.backend.captured_extend_metadata(fb, req)
        hidden = self.model(fb)
        return hidden, {k: fb.scratch[k] for k in ("aux_hidden",) if k in fb.scratch}

    def _capture(self) -> None:
        """Per size, largest first, after two warm-ups (every static input is padding: no attention
        program does any work), all in one shared pool (`capture_per_size`)."""
        self.graphs, self.outputs = capture_per_size(self.sizes, self._run_once, self.runner.device)
        log.info("captured extend steps as whole CUDA graphs for token counts %s", self.sizes)
