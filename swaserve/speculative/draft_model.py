"""DraftModelDrafter: a smaller model with the target's tokenizer proposes tokens greedily (e.g. Gemma 3
270M drafting for Gemma 3 1B/4B). It keeps its own two-pool cache: per target sequence a request row
whose K/V cover the tokens it has seen; each step it drops what the target rejected, catches up on the
tokens the target appended (one extend forward for every request), then decodes k - 1 steps."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from swaserve.runner.forward_batch import ForwardBatch, ForwardMode

if TYPE_CHECKING:
    from swaserve.config import ModelConfig, SchedulerConfig
    from swaserve.runtime import Runtime
    from swaserve.scheduler.req import Req


@dataclass
class _DraftSeq:
    row: int
    tokens: list[int] = field(default_factory=list)  # the tokens whose K/V are in the draft cache, in order
    swa_evicted: int = 0


class DraftModelDrafter:
    """Owns the draft model's runtime (pools, request table, allocator, runner). Invariant: for every
    tracked sequence, positions [0, len(tokens)) of its row hold K/V of `tokens` and nothing else."""

    def __init__(self, rt: Runtime):
        self.rt = rt
        self.seqs: dict[str, _DraftSeq] = {}

    @classmethod
    def build(cls, model: str | None, target: ModelConfig, device: torch.device, dtype: torch.dtype,
              target_sched: SchedulerConfig, load_format: str, verify: tuple[int, int] | None = None,
              ) -> DraftModelDrafter:
        """`verify`: (max batch, tokens per request) of the catch-up steps captured in CUDA graphs
        (the tokens a request appended since its last draft: at most K + 1)."""
        from swaserve.config import CacheConfig, RunnerConfig, SchedulerConfig
        from swaserve.engine_setup import load_engine_model
        from swaserve.runtime import build_runtime, start_runner

        sched = SchedulerConfig(max_running_requests=target_sched.max_running_requests,
                                max_prefill_tokens=target_sched.max_prefill_tokens, max_context=target.max_context)
        runner = RunnerConfig(load_format=load_format)  # dummy target (benchmarks): a dummy draft too
        loaded, config = load_engine_model(model, device, dtype, sched, runner)
        if config.vocab_size != target.vocab_size:
            raise ValueError(f"the draft model's vocabulary ({config.vocab_size}) differs from the target's "
                             f"({target.vocab_size}): it must use the same tokenizer")
        budget = (256 << 20) if device.type == "cpu" else (4 << 30)
        cache = CacheConfig(kv_cache_bytes=budget, disable_prefix_cache=True)
        rt = build_runtime(config, loaded.model, device, dtype, cache, sched, runner, start=False)
        start_runner(rt, runner, sched, verify=verify)
        return cls(rt)

    # -- the drafter interface ---------------------------------------------------------------

    def propose(self, reqs: list[Req], ks: list[int]) -> list[list[int]]:
        live = [(r, k) for r, k in zip(reqs, ks) if k > 0 and self._sync(r)]
        drafts: dict[str, list[int]] = {}
        if live:
            tokens = self._catch_up([r for r, _ in live])
            for (r, _), t in zip(live, tokens):
                drafts[r.rid] = [t]
            for step in range(1, max(k for _, k in live)):
                going = [r for r, k in live if k > step and len(drafts[r.rid]) == step]
                if not going:
                    break
                for r, t in zip(going, self._decode(going, [drafts[r.rid][-1] for r in going])):
                    drafts[r.rid].append(t)
        return [drafts.get(r.rid, []) for r in reqs]

    def release(self, req: Req) -> None:
        seq = self.seqs.pop(req.rid, None)
        if seq is not None:
            self._truncate(seq, 0)
            self.rt.req_to_token.free(seq.row)

    # -- the draft cache ---------------------------------------------------------------------

    def _sync(self, r: Req) -> bool:
        """Keep the K/V of the tokens the draft cache shares with `r.ids`, free the rest; reserve
        room for catching up and drafting. False (no draft this step) when the cache is full."""
        seq = self.seqs.get(r.rid)
        if seq is None:
            row = self.rt.req_to_token.alloc()
            if row is None:
                return False
            seq = self.seqs[r.rid] = _DraftSeq(row)
        common = 0
        for a, b in zip(seq.tokens, r.ids):
            if a != b:
                break
            common += 1
        self._truncate(seq, min(common, len(r.ids) - 1))
        return True

    def _truncate(self, seq: _DraftSeq, n: int) -> None:
        if len(seq.tokens) > n:
            table = self.rt.req_to_token
            self.rt.allocator.free(table.slots(seq.row, n, len(seq.tokens)))
            table.clear(seq.row, n, len(seq.tokens))
            del seq.tokens[n:]

    def _alloc(self, seq: _DraftSeq, tokens: list[int]) -> torch.Tensor | None:
        slots = self.rt.allocator.alloc(len(tokens))
        if slots is not None:
            self.rt.req_to_token.write(seq.row, len(seq.tokens), slots)
            seq.tokens.extend(tokens)
        return slots

    def _evict(self, seqs: list[_DraftSeq]) -> None:
        ev = self.rt.evictor
        if ev is None:
            return
        new = ev.evict_many([(s.row, len(s.tokens), s.swa_evicted) for s in seqs])
        for s, e in zip(seqs, new):
            s.swa_evicted = e

    def _catch_up(self, reqs: list[Req]) -> list[int]:
        """One extend forward over each sequence's tokens the draft has not seen; its first draft."""
        ids, pos, rows, seq_lens, prefix, ext, locs = [], [], [], [], [], [], []
        for r in reqs:
            seq = self.seqs[r.rid]
            new = r.ids[len(seq.tokens):]
            start = len(seq.tokens)
            slots = self._alloc(seq, new)
            if slots is None:
                raise RuntimeError("the draft model's KV cache is full")  # sized for max_running x context
            ids += new
            pos += range(start, start + len(new))
            rows.append(seq.row)
            prefix.append(start)
            ext.append(len(new))
            seq_lens.append(start + len(new))
            locs.append(slots)
        batch = ForwardBatch.build(ForwardMode.EXTEND, ids, pos, rows, seq_lens, torch.cat(locs), self.rt.runner.device,
                                   extend_prefix_lens=prefix, extend_seq_lens=ext)
        out = self.rt.runner.greedy_tokens(self.rt.runner.forward_hidden(batch)).tolist()
        self._evict([self.seqs[r.rid] for r in reqs])  # every query up to the confirmed tokens has run
        return out

    def _decode(self, reqs: list[Req], inputs: list[int]) -> list[int]:
        seqs = [self.seqs[r.rid] for r in reqs]
        prefix = [len(s.tokens) for s in seqs]
        locs = [self._alloc(s, [t]) for s, t in zip(seqs, inputs)]
        if any(slot is None for slot in locs):
            raise RuntimeError("the draft model's KV cache is full")
        batch = ForwardBatch.build(ForwardMode.DECODE, inputs, prefix, [s.row for s in seqs],
                                   [p + 1 for p in prefix], torch.cat(locs), self.rt.runner.device)  # type: ignore[arg-type]
        return self.rt.runner.greedy_tokens(self.rt.runner.forward_hidden(batch)).tolist()

    def check_integrity(self) -> None:
        """The draft pools hold exactly the tracked sequences' tokens."""
        owned = [self.rt.req_to_token.slots(s.row, 0, len(s.tokens)) for s in self.seqs.values()]
        self.rt.allocator.check_integrity(torch.cat(owned) if owned else torch.empty(0, dtype=torch.int64))
        self.rt.req_to_token.check_integrity()
        assert all(self.rt.req_to_token.clear_from(s.row, len(s.tokens)) for s in self.seqs.values())
