"""PiecewiseGraphRunner: extend steps (prefill chunks, mixed prefill+decode steps) of up to
`max_tokens` tokens run as CUDA graphs in pieces, cut at every attention call.

For each captured token count N the model forward is recorded as L+1 graphs: embedding to the first
attention, then one graph from each attention's output to the next attention's input, and the last
one through the final norm. Attention itself, whose work depends on the requests (their prefixes,
windows and table rows), runs eagerly between the replays on the live tokens only, with metadata
built for the live batch.

Cut protocol (`_Cut`, the backend the captured model sees): a layer's q/k/v are copied into static
staging buffers at the end of its piece, attention reads them and writes the static output buffer
that the next piece reads. Staging and output buffers are shared by all layers (one per width), so
they cost a few rows of one layer, not a copy of every layer's activations.

Padding rules (DESIGN.md §4, padded *tokens*): a live step of T tokens runs in the smallest captured
N >= T. Tokens T..N-1 carry token 0 at position 0 with `out_cache_loc` 0, so the SWA write location
translated from it in-graph is 0 too: a fused K/V store writes them to slot 0 of both pools only;
they route to no expert (`moe_routed_rows`), attention never reads or computes them, and their
attention output rows are zeroed every replay. Every static input is rewritten on every replay, and
the SWA locations are translated inside the first piece, so nothing memoised survives a step.

`capture=False` runs the same padded program eagerly, attention inline at each cut (the CPU tests
of these rules, and the reference for the captured form).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from swaserve.distributed.state import new_cuda_graph
from swaserve.runner.graph_buffers import ExtendTokenBuffers

if TYPE_CHECKING:
    from collections.abc import Callable

    from swaserve.attention.base import AttentionBackend, AttentionSpec
    from swaserve.runner.forward_batch import ForwardBatch
    from swaserve.runner.graph_target import GraphTarget

log = logging.getLogger(__name__)

# Larger steps run eagerly: their launches are a small share of their time, and the staging copies
# cost more than they save (H100, Gemma-3-4B shape: 0.98x at 2048 tokens, 0.97x at 4096; 1B: 2.8x, 1.04x).
PIECEWISE_MAX_TOKENS = 2048


def piecewise_token_sizes(max_tokens: int) -> list[int]:
    """8, 16, 32, 64, 96, 128, 192, then quarter steps between powers of two from 256 (256, 320, 384, 448,
    512, 640, ...) and eighth steps from 1024 (1024, 1152, ...), up to max_tokens (always included): a live
    step of 256-1023 tokens pads by less than a quarter, a longer one by less than an eighth. Padded tokens
    cost their share of every GEMM: with 1.5x steps a mixed step of 35 decodes and a 1024-token chunk ran as
    1536 tokens (H200, 1B: 6.69 ms against 5.18 for 1024 tokens, `piecewise.py --profile --whole`)."""
    sizes = [n for n in (8, 16, 32) if n < max_tokens]
    n = 64
    while n < max_tokens:
        parts = 2 if n < 256 else 4 if n < 1024 else 8
        sizes += [s for s in range(n, 2 * n, n // parts) if s < max_tokens]
        n *= 2
    return sizes + [max_tokens]


@dataclass(frozen=True)
class Site:
    """One attention call of the captured forward: what the eager attention between pieces needs."""

    spec: AttentionSpec
    sinks: torch.Tensor | None
    kv_stored: bool
    has_k: bool
    has_v: bool


@dataclass
class _PieceMetadata:
    """The static batch's metadata: only where a fused K/V store inside a piece writes SWA layers."""

    swa_out_cache_loc: torch.Tensor | None


