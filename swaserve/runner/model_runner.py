"""ModelRunner: one model step (attention metadata, model, last-token hidden states; logits or tokens
from those), and the attention backend it owns, chosen by name."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

import torch
from torch import nn

from swaserve import step_rows
from swaserve.distributed.state import tp_group

if TYPE_CHECKING:
    from collections.abc import Callable

    from swaserve.attention.base import AttentionBackend
    from swaserve.memory.req_to_token import ReqToTokenPool
    from swaserve.memory.swa import SWAKVPool
    from swaserve.model_config import ModelConfig
    from swaserve.runner.decode_graph import DecodeGraphRunner
    from swaserve.runner.extend_graph import ExtendGraphRunner
    from swaserve.runner.forward_batch import ForwardBatch
    from swaserve.runner.piecewise_graph import PiecewiseGraphRunner
    from swaserve.runner.verify_graph import VerifyGraphRunner

# Every backend is constructed as cls(kv, req_to_token, full_to_swa, sliding_window=W); the triton
# backend also takes deterministic=True, and torch_native has a deterministic-mode class of its own.
_BACKENDS: dict[str, tuple[str, str]] = {
    "torch_native": ("swaserve.attention.torch_native", "TorchNativeAttnBackend"),
    "triton": ("swaserve.attention.triton", "TritonAttnBackend"),
}
_INVARIANT_NATIVE = ("swaserve.attention.invariant_native", "InvariantNativeAttnBackend")


def default_attention_backend(device: torch.device) -> str:
    return "triton" if device.type == "cuda" else "torch_native"


def create_attention_backend(
    name: str,
    kv: SWAKVPool,
    req_to_token: ReqToTokenPool,
    full_to_swa: torch.Tensor | None,
    sliding_window: int | None,
    deterministic: bool = False,
) -> AttentionBackend:
    """Instantiate backend `name`; imported lazily so a CPU run never imports a GPU backend.
    `deterministic`: the backend's batch-invariant form (docs/deterministic.md)."""
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; available: {', '.join(sorted(_BACKENDS))}")
    module, cls = _INVARIANT_NATIVE if deterministic and name == "torch_native" else _BACKENDS[name]
    backend_cls = getattr(importlib.import_module(module), cls)
    kw = {"deterministic": True} if deterministic and name == "triton" else {}
    return backend_cls(kv, req_to_token, full_to_swa, sliding_window=sliding_window, **kw)


