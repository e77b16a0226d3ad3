"""Test harness for model tests: allocates request rows and KV slots from the memory layer, builds
extend/decode ForwardBatches and runs them through ModelRunner. Stands in for the scheduler.

Strict on purpose: slot 0 of every pool is NaN, SWA slots are freed the moment they leave the
window (margin 0, chunk 1) and poisoned with NaN, and the SWA pool is sized so that decoding only
fits because of that eviction. A read outside the window therefore cannot go unnoticed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from swaserve.memory import (
    ReqToTokenPool,
    SWAEvictor,
    SWAKVPool,
    SWATokenToKVPoolAllocator,
    TokenToKVPoolAllocator,
)
from swaserve.model_config import ModelConfig
from swaserve.runner.forward_batch import ForwardBatch, ForwardMode
from swaserve.runner.model_runner import ModelRunner


@dataclass
class _Req:
    tokens: list[int] = field(default_factory=list)  # tokens whose K/V are in the cache
    evicted: int = 0  # SWA slots of positions below this were freed


class Harness:
    """Owns pools, allocator, request table and a ModelRunner for one model; hybrid or single-pool."""

    def __init__(
        self,
        config: ModelConfig,
        model: nn.Module,
        *,
        hybrid: bool,
        full_tokens: int,
        swa_tokens: int,
        max_reqs: int = 8,
        max_context: int = 256,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
        backend: str = "torch_native",
    ):
        """`device`/`backend`: the GPU diagnostics drive the same harness on CUDA, either backend."""
        self.config = config
        self.device = device
        self.hybrid = hybrid and config.is_hybrid
        self.table = ReqToTokenPool(max_reqs, max_context, device=device)
        self.kv = SWAKVPool.build(config, full_tokens, swa_tokens, hybrid=self.hybrid, dtype=dtype, device=device)
        self.full, self.swa = self.kv.full, self.kv.swa if self.kv.swa_space else None
        if self.hybrid:
            self.alloc = SWATokenToKVPoolAllocator(full_tokens, swa_tokens, device=device)
            self.evictor = SWAEvictor(self.alloc, self.table, config.sliding_window, margin=0, chunk=1)
            f2s = self.alloc.full_to_swa_device
        else:
            self.alloc, self.evictor, f2s = TokenToKVPoolAllocator(full_tokens), None, None
        for pool in self.kv.pools():
            for i in range(pool.num_layers):
                pool.k_buffer(i)[0] = float("nan")
                pool.v_buffer(i)[0] = float("nan")
        self.runner = ModelRunner(config, model, self.kv, self.table, f2s, device, dtype, backend)
        self.reqs: dict[int, _Req] = {}

    def add_request(self) -> int:
        row = self.table.alloc()
        assert row is not None, "request table full"
        self.reqs[row] = _Req()
        return row

    def extend(self, rows: list[int], chunks: list[list[int]]) -> torch.Tensor:
        """Prefill `chunks[i]` on top of what row i has cached; logits `[bs, vocab]` of each chunk's end."""
        return self._step(ForwardMode.EXTEND, rows, chunks)

    def decode(self, rows: list[int], tokens: list[int]) -> torch.Tensor:
        return self._step(ForwardMode.DECODE, rows, [[t] for t in tokens])

    def _step(self, mode: ForwardMode, rows: list[int], chunks: list[list[int]]) -> torch.Tensor:
        prefix = [len(self.reqs[r].tokens) for r in rows]
        locs = []
        for row, p, chunk in zip(rows, prefix, chunks):
            slots = self.alloc.alloc(len(chunk))
            if slots is None:
                raise RuntimeError("KV pool exhausted (SWA slots not evicted?)")
            self.table.write(row, p, slots)
            locs.append(slots)
        batch = ForwardBatch.build(
            mode,
            input_ids=[t for c in chunks for t in c],
            positions=[p + i for p, c in zip(prefix, chunks) for i in range(len(c))],
            req_pool_indices=rows,
            seq_lens=[p + len(c) for p, c in zip(prefix, chunks)],
            out_cache_loc=torch.cat(locs),
            device=self.device,
            extend_prefix_lens=None if mode is ForwardMode.DECODE else prefix,
            extend_seq_lens=None if mode is ForwardMode.DECODE else [len(c) for c in chunks],
        )
        logits = self.runner.forward(batch)
        for row, chunk in zip(rows, chunks):
            self.reqs[row].tokens += chunk
            self._evict(row)
        self.check()
        return logits

    def _evict(self, row: int) -> None:
        if self.evictor is None:
            return
        req = self.reqs[row]
        next_q = len(req.tokens)  # every query below this has run
        frontier = self.evictor.frontier(next_q)
        dead = self.alloc.translate_full_to_swa(self.table.slots(row, req.evicted, max(frontier, req.evicted))).long()
        new = self.evictor.evict(row, next_q, req.evicted)
        if new > req.evicted:
            for i in range(self.swa.num_layers):
                self.swa.k_buffer(i)[dead] = float("nan")
                self.swa.v_buffer(i)[dead] = float("nan")
            req.evicted = new

    def release(self, row: int) -> None:
        n = len(self.reqs.pop(row).tokens)
        self.alloc.free(self.table.slots(row, 0, n))
        self.table.free(row)
        self.check()

    def check(self) -> None:
        self.table.check_integrity()
        self.alloc.check_integrity()

    def assert_empty(self) -> None:
        """Every request released: no row, no full slot and (hybrid) no SWA slot still owned."""
        self.check()
        assert not self.table.live_rows(), f"rows still live: {self.table.live_rows()}"
        pools = [self.alloc.full, self.alloc.swa] if self.hybrid else [self.alloc]
        for pool in pools:
            assert pool.used() == 0, f"{pool.used()} slots still owned"

    def generate(self, prompts: list[list[int]], steps: int, chunk: int | None = None) -> tuple[list[torch.Tensor], list[list[int]]]:
        """Greedy: prefill all prompts (in chunks of `chunk` if set), then `steps - 1` batched decodes.

        Returns per prompt the `[steps, vocab]` logits that chose each new token, and the tokens.
        """
        rows = [self.add_request() for _ in prompts]
        done = [0] * len(prompts)
        first: list[torch.Tensor | None] = [None] * len(prompts)
        while any(d < len(p) for d, p in zip(done, prompts)):
            idx = [i for i, p in enumerate(prompts) if done[i] < len(p)]
            ends = [len(prompts[i]) if chunk is None else min(len(prompts[i]), done[i] + chunk) for i in idx]
            logits = self.extend([rows[i] for i in idx], [prompts[i][done[i]:e] for i, e in zip(idx, ends)])
            for j, (i, e) in enumerate(zip(idx, ends)):
                done[i] = e
                if e == len(prompts[i]):
                    first[i] = logits[j]
        step_logits = [[lg] for lg in first]
        tokens = [[int(lg.argmax())] for lg in first]
        for _ in range(steps - 1):
            logits = self.decode(rows, [t[-1] for t in tokens])
            for i, lg in enumerate(logits):
                step_logits[i].append(lg)
                tokens[i].append(int(lg.argmax()))
        for row in rows:
            self.release(row)
        return [torch.stack(s) for s in step_logits], tokens
