"""StateHeadDrafter: what the drafters with a one-layer head over the target's states share (EAGLE-3,
MiMo-V2's MTP layer). The head's K/V entry at position t is computed from the target's state at t and
the embedding of token t + 1, in its own cache (`DraftCache`). `observe` keeps the target's states of
each request's confirmed tokens; each step the head catches up on the positions whose next token is
now known (one extend forward), then chains k - 1 decode steps, its own output standing in for the
target's state; the drafted tokens stay on the device until the step's one host sync."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from swaserve.h2d import to_device
from swaserve.runner.forward_batch import ForwardBatch, ForwardMode
from swaserve.scheduler.speculate import speculates
from swaserve.speculative.draft_cache import DraftCache, DraftRow

if TYPE_CHECKING:
    from swaserve.config import CacheConfig, SchedulerConfig
    from swaserve.model_config import ModelConfig
    from swaserve.runtime import Runtime
    from swaserve.scheduler.req import Req

# Target states waiting for the token after them are folded into the head's cache once this many
# are ready (a prefill chunk, or decode steps while speculation is off for a large batch), so what a
# sequence holds back stays small.
FLUSH_ROWS = 16


@dataclass
class StateSeq:
    cache: DraftRow  # entry j holds the K/V of sequence position base + j
    base: int  # the first position the target's states were seen for (> 0 after a prefix-cache hit)
    exact: int = 0  # entries [0, exact) come from the target's states; later ones from the last drafts
    pending: list[torch.Tensor] = field(default_factory=list)  # [n_i, state width] of positions base + exact ..
    num_pending: int = 0


def head_runtime(config: ModelConfig, head: Any, kv_heads: int, kv_width: int, target: ModelConfig,
                 target_sched: SchedulerConfig, device: torch.device, dtype: torch.dtype,
                 scratch: tuple[dict[str, int], dict[str, int], tuple[str, ...]], verify: tuple[int, int],
                 ) -> tuple[Runtime, Callable[[], None]]:
    """The head's own runtime: a request row per target row, a cache sized for every running request
    at full context (at most 256 MiB on CPU, 4 GiB on a GPU), and the call that starts it. On a GPU
    its chained decode steps and its catch-up extends (up to `verify` = (max batch, tokens per
    request)) replay CUDA graphs, the state input going in through static buffers: `scratch` =
    (decode inputs, extend inputs, outputs) of the batch scratch, key -> width. Started (captured)
    only after `attach`: the graphs must see the embedding and LM head the head shares with the
    target."""
    from swaserve.config import CacheConfig, RunnerConfig, SchedulerConfig
    from swaserve.runtime import build_runtime, start_runner

    sched = SchedulerConfig(max_running_requests=target_sched.max_running_requests,
                            max_prefill_tokens=target_sched.max_prefill_tokens, max_context=target.max_context)
    need = (sched.max_running_requests + 1) * target.max_context * kv_heads * kv_width
    budget = min((256 << 20) if device.type == "cpu" else (4 << 30), 2 * need * dtype.itemsize + (8 << 20))
    cache: CacheConfig = CacheConfig(kv_cache_bytes=budget, disable_prefix_cache=True)
    runner_cfg = RunnerConfig(enable_piecewise_cuda_graph=False)  # its extends carry state inputs: verify graphs
    rt = build_runtime(config, head, device, dtype, cache, sched, runner_cfg, start=False)
    rt.runner.decode_scratch_inputs, rt.runner.extend_scratch_inputs, rt.runner.scratch_outputs = scratch
    return rt, lambda: start_runner(rt, runner_cfg, verify=verify)


class StateHeadDrafter:
    """Owns the head's runtime and one `StateSeq` per speculating request. Invariants: for a tracked
    request, `base + exact + num_pending` is the number of positions the target has shown states for,
    and entry j < exact of its row holds K/V of (state at base + j, embedding of ids[base + j + 1]).

    Subclasses set `name`, `state_width` (the target states' width), `extend_key` / `chain_key` (the
    batch scratch entries the head reads its state input from) and may override `chain_states`."""

    name = "the head"
    extend_key = chain_key = ""

    def __init__(self, rt: Runtime, head: Any, state_width: int, start: Callable[[], None] | None = None):
        self.rt, self.head, self.state_width = rt, head, state_width
        self._start = start
        self.cache = DraftCache(rt)
        self.seqs: dict[str, StateSeq] = {}

    def start(self, target: Runtime) -> None:
        """After `attach` and the target's own start: capture the head's graphs, warm it up."""
        if self._start is not None:
            self._start()
            self._start = None

    def chain_states(self, batch: ForwardBatch, hidden: torch.Tensor) -> torch.Tensor:
        """What the next draft step reads as its state, one row per request: the head's output."""
        return hidden

    # -- the drafter interface ---------------------------------------------------------------

    def observe(self, reqs: list[Req], states: torch.Tensor, offsets: list[int], counts: list[int]) -> None:
        """Keep the target's states of each speculating request's confirmed tokens; fold those whose
        next token is known into the head's cache once FLUSH_ROWS are ready."""
        assert states.shape[1] == self.state_width, f"{self.name}: target states of the wrong width (attach first)"
        due = []
        for r, off, n in zip(reqs, offsets, counts):
            if n == 0 or not speculates(r.params):
                continue
            seq = self.seqs.get(r.rid)
            if seq is None:  # its first step is a prefill chunk, whose K/V length counts it already
                row = self.cache.open(r.rid)
                if row is None:
                    raise RuntimeError(f"{self.name}'s request table is full")  # sized like the target's
                seq = self.seqs[r.rid] = StateSeq(row, base=r.kv_len - n)
            seq.pending.append(states[off : off + n].clone())
            seq.num_pending += n
            if self._ready(seq, r) >= FLUSH_ROWS:
                due.append(r)
        if due:
            self._extend(due)

    @torch.inference_mode()
    def propose(self, reqs: list[Req], ks: list[int]) -> list[list[int]]:
        live = []
        for r, k in zip(reqs, ks):
            seq = self.seqs.get(r.rid)
            if k > 0 and seq is not None and self._ready(seq, r) > 0:
                assert seq.base + seq.exact + seq.num_pending == len(r.ids) - 1, "states of every K/V position seen"
                live.append((r, k))
        if not live:
            return [[] for _ in reqs]
        rs = [r for r, _ in live]
        seqs = [self.seqs[r.rid] for r in rs]
        runner = self.rt.runner
        hidden, g = self._extend(rs)
        outs = [runner.greedy_tokens(hidden)]
        rows = to_device(torch.tensor([s.cache.row for s in seqs], dtype=torch.int64), runner.device)
        for step in range(1, max(k for _, k in live)):
            runner.record_sampled(rows, outs[-1])  # the next step's inputs, on the device
            g, tokens = self._chain(rs, seqs, g, step)
            outs.append(tokens)
        drafted = torch.stack(outs, dim=1).tolist()  # the step's one host sync
        drafts = {r.rid: d[:k] for (r, k), d in zip(live, drafted)}
        return [drafts.get(r.rid, []) for r in reqs]

    def release(self, req: Req) -> None:
        if self.seqs.pop(req.rid, None) is not None:
            self.cache.close(req.rid)

    def check_integrity(self) -> None:
        self.cache.check_integrity()

    # -- the head's cache ----------------------------------------------------------------------

    @staticmethod
    def _ready(seq: StateSeq, r: Req) -> int:
        """Pending positions whose next token is known (t + 1 < len(ids))."""
        return max(0, min(seq.num_pending, len(r.ids) - 1 - seq.base - seq.exact))

    @torch.inference_mode()
    def _extend(self, reqs: list[Req]) -> tuple[torch.Tensor, torch.Tensor]:
        """One extend forward over each request's ready positions (the last drafts' entries dropped
        first): the head's output `[len(reqs), hidden]` at each one's last position, and the state
        the first chained step reads."""
        rows, ids, positions, states = [], [], [], []
        for r in reqs:
            seq = self.seqs[r.rid]
            n = self._ready(seq, r)
            self.cache.truncate(seq.cache, seq.exact)
            pending = torch.cat(seq.pending) if len(seq.pending) > 1 else seq.pending[0]
            states.append(pending[:n])
            seq.pending = [pending[n:]] if n < seq.num_pending else []
            seq.num_pending -= n
            start = seq.base + seq.exact
            rows.append(seq.cache)
            ids.append(r.ids[start + 1 : start + n + 1])
            positions.append(list(range(start, start + n)))
            seq.exact += n
        batch = self.cache.batch(ForwardMode.EXTEND, rows, ids, positions)
        batch.scratch[self.extend_key] = torch.cat(states)
        hidden = self.rt.runner.forward_hidden(batch)
        self.cache.evict(rows)
        return hidden, self.chain_states(batch, hidden)

    def _chain(self, reqs: list[Req], seqs: list[StateSeq], g: torch.Tensor, step: int,
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft step `step` >= 1: each request's previous draft (in the runner's last-token table) at
        position len(ids) - 2 + step, the head's own state `g` standing in for the target's; (the next
        step's states, the drafts `[n]` int64 on the device). Every live request runs every step; a
        request that asked for fewer drafts has the extra entries dropped at its next catch-up."""
        positions = [[len(r.ids) - 2 + step] for r in reqs]
        assert all(s.base + s.cache.length == p[0] for s, p in zip(seqs, positions))
        batch = self.cache.batch(ForwardMode.DECODE, [s.cache for s in seqs], None, positions)
        batch.scratch[self.chain_key] = g
        hidden = self.rt.runner.forward_hidden(batch)
        return self.chain_states(batch, hidden), self.rt.runner.greedy_tokens(hidden)
