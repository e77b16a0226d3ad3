"""DraftModelDrafter: a smaller model with the target's tokenizer proposes tokens greedily (e.g. Gemma 3
270M drafting for Gemma 3 1B/4B). It keeps its own two-pool cache (`DraftCache`: per target sequence a
request row whose K/V cover the tokens it has seen); each step it drops what the target rejected,
catches up on the tokens the target appended (one extend forward for every request, a verify-shaped
CUDA graph when they fit), then decodes k - 1 steps. The drafted tokens stay on the device between
those steps (each decode reads its input from the runner's last-token table): one host sync a step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from swaserve.h2d import to_device
from swaserve.runner.forward_batch import ForwardMode
from swaserve.speculative.draft_cache import DraftCache, DraftRow

if TYPE_CHECKING:
    from swaserve.config import SchedulerConfig
    from swaserve.model_config import ModelConfig
    from swaserve.runtime import Runtime
    from swaserve.scheduler.req import Req


@dataclass
class _DraftSeq:
    cache: DraftRow
    tokens: list[int] = field(default_factory=list)  # the tokens whose K/V are in the draft cache, in order
    confirmed: int = 0  # tokens[:confirmed] is a prefix of the target's ids (which only grow)


class DraftModelDrafter:
    """Owns the draft model's runtime (pools, request table, allocator, runner). Invariant: for every
    tracked sequence, positions [0, len(tokens)) of its row hold K/V of `tokens` and nothing else."""

    def __init__(self, rt: Runtime):
        self.rt = rt
        self.cache = DraftCache(rt)
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
        # dummy target (benchmarks): a dummy draft too. Its extend steps are catch-ups of a few
        # tokens (verify-shaped graphs) and prompt prefills: no piecewise graphs.
        runner = RunnerConfig(load_format=load_format, enable_piecewise_cuda_graph=False)
        loaded, config = load_engine_model(model, device, dtype, sched, runner)
        if config.vocab_size != target.vocab_size:
            raise ValueError(f"the draft model's vocabulary ({config.vocab_size}) differs from the target's "
                             f"({target.vocab_size}): it must use the same tokenizer")
        budget = (256 << 20) if device.type == "cpu" else (4 << 30)
        cache = CacheConfig(kv_cache_bytes=budget, disable_prefix_cache=True)
        rt = build_runtime(config, loaded.model, device, dtype, cache, sched, runner, start=False)
        start_runner(rt, runner, verify=verify)
        return cls(rt)

    # -- the drafter interface ---------------------------------------------------------------

    def propose(self, reqs: list[Req], ks: list[int]) -> list[list[int]]:
        live = [(r, k) for r, k in zip(reqs, ks) if k > 0 and self._sync(r)]
        if not live:
            return [[] for _ in reqs]
        rs = [r for r, _ in live]
        seqs = [self.seqs[r.rid] for r in rs]
        steps = max(k for _, k in live)
        runner = self.rt.runner
        outs = [self._catch_up(rs, seqs)]
        rows = to_device(torch.tensor([s.cache.row for s in seqs], dtype=torch.int64), runner.device)
        for step in range(1, steps):
            runner.record_sampled(rows, outs[-1])  # the next decode's inputs, on the device
            outs.append(self._decode(rs, seqs, step))
        drafted = torch.stack(outs, dim=1).tolist()  # the step's one host sync
        drafts: dict[str, list[int]] = {}
        for (r, k), s, d in zip(live, seqs, drafted):
            s.tokens.extend(d[: steps - 1])  # the decode steps' inputs now have K/V
            drafts[r.rid] = d[:k]
        return [drafts.get(r.rid, []) for r in reqs]

    def release(self, req: Req) -> None:
        if self.seqs.pop(req.rid, None) is not None:
            self.cache.close(req.rid)

    # -- the draft cache ---------------------------------------------------------------------

    def _sync(self, r: Req) -> bool:
        """Keep the K/V of the tokens the draft cache shares with `r.ids`, free the rest (at least
        the last token is recomputed: its logits give the first draft). False (no draft this
        step) when the draft's request table is full."""
        seq = self.seqs.get(r.rid)
        if seq is None:
            row = self.cache.open(r.rid)
            if row is None:
                return False
            seq = self.seqs[r.rid] = _DraftSeq(row)
        common = seq.confirmed
        for a, b in zip(seq.tokens[common:], r.ids[common:]):
            if a != b:
                break
            common += 1
        keep = min(common, len(r.ids) - 1)
        self.cache.truncate(seq.cache, keep)
        del seq.tokens[keep:]
        seq.confirmed = keep
        return True

    def _catch_up(self, reqs: list[Req], seqs: list[_DraftSeq]) -> torch.Tensor:
        """One extend forward over each sequence's tokens the draft has not seen: `[n]` int64 on
        the device, each sequence's first draft."""
        news = [r.ids[len(s.tokens):] for r, s in zip(reqs, seqs)]
        positions = [list(range(len(s.tokens), len(r.ids))) for r, s in zip(reqs, seqs)]
        batch = self.cache.batch(ForwardMode.EXTEND, [s.cache for s in seqs], news, positions)
        for s, new in zip(seqs, news):
            s.tokens.extend(new)
        out = self.rt.runner.greedy_tokens(self.rt.runner.forward_hidden(batch))
        self.cache.evict([s.cache for s in seqs])  # every query up to the confirmed tokens has run
        return out

    def _decode(self, reqs: list[Req], seqs: list[_DraftSeq], step: int) -> torch.Tensor:
        """Draft decode `step` (1..k-1): inputs from the last-token table; `[n]` int64, device."""
        positions = [[len(r.ids) + step - 1] for r in reqs]
        batch = self.cache.batch(ForwardMode.DECODE, [s.cache for s in seqs], None, positions)
        return self.rt.runner.greedy_tokens(self.rt.runner.forward_hidden(batch))

    def check_integrity(self) -> None:
        """The draft pools hold exactly the tracked sequences' tokens."""
        self.cache.check_integrity()
        assert all(s.cache.length == len(s.tokens) for s in self.seqs.values())
