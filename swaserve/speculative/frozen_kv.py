"""FrozenKVDrafter: Gemma 4's assistant (`gemma4_assistant`) drafting over the target's own KV cache. It
stores no K/V: every assistant layer reads the target's last full-attention or last sliding layer
through the target's request table (SWA space for the sliding one), as a decode-shaped forward with
one query per request at position len(ids) - 1 and keys [0, len(ids) - 1), the same for all K steps.
On a GPU whose target decodes in CUDA graphs the K-step chain replays one graph per batch size
(`frozen_kv_graph.FrozenKVGraphRunner`); larger batches run eagerly."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from swaserve.h2d import to_device
from swaserve.runner.forward_batch import ForwardBatch, ForwardMode

if TYPE_CHECKING:
    from swaserve.config import SchedulerConfig, SpeculativeConfig
    from swaserve.model_config import ModelConfig
    from swaserve.models.gemma4_assistant import Gemma4Assistant
    from swaserve.runtime import Runtime
    from swaserve.scheduler.req import Req
    from swaserve.speculative.frozen_kv_graph import FrozenKVGraphRunner

log = logging.getLogger(__name__)


class FrozenKVDrafter:
    """Owns the assistant model, an attention backend of its own over the target's pools (its window is
    the assistant's W + 1, see `Gemma4Assistant`), and `states`: per request-table row, the target's
    final hidden state that predicted the row's newest token (written by `observe`, on the device).

    Invariants: drafting never writes a pool or the request table (the layers are KV-shared readers and
    the batch's write slots are the reserved slot 0); a request is drafted for only when every key its
    sliding layers read still has an SWA slot (the SWA eviction margin is raised to 2 on attach, so
    the (W+1)-th key survives; a prefix-cache hit can still lack it for a step)."""

    def __init__(self, model: Gemma4Assistant, device: torch.device, graph_bs: int = 0, steps: int = 0):
        self.model = model
        self.device = device
        self.graph_bs, self.steps = graph_bs, steps  # graphs for batches <= graph_bs of `steps` drafts
        self.graphs: FrozenKVGraphRunner | None = None
        self.rt: Runtime | None = None
        self.backend = None
        self.embed = None  # the target's (scaled) token embedding
        self.states: torch.Tensor | None = None  # [max_reqs+1, target hidden] model dtype, device

    @classmethod
    def build(cls, cfg: SpeculativeConfig, target: ModelConfig, device: torch.device, dtype: torch.dtype,
              sched: SchedulerConfig, load_format: str) -> FrozenKVDrafter:
        from pathlib import Path

        from transformers import AutoConfig

        from swaserve.models.gemma4_assistant import Gemma4Assistant

        path = cfg.speculative_draft_model
        if path is None or not (Path(path) / "config.json").is_file():
            raise ValueError("speculative_method 'mtp' needs speculative_draft_model: the HF directory of a "
                             f"gemma4_assistant checkpoint (config.json + safetensors), got {path!r}")
        hf = AutoConfig.from_pretrained(str(path), local_files_only=True)
        with torch.device("meta"):
            model = Gemma4Assistant(hf, target)
        model = model.to(dtype=dtype).to_empty(device=device).eval()
        if load_format == "dummy":
            from swaserve.loader.dummy import init_dummy_weights

            init_dummy_weights(model)
            if model.masked_embedding is not None:
                emb = model.masked_embedding
                emb.token_ordering.copy_(torch.randperm(emb.token_ordering.numel(), device="cpu"))
        else:
            from swaserve.loader.safetensors import iter_safetensors

            model.load_weights(iter_safetensors(path))
        return cls(model, device, min(cfg.speculative_max_batch_size, sched.max_running_requests),
                   cfg.speculative_num_tokens)

    def attach(self, rt: Runtime) -> None:
        from swaserve.attention.torch_native import TorchNativeAttnBackend
        from swaserve.runner.model_runner import create_attention_backend

        self.rt = rt
        runner = rt.runner
        self.embed = runner.model.model.embed_tokens
        hidden = self.model.hf_config.backbone_hidden_size
        rows = rt.req_to_token.max_reqs + 1
        self.states = torch.zeros(rows, hidden, dtype=runner.dtype, device=self.device)
        name = "torch_native" if isinstance(runner.attn_backend, TorchNativeAttnBackend) else "triton"
        self.backend = create_attention_backend(name, rt.kv, rt.req_to_token, runner.attn_backend.full_to_swa,
                                                self.model.window)
        ev = rt.evictor
        if ev is not None and self.model.window is not None:
            # The target frees keys before p - W + 1 - margin once its queries reach p; the assistant
            # reads back to p - window (window = its W + 1): margin 2 when both windows are W.
            need = self.model.window + 1 - ev.window
            if ev.margin < need:
                log.info("mtp drafter: SWA eviction margin raised from %d to %d", ev.margin, need)
                ev.margin = need

    def start(self, rt: Runtime) -> None:
        """After `start_runner` (the engine calls it once the target's graphs are captured; at `attach`
        it is not yet known whether they will be): capture the drafting chain in CUDA graphs where the
        target decodes in them, on CUDA with the (non-deterministic) triton backend."""
        from swaserve.attention.triton import TritonAttnBackend
        from swaserve.speculative.frozen_kv_graph import FrozenKVGraphRunner

        backend = self.backend
        if (self.device.type == "cuda" and rt.runner.graph_runner is not None and self.graph_bs > 0
                and self.steps > 0 and isinstance(backend, TritonAttnBackend) and not backend.deterministic):
            self.graphs = FrozenKVGraphRunner(self, self.graph_bs, self.steps)

    # -- the drafter interface ---------------------------------------------------------------

    @torch.inference_mode()
    def observe(self, reqs: list[Req], states: torch.Tensor, offsets: list[int], counts: list[int]) -> None:
        assert self.states is not None, "attach() first"
        pairs = [(r.row, o + n - 1) for r, o, n in zip(reqs, offsets, counts) if n > 0 and r.row is not None]
        if pairs:
            # [2, n] int64, device: table rows, then the state rows they take.
            idx = to_device(torch.tensor(pairs, dtype=torch.int64).T.contiguous(), self.device)
            self.states.index_copy_(0, idx[0], states[idx[1]].to(self.states.dtype))

    @torch.inference_mode()
    def propose(self, reqs: list[Req], ks: list[int]) -> list[list[int]]:
        assert self.states is not None and self.embed is not None, "attach() first"
        if self.rt.runner.before_forward is not None:  # it reads the target's tables, as its forward does
            self.rt.runner.before_forward()
        live = [i for i, (r, k) in enumerate(zip(reqs, ks))
                if k > 0 and r.row is not None and self._keys_live(r)]
        if not live:
            return [[] for _ in reqs]
        rows = [reqs[i].row for i in live]
        kv = [reqs[i].kv_len for i in live]
        assert all(reqs[i].kv_len == len(reqs[i].ids) - 1 for i in live), "speculation runs without overlap"
        tokens, steps = [reqs[i].ids[-1] for i in live], max(ks[i] for i in live)
        if self.graphs is not None and self.graphs.can_run(len(live), steps):
            out = self.graphs.run(rows, kv, tokens).tolist()  # one host sync, as the eager chain
        else:
            out = self._chain(rows, kv, tokens, steps)
        drafts: list[list[int]] = [[] for _ in reqs]
        for i, d in zip(live, out):
            drafts[i] = d[: ks[i]]
        return drafts

    def _chain(self, rows: list[int], kv: list[int], tokens: list[int], steps: int) -> list[list[int]]:
        """The eager K-step chain over the live rows only: `steps` tokens per row."""
        assert self.states is not None and self.embed is not None
        # One query per request at position len(ids) - 1 over keys [0, len(ids) - 1); nothing is stored,
        # so the write slots are the reserved slot 0.
        nowhere = torch.zeros(len(rows), dtype=torch.int64)
        batch = ForwardBatch.build(ForwardMode.DECODE, None, kv, rows, kv, nowhere,  # type: ignore[arg-type]
                                   self.device)
        batch.attn_backend = self.backend
        self.backend.init_forward_metadata(batch)  # type: ignore[union-attr]
        token = to_device(torch.tensor(tokens, dtype=torch.int64), self.device)
        hidden = self.states[batch.req_pool_indices]
        drafted = []
        for _ in range(steps):
            hidden, token = self.model(torch.cat([self.embed(token), hidden], dim=-1), batch)
            drafted.append(token)
        return torch.stack(drafted, dim=1).tolist()

    def release(self, req: Req) -> None:
        """Nothing to drop: a row's state is overwritten by the next request's prefill before it drafts."""

    # -- helpers -------------------------------------------------------------------------------

    def _keys_live(self, r: Req) -> bool:
        """Whether every key the sliding layers read (positions kv_len - W - 1 .. kv_len - 1) still has
        its SWA slot, from the host mirrors (no device read). The request's own eviction keeps them
        (margin 2); a prefix-cache hit guarantees only the W - 1 positions before the match."""
        rt = self.rt
        assert rt is not None
        window = self.model.window
        if rt.evictor is None or window is None:
            return True
        full = rt.req_to_token.slots(r.row, max(0, r.kv_len - window), r.kv_len)  # type: ignore[arg-type]
        return bool((rt.allocator.full_to_swa[full] > 0).all())  # type: ignore[union-attr]