class _Stage:
    """Static `[rows, width]` buffers keyed by width, shared by every layer of that width."""

    def __init__(self, rows: int, dtype: torch.dtype, device: torch.device):
        self.rows, self.dtype, self.device = rows, dtype, device
        self.buffers: dict[int, torch.Tensor] = {}

    def view(self, n: int, heads: int, dim: int) -> torch.Tensor:
        w = heads * dim
        if w not in self.buffers:
            self.buffers[w] = torch.zeros(self.rows, w, dtype=self.dtype, device=self.device)
        return self.buffers[w][:n].view(n, heads, dim)


def _skip_attention(site: Site, n: int) -> None:
    """The cut of a warm-up run: the static output keeps what it holds (the inputs are all padding)."""


class _Cut:
    """The attention backend the piecewise program sees. `forward` stages q/k/v, hands the site to
    `on_cut` (capture: close this piece's graph and open the next; eager: attend now) and returns the
    static output the next piece reads. `kv_target` and `fused_kv_store` are the real backend's, over
    the static batch, so a fused K/V store is recorded inside the piece."""

    def __init__(self, real: AttentionBackend, runner: PiecewiseGraphRunner):
        self.real, self.runner = real, runner
        self.fused_kv_store = real.fused_kv_store
        self.on_cut: Callable[[Site, int], None] = _skip_attention
        self.sites: list[Site] = []

    def kv_target(self, spec: AttentionSpec, batch: ForwardBatch):
        return self.real.kv_target(spec, batch)

    def kv_scales(self, spec: AttentionSpec):
        return self.real.kv_scales(spec)

    def forward(self, q, k, v, spec, batch, sinks=None, kv_stored=False) -> torch.Tensor:
        n, r = q.shape[0], self.runner
        r.q_stage.view(n, spec.num_heads, spec.head_dim).copy_(q)
        if k is not None:
            r.k_stage.view(n, spec.num_kv_heads, spec.head_dim).copy_(k)
        if v is not None:
            r.v_stage.view(n, spec.num_kv_heads, spec.v_head_dim).copy_(v)
        site = Site(spec, sinks, kv_stored, k is not None, v is not None)
        self.sites.append(site)
        self.on_cut(site, n)
        return r.out_stage.view(n, spec.num_heads, spec.v_head_dim)


