"""MiMoMTPDrafter: MiMo-V2-Flash's first MTP layer (`models/mimo_v2_mtp.py`) drafting from the target's
final (normed) states. Its K/V entry at position t is computed from the target's state at t and the
embedding of token t + 1, in its own one-layer sliding-window cache (`DraftCache`, SWA pool with
eviction). Each step it catches up on the positions the target confirmed (one extend forward), then
chains k - 1 decode steps on its own output, the same layer at every depth."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from swaserve.models.mimo_v2_mtp import HIDDEN_INPUT, MTP_LAYER, MiMoMTPHead, head_config
from swaserve.runner.forward_batch import ForwardMode
from swaserve.speculative.draft_cache import DraftCache, DraftRow
from swaserve.speculative.verify import speculates

if TYPE_CHECKING:
    from swaserve.config import ModelConfig, SchedulerConfig, SpeculativeConfig
    from swaserve.runtime import Runtime
    from swaserve.scheduler.req import Req

# Target states waiting for the token after them are folded into the head's cache once this many
# are ready (a prefill chunk, or decode steps while speculation is off for a large batch).
FLUSH_ROWS = 16


@dataclass
class _MTPSeq:
    cache: DraftRow  # entry j holds the K/V of sequence position base + j
    base: int  # the first position the target's states were seen for (> 0 after a prefix-cache hit)
    exact: int = 0  # entries [0, exact) come from the target's states; later ones from the last drafts
    pending: list[torch.Tensor] = field(default_factory=list)  # [n_i, hidden] of positions base + exact ..
    num_pending: int = 0


class MiMoMTPDrafter:
    """Owns the MTP layer's runtime and one `_MTPSeq` per speculating request. Invariants: for a tracked
    request, `base + exact + num_pending` is the number of positions the target has shown states for,
    and entry j < exact of its row holds K/V of (state at base + j, embedding of ids[base + j + 1])."""

    def __init__(self, rt: Runtime, head: MiMoMTPHead):
        self.rt, self.head = rt, head
        self.cache = DraftCache(rt)
        self.seqs: dict[str, _MTPSeq] = {}

    @classmethod
    def build(cls, cfg: SpeculativeConfig, target: ModelConfig, device: torch.device, dtype: torch.dtype,
              target_sched: SchedulerConfig, load_format: str) -> MiMoMTPDrafter:
        from swaserve.config import CacheConfig, ModelConfig, RunnerConfig, SchedulerConfig
        from swaserve.runtime import build_runtime

        thf = target.hf_config
        if load_format == "dummy":
            weights = None
            if not num_mtp_layers_declared(thf):
                raise ValueError("speculative_method 'mtp': this MiMo-V2-Flash config declares no MTP layers "
                                 "(num_nextn_predict_layers)")
        else:
            weights = mtp_weights(Path(getattr(thf, "_name_or_path", "") or "."))
        hf = head_config(thf)
        with torch.device("meta"):
            head = MiMoMTPHead(hf)
        head = head.to(dtype=dtype).to_empty(device=device).eval()
        if weights is None:
            from swaserve.loader.dummy import init_dummy_weights

            init_dummy_weights(head)
        else:
            head.load_weights(weights)
        config = ModelConfig.from_hf(hf, max_context=target.max_context)
        sched = SchedulerConfig(max_running_requests=target_sched.max_running_requests,
                                max_prefill_tokens=target_sched.max_prefill_tokens, max_context=target.max_context)
        group = config.swa_group
        per_token = group.num_kv_heads * (group.k_head_dim + group.v_head_dim)
        need = (sched.max_running_requests + 1) * target.max_context * per_token
        budget = min((256 << 20) if device.type == "cpu" else (4 << 30), 2 * need * dtype.itemsize + (8 << 20))
        cache = CacheConfig(kv_cache_bytes=budget, disable_prefix_cache=True)
        # No decode graphs: a captured forward would freeze the state input it reads from the batch.
        runner = RunnerConfig(disable_cuda_graph=True)
        return cls(build_runtime(config, head, device, dtype, cache, sched, runner), head)

    def attach(self, rt: Runtime) -> None:
        """Share the target's token embedding and LM head with the MTP layer; free its out-of-window
        SWA slots in the target's chunks (`swa_evict_chunk`)."""
        target = rt.runner.model
        self.head.share_target(target.model.embed_tokens, target.lm_head)
        if rt.evictor is not None and self.rt.evictor is not None:
            self.rt.evictor.chunk = rt.evictor.chunk

    # -- the drafter interface ---------------------------------------------------------------

    def observe(self, reqs: list[Req], states: torch.Tensor, offsets: list[int], counts: list[int]) -> None:
        """Keep the target's states of each speculating request's confirmed tokens; fold those whose
        next token is known into the layer's cache once FLUSH_ROWS are ready."""
        assert states.shape[1] == self.head.hidden_size, "the target's final states (no auxiliary states)"
        due = []
        for r, off, n in zip(reqs, offsets, counts):
            if n == 0 or not speculates(r.params):
                continue
            seq = self.seqs.get(r.rid)
            if seq is None:  # its first step is a prefill chunk, whose K/V length counts it already
                row = self.cache.open(r.rid)
                if row is None:
                    raise RuntimeError("the MTP layer's request table is full")  # sized like the target's
                seq = self.seqs[r.rid] = _MTPSeq(row, base=r.kv_len - n)
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
        drafts: dict[str, list[int]] = {}
        if live:
            g = self._extend([r for r, _ in live])
            for (r, _), t in zip(live, self.rt.runner.greedy_tokens(g).tolist()):
                drafts[r.rid] = [t]
            for step in range(1, max(k for _, k in live)):
                going = [(i, r) for i, (r, k) in enumerate(live) if k > step]
                g, tokens = self._chain([r for _, r in going], [drafts[r.rid][-1] for _, r in going],
                                        g[[i for i, _ in going]], step)
                for (_, r), t in zip(going, tokens):
                    drafts[r.rid].append(t)
                live = [live[i] for i, _ in going]
        return [drafts.get(r.rid, []) for r in reqs]

    def release(self, req: Req) -> None:
        if self.seqs.pop(req.rid, None) is not None:
            self.cache.close(req.rid)

    # -- the layer's cache ---------------------------------------------------------------------

    @staticmethod
    def _ready(seq: _MTPSeq, r: Req) -> int:
        """Pending positions whose next token is known (t + 1 < len(ids))."""
        return max(0, min(seq.num_pending, len(r.ids) - 1 - seq.base - seq.exact))

    @torch.inference_mode()
    def _extend(self, reqs: list[Req]) -> torch.Tensor:
        """One extend forward over each request's ready positions (the last drafts' entries dropped
        first): the layer's output `[len(reqs), hidden]` at each one's last position."""
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
        batch.scratch[HIDDEN_INPUT] = torch.cat(states)
        hidden = self.rt.runner.forward_hidden(batch)
        self.cache.evict(rows)
        return hidden

    def _chain(self, reqs: list[Req], inputs: list[int], g: torch.Tensor, step: int) -> tuple[torch.Tensor, list[int]]:
        """Draft step `step` >= 1: each request's previous draft `inputs[i]` at position len(ids) - 2 + step,
        the layer's own output `g` standing in for the target's state; (new outputs, drafts)."""
        seqs = [self.seqs[r.rid] for r in reqs]
        positions = [[len(r.ids) - 2 + step] for r in reqs]
        assert all(s.base + s.cache.length == p[0] for s, p in zip(seqs, positions))
        batch = self.cache.batch(ForwardMode.DECODE, [s.cache for s in seqs], [[t] for t in inputs], positions)
        batch.scratch[HIDDEN_INPUT] = g
        hidden = self.rt.runner.forward_hidden(batch)
        return hidden, self.rt.runner.greedy_tokens(hidden).tolist()


def num_mtp_layers_declared(hf: Any) -> int:
    """The MTP layer count a config states (the released config.json's `num_nextn_predict_layers`)."""
    return int(getattr(hf, "num_nextn_predict_layers", None) or getattr(hf, "num_mtp_layers", None) or 0)


def mtp_weights(path: Path) -> list[tuple[str, torch.Tensor]]:
    """The `model.mtp.layers.0.*` tensors of the target checkpoint at `path` (only those are read).
    Raises ValueError when it has none."""
    from safetensors import safe_open

    from swaserve.loader.safetensors import safetensors_files

    files = safetensors_files(path) if (path / "config.json").is_file() else []
    out = []
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as shard:
            for name in shard.keys():  # noqa: SIM118 (safe_open is not a dict)
                m = MTP_LAYER.match(name)
                if m is not None and m.group(1) == "0":
                    out.append((name, shard.get_tensor(name)))
    if not out:
        raise ValueError(f"speculative_method 'mtp': the MiMo-V2-Flash checkpoint at {path} has no MTP layers "
                         "(no model.mtp.layers.0.* tensors); give speculative_draft_model for another drafter "
                         "or turn speculation off")
    return out