class ModelRunner:
    """Runs the model for one `ForwardBatch` (eagerly, or a captured decode graph) and turns each
    request's last hidden state into next-token logits, or straight into a greedy or sampled token.

    Owns the attention backend (chosen by name) and wires it into every batch; the KV pools, the
    request table and `full_to_swa` belong to the memory layer and are only read/written through it.
    """

    def __init__(
        self,
        model_config: ModelConfig,
        model: nn.Module,
        kv: SWAKVPool,
        req_to_token: ReqToTokenPool,
        full_to_swa: torch.Tensor | None,  # [full_size+2] int32, device; None without an SWA pool
        device: torch.device | str,
        dtype: torch.dtype,
        attention_backend: str | None = None,  # None: triton on CUDA, torch_native elsewhere
        deterministic: bool = False,  # batch-invariant kernels everywhere (docs/deterministic.md)
    ):
        self.model_config = model_config
        self.deterministic = deterministic
        if deterministic:
            from swaserve.layers.batch_invariant import make_batch_invariant

            make_batch_invariant(model)
        self.model = model
        self.device = torch.device(device)
        self.dtype = dtype
        if kv.swa_space and full_to_swa is None:
            raise ValueError("an SWA pool needs the full_to_swa table")
        self.attn_backend = create_attention_backend(
            attention_backend or default_attention_backend(self.device), kv, req_to_token, full_to_swa,
            model_config.sliding_window, deterministic,
        )
        self.graph_runner: DecodeGraphRunner | None = None
        self.verify_graphs: VerifyGraphRunner | None = None  # speculative verify steps (CUDA)
        self.piecewise: PiecewiseGraphRunner | ExtendGraphRunner | None = None  # extend steps (CUDA)
        # Row r: the last token sampled for the request in row r of the request table. Decode steps
        # read their input here, so a step can be launched before the host has seen the previous
        # step's tokens. Row 0 (padding) is never written and stays 0.
        self.last_tokens = torch.zeros(req_to_token.max_reqs + 1, dtype=torch.int64, device=self.device)  # [R+1] int64, device
        # Drafters that read the target's states (EAGLE-3, Gemma 4's assistant) set `keep_states`:
        # after each forward `step_states` holds `[num_tokens, D]` for every token of the batch, the
        # final hidden states, or the concatenated auxiliary layers' inputs where the model keeps
        # them (`aux_hidden` in the batch scratch). Valid until the next forward.
        self.keep_states = False
        self.step_states: torch.Tensor | None = None
        # Called first by every forward: the memory layer's deferred table writes (`runtime.build_runtime`
        # sets the SWA allocator's `sync_device`).
        self.before_forward: Callable[[], None] | None = None
        # Batch-scratch tensors graph replays carry (set before capture; a drafter head's runtime):
        # per-token inputs of decode and of extend (verify-shaped) graphs, key -> width, and the
        # keys the model writes that callers read after a replay.
        self.decode_scratch_inputs: dict[str, int] = {}
        self.extend_scratch_inputs: dict[str, int] = {}
        self.scratch_outputs: tuple[str, ...] = ()

    def enable_decode_graphs(self, max_bs: int) -> None:
        """Capture decode for batch sizes up to max_bs: CUDA graphs on a GPU, torch.compile on CPU."""
        if self.device.type == "cuda":
            from swaserve.runner.cuda_graph import CudaGraphRunner

            self.graph_runner = CudaGraphRunner(self, max_bs)
        else:
            from swaserve.runner.cpu_graph import CpuGraphRunner

            # Deterministic mode traces with the eager backend: inductor would fuse and reorder the
            # batch-invariant reductions (the graph's win on CPU is small anyway).
            self.graph_runner = CpuGraphRunner(self, max_bs, "eager" if self.deterministic else "inductor")

    def enable_verify_graphs(self, max_bs: int, q_len: int) -> None:
        """Capture extend steps of up to `q_len` tokens per request (speculative verify steps) for
        batch sizes up to max_bs (CUDA, triton backend, not in deterministic mode)."""
        from swaserve.runner.verify_graph import VerifyGraphRunner

        self.verify_graphs = VerifyGraphRunner(self, max_bs, q_len)

    def enable_piecewise_graphs(self, max_tokens: int, whole: bool = False) -> None:
        """Capture extend steps (prefill chunks, mixed steps) of up to `max_tokens` tokens as CUDA
        graphs in pieces between the attention calls, or (`whole`) one graph a step, attention
        included (CUDA only; `whole`: a backend that `captures_extend`)."""
        from swaserve.runner.extend_graph import ExtendGraphRunner
        from swaserve.runner.piecewise_graph import PiecewiseGraphRunner

        if self.device.type != "cuda":
            raise ValueError("piecewise CUDA graphs need a CUDA device")
        if whole and not self.attn_backend.captures_extend:
            raise ValueError("whole extend graphs (--extend-graph whole) need the triton attention backend")
        self.piecewise = (ExtendGraphRunner if whole else PiecewiseGraphRunner)(self, max_tokens)

    @torch.inference_mode()
    def warmup(self) -> None:
        """Compile the step's kernels now instead of on the first requests (Triton JITs each kernel on
        first use, ~0.3-1 s apiece): one prefill forward of two dummy requests, the LM head every
        way (logits, greedy, sampling) and the Sampler's kernels, then, unless decode is captured in
        graphs (capture compiles it), one decode forward. Dummy requests use table row 0 and KV slot
        0, as padded graph rows do, so no request's KV is touched."""
        from swaserve.runner.forward_batch import ForwardBatch, ForwardMode

        ext = [3, 2]  # two requests (no batch-size-1 specialisation), an odd token count
        T = sum(ext)
        positions = [p for n in ext for p in range(n)]
        prefill = ForwardBatch.build(ForwardMode.EXTEND, [0] * T, positions, [0] * len(ext), ext,
                                     torch.zeros(T, dtype=torch.int64), self.device,
                                     extend_prefix_lens=[0] * len(ext), extend_seq_lens=ext)
        hidden = self.forward_hidden(prefill)
        self.logits(hidden)
        if hidden.is_cuda and self.deterministic:
            for n in (1, 65):  # the fused head's two launch settings (soft-capped heads: logits + argmax)
                self._warm_greedy(hidden.new_zeros(n, hidden.shape[1]))
        elif hidden.is_cuda and not tp_group().enabled:  # (tensor parallelism: logits + argmax, as above)
            from swaserve.kernels.lm_head_argmax import SMALL_M, gumbel_noise
            from swaserve.kernels.top_p import top_p_threshold

            for n in (1, SMALL_M + 1):  # the head's two launch settings, greedy and sampling
                h = hidden.new_zeros(n, hidden.shape[1])
                self._warm_greedy(h)
                seeds = torch.zeros(n, dtype=torch.int64, device=h.device)
                self.sample_tokens(h, torch.ones(n, device=h.device), seeds)
            vocab = self.model_config.vocab_size
            gumbel_noise(seeds[:1], vocab)  # the Sampler's draw and top-p search on CUDA
            top_p_threshold(torch.zeros(1, vocab, device=h.device), torch.ones(1, device=h.device))
        if self.graph_runner is None:
            self.forward(ForwardBatch.build(ForwardMode.DECODE, None, ext, [0] * len(ext), [n + 1 for n in ext],
                                            torch.zeros(len(ext), dtype=torch.int64), self.device))

    def _warm_greedy(self, h: torch.Tensor) -> None:
        """The greedy head on `h`, plain and with structured outputs' masks (every row; some rows)."""
        self.greedy_tokens(h)
        every = torch.full((h.shape[0], (self.model_config.vocab_size + 31) // 32), -1, dtype=torch.int32,
                           device=h.device)
        self.greedy_tokens(h, (every, None))
        self.greedy_tokens(h, (every[:1], torch.zeros(1, dtype=torch.int64, device=h.device)))

    @torch.inference_mode()
    def forward_hidden(self, batch: ForwardBatch, token_indices: torch.Tensor | None = None) -> torch.Tensor:
        """Final hidden states `[batch_size, hidden]` of each request's last new token (on the graph
        path a view valid until the next replay); of the tokens at `token_indices` (`[n]` int64,
        device; an extend batch, e.g. every token of a speculative verify step) when given. A decode batch reads its inputs from
        `last_tokens`; one that brings its own (tests, teacher forcing) stores them there first, so
        the eager and graph paths see the same inputs."""
        with step_rows.within(batch.num_tokens):  # (the kernels' PDL row limit, `kernels/pdl.py`)
            return self._forward_hidden(batch, token_indices)

    def _forward_hidden(self, batch: ForwardBatch, token_indices: torch.Tensor | None) -> torch.Tensor:
        if self.before_forward is not None:
            self.before_forward()
        if batch.is_decode and batch.input_ids is not None:
            self.last_tokens.index_copy_(0, batch.req_pool_indices, batch.input_ids)
            self.last_tokens[:1].zero_()  # a padding row in the batch must not leave a token in row 0
        if self.graph_runner is not None and token_indices is None and self.graph_runner.can_run(batch):
            hidden = self.graph_runner.replay(batch)  # gathers its inputs from the table in the graph
            batch.scratch.update(self.graph_runner.last_scratch)
            if self.keep_states:
                self.step_states = batch.scratch.get("aux_hidden", hidden)
            return hidden
        if self.verify_graphs is not None and self.verify_graphs.can_run(batch):
            hidden, written = self.verify_graphs.replay(batch)
            batch.scratch.update(written)
            if self.keep_states:
                self.step_states = batch.scratch.get("aux_hidden", hidden)
            return hidden[batch.last_token_indices() if token_indices is None else token_indices]
        if batch.is_decode and batch.input_ids is None:
            batch.input_ids = self.last_tokens[batch.req_pool_indices]
        if batch.table_inputs is not None:  # a mixed batch's decode inputs still in flight
            batch.input_ids[batch.table_inputs[0]] = self.last_tokens[batch.table_inputs[1]]  # type: ignore[index]
        if self.piecewise is not None and self.piecewise.can_run(batch):
            hidden, written = self.piecewise.replay(batch)
            batch.scratch.update(written)
        else:
            batch.attn_backend = self.attn_backend
            self.attn_backend.init_forward_metadata(batch)
            hidden = self.model(batch)  # [num_tokens, hidden]
        if self.keep_states:
            self.step_states = batch.scratch.get("aux_hidden", hidden)
        return hidden[batch.last_token_indices() if token_indices is None else token_indices]

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`[n, hidden]` -> `[n, vocab]` float32 logits."""
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def greedy_tokens(self, hidden: torch.Tensor,
                      allowed: tuple[torch.Tensor, torch.Tensor | None] | None = None) -> torch.Tensor:
        """`[n, hidden]` -> `[n]` int64: the argmax of `logits(hidden)`, without writing the logits on
        a GPU (the LM head's largest output: 268 MB of float32 at 256 rows of Gemma). `allowed`: the
        bitmasks of structured outputs' rows (`(masks, rows)`, device; rows None: every row), whose argmax
        is over the tokens their mask allows."""
        if allowed is None:
            return self.model.greedy_tokens(hidden)
        return self.model.greedy_tokens(hidden, allowed)

    @torch.inference_mode()
    def sample_tokens(
        self, hidden: torch.Tensor, inv_temperature: torch.Tensor, seeds: torch.Tensor,
        allowed: tuple[torch.Tensor, torch.Tensor | None] | None = None,
    ) -> torch.Tensor:
        """`[n, hidden]` -> `[n]` int64 on CUDA: a draw from `softmax(logits * inv_temperature)` per
        row (the argmax where it is 0), without writing the logits; `allowed` as `greedy_tokens`."""
        return self.model.sample_tokens(hidden, inv_temperature, seeds, allowed)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits `[batch_size, vocab]` float32 of each request's last new token."""
        return self.logits(self.forward_hidden(batch))

    @torch.inference_mode()
    def record_sampled(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """Store each request's newly sampled token (`rows`: request-table rows, device) where its
        next decode step reads its input; enqueued on the device, no host sync."""
        self.last_tokens.index_copy_(0, rows, tokens)