class PiecewiseGraphRunner:
    """`replay(batch)` runs an extend batch of at most `max_tokens` tokens through the pieces of the
    smallest captured size that holds it and returns the final hidden states `[num_tokens, hidden]`
    of every live token, with the scratch outputs the model wrote (`aux_hidden`), both views valid
    until the next replay."""

    def __init__(self, runner: GraphTarget, max_tokens: int, capture: bool = True):
        self.runner = runner
        self.model = runner.model
        self.backend = runner.attn_backend
        self.full_to_swa = runner.attn_backend.full_to_swa
        self.sizes = piecewise_token_sizes(max_tokens)
        n, dev = self.sizes[-1], runner.device
        self.tokens = ExtendTokenBuffers(n, dev, self.full_to_swa)  # one copy a step
        self._row0 = torch.zeros(1, dtype=torch.int64, device=dev)  # request-level placeholders
        self._len1 = torch.ones(1, dtype=torch.int32, device=dev)
        self.q_stage, self.k_stage, self.v_stage, self.out_stage = (
            _Stage(n, runner.dtype, dev) for _ in range(4))
        self.cut = _Cut(self.backend, self)
        self.capture = capture
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.sites: dict[int, list[Site]] = {}
        self.outputs: dict[int, tuple[torch.Tensor, dict[str, torch.Tensor]]] = {}
        if capture:
            self._capture()

    def can_run(self, batch: ForwardBatch) -> bool:
        return (not batch.is_decode and batch.num_tokens <= self.sizes[-1]
                and not self.runner.extend_scratch_inputs)

    @torch.inference_mode()
    def replay(self, batch: ForwardBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        T = batch.num_tokens
        n = next(s for s in self.sizes if s >= T)
        assert batch.input_ids is not None and self.can_run(batch), "can_run() must be checked first"
        self.tokens.populate(batch, n)
        for stage in self.out_stage.buffers.values():
            stage[T:n].zero_()  # padded tokens' attention output: zero, never a gone step's
        batch.attn_backend = self.backend
        self.backend.init_forward_metadata(batch)

        def attend(site: Site, m: int) -> None:
            self._attend(site, m, batch)

        if not self.capture:
            self.cut.on_cut = attend
            hidden, written = self._run_once(n)
        else:
            graphs, sites = self.graphs[n], self.sites[n]
            for i, graph in enumerate(graphs):
                graph.replay()
                if i < len(sites):
                    attend(sites[i], n)
            hidden, written = self.outputs[n]
        return hidden[:T], {k: v[:T] for k, v in written.items()}

    def _attend(self, site: Site, n: int, batch: ForwardBatch) -> None:
        """The eager attention of one cut over the live tokens of `batch`, into the static output."""
        T, spec = batch.num_tokens, site.spec
        q = self.q_stage.view(n, spec.num_heads, spec.head_dim)[:T]
        k = self.k_stage.view(n, spec.num_kv_heads, spec.head_dim)[:T] if site.has_k else None
        v = self.v_stage.view(n, spec.num_kv_heads, spec.v_head_dim)[:T] if site.has_v else None
        out = self.backend.forward(q, k, v, spec, batch, site.sinks, site.kv_stored)
        self.out_stage.view(n, spec.num_heads, spec.v_head_dim)[:T].copy_(out)

    def _static_batch(self, n: int) -> ForwardBatch:
        """The batch the pieces read: n tokens from the static buffers, SWA locations translated
        from the live slots (recorded in the first piece). Request-level fields are placeholders:
        only attention reads them, and attention runs on the live batch."""
        fb = self.tokens.batch(n, req_pool_indices=self._row0, seq_lens=self._len1, seq_lens_cpu=[n],
                               extend_prefix_lens_cpu=[0], extend_seq_lens_cpu=[n])
        fb.attn_backend = self.cut  # type: ignore[assignment]
        fb.attn_metadata = _PieceMetadata(fb.swa_out_cache_loc)
        return fb

    def _run_once(self, n: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        self.cut.sites = []
        fb = self._static_batch(n)
        hidden = self.model(fb)
        return hidden, {k: fb.scratch[k] for k in ("aux_hidden",) if k in fb.scratch}

    def _capture(self) -> None:
        """Per size, largest first, two eager warm-ups (attention skipped: the static inputs are all
        padding) and then the pieces, every graph in one shared pool: only one size's pieces replay
        at a time, in the order they were captured."""
        dev = self.runner.device
        stream = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        pool = torch.cuda.graph_pool_handle()
        for n in reversed(self.sizes):
            with torch.inference_mode(), torch.cuda.stream(stream):
                for _ in range(2):
                    self._run_once(n)
                stream.synchronize()
                self.graphs[n] = self._capture_pieces(n, pool)
            self.sites[n] = self.cut.sites
        torch.cuda.synchronize(dev)
        log.info("captured piecewise CUDA graphs (%d pieces) for token counts %s",
                 len(self.graphs[self.sizes[-1]]), self.sizes)

    def _capture_pieces(self, n: int, pool: tuple[int, int]) -> list[torch.cuda.CUDAGraph]:
        """One forward of size n recorded as a new graph at every cut (on the current stream)."""
        pieces: list[torch.cuda.CUDAGraph] = []

        def next_piece(site: Site | None = None, m: int = 0) -> None:
            if pieces:
                pieces[-1].capture_end()
            pieces.append(new_cuda_graph())
            pieces[-1].capture_begin(pool=pool)

        next_piece()
        self.cut.on_cut = next_piece
        try:
            self.outputs[n] = self._run_once(n)
        finally:  # also on an error: leave no stream capturing
            pieces[-1].capture_end()
            self.cut.on_cut = _skip_attention
        return pieces
